"""The implementation of :mod:`ctrainstate.numpy` (which re-exports its API; the module
docstring is there)."""
from ..base.hooks import provide as _provide
_provide('numpy', __name__)   # lower layers call into this module through _hooks.upper
import math as _math
import operator
import numpy as _np

from ..ops.ops import (abs, add, around, ceil, expm1, floor, log1p, reciprocal, round, sign, trunc,
                       argmax, argmin, astype, broadcast_to, cos, divide, dot, einsum, exp,
                       expand_dims, gelu, log, matmul, max, maximum, min, minimum, multiply,
                       negative, power, relu, reshape, rsqrt, sigmoid, sin, sqrt, square, subtract,
                       take_rows, tanh, where, transpose, with_sharding)
from ..ops.math_extra import (arccos, arccosh, arcsin, arcsinh, arctan, arctan2, arctanh, cbrt,
                              copysign, cosh, deg2rad, degrees, exp2, float_power, fmax, fmin,
                              fmod, heaviside, hypot, ldexp, log10, log2, logaddexp, logaddexp2,
                              nextafter, rad2deg, radians, signbit, sinc, sinh, tan)
from ... import _C
from ..ops import ops as _o
from ..array.operators import reduce_operand as _reduce_operand
from ..base import dtypes as _dtypes
from ..array.abstract import is_abstract, ShapeDtypeStruct, ShapeDtypeStruct as _SDS
from ..ops.slicing import getitem
from ..array.array import _buffer_view, _fill_array, Array, check_python_ints, device_put


def sum(a, axis=None, dtype=None, out=None, keepdims=False, *, where=None):  # noqa: A001
    """``jnp.sum``: the sum over ``axis`` (a dimension sharded over mesh axes ends in an
    all-reduce over them); ``dtype=`` converts ``a`` first and accumulates in it (jnp's);
    int32 sums wrap, bools and int8 / int16 sum as int32, uint8 / uint16 as uint32;
    ``where=`` (a bool mask broadcast to ``a``) sums only the elements it selects. See :func:`ctrainstate._src.ops.ops.sum`.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.sum(np.array([True, True, False]), dtype=cnp.float32)).item()
    2.0
    """
    a = _reduce_operand("sum", a, dtype, out)
    if where is not None:
        a = _masked(a, where, "sum")
    res = _o.sum(a, axis=axis, keepdims=keepdims)
    if dtype is not None and getattr(res, "dtype", None) not in (None, _dt.canonicalize(dtype)):
        # a narrow int dtype= accumulates in that dtype in jnp: the 32-bit wrapping sum,
        # wrapped to the narrow width, is that sum
        res = _o.astype(res, dtype)
    return res


# sum(x) of a float32 Array runs from a plan cached in C (ctrainstate._src.ops.ops' primitives)
def _plan_sum(a, axis, dtype, out, keepdims):
    return None if dtype is not None or out is not None else _o._plan_sum(a, axis, keepdims)


def _rule_sum(g, res, a, axis, dtype, out, keepdims):
    return _o._vjp_sum(g, res, a, axis, keepdims)


# (the rule run in C: _vjp_sum's primitive calls, see ops._derivative_programs)
sum = _C.Primitive("sum", 1, sum, _plan_sum, sum.__doc__,  # noqa: A001
                   _C.VjpProgram((None,), _rule_sum, _o._unbroadcast, _o._VP_SUM), ("where",),
                   ("axis", "dtype", "out", "keepdims"), (None, None, None, False))
sum.__module__ = __name__


_F32 = _o._DT_F32   # (the dtype object float32 Arrays hold)


def mean(a, axis=None, dtype=None, out=None, keepdims=False, *, where=None):
    """``jnp.mean`` over ``axis`` (ints and bools give float32); ``dtype=`` converts ``a``
    first; ``where=`` (a bool mask broadcast to ``a``): the sum of the selected elements over
    their count (NaN where none is selected, as jnp). See :func:`ctrainstate._src.ops.ops.mean`."""
    if (type(a) is Array and a._dtype is _F32 and axis is None and keepdims is False
            and dtype is None and out is None and where is None):
        # a float32 Array's mean of all elements (a loss): ops.mean's sum times 1 / n, without
        # the wrappers' five Python calls
        n = _math.prod(a._shape)
        return multiply(_o.sum(a), 1.0 / n if n else _math.nan)
    a = _reduce_operand("mean", a, dtype, out)
    if where is None:
        return _o.mean(a, axis=axis, keepdims=keepdims)
    a = _o._lift_any(a)
    dt = a.dtype
    f = a if dt == _np.float32 else astype(a, _np.float32)   # (16-bit: rounded once, below)
    num = _o.sum(_masked(f, where, "mean"), axis=axis, keepdims=keepdims)
    cnt = _o.sum(_masked(_o.ones_like(f), where, "mean"), axis=axis, keepdims=keepdims)
    out = divide(num, cnt)
    return astype(out, dt) if dt in _o._LOWP else out


