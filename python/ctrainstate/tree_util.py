"""Pytrees: nested containers whose leaves are arrays (mirror of ``jax.tree_util``).

Containers: dict (keys sorted, like JAX), OrderedDict and defaultdict (insertion
order), list, tuple, namedtuple, ``None`` (a node with no children) and any
class registered with :func:`register_pytree_node`. Everything else is a leaf.

>>> from ctrainstate import tree_util
>>> tree_util.tree_map(lambda x: x * 2, {'b': [1, 2], 'a': (3,)})
{'a': (6,), 'b': [2, 4]}
"""
from __future__ import annotations

import collections
import functools
from itertools import islice

import numpy as np
from typing import Any, Callable, NamedTuple

__all__ = [
    "PyTreeDef",
    "register_pytree_node",
    "register_pytree_node_class",
    "register_pytree_with_keys",
    "register_pytree_with_keys_class",
    "register_dataclass",
    "register_static",
    "tree_flatten",
    "tree_unflatten",
    "tree_leaves",
    "tree_structure",
    "tree_map",
    "tree_flatten_with_path",
    "tree_map_with_path",
    "tree_leaves_with_path",
    "keystr",
    "tree_reduce",
    "tree_all",
    "tree_transpose",
    "tree_broadcast",
    "tree_reduce_associative",
    "Partial",
    "DictKey",
    "SequenceKey",
    "GetAttrKey",
    "FlattenedIndexKey",
    "all_leaves",
]


class DictKey(NamedTuple):
    key: Any

    def __str__(self):
        return f"[{self.key!r}]"


class SequenceKey(NamedTuple):
    idx: int

    def __str__(self):
        return f"[{self.idx}]"


class FlattenedIndexKey(NamedTuple):
    """The key of the i-th child of a node registered without keys (jax's FlattenedIndexKey)."""
    key: int

    def __str__(self):
        return f"[<flat index {self.key}>]"


class GetAttrKey(NamedTuple):
    name: str

    def __str__(self):
        return f".{self.name}"


def _check_callable(f, who: str, what: str) -> None:
    if not callable(f):
        raise TypeError(f"{who}: {what} must be callable, got {type(f).__name__} {f!r:.60}")


def _check_is_leaf(is_leaf, who: str) -> None:
    if is_leaf is not None and not callable(is_leaf):
        raise TypeError(f"{who}: is_leaf must be a callable or None, got "
                        f"{type(is_leaf).__name__} {is_leaf!r:.60}")


def _check_treedef(td, who: str, what: str = "treedef") -> None:
    if not isinstance(td, PyTreeDef):
        raise TypeError(f"{who}: {what} must be a PyTreeDef (from tree_structure or "
                        f"tree_flatten), got {type(td).__name__}")


def _leaf_list(leaves, who: str) -> list:
    if isinstance(leaves, (str, bytes)) or not hasattr(leaves, "__iter__"):
        raise TypeError(f"{who}: leaves must be an iterable of leaves, got "
                        f"{type(leaves).__name__}")
    return list(leaves)


def _simple_key(k) -> str:
    if isinstance(k, DictKey):
        return str(k.key)
    if isinstance(k, SequenceKey):
        return str(k.idx)
    if isinstance(k, GetAttrKey):
        return k.name
    if isinstance(k, FlattenedIndexKey):
        return str(k.key)
    return str(k)


def keystr(path, *, simple: bool = False, separator: str = "") -> str:
    """``"['params']['Dense_0']['kernel']"`` for a key path; ``simple=True, separator='/'``
    gives ``'params/Dense_0/kernel'`` (jax.tree_util.keystr).

    >>> keystr((DictKey('a'), SequenceKey(0)), simple=True, separator='/')
    'a/0'
    """
    if isinstance(path, (str, bytes)) or not hasattr(path, "__iter__"):
        raise TypeError(f"keystr: path must be a sequence of keys (from tree_flatten_with_path), "
                        f"got {type(path).__name__}")
    if not isinstance(separator, str):
        raise TypeError(f"keystr: separator must be a string, got {type(separator).__name__}")
    return separator.join(_simple_key(k) if simple else str(k) for k in path)


# node type -> (flatten(x) -> (children, aux, keys), unflatten(aux, children))
# type -> (flatten with keys, unflatten, flatten without keys)
_registry: dict[type, tuple[Callable, Callable, Callable]] = {}


