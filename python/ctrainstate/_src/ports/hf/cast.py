"""The implementation of :mod:`ctrainstate.hf.cast` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import numpy as np

from ...base import dtypes as _dtypes
from ...array.abstract import ShapeDtypeStruct
from ...array.array import Array
from ...base.tree_util import _flatten_up_to, tree_flatten, tree_map, tree_unflatten
from ...ops.ops import astype

__all__ = ['cast', 'to_bf16', 'to_fp16', 'to_fp32']


def cast(x, dtype):
    """``x`` converted to ``dtype`` with the same sharding (one block at a time)."""
    dtype = _dtypes.canonicalize(np.dtype(dtype))
    if isinstance(x, ShapeDtypeStruct):
        return ShapeDtypeStruct(x.shape, dtype, x.sharding)
    if not isinstance(x, Array):
        return np.asarray(x).astype(dtype)
    return astype(x, dtype)


_FLOATS = (np.dtype(np.float16), _dtypes.bfloat16, np.dtype(np.float32), np.dtype(np.float64))


def _floats_to(params, dst, mask=None):
    """HF's ``_cast_floating_to``: every floating leaf (any float dtype) to ``dst``; with a
    ``mask`` (a tree of the params' structure with boolean leaves), only where it is True."""
    def f(x, cast_it=True):
        dt = getattr(x, 'dtype', None)
        return cast(x, dst) if cast_it and dt is not None and np.dtype(dt) in _FLOATS else x
    if mask is None:
        return tree_map(f, params)
    leaves, treedef = tree_flatten(params)
    try:
        flags = _flatten_up_to(treedef, mask)
    except ValueError as e:
        raise ValueError(f'mask does not have the structure of params: {e}') from None
    return tree_unflatten(treedef, [f(x, bool(m)) for x, m in zip(leaves, flags)])


def to_bf16(params, mask=None):
    """Cast floating leaves to bfloat16 (other dtypes untouched); ``mask``: a tree like
    ``params`` whose True leaves are the ones to cast (HF ``model.to_bf16(params, mask)``)."""
    return _floats_to(params, _dtypes.bfloat16, mask)


def to_fp16(params, mask=None):
    """Cast floating leaves to float16 (``mask`` as in :func:`to_bf16`)."""
    return _floats_to(params, np.float16, mask)


def to_fp32(params, mask=None):
    """Cast floating leaves to float32 (``mask`` as in :func:`to_bf16`)."""
    return _floats_to(params, np.float32, mask)


from ...base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