def _masked(a, where, who):
    """``where(mask, a, 0)`` for a reduction's ``where=`` (jnp: a bool mask that broadcasts
    to ``a``'s shape)."""
    wdt = _np.dtype(getattr(where, "dtype", _np.asarray(where).dtype))
    if wdt != _np.bool_:
        raise TypeError(f"{who}: where= must be a bool mask, got dtype {wdt}")
    shape = tuple(_np.shape(a))
    if _np.broadcast_shapes(tuple(_np.shape(where)), shape) != shape:
        raise ValueError(f"{who}: where= of shape {tuple(_np.shape(where))} does not broadcast "
                         f"to the operand's shape {shape}")
    return _o.where(where, a, False if getattr(a, "dtype", None) == _np.bool_ else 0)
from ..ops import linalg  # noqa: F401
from ..ops.elementwise import (all, any, bitwise_and, bitwise_not, bitwise_or, bitwise_xor,
                               cumprod, cumsum, equal, floor_divide, greater, greater_equal,
                               invert, isfinite, isinf, isnan, left_shift, less, less_equal,
                               logical_and, logical_not, logical_or, logical_xor, mod, not_equal,
                               remainder, result_type, right_shift)
from ..ops.slicing import array_split, concatenate, split, stack  # noqa: F401
from ..ops.move import (atleast_1d, atleast_2d, atleast_3d, diag, diagonal, eye, flip, fliplr,
                        flipud, moveaxis, pad, prod, repeat, roll, swapaxes, take, take_along_axis,
                        sort, argsort, tile, tril, triu)

amax, amin = max, min


def var(x, axis=None, keepdims: bool = False, *, ddof=0):
    """Variance (``jnp.var``): the mean of the squared deviations, or their sum over
    ``N - ddof`` with ``ddof`` (``ddof=1``: the sample variance; NaN where ``N - ddof <= 0``,
    as jnp); int and bool ``x`` give float32."""
    m = mean(x, axis=axis, keepdims=True)
    if not ddof:
        return mean(square(subtract(x, m)), axis=axis, keepdims=keepdims)
    n = x.size // m.size if m.size else 0
    ss = sum(square(subtract(x, m)), axis=axis, keepdims=keepdims)
    if n - ddof <= 0:           # jnp: NaN where N - ddof <= 0
        return add(multiply(ss, 0.0), _np.nan)
    return divide(ss, float(n - ddof))


def std(x, axis=None, keepdims: bool = False, *, ddof=0):
    """Standard deviation (``jnp.std``): ``sqrt(var(x, axis, keepdims, ddof=ddof))``."""
    return sqrt(var(x, axis=axis, keepdims=keepdims, ddof=ddof))


# 16-bit floats: computed in float32 and rounded once, as jnp.var / jnp.std upcast them
var = _o._with_dtype_policy(var)
std = _o._with_dtype_policy(std)


def clip(x, min=None, max=None, *, a_min=None, a_max=None):  # noqa: A002 - jnp's names
    """``minimum(maximum(x, min), max)`` (``jnp.clip``; ``a_min``/``a_max`` are the old names)."""
    lo = min if min is not None else a_min
    hi = max if max is not None else a_max
    if lo is not None:
        x = maximum(x, lo)
    if hi is not None:
        x = minimum(x, hi)
    return x


def ravel(a, order: str = "C"):
    """``a`` flattened to one dimension in row-major order (``jnp.ravel``; ``order='C'`` only).
    A reshape: any dtype, no arithmetic."""
    if order != "C":
        raise NotImplementedError(f"ravel: only order='C' is supported, got {order!r}")
    a = _o._lift_any(a)
    return reshape(a, (a.size,))


def outer(a, b):
    """``ravel(a)[:, None] * ravel(b)[None, :]`` (``jnp.outer``)."""
    a, b = _o._lift_pair(a, b)
    return multiply(reshape(ravel(a), (a.size, 1)), reshape(ravel(b), (1, b.size)))


