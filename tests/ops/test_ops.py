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


def _input(shape, kind, gen=None):
    x = (rng if gen is None else gen).standard_normal(shape)
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
    # size-1 dimensions hold no data: one before a sharded dimension, dropped, moved or
    # added, leaves that dimension's mesh axes on it (nothing gathered), as jax does
    w = _input((1, 8, 4), None)
    W = cts.device_put(w, NamedSharding(m, P(None, "data", "model")))
    for y, shape, spec in ((cnp.squeeze(W, 0), (8, 4), P("data", "model")),
                           (cnp.reshape(W, (8, 4)), (8, 4), P("data", "model")),
                           (cnp.reshape(W, (8, 1, 4)), (8, 1, 4), P("data", None, "model")),
                           (cnp.reshape(W, (1, 1, 8, 4)), (1, 1, 8, 4),
                            P(None, None, "data", "model"))):
        assert y.sharding.spec == spec, shape
        np.testing.assert_array_equal(np.asarray(y), w.reshape(shape))
        assert all(b[1].nbytes == 4 * 4 for b in y._blocks)  # (8 / 2) x (4 / 4) floats each


def test_with_sharding_constraint_on_activation_reshards():
    from ctrainstate import partitioning as nnp
    m = mesh2x4()
    x = cts.device_put(_input((8, 8), None), NamedSharding(m, P("data")))
    with m, nnp.axis_rules((("batch", "data"), ("hidden", "model"))):
        y = nnp.with_sharding_constraint(x, ("batch", "hidden"))
    assert y.sharding.spec == P("data", "model")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_ops_match_jax(jax_ref):
    gen = np.random.default_rng(11)     # (not the module's rng: the same inputs in any selection)
    x = _input((6, 5), None, gen)
    w = _input((5, 7), None, gen)

    def f_ct(w, x):
        return cnp.mean(cnp.gelu(x @ w) * cnp.cos(x @ w))

    def f_jax(jax, jnp):
        return jax.value_and_grad(lambda w, x: jnp.mean(jax.nn.gelu(x @ w) * jnp.cos(x @ w)))(w, x)

    v, g = cts.value_and_grad(f_ct)(w, x)
    jv, jg = jax_ref("value_and_grad", f_jax)
    np.testing.assert_allclose(float(v), float(jv), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g), np.asarray(jg), rtol=1e-4, atol=1e-6)


def test_mean_var_std_of_an_empty_axis_are_nan_as_in_jax():
    e = cnp.zeros((0, 4))
    assert np.isnan(float(cnp.mean(e))) and np.isnan(float(cnp.var(e)))
    assert np.isnan(np.asarray(cnp.mean(e, axis=0))).all()
    assert np.isnan(np.asarray(cnp.std(e, axis=0))).all()
    assert np.asarray(cnp.mean(e, axis=1)).shape == (0,)
    assert float(cnp.sum(e)) == 0.0


def test_mean_of_all_elements_gives_the_general_paths_bits():
    """``cnp.mean(x)`` of a float32 Array (numpy.mean's direct path: sum, times 1 / n) gives
    the bits of the general path (an axis naming every dimension), value and gradient, on one
    device and sharded over a mesh."""
    x = _input((6, 8), None)
    r = rng.standard_normal((6, 8)).astype(np.float32)
    for sharding in (None, _mesh_sharding(P("data", "model"))):
        X = cts.device_put(x, sharding) if sharding is not None else cts.device_put(x)
        R = cts.device_put(r, sharding) if sharding is not None else cts.device_put(r)
        direct, general = cnp.mean(X), cnp.mean(X, axis=(0, 1))
        assert direct.shape == general.shape == ()
        assert np.asarray(direct).tobytes() == np.asarray(general).tobytes()
        gd = cts.grad(lambda v: cnp.mean(v * R))(X)
        gg = cts.grad(lambda v: cnp.mean(v * R, axis=(0, 1)))(X)
        assert gd.sharding == gg.sharding
        assert np.asarray(gd).tobytes() == np.asarray(gg).tobytes()
        np.testing.assert_allclose(np.asarray(gd), r / x.size, rtol=1e-6)


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


# --- jax.numpy parity bugs found by probing ctrainstate.numpy against jax: each checked against
# a numpy computation and against jax (recorded values: tests/recorded.py).

def _mesh_sharding(spec):
    return cts.NamedSharding(cts.make_mesh((2, 4), ("data", "model")), cts.P(*spec))


DOT_SHAPES = [((2, 3, 4), (2, 4, 5)), ((4,), (2, 4, 5)), ((3, 4), (3, 4, 2)),
              ((2, 1, 3, 4), (5, 4, 2)), ((2, 3, 4), (4, 5)), ((3,), (3,)), ((), (3,)),
              ((2, 3), ())]