def register_pytree_node(nodetype: type, flatten_func: Callable, unflatten_func: Callable,
                         flatten_with_keys_func: Callable | None = None) -> None:
    """Register ``nodetype``: ``flatten_func(x) -> (children, aux_data)`` and
    ``unflatten_func(aux_data, children) -> x``. Its children's key paths are
    ``FlattenedIndexKey(i)``, or those of ``flatten_with_keys_func(x) -> ([(key, child)], aux)``
    (see :func:`register_pytree_with_keys`)."""
    _check_node_type(nodetype, "register_pytree_node")
    _check_callable(flatten_func, "register_pytree_node", "flatten_func")
    _check_callable(unflatten_func, "register_pytree_node", "unflatten_func")
    if flatten_with_keys_func is not None:
        return register_pytree_with_keys(nodetype, flatten_with_keys_func, unflatten_func,
                                         flatten_func)
    if nodetype in _registry:
        raise ValueError(f"{nodetype.__name__} is already registered as a pytree node")

    def flat(x):
        children, aux = flatten_func(x)
        children = list(children)
        return children, aux, [FlattenedIndexKey(i) for i in range(len(children))]

    def plain(x):  # without key paths (tree_flatten); children read more than once
        children, aux = flatten_func(x)
        return (children if type(children) is tuple or type(children) is list
                else list(children)), aux

    _registry[nodetype] = (flat, unflatten_func, plain)
    _LEAF_TYPES.discard(nodetype)


def register_pytree_with_keys(nodetype: type, flatten_with_keys: Callable, unflatten_func: Callable,
                              flatten_func: Callable | None = None):
    """Like :func:`register_pytree_node` but ``flatten_with_keys(x) -> ([(key, child)], aux)``
    (``flatten_func``, optional, flattens without the keys)."""
    _check_node_type(nodetype, "register_pytree_with_keys")
    _check_callable(flatten_with_keys, "register_pytree_with_keys", "flatten_with_keys")
    _check_callable(unflatten_func, "register_pytree_with_keys", "unflatten_func")
    if flatten_func is not None:
        _check_callable(flatten_func, "register_pytree_with_keys", "flatten_func")
    if nodetype in _registry:
        raise ValueError(f"{nodetype.__name__} is already registered as a pytree node")

    def flat(x):
        kc, aux = flatten_with_keys(x)
        kc = list(kc)
        return [c for _, c in kc], aux, [k for k, _ in kc]

    def plain(x):
        if flatten_func is not None:
            children, aux = flatten_func(x)
            return (children if type(children) is tuple or type(children) is list
                    else list(children)), aux
        kc, aux = flatten_with_keys(x)
        return [c for _, c in kc], aux

    _registry[nodetype] = (flat, unflatten_func, plain)
    _LEAF_TYPES.discard(nodetype)


def _check_node_type(nodetype, who: str) -> None:
    if not isinstance(nodetype, type):
        raise TypeError(f"{who}: nodetype must be a class, got {type(nodetype).__name__} "
                        f"{nodetype!r:.60}")


def register_pytree_node_class(cls):
    """Class decorator: uses ``cls.tree_flatten`` and ``cls.tree_unflatten``."""
    register_pytree_node(cls, lambda x: x.tree_flatten(), cls.tree_unflatten)
    return cls


def register_pytree_with_keys_class(cls):
    """Class decorator: uses ``cls.tree_flatten_with_keys`` (and ``cls.tree_flatten`` if it has
    one) and ``cls.tree_unflatten`` (jax.tree_util.register_pytree_with_keys_class)."""
    register_pytree_with_keys(cls, lambda x: x.tree_flatten_with_keys(), cls.tree_unflatten,
                              (lambda x: x.tree_flatten()) if hasattr(cls, "tree_flatten") else None)
    return cls


