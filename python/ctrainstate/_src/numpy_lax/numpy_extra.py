"""The rest of ``jax.numpy``'s everyday names: dtype introspection, creation helpers,
comparisons and small utilities, NaN-skipping reductions and order statistics.

Everything here is built from the differentiable ops of :mod:`ctrainstate._src.ops.ops`,
:mod:`ctrainstate._src.ops.elementwise`, :mod:`ctrainstate._src.ops.slicing` and :mod:`ctrainstate._src.ops.move`
(``where``, ``sum``, ``max``, ``sort``, ``take``, ``concatenate``, ...), so the results keep
those ops' sharding rules (a reduced dimension sharded over mesh axes ends in their
all-reduce) and their gradients are the ones jax's compositions give: ``nansum``'s gradient
is 0 at the NaNs, ``quantile``'s goes to the one or two sorted elements it interpolates.

Results follow jax 0.10 without x64: int32 indices and counts, float32 means of ints, the
jax promotion lattice in :func:`promote_types`. Functions whose output size depends on the
values (``nonzero``, ``argwhere``, ``flatnonzero``, one-argument ``where``) and the index
planning of ``quantile`` / ``searchsorted`` read their operand to the host (the eager
counterpart of jax's concrete ``size=``), then place the int32 results as ``device_put``
places a host array.

Where jax is silent on a user error this module raises instead (noted in the docstrings):
``quantile`` with ``q`` outside ``[0, 1]``, ``geomspace`` through zero, ``vsplit`` of a 1-d
array.

>>> import numpy as np, ctrainstate.numpy as cnp
>>> x = np.array([[1.0, np.nan, 3.0], [4.0, 5.0, np.nan]], np.float32)
>>> np.asarray(cnp.nansum(x, axis=1)).tolist(), np.asarray(cnp.nanmax(x)).item()
([4.0, 9.0], 5.0)
>>> [np.asarray(i).tolist() for i in cnp.nonzero(np.array([0, 3, 0, 7]))]
[[1, 3]]
"""
from __future__ import annotations

import builtins
import math

import ml_dtypes
import numpy as np

from ..base import dtypes as _dtypes
from ..ops import ops as _ops
from ..ops.move import (_axes, _axis, _int, _operand as op, flip, moveaxis, sort, swapaxes, take,
                        take_along_axis)
from ..ops.slicing import getitem
from ..array.array import Array, device_put
from ..array.sharding import NamedSharding
from ..base.hooks import upper as _upper

__all__ = [
    # dtypes and introspection
    "finfo", "iinfo", "dtype", "promote_types", "can_cast", "issubdtype", "isdtype", "ndim",
    "shape", "size",
    # creation
    "empty", "empty_like", "identity", "tri", "triu_indices", "tril_indices",
    "triu_indices_from", "tril_indices_from", "indices", "meshgrid", "logspace", "geomspace",
    "copy",
    # comparison and utilities
    "array_equal", "array_equiv", "broadcast_shapes", "broadcast_arrays", "absolute", "fabs",
    "positive", "true_divide", "count_nonzero", "nan_to_num", "isin", "select", "trace", "ptp",
    "average", "cross", "kron", "rot90", "column_stack", "dstack", "hsplit", "vsplit", "dsplit",
    "append",
    # NaN-skipping reductions
    "nansum", "nanmean", "nanmax", "nanmin", "nanprod", "nanstd", "nanvar", "nanargmax",
    "nanargmin", "nancumsum", "nancumprod",
    # order statistics and indices
    "median", "quantile", "percentile", "nanmedian", "nanquantile", "nanpercentile", "searchsorted", "nonzero", "argwhere", "flatnonzero",
    "where",
]


def _o():
    return _ops


def _cnp():
    cnp = _upper('numpy')
    return cnp


def _operand(x, who, name="a"):
    return op(x, who, name)


def _host_place(host):
    """A host result placed as ``device_put`` places it (replicated over the active mesh,
    else on the first device), with its canonical dtype."""
    return _o()._lift_any(np.array(host, order="C"))   # (ascontiguousarray makes 0-d 1-d)


# --- dtypes and introspection --------------------------------------------------------------------

dtype = np.dtype   # jnp.dtype is numpy's (bfloat16 and the other ml_dtypes names included)


def _dtype_of(x, who):
    """The numpy dtype of ``x``: a dtype, a scalar type (numpy's, ml_dtypes' or
    ``ctrainstate.numpy``'s), a dtype name, or anything with a ``dtype`` (an Array)."""
    dt = getattr(x, "dtype", None)
    if dt is not None and not isinstance(x, type):
        return np.dtype(dt)
    if isinstance(x, type) and isinstance(getattr(x, "dtype", None), np.dtype):
        return x.dtype             # ctrainstate.numpy.float32 and friends
    try:
        return np.dtype(x)
    except TypeError:
        raise TypeError(f"{who}: {x!r} is not a dtype or an array") from None


def finfo(dtype):
    """``jnp.finfo``: machine limits of a float dtype (``ml_dtypes.finfo``, so bfloat16 and
    float16 are covered; an Array or dtype name is accepted). An integer dtype raises
    ``ValueError``, as jnp.

    >>> import ctrainstate.numpy as cnp
    >>> float(cnp.finfo(cnp.bfloat16).eps), float(cnp.finfo('float16').max)
    (0.0078125, 65504.0)
    """
    return ml_dtypes.finfo(_dtype_of(dtype, "finfo"))


def iinfo(int_type):
    """``jnp.iinfo``: the range of an integer dtype (``ml_dtypes.iinfo``); a float dtype
    raises ``ValueError``, as jnp.

    >>> import ctrainstate.numpy as cnp
    >>> cnp.iinfo(cnp.int32).max
    2147483647
    """
    return ml_dtypes.iinfo(_dtype_of(int_type, "iinfo"))


# jax's type promotion lattice (jax._src.dtypes._type_promotion_lattice, without the 4-bit and
# 8-bit float types): an edge a -> b means a promotes to b. Python's int, float and complex
# are the weak nodes "i*", "f*", "c*"; a weak result is the 64-bit default type, as
# jnp.promote_types returns it. Without x64, jax's lattice has uint32 -> int32 in place of
# uint32 -> int64 (the one join that would make a 64-bit type from 32-bit inputs).
_B, _WI, _WF, _WC = np.dtype(bool), "i*", "f*", "c*"
_U8, _U16, _U32, _U64 = (np.dtype(t) for t in (np.uint8, np.uint16, np.uint32, np.uint64))
_I8, _I16, _I32, _I64 = (np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64))
_BF16, _F16, _F32, _F64 = _dtypes.bfloat16, np.dtype(np.float16), np.dtype(np.float32), \
    np.dtype(np.float64)
_C64, _C128 = np.dtype(np.complex64), np.dtype(np.complex128)
_LATTICE = {
    _B: [_WI], _WI: [_U8, _I8], _U8: [_I16, _U16], _U16: [_I32, _U32], _U32: [_I32, _U64],
    _U64: [_WF], _I8: [_I16], _I16: [_I32], _I32: [_I64], _I64: [_WF],
    _WF: [_BF16, _F16, _WC], _BF16: [_F32], _F16: [_F32], _F32: [_F64, _C64], _F64: [_C128],
    _WC: [_C64], _C64: [_C128], _C128: [],
}
_WEAK_DEFAULT = {_WI: _I64, _WF: _F64, _WC: _C128}




_UPPER = {n: _dtypes._reachable(_LATTICE, n) for n in _LATTICE}


def _lattice_node(t, who):
    if t is int:
        return _WI
    if t is float:
        return _WF
    if t is complex:
        return _WC
    dt = _dtype_of(t, who)
    if dt not in _LATTICE:
        raise TypeError(f"{who}: dtype {dt} is not in jax's promotion lattice as ctrainstate "
                        f"knows it (bool, [u]int8..64, bfloat16, float16..64, complex64/128)")
    return dt