@pytest.mark.parametrize("sa,sb", DOT_SHAPES)
def test_dot_follows_np_dot_shapes(sa, sb):
    rng = np.random.default_rng(0)
    a = rng.standard_normal(sa).astype(np.float32)
    b = rng.standard_normal(sb).astype(np.float32)
    want = np.dot(a.astype(np.float64), b.astype(np.float64))     # numpy's dot: jnp's contract
    got = cnp.dot(cts.device_put(a), cts.device_put(b))
    assert got.shape == np.shape(want) and got.dtype == np.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_dot_nd_sharded_and_gradient():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 3, 4)).astype(np.float32)
    b = rng.standard_normal((2, 4, 8)).astype(np.float32)
    want = np.dot(a.astype(np.float64), b.astype(np.float64))
    sa = cts.device_put(a, _mesh_sharding(("data", None, None)))
    sb = cts.device_put(b, _mesh_sharding((None, None, "model")))
    np.testing.assert_allclose(np.asarray(cnp.dot(sa, sb)), want, rtol=1e-5, atol=1e-5)
    # d/da sum(dot(a, b)) = sum of b over its first and last axes, broadcast over a's rows
    ga = cts.grad(lambda u: cnp.sum(cnp.dot(u, b)))(a)
    np.testing.assert_allclose(np.asarray(ga), np.broadcast_to(b.sum(axis=(0, 2)), a.shape),
                               rtol=1e-5, atol=1e-5)


def test_dot_abstract_shape():
    S = cts.ShapeDtypeStruct
    out = cts.eval_shape(cnp.dot, S((2, 3, 4), np.float32), S((2, 4, 5), np.float32))
    assert tuple(out.shape) == (2, 3, 2, 5)


def test_dot_parity_with_jax(jax_ref):
    rng = np.random.default_rng(2)
    for sa, sb in DOT_SHAPES:
        a = rng.standard_normal(sa).astype(np.float32)
        b = rng.standard_normal(sb).astype(np.float32)
        want = jax_ref(f"{sa} {sb}", lambda jnp: jnp.dot(a, b))
        got = cnp.dot(a, cts.device_put(b))
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
@pytest.mark.parametrize("axis", [None, 0, -1, (0, 1)])
def test_var_std_of_ints_are_float32(dtype, axis):
    x = (np.arange(32).reshape(4, 8) * 7 % 5).astype(dtype)
    for f in ("var", "std"):
        want = getattr(np, f)(x.astype(np.float64), axis=axis)
        for a in (cts.device_put(x), cts.device_put(x, _mesh_sharding(("data", "model")))):
            got = getattr(cnp, f)(a, axis=axis)
            assert got.dtype == np.float32, f
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["log1p", "expm1"])
def test_float_unaries_of_ints_promote(name):
    x = np.arange(-0, 6, dtype=np.int32)
    got = getattr(cnp, name)(cts.device_put(x))
    assert got.dtype == np.float32
    np.testing.assert_allclose(np.asarray(got), getattr(np, name)(x.astype(np.float64)), rtol=1e-6)


def test_var_std_of_ints_parity(jax_ref):
    x = (np.arange(32).reshape(4, 8) * 7 % 5).astype(np.int32)
    for f in ("var", "std", "log1p", "expm1"):
        want, got = jax_ref(f, lambda jnp: getattr(jnp, f)(x)), getattr(cnp, f)(cts.device_put(x))
        assert got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_pow_by_strong_numpy_float_promotes():
    x16 = np.array([1.5, 2.0, -3.0], np.float16)
    for p, want_dt in ((np.float32(2.0), np.float32), (np.float16(2.0), np.float16), (2.0, np.float16),
                       (2, np.float16), (np.int32(2), np.float16)):
        got = cts.device_put(x16) ** p
        assert got.dtype == want_dt, (p, got.dtype)
        np.testing.assert_array_equal(np.asarray(got).astype(np.float32),
                                      (x16.astype(np.float32) ** 2).astype(want_dt))
    got = cts.device_put(np.array([1, -2, 3], np.int32)) ** np.float32(2.0)
    assert got.dtype == np.float32 and np.asarray(got).tolist() == [1.0, 4.0, 9.0]


def test_pow_by_numpy_scalar_parity(jax_ref):
    for x in (np.array([1.5, 2.0, -3.0], np.float16), np.array([1.5, 2.0], cnp.bfloat16)):
        for p in (np.float32(2.0), np.float16(2.0), 2.0, 2):
            want = jax_ref(f"{x.dtype} {type(p).__name__}", lambda jnp: jnp.asarray(x) ** p)
            got = cts.device_put(x) ** p
            assert got.dtype == want.dtype, (x.dtype, p)
            np.testing.assert_array_equal(np.asarray(got).astype(np.float32),
                                          want.astype(np.float32))


