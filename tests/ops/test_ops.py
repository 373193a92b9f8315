"""ctrainstate.numpy ops: forward values, gradients (vs float64 finite differences of a
numpy reference), sharding propagation and mesh invariance."""
import gc

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import NamedSharding, P
from conftest import bytes_in_use

rng = np.random.default_rng(0)


def fd_grad(f64, x, r, eps=1e-6):
    """Central finite differences of sum(f64(x) * r) in float64."""
    x = x.astype(np.float64)
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        g[i] = (np.sum(f64(xp) * r) - np.sum(f64(xm) * r)) / (2 * eps)
    return g


def gelu64(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


UNARY = [
    (cnp.sin, np.sin, None),
    (cnp.cos, np.cos, None),
    (cnp.tanh, np.tanh, None),
    (cnp.relu, lambda x: np.maximum(x, 0), None),
    (cnp.gelu, gelu64, None),
    (cnp.exp, np.exp, None),
    (cnp.log, np.log, "pos"),
    (cnp.sqrt, np.sqrt, "pos"),
    (cnp.rsqrt, lambda x: 1 / np.sqrt(x), "pos"),
    (cnp.square, np.square, None),
    (cnp.sigmoid, lambda x: 1 / (1 + np.exp(-x)), None),
    (cnp.abs, np.abs, None),
    (cnp.negative, np.negative, None),
    (lambda x: cnp.power(x, 3), lambda x: x ** 3, None),
    (lambda x: x * 2.5 + 1.0, lambda x: x * 2.5 + 1.0, None),
    (lambda x: 3.0 - x, lambda x: 3.0 - x, None),
    (lambda x: 2.0 / x, lambda x: 2.0 / x, "pos"),
]


def _input(shape, kind):
    x = rng.standard_normal(shape)
    if kind == "pos":
        x = np.abs(x) + 0.5
    else:  # keep away from relu/abs kinks so finite differences are meaningful
        x = np.where(np.abs(x) < 0.05, 0.3, x)
    return x.astype(np.float32)


@pytest.mark.parametrize("op,ref,kind", UNARY, ids=[str(i) for i in range(len(UNARY))])
def test_unary_forward_and_grad(op, ref, kind):
    x = _input((3, 5), kind)
    r = rng.standard_normal((3, 5))
    X = cts.device_put(x)
    np.testing.assert_allclose(np.asarray(op(X)), ref(x.astype(np.float64)), rtol=2e-6, atol=2e-6)
    R = cts.device_put(r.astype(np.float32))
    g = cts.grad(lambda v: cnp.sum(op(v) * R))(X)
    np.testing.assert_allclose(np.asarray(g), fd_grad(ref, x, r), rtol=1e-4, atol=1e-4)


BINARY = [
    (cnp.add, np.add, (4, 3), (3,)),
    (cnp.subtract, np.subtract, (4, 1), (1, 3)),
    (cnp.multiply, np.multiply, (2, 4, 3), (4, 3)),
    (cnp.divide, np.divide, (4, 3), (4, 3)),
    (cnp.maximum, np.maximum, (4, 3), (3,)),
    (lambda a, b: a @ b, lambda a, b: a @ b, (4, 3), (3, 5)),
    (lambda a, b: a @ b, lambda a, b: a @ b, (2, 4, 3), (3, 5)),
    (lambda a, b: a @ b, lambda a, b: a @ b, (2, 4, 3), (2, 3, 5)),
    (lambda a, b: cnp.einsum("bi,ij->bj", a, b), lambda a, b: a @ b, (4, 3), (3, 2)),
    (lambda a, b: cnp.einsum("bqd,bkd->bqk", a, b), lambda a, b: np.einsum("bqd,bkd->bqk", a, b), (2, 3, 4), (2, 5, 4)),
]


@pytest.mark.parametrize("op,ref,sa,sb", BINARY, ids=[str(i) for i in range(len(BINARY))])
def test_binary_forward_and_grad(op, ref, sa, sb):
    a = _input(sa, None)
    b = _input(sb, "pos") if ref is np.divide else _input(sb, None)
    if ref is np.maximum:
        b = a[0] + np.where(rng.random(sb) > 0.5, 0.5, -0.5).astype(np.float32)  # no ties
    out = ref(a.astype(np.float64), b.astype(np.float64))
    r = rng.standard_normal(out.shape)
    A, B, R = cts.device_put(a), cts.device_put(b), cts.device_put(r.astype(np.float32))
    np.testing.assert_allclose(np.asarray(op(A, B)), out, rtol=1e-5, atol=1e-5)
    ga, gb = cts.grad(lambda x, y: cnp.sum(op(x, y) * R), argnums=(0, 1))(A, B)
    np.testing.assert_allclose(np.asarray(ga), fd_grad(lambda v: ref(v, b.astype(np.float64)), a, r), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(gb), fd_grad(lambda v: ref(a.astype(np.float64), v), b, r), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("axis,keepdims", [(None, False), (0, False), (1, True), ((0, 2), False), (-1, True)])
def test_sum_mean_reshape_transpose(axis, keepdims):
    x = _input((2, 3, 4), None)
    X = cts.device_put(x)
    for f, ref in ((cnp.sum, np.sum), (cnp.mean, np.mean)):
        np.testing.assert_allclose(np.asarray(f(X, axis=axis, keepdims=keepdims)),
                                   ref(x.astype(np.float64), axis=axis, keepdims=keepdims), rtol=1e-5, atol=1e-6)
        r = rng.standard_normal(np.shape(ref(x, axis=axis, keepdims=keepdims)))
        g = cts.grad(lambda v: cnp.sum(f(v, axis=axis, keepdims=keepdims) * r.astype(np.float32)))(X)
        np.testing.assert_allclose(np.asarray(g), fd_grad(lambda v: ref(v, axis=axis, keepdims=keepdims), x, r), rtol=1e-4, atol=1e-4)
    r = rng.standard_normal((4, 2, 3))
    g = cts.grad(lambda v: cnp.sum(cnp.transpose(v, (2, 0, 1)) * r.astype(np.float32)))(X)
    np.testing.assert_allclose(np.asarray(g), np.transpose(r, (1, 2, 0)), rtol=1e-6)
    r = rng.standard_normal((6, 4))
    g = cts.grad(lambda v: cnp.sum(cnp.reshape(v, (6, 4)) * r.astype(np.float32)))(X)
    np.testing.assert_allclose(np.asarray(g), r.reshape(2, 3, 4), rtol=1e-6)


def test_value_and_grad_has_aux_and_pytrees():
    p = {"w": np.ones((3, 2), np.float32), "b": np.zeros(2, np.float32)}
    x = _input((4, 3), None)

    def f(p, x):
        y = x @ p["w"] + p["b"]
        return cnp.sum(cnp.square(y)), y

    (v, y), g = cts.value_and_grad(f, has_aux=True)(p, x)
    yr = x.astype(np.float64) @ np.ones((3, 2))
    assert np.isclose(float(v), np.sum(yr ** 2), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g["w"]), x.T.astype(np.float64) @ (2 * yr), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g["b"]), np.sum(2 * yr, axis=0), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(y), yr, rtol=1e-5)


