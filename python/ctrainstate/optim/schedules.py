"""Learning-rate schedules (optax names and formulas): plain functions count -> float.

A schedule is evaluated once per step on the host (scalar math, never per
element) and its value handed to the fused kernel.

>>> import ctrainstate.optim as optim
>>> s = optim.linear_schedule(1.0, 0.0, transition_steps=4)
>>> [round(s(i), 3) for i in range(6)]
[1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["constant_schedule", "linear_schedule", "polynomial_schedule",
           "cosine_decay_schedule", "warmup_cosine_decay_schedule", "exponential_decay",
           "join_schedules", "piecewise_constant_schedule"]

_f32 = np.float32


def _c(count) -> float:
    return float(np.asarray(count))


def constant_schedule(value):
    """Always ``value``."""
    return lambda count: value


def polynomial_schedule(init_value, end_value, power, transition_steps, transition_begin=0):
    """(init - end) * (1 - t/T)**power + end with t = clip(count - begin, 0, T)."""
    if transition_steps <= 0:
        return lambda count: init_value
    transition_begin = max(transition_begin, 0)

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

    def schedule(count):
        c = min(_c(count), float(decay_steps))
        cd = _f32(0.5) * (_f32(1) + _f32(math.cos(_f32(math.pi) * _f32(c) / _f32(decay_steps))))
        decayed = (_f32(1) - _f32(alpha)) * cd ** _f32(exponent) + _f32(alpha)
        return float(_f32(init_value) * decayed)
    return schedule


def join_schedules(schedules, boundaries):
    """Schedule i from boundary i-1 on, each seeing the count since its boundary."""
    def schedule(step):
        s = _c(step)
        out = schedules[0](step)
        for b, sch in zip(boundaries, schedules[1:]):
            if not s < b:
                out = sch(s - b)
        return out
    return schedule


def warmup_cosine_decay_schedule(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0,
                                 exponent=1.0):
    """Linear warmup to ``peak_value`` then cosine decay to ``end_value``."""
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    return join_schedules(
        [linear_schedule(init_value, peak_value, warmup_steps),
         cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent)],
        [warmup_steps])
