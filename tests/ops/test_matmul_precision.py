"""Matrix products in TF32 / bfloat16 when asked: ``precision=`` on matmul / dot / einsum /
``nn.Dense``, ``default_matmul_precision``, and the backends' input rounding.

Every expected value is derived here, independently of the C rounding
(csrc/core/ct_prec_math.h, a bit trick on the integer pattern): ``round_ref`` rounds on a
float64 copy with ``np.frexp`` / ``np.rint`` (half to even), and is itself checked against
ml_dtypes' bfloat16 conversion, jax's ``lax.reduce_precision`` (when installed) and values
worked out by hand. Products of rounded inputs are then taken in float64.

Two kinds of data:
  * ``exact_data``: integers 1..8 (either sign) plus a perturbation of 2^-13 that TF32 and
    bfloat16 round away but float32 keeps. Rounded products are small integers, so every
    summation order (CPU kernel, BLAS, sharded partial sums, GPU) gives the same float32
    bits as the float64 reference, and float32 (rounding skipped) gives other bits.
  * random normal data, compared within float32's accumulation bound of the reference;
    each such test also checks that skipping the rounding would break that bound.

The file is device-generic: tools/cuda_emu.sh also runs it on 8 emulated GPU devices.
"""
import threading

import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import NamedSharding, P, _C, nn, random
from ctrainstate._src.ops import ops as _ops
from ctrainstate.lax import Precision

MANTISSA = {"float32": 23, "tensorfloat32": 10, "bfloat16": 7}
MODES = list(MANTISSA)
F32MAX = float(np.finfo(np.float32).max)


# --- the independent reference --------------------------------------------------------------

def round_ref(x, mode):
    """float32 ``x`` rounded to ``mode``'s input format (nearest, ties to even), float32 out.

    On a float64 copy: frexp gives each value's binade 2^(e-1) <= |x| < 2^e, the format's
    quantum there is 2^(e - 1 - mantissa) but never below its denormal quantum
    2^(-126 - mantissa); x / quantum is rounded half to even by np.rint. A result of 2^128
    (past the largest finite value) becomes inf in the cast; 0, inf and NaN pass through."""
    x = np.asarray(x, np.float32)
    mb = MANTISSA[mode]
    if mb == 23:
        return x.copy()
    with np.errstate(invalid="ignore"):   # signalling NaNs in the cast
        out = x.astype(np.float64)
    fin = np.isfinite(x) & (x != 0)
    v = out[fin]
    _, e = np.frexp(v)
    q = np.maximum(e - 1 - mb, -126 - mb)
    out[fin] = np.ldexp(np.rint(np.ldexp(v, -q)), q)
    out = np.where(fin, out, x)   # NaN bits untouched by the float64 round trip
    with np.errstate(over="ignore", invalid="ignore"):
        return out.astype(np.float32)


def f32(*bits):
    return np.array(bits, np.uint32).view(np.float32)


def edge_values():
    """Zeros, ties (to even, both ways), values next to ties, the largest finite values (some
    rounding to inf), inf, NaNs (one with only low payload bits, which a plain rounding would
    turn into inf), denormals around both formats' denormal grids, the smallest normal."""
    hand = [0.0, -0.0, 1.0, -1.0, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -11 + 2.0 ** -23,
            -(1 + 3 * 2.0 ** -11), 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -8 + 2.0 ** -23,
            1 + 2.0 ** -9, 3.0, 1 / 3, -1e-3, 65504.0, 1e30, -1e-30,
            2.0 ** -149, 2.0 ** -137, 3 * 2.0 ** -137, 2.0 ** -137 + 2.0 ** -149, 2.0 ** -134,
            3 * 2.0 ** -134, -(2.0 ** -130), 2.0 ** -126]
    bits = [0x7F7FFFFF, 0xFF7FFFFF, 0x7F7FE000, 0x7F7FEFFF, 0x7F7FF000, 0x7F7F0000, 0x7F7F7FFF,
            0x7F7F8000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC00001, 0x7FA00000,
            0x007FFFFF, 0x00000001, 0x00001001, 0x807FFFFF]
    return np.concatenate([np.array(hand, np.float32), f32(*bits)])


