"""jax.random's gamma family: gamma, loggamma, beta, dirichlet, chisquare, f, t,
generalized_normal and ball.

Imported by :mod:`ctrainstate.random`. JAX (0.10.2) samples gamma element by element:
element ``i`` of ``gamma(key, a, shape)`` runs Marsaglia and Tsang's rejection loop
(``_gamma_one``) with its own key ``split(key, prod(shape))[i]``, drawing scalar normals and
uniforms from keys it splits off as it goes, and boosts ``a < 1`` to ``a + 1`` (times
``u ** (1 / a)``, or ``+ log(u) / a`` in log space). This file runs the same loop for all
elements at once: each round draws only for the elements still rejecting (an ``active``
index array); the keys it splits and the uniforms and normals it draws under arrays of keys
come from the C core (``_C.keys_split``, ``_C.random_keyed``), the rest of each round is
numpy. Every op is JAX's, in JAX's order, as XLA's CPU backend computes
it: float32 multiply-adds fused where LLVM fuses them, ``a / sqrt(b)`` rewritten as
``a * rsqrt(b)`` and ``(a / b) / (c / d)`` as ``(a * d) / (b * c)`` (not for bfloat16),
subnormal results flushed to zero, XLA's ``exp`` reproduced (``_exp``), ``pow`` libm's powf
(``_pow``);
float16 / bfloat16 values rounded after each op (bfloat16 keeps float32 where XLA does).

How close to JAX (measured against jax 0.10.2 on an AMD EPYC CPU, 100 000 samples per
sampler with random parameters; tests/random/test_random_gamma.py asserts it):

- float16 and bfloat16: bit-identical, except ball (within 2 ulp: XLA's fused reduction
  keeps float32 values and has its own math), dirichlet on large arrays (XLA
  hands the softmax of more than ~15 000 bfloat16 elements to YNNPACK: within 2**-7) and
  generalized_normal with a float16 *array* ``p`` (93% the same bits; within 2 ulp, more
  where the gamma draw is a float16 subnormal).
- float32: one constant is not reproducible across CPUs. JAX's ``c = 1 / (3 sqrt(d))``,
  ``d = a - 1/3``, uses XLA's rsqrt, which refines the CPU's ``rsqrtss`` estimate (Intel's
  and AMD's differ) by one Newton step; ``_rsqrt`` is the correctly rounded value. Where the
  two agree (about 84% of values of ``a`` here), every sample is bit-identical; where they
  differ by an ulp, 1-5% of the samples differ: gamma, beta, chisquare, f and
  generalized_normal within 6e-6 relative, loggamma within 5e-7 of ``max(|x|, 1)``, t within
  2e-6. With XLA's rsqrt substituted (the tests do), all of these are bit-identical.
  Besides: dirichlet is bit-identical for arrays up to ~1 000 elements (beyond, XLA runs its
  softmax in YNNPACK: within 6e-6 relative); ball is bit-identical in small programs (a few
  hundred points) and within 3 ulp in larger ones, where XLA's fused reduction computes the
  exponential's log1p with other code.

The results do not depend on the host CPU: ``pow`` is the C library's powf called from the
C core (``_C.xla_pow``), not numpy's float32 power, whose AVX-512 code differs from powf in
the last bit; the other float32 steps are exact IEEE operations or XLA's own
approximations written out (``_exp``, ``_C.xla_math``). The one CPU-dependent quantity is
on JAX's side: its rsqrt estimate, above.

Every element is a pure function of (key, global index) (dirichlet and ball: of its row),
so with ``out_sharding=`` each device computes only its own block (its whole rows, for
dirichlet and ball) and the values are the same on every mesh.

Gradients: jax differentiates gamma (and what is built on it) with respect to its
parameters (implicit reparameterisation). ctrainstate does not: a parameter that
``value_and_grad`` / ``grad`` is differentiating raises ``NotImplementedError`` instead of
silently getting a zero gradient; ``lax.stop_gradient`` of it samples without one.
"""
from __future__ import annotations

import operator

import numpy as np

from ... import _C
from ..base import dtypes as _dtypes
from .dist import (_F32, _HALF, _block, _check_cast, _check_shape, _draw, _fma, _elementwise,
                   _float_of, _is_weak, _log, _log1p, _param, _result_shape, _rounder)
