"""ctrainstate's discrete samplers (_random_discrete.py): poisson, binomial, multinomial and the
key helpers clone, key_impl, key_dtype.

Without jax: moments and pmfs from the closed forms, edge parameters, broadcasting, dtypes,
the float helpers (_fma against exact rationals), mesh invariance, errors. With jax: live
parity (the same integers, both sides of every algorithm's threshold).
"""
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import random as R
from ctrainstate._src.random.discrete import (_fma, _lgamma, _reverse_cumsum, binomial, clone,
                                          key_dtype, key_impl, multinomial, poisson)
from ctrainstate._src.random.dist import _rounder
from sampler_checks import mean_ok, sample_count, sharded_like_host

BF16 = np.dtype(ml_dtypes.bfloat16)
KEY = R.PRNGKey(2024)
INT_MAX = np.iinfo(np.int32).max


def _var_ok(x, var, mu4, sigmas=5.0):
    """The sample variance is within `sigmas` standard errors sqrt((mu4 - var^2) / n)."""
    x = np.asarray(x, np.float64)
    assert abs(x.var() - var) < sigmas * math.sqrt((mu4 - var ** 2) / x.size), (x.var(), var)


def _frac_ok(hits, p, sigmas=5.0):
    """The fraction of True in `hits` is within `sigmas` binomial standard errors of p."""
    hits = np.asarray(hits)
    se = math.sqrt(max(p * (1 - p), 1e-12) / hits.size)
    assert abs(hits.mean() - p) < sigmas * se, (hits.mean(), p)


def _poisson_pmf(k, lam):
    return math.exp(k * math.log(lam) - lam - math.lgamma(k + 1))


def _binom_pmf(k, n, p):
    return math.comb(n, k) * p ** k * (1 - p) ** (n - k)


# --- distributions, from the closed forms -------------------------------------------------

def test_poisson_moments_and_pmf():
    lam = np.float32([0.7, 4.0, 9.5, 25.0, 1000.0])      # Knuth below 10, PTRS from 10 on
    rows = sample_count(20_000, 8_000)
    x = poisson(KEY, lam, (rows, 5))
    assert x.dtype == np.int32 and x.shape == (rows, 5) and x.min() >= 0
    for j, lm in enumerate(lam.tolist()):
        col = x[:, j]
        mean_ok(col, lm, lm)
        _var_ok(col, lm, lm * (1 + 3 * lm))               # Poisson: mu4 = lam (1 + 3 lam)
    for j, k in ((0, 0), (0, 1), (1, 0), (1, 4), (1, 9), (2, 9), (3, 25), (3, 18)):
        _frac_ok(x[:, j] == k, _poisson_pmf(k, float(lam[j])))
    below = sum(_poisson_pmf(k, 1000.0) for k in range(1001))   # P(X <= 1000), lam = 1000
    _frac_ok(x[:, 4] <= 1000, below)


def test_binomial_moments_and_pmf():
    # inversion (n min(p, 1-p) <= 10) and BTRS, p on both sides of 0.5
    n = np.float32([5, 30, 40, 1000, 1000])
    p = np.float32([0.3, 0.2, 0.3, 0.7, 0.02])
    x = binomial(KEY, n, p, (sample_count(20_000, 8_000), 5))
    assert x.dtype == np.float32 and (x == np.floor(x)).all()
    assert (x >= 0).all() and (x <= n).all()
    for j in range(5):
        nn, pp = float(n[j]), float(p[j])
        v = nn * pp * (1 - pp)
        mean_ok(x[:, j], nn * pp, v)
        _var_ok(x[:, j], v, 3 * v ** 2 + v * (1 - 6 * pp * (1 - pp)))   # binomial mu4
    for j, k in ((0, 0), (0, 1), (0, 2), (0, 5), (1, 6), (2, 12), (3, 700)):
        _frac_ok(x[:, j] == k, _binom_pmf(k, int(n[j]), float(p[j])))


