"""Transforms of optim/transforms.py: scale_by_lion's modes (optax 0.2.8's signature)."""
import inspect

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.optim as optim
from ctrainstate.train_state import TrainState

try:
    import jax.numpy as jnp
    import optax
    HAVE_OPTAX = True
except Exception:   # pragma: no cover - the file runs without jax
    HAVE_OPTAX = False

GRADS = [np.array([0.5, -3.0, 2.0, 0.0, 1e-3], np.float32),
         np.array([-0.25, 4.0, 2.0, -1.0, 0.2], np.float32),
         np.array([0.75, 0.1, -2.0, 1.5, -0.3], np.float32)]


def _lion_ref(mode, b1=0.9, b2=0.99, smooth_beta=1.0):
    """optax.scale_by_lion's update in float64."""
    mu = np.zeros(5)
    out = []
    for g in GRADS:
        x = (1 - b1) * g + b1 * mu
        out.append({"hard": np.sign(x), "smooth": np.tanh(smooth_beta * x),
                    "refined": np.where(np.abs(x) < 1.0, x, np.sign(x))}[mode])
        mu = (1 - b2) * g + b2 * mu
    return out, mu


@pytest.mark.parametrize("mode, beta", [("hard", 1.0), ("smooth", 1.0), ("smooth", 3.0),
                                        ("refined", 1.0)])
def test_scale_by_lion_modes(mode, beta):
    tx = optim.scale_by_lion(b1=0.8, b2=0.9, mode=mode, smooth_beta=beta)
    state = tx.init({"w": np.zeros(5, np.float32)})
    want, mu = _lion_ref(mode, 0.8, 0.9, beta)
    for g, w in zip(GRADS, want):
        u, state = tx.update({"w": g}, state)
        np.testing.assert_allclose(np.asarray(u["w"]), w, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(state.mu["w"]), mu, rtol=2e-6)
    assert int(np.asarray(state.count)) == 3
    assert tx.fusable == (mode == "hard")


def test_scale_by_lion_modes_in_a_train_state():
    for mode in ("hard", "smooth", "refined"):
        tx = optim.chain(optim.scale_by_lion(mode=mode), optim.scale(-0.1))
        s = TrainState.create(apply_fn=None, params={"w": np.zeros(5, np.float32)}, tx=tx)
        for g in GRADS:
            s = s.apply_gradients(grads={"w": g})
        want, _ = _lion_ref(mode)
        np.testing.assert_allclose(np.asarray(s.params["w"]), -0.1 * np.sum(want, axis=0),
                                   rtol=1e-5, atol=1e-6)


def test_scale_by_lion_unknown_mode_is_refused_when_built():
    with pytest.raises(ValueError, match=r'Unknown lion mode: soft. It needs to be one of '
                                         r'\["hard", "smooth", "refined"\]'):
        optim.scale_by_lion(mode="soft")
    with pytest.raises(TypeError, match="smooth_beta"):
        optim.scale_by_lion(mode="smooth", smooth_beta="x")


def _params(f):
    """A signature's parameters as JSON-able [name, default, kind]."""
    return [[p.name, None if p.default is inspect.Parameter.empty else p.default, int(p.kind)]
            for p in inspect.signature(f).parameters.values()]


def _optax_lion(mode):
    b = optax.scale_by_lion(mode=mode, smooth_beta=2.0)
    sb = b.init({"w": jnp.zeros(5, jnp.float32)})
    updates = []
    for g in GRADS:
        ub, sb = b.update({"w": jnp.asarray(g)}, sb)
        updates.append(ub["w"])
    return {"updates": updates, "mu": sb.mu["w"]}


def test_scale_by_lion_signature_and_modes_match_optax(jax_ref):
    assert _params(optim.scale_by_lion) == jax_ref(
        "signature", lambda jax: _params(optax.scale_by_lion))
    for mode in ("hard", "smooth", "refined"):
        a = optim.scale_by_lion(mode=mode, smooth_beta=2.0)
        theirs = jax_ref(mode, lambda jax: _optax_lion(mode))
        sa = a.init({"w": cts.device_put(np.zeros(5, np.float32))})
        for g, ub in zip(GRADS, theirs["updates"], strict=True):
            ua, sa = a.update({"w": g}, sa)
            np.testing.assert_allclose(np.asarray(ua["w"]), ub, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(sa.mu["w"]), theirs["mu"], rtol=1e-6)


