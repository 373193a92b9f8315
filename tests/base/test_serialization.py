"""ctrainstate.serialization (flax.serialization): state dicts, msgpack bytes, registered classes.

Each test pins a discrepancy that was found against live Flax/JAX: the parity tests compare
with them (their values recorded where they reduce to bytes and arrays, live where the test
hands jax arrays to ctrainstate), the others hold expectations derived by hand or from the
msgpack format as Flax documents it."""

import collections
import importlib
import re
from typing import Any

import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import core
from ctrainstate import serialization
from ctrainstate import struct
import ctrainstate.numpy as cnp


Pair = collections.namedtuple("Pair", "a b")


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


def _raised(f, match=""):
    """[the name of the exception f() raises, whether it is a ValueError, whether its message
    matches `match`]; None if f() raises nothing. (Not the message itself: Flax's can show a
    set, in an order that changes from run to run.)"""
    try:
        f()
    except Exception as e:
        return [type(e).__name__, isinstance(e, ValueError), re.search(match, str(e)) is not None]
    return None


@pytest.mark.parametrize("target,state", [
    ([1, 2], {"0": 5, "1": 6, "2": 7}),
    (Pair(1, 2), {"a": 5, "b": 6, "c": 7}),
])
def test_from_state_dict_extra_entries_raise_as_in_flax(target, state, jax_ref):
    flax_raised = jax_ref("flax", lambda flax: _raised(
        lambda: flax.serialization.from_state_dict(target, state)))
    assert flax_raised is not None and flax_raised[1], flax_raised   # a ValueError in Flax too
    with pytest.raises(ValueError):
        serialization.from_state_dict(target, state)


def test_from_state_dict_reads_flax_s_old_namedtuple_layout():
    # Flax before 2022 wrote a NamedTuple as {'name', 'fields', 'values'}; Flax still reads it
    old = {"name": "Pair", "fields": {"0": "a", "1": "b"}, "values": {"0": 5, "1": 6}}
    assert serialization.from_state_dict(Pair(1, 2), old) == Pair(5, 6)


def test_old_namedtuple_layout_matches_flax(jax_ref):
    old = {"name": "Pair", "fields": {"0": "b", "1": "a"}, "values": {"0": 5, "1": 6}}
    def theirs(fser):
        r = fser.from_state_dict(Pair(1, 2), old)
        return type(r).__name__, tuple(r)

    kind, values = jax_ref("flax", lambda flax: theirs(flax.serialization))
    ours = serialization.from_state_dict(Pair(1, 2), old)
    assert type(ours).__name__ == kind and ours == values


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


def test_struct_restore_unknown_fields_raise_in_flax_too(jax_ref):
    def theirs(flax):
        @flax.struct.dataclass
        class M:
            w: Any
            fn: Any = flax.struct.field(pytree_node=False, default=None)
        return _raised(lambda: flax.serialization.from_state_dict(M(1), {"w": 2, "z": 3}),
                       "Unknown field")

    assert jax_ref("flax", lambda flax: theirs(flax)) == ["ValueError", True, True]
    with pytest.raises(ValueError, match="Unknown field"):
        serialization.from_state_dict(_Model(1), {"w": 2, "b": 0, "z": 3})


def test_to_state_dict_refuses_keys_with_the_same_string():
    # {1: a, '1': b} both become '1': one value was silently lost
    with pytest.raises(ValueError, match="unique string"):
        serialization.to_state_dict({1: 1, "1": 2})
    with pytest.raises(ValueError, match="unique string"):
        serialization.to_bytes({"p": {1: 1, "1": 2}})
    assert serialization.to_state_dict({1: 1, "2": 2}) == {"1": 1, "2": 2}


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


def test_registered_class_bytes_match_flax(jax_ref):
    t_c = {"b": _Box([np.ones(2, np.float32), 3], "t"), "c": 1}
    ours = serialization.to_bytes(t_c)

    def theirs(fser):
        class FBox(_Box):
            pass
        fser.register_serialization_state(
            FBox, lambda b: {"v": fser.to_state_dict(b.v)},
            lambda b, sd: FBox(fser.from_state_dict(b.v, sd["v"], name="v"), b.tag))
        t_f = {"b": FBox([np.ones(2, np.float32), 3], "t"), "c": 1}
        r = fser.from_bytes({"b": FBox([np.zeros(2, np.float32), 0], "u"), "c": 0}, ours)
        return {"bytes": np.frombuffer(fser.to_bytes(t_f), np.uint8),
                "read": [r["b"].v[1], r["b"].tag]}     # Flax reading ctrainstate's bytes

    want = jax_ref("flax", lambda flax: theirs(flax.serialization))
    assert ours == want["bytes"].tobytes()
    assert want["read"] == [3, "u"]


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