def promote_types(a, b):
    """``jnp.promote_types``: the least upper bound of two dtypes in jax's promotion lattice
    (not numpy's): ``bfloat16`` with ``float16`` is float32, ``int32`` with ``float32``
    float32, ``uint32`` with ``int32`` int32 (jax's lattice without x64), ``uint64`` with
    ``int64`` float64; Python ``int`` / ``float`` are jax's weak types (``promote_types(int,
    int8)`` is int8). As jnp's, 64-bit inputs are not narrowed to 32 bits (see
    :func:`result_type` for that).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> str(cnp.promote_types(cnp.bfloat16, np.float16)), str(cnp.promote_types(np.uint8, np.int8))
    ('float32', 'int16')
    """
    na, nb = _lattice_node(a, "promote_types"), _lattice_node(b, "promote_types")
    common = _UPPER[na] & _UPPER[nb]
    (lub,) = [n for n in common if _UPPER[n] >= common]
    return _WEAK_DEFAULT.get(lub, lub)


def can_cast(from_, to, casting="safe"):
    """``jnp.can_cast`` (numpy's rule, as jnp uses it): whether ``from_`` (a dtype or an
    Array) casts to ``to`` under ``casting``."""
    return bool(np.can_cast(_dtype_of(from_, "can_cast"), _dtype_of(to, "can_cast"), casting))


_ABSTRACT = (np.generic, np.number, np.integer, np.signedinteger, np.unsignedinteger,
             np.inexact, np.floating, np.complexfloating, np.bool_, np.character, np.flexible)
_ML_FLOATS = {np.dtype(getattr(ml_dtypes, n)) for n in (
    "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz", "float8_e4m3fnuz",
    "float8_e5m2fnuz") if hasattr(ml_dtypes, n)}


def issubdtype(arg1, arg2):
    """``jnp.issubdtype``: whether ``arg1`` is ``arg2`` or below it in numpy's hierarchy,
    with jax's extension: bfloat16 (and the float8 types) are ``floating`` / ``inexact`` /
    ``number`` (numpy says no).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> cnp.issubdtype(cnp.bfloat16, np.floating), cnp.issubdtype(np.int32, np.floating)
    (True, False)
    """
    if isinstance(arg1, type) and arg1 in _ABSTRACT:
        return bool(np.issubdtype(arg1, arg2))
    d1 = _dtype_of(arg1, "issubdtype")
    if isinstance(arg2, type) and arg2 in _ABSTRACT:
        if d1 in _ML_FLOATS:
            return arg2 in (np.floating, np.inexact, np.number, np.generic)
        return bool(np.issubdtype(d1, arg2))
    return d1 == _dtype_of(arg2, "issubdtype")


_KINDS = ("bool", "signed integer", "unsigned integer", "integral", "real floating",
          "complex floating", "numeric")


def isdtype(dtype, kind):
    """``jnp.isdtype`` (the array API's): whether ``dtype`` is of ``kind``, a name among
    'bool', 'signed integer', 'unsigned integer', 'integral', 'real floating' (bfloat16 and
    float16 included), 'complex floating', 'numeric', a dtype, or a tuple of these. An
    unknown name raises ``ValueError``, as jnp."""
    dt = _dtype_of(dtype, "isdtype")
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for k in kinds:
        if isinstance(k, str):
            if k not in _KINDS:
                raise ValueError(f"Unrecognized kind={k!r} expected one of {list(_KINDS)}, or a "
                                 f"compatible input for jnp.dtype()")
            real = dt.kind == "f" or dt in _ML_FLOATS
            hit = {"bool": dt == _B, "signed integer": dt.kind == "i",
                   "unsigned integer": dt.kind == "u", "integral": dt.kind in "iu",
                   "real floating": real, "complex floating": dt.kind == "c",
                   "numeric": dt.kind in "iuc" or real}[k]
        else:
            hit = dt == _dtype_of(k, "isdtype")
        if hit:
            return True
    return False


def _shape_of(a):
    s = getattr(a, "shape", None)
    return tuple(s) if s is not None and not isinstance(a, (list, tuple)) else np.shape(a)


def ndim(a):
    """``jnp.ndim``: the number of dimensions of an Array, array or nested sequence."""
    return len(_shape_of(a))


def shape(a):
    """``jnp.shape``: the shape of an Array, array or nested sequence, a tuple."""
    return _shape_of(a)


def size(a, axis=None):
    """``jnp.size``: the number of elements (along ``axis`` when given)."""
    s = _shape_of(a)
    if axis is None:
        return math.prod(s)
    return s[_axis(axis, len(s), "size", s)]


# --- creation ------------------------------------------------------------------------------------

def empty(shape, dtype=None, *, device=None):
    """``jnp.empty``: as jnp (XLA has no uninitialised memory), zeros (float32 by default)."""
    return _cnp().zeros(shape, dtype, device=device)


def empty_like(prototype, dtype=None, shape=None, *, device=None):
    """``jnp.empty_like``: zeros with ``prototype``'s shape, dtype and sharding (as jnp)."""
    out = _cnp().zeros_like(prototype, dtype, shape)
    return out if device is None else _cnp().asarray(out, device=device)


def identity(n, dtype=None):
    """``jnp.identity``: the ``n`` x ``n`` identity (:func:`eye`), float32 by default."""
    return _cnp().eye(n, dtype=dtype)


def tri(N, M=None, k=0, dtype=None):
    """``jnp.tri``: an ``N`` x ``M`` Array with ones at and below the ``k``-th diagonal,
    float32 by default."""
    N = _int(N, "tri", "N")
    M = N if M is None else _int(M, "tri", "M")
    k = _int(k, "tri", "k")
    if N < 0 or M < 0:
        raise ValueError(f"tri: negative dimensions are not allowed, got N={N}, M={M}")
    dt = _dtypes.canonicalize(dtype) if dtype is not None else _dtypes.float32
    return _host_place(np.tri(N, M, k, dtype=dt))


def _tri_indices(n, k, m, who, fn):
    n = _int(n, who, "n")
    k = _int(k, who, "k")
    m = n if m is None else _int(m, who, "m")
    if n < 0 or m < 0:
        raise ValueError(f"{who}: negative dimensions are not allowed, got n={n}, m={m}")
    return tuple(_host_place(i.astype(np.int32)) for i in fn(n, k, m))


def triu_indices(n, k=0, m=None):
    """``jnp.triu_indices``: the (row, column) int32 index Arrays of the upper triangle of an
    ``n`` x ``m`` matrix from the ``k``-th diagonal on.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> [np.asarray(i).tolist() for i in cnp.triu_indices(2)]
    [[0, 0, 1], [0, 1, 1]]
    """
    return _tri_indices(n, k, m, "triu_indices", np.triu_indices)


def tril_indices(n, k=0, m=None):
    """``jnp.tril_indices``: the (row, column) int32 index Arrays of the lower triangle."""
    return _tri_indices(n, k, m, "tril_indices", np.tril_indices)


def _from_2d(arr, who):
    s = _shape_of(arr)
    if len(s) != 2:
        raise ValueError(f"{who}: input array must be 2-d, got shape {s}")
    return s


def triu_indices_from(arr, k=0):
    """``jnp.triu_indices_from``: :func:`triu_indices` for a 2-d array's shape."""
    n, m = _from_2d(arr, "triu_indices_from")
    return triu_indices(n, k, m)


def tril_indices_from(arr, k=0):
    """``jnp.tril_indices_from``: :func:`tril_indices` for a 2-d array's shape."""
    n, m = _from_2d(arr, "tril_indices_from")
    return tril_indices(n, k, m)


def indices(dimensions, dtype=None, sparse=False):
    """``jnp.indices``: a grid of indices (int32 by default), stacked on a new first axis, or
    with ``sparse=True`` a tuple of broadcastable Arrays."""
    dims = _dtypes.int_tuple(dimensions, "indices: dimensions")
    dt = _dtypes.canonicalize(dtype) if dtype is not None else _dtypes.int32
    out = np.indices(dims, dtype=np.int64, sparse=bool(sparse))
    if sparse:
        return tuple(_host_place(i.astype(dt)) for i in out)
    return _host_place(out.astype(dt))


