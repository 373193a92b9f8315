"""ctrainstate.nn's Dropout (nn/stochastic.py, flax.linen.stochastic): checked by hand and against flax
(`jax_ref`: recorded in tests/data/recorded/test_stochastic.npz, live in the `parity` twins)."""

import numpy as np
import pytest

from ctrainstate import nn
from ctrainstate import random
import ctrainstate as cts
import ctrainstate.numpy as cnp


def test_dropout_of_integers_is_a_clear_type_error():
    # Flax raises a TypeError from lax.select (int32 inputs against the float32 kept / keep);
    # here the same type, with a message that says what to do. Floats of every dtype pass.
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    with pytest.raises(TypeError, match="inputs must be a floating-point array, got int32"):
        nn.Dropout(0.5, deterministic=False).apply({}, x, rngs={"dropout": random.PRNGKey(0)})
    import ml_dtypes
    for dt in (np.float32, np.float16, ml_dtypes.bfloat16):
        y = nn.Dropout(0.5, deterministic=False).apply({}, np.ones((2, 3), dt),
                                                       rngs={"dropout": random.PRNGKey(0)})
        assert np.dtype(y.dtype) == np.dtype(dt)
    # deterministic or rate 0 returns the input untouched, as Flax (no dtype check there)
    assert nn.Dropout(0.5, deterministic=True).apply({}, x) is x


def test_dropout_of_integers_fails_in_flax_too(jax_ref):
    x = np.arange(6, dtype=np.int32).reshape(2, 3)

    def flax_side(jax, fnn):
        try:
            fnn.Dropout(0.5, deterministic=False).apply({}, x, rngs={"dropout": jax.random.PRNGKey(0)})
        except Exception as e:   # (the error's kind, as pytest.raises(TypeError) would take it)
            return {"type": type(e).__name__, "TypeError": isinstance(e, TypeError)}
        return None

    err = jax_ref("error", flax_side)
    assert err is not None and err["TypeError"], err


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define, live when installed (those parts skip cleanly otherwise) and derived
# by hand

def _dropout_model(nn_mod):
    class M(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x, train: bool):
            x = nn_mod.Dense(16)(x)
            x = nn_mod.Dropout(0.3, deterministic=not train)(x)
            x = nn_mod.relu(x)
            x = nn_mod.Dropout(rate=0.5, broadcast_dims=(0,))(x, deterministic=not train)
            return nn_mod.Dense(2)(x)
    return M()


def test_dropout_mask_and_scaling():
    x = np.arange(1, 41, dtype=np.float32).reshape(8, 5)
    k = random.PRNGKey(3)
    d = nn.Dropout(0.25)
    y = np.asarray(d.apply({}, x, deterministic=False, rng=k))
    # derived: Flax keeps element i iff uniform(rng, shape)[i] < 1 - rate, and scales by 1/keep
    keep = random.uniform(k, x.shape) < 0.75
    np.testing.assert_allclose(y, np.where(keep, x / 0.75, 0.0), rtol=1e-6)
    assert np.asarray(d.apply({}, x, deterministic=True)).tolist() == x.tolist()
    assert np.asarray(nn.Dropout(1.0).apply({}, x, deterministic=False)).max() == 0.0
    yb = np.asarray(nn.Dropout(0.5, broadcast_dims=(0,)).apply(
        {}, x, deterministic=False, rngs={"dropout": k}))
    assert ((yb == 0).all(axis=0) | (yb != 0).all(axis=0)).all()    # one mask value per column
    with pytest.raises(ValueError, match="deterministic"):
        nn.Dropout(0.1).apply({}, x)
    with pytest.raises(ValueError, match="dropout"):
        nn.Dropout(0.1).apply({}, x, deterministic=False)


def test_dropout_sharded_grads_and_train_step():
    from ctrainstate import optim
    from ctrainstate.train_state import TrainState
    x = np.random.RandomState(0).randn(8, 4).astype(np.float32)
    m = _dropout_model(nn)
    v = m.init({"params": random.PRNGKey(0), "dropout": random.PRNGKey(1)}, x, train=True)
    y1 = np.asarray(m.apply(v, x, train=True, rngs={"dropout": random.PRNGKey(5)}))
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    xs = cts.device_put(x, cts.NamedSharding(mesh, cts.P("data", None)))
    with mesh:
        ys = m.apply(v, xs, train=True, rngs={"dropout": random.PRNGKey(5)})
    np.testing.assert_allclose(np.asarray(ys), y1, rtol=1e-5, atol=1e-6)  # same mask on any mesh
    state = TrainState.create(apply_fn=m.apply, params=v["params"], tx=optim.sgd(0.1))
    loss_fn = lambda p: cnp.mean(cnp.square(state.apply_fn(
        {"params": p}, x, train=True, rngs={"dropout": random.PRNGKey(5)})))
    loss, g = cts.value_and_grad(loss_fn)(state.params)
    np.testing.assert_allclose(float(loss), np.mean(y1 ** 2), rtol=1e-5)
    state = state.apply_gradients(grads=g)
    assert state.step == 1


