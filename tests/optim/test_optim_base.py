"""GradientTransformation (optim/base.py): optax's NamedTuple interface and extra keyword
arguments of ``update`` (optax.GradientTransformationExtraArgs), through every alias,
combinator and wrapper, fused and not."""
import warnings

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.optim as optim
from ctrainstate.optim import alias
from ctrainstate.train_state import TrainState
from ctrainstate.tree_util import tree_leaves, tree_map


def _p():
    return {"b": np.full(3, 0.5, np.float32), "w": np.linspace(-1, 1, 6).astype(np.float32)}


def _g():
    return {"b": np.full(3, 0.25, np.float32), "w": np.linspace(1, -2, 6).astype(np.float32)}


def _np(tree):
    return tree_map(np.asarray, tree)


def _alias(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        f = getattr(optim, name)
        return f(0.1) if name != "adafactor" else f(0.1, min_dim_size_to_factor=2)


ALIASES = sorted(set(alias.__all__))


@pytest.mark.parametrize("name", ALIASES)
def test_every_alias_accepts_and_ignores_extra_args(name):
    tx = _alias(name)
    assert isinstance(tx, optim.GradientTransformationExtraArgs)
    p = _p()
    u0, s0 = tx.update(_g(), tx.init(p), p)
    u1, s1 = tx.update(_g(), tx.init(p), p, value=np.float32(1.5), loss=2.0)
    for a, b in zip(tree_leaves(_np((u0, s0))), tree_leaves(_np((u1, s1)))):
        np.testing.assert_array_equal(a, b)


def _needs_loss():
    """A user transform whose update requires the extra argument ``loss``: scales by it."""
    def update(updates, state, params=None, *, loss, **extra_args):
        return tree_map(lambda g: np.asarray(g) * loss, updates), state
    return optim.GradientTransformationExtraArgs(lambda params: optim.EmptyState(), update)


def _plain_user_tx():
    """A transform built as optax's plain GradientTransformation (no extra args): the
    combinators leave them out for it (optax.with_extra_args_support)."""
    def update(updates, state, params=None):
        return tree_map(lambda g: np.asarray(g) + 1, updates), state
    return optim.GradientTransformation(lambda params: optim.EmptyState(), update)


COMBINATORS = {
    "chain": lambda t: optim.chain(optim.scale(2.0), _plain_user_tx(), t),
    "masked": lambda t: optim.masked(t, {"b": True, "w": True}),
    "partition": lambda t: optim.partition({"a": t, "z": optim.sgd(1.0)}, {"b": "a", "w": "a"}),
    "apply_if_finite": lambda t: optim.apply_if_finite(t, 2),
    "conditionally_mask": lambda t: optim.conditionally_mask(t, lambda step: step >= 0),
    "MultiSteps": lambda t: optim.MultiSteps(t, 1),
    "inject_hyperparams": lambda t: optim.inject_hyperparams(
        lambda learning_rate: optim.chain(optim.scale(learning_rate), t))(learning_rate=1.0),
    "with_extra_args_support": lambda t: optim.with_extra_args_support(optim.chain(t)),
}


@pytest.mark.parametrize("name", sorted(COMBINATORS))
def test_combinators_forward_extra_args(name):
    tx = COMBINATORS[name](_needs_loss())
    p = _p()
    u, _ = tx.update(_g(), tx.init(p), p, loss=np.float32(3.0))
    g = _g()
    want = {k: 3.0 * (2.0 * v + 1) if name == "chain" else 3.0 * v for k, v in g.items()}
    for k in g:
        np.testing.assert_allclose(np.asarray(u[k]), want[k], rtol=1e-6)
    with pytest.raises(TypeError, match="loss"):   # the inner update really needs it
        tx.update(_g(), tx.init(p), p)


def test_lookahead_forwards_extra_args():
    tx = optim.lookahead(_needs_loss(), sync_period=2, slow_step_size=0.5)
    p = optim.LookaheadParams.init_synced(cts.device_put(_p()))
    u, _ = tx.update(_g(), tx.init(p), p, loss=np.float32(2.0))
    np.testing.assert_allclose(np.asarray(u.fast["w"]), 2.0 * _g()["w"], rtol=1e-6)


def test_masked_masks_compatible_extra_args():
    seen = {}

    def update(updates, state, params=None, *, tags, **extra_args):
        seen.update(tags)
        return updates, state
    inner = optim.GradientTransformationExtraArgs(lambda params: optim.EmptyState(), update)
    p = _p()
    tx = optim.masked(inner, {"b": False, "w": True}, mask_compatible_extra_args=True)
    tx.update(_g(), tx.init(p), p, tags={"b": 1, "w": 2})
    assert isinstance(seen["b"], optim.MaskedNode) and seen["w"] == 2
    seen.clear()
    tx = optim.masked(inner, {"b": False, "w": True})
    tx.update(_g(), tx.init(p), p, tags={"b": 1, "w": 2})
    assert seen == {"b": 1, "w": 2}


def test_with_extra_args_support_of_a_plain_transformation():
    tx = _plain_user_tx()
    with pytest.raises(TypeError):
        tx.update(_g(), optim.EmptyState(), None, loss=1.0)
    wrapped = optim.with_extra_args_support(tx)
    assert isinstance(wrapped, optim.GradientTransformationExtraArgs)
    assert optim.with_extra_args_support(wrapped) is wrapped
    u, _ = wrapped.update(_g(), optim.EmptyState(), None, loss=1.0)
    np.testing.assert_allclose(np.asarray(u["w"]), _g()["w"] + 1)


def test_gradient_transformation_is_a_named_tuple():
    tx = optim.adamw(1e-2)
    assert isinstance(tx, tuple) and isinstance(tx, optim.GradientTransformation)
    assert len(tx) == 2 and tx._fields == ("init", "update")
    init, update = tx
    assert tx[0] is init is tx.init and tx[1] is update is tx.update
    assert tx.fusable
    p = _p()
    u, s = tx[1](_g(), tx[0](p), p)
    assert np.asarray(u["w"]).shape == (6,)


def test_fused_path_still_recognises_a_named_tuple_transformation():
    """TrainState runs a fusable tx in place (the old state is donated); a tuple rebuilt
    from it (``_replace``) is a plain transformation: its own update runs, unfused."""
    tx = optim.sgd(0.5)
    s = TrainState.create(apply_fn=None, params=_p(), tx=tx)
    s2 = s.apply_gradients(grads=_g())
    with pytest.raises(cts.DonatedBufferError):
        np.asarray(s.params["w"])
    np.testing.assert_allclose(np.asarray(s2.params["w"]), _p()["w"] - 0.5 * _g()["w"],
                               rtol=1e-6)
    calls = []

    def update(updates, state, params=None):
        calls.append(1)
        return tx.update(updates, state, params)
    replaced = tx._replace(update=update)
    assert type(replaced) is type(tx) and not replaced.fusable
    s = TrainState.create(apply_fn=None, params=_p(), tx=replaced)
    s2 = s.apply_gradients(grads=_g())
    assert calls == [1]
    np.asarray(s.params["w"])   # not donated: the functional path ran
    np.testing.assert_allclose(np.asarray(s2.params["w"]), _p()["w"] - 0.5 * _g()["w"],
                               rtol=1e-6)


def test_plain_tuple_pairs_are_not_taken_for_fusable_ones():
    """A bare (init, update) NamedTuple of another library (optax's, or any tuple) is never
    run by the fused kernel, even though a fusable transformation is a tuple too."""
    tx = optim.sgd(0.5)
    pair = tuple(tx)
    assert not getattr(pair, "fusable", False)
    chained = optim.chain(optim.GradientTransformation(*pair))
    assert not chained.fusable
    p = _p()
    u, _ = chained.update(_g(), chained.init(p), p)
    np.testing.assert_allclose(np.asarray(u["w"]), -0.5 * _g()["w"], rtol=1e-6)


# values for the required arguments of the public factories of ctrainstate.optim
_REQUIRED = {"learning_rate": 0.1, "step_size": 0.5, "max_delta": 1.0, "max_norm": 1.0,
             "threshold": 1.0, "decay": 0.9, "eta": 0.1, "gamma": 0.5, "mask": True,
             "transforms": {"a": optim.sgd(0.1)}, "param_labels": "a",
             "max_consecutive_errors": 1, "should_transform_fn": lambda step: True,
             "sync_period": 2, "slow_step_size": 0.5, "f": lambda u, p: u,
             "step_size_fn": lambda count: 0.1, "every_k_schedule": 2}
_INNER = ("inner", "fast_optimizer", "opt", "tx")


def _public_transformations():
    import inspect
    out = []
    for name in sorted(optim.__all__):
        f = getattr(optim, name)
        if not inspect.isfunction(f):
            continue
        kw = {}
        for pn, p in inspect.signature(f).parameters.items():
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL,
                                                                        p.VAR_KEYWORD):
                kw[pn] = optim.sgd(0.1) if pn in _INNER else _REQUIRED.get(pn)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                tx = f(**kw)
            except (TypeError, ValueError):   # a function of ctrainstate.optim, no factory
                continue
        if hasattr(tx, "init") and hasattr(tx, "update"):
            out.append((name, tx))
    return out


