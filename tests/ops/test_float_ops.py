"""The float functions of jax.numpy / jax.scipy.special in ctrainstate (log1p, expm1, erf, erfc, floor,
ceil, round, trunc, sign, reciprocal, power with array exponents, integer powers, isclose ...):
values against float64 numpy references (ulp bounds) and jax (recorded in tests/data/recorded, live
in each test's twin marked `parity`: `jax_ref`); gradients against central finite differences of
our own function and against jax; 16-bit inputs rounded once; eval_shape; sharded operands give the
single-device bits."""

import math

import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import P
from ctrainstate import nn
from ctrainstate.scipy import special
from conftest import assert_same_bits
from conftest import on_gpu
from recorded import assert_exact
from recorded import exact_record
from float_checks import assert_ulps as _assert_ulps, ord_f32 as _ord


BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)


def _normal(x):
    """``x`` without its subnormal entries: XLA's CPU flushes subnormal inputs to zero
    (1 / -1e-38 is -inf in jax), ctrainstate keeps them as numpy does; the jax comparisons
    leave them out."""
    x = np.asarray(x, np.float32)
    return x[~((x != 0) & (np.abs(x) < np.finfo(np.float32).tiny))]


def _f64(fn):
    return lambda x: np.asarray(fn(np.asarray(x, np.float64)))


_vec_erf = np.vectorize(math.erf)
_vec_erfc = np.vectorize(math.erfc)
_RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _own_rng(twin_seed):
    """Each test draws its inputs from a stream of its own: the same in its recorded and live
    twins (jax's side is recorded for those inputs), whichever tests ran before."""
    global _RNG
    _RNG = np.random.default_rng(twin_seed)


def _special_values():
    return np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)


def _dom(lo, hi, n=3000, small=True):
    x = _RNG.uniform(lo, hi, n)
    if small:
        x = np.r_[x, _RNG.uniform(-1e-4, 1e-4, 200), [1e-30, -1e-30, 1e-7]]
    return x.astype(np.float32)


# name: (ours, float64 reference, jax name, domain, ulps vs reference, ulps vs jax,
#        float64 derivative or None for "zero gradient")
_UNARY = {
    "log1p": (cnp.log1p, np.log1p, "numpy.log1p", _dom(-0.999, 10), 2, 4,
              lambda x: 1.0 / (1.0 + x)),
    "expm1": (cnp.expm1, np.expm1, "numpy.expm1", _dom(-20, 20), 2, 6, np.exp),
    "erf": (special.erf, _vec_erf, "scipy.special.erf", _dom(-5, 5), 2, 8,
            lambda x: 2 / np.sqrt(np.pi) * np.exp(-x * x)),
    # XLA's erfc loses accuracy in the far tail (61 ulps near x = 8.8, measured with jax
    # 0.10.2); glibc's stays within 2 ulp of the correctly rounded value (CUDA's erfcf within
    # 4: allowed on GPU devices)
    "erfc": (special.erfc, _vec_erfc, "scipy.special.erfc", _dom(-3, 9, small=False), 2, 64,
             lambda x: -2 / np.sqrt(np.pi) * np.exp(-x * x)),
    "reciprocal": (cnp.reciprocal, lambda x: 1.0 / x, "numpy.reciprocal",
                   np.r_[_dom(-100, 100), [3.0, 7.0, -1e-38, 1e38]].astype(np.float32), 0, 0,
                   lambda x: -1.0 / (x * x)),
}

# the exact ones: the same bits as numpy's float32 functions (0 ulps, signs of zeros too)
_HALVES = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, -0.49999997, 2.0 ** 23 - 0.5,
                    -(2.0 ** 23 - 0.5), 2.0 ** 23 + 1, 1e10, -1e10, 1e-40, -1e-40, 3.0, -3.0],
                   np.float32)
