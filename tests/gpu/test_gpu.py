"""The CUDA backend: the CPU suites' array checks on GPU devices.

Skipped without a GPU (CI has none); run by benchmarks/gpu_check.sh on a GPU
host, also with CTRAINSTATE_GPU_SPLIT=4 and =8 (logical devices sharing a GPU).
"""
import gc

import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.optim as optim
from ctrainstate import Mesh, NamedSharding, P
from conftest import assert_same_bits

pytestmark = pytest.mark.gpu


def gpus():
    return cts.devices("gpu")


def gpu_mesh(shape, names):
    devs = gpus()
    n = int(np.prod(shape))
    if len(devs) < n:
        pytest.skip(f"needs {n} GPU devices (set CTRAINSTATE_GPU_SPLIT)")
    return Mesh(np.array(devs[:n], dtype=object).reshape(shape), names)


def test_gpu_devices():
    devs = gpus()
    assert devs and all(d.platform == "gpu" for d in devs)
    assert repr(devs[0]).startswith("CudaDevice(id=")
    st = devs[0].memory_stats()
    assert st["bytes_limit"] > 0


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.bool_])
def test_round_trip_single_gpu(dtype):
    x = (np.random.default_rng(0).standard_normal((33, 17)) * 9).astype(dtype)
    a = cts.device_put(x, gpus()[0])
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), x.view(np.uint8))
    xt = x.T  # strided host source
    b = cts.device_put(xt, gpus()[0])
    np.testing.assert_array_equal(np.asarray(b).view(np.uint8),
                                  np.ascontiguousarray(xt).view(np.uint8))


@pytest.mark.parametrize("shape,names,spec", [
    ((2,), ("x",), P("x", None)),
    ((2, 2), ("data", "model"), P("data", "model")),
    ((4,), ("x",), P(None, "x")),
    ((2, 4), ("data", "model"), P(("model", "data"), None)),
])
def test_sharded_round_trip_and_reshard(shape, names, spec):
    m = gpu_mesh(shape, names)
    x = np.random.default_rng(1).standard_normal((16, 32)).astype(np.float32)
    a = cts.device_put(x, NamedSharding(m, spec))
    np.testing.assert_array_equal(np.asarray(a), x)
    b = cts.device_put(a, NamedSharding(m, P()))
    np.testing.assert_array_equal(np.asarray(b), x)
    c = cts.device_put(b, NamedSharding(m, P(None, names[0])))
    np.testing.assert_array_equal(np.asarray(c), x)
    # GPU -> CPU device and back
    cpu = cts.device_put(c, cts.devices("cpu")[0])
    np.testing.assert_array_equal(np.asarray(cpu), x)
    back = cts.device_put(cpu, NamedSharding(m, spec))
    np.testing.assert_array_equal(np.asarray(back), x)


def test_gpu_memory_accounting_and_release():
    d = gpus()[0]
    gc.collect()
    base = d.memory_stats()["bytes_in_use"]
    a = cts.device_put(np.zeros((1024, 1024), np.float32), d)
    assert d.memory_stats()["bytes_in_use"] - base == 4 << 20
    del a
    gc.collect()
    assert d.memory_stats()["bytes_in_use"] == base


def test_gpu_oom_is_resource_exhausted():
    d = gpus()[0]
    limit = d.memory_stats()["bytes_limit"]
    gc.collect()
    base = d.memory_stats()["bytes_in_use"]
    with pytest.raises(cts.ResourceExhaustedError, match=r"CudaDevice\(id=\d+\)"):
        cts._C.Buffer(d.id, (limit // 4 + 1024,), 0)
    assert d.memory_stats()["bytes_in_use"] == base


# --- ops, gradients and init on GPU devices (compared with the CPU backend) ----------------

import ctrainstate.numpy as cnp  # noqa: E402
from ctrainstate import nn, random  # noqa: E402


def _cpu_and_gpu(x, sharding_gpu):
    return cts.device_put(x, cts.devices("cpu")[0]), cts.device_put(x, sharding_gpu)


@pytest.mark.parametrize("op", [cnp.sin, cnp.cos, cnp.tanh, cnp.relu, cnp.gelu, cnp.exp,
                                cnp.square, cnp.sigmoid, lambda v: v * 3.0 - 1.0])
def test_unary_ops_match_cpu(op):
    x = np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32)
    c, g = _cpu_and_gpu(x, gpus()[0])
    np.testing.assert_allclose(np.asarray(op(g)), np.asarray(op(c)), rtol=2e-6, atol=2e-6)


def _ulps32(a, b):
    def o(v):
        i = np.asarray(v, np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    return np.abs(o(a) - o(b))


_EXACT_GPU = ["floor", "ceil", "round", "trunc", "sign"]
_LIBM_GPU = ["log1p", "expm1", "erf", "erfc"]


@pytest.mark.parametrize("name", _EXACT_GPU + _LIBM_GPU)
def test_abi6_unary_ops_match_cpu(name):
    """The ABI 6 kernels on the GPU against the CPU backend: the roundings and sign give the
    same bits (signs of zeros, NaN, halves to even); log1p / expm1 / erf / erfc are each
    backend's libm: CUDA documents log1pf and expm1f within 1 ulp, erff 2 and erfcf 4 of the
    true value, glibc's are within 2 here, so they differ by at most 4 ulp (erfc: 6)."""
    from ctrainstate._src.ops import ops as _ops
    rng = np.random.default_rng(3)
    x = np.r_[rng.uniform(-6, 6, 4000), [0.5, 1.5, 2.5, -0.5, -2.5, 0.0, -0.0, np.nan, np.inf,
                                         -np.inf, 1e-7, -1e-30, 2.0 ** 23 - 0.5]]
    if name == "log1p":
        x = np.where(x < -1, -x, x)
    x = x.astype(np.float32)
    f = getattr(_ops, name)
    c, g = _cpu_and_gpu(x, gpus()[0])
    got, want = np.asarray(f(g)), np.asarray(f(c))
    if name in _EXACT_GPU:
        assert got.tobytes() == want.tobytes(), name
    else:
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert _ulps32(got[~nan], want[~nan]).max() <= (6 if name == "erfc" else 4), name
    # gradients run on the device too. expm1's is jax's g * (expm1(x) + 1): where x << 0,
    # expm1(x) is near -1 (ulp 2^-24) and the + 1 cancels, so the backends' expm1 ulps
    # (CUDA 1, glibc 2) become an absolute difference of up to 3 * 2^-24 in a gradient near 0,
    # which no relative tolerance covers: atol 3 * 2^-23 (3 ulp of 1.0) for expm1 only.
    gg = np.asarray(cts.grad(lambda v: cnp.sum(f(v)))(g))
    gc = np.asarray(cts.grad(lambda v: cnp.sum(f(v)))(c))
    np.testing.assert_allclose(gg, gc, rtol=4e-6, atol=3 * 2.0 ** -23 if name == "expm1" else 1e-30)


_ABI7_LIBM = {  # CUDA's documented ulp bound + glibc's (<= 2 on tests/c/test_ops_math.c's sweep)
    "sinh": 5, "cosh": 4, "tan": 6, "arcsin": 4, "arccos": 4, "arctan": 4, "arcsinh": 5,
    "arccosh": 6, "arctanh": 5, "cbrt": 3, "exp2": 4, "arctan2": 5, "log2": 4, "log10": 4,
    "hypot": 4, "logaddexp": 6, "logaddexp2": 6}
_ABI7_EXACT = ["signbit", "nextafter", "fmod", "ldexp", "copysign", "fmax", "fmin", "heaviside",
               "deg2rad", "rad2deg"]


@pytest.mark.parametrize("name", list(_ABI7_LIBM) + _ABI7_EXACT)
def test_abi7_math_functions_match_cpu(name):
    """The ABI 7 kernels (sinh .. exp2, signbit; atan2, nextafter, fmod, ldexp) and the
    functions composed on them, on a GPU against the CPU backend: the exact ones give the same
    bits; the libm ones (CUDA's device functions, glibc's on the CPU) differ by at most their
    two documented bounds added; gradients run on the device too."""
    rng = np.random.default_rng(7)
    x = np.r_[rng.uniform(-4, 4, 3000), rng.uniform(-0.999, 0.999, 1000),
              [0.0, -0.0, 1.0, -1.0, np.nan, np.inf, -np.inf, 1e-30, 2.5, 88.0]].astype(np.float32)
    y = np.r_[rng.uniform(-3, 3, x.size - 3), [0.0, np.nan, -np.inf]].astype(np.float32)
    if name == "arccosh":
        x = 1.0 + np.abs(x)
    binary = name in ("arctan2", "nextafter", "fmod", "copysign", "fmax", "fmin", "heaviside",
                      "hypot", "logaddexp", "logaddexp2")
    c, g = _cpu_and_gpu(x, gpus()[0])
    cy, gy = _cpu_and_gpu(y, gpus()[0])
    if name == "ldexp":
        e = rng.integers(-140, 140, x.size).astype(np.int32)
        fn = lambda v, w: cnp.ldexp(v, e)       # noqa: E731
    else:
        fn = getattr(cnp, name) if binary else (lambda v, w: getattr(cnp, name)(v))
    got, want = np.asarray(fn(g, gy)), np.asarray(fn(c, cy))
    if name in _ABI7_EXACT:
        assert got.tobytes() == want.tobytes(), name
    else:
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan), name
        d = _ulps32(got[~nan], want[~nan])
        if name in ("logaddexp", "logaddexp2"):
            # max + log1p(exp(-|x - y|)) cancels where the result is near 0: the exp / log1p
            # ulps (the CPU's exp is its own vector kernel) are ulps of max(|x|, |y|) there
            sc = np.maximum(np.abs(x), np.abs(y))[~nan]
            with np.errstate(all="ignore"):
                near = np.abs(got[~nan] - want[~nan]) <= _ABI7_LIBM[name] * np.spacing(sc)
            d = d[~near]
        assert d.size == 0 or d.max() <= _ABI7_LIBM[name], name
    if name in ("signbit", "nextafter"):
        return
    fin = np.isfinite(x) & np.isfinite(y) & (np.abs(x) < 0.99 if name in ("arcsin", "arccos", "arctanh") else True)
    xs, ys = x[fin][:500], y[fin][:500]
    if name == "ldexp":
        es = e[fin][:500]
        fn = lambda v, w: cnp.ldexp(v, es)      # noqa: E731
    c, g = _cpu_and_gpu(xs, gpus()[0])
    cy, gy = _cpu_and_gpu(ys, gpus()[0])
    gg = np.asarray(cts.grad(lambda v: cnp.sum(fn(v, gy)))(g))
    gc = np.asarray(cts.grad(lambda v: cnp.sum(fn(v, cy)))(c))
    np.testing.assert_allclose(gg, gc, rtol=2e-5, atol=1e-6, err_msg=name)


def test_abi6_power_activations_and_at_updates_on_a_split_mesh_match_cpu():
    """Array-exponent power (CT_BIN_POW), the jax.nn activations built on the new kernels, and
    the new .at updates, on GPU meshes, against the CPU backend."""
    mesh = gpu_mesh((len(gpus()),) if len(gpus()) in (1, 2, 4) else (1,), ("m",))
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((8, 16)) * 3).astype(np.float32)
    c, g = _cpu_and_gpu(x, NamedSharding(mesh, P(None, "m")))
    fns = [lambda v: cnp.power(cnp.abs(v), v * 0.5), nn.softplus, nn.log_sigmoid, nn.elu,
           nn.celu, nn.selu, nn.relu6, nn.hard_tanh, nn.hard_sigmoid, nn.hard_silu,
           lambda v: nn.gelu(v, approximate=False), nn.glu, nn.standardize,
           lambda v: cnp.linalg.norm(v, axis=-1)]
    for f in fns:
        np.testing.assert_allclose(np.asarray(f(g)), np.asarray(f(c)), rtol=4e-6, atol=1e-6)
    idx = np.array([1, 1, -1, 9, 3])
    v = rng.standard_normal((5, 16)).astype(np.float32)
    for kind in ("subtract", "min", "max", "mul"):
        a = np.asarray(getattr(g.at[idx], kind)(v))
        b = np.asarray(getattr(c.at[idx], kind)(v))
        assert a.tobytes() == b.tobytes(), kind
    pa = np.asarray(cnp.abs(g).at[idx].power(v))
    pb = np.asarray(cnp.abs(c).at[idx].power(v))
    np.testing.assert_allclose(pa, pb, rtol=4e-6)
    # .apply runs the function once per occurrence of an index: row 1 (twice in idx) becomes
    # expm1(expm1(x)). Rows never indexed keep their bits; rows indexed once differ by the
    # backends' expm1 (a few ulp); on row 1 a relative difference d of y = expm1(x) becomes
    # |y e^y / expm1(y)| d <= (1 + |y|) d in expm1(y) (y is up to ~e^9 here), so its tolerance
    # grows with that amplification.
    ga, ca = np.asarray(g.at[idx].apply(cnp.expm1)), np.asarray(c.at[idx].apply(cnp.expm1))
    once = [3, x.shape[0] - 1]                      # -1; 9 is out of range: dropped
    hit = np.isin(np.arange(x.shape[0]), [1] + once)
    assert ga[~hit].tobytes() == ca[~hit].tobytes()
    np.testing.assert_allclose(ga[once], ca[once], rtol=4e-6, atol=1e-30)
    amp = 1.0 + np.abs(np.expm1(x[1].astype(np.float64)))
    with np.errstate(invalid="ignore"):
        close = np.abs(ga[1].astype(np.float64) - ca[1]) <= 4e-6 * amp * np.abs(ca[1])
    assert np.all(close | (ga[1] == ca[1])), (ga[1], ca[1])


