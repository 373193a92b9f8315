"""Combinators: chain, masked, apply_if_finite (optax names, states and semantics).

A combinator of fusable transforms is itself fusable: ``chain`` concatenates
stages, ``masked`` restricts its inner stages to the unmasked leaves, and
``apply_if_finite`` puts a gate stage before its inner stages (one read-only
pass counts non-finite updates; when rejected the inner stages are skipped,
their state is left untouched and the updates are zero).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..tree_util import tree_flatten, tree_leaves, tree_map, tree_unflatten
from .base import (FINITE_GATE, GradientTransformation, MaskedNode, Stage, safe_increment,
                   scalar, to_array, zeros_like)

__all__ = ["chain", "masked", "apply_if_finite", "MaskedState", "ApplyIfFiniteState"]


class MaskedState(NamedTuple):
    inner_state: Any


class ApplyIfFiniteState(NamedTuple):
    notfinite_count: Any
    last_finite: Any
    total_notfinite: Any
    inner_state: Any


def chain(*args: GradientTransformation) -> GradientTransformation:
    """Apply transformations in sequence; the state is the tuple of their states (optax.chain).

    >>> import ctrainstate.optim as optim
    >>> optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3)).fusable
    True
    """
    def init(params):
        return tuple(t.init(params) for t in args)

    if all(t.fusable for t in args):
        def fuse(state, ctx):
            stages, rbs = [], []
            for t, s in zip(args, state):
                st, rb = t._fuse(s, ctx)
                stages += st
                rbs.append(rb)
            return stages, lambda advance=True: tuple(rb(advance) for rb in rbs)
        return GradientTransformation(init, fuse=fuse)

    def update(updates, state, params=None):
        if len(state) != len(args):
            raise ValueError(f"chain state has {len(state)} entries for {len(args)} transforms")
        new = []
        for t, s in zip(args, state):
            updates, s = t.update(updates, s, params)
            new.append(s)
        return updates, tuple(new)
    return GradientTransformation(init, update)


def _mask_flat(mask, params):
    m = mask(params) if callable(mask) else mask
    leaves, _ = tree_flatten(params)
    if isinstance(m, bool):
        return [m] * len(leaves), m
    flat = tree_map(lambda mk, p: bool(mk), m, params)
    return tree_leaves(flat), m


def masked(inner: GradientTransformation, mask) -> GradientTransformation:
    """Apply ``inner`` only where ``mask`` (a tree of bools like params, or a callable
    params -> tree) is True; other updates pass through unchanged. State:
    MaskedState(inner_state) with MaskedNode() at masked-out leaves (optax.masked)."""
    def mask_tree(tree, m):
        return tree_map(lambda mk, x: x if mk else MaskedNode(), m, tree)

    def init(params):
        _, m = _mask_flat(mask, params)
        return MaskedState(inner_state=inner.init(mask_tree(params, m)))

    if inner.fusable:
        def fuse(state, ctx):
            flat, _ = _mask_flat(mask, ctx.params if ctx.params is not None else ctx.leaves)
            prev = ctx.push_mask(flat)
            try:
                stages, rb = inner._fuse(state.inner_state, ctx)
            finally:
                ctx.pop_mask(prev)
            return stages, lambda advance=True: MaskedState(rb(advance))
        return GradientTransformation(init, fuse=fuse)

    def update(updates, state, params=None):
        flat, m = _mask_flat(mask, params if params is not None else updates)
        mu = mask_tree(updates, m)
        mp = mask_tree(params, m) if params is not None else None
        new_u, new_s = inner.update(mu, state.inner_state, mp)
        u_leaves, td = tree_flatten(updates)
        it = iter(tree_leaves(new_u))
        return tree_unflatten(td, [next(it) if f else u for f, u in zip(flat, u_leaves)]), \
            MaskedState(new_s)
    return GradientTransformation(init, update)


def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int
                    ) -> GradientTransformation:
    """Skip the step (zero updates, inner state unchanged) when any update is not finite,
    unless more than ``max_consecutive_errors`` steps in a row were not (optax.apply_if_finite).
    State: ApplyIfFiniteState(notfinite_count, last_finite, total_notfinite, inner_state)."""
    def init(params):
        return ApplyIfFiniteState(
            notfinite_count=scalar(0, np.int32, params),
            last_finite=scalar(True, np.bool_, params),
            total_notfinite=scalar(0, np.int32, params),
            inner_state=inner.init(params))

    def counters(state, finite):
        nfc = int(np.asarray(state.notfinite_count))
        tot = int(np.asarray(state.total_notfinite))
        new_nfc = 0 if finite else safe_increment(nfc)
        return new_nfc, (tot if finite else safe_increment(tot)), \
            finite or new_nfc > max_consecutive_errors

    if inner.fusable:
        def fuse(state, ctx):
            nfc = int(np.asarray(state.notfinite_count))
            tot = int(np.asarray(state.total_notfinite))
            last = bool(np.asarray(state.last_finite))
            force = safe_increment(nfc) > max_consecutive_errors
            stages, rb = inner._fuse(state.inner_state, ctx)
            gate = Stage(FINITE_GATE, [len(stages), float(force)])

            def rebuild(advance=True):
                if not advance:
                    return ApplyIfFiniteState(
                        ctx.new_scalar(state.notfinite_count, nfc),
                        ctx.new_scalar(state.last_finite, last, np.bool_),
                        ctx.new_scalar(state.total_notfinite, tot), rb(False))
                finite = gate.result == 1.0
                new_nfc, new_tot, applied = counters(state, finite)
                return ApplyIfFiniteState(
                    ctx.new_scalar(state.notfinite_count, new_nfc),
                    ctx.new_scalar(state.last_finite, finite, np.bool_),
                    ctx.new_scalar(state.total_notfinite, new_tot), rb(applied))
            return [gate] + stages, rebuild
        return GradientTransformation(init, fuse=fuse)

    def update(updates, state, params=None):
        finite = all(bool(np.isfinite(np.asarray(u)).all()) for u in tree_leaves(updates))
        new_nfc, new_tot, applied = counters(state, finite)
        if applied:
            updates, inner_state = inner.update(updates, state.inner_state, params)
        else:
            updates = tree_map(lambda u: zeros_like(to_array(u)), updates)
            inner_state = state.inner_state
        ref = params if params is not None else updates
        return updates, ApplyIfFiniteState(
            scalar(new_nfc, np.int32, ref), scalar(finite, np.bool_, ref),
            scalar(new_tot, np.int32, ref), inner_state)
    return GradientTransformation(init, update)
