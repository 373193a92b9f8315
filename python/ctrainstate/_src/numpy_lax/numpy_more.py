"""More of ``jax.numpy``'s names: the NumPy-2 aliases, index helpers, real-dtype complex
helpers, integer number theory, array-API reductions and products, set operations, binning,
insertion / deletion, convolution, statistics and polynomials.

As :mod:`ctrainstate._src.numpy_lax.numpy_extra`, everything is composed from the differentiable ops
(``where``, ``take``, ``take_along_axis``, ``concatenate``, ``matmul``, ``sum``, ...), so the
results keep those ops' sharding rules and jax's gradients where jax has them: ``interp`` is
differentiable in ``x``, ``xp`` and ``fp``, ``convolve`` in both operands, ``partition``
sends the gradient to the elements it gathers. Where the output's shape or the positions it
reads depend on the values (``unique``, ``delete``, ``compress``, ``digitize``, ``bincount``,
``histogram``'s bins, the set operations), the operand that decides them is read to the host
(the eager counterpart of jax's concrete arguments and ``size=``), the int32 positions are
planned there and the values are gathered on the devices; jax's ``size=`` / ``fill_value=``
give static shapes as in jax.

Scatters into int Arrays run here as gathers and selects (``put_along_axis``,
``fill_diagonal``, ``insert``): the positions are planned on the host, a later duplicate
index wins, as numpy.

Results follow jax 0.10 without x64 (int32 indices and counts, float32 for the inexact
results of ints). Complex dtypes are not supported: ``real`` / ``conj`` return their real
operand, ``imag`` its zeros.

>>> import numpy as np, ctrainstate.numpy as cnp
>>> np.asarray(cnp.unique(np.array([3, 1, 3, 2]), size=4, fill_value=-1)).tolist()
[1, 2, 3, -1]
>>> np.asarray(cnp.interp(np.array([0.5, 2.5], np.float32), np.array([0., 1., 3.]),
...                       np.array([0., 10., 30.]))).tolist()
[5.0, 25.0]
"""
from __future__ import annotations
from ..base.hooks import provide as _provide
_provide('_numpy_more', __name__)   # lower layers call into this module through _hooks.upper

import builtins
import collections
import math
import operator

import numpy as np

from ..base import dtypes as _dtypes
from .numpy_extra import _cnp, _mesh_of, _o, _operand  # the lazy module accessors, shared
from ..ops import elementwise as _elementwise, math_extra as _math_extra
from ..ops.move import _axes, _axis as a, _int as i, take_along_axis
from ..ops.slicing import getitem
from ..array.array import Array
from ..array.sharding import NamedSharding, PartitionSpec
from ..base.hooks import upper as _upper

__all__ = [
    # NumPy-2 / array-API aliases
    "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "pow", "concat",
    "permute_dims", "matrix_transpose", "bitwise_invert", "bitwise_left_shift",
    "bitwise_right_shift",
    # index helpers and predicates
    "newaxis", "isscalar", "iterable", "s_", "index_exp",
    # elementwise
    "rint", "modf", "frexp", "isposinf", "isneginf", "real", "imag", "conj", "conjugate",
    "isreal", "iscomplex", "isrealobj", "iscomplexobj", "gcd", "lcm",
    # reductions and products
    "cumulative_sum", "cumulative_prod", "vecdot", "matvec", "vecmat",
    # index arithmetic, layout
    "unstack", "unravel_index", "ravel_multi_index", "diagflat", "diag_indices",
    "diag_indices_from", "fill_diagonal", "put_along_axis", "resize", "trim_zeros",
    "delete", "insert", "compress", "extract", "choose",
    # sorting, sets, binning
    "lexsort", "partition", "argpartition", "unique", "unique_values", "unique_counts",
    "unique_inverse", "unique_all", "setdiff1d", "union1d", "intersect1d", "setxor1d",
    "digitize", "bincount", "histogram_bin_edges", "histogram",
    # numerics
    "interp", "ediff1d", "trapezoid", "gradient", "convolve", "correlate", "cov", "corrcoef",
    "polyval", "vander",
]




def _int(v, who, name):
    return i(v, who, name)


def _axis(axis, nd, who, shape=None, name="axis"):
    return a(axis, nd, who, shape, name)


def _host_place(host, like=None):
    """A host result with its canonical dtype, replicated over ``like``'s mesh when ``like``
    is an Array on one (the same placement in every process, ``like`` sharded over
    processes included), else placed as ``device_put`` places it."""
    return _o()._lift_any(np.array(host, order="C"), _mesh_of(like))


def _idx(host, like=None):
    """Host positions as an int32 Array (jax's index dtype without x64), placed as
    :func:`_host_place` places them."""
    return _host_place(np.asarray(host, np.int64).astype(np.int32), like)


def _replicated(like):
    """The sharding that replicates over ``like``'s mesh (None where ``like`` has none): a
    new Array's ``device=`` placement beside a host result of ``like``."""
    m = _mesh_of(like)
    return None if m is None else NamedSharding(m, PartitionSpec())


def _hv(x):
    """The whole value of ``x`` on the host: an Array sharded over processes is gathered to
    every process (each computes the same result from it)."""
    return _o()._host_value(x)


def _host(x):
    """The values of an operand on the host (16-bit floats as float32, which orders and
    compares them exactly); gathered to every process as :func:`_hv`."""
    h = _hv(x)
    return h.astype(np.float32) if h.dtype == _dtypes.bfloat16 or h.dtype == np.float16 else h


def _inexact(a):
    """``a`` with ints and bools as float32 (jnp's ``promote_dtypes_inexact``)."""
    return a if a.dtype in _o()._FLOATS else _cnp().astype(a, _dtypes.float32)


def _as(a, dt):
    return a if a.dtype == dt else _cnp().astype(a, dt)


def _along(axis, idx):
    return (slice(None),) * axis + (idx,)


def _getitem(a, idx):
    return getitem(a, idx)


def _take(a, idx, axis):
    """``a`` gathered along ``axis`` at the host positions ``idx`` (every one in range)."""
    return _getitem(a, _along(axis, np.asarray(idx, np.int64)))


def _is_int(dt):
    return np.dtype(dt).kind in "iu"


# --- NumPy-2 / array-API aliases ------------------------------------------------------------------

def _math(name):
    return getattr(_math_extra, name)


acos = _math("arccos")
acosh = _math("arccosh")
asin = _math("arcsin")
asinh = _math("arcsinh")
atan = _math("arctan")
atan2 = _math("arctan2")
atanh = _math("arctanh")


def _ew(name):
    return getattr(_elementwise, name)


bitwise_invert = _ew("invert")
bitwise_left_shift = _ew("left_shift")
bitwise_right_shift = _ew("right_shift")


def pow(x1, x2, /):  # noqa: A001 - the array API's name
    """``jnp.pow``: the array API's name of :func:`power`."""
    return _cnp().power(x1, x2)


def concat(arrays, /, *, axis=0):
    """``jnp.concat``: the array API's :func:`concatenate` (``axis=None`` joins the
    flattened operands)."""
    return _cnp().concatenate(arrays, axis=axis)


def permute_dims(a, /, axes):
    """``jnp.permute_dims``: the array API's :func:`transpose` (``axes`` required)."""
    return _cnp().transpose(_operand(a, "permute_dims"), tuple(axes))


def matrix_transpose(x, /):
    """``jnp.matrix_transpose``: the last two axes swapped (a 0-d or 1-d ``x`` raises
    ``ValueError``, as jnp)."""
    x = _operand(x, "matrix_transpose", "x")
    nd = len(x.shape)
    if nd < 2:
        raise ValueError(f"x must be at least two-dimensional for matrix_transpose; got "
                         f"ndim={nd}")
    return _cnp().swapaxes(x, -1, -2)


# --- index helpers and predicates -----------------------------------------------------------------

newaxis = None
s_ = np.s_
index_exp = np.index_exp


def isscalar(element):
    """``jnp.isscalar``: True for Python and numpy scalars and for 0-d arrays (Arrays and
    numpy arrays); False for lists and everything else."""
    if np.isscalar(element):
        return True
    if isinstance(element, (np.ndarray, Array)):
        return len(element.shape) == 0
    return False


def iterable(y):
    """``jnp.iterable``: whether ``iter(y)`` succeeds; an Array of at least one dimension
    counts as iterable, as a jax Array does (it iterates over its first axis), though this
    project's Arrays refuse ``iter`` (a host loop over device slices)."""
    if isinstance(y, Array):
        return len(y.shape) > 0
    try:
        iter(y)
    except TypeError:
        return False
    return True


# --- elementwise ----------------------------------------------------------------------------------

def rint(x, /):
    """``jnp.rint``: rounded to the nearest integer, halves to even, in ``x``'s float dtype;
    ints and bools become float32 (as jnp). The gradient is 0 (jax's ``round``)."""
    x = _operand(x, "rint", "x")
    if x.dtype not in _o()._FLOATS:
        return _cnp().astype(x, _dtypes.float32)
    return _cnp().round(x)


def modf(x, /, out=None):
    """``jnp.modf``: ``(x - whole, whole)`` with ``whole`` ``x`` rounded towards zero, in
    ``x``'s inexact dtype (ints give float32). As jnp, ``modf(inf)`` is ``(nan, inf)``
    (numpy: ``(0, inf)``). The fractional part's gradient is 1, the whole part's 0."""
    if out is not None:
        raise NotImplementedError("The 'out' argument to jnp.modf is not supported.")
    cnp = _cnp()
    x = _inexact(_operand(x, "modf", "x"))
    whole = cnp.where(cnp.greater_equal(x, 0), cnp.floor(x), cnp.ceil(x))
    return cnp.subtract(x, whole), whole


