"""``jax.lax``'s primitives on (sharded) Arrays: the strict forms of the ``ctrainstate.numpy``
ops that Flax / t5x / HuggingFace model code calls through ``jax.lax``.

lax differs from jnp in what it accepts, not in what it computes: no implicit dtype promotion
(operands must have one dtype, a ``TypeError`` otherwise; a Python ``int`` is int32, a
``float`` float32, a ``bool`` bool, numpy 64-bit values narrow to 32 bits), no rank
broadcasting (binary operands have one rank, each dimension equal or 1, or are 0-d), each op
its own set of dtypes (``exp`` only floats, ``add`` no bools, ...), and non-negative axes.
The checks and messages follow jax 0.10's (measured with live jax). The values come from the
differentiable ops of :mod:`ctrainstate._src.ops.ops`, :mod:`ctrainstate._src.ops.elementwise`,
:mod:`ctrainstate._src.ops.slicing` and :mod:`ctrainstate._src.ops.move`, so sharding propagation and
gradients are theirs. Inside ``eval_shape`` every op here returns a ``ShapeDtypeStruct``.

>>> import numpy as np
>>> from ctrainstate import lax
>>> np.asarray(lax.div(np.array([-7, 7], np.int32), np.int32(2))).tolist()    # truncates
[-3, 3]
>>> np.asarray(lax.pad(np.array([1., 2., 3.], np.float32), 0., [(1, -1, 1)])).tolist()
[0.0, 1.0, 0.0, 2.0, 0.0]
"""
from __future__ import annotations

import builtins
import math
import operator

import numpy as np

from ..base import dtypes as _dtypes
from ..array.abstract import ShapeDtypeStruct, is_abstract
from ..array.array import Array
from ..ops import elementwise as ew, ops as o
from . import numpy as cnp
from ..ops.move import (_argsort_host, _placed_like, _prod_f32, _sort_keys, flip, prod,
                        take_along_axis)
from ..ops.slicing import _fresh as fresh, concatenate as join, getitem
from ..array.array import device_put
from ..base.hooks import upper as _upper

_F32, _BF16, _F16 = _dtypes.float32, _dtypes.bfloat16, _dtypes.float16
_I32, _U32, _BOOL = _dtypes.int32, _dtypes.uint32, _dtypes.bool_
_FLOATS = (_F32, _BF16, _F16)
_INTS = _dtypes.INTEGERS
_S = builtins.slice     # (this module defines lax's slice, max, min, abs and pow)

# the dtype sets jax's lax ops accept, with jax's wording
FLOAT = (_FLOATS, "subtypes of floating, complexfloating")
NUMBER = (_FLOATS + _INTS, "subtypes of integer, floating, complexfloating")
SIGNED = (_FLOATS + (_I32, _dtypes.int16, _dtypes.int8), "subtypes of floating, complexfloating, signedinteger")
REAL = (_FLOATS + _INTS, "subtypes of integer, floating")
ANY = (_FLOATS + _INTS + (_BOOL,), "any dtype")


def _ops():
    return o


def _np_ops():
    return cnp


# --- operand typing ---------------------------------------------------------------------------

def _meta(v, who: str):
    """(shape, dtype) of a lax operand as jax types it: Python ``bool`` / ``int`` / ``float``
    are bool / int32 / float32 (0-d), numpy values are narrowed as ``device_put`` does."""
    if isinstance(v, (Array, ShapeDtypeStruct)):
        return tuple(v.shape), np.dtype(v.dtype)
    if isinstance(v, (bool, np.bool_)):
        return (), _BOOL
    if isinstance(v, int):
        if not -(1 << 31) <= v < (1 << 31):
            raise OverflowError(f"{who}: Python int {v} is too large to convert to int32")
        return (), _I32
    if isinstance(v, float):
        return (), _F32
    try:
        h = np.asarray(v)
    except Exception:     # noqa: BLE001 - anything numpy cannot read is no array
        h = None
    if h is None or h.dtype == object or h.dtype.kind in "USc":
        raise TypeError(f"{who}: expected an array, a numpy value or a Python scalar, got "
                        f"{type(v).__name__} {v!r}")
    return h.shape, _dtypes.canonicalize(h.dtype)


def _data(v, dt):
    """``v`` for the computation: an Array as it is, a host value as a numpy array of its lax
    dtype (so that the jnp-style ops below see one strong dtype)."""
    if isinstance(v, (Array, ShapeDtypeStruct)):
        return v
    return np.asarray(v, dtype=dt)


def _placed(v, dt):
    """``v`` as an Array (host values placed as ``device_put`` places them)."""
    return _ops()._lift_any(_data(v, dt))


def _fresh(x):
    """A new Array equal to ``x`` (recorded as the identity for floats), for an op that
    changes nothing: the result is never the caller's own Array."""
    return fresh(x)


def _abstract(*vals) -> bool:
    return is_abstract() or any(isinstance(v, ShapeDtypeStruct) for v in vals)


def _check_kind(who: str, dt, accepted, pos=None):
    dts, words = accepted
    if dt not in dts:
        at = "" if pos is None else f" at position {pos}"
        raise TypeError(f"{who} does not accept dtype {dt.name}{at}. Accepted dtypes{at} are "
                        f"{words}.")


def _same_dtypes(who: str, dts, tip: str | None = None):
    if len(set(dts)) > 1:
        hint = (f" (Tip: jnp.{tip} is a similar function that does automatic type promotion "
                f"on inputs).") if tip else ""
        raise TypeError(f"lax.{who} requires arguments to have the same dtypes, got "
                        f"{', '.join(d.name for d in dts)}.{hint}")


def _binary_shape(who: str, shapes):
    """jax's shape rule for elementwise lax ops: 0-d operands broadcast; the others have one
    rank, and each dimension is equal across them or 1."""
    ranked = [s for s in shapes if s != ()]
    if not ranked:
        return ()
    if len({len(s) for s in ranked}) > 1:
        raise TypeError(f"{who}: arrays must have the same number of dimensions, got "
                        f"{sorted({len(s) for s in ranked})} (shapes "
                        f"{', '.join(str(s) for s in ranked)}); lax does not broadcast ranks "
                        f"(jnp does)")
    out = []
    for ns in zip(*ranked):
        big = {n for n in ns if n != 1}
        if len(big) > 1:
            raise TypeError(f"{who} got incompatible shapes for broadcasting: "
                            f"{', '.join(str(s) for s in ranked)}.")
        out.append(big.pop() if big else 1)
    return tuple(out)


def _unary(who, x, accepted, fn):
    shape, dt = _meta(x, who)
    _check_kind(who, dt, accepted)
    if _abstract(x):
        return ShapeDtypeStruct(shape, dt)
    return fn(_placed(x, dt))


def _binary(who, x, y, accepted, fn, tip=None):
    (sx, dx), (sy, dy) = _meta(x, who), _meta(y, who)
    _check_kind(who, dx, accepted, 0)
    _check_kind(who, dy, accepted, 1)
    _same_dtypes(who, (dx, dy), tip)
    shape = _binary_shape(who, (sx, sy))
    if _abstract(x, y):
        return ShapeDtypeStruct(shape, dx)
    if not isinstance(x, Array) and not isinstance(y, Array):
        x = _placed(x, dx)
    return fn(_data(x, dx), _data(y, dy), dx)


