"""The core of :mod:`ctrainstate.random` (keys, bits, uniform, normal, the samplers built
on them); :mod:`ctrainstate.random` re-exports it with the samplers of ``_random_dist``,
``_random_gamma`` and ``_random_discrete``, which import this module."""
from __future__ import annotations

from collections.abc import Sequence as _Seq
import math
from typing import Sequence

import ml_dtypes
import numpy as np

from ... import _C
from ..base import dtypes as _dtypes
from ..ops import ops as _ops
from ..array.abstract import is_abstract, ShapeDtypeStruct
from ..array.array import _fill_array, Array, device_put
from ..array.sharding import NamedSharding, PartitionSpec, Sharding
from ..ops.node import op_node as _op_node

__all__ = [
    "PRNGKey", "key", "key_data", "wrap_key_data", "split", "fold_in", "bits", "uniform",
    "normal", "truncated_normal", "bernoulli", "permutation", "randint", "gumbel",
    "categorical", "choice",
]

_UNIFORM, _NORMAL, _TRUNCATED_NORMAL, _BERNOULLI = 0, 1, 2, 3
_FLOATS = (_dtypes.float32, _dtypes.float16, _dtypes.bfloat16)


# --- keys -----------------------------------------------------------------------

def _key_words(k) -> tuple[int, int]:
    """(k0, k1) of a raw key: anything array-like of shape (2,) with uint32 values."""
    dt = getattr(k, "dtype", None)
    # a typed jax key (its dtype is jax's, not a numpy dtype): unwrap its data. (A numpy
    # dtype is never formatted: its str() costs as much as the rest of a split.)
    if dt is not None and not isinstance(dt, np.dtype) and "key<" in str(dt):
        import jax  # only reachable when the caller already uses jax
        k = jax.random.key_data(k)
    a = np.asarray(k)
    if a.shape != (2,):
        raise TypeError(f"a PRNG key is a uint32 array of shape (2,); got shape {a.shape}"
                        + (" (split returns a stack of keys: index one)" if a.ndim == 2 else ""))
    if a.dtype != np.uint32:
        if not np.issubdtype(a.dtype, np.integer) or (a < 0).any() or (a > 0xFFFFFFFF).any():
            raise TypeError(f"a PRNG key holds uint32 values; got dtype {a.dtype}")
    return int(a[0]), int(a[1])


def PRNGKey(seed: int) -> np.ndarray:
    """Raw key for an integer seed, equal to ``jax.random.PRNGKey(seed)``.

    As in JAX with 64-bit mode off, the seed is taken modulo 2**32 (its low 32
    bits), so the key is ``[0, seed & 0xFFFFFFFF]``.

    >>> PRNGKey(42)
    array([ 0, 42], dtype=uint32)
    """
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        if isinstance(seed, np.ndarray) and seed.ndim == 0 and np.issubdtype(seed.dtype, np.integer):
            seed = int(seed)
        else:
            raise TypeError(f"PRNGKey: the seed must be a scalar integer, got {seed!r}")
    seed = int(seed)
    if not -(2 ** 63) <= seed < 2 ** 64:
        raise OverflowError(f"PRNGKey: seed {seed} does not fit in 64 bits")
    return np.array([0, seed & 0xFFFFFFFF], dtype=np.uint32)


def key(seed: int) -> np.ndarray:
    """Same as :func:`PRNGKey`: ctrainstate keys are always raw ``uint32[2]`` data.

    (``jax.random.key`` returns a typed key; ``jax.random.key_data`` of it equals
    this value.)

    >>> key(1)
    array([0, 1], dtype=uint32)
    """
    return PRNGKey(seed)


def _key_batch(k, who: str) -> np.ndarray:
    """A key or a batch of keys (shape ``(..., 2)``, uint32 values) as a new uint32 array."""
    dt = getattr(k, "dtype", None)
    if dt is not None and "key<" in str(dt):  # typed jax keys: unwrap their data
        import jax  # only reachable when the caller already uses jax
        k = jax.random.key_data(k)
    if isinstance(k, (str, bytes)) or k is None:
        raise TypeError(f"{who}: expected a PRNG key (a uint32 array of shape (2,)) or a batch "
                        f"of keys (shape (..., 2)), got {type(k).__name__}")
    a = np.asarray(k)
    if a.ndim == 0 or a.shape[-1] != 2:
        raise TypeError(f"{who}: a PRNG key is a uint32 array of shape (2,) and a batch of keys "
                        f"has shape (..., 2); got shape {a.shape}")
    if a.dtype != np.uint32:
        if not np.issubdtype(a.dtype, np.integer) or (a < 0).any() or (a > 0xFFFFFFFF).any():
            raise TypeError(f"{who}: a PRNG key holds uint32 values; got dtype {a.dtype}")
    return np.array(a, dtype=np.uint32)