def random_patterns(n=50_000, seed=0):
    """Random float32 bit patterns (every exponent, NaNs and denormals included)."""
    return np.random.default_rng(seed).integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def exact_data(shape, seed):
    rng = np.random.default_rng(seed)
    n = rng.integers(1, 9, shape) * rng.choice([-1, 1], shape)
    return (n + rng.choice([-1, 1], shape) * 2.0 ** -13).astype(np.float32)


def biased_data(shape, mode, seed):
    """Values in [1, 2) that lie 0.1 to 0.45 of ``mode``'s ulp above a representable value, so
    each rounds down: the rounding errors of a product add up instead of cancelling, and
    skipping the rounding moves the result far past float32's accumulation bound."""
    rng = np.random.default_rng(seed)
    ulp = 2.0 ** -MANTISSA[mode]
    base = 1 + np.floor(rng.uniform(0, 1, shape) / ulp) * ulp
    return (base + rng.uniform(0.1, 0.45, shape) * ulp).astype(np.float32)


def product_ref(a, b, mode):
    return round_ref(a, mode).astype(np.float64) @ round_ref(b, mode).astype(np.float64)


def accumulation_bound(a, b, mode):
    """2 K u (|round(a)| @ |round(b)|), u = 2^-24: float32 accumulation error of any order."""
    k = a.shape[-1]
    mag = np.abs(round_ref(a, mode)).astype(np.float64) @ np.abs(round_ref(b, mode)).astype(np.float64)
    return 2.0 * k * 2.0 ** -24 * mag + 1e-30


def check_product(got, a, b, mode, add=0.0):
    """``got`` is ``a @ b (+ add)`` in ``mode`` on exact data: bit-equal to the reference when
    the operands are rounded (small integers), within the accumulation bound for float32."""
    want = product_ref(a, b, mode) + add
    if mode == "float32":
        assert np.all(np.abs(np.asarray(got) - want) <= accumulation_bound(a, b, mode) + 1e-6 * np.abs(add))
    else:
        np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32))


