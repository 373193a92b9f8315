"""t5x's partitioner (mirror of ``t5x.partitioning``): meshes, rule tables, ``PjitPartitioner``.

A ported t5x script changes only the import::

    from ctrainstate.t5x import partitioning

``PjitPartitioner(num_partitions=...)`` builds t5x's ``('data', 'model')`` mesh
(on CPU: ``data=1, model=<all devices>`` whatever ``num_partitions`` is, as in
t5x; on GPUs: ``model=num_partitions``), resolves logical axis names with the
rules of :func:`standard_logical_axis_rules` (or yours), and ``partition(fn,
in_axis_resources, out_axis_resources)`` runs ``fn`` eagerly inside the mesh
and rules contexts, placing inputs and outputs by the given specs.

>>> from ctrainstate.t5x import partitioning
>>> p = partitioning.PjitPartitioner(num_partitions=1)
>>> tuple(p.mesh.shape)
('data', 'model')
>>> p.data_partition_spec
PartitionSpec('data',)
>>> len(partitioning.standard_logical_axis_rules())
13
"""
from .._src.ports.t5x.partitioning import *  # noqa: F401,F403
from .._src.ports.t5x.partitioning import __all__  # noqa: F401
# names the module had outside __all__, kept importable
from .._src.ports.t5x.partitioning import (devices, local_device_count, process_count)  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
