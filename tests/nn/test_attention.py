"""Attention layers and RMSNorm (mirror of flax.linen.attention / normalization), checked
without Flax: against independent numpy computations of Flax's formulas, sharded against
single-device runs on meshes (8,), (2, 4), (4, 2) (outputs, gradients, parameters born
sharded by logical axis rules), and the errors for bad inputs. Device-generic: also re-run on
emulated GPUs (tools/cuda_emu.sh, benchmarks/gpu_check.sh). The Flax parity tests (same
keys: parameters, outputs with masks and dropout, gradients; recorded and live) are in
test_attention_flax.py."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import NamedSharding, P, nn, random
from conftest import flat_tree as _flat




def _host(tree):
    """{path: numpy} of a param or grad tree (ctrainstate's or Flax's), boxes unboxed."""
    return {k: np.asarray(v.value if hasattr(v, "names") else v) for k, v in _flat(tree).items()}


def _assert_trees_close(got, want, rtol=1e-5, what=""):
    """Leaf by leaf to ``rtol``; the absolute floor is ``rtol`` times the largest entry of the
    whole tree, so leaves that are zero in exact arithmetic (the gradient of the key bias: a
    softmax does not see a shift of one row) compare as rounding noise."""
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    scale = max([float(np.abs(v).max()) for v in want.values() if v.size] + [1e-30])
    worst = 0.0
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=rtol * scale,
                                   err_msg=f"{what} {k}")
        if want[k].size:
            worst = max(worst, float(np.abs(got[k] - want[k]).max()) / scale)
    return worst


_RS = np.random.RandomState(0)
B, L, E = 2, 5, 12
X = _RS.randn(B, L, E).astype(np.float32)
XK = _RS.randn(B, 7, 10).astype(np.float32)          # a key/value sequence of another length
W = _RS.randn(B, L, E).astype(np.float32)             # the loss weights of the output
TOKENS = np.array([[3, 4, 5, 0, 0], [1, 2, 3, 4, 0]])  # 0 = padding


# --- dot_product_attention(_weights), the layer and masks against numpy ------------------------

def _np_attention(q, k, v, bias=None, mask=None, keep=None, keep_prob=1.0):
    """An independent float64 numpy reference of Flax's formula."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    logits = np.einsum("...qhd,...khd->...hqk", q / np.sqrt(q.shape[-1]), k)
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = np.where(mask, logits, np.finfo(np.float32).min)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    if keep is not None:
        w = np.where(keep, w / keep_prob, 0.0)
    return w, np.einsum("...hqk,...khd->...qhd", w, v)


def _qkv(shape_q=(2, 4, 3, 5), lk=6, dv=7, seed=1):
    r = np.random.RandomState(seed)
    q = r.randn(*shape_q).astype(np.float32)
    k = r.randn(*shape_q[:-3], lk, *shape_q[-2:]).astype(np.float32)
    v = r.randn(*shape_q[:-3], lk, shape_q[-2], dv).astype(np.float32)
    return q, k, v


def test_dot_product_attention_matches_numpy_reference():
    q, k, v = _qkv()
    bias = np.random.RandomState(2).randn(2, 3, 4, 6).astype(np.float32)
    mask = np.random.RandomState(3).rand(2, 1, 4, 6) > 0.3
    mask[0, 0, 1, :] = False                  # a fully masked row: uniform weights, as Flax
    for kw in (dict(), dict(bias=bias), dict(mask=mask), dict(bias=bias, mask=mask)):
        want_w, want = _np_attention(q, k, v, **kw)
        got = nn.dot_product_attention(q, k, v, **kw)
        assert got.shape == (2, 4, 3, 7)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(nn.dot_product_attention_weights(q, k, **kw)),
                                   want_w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(nn.dot_product_attention_weights(q, k, mask=mask))[0, :, 1],
                               np.full((3, 6), 1 / 6), rtol=1e-6)
    # dropout: the keep mask is uniform(key, shape) < keep_prob (jax.random.bernoulli)
    for bd, shape in ((True, (1, 1, 4, 6)), (False, (2, 3, 4, 6))):
        keep = np.asarray(random.uniform(random.PRNGKey(8), shape)) < np.float32(0.75)
        _, want = _np_attention(q, k, v, mask=mask, keep=keep, keep_prob=0.75)
        got = nn.dot_product_attention(q, k, v, mask=mask, dropout_rng=random.PRNGKey(8),
                                       dropout_rate=0.25, broadcast_dropout=bd)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
        det = nn.dot_product_attention(q, k, v, mask=mask, dropout_rng=random.PRNGKey(8),
                                       dropout_rate=0.25, deterministic=True)
        np.testing.assert_allclose(np.asarray(det), _np_attention(q, k, v, mask=mask)[1],
                                   rtol=1e-5, atol=1e-6)