_EXACT = {
    "floor": (cnp.floor, np.floor, "numpy.floor"),
    "ceil": (cnp.ceil, np.ceil, "numpy.ceil"),
    "trunc": (cnp.trunc, np.trunc, "numpy.trunc"),
    "round": (cnp.round, np.round, "numpy.round"),      # numpy: halves to even, as jnp
    "sign": (cnp.sign, np.sign, "numpy.sign"),
}


def _jfn(jax, dotted):
    import importlib
    mod, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module("jax." + mod), name)


@pytest.mark.parametrize("name", sorted(_UNARY))
def test_unary_values_against_float64_and_jax(name, jax_ref):
    ours, ref, jname, x, n_ref, n_jax, _ = _UNARY[name]
    x = np.r_[x, _special_values()]
    res = ours(x)
    got = np.asarray(res)
    with np.errstate(all="ignore"):
        want = _f64(ref)(x).astype(np.float32)
    if name == "erfc" and on_gpu(res):
        n_ref = 4   # CUDA documents erfcf within 4 ulp (log1pf 1, expm1f 1, erff 2)
    _assert_ulps(got, want, n_ref, name)
    xn = _normal(x)
    with np.errstate(all="ignore"):
        r = _f64(ref)(xn)
        xn = xn[~((r != 0) & (np.abs(r) < np.finfo(np.float32).tiny))]   # subnormal results
    _assert_ulps(np.asarray(ours(xn)), jax_ref("values", lambda jax: _jfn(jax, jname)(xn)), n_jax,
                 name + " vs jax")


@pytest.mark.parametrize("name", sorted(_EXACT))
def test_exact_roundings_are_bit_identical(name, jax_ref):
    ours, ref, jname = _EXACT[name]
    x = np.r_[_HALVES, _RNG.uniform(-50, 50, 500).astype(np.float32), _special_values()]
    got = np.asarray(ours(x))
    want = ref(x)
    assert want.dtype == np.float32
    assert got.tobytes() == want.tobytes() or name == "sign", (name, got, want)
    if name == "sign":   # numpy's sign(-0.0) is 0.0 on some builds: compare with zeros equal
        np.testing.assert_array_equal(got, want)
        assert np.signbit(got[x == 0]).tolist() == np.signbit(x[x == 0]).tolist()
    xn = _normal(x)
    assert np.asarray(ours(xn)).tobytes() == jax_ref(
        "values", lambda jax: _jfn(jax, jname)(xn)).tobytes(), name


def test_round_with_decimals_matches_jax_and_numpy(jax_ref):
    x = np.array([1.2345, -2.5, 17.5, -17.5, 0.125, 1234.5678, 1e-3], np.float32)
    for d in (1, 2, -1, -2):
        got = np.asarray(cnp.round(x, d))
        f = np.float32(10.0 ** d)   # jnp's formula, spelled in numpy float32
        want = (np.round(x * f) / f).astype(np.float32)
        assert got.tobytes() == want.tobytes(), d
        assert got.tobytes() == jax_ref(d, lambda jax: jax.numpy.round(x, d)).tobytes(), d
    with pytest.raises(TypeError, match="decimals must be an int"):
        cnp.round(x, 1.5)


def _grad(f, x):
    return np.asarray(cts.grad(lambda v: cnp.sum(f(v)))(x))


def _fd(f, x, h):
    """Central differences of our own f in float64 arithmetic on the float32 outputs."""
    up = np.asarray(f(x + h), np.float64)
    dn = np.asarray(f(x - h), np.float64)
    return (up - dn) / (2 * h)


