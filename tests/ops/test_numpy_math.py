"""The elementwise math functions of ctrainstate._src.ops.math_extra (sinh ... fmin) against numpy
float64 references (ulp bounds over a dense sample of float32 inputs with ±0, ±inf, NaN and
the domain edges), against jax (recorded values: tests/recorded.py), gradients
against float64 central differences and jax.grad, special values, bfloat16 / float16,
sharded operands and integer promotion.

References are independent of ctrainstate: numpy's float64 functions rounded to float32
(the ulp distance counts float32 steps from that value), numpy's own exact float32
operations (nextafter, fmod, ldexp, signbit, copysign), and jax's results.
"""
import math

import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import P
from float_checks import ord_f32 as _ord

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
_RNG = np.random.default_rng(20261201)
TINY = np.finfo(np.float32).tiny


# --- ulp distance ---------------------------------------------------------------------------

def _ulps(got, want):
    """float32 steps between got and want (float32); 0 where both are NaN, a huge number
    where one is; +0 and -0 count as equal."""
    got, want = np.atleast_1d(np.asarray(got, np.float32)), np.atleast_1d(np.asarray(want, np.float32))
    d = np.abs(_ord(got) - _ord(want)).astype(np.float64)
    gn, wn = np.isnan(got), np.isnan(want)
    d[gn & wn] = 0
    d[gn ^ wn] = 1e30
    return d


def _ref32(fn64, *args):
    with np.errstate(all="ignore"):
        return np.asarray(fn64(*[np.asarray(a, np.float64) for a in args])).astype(np.float32)


# --- samples --------------------------------------------------------------------------------

def _dense(lo_exp=-38, hi_exp=38, n=1500):
    """Both signs of a log-spaced float32 sweep, the specials and some subnormals."""
    mag = np.logspace(lo_exp, hi_exp, n).astype(np.float32)
    spec = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 1.4e-45, TINY,
                       np.finfo(np.float32).max, 1.0, -1.0, 0.5, 2.0, 3.0])
    return np.concatenate([mag, -mag, spec])


def _interval(lo, hi, n=3000):
    """A uniform sweep of [lo, hi] with the ends and their float32 neighbours."""
    x = np.linspace(lo, hi, n).astype(np.float32)
    ends = np.float32([lo, hi])
    out = np.float32([np.nextafter(ends[0], np.float32(-np.inf)), np.nextafter(ends[1], np.float32(np.inf)),
                      np.nextafter(ends[0], np.float32(np.inf)), np.nextafter(ends[1], np.float32(-np.inf))])
    return np.concatenate([x, ends, out, _dense(n=400)])


X_ALL = _dense()
X_UNIT = _interval(-1.0, 1.0)       # asin, acos, atanh: edges at ±1
X_ACOSH = np.concatenate([_interval(1.0, 30.0), _dense(n=400)])
X_TRIG = np.concatenate([np.linspace(-20, 20, 4001).astype(np.float32), _dense(n=400),
                         np.float32([np.pi / 2, -np.pi / 2, 1e5, 1e30])])
X_EXP = np.concatenate([np.linspace(-160, 130, 4001).astype(np.float32), _dense(n=400),
                        np.arange(-150, 129).astype(np.float32)])
X_SINH = np.concatenate([np.linspace(-92, 92, 4001).astype(np.float32), _dense(n=400)])


# (name, float64 reference, sample, ulp bound vs float64 rounded to float32). The bounds are
# the measured maxima (glibc's float functions; the composites' extra roundings).
UNARY = [
    ("sinh", np.sinh, X_SINH, 2), ("cosh", np.cosh, X_SINH, 2), ("tan", np.tan, X_TRIG, 1),
    ("arcsin", np.arcsin, X_UNIT, 1), ("arccos", np.arccos, X_UNIT, 1),
    ("arctan", np.arctan, X_ALL, 1), ("arcsinh", np.arcsinh, X_ALL, 2),
    ("arccosh", np.arccosh, X_ACOSH, 2), ("arctanh", np.arctanh, X_UNIT, 2),
    ("cbrt", np.cbrt, X_ALL, 1), ("exp2", np.exp2, X_EXP, 1),
    ("log2", np.log2, X_ALL, 2), ("log10", np.log10, X_ALL, 2),
    ("deg2rad", np.deg2rad, X_ALL, 1), ("rad2deg", np.rad2deg, X_ALL, 1),
]


def _pairs(n=3000):
    a = _dense(n=300)
    i = _RNG.integers(0, a.size, n)
    j = _RNG.integers(0, a.size, n)
    g1 = (_RNG.standard_normal(n) * 10).astype(np.float32)
    g2 = (_RNG.standard_normal(n) * 10).astype(np.float32)
    spec = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0])
    s1, s2 = np.meshgrid(spec, spec)
    return (np.concatenate([a[i], g1, s1.ravel()]), np.concatenate([a[j], g2, s2.ravel()]))


