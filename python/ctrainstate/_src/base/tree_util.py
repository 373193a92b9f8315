"""The implementation of :mod:`ctrainstate.tree_util` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import dataclasses
import collections
import functools
from typing import Any, Callable, NamedTuple

import optree

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


# Every node type this package (or its user) registers lives in optree's namespace
# "ctrainstate"; every flatten passes it, so such nodes are nodes here and nowhere else.
_NS = "ctrainstate"
_KEY_TYPES = (DictKey, SequenceKey, GetAttrKey, FlattenedIndexKey)

# The structure of a pytree: optree's PyTreeSpec (num_leaves, num_nodes, children(),
# unflatten(leaves), flatten_up_to(tree); equal structures compare equal).
PyTreeDef = optree.PyTreeSpec


class _KeyEntry(optree.PyTreeEntry):
    """The path entry of a node registered here: ``entry`` is a jax key object
    (``DictKey``, ``GetAttrKey``, ...) or, for a node registered without keys, the child's
    index (reported as ``FlattenedIndexKey``)."""

    def __call__(self, obj):   # optree's accessor protocol: fetch this child of obj
        raise NotImplementedError("ctrainstate key-path entries are names, not accessors")

    def codify(self, node: str = "") -> str:
        return f"{node}{self.jax_key()}"

    def jax_key(self):
        e = self.entry
        return e if isinstance(e, _KEY_TYPES) else FlattenedIndexKey(e)


def _jax_key(entry):
    """optree's path entry as jax's key object."""
    if isinstance(entry, _KeyEntry):
        return entry.jax_key()
    if isinstance(entry, optree.MappingEntry):
        return DictKey(entry.entry)
    if isinstance(entry, optree.NamedTupleEntry):
        return GetAttrKey(entry.field)
    if isinstance(entry, optree.SequenceEntry):
        return SequenceKey(entry.entry)
    return FlattenedIndexKey(entry.entry)


def _check_callable(f, who: str, what: str) -> None:
    if not callable(f):
        raise TypeError(f"{who}: {what} must be callable, got {type(f).__name__} {f!r:.60}")


def _check_node_type(nodetype, who: str) -> None:
    if not isinstance(nodetype, type):
        raise TypeError(f"{who}: nodetype must be a class, got {type(nodetype).__name__} "
                        f"{nodetype!r:.60}")


def _check_treedef(td, who: str, what: str = "treedef") -> None:
    if not isinstance(td, PyTreeDef):
        raise TypeError(f"{who}: {what} must be a PyTreeDef (from tree_structure or "
                        f"tree_flatten), got {type(td).__name__}")


def _register(nodetype: type, flatten: Callable, unflatten_func: Callable) -> None:
    try:
        optree.register_pytree_node(nodetype, flatten, unflatten_func, path_entry_type=_KeyEntry,
                                    namespace=_NS)
    except ValueError as e:
        if "already registered" in str(e):
            raise ValueError(f"{nodetype.__name__} is already registered as a pytree node") \
                from None
        raise


def register_pytree_node(nodetype: type, flatten_func: Callable, unflatten_func: Callable,
                         flatten_with_keys_func: Callable | None = None) -> None:
    """Register ``nodetype``: ``flatten_func(x) -> (children, aux_data)`` and
    ``unflatten_func(aux_data, children) -> x``. Its children's key paths are
    ``FlattenedIndexKey(i)``, or those of ``flatten_with_keys_func(x) -> ([(key, child)], aux)``
    (see :func:`register_pytree_with_keys`).

    >>> class Box:
    ...     def __init__(self, v): self.v = v
    >>> register_pytree_node(Box, lambda b: ((b.v,), None), lambda _, ch: Box(*ch))
    >>> tree_leaves([Box(1), Box(2)])
    [1, 2]
    """
    _check_node_type(nodetype, "register_pytree_node")
    _check_callable(flatten_func, "register_pytree_node", "flatten_func")
    _check_callable(unflatten_func, "register_pytree_node", "unflatten_func")
    if flatten_with_keys_func is not None:
        return register_pytree_with_keys(nodetype, flatten_with_keys_func, unflatten_func,
                                         flatten_func)
    _register(nodetype, flatten_func, unflatten_func)


def register_pytree_with_keys(nodetype: type, flatten_with_keys: Callable, unflatten_func: Callable,
                              flatten_func: Callable | None = None):
    """Like :func:`register_pytree_node` but ``flatten_with_keys(x) -> ([(key, child)], aux)``;
    the keys are the children's key path entries (``flatten_func`` is accepted for jax's
    signature; the keyed flatten serves both)."""
    _check_node_type(nodetype, "register_pytree_with_keys")
    _check_callable(flatten_with_keys, "register_pytree_with_keys", "flatten_with_keys")
    _check_callable(unflatten_func, "register_pytree_with_keys", "unflatten_func")
    if flatten_func is not None:
        _check_callable(flatten_func, "register_pytree_with_keys", "flatten_func")

    def flat(x):
        kc, aux = flatten_with_keys(x)
        kc = list(kc)
        return [c for _, c in kc], aux, [k for k, _ in kc]
    _register(nodetype, flat, unflatten_func)


def register_pytree_node_class(cls):
    """Class decorator: uses ``cls.tree_flatten`` and ``cls.tree_unflatten``."""
    register_pytree_node(cls, lambda x: x.tree_flatten(), cls.tree_unflatten)
    return cls


def register_pytree_with_keys_class(cls):
    """Class decorator: uses ``cls.tree_flatten_with_keys`` and ``cls.tree_unflatten``
    (jax.tree_util.register_pytree_with_keys_class)."""
    register_pytree_with_keys(cls, lambda x: x.tree_flatten_with_keys(), cls.tree_unflatten)
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
    keys = [GetAttrKey(n) for n in data_fields]     # the same entries for every instance

    def flatten(x):
        return ([getattr(x, n) for n in data_fields], tuple(getattr(x, n) for n in meta_fields),
                keys)

    def unflatten(meta, data):
        return nodetype(**dict(zip(meta_fields, meta)), **dict(zip(data_fields, data)))

    _register(nodetype, flatten, unflatten)
    return nodetype


def register_static(cls):
    """Make instances of ``cls`` tree nodes without children, held in the structure
    (jax.tree_util.register_static). Returns ``cls``."""
    register_pytree_node(cls, lambda x: ((), x), lambda x, _: x)
    return cls


def register_leaf_type(t: type) -> None:
    """Declare ``t`` a leaf type (any type not registered as a node is one; this checks that
    ``t`` is not a registered node)."""
    if optree.register_pytree_node.get(t, namespace=_NS) is not None:
        raise ValueError(f"{t.__name__} is a registered pytree node, not a leaf type")


# jax rebuilds a dict (and a defaultdict) with its keys sorted, the order it flattens them
# in; optree rebuilds one in the order the flattened dict had. A treedef made here is made
# canonical (its dict nodes recorded in sorted key order, once per structure: cached), so
# unflatten gives jax's dicts. The canonical treedef compares equal to optree's.
_CANON: dict = {}
_CANON_MAX = 4096


def _sorted_dict_node(spec):
    """A one-level dict / defaultdict treedef with its keys recorded in sorted order."""
    t = spec.type
    if t is not dict and t is not collections.defaultdict:
        return spec
    one = spec.unflatten(range(spec.num_children))
    keys = list(one)
    try:
        ordered = sorted(keys)
    except TypeError:            # keys that do not sort stay as they are (as jax keeps them)
        return spec
    if ordered == keys:
        return spec
    kids = dict.fromkeys(ordered, optree.treespec_leaf(namespace=_NS))
    if t is dict:
        return optree.treespec_dict(kids, namespace=_NS)
    return optree.treespec_defaultdict(one.default_factory, kids, namespace=_NS)


def _canonical(td):
    """``td`` with every dict node in sorted key order (cached per structure)."""
    try:
        got = _CANON.get(td)
    except TypeError:                        # metadata that does not hash: not cached
        return optree.treespec_transform(td, _sorted_dict_node)
    if got is None:
        got = optree.treespec_transform(td, _sorted_dict_node)
        if len(_CANON) >= _CANON_MAX:
            _CANON.clear()
        _CANON[td] = got
    return got


def _sorted_keys(d):
    """A dict's keys in flatten order: sorted, or as they are where they cannot be sorted."""
    try:
        return sorted(d)
    except TypeError:
        return list(d)


