"""The rest of jax.numpy's elementwise float functions: hyperbolic and inverse trigonometric
functions, ``cbrt``, ``exp2`` / ``log2`` / ``log10``, ``arctan2``, ``hypot``, ``copysign``,
``logaddexp`` / ``logaddexp2``, ``deg2rad`` / ``rad2deg``, ``sinc``, ``heaviside``,
``signbit``, ``fmod``, ``nextafter``, ``ldexp``, ``float_power``, ``fmax`` / ``fmin``.

Each follows jax's definition (``jax/_src/numpy/ufuncs.py``, ``jax/_src/lax/lax.py``):

* where jax lowers to an XLA primitive (``sinh cosh tan asin acos atan atan2 asinh acosh
  atanh cbrt exp2 nextafter``, and ``lax.rem`` for ``fmod``) one ABI 7 element kernel runs
  (``csrc/core/ct_ops_math.h``: the libm float function on CPUs, CUDA's on GPUs), with jax's
  derivative rule;
* where jax composes (``log2 = log(x) / log(2)``, ``log10``, ``deg2rad``, ``rad2deg``,
  ``hypot``, ``logaddexp`` and its NaN / inf handling, ``sinc``, ``heaviside``, ``fmax``,
  ``fmin``, ``copysign``) the same composition runs on the existing differentiable ops, so
  values and gradients are jax's up to the rounding of the libm calls; ``logaddexp`` and
  ``logaddexp2`` carry jax's custom derivative;
* ``signbit`` and ``ldexp`` (bit manipulations in jax: ``bitcast_convert_type``, ``frexp``)
  are exact kernels here: the sign bit, and ``ldexpf`` (one rounding).

Accuracy (float32, measured by tests/ops/test_numpy_math.py and tests/c/test_ops_math.c over
dense samples of float32 inputs with ±0, ±inf, NaN and the domain edges): the kernels are
within 2 ulp of the float64 function rounded to float32 (glibc: sinh, cosh, asinh, acosh,
atanh 2; tan, asin, acos, atan, atan2, cbrt, exp2 1), ``signbit fmod nextafter ldexp`` are
exact; the composites add one rounding per step, as jax's do (``log2`` / ``log10`` within
2 ulp; ``logaddexp`` and ``hypot`` within 2 ulp where the result is not near 0).

dtypes: integer and bool operands promote to float32 (``fmod`` and ``signbit`` keep integer
semantics, as jnp); bfloat16 / float16 Arrays compute in float32 and round once (jax
rounds every step of a composite to the 16-bit dtype, so composites may differ from jax's
by one 16-bit ulp). Subnormal float32 operands and results are kept, as everywhere in
ctrainstate's float ops (XLA's CPU flushes them to zero: ``jnp.cbrt(1e-40)`` is not
``4.6e-14`` there, ``jnp.fmod(3., 1e-40)`` is NaN). Sharded operands keep their sharding;
binary functions broadcast and reshard as ``add`` does.

Measured against jax 0.10 on CPU (tests/ops/test_numpy_math.py): within 2 ulp of jax's
results (arccosh 3; the exact functions and ``deg2rad`` / ``rad2deg`` bit for bit) wherever
jax is itself within 2 ulp of float64; XLA's own errors are larger in places: sinh / cosh up
to 24 ulp near ``|x| = 85``, exp2 up to 63, asin and exp2 flush results near the smallest
normal.

>>> import numpy as np, ctrainstate.numpy as cnp
>>> np.asarray(cnp.arctan2(np.float32([1, -1]), np.float32([0, -1]))).astype(float).round(4).tolist()
[1.5708, -2.3562]
>>> np.asarray(cnp.logaddexp(np.float32([0, -np.inf]), np.float32([0, -np.inf]))).tolist()
[0.6931471824645996, -inf]
"""
from __future__ import annotations

import functools

import numpy as np

from ... import _C
from ..base import dtypes as _dtypes
from . import elementwise as _ew
from . import ops as _o
from ..array.array import Array
from ..array.abstract import ShapeDtypeStruct

