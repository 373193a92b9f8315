"""More ``jax.random`` samplers: deterministic transforms of uniform / normal draws.

Imported by :mod:`ctrainstate.random` (use them from there). Each sampler draws JAX's words
with the same key, shape and dtype as ``jax.random`` (0.10.2) and applies JAX's formula op by
op in float32, rounded to the sampling dtype after every op (XLA's CPU rule for float16 /
bfloat16 arithmetic), with XLA's float32 ``log``/``log1p`` from the C core.

How close to JAX (measured against jax 0.10.2 on CPU; tests/random/test_random_dist.py):

- float32, bit-identical: exponential, laplace, logistic, rademacher, rayleigh, triangular,
  geometric (formulas of correctly rounded ops and log/log1p).
- float32, within a few ulp: cauchy (``tan``), lognormal and pareto (``exp``), weibull_min
  (``pow``; computed in float64 and rounded, XLA's are not correctly rounded), maxwell and
  double_sided_maxwell (XLA sums the three squares in its own order), wald (the same ops, but
  its cancellation ``mean + .. - ..`` magnifies one-ulp differences to ~1e-5 relative).
- float16 / bfloat16: mostly the same bits, else within a few ulp of the 16-bit dtype (up to
  ~10 ulp in logistic's far tail): XLA keeps excess float32 precision between some fused
  16-bit ops (which ones depends on its fusion), so per-op rounding does not always reproduce
  it (geometric may then differ by one
  where ``log(u) / log1p(-p)`` lands on an integer).

The elementwise samplers accept ``out_sharding=``: each device computes only its own block
(from its own elements' words; parameters are broadcast to the global shape and sliced), so the
values are the same on every mesh. ``multivariate_normal`` and ``orthogonal`` factorise
matrices (numpy LAPACK, within rounding of JAX's) and are placed with ``device_put``.

The gamma family (gamma, loggamma, beta, dirichlet, chisquare, f, t, generalized_normal, ball)
is in gamma.py; poisson, binomial and multinomial in discrete.py.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from ... import _C
from ..base import dtypes as _dtypes
from .core import (_BERNOULLI, _NORMAL, _UNIFORM, _float_dtype, _key_words, _produce, _shape,
                   _xla_log, split)
from ..array.abstract import is_abstract, ShapeDtypeStruct
from .core import normal
from ..array.array import device_put

__all__ = [
    "exponential", "laplace", "logistic", "cauchy", "rademacher", "lognormal", "maxwell",
    "double_sided_maxwell", "weibull_min", "pareto", "rayleigh", "wald", "triangular",
    "geometric", "multivariate_normal", "orthogonal",
]

_F32 = np.dtype(np.float32)
_HALF = (_dtypes.float16, _dtypes.bfloat16)


# --- helpers ----------------------------------------------------------------------------

def _draw(kw, dist, dt, gshape, start, blk, minval=0.0, maxval=1.0, p=0.0):
    """This block's elements of uniform / normal(key, gshape, dt) (or bernoulli), as float32."""
    out = np.empty(blk, _dtypes.bool_ if dist == _BERNOULLI else dt)
    _C.random_fill(out, kw[0], kw[1], tuple(gshape), tuple(start), dist, _dtypes.code(dt),
                   float(minval), float(maxval), 0.0, 0.0, float(p), None)
    return out if dist == _BERNOULLI else out.astype(_F32)


def _rounder(dt):
    """float32 -> dt -> float32: XLA rounds each float16/bfloat16 op's result to dt."""
    if dt == _F32:
        return lambda v: np.asarray(v, _F32)
    return lambda v: np.asarray(v, _F32).astype(dt).astype(_F32)


def _f64(fn, x):
    """A transcendental function in float64, rounded to float32 (XLA's is within a few ulp)."""
    with np.errstate(all="ignore"):
        return fn(np.asarray(x, np.float64)).astype(_F32)


def _log(x):
    return _xla_log(np.asarray(x, _F32), 0)


def _log1p(x):
    return _xla_log(np.asarray(x, _F32), 1)