def test_multinomial_counts():
    p = np.float32([0.1, 0.25, 0.05, 0.6])
    c = multinomial(KEY, 50.0, p, shape=(25_000, 4))
    assert c.shape == (25_000, 4) and c.dtype == np.float32
    assert (c.sum(-1) == 50).all() and (c >= 0).all()
    for i, pi in enumerate(p.tolist()):
        mean_ok(c[:, i], 50 * pi, 50 * pi * (1 - pi))
    cov = np.cov(c[:, 0], c[:, 3])[0, 1]                  # multinomial: -n p_i p_j
    se = math.sqrt((50 * 0.1 * 0.9 * 50 * 0.6 * 0.4 + 3.0 ** 2) / c.shape[0])
    assert abs(cov - (-50 * 0.1 * 0.6)) < 5 * se
    # p need not be normalised; negative entries count as 0; more than 16 categories (XLA's
    # blocked reverse cumsum)
    c = multinomial(KEY, np.float32([10, 1000]), np.float32([[2.0, -1.0, 6.0]]), shape=(2, 3))
    assert c[:, 1].tolist() == [0, 0] and c.sum(-1).tolist() == [10, 1000]
    p40 = np.linspace(1, 2, 40).astype(np.float32)
    c = multinomial(KEY, 3000.0, p40, shape=(2000, 40), dtype=np.int32)
    assert c.dtype == np.int32 and (c.sum(-1) == 3000).all()
    mean_ok(c[:, 39], 3000 * 2 / p40.sum(), 3000 * (2 / p40.sum()) * (1 - 2 / p40.sum()))


def test_zero_d_is_one_element():
    # a 0-d sample is element 0 of a 1-element one: the same uniform words (threefry's counter
    # 0) and, for the rejection loops, the same number of rounds
    for lam in (0.0, 3.0, 9.999999, 10.0, 37.0, 1e4):
        for s in range(4):
            k = R.PRNGKey(s)
            assert poisson(k, np.float32(lam)) == poisson(k, np.float32(lam), (1,))[0]
    for n, p in ((20.0, 0.3), (200.0, 0.4), (700.0, 0.65)):
        for s in range(4):
            k = R.PRNGKey(s)
            assert binomial(k, n, p) == binomial(k, n, p, (1,))[0]


# --- edge parameters, as jax treats them --------------------------------------------------------

def test_poisson_edges():
    lam = np.float32([0, -0.0, -1, np.nan, -np.inf, 1e30])
    x = poisson(KEY, lam, (300, 6))
    assert (x[:, :2] == 0).all()                  # lam == 0
    assert (x[:, 2:5] == -1).all()                # negative / NaN: Knuth's k - 1 with k = 0
    assert (x[:, 5] == INT_MAX).all()             # saturating float -> int
    u8 = poisson(KEY, lam, (300, 6), np.uint8)
    assert u8.dtype == np.uint8 and (u8[:, 2:5] == 255).all() and (u8[:, 5] == 255).all()
    # the narrow ints are Arrays too: a sharded result holds the host one's values
    for dt in (np.uint8, np.int8, np.int16, np.uint16):
        host = poisson(KEY, np.float32([3.0, 300.0, 1e30, -1.0]), (8, 4), dt)
        sh = poisson(KEY, np.float32([3.0, 300.0, 1e30, -1.0]), (8, 4), dt,
                     out_sharding=cts.NamedSharding(cts.make_mesh((2,), ("x",)), cts.P("x")))
        assert isinstance(sh, cts.Array) and sh.dtype == dt
        np.testing.assert_array_equal(np.asarray(sh), host)
        assert (host[:, 2] == np.iinfo(dt).max).all()              # saturating float -> int
    # lam = inf: PTRS proposes inf (u > 0.5) or NaN (u < 0.5), converted to INT_MAX / 0
    inf = poisson(KEY, np.inf, (2000,))
    assert set(np.unique(inf).tolist()) == {0, INT_MAX}
    assert poisson(KEY, 3.0, (4,), np.int64).dtype == np.int32       # no x64, as jax
    assert poisson(KEY, 3.0, (0, 5)).shape == (0, 5)
    assert poisson(KEY, 37.0).shape == ()
    # an integer lam is converted to float32
    assert (poisson(KEY, np.int32(12), (9,)) == poisson(KEY, np.float32(12), (9,))).all()


