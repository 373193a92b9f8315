"""``jax.random``'s discrete samplers: :func:`poisson`, :func:`binomial`, :func:`multinomial`,
and the key helpers :func:`clone`, :func:`key_impl`, :func:`key_dtype`.

The samplers run jax 0.10.2's algorithms op by op in float32 numpy, vectorised over the
elements: one numpy pass per round of jax's while loop, over the elements still active.

- poisson: Knuth's product of uniforms where ``lam < 10`` (or NaN), Hormann's transformed
  rejection (PTRS) elsewhere; ``lam == 0`` gives 0.
- binomial: the inversion algorithm (a sum of geometric gaps) where ``n * min(p, 1 - p) <= 10``
  (or ``n`` is NaN or negative), the transformed rejection of Hormann (BTRS) elsewhere; counts
  for ``p > 0.5`` are ``n - binomial(n, 1 - p)``. NaN for NaN or negative ``n``, NaN or
  out-of-range ``p``; ``inf`` for ``n = inf``.
- multinomial: one binomial per category on the trials left, ``p_i / sum(p[i:])`` (jax's
  reverse ``cumsum``, in XLA's summation order), keys ``split(key, K)``.

Each round draws ``uniform(subkey, shape)`` from the C core (JAX's bits) and splits the key
as jax does (Knuth: ``key, sub = split(key)``; inversion: ``sub, key = split(key)``;
rejection: ``key, k0, k1 = split(key, 3)``).

One thing about jax's rejection loops (PTRS and BTRS) decides how they are computed here. The
loop keeps running until *every* element of the array has had a proposal accepted, and it
keeps replacing a value each time a later proposal is accepted too. So an element's value is
its last accepted proposal within the number of rounds the *whole array* needed. That number
depends on every element, including the elements that use the other algorithm: jax runs them
through the rejection loop too, with placeholder parameters (``lam = 1e5``; ``n = 1e4,
p = 0.5``), and throws those values away. Here they count towards the number of rounds the
same way. Without ``out_sharding`` the array is one block. With ``out_sharding`` a first pass
over the whole array finds only the number of rounds (first acceptances). Then each device
computes its own block, so the values are the same on every mesh.

How close to JAX (measured against jax 0.10.2 on CPU, an x86-64 with FMA; the live parity
checks in tests/random/test_random_discrete.py): the same values. 0 differences in 12 million poisson
samples (``lam`` from 0.001 to 1e7, per element and broadcast, both algorithms), 10.8 million
binomial samples (float32, float16 and bfloat16 ``p``; scalar, per-element and mixed
parameters; both algorithms) and 1.2 million multinomial counts (5 and 20 categories, float32
and float16), nor at the edge values (0, -0.0, negative, NaN, inf, 1e30, lam on either side of
10, every integer dtype). This holds because of the following:

- XLA's float32 ``log`` / ``log1p`` are the C core's copies, and ``lgamma`` is reproduced as
  XLA compiles it (the Lanczos series, ``z / 7.5`` folded into a multiply, one fused
  multiply-add). The uniforms are the C core's, bit-identical to jax's.
- XLA's rewrites are reproduced too: constants re-associated (``b - 2`` is
  ``sqrt(lam) * 2.53 + -1.069``), a division by a broadcast (scalar) parameter turned into a
  multiply by its reciprocal, and in float32 the multiply-adds that LLVM contracts into FMAs
  (``_fma`` rounds once). float16 / bfloat16 arithmetic rounds every op to the dtype, as
  XLA's HLO does there (its converts leave nothing to contract).
- jax's loop bounds (``max_iters`` of the result dtype) and its float -> int conversion
  (saturating, NaN -> 0) are kept, and so is jax's quirk of evaluating the Stirling tail at
  ``min(k, 9)``.

Caveats. The contracted FMAs are XLA's choice on CPUs that have FMA (x86-64 CPUs with AVX2
do). Without FMA, jax's float32 values move by an ulp, and a count then differs where a
proposal sits that close to an acceptance bound or an integer (measured: 1e-5 to 6e-5 of the
samples when one of the FMAs is left out). The reciprocal for a broadcast parameter follows the
programs jax builds for scalar and full-shape parameters. It changes the last bit of a
constant, which decides fewer than 1 in 10^8 samples (estimated from that bit's size; 0 in the
measurements above). Where jax never returns, these functions return: jax's loop
never ends for binomial with ``n = inf`` and ``p`` 0 or 1 (its BTRS constants are NaN, so no
proposal is ever accepted), or with ``p = -0.0`` (its geometric gaps are ``-inf``). Here they
give ``inf``, the value jax's final selects assign to ``n = inf``, and 0, as for
``p = +0.0``.

Deviations: complex parameters raise ``TypeError`` (jax drops the imaginary part with a
warning), and so do lists, as in jax. Keys are ctrainstate's raw ``uint32[2]`` keys. Typed jax
keys work too. A stack of keys raises jax's ``ValueError``.
"""
from __future__ import annotations

import math
import operator

import ml_dtypes
import numpy as np

from ..base import dtypes as _dtypes
from .dist import (_F32, _HALF, _block, _broadcast, _check_shape, _draw, _float_of, _fma, _log,
                   _log1p, _param, _rounder, _to_int)
from .core import _UNIFORM, _key_words, split
from ..array.abstract import is_abstract, ShapeDtypeStruct
from .dist import _elementwise
from ..array.array import device_put

