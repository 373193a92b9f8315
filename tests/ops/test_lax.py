"""ctrainstate.lax's control flow and primitives: values against numpy (derived here, without
jax), against jax (recorded in tests/data/recorded, live in each test's twin marked `parity`:
`jax_ref`), on sharded operands against one device,
gradients against jax.grad (or an analytic derivative), and jax's strictness (no implicit
promotion or rank broadcasting) with clear errors."""
import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import lax

RNG = np.random.default_rng(0)
XF = RNG.standard_normal((4, 8)).astype(np.float32)
YF = RNG.standard_normal((4, 8)).astype(np.float32) + 2.5
XI = RNG.integers(-50, 50, (4, 8)).astype(np.int32)
YI = RNG.integers(1, 9, (4, 8)).astype(np.int32) * np.where(RNG.random((4, 8)) < 0.5, -1, 1).astype(np.int32)
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(autouse=True)
def _own_rng(twin_seed):
    """Each test draws from a stream of its own: the same in its recorded and live twins."""
    global RNG
    RNG = np.random.default_rng(twin_seed)


@pytest.fixture(scope="module")
def mesh():
    return cts.make_mesh((2, 4), ("data", "model"))


def _sharded(h, mesh, spec=("data", "model")):
    return cts.device_put(h, cts.NamedSharding(mesh, cts.P(*spec)))