from .core import _BERNOULLI, _NORMAL, _UNIFORM, _float_dtype, _key_words, _shape, split
from ..ops import ops as _ops
from ..array.array import Array

__all__ = ["gamma", "loggamma", "beta", "dirichlet", "chisquare", "f", "t",
           "generalized_normal", "ball"]

_U32 = np.dtype(np.uint32)
_FLOATS = (_F32,) + _HALF


# --- checks ------------------------------------------------------------------------------

def _no_grad(name, **params):
    """Refuse a parameter a value_and_grad / grad is differentiating: its gradient (jax's
    implicit reparameterisation) is not implemented, and it must not silently be zero."""
    tapes = [t for t in (getattr(_ops._tls, "tapes", None) or []) if t is not None]
    for tape in tapes:
        for pname, v in params.items():
            if isinstance(v, Array) and id(v) in tape.tracked:
                raise NotImplementedError(
                    f"{name}: `{pname}` is being differentiated, but ctrainstate does not "
                    f"implement the gradient of random.{name} with respect to its parameters "
                    f"(jax's implicit reparameterisation gradient), and a zero gradient would "
                    f"be silently wrong. Pass lax.stop_gradient({pname}) to sample with no "
                    f"gradient through `{pname}`.")


# --- keys and scalar draws of arrays of keys (the C core's cipher and transforms) ---------

def _split_n(keys, n):
    """``split(key, n)`` of every key in ``keys = (k0, k1)``: a list of n (k0, k1) pairs."""
    s = _C.keys_split(np.ascontiguousarray(keys[0], _U32), np.ascontiguousarray(keys[1], _U32), n)
    return [(s[j, 0], s[j, 1]) for j in range(n)]


def _elem_keys(kw, gshape, start, blk):
    """``split(key, prod(gshape))[i]`` for the block's elements ``i`` (flattened): the
    64-bit random bits of the global array are exactly these keys' two words."""
    out = np.empty(blk, np.uint64)
    _C.random_bits(out, kw[0], kw[1], tuple(gshape), tuple(start), 64)
    out = out.reshape(-1)
    return (out >> np.uint64(32)).astype(_U32), (out & np.uint64(0xFFFFFFFF)).astype(_U32)


def _keyed(dist, dt, keys):
    """``sampler(key, (), dt)`` of each key (uniform on [0, 1) or normal), as float32
    holding dt values: the C core's draw under each key (csrc/core/ct_random.h)."""
    k0 = np.ascontiguousarray(keys[0], _U32)
    out = np.empty(k0.shape[0], dt)
    _C.random_keyed(out, k0, np.ascontiguousarray(keys[1], _U32), dist, _dtypes.code(dt),
                    0.0, 1.0, 0.0, 0.0, 0.0, None)
    return out.astype(_F32)


def _uniform01(dt, keys):
    """uniform(key, (), dt) of each key (float32 holding dt values)."""
    return _keyed(_UNIFORM, dt, keys)


def _normal(dt, keys):
    """normal(key, (), dt) of each key (float32 holding dt values)."""
    return _keyed(_NORMAL, dt, keys)


# --- XLA's float32 math, as the CPU backend computes it --------------------------------------

_TINY = _F32.type(np.finfo(np.float32).tiny)


def _ftz(x):
    """XLA's CPU code flushes float32 subnormal results to (signed) zero."""
    x = np.asarray(x, _F32)
    return np.where(np.abs(x) < _TINY, x * _F32.type(0), x)


def _h(bits):
    return np.array([bits], np.uint32).view(_F32)[0]


_EXP_LOG2E, _EXP_C1, _EXP_C2 = _h(0x3FB8AA3B), _h(0x3F318000), _h(0xB95E8083)
_EXP_P = (_h(0x39506967), _h(0x3AB743CE), _h(0x3C088908), _h(0x3D2AA9C1), _h(0x3E2AAAAA),
          _F32.type(0.5))