def _axis_list(axes, ndim, who):
    out = []
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, (int, _np.integer)):
            raise TypeError(f"{who}: axes must be ints, got {a!r}")
        if not -ndim <= a < ndim:
            raise ValueError(f"{who}: axis {a} is out of bounds for an array of dimension {ndim}")
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{who}: repeated axis in {tuple(axes)}")
    return out


def tensordot(a, b, axes=2, *, precision=None):
    """Sum of products over the axes ``axes`` of ``a`` and ``b`` (``jnp.tensordot``):
    ``axes`` an int n (the last n of ``a`` with the first n of ``b``) or a pair of
    sequences (or ints). Runs as one matrix product (``precision`` as :func:`matmul`'s):
    ``a`` with its contracted axes moved last and ``b`` with them first, each reshaped to
    2-d; the result has ``a``'s free axes then ``b``'s."""
    a, b = _o._lift_pair(a, b)
    if isinstance(axes, (int, _np.integer)) and not isinstance(axes, bool):
        n = int(axes)
        if n < 0 or n > a.ndim or n > b.ndim:
            raise ValueError(f"tensordot: axes={n} out of range for shapes {a.shape} and {b.shape}")
        ax_a, ax_b = list(range(a.ndim - n, a.ndim)), list(range(n))
    else:
        try:
            ax_a, ax_b = axes
        except (TypeError, ValueError):
            raise TypeError("tensordot: axes must be an int or a pair of sequences of ints, "
                            f"got {axes!r}") from None
        ax_a = [ax_a] if isinstance(ax_a, (int, _np.integer)) else list(ax_a)
        ax_b = [ax_b] if isinstance(ax_b, (int, _np.integer)) else list(ax_b)
        ax_a = _axis_list(ax_a, a.ndim, "tensordot")
        ax_b = _axis_list(ax_b, b.ndim, "tensordot")
        if len(ax_a) != len(ax_b):
            raise ValueError(f"tensordot: {len(ax_a)} axes of a but {len(ax_b)} of b")
    for i, j in zip(ax_a, ax_b):
        if a.shape[i] != b.shape[j]:
            raise ValueError(f"tensordot: contracted dimensions differ: axis {i} of {a.shape} "
                             f"and axis {j} of {b.shape}")
    free_a = [d for d in range(a.ndim) if d not in ax_a]
    free_b = [d for d in range(b.ndim) if d not in ax_b]
    k = 1
    for d in ax_a:
        k *= a.shape[d]
    m = 1
    for d in free_a:
        m *= a.shape[d]
    n_ = 1
    for d in free_b:
        n_ *= b.shape[d]
    a2 = reshape(transpose(a, free_a + ax_a) if free_a + ax_a != list(range(a.ndim)) else a, (m, k))
    b2 = reshape(transpose(b, ax_b + free_b) if ax_b + free_b != list(range(b.ndim)) else b, (k, n_))
    out = matmul(a2, b2, precision=precision)
    return reshape(out, tuple(a.shape[d] for d in free_a) + tuple(b.shape[d] for d in free_b))


def inner(a, b, *, precision=None):
    """``jnp.inner``: the sum of products over the last axes of ``a`` and ``b`` (a scalar
    operand multiplies), shape ``a.shape[:-1] + b.shape[:-1]``."""
    a, b = _o._lift_pair(a, b)
    if a.ndim == 0 or b.ndim == 0:
        return multiply(a, b)
    return tensordot(a, b, ([a.ndim - 1], [b.ndim - 1]), precision=precision)


def vdot(a, b, *, precision=None):
    """``jnp.vdot``: the dot product of the flattened operands (real: no conjugation), a
    scalar."""
    a, b = _o._lift_pair(a, b)
    if a.size != b.size:
        raise ValueError(f"vdot: operands of {a.size} and {b.size} elements")
    return matmul(ravel(a), ravel(b), precision=precision)


# 16-bit floats: computed in float32 and rounded once
outer = _o._with_dtype_policy(outer, (0, 1))
tensordot = _o._with_dtype_policy(tensordot, (0, 1))
inner = _o._with_dtype_policy(inner, (0, 1))
vdot = _o._with_dtype_policy(vdot, (0, 1))