def _np_trunc_div(a, b):
    return (np.abs(a) // np.abs(b) * np.sign(a) * np.sign(b)).astype(a.dtype)


FLOAT_UNARY = [
    ("exp", np.exp, XF), ("log", np.log, YF), ("sqrt", np.sqrt, YF),
    ("rsqrt", lambda v: 1 / np.sqrt(v), YF), ("tanh", np.tanh, XF),
    ("logistic", lambda v: 1 / (1 + np.exp(-v)), XF), ("sin", np.sin, XF), ("cos", np.cos, XF),
    ("neg", np.negative, XF), ("abs", np.abs, XF), ("square", np.square, XF),
]
BINARY = [
    ("add", np.add, XF, YF), ("sub", np.subtract, XF, YF), ("mul", np.multiply, XF, YF),
    ("div", np.divide, XF, YF), ("max", np.maximum, XF, YF), ("min", np.minimum, XF, YF),
    ("pow", np.power, YF, XF), ("rem", np.fmod, XF * 7, YF),
    ("add", np.add, XI, YI), ("sub", np.subtract, XI, YI), ("mul", np.multiply, XI, YI),
    ("div", _np_trunc_div, XI, YI), ("rem", np.fmod, XI, YI), ("max", np.maximum, XI, YI),
    ("min", np.minimum, XI, YI),
]


@pytest.mark.parametrize("name,ref,h", FLOAT_UNARY, ids=[c[0] for c in FLOAT_UNARY])
def test_unary_values_sharded_and_single(name, ref, h, mesh):
    want = ref(h.astype(np.float64)).astype(np.float32)
    one = np.asarray(getattr(lax, name)(cts.device_put(h)))
    np.testing.assert_allclose(one, want, rtol=2e-6, atol=1e-6)
    sh = getattr(lax, name)(_sharded(h, mesh))
    np.testing.assert_array_equal(np.asarray(sh), one)


@pytest.mark.parametrize("name,ref,a,b", BINARY,
                         ids=[f"{c[0]}-{c[2].dtype}" for c in BINARY])
def test_binary_values_sharded_and_single(name, ref, a, b, mesh):
    want = ref(a, b)
    one = getattr(lax, name)(cts.device_put(a), cts.device_put(b))
    assert one.dtype == a.dtype
    if a.dtype == np.int32:
        np.testing.assert_array_equal(np.asarray(one), want)
    else:
        np.testing.assert_allclose(np.asarray(one), want, rtol=2e-6, atol=1e-6)
    sh = getattr(lax, name)(_sharded(a, mesh), _sharded(b, mesh))
    np.testing.assert_array_equal(np.asarray(sh), np.asarray(one))


def test_int_unary_and_integer_pow():
    x = cts.device_put(XI)
    np.testing.assert_array_equal(np.asarray(lax.neg(x)), -XI)
    np.testing.assert_array_equal(np.asarray(lax.abs(x)), np.abs(XI))
    np.testing.assert_array_equal(np.asarray(lax.square(x)), XI * XI)
    np.testing.assert_array_equal(np.asarray(lax.integer_pow(x, 3)), XI ** 3)
    np.testing.assert_array_equal(np.asarray(lax.integer_pow(x, 0)), np.ones_like(XI))
    np.testing.assert_allclose(np.asarray(lax.integer_pow(cts.device_put(YF), -3)),
                               YF.astype(np.float64) ** -3, rtol=1e-6)
    with pytest.raises(TypeError, match="cannot be raised to negative powers"):
        lax.integer_pow(x, -1)
    with pytest.raises(TypeError, match="does not accept dtype bool"):
        lax.integer_pow(np.array([True]), 2)


def test_elementwise_match_jax(jax_ref):
    for name, _, h in FLOAT_UNARY:
        np.testing.assert_allclose(np.asarray(getattr(lax, name)(h)),
                                   jax_ref(None, lambda jlax: getattr(jlax, name)(h)), rtol=2e-6,
                                   atol=1e-6, err_msg=name)
    for name, _, a, b in BINARY:
        got, want = getattr(lax, name)(a, b), jax_ref(None, lambda jlax: getattr(jlax, name)(a, b))
        assert got.dtype == want.dtype, name
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-6,
                                   err_msg=name)
    # XLA's integer corner cases: division by zero, INT_MIN / -1; rem keeps the dividend's sign
    for dt in (np.int32, np.uint32):
        a = np.array([-7, 7, 0, 5, -(2 ** 31), 9], np.int64).astype(dt)
        b = np.array([0, 0, 0, -2, -1, 4], np.int64).astype(dt)
        for name in ("div", "rem"):
            np.testing.assert_array_equal(np.asarray(getattr(lax, name)(a, b)), jax_ref(
                None, lambda jlax: getattr(jlax, name)(a, b)), err_msg=name)
    f = np.array([-7.5, 7.5, -0.0, 3.0, 1e-30, 5.0], np.float32)
    g = np.array([2.0, -2.0, 3.0, 0.0, -1.0, np.inf], np.float32)
    got, want = np.asarray(lax.rem(f, g)), jax_ref(None, lambda jlax: jlax.rem(f, g))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    bf = XF.astype(BF16)
    for name in ("add", "mul", "max"):
        got = getattr(lax, name)(bf, bf)
        assert got.dtype == BF16
        np.testing.assert_array_equal(np.asarray(got).astype(np.float32), jax_ref(
            None, lambda jlax: getattr(jlax, name)(bf, bf)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(lax.integer_pow(XI, 3)),
                                  jax_ref(None, lambda jlax: jlax.integer_pow(XI, 3)))
    w = np.array([0.5, 1.0, 1.5, 2.0, 2.5], np.float32)
    np.testing.assert_array_equal(np.asarray(cts.grad(lambda v: cnp.sum(lax.clamp(1.0, v, 2.0)))(w)),
                                  jax_ref(None, lambda jax, jlax: jax.grad(
                                      lambda v: jlax.clamp(1.0, v, 2.0).sum())(w)))
    gx, gy = cts.grad(lambda p, q: cnp.sum(lax.rem(p, q)), argnums=(0, 1))(XF * 7, YF)
    jx, jy = jax_ref(None, lambda jax, jlax: jax.grad(lambda p, q: jlax.rem(p, q).sum(),
                                                      argnums=(0, 1))(XF * 7, YF))
    np.testing.assert_allclose(np.asarray(gx), np.asarray(jx))
    np.testing.assert_allclose(np.asarray(gy), np.asarray(jy))


STRICT = [   # (call, exception, message fragment): jax raises the same exception type
    (lambda m: m.add(XF, XI), TypeError, "requires arguments to have the same dtypes"),
    (lambda m: m.add(XF, 1), TypeError, "same dtypes, got float32, int32"),
    (lambda m: m.add(XF.astype(np.float16), 1.0), TypeError, "same dtypes"),
    (lambda m: m.add(XF, XF[0]), TypeError, "same number of dimensions"),
    (lambda m: m.mul(XF, XF[:3, :3]), TypeError, "incompatible shapes for broadcasting"),
    (lambda m: m.exp(XI), TypeError, "does not accept dtype int32"),
    (lambda m: m.add(np.array([True]), np.array([True])), TypeError, "does not accept dtype bool"),
    (lambda m: m.abs(XI.astype(np.uint32)), TypeError, "does not accept dtype uint32"),
    (lambda m: m.pow(XI, XI), TypeError, "first argument to pow must have an inexact dtype"),
    (lambda m: m.select(XF > 0, XF, XI), TypeError, "same dtypes"),
    (lambda m: m.select(XF > 0, XF, XF[:1]), TypeError, "must have the same shapes"),
    (lambda m: m.select(XF[:, :1] > 0, XF, XF), TypeError, "must be scalar or have the same shape"),
    (lambda m: m.select_n(np.array([0.5]), XF[0, :1], XF[0, :1]), TypeError,
     "must be boolean or integer"),
    (lambda m: m.select_n(np.array([True]), *[XF[0, :1]] * 3), TypeError, "cannot have > 2"),
    (lambda m: m.clamp(np.zeros(3, np.float32), XF, 1.0), TypeError, "min.shape == operand.shape"),
    (lambda m: m.clamp(0, XF, 1.0), TypeError, "same dtypes"),
    (lambda m: m.concatenate([XF, XI], 0), TypeError, "same dtypes"),
    (lambda m: m.concatenate([XF, XF[:, :2]], 0), TypeError, "differ in dimensions other"),
    (lambda m: m.concatenate([XF, XF], -1), TypeError, "dimension out of bounds"),
    (lambda m: m.concatenate([], 0), ValueError, "non-empty"),
    (lambda m: m.pad(XF, np.int32(0), [(0, 0, 0)] * 2), TypeError, "must be same dtype"),
    (lambda m: m.pad(XF, 0.0, [(0, 0, -1)] * 2), ValueError, "interior padding"),
    (lambda m: m.pad(XF, 0.0, [(-9, 0, 0)] * 2), ValueError, "not at least 0"),
    (lambda m: m.pad(XF, 0.0, [(0, 0, 0)]), ValueError, "length of padding_config"),
    (lambda m: m.pad(XF, np.zeros(2, np.float32), [(0, 0, 0)] * 2), ValueError,
     "padding_value must be a scalar"),
    (lambda m: m.transpose(XF, (0, 0)), TypeError, "isn't a permutation"),
    (lambda m: m.transpose(XF, (-1, 0)), TypeError, "isn't a permutation"),
    (lambda m: m.reshape(XF, (-1,)), TypeError, "must all be positive"),
    (lambda m: m.reshape(XF, (4, 8), (0, 0)), TypeError, "must be a permutation"),
    (lambda m: m.squeeze(XF, (0,)), ValueError, "size not equal to one"),
    (lambda m: m.expand_dims(XF, (0, 0)), ValueError, "repeated axis"),
    (lambda m: m.broadcast_in_dim(XF[0], (4, 9), (1,)), TypeError, "operand dimension sizes"),
    (lambda m: m.broadcast_in_dim(XF, (8,), (0,)), TypeError, "must have length equal"),
    (lambda m: m.broadcast_in_dim(XF[0], (4, 8), (2,)), TypeError, "subset of output"),
    (lambda m: m.rev(XF, (-1,)), TypeError, "nonnegative"),
    (lambda m: m.rev(XF, (0, 0)), TypeError, "unique"),
    (lambda m: m.slice(XF, (5, 0), (4, 8)), TypeError, "slice"),
    (lambda m: m.index_in_dim(XF, 4), IndexError, "out of bounds"),
    (lambda m: m.reduce_max(XI, (-1,)), ValueError, "out-of-bounds"),
    (lambda m: m.reduce_sum(XF, (0, 0)), ValueError, "duplicate"),
    (lambda m: m.reduce_sum(XF > 0, (0,)), TypeError, "does not accept dtype bool"),
    (lambda m: m.argmax(XF, -1, np.int32), ValueError, "Invalid axis"),
    (lambda m: m.argmax(XF, 0, np.float32), TypeError, "index_dtype must be an integer"),
    (lambda m: m.cumsum(XF > 0), TypeError, "does not accept dtype bool"),
    (lambda m: m.top_k(XF, 9), ValueError, "no larger than size"),
    (lambda m: m.top_k(XF, -1), ValueError, "nonnegative"),
    (lambda m: m.iota(np.bool_, 3), TypeError, "does not accept dtype bool"),
    (lambda m: m.broadcasted_iota(np.int32, (2, 3), 2), ValueError, "iota dimension"),
    (lambda m: m.full((2,), np.ones(2, np.float32)), TypeError, "scalar fill_value"),
    (lambda m: m.dot_general(XF, XF, (((1,), (0,)), ((), ()))), TypeError,
     "contracting dimensions to have the same shape"),
    (lambda m: m.dot_general(XF, XF, (((1, 1), (1, 1)), ((), ()))), TypeError, "distinct"),
    (lambda m: m.dot_general(XF, XF, (((2,), (1,)), ((), ()))), TypeError, "nonnegative and less"),
    (lambda m: m.dot_general(XF[None], XF[None].repeat(2, 0), (((2,), (2,)), ((0,), (0,)))),
     TypeError, "batch dimensions to have the same shape"),
    (lambda m: m.sort((XF[0], XF[0, :3])), TypeError, "equal shapes"),
    (lambda m: m.sort(XF, num_keys=2), ValueError, "num_keys"),
]


def _error_type(call, jlax):
    try:
        call(jlax)
    except Exception as e:   # noqa: BLE001 - its type is compared
        return [c.__name__ for c in type(e).__mro__]
    return None


@pytest.mark.parametrize("k", range(len(STRICT)))
def test_strict_errors(k, jax_ref):
    call, exc, frag = STRICT[k]
    with pytest.raises(exc, match=frag):
        call(lax)
    # jax refuses the same call with the same exception type (or a subclass)
    assert exc.__name__ in (jax_ref("error", lambda jlax: _error_type(call, jlax)) or [])


def test_weak_python_scalars_and_host_operands():
    np.testing.assert_array_equal(np.asarray(lax.add(XF, 1.0)), XF + np.float32(1))
    np.testing.assert_array_equal(np.asarray(lax.add(XI, 3)), XI + 3)
    np.testing.assert_array_equal(np.asarray(lax.add(XF, XF.astype(np.float64))), XF + XF)
    r = lax.add(1, 2)
    assert r.dtype == np.int32 and int(np.asarray(r)) == 3
    np.testing.assert_array_equal(np.asarray(lax.mul(XF[:1], XF)), XF[:1] * XF)   # size-1 dims


def test_select_and_select_n_values_and_gradients(mesh):
    p = XF > 0
    np.testing.assert_array_equal(np.asarray(lax.select(p, XF, YF)), np.where(p, XF, YF))
    which = RNG.integers(-2, 5, (4, 8)).astype(np.int32)     # out of range: clamped
    cases = [XF, YF, XF * 3]
    want = np.choose(np.clip(which, 0, 2), cases)
    np.testing.assert_array_equal(np.asarray(lax.select_n(which, *cases)), want)
    sh = lax.select_n(_sharded(which, mesh), *[_sharded(c, mesh) for c in cases])
    np.testing.assert_array_equal(np.asarray(sh), want)
    np.testing.assert_array_equal(np.asarray(lax.select(True, XF, YF)), XF)
    g = cts.grad(lambda a, b: cnp.sum(lax.select(p, a, b) * YF), argnums=(0, 1))(XF, XF)
    np.testing.assert_array_equal(np.asarray(g[0]), np.where(p, YF, 0))
    np.testing.assert_array_equal(np.asarray(g[1]), np.where(p, 0, YF))
    # the branch not taken leaks no NaN into the gradient
    gl = cts.grad(lambda a: cnp.sum(lax.select(a > 0, lax.log(a), a)))(XF)
    assert np.isfinite(np.asarray(gl)).all()


def test_shape_ops_against_numpy(mesh):
    x = cts.device_put(XF)
    v = XF[0, :4]
    np.testing.assert_array_equal(np.asarray(lax.broadcast_in_dim(v, (3, 4, 2), (1,))),
                                  np.broadcast_to(v[None, :, None], (3, 4, 2)))
    np.testing.assert_array_equal(np.asarray(lax.broadcast_in_dim(XF[:1], (2, 4, 8), (0, 2))),
                                  np.broadcast_to(XF[:1][:, None, :], (2, 4, 8)))
    np.testing.assert_array_equal(np.asarray(lax.broadcast_in_dim(XF, (8, 3, 4), (2, 0))),
                                  np.broadcast_to(XF.T[:, None, :], (8, 3, 4)))
    np.testing.assert_array_equal(np.asarray(lax.broadcast(v, (2, 3))),
                                  np.broadcast_to(v, (2, 3, 4)))
    np.testing.assert_array_equal(np.asarray(lax.iota(np.int32, 5)), np.arange(5))
    np.testing.assert_array_equal(np.asarray(lax.broadcasted_iota(np.float32, (3, 4), 1)),
                                  np.broadcast_to(np.arange(4, dtype=np.float32), (3, 4)))
    f = lax.full((2, 3), 1.5, np.int32)
    assert f.dtype == np.int32 and (np.asarray(f) == 1).all()
    assert lax.full((2,), 2.0).dtype == np.float32
    fl = lax.full_like(_sharded(XF, mesh), 3)
    assert fl.sharding == _sharded(XF, mesh).sharding and (np.asarray(fl) == 3).all()
    np.testing.assert_array_equal(np.asarray(lax.reshape(x, (8, 4))), XF.reshape(8, 4))
    np.testing.assert_array_equal(np.asarray(lax.reshape(x, (32,), (1, 0))), XF.T.reshape(32))
    np.testing.assert_array_equal(np.asarray(lax.squeeze(XF[:, None], (1,))), XF)
    np.testing.assert_array_equal(np.asarray(lax.squeeze(XF[:, :, None], (-1,))), XF)
    assert lax.expand_dims(x, (0, -1)).shape == (1, 4, 8, 1)
    np.testing.assert_array_equal(np.asarray(lax.transpose(_sharded(XF, mesh), (1, 0))), XF.T)
    np.testing.assert_array_equal(np.asarray(lax.concatenate([x, XF[:2]], 0)),
                                  np.concatenate([XF, XF[:2]], 0))
    np.testing.assert_array_equal(np.asarray(lax.rev(_sharded(XF, mesh), (0, 1))), XF[::-1, ::-1])
    np.testing.assert_array_equal(np.asarray(lax.slice(x, (1, 2), (4, 8), (2, 3))), XF[1:4:2, 2:8:3])
    np.testing.assert_array_equal(np.asarray(lax.slice_in_dim(x, -3, None, axis=1)), XF[:, -3:])
    np.testing.assert_array_equal(np.asarray(lax.slice_in_dim(x, None, None, 2)), XF[::2])
    np.testing.assert_array_equal(np.asarray(lax.index_in_dim(x, -1, 1, False)), XF[:, -1])
    np.testing.assert_array_equal(np.asarray(lax.index_in_dim(x, 2)), XF[2:3])
    c = lax.convert_element_type(np.array([1.7, -1.7, 3e9, np.nan], np.float32), np.int32)
    np.testing.assert_array_equal(np.asarray(c), [1, -1, np.iinfo(np.int32).max, 0])


def _np_pad(x, value, config):
    """lax.pad from its definition: the operand's elements land at lo + i * (interior + 1)
    of a buffer holding every position of the padded result, negative lo shifting them left."""
    out_shape = tuple(n + lo + hi + max(n - 1, 0) * it for n, (lo, hi, it) in zip(x.shape, config))
    out = np.full(out_shape, value, x.dtype)
    for idx in np.ndindex(*x.shape):
        pos = tuple(lo + i * (it + 1) for i, (lo, hi, it) in zip(idx, config))
        if all(0 <= p < n for p, n in zip(pos, out_shape)):
            out[pos] = x[idx]
    return out


PADS = [[(1, 2, 0), (0, 0, 0)], [(0, 0, 1), (2, -3, 2)], [(-1, 2, 1), (-2, -1, 0)],
        [(-3, 1, 2), (0, 0, 3)], [(0, -3, 0), (1, 1, 0)], [(-4, 1, 0), (0, 0, 0)]]


@pytest.mark.parametrize("config", PADS, ids=[str(c) for c in PADS])
def test_pad_values_sharded_and_gradient(config, mesh, jax_ref):
    want = _np_pad(XF, -1.5, config)
    got = lax.pad(cts.device_put(XF), -1.5, config)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(lax.pad(_sharded(XF, mesh), -1.5, config)), want)
    np.testing.assert_array_equal(np.asarray(lax.pad(XI, np.int32(7), config)),
                                  _np_pad(XI, 7, config))
    # d sum(pad(x, v) * w) / dx: w at the operand's positions; / dv: the sum of w elsewhere
    w = RNG.standard_normal(want.shape).astype(np.float32)
    gx, gv = cts.grad(lambda a, v: cnp.sum(lax.pad(a, v, config) * w), argnums=(0, 1))(
        XF, cts.device_put(np.float32(0.5)))
    marker = _np_pad(np.arange(1, XF.size + 1, dtype=np.float32).reshape(XF.shape), 0, config)
    gx_want = np.zeros(XF.size, np.float32)
    for v_, ww in zip(marker.ravel(), w.ravel()):
        if v_:
            gx_want[int(v_) - 1] += ww
    np.testing.assert_allclose(np.asarray(gx), gx_want.reshape(XF.shape))
    np.testing.assert_allclose(float(np.asarray(gv)), float(w[marker == 0].sum()), rtol=1e-5)
    np.testing.assert_array_equal(jax_ref(
        None, lambda jlax: jlax.pad(XF, np.float32(-1.5), config)), want)