def test_binary_reduce_matmul_match_cpu():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 16, 24)).astype(np.float32)
    b = rng.standard_normal((24, 8)).astype(np.float32)
    bias = rng.standard_normal((8,)).astype(np.float32)
    d = gpus()[0]
    ga, gb, gbias = (cts.device_put(v, d) for v in (a, b, bias))
    y = cnp.matmul(ga, gb) + gbias
    ref = np.einsum("bij,jk->bik", a.astype(np.float64), b) + bias
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)
    for axis in (None, 0, (0, 2), -1):
        np.testing.assert_allclose(np.asarray(cnp.sum(ga, axis=axis)), a.astype(np.float64).sum(axis=axis),
                                   rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(cnp.transpose(ga, (2, 0, 1))), np.transpose(a, (2, 0, 1)))
    # max: exact; (0, 2) and -1 walk the general kernel, a long trailing row the CTA-per-row one
    a[1, 3, 5] = np.nan
    ga = cts.device_put(a, d)
    for axis in (None, 0, (0, 2), -1):
        np.testing.assert_array_equal(np.asarray(cnp.max(ga, axis=axis)), np.max(a, axis=axis))
        np.testing.assert_array_equal(np.asarray(cnp.min(ga, axis=axis)), np.min(a, axis=axis))
    long = rng.standard_normal((5, 1000)).astype(np.float32)
    long[2, 999] = np.inf
    long[3, 17] = np.nan
    np.testing.assert_array_equal(np.asarray(cnp.max(cts.device_put(long, d), axis=1)), long.max(axis=1))


def test_softmax_cross_entropy_on_a_split_vocab_match_cpu():
    """log_softmax and the integer-label cross-entropy with the class axis sharded over GPU
    devices (the max and the sum end in all-reduces), values and gradients against the CPU."""
    from ctrainstate import optim
    g = gpus()
    n = min(4, len(g))
    m = gpu_mesh((n,), ("model",))
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 8 * n)) * 30).astype(np.float32)
    lab = rng.integers(0, 8 * n, 6)
    xs = cts.device_put(x, cts.NamedSharding(m, cts.P(None, "model")))
    xc = cts.device_put(x, cts.devices("cpu")[0])

    def loss(v):
        return cnp.mean(optim.softmax_cross_entropy_with_integer_labels(v, lab))
    lg, gg = cts.value_and_grad(loss)(xs)
    lc, gc_ = cts.value_and_grad(loss)(xc)
    np.testing.assert_allclose(float(np.asarray(lg)), float(np.asarray(lc)), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gg), np.asarray(gc_), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(nn.log_softmax(xs)), np.asarray(nn.log_softmax(xc)),
                               rtol=1e-5, atol=1e-5)


# --- matmul precisions (cublasGemmEx, FAST_TF32 / FAST_16BF) ---------------------------------

_MANTISSA = {"tensorfloat32": 10, "bfloat16": 7}


def _emulated_cublas():
    """Under tools/mock_gpu.sh or tools/cuda_emu.sh (CTRAINSTATE_CUDA_BACKEND names their
    mock_backend.so / cuda_backend_emu.so): both round the inputs exactly as the CPU backend
    does (core/ct_prec_math.h). A real GPU's tensor cores convert float32 inputs in a way
    cuBLAS does not document (nearest or truncation; and FAST_16BF allows TF32 instead of
    bfloat16), so there only bounds are checked. ctrainstate._src.base.devices sets
    CTRAINSTATE_CUDA_BACKEND itself to the package's own _cuda_backend*.so: that one is the
    real backend, not an emulation."""
    import glob
    import os
    path = os.environ.get("CTRAINSTATE_CUDA_BACKEND")
    if not path:
        return False
    own = glob.glob(os.path.join(os.path.dirname(cts.__file__), "_cuda_backend*.so"))
    real = os.path.basename(path).startswith("_cuda_backend") or any(
        os.path.realpath(path) == os.path.realpath(o) for o in own)
    return not real


def _int_plus_tiny(shape, seed):
    """Integers 1..8 (either sign) plus 2^-13, which TF32 and bfloat16 round away (nearest):
    rounded products are small integers, the same float32 bits in any summation order."""
    rng = np.random.default_rng(seed)
    n = rng.integers(1, 9, shape) * rng.choice([-1, 1], shape)
    return (n + rng.choice([-1, 1], shape) * 2.0 ** -13).astype(np.float32)


@pytest.mark.parametrize("mode", ["tensorfloat32", "bfloat16"])
def test_matmul_precision_on_gpu(mode):
    mb = _MANTISSA[mode]
    rng = np.random.default_rng(7)
    a = rng.standard_normal((64, 256)).astype(np.float32)
    b = rng.standard_normal((256, 48)).astype(np.float32)
    d = gpus()[0]
    ga, gb = cts.device_put(a, d), cts.device_put(b, d)
    got = np.asarray(cnp.matmul(ga, gb, precision=mode)).astype(np.float64)
    f32 = np.asarray(cnp.matmul(ga, gb)).astype(np.float64)
    exact = a.astype(np.float64) @ b
    mag = np.abs(a).astype(np.float64) @ np.abs(b)
    acc = 2 * 256 * 2.0 ** -24 * mag
    # each input off by at most one ulp of the format relative (truncation included)
    assert np.all(np.abs(got - exact) <= (2 * 2.0 ** -mb + 2.0 ** (-2 * mb)) * mag + acc)
    assert np.all(np.abs(f32 - exact) <= acc)
    # and a reduced precision is in effect: float32 is far closer
    assert np.median(np.abs(got - exact)) > 20 * np.median(np.abs(f32 - exact)), \
        f"precision={mode!r} on GPU gave float32-like results"
    cpu = cts.devices("cpu")[0]
    on_cpu = np.asarray(cnp.matmul(cts.device_put(a, cpu), cts.device_put(b, cpu), precision=mode))
    if _emulated_cublas():  # the same rounded inputs: the CPU's result up to summation order
        assert np.all(np.abs(got - on_cpu) <= acc)
    # one product per element: the rounded elements themselves
    x = np.concatenate([rng.standard_normal(500).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 500),
                        np.array([np.nan, np.inf, -np.inf, 0.0, 1 + 2.0 ** -(mb + 1), 2.0 ** -140,
                                  np.finfo(np.float32).max], np.float32)])
    one = np.ones((1, 1), np.float32)
    col = np.asarray(cnp.matmul(cts.device_put(x[:, None], d), one, precision=mode))[:, 0]
    want = np.asarray(cnp.matmul(cts.device_put(x[:, None], cpu), one, precision=mode))[:, 0]
    if _emulated_cublas():
        np.testing.assert_array_equal(col, want)
    else:
        np.testing.assert_array_equal(np.isnan(col), np.isnan(x))
        assert col[x == np.inf] == np.inf and col[x == -np.inf] == -np.inf
        normal = np.isfinite(x) & (np.abs(x) >= 2.0 ** -126) & (np.abs(x) < 2.0 ** 127)
        assert np.all(np.abs(col[normal].astype(np.float64) - x[normal]) <= 2.0 ** -mb * np.abs(x[normal]))


@pytest.mark.parametrize("shape", [(1,), (2,), (4,)])
@pytest.mark.parametrize("mode", ["float32", "tensorfloat32", "bfloat16"])
def test_sharded_matmul_precision_and_gradients_on_gpu(mode, shape):
    """K sharded over the mesh (partial products all-reduced) and the gradients' products, with
    a precision, compared with CPU devices: bit-equal on the emulations (the rounded inputs are
    small integers), within the format's bound on a GPU."""
    m = gpu_mesh(shape, ("model",))
    x, w, c = _int_plus_tiny((8, 32), 1), _int_plus_tiny((32, 12), 2), _int_plus_tiny((8, 12), 3)

    def loss(x, w):
        return cnp.sum(cnp.matmul(x, w, precision=mode) * c)

    cpu = cts.devices("cpu")[0]
    X = cts.device_put(x, NamedSharding(m, P(None, "model")))
    W = cts.device_put(w, NamedSharding(m, P("model", None)))
    y = np.asarray(cnp.matmul(X, W, precision=mode))
    gx, gw = cts.grad(loss, argnums=(0, 1))(X, W)
    y_c = np.asarray(cnp.matmul(cts.device_put(x, cpu), cts.device_put(w, cpu), precision=mode))
    gx_c, gw_c = cts.grad(loss, argnums=(0, 1))(cts.device_put(x, cpu), cts.device_put(w, cpu))
    mb = _MANTISSA.get(mode, 23)
    for got, want, (p, q) in ((y, y_c, (x, w)), (gx, gx_c, (c, w.T)), (gw, gw_c, (x.T, c))):
        got, want = np.asarray(got), np.asarray(want)
        mag = np.abs(p).astype(np.float64) @ np.abs(q)
        if _emulated_cublas() and mode != "float32":
            np.testing.assert_array_equal(got, want)
        else:
            assert np.all(np.abs(got - want) <= (4 * 2.0 ** -mb + 64 * 2.0 ** -24) * mag)


def _emu_nccl_stats():
    """(communicators created, collectives run) of the emulated NCCL (tools/cuda_emu.sh), or
    None elsewhere."""
    import ctypes
    import os
    path = os.environ.get("CTRAINSTATE_CUDA_BACKEND")
    lib = ctypes.CDLL(path) if path else None
    if lib is None or not hasattr(lib, "cuda_emu_nccl_stats"):
        return None
    out = (ctypes.c_longlong * 2)()
    lib.cuda_emu_nccl_stats(out)
    return tuple(out)


