"""Pytree helpers."""
import collections

import numpy as np
import pytest

from ctrainstate import tree_util as tu
from ctrainstate._src.base import tree_util as tu_impl

Point = collections.namedtuple("Point", "x y")


def test_flatten_order_and_round_trip():
    tree = {"b": [1, (2, 3)], "a": {"z": 4, "y": None}, "c": Point(5, 6)}
    leaves, td = tu.tree_flatten(tree)
    assert leaves == [4, 1, 2, 3, 5, 6]  # dict keys sorted; None has no leaves
    assert tu.tree_unflatten(td, leaves) == tree
    assert td.num_leaves == 6
    assert tu.tree_structure(tree) == td
    assert tu.tree_structure({"a": 1}) != tu.tree_structure({"b": 1})


def test_ordered_dict_keeps_order():
    od = collections.OrderedDict([("z", 1), ("a", 2)])
    assert tu.tree_leaves(od) == [1, 2]
    assert tu.tree_map(lambda v: v * 10, od) == collections.OrderedDict([("z", 10), ("a", 20)])


def test_tree_map_multiple_trees_and_mismatch():
    assert tu.tree_map(lambda a, b: a + b, {"x": 1, "y": [2]}, {"x": 10, "y": [20]}) == {"x": 11, "y": [22]}
    with pytest.raises(ValueError, match=r"\['y'\]"):
        tu.tree_map(lambda a, b: a, {"x": 1, "y": [2]}, {"x": 1, "y": (2,)})
    with pytest.raises(ValueError, match="keys"):
        tu.tree_map(lambda a, b: a, {"x": 1}, {"q": 1})


def test_is_leaf_and_paths():
    tree = {"p": {"w": np.zeros(2), "b": (1, 2)}}
    pl, _ = tu.tree_flatten_with_path(tree)
    assert [tu.keystr(p) for p, _ in pl] == ["['p']['b'][0]", "['p']['b'][1]", "['p']['w']"]
    assert tu.tree_leaves(tree, is_leaf=lambda x: isinstance(x, tuple))[0] == (1, 2)
    out = tu.tree_map_with_path(lambda p, x: tu.keystr(p), {"a": [0]})
    assert out == {"a": ["['a'][0]"]}


def test_register_pytree_node():
    class Box:
        def __init__(self, v, tag):
            self.v, self.tag = v, tag

    tu.register_pytree_node(Box, lambda b: ((b.v,), b.tag), lambda tag, ch: Box(ch[0], tag))
    leaves, td = tu.tree_flatten([Box(3, "t"), 4])
    assert leaves == [3, 4]
    back = tu.tree_unflatten(td, [7, 8])
    assert back[0].v == 7 and back[0].tag == "t"
    with pytest.raises(ValueError, match="already registered"):
        tu.register_pytree_node(Box, lambda b: ((), None), lambda a, c: None)


def test_unflatten_wrong_count():
    _, td = tu.tree_flatten([1, 2])
    with pytest.raises(ValueError, match="2 leaves but 3"):
        tu.tree_unflatten(td, [1, 2, 3])


class _Keyed:
    """A node registered with keys (its plain flatten drops them)."""

    def __init__(self, a, b):
        self.a, self.b = a, b


tu.register_pytree_with_keys(
    _Keyed, lambda n: (((tu.GetAttrKey("a"), n.a), (tu.GetAttrKey("b"), n.b)), "aux"),
    lambda aux, ch: _Keyed(*ch))

_TREES = [
    {},
    None,
    [None, (), {}],
    {"w": np.zeros(2), "b": 1.5, "n": None, "s": "str"},
    {f"l{i}": np.full(1, i) for i in range(12)},
    [1, (2, [3, {"z": 4, "a": (5,)}]), Point(6, [7, None])],
    collections.OrderedDict([("z", 1), ("a", [2, 3])]),
    collections.defaultdict(list, {"q": 1, "b": (2,)}),
    {"k": _Keyed([1, 2], {"y": 3, "x": None}), "m": _Keyed(4, Point(5, 6))},
    (object(), [object()]),   # unknown objects are leaves
]