def test_grad_of_unused_input_is_zero_and_same_input_twice():
    a = cts.device_put(np.ones(3, np.float32))
    ga, gb = cts.grad(lambda x, y: cnp.sum(x * 3.0), argnums=(0, 1))(a, a)
    assert np.asarray(ga).tolist() == [3.0] * 3 and np.asarray(gb).tolist() == [0.0] * 3
    g = cts.grad(lambda x: cnp.sum(x * x))(a)  # x used twice in one op
    assert np.asarray(g).tolist() == [2.0] * 3


def test_errors():
    a = cts.device_put(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="do not broadcast"):
        a + cts.device_put(np.ones((4,), np.float32))
    with pytest.raises(ValueError, match="contracting dimensions differ"):
        a @ cts.device_put(np.ones((2, 2), np.float32))
    ints = cts.device_put(np.arange(6, dtype=np.int32).reshape(2, 3))
    summed = ints + ints  # integer arithmetic stays int32 (jax)
    assert summed.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(summed), 2 * np.arange(6).reshape(2, 3))
    with pytest.raises(TypeError, match="bitwise_and does not accept dtype float32"):
        a & ints
    mixed = a + ints      # jax's promotion: int32 with float32 is float32
    assert mixed.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(mixed), np.asarray(a) + np.arange(6).reshape(2, 3))
    with pytest.raises(TypeError, match="scalar Array"):
        cts.grad(lambda x: x * 2.0)(a)
    with pytest.raises(ValueError, match="cannot reshape"):
        cnp.reshape(a, (4, 2))
    with pytest.raises(ValueError, match="different meshes"):
        m1 = cts.make_mesh((8,), ("x",))
        m2 = cts.make_mesh((2, 4), ("a", "b"))
        cts.device_put(np.ones(8, np.float32), NamedSharding(m1, P("x"))) + \
            cts.device_put(np.ones(8, np.float32), NamedSharding(m2, P("a")))