def test_poisson_broadcast_and_elementwise():
    lam = np.float32([[2.0], [30.0]])
    x = poisson(KEY, lam, (2, 5000))
    assert x.shape == (2, 5000)
    assert x[0].mean() < 3 < 25 < x[1].mean()
    assert poisson(KEY, np.ones((3, 4), np.float32)).shape == (3, 4)
    # Knuth is elementwise: the same element of a larger array has the same value
    small = poisson(KEY, 4.0, (10,))
    assert (poisson(KEY, 4.0, (2000,))[:10] == small).all()


def test_binomial_edges():
    n = np.float32([10, 0, 7, 7, np.nan, -1, 10, 10, 10, np.inf, np.inf, np.inf, 5.5, 1e30])
    p = np.float32([0, 0.5, 1, 0.3, 0.5, 0.5, np.nan, -0.1, 1.1, 0.3, 0.0, 1.0, 0.5, 0.3])
    x = binomial(KEY, n, p, (50, 14))
    assert (x[:, 0] == 0).all() and (x[:, 1] == 0).all() and (x[:, 2] == 7).all()
    assert np.isnan(x[:, 4:9]).all()              # NaN / negative n, NaN / out-of-range p
    # n = inf gives inf; with p 0 or 1 jax's loop never ends, here it is inf as well
    assert np.isposinf(x[:, 9:12]).all()
    assert (x[:, 12] <= 5).all()                   # floor(n) trials
    assert (np.abs(x[:, 13] / 1e30 - 0.3) < 1e-3).all()
    # p = -0.0: jax's geometric gaps are -inf and its loop never ends; here 0, as for +0.0
    assert (binomial(KEY, 20.0, np.float32(-0.0), (10,)) == 0).all()
    assert binomial(KEY, 20.0, 0.3).shape == ()
    assert binomial(KEY, 20.0, 0.3, (0, 4)).shape == (0, 4)


def test_binomial_dtypes():
    assert binomial(KEY, 30.0, 0.4, (5,), np.float64).dtype == np.float32   # no x64
    for dt in (np.float16, BF16):
        y = binomial(KEY, 300.0, 0.4, (20_000,), dt)
        assert y.dtype == dt
        mean_ok(y.astype(np.float64), 120.0, 72.0)
    # the arithmetic runs in p's dtype: a float16 p draws float16 uniforms, a different stream
    a = binomial(KEY, 300.0, np.float16(0.4), (1000,))
    assert a.dtype == np.float32
    mean_ok(a, 120.0, 72.0)
    assert (a != binomial(KEY, 300.0, np.float32(0.4), (1000,))).any()
    # integer and bool p promote to float32
    assert (binomial(KEY, 9.0, True, (4,)) == 9).all()


def test_multinomial_edges_and_dtypes():
    p = np.float32([[0.5, 0.5]])
    c = multinomial(KEY, np.float32([np.inf, -3, np.nan, 5.5, 0]), p, shape=(5, 2))
    assert np.isposinf(c[0, 0]) and np.isnan(c[0, 1])        # inf - inf trials left
    assert np.isnan(c[1:3]).all()
    # 5.5 trials: each binomial counts floor(trials left), so 5 in all (as jax: [4, 1] for one
    # key), the last category's p = 1 taking the integer part of what is left
    assert c[3].sum() == 5 and (c[3] == np.floor(c[3])).all() and c[4].tolist() == [0, 0]
    assert multinomial(KEY, 7.0, np.float16([0.3, 0.7])).dtype == np.float32
    assert multinomial(KEY, 7.0, np.float32([0.3, 0.7]), dtype=bool).dtype == np.bool_
    assert multinomial(KEY, 7.0, np.zeros((0,), np.float32)).shape == (0,)
    assert multinomial(KEY, 7.0, np.ones((0, 3), np.float32)).shape == (0, 3)
    assert multinomial(KEY, 7.0, np.float32([0.3, 0.7]), unroll=True).shape == (2,)


# --- float helpers --------------------------------------------------------------------------

def _nearest_f32(exact: Fraction, got: np.float32) -> bool:
    """got is a float32 nearest to the exact rational value (either one on a tie)."""
    lo, hi = (np.nextafter(got, np.float32(d)) for d in (-np.inf, np.inf))
    d = abs(Fraction(float(got)) - exact)
    return d <= abs(Fraction(float(lo)) - exact) and d <= abs(Fraction(float(hi)) - exact)