@pytest.mark.parametrize("op", [0, 1], ids=["sum", "max"])
def test_allreduce_over_every_group_shape(op):
    """The all-reduce (sum, and max) of a mesh axis: within one GPU by the device-copy kernel,
    across GPUs through NCCL (one rank per GPU, the logical devices of each GPU combined
    first, then given their rank's result), for groups of every size, on every split."""
    g = gpus()
    if len(g) < 2:
        pytest.skip("needs 2 GPU devices (set CTRAINSTATE_GPU_SPLIT)")
    rng = np.random.default_rng(11)
    code = cts._src.base.dtypes.code(np.dtype(np.float32))
    shape = (37, 5)
    # all devices; the first two; every other one (a strided mesh axis); the last three
    groups = [list(range(len(g))), [0, 1], list(range(0, len(g), 2)), list(range(len(g)))[-3:]]
    before = _emu_nccl_stats()
    for idx in groups:
        if len(idx) < 2:
            continue
        xs = [rng.standard_normal(shape).astype(np.float32) for _ in idx]
        bufs = []
        for i, x in zip(idx, xs):
            b = cts._C.Buffer(g[i].id, shape, code)
            cts._C.copy_from_host(b, x, (0, 0))
            bufs.append(b)
        cts._C.op_allreduce([bufs], op)
        want = np.sum(np.stack(xs).astype(np.float64), axis=0) if op == 0 else np.max(np.stack(xs), axis=0)
        for i, b in zip(idx, bufs):
            got = np.empty(shape, np.float32)
            cts._C.copy_to_host(b, got, (0, 0))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"group {idx}, device {i}")
    after = _emu_nccl_stats()
    if before is not None:  # the emulated runtime: NCCL ran exactly for the groups spanning GPUs
        import os
        ngpu = int(os.environ.get("CT_EMU_NGPU", "1"))
        split = len(g) // ngpu
        spans = sum(1 for idx in groups if len(idx) >= 2 and len({i // split for i in idx}) > 1)
        assert after[1] - before[1] == spans, (before, after, spans)


def test_gpu_shard_data_is_a_view_that_cannot_be_donated():
    """A GPU Shard.data is a single-device Array over the shard's own buffer (np.asarray and
    DLPack work on it, as on jax's); it cannot be donated (updated in place), and deleting it
    leaves the parent intact."""
    from ctrainstate.train_state import TrainState
    g = gpus()
    m = gpu_mesh((min(2, len(g)),), ("x",))
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    a = cts.device_put(x, NamedSharding(m, P("x")))
    sh = a.addressable_shards[-1]
    np.testing.assert_array_equal(np.asarray(sh.data), x[sh.index])
    assert sh.data.devices() == {sh.device}
    v = sh.data
    with pytest.raises(ValueError, match="view of another Array"):
        TrainState.create(apply_fn=None, params={"w": v}, tx=optim.sgd(0.1)).apply_gradients(
            grads={"w": cts.device_put(np.ones(v.shape, np.float32), sh.device)})
    # a view as optimizer state: refused before the kernel runs, params and state unchanged
    params = {"w": cts.device_put(np.ones(v.shape, np.float32), sh.device)}
    s = TrainState.create(apply_fn=None, params=params, tx=optim.sgd(0.1, momentum=0.9))
    tr = cts.device_put(np.full(v.shape, 5.0, np.float32), sh.device)   # parent of the view
    view = tr.addressable_shards[0].data
    s = s.replace(opt_state=(optim.TraceState(trace={"w": view}),) + tuple(s.opt_state[1:]))
    gw = cts.device_put(np.ones(v.shape, np.float32), sh.device)
    with pytest.raises(ValueError, match="view of another Array"):
        s.apply_gradients(grads={"w": gw})
    np.testing.assert_array_equal(np.asarray(s.params["w"]), 1.0)
    np.testing.assert_array_equal(np.asarray(tr), 5.0)
    assert not s.params["w"].is_deleted() and not view.is_deleted()
    # a view as a counter (written after the kernel): not written in place, so nothing is
    # left half done; the step goes through with the new count in a new Array
    s = TrainState.create(apply_fn=None, params=params, tx=optim.adam(0.1))
    s = s.apply_gradients(grads={"w": gw})
    cpar = cts.device_put(np.int32(7), NamedSharding(m, P()))   # replicated 0-d
    cview = cpar.addressable_shards[0].data                      # a view of replica 0
    assert cview._base is cpar and cview.shape == ()
    s = s.replace(opt_state=(s.opt_state[0]._replace(count=cview),) + tuple(s.opt_state[1:]))
    w0 = np.asarray(s.params["w"]).copy()
    s2 = s.apply_gradients(grads={"w": gw})
    assert int(np.asarray(s2.opt_state[0].count)) == 8
    for shard in cpar.addressable_shards:                     # the parent was not written
        assert int(np.asarray(shard.data)) == 7
    assert not cview.is_deleted() and s.params["w"].is_deleted()
    assert not np.array_equal(np.asarray(s2.params["w"]), w0)
    v.delete()
    np.testing.assert_array_equal(np.asarray(a), x)   # the parent still has its buffer


@pytest.mark.parametrize("strided", [False, True])
def test_copy_between_devices_waits_for_the_source(strided):
    """A device-to-device copy is queued on the destination's stream and must wait for the
    work still queued on the source's (the emulated runtime of tools/cuda_emu.sh runs queued
    work as late as it may, so a missing wait reads the fresh buffer's garbage)."""
    g = gpus()
    if len(g) < 2:
        pytest.skip("needs 2 GPU devices (set CTRAINSTATE_GPU_SPLIT)")
    x = np.random.default_rng(7).standard_normal((48, 40)).astype(np.float32)
    y = cnp.tanh(cts.device_put(x, g[0])) * 3.0 - 1.0   # queued on device 0
    if strided:
        y = cnp.transpose(y, (1, 0))
    z = cts.device_put(y, g[1])                           # read first: device 1's stream
    got = np.asarray(z)
    np.testing.assert_array_equal(got, np.asarray(y))
    want = np.tanh(x.astype(np.float64)) * 3.0 - 1.0
    np.testing.assert_allclose(got, want.T if strided else want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (2, 2)])
def test_tensor_parallel_gradients_equal_cpu(shape):
    m = gpu_mesh(shape, ("data", "model"))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    w1 = rng.standard_normal((16, 32)).astype(np.float32)
    w2 = rng.standard_normal((32, 4)).astype(np.float32)

    def loss(p, x):
        return cnp.mean(cnp.square(cnp.gelu(x @ p[0]) @ p[1]))

    v_cpu, g_cpu = cts.value_and_grad(loss)((cts.device_put(w1, cts.devices("cpu")[0]),
                                             cts.device_put(w2, cts.devices("cpu")[0])),
                                            cts.device_put(x, cts.devices("cpu")[0]))
    W1 = cts.device_put(w1, NamedSharding(m, P(None, "model")))
    W2 = cts.device_put(w2, NamedSharding(m, P("model", None)))
    X = cts.device_put(x, NamedSharding(m, P("data", None)))
    v, (g1, g2) = cts.value_and_grad(loss)((W1, W2), X)
    assert abs(float(v) - float(v_cpu)) <= 1e-5 * abs(float(v_cpu))
    for got, ref in ((g1, g_cpu[0]), (g2, g_cpu[1])):
        ref = np.asarray(ref)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_sharded_init_on_gpu_is_bit_identical_to_cpu():
    m = gpu_mesh((len(gpus()),), ("x",)) if len(gpus()) in (1, 2, 4, 8) else gpu_mesh((1,), ("x",))
    k = random.PRNGKey(3)
    s = NamedSharding(m, P(None, "x"))
    g = random.normal(k, (16, 64), out_sharding=s)
    c = random.normal(k, (16, 64))
    np.testing.assert_array_equal(np.asarray(g), c)
    w = nn.initializers.lecun_normal()(k, (16, 64), out_sharding=s)
    np.testing.assert_array_equal(np.asarray(w), nn.initializers.lecun_normal()(k, (16, 64)))


def test_dlpack_with_torch_cuda_when_installed():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    d = gpus()[0]
    x = np.random.default_rng(5).standard_normal((7, 9)).astype(np.float32)
    a = cts.device_put(x, d)
    t = torch.from_dlpack(a.addressable_shards[0].data)  # zero copy
    assert t.is_cuda and torch.equal(t.cpu(), torch.from_numpy(x))
    g = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4) * 2
    b = cts.from_dlpack(g)  # grads computed by another framework, device to device
    assert b.addressable_shards[0].device.platform == "gpu"
    np.testing.assert_array_equal(np.asarray(b), (np.arange(12).reshape(3, 4) * 2).astype(np.float32))


# --- fused optimizer on GPU devices (csrc/backend/cuda/cuda_optim.cu) ----------------------------

def _opt_tree(rng):
    # odd sizes: float4 bodies with scalar tails, a leaf smaller than a float4, a multi-tile leaf
    return {"w": rng.standard_normal((37, 129)).astype(np.float32),
            "b": rng.standard_normal((3,)).astype(np.float32),
            "e": rng.standard_normal((64, 300)).astype(np.float32)}


_OPT_CASES = {
    "adam": lambda: optim.adam(1e-2),
    "adamw": lambda: optim.adamw(1e-2, weight_decay=0.1),
    "adam_nesterov": lambda: optim.adam(1e-2, nesterov=True),
    "sgd_momentum": lambda: optim.sgd(1e-2, momentum=0.9),
    "sgd_nesterov": lambda: optim.sgd(1e-2, momentum=0.9, nesterov=True),
    "lion": lambda: optim.lion(1e-3),
    "rmsprop": lambda: optim.rmsprop(1e-3),
    "adagrad": lambda: optim.adagrad(1e-2),
    "clip_adamw": lambda: _chain_clip(optim.adamw(1e-2)),
    "clip_sgd": lambda: _chain_clip(optim.sgd(1e-2, momentum=0.9)),
    "adabelief": lambda: optim.adabelief(1e-2, nesterov=True),
    "yogi": lambda: optim.yogi(1e-2),
    "adamax": lambda: optim.adamax(1e-2),
    "amsgrad": lambda: optim.amsgrad(1e-2),
    "radam": lambda: optim.radam(1e-2),           # crosses its threshold at step 6
    "rmsprop_centered": lambda: optim.rmsprop(1e-3, centered=True, bias_correction=True,
                                              initial_scale=0.1),
    "multisteps_adamw": lambda: optim.MultiSteps(optim.adamw(1e-2), 3).gradient_transformation(),
    "partition_frozen": lambda: optim.partition(
        {"train": optim.adam(1e-2), "frozen": optim.set_to_zero()},
        {"w": "train", "b": "frozen", "e": "train"}),
    "lamb": lambda: optim.lamb(1e-2, weight_decay=0.01),
    "lars": lambda: optim.lars(0.1, weight_decay=1e-3),
    "fromage": lambda: optim.fromage(1e-2),
    "clip_lamb": lambda: _chain_clip(optim.lamb(1e-2)),
    "block_param_rms": lambda: optim.chain(optim.clip_by_block_rms(0.5),
                                           optim.scale_by_param_block_rms(1e-3),
                                           optim.scale(-1e-2)),
    "inject_adamw": lambda: optim.inject_hyperparams(optim.adamw)(
        learning_rate=optim.linear_schedule(1e-2, 1e-3, 20)),
    # a global norm and a finite gate inside masks: they cover their own leaves only
    "partition_clip": lambda: optim.partition(
        {"train": _chain_clip(optim.sgd(1e-2)), "frozen": optim.set_to_zero()},
        lambda t: {k: "frozen" if k == "e" else "train" for k in t}),
    "masked_finite_clip": lambda: optim.masked(
        optim.apply_if_finite(_chain_clip(optim.adamw(1e-2)), 3),
        lambda t: {k: k != "b" for k in t}),
}


def _chain_clip(tx):
    return optim.chain(optim.clip_by_global_norm(1.0), tx)


def _run_steps(tx, params, grads_seq, sharding):
    from ctrainstate.train_state import TrainState
    p = cts.device_put(params, sharding)
    s = TrainState.create(apply_fn=None, params=p, tx=tx)
    for g in grads_seq:
        s = s.apply_gradients(grads=cts.device_put(g, sharding))
    return ({k: np.asarray(v) for k, v in s.params.items()},
            [np.asarray(x) for x in cts.tree_util.tree_leaves(s.opt_state)])


def _cpu_vs_gpu(name, gpu_sharding, cpu_sharding):
    rng = np.random.default_rng(3)
    params = _opt_tree(rng)
    grads_seq = [{k: (rng.standard_normal(v.shape) * 3).astype(np.float32) for k, v in params.items()}
                 for _ in range(20)]
    ref_p, ref_s = _run_steps(_OPT_CASES[name](), params, grads_seq, cpu_sharding)
    got_p, got_s = _run_steps(_OPT_CASES[name](), params, grads_seq, gpu_sharding)
    for k in params:
        np.testing.assert_allclose(got_p[k], ref_p[k], rtol=1e-6, atol=1e-7, err_msg=f"{name}: {k}")
    assert len(got_s) == len(ref_s)
    for a, b in zip(got_s, ref_s):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=f"{name}: state")