def key_data(keys) -> np.ndarray:
    """The raw uint32 data of a key (shape ``(2,)``) or of a batch of keys (shape
    ``(..., 2)``, e.g. from :func:`split`), as a new array. Accepts jax keys too.

    >>> key_data(PRNGKey(3))
    array([0, 3], dtype=uint32)
    >>> key_data(split(PRNGKey(0), 5)).shape
    (5, 2)
    """
    return _key_batch(keys, "key_data")


def wrap_key_data(key_bits, *, impl=None) -> np.ndarray:
    """A key (or a batch of keys) from its raw uint32 data of shape ``(..., 2)`` (keys are
    raw data here already).

    >>> wrap_key_data(key_data(PRNGKey(7))).tolist()
    [0, 7]
    """
    if impl not in (None, "threefry2x32"):
        raise ValueError(f"wrap_key_data: only the threefry2x32 PRNG is implemented, got {impl!r}")
    return _key_batch(key_bits, "wrap_key_data")


def split(k, num: int | Sequence[int] = 2) -> np.ndarray:
    """Split a key into ``num`` new keys (``num`` an int or a shape), as jax.random.split.

    Returns a uint32 array of shape ``(num, 2)`` (or ``(*num, 2)``).

    >>> split(PRNGKey(0), 3).shape
    (3, 2)
    """
    shape = _dtypes.int_tuple(num, "split: num", scalar=True,   # split(k, 2.5) is no 2 keys
                              expected="an integer or a tuple of integers")
    if any(d < 0 for d in shape):
        raise ValueError(f"split: num must be non-negative, got {num!r}")
    n = math.prod(shape)
    if n >= 2 ** 62:
        raise ValueError(f"split: num={num!r} is too large ({n} keys)")
    k0, k1 = _key_words(k)
    out = _C.key_split(k0, k1, n)
    return out.reshape(*shape, 2)


def fold_in(k, data: int) -> np.ndarray:
    """Fold a 32-bit integer into a key, as jax.random.fold_in.

    >>> fold_in(PRNGKey(0), 1).dtype
    dtype('uint32')
    """
    if isinstance(data, (str, bytes)) or data is None:
        raise TypeError(f"fold_in: data must be an integer scalar (folded in as uint32), got "
                        f"{data!r}")
    if np.ndim(data):
        raise TypeError(f"fold_in accepts a scalar, got an array of shape {np.shape(data)}")
    try:
        d = int(data)   # a float is truncated, as jax converts it
    except (TypeError, ValueError, OverflowError):
        raise TypeError(f"fold_in: data must be an integer scalar (folded in as uint32), got "
                        f"{type(data).__name__} {data!r}") from None
    if not 0 <= d <= 0xFFFFFFFF:
        raise OverflowError(f"fold_in: data {d} is not a uint32 value")
    k0, k1 = _key_words(k)
    return np.array(_C.key_fold_in(k0, k1, d), dtype=np.uint32)


# --- filling ------------------------------------------------------------------------

def _shape(shape) -> tuple:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    shape = _dtypes.int_tuple(shape, "shape")   # (2.5,) is no shape (2,), as in jax
    if any(d < 0 for d in shape):
        raise ValueError(f"shape must have non-negative dimensions, got {shape}")
    return shape


def _float_dtype(dtype, name) -> np.dtype:
    dt = _dtypes.float32 if dtype is None else np.dtype(dtype)
    if dt == np.float64:
        dt = _dtypes.float32  # as JAX with x64 off
    if dt in _FLOATS:
        return dt
    if dt.kind == "f" or dt.name.startswith("float"):
        raise ValueError(f"dtype argument to `{name}` must be float32, float16 or bfloat16 "
                         f"in ctrainstate, got {dt}")
    raise ValueError(f"dtype argument to `{name}` must be a float dtype, got {dt}")


def _scalar(v, name) -> float:
    if np.ndim(v):
        raise ValueError(f"{name} must be a scalar in ctrainstate.random (got an array of shape "
                         f"{np.shape(v)}); array-valued bounds are not supported")
    return float(v)


def _produce(shape, dtype, out_sharding, fill, device_fill=False):
    """Run ``fill(out, global_shape, start)`` on the host or on every device's block.

    ``device_fill``: ``fill`` is a ``_C.random_fill`` that may write GPU buffers
    directly (with the device's kernel), bit-identical to the host fill.
    """
    if out_sharding is None:
        if is_abstract():
            return ShapeDtypeStruct(shape, dtype)
        out = np.empty(shape, dtype)
        fill(out, shape, (0,) * len(shape))
        return out
    if not isinstance(out_sharding, Sharding):
        raise TypeError(f"out_sharding must be a NamedSharding, got {type(out_sharding).__name__}")
    return _fill_array(shape, dtype, out_sharding,
                       lambda buf, start, shard_shape: fill(buf, shape, tuple(start)),
                       device_fill=device_fill)


