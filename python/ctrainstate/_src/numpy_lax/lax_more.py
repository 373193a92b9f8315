"""More of ``jax.lax``'s primitives, with the strictness of :mod:`ctrainstate._src.numpy_lax.lax_ops` (one
dtype for all operands, no rank broadcasting, jax's accepted dtypes and messages):
comparisons (``eq`` ... ``ge``), bitwise and shift ops, ``population_count`` / ``clz``, the
logical reductions, the remaining float functions (``tan``, ``asin`` ... ``atanh``, ``exp2``,
``cbrt``, ``atan2``, ``nextafter``, ``is_finite``, ``reciprocal``), ``round`` with jax's
``RoundingMethod``, ``dot``, ``batch_matmul`` and ``split``.

The values come from the ``ctrainstate.numpy`` ops (so shardings and gradients are theirs);
integer bit operations are exact (``population_count`` by the SWAR bit count, ``clz`` as the
count of the zeros above the highest set bit), shifts by the bit width or more give jax's
results (0, or the sign fill for ``shift_right_arithmetic``).

>>> import numpy as np
>>> from ctrainstate import lax
>>> np.asarray(lax.population_count(np.array([-1, 7, 0], np.int32))).tolist()
[32, 3, 0]
>>> np.asarray(lax.round(np.array([0.5, -2.5], np.float32))).tolist()    # away from zero
[1.0, -3.0]
"""
from __future__ import annotations

import enum
import operator

import numpy as np

from ..base import dtypes as _dtypes
from ..array.abstract import ShapeDtypeStruct
from .lax_ops import (ANY, FLOAT, _BOOL, _I32, _INTS, _U32, _abstract, _binary, _meta, _np_ops,
                      _placed, _unary)
from .lax_ops import dot_general, integer_pow

__all__ = ["RoundingMethod", "eq", "ne", "lt", "le", "gt", "ge", "bitwise_and", "bitwise_or",
           "bitwise_xor", "bitwise_not", "shift_left", "shift_right_logical",
           "shift_right_arithmetic", "population_count", "clz", "reduce_and", "reduce_or",
           "reduce_xor", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh",
           "atanh", "exp2", "cbrt", "is_finite", "atan2", "nextafter", "reciprocal", "round",
           "dot", "batch_matmul", "split"]

INT = (_INTS, "subtypes of integer")
INT_BOOL = (_INTS + (_BOOL,), "subtypes of integer, bool")
REAL_FLOAT = (FLOAT[0], "subtypes of floating")


class RoundingMethod(enum.IntEnum):
    """``jax.lax.RoundingMethod``: ``AWAY_FROM_ZERO`` (0, ``lax.round``'s default) and
    ``TO_NEAREST_EVEN`` (1); jax's own enum members are accepted too (same values)."""
    AWAY_FROM_ZERO = 0
    TO_NEAREST_EVEN = 1


# --- comparisons -------------------------------------------------------------------------------

def _compare(name, np_name, tip):
    def op(x, y):
        return _binary(name, x, y, ANY, lambda a, b, dt: getattr(_np_ops(), np_name)(a, b), tip)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = (f"``jax.lax.{name}``: the elementwise comparison (``jnp.{np_name}``) of two "
                  f"operands of one dtype (bools too); a bool result, no gradient.")
    return op


eq = _compare("eq", "equal", "equal")
ne = _compare("ne", "not_equal", "not_equal")
lt = _compare("lt", "less", None)
le = _compare("le", "less_equal", None)
gt = _compare("gt", "greater", None)
ge = _compare("ge", "greater_equal", None)


# --- bitwise and shifts ------------------------------------------------------------------------

def bitwise_and(x, y):
    """``jax.lax.bitwise_and``: ``x & y`` of one integer or bool dtype."""
    return _binary("and", x, y, INT_BOOL, lambda a, b, dt: _np_ops().bitwise_and(a, b))


def bitwise_or(x, y):
    """``jax.lax.bitwise_or``: ``x | y`` of one integer or bool dtype."""
    return _binary("or", x, y, INT_BOOL, lambda a, b, dt: _np_ops().bitwise_or(a, b))


def bitwise_xor(x, y):
    """``jax.lax.bitwise_xor``: ``x ^ y`` of one integer or bool dtype."""
    return _binary("xor", x, y, INT_BOOL, lambda a, b, dt: _np_ops().bitwise_xor(a, b))


def bitwise_not(x):
    """``jax.lax.bitwise_not``: ``~x`` (integers; logical not for bools)."""
    return _unary("not", x, INT_BOOL, lambda v: _np_ops().bitwise_not(v))


def _as(v, dt):
    """``v`` converted to ``dt`` (between ints of one width the bits are kept: the
    conversion wraps; to a wider unsigned int an unsigned value is zero-extended)."""
    cnp = _np_ops()
    return v if v.dtype == dt else cnp.astype(v, dt)