def meshgrid(*xi, copy=True, sparse=False, indexing="xy"):
    """``jnp.meshgrid``: coordinate Arrays from 1-d ones (``indexing='xy'``: the first two
    outputs' axes swapped, as numpy; ``'ij'``: matrix order; ``sparse=True``: unbroadcast
    views of shape 1 but one axis). Built from ``reshape`` and ``broadcast_to``: any dtype,
    differentiable. A list, as jnp returns it."""
    del copy
    if indexing not in ("xy", "ij"):
        raise ValueError(f"Valid values for indexing are 'xy' and 'ij', got {indexing}")
    args = [_operand(x, "meshgrid", f"xi[{i}]") for i, x in enumerate(xi)]
    if builtins.any(len(a.shape) != 1 for a in args):
        raise ValueError(f"Arguments to jax.numpy.meshgrid must be 1D, got shapes "
                         f"{[tuple(a.shape) for a in args]}")
    nd = len(args)
    sizes = [a.shape[0] for a in args]
    if indexing == "xy" and nd >= 2:
        sizes[0], sizes[1] = sizes[1], sizes[0]
    out = []
    cnp = _cnp()
    for i, a in enumerate(args):
        d = i
        if indexing == "xy" and nd >= 2 and i < 2:
            d = 1 - i
        s = [1] * nd
        s[d] = a.shape[0]
        r = cnp.reshape(a, tuple(s))
        out.append(r if sparse else cnp.broadcast_to(r, tuple(sizes)))
    return out


def _spaced_host(v, who):
    if hasattr(v, "shape") and not isinstance(v, np.ndarray):
        v = np.asarray(v)      # an Array: read to the host (creation runs there)
    return np.asarray(v, np.float64)


def logspace(start, stop, num=50, endpoint=True, base=10.0, dtype=None, axis=0):
    """``jnp.logspace``: ``base ** linspace(start, stop, num)``, float32 by default (computed
    in float64 on the host and rounded once; an integer ``dtype`` truncates)."""
    num = _int(num, "logspace", "num")
    if num < 0:
        raise ValueError(f"logspace: number of samples, {num}, must be non-negative")
    host = np.logspace(_spaced_host(start, "logspace"), _spaced_host(stop, "logspace"), num,
                       endpoint=bool(endpoint), base=float(base), axis=axis)
    dt = _dtypes.canonicalize(dtype) if dtype is not None else _dtypes.float32
    return _host_place(np.round(host).astype(dt) if dt.kind in "iu" else host.astype(dt))


def geomspace(start, stop, num=50, endpoint=True, dtype=None, axis=0):
    """``jnp.geomspace``: ``num`` values in geometric progression from ``start`` to ``stop``,
    float32 by default (float64 on the host, rounded once). A ``start`` or ``stop`` of zero
    raises ``ValueError`` (numpy's rule; jax returns NaNs)."""
    num = _int(num, "geomspace", "num")
    if num < 0:
        raise ValueError(f"geomspace: number of samples, {num}, must be non-negative")
    s, e = _spaced_host(start, "geomspace"), _spaced_host(stop, "geomspace")
    if np.any(s == 0) or np.any(e == 0):
        raise ValueError("geomspace: a geometric sequence cannot include zero")
    host = np.geomspace(s, e, num, endpoint=bool(endpoint), axis=axis)
    dt = _dtypes.canonicalize(dtype) if dtype is not None else _dtypes.float32
    return _host_place(np.round(host).astype(dt) if dt.kind in "iu" else host.astype(dt))


def copy(a, order=None):
    """``jnp.copy``: a new Array with ``a``'s values, dtype and sharding; differentiable
    (the identity's gradient) for float Arrays."""
    if order not in (None, "K", "C"):
        raise NotImplementedError(f"copy: only order='K' / 'C' is supported, got {order!r}")
    x = _operand(a, "copy")
    out = x.copy()
    if x.dtype in _o()._FLOATS:
        _o()._record(out, (x,), lambda g: (g,))
    return out


# --- comparison and utilities --------------------------------------------------------------------

def _false():
    return _host_place(np.array(False))


def array_equal(a1, a2, equal_nan=False):
    """``jnp.array_equal``: a bool scalar Array, true when the shapes are equal and every
    element is (with ``equal_nan``, NaNs in the same places count as equal)."""
    cnp = _cnp()
    a, b = _operand(a1, "array_equal", "a1"), _operand(a2, "array_equal", "a2")
    if tuple(a.shape) != tuple(b.shape):
        return _false()
    eq = cnp.equal(a, b)
    if equal_nan:
        eq = cnp.logical_or(eq, cnp.logical_and(cnp.isnan(a), cnp.isnan(b)))
    return cnp.all(eq)


def array_equiv(a1, a2):
    """``jnp.array_equiv``: a bool scalar Array, true when the operands broadcast together
    and are equal everywhere."""
    cnp = _cnp()
    a, b = _operand(a1, "array_equiv", "a1"), _operand(a2, "array_equiv", "a2")
    try:
        np.broadcast_shapes(tuple(a.shape), tuple(b.shape))
    except ValueError:
        return _false()
    return cnp.all(cnp.equal(a, b))


def broadcast_shapes(*shapes):
    """``jnp.broadcast_shapes``: the broadcast of the shapes (ints count as 1-d shapes), a
    tuple; incompatible ones raise ``ValueError``, as jnp."""
    ss = [_dtypes.int_tuple(s, "broadcast_shapes: shape", scalar=True) for s in shapes]
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*ss))
    except ValueError:
        raise ValueError(f"Incompatible shapes for broadcasting: shapes={ss}") from None


def broadcast_arrays(*args):
    """``jnp.broadcast_arrays``: every operand broadcast to their common shape
    (:func:`broadcast_to`, differentiable), a list."""
    arrs = [_operand(a, "broadcast_arrays", f"args[{i}]") for i, a in enumerate(args)]
    s = broadcast_shapes(*[tuple(a.shape) for a in arrs])
    return [a if tuple(a.shape) == s else _cnp().broadcast_to(a, s) for a in arrs]


def absolute(x):
    """``jnp.absolute``: :func:`abs`."""
    return _cnp().abs(x)


def fabs(x):
    """``jnp.fabs``: the absolute value as a float (int and bool operands give float32)."""
    x = _operand(x, "fabs", "x")
    if x.dtype not in _o()._FLOATS:
        x = _cnp().astype(x, _dtypes.float32)
    return _cnp().abs(x)


def positive(x):
    """``jnp.positive``: ``+x`` (the operand itself, any dtype)."""
    return _operand(x, "positive", "x")


def true_divide(x1, x2):
    """``jnp.true_divide``: :func:`divide` (ints divide as float32)."""
    return _cnp().divide(x1, x2)


def count_nonzero(a, axis=None, keepdims=False):
    """``jnp.count_nonzero``: the number of nonzero elements (NaN counts) over ``axis``, an
    int32 Array; a sharded counted dimension ends in an all-reduce."""
    cnp = _cnp()
    return cnp.sum(cnp.not_equal(_operand(a, "count_nonzero"), 0), axis=axis, keepdims=keepdims)


def nan_to_num(x, copy=True, nan=0.0, posinf=None, neginf=None):
    """``jnp.nan_to_num``: NaN replaced by ``nan``, +inf by ``posinf`` and -inf by ``neginf``
    (defaults: 0 and the dtype's largest / most negative finite value). Ints and bools come
    back as they are. A select: the gradient is 1 at finite elements and 0 at the replaced
    ones, as jax's."""
    del copy
    cnp = _cnp()
    x = _operand(x, "nan_to_num", "x")
    if x.dtype not in _o()._FLOATS:
        return x
    info = ml_dtypes.finfo(x.dtype)
    hi = float(info.max) if posinf is None else posinf
    lo = float(info.min) if neginf is None else neginf
    out = cnp.where(cnp.isnan(x), nan, x)
    inf = cnp.isinf(x)
    out = cnp.where(cnp.logical_and(inf, cnp.greater(x, 0)), hi, out)
    return cnp.where(cnp.logical_and(inf, cnp.less(x, 0)), lo, out)