P1, P2 = _pairs()


def _np_heaviside(a, b):
    return np.heaviside(a, b)


def _np_logaddexp2(a, b):
    return np.logaddexp2(a, b)


BINARY = [
    ("arctan2", np.arctan2, 1), ("hypot", np.hypot, 2), ("logaddexp", np.logaddexp, 2),
    ("logaddexp2", _np_logaddexp2, 2), ("heaviside", _np_heaviside, 0),
    ("fmax", np.fmax, 0), ("fmin", np.fmin, 0),
]


@pytest.mark.parametrize("name,ref,x,bound", UNARY, ids=[u[0] for u in UNARY])
def test_unary_against_float64(name, ref, x, bound):
    got = np.asarray(getattr(cnp, name)(x))
    want = _ref32(ref, x)
    d = _ulps(got, want)
    assert got.dtype == np.float32
    worst = int(np.argmax(d))
    assert d.max() <= bound, (name, x[worst], got[worst], want[worst], d.max())


def _abs_cond(name, a, b, want):
    """The float32 rounding of the composites' intermediate results, in units of the output:
    logaddexp's sum ``max + tail`` cancels where the result is near 0 (an ulp of max), and the
    ulp bound applies to the larger of the result and that."""
    if name in ("logaddexp", "logaddexp2"):
        return np.maximum(np.abs(want), np.maximum(np.abs(a), np.abs(b)))
    return np.abs(want)


@pytest.mark.parametrize("name,ref,bound", BINARY, ids=[b[0] for b in BINARY])
def test_binary_against_float64(name, ref, bound):
    got = np.asarray(getattr(cnp, name)(P1, P2))
    want = _ref32(ref, P1, P2)
    assert got.dtype == np.float32
    d = _ulps(got, want)
    scale = _abs_cond(name, P1, P2, want.astype(np.float64))
    # an ulp of `scale` where the result cancels below it
    with np.errstate(all="ignore"):
        spacing = np.spacing(np.maximum(scale, TINY).astype(np.float32)).astype(np.float64)
        near = np.abs(got.astype(np.float64) - want.astype(np.float64)) <= bound * spacing
    bad = (d > bound) & ~near & ~(np.isnan(got) & np.isnan(want))
    if bad.any():
        k = int(np.argmax(bad))
        raise AssertionError((name, P1[k], P2[k], got[k], want[k], d[k]))


def test_sinc_against_float64():
    x = np.concatenate([np.linspace(-6, 6, 4801).astype(np.float32), _dense(n=400)])
    got = np.asarray(cnp.sinc(x))
    with np.errstate(all="ignore"):
        want = np.sinc(x.astype(np.float64))
    # sin(pi x) rounds pi x to float32 first (jax's composition): an absolute error of a few
    # float32 epsilons near the zeros of sinc, ulps elsewhere
    err = np.abs(got - want)
    ok = (err <= 4e-7 + 4 * np.spacing(np.abs(want).astype(np.float32))) | (np.isnan(got) & np.isnan(want))
    # where pi * x overflows float32, sin(inf) is NaN: jax's sinc is NaN there too (numpy: ~0)
    ok |= (np.abs(x.astype(np.float64)) * np.float32(np.pi) > np.finfo(np.float32).max) & np.isnan(got)
    assert ok.all(), (x[~ok][:5], got[~ok][:5], want[~ok][:5])
    assert np.isnan(np.asarray(cnp.sinc(np.float32([np.inf, -np.inf, np.nan])))).all()
    assert np.asarray(cnp.sinc(np.float32([0.0, -0.0]))).tolist() == [1.0, 1.0]


def test_exact_functions_against_numpy():
    a, b = P1, P2
    nx, got = np.nextafter(a, b), np.asarray(cnp.nextafter(a, b))
    assert np.array_equal(np.isnan(got), np.isnan(nx))
    assert np.array_equal(got[~np.isnan(nx)].view(np.uint32), nx[~np.isnan(nx)].view(np.uint32))
    with np.errstate(all="ignore"):
        fm = np.fmod(a, b)
    got = np.asarray(cnp.fmod(a, b))
    assert np.array_equal(np.isnan(got), np.isnan(fm))
    assert np.array_equal(got[~np.isnan(fm)].view(np.uint32), fm[~np.isnan(fm)].view(np.uint32))
    assert np.array_equal(np.asarray(cnp.signbit(a)), np.signbit(a))
    cs = np.asarray(cnp.copysign(a, b))
    ok = ~np.isnan(a)
    assert np.array_equal(cs[ok].view(np.uint32), np.copysign(a, b)[ok].view(np.uint32))
    e = _RNG.integers(-300, 300, a.size).astype(np.int32)
    with np.errstate(all="ignore"):
        ld = np.ldexp(a, e)
    got = np.asarray(cnp.ldexp(a, e))
    assert np.array_equal(np.isnan(got), np.isnan(ld))
    assert np.array_equal(got[~np.isnan(ld)].view(np.uint32), ld[~np.isnan(ld)].view(np.uint32))


