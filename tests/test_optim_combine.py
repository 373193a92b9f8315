"""set_to_zero, freeze, partition / multi_transform and prefix masks: semantics beyond the
100-step parity cases of tests/optim_cases.py (state structures, NaN handling, errors,
the unfused path, born-sharded state)."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.optim as optim
from ctrainstate.train_state import TrainState
from ctrainstate.tree_util import tree_leaves, tree_map, tree_structure


def _params():
    rng = np.random.default_rng(3)
    return {"enc": {"w": rng.standard_normal((4, 8)).astype(np.float32),
                    "b": rng.standard_normal(8).astype(np.float32)},
            "head": rng.standard_normal((8, 2)).astype(np.float32)}


def _np(tree):
    return tree_map(np.asarray, tree)


def test_set_to_zero_gives_positive_zero_even_for_nan_and_inf():
    p = {"w": np.ones(5, np.float32)}
    g = {"w": np.array([np.nan, -np.inf, np.inf, -3.0, -0.0], np.float32)}
    tx = optim.set_to_zero()
    state = tx.init(p)
    assert state == optim.EmptyState()
    u, _ = tx.update(g, state, p)
    out = np.asarray(u["w"])
    assert out.tolist() == [0.0] * 5
    assert not np.signbit(out).any()


def test_freeze_bool_mask_freezes_everything():
    p = _params()
    tx = optim.chain(optim.freeze(True), optim.adam(0.1))
    ts = TrainState.create(apply_fn=None, params=p, tx=tx)
    ts = ts.apply_gradients(grads=tree_map(lambda x: np.full_like(x, np.nan), p))
    for a, b in zip(tree_leaves(_np(ts.params)), tree_leaves(p)):
        np.testing.assert_array_equal(a, b)


def test_partition_state_structure_and_masked_nodes():
    p = _params()
    labels = {"enc": "body", "head": "head"}
    tx = optim.multi_transform({"body": optim.adam(1e-2), "head": optim.sgd(0.1, momentum=0.9)},
                               labels)
    assert optim.multi_transform is optim.partition
    st = tx.init(p)
    assert type(st) is optim.PartitionState is optim.MultiTransformState
    assert sorted(st.inner_states) == ["body", "head"]
    adam_state = st.inner_states["body"].inner_state[0]
    # adam keeps moments for the 'enc' leaves only; 'head' is a MaskedNode
    assert isinstance(adam_state.mu["head"], optim.MaskedNode)
    assert adam_state.mu["enc"]["w"].shape == (4, 8)
    trace = st.inner_states["head"].inner_state[0].trace
    assert isinstance(trace["enc"], optim.MaskedNode) and trace["head"].shape == (8, 2)


def test_partition_matches_separate_optimizers():
    """Each label's leaves follow exactly the optimizer they would follow alone."""
    p = _params()
    rng = np.random.default_rng(9)
    grads = [tree_map(lambda x: rng.standard_normal(x.shape).astype(np.float32), p)
             for _ in range(5)]
    tx = optim.partition({"body": optim.adamw(1e-2, weight_decay=0.1), "head": optim.lion(1e-3)},
                         {"enc": "body", "head": "head"})
    ts = TrainState.create(apply_fn=None, params=p, tx=tx)
    alone_body = TrainState.create(apply_fn=None, params=p["enc"],
                                   tx=optim.adamw(1e-2, weight_decay=0.1))
    alone_head = TrainState.create(apply_fn=None, params={"h": p["head"]}, tx=optim.lion(1e-3))
    for g in grads:
        ts = ts.apply_gradients(grads=g)
        alone_body = alone_body.apply_gradients(grads=g["enc"])
        alone_head = alone_head.apply_gradients(grads={"h": g["head"]})
    got = _np(ts.params)
    for k in ("w", "b"):
        np.testing.assert_array_equal(got["enc"][k], np.asarray(alone_body.params[k]))
    np.testing.assert_array_equal(got["head"], np.asarray(alone_head.params["h"]))


def test_partition_unknown_label_is_a_clear_error():
    p = _params()
    tx = optim.partition({"body": optim.sgd(0.1)}, {"enc": "body", "head": "hed"})
    with pytest.raises(ValueError, match=r"no corresponding transformation(.|\n)*'hed'"):
        tx.init(p)


def test_partition_rejects_non_mapping_and_non_transform():
    with pytest.raises(TypeError, match="mapping"):
        optim.partition([optim.sgd(0.1)], {})
    with pytest.raises(TypeError, match=r"transforms\['a'\] is a float"):
        optim.partition({"a": 0.1}, {})


def test_partition_with_foreign_state_is_a_clear_error():
    p = _params()
    tx = optim.partition({"body": optim.sgd(0.1), "head": optim.sgd(0.2)},
                         {"enc": "body", "head": "head"})
    other = optim.partition({"body": optim.sgd(0.1)}, {"enc": "body", "head": "body"})
    with pytest.raises(ValueError, match="no entry for label 'head'"):
        tx.update(p, other.init(p), p)


def test_mask_that_is_not_a_prefix_is_a_clear_error():
    p = _params()
    tx = optim.masked(optim.sgd(0.1), {"enc": True, "tail": False})
    with pytest.raises(ValueError, match="neither the params' tree nor a prefix"):
        tx.init(p)


def test_unfused_inner_transform_runs_through_the_functional_path():
    """A user transformation with only init/update (not fusable) inside partition."""
    def init(params):
        return optim.EmptyState()

    def update(updates, state, params=None):
        return tree_map(lambda u: np.asarray(u) * 2.0, updates), state

    doubler = optim.GradientTransformation(init, update)
    assert not doubler.fusable
    p = _params()
    tx = optim.partition({"x2": doubler, "sgd": optim.sgd(1.0)}, {"enc": "x2", "head": "sgd"})
    assert not tx.fusable
    g = tree_map(np.ones_like, p)
    u, _ = tx.update(g, tx.init(p), p)
    u = _np(u)
    assert u["enc"]["w"].tolist() == np.full((4, 8), 2.0).tolist()
    assert u["head"].tolist() == np.full((8, 2), -1.0).tolist()


def test_partition_on_a_mesh_keeps_state_sharded_like_params():
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    P = cts.P
    specs = {"enc": {"w": P(None, "model"), "b": P("model")}, "head": P("model", None)}
    p = tree_map(lambda x, s: cts.device_put(x, cts.NamedSharding(mesh, s)), _params(), specs,
                 is_leaf=lambda x: isinstance(x, cts.PartitionSpec))
    tx = optim.partition({"body": optim.adam(1e-2), "head": optim.set_to_zero()},
                         lambda t: {"enc": "body", "head": "head"})
    ts = TrainState.create(apply_fn=None, params=p, tx=tx)
    mu = ts.opt_state.inner_states["body"].inner_state[0].mu
    assert mu["enc"]["w"].sharding.spec == P(None, "model")
    assert mu["enc"]["b"].sharding.spec == P("model")
    head0 = np.asarray(ts.params["head"]).copy()
    ts = ts.apply_gradients(grads=tree_map(lambda x: np.ones(x.shape, np.float32), _params()))
    np.testing.assert_array_equal(np.asarray(ts.params["head"]), head0)
    assert ts.params["head"].sharding.spec == P("model", None)
    assert tree_structure(ts.opt_state) == tree_structure(tx.init(p))
