"""The implementation of :mod:`ctrainstate.optim.wrappers` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from ..array.array import Array
from ..base.tree_util import tree_flatten, tree_leaves, tree_map, tree_unflatten
from .base import (ACCUM, GradientTransformation, GradientTransformationExtraArgs, Stage,
                   call_update, read_scalar, safe_increment, scalar, zeros_like)
from ..array.abstract import ShapeDtypeStruct
from .transforms import _state_dtype

__all__ = ["MultiSteps", "MultiStepsState", "skip_not_finite", "skip_large_updates"]


class MultiStepsState(NamedTuple):
    mini_step: Any
    gradient_step: Any
    inner_opt_state: Any
    acc_grads: Any
    skip_state: Any = ()


def _host(x):
    return np.asarray(x)


def _abstract(updates) -> bool:
    """Whether ``updates`` are ShapeDtypeStructs (MultiSteps.init under eval_shape calls the
    skip function on zeros like the params, to get the skip state's structure)."""
    return any(isinstance(u, ShapeDtypeStruct) for u in tree_leaves(updates))


def _struct(dtype):
    return ShapeDtypeStruct((), dtype)


def skip_not_finite(updates, gradient_step, params):
    """Skip a mini-step whose updates hold a NaN or an inf (optax.skip_not_finite).
    Returns ``(should_skip, {'should_skip', 'num_not_finite'})``. Reads every update on the
    host (a gather of sharded Arrays)."""
    del gradient_step, params
    if _abstract(updates):
        return _struct(np.bool_), dict(should_skip=_struct(np.bool_),
                                       num_not_finite=_struct(np.int32))
    n = sum(int(np.count_nonzero(~np.isfinite(_host(u)))) for u in tree_leaves(updates))
    should_skip = np.bool_(n > 0)
    return should_skip, dict(should_skip=should_skip, num_not_finite=np.int32(n))


def skip_large_updates(updates, gradient_step, params, max_squared_norm):
    """Skip a mini-step whose updates' squared norm is not below ``max_squared_norm``
    (optax.skip_large_updates; bind it with functools.partial). Reads every update on the
    host."""
    del gradient_step, params
    if _abstract(updates):
        return _struct(np.bool_), dict(should_skip=_struct(np.bool_),
                                       norm_squared=_struct(np.float32))
    norm_sq = np.float32(sum(float(np.sum(np.square(_host(u).astype(np.float32))))
                             for u in tree_leaves(updates)))
    should_skip = np.bool_(not norm_sq < max_squared_norm)
    return should_skip, dict(should_skip=should_skip, norm_squared=norm_sq)


def _no_skip(*unused_args, **unused_kwargs):
    return np.bool_(False), ()


class MultiSteps:
    """Accumulate the updates of ``k`` consecutive mini-steps and apply ``opt`` to their mean
    (or sum) on the k-th; the other mini-steps return zero updates and leave ``opt``'s state
    alone (optax.MultiSteps). ``every_k_schedule``: an int, or a function of the gradient
    step giving k. State: ``MultiStepsState(mini_step, gradient_step, inner_opt_state,
    acc_grads, skip_state)``, the accumulator sharded like the params.

    Fused when ``opt`` is and no ``should_skip_update_fn`` is given: a mini-step is one kernel
    pass that folds the grads into the accumulator (Welford mean, as optax); the k-th pass
    continues with ``opt``'s stages on the mean, in place under ``TrainState.apply_gradients``.
    With ``should_skip_update_fn`` (``skip_not_finite``, ``skip_large_updates`` or your own
    ``(updates, gradient_step, params) -> (bool scalar, skip_state)``) the step runs unfused.
    ``accumulator_dtype`` (optax's, default float32 whatever the params' dtype; bfloat16 /
    float16 accumulators are computed in float32 and rounded once when stored; None: the
    params' dtype).
    """

    def __init__(self, opt: GradientTransformation, every_k_schedule, use_grad_mean: bool = True,
                 should_skip_update_fn: Callable | None = None, accumulator_dtype=np.float32):
        if not (callable(getattr(opt, "init", None)) and callable(getattr(opt, "update", None))):
            raise TypeError(f"MultiSteps: opt must be a GradientTransformation, got "
                            f"{type(opt).__name__}")
        self._acc_dtype = _state_dtype(accumulator_dtype, "MultiSteps: accumulator_dtype")
        if isinstance(every_k_schedule, (int, np.integer)) and not isinstance(every_k_schedule, bool):
            if every_k_schedule < 1:
                raise ValueError(f"MultiSteps: every_k_schedule={every_k_schedule}; need >= 1")
            k0 = int(every_k_schedule)
            self._every_k_schedule = lambda step: k0
        elif callable(every_k_schedule):
            self._every_k_schedule = every_k_schedule
        else:
            raise TypeError(f"MultiSteps: every_k_schedule must be an int or a function of the "
                            f"gradient step, got {type(every_k_schedule).__name__}")
        self._opt = opt
        self._use_grad_mean = bool(use_grad_mean)
        self._skip_fn = should_skip_update_fn
        self._tx = self._build()

    @property
    def inner_opt(self) -> GradientTransformation:
        return self._opt

    def init(self, params) -> MultiStepsState:
        return self._tx.init(params)

    def update(self, updates, state, params=None, **extra_args):
        """One mini-step (optax's MultiSteps.update); extra keyword arguments go to ``opt``."""
        return self._tx.update(updates, state, params, **extra_args)

    def has_updated(self, state) -> np.bool_:
        """True right after a mini-step that applied ``opt`` (mini_step 0, gradient_step > 0)."""
        return np.bool_(int(read_scalar(state.mini_step)) == 0 and
                        int(read_scalar(state.gradient_step)) > 0)

    def gradient_transformation(self) -> GradientTransformation:
        """The wrapper as a plain GradientTransformation (for chain, TrainState, ...)."""
        return self._tx

    # A MultiSteps also works where a GradientTransformation is expected (TrainState, chain).
    @property
    def fusable(self) -> bool:
        return self._tx.fusable

    @property
    def _fuse(self):
        return self._tx._fuse

    def __iter__(self):
        return iter((self.init, self.update))

    # --- implementation ---------------------------------------------------------------------

    def _k(self, gradient_step: int) -> int:
        k = int(np.asarray(self._every_k_schedule(gradient_step)))
        if k < 1:
            raise ValueError(f"MultiSteps: every_k_schedule({gradient_step}) = {k}; need >= 1")
        return k

    def _counters(self, state):
        n = int(read_scalar(state.mini_step))
        gs = int(read_scalar(state.gradient_step))
        k = self._k(gs)
        if n >= k:
            raise ValueError(f"MultiSteps: mini_step {n} is not below every_k_schedule("
                             f"{gs}) = {k}")
        return n, gs, k, n == k - 1

    def _build(self) -> GradientTransformation:
        opt, skip_fn = self._opt, self._skip_fn

        def init(params):
            gstep = scalar(0, np.int32, params)
            skip_state = ()
            if skip_fn is not None:
                _, skip_state = skip_fn(tree_map(zeros_like, params), gstep, params)
            return MultiStepsState(mini_step=scalar(0, np.int32, params), gradient_step=gstep,
                                   inner_opt_state=opt.init(params),
                                   acc_grads=tree_map(lambda p: zeros_like(p, self._acc_dtype),
                                                      params), skip_state=skip_state)

        def _check(state):
            if not isinstance(state, MultiStepsState):
                raise TypeError(f"MultiSteps: expected a MultiStepsState, got "
                                f"{type(state).__name__} (was it built by this init?)")

        if getattr(opt, "fusable", False) and skip_fn is None:
            def fuse(state, ctx):
                _check(state)
                n, gs, k, emit = self._counters(state)
                acc, acc_rb = ctx.slot(state.acc_grads)
                stages = [Stage(ACCUM, [n + 1, float(emit), float(not self._use_grad_mean)],
                                [acc], ctx.snapshot())]
                if emit:
                    inner, inner_rb = opt._fuse(state.inner_opt_state, ctx)
                    stages += inner
                else:
                    def inner_rb(advance=True):
                        return ctx.keep(state.inner_opt_state)

                def rebuild(advance=True):
                    new_n = (n + 1) % k if advance else n
                    new_gs = safe_increment(gs) if (advance and emit) else gs
                    return MultiStepsState(ctx.new_scalar(state.mini_step, new_n),
                                           ctx.new_scalar(state.gradient_step, new_gs),
                                           inner_rb(advance), acc_rb(), ctx.keep(state.skip_state))
                return stages, rebuild
            return GradientTransformationExtraArgs(init, fuse=fuse)

        def update(updates, state, params=None, **extra_args):
            _check(state)
            n, gs, k, emit = self._counters(state)
            ref = params if params is not None else updates
            if skip_fn is not None:
                should_skip, skip_state = skip_fn(updates, state.gradient_step, params)
                should_skip = np.asarray(should_skip)
                if (should_skip.dtype, should_skip.shape) != (np.bool_, ()):
                    raise ValueError(
                        "The `should_skip_update_fn` function should return a boolean scalar "
                        f"array, but it returned an array of dtype {should_skip.dtype} and "
                        f"shape {should_skip.shape}")
                if bool(should_skip):
                    return tree_map(zeros_like, updates), state._replace(skip_state=skip_state)
            else:
                skip_state = state.skip_state
            u_leaves, td = tree_flatten(updates)
            a_leaves = tree_leaves(state.acc_grads)
            if len(a_leaves) != len(u_leaves):
                raise ValueError(f"MultiSteps: the updates have {len(u_leaves)} leaves, the "
                                 f"accumulator {len(a_leaves)}")
            n1 = np.float32(n + 1)
            acc = []
            for g, a in zip(u_leaves, a_leaves):
                if not isinstance(g, Array):
                    g = np.asarray(g, np.float32)
                    a = np.asarray(a)
                new = g + a if not self._use_grad_mean else a + (g - a) / n1
                acc.append(new.astype(a.dtype) if new.dtype != a.dtype else new)
            acc = tree_unflatten(td, acc)
            if emit:
                out, inner_state = call_update(opt, acc, state.inner_opt_state, params,
                                               extra_args)
                new_acc = tree_map(zeros_like, acc)
            else:
                out, inner_state = tree_map(zeros_like, updates), state.inner_opt_state
                new_acc = acc
            return out, MultiStepsState(
                scalar((n + 1) % k, np.int32, ref),
                scalar(safe_increment(gs) if emit else gs, np.int32, ref),
                inner_state, new_acc, skip_state)
        return GradientTransformationExtraArgs(init, update)


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
