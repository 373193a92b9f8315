"""Checkpoint and pytree parity with flax.serialization / jax.tree_util / flax.core / flax.struct.

Each test pins a discrepancy that was found against live Flax/JAX: the parity tests compare
with them (and skip without them), the others hold expectations derived by hand or from the
msgpack format as Flax documents it.
"""
import collections
import dataclasses
from typing import Any

import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import core, serialization, struct, tree_util

Pair = collections.namedtuple("Pair", "a b")
Other = collections.namedtuple("Other", "a b")


# --- from_state_dict: entries the target does not have ------------------------------------

@pytest.mark.parametrize("target,state,match", [
    ([1, 2], {"0": 5, "1": 6, "2": 7}, r"size of the list.*got 2 and 3"),
    ((1, 2), {"0": 5, "1": 6, "2": 7}, r"size of the tuple.*got 2 and 3"),
    (Pair(1, 2), {"a": 5, "b": 6, "c": 7}, r"field names.*\['c'\]"),
    ({"opt": [1, 2]}, {"opt": {"0": 5, "1": 6, "2": 7}}, r"at opt"),
], ids=["list", "tuple", "namedtuple", "nested-path"])
def test_from_state_dict_refuses_entries_the_target_lacks(target, state, match):
    # a longer list / more NamedTuple fields in the checkpoint than in the target was silently
    # dropped: Flax raises ValueError for these
    with pytest.raises(ValueError, match=match):
        serialization.from_state_dict(target, state)


@pytest.mark.parametrize("target,state", [
    ([1, 2], {"0": 5, "1": 6, "2": 7}),
    (Pair(1, 2), {"a": 5, "b": 6, "c": 7}),
])
def test_from_state_dict_extra_entries_raise_as_in_flax(target, state):
    fser = pytest.importorskip("flax.serialization")
    with pytest.raises(ValueError):
        fser.from_state_dict(target, state)
    with pytest.raises(ValueError):
        serialization.from_state_dict(target, state)


def test_from_state_dict_reads_flax_s_old_namedtuple_layout():
    # Flax before 2022 wrote a NamedTuple as {'name', 'fields', 'values'}; Flax still reads it
    old = {"name": "Pair", "fields": {"0": "a", "1": "b"}, "values": {"0": 5, "1": 6}}
    assert serialization.from_state_dict(Pair(1, 2), old) == Pair(5, 6)


def test_old_namedtuple_layout_matches_flax():
    fser = pytest.importorskip("flax.serialization")
    old = {"name": "Pair", "fields": {"0": "b", "1": "a"}, "values": {"0": 5, "1": 6}}
    assert serialization.from_state_dict(Pair(1, 2), old) == fser.from_state_dict(Pair(1, 2), old)


@struct.dataclass
class _Model:
    w: Any
    b: Any = 0
    fn: Any = struct.field(pytree_node=False, default=None)


@pytest.mark.parametrize("state", [{"w": 5, "b": 6, "z": 1}, {"w": 5, "b": 6, "fn": 1}],
                         ids=["unknown", "static-field"])
def test_struct_restore_refuses_unknown_fields(state):
    # Flax: 'Unknown field(s) "z" in state dict while restoring an instance of ...'
    with pytest.raises(ValueError, match=r"Unknown field\(s\).*_Model"):
        serialization.from_state_dict(_Model(1, 2, fn="f"), state)
    assert serialization.from_state_dict(_Model(1, 2, fn="f"), {"w": 5, "b": 6}) == _Model(5, 6, "f")


def test_struct_restore_unknown_fields_raise_in_flax_too():
    fst = pytest.importorskip("flax.struct")
    fser = pytest.importorskip("flax.serialization")

    @fst.dataclass
    class M:
        w: Any
        fn: Any = fst.field(pytree_node=False, default=None)
    with pytest.raises(ValueError, match="Unknown field"):
        fser.from_state_dict(M(1), {"w": 2, "z": 3})
    with pytest.raises(ValueError, match="Unknown field"):
        serialization.from_state_dict(_Model(1), {"w": 2, "b": 0, "z": 3})


def test_to_state_dict_refuses_keys_with_the_same_string():
    # {1: a, '1': b} both become '1': one value was silently lost
    with pytest.raises(ValueError, match="unique string"):
        serialization.to_state_dict({1: 1, "1": 2})
    with pytest.raises(ValueError, match="unique string"):
        serialization.to_bytes({"p": {1: 1, "1": 2}})
    assert serialization.to_state_dict({1: 1, "2": 2}) == {"1": 1, "2": 2}


# --- msgpack_serialize ----------------------------------------------------------------------

def test_msgpack_serialize_writes_sorted_keys_unless_in_place():
    msgpack = pytest.importorskip("msgpack")
    t = {"b": 1, "a": {"z": 2, "c": 3}}
    # Flax's msgpack_serialize copies the tree through jax.tree_util (dict keys sorted) unless
    # in_place=True; to_bytes writes in place (the state dict's own order)
    assert serialization.msgpack_serialize(t) == msgpack.packb({"a": {"c": 3, "z": 2}, "b": 1})
    assert serialization.msgpack_serialize(t, in_place=True) == msgpack.packb(t)
    assert serialization.to_bytes(t) == msgpack.packb(t)
    assert t == {"b": 1, "a": {"z": 2, "c": 3}} and list(t) == ["b", "a"]   # not modified


