"""Regression tests for optax-parity bugs found by probing ctrainstate.optim against optax
0.2.8 on paths the table-driven parity cases (tests/optim_cases.py) do not reach. Each test
compares with live optax when it is installed (``parity`` marker) or with values derived
by hand, as its comment says."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
import ctrainstate.optim as optim
from ctrainstate.train_state import TrainState
from ctrainstate.tree_util import tree_leaves


def _log_softmax(x, axis):
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


# --- chain: a state with fewer entries than transforms ------------------------------------------

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


# --- integer-label cross entropy: -inf logits of other classes, tuple class axes -----------------

def test_integer_labels_masked_class_gives_a_finite_loss_and_grad():
    # a -inf logit (a masked-out class) that is not the label: the loss is the finite
    # -log_softmax(z)[label] over the other classes (by hand: exp(-inf) = 0), and its
    # gradient softmax - onehot, 0 at the masked class. The label's logit used to be picked
    # by multiplying with the one-hot, so -inf * 0 made the loss and the gradient NaN.
    x = np.array([[0.0, -np.inf, 1.0, 2.0], [0.5, 0.25, -np.inf, -1.0]], np.float32)
    lab = np.array([2, 0])
    fin = np.where(np.isfinite(x), x, -1e30)
    want = -_log_softmax(fin, 1)[[0, 1], lab]
    got = np.asarray(optim.softmax_cross_entropy_with_integer_labels(x, lab))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    g = np.asarray(cts.grad(lambda v: cnp.sum(
        optim.softmax_cross_entropy_with_integer_labels(v, lab)))(cts.device_put(x)))
    want_g = np.exp(_log_softmax(fin, 1)) - np.eye(4, dtype=np.float32)[lab]
    np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-7)
    assert g[0, 1] == 0.0 and g[1, 2] == 0.0


@pytest.mark.parametrize("mesh_shape,names,spec", [((8,), ("x",), (None, "x")),
                                                   ((2, 4), ("data", "model"), ("data", "model"))])
def test_integer_labels_masked_class_on_meshes(mesh_shape, names, spec):
    # the class axis sharded: every shard's one-hot selection must drop the -inf of the others
    rng = np.random.default_rng(11)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    lab = rng.integers(0, 16, 8)
    x[np.arange(8), (lab + 5) % 16] = -np.inf
    fin = np.where(np.isfinite(x), x, -1e30)
    want = -_log_softmax(fin, 1)[np.arange(8), lab]
    a = cts.device_put(x, cts.NamedSharding(cts.make_mesh(mesh_shape, names), cts.P(*spec)))
    got = np.asarray(optim.softmax_cross_entropy_with_integer_labels(a, lab))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_integer_labels_tuple_axis():
    # optax: the class axes (in the order given) are flattened row-major and the label
    # indexes that flat axis. By hand: move the class axes last in that order, reshape.
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    for axis, bshape in (((2, 3), (2, 3)), ((3, 2), (2, 3)), ((-1, 1), (2, 4))):
        cls = [a % 4 for a in axis]
        batch = [d for d in range(4) if d not in cls]
        n = int(np.prod([x.shape[a] for a in cls]))
        lab = rng.integers(0, n, bshape)
        flat = x.transpose(batch + cls).reshape(bshape + (n,))
        want = -np.take_along_axis(_log_softmax(flat, -1), lab[..., None], -1)[..., 0]
        got = np.asarray(optim.softmax_cross_entropy_with_integer_labels(x, lab, axis=axis))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(axis))
    with pytest.raises(ValueError, match=r"\[0, 20\)"):
        optim.softmax_cross_entropy_with_integer_labels(x, np.full((2, 3), 20), axis=(2, 3))
    with pytest.raises(ValueError, match="distinct"):
        optim.softmax_cross_entropy_with_integer_labels(x, np.zeros((2, 3), int), axis=(2, -2))


def test_integer_labels_masked_class_and_tuple_axis_match_optax(jax_ref):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    x[0, 1, 2, 3] = -np.inf
    x[1, 2, 0, 0] = -np.inf
    for axis, lab in (((2, 3), rng.integers(0, 20, (2, 3))), ((3, 2), rng.integers(0, 20, (2, 3))),
                      (-1, rng.integers(0, 5, (2, 3, 4))), (1, rng.integers(0, 3, (2, 4, 5)))):
        want, want_g = jax_ref(str(axis), lambda jax: (
            __import__("optax").softmax_cross_entropy_with_integer_labels(x, lab, axis=axis),
            jax.grad(lambda v: __import__("optax").softmax_cross_entropy_with_integer_labels(
                v, lab, axis=axis).sum())(x)))
        got = np.asarray(optim.softmax_cross_entropy_with_integer_labels(x, lab, axis=axis))
        # the two -inf logits sit in the rows of at most two losses; they are inf only where
        # one is that row's label
        assert np.isfinite(want).sum() >= want.size - 2
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(axis))
        got_g = np.asarray(cts.grad(lambda v: cnp.sum(
            optim.softmax_cross_entropy_with_integer_labels(v, lab, axis=axis)))(cts.device_put(x)))
        np.testing.assert_allclose(got_g, want_g, rtol=1e-5, atol=1e-7, err_msg=str(axis))


# --- regression losses: targets of another shape ------------------------------------------------

@pytest.mark.parametrize("fn", ["squared_error", "l2_loss"])
def test_regression_losses_refuse_broadcasting_targets(fn):
    # optax checks shapes equal (ValueError "Shape mismatch"); broadcasting silently gave a
    # loss of another shape (e.g. (2, 3) predictions against (3,) targets)
    p = np.arange(6, dtype=np.float32).reshape(2, 3)
    f = getattr(optim, fn)
    with pytest.raises(ValueError, match=r"Shape mismatch: got \(2, 3\) and \(3,\)"):
        f(p, np.ones(3, np.float32))
    with pytest.raises(ValueError, match="Shape mismatch"):
        f(p, np.float32(1.0))
    with pytest.raises(ValueError, match="Shape mismatch"):
        getattr(optim.losses, fn)(cts.device_put(p), cts.device_put(np.ones((3, 2), np.float32)))
    scale = 0.5 if fn == "l2_loss" else 1.0
    np.testing.assert_allclose(np.asarray(f(p, np.ones((2, 3), np.float32))), scale * (p - 1) ** 2)


@pytest.mark.parametrize("fn", ["squared_error", "l2_loss"])
def test_regression_losses_shape_check_matches_optax(fn):
    optax = pytest.importorskip("optax")
    p = np.arange(6, dtype=np.float32).reshape(2, 3)
    for t in (np.ones(3, np.float32), np.float32(1.0)):
        with pytest.raises(ValueError, match="Shape mismatch"):
            getattr(optax, fn)(p, t)
        with pytest.raises(ValueError, match="Shape mismatch"):
            getattr(optim, fn)(p, t)


# --- another transformation's state -------------------------------------------------------------

@pytest.mark.parametrize("make_tx,make_other,who", [
    (lambda: optim.adam(0.1), lambda: optim.sgd(0.1, momentum=0.9), "scale_by_adam"),
    (lambda: optim.sgd(0.1, momentum=0.9), lambda: optim.adam(0.1), "trace"),
    (lambda: optim.amsgrad(0.1), lambda: optim.adam(0.1), "scale_by_amsgrad"),
    (lambda: optim.apply_if_finite(optim.adam(0.1), 1), lambda: optim.adam(0.1), "apply_if_finite"),
    (lambda: optim.masked(optim.adam(0.1), {"a": True, "b": False}), lambda: optim.adam(0.1),
     "masked"),
    (lambda: optim.chain(optim.add_decayed_weights(optim.linear_schedule(0.1, 0.0, 3)),
                         optim.scale(-1.0)), lambda: optim.adam(0.1), "add_decayed_weights"),
    (lambda: optim.noisy_sgd(0.1), lambda: optim.adam(0.1), "add_noise"),
])
def test_state_of_another_transformation_is_a_clear_type_error(make_tx, make_other, who):
    # an optimizer swapped while its old state is kept (a checkpoint of another run): optax
    # fails with an AttributeError on a missing field; ctrainstate read `state.count` of a
    # TraceState (tuple.count, a method) and raised "int() argument must be ... not
    # 'builtin_function_or_method'". DESIGN.md: a clear error, naming the transformation.
    p = {"a": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32)}
    g = {"a": np.full((2, 3), 0.5, np.float32), "b": np.full(3, 0.5, np.float32)}
    tx, other = make_tx(), make_other()
    with pytest.raises(TypeError, match=rf"{who}: expected its state .*was the state built by"):
        tx.update(g, other.init(p), p)
    ts = TrainState.create(apply_fn=None, params=p, tx=other)
    before = [np.asarray(x).copy() for x in tree_leaves(ts.opt_state)]
    with pytest.raises(TypeError, match=who):
        ts.replace(tx=tx).apply_gradients(grads=g)
    # nothing donated or written: the old state still steps with its own optimizer
    assert [np.asarray(x).tolist() for x in tree_leaves(ts.opt_state)] == \
        [b.tolist() for b in before]
    ts.apply_gradients(grads=g)


def test_state_with_the_same_fields_is_accepted():
    # a state rebuilt as another NamedTuple class with the same fields (what a checkpoint
    # library may restore) still steps, and gives the same update as the original state
    import collections
    p = {"w": np.ones(3, np.float32)}
    g = {"w": np.array([0.5, -1.0, 2.0], np.float32)}
    tx = optim.adam(0.1)
    st = tx.init(p)
    Same = collections.namedtuple("ScaleByAdamState", ["count", "mu", "nu"])
    u1, _ = tx.update(g, st, p)
    u2, _ = tx.update(g, (Same(*st[0]), st[1]), p)
    np.testing.assert_array_equal(np.asarray(u1["w"]), np.asarray(u2["w"]))
    # adam's first step is -lr * sign(g) (mu_hat / sqrt(nu_hat) = g / |g|, eps aside)
    np.testing.assert_allclose(np.asarray(u1["w"]), [-0.1, 0.1, -0.1], rtol=1e-6)


# --- piecewise_interpolate_schedule: float boundaries -------------------------------------------

def test_piecewise_interpolate_float_boundaries_are_not_truncated():
    # optax stacks the boundaries into an array, so {2.5: 0.5, 6.5: 0.1} interpolates over
    # [0, 2.5) and [2.5, 6.5); they were truncated to 2 and 6. By hand (values 1, 0.5, 0.05):
    # count 1: 1 + (0.5 - 1) * 1/2.5 = 0.8; count 4: 0.5 + (0.05 - 0.5) * 1.5/4 = 0.33125;
    # cosine, count 1: 0.5 + (1 - 0.5) / 2 * (cos(pi * 0.4) + 1)
    lin = optim.piecewise_interpolate_schedule("linear", 1.0, {2.5: 0.5, 6.5: 0.1})
    for c, want in ((0, 1.0), (1, 0.8), (2, 0.6), (2.5, 0.5), (4, 0.33125), (6.5, 0.05), (9, 0.05)):
        np.testing.assert_allclose(float(lin(c)), want, rtol=1e-6, err_msg=str(c))
    cos = optim.piecewise_interpolate_schedule("cosine", 1.0, {2.5: 0.5, 6.5: 0.1})
    np.testing.assert_allclose(float(cos(1)), 0.5 + 0.25 * (np.cos(np.pi * 0.4) + 1), rtol=1e-6)
    # integer boundaries are unchanged: {4: 0.1, 8: 0.01} is optax's docstring example
    s = optim.piecewise_interpolate_schedule("linear", 1.0, {4: 0.1, 8: 0.01})
    np.testing.assert_allclose([float(s(i)) for i in range(0, 11, 2)],
                               [1.0, 0.55, 0.1, 0.0505, 0.001, 0.001], rtol=1e-6)


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_piecewise_interpolate_float_boundaries_match_optax(kind, jax_ref):
    bs = {2.5: 0.5, 6.5: 0.1, 7: 3.0, 0.3 * 31: 0.2}
    counts = list(range(-1, 13)) + [2.4, 2.5, 6.75, 9.3]

    def theirs(jax):
        so = __import__("optax").piecewise_interpolate_schedule(kind, 1.0, bs)
        return [float(so(c)) for c in counts]

    sc = optim.piecewise_interpolate_schedule(kind, 1.0, bs)
    for c, want in zip(counts, jax_ref("values", theirs), strict=True):
        np.testing.assert_allclose(float(sc(c)), want, rtol=1e-6, atol=1e-7, err_msg=str(c))


# --- per-leaf maxima propagate NaN (jnp.maximum) -------------------------------------------------

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


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_adafactor_non_finite_grad_matches_optax(bad, jax_ref):
    rng = np.random.default_rng(2)
    p = {"m": rng.standard_normal((4, 6)).astype(np.float32),
         "v": rng.standard_normal(5).astype(np.float32)}
    g = {"m": rng.standard_normal((4, 6)).astype(np.float32),
         "v": rng.standard_normal(5).astype(np.float32)}
    g["m"][1, 2] = bad
    g["v"][3] = bad
    for i, make in enumerate((lambda o: o.adafactor(0.1, min_dim_size_to_factor=2),  # factored "m"
                              lambda o: o.adafactor(0.1),                            # nothing factored
                              lambda o: o.chain(o.clip_by_block_rms(0.5), o.scale(-1.0)))):
        def theirs(jax):
            txo = make(__import__("optax"))
            pj = jax.tree.map(jax.numpy.asarray, p)
            return dict(txo.update(jax.tree.map(jax.numpy.asarray, g), txo.init(pj), pj)[0])

        uo = jax_ref(i, theirs)
        txc = make(optim)
        uc, _ = txc.update(g, txc.init(p), p)
        for k in p:
            np.testing.assert_allclose(np.asarray(uc[k]), np.asarray(uo[k]), rtol=1e-5,
                                       atol=1e-7, equal_nan=True, err_msg=k)


# --- inject_hyperparams under apply_if_finite: a rejected step keeps the stored values ------------

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


# --- eval_shape of adafactor's init ---------------------------------------------------------------

@pytest.mark.parametrize("min_dim", [4, 128])   # factored leaves, and none factored
def test_eval_shape_of_adafactor_init(min_dim):
    # jax.eval_shape(optax.adafactor(...).init, params) is how t5x / Flax scripts get the
    # optimizer state's shapes for its partition specs; scale_by_factored_rms's init called
    # to_array on the ShapeDtypeStructs and raised "dtype object is not supported". The
    # abstract state must be the concrete one's shapes, dtypes and shardings, on a mesh too.
    from ctrainstate.t5x.optimizers import OptaxWrapper
    from ctrainstate.t5x.train_state import FlaxOptimTrainState
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    sharded = {"a": cts.device_put(np.ones((8, 16), np.float32),
                                   cts.NamedSharding(mesh, cts.P("data", "model"))),
               "b": cts.device_put(np.ones(16, np.float32), cts.NamedSharding(mesh, cts.P("model")))}
    tx = optim.adafactor(0.1, min_dim_size_to_factor=min_dim, momentum=0.9)
    abstract = cts.eval_shape(tx.init, sharded)
    concrete = tx.init(sharded)
    assert [(tuple(x.shape), x.dtype, x.sharding) for x in tree_leaves(abstract)] == \
        [(tuple(x.shape), x.dtype, x.sharding) for x in tree_leaves(concrete)]
    st = cts.eval_shape(lambda: FlaxOptimTrainState.create(
        OptaxWrapper(tx), {"params": {"w": np.ones((16, 16), np.float32)}}))
    assert isinstance(st, FlaxOptimTrainState)


def _shapes(jax, leaves):
    return [[list(x.shape), str(x.dtype)] for x in leaves]


@pytest.mark.parametrize("min_dim", [4, 128])
def test_eval_shape_of_adafactor_init_matches_optax(min_dim, jax_ref):
    p = {"a": np.ones((8, 16), np.float32), "b": np.ones(16, np.float32),
         "c": np.ones((4, 6, 5), np.float32)}
    want = jax_ref("shapes", lambda jax: _shapes(jax, jax.tree.leaves(jax.eval_shape(
        __import__("optax").adafactor(0.1, min_dim_size_to_factor=min_dim).init,
        jax.tree.map(jax.numpy.asarray, p)))))
    got = cts.eval_shape(optim.adafactor(0.1, min_dim_size_to_factor=min_dim).init, p)
    assert _shapes(None, tree_leaves(got)) == want


@pytest.mark.parametrize("skip", ["not_finite", "large"])
def test_eval_shape_of_multisteps_init_with_skip_fn(skip):
    # MultiSteps.init calls should_skip_update_fn on zeros like the params to get the skip
    # state; under eval_shape those are ShapeDtypeStructs and skip_not_finite /
    # skip_large_updates raised (np.isfinite of a struct). The abstract state has the
    # concrete one's structure, shapes and dtypes.
    import functools
    fn = optim.skip_not_finite if skip == "not_finite" else functools.partial(
        optim.skip_large_updates, max_squared_norm=1.0)
    tx = optim.MultiSteps(optim.adam(0.1), 2, should_skip_update_fn=fn)
    p = {"a": np.ones((4, 8), np.float32), "b": np.ones(8, np.float32)}
    abstract, concrete = cts.eval_shape(tx.init, p), tx.init(p)
    key = "num_not_finite" if skip == "not_finite" else "norm_squared"
    assert sorted(abstract.skip_state) == sorted(concrete.skip_state) == sorted(["should_skip", key])
    assert [(tuple(np.shape(x)), np.dtype(x.dtype)) for x in tree_leaves(abstract)] == \
        [(tuple(np.shape(x)), np.dtype(x.dtype)) for x in tree_leaves(concrete)]


@pytest.mark.parametrize("skip", ["not_finite", "large"])
def test_eval_shape_of_multisteps_init_with_skip_fn_matches_optax(skip, jax_ref):
    import functools

    def make(o):
        fn = o.skip_not_finite if skip == "not_finite" else functools.partial(
            o.skip_large_updates, max_squared_norm=1.0)
        return o.MultiSteps(o.adam(0.1), 2, should_skip_update_fn=fn)
    p = {"a": np.ones((4, 8), np.float32), "b": np.ones(8, np.float32)}
    want = jax_ref("shapes", lambda jax: _shapes(jax, jax.tree.leaves(jax.eval_shape(
        make(__import__("optax")).init, jax.tree.map(jax.numpy.asarray, p)))))
    got = cts.eval_shape(make(optim).init, p)
    assert _shapes(None, tree_leaves(got)) == want


# --- join_schedules: an integer count reaches the later schedules as an integer -----------------

def test_join_schedules_passes_integer_counts():
    # optax passes `step - boundary` (an int32 count) to each later schedule; ctrainstate
    # passed a float, so a schedule indexing a table with its count raised TypeError (list
    # indices must be integers). By hand: 1.0 before the boundary 2, then table[count - 2].
    table = [0.5, 0.4, 0.3, 0.2]
    seen = []

    def from_table(c):
        seen.append(c)
        return table[min(c, 3)]
    s = optim.join_schedules([optim.constant_schedule(1.0), from_table], [2])
    assert [float(s(i)) for i in range(7)] == [1.0, 1.0, 0.5, 0.4, 0.3, 0.2, 0.2]
    assert all(type(c) is int for c in seen)
    assert float(s(np.int32(4))) == 0.3
    # through an optimizer (the count is the state's)
    tx = optim.sgd(s)
    p = {"w": np.ones(2, np.float32)}
    st, got = tx.init(p), []
    for _ in range(5):
        u, st = tx.update(p, st, p)
        got.append(float(np.asarray(u["w"])[0]))
    np.testing.assert_allclose(got, [-1.0, -1.0, -0.5, -0.4, -0.3], rtol=1e-6)
    # a float count still gives a float offset (optax: step - boundary in floats)
    lin = optim.join_schedules([optim.constant_schedule(0.0), lambda c: c], [2])
    assert float(lin(3.5)) == 1.5


def test_state_of_other_params_paths_is_refused_before_anything_runs():
    # optax's tree_map raises a pytree structure error for a state built for params of other
    # paths; the fused step paired the arrays by position and stepped them silently (same
    # count, same shapes). Now a ValueError naming the first differing path, in tx.update and
    # in TrainState.apply_gradients, and the state given is left as it was.
    from ctrainstate.train_state import TrainState
    pa = {"a": np.ones(3, np.float32), "b": np.full(3, 2.0, np.float32)}
    pb = {"x": np.ones(3, np.float32), "y": np.full(3, 2.0, np.float32)}
    tx = optim.adam(0.1)
    st = tx.init(pa)
    with pytest.raises(ValueError, match=r"state array \['a'\] where the params have \['x'\]"):
        tx.update(pb, st, pb)
    ts = TrainState.create(apply_fn=None, params=pb, tx=tx)
    bad = ts.replace(opt_state=tx.init(pa))
    with pytest.raises(ValueError, match="does not match the params' tree"):
        bad.apply_gradients(grads=pb)
    assert int(np.asarray(bad.opt_state[0].count)) == 0      # nothing stepped or donated
    assert (np.asarray(bad.params["x"]) == 1.0).all()
    assert int(ts.apply_gradients(grads=pb).step) == 1       # the right state still works
    # a mask (partition / masked) keeps its own, smaller state trees: still accepted
    tx2 = optim.masked(optim.adam(0.1), {"x": True, "y": False})
    st2 = tx2.init(pb)
    tx2.update(pb, st2, pb)


def test_state_of_other_params_paths_fails_in_optax_too():
    optax = pytest.importorskip("optax")
    jnp = pytest.importorskip("jax.numpy")
    pa = {"a": jnp.ones(3), "b": jnp.ones(3)}
    pb = {"x": jnp.ones(3), "y": jnp.ones(3)}
    st = optax.adam(0.1).init(pa)
    with pytest.raises(ValueError):
        optax.adam(0.1).update(pb, st, pb)