def same_values(got, want, msg=""):
    """Bit-equal except that a NaN matches any NaN and 0 matches -0 (a sum starting at +0
    turns -0 into +0, in every GEMM)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=msg)
    np.testing.assert_array_equal(np.where(np.isnan(got), 0, got), np.where(np.isnan(want), 0, want),
                                  err_msg=msg)


@pytest.fixture(params=["blas", "builtin"])
def cpu_kernel(request):
    """The CPU GEMM with the registered BLAS (rounded tile by tile into a scratch) and with
    the built-in kernel (rounding as it reads). On GPU devices both run the same cuBLAS path."""
    if request.param == "builtin" and cts.devices()[0].platform != "cpu":
        pytest.skip("on GPU devices the 'blas' case runs the same cuBLAS path")
    _ops._ensure_blas()
    had = _C.has_blas()
    if request.param == "blas" and not had:
        pytest.skip("no BLAS sgemm registered (scipy absent)")
    if request.param == "builtin" and had:
        _C.set_blas_sgemm(None)
    try:
        yield request.param
    finally:
        if request.param == "builtin" and had:
            from scipy.linalg import cython_blas
            _C.set_blas_sgemm(cython_blas.__pyx_capi__["sgemm"])
            assert _C.has_blas()


# --- the reference itself ------------------------------------------------------------------

def test_reference_rounding_is_right():
    # by hand, from the definition (round to nearest, ties to even, float32's exponent range)
    cases = {
        "tensorfloat32": [(1 + 2.0 ** -11, 1.0), (1 + 3 * 2.0 ** -11, 1 + 2.0 ** -9),
                          (1 + 2.0 ** -11 + 2.0 ** -23, 1 + 2.0 ** -10), (1 + 2.0 ** -9, 1 + 2.0 ** -9),
                          (2.0 ** -137, 0.0), (3 * 2.0 ** -137, 2.0 ** -135),
                          (2.0 ** -137 + 2.0 ** -149, 2.0 ** -136), (F32MAX, np.inf),
                          (-F32MAX, -np.inf), ((2 - 2.0 ** -10) * 2.0 ** 127, (2 - 2.0 ** -10) * 2.0 ** 127)],
        "bfloat16": [(1 + 2.0 ** -8, 1.0), (1 + 3 * 2.0 ** -8, 1 + 2.0 ** -6), (1 + 2.0 ** -9, 1.0),
                     (2.0 ** -134, 0.0), (3 * 2.0 ** -134, 2.0 ** -132), (F32MAX, np.inf),
                     (2.0 ** -149, 0.0)],
    }
    for mode, pairs in cases.items():
        x = np.array([p[0] for p in pairs], np.float32)
        want = np.array([p[1] for p in pairs], np.float32)
        np.testing.assert_array_equal(round_ref(x, mode), want, err_msg=mode)
    x = np.concatenate([edge_values(), random_patterns()])
    nan = np.isnan(x)
    # bfloat16: ml_dtypes' conversion (round to nearest even, denormals kept)
    with np.errstate(invalid="ignore"):
        same_values(round_ref(x, "bfloat16"), x.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert np.isnan(round_ref(x, "tensorfloat32")[nan]).all()
    assert not np.isnan(round_ref(x, "tensorfloat32")[~nan]).any()


def test_reference_rounding_matches_jax_reduce_precision():
    jax = pytest.importorskip("jax")
    x = np.concatenate([edge_values(), random_patterns()])
    for mode in ("tensorfloat32", "bfloat16"):
        j = np.asarray(jax.lax.reduce_precision(jax.numpy.asarray(x), exponent_bits=8,
                                                mantissa_bits=MANTISSA[mode]))
        same_values(round_ref(x, mode), j, mode)


# --- the rounding, through the product ---------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("side", ["lhs", "rhs"])
def test_each_element_is_rounded(mode, side, cpu_kernel):
    """x (N, 1) @ [[1]] and [[1]] @ x (1, N): one product per element, so the result is the
    rounded element itself, bit for bit (NaN, inf, denormals, ties)."""
    x = np.concatenate([edge_values(), random_patterns()])
    one = np.ones((1, 1), np.float32)
    if side == "lhs":
        got = np.asarray(cnp.matmul(cts.device_put(x[:, None]), one, precision=mode))[:, 0]
    else:
        got = np.asarray(cnp.matmul(cts.device_put(one), x[None, :], precision=mode))[0]
    same_values(got, round_ref(x, mode), f"{mode} {side}")
    if mode != "float32":  # the rounding is not skipped: these inputs change under it
        assert np.sum(round_ref(x, mode) != x) > 1000


@pytest.mark.parametrize("mode", ["tensorfloat32", "bfloat16"])
@pytest.mark.parametrize("mkn", [(37, 300, 29), (130, 600, 2100)], ids=["small", "tiles"])
def test_random_products_match_the_reference(mode, mkn, cpu_kernel):
    """Random normal operands, then operands whose rounding errors add up (where skipping the
    rounding breaks the bound); (130, 600, 2100) crosses the BLAS path's K (512), N (2048) and
    row (m / threads) tiles."""
    m, k, n = mkn
    rng = np.random.default_rng(sum(mkn))
    normal = (rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32))
    biased = (biased_data((m, k), mode, 1), biased_data((k, n), mode, 2))
    for a, b in (normal, biased):
        got = np.asarray(cnp.matmul(a, cts.device_put(b), precision=mode)).astype(np.float64)
        ref, bound = product_ref(a, b, mode), accumulation_bound(a, b, mode)
        assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) / bound)
    exact = a.astype(np.float64) @ b.astype(np.float64)   # the biased data, unrounded
    assert np.all(np.abs(exact - ref) > 2 * bound)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ta,tb", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_transposed_operands(mode, ta, tb, cpu_kernel):
    """The kernels' transposed reads (the gradient's products use them): _ops._matmul with a
    stored operand transposed, on exact data (bit-equal to the reference when rounded)."""
    opa, opb = exact_data((17, 24), 1), exact_data((24, 19), 2)
    a = np.ascontiguousarray(opa.T) if ta else opa      # the stored operands
    b = np.ascontiguousarray(opb.T) if tb else opb
    code = cts._src.base.precision.resolve_precision(mode)
    got = _ops._matmul(cts.device_put(a), cts.device_put(b), bool(ta), bool(tb), code)
    want = product_ref(opa, opb, mode)
    if mode == "float32":  # the perturbations are kept: exact up to float32 accumulation
        assert np.all(np.abs(np.asarray(got) - want) <= accumulation_bound(opa, opb, mode))
    else:
        np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32))
        assert not np.array_equal(np.asarray(got), np.asarray(_ops._matmul(
            cts.device_put(a), cts.device_put(b), bool(ta), bool(tb), 0)))


def test_float32_modes_are_todays_product_bit_for_bit():
    """Every float32 spelling gives the bits of the default product, which are those of the
    binding called without a precision (its signature before precisions existed)."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((33, 70)).astype(np.float32)
    b = rng.standard_normal((70, 21)).astype(np.float32)
    A, B = cts.device_put(a), cts.device_put(b)
    base = np.asarray(A @ B)
    out = _ops._new((33, 21), _ops._place_of(A), [(), ()])
    _C.op_matmul(_ops._bufs(A), _ops._bufs(B), _ops._bufs(out), 1, 33, 21, 70, 0, 0, 0, 0, 1.0, 0.0)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), base.view(np.uint32))
    for p in (None, "float32", "highest", "default", "fastest", "F32_F32_F32", Precision.HIGHEST,
              Precision.DEFAULT, ("float32", Precision.HIGHEST), [None, None]):
        for got in (cnp.matmul(A, B, precision=p), cnp.dot(A, B, precision=p),
                    cnp.einsum("ij,jk->ik", A, B, precision=p)):
            np.testing.assert_array_equal(np.asarray(got).view(np.uint32), base.view(np.uint32),
                                          err_msg=repr(p))
    np.testing.assert_allclose(base, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    assert not np.array_equal(base, np.asarray(cnp.matmul(A, B, precision="tensorfloat32")))


# --- the precision argument ------------------------------------------------------------------

ACCEPTED = [
    (None, "float32"), ("default", "float32"), ("fastest", "float32"), ("highest", "float32"),
    ("float32", "float32"), (Precision.DEFAULT, "float32"), (Precision.HIGHEST, "float32"),
    ("high", "tensorfloat32"), ("tensorfloat32", "tensorfloat32"), ("bfloat16_3x", "tensorfloat32"),
    (Precision.HIGH, "tensorfloat32"), ("bfloat16", "bfloat16"), ("F32_F32_F32", "float32"),
    ("TF32_TF32_F32", "tensorfloat32"), ("BF16_BF16_F32", "bfloat16"),
    (("high", Precision.HIGH), "tensorfloat32"), (["bfloat16", "bfloat16"], "bfloat16"),
    (Precision("tensorfloat32"), "tensorfloat32"), (Precision("bfloat16"), "float32"),
]


@pytest.mark.parametrize("precision,mode", ACCEPTED, ids=[repr(p) for p, _ in ACCEPTED])
def test_accepted_precisions_and_their_modes(precision, mode):
    x = np.concatenate([edge_values(), random_patterns(5000)])
    refs = {m: round_ref(x, m) for m in MODES}
    for m1 in MODES:  # the three modes are told apart by this x
        for m2 in MODES:
            assert m1 == m2 or not np.array_equal(refs[m1], refs[m2], equal_nan=True)
    X, one = cts.device_put(x[:, None]), np.ones((1, 1), np.float32)
    same_values(np.asarray(cnp.matmul(X, one, precision=precision))[:, 0], refs[mode])
    same_values(np.asarray(cnp.einsum("ij,jk->ik", X, one, precision=precision))[:, 0], refs[mode])
    with cts.default_matmul_precision(precision if isinstance(precision, (str, Precision)) else None):
        if isinstance(precision, (str, Precision)):
            same_values(np.asarray(X @ one)[:, 0], refs[mode])


@pytest.mark.parametrize("bad,match", [
    ("foo", "unknown precision 'foo'"), ("HIGH", "unknown precision"), (3, "unsupported precision 3"),
    (1.5, "unsupported precision"), (("high", "bfloat16"), "tensorfloat32 on the lhs and bfloat16"),
    (("high",), "pair has two entries"), (("a", "b", "c"), "pair has two entries"),
    ("ANY_F8_ANY_F8_F32", "unknown precision"),
])
def test_invalid_precisions_raise_value_error(bad, match):
    a = cts.device_put(np.ones((2, 3), np.float32))
    b = np.ones((3, 2), np.float32)
    for call, name in ((lambda: cnp.matmul(a, b, precision=bad), "matmul"),
                       (lambda: cnp.dot(a, b, precision=bad), "matmul"),
                       (lambda: cnp.einsum("ij,jk->ik", a, b, precision=bad), "einsum")):
        with pytest.raises(ValueError, match=match) as e:
            call()
        assert str(e.value).startswith(name)
        if "pair" not in match and "lhs" not in match:
            assert "'tensorfloat32'" in str(e.value) and "Precision.DEFAULT" in str(e.value)


def test_invalid_precision_errors_elsewhere():
    with pytest.raises(ValueError, match="default_matmul_precision: unknown precision 'fast'"):
        with cts.default_matmul_precision("fast"):
            pass
    with pytest.raises(ValueError, match="default_matmul_precision"):
        with cts.default_matmul_precision(("high", "high")):
            pass
    with pytest.raises(ValueError):
        Precision("foo")
    sds = cts.ShapeDtypeStruct((2, 3), np.float32)
    with pytest.raises(ValueError, match="unknown precision 'foo'"):
        cts.eval_shape(lambda a: cnp.matmul(a, np.ones((3, 2), np.float32), precision="foo"), sds)
    shapes = cts.eval_shape(lambda a: cnp.matmul(a, np.ones((3, 2), np.float32), precision="high"), sds)
    assert shapes.shape == (2, 2)
    x = np.ones((1, 3), np.float32)
    with pytest.raises(ValueError, match=r"Dense\(precision=...\): unknown precision 'tf32'"):
        nn.Dense(2, precision="tf32").init(random.PRNGKey(0), x)
    with pytest.raises(ValueError, match=r"DenseGeneral\(precision=...\)"):
        nn.DenseGeneral(2, precision=7).init(random.PRNGKey(0), x)


def test_precision_enum_is_jaxs(jax_ref):
    assert [m.name for m in Precision] == ["DEFAULT", "HIGH", "HIGHEST"]
    assert repr(Precision.HIGH) == "Precision.HIGH" and str(Precision.HIGHEST) == "HIGHEST"
    assert cts.lax.Precision is Precision
    if not jax_ref.live:   # jax's own enum objects: in the live twin only (nothing to record)
        return
    jax = jax_ref.jax
    from jax._src.lax.lax import _precision_strings
    for s, p in _precision_strings.items():
        if s is not None:
            assert Precision(s).name == p.name, s
    for m in jax.lax.Precision:
        assert Precision[m.name].value == m.value
    # jax's own enum members are understood (a ported script may still pass them)
    x = np.concatenate([edge_values(), random_patterns(2000)])[:, None]
    one = np.ones((1, 1), np.float32)
    for jp, mode in ((jax.lax.Precision.HIGH, "tensorfloat32"), (jax.lax.Precision.HIGHEST, "float32"),
                     (jax.lax.DotAlgorithmPreset.BF16_BF16_F32, "bfloat16")):
        same_values(np.asarray(cnp.matmul(cts.device_put(x), one, precision=jp))[:, 0],
                    round_ref(x[:, 0], mode), repr(jp))
    with pytest.raises(ValueError, match="unsupported precision"):
        cnp.matmul(cts.device_put(x), one, precision=jax.lax.DotAlgorithmPreset.F16_F16_F32)
    # every legacy name jax's default_matmul_precision takes is taken here
    for name in ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32"):
        with jax.default_matmul_precision(name), cts.default_matmul_precision(name):
            pass


# --- default_matmul_precision -----------------------------------------------------------------

def test_default_matmul_precision_nests_restores_and_is_thread_local():
    x = np.concatenate([edge_values(), random_patterns(2000)])
    X, one = cts.device_put(x[:, None]), np.ones((1, 1), np.float32)

    def run(**kw):
        return np.asarray(cnp.matmul(X, one, **kw))[:, 0]

    same_values(run(), x)
    with cts.default_matmul_precision("tensorfloat32"):
        same_values(run(), round_ref(x, "tensorfloat32"))
        with cts.default_matmul_precision("bfloat16"):
            same_values(run(), round_ref(x, "bfloat16"))
            same_values(run(precision="highest"), x)        # an explicit precision wins
            same_values(run(precision=Precision.DEFAULT), x)  # DEFAULT too, as in jax
            same_values(np.asarray(nn.Dense(1, use_bias=False).apply(
                {"params": {"kernel": one}}, X))[:, 0], round_ref(x, "bfloat16"))
            with cts.default_matmul_precision(None):
                same_values(run(), x)
            same_values(run(), round_ref(x, "bfloat16"))
        same_values(run(), round_ref(x, "tensorfloat32"))
        seen = {}
        t = threading.Thread(target=lambda: seen.setdefault("r", run()))
        t.start()
        t.join()
        same_values(seen["r"], x)   # another thread keeps its own (float32) default
        with pytest.raises(RuntimeError):
            with cts.default_matmul_precision("bfloat16"):
                raise RuntimeError
        same_values(run(), round_ref(x, "tensorfloat32"))
    same_values(run(), x)


def test_thread_default_does_not_leak_between_threads():
    x = np.concatenate([edge_values(), random_patterns(2000)])
    one = np.ones((1, 1), np.float32)
    errors, barrier = [], threading.Barrier(3)

    def worker(mode):
        try:
            X = cts.device_put(x[:, None])
            with cts.default_matmul_precision(mode):
                barrier.wait()
                for _ in range(5):
                    same_values(np.asarray(X @ one)[:, 0], round_ref(x, mode), mode)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(m,)) for m in MODES]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