def frexp(x, /):
    """``jnp.frexp``: the mantissa (``0.5 <= |m| < 1``, ``x``'s inexact dtype) and the int32
    exponent with ``x == m * 2 ** e``; zeros, infinities and NaNs give ``(x, 0)``. Exact: the
    exponent is estimated with ``log2``, corrected by one either way where the scaled value
    falls outside ``[0.5, 1)``, and every scaling is :func:`ldexp` by a power of two
    (subnormals are scaled by ``2 ** 64`` first). No gradient (jax's is zero almost everywhere)."""
    cnp = _cnp()
    x = _inexact(_operand(x, "frexp", "x"))
    dt = x.dtype
    f = _as(x, _dtypes.float32)
    # the CPU kernels treat subnormal operands as zero in arithmetic and comparisons, ldexp
    # does not: values below 1 are scaled up by 2**64 first (subnormals become normal)
    s = cnp.where(cnp.less(cnp.abs(f), 1.0), 64, 0)
    g = cnp.ldexp(f, s)
    special = cnp.logical_or(cnp.equal(g, 0), cnp.logical_not(cnp.isfinite(f)))
    a = cnp.where(special, 1.0, cnp.abs(g))
    e = cnp.astype(cnp.add(cnp.floor(cnp.log2(a)), 1.0), _dtypes.int32)
    for _ in range(2):
        m = cnp.ldexp(a, cnp.negative(e))
        e = cnp.where(cnp.greater_equal(m, 1.0), cnp.add(e, 1),
                      cnp.where(cnp.less(m, 0.5), cnp.subtract(e, 1), e))
    m = cnp.ldexp(g, cnp.negative(e))
    m = cnp.where(special, f, m)
    e = cnp.where(special, 0, cnp.subtract(e, s))
    stop_gradient = _upper('lax').stop_gradient
    m = stop_gradient(m)
    return _as(m, dt), e


def _isposneginf(x, inf, who, out):
    if out is not None:
        raise NotImplementedError("The 'out' argument to isneginf/isposinf is not supported.")
    cnp = _cnp()
    x = _operand(x, who, "x")
    if x.dtype in _o()._FLOATS:
        return cnp.equal(x, inf)
    return cnp.zeros_like(x, dtype=np.bool_)


def isposinf(x, /, out=None):
    """``jnp.isposinf``: where ``x`` is +inf (a bool Array; all False for ints and bools)."""
    return _isposneginf(x, np.inf, "isposinf", out)


def isneginf(x, /, out=None):
    """``jnp.isneginf``: where ``x`` is -inf (a bool Array; all False for ints and bools)."""
    return _isposneginf(x, -np.inf, "isneginf", out)


def real(val, /):
    """``jnp.real`` of a real operand: the operand itself (complex dtypes are not supported
    here)."""
    return _operand(val, "real", "val")


def imag(val, /):
    """``jnp.imag`` of a real operand: zeros of its shape, dtype and sharding."""
    return _cnp().zeros_like(_operand(val, "imag", "val"))


def conjugate(x, /):
    """``jnp.conjugate`` of a real operand: the operand itself (the identity's gradient)."""
    return _operand(x, "conjugate", "x")


def conj(x, /):
    """``jnp.conj``: :func:`conjugate`."""
    return _operand(x, "conj", "x")


def isreal(x, /):
    """``jnp.isreal`` of a real operand: a bool Array, True everywhere."""
    return _cnp().ones_like(_operand(x, "isreal", "x"), dtype=np.bool_)


def iscomplex(x, /):
    """``jnp.iscomplex`` of a real operand: a bool Array, False everywhere."""
    return _cnp().zeros_like(_operand(x, "iscomplex", "x"), dtype=np.bool_)


def iscomplexobj(x):
    """``jnp.iscomplexobj``: whether ``x`` (a number, an array or anything with a dtype) is
    of a complex type (never for an Array: this project has no complex dtype)."""
    if isinstance(x, (complex, np.complexfloating)):
        return True
    if x is None or isinstance(x, (bool, int, float, str, np.generic)):
        return False
    try:
        typ = x.dtype.type
    except AttributeError:
        typ = np.asarray(x).dtype.type
    return bool(np.issubdtype(typ, np.complexfloating))


def isrealobj(x):
    """``jnp.isrealobj``: ``not iscomplexobj(x)``."""
    return not iscomplexobj(x)


def _int_pair(x1, x2, who):
    cnp = _cnp()
    rdt = cnp.result_type(x1, x2, who=who)
    if not _is_int(rdt):
        raise ValueError(f"Arguments to jax.numpy.{who} must be integers.")
    a, b = _as(_operand(x1, who, "x1"), rdt), _as(_operand(x2, who, "x2"), rdt)
    if isinstance(x2, Array) and not isinstance(x1, Array):
        a = cnp.asarray(a, device=b.sharding)
    return cnp.broadcast_arrays(a, b)


def _gcd(a, b):
    cnp = _cnp()
    a, b = cnp.abs(a), cnp.abs(b)
    # jax's loop: (a, b) <- (b, a rem b) where b != 0, ordered so that a >= b; at most ~46
    # rounds for 32-bit operands (Fibonacci worst case); the condition is read each round
    while bool(np.asarray(cnp.any(cnp.not_equal(b, 0)))):
        nz = cnp.not_equal(b, 0)
        a, b = cnp.where(nz, b, a), cnp.where(nz, cnp.remainder(a, cnp.where(nz, b, 1)), 0)
        lt = cnp.less(a, b)
        a, b = cnp.where(lt, b, a), cnp.where(lt, a, b)
    return a


def gcd(x1, x2, /):
    """``jnp.gcd``: the greatest common divisor of ``|x1|`` and ``|x2|`` elementwise (jax's
    promoted integer dtype; ``gcd(0, 0) == 0``). Float or bool operands raise
    ``ValueError``, as jnp."""
    a, b = _int_pair(x1, x2, "gcd")
    return _gcd(a, b)


def lcm(x1, x2, /):
    """``jnp.lcm``: the least common multiple of ``|x1|`` and ``|x2|`` (0 where either is 0;
    the product wraps in the dtype, as jnp)."""
    cnp = _cnp()
    a, b = _int_pair(x1, x2, "lcm")
    a, b = cnp.abs(a), cnp.abs(b)
    d = _gcd(a, b)
    zero = cnp.equal(d, 0)
    return cnp.where(zero, 0, cnp.multiply(a, cnp.floor_divide(b, cnp.where(zero, 1, d))))


# --- array-API reductions and products ------------------------------------------------------------

def _cumulative(x, axis, dtype, include_initial, who, scan, init, what):
    cnp = _cnp()
    x = _operand(x, who, "x")
    nd = len(x.shape)
    if nd == 0:
        raise ValueError(f"The input must be non-scalar to take a cumulative {what}, however "
                         f"a scalar value or scalar array was given.")
    if axis is None:
        if nd > 1:
            raise ValueError(f"The input array has rank {nd}, however axis was not set to an "
                             f"explicit value. The axis argument is only optional for "
                             f"one-dimensional arrays.")
        axis = 0
    axis = _axis(axis, nd, who, x.shape)
    if dtype is not None:
        x = cnp.astype(x, dtype)
    out = scan(x, axis=axis)
    if include_initial:
        shape = list(x.shape)
        shape[axis] = 1
        first = cnp.full(tuple(shape), init, out.dtype)
        out = cnp.concatenate([first, out], axis)
    return out


def cumulative_sum(x, /, *, axis=None, dtype=None, include_initial=False):
    """``jnp.cumulative_sum`` (the array API's :func:`cumsum`): ``axis`` may be left out for
    1-d ``x`` only; ``include_initial=True`` starts with a zero (the result one longer along
    ``axis``). Bools sum as int32."""
    return _cumulative(x, axis, dtype, include_initial, "cumulative_sum", _cnp().cumsum, 0,
                       "sum")


def cumulative_prod(x, /, *, axis=None, dtype=None, include_initial=False):
    """``jnp.cumulative_prod`` (the array API's :func:`cumprod`): as
    :func:`cumulative_sum`, starting with a one."""
    return _cumulative(x, axis, dtype, include_initial, "cumulative_prod", _cnp().cumprod, 1,
                       "product")


def _vecdot(x1, x2, axis):
    cnp = _cnp()
    a, b = _operand(x1, "vecdot", "x1"), _operand(x2, "vecdot", "x2")
    rdt = cnp.result_type(a, b, who="vecdot")
    a, b = _as(a, rdt), _as(b, rdt)
    ax1 = _axis(axis, len(a.shape), "vecdot", a.shape)
    ax2 = _axis(axis, len(b.shape), "vecdot", b.shape)
    if a.shape[ax1] != b.shape[ax2]:
        raise ValueError(f"axes must match; got shapes {tuple(a.shape)} and {tuple(b.shape)} "
                         f"with axis={axis}")
    a, b = cnp.moveaxis(a, ax1, -1), cnp.moveaxis(b, ax2, -1)
    return cnp.sum(cnp.multiply(a, b), axis=-1)


def vecdot(x1, x2, /, *, axis=-1, precision=None, preferred_element_type=None):
    """``jnp.vecdot``: the dot product of ``x1`` and ``x2`` along ``axis`` (of equal length),
    broadcast over the other dimensions (real operands: no conjugation); jax's promoted
    dtype. A broadcast product and a sum: differentiable, sharded batch dimensions stay
    sharded."""
    del precision, preferred_element_type
    return _vecdot(x1, x2, axis)


def matvec(x1, x2, /):
    """``jnp.matvec``: the matrix-vector product of ``x1`` (``(..., n, m)``) and ``x2``
    (``(..., m)``), broadcast over the leading dimensions: ``(..., n)``."""
    cnp = _cnp()
    a, b = _operand(x1, "matvec", "x1"), _operand(x2, "matvec", "x2")
    if len(a.shape) < 2 or len(b.shape) < 1 or a.shape[-1] != b.shape[-1]:
        raise ValueError(f"matvec: x1 of shape (..., n, m) and x2 of shape (..., m) expected, "
                         f"got {tuple(a.shape)} and {tuple(b.shape)}")
    return _vecdot(a, cnp.expand_dims(b, -2), -1)


def vecmat(x1, x2, /):
    """``jnp.vecmat``: the vector-matrix product of ``x1`` (``(..., n)``) and ``x2``
    (``(..., n, m)``), broadcast over the leading dimensions: ``(..., m)``."""
    cnp = _cnp()
    a, b = _operand(x1, "vecmat", "x1"), _operand(x2, "vecmat", "x2")
    if len(a.shape) < 1 or len(b.shape) < 2 or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"vecmat: x1 of shape (..., n) and x2 of shape (..., n, m) expected, "
                         f"got {tuple(a.shape)} and {tuple(b.shape)}")
    return _vecdot(cnp.expand_dims(a, -1), b, -2)