# the ABI 7 kernels' codes (csrc/core/ct_ops.h), read from _C.op_codes
(U_SINH, U_COSH, U_TAN, U_ASIN, U_ACOS, U_ATAN, U_ASINH, U_ACOSH, U_ATANH, U_CBRT, U_EXP2,
 U_SIGNBIT) = (_C.op_codes["unary"][n] for n in (
    "SINH", "COSH", "TAN", "ASIN", "ACOS", "ATAN", "ASINH", "ACOSH", "ATANH", "CBRT", "EXP2",
    "SIGNBIT"))
B_ATAN2, B_NEXTAFTER, B_FMOD, B_LDEXP = (_C.op_codes["binary"][n] for n in (
    "ATAN2", "NEXTAFTER", "FMOD", "LDEXP"))

_F32 = _dtypes.float32
_FLOATS = (_dtypes.float32, _dtypes.bfloat16, _dtypes.float16)
_LN2 = float(np.log(np.float32(2.0)))          # lax.log(2) in float32 (correctly rounded)
_INV_LN10 = float(np.float32(0.4342944819032518))
_INV_LN2 = float(np.float32(1 / np.log(2)))
_DEG2RAD = float(np.float32(np.pi / 180))
_RAD2DEG = float(np.float32(180 / np.pi))
_PI = float(np.float32(np.pi))


# --- dtype promotion and shape rules ----------------------------------------------------

def _shape_of(v):
    return tuple(v.shape) if hasattr(v, "shape") else tuple(np.shape(v))


def _float_result(vals, who):
    dt = _ew.result_type(*vals, who=who)
    return dt if dt in _FLOATS else _F32


def _abstract(vals, dtype):
    shape: tuple = ()
    for v in vals:
        shape = tuple(np.broadcast_shapes(shape, _shape_of(v)))
    return ShapeDtypeStruct(shape, dtype, None)


def _any_abstract(vals) -> bool:
    return any(isinstance(v, ShapeDtypeStruct) for v in vals)


def _floating(nargs: int):
    """Wrap a float32 implementation of ``nargs`` operands with jnp's promotion: integer /
    bool operands become the promoted float dtype (float32 unless a 16-bit float Array takes
    part), 16-bit floats compute in float32 and round once (``_ops``' dtype policy), and
    ShapeDtypeStructs give the result's shape and dtype (``eval_shape``)."""
    def deco(fn):
        policy = _o._with_dtype_policy(fn, tuple(range(nargs)))

        @functools.wraps(fn)
        def wrapped(*args):
            if len(args) != nargs:
                raise TypeError(f"{fn.__name__} takes {nargs} positional operand"
                                f"{'s' if nargs > 1 else ''}, got {len(args)}")
            if _any_abstract(args):
                return _abstract(args, _float_result(args, fn.__name__))
            if any(_o._intlike(v) for v in args):
                rdt = _float_result(args, fn.__name__)
                args = tuple(_to_float(v, rdt) for v in args)
            return policy(*args)
        return wrapped
    return deco


def _to_float(v, dt):
    """An integer / bool operand converted to float dtype ``dt`` (not recorded: it carries no
    gradient); anything else as it is."""
    if isinstance(v, Array):
        return _o.astype(v, dt) if _o._intlike(v) else v
    if isinstance(v, (np.ndarray, np.generic)) and v.dtype.kind in "biu":
        return np.asarray(v).astype(dt)
    return v


def _const(x: Array, value) -> Array:
    """A float32 scalar Array on ``x``'s devices (a true operand of a binary kernel)."""
    return _o._lift(np.float32(value), _o._place_of(x))


# --- ABI 7 kernels: jax's primitives and their derivative rules ----------------------------

@_floating(1)
def sinh(x, /) -> Array:
    """Hyperbolic sine (``jnp.sinh``, ``lax.sinh``; libm ``sinhf``, within 2 ulp); gradient
    ``cosh(x)``."""
    return _o._unary(U_SINH, x, vjp=lambda g, x, y: _o.multiply(g, cosh(x)))