@pytest.mark.parametrize("name", sorted(_OPT_CASES))
def test_optim_single_gpu_matches_cpu(name):
    _cpu_vs_gpu(name, gpus()[0], cts.devices("cpu")[0])


@pytest.mark.parametrize("name", ["adamw", "clip_adamw", "lion", "clip_sgd", "lamb", "clip_lamb"])
def test_optim_split_mesh_matches_cpu(name):
    m = gpu_mesh((2, 2), ("data", "model"))
    cpu = cts.devices("cpu")
    if len(cpu) < 4:
        pytest.skip("needs 4 CPU devices")
    cm = Mesh(np.array(cpu[:4], dtype=object).reshape(2, 2), ("data", "model"))
    # w sharded over model (replicated over data: replicas must not double-count the norm)
    spec = P(None, "model")
    rng = np.random.default_rng(5)
    params = {"w": rng.standard_normal((16, 64)).astype(np.float32),
              "e": rng.standard_normal((40, 36)).astype(np.float32)}
    grads_seq = [{k: (rng.standard_normal(v.shape) * 3).astype(np.float32) for k, v in params.items()}
                 for _ in range(20)]
    ref_p, ref_s = _run_steps(_OPT_CASES[name](), params, grads_seq, NamedSharding(cm, spec))
    got_p, got_s = _run_steps(_OPT_CASES[name](), params, grads_seq, NamedSharding(m, spec))
    for k in params:
        np.testing.assert_allclose(got_p[k], ref_p[k], rtol=1e-6, atol=1e-7, err_msg=f"{name}: {k}")
    for a, b in zip(got_s, ref_s):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


_ADA_SHAPES = {"w2": (8, 12), "w2t": (6, 20), "w4": (3, 16, 5, 12), "wq": (10, 6, 4, 2),
               "wl": (4, 520), "wt": (300, 6), "b": (5,), "s": (3, 3)}


def _ada_layouts():
    """(mesh shape, axis names, spec per leaf): factored dims sharded or not, replicas."""
    return [((1,), ("x",), {}),
            ((2,), ("x",), {"w2": P("x"), "w2t": P(None, "x"), "w4": P(None, "x"), "wq": P("x"),
                            "wl": P(None, "x"), "wt": P("x")}),
            ((2, 2), ("x", "y"), {"w2": P("x", "y"), "w2t": P("y"), "w4": P(None, "x", None, "y"),
                                  "wq": P("y", "x"), "wt": P(("x", "y"))})]


def _ada_chains():
    return {
        "adafactor": lambda: optim.adafactor(1e-2, min_dim_size_to_factor=4),
        "clip_adafactor": lambda: optim.chain(optim.clip_by_global_norm(0.5),
                                              optim.adafactor(1e-2, min_dim_size_to_factor=4)),
        "adafactor_momentum": lambda: optim.adafactor(1e-2, min_dim_size_to_factor=4,
                                                      momentum=0.9, decay_rate=0.7),
    }


@pytest.mark.parametrize("chain", sorted(_ada_chains()))
@pytest.mark.parametrize("layout", [0, 1, 2])
def test_adafactor_on_gpu_matches_cpu(chain, layout, monkeypatch):
    """Adafactor's factored second moments on GPU devices: a statistics pass per device, the
    CPU driver's combine step on the host, the factors multiplied in by the fused pass.
    Factored leaves of rank 2 and 4 (dims between, before and after the factored ones, row
    dim first or second), sharded along either factored dim or replicated, plus leaves that
    are not factored; against the CPU devices of the same layout. With
    CTRAINSTATE_STAGE_FACTORED=1 the step goes through host staging (the CPU driver): equal
    bit for bit."""
    mshape, names, specs = _ada_layouts()[layout]
    gmesh = gpu_mesh(mshape, names)
    ndev = int(np.prod(mshape))
    if cts.device_count("cpu") < ndev:
        pytest.skip(f"needs {ndev} CPU devices")
    cmesh = Mesh(np.array(cts.devices("cpu")[:ndev], dtype=object).reshape(mshape), names)
    rng = np.random.default_rng(4)
    params = {k: rng.standard_normal(v).astype(np.float32) for k, v in _ADA_SHAPES.items()}
    grads = [{k: (rng.standard_normal(v.shape) * (1 + i)).astype(np.float32) for k, v in params.items()}
             for i in range(4)]
    tx = _ada_chains()[chain]
    gsh = {k: NamedSharding(gmesh, specs.get(k, P())) for k in params}
    csh = {k: NamedSharding(cmesh, specs.get(k, P())) for k in params}
    ref_p, ref_s = _run_steps(tx(), params, grads, csh)
    got_p, got_s = _run_steps(tx(), params, grads, gsh)
    for k in params:
        np.testing.assert_allclose(got_p[k], ref_p[k], rtol=1e-6, atol=1e-7, err_msg=f"{chain}: {k}")
    assert len(got_s) == len(ref_s)
    for a, b in zip(got_s, ref_s):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=f"{chain}: state")
    monkeypatch.setenv("CTRAINSTATE_STAGE_FACTORED", "1")
    st_p, st_s = _run_steps(tx(), params, grads, gsh)
    for k in params:
        np.testing.assert_array_equal(st_p[k], ref_p[k])
    for a, b in zip(st_s, ref_s):
        np.testing.assert_array_equal(a, b)


def test_optim_gpu_state_creation_and_apply_updates():
    p = cts.device_put({"w": np.full((5, 7), 2.0, np.float32)}, gpus()[0])
    st = optim.adagrad(1e-2, initial_accumulator_value=0.25).init(p)
    leaves = [np.asarray(x) for x in cts.tree_util.tree_leaves(st)]
    assert any(x.shape == (5, 7) and (x == 0.25).all() for x in leaves)
    c = optim.base.copy_array(p["w"])
    np.testing.assert_array_equal(np.asarray(c), np.full((5, 7), 2.0, np.float32))
    u = optim.apply_updates(p, {"w": cts.device_put(np.full((5, 7), 0.5, np.float32), gpus()[0])})
    np.testing.assert_array_equal(np.asarray(u["w"]), np.full((5, 7), 2.5, np.float32))


def test_optim_gpu_apply_if_finite_matches_cpu():
    rng = np.random.default_rng(9)
    params = _opt_tree(rng)
    grads_seq = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
                 for _ in range(8)]
    grads_seq[3]["w"][2, 5] = np.nan  # this step is rejected: zero update, inner state kept
    make = lambda: optim.apply_if_finite(optim.chain(optim.clip_by_global_norm(1.0),  # noqa: E731
                                                     optim.adamw(1e-2)), 3)
    ref_p, ref_s = _run_steps(make(), params, grads_seq, cts.devices("cpu")[0])
    got_p, got_s = _run_steps(make(), params, grads_seq, gpus()[0])
    for k in params:
        np.testing.assert_allclose(got_p[k], ref_p[k], rtol=1e-6, atol=1e-7, err_msg=k)
    for a, b in zip(got_s, ref_s):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_optim_gpu_functional_update_matches_cpu():
    # tx.update writes the updates to new buffers (emit mode) instead of p += u
    rng = np.random.default_rng(11)
    params = _opt_tree(rng)
    grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
    out = []
    for dev in (cts.devices("cpu")[0], gpus()[0]):
        tx = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2))
        p = cts.device_put(params, dev)
        st = tx.init(p)
        u, st = tx.update(cts.device_put(grads, dev), st, p)
        out.append(({k: np.asarray(v) for k, v in u.items()},
                    [np.asarray(x) for x in cts.tree_util.tree_leaves(st)]))
    for k in params:
        np.testing.assert_allclose(out[1][0][k], out[0][0][k], rtol=1e-6, atol=1e-7, err_msg=k)
    for a, b in zip(out[1][1], out[0][1]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# --- random numbers generated on the GPU (csrc/backend/cuda/cuda_random.cu) ----------------

_RAND_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]


def _sampler(name, dt):
    """(k, shape, out_sharding) -> sample, for every jax.random sampler the kernel has."""
    return {
        "normal": lambda k, sh, s: random.normal(k, sh, dt, out_sharding=s),
        "uniform": lambda k, sh, s: random.uniform(k, sh, dt, -2.5, 3.0, out_sharding=s),
        "truncated_normal": lambda k, sh, s: random.truncated_normal(k, -1.5, 2.0, sh, dt,
                                                                      out_sharding=s),
        "bernoulli": lambda k, sh, s: random.bernoulli(k, np.dtype(dt).type(0.3), sh,
                                                       out_sharding=s),
        # a host fill per device block, copied over (no kernel)
        "bernoulli_high": lambda k, sh, s: random.bernoulli(k, np.dtype(dt).type(1e-3), sh,
                                                            mode="high", out_sharding=s),
    }[name]


def _gpu_shardings():
    """(mesh shape, axis names, spec) for the GPU devices present (split ones included)."""
    n = len(gpus())
    out = [((1,), ("x",), P()), ((1,), ("x",), P("x"))]
    for k in (2, 4, 8):
        if n >= k:
            out += [((k,), ("x",), P("x")), ((k,), ("x",), P(None, "x")),
                    ((2, k // 2), ("a", "b"), P("a", "b")), ((2, k // 2), ("a", "b"), P("b", "a"))]
    return out


def test_gpu_buffers_are_filled_on_the_device():
    buf = cts._C.Buffer(gpus()[0].id, (8,), cts._src.base.dtypes.code(np.float32))
    assert cts._C.random_on_device(buf)


@pytest.mark.parametrize("name", ["normal", "uniform", "truncated_normal", "bernoulli",
                                  "bernoulli_high"])
@pytest.mark.parametrize("dt", _RAND_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(64, 48), (16, 40, 24), (8, 1027), (8216,)])
def test_random_on_gpu_is_bit_identical_to_cpu(name, dt, shape):
    k = random.PRNGKey(11)
    f = _sampler(name, dt)
    want = np.asarray(f(k, shape, None))
    for mshape, names, spec in _gpu_shardings():
        spec = P(*tuple(spec)[:len(shape)])
        try:
            s = NamedSharding(gpu_mesh(mshape, names), spec)
            s.shard_shape(shape)
        except ValueError:
            continue  # this shape does not divide over this mesh
        got = np.asarray(f(k, shape, s))
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8),
                                      err_msg=f"{name} {mshape} {spec}")