def _lowp(fn, pos=(0, 1)):
    return _o()._with_dtype_policy(fn, pos)


vecdot = _lowp(vecdot)
matvec = _lowp(matvec)
vecmat = _lowp(vecmat)


# --- index arithmetic and layout ------------------------------------------------------------------

def unstack(x, /, *, axis=0):
    """``jnp.unstack``: the slices of ``x`` along ``axis``, a tuple (a 0-d ``x`` raises
    ``ValueError``). Differentiable; any dtype."""
    x = _operand(x, "unstack", "x")
    if len(x.shape) == 0:
        raise ValueError("Unstack requires arrays with rank > 0, however a scalar array was "
                         "passed.")
    ax = _axis(axis, len(x.shape), "unstack", x.shape)
    return tuple(_getitem(x, _along(ax, i)) for i in range(x.shape[ax]))


def _shape_arg(shape, who):
    try:
        dims = list(shape)
    except TypeError:
        dims = [shape]
    if builtins.any(np.ndim(s) != 0 for s in dims):
        raise ValueError(f"{who}: shape should be a scalar or 1D sequence.")
    return [_int(s, who, "shape") for s in dims]


def unravel_index(indices, shape):
    """``jnp.unravel_index``: the tuple of coordinate Arrays of the flat ``indices`` in an
    array of ``shape`` (row major). As jax, out-of-range indices are clipped: above the
    size to the last element, below ``-1`` to the first (``-1`` is the last element).
    Computed on the devices with ``floor_divide`` / ``remainder``; ``indices`` must be an
    integer array."""
    cnp = _cnp()
    idx = _operand(indices, "unravel_index", "indices")
    if not _is_int(idx.dtype):
        raise TypeError(f"unravel_index: indices must be integers, got dtype {idx.dtype}")
    dims = _shape_arg(shape, "unravel_index")
    out = [None] * len(dims)
    rest = idx
    for i in reversed(range(len(dims))):
        s = dims[i]
        out[i] = cnp.remainder(rest, s) if s else cnp.zeros_like(rest)
        rest = cnp.floor_divide(rest, s) if s else rest
    oob_pos = cnp.greater(rest, 0)
    oob_neg = cnp.less(rest, -1) if idx.dtype.kind == "i" else None
    res = []
    for s, i in zip(dims, out):
        v = i if oob_neg is None else cnp.where(oob_neg, 0, i)
        res.append(_as(cnp.where(oob_pos, s - 1, v), idx.dtype))
    return tuple(res)


def ravel_multi_index(multi_index, dims, mode="raise", order="C"):
    """``jnp.ravel_multi_index``: the flat index of each coordinate tuple of ``multi_index``
    in an array of shape ``dims`` (int32). ``mode``: 'raise' (an out-of-range coordinate
    raises ``ValueError``; the coordinates are read to the host), 'wrap', 'clip' or
    'ignore'; ``order`` 'C' or 'F'."""
    cnp = _cnp()
    who = "ravel_multi_index"
    multi_index = list(multi_index)
    dims = tuple(_int(d, who, "dims") for d in dims)
    if len(multi_index) != len(dims):
        raise ValueError(f"{who}: len(multi_index)={len(multi_index)} != len(dims)={len(dims)}")
    arrs = [_operand(i, who, "multi_index") for i in multi_index]
    for a in arrs:
        if not _is_int(a.dtype):
            raise TypeError("only int indices permitted")
    if math.prod(dims) - 1 > np.iinfo(np.int32).max:
        raise ValueError(f"jnp.ravel_multi_index: dtype=int32 not large enough to hold "
                         f"flattened index for dims={dims}")
    if mode == "raise":
        for a, d in zip(arrs, dims):
            h = _hv(a).astype(np.int64)
            if np.any((h < 0) | (h >= d)):
                raise ValueError("invalid entry in coordinates array")
    elif mode == "clip":
        arrs = [cnp.clip(a, 0, d - 1) for a, d in zip(arrs, dims)]
    elif mode == "wrap":
        arrs = [cnp.remainder(a, d) for a, d in zip(arrs, dims)]
    elif mode != "ignore":
        raise ValueError(f"invalid mode={mode!r}. Expected 'raise', 'wrap', 'clip', or "
                         f"'ignore'.")
    if order == "F":
        strides = np.cumprod((1,) + dims[:-1])
    elif order == "C":
        strides = np.cumprod((1,) + dims[1:][::-1])[::-1]
    else:
        raise ValueError(f"invalid order={order!r}. Expected 'C' or 'F'")
    result = None
    for a, s in zip(arrs, strides):
        t = cnp.multiply(_as(a, _dtypes.int32), int(s))
        result = t if result is None else cnp.add(result, t)
    return result if result is not None else _host_place(np.int32(0))


def diagflat(v, k=0):
    """``jnp.diagflat``: the square matrix with ``v`` flattened on its ``k``-th diagonal
    (:func:`diag` of ``ravel(v)``; differentiable)."""
    cnp = _cnp()
    return cnp.diag(cnp.ravel(_operand(v, "diagflat", "v")), _int(k, "diagflat", "k"))


def diag_indices(n, ndim=2):
    """``jnp.diag_indices``: ``ndim`` copies of ``arange(n)`` (int32), the indices of the
    main diagonal of an ``n`` x ... x ``n`` array."""
    n, ndim = _int(n, "diag_indices", "n"), _int(ndim, "diag_indices", "ndim")
    if n < 0:
        raise ValueError(f"n argument to diag_indices must be nonnegative, got {n}")
    if ndim < 0:
        raise ValueError(f"ndim argument to diag_indices must be nonnegative, got {ndim}")
    i = _idx(np.arange(n))
    return (i,) * ndim


def diag_indices_from(arr):
    """``jnp.diag_indices_from``: :func:`diag_indices` for an array of at least 2 equal
    dimensions."""
    s = tuple(np.shape(arr)) if not hasattr(arr, "shape") else tuple(arr.shape)
    if len(s) < 2:
        raise ValueError("input array must be at least 2-d")
    if len(set(s)) != 1:
        raise ValueError("All dimensions of input must be of equal length")
    return diag_indices(s[0], ndim=len(s))


def _scatter_set(arr, flat_pos, values):
    """``arr`` with the flat positions ``flat_pos`` (host, in range) set to ``values`` (an
    Array of as many elements, in order; converted to ``arr``'s dtype): a gather of
    ``values`` and a select, so every dtype works and the gradient goes to the value that
    lands (a later duplicate wins, as numpy)."""
    cnp = _cnp()
    n = math.prod(arr.shape)
    flat_pos = np.asarray(flat_pos, np.int64).reshape(-1)
    src = np.zeros(n, np.int64)
    mask = np.zeros(n, bool)
    src[flat_pos] = np.arange(flat_pos.size)
    mask[flat_pos] = True
    if n == 0 or flat_pos.size == 0:
        return arr
    vals = cnp.reshape(_take(cnp.ravel(_as(values, arr.dtype)), src, 0), tuple(arr.shape))
    return cnp.where(_host_place(mask.reshape(arr.shape), arr), vals, arr)


def fill_diagonal(a, val, wrap=False, *, inplace=True):
    """``jnp.fill_diagonal`` with ``inplace=False`` (jnp refuses the default, Arrays being
    immutable): ``a`` with its main diagonal set to ``val`` (a scalar, or its flattened
    values repeated along the diagonal). ``a`` must be 2-d, or of equal dimensions."""
    if inplace:
        raise NotImplementedError("JAX arrays are immutable, must use inplace=False")
    if wrap:
        raise NotImplementedError("wrap=True is not implemented, must use wrap=False")
    cnp = _cnp()
    a = _operand(a, "fill_diagonal")
    v = _operand(val, "fill_diagonal", "val")
    s = tuple(a.shape)
    if len(s) < 2:
        raise ValueError("array must be at least 2-d")
    if len(s) > 2 and not builtins.all(n == s[0] for n in s[1:]):
        raise ValueError("All dimensions of input must be of equal length")
    n = builtins.min(s)
    pos = np.ravel_multi_index((np.arange(n),) * len(s), s) if n else np.zeros(0, np.int64)
    v = cnp.ravel(v)
    if v.size == 0 and n:
        raise ValueError("fill_diagonal: val has no elements")
    if v.size and v.size != n:
        v = _take(v, np.arange(n) % v.size, 0)
    return _scatter_set(a, pos, v if v.size == n else cnp.broadcast_to(v, (n,)))


def put_along_axis(arr, indices, values, axis, inplace=True, *, mode=None):
    """``jnp.put_along_axis`` with ``inplace=False`` (jnp refuses the default): ``arr`` with
    the positions that :func:`take_along_axis` with ``indices`` reads set to ``values``
    (broadcast to ``indices``'s shape; negative indices count from the end; ``axis=None``:
    the flattened ``arr``). The indices are read to the host; the result is a gather and a
    select, any dtype, differentiable in ``arr`` and ``values``."""
    if inplace:
        raise ValueError("jax.numpy.put_along_axis cannot modify arrays in-place, because JAX "
                         "arrays are immutable. Pass inplace=False to instead return an updated "
                         "array.")
    cnp = _cnp()
    who = "put_along_axis"
    a = _operand(arr, who, "arr")
    shape0 = tuple(a.shape)
    if axis is None:
        a, axis = cnp.ravel(a), 0
    ih = _hv(indices)
    if ih.dtype.kind not in "iu":
        raise TypeError(f"{who}: indices must be integers, got dtype {ih.dtype}")
    if ih.ndim != len(a.shape):
        raise ValueError(f"put_along_axis arguments 'arr' and 'indices' must have same ndim. "
                         f"Got arr.ndim={len(a.shape)} and indices.ndim={ih.ndim}.")
    ax = _axis(axis, len(a.shape), who, a.shape)
    v = _operand(values, who, "values")
    try:
        v = cnp.broadcast_to(v, ih.shape) if tuple(v.shape) != ih.shape else v
    except ValueError:
        raise ValueError(f"put_along_axis argument 'values' must be broadcastable to "
                         f"'indices'. Got values.shape={tuple(v.shape)} and "
                         f"indices.shape={ih.shape}.") from None
    n = a.shape[ax]
    ih = ih.astype(np.int64)
    if mode not in (None, "promise_in_bounds", "clip", "drop", "fill"):
        raise ValueError(f"{who}: mode={mode!r}: expected None, 'promise_in_bounds', 'clip', "
                         f"'drop' or 'fill'")
    if mode == "clip":
        ih = np.clip(ih, 0, n - 1)
    else:
        ih = np.where(ih < 0, ih + n, ih)
    keep = (ih >= 0) & (ih < n)        # out of range: dropped (jax's scatter default)
    grids = list(np.indices(ih.shape, sparse=True))
    coords = [np.broadcast_to(g, ih.shape) for g in grids]
    for d in range(len(ih.shape)):
        if d != ax and ih.shape[d] > a.shape[d]:
            keep &= coords[d] < a.shape[d]
    coords[ax] = ih
    sel = np.flatnonzero(keep.reshape(-1))
    pos = np.ravel_multi_index(tuple(c.reshape(-1)[sel] for c in coords), tuple(a.shape)) \
        if sel.size else np.zeros(0, np.int64)
    out = _scatter_set(a, pos, _take(cnp.ravel(v), sel, 0))
    return cnp.reshape(out, shape0) if tuple(out.shape) != shape0 else out