def _axis1(who: str, axis, ndim: int) -> int:
    try:
        a = operator.index(axis)
    except TypeError:
        raise TypeError(f"{who}: axis must be an int, got {axis!r}") from None
    if not 0 <= a < ndim:
        raise ValueError(f"{who}: axis {a} is out of bounds for an operand of rank {ndim} "
                         f"(lax takes no negative axes)")
    return a


# --- elementwise math ------------------------------------------------------------------------

def _float_unary(name, impl):
    def op(x):
        return _unary(name, x, FLOAT, impl)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = (f"``jax.lax.{name}``: elementwise, float operands only (an integer or bool "
                  f"operand is a ``TypeError``, as in jax).")
    return op


exp = _float_unary("exp", lambda x: _ops().exp(x))
log = _float_unary("log", lambda x: _ops().log(x))
sqrt = _float_unary("sqrt", lambda x: _ops().sqrt(x))
rsqrt = _float_unary("rsqrt", lambda x: _ops().rsqrt(x))
tanh = _float_unary("tanh", lambda x: _ops().tanh(x))
logistic = _float_unary("logistic", lambda x: _ops().sigmoid(x))
sin = _float_unary("sin", lambda x: _ops().sin(x))
cos = _float_unary("cos", lambda x: _ops().cos(x))
logistic.__doc__ = "``jax.lax.logistic``: ``1 / (1 + exp(-x))`` (``jax.nn.sigmoid``), floats only."


def neg(x):
    """``jax.lax.neg``: ``-x`` (floats and integers; uint32 wraps; bools refused)."""
    return _unary("neg", x, NUMBER, lambda v: _ops().negative(v))


def abs(x):  # noqa: A001 - lax's name
    """``jax.lax.abs``: ``|x|`` (floats and int32; ``abs(int32 min)`` wraps to itself;
    uint32 and bool are refused, as in jax)."""
    return _unary("abs", x, SIGNED, lambda v: _ops().abs(v))


def square(x):
    """``jax.lax.square``: ``x * x`` (floats and integers, wrapping)."""
    def f(v):
        return _ops().square(v) if v.dtype in _FLOATS else _ops().multiply(v, v)
    return _unary("square", x, NUMBER, f)


def add(x, y):
    """``jax.lax.add``: ``x + y`` of one dtype (no bools); see the module docstring for the
    shape and dtype rules."""
    return _binary("add", x, y, NUMBER, lambda a, b, dt: _ops().add(a, b), "add")


def sub(x, y):
    """``jax.lax.sub``: ``x - y`` of one dtype (no bools)."""
    return _binary("sub", x, y, NUMBER, lambda a, b, dt: _ops().subtract(a, b), "subtract")


def mul(x, y):
    """``jax.lax.mul``: ``x * y`` of one dtype (no bools; integers wrap)."""
    return _binary("mul", x, y, NUMBER, lambda a, b, dt: _ops().multiply(a, b), "multiply")


def max(x, y):  # noqa: A001 - lax's name
    """``jax.lax.max``: the elementwise maximum of one dtype (bools too); a NaN on either side
    gives NaN. The gradient at ties is split in halves, as jax's."""
    return _binary("max", x, y, ANY, lambda a, b, dt: _ops().maximum(a, b), "maximum")


def min(x, y):  # noqa: A001 - lax's name
    """``jax.lax.min``: the elementwise minimum of one dtype (bools too); NaN wins."""
    return _binary("min", x, y, ANY, lambda a, b, dt: _ops().minimum(a, b), "minimum")


def _int_div(a, b):
    """Integer division truncated toward zero (C's ``/``, XLA's Div): from jnp's floor
    division, plus 1 where the remainder is non-zero and the operands' signs differ; a zero
    divisor gives -1 (uint32: all ones), ``INT_MIN / -1`` wraps to INT_MIN, as XLA."""
    cnp = _np_ops()
    q = ew.floor_divide(a, b)
    dt = q.dtype
    if dt in _dtypes.UNSIGNED:
        return q                        # (unsigned: floor is truncation; x // 0 is all ones)
    r = ew.remainder(a, b)
    fix = cnp.logical_and(cnp.not_equal(r, np.zeros((), dt)),
                          cnp.not_equal(cnp.less(a, np.zeros((), dt)),
                                        cnp.less(b, np.zeros((), dt))))
    q = cnp.where(fix, cnp.add(q, np.ones((), dt)), q)
    return cnp.where(cnp.equal(b, np.zeros((), dt)), np.full((), -1, dt), q)


def div(x, y):
    """``jax.lax.div``: ``x / y`` of one dtype. Integers truncate toward zero (``div(-7, 2)``
    is -3, unlike ``//``); an integer division by zero gives -1 (uint32: ``2**32 - 1``), as
    XLA on CPU. Floats divide (IEEE: ``1 / 0 = inf``), differentiably."""
    def f(a, b, dt):
        if dt in _FLOATS:
            return _ops().divide(a, b)
        return _int_div(a, b)
    return _binary("div", x, y, NUMBER, f, "divide")


def rem(x, y):
    """``jax.lax.rem``: C's ``fmod``, the remainder of ``x / y`` truncated toward zero: it has
    the dividend's sign (``rem(-7, 2) == -1``, unlike ``%``). Integers: ``rem(x, 0) == x``,
    ``rem(INT_MIN, -1) == 0`` (XLA's). Floats: exact (``|x| fmod |y|`` with ``x``'s sign,
    ``-0.0`` kept), NaN for ``y == 0``; differentiable as jax's (``d/dx = 1``,
    ``d/dy = -trunc(x / y)``)."""

    def f(a, b, dt):
        cnp = _np_ops()
        a = _placed(a, dt)
        if dt in _FLOATS:
            r = ew.remainder(cnp.abs(a), cnp.abs(b))      # both >= 0: fmod itself, exactly
            # times the dividend's sign (-0.0 included: 1 / -0.0 < 0), so fmod(-0.0, y) = -0.0
            a0, zero = _ops().stop_gradient(a), np.zeros((), dt)
            negative = cnp.logical_or(cnp.less(a0, zero), cnp.logical_and(
                cnp.equal(a0, zero), cnp.less(cnp.divide(np.ones((), dt), a0), zero)))
            return cnp.multiply(r, cnp.where(negative, np.full((), -1, dt), np.ones((), dt)))
        return _ops().subtract(a, _ops().multiply(b, _int_div(a, b)))    # wrapping: exact
    return _binary("rem", x, y, REAL, f, "remainder")


def pow(x, y):  # noqa: A001 - lax's name
    """``jax.lax.pow``: ``x ** y`` with a float ``x`` and ``y`` of ``x``'s dtype or any integer
    dtype (jax's rule; the shapes as the other binary ops). Differentiable."""
    who = "pow"
    (sx, dx), (sy, dy) = _meta(x, who), _meta(y, who)
    if dx not in _FLOATS or not (dy in _INTS or dy == dx):
        raise TypeError(f"the first argument to pow must have an inexact dtype (float or "
                        f"complex), and the second argument must have an inexact or integer "
                        f"dtype, and two inexact dtypes must match, but got {dx.name} and "
                        f"{dy.name} respectively.")
    shape = _binary_shape(who, (sx, sy))
    if _abstract(x, y):
        return ShapeDtypeStruct(shape, dx)
    o = _ops()
    xa = _placed(x, dx)
    if dy in _INTS:     # an integer exponent: converted (exactly, for |y| < 2**24) to x's dtype
        y = o.astype(_placed(y, dy), dx) if isinstance(y, Array) else np.asarray(y, dx)
    return o.power(xa, _data(y, dx))


