"""The implementation of :mod:`ctrainstate.optim.schedules` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import functools
import math

import numpy as np

__all__ = ["constant_schedule", "linear_schedule", "polynomial_schedule",
           "cosine_decay_schedule", "warmup_cosine_decay_schedule", "exponential_decay",
           "join_schedules", "piecewise_constant_schedule", "piecewise_interpolate_schedule",
           "linear_onecycle_schedule", "cosine_onecycle_schedule", "warmup_constant_schedule",
           "warmup_exponential_decay_schedule", "sgdr_schedule"]

from ... import _C
from ..array.array import Array, device_put
from ..ops.node import op_node

_f32 = np.float32


def _c(count) -> float:
    return float(np.asarray(count))


def _on_count_placement(r, ins):
    """A schedule's value under jit: a float32 Array placed as the count Array is."""
    return device_put(np.asarray(r, np.float32), ins[0].sharding)


def _elementwise(schedule):
    """``schedule`` (of a scalar count) also taking an array of counts: a float32 array of
    the counts' shape, as optax's schedules give for an array step. Under jit, a schedule of
    a traced count (``schedule(state.step)``) is one op node of the program: its value is
    computed from each call's count and comes back as a float32 Array."""
    node = op_node("schedule", _on_count_placement)(lambda count: wrapped(count))

    @functools.wraps(schedule)
    def wrapped(count):
        if type(count) is Array and _C.trace_active():
            return node(count)
        if np.ndim(count) == 0:
            return schedule(count)
        counts = np.asarray(count)
        return np.array([schedule(c) for c in counts.reshape(-1)],
                        np.float32).reshape(counts.shape)
    return wrapped


def constant_schedule(value):
    """Always ``value``."""
    return lambda count: value


def polynomial_schedule(init_value, end_value, power, transition_steps, transition_begin=0):
    """(init - end) * (1 - t/T)**power + end with t = clip(count - begin, 0, T)."""
    if transition_steps <= 0:
        return lambda count: init_value
    transition_begin = max(transition_begin, 0)

    @_elementwise
    def schedule(count):
        c = min(max(_c(count) - transition_begin, 0.0), transition_steps)
        frac = _f32(1) - _f32(c) / _f32(transition_steps)
        return float((_f32(init_value) - _f32(end_value)) * frac ** _f32(power) + _f32(end_value))
    return schedule


def linear_schedule(init_value, end_value, transition_steps, transition_begin=0):
    """Linear from ``init_value`` to ``end_value`` over ``transition_steps``."""
    return polynomial_schedule(init_value, end_value, 1, transition_steps, transition_begin)


def piecewise_constant_schedule(init_value, boundaries_and_scales=None):
    """``init_value`` multiplied by every scale whose boundary the count has reached."""
    if boundaries_and_scales is not None:
        if not all(s >= 0.0 for s in boundaries_and_scales.values()):
            raise ValueError("`piecewise_constant_schedule` expects non-negative scale factors")

    @_elementwise
    def schedule(count):
        c = _c(count)
        v = _f32(init_value)
        for threshold, scale in sorted((boundaries_and_scales or {}).items()):
            if not threshold > c:
                v = v * _f32(scale)
        return float(v)
    return schedule


def exponential_decay(init_value, transition_steps, decay_rate, transition_begin=0,
                      staircase=False, end_value=None):
    """init * decay_rate ** ((count - begin) / transition_steps), clipped at ``end_value``."""
    if transition_steps <= 0 or decay_rate == 0:
        return lambda count: init_value
    transition_begin = max(transition_begin, 0)

    @_elementwise
    def schedule(count):
        d = _c(count) - transition_begin
        p = _f32(d) / _f32(transition_steps)
        if staircase:
            p = np.floor(p)
        v = _f32(init_value) if d <= 0 else _f32(init_value) * _f32(decay_rate) ** p
        if end_value is not None:
            v = max(v, _f32(end_value)) if decay_rate < 1.0 else min(v, _f32(end_value))
        return float(v)
    return schedule


def cosine_decay_schedule(init_value, decay_steps, alpha=0.0, exponent=1.0):
    """init * ((1 - alpha) * (0.5 * (1 + cos(pi * t / T)))**exponent + alpha), t = min(count, T)."""
    if not decay_steps > 0:
        raise ValueError(
            f"The cosine_decay_schedule requires positive decay_steps, got decay_steps={decay_steps}.")

    @_elementwise
    def schedule(count):
        c = min(_c(count), float(decay_steps))
        cd = _f32(0.5) * (_f32(1) + _f32(math.cos(_f32(math.pi) * _f32(c) / _f32(decay_steps))))
        decayed = (_f32(1) - _f32(alpha)) * cd ** _f32(exponent) + _f32(alpha)
        return float(_f32(init_value) * decayed)
    return schedule


def join_schedules(schedules, boundaries):
    """Schedule i from boundary i-1 on, each seeing the count since its boundary (an int
    when the count and the boundary are ints, as optax's ``step - boundary``)."""
    @_elementwise
    def schedule(step):
        s = _c(step)
        out = schedules[0](step)
        for b, sch in zip(boundaries, schedules[1:]):
            if not s < b:
                out = sch(_since(step, s, b))
        return out
    return schedule