def resize(a, new_shape):
    """``jnp.resize``: ``a`` flattened, repeated as often as needed and cut to
    ``new_shape``'s size (zeros when either is empty). Differentiable."""
    cnp = _cnp()
    shape = _dtypes.int_tuple(new_shape, "resize: new_shape", scalar=True)
    if builtins.any(d < 0 for d in shape):
        raise ValueError("all elements of `new_shape` must be non-negative")
    x = cnp.ravel(_operand(a, "resize"))
    n = math.prod(shape)
    if x.size == 0 or n == 0:
        return cnp.zeros(shape, x.dtype)
    return cnp.reshape(_take(x, np.arange(n) % x.size, 0), shape)


def trim_zeros(filt, trim="fb", axis=None):
    """``jnp.trim_zeros``: ``filt`` without its leading ('f') and / or trailing ('b') zeros
    along ``axis`` (None: every axis), read to the host to find them; a slice of ``filt``
    (differentiable)."""
    x = _operand(filt, "trim_zeros", "filt")
    nd = len(x.shape)
    if axis is None:
        axes = set(range(nd))
    else:
        axes = set(_axes(axis, nd, "trim_zeros", x.shape))
    t = trim.lower()
    if not axes or ("f" not in t and "b" not in t):
        return x
    h = _host(x) != 0
    idx = []
    for ax in range(nd):
        if ax not in axes:
            idx.append(slice(None))
            continue
        mask = h.any(axis=tuple(d for d in range(nd) if d != ax))
        if not mask.any():
            idx.append(slice(0, 0))
            continue
        start = int(mask.argmax()) if "f" in t else None
        stop = x.shape[ax] - int(mask[::-1].argmax()) if "b" in t else None
        idx.append(slice(start, stop))
    return _getitem(x, tuple(idx))


def delete(arr, obj, axis=None, *, assume_unique_indices=False):
    """``jnp.delete``: ``arr`` without the entries ``obj`` (an int, a slice, an int array or
    a bool mask of the axis' length) along ``axis`` (None: of the flattened ``arr``). The
    kept positions are planned on the host and gathered: differentiable, any dtype."""
    del assume_unique_indices
    cnp = _cnp()
    a = _operand(arr, "delete", "arr")
    if axis is None:
        a, axis = cnp.ravel(a), 0
    ax = _axis(axis, len(a.shape), "delete", a.shape)
    n = a.shape[ax]
    mask = np.ones(n, bool)
    if isinstance(obj, slice):
        mask[np.arange(n)[obj]] = False
    else:
        try:
            i = operator.index(obj)
        except TypeError:
            oh = _hv(obj)
            if oh.dtype.kind in "iu":
                if np.any((oh < -n) | (oh >= n)):
                    raise IndexError(f"delete: index out of bounds for axis {ax} of size {n}")
                mask[oh] = False
            elif oh.dtype == np.bool_:
                if oh.shape != (n,):
                    raise ValueError("np.delete(arr, obj): for boolean indices, obj must be "
                                     "one-dimensional with length matching specified axis.")
                mask = ~oh
            else:
                raise ValueError(f"np.delete(arr, obj): got obj.dtype={oh.dtype}; must be "
                                 f"integer or bool.")
        else:
            if not -n <= i < n:
                raise ValueError(f"delete: index {i} is out of bounds for axis {ax} with size "
                                 f"{n}")
            mask[i % n] = False
    return _take(a, np.flatnonzero(mask), ax)


def insert(arr, obj, values, axis=None):
    """``jnp.insert``: ``values`` inserted into ``arr`` before the positions ``obj`` (an int,
    a slice or a 1-d int array) along ``axis`` (None: into the flattened ``arr``), in
    ``arr``'s dtype. The output order is planned on the host as jax plans it (positions
    clipped to the axis; values at one position keep their order) and built as one gather
    from ``arr`` and ``values`` joined: differentiable in both."""
    cnp = _cnp()
    who = "insert"
    a = _operand(arr, who, "arr")
    if axis is None:
        a, axis = cnp.ravel(a), 0
    ax = _axis(axis, len(a.shape), who, a.shape)
    n_input = a.shape[ax]
    if isinstance(obj, slice):
        ih = np.arange(*obj.indices(n_input))
    else:
        ih = _hv(obj)
    if ih.ndim > 1:
        raise ValueError(f"jnp.insert(): obj must be a slice, a one-dimensional array, or a "
                         f"scalar; got {obj}")
    if ih.dtype.kind not in "iu":
        if ih.size == 0:
            ih = ih.astype(np.int64)
        else:
            raise ValueError(f"jnp.insert(): index array must be integer typed; got {obj}")
    v = _as(_operand(values, who, "values"), a.dtype)
    nd = len(a.shape)
    if len(v.shape) < nd:
        v = cnp.reshape(v, (1,) * (nd - len(v.shape)) + tuple(v.shape))
    if ih.size == 1:
        index = int(ih.reshape(-1)[0])
        if ih.ndim == 0:
            v = cnp.moveaxis(v, 0, ax)
        ih = np.full(v.shape[ax], index)
    n_insert = np.broadcast_shapes(ih.shape, (v.shape[ax],))[0]
    ih = np.broadcast_to(ih.astype(np.int64), (n_insert,))
    ih = np.clip(np.where(ih < 0, ih + n_input, ih), 0, n_input)
    target = list(a.shape)
    target[ax] = n_insert
    try:
        v = cnp.broadcast_to(v, tuple(target)) if tuple(v.shape) != tuple(target) else v
    except ValueError:
        raise ValueError(f"insert: values of shape {tuple(v.shape)} do not broadcast to "
                         f"{tuple(target)}") from None
    values_ind = ih.copy()
    values_ind[np.argsort(ih, kind="stable")] += np.arange(n_insert)
    arr_mask = np.ones(n_input + n_insert, bool)
    arr_mask[values_ind] = False
    perm = np.zeros(n_input + n_insert, np.int64)
    perm[np.flatnonzero(arr_mask)] = np.arange(n_input)
    perm[values_ind] = n_input + np.arange(n_insert)
    return _take(cnp.concatenate([a, v], ax), perm, ax)


def compress(condition, a, axis=None, *, size=None, fill_value=0, out=None):
    """``jnp.compress``: the slices of ``a`` along ``axis`` (None: of the flattened ``a``)
    where the 1-d ``condition`` is true (read to the host). ``size=`` gives a static length:
    the selected slices first, then ``fill_value``. Differentiable in ``a``."""
    if out is not None:
        raise NotImplementedError("The 'out' argument to jnp.compress is not supported.")
    cnp = _cnp()
    ch = _hv(condition)
    ch = (ch.astype(np.float32) != 0) if ch.dtype.kind not in "biu" else ch.astype(bool)
    if ch.ndim != 1:
        raise ValueError("condition must be a 1D array")
    x = _operand(a, "compress")
    if axis is None:
        x, ax = cnp.ravel(x), 0
    else:
        ax = _axis(axis, len(x.shape), "compress", x.shape)
    n = x.shape[ax]
    cond, extra = ch[:n], ch[n:]
    if size is None:
        if extra.any():
            raise ValueError("condition contains entries that are out of bounds")
        return _take(x, np.flatnonzero(cond), ax)
    size = _int(size, "compress", "size")
    if not 0 <= size <= n:
        raise ValueError(f"size must be positive and not greater than the size of the array "
                         f"axis; got size={size} for a.shape[axis]={n}")
    cond = np.concatenate([cond, np.zeros(n - cond.size, bool)])
    perm = np.argsort(~cond, kind="stable")[:size]
    got = _take(x, perm, ax)
    keep = cond[perm].reshape((1,) * ax + (size,) + (1,) * (len(x.shape) - ax - 1))
    fv = np.asarray(fill_value).astype(got.dtype)
    return cnp.where(_host_place(keep, got), got, fv) if not keep.all() else got


def extract(condition, arr, *, size=None, fill_value=0):
    """``jnp.extract``: :func:`compress` of the flattened ``arr`` by the flattened
    ``condition``."""
    ch = np.ravel(_hv(condition))
    return compress(ch, _cnp().ravel(_operand(arr, "extract", "arr")), size=size,
                    fill_value=fill_value)


def choose(a, choices, out=None, mode="raise"):
    """``jnp.choose``: where ``a`` (ints) is ``k``, the element of ``choices[k]`` (all
    broadcast together; jax's promoted dtype of the choices). ``mode``: 'raise' (an entry
    outside ``[0, len(choices))`` raises ``ValueError``; ``a`` is read to the host), 'wrap'
    or 'clip'. A chain of selects: differentiable in the choices."""
    if out is not None:
        raise NotImplementedError("The 'out' argument to jnp.choose is not supported.")
    cnp = _cnp()
    idx = _operand(a, "choose")
    if not _is_int(idx.dtype):
        raise ValueError("`a` array must be integer typed")
    ch = list(choices)
    N = len(ch)
    if N == 0:
        raise ValueError("choose: choices must not be empty")
    if mode == "raise":
        h = _hv(idx).astype(np.int64)
        if np.any((h < 0) | (h >= N)):
            raise ValueError("invalid entry in choice array")
    elif mode == "wrap":
        idx = cnp.remainder(idx, N)
    elif mode == "clip":
        idx = cnp.clip(idx, 0, N - 1)
    else:
        raise ValueError(f"mode={mode!r} not understood. Must be 'raise', 'wrap', or 'clip'")
    rdt = cnp.result_type(*ch, who="choose")
    ch = [_as(_operand(c, "choose", f"choices[{i}]"), rdt) for i, c in enumerate(ch)]
    arrs = cnp.broadcast_arrays(idx, *ch)
    idx, ch = arrs[0], arrs[1:]
    r = ch[-1]
    for k in range(N - 2, -1, -1):
        r = cnp.where(cnp.equal(idx, k), ch[k], r)
    return r