def register_dataclass(nodetype, data_fields=None, meta_fields=None, drop_fields=()):
    """Register a dataclass (or a class built from keyword arguments): ``data_fields`` are
    children (key paths ``.name``), ``meta_fields`` static; without them a dataclass's fields
    marked ``metadata={'static': True}`` are static (jax.tree_util.register_dataclass).
    Usable as a class decorator.

    >>> import dataclasses
    >>> @register_dataclass
    ... @dataclasses.dataclass
    ... class P:
    ...     x: float
    ...     tag: str = dataclasses.field(default='t', metadata={'static': True})
    >>> tree_leaves(P(1.0)), tree_map(lambda v: v * 2, P(1.0, 'u'))
    ([1.0], P(x=2.0, tag='u'))
    """
    import dataclasses
    if data_fields is None or meta_fields is None:
        if (data_fields is None) != (meta_fields is None):
            raise TypeError(f"register_dataclass: data_fields and meta_fields must both be given "
                            f"when either is, got data_fields={data_fields!r}, "
                            f"meta_fields={meta_fields!r}")
        if not dataclasses.is_dataclass(nodetype):
            raise TypeError(f"register_dataclass: data_fields and meta_fields are required when "
                            f"the type is not a dataclass, got {nodetype!r}")
        fields = dataclasses.fields(nodetype)
        data_fields = [f.name for f in fields if not f.metadata.get("static", False)]
        meta_fields = [f.name for f in fields if f.metadata.get("static", False)]
    data_fields, meta_fields = tuple(data_fields), tuple(meta_fields)
    if dataclasses.is_dataclass(nodetype):
        init = {f.name for f in dataclasses.fields(nodetype) if f.init} - set(drop_fields)
        given = {*data_fields, *meta_fields}
        if given != init:
            raise ValueError(f"register_dataclass({nodetype.__name__}): data_fields and "
                             f"meta_fields must name every dataclass field with init=True and "
                             f"only those: missing {sorted(init - given)}, unexpected "
                             f"{sorted(given - init)} (drop_fields= leaves fields out)")
    overlap = set(data_fields) & set(meta_fields)
    if overlap:
        raise ValueError(f"register_dataclass({nodetype.__name__}): data_fields and meta_fields "
                         f"overlap in {sorted(overlap)}")

    def flatten_with_keys(x):
        return ([(GetAttrKey(n), getattr(x, n)) for n in data_fields],
                tuple(getattr(x, n) for n in meta_fields))

    def unflatten(meta, data):
        return nodetype(**dict(zip(meta_fields, meta)), **dict(zip(data_fields, data)))

    register_pytree_with_keys(nodetype, flatten_with_keys, unflatten,
                              lambda x: ([getattr(x, n) for n in data_fields],
                                         tuple(getattr(x, n) for n in meta_fields)))
    return nodetype


def register_static(cls):
    """Make instances of ``cls`` tree nodes without children, held in the structure
    (jax.tree_util.register_static). Returns ``cls``."""
    register_pytree_node(cls, lambda x: ((), x), lambda x, _: x)
    return cls


def _sorted_keys(d):
    try:
        return sorted(d)
    except TypeError:
        return list(d)


def _flatten_node(x):
    """(children, aux, keys, kind) for a container, or None for a leaf."""
    t = type(x)
    if t in _registry:
        children, aux, keys = _registry[t][0](x)
        return children, aux, keys, t
    if x is None:
        return [], None, [], type(None)
    if t is dict:
        ks = _sorted_keys(x)
        return [x[k] for k in ks], tuple(ks), [DictKey(k) for k in ks], dict
    if t is collections.OrderedDict:
        ks = list(x)
        return [x[k] for k in ks], tuple(ks), [DictKey(k) for k in ks], t
    if t is collections.defaultdict:
        ks = _sorted_keys(x)
        return [x[k] for k in ks], (x.default_factory, tuple(ks)), [DictKey(k) for k in ks], t
    if t is list:
        return list(x), len(x), [SequenceKey(i) for i in range(len(x))], list
    if t is tuple:
        return list(x), len(x), [SequenceKey(i) for i in range(len(x))], tuple
    if isinstance(x, tuple) and hasattr(t, "_fields"):
        return list(x), t, [GetAttrKey(f) for f in t._fields], "namedtuple"
    return None


def _unflatten_node(kind, aux, children):
    if kind in _registry:
        return _registry[kind][1](aux, children)
    if kind is type(None):
        return None
    if kind is dict:
        return dict(zip(aux, children))
    if kind is collections.OrderedDict:
        return collections.OrderedDict(zip(aux, children))
    if kind is collections.defaultdict:
        factory, ks = aux
        return collections.defaultdict(factory, zip(ks, children))
    if kind is list:
        return list(children)
    if kind is tuple:
        return tuple(children)
    if kind == "namedtuple":
        return aux(*children)
    raise TypeError(f"unknown pytree node kind {kind!r}")