# --- optax-parity regressions of the transforms (found probing ctrainstate.optim against optax
# 0.2.8)

def test_block_rms_clip_and_param_scale_propagate_nan_to_the_leaf():
    # optax: u / jnp.maximum(1, rms(u) / threshold) and u * jnp.maximum(rms(p), min_scale);
    # jnp.maximum(x, NaN) is NaN, so one NaN element makes the whole leaf NaN. The kernel's
    # `q > 1 ? q : 1` dropped the NaN: the other elements came back finite. The other leaf
    # is untouched (by hand: rms([3, 4]) = sqrt(12.5) / threshold 1 -> u / 3.5355).
    p = {"a": np.ones(4, np.float32), "b": np.ones(2, np.float32)}
    g = {"a": np.array([1.0, np.nan, 2.0, 3.0], np.float32), "b": np.array([3.0, 4.0], np.float32)}
    tx = optim.chain(optim.clip_by_block_rms(1.0), optim.scale(-1.0))
    u, _ = tx.update(g, tx.init(p), p)
    assert np.isnan(np.asarray(u["a"])).all()
    np.testing.assert_allclose(np.asarray(u["b"]), -np.array([3.0, 4.0]) / np.sqrt(12.5), rtol=1e-6)
    pn = {"a": np.array([1.0, np.nan, 1.0, 1.0], np.float32), "b": np.full(2, 2.0, np.float32)}
    tx = optim.chain(optim.scale_by_param_block_rms(1e-3), optim.scale(-1.0))
    gg = {"a": np.ones(4, np.float32), "b": np.ones(2, np.float32)}
    u, _ = tx.update(gg, tx.init(pn), pn)
    assert np.isnan(np.asarray(u["a"])).all()
    np.testing.assert_allclose(np.asarray(u["b"]), [-2.0, -2.0], rtol=1e-6)   # rms(p) = 2
    # in place (TrainState), the same kernel: adafactor's clip makes the leaf NaN
    ts = TrainState.create(apply_fn=None, params=p, tx=optim.adafactor(0.1))
    ts = ts.apply_gradients(grads=g)
    assert np.isnan(np.asarray(ts.params["a"])).all()
    assert np.isfinite(np.asarray(ts.params["b"])).all()


# --- optax's small transforms added to ctrainstate.optim (zero_nans, lookahead, tree_map_params,
# safe_norm ...): each stepped against optax on the same grads (functional and through TrainState),
# recorded and live (`jax_ref`), sharded against one device, errors

try:
    import jax
    import jax.numpy as jnp
    import optax
    HAVE_JAX = True
except Exception:   # pragma: no cover - the file runs without jax
    HAVE_JAX = False


f32 = np.float32


_rng = np.random.default_rng(0)
X = (_rng.normal(size=(8, 6)) * 3).astype(f32)              # logits / predictions / scores
Y = _rng.normal(size=(8, 6)).astype(f32)                    # targets
B = (_rng.random((8, 6)) > 0.5).astype(f32)                 # binary labels
PM = np.where(_rng.random((8, 6)) > 0.5, 1, -1).astype(f32)  # +-1 targets
LAB = _rng.integers(0, 6, size=8)


P0 = {"a": np.abs(_rng.normal(size=(4, 3))).astype(f32) * 0.1,
      "b": {"c": _rng.normal(size=(5,)).astype(f32), "d": _rng.normal(size=(2, 2, 2)).astype(f32)}}
STEPS = 5


def _grads(i):
    r = np.random.default_rng(100 + i)
    g = cts.tree_util.tree_map(lambda p: r.normal(size=p.shape).astype(f32), P0)
    if i == 2:
        g["b"]["c"][1] = np.nan   # a NaN grad (zero_nans, and NaN propagation elsewhere)
    return g


def _np(tree):
    return cts.tree_util.tree_map(lambda x: np.asarray(x, f32), tree)


def _run_ours(tx, steps=STEPS, params=None, grads=_grads):
    params = cts.device_put(P0) if params is None else params
    state = tx.init(params)
    for i in range(steps):
        u, state = tx.update(grads(i), state, params)
        params = optim.apply_updates(params, u)
    return _np(params), state


