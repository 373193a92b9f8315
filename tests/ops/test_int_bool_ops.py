"""Comparisons, boolean logic and integer arithmetic on Arrays (ctrainstate._src.ops.elementwise).

Expected values come from numpy (on values cast as jax's promotion says, the promotion table
written out below), from a table of what jax 0.10 returns where numpy differs or has no
answer (division by zero, shift counts past the width), and from live jax when it is
installed (those tests skip otherwise). Sharded runs must give the single-device bits.
"""
import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import NamedSharding, P
from recorded import assert_exact, exact_record, dtype as rec_dtype
from conftest import assert_same_bits, on_gpu

BF16 = ml_dtypes.bfloat16
F32, F16, I32, U32, BOOL = np.float32, np.float16, np.int32, np.uint32, np.bool_
DTYPES = [F32, BF16, F16, I32, U32, BOOL]
NAMES = {F32: "f32", BF16: "bf16", F16: "f16", I32: "i32", U32: "u32", BOOL: "bool"}
INT_MIN, INT_MAX = -(2 ** 31), 2 ** 31 - 1
# edge values cast to narrower types on purpose (inf from float32 -> float16, wraps)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")


def _jnp():
    return pytest.importorskip("jax.numpy")


# jax's promotion (x64 off) among the stored dtypes, written out: floats beat ints beat bool;
# two different floats give float32; int32 with uint32 gives int32.
def ref_promote(a, b):
    a, b = np.dtype(a), np.dtype(b)
    if a == b:
        return a
    fl = [d for d in (a, b) if d in (np.dtype(F32), np.dtype(BF16), np.dtype(F16))]
    if len(fl) == 2:
        return np.dtype(F32)
    if len(fl) == 1:
        return fl[0]
    ints = [d for d in (a, b) if d in (np.dtype(I32), np.dtype(U32))]
    if len(ints) == 2:
        return np.dtype(I32)
    return ints[0]


def values(dt, shape, seed=0):
    """Edge values first (NaN, inf, -0, subnormals, int extremes), then random ones."""
    r = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dt == BOOL:
        return r.integers(0, 2, n).astype(bool).reshape(shape)
    if dt in (I32, U32):
        edge = np.array([0, 1, -1, 7, -7, 2, -2, INT_MAX, INT_MIN, 2 ** 24 + 1, 3, -3], np.int64)
        rest = r.integers(-50, 50, n) if seed % 2 else r.integers(INT_MIN, INT_MAX, n)
        v = np.concatenate([edge, rest])[:n]
        return v.astype(dt).reshape(shape)     # int64 -> 32 bits wraps
    edge = np.array([0.0, -0.0, 1.0, -1.0, 0.5, 2.5, -2.5, 1e-40, 3e38, np.inf, -np.inf, np.nan,
                     7.0, -7.0, 0.1], np.float32)
    rest = (r.standard_normal(n) * 4).round(1).astype(np.float32)
    v = np.concatenate([edge, rest])[:n]
    with np.errstate(over="ignore"):
        return v.astype(dt).reshape(shape)


def put(x, sharding=None):
    return cts.device_put(x, sharding) if sharding is not None else cts.device_put(x)


def host(a):
    return np.asarray(a)


def same_bits(got, want):
    """got's bits are want's. got is a ctrainstate Array: on GPU devices (CTRAINSTATE_GPU_SPLIT
    makes them the default) a NaN result is CUDA's canonical NaN, so there any NaN matches
    any NaN; on CPUs every bit must match jax's."""
    gpu = isinstance(got, cts.Array) and on_gpu(got)
    assert_same_bits(got, want, gpu)


# --- comparisons ---------------------------------------------------------------------------------

CMPS = {"equal": np.equal, "not_equal": np.not_equal, "less": np.less,
        "less_equal": np.less_equal, "greater": np.greater, "greater_equal": np.greater_equal}


def daz(v, dt):
    """jax on CPU compares float32 / bfloat16 subnormals as zeros (XLA flushes denormals;
    measured: 1e-40 == 0.0 is True); float16 subnormals are normal float32 numbers."""
    if np.dtype(dt) in (np.dtype(F32), np.dtype(BF16)):
        return np.where(np.abs(v) < np.finfo(np.float32).tiny, np.float32(0), v).astype(np.float32)
    return v


def _ref_cmp(name, a, b):
    dt = ref_promote(a.dtype, b.dtype)
    ca, cb = a.astype(dt), b.astype(dt)
    if dt in (np.dtype(BF16), np.dtype(F16)):
        ca, cb = ca.astype(np.float32), cb.astype(np.float32)   # exact
    ca, cb = daz(ca, dt), daz(cb, dt)
    with np.errstate(invalid="ignore"):
        return CMPS[name](ca, cb)


@pytest.mark.parametrize("da", DTYPES, ids=lambda d: NAMES[d])
@pytest.mark.parametrize("db", DTYPES, ids=lambda d: NAMES[d])
def test_comparisons_every_dtype_pair(da, db):
    a = values(da, (5, 7), 0)
    b = values(db, (7,), 1)              # broadcast against a's rows
    b2 = values(db, (5, 7), 2)
    b2[0, :] = a[0, :].astype(db) if da != BOOL or db == BOOL else b2[0, :]   # some equal pairs
    for name in CMPS:
        fn = getattr(cnp, name)
        for x, y in ((a, b), (a, b2)):
            got = fn(put(x), put(y))
            assert got.dtype == np.bool_ and got.shape == np.broadcast_shapes(x.shape, y.shape)
            np.testing.assert_array_equal(host(got), _ref_cmp(name, x, y), err_msg=f"{name} {da} {db}")


def _jax_all(jnp, names):
    """jax.jit of the functions of jax.numpy called `names`, all on the same arguments."""
    import jax
    return jax.jit(lambda *args: [getattr(jnp, n)(*args) for n in names])


def test_comparisons_match_jax_every_dtype_pair(jax_ref):
    for da in DTYPES:
        for db in DTYPES:
            a, b = values(da, (3, 6), 3), values(db, (6,), 4)
            # a dtype pair's comparisons in one jax program (one XLA compile, most of this
            # test's time; comparisons round nothing, so the bits are those of eager calls)
            wants = jax_ref(None, lambda jnp: _jax_all(jnp, CMPS)(jnp.asarray(a), jnp.asarray(b)))
            for name, want in zip(CMPS, wants, strict=True):
                got = getattr(cnp, name)(put(a), put(b))
                same_bits(got, np.asarray(want))


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: NAMES[d])
def test_comparisons_with_weak_python_scalars(dt):
    """Python scalars are weak: an int32 Array against 0.5 compares as float32; a bfloat16
    Array against 0.1 compares with 0.1 rounded to bfloat16 (jax)."""
    a = values(dt, (4, 5), 5)
    for s in (0, 1, -1, 0.5, 0.1, 2.5, True):
        if dt == U32 and isinstance(s, int) and s < 0:
            want_s = np.uint32(2 ** 32 - 1)          # -1 wraps to uint32, as in jax
        else:
            want_s = s
        if isinstance(s, float) and dt in (I32, U32, BOOL):
            ref_dt = np.float32
        elif isinstance(s, int) and not isinstance(s, bool) and dt == BOOL:
            ref_dt = np.int32
        else:
            ref_dt = dt
        ca = a.astype(ref_dt).astype(np.float32) if ref_dt in (BF16, F16) else a.astype(ref_dt)
        cs = np.asarray(want_s).astype(ref_dt)
        cs = cs.astype(np.float32) if ref_dt in (BF16, F16) else cs
        ca = daz(ca, ref_dt)
        with np.errstate(invalid="ignore"):
            np.testing.assert_array_equal(host(put(a) > s), ca > cs)
            np.testing.assert_array_equal(host(s >= put(a)), cs >= ca)   # reflected
            np.testing.assert_array_equal(host(put(a) == s), ca == cs)
            np.testing.assert_array_equal(host(put(a) != s), ca != cs)


def test_weak_scalars_match_jax(jax_ref):
    for dt in DTYPES:
        a = values(dt, (11,), 6)
        for s in (0, -1, 0.5, 0.1, 3, True):
            for op in (np.greater, np.equal, np.less_equal):
                name = op.__name__
                same_bits(getattr(cnp, name)(put(a), s), jax_ref(None, lambda jnp: getattr(jnp, name)(jnp.asarray(a), s)))