def test_dot_general_values_sharded_and_gradient(mesh, jax_ref):
    a = RNG.standard_normal((2, 4, 3)).astype(np.float32)
    b = RNG.standard_normal((3, 2, 5)).astype(np.float32)
    dn = (((2,), (0,)), ((0,), (1,)))
    want = np.einsum("bik,kbj->bij", a, b)
    got = lax.dot_general(a, b, dn)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    A = cts.device_put(XF, cts.NamedSharding(mesh, cts.P("data", "model")))
    B = cts.device_put(YF.T.copy(), cts.NamedSharding(mesh, cts.P("model", None)))
    np.testing.assert_allclose(np.asarray(lax.dot_general(A, B, (((1,), (0,)), ((), ())))),
                               XF @ YF.T, rtol=1e-5, atol=1e-5)
    # no contraction: an outer product, free dims in lhs-then-rhs order
    np.testing.assert_allclose(np.asarray(lax.dot_general(XF[0], YF[0, :3], (((), ()), ((), ())))),
                               np.outer(XF[0], YF[0, :3]), rtol=1e-6)
    p = lax.dot_general(XI, XI.T, (((1,), (0,)), ((), ())), preferred_element_type=np.float32)
    assert p.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(p), (XI @ XI.T).astype(np.float32))
    with pytest.raises(TypeError, match="preferred_element_type"):
        lax.dot_general(XI, XI.T, (((1,), (0,)), ((), ())))
    w = RNG.standard_normal((2, 4, 5)).astype(np.float32)
    ga, gb = cts.grad(lambda p_, q: cnp.sum(lax.dot_general(p_, q, dn) * w), argnums=(0, 1))(a, b)
    np.testing.assert_allclose(np.asarray(ga), np.einsum("bij,kbj->bik", w, b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gb), np.einsum("bij,bik->kbj", w, a), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got), jax_ref(
        None, lambda jlax: jlax.dot_general(a, b, dn)), rtol=1e-5, atol=1e-6)
    bf = lax.dot_general(a.astype(BF16), b.astype(BF16), dn, preferred_element_type=np.float32)
    jbf = jax_ref(None, lambda jnp, jlax: jlax.dot_general(
        a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), dn, preferred_element_type=jnp.float32))
    assert bf.dtype == jbf.dtype
    np.testing.assert_allclose(np.asarray(bf), jbf, rtol=1e-5, atol=1e-5)


def test_reductions_args_and_cumulative(mesh, jax_ref):
    for name, ref in (("reduce_sum", np.sum), ("reduce_max", np.max), ("reduce_min", np.min),
                      ("reduce_prod", np.prod)):
        for axes in ((0,), (1,), (0, 1)):
            np.testing.assert_allclose(np.asarray(getattr(lax, name)(_sharded(XF, mesh), axes)),
                                       ref(XF, axis=axes), rtol=1e-5, err_msg=f"{name} {axes}")
            np.testing.assert_array_equal(np.asarray(getattr(lax, name)(XI % 5, axes)),
                                          ref(XI % 5, axis=axes).astype(np.int32))
    np.testing.assert_array_equal(np.asarray(lax.reduce_sum(XF, ())), XF)
    np.testing.assert_array_equal(np.asarray(lax.argmax(_sharded(XF, mesh), 1, np.int32)),
                                  np.argmax(XF, 1))
    am = lax.argmin(XF, 0, np.uint32)
    assert am.dtype == np.uint32
    np.testing.assert_array_equal(np.asarray(am), np.argmin(XF, 0))
    for name, ref in (("cumsum", np.cumsum), ("cumprod", np.cumprod),
                      ("cummax", np.maximum.accumulate), ("cummin", np.minimum.accumulate)):
        for axis in (0, 1):
            for rev in (False, True):
                h = XF[::-1] if (rev and axis == 0) else (XF[:, ::-1] if rev else XF)
                want = ref(h, axis=axis)
                want = want[::-1] if (rev and axis == 0) else (want[:, ::-1] if rev else want)
                got = getattr(lax, name)(_sharded(XF, mesh), axis, reverse=rev)
                np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{name} {axis} {rev}")
        np.testing.assert_array_equal(np.asarray(getattr(lax, name)(XI % 7, 1)),
                                      ref(XI % 7, axis=1).astype(np.int32))
    g = cts.grad(lambda v: cnp.sum(lax.cumsum(v, 1, reverse=True) * YF))(XF)
    np.testing.assert_allclose(np.asarray(g), np.cumsum(YF, 1), rtol=1e-5)
    nan = np.array([3.0, np.nan, 1.0, 4.0], np.float32)
    for name in ("cummax", "cummin"):
        np.testing.assert_array_equal(np.asarray(getattr(lax, name)(nan)),
                                      jax_ref(None, lambda jlax: getattr(jlax, name)(nan)))