# --- sharded products --------------------------------------------------------------------------

SHARDED = [
    ((8,), ("x",), P(None, "x"), P("x", None)),          # K sharded: partial sums + all-reduce
    ((8,), ("x",), P("x", None), P()),                   # M sharded
    ((8,), ("x",), P(), P(None, "x")),                   # N sharded
    ((2, 4), ("data", "model"), P("data", "model"), P("model", None)),
    ((2, 4), ("data", "model"), P("data", None), P(None, "model")),
    ((2, 4), ("data", "model"), P(None, ("data", "model")), P(("data", "model"), None)),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,names,sa,sb", SHARDED, ids=[f"{s}-{a}-{b}" for s, _, a, b in SHARDED])
def test_sharded_products_equal_single_device(mode, shape, names, sa, sb):
    m = cts.make_mesh(shape, names)
    a, b = exact_data((16, 32), 4), exact_data((32, 24), 5)
    single = np.asarray(cnp.matmul(cts.device_put(a), cts.device_put(b), precision=mode))
    A = cts.device_put(a, NamedSharding(m, sa))
    B = cts.device_put(b, NamedSharding(m, sb))
    got = cnp.matmul(A, B, precision=mode)
    assert isinstance(got.sharding, NamedSharding)
    if mode == "float32":  # float32 keeps the perturbations: equal up to summation order
        bound = accumulation_bound(a, b, mode)
        assert np.all(np.abs(np.asarray(got) - single) <= bound)
        assert np.all(np.abs(single - a.astype(np.float64) @ b) <= bound)
    else:  # rounded: small integers, the same bits in any order
        np.testing.assert_array_equal(np.asarray(got), single)
        np.testing.assert_array_equal(single, product_ref(a, b, mode).astype(np.float32))
        assert not np.array_equal(single, np.asarray(cnp.matmul(A, B)))


@pytest.mark.parametrize("mode", ["tensorfloat32", "bfloat16"])
def test_sharded_random_products_within_the_bound(mode):
    m = cts.make_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(6)
    normal = (rng.standard_normal((16, 64)).astype(np.float32), rng.standard_normal((64, 24)).astype(np.float32))
    for a, b in (normal, (biased_data((16, 64), mode, 3), biased_data((64, 24), mode, 4))):
        A = cts.device_put(a, NamedSharding(m, P("data", "model")))
        B = cts.device_put(b, NamedSharding(m, P("model", None)))
        got = np.asarray(cnp.matmul(A, B, precision=mode)).astype(np.float64)
        ref, bound = product_ref(a, b, mode), accumulation_bound(a, b, mode)
        assert np.all(np.abs(got - ref) <= bound)
    assert np.all(np.abs(a.astype(np.float64) @ b - ref) > 2 * bound)


# --- gradients ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh", [None, (2, 4)])
def test_gradients_use_the_forward_precision(mode, mesh):
    """d/dx sum((x @ w) * c) = round(c) @ round(w)^T and d/dw = round(x)^T @ round(c): the
    backward products round the cotangent and the saved operands with the forward's
    precision, also on a mesh (partial products all-reduced over 'model' and 'data')."""
    x, w, c = exact_data((8, 16), 7), exact_data((16, 12), 8), exact_data((8, 12), 9)
    if mesh:
        msh = cts.make_mesh(mesh, ("data", "model"))
        X = cts.device_put(x, NamedSharding(msh, P("data", "model")))
        W = cts.device_put(w, NamedSharding(msh, P("model", None)))
    else:
        X, W = cts.device_put(x), cts.device_put(w)

    def loss(x, w):
        return cnp.sum(cnp.matmul(x, w, precision=mode) * c)

    gx, gw = cts.grad(loss, argnums=(0, 1))(X, W)
    check_product(gx, c, w.T, mode)
    check_product(gw, x.T, c, mode)
    if mode != "float32":
        fx, fw = cts.grad(lambda x, w: cnp.sum(cnp.matmul(x, w) * c), argnums=(0, 1))(X, W)
        assert not np.array_equal(np.asarray(fx), np.asarray(gx))
        assert not np.array_equal(np.asarray(fw), np.asarray(gw))


@pytest.mark.parametrize("mode", ["tensorfloat32", "bfloat16"])
def test_gradient_precision_is_fixed_when_the_forward_runs(mode):
    """The precision a product was called with (here from a default_matmul_precision block
    around the forward only) is its gradient's, though the backward pass runs after the block."""
    x, w, c = exact_data((6, 10), 10), exact_data((10, 4), 11), exact_data((6, 4), 12)

    def loss(x, w):
        with cts.default_matmul_precision(mode):
            y = x @ w
        return cnp.sum(y * c)

    gx, gw = cts.grad(loss, argnums=(0, 1))(cts.device_put(x), cts.device_put(w))
    np.testing.assert_array_equal(np.asarray(gx), product_ref(c, w.T, mode).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(gw), product_ref(x.T, c, mode).astype(np.float32))


@pytest.mark.parametrize("mode", ["tensorfloat32", "bfloat16"])
def test_checkpoint_reruns_with_the_forward_precision(mode):
    """A checkpointed block runs again during the backward pass, after the
    default_matmul_precision block around its first run has closed: the second run uses the
    first run's default, so the gradients are those without checkpoint, bit for bit."""
    x, w1, w2 = exact_data((6, 10), 30), exact_data((10, 8), 31), exact_data((8, 4), 32)
    block = lambda x, w1, w2: cnp.matmul(cnp.matmul(x, w1), w2)  # noqa: E731

    def loss(ws, remat):
        f = cts.checkpoint(block) if remat else block
        with cts.default_matmul_precision(mode):
            y = f(x, *ws)
        return cnp.sum(y * 0.5)

    ws = (cts.device_put(w1), cts.device_put(w2))
    plain = cts.grad(lambda ws: loss(ws, False))(ws)
    remat = cts.grad(lambda ws: loss(ws, True))(ws)
    for a, b in zip(plain, remat):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
    # and they are the rounded ones: d/dw2 = round(x @ w1 rounded)^T @ round(0.5)
    h = product_ref(x, w1, mode).astype(np.float32)
    check_product(remat[1], h.T, np.full((6, 4), 0.5, np.float32), mode)


@pytest.mark.parametrize("mode", ["tensorfloat32", "bfloat16"])
def test_batched_einsum_and_its_gradients(mode):
    """'bqd,bkd->bqk' (a batched product with a 3-d rhs) and its gradients."""
    q, k, c = exact_data((3, 5, 8), 13), exact_data((3, 7, 8), 14), exact_data((3, 5, 7), 15)
    got = cnp.einsum("bqd,bkd->bqk", q, cts.device_put(k), precision=mode)
    want = np.einsum("bqd,bkd->bqk", round_ref(q, mode).astype(np.float64), round_ref(k, mode))
    np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32))

    def loss(q, k):
        return cnp.sum(cnp.einsum("bqd,bkd->bqk", q, k, precision=mode) * c)

    gq, gk = cts.grad(loss, argnums=(0, 1))(cts.device_put(q), cts.device_put(k))
    rq, rk, rc = (round_ref(v, mode).astype(np.float64) for v in (q, k, c))
    np.testing.assert_array_equal(np.asarray(gq), np.einsum("bqk,bkd->bqd", rc, rk).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(gk), np.einsum("bqk,bqd->bkd", rc, rq).astype(np.float32))
    assert not np.array_equal(np.asarray(gq), np.asarray(
        cts.grad(lambda q, k: cnp.sum(cnp.einsum("bqd,bkd->bqk", q, k) * c))(cts.device_put(q), cts.device_put(k))))