@pytest.mark.parametrize("tree", _TREES, ids=range(len(_TREES)))
def test_plain_flatten_agrees_with_the_path_flatten(tree):
    # tree_flatten takes a fast path (no keys, leaf children appended in the node's loop);
    # tree_flatten_with_path walks the nodes through the general code: both must agree
    leaves, td = tu.tree_flatten(tree)
    pl, td_p = tu.tree_flatten_with_path(tree)
    assert td == td_p and td.num_leaves == len(leaves) == len(pl)
    assert all(a is b for a, (_, b) in zip(leaves, pl))
    back = tu.tree_unflatten(td, leaves)
    assert tu.tree_structure(back) == td
    assert all(a is b for a, b in zip(tu.tree_leaves(back), leaves))
    assert type(back) is type(tree)
    # is_leaf goes through the per-child calls: a leaf predicate that never fires changes nothing
    assert tu.tree_flatten(tree, is_leaf=lambda x: False) == (leaves, td)


def test_is_leaf_stops_at_containers_on_the_fast_path():
    tree = {"a": [1, 2], "b": {"c": (3, 4)}}
    leaves, td = tu.tree_flatten(tree, is_leaf=lambda x: isinstance(x, (list, tuple)))
    assert leaves == [[1, 2], (3, 4)] and td.num_leaves == 2
    assert tu.tree_unflatten(td, ["x", "y"]) == {"a": "x", "b": {"c": "y"}}


class _GenNode:
    """A node whose registered flatten returns its children as a generator."""

    def __init__(self, a, b):
        self.a, self.b = a, b


tu.register_pytree_node(_GenNode, lambda n: ((c for c in (n.a, n.b)), None),
                        lambda aux, ch: _GenNode(*ch))


@pytest.mark.parametrize("tree", [_GenNode(1, 2), _GenNode({"k": 1}, [2, 3]),
                                  {"x": _GenNode(1, (2, None))}], ids=["leaves", "nested", "in-dict"])
def test_registered_flatten_may_return_an_iterator(tree):
    # the fast path reads a node's children more than once: an iterator is materialised first
    leaves, td = tu.tree_flatten(tree)
    pl, td_p = tu.tree_flatten_with_path(tree)
    assert leaves == [x for _, x in pl] and leaves and td == td_p
    back = tu.tree_unflatten(td, leaves)
    assert tu.tree_leaves(back) == leaves


_TREE_UTIL_BAD_ARGS = [
    ("tree_map", lambda: tu.tree_map(1, [1]), "tree_map: f must be callable, got int"),
    ("tree_map_with_path", lambda: tu.tree_map_with_path(1, [1]),
     "tree_map_with_path: f must be callable, got int"),
    ("tree_unflatten", lambda: tu.tree_unflatten([1], [1]),
     "tree_unflatten: treedef must be a PyTreeDef .*got list"),
    ("unflatten", lambda: tu.tree_unflatten(tu.tree_structure([1]), 3),
     "tree_unflatten: leaves must be an iterable of leaves, got int"),
    ("tree_leaves", lambda: tu.tree_leaves(1, is_leaf=3),
     "tree_leaves: is_leaf must be a callable or None, got int"),
    ("tree_flatten_with_path", lambda: tu.tree_flatten_with_path([1], is_leaf=3),
     "tree_flatten_with_path: is_leaf must be a callable or None, got int"),
    ("tree_transpose", lambda: tu.tree_transpose(1, 2, [1]),
     "tree_transpose: outer_treedef must be a PyTreeDef .*got int"),
    ("keystr", lambda: tu.keystr(3), "keystr: path must be a sequence of keys"),
    ("tree_reduce", lambda: tu.tree_reduce(3, [1, 2]), "tree_reduce: function must be callable"),
    ("tree_reduce_associative", lambda: tu.tree_reduce_associative(3, [1, 2]),
     "tree_reduce_associative: operation must be callable"),
    ("register_pytree_node", lambda: tu.register_pytree_node("T", lambda x: x, lambda a, c: c),
     "register_pytree_node: nodetype must be a class, got str"),
    ("register_pytree_node_funcs", lambda: tu.register_pytree_node(type("T", (), {}), 1, 2),
     "register_pytree_node: flatten_func must be callable, got int"),
]


@pytest.mark.parametrize("name,call,msg", _TREE_UTIL_BAD_ARGS,
                         ids=[c[0] for c in _TREE_UTIL_BAD_ARGS])
def test_tree_util_wrong_argument_types_name_the_argument(name, call, msg):
    with pytest.raises(TypeError, match=msg):
        call()


# --- on optree: jax's semantics where optree's differ ------------------------------------------