def _sample(k, shape, dtype, out_sharding, dist, *, minval=0.0, maxval=1.0, lower=0.0,
            upper=0.0, p=0.0, scale=None, out_dtype=None):
    """Fill with distribution ``dist`` (internal; also used by nn.initializers)."""
    k0, k1 = _key_words(k)
    code = _dtypes.code(dtype)
    out_dtype = dtype if out_dtype is None else out_dtype

    def fill(out, gshape, start):
        _C.random_fill(out, k0, k1, gshape, start, dist, code, minval, maxval, lower, upper,
                       p, scale)

    return _produce(shape, out_dtype, out_sharding, fill, device_fill=True)


# --- samplers -------------------------------------------------------------------------

def bits(k, shape=(), dtype=None, *, out_sharding=None):
    """Uniform random bits as unsigned integers (default uint32), as jax.random.bits.

    uint8 / uint16 / uint32 are jax's bits for those widths (each element's value is a
    function of its global index, so a sharded result equals the host one); uint64 is
    supported on the host only (Arrays store no 64-bit dtype).

    >>> bits(PRNGKey(0), (3,)).dtype
    dtype('uint32')
    >>> bits(PRNGKey(0), (4,), np.uint8).dtype
    dtype('uint8')
    """
    dt = np.dtype(np.uint32 if dtype is None else dtype)
    if dt.kind != "u":
        raise ValueError(f"dtype argument to `bits` must be an unsigned int dtype, got {dt}")
    if out_sharding is not None and dt not in _dtypes.UNSIGNED:
        raise TypeError(f"bits: dtype {dt} is not supported in sharded Arrays (they store "
                        f"uint8, uint16 and uint32)")
    shape = _shape(shape)
    k0, k1 = _key_words(k)
    width = dt.itemsize * 8
    return _produce(shape, dt, out_sharding,
                    lambda out, g, s: _C.random_bits(out, k0, k1, g, s, width))


def uniform(k, shape=(), dtype=None, minval=0.0, maxval=1.0, *, out_sharding=None):
    """Uniform floats in ``[minval, maxval)``, as jax.random.uniform.

    >>> x = uniform(PRNGKey(0), (1000,), minval=-1.0, maxval=1.0)
    >>> bool(x.min() >= -1.0 and x.max() < 1.0)
    True
    """
    dt = _float_dtype(dtype, "uniform")
    return _sample(k, _shape(shape), dt, out_sharding, _UNIFORM,
                   minval=_scalar(minval, "minval"), maxval=_scalar(maxval, "maxval"))


def normal(k, shape=(), dtype=None, *, out_sharding=None):
    """Standard normal floats, as jax.random.normal (sqrt(2) * erf_inv(uniform)).

    >>> abs(float(normal(PRNGKey(0), (10000,)).mean())) < 0.05
    True
    """
    dt = _float_dtype(dtype, "normal")
    return _sample(k, _shape(shape), dt, out_sharding, _NORMAL)


def truncated_normal(k, lower, upper, shape=None, dtype=None, *, out_sharding=None):
    """Normal floats truncated to the open interval ``(lower, upper)``, as
    jax.random.truncated_normal. ``lower``/``upper`` are scalars (+-inf allowed).

    >>> x = truncated_normal(PRNGKey(0), -2.0, 2.0, (1000,))
    >>> bool(x.min() > -2.0 and x.max() < 2.0)
    True
    """
    dt = _float_dtype(dtype, "truncated_normal")
    shape = () if shape is None else _shape(shape)
    return _sample(k, shape, dt, out_sharding, _TRUNCATED_NORMAL,
                   lower=_scalar(lower, "lower"), upper=_scalar(upper, "upper"))


