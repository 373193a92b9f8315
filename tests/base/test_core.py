"""ctrainstate.core (flax.core): FrozenDict, freeze / unfreeze, copy / pop, pretty_repr. Each test pins a
discrepancy that was found against live Flax: the parity tests compare with it (and skip without
it), the others hold expectations derived by hand."""

import numpy as np
import pytest

from ctrainstate import core
import ctrainstate as cts


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


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define, live when installed (those parts skip cleanly otherwise) and derived
# by hand

def _jax():
    return pytest.importorskip("jax")


def test_frozen_dict_basics():
    from ctrainstate.core import FrozenDict, copy, freeze, pop, pretty_repr, unfreeze
    f = freeze({"b": {"x": 1}, "a": 2})
    assert isinstance(f["b"], FrozenDict) and f == {"b": {"x": 1}, "a": 2}
    with pytest.raises(TypeError, match="immutable"):
        f["a"] = 3
    with pytest.raises(TypeError, match="immutable"):
        f["b"]["x"] = 3
    rest, a = f.pop("a")
    assert a == 2 and isinstance(rest, FrozenDict) and dict(rest) == {"b": {"x": 1}}
    u = unfreeze(f)
    assert type(u) is dict and type(u["b"]) is dict and u == f
    u["b"]["x"] = 5                                      # a copy: f is untouched
    assert f["b"]["x"] == 1
    assert copy(f, {"c": 3})["c"] == 3 and isinstance(copy(f, {"c": 3}), FrozenDict)
    assert pop({"a": 1, "b": 2}, "a") == ({"b": 2}, 1)
    assert hash(freeze({"a": 1})) == hash(freeze({"a": 1}))
    # a pytree node with sorted keys, rebuilt as a FrozenDict
    leaves, td = cts.tree_util.tree_flatten(f)
    assert leaves == [2, 1]
    assert isinstance(cts.tree_util.tree_map(lambda v: v * 10, f), FrozenDict)
    assert [cts.tree_util.keystr(p) for p, _ in cts.tree_util.tree_flatten_with_path(f)[0]] == \
        ["['a']", "['b']['x']"]
    assert pretty_repr({"a": {"b": 1}}) == "{\n    a: {\n        b: 1,\n    },\n}"


def test_frozen_params_train():
    from ctrainstate import optim
    from ctrainstate.core import FrozenDict, freeze
    from ctrainstate.train_state import TrainState
    p = freeze({"w": np.ones((2, 2), np.float32), "b": np.zeros(2, np.float32)})
    tx = optim.adamw(0.1, weight_decay=0.1, mask=freeze({"w": True, "b": False}))
    s = TrainState.create(apply_fn=None, params=p, tx=tx)
    assert isinstance(s.params, FrozenDict)
    s = s.apply_gradients(grads=freeze({"w": np.ones((2, 2), np.float32),
                                        "b": np.ones(2, np.float32)}))
    assert isinstance(s.params, FrozenDict) and s.step == 1
    # adam's first step is -lr * sign(g) (up to eps); the decay applies to w only
    np.testing.assert_allclose(np.asarray(s.params["b"]), [-0.1, -0.1], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s.params["w"]), 1 - 0.1 * (1 + 0.1), rtol=1e-5)


def test_frozen_dict_matches_flax():
    fcore = pytest.importorskip("flax.core")
    jax = _jax()
    from ctrainstate import core
    d = {"b": {"x": 1, "y": {}}, "a": 2}
    assert repr(core.freeze(d)) == repr(fcore.freeze(d))
    assert core.unfreeze(core.freeze(d)) == fcore.unfreeze(fcore.freeze(d))
    for key in ("a", "b"):
        rest, val = core.freeze(d).pop(key)
        frest, fval = fcore.freeze(d).pop(key)
        assert repr(val) == repr(fval)
        assert type(rest).__name__ == type(frest).__name__ == "FrozenDict"
        assert repr(rest) == repr(frest) and list(rest) == list(frest)
        assert core.unfreeze(rest) == fcore.unfreeze(frest)
        assert rest == core.freeze({k: v for k, v in d.items() if k != key})   # hand-derived
    with pytest.raises(KeyError):
        fcore.freeze(d).pop("zz")
    with pytest.raises(KeyError):
        core.freeze(d).pop("zz")
    assert repr(core.copy(core.freeze(d), {"c": 3})) == repr(fcore.copy(fcore.freeze(d), {"c": 3}))
    fl = jax.tree_util.tree_flatten_with_path(fcore.freeze(d))[0]
    cl = cts.tree_util.tree_flatten_with_path(core.freeze(d))[0]
    assert [jax.tree_util.keystr(k) for k, _ in fl] == [cts.tree_util.keystr(k) for k, _ in cl]