@pytest.mark.parametrize("target", [(4, 1), (1, 8), (8,), (), (2, 4, 1)])
def test_broadcast_to_refuses_non_broadcast_shapes(target):
    x = cts.device_put(np.ones((4, 8), np.float32))
    with pytest.raises(ValueError, match="broadcast_to"):
        cnp.broadcast_to(x, target)
    with pytest.raises(ValueError, match="broadcast_to"):
        cnp.broadcast_to(np.ones((4, 8), np.int32), target)
    with pytest.raises(ValueError, match="broadcast_to"):
        cts.eval_shape(lambda a: cnp.broadcast_to(a, target),
                       cts.ShapeDtypeStruct((4, 8), np.float32))


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.bool_])
def test_broadcast_to_int_and_bool(dtype):
    rng = np.random.default_rng(3)
    x = rng.integers(0, 7, (1, 8)).astype(dtype)
    want = np.broadcast_to(x, (2, 4, 8))          # numpy's broadcast: the same values
    for a in (x, cts.device_put(x), cts.device_put(x, _mesh_sharding((None, "model")))):
        got = cnp.broadcast_to(a, (2, 4, 8))
        assert got.dtype == dtype and got.shape == (2, 4, 8)
        np.testing.assert_array_equal(np.asarray(got), want)
    sharded = cnp.broadcast_to(cts.device_put(x, _mesh_sharding((None, "model"))), (4, 8))
    assert sharded.sharding.spec == cts.P(None, "model")
    assert cnp.broadcast_to(True, (3,)).dtype == np.bool_
    assert cnp.broadcast_to(2, (3,)).dtype == np.int32


def test_broadcast_to_parity(jax_ref):
    for i, x in enumerate((np.array([[True], [False], [True]]), np.arange(3, dtype=np.int32)[:, None],
                           True, 3)):
        want = jax_ref(f"case {i}", lambda jnp: jnp.broadcast_to(x, (2, 3, 4)))
        got = cnp.broadcast_to(x, (2, 3, 4))
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), want)


def test_norms_of_ints_are_float32():
    xf = np.array([[3, -4, 0], [1, 2, -2]], np.float64)
    x = cts.device_put(xf.astype(np.int32))
    for got, want in ((cnp.linalg.norm(x), np.linalg.norm(xf)),
                      (cnp.linalg.norm(x, ord=1, axis=1), np.linalg.norm(xf, ord=1, axis=1)),
                      (cnp.linalg.norm(x, ord=np.inf, axis=0), np.linalg.norm(xf, ord=np.inf, axis=0)),
                      (cnp.linalg.vector_norm(x), np.linalg.norm(xf.ravel())),
                      (cnp.linalg.matrix_norm(x), np.linalg.norm(xf, "fro"))):
        assert got.dtype == np.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def _shift_tokens_right(ids, np_, start=7, pad=0):
    s = np_.zeros_like(ids)
    s = s.at[:, 1:].set(ids[:, :-1])
    s = s.at[:, 0].set(start)
    return np_.where(s == -100, pad, s)


def test_shift_tokens_right_on_int_ids():
    rng = np.random.default_rng(4)
    ids = rng.integers(-100, 50, (4, 8)).astype(np.int32)
    ids[0, 3] = -100
    want = np.zeros_like(ids)                  # numpy, by hand: the same shift
    want[:, 1:] = ids[:, :-1]
    want[:, 0] = 7
    want[want == -100] = 0
    for a in (cts.device_put(ids), cts.device_put(ids, _mesh_sharding(("data", None))),
              cts.device_put(ids, _mesh_sharding(("data", "model")))):
        got = _shift_tokens_right(a, cnp)
        assert got.dtype == np.int32 and got.sharding == a.sharding
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("ddof", [0, 1, 3, 8])
@pytest.mark.parametrize("axis", [None, 0, -1])
def test_var_std_ddof(ddof, axis):
    x = np.random.default_rng(6).standard_normal((8, 8)).astype(np.float32)
    xd = x.astype(np.float64)
    n = xd.size if axis is None else xd.shape[axis]
    # numpy's var with ddof, NaN where N - ddof <= 0 (jnp's rule; numpy gives inf there)
    want = np.var(xd, axis=axis, ddof=ddof) if n > ddof else np.full(np.var(xd, axis=axis).shape, np.nan)
    for a in (cts.device_put(x), cts.device_put(x, _mesh_sharding(("data", "model")))):
        np.testing.assert_allclose(np.asarray(cnp.var(a, axis=axis, ddof=ddof)), want, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(a.std(axis=axis, ddof=ddof)), np.sqrt(want), rtol=1e-5)