def _check_is_leaf(is_leaf, where):
    if is_leaf is not None and not callable(is_leaf):
        raise TypeError(f"{where}: is_leaf must be a callable or None, got "
                        f"{type(is_leaf).__name__}")


def tree_flatten(tree, is_leaf: Callable | None = None):
    """``(leaves, treedef)`` of ``tree``, leaves in a deterministic order (dict keys sorted).

    >>> tree_flatten({'b': 1, 'a': (2, None)})
    ([2, 1], PyTreeSpec({'a': (*, None), 'b': *}))
    """
    _check_is_leaf(is_leaf, "tree_flatten")
    leaves, td = optree.tree_flatten(tree, is_leaf, namespace=_NS)
    return leaves, _canonical(td)


class _Marked:
    """A subtree that ``is_leaf(path, x)`` chose as a leaf (with ``is_leaf_takes_path``)."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _one_level(x):
    """``(children, keys, treedef)`` of ``x``'s own node (its children as leaves; a leaf:
    ``([x], [()], leaf treedef)``); ``treedef.unflatten(children)`` rebuilds the node."""
    accessors, children, td = optree.tree_flatten_with_accessor(
        x, lambda y: y is not x, namespace=_NS)
    return children, [tuple(_jax_key(e) for e in a) for a in accessors], td


def _mark_path_leaves(x, is_leaf, path):
    """``x`` with every subtree for which ``is_leaf(path, subtree)`` holds wrapped in _Marked."""
    if is_leaf(path, x):
        return _Marked(x)
    children, keys, td = _one_level(x)
    if optree.treespec_is_leaf(td):
        return x
    return td.unflatten([_mark_path_leaves(c, is_leaf, path + k) for k, c in zip(keys, children)])


def tree_flatten_with_path(tree, is_leaf: Callable | None = None, is_leaf_takes_path: bool = False):
    """``([(key_path, leaf)], treedef)``; with ``is_leaf_takes_path`` the predicate is called
    as ``is_leaf(key_path, x)``.

    >>> [(keystr(p), x) for p, x in tree_flatten_with_path({'a': [5]})[0]]
    [("['a'][0]", 5)]
    """
    _check_is_leaf(is_leaf, "tree_flatten_with_path")
    if is_leaf is not None and is_leaf_takes_path:
        marked = _mark_path_leaves(tree, is_leaf, ())
        accessors, leaves, td = optree.tree_flatten_with_accessor(
            marked, lambda y: type(y) is _Marked, namespace=_NS)
        leaves = [v.value if type(v) is _Marked else v for v in leaves]
    else:
        accessors, leaves, td = optree.tree_flatten_with_accessor(tree, is_leaf, namespace=_NS)
    return ([(tuple(_jax_key(e) for e in a), v) for a, v in zip(accessors, leaves)],
            _canonical(td))


def tree_leaves_with_path(tree, is_leaf: Callable | None = None, is_leaf_takes_path: bool = False):
    """``[(key_path, leaf)]`` of ``tree`` (jax.tree_util.tree_leaves_with_path)."""
    return tree_flatten_with_path(tree, is_leaf, is_leaf_takes_path)[0]


def tree_unflatten(treedef: PyTreeDef, leaves):
    """Rebuild a pytree of structure ``treedef`` from ``leaves``.

    >>> leaves, td = tree_flatten({'a': 1, 'b': [2]})
    >>> tree_unflatten(td, [10, 20])
    {'a': 10, 'b': [20]}
    """
    _check_treedef(treedef, "tree_unflatten")
    if isinstance(leaves, (str, bytes)) or not hasattr(leaves, "__iter__"):
        raise TypeError(f"tree_unflatten: leaves must be an iterable of leaves, got "
                        f"{type(leaves).__name__}")
    leaves = list(leaves)
    if len(leaves) != treedef.num_leaves:
        raise ValueError(
            f"tree_unflatten: the structure has {treedef.num_leaves} leaves but "
            f"{len(leaves)} were given")
    return treedef.unflatten(leaves)


def tree_leaves(tree, is_leaf: Callable | None = None) -> list:
    """The leaves of ``tree`` in flatten order.

    >>> tree_leaves({'b': 1, 'a': [2, 3]})
    [2, 3, 1]
    """
    _check_is_leaf(is_leaf, "tree_leaves")
    return optree.tree_leaves(tree, is_leaf, namespace=_NS)


def tree_structure(tree, is_leaf: Callable | None = None) -> PyTreeDef:
    """The structure (treedef) of ``tree``."""
    _check_is_leaf(is_leaf, "tree_structure")
    return _canonical(optree.tree_structure(tree, is_leaf, namespace=_NS))


def all_leaves(iterable, is_leaf: Callable | None = None) -> bool:
    """Whether every item of ``iterable`` is a leaf (jax.tree_util.all_leaves)."""
    if is_leaf is None:
        return all(optree.treespec_is_leaf(tree_structure(x)) for x in iterable)
    items = list(iterable)   # JAX's test: is_leaf sees the list itself first
    return items == tree_leaves(items, is_leaf)


def _flatten_up_to(treedef, tree, check_aux: bool = False):
    """The subtrees of ``tree`` at the leaf positions of ``treedef`` (``tree`` may be deeper
    there). Nodes must agree in type, child count and dict keys; with ``check_aux`` (tree_map's
    check, as jax's) also in their metadata (namedtuple classes, a registered node's aux data),
    without it (sharding prefix trees, whose nodes may hold other instances of the same
    optimizer or module definition) not. A mismatch is a ValueError naming the first path
    where the two differ."""
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError):
        if check_aux:
            raise ValueError(_mismatch(treedef, tree)) from None
    return _flatten_up_to_loose(treedef, tree, ())


_DICTS = (dict, collections.OrderedDict, collections.defaultdict)


def _flatten_up_to_loose(treedef, tree, path):
    if optree.treespec_is_leaf(treedef):
        return [tree]
    children, keys, td = _one_level(tree)
    if (optree.treespec_is_leaf(td) or td.type is not treedef.type
            or td.num_children != treedef.num_children
            or (td.type in _DICTS and td.entries() != treedef.entries())):
        raise ValueError(_mismatch(treedef, tree, path))
    out = []
    for k, c, sub in zip(keys, children, treedef.children()):
        out += _flatten_up_to_loose(sub, c, path + k)
    return out


def _leaves_as(treedef, tree, leaf_type):
    """The leaves of ``tree`` when it has exactly ``treedef``'s structure and every leaf is of
    ``leaf_type``, else None: a known structure's check and flatten in one C++ pass (a few
    microseconds for a tree that a full flatten, sorting each dict's keys, takes ten times
    longer on). For hot paths that expect a structure (an optimizer step's grads and state);
    None sends them to their general path."""
    try:
        leaves = treedef.flatten_up_to(tree)
    except (ValueError, TypeError):
        return None
    for x in leaves:     # (a subtree where treedef has a leaf is not of leaf_type)
        if type(x) is not leaf_type:
            return None
    return leaves


def _node_desc(td) -> str:
    t = td.type
    name = t.__name__ if t is not None else "leaf"
    if t in (dict, collections.OrderedDict, collections.defaultdict):
        return f"{name} with keys {list(td.entries())!r}"
    return f"{name} of {td.num_children} children"


def _mismatch(treedef, tree, path=()) -> str:
    """The message for the first place where ``tree`` does not have ``treedef`` as a prefix."""
    where = keystr(path) or "the root"
    if optree.treespec_is_leaf(treedef):
        return f"tree structure mismatch at {where}"
    children, keys, td = _one_level(tree)
    if optree.treespec_is_leaf(td):
        return (f"tree structure mismatch at {where}: expected a {_node_desc(treedef)}, got a "
                f"leaf of type {type(tree).__name__}")
    if td.type is not treedef.type or td.num_children != treedef.num_children or (
            td.type in _DICTS and td.entries() != treedef.entries()):
        return (f"tree structure mismatch at {where}: expected a {_node_desc(treedef)}, got a "
                f"{_node_desc(td)}")
    if td.one_level() != treedef.one_level():
        return (f"tree structure mismatch at {where}: the {td.type.__name__} nodes differ in "
                f"their metadata ({treedef.one_level()!r} against {td.one_level()!r})")
    for k, c, sub in zip(keys, children, treedef.children()):
        try:
            sub.flatten_up_to(c)
        except (ValueError, TypeError):
            return _mismatch(sub, c, path + k)
    return f"tree structure mismatch at {where}: {treedef!r} against {td!r}"


def tree_map(f: Callable, tree, *rest, is_leaf: Callable | None = None):
    """Apply ``f`` to the leaves of ``tree`` (and the matching leaves of ``rest``).

    >>> tree_map(lambda a, b: a + b, [1, (2,)], [10, (20,)])
    [11, (22,)]
    """
    _check_callable(f, "tree_map", "f")
    leaves, td = tree_flatten(tree, is_leaf)
    if not rest:
        return td.unflatten(map(f, leaves))
    others = [_flatten_up_to(td, r, check_aux=True) for r in rest]
    return td.unflatten([f(*xs) for xs in zip(leaves, *others)])


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
        inner_treedef = tree_structure(_flatten_up_to(outer_treedef, pytree_to_transpose,
                                                      check_aux=True)[0])
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


from .exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
