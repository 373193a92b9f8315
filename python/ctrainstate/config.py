"""``jax.config`` for ctrainstate: settings read at first use, and jax's flags that mean
something here.

``config.update(name, value)`` sets an option, ``config.read(name)`` and attribute access
(``config.jax_enable_x64``) read one, as with ``jax.config``. An unknown name raises
``AttributeError`` (jax's error for it). The options:

``jax_num_cpu_devices`` / ``ctrainstate_num_cpu_devices``
    The number of CPU virtual devices (``CTRAINSTATE_NUM_CPU_DEVICES``). Read once, when
    devices are first used: set it right after ``import ctrainstate``. Setting another
    count after that raises ``RuntimeError`` (setting the count the devices already have
    does nothing, so a second module of a test suite may repeat it).
``ctrainstate_cpu_device_memory``
    A per-device memory limit in bytes for CPU devices, or None for none
    (``CTRAINSTATE_CPU_DEVICE_MEMORY``); also before first use.
``ctrainstate_gpu_split``
    Logical devices per GPU (``CTRAINSTATE_GPU_SPLIT``); also before first use.
``jax_platforms``
    Platforms by preference, ``"cpu"``, ``"gpu"`` (``"cuda"``) or a comma-separated list;
    ``devices()`` without a backend uses the first one that has devices and other
    platforms are refused. None (the default): GPUs when present, else CPUs. Before first
    use, as in jax.
``jax_enable_x64``
    Only ``False``: ctrainstate stores 32-bit values (64-bit inputs are narrowed, as in jax
    without x64); ``True`` raises ``ValueError``.
``jax_threefry_partitionable``
    Only ``True`` (jax's default): random bits are a function of the key and each
    element's global index on every mesh; ``False`` raises ``ValueError``.
``jax_default_prng_impl``
    Only ``"threefry2x32"``.
``jax_default_matmul_precision``
    The default precision of matrix products called with ``precision=None``, process-wide
    (``'float32'``/``'highest'``, ``'tensorfloat32'``/``'high'``, ``'bfloat16'``,
    ``'default'``, or None for float32); ``default_matmul_precision`` blocks override it.
``jax_debug_nans`` / ``jax_debug_infs``
    Only ``False``: ctrainstate does not check every op's result for NaNs or infinities;
    ``True`` raises ``ValueError``.
``jax_disable_jit``
    ``jit`` runs eagerly either way; with ``True`` a jitted function also runs as outside
    ``jit`` (a non-dividing sharding is an error, as it is eagerly).

Settings before first use are passed to the core through the environment variables named
above, so child processes inherit them.

>>> import ctrainstate as cts
>>> cts.config.jax_enable_x64
False
>>> cts.config.update("jax_enable_x64", False)
>>> cts.config.read("jax_threefry_partitionable")
True
"""
from ._src.base.config import __all__, read, update  # noqa: F401
# attribute reads of the options (``config.jax_enable_x64``) and dir(): the options
from ._src.base.config import __dir__, __getattr__  # noqa: F401