@pytest.mark.parametrize("name", sorted(_UNARY))
def test_unary_gradients(name, jax_ref):
    ours, _, jname, x, _, _, deriv = _UNARY[name]
    x = x[(np.abs(x) > 1e-3)][:400]            # away from reciprocal's pole for the FD
    g = _grad(ours, x)
    want = deriv(x.astype(np.float64))
    # the formula, to a few ulps (expm1: jax's rule exp(x) = expm1(x) + 1, exact to ulp(1))
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=2.4e-7 if name == "expm1" else 1e-30)
    h = np.float32(1e-3) * np.maximum(1.0, np.abs(x))
    fd = _fd(ours, x, h)
    np.testing.assert_allclose(g, fd, rtol=2e-2, atol=2e-3 * np.abs(want).max())
    gj = jax_ref("grad", lambda jax: jax.grad(lambda v: _jfn(jax, jname)(v).sum())(x))
    # expm1's gradient is expm1(x) + 1 in both: where x << 0 the + 1 cancels, and a difference
    # of an ulp or two between the backends' expm1 near -1 (ulp 2^-24; CUDA 1 ulp, glibc 2)
    # stays an absolute one in a gradient near 0, beyond any rtol: atol 3 * 2^-23 (3 ulp of 1.0)
    np.testing.assert_allclose(g, gj, rtol=1e-5, atol=3 * 2.0 ** -23 if name == "expm1" else 1e-30)


@pytest.mark.parametrize("name", sorted(_EXACT))
def test_roundings_and_sign_have_zero_gradient(name, jax_ref):
    ours, _, jname = _EXACT[name]
    x = np.array([-2.3, -0.7, 0.2, 1.3, 3.9], np.float32)
    g = _grad(ours, x)
    assert g.tolist() == [0.0] * 5
    assert np.abs(_fd(ours, x, np.float32(1e-3))).max() == 0.0   # piecewise constant there
    assert jax_ref("grad", lambda jax: jax.grad(lambda v: _jfn(jax, jname)(v).sum())(x)).tolist() \
        == g.tolist()


def test_power_with_array_exponents(jax_ref):
    x = np.array([2.0, 3.0, 0.5, 0.0, 4.0, -2.0], np.float32)
    p = np.array([3.0, 0.5, -1.0, 2.0, 0.0, 2.0], np.float32)
    got = np.asarray(cnp.power(x, p))
    _assert_ulps(got, np.power(x.astype(np.float64), p).astype(np.float32), 1)
    gx, gp = (np.asarray(t) for t in cts.grad(lambda a, b: cnp.sum(cnp.power(a, b)), (0, 1))(x, p))
    x64, p64 = x.astype(np.float64), p.astype(np.float64)
    # jax's rules: d/dx = p x^(p-1), 0 where p == 0; d/dp = log(x) x^p, 0 where x == 0
    with np.errstate(all="ignore"):
        wx = np.where(p64 == 0, 0.0, p64 * np.power(x64, p64 - 1))
        wp = np.where(x64 == 0, 0.0, np.log(np.where(x64 == 0, 1.0, x64)) * np.power(x64, p64))
    np.testing.assert_allclose(gx, wx, rtol=1e-6)
    np.testing.assert_allclose(gp, wp, rtol=1e-6)     # log(-2) is NaN in both
    jgx, jgp = jax_ref("grad", lambda jax: jax.grad(lambda a, b: jax.numpy.power(a, b).sum(),
                                                    (0, 1))(x, p))
    np.testing.assert_allclose(gx, jgx, rtol=1e-6)
    np.testing.assert_allclose(gp, jgp, rtol=1e-6)
    _assert_ulps(got, jax_ref("power", lambda jax: jax.numpy.power(x, p)), 2)


