"""Convolution layers: Conv, ConvLocal and ConvTranspose (mirror of ``flax.linen.Conv``,
``ConvLocal`` and ``ConvTranspose``), over :func:`ctrainstate.lax.conv_general_dilated` (and
``conv_general_dilated_local``, ``conv_transpose``).

Channels last, as Flax: inputs ``(*batch, spatial..., features)``; several batch dimensions
are flattened for the convolution and restored, a missing one is added and removed. The
kernel is ``kernel_size + (in_features // feature_group_count, features)`` (``'kernel'``,
``lecun_normal``), the bias ``(features,)`` (``'bias'``, zeros), drawn in Flax's order, so
the same key gives Flax's parameters. A kernel declared with ``nn.with_partitioning`` /
``nn.with_logical_partitioning`` is born sharded like any other parameter.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from .._src.numpy_lax import lax
from .._src.numpy_lax import numpy as cnp
from . import initializers
from .dtypes import promote_dtype
from .linear import _check_dtype, _precision, default_kernel_init
from .._src.nn.module import Module, compact
from .._src.numpy_lax.conv import _explicit_pads, _out_sizes

__all__ = ["Conv", "ConvLocal", "ConvTranspose", "canonicalize_padding"]


def canonicalize_padding(padding, rank: int):
    """Flax's padding forms as what the lax convolutions take: a string as it is, an int
    ``p`` as ``(p, p)`` on every spatial dimension, a sequence of ``rank`` ints or
    ``(low, high)`` pairs as pairs; anything else is a ``ValueError``."""
    if isinstance(padding, str):
        return padding
    if isinstance(padding, (int, np.integer)) and not isinstance(padding, bool):
        return [(int(padding), int(padding))] * rank
    if isinstance(padding, Sequence) and len(padding) == rank:
        out = []
        for p in padding:
            if isinstance(p, (int, np.integer)) and not isinstance(p, bool):
                out.append((int(p), int(p)))
            elif isinstance(p, (tuple, list)) and len(p) == 2:
                out.append((int(p[0]), int(p[1])))
            else:
                break
        if len(out) == rank:
            return out
    raise ValueError(f"Invalid padding format: {padding!r}, should be str, int, or a sequence "
                     f"of len {rank} where each element is an int or pair of ints.")


def _kernel_size(module) -> tuple:
    ks = module.kernel_size
    if isinstance(ks, (int, np.integer)) and not isinstance(ks, bool):
        ks = (int(ks),)
    try:
        ks = tuple(int(k) for k in ks)
    except TypeError:
        raise TypeError(f"{type(module).__name__}: kernel_size must be an int or a sequence "
                        f"of ints, got {module.kernel_size!r}") from None
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"{type(module).__name__}: kernel_size must be positive ints, got "
                         f"{module.kernel_size!r}")
    return ks


def _broadcast(v, n, module, field):
    if v is None:
        v = 1
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return (int(v),) * n
    t = tuple(int(i) for i in v)
    if len(t) != n:
        raise ValueError(f"{type(module).__name__}.{field}={v!r}: expected an int or {n} ints "
                         f"(one per spatial dimension of kernel_size)")
    return t


def _flatten_batch(module, inputs, nsp):
    """``(inputs as (N, spatial..., C), the batch shape to restore or None)``."""
    nd = len(np.shape(inputs))
    nbatch = nd - (nsp + 1)
    if nbatch < 0:
        raise ValueError(f"{type(module).__name__}: an input of shape {tuple(np.shape(inputs))} "
                         f"has fewer dimensions than the {nsp} spatial dimensions of "
                         f"kernel_size plus features")
    if nbatch == 1:
        return inputs, None
    shape = tuple(np.shape(inputs))
    return cnp.reshape(inputs, (-1,) + shape[nbatch:]), shape[:nbatch]


def _dnums(ndim):
    lhs = (0, ndim - 1) + tuple(range(1, ndim - 1))
    rhs = (ndim - 1, ndim - 2) + tuple(range(0, ndim - 2))
    return lax.ConvDimensionNumbers(lhs, rhs, lhs)


def _start(module, inputs):
    """The convolution layers' shared start: fields checked, ``(precision, kernel_size, the
    input with one batch dimension, the batch shape to restore or None, strides)``."""
    _check_dtype(module)
    precision = _precision(module)
    ks = _kernel_size(module)
    x, batch_shape = _flatten_batch(module, inputs, len(ks))
    return precision, ks, x, batch_shape, _broadcast(module.strides, len(ks), module, "strides")


def _finish(y, bias, batch_shape):
    """``y`` plus the bias on its features, with the batch dimensions restored."""
    if bias is not None:
        y = y + cnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    if batch_shape is not None:
        y = cnp.reshape(y, batch_shape + tuple(y.shape[1:]))
    return y


def _masked_kernel(module, kernel, kernel_shape):
    if module.mask is None:
        return kernel
    if tuple(np.shape(module.mask)) != tuple(kernel_shape):
        raise ValueError(f"Mask needs to have the same shape as weights. Shapes are: "
                         f"{tuple(np.shape(module.mask))}, {tuple(kernel_shape)}")
    return cnp.multiply(kernel, module.mask)


class _Conv(Module):
    """The fields :class:`Conv` and :class:`ConvLocal` share (Flax's ``_Conv``)."""

    features: int
    kernel_size: Any
    strides: Any = 1
    padding: Any = "SAME"
    input_dilation: Any = 1
    kernel_dilation: Any = 1
    feature_group_count: int = 1
    use_bias: bool = True
    mask: Any = None
    dtype: Any = None
    param_dtype: Any = np.float32
    precision: Any = None
    kernel_init: Callable = default_kernel_init
    bias_init: Callable = initializers.zeros_init()


class Conv(_Conv):
    """An n-d convolution (``flax.linen.Conv``; ``n = len(kernel_size)``).

    Fields as Flax's: ``features``, ``kernel_size`` (an int is one spatial dimension),
    ``strides``, ``padding`` (``'SAME'``, ``'VALID'``, ``'CIRCULAR'``, ``'REFLECT'``,
    ``'CAUSAL'`` for 1-d, an int, or ints / ``(low, high)`` pairs per dimension),
    ``input_dilation``, ``kernel_dilation``, ``feature_group_count``, ``use_bias``, ``mask``
    (multiplies the kernel), ``dtype`` / ``param_dtype`` (as :class:`~ctrainstate.nn.Dense`),
    ``precision``, ``kernel_init``, ``bias_init``. See :func:`ctrainstate.lax.conv_general_dilated`
    for how the product is computed and sharded.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> layer = nn.Conv(features=4, kernel_size=(3,), padding='VALID')
    >>> y, v = layer.init_with_output(random.PRNGKey(0), np.ones((1, 8, 3), np.float32))
    >>> y.shape, v['params']['kernel'].shape, v['params']['bias'].shape
    ((1, 6, 4), (3, 3, 4), (4,))
    """

    @compact
    def __call__(self, inputs):
        return _conv_call(self, inputs, shared=True)


def _local_out_spatial(module, x, ks, strides, padding, idil, kdil):
    """The output's spatial sizes of the convolution ``module`` computes on ``x`` (Flax's
    ``eval_shape`` of a shared convolution, as arithmetic)."""
    sizes = [int(d) for d in np.shape(x)[1:-1]]
    if isinstance(padding, str):
        if any(d != 1 for d in idil):
            raise ValueError(f"{type(module).__name__}: string padding {padding!r} is not "
                             f"implemented with input_dilation > 1; give explicit "
                             f"(low, high) pairs")
        keff = [(k - 1) * d + 1 for k, d in zip(ks, kdil)]
        pads = lax.padtype_to_pads(sizes, keff, strides, padding)
    else:
        pads = _explicit_pads(padding, len(ks), type(module).__name__)
    grown = [((n - 1) * d + 1 if n else 0) + lo + hi
             for n, d, (lo, hi) in zip(sizes, idil, pads)]
    return tuple(_out_sizes(grown, ks, strides, kdil))


def _conv_call(module, inputs, shared):
    """Conv (``shared``) and ConvLocal: Flax's ``_Conv.__call__``."""
    name = type(module).__name__
    precision, ks, x, batch_shape, strides = _start(module, inputs)
    n = len(ks)
    idil = _broadcast(module.input_dilation, n, module, "input_dilation")
    kdil = _broadcast(module.kernel_dilation, n, module, "kernel_dilation")
    padding = canonicalize_padding(module.padding, n)
    if padding in ("CIRCULAR", "REFLECT"):
        keff = [(k - 1) * d + 1 for k, d in zip(ks, kdil)]
        pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in keff] + [(0, 0)]
        x = cnp.pad(x, pads, mode={"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding])
        padding = "VALID"
    elif padding == "CAUSAL":
        if n != 1:
            raise ValueError("Causal padding is only implemented for 1D convolutions.")
        x = cnp.pad(x, [(0, 0), (kdil[0] * (ks[0] - 1), 0), (0, 0)])
        padding = "VALID"
    in_features = int(np.shape(x)[-1])
    features = int(module.features)
    groups = int(module.feature_group_count)
    if shared:
        if groups < 1 or in_features % groups:
            raise ValueError(f"{name}: the input's {in_features} features are not divisible "
                             f"by feature_group_count={module.feature_group_count}")
        if features % groups:
            raise ValueError(f"{name}: features={module.features} is not divisible by "
                             f"feature_group_count={groups}")
        kernel_shape = ks + (in_features // groups, features)
        bias_shape = (features,)
    else:
        if groups != 1:
            raise NotImplementedError(
                f"{name}: `lax.conv_general_dilated_local` does not support "
                f"`feature_group_count != 1`, got `{module.feature_group_count}`.")
        out = _local_out_spatial(module, x, ks, strides, padding, idil, kdil)
        # one kernel (and bias) per output position
        kernel_shape = out + (math.prod(ks) * in_features, features)
        bias_shape = out + (features,)
    kernel = module.param("kernel", module.kernel_init, kernel_shape, module.param_dtype)
    kernel = _masked_kernel(module, kernel, kernel_shape)
    bias = (module.param("bias", module.bias_init, bias_shape, module.param_dtype)
            if module.use_bias else None)
    x, kernel, bias = promote_dtype(x, kernel, bias, dtype=module.dtype)
    if shared:
        y = lax.conv_general_dilated(x, kernel, strides, padding, lhs_dilation=idil,
                                     rhs_dilation=kdil, dimension_numbers=_dnums(x.ndim),
                                     feature_group_count=groups, precision=precision)
    else:
        y = lax.conv_general_dilated_local(x, kernel, strides, padding, ks, lhs_dilation=idil,
                                           rhs_dilation=kdil, dimension_numbers=_dnums(x.ndim),
                                           precision=precision)
    if bias is not None and not shared:
        y = y + cnp.reshape(bias, (1,) + tuple(bias.shape))
        bias = None
    return _finish(y, bias, batch_shape)


class ConvLocal(_Conv):
    """A locally connected layer (``flax.linen.ConvLocal``): a convolution whose kernel is
    not shared, one kernel per output position
    (:func:`ctrainstate.lax.conv_general_dilated_local`).

    Fields as :class:`Conv`'s (``feature_group_count`` must be 1, as in Flax). The kernel is
    ``out_spatial + (prod(kernel_size) * in_features, features)``, its patch dimension
    ordered input feature first, then the window offset (jax's patches), ``lecun_normal``;
    the bias ``out_spatial + (features,)``: the same key gives Flax's parameters.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> layer = nn.ConvLocal(features=4, kernel_size=(3,), padding='VALID')
    >>> y, v = layer.init_with_output(random.PRNGKey(0), np.ones((1, 8, 3), np.float32))
    >>> y.shape, v['params']['kernel'].shape, v['params']['bias'].shape
    ((1, 6, 4), (6, 9, 4), (6, 4))
    """

    @compact
    def __call__(self, inputs):
        return _conv_call(self, inputs, shared=False)


class ConvTranspose(Module):
    """A transposed (fractionally strided) convolution (``flax.linen.ConvTranspose``,
    :func:`ctrainstate.lax.conv_transpose`).

    Fields as Flax's: ``features``, ``kernel_size``, ``strides``, ``padding`` (``'SAME'``,
    ``'VALID'``, ``'CIRCULAR'``, or explicit pairs), ``kernel_dilation``, ``use_bias``,
    ``mask``, ``dtype``, ``param_dtype``, ``precision``, ``kernel_init``, ``bias_init``,
    ``transpose_kernel`` (kernel ``kernel_size + (features, in_features)``, flipped and
    swapped: the gradient of a :class:`Conv`), ``preferred_element_type``.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> layer = nn.ConvTranspose(features=2, kernel_size=(3, 3), strides=(2, 2))
    >>> layer.init_with_output(random.PRNGKey(0), np.ones((1, 4, 4, 3), np.float32))[0].shape
    (1, 8, 8, 2)
    """

    features: int
    kernel_size: Any
    strides: Any = None
    padding: Any = "SAME"
    kernel_dilation: Any = None
    use_bias: bool = True
    mask: Any = None
    dtype: Any = None
    param_dtype: Any = np.float32
    precision: Any = None
    kernel_init: Callable = default_kernel_init
    bias_init: Callable = initializers.zeros_init()
    transpose_kernel: bool = False
    preferred_element_type: Any = None

    @compact
    def __call__(self, inputs):
        precision, ks, x, batch_shape, strides = _start(self, inputs)
        n = len(ks)
        kdil = _broadcast(self.kernel_dilation, n, self, "kernel_dilation")
        in_features = int(np.shape(x)[-1])
        features = int(self.features)
        kernel_shape = ks + ((features, in_features) if self.transpose_kernel
                             else (in_features, features))
        kernel = self.param("kernel", self.kernel_init, kernel_shape, self.param_dtype)
        kernel = _masked_kernel(self, kernel, kernel_shape)
        padding = canonicalize_padding(self.padding, n)
        circular = padding == "CIRCULAR"
        if circular:
            padding = "VALID"
        bias = (self.param("bias", self.bias_init, (features,), self.param_dtype)
                if self.use_bias else None)
        x, kernel, bias = promote_dtype(x, kernel, bias, dtype=self.dtype)
        y = lax.conv_transpose(x, kernel, strides, padding, rhs_dilation=kdil,
                               transpose_kernel=self.transpose_kernel, precision=precision,
                               preferred_element_type=self.preferred_element_type)
        if circular:
            # wrap the output's overhang back onto a period of in * stride (Flax's rule)
            scaled = [int(d) * s for d, s in zip(np.shape(x)[1:-1], strides)]
            diffs = [-(yd - xd) % (2 * xd) for yd, xd in zip(y.shape[1:-1], scaled)]
            if self.transpose_kernel:
                pads = [(d // 2, (d + 1) // 2) for d in diffs]
            else:
                pads = [((d + 1) // 2, d // 2) for d in diffs]
            y = cnp.pad(y, [(0, 0)] + pads + [(0, 0)])
            for i in range(1, y.ndim - 1):
                shape = tuple(y.shape)
                y = cnp.reshape(y, shape[:i] + (-1, scaled[i - 1]) + shape[i + 1:])
                y = cnp.sum(y, axis=i)
        return _finish(y, bias, batch_shape)


from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
