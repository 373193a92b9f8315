"""Snippets a user ports from Flax / optax / JAX by changing imports.

Each test runs the ctrainstate version of a common snippet and checks it against the
value Flax/optax/JAX define: computed live when jax/flax/optax are installed (those
parts skip cleanly otherwise), and derived by hand (stated next to the assertion) in
every case.
"""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import nn, random


def _flax():
    return pytest.importorskip("flax.linen")


def _jax():
    return pytest.importorskip("jax")


# --- Module.init keeps no 'intermediates'; is_initializing ------------------------------------

def _sow_model(nn_mod):
    class M(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            h = nn_mod.Dense(4)(x)
            self.sow("intermediates", "h", h)
            self.sow("intermediates", "init_flag", self.is_initializing())
            return h
    return M()


def test_init_does_not_keep_intermediates():
    x = np.ones((2, 3), np.float32)
    m = _sow_model(nn)
    v = m.init(random.PRNGKey(1), x)
    # Flax: init's default mutable is DenyList('intermediates')
    assert sorted(v) == ["params"]
    _, mut = m.apply(v, x, mutable=["intermediates"])
    assert len(mut["intermediates"]["h"]) == 1          # one call, one sown value
    assert mut["intermediates"]["init_flag"] == (False,)
    # explicit mutable=True keeps them, and is_initializing is True during init
    v_all = m.init(random.PRNGKey(1), x, mutable=True)
    assert v_all["intermediates"]["init_flag"] == (True,)
    _, v2 = m.init_with_output(random.PRNGKey(1), x)
    assert sorted(v2) == ["params"]
    assert m.apply(v, x, mutable=nn.DenyList("params"))[1].keys() == {"intermediates"}


def test_init_intermediates_match_flax():
    fnn = _flax()
    jax = _jax()
    x = np.ones((2, 3), np.float32)
    fv = _sow_model(fnn).init(jax.random.PRNGKey(1), x)
    cv = _sow_model(nn).init(random.PRNGKey(1), x)
    assert sorted(fv) == sorted(cv)
    _, fm = _sow_model(fnn).apply(fv, x, mutable=["intermediates"])
    _, cm = _sow_model(nn).apply(cv, x, mutable=["intermediates"])
    assert len(fm["intermediates"]["h"]) == len(cm["intermediates"]["h"])
    np.testing.assert_allclose(np.asarray(cm["intermediates"]["h"][0]),
                               np.asarray(fm["intermediates"]["h"][0]), rtol=1e-6)
