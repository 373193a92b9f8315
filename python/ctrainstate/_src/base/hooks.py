"""Calls from a lower layer into an upper one, without an import.

The package's Python is in one-way layers (base, array, ops, the numpy/lax breadth, autodiff,
the model libraries, jit, the applications, the ports): a module imports only modules of its
own or lower layers, and never inside a function. Where a lower layer must call an upper one
(an Array method that slices or casts, the operators that run numpy functions), the upper
module registers itself here when it is imported (:func:`provide`, first thing in the
module) and the lower one looks it up at call time (:func:`upper`). ``import ctrainstate``
imports every layer, so by the time any function runs every provider is registered.

>>> from ctrainstate._src.base import hooks as _hooks
>>> _hooks.upper("numpy").__name__
'ctrainstate._src.numpy_lax.numpy'
"""
from __future__ import annotations

import sys
import types

_PROVIDED: dict[str, types.ModuleType] = {}


def provide(key: str, module_name: str) -> None:
    """Register the module ``module_name`` (being imported) under ``key`` for lower layers."""
    _PROVIDED[key] = sys.modules[module_name]


def upper(key: str) -> types.ModuleType:
    """The upper-layer module registered under ``key``."""
    try:
        return _PROVIDED[key]
    except KeyError:
        raise ImportError(f"ctrainstate: {key!r} is used before its module was imported "
                          f"(import ctrainstate first)") from None


def provided() -> dict[str, str]:
    """``{key: module name}`` of every registered provider."""
    return {k: m.__name__ for k, m in _PROVIDED.items()}