def test_power_by_0_1_2_and_minus_1_is_exact(jax_ref):
    """x ** 2 is x * x, x ** -1 is 1 / x, x ** 1 is x and x ** 0 is 1 (NaN ** 0 too) bit for
    bit, for a scalar and an array exponent: jax under jit rewrites a constant exponent so
    (XLA's algebraic simplifier), and CUDA's powf (4 ulp) would not give x * x."""
    x = np.r_[_RNG.standard_normal(2000).astype(np.float32) * 30,
              np.float32([0.0, -0.0, 1.5, -3.0, 3e38, np.inf, -np.inf, np.nan])].astype(np.float32)
    X = cts.device_put(x)
    with np.errstate(all="ignore"):
        refs = {2.0: x * x, -1.0: np.float32(1.0) / x, 1.0: x, 0.0: np.ones_like(x)}
    for p, want in refs.items():
        for got in (cnp.power(X, p), cnp.power(X, cnp.full(x.shape, p)), X ** p):
            # NaN ** 2 on GPU devices is CUDA's canonical NaN (README: NaN bits are the backend's)
            assert_same_bits(got, want, on_gpu(got), err_msg=str(p))
    assert np.asarray(cnp.power(np.float32(np.nan), 0.0)).tolist() == 1.0
    for p, want in refs.items():   # jax's values for a constant exponent under jit
        j = jax_ref(f"x ** {p}", lambda jax: jax.jit(lambda v: v ** p)(x))
        normal = ~(np.abs(want) < np.finfo(np.float32).tiny) | (want == 0)   # XLA's CPU flushes
        assert j[normal].tobytes() == want[normal].tobytes(), p              # 1 / 3e38 to 0
    assert float(jax_ref("nan ** 0", lambda jax: jax.numpy.power(np.float32(np.nan),
                                                                  np.float32(0.0)))) == 1.0


def test_jax_names_exist_where_jax_has_them():
    import ctrainstate.lax as clax
    for mod, names in ((cnp, ["log1p", "expm1", "floor", "ceil", "round", "around", "trunc",
                              "sign", "reciprocal", "ravel", "outer", "inner", "vdot",
                              "tensordot"]),
                       (nn, ["softplus", "log_sigmoid", "elu", "celu", "selu", "relu6",
                             "hard_tanh", "hard_sigmoid", "hard_silu", "hard_swish", "glu",
                             "standardize", "silu", "swish"]),
                       (clax, ["erf", "erfc", "log1p", "expm1", "floor", "ceil", "sign"]),
                       (special, ["erf", "erfc"]), (cnp.linalg, ["norm"])):
        for n in names:
            assert callable(getattr(mod, n)), n
            assert n in mod.__all__, n
    assert nn.hard_swish is nn.hard_silu and nn.swish is nn.silu


_ONE_ROUNDING = [cnp.log1p, cnp.expm1, special.erf, special.erfc, cnp.floor, cnp.ceil, cnp.round,
                 cnp.trunc, cnp.sign, cnp.reciprocal, nn.softplus, nn.log_sigmoid, nn.elu,
                 nn.celu, nn.selu, nn.relu6, nn.hard_tanh, nn.hard_sigmoid, nn.hard_silu,
                 nn.silu, nn.glu, nn.standardize, lambda v: nn.gelu(v, approximate=False),
                 lambda v: cnp.linalg.norm(v, axis=-1), lambda v: cnp.power(v, v)]


@pytest.mark.parametrize("dt", [BF16, F16], ids=str)
def test_16_bit_inputs_round_once(dt):
    x = (_RNG.standard_normal((4, 6)) * 2).astype(dt)
    x[0, :3] = np.array([0.5, -1.5, 2.5], dt)
    ax, wx = cts.device_put(x), cts.device_put(x.astype(np.float32))
    for f in _ONE_ROUNDING:
        out = f(ax)
        assert out.dtype == dt, f
        want = np.asarray(f(wx)).astype(dt)
        got = np.asarray(out)
        assert got.tobytes() == want.tobytes() or np.array_equal(got, want, equal_nan=True), f
    g = cts.grad(lambda v: cnp.sum(cnp.astype(nn.softplus(v), np.float32)))(ax)
    assert g.dtype == dt