def _balanced_cumulative_jacobian(x, big, reverse):
    """d cummax(x) / dx for a 1-d float64 x, written from jax's definition of the gradient:
    jvp of ``lax.associative_scan(lax.max)`` (pairs combined, the half-size scan recursively,
    then the even outputs, interleaved), each max contributing ``_balanced_eq`` (1 to the
    operand equal to the output, halved when both are; 0 where the output is NaN). Values
    carry their Jacobian rows through the tree."""
    n = len(x)
    vals = [(float(v), np.eye(n)[i]) for i, v in enumerate(x)]
    if reverse:
        vals = vals[::-1]

    def comb(a, b):
        z = max(a[0], b[0]) if big else min(a[0], b[0])
        if np.isnan(a[0]) or np.isnan(b[0]):
            return (np.nan, np.zeros(n))
        wa = 1.0 if a[0] == z else 0.0
        wb = 1.0 if b[0] == z else 0.0
        if wa and wb:
            wa = wb = 0.5
        return (z, wa * a[1] + wb * b[1])

    def scan(e):
        if len(e) < 2:
            return e
        odd = scan([comb(e[i], e[i + 1]) for i in range(0, len(e) - 1, 2)])
        evens = [comb(o, e[2 + 2 * j]) for j, o in enumerate(odd) if 2 + 2 * j < len(e)]
        even = [e[0]] + evens
        out = []
        for i in range(len(e)):
            out.append(even[i // 2] if i % 2 == 0 else odd[i // 2])
        return out
    rows = scan(vals)
    if reverse:
        rows = rows[::-1]
    return np.array([r[1] for r in rows])


def test_cummax_cummin_gradients_at_ties_follow_jax_scan_tree(mesh, jax_ref):
    rng = np.random.default_rng(3)
    for n in (1, 2, 3, 5, 8, 13):
        x = rng.integers(0, 3, size=(4, n)).astype(np.float32)     # many ties
        x[1, n // 2] = np.nan
        x[2, 0] = -np.inf
        w = rng.standard_normal((4, n)).astype(np.float32)
        for name, big in (("cummax", True), ("cummin", False)):
            for rev in (False, True):
                f = getattr(lax, name)
                for operand in (x, _sharded(x, mesh) if n % 4 == 0 else x):
                    g = cts.grad(lambda v: cnp.sum(f(v, 1, reverse=rev) * w))(operand)
                    want = np.stack([w[i] @ _balanced_cumulative_jacobian(x[i], big, rev)
                                     for i in range(4)])
                    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-6, atol=1e-6,
                                               err_msg=f"{name} n={n} reverse={rev}")
    for n in (4, 7, 16):
        x = rng.integers(0, 3, size=(3, n)).astype(np.float32)
        x[0, 1] = np.nan
        w = rng.standard_normal((3, n)).astype(np.float32)

        def jgrads(jax, v):
            jnp, jlax = jax.numpy, jax.lax
            return [jax.grad(lambda u: jnp.sum(getattr(jlax, nm)(u, 1, reverse=r) * w))(v)
                    for nm in ("cummax", "cummin") for r in (False, True)]
        want = jax_ref(n, lambda jax: jax.jit(lambda v: jgrads(jax, v))(x))
        got = [cts.grad(lambda u: cnp.sum(getattr(lax, nm)(u, 1, reverse=r) * w))(x)
               for nm in ("cummax", "cummin") for r in (False, True)]
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def _affine(p, q):
    """Composition of the affine maps v -> p0 * v + p1, then q (associative, not commutative)."""
    return (p[0] * q[0], q[0] * p[1] + q[1])


def test_associative_scan_values_pytrees_gradients_and_errors(mesh):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 11)).astype(np.float32)
    y = rng.standard_normal((3, 11)).astype(np.float32)
    for rev in (False, True):
        got = lax.associative_scan(cnp.add, _sharded(x[:2, :8], mesh), reverse=rev, axis=1)
        h = x[:2, :8][:, ::-1] if rev else x[:2, :8]
        want = np.cumsum(h.astype(np.float64), axis=1)
        np.testing.assert_allclose(np.asarray(got), want[:, ::-1] if rev else want, rtol=1e-5,
                                   atol=1e-5)
        # the composed affine maps, against the sequential composition in float64
        a, b = lax.associative_scan(_affine, (x, y), reverse=rev, axis=-1)
        pa, pb = np.ones(3), np.zeros(3)
        cols = range(10, -1, -1) if rev else range(11)
        for j in cols:
            pa, pb = pa * x[:, j], x[:, j] * pb + y[:, j]
            np.testing.assert_allclose(np.asarray(a)[:, j], pa, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(np.asarray(b)[:, j], pb, rtol=1e-4, atol=1e-5)
    xi = rng.integers(-9, 9, (2, 7)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(lax.associative_scan(cnp.add, xi, axis=1)),
                                  np.cumsum(xi, axis=1))
    bm = rng.random((2, 9)) < 0.3
    np.testing.assert_array_equal(np.asarray(lax.associative_scan(cnp.logical_or, bm, axis=1)),
                                  np.logical_or.accumulate(bm, axis=1))
    d = lax.associative_scan(lambda p, q: {"s": p["s"] + q["s"], "m": cnp.maximum(p["m"], q["m"])},
                             {"s": x[0], "m": y[0]})
    np.testing.assert_allclose(np.asarray(d["s"]), np.cumsum(x[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(d["m"]), np.maximum.accumulate(y[0]))
    # gradient of a linear functional of the scan: d/dy_j sum_k w_k b_k, b_k = sum_{j<=k} y_j
    # prod_{j<i<=k} x_i
    w = rng.standard_normal(11).astype(np.float32)
    g = cts.grad(lambda v: cnp.sum(lax.associative_scan(_affine, (x[0], v))[1] * w))(y[0])
    want = [sum(w[k] * np.prod(x[0, j + 1:k + 1].astype(np.float64)) for k in range(j, 11))
            for j in range(11)]
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="must have the same first dimension"):
        lax.associative_scan(_affine, (x, y[:, :5]), axis=1)
    with pytest.raises(TypeError, match="must return the structure of its operands"):
        lax.associative_scan(lambda p, q: p[0] * q[0], (x, y), axis=1)
    with pytest.raises(ValueError, match="out of bounds"):
        lax.associative_scan(cnp.add, x, axis=2)
    with pytest.raises(ValueError, match="holds no arrays"):
        lax.associative_scan(cnp.add, ())


def test_associative_scan_matches_jax_grouping_bit_for_bit(jax_ref):
    rng = np.random.default_rng(5)
    for n in (2, 5, 8, 13):
        x = rng.standard_normal((3, n)).astype(np.float32)
        y = rng.standard_normal((3, n)).astype(np.float32)

        def jside(jax, u, v):
            jnp, jlax = jax.numpy, jax.lax
            return [jlax.associative_scan(jnp.add, u, reverse=r, axis=1) for r in (False, True)] + \
                [jax.grad(lambda a, b: jnp.sum(jlax.associative_scan(_affine, (a, b), axis=1)[1]
                                               * v), argnums=(0, 1))(u, v)]
        want = jax_ref(n, lambda jax: jax.jit(lambda u, v: jside(jax, u, v))(x, y))
        for r, wv in zip((False, True), want[:2]):
            # float32 sums in jax's grouping: the same rounding, bit for bit
            np.testing.assert_array_equal(
                np.asarray(lax.associative_scan(cnp.add, x, reverse=r, axis=1)), np.asarray(wv))
        g = cts.grad(lambda a, b: cnp.sum(lax.associative_scan(_affine, (a, b), axis=1)[1] * y),
                     argnums=(0, 1))(x, y)
        for u, v in zip(g, want[2]):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-5)


def test_sort_and_top_k(mesh, jax_ref):
    k1 = np.array([2, 0, 2, 1, 0, 2], np.int32)
    k2 = np.array([5.0, 1.0, -1.0, 3.0, 1.0, 5.0], np.float32)
    v = np.arange(6, dtype=np.float32)
    order = np.lexsort((k2, k1))
    out = lax.sort((k1, k2, v), num_keys=2)
    for o_, h in zip(out, (k1, k2, v)):
        np.testing.assert_array_equal(np.asarray(o_), h[order])
    np.testing.assert_array_equal(np.asarray(lax.sort(_sharded(XF, mesh), dimension=0)),
                                  np.sort(XF, 0))
    ks, vs = lax.sort_key_val(k1, v)
    np.testing.assert_array_equal(np.asarray(vs), v[np.argsort(k1, kind="stable")])
    ties = np.round(XF * 2) / 2
    vals, idx = lax.top_k(_sharded(ties, mesh), 3)
    want_idx = np.argsort(-ties, axis=-1, kind="stable")[:, :3]     # ties: the lower index
    assert idx.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_array_equal(np.asarray(vals), np.take_along_axis(ties, want_idx, -1))
    g = cts.grad(lambda a: cnp.sum(lax.top_k(a, 2)[0]))(XF)
    gw = np.zeros_like(XF)
    np.put_along_axis(gw, np.argsort(-XF, axis=-1, kind="stable")[:, :2], 1.0, -1)
    np.testing.assert_array_equal(np.asarray(g), gw)
    nan = np.array([1.0, np.nan, 5.0, 5.0], np.float32)
    for a, b in zip(lax.top_k(nan, 3), jax_ref(None, lambda jlax: jlax.top_k(nan, 3)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    for a, b in zip(lax.sort((k1, k2, v), num_keys=2),
                    jax_ref(None, lambda jlax: jlax.sort((k1, k2, v), num_keys=2)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


# --- control flow ----------------------------------------------------------------------------

def _body(i, c):
    x, acc = c
    return lax.tanh(x * 1.1 + 0.1 * i), acc + cnp.sum(x * x)


def test_fori_loop_values_and_gradient(mesh, jax_ref):
    want_x, want_acc = XF.astype(np.float64), 0.0
    for i in range(2, 6):
        want_acc += (want_x ** 2).sum()
        want_x = np.tanh(want_x * 1.1 + 0.1 * i)
    x, acc = lax.fori_loop(2, 6, _body, (cts.device_put(XF), 0.0))
    np.testing.assert_allclose(np.asarray(x), want_x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(np.asarray(acc)), want_acc, rtol=1e-5)
    xs, _ = lax.fori_loop(cts.device_put(np.int32(2)), 6, _body, (_sharded(XF, mesh), 0.0))
    np.testing.assert_array_equal(np.asarray(xs), np.asarray(x))
    assert lax.fori_loop(5, 2, _body, "untouched") == "untouched"

    def loss(v):
        x_, acc_ = lax.fori_loop(2, 6, _body, (v, 0.0))
        return cnp.sum(x_) + acc_
    g = cts.grad(loss)(XF)

    def jgrad(jax):
        jnp, jlax = jax.numpy, jax.lax

        def jbody(i, c):
            x_, acc_ = c
            return jnp.tanh(x_ * 1.1 + 0.1 * i), acc_ + jnp.sum(x_ * x_)

        def jloss(v):
            x_, acc_ = jlax.fori_loop(2, 6, jbody, (v, 0.0))
            return jnp.sum(x_) + acc_
        return jax.grad(jloss)(XF)

    np.testing.assert_allclose(np.asarray(g), jax_ref("grad", jgrad), rtol=1e-4, atol=1e-5)
    for idx in [(0, 0), (3, 7)]:   # and central differences at a few elements
        e = np.zeros_like(XF, np.float64)
        e[idx] = 1e-3
        fd = (float(np.asarray(loss((XF + e).astype(np.float32)))) -
              float(np.asarray(loss((XF - e).astype(np.float32))))) / 2e-3
        np.testing.assert_allclose(np.asarray(g)[idx], fd, rtol=2e-2, atol=2e-2)


def _jax_loop_errors(jax):
    """The type and message of jax's error for each bad carry / predicate."""
    jnp, jlax = jax.numpy, jax.lax
    out = []
    for call in (lambda: jlax.fori_loop(0, 2, lambda i, c: c.astype(jnp.int32), jnp.float32(1)),
                 lambda: jlax.fori_loop(0, 2, lambda i, c: 0, jnp.float32(1)),
                 lambda: jlax.while_loop(lambda c: jnp.ones(2) > 0, lambda c: c, 0.0)):
        try:
            call()
            out.append(None)
        except Exception as e:   # noqa: BLE001 - compared below
            out.append([type(e).__name__, str(e)])
    return out


def test_carry_checks_and_bad_loops(jax_ref):
    f32 = cts.device_put(np.float32(1.0))
    with pytest.raises(TypeError, match=r"loop_carry has type float32\[\] .* int32\[\], so the dtypes"):
        lax.fori_loop(0, 2, lambda i, c: lax.convert_element_type(c, np.int32), f32)
    with pytest.raises(TypeError, match=r"float32\[3\], so the shapes do not match"):
        lax.fori_loop(0, 2, lambda i, c: cnp.ones(3), f32)
    with pytest.raises(TypeError, match="same pytree structure"):
        lax.fori_loop(0, 2, lambda i, c: (c, c), f32)
    with pytest.raises(TypeError, match=r"carry\[1\] has type float32\[\]"):
        lax.scan(lambda c, x: ((c[0], 0), x), (1, f32), np.ones(2, np.float32))
    with pytest.raises(TypeError, match="must have equal types"):
        lax.fori_loop(0, 2, lambda i, c: 0, f32)       # an int output for a float32 carry
    assert lax.while_loop(lambda c: c < 3, lambda c: c + 1.5, 0) == 3.0   # weak input: ok
    with pytest.raises(TypeError, match="equal types"):
        lax.fori_loop(cts.device_put(np.uint32(0)), cts.device_put(np.int32(3)),
                      lambda i, c: c, 0)
    with pytest.raises(TypeError, match="must be an integer"):
        lax.fori_loop(0.5, 3, lambda i, c: c, 0)
    with pytest.raises(TypeError, match="cond_fun must return a boolean scalar"):
        lax.while_loop(lambda c: cnp.ones(2) > 0, lambda c: c, 0.0)
    with pytest.raises(TypeError, match="cond_fun must return a boolean scalar"):
        lax.while_loop(lambda c: c, lambda c: c - 1, 3)
    with pytest.raises(TypeError, match="abstract"):
        cts.eval_shape(lambda v: lax.while_loop(lambda c: cnp.sum(c) < 3, lambda c: c + 1, v),
                       XF)
    # jax refuses the same carries and predicates
    import re
    errs = jax_ref("jax's errors", _jax_loop_errors)
    for err, frag in zip(errs, ("dtypes do not match", "dtypes do not match", "boolean scalar"),
                         strict=True):
        assert err is not None and err[0] == "TypeError" and re.search(frag, err[1]), err


def test_while_loop_values_and_gradient():
    out = lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 1.5),
                         (0, cts.device_put(XF)))
    assert out[0] == 5
    np.testing.assert_allclose(np.asarray(out[1]), XF * np.float32(1.5) ** 5, rtol=1e-6)
    # differentiable (jax's while_loop is not): d/dx sum(x * 1.5**5) = 1.5**5
    g = cts.grad(lambda v: cnp.sum(lax.while_loop(
        lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 1.5), (0, v))[1]))(XF)
    np.testing.assert_allclose(np.asarray(g), np.full_like(XF, 1.5 ** 5), rtol=1e-5)


def test_cond_and_switch(jax_ref):
    x = cts.device_put(XF)
    for p in (True, False, 0, 2.0, np.bool_(True), cts.device_put(np.array(False))):
        want = XF + 1 if bool(np.asarray(p)) else XF * 2
        np.testing.assert_allclose(np.asarray(lax.cond(p, lambda v: v + 1, lambda v: v * 2, x)),
                                   want)
    np.testing.assert_allclose(np.asarray(lax.cond(True, lambda v: v - 1, lambda v: v, operand=x)),
                               XF - 1)
    assert lax.cond(False, 1.0, lambda a: a, 2.0, lambda b: b * 3) == 6.0     # the old form
    with pytest.raises(TypeError, match="Pred must be a scalar"):
        lax.cond(np.array([True, False]), lambda: 1, lambda: 2)
    with pytest.raises(TypeError, match="should be callable"):
        lax.cond(True, 1.0, lambda: 2)
    with pytest.raises(TypeError, match="no positional operands"):
        lax.cond(True, lambda v: v, lambda v: v, 1.0, operand=2.0)
    branches = [lambda v: v, lambda v: v * 2, lambda v: v * 3]
    for i in (-3, 0, 1, 2, 9):
        want = XF * (min(max(i, 0), 2) + 1)
        np.testing.assert_allclose(np.asarray(lax.switch(i, branches, x)), want)
        np.testing.assert_allclose(jax_ref(None, lambda jlax: jlax.switch(i, branches, XF)), want)
    with pytest.raises(TypeError, match="Index type must be an integer"):
        lax.switch(1.0, branches, x)
    with pytest.raises(ValueError, match="Empty branch sequence"):
        lax.switch(0, [], x)
    # inside eval_shape both branches run and must agree, as jax traces them
    s = cts.eval_shape(lambda p, v: lax.cond(p, lambda a: a + 1, lambda a: a * 2, v),
                       np.array(True), XF)
    assert s.shape == XF.shape
    with pytest.raises(TypeError, match="equal output types"):
        cts.eval_shape(lambda p, v: lax.cond(p, lambda a: a, lambda a: a[0], v),
                       np.array(True), XF)
    # gradient: only the branch taken
    for p in (True, False):
        g = cts.grad(lambda v: cnp.sum(lax.cond(p, lambda a: a * a, lambda a: lax.sin(a), v)))(XF)
        np.testing.assert_allclose(np.asarray(g), 2 * XF if p else np.cos(XF), rtol=1e-6)
        jg = jax_ref(None, lambda jax, jnp, jlax: jax.grad(
            lambda v: jnp.sum(jlax.cond(p, lambda a: a * a, jnp.sin, v)))(XF))
        np.testing.assert_allclose(np.asarray(g), jg, rtol=1e-6)


def _scan_body(c, x):
    h, n = c
    h2 = lax.tanh(h * 0.9 + x["u"])
    return (h2, n + 1), {"h": h2, "s": cnp.sum(h2 * x["w"])}


def test_scan_values_reverse_pytrees_and_sharding(mesh):
    u = RNG.standard_normal((5, 4, 8)).astype(np.float32)
    w = RNG.standard_normal((5, 8)).astype(np.float32)
    for rev in (False, True):
        h, hs, ss = np.zeros((4, 8)), [None] * 5, [None] * 5
        for t in (range(4, -1, -1) if rev else range(5)):
            h = np.tanh(h * 0.9 + u[t])
            hs[t], ss[t] = h, (h * w[t]).sum()
        (hc, n), ys = lax.scan(_scan_body, (cts.device_put(np.zeros((4, 8), np.float32)), 0),
                               {"u": cts.device_put(u), "w": w}, reverse=rev)
        assert n == 5
        np.testing.assert_allclose(np.asarray(hc), h, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(ys["h"]), np.stack(hs), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(ys["s"]), np.array(ss), rtol=1e-5, atol=1e-5)
    us = cts.device_put(u, cts.NamedSharding(mesh, cts.P(None, "data", "model")))
    (hc2, _), ys2 = lax.scan(_scan_body, (cts.device_put(np.zeros((4, 8), np.float32)), 0),
                             {"u": us, "w": w}, reverse=True)
    np.testing.assert_array_equal(np.asarray(hc2), np.asarray(hc))
    np.testing.assert_array_equal(np.asarray(ys2["h"]), np.asarray(ys["h"]))
    # xs=None with length; ys of Python scalars stack as jax's default dtypes
    c, ys3 = lax.scan(lambda c, _: (c + 1, c * 2), 0, None, length=4)
    assert c == 4 and ys3.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(ys3), [0, 2, 4, 6])
    c, ys4 = lax.scan(lambda c, x: (c + x, c), 0.0, np.zeros((0, 3), np.float32))
    assert ys4.shape == (0,) and ys4.dtype == np.float32 and c == 0.0
    np.testing.assert_allclose(np.asarray(lax.map(lambda v: v["a"] * 2 + v["b"], {"a": u, "b": w[:, None, :]})),
                               u * 2 + w[:, None, :], rtol=1e-6)


def test_scan_errors():
    f = lambda c, x: (c, x)   # noqa: E731
    with pytest.raises(ValueError, match="different leading axis sizes: 3, 4"):
        lax.scan(f, 0.0, (np.ones(3), np.ones(4)))
    with pytest.raises(ValueError, match="`length` argument of 4 which disagrees"):
        lax.scan(f, 0.0, np.ones(3), length=4)
    with pytest.raises(ValueError, match="no values to scan over"):
        lax.scan(f, 0.0, None)
    with pytest.raises(ValueError, match="no leading axis"):
        lax.scan(f, 0.0, np.float32(1))
    with pytest.raises(TypeError, match="must be a pair"):
        lax.scan(lambda c, x: (c, x, x), 0.0, np.ones(3, np.float32))
    with pytest.raises(TypeError, match="dtypes do not match"):
        lax.scan(lambda c, x: (lax.convert_element_type(c, np.int32), x),
                 cts.device_put(np.float32(0)), np.ones(3, np.float32))


def test_scan_gradient_matches_jax(jax_ref):
    u = RNG.standard_normal((5, 4, 8)).astype(np.float32)

    def loss(h0, uu):
        def body(h, x):
            h2 = lax.tanh(h * 0.9 + x)
            return h2, cnp.sum(h2 * h2)
        h, ys = lax.scan(body, h0, uu, reverse=True)
        return cnp.sum(h) + cnp.sum(ys)
    gh, gu = cts.grad(loss, argnums=(0, 1))(XF, u)

    def jgrads(jax):
        jnp, jlax = jax.numpy, jax.lax

        def jloss(h0, uu):
            def body(h, x):
                h2 = jnp.tanh(h * 0.9 + x)
                return h2, jnp.sum(h2 * h2)
            h, ys = jlax.scan(body, h0, uu, reverse=True)
            return jnp.sum(h) + jnp.sum(ys)
        return jax.grad(jloss, argnums=(0, 1))(XF, u)

    jh, ju = jax_ref("grads", jgrads)
    np.testing.assert_allclose(np.asarray(gh), jh, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gu), ju, rtol=1e-4, atol=1e-5)


