"""Meshes, partition specs and shardings (mirror of ``jax.sharding``).

A :class:`Mesh` names the axes of an n-d grid of devices; a
:class:`PartitionSpec` says which mesh axes split each array dimension; a
:class:`NamedSharding` joins the two. Validation and the shard layout are
computed in C (csrc/core/ct_layout.c); this module only holds the objects.

>>> import numpy as np, ctrainstate as cts
>>> mesh = cts.Mesh(np.array(cts.devices()[:1]).reshape(1, 1), ('data', 'model'))
>>> s = cts.NamedSharding(mesh, cts.P('data', None))
>>> s.shard_shape((4, 6))
(4, 6)
"""
from ._src.array.sharding import *  # noqa: F401,F403
from ._src.array.sharding import __all__  # noqa: F401
# names the module had outside __all__, kept importable
from ._src.array.sharding import (Device, in_jit, shard_index, UNCONSTRAINED, P,
                                  default_sharding)  # noqa: F401

from ._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
