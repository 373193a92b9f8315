"""Comparisons, boolean logic and integer arithmetic on (sharded) Arrays.

The float ops of :mod:`ctrainstate._src.ops.ops` compute in float32. The ops here run one typed
kernel (``_C.op_ewise``: csrc/core/ct_ewise_math.h, the same element code on CPUs and GPUs)
on every device's own blocks, for any stored dtype (float32, bfloat16, float16, int32,
uint32, int16, uint16, int8, uint8, bool), with jax's semantics:

* **dtype promotion** (:func:`result_type`): jax's lattice on the stored dtypes without x64
  (``_dtypes.promote``): ``uint8 + int8`` is int16, ``uint16 + int8`` int32, int32 with
  uint32 int32, any int with a float that float. Python scalars are weak (``int32_array + 1``
  is int32, ``uint8_array + 1`` uint8, ``int32_array > 0.5`` compares as float32,
  ``bfloat16_array > 0.1`` compares in bfloat16 with 0.1 rounded to bfloat16); a weak int
  wraps to a narrower int dtype as in jax (``uint8_array + 300`` adds 44, ``uint8_array == -1``
  compares with 255); a Python int outside int32's range raises ``OverflowError`` as jax does.
* **narrow ints** (int16, uint16, int8, uint8) run in their own kernels: each element is
  loaded into a wide register and the result wrapped to the dtype's width when stored
  (``uint8 200 + 100 == 44``).
* **comparisons** return bool Arrays; NaN compares false (``!=``: true).
* **integers wrap** (two's complement, as XLA): ``int32 max + 1 == int32 min``,
  ``abs(int32 min) == int32 min``.
* **floor_divide / remainder** (``//``, ``%``), as measured with jax 0.10 on CPU:
  ints ``x // 0`` is ``-1`` for ``x == 0`` and ``-2`` for ``x != 0`` of the other sign
  (XLA divides by zero to -1, then jnp's floor correction applies), ``x % 0 == 0``;
  ``INT_MIN // -1 == INT_MIN``; uint32 ``x // 0 == 2**32 - 1``. Floats follow jnp's
  ``_float_divmod``: ``x // 0 == ±inf`` (``0 // 0`` NaN), ``x % 0`` NaN, ``5.5 % inf == 5.5``,
  ``3 % -inf == -inf``. 16-bit floats are computed in float32 and rounded once.
* **shifts**: a count outside ``[0, width)`` gives 0 (``<<``, unsigned ``>>``) or the sign
  fill (signed ``>>``, arithmetic).

Sharding follows the float binary ops (the output takes the operands' shardings where they
are not broadcast; an incompatible operand is resharded). None of these ops is
differentiable: their results are bool or integer Arrays that carry no gradient, so a mask
``x > 0`` inside :func:`ctrainstate.value_and_grad` leaves the trace intact, and
``where(x > 0, x, 0.1 * x)`` differentiates through ``x`` and ``0.1 * x``.

>>> import numpy as np, ctrainstate as cts, ctrainstate.numpy as cnp
>>> ids = cts.device_put(np.array([-100, 3, 7], np.int32))
>>> np.asarray(ids != -100).tolist(), np.asarray((ids + 1) // 2).tolist()
([False, True, True], [-50, 2, 4])
>>> px = cts.device_put(np.array([200, 3], np.uint8))
>>> np.asarray(px + 100).tolist(), str(cnp.sum(px).dtype), str((px + np.int8(1)).dtype)
([44, 103], 'uint32', 'int16')
"""
from __future__ import annotations
from ..base.hooks import provide as _provide
_provide('_elementwise', __name__)   # lower layers call into this module through _hooks.upper

import builtins
import functools

import numpy as np

from ... import _C
from ..base import dtypes as _dtypes
from ..array.array import Array, device_put
from ..array.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding, get_mesh
from ..array.abstract import ShapeDtypeStruct
from ..base.devices import Device, devices, local_devices
from .slicing import concatenate, split, stack
from ..base.hooks import upper as _upper

# ct_ewise_op and the reductions (csrc/core/ct_ops.h), read from _C.op_codes
(EQ, NE, LT, LE, GT, GE, ADD, SUB, MUL, MAX, MIN, FLOORDIV, REM, AND, OR, XOR, SHL, SHR,
 NOT, NEG, ABS, ISNAN, ISINF, ISFINITE) = (_C.op_codes["ewise"][n] for n in (
    "EQ", "NE", "LT", "LE", "GT", "GE", "ADD", "SUB", "MUL", "MAX", "MIN", "FLOORDIV", "REM",
    "AND", "OR", "XOR", "SHL", "SHR", "NOT", "NEG", "ABS", "ISNAN", "ISINF", "ISFINITE"))