def test_array_methods_delegate_to_numpy_functions():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    xi = rng.integers(-5, 5, (4, 8)).astype(np.int32)
    a, ai = cts.device_put(x), cts.device_put(xi)
    close = np.testing.assert_allclose
    close(np.asarray(a.var(axis=0)), x.astype(np.float64).var(axis=0), rtol=1e-5)
    close(np.asarray(ai.std()), xi.astype(np.float64).std(), rtol=1e-6)
    close(np.asarray(a.prod(axis=1, keepdims=True)), x.prod(axis=1, keepdims=True), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(ai.cumsum(axis=1)), xi.cumsum(axis=1))
    assert ai.cumsum(dtype=np.float32).dtype == np.float32
    close(np.asarray(a.round(1)), np.round(x, 1), rtol=1e-6)
    close(np.asarray(a.dot(x.T)), x.astype(np.float64) @ x.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(a.take(np.array([0, 9]), axis=1, mode="clip")),
                                  x[:, [0, 7]])
    np.testing.assert_array_equal(np.asarray(a.sort(axis=0)), np.sort(x, axis=0))
    np.testing.assert_array_equal(np.asarray(ai.argsort(axis=-1)),
                                  np.argsort(xi, axis=-1, kind="stable"))
    np.testing.assert_array_equal(np.asarray(a.repeat(2, axis=1)), x.repeat(2, axis=1))
    np.testing.assert_array_equal(np.asarray(a.swapaxes(0, 1)), x.T)


def test_var_std_ddof_and_methods_parity(jax_ref):
    x = np.random.default_rng(8).standard_normal((8, 8)).astype(np.float32)
    for ddof in (0, 1, 8):
        for f in ("var", "std"):
            want = jax_ref(f"{f} ddof {ddof}", lambda jnp: getattr(jnp, f)(x, axis=0, ddof=ddof))
            got = getattr(cnp, f)(x, axis=0, ddof=ddof)
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    a = cts.device_put(x)
    for name, args, kw in (("var", (), {"ddof": 1}), ("std", (0,), {}), ("prod", (1,), {}),
                           ("cumsum", (0,), {}), ("round", (2,), {}), ("dot", (x,), {}),
                           ("sort", (), {}), ("argsort", (0,), {}), ("swapaxes", (0, 1), {})):
        want = jax_ref(f"method {name}", lambda jnp: getattr(jnp.asarray(x), name)(*args, **kw))
        got = getattr(a, name)(*args, **kw)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis", [None, 0, 1])
@pytest.mark.filterwarnings("ignore:Mean of empty slice:RuntimeWarning")
def test_sum_mean_where(axis):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((8, 8)).astype(np.float32)
    m = rng.integers(0, 2, (8, 8)).astype(bool)
    m[3] = False                                   # a row with nothing selected
    xd = x.astype(np.float64)
    # numpy references: np.sum / np.mean with where= (mean: NaN where nothing is selected)
    with np.errstate(invalid="ignore", divide="ignore"):
        want_mean = np.mean(xd, axis=axis, where=m)
    want_sum = np.sum(xd, axis=axis, where=m)
    for a in (cts.device_put(x), cts.device_put(x, _mesh_sharding(("data", "model")))):
        np.testing.assert_allclose(np.asarray(cnp.sum(a, axis=axis, where=m)), want_sum,
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(cnp.mean(a, axis=axis, where=m)), want_mean,
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(a.mean(axis=axis, where=m)), want_mean,
                                   rtol=1e-5, atol=1e-6)
    xi = rng.integers(-5, 5, (8, 8)).astype(np.int32)
    got = cnp.sum(cts.device_put(xi), axis=axis, where=m)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(got), np.sum(xi, axis=axis, where=m))
    # d/dx mean(x**2, where=m) = 2 x m / count(m)
    g = cts.grad(lambda u: cnp.mean(u * u, where=m))(x)
    np.testing.assert_allclose(np.asarray(g), 2 * xd * m / m.sum(), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="broadcast"):
        cnp.mean(x, where=m[:3])


