"""Pooling: ``pool``, ``avg_pool``, ``max_pool``, ``min_pool`` (mirror of
``flax.linen.pooling``), over :func:`ctrainstate.lax.reduce_window`.

Inputs are ``(*batch, window dims..., features)``: the window and the strides cover the
dimensions after the batch ones, the batch and feature dimensions get a window of 1. A
missing batch dimension is added and removed, as in Flax. ``max_pool``'s gradient goes to
the first maximal element of each window (jax's); ``avg_pool`` divides the window sum by
the window size, or with ``count_include_pad=False`` by the number of real (unpadded)
elements in each window.

>>> import numpy as np
>>> from ctrainstate import nn
>>> x = np.arange(16, dtype=np.float32).reshape(1, 4, 4, 1)
>>> np.asarray(nn.max_pool(x, (2, 2), strides=(2, 2)))[0, :, :, 0].tolist()
[[5.0, 7.0], [13.0, 15.0]]
"""
from __future__ import annotations

import numpy as np

from .._src.numpy_lax import lax
from .._src.numpy_lax import numpy as cnp

__all__ = ["pool", "avg_pool", "max_pool", "min_pool"]


def _window(window_shape, what):
    try:
        w = tuple(int(k) for k in window_shape)
    except TypeError:
        raise TypeError(f"{what}: window_shape must be a sequence of ints, got "
                        f"{window_shape!r}") from None
    return w


def pool(inputs, init, reduce_fn, window_shape, strides, padding):
    """``flax.linen.pool``: ``lax.reduce_window`` of ``inputs`` with ``reduce_fn`` from
    ``init`` over windows of ``window_shape`` (with ``strides``, default 1) on the dimensions
    between the batch dimensions and the last (features). ``padding``: ``'SAME'``,
    ``'VALID'`` or one ``(low, high)`` pair per window dimension."""
    window = _window(window_shape, "pool")
    shape = tuple(np.shape(inputs))
    nbatch = len(shape) - (len(window) + 1)
    if nbatch < 0:
        raise ValueError(f"pool: an input of shape {shape} has fewer dimensions than the "
                         f"{len(window)} window dimensions plus features")
    strides = tuple(int(s) for s in strides) if strides else (1,) * len(window)
    if len(strides) != len(window):
        raise ValueError(f"pool: strides {strides} must have one entry per window dimension "
                         f"({window})")
    single = nbatch == 0
    x = cnp.expand_dims(cnp.asarray(inputs), 0) if single else inputs
    nbatch = max(nbatch, 1)
    dims = (1,) * nbatch + window + (1,)
    strides = (1,) * nbatch + strides + (1,)
    if not isinstance(padding, str):
        pads = tuple(tuple(p) for p in padding)
        if len(pads) != len(window) or any(len(p) != 2 for p in pads):
            raise ValueError(f"pool: padding {padding!r} must be one (low, high) pair per "
                             f"window dimension ({len(window)})")
        padding = ((0, 0),) * nbatch + pads + ((0, 0),)
    y = lax.reduce_window(x, init, reduce_fn, dims, strides, padding)
    return cnp.squeeze(y, 0) if single else y


def avg_pool(inputs, window_shape, strides=None, padding="VALID", count_include_pad=True):
    """The mean over each window (``flax.linen.avg_pool``): the window sum divided by the
    window size, or with ``count_include_pad=False`` by the number of unpadded elements."""
    y = pool(inputs, 0.0, cnp.add, window_shape, strides, padding)
    if count_include_pad:
        return cnp.divide(y, float(np.prod(_window(window_shape, "avg_pool"))))
    shape = tuple(np.shape(inputs))
    div_shape = shape[:-1] + (1,)
    if len(div_shape) - 2 == len(window_shape):
        div_shape = (1,) + div_shape[1:]
    return cnp.divide(y, pool(np.ones(div_shape, np.float32), 0.0, cnp.add, window_shape,
                              strides, padding))


def max_pool(inputs, window_shape, strides=None, padding="VALID"):
    """The maximum over each window (``flax.linen.max_pool``; padding counts as ``-inf``)."""
    return pool(inputs, -np.inf, cnp.maximum, window_shape, strides, padding)


def min_pool(inputs, window_shape, strides=None, padding="VALID"):
    """The minimum over each window (``flax.linen.min_pool``; padding counts as ``+inf``)."""
    return pool(inputs, np.inf, cnp.minimum, window_shape, strides, padding)


from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
