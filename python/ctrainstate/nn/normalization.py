"""Normalization layers: LayerNorm, RMSNorm, BatchNorm, GroupNorm and InstanceNorm, and the
weight wrappers WeightNorm and SpectralNorm (mirror of ``flax.linen.normalization``).

Flax's arithmetic, step for step: statistics over ``reduction_axes`` (the fast variance
``max(0, E[x^2] - E[x]^2)`` by default, or ``E[(x - E[x])^2]``), then ``y = (x - mean) *
(rsqrt(var + epsilon) * scale) + bias`` with ``scale``/``bias`` of the shape of the
``feature_axes``. An optional ``mask`` restricts the statistics to the positions it sets,
as ``jnp.mean(..., where=mask)`` does. Parameter names (``scale``, ``bias``) and
initializers are Flax's. Over a dimension sharded on mesh axes the means end in
all-reduces over them, so ``axis_name`` is not needed there; inside a
:func:`ctrainstate.pmap`, ``axis_name`` averages the statistics over its replicas (Flax's
distributed statistics: ``lax.pmean`` of E[x] and E[x^2]). ``axis_index_groups`` is refused.

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

import dataclasses
from typing import Any, Callable

import numpy as np

from .._src.numpy_lax import numpy as cnp
from .._src.array.array import Array
from . import initializers
from .dtypes import canonicalize_dtype, promote_dtype
from .dtypes import _check_dtype
from .._src.nn.module import Module, compact
from .. import random as _random
from .._src.ops.ops import stop_gradient
from .._src.numpy_lax.pmap import _bound, pmean
from ..nn.stochastic import merge_param
from ..nn.transforms_more import map_variables

__all__ = ["LayerNorm", "RMSNorm", "BatchNorm", "GroupNorm", "InstanceNorm", "WeightNorm",
           "SpectralNorm"]


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
    """``axis_name``: the statistics are pmean'd over that axis of an enclosing
    :func:`ctrainstate.pmap` (Flax's distributed statistics); ``axis_index_groups`` is refused."""
    if module.axis_index_groups is not None:
        raise NotImplementedError(
            f"{type(module).__name__}(axis_index_groups=...): statistics over groups of pmap "
            f"replicas are not supported (axis_name alone is: the whole axis)")
    if module.axis_name is not None:
        names = module.axis_name if isinstance(module.axis_name, (tuple, list)) else (module.axis_name,)
        missing = [nm for nm in names if nm not in _bound()]
        if missing:
            raise NameError(
                f"{type(module).__name__}(axis_name={module.axis_name!r}): unbound axis name "
                f"{missing[0]!r}. axis_name averages the statistics over the replicas of an "
                f"enclosing ctrainstate.pmap(..., axis_name={missing[0]!r}); outside pmap, over a "
                f"batch sharded on mesh axes the means already all-reduce over them (drop "
                f"axis_name)")


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


def _compute_stats(x, axes, use_mean: bool, use_fast_variance: bool, mask, axis_name=None):
    """``(mean, var)`` over ``axes`` (kept as size-1 dims); mean is None without use_mean.
    Always float32, as Flax's ``force_float32_reductions`` (a 16-bit ``x`` is converted).
    With ``axis_name`` (inside a pmap), each mean is then averaged over the replicas
    (``lax.pmean``), E[x] and E[x^2] in one collective, as Flax's ``maybe_distributed_mean``."""
    x, = promote_dtype(x, dtype=np.float32)

    def dmean(*vals):
        mus = tuple(_masked_mean(v, axes, mask) for v in vals)
        if axis_name is not None:
            mus = tuple(pmean(mus, axis_name))
        return mus if len(mus) > 1 else mus[0]

    if not use_mean:
        return None, dmean(cnp.square(x))
    if use_fast_variance:
        mu, mu2 = dmean(x, cnp.square(x))
        # E[x^2] - E[x]^2 can round below zero: clipped as Flax does
        return mu, cnp.maximum(0.0, cnp.subtract(mu2, cnp.square(mu)))
    mu = dmean(x)
    return mu, dmean(cnp.square(cnp.subtract(x, mu)))


def _normalize(mdl: Module, x, mean, var, feature_axes, epsilon, use_bias, use_scale,
               bias_init, scale_init):
    shape = x.shape if type(x) is Array else tuple(np.shape(x))
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
    nd = len(x.shape if type(x) is Array else np.shape(x))
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
    ``axis_name``: inside a pmap, see the module docstring; ``force_float32_reductions`` is
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
        mean, var = _compute_stats(x, red, True, self.use_fast_variance, mask,
                                    self.axis_name)
        return _normalize(self, x, mean, var, feat, self.epsilon, self.use_bias, self.use_scale,
                          self.bias_init, self.scale_init)


class RMSNorm(Module):
    """RMS layer normalization (``flax.linen.RMSNorm``): ``x * rsqrt(mean(x^2) + epsilon) *
    scale`` — no re-centering, no bias; the mean of squares over ``reduction_axes`` (default
    the last), ``scale`` (param ``'scale'``, ones) of the shape of ``feature_axes``.

    Fields and ``__call__(x, *, mask=None)`` as Flax's (``epsilon=1e-6``, ``use_scale``,
    ``scale_init``, ``reduction_axes``, ``feature_axes``); ``dtype`` as :class:`LayerNorm`'s;
    ``axis_name`` as there.

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
        _, var = _compute_stats(x, red, False, self.use_fast_variance, mask, self.axis_name)
        return _normalize(self, x, None, var, feat, self.epsilon, False, self.use_scale,
                          initializers.zeros_init(), self.scale_init)


def _keep_shape(x, axes):
    """``x``'s shape with 1 on every dimension not in ``axes``."""
    shape = x.shape if type(x) is Array else tuple(np.shape(x))
    return tuple(n if d in axes else 1 for d, n in enumerate(shape))


class BatchNorm(Module):
    """Batch normalization (``flax.linen.BatchNorm``): normalise over every dimension but
    ``axis`` (default the last, the features) with the batch's statistics, and keep their
    exponential moving averages in the ``'batch_stats'`` collection (``'mean'``, zeros, and
    ``'var'``, ones, float32, of the feature shape).

    ``use_running_average`` (a field or a ``__call__`` argument, as Flax's ``merge_param``):
    true normalises with the stored averages (evaluation); false with the batch's, and,
    outside ``init``, updates ``mean <- momentum * mean + (1 - momentum) * batch_mean`` (and
    ``var``) -- ``apply(..., mutable=['batch_stats'])`` returns the new values, and without it
    the update raises Flax's immutable-collection error. ``momentum=0.99``, ``epsilon=1e-5``,
    ``use_bias``, ``use_scale``, ``bias_init``, ``scale_init``, ``use_fast_variance``, ``mask``
    and ``dtype`` / ``param_dtype`` are Flax's. Over a batch sharded on mesh axes the means
    all-reduce over them, so ``axis_name`` is not needed; inside a :func:`ctrainstate.pmap`
    (Flax's ImageNet example), ``axis_name='batch'`` averages the batch statistics over the
    replicas, so every replica normalises and updates its averages with the global batch's.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> x = np.array([[1.0], [3.0]], np.float32)
    >>> bn = nn.BatchNorm(use_running_average=False, momentum=0.9)
    >>> v = bn.init(random.PRNGKey(0), x)
    >>> y, upd = bn.apply(v, x, mutable=['batch_stats'])
    >>> np.asarray(y).ravel().round(3).tolist()
    [-1.0, 1.0]
    >>> np.asarray(upd['batch_stats']['mean'], np.float64).round(4).tolist()   # 0.1 * 2
    [0.2]
    """

    use_running_average: Any = None
    axis: Any = -1
    momentum: float = 0.99
    epsilon: float = 1e-5
    dtype: Any = None
    param_dtype: Any = np.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Callable = initializers.zeros_init()
    scale_init: Callable = initializers.ones_init()
    axis_name: Any = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    @compact
    def __call__(self, x, use_running_average=None, *, mask=None):
        _check_dtype(self)
        _no_axis_name(self)
        use_ra = merge_param("use_running_average", self.use_running_average,
                             use_running_average)
        nd = len(x.shape if type(x) is Array else np.shape(x))
        feat = _canon_axes(self.axis, nd, "BatchNorm.axis")
        red = tuple(d for d in range(nd) if d not in feat)
        fshape = tuple(int(np.shape(x)[d]) for d in feat)
        keep = _keep_shape(x, feat)
        ra_mean = self.variable("batch_stats", "mean",
                                lambda s: cnp.zeros(s, np.float32), fshape)
        ra_var = self.variable("batch_stats", "var",
                               lambda s: cnp.ones(s, np.float32), fshape)
        if use_ra:
            mean = cnp.reshape(ra_mean.value, keep)
            var = cnp.reshape(ra_var.value, keep)
        else:
            mean, var = _compute_stats(x, red, True, self.use_fast_variance, mask,
                                    self.axis_name)
            if not self.is_initializing():
                m = float(self.momentum)
                ra_mean.value = cnp.add(cnp.multiply(m, ra_mean.value),
                                        cnp.multiply(1.0 - m, cnp.reshape(mean, fshape)))
                ra_var.value = cnp.add(cnp.multiply(m, ra_var.value),
                                       cnp.multiply(1.0 - m, cnp.reshape(var, fshape)))
        return _normalize(self, x, mean, var, feat, self.epsilon, self.use_bias,
                          self.use_scale, self.bias_init, self.scale_init)


class GroupNorm(Module):
    """Group normalization (``flax.linen.GroupNorm``): the last dimension's ``C`` features
    split into ``num_groups`` groups (default 32) of ``C / num_groups`` (or groups of
    ``group_size``; give exactly one of the two), each normalised over the group and the
    ``reduction_axes`` (default every dimension but the first, the batch), then ``* scale +
    bias`` of shape ``(C,)``. ``epsilon=1e-6`` and the other fields are Flax's; the errors for
    a group count that does not divide ``C`` are Flax's ``ValueError``.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> x = np.array([[1.0, 3.0, 10.0, 30.0]], np.float32)
    >>> gn = nn.GroupNorm(num_groups=2, use_bias=False, use_scale=False)
    >>> np.asarray(gn.apply({}, x)).round(3).tolist()
    [[-1.0, 1.0, -1.0, 1.0]]
    """

    num_groups: Any = 32
    group_size: Any = None
    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = np.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Callable = initializers.zeros_init()
    scale_init: Callable = initializers.ones_init()
    reduction_axes: Any = None
    axis_name: Any = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    @compact
    def __call__(self, x, *, mask=None):
        _check_dtype(self)
        _no_axis_name(self)
        shape = tuple(int(n) for n in np.shape(x))
        nd = len(shape)
        if nd < 1:
            raise ValueError("GroupNorm: the input needs a feature (last) dimension")
        red = self.reduction_axes
        if red is None:
            red = list(range(1, nd - 1)) + [-1]
        red = _canon_axes(red, nd, "GroupNorm.reduction_axes")
        if not red or red[-1] != nd - 1:
            raise ValueError("The reduction axes must include the final dimension as this is "
                             "assumed to be the feature axis.")
        if (self.num_groups is None) == (self.group_size is None):
            raise ValueError("Either `num_groups` or `group_size` should be specified. If "
                             "`group_size` is to be specified, pass `num_groups=None` as "
                             "argument to override the default `num_groups` value of 32.")
        channels = shape[-1]
        if self.group_size is not None:
            if int(self.group_size) <= 0 or channels % int(self.group_size):
                raise ValueError(f"Number of channels ({channels}) is not multiple of the "
                                 f"group size ({self.group_size}).")
            groups = channels // int(self.group_size)
        else:
            groups = int(self.num_groups)
        if groups <= 0 or channels % groups:
            raise ValueError(f"Number of groups ({groups}) does not divide the number of "
                             f"channels ({channels}).")
        gs = channels // groups
        gshape = shape[:-1] + (groups, gs)
        if mask is not None:
            mshape = tuple(np.shape(mask))
            mask = (cnp.reshape(mask, mshape[:-1] + (groups, gs)) if isinstance(mask, Array)
                    else np.reshape(np.asarray(mask, bool), mshape[:-1] + (groups, gs)))
        mean, var = _compute_stats(cnp.reshape(x, gshape), tuple(red[:-1]) + (nd,), True,
                                   self.use_fast_variance, mask, self.axis_name)
        # (..., groups, 1) -> each group's statistic repeated over its gs features
        keep = tuple(mean.shape[:-2]) + (channels,)
        mean = cnp.reshape(cnp.repeat(mean, gs, axis=-1), keep)
        var = cnp.reshape(cnp.repeat(var, gs, axis=-1), keep)
        return _normalize(self, x, mean, var, (nd - 1,), self.epsilon, self.use_bias,
                          self.use_scale, self.bias_init, self.scale_init)


class InstanceNorm(Module):
    """Instance normalization (``flax.linen.InstanceNorm``): each example (dimension 0) and
    feature normalised over the other dimensions, then ``* scale + bias`` of the shape of
    ``feature_axes`` (default the last; the batch dimension cannot be one). ``epsilon=1e-6``
    and the other fields are Flax's.

    >>> import numpy as np
    >>> from ctrainstate import nn
    >>> x = np.array([[[1.0], [3.0]]], np.float32)
    >>> y = nn.InstanceNorm(use_bias=False, use_scale=False).apply({}, x)
    >>> np.asarray(y).ravel().round(3).tolist()
    [-1.0, 1.0]
    """

    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = np.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Callable = initializers.zeros_init()
    scale_init: Callable = initializers.ones_init()
    feature_axes: Any = -1
    axis_name: Any = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    @compact
    def __call__(self, x, *, mask=None):
        _check_dtype(self)
        _no_axis_name(self)
        nd = len(x.shape if type(x) is Array else np.shape(x))
        feat = _canon_axes(self.feature_axes, nd, "InstanceNorm.feature_axes")
        if 0 in feat:
            raise ValueError("The channel axes cannot include the leading dimension as this "
                             "is assumed to be the batch axis.")
        red = tuple(d for d in range(1, nd) if d not in feat)
        mean, var = _compute_stats(x, red, True, self.use_fast_variance, mask,
                                    self.axis_name)
        return _normalize(self, x, mean, var, feat, self.epsilon, self.use_bias,
                          self.use_scale, self.bias_init, self.scale_init)


# --- weight wrappers ------------------------------------------------------------------------------

def _map_leaves(fn, tree, path=()):
    """``fn(path, leaf)`` over the nested dicts ``{collection: tree}`` (keys in sorted order, as
    ``jax.tree_util.tree_map_with_path`` walks a dict); ``path[0]`` is the collection."""
    if isinstance(tree, dict):
        return {k: _map_leaves(fn, tree[k], path + (k,)) for k in sorted(tree)}
    return fn(path, tree)


def _l2_normalize(x, axis=None, eps=1e-12):
    """``x * rsqrt(sum(x * x, axis) + eps)`` (Flax's ``_l2_normalize``)."""
    return cnp.multiply(x, cnp.rsqrt(cnp.add(cnp.sum(cnp.multiply(x, x), axis=axis,
                                                      keepdims=True), float(eps))))


def _as_dtype(x, dt):
    return x if getattr(x, "dtype", None) == dt else promote_dtype(x, dtype=dt)[0]


class WeightNorm(Module):
    """L2 weight normalization of a wrapped layer (``flax.linen.WeightNorm``): each variable
    of ``layer_instance`` whose path (``'<layer name>/kernel'``) contains a name of
    ``variable_filter`` (default ``{'kernel'}``; ``None`` or empty: all) is used as
    ``scale * v / ||v||``, the norm over the axes not in ``feature_axes`` (default the last;
    ``None``: over all), ``scale`` a parameter of this module named ``'<layer
    name>/<path>/scale'`` of the feature shape (``scale_init``, ones; ``use_scale=False``: none).

    The wrapped layer keeps its own parameters where it was created (``Dense_1/kernel`` beside
    ``WeightNorm_0``), as in Flax -- and, as Flax's ``map_variables(init=True)`` does, the value
    stored at init is the normalized one (``scale * v / ||v||`` with ``scale`` ones: ``v /
    ||v||``). ``epsilon=1e-12`` is added under the square root; ``dtype`` is the result's.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> class Foo(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.WeightNorm(nn.Dense(3))(x)
    >>> v = Foo().init(random.PRNGKey(0), np.ones((1, 2), np.float32))
    >>> sorted(v['params']), sorted(v['params']['WeightNorm_0'])
    (['Dense_0', 'WeightNorm_0'], ['Dense_0/kernel/scale'])
    """

    layer_instance: Module
    epsilon: float = 1e-12
    dtype: Any = None
    param_dtype: Any = np.float32
    use_scale: bool = True
    scale_init: Callable = initializers.ones
    feature_axes: Any = -1
    variable_filter: Any = dataclasses.field(default_factory=lambda: {"kernel"})

    @compact
    def __call__(self, *args, **kwargs):
        return map_variables(lambda layer: layer(*args, **kwargs),
                             trans_in_fn=lambda vs: _map_leaves(self._normalize_leaf, vs),
                             init=self.is_initializing())(self.layer_instance)

    def _normalize_leaf(self, path, vs):
        value = vs
        str_path = self.layer_instance.name + "/" + "/".join(str(p) for p in path[1:])
        if self.variable_filter:
            if not any(name in str_path for name in self.variable_filter):
                return value
        nd = len(np.shape(value))
        if self.feature_axes is None:
            feature_axes, reduction_axes = (), tuple(range(nd))
        else:
            feature_axes = _canon_axes(self.feature_axes, nd, "WeightNorm.feature_axes")
            reduction_axes = tuple(i for i in range(nd) if i not in feature_axes)
        shape = tuple(np.shape(value))
        feature_shape = [1] * nd
        reduced = []
        for ax in feature_axes:
            feature_shape[ax] = shape[ax]
            reduced.append(shape[ax])
        value_bar = _l2_normalize(value, axis=reduction_axes, eps=self.epsilon)
        args = [vs]
        if self.use_scale:
            scale = self.param(str_path + "/scale", self.scale_init, tuple(reduced),
                               self.param_dtype)
            scale = cnp.reshape(scale, tuple(feature_shape))
            value_bar = cnp.multiply(value_bar, scale)
            args.append(scale)
        return _as_dtype(value_bar, canonicalize_dtype(*args, dtype=self.dtype))


class SpectralNorm(Module):
    """Spectral normalization of a wrapped layer (``flax.linen.SpectralNorm``): each weight of
    ``layer_instance`` with 2 or more dimensions (flattened to ``(-1, last)``) is divided by
    its largest singular value ``sigma``, estimated by ``n_steps`` of power iteration from the
    vector ``u`` kept in ``collection_name`` (``'batch_stats'``) as ``'<layer
    name>/<path>/u'`` (``(1, last)``, standard normal from this module's ``'params'`` stream at
    init) beside ``'<layer name>/<path>/sigma'`` (ones, ``()``). ``__call__(*args,
    update_stats, **kwargs)``: with ``update_stats=True`` (and the collection mutable) ``u`` and
    ``sigma`` are replaced by the new estimates; ``u`` and the power-iteration vectors carry no
    gradient. Scalars and vectors are left alone (``error_on_non_matrix=True``: a weight of
    more than 2 dimensions is an error). As in Flax, at init the normalized weights are
    stored in the layer's parameters.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> class Foo(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x, train):
    ...         return nn.SpectralNorm(nn.Dense(4))(x, update_stats=train)
    >>> v = Foo().init(random.PRNGKey(0), np.ones((1, 3), np.float32), True)
    >>> {k: a.shape for k, a in v['batch_stats']['SpectralNorm_0'].items()}
    {'Dense_0/kernel/u': (1, 4), 'Dense_0/kernel/sigma': ()}
    """

    layer_instance: Module
    n_steps: int = 1
    epsilon: float = 1e-12
    dtype: Any = None
    param_dtype: Any = np.float32
    error_on_non_matrix: bool = False
    collection_name: str = "batch_stats"

    @compact
    def __call__(self, *args, update_stats: bool, **kwargs):
        return map_variables(
            lambda layer: layer(*args, **kwargs),
            trans_in_fn=lambda vs: _map_leaves(
                lambda path, v: self._spectral_normalize(path, v, update_stats), vs),
            init=self.is_initializing(), mutable=True)(self.layer_instance)

    def _spectral_normalize(self, path, vs, update_stats):
        value = vs
        value_shape = tuple(np.shape(value))
        if len(value_shape) <= 1 or self.n_steps < 1:
            return value
        if len(value_shape) > 2:
            if self.error_on_non_matrix:
                raise ValueError(f"Input is {len(value_shape)}D but error_on_non_matrix is "
                                 f"True")
            value = cnp.reshape(value, (-1, value_shape[-1]))
        base = self.layer_instance.name + "/" + "/".join(str(p) for p in path[1:])
        u_name, sigma_name = base + "/u", base + "/sigma"
        n = int(np.shape(value)[-1])
        col = self.collection_name
        key = self.make_rng("params") if not self.has_variable(col, u_name) else None
        u_var = self.variable(col, u_name, lambda: _random.normal(key, (1, n), self.param_dtype))
        sigma_var = self.variable(col, sigma_name,
                                  lambda: cnp.ones((), self.param_dtype))
        u0 = u_var.value
        v0 = None
        for _ in range(self.n_steps):
            v0 = _l2_normalize(cnp.matmul(u0, cnp.transpose(value, (1, 0))), eps=self.epsilon)
            u0 = _l2_normalize(cnp.matmul(v0, value), eps=self.epsilon)
        u0 = stop_gradient(u0)
        v0 = stop_gradient(v0)
        sigma = cnp.reshape(cnp.matmul(cnp.matmul(v0, value), cnp.transpose(u0)), ())
        value = cnp.divide(value, cnp.where(cnp.not_equal(sigma, 0.0), sigma, 1.0))
        value_bar = cnp.reshape(value, value_shape)
        if update_stats:
            u_var.value = u0
            sigma_var.value = sigma
        return _as_dtype(value_bar, canonicalize_dtype(vs, u0, v0, sigma, dtype=self.dtype))


from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
