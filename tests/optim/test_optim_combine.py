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


# --- inject_hyperparams -----------------------------------------------------------------------


def _steps(tx_state_update, grads):
    for g in grads:
        tx_state_update(g)


def test_inject_hyperparams_change_between_steps_matches_optax(jax_ref):
    p = _params()
    rng = np.random.default_rng(5)
    grads = [tree_map(lambda x: rng.standard_normal(x.shape).astype(np.float32), p)
             for _ in range(6)]

    def make(o):
        return o.inject_hyperparams(o.adamw)(learning_rate=o.linear_schedule(0.1, 0.01, 5),
                                             weight_decay=0.05, b1=0.8)

    def theirs(jax):
        optax = pytest.importorskip("optax")
        ref_tx = make(optax)
        ref_p = jax.tree.map(jax.numpy.asarray, p)
        ref_st = ref_tx.init(ref_p)
        for i, g in enumerate(grads):
            if i == 3:   # change a numeric hyper-parameter mid-run
                ref_st.hyperparams["b1"] = jax.numpy.asarray(0.5, jax.numpy.float32)
            u, ref_st = ref_tx.update(jax.tree.map(jax.numpy.asarray, g), ref_st, ref_p)
            ref_p = optax.apply_updates(ref_p, u)
        return {"params": jax.tree.leaves(ref_p), "count": int(ref_st.count),
                "hyperparams": {k: float(v) for k, v in ref_st.hyperparams.items()}}

    want = jax_ref("optax", theirs)
    ts = TrainState.create(apply_fn=None, params=p, tx=make(optim))
    for i, g in enumerate(grads):
        if i == 3:   # change a numeric hyper-parameter mid-run, as in optax's
            ts.opt_state.hyperparams["b1"] = 0.5
        ts = ts.apply_gradients(grads=g)
    for a, b in zip(tree_leaves(_np(ts.params)), want["params"], strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-7)
    got = {k: float(np.asarray(v)) for k, v in ts.opt_state.hyperparams.items()}
    assert got == want["hyperparams"]
    assert int(np.asarray(ts.opt_state.count)) == want["count"] == 6
    assert int(np.asarray(ts.opt_state.hyperparams_states["learning_rate"].count)) == 6


def test_inject_hyperparams_state_and_fusion():
    tx = optim.inject_hyperparams(optim.adam)(learning_rate=0.1, nesterov=True)
    assert tx.fusable
    st = tx.init(_params())
    assert type(st) is optim.InjectStatefulHyperparamsState
    # booleans and None stay fixed arguments, numbers become float32 state
    assert sorted(st.hyperparams) == ["b1", "b2", "eps", "eps_root", "learning_rate"]
    assert st.hyperparams_states == {}
    assert np.asarray(st.hyperparams["learning_rate"]).dtype == np.float32
    noisy = optim.inject_hyperparams(optim.noisy_sgd)(learning_rate=0.1, key=0)
    assert not noisy.fusable
    p = _params()
    u, s2 = noisy.update(tree_map(np.ones_like, p), noisy.init(p), p)
    assert int(np.asarray(s2.count)) == 1


def test_inject_hyperparams_errors():
    with pytest.raises(ValueError, match="static_args"):
        optim.inject_hyperparams(optim.sgd, static_args=("nope",))
    tx = optim.inject_hyperparams(optim.sgd)(learning_rate=0.1)
    p = _params()
    with pytest.raises(TypeError, match="InjectStatefulHyperparamsState"):
        tx.update(p, optim.sgd(0.1).init(p), p)


# --- MultiSteps ------------------------------------------------------------------------------


def test_multisteps_object_in_trainstate_is_fused_and_in_place():
    p = _params()
    ms = optim.MultiSteps(optim.adam(0.1), every_k_schedule=3)
    assert ms.fusable and ms.gradient_transformation().fusable
    ts = TrainState.create(apply_fn=None, params=p, tx=ms)
    g = tree_map(lambda x: np.full(x.shape, 0.5, np.float32), p)
    before = _np(ts.params)
    for i in range(1, 7):
        old = ts
        ts = ts.apply_gradients(grads=g)
        with pytest.raises(cts.DonatedBufferError):   # the old state was donated
            np.asarray(old.opt_state.acc_grads["head"])
        changed = not np.array_equal(np.asarray(ts.params["head"]), before["head"])
        assert changed == (i >= 3), i          # params move only from the 3rd mini-step on
        assert bool(ms.has_updated(ts.opt_state)) == (i % 3 == 0)
    assert int(np.asarray(ts.opt_state.gradient_step)) == 2
    assert int(np.asarray(ts.opt_state.inner_opt_state[0].count)) == 2