def test_sum_mean_where_parity(jax_ref):
    rng = np.random.default_rng(10)
    x = rng.standard_normal((8, 8)).astype(np.float32)
    m = rng.integers(0, 2, (1, 8)).astype(bool)
    for arr in (x, x.astype(np.float16), (x * 4).astype(np.int32), x > 0):
        for f in ("sum", "mean"):
            for axis in (None, 0, -1):
                want = jax_ref(f"{f} {arr.dtype} {axis}",
                               lambda jnp: getattr(jnp, f)(arr, axis=axis, where=m))
                got = getattr(cnp, f)(cts.device_put(arr), axis=axis, where=m)
                assert got.dtype == want.dtype, (f, arr.dtype)
                np.testing.assert_allclose(np.asarray(got).astype(np.float64),
                                           want.astype(np.float64), rtol=2e-3)
    want = jax_ref("grad", lambda jax, jnp: jax.grad(lambda u: jnp.mean(u ** 2, where=m))(x))
    got = cts.grad(lambda u: cnp.mean(u ** 2, where=m))(x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_tanh_keeps_nan_and_signed_zero():
    z = np.array([np.nan, -np.nan, -0.0, 0.0, np.inf, -np.inf, 0.3, -0.7, 9.0], np.float32)
    want = np.tanh(z)                                  # numpy's tanhf
    for a in (cts.device_put(z), cts.device_put(np.tile(z, 8).reshape(8, 9),
                                                 _mesh_sharding(("data", None)))):
        got = np.asarray(cnp.tanh(a)).reshape(-1, 9)[0]
        np.testing.assert_allclose(got, want, rtol=2e-7)      # NaN where NaN
        assert np.signbit(got[2]) and not np.signbit(got[3])
    g = np.asarray(cts.grad(lambda u: cnp.sum(cnp.tanh(u)))(z))
    assert np.isnan(g[:2]).all() and g[2] == 1.0     # d tanh = 1 - tanh^2
    gelu = np.asarray(cts.nn.gelu(cts.device_put(z[:2])))
    assert np.isnan(gelu).all()


def test_reshape_minus_one_beside_zero_raises():
    e = cts.device_put(np.zeros((0, 4), np.float32))
    for shape in ((0, -1), (-1, 0), (2, 0, -1)):
        with pytest.raises(ValueError, match="ambiguous"):
            e.reshape(shape)
        with pytest.raises(ValueError, match="ambiguous"):
            cts.eval_shape(lambda a: a.reshape(shape), cts.ShapeDtypeStruct((0, 4), np.float32))
    assert e.reshape(-1, 4).shape == (0, 4) and e.reshape(-1).shape == (0,)   # numpy's too
    # the matmul gradient of an empty batch still works (it reshapes explicitly)
    g = cts.grad(lambda w: cnp.sum(cnp.matmul(np.zeros((2, 0, 3), np.float32), w)))(
        np.ones((3, 5), np.float32))
    assert np.asarray(g).tolist() == np.zeros((3, 5)).tolist()


def test_one_hot_num_classes_must_be_an_int():
    with pytest.raises(TypeError, match="num_classes"):
        cts.nn.one_hot(np.array([0, 1, 2], np.int32), 2.5)
    out = cts.nn.one_hot(np.array([0, 1], np.int32), np.int64(3))
    assert np.asarray(out).tolist() == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define (recorded: tests/recorded.py) and derived by hand

def _creations(jnp):
    return {
        "ones": jnp.ones((1, 2)), "zeros_i": jnp.zeros(3, jnp.int32),
        "array_i": jnp.array([1, 2, 3]), "array_f": jnp.array([1.0, 2.0]),
        "asarray_f64": jnp.asarray(np.ones(2)), "arange": jnp.arange(5),
        "arange3": jnp.arange(1, 7, 2), "arange_f": jnp.arange(0.0, 1.0, 0.25),
        "linspace": jnp.linspace(0, 1, 5), "full_i": jnp.full((2,), 3),
        "full_f": jnp.full((2, 2), 0.5), "full_dt": jnp.full((2,), 1, jnp.float32),
        # a numpy scalar or array fill value keeps its dtype (64-bit narrowed to 32)
        "full_f16": jnp.full((2,), np.float16(1.5)), "full_u32": jnp.full((2,), np.uint32(3)),
        "full_f64": jnp.full((2,), np.float64(0.5)), "full_i64": jnp.full((2,), np.int64(3)),
        "full_b": jnp.full((2,), True), "full_bf16": jnp.full((1,), jnp.bfloat16(7)),
        "full_arr": jnp.full((2, 2), np.array([1.0, 2.0], np.float16)),
    }


def test_jnp_creation_functions():
    got = _creations(cnp)
    # derived: JAX without x64 — float32 by default, int32 for integers
    want = {"ones": ([[1.0, 1.0]], "float32"), "zeros_i": ([0, 0, 0], "int32"),
            "array_i": ([1, 2, 3], "int32"), "array_f": ([1.0, 2.0], "float32"),
            "asarray_f64": ([1.0, 1.0], "float32"), "arange": ([0, 1, 2, 3, 4], "int32"),
            "arange3": ([1, 3, 5], "int32"), "arange_f": ([0.0, 0.25, 0.5, 0.75], "float32"),
            "linspace": ([0.0, 0.25, 0.5, 0.75, 1.0], "float32"), "full_i": ([3, 3], "int32"),
            "full_f": ([[0.5, 0.5], [0.5, 0.5]], "float32"), "full_dt": ([1.0, 1.0], "float32"),
            "full_f16": ([1.5, 1.5], "float16"), "full_u32": ([3, 3], "uint32"),
            "full_f64": ([0.5, 0.5], "float32"), "full_i64": ([3, 3], "int32"),
            "full_b": ([True, True], "bool"), "full_bf16": ([7.0], "bfloat16"),
            "full_arr": ([[1.0, 2.0], [1.0, 2.0]], "float16")}
    for k, (vals, dt) in want.items():
        assert isinstance(got[k], cts.Array), k
        assert got[k].tolist() == vals and str(got[k].dtype) == dt, k
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    with mesh:                                            # replicated over the active mesh
        assert cnp.zeros((8, 4)).sharding == cts.NamedSharding(mesh, cts.P())
    s = cts.NamedSharding(mesh, cts.P("data"))
    assert cnp.ones((8, 4), device=s).sharding == s
    a = cnp.ones(3)
    assert cnp.asarray(a) is a and cnp.array(a) is not a
    assert cnp.float32(2.0) == 2.0 and str(np.dtype(cnp.bfloat16)) == "bfloat16"


def test_jnp_creation_matches_jax(jax_ref):
    got, want = _creations(cnp), jax_ref("creations", _creations)
    for k in want:
        assert str(got[k].dtype) == str(want[k].dtype), k
        np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=k)