def test_treedefs_are_optrees_and_compare_in_cpp():
    import optree
    td = tu.tree_structure({"a": [1, 2], "b": None})
    assert isinstance(td, optree.PyTreeSpec) and isinstance(td, tu.PyTreeDef)
    assert td == tu.tree_structure({"b": None, "a": [3, 4]})
    assert hash(td) == hash(tu.tree_structure({"b": None, "a": [3, 4]}))
    assert td.num_leaves == 2 and td.num_nodes == 5 and len(td.children()) == 2


def test_unflatten_rebuilds_dicts_with_sorted_keys_as_jax():
    # optree on its own rebuilds a dict in the order it was built in; jax sorts its keys
    tree = {"z": {"kernel": 1, "bias": 2}, "a": 3,
            "d": collections.defaultdict(list, {"y": 4, "x": 5})}
    out = tu.tree_map(lambda v: v * 10, tree)
    assert list(out) == ["a", "d", "z"] and list(out["z"]) == ["bias", "kernel"]
    assert list(out["d"]) == ["x", "y"] and out["d"].default_factory is list
    leaves, td = tu.tree_flatten(tree)
    assert list(tu.tree_unflatten(td, leaves)["z"]) == ["bias", "kernel"]
    # keys that cannot be sorted keep their order, as in jax
    mixed = {1: "a", "x": "b"}
    assert list(tu.tree_map(lambda v: v, mixed)) == [1, "x"]


def test_key_paths_use_jax_key_classes():
    tree = {"p": Point(1, [2]), "k": _Keyed(3, 4), "g": _GenNode(5, 6)}
    paths = [p for p, _ in tu.tree_flatten_with_path(tree)[0]]
    assert paths == [
        (tu.DictKey("g"), tu.FlattenedIndexKey(0)), (tu.DictKey("g"), tu.FlattenedIndexKey(1)),
        (tu.DictKey("k"), tu.GetAttrKey("a")), (tu.DictKey("k"), tu.GetAttrKey("b")),
        (tu.DictKey("p"), tu.GetAttrKey("x")), (tu.DictKey("p"), tu.GetAttrKey("y"),
                                                tu.SequenceKey(0))]
    assert tu.keystr(paths[-1]) == "['p'].y[0]"


def test_is_leaf_takes_path():
    tree = {"a": [1, 2], "b": [3, [4, 5]]}
    pl, td = tu.tree_flatten_with_path(
        tree, is_leaf=lambda p, x: tu.keystr(p) == "['b'][1]", is_leaf_takes_path=True)
    assert [(tu.keystr(p), x) for p, x in pl] == [("['a'][0]", 1), ("['a'][1]", 2),
                                                   ("['b'][0]", 3), ("['b'][1]", [4, 5])]
    assert tu.tree_unflatten(td, ["w", "x", "y", "z"]) == {"a": ["w", "x"], "b": ["y", "z"]}


def test_metadata_mismatch_is_named_in_tree_map_but_not_in_prefix_trees():
    class Opt:
        def __init__(self, tag, v):
            self.tag, self.v = tag, v
    tu.register_pytree_node(Opt, lambda o: ((o.v,), o.tag), lambda tag, ch: Opt(tag, ch[0]))
    a, b = {"o": Opt("adam", 1)}, {"o": Opt("sgd", 2)}
    with pytest.raises(ValueError, match=r"at \['o'\]: the Opt nodes differ in their metadata"):
        tu.tree_map(lambda x, y: x + y, a, b)
    # a prefix tree (shardings, masks) pairs nodes by type and keys only
    assert tu_impl._flatten_up_to(tu.tree_structure(a), b) == [2]


def test_leaves_as_a_known_structure():
    # the hot paths' check-and-flatten against a known treedef: the leaves when the tree has
    # exactly that structure and leaf type, None otherwise (they then take the general path)
    td = tu.tree_structure({"a": 1, "b": [2, 3]})
    assert tu_impl._leaves_as(td, {"b": [5, 6], "a": 4}, int) == [4, 5, 6]
    assert tu_impl._leaves_as(td, {"a": 4, "b": [5, (6,)]}, int) is None        # deeper
    assert tu_impl._leaves_as(td, {"a": 4, "b": (5, 6)}, int) is None           # another node type
    assert tu_impl._leaves_as(td, {"a": 4, "c": [5, 6]}, int) is None           # other keys
    assert tu_impl._leaves_as(td, {"a": 4, "b": [5, 6.0]}, int) is None         # another leaf type
    assert tu_impl._leaves_as(td, 7, int) is None