def _run_optax(tx, steps=STEPS, params=None, grads=_grads):
    params = jax.tree.map(jnp.asarray, P0) if params is None else params
    state = tx.init(params)
    for i in range(steps):
        u, state = tx.update(jax.tree.map(jnp.asarray, grads(i)), state, params)
        params = optax.apply_updates(params, u)
    return _np(params), state


def _close(a, lb, rtol=1e-5):
    """ours (a tree) against optax's leaves (recorded, or jax.tree.leaves of its tree)."""
    la = cts.tree_util.tree_leaves(a)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        y = np.asarray(y, f32)
        # optax's relative bound (tests/optim/test_optim_parity.py): single float32 roundings of
        # the fused kernel and XLA differ, adam's steps scale them up to ~1e-6 of the leaf
        scale = np.nanmax(np.abs(y)) if y.size and np.isfinite(y).any() else 1.0
        np.testing.assert_allclose(np.asarray(x, f32), y, rtol=rtol, atol=rtol * max(scale, 0.1))


def _fields(state):
    """The state's NamedTuple names and fields, recursively (tuples of states included)."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return (type(state).__name__, tuple((f, _fields(getattr(state, f)))
                                            for f in state._fields))
    if isinstance(state, tuple):
        return tuple(_fields(s) for s in state)
    return None


TX_CASES = {
    "zero_nans": lambda o: o.chain(o.zero_nans(), o.sgd(0.1)),
    "apply_every": lambda o: o.chain(o.apply_every(2), o.sgd(0.1)),
    "apply_every3": lambda o: o.chain(o.zero_nans(), o.apply_every(3), o.adam(0.1)),
    "keep_params_nonnegative": lambda o: o.chain(o.zero_nans(), o.sgd(0.3),
                                                  o.keep_params_nonnegative()),
    "centralize": lambda o: o.chain(o.zero_nans(), o.centralize(), o.sgd(0.1)),
    "scale_by_sign": lambda o: o.chain(o.scale_by_sign(), o.scale(-0.01)),
    "sign_sgd": lambda o: o.sign_sgd(0.01),
    "signum": lambda o: o.chain(o.zero_nans(), o.signum(0.01, beta=0.8)),
    "nadam": lambda o: o.chain(o.zero_nans(), o.nadam(0.01)),
    "nadamw": lambda o: o.chain(o.zero_nans(), o.nadamw(0.01, weight_decay=0.1)),
    "adamaxw": lambda o: o.chain(o.zero_nans(), o.adamaxw(0.01, weight_decay=0.1)),
    "conditionally_mask": lambda o: o.chain(o.zero_nans(), o.conditionally_mask(
        o.adam(0.1), lambda step: step % 2 == 1)),
    "conditionally_mask_unfused": lambda o: o.conditionally_mask(
        o.chain(o.zero_nans(), o.sgd(0.1)), lambda step: step >= 2),
    "with_extra_args_support": lambda o: o.with_extra_args_support(
        o.chain(o.zero_nans(), o.adamw(0.01))),
}


def _optax_result(params, state):
    """optax's params and state as recorded: leaves, and the state's structure (_fields)."""
    return {"params": jax.tree.leaves(params), "fields": _fields(state),
            "state": jax.tree.leaves(state)}


@pytest.mark.parametrize("name", sorted(TX_CASES))
def test_transform_steps_match_optax(name, jax_ref):
    ours_p, ours_s = _run_ours(TX_CASES[name](optim))
    theirs = jax_ref("steps", lambda jax: _optax_result(*_run_optax(TX_CASES[name](optax))))
    _close(ours_p, theirs["params"])
    assert _fields(ours_s) == theirs["fields"]
    _close(ours_s, theirs["state"])


@pytest.mark.parametrize("name", sorted(TX_CASES))
def test_transform_train_state_equals_functional(name):
    tx = TX_CASES[name](optim)
    want, _ = _run_ours(tx)
    ts = TrainState.create(apply_fn=None, params=cts.device_put(P0), tx=tx)
    for i in range(STEPS):
        ts = ts.apply_gradients(grads=_grads(i))
    _close_np(_np(ts.params), want)


def _close_np(a, b):
    for x, y in zip(cts.tree_util.tree_leaves(a), cts.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_transforms_without_jax_hand_computed():
    # apply_every(2): zeros, then the sum of two steps' grads
    tx = optim.apply_every(2)
    p = {"w": np.zeros(2, f32)}
    st = tx.init(p)
    assert type(st).__name__ == "ApplyEvery" and st._fields == ("count", "grad_acc")
    u1, st = tx.update({"w": np.array([1., 2.], f32)}, st, p)
    u2, st = tx.update({"w": np.array([3., 5.], f32)}, st, p)
    u3, st = tx.update({"w": np.array([1., 1.], f32)}, st, p)
    assert np.asarray(u1["w"]).tolist() == [0, 0] and np.asarray(u2["w"]).tolist() == [4, 7]
    assert np.asarray(u3["w"]).tolist() == [0, 0] and int(np.asarray(st.count)) == 1
    # keep_params_nonnegative: p + u < 0 -> -p
    u, _ = optim.keep_params_nonnegative().update(
        {"w": np.array([-2., 1., -0.5], f32)}, optim.EmptyState(), {"w": np.array([1., 0., 1.], f32)})
    assert np.asarray(u["w"]).tolist() == [-1., 1., -0.5]
    # centralize: rows minus their mean; vectors unchanged
    g = np.arange(6, dtype=f32).reshape(2, 3)
    u, _ = optim.centralize().update({"m": g, "v": g[0]}, optim.EmptyState())
    np.testing.assert_array_equal(np.asarray(u["m"]), g - g.mean(1, keepdims=True))
    np.testing.assert_array_equal(np.asarray(u["v"]), g[0])
    # sign and zero_nans
    u, st = optim.zero_nans().update({"w": np.array([np.nan, -np.inf, 2.], f32)},
                                     optim.zero_nans().init({"w": np.zeros(3, f32)}))
    assert np.asarray(u["w"]).tolist() == [0., -np.inf, 2.] and bool(np.asarray(st.found_nan["w"]))
    u, _ = optim.scale_by_sign().update({"w": np.array([-3., 0., 0.5, np.nan], f32)}, None)
    out = np.asarray(u["w"])
    assert out[:3].tolist() == [-1., 0., 1.] and np.isnan(out[3])


def test_zero_nans_state_per_leaf():
    tx = optim.zero_nans()
    st = tx.init(cts.device_put(P0))
    assert type(st).__name__ == "ZeroNansState" and st._fields == ("found_nan",)
    assert cts.tree_util.tree_structure(st.found_nan) == cts.tree_util.tree_structure(P0)
    _, st = tx.update(_grads(2), st)
    assert [bool(np.asarray(x)) for x in cts.tree_util.tree_leaves(st.found_nan)] == [False, True, False]


def test_sharded_transforms_equal_one_device():
    mesh = cts.make_mesh((2, 4), ("i", "j"))
    specs = {"a": cts.P("j", None), "b": {"c": cts.P(), "d": cts.P("i", None, None)}}
    placed = cts.tree_util.tree_map(lambda x, s: cts.device_put(x, cts.NamedSharding(mesh, s)),
                                    P0, specs, is_leaf=lambda x: isinstance(x, cts.PartitionSpec))
    for name in ("centralize", "signum", "conditionally_mask", "keep_params_nonnegative"):
        tx = TX_CASES[name](optim)
        want, _ = _run_ours(tx)
        got, _ = _run_ours(tx, params=cts.tree_util.tree_map(lambda x: x, placed))
        _close_np(got, want)


def _optax_lookahead(reset):
    """optax's lookahead: the state's structure, then each step's params and state leaves."""
    theirs_tx = optax.lookahead(optax.adam(0.1), sync_period=2, slow_step_size=0.5,
                                reset_state=reset)
    q = optax.LookaheadParams.init_synced({"a": jnp.asarray(P0["a"])})
    t = theirs_tx.init(q)
    out = {"fields": _fields(t), "steps": []}
    for i in range(STEPS):
        v, t = theirs_tx.update({"a": jnp.asarray(_grads(i)["a"])}, t, q)
        q = optax.apply_updates(q, v)
        out["steps"].append((jax.tree.leaves(q), jax.tree.leaves(t)))
    return out