def test_minimum_clip_squeeze_std_and_grads():
    x = cnp.array([-2.0, 0.5, 3.0, 1.0])
    assert cnp.minimum(x, 1.0).tolist() == [-2.0, 0.5, 1.0, 1.0]
    assert cnp.clip(x, -1.0, 1.0).tolist() == [-1.0, 0.5, 1.0, 1.0]
    assert cnp.clip(x, a_max=0.0).tolist() == [-2.0, 0.0, 0.0, 0.0]
    assert cnp.squeeze(cnp.ones((1, 3, 1))).shape == (3,)
    assert cnp.squeeze(cnp.ones((1, 3, 1)), axis=-1).shape == (1, 3)
    with pytest.raises(ValueError, match="not 1"):
        cnp.squeeze(cnp.ones((2, 3)), axis=0)
    np.testing.assert_allclose(float(cnp.std(x)), np.std([-2.0, 0.5, 3.0, 1.0]), rtol=1e-6)
    # d/dx sum(clip(x, -1, 1)) = 1 strictly inside, 0 outside; d/dy min(x, y) where y < x
    g = cts.grad(lambda v: cnp.sum(cnp.clip(v, -1.0, 1.0)))(cnp.array([-2.0, 0.5, 3.0]))
    assert g.tolist() == [0.0, 1.0, 0.0]
    ga, gb = cts.grad(lambda a, b: cnp.sum(cnp.minimum(a, b)), argnums=(0, 1))(
        cnp.array([1.0, 5.0]), cnp.array([2.0, 3.0]))
    assert ga.tolist() == [1.0, 0.0] and gb.tolist() == [0.0, 1.0]
    assert cts.eval_shape(lambda a: cnp.minimum(a, 0.0), cts.ShapeDtypeStruct((2, 3), np.float32)).shape == (2, 3)


def test_squeeze_axis_errors_like_jnp():
    assert cnp.squeeze(cnp.ones((1, 3, 1)), axis=(0, -1)).shape == (3,)
    assert cnp.squeeze(cnp.ones(()), axis=()).shape == ()
    for shape, axis in (((1, 3), 2), ((1, 3), -3), ((), 0), ((), -1)):
        with pytest.raises(ValueError, match="out of bounds"):
            cnp.squeeze(cnp.ones(shape), axis=axis)
    with pytest.raises(ValueError, match="repeated"):
        cnp.squeeze(cnp.ones((1, 1)), axis=(0, -2))


def _jnp_squeeze_raises_value_error(jnp, shape, axis):
    try:
        jnp.squeeze(jnp.ones(shape), axis=axis)
    except ValueError:
        return True
    return False


def test_squeeze_axis_errors_match_jnp(jax_ref):
    for shape, axis in (((1, 3), 2), ((1, 3), -3), ((), 0), ((), -1), ((1, 1), (0, -2)),
                        ((2, 3), 0)):
        assert jax_ref(f"raises {shape} {axis}",
                       lambda jnp: _jnp_squeeze_raises_value_error(jnp, shape, axis)), (shape, axis)
        with pytest.raises(ValueError):
            cnp.squeeze(cnp.ones(shape), axis=axis)
    for shape, axis in (((1, 3, 1), (0, -1)), ((), ()), ((1, 3), -2), ((1, 1), None)):
        assert cnp.squeeze(cnp.ones(shape), axis=axis).shape == \
            jax_ref(f"shape {shape} {axis}", lambda jnp: jnp.squeeze(jnp.ones(shape), axis=axis).shape)


