"""The dtypes ctrainstate stores and their conversion from numpy.

Codes match ``ct_dtype`` in csrc/core/ct_dtype.h. Like JAX with x64 disabled,
64-bit inputs are narrowed (float64 -> float32, int64 -> int32, uint64 -> uint32).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

float32 = np.dtype(np.float32)
float16 = np.dtype(np.float16)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
int32 = np.dtype(np.int32)
uint32 = np.dtype(np.uint32)
bool_ = np.dtype(np.bool_)

_CODES = {float32: 0, float16: 1, bfloat16: 2, int32: 3, uint32: 4, bool_: 5}
_BY_CODE = {v: k for k, v in _CODES.items()}
_NARROW = {
    np.dtype(np.float64): float32,
    np.dtype(np.int64): int32,
    np.dtype(np.uint64): uint32,
}

SUPPORTED = tuple(_CODES)

# numpy's AxisError: numpy.exceptions from numpy 1.25 on, the top-level name before (numpy 2
# removed that one)
AxisError = np.exceptions.AxisError if hasattr(np, "exceptions") else np.AxisError


def int_tuple(seq, what: str, scalar: bool = False, expected: str | None = None) -> tuple:
    """A shape-like argument as a tuple of Python ints, converted once at the boundary as
    dtypes are: integers only (``operator.index``, so ``(2.5,)`` is refused rather than
    truncated, as jax refuses it). ``scalar``: a lone integer is a 1-tuple. Otherwise a
    TypeError saying "<what> must be <expected>, got <seq>"."""
    import operator
    try:
        if scalar and (not hasattr(seq, "__iter__") or getattr(seq, "ndim", None) == 0):
            return (operator.index(seq),)   # an int, a numpy integer, a 0-d array
        return tuple(operator.index(d) for d in seq)
    except TypeError:
        if expected is None:
            expected = ("an integer or a sequence of integers" if scalar
                        else "a sequence of integers")
        raise TypeError(f"{what} must be {expected}, got {seq!r}") from None


def canonicalize(dtype) -> np.dtype:
    """Return the supported numpy dtype for ``dtype`` or raise ``TypeError``."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{dtype!r} is not a dtype") from e
    if not dt.isnative:
        dt = dt.newbyteorder("=")
    dt = _NARROW.get(dt, dt)
    if dt not in _CODES:
        names = ", ".join(str(d) for d in SUPPORTED)
        raise TypeError(f"dtype {dt} is not supported; ctrainstate stores {names}")
    return dt


def code(dtype) -> int:
    """Core dtype code of a (canonical) dtype."""
    return _CODES[canonicalize(dtype)]


def from_code(c: int) -> np.dtype:
    return _BY_CODE[c]