def test_multisteps_accumulates_the_mean_like_plain_adam_on_the_mean():
    p = _params()
    rng = np.random.default_rng(2)
    grads = [tree_map(lambda x: rng.standard_normal(x.shape).astype(np.float32), p)
             for _ in range(4)]
    ms = optim.MultiSteps(optim.adam(0.1), 4)
    ts = TrainState.create(apply_fn=None, params=p, tx=ms)
    for g in grads:
        ts = ts.apply_gradients(grads=g)
    # Welford's running mean, as optax: acc + (g - acc) / (n + 1), in float32
    acc = tree_map(lambda x: np.zeros_like(x), p)
    for n, g in enumerate(grads):
        acc = tree_map(lambda a, x: a + (x - a) / np.float32(n + 1), acc, g)
    plain = TrainState.create(apply_fn=None, params=p, tx=optim.adam(0.1)).apply_gradients(
        grads=acc)
    for a, b in zip(tree_leaves(_np(ts.params)), tree_leaves(_np(plain.params))):
        np.testing.assert_array_equal(a, b)


def test_multisteps_errors():
    with pytest.raises(ValueError, match=">= 1"):
        optim.MultiSteps(optim.sgd(0.1), 0)
    with pytest.raises(TypeError, match="every_k_schedule"):
        optim.MultiSteps(optim.sgd(0.1), 2.5)
    with pytest.raises(TypeError, match="GradientTransformation"):
        optim.MultiSteps(0.1, 2)
    with pytest.raises(ValueError, match="accumulator_dtype=.*float32, bfloat16 or float16"):
        optim.MultiSteps(optim.sgd(0.1), 2, accumulator_dtype=np.int32)
    p = _params()
    ms = optim.MultiSteps(optim.sgd(0.1), lambda s: 0)
    with pytest.raises(ValueError, match=r"every_k_schedule\(0\) = 0"):
        ms.update(p, ms.init(p), p)
    bad = optim.MultiSteps(optim.sgd(0.1), 2,
                           should_skip_update_fn=lambda u, s, p: (np.float32(0), ()))
    with pytest.raises(ValueError, match="boolean scalar"):
        bad.update(p, bad.init(p), p)
    with pytest.raises(TypeError, match="MultiStepsState"):
        optim.MultiSteps(optim.sgd(0.1), 2).update(p, optim.sgd(0.1).init(p), p)


def test_skip_large_updates_drops_the_mini_step():
    import functools
    p = {"w": np.zeros(3, np.float32)}
    ms = optim.MultiSteps(optim.sgd(1.0), 2, should_skip_update_fn=functools.partial(
        optim.skip_large_updates, max_squared_norm=100.0))
    st = ms.init(p)
    assert set(st.skip_state) == {"should_skip", "norm_squared"}
    u, st = ms.update({"w": np.full(3, 100.0, np.float32)}, st, p)   # norm^2 3e4: skipped
    assert bool(st.skip_state["should_skip"]) and int(np.asarray(st.mini_step)) == 0
    u, st = ms.update({"w": np.ones(3, np.float32)}, st, p)
    u, st = ms.update({"w": np.full(3, 3.0, np.float32)}, st, p)
    assert np.asarray(u["w"]).tolist() == [-2.0, -2.0, -2.0]


def test_counter_host_copy_is_the_value_the_device_holds():
    # optim.base.scalar keeps a host copy of a counter so reading it needs no device read;
    # device_put narrows int64 / float64, and the copy must be what the device holds.
    from ctrainstate.optim.base import read_scalar, scalar
    for value, dtype in [(0.1, np.float64), (2**31 + 5, np.int64), (7, np.int64),
                         (-3, np.int32), (1.5, np.float32), (True, np.bool_)]:
        a = scalar(value, dtype)
        want = np.asarray(a).item()
        got = read_scalar(a)
        assert a._host_scalar is not None
        assert type(got) is type(want) and got == want, (value, dtype, got, want)


# --- reductions inside masks: a global norm or finite gate covers its own leaves only -------