def _products_abstract_rules():
    """Inside ``eval_shape`` these return ShapeDtypeStructs of jnp's result shapes."""

    def size(x):
        return _math.prod(_o._shp(x))

    def td_rule(a, b, axes=2, **_k):
        sa, sb = _o._shp(a), _o._shp(b)
        if isinstance(axes, (int, _np.integer)):
            aa, bb = list(range(len(sa) - int(axes), len(sa))), list(range(int(axes)))
        else:
            aa, bb = axes
            aa = [aa] if isinstance(aa, (int, _np.integer)) else list(aa)
            bb = [bb] if isinstance(bb, (int, _np.integer)) else list(bb)
            aa, bb = [d % len(sa) for d in aa], [d % len(sb) for d in bb]
        return tuple(n for d, n in enumerate(sa) if d not in aa) + \
            tuple(n for d, n in enumerate(sb) if d not in bb)

    def inner_rule(a, b, **_k):
        sa, sb = _o._shp(a), _o._shp(b)
        if not sa or not sb:
            return _o._bcast_shape(sa, sb)
        return tuple(sa[:-1]) + tuple(sb[:-1])

    g = globals()
    g["ravel"] = _o._with_rule(g["ravel"], lambda a, order="C": (size(a),), _SDS)
    g["outer"] = _o._with_rule(g["outer"], lambda a, b: (size(a), size(b)), _SDS)
    g["tensordot"] = _o._with_rule(g["tensordot"], td_rule, _SDS)
    g["inner"] = _o._with_rule(g["inner"], inner_rule, _SDS)
    g["vdot"] = _o._with_rule(g["vdot"], lambda a, b, **_k: (), _SDS)


_products_abstract_rules()


def squeeze(x, axis=None):
    """Drop size-1 dimensions (all of them, or those in ``axis``; ``jnp.squeeze``: an axis
    out of range, repeated, or of size other than 1 raises ``ValueError``)."""
    shape = tuple(x.shape)
    nd = len(shape)
    if axis is None:
        drop = {d for d, n in enumerate(shape) if n == 1}
    else:
        axes = (axis,) if isinstance(axis, (int, _np.integer)) else tuple(axis)
        norm = []
        for a in axes:
            if not isinstance(a, (int, _np.integer)) or isinstance(a, bool):
                raise TypeError(f"squeeze: axis must be an int or a tuple of ints, got {axis!r}")
            if not -nd <= a < nd:
                raise ValueError(f"squeeze: axis {a} is out of bounds for an array of dimension "
                                 f"{nd} (shape {shape})")
            norm.append(int(a) % nd)
        if len(set(norm)) != len(norm):
            raise ValueError(f"squeeze: repeated axis in {axis!r} (dimensions {tuple(norm)})")
        drop = set(norm)
        for d in sorted(drop):
            if shape[d] != 1:
                raise ValueError(f"squeeze: dimension {d} of shape {shape} has size {shape[d]}, not 1")
    return reshape(x, tuple(n for d, n in enumerate(shape) if d not in drop))


# --- dtypes and array creation (jnp.zeros, jnp.array, ...) ---------------------------------------
# The result is an Array placed like ``device_put`` places it: on ``device`` (a Device or a
# Sharding) when given, else replicated over the active mesh, else on the default device.
# Without ``dtype``, floats are float32 and integers int32 (JAX without x64).

from ..base import dtypes as _dt  # noqa: E402

class _ScalarMeta(type):
    """jnp's scalar types: ``jnp.float32`` is a dtype (``np.dtype(jnp.float32)``,
    ``dtype=jnp.float32``, ``== np.float32``) and, called, converts to an Array of that dtype
    (``jnp.float32(mask)``, ``jnp.int32(x)``: ``astype`` on the devices, on the autodiff tape;
    numpy's own types would pull an Array to the host, or refuse it)."""

    def __hash__(cls):
        return hash(cls.dtype.type)

    def __eq__(cls, other):
        return cls is other or cls.dtype.type == other

    def __ne__(cls, other):
        return not cls == other

    def __call__(cls, x):
        return asarray(x, dtype=cls.dtype)

    def __instancecheck__(cls, instance):
        return isinstance(instance, cls.dtype.type)


def _scalar_type(t):
    return _ScalarMeta(_np.dtype(t).name, (object,), {"dtype": _np.dtype(t),
                                                      "__module__": __name__})