_RED_SUM, _RED_MAX = _C.op_codes["reduce"]["SUM"], _C.op_codes["reduce"]["MAX"]

_F32, _BF16, _F16 = _dtypes.float32, _dtypes.bfloat16, _dtypes.float16
_I32, _U32, _BOOL = _dtypes.int32, _dtypes.uint32, _dtypes.bool_
_FLOATS = (_F32, _BF16, _F16)
_INTS = _dtypes.INTEGERS
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1


def _o():
    _ops = _upper('_ops')
    return _ops


# --- dtype promotion ---------------------------------------------------------------------

def _kind(dt) -> int:
    return 2 if dt in _FLOATS else (1 if dt in _INTS else 0)


def _strong_dtype(v):
    """The dtype of a strongly typed operand (Array, ShapeDtypeStruct, numpy value, Python
    bool), None for a weak Python int / float; TypeError for anything else."""
    if isinstance(v, (Array, ShapeDtypeStruct)):
        return np.dtype(v.dtype)
    if isinstance(v, (bool, np.bool_)):
        return _BOOL
    if isinstance(v, (int, float)):
        return None
    if isinstance(v, (np.dtype, type, str)):   # a dtype (result_type(np.int32, 'float32'))
        try:
            return _dtypes.canonicalize(v)
        except TypeError:
            raise TypeError(f"{v!r} is not a dtype ctrainstate stores") from None
    _ops = _upper('_ops')
    _ops._check_host_operand(v)   # numbers only (not None, a string, an object array)
    return _dtypes.canonicalize(np.asarray(v).dtype)


def result_type(*vals, who: str = "op"):
    """jax's result dtype (``jnp.result_type``, x64 disabled) of operands (Arrays, arrays,
    dtypes) among the stored dtypes, Python scalars weak. A Python int that does not fit the int32 weak type with an
    integer result raises ``OverflowError``, as jax does."""
    strong = []
    weak_int = weak_float = False
    for v in vals:
        dt = _strong_dtype(v)
        if dt is not None:
            strong.append(dt)
        elif isinstance(v, float):
            weak_float = True
        else:
            weak_int = True
    res = None
    for d in strong:
        res = d if res is None else _dtypes.promote(res, d)
    if weak_float and (res is None or _kind(res) < 2):
        res = _F32
    if weak_int and (res is None or res == _BOOL):
        res = _I32
    if res in _INTS:
        for v in vals:
            if isinstance(v, int) and not isinstance(v, bool) and \
                    not _INT32_MIN <= v <= _INT32_MAX:
                raise OverflowError(f"{who}: Python int {v} does not fit int32, jax's type for "
                                    f"Python ints (without x64); make it an Array of a wider "
                                    f"dtype or a float")
    return res


# --- placement and the kernel call -------------------------------------------------------------

def _place_for(vals):
    place = None
    for v in vals:
        if isinstance(v, Array):
            place = _o()._place_of(v)
    if place is None:
        place = get_mesh()
    if place is None:
        place = local_devices()[0]
    return place


def _as(v, dt, place) -> Array:
    """``v`` as an Array of dtype ``dt``: Arrays converted on their devices (not recorded on
    the tape), host values converted on the host (Python ints wrap as jax's weak ints do)
    and placed replicated on ``place``."""
    if isinstance(v, Array):
        v._check_alive()
        return v if v.dtype == dt else _o()._convert(v, dt)
    t = type(v)
    if dt == _F32 and (t is float or (t is int and -_EXACT_INT <= v <= _EXACT_INT)) and v == v:
        # (a Python scalar beside a float32 operand, `x > 0`: the kept 0-d Array, the same
        # float32 value; the ops here compute a new Array from it)
        return _o()._const(v, place)
    if isinstance(v, int) and not isinstance(v, bool) and dt in _INTS:
        host = np.asarray(v, np.int64).astype(dt)   # wraps (result_type bounded it to int32)
    else:
        host = np.asarray(v)
        if host.dtype.kind in "iu" and dt in _INTS:
            host = host.astype(np.int64).astype(dt)   # wraps, as jax's canonicalisation
        else:
            host = host.astype(dt)
    if isinstance(place, Device):
        return device_put(host, SingleDeviceSharding(place))
    return device_put(host, NamedSharding(place, PartitionSpec()))