def integer_pow(x, y):
    """``jax.lax.integer_pow``: ``x ** y`` for a Python integer ``y`` (floats: repeated
    squaring, then ``1 / that`` for ``y < 0``, jax's bits and gradient; integers: wrapping
    products, a negative ``y`` refused as in jax; bools refused)."""
    who = "integer_pow"
    shape, dt = _meta(x, who)
    _check_kind(who, dt, NUMBER)
    if isinstance(y, (bool, np.bool_)):
        raise TypeError(f"{who}: the exponent must be an int, got {y!r}")
    if isinstance(y, float) and y.is_integer():
        y = int(y)          # (jax accepts an integral float)
    try:
        n = operator.index(y)
    except TypeError:
        raise TypeError(f"{who}: the exponent must be a Python int, got {y!r}") from None
    if dt in _INTS and n < 0:
        raise TypeError(f"Integers cannot be raised to negative powers, got "
                        f"integer_pow({dt.name}{list(shape)}, {n})")
    if _abstract(x):
        return ShapeDtypeStruct(shape, dt)
    o = _ops()
    xa = _placed(x, dt)
    if dt in _FLOATS:
        return o._integer_pow(xa, n)
    if n == 0:
        return _np_ops().full_like(xa, 1)
    acc, base = None, xa
    while n:
        if n & 1:
            acc = base if acc is None else o.multiply(acc, base)
        n >>= 1
        if n:
            base = o.multiply(base, base)
    return acc if acc is not xa else _fresh(xa)


def clamp(min, x, max):  # noqa: A002 - lax's names
    """``jax.lax.clamp(min, x, max)``: ``min(max(x, min), max)`` elementwise (``max`` wins
    where ``min > max``, as XLA); ``min`` and ``max`` are 0-d or of ``x``'s shape, all of one
    dtype. Gradient as jax's: ``x`` gets the cotangent where ``min < x < max`` (zero at the
    bounds), ``min`` where ``x < min`` and ``max`` where ``x > max`` (broadcast bounds summed)."""
    who = "clamp"
    (sl, dl), (sx, dx), (sh, dh) = (_meta(v, who) for v in (min, x, max))
    _same_dtypes(who, (dl, dx, dh))
    _check_kind(who, dx, REAL)
    for nm, s in (("min", sl), ("max", sh)):
        if s not in ((), sx):
            raise TypeError(f"clamp requires {nm}.shape == operand.shape or {nm}.shape == (), "
                            f"got {nm}.shape={s}, operand.shape={sx}.")
    if _abstract(min, x, max):
        return ShapeDtypeStruct(sx, dx)
    cnp = _np_ops()
    xa = _placed(x, dx)
    lo, hi = _data(min, dl), _data(max, dh)
    if dx in _FLOATS and _ops()._tape() is not None:
        inside = cnp.logical_and(cnp.greater(xa, lo), cnp.less(xa, hi))
        xa = cnp.where(inside, xa, _ops().stop_gradient(xa))
    t = cnp.where(cnp.greater(lo, xa), lo, xa)
    return cnp.where(cnp.less(hi, t), hi, t)


# --- select ----------------------------------------------------------------------------------

def select_n(which, *cases):
    """``jax.lax.select_n``: ``cases[which]`` elementwise. ``which`` is bool (two cases at
    most: False picks ``cases[0]``) or an integer, clamped to ``[0, len(cases) - 1]`` as XLA
    does; 0-d or of the cases' shape. The cases have one shape and one dtype (no
    broadcasting). A chain of ``where`` selects: differentiable into each case, and a case
    not selected never leaks an inf or NaN."""
    who = "select_n"
    if not cases:
        raise ValueError("select_n() must have at least one case")
    sw, dw = _meta(which, who)
    metas = [_meta(c, who) for c in cases]
    if dw != _BOOL and dw not in _INTS:
        raise TypeError(f"select `which` must be boolean or integer type, got {dw.name}.")
    if dw == _BOOL and len(cases) > 2:
        raise TypeError("select with boolean `which` cannot have > 2 cases.")
    shapes = [s for s, _ in metas]
    if len(set(shapes)) > 1:
        raise TypeError(f"select cases must have the same shapes, got "
                        f"{sorted(set(shapes), key=str)}.")
    _same_dtypes("select", [d for _, d in metas], "where")
    shape, dt = metas[0]
    if sw not in ((), shape):
        raise TypeError(f"select `which` must be scalar or have the same shape as cases, got "
                        f"`which` shape {sw} but case shape {shape}.")
    if _abstract(which, *cases):
        return ShapeDtypeStruct(shape, dt)
    cnp = _np_ops()
    data = [_data(c, dt) for c in cases]
    if not any(isinstance(c, Array) for c in data):
        data[0] = _placed(data[0], dt)
    if len(cases) == 1:
        return _fresh(_placed(data[0], dt))
    w = _data(which, dw)
    if dw == _BOOL:
        return cnp.where(w, data[1], data[0])
    out = data[0]
    for k in range(1, len(data)):
        # which >= k, then == k for the last case: out-of-range indices clamp
        pick = cnp.greater_equal(w, np.asarray(k, dw)) if k == len(data) - 1 else \
            cnp.equal(w, np.asarray(k, dw))
        out = cnp.where(pick, data[k], out)     # (a negative index matches none: case 0)
    return out


def select(pred, on_true, on_false):
    """``jax.lax.select``: ``on_true`` where ``pred`` else ``on_false``; ``pred`` bool (or an
    integer: nonzero selects ``on_true``... as ``select_n(pred, on_false, on_true)``, clamped),
    0-d or of the cases' shape; the two cases of one shape and dtype (no broadcasting, no
    promotion: use ``jnp.where`` for those). Differentiable into both cases."""
    return select_n(pred, on_false, on_true)


# --- dtype, shape and creation ---------------------------------------------------------------

def convert_element_type(operand, new_dtype):
    """``jax.lax.convert_element_type``: ``operand`` converted to ``new_dtype`` on its own
    devices (:func:`ctrainstate.numpy.astype`'s semantics: floats round to nearest even,
    floats to integers truncate and saturate, NaN -> 0; 64-bit dtypes narrow to 32 bits as
    jax without x64). Differentiable between float dtypes."""
    dt = _dtypes.canonicalize(new_dtype)
    shape, src = _meta(operand, "convert_element_type")
    if _abstract(operand):
        return ShapeDtypeStruct(shape, dt, getattr(operand, "sharding", None))
    return _ops().astype(_placed(operand, src), dt)


def _shape_arg(shape, who, what="shape"):
    s = _dtypes.int_tuple(shape, f"{who}: {what}", scalar=False)
    if any(n < 0 for n in s):
        raise TypeError(f"{who} {what} must have every element be nonnegative, got {s}.")
    return s