def test_partitioned_box_bytes_match_flax(jax_ref):
    from ctrainstate import nn
    tc = {"w": nn.Partitioned(np.ones(2, np.float32), names=("a",)),
          "l": nn.LogicallyPartitioned(np.ones(2, np.float32), names=("a",))}
    ours = serialization.to_bytes(tc)

    def theirs(fser, fnn):
        tf = {"w": fnn.Partitioned(np.ones(2, np.float32), names=("a",)),
              "l": fnn.LogicallyPartitioned(np.ones(2, np.float32), names=("a",))}
        rf = fser.from_bytes(tf, ours)                 # Flax reading ctrainstate's bytes
        return {"bytes": np.frombuffer(fser.to_bytes(tf), np.uint8),
                "w is Partitioned": isinstance(rf["w"], fnn.Partitioned),
                "l": np.asarray(rf["l"].value)}

    want = jax_ref("flax", lambda flax, linen: theirs(flax.serialization, linen))
    assert ours == want["bytes"].tobytes()
    rc = serialization.from_bytes(tc, want["bytes"].tobytes())
    assert want["w is Partitioned"] and isinstance(rc["w"], nn.Partitioned)
    np.testing.assert_array_equal(np.asarray(rc["l"].value), want["l"])


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


def test_from_bytes_dict_order_matches_flax(jax_ref):
    t = {"w": np.zeros((2,), np.float32), "n": 0, "b": {"z": np.zeros(1), "a": None}, "l": [{"y": 1, "x": 2}]}

    def order(x):
        if isinstance(x, dict):
            return [(k, order(v)) for k, v in x.items()]
        if isinstance(x, list):
            return [order(v) for v in x]
        return None

    def theirs(fser):
        data = fser.to_bytes(t)
        return np.frombuffer(data, np.uint8), order(fser.from_bytes(t, data))

    data, want = jax_ref("flax", lambda flax: theirs(flax.serialization))
    assert order(serialization.from_bytes(t, data.tobytes())) == want


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
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml")) as f:
        text = f.read()
    deps = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.M | re.S).group(1)
    # (each requirement is one quoted string; a version range has commas inside it)
    names = [n.lower() for n in re.findall(r"[\"']([A-Za-z0-9_.-]+)", deps)]
    assert "msgpack" in names, names
    import numpy as np
    from ctrainstate import serialization
    tree = {"w": np.arange(3, dtype=np.float32)}
    back = serialization.from_bytes(tree, serialization.to_bytes(tree))
    np.testing.assert_array_equal(back["w"], tree["w"])


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define (recorded, checked live in the parity twins) and derived by hand

def _ser_params():
    r = np.random.RandomState(0)
    return {"dense": {"kernel": r.randn(4, 8).astype(np.float32), "bias": np.zeros(8, np.float32)},
            "ln": {"scale": np.ones(8, np.float32)}}


def _ser_grads():
    r = np.random.RandomState(1)
    return {k: {n: r.randn(*v.shape).astype(np.float32) for n, v in d.items()}
            for k, d in _ser_params().items()}


def _ct_state(mesh):
    from ctrainstate import optim
    from ctrainstate.train_state import TrainState
    p = _ser_params()
    params = {"dense": {"kernel": cts.device_put(p["dense"]["kernel"],
                                                 cts.NamedSharding(mesh, cts.P("data", "model"))),
                        "bias": cts.device_put(p["dense"]["bias"], cts.NamedSharding(mesh, cts.P("model")))},
              "ln": {"scale": p["ln"]["scale"]}}
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
    return TrainState.create(apply_fn=None, params=params, tx=tx)


def test_serialization_roundtrip_keeps_shardings():
    pytest.importorskip("msgpack")
    from ctrainstate import serialization
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    s = _ct_state(mesh).apply_gradients(grads=_ser_grads())
    sd = serialization.to_state_dict(s)
    assert sorted(sd) == ["opt_state", "params", "step"]
    assert sorted(sd["opt_state"]["1"]["0"]) == ["count", "mu", "nu"] and sd["opt_state"]["0"] == {}
    data = serialization.to_bytes(s)
    target = _ct_state(mesh)                            # a fresh state as the template
    r = serialization.from_bytes(target, data)
    assert r.step == 1
    for a, b in zip(cts.tree_util.tree_leaves(s), cts.tree_util.tree_leaves(r)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    k = r.params["dense"]["kernel"]
    assert k.sharding == cts.NamedSharding(mesh, cts.P("data", "model"))
    assert r.opt_state[1][0].mu["dense"]["bias"].sharding == cts.NamedSharding(mesh, cts.P("model"))
    kval = np.asarray(k)
    r2 = r.apply_gradients(grads=_ser_grads())           # the restored state trains
    assert r2.step == 2
    # an abstract target (eval_shape) restores born sharded
    abstract = cts.eval_shape(lambda: _ct_state(mesh))
    r3 = serialization.from_bytes(abstract, data)
    assert r3.params["dense"]["kernel"].sharding == k.sharding
    np.testing.assert_array_equal(np.asarray(r3.params["dense"]["kernel"]), kval)
    with pytest.raises(ValueError):
        serialization.from_bytes({"w": cts.device_put(np.zeros(3, np.float32))},
                                 serialization.to_bytes({"w": np.zeros(4, np.float32)}))


def test_serialization_chunks_big_arrays(monkeypatch):
    pytest.importorskip("msgpack")
    from ctrainstate import serialization
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 64)   # 16 float32 per chunk
    a = np.arange(40, dtype=np.float32).reshape(5, 8)
    import msgpack
    tree = msgpack.unpackb(serialization.msgpack_serialize({"a": a}), raw=False,
                           strict_map_key=False, ext_hook=serialization._unpack_ext)
    # Flax's layout: a marker, the shape as {'0': 5, '1': 8}, flat chunks of 16 elements
    assert tree["a"]["__msgpack_chunked_array__"] is True
    assert tree["a"]["shape"] == {"0": 5, "1": 8}
    assert [c.size for c in tree["a"]["chunks"].values()] == [16, 16, 8]
    np.testing.assert_array_equal(serialization.msgpack_restore(
        serialization.msgpack_serialize({"a": a}))["a"], a)


