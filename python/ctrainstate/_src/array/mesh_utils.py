"""The implementation of :mod:`ctrainstate.mesh_utils` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..base.devices import Device, devices as _devices
from ..base import dtypes as _dtypes
from .sharding import Mesh

__all__ = ["create_device_mesh", "make_mesh"]


def _device_list(devices, who: str) -> list:
    """``devices`` (None: all devices) as a list of Devices, or a TypeError naming it."""
    if devices is None:
        return list(_devices())
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
        raise TypeError(f"{who}: devices must be a sequence of Devices, got "
                        f"{type(devices).__name__}")
    devs = list(np.asarray(devices, dtype=object).reshape(-1)) if isinstance(
        devices, np.ndarray) else list(devices)
    for d in devs:
        if not isinstance(d, Device):
            raise TypeError(f"{who}: devices must be a sequence of Devices, got an element of "
                            f"type {type(d).__name__} ({d!r})")
    return devs


def _more_devices_hint(need, devs) -> str:
    """How to get ``need`` devices of the platform of ``devs``."""
    if devs and getattr(devs[0], "platform", "cpu") == "gpu":
        return (f"set CTRAINSTATE_GPU_SPLIT=k before first use to split each GPU into k "
                f"logical devices (k * number of GPUs >= {need})")
    return f"set CTRAINSTATE_NUM_CPU_DEVICES={need} before first use for CPU virtual devices"


def create_device_mesh(mesh_shape: Sequence[int], devices=None, *,
                       contiguous_submeshes: bool = False,
                       allow_split_physical_axes: bool = False) -> np.ndarray:
    """An ndarray of devices of shape ``mesh_shape``, in device-id order.

    ``contiguous_submeshes`` and ``allow_split_physical_axes`` are accepted for jax's
    signature and change nothing: devices here have no physical topology to follow.

    >>> import ctrainstate as cts
    >>> from ctrainstate import mesh_utils
    >>> mesh_utils.create_device_mesh((1,), cts.devices()[:1]).shape
    (1,)
    """
    shape = _dtypes.int_tuple(mesh_shape, "create_device_mesh: mesh_shape")
    if any(s < 1 for s in shape):
        raise ValueError(f"create_device_mesh: mesh_shape {shape} must have positive sizes")
    devs = _device_list(devices, "create_device_mesh")
    need = math.prod(shape)
    if need != len(devs):
        raise ValueError(
            f"mesh_shape {shape} needs {need} devices but {len(devs)} were given; "
            f"{_more_devices_hint(need, devs)}")
    arr = np.empty(len(devs), dtype=object)
    arr[:] = devs
    return arr.reshape(shape)


def make_mesh(axis_shapes: Sequence[int], axis_names: Sequence[str], *, devices=None) -> Mesh:
    """A :class:`Mesh` of the given axis sizes and names over the first devices.

    >>> import ctrainstate as cts
    >>> cts.make_mesh((1,), ('x',)).shape['x']
    1
    """
    if isinstance(axis_shapes, (int, np.integer)):   # make_mesh(8, ('x',)): jax refuses it too
        raise TypeError(f"make_mesh: axis_shapes must be a sequence of integers, got "
                        f"{type(axis_shapes).__name__} {axis_shapes!r}; for one axis write "
                        f"({axis_shapes},)")
    shape = _dtypes.int_tuple(axis_shapes, "make_mesh: axis_shapes")
    if isinstance(axis_names, str):
        axis_names = (axis_names,)
    try:
        axis_names = tuple(axis_names)
    except TypeError:
        raise TypeError(f"make_mesh: axis_names must be a sequence of strings, got "
                        f"{axis_names!r}") from None
    if len(shape) != len(tuple(axis_names)):
        raise ValueError(
            f"make_mesh: {len(shape)} axis sizes {shape} but {len(tuple(axis_names))} names "
            f"{tuple(axis_names)!r}")
    devs = _device_list(devices, "make_mesh")
    need = math.prod(shape)
    if need > len(devs):
        raise ValueError(
            f"make_mesh: axis sizes {shape} need {need} devices but only {len(devs)} exist; "
            f"{_more_devices_hint(need, devs)}")
    return Mesh(create_device_mesh(shape, devs[:need]), tuple(axis_names))


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
