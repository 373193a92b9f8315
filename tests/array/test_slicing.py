"""Basic indexing (x[ints, slices, None, ...]) and concatenate/stack/split on sharded Arrays:
values equal numpy's on every mesh and spec, the unsliced dimensions keep their mesh axes,
gradients equal numpy scatters of the cotangent, any dtype, clear errors. Slice steps,
integer arrays and masks: tests/array/test_slicing_advanced.py."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate._src.ops import slicing as _slicing
from ctrainstate import optim
from conftest import assert_same_bits, on_gpu

MESHES = [((1,), ("x",)), ((8,), ("x",)), ((2, 4), ("data", "model")), ((4, 2), ("data", "model"))]


def _specs(names):
    if len(names) == 1:
        return [cts.P(), cts.P("x"), cts.P(None, "x"), cts.P(None, None, "x")]
    return [cts.P(), cts.P("data", "model"), cts.P(None, "model", "data"),
            cts.P(("data", "model")), cts.P("model", None, "data")]


INDICES = [
    (0,), (-1,), (slice(1, None),), (slice(None, -1),), (Ellipsis, 3), (Ellipsis, slice(2, 7)),
    (slice(None), slice(1, 3)), (1, slice(None), -2), (None, slice(2, 6), None),
    (slice(0, 8), slice(0, 4), slice(0, 8)), (slice(0, 8), slice(None), slice(4, 8)), (slice(3, 3),), (slice(None), 2, None, Ellipsis),
    (-8, -5, -8), (slice(-3, None), Ellipsis, slice(1, -1)),
]


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_getitem_values_layouts_and_gradients(mesh_shape, names):
    rng = np.random.default_rng(0)
    h = rng.standard_normal((8, 8, 8)).astype(np.float32)
    mesh = cts.make_mesh(mesh_shape, names)
    for spec in _specs(names):
        s = cts.NamedSharding(mesh, spec)
        x = cts.device_put(h, s)
        full = list(spec) + [None] * (3 - len(spec))
        for idx in INDICES:
            y = x[idx]
            want = h[idx]
            assert y.shape == want.shape, (spec, idx)
            np.testing.assert_array_equal(np.asarray(y), want, err_msg=f"{spec} {idx}")
            # dimensions taken whole keep their mesh axes; sliced or indexed ones do not
            if y.ndim and isinstance(y.sharding, cts.NamedSharding):
                for e in y.sharding.spec:
                    assert e is None or e in full, (spec, idx, y.sharding.spec)
            w = rng.standard_normal(want.shape).astype(np.float32)
            g = cts.grad(lambda v: cnp.sum(v[idx] * w))(x)
            gw = np.zeros_like(h)
            gw[idx] += w  # basic indices select distinct elements: a plain scatter
            assert g.sharding == x.sharding
            np.testing.assert_array_equal(np.asarray(g), gw, err_msg=f"{spec} {idx}")


def test_unsliced_dims_keep_their_axes():
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    x = cts.device_put(np.zeros((4, 6, 8), np.float32),
                       cts.NamedSharding(mesh, cts.P("data", None, "model")))
    def spec(a):
        s = list(a.sharding.spec) + [None] * (a.ndim - len(a.sharding.spec))
        return tuple(s)
    assert spec(x[:, :-1, :]) == ("data", None, "model")  # logits[:, :-1]
    assert spec(x[:, 1:]) == ("data", None, "model")
    assert spec(x[1:]) == (None, None, "model")  # the sliced dim is gathered
    assert spec(x[0]) == (None, "model")
    assert spec(x[..., None]) == ("data", None, "model", None)
    assert spec(x[:, 2]) == ("data", "model")


def test_shifted_lm_loss_on_a_mesh_matches_numpy():
    """run_clm's shift: logits[:, :-1] against labels[:, 1:] on a (batch, vocab) layout."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 6, 16)).astype(np.float32)
    labels = rng.integers(0, 16, (4, 6))
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    lx = cts.device_put(logits, cts.NamedSharding(mesh, cts.P("data", None, "model")))

    def loss(lg):
        return cnp.mean(optim.softmax_cross_entropy_with_integer_labels(lg[:, :-1], labels[:, 1:]))

    v, g = cts.value_and_grad(loss)(lx)
    lg = logits[:, :-1].astype(np.float64)
    lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
    nll = lse - np.take_along_axis(lg, labels[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(float(v), nll.mean(), rtol=1e-5)
    p = np.exp(lg - lse[..., None])
    p[np.arange(4)[:, None], np.arange(5)[None], labels[:, 1:]] -= 1
    want = np.zeros_like(logits, np.float64)
    want[:, :-1] = p / nll.size
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-4, atol=1e-7)
    assert g.sharding == lx.sharding


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_concatenate_stack_split(mesh_shape, names):
    rng = np.random.default_rng(2)
    mesh = cts.make_mesh(mesh_shape, names)
    a = rng.standard_normal((8, 8)).astype(np.float32)
    b = rng.standard_normal((8, 8)).astype(np.float32)
    for spec in _specs(names)[:3]:
        spec = cts.P(*tuple(spec)[:2])
        xa = cts.device_put(a, cts.NamedSharding(mesh, spec))
        xb = cts.device_put(b, cts.NamedSharding(mesh, cts.P()))
        for axis in (1, -1):
            c = cnp.concatenate([xa, xb, a], axis=axis)  # a host operand too
            np.testing.assert_array_equal(np.asarray(c), np.concatenate([a, b, a], axis=axis))
        c0 = cnp.concatenate([xa, xa[:3]], axis=0)
        np.testing.assert_array_equal(np.asarray(c0), np.concatenate([a, a[:3]], axis=0))
        st = cnp.stack([xa, xa * 2.0], axis=1)
        np.testing.assert_array_equal(np.asarray(st), np.stack([a, a * 2], axis=1))
        # (the new axis by the Array's indexing: the layout of the Python getitem's join)
        via = cnp.concatenate([_slicing.getitem(v, (slice(None), None)) for v in (xa, xa * 2.0)],
                              axis=1)
        assert st.sharding == via.sharding
        for got, want in zip(cnp.split(xb, 4, axis=1), np.split(b, 4, axis=1)):
            np.testing.assert_array_equal(np.asarray(got), want)
        for got, want in zip(cnp.split(xb, [3, 5, 20], axis=0), np.split(b, [3, 5, 20], axis=0)):
            assert got.shape == want.shape
            np.testing.assert_array_equal(np.asarray(got), want)
        for got, want in zip(cnp.array_split(xb, 3, axis=0), np.array_split(b, 3, axis=0)):
            np.testing.assert_array_equal(np.asarray(got), want)
        wa = rng.standard_normal((8, 16)).astype(np.float32)
        ga, gb = cts.grad(lambda u, v: cnp.sum(cnp.concatenate([u, v], axis=1) * wa),
                          argnums=(0, 1))(xa, xb)
        np.testing.assert_array_equal(np.asarray(ga), wa[:, :8])
        np.testing.assert_array_equal(np.asarray(gb), wa[:, 8:])
        ws = rng.standard_normal((8, 3, 8)).astype(np.float32)
        gs = cts.grad(lambda u: cnp.sum(cnp.stack([u, u * 3.0, u], axis=1) * ws))(xa)
        np.testing.assert_allclose(np.asarray(gs), ws[:, 0] + 3 * ws[:, 1] + ws[:, 2], rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.bool_])