float32 = _scalar_type(_np.float32)
float16 = _scalar_type(_np.float16)
bfloat16 = _scalar_type(_dt.bfloat16)
int32 = _scalar_type(_np.int32)
uint32 = _scalar_type(_np.uint32)
uint8 = _scalar_type(_np.uint8)
int8 = _scalar_type(_np.int8)
int16 = _scalar_type(_np.int16)
uint16 = _scalar_type(_np.uint16)
bool_ = _scalar_type(_np.bool_)
# jax's 64-bit names; without x64 (the only mode here) values of these dtypes are narrowed
# as jax narrows them: jnp.zeros(3, jnp.float64).dtype is float32, jnp.int64(3) an int32
# Array. np.dtype(jnp.float64) stays float64, as in jax.
float64 = _scalar_type(_np.float64)
int64 = _scalar_type(_np.int64)
uint64 = _scalar_type(_np.uint64)

from ..array.array import Array as ndarray  # noqa: E402 - jnp.ndarray is jax.Array
pi = _np.pi
e = _np.e
inf = _np.inf
nan = _np.nan


def _place(host, device):
    return device_put(host, device)


def _default_dtype(dtype, like_float=True):
    if dtype is not None:
        return _dt.canonicalize(dtype)
    return _dt.float32 if like_float else None


def asarray(a, dtype=None, *, device=None):
    """``a`` as an Array (an Array of that dtype and placement is returned as it is)."""
    if isinstance(a, Array):
        if dtype is not None and _dt.canonicalize(dtype) != a.dtype:
            a = a.astype(dtype)
        return a if device is None else _place(a, device)
    try:
        host = _np.asarray(a, dtype=_dt.canonicalize(dtype) if dtype is not None else None)
    except TypeError:   # a list of Arrays to bfloat16: ml_dtypes converts numbers only
        if dtype is None:
            raise
        host = _np.asarray(a).astype(_dt.canonicalize(dtype))
    if dtype is None:
        check_python_ints(a, host)
    return _place(host, device)


def array(a, dtype=None, copy: bool = True, *, device=None):
    """A new Array holding ``a`` (``jnp.array``: an Array argument is copied)."""
    if isinstance(a, Array):
        out = asarray(a, dtype, device=device)
        return out.copy() if (out is a and copy) else out
    return asarray(a, dtype, device=device)


def _value_dtype(value) -> _np.dtype:
    """``jnp``'s dtype of a fill value without x64: a Python bool, int or float gives bool,
    int32 or float32; a numpy (or ctrainstate) scalar or array keeps its dtype, with 64-bit
    types narrowed to 32 bits (float16 stays float16, bfloat16 stays bfloat16)."""
    dt = getattr(value, "dtype", None)
    return _dt.canonicalize(dt if dt is not None else _np.asarray(value).dtype)


def full(shape, fill_value, dtype=None, *, device=None):
    """An Array of ``shape`` filled with ``fill_value`` (broadcast to ``shape``); without
    ``dtype``, of ``fill_value``'s dtype as ``jnp.full`` infers it (``full((2,),
    np.float16(1))`` is float16, ``full((2,), 1.0)`` float32)."""
    dt = _dt.canonicalize(dtype) if dtype is not None else _value_dtype(fill_value)
    return _place(_np.full(_shape(shape), _np.asarray(fill_value), dt), device)


def zeros(shape, dtype=None, *, device=None):
    """An Array of zeros (float32 by default)."""
    return _place(_np.zeros(_shape(shape), _default_dtype(dtype)), device)


def ones(shape, dtype=None, *, device=None):
    """An Array of ones (float32 by default)."""
    return _place(_np.ones(_shape(shape), _default_dtype(dtype)), device)


def arange(start, stop=None, step=None, dtype=None, *, device=None):
    """``jnp.arange``: int32 for integer arguments, float32 otherwise."""
    if stop is None:
        start, stop = 0, start
    host = _np.arange(start, stop, step) if step is not None else _np.arange(start, stop)
    return _place(host.astype(_dt.canonicalize(dtype if dtype is not None else host.dtype)),
                  device)


def linspace(start, stop, num: int = 50, endpoint: bool = True, dtype=None, *, device=None):
    """``num`` evenly spaced float32 values from ``start`` to ``stop``."""
    host = _np.linspace(start, stop, num, endpoint=endpoint)
    return _place(host.astype(_default_dtype(dtype)), device)