def _np_mha(params, xq, xkv, mask=None, keep=None, keep_prob=1.0):
    """Flax's MultiHeadDotProductAttention in float64 numpy from the parameters."""
    p = {k: np.asarray(v, np.float64) for k, v in _host(params).items()}
    q = np.einsum("...e,ehd->...hd", xq, p["query/kernel"]) + p["query/bias"]
    k = np.einsum("...e,ehd->...hd", xkv, p["key/kernel"]) + p["key/bias"]
    v = np.einsum("...e,ehd->...hd", xkv, p["value/kernel"]) + p["value/bias"]
    _, x = _np_attention(q, k, v, mask=mask, keep=keep, keep_prob=keep_prob)
    return np.einsum("...hd,hde->...e", x, p["out/kernel"]) + p["out/bias"]


def test_mha_matches_numpy_reference():
    mask = nn.combine_masks(nn.make_attention_mask(TOKENS > 0, TOKENS > 0),
                            nn.make_causal_mask(TOKENS))
    m = nn.MultiHeadDotProductAttention(3, bias_init=nn.initializers.normal(0.5))
    v = m.init(random.PRNGKey(1), X)
    p = _host(v["params"])
    assert {k: a.shape for k, a in p.items()} == {
        "query/kernel": (E, 3, 4), "key/kernel": (E, 3, 4), "value/kernel": (E, 3, 4),
        "query/bias": (3, 4), "key/bias": (3, 4), "value/bias": (3, 4),
        "out/kernel": (3, 4, E), "out/bias": (E,)}
    # Flax's defaults: lecun_normal kernels (std 1/sqrt(fan_in) before truncation; the query
    # kernel's fan_in is E: it is initialised as the flat (E, 12) matrix)
    assert 0.5 < p["query/kernel"].std() * np.sqrt(E) < 1.2
    for mk in (None, mask):
        np.testing.assert_allclose(np.asarray(m.apply(v, X, mask=mk)), _np_mha(v["params"], X, X, mk),
                                   rtol=1e-5, atol=1e-5)
    # cross attention with dropout through dropout_rng: keep = uniform(key, (1, 1, L, 7)) < 0.7
    xk = np.random.RandomState(7).randn(B, 7, E).astype(np.float32)
    md = nn.MultiHeadDotProductAttention(3, dropout_rate=0.3)
    keep = np.asarray(random.uniform(random.PRNGKey(4), (1, 1, L, 7))) < np.float32(0.7)
    got = md.apply(v, X, xk, deterministic=False, dropout_rng=random.PRNGKey(4))
    np.testing.assert_allclose(np.asarray(got), _np_mha(v["params"], X, xk, keep=keep,
                                                        keep_prob=0.7), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(md.apply(v, X, xk, deterministic=True)),
                               _np_mha(v["params"], X, xk), rtol=1e-5, atol=1e-5)
    # sow_weights: the (pre-dropout) weights in 'intermediates', as Flax sows them
    _, st = m.apply(v, X, mask=mask, sow_weights=True, mutable=["intermediates"])
    (w,) = st["intermediates"]["attention_weights"]
    assert w.shape == (B, 3, L, L)
    np.testing.assert_allclose(np.asarray(w).sum(-1), np.ones((B, 3, L)), rtol=1e-5)


def test_mask_helpers_match_numpy():
    a = np.array([[1, 2, 0], [3, 0, 0]])
    b = np.array([[5, 0, 1, 1], [0, 2, 2, 0]])
    m = nn.make_attention_mask(a > 0, b > 0)
    assert m.dtype == np.float32 and m.shape == (2, 1, 3, 4)
    np.testing.assert_array_equal(m[:, 0], ((a[:, :, None] > 0) & (b[:, None, :] > 0)).astype(np.float32))
    assert nn.make_attention_mask(a > 0, b > 0, extra_batch_dims=2).shape == (1, 1, 2, 1, 3, 4)
    ge = nn.make_attention_mask(a, b, pairwise_fn=np.greater_equal, dtype=np.bool_)
    np.testing.assert_array_equal(ge[:, 0], a[:, :, None] >= b[:, None, :])
    assert nn.make_attention_mask(a, b, dtype=np.float64).dtype == np.float32   # jax without x64
    c = nn.make_causal_mask(np.ones((2, 4)))
    assert c.shape == (2, 1, 4, 4)
    np.testing.assert_array_equal(c[1, 0], np.tril(np.ones((4, 4), np.float32)))
    assert nn.make_causal_mask(np.ones((2, 4)), extra_batch_dims=1).shape == (1, 2, 1, 4, 4)
    comb = nn.combine_masks(m, None, nn.make_attention_mask(a > 1, b > 1))
    np.testing.assert_array_equal(comb[:, 0], ((a[:, :, None] > 1) & (b[:, None, :] > 1)).astype(np.float32))
    assert nn.combine_masks(None, None) is None
    assert nn.combine_masks(m, dtype=np.bool_).dtype == np.bool_