def test_other_dtypes(dtype):
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    h = (np.arange(64).reshape(8, 8) % 3).astype(dtype)
    x = cts.device_put(h, cts.NamedSharding(mesh, cts.P("data", "model")))
    for idx in [(slice(1, 5), 3), (Ellipsis, slice(2, None)), (None, 0)]:
        y = x[idx]
        assert y.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(y), h[idx])
    c = cnp.concatenate([x[:, :2], x[:, 6:]], axis=1)
    assert c.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(c), np.concatenate([h[:, :2], h[:, 6:]], 1))


def test_eval_shape():
    s = cts.ShapeDtypeStruct((4, 6, 8), np.float32)
    out = cts.eval_shape(lambda v: (v[:, :-1], v[0, ..., None], cnp.concatenate([v, v], 2),
                                    cnp.stack([v, v]), cnp.split(v, 2, axis=1)), s)
    assert [o.shape for o in out[:4]] == [(4, 5, 8), (6, 8, 1), (4, 6, 16), (2, 4, 6, 8)]
    assert [o.shape for o in out[4]] == [(4, 3, 8), (4, 3, 8)]


@pytest.mark.parametrize("join", ["concatenate", "stack"])
def test_join_operands_dtypes_placements_and_liveness(join):
    """concatenate / stack operands: one dtype is kept as it is (bfloat16, int8, bool), mixed
    ones promote as jax's (bfloat16 with float32 -> float32, int8 with a host int16 ->
    int16); Arrays on different meshes, or on different devices, and a deleted Array are
    refused with the element-wise ops' errors, before anything is joined."""
    f = getattr(cnp, join)
    h = np.arange(12).reshape(3, 4)
    for dt in (cnp.bfloat16, np.int8, np.bool_):
        x = cts.device_put((h % 2 if dt is np.bool_ else h).astype(dt))
        out = f([x, x])
        assert out.dtype == np.dtype(dt)
        np.testing.assert_array_equal(np.asarray(out), getattr(np, join)([np.asarray(x)] * 2))
    b, w = cts.device_put(h.astype(cnp.bfloat16)), cts.device_put(h.astype(np.float32))
    assert f([b, w]).dtype == np.float32
    i8 = cts.device_put(h.astype(np.int8))
    assert f([i8, h.astype(np.int16)]).dtype == np.int16
    m1, m2 = cts.make_mesh((8,), ("x",)), cts.make_mesh((2, 4), ("a", "b"))
    on1 = cts.device_put(np.ones((8, 4), np.float32), cts.NamedSharding(m1, cts.P("x")))
    on2 = cts.device_put(np.ones((8, 4), np.float32), cts.NamedSharding(m2, cts.P("a")))
    with pytest.raises(ValueError, match="different meshes"):
        f([on1, on2])
    d0 = cts.device_put(np.ones((8, 4), np.float32), cts.devices()[0])
    d1 = cts.device_put(np.ones((8, 4), np.float32), cts.devices()[1])
    with pytest.raises(ValueError, match="different devices"):
        f([d0, d1])
    gone = cts.device_put(np.ones((8, 4), np.float32))
    gone.delete()
    with pytest.raises(RuntimeError, match="deleted"):
        f([d0, gone])


