"""The implementation of :mod:`ctrainstate.debug` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import numpy as np
import builtins
from typing import Callable

from ..array.array import visualize_array_sharding, visualize_sharding
from ... import _C
from ..array.array import Array
from ..base.tree_util import tree_map

__all__ = ["print", "callback", "visualize_array_sharding", "visualize_sharding",
           "inspect_array_sharding"]


def _read(v):
    # under jit, a traced value: printed at every call, so the function runs eagerly (it
    # cannot be replayed)
    _C.trace_break("debug.print / debug.callback of a traced value (runs eagerly)", v)
    return np.asarray(v)


def _host(tree):
    return tree_map(lambda v: _read(v) if isinstance(v, Array) else v, tree)


def print(fmt: str, *args, ordered: bool = False, **kwargs) -> None:  # noqa: A001 - jax's name
    """``jax.debug.print``: ``fmt.format(*args, **kwargs)`` of the host values, printed."""
    if not isinstance(fmt, str):
        raise TypeError(f"debug.print: the format must be a string, got {type(fmt).__name__}")
    builtins.print(fmt.format(*_host(args), **_host(kwargs)))


def callback(fn: Callable, *args, ordered: bool = False, **kwargs) -> None:
    """``jax.debug.callback``: ``fn(*args, **kwargs)`` with Arrays as numpy arrays; its
    return value is dropped, as in jax."""
    if not callable(fn):
        raise TypeError(f"debug.callback: expected a callable, got {type(fn).__name__}")
    fn(*_host(args), **_host(kwargs))


def inspect_array_sharding(value, *, callback: Callable) -> None:
    """``jax.debug.inspect_array_sharding``: ``callback(value.sharding)`` for an Array.

    >>> import numpy as np, ctrainstate as cts
    >>> seen = []
    >>> cts.debug.inspect_array_sharding(cts.device_put(np.zeros(2)), callback=seen.append)
    >>> seen
    [SingleDeviceSharding(device=CpuDevice(id=0))]
    """
    if not callable(callback):
        raise TypeError(f"inspect_array_sharding: callback must be callable, got "
                        f"{type(callback).__name__}")
    if not isinstance(value, Array):
        raise TypeError(f"inspect_array_sharding: expected an Array, got {type(value).__name__}")
    callback(value.sharding)


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