_EXACT_INT = 2 ** 24   # the ints float32 holds exactly (converted alike from int64 or double)


def _out_dtype(op, dt):
    return _BOOL if (op <= GE or op in (ISNAN, ISINF, ISFINITE)) else dt


def _ewise_raw(op, a: Array, b: Array | None) -> Array:
    """The typed kernel on operands of one dtype (b None for a unary op), sharded as the
    float binary ops are."""
    o = _o()
    dt = _out_dtype(op, a.dtype)
    if b is None:
        norm = o._norm(a.sharding, a.ndim) if o._mesh_key(a)[0] == "mesh" else [()] * a.ndim
        out = o._new(a.shape, o._place_of(a), norm, dt)
        _C.op_ewise(op, o._bufs(out), o._bufs(a), None)
        return out
    place, shape, norm, a2, b2 = o._binary_layout(a, b)
    out = o._new(shape, place, norm, dt)
    _C.op_ewise(op, o._bufs(out), o._bufs(a2), o._bufs(b2))
    return out


_BITWISE_ONLY = "Accepted dtypes are subtypes of integer, bool."
_NUMERIC_ONLY = "Accepted dtypes are subtypes of integer, floating."


def _refuse(name, dt, accepted):
    raise TypeError(f"{name} does not accept dtype {np.dtype(dt)}. {accepted}")


def _binary(op, a, b, name, *, no_float=False, no_bool=False, bool_as_int=False):
    """``op(a, b)`` after jax's promotion of the two operands."""
    dt = result_type(a, b, who=name)
    if no_float and dt in _FLOATS:
        _refuse(name, dt, _BITWISE_ONLY)
    if dt == _BOOL and bool_as_int:     # jnp's numeric ops compute bools as int32
        dt = _I32
    if no_bool and dt == _BOOL:
        _refuse(name, dt, _NUMERIC_ONLY)
    place = _place_for((a, b))
    return _ewise_raw(op, _as(a, dt, place), _as(b, dt, place))


def _unary_op(op, x, name, *, no_float=False, no_bool=False):
    dt = result_type(x, who=name)
    if no_float and dt in _FLOATS:
        _refuse(name, dt, _BITWISE_ONLY)
    if no_bool and dt == _BOOL:
        _refuse(name, dt, _NUMERIC_ONLY)
    return _ewise_raw(op, _as(x, dt, _place_for((x,))), None)


