"""Normalization layers: LayerNorm and RMSNorm (mirror of ``flax.linen.normalization``).

Flax's arithmetic, step for step: statistics over ``reduction_axes`` (the fast variance
``max(0, E[x^2] - E[x]^2)`` by default, or ``E[(x - E[x])^2]``), then ``y = (x - mean) *
(rsqrt(var + epsilon) * scale) + bias`` with ``scale``/``bias`` of the shape of the
``feature_axes``. An optional ``mask`` restricts the statistics to the positions it sets,
as ``jnp.mean(..., where=mask)`` does. Parameter names (``scale``, ``bias``) and
initializers are Flax's. Over a dimension sharded on mesh axes the means end in
all-reduces over them, so ``axis_name`` (pmap/shard_map) is neither needed nor accepted.

>>> import numpy as np
>>> from ctrainstate import nn, random
>>> x = np.array([[3.0, 4.0]], np.float32)
>>> v = nn.RMSNorm().init(random.PRNGKey(0), x)
>>> v['params']['scale'].shape
(2,)
>>> [round(float(a), 4) for a in np.asarray(nn.RMSNorm().apply(v, x))[0]]   # x / sqrt(12.5)
[0.8485, 1.1314]
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import numpy as cnp
from ..array import Array
from . import initializers
from .dtypes import canonicalize_dtype, promote_dtype
from .linear import _check_dtype
from .module import Module, compact

__all__ = ["LayerNorm", "RMSNorm"]


def _canon_axes(axes, ndim, what) -> tuple:
    """Sorted, deduplicated non-negative axes (Flax's ``_canonicalize_axes``), checked."""
    if isinstance(axes, (int, np.integer)):
        axes = (axes,)
    out = set()
    for a in axes:
        if not -ndim <= int(a) < ndim:
            raise ValueError(f"{what}: axis {a} is out of bounds for an input of rank {ndim}")
        out.add(int(a) % ndim)
    return tuple(sorted(out))


def _no_axis_name(module):
    if module.axis_name is not None or module.axis_index_groups is not None:
        raise NotImplementedError(
            f"{type(module).__name__}(axis_name=..., axis_index_groups=...): pmap/shard_map "
            f"statistics have no equivalent here and are not needed: over a dimension sharded "
            f"on mesh axes the means already all-reduce over them (drop axis_name)")


def _masked_mean(x, axes, mask):
    if mask is None:
        return cnp.mean(x, axis=axes, keepdims=True)
    # jnp.mean(x, axes, where=mask): sum of the selected elements / their count
    total = cnp.sum(cnp.where(mask, x, 0.0), axis=axes, keepdims=True)
    m = mask if isinstance(mask, Array) else np.broadcast_to(np.asarray(mask, bool), np.shape(x))
    if isinstance(m, Array):
        m = cnp.broadcast_to(cnp.where(m, 1.0, 0.0), np.shape(x))
        count = cnp.sum(m, axis=axes, keepdims=True)
    else:
        count = m.sum(axis=axes, keepdims=True).astype(np.float32)
    return cnp.divide(total, count)


def _compute_stats(x, axes, use_mean: bool, use_fast_variance: bool, mask):
    """``(mean, var)`` over ``axes`` (kept as size-1 dims); mean is None without use_mean.
    Always float32, as Flax's ``force_float32_reductions`` (a 16-bit ``x`` is converted)."""
    x, = promote_dtype(x, dtype=np.float32)
    if not use_mean:
        return None, _masked_mean(cnp.square(x), axes, mask)
    mu = _masked_mean(x, axes, mask)
    if use_fast_variance:
        mu2 = _masked_mean(cnp.square(x), axes, mask)
        # E[x^2] - E[x]^2 can round below zero: clipped as Flax does
        return mu, cnp.maximum(0.0, cnp.subtract(mu2, cnp.square(mu)))
    return mu, _masked_mean(cnp.square(cnp.subtract(x, mu)), axes, mask)


def _normalize(mdl: Module, x, mean, var, feature_axes, epsilon, use_bias, use_scale,
               bias_init, scale_init):
    shape = tuple(np.shape(x))
    feature_shape = [1] * len(shape)
    reduced = []
    for ax in feature_axes:
        feature_shape[ax] = shape[ax]
        reduced.append(shape[ax])
    y = x if mean is None else cnp.subtract(x, mean)
    mul = cnp.rsqrt(cnp.add(var, float(epsilon)))
    if use_scale:
        scale = mdl.param("scale", scale_init, tuple(reduced), mdl.param_dtype)
        mul = cnp.multiply(mul, cnp.reshape(scale, feature_shape))
    y = cnp.multiply(y, mul)
    args = [x, scale if use_scale else None]
    if use_bias:
        bias = mdl.param("bias", bias_init, tuple(reduced), mdl.param_dtype)
        y = cnp.add(y, cnp.reshape(bias, feature_shape))
        args.append(bias)
    # the output dtype: the layer's dtype, else the promotion of x and the parameters (Flax)
    dt = canonicalize_dtype(*args, dtype=mdl.dtype)
    return y if getattr(y, "dtype", None) == dt else promote_dtype(y, dtype=dt)[0]



def _checked_axes(module, x):
    """The norm layers' shared checks (dtypes, no ``axis_name``) and their reduction
    and feature axes, canonical for ``x``'s rank."""
    _check_dtype(module)
    _no_axis_name(module)
    nd = len(np.shape(x))
    name = type(module).__name__
    return (_canon_axes(module.reduction_axes, nd, f"{name}.reduction_axes"),
            _canon_axes(module.feature_axes, nd, f"{name}.feature_axes"))

class LayerNorm(Module):
    """Layer normalization (``flax.linen.LayerNorm``): normalise over ``reduction_axes``
    (default the last) to zero mean and unit variance, then ``* scale + bias`` (shape of
    ``feature_axes``, default the last).

    ``epsilon=1e-6``, ``use_bias``, ``use_scale``, ``bias_init`` (zeros), ``scale_init``
    (ones), ``use_fast_variance`` and ``__call__(x, *, mask=None)`` are Flax's. ``dtype``:
    the output's (as Flax: statistics and normalisation in float32, the result cast to
    ``dtype``, or to the promotion of ``x`` and the parameters when ``None``);
    ``axis_name`` is refused (see the module docstring); ``force_float32_reductions`` is
    accepted (always float32).

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> x = np.array([[1.0, 2.0, 3.0]], np.float32)
    >>> y = nn.LayerNorm(use_bias=False).apply({'params': {'scale': np.ones(3, np.float32)}}, x)
    >>> [round(float(a), 3) for a in np.asarray(y)[0]]
    [-1.225, 0.0, 1.225]
    """

    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = np.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Callable = initializers.zeros_init()
    scale_init: Callable = initializers.ones_init()
    reduction_axes: Any = -1
    feature_axes: Any = -1
    axis_name: Any = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    @compact
    def __call__(self, x, *, mask=None):
        red, feat = _checked_axes(self, x)
        mean, var = _compute_stats(x, red, True, self.use_fast_variance, mask)
        return _normalize(self, x, mean, var, feat, self.epsilon, self.use_bias, self.use_scale,
                          self.bias_init, self.scale_init)


class RMSNorm(Module):
    """RMS layer normalization (``flax.linen.RMSNorm``): ``x * rsqrt(mean(x^2) + epsilon) *
    scale`` — no re-centering, no bias; the mean of squares over ``reduction_axes`` (default
    the last), ``scale`` (param ``'scale'``, ones) of the shape of ``feature_axes``.

    Fields and ``__call__(x, *, mask=None)`` as Flax's (``epsilon=1e-6``, ``use_scale``,
    ``scale_init``, ``reduction_axes``, ``feature_axes``); ``dtype`` as :class:`LayerNorm`'s;
    ``axis_name`` is refused as there.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> x = np.ones((2, 4), np.float32)
    >>> v = nn.RMSNorm().init(random.PRNGKey(0), x)
    >>> np.asarray(nn.RMSNorm().apply(v, 2 * x)).round(4).tolist()[0]
    [1.0, 1.0, 1.0, 1.0]
    """

    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = np.float32
    use_scale: bool = True
    scale_init: Callable = initializers.ones_init()
    reduction_axes: Any = -1
    feature_axes: Any = -1
    axis_name: Any = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    @compact
    def __call__(self, x, *, mask=None):
        red, feat = _checked_axes(self, x)
        _, var = _compute_stats(x, red, False, self.use_fast_variance, mask)
        return _normalize(self, x, None, var, feat, self.epsilon, False, self.use_scale,
                          initializers.zeros_init(), self.scale_init)