@pytest.mark.parametrize("dist", [0, 1, 2, 3])
@pytest.mark.parametrize("dt", _RAND_DTYPES, ids=lambda d: np.dtype(d).name)
def test_random_fill_gpu_blocks_past_2_32_and_odd_offsets(dist, dt):
    """Counters past 2^32 (JAX's high word), a strided (column) block, odd sizes."""
    code = cts._src.base.dtypes.code(np.dtype(dt))
    out_dt = np.uint8 if dist == 3 else np.dtype(dt)
    out_code = cts._src.base.dtypes.code(np.bool_) if dist == 3 else code
    cases = [((3, 2 ** 31 + 5), (1, 2 ** 31 - 35), (2, 40)),
             ((5, 77, 13), (1, 3, 2), (3, 70, 11)),
             ((1001,), (0,), (1001,)),
             ((9, 1000), (4, 1), (5, 999))]
    for gshape, start, block in cases:
        args = (0x1234, 0xabcd, gshape, start, dist, code, -1.0, 2.0, -0.5, 1.7, 0.4, None)
        want = np.empty(block, out_dt)
        cts._C.random_fill(want, *args)
        buf = cts._C.Buffer(gpus()[0].id, block, out_code)
        cts._C.random_fill(buf, *args)
        got = np.empty(block, out_dt)
        cts._C.copy_to_host(buf, got, (0,) * len(block))
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8),
                                      err_msg=f"{gshape} {start} {block}")


def test_initializers_on_gpu_are_bit_identical_to_cpu():
    n = len(gpus())
    m = gpu_mesh((2, n // 2), ("a", "b")) if n >= 2 and n % 2 == 0 else gpu_mesh((1,), ("a",))
    spec = P("a", "b") if len(m.axis_names) == 2 else P("a")
    k = random.PRNGKey(5)
    for init in (nn.initializers.lecun_normal(), nn.initializers.xavier_uniform(),
                 nn.initializers.truncated_normal(0.02), nn.initializers.normal(0.1)):
        for dt in _RAND_DTYPES:
            got = init(k, (64, 96), dt, out_sharding=NamedSharding(m, spec))
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                          np.asarray(init(k, (64, 96), dt)).view(np.uint8))


def _mock_stats():
    """(syncs, host->device copies, device->host copies) of the host emulation of the
    backend (tools/mock_gpu.sh), or None on a real GPU."""
    import ctypes
    import os
    path = os.environ.get("CTRAINSTATE_CUDA_BACKEND")
    if not path:
        return None
    lib = ctypes.CDLL(path)
    if not hasattr(lib, "mock_gpu_stats"):
        return None
    out = (ctypes.c_longlong * 3)()
    lib.mock_gpu_stats(out)
    return tuple(out)


def _skip_if_host_norm(name):
    """CTRAINSTATE_HOST_NORM=1 (gpu_check.sh's debugging step) sends clip_by_global_norm's norm
    through the host on purpose: one sync and a reduce pass per step, not the device norm's
    counts these tests pin down."""
    import os
    e = os.environ.get("CTRAINSTATE_HOST_NORM", "")
    if name.startswith("clip") and e not in ("", "0"):
        pytest.skip("CTRAINSTATE_HOST_NORM=1 routes the global norm through the host")


@pytest.mark.parametrize("name", ["adamw", "multisteps_adamw", "inject_adamw", "clip_adamw"])
def test_optim_step_needs_no_host_sync(name):
    """A steady-state GPU step reads its counters from their host copies and writes them with
    a kernel, and clip_by_global_norm's norm stays on the devices: no stream synchronisation
    and no host<->device copy (checked on the emulated backend, which counts them; a real GPU
    has no such counters)."""
    from ctrainstate.train_state import TrainState
    if _mock_stats() is None:
        pytest.skip("counts host synchronisations only on the emulated backend")
    _skip_if_host_norm(name)
    dev = gpus()[0]
    rng = np.random.default_rng(0)
    params = cts.device_put(_opt_tree(rng), dev)
    g = cts.device_put({k: np.ones(v.shape, np.float32) for k, v in _opt_tree(rng).items()}, dev)
    s = TrainState.create(apply_fn=None, params=params, tx=_OPT_CASES[name]())
    s = s.apply_gradients(grads=g)          # first step: the kernel's block list is built
    before = _mock_stats()
    for _ in range(5):
        s = s.apply_gradients(grads=g)
    assert _mock_stats() == before, (before, _mock_stats())
    # the counters are right on the device too
    counts = [x for x in cts.tree_util.tree_leaves(s.opt_state) if np.ndim(x) == 0]
    assert counts and all(int(np.asarray(c)) in (0, 1, 2, 6) for c in counts)


def _emu_launches(part):
    """Kernel launches so far from launch sites in files matching `part`, on the emulated CUDA
    runtime of tools/cuda_emu.sh; None elsewhere."""
    import ctypes
    import os
    path = os.environ.get("CTRAINSTATE_CUDA_BACKEND")
    lib = ctypes.CDLL(path) if path else None
    if lib is None or not hasattr(lib, "cuda_emu_launches"):
        return None
    lib.cuda_emu_launches.restype = ctypes.c_longlong
    return lib.cuda_emu_launches(part.encode())


# optimizer launches (cuda_optim.cu) per device and step: the fused pass, and for a
# device-resident global norm its reduce pass, the sum onto the board and the fetch of the
# norms before the fused pass
_LAUNCHES_PER_DEVICE = {"adamw": 1, "multisteps_adamw": 1, "inject_adamw": 1, "clip_adamw": 4}


@pytest.mark.parametrize("name", sorted(_LAUNCHES_PER_DEVICE))
def test_optim_step_is_one_fused_launch_per_device(name):
    """A steady-state step of an elementwise chain is one kernel launch per device over all
    its leaves (counted by the emulated CUDA runtime, which runs the real launch code)."""
    from ctrainstate.train_state import TrainState
    if _emu_launches("cuda_optim.cu") is None:
        pytest.skip("counts kernel launches only on the emulated CUDA runtime")
    _skip_if_host_norm(name)
    n = min(4, len(gpus()))
    m = gpu_mesh((n,), ("x",))
    rng = np.random.default_rng(0)
    tree = _opt_tree(rng)
    sh = {k: NamedSharding(m, P("x") if v.ndim and v.shape[0] % n == 0 else P())
          for k, v in tree.items()}
    params = cts.device_put(tree, sh)
    g = cts.device_put({k: np.ones(v.shape, np.float32) for k, v in tree.items()}, sh)
    s = TrainState.create(apply_fn=None, params=params, tx=_OPT_CASES[name]())
    s = s.apply_gradients(grads=g)
    before = _emu_launches("cuda_optim.cu")
    steps = 3
    for _ in range(steps):
        s = s.apply_gradients(grads=g)
    assert _emu_launches("cuda_optim.cu") - before == steps * n * _LAUNCHES_PER_DEVICE[name]
    assert len(tree) > 1  # many leaves, still one launch


def _adafactor_waits(nleaves, ndev, steps=3, warmup=4):
    """(host waits, copies host->device from and device->host to pageable memory) of `steps`
    steady-state adafactor steps on `ndev` GPU devices, for a tree of `nleaves` factored 2-d
    leaves (rows sharded) and one leaf that is not factored; and the final params, on the GPU
    devices and on the CPU devices. The first steps fill the backend's caches (descriptor
    tables, statistics and staging buffers), which may wait."""
    from ctrainstate.train_state import TrainState
    m = gpu_mesh((ndev,), ("x",))
    cm = Mesh(np.array(cts.devices("cpu")[:ndev], dtype=object).reshape(ndev), ("x",))
    rng = np.random.default_rng(13)
    tree = {f"w{i:02d}": rng.standard_normal((8, 12 + i)).astype(np.float32)
            for i in range(nleaves)}
    tree["b"] = rng.standard_normal((5,)).astype(np.float32)
    grads = [{k: (rng.standard_normal(v.shape) * (1 + i)).astype(np.float32)
              for k, v in tree.items()} for i in range(warmup + steps)]

    def run(mesh, count):
        sh = {k: NamedSharding(mesh, P("x") if v.ndim == 2 else P()) for k, v in tree.items()}
        tx = optim.adafactor(1e-2, min_dim_size_to_factor=4)
        s = TrainState.create(apply_fn=None, params=cts.device_put(tree, sh), tx=tx)
        gs = [cts.device_put(g, sh) for g in grads]  # placed up front: not counted
        for g in gs[:warmup]:
            s = s.apply_gradients(grads=g)
        before = _mock_stats() if count else None
        for g in gs[warmup:]:
            s = s.apply_gradients(grads=g)
        after = _mock_stats() if count else None
        return s.params, (tuple(a - b for a, b in zip(after, before)) if count else None)

    got, counts = run(m, True)
    ref, _ = run(cm, False)
    return counts, {k: np.asarray(v) for k, v in got.items()}, {k: np.asarray(v) for k, v in ref.items()}


def test_adafactor_step_waits_do_not_grow_with_leaves():
    """Adafactor's FACTORED stage on GPU devices copies v_row / v_col of every factored block
    to the host and the new ones and the factors back in one batch per device and direction
    (ct_backend.copy_segments): a steady-state step waits for each device a fixed number of
    times (the statistics, block RMS and parameter scale passes, and the batch to the host),
    however many leaves it has; no copy from pageable memory, one to it (the statistics).
    Counted on the emulated CUDA runtime (cudaStreamSynchronize, cudaEventSynchronize, copies
    to or from pageable memory); the results equal the CPU devices'."""
    if _emu_launches("cuda_optim.cu") is None:
        pytest.skip("counts the CUDA backend's host waits only on the emulated CUDA runtime")
    ndev = min(4, len(gpus()))
    steps = 3
    few, _, _ = _adafactor_waits(4, ndev, steps)
    many, got, ref = _adafactor_waits(16, ndev, steps)
    assert many == few, (few, many)
    waits, h2d, d2h = many
    assert waits <= steps * ndev * 4 and h2d == 0 and d2h <= steps * ndev, many
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("name", ["clip_adamw", "clip_sgd"])
def test_device_norm_equals_host_norm(name, monkeypatch):
    """clip_by_global_norm with the norm kept on the devices (default) and with the host round
    trip (CTRAINSTATE_HOST_NORM=1) give the same bits (the same sums in the same order)."""
    rng = np.random.default_rng(11)
    params = _opt_tree(rng)
    grads_seq = [{k: (rng.standard_normal(v.shape) * 3).astype(np.float32) for k, v in params.items()}
                 for _ in range(6)]
    dev_p, dev_s = _run_steps(_OPT_CASES[name](), params, grads_seq, gpus()[0])
    monkeypatch.setenv("CTRAINSTATE_HOST_NORM", "1")
    host_p, host_s = _run_steps(_OPT_CASES[name](), params, grads_seq, gpus()[0])
    for k in params:
        np.testing.assert_array_equal(dev_p[k], host_p[k])
    for a, b in zip(dev_s, host_s):
        np.testing.assert_array_equal(a, b)


def test_device_norms_of_train_states_on_other_devices_do_not_mix():
    """Two train states with clip_by_global_norm on other GPU devices (a 2-device mesh, and a
    third device) write the same slots of the norm board (their positions in their groups):
    a step of the second must not overwrite a slot that passes of the first, still queued,
    have to read. Device 1 is kept busy (matmuls queued before each step of the first) so the
    first state's passes lag behind the second's. The emulated backend runs serially; a GPU
    split into logical devices (CTRAINSTATE_GPU_SPLIT) checks it for real."""
    from ctrainstate.train_state import TrainState
    m = gpu_mesh((2,), ("data",))
    g = gpus()
    if len(g) < 3:
        pytest.skip("needs 3 GPU devices (set CTRAINSTATE_GPU_SPLIT)")
    cpu = cts.devices("cpu")[0]
    rng = np.random.default_rng(12)
    pa = {"w": rng.standard_normal((64, 32)).astype(np.float32)}
    pb = {"w": rng.standard_normal((16,)).astype(np.float32)}
    ga = [{"w": (rng.standard_normal((64, 32)) * 3).astype(np.float32)} for _ in range(6)]
    gb = [{"w": (rng.standard_normal((16,)) * 30).astype(np.float32)} for _ in range(6)]

    def tx():
        return optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1))
    ref_a, _ = _run_steps(tx(), pa, ga, cpu)
    ref_b, _ = _run_steps(tx(), pb, gb, cpu)
    sh_a = NamedSharding(m, P("data"))
    sa = TrainState.create(apply_fn=None, params=cts.device_put(pa, sh_a), tx=tx())
    sb = TrainState.create(apply_fn=None, params=cts.device_put(pb, g[2]), tx=tx())
    # placed up front: a copy from the host waits for its device's stream
    ga_d = [cts.device_put(x, sh_a) for x in ga]
    gb_d = [cts.device_put(x, g[2]) for x in gb]
    real_gpu = _mock_stats() is None
    busy = cts.device_put(np.full((4096, 4096) if real_gpu else (4, 4), 1e-4, np.float32), g[1])
    for a, b in zip(ga_d, gb_d):
        for _ in range(4):
            busy = busy @ busy
        sa = sa.apply_gradients(grads=a)
        sb = sb.apply_gradients(grads=b)
    np.testing.assert_allclose(np.asarray(sa.params["w"]), ref_a["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sb.params["w"]), ref_b["w"], rtol=1e-5, atol=1e-6)
    assert np.isfinite(np.asarray(busy)).all()


# --- the examples on GPU devices (issue #8: "and on GPUs") -------------------------------------

_ROOT = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.dirname(
    __import__("os").path.abspath(__file__))))