def test_float_power_is_pow_of_floats():
    x = np.abs(_RNG.standard_normal(500)).astype(np.float32) * 4
    y = (_RNG.standard_normal(500) * 3).astype(np.float32)
    d = _ulps(np.asarray(cnp.float_power(x, y)), _ref32(np.power, x, y))
    assert d.max() <= 1
    # an integer exponent is a float exponent (jnp.float_power: lax.pow, not integer_pow)
    got = np.asarray(cnp.float_power(x, 3))
    assert _ulps(got, _ref32(np.power, x, 3.0)).max() <= 1
    assert np.isnan(np.asarray(cnp.float_power(np.float32(-2.0), np.float32(0.5))))


# --- special values --------------------------------------------------------------------------------

def _bits(v):
    return np.atleast_1d(np.asarray(v, np.float32)).view(np.uint32).tolist()


def test_special_values():
    inf, nan = np.float32(np.inf), np.float32(np.nan)
    z, nz = np.float32(0.0), np.float32(-0.0)
    # signed zeros are kept by the odd functions and copysign (numpy's bits)
    for name in ("sinh", "tan", "arcsin", "arctan", "arcsinh", "arctanh", "cbrt"):
        assert _bits(getattr(cnp, name)(nz)) == _bits(getattr(np, name)(nz)), name
    assert _bits(cnp.copysign(z, np.float32(-1))) == _bits(nz)
    assert _bits(cnp.copysign(np.float32(3), nz)) == _bits(np.float32(-3))
    assert _bits(cnp.copysign(np.float32(3), -nan)) == _bits(np.float32(-3))   # the NaN's sign bit
    assert np.asarray(cnp.signbit(np.float32([nz, -nan, nan, z, -inf]))).tolist() == \
        [True, True, False, False, True]
    # domain edges (numpy float64)
    edges = [("arcsin", 1.0), ("arcsin", -1.0), ("arccos", -1.0), ("arccosh", 1.0),
             ("arctanh", 1.0), ("arctanh", -1.0), ("arctan", np.inf), ("exp2", -np.inf),
             ("exp2", 128.0), ("cosh", -np.inf), ("log2", 0.0), ("log10", -1.0),
             ("arccosh", 0.999), ("arcsin", 1.0001)]
    for name, v in edges:
        got = np.asarray(getattr(cnp, name)(np.float32(v)))
        with np.errstate(all="ignore"):
            want = np.float32(getattr(np, name)(np.float64(v)))
        assert _ulps(got, want) <= 1, (name, v, got, want)
    # arctan2 at the zeros and infinities: C99's values, bit for bit, taken from numpy's
    # float64 arctan2 rounded to float32 (numpy's float32 loop depends on the host: with
    # AVX-512 it returns pi/4 and 3pi/4 one ulp below the nearest float32)
    vals = np.float32([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf])
    a, b = np.meshgrid(vals, vals)
    want = np.arctan2(a.astype(np.float64), b.astype(np.float64)).astype(np.float32)
    assert _bits(cnp.arctan2(a, b)) == _bits(want)
    # logaddexp: infinities of one sign, NaN
    la = np.asarray(cnp.logaddexp(np.float32([-inf, inf, inf, nan, -inf]),
                                  np.float32([-inf, inf, -inf, 0.0, 1.0])))
    assert la[:3].tolist() == [-np.inf, np.inf, np.inf] and np.isnan(la[3]) and la[4] == 1.0
    # hypot: inf wins over NaN
    assert np.asarray(cnp.hypot(np.float32([inf, nan, -inf]), np.float32([nan, -inf, 0.0]))).tolist() \
        == [np.inf, np.inf, np.inf]
    # heaviside's NaN and zero cases, fmax / fmin ignoring NaN
    assert np.isnan(np.asarray(cnp.heaviside(nan, np.float32(0.5))))
    assert np.asarray(cnp.heaviside(np.float32([0.0, -0.0]), np.float32(0.25))).tolist() == [0.25, 0.25]
    assert np.asarray(cnp.fmax(np.float32([nan, 1.0]), np.float32([2.0, nan]))).tolist() == [2.0, 1.0]
    assert np.isnan(np.asarray(cnp.fmin(nan, nan)))
    # fmod: NaN for a zero divisor or an infinite dividend, x for an infinite divisor
    fm = np.asarray(cnp.fmod(np.float32([1.0, inf, 5.5, -4.0]), np.float32([0.0, 2.0, -inf, 2.0])))
    assert np.isnan(fm[:2]).all() and fm[2] == 5.5 and _bits(fm[3]) == _bits(nz)
    # nextafter into the subnormals (kept, as in jax: lax.nextafter's documented example)
    assert _bits(cnp.nextafter(z, np.float32(1))) == [1]
    assert _bits(cnp.nextafter(z, np.float32(-1))) == [0x80000001]
    # ldexp: a subnormal result is rounded once (numpy), not flushed
    assert _bits(cnp.ldexp(np.float32(1.5), -149)) == _bits(np.ldexp(np.float32(1.5), -149))
    assert np.asarray(cnp.ldexp(np.float32(1.0), 128)).item() == np.inf
    with pytest.raises(ValueError):
        cnp.ldexp(np.float32(1.0), np.float32(2.0))