def broadcast_in_dim(operand, shape, broadcast_dimensions, *, out_sharding=None):
    """``jax.lax.broadcast_in_dim``: ``operand``'s dimension ``i`` becomes dimension
    ``broadcast_dimensions[i]`` of ``shape`` (its size equal, or 1 to broadcast), the others
    are new. ``out_sharding`` (a Sharding) places the result. Differentiable (the gradient
    sums over the broadcast dimensions)."""
    who = "broadcast_in_dim"
    oshape, dt = _meta(operand, who)
    shape = _shape_arg(shape, who)
    bd = _dtypes.int_tuple(broadcast_dimensions, f"{who}: broadcast_dimensions")
    if len(bd) != len(oshape):
        raise TypeError(f"broadcast_in_dim broadcast_dimensions must have length equal to "
                        f"operand ndim; got broadcast_dimensions {bd} for operand ndim "
                        f"{len(oshape)}.")
    if any(not 0 <= d < len(shape) for d in bd):
        raise TypeError(f"broadcast_in_dim broadcast_dimensions must be a subset of output "
                        f"dimensions, got {bd} for operand ndim {len(oshape)} and shape "
                        f"{shape}.")
    if len(set(bd)) != len(bd):
        raise TypeError(f"broadcast_in_dim broadcast_dimensions must not contain duplicates, "
                        f"got broadcast_dimensions {bd}")
    if any(n != 1 and n != shape[d] for n, d in zip(oshape, bd)):
        raise TypeError(f"broadcast_in_dim operand dimension sizes must either be 1, or be "
                        f"equal to their corresponding dimensions in the target broadcast "
                        f"shape; got operand of shape {oshape}, target broadcast shape "
                        f"{shape}, broadcast_dimensions {bd} ")
    if _abstract(operand):
        return ShapeDtypeStruct(shape, dt, out_sharding)
    o = _ops()
    x = _placed(operand, dt)
    order = sorted(range(len(bd)), key=lambda i: bd[i])
    if order != list(range(len(bd))):
        x = o.transpose(x, order)
    sbd = sorted(bd)
    expanded = [1] * len(shape)
    for i, d in enumerate(sbd):
        expanded[d] = x.shape[i]
    if tuple(expanded) != tuple(x.shape):
        x = o.reshape(x, tuple(expanded))
    out = o.broadcast_to(x, shape) if tuple(x.shape) != shape else x
    if out is operand:
        out = _fresh(out)
    if out_sharding is not None:
        with_sharding_constraint = _upper('lax').with_sharding_constraint
        out = with_sharding_constraint(out, out_sharding)
    return out


def broadcast(operand, sizes, *, out_sharding=None):
    """``jax.lax.broadcast``: ``operand`` with new leading dimensions ``sizes``."""
    shape, _ = _meta(operand, "broadcast")
    sizes = _shape_arg(sizes, "broadcast", "sizes")
    n = len(sizes)
    return broadcast_in_dim(operand, sizes + shape, tuple(range(n, n + len(shape))),
                            out_sharding=out_sharding)


def iota(dtype, size):
    """``jax.lax.iota``: ``[0, 1, ..., size - 1]`` of ``dtype`` (not bool), replicated."""
    return broadcasted_iota(dtype, (size,), 0)


def broadcasted_iota(dtype, shape, dimension, *, out_sharding=None):
    """``jax.lax.broadcasted_iota``: the index along ``dimension`` at every position of
    ``shape`` (e.g. the rows / columns of a causal mask), of ``dtype`` (not bool)."""
    who = "iota"
    dt = _dtypes.canonicalize(dtype)
    _check_kind(who, dt, NUMBER)
    shape = _shape_arg(shape, who)
    d = operator.index(dimension)
    if not 0 <= d < len(shape):
        raise ValueError(f"iota dimension must be between 0 and len(shape), got "
                         f"dimension={d} for shape={shape}")
    if is_abstract():
        return ShapeDtypeStruct(shape, dt, out_sharding)
    along = [1] * len(shape)
    along[d] = shape[d]
    host = np.broadcast_to(np.arange(shape[d]).reshape(along), shape).astype(dt)
    if out_sharding is not None:
        return device_put(np.ascontiguousarray(host), out_sharding)
    return _np_ops().asarray(host)


def _scalar_fill(who, fill_value):
    s, dt = _meta(fill_value, who)
    if s != ():
        raise TypeError(f"{who} must be called with scalar fill_value, got fill_value.shape "
                        f"{s}.")
    return dt


def full(shape, fill_value, dtype=None, *, sharding=None):
    """``jax.lax.full``: ``shape`` filled with the scalar ``fill_value`` (of ``dtype``, else of
    the value's dtype: a Python float is float32, an int int32); ``sharding`` places it."""
    vdt = _scalar_fill("full", fill_value)
    dt = _dtypes.canonicalize(dtype) if dtype is not None else vdt
    shape = _shape_arg(shape, "broadcast_in_dim")
    if is_abstract():
        return ShapeDtypeStruct(shape, dt, sharding)
    host = np.full(shape, np.asarray(fill_value), dt)
    if sharding is not None:
        return device_put(host, sharding)
    return _np_ops().asarray(host)


def full_like(x, fill_value, dtype=None, shape=None, sharding=None):
    """``jax.lax.full_like``: the scalar ``fill_value`` with ``x``'s shape, dtype (or
    ``dtype``) and sharding (or ``sharding``; a new ``shape`` is placed replicated)."""
    _scalar_fill("full_like", fill_value)
    if sharding is not None:
        xs, xd = _meta(x, "full_like")
        return full(shape if shape is not None else xs, fill_value,
                    dtype if dtype is not None else xd, sharding=sharding)
    if isinstance(fill_value, Array):
        fill_value = np.asarray(fill_value)
    return _np_ops().full_like(x, fill_value, dtype=dtype, shape=shape)


def reshape(operand, new_sizes, dimensions=None, *, out_sharding=None):
    """``jax.lax.reshape``: ``operand`` in ``new_sizes`` (no ``-1``: every size given), after
    transposing by ``dimensions`` when given (the order in which its elements are read)."""
    who = "reshape"
    shape, dt = _meta(operand, who)
    new = _dtypes.int_tuple(new_sizes, f"{who}: new_sizes", scalar=True)
    if any(n < 0 for n in new):
        raise TypeError(f"reshape new_sizes must all be positive, got {new}.")
    if math.prod(new) != math.prod(shape):
        raise TypeError(f"reshape total size must be unchanged, got new_sizes {new} (of total "
                        f"size {math.prod(new)}) for shape {shape} (of total size "
                        f"{math.prod(shape)}).")
    perm = None
    if dimensions is not None:
        perm = _dtypes.int_tuple(dimensions, f"{who}: dimensions")
        if sorted(perm) != list(range(len(shape))):
            raise TypeError(f"reshape dimensions must be a permutation of operand dimensions, "
                            f"got dimensions {perm} for shape {shape}.")
    if _abstract(operand):
        return ShapeDtypeStruct(new, dt, out_sharding)
    o = _ops()
    x = _placed(operand, dt)
    if perm is not None and perm != tuple(range(len(shape))):
        x = o.transpose(x, perm)
    out = o.reshape(x, new)
    if out_sharding is not None:
        with_sharding_constraint = _upper('lax').with_sharding_constraint
        out = with_sharding_constraint(out, out_sharding)
    return out