# (args, GPU devices needed, a line the output must contain)
_EXAMPLES = {
    "siren": (["examples/siren.py", "--backend", "gpu", "--mesh", "1x1", "--steps", "40",
               "--size", "16", "--hidden", "32"], 1, "PSNR:"),
    "siren_2x2": (["examples/siren.py", "--backend", "gpu", "--mesh", "2x2", "--steps", "40",
                   "--size", "16", "--hidden", "32"], 4, "PSNR:"),
    "t5x_partitioner": (["examples/t5x_partitioner.py", "--steps", "6", "--layers", "1"], 4,
                        "final loss"),
    "hf_model_parallel": (["examples/hf_model_parallel.py", "--steps", "4", "--layers", "1"], 2,
                          "eval loss"),
    "bloom_sharding": (["examples/bloom_sharding.py"], 4, "values exact: True"),
    "flax_guide_mlp": (["examples/flax_guide_mlp.py", "--depth", "128", "--layers", "2",
                        "--steps", "2"], 8, "shards exactly like the mesh-axis variant: OK"),
    "demo_mesh": (["examples/demo_mesh.py"], 8, "exact: True"),
}


def _run_example(args, backend_env):
    import os
    import subprocess
    import sys
    env = dict(os.environ)
    env.update(backend_env)
    env["PYTHONPATH"] = os.path.join(_ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable] + args, cwd=_ROOT, capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


@pytest.mark.parametrize("name", sorted(_EXAMPLES))
def test_example_runs_on_gpu_devices(name, tmp_path):
    args, need, expect = _EXAMPLES[name]
    if len(gpus()) < need:
        pytest.skip(f"needs {need} GPU devices (set CTRAINSTATE_GPU_SPLIT)")
    if name.startswith("siren"):
        args = args + ["--out", str(tmp_path / "out.png")]
    out = _run_example(args, {})
    assert expect in out
    assert " on gpu" in out or name != "siren", out[-500:]
    if name.startswith("siren"):
        # the same run on CPU devices reaches the same PSNR (to rounding)
        cpu_args = [a if a != "gpu" else "cpu" for a in args]
        cpu = _run_example(cpu_args, {"CTRAINSTATE_NUM_CPU_DEVICES": "4"})
        psnr = [float(o.strip().split("PSNR:")[1].split()[0]) for o in (out, cpu)
                for o in [o.strip().splitlines()[-1]]]
        assert abs(psnr[0] - psnr[1]) < 0.05, psnr


def test_take_rows_on_a_split_vocab_matches_cpu():
    """The embedding lookup's gather and scatter-add kernels, with the table's rows split over
    GPU devices: values bit-identical to the table's rows, gradients bit-identical to the CPU
    backend's (both add the ids' cotangents in id order)."""
    g = gpus()
    n = min(4, len(g))
    m = gpu_mesh((n,), ("model",))
    rng = np.random.default_rng(9)
    table = rng.standard_normal((8 * n, 5)).astype(np.float32)
    ids = rng.integers(0, 8 * n, (3, 7))
    ids[1, :4] = 2
    w = rng.standard_normal((3, 7, 5)).astype(np.float32)
    tg = cts.device_put(table, cts.NamedSharding(m, cts.P("model", None)))
    tc = cts.device_put(table, cts.devices("cpu")[0])
    np.testing.assert_array_equal(np.asarray(cnp.take_rows(tg, ids)), table[ids])
    f = lambda t: cnp.sum(cnp.take_rows(t, ids) * w)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(cts.grad(f)(tg)), np.asarray(cts.grad(f)(tc)))


# --- dtype conversions and 16-bit float ops (test_mixed_precision.py on GPU devices) --------

_NARROW_INTS = [np.uint8, np.int8, np.int16, np.uint16]
_CONVERT_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.uint32,
                   np.bool_] + _NARROW_INTS


@pytest.mark.parametrize("src", _CONVERT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_astype_on_gpu_matches_cpu(src):
    """The CUDA convert kernel gives the CPU kernel's bits for every dtype pair (edges:
    ties, float16 overflow and subnormals, saturation, NaN -> 0, integer wrap)."""
    r = np.random.default_rng(4)
    f = np.concatenate([np.array([0.0, -0.0, 0.5, 1.5, 2.5, -2.7, 6e-8, 65519.9, 65520.0,
                                  3e9, -3e9, 2.0 ** 24 + 1, np.inf, -np.inf, np.nan], np.float32),
                        (r.standard_normal(4000) * 10.0 ** r.integers(-6, 10, 4000)).astype(np.float32)])
    ints = np.concatenate([[0, -1, 2 ** 31 - 1, -(2 ** 31), 2 ** 24 + 3], r.integers(-(2 ** 31), 2 ** 31, 4000)])
    if np.dtype(src) == np.bool_:
        x = r.integers(0, 2, 4005).astype(bool)
    elif np.dtype(src).kind in "iu":
        x = ints.astype(np.int64).astype(src)
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            x = f.astype(src)
    on_gpu = cts.device_put(x, gpus()[0])
    on_cpu = cts.device_put(x, cts.devices("cpu")[0])
    for dst in _CONVERT_DTYPES:
        a, b = np.asarray(on_gpu.astype(dst)), np.asarray(on_cpu.astype(dst))
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_bfloat16_ops_on_a_gpu_mesh_match_cpu():
    """bfloat16 compute (converted, float32 kernels, rounded back) on a GPU mesh gives what a
    CPU mesh of the same shape gives; a gradient through it too."""
    import ctrainstate.numpy as cnp
    m = gpu_mesh((2,), ("x",))
    x = np.random.default_rng(5).standard_normal((8, 16)).astype(ml_dtypes.bfloat16)
    w = np.random.default_rng(6).standard_normal((16, 4)).astype(np.float32)

    def f(xa, wa):
        return cnp.sum(cnp.tanh(cnp.matmul(xa, wa.astype(ml_dtypes.bfloat16)))).astype(np.float32)
    xg = cts.device_put(x, NamedSharding(m, P("x", None)))
    wg = cts.device_put(w, NamedSharding(m, P()))
    vg, gg = cts.value_and_grad(f, argnums=1)(xg, wg)
    cm = Mesh(np.array(cts.devices("cpu")[:2], dtype=object), ("x",))
    vc, gc_ = cts.value_and_grad(f, argnums=1)(cts.device_put(x, NamedSharding(cm, P("x", None))),
                                               cts.device_put(w, NamedSharding(cm, P())))
    assert vg.dtype == vc.dtype == np.float32 and gg.dtype == np.float32
    # float32 sums in the collectives' order: equal up to that order (one bfloat16 ulp)
    np.testing.assert_allclose(float(vg), float(vc), rtol=2 ** -7)
    np.testing.assert_allclose(np.asarray(gg), np.asarray(gc_), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("name,dtype,mu_dtype", [
    ("adamw", ml_dtypes.bfloat16, None), ("clip_adamw", ml_dtypes.bfloat16, None),
    ("lion", np.float16, None), ("adamw", np.float32, ml_dtypes.bfloat16)])
def test_optim_16bit_on_gpu_is_bit_identical_to_cpu(name, dtype, mu_dtype):
    """16-bit params / moments, loaded and stored in their dtype by the GPU's fused kernel,
    give the CPU devices' bits."""
    make = {"adamw": lambda: optim.adamw(1e-2, weight_decay=0.1, mu_dtype=mu_dtype),
            "clip_adamw": lambda: _chain_clip(optim.adamw(1e-2, mu_dtype=mu_dtype)),
            "lion": lambda: optim.lion(1e-3, mu_dtype=mu_dtype)}[name]
    rng = np.random.default_rng(9)
    params = {k: v.astype(dtype) for k, v in _opt_tree(rng).items()}
    grads_seq = [{k: (rng.standard_normal(v.shape) * 3).astype(dtype) for k, v in params.items()}
                 for _ in range(6)]
    ref_p, ref_s = _run_steps(make(), params, grads_seq, cts.devices("cpu")[0])
    got_p, got_s = _run_steps(make(), params, grads_seq, gpus()[0])
    for k in params:
        assert got_p[k].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got_p[k].view(np.uint8), ref_p[k].view(np.uint8),
                                      err_msg=f"{name}: {k}")
    assert [a.dtype for a in got_s] == [b.dtype for b in ref_s]
    for a, b in zip(got_s, ref_s):
        np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8),
                                      np.atleast_1d(b).view(np.uint8), err_msg=f"{name}: state")


# --- comparisons, booleans, integer arithmetic (test_int_bool_ops.py on GPU devices) ---------

_EW_DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.int32, np.uint32,
              np.bool_] + _NARROW_INTS


def _ew_values(dt, shape, seed):
    """Edge values (NaN, inf, -0, float32 subnormals, int extremes, zero divisors) first."""
    r = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if np.dtype(dt) == np.bool_:
        return r.integers(0, 2, n).astype(bool).reshape(shape)
    if np.dtype(dt).kind in "iu":
        edge = np.array([0, 1, -1, 7, -7, 2 ** 31 - 1, -(2 ** 31), 33, -33, 2 ** 24 + 1], np.int64)
        return np.concatenate([edge, r.integers(-(2 ** 31), 2 ** 31, n)])[:n].astype(dt).reshape(shape)
    edge = np.array([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 1e-40, 6e-8, np.inf, -np.inf, np.nan, 7.0,
                     -7.0, 3.0], np.float32)
    v = np.concatenate([edge, (r.standard_normal(n) * 4).astype(np.float32)])[:n]
    return v.astype(dt).reshape(shape)


