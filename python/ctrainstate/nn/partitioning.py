"""``flax.linen.partitioning`` at Flax's module path: the names of
:mod:`ctrainstate.partitioning`, re-exported (``from flax.linen import partitioning as
nn_partitioning`` becomes ``from ctrainstate.nn import partitioning as nn_partitioning``).

>>> from ctrainstate.nn import partitioning as nn_partitioning
>>> with nn_partitioning.axis_rules((('mlp', 'model'),)):
...     nn_partitioning.logical_to_mesh_axes(('embed', 'mlp'))
PartitionSpec(None, 'model')
"""
from ..partitioning import *  # noqa: F401,F403 - the facade re-exports that module's API
from ..partitioning import __all__  # noqa: F401