# the unsigned and the signed integer dtype of each integer dtype's width
_UNSIGNED_OF = {_dtypes.int32: _U32, _dtypes.uint32: _U32, _dtypes.int16: _dtypes.uint16,
                _dtypes.uint16: _dtypes.uint16, _dtypes.int8: _dtypes.uint8,
                _dtypes.uint8: _dtypes.uint8}
_SIGNED_OF = {_dtypes.int32: _I32, _dtypes.uint32: _I32, _dtypes.int16: _dtypes.int16,
              _dtypes.uint16: _dtypes.int16, _dtypes.int8: _dtypes.int8,
              _dtypes.uint8: _dtypes.int8}


def _clamped_shift(y, dt, width):
    """Shift amounts as ``dt``, those at or beyond the bit width ``width`` (or negative)
    marked: jax gives 0 (or the sign fill) for them, C's shift would be undefined."""
    cnp = _np_ops()
    yu = _as(y, _U32)       # (a negative amount wraps to a huge one)
    return (cnp.greater_equal(yu, np.uint32(width)),
            _as(cnp.minimum(yu, np.uint32(width - 1)), dt))


def shift_left(x, y):
    """``jax.lax.shift_left``: ``x << y`` for one integer dtype; amounts of the bit width or
    more give 0."""
    def f(a, b, dt):
        cnp = _np_ops()
        a, b = _placed(a, dt), _placed(b, dt)
        big, s = _clamped_shift(b, dt, 8 * dt.itemsize)
        return cnp.where(big, np.zeros((), dt), cnp.left_shift(a, s))
    return _binary("shift_left", x, y, INT, f)


def shift_right_logical(x, y):
    """``jax.lax.shift_right_logical``: ``x >> y`` filling with zeros (signed ints too, on
    their bits); amounts of the bit width or more give 0."""
    def f(a, b, dt):
        cnp = _np_ops()
        a, b = _placed(a, dt), _placed(b, dt)
        ut = _UNSIGNED_OF[dt]
        big, s = _clamped_shift(b, ut, 8 * dt.itemsize)
        r = cnp.where(big, np.zeros((), ut), cnp.right_shift(_as(a, ut), s))
        return _as(r, dt)
    return _binary("shift_right_logical", x, y, INT, f)


def shift_right_arithmetic(x, y):
    """``jax.lax.shift_right_arithmetic``: ``x >> y`` filling with the sign bit (unsigned ints
    too, on their bits); amounts of the bit width or more give the sign fill (0 or all
    ones)."""
    def f(a, b, dt):
        cnp = _np_ops()
        a, b = _placed(a, dt), _placed(b, dt)
        st = _SIGNED_OF[dt]
        _, s = _clamped_shift(b, st, 8 * dt.itemsize)   # past the width: width - 1, the fill
        return _as(cnp.right_shift(_as(a, st), s), dt)
    return _binary("shift_right_arithmetic", x, y, INT, f)


def _popcount_u32(u):
    cnp = _np_ops()
    c1, c2, c4 = np.uint32(0x55555555), np.uint32(0x33333333), np.uint32(0x0F0F0F0F)
    u = cnp.subtract(u, cnp.bitwise_and(cnp.right_shift(u, np.uint32(1)), c1))
    u = cnp.add(cnp.bitwise_and(u, c2), cnp.bitwise_and(cnp.right_shift(u, np.uint32(2)), c2))
    u = cnp.bitwise_and(cnp.add(u, cnp.right_shift(u, np.uint32(4))), c4)
    return cnp.right_shift(cnp.multiply(u, np.uint32(0x01010101)), np.uint32(24))


def _as_u32_bits(v):
    """An integer Array's bit pattern, zero-extended to uint32 (int8 -1 -> 0xff)."""
    return _as(_as(v, _UNSIGNED_OF[v.dtype]), _U32)


def population_count(x):
    """``jax.lax.population_count``: the number of set bits of each integer (of its bit
    pattern for signed ints: ``population_count(int32(-1))`` is 32, of int8 -1 8)."""
    return _unary("population_count", x, INT,
                  lambda v: _as(_popcount_u32(_as_u32_bits(v)), v.dtype))


def clz(x):
    """``jax.lax.clz``: the number of leading zero bits of each integer in its own width
    (32 for an int32 0, 8 for an int8 0)."""
    def f(v):
        cnp = _np_ops()
        u = _as_u32_bits(v)
        for k in (1, 2, 4, 8, 16):      # every bit below the highest set one set too
            u = cnp.bitwise_or(u, cnp.right_shift(u, np.uint32(k)))
        n = _popcount_u32(cnp.bitwise_not(u))      # leading zeros of the 32-bit pattern
        return _as(cnp.subtract(n, np.uint32(32 - 8 * v.dtype.itemsize)), v.dtype)
    return _unary("clz", x, INT, f)