def test_shape_ops_and_select_gradients_match_jax(jax_ref):
    cfg = [(-1, 2, 1), (2, -3, 2)]
    w = RNG.standard_normal(_np_pad(XF, 0.0, cfg).shape).astype(np.float32)
    g = cts.grad(lambda a: cnp.sum(lax.pad(a, 0.0, cfg) * w))(XF)
    jg = jax_ref(None, lambda jax, jnp, jlax: jax.grad(
        lambda a: jnp.sum(jlax.pad(a, 0.0, cfg) * w))(XF))
    np.testing.assert_array_equal(np.asarray(g), jg)
    p = XF > 0
    g = cts.grad(lambda a: cnp.sum(lax.select(p, lax.sin(a), a * a)))(XF)
    jg = jax_ref(None, lambda jax, jnp, jlax: jax.grad(
        lambda a: jnp.sum(jlax.select(p, jnp.sin(a), a * a)))(XF))
    np.testing.assert_allclose(np.asarray(g), jg, rtol=1e-6)
    for args in ((XF[0, :4], (3, 4, 2), (1,)), (XF, (8, 3, 4), (2, 0))):
        np.testing.assert_array_equal(np.asarray(lax.broadcast_in_dim(*args)),
                                      jax_ref(None, lambda jlax: jlax.broadcast_in_dim(*args)))
    np.testing.assert_array_equal(np.asarray(lax.reshape(XF, (32,), (1, 0))),
                                  jax_ref(None, lambda jlax: jlax.reshape(XF, (32,), (1, 0))))
    c = np.array([-1.5, 5e9, 2.5, np.nan], np.float32)
    for dt in (np.int32, np.uint32, np.bool_):
        np.testing.assert_array_equal(np.asarray(lax.convert_element_type(c, dt)),
                                      jax_ref(None, lambda jlax: jlax.convert_element_type(c, dt)))