# --- sharding propagation -------------------------------------------------------------------

def mesh2x4():
    return cts.make_mesh((2, 4), ("data", "model"))


def test_tensor_parallel_mlp_propagation(mem_baseline):
    m = mesh2x4()
    x = _input((8, 16), None)
    w1 = _input((16, 32), None)
    w2 = _input((32, 4), None)
    X = cts.device_put(x, NamedSharding(m, P("data", None)))
    W1 = cts.device_put(w1, NamedSharding(m, P(None, "model")))
    W2 = cts.device_put(w2, NamedSharding(m, P("model", None)))
    h = X @ W1
    # no communication: each device multiplies its blocks; the result is sharded both ways
    assert h.sharding.spec == P("data", "model")
    y = cnp.relu(h) @ W2
    assert y.sharding.spec == P("data")  # all-reduced over 'model', still split over 'data'
    ref = np.maximum(x.astype(np.float64) @ w1, 0) @ w2
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)

    def loss(p, x):
        return cnp.mean(cnp.square(cnp.relu(x @ p[0]) @ p[1]))

    v, (g1, g2) = cts.value_and_grad(loss)((W1, W2), X)
    # gradients of data-replicated params: all-reduced over 'data', sharded like the params
    assert g1.sharding == W1.sharding and g2.sharding == W2.sharding
    v1, (h1, h2) = cts.value_and_grad(loss)((cts.device_put(w1), cts.device_put(w2)), cts.device_put(x))
    np.testing.assert_allclose(float(v), float(v1), rtol=1e-6)
    for got, ref in ((g1, h1), (g2, h2)):
        ref = np.asarray(ref)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    del X, W1, W2, h, y, g1, g2, h1, h2, v, v1, got
    gc.collect()
    assert bytes_in_use() == mem_baseline


def test_incompatible_operands_are_resharded_not_wrong():
    m = mesh2x4()
    a = _input((8, 8), None)
    b = _input((8, 8), None)
    ref = a.astype(np.float64) @ b
    specs = [P(), P("data"), P(None, "data"), P("model"), P(None, "model"), P("data", "model"),
             P("model", "data"), P(("data", "model")), P(None, ("model", "data"))]
    for sa in specs:
        for sb in specs:
            A = cts.device_put(a, NamedSharding(m, sa))
            B = cts.device_put(b, NamedSharding(m, sb))
            np.testing.assert_allclose(np.asarray(A @ B), ref, rtol=1e-5, atol=1e-5, err_msg=f"{sa} @ {sb}")
            np.testing.assert_allclose(np.asarray(A + B), a + b, rtol=1e-6, err_msg=f"{sa} + {sb}")