def test_msgpack_serialize_bytes_match_flax():
    fser = pytest.importorskip("flax.serialization")
    jnp = pytest.importorskip("jax.numpy")
    t = {"b": 1, "a": {"z": np.arange(3, dtype=np.int32), "c": [jnp.ones(2), 3.5]},
         "l": [jnp.float32(2.0), {"y": 1, "x": 2}]}
    assert serialization.msgpack_serialize(t) == fser.msgpack_serialize(t)
    assert serialization.msgpack_serialize(t, in_place=True) == fser.msgpack_serialize(
        {"b": 1, "a": {"z": np.arange(3, dtype=np.int32), "c": [jnp.ones(2), 3.5]},
         "l": [jnp.float32(2.0), {"y": 1, "x": 2}]}, in_place=True)


def test_msgpack_serialize_takes_arrays_in_lists():
    pytest.importorskip("msgpack")
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    w = cts.device_put(np.arange(8, dtype=np.float32).reshape(2, 4),
                       cts.NamedSharding(mesh, cts.P("data", "model")))
    back = serialization.msgpack_restore(serialization.msgpack_serialize({"l": [w, 1, [w]]}))
    np.testing.assert_array_equal(back["l"][0], np.arange(8).reshape(2, 4))
    np.testing.assert_array_equal(back["l"][2][0], np.arange(8).reshape(2, 4))
    assert back["l"][1] == 1


def test_msgpack_serialize_jax_arrays_in_lists_like_flax():
    fser = pytest.importorskip("flax.serialization")
    jnp = pytest.importorskip("jax.numpy")
    t = {"l": [jnp.arange(3.0), jnp.int32(4)]}
    assert serialization.msgpack_serialize(t) == fser.msgpack_serialize(t)


# --- from_bytes: errors name the path, the target stays as it was -------------------------

def _sharded_target():
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    w = cts.device_put(np.zeros((4, 8), np.float32), cts.NamedSharding(mesh, cts.P("data", "model")))
    return {"p": {"w": w, "b": cts.device_put(np.zeros(8, np.float32))}}


@pytest.mark.parametrize("saved,match", [
    (np.zeros((4, 4), np.float32), r"shape \(4, 4\), its target \(4, 8\), at \['p'\]\['w'\]"),
    ({"x": np.zeros((4, 8), np.float32)}, r"at \['p'\]\['w'\] .*array of shape \(4, 8\).*dict"),
    (None, r"at \['p'\]\['w'\] .*NoneType"),
    ("abc", r"at \['p'\]\['w'\] .*str"),
], ids=["shape", "dict", "none", "str"])
def test_from_bytes_mismatch_names_the_path_and_leaves_the_target(saved, match):
    pytest.importorskip("msgpack")
    target = _sharded_target()
    data = serialization.to_bytes({"p": {"w": saved, "b": np.ones(8, np.float32)}})
    with pytest.raises(ValueError, match=match):
        serialization.from_bytes(target, data)
    assert np.asarray(target["p"]["w"]).sum() == 0 and np.asarray(target["p"]["b"]).sum() == 0
    assert target["p"]["w"].sharding.spec == cts.P("data", "model")


# --- tree_map: nodes that differ in their metadata do not match ---------------------------

def _mismatched_pairs():
    @struct.dataclass
    class S:
        a: Any
        k: int = struct.field(pytree_node=False, default=0)
    return [
        (Pair(1, 2), Other(1, 2)),                                         # namedtuple classes
        (core.freeze({"a": 1, "b": 2}), core.freeze({"a": 1, "c": 2})),    # FrozenDict keys
        (collections.defaultdict(list, {"a": 1}), collections.defaultdict(list, {"b": 1})),
        (S(1, 2), S(1, 3)),                                                # struct static field
    ]


@pytest.mark.parametrize("i", range(4), ids=["namedtuple", "frozendict", "defaultdict", "struct"])
def test_tree_map_refuses_nodes_with_other_metadata(i):
    # the leaves were paired by position: FrozenDict({'a', 'b'}) with FrozenDict({'a', 'c'})
    # gave b's value c's leaf. JAX raises ValueError ('different pytree metadata' / types)
    x, y = _mismatched_pairs()[i]
    with pytest.raises(ValueError, match="mismatch at the root"):
        tree_util.tree_map(lambda a, b: (a, b), x, y)
    assert tree_util.tree_leaves(tree_util.tree_map(lambda a, b: a + b, x, x)) == \
        [2 * v for v in tree_util.tree_leaves(x)]


def test_tree_map_metadata_mismatch_raises_in_jax_too():
    jtu = pytest.importorskip("jax.tree_util")
    fcore = pytest.importorskip("flax.core")
    pairs = [(Pair(1, 2), Other(1, 2)),
             (fcore.freeze({"a": 1, "b": 2}), fcore.freeze({"a": 1, "c": 2})),
             (collections.defaultdict(list, {"a": 1}), collections.defaultdict(list, {"b": 1}))]
    for x, y in pairs:
        with pytest.raises(ValueError):
            jtu.tree_map(lambda a, b: (a, b), x, y)
    for x, y in _mismatched_pairs()[:3]:
        with pytest.raises(ValueError):
            tree_util.tree_map(lambda a, b: (a, b), x, y)


# --- FrozenDict -----------------------------------------------------------------------------

def test_frozen_dict_setitem_raises_value_error_as_flax():
    f = core.freeze({"a": 1})
    with pytest.raises(ValueError, match="immutable"):
        f["a"] = 2
    with pytest.raises(TypeError, match="immutable"):   # and stays a TypeError
        f["a"] = 2
    assert f == {"a": 1}


def test_pretty_repr_of_frozen_dicts_inside_plain_dicts():
    f = core.freeze({"b": 1})
    assert core.pretty_repr({"a": f}, 2) == "{\n  a: FrozenDict({\n      b: 1,\n  }),\n}"
    assert core.pretty_repr(core.freeze({"a": f})) == "FrozenDict({\n    a: {\n        b: 1,\n    },\n})"


