"""jnp.sort / jnp.argsort: jax's order (NaNs last, -0.0 and 0.0 equal, ties in index order,
descending as jax builds it), every stored dtype, axes, meshes, gradients, eval_shape and
errors; against numpy (where the orders agree), hand-derived cases, and live jax."""
import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp

BF16 = ml_dtypes.bfloat16
DTYPES = [np.float32, BF16, np.float16, np.int32, np.uint32, np.bool_]


def _data(shape, dt, seed):
    rng = np.random.default_rng(seed)
    if dt == np.bool_:
        return rng.random(shape) > 0.5
    if dt in (np.int32, np.uint32):
        return rng.integers(0, 6, shape).astype(dt)     # small range: many ties
    h = np.round(rng.standard_normal(shape) * 2).astype(np.float32) / 2   # ties too
    flat = h.reshape(-1)
    if flat.size >= 6:
        flat[:6] = [np.nan, -0.0, 0.0, np.inf, -np.inf, -np.nan]
    return h.astype(dt)


def _bits(a):
    a = np.asarray(a)
    return a if a.dtype == np.bool_ else a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def test_hand_derived_order():
    """The rules on one row, derived by hand: NaNs last (both signs, in index order), -inf,
    negatives, -0.0 and 0.0 equal, ties by index; descending reverses the array and
    positions, sorts, and reverses back, so ties still go in index order."""
    x = np.array([1.0, np.nan, -0.0, 1.0, -np.inf, 0.0, -np.nan, -2.0], np.float32)
    assert np.asarray(cnp.argsort(x)).tolist() == [4, 7, 2, 5, 0, 3, 1, 6]
    assert np.asarray(cnp.argsort(x, descending=True)).tolist() == [1, 6, 0, 3, 2, 5, 7, 4]
    s = np.asarray(cnp.sort(x))
    assert np.signbit(s[2]) and not np.signbit(s[3]) and np.isnan(s[-2:]).all()
    # the descending sort is the ascending one reversed (jax): the NaNs' order flips too
    sd = np.asarray(cnp.sort(x, descending=True))
    np.testing.assert_array_equal(_bits(sd), _bits(s[::-1]))


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: np.dtype(d).name)
def test_matches_numpy_where_the_orders_agree(dt):
    """Without NaN or -0.0, jax's order is numpy's stable one."""
    rng = np.random.default_rng(3)
    h = (rng.integers(-4, 5, (5, 9)) if dt not in (np.uint32, np.bool_) else
         rng.integers(0, 5, (5, 9))).astype(dt)
    for axis in (0, 1, -1, None):
        want = np.argsort(h, axis=axis, kind="stable")
        got = cnp.argsort(cts.device_put(h), axis=axis)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(np.asarray(got), want)
        np.testing.assert_array_equal(_bits(cnp.sort(cts.device_put(h), axis=axis)),
                                      _bits(np.sort(h, axis=axis, kind="stable")))
        # descending, ties in index order: a stable sort of the negated keys
        hk = h.astype(np.int64)
        want_d = np.argsort(-hk, axis=axis, kind="stable")
        np.testing.assert_array_equal(np.asarray(cnp.argsort(h, axis=axis, descending=True)), want_d)


def test_gradient_returns_each_cotangent_to_its_element():
    x = np.random.default_rng(4).standard_normal((3, 7)).astype(np.float32)
    w = np.random.default_rng(5).standard_normal((3, 7)).astype(np.float32)
    for desc in (False, True):
        g = cts.grad(lambda v: cnp.sum(cnp.sort(v, axis=1, descending=desc) * w))(cts.device_put(x))
        order = np.argsort(-x if desc else x, axis=1, kind="stable")
        want = np.zeros_like(x)
        np.put_along_axis(want, order, w, axis=1)
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-6)


@pytest.mark.parametrize("mesh_shape,names", [((8,), ("x",)), ((2, 4), ("a", "b"))])
def test_sharded_operands_give_the_single_device_result(mesh_shape, names):
    if cts.device_count() < 8:
        pytest.skip("needs 8 CPU devices")
    mesh = cts.make_mesh(mesh_shape, names)
    h = _data((8, 16), np.float32, 6)
    spec = cts.P(*names) if len(names) == 2 else cts.P(None, "x")
    x = cts.device_put(h, cts.NamedSharding(mesh, spec))
    for axis in (0, 1):
        np.testing.assert_array_equal(np.asarray(cnp.argsort(x, axis=axis)),
                                      np.asarray(cnp.argsort(h, axis=axis)))
        np.testing.assert_array_equal(_bits(cnp.sort(x, axis=axis)), _bits(cnp.sort(h, axis=axis)))


def test_eval_shape_and_errors():
    S = cts.ShapeDtypeStruct
    out = cts.eval_shape(lambda v: (cnp.sort(v, axis=0), cnp.argsort(v, axis=None)),
                         S((3, 4), np.float16))
    assert out[0].shape == (3, 4) and out[0].dtype == np.float16
    assert out[1].shape == (12,) and out[1].dtype == np.int32
    x = np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match="'kind' is not supported"):
        cnp.sort(x, kind="quicksort")
    with pytest.raises(TypeError, match="'order' is not supported"):
        cnp.argsort(x, order="f")
    with pytest.raises(ValueError, match="0-d"):
        cnp.sort(np.float32(1.0))
    with pytest.raises(ValueError, match="axis"):
        cnp.argsort(x, axis=2)


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: np.dtype(d).name)
def test_matches_jax(dt):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    h = _data((4, 3, 10), dt, 7)
    calls = [(axis, desc) for axis in (-1, 0, None) for desc in (False, True)]
    # every call of this dtype in one jax program (one XLA compile; sorting rounds nothing)
    wants = jax.jit(lambda v: [(jnp.sort(v, axis=a, descending=d), jnp.argsort(v, axis=a, descending=d))
                               for a, d in calls])(jnp.asarray(h))
    x = cts.device_put(h)
    for (axis, desc), (ws, wi) in zip(calls, wants):
        np.testing.assert_array_equal(_bits(cnp.sort(x, axis=axis, descending=desc)), _bits(ws),
                                      err_msg=f"sort axis={axis} descending={desc}")
        np.testing.assert_array_equal(np.asarray(cnp.argsort(x, axis=axis, descending=desc)),
                                      np.asarray(wi), err_msg=f"argsort axis={axis} descending={desc}")
