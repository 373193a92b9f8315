"""The CUDA backend: the CPU suites' array checks on GPU devices.

Skipped without a GPU (CI has none); run by benchmarks/gpu_check.sh on a GPU
host, also with CTRAINSTATE_GPU_SPLIT=4 and =8 (logical devices sharing a GPU).
"""
import gc

import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import Mesh, NamedSharding, P

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
    np.testing.assert_array_equal(np.asarray(b).view(np.uint8), xt.view(np.uint8))


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