def test_errors():
    x = cts.device_put(np.zeros((4, 5), np.float32))
    # slice steps, integer arrays and boolean masks work now: tests/array/test_slicing_advanced.py
    with pytest.raises(IndexError, match="index 4 is out of bounds for axis 0 with size 4"):
        x[4]
    with pytest.raises(IndexError, match="index -6 is out of bounds for axis 1 with size 5"):
        x[0, -6]
    with pytest.raises(IndexError, match="too many indices"):
        x[0, 0, 0]
    with pytest.raises(IndexError, match="single ellipsis"):
        x[..., ...]
    with pytest.raises(TypeError, match="must be ints, slices"):
        x["a"]
    with pytest.raises(ValueError, match="all dimensions except 1 must match"):
        cnp.concatenate([x, np.zeros((3, 2), np.float32)], axis=1)
    with pytest.raises(ValueError, match="out of bounds"):
        cnp.concatenate([x, x], axis=2)
    with pytest.raises(ValueError, match="need at least one"):
        cnp.concatenate([])
    with pytest.raises(ValueError, match="equal division"):
        cnp.split(x, 3, axis=1)
    with pytest.raises(ValueError, match="same shape"):
        cnp.stack([x, x[1:]])
    # mixed dtypes promote as in jax: the int32 Array is converted up, floats are never
    # truncated to ints
    mixed = cnp.concatenate([x, cts.device_put(np.arange(20, dtype=np.int32).reshape(4, 5))])
    assert mixed.dtype == np.float32 and np.asarray(mixed)[4:].tolist() == \
        np.arange(20).reshape(4, 5).tolist()
    ints = cts.device_put(np.array([1, 2], np.int32))
    up = cnp.concatenate([ints, np.array([1.5, 2.7], np.float32)])
    assert up.dtype == np.float32 and np.asarray(up).tolist() == [1.0, 2.0, 1.5, np.float32(2.7)]
    joined = cnp.concatenate([ints, np.array([3, 4])])  # int64 host values: int32, as jax
    assert joined.dtype == np.int32 and np.asarray(joined).tolist() == [1, 2, 3, 4]
    assert cnp.concatenate([np.array([1.0]), np.array([2])]).dtype == np.float32


def _np_update(h, idx, v, kind):
    """numpy's in-place update on a copy of ``h``: the reference for ``x.at[idx].<kind>(v)``."""
    want = h.copy()
    if kind == "set":
        want[idx] = v
    else:
        ufunc = {"add": np.add, "multiply": np.multiply, "divide": np.divide}[kind]
        want[idx] = ufunc(want[idx], v)
    return want


def _sum_to(g, shape):
    """numpy: the cotangent of a value broadcast from ``shape`` to ``g.shape``."""
    g = g.sum(axis=tuple(range(g.ndim - len(shape))))
    return g.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1), keepdims=True)