def test_masks_as_arrays_and_bool_arrays():
    q, k, v = _qkv()
    mask = np.random.RandomState(3).rand(2, 1, 4, 6) > 0.3
    want = nn.dot_product_attention(q, k, v, mask=mask)
    for m in (cts.device_put(mask), cts.device_put(mask.astype(np.float32)),
              mask.astype(np.int32), mask.astype(np.float32)):
        np.testing.assert_array_equal(np.asarray(nn.dot_product_attention(q, k, v, mask=m)),
                                      np.asarray(want))
    # cnp.where takes a bool Array condition (converted to its nonzeros)
    c = cts.device_put(np.array([True, False, True]))
    assert np.asarray(cnp.where(c, np.ones(3, np.float32), -1.0)).tolist() == [1.0, -1.0, 1.0]


def test_mask_helpers_on_arrays():
    a = np.array([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]], np.float32)
    want = nn.make_attention_mask(a, a)                   # numpy: a_i * a_j as float32
    got = nn.make_attention_mask(cts.device_put(a), a)
    assert isinstance(got, cts.Array) and got.shape == (2, 1, 3, 3)
    np.testing.assert_array_equal(np.asarray(got), want)
    got2 = nn.make_attention_mask(cts.device_put(a > 0), cts.device_put(a > 0), extra_batch_dims=1)
    np.testing.assert_array_equal(np.asarray(got2), nn.make_attention_mask(a > 0, a > 0)[None])
    assert nn.make_attention_mask(cts.device_put(a), a, dtype=np.bool_).dtype == np.bool_
    causal = nn.make_causal_mask(cts.device_put(a))         # only the shape is read
    assert isinstance(causal, np.ndarray)
    comb = nn.combine_masks(got2[0], causal)
    assert isinstance(comb, cts.Array)
    np.testing.assert_array_equal(np.asarray(comb),
                                  np.logical_and(np.asarray(got2[0]) != 0, causal).astype(np.float32))
    # comparisons run on the devices too (segment ids, positions), as on the host
    dev_ge = nn.make_attention_mask(cts.device_put(a), a, pairwise_fn=np.greater_equal)
    assert isinstance(dev_ge, cts.Array) and dev_ge.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(dev_ge),
                                  nn.make_attention_mask(a, a, pairwise_fn=np.greater_equal))
    with pytest.raises(TypeError, match="cannot run on devices"):
        nn.make_attention_mask(cts.device_put(a), a, pairwise_fn=np.add)


# --- sharded: meshes (8,), (2, 4), (4, 2) ------------------------------------------------------

_LP = nn.with_logical_partitioning
_MESHES = [
    ((8,), ("data",), (("batch", "data"),)),
    ((8,), ("model",), (("heads", "model"), ("mlp", "model"))),
    ((2, 4), ("data", "model"), (("batch", "data"), ("heads", "model"))),
    ((4, 2), ("data", "model"), (("batch", "data"), ("heads", "model"), ("embed", None))),
]


def _sharded_model(dropout_rate=0.2, normalize_qk=False):
    init = nn.initializers.lecun_normal()
    return nn.MultiHeadDotProductAttention(
        8, qkv_features=16, dropout_rate=dropout_rate, deterministic=False,
        broadcast_dropout=False, normalize_qk=normalize_qk,
        kernel_init=_LP(init, ("embed", "heads", "kv")),
        out_kernel_init=_LP(init, ("heads", "kv", "embed")),
        bias_init=_LP(nn.initializers.normal(0.1), ("heads", "kv")),
        out_bias_init=_LP(nn.initializers.normal(0.1), ("embed",)))


@pytest.mark.parametrize("mesh_shape,names,rules", _MESHES,
                         ids=["8data", "8model", "2x4", "4x2"])