@_floating(1)
def cosh(x, /) -> Array:
    """Hyperbolic cosine (``jnp.cosh``, ``lax.cosh``; ``coshf``, within 2 ulp); gradient
    ``sinh(x)``."""
    return _o._unary(U_COSH, x, vjp=lambda g, x, y: _o.multiply(g, sinh(x)))


@_floating(1)
def tan(x, /) -> Array:
    """Tangent (``jnp.tan``, ``lax.tan``; ``tanf``, within 1 ulp); gradient ``1 + tan(x)**2``
    (jax's, from the result)."""
    return _o._unary(U_TAN, x, vjp=lambda g, x, y: _o.multiply(g, _o.add(1.0, _o.square(y))))


def _one_minus_sq(x):
    return _o.subtract(1.0, _o.square(x))


@_floating(1)
def arcsin(x, /) -> Array:
    """Inverse sine (``jnp.arcsin``, ``lax.asin``; ``asinf``, within 1 ulp; NaN outside
    [-1, 1]); gradient ``rsqrt(1 - x**2)`` (inf at ±1, NaN outside, as jax)."""
    return _o._unary(U_ASIN, x, vjp=lambda g, x, y: _o.multiply(g, _o.rsqrt(_one_minus_sq(x))))


@_floating(1)
def arccos(x, /) -> Array:
    """Inverse cosine (``jnp.arccos``, ``lax.acos``; ``acosf``, within 1 ulp); gradient
    ``-rsqrt(1 - x**2)``."""
    return _o._unary(U_ACOS, x, vjp=lambda g, x, y: _o.multiply(
        g, _o.negative(_o.rsqrt(_one_minus_sq(x)))))


@_floating(1)
def arctan(x, /) -> Array:
    """Inverse tangent (``jnp.arctan``, ``lax.atan``; ``atanf``, within 1 ulp); gradient
    ``1 / (1 + x**2)``."""
    return _o._unary(U_ATAN, x, vjp=lambda g, x, y: _o.divide(g, _o.add(1.0, _o.square(x))))


@_floating(1)
def arcsinh(x, /) -> Array:
    """Inverse hyperbolic sine (``jnp.arcsinh``, ``lax.asinh``; ``asinhf``, within 2 ulp);
    gradient ``rsqrt(x**2 + 1)``."""
    return _o._unary(U_ASINH, x, vjp=lambda g, x, y: _o.multiply(
        g, _o.rsqrt(_o.add(_o.square(x), 1.0))))


@_floating(1)
def arccosh(x, /) -> Array:
    """Inverse hyperbolic cosine (``jnp.arccosh``, ``lax.acosh``; ``acoshf``, within 2 ulp;
    NaN below 1); gradient ``rsqrt(x**2 - 1)`` (jax's form: inf at 1)."""
    return _o._unary(U_ACOSH, x, vjp=lambda g, x, y: _o.multiply(
        g, _o.rsqrt(_o.subtract(_o.square(x), 1.0))))


@_floating(1)
def arctanh(x, /) -> Array:
    """Inverse hyperbolic tangent (``jnp.arctanh``, ``lax.atanh``; ``atanhf``, within 2 ulp;
    ±inf at ±1, NaN outside); gradient ``1 / (1 + x) * (g / (1 - x))`` (jax's order)."""
    return _o._unary(U_ATANH, x, vjp=lambda g, x, y: _o.multiply(
        _o.reciprocal(_o.add(1.0, x)), _o.divide(g, _o.subtract(1.0, x))))


@_floating(1)
def cbrt(x, /) -> Array:
    """Cube root (``jnp.cbrt``, ``lax.cbrt``; ``cbrtf``, within 1 ulp; odd: ``cbrt(-8) = -2``);
    gradient ``1/3 * cbrt(x)**-2`` (inf at 0, as jax)."""
    def vjp(g, x, y):
        return _o.multiply(g, _o.multiply(_o._integer_pow_raw(y, -2), float(np.float32(1 / 3))))
    return _o._unary(U_CBRT, x, vjp=vjp)


