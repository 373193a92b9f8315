"""NaN, infinities and ties in maximum / minimum / clip / relu / leaky_relu, as jax.numpy
treats them: a NaN operand gives NaN, infinities stay infinite, and the gradient of
maximum/minimum is split 0.5 / 0.5 where the operands are equal. Expected values are written
out by hand here; where jax is installed the same cases are also compared with it live."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import nn

NAN, INF = np.nan, np.inf


def _jax():
    try:
        import jax
        import jax.numpy as jnp
        return jax, jnp
    except Exception:  # noqa: BLE001 - absent, or unusable under the sanitizer run
        return None, None


def test_maximum_minimum_propagate_nan():
    a = np.array([NAN, 1.0, 2.0, 3.0, -INF], np.float32)
    b = np.array([1.0, NAN, 2.0, 1.0, 0.0], np.float32)
    np.testing.assert_array_equal(np.asarray(cnp.maximum(a, b)), [NAN, NAN, 2.0, 3.0, 0.0])
    np.testing.assert_array_equal(np.asarray(cnp.minimum(a, b)), [NAN, NAN, 2.0, 1.0, -INF])
    # a scalar operand on either side
    np.testing.assert_array_equal(np.asarray(cnp.maximum(a, 1.5)), [NAN, 1.5, 2.0, 3.0, 1.5])
    np.testing.assert_array_equal(np.asarray(cnp.clip(np.array([NAN, 5.0, -3.0, 0.5], np.float32), -1, 1)),
                                  [NAN, 1.0, -1.0, 0.5])


def test_maximum_minimum_split_the_gradient_at_ties():
    p = cts.device_put(np.array([1.0, 2.0, 3.0], np.float32))
    q = cts.device_put(np.array([1.0, 1.0, 4.0], np.float32))
    w = np.array([1.0, 2.0, 3.0], np.float32)
    gp, gq = cts.grad(lambda u, v: cnp.sum(cnp.maximum(u, v) * w), argnums=(0, 1))(p, q)
    np.testing.assert_array_equal(np.asarray(gp), [0.5, 2.0, 0.0])
    np.testing.assert_array_equal(np.asarray(gq), [0.5, 0.0, 3.0])
    gp, gq = cts.grad(lambda u, v: cnp.sum(cnp.minimum(u, v) * w), argnums=(0, 1))(p, q)
    np.testing.assert_array_equal(np.asarray(gp), [0.5, 0.0, 3.0])
    np.testing.assert_array_equal(np.asarray(gq), [0.5, 2.0, 0.0])
    # clip at its bounds: half the gradient passes (jnp.clip is minimum(maximum(x, lo), hi))
    g = cts.grad(lambda v: cnp.sum(cnp.clip(v, -1.0, 1.0)))(
        cts.device_put(np.array([1.0, -1.0, 0.5, 2.0], np.float32)))
    np.testing.assert_array_equal(np.asarray(g), [0.5, 0.5, 1.0, 0.0])
    # where the output is NaN the gradient goes to neither operand (lax.max: a NaN output
    # equals neither); infinities and signed zeros tie as equal values do
    u = np.array([NAN, 2.0, NAN, INF, -0.0, -INF], np.float32)
    v = np.array([1.0, NAN, NAN, INF, 0.0, 3.0], np.float32)
    for f, first in ((cnp.maximum, [0.0, 0.0, 0.0, 0.5, 0.5, 0.0]),
                     (cnp.minimum, [0.0, 0.0, 0.0, 0.5, 0.5, 1.0])):
        gu, gv = cts.grad(lambda a, b: cnp.sum(f(a, b)), argnums=(0, 1))(u, v)
        second = [0.0, 0.0, 0.0, 0.5, 0.5, 1.0 - first[5]]
        np.testing.assert_array_equal(np.asarray(gu), first)
        np.testing.assert_array_equal(np.asarray(gv), second)


def test_maximum_gradient_with_a_broadcast_operand():
    x = cts.device_put(np.array([[0.0, 2.0], [1.0, -1.0]], np.float32))
    gx, gb = cts.grad(lambda u, b: cnp.sum(cnp.maximum(u, b)), argnums=(0, 1))(
        x, cts.device_put(np.float32(1.0)))
    np.testing.assert_array_equal(np.asarray(gx), [[0.0, 1.0], [0.5, 0.0]])
    assert float(np.asarray(gb)) == 2.5


def test_relu_and_leaky_relu_keep_nan_and_infinities():
    x = np.array([INF, -INF, NAN, 0.0, -2.0, 3.0], np.float32)
    np.testing.assert_array_equal(np.asarray(cnp.relu(x)), [INF, 0.0, NAN, 0.0, 0.0, 3.0])
    np.testing.assert_array_equal(np.asarray(nn.leaky_relu(x)),
                                  np.array([INF, -INF, NAN, 0.0, np.float32(-2.0) * np.float32(0.01), 3.0],
                                           np.float32))
    np.testing.assert_array_equal(np.asarray(nn.leaky_relu(x, 0.2)),
                                  np.array([INF, -INF, NAN, 0.0, np.float32(-2.0) * np.float32(0.2), 3.0],
                                           np.float32))
    # gradient: 1 at x >= 0 (0 included), the slope below
    g = cts.grad(lambda v: cnp.sum(nn.leaky_relu(v, 0.2) * 2.0))(
        cts.device_put(np.array([0.0, -2.0, 3.0, -0.5], np.float32)))
    np.testing.assert_allclose(np.asarray(g), [2.0, 0.4, 2.0, 0.4], rtol=1e-7)


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)])
def test_maximum_on_meshes_equals_one_device(mesh_shape):
    names = ("x",) if len(mesh_shape) == 1 else ("data", "model")
    mesh = cts.make_mesh(mesh_shape, names)
    rng = np.random.default_rng(0)
    a = np.round(rng.standard_normal((8, 8)), 0).astype(np.float32)  # rounding makes ties
    b = np.round(rng.standard_normal((8, 8)), 0).astype(np.float32)
    a[2, 3] = NAN
    sh = cts.NamedSharding(mesh, cts.P(*names))
    f = lambda u, v: cnp.sum(cnp.maximum(u, v) * 3.0)  # noqa: E731
    want = cts.grad(f, argnums=(0, 1))(cts.device_put(a), cts.device_put(b))
    got = cts.grad(f, argnums=(0, 1))(cts.device_put(a, sh), cts.device_put(b, sh))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(cnp.maximum(cts.device_put(a, sh), b)), np.maximum(a, b))


def test_against_jax(jax_ref):
    rng = np.random.default_rng(1)
    a = np.round(rng.standard_normal(40), 0).astype(np.float32)
    b = np.round(rng.standard_normal(40), 0).astype(np.float32)
    a[[3, 7]] = [NAN, INF]
    b[[5, 7]] = [NAN, -INF]
    for ours, theirs in ((cnp.maximum, "maximum"), (cnp.minimum, "minimum")):
        np.testing.assert_array_equal(np.asarray(ours(a, b)), jax_ref(
            theirs, lambda jax: getattr(jax.numpy, theirs)(a, b)))
    # the gradients with the NaNs and infinities too (none where the output is NaN)
    a2, b2 = a, b
    for ours, theirs in ((cnp.maximum, "maximum"), (cnp.minimum, "minimum")):
        g = cts.grad(lambda u, v: cnp.sum(ours(u, v) * 2.0), argnums=(0, 1))(cts.device_put(a2),
                                                                           cts.device_put(b2))
        gj = jax_ref(f"grad {theirs}", lambda jax: jax.grad(
            lambda u, v: jax.numpy.sum(getattr(jax.numpy, theirs)(u, v) * 2.0),
            argnums=(0, 1))(a2, b2))
        for x, y in zip(g, gj):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    x = np.concatenate([a, [0.0, -0.0]]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(nn.leaky_relu(x)), jax_ref(
        "leaky_relu", lambda jax: jax.nn.leaky_relu(x)))
    np.testing.assert_array_equal(np.asarray(cnp.relu(x)), jax_ref(
        "relu", lambda jax: jax.nn.relu(x)))
    xf = x[np.isfinite(x)]
    np.testing.assert_allclose(
        np.asarray(cts.grad(lambda v: cnp.sum(nn.leaky_relu(v)))(cts.device_put(xf))),
        jax_ref("grad leaky_relu", lambda jax: jax.grad(
            lambda v: jax.numpy.sum(jax.nn.leaky_relu(v)))(xf)), rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(cnp.clip(a, -0.5, 0.5)), jax_ref(
        "clip", lambda jax: jax.numpy.clip(a, -0.5, 0.5)))


def test_where_selects_exactly():
    c = np.array([[True, False, True], [False, False, True]])
    x = np.array([[1.0, INF, NAN], [2.0, 3.0, 4.0]], np.float32)
    y = np.array([5.0, NAN, -INF], np.float32)
    # the branch not taken never leaks (a product with a 0/1 mask would give NaN for inf * 0)
    np.testing.assert_array_equal(np.asarray(cnp.where(c, x, y)),
                                  [[1.0, NAN, NAN], [5.0, NAN, 4.0]])
    np.testing.assert_array_equal(np.asarray(cnp.where(c, x, 0.0)), [[1.0, 0.0, NAN], [0.0, 0.0, 4.0]])
    # an Array condition: nonzero (NaN included) is true
    ca = cts.device_put(np.array([0.0, 2.0, NAN], np.float32))
    np.testing.assert_array_equal(np.asarray(cnp.where(ca, 1.0, -1.0)), [-1.0, 1.0, 1.0])
    gx, gy = cts.grad(lambda a, b: cnp.sum(cnp.where(c, a, b) * 2.0), argnums=(0, 1))(
        cts.device_put(np.ones((2, 3), np.float32)), cts.device_put(np.ones(3, np.float32)))
    np.testing.assert_array_equal(np.asarray(gx), [[2.0, 0.0, 2.0], [0.0, 0.0, 2.0]])
    np.testing.assert_array_equal(np.asarray(gy), [2.0, 4.0, 0.0])
    # the one-argument form is jnp's nonzero (ctrainstate/_src/numpy_lax/numpy_extra.py)
    np.testing.assert_array_equal(np.stack([np.asarray(i) for i in cnp.where(c)]),
                                  np.stack(np.nonzero(np.asarray(c))))
    s = cts.eval_shape(lambda a: cnp.where(c, a, 0.0), cts.ShapeDtypeStruct((2, 3), np.float32))
    assert s.shape == (2, 3)


def test_where_sharded_and_against_jax(jax_ref):
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    x[1, 2] = INF
    c = rng.random((4, 8)) > 0.5
    xs = cts.device_put(x, cts.NamedSharding(mesh, cts.P("data", "model")))
    got = cnp.where(c, xs, -x)
    np.testing.assert_array_equal(np.asarray(got), np.where(c, x, -x))
    np.testing.assert_array_equal(np.asarray(got), jax_ref(
        "where", lambda jax: jax.numpy.where(c, x, -x)))
    w = rng.standard_normal((4, 8)).astype(np.float32)
    xf = np.where(np.isfinite(x), x, 0.0).astype(np.float32)
    g = cts.grad(lambda a: cnp.sum(cnp.where(c, a * 3.0, a) * w))(
        cts.device_put(xf, cts.NamedSharding(mesh, cts.P("data", "model"))))
    gj = jax_ref("grad where", lambda jax: jax.grad(
        lambda a: jax.numpy.sum(jax.numpy.where(c, a * 3.0, a) * w))(xf))
    np.testing.assert_allclose(np.asarray(g), gj, rtol=1e-6)


def test_scalar_multiply_keeps_nan_inf_and_signed_zeros_as_jax():
    """x * 0.0 is NaN for inf and NaN (not a fill with zeros) and a -0.0 product stays -0.0,
    bit for bit as IEEE float32 (what jax computes)."""
    h = np.array([-0.0, 0.0, -2.0, 3.0, np.inf, -np.inf, np.nan], np.float32)
    x = cts.device_put(h)
    for s in (0.0, -0.0, 2.0, -2.0, 0.5):
        got = np.asarray(x * s)
        with np.errstate(invalid="ignore"):
            want = h * np.float32(s)
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (s, got, want)
    g = cts.grad(lambda v: cnp.sum(v * 0.0 + v * 3.0))(cts.device_put(np.ones(2, np.float32)))
    np.testing.assert_array_equal(np.asarray(g), [3.0, 3.0])