def _clip_partition(max_norm):
    return optim.partition({"train": optim.chain(optim.clip_by_global_norm(max_norm),
                                                 optim.sgd(1.0)),
                            "frozen": optim.set_to_zero()},
                           {"embed": "frozen", "body": "train"})


@pytest.mark.parametrize("body_g, want", [
    ([0.6, 0.0], [-0.6, 0.0]),        # norm 0.6 <= 1: not clipped
    ([3.0, 4.0], [-0.6, -0.8]),       # norm 5: scaled to norm 1
])
@pytest.mark.parametrize("embed_g", [[100.0, 0.0], [np.nan, np.inf]])
def test_global_norm_in_a_partition_ignores_the_other_partitions(body_g, want, embed_g):
    """optax computes clip_by_global_norm's norm over the updates its partition sees: a large
    or non-finite gradient of a frozen leaf must not shrink (or poison) the trained ones."""
    p = {"embed": np.zeros(2, np.float32), "body": np.zeros(2, np.float32)}
    g = {"embed": np.array(embed_g, np.float32), "body": np.array(body_g, np.float32)}
    for tx in (_clip_partition(1.0),
               optim.masked(optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(1.0)),
                            {"embed": False, "body": True})):
        s = TrainState.create(apply_fn=None, params=p, tx=tx)
        s = s.apply_gradients(grads=g)
        np.testing.assert_allclose(np.asarray(s.params["body"]), want, rtol=1e-6)
        u, _ = tx.update(g, tx.init(p), p)   # the functional path too
        np.testing.assert_allclose(np.asarray(u["body"]), want, rtol=1e-6)


def test_global_norm_in_a_partition_on_a_mesh():
    """The same with sharded and replicated leaves: each global element of the partition's
    leaves counts once, the other partition's not at all."""
    cpu = cts.devices("cpu")
    if len(cpu) < 4:
        pytest.skip("needs 4 CPU devices")
    mesh = cts.Mesh(np.array(cpu[:4], dtype=object).reshape(2, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    p = {"embed": np.zeros((8, 6), np.float32), "body": np.zeros((4, 8), np.float32),
         "head": np.zeros(8, np.float32)}
    g = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in p.items()}
    g["embed"] *= 1e3
    specs = {"embed": cts.P("data", None), "body": cts.P(None, "model"), "head": cts.P()}
    tx = optim.partition({"train": optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(1.0)),
                          "frozen": optim.set_to_zero()},
                         {"embed": "frozen", "body": "train", "head": "train"})
    ps = {k: cts.device_put(v, cts.NamedSharding(mesh, specs[k])) for k, v in p.items()}
    s = TrainState.create(apply_fn=None, params=ps, tx=tx)
    s = s.apply_gradients(grads=g)
    norm = np.sqrt(sum(float(np.sum(g[k].astype(np.float64) ** 2)) for k in ("body", "head")))
    assert norm > 1.0
    for k in ("body", "head"):
        np.testing.assert_allclose(np.asarray(s.params[k]), -g[k] / norm, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(s.params["embed"]), p["embed"])


def test_apply_if_finite_in_a_partition_checks_its_own_leaves():
    """A NaN in a frozen leaf's gradient does not reject the trained partition's step."""
    p = {"embed": np.zeros(2, np.float32), "body": np.zeros(2, np.float32)}
    g = {"embed": np.array([np.nan, 1.0], np.float32), "body": np.array([1.0, 2.0], np.float32)}
    tx = optim.partition({"train": optim.apply_if_finite(optim.sgd(0.1), 3),
                          "frozen": optim.set_to_zero()},
                         {"embed": "frozen", "body": "train"})
    s = TrainState.create(apply_fn=None, params=p, tx=tx)
    s = s.apply_gradients(grads=g)
    np.testing.assert_allclose(np.asarray(s.params["body"]), [-0.1, -0.2], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(s.params["embed"]), [0.0, 0.0])
    gate = s.opt_state.inner_states["train"].inner_state
    assert int(gate.notfinite_count) == 0 and bool(gate.last_finite)