def _full_like(x, value, dtype, shape):
    src = x.dtype if hasattr(x, "dtype") else _np.asarray(x).dtype
    dt = _dt.canonicalize(dtype if dtype is not None else src)
    value = _np.asarray(value)
    if shape is not None:
        return _place(_np.full(_shape(shape), value, dt), None)
    if isinstance(x, ShapeDtypeStruct) and (is_abstract() or x.sharding is None):
        if is_abstract():                       # eval_shape: stay abstract
            _np.broadcast_shapes(value.shape, tuple(x.shape))
            return ShapeDtypeStruct(x.shape, dt, x.sharding)
        return _place(_np.full(tuple(x.shape), value, dt), None)    # jnp: an Array
    if not isinstance(x, (Array, ShapeDtypeStruct)):
        return _place(_np.full(_np.shape(x), value, dt), None)
    if isinstance(x, Array) and value.ndim == 0 and dt == _dt.float32 \
            and x.dtype == _dt.float32 and value in (0, 1):
        return (_o.zeros_like if value == 0 else _o.ones_like)(x)   # the op kernel, per shard
    # each device writes its own block of the (broadcast) value
    full_value = _np.broadcast_to(value.astype(dt) if value.dtype != dt else value, tuple(x.shape))

    def fill(target, start, shard_shape):
        view = target if isinstance(target, _np.ndarray) else _buffer_view(target, shard_shape, dt)
        view[...] = full_value[tuple(slice(b, b + n) for b, n in zip(start, shard_shape))]
    return _fill_array(tuple(x.shape), dt, x.sharding, fill)


def zeros_like(a, dtype=None, shape=None):
    """Zeros with ``a``'s shape, dtype and sharding (``jnp.zeros_like``; each device fills
    its own block). ``a`` may be an Array, a numpy array or a ``ShapeDtypeStruct`` (an Array
    is returned, as jnp does, placed by the struct's sharding when it has one; inside
    ``eval_shape`` a ``ShapeDtypeStruct``)."""
    return _full_like(a, 0, dtype, shape)


def ones_like(a, dtype=None, shape=None):
    """Ones with ``a``'s shape, dtype and sharding (``jnp.ones_like``)."""
    return _full_like(a, 1, dtype, shape)


def full_like(a, fill_value, dtype=None, shape=None):
    """``fill_value`` (broadcast to ``a``'s shape) with ``a``'s shape, dtype and sharding
    (``jnp.full_like``)."""
    return _full_like(a, fill_value, dtype, shape)


def _shape(shape):
    """``shape`` as a tuple of ints; as jnp, sizes must be integers (``(2.5,)`` is no shape)."""
    return _dtypes.int_tuple(shape, "shape", scalar=True)


__all__ = [
    "abs", "add", "arange", "argmax", "argmin", "array", "asarray", "bfloat16", "bool_", "clip", "e", "float16",
    "float32", "full", "inf", "int32", "linspace", "minimum", "nan", "ones", "pi", "squeeze",
    "std", "uint32", "uint8", "int8", "int16", "uint16", "zeros", "full_like", "ones_like", "zeros_like", "broadcast_to", "cos", "divide", "dot", "einsum", "exp", "expand_dims", "gelu",
    "log", "matmul", "maximum", "mean", "multiply", "negative", "power", "relu",
    "reshape", "rsqrt", "sigmoid", "sin", "sqrt", "square", "subtract", "sum", "tanh",
    "transpose", "var", "with_sharding", "max", "min", "amax", "amin", "take_rows", "where", "concatenate", "stack", "split", "array_split",
    "around", "ceil", "expm1", "floor", "log1p", "reciprocal", "round", "sign", "trunc", "ravel",
    "outer", "inner", "vdot", "tensordot", "linalg", "ndarray", "float64", "int64", "uint64",
]
__all__ += [
    "atleast_1d", "atleast_2d", "atleast_3d", "diag", "diagonal", "eye", "flip", "fliplr",
    "flipud", "moveaxis", "pad", "prod", "repeat", "roll", "swapaxes", "take",
    "take_along_axis", "tile", "tril", "triu", "sort", "argsort",
    "all", "any", "bitwise_and", "bitwise_not", "bitwise_or", "bitwise_xor", "cumprod", "cumsum",
    "equal",
    "floor_divide", "greater", "greater_equal", "invert", "isfinite", "isinf", "isnan",
    "left_shift", "less", "less_equal", "logical_and", "logical_not", "logical_or",
    "logical_xor", "mod", "not_equal", "remainder", "result_type", "right_shift",
]
__all__ += [  # ctrainstate._src.ops.math_extra
    "arccos",
    "arccosh",
    "arcsin",
    "arcsinh",
    "arctan",
    "arctan2",
    "arctanh",
    "cbrt",
    "copysign",
    "cosh",
    "deg2rad",
    "degrees",
    "exp2",
    "float_power",
    "fmax",
    "fmin",
    "fmod",
    "heaviside",
    "hypot",
    "ldexp",
    "log10",
    "log2",
    "logaddexp",
    "logaddexp2",
    "nextafter",
    "rad2deg",
    "radians",
    "signbit",
    "sinc",
    "sinh",
    "tan",
]