def _logical_reduce(who, operand, axes, fold, identity):
    shape, dt = _meta(operand, who)
    if dt not in INT_BOOL[0]:
        raise TypeError(f"logical reduction requires operand dtype bool or int, got {dt.name}.")
    try:
        ax = tuple(operator.index(a) for a in axes)
    except TypeError:
        raise TypeError(f"{who}: axes must be a sequence of ints, got {axes!r}") from None
    if any(not 0 <= a < len(shape) for a in ax) or len(set(ax)) != len(ax):
        raise ValueError(f"{who}: axes {ax} must be distinct and within the operand's "
                         f"{len(shape)} dimensions (lax takes no negative axes)")
    out_shape = tuple(n for d, n in enumerate(shape) if d not in ax)
    if _abstract(operand):
        return ShapeDtypeStruct(out_shape, dt)
    cnp = _np_ops()
    x = _placed(operand, dt)
    if not ax:
        return cnp.copy(x)
    keep = [d for d in range(len(shape)) if d not in ax]
    x = cnp.transpose(x, tuple(ax) + tuple(keep)) if tuple(ax) + tuple(keep) != \
        tuple(range(len(shape))) else x
    k = int(np.prod([shape[a] for a in ax], dtype=np.int64))
    x = cnp.reshape(x, (k,) + out_shape)
    if k == 0:
        return cnp.full(out_shape, identity(dt), dtype=dt)
    while x.shape[0] > 1:           # fold halves: log2(k) elementwise ops, exact
        n = x.shape[0]
        h = n // 2
        folded = fold(x[:h], x[h:2 * h])
        x = cnp.concatenate([folded, x[2 * h:]], axis=0) if n % 2 else folded
    return cnp.reshape(x, out_shape)


def _all_ones(dt):
    return True if dt == _BOOL else np.array(-1).astype(dt)[()]   # every bit set


def reduce_and(operand, axes):
    """``jax.lax.reduce_and``: the bitwise (bools: logical) and over ``axes``; an empty
    reduction gives all ones (``True``, ``-1``, ``2**32 - 1``)."""
    return _logical_reduce("reduce_and", operand, axes, lambda a, b: _np_ops().bitwise_and(a, b),
                           _all_ones)


def reduce_or(operand, axes):
    """``jax.lax.reduce_or``: the bitwise (bools: logical) or over ``axes``; empty: 0."""
    return _logical_reduce("reduce_or", operand, axes, lambda a, b: _np_ops().bitwise_or(a, b),
                           lambda dt: np.zeros((), dt)[()])


def reduce_xor(operand, axes):
    """``jax.lax.reduce_xor``: the bitwise (bools: parity) xor over ``axes``; empty: 0."""
    return _logical_reduce("reduce_xor", operand, axes, lambda a, b: _np_ops().bitwise_xor(a, b),
                           lambda dt: np.zeros((), dt)[()])


# --- float functions ---------------------------------------------------------------------------

def _float_fn(name, np_name, accepted=FLOAT):
    def op(x):
        return _unary(name, x, accepted, lambda v: getattr(_np_ops(), np_name)(v))
    op.__name__ = op.__qualname__ = name
    op.__doc__ = (f"``jax.lax.{name}``: ``jnp.{np_name}`` for float operands only (integers "
                  f"and bools are a ``TypeError``, as in jax); differentiable.")
    return op


tan = _float_fn("tan", "tan")
asin = _float_fn("asin", "arcsin")
acos = _float_fn("acos", "arccos")
atan = _float_fn("atan", "arctan")
sinh = _float_fn("sinh", "sinh")
cosh = _float_fn("cosh", "cosh")
asinh = _float_fn("asinh", "arcsinh")
acosh = _float_fn("acosh", "arccosh")
atanh = _float_fn("atanh", "arctanh")
exp2 = _float_fn("exp2", "exp2")
cbrt = _float_fn("cbrt", "cbrt")


def is_finite(x):
    """``jax.lax.is_finite``: bool, True where ``x`` is neither infinite nor NaN (floats
    only)."""
    return _unary("is_finite", x, REAL_FLOAT, lambda v: _np_ops().isfinite(v))


def atan2(x, y):
    """``jax.lax.atan2``: the angle of ``(y, x)`` -- ``atan2(x, y)`` is ``arctan(x / y)`` in the
    right quadrant (``jnp.arctan2(x, y)``), floats of one dtype; differentiable."""
    return _binary("atan2", x, y, FLOAT, lambda a, b, dt: _np_ops().arctan2(a, b), "arctan2")