class PyTreeDef:
    """The structure of a pytree: node kinds, aux data and the leaf positions."""

    __slots__ = ("kind", "aux", "_children", "num_leaves", "leafy")

    def __init__(self, kind, aux, children, num_leaves=None, leafy=None):
        self.kind = kind  # "leaf", "none" handled via kind type(None)
        self.aux = aux
        self._children = tuple(children)
        self.leafy = leafy   # every child the shared leaf node (None: not known yet)
        if kind == "leaf":
            self.num_leaves = 1
        elif num_leaves is not None:   # known to the caller (flatten counts as it goes)
            self.num_leaves = num_leaves
        else:
            self.num_leaves = sum([c.num_leaves for c in self._children])

    @property
    def num_nodes(self) -> int:
        return 1 if self.kind == "leaf" else 1 + sum(c.num_nodes for c in self._children)

    def unflatten(self, leaves):
        return tree_unflatten(self, leaves)

    def children(self) -> list:
        """The structures of this node's children (jax's ``PyTreeDef.children()``)."""
        return list(self._children)

    def flatten_up_to(self, tree) -> list:
        """The subtrees of ``tree`` at this structure's leaves (``tree`` may be deeper there)."""
        return _flatten_up_to(self, tree)

    def _key(self):
        aux = self.aux
        return (self.kind, aux, self._children)

    def __eq__(self, other):
        if self is other:
            return True
        if not isinstance(other, PyTreeDef):
            return NotImplemented
        if (self.kind != other.kind or self.num_leaves != other.num_leaves
                or len(self._children) != len(other._children)):
            return False
        if not _same_aux(self.aux, other.aux):
            return False
        # tuple equality compares identical items (the shared leaf node) without a call
        return self._children == other._children

    def __hash__(self):
        try:
            return hash((str(self.kind), self.aux, self._children))
        except TypeError:
            return hash((str(self.kind), self._children))

    def __repr__(self):
        if self.kind == "leaf":
            return "*"
        inner = ", ".join(repr(c) for c in self._children)
        name = self.kind if isinstance(self.kind, str) else self.kind.__name__
        if self.kind is dict:
            return "{" + ", ".join(f"{k!r}: {c!r}" for k, c in zip(self.aux, self._children)) + "}"
        if self.kind is list:
            return f"[{inner}]"
        if self.kind is tuple:
            return f"({inner}{',' if len(self._children) == 1 else ''})"
        if self.kind is type(None):
            return "None"
        return f"PyTreeDef({name}, [{inner}])"


_LEAF = PyTreeDef("leaf", None, ())
_NONE = PyTreeDef(type(None), None, (), 0)

# Types that are always leaves (checked first by the flatten fast path); Array and
# ShapeDtypeStruct are added when their modules load (register_leaf_type).
_LEAF_TYPES = {np.ndarray, int, float, bool, complex, str, bytes, np.float32, np.float64,
               np.int32, np.int64, np.bool_}


def register_leaf_type(t: type) -> None:
    """Declare ``t`` a leaf type for the flatten fast path (it must not be a registered node)."""
    if t in _registry:
        raise ValueError(f"{t.__name__} is a registered pytree node, not a leaf type")
    _LEAF_TYPES.add(t)


def _flatten_plain(x, is_leaf, leaves):
    """_flatten without key paths (the common case: no key objects are built). Children
    of a known leaf type are appended in the node's own loop, without a call each."""
    t = type(x)
    if t in _LEAF_TYPES or (is_leaf is not None and is_leaf(x)):
        leaves.append(x)
        return _LEAF
    if t is dict:
        ks = _sorted_keys(x)
        children, aux, kind = [x[k] for k in ks], tuple(ks), dict
    elif t is tuple or t is list:
        children, aux, kind = x, len(x), t
    else:
        reg = _registry.get(t)
        if reg is not None:
            children, aux = reg[2](x)
            kind = t
        elif x is None:
            return _NONE
        elif isinstance(x, tuple) and hasattr(t, "_fields"):
            children, aux, kind = x, t, "namedtuple"
        else:
            node = _flatten_node(x)   # dict subclasses
            if node is None:
                leaves.append(x)
                return _LEAF
            children, aux, _, kind = node
    n0 = len(leaves)
    if is_leaf is None:
        lt = _LEAF_TYPES
        if set(map(type, children)) <= lt:   # only leaves below (a params dict, a layer)
            leaves.extend(children)
            return PyTreeDef(kind, aux, (_LEAF,) * len(children), len(children), True)
        append = leaves.append
        defs = []
        for c in children:
            if type(c) in lt:
                append(c)
                defs.append(_LEAF)
            else:
                defs.append(_flatten_plain(c, None, leaves))
    else:
        defs = [_flatten_plain(c, is_leaf, leaves) for c in children]
    return PyTreeDef(kind, aux, defs, len(leaves) - n0)


