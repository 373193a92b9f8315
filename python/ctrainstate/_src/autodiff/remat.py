"""Rematerialisation: ``checkpoint`` / ``remat`` (mirror of ``jax.checkpoint``).

Inside ``value_and_grad``, every op records its inputs and output on the tape, so the
activations of a deep model stay alive until the backward pass. ``checkpoint(fn)`` runs
``fn`` so that none of its intermediate values are kept: the tape keeps only ``fn``'s
inputs (its arguments and the tracked Arrays it reads, e.g. parameters) and outputs. When
the backward pass reaches ``fn``'s outputs, ``fn`` is run again on the same inputs with
recording on, and its gradients are taken through that second run. Values and gradients
are exactly those without ``checkpoint`` (every op is deterministic and keys are
explicit); what changes is peak memory (the intermediates of one checkpointed call at a
time) and time (a second forward of ``fn``).

Outside ``value_and_grad`` there is nothing to save and ``checkpoint(fn)`` is ``fn``.

>>> import numpy as np, ctrainstate as cts, ctrainstate.numpy as cnp
>>> block = cts.checkpoint(lambda x: cnp.sin(cnp.sin(x)))
>>> g = cts.grad(lambda x: cnp.sum(block(x)))(np.array([0.5, 1.0], np.float32))
>>> np.allclose(np.asarray(g), np.cos(np.sin([0.5, 1.0])) * np.cos([0.5, 1.0]))
True
"""
from __future__ import annotations

import contextlib
import functools
import threading
import types
from typing import Callable

from ..array.array import Array
from ..base.tree_util import tree_flatten
from ..ops import ops as _ops
from ..array import sharding
from ..base.precision import current_default, default_mode
from ..base.hooks import upper as _upper

__all__ = ["checkpoint", "remat", "checkpoint_policies"]


# --- policies ---------------------------------------------------------------------------------

def _policy(name: str, saves_everything: bool = False):
    def policy(*_args, **_kwargs):
        return saves_everything
    policy.__name__ = policy.__qualname__ = name
    policy._ct_saves_everything = saves_everything
    return policy


def _policy_factory(name: str):
    def factory(*names, **_kwargs):
        p = _policy(f"{name}({', '.join(map(repr, names))})")
        return p
    factory.__name__ = factory.__qualname__ = name
    return factory


checkpoint_policies = types.SimpleNamespace(
    nothing_saveable=_policy("nothing_saveable"),
    everything_saveable=_policy("everything_saveable", saves_everything=True),
    dots_saveable=_policy("dots_saveable"),
    checkpoint_dots=_policy("checkpoint_dots"),
    dots_with_no_batch_dims_saveable=_policy("dots_with_no_batch_dims_saveable"),
    checkpoint_dots_with_no_batch_dims=_policy("checkpoint_dots_with_no_batch_dims"),
    save_only_these_names=_policy_factory("save_only_these_names"),
    save_any_names_but_these=_policy_factory("save_any_names_but_these"),
    save_anything_except_these_names=_policy_factory("save_anything_except_these_names"),
)
checkpoint_policies.__doc__ = (
    "jax.checkpoint_policies' names. ctrainstate saves nothing but a checkpointed call's "
    "inputs and outputs under every policy except ``everything_saveable`` (which saves all, "
    "i.e. no rematerialisation): values and gradients are the same under any policy, only "
    "memory and time differ.")


def _check_policy(policy):
    if policy is not None and not callable(policy):
        raise TypeError(f"checkpoint: policy must be a callable such as "
                        f"checkpoint_policies.nothing_saveable or None, got {policy!r}")
    return bool(getattr(policy, "_ct_saves_everything", False))


def _check_static(static_argnums, who):
    nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    for n in nums:
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"{who}: static_argnums must be ints, got {static_argnums!r}")
    return nums


# --- the tape around a checkpointed call -------------------------------------------------------

class _Chain:
    """A set of ids seen through an outer tape's set: adds go to ``own`` only."""

    def __init__(self, outer):
        self.outer = outer
        self.own: set = set()

    def __contains__(self, k):
        return k in self.own or k in self.outer

    def add(self, k):
        self.own.add(k)


_rerun = threading.local()


def in_rerun() -> bool:
    """True while a checkpointed function is being run again for the backward pass."""
    return getattr(_rerun, "depth", 0) > 0


def _capture_context():
    """The thread's mesh context (``with mesh:`` stack and ``set_mesh``) and logical axis
    rules: what a checkpointed function may read, which the backward pass must give back to
    its second run (the forward may have entered them inside the differentiated function)."""
    spmd = _upper('nn.spmd')
    return (list(sharding._mesh_stack()), sharding._mesh_tls.__dict__.get("set"),
            spmd.get_logical_axis_rules())


@contextlib.contextmanager
def _entered(context):
    spmd = _upper('nn.spmd')
    saved = _capture_context()
    stack, mset, rules = context
    sharding._mesh_stack()[:] = stack
    _put_mesh_set(sharding, mset)
    spmd.set_logical_axis_rules(rules)
    try:
        yield
    finally:
        stack, mset, rules = saved
        sharding._mesh_stack()[:] = stack
        _put_mesh_set(sharding, mset)
        spmd.set_logical_axis_rules(rules)