def bernoulli(k, p=0.5, shape=None, mode: str = "low", *, out_sharding=None):
    """Booleans that are True with probability ``p``, as jax.random.bernoulli.

    ``mode='low'`` (JAX's default): ``uniform(k, shape) < p``, one random word per
    element; in float32 it cannot produce probabilities below about 1e-7.
    ``mode='high'``: JAX's two-uniform construction, ``u2 * 2**-nmant < p - u1``
    with ``u1, u2 = uniform(k, (2, *shape))``, correct for small ``p`` at twice the
    cost. Each device (with ``out_sharding``) draws only the two words of each of
    its own elements (global indices i and size + i of the doubled shape).

    The uniforms are drawn in p's dtype (float32 for a Python float; a float16 or
    bfloat16 numpy scalar selects that dtype), as in JAX.

    >>> bernoulli(PRNGKey(0), 0.3, (4,)).dtype
    dtype('bool')
    >>> int(bernoulli(PRNGKey(0), 1e-9, (10 ** 6,), mode="high").sum()) <= 1
    True
    """
    if mode not in ("low", "high"):
        raise ValueError(f"got mode={mode!r}, expected 'high' or 'low'")
    pdt = np.asarray(p).dtype
    if pdt.kind != "f" and pdt not in _FLOATS:
        raise TypeError(f"bernoulli probability `p` must have a floating dtype, got {pdt}")
    pdt = _float_dtype(pdt, "bernoulli")
    shape = () if shape is None else _shape(shape)
    pv = _scalar(p, "p")
    if mode == "low":
        return _sample(k, shape, pdt, out_sharding, _BERNOULLI, p=pv, out_dtype=_dtypes.bool_)
    k0, k1 = _key_words(k)
    code = _dtypes.code(pdt)
    p_t = np.asarray(pv).astype(pdt)  # p in the sampling dtype, as JAX converts it
    scale = pdt.type(2.0 ** -int(ml_dtypes.finfo(pdt).nmant))  # also knows bfloat16

    def fill(out, gshape, start):
        # this block's elements of u1 = u[0] and u2 = u[1], u = uniform(k, (2, *gshape)),
        # computed on the host; out: a host array, or a CPU device's buffer
        blk = tuple(out.shape)
        u = np.empty((2,) + blk, pdt)
        for half in (0, 1):
            _C.random_fill(u[half:half + 1], k0, k1, (2,) + tuple(gshape), (half,) + tuple(start),
                           _UNIFORM, code, 0.0, 1.0, 0.0, 0.0, 0.0, None)
        res = np.less(u[1] * scale, p_t - u[0])
        if isinstance(out, np.ndarray):
            out[...] = res
        else:
            _C.copy_from_host(out, res.view(np.uint8), (0,) * len(blk))

    return _produce(shape, _dtypes.bool_, out_sharding, fill)


def permutation(k, x, axis: int = 0, independent: bool = False, *, out_sharding=None):
    """A random permutation of ``range(x)`` (int x) or of ``x`` along ``axis``, as
    jax.random.permutation (repeated stable sorts by random 32-bit keys).

    Computed on the host (a permutation is a global operation); with
    ``out_sharding`` the result is then placed with ``device_put``.

    >>> sorted(permutation(PRNGKey(0), 5).tolist())
    [0, 1, 2, 3, 4]
    """
    if np.ndim(x) == 0:
        if not np.issubdtype(np.asarray(x).dtype, np.integer):
            raise TypeError("x must be an integer or at least 1-dimensional")
        arr, axis = np.arange(int(x), dtype=np.int32), 0
    else:
        arr = np.asarray(x)
        if arr.dtype in _dtypes._NARROW:       # int64 -> int32, float64 -> float32 (as JAX)
            arr = arr.astype(_dtypes._NARROW[arr.dtype])
        axis = axis + arr.ndim if axis < 0 else axis
        if not 0 <= axis < arr.ndim:
            raise ValueError(f"axis {axis} is out of bounds for an array of rank {arr.ndim}")
    if independent or arr.ndim == 1:
        out = _shuffle(k, arr, axis)
    else:
        idx = _shuffle(k, np.arange(arr.shape[axis], dtype=np.int32), 0)
        out = np.take(arr, idx, axis=axis)
    if out_sharding is None:
        return out
    return device_put(out, out_sharding)


def _shuffle(k, x, axis):
    exponent = 3  # JAX's heuristic number of sort rounds (see jax.random._shuffle)
    uint32max = np.iinfo(np.uint32).max
    num_rounds = int(np.ceil(exponent * np.log(max(1, x.size)) / np.log(uint32max)))
    for _ in range(num_rounds):
        k, sub = split(k)
        sort_keys = bits(sub, x.shape)
        order = np.argsort(sort_keys, axis=axis, kind="stable")
        x = np.take_along_axis(x, order, axis=axis)
    return x


def _rem(a: np.ndarray, n) -> np.ndarray:
    """Unsigned remainder with XLA's convention that ``x % 0 == x``."""
    n = np.asarray(n, dtype=a.dtype)
    return np.where(n == 0, a, a % np.where(n == 0, 1, n)).astype(a.dtype)