def test_fma_rounds_once():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(3000).astype(np.float32)
    b = rng.standard_normal(3000).astype(np.float32)
    c = (rng.standard_normal(3000) * 10.0 ** rng.integers(-8, 8, 3000)).astype(np.float32)
    # a * b = 1 + 2**-22 + 2**-46: rounding the product first loses the 2**-46 that c leaves
    # a * b = 64 - 2**-40 plus c = 2**30 + 128: the float64 sum lands exactly halfway between
    # two float32s (2**30 + 192) and rounds to even upwards; the exact value is just below
    a = np.concatenate([a, np.float32([1 + 2 ** -23, 1 + 2 ** -23])])
    b = np.concatenate([b, np.float32([1 + 2 ** -23, 64 - 2 ** -17])])
    c = np.concatenate([c, np.float32([-(1 + 2 ** -22), 2 ** 30 + 128])])
    got = _fma(a, b, c)
    for x, y, z, g in zip(a, b, c, got):
        exact = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
        assert _nearest_f32(exact, g), (x, y, z, g)
    assert got[-2] == 2.0 ** -46 and got[-1] == 2.0 ** 30 + 128
    assert (a[-2:] * b[-2:] + c[-2:]).tolist() == [0.0, 2.0 ** 30 + 256]   # two roundings


def test_lgamma_is_lgamma():
    x = np.concatenate([np.arange(1, 200, dtype=np.float32),
                        np.float32([0.5, 1.5, 2.5, 123.25, 1e4, 3e6, 1e30])])
    want = np.array([math.lgamma(float(v)) for v in x])
    np.testing.assert_allclose(_lgamma(x), want, rtol=2e-6, atol=2e-6)


def test_reverse_cumsum_is_a_reverse_cumsum():
    r = _rounder(np.dtype(np.float32))
    rng = np.random.default_rng(1)
    for k in (1, 3, 16, 17, 40, 300):
        x = rng.uniform(0, 1, (k, 3)).astype(np.float32)
        want = np.flip(np.cumsum(np.flip(x.astype(np.float64), 0), 0), 0)
        got = _reverse_cumsum(x, r)
        assert got.shape == x.shape
        np.testing.assert_allclose(got, want, rtol=1e-5)
        # the first output sums its 16-element window in order (exact here: small integers)
    ints = np.arange(1, 21, dtype=np.float32)[:, None]
    assert _reverse_cumsum(ints, r)[:, 0].tolist() == np.flip(np.cumsum(np.flip(
        np.arange(1, 21)))).tolist()


# --- mesh invariance -------------------------------------------------------------------------

def test_mesh_invariance_2x4():
    if cts.device_count() < 8:
        pytest.skip("needs CTRAINSTATE_NUM_CPU_DEVICES >= 8")
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    shape = (8, 16)
    # per-row rates on both sides of each threshold: a device's own block needs fewer rejection
    # rounds than the whole array, which a per-block loop would get wrong
    lam = np.float32([[1.0], [12.0], [300.0], [0.0], [7.0], [40.0], [2.0], [1e4]])
    n = np.float32([3, 30, 300, 3000, 5, 50, 500, 5000, 1, 10, 100, 1000, 2, 20, 200, 2000])
    samplers = {
        "poisson": lambda s: poisson(KEY, lam, shape, out_sharding=s),
        "poisson uint32": lambda s: poisson(KEY, 15.0, shape, np.uint32, out_sharding=s),
        "binomial": lambda s: binomial(KEY, n, 0.4, shape, out_sharding=s),
        "binomial bf16": lambda s: binomial(KEY, 400.0, BF16.type(0.7), shape, BF16,
                                            out_sharding=s),
        "multinomial": lambda s: multinomial(KEY, 50.0, np.full(shape, 1 / 16, np.float32),
                                             out_sharding=s),
    }
    sharded_like_host(samplers, mesh, (cts.P("data", "model"), cts.P(None, "model"),
                                       cts.P("model"), cts.P()))