@pytest.mark.parametrize("shape", [(8,), (2, 4), (4, 2)])
def test_gradients_equal_single_device(shape):
    names = {1: ("x",), 2: ("data", "model")}[len(shape)]
    m = cts.make_mesh(shape, names)
    x = _input((8, 12), None)
    w = _input((12, 16), None)
    b = _input((16,), None)
    w2 = _input((16, 8), None)
    a0 = names[0]
    a1 = names[-1]
    shard = {
        "x": P(a0, None), "w": P(None, a1), "b": P(a1), "w2": P(a1, None),
    }

    def loss(p, x):
        h = cnp.gelu(x @ p["w"] + p["b"])
        y = cnp.sin(h @ p["w2"]) * 30.0
        return cnp.mean(cnp.square(y - 1.0)) + cnp.sum(cnp.tanh(p["b"]))

    p = {"w": w, "b": b, "w2": w2}
    v1, g1 = cts.value_and_grad(loss)({k: cts.device_put(v) for k, v in p.items()}, cts.device_put(x))
    ps = {k: cts.device_put(v, NamedSharding(m, shard[k])) for k, v in p.items()}
    xs = cts.device_put(x, NamedSharding(m, shard["x"]))
    v2, g2 = cts.value_and_grad(loss)(ps, xs)
    assert abs(float(v1) - float(v2)) <= 1e-5 * abs(float(v1))
    for k in p:
        assert g2[k].sharding == ps[k].sharding
        ref = np.asarray(g1[k])
        np.testing.assert_allclose(np.asarray(g2[k]), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_sum_over_sharded_dim_all_reduces():
    m = mesh2x4()
    x = _input((8, 4), None)
    X = cts.device_put(x, NamedSharding(m, P("data", "model")))
    s = cnp.sum(X, axis=0)
    assert s.sharding.spec == P("model")
    np.testing.assert_allclose(np.asarray(s), x.sum(0), rtol=1e-5)
    t = cnp.sum(X)
    assert t.shape == () and t.sharding.is_fully_replicated
    np.testing.assert_allclose(float(t), x.astype(np.float64).sum(), rtol=1e-5)


def test_reshape_keeps_leading_sharding():
    m = mesh2x4()
    x = _input((8, 3, 4), None)
    X = cts.device_put(x, NamedSharding(m, P("data", None, "model")))
    y = cnp.reshape(X, (8, 12))  # merges an unsharded dim into a sharded one: gathered
    np.testing.assert_array_equal(np.asarray(y), x.reshape(8, 12))
    assert y.sharding.spec == P("data")
    z = cnp.reshape(cts.device_put(x, NamedSharding(m, P("data"))), (4, 2, 12))
    assert z.sharding.spec == P("data")
    np.testing.assert_array_equal(np.asarray(z), x.reshape(4, 2, 12))


def test_with_sharding_constraint_on_activation_reshards():
    from ctrainstate import partitioning as nnp
    m = mesh2x4()
    x = cts.device_put(_input((8, 8), None), NamedSharding(m, P("data")))
    with m, nnp.axis_rules((("batch", "data"), ("hidden", "model"))):
        y = nnp.with_sharding_constraint(x, ("batch", "hidden"))
    assert y.sharding.spec == P("data", "model")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_ops_match_jax_when_installed():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x = _input((6, 5), None)
    w = _input((5, 7), None)

    def f_ct(w, x):
        return cnp.mean(cnp.gelu(x @ w) * cnp.cos(x @ w))

    def f_jax(w, x):
        return jnp.mean(jax.nn.gelu(x @ w) * jnp.cos(x @ w))

    v, g = cts.value_and_grad(f_ct)(w, x)
    jv, jg = jax.value_and_grad(f_jax)(w, x)
    np.testing.assert_allclose(float(v), float(jv), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g), np.asarray(jg), rtol=1e-4, atol=1e-6)


def test_mean_var_std_of_an_empty_axis_are_nan_as_in_jax():
    e = cnp.zeros((0, 4))
    assert np.isnan(float(cnp.mean(e))) and np.isnan(float(cnp.var(e)))
    assert np.isnan(np.asarray(cnp.mean(e, axis=0))).all()
    assert np.isnan(np.asarray(cnp.std(e, axis=0))).all()
    assert np.asarray(cnp.mean(e, axis=1)).shape == (0,)
    assert float(cnp.sum(e)) == 0.0


def test_min_of_an_empty_axis_names_min():
    with pytest.raises(ValueError, match="min: zero-size dimension 0 .* has no minimum"):
        cnp.min(cnp.zeros((0, 4)), axis=0)
    with pytest.raises(ValueError, match="max: zero-size dimension 1 .* has no maximum"):
        cnp.max(cnp.zeros((3, 0)))


