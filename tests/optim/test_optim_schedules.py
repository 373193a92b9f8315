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


# --- optax-parity regressions of the schedules (found probing ctrainstate.optim against optax
# 0.2.8)

def test_piecewise_interpolate_float_boundaries_are_not_truncated():
    # optax stacks the boundaries into an array, so {2.5: 0.5, 6.5: 0.1} interpolates over
    # [0, 2.5) and [2.5, 6.5); they were truncated to 2 and 6. By hand (values 1, 0.5, 0.05):
    # count 1: 1 + (0.5 - 1) * 1/2.5 = 0.8; count 4: 0.5 + (0.05 - 0.5) * 1.5/4 = 0.33125;
    # cosine, count 1: 0.5 + (1 - 0.5) / 2 * (cos(pi * 0.4) + 1)
    lin = optim.piecewise_interpolate_schedule("linear", 1.0, {2.5: 0.5, 6.5: 0.1})
    for c, want in ((0, 1.0), (1, 0.8), (2, 0.6), (2.5, 0.5), (4, 0.33125), (6.5, 0.05), (9, 0.05)):
        np.testing.assert_allclose(float(lin(c)), want, rtol=1e-6, err_msg=str(c))
    cos = optim.piecewise_interpolate_schedule("cosine", 1.0, {2.5: 0.5, 6.5: 0.1})
    np.testing.assert_allclose(float(cos(1)), 0.5 + 0.25 * (np.cos(np.pi * 0.4) + 1), rtol=1e-6)
    # integer boundaries are unchanged: {4: 0.1, 8: 0.01} is optax's docstring example
    s = optim.piecewise_interpolate_schedule("linear", 1.0, {4: 0.1, 8: 0.01})
    np.testing.assert_allclose([float(s(i)) for i in range(0, 11, 2)],
                               [1.0, 0.55, 0.1, 0.0505, 0.001, 0.001], rtol=1e-6)


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_piecewise_interpolate_float_boundaries_match_optax(kind, jax_ref):
    bs = {2.5: 0.5, 6.5: 0.1, 7: 3.0, 0.3 * 31: 0.2}
    counts = list(range(-1, 13)) + [2.4, 2.5, 6.75, 9.3]

    def theirs(jax):
        so = __import__("optax").piecewise_interpolate_schedule(kind, 1.0, bs)
        return [float(so(c)) for c in counts]

    sc = optim.piecewise_interpolate_schedule(kind, 1.0, bs)
    for c, want in zip(counts, jax_ref("values", theirs), strict=True):
        np.testing.assert_allclose(float(sc(c)), want, rtol=1e-6, atol=1e-7, err_msg=str(c))


def test_join_schedules_passes_integer_counts():
    # optax passes `step - boundary` (an int32 count) to each later schedule; ctrainstate
    # passed a float, so a schedule indexing a table with its count raised TypeError (list
    # indices must be integers). By hand: 1.0 before the boundary 2, then table[count - 2].
    table = [0.5, 0.4, 0.3, 0.2]
    seen = []

    def from_table(c):
        seen.append(c)
        return table[min(c, 3)]
    s = optim.join_schedules([optim.constant_schedule(1.0), from_table], [2])
    assert [float(s(i)) for i in range(7)] == [1.0, 1.0, 0.5, 0.4, 0.3, 0.2, 0.2]
    assert all(type(c) is int for c in seen)
    assert float(s(np.int32(4))) == 0.3
    # through an optimizer (the count is the state's)
    tx = optim.sgd(s)
    p = {"w": np.ones(2, np.float32)}
    st, got = tx.init(p), []
    for _ in range(5):
        u, st = tx.update(p, st, p)
        got.append(float(np.asarray(u["w"])[0]))
    np.testing.assert_allclose(got, [-1.0, -1.0, -0.5, -0.4, -0.3], rtol=1e-6)
    # a float count still gives a float offset (optax: step - boundary in floats)
    lin = optim.join_schedules([optim.constant_schedule(0.0), lambda c: c], [2])
    assert float(lin(3.5)) == 1.5


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define, live when installed (those parts skip cleanly otherwise) and derived
# by hand

def _schedules(o):
    return {
        "pwi_lin": o.piecewise_interpolate_schedule("linear", 1.0, {4: 0.1, 8: 0.01}),
        "pwi_cos": o.piecewise_interpolate_schedule("cosine", 2.0, {3: 0.5, 5: 0.0, 9: 3.0}),
        "pwi_none": o.piecewise_interpolate_schedule("linear", 0.3),
        "lin1c": o.linear_onecycle_schedule(20, 0.1),
        "cos1c": o.cosine_onecycle_schedule(17, 0.05, pct_start=0.2),
        "wconst": o.warmup_constant_schedule(0.0, 1.0, 4),
        "wexp": o.warmup_exponential_decay_schedule(0.0, 1.0, 3, 2, 0.5, transition_begin=1,
                                                    staircase=True, end_value=0.1),
        "sgdr": o.sgdr_schedule([
            dict(init_value=0.0, peak_value=1.0, warmup_steps=2, decay_steps=6),
            dict(init_value=0.1, peak_value=0.5, warmup_steps=1, decay_steps=5, end_value=0.05)]),
    }


def test_more_schedules_derived_values():
    from ctrainstate import optim
    s = _schedules(optim)
    # optax's docstring: linear interpolation between the accumulated values 1, 0.1, 0.001
    assert [round(s["pwi_lin"](i), 6) for i in range(0, 11, 2)] == [1.0, 0.55, 0.1, 0.0505,
                                                                    0.001, 0.001]
    assert s["pwi_none"](0) == pytest.approx(0.3) and s["pwi_none"](100) == pytest.approx(0.3)
    # onecycle: peak/25 at 0, peak at int(0.3 * 20) = 6, peak/25 at 17, peak/25/1e4 at 20
    assert s["lin1c"](0) == pytest.approx(0.004) and s["lin1c"](6) == pytest.approx(0.1)
    assert s["lin1c"](17) == pytest.approx(0.004) and s["lin1c"](20) == pytest.approx(4e-7)
    assert s["cos1c"](3) == pytest.approx(0.05) and s["cos1c"](17) == pytest.approx(0.05 / 25 / 1e4)
    assert s["wconst"](2) == pytest.approx(0.5) and s["wconst"](50) == 1.0
    # sgdr: the second cycle starts at step 6 with its own warmup from 0.1
    assert s["sgdr"](6) == pytest.approx(0.1) and s["sgdr"](7) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="interpolate_type"):
        optim.piecewise_interpolate_schedule("quadratic", 1.0)


def test_more_schedules_match_optax(jax_ref):
    from ctrainstate import optim
    want = jax_ref("values", lambda optax: {
        k: np.array([float(f(i)) for i in range(25)]) for k, f in _schedules(optax).items()})
    got = _schedules(optim)
    for k in want:
        a = want[k]
        b = np.array([float(got[k](i)) for i in range(25)])
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-12, err_msg=k)