def test_nan_and_inf_comparisons():
    x = put(np.array([np.nan, np.inf, -np.inf, 1.0, -0.0], np.float32))
    assert host(x == x).tolist() == [False, True, True, True, True]
    assert host(x != x).tolist() == [True, False, False, False, False]
    assert host(x < np.inf).tolist() == [False, False, True, True, True]
    assert host(x >= 0.0).tolist() == [False, True, False, True, True]   # -0.0 >= 0
    assert host(cnp.isnan(x)).tolist() == [True, False, False, False, False]
    assert host(cnp.isinf(x)).tolist() == [False, True, True, False, False]
    assert host(cnp.isfinite(x)).tolist() == [False, False, False, True, True]
    for dt in (BF16, F16):
        y = put(np.array([np.nan, np.inf, 1.0], np.float32).astype(dt))
        assert host(cnp.isnan(y)).tolist() == [True, False, False]
        assert host(cnp.isfinite(y)).tolist() == [False, False, True]
    i = put(np.array([1, -5], np.int32))
    assert host(cnp.isnan(i)).tolist() == [False, False]
    assert host(cnp.isfinite(i)).tolist() == [True, True]
    assert host(cnp.isinf(put(np.array([True])))).tolist() == [False]


def test_zero_d_comparisons_and_truth_values():
    loss = put(np.float32(0.25))
    c = loss < 1.0
    assert c.shape == () and c.dtype == np.bool_
    assert bool(c) is True and bool(loss > 1.0) is False
    if loss < 1.0:
        pass
    else:
        raise AssertionError("0-d comparison")
    with pytest.raises(ValueError, match="ambiguous"):
        bool(put(np.arange(3, dtype=np.float32)) > 0)
    x = put(np.ones(3, np.float32))
    assert (x == "text") is False and (x != None) is True   # noqa: E711 - identity fallback


def _bool_error(jnp):
    try:
        bool(jnp.arange(3) > 0)
    except Exception as e:   # noqa: BLE001 - its type and message are compared
        return [type(e).__name__, str(e)]
    return None


def test_bool_of_non_scalar_matches_jax_error_kind(jax_ref):
    theirs = jax_ref("error", _bool_error)
    with pytest.raises(ValueError) as ours:
        bool(put(np.arange(3, dtype=np.int32)) > 0)
    assert ["ValueError", str(ours.value)] == theirs


# --- booleans and bits -------------------------------------------------------------------------------

def test_logical_ops_any_dtype():
    a = np.array([[0.0, 1.0, np.nan, -0.0], [2.0, 0.0, 0.0, 3.0]], np.float32)
    b = np.array([1, 0, 5, 0], np.int32)
    ab, bb = a != 0, b != 0            # NaN is true
    np.testing.assert_array_equal(host(cnp.logical_and(put(a), put(b))), ab & bb)
    np.testing.assert_array_equal(host(cnp.logical_or(put(a), put(b))), ab | bb)
    np.testing.assert_array_equal(host(cnp.logical_xor(put(a), put(b))), ab ^ bb)
    np.testing.assert_array_equal(host(cnp.logical_not(put(a))), ~ab)
    m, n = put(ab), put(bb)
    np.testing.assert_array_equal(host(m & n), ab & bb)
    np.testing.assert_array_equal(host(m | n), ab | bb)
    np.testing.assert_array_equal(host(m ^ n), ab ^ bb)
    np.testing.assert_array_equal(host(~m), ~ab)
    assert (m & n).dtype == np.bool_ and (~m).dtype == np.bool_
    assert (m & 3).dtype == np.int32          # bool with a weak int: int32 (jax)
    np.testing.assert_array_equal(host(m & 3), ab.astype(np.int32) & 3)


@pytest.mark.parametrize("dt", [I32, U32], ids=lambda d: NAMES[d])
def test_bitwise_ints(dt):
    a, b = values(dt, (6, 5), 7), values(dt, (5,), 8)
    np.testing.assert_array_equal(host(put(a) & put(b)), a & b)
    np.testing.assert_array_equal(host(put(a) | put(b)), a | b)
    np.testing.assert_array_equal(host(put(a) ^ put(b)), a ^ b)
    np.testing.assert_array_equal(host(~put(a)), ~a)
    np.testing.assert_array_equal(host(cnp.bitwise_not(put(a))), ~a)


SHIFT_COUNTS = np.array([0, 1, 5, 31, 32, 33, 100, -1, -32], np.int64)


@pytest.mark.parametrize("dt", [I32, U32], ids=lambda d: NAMES[d])
def test_shifts(dt):
    x = values(dt, (SHIFT_COUNTS.size, 12), 9)
    s = SHIFT_COUNTS.astype(dt)[:, None]
    sc = SHIFT_COUNTS[:, None]
    inr = (sc >= 0) & (sc < 32)
    safe = np.where(inr, s, 0).astype(dt)
    # in range: numpy (wrapping left shift via 64 bits; >> arithmetic for int32, logical for
    # uint32); out of range (jax 0.10, measured): << gives 0, >> gives the sign fill / 0
    left = ((x.astype(np.int64) << safe.astype(np.int64)) & 0xFFFFFFFF).astype(np.uint32).astype(dt)
    right = x >> safe
    fill = np.where(x < 0, -1, 0).astype(dt) if dt == I32 else np.zeros_like(x)
    np.testing.assert_array_equal(host(put(x) << put(s)), np.where(inr, left, 0).astype(dt))
    np.testing.assert_array_equal(host(put(x) >> put(s)), np.where(inr, right, fill).astype(dt))


def test_shifts_and_bits_match_jax(jax_ref):
    for dt in (I32, U32):
        x = values(dt, (SHIFT_COUNTS.size, 10), 10)
        s = SHIFT_COUNTS.astype(dt)[:, None]
        for name in ("left_shift", "right_shift", "bitwise_and", "bitwise_or", "bitwise_xor"):
            same_bits(getattr(cnp, name)(put(x), put(s)),
                      jax_ref(None, lambda jnp: getattr(jnp, name)(jnp.asarray(x), jnp.asarray(s))))
        same_bits(cnp.invert(put(x)), jax_ref(None, lambda jnp: jnp.invert(jnp.asarray(x))))
    bx = np.array([True, False, True])
    same_bits(cnp.left_shift(put(bx), put(bx)), jax_ref(None, lambda jnp: jnp.left_shift(bx, bx)))   # int32
    same_bits(cnp.invert(put(bx)), jax_ref(None, lambda jnp: jnp.invert(bx)))


# --- integer arithmetic ------------------------------------------------------------------------------

def _wrap(v, dt):
    return np.asarray(v, np.int64).astype(dt)      # two's complement wrap


@pytest.mark.parametrize("dt", [I32, U32], ids=lambda d: NAMES[d])
def test_int_arithmetic_wraps(dt):
    a, b = values(dt, (7, 9), 11), values(dt, (9,), 12)
    A, B = a.astype(np.int64), b.astype(np.int64)
    pa, pb = put(a), put(b)
    for got, want in ((pa + pb, A + B), (pa - pb, A - B), (pa * pb, A * B), (-pa, -A),
                      (cnp.maximum(pa, pb), np.maximum(A, B)), (cnp.minimum(pa, pb), np.minimum(A, B)),
                      (abs(pa), np.abs(A)), (cnp.abs(pa), np.abs(A)), (cnp.negative(pa), -A),
                      (pa + 1, A + 1), (1 - pa, 1 - A), (pa * 3, A * 3)):
        assert got.dtype == dt
        np.testing.assert_array_equal(host(got), _wrap(want, dt))
    big = put(np.array([INT_MAX, INT_MIN], np.int32))
    assert host(big + 1).tolist() == [INT_MIN, INT_MIN + 1]
    assert host(abs(big)).tolist() == [INT_MAX, INT_MIN]          # abs(INT_MIN) wraps
    assert host(-big).tolist() == [-INT_MAX, INT_MIN]
    assert host(put(np.array([1, 0], np.uint32)) - 2).tolist() == [2 ** 32 - 1, 2 ** 32 - 2]


def test_bool_arithmetic():
    a, b = np.array([True, True, False, False]), np.array([True, False, True, False])
    pa, pb = put(a), put(b)
    assert (pa + pb).dtype == np.bool_ and host(pa + pb).tolist() == (a | b).tolist()
    assert host(pa * pb).tolist() == (a & b).tolist()
    assert host(cnp.maximum(pa, pb)).tolist() == (a | b).tolist()
    assert host(cnp.minimum(pa, pb)).tolist() == (a & b).tolist()
    assert (pa + 1).dtype == np.int32 and host(pa + 1).tolist() == [2, 2, 1, 1]
    assert host(abs(pa)).tolist() == a.tolist()
    with pytest.raises(TypeError, match="subtract does not accept dtype bool"):
        pa - pb
    with pytest.raises(TypeError, match="negative does not accept dtype bool"):
        -pa