def test_nested_grad_of_outer_values_is_refused_not_silently_wrong():
    """The inner backward pass is not differentiated: grad(grad(f)) gave 0.0 (jax: f'') and a
    MAML-style inner step lost its second-order term. Such nesting now raises; an inner
    gradient that does not depend on the outer values (or on their stop_gradient) works."""
    x = np.array([1.0, 2.0], np.float32)
    cube = lambda w: cnp.sum(w ** 3)   # noqa: E731
    with pytest.raises(NotImplementedError, match="higher-order derivatives"):
        cts.grad(cts.grad(lambda a: a ** 3))(cts.device_put(np.float32(2.0)))
    with pytest.raises(NotImplementedError, match="higher-order derivatives"):
        cts.grad(lambda w: cube(w - 0.1 * cts.grad(cube)(w)))(cts.device_put(x))
    with pytest.raises(NotImplementedError, match="higher-order derivatives"):   # closes over w
        cts.grad(lambda w: cnp.sum(cts.grad(lambda a: cnp.sum(a * w))(cts.device_put(x))))(
            cts.device_put(x))
    # independent inner gradients: d/dw [sum(w * w) + sum(grad_a sum(a * sg(w)))] = 2 w
    g = cts.grad(lambda w: cnp.sum(w * w) + cnp.sum(
        cts.grad(lambda a: cnp.sum(a * cts.lax.stop_gradient(w)))(cts.device_put(x))))(
        cts.device_put(x))
    np.testing.assert_allclose(np.asarray(g), 2 * x)
    g = cts.grad(lambda w: cnp.sum(w) + cnp.sum(cts.grad(lambda a: cnp.sum(a * a))(
        cts.device_put(x))))(cts.device_put(x))
    np.testing.assert_allclose(np.asarray(g), [1.0, 1.0])


def test_axis_and_shape_arguments_in_the_forms_jax_takes():
    """numpy-integer axes, int shapes, tuple axes for expand_dims, concatenate(axis=None) and
    a numpy array as a shape: each raised an internal TypeError."""
    from ctrainstate import nn
    x = np.arange(24.0, dtype=np.float32).reshape(2, 3, 4)
    a = cts.device_put(x)
    ax = np.int64(1)
    np.testing.assert_allclose(np.asarray(cnp.sum(a, axis=ax)), x.sum(axis=1))
    np.testing.assert_allclose(np.asarray(cnp.mean(a, axis=(np.int32(0), 2))), x.mean(axis=(0, 2)))
    np.testing.assert_allclose(np.asarray(a.max(axis=ax)), x.max(axis=1))
    np.testing.assert_allclose(np.asarray(nn.softmax(a, axis=ax)).sum(axis=1), 1.0, rtol=1e-6)
    with pytest.raises(TypeError, match="axis must be None, an int or a tuple of ints"):
        cnp.sum(a, axis=1.5)
    assert cnp.expand_dims(a, (0, -1)).shape == (1, 2, 3, 4, 1)
    assert cnp.expand_dims(a, [0, 2]).shape == (1, 2, 1, 3, 4)
    with pytest.raises(ValueError, match="repeated axis"):
        cnp.expand_dims(a, (0, 0))
    assert cnp.reshape(a, 24).shape == (24,)
    assert a.reshape(np.array([4, 6])).shape == (4, 6)
    assert cnp.broadcast_to(cts.device_put(np.float32(2.0)), 3).shape == (3,)
    np.testing.assert_array_equal(np.asarray(cnp.concatenate([a, a], axis=None)),
                                  np.concatenate([x, x], axis=None))


def test_nested_grad_guard_also_covers_checkpointed_inner_functions():
    """cts.checkpoint runs the inner function on a probe tape of its own; the guard applies
    there too (it gave a silently wrong gradient penalty)."""
    w = np.array([1.5, -2.0], np.float32)
    x = np.array([0.5, 3.0], np.float32)
    f = lambda x, w: cnp.sum(cnp.sin(w * x) * w)   # noqa: E731
    pen = lambda w: cnp.sum(cts.grad(cts.checkpoint(f))(x, w) ** 2)   # noqa: E731
    with pytest.raises(NotImplementedError, match="higher-order derivatives"):
        cts.grad(pen)(cts.device_put(w))
    # a checkpointed function inside a plain (first-order) grad still works
    g = cts.grad(lambda w: cts.checkpoint(f)(x, w))(cts.device_put(w))
    np.testing.assert_allclose(np.asarray(g), np.sin(w * x) + w * x * np.cos(w * x), rtol=1e-5)