def test_zeros_like_over_param_trees():
    mesh = cts.make_mesh((2, 4), ("a", "b"))
    s = cts.NamedSharding(mesh, cts.P("a", "b"))
    tree = {"np": np.ones((4, 3), np.float32), "sharded": cts.device_put(np.ones((8, 4), np.float32), s),
            "int": cts.device_put(np.arange(3, dtype=np.int32)), "py": 3}
    z = cts.tree_util.tree_map(cnp.zeros_like, tree)        # e.g. a gradient accumulator
    assert z["np"].shape == (4, 3) and z["np"].dtype == np.float32 and z["np"].tolist() == [[0.0] * 3] * 4
    assert z["sharded"].sharding == s and float(np.asarray(z["sharded"]).sum()) == 0.0
    assert z["int"].dtype == np.int32 and z["int"].tolist() == [0, 0, 0]      # dtype kept
    assert int(z["py"]) == 0
    o = cnp.ones_like(tree["int"], dtype=np.float32)
    assert o.dtype == np.float32 and o.tolist() == [1.0, 1.0, 1.0]
    f = cnp.full_like(tree["sharded"], 2.5, dtype=cnp.bfloat16)
    assert f.sharding == s and str(f.dtype) == "bfloat16"
    assert np.asarray(f).astype(np.float32).tolist() == [[2.5] * 4] * 8
    assert cnp.zeros_like(tree["np"], shape=(2,)).tolist() == [0.0, 0.0]
    assert cts.eval_shape(cnp.zeros_like, cts.ShapeDtypeStruct((2, 3), np.float32)).shape == (2, 3)


def test_zeros_like_of_shape_dtype_struct_and_array_fill():
    mesh = cts.make_mesh((2, 4), ("a", "b"))
    s = cts.NamedSharding(mesh, cts.P("a", "b"))
    # a ShapeDtypeStruct gives an Array (jnp does), placed by its sharding when it has one
    z = cnp.zeros_like(cts.ShapeDtypeStruct((8, 4), np.int32, s))
    assert isinstance(z, cts.Array) and z.sharding == s and z.dtype == np.int32
    assert np.asarray(z).tolist() == [[0] * 4] * 8
    o = cnp.ones_like(cts.ShapeDtypeStruct((2, 3), np.float32))
    assert isinstance(o, cts.Array) and o.tolist() == [[1.0] * 3] * 2
    f = cnp.full_like(cts.ShapeDtypeStruct((2,), cnp.bfloat16), 2.5)
    assert isinstance(f, cts.Array) and str(f.dtype) == "bfloat16"
    # inside eval_shape it stays abstract
    sd = cts.eval_shape(cnp.zeros_like, cts.ShapeDtypeStruct((8, 4), np.float32, s))
    assert isinstance(sd, cts.ShapeDtypeStruct) and sd.shape == (8, 4) and sd.sharding == s
    # an array fill value broadcasts to the shape, on every device's block
    x = cts.device_put(np.ones((8, 4), np.float32), s)
    g = cnp.full_like(x, np.array([1.0, 2.0, 3.0, 4.0]))
    assert g.sharding == s and np.asarray(g).tolist() == [[1.0, 2.0, 3.0, 4.0]] * 8
    col = np.arange(8, dtype=np.float32).reshape(8, 1)
    assert np.asarray(cnp.full_like(x, col)).tolist() == np.broadcast_to(col, (8, 4)).tolist()
    assert cnp.full_like(cnp.ones((2, 2)), np.array([1.0, 2.0])).tolist() == [[1.0, 2.0]] * 2
    assert cnp.full_like(np.ones((2, 2), np.int32), 2.7).tolist() == [[2, 2]] * 2
    with pytest.raises(ValueError):
        cnp.full_like(x, np.array([1.0, 2.0, 3.0]))      # does not broadcast to (8, 4)


_LIKE_HOST = {"f32": np.ones((8, 4), np.float32), "i32": np.arange(32, dtype=np.int32).reshape(8, 4),
              "u32": np.arange(8, dtype=np.uint32), "bool": np.ones(8, bool),
              "f16": np.ones((8, 2), np.float16), "f64": np.ones(2), "i64": np.arange(3)}
_LIKE_SPECS = {"f32": ("a", "b"), "i32": ("a",), "u32": ("b",), "bool": ("a",), "f16": (None, "a")}
_LIKE_FNS = (("zeros", "zeros_like", ()), ("ones", "ones_like", ()), ("full 3", "full_like", (3,)),
             ("full f32", "full_like", (np.float32(2.5),)))