def randint(k, shape, minval, maxval, dtype=None, *, out_sharding=None):
    """Uniform integers in ``[minval, maxval)``, as jax.random.randint (same values).

    As in JAX, two 32-bit words are drawn per element (from the two halves of
    ``split(k)``) and reduced modulo the span; bounds are clipped to the dtype's range
    (``maxval`` one past its maximum is allowed) and ``maxval <= minval`` gives ``minval``.
    ``minval``/``maxval`` are scalars; the values are computed on the host and placed by
    ``out_sharding`` when given.

    >>> x = randint(PRNGKey(0), (1000,), 0, 10)
    >>> str(x.dtype), int(x.min()), int(x.max())
    ('int32', 0, 9)
    """
    dt = np.dtype(np.int32 if dtype is None else dtype)
    if dt == np.int64:
        dt = np.dtype(np.int32)      # as JAX with x64 off
    if dt.kind not in "iu":
        raise TypeError(f"randint only accepts integer dtypes, got {dt}")
    if dt.itemsize > 4:
        raise TypeError(f"randint: 64-bit dtypes need x64, which ctrainstate does not have; "
                        f"got {dt}")
    lo_v, hi_v = (_int_scalar(v, n) for v, n in ((minval, "minval"), (maxval, "maxval")))
    info = np.iinfo(dt)
    sample_dt = np.dtype(np.int32) if dt.itemsize < 4 else dt   # small ints: sample in 32 bits
    if dt.itemsize < 4:
        lo_v = min(max(lo_v, int(info.min)), int(info.max))
        hi_v = min(max(hi_v, int(info.min)), int(info.max) + 1)
    sinfo = np.iinfo(sample_dt)
    out_of_range = hi_v > int(sinfo.max)
    lo_v = min(max(lo_v, int(sinfo.min)), int(sinfo.max))
    hi_v = min(max(hi_v, int(sinfo.min)), int(sinfo.max))
    shape = _shape(shape)
    k1, k2 = split(k)
    high = bits(k1, shape)
    low = bits(k2, shape)
    u32 = np.uint32
    span = (hi_v - lo_v) & 0xFFFFFFFF if hi_v > lo_v else 1
    if out_of_range and hi_v > lo_v:
        span = (span + 1) & 0xFFFFFFFF          # 2**32 wraps to 0: the remainders are no-ops
    span = u32(span)
    with np.errstate(over="ignore"):
        mult = _rem(np.asarray(u32(1 << 16)), span)
        mult = _rem(np.asarray(mult * mult, u32), span)
        off = _rem((_rem(high, span) * mult + _rem(low, span)).astype(u32), span)
        vals = (np.asarray(lo_v).astype(sample_dt) + off.astype(sample_dt)).astype(sample_dt)
    vals = vals.astype(dt)
    if out_sharding is not None:
        return device_put(vals, out_sharding)
    return vals


def _int_scalar(v, name) -> int:
    if np.ndim(v):
        raise ValueError(f"{name} must be a scalar in ctrainstate.random.randint (got an array "
                         f"of shape {np.shape(v)}); array-valued bounds are not supported")
    a = np.asarray(v)
    if not np.issubdtype(a.dtype, np.integer):
        a = a.astype(np.int64)   # JAX truncates float bounds to integers
    return int(a)


# --- gumbel, categorical, choice ---------------------------------------------------------

def _xla_log(x: np.ndarray, fn: int = 0) -> np.ndarray:
    """XLA's float32 log (fn 0) or log1p (fn 1) of a float32 array, as jnp.log on CPU."""
    out = np.array(x, dtype=np.float32, order="C")
    _C.xla_math(fn, out)
    return out


