"""Devices, per-device memory accounting and the environment settings."""
import gc

import numpy as np
import pytest

import ctrainstate as cts
from conftest import bytes_in_use, run_python


def test_eight_cpu_devices_from_env():
    devs = cts.devices()
    assert len(devs) == 8 == cts.device_count() == cts.local_device_count()
    assert [d.id for d in devs] == list(range(8))
    assert all(d.platform == "cpu" for d in devs)
    assert repr(devs[3]) == "CpuDevice(id=3)"
    assert cts.local_devices() == devs
    assert cts.devices("cpu") == devs
    assert cts.default_backend() == "cpu"


def test_devices_are_unique_objects():
    assert cts.devices()[2] is cts.devices()[2]
    assert len({cts.devices()[i] for i in range(8)}) == 8


def test_bad_backend_names():
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        cts.devices("tpu")
    with pytest.raises(TypeError):
        cts.devices(3)


def test_no_gpu_is_a_clear_error_not_an_import_error():
    if cts._C.device_ids("gpu"):
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="no gpu devices"):
        cts.devices("gpu")


def test_memory_stats_keys_and_accounting():
    d = cts.devices()[5]
    stats = d.memory_stats()
    for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
        assert isinstance(stats[k], int)
    gc.collect()  # arrays other tests left in reference cycles must not be freed mid-test
    before = bytes_in_use()
    x = cts.device_put(np.zeros(1000, np.float32), d)
    after = bytes_in_use()
    assert after[5] - before[5] == 4000
    assert [a - b for i, (a, b) in enumerate(zip(after, before)) if i != 5] == [0] * 7
    del x
    gc.collect()
    assert bytes_in_use() == before


def test_peak_and_reset():
    d = cts.devices()[1]
    cts.reset_peak_memory_stats()
    base = d.memory_stats()["bytes_in_use"]
    assert d.memory_stats()["peak_bytes_in_use"] == base
    x = cts.device_put(np.zeros((256, 1024), np.float32), d)
    del x
    gc.collect()
    s = d.memory_stats()
    assert s["bytes_in_use"] == base
    assert s["peak_bytes_in_use"] == base + (1 << 20)
    cts.reset_peak_memory_stats()
    assert d.memory_stats()["peak_bytes_in_use"] == base