def test_degrees_radians_aliases():
    x = np.float32([30.0, -45.0, 1.0])
    assert np.asarray(cnp.radians(x)).tobytes() == np.asarray(cnp.deg2rad(x)).tobytes()
    assert np.asarray(cnp.degrees(x)).tobytes() == np.asarray(cnp.rad2deg(x)).tobytes()
    assert "radians" in cnp.__all__ and "logaddexp" in cnp.__all__


# --- jax ------------------------------------------------------------------------------------

def _jax_ok(x):
    """Points where XLA's CPU (which flushes subnormal inputs) computes the true function."""
    x = np.asarray(x, np.float32)
    return ~((np.abs(x) < TINY) & (x != 0))


JAX_UNARY = {  # our name -> ulps from jax's result where jax is within 2 ulp of float64
    "sinh": 2, "cosh": 2, "tan": 2, "arcsin": 2, "arccos": 2, "arctan": 2, "arcsinh": 2,
    "arccosh": 3, "arctanh": 2, "cbrt": 1, "exp2": 1, "log2": 2, "log10": 2, "deg2rad": 0,
    "rad2deg": 0,
}
JAX_BINARY = {"arctan2": 1, "hypot": 2, "logaddexp": 3, "logaddexp2": 3, "heaviside": 0,
              "fmax": 0, "fmin": 0, "copysign": 0, "nextafter": 0, "fmod": 0}


def test_against_jax(jax_ref):
    """Our values against jax's: within the bound, or else closer to the float64 value than
    jax's (XLA's CPU sinh / cosh are up to 24 ulp off near |x| = 85, its asin and exp2 flush
    results near the smallest normal: measured with jax 0.10)."""
    rng = np.random.default_rng(20261202)
    for name, ref, x, _ in UNARY:
        x = x[_jax_ok(x)]
        want = jax_ref(name, lambda jnp: getattr(jnp, name)(x))
        got = np.asarray(getattr(cnp, name)(x))
        r64 = _ref32(ref, x)
        keep = _jax_ok(want) & _jax_ok(r64)   # (and where jax's result is not flushed)
        d = _ulps(got[keep], want[keep])
        ours_better = _ulps(got[keep], r64[keep]) < _ulps(want[keep], r64[keep])
        bad = (d > JAX_UNARY[name]) & ~ours_better
        assert not bad.any(), (name, x[keep][bad][:3], got[keep][bad][:3], want[keep][bad][:3])
        assert (d[~ours_better] <= JAX_UNARY[name]).all()
    ok = _jax_ok(P1) & _jax_ok(P2)
    a, b = P1[ok], P2[ok]
    for name, bound in JAX_BINARY.items():
        want = jax_ref(name, lambda jnp: getattr(jnp, name)(a, b))
        got = np.asarray(getattr(cnp, name)(a, b))
        keep = _jax_ok(want) & _jax_ok(got)   # (XLA flushes subnormal results)
        if name in ("logaddexp", "logaddexp2"):   # cancellation near 0: compare by max(|a|, |b|)
            sc = np.maximum(np.abs(a), np.abs(b))
            with np.errstate(all="ignore"):
                near = np.abs(got - want) <= bound * np.spacing(np.maximum(sc, TINY))
            keep &= ~near
        d = _ulps(got[keep], want[keep])
        assert d.max() <= bound, (name, a[keep][np.argmax(d)], b[keep][np.argmax(d)], d.max())
    x = np.linspace(-5, 5, 2001).astype(np.float32)
    assert np.abs(np.asarray(cnp.sinc(x)) - jax_ref("sinc", lambda jnp: jnp.sinc(x))).max() <= 2e-7
    assert np.array_equal(np.asarray(cnp.signbit(P1)), jax_ref("signbit", lambda jnp: jnp.signbit(P1)))
    e = rng.integers(-120, 120, a.size).astype(np.int32)
    want = jax_ref("ldexp", lambda jnp: jnp.ldexp(a, e))
    got = np.asarray(cnp.ldexp(a, e))
    keep = _jax_ok(want) & _jax_ok(got)
    assert _ulps(got[keep], want[keep]).max() == 0
    y = (rng.standard_normal(a.size)).astype(np.float32)
    pw = np.abs(a).clip(1e-3, 1e3)
    want = jax_ref("float_power", lambda jnp: jnp.float_power(pw, y))
    assert _ulps(np.asarray(cnp.float_power(pw, y)), want).max() <= 2