def test_sharded_outputs_grads_and_born_sharded_params(mesh_shape, names, rules):
    b, l, e = 8, 6, 12
    r = np.random.RandomState(5)
    x = r.randn(b, l, e).astype(np.float32)
    w = r.randn(b, l, e).astype(np.float32)
    tok = np.array([[1] * (l - i % 3) + [0] * (i % 3) for i in range(b)])
    mask = nn.combine_masks(nn.make_attention_mask(tok > 0, tok > 0), nn.make_causal_mask(tok))
    m = _sharded_model()
    key, dkey = random.PRNGKey(0), random.PRNGKey(3)

    def loss(p, x):
        return cnp.sum(m.apply({"params": p}, x, mask=mask, rngs={"dropout": dkey}) * w)

    v0 = m.init(key, x)
    p0 = nn.unbox(v0["params"])
    out0 = np.asarray(m.apply({"params": p0}, x, mask=mask, rngs={"dropout": dkey}))
    l0, (g0, gx0) = cts.value_and_grad(loss, argnums=(0, 1))(p0, x)

    mesh = cts.make_mesh(mesh_shape, names)
    with mesh, nn.logical_axis_rules(rules):
        v = m.init(key, x)
        for path, box in _flat(v["params"]).items():      # born sharded as the rules say
            want = NamedSharding(mesh, nn.logical_to_mesh_axes(box.names))
            assert box.value.sharding == want and box.value.sharding.spec == want.spec, \
                (path, box.value.sharding, want)
        p = nn.unbox(v["params"])
        xs = cts.device_put(x, NamedSharding(mesh, nn.logical_to_mesh_axes(("batch", None, None))))
        out = m.apply({"params": p}, xs, mask=mask, rngs={"dropout": dkey})
        l1, (g1, gx1) = cts.value_and_grad(loss, argnums=(0, 1))(p, xs)
    _assert_trees_close(_host(p), _host(p0), rtol=0)                 # same values as unsharded
    if "data" in names:
        assert out.sharding.spec[0] == "data"
    np.testing.assert_allclose(np.asarray(out), out0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5)
    for path, g in _flat(g1).items():                                  # grads keep the params' shardings
        assert g.sharding == _flat(p)[path].sharding, path
    assert gx1.sharding == xs.sharding
    _assert_trees_close(_host(g1), _host(g0), what=f"{mesh_shape} d/dparams")
    _assert_trees_close({"x": np.asarray(gx1)}, {"x": np.asarray(gx0)}, what="d/dx")


def test_sharded_specs_on_2x4_and_normalize_qk():
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    rules = (("batch", "data"), ("heads", "model"))
    x = np.random.RandomState(1).randn(4, 5, 12).astype(np.float32)
    m = _sharded_model(dropout_rate=0.0, normalize_qk=True)
    v0 = m.init(random.PRNGKey(2), x)
    out0 = np.asarray(m.apply(v0, x))
    with mesh, nn.logical_axis_rules(rules):
        v = m.init(random.PRNGKey(2), x)
        out = m.apply(v, cts.device_put(x, NamedSharding(mesh, P("data"))))
    assert v["params"]["query"]["kernel"].value.sharding.spec == P(None, "model", None)
    assert v["params"]["out"]["kernel"].value.sharding.spec == P("model", None, None)
    assert v["params"]["query"]["bias"].value.sharding.spec == P("model", None)
    assert v["params"]["query_ln"]["scale"].sharding.spec == P()        # replicated
    # each device holds its block of the kernel: (12, 8/4, 2)
    assert {blk[1].shape for blk in v["params"]["key"]["kernel"].value._blocks} == {(12, 2, 2)}
    # The sharded products have other shapes than the unsharded ones, and the BLAS may pick
    # other kernels (summation orders) for them: cuBLAS on GPUs, and OpenBLAS on some CPUs (a
    # Zen 3 VM: the (2, 5, 12) @ (12, 4) blocks differ from the (4, 5, 12) @ (12, 16) product
    # by up to 27 ulp, the attention output by 1.3e-4). So q and k differ by an ulp or so, and
    # normalize_qk's LayerNorm over head_dim = 2
    # features (flax's mean(x^2) - mean(x)^2) is ill-conditioned: an H200 gave 1.3e-3. So the
    # bound is what the unsharded model itself does when its input moves by 1 ulp (each
    # element times 1 +- 2^-23; on CPUs that alone moves the output by ~7e-3), times 2.
    rs = np.random.RandomState(3)
    spread = 0.0
    for _ in range(4):
        xp = (x * (1 + rs.choice([-1.0, 1.0], x.shape) * 2.0 ** -23)).astype(np.float32)
        spread = max(spread, float(np.abs(np.asarray(m.apply(v0, xp)) - out0).max()))
    assert np.abs(np.asarray(out) - out0).max() <= 2 * spread + 1e-5, spread