def test_lookahead_matches_optax(jax_ref):
    for reset in (False, True):
        ours_tx = optim.lookahead(optim.adam(0.1), sync_period=2, slow_step_size=0.5,
                                  reset_state=reset)
        theirs = jax_ref(f"reset={reset}", lambda jax: _optax_lookahead(reset))
        p = optim.LookaheadParams.init_synced(cts.device_put({"a": P0["a"]}))
        s = ours_tx.init(p)
        assert _fields(s) == theirs["fields"]
        for i in range(STEPS):
            g = {"a": _grads(i)["a"]}
            u, s = ours_tx.update(g, s, p)
            p = optim.apply_updates(p, u)
            assert isinstance(p, optim.LookaheadParams)
            q, t = theirs["steps"][i]
            _close(p, q)
            _close(s, t)


def test_lookahead_train_state_and_errors():
    tx = optim.lookahead(optim.sgd(0.5), sync_period=2, slow_step_size=0.5)
    params = optim.LookaheadParams.init_synced({"w": np.ones(2, f32)})
    ts = TrainState.create(apply_fn=None, params=params, tx=tx)
    for _ in range(2):
        ts = ts.apply_gradients(grads={"w": np.ones(2, f32)})
    # fast: 1 - .5 = .5, .5 - .5 = 0; then sync: slow = 1 + .5 * (0 - 1) = .5, fast = slow
    assert np.asarray(ts.params.slow["w"]).tolist() == [0.5, 0.5]
    assert np.asarray(ts.params.fast["w"]).tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="Synchronization period"):
        optim.lookahead(optim.sgd(0.1), sync_period=0, slow_step_size=0.5)
    with pytest.raises(ValueError, match="LookaheadParams"):
        tx.update({"w": np.ones(2, f32)}, tx.init(params), {"w": np.ones(2, f32)})