def gumbel(k, shape=(), dtype=None, mode=None, *, out_sharding=None):
    """Standard Gumbel floats, as jax.random.gumbel (same bits).

    ``mode='low'`` (JAX's default): ``-log(-log(u))`` with ``u = max(uniform(k, shape),
    tiny)`` — JAX's ``uniform(minval=tiny, maxval=1)`` as XLA simplifies it. ``mode='high'``:
    JAX's two-uniform construction (``u = uniform(k, (2, *shape))``, ``-log(-log1p(-x))``),
    larger samples reachable at twice the cost. The logs are XLA's float32 log / log1p (the C
    core's copy), computed in float32 and rounded to ``dtype`` after each, as XLA does.
    Samples are finished on the host, block by block; with ``out_sharding`` each device's
    block is computed from its own elements' words only.

    >>> x = gumbel(PRNGKey(0), (10000,))
    >>> abs(float(x.mean()) - 0.5772) < 0.05   # Euler's constant
    True
    """
    dt = _float_dtype(dtype, "gumbel")
    mode = "low" if mode is None else mode
    if mode not in ("highest", "high", "low"):
        raise ValueError(f"Must provide valid mode for gumbel got: {mode}")
    if mode == "highest":
        raise NotImplementedError("gumbel: mode='highest' is not implemented; use 'low' or 'high'")
    shape = _shape(shape)
    k0, k1 = _key_words(k)
    code = _dtypes.code(dt)
    info = ml_dtypes.finfo(dt)
    tiny = np.asarray(info.tiny, dt)

    def rnd(v):  # float32 -> dtype -> float32: XLA rounds each op's result to dtype
        return np.asarray(v, np.float32).astype(dt).astype(np.float32)

    def fill(out, gshape, start):
        blk = tuple(out.shape)
        if mode == "low":
            u = np.empty(blk, dt)
            _C.random_fill(u, k0, k1, tuple(gshape), tuple(start), _UNIFORM, code, 0.0, 1.0,
                           0.0, 0.0, 0.0, None)
            u = np.maximum(u, tiny).astype(np.float32)
            res = -rnd(_xla_log(-rnd(_xla_log(u))))
        else:
            u = np.empty((2,) + blk, dt)
            for half in (0, 1):
                _C.random_fill(u[half:half + 1], k0, k1, (2,) + tuple(gshape),
                               (half,) + tuple(start), _UNIFORM, code, 0.0, 1.0, 0.0, 0.0, 0.0,
                               None)
            high, low = u[0], u[1]
            lo = (low * np.asarray(2.0 ** -int(info.nmant), dt)).astype(dt)
            x = np.where(high >= 0.5, high, ((high + lo).astype(dt) + tiny).astype(dt))
            res = -rnd(_xla_log(-rnd(_xla_log(-x.astype(np.float32), 1))))
        res = res.astype(dt)
        if isinstance(out, np.ndarray):
            out[...] = res
        else:
            _C.copy_from_host(out, res, (0,) * len(blk))

    return _produce(shape, dt, out_sharding, fill)


def _logits_dtype(dt) -> np.dtype:
    dt = np.dtype(dt)
    dt = _dtypes._NARROW.get(dt, dt)
    if dt not in _FLOATS:
        raise ValueError(f"dtype argument to `gumbel` must be a float dtype, got {dt}")
    return dt


def _check_axis(axis, ndim):
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"axis must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise _dtypes.AxisError(int(axis), ndim)
    return int(axis)


def _top_k_indices(z: np.ndarray, kk: int) -> np.ndarray:
    """lax.top_k's indices along the last axis: largest first in the float total order
    (-NaN < -inf < -0.0 < 0.0 < inf < NaN), equal values by position."""
    b = np.ascontiguousarray(z, np.float32).view(np.int32).astype(np.int64)
    order_key = np.where(b < 0, -(b & 0x7FFFFFFF) - 1, b)
    return np.argsort(-order_key, axis=-1, kind="stable")[..., :kk].astype(np.int32)