def test_eval_shape_gives_shapes_and_dtypes():
    for dt in (np.float32, BF16):
        s = cts.ShapeDtypeStruct((4, 6), dt)
        for f, shape in [(nn.softplus, (4, 6)), (nn.selu, (4, 6)), (nn.relu6, (4, 6)),
                         (nn.hard_swish, (4, 6)), (nn.glu, (4, 3)), (nn.standardize, (4, 6)),
                         (cnp.log1p, (4, 6)), (cnp.round, (4, 6)), (special.erf, (4, 6)),
                         (cnp.ravel, (24,)), (lambda v: cnp.outer(v, v), (24, 24)),
                         (lambda v: cnp.tensordot(v, v, ([1], [1])), (4, 4)),
                         (lambda v: cnp.inner(v, v), (4, 4)), (lambda v: cnp.vdot(v, v), ()),
                         (lambda v: cnp.linalg.norm(v, axis=0, keepdims=True), (1, 6)),
                         (lambda v: cnp.power(v, v), (4, 6))]:
            r = cts.eval_shape(f, s)
            assert isinstance(r, cts.ShapeDtypeStruct), f
            assert (tuple(r.shape), np.dtype(r.dtype)) == (shape, np.dtype(dt)), (f, r)
            # and the shape is what running it gives
            real = f(cts.device_put(np.ones((4, 6), dt)))
            assert (tuple(real.shape), real.dtype) == (shape, np.dtype(dt)), f


_ELEMENTWISE = [cnp.log1p, cnp.expm1, special.erf, special.erfc, cnp.floor, cnp.ceil, cnp.round,
                cnp.trunc, cnp.sign, cnp.reciprocal, nn.softplus, nn.log_sigmoid, nn.elu,
                nn.celu, nn.selu, nn.relu6, nn.hard_tanh, nn.hard_sigmoid, nn.hard_silu,
                lambda v: nn.gelu(v, approximate=False), lambda v: cnp.power(cnp.abs(v), v),
                nn.glu]


@pytest.mark.parametrize("mesh_shape,spec", [((8,), P("a")), ((2, 4), P("a", "b"))])
def test_sharded_operands_give_the_single_device_bits(mesh_shape, spec):
    names = ("a",) if len(mesh_shape) == 1 else ("a", "b")
    mesh = cts.make_mesh(mesh_shape, names)
    x = (_RNG.standard_normal((8, 16)) * 3).astype(np.float32)
    single = cts.device_put(x, cts.devices()[0])
    sharded = cts.device_put(x, cts.NamedSharding(mesh, spec))
    for f in _ELEMENTWISE:
        want = np.asarray(f(single))
        got = f(sharded)
        assert np.asarray(got).tobytes() == want.tobytes(), f
        g1 = np.asarray(cts.grad(lambda v: cnp.sum(f(v) * 1.5))(single))
        g2 = np.asarray(cts.grad(lambda v: cnp.sum(f(v) * 1.5))(sharded))
        np.testing.assert_allclose(g2, g1, rtol=1e-6, atol=1e-7)   # sums run per shard
    # the .at updates too (duplicates, negatives, out of range)
    idx = np.array([1, 1, -1, 9, 3])
    v = _RNG.standard_normal((5, 16)).astype(np.float32)
    for kind in ("subtract", "min", "max", "power", "mul"):
        base = cts.device_put(np.abs(x) + 0.5, cts.devices()[0])
        shb = cts.device_put(np.abs(x) + 0.5, cts.NamedSharding(mesh, spec))
        want = np.asarray(getattr(base.at[idx], kind)(v))
        assert np.asarray(getattr(shb.at[idx], kind)(v)).tobytes() == want.tobytes(), kind
    want = np.asarray(single.at[idx].apply(cnp.sin))
    assert np.asarray(sharded.at[idx].apply(cnp.sin)).tobytes() == want.tobytes()


def test_pow_operator_with_array_exponents_and_scalar_base():
    """x ** y with an Array exponent and b ** x with a scalar base are cnp.power (values and
    gradients against numpy's float64 formulas)."""
    xv = np.array([1.5, 2.0, 3.0, 0.5], np.float32)
    yv = np.array([2.0, 3.0, 1.0, -1.5], np.float32)
    x, y = cts.device_put(xv), cts.device_put(yv)
    np.testing.assert_allclose(np.asarray(x ** y), xv.astype(np.float64) ** yv, rtol=2e-7)
    np.testing.assert_allclose(np.asarray(2.0 ** x), 2.0 ** xv.astype(np.float64), rtol=2e-7)
    np.testing.assert_array_equal(np.asarray(x ** 2), xv * xv)
    gx, gy = cts.grad(lambda a, b: (a ** b).sum(), argnums=(0, 1))(x, y)
    x64, y64 = xv.astype(np.float64), yv.astype(np.float64)
    np.testing.assert_allclose(np.asarray(gx), y64 * x64 ** (y64 - 1), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gy), np.log(x64) * x64 ** y64, rtol=1e-6)
    g = cts.grad(lambda a: (3.0 ** a).sum())(x)
    np.testing.assert_allclose(np.asarray(g), np.log(3.0) * 3.0 ** x64, rtol=1e-6)