def isin(element, test_elements, assume_unique=False, invert=False, *, method="auto"):
    """``jnp.isin``: for each element of ``element``, whether it equals one of
    ``test_elements`` (a bool Array of ``element``'s shape; ``invert=True`` negates). Every
    element is compared with every test element on the devices (memory ``element.size *
    test_elements.size``, jax's 'compare_all')."""
    del assume_unique, method
    cnp = _cnp()
    e = _operand(element, "isin", "element")
    t = cnp.ravel(_operand(test_elements, "isin", "test_elements"))
    if t.size == 0:
        out = cnp.zeros_like(e, dtype=np.bool_)
    else:
        out = cnp.any(cnp.equal(cnp.expand_dims(e, -1), t), axis=-1)
    return cnp.logical_not(out) if invert else out


def select(condlist, choicelist, default=0):
    """``jnp.select``: where the first true condition of ``condlist`` holds, the matching
    entry of ``choicelist``, else ``default`` (all broadcast together; the dtype is jax's
    promotion of the choices and ``default``). Made of :func:`where`: differentiable in the
    choices and ``default``."""
    condlist, choicelist = list(condlist), list(choicelist)
    if len(condlist) != len(choicelist):
        raise ValueError(f"condlist must have length equal to choicelist "
                         f"({len(condlist)} vs {len(choicelist)})")
    if not condlist:
        raise ValueError("condlist must be non-empty")
    cnp = _cnp()
    for i, c in enumerate(condlist):
        cdt = _dtype_of(c, "select") if hasattr(c, "dtype") else np.asarray(c).dtype
        if cdt != np.bool_:
            raise TypeError(f"select: condlist[{i}] must be a bool array, got dtype {cdt}")
    rdt = cnp.result_type(*choicelist, default, who="select")
    out = default
    for c, v in zip(reversed(condlist), reversed(choicelist)):
        out = cnp.where(c, v, out)
    out = _operand(out, "select")
    return out if out.dtype == rdt else cnp.astype(out, rdt)


def trace(a, offset=0, axis1=0, axis2=1, dtype=None, out=None):
    """``jnp.trace``: the sum along the ``offset`` diagonal of axes ``axis1`` and ``axis2``
    (ints sum in their dtype, bools as int32)."""
    if out is not None:
        raise ValueError("trace: out= is not supported (as in jax)")
    cnp = _cnp()
    a = _operand(a, "trace")
    if len(a.shape) < 2:
        raise ValueError(f"trace: a must be at least 2-d, got shape {tuple(a.shape)}")
    d = cnp.diagonal(a, offset, axis1, axis2)
    return cnp.sum(d, axis=-1, dtype=dtype)


def ptp(a, axis=None, out=None, keepdims=False):
    """``jnp.ptp``: ``max - min`` over ``axis`` (bools raise ``TypeError``, as jnp)."""
    if out is not None:
        raise ValueError("ptp: out= is not supported (as in jax)")
    cnp = _cnp()
    a = _operand(a, "ptp")
    if a.dtype == np.bool_:
        raise TypeError("ptp does not accept dtype bool (the difference of bools is undefined, "
                        "as in jax)")
    return cnp.subtract(cnp.max(a, axis=axis, keepdims=keepdims),
                        cnp.min(a, axis=axis, keepdims=keepdims))


def average(a, axis=None, weights=None, returned=False, keepdims=False):
    """``jnp.average``: the mean over ``axis``, or with ``weights`` (``a``'s shape, or 1-d of
    the length of ``a.shape[axis]``) ``sum(a * w) / sum(w)``; ``returned=True`` adds the sum
    of the weights (broadcast to the average's shape). Ints give float32; zero total weight
    gives NaN, as jnp."""
    cnp = _cnp()
    a = _operand(a, "average")
    if a.dtype not in _o()._FLOATS:
        a = cnp.astype(a, _dtypes.float32)
    if weights is None:
        avg = cnp.mean(a, axis=axis, keepdims=keepdims)
        n = a.size // builtins.max(avg.size, 1) if a.size else 0
        if returned:
            return avg, cnp.full_like(avg, float(n))
        return avg
    w = _operand(weights, "average", "weights")
    if w.dtype not in _o()._FLOATS:
        w = cnp.astype(w, _dtypes.float32)
    if tuple(w.shape) != tuple(a.shape):
        if axis is None:
            raise ValueError("Axis must be specified when shapes of a and weights differ.")
        ax = _axis(axis, len(a.shape), "average", a.shape)
        if len(w.shape) != 1 or w.shape[0] != a.shape[ax]:
            raise ValueError("Shape of weights must be consistent with shape of a along "
                             "specified axis.")
        w = cnp.reshape(w, tuple(a.shape[ax] if d == ax else 1 for d in range(len(a.shape))))
        w = cnp.broadcast_to(w, tuple(a.shape))
    scl = cnp.sum(w, axis=axis, keepdims=keepdims)
    avg = cnp.divide(cnp.sum(cnp.multiply(a, w), axis=axis, keepdims=keepdims), scl)
    if returned:
        return avg, (scl if tuple(scl.shape) == tuple(avg.shape) else
                     cnp.broadcast_to(scl, tuple(avg.shape)))
    return avg


def cross(a, b, axisa=-1, axisb=-1, axisc=-1, axis=None):
    """``jnp.cross``: the cross product of vectors of 2 or 3 components along ``axisa`` /
    ``axisb`` (``axis`` sets all three), broadcast over the other dimensions; two 2-vectors
    give the scalar z component. Built from slices, products and ``stack``:
    differentiable."""
    cnp = _cnp()
    a, b = _operand(a, "cross", "a"), _operand(b, "cross", "b")
    if axis is not None:
        axisa = axisb = axisc = axis
    a = moveaxis(a, _axis(axisa, len(a.shape), "cross", a.shape, "axisa"), -1)
    b = moveaxis(b, _axis(axisb, len(b.shape), "cross", b.shape, "axisb"), -1)
    if a.shape[-1] not in (2, 3) or b.shape[-1] not in (2, 3):
        raise ValueError("Dimension must be either 2 or 3 for cross product")

    def comp(v, i):
        return getitem(v, (Ellipsis, i)) if i < v.shape[-1] else None

    a0, a1, a2 = (comp(a, i) for i in range(3))
    b0, b1, b2 = (comp(b, i) for i in range(3))
    z = cnp.subtract(cnp.multiply(a0, b1), cnp.multiply(a1, b0))
    if a2 is None and b2 is None:
        return z

    def mul(p, q):
        return None if p is None or q is None else cnp.multiply(p, q)

    def sub(p, q):
        if q is None:
            return p
        return cnp.negative(q) if p is None else cnp.subtract(p, q)
    x = sub(mul(a1, b2), mul(a2, b1))
    y = sub(mul(a2, b0), mul(a0, b2))
    s = cnp.broadcast_shapes(tuple(x.shape), tuple(y.shape), tuple(z.shape))
    c = cnp.stack([cnp.broadcast_to(v, s) if tuple(v.shape) != s else v for v in (x, y, z)], -1)
    return moveaxis(c, -1, _axis(axisc, len(c.shape), "cross", c.shape, "axisc"))


