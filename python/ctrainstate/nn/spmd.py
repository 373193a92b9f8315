"""Logical axis rules and logical sharding constraints (mirror of ``flax.linen.spmd``).

Resolution and the thread-local rules context live in C (``ctrainstate._C``:
``csrc/core/ct_rules.c`` and ``csrc/python/py_rules.c``); this module only
wraps results in ``PartitionSpec`` and walks pytrees.

Version profile: current Flax (0.12.3+). Rules are tried in order; a mesh axis
serves one dimension per array; a tuple rule is all-or-nothing; ``(name, None)``
claims a dimension; unmatched names resolve to ``None``; non-string entries
(``None``, ``PartitionSpec.UNCONSTRAINED``, ...) are kept verbatim; ``None`` and
``UNCONSTRAINED`` in a rule's value never count as used mesh axes.

>>> from ctrainstate.nn import spmd
>>> rules = (('batch', 'data'), ('embed', 'model'), ('mlp', 'model'))
>>> spmd.logical_to_mesh_axes(('batch', 'embed', 'mlp'), rules)
PartitionSpec('data', 'model', None)
"""
from .._src.nn.spmd import *  # noqa: F401,F403
from .._src.nn.spmd import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
