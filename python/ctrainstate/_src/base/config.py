"""The implementation of :mod:`ctrainstate.config` (which re-exports its API; the module
docstring is there). The options' values live here (``_values``, the environment, the device
and precision modules)."""
from __future__ import annotations

import os as _os

from . import devices as _devices
from ... import _C as C
from . import precision as _precision

__all__ = ["update", "read"]

_values = {
    "jax_enable_x64": False,
    "jax_threefry_partitionable": True,
    "jax_default_prng_impl": "threefry2x32",
    "jax_disable_jit": False,
    "jax_debug_nans": False,
    "jax_debug_infs": False,
}

_ENV = {
    "ctrainstate_num_cpu_devices": "CTRAINSTATE_NUM_CPU_DEVICES",
    "ctrainstate_cpu_device_memory": "CTRAINSTATE_CPU_DEVICE_MEMORY",
    "ctrainstate_gpu_split": "CTRAINSTATE_GPU_SPLIT",
}
_ALIASES = {"jax_num_cpu_devices": "ctrainstate_num_cpu_devices"}

_NAMES = sorted(set(_values) | set(_ENV) | set(_ALIASES)
                | {"jax_platforms", "jax_default_matmul_precision"})


def _unknown(name) -> AttributeError:
    return AttributeError(f"Unrecognized config option: {name!r}; ctrainstate's options are "
                          f"{', '.join(_NAMES)}")


def _int_option(name, value, minimum, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        want = "an int or None" if allow_none else "an int"
        raise TypeError(f"config.update({name!r}, ...): expected {want}, got {value!r}")
    if value < minimum:
        raise ValueError(f"config.update({name!r}, ...): expected at least {minimum}, got "
                         f"{value}")
    return value


def _created_count(platform: str) -> int:
    return len(C.device_ids(platform))


def _set_env_option(user_name: str, name: str, value) -> None:
    env = _ENV[name]
    if name == "ctrainstate_num_cpu_devices":
        v = _int_option(user_name, value, 1)
    elif name == "ctrainstate_cpu_device_memory":
        v = _int_option(user_name, value, 1, allow_none=True)
    else:
        v = _int_option(user_name, value, 1)
    if _devices._created:
        if name == "ctrainstate_num_cpu_devices" and v == _created_count("cpu"):
            return   # the count the devices already have: nothing to change
        raise RuntimeError(
            f"config.update({user_name!r}, {value!r}): the devices were already created (with "
            f"{_created_count('cpu')} CPU devices) and read this setting then; call "
            f"config.update right after `import ctrainstate`, before anything uses devices, "
            f"or set {env} in the environment")
    if v is None:
        _os.environ.pop(env, None)
    else:
        _os.environ[env] = str(v)
    if name == "ctrainstate_num_cpu_devices":
        _devices._requested_cpu = v


def _set_platforms(value) -> None:
    if value is None or value == "":
        plats = None
    elif isinstance(value, str):
        plats = tuple(_devices._normalize_backend(p.strip()) for p in value.split(","))
    else:
        raise TypeError(f"config.update('jax_platforms', ...): expected a string like 'cpu' or "
                        f"'cuda,cpu', or None, got {value!r}")
    if _devices._created and plats != _devices._platforms:
        raise RuntimeError("config.update('jax_platforms', ...): the devices were already "
                           "created; set it right after `import ctrainstate`")
    _devices._platforms = plats


def update(name: str, value) -> None:
    """Set option ``name`` (see the module docstring for the options and when each may be
    set).

    >>> import ctrainstate as cts
    >>> cts.config.update("jax_enable_x64", True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: config.update('jax_enable_x64', True): ctrainstate stores 32-bit values only ...
    """
    if not isinstance(name, str):
        raise TypeError(f"config.update: the option name must be a string, got {name!r}")
    key = _ALIASES.get(name, name)
    if key in _ENV:
        _set_env_option(name, key, value)
    elif key == "jax_platforms":
        _set_platforms(value)
    elif key == "jax_enable_x64":
        if value:
            raise ValueError(
                f"config.update({name!r}, {value!r}): ctrainstate stores 32-bit values only "
                f"(float32, int32, uint32, float16, bfloat16, bool); 64-bit inputs are "
                f"narrowed, as in jax without x64")
    elif key == "jax_threefry_partitionable":
        if not value:
            raise ValueError(
                f"config.update({name!r}, {value!r}): ctrainstate's random bits are always "
                f"partitionable (a function of the key and each element's global index, the "
                f"same on every mesh), as jax's default True")
    elif key == "jax_default_prng_impl":
        if value != "threefry2x32":
            raise ValueError(f"config.update({name!r}, {value!r}): ctrainstate implements "
                             f"'threefry2x32' only")
    elif key == "jax_disable_jit":
        _values[key] = bool(value)
    elif key == "jax_default_matmul_precision":
        _precision.set_process_default(value)
    elif key in ("jax_debug_nans", "jax_debug_infs"):
        if value:
            raise ValueError(f"config.update({name!r}, {value!r}): ctrainstate does not check "
                             f"each op's result for NaNs or infinities (use jnp.isfinite on "
                             f"the values you want to check)")
    else:
        raise _unknown(name)


def read(name: str):
    """The value of option ``name``; for the device settings, the value in effect (the
    environment's before first use, the devices' after it).

    >>> import ctrainstate as cts
    >>> cts.config.read("jax_num_cpu_devices") == cts.device_count("cpu")
    True
    """
    if not isinstance(name, str):
        raise TypeError(f"config.read: the option name must be a string, got {name!r}")
    key = _ALIASES.get(name, name)
    if key == "ctrainstate_num_cpu_devices":
        if _devices._created:
            return _created_count("cpu")
        return int(_os.environ.get(_ENV[key]) or 1)
    if key in _ENV:
        v = _os.environ.get(_ENV[key])
        return int(v) if v else (1 if key == "ctrainstate_gpu_split" else None)
    if key == "jax_platforms":
        return None if _devices._platforms is None else ",".join(_devices._platforms)
    if key == "jax_default_matmul_precision":
        return _precision.process_default_name()
    if key in _values:
        return _values[key]
    raise _unknown(name)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    if name in _NAMES:
        return read(name)
    raise AttributeError(f"module 'ctrainstate.config' has no attribute {name!r}")


def __dir__():
    return sorted(__all__ + _NAMES)