def squeeze(array, dimensions):
    """``jax.lax.squeeze``: ``array`` without its size-1 ``dimensions`` (negative ones count
    from the end)."""
    who = "squeeze"
    shape, dt = _meta(array, who)
    nd = len(shape)
    dims = _dtypes.int_tuple(dimensions, f"{who}: dimensions", scalar=True)
    for d in dims:
        if not -nd <= d < nd:
            raise ValueError(f"axis {d} is out of bounds for array of dimension {nd}")
    dims = tuple(d % nd for d in dims)
    if len(set(dims)) != len(dims):
        raise ValueError(f"dimensions are not unique: {tuple(dimensions)}")
    if any(shape[d] != 1 for d in dims):
        raise ValueError(f"cannot select an axis to squeeze out which has size not equal to "
                         f"one, got shape={shape} and dimensions={tuple(dimensions)}")
    new = tuple(n for d, n in enumerate(shape) if d not in dims)
    return reshape(array, new)


def expand_dims(array, dimensions):
    """``jax.lax.expand_dims``: ``array`` with size-1 dimensions inserted at ``dimensions``
    (positions in the result; negative ones count from its end)."""
    who = "expand_dims"
    shape, dt = _meta(array, who)
    dims = _dtypes.int_tuple(dimensions, f"{who}: dimensions", scalar=True)
    nd = len(shape) + len(dims)
    for d in dims:
        if not -nd <= d < nd:
            raise ValueError(f"axis {d} is out of bounds for array of dimension {nd}")
    norm = sorted(d % nd for d in dims)
    if len(set(norm)) != len(norm):
        raise ValueError(f"repeated axis in lax.expand_dims: {tuple(dimensions)}")
    new, it = [], iter(shape)
    for d in range(nd):
        new.append(1 if d in norm else next(it))
    return reshape(array, tuple(new))


def transpose(operand, permutation):
    """``jax.lax.transpose``: dimension ``i`` of the result is ``permutation[i]`` of
    ``operand`` (a permutation of ``range(ndim)``: no negative entries). Any dtype; the mesh
    axes move with their dimensions."""
    who = "transpose"
    shape, dt = _meta(operand, who)
    perm = _dtypes.int_tuple(permutation, f"{who}: permutation")
    if sorted(perm) != list(range(len(shape))):
        raise TypeError(f"transpose permutation isn't a permutation of operand dimensions, got "
                        f"permutation {perm} for operand shape {shape}.")
    if _abstract(operand):
        return ShapeDtypeStruct(tuple(shape[p] for p in perm), dt)
    return _ops().transpose(_placed(operand, dt), perm)


def concatenate(operands, dimension):
    """``jax.lax.concatenate``: ``operands`` (one dtype and rank, equal sizes but in
    ``dimension``, which is not negative) joined along ``dimension``. Differentiable."""
    who = "concatenate"
    ops_ = list(operands) if not isinstance(operands, (Array, np.ndarray)) else list(operands)
    if not ops_:
        raise ValueError("concatenate requires a non-empty sequences of arrays")
    metas = [_meta(v, who) for v in ops_]
    _same_dtypes(who, [d for _, d in metas], "concatenate")
    shapes = [s for s, _ in metas]
    d = operator.index(dimension)
    if len({len(s) for s in shapes}) > 1:
        raise TypeError(f"Cannot concatenate arrays with different numbers of dimensions: got "
                        f"{', '.join(str(s) for s in shapes)}.")
    nd = len(shapes[0])
    if not 0 <= d < nd:
        raise TypeError(f"concatenate dimension out of bounds: dimension {d} for shapes "
                        f"{', '.join(str(s) for s in shapes)}.")
    if len({s[:d] + s[d + 1:] for s in shapes}) > 1:
        raise TypeError(f"Cannot concatenate arrays with shapes that differ in dimensions "
                        f"other than the one being concatenated: concatenating along "
                        f"dimension {d} for shapes {', '.join(str(s) for s in shapes)}.")
    dt = metas[0][1]
    out_shape = shapes[0][:d] + (sum(s[d] for s in shapes),) + shapes[0][d + 1:]
    if _abstract(*ops_):
        return ShapeDtypeStruct(out_shape, dt)
    if len(ops_) == 1:
        return _fresh(_placed(ops_[0], dt))
    return join([_data(v, dt) for v in ops_], d)


def pad(operand, padding_value, padding_config):
    """``jax.lax.pad``: ``operand`` padded by ``padding_config``, one ``(lo, hi, interior)``
    per dimension: ``interior`` (>= 0) values between neighbouring elements, then ``lo`` before
    and ``hi`` after; a negative ``lo`` / ``hi`` removes that many from the start / end (of
    the interior-padded array, pads included). ``padding_value`` is a scalar of the
    operand's dtype (an Array too: it then gets the gradient of every padded position).

    Built from ``reshape`` / ``concatenate`` / slicing, so it is differentiable: the operand's
    gradient is the cotangent at the operand's positions (zero for cropped ones). A padded
    dimension comes out unsharded; the others keep their mesh axes.
    """
    who = "pad"
    shape, dt = _meta(operand, who)
    ps, pdt = _meta(padding_value, who)
    if ps != ():
        raise ValueError(f"padding_value must be a scalar; got np.shape(padding_value)={ps}")
    if pdt != dt:
        raise TypeError(f"pad operand and padding_value must be same dtype: got {dt.name} and "
                        f"{pdt.name}.")
    try:
        config = [tuple(operator.index(v) for v in c) for c in padding_config]
    except TypeError:
        raise TypeError(f"pad: padding_config must be a sequence of (lo, hi, interior) int "
                        f"triples, got {padding_config!r}") from None
    if len(config) != len(shape):
        raise ValueError(f"length of padding_config must equal the number of axes of operand, "
                         f"got padding_config {tuple(config)} for operand shape {shape}")
    if any(len(c) != 3 for c in config):
        raise ValueError(f"pad: each padding_config entry is (lo, hi, interior), got "
                         f"{tuple(config)}")
    if any(c[2] < 0 for c in config):
        raise ValueError(f"interior padding in padding_config must be nonnegative, got "
                         f"padding_config {tuple(config)}")
    out_shape = tuple(n + lo + hi + (n - 1 if n else 0) * it for n, (lo, hi, it) in
                      zip(shape, config))
    if any(n < 0 for n in out_shape):
        raise ValueError(f"Dimension size after padding is not at least 0, got result shape "
                         f"{out_shape}, for padding_config {tuple(config)} and operand shape "
                         f"{shape}")
    if _abstract(operand, padding_value):
        return ShapeDtypeStruct(out_shape, dt)
    o = _ops()
    x = _placed(operand, dt)
    pv = padding_value if isinstance(padding_value, Array) else None
    host_pv = None if pv is not None else np.asarray(padding_value, dt)

    def fill(like, shape_, d):
        if pv is not None:
            return o.broadcast_to(pv, tuple(shape_))
        return _placed_like(like, np.full(tuple(shape_), host_pv, dt), d)

    y = x
    for d, (lo, hi, it) in enumerate(config):
        n = y.shape[d]
        if it and n > 1:   # (.., n, ..) -> (.., n, 1 + it, ..) -> (.., n (1 + it), ..), less the last it
            s1 = tuple(y.shape[:d]) + (n, 1) + tuple(y.shape[d + 1:])
            s2 = s1[:d + 1] + (it,) + s1[d + 2:]
            yy = join([o.reshape(y, s1), fill(o.reshape(y, s1), s2, d + 1)], d + 1)
            yy = o.reshape(yy, tuple(y.shape[:d]) + (n * (1 + it),) + tuple(y.shape[d + 1:]))
            y = getitem(yy, (_S(None),) * d + (_S(0, n * (1 + it) - it),))
        parts = []
        for width in (lo, hi):
            if width > 0:
                s = list(y.shape)
                s[d] = width
                parts.append(fill(y, s, d))
            else:
                parts.append(None)
        if parts[0] is not None or parts[1] is not None:
            y = join([p for p in (parts[0], y, parts[1]) if p is not None], d)
        m = y.shape[d]
        a, b = (-lo if lo < 0 else 0), m - (-hi if hi < 0 else 0)
        if a or b != m:
            y = getitem(y, (_S(None),) * d + (_S(a, b),))
    return y if y is not x else _fresh(x)