@_floating(1)
def exp2(x, /) -> Array:
    """``2 ** x`` (``jnp.exp2``, ``lax.exp2``; ``exp2f``, within 1 ulp and exact at integers;
    XLA's CPU exp2 is up to 63 ulp off on [-100, 100], 34 at ``exp2(127.)``, measured with
    jax 0.10); gradient ``log(2) * 2**x``."""
    return _o._unary(U_EXP2, x, vjp=lambda g, x, y: _o.multiply(_o.multiply(g, y), _LN2))


@_floating(2)
def arctan2(x1, x2, /) -> Array:
    """The angle of the point ``(x2, x1)`` in ``[-pi, pi]`` (``jnp.arctan2``, ``lax.atan2``;
    ``atan2f``, within 1 ulp; the signed zeros and infinities of C99: ``arctan2(0., -0.)`` is
    pi). Gradients ``x2 / (x1**2 + x2**2)`` and ``-x1 / (x1**2 + x2**2)`` (NaN at the
    origin, as jax)."""
    def den(x, y):
        return _o.add(_o.square(x), _o.square(y))
    return _o._binary(B_ATAN2, x1, x2,
                      lambda g, x, y, o: _o.multiply(g, _o.divide(y, den(x, y))),
                      lambda g, x, y, o: _o.multiply(g, _o.divide(_o.negative(x), den(x, y))))


def _refuse_grad(name, *vals):
    t = _o._tape()
    if t is not None and any(isinstance(v, Array) and id(v) in t.tracked for v in vals):
        raise NotImplementedError(f"Differentiation rule for '{name}' not implemented (as in "
                                  f"jax: {name} has no derivative; wrap its operands in "
                                  f"lax.stop_gradient)")


@_floating(2)
def _nextafter_f32(x1, x2, /) -> Array:
    _refuse_grad("nextafter", x1, x2)
    return _o._binary(B_NEXTAFTER, x1, x2)


def nextafter(x1, x2, /) -> Array:
    """The float32 next to ``x1`` in the direction of ``x2`` (``jnp.nextafter``,
    ``lax.nextafter``; exact: ``nextafter(0., 1.)`` is the least subnormal, as in jax; NaN if
    either is NaN; ``x2`` where they are equal). Not differentiable: under ``grad`` it raises
    ``NotImplementedError``, as jax does. bfloat16 / float16 operands are refused (a
    ``TypeError``): the step is the float32 one, which rounds back to ``x1`` in 16 bits, where
    jax steps in the 16-bit format."""
    for v in (x1, x2):
        dt = getattr(v, "dtype", None)
        if dt is not None and np.dtype(dt) in (_dtypes.bfloat16, _dtypes.float16):
            raise TypeError(f"nextafter: {np.dtype(dt).name} operands are not supported (the "
                            f"next float32 rounds back to the same {np.dtype(dt).name}); "
                            f"convert to float32 for the float32 neighbour")
    return _nextafter_f32(x1, x2)


# --- fmod: lax.rem -------------------------------------------------------------------------

def fmod(x1, x2, /) -> Array:
    """The remainder of truncated division, with the dividend's sign (``jnp.fmod``,
    ``lax.rem``): floats exact (``fmodf``; ``fmod(x, 0)`` and ``fmod(inf, y)`` NaN,
    ``fmod(x, inf) = x``); integers as jnp (a zero divisor is replaced by 1, so
    ``fmod(x, 0) == 0``; bools compute as int32). Float gradients as ``lax.rem``'s:
    ``d/dx1 = 1``, ``d/dx2 = -sign(x1 / x2) * floor(|x1 / x2|)``."""
    if _any_abstract((x1, x2)):
        dt = _ew.result_type(x1, x2, who="fmod")
        return _abstract((x1, x2), _dtypes.int32 if dt == _dtypes.bool_ else dt)
    dt = _ew.result_type(x1, x2, who="fmod")
    if dt not in _FLOATS:
        return _int_fmod(x1, x2, dt)
    return _float_fmod(x1, x2)