def _exp(x):
    """XLA's float32 exp (Cephes' expf; every multiply-add fused, as LLVM contracts them):
    bit-identical to jnp.exp on CPU (checked on 2 million values, tests/random/test_random_gamma.py)."""
    x = np.asarray(x, _F32)
    with np.errstate(all="ignore"):
        x = np.where(x < _F32.type(-87.8), _F32.type(-87.8), x)    # NaN stays NaN
        x = np.where(x > _F32.type(88.8), _F32.type(88.8), x)
        fx = np.floor(_fma(x, _EXP_LOG2E, _F32.type(0.5)))
        fx = np.clip(fx, _F32.type(-127), _F32.type(127))
        x = _fma(-fx, _EXP_C2, _fma(-fx, _EXP_C1, x))
        y = _fma(x, _EXP_P[0], _EXP_P[1])
        for p in _EXP_P[2:]:
            y = _fma(y, x, p)
        y = _F32.type(1) + _fma(y, x * x, x)
        scale = ((np.nan_to_num(fx).astype(np.int32) + 127) << 23).view(_F32)
        return _ftz(y * scale)


def _pow(x, y):
    """XLA's float32 pow on CPU, the same bits on any host: the C library's powf, run with
    denormals flushed to zero as XLA's compiled code runs it (``_C.xla_pow``). numpy's
    float32 power is not used: its AVX-512 code differs from powf in the last bit of about a
    fifth of the results, so samples would depend on the host's SIMD."""
    x, y = np.broadcast_arrays(np.asarray(x, _F32), np.asarray(y, _F32))
    out = np.array(x, _F32, order="C")          # a writeable copy, one element per result
    _C.xla_pow(out, np.ascontiguousarray(y, _F32))
    return out


def _rsqrt(x):
    """``1 / sqrt(x)`` in float32, correctly rounded. XLA rewrites ``a / sqrt(b)`` as
    ``a * rsqrt(b)`` and computes rsqrt from the CPU's ``rsqrtss`` estimate (which differs
    between CPU vendors) and one Newton step: within 2 ulp of this (equal on about 84% of
    the inputs on an AMD EPYC)."""
    with np.errstate(all="ignore"):
        return (1.0 / np.sqrt(np.asarray(x, np.float64))).astype(_F32)


def _sum_last(x, dt):
    """jnp.sum(x, -1) as XLA's CPU reduction (in order; float32 accumulation for 16-bit)."""
    acc = np.zeros(x.shape[:-1], _F32)
    for j in range(x.shape[-1]):
        acc = acc + x[..., j]
    return _rounder(dt)(acc)


# --- Marsaglia and Tsang, vectorised ---------------------------------------------------------

def _take(keys, idx):
    return keys[0][idx], keys[1][idx]


def _gamma_one(keys, alpha, dt, log_space):
    """JAX's _gamma_one for every (key, alpha) pair at once (flat arrays; alpha holds ``dt``
    values as float32): the same ops in the same order, each element's loop run until it
    accepts (``active``: the elements whose loop condition still holds)."""
    r = _rounder(dt)

    def c(v):
        return np.asarray(v, dt).astype(_F32)
    zero, one, half, third, squeeze = c(0), c(1), c(0.5), c(1 / 3), c(0.0331)
    n = alpha.shape[0]
    with np.errstate(all="ignore"):
        boost_mask = alpha >= one
        a = np.where(boost_mask, alpha, r(alpha + one))
        d = r(a - third)
        if dt == _dtypes.bfloat16:
            cc = r(third / r(np.sqrt(d)))
        else:                             # XLA rewrites one_over_three / sqrt(d)
            cc = r(third * r(_rsqrt(d)))
        key, subkey = _split_n(keys, 2)
        V = np.ones(n, _F32)
        active = np.arange(n)             # the initial state (X, V, U) = (0, 1, 2) rejects
        while active.size:
            key_a, x_key, u_key = _split_n(_take(key, active), 3)
            ci = cc[active]
            # the inner loop: draw x until v = 1 + x * c > 0 (XLA fuses the multiply-add)
            x = np.zeros(active.size, _F32)
            v = np.full(active.size, -one, _F32)
            todo = np.arange(active.size)
            while todo.size:
                x_key, sub = _split_n(x_key, 2)
                xt = _normal(dt, sub)
                vt = _fma(xt, ci[todo], one) if dt == _F32 else r(one + r(xt * ci[todo]))
                x[todo], v[todo] = xt, vt
                redo = vt <= zero
                todo, x_key = todo[redo], _take(x_key, redo)
            X = r(x * x)
            Va = r(r(v * v) * v)
            U = _uniform01(dt, u_key)
            key[0][active], key[1][active] = key_a
            V[active] = Va
            di = d[active]
            if dt == _F32:
                bound = _fma(-squeeze, r(X * X), one)
            else:
                bound = r(one - r(squeeze * r(X * X)))
            again = (U >= bound) & (
                r(_log(U)) >= r(r(X * half) + r(di * r(r(one - Va) + r(_log(Va))))))
            active = active[again]
        if log_space:
            log_samples = r(_log1p(-_uniform01(dt, subkey)))    # -exponential(subkey)
            log_boost = np.where(boost_mask | (log_samples == zero), zero,
                                 r(log_samples * r(one / alpha)))
            return r(r(r(_log(d)) + r(_log(V))) + log_boost)
        samples = r(one - _uniform01(dt, subkey))
        boost = np.where(boost_mask, one, r(_pow(samples, r(one / alpha))))
        return r(_ftz(r(_ftz(d * V)) * boost))


