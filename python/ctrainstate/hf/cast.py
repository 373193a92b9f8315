"""dtype casts of sharded params, block by block (HF ``model.to_bf16(params)``/``to_fp32``).

Each device converts its own block into a new buffer on the same device (the core's
convert kernel, :func:`ctrainstate.numpy.astype`), so no device ever holds more than its
own block and nothing goes through the host. Arrays keep their shardings; numpy leaves
are cast on the host.

>>> import numpy as np, ctrainstate as cts
>>> from ctrainstate.hf.cast import to_bf16
>>> x = cts.device_put(np.arange(4, dtype=np.float32))
>>> y = to_bf16({'w': x})['w']
>>> str(y.dtype), y.sharding == x.sharding
('bfloat16', True)
"""
from __future__ import annotations

import numpy as np

from .. import _dtypes
from .._abstract import ShapeDtypeStruct
from ..array import Array
from ..tree_util import tree_map

__all__ = ['cast', 'to_bf16', 'to_fp16', 'to_fp32']


def cast(x, dtype):
    """``x`` converted to ``dtype`` with the same sharding (one block at a time)."""
    dtype = _dtypes.canonicalize(np.dtype(dtype))
    if isinstance(x, ShapeDtypeStruct):
        return ShapeDtypeStruct(x.shape, dtype, x.sharding)
    if not isinstance(x, Array):
        return np.asarray(x).astype(dtype)
    from .._ops import astype
    return astype(x, dtype)


def _floats_to(params, src, dst):
    def f(x):
        dt = getattr(x, 'dtype', None)
        return cast(x, dst) if dt is not None and np.dtype(dt) in src else x
    return tree_map(f, params)


def to_bf16(params):
    """Cast float32 leaves to bfloat16 (other dtypes untouched)."""
    return _floats_to(params, (np.dtype(np.float32),), _dtypes.bfloat16)


def to_fp16(params):
    """Cast float32 leaves to float16."""
    return _floats_to(params, (np.dtype(np.float32),), np.float16)


def to_fp32(params):
    """Cast bfloat16/float16 leaves to float32."""
    return _floats_to(params, (_dtypes.bfloat16, np.dtype(np.float16)), np.float32)