def test_int_arithmetic_matches_jax(jax_ref):
    for da in (I32, U32, BOOL):
        for db in (I32, U32, BOOL):
            a, b = values(da, (4, 6), 13), values(db, (6,), 14)
            for name in ("add", "multiply", "maximum", "minimum"):
                same_bits(getattr(cnp, name)(put(a), put(b)), jax_ref(
                    None, lambda jnp: getattr(jnp, name)(jnp.asarray(a), jnp.asarray(b))))
            if not (da == BOOL and db == BOOL):
                same_bits(cnp.subtract(put(a), put(b)), jax_ref(
                    None, lambda jnp: jnp.subtract(jnp.asarray(a), jnp.asarray(b))))
        a = values(da, (9,), 15)
        for s in (1, -1, 7, 2 ** 31 - 1):
            same_bits(put(a) + s, jax_ref(None, lambda jnp: jnp.asarray(a) + s))
            same_bits(put(a) * s, jax_ref(None, lambda jnp: jnp.asarray(a) * s))
        if da != BOOL:
            same_bits(-put(a), jax_ref(None, lambda jnp: -jnp.asarray(a)))
        same_bits(abs(put(a)), jax_ref(None, lambda jnp: jnp.abs(jnp.asarray(a))))


def test_int_with_float_is_float_and_true_divide():
    a = np.array([1, -2, 7], np.int32)
    r = put(a) * 0.5
    assert r.dtype == np.float32 and host(r).tolist() == [0.5, -1.0, 3.5]
    r = put(a) + put(np.ones(3, BF16))
    assert r.dtype == BF16
    q = put(a) / put(np.array([2, 2, 2], np.int32))
    assert q.dtype == np.float32 and host(q).tolist() == [0.5, -1.0, 3.5]
    assert cnp.mean(put(a)).dtype == np.float32 and float(cnp.mean(put(a))) == 2.0


def test_weak_int_overflow_raises_as_jax():
    with pytest.raises(OverflowError, match="does not fit int32"):
        put(np.array([1], np.int32)) + 2 ** 40
    with pytest.raises(OverflowError):
        put(np.array([1], np.uint32)) + 2 ** 32 - 1
    assert host(put(np.array([1], np.uint32)) + (-1)).tolist() == [0]   # wraps, as jax


# --- floor_divide and remainder ---------------------------------------------------------------------------

# jax 0.10 on CPU, measured: int x // 0 is -1 for x == 0 and -2 otherwise (XLA gives -1, then
# jnp's floor correction applies where rem(x, 0) = x is nonzero); int x % 0 is 0 (jnp divides
# by 1 instead); uint32 x // 0 is 2**32 - 1 and x % 0 is 0.
def _ref_int_floordiv(a, b, dt):
    A, B = a.astype(np.int64), b.astype(np.int64)
    A, B = np.broadcast_arrays(A, B)
    safe = np.where(B == 0, 1, B)
    q, r = A // safe, A % safe          # Python's floor semantics in int64
    if dt == U32:
        q = np.where(B == 0, 2 ** 32 - 1, q)
    else:
        q = np.where(B == 0, np.where(A == 0, -1, -2), q)
    r = np.where(B == 0, 0, r)
    return _wrap(q, dt), _wrap(r, dt)