@_floating(2)
def _float_fmod(x1, x2, /) -> Array:
    def vjp_y(g, x, y, o):
        q = _o._binary_raw(_o.B_DIV, x, y)
        k = _o._binary_raw(_o.B_MUL, _o._unary_raw(_o.U_SIGN, q),
                           _o._unary_raw(_o.U_FLOOR, _o._unary_raw(_o.U_ABS, q)))
        return _o.negative(_o.multiply(g, k))
    return _o._binary(B_FMOD, x1, x2, lambda g, x, y, o: g, vjp_y)


def _int_fmod(x1, x2, dt):
    """jnp.fmod of integers on the typed kernels: jnp.remainder (the divisor's sign) of the
    divisor with zeros replaced by 1, moved to the dividend's sign where they differ."""
    if dt == _dtypes.bool_:
        dt = _dtypes.int32
    place = _ew._place_for((x1, x2))
    a, b = _ew._as(x1, dt, place), _ew._as(x2, dt, place)
    zero, one = _ew._as(0, dt, place), _ew._as(1, dt, place)
    b = _ew.int_where(_ew._ewise_raw(_ew.EQ, b, zero), one, b)
    r = _ew._ewise_raw(_ew.REM, a, b)
    if dt == _dtypes.uint32:
        return r
    # r - b where r != 0 and sign(a) != sign(b) (|r| < |b|, same sign as b: no overflow)
    flip = _ew._ewise_raw(_ew.AND, _ew._ewise_raw(_ew.NE, r, zero),
                          _ew._ewise_raw(_ew.NE, _ew._ewise_raw(_ew.LT, a, zero),
                                         _ew._ewise_raw(_ew.LT, b, zero)))
    return _ew._ewise_raw(_ew.SUB, r, _ew._ewise_raw(_ew.MUL, _o._convert(flip, dt), b))


# --- ldexp and signbit: exact kernels ----------------------------------------------------------

def ldexp(x1, x2, /) -> Array:
    """``x1 * 2 ** x2`` for an integer ``x2`` (``jnp.ldexp``): exact, rounded once where the
    result is subnormal or overflows (``ldexpf``); ``x1`` integer / bool promotes to float32.
    A float ``x2`` raises ``ValueError``, as jnp. Gradient in ``x1``: ``2 ** x2``, and 1 where
    ``x1`` is 0 or ±inf (jax's ``where(isinf(x1) | (x1 == 0), x1, ...)``); none for ``x2``.
    (jax composes ldexp from ``frexp`` under XLA's flushing of subnormals, so jax returns 0
    for a subnormal result such as ``ldexp(1., -130)``; this returns the subnormal, as numpy.)"""
    if _any_abstract((x1, x2)):
        d2 = _ew.result_type(x2, who="ldexp")
        if d2 in _FLOATS:
            raise ValueError(f"ldexp not supported for input types ({x1.dtype if hasattr(x1, 'dtype') else type(x1).__name__}, {d2})")
        return _abstract((x1, x2), _float_result((x1,), "ldexp"))
    d2 = _ew.result_type(x2, who="ldexp")
    if d2 in _FLOATS:
        d1 = _ew.result_type(x1, who="ldexp")
        raise ValueError(f"ldexp not supported for input types ({np.dtype(d1)}, {np.dtype(d2)})")
    if isinstance(x2, Array):
        e = _o._convert(x2, _F32) if x2.dtype != _F32 else x2
    else:
        e = np.asarray(x2, np.int64).clip(-1024, 1024).astype(np.float32)
    return _ldexp(x1, e)


def _ldexp(x1, e):
    rdt = _float_result((x1,), "ldexp")
    x1 = _to_float(x1, rdt)
    if isinstance(x1, Array) and x1.dtype in _o._LOWP:
        return _o.astype(_ldexp_f32(_o.astype(x1, _F32), e), x1.dtype)
    if isinstance(x1, (np.ndarray, np.generic)) and x1.dtype in _o._LOWP:
        return _o.astype(_ldexp_f32(np.asarray(x1, np.float32), e), x1.dtype)
    return _ldexp_f32(x1, e)