def kron(a, b):
    """``jnp.kron``: the Kronecker product (``a``'s blocks scaled copies of ``b``), as one
    broadcast product and a reshape: differentiable, any numeric dtype."""
    cnp = _cnp()
    a, b = _operand(a, "kron", "a"), _operand(b, "kron", "b")
    nd = builtins.max(len(a.shape), len(b.shape))
    sa = (1,) * (nd - len(a.shape)) + tuple(a.shape)
    sb = (1,) * (nd - len(b.shape)) + tuple(b.shape)
    ar = cnp.reshape(a, tuple(v for s in sa for v in (s, 1)))
    br = cnp.reshape(b, tuple(v for s in sb for v in (1, s)))
    return cnp.reshape(cnp.multiply(ar, br), tuple(p * q for p, q in zip(sa, sb)))


def rot90(m, k=1, axes=(0, 1)):
    """``jnp.rot90``: ``m`` rotated by 90 degrees ``k`` times in the plane of ``axes`` (from
    the first axis towards the second): flips and an axis swap, exact for every dtype."""
    m = _operand(m, "rot90", "m")
    nd = len(m.shape)
    if nd < 2:
        raise ValueError(f"rot90 requires its first argument to have ndim at least two, but "
                         f"got first argument of shape {tuple(m.shape)}, which has ndim {nd}")
    k = _int(k, "rot90", "k") % 4
    try:
        ax0, ax1 = axes
    except (TypeError, ValueError):
        raise ValueError(f"rot90: axes must be a pair of ints, got {axes!r}") from None
    ax0, ax1 = _axis(ax0, nd, "rot90", m.shape, "axes"), _axis(ax1, nd, "rot90", m.shape, "axes")
    if ax0 == ax1:
        raise ValueError("Axes must be different")
    if k == 0:
        return m
    if k == 2:
        return flip(flip(m, ax0), ax1)
    if k == 1:
        return swapaxes(flip(m, ax1), ax0, ax1)
    return flip(swapaxes(m, ax0, ax1), ax1)


def column_stack(tup):
    """``jnp.column_stack``: 1-d operands as columns, joined along axis 1."""
    cnp = _cnp()
    arrs = [_operand(t, "column_stack", f"tup[{i}]") for i, t in enumerate(tup)]
    arrs = [cnp.reshape(a, (a.shape[0], 1)) if len(a.shape) == 1 else
            (cnp.reshape(a, (1, 1)) if len(a.shape) == 0 else a) for a in arrs]
    return cnp.concatenate(arrs, 1)


def dstack(tup):
    """``jnp.dstack``: operands made at least 3-d, joined along axis 2."""
    cnp = _cnp()
    arrs = [cnp.atleast_3d(_operand(t, "dstack", f"tup[{i}]")) for i, t in enumerate(tup)]
    return cnp.concatenate(arrs, 2)


def hsplit(ary, indices_or_sections):
    """``jnp.hsplit``: :func:`split` along axis 1 (axis 0 for 1-d arrays)."""
    a = _operand(ary, "hsplit", "ary")
    if len(a.shape) == 0:
        raise ValueError("hsplit only works on arrays of 1 or more dimensions")
    return _cnp().split(a, indices_or_sections, axis=1 if len(a.shape) > 1 else 0)


def vsplit(ary, indices_or_sections):
    """``jnp.vsplit``: :func:`split` along axis 0 of an array of at least 2 dimensions (a
    1-d array raises ``ValueError``, numpy's rule; jax splits it silently)."""
    a = _operand(ary, "vsplit", "ary")
    if len(a.shape) < 2:
        raise ValueError(f"vsplit only works on arrays of 2 or more dimensions, got shape "
                         f"{tuple(a.shape)}")
    return _cnp().split(a, indices_or_sections, axis=0)


def dsplit(ary, indices_or_sections):
    """``jnp.dsplit``: :func:`split` along axis 2 of an array of at least 3 dimensions."""
    a = _operand(ary, "dsplit", "ary")
    if len(a.shape) < 3:
        raise ValueError(f"dsplit only works on arrays of 3 or more dimensions, got shape "
                         f"{tuple(a.shape)}")
    return _cnp().split(a, indices_or_sections, axis=2)


def append(arr, values, axis=None):
    """``jnp.append``: ``values`` joined after ``arr`` (both flattened when ``axis`` is None),
    in jax's promoted dtype (``append(int32_array, 1.5)`` is float32)."""
    cnp = _cnp()
    a, v = _operand(arr, "append", "arr"), _operand(values, "append", "values")
    rdt = cnp.result_type(arr, values, who="append")
    a = a if a.dtype == rdt else cnp.astype(a, rdt)
    v = v if v.dtype == rdt else cnp.astype(v, rdt)
    if axis is None:
        return cnp.concatenate([cnp.ravel(a), cnp.ravel(v)], 0)
    if len(a.shape) != len(v.shape):
        raise TypeError(f"Cannot concatenate arrays with different numbers of dimensions: got "
                        f"{tuple(a.shape)}, {tuple(v.shape)}.")
    return cnp.concatenate([a, v], axis)


# --- NaN-skipping reductions ---------------------------------------------------------------------
# jax's compositions (jax._src.numpy.reductions._nan_reduction and friends): the NaNs (and the
# elements a ``where=`` mask leaves out) are replaced by the reduction's identity with a select,
# so they get a zero gradient, then the ordinary reduction runs (its sharding rule included).

def _nan_operand(a, who, where):
    """``(a, skip)``: ``a`` as an Array and the bool mask of the elements to skip (NaNs, and
    those ``where`` leaves out), None when there are none to skip (ints without ``where``)."""
    cnp = _cnp()
    a = _operand(a, who)
    skip = cnp.isnan(a) if a.dtype in _o()._FLOATS else None
    if where is not None:
        wdt = _dtype_of(where, who) if hasattr(where, "dtype") else np.asarray(where).dtype
        if wdt != np.bool_:
            raise TypeError(f"{who}: where= must be a bool mask, got dtype {wdt}")
        keep = cnp.broadcast_to(_operand(where, who, "where"), tuple(a.shape))
        skip = cnp.logical_not(keep) if skip is None else cnp.logical_or(skip, cnp.logical_not(keep))
    return a, skip


def _filled(a, skip, value):
    return a if skip is None else _cnp().where(skip, value, a)


def nansum(a, axis=None, dtype=None, out=None, keepdims=False, initial=None, where=None):
    """``jnp.nansum``: the sum over ``axis`` with NaNs counted as zero (and, with ``where=``,
    only the selected elements; ``initial`` is added). The gradient is 0 at the NaNs.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.nansum(np.array([1.0, np.nan, 2.0], np.float32))).item()
    3.0
    """
    if out is not None:
        raise ValueError("nansum: out= is not supported (as in jax)")
    cnp = _cnp()
    a, skip = _nan_operand(a, "nansum", where)
    r = cnp.sum(_filled(a, skip, 0), axis=axis, dtype=dtype, keepdims=keepdims)
    return r if initial is None else cnp.add(r, initial)


def nanprod(a, axis=None, dtype=None, out=None, keepdims=False, initial=None, where=None):
    """``jnp.nanprod``: the product over ``axis`` with NaNs counted as one (floats: this
    project's ``prod`` computes in floats, so an integer ``a`` raises ``TypeError``; jax
    multiplies ints). The gradient is 0 at the NaNs."""
    if out is not None:
        raise ValueError("nanprod: out= is not supported (as in jax)")
    cnp = _cnp()
    a, skip = _nan_operand(a, "nanprod", where)
    if dtype is not None:
        a = cnp.astype(a, dtype)
    r = cnp.prod(_filled(a, skip, 1), axis=axis, keepdims=keepdims)
    return r if initial is None else cnp.multiply(r, initial)


def _nan_extreme(a, axis, keepdims, initial, where, who, fill, reduce, combine):
    cnp = _cnp()
    if where is not None and initial is None:
        raise ValueError(f"reduction operation {who[3:]} does not have an identity, so to use a "
                         f"where mask one has to specify 'initial'")
    a, skip = _nan_operand(a, who, where)
    if skip is None:   # ints without where=
        r = reduce(a, axis=axis, keepdims=keepdims)
        return r if initial is None else combine(r, initial)
    r = reduce(_filled(a, skip, fill), axis=axis, keepdims=keepdims)
    if initial is not None:
        return combine(r, initial)
    return cnp.where(cnp.all(skip, axis=axis, keepdims=keepdims), np.nan, r)