def _since(step, s, boundary):
    """``step - boundary``: an int for an integer count and boundary, else a float."""
    ints = (int, np.integer)
    step = np.asarray(step)[()] if hasattr(step, "shape") else step
    if isinstance(step, ints) and isinstance(boundary, ints) and not isinstance(step, bool):
        return int(step) - int(boundary)
    return s - boundary


def warmup_cosine_decay_schedule(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0,
                                 exponent=1.0):
    """Linear warmup to ``peak_value`` then cosine decay to ``end_value``."""
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    return join_schedules(
        [linear_schedule(init_value, peak_value, warmup_steps),
         cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent)],
        [warmup_steps])


def warmup_constant_schedule(init_value, peak_value, warmup_steps):
    """Linear warmup to ``peak_value``, then constant."""
    return linear_schedule(init_value, peak_value, warmup_steps)


def warmup_exponential_decay_schedule(init_value, peak_value, warmup_steps, transition_steps,
                                      decay_rate, transition_begin=0, staircase=False,
                                      end_value=None):
    """Linear warmup to ``peak_value``, then :func:`exponential_decay` from there."""
    return join_schedules(
        [linear_schedule(init_value, peak_value, warmup_steps),
         exponential_decay(peak_value, transition_steps, decay_rate, transition_begin,
                           staircase, end_value)],
        [warmup_steps])


def sgdr_schedule(cosine_kwargs):
    """Warm restarts: one :func:`warmup_cosine_decay_schedule` per dict of ``cosine_kwargs``,
    each starting where the previous one's ``decay_steps`` end."""
    schedules, ends, step = [], [], 0
    for kw in cosine_kwargs:
        schedules.append(warmup_cosine_decay_schedule(**kw))
        step += kw["decay_steps"]
        ends.append(step)
    return join_schedules(schedules, ends[:-1])


def piecewise_interpolate_schedule(interpolate_type, init_value, boundaries_and_scales=None):
    """Values ``init_value * scale_1 * ... * scale_i`` reached at the boundaries, linearly
    (``'linear'``) or by a half cosine (``'cosine'``) interpolated in between; after the
    last boundary, its value."""
    if interpolate_type not in ("linear", "cosine"):
        raise ValueError("`interpolate_type` must be either 'cosine' or 'linear'")
    items = sorted((boundaries_and_scales or {}).items())
    if any(not sc >= 0.0 for _, sc in items):
        raise ValueError("`piecewise_interpolate_schedule` expects non-negative scale factors")
    # the boundaries as optax stacks them: integers stay integers; any float makes them all
    # float32 (a boundary 2.5 is 2.5, not truncated to 2)
    if all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b, _ in items):
        bounds = [0] + [int(b) for b, _ in items]
    else:
        bounds = [0.0] + [float(_f32(b)) for b, _ in items]
    values = [_f32(init_value)]
    for _, sc in items:
        values.append(values[-1] * _f32(sc))

    @_elementwise
    def schedule(count):
        c = _c(count)
        if c >= bounds[-1]:
            return float(values[-1])
        for i in range(len(bounds) - 1):
            lo, hi = bounds[i], bounds[i + 1]
            if lo <= c < hi:
                pct = _f32(c - lo) / _f32(max(hi - lo, 1))
                a, b = values[i], values[i + 1]
                if interpolate_type == "linear":
                    return float((b - a) * pct + a)
                return float(b + (a - b) / _f32(2) * (_f32(math.cos(_f32(math.pi) * pct)) + _f32(1)))
        return 0.0   # a count below 0 lies in no interval
    return schedule


def linear_onecycle_schedule(transition_steps, peak_value, pct_start=0.3, pct_final=0.85,
                             div_factor=25.0, final_div_factor=1e4):
    """One cycle: linear from ``peak/div_factor`` up to ``peak`` (at ``pct_start``), back down
    (at ``pct_final``), then to ``peak/div_factor/final_div_factor`` at ``transition_steps``."""
    if transition_steps <= 0:
        raise ValueError("A linear onecycle schedule was set with a non-positive "
                         "`transition_steps`")
    return piecewise_interpolate_schedule(
        "linear", peak_value / div_factor,
        {int(pct_start * transition_steps): div_factor,
         int(pct_final * transition_steps): 1.0 / div_factor,
         transition_steps: 1.0 / final_div_factor})


def cosine_onecycle_schedule(transition_steps, peak_value, pct_start=0.3, div_factor=25.0,
                             final_div_factor=1e4):
    """One cycle with cosine ramps: up to ``peak_value`` at ``pct_start``, then down to
    ``peak/div_factor/final_div_factor`` at ``transition_steps``."""
    if transition_steps <= 0:
        raise ValueError("A cosine onecycle schedule was set with a non-positive "
                         "`transition_steps`")
    return piecewise_interpolate_schedule(
        "cosine", peak_value / div_factor,
        {int(pct_start * transition_steps): div_factor,
         int(transition_steps): 1.0 / (div_factor * final_div_factor)})


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