def _ldexp_f32(x1, e) -> Array:
    def vjp_x(g, x, y, o):
        scale = _o._binary_raw(B_LDEXP, _const(x, 1.0), y)
        # 1 where x is 0 or ±inf (jax's where picks x itself there), else 2 ** x2
        fixed = _mask(_ew.logical_or(_ew.isinf(x), _ew.equal(x, 0.0)))  # (jax's test)
        return _o.multiply(g, _select_raw(fixed, _o._filled_like(x, 1.0), scale))
    return _o._binary(B_LDEXP, x1, e, vjp_x, None)


def signbit(x, /) -> Array:
    """Whether the sign bit of ``x`` is set (``jnp.signbit``): a bool Array, true at -0.0 and
    at a NaN with the sign bit (the bit itself, as jax's bitcast; exact); ints: ``x < 0``;
    bools: all false. Not differentiable (a bool result)."""
    if _any_abstract((x,)):
        return _abstract((x,), _dtypes.bool_)
    dt = _ew.result_type(x, who="signbit")
    place = _ew._place_for((x,))
    if dt == _dtypes.bool_:
        xa = _ew._as(x, dt, place)
        return _ew._ewise_raw(_ew.NE, xa, xa)          # all false, x's shape and sharding
    if dt in _dtypes.INTEGERS:
        return _ew.less(x, 0)
    return _o._convert(_signbit_f32(x), _dtypes.bool_)


def _signbit_f32(x) -> Array:
    """1.0 where the sign bit of ``x`` (a float operand) is set, else 0.0 (not recorded)."""
    if isinstance(x, Array):
        x._check_alive()
        if x.dtype != _F32:
            x = _o._convert(x, _F32)      # (16-bit to float32 keeps the sign, of NaN too)
    else:
        x = _o._lift(np.asarray(x, dtype=np.float32))
    return _o._unary_raw(U_SIGNBIT, x)


@_floating(2)
def copysign(x1, x2, /) -> Array:
    """``|x1|`` with the sign bit of ``x2`` (``jnp.copysign``: ``where(signbit(x2), -|x1|,
    |x1|)``; exact, signed zeros included: ``copysign(0., -1.)`` is -0.0). Gradient in ``x1``
    as jax's (``±sign`` of abs's derivative); none in ``x2``."""
    x1, x2 = _o._lift_pair(x1, x2)
    factor = _o._unary_raw(_o.U_AFFINE, _signbit_f32(x2), -2.0, 1.0)   # +1 or -1 (exact)
    return _o.multiply(_o.abs(x1), factor)


# --- compositions, as jax's ---------------------------------------------------------------------

@_floating(1)
def log2(x, /) -> Array:
    """Base-2 logarithm (``jnp.log2``: ``log(x) / log(2)``, a true division as jax's; within
    2 ulp); gradient by that composition."""
    x = _o._lift(x)
    return _o.divide(_o.log(x), _const(x, _LN2))


@_floating(1)
def log10(x, /) -> Array:
    """Base-10 logarithm (``jnp.log10``: ``log(x) * float32(1 / log(10))``; within 2 ulp)."""
    return _o.multiply(_o.log(x), _INV_LN10)


@_floating(1)
def deg2rad(x, /) -> Array:
    """Degrees to radians (``jnp.deg2rad`` / ``jnp.radians``: ``x * float32(pi / 180)``,
    one rounding)."""
    return _o.multiply(x, _DEG2RAD)


@_floating(1)
def rad2deg(x, /) -> Array:
    """Radians to degrees (``jnp.rad2deg`` / ``jnp.degrees``: ``x * float32(180 / pi)``)."""
    return _o.multiply(x, _RAD2DEG)


def radians(x, /) -> Array:
    """Alias of :func:`deg2rad` (``jnp.radians``)."""
    return deg2rad(x)


def degrees(x, /) -> Array:
    """Alias of :func:`rad2deg` (``jnp.degrees``)."""
    return rad2deg(x)