def _ew_cases(dt):
    """(name, fn) of the typed ops that accept operands of dtype dt."""
    import ctrainstate._src.ops.elementwise as ew
    cases = [(n, getattr(ew, n)) for n in ("equal", "not_equal", "less", "less_equal",
                                           "greater", "greater_equal", "logical_and",
                                           "logical_xor")]
    kind = np.dtype(dt).kind
    if kind in "iub":
        cases += [(n, getattr(ew, n)) for n in ("bitwise_and", "bitwise_or", "bitwise_xor")]
        cases += [("add", cnp.add), ("multiply", cnp.multiply), ("maximum", cnp.maximum),
                  ("minimum", cnp.minimum)]
    if kind in "iu":
        cases += [("subtract", cnp.subtract), ("left_shift", ew.left_shift),
                  ("right_shift", ew.right_shift)]
    if kind in "iuf" or np.dtype(dt) == ml_dtypes.bfloat16:
        cases += [("floor_divide", ew.floor_divide), ("remainder", ew.remainder)]
    return cases


@pytest.mark.parametrize("dt", _EW_DTYPES, ids=lambda d: np.dtype(d).name)
def test_typed_elementwise_on_gpu_matches_cpu(dt):
    """The CUDA ewise kernel gives the CPU kernel's bits for every op and dtype, dense and
    broadcast (zero divisors, shifts past the width, NaN, subnormals, wraparound), except
    a NaN result's sign and payload (CUDA's canonical NaN: conftest.assert_same_bits)."""
    import ctrainstate._src.ops.elementwise as ew
    a, b = _ew_values(dt, (37, 19), 1), _ew_values(dt, (19,), 2)
    b2 = _ew_values(dt, (37, 19), 3)
    cpu = cts.devices("cpu")[0]
    for name, fn in _ew_cases(dt):
        for x, y in ((a, b), (a, b2)):
            got = np.asarray(fn(cts.device_put(x, gpus()[0]), cts.device_put(y, gpus()[0])))
            want = np.asarray(fn(cts.device_put(x, cpu), cts.device_put(y, cpu)))
            # NaN results carry CUDA's canonical NaN on the GPU (floor_divide's and
            # remainder's NaN from inf or a zero divisor), x86's on the CPU: both NaN is equal
            assert_same_bits(got, want, gpu=True, err_msg=name)
    unary = [("logical_not", ew.logical_not), ("isnan", ew.isnan), ("isfinite", ew.isfinite)]
    if np.dtype(dt).kind in "iub":
        unary.append(("invert", ew.invert))
    if np.dtype(dt).kind in "iu":
        unary += [("negative", cnp.negative), ("abs", cnp.abs)]
    for name, fn in unary:
        got = np.asarray(fn(cts.device_put(a, gpus()[0])))
        want = np.asarray(fn(cts.device_put(a, cpu)))
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=name)


@pytest.mark.parametrize("dt", [np.int32, np.uint32, np.bool_] + _NARROW_INTS,
                         ids=lambda d: np.dtype(d).name)
def test_int_reductions_and_cumsum_on_a_gpu_mesh_match_cpu(dt):
    """Integer sums (wrapping), max, min, any/all and cumsum on a GPU mesh, the reduced axis
    sharded (partial results combined across devices), give the single CPU device's bits."""
    import ctrainstate._src.ops.elementwise as ew
    n = min(4, len(gpus()))
    m = gpu_mesh((n,), ("x",))
    x = _ew_values(dt, (8 * n, 13), 4)
    g = cts.device_put(x, NamedSharding(m, P("x", None)))
    c = cts.device_put(x, cts.devices("cpu")[0])
    fns = [lambda v: cnp.sum(v), lambda v: cnp.sum(v, axis=0), lambda v: cnp.max(v, axis=0),
           lambda v: cnp.min(v, axis=1), lambda v: ew.any(v, axis=0), lambda v: ew.all(v),
           lambda v: ew.cumsum(v, axis=0), lambda v: ew.cumsum(v, axis=1),
           lambda v: cnp.where(ew.greater(v, 0), v, v)]
    # few outputs of many elements: the block-per-output kernel (a shared-memory tree)
    big = _ew_values(dt, (3, 5000), 6)
    bg, bc = cts.device_put(big, gpus()[0]), cts.device_put(big, cts.devices("cpu")[0])
    for f in (lambda v: cnp.sum(v), lambda v: cnp.sum(v, axis=1), lambda v: cnp.max(v, axis=1),
              lambda v: cnp.min(v)):
        np.testing.assert_array_equal(np.asarray(f(bg)), np.asarray(f(bc)))
    for i, f in enumerate(fns):
        got, want = np.asarray(f(g)), np.asarray(f(c))
        assert got.dtype == want.dtype, i
        np.testing.assert_array_equal(got.reshape(-1).view(np.uint8),
                                      want.reshape(-1).view(np.uint8), err_msg=str(i))


def test_leaky_mask_gradient_on_gpu_matches_cpu():
    """where(x > 0, x, 0.1 x) with an integer-id mask inside value_and_grad on GPU devices."""
    x = _ew_values(np.float32, (8, 6), 5)
    x = np.nan_to_num(x, nan=0.5, posinf=2.0, neginf=-2.0)
    ids = np.array([1, -100, 3, 4, -100, 6, 7, 8], np.int32)

    def f(v, i):
        y = cnp.where(v > 0, v, 0.1 * v)
        return cnp.sum(cnp.where((i != -100)[:, None], y * y, 0.0))
    cpu = cts.devices("cpu")[0]
    vg, gg = cts.value_and_grad(f)(cts.device_put(x, gpus()[0]), cts.device_put(ids, gpus()[0]))
    vc, gc_ = cts.value_and_grad(f)(cts.device_put(x, cpu), cts.device_put(ids, cpu))
    np.testing.assert_allclose(float(vg), float(vc), rtol=1e-6)   # float sums: order differs
    np.testing.assert_array_equal(np.asarray(gg), np.asarray(gc_))  # elementwise: exact


def _chain_launches():
    """Update passes that ran a chain kernel (cuda_optim.cu) so far, from the loaded CUDA
    backend (real or emulated); None when it does not count them."""
    import ctypes
    import os
    path = os.environ.get("CTRAINSTATE_CUDA_BACKEND")
    lib = ctypes.CDLL(path) if path else None
    if lib is None or not hasattr(lib, "ct_cuda_optim_chain_launches"):
        return None
    lib.ct_cuda_optim_chain_launches.restype = ctypes.c_longlong
    return lib.ct_cuda_optim_chain_launches()


def test_fused_launch_settings_give_the_same_bits(monkeypatch):
    """The fused optimizer pass's launch settings (CTRAINSTATE_OPT_WAVES: CTAs looping over
    tiles, or one CTA per tile; CTRAINSTATE_OPT_PREFETCH: the stateful stage's slots loaded
    with g and p, or in the stage loop; CTRAINSTATE_OPT_UNROLL: one or two quads per thread
    through the stages at once; CTRAINSTATE_OPT_CHAIN: the common chains' own kernels, or
    the generic one; CTRAINSTATE_OPT_VSTORE: the chain kernels' 16-byte loads and stores, quad
    by quad) change only the schedule: params and state after two steps are the same
    bits under each, on a tree whose leaves span many tiles, partial tiles and unaligned
    tails. The chains with a kernel of their own take it (counted), the others do not."""
    from ctrainstate import optim
    from ctrainstate.train_state import TrainState
    dev = gpus()[0]
    rng = np.random.default_rng(11)
    sizes = [1, 3, 2048, 2049, 7, 5000, 64, 9000, 4095, 12289, 130, 33333]
    params = {f"l{i:02d}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)}
    grads = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
             for _ in range(2)]
    odd = {k: i % 2 == 1 for i, k in enumerate(params)}
    # name: (transformation, has a chain kernel)
    chains = {
        "adamw": (lambda: optim.adamw(1e-2, weight_decay=0.1), True),
        "adamw, decay masked": (lambda: optim.adamw(1e-2, weight_decay=0.1, mask=odd), True),
        "clip+adamw": (lambda: optim.chain(optim.clip_by_global_norm(0.5),
                                           optim.adamw(1e-2, weight_decay=0.1)), True),
        "clip+adam": (lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.adam(1e-2)), True),
        "adam, nesterov": (lambda: optim.adam(1e-2, nesterov=True), True),
        "sgd momentum": (lambda: optim.sgd(1e-2, momentum=0.9), True),
        "sgd": (lambda: optim.sgd(1e-2), True),
        "momentum+rmsprop": (lambda: optim.chain(optim.trace(0.9), optim.scale_by_rms(),
                                                 optim.scale(-1e-2)), False),
    }
    settings = [(w, pre, un, "0", "0") for w in ("0", "1", "2", "64") for pre in ("0", "1")
                for un in ("1", "2")]
    settings += [(w, "0", un, "1", vs) for w in ("0", "1", "64") for un in ("1", "2")
                 for vs in ("0", "1")]
    for cname, (make, has_kernel) in chains.items():
        results = {}
        for waves, pre, unroll, chain, vstore in settings:
            monkeypatch.setenv("CTRAINSTATE_OPT_WAVES", waves)
            monkeypatch.setenv("CTRAINSTATE_OPT_PREFETCH", pre)
            monkeypatch.setenv("CTRAINSTATE_OPT_UNROLL", unroll)
            monkeypatch.setenv("CTRAINSTATE_OPT_CHAIN", chain)
            monkeypatch.setenv("CTRAINSTATE_OPT_VSTORE", vstore)
            s = TrainState.create(apply_fn=None, params=cts.device_put(params, dev), tx=make())
            before = _chain_launches()
            for g in grads:
                s = s.apply_gradients(grads=cts.device_put(g, dev))
            if before is not None:
                took = _chain_launches() - before
                assert took == (len(grads) if has_kernel and chain == "1" else 0), (cname, chain, took)
            leaves = cts.tree_util.tree_leaves((s.params, s.opt_state))
            results[(waves, pre, unroll, chain, vstore)] = [np.asarray(x).tobytes() for x in leaves]
        first = results[("1", "0", "2", "0", "0")]  # the generic kernel's defaults
        for key, got in results.items():
            assert got == first, (cname, key)
        # and the step did something: the params moved
        assert np.asarray(cts.tree_util.tree_leaves(s.params)[0]).tobytes() != params["l00"].tobytes()


def _sequential_sum(a, axes):
    """float32 sums over `axes`, each output adding its elements one by one in row-major
    order of the reduced dims (the order reduce_kernel documents)."""
    kept = [d for d in range(a.ndim) if d not in axes]
    t = np.transpose(a, kept + list(axes)).reshape([a.shape[d] for d in kept] + [-1])
    acc = np.zeros(t.shape[:-1], np.float32)
    for i in range(t.shape[-1]):
        acc = (acc + t[..., i]).astype(np.float32)
    return acc