def _is_subnormal(v):
    v = np.abs(np.asarray(v, np.float32))
    return (v > 0) & (v < np.finfo(np.float32).tiny)


def test_integer_exponent_is_jaxs_integer_pow(jax_ref):
    """``x ** n`` / ``power(x, n)`` for a Python or numpy integer n is jax's lax.integer_pow:
    repeated squaring, 1 / that for n < 0, ones for n == 0 (NaN ** 0 too), and its gradient
    ``g * (n * x ** (n - 1))``: jax's bits (elements where XLA's CPU flushes a subnormal
    result to zero excepted)."""
    x = np.r_[_RNG.standard_normal(3000).astype(np.float32) * 3,
              np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-20, 3e10, -1.5])].astype(np.float32)
    X = cts.device_put(x)

    def theirs(jax, n):
        jnp = jax.numpy
        return (np.asarray(jnp.power(jnp.asarray(x), n)),
                np.asarray(jax.grad(lambda v: jnp.sum(jnp.power(v, n)))(jnp.asarray(x))))

    def flushed(v):   # XLA's CPU flushes subnormal results to zero (of either sign)
        v = np.asarray(v)
        return np.where(_is_subnormal(v) | (v == 0), np.float32(0), v).astype(np.float32)

    for n in range(-5, 8):
        gg = cts.grad(lambda v: cnp.sum(cnp.power(v, n)))(X)
        if jax_ref.live:   # jax's values themselves
            want, gw = theirs(jax_ref.jax, n)
            for got in (cnp.power(X, n), X ** n, cnp.power(X, np.int32(n))):
                g = np.asarray(got)
                keep = ~_is_subnormal(want) & ~_is_subnormal(g)   # XLA's CPU: subnormal -> 0
                assert_same_bits(g[keep], want[keep], on_gpu(got), err_msg=str(n))
                assert np.all(want[~keep] == 0) or np.all(_is_subnormal(want[~keep])), n
            keep = ~_is_subnormal(gw) & ~_is_subnormal(np.asarray(gg))
            assert_same_bits(np.asarray(gg)[keep], gw[keep], on_gpu(gg), err_msg=f"grad {n}")
        # recorded: the bits with subnormals and zeros as +0 (every NaN as one)
        rec = jax_ref(n, lambda jax: [exact_record(flushed(w)) for w in theirs(jax, n)])
        for got in (cnp.power(X, n), X ** n, cnp.power(X, np.int32(n))):
            assert_exact(flushed(got), rec[0], f"x ** {n}")
        assert_exact(flushed(gg), rec[1], f"grad {n}")
    # not the float path: x ** 3 is x * x * x here, where powf may round differently
    third = np.asarray(X ** 3)
    assert np.array_equal(third[:3000], (x[:3000] * x[:3000]) * x[:3000])


def _ipow_round_each(x, n):
    """lax.integer_pow for a 16-bit float array by its definition, in numpy: square and
    multiply from the low bits of |n|, each product a float32 product rounded to the dtype,
    then 1 / that rounded for n < 0; 1 for n == 0."""
    dt = x.dtype
    if n == 0:
        return np.ones_like(x)
    m, acc, base = abs(n), None, x
    with np.errstate(all="ignore"):
        while m:
            if m & 1:
                acc = base if acc is None else (acc.astype(np.float32) * base.astype(np.float32)).astype(dt)
            m >>= 1
            if m:
                base = (base.astype(np.float32) * base.astype(np.float32)).astype(dt)
        return (np.float32(1) / acc.astype(np.float32)).astype(dt) if n < 0 else acc