def test_abstract_eval():
    # eval_shape: array parameters become ShapeDtypeStructs, nothing is sampled
    lam = np.ones((4, 1), np.float32)
    out = cts.eval_shape(lambda k, lm: poisson(k, lm, (4, 3), np.uint32), KEY, lam)
    assert out.shape == (4, 3) and out.dtype == np.uint32
    out = cts.eval_shape(lambda k, n, p: binomial(k, n, p), KEY, np.ones(3, np.float32),
                         np.ones((2, 1), np.float16))
    assert out.shape == (2, 3) and out.dtype == np.float32
    out = cts.eval_shape(lambda k, p: multinomial(k, 5.0, p), KEY, np.ones((2, 3), np.float16))
    assert out.shape == (2, 3) and out.dtype == np.float32
    with pytest.raises(ValueError, match="Incompatible types for broadcasting"):
        cts.eval_shape(lambda k, lm: poisson(k, lm, (5,)), KEY, np.ones(3, np.float32))


# --- errors (jax's messages) -----------------------------------------------------------------

def test_errors():
    f3 = np.ones(3, np.float32)
    cases = [
        (lambda: poisson(KEY, 3.0, (2,), np.float32), ValueError,
         "Invalid integer data type 'f'."),
        (lambda: poisson(KEY, 3.0, (2,), bool), ValueError, "Invalid integer data type 'b'."),
        (lambda: poisson(KEY, f3, (4,)), ValueError,
         r"Incompatible types for broadcasting: input type=float32\[3\] and requested "
         r"type=float32\[4\]"),
        (lambda: poisson(KEY, np.ones((2, 3), np.float32), (3,)), ValueError,
         r"Cannot broadcast to shape with fewer dimensions: arr_shape=\(2, 3\) shape=\(3,\)"),
        (lambda: poisson(KEY, 1.0, (-1,)), TypeError,
         "broadcast_in_dim shape must have every element be nonnegative"),
        (lambda: poisson(KEY, 1.0, (2.5,)), TypeError,
         "Shapes must be 1D sequences of concrete values of integer type"),
        (lambda: poisson(KEY, [3.0, 4.0]), TypeError,
         "broadcast_to requires ndarray or scalar arguments, got <class 'list'> at position 0"),
        (lambda: poisson(KEY, 3 + 1j), TypeError, "real-valued"),
        (lambda: poisson(R.split(KEY), 3.0), ValueError,
         r"poisson accepts a single key, but was given a key array of shape \(2, 2\) != \(\)"),
        (lambda: binomial(KEY, 10.0, 0.3, dtype=np.int32), ValueError,
         "dtype argument to `binomial` must be a float dtype, got int32"),
        (lambda: binomial(KEY, [10.0], 0.3), TypeError,
         "binomial requires ndarray or scalar arguments, got <class 'list'> at position 0"),
        (lambda: binomial(KEY, f3, 0.3, (4,)), ValueError,
         r"Incompatible shapes for broadcasting: shapes=\[\(4,\), \(3,\), \(\)\]"),
        (lambda: binomial(KEY, f3, 0.3, (2, 1)), ValueError,
         "binomial parameter shapes must be broadcast-compatible with shape argument"),
        (lambda: binomial(KEY, f3, np.ones(4)), ValueError,
         r"Incompatible shapes for broadcasting: shapes=\[\(3,\), \(4,\)\]"),
        (lambda: binomial(KEY, 1.0, 0.3, (-1,)), TypeError,
         "Only non-negative indices are allowed when broadcasting static shapes"),
        (lambda: binomial(R.split(KEY), 3.0, 0.3), ValueError,
         "binomial accepts a single key"),
        (lambda: multinomial(KEY, 10.0, f3, shape=(4,)), ValueError,
         r"Incompatible types for broadcasting: input type=float32\[3\] and requested "
         r"type=float32\[4\]"),
        (lambda: multinomial(KEY, 10.0, np.float32(1.0)), ValueError,
         "axis -1 is out of bounds for array of dimension 0"),
        (lambda: multinomial(KEY, np.float32([5, 10]), np.float32([0.5, 0.5])), ValueError,
         r"Cannot broadcast to shape with fewer dimensions: arr_shape=\(2,\) shape=\(\)"),
        (lambda: multinomial(KEY, 10.0, [0.5, 0.5]), TypeError,
         "multinomial requires ndarray or scalar arguments, got <class 'list'> at position 1"),
        (lambda: multinomial(KEY, 10.0, f3, shape=2), TypeError, "not subscriptable"),
        (lambda: multinomial(KEY, 10.0, f3, unroll=2.5), TypeError,
         "cannot be interpreted as an integer"),
        (lambda: multinomial(R.split(KEY), 10.0, f3), ValueError,
         "multinomial accepts a single key"),
        (lambda: poisson(KEY, 3.0, (4,), out_sharding="x"), TypeError, "NamedSharding"),
        (lambda: poisson(KEY, 3.0, (4,), np.complex64, out_sharding=cts.NamedSharding(
            cts.make_mesh((1,), ("x",)), cts.P())), ValueError, "Invalid integer data type 'c'"),
    ]
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn()