def nanmax(a, axis=None, out=None, keepdims=False, initial=None, where=None):
    """``jnp.nanmax``: the maximum over ``axis`` ignoring NaNs (NaN where every element is
    NaN, unless ``initial`` is given; ``where=`` needs ``initial``, as jnp). The gradient is
    ``max``'s (split among ties), 0 at the NaNs."""
    if out is not None:
        raise ValueError("nanmax: out= is not supported (as in jax)")
    cnp = _cnp()
    return _nan_extreme(a, axis, keepdims, initial, where, "nanmax", -np.inf, cnp.max,
                        cnp.maximum)


def nanmin(a, axis=None, out=None, keepdims=False, initial=None, where=None):
    """``jnp.nanmin``: the minimum over ``axis`` ignoring NaNs (as :func:`nanmax`)."""
    if out is not None:
        raise ValueError("nanmin: out= is not supported (as in jax)")
    cnp = _cnp()
    return _nan_extreme(a, axis, keepdims, initial, where, "nanmin", np.inf, cnp.min,
                        cnp.minimum)


def _inexact(a):
    """``a`` with ints and bools as float32 (jnp's ``promote_dtypes_inexact``)."""
    return a if a.dtype in _o()._FLOATS else _cnp().astype(a, _dtypes.float32)


def _nan_count(a, skip, axis, keepdims):
    cnp = _cnp()
    if skip is None:
        return cnp.sum(cnp.ones_like(a, dtype=np.float32), axis=axis, keepdims=keepdims)
    return cnp.sum(cnp.logical_not(skip), axis=axis, dtype=np.float32, keepdims=keepdims)


def _nan_prep(a, who, where, dtype, out):
    """The NaN-skipping means' shared start: ``out=`` refused (as jax), the operand and its
    skip mask, its result dtype (inexact, or ``dtype``), and its float32 values."""
    if out is not None:
        raise ValueError(f"{who}: out= is not supported (as in jax)")
    cnp = _cnp()
    a, skip = _nan_operand(a, who, where)
    a = _inexact(a) if dtype is None else cnp.astype(a, dtype)
    return cnp.astype(a, np.float32), skip, a.dtype


def nanmean(a, axis=None, dtype=None, out=None, keepdims=False, where=None):
    """``jnp.nanmean``: the mean of the non-NaN elements over ``axis`` (NaN where there are
    none; ints give float32). The gradient is 0 at the NaNs and ``1 / count`` elsewhere."""
    cnp = _cnp()
    f, skip, dt = _nan_prep(a, "nanmean", where, dtype, out)
    s = cnp.sum(_filled(f, skip, 0.0), axis=axis, keepdims=keepdims)
    r = cnp.divide(s, _nan_count(f, skip, axis, keepdims))
    return r if r.dtype == dt else cnp.astype(r, dt)


def nanvar(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, where=None):
    """``jnp.nanvar``: the variance of the non-NaN elements over ``axis``, the sum of squared
    deviations over ``count - ddof`` (NaN where that is <= 0; ints give float32). The
    gradient is 0 at the NaNs."""
    cnp = _cnp()
    f, skip, dt = _nan_prep(a, "nanvar", where, dtype, out)
    cnt = _nan_count(f, skip, axis, True)
    m = cnp.divide(cnp.sum(_filled(f, skip, 0.0), axis=axis, keepdims=True), cnt)
    centered = _filled(cnp.subtract(f, m), skip, 0.0)
    ss = cnp.sum(cnp.square(centered), axis=axis, keepdims=keepdims)
    norm = cnp.subtract(_nan_count(f, skip, axis, keepdims), float(ddof))
    bad = cnp.less_equal(norm, 0.0)
    r = cnp.divide(cnp.where(bad, np.nan, ss), cnp.where(bad, 1.0, norm))
    return r if r.dtype == dt else cnp.astype(r, dt)


def nanstd(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, where=None):
    """``jnp.nanstd``: ``sqrt(nanvar(...))``."""
    if out is not None:
        raise ValueError("nanstd: out= is not supported (as in jax)")
    v = nanvar(a, axis=axis, dtype=dtype, ddof=ddof, keepdims=keepdims, where=where)
    dt = v.dtype
    r = _cnp().sqrt(_cnp().astype(v, np.float32))
    return r if dt == np.float32 else _cnp().astype(r, dt)


def _nan_arg(a, axis, keepdims, who, fill, arg):
    cnp = _cnp()
    a = _operand(a, who)
    if a.dtype not in _o()._FLOATS:
        return arg(a, axis=axis, keepdims=keepdims)
    nan = cnp.isnan(a)
    r = arg(cnp.where(nan, fill, a), axis=axis, keepdims=keepdims)
    return cnp.where(cnp.all(nan, axis=axis, keepdims=keepdims), -1, r)


def nanargmax(a, axis=None, out=None, keepdims=None):
    """``jnp.nanargmax``: the index of the first maximum ignoring NaNs, int32; -1 where
    every element is NaN (jax's value; numpy raises)."""
    if out is not None:
        raise ValueError("nanargmax: out= is not supported (as in jax)")
    return _nan_arg(a, axis, bool(keepdims), "nanargmax", -np.inf, _cnp().argmax)


def nanargmin(a, axis=None, out=None, keepdims=None):
    """``jnp.nanargmin``: the index of the first minimum ignoring NaNs (as
    :func:`nanargmax`)."""
    if out is not None:
        raise ValueError("nanargmin: out= is not supported (as in jax)")
    return _nan_arg(a, axis, bool(keepdims), "nanargmin", np.inf, _cnp().argmin)


def _nancum(a, axis, dtype, out, who, fill, scan):
    """``scan`` (cumsum / cumprod) of ``a`` with its NaNs replaced by ``fill``."""
    if out is not None:
        raise ValueError(f"{who}: out= is not supported (as in jax)")
    a, skip = _nan_operand(a, who, None)
    if dtype is not None:
        a = _cnp().astype(a, dtype)
    return scan(_filled(a, skip, fill), axis=axis)


def nancumsum(a, axis=None, dtype=None, out=None):
    """``jnp.nancumsum``: :func:`cumsum` with NaNs counted as zero (gradient 0 there)."""
    return _nancum(a, axis, dtype, out, "nancumsum", 0, _cnp().cumsum)


def nancumprod(a, axis=None, dtype=None, out=None):
    """``jnp.nancumprod``: :func:`cumprod` with NaNs counted as one (gradient 0 there)."""
    return _nancum(a, axis, dtype, out, "nancumprod", 1, _cnp().cumprod)


# --- order statistics ----------------------------------------------------------------------------

_METHODS = ("linear", "lower", "higher", "midpoint", "nearest", "inverted_cdf")


def _host_q(q, who):
    if hasattr(q, "shape") and not isinstance(q, np.ndarray):
        q = _o()._host_value(q)   # an Array: read to the host (it plans the gather)
    qh = np.asarray(q)
    if qh.dtype.kind not in "biuf" and qh.dtype not in _ML_FLOATS:
        raise TypeError(f"{who}: q must be a real number or array, got dtype {qh.dtype}")
    if qh.ndim > 1:
        raise ValueError(f"q must be have rank <= 1, got shape {qh.shape}")
    return qh.astype(np.float32)


def _check_args(name, overwrite_input, out, method="linear"):
    """jax's refusals for the order statistics' numpy-only arguments, and the method names."""
    if overwrite_input or out is not None:
        raise ValueError(f"jax.numpy.{name} does not support overwrite_input=True or out != None")
    if method not in _METHODS:
        raise ValueError("method can only be 'linear', 'lower', 'higher', 'midpoint', "
                         "'nearest' or 'inverted_cdf'")