def test_pretty_repr_indents_multi_line_leaves():
    # Flax indents every line of an entry (its _indent), a leaf's continuation lines too
    a = np.zeros((2, 1))
    want = ("{\n    m: {\n        k: array([[0.],\n               [0.]]),\n    },\n}")
    assert core.pretty_repr({"m": {"k": a}}) == want
    assert repr(core.freeze({"m": {"k": a}})) == "FrozenDict(" + want + ")"


def test_pretty_repr_matches_flax():
    ffd = pytest.importorskip("flax.core.frozen_dict")
    t = {"b": {"y": np.arange(3), "x": np.ones((2, 2))}, "a": 1, "e": {}, "z": np.eye(3)}
    assert core.pretty_repr(t) == ffd.pretty_repr(t)
    assert core.pretty_repr(t, num_spaces=2) == ffd.pretty_repr(t, num_spaces=2)
    assert repr(core.freeze(t)) == repr(ffd.freeze(t))
    # a FrozenDict inside a plain dict prints as one; other mappings print as their repr
    import types
    for mk in (lambda M: {"a": M.freeze({"b": np.eye(2)}), "c": 2},
               lambda M: {"m": types.MappingProxyType({"b": 1})},
               lambda M: M.freeze({"a": M.freeze({"b": {}})})):
        assert core.pretty_repr(mk(core)) == ffd.pretty_repr(mk(ffd))
        if not isinstance(mk(ffd), ffd.FrozenDict):   # Flax ignores num_spaces for a FrozenDict
            assert core.pretty_repr(mk(core), 2) == ffd.pretty_repr(mk(ffd), 2)


# --- struct ---------------------------------------------------------------------------------

def test_struct_dataclass_frozen_false_is_mutable():
    @struct.dataclass(frozen=False)
    class C:
        x: int

    c = C(1)
    c.x = 2            # Flax's struct.dataclass sets frozen=True only when not given
    assert c.x == 2 and tree_util.tree_leaves(c) == [2]

    @struct.dataclass
    class D:
        x: int
    with pytest.raises(dataclasses.FrozenInstanceError):
        D(1).x = 2


def test_pytree_node_passes_class_keywords_to_dataclass():
    class K(struct.PyTreeNode, kw_only=True):
        x: int
        y: int = struct.field(pytree_node=False, default=3)

    k = K(x=1)
    assert tree_util.tree_leaves(k) == [1] and k.y == 3
    with pytest.raises(TypeError):
        K(1)           # keyword-only


def test_struct_keywords_match_flax():
    fst = pytest.importorskip("flax.struct")
    for S in (fst, struct):
        class K(S.PyTreeNode, kw_only=True):
            x: int
        assert K(x=1).x == 1
        with pytest.raises(TypeError):
            K(1)

        @S.dataclass(frozen=False)
        class C:
            x: int
        c = C(1)
        c.x = 5
        assert c.x == 5


# --- register_serialization_state -----------------------------------------------------------

class _Box:
    """A custom class with a registered state dict (and no pytree registration)."""

    def __init__(self, v, tag):
        self.v, self.tag = v, tag


_seen_paths = []


def _box_restore(b, sd):
    _seen_paths.append(serialization.current_path())
    return _Box(serialization.from_state_dict(b.v, sd["v"], name="v"), b.tag)


serialization.register_serialization_state(
    _Box, lambda b: {"v": serialization.to_state_dict(b.v)}, _box_restore)


def test_register_serialization_state_round_trips_a_custom_class():
    pytest.importorskip("msgpack")
    assert serialization.is_serializable(_Box) and serialization.is_serializable(_Box(1, 2))
    assert not serialization.is_serializable(3)
    t = {"b": _Box([np.ones(2, np.float32), 3], "t"), "c": 1}
    assert serialization.to_state_dict(t)["b"] == {"v": {"0": t["b"].v[0], "1": 3}}
    _seen_paths.clear()
    r = serialization.from_bytes({"b": _Box([np.zeros(2, np.float32), 0], "u"), "c": 0},
                                 serialization.to_bytes(t))
    assert r["b"].tag == "u" and r["b"].v[1] == 3 and r["c"] == 1
    np.testing.assert_array_equal(r["b"].v[0], [1, 1])
    assert _seen_paths == ["./b"]
    with pytest.raises(ValueError, match="already registered"):
        serialization.register_serialization_state(_Box, None, None)
    serialization.register_serialization_state(   # override=True replaces the handler
        _Box, lambda b: {"v": serialization.to_state_dict(b.v)}, _box_restore, override=True)


def test_registered_class_bytes_match_flax():
    fser = pytest.importorskip("flax.serialization")

    class FBox(_Box):
        pass
    fser.register_serialization_state(
        FBox, lambda b: {"v": fser.to_state_dict(b.v)},
        lambda b, sd: FBox(fser.from_state_dict(b.v, sd["v"], name="v"), b.tag))
    t_c = {"b": _Box([np.ones(2, np.float32), 3], "t"), "c": 1}
    t_f = {"b": FBox([np.ones(2, np.float32), 3], "t"), "c": 1}
    assert serialization.to_bytes(t_c) == fser.to_bytes(t_f)
    r = fser.from_bytes({"b": FBox([np.zeros(2, np.float32), 0], "u"), "c": 0},
                        serialization.to_bytes(t_c))
    assert r["b"].v[1] == 3 and r["b"].tag == "u"


# --- tree_transpose, jax.tree.transpose, Partial --------------------------------------------