def _flatten(x, is_leaf, leaves, paths, path, takes_path=False):
    if paths is None:
        return _flatten_plain(x, is_leaf, leaves)
    if is_leaf is not None and (is_leaf(path, x) if takes_path else is_leaf(x)):
        leaves.append(x)
        if paths is not None:
            paths.append(path)
        return _LEAF
    node = _flatten_node(x)
    if node is None:
        leaves.append(x)
        if paths is not None:
            paths.append(path)
        return _LEAF
    children, aux, keys, kind = node
    defs = [
        _flatten(c, is_leaf, leaves, paths, path + (k,) if paths is not None else path, takes_path)
        for c, k in zip(children, keys)
    ]
    return PyTreeDef(kind, aux, defs)


def tree_flatten(tree, is_leaf: Callable | None = None):
    """``(leaves, treedef)`` of ``tree``, leaves in a deterministic order."""
    if is_leaf is not None:
        _check_is_leaf(is_leaf, "tree_flatten")
    leaves: list = []
    td = _flatten(tree, is_leaf, leaves, None, ())
    return leaves, td


def tree_flatten_with_path(tree, is_leaf: Callable | None = None, is_leaf_takes_path: bool = False):
    """``([(key_path, leaf)], treedef)``; with ``is_leaf_takes_path`` the predicate is called
    as ``is_leaf(key_path, x)``."""
    _check_is_leaf(is_leaf, "tree_flatten_with_path")
    leaves: list = []
    paths: list = []
    td = _flatten(tree, is_leaf, leaves, paths, (), is_leaf_takes_path)
    return list(zip(paths, leaves)), td


def tree_leaves_with_path(tree, is_leaf: Callable | None = None, is_leaf_takes_path: bool = False):
    return tree_flatten_with_path(tree, is_leaf, is_leaf_takes_path)[0]


def tree_unflatten(treedef: PyTreeDef, leaves):
    """Rebuild a pytree of structure ``treedef`` from ``leaves``."""
    if type(treedef) is not PyTreeDef:
        _check_treedef(treedef, "tree_unflatten")
    leaves = _leaf_list(leaves, "tree_unflatten")
    if len(leaves) != treedef.num_leaves:
        raise ValueError(
            f"tree_unflatten: the structure has {treedef.num_leaves} leaves but "
            f"{len(leaves)} were given")
    it = iter(leaves)

    def build(td):
        if td.kind == "leaf":
            return next(it)
        leafy = td.leafy
        if leafy is None:
            leafy = td.leafy = all(c is _LEAF for c in td._children)
        if leafy:
            kids = list(islice(it, len(td._children)))
        else:
            kids = [next(it) if c is _LEAF or c.kind == "leaf" else build(c) for c in td._children]
        return _unflatten_node(td.kind, td.aux, kids)

    return build(treedef)


def tree_leaves(tree, is_leaf: Callable | None = None) -> list:
    return tree_flatten(tree, is_leaf)[0]


def tree_structure(tree, is_leaf: Callable | None = None) -> PyTreeDef:
    return tree_flatten(tree, is_leaf)[1]


def all_leaves(iterable, is_leaf: Callable | None = None) -> bool:
    """Whether every item of ``iterable`` is a leaf (jax.tree_util.all_leaves)."""
    if is_leaf is None:
        return all(tree_structure(x) == _LEAF for x in iterable)
    items = list(iterable)   # JAX's test: is_leaf sees the list itself first
    return items == tree_leaves(items, is_leaf)