@pytest.mark.parametrize("dt", [I32, U32], ids=lambda d: NAMES[d])
def test_int_floor_divide_and_remainder(dt):
    a = values(dt, (12, 8), 16)
    b = values(dt, (8,), 17)
    b[:3] = np.array([0, 2, -1]).astype(dt)             # zero divisor and INT_MIN // -1
    a[0, :] = np.array([INT_MIN] * 8).astype(dt)
    q, r = _ref_int_floordiv(a, b, dt)
    np.testing.assert_array_equal(host(put(a) // put(b)), q)
    np.testing.assert_array_equal(host(put(a) % put(b)), r)
    np.testing.assert_array_equal(host(cnp.floor_divide(put(a), put(b))), q)
    np.testing.assert_array_equal(host(cnp.mod(put(a), put(b))), r)
    for s in (1, 2, 3, 7):
        qs, rs = _ref_int_floordiv(a, np.array(s, np.int64).astype(dt), dt)
        np.testing.assert_array_equal(host(put(a) // s), qs)
        np.testing.assert_array_equal(host(put(a) % s), rs)
    i = put(np.array([7, -7, 0, 5, -5, INT_MIN, INT_MIN, INT_MAX], np.int32))
    d = put(np.array([2, 2, 0, 0, 0, -1, 0, -1], np.int32))
    assert host(i // d).tolist() == [3, -4, -1, -2, -2, INT_MIN, -2, -INT_MAX]
    assert host(i % d).tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert host(17 // put(np.array([5, -5], np.int32))).tolist() == [3, -4]   # reflected
    assert host(17 % put(np.array([5, -5], np.int32))).tolist() == [2, -3]


def test_float_floor_divide_and_remainder():
    a = np.array([7, -7, 7, -7, 0, 1, np.inf, 5.5, 3, -1, np.nan, 1e-40], np.float32)
    b = np.array([2, 2, -2, -2, 0, 0, 2, np.inf, -np.inf, 0.3, 1, 3], np.float32)
    fa, fb = daz(a, F32), daz(b, F32)     # 1e-40 counts as 0, as in jax on CPU
    with np.errstate(divide="ignore", invalid="ignore"):
        np.testing.assert_array_equal(host(put(a) // put(b)), fa // fb)
        # % keeps a subnormal dividend (1e-40 % 3 is 1e-40) and flushes a divisor, as jax
        np.testing.assert_array_equal(host(put(a) % put(b)), a % fb)
    # where numpy and jax differ: the sign of a zero (jax, measured)
    z = put(np.array([-0.0, -4.0], np.float32)) % put(np.array([3.0, 2.0], np.float32))
    assert np.signbit(host(z)).tolist() == [True, True]
    assert (put(np.array([7], np.int32)) // 2.0).dtype == np.float32


def test_floor_divide_and_remainder_match_jax(jax_ref):
    for dt in (I32, U32, F32, BF16, F16):   # 16-bit floats: each step of // rounded, as jax
        a, b = values(dt, (10, 8), 18), values(dt, (8,), 19)
        b[:2] = 0
        same_bits(cnp.floor_divide(put(a), put(b)), jax_ref(None, lambda jnp: jnp.floor_divide(jnp.asarray(a), jnp.asarray(b))))
        same_bits(cnp.remainder(put(a), put(b)), jax_ref(None, lambda jnp: jnp.remainder(jnp.asarray(a), jnp.asarray(b))))
    bx = np.array([True, False, True])
    same_bits(cnp.floor_divide(put(bx), put(bx | True)), jax_ref(None, lambda jnp: jnp.floor_divide(bx, bx | True)))
    rng = np.random.default_rng(23)
    for dt in (BF16, F16):
        # (through float32: ml_dtypes before 0.5 rounds float64 to bfloat16 through float32,
        # later ones directly, which differs on rare values; the recording needs one input)
        a = (rng.standard_normal(20000) * 1000).astype(np.float32).astype(dt)
        b = (rng.standard_normal(20000) * rng.choice([0.01, 1.0, 100.0], 20000)).astype(
            np.float32).astype(dt)
        # (20000 values: recorded as a digest of jax's bits)
        want = jax_ref(None, lambda jnp: [exact_record(jnp.floor_divide(a, b)),
                                          exact_record(jnp.remainder(a, b))])
        assert_exact(cnp.floor_divide(put(a), put(b)), want[0], "floor_divide")
        assert_exact(cnp.remainder(put(a), put(b)), want[1], "remainder")
    sa = np.array([1e-40, -1e-40, 3.0, 1e-40, 2e-38, 1e-40, 7.0, -7.0], np.float32)
    sb = np.array([3.0, 3.0, 1e-40, -3.0, 1e-38, 1e-40, -2.0, 2.0], np.float32)
    same_bits(cnp.remainder(put(sa), put(sb)), jax_ref(None, lambda jnp: jnp.remainder(sa, sb)))
    same_bits(cnp.floor_divide(put(sa), put(sb)), jax_ref(None, lambda jnp: jnp.floor_divide(sa, sb)))
    for c in (sa, np.array([0.0, -0.0, np.nan, 1e-40], np.float32)):
        same_bits(cnp.logical_and(put(c), True), jax_ref(None, lambda jnp: jnp.logical_and(c, True)))
        same_bits(cnp.where(put(c), 1.0, 0.0), jax_ref(None, lambda jnp: jnp.where(c, 1.0, 0.0)))
        same_bits(cnp.where(c, 1.0, 0.0), jax_ref(None, lambda jnp: jnp.where(c, 1.0, 0.0)))
        same_bits(cnp.any(put(c[3:])), jax_ref(None, lambda jnp: jnp.any(c[3:])))


# --- where, reductions, cumsum ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dt", [I32, U32, BOOL, F32, BF16], ids=lambda d: NAMES[d])
def test_where_with_a_bool_array_condition(dt):
    c = values(BOOL, (5, 6), 20)
    x, y = values(dt, (5, 6), 21), values(dt, (6,), 22)
    got = cnp.where(put(c), put(x), put(y))
    assert got.dtype == dt
    same_bits(got, np.where(c, x, y))
    ids = put(np.array([[3, -100, 5]], np.int32))
    got = cnp.where(ids != -100, ids, 0)
    assert got.dtype == np.int32 and host(got).tolist() == [[3, 0, 5]]
    got = cnp.where(ids > 0, 1, 0)                     # weak ints: int32, as jax
    assert got.dtype == np.int32 and host(got).tolist() == [[1, 0, 1]]
    got = cnp.where(ids > 0, 1.0, 0)
    assert got.dtype == np.float32 and host(got).tolist() == [[1.0, 0.0, 1.0]]


@pytest.mark.parametrize("dt", [F32, BF16, F16], ids=lambda d: NAMES[d])
def test_where_returns_the_selected_value_bit_for_bit(dt, jax_ref):
    """A select, not arithmetic: -0.0, +0.0, infinities and NaN payloads come back as they
    were in the branch taken, in either branch, with Array or scalar branches, on a mesh, and
    through fmax / fmin / heaviside (which select with where), as jax's select does."""
    nan_payload = np.uint32(0x7FC00123).view(np.float32)   # a quiet NaN with payload bits
    x = np.array([-0.0, 0.0, -0.0, np.inf, -np.inf, 1.5, -0.0, nan_payload], np.float32).astype(dt)
    y = np.array([0.0, -0.0, -0.0, -0.0, 2.0, -0.0, np.nan, -0.0], np.float32).astype(dt)
    c = np.array([True, True, False, False, True, False, True, False])
    want = np.where(c, x, y)
    assert np.signbit(want.astype(np.float32)).tolist() == [True, False, True, True, True,
                                                            True, True, True]
    same_bits(cnp.where(put(c), put(x), put(y)), want)
    same_bits(cnp.where(c, put(x), put(y)), want)
    same_bits(cnp.where(c.astype(np.float32), put(x), put(y)), want)   # a float condition
    mesh = cts.Mesh(np.array(cts.devices()[:4]).reshape(2, 2), ("a", "b"))
    sh = NamedSharding(mesh, P(("a", "b")))
    xs, ys = cts.device_put(x, sh), cts.device_put(y, sh)
    same_bits(cnp.where(cts.device_put(c, sh), xs, ys), want)
    # a scalar branch: jax's weak-typed -0.0 keeps its sign too
    got = cnp.where(c, put(x), -0.0)
    assert got.dtype == dt
    same_bits(got, np.where(c, x, np.array(-0.0, dt)))
    # the gradient still splits between the branches (1 where taken, else 0), -0.0 or not
    gx, gy = cts.grad(lambda u, v: cnp.sum(cnp.where(c, u, v)), argnums=(0, 1))(
        put(x.astype(np.float32)), put(y.astype(np.float32)))
    assert host(gx).tolist() == c.astype(np.float32).tolist()
    assert host(gy).tolist() == (~c).astype(np.float32).tolist()
    # fmax / fmin at signed-zero ties select x2 (jnp's where((x1 > x2) | isnan(x2), x1, x2))
    z, nz = np.array([0.0, -0.0], dt), np.array([-0.0, 0.0], dt)
    same_bits(cnp.fmax(put(z), put(nz)), nz)
    same_bits(cnp.fmin(put(z), put(nz)), nz)
    same_bits(cnp.heaviside(put(np.array([0.0, 0.0], dt)), put(np.array([-0.0, 0.0], dt))),
              np.array([-0.0, 0.0], dt))
    same_bits(cnp.where(put(c), put(x), put(y)), jax_ref(None, lambda jnp: jnp.where(c, x, y)))
    same_bits(cnp.where(c, put(x), -0.0), jax_ref(None, lambda jnp: jnp.where(c, x, -0.0)))
    same_bits(cnp.fmax(put(z), put(nz)), jax_ref(None, lambda jnp: jnp.fmax(z, nz)))
    same_bits(cnp.fmin(put(z), put(nz)), jax_ref(None, lambda jnp: jnp.fmin(z, nz)))
    same_bits(cnp.heaviside(put(np.array([0.0, 0.0], dt)), put(np.array([-0.0, 0.0], dt))),
              jax_ref(None, lambda jnp: jnp.heaviside(np.array([0.0, 0.0], dt), np.array([-0.0, 0.0], dt))))


def test_eval_shape_of_the_new_ops():
    from ctrainstate import ShapeDtypeStruct as SDS
    out = cts.eval_shape(lambda a, b: (cnp.greater(a, b), a // 2, cnp.any(cnp.less(a, 0), axis=1),
                                       cnp.sum(a, axis=0)),
                         SDS((4, 3), np.int32), SDS((3,), np.int32))
    assert [(o.shape, o.dtype) for o in out] == [((4, 3), np.bool_), ((4, 3), np.int32),
                                                ((4,), np.bool_), ((3,), np.int32)]


@pytest.mark.parametrize("dt", [I32, U32, BOOL], ids=lambda d: NAMES[d])
@pytest.mark.parametrize("axis", [None, 0, 1, (0, 2)])
def test_int_reductions(dt, axis):
    x = values(dt, (4, 5, 3), 23)
    X = x.astype(np.int64)
    want_dt = np.int32 if dt == BOOL else dt
    s = cnp.sum(put(x), axis=axis)
    assert s.dtype == want_dt
    np.testing.assert_array_equal(host(s), _wrap(X.sum(axis=axis), want_dt))
    for name, ref in (("max", np.max), ("min", np.min)):
        got = getattr(cnp, name)(put(x), axis=axis)
        assert got.dtype == dt
        np.testing.assert_array_equal(host(got), ref(x, axis=axis))
    k = cnp.sum(put(x), axis=axis, keepdims=True)
    assert k.shape == np.sum(x, axis=axis, keepdims=True).shape
    m = cnp.mean(put(x), axis=axis)
    assert m.dtype == np.float32
    # float32 accumulation of values up to 2**31 (jnp.mean of ints sums in float32 too)
    np.testing.assert_allclose(host(m), X.mean(axis=axis), rtol=1e-6, atol=1e-6 * np.abs(X).max())
    np.testing.assert_array_equal(host(cnp.any(put(x), axis=axis)), np.any(x, axis=axis))
    np.testing.assert_array_equal(host(cnp.all(put(x), axis=axis)), np.all(x, axis=axis))


@pytest.mark.parametrize("dt", [I32, U32, BOOL], ids=lambda d: NAMES[d])
def test_large_int_reductions_split_across_threads(dt):
    """A full reduction of many elements (the threads split one output's elements)."""
    x = values(dt, (2, 50001), 33)
    X = x.astype(np.int64)
    want_dt = np.int32 if dt == BOOL else dt
    np.testing.assert_array_equal(host(cnp.sum(put(x))), _wrap(X.sum(), want_dt))
    np.testing.assert_array_equal(host(cnp.sum(put(x), axis=1)), _wrap(X.sum(axis=1), want_dt))
    np.testing.assert_array_equal(host(cnp.max(put(x), axis=1)), x.max(axis=1))
    np.testing.assert_array_equal(host(cnp.min(put(x))), x.min())


def test_int_sum_wraps_and_matches_jax(jax_ref):
    x = np.array([INT_MAX, 1, 5], np.int32)
    assert int(cnp.sum(put(x))) == INT_MIN + 5
    assert put(x).sum().dtype == np.int32
    for dt in (I32, U32, BOOL):
        v = values(dt, (6, 7), 24)
        for name in ("sum", "max", "min"):
            for axis in (None, 1):
                same_bits(getattr(cnp, name)(put(v), axis=axis),
                          jax_ref(None, lambda jnp: getattr(jnp, name)(jnp.asarray(v), axis=axis)))


@pytest.mark.parametrize("name", ["cumsum", "cumprod"])
@pytest.mark.parametrize("dt", [I32, U32, BOOL], ids=lambda d: NAMES[d])
def test_int_scans(dt, name):
    """cumsum / cumprod of ints and bools: wrapping in the dtype (bools as int32), every axis,
    against sequential int64 sums and uint64 products cut to 32 bits."""
    x = values(dt, (5, 7), 25 if name == "cumsum" else 35)
    want_dt = np.int32 if dt == BOOL else dt
    for axis in (0, 1, -1, None):
        got = getattr(cnp, name)(put(x), axis=axis)
        assert got.dtype == want_dt and got.shape == np.cumsum(x, axis=axis).shape
        want = (_wrap(np.cumsum(x.astype(np.int64), axis=axis), want_dt) if name == "cumsum"
                else _cumprod_wrapped(x, axis, want_dt))
        np.testing.assert_array_equal(host(got), want, err_msg=f"{name} axis={axis}")


def test_int_scan_cases():
    mask = put(np.array([[1, 1, 0, 1]], np.int32)) != 0
    assert host(cnp.cumsum(mask, -1) - 1).tolist() == [[0, 1, 1, 2]]   # positions from a mask
    big = np.array([[65536, 65536, 3, -1]], np.int32)       # 2^32 wraps to 0 in int32
    assert host(cnp.cumprod(put(big), axis=1)).tolist() == [[65536, 0, 0, 0]]


def test_float_cumsum_values_and_gradient(jax_ref):
    x = np.random.default_rng(31).standard_normal((6, 11)).astype(np.float32)
    for axis in (0, 1, None):
        np.testing.assert_allclose(host(cnp.cumsum(put(x), axis=axis)),
                                   np.cumsum(x.astype(np.float64), axis=axis), rtol=1e-5, atol=1e-5)
    w = np.random.default_rng(32).standard_normal((6, 11)).astype(np.float32)
    g = cts.grad(lambda v: cnp.sum(cnp.cumsum(v, axis=1) * w))(put(x))
    # d/dx[j] of sum_i w[i] cumsum(x)[i] = sum over i >= j of w[i]: a reversed cumsum
    np.testing.assert_allclose(host(g), np.cumsum(w[:, ::-1], axis=1)[:, ::-1], rtol=1e-5, atol=1e-5)
    jg = jax_ref("grad", lambda jax, jnp: jax.grad(lambda v: jnp.sum(jnp.cumsum(v, axis=1) * w))(
        jnp.asarray(x)))
    np.testing.assert_allclose(host(g), jg, rtol=1e-5, atol=1e-5)
    b = put(x.astype(BF16))
    assert cnp.cumsum(b, axis=1).dtype == BF16


def _cumprod_wrapped(x, axis, dt):
    """Sequential products with two's-complement wrap in ``dt``: the low 32 bits of a product
    depend only on the factors' low 32 bits, so uint64 products (numpy wraps them mod 2^64)
    cut to 32 bits are the reference."""
    u = np.asarray(x).astype(np.int64).view(np.uint64)
    r = np.cumprod(u, axis=axis, dtype=np.uint64) & np.uint64(0xFFFFFFFF)
    return r.astype(np.uint32).view(np.int32).astype(dt) if dt != U32 else r.astype(np.uint32)


def test_float_cumprod_values_and_gradient(jax_ref):
    rng = np.random.default_rng(36)
    x = (rng.random((6, 11)) + 0.5).astype(np.float32) * rng.choice([-1, 1], (6, 11))
    x[2, 4] = 0.0                                             # a zero factor
    for axis in (0, 1, None):
        np.testing.assert_allclose(host(cnp.cumprod(put(x), axis=axis)),
                                   np.cumprod(x.astype(np.float64), axis=axis), rtol=1e-5, atol=1e-6)
    w = rng.standard_normal((6, 11)).astype(np.float32)
    g = cts.grad(lambda v: cnp.sum(cnp.cumprod(v, axis=1) * w))(put(x))
    # d/dx[j] of sum_i w[i] prod_{k<=i} x[k] = sum over i >= j of w[i] prod_{k<=i, k!=j} x[k],
    # in float64 from the definition (the zero factor's own derivative included)
    want = np.zeros((6, 11))
    x64 = x.astype(np.float64)
    for r in range(6):
        for j in range(11):
            want[r, j] = sum(w[r, i] * np.prod(np.delete(x64[r, :i + 1], j)) for i in range(j, 11))
    np.testing.assert_allclose(host(g), want, rtol=1e-4, atol=1e-5)
    b = put(x.astype(BF16))
    assert cnp.cumprod(b, axis=1).dtype == BF16
    jg = jax_ref("grad", lambda jax, jnp: jax.grad(lambda v: jnp.sum(jnp.cumprod(v, axis=1) * w))(
        jnp.asarray(x)))
    np.testing.assert_allclose(host(g), jg, rtol=1e-4, atol=1e-5)
    xi = values(I32, (4, 5), 37)                              # wrapping: the same bits as jax
    same_bits(cnp.cumprod(put(xi), axis=0), jax_ref(None, lambda jnp: jnp.cumprod(jnp.asarray(xi), axis=0)))
    np.testing.assert_allclose(host(cnp.cumprod(put(x), axis=1)),
                               jax_ref(None, lambda jnp: jnp.cumprod(jnp.asarray(x), axis=1)), rtol=1e-5, atol=1e-6)


def test_cumprod_on_a_mesh_equals_one_device():
    if cts.device_count() < 8:
        pytest.skip("needs 8 CPU devices")
    mesh = cts.make_mesh((2, 4), ("a", "b"))
    x = values(I32, (8, 16), 38)
    f = (np.random.default_rng(39).random((8, 16)) + 0.5).astype(np.float32)
    for spec in (P("a", "b"), P("b", None), P(None, ("a", "b"))):
        for v in (x, f):
            one = cnp.cumprod(put(v), axis=1)
            sharded = cnp.cumprod(cts.device_put(v, NamedSharding(mesh, spec)), axis=1)
            same_bits(sharded, host(one))


# --- meshes: sharded results are the single-device bits ---------------------------------------------------------

MESHES = [((8,), ("x",), [P("x"), P(None, "x"), P()]),
          ((2, 4), ("a", "b"), [P("a", "b"), P("b", "a"), P(None, ("a", "b")), P("a")]),
          ((4, 2), ("a", "b"), [P("a", "b"), P(("a", "b")), P(None, "a")])]


@pytest.mark.parametrize("shape,names,specs", MESHES, ids=["8", "2x4", "4x2"])
def test_sharded_results_equal_single_device(shape, names, specs):
    mesh = cts.make_mesh(shape, names)
    a = values(I32, (8, 16), 26)
    b = values(I32, (16,), 27)
    b[:2] = 0
    f = values(F32, (8, 16), 28)
    m = values(BOOL, (8, 16), 29)
    ops = [
        lambda x, y, g, k: x > y, lambda x, y, g, k: x == 3, lambda x, y, g, k: x + y,
        lambda x, y, g, k: x * y - 1, lambda x, y, g, k: x // y, lambda x, y, g, k: x % y,
        lambda x, y, g, k: (x & y) ^ ~x, lambda x, y, g, k: x >> 3, lambda x, y, g, k: g < 0.5,
        lambda x, y, g, k: cnp.isnan(g) | k, lambda x, y, g, k: cnp.where(k, x, y),
        lambda x, y, g, k: cnp.where(g > 0, g, 0.1 * g), lambda x, y, g, k: cnp.sum(x, axis=0),
        lambda x, y, g, k: cnp.sum(x), lambda x, y, g, k: cnp.max(x, axis=1),
        lambda x, y, g, k: cnp.min(x), lambda x, y, g, k: cnp.sum(k, axis=1),
        lambda x, y, g, k: cnp.any(k, axis=0), lambda x, y, g, k: cnp.all(g == g),
        lambda x, y, g, k: cnp.cumsum(k, axis=1), lambda x, y, g, k: cnp.cumsum(x, axis=0),
        lambda x, y, g, k: cnp.cumsum(cnp.where(g > 0, g, 1.0), axis=1),
        lambda x, y, g, k: x == g,
    ]
    single = [op(put(a), put(b), put(f), put(m)) for op in ops]
    for spec in specs:
        s2 = NamedSharding(mesh, spec)
        s1 = NamedSharding(mesh, P(*spec[1:2])) if len(spec) > 1 else NamedSharding(mesh, P())
        xa, xb = put(a, s2), put(b, s1)
        xf, xm = put(f, NamedSharding(mesh, P())), put(m, s2)      # a replicated operand
        for i, op in enumerate(ops):
            got = op(xa, xb, xf, xm)
            same_bits(got, single[i])


# --- the tape ------------------------------------------------------------------------------------------------

def _leaky_loss(mod):
    def f(x, ids):
        y = mod.where(x > 0, x, 0.1 * x)
        keep = ids != -100
        z = mod.where(keep[:, None], y * y, 0.0)
        return mod.sum(z) + mod.sum(mod.where(x >= 1.0, x, 0.0))
    return f


def test_masks_inside_value_and_grad(jax_ref):
    x = values(F32, (6, 5), 30)
    x = np.nan_to_num(x, nan=0.3, posinf=2.0, neginf=-2.0).clip(-3, 3).astype(np.float32)
    ids = np.array([1, -100, 4, 7, -100, 2], np.int32)
    v, g = cts.value_and_grad(_leaky_loss(cnp))(put(x), put(ids))
    # by hand: d/dx of y^2 is 2 y dy/dx, y = x (x > 0) or 0.1 x; rows with id -100 drop out
    keep = (ids != -100)[:, None]
    y = np.where(x > 0, x, 0.1 * x)
    want_g = np.where(keep, 2 * y * np.where(x > 0, 1.0, 0.1), 0.0) + (x >= 1.0)
    np.testing.assert_allclose(host(g), want_g, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(v), np.sum(np.where(keep, y * y, 0)) + np.sum(np.where(x >= 1, x, 0)),
                               rtol=1e-5)
    jv, jg = jax_ref("value_and_grad", lambda jax, jnp: jax.value_and_grad(_leaky_loss(jnp))(
        jnp.asarray(x), jnp.asarray(ids)))
    np.testing.assert_allclose(float(v), float(jv), rtol=1e-6)
    np.testing.assert_allclose(host(g), jg, rtol=1e-6, atol=1e-7)


def test_int_ops_inside_a_float_computation_keep_the_tape():
    x = np.array([[1.0, -2.0, 3.0, 0.5]], np.float32)
    ids = put(np.array([[0, 5, 9, 2]], np.int32))

    def f(w):
        pos = cnp.cumsum(ids >= 2, -1) - 1                 # int32, no gradient
        scale = (pos % 2 + 1).astype(np.float32)           # 1 or 2
        return cnp.sum(w * scale)
    g = cts.grad(f)(put(x))
    pos = np.cumsum(np.array([[0, 5, 9, 2]]) >= 2, -1) - 1
    np.testing.assert_array_equal(host(g), (pos % 2 + 1).astype(np.float32))


def test_grad_of_an_int_input_raises_as_jax():
    with pytest.raises(TypeError, match="grad requires real- or complex-valued inputs"):
        cts.grad(lambda i: cnp.sum(i * 2.0))(put(np.array([1, 2], np.int32)))


# --- errors ---------------------------------------------------------------------------------------------------

def test_errors_name_the_op_and_dtypes():
    f = put(np.ones(3, np.float32))
    i = put(np.ones(3, np.int32))
    with pytest.raises(TypeError, match="bitwise_and does not accept dtype float32"):
        f & i
    with pytest.raises(TypeError, match="left_shift does not accept dtype float32"):
        f << 1
    with pytest.raises(TypeError, match="invert does not accept dtype float32"):
        ~f
    with pytest.raises(ValueError, match=r"shapes \(3,\) and \(4,\) do not broadcast"):
        i > put(np.ones(4, np.int32))
    with pytest.raises(TypeError, match="expected an Array"):
        cnp.equal(i, object())
    with pytest.raises(ValueError, match="zero-size"):
        cnp.max(put(np.zeros((0, 2), np.int32)), axis=0)
    with pytest.raises(TypeError, match="matmul: got int32 operands"):   # never silently rounded
        put(np.ones((2, 2), np.int32)) @ put(np.ones((2, 2), np.int32))
    r = cnp.exp(put(np.array([0, 1], np.int32)))                          # jnp: float32
    assert r.dtype == np.float32 and np.allclose(host(r), np.exp([0.0, 1.0]))


# --- review fixes ---------------------------------------------------------------------------


def test_float_remainder_is_differentiable_as_jax(jax_ref):
    """d(x % y)/dx = 1, d/dy = -floor(x / y): against the formula (numpy) and jax.grad."""
    xv = np.array([0.5, 2.5, -1.2, 3.3, -4.1], np.float32)
    yv = np.array([0.7, -0.7, 0.7, 2.0, -1.5], np.float32)
    x, y = cts.device_put(xv), cts.device_put(yv)
    gx, gy = cts.grad(lambda a, b: cnp.sum((a % b) * a), argnums=(0, 1))(x, y)
    r = np.asarray(cnp.remainder(x, y))
    np.testing.assert_allclose(np.asarray(gx), r + xv, rtol=1e-6)      # d/dx (r * x)
    np.testing.assert_allclose(np.asarray(gy), -np.floor(xv / yv) * xv, rtol=1e-6)
    g = cts.grad(lambda b: cnp.sum(3.0 % b))(y)
    np.testing.assert_array_equal(np.asarray(g), -np.floor(3.0 / yv))
    np.testing.assert_array_equal(np.asarray(cts.grad(lambda a: cnp.sum(a % 2.0))(x)),
                                  np.ones(5, np.float32))
    jx, jy = jax_ref("grad", lambda jax, jnp: jax.grad(lambda a, b: jnp.sum((a % b) * a),
                                                        argnums=(0, 1))(xv, yv))
    np.testing.assert_allclose(np.asarray(gx), jx, rtol=1e-6)
    np.testing.assert_allclose(np.abs(np.asarray(gy)), np.abs(jy), rtol=1e-6)


def test_comparisons_and_cumsum_under_eval_shape():
    S = cts.ShapeDtypeStruct
    a = S((3,), np.int32)
    for f in (lambda v: v == 0, lambda v: v != 1, lambda v: v < 2, lambda v: v <= 2,
              lambda v: v > 0, lambda v: v >= 0, lambda v: 0 < v):
        out = cts.eval_shape(f, a)
        assert (out.shape, out.dtype) == ((3,), np.dtype(np.bool_))
    assert a == S((3,), np.int32) and a != S((4,), np.int32)   # two structs: descriptions
    out = cts.eval_shape(lambda v: cnp.cumsum(v), S((3, 4), np.bool_))
    assert (out.shape, out.dtype) == ((12,), np.dtype(np.int32))
    out = cts.eval_shape(lambda v: cnp.cumsum(v, -1), S((3, 4), np.float32))
    assert (out.shape, out.dtype) == ((3, 4), np.dtype(np.float32))
    import ctrainstate.nn as nn

    class M(nn.Module):
        @nn.compact
        def __call__(self, v):
            y = nn.Dense(4)(v)
            return cnp.where(y > 0, y, 0.1 * y)
    shapes = cts.eval_shape(M().init, cts.random.PRNGKey(0), S((2, 3), np.float32))
    assert shapes["params"]["Dense_0"]["kernel"].shape == (3, 4)


def test_sum_and_mean_take_dtype():
    m = cts.device_put(np.array([True, True, False]))
    big = cts.device_put(np.full(3, 2 ** 30, np.int32))
    assert m.sum(dtype=np.float32).dtype == np.float32 and float(m.sum(dtype=np.float32)) == 2.0
    assert int(cnp.sum(big)) == np.sum(np.full(3, 2 ** 30, np.int32), dtype=np.int32)  # wraps
    assert float(cnp.sum(big, dtype=np.float32)) == 3 * 2.0 ** 30                     # does not
    assert float(big.mean(dtype=np.float32)) == 2.0 ** 30
    with pytest.raises(TypeError, match="out= is not supported"):
        m.sum(out=np.zeros(()))


def test_cumsum_of_a_sharded_array_keeps_device_memory_bounded():
    """The zero blocks the scan shifts in are created in the operand's layout (each device
    its block), so no device holds a replicated (k, ...) block: peak below 5 shards."""
    from ctrainstate import _C
    import gc
    mesh = cts.make_mesh((8,), ("x",))
    h = (np.arange(256 * 1024) % 7).reshape(256, 1024).astype(np.int32)
    x = cts.device_put(h, NamedSharding(mesh, P(None, "x")))
    gc.collect()
    base = [d.memory_stats()["bytes_in_use"] for d in cts.devices()]
    _C.reset_peak_memory_stats()
    y = cnp.cumsum(x, axis=0)
    peak = max(d.memory_stats()["peak_bytes_in_use"] - b for d, b in zip(cts.devices(), base))
    np.testing.assert_array_equal(np.asarray(y), np.cumsum(h, axis=0, dtype=np.int32))
    assert tuple(y.sharding.spec) == (None, "x")
    assert peak <= 5 * h.nbytes // 8, peak / (h.nbytes / 8)


def test_division_by_a_zero_scalar_is_inf_or_nan():
    h = np.array([1.0, -1.0, 0.0, np.inf, np.nan], np.float32)
    x = cts.device_put(h)
    with np.errstate(divide="ignore", invalid="ignore"):
        np.testing.assert_array_equal(np.asarray(x / 0.0), h / np.float32(0.0))
        np.testing.assert_array_equal(np.asarray(x / -0.0), h / np.float32(-0.0))
        np.testing.assert_array_equal(np.asarray(cnp.divide(x, 0.0)), h / np.float32(0.0))


def test_result_type_takes_dtypes_as_jax(jax_ref):
    cases = [(np.int32, np.float32), (np.dtype("int32"), np.dtype("uint32")), ("float32", 1),
             (BF16, np.float16), ("bfloat16", 2.0), (np.bool_, 1), (np.uint32, True)]
    want = [F32, I32, F32, F32, BF16, I32, U32]   # jnp.result_type, jax 0.10.2 (measured)
    for args, w in zip(cases, want):
        assert cnp.result_type(*args) == np.dtype(w), args
    with pytest.raises(TypeError, match="not a dtype ctrainstate stores"):
        cnp.result_type(np.complex64)
    for args in cases:
        assert cnp.result_type(*args) == rec_dtype(jax_ref(
            None, lambda jnp: np.dtype(jnp.result_type(*args)).name)), args


# --- the narrow integer dtypes: uint8, int8, int16, uint16 ---------------------------------------

U8, I8, I16, U16 = np.uint8, np.int8, np.int16, np.uint16
NARROW = [U8, I8, I16, U16]
NNAMES = {U8: "u8", I8: "i8", I16: "i16", U16: "u16"}
# jnp.promote_types of a narrow int (row) with each stored dtype (column), jax 0.10.2 with x64
# off (measured; int64 where jax would reach it canonicalises to int32)
_COLS = [U8, I8, I16, U16, I32, U32, BOOL, F32, BF16, F16]
NARROW_PROMOTE = {
    U8: [U8, I16, I16, U16, I32, U32, U8, F32, BF16, F16],
    I8: [I16, I8, I16, I32, I32, I32, I8, F32, BF16, F16],
    I16: [I16, I16, I16, I32, I32, I32, I16, F32, BF16, F16],
    U16: [U16, I32, I32, U16, I32, U32, U16, F32, BF16, F16],
}


def narrow_values(dt, shape, seed=0):
    """The dtype's extremes and small values first, then random ones over its whole range."""
    info = np.iinfo(dt)
    n = int(np.prod(shape))
    edge = np.array([0, 1, info.max, info.min, info.max - 1, info.min + 1, 2, 3, 7, 100],
                    np.int64)
    rest = np.random.default_rng(seed).integers(info.min, info.max, n, endpoint=True)
    return np.concatenate([edge, rest])[:n].astype(dt).reshape(shape)


def _mesh_put(x):
    """x sharded over a 2 x 4 mesh along its leading dimensions (replicated where it has none)."""
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    spec = P(*(("data", "model")[:x.ndim]))
    return cts.device_put(x, NamedSharding(mesh, spec))


@pytest.mark.parametrize("dt", NARROW, ids=lambda d: NNAMES[d])
def test_narrow_promotion(dt):
    """Each pairing's result dtype is jax's (the table above), for Arrays, numpy scalars and
    cnp.result_type; weak Python scalars keep the narrow dtype (ints) or give float32."""
    x = put(narrow_values(dt, (4,)))
    for col, want in zip(_COLS, NARROW_PROMOTE[dt]):
        y = put(np.ones(4, col))
        assert cnp.result_type(x, y) == np.dtype(want), (dt, col)
        assert (x + y).dtype == np.dtype(want) and (y * x).dtype == np.dtype(want), (dt, col)
        assert cnp.maximum(x, y).dtype == np.dtype(want), (dt, col)
        assert (x + np.ones((), col)).dtype == np.dtype(want), (dt, col)
        assert cnp.where(x > 1, x, y).dtype == np.dtype(want), (dt, col)
    assert (x + 1).dtype == dt and (3 * x).dtype == dt and (x - True).dtype == dt
    assert (x + 1.5).dtype == F32 and (x / x).dtype == F32 and cnp.mean(x).dtype == F32


def test_narrow_promotion_table_is_jaxs(jax_ref):
    for dt, row in NARROW_PROMOTE.items():
        for col, want in zip(_COLS, row):
            got = rec_dtype(jax_ref(None, lambda jnp: np.dtype(jnp.promote_types(dt, col)).name))
            assert (np.dtype(I32) if got == np.int64 else got) == np.dtype(want), (dt, col)


@pytest.mark.parametrize("dt", NARROW, ids=lambda d: NNAMES[d])
def test_narrow_arithmetic_wraps(dt):
    """+ - * neg abs max min wrap to the dtype's width, on a mesh, with Python ints wrapping to
    the dtype first (jax: uint8 + 300 adds 44, uint8 + -1 subtracts one)."""
    a, b = narrow_values(dt, (8, 12), 1), narrow_values(dt, (12,), 2)
    A, B = a.astype(np.int64), b.astype(np.int64)
    pa, pb = _mesh_put(a), put(b)
    for name, got, want in (("+", pa + pb, A + B), ("-", pa - pb, A - B), ("*", pa * pb, A * B),
                            ("neg", -pa, -A), ("abs", cnp.abs(pa), np.abs(A)),
                            ("max", cnp.maximum(pa, pb), np.maximum(A, B)),
                            ("min", cnp.minimum(pb, pa), np.minimum(A, B)),
                            ("+300", pa + 300, A + (300 % 2 ** (8 * a.itemsize))),
                            ("+-1", pa + (-1), A - 1), ("2*", 2 * pa, 2 * A),
                            ("1-", 1 - pa, 1 - A)):
        assert got.dtype == dt, name
        np.testing.assert_array_equal(host(got), _wrap(want, dt), err_msg=name)
    assert host(put(np.array([200], U8)) + put(np.array([100], U8))).tolist() == [44]
    assert host(put(np.array([-128], I8)) * -1).tolist() == [-128]      # wraps
    with pytest.raises(OverflowError, match="does not fit int32"):
        pa + 2 ** 31


def _ref_narrow_floordiv(a, b, dt):
    """As _ref_int_floordiv, with the narrow width: x // 0 is -1 / -2 signed, all ones
    unsigned; x % 0 is 0; INT_MIN // -1 wraps to INT_MIN."""
    A, B = np.broadcast_arrays(a.astype(np.int64), b.astype(np.int64))
    safe = np.where(B == 0, 1, B)
    q, r = A // safe, A % safe
    if np.iinfo(dt).min == 0:
        q = np.where(B == 0, np.iinfo(dt).max, q)
    else:
        q = np.where(B == 0, np.where(A == 0, -1, -2), q)
    return _wrap(q, dt), _wrap(np.where(B == 0, 0, r), dt)


@pytest.mark.parametrize("dt", NARROW, ids=lambda d: NNAMES[d])
def test_narrow_floor_divide_remainder_and_shifts(dt):
    info = np.iinfo(dt)
    w = 8 * np.dtype(dt).itemsize
    a, b = narrow_values(dt, (8, 12), 3), narrow_values(dt, (12,), 4)
    b[:3] = np.array([0, -1, 2]).astype(dt)
    q, r = _ref_narrow_floordiv(a, b, dt)
    np.testing.assert_array_equal(host(_mesh_put(a) // put(b)), q)
    np.testing.assert_array_equal(host(_mesh_put(a) % put(b)), r)
    # shifts: counts past the width give 0 / the sign fill (jax 0.10, measured), negative
    # counts too
    counts = np.array([0, 1, w - 1, w, w + 1, 31, 32, 100, -1], np.int64)
    x = narrow_values(dt, (counts.size, 10), 5)
    s = counts.astype(dt)[:, None]
    cs = s.astype(np.int64)         # the count as the dtype holds it (uint8 -1 is 255)
    inr = (cs >= 0) & (cs < w)
    safe = np.where(inr, cs, 0)
    left = _wrap(x.astype(np.int64) << safe, dt)
    right = (x.astype(np.int64) >> safe).astype(dt)
    fill = np.where(x < 0, -1, 0).astype(dt) if info.min < 0 else np.zeros_like(x)
    np.testing.assert_array_equal(host(put(x) << put(s)), np.where(inr, left, 0).astype(dt))
    np.testing.assert_array_equal(host(put(x) >> put(s)), np.where(inr, right, fill).astype(dt))


@pytest.mark.parametrize("dt", NARROW, ids=lambda d: NNAMES[d])
def test_narrow_comparisons_bitwise_and_where(dt):
    a, b = narrow_values(dt, (8, 12), 6), narrow_values(dt, (12,), 7)
    a[0] = b                                            # equal pairs
    pa, pb = _mesh_put(a), put(b)
    for name in CMPS:
        got = getattr(cnp, name)(pa, pb)
        assert got.dtype == BOOL
        np.testing.assert_array_equal(host(got), CMPS[name](a, b), err_msg=name)
    # a weak int wraps to the dtype before comparing (jax: uint8 == -1 compares with 255)
    np.testing.assert_array_equal(host(pa == -1), a == np.array(-1).astype(dt))
    np.testing.assert_array_equal(host(pa < 2 ** 16 + 3), a < np.array(2 ** 16 + 3).astype(dt))
    for got, want in ((pa & pb, a & b), (pa | pb, a | b), (pa ^ pb, a ^ b), (~pa, ~a)):
        assert got.dtype == dt
        np.testing.assert_array_equal(host(got), want)
    got = cnp.where(pa > b, pa, -1)
    assert got.dtype == dt
    np.testing.assert_array_equal(host(got), np.where(a > b, a, np.array(-1).astype(dt)))
    other = narrow_values(I8, (12,), 8)
    got = cnp.where(pa > b, pa, put(other))
    want_dt = NARROW_PROMOTE[dt][_COLS.index(I8)]
    assert got.dtype == want_dt
    np.testing.assert_array_equal(host(got), np.where(a > b, a.astype(want_dt), other.astype(want_dt)))


@pytest.mark.parametrize("dt", NARROW, ids=lambda d: NNAMES[d])
@pytest.mark.parametrize("axis", [None, 0, 1, (0, 1)])
def test_narrow_reductions(dt, axis):
    """sum widens as jnp.sum does (int8 / int16 to int32, uint8 / uint16 to uint32) and wraps
    there; sum(dtype=dt) wraps in dt; max / min / cumsum / cumprod / argmax keep their jax
    dtypes; reduced dimensions sharded over the mesh combine the devices' partials."""
    a = narrow_values(dt, (8, 12), 9)
    pa = _mesh_put(a)
    wide = np.int32 if np.iinfo(dt).min < 0 else np.uint32
    got = cnp.sum(pa, axis=axis)
    assert got.dtype == wide
    np.testing.assert_array_equal(host(got), np.sum(a.astype(np.int64), axis=axis).astype(wide))
    for got in (cnp.sum(pa, axis=axis, dtype=dt), pa.sum(axis=axis, dtype=dt)):
        assert got.dtype == dt
        np.testing.assert_array_equal(host(got), _wrap(np.sum(a.astype(np.int64), axis=axis), dt))
    assert pa.sum(axis=axis).dtype == wide and pa.prod(axis=axis).dtype == wide
    for name in ("max", "min"):
        got = getattr(cnp, name)(pa, axis=axis)
        assert got.dtype == dt
        np.testing.assert_array_equal(host(got), getattr(np, name)(a, axis=axis))
    assert host(cnp.any(pa, axis=axis)).tolist() == np.any(a, axis=axis).tolist()
    if axis in (0, 1):
        for name, fn in (("cumsum", np.cumsum), ("cumprod", np.cumprod)):
            got = getattr(cnp, name)(pa, axis=axis)
            assert got.dtype == dt
            np.testing.assert_array_equal(host(got), _wrap(fn(a.astype(np.int64), axis=axis), dt))
        got = cnp.argmax(pa, axis=axis)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(host(got), np.argmax(a, axis=axis))
        np.testing.assert_array_equal(host(cnp.argmin(pa, axis=axis)), np.argmin(a, axis=axis))


@pytest.mark.parametrize("dt", NARROW + [I32, U32], ids=lambda d: np.dtype(d).name)
def test_int_rounding_sign_and_square_keep_the_dtype(dt):
    """jnp's floor / ceil / round / trunc of ints are the ints, sign is -1 / 0 / 1 in the
    dtype, square wraps in it (measured with jax 0.10)."""
    info = np.iinfo(dt)
    a = np.array([info.min, info.min + 1, -3, 0, 1, 5, 16, 255, info.max, 7, -7, 2],
                 np.int64).astype(dt)
    pa = _mesh_put(np.tile(a, (8, 1)))
    for name in ("floor", "ceil", "round", "around", "trunc"):
        got = getattr(cnp, name)(pa)
        assert got.dtype == dt, name
        np.testing.assert_array_equal(host(got)[0], a, err_msg=name)
    got = cnp.sign(pa)
    assert got.dtype == dt
    np.testing.assert_array_equal(host(got)[3], np.sign(a.astype(np.int64)).astype(dt))
    np.testing.assert_array_equal(host(cnp.sign(put(a)))[:3], np.array([-1, -1, -1]).astype(dt)
                                  if info.min < 0 else [0, 1, 1])
    got = cnp.square(pa)
    assert got.dtype == dt
    np.testing.assert_array_equal(host(got)[5], _wrap(a.astype(np.int64) ** 2, dt))


def test_narrow_ints_with_16_bit_floats_round_the_int_first():
    """int16 + bfloat16 is bfloat16; jax converts the int16 to bfloat16 first (one rounding),
    then adds (another): 257 + 0 -> 256, and 259 + 1.0 is 260 (259 -> 260), not 260 from 260."""
    i = put(np.array([257, 259, -32767, 1001], I16))
    f = put(np.array([0, 1, 0, 0.5], BF16))
    got = i + f
    want = (np.array([257, 259, -32767, 1001], I16).astype(BF16).astype(F32) +
            np.array([0, 1, 0, 0.5], np.float32)).astype(BF16)
    assert got.dtype == BF16
    np.testing.assert_array_equal(host(got).view(np.uint16), want.view(np.uint16))
    h = put(np.array([2049, 2051, 65535], U16)) * put(np.array([1, 1, 1], F16))
    assert h.dtype == F16
    np.testing.assert_array_equal(host(h), np.array([2049, 2051, 65535], U16).astype(F16))


def test_narrow_ops_match_jax(jax_ref):
    names = ["add", "subtract", "multiply", "maximum", "minimum", "floor_divide", "remainder",
             "equal", "less", "greater_equal", "bitwise_and", "bitwise_or", "bitwise_xor",
             "left_shift", "right_shift"]
    # (true_divide is checked for its dtype only: XLA's CPU float32 division of broadcast
    # operands is not the correctly rounded quotient, ctrainstate's is, for every dtype)
    for dt in NARROW:
        for other in _COLS:
            a, b = narrow_values(dt, (3, 12), 10), values(other, (12,), 11) \
                if other not in NARROW else narrow_values(other, (12,), 11)
            if np.dtype(other).kind == "f" or other == BF16:
                # (no subnormals: XLA's float arithmetic flushes them, the float32 kernels
                # here keep them, whatever the other operand's dtype)
                b = np.where(np.abs(b.astype(np.float32)) < np.finfo(np.float32).tiny,
                             np.zeros_like(b), b).astype(other)
            pairs = [(a, b), (b, a)]
            for x, y in pairs:
                res_dt = rec_dtype(jax_ref(None, lambda jnp: np.dtype(
                    jnp.result_type(x.dtype, y.dtype)).name))
                fl = res_dt in (np.dtype(F32), np.dtype(BF16), np.dtype(F16))
                # (bitwise ops of floats raise in both; a 16-bit float floor_divide /
                # remainder can differ from jax by an ulp whatever the operands' dtypes --
                # float16 // float16 too --, so a narrow int's part is checked in float32)
                ok = [n for n in names if not (n.startswith(("bitwise", "left", "right")) and fl)
                      and not (n in ("floor_divide", "remainder") and fl and res_dt != F32)]
                wants = jax_ref(None, lambda jax, jnp: jax.jit(
                    lambda p, q: [getattr(jnp, n)(p, q) for n in ok])(x, y))
                for n, want in zip(ok, wants, strict=True):
                    got = getattr(cnp, n)(put(x), put(y))
                    assert_same_bits(got, np.asarray(want), False, f"{n} {x.dtype} {y.dtype}")
            for x, y in pairs:   # (jax's dtype from eval_shape: traced, nothing compiled)
                assert cnp.true_divide(put(x), put(y)).dtype == rec_dtype(jax_ref(
                    None, lambda jax, jnp: jax.eval_shape(jnp.true_divide, x, y).dtype.name))
        a = narrow_values(dt, (4, 12), 12)
        for n in ("negative", "abs", "invert", "logical_not", "isnan", "isfinite", "signbit",
                  "floor", "round", "sign", "square"):
            if n == "abs" and np.iinfo(dt).min == 0:
                continue
            same_bits(getattr(cnp, n)(put(a)), jax_ref(None, lambda jnp: getattr(jnp, n)(a)))
        for n in ("sum", "max", "min", "cumsum", "cumprod", "argmax", "argmin", "any", "all"):
            for ax in (None, 0, 1):
                if ax is None and n in ("cumsum", "cumprod"):
                    continue
                same_bits(getattr(cnp, n)(_mesh_put(a), axis=ax),
                          jax_ref(None, lambda jnp: getattr(jnp, n)(a, axis=ax)))
        for sc in (1, -1, 300, 2.5, True):
            for n in ("add", "multiply", "equal", "less", "floor_divide", "remainder"):
                same_bits(getattr(cnp, n)(put(a), sc), jax_ref(None, lambda jnp: getattr(jnp, n)(a, sc)))
        same_bits(cnp.where(put(a) > 3, put(a), -1), jax_ref(None, lambda jnp: jnp.where(a > 3, a, -1)))