def _gamma_block(kw, alpha, dt, log_space, gshape, start, blk):
    """This block of gamma / loggamma(key, a, gshape, dt); ``alpha``: a's block, float32."""
    if not np.prod(blk, dtype=np.int64):
        return np.zeros(blk, _F32)
    keys = _elem_keys(kw, gshape, start, blk)
    a = np.ascontiguousarray(alpha, _F32).reshape(-1)
    return _gamma_one(keys, a, dt, log_space).reshape(blk)


# --- parameters ------------------------------------------------------------------------------

def _gamma_shape(shape, a):
    """_gamma's shape: ``a.shape`` for None, else ``shape`` (a must broadcast to it)."""
    if shape is None:
        return tuple(a.shape)
    shape = _shape(shape)
    _check_shape("gamma", shape, a.shape)
    return shape


def _whole_rows(compute):
    """``compute`` for a block of an array whose last axis is computed together (softmax,
    a norm): run on the block's rows extended to the whole last axis, then sliced."""
    def rows(g, s, b):
        full = compute(g, tuple(s[:-1]) + (0,), tuple(b[:-1]) + (g[-1],))
        return full[..., s[-1]:s[-1] + b[-1]]
    return rows


# --- gamma and loggamma ------------------------------------------------------------------------

def gamma(key, a, shape=None, dtype=None, *, out_sharding=None):
    """Gamma(a, 1) floats, as jax.random.gamma: element ``i`` from Marsaglia and Tsang's
    rejection loop with key ``split(key, size)[i]`` (``a < 1`` boosted to ``a + 1``, times
    ``u ** (1 / a)``). ``a`` broadcasts to ``shape`` (default: ``a.shape``) and is
    converted to ``dtype``; the result has ``dtype``.

    Closeness to JAX (CPU): float16 and bfloat16 bit-identical. float32: JAX computes
    ``c = 1 / (3 sqrt(d))``, ``d = a - 1/3``, with XLA's rsqrt, which refines the CPU's
    ``rsqrtss`` estimate (it differs between CPU vendors); this uses the correctly rounded
    value. Every sample of an ``a`` whose ``c`` agrees is bit-identical (with XLA's rsqrt
    substituted, all are); the others (1-5% of the samples, measured on an AMD EPYC) are
    within 6e-6 relative. ``a < 1`` adds ``pow``: libm's powf, as XLA's (see ``_pow``).

    Differentiating with respect to ``a`` (jax's implicit reparameterisation gradient) is not
    implemented: a traced ``a`` raises NotImplementedError.

    >>> from ctrainstate import random
    >>> from ctrainstate._src.random.gamma import gamma
    >>> x = gamma(random.PRNGKey(0), 2.0, (10000,))
    >>> bool(x.min() > 0) and abs(float(x.mean()) - 2) < 0.1
    True
    """
    kw = _key_words(key)
    dt = _float_dtype(dtype, "gamma")
    _no_grad("gamma", a=a)
    ap = _param(a, "a")
    shape = _gamma_shape(shape, ap)

    def compute(g, s, b):
        return _gamma_block(kw, _block(ap, dt, g, s, b), dt, False, g, s, b)
    return _elementwise(shape, dt, out_sharding, compute)


