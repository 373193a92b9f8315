"""``ctrainstate.nn.initializers``: flax.linen.initializers / jax.nn.initializers, sharded.

Each builder returns ``init(key, shape, dtype=float32, out_sharding=None)``
returning the same values as the JAX initializer for the same key, shape and
dtype. With ``out_sharding`` (a NamedSharding) every device fills only its own
block (no full-size temporary anywhere) and the result is a sharded
:class:`ctrainstate.Array`; without it, a host ``numpy.ndarray``.

The scalar factors (stddev, ``sqrt(variance)``...) are computed in the
parameter dtype exactly as JAX does, then each sample is multiplied by them
once, in that dtype, in the same pass that generates it.

:func:`orthogonal` needs a QR factorisation of the whole matrix: it is computed
on the host (a gather: full size in host memory) and then placed; it matches
JAX to rounding of the QR (LAPACK), not bit for bit.

>>> from ctrainstate import random
>>> from ctrainstate.nn import initializers as init
>>> w = init.lecun_normal()(random.PRNGKey(0), (64, 32))
>>> w.shape
(64, 32)
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from .._src.base import dtypes as _dtypes
from .._src.random import core as _random
from .._src.array.abstract import is_abstract, ShapeDtypeStruct
from .._src.array.array import _fill_array, device_put

__all__ = [
    "zeros", "ones", "constant", "normal", "uniform", "truncated_normal", "variance_scaling",
    "lecun_normal", "lecun_uniform", "glorot_normal", "glorot_uniform", "xavier_normal",
    "xavier_uniform", "he_normal", "he_uniform", "kaiming_normal", "kaiming_uniform",
    "orthogonal", "zeros_init", "ones_init",
]

Initializer = Callable


def _dt(dtype) -> np.dtype:
    return _random._float_dtype(dtype, "initializer")


def _full(shape, dtype, value, out_sharding):
    shape = _random._shape(shape)
    dt = _dtypes.canonicalize(dtype)
    if out_sharding is None:
        if is_abstract():
            return ShapeDtypeStruct(shape, dt)
        return np.full(shape, value, dt)

    def fill(buf, start, shard_shape):
        np.frombuffer(buf, dtype=np.uint8).view(dt)[...] = value

    return _fill_array(shape, dt, out_sharding, fill)


def zeros(key, shape, dtype=np.float32, out_sharding=None):
    """An array of zeros (the key is ignored), as jax.nn.initializers.zeros.

    >>> zeros(None, (2,)).tolist()
    [0.0, 0.0]
    """
    return _full(shape, dtype, 0, out_sharding)


def ones(key, shape, dtype=np.float32, out_sharding=None):
    """An array of ones (the key is ignored), as jax.nn.initializers.ones.

    >>> ones(None, (2,)).tolist()
    [1.0, 1.0]
    """
    return _full(shape, dtype, 1, out_sharding)


def zeros_init() -> Initializer:
    """flax.linen.initializers.zeros_init(): returns :func:`zeros`."""
    return zeros


def ones_init() -> Initializer:
    """flax.linen.initializers.ones_init(): returns :func:`ones`."""
    return ones


def constant(value, dtype=np.float32) -> Initializer:
    """Builds an initializer filling with ``value``.

    >>> constant(0.5)(None, (2,)).tolist()
    [0.5, 0.5]
    """
    def init(key, shape, dtype=dtype, out_sharding=None):
        return _full(shape, dtype, value, out_sharding)
    return init


def normal(stddev=1e-2, dtype=np.float32) -> Initializer:
    """Normal with standard deviation ``stddev``: ``random.normal(...) * stddev``.

    >>> normal(0.1)(_random.PRNGKey(0), (3,)).shape
    (3,)
    """
    def init(key, shape, dtype=dtype, out_sharding=None):
        dt = _dt(dtype)
        return _random._sample(key, _random._shape(shape), dt, out_sharding, _random._NORMAL,
                               scale=float(np.array(stddev, dt)))
    return init


def uniform(scale=1e-2, dtype=np.float32) -> Initializer:
    """Uniform in ``[0, scale)``: ``random.uniform(...) * scale``.

    >>> bool((uniform(1.0)(_random.PRNGKey(0), (100,)) < 1.0).all())
    True
    """
    def init(key, shape, dtype=dtype, out_sharding=None):
        dt = _dt(dtype)
        return _random._sample(key, _random._shape(shape), dt, out_sharding, _random._UNIFORM,
                               minval=0.0, maxval=1.0, scale=float(np.array(scale, dt)))
    return init


def truncated_normal(stddev=1e-2, dtype=np.float32, lower=-2.0, upper=2.0) -> Initializer:
    """Truncated normal on ``(lower, upper)`` times ``stddev`` (no variance correction).

    >>> float(abs(truncated_normal(1.0)(_random.PRNGKey(0), (100,))).max()) < 2.0
    True
    """
    def init(key, shape, dtype=dtype, out_sharding=None):
        dt = _dt(dtype)
        return _random._sample(key, _random._shape(shape), dt, out_sharding,
                               _random._TRUNCATED_NORMAL, lower=float(lower), upper=float(upper),
                               scale=float(np.array(stddev, dt)))
    return init


def _compute_fans(shape, in_axis=-2, out_axis=-1, batch_axis=()):
    """Effective fan-in and fan-out, as jax.nn.initializers._compute_fans."""
    if isinstance(in_axis, int) and in_axis == -2 and len(shape) <= 1:
        raise ValueError(
            f"Can't compute input and output sizes of a {len(shape)}-dimensional weights "
            "tensor with default in_axis. Must be at least 2D or specify in_axis explicitly.")
    def size(axes):
        return shape[axes] if isinstance(axes, int) else math.prod([shape[i] for i in axes])
    in_size, out_size, batch_size = size(in_axis), size(out_axis), size(batch_axis)
    receptive_field_size = math.prod(shape) / in_size / out_size / batch_size
    return in_size * receptive_field_size, out_size * receptive_field_size


def variance_scaling(scale, mode: str, distribution: str, in_axis: int | Sequence[int] = -2,
                     out_axis: int | Sequence[int] = -1, batch_axis: int | Sequence[int] = (),
                     dtype=np.float32) -> Initializer:
    """Initializer whose scale adapts to the shape, as jax.nn.initializers.variance_scaling.

    ``mode``: "fan_in", "fan_out", "fan_avg" or "fan_geo_avg"; ``distribution``:
    "truncated_normal", "normal" or "uniform" (real dtypes).

    >>> variance_scaling(2.0, "fan_in", "normal")(_random.PRNGKey(0), (8, 4)).shape
    (8, 4)
    """
    if mode not in ("fan_in", "fan_out", "fan_avg", "fan_geo_avg"):
        raise ValueError(f"invalid mode for variance scaling initializer: {mode}")
    if distribution not in ("truncated_normal", "normal", "uniform"):
        raise ValueError(
            f"invalid distribution for variance scaling initializer: {distribution}")

    def init(key, shape, dtype=dtype, out_sharding=None):
        shape = _random._shape(shape)
        dt = _dt(dtype)
        fan_in, fan_out = _compute_fans(shape, in_axis, out_axis, batch_axis)
        denominator = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2,
                       "fan_geo_avg": (fan_in * fan_out) ** 0.5}[mode]
        # Scalar factors in the parameter dtype, op by op, as JAX computes them.
        variance = np.array(scale / denominator, dtype=dt)
        if distribution == "truncated_normal":
            stddev = np.sqrt(variance) / np.array(.87962566103423978, dt)
            return _random._sample(key, shape, dt, out_sharding, _random._TRUNCATED_NORMAL,
                                   lower=-2.0, upper=2.0, scale=float(stddev.astype(dt)))
        if distribution == "normal":
            return _random._sample(key, shape, dt, out_sharding, _random._NORMAL,
                                   scale=float(np.sqrt(variance).astype(dt)))
        factor = np.sqrt((np.array(3, dt) * variance).astype(dt)).astype(dt)
        return _random._sample(key, shape, dt, out_sharding, _random._UNIFORM, minval=-1.0,
                               maxval=1.0, scale=float(factor))
    return init


def _vs(scale, mode, distribution, doc):
    def builder(in_axis=-2, out_axis=-1, batch_axis=(), dtype=np.float32) -> Initializer:
        return variance_scaling(scale, mode, distribution, in_axis=in_axis, out_axis=out_axis,
                                batch_axis=batch_axis, dtype=dtype)
    builder.__doc__ = doc
    return builder


glorot_uniform = _vs(1.0, "fan_avg", "uniform", """Glorot (Xavier) uniform: variance_scaling(1.0, "fan_avg", "uniform").

    >>> glorot_uniform()(_random.PRNGKey(0), (4, 4)).shape
    (4, 4)
    """)
glorot_normal = _vs(1.0, "fan_avg", "truncated_normal", """Glorot (Xavier) normal: variance_scaling(1.0, "fan_avg", "truncated_normal").

    >>> glorot_normal()(_random.PRNGKey(0), (4, 4)).shape
    (4, 4)
    """)
lecun_uniform = _vs(1.0, "fan_in", "uniform", """LeCun uniform: variance_scaling(1.0, "fan_in", "uniform").

    >>> lecun_uniform()(_random.PRNGKey(0), (4, 4)).shape
    (4, 4)
    """)
lecun_normal = _vs(1.0, "fan_in", "truncated_normal", """LeCun normal: variance_scaling(1.0, "fan_in", "truncated_normal").

    >>> lecun_normal()(_random.PRNGKey(0), (4, 4)).shape
    (4, 4)
    """)
he_uniform = _vs(2.0, "fan_in", "uniform", """He (Kaiming) uniform: variance_scaling(2.0, "fan_in", "uniform").

    >>> he_uniform()(_random.PRNGKey(0), (4, 4)).shape
    (4, 4)
    """)
he_normal = _vs(2.0, "fan_in", "truncated_normal", """He (Kaiming) normal: variance_scaling(2.0, "fan_in", "truncated_normal").

    >>> he_normal()(_random.PRNGKey(0), (4, 4)).shape
    (4, 4)
    """)
xavier_uniform = glorot_uniform
xavier_normal = glorot_normal
kaiming_uniform = he_uniform
kaiming_normal = he_normal


def orthogonal(scale=1.0, column_axis: int = -1, dtype=np.float32) -> Initializer:
    """Uniformly random orthogonal matrix (or stack), as jax.nn.initializers.orthogonal.

    Gathers: the normal matrix is generated and factorised (numpy QR) on the
    host, then placed with ``device_put`` if ``out_sharding`` is given. Equal to
    JAX up to rounding of the QR, not bit for bit.

    >>> q = orthogonal()(_random.PRNGKey(0), (4, 4))
    >>> bool(np.allclose(q @ q.T, np.eye(4), atol=1e-5))
    True
    """
    def init(key, shape, dtype=dtype, out_sharding=None):
        shape = _random._shape(shape)
        dt = _dt(dtype)
        if len(shape) < 2:
            raise ValueError("orthogonal initializer requires at least a 2D shape")
        if any(d == 0 for d in shape):
            return zeros(key, shape, dt, out_sharding)
        if is_abstract():
            return ShapeDtypeStruct(shape, dt, out_sharding)
        n_rows, n_cols = math.prod(shape) // shape[column_axis], shape[column_axis]
        z = _random.normal(key, (max(n_rows, n_cols), min(n_rows, n_cols)), dt)
        q, r = np.linalg.qr(z.astype(np.float32))
        q = (q * np.sign(np.diagonal(r))[None, :]).astype(dt)
        if n_rows < n_cols:
            q = q.T
        q = q.reshape(tuple(np.delete(shape, column_axis)) + (shape[column_axis],))
        q = np.moveaxis(q, -1, column_axis)
        out = (np.array(scale, dt) * q).astype(dt)
        if out_sharding is None:
            return out
        return device_put(out, out_sharding)
    return init


from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