def test_tree_transpose():
    outer, inner = tree_util.tree_structure([0, 0]), tree_util.tree_structure((0, 0, 0))
    assert tree_util.tree_transpose(outer, inner, [(1, 2, 3), (4, 5, 6)]) == \
        ([1, 4], [2, 5], [3, 6])
    assert cts.tree.transpose(tree_util.tree_structure({"x": 0, "y": 0}), None,
                              {"x": [1, 2], "y": [3, 4]}) == [{"x": 1, "y": 3}, {"x": 2, "y": 4}]
    with pytest.raises(TypeError, match="5 leaves"):
        tree_util.tree_transpose(outer, inner, [(1, 2, 3), (4, 5)])


def test_tree_transpose_matches_jax():
    jtu = pytest.importorskip("jax.tree_util")
    t = [{"a": 1, "b": (2, 3)}, {"a": 4, "b": (5, 6)}, {"a": 7, "b": (8, 9)}]
    got = tree_util.tree_transpose(tree_util.tree_structure([0, 0, 0]), None, t)
    assert got == jtu.tree_transpose(jtu.tree_structure([0, 0, 0]), None, t)


def _add3(a, b, c=0):
    return a + b + c


def test_partial_is_a_pytree_with_static_function():
    p = tree_util.Partial(_add3, 1, c=3)
    assert p(2) == 6 and tree_util.tree_leaves(p) == [1, 3]
    assert tree_util.tree_map(lambda x: x * 10, p)(2) == 42       # 10 + 2 + 30
    import functools
    q = tree_util.Partial(functools.partial(_add3, 1), 2)          # the inner partial is static
    assert tree_util.tree_leaves(q) == [2] and q(c=5) == 8
    sd = serialization.to_state_dict(p)
    assert sd == {"args": {"0": 1}, "keywords": {"c": 3}}
    assert serialization.from_state_dict(p, {"args": {"0": 7}, "keywords": {"c": 9}})(1) == 17


def test_partial_matches_jax_and_flax():
    jtu = pytest.importorskip("jax.tree_util")
    fser = pytest.importorskip("flax.serialization")
    pj, pc = jtu.Partial(_add3, np.float32(1), c=np.ones(2)), tree_util.Partial(
        _add3, np.float32(1), c=np.ones(2))
    assert serialization.to_bytes(pc) == fser.to_bytes(pj)
    assert [np.asarray(x).tolist() for x in tree_util.tree_leaves(pc)] == \
        [np.asarray(x).tolist() for x in jtu.tree_leaves(pj)]
    r = serialization.from_bytes(pc, fser.to_bytes(jtu.Partial(_add3, np.float32(5), c=np.zeros(2))))
    assert r(1).tolist() == [6.0, 6.0]


# --- key paths of registered nodes ----------------------------------------------------------

class _NoKeys:
    def __init__(self, a, b):
        self.a, self.b = a, b


tree_util.register_pytree_node(_NoKeys, lambda x: ((x.a, x.b), None), lambda aux, ch: _NoKeys(*ch))


def test_nodes_registered_without_keys_have_flattened_index_keys():
    # jax.tree_util: the children of register_pytree_node nodes are FlattenedIndexKey(i),
    # printed '[<flat index i>]' (SequenceKey's '[i]' is for lists and tuples)
    pl = tree_util.tree_flatten_with_path({"x": _NoKeys(1, [2])})[0]
    assert [tree_util.keystr(p) for p, _ in pl] == ["['x'][<flat index 0>]",
                                                    "['x'][<flat index 1>][0]"]
    assert [type(k).__name__ for k in pl[1][0]] == ["DictKey", "FlattenedIndexKey", "SequenceKey"]
    assert [tree_util.keystr(p, simple=True, separator="/") for p, _ in pl] == ["x/0", "x/1/0"]


def test_partitioned_boxes_have_the_value_key_path():
    from ctrainstate import nn
    t = {"w": nn.Partitioned(np.ones(2), names=("a",)),
         "l": nn.LogicallyPartitioned(np.ones(2), names=("a",))}
    assert [tree_util.keystr(p) for p, _ in tree_util.tree_flatten_with_path(t)[0]] == \
        ["['l'].value", "['w'].value"]      # Flax's boxes are structs with a 'value' field
    b = tree_util.tree_map(lambda x: x * 2, t["w"])
    assert isinstance(b, nn.Partitioned) and b.names == ("a",) and np.asarray(b.value).tolist() == [2, 2]


def test_key_paths_match_jax_and_flax():
    jtu = pytest.importorskip("jax.tree_util")
    fnn = pytest.importorskip("flax.linen")
    jnp = pytest.importorskip("jax.numpy")
    from ctrainstate import nn

    class JNoKeys(_NoKeys):
        pass
    jtu.register_pytree_node(JNoKeys, lambda x: ((x.a, x.b), None), lambda aux, ch: JNoKeys(*ch))
    tj = {"x": JNoKeys(1, [2]), "w": fnn.Partitioned(jnp.ones(2), names=("a",)),
          "l": fnn.LogicallyPartitioned(jnp.ones(2), names=("a",))}
    tc = {"x": _NoKeys(1, [2]), "w": nn.Partitioned(np.ones(2), names=("a",)),
          "l": nn.LogicallyPartitioned(np.ones(2), names=("a",))}
    assert [tree_util.keystr(p) for p, _ in tree_util.tree_flatten_with_path(tc)[0]] == \
        [jtu.keystr(p) for p, _ in jtu.tree_flatten_with_path(tj)[0]]


# --- register_dataclass, register_pytree_with_keys_class, register_static -----------------