def loggamma(key, a, shape=None, dtype=None, *, out_sharding=None):
    """The logs of Gamma(a, 1) floats, as jax.random.loggamma: :func:`gamma`'s loop in log
    space (``log(d) + log(V)``, and ``a < 1`` boosted by ``+ log(u) / a``), so small ``a``
    gives finite values where ``gamma`` underflows to 0. The same draws as ``gamma``:
    ``exp(loggamma(k, a)) ~= gamma(k, a)``.

    Closeness to JAX (CPU): float16 and bfloat16 bit-identical; float32 bit-identical
    wherever :func:`gamma`'s ``c`` agrees (only log, log1p and correctly rounded ops), else
    within 5e-7 of ``max(|x|, 1)``.

    >>> import numpy as np
    >>> from ctrainstate import random
    >>> from ctrainstate._src.random.gamma import loggamma
    >>> x = loggamma(random.PRNGKey(0), 1e-3, (1000,))
    >>> bool(np.isfinite(x).all()) and float(np.median(x)) < -100
    True
    """
    kw = _key_words(key)
    dt = _float_dtype(dtype, "gamma")      # (jax's message names gamma here too)
    _no_grad("loggamma", a=a)
    ap = _param(a, "a")
    shape = _gamma_shape(shape, ap)

    def compute(g, s, b):
        return _gamma_block(kw, _block(ap, dt, g, s, b), dt, True, g, s, b)
    return _elementwise(shape, dt, out_sharding, compute)


# --- built on loggamma ---------------------------------------------------------------------------

def beta(key, a, b, shape=None, dtype=None, *, out_sharding=None):
    """Beta(a, b) floats, as jax.random.beta: ``ga / (ga + gb)`` from
    ``la, lb = loggamma(key_a, a), loggamma(key_b, b)``, ``key_a, key_b = split(key)``,
    scaled by ``exp(. - max(la, lb))`` so that small ``a``, ``b`` do not give 0 / 0.

    Closeness to JAX (CPU): float16, bfloat16 and float32 bit-identical (``exp`` is XLA's,
    reproduced), except where :func:`gamma`'s float32 ``c`` differs (then within 6e-6
    relative).

    >>> from ctrainstate import random
    >>> from ctrainstate._src.random.gamma import beta
    >>> x = beta(random.PRNGKey(0), 2.0, 3.0, (10000,))
    >>> bool(x.min() >= 0 and x.max() <= 1) and abs(float(x.mean()) - 0.4) < 0.02
    True
    """
    kw = _key_words(key)
    dt = _float_dtype(dtype, "beta")
    _no_grad("beta", a=a, b=b)
    ap, bp = _param(a, "a"), _param(b, "b")
    _check_cast("beta", dt, a, b)
    shape = _result_shape("beta", shape, ap, bp)
    ka, kb = (_key_words(k) for k in split(kw))
    r = _rounder(dt)

    def compute(g, s, blk):
        la = _gamma_block(ka, _block(ap, dt, g, s, blk), dt, True, g, s, blk)
        lb = _gamma_block(kb, _block(bp, dt, g, s, blk), dt, True, g, s, blk)
        with np.errstate(all="ignore"):
            top = np.maximum(la, lb)
            ga = r(_exp(r(la - top)))
            gb = r(_exp(r(lb - top)))
            return r(ga / r(ga + gb))
    return _elementwise(shape, dt, out_sharding, compute)


def dirichlet(key, alpha, shape=None, dtype=None, *, out_sharding=None):
    """Dirichlet(alpha) vectors, as jax.random.dirichlet: the softmax over the last axis of
    ``loggamma(key, alpha, shape + alpha.shape[-1:])``. ``shape`` is the batch shape
    (default ``alpha.shape[:-1]``, which must broadcast to it). With ``out_sharding`` each
    device computes its own rows (whole, when the last axis is sharded).

    Closeness to JAX (CPU): bit-identical (XLA's exp, its summation order and reciprocal)
    in float16, and in float32 / bfloat16 up to about 1 000 / 15 000 elements, except where
    :func:`gamma`'s float32 ``c`` differs (then within 6e-6 relative). Larger arrays: XLA
    runs the softmax in YNNPACK (its own exp and order): float32 within 6e-6 relative,
    bfloat16 within 2**-7.

    >>> import numpy as np
    >>> from ctrainstate import random
    >>> from ctrainstate._src.random.gamma import dirichlet
    >>> x = dirichlet(random.PRNGKey(0), np.array([1.0, 2.0, 3.0]), (4,))
    >>> x.shape, bool(np.allclose(x.sum(-1), 1, atol=1e-6))
    ((4, 3), True)
    """
    kw = _key_words(key)
    dt = _float_dtype(dtype, "dirichlet")
    if shape is not None:
        shape = _shape(shape)
    _no_grad("dirichlet", alpha=alpha)
    al = _param(alpha, "alpha")
    if al.ndim < 1:
        raise ValueError(f"dirichlet requires alpha.ndim >= 1, got alpha.ndim == {al.ndim}")
    if shape is None:
        shape = tuple(al.shape[:-1])
    else:
        _check_shape("dirichlet", shape, al.shape[:-1])
    full = shape + al.shape[-1:]
    r = _rounder(dt)

    def compute(g, s, b):
        lg = _gamma_block(kw, _block(al, dt, g, s, b), dt, True, g, s, b)
        with np.errstate(all="ignore"):
            top = np.max(lg, axis=-1, keepdims=True, initial=-np.inf)
            un = _exp(r(lg - top))
            if dt == _dtypes.bfloat16:    # XLA sums the float32 exps, and keeps 1 / sum
                return r(r(un) * (_F32.type(1) / _sum_last(un, dt))[..., None])
            un = r(un)
            return r(un * r(_F32.type(1) / _sum_last(un, dt))[..., None])
    return _elementwise(full, dt, out_sharding, _whole_rows(compute))


