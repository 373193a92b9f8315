"""Sharded arrays: :class:`Array`, :class:`Shard`, :func:`device_put`.

An Array is a global shape and dtype, a sharding, and one buffer per device of
the sharding holding that device's block (replicas are separate buffers). No
device ever holds more than its block; ``np.asarray(array)`` is the one place a
full copy is made, on the host, because the user asked for it.

>>> import numpy as np, ctrainstate as cts
>>> x = cts.device_put(np.arange(6, dtype=np.float32).reshape(2, 3))
>>> x.shape, str(x.dtype)
((2, 3), 'float32')
>>> float(np.asarray(x)[1, 2])
5.0
"""
from ._src.array.array import *  # noqa: F401,F403
from ._src.array.array import __all__  # noqa: F401
# names the module had outside __all__, kept importable
from ._src.array.array import (Device, OperatorsMixin, NamedSharding, PartitionSpec, Sharding,
                               SingleDeviceSharding, default_sharding, shard_index,
                               register_leaf_type, tree_leaves, tree_map, is_abstract,
                               ShapeDtypeStruct, devices, get_mesh, Mesh, tree_flatten,
                               tree_unflatten, DonatedBufferError, check_python_ints)  # noqa: F401

from ._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