def _put_mesh_set(sharding, mset):
    if mset is None:
        if "set" in sharding._mesh_tls.__dict__:   # (deleted as an attribute: see threadlocal)
            del sharding._mesh_tls.set
    else:
        sharding._mesh_tls.set = mset


def remat_call(fn: Callable, args: tuple, kwargs: dict, before_rerun=None, after_rerun=None):
    """Run ``fn(*args, **kwargs)`` on the active tape without keeping its intermediates
    (see the module docstring). ``before_rerun()`` returns a token passed to
    ``after_rerun(token)``: hooks that put caller state (e.g. a module's RNG counters) back
    as it was at the first run while the second one runs."""

    outer = _ops._tape()
    if outer is None:
        return fn(*args, **kwargs)
    # the second run multiplies as the first did, also where the backward pass runs outside
    # the default_matmul_precision block the forward ran in (jax fixes it when tracing)
    matmul_default = current_default()
    context = _capture_context()  # likewise the mesh and the logical axis rules
    # 1. forward: a probe tape that sees the outer tape's tracked arrays, so every op that
    #    depends on them is noticed (and their identities collected), then dropped
    probe = _ops._Tape()
    probe.tracked = _Chain(outer.tracked)
    probe.outer = outer.outer   # inside a nested value_and_grad: its guard applies here too
    stack = _ops._tls.tapes
    stack.append(probe)
    try:
        res = fn(*args, **kwargs)
    finally:
        stack.pop()
    inputs, seen = [], set()
    for node in probe.nodes:
        for x in (node.inputs if type(node) is _ops._Group else node[1]):
            if isinstance(x, Array) and id(x) in outer.tracked and id(x) not in seen:
                seen.add(id(x))
                inputs.append(x)
    leaves, treedef = tree_flatten(res)
    outs = [(k, x) for k, x in enumerate(leaves)
            if isinstance(x, Array) and id(x) in probe.tracked.own]
    del probe  # the intermediates go with it
    if not outs:
        return res
    # 2. one tape node for all outputs: when the backward pass reaches it (every consumer
    #    of every output is done), fn runs again and the backward pass continues through
    #    that run from the outputs' cotangents and the inputs' cotangents so far -- the
    #    same additions in the same order as without checkpoint, so the same bits
    def vjp(gs, prev):
        token = before_rerun() if before_rerun is not None else None
        tape = _ops._Tape()
        for x in inputs:
            tape.track(x)
        stack = _ops._tls.tapes
        stack.append(tape)
        _rerun.depth = getattr(_rerun, "depth", 0) + 1
        try:
            with default_mode(matmul_default), _entered(context):
                res2 = fn(*args, **kwargs)
        finally:
            _rerun.depth -= 1
            stack.pop()
            if after_rerun is not None:
                after_rerun(token)
        leaves2, treedef2 = tree_flatten(res2)
        if treedef2 != treedef or any(
                isinstance(a, Array) != isinstance(b, Array)
                or (isinstance(a, Array) and (a.shape, a.dtype) != (b.shape, b.dtype))
                for a, b in zip(leaves, leaves2)):
            raise RuntimeError(
                "checkpoint: the function returned a different structure when run again for "
                "the backward pass; a checkpointed function must be deterministic")
        seeds = {id(x): p for x, p in zip(inputs, prev) if p is not None}
        for (k, _), g in zip(outs, gs):
            o = leaves2[k]
            if g is not None and isinstance(o, Array) and id(o) in tape.tracked:
                seeds[id(o)] = g if id(o) not in seeds else _ops._binary_raw(
                    _ops.B_ADD, seeds[id(o)], g)
        cot = _ops._backward(tape, None, seeds=seeds)
        return [cot.get(id(x)) for x in inputs]

    for _, out in outs:
        outer.track(out)
    outer.nodes.append(_ops._Group([o for _, o in outs], inputs, vjp))
    return res


# --- the public transform -------------------------------------------------------------------

def checkpoint(fun: Callable | None = None, *, prevent_cse: bool = True, policy=None,
               static_argnums=(), static_argnames=()):
    """Like ``jax.checkpoint`` (alias ``remat``): ``fun`` whose intermediate values are not
    kept for the backward pass but recomputed there (see the module docstring).

    ``prevent_cse`` and ``static_argnums``/``static_argnames`` are accepted for jax's
    signature and change nothing (ctrainstate does not trace or fuse). ``policy``: any of
    :data:`checkpoint_policies`; all save only the call's inputs and outputs except
    ``everything_saveable``, which saves everything (no recomputation). Usable as a
    decorator with or without arguments.
    """
    if fun is None:
        return functools.partial(checkpoint, prevent_cse=prevent_cse, policy=policy,
                                 static_argnums=static_argnums, static_argnames=static_argnames)
    if not callable(fun):
        raise TypeError(f"checkpoint: expected a function, got {type(fun).__name__}")
    saves_all = _check_policy(policy)
    _check_static(static_argnums, "checkpoint")

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        if saves_all:
            return fun(*args, **kwargs)
        return remat_call(fun, args, kwargs)
    return wrapped


remat = checkpoint
