"""Dtype helpers of the layers (mirror of ``flax.linen.dtypes``): ``canonicalize_dtype`` and
``promote_dtype``, with which a layer's ``dtype=`` field (Flax's mixed precision, e.g.
``nn.Dense(..., dtype=jnp.bfloat16)``) casts its inputs and parameters before computing.

The dtypes are those ctrainstate stores: float32, bfloat16, float16 for floats (int32,
uint32, int16, uint16, int8, uint8 and bool for the rest). jax's promotion among them: a 16-bit float with float32 is
float32, bfloat16 with float16 is float32, an integer with a float is the float, and Python
scalars are weak (they take the other operand's dtype).

>>> import numpy as np
>>> from ctrainstate.nn import dtypes
>>> x, w = np.ones((2, 3), np.float32), np.ones((3,), dtypes.bfloat16)
>>> dtypes.canonicalize_dtype(x, w), dtypes.canonicalize_dtype(w), dtypes.canonicalize_dtype(w, dtype=np.float16)
(dtype('float32'), dtype(bfloat16), dtype('float16'))
>>> [str(a.dtype) for a in dtypes.promote_dtype(x, w, dtype=dtypes.bfloat16)]
['bfloat16', 'bfloat16']
"""
from __future__ import annotations

import numpy as np

from .._src.base import dtypes as _dtypes
from .._src.ops import ops as _ops
from .._src.array.abstract import ShapeDtypeStruct
from .._src.array.array import Array

bfloat16 = _dtypes.bfloat16
float16 = _dtypes.float16
float32 = _dtypes.float32

__all__ = ["canonicalize_dtype", "promote_dtype"]

_F32 = np.dtype(np.float32)   # (builtin dtypes are singletons: `is` compares them)


def _dtype_of(x):
    if isinstance(x, (Array, ShapeDtypeStruct)):
        return np.dtype(x.dtype), False
    return _ops._operand_dtype(x)


def canonicalize_dtype(*args, dtype=None, inexact: bool = True) -> np.dtype:
    """``dtype`` when given (checked: a dtype ctrainstate stores; with ``inexact`` a float),
    else the promoted dtype of ``args`` (``None`` entries skipped), made a float with
    ``inexact`` (an integer-only result becomes float32, as in Flax)."""
    if dtype is not None:
        dt = _dtypes.canonicalize(dtype)
        if inexact and dt not in _ops._FLOATS:
            raise ValueError(f"dtype must be inexact (a float dtype): {dt}")
        return dt
    # float32 Arrays (and None entries), at least one: float32, what the loop below gives
    seen = False
    for x in args:
        if x is None:
            continue
        if type(x) is not Array or x._dtype is not _F32:
            break
        seen = True
    else:
        if seen:
            return _F32
    strong, weak_float, others = set(), False, set()
    for x in args:
        if x is None:
            continue
        dt, weak = _dtype_of(x)
        if dt is None:
            continue
        if dt in _ops._FLOATS:
            if weak:
                weak_float = True
            else:
                strong.add(dt)
        else:
            others.add(dt)
    if len(strong) == 1:
        return next(iter(strong))
    if strong or weak_float or inexact:
        return float32
    if not others:
        return _dtypes.int32
    res = None
    for dt in others:       # jax's join: uint8 with int8 is int16
        res = dt if res is None else _dtypes.promote(res, dt)
    return res


def _cast(x, dtype):
    if x is None:
        return None
    if isinstance(x, ShapeDtypeStruct):
        return ShapeDtypeStruct(x.shape, dtype, x.sharding)
    if isinstance(x, Array):
        return x if x.dtype == dtype else _ops.astype(x, dtype)
    return np.asarray(x, dtype=dtype)


def promote_dtype(*args, dtype=None, inexact: bool = True) -> list:
    """``args`` cast to one dtype (:func:`canonicalize_dtype`'s), ``None`` entries kept:
    Arrays on their devices (differentiable, nothing gathered), host values on the host."""
    if inexact and (dtype is None or dtype is np.float32 or dtype is _F32):
        # every argument a float32 Array or None (a float32 layer's inputs, kernel and bias;
        # a norm's input promoted to float32): float32, and each argument as it is (what the
        # general path below gives for these)
        for x in args:
            if x is not None and (type(x) is not Array or x._dtype is not _F32):
                break
        else:
            return list(args)
    dt = canonicalize_dtype(*args, dtype=dtype, inexact=inexact)
    return [_cast(x, dt) for x in args]


def _check_dtype(module) -> None:
    """A layer's ``dtype`` / ``param_dtype`` fields checked now, so a bad value names the
    layer: a float dtype ctrainstate stores (float32, bfloat16, float16) or ``None``."""
    for field in ("dtype", "param_dtype"):
        dt = getattr(module, field, None)
        if dt is None or dt is np.float32 or dt is _F32:
            continue
        try:
            ok = _dtypes.canonicalize(dt) in (_dtypes.float32, _dtypes.bfloat16, _dtypes.float16)
        except TypeError:
            ok = False
        if not ok:
            raise TypeError(f"{type(module).__name__}({field}={dt!r}): expected float32, "
                            f"bfloat16 or float16 (or None)")


from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
