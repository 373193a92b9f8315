"""Test configuration: 8 CPU virtual devices (and 8 XLA CPU devices for parity tests).

Both variables are read at first use, so they are set here before anything
imports ctrainstate or jax.
"""
import os
import subprocess
import sys

if os.environ.get("CTRAINSTATE_SANITIZED") != "1":
    # Import the package of this checkout (built in place), whatever other
    # checkout an editable install points at.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

os.environ.setdefault("CTRAINSTATE_NUM_CPU_DEVICES", "8")
_xla = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _xla:
    os.environ["XLA_FLAGS"] = (_xla + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _host_has_native_float16() -> bool:
    """Whether this CPU has AVX512-FP16 (float16 arithmetic in hardware)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512_fp16" in line.split()
    except OSError:
        pass
    return False


# The jax side of the float16 parity tests. The HLO of jax's float16 samplers rounds every
# multiply and add to float16, and ctrainstate does the same. XLA's CPU backend keeps that
# rounding where the CPU has no float16 arithmetic (it widens each op to float32 and narrows
# it back). On a CPU with AVX512-FP16 it emits float16 instructions instead, and LLVM fuses a
# multiply and the add after it into one float16 FMA with a single rounding. jax's float16
# uniform(minval, maxval), truncated_normal and the initializers built on them then differ by
# an ulp in the uniform step (measured on a Sapphire Rapids VM: 52913 of 100000 `a * c1 + c2`
# differ from the per-op rounding; tests/test_random.py's live parity failed there). Capping
# XLA at AVX2 restores the per-op rounding (measured: 0 differences), so the live parity tests
# compare against the same jax values on every host. It changes which vector instructions
# XLA picks, not the HLO: float32 results were the same in the full suite.
# An XLA that does not know the flag would abort at its first use, so a child process tries it
# first (about a second, on such hosts only; without jax it fails and nothing is added).
def _xla_accepts(flags: str) -> bool:
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    try:
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                              capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


if _host_has_native_float16() and "xla_cpu_max_isa" not in os.environ["XLA_FLAGS"]:
    _capped = os.environ["XLA_FLAGS"] + " --xla_cpu_max_isa=AVX2"
    if os.environ.get("CTRAINSTATE_SANITIZED") != "1" and _xla_accepts(_capped):
        os.environ["XLA_FLAGS"] = _capped
# jax's persistent compilation cache. The parity tests spend most of their time in XLA
# compiling the jax side; with the compiled programs kept on disk, a second pytest process (CI's
# rerun of the CPU suites on emulated GPU devices, a developer's rerun) loads them instead. The
# programs are the same, so are their results. CTRAINSTATE_TEST_JAX_CACHE: the directory, or
# 0 for none.
_jax_cache = os.environ.get("CTRAINSTATE_TEST_JAX_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
    "ctrainstate", "jax-test-compile")
if _jax_cache != "0":
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _jax_cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

if os.environ.get("CTRAINSTATE_SANITIZED") == "1":
    # Under tools/sanitize.sh: jaxlib is not built for ASan, so parity tests
    # (which only exercise jax's side) skip via pytest.importorskip.
    for _mod in ("jax", "flax", "optax", "torch"):
        sys.modules[_mod] = None

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import ctrainstate as cts  # noqa: E402


def _has_gpu():
    try:
        return len(cts._devices._ids("gpu")) > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def mem_baseline():
    """Per-device bytes_in_use before the test; the test can assert a return to it."""
    import gc
    gc.collect()
    return [d.memory_stats()["bytes_in_use"] for d in cts.devices()]


def bytes_in_use():
    return [d.memory_stats()["bytes_in_use"] for d in cts.devices()]


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (for settings read at first use)."""
    e = dict(os.environ)
    for k in ("CTRAINSTATE_NUM_CPU_DEVICES", "CTRAINSTATE_CPU_DEVICE_MEMORY"):
        e.pop(k, None)
    if os.environ.get("CTRAINSTATE_SANITIZED") != "1":
        # the package of this checkout, as in this process (under tools/sanitize.sh,
        # PYTHONPATH already names the sanitized build)
        here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
        e["PYTHONPATH"] = os.pathsep.join([here] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                          timeout=120)


def flat_tree(tree, prefix=""):
    """A nested dict as {'a/b/c': leaf} (params and gradients in tests)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat_tree(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out


def on_gpu(*arrays) -> bool:
    """Whether any of these ctrainstate Arrays has a shard on a GPU device."""
    return any(d.platform != "cpu" for a in arrays for d in a.devices())


def assert_same_bits(got, want, gpu: bool, err_msg: str = "") -> None:
    """got and want (numpy arrays of one dtype and shape) hold the same bits. With ``gpu``
    (got was computed on GPU devices: see :func:`on_gpu`), a NaN matches any NaN: CUDA's
    arithmetic returns the canonical NaN 0x7fffffff (float16 0x7fff, bfloat16 0x7fff),
    keeping neither the sign nor the payload, where x86 and XLA's CPU return 0xffc00000 for
    an invalid operation and keep an input NaN's bits; jax on GPU does the same as CUDA.
    Every other element, and every element on CPUs (the jax-parity claim), must match
    bit for bit."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype, err_msg)
    assert got.shape == want.shape, (got.shape, want.shape, err_msg)
    got, want = got.reshape(-1), want.reshape(-1)
    if gpu and (got.dtype.kind == "f" or got.dtype.name == "bfloat16"):
        gn, wn = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
        np.testing.assert_array_equal(gn, wn, err_msg=f"{err_msg} (NaN positions)")
        got, want = got[~gn], want[~wn]
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=err_msg)
