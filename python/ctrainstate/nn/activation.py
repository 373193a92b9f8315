"""Activation helpers of ``flax.linen`` / ``jax.nn`` built from ctrainstate.numpy ops
(differentiable, sharded): ``silu``/``swish``, ``leaky_relu``, and ``one_hot``.

>>> import numpy as np
>>> from ctrainstate import nn
>>> nn.one_hot(np.array([0, 2]), 3).tolist()
[[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
"""
from __future__ import annotations

import numpy as np

from .. import _dtypes, _ops
from ..array import device_put

__all__ = ["silu", "swish", "leaky_relu", "one_hot"]


def silu(x):
    """``x * sigmoid(x)`` (jax.nn.silu, also called swish)."""
    return _ops.multiply(x, _ops.sigmoid(x))


swish = silu


def leaky_relu(x, negative_slope: float = 1e-2):
    """``x`` where ``x >= 0``, else ``negative_slope * x``."""
    r = _ops.relu(x)
    return _ops.add(r, _ops.multiply(_ops.subtract(x, r), float(negative_slope)))


def one_hot(x, num_classes: int, *, dtype=np.float32, axis: int = -1):
    """``x[..., None] == arange(num_classes)`` as ``dtype`` (float32), the new axis at ``axis``;
    an index outside ``[0, num_classes)`` gives a row of zeros. Built on the host from the
    integer labels and placed like ``device_put`` (the labels of a batch are small)."""
    idx = np.asarray(x)
    if not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"one_hot expects integer labels, got {idx.dtype}")
    out = (idx[..., None] == np.arange(int(num_classes))).astype(_dtypes.canonicalize(dtype))
    if axis != -1:
        out = np.moveaxis(out, -1, axis)
    return device_put(out)
