"""Schedules (optim/schedules.py) of an array of steps: a float32 array of the steps' shape,
each value the scalar schedule's, and (with optax) optax's values."""
import numpy as np
import pytest

import ctrainstate.optim as optim

try:
    import jax.numpy as jnp
    import optax
    HAVE_OPTAX = True
except Exception:   # pragma: no cover - the file runs without jax
    HAVE_OPTAX = False

SCHEDULES = {
    "constant_schedule": dict(value=0.3),
    "linear_schedule": dict(init_value=1.0, end_value=0.1, transition_steps=40,
                            transition_begin=5),
    "polynomial_schedule": dict(init_value=1.0, end_value=0.0, power=2, transition_steps=60),
    "cosine_decay_schedule": dict(init_value=0.1, decay_steps=100, exponent=2),
    "cosine_decay_schedule_alpha": dict(init_value=0.1, decay_steps=30, alpha=0.2),
    "warmup_cosine_decay_schedule": dict(init_value=0.0, peak_value=1.0, warmup_steps=10,
                                         decay_steps=80, end_value=0.01),
    "exponential_decay": dict(init_value=1.0, transition_steps=10, decay_rate=0.5,
                              transition_begin=3, staircase=True, end_value=0.05),
    "piecewise_constant_schedule": dict(init_value=1.0,
                                        boundaries_and_scales={10: 0.5, 50: 0.1}),
    "piecewise_interpolate_schedule": dict(interpolate_type="cosine", init_value=1.0,
                                           boundaries_and_scales={10: 2.0, 60: 0.1}),
    "linear_onecycle_schedule": dict(transition_steps=100, peak_value=1.0),
    "cosine_onecycle_schedule": dict(transition_steps=100, peak_value=1.0),
    "warmup_constant_schedule": dict(init_value=0.0, peak_value=1.0, warmup_steps=20),
    "warmup_exponential_decay_schedule": dict(init_value=0.0, peak_value=1.0, warmup_steps=10,
                                              transition_steps=20, decay_rate=0.5),
    "sgdr_schedule": dict(cosine_kwargs=[
        dict(init_value=0.0, peak_value=1.0, warmup_steps=5, decay_steps=40),
        dict(init_value=0.0, peak_value=0.5, warmup_steps=5, decay_steps=40)]),
}


SCHEDULES["join_schedules"] = None   # built from two of the library's own, in _make
# optax's piecewise interpolation (and the one-cycle schedules built on it) compares the
# step with its boundaries by broadcasting: an array of steps fails there
OPTAX_SCALAR_ONLY = {"piecewise_interpolate_schedule", "linear_onecycle_schedule",
                     "cosine_onecycle_schedule"}


def _make(lib, case):
    if case == "join_schedules":
        return lib.join_schedules([lib.linear_schedule(1.0, 0.5, 10),
                                   lib.exponential_decay(0.5, 5, 0.9)], [12])
    name = case[:-len("_alpha")] if case.endswith("_alpha") else case
    return getattr(lib, name)(**SCHEDULES[case])


def test_every_schedule_is_covered():
    assert {c[:-len("_alpha")] if c.endswith("_alpha") else c for c in SCHEDULES} == set(
        optim.schedules.__all__)


STEPS = np.array([0, 3, 10, 11, 25, 50, 59, 60, 99, 100, 150])


@pytest.mark.parametrize("case", sorted(SCHEDULES))
def test_schedule_of_an_array_of_steps_is_elementwise(case):
    sched = _make(optim, case)
    out = sched(STEPS)
    want = np.array([sched(int(c)) for c in STEPS], np.float32)
    if case == "constant_schedule":   # optax's constant ignores the step: its value
        assert out == 0.3
        return
    assert out.shape == STEPS.shape and out.dtype == np.float32
    np.testing.assert_array_equal(out, want)
    grid = sched(STEPS.reshape(1, -1, 1))
    assert grid.shape == (1, STEPS.size, 1)
    np.testing.assert_array_equal(grid.reshape(-1), want)


@pytest.mark.parametrize("case", sorted(SCHEDULES))
def test_schedule_of_an_array_of_steps_matches_optax(case, jax_ref):
    if case in OPTAX_SCALAR_ONLY:   # compared step by step instead
        theirs = jax_ref("steps", lambda jax: [_make(optax, case)(jnp.asarray(c)) for c in STEPS])
        for c, t in zip(STEPS, theirs, strict=True):
            np.testing.assert_allclose(_make(optim, case)(c), t, rtol=2e-6, atol=1e-7)
        return
    ours = np.asarray(_make(optim, case)(STEPS))
    theirs = np.asarray(jax_ref("array", lambda jax: _make(optax, case)(jnp.asarray(STEPS))))
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=2e-6, atol=1e-7)


def test_cosine_decay_schedule_with_exponent_of_an_array_step():
    out = optim.cosine_decay_schedule(0.1, 100, exponent=2)(np.array([0, 10, 50]))
    want = 0.1 * (0.5 * (1 + np.cos(np.pi * np.array([0, 10, 50]) / 100))) ** 2
    np.testing.assert_allclose(out, want, rtol=1e-6)
    np.testing.assert_allclose(optim.linear_schedule(1.0, 0.0, 4)(np.arange(6)),
                               [1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