def test_dropout_matches_flax(jax_ref):
    x = np.random.RandomState(0).randn(8, 4).astype(np.float32)
    loss = lambda apply, p, k, jnp: jnp.mean(jnp.square(apply({"params": p}, x, train=True,
                                                               rngs={"dropout": k})))

    def flax_side(jax, fnn):
        fv = _dropout_model(fnn).init(
            {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}, x, train=True)
        fo = _dropout_model(fnn).apply(fv, x, train=True, rngs={"dropout": jax.random.PRNGKey(5)})
        gf = jax.grad(lambda p: loss(_dropout_model(fnn).apply, p, jax.random.PRNGKey(5),
                                     jax.numpy))(fv["params"])
        return {"params": fv["params"], "out": fo, "grad": gf}

    want = jax_ref("flax", flax_side)
    cv = _dropout_model(nn).init({"params": random.PRNGKey(0), "dropout": random.PRNGKey(1)},
                                 x, train=True)
    for a, b in zip(cts.tree_util.tree_leaves(want["params"]),
                    cts.tree_util.tree_leaves(cv["params"])):
        np.testing.assert_array_equal(np.asarray(b), a)
    co = _dropout_model(nn).apply(cv, x, train=True, rngs={"dropout": random.PRNGKey(5)})
    np.testing.assert_allclose(np.asarray(co), want["out"], rtol=1e-5, atol=1e-6)
    gc = cts.grad(lambda p: loss(_dropout_model(nn).apply, p, random.PRNGKey(5), cnp))(cv["params"])
    for a, b in zip(cts.tree_util.tree_leaves(want["grad"]), cts.tree_util.tree_leaves(gc)):
        np.testing.assert_allclose(np.asarray(b), a, rtol=1e-4, atol=1e-6)


_NONFINITE = np.tile(np.array([np.inf, -np.inf, np.nan, -2.0, 0.0, 3.0, -0.0, 1e30], np.float32),
                     16).reshape(8, 16)


@pytest.mark.parametrize("bd", [(), (0,)])
def test_dropout_selects_dropped_are_zero_even_for_inf_nan(bd):
    x, k = _NONFINITE, random.PRNGKey(15)
    # derived: Flax's lax.select(mask, x / keep, 0): dropped elements are exactly 0, kept ones
    # x / keep (inf and NaN included)
    shape = (1, 16) if bd == (0,) else (8, 16)
    keep = np.broadcast_to(np.asarray(random.uniform(k, shape)) < 0.5, x.shape)
    want = np.where(keep, x / np.float32(0.5), np.float32(0.0))
    for f in (np.isnan, np.isposinf, np.isneginf):       # each kept somewhere and dropped somewhere
        assert (keep & f(x)).any() and (~keep & f(x)).any()
    d = nn.Dropout(0.5, broadcast_dims=bd, deterministic=False)
    np.testing.assert_array_equal(np.asarray(d.apply({}, x, rng=k)), want)
    mesh = cts.make_mesh((2, 4), ("d", "m"))
    xs = cts.device_put(x, cts.NamedSharding(mesh, cts.P("d", "m")))
    ys = d.apply({}, xs, rng=k)
    assert ys.sharding.spec == cts.P("d", "m")
    np.testing.assert_array_equal(np.asarray(ys), want)
    # the gradient is the same selection of g / keep
    w = cts.device_put(np.random.RandomState(0).randn(8, 16).astype(np.float32),
                       cts.NamedSharding(mesh, cts.P("d", "m")))
    g = cts.grad(lambda v: cnp.sum(cnp.square(d.apply({}, v, rng=k))))(w)
    assert g.sharding == w.sharding
    np.testing.assert_allclose(np.asarray(g), np.where(keep, 2 * np.asarray(w) / 0.25, 0.0),
                               rtol=1e-6)
    # rate 1: zeros_like, whatever the input
    z = nn.Dropout(1.0, deterministic=False).apply({}, x)
    assert np.asarray(z).tolist() == [[0.0] * 16] * 8


@pytest.mark.parametrize("bd", [(), (0,)])
def test_dropout_inf_nan_matches_flax(bd, jax_ref):
    x = _NONFINITE
    w = np.random.RandomState(0).randn(8, 16).astype(np.float32)

    def flax_side(jax, fnn):
        fo = fnn.Dropout(0.5, broadcast_dims=bd, deterministic=False).apply(
            {}, x, rngs={"dropout": jax.random.PRNGKey(15)})
        f1 = fnn.Dropout(1.0, deterministic=False).apply({}, x)
        gf = jax.grad(lambda v: jax.numpy.sum(jax.numpy.square(fnn.Dropout(
            0.5, broadcast_dims=bd, deterministic=False).apply(
                {}, v, rngs={"dropout": jax.random.PRNGKey(15)}))))(w)
        return {"out": fo, "rate 1": f1, "grad": gf}

    want = jax_ref("flax", flax_side)
    co = nn.Dropout(0.5, broadcast_dims=bd, deterministic=False).apply(
        {}, x, rngs={"dropout": random.PRNGKey(15)})
    np.testing.assert_array_equal(np.asarray(co), want["out"])
    np.testing.assert_array_equal(
        np.asarray(nn.Dropout(1.0, deterministic=False).apply({}, x)), want["rate 1"])
    gc = cts.grad(lambda v: cnp.sum(cnp.square(nn.Dropout(
        0.5, broadcast_dims=bd, deterministic=False).apply({}, v, rngs={"dropout": random.PRNGKey(15)}))))(
        cts.device_put(w))
    np.testing.assert_allclose(np.asarray(gc), want["grad"], rtol=1e-6)
