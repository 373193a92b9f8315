"""Pytree helpers."""
import collections

import numpy as np
import pytest

from ctrainstate import tree_util as tu

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
