"""Pytrees: nested containers whose leaves are arrays (mirror of ``jax.tree_util``), built on
optree (the C++ pytree library whose flattening order and None handling are jax's).

Containers: dict (keys sorted, like JAX), OrderedDict (insertion order), defaultdict (keys
sorted), list, tuple, namedtuple, ``None`` (a node with no children) and any class
registered with :func:`register_pytree_node` (kept in optree's ``"ctrainstate"``
namespace). Everything else is a leaf. Key paths use jax's key classes (``DictKey``,
``SequenceKey``, ``GetAttrKey``, ``FlattenedIndexKey``). A treedef is optree's
``PyTreeSpec`` (``PyTreeDef`` here), whose flatten, unflatten and comparison run in C++.

>>> from ctrainstate import tree_util
>>> tree_util.tree_map(lambda x: x * 2, {'b': [1, 2], 'a': (3,)})
{'a': (6,), 'b': [2, 4]}
"""
from ._src.base.tree_util import *  # noqa: F401,F403
from ._src.base.tree_util import __all__  # noqa: F401
# names the module had outside __all__, kept importable
from ._src.base.tree_util import (register_leaf_type)  # noqa: F401

from ._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
