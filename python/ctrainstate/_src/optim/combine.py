"""The implementation of :mod:`ctrainstate.optim.combine` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations
from ..base.hooks import provide as _provide
_provide('optim.combine', __name__)   # lower layers call into this module through _hooks.upper

from typing import Any, NamedTuple

import numpy as np

from ..base.tree_util import (_flatten_up_to, tree_flatten, tree_leaves, tree_map,
                              tree_structure, tree_unflatten)
from .base import (FINITE_GATE, ZERO, GradientTransformation, GradientTransformationExtraArgs,
                   MaskedNode, Stage, call_update, read_scalar, safe_increment, scalar, to_array,
                   zeros_like)
from .transforms import _expect_state, set_to_zero
from .utils import _ParamsPlaceholder
from .base import run_fused

__all__ = ["chain", "masked", "partition", "multi_transform", "freeze", "apply_if_finite",
           "MaskedState", "PartitionState", "MultiTransformState", "ApplyIfFiniteState",
           "conditionally_mask", "ConditionallyMaskState"]


class MaskedState(NamedTuple):
    inner_state: Any


class PartitionState(NamedTuple):
    inner_states: Any


MultiTransformState = PartitionState


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

    def check(state):
        # optax raises here too; without the check the fused path's zip() would silently
        # drop the transforms that have no state entry
        try:
            n = len(state)
        except TypeError:
            n = None
        if n != len(args):
            got = f"{n} entries" if n is not None else f"a {type(state).__name__}"
            raise ValueError(f"The number of updates and states has to be the same in chain: "
                             f"the state has {got} for {len(args)} transforms. Make sure "
                             f"you have called init first!")

    if all(getattr(t, "fusable", False) for t in args):
        def fuse(state, ctx):
            check(state)
            stages, rbs = [], []
            for t, s in zip(args, state):
                st, rb = t._fuse(s, ctx)
                stages += st
                rbs.append(rb)
            return stages, lambda advance=True: tuple(rb(advance) for rb in rbs)
        return GradientTransformationExtraArgs(init, fuse=fuse)

    def update(updates, state, params=None, **extra_args):
        check(state)
        new = []
        for t, s in zip(args, state):
            updates, s = call_update(t, updates, s, params, extra_args)
            new.append(s)
        return updates, tuple(new)
    return GradientTransformationExtraArgs(init, update)


def _mask_callable(mask) -> bool:
    """Whether ``mask`` is a mask function (optax's rule): every leaf of
    ``tree_map(callable, mask)`` is true, and there is at least one. A callable object that
    is a pytree with leaves (a callable container of bools) is a mask tree."""
    leaves = tree_leaves(tree_map(callable, mask))
    return len(leaves) > 0 and all(leaves)


def _mask_flat(mask, params):
    """(one bool per leaf of params, the mask tree). The mask may be a bool, a tree like
    params, or a prefix of it (a leaf of the mask then covers a whole subtree, as optax),
    or a function of the params giving one."""
    m = mask(params) if _mask_callable(mask) else mask
    leaves, _ = tree_flatten(params)
    if isinstance(m, (bool, np.bool_)):
        return [bool(m)] * len(leaves), m
    m_leaves, m_def = tree_flatten(m)
    try:
        subtrees = _flatten_up_to(m_def, params)
    except ValueError as e:
        raise ValueError(f"the mask is neither the params' tree nor a prefix of it: {e}") from None
    flat = []
    for mk, sub in zip(m_leaves, subtrees):
        flat += [bool(mk)] * len(tree_leaves(sub))
    return flat, m


def masked(inner: GradientTransformation, mask, *, mask_compatible_extra_args: bool = False
           ) -> GradientTransformation:
    """Apply ``inner`` only where ``mask`` (a tree of bools like params, or a callable
    params -> tree) is True; other updates pass through unchanged. State:
    MaskedState(inner_state) with MaskedNode() at masked-out leaves (optax.masked).

    A callable ``mask`` that is a pytree with leaves (a callable container of bools) is a
    mask tree, not a mask function (optax's rule). Extra keyword arguments of ``update`` go
    to ``inner``; with ``mask_compatible_extra_args`` those that have the updates' tree
    structure are masked like the updates first."""
    def mask_tree(tree, m):
        return tree_map(lambda mk, x: x if mk else MaskedNode(), m, tree)

    def mask_extra(extra_args, updates, m):
        if not (mask_compatible_extra_args and extra_args):
            return extra_args
        td = tree_structure(updates)
        return {k: mask_tree(v, m) if tree_structure(v) == td else v
                for k, v in extra_args.items()}

    def init(params):
        if isinstance(params, _ParamsPlaceholder):
            # tree_map_params calls init on a placeholder to find the params-shaped trees of
            # the state: the inner init sees it unmasked (optax's workaround too)
            return MaskedState(inner_state=inner.init(params))
        _, m = _mask_flat(mask, params)
        return MaskedState(inner_state=inner.init(mask_tree(params, m)))

    if getattr(inner, "fusable", False):
        def fuse(state, ctx):
            _expect_state(state, MaskedState, "masked")
            flat, _ = _mask_flat(mask, ctx.params if ctx.params is not None else ctx.tree)
            prev = ctx.push_mask(flat)
            try:
                stages, rb = inner._fuse(state.inner_state, ctx)
            finally:
                ctx.pop_mask(prev)
            return stages, lambda advance=True: MaskedState(rb(advance))
        return GradientTransformationExtraArgs(init, fuse=fuse)

    def update(updates, state, params=None, **extra_args):
        _expect_state(state, MaskedState, "masked")
        flat, m = _mask_flat(mask, params if params is not None else updates)
        mu = mask_tree(updates, m)
        mp = mask_tree(params, m) if params is not None else None
        new_u, new_s = call_update(inner, mu, state.inner_state, mp,
                                   mask_extra(extra_args, updates, m))
        u_leaves, td = tree_flatten(updates)
        it = iter(tree_leaves(new_u))
        return tree_unflatten(td, [next(it) if f else u for f, u in zip(flat, u_leaves)]), \
            MaskedState(new_s)
    return GradientTransformationExtraArgs(init, update)


def freeze(mask) -> GradientTransformation:
    """Zero the updates where ``mask`` is True (optax.freeze): ``masked(set_to_zero(), mask)``.

    >>> import numpy as np, ctrainstate.optim as optim
    >>> p = {'frozen': np.ones(2, np.float32), 'w': np.ones(2, np.float32)}
    >>> tx = optim.chain(optim.freeze({'frozen': True, 'w': False}), optim.sgd(0.5))
    >>> u, _ = tx.update(p, tx.init(p), p)
    >>> np.asarray(u['frozen']).tolist(), np.asarray(u['w']).tolist()  # 0 * -0.5, as optax
    ([-0.0, -0.0], [-0.5, -0.5])
    """
    return masked(set_to_zero(), mask)


def partition(transforms, param_labels, *, mask_compatible_extra_args: bool = False
              ) -> GradientTransformation:
    """Apply a different transformation to each labelled subset of the params
    (optax.partition, also named multi_transform).

    ``transforms`` maps labels to transformations; ``param_labels`` is a tree of labels
    like the params (or a prefix of it), or a function params -> such a tree. Every label
    must have a transformation. State: ``PartitionState(inner_states={label:
    MaskedState(...)})``. Fused when every transformation is: each runs as a masked group
    of stages of the same kernel pass.

    >>> import numpy as np, ctrainstate.optim as optim
    >>> p = {'b': np.ones(2, np.float32), 'w': np.ones(2, np.float32)}
    >>> tx = optim.partition({'w': optim.adam(0.1), 'b': optim.sgd(0.5)}, {'b': 'b', 'w': 'w'})
    >>> u, st = tx.update(p, tx.init(p), p)
    >>> np.asarray(u['b']).tolist(), sorted(st.inner_states)
    ([-0.5, -0.5], ['b', 'w'])
    """
    if not hasattr(transforms, "items"):
        raise TypeError(f"partition: transforms must be a mapping from labels to "
                        f"GradientTransformations, got {type(transforms).__name__}")
    transforms = dict(transforms)
    for label, tx in transforms.items():
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise TypeError(f"partition: transforms[{label!r}] is a {type(tx).__name__}, not a "
                            f"GradientTransformation")

    def labels_of(tree):
        return param_labels(tree) if callable(param_labels) else param_labels

    def check(tree):
        found = set(tree_leaves(labels_of(tree)))
        missing = found - set(transforms)
        if missing:
            raise ValueError(
                "Some parameters have no corresponding transformation.\n"
                f"Parameter labels: {sorted(found, key=repr)} \n"
                f"Transforms keys: {sorted(transforms, key=repr)} \n"
                f"(no transformation for {sorted(missing, key=repr)})")

    def group_mask(label):
        return lambda tree: tree_map(lambda lb: lb == label, labels_of(tree))

    inner = {label: masked(tx, group_mask(label),
                           mask_compatible_extra_args=mask_compatible_extra_args)
             for label, tx in transforms.items()}

    def init(params):
        check(params)
        return PartitionState({label: t.init(params) for label, t in inner.items()})

    def _state_of(state, label):
        try:
            return state.inner_states[label]
        except (AttributeError, KeyError, TypeError):
            raise ValueError(f"partition: the state has no entry for label {label!r}: was it "
                             f"built by this transformation's init?") from None

    if all(getattr(t, "fusable", False) for t in transforms.values()):
        def fuse(state, ctx):
            check(ctx.params if ctx.params is not None else ctx.tree)
            stages, rbs = [], {}
            for label, t in inner.items():
                st, rb = t._fuse(_state_of(state, label), ctx)
                stages += st
                rbs[label] = rb
            return stages, lambda advance=True: PartitionState(
                {label: rb(advance) for label, rb in rbs.items()})
        return GradientTransformationExtraArgs(init, fuse=fuse)

    def update(updates, state, params=None, **extra_args):
        check(updates)
        new = {}
        for label, t in inner.items():
            updates, new[label] = t.update(updates, _state_of(state, label), params,
                                           **extra_args)
        return updates, PartitionState(new)
    return GradientTransformationExtraArgs(init, update)


multi_transform = partition


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
        nfc = int(read_scalar(state.notfinite_count))
        tot = int(read_scalar(state.total_notfinite))
        new_nfc = 0 if finite else safe_increment(nfc)
        return new_nfc, (tot if finite else safe_increment(tot)), \
            finite or new_nfc > max_consecutive_errors

    if getattr(inner, "fusable", False):
        def fuse(state, ctx):
            _expect_state(state, ApplyIfFiniteState, "apply_if_finite")
            nfc = int(read_scalar(state.notfinite_count))
            tot = int(read_scalar(state.total_notfinite))
            last = bool(read_scalar(state.last_finite))
            force = safe_increment(nfc) > max_consecutive_errors
            stages, rb = inner._fuse(state.inner_state, ctx)
            # the gate checks, and when it rejects zeroes, only the leaves the enclosing
            # masks leave to it (optax: apply_if_finite inside masked sees those only)
            gate = Stage(FINITE_GATE, [len(stages), float(force)], active=ctx.snapshot())

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
        return GradientTransformationExtraArgs(init, fuse=fuse)

    def update(updates, state, params=None, **extra_args):
        _expect_state(state, ApplyIfFiniteState, "apply_if_finite")
        finite = all(bool(np.isfinite(np.asarray(u)).all()) for u in tree_leaves(updates))
        new_nfc, new_tot, applied = counters(state, finite)
        if applied:
            updates, inner_state = call_update(inner, updates, state.inner_state, params,
                                               extra_args)
        else:
            updates = tree_map(lambda u: zeros_like(to_array(u)), updates)
            inner_state = state.inner_state
        ref = params if params is not None else updates
        return updates, ApplyIfFiniteState(
            scalar(new_nfc, np.int32, ref), scalar(finite, np.bool_, ref),
            scalar(new_tot, np.int32, ref), inner_state)
    return GradientTransformationExtraArgs(init, update)


class ConditionallyMaskState(NamedTuple):
    """State of :func:`conditionally_mask` (optax.ConditionallyMaskState)."""
    step: Any
    inner_state: Any


def conditionally_mask(inner: GradientTransformation, should_transform_fn,
                       forward_extra_args: bool = False) -> GradientTransformation:
    """Run ``inner`` at the steps where ``should_transform_fn(step)`` is true; at the others
    the updates are zero and ``inner``'s state is left as it is (optax.conditionally_mask).
    ``step`` counts every call (both kinds) from 0 and is given to the function as a
    numpy int32 scalar (optax: a traced int32); the function returns a bool scalar.
    ``forward_extra_args``: the extra keyword arguments of ``update`` are passed to the
    function too. State: ConditionallyMaskState(step, inner_state).

    The condition is evaluated on the host before the step, so a fusable ``inner`` keeps
    the whole transformation fusable: a rejected step runs a zeroing stage instead of
    ``inner``'s stages (``TrainState.apply_gradients`` in place)."""
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(f"conditionally_mask: inner must be a GradientTransformation, got "
                        f"{type(inner).__name__}")
    if not callable(should_transform_fn):
        raise TypeError(f"conditionally_mask: should_transform_fn must be a function of the "
                        f"step, got {type(should_transform_fn).__name__}")

    def init(params):
        return ConditionallyMaskState(step=scalar(0, np.int32, params),
                                      inner_state=inner.init(params))

    def decide(step, kwargs):
        out = should_transform_fn(np.int32(step), **kwargs)
        shape = getattr(out, "shape", ())
        if tuple(shape) != ():
            raise ValueError(f"conditionally_mask: should_transform_fn must return a bool "
                             f"scalar, got an array of shape {tuple(shape)}")
        return bool(np.asarray(out))

    if getattr(inner, "fusable", False):
        def fuse(state, ctx):
            _expect_state(state, ConditionallyMaskState, "conditionally_mask")
            step = int(read_scalar(state.step))
            if decide(step, {}):
                stages, rb = inner._fuse(state.inner_state, ctx)
            else:
                stages = [Stage(ZERO, [], active=ctx.snapshot())]

                def rb(advance=True):
                    return ctx.keep(state.inner_state)

            def rebuild(advance=True):
                return ConditionallyMaskState(
                    ctx.new_scalar(state.step, safe_increment(step) if advance else step),
                    rb(advance))
            return stages, rebuild
    else:
        fuse = None

    def update(updates, state, params=None, **extra_args):
        _expect_state(state, ConditionallyMaskState, "conditionally_mask")
        step = int(read_scalar(state.step))
        if fuse is not None and not extra_args:
            return run_fused(tx, updates, state, params, inplace=False)
        if decide(step, extra_args if forward_extra_args else {}):
            updates, inner_state = call_update(inner, updates, state.inner_state, params,
                                               extra_args)
        else:
            updates = tree_map(lambda u: zeros_like(to_array(u)), updates)
            inner_state = state.inner_state
        return updates, ConditionallyMaskState(
            scalar(safe_increment(step), np.int32,
                   sharding=getattr(state.step, "sharding", None)), inner_state)
    tx = GradientTransformationExtraArgs(init, update, fuse=fuse)
    return tx


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