def _fma(a, b, c):
    """float32 ``fmaf(a, b, c)``, rounded once (XLA's CPU code contracts multiply-adds into
    FMAs): the exact product plus ``c`` in float64, rounded to odd, so that the final
    rounding to float32 is not a double rounding (subnormal results included)."""
    a, b, c = (np.asarray(v, np.float64) for v in (a, b, c))
    with np.errstate(all="ignore"):
        p = a * b                                   # exact (24 + 24 bits)
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)             # Knuth's TwoSum: p + c == s + err exactly
        even = (np.ascontiguousarray(s).view(np.int64) & 1) == 0
        fix = even & (err != 0) & np.isfinite(s)
        s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(_F32)


def _is_weak(v) -> bool:
    """A Python scalar: weakly typed in JAX (takes the other operand's dtype)."""
    return isinstance(v, (int, float)) and not isinstance(v, (np.generic, bool))


def _param(v, name):
    """A real-valued parameter as a numpy array (float64 narrowed to float32, as JAX). A
    ShapeDtypeStruct stands for an array only under eval_shape, as zeros of its shape and
    dtype (they shape the abstract result); anywhere else it has no values and is refused."""
    if isinstance(v, ShapeDtypeStruct):
        if not is_abstract():
            raise TypeError(f"{name}: a ShapeDtypeStruct has no values (use it under "
                            f"eval_shape)")
        a = np.broadcast_to(np.zeros((), v.dtype), v.shape)
    else:
        a = np.asarray(v)
    if a.dtype.kind not in "biuf" and a.dtype not in _HALF:
        raise TypeError(f"{name} must be real-valued, got dtype {a.dtype}"
                        + (" (jax would drop the imaginary part)" if a.dtype.kind == "c" else ""))
    if a.dtype in _dtypes._NARROW:
        a = a.astype(_dtypes._NARROW[a.dtype])
    return a


def _float_of(v):
    """The float dtype a parameter carries in JAX's promotion, or None (weak / integer)."""
    if _is_weak(v):
        return None
    a = _param(v, "parameter")
    return a.dtype if (a.dtype.kind == "f" or a.dtype in _HALF) else None


def _promote(dt, *params):
    """JAX's result dtype of ``dt`` op params: equal floats stay, mixed floats give float32."""
    for v in params:
        pd = _float_of(v)
        if pd is not None and pd != dt:
            dt = _F32
    return np.dtype(dt)


def _check_cast(name, dt, *params):
    """JAX's _check_all_safe_to_cast: a float parameter must not be wider than ``dt``."""
    for v in params:
        pd = _float_of(v)
        if pd is not None and _promote(dt, v) != dt:
            raise ValueError(f"In arguments to {name}, cannot safely cast argument of type "
                             f"{pd} to {dt}")


def _broadcast(*shapes):
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ValueError(f"Incompatible shapes for broadcasting: shapes={list(shapes)}") from None


def _check_shape(name, shape, *param_shapes):
    if param_shapes:
        res = _broadcast(shape, *param_shapes)
        if res != shape:
            raise ValueError(
                f"{name} parameter shapes must be broadcast-compatible with shape argument, "
                f"and the result of broadcasting the shapes must equal the shape argument, "
                f"but got result {res} for shape argument {shape}.")


def _result_shape(name, shape, *params):
    """JAX's _check_broadcast_shapes: shape=None broadcasts the parameters' shapes."""
    pshapes = [np.shape(p) for p in params]
    if shape is None:
        return _broadcast(*pshapes) if pshapes else ()
    shape = _shape(shape)
    _check_shape(name, shape, *pshapes)
    return shape


def _block(v, dt, gshape, start, blk):
    """Parameter ``v`` converted to ``dt``, broadcast to the global shape, sliced to a block."""
    with np.errstate(over="ignore"):             # (n > 65504 is inf in float16, as in jax)
        a = np.asarray(v).astype(dt).astype(_F32)
    a = np.broadcast_to(a, gshape)
    return a[tuple(slice(s, s + b) for s, b in zip(start, blk))]