def nextafter(x1, x2):
    """``jax.lax.nextafter``: the float next to ``x1`` toward ``x2`` (one float dtype; not
    differentiable, as in jax)."""
    return _binary("nextafter", x1, x2, REAL_FLOAT,
                   lambda a, b, dt: _np_ops().nextafter(a, b))


def reciprocal(x):
    """``jax.lax.reciprocal``: ``1 / x`` (``integer_pow(x, -1)``; integers are refused, as
    jax's integer_pow refuses negative powers of them)."""
    return integer_pow(x, -1)


def round(x, rounding_method=RoundingMethod.AWAY_FROM_ZERO):  # noqa: A001 - lax's name
    """``jax.lax.round``: to the nearest integer, ties away from zero (the default,
    ``RoundingMethod.AWAY_FROM_ZERO``) or to even (``TO_NEAREST_EVEN``); floats only, the sign
    of zero kept, NaN and infinities unchanged; the gradient is zero, as in jax."""
    try:
        method = RoundingMethod(int(rounding_method))
    except (TypeError, ValueError):
        raise ValueError(f"{rounding_method!r} is not a valid RoundingMethod") from None

    def f(v):
        cnp = _np_ops()
        if method == RoundingMethod.TO_NEAREST_EVEN:
            return cnp.round(v)
        t = cnp.trunc(v)
        # |v - trunc(v)| is exact; at >= 0.5 step away from zero
        away = cnp.greater_equal(cnp.abs(cnp.subtract(v, t)), np.asarray(0.5, v.dtype))
        return cnp.where(away, cnp.add(t, cnp.sign(v)), t)
    return _unary("round", x, FLOAT, f)


# --- products and split ------------------------------------------------------------------------

def dot(lhs, rhs, precision=None, preferred_element_type=None):
    """``jax.lax.dot``: the vector-vector, matrix-vector, vector-matrix or matrix-matrix
    product (``lhs``'s last dimension against ``rhs``'s first); other ranks need
    :func:`~ctrainstate.lax.dot_general`, as in jax. ``precision`` and
    ``preferred_element_type`` as ``dot_general``'s."""
    (ls, _), (rs, _) = _meta(lhs, "dot"), _meta(rhs, "dot")
    if 1 <= len(ls) <= 2 and 1 <= len(rs) <= 2 and ls[-1] == rs[0]:
        return dot_general(lhs, rhs, (((len(ls) - 1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=preferred_element_type)
    raise ValueError(f"jax.lax.dot: dimension_numbers must be specified when not performing "
                     f"simple un-batched matrix-matrix, matrix-vector, or vector-vector "
                     f"products; got lhs_shape={tuple(ls)} rhs_shape={tuple(rs)}")


def batch_matmul(lhs, rhs, precision=None):
    """``jax.lax.batch_matmul``: matrix products over the leading batch dimensions (operands
    of one rank >= 2, equal batch dimensions)."""
    (ls, _), (rs, _) = _meta(lhs, "batch_matmul"), _meta(rhs, "batch_matmul")
    if len(ls) != len(rs):
        raise ValueError(f"Arguments to batch_matmul must have same ndim, got {len(ls)}, "
                         f"{len(rs)}")
    if len(ls) < 2:
        raise ValueError(f"Arguments to batch_matmul must be at least 2D, got {len(ls)}, "
                         f"{len(rs)}")
    nb = len(ls) - 2
    return dot_general(lhs, rhs, (((nb + 1,), (nb,)), (tuple(range(nb)), tuple(range(nb)))),
                       precision=precision)


def split(operand, sizes, axis=0):
    """``jax.lax.split``: ``operand`` cut along ``axis`` into pieces of ``sizes`` (which must
    add up to that dimension), a list; differentiable."""
    shape, dt = _meta(operand, "split")
    try:
        sz = [operator.index(s) for s in sizes]
        a = operator.index(axis)
    except TypeError:
        raise TypeError(f"split: sizes must be ints and axis an int, got {sizes!r}, "
                        f"{axis!r}") from None
    if not -len(shape) <= a < len(shape):
        raise ValueError(f"axis {axis} is out of bounds for array of dimension {len(shape)}")
    a %= len(shape)
    if any(s < 0 for s in sz):
        raise ValueError(f"Sizes passed to split must be nonnegative, got {sz}")
    if sum(sz) != shape[a]:
        raise ValueError(f"Sum of sizes {sum(sz)} must be equal to dimension {a} of the "
                         f"operand shape {list(shape)}")
    if _abstract(operand):
        return [ShapeDtypeStruct(shape[:a] + (s,) + shape[a + 1:], dt) for s in sz]
    x = _placed(operand, dt)
    out, start = [], 0
    for s in sz:
        idx = [slice(None)] * len(shape)
        idx[a] = slice(start, start + s)
        out.append(x[tuple(idx)])
        start += s
    return out


