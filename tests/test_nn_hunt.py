"""Flax-parity regressions in ``ctrainstate.nn`` found by running the same module code through
flax.linen and ctrainstate.nn. Each behaviour is checked by hand (the expectation derived in the
test) and, when flax is installed, against live flax."""
import numpy as np
import pytest

from ctrainstate import nn, random


def _flax():
    return pytest.importorskip("flax.linen")


def _jnp():
    return pytest.importorskip("jax.numpy")


# --- DenseGeneral: axis given out of order -------------------------------------------------

def test_dense_general_axis_out_of_order_is_sorted_like_flax():
    # Flax's _normalize_axes sorts the contracted axes, so axis=(-1, -2) on a (2, 3, 4) input
    # is axis (1, 2): a kernel (3, 4, 5) indexed in the input's order, y = einsum('bij,ijf->bf').
    x = np.random.RandomState(0).randn(2, 3, 4).astype(np.float32)
    m = nn.DenseGeneral(5, axis=(-1, -2), bias_init=nn.initializers.normal(1.0))
    v = m.init(random.PRNGKey(0), x)
    k = np.asarray(v["params"]["kernel"])
    b = np.asarray(v["params"]["bias"])
    assert k.shape == (3, 4, 5)
    # the same parameters as axis=(1, 2) (same key, same flattened init shape)
    v12 = nn.DenseGeneral(5, axis=(1, 2), bias_init=nn.initializers.normal(1.0)).init(
        random.PRNGKey(0), x)
    np.testing.assert_array_equal(k, np.asarray(v12["params"]["kernel"]))
    np.testing.assert_allclose(np.asarray(m.apply(v, x)), np.einsum("bij,ijf->bf", x, k) + b,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parity
def test_dense_general_axis_out_of_order_matches_flax():
    fnn, jnp = _flax(), _jnp()
    x = np.random.RandomState(1).randn(2, 3, 4, 2).astype(np.float32)
    for axis, bdims in (((-1, -2), ()), ((3, 1), ()), ((3, 2), (0,))):
        key = random.PRNGKey(3)
        v = nn.DenseGeneral((2, 3), axis=axis, batch_dims=bdims).init(key, x)
        fm = fnn.DenseGeneral((2, 3), axis=axis, batch_dims=bdims)
        fv = fm.init(jnp.asarray(key), jnp.asarray(x))
        for name in ("kernel", "bias"):
            np.testing.assert_array_equal(np.asarray(v["params"][name]),
                                          np.asarray(fv["params"][name]), err_msg=f"{axis} {name}")
        np.testing.assert_allclose(
            np.asarray(nn.DenseGeneral((2, 3), axis=axis, batch_dims=bdims).apply(v, x)),
            np.asarray(fm.apply(fv, jnp.asarray(x))), rtol=1e-5, atol=1e-5, err_msg=str(axis))