# --- sorting, sets, binning -----------------------------------------------------------------------

def lexsort(keys, axis=-1):
    """``jnp.lexsort``: the int32 indices that sort by the last key, then the one before, ...
    (stable; NaNs last), along ``axis``. Computed on the host."""
    xs = [_operand(k, "lexsort", "keys") for k in keys]
    if not xs:
        raise TypeError("need sequence of keys with len > 0 in lexsort")
    ks = [np.asarray(_host(k)) for k in xs]
    if len({k.shape for k in ks}) > 1:
        raise ValueError("all keys need to be the same shape")
    if ks[0].ndim == 0:
        return _host_place(np.int32(0), xs[0])
    ax = _axis(axis, ks[0].ndim, "lexsort", ks[0].shape)
    return _idx(np.lexsort(ks, axis=ax), xs[0])


def _stable_desc(h, axis):
    """Stable descending argsort along ``axis`` (ties: the lower index first, as top_k)."""
    r = np.flip(h, axis)
    n = h.shape[axis]
    return np.flip(n - 1 - np.argsort(r, axis=axis, kind="stable"), axis)


def _partition_plan(a, kth, axis, who):
    a = _operand(a, who)
    nd = len(a.shape)
    if nd == 0:
        raise ValueError(f"{who}: a must be at least 1-d")
    ax = _axis(axis, nd, who, a.shape)
    n = a.shape[ax]
    k = _axis(kth, n, who, None, "kth")
    h = _host(a)
    asc = np.argsort(h, axis=ax, kind="stable")
    bottom = np.take(asc, np.arange(k + 1), axis=ax)
    return a, ax, n, k, h, bottom


def partition(a, kth, axis=-1):
    """``jnp.partition`` (jax's arrangement, from ``top_k``): along ``axis``, the ``kth + 1``
    smallest elements in ascending order, then the ``n - kth - 1`` largest in descending
    order (numpy leaves both parts unordered; the element at ``kth`` agrees). The positions
    are planned on the host, the values gathered: differentiable."""
    a, ax, n, k, h, bottom = _partition_plan(a, kth, axis, "partition")
    top = np.take(_stable_desc(h, ax), np.arange(n - k - 1), axis=ax)
    return take_along_axis(a, np.concatenate([bottom, top], ax), axis=ax)


def argpartition(a, kth, axis=-1):
    """``jnp.argpartition`` (jax's arrangement): the int32 indices of the ``kth + 1``
    smallest elements in ascending order of value, then those of the others in increasing
    index order."""
    a, ax, n, k, h, bottom = _partition_plan(a, kth, axis, "argpartition")
    b = np.moveaxis(bottom, ax, -1)
    rows = b.reshape(-1, k + 1)
    rest = np.ones((rows.shape[0], n), bool)
    np.put_along_axis(rest, rows, False, axis=1)
    top = np.nonzero(rest)[1].reshape(rows.shape[0], n - k - 1)
    out = np.concatenate([rows, top], 1).reshape(b.shape[:-1] + (n,))
    return _idx(np.moveaxis(out, -1, ax), a)


def _neq(x, y, equal_nan):
    if x.dtype.kind == "f" and equal_nan:
        return (x != y) & ~(np.isnan(x) & np.isnan(y))
    return x != y


def _unique_plan(h, axis, equal_nan):
    """jax's ``_unique_sorted_mask`` on the host: the lexsort permutation along axis 0 of
    ``h`` (axis moved first) and the mask of the first of each run of equal slices."""
    aux = np.moveaxis(h, axis, 0)
    size = aux.shape[0]
    rest = math.prod(aux.shape[1:])
    if rest == 0:
        size, perm = 1, np.zeros(1, np.int64)
    else:
        perm = np.lexsort(aux.reshape(size, rest).T[::-1])
    if aux.size:
        s = aux[perm]
        mask = np.ones(size, bool)
        if size > 1:      # (one slice: nothing to compare, it is the first of its run)
            mask[1:] = _neq(s[1:], s[:-1], equal_nan).reshape(size - 1, rest).any(1)
    else:
        mask = np.zeros(size, bool)
    return perm, mask


def _nonzero_sized(mask, size):
    nz = np.flatnonzero(mask)
    if size is None:
        return nz
    out = np.zeros(size, np.int64)
    out[:builtins.min(size, nz.size)] = nz[:size]
    return out


def unique(ar, return_index=False, return_inverse=False, return_counts=False, axis=None, *,
           equal_nan=True, size=None, fill_value=None, sorted=True):  # noqa: A002
    """``jnp.unique``: the sorted unique elements of ``ar`` (flattened, or the unique slices
    along ``axis``), with jax's optional first indices, inverse (``ar``'s shape when
    ``axis`` is None) and counts (int32). ``equal_nan=True`` merges NaNs. ``size=`` gives a
    static length: padded with ``fill_value`` (default: the smallest unique value; the
    padded indices are the first index, the padded counts 0) or truncated.

    The order is planned on the host; the values are gathered from ``ar`` on the devices
    (differentiable, as jax's gather)."""
    del sorted
    cnp = _cnp()
    who = "unique"
    x = _operand(ar, who, "ar")
    shape0 = tuple(x.shape)
    if size is not None:
        size = _int(size, who, "size")
    if axis is None:
        x, ax = cnp.ravel(x), 0
    else:
        ax = _axis(axis, len(x.shape), who, x.shape)
    n = x.shape[ax]
    if n == 0 and size and fill_value is None:
        raise ValueError("jnp.unique: for zero-sized input with nonzero size argument, "
                         "fill_value must be specified")
    h = _host(x)
    perm, mask = _unique_plan(h, ax, equal_nan)
    ind = _nonzero_sized(mask, size)
    if x.size:
        result = _take(x, perm[ind], ax)
    else:
        result = x
    if size is not None and fill_value is not None:
        fv = np.asarray(fill_value).astype(result.dtype)
        if result.shape[ax]:
            valid = np.arange(size) < mask.sum()
            if not valid.all():
                vshape = (1,) * ax + (size,) + (1,) * (len(x.shape) - ax - 1)
                result = cnp.where(_host_place(valid.reshape(vshape), x), result, fv)
        else:
            rs = list(result.shape)
            rs[ax] = size
            result = cnp.full(tuple(rs), fv, result.dtype)
    ret = [result]
    if return_index:
        ret.append(_idx(perm[ind] if x.size else perm, x))
    if return_inverse:
        if x.size:
            inv = np.zeros(mask.shape, np.int64)
            inv[perm] = np.cumsum(mask) - 1
        else:
            inv = np.zeros(n, np.int64)
        ret.append(_idx(inv.reshape(shape0) if axis is None else inv, x))
    if return_counts:
        if x.size:
            if size is None:
                idx = np.append(np.flatnonzero(mask), mask.size)
            else:
                idx = _nonzero_sized(mask, size + 1)
                idx[1:] = np.where(idx[1:], idx[1:], mask.size)
            ret.append(_idx(np.diff(idx), x))
        elif n:
            ret.append(_idx(np.full(1, n), x))
        else:
            ret.append(_idx(np.zeros(0), x))
    return ret[0] if len(ret) == 1 else tuple(ret)


UniqueAllResult = collections.namedtuple("UniqueAllResult",
                                         ["values", "indices", "inverse_indices", "counts"])
UniqueCountsResult = collections.namedtuple("UniqueCountsResult", ["values", "counts"])
UniqueInverseResult = collections.namedtuple("UniqueInverseResult",
                                             ["values", "inverse_indices"])


def unique_values(x, /, *, size=None, fill_value=None):
    """``jnp.unique_values``: :func:`unique` with NaNs kept apart (the array API's)."""
    return unique(x, equal_nan=False, size=size, fill_value=fill_value)


def unique_counts(x, /, *, size=None, fill_value=None):
    """``jnp.unique_counts``: ``(values, counts)`` of :func:`unique`, NaNs kept apart."""
    return UniqueCountsResult(*unique(x, return_counts=True, equal_nan=False, size=size,
                                      fill_value=fill_value))


def unique_inverse(x, /, *, size=None, fill_value=None):
    """``jnp.unique_inverse``: ``(values, inverse_indices)`` of :func:`unique`, NaNs kept
    apart (the inverse has ``x``'s shape)."""
    return UniqueInverseResult(*unique(x, return_inverse=True, equal_nan=False, size=size,
                                       fill_value=fill_value))


def unique_all(x, /, *, size=None, fill_value=None):
    """``jnp.unique_all``: ``(values, indices, inverse_indices, counts)`` of :func:`unique`,
    NaNs kept apart."""
    return UniqueAllResult(*unique(x, return_index=True, return_inverse=True,
                                   return_counts=True, equal_nan=False, size=size,
                                   fill_value=fill_value))


def _sized(vals, size, fill, dt, who, like=None):
    """A host result of the set operations cut or padded to ``size`` with ``fill`` (None:
    the first value, as jax's unique padding; 0 for an empty result), placed as
    :func:`_host_place` places it by ``like``."""
    vals = np.asarray(vals)
    if size is None:
        return _host_place(vals.astype(dt), like)
    size = _int(size, who, "size")
    if fill is None:
        fill = vals[0] if vals.size else 0
    out = np.full(size, np.asarray(fill).astype(dt), dt)
    k = builtins.min(size, vals.size)
    out[:k] = vals[:k].astype(dt)
    return _host_place(out, like)