def categorical(k, logits, axis: int = -1, shape=None, replace: bool = True, mode=None):
    """Samples from categorical distributions, as jax.random.categorical (the same indices).

    ``replace=True``: ``argmax(gumbel(k, (*prefix, *logits_shape)) + logits, axis)``, JAX's
    Gumbel-max recipe, where ``shape`` (default: ``logits.shape`` without ``axis``) must end
    with a shape the batch dimensions broadcast to and ``prefix`` is the rest.
    ``replace=False``: the Gumbel top-k trick, ``prod(prefix)`` distinct categories per batch
    element, the draws leading the result.

    ``logits`` may be a numpy array (the result is a host int32 array, as the other samplers
    without ``out_sharding``) or a float32 :class:`ctrainstate.Array`: then the Gumbel noise
    is drawn with the logits' sharding (each device its own block), added on the devices,
    and :func:`ctrainstate.numpy.argmax` gives an int32 Array sharded like the batch
    dimensions — a sharded category axis included. (Without replacement the top-k runs on
    the host and the result is replicated on the logits' devices.)

    >>> logits = np.log(np.array([0.1, 0.6, 0.3], np.float32))
    >>> s = categorical(PRNGKey(0), logits, shape=(10000,))
    >>> np.round(np.bincount(s, minlength=3) / 10000, 1).tolist()
    [0.1, 0.6, 0.3]
    """
    _key_words(k)
    on_device = isinstance(logits, Array)
    if on_device:
        logits._check_alive()
        if logits.dtype != _dtypes.float32:
            raise TypeError(f"categorical: Array logits are float32 (ctrainstate ops compute "
                            f"in float32); got {logits.dtype}: cast them, or pass a numpy array")
        dt = _dtypes.float32
    elif isinstance(logits, ShapeDtypeStruct):
        dt = _logits_dtype(logits.dtype)
    else:
        logits = np.asarray(logits)
        dt = _logits_dtype(logits.dtype)
        logits = logits.astype(dt, copy=False)
    lshape = tuple(logits.shape)
    nd = len(lshape)
    axis = _check_axis(axis, nd)
    batch_shape = tuple(int(s) for s in np.delete(np.array(lshape, dtype=np.int64), axis))
    if shape is None:
        shape = batch_shape
    else:
        shape = _shape(shape)
        try:
            res = tuple(np.broadcast_shapes(shape, batch_shape))
        except ValueError:
            raise ValueError(f"Incompatible shapes for broadcasting: shapes={[shape, batch_shape]}") from None
        if res != shape:
            raise ValueError(
                f"categorical parameter shapes must be broadcast-compatible with shape "
                f"argument, and the result of broadcasting the shapes must equal the shape "
                f"argument, but got result {res} for shape argument {shape}.")
    prefix = shape[:len(shape) - len(batch_shape)]
    n = lshape[axis]
    if not replace:
        kk = math.prod(prefix)
        if kk > n:
            raise ValueError(f"Number of samples without replacement ({kk}) cannot exceed "
                             f"number of categories ({n}).")
        if shape != prefix + batch_shape:
            raise ValueError(f"categorical without replacement: shape {shape} must be the "
                             f"draws followed by the batch shape {batch_shape}")
    if isinstance(logits, ShapeDtypeStruct) or is_abstract():
        return ShapeDtypeStruct(shape, _dtypes.int32)
    if replace:
        ax = axis - nd if axis >= 0 else axis
        gshape = list(shape[len(shape) - len(batch_shape):])
        gshape.insert(ax % nd, n)
        gshape = tuple(prefix) + tuple(gshape)
        if not on_device:
            z = (gumbel(k, gshape, dt, mode) + logits).astype(np.float32)
            return np.asarray(np.argmax(z, axis=ax), dtype=np.int32)
        place = _ops._place_of(logits)
        ln = _ops._norm(logits.sharding, nd) if _ops._mesh_key(logits)[0] == "mesh" else [()] * nd
        off = len(gshape) - nd
        gnorm = [()] * off + [ln[j] if lshape[j] == gshape[off + j] else () for j in range(nd)]
        g = gumbel(k, gshape, dt, mode, out_sharding=_ops._sharding_for(place, gnorm))
        return _ops.argmax(_ops._binary_raw(_ops.B_ADD, g, logits), axis=ax)
    if on_device:
        g = gumbel(k, lshape, dt, mode, out_sharding=logits.sharding)
        z = np.asarray(_ops._binary_raw(_ops.B_ADD, logits, g))
    else:
        z = (logits + gumbel(k, lshape, dt, mode)).astype(np.float32)
    idx = _top_k_indices(np.moveaxis(z, axis, -1), kk)          # (*batch, k)
    out = np.moveaxis(idx, -1, 0).reshape(shape)
    if on_device:
        return device_put(out, _ops._sharding_for(_ops._place_of(logits), [()] * len(shape)))
    return out


