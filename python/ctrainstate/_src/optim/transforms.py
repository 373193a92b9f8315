"""The implementation of :mod:`ctrainstate.optim.transforms` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import functools
import numbers
from typing import Any, NamedTuple

import numpy as np

from ... import _C

from ..base.tree_util import tree_flatten, tree_leaves, tree_map, tree_unflatten
from ..base import dtypes as _dtypes
from ..array.array import Array
from .base import (ADAM, ADAMAX, AMSGRAD, BELIEF, STDDEV, YOGI, BLOCK_RMS, CLIP, DECAY, EMA, FACTORED, GLOBAL_NORM, LION, PARAM_RMS,
                   RMS, RSS, SCALE, TRACE, TRUST_RATIO, ZERO, EmptyState, GradientTransformation,
                   GradientTransformationExtraArgs, Stage, CONST, _scalar_sharding, full_like, identity,
                   safe_increment, scalar, to_array, zeros_like, _INT32_MAX)
from ..ops import ops as _ops
from ..random import core as _random
from ..numpy_lax import numpy as cnp
from ..array.abstract import ShapeDtypeStruct
from ..array.array import device_put as _put
from .base import read_scalar
from .utils import safe_norm
from ..array.sharding import NamedSharding, PartitionSpec
from ..base.hooks import upper as _upper

__all__ = [
    "ScaleByAdamState", "ScaleByLionState", "ScaleByRmsState", "ScaleByRmsWithCountState",
    "ScaleByRssState", "ScaleByScheduleState", "TraceState", "EmaState", "WeightDecaySchedule",
    "FactoredState", "scale", "scale_by_adam", "scale_by_lion", "scale_by_rms", "scale_by_rss",
    "trace", "ema", "add_decayed_weights", "clip", "clip_by_global_norm", "scale_by_trust_ratio",
    "scale_by_learning_rate", "scale_by_schedule", "scale_by_factored_rms", "clip_by_block_rms",
    "scale_by_param_block_rms", "set_to_zero", "ScaleByBeliefState", "scale_by_belief",
    "scale_by_yogi", "scale_by_radam", "AddNoiseState", "add_noise", "ScaleByRStdDevState",
    "ScaleByRStdDevWithCountState", "scale_by_stddev", "scale_by_adamax", "ScaleByAmsgradState",
    "scale_by_amsgrad",
]

_f32 = np.float32


class ScaleByAdamState(NamedTuple):
    count: Any
    mu: Any
    nu: Any


class ScaleByAmsgradState(NamedTuple):
    count: Any
    mu: Any
    nu: Any
    nu_max: Any


class ScaleByBeliefState(NamedTuple):
    count: Any
    mu: Any
    nu: Any


class AddNoiseState(NamedTuple):
    count: Any
    rng_key: Any


class ScaleByLionState(NamedTuple):
    count: Any
    mu: Any


class ScaleByRmsState(NamedTuple):
    nu: Any


class ScaleByRmsWithCountState(NamedTuple):
    count: Any
    nu: Any


class ScaleByRStdDevState(NamedTuple):
    mu: Any
    nu: Any


class ScaleByRStdDevWithCountState(NamedTuple):
    count: Any
    mu: Any
    nu: Any


class ScaleByRssState(NamedTuple):
    sum_of_squares: Any


class ScaleByScheduleState(NamedTuple):
    count: Any


class TraceState(NamedTuple):
    trace: Any


class EmaState(NamedTuple):
    count: Any
    ema: Any


class WeightDecaySchedule(NamedTuple):
    count: Any


class FactoredState(NamedTuple):
    count: Any
    v_row: Any
    v_col: Any
    v: Any


def _count0(params):
    return scalar(0, np.int32, params)


def _zeros_tree(params, dtype=None):
    """Zeros like each param, in ``dtype`` (None: the param's dtype, as optax)."""
    return tree_map(lambda p: zeros_like(p, dtype), params)


def _bc(decay, t) -> float:
    """1 - decay**t in float32, like optax's bias correction (C: powf and a float32
    subtraction, the bits of numpy's float32 scalars, without their per-operation cost)."""
    return _C.f32_bias_correction(decay, t)


def _expect_state(state, cls, who):
    """Check the state a stateful transform was given: an instance of its ``cls``, or a
    tuple with the same fields (a state rebuilt by a checkpoint library). Another
    transform's state (an optimizer swapped while its old state was kept) raises a
    TypeError naming both, instead of an AttributeError (or a TypeError about a tuple
    method) deep in the step."""
    fields = getattr(state, "_fields", None)
    if not (isinstance(state, cls) or (isinstance(state, tuple) and fields == cls._fields)):
        got = type(state).__name__ + (repr(fields) if isinstance(fields, tuple) else "")
        raise TypeError(f"{who}: expected its state {cls.__name__}{cls._fields!r}, got {got}: "
                        f"was the state built by this transformation's init?")


def _stateless(kind, scalars_fn) -> GradientTransformation:
    def fuse(state, ctx):
        return ([Stage(kind, scalars_fn(), active=ctx.snapshot(), at=CONST)],
                lambda advance=True: state)
    return GradientTransformationExtraArgs(lambda params: EmptyState(), fuse=fuse)


# --- elementwise, fused ---------------------------------------------------------------------------


def _check_scalar(x, what):
    """A hyper-parameter given as a number (a Python or numpy real, or a 0-d array), not a
    string or a sequence (which would fail only at the first step, far from the cause)."""
    if isinstance(x, (str, bytes)) or not (
            isinstance(x, (numbers.Real, np.number))
            or (hasattr(x, "shape") and tuple(x.shape) == ())):   # 0-d arrays
        raise TypeError(f"{what} must be a number or a schedule (a function of the step "
                        f"count), got {x!r}")
    return x


def _check_numbers(who, **hyper) -> None:
    """Check a transform's fixed-number hyper-parameters when it is built: a string, a
    sequence, None or a function where optax computes with a number fails here, with a
    TypeError naming it, not at the first step (far from the cause)."""
    for name, value in hyper.items():
        _check_number(value, f"{who}: {name}")


def scale(step_size) -> GradientTransformation:
    """Multiply updates by a fixed scalar (optax.scale). State: EmptyState()."""
    _check_scalar(step_size, "scale: step_size")
    return _stateless(SCALE, lambda: [step_size])


def set_to_zero() -> GradientTransformation:
    """Map every update to +0.0, whatever it was, NaN and inf included (optax.set_to_zero).
    State: EmptyState(). Usually inside ``masked`` / ``freeze`` / ``partition``."""
    return _stateless(ZERO, lambda: [])


def clip(max_delta) -> GradientTransformation:
    """Clip every update element to [-max_delta, max_delta] (optax.clip)."""
    _check_numbers("clip", max_delta=max_delta)
    return _stateless(CLIP, lambda: [max_delta])


def clip_by_global_norm(max_norm) -> GradientTransformation:
    """Rescale updates to global norm ``max_norm`` when they exceed it (optax.clip_by_global_norm).

    The norm runs over every global element once: only replica 0 of each block
    counts, so a replicated or sharded tree gives the same norm. Fused: one
    read-only pass over the updates entering it, then the main pass.
    """
    _check_numbers("clip_by_global_norm", max_norm=max_norm)
    return _stateless(GLOBAL_NORM, lambda: [max_norm])


def scale_by_trust_ratio(min_norm=0.0, trust_coefficient=1.0, eps=0.0) -> GradientTransformation:
    """Scale each leaf by ||param|| / ||update|| (1 where either is zero) — LAMB's trust ratio.

    Fused with one extra read-only pass computing per-leaf norms (of params and
    of the updates entering it) across all shards.
    """
    _check_numbers("scale_by_trust_ratio", min_norm=min_norm,
                   trust_coefficient=trust_coefficient, eps=eps)
    return _stateless(TRUST_RATIO, lambda: [min_norm, trust_coefficient, eps])


def scale_by_adam(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, *,
                  nesterov=False) -> GradientTransformation:
    """Adam's scaling (optax.scale_by_adam): state ScaleByAdamState(count, mu, nu).

    ``mu_dtype`` (optax's): the dtype mu is stored in (None: the params'); bfloat16 /
    float16 moments are rounded once when stored, the step's update uses their float32
    value (as optax).
    """
    mu_dtype = _state_dtype(mu_dtype, "mu_dtype")
    return _adam_like(ADAM, ScaleByAdamState, b1, b2, eps, eps_root, float(bool(nesterov)),
                      mu_dtype=mu_dtype)


def _adam_like(kind, state_cls, b1, b2, eps, eps_root, mode, initial=0.0, extra=None,
               mu_dtype=None, who="scale_by_adam"):
    """A fused two-moment transform (ADAM / BELIEF / YOGI / ADAMAX stages) with optax's
    ``state_cls(count, mu, nu)``. ``mode``: the stage's mode scalar, a float, or a function
    giving it for step t; ``extra(t)`` optional stages after it (radam's rectification
    factor)."""
    _check_numbers(who, b1=b1, b2=b2, eps=eps, eps_root=eps_root, initial_accumulator_value=initial)

    def init(params):
        if initial == 0.0:
            return state_cls(count=_count0(params), mu=_zeros_tree(params, mu_dtype),
                             nu=_zeros_tree(params))
        return state_cls(count=_count0(params), mu=tree_map(lambda p: full_like(p, initial), params),
                         nu=tree_map(lambda p: full_like(p, initial), params))

    # scalars_at(c): the stage's scalars for the step whose count reads c before it (this
    # runs at every step); for a constant mode, the list is made in C
    if callable(mode):
        bc = _C.f32_bias_correction   # (_bc, called directly)

        def scalars_at(c):
            t = min(int(c) + 1, _INT32_MAX)   # safe_increment(c), inline
            return [b1, b2, eps, eps_root, bc(b1, t), bc(b2, t), mode(t),
                    bc(b1, min(t + 1, _INT32_MAX))]
    else:
        scalars_at = functools.partial(_C.adam_scalars, b1, b2, eps, eps_root, mode)

    def fuse(state, ctx):
        _expect_state(state, state_cls, who)
        c = ctx.count(state.count)
        t = safe_increment(c)
        mu, mu_rb = ctx.slot(state.mu)
        nu, nu_rb = ctx.slot(state.nu)
        active = ctx.snapshot()
        stages = [Stage(kind, scalars_at(c), [mu, nu], active, at=scalars_at)]
        if extra is not None:
            stages += [Stage(k, sc, active=active) for k, sc in extra(t)]

        def rebuild(advance=True):
            return state_cls(ctx.new_scalar(state.count, t if advance else c), mu_rb(), nu_rb())
        return stages, rebuild
    return GradientTransformationExtraArgs(init, fuse=fuse)


def scale_by_belief(b1=0.9, b2=0.999, eps=1e-16, eps_root=1e-16, *,
                    nesterov=False) -> GradientTransformation:
    """AdaBelief's scaling (optax.scale_by_belief): the second moment tracks the squared
    prediction error (g - mu)^2 (+ eps_root). State: ScaleByBeliefState(count, mu, nu)."""
    return _adam_like(BELIEF, ScaleByBeliefState, b1, b2, eps, eps_root,
                      float(bool(nesterov)), who="scale_by_belief")


def scale_by_yogi(b1=0.9, b2=0.999, eps=1e-3, eps_root=0.0,
                  initial_accumulator_value=1e-6) -> GradientTransformation:
    """Yogi's scaling (optax.scale_by_yogi): nu -= (1 - b2) sign(nu - g^2) g^2, both moments
    start at ``initial_accumulator_value``. State: ScaleByAdamState(count, mu, nu)."""
    return _adam_like(YOGI, ScaleByAdamState, b1, b2, eps, eps_root, 0.0,
                      initial=initial_accumulator_value, who="scale_by_yogi")


def scale_by_adamax(b1=0.9, b2=0.999, eps=1e-8) -> GradientTransformation:
    """Adamax's scaling (optax.scale_by_adamax): the bias-corrected first moment over the
    infinity-norm moment max(|g| + eps, b2 nu). State: ScaleByAdamState(count, mu, nu)."""
    return _adam_like(ADAMAX, ScaleByAdamState, b1, b2, eps, 0.0, 0.0,
                      who="scale_by_adamax")


def scale_by_amsgrad(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
                     bias_correction_mu=True, bias_correction_nu=True) -> GradientTransformation:
    """AMSGrad's scaling (optax.scale_by_amsgrad): Adam with the running maximum of the
    (bias-corrected) second moment. State: ScaleByAmsgradState(count, mu, nu, nu_max)."""
    mu_dtype = _state_dtype(mu_dtype, "mu_dtype")
    _check_numbers("scale_by_amsgrad", b1=b1, b2=b2, eps=eps, eps_root=eps_root)

    def init(params):
        return ScaleByAmsgradState(count=_count0(params), mu=_zeros_tree(params, mu_dtype),
                                   nu=_zeros_tree(params), nu_max=_zeros_tree(params))

    def scalars_at(c):
        t = safe_increment(c)
        return [b1, b2, eps, eps_root, _bc(b1, t) if bias_correction_mu else 1.0,
                _bc(b2, t) if bias_correction_nu else 1.0, 0.0, 1.0]

    def fuse(state, ctx):
        _expect_state(state, ScaleByAmsgradState, "scale_by_amsgrad")
        c = ctx.count(state.count)
        t = safe_increment(c)
        slots = [ctx.slot(state.mu), ctx.slot(state.nu), ctx.slot(state.nu_max)]
        st = Stage(AMSGRAD, scalars_at(c), [a for a, _ in slots], ctx.snapshot(), at=scalars_at)

        def rebuild(advance=True):
            return ScaleByAmsgradState(ctx.new_scalar(state.count, t if advance else c),
                                       *[rb() for _, rb in slots])
        return [st], rebuild
    return GradientTransformationExtraArgs(init, fuse=fuse)


def scale_by_radam(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, threshold=5.0, *,
                   nesterov=False) -> GradientTransformation:
    """Rectified Adam's scaling (optax.scale_by_radam). While the variance estimate's
    length rho_t is below ``threshold`` the update is the bias-corrected first moment;
    after, Adam's update times the rectification factor r_t (both evaluated per step in
    float32 on the host, as optax does). State: ScaleByAdamState(count, mu, nu)."""
    _check_numbers("scale_by_radam", b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                   threshold=threshold)
    f = np.float32
    ro_inf = 2.0 / (1.0 - b2) - 1.0          # a Python float in optax too

    def rho(t):
        b2t = f(b2) ** f(t)
        return f(ro_inf) - (f(2 * t) * b2t) / (f(1) - b2t)

    def mode(t):
        return float(bool(nesterov)) + (0.0 if rho(t) >= f(threshold) else 2.0)

    def rect(t):
        ro = rho(t)
        if not ro >= f(threshold):
            return [(SCALE, [1.0])]
        r = np.sqrt((ro - f(4.0)) * (ro - f(2.0)) * f(ro_inf)
                    / (f((ro_inf - 4.0) * (ro_inf - 2.0)) * ro))
        return [(SCALE, [float(r)])]
    return _adam_like(ADAM, ScaleByAdamState, b1, b2, eps, eps_root, mode, extra=rect,
                      who="scale_by_radam")


_LION_MODES = ("hard", "smooth", "refined")


def scale_by_lion(b1=0.9, b2=0.99, mu_dtype=None, *, mode="hard", smooth_beta=1.0
                  ) -> GradientTransformation:
    """Lion's update (optax.scale_by_lion): with ``x = (1 - b1) g + b1 mu``, ``sign(x)``
    (``mode='hard'``, fused), ``tanh(smooth_beta * x)`` (``'smooth'``) or ``x`` where
    ``|x| < 1`` and ``sign(x)`` elsewhere (``'refined'``; these two are not fused); then
    ``mu = (1 - b2) g + b2 mu``. State: ScaleByLionState(count, mu)."""
    mu_dtype = _state_dtype(mu_dtype, "mu_dtype")
    _check_number(b1, "scale_by_lion: b1")
    _check_number(b2, "scale_by_lion: b2")
    if not isinstance(mode, str) or mode not in _LION_MODES:
        raise ValueError(f'Unknown lion mode: {mode}. It needs to be one of ["hard", '
                         f'"smooth", "refined"].')
    _check_number(smooth_beta, "scale_by_lion: smooth_beta")

    def init(params):
        return ScaleByLionState(count=_count0(params), mu=_zeros_tree(params, mu_dtype))

    if mode != "hard":
        def update(updates, state, params=None, **extra_args):
            del params
            _expect_state(state, ScaleByLionState, "scale_by_lion")
            cnp = _cnp()

            def comb(g, m):
                x = (1.0 - b1) * _like(g, m) + b1 * m
                if mode == "smooth":
                    return cnp.tanh(smooth_beta * x)
                return cnp.where(cnp.abs(x) < 1.0, x, cnp.sign(x))
            out = tree_map(comb, updates, state.mu)
            mu = tree_map(lambda g, m: _moment(_like(g, m), m, b2, 1), updates, state.mu)
            if mu_dtype is not None:
                mu = tree_map(lambda m: m.astype(mu_dtype), mu)
            count = scalar(safe_increment(int(read_scalar(state.count))), np.int32,
                           sharding=getattr(state.count, "sharding", None))
            return out, ScaleByLionState(count=count, mu=mu)
        return GradientTransformationExtraArgs(init, update)

    def fuse(state, ctx):
        _expect_state(state, ScaleByLionState, "scale_by_lion")
        c = ctx.count(state.count)
        mu, mu_rb = ctx.slot(state.mu)
        st = Stage(LION, [b1, b2], [mu], ctx.snapshot(), at=CONST)
        return [st], lambda advance=True: ScaleByLionState(
            ctx.new_scalar(state.count, safe_increment(c) if advance else c), mu_rb())
    return GradientTransformationExtraArgs(init, fuse=fuse)


def _rms_like(centered, decay, eps, initial_scale, eps_in_sqrt, bias_correction):
    """scale_by_rms (RMS stage, state nu) or, ``centered``, scale_by_stddev (STDDEV stage,
    state mu and nu); optax's states, with a count when ``bias_correction``."""
    if centered:
        plain, counted, kind = ScaleByRStdDevState, ScaleByRStdDevWithCountState, STDDEV
    else:
        plain, counted, kind = ScaleByRmsState, ScaleByRmsWithCountState, RMS
    moments = plain._fields                    # ('mu', 'nu') or ('nu',)
    _check_numbers("scale_by_stddev" if centered else "scale_by_rms", decay=decay, eps=eps,
                   initial_scale=initial_scale)

    def init(params):
        m = {"nu": tree_map(lambda p: full_like(p, initial_scale), params)}
        if centered:
            m["mu"] = _zeros_tree(params)
        if bias_correction:
            return counted(count=_count0(params), **m)
        return plain(**m)

    def scalars_at(c):
        return [decay, eps, float(bool(eps_in_sqrt)), _bc(decay, safe_increment(c))]

    def fuse(state, ctx):
        _expect_state(state, counted if bias_correction else plain,
                      "scale_by_stddev" if centered else "scale_by_rms")
        slots = [ctx.slot(getattr(state, f)) for f in moments]
        if bias_correction:
            c = ctx.count(state.count)
            t = safe_increment(c)
            st = Stage(kind, scalars_at(c), [a for a, _ in slots], ctx.snapshot(), at=scalars_at)
        else:
            st = Stage(kind, [decay, eps, float(bool(eps_in_sqrt)), 1.0], [a for a, _ in slots],
                       ctx.snapshot(), at=CONST)

        def rebuild(advance=True):
            m = [rb() for _, rb in slots]
            if bias_correction:
                return counted(ctx.new_scalar(state.count, t if advance else c), *m)
            return plain(*m)
        return [st], rebuild
    return GradientTransformationExtraArgs(init, fuse=fuse)


def scale_by_rms(decay=0.9, eps=1e-8, initial_scale=0.0, eps_in_sqrt=True,
                 bias_correction=False) -> GradientTransformation:
    """RMSProp's scaling (optax.scale_by_rms): ScaleByRmsState(nu), or
    ScaleByRmsWithCountState(count, nu) with ``bias_correction``."""
    return _rms_like(False, decay, eps, initial_scale, eps_in_sqrt, bias_correction)


def scale_by_stddev(decay=0.9, eps=1e-8, initial_scale=0.0, eps_in_sqrt=True,
                    bias_correction=False) -> GradientTransformation:
    """Centered RMSProp's scaling (optax.scale_by_stddev): g / sqrt(nu - mu^2 + eps), with
    mu and nu the first and second moments. State: ScaleByRStdDevState(mu, nu), or
    ScaleByRStdDevWithCountState(count, mu, nu) with ``bias_correction``."""
    return _rms_like(True, decay, eps, initial_scale, eps_in_sqrt, bias_correction)


def scale_by_rss(initial_accumulator_value=0.1, eps=1e-7) -> GradientTransformation:
    """Adagrad's scaling (optax.scale_by_rss): ScaleByRssState(sum_of_squares)."""
    _check_numbers("scale_by_rss", initial_accumulator_value=initial_accumulator_value, eps=eps)
    def init(params):
        return ScaleByRssState(
            tree_map(lambda p: full_like(p, initial_accumulator_value), params))

    def fuse(state, ctx):
        _expect_state(state, ScaleByRssState, "scale_by_rss")
        acc, rb = ctx.slot(state.sum_of_squares)
        return ([Stage(RSS, [eps], [acc], ctx.snapshot(), at=CONST)],
                lambda advance=True: ScaleByRssState(rb()))
    return GradientTransformationExtraArgs(init, fuse=fuse)


def trace(decay, nesterov=False, accumulator_dtype=None) -> GradientTransformation:
    """Momentum (optax.trace): TraceState(trace)."""
    _check_numbers("trace", decay=decay)
    accumulator_dtype = _state_dtype(accumulator_dtype, "accumulator_dtype")

    def init(params):
        return TraceState(_zeros_tree(params, accumulator_dtype))

    def fuse(state, ctx):
        _expect_state(state, TraceState, "trace")
        t, rb = ctx.slot(state.trace)
        return ([Stage(TRACE, [decay, float(bool(nesterov))], [t], ctx.snapshot(), at=CONST)],
                lambda advance=True: TraceState(rb()))
    return GradientTransformationExtraArgs(init, fuse=fuse)


def ema(decay, debias=True, accumulator_dtype=None) -> GradientTransformation:
    """Exponential moving average of updates (optax.ema): EmaState(count, ema)."""
    _check_numbers("ema", decay=decay)
    accumulator_dtype = _state_dtype(accumulator_dtype, "accumulator_dtype")

    def init(params):
        return EmaState(count=_count0(params), ema=_zeros_tree(params, accumulator_dtype))

    def scalars_at(c):
        return [decay, _bc(decay, safe_increment(c)) if debias else 1.0]

    def fuse(state, ctx):
        _expect_state(state, EmaState, "ema")
        c = ctx.count(state.count)
        t = safe_increment(c)
        e, rb = ctx.slot(state.ema)
        st = Stage(EMA, scalars_at(c), [e], ctx.snapshot(), at=scalars_at)
        return [st], lambda advance=True: EmaState(
            ctx.new_scalar(state.count, t if advance else c), rb())
    return GradientTransformationExtraArgs(init, fuse=fuse)


def add_decayed_weights(weight_decay=0.0, mask=None) -> GradientTransformation:
    """updates + weight_decay * params (optax.add_decayed_weights). ``weight_decay`` may be
    a schedule (state WeightDecaySchedule(count)); ``mask`` wraps it in :func:`masked`."""
    if not callable(weight_decay):
        _check_scalar(weight_decay, "add_decayed_weights: weight_decay")
    def init(params):
        if callable(weight_decay):
            return WeightDecaySchedule(count=_count0(params))
        return EmptyState()

    def fuse(state, ctx):
        if callable(weight_decay):
            _expect_state(state, WeightDecaySchedule, "add_decayed_weights")
            c = ctx.count(state.count)
            at = lambda c: [float(_f32(weight_decay(c)))]   # noqa: E731
            return [Stage(DECAY, at(c), active=ctx.snapshot(), at=at)], lambda advance=True: \
                WeightDecaySchedule(ctx.new_scalar(state.count, safe_increment(c) if advance else c))
        if isinstance(weight_decay, (int, float)) and weight_decay == 0.0:
            return [], lambda advance=True: state
        return ([Stage(DECAY, [weight_decay], active=ctx.snapshot(), at=CONST)],
                lambda advance=True: state)
    tx = GradientTransformationExtraArgs(init, fuse=fuse)
    if mask is not None:
        return _upper('optim.combine').masked(tx, mask)
    return tx


def scale_by_schedule(step_size_fn) -> GradientTransformation:
    """Multiply updates by ``step_size_fn(count)`` (optax.scale_by_schedule):
    ScaleByScheduleState(count). The schedule is evaluated once per step, on the host."""
    def init(params):
        return ScaleByScheduleState(count=_count0(params))

    def fuse(state, ctx):
        _expect_state(state, ScaleByScheduleState, "scale_by_schedule")
        c = ctx.count(state.count)
        at = lambda c: [float(_f32(step_size_fn(c)))]   # noqa: E731
        return [Stage(SCALE, at(c), active=ctx.snapshot(), at=at)], lambda advance=True: \
            ScaleByScheduleState(ctx.new_scalar(state.count, safe_increment(c) if advance else c))
    return GradientTransformationExtraArgs(init, fuse=fuse)


def scale_by_learning_rate(learning_rate=None, *, flip_sign=True) -> GradientTransformation:
    """Scale by -learning_rate (a float or a schedule) (optax.scale_by_learning_rate)."""
    if learning_rate is None:
        return identity()
    m = -1 if flip_sign else 1
    if callable(learning_rate):
        return scale_by_schedule(lambda count: m * learning_rate(count))
    return scale(m * _check_scalar(learning_rate, "learning_rate"))


def _state_dtype(dtype, what):
    """A state dtype argument (optax's ``mu_dtype`` / ``accumulator_dtype``): None (the
    params' dtype) or a float dtype the kernels keep state in (float32, bfloat16, float16;
    16-bit state is computed in float32 and rounded once when stored, as optax casts it)."""
    if dtype is None:
        return None
    try:
        dt = _dtypes.canonicalize(dtype)
    except TypeError:
        dt = None
    if dt not in (_dtypes.float32, _dtypes.bfloat16, _dtypes.float16):
        raise ValueError(f"{what}={dtype!r}: optimizer state is kept in float32, bfloat16 or "
                         f"float16 (None: the params' dtype)")
    return dt


# --- adafactor pieces: fused ---------------------------------------------------------------------


def _decay_rate_pow(i, exponent=0.8):
    t = _f32(i + 1)
    return _f32(1.0) - t ** _f32(-exponent)


def _factored_dims(shape, factored, min_dim_size_to_factor):
    """optax's choice: (d1, d0), the second largest and the largest dim, or None."""
    if not factored or len(shape) < 2:
        return None
    sorted_dims = np.argsort(shape)
    if shape[sorted_dims[-2]] < min_dim_size_to_factor:
        return None
    return int(sorted_dims[-2]), int(sorted_dims[-1])


def _without_dim(sharding, ndim, d):
    """The sharding of a statistic of an array (rank ``ndim``) reduced over dim ``d``: the
    array's PartitionSpec without entry ``d``; the result is replicated over that mesh axis."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(tuple(sharding.spec)))
        return NamedSharding(sharding.mesh, PartitionSpec(*(spec[:d] + spec[d + 1:])))
    return sharding


def scale_by_factored_rms(factored=True, decay_rate=0.8, step_offset=0, min_dim_size_to_factor=128,
                          epsilon=1e-30, decay_rate_fn=_decay_rate_pow) -> GradientTransformation:
    """Adafactor's factored second moments (optax.scale_by_factored_rms): FactoredState(count,
    v_row, v_col, v).

    Fused. For a factored leaf (two dims >= ``min_dim_size_to_factor``), ``v_row`` (the leaf
    without its largest dim d0) and ``v_col`` (without d1) are sharded like the param with
    that dim dropped; a read-only pass sums g^2 + eps along d0 and d1 on every device and the
    sums of the devices along a sharded dim are added (each global element once). Other
    leaves keep a full ``v`` sharded like the param.
    """
    _check_numbers("scale_by_factored_rms", decay_rate=decay_rate, step_offset=step_offset,
                   min_dim_size_to_factor=min_dim_size_to_factor, epsilon=epsilon)

    def init(params):

        def _init(p):
            # under eval_shape the params are ShapeDtypeStructs: the statistics are too
            # (jax.eval_shape(optax.adafactor().init, params) works, e.g. for t5x's specs)
            abstract = isinstance(p, ShapeDtypeStruct)
            if not abstract:
                p = to_array(p)
            shape = tuple(p.shape)
            fd = _factored_dims(shape, factored, min_dim_size_to_factor)
            dt = p.dtype   # optax keeps the statistics in the param's dtype

            def zeros(shp, sharding):
                if abstract:
                    return ShapeDtypeStruct(shp, dt, sharding)
                return device_put(np.zeros(shp, dt), sharding)
            # the (1,) placeholders live on this param's devices (replicated over its mesh, or
            # on its one device): the kernel pairs every state block with a param block, so a
            # placeholder on the first param's mesh broke a leaf placed elsewhere
            z1 = lambda: zeros((1,), _scalar_sharding(p))  # noqa: E731
            if fd is not None:
                d1, d0 = fd
                vr = zeros(shape[:d0] + shape[d0 + 1:], _without_dim(p.sharding, len(shape), d0))
                vc = zeros(shape[:d1] + shape[d1 + 1:], _without_dim(p.sharding, len(shape), d1))
                return (vr, vc, z1())
            return (z1(), z1(), zeros_like(p))
        leaves, td = tree_flatten(params)
        res = [_init(p) for p in leaves]
        return FactoredState(count=_count0(params),
                             v_row=tree_unflatten(td, [r[0] for r in res]),
                             v_col=tree_unflatten(td, [r[1] for r in res]),
                             v=tree_unflatten(td, [r[2] for r in res]))

    def fuse(state, ctx):
        if ctx.params is None:
            raise ValueError("scale_by_factored_rms needs params (tx.update(updates, state, params))")
        _expect_state(state, FactoredState, "scale_by_factored_rms")
        c = ctx.count(state.count)
        at = lambda c: [float(_f32(decay_rate_fn(c - step_offset, decay_rate))), epsilon]  # noqa: E731
        vr, vr_rb = ctx.slot(state.v_row, same_shape=False)
        vc, vc_rb = ctx.slot(state.v_col, same_shape=False)
        v, v_rb = ctx.slot(state.v, same_shape=False)
        geom = []
        for p in ctx.leaves:
            fd = _factored_dims(tuple(p.shape), factored, min_dim_size_to_factor)
            geom.append(None if fd is None else (fd[1], fd[0]))   # (d0, d1)
        st = Stage(FACTORED, at(c), [vr, vc, v], ctx.snapshot(), at=at)
        st.geom = geom
        return [st], lambda advance=True: FactoredState(
            ctx.new_scalar(state.count, safe_increment(c) if advance else c), vr_rb(), vc_rb(),
            v_rb())
    return GradientTransformationExtraArgs(init, fuse=fuse)


def clip_by_block_rms(threshold) -> GradientTransformation:
    """Divide each leaf by max(1, rms(leaf)/threshold) (optax.clip_by_block_rms). Fused: one
    read-only pass for the per-leaf RMS over all shards."""
    _check_numbers("clip_by_block_rms", threshold=threshold)
    return _stateless(BLOCK_RMS, lambda: [threshold])


def scale_by_param_block_rms(min_scale=1e-3) -> GradientTransformation:
    """Multiply each leaf by max(rms(param), min_scale) (optax.scale_by_param_block_rms).
    Fused: the per-leaf RMS of the params is summed in an earlier read-only pass of the step
    when there is one (adafactor's block-RMS clip), else in a pass over the params alone."""
    _check_numbers("scale_by_param_block_rms", min_scale=min_scale)
    def fuse(state, ctx):
        if ctx.params is None:
            raise ValueError("scale_by_param_block_rms needs params")
        return ([Stage(PARAM_RMS, [min_scale], active=ctx.snapshot(), at=CONST)],
                lambda advance=True: state)
    return GradientTransformationExtraArgs(lambda params: EmptyState(), fuse=fuse)


# --- noise (not fused) ----------------------------------------------------------------------------


def add_noise(eta, gamma, key=None, *, seed=None) -> GradientTransformation:
    """Add Gaussian noise of variance ``eta / t**gamma`` at step t (optax.add_noise).

    State: ``AddNoiseState(count, rng_key)``; the key is a raw uint32[2] key (a seed is
    turned into ``random.key(seed)``, a typed jax key is accepted). Each step splits the
    key like optax (``rng_key, sample_key = split(rng_key)``, one key per leaf from
    ``split(sample_key, num_leaves)``) and draws each leaf's noise with
    :func:`ctrainstate.random.normal` in the leaf's own sharding, so every device
    generates only its shard and the noise equals optax's bit for bit. Not fused: the
    noise is generated, then added by a separate elementwise op per leaf.
    """
    _check_numbers("add_noise", eta=eta, gamma=gamma)
    if seed is not None:
        if key is not None:
            raise ValueError("add_noise: give only one of seed or key")
        key = seed
    if key is None:
        key = 0
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        key0 = _random.key(int(key))
    else:
        key0 = np.array(_random._key_words(key), dtype=np.uint32)

    def init(params):
        return AddNoiseState(count=_count0(params), rng_key=key0.copy())

    def update(updates, state, params=None, **extra_args):
        del params
        _expect_state(state, AddNoiseState, "add_noise")
        t = safe_increment(int(np.asarray(state.count)))
        std = np.sqrt(_f32(eta) / (_f32(t) ** _f32(gamma)))
        rng_key, sample_key = _random.split(state.rng_key)
        leaves, td = tree_flatten(updates)
        keys = _random.split(sample_key, len(leaves)) if leaves else []
        out = []
        for leaf, k in zip(leaves, keys):
            if isinstance(leaf, Array):
                noise = _random.normal(k, leaf.shape, leaf.dtype, out_sharding=leaf.sharding)
                out.append(leaf + noise * float(std))   # a weak scalar: keeps leaf's dtype
            else:
                x = np.asarray(leaf)
                noise = _random.normal(k, x.shape, x.dtype)
                out.append(x + np.asarray(std, x.dtype) * noise)
        return tree_unflatten(td, out), AddNoiseState(
            count=scalar(t, np.int32, sharding=getattr(state.count, "sharding", None)),
            rng_key=np.asarray(rng_key, np.uint32))
    return GradientTransformationExtraArgs(init, update)


# --- sign, centralization, accumulation (not fused) -----------------------------------------------


def _unfused_map(f):
    """An EmptyState transform applying ``f`` to every update leaf with ctrainstate.numpy
    ops (runs through ``tx.update``, not fused: the kernel has no stage for it)."""
    def update(updates, state, params=None, **extra_args):
        del params
        return tree_map(lambda u: None if u is None else f(u), updates,
                        is_leaf=lambda x: x is None), state
    return GradientTransformationExtraArgs(lambda params: EmptyState(), update)


def scale_by_sign() -> GradientTransformation:
    """Replace every update by its sign, -1, 0 or +1 (optax.scale_by_sign; ``jnp.sign``: NaN
    stays NaN). State: EmptyState(). Not fused: one elementwise op per leaf.

    >>> import numpy as np, ctrainstate.optim as optim
    >>> u, _ = optim.scale_by_sign().update({'w': np.array([-2., 0., 3.], np.float32)}, None)
    >>> np.asarray(u['w']).tolist()
    [-1.0, 0.0, 1.0]
    """
    return _unfused_map(_ops.sign)


def centralize() -> GradientTransformation:
    """Gradient centralization (optax.centralize): a leaf of rank > 1 has its mean over all
    dims but the first subtracted (``g - g.mean(range(1, ndim), keepdims=True)``); vectors
    and scalars pass unchanged. State: EmptyState(). Not fused (a reduction per leaf, an
    all-reduce where the reduced dims are sharded)."""

    def sub_mean(g):
        g = to_array(g) if not isinstance(g, Array) else g
        if len(g.shape) > 1:
            return _ops.subtract(g, _ops.mean(g, axis=tuple(range(1, len(g.shape))),
                                              keepdims=True))
        return g
    return _unfused_map(sub_mean)


class ApplyEvery(NamedTuple):
    """State of :func:`apply_every` (optax.ApplyEvery)."""
    count: Any
    grad_acc: Any


def apply_every(k=1) -> GradientTransformation:
    """Accumulate the updates of ``k`` steps and emit their sum every k-th step, zeros in
    between (optax.apply_every). State: ApplyEvery(count, grad_acc), the accumulator like the
    params. As optax, the accumulator restarts by multiplying it by 0 (a NaN in it stays
    NaN) and the emitted updates are ``emit * grad_acc``. Not fused. ``k`` must be an int
    >= 1 (optax would take the step count modulo 0)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"apply_every: k must be an int, got {k!r}")
    if k < 1:
        raise ValueError(f"apply_every: k={k}; need k >= 1")
    k = int(k)

    def init(params):
        return ApplyEvery(count=_count0(params), grad_acc=_zeros_tree(params))

    def update(updates, state, params=None, **extra_args):
        del params
        _expect_state(state, ApplyEvery, "apply_every")
        count = int(read_scalar(state.count))
        c = count % k
        acc = float(c != 0)
        emit = float(c == k - 1)
        grad_acc = tree_map(lambda g, ga: _ops.add(_ops.multiply(ga, acc), g),
                            updates, state.grad_acc)
        out = tree_map(lambda ga: _ops.multiply(ga, emit), grad_acc)
        new_count = scalar(safe_increment(count) % k, np.int32,
                           sharding=getattr(state.count, "sharding", None))
        return out, ApplyEvery(count=new_count, grad_acc=grad_acc)
    return GradientTransformationExtraArgs(init, update)


__all__ += ["scale_by_sign", "centralize", "ApplyEvery", "apply_every"]


# --- more of optax's scalings (not fused: ctrainstate.numpy ops per leaf) -------------------------
#
# Each is optax's update written with ctrainstate.numpy ops, so a sharded leaf stays sharded
# (its reductions are all-reduces) and the float32 roundings are optax's. Step counters and
# flags are read on the host (they are replicated scalars that remember their value).


class ScaleByAdaDeltaState(NamedTuple):
    """State of :func:`scale_by_adadelta` (optax.ScaleByAdaDeltaState)."""
    e_g: Any
    e_x: Any


class ScaleByNovogradState(NamedTuple):
    """State of :func:`scale_by_novograd` (optax.ScaleByNovogradState)."""
    count: Any
    mu: Any
    nu: Any


class ScaleByRpropState(NamedTuple):
    """State of :func:`scale_by_rprop` (optax.ScaleByRpropState)."""
    step_sizes: Any
    prev_updates: Any


class ScaleByAdanState(NamedTuple):
    """State of :func:`scale_by_adan` (optax.ScaleByAdanState)."""
    m: Any
    v: Any
    n: Any
    g: Any
    t: Any


class ScaleByOptimisticGradientState(NamedTuple):
    """State of :func:`scale_by_optimistic_gradient` (optax.ScaleByOptimisticGradientState)."""
    is_initial_step: Any
    previous_gradient: Any


class ScaleByDistanceOverGradientsState(NamedTuple):
    """State of :func:`scale_by_distance_over_gradients`
    (optax.ScaleByDistanceOverGradientsState)."""
    max_dist: Any
    grad_sum_of_squares: Any
    init_params: Any


def _cnp():
    return cnp


def device_put(x, sharding):
    return _put(x, sharding)


def _like(x, ref):
    """An update leaf as an Array placed like the state leaf ``ref`` (numpy grads given to a
    sharded state take its sharding)."""
    return to_array(x, like=ref)


def _moment(g, m, decay, order):
    """optax.tree.update_moment on one leaf: (1 - decay) * g**order + decay * m."""
    return (1 - decay) * (g ** order if order != 1 else g) + decay * m


def _need_params(params, who):
    if params is None:
        raise ValueError(f"{who} needs params: call update(updates, state, params)")


def _check_number(x, what):
    """A hyper-parameter that must be a fixed number (optax takes no schedule there)."""
    if callable(x):
        raise TypeError(f"{what} must be a number, not a schedule (optax takes none here), "
                        f"got {x!r}")
    if isinstance(x, (str, bytes)) or not (
            isinstance(x, (numbers.Real, np.number))
            or (hasattr(x, "shape") and tuple(x.shape) == ())):   # 0-d arrays
        raise TypeError(f"{what} must be a number, got {x!r}")
    return x


def scale_by_adadelta(rho=0.9, eps=1e-6) -> GradientTransformation:
    """Adadelta's scaling (optax.scale_by_adadelta). With ``e_g`` the EMA of squared grads
    and ``e_x`` the EMA of squared updates (both start at zeros like the params)::

        e_g = (1 - rho) * g**2 + rho * e_g
        u = sqrt(e_x + eps) / sqrt(e_g + eps) * g          # e_x of the previous step
        e_x = (1 - rho) * u**2 + rho * e_x

    State: ScaleByAdaDeltaState(e_g, e_x). Not fused."""
    _check_number(rho, "scale_by_adadelta: rho")
    _check_number(eps, "scale_by_adadelta: eps")

    def init(params):
        return ScaleByAdaDeltaState(e_g=_zeros_tree(params), e_x=_zeros_tree(params))

    def update(updates, state, params=None, **extra_args):
        del params
        _expect_state(state, ScaleByAdaDeltaState, "scale_by_adadelta")
        cnp = _cnp()
        e_g = tree_map(lambda g, m: _moment(_like(g, m), m, rho, 2), updates, state.e_g)
        out = tree_map(lambda g, eg, ex: (cnp.sqrt(ex + eps) / cnp.sqrt(eg + eps)) * _like(g, eg),
                       updates, e_g, state.e_x)
        e_x = tree_map(lambda u, m: _moment(u, m, rho, 2), out, state.e_x)
        return out, ScaleByAdaDeltaState(e_g=e_g, e_x=e_x)
    return GradientTransformationExtraArgs(init, update)


def scale_by_novograd(b1=0.9, b2=0.25, eps=1e-8, eps_root=0.0, weight_decay=0.0,
                      mu_dtype=None) -> GradientTransformation:
    """NovoGrad's scaling (optax.scale_by_novograd): a per-leaf second moment of the grad's
    squared norm, ``nu = ||g||**2`` at the first step then ``(1 - b2) * ||g||**2 + b2 * nu``,
    and the momentum of the normalized grad plus weight decay,
    ``mu = b1 * mu + g / (sqrt(nu + eps_root) + eps) + weight_decay * params`` (``mu`` is that
    sum alone at the first step); the update is ``mu``. Needs params. State:
    ScaleByNovogradState(count, mu, nu), ``nu`` a 0-d scalar per leaf in the param's dtype.
    Not fused (a norm per leaf, an all-reduce where the leaf is sharded)."""
    mu_dtype = _state_dtype(mu_dtype, "mu_dtype")
    for v, n in ((b1, "b1"), (b2, "b2"), (eps, "eps"), (eps_root, "eps_root"),
                 (weight_decay, "weight_decay")):
        _check_number(v, f"scale_by_novograd: {n}")

    def init(params):
        nu = tree_map(lambda p: scalar(0.0, np.dtype(p.dtype), ref=p), params)
        return ScaleByNovogradState(count=_count0(params), mu=_zeros_tree(params, mu_dtype),
                                    nu=nu)

    def update(updates, state, params=None, **extra_args):
        _expect_state(state, ScaleByNovogradState, "scale_by_novograd")
        _need_params(params, "scale_by_novograd")
        cnp = _cnp()
        t = safe_increment(int(read_scalar(state.count)))
        grads = tree_map(lambda g, m: _like(g, m), updates, state.mu)

        def nu_add(g):
            return cnp.sqrt(cnp.sum(cnp.square(g))) ** 2     # jnp.linalg.norm(g) ** 2

        if t == 1:
            nu = tree_map(lambda g, n: nu_add(g).astype(n.dtype), grads, state.nu)
        else:
            nu = tree_map(lambda g, n: _moment(nu_add(g), n, b2, 1), grads, state.nu)

        def mu_add(g, p, n):
            return g / (cnp.sqrt(n + eps_root) + eps) + weight_decay * _like(p, g)

        if t == 1:
            mu = tree_map(mu_add, grads, params, nu)
        else:
            mu = tree_map(lambda m, g, p, n: b1 * m + mu_add(g, p, n), state.mu, grads, params, nu)
        if mu_dtype is not None:
            mu = tree_map(lambda m: m.astype(mu_dtype), mu)
        count = scalar(t, np.int32, sharding=getattr(state.count, "sharding", None))
        return mu, ScaleByNovogradState(count=count, mu=mu, nu=nu)
    return GradientTransformationExtraArgs(init, update)


def scale_by_rprop(learning_rate, eta_minus=0.5, eta_plus=1.2, min_step_size=1e-6,
                   max_step_size=50.0) -> GradientTransformation:
    """Rprop's scaling (optax.scale_by_rprop). Per element, with ``s = g * prev`` (``prev``
    the previous step's output before zeroing): the step size grows by ``eta_plus`` where
    ``s > 0``, shrinks by ``eta_minus`` where ``s < 0`` (clipped to [min_step_size,
    max_step_size]) and is kept where ``s == 0``; the new ``prev`` is ``step * sign(g)``, or 0
    where ``s < 0``; the update is the *previous* ``prev``, or 0 where ``s < 0`` (optax's
    exact rule, a step late). Step sizes start at ``learning_rate``, a fixed number. State:
    ScaleByRpropState(step_sizes, prev_updates). Not fused."""
    for v, n in ((learning_rate, "learning_rate"), (eta_minus, "eta_minus"),
                 (eta_plus, "eta_plus"), (min_step_size, "min_step_size"),
                 (max_step_size, "max_step_size")):
        _check_number(v, f"scale_by_rprop: {n}")

    def init(params):
        return ScaleByRpropState(tree_map(lambda p: full_like(p, learning_rate), params),
                                 _zeros_tree(params))

    def update(updates, state, params=None, **extra_args):
        del params
        _expect_state(state, ScaleByRpropState, "scale_by_rprop")
        cnp = _cnp()
        grads = tree_map(_like, updates, state.prev_updates)
        sign = tree_map(lambda g, pg: g * pg, grads, state.prev_updates)
        step_sizes = tree_map(
            lambda s, st: cnp.where(s == 0, st, cnp.clip(
                cnp.where(s > 0, st * eta_plus, st * eta_minus), min_step_size, max_step_size)),
            sign, state.step_sizes)
        prev = tree_map(lambda s, g, st: cnp.where(s < 0, cnp.zeros_like(g), st * cnp.sign(g)),
                        sign, grads, step_sizes)
        out = tree_map(lambda s, pg: cnp.where(s < 0, cnp.zeros_like(pg), pg),
                       sign, state.prev_updates)
        return out, ScaleByRpropState(step_sizes, prev)
    return GradientTransformationExtraArgs(init, update)


def scale_by_adan(b1=0.98, b2=0.92, b3=0.99, eps=1e-8, eps_root=0.0) -> GradientTransformation:
    """Adan's scaling (optax.scale_by_adan, Algorithm 1 of arXiv:2208.06677). With
    ``d = g - g_prev`` (zeros at the first step)::

        m = (1 - b1) * g + b1 * m
        v = (1 - b2) * d + b2 * v
        n = (1 - b3) * (g + (1 - b2) * d)**2 + b3 * n
        u = (m_hat + (1 - b2) * v_hat) / (sqrt(n_hat + eps_root) + eps)

    the hats bias-corrected by ``1 - b**t`` in float32. State: ScaleByAdanState(m, v, n, g,
    t), ``g`` the previous grads and ``t`` the int32 step count. Not fused."""
    for v_, n_ in ((b1, "b1"), (b2, "b2"), (b3, "b3"), (eps, "eps"), (eps_root, "eps_root")):
        _check_number(v_, f"scale_by_adan: {n_}")

    def init(params):
        return ScaleByAdanState(m=_zeros_tree(params), v=_zeros_tree(params),
                                n=_zeros_tree(params), g=_zeros_tree(params),
                                t=_count0(params))

    def update(updates, state, params=None, **extra_args):
        del params
        _expect_state(state, ScaleByAdanState, "scale_by_adan")
        cnp = _cnp()
        t0 = int(read_scalar(state.t))
        g = tree_map(_like, updates, state.g)
        if t0 == 0:
            diff = tree_map(cnp.zeros_like, g)
        else:
            diff = tree_map(lambda a, b: a - b, g, state.g)
        m = tree_map(lambda x, mm: _moment(x, mm, b1, 1), g, state.m)
        v = tree_map(lambda x, vv: _moment(x, vv, b2, 1), diff, state.v)
        sq = tree_map(lambda x, d: x + (1 - b2) * d, g, diff)
        n = tree_map(lambda x, nn: _moment(x, nn, b3, 2), sq, state.n)
        t = safe_increment(t0)
        c1, c2, c3 = _bc(b1, t), _bc(b2, t), _bc(b3, t)
        u = tree_map(lambda mm, vv, nn: (mm / c1 + (1 - b2) * (vv / c2))
                     / (cnp.sqrt(nn / c3 + eps_root) + eps), m, v, n)
        return u, ScaleByAdanState(m=m, v=v, n=n, g=g, t=scalar(
            t, np.int32, sharding=getattr(state.t, "sharding", None)))
    return GradientTransformationExtraArgs(init, update)


def scale_by_optimistic_gradient(alpha=1.0, beta=1.0) -> GradientTransformation:
    """Generalized optimistic gradients (optax.scale_by_optimistic_gradient):
    ``(alpha + beta) * g - beta * g_prev``, with ``g_prev = g`` at the first step (optax
    issue 1082). State: ScaleByOptimisticGradientState(is_initial_step, previous_gradient),
    the flag a bool scalar. Not fused."""
    _check_number(alpha, "scale_by_optimistic_gradient: alpha")
    _check_number(beta, "scale_by_optimistic_gradient: beta")

    def init(params):
        return ScaleByOptimisticGradientState(is_initial_step=scalar(True, np.bool_, params),
                                              previous_gradient=_zeros_tree(params))

    def update(updates, state, params=None, **extra_args):
        del params
        _expect_state(state, ScaleByOptimisticGradientState, "scale_by_optimistic_gradient")
        first = bool(read_scalar(state.is_initial_step))
        g = tree_map(_like, updates, state.previous_gradient)
        prev = g if first else state.previous_gradient
        out = tree_map(lambda x, p: (alpha + beta) * x - beta * p, g, prev)
        flag = scalar(False, np.bool_,
                      sharding=getattr(state.is_initial_step, "sharding", None))
        return out, ScaleByOptimisticGradientState(is_initial_step=flag, previous_gradient=g)
    return GradientTransformationExtraArgs(init, update)


def normalize_by_update_norm(scale_factor=1.0, eps=1e-6) -> GradientTransformation:
    """Divide the updates by their global norm (optax.normalize_by_update_norm):
    ``g / ((global_norm(updates) + eps) / scale_factor)``. State: EmptyState(). Not fused
    (one all-reduce per sharded leaf for the norm)."""
    _check_number(scale_factor, "normalize_by_update_norm: scale_factor")
    _check_number(eps, "normalize_by_update_norm: eps")

    def update(updates, state, params=None, **extra_args):
        del params
        cnp = _cnp()
        leaves = [to_array(x) for x in tree_leaves(updates)]
        sq = 0
        for x in leaves:
            sq = sq + cnp.sum(cnp.square(x))
        g_norm = (cnp.sqrt(sq) + eps) / scale_factor
        return tree_map(lambda g: to_array(g) / g_norm, updates), state
    return GradientTransformationExtraArgs(lambda params: EmptyState(), update)


def scale_by_param_block_norm(min_scale=1e-3) -> GradientTransformation:
    """Multiply each leaf by the norm of its param, at least ``min_scale``
    (optax.scale_by_param_block_norm: ``u * safe_norm(p, min_scale)``). Needs params.
    State: EmptyState(). Not fused."""
    _check_number(min_scale, "scale_by_param_block_norm: min_scale")

    def update(updates, state, params=None, **extra_args):
        _need_params(params, "scale_by_param_block_norm")
        return tree_map(lambda u, p: _like(u, to_array(p)) * safe_norm(to_array(p), min_scale),
                        updates, params), state
    return GradientTransformationExtraArgs(lambda params: EmptyState(), update)


def scale_by_distance_over_gradients(reps_rel=1e-6, eps=1e-8, param_dtype=np.float32,
                                     global_scale=1.0) -> GradientTransformation:
    """Layer-wise distance over gradients (optax.scale_by_distance_over_gradients, "LDoG").
    Per leaf: ``max_dist = max(max_dist, ||p - p0||)`` (starting at ``reps_rel * (1 +
    ||p0||)``), ``grad_sum_of_squares += sum(g**2)`` (a shape (1,) float32 array, as optax),
    and the update ``global_scale * max_dist / sqrt(grad_sum_of_squares + eps) * g``. Needs
    params. State: ScaleByDistanceOverGradientsState(max_dist, grad_sum_of_squares,
    init_params), the initial params cast to ``param_dtype``. Not fused."""
    for v, n in ((reps_rel, "reps_rel"), (eps, "eps"), (global_scale, "global_scale")):
        _check_number(v, f"scale_by_distance_over_gradients: {n}")
    param_dtype = _state_dtype(param_dtype, "param_dtype")

    def _l2(x, y=None):
        cnp = _cnp()
        d = x if y is None else x - y
        return cnp.sqrt(cnp.sum(cnp.square(d)))

    def init(params):
        return ScaleByDistanceOverGradientsState(
            tree_map(lambda x: reps_rel * (1 + _l2(to_array(x))), params),
            tree_map(lambda x: device_put(np.zeros(1, np.float32), _scalar_sharding(x)),
                     params),
            tree_map(lambda x: to_array(x) if param_dtype is None
                     else to_array(x).astype(param_dtype), params))

    def update(updates, state, params=None, **extra_args):
        _expect_state(state, ScaleByDistanceOverGradientsState,
                      "scale_by_distance_over_gradients")
        _need_params(params, "scale_by_distance_over_gradients")
        cnp = _cnp()
        max_dist = tree_map(lambda d, x, y: cnp.maximum(d, _l2(_like(x, y), y)),
                            state.max_dist, params, state.init_params)
        g = tree_map(_like, updates, state.init_params)
        g_sos = tree_map(lambda s, y: s + cnp.sum(cnp.square(y)),
                         state.grad_sum_of_squares, g)
        out = tree_map(lambda x, d, s: (global_scale * (d / cnp.sqrt(s + eps))) * x,
                       g, max_dist, g_sos)
        return out, ScaleByDistanceOverGradientsState(max_dist, g_sos, state.init_params)
    return GradientTransformationExtraArgs(init, update)


__all__ += ["ScaleByAdaDeltaState", "scale_by_adadelta", "ScaleByNovogradState",
            "scale_by_novograd", "ScaleByRpropState", "scale_by_rprop", "ScaleByAdanState",
            "scale_by_adan", "ScaleByOptimisticGradientState", "scale_by_optimistic_gradient",
            "normalize_by_update_norm", "scale_by_param_block_norm",
            "ScaleByDistanceOverGradientsState", "scale_by_distance_over_gradients"]


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