def _jnp_like(jax, k, where, fn, args, dtype=None):
    """jnp.<fn> of host array k as a numpy array, a single-device or a sharded jax Array: its
    dtype, values and PartitionSpec (None unless NamedSharding)."""
    from jax.sharding import NamedSharding as JNS, PartitionSpec as JP
    jnp = jax.numpy
    a = _LIKE_HOST[k]
    theirs = {"numpy": lambda: a, "device": lambda: jnp.asarray(a),
              "sharded": lambda: jax.device_put(a, JNS(jax.make_mesh((2, 4), ("a", "b")),
                                                       JP(*_LIKE_SPECS[k])))}[where]()
    kw = {} if dtype is None else {"dtype": getattr(jnp, dtype)}
    want = getattr(jnp, fn)(theirs, *args, **kw)
    spec = tuple(want.sharding.spec) if isinstance(want.sharding, JNS) else None
    return {"dtype": str(want.dtype), "value": want, "spec": spec}


def test_zeros_like_matches_jax(jax_ref):
    mesh = cts.make_mesh((2, 4), ("a", "b"))
    cases = []
    for k, a in _LIKE_HOST.items():
        cases.append((k, "numpy", a))                                # numpy inputs
        cases.append((k, "device", cts.device_put(a)))               # single-device Arrays
        if k in _LIKE_SPECS:                                         # sharded Arrays
            cases.append((k, "sharded", cts.device_put(a, cts.NamedSharding(mesh, cts.P(*_LIKE_SPECS[k])))))
    for k, where, ours in cases:
        for label, fn, args in _LIKE_FNS:
            want = jax_ref(f"{k} {where} {label}", lambda jax: _jnp_like(jax, k, where, fn, args))
            got = getattr(cnp, fn)(ours, *args)
            assert isinstance(got, cts.Array), (fn, ours)
            assert str(got.dtype) == want["dtype"], (fn, ours, got.dtype, want["dtype"])
            np.testing.assert_array_equal(np.asarray(got), want["value"])
            if want["spec"] is not None:
                assert tuple(got.sharding.spec) == want["spec"], (fn, ours)
        for dt in ("float32", "int32", "bool_"):
            want = jax_ref(f"{k} {where} zeros {dt}",
                           lambda jax: _jnp_like(jax, k, where, "zeros_like", (), dt))
            got = cnp.zeros_like(ours, dtype=getattr(cnp, dt))
            assert str(got.dtype) == want["dtype"]
            np.testing.assert_array_equal(np.asarray(got), want["value"])
    # ShapeDtypeStructs: an Array, with the struct's sharding
    def jax_sds(jax):
        from jax.sharding import NamedSharding as JNS, PartitionSpec as JP
        sds = jax.ShapeDtypeStruct((8, 4), jax.numpy.int32,
                                   sharding=JNS(jax.make_mesh((2, 4), ("a", "b")), JP("a")))
        want = jax.numpy.zeros_like(sds)
        return {"type": type(want).__name__, "dtype": str(want.dtype), "value": want,
                "spec": tuple(want.sharding.spec)}
    want = jax_ref("ShapeDtypeStruct", jax_sds)
    got = cnp.zeros_like(cts.ShapeDtypeStruct((8, 4), np.int32, cts.NamedSharding(mesh, cts.P("a"))))
    assert want["type"] == "ArrayImpl" and isinstance(got, cts.Array)
    assert str(got.dtype) == want["dtype"] and tuple(got.sharding.spec) == want["spec"]
    np.testing.assert_array_equal(np.asarray(got), want["value"])
    # an array fill value broadcasts
    fill = np.array([1.0, 2.0, 3.0, 4.0])
    np.testing.assert_array_equal(np.asarray(cnp.full_like(cts.device_put(_LIKE_HOST["f32"]), fill)),
                                  jax_ref("full_like array fill",
                                          lambda jnp: jnp.full_like(_LIKE_HOST["f32"], fill)))


def test_dot_of_vectors_and_einsum_arity():
    a = cnp.array([1.0, 2.0, 3.0])
    d = cnp.dot(a, a)
    assert d.shape == () and float(d) == 14.0
    assert cts.grad(lambda v: cnp.dot(v, v))(a).tolist() == [2.0, 4.0, 6.0]
    with pytest.raises(ValueError, match="contracting"):
        cnp.dot(a, cnp.ones(2))
    with pytest.raises(NotImplementedError, match="two operands"):
        cnp.einsum("ij,jk,kl->il", np.ones((2, 3), np.float32), np.ones((3, 4), np.float32),
                   np.ones((4, 5), np.float32))