# --- comparisons of whole arrays, stacking, differences ----------------------------------------

def isclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    """``jnp.isclose``: ``|a - b| <= atol + rtol * |b|`` elementwise, infinities close only
    to the same infinity, NaN close to NaN only with ``equal_nan`` (computed in float32;
    integer operands are compared as floats)."""
    # a Python scalar takes the other operand's 16-bit dtype first (jax's weak types)
    a = _o._weak_in(a, getattr(b, "dtype", None)) if not hasattr(a, "dtype") else a
    b = _o._weak_in(b, getattr(a, "dtype", None)) if not hasattr(b, "dtype") else b
    fa = astype(a, _np.float32) if _np.dtype(getattr(a, "dtype", _np.float32)) != _np.float32 \
        else a
    fb = astype(b, _np.float32) if _np.dtype(getattr(b, "dtype", _np.float32)) != _np.float32 \
        else b
    finite = logical_and(isfinite(fa), isfinite(fb))
    diff = abs(subtract(fa, fb))
    tol = add(float(atol), multiply(float(rtol), abs(fb)))
    close_finite = logical_and(finite, less_equal(where(finite, diff, 0.0), where(finite, tol, 1.0)))
    same_inf = logical_and(logical_and(isinf(fa), isinf(fb)), equal(fa, fb))
    out = logical_or(close_finite, same_inf)
    if equal_nan:
        out = logical_or(out, logical_and(isnan(fa), isnan(fb)))
    return out


def allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    """``jnp.allclose``: a bool scalar Array, every element :func:`isclose`."""
    return all(isclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan))


def hstack(tup):
    """``jnp.hstack``: joined along axis 1 (axis 0 for 1-d operands)."""
    arrs = atleast_1d(*tup) if len(tup) > 1 else [atleast_1d(*tup)]
    return concatenate(arrs, 0 if arrs[0].ndim == 1 else 1)


def vstack(tup):
    """``jnp.vstack``: operands made at least 2-d, joined along axis 0."""
    arrs = atleast_2d(*tup) if len(tup) > 1 else [atleast_2d(*tup)]
    return concatenate(arrs, 0)


def diff(a, n=1, axis=-1):
    """``jnp.diff``: the ``n``-th forward difference along ``axis``."""
    n = _operator_index(n, "diff: n")
    if n < 0:
        raise ValueError(f"diff: order n must be non-negative, got {n}")
    x = asarray(a)
    ax = _o._axes(axis, x.ndim)[0] if x.ndim else None
    if ax is None:
        raise ValueError("diff requires an input that is at least one-dimensional")
    for _ in range(n):
        hi = tuple(slice(1, None) if d == ax else slice(None) for d in range(x.ndim))
        lo = tuple(slice(None, -1) if d == ax else slice(None) for d in range(x.ndim))
        x = subtract(getitem(x, hi), getitem(x, lo))
    return x


def _operator_index(v, what):
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {v!r}") from None


# --- the rest of jax.numpy's utility, creation, NaN-reduction and order-statistic names ---------
# (ctrainstate/_src/numpy_lax/numpy_extra.py, names in its __all__; its ``where`` replaces the select-only one
# above and takes the one-argument form)
from . import numpy_extra as _extra  # noqa: E402
globals().update({_n: getattr(_extra, _n) for _n in _extra.__all__})
__all__ += _extra.__all__

# --- NumPy-2 aliases, set operations, binning, insertion / deletion, convolution, statistics,
# polynomials (ctrainstate/_src/numpy_lax/numpy_more.py, names in its __all__)
from . import numpy_more as _more  # noqa: E402
globals().update({_n: getattr(_more, _n) for _n in _more.__all__})
__all__ += _more.__all__