def _set_operands(ar1, ar2, who, promote=True):
    cnp = _cnp()
    a = cnp.ravel(_operand(ar1, who, "ar1"))
    b = cnp.ravel(_operand(ar2, who, "ar2"))
    dt = cnp.result_type(a, b, who=who) if promote else a.dtype
    return a, b, np.dtype(dt)


def _uniq_host(h):
    perm, mask = _unique_plan(h, 0, True)
    return h[perm][mask] if h.size else h


def setdiff1d(ar1, ar2, assume_unique=False, *, size=None, fill_value=None):
    """``jnp.setdiff1d``: the sorted unique values of ``ar1`` not in ``ar2`` (``ar1``'s
    dtype; with ``assume_unique``, ``ar1``'s order). ``size=`` pads with ``fill_value``
    (default 0) or truncates. Computed on the host (no gradient)."""
    a, b, dt = _set_operands(ar1, ar2, "setdiff1d", promote=False)
    ha, hb = _host(a), _host(b)
    u = ha if assume_unique else _uniq_host(ha)
    vals = u[~np.isin(u, hb)]
    return _sized(vals, size, 0 if fill_value is None else fill_value, dt, "setdiff1d", a)


def union1d(ar1, ar2, *, size=None, fill_value=None):
    """``jnp.union1d``: :func:`unique` of both operands joined (jax's promoted dtype;
    ``size=`` / ``fill_value=`` as there)."""
    a, b, dt = _set_operands(ar1, ar2, "union1d")
    cnp = _cnp()
    return unique(cnp.concatenate([_as(a, dt), _as(b, dt)], 0), size=size,
                  fill_value=fill_value)


def intersect1d(ar1, ar2, assume_unique=False, return_indices=False, *, size=None,
                fill_value=None):
    """``jnp.intersect1d``: the sorted values in both operands (jax's promoted dtype); with
    ``return_indices``, also the int32 positions of their first occurrences in ``ar1`` and
    ``ar2``. ``size=`` pads (with ``fill_value``, default the smallest value; the padded
    indices are each operand's length, as jax's) or truncates. Computed on the host (no gradient)."""
    who = "intersect1d"
    a, b, dt = _set_operands(ar1, ar2, who)
    ha, hb = _host(a).astype(dt if dt != _dtypes.bfloat16 else np.float32), _host(b)
    hb = hb.astype(ha.dtype)
    if assume_unique:
        ua, ia = ha, np.arange(ha.size)
        ub, ib = hb, np.arange(hb.size)
    else:
        ua, ia = np.unique(ha, return_index=True)
        ub, ib = np.unique(hb, return_index=True)
    vals, i1, i2 = np.intersect1d(ua, ub, assume_unique=True, return_indices=True)
    out = _sized(vals, size, fill_value, dt, who, a)
    if not return_indices:
        return out
    j1, j2 = ia[i1], ib[i2]
    if size is not None:
        return out, _sized(j1, size, ha.size, np.int32, who, a), \
            _sized(j2, size, hb.size, np.int32, who, a)
    return out, _idx(j1, a), _idx(j2, a)


def setxor1d(ar1, ar2, assume_unique=False, *, size=None, fill_value=None):
    """``jnp.setxor1d``: the sorted values in exactly one of the operands (jax's promoted
    dtype; ``size=`` pads with ``fill_value``, default the smallest value). Computed on
    the host (no gradient)."""
    who = "setxor1d"
    a, b, dt = _set_operands(ar1, ar2, who)
    ha, hb = _host(a), _host(b)
    if not assume_unique:
        ha, hb = _uniq_host(ha), _uniq_host(hb)
    aux = np.sort(np.concatenate([ha.astype(np.float64) if ha.dtype.kind == "f" else ha,
                                  hb.astype(np.float64) if hb.dtype.kind == "f" else hb]))
    if aux.size == 0:
        vals = aux
    else:
        flag = np.concatenate([[True], aux[1:] != aux[:-1], [True]])
        vals = aux[flag[1:] & flag[:-1]]
    return _sized(vals, size, fill_value, dt, who, a)


def digitize(x, bins, right=False, *, method=None):
    """``jnp.digitize``: the int32 index of the bin of ``bins`` (1-d, increasing or
    decreasing) each element of ``x`` falls in (``right``: bins closed on the right).
    :func:`searchsorted` on the host; the result has ``x``'s shape."""
    cnp = _cnp()
    bh = _host(_operand(bins, "digitize", "bins"))
    if bh.ndim != 1:
        raise ValueError(f"digitize: bins must be a 1-dimensional array; got bins={bins!r}")
    xv = _operand(x, "digitize", "x")
    if bh.shape[0] == 0:
        return cnp.zeros_like(xv, dtype=np.int32)
    side = "left" if right else "right"
    kw = {} if method is None else {"method": method}
    if bh[-1] >= bh[0]:
        return cnp.searchsorted(bh, xv, side=side, **kw)
    return cnp.subtract(np.int32(bh.shape[0]), cnp.searchsorted(bh[::-1].copy(), xv, side=side,
                                                                **kw))


def _scatter_add(length, pos, weights, wdt, like=None):
    """``zeros(length, wdt).at[pos].add(weights)`` with out-of-range positions dropped:
    float weights through the differentiable scatter-add, ints and bools on the host (a
    host result placed by ``like`` as :func:`_host_place` places it)."""
    cnp = _cnp()
    pos = np.asarray(pos, np.int64).reshape(-1)
    keep = np.flatnonzero((pos >= 0) & (pos < length))
    if weights is None:
        return _host_place(np.bincount(pos[keep], minlength=length)[:length].astype(wdt),
                           like)
    w = cnp.ravel(weights)
    if np.dtype(wdt) in _o()._FLOATS:
        zeros = cnp.zeros((length,), wdt, device=_replicated(like))
        if keep.size == 0:
            return zeros
        return zeros.at[pos[keep]].add(_take(w, keep, 0))
    hw = _hv(w).reshape(-1)[keep]
    if np.dtype(wdt) == np.bool_:
        out = np.zeros(length, bool)
        out[pos[keep][hw]] = True
        return _host_place(out, like)
    out = np.zeros(length, np.int64)
    np.add.at(out, pos[keep], hw.astype(np.int64))
    return _host_place(out.astype(wdt), like)


def bincount(x, weights=None, minlength=0, *, length=None):
    """``jnp.bincount``: the number of occurrences of each value of the 1-d non-negative
    ints ``x`` (int32), or the sum of ``weights`` (same shape, their dtype; float weights
    keep their gradient) per value. ``length=`` (jax's static size) gives the output length,
    values at or above it dropped; else ``max(minlength, max(x) + 1)``. Negative values count
    as 0, as jax clips them. ``x`` is read to the host."""
    who = "bincount"
    xv = _operand(x, who, "x")
    h = _hv(xv)
    if h.dtype == np.bool_:
        h = h.astype(np.int32)
    if h.dtype.kind not in "iu":
        raise TypeError(f"x argument to bincount must have an integer type; got {xv.dtype}")
    if h.ndim != 1:
        raise ValueError("only 1-dimensional input supported.")
    minlength = _int(minlength, who, "minlength")
    if length is None:
        length = builtins.max(minlength, h.size and int(builtins.max(0, h.max())) + 1)
    else:
        length = _int(length, who, "length")
    pos = np.clip(h.astype(np.int64), 0, None)
    if weights is None:
        return _scatter_add(length, pos, None, np.int32, xv)
    w = _operand(weights, who, "weights")
    if tuple(w.shape) != h.shape:
        raise ValueError(f"type of weights must match type of x. Got x of shape {h.shape} and "
                         f"weights of shape {tuple(w.shape)}")
    return _scatter_add(length, pos, w, w.dtype, xv)


def histogram_bin_edges(a, bins=10, range=None, weights=None):  # noqa: A002
    """``jnp.histogram_bin_edges``: ``bins`` (a 1-d array) as it is, or ``bins + 1`` evenly
    spaced edges over ``range`` (default: ``a``'s minimum and maximum, read to the host;
    widened by 0.5 either side when empty), in ``a``'s inexact dtype."""
    del weights
    cnp = _cnp()
    if isinstance(bins, str):
        raise NotImplementedError("string values for `bins` not implemented.")
    x = _operand(a, "histogram_bin_edges")
    dt = _inexact(x).dtype if x.dtype not in _o()._FLOATS else x.dtype
    if np.ndim(bins) == 1:
        return cnp.asarray(_hv(bins), dtype=dt, device=_replicated(x))
    nb = _int(bins, "histogram_bin_edges", "bins")
    if range is None:
        h = _host(x)
        if h.size == 0:
            raise ValueError("histogram_bin_edges: range= is needed for an empty array")
        rng = np.array([h.min(), h.max()], np.float32)
    else:
        rng = np.asarray([np.asarray(r, np.float64) for r in range], np.float64)
        if rng.shape != (2,):
            raise ValueError(f"`range` must be either None or a sequence of scalars, got "
                             f"{range}")
        rng = rng.astype(np.float32)
    rng = rng.astype(np.dtype(dt) if dt != _dtypes.bfloat16 else _dtypes.bfloat16)
    lo, hi = float(rng[0]), float(rng[1])
    if hi - lo == 0:
        lo, hi = lo - 0.5, hi + 0.5
    return cnp.linspace(lo, hi, nb + 1, dtype=dt, device=_replicated(x))


def histogram(a, bins=10, range=None, weights=None, density=None):  # noqa: A002
    """``jnp.histogram``: ``(counts, bin_edges)``: the count (or the sum of ``weights``) of
    the elements of ``a`` in each bin (the last bin closed on the right; elements outside
    the edges and NaNs not counted), float in ``a``'s inexact dtype, as jax's; ``density``
    normalises to unit area. The bins are found on the host; float weights keep their
    gradient."""
    cnp = _cnp()
    if isinstance(bins, str):   # jnp: TypeError from its array-like check of bins
        raise TypeError(f"histogram: bins must be an int or a 1-d array; string values for "
                        f"`bins` ({bins!r}) are not implemented")
    x = _inexact(_operand(a, "histogram"))
    if weights is None:
        w = None
        wdt = x.dtype
    else:
        w = _inexact(_operand(weights, "histogram", "weights"))
        if tuple(w.shape) != tuple(x.shape):
            raise ValueError("weights should have the same shape as a.")
        wdt = cnp.result_type(x, w, who="histogram")
        w = _as(w, wdt)
    edges = histogram_bin_edges(x, bins, range)
    eh = _host(edges)
    xh = _host(x).reshape(-1)
    idx = np.searchsorted(eh, xh, side="right")
    idx = np.where(xh == eh[-1], eh.size - 1, idx)
    if w is None:
        w = cnp.ones_like(x, dtype=wdt) if x.size else None
    if w is None:
        counts = cnp.zeros((eh.size - 1,), wdt)
    else:
        counts = _scatter_add(eh.size, idx, w, wdt, x)
        counts = _getitem(counts, slice(1, None))
    if density:
        widths = cnp.diff(edges)
        counts = cnp.divide(cnp.divide(counts, widths), cnp.sum(counts))
    return counts, edges