def test_key_helpers():
    k = R.PRNGKey(7)
    c = clone(k)
    assert c is not k and c.tolist() == [0, 7] and c.dtype == np.uint32
    assert (R.normal(c, (3,)) == R.normal(k, (3,))).all()
    assert key_impl(k) == "threefry2x32"
    assert key_impl(R.split(k, (2, 3))) == "threefry2x32"     # stacks of keys too
    assert key_dtype() == np.uint32 and key_dtype("threefry2x32") == np.uint32
    bad = "JAX encountered invalid PRNG key data: expected "
    with pytest.raises(TypeError, match=bad + "key_data.dtype = uint32; got dtype=float32"):
        key_impl(np.zeros(2, np.float32))
    with pytest.raises(TypeError, match=bad + r"key_data.shape to end with \(2,\)"):
        key_impl(np.zeros(3, np.uint32))
    with pytest.raises(TypeError, match=bad + "key_data.ndim >= 1; got ndim=0"):
        key_impl(np.uint32(0))
    with pytest.raises(TypeError, match="unexpected PRNG key type <class 'list'>"):
        key_impl([0, 0])
    with pytest.raises(TypeError, match="Error interpreting argument to random_clone"):
        clone([0, 0])
    with pytest.raises(ValueError, match="only the threefry2x32 PRNG, got 'rbg'"):
        key_dtype("rbg")
    with pytest.raises(ValueError, match='unrecognized PRNG implementation "foo"'):
        key_dtype("foo")
    with pytest.raises(TypeError, match="unrecognized type <class 'int'>"):
        key_dtype(3)


def test_docstring_examples():
    import doctest

    from ctrainstate._src.random import discrete as _random_discrete
    res = doctest.testmod(_random_discrete)
    assert res.attempted >= 6 and res.failed == 0


# --- live parity with jax ---------------------------------------------------------------------

def _same(x, y, what):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, (what, x.dtype, y.dtype, x.shape, y.shape)
    xf, yf = x.astype(np.float64), y.astype(np.float64)
    bad = ~((xf == yf) | (np.isnan(xf) & np.isnan(yf)))
    assert not bad.any(), (what, int(bad.sum()), xf[bad][:5], yf[bad][:5])


SEEDS = (0, 7, 123456789)
# Each jax program below compiles once (keys and parameters are jit arguments): jax's compile,
# 2 to 3 s a program on CI's CPUs, is most of this file's time, so there are four. (0-d
# results are those of one-element arrays: test_zero_d_is_one_element.)


def test_parity_poisson(jax_ref):
    rng = np.random.default_rng(0)
    # a 3-d array of per-element rates from 0.01 to 1e6, both sides of lam = 10, jax's edges
    lam = np.exp(rng.uniform(np.log(1e-2), np.log(1e6), (9, 77, 13))).astype(np.float32)
    lam.reshape(-1)[:12] = [0, -0.0, -1, np.nan, np.inf, -np.inf, 1e30, 9.999999, 10,
                            10.000001, 1e-30, 2.5]

    def theirs(jax):
        f = jax.jit(lambda k, lm: jax.random.poisson(k, lm))
        return [f(jax.random.PRNGKey(s), lam) for s in SEEDS]

    for s, want in zip(SEEDS, jax_ref("3-d", theirs)):
        _same(poisson(R.PRNGKey(s), lam), want, f"poisson 3-d seed {s}")