# --- layers ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_dense_precision(mode):
    x, kern, bias = exact_data((4, 6), 16), exact_data((6, 5), 17), exact_data((5,), 18)
    model = nn.Dense(5, precision=mode)
    params = model.init(random.PRNGKey(0), x)["params"]
    assert params["kernel"].shape == (6, 5)
    y = model.apply({"params": {"kernel": kern, "bias": bias}}, x)
    check_product(y, x, kern, mode, add=bias)
    # the gradient's products too
    g = cts.grad(lambda p: cnp.sum(model.apply({"params": p}, x) * x[:, :5]))(
        {"kernel": kern, "bias": bias})
    check_product(g["kernel"], x.T, x[:, :5], mode)
    if mode != "float32":
        assert not np.array_equal(np.asarray(y), np.asarray(
            nn.Dense(5).apply({"params": {"kernel": kern, "bias": bias}}, x)))


@pytest.mark.parametrize("mode", MODES)
def test_dense_general_precision(mode):
    x, kern = exact_data((3, 2, 4), 19), exact_data((2, 4, 5, 2), 20)
    model = nn.DenseGeneral((5, 2), axis=(-2, -1), use_bias=False, precision=mode)
    assert model.init(random.PRNGKey(1), x)["params"]["kernel"].shape == (2, 4, 5, 2)
    y = model.apply({"params": {"kernel": kern}}, x)
    check_product(np.asarray(y).reshape(3, 10), x.reshape(3, 8), kern.reshape(8, 10), mode)