@_floating(1)
def sinc(x, /) -> Array:
    """The normalized sinc ``sin(pi x) / (pi x)``, 1 at 0 (``jnp.sinc``, jax's composition:
    ``pi * x`` in float32, the quotient where ``x != 0``). Gradient by the composition, 0 at
    0 (jax's Maclaurin rule)."""
    x = _o._lift(x)
    eq_zero = _ew.equal(x, 0.0)   # (a subnormal x counts as 0, as in jax: sinc is 1 there)
    pi_x = _o.multiply(x, _PI)
    safe = _o.where(eq_zero, 1.0, pi_x)
    return _o.where(eq_zero, 1.0, _o.divide(_o.sin(safe), safe))


@_floating(2)
def hypot(x1, x2, /) -> Array:
    """``sqrt(x1**2 + x2**2)`` without overflow (``jnp.hypot``, jax's composition: with
    ``a = max(|x1|, |x2|)``, ``b = min(...)``, ``a * sqrt(1 + (b / a)**2)``, 0 where
    ``a == 0``, inf where either is inf, NaN included). Within 2 ulp; gradient by the
    composition (``(0.5, 0.5)`` at the origin, as jax)."""
    x1, x2 = _o._lift_pair(x1, x2)
    a1, a2 = _o.abs(x1), _o.abs(x2)
    inf = float("inf")
    idx_inf = _ew.logical_or(_ew.equal(a1, inf), _ew.equal(a2, inf))
    big, small = _o.maximum(a1, a2), _o.minimum(a1, a2)
    is0 = _o._unary_raw(_o.U_AFFINE, _o._binary_raw(_o.B_GT, big, _const(big, 0.0)), -1.0, 1.0)
    # (1 where big == 0 or NaN: a NaN takes the first branch, NaN as well; subnormals are > 0)
    ratio = _o.divide(small, _o.where(is0, 1.0, big))
    x = _o.where(is0, big, _o.multiply(big, _o.sqrt(_o.add(1.0, _o.square(ratio)))))
    return _o.where(idx_inf, inf, x)


@_floating(2)
def heaviside(x1, x2, /) -> Array:
    """The Heaviside step (``jnp.heaviside``): 0 where ``x1 < 0``, 1 where ``x1 > 0``, ``x2``
    where ``x1 == 0``, NaN where ``x1`` is NaN. The gradient goes to ``x2`` where ``x1 == 0``
    (and to ``x1`` at its NaNs), as jax's nested ``where`` (a selected ``x2`` of -0.0 stays
    -0.0). A subnormal ``x1`` is its sign here (XLA flushes it:
    ``x2``)."""
    x1, x2 = _o._lift_pair(x1, x2)
    zero = _const(x1, 0.0)
    inner = _o.where(_ew.isnan(x1), x1, x2)
    return _o.where(_o._binary_raw(_o.B_GT, zero, x1), 0.0,
                    _o.where(_o._binary_raw(_o.B_GT, x1, zero), 1.0, inner))


def _fselect(x1, x2, less: bool) -> Array:
    x1, x2 = _o._lift_pair(x1, x2)
    gt = _o._binary_raw(_o.B_GT, x2, x1) if less else _o._binary_raw(_o.B_GT, x1, x2)
    mask = _o._binary_raw(_o.B_ADD, gt, _mask(_ew.isnan(x2)))   # 0 or 1 (gt is 0 at a NaN)
    return _o.where(mask, x1, x2)


@_floating(2)
def fmax(x1, x2, /) -> Array:
    """Elementwise maximum ignoring NaN (``jnp.fmax``: ``where((x1 > x2) | isnan(x2), x1,
    x2)``; NaN only where both are). The gradient goes to the selected operand (``x2`` at
    ties, as jax). The selected operand comes back bit for bit: ``fmax(0., -0.)`` is -0.0, as
    jax's."""
    return _fselect(x1, x2, False)


