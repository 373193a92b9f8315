"""The dtypes ctrainstate stores and their conversion from numpy.

Codes are ``ct_dtype``'s (csrc/core/ct_dtype.h), read from ``_C.dtype_names``. Like JAX with
x64 disabled, 64-bit inputs are narrowed (float64 -> float32, int64 -> int32, uint64 ->
uint32); complex and other dtypes raise ``TypeError`` naming the dtype.
"""
from __future__ import annotations

import operator
import ml_dtypes
import numpy as np

from ... import _C

float32 = np.dtype(np.float32)
float16 = np.dtype(np.float16)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
int32 = np.dtype(np.int32)
uint32 = np.dtype(np.uint32)
bool_ = np.dtype(np.bool_)
uint8 = np.dtype(np.uint8)
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
uint16 = np.dtype(np.uint16)

_CODES = {(bfloat16 if name == "bfloat16" else np.dtype(name)): code
          for code, name in enumerate(_C.dtype_names)}
_BY_CODE = {v: k for k, v in _CODES.items()}
_NARROW = {
    np.dtype(np.float64): float32,
    np.dtype(np.int64): int32,
    np.dtype(np.uint64): uint32,
}

SUPPORTED = tuple(_CODES)
# the integer dtypes (not bool), widest first, and the 8/16-bit ones
INTEGERS = (int32, uint32, int16, uint16, int8, uint8)
NARROW_INTS = (int16, uint16, int8, uint8)

UNSIGNED = (uint32, uint16, uint8)

# jax's type promotion lattice (jax._src.dtypes) on the stored dtypes, x64 disabled: an edge
# a -> b means a promotes to b. Where jax would reach int64 (uint32 with a signed int) it
# canonicalises to int32; every int reaches both 16-bit floats, and they join in float32.
_LATTICE = {
    bool_: (uint8, int8), uint8: (int16, uint16), uint16: (int32, uint32), uint32: (int32,),
    int8: (int16,), int16: (int32,), int32: (bfloat16, float16), bfloat16: (float32,),
    float16: (float32,), float32: (),
}


def _reachable(lattice, node) -> frozenset:
    """``node`` and every type above it in a promotion ``lattice`` ({type: types right
    above it}); the least upper bound of two types is the least type both reach."""
    seen, todo = {node}, [node]
    while todo:
        for nxt in lattice[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return frozenset(seen)


_ABOVE = {n: _reachable(_LATTICE, n) for n in _LATTICE}


def promote(a, b) -> np.dtype:
    """jax's promotion of two stored dtypes (x64 disabled): the least upper bound in the
    lattice above, e.g. uint8 with int8 -> int16, uint16 with int8 -> int32, uint32 with
    int32 -> int32, int16 with bfloat16 -> bfloat16, bfloat16 with float16 -> float32."""
    common = _ABOVE[a] & _ABOVE[b]
    for n in common:
        if _ABOVE[n] == common:
            return n
    raise AssertionError(f"no join of {a} and {b}")   # the lattice has a top: unreachable


# numpy's AxisError: numpy.exceptions from numpy 1.25 on, the top-level name before (numpy 2
# removed that one)
AxisError = np.exceptions.AxisError if hasattr(np, "exceptions") else np.AxisError


def int_tuple(seq, what: str, scalar: bool = False, expected: str | None = None) -> tuple:
    """A shape-like argument as a tuple of Python ints, converted once at the boundary as
    dtypes are: integers only (``operator.index``, so ``(2.5,)`` is refused rather than
    truncated, as jax refuses it). ``scalar``: a lone integer is a 1-tuple. Otherwise a
    TypeError saying "<what> must be <expected>, got <seq>"."""
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