def test_every_transformation_takes_extra_args():
    import inspect
    txs = _public_transformations()
    assert len(txs) > 60
    for name, tx in txs:
        assert isinstance(tx, optim.GradientTransformationExtraArgs), name
        kinds = [p.kind for p in inspect.signature(tx.update).parameters.values()]
        assert inspect.Parameter.VAR_KEYWORD in kinds, name


# --- optax-parity regressions of the states a transformation accepts (found probing
# ctrainstate.optim against optax 0.2.8): each compared with live optax (`parity`) or with values
# derived by hand.

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


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define, live when installed (those parts skip cleanly otherwise) and derived
# by hand

@pytest.mark.parametrize("name", ["adamw", "lamb", "add_decayed_weights"])
def test_update_without_params_says_to_pass_them(name):
    from ctrainstate import optim
    tx = {"adamw": lambda: optim.adamw(1e-3), "lamb": lambda: optim.lamb(1e-3),
          "add_decayed_weights": lambda: optim.add_decayed_weights(1e-4)}[name]()
    p = {"w": np.ones(3, np.float32)}
    st = tx.init(p)
    # optax raises a ValueError too ("...requires the current value of parameters...")
    with pytest.raises(ValueError, match=r"tx.update\(updates, state, params\)"):
        tx.update({"w": np.ones(3, np.float32)}, st)
    u, _ = tx.update({"w": np.ones(3, np.float32)}, st, p)      # with params it runs
    assert np.isfinite(np.asarray(u["w"])).all()