# --- gradients -----------------------------------------------------------------------------------

# (name, points, d/dx in float64 from numpy)
GRAD_UNARY = [
    ("sinh", np.linspace(-5, 5, 41), np.cosh), ("cosh", np.linspace(-5, 5, 41), np.sinh),
    ("tan", np.linspace(-1.4, 1.4, 41), lambda x: 1 / np.cos(x) ** 2),
    ("arcsin", np.linspace(-0.95, 0.95, 41), lambda x: 1 / np.sqrt(1 - x * x)),
    ("arccos", np.linspace(-0.95, 0.95, 41), lambda x: -1 / np.sqrt(1 - x * x)),
    ("arctan", np.linspace(-8, 8, 41), lambda x: 1 / (1 + x * x)),
    ("arcsinh", np.linspace(-8, 8, 41), lambda x: 1 / np.sqrt(1 + x * x)),
    ("arccosh", np.linspace(1.1, 9, 41), lambda x: 1 / np.sqrt(x * x - 1)),
    ("arctanh", np.linspace(-0.95, 0.95, 41), lambda x: 1 / (1 - x * x)),
    ("cbrt", np.linspace(0.1, 9, 41), lambda x: np.cbrt(x) ** -2 / 3),
    ("exp2", np.linspace(-9, 9, 41), lambda x: np.log(2) * np.exp2(x)),
    ("log2", np.linspace(0.1, 9, 41), lambda x: 1 / (x * np.log(2))),
    ("log10", np.linspace(0.1, 9, 41), lambda x: 1 / (x * np.log(10))),
    ("deg2rad", np.linspace(-9, 9, 5), lambda x: np.full_like(x, np.pi / 180)),
    ("rad2deg", np.linspace(-9, 9, 5), lambda x: np.full_like(x, 180 / np.pi)),
]


def _central(f64, x, h=1e-6):
    return (f64(x + h) - f64(x - h)) / (2 * h)


@pytest.mark.parametrize("name,pts,deriv", GRAD_UNARY, ids=[g[0] for g in GRAD_UNARY])
def test_unary_gradients_against_float64(name, pts, deriv):
    x = pts.astype(np.float32)
    g = np.asarray(cts.grad(lambda v: cnp.sum(getattr(cnp, name)(v)))(cts.device_put(x)))
    want = deriv(x.astype(np.float64))
    np.testing.assert_allclose(g, want, rtol=2e-6, atol=1e-7)
    # and the central difference of numpy's own function (independent of the formula)
    fd = _central(getattr(np, name), x.astype(np.float64))
    np.testing.assert_allclose(g, fd, rtol=2e-5, atol=1e-6)


def _grad2(name, a, b):
    return [np.asarray(t) for t in cts.grad(lambda u, v: cnp.sum(getattr(cnp, name)(u, v)),
                                            argnums=(0, 1))(cts.device_put(a), cts.device_put(b))]