def test_born_sharded_attention_kernels_never_whole_on_a_device(mem_baseline):
    e, heads = 512, 8
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    x = np.ones((2, 3, e), np.float32)
    m = nn.MultiHeadDotProductAttention(
        heads, kernel_init=_LP(nn.initializers.lecun_normal(), ("embed", "heads", "kv")),
        out_kernel_init=_LP(nn.initializers.lecun_normal(), ("heads", "kv", "embed")))
    cts.reset_peak_memory_stats()
    with mesh, nn.logical_axis_rules((("heads", "model"),)):
        v = m.init(random.PRNGKey(0), x)
    kernel = e * e * 4                                  # 1 MiB each, 4 kernels
    for i, d in enumerate(cts.devices()):
        grew = d.memory_stats()["peak_bytes_in_use"] - mem_baseline[i]
        # 4 kernel shards (1/4 each) plus biases and the small activations; a whole kernel on a
        # device would add 3/4 MiB more
        assert 4 * kernel // 4 <= grew < 4 * kernel // 4 + kernel // 2, (d, grew)
    del v


@pytest.mark.parametrize("shape,spec,flat,want", [
    ((8, 4, 2), (None, "model", None), (8, 8), (None, "model")),       # heads lead (heads, kv)
    ((4, 2, 8), ("model", None, None), (8, 8), ("model", None)),
    ((8, 4, 2), ("data", "model", None), (8, 8), ("data", "model")),
    ((8, 8, 2), (None, ("data", "model"), None), (8, 16), (None, ("data", "model"))),
    ((8, 4, 2), (None, ("data", "model"), None), (8, 8), None),       # 4 heads over 8 devices
    ((4, 2), ("model", None), (8,), ("model",)),                        # a (heads, kv) bias
    ((8, 4, 2), (None, None, "model"), (8, 8), None),                  # kv does not lead
    ((8, 2, 4), (None, "model", None), (8, 8), None),                  # 2 heads over model=4
])
def test_flat_init_sharding_maps_blocks(shape, spec, flat, want):
    """DenseGeneral makes a multi-axis kernel as its flat matrix (Flax's kernel_init_wrap):
    in the flat sharding whose blocks are the requested blocks, when there is one."""
    from ctrainstate.nn.linear import _flat_sharding
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    got = _flat_sharding(NamedSharding(mesh, P(*spec)), shape, flat)
    assert (got.spec if got is not None else None) == (P(*want) if want is not None else None)


# --- DenseGeneral with boxed initializers (the projections) ------------------------------------

def test_dense_general_boxed_kernel_init_is_born_sharded():
    x = np.random.RandomState(0).randn(2, 3, 8).astype(np.float32)
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    for feats, axis, names, rules, block in (
            ((4, 2), -1, ("embed", "heads", "kv"), (("heads", "model"),), (8, 1, 2)),
            (5, (-2, -1), ("heads", "kv", "embed"), (("heads", "model"),), (1, 2, 5)),
            # kv (not leading its flattened group) sharded: made on the host and scattered
            ((4, 2), -1, ("embed", "heads", "kv"), (("heads", "model"), ("kv", "data")), (8, 1, 1))):
        xi = x if axis == -1 else x.reshape(2, 3, 4, 2)
        c = nn.DenseGeneral(feats, axis=axis, kernel_init=_LP(nn.initializers.lecun_normal(), names))
        ref = c.init(random.PRNGKey(1), xi)
        assert type(ref["params"]["kernel"]).__name__ == "LogicallyPartitioned"
        assert ref["params"]["kernel"].names == names
        plain = nn.DenseGeneral(feats, axis=axis).init(random.PRNGKey(1), xi)
        np.testing.assert_array_equal(_host(ref["params"])["kernel"],
                                      np.asarray(plain["params"]["kernel"]))
        with mesh, nn.logical_axis_rules(rules):
            sv = c.init(random.PRNGKey(1), xi)
            k = sv["params"]["kernel"].value
            assert k.sharding == NamedSharding(mesh, nn.logical_to_mesh_axes(names))
            assert {blk[1].shape for blk in k._blocks} == {block}
            out = c.apply(sv, xi)
        np.testing.assert_array_equal(np.asarray(k), _host(ref["params"])["kernel"])
        np.testing.assert_allclose(np.asarray(out), np.asarray(c.apply(ref, xi)), rtol=1e-5,
                                   atol=1e-6)
    # t5x's kernel_axes (param_with_axes) on a 3-d kernel: flat generation in a block-aligned
    # sharding, same values
    with mesh, nn.logical_axis_rules((("heads", "model"),)):
        tv = nn.DenseGeneral((4, 2), kernel_axes=("embed", "heads", "kv")).init(random.PRNGKey(1), x)
    assert tv["params"]["kernel"].sharding.spec == P(None, "model", None)
    np.testing.assert_array_equal(
        np.asarray(tv["params"]["kernel"]),
        np.asarray(nn.DenseGeneral((4, 2)).init(random.PRNGKey(1), x)["params"]["kernel"]))


