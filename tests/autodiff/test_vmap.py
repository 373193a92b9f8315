"""ctrainstate.vmap (jax.vmap as a loop over the mapped axis): values, per-example gradients,
gradients through it, in_axes / out_axes / axis_size, size 0, nesting, inside pmap, sharded
inputs, and jax's errors; against jax (live, or its recorded values)."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import P, lax, random

RS = np.random.RandomState(0)
W = RS.randn(3, 4).astype(np.float32)
X = RS.randn(5, 3).astype(np.float32)
Y = RS.randn(5, 4).astype(np.float32)


def host(x):
    return np.asarray(x)


def _loss(np_):
    return lambda w, x, y: np_.sum((x @ w - y) ** 2)


def test_values_in_axes_and_out_axes():
    got = cts.vmap(lambda x: W.T @ x)(X)                   # one matrix-vector product per row
    np.testing.assert_allclose(host(got), X @ W, rtol=1e-6, atol=1e-6)
    got = cts.vmap(lambda x, s: x * s, in_axes=(1, None))(X, 2.0)
    np.testing.assert_array_equal(host(got), (X * 2.0).T)
    got = cts.vmap(lambda t: t["a"] + t["b"], in_axes=({"a": 0, "b": None},))(
        {"a": X, "b": np.float32([1.0, 2.0, 3.0])})
    np.testing.assert_array_equal(host(got), X + np.float32([1.0, 2.0, 3.0]))
    got = cts.vmap(lambda x, *, k: x * k)(X, k=np.arange(5, dtype=np.float32))  # kwargs: axis 0
    np.testing.assert_array_equal(host(got), X * np.arange(5, dtype=np.float32)[:, None])
    out = cts.vmap(lambda x: {"s": cnp.sum(x), "t": x * 2.0}, out_axes={"s": 0, "t": -1})(X)
    np.testing.assert_allclose(host(out["s"]), X.sum(1), rtol=1e-6)
    np.testing.assert_array_equal(host(out["t"]), (X * 2.0).T)
    out = cts.vmap(lambda x: (x, W), out_axes=(0, None))(X)   # an unmapped output
    assert out[1] is W
    got = cts.vmap(lambda: cnp.ones(2), axis_size=3)()
    assert host(got).tolist() == [[1.0, 1.0]] * 3
    # nested: the outer product, as two vmaps
    got = cts.vmap(cts.vmap(lambda a, b: a * b, in_axes=(None, 0)), in_axes=(0, None))(
        np.arange(3, dtype=np.float32), np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(host(got), np.outer(np.arange(3), np.arange(4)).astype(np.float32))


def test_size_zero_gives_empty_outputs_of_the_abstract_shapes():
    out = cts.vmap(lambda x: {"s": cnp.sum(x), "m": x[:, None] * W[0]})(np.zeros((0, 3), np.float32))
    assert out["s"].shape == (0,) and out["m"].shape == (0, 3, 4)
    assert out["s"].dtype == np.float32


def test_per_example_gradients_and_gradients_through_vmap():
    pe = cts.vmap(cts.grad(_loss(cnp)), in_axes=(None, 0, 0))(W, X, Y)
    assert pe.shape == (5, 3, 4)
    # each example's gradient, derived: 2 x_i (x_i w - y_i)^T
    for i in range(5):
        want = 2 * np.outer(X[i], X[i] @ W - Y[i])
        np.testing.assert_allclose(host(pe)[i], want, rtol=1e-5, atol=1e-5)
    # their sum is the batch gradient
    full = cts.grad(_loss(cnp))(W, X, Y)
    np.testing.assert_allclose(host(pe).sum(0), host(full), rtol=1e-5, atol=1e-5)
    # the gradient of a function that vmaps: d/dw sum tanh(x_i w) = x^T (1 - tanh^2)
    g = cts.grad(lambda w: cnp.sum(cts.vmap(lambda xi: cnp.tanh(xi @ w))(X)))(cts.device_put(W))
    t = np.tanh(X @ W)
    np.testing.assert_allclose(host(g), X.T @ (1 - t * t), rtol=1e-5, atol=1e-6)


def test_sharded_inputs_and_vmap_inside_pmap():
    mesh = cts.make_mesh((2, 2), ("a", "b"))
    xs = cts.device_put(RS.randn(4, 6).astype(np.float32), cts.NamedSharding(mesh, P("a", "b")))
    got = cts.vmap(lambda r: cnp.cumsum(r) * 2.0)(xs)
    np.testing.assert_allclose(host(got), np.cumsum(host(xs), axis=1) * 2.0, rtol=1e-6)
    n = 4
    got = cts.pmap(lambda blk: lax.psum(cts.vmap(cnp.sum)(blk), "i"), "i")(
        np.arange(n * 3 * 2, dtype=np.float32).reshape(n, 3, 2))
    want = np.arange(n * 3 * 2, dtype=np.float32).reshape(n, 3, 2).sum(2).sum(0)
    for j in range(n):
        np.testing.assert_array_equal(host(got)[j], want)


def test_errors():
    with pytest.raises(ValueError, match="inconsistent sizes for array axes to be mapped"):
        cts.vmap(lambda a, b: a)(X, Y[:4])
    with pytest.raises(ValueError, match="rank should be at least 1"):
        cts.vmap(lambda a: a)(np.float32(1.0))
    with pytest.raises(ValueError, match="give axis_size="):
        cts.vmap(lambda a: a, in_axes=None)(X)
    with pytest.raises(TypeError, match="in_axes must be an int, None, or a tuple"):
        cts.vmap(lambda a: a, in_axes=[0])(X)
    with pytest.raises(ValueError, match="tree prefix"):
        cts.vmap(lambda a, b: a, in_axes=(0,))(X, X)
    with pytest.raises(ValueError, match="mapped output but out_axes is None"):
        cts.vmap(lambda a: a * 2.0, out_axes=None)(X)
    with pytest.raises(ValueError, match="out_axes 3 is out of range"):
        cts.vmap(lambda a: a, out_axes=3)(X)
    with pytest.raises(NotImplementedError, match="collectives over a vmap axis"):
        cts.vmap(lambda a: lax.psum(a, "b"), axis_name="b")(X)
    with pytest.raises(TypeError, match="must be a function"):
        cts.vmap(None)
    with pytest.raises(ValueError, match="different shapes"):
        cts.vmap(lambda a: a[: int(host(a[0]) > 0) + 1])(np.float32([[1.0, 2.0], [-1.0, 2.0]]))


def test_matches_live_jax(jax_ref):
    pe = cts.vmap(cts.grad(_loss(cnp)), in_axes=(None, 0, 0))(W, X, Y)
    want = jax_ref("per_example_grad", lambda jax: jax.vmap(
        jax.grad(_loss(jax.numpy)), in_axes=(None, 0, 0))(W, X, Y))
    np.testing.assert_allclose(host(pe), want, rtol=1e-5, atol=1e-5)
    g = cts.grad(lambda w: cnp.sum(cts.vmap(lambda xi: cnp.tanh(xi @ w))(X)))(cts.device_put(W))
    want = jax_ref("grad_through_vmap", lambda jax, jnp: jax.grad(
        lambda w: jnp.sum(jax.vmap(lambda xi: jnp.tanh(xi @ w))(X)))(W))
    np.testing.assert_allclose(host(g), want, rtol=1e-5, atol=1e-6)
    # vmap over split keys: the same bits as jax's batched sampler
    keys = random.split(random.PRNGKey(3), 4)
    got = cts.vmap(lambda k: random.normal(k, (3,)))(keys)
    want = jax_ref("normal_of_split_keys", lambda jax: jax.vmap(
        lambda k: jax.random.normal(k, (3,)))(jax.random.split(jax.random.PRNGKey(3), 4)))
    np.testing.assert_allclose(host(got), want, rtol=1e-6, atol=1e-6)
