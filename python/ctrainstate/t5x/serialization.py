"""State dicts (mirror of ``flax.serialization.to_state_dict`` / ``from_state_dict``).

A state dict is nested plain dicts with string keys: dicts keep their keys,
tuples and lists become ``{'0': ..., '1': ...}``, NamedTuples ``{field: ...}``
and ctrainstate structs (``PyTreeNode``) ``{data field: ...}``. Anything else —
Arrays, numbers, ``PartitionSpec`` — is a leaf, unless its type was registered with
:func:`register_serialization_state` (Flax's hook for custom classes).

>>> from ctrainstate.t5x.serialization import to_state_dict, from_state_dict
>>> sd = to_state_dict({'opt': (1, {'mu': 2})})
>>> sd
{'opt': {'0': 1, '1': {'mu': 2}}}
>>> from_state_dict({'opt': (0, {'mu': 0})}, sd)
{'opt': (1, {'mu': 2})}
"""
from .._src.serialization.state_dict import *  # noqa: F401,F403
from .._src.serialization.state_dict import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