def _xla_cumsum(x: np.ndarray) -> np.ndarray:
    """jnp.cumsum of a float32 vector on CPU, bit for bit: XLA rewrites the scan into rows of
    16 summed in order, plus the (recursively scanned) totals of the rows before."""
    n = x.shape[0]
    if n <= 16:
        return np.add.accumulate(x.astype(np.float32))
    rows = -(-n // 16)
    padded = np.zeros(rows * 16, np.float32)
    padded[:n] = x
    inner = np.add.accumulate(padded.reshape(rows, 16), axis=1)
    before = np.concatenate([np.zeros(1, np.float32), _xla_cumsum(inner[:, -1])[:-1]])
    return (inner + before[:, None]).reshape(-1)[:n]


def _sort_key(v: np.ndarray) -> np.ndarray:
    """jax's sort order of float32 values as int64: -0.0 == 0.0, every NaN above inf."""
    v = np.where(v == 0, np.float32(0), v).astype(np.float32)
    b = np.where(np.isnan(v), np.int64(0x7FC00000),
                 np.ascontiguousarray(v).view(np.int32).astype(np.int64))
    return np.where(b < 0, -(b & 0x7FFFFFFF) - 1, b)


def _searchsorted_left(a: np.ndarray, v: np.ndarray) -> np.ndarray:
    """jnp.searchsorted(a, v) (side='left', method='scan'): the same fixed number of
    bisection steps and jax's sort comparator, so unsorted or NaN inputs agree too."""
    n = a.shape[0]
    ka, kv = _sort_key(a), _sort_key(v)
    low = np.zeros(v.shape, np.int64)
    high = np.full(v.shape, n, np.int64)
    for _ in range(int(np.ceil(np.log2(n + 1)))):
        mid = low + (high - low) // 2
        go_left = kv <= ka[np.minimum(mid, n - 1)]
        low, high = np.where(go_left, low, mid), np.where(go_left, mid, high)
    return high.astype(np.int32)


def choice(k, a, shape=(), replace: bool = True, p=None, axis: int = 0, mode=None, *,
           out_sharding=None):
    """A random sample of ``a`` (an array, or ``range(a)`` for an int) along ``axis``, as
    jax.random.choice (the same values).

    ``p=None``: with replacement ``randint`` indices, without it the first draws of
    :func:`permutation`. With ``p`` (a 1-d vector of ``a.shape[axis]`` weights, float32):
    with replacement, the first ``i`` whose cumulative weight reaches
    ``total * (1 - uniform)`` (jnp.cumsum's exact summation order and searchsorted);
    without it, the Gumbel top-k of ``gumbel + log(p)`` (XLA's log). The result has
    shape ``a.shape[:axis] + shape + a.shape[axis + 1:]`` and is computed on the host (a
    numpy array; placed with ``device_put`` when ``out_sharding`` is given). As in JAX,
    ``p`` is not checked for negative entries, and without replacement ``p`` needs at least
    as many nonzero entries as draws.

    >>> sorted(choice(PRNGKey(0), 5, (5,), replace=False).tolist())
    [0, 1, 2, 3, 4]
    >>> choice(PRNGKey(1), np.array([10, 20, 30]), (4,), p=np.array([0., 1., 0.])).tolist()
    [20, 20, 20, 20]
    """
    _key_words(k)
    if not isinstance(shape, _Seq):
        raise TypeError(f"shape argument of jax.random.choice must be a sequence, got {shape}")
    shape = _shape(shape)
    arr = np.asarray(a)
    if arr.dtype in _dtypes._NARROW:
        arr = arr.astype(_dtypes._NARROW[arr.dtype])
    if arr.ndim == 0:
        n_inputs = int(arr)
    else:
        axis = _check_axis(axis, arr.ndim) % arr.ndim
        n_inputs = arr.shape[axis]
    n_draws = math.prod(shape)
    if n_draws == 0:
        return _placed(np.zeros(shape, dtype=arr.dtype), out_sharding)
    if n_inputs <= 0:
        raise ValueError("a must be greater than 0 unless no samples are taken")
    if not replace and n_draws > n_inputs:
        raise ValueError(f"Cannot take a larger sample (size {n_draws}) than population "
                         f"(size {n_inputs}) when 'replace=False'")
    if p is None:
        if replace:
            ind = randint(k, shape, 0, n_inputs)
            result = ind if arr.ndim == 0 else np.take(arr, ind, axis)
        else:
            perm = permutation(k, n_inputs if arr.ndim == 0 else arr, axis)
            result = np.take(perm, np.arange(n_draws), axis=0 if arr.ndim == 0 else axis)
    else:
        p_arr = np.asarray(p)
        if p_arr.dtype.kind not in "biuf" and p_arr.dtype not in _FLOATS:
            raise TypeError(f"choice: p must be real, got dtype {p_arr.dtype}")
        p_arr = p_arr.astype(np.float32)
        if p_arr.shape != (n_inputs,):
            raise ValueError(
                "p must be None or a 1D vector with the same size as a.shape[axis]. "
                f"p has shape {p_arr.shape} and a.shape[axis] is {n_inputs}.")
        if replace:
            p_cuml = _xla_cumsum(p_arr)
            r = p_cuml[-1] * (np.float32(1) - uniform(k, shape, np.float32))
            ind = _searchsorted_left(p_cuml, r.astype(np.float32))
        else:
            g = gumbel(k, (n_inputs,), np.float32, mode) + _xla_log(p_arr)
            ind = _top_k_indices(g, n_draws)
        result = ind if arr.ndim == 0 else np.take(arr, ind, axis)
    out = result.reshape(shape if arr.ndim == 0 else
                         arr.shape[0:axis] + tuple(shape) + arr.shape[axis + 1:])
    return _placed(out, out_sharding)


def _placed(x: np.ndarray, out_sharding):
    if out_sharding is None:
        return x
    return device_put(x, out_sharding)


# --- under jit: a draw from a key Array is one node of the program (ops/node.py) -------------

def _on_key_placement(r, ins):
    """A draw's result as an Array: an Array as it is, a numpy array placed replicated where
    the key (the first input Array) lives."""
    if type(r) is Array:
        return r
    if isinstance(r, tuple):
        return tuple(_on_key_placement(x, ins) for x in r)
    sh = ins[0].sharding
    if isinstance(sh, NamedSharding):
        sh = NamedSharding(sh.mesh, PartitionSpec())
    return device_put(np.asarray(r), sh)


for _name in ("split", "fold_in", "bits", "uniform", "normal", "truncated_normal", "bernoulli",
              "randint", "gumbel", "categorical", "permutation", "choice",
              "_sample"):   # (_sample: the initializers' draws, nn.initializers)
    globals()[_name] = _op_node("random." + _name, _on_key_placement)(globals()[_name])
del _name
