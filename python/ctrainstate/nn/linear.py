"""Layers: Dense, DenseGeneral, Embed, LayerNorm (mirror of ``flax.linen``).

Parameter names, shapes, default initializers and the order in which keys are
drawn follow Flax, so the same key gives the same parameters.
``DenseGeneral(kernel_axes=...)`` / ``Embed(embedding_axes=...)`` declare
logical axes with ``param_with_axes`` (t5x style): under ``with mesh,
axis_rules(rules):`` those parameters are born sharded.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from .. import numpy as cnp
from ..array import Array, device_put
from . import initializers
from .module import Module, compact

default_kernel_init = initializers.lecun_normal()

__all__ = ["Dense", "DenseGeneral", "Embed", "LayerNorm"]


def _in_features(x) -> int:
    return int(np.shape(x)[-1])


def _check_dtype(module) -> None:
    """Layers compute in float32: a lower-precision computation ``dtype`` (Flax's mixed
    precision, e.g. ``dtype=jnp.bfloat16``) is refused rather than silently run in float32."""
    dt = getattr(module, "dtype", None)
    if dt is not None and np.dtype(dt) != np.float32:
        raise NotImplementedError(
            f"{type(module).__name__}(dtype={np.dtype(dt)}): ctrainstate layers compute in "
            f"float32 only; drop dtype= (or pass float32) and the outputs are float32 (Flax "
            f"would compute and return {np.dtype(dt)})")


def _precision(module):
    """``module.precision``, checked now so a bad value names the module (the product
    resolves it again: ``None`` is the thread's default, see :mod:`ctrainstate._precision`)."""
    from .._precision import resolve_precision
    resolve_precision(module.precision, f"{type(module).__name__}(precision=...)")
    return module.precision


class Dense(Module):
    """``y = x @ kernel + bias`` with ``kernel`` of shape ``(in, features)``.

    ``precision`` is the product's (``jnp.matmul``'s ``precision=``, Flax's field): ``None``
    (the thread's default: float32 unless ``default_matmul_precision`` says otherwise),
    ``'tensorfloat32'`` / ``Precision.HIGH``, ``'bfloat16'``, ``'float32'`` / ``HIGHEST``...;
    the gradient's products use it too.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> v = nn.Dense(3).init(random.PRNGKey(0), np.ones((1, 2), np.float32))
    >>> v['params']['kernel'].shape, v['params']['bias'].shape
    ((2, 3), (3,))
    """

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = np.float32
    precision: Any = None
    kernel_init: Callable = default_kernel_init
    bias_init: Callable = initializers.zeros_init()

    @compact
    def __call__(self, inputs):
        _check_dtype(self)
        precision = _precision(self)
        kernel = self.param("kernel", self.kernel_init, (_in_features(inputs), self.features),
                            self.param_dtype)
        y = cnp.matmul(inputs, kernel, precision=precision)
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            y = y + bias
        return y


def _canon(axes, ndim):
    if isinstance(axes, int):
        axes = (axes,)
    return tuple(a % ndim for a in axes)


class DenseGeneral(Module):
    """Dense over several input axes and/or producing several feature axes (Flax's
    ``DenseGeneral`` without ``batch_dims``).

    ``axis``: input axes contracted (default the last); ``features``: an int or a
    tuple of output sizes. As in Flax, the kernel (and bias) initializer sees the
    flattened 2-d shape ``(prod(in), prod(features))``. ``kernel_axes``: logical
    axis names of the kernel (``len(axis) + len(features)`` names), declared with
    ``param_with_axes`` as in t5x's ``DenseGeneral`` (the bias takes the feature
    names). Multi-axis kernels are generated on the host and scattered; 2-d ones
    are generated in place on each device. ``precision``: the product's, as
    :class:`Dense`'s.
    """

    features: Any
    axis: Any = -1
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = np.float32
    kernel_init: Callable = default_kernel_init
    bias_init: Callable = initializers.zeros_init()
    precision: Any = None
    kernel_axes: tuple = ()

    @compact
    def __call__(self, inputs):
        _check_dtype(self)
        precision = _precision(self)
        feats = (self.features,) if isinstance(self.features, int) else tuple(self.features)
        nd = len(np.shape(inputs))
        axes = _canon(self.axis, nd)
        in_shape = tuple(np.shape(inputs)[a] for a in axes)
        kshape = in_shape + feats
        flat = (math.prod(in_shape), math.prod(feats))
        kernel = self._declare("kernel", _flat_init(self.kernel_init, flat), kshape,
                               tuple(self.kernel_axes) or None)
        x = inputs
        keep = [d for d in range(nd) if d not in axes]
        if axes != tuple(range(nd - len(axes), nd)):
            x = cnp.transpose(x, keep + list(axes))
        batch_shape = tuple(np.shape(inputs)[d] for d in keep)
        x2 = cnp.reshape(x, batch_shape + (flat[0],)) if len(axes) != 1 else x
        k2 = cnp.reshape(kernel, flat) if kshape != flat else kernel
        y = cnp.matmul(x2, k2, precision=precision)
        if len(feats) != 1:
            y = cnp.reshape(y, batch_shape + feats)
        if self.use_bias:
            bias = self._declare("bias", _flat_init(self.bias_init, (flat[1],)), feats,
                                 tuple(self.kernel_axes[len(axes):]) or None)
            y = y + bias
        return y

    def _declare(self, name, init, shape, axes):
        if axes:
            from ..partitioning import param_with_axes
            return param_with_axes(name, init, shape, self.param_dtype, axes=axes, module=self)
        return self.param(name, init, shape, self.param_dtype)


def _flat_init(init_fn, flat_shape):
    """Call ``init_fn`` on ``flat_shape`` and reshape to the requested shape (Flax's
    ``kernel_init_wrap``); in place on devices when no reshape is needed."""
    from .module import _accepts_out_sharding

    def init(key, shape, dtype=np.float32, out_sharding=None):
        shape = tuple(shape)
        if shape == tuple(flat_shape):
            if out_sharding is not None and _accepts_out_sharding(init_fn):
                return init_fn(key, shape, dtype, out_sharding=out_sharding)
            v = init_fn(key, shape, dtype)
        else:
            v = init_fn(key, tuple(flat_shape), dtype)
            v = np.reshape(np.asarray(v), shape) if not hasattr(v, "reshape") or isinstance(v, np.ndarray) else v.reshape(shape)
        if out_sharding is not None:
            return device_put(v, out_sharding)
        return v
    return init


class Embed(Module):
    """Embedding lookup: ``embedding[inputs]`` with ``embedding`` of shape
    ``(num_embeddings, features)``; ``attend(query)`` is ``query @ embedding.T``."""

    num_embeddings: int
    features: int
    dtype: Any = None
    param_dtype: Any = np.float32
    embedding_init: Callable = initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
    embedding_axes: tuple = ()

    def setup(self):
        shape = (self.num_embeddings, self.features)
        if self.embedding_axes:
            from ..partitioning import param_with_axes
            self.embedding = param_with_axes("embedding", self.embedding_init, shape,
                                             self.param_dtype, axes=tuple(self.embedding_axes),
                                             module=self)
        else:
            self.embedding = self.param("embedding", self.embedding_init, shape, self.param_dtype)

    def __call__(self, inputs):
        _check_dtype(self)
        idx = np.asarray(inputs)
        if not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"Embed expects integer inputs, got {idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_embeddings):
            raise ValueError(f"Embed: indices must be in [0, {self.num_embeddings}), got "
                             f"[{idx.min()}, {idx.max()}]")
        return cnp.take_rows(self.embedding, idx)

    def attend(self, query):
        _check_dtype(self)
        return cnp.matmul(query, cnp.transpose(self.embedding))


class LayerNorm(Module):
    """Layer normalisation over the last axis (Flax's defaults: ``epsilon=1e-6``, scale
    and bias)."""

    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = np.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Callable = initializers.zeros_init()
    scale_init: Callable = initializers.ones_init()

    @compact
    def __call__(self, x):
        _check_dtype(self)
        feat = _in_features(x)
        mean = cnp.mean(x, axis=-1, keepdims=True)
        mean2 = cnp.mean(cnp.square(x), axis=-1, keepdims=True)
        var = cnp.maximum(mean2 - cnp.square(mean), 0.0)
        y = (x - mean) * cnp.rsqrt(var + self.epsilon)
        if self.use_scale:
            y = y * self.param("scale", self.scale_init, (feat,), self.param_dtype)
        if self.use_bias:
            y = y + self.param("bias", self.bias_init, (feat,), self.param_dtype)
        return y