def test_register_dataclass():
    @tree_util.register_dataclass
    @dataclasses.dataclass
    class P:
        x: float
        y: list
        tag: str = dataclasses.field(default="t", metadata={"static": True})

    assert tree_util.tree_leaves(P(1.0, [2, 3])) == [1.0, 2, 3]
    assert [tree_util.keystr(p) for p, _ in tree_util.tree_flatten_with_path(P(1.0, [2]))[0]] == \
        [".x", ".y[0]"]
    assert tree_util.tree_map(lambda v: v * 2, P(1.0, [2], "u")) == P(2.0, [4], "u")
    with pytest.raises(ValueError, match="mismatch"):          # the static field differs
        tree_util.tree_map(lambda a, b: a, P(1.0, [2], "u"), P(1.0, [2], "v"))

    @dataclasses.dataclass
    class Q:
        a: int
        b: int
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        tree_util.register_dataclass(Q, ["a"], [])
    with pytest.raises(TypeError, match="both"):
        tree_util.register_dataclass(Q, ["a"], None)

    class R:                                                   # not a dataclass: fields given
        def __init__(self, a, b):
            self.a, self.b = a, b
    tree_util.register_dataclass(R, ["a"], ["b"])
    r = tree_util.tree_map(lambda v: v + 1, R(1, 2))
    assert tree_util.tree_leaves(R(1, 2)) == [1] and (r.a, r.b) == (2, 2)


def test_register_pytree_with_keys_class_and_register_static():
    @tree_util.register_pytree_with_keys_class
    class K:
        def __init__(self, x, y):
            self.x, self.y = x, y

        def tree_flatten_with_keys(self):
            return ((tree_util.GetAttrKey("x"), self.x), (tree_util.GetAttrKey("y"), self.y)), None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls(*children)
    assert [tree_util.keystr(p) for p, _ in tree_util.tree_flatten_with_path(K(1, 2))[0]] == \
        [".x", ".y"]
    assert tree_util.tree_leaves(K(1, [2])) == [1, 2]

    @tree_util.register_static
    class S:
        def __init__(self, v):
            self.v = v
    s = S(1)
    out = tree_util.tree_map(lambda x: x + 1, [s, 2])
    assert tree_util.tree_leaves([s, 2]) == [2] and out[0] is s and out[1] == 3


def test_registration_helpers_match_jax():
    jtu = pytest.importorskip("jax.tree_util")
    for m in (jtu, tree_util):
        @m.register_dataclass
        @dataclasses.dataclass
        class P:
            x: float
            y: list
            tag: str = dataclasses.field(default="t", metadata={"static": True})
        p = P(1.0, [2, 3], "u")
        assert m.tree_leaves(p) == [1.0, 2, 3]
        assert [m.keystr(k) for k, _ in m.tree_flatten_with_path(p)[0]] == [".x", ".y[0]", ".y[1]"]
        assert m.tree_map(lambda v: v * 2, p) == P(2.0, [4, 6], "u")


# --- PyTreeDef methods ----------------------------------------------------------------------

def test_treedef_children_and_flatten_up_to():
    td = tree_util.tree_structure({"a": [1, (2, None)], "b": 3})
    kids = td.children()                       # a method, as jax's PyTreeDef.children()
    assert kids == [tree_util.tree_structure([1, (2, None)]), tree_util.tree_structure(3)]
    assert tree_util.tree_structure(5).children() == []
    assert tree_util.tree_structure([0, 0]).flatten_up_to([(1, 2), {"x": 3}]) == [(1, 2), {"x": 3}]
    with pytest.raises(ValueError, match="mismatch"):
        tree_util.tree_structure([0, 0]).flatten_up_to([1, 2, 3])


def test_treedef_methods_match_jax():
    jtu = pytest.importorskip("jax.tree_util")
    t = {"a": [1, (2, None)], "b": Pair(3, 4)}
    assert [c.num_leaves for c in tree_util.tree_structure(t).children()] == \
        [c.num_leaves for c in jtu.tree_structure(t).children()]
    up = [(1, 2), {"x": 3}]
    assert tree_util.tree_structure([0, 0]).flatten_up_to(up) == \
        jtu.tree_structure([0, 0]).flatten_up_to(up)


# --- boxed parameters (nn.Partitioned / LogicallyPartitioned) -------------------------------

def test_partitioned_boxes_serialize_as_their_value():
    msgpack = pytest.importorskip("msgpack")
    from ctrainstate import nn
    # Flax's boxes are structs whose only data field is 'value': {'value': array}. to_bytes of
    # variables made with with_partitioning raised TypeError
    t = {"w": nn.Partitioned(np.ones(2, np.float32), names=("a",)),
         "l": nn.LogicallyPartitioned(np.ones(2, np.float32), names=("a",))}
    assert set(serialization.to_state_dict(t)["w"]) == {"value"}
    assert msgpack.unpackb(serialization.to_bytes(t), raw=False, ext_hook=serialization._unpack_ext
                           )["l"]["value"].tolist() == [1.0, 1.0]
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    target = {"k": nn.Partitioned(cts.device_put(np.zeros((2, 4), np.float32),
                                                 cts.NamedSharding(mesh, cts.P(None, "model"))),
                                  names=(None, "model"))}
    data = serialization.to_bytes({"k": nn.Partitioned(np.arange(8, dtype=np.float32).reshape(2, 4),
                                                       names=(None, "model"))})
    r = serialization.from_bytes(target, data)
    assert isinstance(r["k"], nn.Partitioned) and r["k"].names == (None, "model")
    assert r["k"].value.sharding.spec == cts.P(None, "model")
    np.testing.assert_array_equal(np.asarray(r["k"].value), np.arange(8).reshape(2, 4))
    with pytest.raises(ValueError, match=r"k has a ndarray where the target is a Partitioned"):
        serialization.from_bytes(target, serialization.to_bytes({"k": np.zeros((2, 4), np.float32)}))
    with pytest.raises(ValueError, match=r"\['names', 'value'\]"):
        serialization.from_state_dict(target, {"k": {"value": 1, "names": 2}})


