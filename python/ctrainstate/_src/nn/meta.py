"""The implementation of :mod:`ctrainstate.nn.meta` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import abc
import functools
from typing import Any, Callable

from ..base import tree_util
from ..array.sharding import NamedSharding, PartitionSpec
from ..array import sharding as _sh
from ..ops.ops import with_sharding
from ..array.array import Array, device_put
from ..array.sharding import get_mesh
from ..base.hooks import upper as _upper

PARTITION_NAME = 'partition_name'

__all__ = [
    'AxisMetadata', 'is_axis_metadata', 'map_axis_meta', 'add_axis', 'remove_axis', 'unbox',
    'replace_boxed', 'PARTITION_NAME', 'Partitioned', 'with_partitioning', 'get_partition_spec',
    'get_sharding', 'PartitioningUnspecifiedError',
]


class PartitioningUnspecifiedError(ValueError):
    """A transform tried to add/remove an axis of a Partitioned box without a partition name."""

    def __init__(self, target):
        super().__init__(
            'Trying to transform a Partitioned variable but "partition_name" is not specified '
            f'in metadata_params: {target}')


class AxisMetadata(abc.ABC):
    """Abstract base of boxed metadata: ``unbox``, ``replace_boxed``, ``add_axis``, ``remove_axis``.

    >>> from ctrainstate.nn.meta import AxisMetadata, Partitioned
    >>> isinstance(Partitioned(1.0, ()), AxisMetadata)
    True
    """

    @abc.abstractmethod
    def unbox(self) -> Any:
        """Return the boxed value (possibly with a sharding constraint applied)."""

    @abc.abstractmethod
    def replace_boxed(self, val: Any) -> 'AxisMetadata':
        """Return a copy of this box holding ``val``."""

    @abc.abstractmethod
    def add_axis(self, index: int, params: dict) -> 'AxisMetadata':
        """Return a box describing the value with a new axis at ``index``."""

    @abc.abstractmethod
    def remove_axis(self, index: int, params: dict) -> 'AxisMetadata':
        """Return a box describing the value without axis ``index``."""


def is_axis_metadata(val: Any) -> bool:
    """True for boxes.

    >>> from ctrainstate.nn.meta import is_axis_metadata, Partitioned
    >>> is_axis_metadata(Partitioned(0, ())), is_axis_metadata(0)
    (True, False)
    """
    return isinstance(val, AxisMetadata)


def map_axis_meta(fn: Callable[[AxisMetadata], Any], tree: Any) -> Any:
    """Apply ``fn`` to every box of ``tree``; other leaves are kept.

    >>> from ctrainstate.nn.meta import map_axis_meta, Partitioned
    >>> map_axis_meta(lambda b: b.names, {'a': Partitioned(0, ('x',)), 'b': 1})
    {'a': ('x',), 'b': 1}
    """
    return tree_util.tree_map(lambda x: fn(x) if isinstance(x, AxisMetadata) else x, tree,
                              is_leaf=is_axis_metadata)


def add_axis(tree: Any, index: int, params: dict) -> Any:
    """Call ``add_axis(index, params)`` on every box."""
    return map_axis_meta(functools.partial(_add_axis, index=index, params=params), tree)


def _add_axis(x, index, params):
    return x.add_axis(index, params)


def remove_axis(tree: Any, index: int, params: dict) -> Any:
    """Call ``remove_axis(index, params)`` on every box."""
    return map_axis_meta(lambda x: x.remove_axis(index, params), tree)


def unbox(tree: Any) -> Any:
    """Strip every box (recursively, a box inside a box too).

    >>> from ctrainstate.nn.meta import unbox, Partitioned
    >>> unbox({'k': Partitioned(Partitioned(3, ()), ('a',))})
    {'k': 3}
    """
    if type(tree) is Array:   # (a parameter's value, the common case: nothing to walk)
        return tree
    return map_axis_meta(lambda x: unbox(x.unbox()), tree)


def replace_boxed(tree: Any, updates: Any) -> Any:
    """Put the values of ``updates`` into the boxes of ``tree`` (boxes kept).

    >>> from ctrainstate.nn.meta import replace_boxed, Partitioned
    >>> new = replace_boxed({'k': Partitioned(0, ('a',)), 'b': 0}, {'k': 5, 'b': 6})
    >>> new['k'].value, new['k'].names, new['b']
    (5, ('a',), 6)
    """

    def inner_update(c, v):
        if isinstance(c, AxisMetadata):
            return c.replace_boxed(replace_boxed(c.unbox(), v))
        return v

    return tree_util.tree_map(inner_update, tree, updates, is_leaf=is_axis_metadata)


def _global_mesh():
    return _sh.get_mesh()


class Partitioned(AxisMetadata):
    """Box holding ``value`` with mesh axis ``names`` (and an optional ``mesh``).

    Frozen; ``replace(**fields)`` makes a modified copy. ``unbox()`` reshards a
    ctrainstate Array onto ``NamedSharding(mesh, P(*names))`` when a mesh is
    active or given, and otherwise returns the value.

    >>> import numpy as np
    >>> from ctrainstate.nn import Partitioned
    >>> box = Partitioned(np.zeros((4, 2)), ('data', None))
    >>> box.get_partition_spec()
    PartitionSpec('data', None)
    >>> box.add_axis(0, {'partition_name': 'layers'}).names
    ('layers', 'data', None)
    """

    def __init__(self, value, names, mesh=None):
        object.__setattr__(self, 'value', value)
        object.__setattr__(self, 'names', names)
        object.__setattr__(self, 'mesh', mesh)

    def __setattr__(self, name, value):
        raise AttributeError(f"cannot assign to field '{name}' of a frozen {type(self).__name__}")

    def _fields(self):
        return dict(value=self.value, names=self.names, mesh=self.mesh)

    def replace(self, **updates):
        """Return a copy with some fields replaced."""
        fields = self._fields()
        unknown = set(updates) - set(fields)
        if unknown:
            raise TypeError(f'{type(self).__name__}.replace() got unknown field(s) {sorted(unknown)}')
        fields.update(updates)
        return type(self)(**fields)

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self.value, self.names, self.mesh) == (other.value, other.names, other.mesh)

    __hash__ = None

    def __repr__(self):
        return f'Partitioned(value={self.value!r}, names={self.names!r}, mesh={self.mesh!r})'

    def unbox(self, apply_constraint=True):
        """Return the value, resharded to this box's spec when a mesh is in reach."""
        if apply_constraint and (self.mesh is not None or _global_mesh() is not None):
            mesh = self.mesh if self.mesh is not None else _global_mesh()
            if isinstance(self.value, Array):
                _replicate_uneven = _upper('nn.spmd')._replicate_uneven
                target = _replicate_uneven(NamedSharding(mesh, self.get_partition_spec()),
                                           self.value.shape)
                if self.value.sharding != target:
                    return with_sharding(self.value, target)
        return self.value

    def replace_boxed(self, val):
        return self.replace(value=val)

    def _get_partition_name(self, params):
        if PARTITION_NAME not in params:
            raise PartitioningUnspecifiedError(self)
        return params[PARTITION_NAME]

    def add_axis(self, index, params):
        axis_name = self._get_partition_name(params)
        names = list(self.names)
        while len(names) < index:
            names.append(None)
        names.insert(index, axis_name)
        return self.replace(names=tuple(names))

    def remove_axis(self, index, params):
        axis_name = self._get_partition_name(params)
        names = list(self.names)
        removed = names.pop(index)
        if removed != axis_name:
            raise ValueError(f'Expected axis {axis_name!r} at position {index} of {self.names}, '
                             f'found {removed!r}')
        return self.replace(names=tuple(names))

    def get_partition_spec(self) -> PartitionSpec:
        """``PartitionSpec(*names)``."""
        return PartitionSpec(*self.names)

    def get_sharding(self, mesh) -> NamedSharding:
        """``NamedSharding(mesh, self.get_partition_spec())``."""
        return NamedSharding(mesh, self.get_partition_spec())