def _elementwise(shape, out_dt, out_sharding, compute):
    """``compute(gshape, start, blk)`` gives a block of the result; run it per host / device."""
    def fill(out, gshape, start):
        blk = tuple(out.shape)
        res = np.asarray(compute(tuple(gshape), tuple(start), blk)).astype(out_dt)
        if isinstance(out, np.ndarray):
            out[...] = res
        else:
            _C.copy_from_host(out, res.view(np.uint8) if out_dt == _dtypes.bool_ else res,
                              (0,) * len(blk))
    if out_sharding is not None:
        _dtypes.canonicalize(out_dt)   # a clear error for dtypes Arrays do not store
    return _produce(shape, out_dt, out_sharding, fill)


def _int_dtype(dtype, name, default=np.int32) -> np.dtype:
    dt = np.dtype(default if dtype is None else dtype)
    if dt == np.int64:
        dt = np.dtype(np.int32)   # as JAX with x64 off
    if dt == np.uint64:
        dt = np.dtype(np.uint32)
    if dt.kind not in "iu":
        raise ValueError(f"dtype argument to `{name}` must be an int dtype, got {dt}")
    return dt


def _to_int(x, dt):
    """XLA's float -> int conversion: saturating, NaN -> 0."""
    info = np.iinfo(dt)
    x = np.asarray(x, np.float64)       # (INT_MAX is not a float32: clip in float64)
    return np.where(np.isnan(x), 0, np.clip(x, info.min, info.max)).astype(dt)


# --- samplers built on uniform ------------------------------------------------------------

def exponential(k, shape=(), dtype=None, *, out_sharding=None):
    """Standard exponential floats, as jax.random.exponential: ``-log1p(-uniform(k, shape))``.
    Bit-identical to JAX in float32 (XLA's log1p).

    >>> from ctrainstate import random
    >>> x = random.exponential(random.PRNGKey(0), (10000,))
    >>> bool(x.min() >= 0) and abs(float(x.mean()) - 1) < 0.05
    True
    """
    dt = _float_dtype(dtype, "exponential")
    shape, kw = _shape(shape), _key_words(k)
    r = _rounder(dt)

    def compute(g, s, b):
        return -r(_log1p(-_draw(kw, _UNIFORM, dt, g, s, b)))
    return _elementwise(shape, dt, out_sharding, compute)


def laplace(k, shape=(), dtype=None, *, out_sharding=None):
    """Standard Laplace floats, as jax.random.laplace: ``sign(u) * log1p(-|u|)`` with
    ``u = uniform(k, shape, minval=-1 + epsneg, maxval=1)``. Bit-identical to JAX in float32.

    >>> from ctrainstate import random
    >>> abs(float(random.laplace(random.PRNGKey(0), (10000,)).mean())) < 0.05
    True
    """
    dt = _float_dtype(dtype, "laplace")
    shape, kw = _shape(shape), _key_words(k)
    r = _rounder(dt)
    lo = -1.0 + float(ml_dtypes.finfo(dt).epsneg)

    def compute(g, s, b):
        u = _draw(kw, _UNIFORM, dt, g, s, b, lo, 1.0)
        return np.sign(u) * r(_log1p(-np.abs(u)))
    return _elementwise(shape, dt, out_sharding, compute)


def logistic(k, shape=(), dtype=None, *, out_sharding=None):
    """Standard logistic floats, as jax.random.logistic: ``log(x) - log1p(-x)`` with
    ``x = uniform(k, shape, minval=tiny, maxval=1)``. Bit-identical to JAX in
    float32.

    >>> from ctrainstate import random
    >>> abs(float(random.logistic(random.PRNGKey(0), (10000,)).mean())) < 0.1
    True
    """
    dt = _float_dtype(dtype, "logistic")
    shape, kw = _shape(shape), _key_words(k)
    r = _rounder(dt)
    tiny = float(ml_dtypes.finfo(dt).tiny)

    def compute(g, s, b):
        x = _draw(kw, _UNIFORM, dt, g, s, b, tiny, 1.0)
        return r(r(_log(x)) - r(_log1p(-x)))
    return _elementwise(shape, dt, out_sharding, compute)