def test_eval_shape_of_attention_and_norms():
    init = _LP(nn.initializers.lecun_normal(), ("embed", "heads", "kv"))
    a = cts.eval_shape(nn.MultiHeadDotProductAttention(3, kernel_init=init, normalize_qk=True).init,
                       random.PRNGKey(0), X, mask=nn.make_causal_mask(TOKENS))
    shapes = {k: v.shape for k, v in _flat(nn.unbox(a)["params"]).items()}
    assert shapes["query/kernel"] == (E, 3, 4) and shapes["out/kernel"] == (3, 4, E)
    assert shapes["query_ln/scale"] == (4,) and "query_ln/bias" not in shapes
    assert nn.get_partition_spec(a)["params"]["key"]["kernel"] == P("embed", "heads", "kv")
    assert cts.eval_shape(nn.LayerNorm().init, random.PRNGKey(0), X)["params"]["bias"].shape == (E,)


# --- RMSNorm and LayerNorm ---------------------------------------------------------------------

def test_rmsnorm_matches_numpy_and_is_sharded():
    r = np.random.RandomState(4)
    x = r.randn(4, 6, 8).astype(np.float32)
    scale = r.randn(8).astype(np.float32)
    v = {"params": {"scale": scale}}
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * scale
    np.testing.assert_allclose(np.asarray(nn.RMSNorm().apply(v, x)), want, rtol=1e-5, atol=1e-6)
    # gradient wrt scale: sum over rows of x * rsqrt(ms + eps) (loss = sum(y))
    gs = cts.grad(lambda p: cnp.sum(nn.RMSNorm().apply({"params": p}, x)))({"scale": scale})
    np.testing.assert_allclose(np.asarray(gs["scale"]),
                               (x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6)).sum((0, 1)),
                               rtol=1e-5)
    assert nn.RMSNorm().init(random.PRNGKey(0), x)["params"]["scale"].tolist() == [1.0] * 8
    # features sharded on model: the mean of squares all-reduces over it
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    xs = cts.device_put(x, NamedSharding(mesh, P("data", None, "model")))
    with mesh:
        ys = nn.RMSNorm().apply(v, xs)
        gx = cts.grad(lambda x: cnp.sum(nn.RMSNorm().apply(v, x) * x))(xs)
    assert ys.sharding == xs.sharding and gx.sharding == xs.sharding
    np.testing.assert_allclose(np.asarray(ys), want, rtol=1e-5, atol=1e-6)
    gx0 = cts.grad(lambda x: cnp.sum(nn.RMSNorm().apply(v, x) * x))(x)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(gx0), rtol=1e-5, atol=1e-6)
    # eval_shape
    a = cts.eval_shape(nn.RMSNorm().init, random.PRNGKey(0), x)
    assert a["params"]["scale"].shape == (8,)