tree_util.register_pytree_with_keys(   # key path '.value', as Flax's struct has it
    Partitioned,
    lambda b: (((tree_util.GetAttrKey("value"), b.value),), (b.names, b.mesh)),
    lambda aux, children: Partitioned(children[0], aux[0], mesh=aux[1]),
)


def with_partitioning(fn: Callable[..., Any], names, mesh=None) -> Callable[..., Partitioned]:
    """Wrap an initializer so its result is boxed in :class:`Partitioned`.

    >>> import numpy as np
    >>> from ctrainstate.nn import with_partitioning
    >>> init = with_partitioning(lambda key, shape: np.ones(shape), (None, 'model'))
    >>> init(None, (2, 3)).names
    (None, 'model')
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        m = mesh if mesh is not None else get_mesh()
        init = fn
        if m is not None and 'out_sharding' not in kwargs:  # born sharded
            sharded_initializer = _upper('nn.module').sharded_initializer
            init = sharded_initializer(fn, NamedSharding(m, PartitionSpec(*names)))
        return Partitioned(init(*args, **kwargs), names, mesh=mesh)

    def born():
        m = mesh if mesh is not None else get_mesh()
        return NamedSharding(m, PartitionSpec(*names)) if m is not None else None

    # (unboxed init, boxing, born sharding): lets a layer that reshapes the value (DenseGeneral's
    # flat kernel init) box and shard the reshaped value instead
    wrapper._ct_boxing = (fn, lambda v: Partitioned(v, names, mesh=mesh), born)
    return wrapper


def _get_leaf_pspec(x):
    if hasattr(x, 'get_partition_spec'):
        return x.get_partition_spec()
    if hasattr(x, 'shape'):
        return PartitionSpec()
    return None


def get_partition_spec(tree: Any) -> Any:
    """Spec tree: box -> its spec; arrays and shape structs -> ``PartitionSpec()``; else ``None``.

    >>> import numpy as np
    >>> from ctrainstate.nn import get_partition_spec, Partitioned
    >>> get_partition_spec({'k': Partitioned(np.zeros((2, 2)), ('a', 'b')), 'n': 3})
    {'k': PartitionSpec('a', 'b'), 'n': None}
    """
    return tree_util.tree_map(_get_leaf_pspec, tree, is_leaf=is_axis_metadata)


def get_sharding(tree: Any, mesh) -> Any:
    """Like :func:`get_partition_spec`, as ``NamedSharding(mesh, spec)``; ``None`` stays ``None``.

    No logical rules are applied: logical boxes give their logical names.

    >>> import numpy as np
    >>> from ctrainstate import devices
    >>> from ctrainstate.sharding import Mesh
    >>> from ctrainstate.nn import get_sharding, Partitioned
    >>> mesh = Mesh(np.array(devices()[:1]).reshape(1, 1), ('in', 'out'))
    >>> get_sharding({'k': Partitioned(np.zeros((2, 2)), ('in', 'out'))}, mesh)['k'].spec
    PartitionSpec('in', 'out')
    """

    def f(x):
        if hasattr(x, 'get_sharding'):
            return x.get_sharding(mesh)
        spec = _get_leaf_pspec(x)
        return None if spec is None else NamedSharding(mesh, spec)

    return tree_util.tree_map(f, tree, is_leaf=is_axis_metadata)


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