def _chisquare_block(kw, df, dt, g, s, b):
    r = _rounder(dt)
    half = r(df / _F32.type(2))
    return r(r(_exp(_gamma_block(kw, half, dt, True, g, s, b))) * _F32.type(2))


def chisquare(key, df, shape=None, dtype=None, *, out_sharding=None):
    """Chi-square(df) floats, as jax.random.chisquare: ``2 * exp(loggamma(key, df / 2))``.

    Closeness to JAX (CPU): float16, bfloat16 and float32 bit-identical, except where
    :func:`gamma`'s float32 ``c`` differs (then within 6e-6 relative).

    >>> from ctrainstate import random
    >>> from ctrainstate._src.random.gamma import chisquare
    >>> x = chisquare(random.PRNGKey(0), 3.0, (10000,))
    >>> bool(x.min() > 0) and abs(float(x.mean()) - 3) < 0.15
    True
    """
    kw = _key_words(key)
    dt = _float_dtype(dtype, "chisquare")
    _no_grad("chisquare", df=df)
    dp = _param(df, "df")
    shape = _result_shape("chisquare", shape, dp)
    _check_cast("chisquare", dt, df)

    def compute(g, s, b):
        return _chisquare_block(kw, _block(dp, dt, g, s, b), dt, g, s, b)
    return _elementwise(shape, dt, out_sharding, compute)


def f(key, dfnum, dfden, shape=None, dtype=None, *, out_sharding=None):
    """F(dfnum, dfden) floats, as jax.random.f: ``(chi2n / dfnum) / (chi2d / dfden)`` with
    ``chi2d, chi2n = chisquare(key_dfd, dfden), chisquare(key_dfn, dfnum)``,
    ``key_dfd, key_dfn = split(key)``.

    Closeness to JAX (CPU): float16, bfloat16 and float32 bit-identical, except where
    :func:`gamma`'s float32 ``c`` differs (then within 6e-6 relative). (jax 0.10.2 fails
    on array parameters of lower rank than ``shape``; these broadcast here.)

    >>> from ctrainstate import random
    >>> from ctrainstate._src.random.gamma import f
    >>> x = f(random.PRNGKey(0), 4.0, 10.0, (10000,))
    >>> bool(x.min() > 0) and abs(float(x.mean()) - 1.25) < 0.1
    True
    """
    kw = _key_words(key)
    dt = _float_dtype(dtype, "f")
    _no_grad("f", dfnum=dfnum, dfden=dfden)
    np_, dp = _param(dfnum, "dfnum"), _param(dfden, "dfden")
    shape = _result_shape("f", shape, np_, dp)
    _check_cast("f", dt, dfnum, dfden)
    kd, kn = (_key_words(k) for k in split(kw))
    r = _rounder(dt)

    def compute(g, s, b):
        num_df, den_df = _block(np_, dt, g, s, b), _block(dp, dt, g, s, b)
        chi_n = _chisquare_block(kn, num_df, dt, g, s, b)
        chi_d = _chisquare_block(kd, den_df, dt, g, s, b)
        with np.errstate(all="ignore"):
            if dt == _dtypes.bfloat16:
                return r(r(chi_n / num_df) / r(chi_d / den_df))
            # XLA rewrites (A / B) / (C / D) as (A * D) / (B * C) (not for bfloat16)
            return r(r(chi_n * den_df) / r(num_df * chi_d))
    return _elementwise(shape, dt, out_sharding, compute)