def _flatten_up_to(treedef, tree, path=(), check_aux=False):
    """Leaves of ``tree`` at the leaf positions of ``treedef`` (tree may be deeper).

    ``check_aux`` (tree_map's check): nodes must also agree in their metadata, as in JAX;
    without it (sharding prefix trees) only dict keys are compared."""
    if treedef.kind == "leaf":
        return [tree]
    node = _flatten_node(tree)
    if node is None:
        raise ValueError(
            f"tree structure mismatch at {keystr(path) or 'the root'}: expected a "
            f"{_kind_name(treedef.kind)}, got a leaf of type {type(tree).__name__}")
    children, aux, keys, kind = node
    if kind != treedef.kind or len(children) != len(treedef._children) or (
            kind in (dict, collections.OrderedDict) and aux != treedef.aux):
        raise ValueError(
            f"tree structure mismatch at {keystr(path) or 'the root'}: expected "
            f"{treedef!r}, got {_kind_name(kind)} with {len(children)} children"
            + (f" (keys {list(aux)!r})" if kind in (dict, collections.OrderedDict) else ""))
    if (check_aux and kind is not dict and kind is not list and kind is not tuple
            and not _same_aux(aux, treedef.aux)):
        # namedtuple classes, FrozenDict / defaultdict keys, a struct's static fields: as JAX
        # does, nodes that differ there do not match (their leaves would pair up wrongly)
        raise ValueError(
            f"tree structure mismatch at {keystr(path) or 'the root'}: expected a "
            f"{_kind_name(kind)} node with metadata {_aux_name(treedef.aux)}, got one with "
            f"{_aux_name(aux)}")
    out = []
    for c, k, td in zip(children, keys, treedef._children):
        out += _flatten_up_to(td, c, path + (k,), check_aux)
    return out


def _same_aux(a, b) -> bool:
    """Whether two nodes' aux data are equal (PyTreeDef equality, tree_map's metadata check);
    aux without a usable ``==`` (e.g. arrays) is compared by identity."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def _aux_name(aux) -> str:
    return aux.__name__ if isinstance(aux, type) else repr(aux)


def _kind_name(kind):
    if isinstance(kind, str):
        return kind
    return kind.__name__


def tree_map(f: Callable, tree, *rest, is_leaf: Callable | None = None):
    """Apply ``f`` to the leaves of ``tree`` (and the matching leaves of ``rest``).

    >>> tree_map(lambda a, b: a + b, [1, (2,)], [10, (20,)])
    [11, (22,)]
    """
    if not callable(f):
        _check_callable(f, "tree_map", "f")
    leaves, td = tree_flatten(tree, is_leaf)
    others = [_flatten_up_to(td, r, check_aux=True) for r in rest]
    return tree_unflatten(td, [f(*xs) for xs in zip(leaves, *others)])


def tree_map_with_path(f: Callable, tree, *rest, is_leaf: Callable | None = None,
                       is_leaf_takes_path: bool = False):
    """Like :func:`tree_map`, with the key path as ``f``'s first argument (and ``is_leaf``'s,
    with ``is_leaf_takes_path``)."""
    _check_callable(f, "tree_map_with_path", "f")
    pl, td = tree_flatten_with_path(tree, is_leaf, is_leaf_takes_path)
    others = [_flatten_up_to(td, r, check_aux=True) for r in rest]
    return tree_unflatten(td, [f(p, x, *xs) for (p, x), *xs in zip(pl, *others)])


class _Unspecified:
    pass


_UNSPECIFIED = _Unspecified()


def tree_reduce(function: Callable, tree, initializer: Any = _UNSPECIFIED,
                is_leaf: Callable | None = None):
    """``functools.reduce(function, tree_leaves(tree)[, initializer])`` (jax.tree_util.tree_reduce).

    >>> tree_reduce(lambda a, b: a + b, {'x': 1, 'y': [2, 3]}, 10)
    16
    """
    import functools
    _check_callable(function, "tree_reduce", "function")
    leaves = tree_leaves(tree, is_leaf=is_leaf)
    if initializer is _UNSPECIFIED:
        return functools.reduce(function, leaves)
    return functools.reduce(function, leaves, initializer)


def tree_all(tree, *, is_leaf: Callable | None = None) -> bool:
    """``all(tree_leaves(tree))`` (jax.tree_util.tree_all)."""
    return all(tree_leaves(tree, is_leaf=is_leaf))


def tree_transpose(outer_treedef: PyTreeDef, inner_treedef: PyTreeDef | None, pytree_to_transpose):
    """A tree of structure ``outer(inner)`` as one of structure ``inner(outer)``; ``inner_treedef``
    None takes it from the first outer subtree (jax.tree_util.tree_transpose).

    >>> tree_transpose(tree_structure([0, 0]), tree_structure((0, 0)), [(1, 2), (3, 4)])
    ([1, 3], [2, 4])
    """
    _check_treedef(outer_treedef, "tree_transpose", "outer_treedef")
    if inner_treedef is not None:
        _check_treedef(inner_treedef, "tree_transpose", "inner_treedef")
    flat, treedef = tree_flatten(pytree_to_transpose)
    if inner_treedef is None:
        inner_treedef = tree_structure(_flatten_up_to(outer_treedef, pytree_to_transpose)[0])
    inner_size, outer_size = inner_treedef.num_leaves, outer_treedef.num_leaves
    if treedef.num_leaves != inner_size * outer_size:   # JAX checks the count only, so do we
        raise TypeError(f"tree_transpose: the tree has {treedef.num_leaves} leaves, the outer "
                        f"structure {outer_treedef!r} of inner ones {inner_treedef!r} has "
                        f"{outer_size * inner_size}")
    it = iter(flat)
    lol = [[next(it) for _ in range(inner_size)] for _ in range(outer_size)]
    return tree_unflatten(inner_treedef, [tree_unflatten(outer_treedef, list(col))
                                          for col in zip(*lol)])


class _PartialFunc:
    """A ``functools.partial`` held as Partial's static function (not merged into it)."""

    def __init__(self, f):
        self.f = f

    def __call__(self, *args, **kwargs):
        return self.f(*args, **kwargs)

    def __eq__(self, other):
        return isinstance(other, _PartialFunc) and self.f is other.f

    def __hash__(self):
        return id(self.f)