def test_default_is_one_device():
    r = run_python("import ctrainstate as c; print(c.device_count())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1"


@pytest.mark.parametrize("value", ["zero", "0", "-3", "5000"])
def test_bad_device_count_env(value):
    r = run_python("import ctrainstate as c; c.devices()",
                   {"CTRAINSTATE_NUM_CPU_DEVICES": value})
    assert r.returncode != 0
    assert "CTRAINSTATE_NUM_CPU_DEVICES" in r.stderr
    assert "ValueError" in r.stderr


def test_memory_limit_raises_resource_exhausted():
    code = """
import numpy as np, ctrainstate as c
d = c.devices()[2]
a = c.device_put(np.zeros(200, np.float32), d)       # 800 bytes
try:
    c.device_put(np.zeros(100, np.float32), d)       # +400 > 1000
except c.ResourceExhaustedError as e:
    print("MSG", e)
    print("INUSE", d.memory_stats()["bytes_in_use"], d.memory_stats()["bytes_limit"])
b = c.device_put(np.zeros(50, np.float32), d)        # 200 more fits exactly
print("OK", d.memory_stats()["bytes_in_use"])
"""
    r = run_python(code, {"CTRAINSTATE_NUM_CPU_DEVICES": "4",
                          "CTRAINSTATE_CPU_DEVICE_MEMORY": "1000"})
    assert r.returncode == 0, r.stderr
    msg = [l for l in r.stdout.splitlines() if l.startswith("MSG")][0]
    assert "CpuDevice(id=2)" in msg and "400 bytes" in msg and "800 bytes in use" in msg
    assert "INUSE 800 1000" in r.stdout
    assert "OK 1000" in r.stdout


def test_resource_exhausted_in_sharded_put_leaves_nothing_allocated():
    code = """
import numpy as np, ctrainstate as c
m = c.make_mesh((4,), ('x',))
s = c.NamedSharding(m, c.P('x'))
a = c.device_put(np.zeros(100, np.float32), c.devices()[3])   # device 3: 400 of 1000 bytes
try:
    c.device_put(np.zeros(4 * 200, np.float32), s)             # 800 bytes per device
except c.ResourceExhaustedError as e:
    print("RAISED", "CpuDevice(id=3)" in str(e))
import gc; gc.collect()
print("INUSE", [d.memory_stats()["bytes_in_use"] for d in c.devices()])
"""
    r = run_python(code, {"CTRAINSTATE_NUM_CPU_DEVICES": "4",
                          "CTRAINSTATE_CPU_DEVICE_MEMORY": "1000"})
    assert r.returncode == 0, r.stderr
    assert "RAISED True" in r.stdout
    assert "INUSE [0, 0, 0, 400]" in r.stdout


# --- the loadable CUDA backend -------------------------------------------------------


def test_gpu_status_explains_missing_gpus():
    status = cts.gpu_status()
    assert isinstance(status, str) and status
    if not cts._C.device_ids("gpu"):
        with pytest.raises(RuntimeError) as e:
            cts.devices("gpu")
        assert status in str(e.value)


def test_gpu_backend_library_missing_is_not_an_import_error():
    r = run_python("import ctrainstate as c; print(c.device_count('cpu')); print(c.gpu_status())",
                   {"CTRAINSTATE_CUDA_BACKEND": "/nonexistent/_cuda_backend.so"})
    assert r.returncode == 0, r.stderr
    assert "could not be loaded" in r.stdout and "/nonexistent/_cuda_backend.so" in r.stdout


def test_gpus_can_be_disabled():
    r = run_python("import ctrainstate as c; print(c.gpu_status()); print(len(c._C.device_ids('gpu')))",
                   {"CTRAINSTATE_NO_GPU": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["GPUs disabled by CTRAINSTATE_NO_GPU=1", "0"]


def test_bad_gpu_split():
    r = run_python("import ctrainstate as c; c.devices('cpu')", {"CTRAINSTATE_GPU_SPLIT": "0"})
    assert r.returncode != 0 and "CTRAINSTATE_GPU_SPLIT" in r.stderr


def _nccl_version_in_subprocess(env):
    """ct_cuda_nccl_version() of the built CUDA backend (no GPU needed), in a fresh process."""
    code = ("import ctypes, glob, os, ctrainstate\n"
            "lib = ctypes.CDLL(os.environ['CTRAINSTATE_CUDA_BACKEND'])\n"
            "why = ctypes.create_string_buffer(1024)\n"
            "print(lib.ct_cuda_nccl_version(why, 1024)); print(why.value.decode())\n")
    return run_python(code, env)


def test_cuda_backend_loads_nccl_at_run_time():
    """NCCL is dlopen-ed by the CUDA backend only for collectives across GPUs: found on the
    loader's path / $NCCL_HOME / the toolkit / the nvidia-nccl wheel, or a clear reason."""
    import ctypes
    import glob
    import os
    libs = glob.glob(os.path.join(os.path.dirname(cts.__file__), "_cuda_backend*.so"))
    if not libs:
        pytest.skip("built without the CUDA backend")
    try:
        ctypes.CDLL(libs[0])
    except OSError as e:
        pytest.skip(f"CUDA backend not loadable here ({e})")
    env = {"CTRAINSTATE_CUDA_BACKEND": libs[0]}
    try:
        ctypes.CDLL(os.environ.get("CTRAINSTATE_NCCL_LIB") or "libnccl.so.2")
        findable = True
    except OSError:
        findable = False
    r = _nccl_version_in_subprocess(env)
    assert r.returncode == 0, r.stderr
    version, why = (r.stdout.splitlines() + [""])[:2]
    if findable:
        assert int(version) >= 20000, r.stdout
    else:
        assert int(version) == 0 and "NCCL not found" in why, r.stdout
    # a wrong explicit library falls back to the search; no library at all is a reason, not a crash
    r = _nccl_version_in_subprocess({**env, "CTRAINSTATE_NCCL_LIB": "/nonexistent/libnccl.so.2",
                                     "LD_LIBRARY_PATH": "", "NCCL_HOME": "/nonexistent",
                                     "CUDA_HOME": "/nonexistent"})
    assert r.returncode == 0, r.stderr
    v, why = (r.stdout.splitlines() + [""])[:2]
    try:
        ctypes.CDLL("libnccl.so.2")  # what the search tries next (ldconfig's cache)
        assert int(v) >= 20000, r.stdout
    except OSError:
        assert int(v) == 0 and "/nonexistent/libnccl.so.2" in why, r.stdout


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define, live when installed (those parts skip cleanly otherwise) and derived
# by hand

def _jax():
    return pytest.importorskip("jax")


def test_device_process_index():
    # t5x's get_coords / bounds_from_last_device read device.process_index: every device
    # belongs to the one process, whose devices are exactly local_devices()
    devs = cts.devices()
    assert cts.process_count() == 1 and cts.process_index() == 0
    assert [d.process_index for d in devs] == [cts.process_index()] * cts.device_count()
    assert [d.host_id for d in devs] == [d.process_index for d in devs]
    assert [d for d in devs if d.process_index == cts.process_index()] == cts.local_devices()
    assert cts.local_devices(process_index=0) == cts.local_devices()
    with pytest.raises(ValueError, match="process_index 1"):
        cts.local_devices(process_index=1)
    assert len({d.id for d in devs}) == len(devs)
    from ctrainstate.t5x import partitioning as t5p
    coords = [t5p.get_coords(d) for d in devs]
    assert len(set(coords)) == len(devs) and {c[0] for c in coords} == {0}


def test_device_attributes_match_jax():
    jax = _jax()
    attrs = lambda d: (d.id, d.process_index, d.host_id, d.platform, d.device_kind)
    theirs, ours = jax.devices("cpu"), cts.devices("cpu")
    n = min(len(theirs), len(ours))
    assert n >= 1
    assert [attrs(d) for d in ours[:n]] == [attrs(d) for d in theirs[:n]]
    assert (cts.process_index(), cts.process_count()) == (jax.process_index(), jax.process_count())


def _nvidia_driver_loads() -> bool:
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


# what the probe says, and which CUDA libraries the process mapped
_PROBE_MAPS = ("import ctrainstate as c; c.devices(); print(c.gpu_status())\n"
               "print(sorted({l.split()[-1].rsplit('/', 1)[-1] for l in open('/proc/self/maps')\n"
               "              if 'cublas' in l or 'backend' in l}))\n")


def test_the_package_backend_is_not_loaded_without_the_nvidia_driver(tmp_path):
    """Where CTRAINSTATE_CUDA_BACKEND names the package's own CUDA backend (set at import, or
    inherited from a parent with that path) and the driver's libcuda.so.1 does not load, the
    probe says so and maps neither the backend nor cuBLAS (a tenth of a second per process);
    a library named otherwise is loaded as before."""
    import glob
    import os
    import shutil
    libs = glob.glob(os.path.join(os.path.dirname(cts.__file__), "_cuda_backend*.so"))
    if not libs:
        pytest.skip("ctrainstate was built without the CUDA backend")
    if _nvidia_driver_loads():
        pytest.skip("the NVIDIA driver is installed here: the backend is loaded")
    for env in ({"CTRAINSTATE_CUDA_BACKEND": ""}, {"CTRAINSTATE_CUDA_BACKEND": libs[0]}):
        r = run_python(_PROBE_MAPS, env)
        assert r.returncode == 0, r.stderr
        status, maps = r.stdout.splitlines()
        assert status.startswith("no NVIDIA driver: libcuda.so.1 could not be loaded ("), status
        assert status.endswith("so the CUDA backend was not loaded"), status
        assert maps == "[]", maps
    copy = tmp_path / "backend_copy.so"
    shutil.copy(libs[0], copy)
    r = run_python(_PROBE_MAPS, {"CTRAINSTATE_CUDA_BACKEND": str(copy)})
    assert r.returncode == 0, r.stderr
    status, maps = r.stdout.splitlines()
    assert "no NVIDIA driver" not in status, status
    assert "backend_copy.so" in maps or status.startswith("the CUDA backend could not be loaded"), \
        (status, maps)


def test_devices_set_cuda_backend_checks_its_argument():
    cts.devices()   # devices exist in this process
    with pytest.raises(ValueError, match="devices exist already"):
        cts._C.devices_set_cuda_backend("/some/_cuda_backend.so")
    with pytest.raises(ValueError, match="missing or too long"):
        cts._C.devices_set_cuda_backend("x" * 5000)
    with pytest.raises(ValueError, match="embedded NUL"):
        cts._C.devices_set_cuda_backend("a\0b")
    with pytest.raises(TypeError, match="a path"):
        cts._C.devices_set_cuda_backend(b"/some/path")


def test_the_devices_module_run_again_after_the_probe_is_harmless():
    """A notebook's autoreload runs the module again once devices exist: naming the package's
    backend is then too late, and is skipped without an error."""
    r = run_python("import importlib, ctrainstate as c\n"
                   "from ctrainstate._src.base import devices\n"
                   "c.devices(); before = c.gpu_status()\n"
                   "importlib.reload(devices)\n"
                   "print(c.gpu_status() == before, len(c.devices('cpu')))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "1"], r.stdout