__all__ = ["poisson", "binomial", "multinomial", "clone", "key_impl", "key_dtype"]

_F = np.float32
_BF16 = np.dtype(ml_dtypes.bfloat16)
_THREEFRY = "threefry2x32"
_PRNG_NAMES = ("philox2x32", "philox4x32", "threefry2x32", "rbg", "unsafe_rbg", "threefry4x32")
_CHUNK = 1 << 20          # elements per slab of the first pass over a sharded array


# --- arguments ------------------------------------------------------------------------------

def _batched_msg(name, shape):
    return (f"{name} accepts a single key, but was given a key array of shape {shape} != (). "
            f"Use jax.vmap for batching.")


def _key(name, k):
    """(k0, k1) of a single key: raw uint32 data as ctrainstate's other samplers accept it, or a
    typed jax key; a stack of keys raises jax's ValueError."""
    dt = getattr(k, "dtype", None)
    if dt is not None and "key<" in str(dt):          # a typed jax key
        if np.ndim(k):
            raise ValueError(_batched_msg(name, np.shape(k)))
        import jax  # only reachable when the caller already uses jax
        impl = jax.random.key_impl(k)
        if impl != _THREEFRY:
            if name == "poisson":
                raise NotImplementedError(f"`poisson` is only implemented for the threefry2x32 "
                                          f"RNG, not {impl}")
            raise TypeError(f"{name}: ctrainstate implements only the threefry2x32 PRNG, got "
                            f"a {impl} key")
        return _key_words(k)
    shape = np.shape(k)
    if len(shape) >= 2 and shape[-1] == 2:
        raise ValueError(_batched_msg(name, shape))
    return _key_words(k)


def _arraylike(v) -> bool:
    """jax's notion of an array argument: arrays and scalars (not lists or tuples), and the
    ShapeDtypeStructs that stand for arrays under eval_shape."""
    if isinstance(v, (np.ndarray, np.generic, bool, int, float, complex, ShapeDtypeStruct)):
        return True
    return hasattr(v, "__jax_array__") or (hasattr(v, "__array__") and hasattr(v, "dtype")
                                           and hasattr(v, "shape"))


def _canon_shape(shape) -> tuple:
    """jax's core.canonicalize_shape: an int or a sequence of ints."""
    try:
        if isinstance(shape, (int, np.integer)) and not isinstance(shape, (bool, np.bool_)):
            return (int(shape),)
        return tuple(operator.index(d) for d in shape)
    except TypeError:
        raise TypeError(f"Shapes must be 1D sequences of concrete values of integer type, got "
                        f"{shape}.") from None


def _aval(dt, shape) -> str:
    return f"{np.dtype(dt).name}[{','.join(str(d) for d in shape)}]"


def _broadcast_to_check(dt, arr_shape, shape) -> None:
    """lax.broadcast_to's checks, in its order and with its messages."""
    arr_shape, shape = tuple(arr_shape), tuple(shape)
    if arr_shape == shape:
        return
    if len(shape) < len(arr_shape):
        raise ValueError(f"Cannot broadcast to shape with fewer dimensions: "
                         f"arr_shape={arr_shape} shape={shape}")
    tail = shape[len(shape) - len(arr_shape):]
    if not all(a in (1, s) for a, s in zip(arr_shape, tail)):
        raise ValueError(f"Incompatible types for broadcasting: input type="
                         f"{_aval(dt, arr_shape)} and requested type={_aval(dt, shape)}")
    if any(d < 0 for d in shape):
        raise TypeError(f"broadcast_in_dim shape must have every element be nonnegative, got "
                        f"{shape}.")


def _float_dtype_of(v):
    """The float dtype a parameter carries in jax's promotion, or None (Python numbers,
    integers, booleans)."""
    if isinstance(v, ShapeDtypeStruct):
        dt = _dtypes._NARROW.get(v.dtype, v.dtype)
        return dt if dt.kind == "f" or dt in _HALF else None
    return _float_of(v)


def _abstract() -> bool:
    return is_abstract()


def _user_dtype(dtype) -> np.dtype:
    dt = np.dtype(dtype)
    return _dtypes._NARROW.get(dt, dt)


def _block32(a, dt, g, s, b):
    """_block (parameter ``a`` in ``dt``, this block of it) as a flat float32 array."""
    return np.ascontiguousarray(_block(a, dt, g, s, b)).reshape(-1)