class Partial(functools.partial):
    """``functools.partial`` as a pytree: the arguments are children, the function is static
    (jax.tree_util.Partial), so a partially applied function passes through tree_map.

    >>> tree_map(lambda x: x * 10, Partial(max, 1, 2))()
    20
    """

    def __new__(cls, func, *args, **kwargs):
        if isinstance(func, functools.partial):   # keep a partial's own arguments static
            func = _PartialFunc(func)
        return super().__new__(cls, func, *args, **kwargs)


register_pytree_node(Partial, lambda p: ((p.args, p.keywords), p.func),
                     lambda func, xs: Partial(func, *xs[0], **xs[1]))


def tree_broadcast(prefix_tree, full_tree, is_leaf: Callable | None = None):
    """``full_tree``'s structure with each leaf of ``prefix_tree`` repeated over the subtree it
    prefixes (jax.tree_util.tree_broadcast); ``is_leaf`` applies to ``prefix_tree``.

    >>> tree_broadcast({'a': 1, 'b': 2}, {'a': [0, 0], 'b': 0})
    {'a': [1, 1], 'b': 2}
    """
    leaves, td = tree_flatten(prefix_tree, is_leaf)
    subtrees = _flatten_up_to(td, full_tree, check_aux=True)
    out = []
    for x, sub in zip(leaves, subtrees):
        out.extend([x] * tree_structure(sub).num_leaves)
    return tree_unflatten(tree_structure(full_tree), out)


def tree_reduce_associative(operation: Callable, tree, *, identity: Any = _UNSPECIFIED,
                            is_leaf: Callable | None = None):
    """Reduce the leaves with an associative ``operation`` as a balanced binary tree, as
    jax.tree_util.tree_reduce_associative pairs them (``identity`` for an empty tree).

    >>> tree_reduce_associative(lambda a, b: f"({a}+{b})", [1, 2, 3, 4])
    '((1+2)+(3+4))'
    """
    _check_callable(operation, "tree_reduce_associative", "operation")

    def reduce(seq):
        if not seq:
            if identity is _UNSPECIFIED:
                raise TypeError("tree_reduce_associative: the tree has no leaves; give identity=")
            return identity
        if len(seq) == 1:
            return seq[0]
        half = len(seq) // 2
        return operation(reduce(seq[:half]), reduce(seq[half:]))
    return reduce(tree_leaves(tree, is_leaf=is_leaf))


from ._exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