# --- built on gamma -----------------------------------------------------------------------------

def t(key, df, shape=None, dtype=None, *, out_sharding=None):
    """Student's t(df) floats, as jax.random.t: ``n * sqrt(df / 2 / g)`` with
    ``n = normal(key_n)``, ``g = gamma(key_g, df / 2)``, ``key_n, key_g = split(key)``.

    Closeness to JAX (CPU): float16, bfloat16 and float32 bit-identical, except where
    :func:`gamma`'s float32 ``c`` differs (then within 2e-6 relative).

    >>> from ctrainstate import random
    >>> from ctrainstate._src.random.gamma import t
    >>> x = t(random.PRNGKey(0), 5.0, (10000,))
    >>> abs(float(x.mean())) < 0.1
    True
    """
    kw = _key_words(key)
    dt = _float_dtype(dtype, "t")
    _no_grad("t", df=df)
    dp = _param(df, "df")
    shape = _result_shape("t", shape, dp)
    _check_cast("t", dt, df)
    kn, kg = (_key_words(k) for k in split(kw))
    r = _rounder(dt)

    def compute(g, s, b):
        nrm = _draw(kn, _NORMAL, dt, g, s, b)
        half = r(_block(dp, dt, g, s, b) / _F32.type(2))
        gm = _gamma_block(kg, half, dt, False, g, s, b)
        with np.errstate(all="ignore"):
            return r(nrm * r(np.sqrt(r(half / gm))))
    return _elementwise(shape, dt, out_sharding, compute)


def _p_dtypes(p, name):
    """(p, dtype of ``x ** p``'s exponent, dtype of ``1 / p``) in JAX's promotion: None for
    a weakly typed Python number (it takes the other operand's dtype); an integer array
    raises ``x`` to its power in x's dtype, and ``1 / p`` is float32."""
    pp = _param(p, name)
    if _is_weak(p):
        return pp, None, None
    fd = _float_of(p)
    return pp, fd, (fd or _F32)


def _join(*dts):
    """The float dtype JAX promotes these to (None: weak, no vote; mixed: float32)."""
    got = {np.dtype(d) for d in dts if d is not None}
    return got.pop() if len(got) == 1 else _F32


def _generalized_normal_block(kw, pp, inv_dt, dt, odt, g, s, b):
    k0, k1 = (_key_words(k) for k in split(kw))
    with np.errstate(all="ignore"):
        ri = _rounder(inv_dt or _F32)          # 1 / p: float32 for a Python number
        inv = ri(_F32.type(1) / np.broadcast_to(pp.astype(_F32), g)[
            tuple(slice(a, a + n) for a, n in zip(s, b))])
        gm = _gamma_block(k0, _rounder(dt)(inv), dt, False, g, s, b)
        sign = _rounder(dt)(2 * _draw(k1, _BERNOULLI, _F32, g, s, b, p=0.5).astype(_F32) - 1)
        ro = _rounder(odt)
        return ro(sign * ro(_pow(gm, ro(inv))))


def generalized_normal(key, p, shape=(), dtype=None, *, out_sharding=None):
    """Generalized normal floats (density proportional to ``exp(-|x| ** p)``), as
    jax.random.generalized_normal: ``r * g ** (1 / p)`` with ``g = gamma(k0, 1 / p)`` and
    ``r = rademacher(k1)`` signs, ``k0, k1 = split(key)``. ``p`` is a number or an array
    that broadcasts to ``shape``.

    Closeness to JAX (CPU): bfloat16 bit-identical, float16 too for a scalar ``p`` (with a
    float16 array ``p``, XLA keeps precision this does not: 93% the same bits, within 2
    ulp except where the gamma draw is a float16 subnormal); float32 bit-identical where
    :func:`gamma`'s ``c`` agrees (``pow`` is libm's powf, as XLA's), else within 6e-6
    relative.

    >>> from ctrainstate import random
    >>> from ctrainstate._src.random.gamma import generalized_normal
    >>> x = generalized_normal(random.PRNGKey(0), 2.0, (10000,))
    >>> abs(float((x ** 2).mean()) - 0.5) < 0.05     # p = 2: normal with variance 1/2
    True
    """
    shape = _shape(shape)
    kw = _key_words(key)
    dt = _float_dtype(dtype, "gamma")        # (jax's check is gamma's)
    _no_grad("generalized_normal", p=p)
    pp, _, inv_dt = _p_dtypes(p, "p")
    _check_shape("gamma", shape, pp.shape)
    odt = _join(dt, inv_dt)

    def compute(g, s, b):
        return _generalized_normal_block(kw, pp, inv_dt, dt, odt, g, s, b)
    return _elementwise(shape, odt, out_sharding, compute)