def test_apply_if_finite_in_a_mask_passes_the_other_leaves_through():
    """masked(apply_if_finite(...)): a NaN outside the mask is not counted; when the gate
    rejects (a NaN inside), only the leaves inside get zero updates, the others pass through
    unchanged (optax.masked)."""
    p = {"w": np.zeros(2, np.float32), "v": np.zeros(2, np.float32)}
    tx = optim.masked(optim.apply_if_finite(optim.sgd(0.1), 3), {"w": True, "v": False})
    g = {"w": np.array([1.0, 2.0], np.float32), "v": np.array([np.nan, 3.0], np.float32)}
    u, st = tx.update(g, tx.init(p), p)
    np.testing.assert_allclose(np.asarray(u["w"]), [-0.1, -0.2], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(u["v"]), g["v"])
    assert int(st.inner_state.notfinite_count) == 0
    g = {"w": np.array([np.inf, 2.0], np.float32), "v": np.array([5.0, 3.0], np.float32)}
    u, st = tx.update(g, tx.init(p), p)
    np.testing.assert_array_equal(np.asarray(u["w"]), [0.0, 0.0])
    np.testing.assert_array_equal(np.asarray(u["v"]), g["v"])
    assert int(st.inner_state.notfinite_count) == 1


def test_reductions_in_masks_match_optax(jax_ref):
    rng = np.random.default_rng(4)
    p = {"embed": rng.standard_normal((3, 5)).astype(np.float32),
         "body": rng.standard_normal((4,)).astype(np.float32)}
    labels = {"embed": "frozen", "body": "train"}
    grads = []
    for step in range(4):
        g = {k: (rng.standard_normal(v.shape) * 3).astype(np.float32) for k, v in p.items()}
        if step == 1:
            g["embed"][0, 0] = np.nan      # outside the gate's partition
        grads.append(g)

    def make(o):
        return o.multi_transform(
            {"train": o.chain(o.clip_by_global_norm(0.5), o.apply_if_finite(o.adam(0.1), 2)),
             "frozen": o.set_to_zero()}, labels)

    def theirs(jax):
        jnp = jax.numpy
        ref = make(pytest.importorskip("optax"))
        s_ref = ref.init({k: jnp.asarray(v) for k, v in p.items()})
        out = []
        for g in grads:
            u2, s_ref = ref.update({k: jnp.asarray(v) for k, v in g.items()}, s_ref,
                                   {k: jnp.asarray(v) for k, v in p.items()})
            out.append(dict(u2))
        return out

    ours = make(optim)
    s_ours = ours.init(p)
    for step, (g, u2) in enumerate(zip(grads, jax_ref("updates", theirs), strict=True)):
        u1, s_ours = ours.update(g, s_ours, p)
        for k in p:
            np.testing.assert_allclose(np.asarray(u1[k]), np.asarray(u2[k]), rtol=1e-5,
                                       atol=1e-7, err_msg=f"step {step} {k}")


@pytest.mark.parametrize("bad", ["0.1", b"1", [0.1], (0.1,), np.array([0.1, 0.2])])
def test_a_learning_rate_that_is_not_a_number_is_refused_when_built(bad):
    """A string used to pass (-1 * '0.1' is '') and fail at the first step with "could not
    convert string to float: ''"."""
    with pytest.raises(TypeError, match="learning_rate must be a number or a schedule"):
        optim.adam(bad)
    with pytest.raises(TypeError, match="step_size must be a number"):
        optim.scale(bad)


def test_learning_rates_given_as_numpy_or_array_scalars_still_work():
    p = {"w": np.ones(2, np.float32)}
    for lr in (np.float32(0.5), np.array(0.5), cts.device_put(np.float32(0.5)), 0.5):
        tx = optim.sgd(lr)
        u, _ = tx.update(p, tx.init(p), p)
        np.testing.assert_array_equal(np.asarray(u["w"]), [-0.5, -0.5])


def test_scale_refuses_none_and_containers():
    for bad in (None, {}, {"a": 1.0}):
        with pytest.raises(TypeError, match="step_size must be a number"):
            optim.scale(bad)


def test_masked_with_a_mask_function_works_under_tree_map_params():
    """tree_map_params calls init on a placeholder: a mask function cannot be applied to it
    (optax passes it through unmasked); the params-shaped trees of the state are found and
    mapped, the masked-out leaves stay MaskedNode()."""
    p = _params()
    tx = optim.masked(optim.adam(0.1), lambda params: {
        "enc": {"w": True, "b": params["enc"]["b"].ndim > 1}, "head": True})
    state = tx.init(p)
    out = optim.tree_map_params(tx, lambda x: np.shape(x), state,
                                transform_non_params=lambda v: "count")
    inner = out.inner_state[0]
    assert inner.count == "count"
    assert inner.mu == {"enc": {"w": (4, 8), "b": optim.MaskedNode()}, "head": (8, 2)}
    assert inner.nu == inner.mu
    tx2 = optim.chain(optim.clip_by_global_norm(1.0),
                      optim.adamw(0.1, mask=lambda params: tree_map(lambda x: True, params)))
    out = optim.tree_map_params(tx2, lambda x: "P", tx2.init(p))
    assert tree_leaves(out[1][0].mu) == ["P"] * 3