def quantile(a, q, axis=None, out=None, overwrite_input=False, method="linear",
             keepdims=False, *, weights=None):
    """``jnp.quantile``: the ``q``-th quantiles (``q`` a scalar or 1-d, in ``[0, 1]``) of
    ``a`` over ``axis`` (None: all; a tuple: those axes together), by jax's methods
    'linear', 'lower', 'higher', 'midpoint', 'nearest' (a tie at one half takes the lower
    one, as jax) and 'inverted_cdf'. The result has ``q``'s dimension first, then the
    reduced shape (``keepdims``: size-1 dimensions in place); its dtype is ``a``'s float
    dtype (ints give float32). A NaN in a slice makes its quantiles NaN.

    ``a`` is sorted with :func:`sort` (positions planned on the host, values gathered on the
    devices) and the one or two order statistics each ``q`` needs are gathered and
    interpolated with weights computed on the host in float32 as jax computes them, so the
    gradient goes to those elements, as jax's. ``q`` is read to the host (no gradient with
    respect to ``q``); a ``q`` outside ``[0, 1]`` raises ``ValueError`` (jax clamps silently);
    ``weights=`` is not supported.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.quantile(np.array([1., 2., 3., 4.], np.float32), np.array([0.5, 0.25]))).tolist()
    [2.5, 1.75]
    """
    who = "quantile"
    _check_args("quantile", overwrite_input, out, method)
    if weights is not None:
        raise NotImplementedError(f"{who}: weights= is not supported")
    return _quantile(a, _host_q(q, who), axis, method, keepdims, who)


def _quantile(a, qh, axis, method, keepdims, who, nan=False):
    cnp = _cnp()
    a = _operand(a, who)
    if np.any(~((qh >= 0) & (qh <= 1))):
        raise ValueError(f"{who}: quantiles must be in the range [0, 1], got {qh.tolist()}")
    dt = a.dtype if a.dtype in _o()._FLOATS else _dtypes.float32
    f = cnp.astype(a, np.float32)
    nd = len(f.shape)
    if axis is None:
        red = tuple(range(nd))
    else:
        red = tuple(sorted(_axes(axis, nd, who, f.shape)))
    kept = [d for d in range(nd) if d not in red]
    keep_shape = tuple(1 if d in red else s for d, s in enumerate(f.shape))
    # the reduced dimensions moved last and merged into one
    if red != tuple(range(nd - len(red), nd)):
        f = cnp.transpose(f, kept + list(red))
    n = math.prod(f.shape[len(kept):])
    f = cnp.reshape(f, tuple(f.shape[:len(kept)]) + (n,))
    if n == 0:
        raise TypeError(f"{who}: the reduced dimensions of shape {tuple(a.shape)} are empty "
                        f"(jax fails in its gather)")
    s = sort(f, axis=-1)
    if nan:
        r = _nan_order_statistics(s, qh, method, n)
    else:
        lo_i, hi_i, hw = _order_positions(qh, np.float32(n), n, method)

        def gather(i):
            v = take(s, np.asarray(i, np.int64), axis=-1)    # (..., [k])
            return moveaxis(v, -1, 0) if np.ndim(i) == 1 else v

        r = _interpolate(method, gather, lo_i, hi_i, hw.reshape(hw.shape + (1,) * len(kept)))
        # a NaN anywhere in a slice: NaN (sort put NaNs last; jax's where before its sort)
        r = cnp.where(cnp.any(cnp.isnan(s), axis=-1), np.nan, r)
    if keepdims:
        r = cnp.reshape(r, tuple(qh.shape) + keep_shape)
    return r if dt == np.float32 else cnp.astype(r, dt)


def _order_positions(q, c, n, method):
    """jax's positions of the quantiles ``q`` among ``c`` sorted elements (a number, or per-row
    counts broadcastable against ``q``) of rows of length ``n``: the indices of the low and
    high order statistics, clamped to ``[0, c - 1]``, and the high one's weight, in float32
    as jax computes them."""
    q = np.asarray(q, np.float32)
    c = np.asarray(c, np.float32)
    top = np.maximum(c - np.float32(1), 0)
    if method == "inverted_cdf":     # the first position whose cumulative count reaches q * c
        cum = np.minimum(np.arange(1, n + 1, dtype=np.float32), c[..., None])
        idx = np.clip((cum < (q * c)[..., None]).sum(-1), 0, top).astype(np.int64)
        return idx, idx, np.zeros(idx.shape, np.float32)
    pos = q * (c - np.float32(1))
    lo = np.floor(pos)
    hw = (pos - lo).astype(np.float32)
    lo_i = np.clip(lo, 0, top).astype(np.int64)
    hi_i = np.clip(np.ceil(pos), 0, top).astype(np.int64)
    if method == "nearest":          # a tie at one half takes the lower one, as jax
        lo_i = hi_i = np.where(hw <= np.float32(0.5), lo_i, hi_i)
    elif method == "lower":
        hi_i = lo_i
    elif method == "higher":
        lo_i = hi_i
    return lo_i, hi_i, hw


def _interpolate(method, gather, lo_i, hi_i, w):
    """The quantile from the gathered order statistics (``w``: the high one's weight, shaped
    like the gathered values)."""
    cnp = _cnp()
    lo_v = gather(lo_i)
    if method == "linear":
        return cnp.add(cnp.multiply(lo_v, cnp.asarray(np.float32(1) - w)),
                       cnp.multiply(gather(hi_i), cnp.asarray(w)))
    if method == "midpoint":
        return cnp.multiply(cnp.add(lo_v, gather(hi_i)), 0.5)
    return lo_v


def _nan_order_statistics(s, qh, method, n):
    """The quantiles ``qh`` of each row of ``s`` (rows sorted, NaNs last) among its non-NaN
    elements, as jax's ``squash_nans`` path: ``pos = q * (count - 1)`` per row in float32,
    the order statistics at ``floor`` / ``ceil`` (clamped to ``[0, count - 1]``) gathered per
    row, interpolated as the method says; a row of NaNs only gives NaN. The counts are read
    to the host (one number per row) to plan the gathers."""
    cnp = _cnp()
    rows = tuple(s.shape[:-1])
    cnt = _o()._host_value(cnp.sum(cnp.logical_not(cnp.isnan(s)), axis=-1)).astype(np.float32)
    cnt = np.reshape(cnt, rows)
    q = qh.reshape(-1).astype(np.float32)                       # (k,)
    lo_i, hi_i, hw = _order_positions(q, cnt[..., None], n, method)  # rows + (k,)

    def gather(i):            # rows + (k,) -> (k,) + rows
        return moveaxis(take_along_axis(s, np.asarray(i, np.int64), axis=-1), -1, 0)

    r = _interpolate(method, gather, lo_i, hi_i, np.moveaxis(hw, -1, 0))
    empty = np.broadcast_to(cnt == 0, r.shape)
    if empty.any():
        r = cnp.where(empty, np.nan, r)
    return r[0] if qh.ndim == 0 else r


def nanquantile(a, q, axis=None, out=None, overwrite_input=False, method="linear",
                keepdims=False):
    """``jnp.nanquantile``: :func:`quantile` ignoring NaNs: each slice's quantiles among its
    non-NaN elements (positions ``q * (count - 1)`` per slice, as jax), NaN for a slice of
    NaNs only. The gradient goes to the order statistics used.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> x = np.array([[1., np.nan, 3.], [np.nan, np.nan, np.nan]], np.float32)
    >>> np.asarray(cnp.nanquantile(x, 0.5, axis=1)).tolist()
    [2.0, nan]
    """
    _check_args("nanquantile", overwrite_input, out, method)
    return _quantile(a, _host_q(q, "nanquantile"), axis, method, keepdims, "nanquantile",
                     nan=True)