def test_layernorm_options_match_numpy():
    r = np.random.RandomState(6)
    x = (r.randn(2, 3, 4, 5) * 2 + 1).astype(np.float32)
    x64 = x.astype(np.float64)
    mask = r.rand(2, 3, 4, 5) > 0.3

    def ref(red, feat, scale, bias, mask=None, center=True):
        msk = np.ones_like(x64, bool) if mask is None else mask
        cnt = msk.sum(red, keepdims=True)
        mu = np.where(msk, x64, 0).sum(red, keepdims=True) / cnt if center else 0.0
        var = np.where(msk, (x64 - mu) ** 2, 0).sum(red, keepdims=True) / cnt
        shp = [1] * 4
        for a in feat:
            shp[a] = x.shape[a]
        y = (x64 - mu) / np.sqrt(var + 1e-6)
        y = y * scale.reshape(shp) if scale is not None else y
        return y + bias.reshape(shp) if bias is not None else y

    for kw, red, feat in ((dict(), (3,), (3,)),
                          (dict(reduction_axes=(1, 2, 3)), (1, 2, 3), (3,)),
                          (dict(reduction_axes=(1, 2), feature_axes=(-2, -1)), (1, 2), (2, 3)),
                          (dict(use_fast_variance=False), (3,), (3,))):
        fshape = tuple(x.shape[a] for a in feat)
        s, bb = r.randn(*fshape).astype(np.float32), r.randn(*fshape).astype(np.float32)
        v = {"params": {"scale": s, "bias": bb}}
        assert {k: a.shape for k, a in nn.LayerNorm(**kw).init(random.PRNGKey(0), x)["params"].items()} \
            == {"scale": fshape, "bias": fshape}
        for mk in (None, mask):
            np.testing.assert_allclose(np.asarray(nn.LayerNorm(**kw).apply(v, x, mask=mk)),
                                       ref(red, feat, s, bb, mk), rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(
                np.asarray(nn.RMSNorm(**kw).apply({"params": {"scale": s}}, x, mask=mk)),
                ref(red, feat, s, None, mk, center=False), rtol=1e-4, atol=1e-4)
    y = nn.LayerNorm(use_bias=False, use_scale=False).apply({}, x)
    np.testing.assert_allclose(np.asarray(y), ref((3,), (3,), None, None), rtol=1e-4, atol=1e-4)
    assert nn.LayerNorm(use_bias=False).init(random.PRNGKey(0), x)["params"].keys() == {"scale"}
    assert nn.RMSNorm(use_scale=False).init(random.PRNGKey(0), x) == {}
    # LayerNorm is still importable from nn.linear (where it used to live)
    from ctrainstate.nn.linear import LayerNorm
    assert LayerNorm is nn.LayerNorm

# --- errors --------------------------------------------------------------------------------

def test_errors():
    x = np.ones((2, 5, 12), np.float32)
    with pytest.raises(ValueError, match=r"Memory dimension \(12\) must be divisible by number of heads \(5\)"):
        nn.MultiHeadDotProductAttention(5).init(random.PRNGKey(0), x)
    with pytest.raises(ValueError, match=r"Memory dimension \(10\).*\(4\)"):
        nn.MultiHeadDotProductAttention(4, qkv_features=10).init(random.PRNGKey(0), x)
    v = nn.MultiHeadDotProductAttention(3).init(random.PRNGKey(0), x)
    mha = nn.MultiHeadDotProductAttention(3)
    with pytest.raises(ValueError, match="same batch dims"):
        mha.apply(v, x, np.ones((3, 5, 12), np.float32))
    with pytest.raises(ValueError, match="inputs_k.*inputs_v.*same batch dims and length"):
        mha.apply(v, x, np.ones((2, 4, 12), np.float32), np.ones((2, 6, 12), np.float32))
    with pytest.raises(ValueError, match="`inputs_k` cannot be None"):
        mha.apply(v, x, inputs_v=x)
    with pytest.raises(ValueError, match="inputs_kv"):
        mha.apply(v, x, x, inputs_kv=x)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 5, 4\) does not broadcast"):
        mha.apply(v, x, mask=np.ones((2, 1, 5, 4), bool))
    with pytest.raises(TypeError, match=r"dtype=.*int32.*expected float32, bfloat16"):
        nn.MultiHeadDotProductAttention(3, dtype=np.int32).init(random.PRNGKey(0), x)
    with pytest.raises(TypeError, match="dot_product_attention.*must be inexact"):
        nn.dot_product_attention(*_qkv(), dtype=np.int32)
    with pytest.raises(ValueError, match='"deterministic"'):   # dropout needs deterministic
        nn.MultiHeadDotProductAttention(3, dropout_rate=0.1).apply(v, x)
    with pytest.raises(ValueError, match="dropout"):            # ... and a dropout key
        nn.MultiHeadDotProductAttention(3, dropout_rate=0.1).apply(v, x, deterministic=False)
    assert nn.MultiHeadDotProductAttention(3, dropout_rate=0.1).apply(
        v, x, deterministic=True).shape == x.shape
    q, k, vv = _qkv()
    for args, msg in (((q, k[..., :4], vv), "depths must match"),
                      ((q, k[:, :, :2], vv[:, :, :2]), "num_heads must match"),
                      ((q, k[:1], vv[:1]), "batch dims must match"),
                      ((q, k[0], vv[0]), "same rank"),
                      ((q, k, vv[:, :5]), "lengths must match")):
        with pytest.raises(ValueError, match=msg):
            nn.dot_product_attention(*args)
    with pytest.raises(ValueError, match="bias of shape"):
        nn.dot_product_attention(q, k, vv, bias=np.ones((2, 3, 4, 5), np.float32))
    with pytest.raises(ValueError, match="needs dropout_rng"):
        nn.dot_product_attention(q, k, vv, dropout_rate=0.5)
    with pytest.raises(ValueError, match="mutually exclusive"):
        nn.dot_product_attention_weights(q, k, precision="highest", einsum=cnp.einsum)
    with pytest.raises(ValueError, match="specified together"):
        nn.dot_product_attention(q, k, vv, qk_attn_weights_einsum=cnp.einsum)
    with pytest.raises(ValueError, match=r"masks must have same rank: \(4, 3\)"):
        nn.combine_masks(np.ones((1, 1, 2, 2)), np.ones((1, 2, 2)))
    with pytest.raises(NameError, match="axis_name=.batch.*enclosing ctrainstate.pmap"):
        nn.RMSNorm(axis_name="batch").init(random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="reduction_axes: axis 3 is out of bounds"):
        nn.RMSNorm(reduction_axes=3).init(random.PRNGKey(0), x)
    with pytest.raises(TypeError, match=r"RMSNorm\(dtype=.*uint32.*expected float32"):
        nn.RMSNorm(dtype=np.uint32).init(random.PRNGKey(0), x)


