"""Boxed axis metadata (mirror of ``flax.core.meta``).

A box wraps a parameter value together with how it is partitioned. Boxes are
pytree nodes whose only child is the value, so tree functions map *through*
them; the names (and mesh, rules) are static.

>>> import numpy as np
>>> from ctrainstate.nn import meta
>>> params = {'kernel': meta.Partitioned(np.zeros((3, 2)), ('in', 'out')), 'bias': np.zeros(2)}
>>> meta.get_partition_spec(params)
{'bias': PartitionSpec(), 'kernel': PartitionSpec('in', 'out')}
>>> meta.unbox(params)['kernel'].shape
(3, 2)
"""
from .._src.nn.meta import *  # noqa: F401,F403
from .._src.nn.meta import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
