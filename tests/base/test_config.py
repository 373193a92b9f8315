"""ctrainstate.config: jax.config's update/read, device settings read once per process."""
import textwrap

import numpy as np
import pytest

import ctrainstate as cts
from conftest import run_python


def _run(code: str, env: dict | None = None) -> str:
    r = run_python(textwrap.dedent(code), env)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_config_sets_the_cpu_device_count_before_first_use():
    out = _run("""
        import ctrainstate as cts
        cts.config.update("jax_num_cpu_devices", 3)
        print(cts.device_count(), cts.config.jax_num_cpu_devices,
              cts.config.read("ctrainstate_num_cpu_devices"))
    """)
    assert out == "3 3 3"
    out = _run("""
        import ctrainstate as cts
        cts.config.update("ctrainstate_num_cpu_devices", 2)
        cts.config.update("ctrainstate_cpu_device_memory", 4096)
        print(cts.device_count(), cts.devices()[0].memory_stats()["bytes_limit"])
    """)
    assert out == "2 4096"


def test_config_device_count_after_first_use_raises():
    out = _run("""
        import ctrainstate as cts
        cts.config.update("jax_num_cpu_devices", 4)
        cts.devices()
        cts.config.update("jax_num_cpu_devices", 4)   # the count they have: nothing to do
        for name, v in [("jax_num_cpu_devices", 8), ("ctrainstate_cpu_device_memory", 1024),
                        ("jax_platforms", "gpu")]:
            try:
                cts.config.update(name, v)
            except RuntimeError as e:
                print("RuntimeError", name in str(e), "already created" in str(e))
        print(cts.device_count())
    """)
    assert out.splitlines() == ["RuntimeError True True"] * 3 + ["4"]


def test_config_device_count_set_after_core_created_devices_raises_at_use():
    # the core reached directly (not through ctrainstate's device functions) creates the
    # devices from the environment; the count set afterwards cannot be honoured
    out = _run("""
        import ctrainstate as cts
        cts._C.device_ids("cpu")
        cts.config.update("jax_num_cpu_devices", 5)
        try:
            cts.devices()
        except RuntimeError as e:
            print("RuntimeError", "set to 5" in str(e), "2 CPU devices" in str(e))
    """, {"CTRAINSTATE_NUM_CPU_DEVICES": "2"})
    assert out == "RuntimeError True True"


def test_config_jax_platforms_picks_the_default_backend():
    out = _run("""
        import ctrainstate as cts
        cts.config.update("jax_platforms", "cpu")
        print(cts.default_backend(), cts.config.jax_platforms)
        try:
            cts.devices("gpu")
        except RuntimeError as e:
            print("refused", "jax_platforms" in str(e))
    """)
    assert out.splitlines() == ["cpu cpu", "refused True"]


def test_config_rejects_unknown_names_and_bad_values():
    with pytest.raises(AttributeError, match="jax_foo"):
        cts.config.update("jax_foo", 1)
    with pytest.raises(AttributeError, match="jax_foo"):
        cts.config.read("jax_foo")
    with pytest.raises(AttributeError, match="jax_foo"):
        cts.config.jax_foo
    with pytest.raises(TypeError, match="jax_num_cpu_devices"):
        cts.config.update("jax_num_cpu_devices", "8")
    with pytest.raises(ValueError, match="at least 1"):
        cts.config.update("ctrainstate_num_cpu_devices", 0)
    with pytest.raises(TypeError, match="jax_platforms"):
        cts.config.update("jax_platforms", 3)
    with pytest.raises(ValueError, match="unknown backend"):
        cts.config.update("jax_platforms", "tpu")


def test_config_x64_true_raises_and_false_is_accepted():
    cts.config.update("jax_enable_x64", False)
    assert cts.config.jax_enable_x64 is False
    with pytest.raises(ValueError, match="32-bit"):
        cts.config.update("jax_enable_x64", True)
    assert cts.config.read("jax_enable_x64") is False


def test_config_threefry_partitionable_and_prng_impl():
    cts.config.update("jax_threefry_partitionable", True)
    assert cts.config.jax_threefry_partitionable is True
    with pytest.raises(ValueError, match="partitionable"):
        cts.config.update("jax_threefry_partitionable", False)
    cts.config.update("jax_default_prng_impl", "threefry2x32")
    with pytest.raises(ValueError, match="threefry2x32"):
        cts.config.update("jax_default_prng_impl", "rbg")


def test_config_disable_jit_runs_outside_jit_scope():
    from ctrainstate._src.base import trace_state as _trace_state
    seen = []
    f = cts.jit(lambda: seen.append(_trace_state.in_jit()))
    try:
        cts.config.update("jax_disable_jit", True)
        assert cts.config.jax_disable_jit is True
        f()
    finally:
        cts.config.update("jax_disable_jit", False)
    f()
    assert seen == [False, True]


def test_config_same_device_count_in_this_process_is_a_no_op():
    cts.devices()
    cts.config.update("jax_num_cpu_devices", cts.device_count("cpu"))
    with pytest.raises(RuntimeError, match="already created"):
        cts.config.update("jax_num_cpu_devices", cts.device_count("cpu") + 1)


def test_config_default_matmul_precision_is_process_wide_under_the_context():
    import threading
    x = np.array([[1 + 2.0 ** -9]], np.float32)     # bfloat16 rounds the 2^-9 away
    one = np.ones((1, 1), np.float32)

    def product():
        return float(np.asarray(cts.device_put(x) @ one)[0, 0])
    assert product() == 1 + 2.0 ** -9 and cts.config.jax_default_matmul_precision is None
    cts.config.update("jax_default_matmul_precision", "bfloat16")
    try:
        assert cts.config.read("jax_default_matmul_precision") == "bfloat16"
        assert product() == 1.0
        got = []
        t = threading.Thread(target=lambda: got.append(product()))   # every thread
        t.start()
        t.join()
        assert got == [1.0]
        with cts.default_matmul_precision("float32"):    # a block still overrides it
            assert product() == 1 + 2.0 ** -9
        assert product() == 1.0
        with pytest.raises(ValueError, match="unknown precision 'fp8'"):
            cts.config.update("jax_default_matmul_precision", "fp8")
    finally:
        cts.config.update("jax_default_matmul_precision", None)
    assert product() == 1 + 2.0 ** -9


def test_config_debug_nans_false_is_accepted_true_raises():
    for name in ("jax_debug_nans", "jax_debug_infs"):
        cts.config.update(name, False)
        assert cts.config.read(name) is False
        with pytest.raises(ValueError, match="does not check each op's result"):
            cts.config.update(name, True)
