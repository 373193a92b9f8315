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
