"""ctrainstate.nn's linear layers (nn/linear.py, flax.linen.linear): behaviour Flax users rely on, checked
by hand and against flax (`jax_ref`: recorded in tests/data/recorded/test_linear.npz, live in the
`parity` twins)."""

import numpy as np
import pytest

from ctrainstate import nn
from ctrainstate import random
from conftest import flat_tree
import ctrainstate.numpy as cnp


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


def test_dense_general_axis_out_of_order_matches_flax(jax_ref):
    x = np.random.RandomState(1).randn(2, 3, 4, 2).astype(np.float32)
    for axis, bdims in (((-1, -2), ()), ((3, 1), ()), ((3, 2), (0,))):
        key = random.PRNGKey(3)
        v = nn.DenseGeneral((2, 3), axis=axis, batch_dims=bdims).init(key, x)
        hkey = np.asarray(key)

        def flax_side(jnp, fnn):
            fm = fnn.DenseGeneral((2, 3), axis=axis, batch_dims=bdims)
            fv = fm.init(jnp.asarray(hkey), jnp.asarray(x))
            return {"params": fv["params"], "out": fm.apply(fv, jnp.asarray(x))}

        want = jax_ref(f"{axis} {bdims}", flax_side)
        for name in ("kernel", "bias"):
            np.testing.assert_array_equal(np.asarray(v["params"][name]),
                                          want["params"][name], err_msg=f"{axis} {name}")
        np.testing.assert_allclose(
            np.asarray(nn.DenseGeneral((2, 3), axis=axis, batch_dims=bdims).apply(v, x)),
            want["out"], rtol=1e-5, atol=1e-5, err_msg=str(axis))


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define, live when installed (those parts skip cleanly otherwise) and derived
# by hand

@pytest.mark.parametrize("make", [
    lambda dt: nn.Dense(4, dtype=dt), lambda dt: nn.DenseGeneral((2, 2), dtype=dt),
    lambda dt: nn.LayerNorm(dtype=dt)])
def test_layers_compute_in_their_dtype_and_refuse_non_float_dtypes(make):
    x = np.ones((2, 3), np.float32)
    v = make(cnp.bfloat16).init(random.PRNGKey(0), x)
    assert {str(p.dtype) for p in flat_tree(v["params"]).values()} == {"float32"}   # param_dtype
    assert make(cnp.bfloat16).apply(v, x).dtype == cnp.bfloat16
    assert make(np.float16).apply(v, x).dtype == np.float16
    assert make(None).apply(v, x).dtype == np.float32
    with pytest.raises(TypeError, match=r"dtype=.*int32.*expected float32, bfloat16 or float16"):
        make(np.int32).init(random.PRNGKey(0), x)


def test_embed_dtype():
    ids = np.array([[1, 2]], np.int32)
    e = nn.Embed(5, 3, dtype=np.float16)
    v = e.init(random.PRNGKey(0), ids)
    out = e.apply(v, ids)
    assert out.dtype == np.float16 and v["params"]["embedding"].dtype == np.float32
    want = np.asarray(v["params"]["embedding"]).astype(np.float16)[[1, 2]]
    np.testing.assert_array_equal(np.asarray(out)[0], want)
    with pytest.raises(TypeError, match="param_dtype=.*expected float32"):
        nn.Embed(5, 3, param_dtype=np.int32).init(random.PRNGKey(0), ids)


def test_promote_dtype_float32_arrays_as_they_are_others_promoted():
    """nn.dtypes.promote_dtype: float32 Arrays (and None) come back as they are, the same
    objects; a bfloat16 Array among them, numpy values, an explicit dtype or inexact=False
    take the general path (Flax's promotion)."""
    import ctrainstate as cts
    from ctrainstate.nn.dtypes import promote_dtype
    a = cts.device_put(np.ones((2, 3), np.float32))
    k = cts.device_put(np.ones((3, 4), np.float32))
    out = promote_dtype(a, k, None)
    assert out[0] is a and out[1] is k and out[2] is None
    b16 = cts.numpy.astype(k, cts.numpy.bfloat16)
    assert [x.dtype for x in promote_dtype(b16, b16)] == [cts.numpy.bfloat16] * 2
    mixed = promote_dtype(a, b16)
    assert [x.dtype for x in mixed] == [np.float32, np.float32] and mixed[0] is a
    assert [x.dtype for x in promote_dtype(a, k, dtype=cts.numpy.bfloat16)] == \
        [cts.numpy.bfloat16] * 2
    host = promote_dtype(a, np.ones(3, np.float64))
    assert host[0] is a and isinstance(host[1], np.ndarray) and host[1].dtype == np.float32
    assert promote_dtype(a, k, inexact=False)[0] is a