# --- slicing ---------------------------------------------------------------------------------

def slice(operand, start_indices, limit_indices, strides=None):  # noqa: A001 - lax's name
    """``jax.lax.slice``: ``operand[start:limit:stride]`` in every dimension, with
    ``0 <= start <= limit <= size`` and positive strides (a ``TypeError`` otherwise, as
    jax's shape rule; jax's eager path clamps an out-of-range limit instead, here it is an
    error as under ``jax.jit``). Differentiable."""
    who = "slice"
    shape, dt = _meta(operand, who)
    nd = len(shape)
    st = _dtypes.int_tuple(start_indices, f"{who}: start_indices")
    lim = _dtypes.int_tuple(limit_indices, f"{who}: limit_indices")
    sd = (1,) * nd if strides is None else _dtypes.int_tuple(strides, f"{who}: strides")
    for nm, v in (("start_indices", st), ("limit_indices", lim), ("strides", sd)):
        if len(v) != nd:
            raise TypeError(f"slice {nm} must have length equal to the number of dimensions "
                            f"of the operand, got indices {v} for operand shape {shape}.")
    if any(s < 0 for s in st):
        raise TypeError(f"slice start_indices must be greater than or equal to zero, got "
                        f"start_indices of {st}.")
    if any(lm > n for lm, n in zip(lim, shape)):
        raise TypeError(f"slice limit_indices must be less than or equal to operand shape, got "
                        f"limit_indices {lim} for operand shape {shape}.")
    if any(lm < s for s, lm in zip(st, lim)):
        raise TypeError(f"slice limit_indices must be greater than or equal to start_indices, "
                        f"got start_indices {st} and limit_indices {lim}.")
    if any(s <= 0 for s in sd):
        raise TypeError(f"slice strides must be positive, got {sd}")
    out_shape = tuple(-(-(lm - s) // k) for s, lm, k in zip(st, lim, sd))
    if _abstract(operand):
        return ShapeDtypeStruct(out_shape, dt)
    x = _placed(operand, dt)
    y = getitem(x, tuple(_S(s, lm, k) for s, lm, k in zip(st, lim, sd)))
    return y if y is not x else _fresh(x)


def slice_in_dim(operand, start_index, limit_index, stride=1, axis=0):
    """``jax.lax.slice_in_dim``: :func:`slice` along ``axis`` only; ``None`` means the start /
    the end, negative indices count from the end (once)."""
    shape, _ = _meta(operand, "slice_in_dim")
    ax = _axis1("slice_in_dim", axis, len(shape)) if axis >= 0 else \
        _axis1("slice_in_dim", axis + len(shape), len(shape))
    n = shape[ax]
    s = 0 if start_index is None else operator.index(start_index)
    e = n if limit_index is None else operator.index(limit_index)
    s = s + n if s < 0 else s
    e = e + n if e < 0 else e
    st, lim, sd = [0] * len(shape), list(shape), [1] * len(shape)
    st[ax], lim[ax], sd[ax] = s, e, operator.index(stride)
    return slice(operand, st, lim, sd)


def index_in_dim(operand, index, axis=0, keepdims=True):
    """``jax.lax.index_in_dim``: the slice at ``index`` (negative counts from the end; out of
    range is an ``IndexError``) along ``axis``, that dimension dropped unless ``keepdims``."""
    shape, _ = _meta(operand, "index_in_dim")
    ax = operator.index(axis)
    ax = ax + len(shape) if ax < 0 else ax
    ax = _axis1("index_in_dim", ax, len(shape))
    n = shape[ax]
    i = operator.index(index)
    j = i + n if i < 0 else i
    if not 0 <= j < n:
        raise IndexError(f"index {i} is out of bounds for axis {ax} with size {n}")
    out = slice_in_dim(operand, j, j + 1, 1, ax)
    if keepdims:
        return out
    return reshape(out, shape[:ax] + shape[ax + 1:])


def rev(operand, dimensions):
    """``jax.lax.rev``: ``operand`` reversed along ``dimensions`` (non-negative, unique).
    Differentiable; reversed dimensions come out unsharded."""
    who = "rev"
    shape, dt = _meta(operand, who)
    dims = _dtypes.int_tuple(dimensions, f"{who}: dimensions")
    if any(d < 0 for d in dims):
        raise TypeError(f"rev dimensions must have every element be nonnegative, got {dims}.")
    if len(set(dims)) != len(dims):
        raise TypeError(f"rev dimensions must be unique, got {dims}.")
    if any(d >= len(shape) for d in dims):
        raise TypeError(f"rev dimensions must all be less than operand ndim, got dimensions "
                        f"{dims} for operand ndim {len(shape)}.")
    if _abstract(operand):
        return ShapeDtypeStruct(shape, dt)
    x = _placed(operand, dt)
    if not dims:
        return _fresh(x)
    return flip(x, dims)


# --- reductions ------------------------------------------------------------------------------

def _reduce(who, operand, axes, accepted, fn):
    shape, dt = _meta(operand, who)
    _check_kind(who, dt, accepted)
    try:
        ax = tuple(operator.index(a) for a in axes)
    except TypeError:
        raise TypeError(f"{who}: axes must be a sequence of ints, got {axes!r}") from None
    if any(not 0 <= a < len(shape) for a in ax):
        raise ValueError(f"reduction axes {ax} contains out-of-bounds indices for "
                         f"{dt.name}{list(shape)}.")
    if len(set(ax)) != len(ax):
        raise ValueError(f"duplicate value in 'axes' of reduction: {ax}")
    out_shape = tuple(n for d, n in enumerate(shape) if d not in ax)
    if _abstract(operand):
        return ShapeDtypeStruct(out_shape, dt)
    x = _placed(operand, dt)
    if not ax:
        return _fresh(x)
    return fn(x, ax)


def reduce_sum(operand, axes, *, out_sharding=None):
    """``jax.lax.reduce_sum``: the sum over ``axes`` (non-negative; floats and integers,
    wrapping in the operand's dtype, narrow ints too; no bools). A sharded reduced dimension
    ends in an all-reduce."""
    del out_sharding

    def f(x, a):    # (jnp.sum widens the narrow ints; the 32-bit sum wrapped back is lax's)
        out = _ops().sum(x, axis=a)
        return out if out.dtype == x.dtype else _ops().astype(out, x.dtype)
    return _reduce("reduce_sum", operand, axes, NUMBER, f)


def reduce_max(operand, axes):
    """``jax.lax.reduce_max``: the maximum over ``axes`` (any dtype; a NaN wins)."""
    return _reduce("reduce_max", operand, axes, ANY, lambda x, a: _ops().max(x, axis=a))


def reduce_min(operand, axes):
    """``jax.lax.reduce_min``: the minimum over ``axes`` (any dtype; a NaN wins)."""
    return _reduce("reduce_min", operand, axes, ANY, lambda x, a: _ops().min(x, axis=a))


def reduce_prod(operand, axes):
    """``jax.lax.reduce_prod``: the product over ``axes`` (floats through ``jnp.prod``'s
    product tree, differentiable; integers wrap)."""
    def f(x, a):
        if x.dtype in _FLOATS:
            return prod(x, axis=a)
        if any(x.shape[d] == 0 for d in a):
            return _np_ops().full_like(x, 1, shape=tuple(n for d, n in enumerate(x.shape)
                                                         if d not in a))
        return _prod_f32(x, axis=a)      # (its pairwise products dispatch to integer kernels)
    return _reduce("reduce_prod", operand, axes, NUMBER, f)


def _arg(who, fn, operand, axis, index_dtype):
    shape, dt = _meta(operand, who)
    idt = _dtypes.canonicalize(index_dtype)
    if idt not in _INTS:
        raise TypeError(f"index_dtype must be an integer type, but got {idt.name}")
    try:
        a = operator.index(axis)
    except TypeError:
        raise TypeError(f"{who}: axis must be an int, got {axis!r}") from None
    if not 0 <= a < len(shape):
        raise ValueError(f"Invalid axis {a} for operand shape {shape}")
    if _abstract(operand):
        return ShapeDtypeStruct(shape[:a] + shape[a + 1:], idt)
    out = fn(_placed(operand, dt), axis=a)
    return out if out.dtype == idt else _ops().astype(out, idt)


def argmax(operand, axis, index_dtype):
    """``jax.lax.argmax``: the index of the maximum along ``axis`` (non-negative), the first
    among ties, a NaN counting as the maximum; in ``index_dtype`` (int32 or uint32)."""
    return _arg("argmax", _ops().argmax, operand, axis, index_dtype)


def argmin(operand, axis, index_dtype):
    """``jax.lax.argmin``: as :func:`argmax` for the minimum."""
    return _arg("argmin", _ops().argmin, operand, axis, index_dtype)


# --- cumulative ops --------------------------------------------------------------------------

def _cumulative(who, operand, axis, reverse):
    shape, dt = _meta(operand, who)
    _check_kind(who, dt, (_FLOATS + _INTS, "subtypes of number"))
    try:
        a = operator.index(axis)
    except TypeError:
        raise TypeError(f"{who}: axis must be an int, got {axis!r}") from None
    if not 0 <= a < len(shape):
        raise ValueError(f"{who}: axis {a} is out of bounds for array of shape {shape} (lax "
                         f"takes no negative axes)")
    if _abstract(operand):
        return ShapeDtypeStruct(shape, dt)
    x = _placed(operand, dt)
    if reverse:
        x = flip(x, a)
    y = ew._scan(x, a, who)
    if y is x:
        y = _fresh(x)
    return flip(y, a) if reverse else y


def cumsum(operand, axis=0, reverse=False):
    """``jax.lax.cumsum``: the running sum along ``axis`` (non-negative), from the end with
    ``reverse``. Floats (differentiable) and integers (wrapping); no bools."""
    return _cumulative("cumsum", operand, axis, reverse)


def cumprod(operand, axis=0, reverse=False):
    """``jax.lax.cumprod``: the running product along ``axis``, from the end with
    ``reverse``."""
    return _cumulative("cumprod", operand, axis, reverse)


def cummax(operand, axis=0, reverse=False):
    """``jax.lax.cummax``: the running maximum along ``axis`` (a NaN propagates onward), from
    the end with ``reverse``. Differentiable: computed as jax differentiates it, a parallel
    prefix scan of ``maximum`` in ``lax.associative_scan``'s grouping, so tied values split
    the gradient as in jax (halves at each tie in that tree; none where the output is NaN)."""
    return _cumulative("cummax", operand, axis, reverse)


def cummin(operand, axis=0, reverse=False):
    """``jax.lax.cummin``: the running minimum along ``axis``, as :func:`cummax`."""
    return _cumulative("cummin", operand, axis, reverse)


# --- sorting ---------------------------------------------------------------------------------

def sort(operand, dimension=-1, is_stable=True, num_keys=1):
    """``jax.lax.sort``: one array sorted along ``dimension`` (jax's float order: NaNs last,
    ``-0.0 == 0.0``), or a sequence of arrays of one shape sorted together by the first
    ``num_keys`` of them (lexicographically; the others follow the permutation); returns a
    tuple then. Always stable here (``is_stable=False`` may order ties differently in jax).
    The permutation is computed on the host; the values are gathered on the devices,
    differentiably (:func:`ctrainstate.numpy.sort`)."""
    del is_stable
    if isinstance(operand, (Array, ShapeDtypeStruct, np.ndarray)) or np.isscalar(operand):
        if num_keys != 1:
            raise ValueError(f"num_keys={num_keys} must equal 1 for a single operand.")
        shape, dt = _meta(operand, "sort")
        if not shape:
            raise ValueError("sort: a 0-d operand has no dimension to sort along")
        d = operator.index(dimension)
        if _abstract(operand):
            return ShapeDtypeStruct(shape, dt)
        return _np_ops().sort(_placed(operand, dt), axis=d)
    ops_ = list(operand)
    k = operator.index(num_keys)
    if not 1 <= k <= len(ops_):
        raise ValueError(f"num_keys={k} must be between 1 and len(operand)={len(ops_)}")
    metas = [_meta(v, "sort") for v in ops_]
    if len({s for s, _ in metas}) > 1:
        raise TypeError(f"Arguments to sort must have equal shapes, got: "
                        f"{' '.join(str(s) for s, _ in metas)}")
    shape = metas[0][0]
    if not shape:
        raise ValueError("sort: 0-d operands have no dimension to sort along")
    d = operator.index(dimension)
    if not -len(shape) <= d < len(shape):
        raise ValueError(f"sort: dimension {d} is out of bounds for shape {shape}")
    d %= len(shape)
    if _abstract(*ops_):
        return tuple(ShapeDtypeStruct(s, dt) for s, dt in metas)
    placed = [_placed(v, dt) for v, (_, dt) in zip(ops_, metas)]
    keys = [np.moveaxis(_sort_keys(_ops()._host_value(placed[i])), d, -1) for i in range(k)]
    perm = np.lexsort(keys[::-1], axis=-1) if k > 1 else np.argsort(keys[0], axis=-1,
                                                                    kind="stable")
    perm = np.ascontiguousarray(np.moveaxis(perm, -1, d).astype(np.int32))
    return tuple(take_along_axis(p, perm, axis=d) for p in placed)


def sort_key_val(keys, values, dimension=-1, is_stable=True):
    """``jax.lax.sort_key_val``: ``(keys, values)`` sorted by ``keys`` along ``dimension``."""
    return sort((keys, values), dimension, is_stable, num_keys=1)


def top_k(operand, k, *, axis=-1):
    """``jax.lax.top_k``: the ``k`` largest values along ``axis`` (the last by default) in
    descending order and their int32 indices; ties go to the lower index, a NaN counts as the
    largest (jax's). The order is computed on the host; the values are a differentiable
    gather on the devices."""
    who = "top_k"
    shape, dt = _meta(operand, who)
    nd = len(shape)
    a = operator.index(axis)
    if not -nd <= a < nd:
        raise ValueError(f"axis {a} is out of bounds for array of dimension {nd}")
    a %= nd
    kk = operator.index(k)
    if kk < 0:
        raise ValueError(f"k argument to top_k must be nonnegative, got {kk}")
    if kk > shape[a]:
        raise ValueError(f"k argument to top_k must be no larger than size along axis; got "
                         f"k={kk} with shape={list(shape)} and axis={a}")
    out_shape = shape[:a] + (kk,) + shape[a + 1:]
    if _abstract(operand):
        return ShapeDtypeStruct(out_shape, dt), ShapeDtypeStruct(out_shape, _I32)
    x = _placed(operand, dt)
    idx = _argsort_host(x, a, True)
    idx = np.ascontiguousarray(np.take(idx, np.arange(kk), axis=a))
    return take_along_axis(x, idx, axis=a), _ops()._lift_any(idx, _ops()._place_of(x))


# --- dot_general -----------------------------------------------------------------------------

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                out_sharding=None):
    """``jax.lax.dot_general``: contract ``lhs`` and ``rhs`` over
    ``dimension_numbers = ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``; the
    result's dimensions are the batch dimensions, then ``lhs``'s free ones, then ``rhs``'s
    (jax's order). Runs as :func:`ctrainstate.numpy.einsum` (``precision`` as there), so it is
    differentiable and sharded as einsum is. Float operands (mixed float dtypes promote as
    jax: bfloat16 with float32 is float32); ``preferred_element_type`` is the result dtype
    (with 16-bit operands and float32 the product accumulates in float32). Integer operands
    need a float ``preferred_element_type`` here (jax computes integer products exactly; the
    matrix kernels here are float) -- a ``TypeError`` otherwise."""
    who = "dot_general"
    (ls, ld), (rs, rd) = _meta(lhs, who), _meta(rhs, who)
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(operator.index(v) for v in t) for t in (lc, rc, lb, rb))
    except (TypeError, ValueError):
        raise TypeError(f"dot_general: dimension_numbers must be ((lhs_contracting, "
                        f"rhs_contracting), (lhs_batch, rhs_batch)), got "
                        f"{dimension_numbers!r}") from None
    for side, s, c, b in (("lhs", ls, lc, lb), ("rhs", rs, rc, rb)):
        if any(not 0 <= v < len(s) for v in c + b):
            raise TypeError(f"dot_general requires {side} dimension numbers to be nonnegative "
                            f"and less than the number of axes of the {side} value, got "
                            f"{side}_batch of {b} and {side}_contracting of {c} for {side} of "
                            f"rank {len(s)}")
        if len(set(c)) != len(c):
            raise TypeError(f"dot_general requires {side} contracting dimensions to be "
                            f"distinct, got {side}_contracting {c}.")
        if len(set(b)) != len(b):
            raise TypeError(f"dot_general requires {side} batch dimensions to be distinct, got "
                            f"{side}_batch {b}.")
        if set(b) & set(c):
            raise TypeError(f"dot_general requires {side} batch dimensions and {side} "
                            f"contracting dimensions to be disjoint, got {side}_batch {b} and "
                            f"{side}_contracting {c}.")
    if len(lb) != len(rb):
        raise TypeError(f"dot_general requires equal numbers of lhs_batch and rhs_batch "
                        f"dimensions, got lhs_batch {lb} and rhs_batch {rb}.")
    if len(lc) != len(rc):
        raise TypeError(f"dot_general requires equal numbers of lhs_contracting and "
                        f"rhs_contracting dimensions, got lhs_contracting {lc} and "
                        f"rhs_contracting {rc}.")
    if tuple(ls[d] for d in lb) != tuple(rs[d] for d in rb):
        raise TypeError(f"dot_general requires lhs batch dimensions and rhs batch dimensions "
                        f"to have the same shape, got {tuple(ls[d] for d in lb)} and "
                        f"{tuple(rs[d] for d in rb)}.")
    if tuple(ls[d] for d in lc) != tuple(rs[d] for d in rc):
        raise TypeError(f"dot_general requires contracting dimensions to have the same shape, "
                        f"got {tuple(ls[d] for d in lc)} and {tuple(rs[d] for d in rc)}.")
    if len(ls) + len(rs) - len(lb) - len(lc) > len(_LETTERS):
        raise ValueError(f"dot_general: too many dimensions ({len(ls)} + {len(rs)})")
    pet = None if preferred_element_type is None else _dtypes.canonicalize(preferred_element_type)
    for side, dt in (("lhs", ld), ("rhs", rd)):
        if dt == _BOOL or (dt in _INTS and (pet is None or pet not in _FLOATS)):
            raise TypeError(f"dot_general: {side} has dtype {dt.name}; ctrainstate's matrix "
                            f"products are float: pass preferred_element_type=jnp.float32 "
                            f"(the integers are converted exactly below 2**24), or convert "
                            f"the operands with convert_element_type")
    letters = iter(_LETTERS)
    ll = [None] * len(ls)
    rl = [None] * len(rs)
    for a, b in zip(lb, rb):
        ll[a] = rl[b] = next(letters)
    for a, b in zip(lc, rc):
        ll[a] = rl[b] = next(letters)
    for i in range(len(ls)):
        if ll[i] is None:
            ll[i] = next(letters)
    for i in range(len(rs)):
        if rl[i] is None:
            rl[i] = next(letters)
    out = [ll[a] for a in lb] + [ll[i] for i in range(len(ls)) if i not in lb and i not in lc] + \
        [rl[i] for i in range(len(rs)) if i not in rb and i not in rc]
    out_shape = tuple(ls[a] for a in lb) + tuple(
        ls[i] for i in range(len(ls)) if i not in lb and i not in lc) + tuple(
        rs[i] for i in range(len(rs)) if i not in rb and i not in rc)
    o = _ops()
    res_dt = pet if pet is not None else o._result_dtype([ShapeDtypeStruct((), ld),
                                                          ShapeDtypeStruct((), rd)], who)
    if _abstract(lhs, rhs):
        return ShapeDtypeStruct(out_shape, res_dt, out_sharding)
    a, b = _placed(lhs, ld), _placed(rhs, rd)
    if pet is not None and pet == _F32:   # accumulate in float32 (16-bit / int operands exact)
        a = a if a.dtype == _F32 else o.astype(a, _F32)
        b = b if b.dtype == _F32 else o.astype(b, _F32)
    elif pet is not None:
        a = a if a.dtype in _FLOATS else o.astype(a, pet)
        b = b if b.dtype in _FLOATS else o.astype(b, pet)
    r = o.einsum(f"{''.join(ll)},{''.join(rl)}->{''.join(out)}", a, b, precision=precision)
    if r.dtype != res_dt:
        r = o.astype(r, res_dt)
    if out_sharding is not None:
        with_sharding_constraint = _upper('lax').with_sharding_constraint
        r = with_sharding_constraint(r, out_sharding)
    return r