def _elementwise_iters(shape, out_dt, out_sharding, compute, first_pass):
    """Run ``compute(g, s, b, n_iters)`` per block (see _random_dist._elementwise). With
    ``out_sharding`` and a ``first_pass(g, s, b)`` (the rounds a block needs), the rounds of
    the whole array are found first, over slabs of at most _CHUNK elements."""
    n_iters = None
    if out_sharding is not None and first_pass is not None and not is_abstract():
        n_iters = 0
        rest = math.prod(shape[1:])
        if not shape:
            n_iters = first_pass((), (), ())
        elif rest and shape[0]:
            rows = max(1, _CHUNK // rest)
            for r0 in range(0, shape[0], rows):
                blk = (min(rows, shape[0] - r0),) + tuple(shape[1:])
                n_iters = max(n_iters, first_pass(shape, (r0,) + (0,) * (len(shape) - 1), blk))
    return _elementwise(shape, out_dt, out_sharding, lambda g, s, b: compute(g, s, b, n_iters))


# --- float32 arithmetic as XLA compiles it ----------------------------------------------------

_LANCZOS = (676.520368121885098567009190444019, -1259.13921672240287047156078755283,
            771.3234287776530788486528258894, -176.61502916214059906584439813,
            12.507343278686904814458936853, -0.13857109526572011689554707,
            9.984369578019570859563e-6, 1.50563273514931155834e-7)


def _lgamma(x):
    """jax.lax.lgamma of float32 ``x >= 0.5`` as XLA's CPU backend computes it (the Lanczos
    series; ``z / 7.5`` folded into ``z * (1 / 7.5)``, the last multiply-add an FMA). Values
    below 0.5 (the reflection branch) are not needed here and are not reproduced."""
    z = np.asarray(x, _F32) - _F(1)
    with np.errstate(all="ignore"):
        a = _F(_LANCZOS[0]) / (z + _F(1)) + _F(1)
        for i, c in enumerate(_LANCZOS[1:], start=2):
            a = a + _F(c) / (z + _F(i))
        t = z + _F(7.5)
        logt = _log1p(z * _F(1 / 7.5)) + _F(math.log(7.5))
        y = _fma((z + _F(0.5)) - t / logt, logt, _F(0.5 * math.log(2 * math.pi)))
        return y + _log(a)


def _below(i, cap) -> bool:
    """jax's loop bound ``i < max_iters``, compared in max_iters' dtype (float16 rounds i)."""
    if isinstance(cap, np.floating):
        return bool(np.asarray(i).astype(cap.dtype) < cap)
    return i < cap


# --- the rejection loop ---------------------------------------------------------------------

def _rejection(kw, g, s, b, consts, step, live, keep, n_iters, cap, dt=_F32):
    """jax's rejection while loop (PTRS / BTRS) over the block ``(g, s, b)``, flat.

    Every round ``key, k0, k1 = split(key, 3)`` and each element proposes from ``uniform(k0)``
    and ``uniform(k1)``; an accepted proposal replaces the element's value, also after its first
    acceptance. ``live``: elements that take part in counting rounds (all but those that can
    never accept); ``keep``: elements whose value is wanted. ``n_iters=None``: this block is the
    whole array, run until every live element has accepted once; else run ``n_iters`` rounds.
    Returns (values, rounds)."""
    out = np.full(live.shape, -1, _F32)
    pending = live.copy() if n_iters is None else np.zeros(live.shape, bool)
    key, i = kw, 0
    while _below(i, cap) and (pending.any() if n_iters is None else i < n_iters):
        key, k0, k1 = (_key_words(x) for x in split(key, 3))
        idx = np.nonzero(pending | keep)[0]
        if idx.size:
            u = _draw(k0, _UNIFORM, dt, g, s, b).reshape(-1)[idx]
            v = _draw(k1, _UNIFORM, dt, g, s, b).reshape(-1)[idx]
            k, acc = step({name: x[idx] for name, x in consts.items()}, u, v)
            hit = idx[acc]
            out[hit] = k[acc]
            pending[hit] = False
        i += 1
    return out, i


# --- poisson --------------------------------------------------------------------------------

def _knuth(kw, lam, g, s, b, cap):
    """jax's _poisson_knuth (flat block): count the uniforms whose running log-product stays
    above ``-lam``; ``k - 1`` as int64. Elementwise: a count only moves while its element is
    active."""
    k = np.zeros(lam.shape, np.int64)
    logp = np.zeros(lam.shape, _F32)
    neg = -lam
    idx = np.nonzero(logp > neg)[0]
    rng, i = kw, 0
    while idx.size and _below(i, cap):
        rng, sub = (_key_words(x) for x in split(rng))
        u = _draw(sub, _UNIFORM, _F32, g, s, b).reshape(-1)[idx]
        k[idx] += 1
        logp[idx] = logp[idx] + _log(u)
        idx = idx[logp[idx] > neg[idx]]
        i += 1
    return k - 1


def _ptrs_consts(lam, bcast):
    """PTRS's per-element constants, as XLA folds them (``b - 2`` and ``b - 3.4`` re-associated;
    with a broadcast ``lam``, ``1.1328 / x`` is ``1.1328 * (1 / x)``)."""
    with np.errstate(all="ignore"):
        sq = np.sqrt(lam)
        b = _fma(sq, _F(2.53), _F(0.931))
        a = _fma(b, _F(0.02483), _F(-0.059))
        v_r = _F(0.9277) - _F(3.6224) / _fma(sq, _F(2.53), _F(0.931) + _F(-2))
        d = _fma(sq, _F(2.53), _F(0.931) - _F(3.4))
        inv_alpha = (_fma(_F(1.1328), _F(1) / d, _F(1.1239)) if bcast
                     else _F(1.1328) / d + _F(1.1239))
        return {"lam": lam, "log_lam": _log(lam), "b": b, "a": a, "two_a": a * _F(2),
                "v_r": v_r, "inv_alpha": inv_alpha}


def _ptrs_step(c, u, v):
    """One PTRS proposal per element: (k, accepted)."""
    with np.errstate(all="ignore"):
        u = u - _F(0.5)
        us = _F(0.5) - np.abs(u)
        k = np.floor(_fma(c["two_a"] / us + c["b"], u, c["lam"]) + _F(0.43))
        lhs = _log((v * c["inv_alpha"]) / (c["a"] / (us * us) + c["b"]))
        rhs = _fma(k, c["log_lam"], -c["lam"]) - _lgamma(k + _F(1))
        accept1 = (us >= _F(0.07)) & (v <= c["v_r"])
        reject = (k < 0) | ((us < _F(0.013)) & (v > us))
        return k, accept1 | (~reject & (lhs <= rhs))


def poisson(key, lam, shape=None, dtype=None, *, out_sharding=None):
    """Poisson integers with rate ``lam``, as jax.random.poisson (the same values).

    ``lam`` (scalar or array) must broadcast to ``shape`` (default: ``lam``'s shape); it is
    converted to float32. Elements with ``lam < 10`` use Knuth's algorithm, the others Hormann's
    transformed rejection (see the module docstring); ``lam == 0`` gives 0 and, as in jax,
    negative or NaN ``lam`` gives ``-1`` (wrapping in unsigned dtypes) and ``lam = inf`` gives
    the dtype's maximum or 0. ``dtype``: an integer dtype (default int32; 64-bit ones become
    32-bit as in jax without x64). With ``out_sharding`` each device computes its own block,
    the same values on any mesh (int32 / uint32, which Arrays store).

    >>> import numpy as np
    >>> from ctrainstate import random
    >>> from ctrainstate._src.random.discrete import poisson
    >>> x = poisson(random.PRNGKey(0), np.float32([0.5, 3.0, 50.0]), (10000, 3))
    >>> x.dtype, x.shape
    (dtype('int32'), (10000, 3))
    >>> np.round(x.mean(0)).tolist()
    [0.0, 3.0, 50.0]
    """
    kw = _key("poisson", key)
    dt = _user_dtype(int if dtype is None else dtype)
    if shape is not None:
        shape = _canon_shape(shape)
    if not _arraylike(lam):
        raise TypeError(f"broadcast_to requires ndarray or scalar arguments, got {type(lam)} at "
                        f"position 0.")
    lam_a = _param(lam, "lam")
    if shape is None:
        shape = lam_a.shape
    _broadcast_to_check(lam_a.dtype, lam_a.shape, shape)
    cap = int(np.iinfo(dt).max)           # jax's max_iters ("Invalid integer data type" else)
    if _abstract():
        return _elementwise_iters(shape, dt, out_sharding, None, None)
    lam32 = lam_a.astype(_F32)
    bcast = lam32.size < math.prod(shape)
    with np.errstate(invalid="ignore"):
        any_ptrs = math.prod(shape) > 0 and bool((~(np.isnan(lam32) | (lam32 < 10))).any())

    def setup(g, s, b):
        lam_b = _block32(lam32, _F32, g, s, b)
        with np.errstate(invalid="ignore"):
            use_knuth = np.isnan(lam_b) | (lam_b < 10)
        # jax runs PTRS on every element; the Knuth ones with lam = 1e5, values unused
        consts = _ptrs_consts(np.where(use_knuth, _F(1e5), lam_b), bcast)
        return lam_b, use_knuth, consts

    def first_pass(g, s, b):
        lam_b, use_knuth, consts = setup(g, s, b)
        live = np.ones(lam_b.shape, bool)
        return _rejection(kw, g, s, b, consts, _ptrs_step, live, ~live, None, cap)[1]

    def compute(g, s, b, n_iters):
        lam_b, use_knuth, consts = setup(g, s, b)
        res = np.zeros(lam_b.shape, dt)
        if use_knuth.any():
            kn = _knuth(kw, np.where(use_knuth, lam_b, _F(0)), g, s, b, cap)
            res = np.where(use_knuth, kn.astype(dt), res)
        if any_ptrs:
            live = np.ones(lam_b.shape, bool)
            rej, _ = _rejection(kw, g, s, b, consts, _ptrs_step, live, ~use_knuth, n_iters, cap)
            res = np.where(use_knuth, res, _to_int(rej, dt))
        return np.where(lam_b == 0, dt.type(0), res).reshape(b)

    return _elementwise_iters(shape, dt, out_sharding, compute, first_pass if any_ptrs else None)


# --- binomial -------------------------------------------------------------------------------

_STIRLING_TAIL = np.array([0.0810614667953272, 0.0413406959554092, 0.0276779256849983,
                           0.02079067210376509, 0.0166446911898211, 0.0138761288230707,
                           0.0118967099458917, 0.0104112652619720, 0.00925546218271273,
                           0.00833056343336287])


def _stirling(k, r, bcast=False):
    """jax's _stirling_approx_tail of integer-valued ``k``: the table for ``k <= 9``, else the
    series evaluated — as in jax — at ``min(k, 9)``. ``r`` rounds to the sampling dtype (its
    ``.c`` makes constants of it). ``bcast``: the divisions by a broadcast value XLA turns into
    reciprocal multiplies (jax's loop-invariant terms of scalar parameters)."""
    c = r.c
    with np.errstate(all="ignore"):
        use_table = k <= 9
        kc = np.where(np.isnan(k), k, np.clip(k, c(0), c(9)))
        kp1 = r(kc + c(1))
        kp1sq = r(kp1 * kp1)
        c12, c360, c1260 = c(1.0 / 12), c(1.0 / 360), c(1.0 / 1260)
        if bcast:
            inner = r.fma(-c1260, r(c(1) / kp1sq), c360)
            approx = r(r(c12 - r(inner / kp1sq)) * r(c(1) / kp1))
        else:
            approx = r(r(c12 - r(r(c360 - r(c1260 / kp1sq)) / kp1sq)) / kp1)
        idx = np.where(use_table, np.nan_to_num(kc), 0).astype(np.int64)
        return np.where(use_table, c(_STIRLING_TAIL)[idx], approx)


def _rounder_c(pdt):
    """_rounder(pdt) with ``.c``, a Python constant as jax makes it in ``pdt`` (one rounding
    from float64), and ``.fma``, a multiply-add: in float32 one FMA (LLVM contracts XLA's),
    in float16 / bfloat16 two rounded ops (XLA rounds each 16-bit op's result to the dtype,
    so there is nothing to contract)."""
    r = _rounder(pdt)
    r.c = lambda v: np.asarray(v, np.float64).astype(pdt).astype(_F32)
    r.fma = _fma if np.dtype(pdt) == _F32 else (lambda a, b, c: r(r(a * b) + c))
    return r


def _btrs_consts(cnt, q, r, bcast):
    """BTRS's per-element constants, in jax's order with XLA's FMAs (``bcast``: scalar
    parameters, whose ``4.2 / b`` XLA computes as ``4.2 * (1 / b)``)."""
    c = r.c
    with np.errstate(all="ignore"):
        stddev = r(np.sqrt(r(r(cnt * q) * r(c(1) - q))))
        b = r.fma(stddev, c(2.53), c(1.15))
        a = r.fma(q, c(0.01), r.fma(b, c(0.0248), c(-0.0873)))
        v_r = r.fma(-c(4.2), r(c(1) / b), c(0.92)) if bcast else r(c(0.92) - r(c(4.2) / b))
        rr = r(q / r(c(1) - q))
        m = np.floor(r(r(cnt + c(1)) * q))
        cm1 = r(r(cnt - m) + c(1))
        return {"cnt": cnt, "b": b, "a": a, "two_a": r(a * c(2)), "c": r.fma(cnt, q, c(0.5)),
                "v_r": v_r, "rr": rr, "alpha": r(r(r(c(5.1) / b) + c(2.83)) * stddev),
                "cm1": cm1, "cp1": r(cnt + c(1)),
                "t1": r(r(m + c(0.5)) * r(_log(r(r(m + c(1)) / r(rr * cm1))))),
                "st_m": _stirling(m, r, bcast), "st_cm": _stirling(r(cnt - m), r, bcast)}


def _btrs_step(r):
    c = r.c

    def step(cs, u, v):
        """One BTRS proposal per element: (k, accepted)."""
        with np.errstate(all="ignore"):
            u = r(u - c(0.5))
            us = r(c(0.5) - np.abs(u))
            accept1 = (us >= c(0.07)) & (v <= cs["v_r"])
            k = np.floor(r.fma(r(r(cs["two_a"] / us) + cs["b"]), u, cs["c"]))
            reject = (k < 0) | (k > cs["cnt"])
            lhs = r(_log(r(r(v * cs["alpha"]) / r(r(cs["a"] / r(us * us)) + cs["b"]))))
            ck1 = r(r(cs["cnt"] - k) + c(1))
            ub = r.fma(cs["cp1"], r(_log(r(cs["cm1"] / ck1))), cs["t1"])
            ub = r.fma(r(k + c(0.5)), r(_log(r(r(cs["rr"] * ck1) / r(k + c(1))))), ub)
            ub = r(r(r(ub + cs["st_m"]) + cs["st_cm"]) - _stirling(k, r))
            ub = r(ub - _stirling(r(cs["cnt"] - k), r))
            return k, accept1 | (~reject & (lhs <= ub))
    return step


def _inversion(kw, cnt, q, want, g, s, b, pdt, cap):
    """jax's _binomial_inversion (flat block): the number of geometric gaps
    ``ceil(log(u) / log1p(-q))`` whose running sum stays ``<= cnt``, minus one. Elementwise
    (a count only moves while its element is active); computed for ``want`` only."""
    r = _rounder(pdt)
    with np.errstate(all="ignore"):
        l1mq = r(_log1p(-q))
        num = np.zeros(cnt.shape, _F32)
        gsum = np.zeros(cnt.shape, _F32)
        idx = np.nonzero(want & (gsum <= cnt))[0]
        key, i = kw, 0
        while idx.size and _below(i, cap):
            sub, key = (_key_words(x) for x in split(key))
            u = _draw(sub, _UNIFORM, pdt, g, s, b).reshape(-1)[idx]
            num[idx] = r(num[idx] + _F(1))
            gsum[idx] = r(gsum[idx] + r(np.ceil(r(r(_log(u)) / l1mq[idx]))))
            idx = idx[gsum[idx] <= cnt[idx]]
            i += 1
        return r(num - _F(1))


class _Binomial:
    """jax's _binomial for flat blocks of (count, prob) in ``pdt`` (as float32 values)."""

    def __init__(self, kw, dt, pdt, bcast):
        self.kw, self.dt, self.pdt, self.bcast = kw, np.dtype(dt), np.dtype(pdt), bcast
        self.r = _rounder_c(self.pdt)
        # jax's max_iters: finfo(dtype).max in dtype (float16: i stops at 65489)
        self.cap = (np.inf if self.dt == _BF16
                    else self.dt.type(np.finfo(self.dt).max))

    def prepare(self, cnt, prob):
        r = self.r
        with np.errstate(all="ignore"):
            p_lt_half = prob < 0.5
            q = np.where(p_lt_half, prob, r(_F(1) - prob))
            cnt_bad = np.isnan(cnt) | (cnt < 0)
            cnt_inf = np.isinf(cnt)
            q_nan, q_neg = np.isnan(q), q < 0
            q = np.where(q_nan | q_neg, r.c(0.01), q) + _F(0)   # (+ 0: -0.0 -> 0.0, below)
            use_inv = cnt_bad | (r(cnt * q) <= 10)
            cnt = np.floor(cnt)
            # jax runs BTRS on every element, the inversion ones with n = 1e4, p = 0.5
            consts = _btrs_consts(np.where(use_inv, r.c(1e4), cnt),
                                  np.where(use_inv, _F(0.5), q), r, self.bcast)
            invalid = q_neg | q_nan | cnt_bad
        # jax's loop never ends where no proposal can be accepted (n = inf with p 0 or 1: NaN
        # constants); those values are replaced by inf below, so they sit out of the count
        live = ~np.isnan(consts["v_r"])
        return dict(cnt=cnt, q=q, use_inv=use_inv, consts=consts, live=live,
                    btrs=~use_inv & live & ~invalid & ~cnt_inf, p_lt_half=p_lt_half,
                    cnt_bad=cnt_bad, cnt_inf=cnt_inf, q_nan=q_nan, invalid=invalid)

    def rounds(self, st, g, s, b):
        """The rounds BTRS needs for this block (first acceptances only)."""
        live = st["live"]
        return _rejection(self.kw, g, s, b, st["consts"], _btrs_step(self.r), live,
                          np.zeros(live.shape, bool), None, self.cap, self.pdt)[1]

    def sample(self, st, g, s, b, n_iters=None):
        dt, use_inv = self.dt, st["use_inv"]
        with np.errstate(all="ignore"):
            # (-0.0 would make jax's gaps -inf and its loop endless; q + 0 above is +0.0)
            inv = _inversion(self.kw, np.where(use_inv, st["cnt"], _F(0)), st["q"],
                             use_inv & ~st["invalid"], g, s, b, self.pdt, self.cap)
            out = inv.astype(dt)
            if st["btrs"].any():
                bt, _ = _rejection(self.kw, g, s, b, st["consts"], _btrs_step(self.r),
                                   st["live"], st["btrs"], n_iters, self.cap, self.pdt)
                out = np.where(use_inv, out, bt.astype(dt))
            out = np.where(st["invalid"], dt.type(np.nan), out)
            out = np.where(st["cnt_inf"] & ~st["invalid"], dt.type(np.inf), out)
            flip = ~(st["p_lt_half"] | st["cnt_bad"] | st["q_nan"] | st["cnt_inf"])
            return np.where(flip, (st["cnt"].astype(dt) - out).astype(dt), out)


def binomial(key, n, p, shape=None, dtype=None, *, out_sharding=None):
    """Binomial counts (as floats) of ``n`` trials with success probability ``p``, as
    jax.random.binomial (the same values for float32 ``p``).

    ``n`` and ``p`` broadcast together (to ``shape`` when given). The arithmetic runs in
    ``p``'s float dtype (float32 for Python numbers and integer arrays) and the result is
    ``dtype`` (a float dtype, default float32). Non-integer ``n`` counts ``floor(n)`` trials.
    NaN or negative ``n`` and NaN ``p`` or ``p`` outside ``[0, 1]`` give NaN; ``n = inf`` gives
    inf. ``out_sharding`` (an extension; jax has none here): each device computes its own block,
    with the same values on any mesh (see the module docstring for the first pass this takes).

    >>> import numpy as np
    >>> from ctrainstate import random
    >>> from ctrainstate._src.random.discrete import binomial
    >>> x = binomial(random.PRNGKey(0), np.float32([4.0, 1000.0]), 0.3, (10000, 2))
    >>> x.dtype, bool((x >= 0).all() and (x[:, 0] <= 4).all())
    (dtype('float32'), True)
    >>> np.round(x.mean(0)).tolist()
    [1.0, 300.0]
    """
    kw = _key("binomial", key)
    for pos, v in enumerate((n, p)):
        if not _arraylike(v):
            raise TypeError(f"binomial requires ndarray or scalar arguments, got {type(v)} at "
                            f"position {pos}.")
    dt = _user_dtype(float if dtype is None else dtype)
    if dt.kind != "f" and dt != _BF16:
        raise ValueError(f"dtype argument to `binomial` must be a float dtype, got {dt}")
    if shape is not None:
        shape = _canon_shape(shape)
    na, pa = _param(n, "n"), _param(p, "p")
    pshape = _broadcast(na.shape, pa.shape)
    if shape is None:
        shape = pshape
    else:
        if any(d < 0 for d in shape):
            raise TypeError(f"Only non-negative indices are allowed when broadcasting static "
                            f"shapes, but got shape {shape}.")
        _check_shape("binomial", shape, na.shape, pa.shape)
    pdt = np.dtype(_float_dtype_of(p) or _F32)
    if _abstract():
        return _elementwise_iters(shape, dt, out_sharding, None, None)
    sampler = _Binomial(kw, dt, pdt, math.prod(pshape) < math.prod(shape))
    any_btrs = False
    if math.prod(shape):
        st = sampler.prepare(_block32(na, pdt, pshape, (0,) * len(pshape), pshape),
                             _block32(pa, pdt, pshape, (0,) * len(pshape), pshape))
        any_btrs = bool(st["btrs"].any())

    def setup(g, s, b):
        return sampler.prepare(_block32(na, pdt, g, s, b), _block32(pa, pdt, g, s, b))

    def compute(g, s, b, n_iters):
        return sampler.sample(setup(g, s, b), g, s, b, n_iters).reshape(b)

    return _elementwise_iters(shape, dt, out_sharding, compute,
                              (lambda g, s, b: sampler.rounds(setup(g, s, b), g, s, b))
                              if any_btrs else None)


# --- multinomial ----------------------------------------------------------------------------

def _window_sums(x, r):
    """out[j] = ((x[j] + x[j+1]) + ...) + x[-1] along axis 0, summed in that order."""
    out = np.empty_like(x)
    for j in range(x.shape[0]):
        acc = x[j]
        for i in range(j + 1, x.shape[0]):
            acc = r(acc + x[i])
        out[j] = acc
    return out


def _reverse_cumsum(x, r):
    """jax.lax.cumsum(x, 0, reverse=True) on CPU, bit for bit: up to 16 terms, each output
    sums its window in order; longer scans are split (by XLA) into rows of 16 (zero-padded at
    the end), each scanned so, plus the (recursively scanned) totals of the rows after it."""
    k = x.shape[0]
    if k <= 16:
        return _window_sums(x, r)
    rows = -(-k // 16)
    pad = np.zeros((rows * 16 - k,) + x.shape[1:], _F32)
    xs = np.concatenate([x, pad]).reshape((rows, 16) + x.shape[1:])
    inner = np.moveaxis(_window_sums(np.moveaxis(xs, 1, 0), r), 0, 1)
    after = np.concatenate([_reverse_cumsum(inner[:, 0], r)[1:],
                            np.zeros((1,) + x.shape[1:], _F32)])
    return r(inner + after[:, None]).reshape((rows * 16,) + x.shape[1:])[:k]


def _promote_inexact(*vals) -> np.dtype:
    """jax's promote_dtypes_inexact of the parameters: the float dtype they share (integers,
    booleans and Python numbers defer to it), float32 when there is none or they differ."""
    floats = {np.dtype(f) for f in (_float_dtype_of(v) for v in vals) if f is not None}
    return floats.pop() if len(floats) == 1 else _F32


def multinomial(key, n, p, *, shape=None, dtype=None, unroll=1, out_sharding=None):
    """Multinomial counts of ``n`` trials over the categories of ``p``'s last axis, as
    jax.random.multinomial (the same values for float32 ``p``).

    For each category ``i`` in turn, ``binomial(keys[i], trials left, p_i / sum(p[i:]))`` with
    ``keys = split(key, K)``; ``p`` need not be normalised (negative entries count as 0). As in
    jax 0.10.2's code (its docstring says otherwise), ``shape`` is the whole result shape,
    categories last (``p`` broadcasts to it, ``n`` to ``shape[:-1]``); default ``p.shape``. The
    arithmetic runs in the dtype ``n`` and ``p`` promote to; the result is ``dtype`` (default
    float32). ``unroll`` is accepted for jax's signature (it tunes jax's scan, not the values).
    Computed on the host (every category's binomial depends on the rounds its whole batch
    needs); with ``out_sharding`` the result is placed with ``device_put``.

    >>> import numpy as np
    >>> from ctrainstate import random
    >>> from ctrainstate._src.random.discrete import multinomial
    >>> c = multinomial(random.PRNGKey(0), 100.0, np.float32([0.2, 0.3, 0.5]), shape=(4, 3))
    >>> c.shape, c.sum(-1).tolist()
    ((4, 3), [100.0, 100.0, 100.0, 100.0])
    """
    kw = _key("multinomial", key)
    for pos, v in enumerate((n, p)):
        if not _arraylike(v):
            raise TypeError(f"multinomial requires ndarray or scalar arguments, got {type(v)} "
                            f"at position {pos}.")
    if not isinstance(unroll, (bool, np.bool_)):
        operator.index(unroll)             # jax's scan: "'float' object cannot be interpreted..."
    na, pa = _param(n, "n"), _param(p, "p")
    cdt = _promote_inexact(n, p)
    if shape is None:
        shape = pa.shape
    bshape = _canon_shape(shape[:-1])
    shape = _canon_shape(shape)
    _broadcast_to_check(cdt, na.shape, bshape)
    _broadcast_to_check(cdt, pa.shape, shape)
    if not shape:
        raise ValueError("axis -1 is out of bounds for array of dimension 0")
    dt = _F32 if dtype is None else _user_dtype(dtype)
    if _abstract():
        if out_sharding is None:
            return ShapeDtypeStruct(shape, dt)
        return device_put(ShapeDtypeStruct(shape, dt), out_sharding)
    r = _rounder(cdt)
    pk = np.moveaxis(np.broadcast_to(pa.astype(cdt).astype(_F32), shape), -1, 0)
    remainder = np.broadcast_to(na.astype(cdt).astype(_F32), bshape).reshape(-1)
    ncat = shape[-1]
    pk = np.ascontiguousarray(pk).reshape(ncat, remainder.size)
    with np.errstate(all="ignore"):
        remaining = _reverse_cumsum(pk, r)
        ratios = r(pk / np.where(remaining == 0, _F(1), remaining))
    keys = split(kw, ncat)
    sampler_args = (cdt, cdt, False)
    counts = np.zeros((ncat, remainder.size), _F32)
    start = (0,) * len(bshape)
    for i in range(ncat):
        sampler = _Binomial(_key_words(keys[i]), *sampler_args)
        with np.errstate(invalid="ignore"):
            ratio = np.clip(ratios[i], _F(0), _F(1))
        counts[i] = sampler.sample(sampler.prepare(remainder, ratio), bshape, start, bshape)
        with np.errstate(invalid="ignore"):
            remainder = r(remainder - counts[i])
    out = np.moveaxis(counts.reshape((ncat,) + bshape), 0, -1)
    if dt.kind in "iu":
        out = _to_int(out, dt)
    elif dt.kind == "b":
        out = out != 0
    else:
        out = out.astype(dt)
    if out_sharding is None:
        return out
    return device_put(out, out_sharding)


# --- key helpers ----------------------------------------------------------------------------

def clone(key):
    """A copy of ``key``, as jax.random.clone (outside jax's key-reuse checking, an identity).

    ctrainstate keys are numpy arrays, so the copy is a new array with the same data; a typed
    jax key is returned as it is (jax arrays are immutable).

    >>> from ctrainstate import random
    >>> from ctrainstate._src.random.discrete import clone
    >>> k = random.PRNGKey(0)
    >>> c = clone(k)
    >>> c.tolist(), c is k
    ([0, 0], False)
    """
    dt = getattr(key, "dtype", None)
    if dt is not None and "key<" in str(dt):
        return key
    if not _arraylike(key):
        raise TypeError(f"Error interpreting argument to random_clone as a JAX value. The "
                        f"problematic value is of type {type(key)} and was passed to "
                        f"random_clone at position 0.")
    return np.array(key, copy=True)


def key_impl(keys):
    """The PRNG implementation of a key or a stack of keys, as jax.random.key_impl:
    ``'threefry2x32'`` for ctrainstate's raw ``uint32[..., 2]`` keys (and jax's legacy ones).

    >>> from ctrainstate import random
    >>> from ctrainstate._src.random.discrete import key_impl
    >>> key_impl(random.PRNGKey(0)), key_impl(random.split(random.PRNGKey(0), 4))
    ('threefry2x32', 'threefry2x32')
    """
    dt = getattr(keys, "dtype", None)
    if dt is not None and "key<" in str(dt):
        import jax  # only reachable when the caller already uses jax
        return jax.random.key_impl(keys)
    if not _arraylike(keys):
        raise TypeError(f"unexpected PRNG key type {type(keys)}")
    a = np.asarray(keys)
    bad = "JAX encountered invalid PRNG key data: expected "
    if a.ndim < 1:
        raise TypeError(f"{bad}key_data.ndim >= 1; got ndim={a.ndim}")
    if a.shape[-1] != 2:
        raise TypeError(f"{bad}key_data.shape to end with (2,); got shape={a.shape} for "
                        f"impl={_THREEFRY}")
    if a.dtype != np.uint32:
        raise TypeError(f"{bad}key_data.dtype = uint32; got dtype={a.dtype}")
    return _THREEFRY


def key_dtype(impl_spec=None) -> np.dtype:
    """The dtype of ctrainstate's keys: ``uint32``. (jax.random.key_dtype returns the typed-key
    dtype ``key<fry>``; ctrainstate keys are raw ``uint32[2]`` data, the layout of jax's
    legacy keys.) ``impl_spec``: None or ``'threefry2x32'``; jax's other PRNGs raise
    ``ValueError``, unknown names and types jax's errors.

    >>> from ctrainstate._src.random.discrete import key_dtype
    >>> key_dtype(), key_dtype("threefry2x32")
    (dtype('uint32'), dtype('uint32'))
    """
    if impl_spec is None or impl_spec == _THREEFRY:
        return np.dtype(np.uint32)
    if isinstance(impl_spec, str):
        if impl_spec in _PRNG_NAMES:
            raise ValueError(f"key_dtype: ctrainstate implements only the threefry2x32 PRNG, "
                             f"got {impl_spec!r}")
        names = ", ".join(f'"{s}"' for s in _PRNG_NAMES)
        raise ValueError(f'unrecognized PRNG implementation "{impl_spec}". Did you mean one '
                         f'of: {names}?')
    if "key<fry>" == str(impl_spec) or getattr(impl_spec, "name", None) == _THREEFRY:
        return np.dtype(np.uint32)          # jax's own key_dtype() / PRNGImpl of threefry
    raise TypeError(f"unrecognized type {type(impl_spec)} for specifying PRNG implementation.")


# under jit, each draw given a traced key is one op node of the program (ops/node.py): its key
# is read at each call, and a numpy result comes back as an Array where the key lives
from ..ops.node import op_node as _op_node  # noqa: E402
from .core import _on_key_placement  # noqa: E402

for _name in __all__:
    globals()[_name] = _op_node("random." + _name, _on_key_placement)(globals()[_name])
del _name