def test_dense_fields_follow_flax():
    flax = pytest.importorskip("flax")
    for ours, theirs in ((nn.Dense, flax.linen.Dense), (nn.DenseGeneral, flax.linen.DenseGeneral)):
        mine = [f for f in ours.__dataclass_fields__ if f not in ("parent", "name")]
        common = [f for f in theirs.__dataclass_fields__ if f in mine]
        assert "precision" in common
        assert [f for f in mine if f in common] == common, ours.__name__
        assert ours.__dataclass_fields__["precision"].default is None


# --- jax -----------------------------------------------------------------------------------------

def test_against_jax_on_cpu():
    """jax's CPU backend ignores ``precision=`` (its docs: "Has no impact on CPU backends"; this
    checks it), so reduced precisions are compared with jax computing on inputs it rounded
    itself (``lax.reduce_precision``), float32 with jax's product directly."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    for mode in ("tensorfloat32", "bfloat16"):
        a, b = biased_data((24, 200), mode, 21), biased_data((200, 16), mode, 22)
        a[::2] *= -1  # both signs
        highest = np.asarray(jnp.matmul(a, b, precision="highest"))
        jax_ignores = all(np.array_equal(np.asarray(jnp.matmul(a, b, precision=p)), highest)
                          for p in ("bfloat16", "tensorfloat32", "default", mode))
        bound = lambda mode: accumulation_bound(a, b, mode)  # noqa: E731
        ours32 = np.asarray(cnp.matmul(a, b, precision="float32"))
        assert np.all(np.abs(ours32.astype(np.float64) - highest) <= 2 * bound("float32"))
        ours = np.asarray(cnp.matmul(a, b, precision=mode)).astype(np.float64)
        if jax_ignores:
            rp = lambda v: jax.lax.reduce_precision(jnp.asarray(v), exponent_bits=8,  # noqa: E731
                                                    mantissa_bits=MANTISSA[mode])
            want = np.asarray(jnp.matmul(rp(a), rp(b), precision="highest"))
        else:  # a jax that honours precision on CPU: compare with it directly
            want = np.asarray(jnp.matmul(a, b, precision=mode))
        assert np.all(np.abs(ours - want) <= 2 * bound(mode)), mode
        assert np.all(np.abs(highest - want) > 4 * bound(mode))  # so skipping the rounding fails the line above
        # einsum and the gradient (whose product rounds the cotangent and b), the same way
        g = cts.grad(lambda a: cnp.sum(cnp.einsum("ij,jk->ik", a, b, precision=mode)))(cts.device_put(a))
        ones = np.ones((24, 16), np.float32)
        if jax_ignores:
            jg = np.asarray(jnp.matmul(rp(ones), rp(b).T, precision="highest"))
        else:
            jg = np.asarray(jax.grad(lambda a: jnp.sum(jnp.einsum("ij,jk->ik", a, b, precision=mode)))(a))
        assert np.all(np.abs(np.asarray(g).astype(np.float64) - jg) <= 2 * accumulation_bound(ones, b.T, mode))


def test_module_doctests():
    import doctest

    import ctrainstate._src.base.precision as mod
    assert doctest.testmod(mod).failed == 0
