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


@pytest.mark.parity
def test_chain_short_state_raises_as_optax():
    optax = pytest.importorskip("optax")
    jnp = pytest.importorskip("jax.numpy")
    for lib in (optax, optim):
        tx = lib.chain(lib.sgd(1.0), lib.clip(1.0))
        p = {"b": jnp.ones(3) if lib is optax else np.ones(3, np.float32)}
        with pytest.raises(ValueError, match="number of updates and states"):
            tx.update(p, tx.init(p)[:1], p)