def test_tree_map_params_matches_optax(jax_ref):
    for i, make in enumerate((lambda o: o.adam(0.1),
                              lambda o: o.chain(o.apply_every(2), o.signum(0.1)),
                              lambda o: o.zero_nans())):
        ours = optim.tree_map_params(make(optim), lambda p, s: ("spec", s), make(optim).init(
            cts.device_put(P0)), {"a": 1, "b": {"c": 2, "d": 3}},
            transform_non_params=lambda v: None)

        def theirs_f(jax):
            t = optax.tree_map_params(make(optax), lambda p, s: ("spec", s), make(optax).init(
                jax.tree.map(jnp.asarray, P0)), {"a": 1, "b": {"c": 2, "d": 3}},
                transform_non_params=lambda v: None)
            return {"fields": _fields(t), "leaves": jax.tree.leaves(t)}

        theirs = jax_ref(i, theirs_f)
        assert _fields(ours) == theirs["fields"]
        assert cts.tree_util.tree_leaves(ours) == theirs["leaves"]


def test_tree_map_params_without_jax():
    st = optim.adam(0.1).init(cts.device_put(P0))
    out = optim.tree_map_params(optim.adam(0.1), lambda p: p.shape, st,
                                transform_non_params=lambda v: "count")
    assert out[0].mu == {"a": (4, 3), "b": {"c": (5,), "d": (2, 2, 2)}}
    assert out[0].count == "count" and out[0].nu == out[0].mu
    with pytest.raises(TypeError, match="initable"):
        optim.tree_map_params(3, lambda p: p, st)


def test_safe_norm_and_rms_match_optax(jax_ref):
    x = np.array([[3., 4.], [0., 0.]], f32)
    for i, args in enumerate([(1.0,), (6.0,), (0.5, None, 1, True)]):
        ours = optim.safe_norm(x, *args)
        theirs, gr = jax_ref(f"safe_norm {i}", lambda jax: (
            optax.safe_norm(jnp.asarray(x), *args),
            jax.grad(lambda a: jnp.sum(optax.safe_norm(a, *args)))(jnp.asarray(x))))
        np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-6)
        g = cts.grad(lambda a: cts.numpy.sum(optim.safe_norm(a, *args)))(cts.device_put(x))
        np.testing.assert_allclose(np.asarray(g), gr, rtol=1e-6, atol=1e-7)
    for i, (m, v) in enumerate(((1.0, x), (5.0, x), (0.0, np.zeros((2, 2), f32)))):
            ours = optim.safe_root_mean_squares(v, m)
            theirs, gr = jax_ref(f"rms {i}", lambda jax: (
                optax.safe_root_mean_squares(jnp.asarray(v), m),
                jax.grad(lambda a: optax.safe_root_mean_squares(a, m))(jnp.asarray(v))))
            np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-6)
            g = cts.grad(lambda a: optim.safe_root_mean_squares(a, m))(cts.device_put(v))
            np.testing.assert_allclose(np.asarray(g), gr, rtol=1e-6, atol=1e-7)