def test_serialization_interoperates_with_flax(monkeypatch, jax_ref):
    pytest.importorskip("msgpack")
    from ctrainstate import serialization
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    cs = _ct_state(mesh).apply_gradients(grads=_ser_grads())
    ours = serialization.to_bytes(cs)
    # chunked arrays: written by one, read by the other
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 64)
    a = np.arange(40, dtype=np.float32).reshape(5, 8)
    ours_chunked = serialization.msgpack_serialize({"a": a})
    vals = {"f": np.float32(1.5), "i": np.arange(3, dtype=np.int32), "s": "x", "n": 2,
            "b": np.ones(2, cnp.bfloat16)}
    ours_vals = serialization.msgpack_serialize(vals)

    def leaves(s):
        return [np.asarray(v) for v in cts.tree_util.tree_leaves((s.params, s.opt_state))]

    def theirs(fser, fts, optax):
        # Flax's bytes of its state, and what Flax reads from ctrainstate's bytes (the bytes it
        # read recorded beside it)
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
        fs = fts.TrainState.create(apply_fn=None, params=_ser_params(), tx=tx)
        fs = fs.apply_gradients(grads=_ser_grads())
        out = {"bytes": np.frombuffer(fser.to_bytes(fs), np.uint8), "leaves": leaves(fs),
               "from": np.frombuffer(ours, np.uint8), "read": leaves(fser.from_bytes(fs, ours))}
        monkeypatch.setattr(fser, "MAX_CHUNK_SIZE", 64)
        out["chunked"] = np.frombuffer(fser.msgpack_serialize({"a": a}), np.uint8)
        out["chunked from"] = np.frombuffer(ours_chunked, np.uint8)
        out["chunked read"] = fser.msgpack_restore(ours_chunked)["a"]
        back = fser.msgpack_restore(ours_vals)
        out["vals from"] = np.frombuffer(ours_vals, np.uint8)
        out["vals read"] = {k: back[k] for k in ("f", "s", "n", "b", "i")}
        return out

    want = jax_ref("flax", lambda flax, optax: theirs(
        flax.serialization, importlib.import_module("flax.training.train_state"), optax))
    r = serialization.from_bytes(_ct_state(mesh), want["bytes"].tobytes())   # Flax -> ctrainstate
    assert r.step == 1
    for a_, b in zip(want["leaves"], leaves(r), strict=True):
        np.testing.assert_array_equal(np.asarray(b), a_)
    assert r.params["dense"]["kernel"].sharding.spec == cts.P("data", "model")
    # ctrainstate -> Flax (recorded for these bytes)
    assert ours == want["from"].tobytes()
    for a_, b in zip(leaves(cs), want["read"], strict=True):
        np.testing.assert_array_equal(b, a_)
    assert ours_chunked == want["chunked from"].tobytes()
    np.testing.assert_array_equal(want["chunked read"], a)
    np.testing.assert_array_equal(serialization.msgpack_restore(want["chunked"].tobytes())["a"], a)
    assert ours_vals == want["vals from"].tobytes()
    back = want["vals read"]
    assert back["f"] == np.float32(1.5) and back["s"] == "x" and back["n"] == 2
    assert str(back["b"].dtype) == "bfloat16" and back["i"].tolist() == [0, 1, 2]


def test_to_bytes_takes_jax_arrays_with_flax_s_bytes():
    """Params that came out of a jax/Flax model (jax Arrays, 0-d included) serialize to the
    same bytes as flax.serialization.to_bytes; they raised TypeError."""
    jnp = pytest.importorskip("jax.numpy")
    fser = pytest.importorskip("flax.serialization")
    from ctrainstate import serialization as cser
    t = {"w": jnp.ones(3), "b": jnp.bfloat16(1.5), "s": jnp.float32(2.0),
         "m": jnp.arange(4).reshape(2, 2), "n": np.float32(3.0)}
    assert cser.to_bytes(t) == fser.to_bytes(t)
    back = cser.msgpack_restore(cser.to_bytes(t))
    np.testing.assert_array_equal(back["m"], [[0, 1], [2, 3]])