def cauchy(k, shape=(), dtype=None, *, out_sharding=None):
    """Standard Cauchy floats, as jax.random.cauchy: ``tan(pi * (u - 0.5))`` with
    ``u = uniform(k, shape, minval=eps, maxval=1)``. Within a few ulp of JAX (``tan``).

    >>> import numpy as np
    >>> from ctrainstate import random
    >>> float(np.median(random.cauchy(random.PRNGKey(0), (10001,)))) ** 2 < 0.01
    True
    """
    dt = _float_dtype(dtype, "cauchy")
    shape, kw = _shape(shape), _key_words(k)
    r = _rounder(dt)
    eps = float(ml_dtypes.finfo(dt).eps)
    pi = r(np.float32(np.pi))

    def compute(g, s, b):
        u = _draw(kw, _UNIFORM, dt, g, s, b, eps, 1.0)
        return r(_f64(np.tan, r(pi * r(u - np.float32(0.5)))))
    return _elementwise(shape, dt, out_sharding, compute)


def rademacher(k, shape=(), dtype=None, *, out_sharding=None):
    """Random signs -1 / +1 (default int32), as jax.random.rademacher:
    ``2 * bernoulli(k, 0.5, shape) - 1``. Bit-identical to JAX.

    >>> from ctrainstate import random
    >>> sorted(set(random.rademacher(random.PRNGKey(0), (100,)).tolist()))
    [-1, 1]
    """
    if dtype is not None and (np.dtype(dtype) in _HALF or np.dtype(dtype).kind == "f"):
        dt = _float_dtype(dtype, "rademacher")
    else:
        dt = _int_dtype(dtype, "rademacher")
    shape, kw = _shape(shape), _key_words(k)

    def compute(g, s, b):
        bern = _draw(kw, _BERNOULLI, _F32, g, s, b, p=0.5)
        with np.errstate(over="ignore"):
            return (2 * bern.astype(dt) - dt.type(1)).astype(dt)
    return _elementwise(shape, dt, out_sharding, compute)


def weibull_min(k, scale, concentration, shape=(), dtype=None, *, out_sharding=None):
    """Weibull floats, as jax.random.weibull_min:
    ``(-log1p(-uniform(k, shape))) ** (1 / concentration) * scale``. Within a few ulp of JAX
    (``pow``). As in JAX the result is ``shape`` broadcast with the parameters' shapes, in the
    dtype that ``dtype`` and the parameters promote to (``out_sharding``, an extension: the
    parameters must broadcast to ``shape``).

    >>> from ctrainstate import random
    >>> bool(random.weibull_min(random.PRNGKey(0), 1.0, 2.0, (100,)).min() >= 0)
    True
    """
    dt = _float_dtype(dtype, "weibull_min")
    shape, kw = _shape(shape), _key_words(k)
    sc, co = _param(scale, "scale"), _param(concentration, "concentration")
    oshape = _broadcast(shape, sc.shape, co.shape)
    if out_sharding is not None:
        _check_shape("weibull_min", shape, sc.shape, co.shape)
    # 1.0 / concentration: a weak Python float, or an array (float32 for integer arrays)
    cdt = None if _is_weak(concentration) else (_float_of(concentration) or _F32)
    pdt = dt if cdt is None or cdt == dt else _F32     # pow's dtype
    odt = _promote(pdt, scale)                         # the result's
    r, rp, ro = _rounder(dt), _rounder(pdt), _rounder(odt)

    def compute(g, s, b):
        if g == shape:
            u = _draw(kw, _UNIFORM, dt, g, s, b)
        else:   # the parameters widen the result (host only): the whole uniform, broadcast
            u = np.broadcast_to(_draw(kw, _UNIFORM, dt, shape, (0,) * len(shape), shape), g)
        base = -r(_log1p(-u))
        if cdt is None:
            e = np.asarray(1.0 / float(concentration)).astype(pdt).astype(_F32)
        else:
            e = _rounder(cdt)(np.float32(1.0) / _block(co, cdt, g, s, b))
        y = rp(_f64(lambda t: np.power(t[0], t[1]), np.broadcast_arrays(base, e)))
        return ro(y * _block(sc, odt, g, s, b))
    if out_sharding is None and oshape != shape:
        return compute(oshape, (0,) * len(oshape), oshape).astype(odt)
    return _elementwise(shape, odt, out_sharding, compute)