def test_safe_norm_gradient_is_zero_not_nan_below_min():
    g = cts.grad(lambda a: optim.safe_norm(a, 1e-3))(cts.device_put(np.zeros(3, f32)))
    assert np.asarray(g).tolist() == [0., 0., 0.]
    assert float(optim.safe_norm(np.array([3., 4.], f32), 1.0)) == 5.0


def test_transform_errors_and_fusion():
    with pytest.raises(ValueError, match="k >= 1"):
        optim.apply_every(0)
    with pytest.raises(TypeError, match="int"):
        optim.apply_every(2.5)
    with pytest.raises(ValueError, match="params"):
        optim.keep_params_nonnegative().update({"w": np.ones(2, f32)}, optim.EmptyState())
    with pytest.raises(TypeError, match="should_transform_fn"):
        optim.conditionally_mask(optim.sgd(0.1), 3)
    with pytest.raises(ValueError, match="bool scalar"):
        tx = optim.conditionally_mask(optim.sgd(0.1), lambda s: np.ones(2, bool))
        tx.update({"w": np.ones(2, f32)}, tx.init({"w": np.ones(2, f32)}))
    with pytest.raises(TypeError, match="ApplyEvery"):
        optim.apply_every(2).update({"w": np.ones(2, f32)}, optim.EmptyState())
    with pytest.raises(TypeError, match="GradientTransformation"):
        optim.with_extra_args_support(3)
    # fusable inner transforms stay fused; the sign transforms cannot be
    assert optim.conditionally_mask(optim.adam(0.1), lambda s: True).fusable
    assert optim.with_extra_args_support(optim.adam(0.1)).fusable
    assert optim.nadamw(0.1).fusable and optim.adamaxw(0.1).fusable
    assert not optim.sign_sgd(0.1).fusable
    # extra args are ignored by with_extra_args_support, forwarded by conditionally_mask
    p = {"w": np.ones(2, f32)}
    tx = optim.with_extra_args_support(optim.sgd(1.0))
    u, _ = tx.update(p, tx.init(p), p, loss=3.0)
    assert np.asarray(u["w"]).tolist() == [-1., -1.]
    tx = optim.conditionally_mask(optim.sgd(1.0), lambda step, loss: loss > 1.0,
                                  forward_extra_args=True)
    st = tx.init(p)
    u, st = tx.update(p, st, p, loss=0.5)
    assert np.asarray(u["w"]).tolist() == [0., 0.]
    u, st = tx.update(p, st, p, loss=2.0)
    assert np.asarray(u["w"]).tolist() == [-1., -1.] and int(np.asarray(st.step)) == 2


def test_every_new_name_is_exported_and_documented(jax_ref):
    names = ["sigmoid_binary_cross_entropy", "sigmoid_focal_loss", "huber_loss", "log_cosh",
             "hinge_loss", "kl_divergence", "convex_kl_divergence", "cosine_similarity",
             "cosine_distance", "smooth_labels", "safe_softmax_cross_entropy", "ntxent",
             "zero_nans", "ZeroNansState", "apply_every", "ApplyEvery",
             "keep_params_nonnegative", "NonNegativeParamsState", "centralize", "scale_by_sign",
             "sign_sgd", "signum", "nadam", "nadamw", "adamaxw", "tree_map_params", "safe_norm",
             "safe_root_mean_squares", "with_extra_args_support", "conditionally_mask",
             "ConditionallyMaskState", "lookahead", "LookaheadState", "LookaheadParams",
             "generalized_kl_divergence"]
    for n in names:
        assert n in optim.__all__, n
        assert getattr(optim, n).__doc__, n
    losses = ["multiclass_hinge_loss", "perceptron_loss", "multiclass_perceptron_loss",
              "kl_divergence_with_log_targets", "poly_loss_cross_entropy", "triplet_margin_loss"]
    for n in losses:
        assert getattr(optim.losses, n).__doc__, n
    # optax's names, all of them
    assert jax_ref("missing from optax", lambda jax: [n for n in names if not hasattr(optax, n)]
                   + [n for n in losses if not hasattr(optax.losses, n)]) == []


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define, live when installed (those parts skip cleanly otherwise) and derived
# by hand