def test_binary_gradients_against_float64():
    a = (_RNG.standard_normal(64) * 3).astype(np.float32)
    b = (_RNG.standard_normal(64) * 3).astype(np.float32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    fns = {"arctan2": np.arctan2, "hypot": np.hypot, "logaddexp": np.logaddexp,
           "logaddexp2": np.logaddexp2, "fmod": np.fmod, "fmax": np.fmax, "fmin": np.fmin,
           "copysign": np.copysign}
    for name, f in fns.items():
        ga, gb = _grad2(name, a, b)
        np.testing.assert_allclose(ga, _central(lambda u: f(u, b64), a64), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
        if name != "copysign":
            np.testing.assert_allclose(gb, _central(lambda v: f(a64, v), b64), rtol=1e-5,
                                       atol=1e-6, err_msg=name)
        else:
            assert not gb.any()
    # ldexp: 2 ** e in x1
    e = np.int32([3, -2, 0, 10])
    g = np.asarray(cts.grad(lambda u: cnp.sum(cnp.ldexp(u, e)))(cts.device_put(np.float32([1.5, -2, 3, 0.25]))))
    assert g.tolist() == [8.0, 0.25, 1.0, 1024.0]
    # float_power, sinc
    x = np.linspace(0.5, 3, 11).astype(np.float32)
    g = np.asarray(cts.grad(lambda u: cnp.sum(cnp.float_power(u, 2.5)))(cts.device_put(x)))
    np.testing.assert_allclose(g, 2.5 * x.astype(np.float64) ** 1.5, rtol=2e-6)
    xs = np.float32([-2.3, -0.7, 0.3, 1.6])
    g = np.asarray(cts.grad(lambda u: cnp.sum(cnp.sinc(u)))(cts.device_put(xs)))
    np.testing.assert_allclose(g, _central(np.sinc, xs.astype(np.float64)), rtol=1e-5, atol=1e-6)


def test_gradients_at_domain_edges():
    one = cts.device_put(np.float32([1.0, -1.0]))

    def g1(name, x):
        return np.asarray(cts.grad(lambda v: cnp.sum(getattr(cnp, name)(v)))(cts.device_put(np.float32(x))))
    assert g1("arcsin", [1.0, -1.0]).tolist() == [np.inf, np.inf]      # jax: rsqrt(0) = inf
    assert g1("arccos", [1.0]).tolist() == [-np.inf]
    assert g1("arccosh", [1.0]).tolist() == [np.inf]
    assert g1("arctanh", [1.0, -1.0]).tolist() == [np.inf, np.inf]
    assert g1("cbrt", [0.0]).tolist() == [np.inf]
    assert g1("sinc", [0.0]).tolist() == [0.0]                         # jax's Maclaurin rule
    assert np.isnan(g1("arcsin", [2.0])).all()
    del one
    # hypot at the origin splits (0.5, 0.5); logaddexp at (inf, inf) gives 1 and 1; fmax at
    # a tie goes to x2; heaviside's gradient goes to x2 at 0; ldexp at 0 and inf is 1
    assert [t.tolist() for t in _grad2("hypot", np.float32([0.0]), np.float32([0.0]))] == [[0.5], [0.5]]
    assert [t.tolist() for t in _grad2("logaddexp", np.float32([np.inf]), np.float32([np.inf]))] == [[1.0], [1.0]]
    assert [t.tolist() for t in _grad2("fmax", np.float32([1.0]), np.float32([1.0]))] == [[0.0], [1.0]]
    assert [t.tolist() for t in _grad2("heaviside", np.float32([0.0, 2.0]), np.float32([0.5, 0.5]))] == \
        [[0.0, 0.0], [1.0, 0.0]]
    g = np.asarray(cts.grad(lambda u: cnp.sum(cnp.ldexp(u, 5)))(cts.device_put(np.float32([0.0, np.inf, 1.0]))))
    assert g.tolist() == [1.0, 1.0, 32.0]
    # nextafter has no derivative (jax raises too)
    with pytest.raises(NotImplementedError, match="nextafter"):
        cts.grad(lambda u: cnp.sum(cnp.nextafter(u, 1.0)))(cts.device_put(np.float32([0.5])))


def test_gradients_against_jax_grad(jax_ref):
    x = np.float32([0.3, -0.6, 0.9])
    for name in ("sinh", "cosh", "tan", "arcsin", "arccos", "arctan", "arcsinh", "arctanh",
                 "cbrt", "exp2", "log2", "log10", "deg2rad", "rad2deg", "sinc"):
        xx = np.abs(x) if name in ("cbrt", "log2", "log10") else x
        want = jax_ref(name, lambda jax, jnp: jax.grad(lambda v: jnp.sum(getattr(jnp, name)(v)))(xx))
        got = np.asarray(cts.grad(lambda v: cnp.sum(getattr(cnp, name)(v)))(cts.device_put(xx)))
        assert _ulps(got, want).max() <= 4, (name, got, want)
    want = jax_ref("arccosh", lambda jax, jnp: jax.grad(lambda v: jnp.sum(jnp.arccosh(v)))(x + 1.5))
    got = np.asarray(cts.grad(lambda v: cnp.sum(cnp.arccosh(v)))(cts.device_put(x + 1.5)))
    assert _ulps(got, want).max() <= 4
    a = np.float32([0.3, -2.0, 0.0, np.inf, 1.0, 5.5])
    b = np.float32([-1.2, 0.7, 0.0, 1.0, 1.0, 2.0])
    for name in ("arctan2", "hypot", "logaddexp", "logaddexp2", "heaviside", "fmax", "fmin",
                 "fmod", "copysign"):
        if name in ("arctan2", "fmod"):
            aa, bb = a[[0, 1, 4, 5]], b[[0, 1, 4, 5]]
        else:
            aa, bb = a, b
        want = jax_ref(name, lambda jax, jnp: jax.grad(lambda u, v: jnp.sum(getattr(jnp, name)(u, v)),
                                                       argnums=(0, 1))(aa, bb))
        got = _grad2(name, aa, bb)
        for w, g_ in zip(want, got):
            assert _ulps(g_, np.asarray(w)).max() <= 4, (name, g_, np.asarray(w))


# --- dtypes, promotion, sharding --------------------------------------------------------------------

ALL_UNARY = [u[0] for u in UNARY] + ["sinc"]
ALL_BINARY = ["arctan2", "hypot", "logaddexp", "logaddexp2", "heaviside", "fmax", "fmin",
              "copysign", "fmod", "float_power"]


@pytest.mark.parametrize("dt", [BF16, F16], ids=["bfloat16", "float16"])
def test_16bit_floats_compute_in_float32_and_round_once(dt):
    x = np.float32([0.3, -0.6, 0.9, 1.7, 2.5, -3.25, 0.0, np.inf, np.nan]).astype(dt)
    y = np.float32([1.1, 0.4, -0.2, 2.0, 0.7, 1.5, -1.0, 1.0, 1.0]).astype(dt)
    info = ml_dtypes.finfo(dt)
    for name in ALL_UNARY:
        got = getattr(cnp, name)(cts.device_put(x))
        assert got.dtype == dt, name
        with np.errstate(all="ignore"):
            ref = getattr(np, name)(x.astype(np.float64)).astype(dt)
        with np.errstate(all="ignore"):
            d = np.abs(np.asarray(got).astype(np.float64) - ref.astype(np.float64))
        tol = np.abs(ref.astype(np.float64)) * float(info.eps) + 1e-30
        fine = (d <= tol) | (np.isnan(np.asarray(got, np.float32)) & np.isnan(ref.astype(np.float32))) \
            | (np.asarray(got).astype(np.float64) == ref.astype(np.float64))
        assert fine.all(), (name, np.asarray(got), ref)
    for name in ALL_BINARY:
        got = getattr(cnp, name)(cts.device_put(x), cts.device_put(y))
        assert got.dtype == dt, name
        # exactly the float32 computation rounded once to the dtype
        with np.errstate(over="ignore"):
            want = np.asarray(getattr(cnp, name)(x.astype(np.float32),
                                                 y.astype(np.float32))).astype(dt)
        assert np.asarray(got).astype(np.float32).tobytes() == want.astype(np.float32).tobytes(), name
    # a float32 operand with a 16-bit one: float32 (jax's promotion)
    assert cnp.arctan2(cts.device_put(x), y.astype(np.float32)).dtype == np.float32
    # nextafter in 16 bits would need a 16-bit step (the float32 one rounds back to x):
    # refused rather than returning x unchanged
    with pytest.raises(TypeError, match="operands are not supported"):
        cnp.nextafter(cts.device_put(x), cts.device_put(y))
    # gradients of a 16-bit input have its dtype
    g = cts.grad(lambda v: cnp.sum(cnp.sinh(v).astype(np.float32)))(cts.device_put(x[:3]))
    assert g.dtype == dt


def test_16bit_against_jax(jax_ref):
    x = np.float32([0.3, -0.6, 0.9, 1.7, 2.5, -3.25, 0.0]).astype(BF16)
    for name in ("sinh", "cosh", "tan", "arctan", "arcsinh", "cbrt", "exp2", "deg2rad"):
        got = np.asarray(getattr(cnp, name)(cts.device_put(x))).astype(np.float32)
        want = jax_ref(name, lambda jnp: getattr(jnp, name)(x)).astype(np.float32)
        # one bfloat16 ulp at most (jax may round intermediate steps)
        assert (np.abs(got - want) <= np.abs(want) * 2 ** -7 + 1e-30).all(), (name, got, want)


def test_integer_operands_promote_to_float32():
    xi = np.int32([-3, -1, 0, 1, 2, 7])
    xf = xi.astype(np.float32)
    for name in ALL_UNARY:
        for v in (xi, cts.device_put(xi)):
            got = getattr(cnp, name)(v)
            assert got.dtype == np.float32, name
            want = np.asarray(getattr(cnp, name)(xf))
            assert np.asarray(got).tobytes() == want.tobytes(), name
    for name in ALL_BINARY:
        if name == "fmod":
            continue
        got = getattr(cnp, name)(cts.device_put(xi), 2)
        assert got.dtype == np.float32, name
        assert np.asarray(got).tobytes() == np.asarray(getattr(cnp, name)(xf, 2.0)).tobytes(), name
    # an int32 Array with a bfloat16 one: bfloat16 (jax's lattice)
    assert cnp.hypot(cts.device_put(xi), cts.device_put(xf.astype(BF16))).dtype == BF16
    # ldexp of ints: float32
    assert np.asarray(cnp.ldexp(xi, np.int32(2))).tolist() == (xf * 4).tolist()
    # signbit of ints: x < 0; of bools: false
    assert np.asarray(cnp.signbit(cts.device_put(xi))).tolist() == (xi < 0).tolist()
    assert not np.asarray(cnp.signbit(np.array([True, False]))).any()


def test_integer_fmod():
    a = np.int32([5, -5, 5, -5, 7, -7, 0, -2 ** 31, 2 ** 31 - 1, 6])
    b = np.int32([3, 3, -3, -3, 0, 0, 4, -1, -2, 3])
    got = cnp.fmod(cts.device_put(a), cts.device_put(b))
    assert got.dtype == np.int32
    nz = b != 0
    assert np.asarray(got)[nz].tolist() == np.fmod(a[nz], b[nz]).tolist()
    assert np.asarray(got)[~nz].tolist() == [0, 0]     # jnp: a zero divisor is replaced by 1
    u = cnp.fmod(cts.device_put(np.uint32([7, 4000000000, 3])), np.uint32([4, 7, 0]))
    assert u.dtype == np.uint32 and np.asarray(u).tolist() == [3, 4000000000 % 7, 0]
    assert np.asarray(cnp.fmod(cts.device_put(a), 4)).tolist() == np.fmod(a, 4).tolist()


def test_integer_fmod_against_jax(jax_ref):
    rng = np.random.default_rng(20261203)
    a = rng.integers(-50, 50, 200).astype(np.int32)
    b = rng.integers(-6, 6, 200).astype(np.int32)
    assert np.asarray(cnp.fmod(a, b)).tolist() == jax_ref("fmod", lambda jnp: jnp.fmod(a, b)).tolist()


@pytest.mark.parametrize("mesh_shape,spec", [((8,), P("a")), ((2, 4), P("a", "b"))])
def test_sharded_operands_give_the_single_device_result(mesh_shape, spec):
    names = ("a",) if len(mesh_shape) == 1 else ("a", "b")
    mesh = cts.make_mesh(mesh_shape, names)
    x = (_RNG.uniform(0.05, 0.95, (8, 16))).astype(np.float32)
    y = (_RNG.standard_normal((8, 16)) * 2).astype(np.float32)
    row = (_RNG.standard_normal((16,)) * 2).astype(np.float32)
    single_x, single_y = cts.device_put(x, cts.devices()[0]), cts.device_put(y, cts.devices()[0])
    sh = cts.NamedSharding(mesh, spec)
    sx, sy = cts.device_put(x, sh), cts.device_put(y, sh)
    for name in ALL_UNARY + ["signbit"]:
        f = getattr(cnp, name)
        got = f(sx)
        assert got.sharding == sx.sharding, name
        assert np.asarray(got).tobytes() == np.asarray(f(single_x)).tobytes(), name
    for name in ALL_BINARY:
        f = getattr(cnp, name)
        assert np.asarray(f(sx, sy)).tobytes() == np.asarray(f(single_x, single_y)).tobytes(), name
        # a replicated row broadcast against the sharded operand, and a Python scalar
        assert np.asarray(f(sx, row)).tobytes() == np.asarray(f(single_x, row)).tobytes(), name
        assert np.asarray(f(sy, 0.5)).tobytes() == np.asarray(f(single_y, 0.5)).tobytes(), name
    ld = cnp.ldexp(sx, np.int32(3))
    assert np.asarray(ld).tobytes() == (x * 8).tobytes() and ld.sharding == sx.sharding
    g1 = np.asarray(cts.grad(lambda v: cnp.sum(cnp.arctan2(v, y) * cnp.sinh(v)))(single_x))
    g2 = np.asarray(cts.grad(lambda v: cnp.sum(cnp.arctan2(v, y) * cnp.sinh(v)))(sx))
    np.testing.assert_allclose(g2, g1, rtol=1e-6, atol=1e-7)


def test_eval_shape_structs():
    from ctrainstate._src.array.abstract import ShapeDtypeStruct
    s = ShapeDtypeStruct((3, 1), np.int32)
    t = ShapeDtypeStruct((4,), BF16)
    assert cnp.sinh(s).shape == (3, 1) and cnp.sinh(s).dtype == np.float32
    r = cnp.arctan2(s, t)
    assert r.shape == (3, 4) and r.dtype == BF16
    assert cnp.signbit(t).dtype == np.bool_
    assert cnp.fmod(s, s).dtype == np.int32


def test_docstrings():
    for name in ALL_UNARY + ALL_BINARY + ["signbit", "ldexp", "radians", "degrees"]:
        doc = getattr(cnp, name).__doc__
        assert doc and "jnp." in doc or "Alias" in (doc or ""), name
    assert math.isclose(float(np.asarray(cnp.log2(np.float32(8.0)))), 3.0)


def test_module_doctests():
    import doctest

    from ctrainstate._src.ops import math_extra as _math_extra
    res = doctest.testmod(_math_extra)
    assert res.failed == 0 and res.attempted >= 3