def pareto(k, b, shape=None, dtype=None, *, out_sharding=None):
    """Pareto floats, as jax.random.pareto: ``exp(exponential(k, shape) / b)``.
    Within a few ulp of JAX (``exp``).

    >>> from ctrainstate import random
    >>> bool(random.pareto(random.PRNGKey(0), 3.0, (100,)).min() >= 1)
    True
    """
    dt = _float_dtype(dtype, "pareto")
    bp = _param(b, "b")
    shape = _result_shape("pareto", shape, bp)
    _check_cast("pareto", dt, b)
    kw = _key_words(k)
    r = _rounder(dt)

    def compute(g, s, blk):
        e = -r(_log1p(-_draw(kw, _UNIFORM, dt, g, s, blk)))
        return r(_f64(np.exp, r(e / _block(bp, dt, g, s, blk))))
    return _elementwise(shape, dt, out_sharding, compute)


def rayleigh(k, scale, shape=None, dtype=None, *, out_sharding=None):
    """Rayleigh floats, as jax.random.rayleigh: ``scale * sqrt(-2 * log(uniform(k, shape)))``.
    Bit-identical to JAX in float32.

    >>> from ctrainstate import random
    >>> bool(random.rayleigh(random.PRNGKey(0), 2.0, (100,)).min() >= 0)
    True
    """
    dt = _float_dtype(dtype, "rayleigh")
    sp = _param(scale, "scale")
    shape = _result_shape("rayleigh", shape, sp)
    _check_cast("rayleigh", dt, scale)
    kw = _key_words(k)
    r = _rounder(dt)

    def compute(g, s, b):
        u = _draw(kw, _UNIFORM, dt, g, s, b)
        with np.errstate(invalid="ignore"):
            root = r(np.sqrt(r(_log(u)) * np.float32(-2)))
        return r(_block(sp, dt, g, s, b) * root)
    return _elementwise(shape, dt, out_sharding, compute)


def triangular(k, left, mode, right, shape=None, dtype=None, *, out_sharding=None):
    """Triangular floats on ``[left, right]`` peaking at ``mode``, as jax.random.triangular
    (inverse CDF of one uniform; the same ops in the same order). Bit-identical to JAX in
    float32.

    >>> from ctrainstate import random
    >>> x = random.triangular(random.PRNGKey(0), -1.0, 0.0, 2.0, (100,))
    >>> bool(x.min() >= -1 and x.max() <= 2)
    True
    """
    dt = _float_dtype(dtype, "triangular")
    ps = [_param(v, n) for v, n in ((left, "left"), (mode, "mode"), (right, "right"))]
    shape = _result_shape("triangular", shape, *ps)
    _check_cast("triangular", dt, left, mode, right)
    kw = _key_words(k)
    r = _rounder(dt)

    def compute(g, s, b):
        lo, md, hi = (_block(p, dt, g, s, b) for p in ps)
        with np.errstate(all="ignore"):
            fc = r(r(md - lo) / r(hi - lo))
            u = _draw(kw, _UNIFORM, dt, g, s, b)
            out1 = r(lo + r(np.sqrt(r(r(u * r(hi - lo)) * r(md - lo)))))
            out2 = r(hi - r(np.sqrt(r(r(r(np.float32(1) - u) * r(hi - lo)) * r(hi - md)))))
        return np.where(u < fc, out1, out2)
    return _elementwise(shape, dt, out_sharding, compute)


def geometric(k, p, shape=None, dtype=None, *, out_sharding=None):
    """Geometric integers (trials to the first success, >= 1; default int32), as
    jax.random.geometric: ``floor(log(u) / log1p(-p)) + 1``, ``u = uniform(k, shape)`` in p's
    float dtype (float32 for Python numbers) with 0 mapped to 1. Bit-identical to
    JAX for float32 ``p`` (float -> int saturates as XLA's convert).

    >>> from ctrainstate import random
    >>> bool(random.geometric(random.PRNGKey(0), 0.3, (100,)).min() >= 1)
    True
    """
    dt = _int_dtype(dtype, "geometric")
    pp = _param(p, "p")
    pdt = _float_of(p) or _F32
    shape = _result_shape("geometric", shape, pp)
    kw = _key_words(k)
    r = _rounder(pdt)

    def compute(g, s, b):
        u = _draw(kw, _UNIFORM, pdt, g, s, b)
        u = np.where(u == 0, np.float32(1), u)
        l1p = r(_log1p(-_block(pp, pdt, g, s, b)))
        with np.errstate(all="ignore"):
            q = r(np.floor(r(r(_log(u)) / l1p)) + np.float32(1))
        return _to_int(q, dt)
    return _elementwise(shape, dt, out_sharding, compute)