AT_CASES = [((1, slice(2, 6)), (4,)), ((slice(None), 3), ()), ((Ellipsis, slice(1, 3)), (1, 2)),
            ((slice(2, 4), None, slice(0, 8)), (8,)), ((-1,), (8,)), ((slice(5, 5),), ())]


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_at_set_add_multiply_divide_values_and_gradients(mesh_shape, names):
    rng = np.random.default_rng(7)
    h = rng.standard_normal((8, 8)).astype(np.float32)
    mesh = cts.make_mesh(mesh_shape, names)
    spec = cts.P(names[0], names[-1]) if len(names) == 2 else cts.P(None, "x")
    x = cts.device_put(h, cts.NamedSharding(mesh, spec))
    w = rng.standard_normal((8, 8)).astype(np.float32)
    for idx, vshape in AT_CASES:
        v = (rng.standard_normal(vshape) + 2.0).astype(np.float32)
        for kind in ("set", "add", "multiply", "divide"):
            want = _np_update(h, idx, v, kind)
            got = getattr(x.at[idx], kind)(v)
            assert got.sharding == x.sharding
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, err_msg=f"{kind} {idx}")
        assert np.array_equal(np.asarray(x), h)  # x itself is unchanged
        np.testing.assert_array_equal(np.asarray(x.at[idx].get()), h[idx])
        # gradients, derived with numpy: d/dx and d/dv of sum(w * x.at[idx].set(v))
        gx, gv = cts.grad(lambda a, b: cnp.sum(a.at[idx].set(b) * w), argnums=(0, 1))(x, v)
        mask = np.ones_like(h)
        mask[idx] = 0
        np.testing.assert_array_equal(np.asarray(gx), w * mask)
        np.testing.assert_allclose(np.asarray(gv), _sum_to(w[idx], vshape), rtol=1e-5, atol=1e-6)
        gx, gv = cts.grad(lambda a, b: cnp.sum(a.at[idx].multiply(b) * w), argnums=(0, 1))(x, v)
        m = np.ones_like(h)
        m[idx] = v
        np.testing.assert_allclose(np.asarray(gx), w * m, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(gv), _sum_to((w * h)[idx], vshape), rtol=1e-5,
                                   atol=1e-6)


def test_at_errors_and_eval_shape():
    x = cts.device_put(np.zeros((4, 5), np.float32))
    with pytest.raises(ValueError, match="does not broadcast to the indexed shape"):
        x.at[1:3].set(np.ones(4, np.float32))
    with pytest.raises(AttributeError):
        x.at[0].scatter_xor(1.0)
    with pytest.raises(TypeError, match="func must be callable"):
        x.at[0].apply(1.0)
    s = cts.eval_shape(lambda a: a.at[0, 1:].add(1.0), cts.ShapeDtypeStruct((4, 5), np.float32))
    assert s.shape == (4, 5)


def test_at_overwrites_inf_nan_and_keeps_other_bits():
    """Updates are copies: an inf/NaN being overwritten does not leak, and elements outside
    the region keep their exact bits (-0.0 too), as numpy's (and jax's) updates. On GPU
    devices a NaN may come back as CUDA's canonical NaN (the arithmetic updates run over the
    whole array there, so even a NaN outside the region): any NaN matches any NaN."""
    h = np.array([[-0.0, 1.0, np.inf, -np.inf], [np.nan, -0.0, 2.0, 3.0]], np.float32)
    x = cts.device_put(h)
    for idx, v, kind in [((slice(None), slice(2, None)), 0.0, "set"), ((1, 0), 5.0, "set"),
                         ((0, slice(1, 3)), 1.0, "add"), ((slice(None), 3), 2.0, "multiply"),
                         ((1,), -1.0, "divide")]:
        want = _np_update(h, idx, v, kind)
        got = getattr(x.at[idx], kind)(v)
        assert_same_bits(got, want, on_gpu(got), err_msg=f"{idx} {kind}")
    # an inf cotangent inside the overwritten region does not reach x's gradient as NaN
    w = np.array([[1.0, 1.0, np.inf, 1.0], [1.0, 1.0, 1.0, 1.0]], np.float32)
    g = cts.grad(lambda a: cnp.sum(a.at[0, 2].set(3.0) * w))(np.ones((2, 4), np.float32))
    want = w.copy()
    want[0, 2] = 0.0
    np.testing.assert_array_equal(np.asarray(g), want)


def test_whole_slices_are_new_arrays():
    """x[:], x[...], split(x, 1) and concatenate([x]) are new Arrays with their own buffers,
    as in jax: deleting (or donating) x leaves them intact; gradients still flow."""
    h = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = cts.device_put(h)
    outs = [x[:], x[...], x[:, :], cnp.split(x, 1)[0], cnp.concatenate([x])]
    assert all(o is not x for o in outs)
    x.delete()
    for o in outs:
        np.testing.assert_array_equal(np.asarray(o), h)
    g = cts.grad(lambda v: cnp.sum(v[...] * 2.0) + cnp.sum(cnp.concatenate([v])))(h)
    np.testing.assert_array_equal(np.asarray(g), np.full((2, 3), 3.0, np.float32))