def test_partitioned_box_bytes_match_flax():
    fser = pytest.importorskip("flax.serialization")
    fnn = pytest.importorskip("flax.linen")
    from ctrainstate import nn
    tf = {"w": fnn.Partitioned(np.ones(2, np.float32), names=("a",)),
          "l": fnn.LogicallyPartitioned(np.ones(2, np.float32), names=("a",))}
    tc = {"w": nn.Partitioned(np.ones(2, np.float32), names=("a",)),
          "l": nn.LogicallyPartitioned(np.ones(2, np.float32), names=("a",))}
    assert serialization.to_bytes(tc) == fser.to_bytes(tf)
    rf = fser.from_bytes(tf, serialization.to_bytes(tc))
    rc = serialization.from_bytes(tc, fser.to_bytes(tf))
    assert isinstance(rf["w"], fnn.Partitioned) and isinstance(rc["w"], nn.Partitioned)
    np.testing.assert_array_equal(np.asarray(rc["l"].value), np.asarray(rf["l"].value))


def test_train_state_checkpoint_of_another_optimizer_names_the_path():
    pytest.importorskip("msgpack")
    from ctrainstate import optim
    from ctrainstate.train_state import TrainState
    p = {"dense": {"kernel": np.ones((2, 3), np.float32), "bias": np.zeros(3, np.float32)}}
    adam = TrainState.create(apply_fn=None, params=p, tx=optim.adam(1e-3))
    chain = TrainState.create(apply_fn=None, params=p, tx=optim.chain(
        optim.clip_by_global_norm(1.0), optim.adam(1e-3)))
    # adam's state {'0': {count, mu, nu}, '1': {}} read into chain's (EmptyState, (adam, ...)):
    # EmptyState took the adam fields silently before
    with pytest.raises(ValueError, match=r"\['count', 'mu', 'nu'\].*EmptyState.*at opt_state/0"):
        serialization.from_bytes(chain, serialization.to_bytes(adam))
    assert np.asarray(chain.opt_state[1][0].mu["dense"]["kernel"]).sum() == 0   # untouched


def test_copy_and_pop_of_a_dict_copy_its_structure_like_flax():
    # Flax copies a dict through jax.tree_util.tree_map: dict keys sorted, nested dicts (in
    # lists too) copied, FrozenDicts kept frozen
    d = {"b": {"y": 1, "x": None}, "a": [{"q": 1, "p": 2}], "f": core.freeze({"k": 1})}
    c = core.copy(d, {"c": 3})
    assert list(c) == ["a", "b", "f", "c"] and list(c["b"]) == ["x", "y"]
    assert list(c["a"][0]) == ["p", "q"] and c["a"][0] is not d["a"][0]
    assert isinstance(c["f"], core.FrozenDict) and c == {**d, "c": 3}
    rest, v = core.pop(d, "a")
    assert list(rest) == ["b", "f"] and isinstance(rest["f"], core.FrozenDict)
    assert v == [{"p": 2, "q": 1}] and list(v[0]) == ["p", "q"]
    assert list(d) == ["b", "a", "f"]          # the input is not changed


def _container_shape(t, ffd):
    """The container types and key order of a tree of dicts / FrozenDicts (ours or Flax's,
    ``ffd`` is flax.core.frozen_dict) and lists, leaves as they are."""
    if isinstance(t, (dict, ffd.FrozenDict)):
        return (type(t).__name__, [(k, _container_shape(v, ffd)) for k, v in t.items()])
    if isinstance(t, list):
        return [_container_shape(v, ffd) for v in t]
    return t


def test_copy_and_pop_of_a_dict_match_flax():
    ffd = pytest.importorskip("flax.core.frozen_dict")

    def mk(M):
        return {"b": {"y": 1, "x": None}, "a": [{"q": 1, "p": 2}], "f": M.freeze({"k": 1})}

    assert _container_shape(core.copy(mk(core), {"c": 3}), ffd) == _container_shape(
        ffd.copy(mk(ffd), {"c": 3}), ffd)
    for i in (0, 1):
        assert _container_shape(core.pop(mk(core), "a")[i], ffd) == _container_shape(
            ffd.pop(mk(ffd), "a")[i], ffd)


def test_struct_field_takes_metadata_none():
    # flax.struct.field(pytree_node=True, *, metadata=None, **kwargs): None raised TypeError
    f = struct.field(pytree_node=False, metadata=None)
    assert dict(f.metadata) == {"pytree_node": False}
    assert dict(struct.field(metadata={"x": 1}).metadata) == {"pytree_node": True, "x": 1}


# --- is_leaf_takes_path, all_leaves(is_leaf=), register_pytree_node(flatten_with_keys_func=)

_NESTED = {"a": {"x": [1, 2], "y": 3}, "b": [4, (5, 6)]}


def test_is_leaf_takes_path():
    def at_depth_2(path, x):
        return len(path) == 2
    pl = tree_util.tree_flatten_with_path(_NESTED, is_leaf=at_depth_2, is_leaf_takes_path=True)[0]
    assert [(tree_util.keystr(p), v) for p, v in pl] == [
        ("['a']['x']", [1, 2]), ("['a']['y']", 3), ("['b'][0]", 4), ("['b'][1]", (5, 6))]
    assert tree_util.tree_map_with_path(lambda p, x: len(p), _NESTED, is_leaf=at_depth_2,
                                        is_leaf_takes_path=True) == {"a": {"x": 2, "y": 2},
                                                                     "b": [2, 2]}
    assert len(tree_util.tree_leaves_with_path(_NESTED, is_leaf=at_depth_2,
                                               is_leaf_takes_path=True)) == 4