def ball(key, d, p=2, shape=(), dtype=None, *, out_sharding=None):
    """Points uniform in the unit Lp ball of dimension ``d``, shape ``(*shape, d)``, as
    jax.random.ball: ``g / (sum(|g| ** p, -1) + e) ** (1 / p)`` with
    ``g = generalized_normal(k1, p, (*shape, d))``, ``e = exponential(k2, shape)``,
    ``k1, k2 = split(key)``. ``p`` is a number here (jax also takes arrays). With
    ``out_sharding`` each device computes its own points (whole, when the last axis is
    sharded).

    Closeness to JAX (CPU), measured for d from 1 to 8 and p from 0.8 to 3.3: bfloat16
    bit-identical; float16 and float32 bit-identical for a few hundred points, within 3 ulp
    for more (XLA computes the norm in a fused reduction whose code generator has its own
    log1p and keeps float32 values unrounded), besides gamma's rsqrt difference in float32
    (within 6e-6 relative where the CPU's rsqrt estimate differs; see the module).

    >>> import numpy as np
    >>> from ctrainstate import random
    >>> from ctrainstate._src.random.gamma import ball
    >>> x = ball(random.PRNGKey(0), 3, shape=(1000,))
    >>> x.shape, bool((np.linalg.norm(x, axis=-1) <= 1).all())
    ((1000, 3), True)
    """
    shape = _shape(shape)
    kw = _key_words(key)
    dt = _float_dtype(dtype, "gamma")        # (jax's check is gamma's)
    d = operator.index(d)
    if d < 0:
        raise TypeError(f"Only non-negative indices are allowed when broadcasting static "
                        f"shapes, but got shape {(*shape, d)}.")
    _no_grad("ball", p=p)
    pp, pow_dt, inv_dt = _p_dtypes(p, "p")
    if pp.ndim:
        raise ValueError(f"ball: p must be a scalar in ctrainstate, got an array of shape "
                         f"{pp.shape}")
    k1, k2 = (_key_words(k) for k in split(kw))
    gdt = _join(dt, inv_dt)                    # generalized_normal's result
    adt = _join(gdt, pow_dt)                   # |g| ** p
    sdt = _join(adt, dt)                       # + e
    odt = _join(_join(sdt, inv_dt), gdt)       # (..) ** (1 / p), g / (..)
    full = shape + (d,)

    def compute(g, s, b):
        gn = _generalized_normal_block(k1, pp, inv_dt, dt, gdt, g, s, b)
        e = -_rounder(dt)(_log1p(-_draw(k2, _UNIFORM, dt, g[:-1], s[:-1], b[:-1])))
        ra, rs, ro = _rounder(adt), _rounder(sdt), _rounder(odt)
        bf16 = odt == _dtypes.bfloat16     # XLA keeps some float32 values unrounded
        with np.errstate(all="ignore"):
            pw = _pow(np.abs(gn), ra(pp.astype(_F32)))
            tot = rs(_sum_last(pw if bf16 else ra(pw), adt) + e)
            inv = _rounder(inv_dt or _F32)(_F32.type(1) / pp.astype(_F32))
            if bf16:     # g * (1 / pow(..)), the reciprocal in float32
                return ro(gn * (_F32.type(1) / ro(_pow(tot, ro(inv))))[..., None])
            # XLA rewrites g / pow(x, 1 / p) as g * pow(x, -(1 / p))
            return ro(gn * ro(_pow(tot, -ro(inv)))[..., None])
    return _elementwise(full, odt, out_sharding, _whole_rows(compute))


# under jit, each draw given a traced key is one op node of the program (ops/node.py): its key
# is read at each call, and a numpy result comes back as an Array where the key lives
from ..ops.node import op_node as _op_node  # noqa: E402
from .core import _on_key_placement  # noqa: E402

for _name in __all__:
    globals()[_name] = _op_node("random." + _name, _on_key_placement)(globals()[_name])
del _name
