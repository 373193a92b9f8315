"""Max/min reductions, stop_gradient, softmax / log_softmax / logsumexp and the softmax
cross-entropies: values against float64 numpy references computed here, gradients against
hand-derived values and against jax / optax (recorded values: tests/recorded.py), and the same
results on every mesh with the reduced dimension sharded."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import _C, nn, optim
from ctrainstate.lax import stop_gradient

MESHES = [((1,), ("x",)), ((8,), ("x",)), ((2, 4), ("data", "model")), ((4, 2), ("data", "model"))]


def _np_log_softmax(x, axis=-1):
    x = x.astype(np.float64)
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def _shardings(shape, names):
    """Specs that shard dimension 1 (the reduced one in these tests) several ways."""
    mesh = cts.make_mesh(shape, names)
    if len(names) == 1:
        specs = [cts.P(), cts.P(None, "x"), cts.P("x", None)]
    else:
        specs = [cts.P(None, "model"), cts.P("data", "model"), cts.P(None, ("data", "model")),
                 cts.P("model", None)]
    return [cts.NamedSharding(mesh, s) for s in specs]


# --- max / min ---------------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2), (1, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_max_min_equal_numpy(axis, keepdims):
    x = np.random.default_rng(0).standard_normal((3, 5, 7)).astype(np.float32)
    a = cts.device_put(x)
    np.testing.assert_array_equal(np.asarray(cnp.max(a, axis=axis, keepdims=keepdims)),
                                  np.max(x, axis=axis, keepdims=keepdims))
    np.testing.assert_array_equal(np.asarray(cnp.min(a, axis=axis, keepdims=keepdims)),
                                  np.min(x, axis=axis, keepdims=keepdims))
    np.testing.assert_array_equal(np.asarray(a.max(axis=axis, keepdims=keepdims)),
                                  x.max(axis=axis, keepdims=keepdims))


def test_max_special_values_and_shapes():
    x = np.array([[1.0, np.nan, 3.0], [-np.inf, -np.inf, -np.inf], [np.inf, 2.0, -1.0]], np.float32)
    np.testing.assert_array_equal(np.asarray(cnp.max(x, axis=1)), [np.nan, -np.inf, np.inf])
    np.testing.assert_array_equal(np.asarray(cnp.min(x, axis=1)), [np.nan, -np.inf, -1.0])
    assert float(np.asarray(cnp.max(np.float32(2.5)))) == 2.5            # 0-d
    assert float(np.asarray(cnp.amax(np.arange(7, dtype=np.float32)))) == 6.0
    assert float(np.asarray(cnp.amin(np.arange(7, dtype=np.float32) + 1))) == 1.0
    with pytest.raises(ValueError, match="zero-size"):
        cnp.max(np.zeros((2, 0), np.float32), axis=1)
    np.testing.assert_array_equal(np.asarray(cnp.max(np.zeros((0, 3), np.float32), axis=1)),
                                  np.zeros((0,), np.float32))


def test_sums_over_empty_dimensions_are_zero():
    # a zero-length reduced dimension (the innermost one included) sums to 0, as numpy
    for shape, axis in (((2, 0), None), ((2, 0), 1), ((0, 3), 0), ((2, 0, 3), (1, 2)), ((3, 0), -1)):
        x = np.zeros(shape, np.float32)
        np.testing.assert_array_equal(np.asarray(cnp.sum(x, axis=axis)), np.sum(x, axis=axis),
                                      err_msg=f"{shape} {axis}")


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_max_on_meshes_equals_one_device(mesh_shape, names):
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32) * 10
    x[3, 11] = 100.0
    for sh in _shardings(mesh_shape, names):
        a = cts.device_put(x, sh)
        for axis in (None, 0, 1):
            np.testing.assert_array_equal(np.asarray(cnp.max(a, axis=axis)), x.max(axis=axis),
                                          err_msg=f"{sh.spec} axis {axis}")
            np.testing.assert_array_equal(np.asarray(cnp.min(a, axis=axis)), x.min(axis=axis),
                                          err_msg=f"{sh.spec} axis {axis}")


def test_max_gradient_splits_ties():
    # d/dx sum_i w_i max_j x_ij: w_i on the row's maximum, split equally among ties
    x = np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0], [5.0, 5.0, 5.0]], np.float32)
    w = np.array([1.0, 2.0, 3.0], np.float32)
    g = cts.grad(lambda v: cnp.sum(cnp.max(v, axis=1) * w))(cts.device_put(x))
    np.testing.assert_allclose(np.asarray(g), [[0, 0.5, 0.5], [2, 0, 0], [1, 1, 1]], rtol=1e-6)
    gmin = cts.grad(lambda v: cnp.sum(cnp.min(v, axis=0)))(cts.device_put(x))
    np.testing.assert_allclose(np.asarray(gmin), [[1, 0, 0], [0, 1, 1], [0, 0, 0]], rtol=1e-6)


@pytest.mark.parametrize("mesh_shape,names", MESHES[1:])
def test_max_gradient_on_meshes_equals_one_device(mesh_shape, names):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    w = rng.standard_normal((8,)).astype(np.float32)
    f = lambda v: cnp.sum(cnp.max(v, axis=1) * w)  # noqa: E731
    ref = np.asarray(cts.grad(f)(cts.device_put(x)))
    for sh in _shardings(mesh_shape, names):
        np.testing.assert_allclose(np.asarray(cts.grad(f)(cts.device_put(x, sh))), ref, rtol=1e-6,
                                   err_msg=str(sh.spec))


def test_max_matches_jax(jax_ref):
    rng = np.random.default_rng(3)
    x = np.round(rng.standard_normal((4, 6, 5)), 1).astype(np.float32)  # rounding makes ties
    for axis in (None, 0, (1, 2), -1):
        f = lambda v: cnp.sum(cnp.max(v, axis=axis) * 1.5)  # noqa: E731
        want = jax_ref(f"grad {axis}", lambda jax, jnp: jax.grad(
            lambda v: jnp.sum(jnp.max(v, axis=axis) * 1.5))(x))
        np.testing.assert_allclose(np.asarray(cts.grad(f)(cts.device_put(x))), want, rtol=1e-6,
                                   err_msg=str(axis))


def test_max_eval_shape():
    s = cts.eval_shape(lambda v: cnp.max(v, axis=0, keepdims=True),
                       cts.ShapeDtypeStruct((3, 4), np.float32))
    assert s.shape == (1, 4)


def test_reduce_and_allreduce_reject_unknown_ops():
    code = cts._src.base.dtypes.code(np.dtype(np.float32))
    b = _C.Buffer(0, (4,), code)
    o = _C.Buffer(0, (1,), code)
    with pytest.raises(ValueError, match="unknown reduction"):
        _C.op_reduce([b], 7, 1, [o])
    with pytest.raises(ValueError, match="unknown reduction"):
        _C.op_allreduce([[b]], 5)


def test_allreduce_max_over_cpu_devices():
    devs = cts.devices("cpu")
    if len(devs) < 2:
        pytest.skip("needs 2 CPU devices (CTRAINSTATE_NUM_CPU_DEVICES)")
    code = cts._src.base.dtypes.code(np.dtype(np.float32))
    xs = [np.array([1.0, -5.0, np.nan, 2.0], np.float32), np.array([3.0, -7.0, 0.0, 2.0], np.float32)]
    bufs = []
    for d, x in zip(devs[:2], xs):
        b = _C.Buffer(d.id, (4,), code)
        _C.copy_from_host(b, x, (0,))
        bufs.append(b)
    _C.op_allreduce([bufs], 1)
    for b in bufs:
        got = np.empty(4, np.float32)
        _C.copy_to_host(b, got, (0,))
        np.testing.assert_array_equal(got, [3.0, -5.0, np.nan, 2.0])


# --- stop_gradient -----------------------------------------------------------------------------

def test_stop_gradient():
    x = cts.device_put(np.array([1.0, -2.0, 3.0], np.float32))
    # d/dx sum(x * sg(x)) = sg(x) = x, not 2x
    g = cts.grad(lambda v: cnp.sum(v * stop_gradient(v)))(x)
    np.testing.assert_allclose(np.asarray(g), [1.0, -2.0, 3.0])
    assert stop_gradient(x) is x                      # nothing is traced: the values themselves
    tree = {"a": x, "b": np.ones(2, np.float32)}
    g2 = cts.grad(lambda t: cnp.sum(t["a"] * stop_gradient(t)["a"]) + cnp.sum(t["b"]))(tree)
    np.testing.assert_allclose(np.asarray(g2["a"]), [1.0, -2.0, 3.0])


# --- softmax family ----------------------------------------------------------------------------

def test_softmax_family_values_are_stable():
    x = np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1001.0, -1002.0], [0.1, 0.2, 0.3]], np.float32)
    ref = _np_log_softmax(x)
    np.testing.assert_allclose(np.asarray(nn.log_softmax(x)), ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(nn.softmax(x)), np.exp(ref), rtol=1e-6, atol=1e-7)
    x64 = x.astype(np.float64)
    m = x64.max(axis=1)
    np.testing.assert_allclose(np.asarray(nn.logsumexp(x, axis=1)),
                               m + np.log(np.exp(x64 - m[:, None]).sum(axis=1)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nn.softmax(x, axis=0)), np.exp(_np_log_softmax(x, 0)),
                               rtol=1e-5, atol=1e-7)
    assert np.asarray(nn.logsumexp(x, axis=1, keepdims=True)).shape == (3, 1)
    assert np.asarray(nn.logsumexp(x)).shape == ()
    # rows of -inf give -inf, a +inf gives +inf (jax's rule for the shift)
    e = np.array([[-np.inf, -np.inf], [np.inf, 0.0]], np.float32)
    np.testing.assert_array_equal(np.asarray(nn.logsumexp(e, axis=1)), [-np.inf, np.inf])
    with pytest.raises(NotImplementedError):
        nn.softmax(x, where=x > 0)


def test_log_softmax_gradient_is_softmax_minus_onehot():
    # d/dz [-log_softmax(z)[k]] = softmax(z) - e_k, derived by hand
    z = np.array([[0.5, -1.0, 2.0, 0.0], [3.0, 3.0, -2.0, 1.0]], np.float32)
    k = np.array([2, 0])
    onehot = np.eye(4, dtype=np.float32)[k]
    g = cts.grad(lambda v: -cnp.sum(nn.log_softmax(v) * onehot))(cts.device_put(z))
    np.testing.assert_allclose(np.asarray(g), np.exp(_np_log_softmax(z)) - onehot, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_cross_entropy_on_meshes(mesh_shape, names):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((8, 16)) * 20).astype(np.float32)
    lab = rng.integers(0, 16, 8)
    onehot = np.eye(16, dtype=np.float32)[lab]
    want = -(_np_log_softmax(x) * onehot).sum(axis=1)
    want_grad = (np.exp(_np_log_softmax(x)) - onehot) / 8
    for sh in _shardings(mesh_shape, names):
        a = cts.device_put(x, sh)
        np.testing.assert_allclose(np.asarray(optim.softmax_cross_entropy_with_integer_labels(a, lab)),
                                   want, rtol=1e-5, atol=1e-5, err_msg=str(sh.spec))
        np.testing.assert_allclose(np.asarray(optim.softmax_cross_entropy(a, onehot)), want,
                                   rtol=1e-5, atol=1e-5, err_msg=str(sh.spec))
        g = cts.grad(lambda v: cnp.mean(optim.softmax_cross_entropy_with_integer_labels(v, lab)))(a)
        np.testing.assert_allclose(np.asarray(g), want_grad, rtol=1e-4, atol=1e-7, err_msg=str(sh.spec))


def test_integer_label_cross_entropy_checks_labels():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        optim.softmax_cross_entropy_with_integer_labels(x, np.array([0, 3]))
    with pytest.raises(ValueError, match="expected"):
        optim.softmax_cross_entropy_with_integer_labels(x, np.array([0, 1, 2]))
    with pytest.raises(TypeError, match="integers"):
        optim.softmax_cross_entropy_with_integer_labels(x, np.array([0.0, 1.0]))
    # the class axis may be another one
    x3 = np.random.default_rng(6).standard_normal((3, 2)).astype(np.float32)
    got = np.asarray(optim.softmax_cross_entropy_with_integer_labels(x3, np.array([2, 0]), axis=0))
    np.testing.assert_allclose(got, -_np_log_softmax(x3, 0)[[2, 0], [0, 1]], rtol=1e-5)


def test_softmax_family_matches_jax_and_optax(jax_ref):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((5, 3, 11)) * 8).astype(np.float32)
    lab = rng.integers(0, 11, (5, 3))
    for axis in (-1, 1, (0, 2)):
        np.testing.assert_allclose(np.asarray(nn.logsumexp(x, axis=axis)),
                                   jax_ref(f"logsumexp {axis}", lambda jax: jax.nn.logsumexp(x, axis=axis)),
                                   rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(nn.softmax(x, axis=1)),
                               jax_ref("softmax", lambda jax: jax.nn.softmax(x, axis=1)),
                               rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(nn.log_softmax(x)),
                               jax_ref("log_softmax", lambda jax: jax.nn.log_softmax(x)),
                               rtol=2e-6, atol=2e-6)

    def cej(jnp, optax):
        return lambda v: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(v, lab))

    ce = lambda v: cnp.sum(optim.softmax_cross_entropy_with_integer_labels(v, lab))  # noqa: E731
    np.testing.assert_allclose(float(np.asarray(ce(x))),
                               float(jax_ref("ce", lambda jnp, optax: cej(jnp, optax)(x))), rtol=2e-6)
    np.testing.assert_allclose(np.asarray(cts.grad(ce)(cts.device_put(x))),
                               jax_ref("ce grad", lambda jax, jnp, optax: jax.grad(cej(jnp, optax))(x)),
                               rtol=1e-5, atol=1e-7)
    sm = lambda v: cnp.sum(nn.softmax(v) * np.arange(11, dtype=np.float32))  # noqa: E731
    want = jax_ref("softmax grad", lambda jax, jnp: jax.grad(
        lambda v: jnp.sum(jax.nn.softmax(v) * jnp.arange(11.0)))(x))
    np.testing.assert_allclose(np.asarray(cts.grad(sm)(cts.device_put(x))), want, rtol=1e-4, atol=1e-6)