def test_all_leaves_is_leaf_and_register_with_keys_func():
    assert tree_util.all_leaves([1, 2.0]) and not tree_util.all_leaves([1, [2]])
    assert tree_util.all_leaves([None], is_leaf=lambda x: x is None)
    assert not tree_util.all_leaves([None])

    class B:
        def __init__(self, a):
            self.a = a
    tree_util.register_pytree_node(B, lambda b: ((b.a,), None), lambda aux, ch: B(*ch),
                                   lambda b: (((tree_util.GetAttrKey("a"), b.a),), None))
    assert [tree_util.keystr(p) for p, _ in tree_util.tree_flatten_with_path(B([1]))[0]] == [".a[0]"]
    assert tree_util.tree_leaves(B([1, 2])) == [1, 2]


def test_path_predicates_and_all_leaves_match_jax():
    jtu = pytest.importorskip("jax.tree_util")

    def isl(p, x):
        return len(p) == 2
    for tree in (_NESTED, [1, [2, [3]]], {"q": Pair(1, [2])}):
        assert [(tree_util.keystr(p), v) for p, v in tree_util.tree_flatten_with_path(
            tree, is_leaf=isl, is_leaf_takes_path=True)[0]] == \
            [(jtu.keystr(p), v) for p, v in jtu.tree_flatten_with_path(
                tree, is_leaf=isl, is_leaf_takes_path=True)[0]]
    for items, pred in (([1, [2]], lambda x: isinstance(x, list)), ([None], lambda x: x is None),
                        ([1, (2,)], lambda x: isinstance(x, tuple)), ([1, 2], None)):
        assert tree_util.all_leaves(items, is_leaf=pred) == jtu.all_leaves(items, is_leaf=pred)


def test_from_bytes_checks_host_and_jax_array_targets_too(jax_ref):
    pytest.importorskip("msgpack")
    data = serialization.to_bytes({"w": np.ones((2, 3), np.float32), "n": 1})
    # a numpy template of another shape got the saved array silently
    with pytest.raises(ValueError, match=r"shape \(2, 3\), its target \(3, 3\), at \['w'\]"):
        serialization.from_bytes({"w": np.zeros((3, 3), np.float32), "n": 0}, data)
    r = serialization.from_bytes({"w": np.zeros((2, 3), np.float32), "n": 0}, data)
    assert type(r["w"]) is np.ndarray and r["w"].sum() == 6 and r["n"] == 1
    if jax_ref.live:   # a jax array as the target: in the live twin only (nothing to record)
        with pytest.raises(ValueError, match=r"at \['w'\]"):
            serialization.from_bytes({"w": jax_ref.jax.numpy.zeros((3, 3)), "n": 0}, data)
    with pytest.raises(ValueError, match=r"at \['w'\] .*saved value a str"):
        serialization.from_bytes({"w": np.zeros((2, 3)), "n": 0},
                                 serialization.to_bytes({"w": "x", "n": 1}))


def test_unfreeze_of_a_frozen_dict_sorts_keys_like_flax():
    f = core.freeze({"b": {"y": 1, "x": 2}, "a": [{"q": 1, "p": 2}, core.freeze({"n": 1})]})
    u = core.unfreeze(f)
    assert list(u) == ["a", "b"] and list(u["b"]) == ["x", "y"] and type(u["b"]) is dict
    assert list(u["a"][0]) == ["p", "q"] and u["a"] is not f["a"]       # the list is copied
    assert isinstance(u["a"][1], core.FrozenDict)       # a FrozenDict inside a list stays one
    assert u == {"b": {"y": 1, "x": 2}, "a": [{"q": 1, "p": 2}, {"n": 1}]}
    d = core.unfreeze({"z": core.freeze({"b": 1, "a": 2}), "y": {"d": 1, "c": 2}})
    assert list(d) == ["z", "y"] and list(d["z"]) == ["a", "b"] and list(d["y"]) == ["d", "c"]


def test_unfreeze_matches_flax():
    ffd = pytest.importorskip("flax.core.frozen_dict")

    def mk(M):
        return M.freeze({"b": {"y": 1, "x": 2}, "a": [{"q": 1, "p": 2}, M.freeze({"n": 1, "m": 2})]})

    assert _container_shape(core.unfreeze(mk(core)), ffd) == _container_shape(
        ffd.unfreeze(mk(ffd)), ffd)
    assert _container_shape(mk(core).unfreeze(), ffd) == _container_shape(mk(ffd).unfreeze(), ffd)
    mixed = {"z": 1, "y": {"d": 1, "c": 2}}
    assert _container_shape(core.unfreeze({**mixed, "f": core.freeze({"b": 1, "a": 2})}), ffd) \
        == _container_shape(ffd.unfreeze({**mixed, "f": ffd.freeze({"b": 1, "a": 2})}), ffd)


def test_from_bytes_keeps_the_target_s_dict_order():
    pytest.importorskip("msgpack")
    from ctrainstate import optim
    from ctrainstate.train_state import TrainState
    # Flax's from_bytes rebuilds dicts in the target's key order; the placing pass sorted them
    t = {"w": np.zeros((2,), np.float32), "n": 0, "b": {"z": np.zeros(1), "a": None}}
    r = serialization.from_bytes(t, serialization.to_bytes(t))
    assert list(r) == ["w", "n", "b"] and list(r["b"]) == ["z", "a"]
    p = {"dense": {"kernel": np.ones((2, 3), np.float32), "bias": np.zeros(3, np.float32)}}
    s = TrainState.create(apply_fn=None, params=p, tx=optim.adam(1e-3))
    s = s.replace(params={"dense": {"kernel": s.params["dense"]["kernel"],
                                    "bias": s.params["dense"]["bias"]}})   # unsorted keys
    rs = serialization.from_bytes(s, serialization.to_bytes(s))
    assert list(rs.params["dense"]) == list(s.params["dense"])
    assert list(rs.opt_state[0].mu["dense"]) == list(s.opt_state[0].mu["dense"])
    f = serialization.from_bytes(core.freeze(t), serialization.to_bytes(t))
    assert isinstance(f, core.FrozenDict) and list(f) == ["w", "n", "b"]