def test_attention_fn_and_custom_einsum():
    """A custom attention_fn gets only the keyword arguments it declares (Flax filters them);
    einsum= replaces the logits' einsum (called with Flax's ``...`` subscripts)."""
    seen = {}

    def my_attention(query, key, value, mask=None):
        seen["kw"] = mask is not None
        return nn.dot_product_attention(query, key, value, mask=mask)
    x = np.random.RandomState(0).randn(2, 4, 6).astype(np.float32)
    mask = nn.make_causal_mask(np.ones((2, 4)))
    v = nn.MultiHeadDotProductAttention(2).init(random.PRNGKey(0), x)
    got = nn.MultiHeadDotProductAttention(2, attention_fn=my_attention).apply(v, x, mask=mask)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(
        nn.MultiHeadDotProductAttention(2).apply(v, x, mask=mask)))
    assert seen["kw"]
    q, k, _ = _qkv()
    calls = []

    def my_einsum(sub, a, b):
        calls.append(sub)
        return cnp.einsum("bqhd,bkhd->bhqk", a, b)
    np.testing.assert_allclose(np.asarray(nn.dot_product_attention_weights(q, k, einsum=my_einsum)),
                               np.asarray(nn.dot_product_attention_weights(q, k)), rtol=1e-6)
    assert calls == ["...qhd,...khd->...hqk"]


def test_precision_reaches_every_product():
    """precision= of the layer goes to its projections and both attention einsums: 'highest'
    is float32 bit for bit, 'bfloat16' and 'tensorfloat32' change the output (by about the
    inputs' rounding) and stay within that format's error of the float32 reference."""
    m32 = nn.MultiHeadDotProductAttention(3)
    v = m32.init(random.PRNGKey(1), X)
    base = np.asarray(m32.apply(v, X))
    hi = np.asarray(nn.MultiHeadDotProductAttention(3, precision="highest").apply(v, X))
    assert hi.tobytes() == base.tobytes()
    for prec, eps in (("bfloat16", 2.0 ** -8), ("tensorfloat32", 2.0 ** -11)):
        mp = nn.MultiHeadDotProductAttention(3, precision=prec)
        got = np.asarray(mp.apply(v, X))
        diff = np.abs(got - base).max()
        assert diff > eps * 1e-2, (prec, diff)          # the rounding happened
        assert diff < 50 * eps * np.abs(base).max(), (prec, diff)  # and only the rounding
        g = cts.grad(lambda p: cnp.sum(mp.apply({"params": p}, X) * W))(v["params"])
        assert np.isfinite(np.asarray(g["query"]["kernel"])).all()
    # the bare functions too
    q, k, vv = _qkv()
    a = np.asarray(nn.dot_product_attention(q, k, vv))
    b = np.asarray(nn.dot_product_attention(q, k, vv, precision="bfloat16"))
    assert 0 < np.abs(a - b).max() < 0.1