# --- comparisons, bit operations, the remaining float functions, dot / split ----------------

_U = np.array([0, 1, 7, 0x80000000, 0xFFFFFFFF, 0x12345678, 2, 0xF0F0F0F0], np.uint32)
_I = _U.view(np.int32)
_SH = np.array([0, 1, 31, 32, 33, 4, 40, 3], np.int32)


def _bits_ref(fn, u):
    return np.array([fn(int(v)) for v in u.astype(np.int64) & 0xFFFFFFFF], np.int64)


def test_comparisons_bitwise_shifts_and_counts_match_numpy(mesh):
    for a, b in ((XF, np.round(XF)), (XI % 3, XI % 2), (XI.view(np.uint32) % 3, np.uint32(1)),
                 (XF > 0, XF > 0.5)):
        b = np.broadcast_to(b, a.shape).astype(a.dtype) if np.ndim(b) else b
        for name, ref in (("eq", np.equal), ("ne", np.not_equal), ("lt", np.less),
                          ("le", np.less_equal), ("gt", np.greater), ("ge", np.greater_equal)):
            got = getattr(lax, name)(_sharded(a, mesh), b)
            assert got.dtype == np.bool_
            np.testing.assert_array_equal(np.asarray(got), ref(a, b), err_msg=name)
    for x, y in ((_I, _I[::-1].copy()), (_U, _U[::-1].copy()), (_U > 5, _U > 100)):
        np.testing.assert_array_equal(np.asarray(lax.bitwise_and(x, y)), x & y)
        np.testing.assert_array_equal(np.asarray(lax.bitwise_or(x, y)), x | y)
        np.testing.assert_array_equal(np.asarray(lax.bitwise_xor(x, y)), x ^ y)
        np.testing.assert_array_equal(np.asarray(lax.bitwise_not(x)), ~x)
    # shifts by the width or more: 0, or the sign fill (C leaves them undefined)
    s64 = _SH.astype(np.int64)
    u64 = _U.astype(np.int64)
    left = np.where(s64 >= 32, 0, (u64 << np.minimum(s64, 31)) & 0xFFFFFFFF)
    logical = np.where(s64 >= 32, 0, u64 >> np.minimum(s64, 31))
    arith = _I.astype(np.int64) >> np.minimum(s64, 31)
    for dt in (np.int32, np.uint32):
        x, s = _U.view(dt), _SH.astype(dt)
        np.testing.assert_array_equal(np.asarray(lax.shift_left(x, s)), left.astype(np.uint32).view(dt))
        np.testing.assert_array_equal(np.asarray(lax.shift_right_logical(x, s)),
                                      logical.astype(np.uint32).view(dt))
        np.testing.assert_array_equal(np.asarray(lax.shift_right_arithmetic(x, s)),
                                      (arith & 0xFFFFFFFF).astype(np.uint32).view(dt))
        np.testing.assert_array_equal(np.asarray(lax.population_count(x)),
                                      _bits_ref(lambda v: bin(v).count("1"), _U).astype(dt))
        np.testing.assert_array_equal(np.asarray(lax.clz(x)),
                                      _bits_ref(lambda v: 32 - v.bit_length(), _U).astype(dt))
    m = (XI % 5).astype(np.int32)
    for name, ufunc in (("reduce_and", np.bitwise_and), ("reduce_or", np.bitwise_or),
                        ("reduce_xor", np.bitwise_xor)):
        for axes in ((0,), (1,), (0, 1)):
            got = getattr(lax, name)(_sharded(m, mesh), axes)
            np.testing.assert_array_equal(np.asarray(got), ufunc.reduce(m, axis=axes))
            got = getattr(lax, name)(XF > 0, axes)
            np.testing.assert_array_equal(np.asarray(got), ufunc.reduce(XF > 0, axis=axes))
        np.testing.assert_array_equal(np.asarray(getattr(lax, name)(m[:0], (0,))),
                                      ufunc.reduce(m[:0], axis=0))        # the identity
        np.testing.assert_array_equal(np.asarray(getattr(lax, name)(m[:0].view(np.uint32), (0,))),
                                      ufunc.reduce(m[:0].view(np.uint32), axis=0))