def test_from_bytes_dict_order_matches_flax():
    fser = pytest.importorskip("flax.serialization")
    t = {"w": np.zeros((2,), np.float32), "n": 0, "b": {"z": np.zeros(1), "a": None}, "l": [{"y": 1, "x": 2}]}
    data = fser.to_bytes(t)

    def order(x):
        if isinstance(x, dict):
            return [(k, order(v)) for k, v in x.items()]
        if isinstance(x, list):
            return [order(v) for v in x]
        return None
    assert order(serialization.from_bytes(t, data)) == order(fser.from_bytes(t, data))


def test_struct_unflatten_runs_post_init_like_flax():
    # jax.tree_util.register_dataclass (Flax's struct) rebuilds through __init__: attributes
    # that __post_init__ derives exist on tree_map's result too (they were missing)
    calls = []

    @struct.dataclass
    class A:
        x: Any
        tag: str = struct.field(pytree_node=False, default="t")

        def __post_init__(self):
            calls.append(self.x)
            object.__setattr__(self, "double", self.x * 2)

    a = A(1, "u")
    b = tree_util.tree_map(lambda v: v + 1, a)
    assert calls == [1, 2] and b.double == 4 and b.tag == "u" and b == A(2, "u")
    r = serialization.from_state_dict(a, {"x": 5})
    assert r.double == 10


def test_struct_post_init_on_unflatten_matches_flax():
    fst = pytest.importorskip("flax.struct")
    jtu = pytest.importorskip("jax.tree_util")
    for S, tu in ((fst, jtu), (struct, tree_util)):
        calls = []

        @S.dataclass
        class A:
            x: Any

            def __post_init__(self):
                calls.append(self.x)
        tu.tree_map(lambda v: v + 1, A(1))
        assert calls == [1, 2]


# --- tree_broadcast / tree_reduce_associative (jax.tree.broadcast / reduce_associative) ----

def test_tree_broadcast_and_reduce_associative():
    assert tree_util.tree_broadcast({"a": 1, "b": 2}, {"a": [0, 0], "b": 0}) == {"a": [1, 1], "b": 2}
    assert cts.tree.broadcast(5, {"a": [0, 0], "b": None}) == {"a": [5, 5], "b": None}
    with pytest.raises(ValueError, match="mismatch"):
        cts.tree.broadcast({"a": 1}, {"b": 1})
    # pairs as a balanced binary tree: ((1+2)+(3+(4+5)))
    assert cts.tree.reduce_associative(lambda a, b: f"({a}+{b})", [1, 2, 3, 4, 5]) == \
        "((1+2)+(3+(4+5)))"
    assert cts.tree.reduce_associative(lambda a, b: a + b, [], identity=0) == 0
    with pytest.raises(TypeError, match="identity"):
        cts.tree.reduce_associative(lambda a, b: a + b, [])


def test_tree_broadcast_and_reduce_associative_match_jax():
    jax = pytest.importorskip("jax")
    cases = [({"a": 1, "b": 2}, {"a": [0, 0], "b": 0}, None), (5, {"a": [0, (0,)], "b": None}, None),
             ([[1, 2]], [[[0, 0], [0]]], lambda x: isinstance(x, list) and len(x) == 2)]
    for prefix, full, isl in cases:
        assert cts.tree.broadcast(prefix, full, is_leaf=isl) == jax.tree.broadcast(prefix, full,
                                                                                  is_leaf=isl)
    for n in range(1, 9):
        op = lambda a, b: f"({a}+{b})"   # noqa: E731
        assert cts.tree.reduce_associative(op, list(range(n))) == \
            jax.tree.reduce_associative(op, list(range(n)))


def test_from_state_dict_restores_a_defaultdict():
    # type(target)(pairs) raised TypeError for a defaultdict (its factory comes first)
    t = collections.defaultdict(list, {"a": 1, "b": {"c": 2}})
    r = serialization.from_state_dict(t, {"a": 5, "b": {"c": 6}})
    assert type(r) is collections.defaultdict and r.default_factory is list
    assert dict(r) == {"a": 5, "b": {"c": 6}}
    od = collections.OrderedDict(b=1, a=2)
    assert serialization.from_state_dict(od, {"a": 3, "b": 4}) == collections.OrderedDict(b=4, a=3)


def test_msgpack_is_a_declared_dependency():
    """to_bytes needs msgpack, so pyproject.toml declares it: a fresh install has it before
    the first checkpoint is written, not a failure at save time after training."""
    import os
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml")) as f:
        text = f.read()
    deps = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.M | re.S).group(1)
    names = [re.match(r"\s*[\"']([A-Za-z0-9_.-]+)", d).group(1).lower()
             for d in deps.split(",") if d.strip()]
    assert "msgpack" in names, names
    import numpy as np
    from ctrainstate import serialization
    tree = {"w": np.arange(3, dtype=np.float32)}
    back = serialization.from_bytes(tree, serialization.to_bytes(tree))
    np.testing.assert_array_equal(back["w"], tree["w"])