def test_parity_binomial(jax_ref):
    rng = np.random.default_rng(1)
    n = np.floor(np.exp(rng.uniform(0, np.log(1e5), 9001))).astype(np.float32)
    p = rng.uniform(0, 1, 9001).astype(np.float32)
    # edges jax returns from (not n = inf with p 0 or 1, or p = -0.0: its loop never ends)
    n[:12] = [10, 0, -1, np.nan, np.inf, np.inf, 5.5, 100, 100, 1e30, 30, 21]
    p[:12] = [0.5, 0.5, 0.5, 0.5, 0.3, 0.7, 0.5, 1.1, np.nan, 0.3, 0.999, 0.5]

    def theirs(jax):
        f = jax.jit(lambda k, a, b: jax.random.binomial(k, a, b))
        return [f(jax.random.PRNGKey(s), n, p) for s in SEEDS]

    for s, want in zip(SEEDS, jax_ref("1-d", theirs)):
        _same(binomial(R.PRNGKey(s), n, p), want, f"binomial 1-d seed {s}")
    # bfloat16 arithmetic (p's dtype) and result, 2-d
    nb, pb = n[12:6012].reshape(40, 150), p[12:6012].reshape(40, 150).astype(BF16)

    def theirs16(jax):
        f = jax.jit(lambda k, a, b: jax.random.binomial(k, a, b, None, jax.numpy.bfloat16))
        return [f(jax.random.PRNGKey(s), nb, jax.numpy.asarray(pb)) for s in SEEDS]

    for s, want in zip(SEEDS, jax_ref("bfloat16", theirs16)):
        _same(binomial(R.PRNGKey(s), nb, pb, None, BF16), want, f"binomial bfloat16 seed {s}")


def test_parity_multinomial(jax_ref):
    rng = np.random.default_rng(2)
    # 17 categories: XLA's blocked reverse cumsum; a zero, a negative and a NaN weight
    p = rng.uniform(0, 1, (333, 17)).astype(np.float32)
    p[0, :3] = [0.0, -0.5, np.nan]
    n = np.floor(rng.uniform(0, 3000, 333)).astype(np.float32)

    def theirs(jax):
        f = jax.jit(lambda k, a, b: jax.random.multinomial(k, a, b))
        return [f(jax.random.PRNGKey(s), n, p) for s in SEEDS[:2]]

    for s, want in zip(SEEDS[:2], jax_ref("multinomial", theirs)):
        _same(multinomial(R.PRNGKey(s), n, p), want, f"multinomial seed {s}")


def test_live_parity_key_helpers():
    jax = pytest.importorskip("jax")
    k = jax.random.PRNGKey(3)
    assert key_impl(np.asarray(k)) == jax.random.key_impl(k)
    assert np.asarray(clone(np.asarray(k))).tolist() == np.asarray(jax.random.clone(k)).tolist()
    # typed jax keys are read as their data; a stack of them raises jax's error
    tk = jax.random.key(5)
    data = np.asarray(jax.random.key_data(tk))
    assert (poisson(tk, 20.0, (9,)) == poisson(data, 20.0, (9,))).all()
    assert key_impl(tk) == "threefry2x32"
    with pytest.raises(ValueError, match=r"given a key array of shape \(2,\)"):
        poisson(jax.random.split(tk), 3.0)


def test_a_shape_dtype_struct_has_values_only_under_eval_shape():
    # outside eval_shape a ShapeDtypeStruct parameter used to sample as if it held zeros
    s = cts.ShapeDtypeStruct((3,), np.float32)
    for fn, args, name in ((poisson, (s,), "lam"), (binomial, (s, 0.5), "n"),
                           (binomial, (4.0, s), "p")):
        with pytest.raises(TypeError, match=f"{name}: a ShapeDtypeStruct has no values"):
            fn(KEY, *args)
    out = cts.eval_shape(lambda: binomial(KEY, s, 0.5))
    assert out.shape == (3,) and out.dtype == np.float32