def test_float_functions_round_dot_split_match_numpy_and_their_gradients(mesh):
    x = np.linspace(-0.95, 0.95, 32, dtype=np.float32).reshape(4, 8)
    pos = (np.abs(XF) + 1.1).astype(np.float32)
    for name, ref, arg in (("tan", np.tan, x), ("asin", np.arcsin, x), ("acos", np.arccos, x),
                           ("atan", np.arctan, XF), ("sinh", np.sinh, XF), ("cosh", np.cosh, XF),
                           ("asinh", np.arcsinh, XF), ("acosh", np.arccosh, pos),
                           ("atanh", np.arctanh, x), ("exp2", np.exp2, XF), ("cbrt", np.cbrt, XF)):
        got = getattr(lax, name)(_sharded(arg, mesh))
        np.testing.assert_allclose(np.asarray(got), ref(arg.astype(np.float64)), rtol=2e-6,
                                   atol=1e-6, err_msg=name)
    d = cts.grad(lambda v: cnp.sum(lax.tan(v)))(x)
    np.testing.assert_allclose(np.asarray(d), 1 / np.cos(x.astype(np.float64)) ** 2, rtol=1e-5)
    ga, gb = cts.grad(lambda a, b: cnp.sum(lax.atan2(a, b)), argnums=(0, 1))(XF, YF)
    r2 = XF.astype(np.float64) ** 2 + YF.astype(np.float64) ** 2
    np.testing.assert_allclose(np.asarray(ga), YF / r2, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gb), -XF / r2, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(lax.is_finite(np.float32([1, np.inf, -np.inf, np.nan]))),
                                  [True, False, False, False])
    np.testing.assert_array_equal(np.asarray(lax.reciprocal(np.float32([4, -0.5]))), [0.25, -2.0])
    np.testing.assert_array_equal(
        np.asarray(lax.nextafter(np.float32([0, 1]), np.float32([1, 0]))),
        np.nextafter(np.float32([0, 1]), np.float32([1, 0])))
    # round: ties away from zero by default (float64 floor(|x| + 0.5) is exact for float32 x)
    v = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.4, 3.7, -0.0, np.inf, np.nan,
                  8388607.5], np.float32)
    away = (np.sign(v.astype(np.float64)) * np.floor(np.abs(v.astype(np.float64)) + 0.5))
    got = np.asarray(lax.round(v))
    np.testing.assert_array_equal(got, away.astype(np.float32))
    assert np.signbit(got[6]) and np.signbit(got[8])          # -0.4 and -0.0 round to -0.0
    np.testing.assert_array_equal(np.asarray(lax.round(v, lax.RoundingMethod.TO_NEAREST_EVEN)),
                                  np.rint(v))
    np.testing.assert_array_equal(np.asarray(cts.grad(lambda u: cnp.sum(lax.round(u)))(x)),
                                  np.zeros_like(x))
    a2, b2 = XF, YF.T.copy()
    np.testing.assert_allclose(np.asarray(lax.dot(a2, b2)), a2 @ b2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lax.dot(a2[0], b2)), a2[0] @ b2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lax.dot(a2, b2[:, 0])), a2 @ b2[:, 0], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(lax.dot(a2[0], a2[1])), a2[0] @ a2[1], rtol=1e-5)
    bm1 = RNG.standard_normal((3, 4, 5)).astype(np.float32)
    bm2 = RNG.standard_normal((3, 5, 2)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(lax.batch_matmul(bm1, bm2)), bm1 @ bm2, rtol=1e-5,
                               atol=1e-5)
    parts = lax.split(_sharded(XF, mesh), (3, 0, 5), axis=1)
    for p_, w in zip(parts, np.split(XF, [3, 3], axis=1)):
        np.testing.assert_array_equal(np.asarray(p_), w)
    g = cts.grad(lambda u: cnp.sum(lax.split(u, (3, 5), 1)[1] * 2.0))(XF)
    np.testing.assert_array_equal(np.asarray(g), np.concatenate(
        [np.zeros((4, 3)), np.full((4, 5), 2.0)], axis=1))