def wald(k, mean, shape=None, dtype=None, *, out_sharding=None):
    """Wald (inverse Gaussian, scale 1) floats, as jax.random.wald: Michael, Schucany and
    Haas's transform of ``normal(k1)`` and ``uniform(k2)``, ``k1, k2 = split(k)``, with JAX's
    ops in JAX's order. Within ~1e-5 relative of JAX in float32 (its cancellation magnifies
    ulp differences of the intermediate ops).

    >>> from ctrainstate import random
    >>> bool(random.wald(random.PRNGKey(0), 1.5, (100,)).min() > 0)
    True
    """
    dt = _float_dtype(dtype, "wald")
    mp = _param(mean, "mean")
    shape = _result_shape("wald", shape, mp)
    _check_cast("wald", dt, mean)
    k1, k2 = (_key_words(x) for x in split(k))
    r = _rounder(dt)
    two, four = np.float32(2), np.float32(4)

    def compute(g, s, b):
        mu = _block(mp, dt, g, s, b)
        v = _draw(k1, _NORMAL, dt, g, s, b)
        z = _draw(k2, _UNIFORM, dt, g, s, b)
        with np.errstate(all="ignore"):
            y = r(v * v)
            y_sq = r(y * y)
            mean_sq = r(mu * mu)
            sqrt_term = r(np.sqrt(r(r(r(four * mu) * y) + r(mean_sq * y_sq))))
            x = r(r(mu + r(r(mean_sq * y) / two)) - r(r(mu / two) * sqrt_term))
            return np.where(z <= r(mu / r(mu + x)), x, r(mean_sq / x))
    return _elementwise(shape, dt, out_sharding, compute)


# --- samplers built on normal --------------------------------------------------------------

def lognormal(k, sigma=np.float32(1), shape=None, dtype=None, *, out_sharding=None):
    """Log-normal floats, as jax.random.lognormal: ``exp(sigma * normal(k, shape))``.
    Within a few ulp of JAX (``exp``).

    >>> from ctrainstate import random
    >>> bool(random.lognormal(random.PRNGKey(0), 0.5, (100,)).min() > 0)
    True
    """
    dt = _float_dtype(dtype, "lognormal")
    sp = _param(sigma, "sigma")
    shape = _result_shape("lognormal", shape, sp)
    _check_cast("lognormal", dt, sigma)
    kw = _key_words(k)
    r = _rounder(dt)

    def compute(g, s, b):
        z = r(_draw(kw, _NORMAL, dt, g, s, b) * _block(sp, dt, g, s, b))
        return r(_f64(np.exp, z))
    return _elementwise(shape, dt, out_sharding, compute)


def _maxwell_block(kw, dt, g, s, b):
    """This block of maxwell(k, g, dt): the norm of the last axis of normal(k, (*g, 3))."""
    r = _rounder(dt)
    n = _draw(kw, _NORMAL, dt, tuple(g) + (3,), tuple(s) + (0,), tuple(b) + (3,))
    sq = r(n * n)
    # jnp.sum upcasts 16-bit floats to float32 (XLA's order of the three adds is its own)
    tot = r((sq[..., 0] + sq[..., 1]) + sq[..., 2])
    return r(np.sqrt(tot))


