"""``flax.struct``: frozen dataclasses that are pytrees.

``@struct.dataclass`` / ``struct.PyTreeNode`` make the fields children of the pytree, except
those declared ``struct.field(pytree_node=False)`` (static, kept in the tree structure);
``.replace(**changes)`` returns a copy.

>>> from typing import Any, Callable
>>> from ctrainstate import struct, tree_util
>>> @struct.dataclass
... class Model:
...     params: Any
...     apply_fn: Callable = struct.field(pytree_node=False)
>>> m = Model({'w': 1.0}, print)
>>> tree_util.tree_leaves(m), m.replace(params={'w': 2.0}).params
([1.0], {'w': 2.0})
"""
from ._src.train_state.train_state import PyTreeNode, dataclass, field

__all__ = ["dataclass", "field", "PyTreeNode"]