class _CallableTree(dict):
    """A pytree container that is also callable (as some model-state classes are): used as
    a mask, optax's rule takes it as a mask tree (its leaves are bools, not functions) and
    never calls it."""

    def __call__(self, params):
        raise AssertionError("a callable mask tree was called as a mask function")


def _register_callable_tree():
    from ctrainstate.tree_util import register_pytree_node
    register_pytree_node(_CallableTree, lambda m: (list(m.values()), list(m.keys())),
                         lambda keys, values: _CallableTree(zip(keys, values)))


_register_callable_tree()


def test_callable_pytree_mask_is_a_mask_tree_not_a_function():
    p = _CallableTree(a=np.ones(2, np.float32), b=np.ones(2, np.float32))
    g = _CallableTree(a=np.full(2, 2.0, np.float32), b=np.full(2, 2.0, np.float32))
    mask = _CallableTree(a=True, b=False)
    for tx in (optim.masked(optim.scale(-1.0), mask),                      # fused
               optim.masked(optim.scale_by_adadelta(), mask)):             # not fused
        u, _ = tx.update(g, tx.init(p), p)
        assert not np.allclose(np.asarray(u["a"]), 2.0)
        np.testing.assert_array_equal(np.asarray(u["b"]), 2.0)


# --- optax-parity regressions of chain, masked and apply_if_finite (found probing ctrainstate.optim
# against optax 0.2.8): each compared with live optax (`parity`) or with values derived by hand.

def _short_chain():
    p = {"b": np.ones(3, np.float32)}
    return optim.chain(optim.sgd(1.0), optim.clip(1.0)), p, {"b": np.full(3, 5.0, np.float32)}


def test_chain_refuses_a_state_with_missing_entries():
    # optax.chain raises ValueError("The number of updates and states has to be the same in
    # chain! ..."); the fused chain zipped transforms with state entries and silently dropped
    # the clip (update -5 instead of -1)
    tx, p, g = _short_chain()
    st = tx.init(p)
    u, _ = tx.update(g, st, p)
    np.testing.assert_array_equal(np.asarray(u["b"]), [-1.0] * 3)   # sgd(1) then clip(1)
    for bad in (st[:1], st + (optim.EmptyState(),), ()):
        with pytest.raises(ValueError, match="number of updates and states"):
            tx.update(g, bad, p)
    # the unfused chain (a user transform inside) too
    tx2 = optim.chain(optim.stateless(lambda u, p: u), optim.clip(1.0))
    with pytest.raises(ValueError, match="number of updates and states"):
        tx2.update(g, tx2.init(p)[:1], p)


def test_chain_short_state_in_train_state_leaves_it_untouched():
    tx, p, g = _short_chain()
    ts = TrainState.create(apply_fn=None, params=p, tx=tx)
    bad = ts.replace(opt_state=ts.opt_state[:1])
    with pytest.raises(ValueError, match="number of updates and states"):
        bad.apply_gradients(grads=g)
    # nothing was donated or written: the same state still steps
    np.testing.assert_array_equal(np.asarray(bad.params["b"]), [1.0] * 3)
    ts = ts.apply_gradients(grads=g)
    np.testing.assert_array_equal(np.asarray(ts.params["b"]), [0.0] * 3)


def _optax_short_state_error(jax):
    import optax
    tx = optax.chain(optax.sgd(1.0), optax.clip(1.0))
    p = {"b": jax.numpy.ones(3)}
    try:
        tx.update(p, tx.init(p)[:1], p)
    except Exception as e:   # noqa: BLE001 - its type and message are compared
        return [type(e).__name__, str(e)]
    return None