def test_more_lax_primitives_refuse_what_jax_refuses():
    with pytest.raises(TypeError, match=r"lax.eq requires arguments to have the same dtypes, "
                                         r"got float32, int32. \(Tip: jnp.equal"):
        lax.eq(np.float32(1), np.int32(1))
    with pytest.raises(TypeError, match="and does not accept dtype float32 at position 0"):
        lax.bitwise_and(np.float32(1), np.float32(1))
    with pytest.raises(TypeError, match="shift_left does not accept dtype bool"):
        lax.shift_left(True, True)
    with pytest.raises(TypeError, match="population_count does not accept dtype float32"):
        lax.population_count(XF)
    with pytest.raises(TypeError, match="logical reduction requires operand dtype bool or int"):
        lax.reduce_and(XF, (0,))
    with pytest.raises(TypeError, match="tan does not accept dtype int32"):
        lax.tan(XI)
    with pytest.raises(TypeError, match="is_finite does not accept dtype int32"):
        lax.is_finite(XI)
    with pytest.raises(TypeError, match="Integers cannot be raised to negative powers"):
        lax.reciprocal(np.int32(4))
    with pytest.raises(ValueError, match="3 is not a valid RoundingMethod"):
        lax.round(XF, 3)
    with pytest.raises(ValueError, match="dimension_numbers must be specified"):
        lax.dot(np.ones((2, 3, 4), np.float32), np.ones((4, 5), np.float32))
    with pytest.raises(ValueError, match="must have same ndim, got 3, 2"):
        lax.batch_matmul(np.ones((2, 3, 4), np.float32), np.ones((4, 5), np.float32))
    with pytest.raises(ValueError, match="must be at least 2D"):
        lax.batch_matmul(np.ones(4, np.float32), np.ones(4, np.float32))
    with pytest.raises(ValueError, match=r"Sum of sizes 5 must be equal to dimension 0"):
        lax.split(np.arange(6, dtype=np.float32), (2, 3))
    with pytest.raises(ValueError, match="must be nonnegative"):
        lax.split(np.arange(6, dtype=np.float32), (-1, 7))


def test_more_lax_primitives_match_live_jax(jax_ref):
    x = np.linspace(-0.9, 0.9, 12, dtype=np.float32)
    cases = [("eq", (XF, np.round(XF))), ("lt", (XI % 3, XI % 2)), ("ge", (XF > 0, XF > 0.5)),
             ("bitwise_and", (_I, _I[::-1].copy())), ("bitwise_xor", (_U, _U[::-1].copy())),
             ("bitwise_not", (_I,)), ("shift_left", (_I, _SH)),
             ("shift_right_logical", (_I, _SH)), ("shift_right_arithmetic", (_U, _SH.view(np.uint32))),
             ("population_count", (_I,)), ("clz", (_U,)), ("tan", (x,)), ("asin", (x,)),
             ("acos", (x,)), ("atan", (XF,)), ("sinh", (XF,)), ("cosh", (XF,)),
             ("asinh", (XF,)), ("acosh", (np.abs(XF) + 1.1,)), ("atanh", (x,)), ("exp2", (XF,)),
             ("cbrt", (XF,)), ("atan2", (XF, YF)), ("is_finite", (np.float32([1, np.inf, np.nan]),)),
             ("reciprocal", (YF,)), ("round", (np.float32([0.5, -2.5, 1.49, -0.4]),)),
             ("nextafter", (XF, YF))]
    for name, args in cases:
        got = np.asarray(getattr(lax, name)(*args))
        want = jax_ref(None, lambda jlax: getattr(jlax, name)(*args))
        assert got.dtype == want.dtype, name
        if got.dtype.kind == "f":
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)
    for name in ("reduce_and", "reduce_or", "reduce_xor"):
        for v in ((XI % 5).astype(np.int32), XF > 0):
            np.testing.assert_array_equal(np.asarray(getattr(lax, name)(v, (1,))),
                                          jax_ref(None, lambda jlax: getattr(jlax, name)(v, (1,))))
    np.testing.assert_allclose(np.asarray(lax.dot(XF, YF.T.copy())),
                               jax_ref(None, lambda jlax: jlax.dot(XF, YF.T.copy())), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("dt", [np.uint8, np.int8, np.int16, np.uint16], ids=lambda d: np.dtype(d).name)
def test_narrow_int_bit_ops_use_their_width(dt, mesh):
    """lax's integer primitives on uint8 / int8 / int16 / uint16 work in the dtype's own width:
    shifts by the width or more give 0 / the sign fill, population_count and clz count the
    dtype's bits, reduce_sum wraps in the dtype (jnp.sum would widen), abs / neg / div / rem
    as jax (numpy references written with that width)."""
    w = 8 * np.dtype(dt).itemsize
    info = np.iinfo(dt)
    rng = np.random.default_rng(3)
    x = rng.integers(info.min, info.max, (4, 8), endpoint=True).astype(dt)
    x[0, :4] = np.array([0, -1, info.max, info.min]).astype(dt)
    s = rng.integers(0, w + 3, (4, 8)).astype(dt)
    s[1, :4] = np.array([w - 1, w, 31, -1]).astype(dt)
    bits = x.astype(np.int64) & ((1 << w) - 1)                 # the bit pattern
    cnt = s.astype(np.int64) & ((1 << w) - 1)                  # the count as stored (-1: huge)
    inr = cnt < w
    sh = np.where(inr, cnt, 0)
    wrap = lambda v: (np.asarray(v, np.int64) & ((1 << w) - 1)).astype(np.int64).astype(
        {8: np.uint8, 16: np.uint16}[w]).view(dt)
    xs = _sharded(x, mesh)
    np.testing.assert_array_equal(np.asarray(lax.shift_left(xs, s)), np.where(inr, wrap(bits << sh), 0))
    np.testing.assert_array_equal(np.asarray(lax.shift_right_logical(xs, s)),
                                  np.where(inr, wrap(bits >> sh), 0))
    fill = np.where(x < 0, -1, 0) if info.min < 0 else np.where(bits >> (w - 1), (1 << w) - 1, 0)
    sx = np.where(bits >> (w - 1), bits - (1 << w), bits)      # the pattern read as signed
    np.testing.assert_array_equal(np.asarray(lax.shift_right_arithmetic(xs, s)),
                                  np.where(inr, wrap(sx >> sh), wrap(fill)))
    np.testing.assert_array_equal(np.asarray(lax.population_count(xs)),
                                  np.vectorize(lambda v: bin(v).count("1"))(bits).astype(dt))
    np.testing.assert_array_equal(np.asarray(lax.clz(xs)),
                                  np.vectorize(lambda v: w - int(v).bit_length())(bits).astype(dt))
    got = lax.reduce_sum(xs, (0,))
    assert got.dtype == dt
    np.testing.assert_array_equal(np.asarray(got), wrap(x.astype(np.int64).sum(0)))
    np.testing.assert_array_equal(np.asarray(lax.bitwise_not(xs)), ~x)
    np.testing.assert_array_equal(np.asarray(lax.neg(xs)), wrap(-x.astype(np.int64)))
    if info.min < 0:
        np.testing.assert_array_equal(np.asarray(lax.abs(xs)), wrap(np.abs(x.astype(np.int64))))
    else:
        with pytest.raises(TypeError, match=f"abs does not accept dtype {np.dtype(dt).name}"):
            lax.abs(xs)
    d = np.where(s == 0, 1, s).astype(dt)
    np.testing.assert_array_equal(np.asarray(lax.div(xs, d)),
                                  wrap(np.trunc(x.astype(np.float64) / d.astype(np.float64))))
    np.testing.assert_array_equal(np.asarray(lax.rem(xs, d)),
                                  wrap(np.fmod(x.astype(np.int64), d.astype(np.int64))))


def test_narrow_int_primitives_match_jax(jax_ref):
    for dt in (np.uint8, np.int8, np.int16, np.uint16):
        info = np.iinfo(dt)
        x = np.random.default_rng(4).integers(info.min, info.max, 64, endpoint=True).astype(dt)
        s = np.random.default_rng(5).integers(0, 8 * x.itemsize + 4, 64).astype(dt)
        s[:3] = np.array([-1, 255, 8 * x.itemsize]).astype(dt)
        z = np.where(s == 0, 0, x).astype(dt)
        for name, args in (("shift_left", (x, s)), ("shift_right_logical", (x, s)),
                           ("shift_right_arithmetic", (x, s)), ("population_count", (x,)),
                           ("clz", (x,)), ("add", (x, s)), ("mul", (x, s)), ("div", (x, z)),
                           ("rem", (x, z)), ("neg", (x,)), ("max", (x, s)), ("bitwise_not", (x,)),
                           ("integer_pow", (x, 3))):
            got = getattr(lax, name)(*[cts.device_put(a) if isinstance(a, np.ndarray) else a
                                       for a in args])
            want = jax_ref(None, lambda jlax: getattr(jlax, name)(*args))
            assert np.asarray(got).dtype == want.dtype, name
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{name} {np.dtype(dt)}")
        for name in ("reduce_sum", "reduce_max", "reduce_and", "reduce_xor"):
            np.testing.assert_array_equal(np.asarray(getattr(lax, name)(cts.device_put(x), (0,))),
                                          jax_ref(None, lambda jlax: getattr(jlax, name)(x, (0,))),
                                          err_msg=name)