@_floating(2)
def fmin(x1, x2, /) -> Array:
    """Elementwise minimum ignoring NaN (``jnp.fmin``: ``where((x1 < x2) | isnan(x2), x1,
    x2)``; the gradient and the sign of a zero result as :func:`fmax`'s)."""
    return _fselect(x1, x2, True)


@_floating(2)
def float_power(x, y, /) -> Array:
    """``x ** y`` in floating point (``jnp.float_power``: ``lax.pow``, float32 here without
    x64; an integer exponent is a float exponent, not ``integer_pow``). Values and gradients
    as :func:`ctrainstate.numpy.power` with a float exponent."""
    if isinstance(y, (int, np.integer)) and not isinstance(y, (bool, np.bool_)):
        y = float(y)
    return _o.power(x, y)


# --- logaddexp / logaddexp2: jax's formula and custom derivative ----------------------------------

def _select_raw(mask: Array, a: Array, b: Array) -> Array:
    """``a`` where the float mask is 1, else ``b``, bit for bit (a -0.0 included; raw)."""
    not_m = _o._unary_raw(_o.U_AFFINE, mask, -1.0, 1.0)
    return _o._binary_raw(_o.B_ADD, _o._binary_raw(_o.B_PICK, a, mask),
                          _o._binary_raw(_o.B_PICK, b, not_m))


def _mask(boolean: Array) -> Array:
    return _o._convert(boolean, _F32)


def _replace_inf(v: Array) -> Array:
    """``where(v == inf, 0, v)`` (jax's ``_replace_inf``), raw."""
    return _select_raw(_mask(_ew.equal(v, float("inf"))), _o._filled_like(v, 0.0), v)


def _logaddexp_impl(x1, x2, base2: bool) -> Array:
    a, b = _o._lift_pair(x1, x2)
    amax = _o._binary_raw(_o.B_MAX, a, b)
    delta = _o._binary_raw(_o.B_SUB, a, b)
    neg = _o._unary_raw(_o.U_NEG, _o._unary_raw(_o.U_ABS, delta))
    if base2:
        tail = _o._unary_raw(_o.U_AFFINE, _o._unary_raw(_o.U_LOG1P, _o._unary_raw(U_EXP2, neg)),
                             _INV_LN2, -0.0)
    else:
        tail = _o._unary_raw(_o.U_LOG1P, _o._unary_raw(_o.U_EXP, neg))
    out = _select_raw(_mask(_ew.isnan(delta)), _o._binary_raw(_o.B_ADD, a, b),
                      _o._binary_raw(_o.B_ADD, amax, tail))
    expo = U_EXP2 if base2 else _o.U_EXP

    def vjp(g):
        ro = _replace_inf(out)

        def part(v):
            w = _o._unary_raw(expo, _o._binary_raw(_o.B_SUB, _replace_inf(v), ro))
            return _o._unbroadcast(_o.multiply(g, w), v.shape)
        return part(a), part(b)
    return _o._record(out, (a, b), vjp)


@_floating(2)
def logaddexp(x1, x2, /) -> Array:
    """``log(exp(x1) + exp(x2))`` without overflow (``jnp.logaddexp``, jax's formula:
    ``max + log1p(exp(-|x1 - x2|))``, and ``x1 + x2`` where the difference is NaN: a NaN
    operand, or infinities of one sign). Within 2 ulp of the float64 value away from
    cancellation. Gradient jax's custom rule ``exp(x - out)`` with +inf replaced by 0 (1 for
    each operand at ``(inf, inf)``)."""
    return _logaddexp_impl(x1, x2, False)


@_floating(2)
def logaddexp2(x1, x2, /) -> Array:
    """``log2(2**x1 + 2**x2)`` without overflow (``jnp.logaddexp2``: ``max + log1p(2**-|d|) /
    log(2)``, as :func:`logaddexp`); gradient ``2 ** (x - out)`` (jax's custom rule)."""
    return _logaddexp_impl(x1, x2, True)


# the select kernel call under jit: one node of the program (node.py; its callers record the
# derivative)
from .node import op_node as _op_node  # noqa: E402

_select_raw = _op_node("_select_raw", raw=True)(_select_raw)