def test_reductions_and_broadcasts_walk_in_order_on_gpu():
    """Sums over every subset of axes that the one-thread-per-output kernel handles (one,
    two, or more reduced dims: strided and nested walks, and the general index walk) give the
    bits of a sequential float32 sum in row-major order; broadcasting binary ops give numpy's
    float32 bits (these shapes take the 32-bit index path; the 64-bit kernel, for launches past
    2^31 elements or offsets, is the unchanged earlier one)."""
    import itertools
    rng = np.random.default_rng(21)
    a = rng.standard_normal((3, 5, 4, 6)).astype(np.float32) * 100
    ga = cts.device_put(a, gpus()[0])
    checked = 0
    for r in range(1, 5):
        for axes in itertools.combinations(range(4), r):
            trailing = axes == tuple(range(4 - r, 4))
            nred = int(np.prod([a.shape[d] for d in axes]))
            if trailing and nred >= 256:
                continue  # the CTA-per-row tree kernel: another order
            got = np.asarray(cnp.sum(ga, axis=axes))
            assert got.tobytes() == _sequential_sum(a, axes).tobytes(), axes
            checked += 1
    assert checked == 14
    for xs, ys in [((4, 1, 6), (5, 1)), ((3, 5, 4, 6), (4, 1)), ((1, 7), (6, 1)), ((2, 3, 1, 5), (3, 4, 1))]:
        x = rng.standard_normal(xs).astype(np.float32)
        y = rng.standard_normal(ys).astype(np.float32)
        gx, gy = cts.device_put(x, gpus()[0]), cts.device_put(y, gpus()[0])
        for op, ref in ((cnp.add, np.add), (cnp.multiply, np.multiply), (cnp.maximum, np.maximum)):
            assert np.asarray(op(gx, gy)).tobytes() == ref(x, y).astype(np.float32).tobytes(), (xs, ys)


@pytest.mark.parametrize("name", ["adamw", "clip_adamw", "lamb", "sgd_nesterov"])
def test_optim_steady_state_runs_from_the_persistent_plan(name, monkeypatch):
    """After the first step, TrainState.apply_gradients on GPU devices runs from the
    persistent plan (optim.base.FastPlan over _C.OptimPlan: one C call, the GPU kernels'
    launches inside it), with the bits of the same steps on CPU devices."""
    from ctrainstate.train_state import TrainState
    from ctrainstate._src.train_state import train_state as ts
    n = min(2, len(gpus()))
    m = gpu_mesh((n,), ("x",))
    cm = Mesh(np.array(cts.devices("cpu")[:n], dtype=object).reshape(n), ("x",))
    rng = np.random.default_rng(4)
    tree = _opt_tree(rng)
    grads = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in tree.items()}
             for _ in range(4)]
    calls = []
    real = ts.run_fused
    monkeypatch.setattr(ts, "run_fused", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(mesh):
        sh = {k: NamedSharding(mesh, P("x") if v.ndim and v.shape[0] % n == 0 else P())
              for k, v in tree.items()}
        s = TrainState.create(apply_fn=None, params=cts.device_put(tree, sh),
                              tx=_OPT_CASES[name]())
        for g in grads:
            s = s.apply_gradients(grads=cts.device_put(g, sh))
        assert s.__dict__["_ct_plan"].fast is not None
        return [np.asarray(x).tobytes() for x in cts.tree_util.tree_leaves((s.params, s.opt_state))]

    got = run(m)
    assert len(calls) == 1, calls   # the first step only: the others ran from the plan
    assert got == run(cm)


@pytest.mark.parametrize("where", ["one device", "mesh"])
def test_jit_fused_chain_is_one_kernel_with_the_step_by_step_bits(where):
    """A jitted chain of float32 elementwise steps on GPU devices runs as one chain kernel per
    device (ct_op_chain; broadcast operands, a scalar on the left, a chained right operand) and
    gives the bits of the steps run one by one and of the eager ops."""
    from chain_checks import assert_chain_bits
    if where == "one device":
        put = lambda a, *spec: cts.device_put(a, gpus()[0])
    else:
        m = gpu_mesh((2, 2), ("x", "y"))
        put = lambda a, *spec: cts.device_put(a, cts.NamedSharding(m, cts.P(*spec)))
    assert_chain_bits(put, (64, 48), seed=11)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_unary_ops_are_one_kernel_with_the_float32_bits_rounded(dtype):
    """A unary op on a 16-bit float Array on a GPU runs the typed kernel (widen, the float32
    formula, round back): the bits of the float32 op on the widened values, rounded."""
    import ctrainstate.numpy as cnp
    from ctrainstate import nn
    dt = getattr(cnp, dtype)
    v = (np.random.default_rng(5).standard_normal(4099) * 4).astype(np.float32)
    v[:3] = [np.inf, np.nan, -0.0]
    x = cts.device_put(v, gpus()[0]).astype(dt)
    for f in (cnp.sin, cnp.exp, cnp.tanh, cnp.log, cnp.sqrt, cnp.negative, nn.gelu, nn.sigmoid):
        got, ref = f(x), f(x.astype(np.float32)).astype(dt)
        assert got.dtype == dt and np.asarray(got).tobytes() == np.asarray(ref).tobytes(), f


# --- CUDA graphs: jit's replays on GPU devices -------------------------------------------------

def _graphs_expected():
    """Whether the backend captures graphs: the CUDA backend (a GPU, or the emulated runtime of
    tools/cuda_emu.sh), not the mock backend of tools/mock_gpu.sh (no graph entries)."""
    import os
    return not os.environ.get("CTRAINSTATE_CUDA_BACKEND") or _emu_launches("") is not None


def _graph_put(where):
    """``put(array, *spec)``: onto the first GPU device, or by ``spec`` over a 2x2 mesh."""
    if where == "one device":
        return lambda a, *spec: cts.device_put(a, gpus()[0])
    m = gpu_mesh((2, 2), ("x", "y"))
    return lambda a, *spec: cts.device_put(a, NamedSharding(m, P(*spec)))


def _graph_train(put, steps, *, graphs=True, new_inputs=False, donate=False):
    """A jitted MLP training step (value_and_grad, then TrainState.apply_gradients with AdamW:
    an optimizer node after the differentiated steps), `steps` calls, the loss read after
    each as a training loop does. Returns (losses, params' bits, the program)."""
    from ctrainstate.train_state import TrainState
    rng = np.random.default_rng(3)
    params = {"w1": put(rng.standard_normal((8, 32)).astype(np.float32) * 0.3, None, "y"),
              "w2": put(rng.standard_normal((32, 4)).astype(np.float32) * 0.3, "y", None)}
    xs = [rng.standard_normal((16, 8)).astype(np.float32) for _ in range(steps)]
    ys = [rng.standard_normal((16, 4)).astype(np.float32) for _ in range(steps)]
    x0, y0 = put(xs[0], "x", None), put(ys[0], "x", None)

    def loss(p, x, y):
        h = cnp.tanh(x @ p["w1"]) * 2.0 - 0.5
        return cnp.mean((cnp.sin(h) @ p["w2"] - y) ** 2)

    def step(s, x, y):
        l, g = cts.value_and_grad(loss)(s.params, x, y)
        return s.apply_gradients(grads=g), l

    state = TrainState.create(apply_fn=None, params=params, tx=optim.adamw(1e-2))
    j = cts.jit(step, donate_argnums=0 if donate else None)
    losses = []
    for i in range(steps):
        x, y = (put(xs[i], "x", None), put(ys[i], "x", None)) if new_inputs else (x0, y0)
        if i == 1:
            prog = j._programs.program([state, x, y], {})[0]
            assert prog is not None and prog.broken is None, prog
            prog.set_graphs(graphs)
        state, l = j(state, x, y)
        losses.append(float(l))
    bits = [np.asarray(v).tobytes() for v in cts.tree_util.tree_leaves(state.params)]
    return losses, bits, prog


@pytest.mark.parametrize("where", ["one device", "mesh"])
def test_jit_replays_as_cuda_graphs_with_the_kernel_by_kernel_bits(where):
    """A jitted training step on GPU devices replays its runs of GPU steps as CUDA graphs, one
    per device, captured once per set of buffer addresses and relaunched: the losses and the
    parameters are those of the same replays run kernel by kernel, and new input Arrays at
    every call (other addresses: captured again, or updated in place) give them too. The
    emulated runtime aborts a launch whose graph uses memory freed since its capture."""
    put = _graph_put(where)
    steps = 6
    ref_l, ref_p, off = _graph_train(put, steps, graphs=False)
    assert off.graph_stats() == []
    got_l, got_p, prog = _graph_train(put, steps)
    assert got_l == ref_l and got_p == ref_p
    ref2_l, ref2_p, _ = _graph_train(put, steps, graphs=False, new_inputs=True)
    new_l, new_p, prog2 = _graph_train(put, steps, new_inputs=True)
    assert new_l == ref2_l and new_p == ref2_p and new_l != ref_l
    if not _graphs_expected():
        assert prog.graph_stats() == []
        return
    segs = prog.graph_stats()
    assert segs and "# CUDA graph: steps" in prog.as_text()
    ndev = 1 if where == "one device" else 4
    for first, last, nd, captures, updates, launches, failed in segs:
        assert last > first and nd == ndev and not failed
        assert launches == steps - 1   # (the first call traced the step, eagerly)
        assert 1 <= captures + updates <= launches
    assert [s[:3] for s in prog2.graph_stats()] == [s[:3] for s in segs]


@pytest.mark.parametrize("where", ["one device", "mesh"])
@pytest.mark.parametrize("donate", [False, True])
def test_jit_cuda_graphs_are_relaunched_as_they_are_in_a_steady_loop(where, donate):
    """A training loop on one batch: the optimizer node updates the state in place, the
    values the graphs pass on (the gradients) come back from the pool at the addresses they
    had, and the loss is staged (written by the graph into a buffer of its own, then copied
    into a new Array), so each graph is captured once and relaunched as it is. The emulated
    pool hands back the block freed last of a size, as CUDA's caching pool does; with another
    pool the graphs are captured again where addresses differ (checked on a GPU: same bits)."""
    import os
    if not _graphs_expected():
        pytest.skip("the backend has no graphs (the mock backend)")
    put = _graph_put(where)
    steps = 8
    ref_l, ref_p, _ = _graph_train(put, steps, graphs=False, donate=donate)
    got_l, got_p, prog = _graph_train(put, steps, donate=donate)
    assert got_l == ref_l and got_p == ref_p
    emulated = bool(os.environ.get("CTRAINSTATE_CUDA_BACKEND"))
    for *_, captures, updates, launches, failed in prog.graph_stats():
        assert launches == steps - 1 and not failed
        assert not emulated or (captures, updates) == (1, 0), prog.graph_stats()


def test_cuda_graphs_off_by_environment(monkeypatch):
    """CTRAINSTATE_CUDA_GRAPHS=0 at the trace: the program replays kernel by kernel."""
    monkeypatch.setenv("CTRAINSTATE_CUDA_GRAPHS", "0")
    x = cts.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), gpus()[0])
    j = cts.jit(lambda a: cnp.sin(a @ a) * 2.0 + a)
    j(x)
    prog = j._programs.program([x], {})[0]
    assert prog.graph_stats() == [] and "CUDA graph" not in prog.as_text()
    assert j.lower(x).compile().graph_stats() == []
    np.testing.assert_array_equal(np.asarray(j(x)), np.asarray(cnp.sin(x @ x) * 2.0 + x))


def test_graph_stats_through_lower():
    """``f.lower(*args).compile().graph_stats()``: the runs of steps replayed as graphs, as
    dicts (none with the mock backend, which has no graphs)."""
    x = cts.device_put(np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8), gpus()[0])
    j = cts.jit(lambda a: cnp.tanh(a @ a) * 3.0 - a)
    for _ in range(3):
        y = j(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(cnp.tanh(x @ x) * 3.0 - x))
    stats = j.lower(x).compile().graph_stats()
    if not _graphs_expected():
        assert stats == []
        return
    last = j._programs.program([x], {})[0].nsteps - 1   # (one run: every step)
    assert [(s["steps"], s["devices"], s["launches"], s["capture_failed"]) for s in stats] == \
        [((0, last), 1, 2, False)]
    assert stats[0]["captures"] + stats[0]["updates"] >= 1