def maxwell(k, shape=(), dtype=None, *, out_sharding=None):
    """One-sided Maxwell floats, as jax.random.maxwell: the norm of three normals,
    ``normal(k, (*shape, 3))``. Within an ulp of JAX (the order XLA sums the squares in).

    >>> from ctrainstate import random
    >>> bool(random.maxwell(random.PRNGKey(0), (100,)).min() >= 0)
    True
    """
    dt = _float_dtype(dtype, "maxwell")
    shape, kw = _shape(shape), _key_words(k)
    return _elementwise(shape, dt, out_sharding, lambda g, s, b: _maxwell_block(kw, dt, g, s, b))


def double_sided_maxwell(k, loc, scale, shape=(), dtype=None, *, out_sharding=None):
    """Double-sided Maxwell floats, as jax.random.double_sided_maxwell:
    ``rademacher(k2) * maxwell(k1) * scale + loc``, ``k1, k2 = split(k)``. Within a few ulp of
    JAX (see :func:`maxwell`). As in JAX the sample shape is ``shape + broadcast(loc.shape, scale.shape)`` (and
    ``shape=()`` means the parameters' shape alone), in the dtype ``dtype`` and the parameters
    promote to. ``out_sharding`` is an extension (jax has none here).

    >>> from ctrainstate import random
    >>> x = random.double_sided_maxwell(random.PRNGKey(0), 0.0, 1.0, (1000,))
    >>> bool((x < 0).any() and (x > 0).any())
    True
    """
    dt = _float_dtype(dtype, "double_sided_maxwell")
    shape = _shape(shape)
    lp, sp = _param(loc, "loc"), _param(scale, "scale")
    pshape = _broadcast(lp.shape, sp.shape)
    if not shape:
        shape = pshape
    shape = shape + pshape
    km, kr = (_key_words(x) for x in split(k))
    odt = _promote(_promote(dt, scale), loc)
    r = _rounder(dt)
    r1, r2 = _rounder(_promote(dt, scale)), _rounder(odt)

    def compute(g, s, b):
        m = _maxwell_block(km, dt, g, s, b)
        sign = r(2 * _draw(kr, _BERNOULLI, _F32, g, s, b, p=0.5).astype(_F32) - 1)
        sdt, ldt = _promote(dt, scale), odt
        y = r1(r(sign * m) * _block(sp, sdt, g, s, b))
        return r2(y + _block(lp, ldt, g, s, b))
    return _elementwise(shape, odt, out_sharding, compute)


# --- samplers that factorise matrices -------------------------------------------------------

def _placed(x, out_sharding):
    if out_sharding is None:
        return x
    return device_put(x, out_sharding)


def multivariate_normal(k, mean, cov, shape=None, dtype=None, method: str = "cholesky", *,
                        out_sharding=None):
    """Multivariate normal vectors, as jax.random.multivariate_normal:
    ``mean + factor @ normal(k, (*shape, n))`` with ``factor`` the Cholesky factor of ``cov``
    (``method='cholesky'``, JAX's default), ``u * sqrt(s)`` of its SVD (``'svd'``) or
    ``v * sqrt(w)`` of its eigendecomposition (``'eigh'``). The normal draws are JAX's bits;
    the factorisation and product are numpy's (LAPACK, float32), so the values equal JAX's
    to float32 rounding for 'cholesky', and for 'svd'/'eigh' wherever LAPACK picks the same
    singular / eigen vectors (their signs are not unique). As in JAX a covariance that is not
    positive definite gives NaNs with 'cholesky'. Computed on the host; placed with
    ``device_put`` when ``out_sharding`` is given.

    >>> import numpy as np
    >>> from ctrainstate import random
    >>> x = random.multivariate_normal(random.PRNGKey(0), np.zeros(2), np.eye(2), (1000,))
    >>> x.shape
    (1000, 2)
    """
    if method not in ("svd", "eigh", "cholesky"):
        raise ValueError("method must be one of {'svd', 'eigh', 'cholesky'}")
    mean, cov = _param(mean, "mean"), _param(cov, "cov")
    fm, fc = _float_of(mean), _float_of(cov)     # promote_dtypes_inexact(mean, cov)
    base = _F32 if fm is None and fc is None else np.dtype(fm or fc)
    if fm is not None and fc is not None and fm != fc:
        base = _F32
    dt = base if dtype is None else _float_dtype(dtype, "multivariate_normal")
    if mean.ndim < 1:
        raise ValueError(f"multivariate_normal requires mean.ndim >= 1, got mean.ndim == "
                         f"{mean.ndim}")
    if cov.ndim < 2:
        raise ValueError(f"multivariate_normal requires cov.ndim >= 2, got cov.ndim == "
                         f"{cov.ndim}")
    n = mean.shape[-1]
    if cov.shape[-2:] != (n, n):
        raise ValueError(f"multivariate_normal requires cov.shape == (..., n, n) for n={n}, "
                         f"but got cov.shape == {cov.shape}.")
    if shape is None:
        shape = _broadcast(mean.shape[:-1], cov.shape[:-2])
    else:
        shape = _shape(shape)
        _check_shape("normal", shape, mean.shape[:-1], cov.shape[:-2])
    c = cov.astype(base).astype(_F32)
    with np.errstate(all="ignore"):
        if method == "cholesky":
            c = (c + np.swapaxes(c, -1, -2)) / np.float32(2)
            factor = _cholesky_or_nan(c)
        elif method == "svd":
            u, s_, _ = np.linalg.svd(c)
            factor = u * np.sqrt(s_[..., None, :])
        else:
            w, v = np.linalg.eigh(c)
            factor = v * np.sqrt(w[..., None, :])
        z = normal(k, shape + (n,), dt).astype(_F32)
        odt = base if base == dt else _F32
        factor = factor.astype(base).astype(_F32)
        out = mean.astype(base).astype(_F32) + np.einsum("...ij,...j->...i", factor, z)
    return _placed(out.astype(odt), out_sharding)


