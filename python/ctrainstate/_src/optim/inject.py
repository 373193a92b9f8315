"""The implementation of :mod:`ctrainstate.optim.inject` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, NamedTuple

import numpy as np

from ..array.array import Array
from .base import (GradientTransformation, GradientTransformationExtraArgs, call_update,
                   read_scalar, safe_increment, scalar)

__all__ = ["inject_hyperparams", "InjectHyperparamsState", "InjectStatefulHyperparamsState",
           "WrappedScheduleState"]


class InjectHyperparamsState(NamedTuple):
    count: Any
    hyperparams: Any
    inner_state: Any


class InjectStatefulHyperparamsState(NamedTuple):
    count: Any
    hyperparams: Any
    hyperparams_states: Any
    inner_state: Any


class WrappedScheduleState(NamedTuple):
    count: Any


def _to_host(v):
    """A hyper-parameter as the inner factory receives it: a numpy scalar (float32 for floats,
    integers unchanged), read from an Array when the state holds one."""
    if isinstance(v, Array):
        v = read_scalar(v)
    a = np.asarray(v)
    if a.shape != ():
        raise ValueError(f"inject_hyperparams: hyper-parameters are scalars; got shape {a.shape}")
    if np.issubdtype(a.dtype, np.floating):
        return np.float32(a)
    return a[()]


def inject_hyperparams(inner_factory: Callable[..., GradientTransformation], static_args=(),
                       hyperparam_dtype=None) -> Callable[..., GradientTransformation]:
    """Wrap an optimizer factory so that its numeric and scheduled arguments live in the state.

    ``inject_hyperparams(optim.adamw)(learning_rate=schedule, weight_decay=0.01)`` is an
    optimizer whose state is ``InjectStatefulHyperparamsState(count, hyperparams,
    hyperparams_states, inner_state)``: ``hyperparams`` maps each numeric or scheduled
    argument to its current value (a replicated float32 scalar Array), ``hyperparams_states``
    each scheduled one to ``WrappedScheduleState(count)``. Each step rebuilds the inner
    optimizer from the stored values (schedules evaluated at their count), so assigning
    ``state.hyperparams['learning_rate'] = 1e-4`` between steps changes the rate, as in optax.
    Booleans, ``static_args`` and non-numeric arguments are fixed. Fused when the inner
    optimizer is. ``hyperparam_dtype``: only float32 (the fused kernel's precision).
    """
    static_args = {static_args} if isinstance(static_args, str) else set(static_args)
    signature = inspect.signature(inner_factory)
    if not static_args.issubset(signature.parameters):
        raise ValueError(
            "`static_args` must specify a subset of `inner_factory`'s parameters. Given "
            f"`static_args`: {static_args}. `inner_factory` parameters: "
            f"{set(signature.parameters)}")
    if hyperparam_dtype is not None and np.dtype(hyperparam_dtype) != np.float32:
        raise NotImplementedError(
            f"inject_hyperparams: hyperparam_dtype={np.dtype(hyperparam_dtype)}; ctrainstate "
            f"keeps hyper-parameters in float32")

    @functools.wraps(inner_factory)
    def wrapped(*args, **kwargs) -> GradientTransformation:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        sched, numeric, other = {}, {}, {}
        for name, value in bound.arguments.items():
            if name in static_args or isinstance(value, (bool, np.bool_)):
                other[name] = value
            elif callable(value):
                sched[name] = value
            elif isinstance(value, (int, float, np.ndarray, np.number, Array)):
                numeric[name] = value
            else:
                other[name] = value

        def current(state):
            hp = {k: _to_host(v) for k, v in state.hyperparams.items()}
            for k, f in sched.items():
                hp[k] = _to_host(f(int(read_scalar(state.hyperparams_states[k].count))))
            return hp

        def make(hp):
            return inner_factory(**other, **hp)

        def new_state(state, hp, inner_state, advance, ref, inplace_scalar=None):
            def put(old, value, dtype):
                if inplace_scalar is not None:
                    return inplace_scalar(old, value, dtype)
                return scalar(value, dtype, ref,
                              sharding=getattr(old, "sharding", None))
            c = int(read_scalar(state.count))
            if not advance:
                # a step that did not happen (rejected by an enclosing apply_if_finite): the
                # state stays as it was, the stored values included (optax keeps the old
                # inner state), not this step's schedule values
                hp = {k: _to_host(state.hyperparams[k]) if k in state.hyperparams else v
                      for k, v in hp.items()}
            hyper = {k: put(state.hyperparams.get(k), hp[k],
                            np.float32 if isinstance(hp[k], np.floating) else np.asarray(hp[k]).dtype)
                     for k in hp}
            hstates = {}
            for k in sched:
                old = state.hyperparams_states[k].count
                n = int(read_scalar(old))
                hstates[k] = WrappedScheduleState(put(old, safe_increment(n) if advance else n,
                                                      np.int32))
            return InjectStatefulHyperparamsState(
                put(state.count, safe_increment(c) if advance else c, np.int32), hyper, hstates,
                inner_state)

        def init(params):
            hp = {k: _to_host(v) for k, v in numeric.items()}
            for k, f in sched.items():
                hp[k] = _to_host(f(0))
            return InjectStatefulHyperparamsState(
                count=scalar(0, np.int32, params),
                hyperparams={k: scalar(v, np.asarray(v).dtype, params) for k, v in hp.items()},
                hyperparams_states={k: WrappedScheduleState(scalar(0, np.int32, params))
                                    for k in sched},
                inner_state=make(hp).init(params))

        def _check(state):
            if not isinstance(state, InjectStatefulHyperparamsState):
                raise TypeError(f"inject_hyperparams: expected an InjectStatefulHyperparamsState, "
                                f"got {type(state).__name__} (was the state built by this "
                                f"optimizer's init?)")

        probe = make({k: _to_host(v) for k, v in numeric.items()}
                     | {k: _to_host(f(0)) for k, f in sched.items()})

        if probe.fusable:
            def fuse(state, ctx):
                _check(state)
                hp = current(state)
                inner = make(hp)
                if not inner.fusable:
                    raise TypeError("inject_hyperparams: the inner optimizer stopped being "
                                    "fusable for these hyper-parameter values")
                stages, rb = inner._fuse(state.inner_state, ctx)

                def rebuild(advance=True):
                    return new_state(state, hp, rb(advance), advance, ctx.params,
                                     inplace_scalar=lambda old, v, dt: ctx.new_scalar(old, v, dt))
                return stages, rebuild
            return GradientTransformationExtraArgs(init, fuse=fuse)

        def update(updates, state, params=None, **extra_args):
            _check(state)
            hp = current(state)
            updates, inner_state = call_update(make(hp), updates, state.inner_state, params,
                                               extra_args)
            return updates, new_state(state, hp, inner_state, True,
                                      params if params is not None else updates)
        return GradientTransformationExtraArgs(init, update)
    return wrapped


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