def test_chain_short_state_raises_as_optax(jax_ref):
    etype, msg = jax_ref("optax's error", _optax_short_state_error)
    assert etype == "ValueError" and "number of updates and states" in msg
    tx = optim.chain(optim.sgd(1.0), optim.clip(1.0))
    p = {"b": np.ones(3, np.float32)}
    with pytest.raises(ValueError, match="number of updates and states"):
        tx.update(p, tx.init(p)[:1], p)


def _aif_inject(lib):
    return lib.apply_if_finite(lib.inject_hyperparams(lib.sgd)(
        learning_rate=lib.linear_schedule(0.4, 0.0, 4), momentum=0.5), 3)


@pytest.mark.parametrize("in_place", [False, True])
def test_rejected_step_keeps_injected_hyperparams(in_place):
    # optax's apply_if_finite keeps the whole inner state on a rejected step. The fused
    # inject_hyperparams wrote this step's schedule value (0.3 = linear 0.4 -> 0 at count 1)
    # into hyperparams although its counts did not advance. By hand: step 0 stores lr(0)=0.4,
    # the rejected step 1 keeps 0.4 (counts 1), step 2 stores lr(1) = 0.3 (counts 2).
    p = {"w": np.ones(2, np.float32)}
    good = {"w": np.ones(2, np.float32)}
    bad = {"w": np.array([np.nan, 1.0], np.float32)}
    tx = _aif_inject(optim)
    if in_place:
        ts = TrainState.create(apply_fn=None, params=p, tx=tx)
        seen = []
        for g in (good, bad, good):
            ts = ts.apply_gradients(grads=g)
            inj = ts.opt_state.inner_state
            seen.append((float(np.asarray(inj.hyperparams["learning_rate"])),
                         int(np.asarray(inj.count)),
                         int(np.asarray(inj.hyperparams_states["learning_rate"].count))))
    else:
        st, seen = tx.init(p), []
        for g in (good, bad, good):
            _, st = tx.update(g, st, p)
            inj = st.inner_state
            seen.append((float(np.asarray(inj.hyperparams["learning_rate"])),
                         int(np.asarray(inj.count)),
                         int(np.asarray(inj.hyperparams_states["learning_rate"].count))))
    np.testing.assert_allclose([s[0] for s in seen], [0.4, 0.4, 0.3], rtol=1e-6)
    assert [s[1:] for s in seen] == [(1, 1), (1, 1), (2, 2)]


def _optax_aif_steps(jax, p, gs):
    """optax's state leaves and params after each step."""
    optax = __import__("optax")
    txo = _aif_inject(optax)
    pj = jax.tree.map(jax.numpy.asarray, p)
    so = txo.init(pj)
    out = []
    for g in gs:
        uo, so = txo.update(jax.tree.map(jax.numpy.asarray, g), so, pj)
        pj = optax.apply_updates(pj, uo)
        out.append((jax.tree.leaves(so), pj["w"]))
    return out


def test_rejected_step_keeps_injected_hyperparams_as_optax(jax_ref):
    rng = np.random.default_rng(4)
    p = {"w": rng.standard_normal(3).astype(np.float32)}
    gs = [{"w": rng.standard_normal(3).astype(np.float32)} for _ in range(6)]
    for i in (1, 3, 4):
        gs[i]["w"][0] = np.nan
    ts = TrainState.create(apply_fn=None, params=p, tx=_aif_inject(optim))
    for g, (state, w) in zip(gs, jax_ref("steps", lambda jax: _optax_aif_steps(jax, p, gs)),
                             strict=True):
        ts = ts.apply_gradients(grads=g)
        leaves = tree_leaves(ts.opt_state)
        assert len(leaves) == len(state)
        for a, b in zip(state, leaves):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, equal_nan=True)
        np.testing.assert_allclose(np.asarray(ts.params["w"]), w, rtol=1e-6)


def test_masked_accepts_optax_keyword():
    # optax.masked(inner, mask, *, mask_compatible_extra_args=False): an optax script passing
    # it got a TypeError (partition already accepted the same keyword). Same result either
    # way; by hand: sgd(0.5) on the masked leaf, the other passes through unchanged.
    p = {"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}
    for flag in (False, True):
        tx = optim.masked(optim.sgd(0.5), {"a": True, "b": False},
                          mask_compatible_extra_args=flag)
        u, _ = tx.update(p, tx.init(p), p)
        assert np.asarray(u["a"]).tolist() == [-0.5, -0.5]
        assert np.asarray(u["b"]).tolist() == [1.0, 1.0]