def _abstract(rule_dtype, reduce=False):
    """Let an op take ShapeDtypeStructs (``eval_shape``): the operands' broadcast shape (or,
    ``reduce``, the reduction's shape) and the dtype ``rule_dtype(*operands)`` gives."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if builtins.any(isinstance(a, ShapeDtypeStruct) for a in args):
                if reduce:
                    shape = _o()._rule_reduce(*args, **kwargs)
                    return ShapeDtypeStruct(tuple(shape), rule_dtype(args[0]), None)
                shape = ()
                for a in args:
                    shape = np.broadcast_shapes(shape, tuple(np.shape(a)) if not hasattr(a, "shape")
                                                else tuple(a.shape))
                return ShapeDtypeStruct(tuple(shape), rule_dtype(*args), None)
            return fn(*args, **kwargs)
        return wrapped
    return deco


_to_bool = _abstract(lambda *a: _BOOL)
_promoted = _abstract(lambda *a: result_type(*a))


# --- comparisons -----------------------------------------------------------------------------

@_to_bool
def equal(x, y) -> Array:
    """``x == y`` elementwise (``jnp.equal``): a bool Array; NaN is equal to nothing.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.equal(np.array([1., np.nan], np.float32), np.float32(1))).tolist()
    [True, False]
    """
    return _binary(EQ, x, y, "equal")


@_to_bool
def not_equal(x, y) -> Array:
    """``x != y`` elementwise (``jnp.not_equal``): a bool Array; NaN differs from everything."""
    return _binary(NE, x, y, "not_equal")


@_to_bool
def less(x, y) -> Array:
    """``x < y`` elementwise (``jnp.less``); operands promoted as jax does (an int32 Array
    against ``0.5`` compares as float32)."""
    return _binary(LT, x, y, "less")


@_to_bool
def less_equal(x, y) -> Array:
    """``x <= y`` elementwise (``jnp.less_equal``)."""
    return _binary(LE, x, y, "less_equal")


@_to_bool
def greater(x, y) -> Array:
    """``x > y`` elementwise (``jnp.greater``).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.greater(np.array([-1, 0, 2], np.int32), 0.5)).tolist()
    [False, False, True]
    """
    return _binary(GT, x, y, "greater")


@_to_bool
def greater_equal(x, y) -> Array:
    """``x >= y`` elementwise (``jnp.greater_equal``)."""
    return _binary(GE, x, y, "greater_equal")


# --- booleans and bits -------------------------------------------------------------------------

def _as_bool(v, place):
    """``v`` as a bool Array: nonzero is true (NaN too). A float is compared with zero as
    jax does (``v != 0``, which on XLA's CPU counts a float32/bfloat16 subnormal as zero),
    not converted (a conversion would call 1e-40 true)."""
    if isinstance(v, Array):
        return not_equal(v, 0) if v.dtype in _FLOATS else _as(v, _BOOL, place)
    h = np.asarray(v)
    if h.dtype.kind == "f":
        h32 = h.astype(np.float32)
        h = (h32 != 0) & ~(np.abs(h32) < np.finfo(np.float32).tiny)
    return _as(h, _BOOL, place)


@_to_bool
def logical_and(x, y) -> Array:
    """``jnp.logical_and``: both operands as bools (nonzero is true, NaN too), a bool Array."""
    place = _place_for((x, y))
    return _ewise_raw(AND, _as_bool(x, place), _as_bool(y, place))


@_to_bool
def logical_or(x, y) -> Array:
    """``jnp.logical_or`` (operands as bools)."""
    place = _place_for((x, y))
    return _ewise_raw(OR, _as_bool(x, place), _as_bool(y, place))


@_to_bool
def logical_xor(x, y) -> Array:
    """``jnp.logical_xor`` (operands as bools)."""
    place = _place_for((x, y))
    return _ewise_raw(XOR, _as_bool(x, place), _as_bool(y, place))


@_to_bool
def logical_not(x) -> Array:
    """``jnp.logical_not``: ``x == 0`` as a bool Array (NaN is true, so its negation false)."""
    return _ewise_raw(NOT, _as_bool(x, _place_for((x,))), None)


@_promoted
def bitwise_and(x, y) -> Array:
    """``x & y`` (``jnp.bitwise_and``) for ints and bools; floats raise ``TypeError``."""
    return _binary(AND, x, y, "bitwise_and", no_float=True)


@_promoted
def bitwise_or(x, y) -> Array:
    """``x | y`` (``jnp.bitwise_or``) for ints and bools."""
    return _binary(OR, x, y, "bitwise_or", no_float=True)


@_promoted
def bitwise_xor(x, y) -> Array:
    """``x ^ y`` (``jnp.bitwise_xor``) for ints and bools."""
    return _binary(XOR, x, y, "bitwise_xor", no_float=True)


@_promoted
def invert(x) -> Array:
    """``~x`` (``jnp.invert`` / ``bitwise_not``): bitwise not of ints, logical not of bools."""
    return _unary_op(NOT, x, "invert", no_float=True)


bitwise_not = invert


@_abstract(lambda x, y: _I32 if result_type(x, y) == _BOOL else result_type(x, y))
def left_shift(x, y) -> Array:
    """``x << y`` (``jnp.left_shift``) for ints (bools compute as int32); a count outside
    ``[0, 32)`` gives 0."""
    return _binary(SHL, x, y, "left_shift", no_float=True, bool_as_int=True)


@_abstract(lambda x, y: _I32 if result_type(x, y) == _BOOL else result_type(x, y))
def right_shift(x, y) -> Array:
    """``x >> y`` (``jnp.right_shift``): arithmetic for int32 (a count outside ``[0, 32)``
    fills with the sign), logical for uint32 (0 past 31)."""
    return _binary(SHR, x, y, "right_shift", no_float=True, bool_as_int=True)


# --- float classification ------------------------------------------------------------------------

def _classify(op, x, name, int_value):
    dt = result_type(x, who=name)
    place = _place_for((x,))
    if dt in _FLOATS:
        return _ewise_raw(op, _as(x, dt, place), None)
    # ints and bools are never NaN or inf: a constant of x's shape and sharding
    xa = _as(x, dt, place)
    return _ewise_raw(EQ if int_value else NE, xa, xa)


@_to_bool
def isnan(x) -> Array:
    """``jnp.isnan``: a bool Array (all false for ints and bools)."""
    return _classify(ISNAN, x, "isnan", False)


@_to_bool
def isinf(x) -> Array:
    """``jnp.isinf``: true at +inf and -inf (all false for ints and bools)."""
    return _classify(ISINF, x, "isinf", False)


@_to_bool
def isfinite(x) -> Array:
    """``jnp.isfinite``: neither inf nor NaN (all true for ints and bools)."""
    return _classify(ISFINITE, x, "isfinite", True)


# --- integer arithmetic (the int / bool paths of add, subtract, ...) ------------------------------

def int_binary(name, a, b):
    """``add`` / ``subtract`` / ``multiply`` / ``maximum`` / ``minimum`` when jax's promotion
    of the operands is an integer or bool dtype (ints wrap; bools: add is or, multiply and,
    maximum or, minimum and; subtract of bools raises as in jax)."""
    op = {"add": ADD, "subtract": SUB, "multiply": MUL, "maximum": MAX, "minimum": MIN}[name]
    return _binary(op, a, b, name, no_bool=(name == "subtract"))


def int_broadcast_to(x, shape):
    """``broadcast_to`` of an int or bool Array: ``x`` plus zeros of ``shape`` in ``x``'s
    dtype (for bools ``or False``), sharded as the float op (the output keeps ``x``'s
    sharding where ``x`` is not broadcast)."""
    o = _o()
    x = o._lift_any(x)
    shape = o._shape_arg(shape, "broadcast_to")
    if x.shape == shape:
        return x
    o._check_broadcast_to(x.shape, shape)
    zero = o._new(shape, o._place_of(x), [()] * len(shape))
    _C.op_unary(o.U_AFFINE, 0.0, 0.0, o._bufs(zero), o._bufs(zero))
    return _ewise_raw(ADD, x, o._convert(zero, x.dtype))


@_abstract(lambda x, y: _I32 if result_type(x, y) == _BOOL else result_type(x, y))
def floor_divide(x, y) -> Array:
    """``x // y`` (``jnp.floor_divide``): jax's results, division by zero included (see the
    module docstring: int ``x // 0`` is -1 or -2, uint32 all ones, float ±inf / NaN); bools
    compute as int32."""
    return _binary(FLOORDIV, x, y, "floor_divide", bool_as_int=True)


@_abstract(lambda x, y: _I32 if result_type(x, y) == _BOOL else result_type(x, y))
def remainder(x, y) -> Array:
    """``x % y`` (``jnp.remainder`` / ``jnp.mod``): the sign of the divisor; int ``x % 0`` is
    0, float ``x % 0`` NaN. Float results are differentiable as jax's: ``d/dx = 1`` and
    ``d/dy = -floor(x / y)``."""
    out = _binary(REM, x, y, "remainder", bool_as_int=True)
    if out.dtype in _FLOATS:
        _o()._record(out, (x, y), lambda g: _remainder_vjp(g, x, y))
    return out


def _remainder_vjp(g, x, y):
    o = _o()

    def back(c, v):
        c = o._unbroadcast(c, tuple(v.shape))
        return c if c.dtype == v.dtype else o.astype(c, v.dtype)
    gx = back(g, x) if isinstance(x, Array) else None
    gy = None
    if isinstance(y, Array):
        q = floor_divide(x, y)   # (not recorded: a step function)
        gy = back(o.negative(o.multiply(g, q)), y)
    return gx, gy


mod = remainder


def int_negative(x):
    return _unary_op(NEG, x, "negative", no_bool=True)


def int_unary(name, x):
    """``floor`` / ``ceil`` / ``round`` / ``trunc`` / ``sign`` / ``square`` of an integer
    operand, as jnp computes them: the first four return the integers themselves, ``sign`` is
    -1, 0 or 1 in the operand's dtype (``(x > 0) - (x < 0)``), ``square`` is ``x * x``,
    wrapping (uint8 16 squared is 0)."""
    dt = result_type(x, who=name)
    place = _place_for((x,))
    xa = _as(x, dt, place)
    if name == "square":
        return _ewise_raw(MUL, xa, xa)
    if name == "sign":
        zero = _as(0, dt, place)
        return _ewise_raw(SUB, _o()._convert(_ewise_raw(GT, xa, zero), dt),
                          _o()._convert(_ewise_raw(LT, xa, zero), dt))
    return xa


def int_abs(x):
    dt = result_type(x, who="abs")
    if dt == _BOOL:        # jnp.abs of bools: the bools themselves
        return _as(x, dt, _place_for((x,)))
    return _unary_op(ABS, x, "abs")


def int_where(c, x, y):
    """``where`` for integer / bool branches: an exact select of typed ops (from their C
    plans where they have one): ``c * x + (1 - c) * y`` with the condition as 0 / 1 (exact
    with wrapping ints), for bools ``(c & x) | (~c & y)``."""
    dt = result_type(x, y, who="where")
    place = _place_for((c, x, y))
    xa, ya = _as(x, dt, place), _as(y, dt, place)
    cb = _as_bool(c, place)
    if dt == _BOOL:
        return bitwise_or(bitwise_and(cb, xa), bitwise_and(invert(cb), ya))
    o = _o()
    ci = o._convert_to(cb, dt)
    return o.add(o.multiply(ci, xa), o.multiply(o.subtract(1, ci), ya))


# --- integer reductions -------------------------------------------------------------------------

def _allreduce_typed(a: Array, axes, op: int):
    """Combine ``a``'s shards over the devices that differ only in mesh ``axes`` (in place):
    each group's first buffer accumulates the others (copied to its device) with the typed
    kernel, then is copied back to them. Wrapping sums and maxima are exact in any order. A
    group that spans processes is combined on the host (``ops._allreduce_processes``)."""
    o = _o()
    axes = tuple(axes)
    if not axes or not isinstance(a.sharding, NamedSharding):
        return
    mesh = a.sharding.mesh
    code = _dtypes.code(a.dtype)
    kop = ADD if op == _RED_SUM else MAX

    def combine(groups):
        for g in groups:
            acc = g[0]
            tmp = _C.Buffer(acc.device_id, tuple(acc.shape), code)
            for b in g[1:]:
                _C.copy_bytes(tmp, b)
                _C.op_ewise(kop, [acc], [acc], [tmp])
            for b in g[1:]:
                _C.copy_bytes(b, acc)

    positions = o._allreduce_groups(mesh, axes)
    if not positions:
        return
    if not a._sharding.is_fully_addressable:
        o._allreduce_processes(a, mesh, positions, op, inside=combine)
        return
    bufs = o._bufs(a)
    combine([[bufs[p] for p in g] for g in positions])


def _reduce_typed_raw(op, x: Array, axes: tuple) -> Array:
    o = _o()
    xn = o._norm(x.sharding, x.ndim) if o._mesh_key(x)[0] == "mesh" else [()] * x.ndim
    kept_shape = [s for d, s in enumerate(x.shape) if d not in axes]
    kept_norm = [xn[d] for d in range(x.ndim) if d not in axes]
    out = o._new(kept_shape, o._place_of(x), kept_norm, x.dtype)
    if axes:
        mask = 0
        for d in axes:
            mask |= 1 << d
        _C.op_reduce_typed(o._bufs(x), op, mask, o._bufs(out))
    else:
        for ob, ib in zip(o._bufs(out), o._bufs(x)):
            _C.copy_bytes(ob, ib)
    _allreduce_typed(out, [m for d in axes for m in xn[d]], op)
    return out


def _int_operand(x, name) -> Array:
    dt = result_type(x, who=name)
    return _as(x, dt, _place_for((x,)))


def sum_dtype(dt):
    """The dtype jnp.sum (and prod) of ``dt`` returns: bools and the signed narrow ints
    widen to int32, the unsigned narrow ints to uint32 (jax's default int of their kind);
    the rest keep their dtype."""
    if dt == _BOOL or dt in (_dtypes.int8, _dtypes.int16):
        return _I32
    if dt in (_dtypes.uint8, _dtypes.uint16):
        return _U32
    return dt


def int_reduce(name, x, axis=None, keepdims=False):
    """``sum`` / ``max`` / ``min`` of an integer or bool Array (jnp: the sum of bools and of
    int8 / int16 is int32, of uint8 / uint16 uint32 -- a conversion kernel, then the 32-bit
    sum --, of 32-bit ints their dtype, wrapping; max / min keep the dtype and run on it).
    A dimension sharded over mesh axes ends in a combination of the devices' partial
    results."""
    o = _o()
    x = _int_operand(x, name)
    axes = o._axes(axis, x.ndim)
    if name == "sum" and sum_dtype(x.dtype) != x.dtype:
        x = o._convert(x, sum_dtype(x.dtype))
    if name != "sum":
        for d in axes:
            if x.shape[d] == 0:
                raise ValueError(f"{name}: zero-size dimension {d} of an array of shape "
                                 f"{x.shape} has no {'maximum' if name == 'max' else 'minimum'}")
    if name == "min":   # min(x) = ~max(~x): ~ reverses the order of every int and of bool
        out = _ewise_raw(NOT, _reduce_typed_raw(_RED_MAX, _ewise_raw(NOT, x, None), axes), None)
    else:
        out = _reduce_typed_raw(_RED_SUM if name == "sum" else _RED_MAX, x, axes)
    if keepdims:
        out = o.reshape(out, [1 if d in axes else s for d, s in enumerate(x.shape)])
    return out


@_abstract(lambda x: _BOOL, reduce=True)
def any(x, axis=None, keepdims: bool = False) -> Array:  # noqa: A001 - numpy's name
    """``jnp.any``: whether any element (as a bool) is true, over ``axis``."""
    place = _place_for((x,))
    xb = _as_bool(x, place)
    if xb.size == 0:
        return _empty_bool(xb, place, axis, keepdims, False)
    return int_reduce("max", xb, axis, keepdims)


@_abstract(lambda x: _BOOL, reduce=True)
def all(x, axis=None, keepdims: bool = False) -> Array:  # noqa: A001 - numpy's name
    """``jnp.all``: whether every element (as a bool) is true, over ``axis``."""
    place = _place_for((x,))
    xb = _as_bool(x, place)
    if xb.size == 0:
        return _empty_bool(xb, place, axis, keepdims, True)
    return int_reduce("min", xb, axis, keepdims)


def _empty_bool(x, place, axis, keepdims, value):
    """any / all with an empty reduction: every slice has the identity (False / True)."""
    o = _o()
    xb = _as_bool(x, place)
    axes = o._axes(axis, xb.ndim)
    shape = [1 if d in axes else s for d, s in enumerate(xb.shape)] if keepdims else \
        [s for d, s in enumerate(xb.shape) if d not in axes]
    return _as(np.full(shape, value, np.bool_), _BOOL, place)


def cumsum(x, axis=None) -> Array:
    """``jnp.cumsum`` along ``axis`` (None: the flattened array): ints wrap in their dtype,
    bools sum as int32, floats in their dtype (16-bit floats rounded after every step).

    A Hillis-Steele scan: ceil(log2(n)) additions of the array and itself shifted by 1, 2,
    4, ... along the axis, on each device's own blocks, so the float additions happen in a
    different order than a sequential sum (results agree to rounding). A scanned dimension
    sharded over mesh axes is gathered first (the other dimensions keep their sharding).
    Float cumsums are differentiable (the scan is made of differentiable adds, slices and
    joins); integer ones carry no gradient.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> mask = np.array([[True, True, False, True]])
    >>> np.asarray(cnp.cumsum(mask, -1) - 1).tolist()
    [[0, 1, 1, 2]]
    """
    return _scan(x, axis, "cumsum")


def cumprod(x, axis=None) -> Array:
    """``jnp.cumprod`` along ``axis`` (None: the flattened array): ints wrap in their dtype,
    bools multiply as int32, floats in their dtype (16-bit floats rounded after every step).

    The same scan as :func:`cumsum` with products: each output is the product of the same
    factors as jax's, grouped differently, so floats agree to rounding; where a running
    product overflows before a zero factor, the two orders can differ in kind (jax's
    sequential product gives ``inf * 0 = nan``, the scan may multiply the zero in first).
    Float cumprods are differentiable (zeros included: the scan is made of products).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.cumprod(np.array([1, 2, 3, 4], np.int32))).tolist()
    [1, 2, 6, 24]
    """
    return _scan(x, axis, "cumprod")


def _scan(x, axis, name) -> Array:
    """cumsum / cumprod (and lax's cummax / cummin): a Hillis-Steele scan along one axis (see
    cumsum)."""
    o = _o()
    if isinstance(x, ShapeDtypeStruct):   # eval_shape
        dt = _I32 if x.dtype == _BOOL else x.dtype
        if axis is None:
            return ShapeDtypeStruct((x.size,), dt, None)
        o._axes(axis, x.ndim)   # (a bad axis raises as on Arrays)
        return ShapeDtypeStruct(x.shape, dt, None)
    x = _int_operand(x, name)
    if x.dtype == _BOOL:
        x = o._convert(x, _I32)
    if axis is None:
        x = o.reshape(x, (x.size,))
        axis = 0
    (ax,) = o._axes(axis, x.ndim)
    n = x.shape[ax]
    if n <= 1:
        return x
    xn = o._norm(x.sharding, x.ndim) if o._mesh_key(x)[0] == "mesh" else [()] * x.ndim
    if xn[ax]:
        want = list(xn)
        want[ax] = ()
        x = o.with_sharding(x, o._sharding_for(o._place_of(x), want))
    floats = x.dtype in _FLOATS
    if name == "cumsum":
        combine = o.add if floats else (lambda p, q: _ewise_raw(ADD, p, q))
        identity = 0
    elif name == "cumprod":
        combine = o.multiply if floats else (lambda p, q: _ewise_raw(MUL, p, q))
        identity = 1
    elif floats:
        # lax.cummax / lax.cummin: jax's parallel prefix scan, so that tied values split
        # the gradient as jax's (which differentiates through that scan) does
        return _assoc_scan(x, ax, o.maximum if name == "cummax" else o.minimum)
    else:   # integer cummax / cummin: the identity is the dtype's lowest / highest value
        big = name == "cummax"
        combine = (o.maximum if big else o.minimum) if floats else (
            lambda p, q: _ewise_raw(MAX if big else MIN, p, q))
        identity = (-np.inf if big else np.inf) if floats else (
            np.iinfo(x.dtype).min if big else np.iinfo(x.dtype).max)
    k = 1
    while k < n:
        lead = [s if d != ax else k for d, s in enumerate(x.shape)]
        shifted = concatenate([_fill_like_block(x, lead, identity), split(x, [n - k], axis=ax)[0]],
                              axis=ax)
        x = combine(x, shifted)
        k *= 2
    return x


def _assoc_scan(x: Array, ax: int, combine) -> Array:
    """The inclusive scan of ``combine`` along ``ax`` in the grouping of jax's
    ``lax.associative_scan`` (:func:`ctrainstate._src.numpy_lax.lax_control._prefix_scan`). The halves are
    interleaved by stacking, so the values are exactly ``combine``'s (a ``-0.0`` stays): the
    same binary tree gives the same gradient where ``combine``'s depends on the grouping
    (``maximum`` at ties)."""
    _axis_slice = _upper('_lax_control')._axis_slice
    _prefix_scan = _upper('_lax_control')._prefix_scan
    o = _o()

    def interleave(even, odd):
        m = odd.shape[ax]
        pairs = stack([_axis_slice(even, ax, 0, m), odd], axis=ax + 1)
        shape = tuple(even.shape[:ax]) + (2 * m,) + tuple(even.shape[ax + 1:])
        out = o.reshape(pairs, shape)
        if even.shape[ax] > m:
            out = concatenate([out, _axis_slice(even, ax, m, m + 1)], axis=ax)
        return out

    (y,) = _prefix_scan([x], ax, lambda a, b: [combine(a[0], b[0])], interleave)
    return y


def _fill_like_block(x: Array, shape, value):
    """``value`` everywhere, of ``shape``, laid out as ``x`` in the dimensions it shares with
    ``x`` (each device receives only its block: no replicated copy first)."""
    o = _o()
    xn = o._norm(x.sharding, x.ndim) if o._mesh_key(x)[0] == "mesh" else [()] * x.ndim
    place = o._place_of(x)
    norm = [xn[d] if shape[d] == x.shape[d] else () for d in range(x.ndim)]
    return device_put(np.full(shape, value, x.dtype), o._sharding_for(place, norm))


# ops that read host values: under jit, single nodes of the program (node.py)
from .node import op_node as _op_node  # noqa: E402

cumsum = _op_node("cumsum")(cumsum)
_ewise_raw = _op_node("_ewise_raw", raw=True)(_ewise_raw)
_reduce_typed_raw = _op_node("_reduce_typed_raw", raw=True)(_reduce_typed_raw)
