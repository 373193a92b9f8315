"""jax.numpy parity bugs found by probing ctrainstate.numpy against jax: each test checks
against live jax when it is importable and otherwise against a numpy computation."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp


def _mesh_sharding(spec):
    return cts.NamedSharding(cts.make_mesh((2, 4), ("data", "model")), cts.P(*spec))


# --- jnp.dot with an n-d second operand (n > 2) -------------------------------------------------
# jnp.dot(a, b)[i, j, k, m] = sum(a[i, j, :] * b[k, :, m]): no batch dimensions (np.dot's rule),
# unlike matmul; ctrainstate's dot was matmul and silently gave matmul's (2, 3, 5) result.

DOT_SHAPES = [((2, 3, 4), (2, 4, 5)), ((4,), (2, 4, 5)), ((3, 4), (3, 4, 2)),
              ((2, 1, 3, 4), (5, 4, 2)), ((2, 3, 4), (4, 5)), ((3,), (3,)), ((), (3,)),
              ((2, 3), ())]


@pytest.mark.parametrize("sa,sb", DOT_SHAPES)
def test_dot_follows_np_dot_shapes(sa, sb):
    rng = np.random.default_rng(0)
    a = rng.standard_normal(sa).astype(np.float32)
    b = rng.standard_normal(sb).astype(np.float32)
    want = np.dot(a.astype(np.float64), b.astype(np.float64))     # numpy's dot: jnp's contract
    got = cnp.dot(cts.device_put(a), cts.device_put(b))
    assert got.shape == np.shape(want) and got.dtype == np.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_dot_nd_sharded_and_gradient():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 3, 4)).astype(np.float32)
    b = rng.standard_normal((2, 4, 8)).astype(np.float32)
    want = np.dot(a.astype(np.float64), b.astype(np.float64))
    sa = cts.device_put(a, _mesh_sharding(("data", None, None)))
    sb = cts.device_put(b, _mesh_sharding((None, None, "model")))
    np.testing.assert_allclose(np.asarray(cnp.dot(sa, sb)), want, rtol=1e-5, atol=1e-5)
    # d/da sum(dot(a, b)) = sum of b over its first and last axes, broadcast over a's rows
    ga = cts.grad(lambda u: cnp.sum(cnp.dot(u, b)))(a)
    np.testing.assert_allclose(np.asarray(ga), np.broadcast_to(b.sum(axis=(0, 2)), a.shape),
                               rtol=1e-5, atol=1e-5)


def test_dot_abstract_shape():
    S = cts.ShapeDtypeStruct
    out = cts.eval_shape(cnp.dot, S((2, 3, 4), np.float32), S((2, 4, 5), np.float32))
    assert tuple(out.shape) == (2, 3, 2, 5)


def test_dot_parity_with_jax():
    jnp = pytest.importorskip("jax.numpy")
    rng = np.random.default_rng(2)
    for sa, sb in DOT_SHAPES:
        a = rng.standard_normal(sa).astype(np.float32)
        b = rng.standard_normal(sb).astype(np.float32)
        want = jnp.dot(a, b)
        got = cnp.dot(a, cts.device_put(b))
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# --- var / std of integer and bool arrays ---------------------------------------------------------
# jnp.var / jnp.std of int32 or bool arrays promote to float32 (as jnp.mean does); they raised
# TypeError here.

@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
@pytest.mark.parametrize("axis", [None, 0, -1, (0, 1)])
def test_var_std_of_ints_are_float32(dtype, axis):
    x = (np.arange(32).reshape(4, 8) * 7 % 5).astype(dtype)
    for f in ("var", "std"):
        want = getattr(np, f)(x.astype(np.float64), axis=axis)
        for a in (cts.device_put(x), cts.device_put(x, _mesh_sharding(("data", "model")))):
            got = getattr(cnp, f)(a, axis=axis)
            assert got.dtype == np.float32, f
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["log1p", "expm1"])
def test_float_unaries_of_ints_promote(name):
    x = np.arange(-0, 6, dtype=np.int32)
    got = getattr(cnp, name)(cts.device_put(x))
    assert got.dtype == np.float32
    np.testing.assert_allclose(np.asarray(got), getattr(np, name)(x.astype(np.float64)), rtol=1e-6)


def test_var_std_of_ints_parity():
    jnp = pytest.importorskip("jax.numpy")
    x = (np.arange(32).reshape(4, 8) * 7 % 5).astype(np.int32)
    for f in ("var", "std", "log1p", "expm1"):
        want, got = getattr(jnp, f)(x), getattr(cnp, f)(cts.device_put(x))
        assert got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


# --- x ** <numpy float scalar> -------------------------------------------------------------------
# A numpy scalar is strongly typed in jax: float16_array ** np.float32(2) is float32 (and
# int32_array ** np.float32(2) float32). The x ** 2 -> square shortcut kept float16 (and raised
# for ints).

def test_pow_by_strong_numpy_float_promotes():
    x16 = np.array([1.5, 2.0, -3.0], np.float16)
    for p, want_dt in ((np.float32(2.0), np.float32), (np.float16(2.0), np.float16), (2.0, np.float16),
                       (2, np.float16), (np.int32(2), np.float16)):
        got = cts.device_put(x16) ** p
        assert got.dtype == want_dt, (p, got.dtype)
        np.testing.assert_array_equal(np.asarray(got).astype(np.float32),
                                      (x16.astype(np.float32) ** 2).astype(want_dt))
    got = cts.device_put(np.array([1, -2, 3], np.int32)) ** np.float32(2.0)
    assert got.dtype == np.float32 and np.asarray(got).tolist() == [1.0, 4.0, 9.0]


def test_pow_by_numpy_scalar_parity():
    jnp = pytest.importorskip("jax.numpy")
    for x in (np.array([1.5, 2.0, -3.0], np.float16), np.array([1.5, 2.0], jnp.bfloat16)):
        for p in (np.float32(2.0), np.float16(2.0), 2.0, 2):
            want, got = jnp.asarray(x) ** p, cts.device_put(x) ** p
            assert got.dtype == want.dtype, (x.dtype, p)
            np.testing.assert_array_equal(np.asarray(got).astype(np.float32),
                                          np.asarray(want).astype(np.float32))


# --- broadcast_to: the target shape is checked; int and bool operands ----------------------------
# jnp.broadcast_to raises ValueError when ``shape`` is not a broadcast of the operand's shape
# ((4, 8) -> (4, 1) or (8,)); ctrainstate returned a (4, 8) Array silently. It also refused
# int32 / uint32 / bool operands (masks), which jax broadcasts in their dtype.

@pytest.mark.parametrize("target", [(4, 1), (1, 8), (8,), (), (2, 4, 1)])
def test_broadcast_to_refuses_non_broadcast_shapes(target):
    x = cts.device_put(np.ones((4, 8), np.float32))
    with pytest.raises(ValueError, match="broadcast_to"):
        cnp.broadcast_to(x, target)
    with pytest.raises(ValueError, match="broadcast_to"):
        cnp.broadcast_to(np.ones((4, 8), np.int32), target)
    with pytest.raises(ValueError, match="broadcast_to"):
        cts.eval_shape(lambda a: cnp.broadcast_to(a, target),
                       cts.ShapeDtypeStruct((4, 8), np.float32))


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.bool_])
def test_broadcast_to_int_and_bool(dtype):
    rng = np.random.default_rng(3)
    x = rng.integers(0, 7, (1, 8)).astype(dtype)
    want = np.broadcast_to(x, (2, 4, 8))          # numpy's broadcast: the same values
    for a in (x, cts.device_put(x), cts.device_put(x, _mesh_sharding((None, "model")))):
        got = cnp.broadcast_to(a, (2, 4, 8))
        assert got.dtype == dtype and got.shape == (2, 4, 8)
        np.testing.assert_array_equal(np.asarray(got), want)
    sharded = cnp.broadcast_to(cts.device_put(x, _mesh_sharding((None, "model"))), (4, 8))
    assert sharded.sharding.spec == cts.P(None, "model")
    assert cnp.broadcast_to(True, (3,)).dtype == np.bool_
    assert cnp.broadcast_to(2, (3,)).dtype == np.int32


def test_broadcast_to_parity():
    jnp = pytest.importorskip("jax.numpy")
    for x in (np.array([[True], [False], [True]]), np.arange(3, dtype=np.int32)[:, None], True, 3):
        want, got = jnp.broadcast_to(x, (2, 3, 4)), cnp.broadcast_to(x, (2, 3, 4))
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --- jnp.linalg.norm of ints: float32 ---------------------------------------------------------------

def test_norms_of_ints_are_float32():
    xf = np.array([[3, -4, 0], [1, 2, -2]], np.float64)
    x = cts.device_put(xf.astype(np.int32))
    for got, want in ((cnp.linalg.norm(x), np.linalg.norm(xf)),
                      (cnp.linalg.norm(x, ord=1, axis=1), np.linalg.norm(xf, ord=1, axis=1)),
                      (cnp.linalg.norm(x, ord=np.inf, axis=0), np.linalg.norm(xf, ord=np.inf, axis=0)),
                      (cnp.linalg.vector_norm(x), np.linalg.norm(xf.ravel())),
                      (cnp.linalg.matrix_norm(x), np.linalg.norm(xf, "fro"))):
        assert got.dtype == np.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


# --- x.at[idx] updates of int32 / uint32 / bool Arrays (basic indices) ----------------------------
# HF's shift_tokens_right (Flax BART / T5 / Marian training scripts) updates int32 token ids:
# ``zeros_like(ids).at[:, 1:].set(ids[:, :-1]).at[:, 0].set(start)``; ctrainstate raised
# TypeError for every .at update of an integer Array.

def _shift_tokens_right(ids, np_, start=7, pad=0):
    s = np_.zeros_like(ids)
    s = s.at[:, 1:].set(ids[:, :-1])
    s = s.at[:, 0].set(start)
    return np_.where(s == -100, pad, s)


def test_shift_tokens_right_on_int_ids():
    rng = np.random.default_rng(4)
    ids = rng.integers(-100, 50, (4, 8)).astype(np.int32)
    ids[0, 3] = -100
    want = np.zeros_like(ids)                  # numpy, by hand: the same shift
    want[:, 1:] = ids[:, :-1]
    want[:, 0] = 7
    want[want == -100] = 0
    for a in (cts.device_put(ids), cts.device_put(ids, _mesh_sharding(("data", None))),
              cts.device_put(ids, _mesh_sharding(("data", "model")))):
        got = _shift_tokens_right(a, cnp)
        assert got.dtype == np.int32 and got.sharding == a.sharding
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("spec", [None, ("data", "model")])
def test_int_at_updates_cast_like_jax(spec):
    x = np.arange(-12, 20, dtype=np.int32).reshape(4, 8)
    a = cts.device_put(x) if spec is None else cts.device_put(x, _mesh_sharding(spec))
    # numpy references: set casts the value (2.7 -> 2); arithmetic runs in float32 for a
    # float value, then truncates back to int32 (as jax's scatter on the promoted values)
    ref = x.copy(); ref[0] = 2
    np.testing.assert_array_equal(np.asarray(a.at[0].set(2.7)), ref)
    ref = x.copy(); ref[:, 1:] += 3
    np.testing.assert_array_equal(np.asarray(a.at[:, 1:].add(3)), ref)
    ref = x.copy(); ref[1] = (ref[1] + np.float32(2.7)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(a.at[1].add(2.7)), ref)
    ref = x.copy(); ref[..., -1] = np.minimum(ref[..., -1], 0)
    np.testing.assert_array_equal(np.asarray(a.at[..., -1].min(0)), ref)
    ref = x.copy(); ref[2, 3] *= -2
    np.testing.assert_array_equal(np.asarray(a.at[2, 3].multiply(-2)), ref)
    ref = x.copy(); ref[:, 0] = np.arange(4)
    np.testing.assert_array_equal(np.asarray(a.at[:, 0].set(np.arange(4, dtype=np.int32))), ref)
    b = cts.device_put(x > 0)
    ref = x > 0; ref[1:3] = True
    got = b.at[1:3].set(True)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(np.asarray(got), ref)
    assert np.asarray(a).tolist() == x.tolist()      # functional: x unchanged
    with pytest.raises(TypeError, match="astype"):
        a.at[np.array([0, 2])].set(1)                 # advanced index: not here
    with pytest.raises(TypeError, match="astype"):
        b.at[0].add(True)


@pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types:FutureWarning")
def test_int_at_updates_parity():
    jnp = pytest.importorskip("jax.numpy")
    rng = np.random.default_rng(5)
    for x in (rng.integers(-5, 5, (4, 8)).astype(np.int32), rng.integers(0, 9, (4, 8)).astype(np.uint32)):
        for idx in [(0,), (slice(None), 0), (slice(None), slice(1, None)), (Ellipsis, -1), (1, 2)]:
            for meth in ("set", "add", "subtract", "multiply", "min", "max"):
                for v in (3, 2.7, np.int32(2)):
                    want = getattr(jnp.asarray(x).at[idx], meth)(v)
                    got = getattr(cts.device_put(x).at[idx], meth)(v)
                    assert got.dtype == want.dtype
                    np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                                  err_msg=f"{x.dtype} {idx} {meth} {v}")
    ids = rng.integers(-100, 50, (4, 8)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(_shift_tokens_right(cts.device_put(ids), cnp)),
                                  np.asarray(_shift_tokens_right(jnp.asarray(ids), jnp)))


# --- var / std ddof=, and jax.Array methods ported code calls ---------------------------------------
# jnp.var / jnp.std take ddof (``x.std(ddof=1)``); jax.Array has .var, .std, .prod, .cumsum,
# .round, .dot, .take, .sort, ... (these raised TypeError / AttributeError).

@pytest.mark.parametrize("ddof", [0, 1, 3, 8])
@pytest.mark.parametrize("axis", [None, 0, -1])
def test_var_std_ddof(ddof, axis):
    x = np.random.default_rng(6).standard_normal((8, 8)).astype(np.float32)
    xd = x.astype(np.float64)
    n = xd.size if axis is None else xd.shape[axis]
    # numpy's var with ddof, NaN where N - ddof <= 0 (jnp's rule; numpy gives inf there)
    want = np.var(xd, axis=axis, ddof=ddof) if n > ddof else np.full(np.var(xd, axis=axis).shape, np.nan)
    for a in (cts.device_put(x), cts.device_put(x, _mesh_sharding(("data", "model")))):
        np.testing.assert_allclose(np.asarray(cnp.var(a, axis=axis, ddof=ddof)), want, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(a.std(axis=axis, ddof=ddof)), np.sqrt(want), rtol=1e-5)


def test_array_methods_delegate_to_numpy_functions():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    xi = rng.integers(-5, 5, (4, 8)).astype(np.int32)
    a, ai = cts.device_put(x), cts.device_put(xi)
    close = np.testing.assert_allclose
    close(np.asarray(a.var(axis=0)), x.astype(np.float64).var(axis=0), rtol=1e-5)
    close(np.asarray(ai.std()), xi.astype(np.float64).std(), rtol=1e-6)
    close(np.asarray(a.prod(axis=1, keepdims=True)), x.prod(axis=1, keepdims=True), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(ai.cumsum(axis=1)), xi.cumsum(axis=1))
    assert ai.cumsum(dtype=np.float32).dtype == np.float32
    close(np.asarray(a.round(1)), np.round(x, 1), rtol=1e-6)
    close(np.asarray(a.dot(x.T)), x.astype(np.float64) @ x.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(a.take(np.array([0, 9]), axis=1, mode="clip")),
                                  x[:, [0, 7]])
    np.testing.assert_array_equal(np.asarray(a.sort(axis=0)), np.sort(x, axis=0))
    np.testing.assert_array_equal(np.asarray(ai.argsort(axis=-1)),
                                  np.argsort(xi, axis=-1, kind="stable"))
    np.testing.assert_array_equal(np.asarray(a.repeat(2, axis=1)), x.repeat(2, axis=1))
    np.testing.assert_array_equal(np.asarray(a.swapaxes(0, 1)), x.T)


def test_var_std_ddof_and_methods_parity():
    jnp = pytest.importorskip("jax.numpy")
    x = np.random.default_rng(8).standard_normal((8, 8)).astype(np.float32)
    for ddof in (0, 1, 8):
        for f in ("var", "std"):
            want = getattr(jnp, f)(x, axis=0, ddof=ddof)
            got = getattr(cnp, f)(x, axis=0, ddof=ddof)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    a, j = cts.device_put(x), jnp.asarray(x)
    for name, args, kw in (("var", (), {"ddof": 1}), ("std", (0,), {}), ("prod", (1,), {}),
                           ("cumsum", (0,), {}), ("round", (2,), {}), ("dot", (x,), {}),
                           ("sort", (), {}), ("argsort", (0,), {}), ("swapaxes", (0, 1), {})):
        want, got = getattr(j, name)(*args, **kw), getattr(a, name)(*args, **kw)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


# --- sum / mean with where= (masked losses: jnp.mean(loss, where=mask)) ---------------------------

@pytest.mark.parametrize("axis", [None, 0, 1])
@pytest.mark.filterwarnings("ignore:Mean of empty slice:RuntimeWarning")
def test_sum_mean_where(axis):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((8, 8)).astype(np.float32)
    m = rng.integers(0, 2, (8, 8)).astype(bool)
    m[3] = False                                   # a row with nothing selected
    xd = x.astype(np.float64)
    # numpy references: np.sum / np.mean with where= (mean: NaN where nothing is selected)
    with np.errstate(invalid="ignore", divide="ignore"):
        want_mean = np.mean(xd, axis=axis, where=m)
    want_sum = np.sum(xd, axis=axis, where=m)
    for a in (cts.device_put(x), cts.device_put(x, _mesh_sharding(("data", "model")))):
        np.testing.assert_allclose(np.asarray(cnp.sum(a, axis=axis, where=m)), want_sum,
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(cnp.mean(a, axis=axis, where=m)), want_mean,
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(a.mean(axis=axis, where=m)), want_mean,
                                   rtol=1e-5, atol=1e-6)
    xi = rng.integers(-5, 5, (8, 8)).astype(np.int32)
    got = cnp.sum(cts.device_put(xi), axis=axis, where=m)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(got), np.sum(xi, axis=axis, where=m))
    # d/dx mean(x**2, where=m) = 2 x m / count(m)
    g = cts.grad(lambda u: cnp.mean(u * u, where=m))(x)
    np.testing.assert_allclose(np.asarray(g), 2 * xd * m / m.sum(), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="broadcast"):
        cnp.mean(x, where=m[:3])


def test_sum_mean_where_parity():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(10)
    x = rng.standard_normal((8, 8)).astype(np.float32)
    m = rng.integers(0, 2, (1, 8)).astype(bool)
    for arr in (x, x.astype(np.float16), (x * 4).astype(np.int32), x > 0):
        for f in ("sum", "mean"):
            for axis in (None, 0, -1):
                want = getattr(jnp, f)(arr, axis=axis, where=m)
                got = getattr(cnp, f)(cts.device_put(arr), axis=axis, where=m)
                assert got.dtype == want.dtype, (f, arr.dtype)
                np.testing.assert_allclose(np.asarray(got).astype(np.float64),
                                           np.asarray(want).astype(np.float64), rtol=2e-3)
    want = jax.grad(lambda u: jnp.mean(u ** 2, where=m))(x)
    got = cts.grad(lambda u: cnp.mean(u ** 2, where=m))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


# --- tanh of NaN ---------------------------------------------------------------------------------
# The CPU kernel clamped |x| with fminf before exp, which turns NaN into 10: tanh(NaN) was 1.0
# (and its gradient 0), hiding a diverged activation; jnp.tanh(NaN) is NaN, tanh(-0.) is -0.

def test_tanh_keeps_nan_and_signed_zero():
    z = np.array([np.nan, -np.nan, -0.0, 0.0, np.inf, -np.inf, 0.3, -0.7, 9.0], np.float32)
    want = np.tanh(z)                                  # numpy's tanhf
    for a in (cts.device_put(z), cts.device_put(np.tile(z, 8).reshape(8, 9),
                                                 _mesh_sharding(("data", None)))):
        got = np.asarray(cnp.tanh(a)).reshape(-1, 9)[0]
        np.testing.assert_allclose(got, want, rtol=2e-7)      # NaN where NaN
        assert np.signbit(got[2]) and not np.signbit(got[3])
    g = np.asarray(cts.grad(lambda u: cnp.sum(cnp.tanh(u)))(z))
    assert np.isnan(g[:2]).all() and g[2] == 1.0     # d tanh = 1 - tanh^2
    gelu = np.asarray(cts.nn.gelu(cts.device_put(z[:2])))
    assert np.isnan(gelu).all()


# --- asarray of a list of Arrays with a 16-bit dtype ------------------------------------------------
# jnp.asarray([loss_a, loss_b], dtype=jnp.bfloat16) works; numpy's bfloat16 conversion of a list
# of Arrays raised "expected number, got Array" here.

def test_asarray_list_of_arrays_to_bfloat16():
    vals = [cts.device_put(np.float32(1.1)), cts.device_put(np.float32(2.5))]
    for dt in (cnp.bfloat16, np.float16):
        for f in (cnp.asarray, cnp.array):
            got = f(vals, dtype=dt)
            assert got.dtype == dt
            # numpy: the float32 values rounded once to dt
            np.testing.assert_array_equal(np.asarray(got),
                                          np.array([1.1, 2.5], np.float32).astype(dt))


# --- user errors jax crashes on or accepts silently -------------------------------------------------
# reshape(0, -1) of an empty array: numpy raises ValueError (any size fits the -1), jax a
# ZeroDivisionError; ctrainstate picked 0. one_hot(ids, 2.5): jax raises TypeError; ctrainstate
# truncated to 2 classes.

def test_reshape_minus_one_beside_zero_raises():
    e = cts.device_put(np.zeros((0, 4), np.float32))
    for shape in ((0, -1), (-1, 0), (2, 0, -1)):
        with pytest.raises(ValueError, match="ambiguous"):
            e.reshape(shape)
        with pytest.raises(ValueError, match="ambiguous"):
            cts.eval_shape(lambda a: a.reshape(shape), cts.ShapeDtypeStruct((0, 4), np.float32))
    assert e.reshape(-1, 4).shape == (0, 4) and e.reshape(-1).shape == (0,)   # numpy's too
    # the matmul gradient of an empty batch still works (it reshapes explicitly)
    g = cts.grad(lambda w: cnp.sum(cnp.matmul(np.zeros((2, 0, 3), np.float32), w)))(
        np.ones((3, 5), np.float32))
    assert np.asarray(g).tolist() == np.zeros((3, 5)).tolist()


def test_one_hot_num_classes_must_be_an_int():
    with pytest.raises(TypeError, match="num_classes"):
        cts.nn.one_hot(np.array([0, 1, 2], np.int32), 2.5)
    out = cts.nn.one_hot(np.array([0, 1], np.int32), np.int64(3))
    assert np.asarray(out).tolist() == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]


# --- jnp.float32(x) / jnp.int32(x) convert Arrays -----------------------------------------------------
# cnp.float32 was numpy's type: cnp.float32(array) pulled a sharded Array to a host ndarray (off
# the tape: no gradient), cnp.int32(array) / cnp.bfloat16(array) raised TypeError. jnp's scalar
# types convert to an Array of their dtype and still work as dtypes.

def test_dtype_names_convert_arrays():
    x = np.arange(8, dtype=np.float32).reshape(8, 1)
    a = cts.device_put(x, _mesh_sharding((("data", "model"), None)))
    m = cnp.float32(a > 2)
    assert isinstance(m, cts.Array) and m.dtype == np.float32 and m.sharding == a.sharding
    np.testing.assert_array_equal(np.asarray(m), (x > 2).astype(np.float32))
    i = cnp.int32(a * 1.5)
    assert isinstance(i, cts.Array) and i.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(i), (x * 1.5).astype(np.int32))   # truncation
    assert cnp.bfloat16(a).dtype == cnp.bfloat16 and cnp.bool_(a).dtype == np.bool_
    # d/dv sum(float32(v) * 2) = 2 (through the conversion, as jax)
    g = cts.grad(lambda v: cnp.sum(cnp.bfloat16(v).astype(cnp.float32) * 2.0))(x)
    assert np.asarray(g).tolist() == np.full((8, 1), 2.0).tolist()
    assert float(cnp.float32(2.5)) == 2.5 and isinstance(cnp.float32(2.5), cts.Array)
    # still dtypes, equal to numpy's types
    assert np.dtype(cnp.bfloat16) == np.dtype("bfloat16") and cnp.float32 == np.float32
    assert np.zeros(2, cnp.float16).dtype == np.float16 and a.dtype == cnp.float32
    assert {np.int32: "i"}[cnp.int32] == "i" and isinstance(np.float32(1), cnp.float32)
    assert cnp.zeros(2, cnp.int32).dtype == np.int32 and a.astype(cnp.bfloat16).dtype == cnp.bfloat16


def test_dtype_names_parity():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x = np.linspace(-2, 2, 8, dtype=np.float32)
    for name in ("float32", "float16", "bfloat16", "int32", "uint32", "bool_"):
        want, got = getattr(jnp, name)(x), getattr(cnp, name)(x)
        assert isinstance(got, cts.Array) and got.dtype == want.dtype, name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    want = jax.grad(lambda v: jnp.sum(jnp.float16(v) * 3.0).astype(jnp.float32))(x)
    got = cts.grad(lambda v: cnp.sum(cnp.float16(v) * 3.0).astype(cnp.float32))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