@pytest.mark.parametrize("dt", [ml_dtypes.bfloat16, np.float16], ids=["bfloat16", "float16"])
def test_16_bit_integer_power_rounds_every_step_as_jax(dt, jax_ref):
    """x ** n for a 16-bit x and an integer n is jax's integer_pow in that dtype (each
    squaring and product rounded), not one float32 power rounded once; its gradient
    g * (n * x ** (n - 1)) rounds each product too. Against the definition in numpy and,
    where installed, jax's bits (values and gradients, -0.0 and the specials included)."""
    x = np.r_[_RNG.standard_normal(4000) * 3,
              [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-4, -3e-3, 300.0]].astype(dt)
    X = cts.device_put(x)

    def same(a, b, what):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype == dt, what
        nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
        bad = (a.view(np.uint16) != b.view(np.uint16)) & ~nan
        assert not bad.any(), (what, x[bad][:5], a[bad][:5], b[bad][:5])

    once_differs = False
    for n in range(-5, 9):
        got = X ** n
        same(got, _ipow_round_each(x, n), f"x ** {n}")
        same(cnp.power(x, n), _ipow_round_each(x, n), f"power(numpy x, {n})")
        with np.errstate(all="ignore"):
            once = np.power(x.astype(np.float32), np.float32(n)).astype(dt)
        once_differs |= bool((once.view(np.uint16) != np.asarray(got).view(np.uint16)).any())
    assert once_differs   # the inputs tell the two roundings apart
    for n in range(-5, 9):   # jax's bits (recorded as digests: NaN matches any NaN)
        want = jax_ref(n, lambda jax: [exact_record(w) for w in (
            jax.numpy.asarray(x) ** n, jax.grad(lambda v: jax.numpy.sum(
                (v ** n).astype(jax.numpy.float32)))(jax.numpy.asarray(x)))])
        assert_exact(X ** n, want[0], f"jax x ** {n}")
        gc = cts.grad(lambda v: cnp.sum((v ** n).astype(np.float32)))(X)
        assert_exact(gc, want[1], f"jax grad {n}")


def test_isclose_allclose_hstack_vstack_diff_match_numpy():
    a = np.array([1.0, 2.0, np.inf, -np.inf, np.nan, 1e-9, 0.0, np.inf], np.float32)
    b = np.array([1.0 + 1e-6, 2.1, np.inf, np.inf, np.nan, 0.0, 1e-9, 1.0], np.float32)
    for eq in (False, True):
        np.testing.assert_array_equal(np.asarray(cnp.isclose(a, b, equal_nan=eq)),
                                      np.isclose(a, b, equal_nan=eq))
    assert bool(cnp.allclose(a[:2], a[:2] * (1 + 1e-7))) and not bool(cnp.allclose(a, b))
    x = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    for f, g in ((cnp.hstack, np.hstack), (cnp.vstack, np.vstack)):
        np.testing.assert_array_equal(np.asarray(f([x, x])), g([x, x]))
        np.testing.assert_array_equal(np.asarray(f([x[0], x[1]])), g([x[0], x[1]]))
    y = np.array([[1, 4, 9, 16], [2, 3, 5, 8]], np.float32)
    np.testing.assert_array_equal(np.asarray(cnp.diff(y)), np.diff(y))
    np.testing.assert_array_equal(np.asarray(cnp.diff(y, 2, axis=1)), np.diff(y, 2, axis=1))
    np.testing.assert_array_equal(np.asarray(cnp.diff(y, axis=0)), np.diff(y, axis=0))


def test_isclose_rounds_a_python_scalar_to_the_16bit_operand_dtype():
    h = cts.device_put(np.array([1.0, 2.0], np.float16))
    np.testing.assert_array_equal(np.asarray(cnp.isclose(h, 1.0001)), [True, False])
    np.testing.assert_array_equal(np.asarray(cnp.isclose(1.0001, h)), [True, False])