def nanpercentile(a, q, axis=None, out=None, overwrite_input=False, method="linear",
                  keepdims=False):
    """``jnp.nanpercentile``: :func:`nanquantile` of ``q / 100``."""
    _check_args("nanpercentile", overwrite_input, out, method)
    qh = _host_q(q, "nanpercentile") / np.float32(100)
    return _quantile(a, qh, axis, method, keepdims, "nanpercentile", nan=True)


def nanmedian(a, axis=None, out=None, overwrite_input=False, keepdims=False):
    """``jnp.nanmedian``: :func:`nanquantile` at 0.5 with method 'midpoint'."""
    _check_args("nanmedian", overwrite_input, out)
    return _quantile(a, np.asarray(0.5, np.float32), axis, "midpoint", keepdims, "nanmedian",
                     nan=True)


def percentile(a, q, axis=None, out=None, overwrite_input=False, method="linear",
               keepdims=False, *, weights=None):
    """``jnp.percentile``: :func:`quantile` of ``q / 100`` (``q`` in ``[0, 100]``)."""
    _check_args("percentile", overwrite_input, out, method)
    if weights is not None:
        raise NotImplementedError("percentile: weights= is not supported")
    qh = _host_q(q, "percentile") / np.float32(100)
    return _quantile(a, qh, axis, method, keepdims, "percentile")


def median(a, axis=None, out=None, overwrite_input=False, keepdims=False):
    """``jnp.median``: :func:`quantile` at 0.5 with jax's method 'midpoint' (the mean of the
    two middle elements of an even count; the gradient splits between them)."""
    _check_args("median", overwrite_input, out)
    return _quantile(a, np.asarray(0.5, np.float32), axis, "midpoint", keepdims, "median")


def _host_values(x, who, name):
    """(``x`` as an Array, its whole value on the host: gathered to every process when it
    is sharded over processes)."""
    x = _operand(x, who, name)
    return x, _o()._host_value(x)


def searchsorted(a, v, side="left", sorter=None, *, method="scan"):
    """``jnp.searchsorted``: int32 positions where the elements of ``v`` would be inserted
    into the sorted 1-d ``a`` (``side='left'``: before equal elements, ``'right'``: after;
    NaNs sort last, ``-0.0`` equals ``0.0``); ``sorter`` is an argsort of an unsorted ``a``.
    Computed on the host; the result has ``v``'s shape (and sharding, when ``v`` is an
    Array). ``method`` (jax's search strategy) does not change the result."""
    who = "searchsorted"
    if side not in ("left", "right"):
        raise ValueError(f"invalid argument side={side!r}, expected 'left' or 'right'")
    if method not in ("scan", "scan_unrolled", "sort", "compare_all"):
        raise ValueError(f"invalid argument method={method!r}, expected 'scan', "
                         f"'scan_unrolled', 'sort' or 'compare_all'")
    _, ah = _host_values(a, who, "a")
    if ah.ndim != 1:
        raise ValueError("a should be 1-dimensional")
    vx, vh = _host_values(v, who, "v")
    if sorter is not None:
        sh = _o()._host_value(sorter)
        if sh.shape != ah.shape or sh.dtype.kind not in "iu":
            raise ValueError(f"{who}: sorter must be an integer array of a's shape {ah.shape}")
        ah = ah[sh]
    dt = np.result_type(ah.dtype, vh.dtype) if ah.dtype != _BF16 and vh.dtype != _BF16 \
        else np.float32
    ah, vh = ah.astype(dt), vh.astype(dt)
    if dt.kind == "f":   # -0.0 == 0.0 (numpy agrees), NaNs last (numpy agrees)
        ah, vh = ah + dt.type(0), vh + dt.type(0)
    idx = np.searchsorted(ah, vh, side=side).astype(np.int32)
    if isinstance(v, Array):
        return device_put(np.asarray(idx), vx.sharding)
    return _host_place(idx)


def _mesh_of(x):
    """Where an index result of ``x`` goes: replicated over ``x``'s mesh when it has one (the
    same placement in every process, ``x`` sharded over processes included), else None
    (placed as ``device_put`` places it)."""
    return _o()._place_of(x) if isinstance(x, Array) and isinstance(x.sharding, NamedSharding) \
        else None


def _size_arg(size, who):
    s = _int(size, who, "size")
    if s < 0:
        raise ValueError(f"{who}: size must be non-negative, got {s}")
    return s


def nonzero(a, *, size=None, fill_value=None):
    """``jnp.nonzero``: a tuple of int32 Arrays, the indices of the nonzero elements (row
    major), one per dimension. The count is found on the host; jax's ``size=`` pads (with
    ``fill_value``, 0 by default; a tuple gives one per dimension) or truncates to that
    length. A 0-d ``a`` raises ``ValueError``, as jnp. The indices are replicated over
    ``a``'s mesh when it has one (an ``a`` sharded over processes is gathered to every
    process); else placed as ``device_put`` places them."""
    who = "nonzero"
    x, h = _host_values(a, who, "a")
    if h.ndim == 0:
        raise ValueError("Calling nonzero on 0d arrays is not allowed. Use "
                         "jnp.atleast_1d(scalar).nonzero() instead.")
    idx = [i.astype(np.int32) for i in np.nonzero(h.astype(np.float32) != 0
                                                  if h.dtype in _ML_FLOATS else h)]
    if size is not None:
        size = _size_arg(size, who)
        fills = fill_value if isinstance(fill_value, (tuple, list)) else (fill_value,) * h.ndim
        if len(fills) != h.ndim:
            raise ValueError(f"{who}: fill_value of length {len(fills)} for an array of "
                             f"dimension {h.ndim}")
        out = []
        for i, fv in zip(idx, fills):
            i = i[:size]
            if len(i) < size:
                pad = np.full(size - len(i), 0 if fv is None else fv, np.int32)
                i = np.concatenate([i, pad])
            out.append(i)
        idx = out
    return tuple(_o()._lift_any(np.array(i, order="C"), _mesh_of(x)) for i in idx)


def argwhere(a, *, size=None, fill_value=None):
    """``jnp.argwhere``: the indices of the nonzero elements as rows of an int32 Array of
    shape ``(count, a.ndim)`` (``size=`` / ``fill_value=`` as :func:`nonzero`; a 0-d ``a``
    gives shape ``(count, 0)``)."""
    who = "argwhere"
    x, h = _host_values(a, who, "a")
    if h.ndim == 0:
        cols = nonzero(np.atleast_1d(h), size=size, fill_value=fill_value)
        return _o()._lift_any(np.zeros((cols[0].shape[0], 0), np.int32), _mesh_of(x))
    cols = nonzero(h, size=size, fill_value=fill_value)
    return _o()._lift_any(np.ascontiguousarray(
        np.stack([np.asarray(c) for c in cols], axis=1).reshape(-1, h.ndim)), _mesh_of(x))


def flatnonzero(a, *, size=None, fill_value=None):
    """``jnp.flatnonzero``: the flat (row-major) indices of the nonzero elements, int32
    (``size=`` / ``fill_value=`` as :func:`nonzero`)."""
    x, h = _host_values(a, "flatnonzero", "a")
    i = nonzero(h.reshape(-1), size=size, fill_value=fill_value)[0]
    return i if _mesh_of(x) is None else _o()._lift_any(np.asarray(i), _mesh_of(x))


def where(condition, x=None, y=None, /, *, size=None, fill_value=None):
    """``jnp.where``: with ``x`` and ``y``, the select of :func:`ctrainstate._src.ops.ops.where`
    (``x`` where ``condition``, else ``y``; differentiable in both); with neither,
    :func:`nonzero` of ``condition`` (``size=`` / ``fill_value=`` as there)."""
    if x is None and y is None:
        return nonzero(condition, size=size, fill_value=fill_value)
    if x is None or y is None:
        raise TypeError("where: either both or neither of x and y must be given (one "
                        "argument: the indices of condition's nonzero elements)")
    if size is not None or fill_value is not None:
        raise ValueError("size and fill_value arguments cannot be used in three-term where "
                         "function.")
    return _o().where(condition, x, y)