def _cholesky_or_nan(c):
    """Lower Cholesky factors of a stack of matrices; NaN where one is not positive definite
    (jnp.linalg.cholesky's result, where numpy raises)."""
    flat = c.reshape((-1,) + c.shape[-2:])
    out = np.empty_like(flat)
    for i, m in enumerate(flat):
        try:
            out[i] = np.linalg.cholesky(m)
        except np.linalg.LinAlgError:
            out[i] = np.nan
    return out.reshape(c.shape)


def orthogonal(k, n: int, shape=(), dtype=None, m: int | None = None, *, out_sharding=None):
    """Uniformly (Haar) distributed ``n x m`` matrices with orthonormal columns or rows
    (``m=None``: ``n x n``), as jax.random.orthogonal: the Q of the QR factorisation of
    ``normal(k, (*shape, max(n, m), min(n, m)))``, columns multiplied by the signs of R's
    diagonal, transposed when ``n < m``. The normal draws are JAX's bits; the QR is numpy's
    (LAPACK, float32), so the values equal JAX's to float32 rounding. Computed on the host;
    placed with ``device_put`` when ``out_sharding`` is given.

    >>> import numpy as np
    >>> from ctrainstate import random
    >>> q = random.orthogonal(random.PRNGKey(0), 3)
    >>> bool(np.allclose(q @ q.T, np.eye(3), atol=1e-5))
    True
    """
    shape = _shape(shape)
    dt = _float_dtype(dtype, "orthogonal")
    mm = n if m is None else m
    for v, name in ((n, "n"), (mm, "m")):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
            raise TypeError(f"orthogonal: {name} must be a non-negative integer, got {v!r}")
    n, mm = int(n), int(mm)
    z = normal(k, (*shape, max(n, mm), min(n, mm)), dt).astype(_F32)
    if z.size == 0:
        x = np.zeros(z.shape, _F32)
    else:
        q, rr = np.linalg.qr(z)
        d = np.diagonal(rr, axis1=-2, axis2=-1)
        x = q * np.expand_dims(np.sign(d), -2)
    if n < mm:
        x = np.swapaxes(x, -1, -2)
    return _placed(np.ascontiguousarray(x.astype(dt)), out_sharding)


del math


# under jit, each draw given a traced key is one op node of the program (ops/node.py): its key
# is read at each call, and a numpy result comes back as an Array where the key lives
from ..ops.node import op_node as _op_node  # noqa: E402
from .core import _on_key_placement  # noqa: E402

for _name in __all__:
    globals()[_name] = _op_node("random." + _name, _on_key_placement)(globals()[_name])
del _name