# --- numerics ---------------------------------------------------------------------------------------

def interp(x, xp, fp, left=None, right=None, period=None):
    """``jnp.interp``: the piecewise-linear interpolant through ``(xp, fp)`` (1-d, ``xp``
    increasing) at ``x``, jax's formula: ``fp[i-1] + (x - xp[i-1]) / dx * df`` with ``i``
    the right insertion point clipped to ``[1, len - 1]``; ``left`` / ``right`` (default
    ``fp[0]`` / ``fp[-1]``, or 'extrapolate') outside; ``period`` wraps. The insertion
    points are found on the host; the result is differentiable in ``x``, ``xp`` and ``fp``."""
    cnp = _cnp()
    who = "interp"
    xa = _operand(x, who, "x")
    xpa = _operand(xp, who, "xp")
    fpa = _operand(fp, who, "fp")
    if tuple(xpa.shape) != tuple(fpa.shape) or len(xpa.shape) != 1:
        raise ValueError("xp and fp must be one-dimensional arrays of equal size")
    dt = cnp.result_type(xa, xpa, who=who)
    dt = dt if dt in _o()._FLOATS else _dtypes.float32
    xa, xpa = _as(xa, dt), _as(xpa, dt)
    fpa = _inexact(fpa)
    ext = {}
    for name, v in (("left", left), ("right", right)):
        if isinstance(v, str):
            if v != "extrapolate":
                raise ValueError(f"the only valid string value of `{name}` is 'extrapolate', "
                                 f"but got: {v!r}")
            ext[name] = True
        else:
            ext[name] = False
    if period is not None:
        if np.ndim(period) != 0:
            raise ValueError(f"period must be a scalar; got {period}")
        p = builtins.abs(float(np.asarray(period)))
        xa = cnp.remainder(xa, p)
        xpa = cnp.remainder(xpa, p)
        order = np.argsort(_host(xpa), kind="stable")
        xpa, fpa = _take(xpa, order, 0), _take(fpa, order, 0)
        xpa = cnp.concatenate([cnp.subtract(_getitem(xpa, slice(-1, None)), p), xpa,
                               cnp.add(_getitem(xpa, slice(None, 1)), p)], 0)
        fpa = cnp.concatenate([_getitem(fpa, slice(-1, None)), fpa,
                               _getitem(fpa, slice(None, 1))], 0)
    n = xpa.shape[0]
    if n == 0:
        raise ValueError("interp: xp and fp must not be empty")
    i = np.clip(np.searchsorted(_host(xpa), _host(xa), side="right"), 1, builtins.max(n - 1, 1))
    if n == 1:
        i = np.zeros_like(i)
        im1 = i
    else:
        im1 = i - 1

    def at(v, j):
        return cnp.reshape(_take(v, j.reshape(-1), 0), tuple(xa.shape))
    f_lo, f_hi = at(fpa, im1), at(fpa, i)
    x_lo, x_hi = at(xpa, im1), at(xpa, i)
    df = cnp.subtract(f_hi, f_lo)
    dx = cnp.subtract(x_hi, x_lo)
    delta = cnp.subtract(xa, x_lo)
    eps = float(np.spacing(np.finfo(np.float32 if dt == _dtypes.bfloat16 else dt).eps)) \
        if dt != _dtypes.bfloat16 else float(np.spacing(np.float32(2 ** -7)))
    dx0 = cnp.less_equal(cnp.abs(dx), eps)
    f = cnp.where(dx0, f_lo, cnp.add(f_lo, cnp.multiply(cnp.divide(delta, cnp.where(dx0, 1, dx)),
                                                         df)))
    if period is None:
        if not ext["left"]:
            lv = _getitem(fpa, 0) if left is None else left
            f = cnp.where(cnp.less(xa, _getitem(xpa, 0)), lv, f)
        if not ext["right"]:
            rv = _getitem(fpa, -1) if right is None else right
            f = cnp.where(cnp.greater(xa, _getitem(xpa, -1)), rv, f)
    return f


def ediff1d(ary, to_end=None, to_begin=None):
    """``jnp.ediff1d``: the differences of consecutive elements of the flattened ``ary``,
    with ``to_begin`` / ``to_end`` (flattened, in ``ary``'s dtype) around them."""
    cnp = _cnp()
    a = cnp.ravel(_operand(ary, "ediff1d", "ary"))
    r = cnp.subtract(_getitem(a, slice(1, None)), _getitem(a, slice(None, -1)))
    parts = [r]
    if to_begin is not None:
        parts.insert(0, cnp.ravel(_as(_operand(to_begin, "ediff1d", "to_begin"), a.dtype)))
    if to_end is not None:
        parts.append(cnp.ravel(_as(_operand(to_end, "ediff1d", "to_end"), a.dtype)))
    return parts[0] if len(parts) == 1 else cnp.concatenate(parts, 0)


def trapezoid(y, x=None, dx=1.0, axis=-1):
    """``jnp.trapezoid``: the integral of ``y`` along ``axis`` by the trapezoidal rule, with
    sample points ``x`` (1-d, or ``y``'s shape) or spacing ``dx``; ints give float32."""
    cnp = _cnp()
    ya = _inexact(_operand(y, "trapezoid", "y"))
    nd = len(ya.shape)
    ax = _axis(axis, nd, "trapezoid", ya.shape)
    if x is None:
        # a Python number is weakly typed (a 16-bit y keeps its dtype, as jax)
        d = float(dx) if isinstance(dx, (int, float)) else _operand(dx, "trapezoid", "dx")
        if np.ndim(d) > 0:
            d = cnp.reshape(d, (1,) * (nd - len(d.shape)) + tuple(d.shape))
            d = cnp.moveaxis(d, ax, -1)
    else:
        xa = _operand(x, "trapezoid", "x")
        rdt = cnp.result_type(ya, xa, who="trapezoid")
        rdt = rdt if rdt in _o()._FLOATS else _dtypes.float32
        ya, xa = _as(ya, rdt), _as(xa, rdt)
        d = cnp.diff(xa) if len(xa.shape) == 1 else cnp.moveaxis(cnp.diff(xa, axis=ax), ax, -1)
    ya = cnp.moveaxis(ya, ax, -1)
    if np.ndim(d) == 0 or d.shape[-1] == 1:
        dr = d if np.ndim(d) == 0 else _getitem(d, (Ellipsis, 0))
        ends = cnp.add(_getitem(ya, (Ellipsis, 0)), _getitem(ya, (Ellipsis, -1)))
        return cnp.multiply(dr, cnp.subtract(cnp.sum(ya, axis=-1), cnp.multiply(0.5, ends)))
    mids = cnp.add(_getitem(ya, (Ellipsis, slice(1, None))),
                   _getitem(ya, (Ellipsis, slice(None, -1))))
    return cnp.multiply(0.5, cnp.sum(cnp.multiply(d, mids), axis=-1))


def gradient(f, *varargs, axis=None, edge_order=None):
    """``jnp.gradient``: the derivative of ``f`` along each axis (or ``axis``) by central
    differences inside and one-sided differences at the ends (edge order 1), with spacing
    a scalar or a 1-d coordinate array per axis. A list of Arrays, one Array for one axis;
    differentiable. ``edge_order`` raises ``NotImplementedError``, as jnp."""
    if edge_order is not None:
        raise NotImplementedError("The 'edge_order' argument to jnp.gradient is not supported.")
    cnp = _cnp()
    a = _operand(f, "gradient", "f")
    spacing = [_operand(v, "gradient", "varargs") for v in varargs]
    rdt = cnp.result_type(a, *spacing, who="gradient") if spacing else a.dtype
    rdt = rdt if rdt in _o()._FLOATS else _dtypes.float32
    a = _as(a, rdt)
    spacing = [_as(v, rdt) for v in spacing]
    nd = len(a.shape)

    def sl(v, ax, lo, hi):
        return _getitem(v, (slice(None),) * ax + (slice(lo, hi),))

    def along(ax, h):
        upper = cnp.subtract(sl(a, ax, 1, 2), sl(a, ax, 0, 1))
        lower = cnp.subtract(sl(a, ax, -1, None), sl(a, ax, -2, -1))
        if np.ndim(h) == 0:
            inner = cnp.divide(cnp.multiply(cnp.subtract(sl(a, ax, 2, None),
                                                         sl(a, ax, None, -2)), 0.5), h)
            lower, upper = cnp.divide(lower, h), cnp.divide(upper, h)
        elif np.ndim(h) == 1:
            if h.shape[0] != a.shape[ax]:
                raise ValueError("Spacing arrays must have the same length as the dimension "
                                 "along which the gradient is calculated.")
            hs = [1] * nd
            hs[ax] = h.shape[0]
            h = cnp.reshape(h, tuple(hs))
            upper = cnp.divide(upper, cnp.subtract(sl(h, ax, 1, 2), sl(h, ax, 0, 1)))
            lower = cnp.divide(lower, cnp.subtract(sl(h, ax, -1, None), sl(h, ax, -2, -1)))
            dx1 = cnp.subtract(sl(h, ax, 1, -1), sl(h, ax, 0, -2))
            dx2 = cnp.subtract(sl(h, ax, 2, None), sl(h, ax, 1, -1))
            ca = cnp.divide(cnp.negative(dx2), cnp.multiply(dx1, cnp.add(dx1, dx2)))
            cb = cnp.divide(cnp.subtract(dx2, dx1), cnp.multiply(dx1, dx2))
            cc = cnp.divide(dx1, cnp.multiply(dx2, cnp.add(dx1, dx2)))
            inner = cnp.add(cnp.add(cnp.multiply(ca, sl(a, ax, 0, -2)),
                                    cnp.multiply(cb, sl(a, ax, 1, -1))),
                            cnp.multiply(cc, sl(a, ax, 2, None)))
        else:
            raise ValueError("Spacing arrays must be 1D arrays or scalars.")
        return cnp.concatenate([upper, inner, lower], ax)

    if axis is None:
        axes = tuple(range(nd))
    else:
        axes = _axes(axis, nd, "gradient", a.shape)
    if not axes:
        return []
    if builtins.min(a.shape[d] for d in axes) < 2:
        raise ValueError("Shape of array too small to calculate a numerical gradient, at least "
                         "2 elements are required.")
    if len(spacing) == 0:
        dx = [1.0] * len(axes)
    elif len(spacing) == 1:
        dx = spacing * len(axes)
    elif len(spacing) == len(axes):
        dx = spacing
    else:
        raise TypeError(f"Invalid number of spacing arguments {len(spacing)} for axis={axis!r}")
    out = [along(ax, h) for ax, h in zip(axes, dx)]
    return out[0] if len(axes) == 1 else out