def _loss_inputs():
    r = np.random.RandomState(0)
    return r.randn(4, 3).astype(np.float32), r.randn(4, 3).astype(np.float32)


def _stateless_chain(o, tmap):
    return o.chain(o.stateless_with_tree_map(lambda g, p: g + 0.01 * p),
                   o.stateless(lambda u, p: tmap(lambda x: x * 0.5, u)),
                   o.sgd(0.1, momentum=0.9))


def test_stateless_transforms_in_train_state(jax_ref):
    from ctrainstate import optim, tree_util
    from ctrainstate.train_state import TrainState
    p, g = _loss_inputs()
    s = TrainState.create(apply_fn=None, params={"w": p}, tx=_stateless_chain(optim, tree_util.tree_map))
    s = s.apply_gradients(grads={"w": g})
    # derived: u = 0.5 * (g + 0.01 p); momentum trace starts at 0, so the first update is -0.1 u
    np.testing.assert_allclose(np.asarray(s.params["w"]), p - 0.1 * 0.5 * (g + 0.01 * p), rtol=1e-6)
    def theirs(jax, optax):
        tx = _stateless_chain(optax, jax.tree_util.tree_map)
        st = tx.init({"w": p})
        return tx.update({"w": g}, st, {"w": p})[0]["w"]

    np.testing.assert_allclose(np.asarray(s.params["w"]), p + jax_ref("optax update", theirs),
                               rtol=1e-6)


def test_adam_scalars_in_c_are_the_python_stage_scalars():
    # _C.adam_scalars (the per-step scalars of a two-moment stage with a constant mode)
    # against the formula written out with numpy float32 scalars: t = min(int(c) + 1,
    # 2**31 - 1), bias corrections 1 - b**t in float32
    from ctrainstate import _C
    f = np.float32
    imax = 2**31 - 1

    def bc(d, t):
        return float(f(1) - f(d) ** f(t))

    for b1, b2, eps, eps_root, mode in ((0.9, 0.999, 1e-8, 0.0, 0.0), (0.5, 0.25, 1e-3, 1e-9, 1.0)):
        for c in (0, 1, 7, 1000, imax - 2, imax - 1, imax, 2**40, np.int32(41), 12.7, -3):
            t = min(int(c) + 1, imax)
            want = [b1, b2, eps, eps_root, bc(b1, t), bc(b2, t), mode, bc(b1, min(t + 1, imax))]
            got = _C.adam_scalars(b1, b2, eps, eps_root, mode, c)
            assert got == want, (c, got, want)
    with pytest.raises(TypeError, match="adam_scalars"):
        _C.adam_scalars(0.9, 0.999, 1e-8, 0.0, 0.0)
    with pytest.raises(ValueError):     # int(c)'s errors, as the Python stage's
        _C.adam_scalars(0.9, 0.999, 1e-8, 0.0, 0.0, "x")
    with pytest.raises(TypeError):
        _C.adam_scalars(0.9, 0.999, 1e-8, 0.0, 0.0, None)
    # the two-moment stages with a constant mode use it (radam's mode follows the step: it
    # keeps the Python function, and its extra stage keeps it off the step plan)
    for tx in (optim.adam(0.1), optim.adamw(0.1), optim.yogi(0.1), optim.adamax(0.1)):
        state = TrainState.create(apply_fn=None, params={"w": np.ones(3, np.float32)}, tx=tx)
        g = cts.device_put({"w": np.full(3, 0.5, np.float32)})
        for _ in range(3):
            state = state.apply_gradients(grads=g)
        fns = [fn for _, fn in state.__dict__["_ct_plan"].fast.scalars if fn is not None]
        assert any(getattr(fn, "func", None) is _C.adam_scalars for fn in fns), tx