def test_float32_fast_paths_of_promote_and_canonicalize_give_the_general_paths_answers(
        monkeypatch):
    """promote_dtype(..., dtype=float32) of float32 Arrays returns the same objects (a norm's
    input promoted to float32 at every apply); canonicalize_dtype of float32 Arrays (and None)
    answers float32 without the promotion loop. Each answer is the general path's, found by
    running the same calls with the fast paths' test made to fail (the dtype objects compared
    by identity there replaced by an equal non-identical one)."""
    import ctrainstate as cts
    from ctrainstate.nn import dtypes as nd
    a = cts.device_put(np.ones((2, 3), np.float32))
    k = cts.device_put(np.ones((3, 4), np.float32))
    b16 = cts.numpy.astype(k, cts.numpy.bfloat16)
    i32 = cts.device_put(np.ones((3,), np.int32))
    cases = [((a, k, None), {}), ((a,), {"dtype": np.float32}), ((a, None), {"dtype": nd._F32}),
             ((None,), {}), ((None,), {"inexact": False}), ((a, b16), {}), ((a, i32), {}),
             ((i32,), {"inexact": False}), ((a, 2.0), {}), ((a, k), {"inexact": False})]
    fast = [(nd.canonicalize_dtype(*args, **kw), [getattr(x, "dtype", x) for x in
             nd.promote_dtype(*args, **kw)] if args != (None,) or kw.get("inexact", True)
             else None) for args, kw in cases]
    promoted = nd.promote_dtype(a, k, dtype=np.float32)
    assert promoted[0] is a and promoted[1] is k
    monkeypatch.setattr(nd, "_F32", np.dtype(np.float64))   # no float32 Array matches
    slow = [(nd.canonicalize_dtype(*args, **kw), [getattr(x, "dtype", x) for x in
             nd.promote_dtype(*args, **kw)] if args != (None,) or kw.get("inexact", True)
             else None) for args, kw in cases]
    assert fast == slow
    assert fast[0][0] == np.float32 and fast[3][0] == np.float32 and fast[4][0] == np.int32

def test_dense_checks_its_fields_where_they_are_not_the_common_values():
    """nn.Dense skips its field checks for a float32 layer of the default precision and an
    int width (the values every apply of such a layer passes), and still refuses every other
    bad value at init and apply, naming the layer."""
    x = np.ones((2, 3), np.float32)
    k = random.PRNGKey(0)
    v = nn.Dense(4).init(k, x)
    bad = [(dict(param_dtype=np.int32), TypeError, r"Dense\(param_dtype=.*int32.*expected float32"),
           (dict(dtype=np.int8), TypeError, r"Dense\(dtype=.*int8.*expected float32"),
           (dict(precision="nonsense"), ValueError, r"Dense\(precision=...\): unknown precision"),
           (dict(features=True), TypeError, "features must be an int, got a bool"),
           (dict(features=(2,)), TypeError, "several output dimensions: DenseGeneral"),
           (dict(features=-2), ValueError, "non-negative")]
    for kw, err, msg in bad:
        kw = {"features": 4, **kw}
        with pytest.raises(err, match=msg):
            nn.Dense(**kw).init(k, x)
        with pytest.raises(err, match=msg):
            nn.Dense(**kw).apply(v, x)
    # the checked values that pass: the same result as the defaults
    want = np.asarray(nn.Dense(4).apply(v, x))
    for kw in (dict(precision="highest"), dict(dtype=np.float32), dict(features=np.int64(4))):
        kw = {"features": 4, **kw}
        np.testing.assert_array_equal(np.asarray(nn.Dense(**kw).apply(v, x)), want)