def _conv(a, v, mode, op, precision):
    cnp = _cnp()
    x, y = _operand(a, op, "a"), _operand(v, op, "v")
    if len(x.shape) != 1 or len(y.shape) != 1:
        raise ValueError(f"{op}() only support 1-dimensional inputs.")
    dt = cnp.result_type(x, y, who=op)
    dt = dt if dt in _o()._FLOATS else _dtypes.float32
    x, y = _as(x, dt), _as(y, dt)
    if x.shape[0] == 0 or y.shape[0] == 0:
        raise ValueError(f"{op}: inputs cannot be empty, got shapes {tuple(x.shape)} and "
                         f"{tuple(y.shape)}.")
    reverse = False
    if x.shape[0] < y.shape[0]:
        x, y = y, x
        reverse = op == "correlate"
    if op == "convolve":
        y = cnp.flip(y, 0)
    n, m = x.shape[0], y.shape[0]
    if mode == "valid":
        lo, hi = 0, 0
    elif mode == "same":
        lo, hi = m // 2, m - m // 2 - 1
    elif mode == "full":
        lo, hi = m - 1, m - 1
    else:
        raise ValueError("mode must be one of ['full', 'same', 'valid']")
    L = n + lo + hi - m + 1
    # out[i] = sum_j xpad[i + j] * y[j]: a gather of the windows, then one matrix product
    xpad = cnp.pad(x, [(lo, hi)]) if lo or hi else x
    win = np.arange(L)[:, None] + np.arange(m)[None, :]
    w = cnp.reshape(_take(xpad, win.reshape(-1), 0), (L, m))
    out = cnp.matmul(w, y, precision=precision)
    return cnp.flip(out, 0) if reverse else out


def convolve(a, v, mode="full", *, precision=None, preferred_element_type=None):
    """``jnp.convolve``: the discrete linear convolution of the 1-d ``a`` and ``v``
    (``mode``: 'full', 'same' or 'valid'; the longer operand slides, as jax); ints give
    float32. Built as a gather of ``a``'s windows and a matrix product: differentiable in
    both operands."""
    del preferred_element_type
    return _conv(a, v, mode, "convolve", precision)


def correlate(a, v, mode="valid", *, precision=None, preferred_element_type=None):
    """``jnp.correlate``: the cross-correlation of the 1-d ``a`` and ``v`` (``mode`` as
    :func:`convolve`, default 'valid'; real operands: no conjugation)."""
    del preferred_element_type
    return _conv(a, v, mode, "correlate", precision)


convolve = _lowp(convolve)
correlate = _lowp(correlate)


def _cov_weights(v, name, n):
    """``cov``'s ``fweights`` / ``aweights``: one weight per sample (numpy's checks)."""
    w = _operand(v, "cov", name)
    if len(w.shape) > 1:
        raise RuntimeError(f"cannot handle multidimensional {name}")
    if w.shape[0] != n:
        raise RuntimeError(f"incompatible numbers of samples and {name}")
    return w


def cov(m, y=None, rowvar=True, bias=False, ddof=None, fweights=None, aweights=None,
        dtype=None):
    """``jnp.cov``: the covariance matrix of the variables in the rows of ``m`` (columns with
    ``rowvar=False``; ``y`` adds variables), normalised by ``N - 1`` (``bias``: ``N``;
    ``ddof`` overrides), with integer frequency weights ``fweights`` and observation weights
    ``aweights``. A scalar for one variable; ints give float32. Differentiable."""
    cnp = _cnp()
    x = _inexact(_operand(m, "cov", "m"))
    if len(x.shape) > 2:
        raise ValueError("m has more than 2 dimensions")
    if y is not None:
        ya = _inexact(_operand(y, "cov", "y"))
        if len(ya.shape) > 2:
            raise ValueError("y has more than 2 dimensions")
        rdt = cnp.result_type(x, ya, who="cov")
        x, ya = _as(x, rdt), _as(ya, rdt)
    if dtype is not None and np.dtype(dtype).kind not in "fc" and \
            np.dtype(dtype) != _dtypes.bfloat16:
        raise ValueError(f"cov: dtype must be a subclass of float or complex; got dtype={dtype!r}")
    X = cnp.atleast_2d(x)
    if not rowvar and len(x.shape) != 1:
        X = cnp.transpose(X)
    if X.shape[0] == 0:
        return cnp.zeros((0, 0), X.dtype)
    if y is not None:
        Y = cnp.atleast_2d(ya)
        if not rowvar and Y.shape[0] != 1:
            Y = cnp.transpose(Y)
        X = cnp.concatenate([X, Y], 0)
    if X.shape[1] == 0:
        shp = () if X.shape[0] == 1 else (X.shape[0], X.shape[0])
        return cnp.full(shp, np.nan, X.dtype)
    if ddof is None:
        ddof = 1 if not bias else 0
    w = aw = None
    if fweights is not None:
        fw = _cov_weights(fweights, "fweights", X.shape[1])
        if not _is_int(fw.dtype):
            raise TypeError("fweights must be integer.")
        w = cnp.abs(fw)
    if aweights is not None:
        aw = cnp.abs(_cov_weights(aweights, "aweights", X.shape[1]))
        w = aw if w is None else cnp.multiply(w, aw)
    if dtype is not None:
        X = cnp.astype(X, dtype)
    if w is not None:
        w = _as(w, X.dtype) if w.dtype in _o()._FLOATS or dtype is not None else \
            cnp.astype(w, _dtypes.float32)
    avg, w_sum = cnp.average(X, axis=1, weights=w, returned=True)
    w_sum = _getitem(w_sum, 0)
    if w is None:
        f = float(X.shape[1] - ddof)
    elif ddof == 0:
        f = w_sum
    elif aw is None:
        f = cnp.subtract(w_sum, float(ddof))
    else:
        f = cnp.subtract(w_sum, cnp.divide(cnp.multiply(float(ddof),
                                                        cnp.sum(cnp.multiply(w, aw))), w_sum))
    Xc = cnp.subtract(X, cnp.expand_dims(avg, 1))
    XT = cnp.transpose(Xc if w is None else cnp.multiply(Xc, cnp.expand_dims(w, 0)))
    c = cnp.divide(cnp.matmul(Xc, XT), f)
    return cnp.squeeze(c)


def corrcoef(x, y=None, rowvar=True, dtype=None):
    """``jnp.corrcoef``: the correlation coefficients, :func:`cov` over the outer product of
    the standard deviations, clipped to ``[-1, 1]`` (a scalar ``c / c`` for one
    variable)."""
    cnp = _cnp()
    if dtype is not None and np.dtype(dtype).kind not in "fc" and \
            np.dtype(dtype) != _dtypes.bfloat16:
        raise ValueError(f"corrcoef: dtype must be a subclass of float or complex; got "
                         f"dtype={dtype!r}")
    c = cov(x, y, rowvar, dtype=dtype)
    if len(c.shape) == 0:
        return cnp.divide(c, c)
    d = cnp.sqrt(cnp.diagonal(c))
    c = cnp.divide(cnp.divide(c, cnp.expand_dims(d, 1)), cnp.expand_dims(d, 0))
    return cnp.clip(c, -1, 1)


def polyval(p, x, *, unroll=16):
    """``jnp.polyval``: the polynomial with coefficients ``p`` (highest power first, along
    ``p``'s first axis) at ``x``, by Horner's rule in jax's promoted dtype (ints stay ints);
    differentiable in ``p`` and ``x``."""
    del unroll
    cnp = _cnp()
    pa, xa = _operand(p, "polyval", "p"), _operand(x, "polyval", "x")
    rdt = cnp.result_type(pa, xa, who="polyval")
    pa, xa = _as(pa, rdt), _as(xa, rdt)
    if len(pa.shape) == 0:
        raise ValueError("polyval: p must be at least 1-d")
    shape = np.broadcast_shapes(tuple(pa.shape[1:]), tuple(xa.shape))
    y = cnp.zeros(shape, rdt)
    for k in range(pa.shape[0]):
        y = cnp.add(cnp.multiply(y, xa), _getitem(pa, k))
    return y


def vander(x, N=None, increasing=False):
    """``jnp.vander``: the Vandermonde matrix of the 1-d ``x``: columns ``x ** (N - 1)``, ...,
    ``x ** 0`` (``increasing``: the other way), in ``x``'s dtype. Built from repeated
    products (the powers of ints stay exact): differentiable."""
    cnp = _cnp()
    xa = _operand(x, "vander", "x")
    if len(xa.shape) != 1:
        raise ValueError("x must be a one-dimensional array")
    N = xa.shape[0] if N is None else _int(N, "vander", "N")
    if N < 0:
        raise ValueError("N must be nonnegative")
    if N == 0:
        return cnp.zeros((xa.shape[0], 0), xa.dtype)
    cols = [cnp.ones_like(xa)]
    for _ in range(N - 1):
        cols.append(cnp.multiply(cols[-1], xa))
    if not increasing:
        cols = cols[::-1]
    return cnp.stack(cols, 1)
