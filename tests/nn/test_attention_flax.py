"""Attention layers and RMSNorm against flax.linen: for the same keys and inputs, the
parameters of init (names, shapes, values), outputs with causal and padding masks and with
dropout (Flax's bernoulli mask), and gradients with respect to parameters and inputs
(ctrainstate.value_and_grad against jax.value_and_grad). Flax's side comes from conftest's
`jax_ref`: recorded in tests/data/recorded/test_attention_flax.npz (the README's run, without
jax), or computed by live flax and checked against that recording (the `parity` twins). The
device-generic checks (numpy references, meshes, errors) are in test_attention.py."""
import warnings

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import NamedSharding, nn, random
from test_attention import (B, E, L, TOKENS, W, X, XK, _LP, _assert_trees_close, _flat, _host,
                            _qkv)


def _masks(nn_mod):
    pad = nn_mod.make_attention_mask(TOKENS > 0, TOKENS > 0)
    return {"none": None, "causal": nn_mod.make_causal_mask(TOKENS),
            "padding": pad,
            "causal+padding": nn_mod.combine_masks(pad, nn_mod.make_causal_mask(TOKENS))}


# Flax configurations of the layer (kwargs), run against flax.linen by name
CONFIGS = {
    "default": dict(num_heads=3),
    "qkv6_out7": dict(num_heads=3, qkv_features=6, out_features=7),
    "no_bias": dict(num_heads=2, use_bias=False),
    "normalize_qk": dict(num_heads=3, normalize_qk=True),
    "xavier_uniform_normal_bias": dict(num_heads=4, kernel_init="xavier_uniform", bias_init="normal"),
    "out_inits": dict(num_heads=2, out_kernel_init="normal", out_bias_init="normal"),
    "dropout": dict(num_heads=3, dropout_rate=0.3, deterministic=False),
    "dropout_unbroadcast": dict(num_heads=3, dropout_rate=0.4, deterministic=False,
                                broadcast_dropout=False),
}


def _build(nn_mod, cfg, cls="MultiHeadDotProductAttention"):
    kw = dict(cfg)
    for k in ("kernel_init", "out_kernel_init"):
        if kw.get(k) == "xavier_uniform":
            kw[k] = nn_mod.initializers.xavier_uniform()
        elif kw.get(k) == "normal":
            kw[k] = nn_mod.initializers.normal(0.3)
    for k in ("bias_init", "out_bias_init"):
        if kw.get(k) == "normal":
            kw[k] = nn_mod.initializers.normal(0.5)
    return getattr(nn_mod, cls)(**kw)


def _init(nn_mod, prng, cfg, key, *args, cls="MultiHeadDotProductAttention"):
    """The variables of `cls` of nn_mod (ctrainstate.nn or flax.linen) built from cfg: init with
    the params key `key` and the dropout key 11 of prng (ctrainstate.random or jax.random)."""
    return _build(nn_mod, cfg, cls).init({"params": key, "dropout": prng.PRNGKey(11)}, *args)


# --- MultiHeadDotProductAttention against Flax -------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mha_init_params_match_flax(name, jax_ref):
    cfg = CONFIGS[name]
    seeds = (0, 7)
    keys = [np.asarray(random.PRNGKey(seed)) for seed in seeds]
    want_all = jax_ref("flax", lambda jax, fnn: [
        _host(_init(fnn, jax.random, cfg, jax.numpy.asarray(key), X)["params"]) for key in keys])
    for key, want in zip(keys, want_all):
        got = _host(_init(nn, random, cfg, key, X)["params"])
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].shape == want[k].shape, k
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{name} {k}")
    heads, qkv = cfg["num_heads"], cfg.get("qkv_features", E)
    assert got["query/kernel"].shape == (E, heads, qkv // heads)
    assert got["out/kernel"].shape == (heads, qkv // heads, cfg.get("out_features", E))


@pytest.mark.parametrize("mask_name", ["none", "causal", "padding", "causal+padding"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mha_apply_and_grads_match_flax(name, mask_name, jax_ref):
    cfg = CONFIGS[name]
    key = np.asarray(random.PRNGKey(1))
    out_f = cfg.get("out_features", E)
    w = W[..., :out_f] if out_f <= E else np.resize(W, (B, L, out_f))
    dk = 5

    def flax_side(jax, fnn):
        fv = _init(fnn, jax.random, cfg, jax.numpy.asarray(key), X)
        fmask = _masks(fnn)[mask_name]
        fm = _build(fnn, cfg)

        def floss(p, x):
            return jax.numpy.sum(fm.apply({"params": p}, x, mask=fmask,
                                          rngs={"dropout": jax.random.PRNGKey(dk)}) * w)

        fo = fm.apply(fv, X, mask=fmask, rngs={"dropout": jax.random.PRNGKey(dk)})
        fl, (fgp, fgx) = jax.value_and_grad(floss, argnums=(0, 1))(fv["params"], X)
        return {"mask": fmask, "out": fo, "loss": fl, "d/dparams": _host(fgp), "d/dx": fgx}

    want = jax_ref("flax", flax_side)
    cv = _init(nn, random, cfg, key, X)
    cmask = _masks(nn)[mask_name]
    if want["mask"] is not None:
        np.testing.assert_array_equal(cmask, want["mask"])
    cm = _build(nn, cfg)

    def closs(p, x):
        return cnp.sum(cm.apply({"params": p}, x, mask=cmask,
                                rngs={"dropout": random.PRNGKey(dk)}) * w)

    co = cm.apply(cv, X, mask=cmask, rngs={"dropout": random.PRNGKey(dk)})
    assert co.shape == want["out"].shape
    np.testing.assert_allclose(np.asarray(co), want["out"], rtol=1e-5, atol=2e-6)
    cl, (cgp, cgx) = cts.value_and_grad(closs, argnums=(0, 1))(cv["params"], X)
    np.testing.assert_allclose(float(cl), float(want["loss"]), rtol=1e-5, atol=1e-5)
    _assert_trees_close(_host(cgp), want["d/dparams"], what=f"{name}/{mask_name} d/dparams")
    _assert_trees_close({"x": np.asarray(cgx)}, {"x": want["d/dx"]}, what="d/dx")


def test_mha_dropout_mask_is_flax_bit_for_bit(jax_ref):
    """With kernels of ones the output is the dropped weights summed; the same dropout key
    keeps the same weights as Flax (jax.random.bernoulli), so the outputs are the same to
    rounding and the zero pattern of the weights is identical."""
    kw = dict(num_heads=2, qkv_features=4, dropout_rate=0.5, deterministic=False)
    q = np.abs(X[..., :8].reshape(B, L, 2, 4))
    bds = (True, False)

    def flax_side(jax, fnn):
        out = []
        for bd in bds:
            f = fnn.MultiHeadDotProductAttention(**kw, broadcast_dropout=bd)
            fv = f.init(jax.random.PRNGKey(0), X)
            _, fs = f.apply(fv, X, sow_weights=True, dropout_rng=jax.random.PRNGKey(9),
                            mutable=["intermediates"])
            out.append({"sown": fs["intermediates"]["attention_weights"][0],
                        "dropped": fnn.dot_product_attention_weights(
                            q, q, dropout_rng=jax.random.PRNGKey(9), dropout_rate=0.5,
                            broadcast_dropout=bd)})
        return out

    for bd, want in zip(bds, jax_ref("flax", flax_side)):
        c = nn.MultiHeadDotProductAttention(**kw, broadcast_dropout=bd)
        cv = c.init(random.PRNGKey(0), X)
        _, cs = c.apply(cv, X, sow_weights=True, dropout_rng=random.PRNGKey(9),
                        mutable=["intermediates"])
        # sown weights are before dropout (Flax sows before it): identical structure
        cw = np.asarray(cs["intermediates"]["attention_weights"][0])
        np.testing.assert_allclose(cw, want["sown"], rtol=1e-5, atol=1e-7)
        # the dropped weights themselves, through the function with the same key
        cd = np.asarray(nn.dot_product_attention_weights(
            q, q, dropout_rng=random.PRNGKey(9), dropout_rate=0.5, broadcast_dropout=bd))
        fd = want["dropped"]
        assert ((cd == 0) == (fd == 0)).all()
        assert 0.3 < (cd == 0).mean() < 0.7
        np.testing.assert_allclose(cd, fd, rtol=1e-6, atol=1e-7)


def test_mha_cross_attention_inputs_k_v_kv_and_extra_batch_dims_match_flax(jax_ref):
    key = np.asarray(random.PRNGKey(3))
    cfg = dict(num_heads=2, qkv_features=8)
    # a generator of its own: both twins (and the recording) see the same inputs
    r = np.random.RandomState(5)
    xv = r.randn(B, 7, 6).astype(np.float32)
    x4 = r.randn(2, 3, 4, 6).astype(np.float32)
    mask = np.ones((B, 1, L, 7), bool)
    mask[:, :, :, 5:] = False

    def flax_side(jax, fnn):
        fkey = jax.numpy.asarray(key)
        fv = _init(fnn, jax.random, cfg, fkey, X, XK, xv)
        fv2 = _init(fnn, jax.random, cfg, fkey, X, XK)
        fv4 = _init(fnn, jax.random, dict(num_heads=2), fkey, x4)
        return {"params": _host(fv["params"]),
                "out": _build(fnn, cfg).apply(fv, X, XK, xv, mask=mask),
                "out_k": _build(fnn, cfg).apply(fv2, X, XK),
                "out4": _build(fnn, dict(num_heads=2)).apply(
                    fv4, x4, mask=fnn.make_causal_mask(np.ones((2, 3, 4))))}

    want = jax_ref("flax", flax_side)
    cv = _init(nn, random, cfg, key, X, XK, xv)
    _assert_trees_close(_host(cv["params"]), want["params"], rtol=0)
    assert _host(cv["params"])["value/kernel"].shape == (6, 2, 4)
    co = _build(nn, cfg).apply(cv, X, XK, xv, mask=mask)
    np.testing.assert_allclose(np.asarray(co), want["out"], rtol=1e-5, atol=2e-6)
    # inputs_k only: inputs_v = inputs_k; inputs_kv: both (deprecated, warns as Flax)
    cv2 = _init(nn, random, cfg, key, X, XK)
    np.testing.assert_allclose(np.asarray(_build(nn, cfg).apply(cv2, X, XK)), want["out_k"],
                               rtol=1e-5, atol=2e-6)
    with pytest.warns(DeprecationWarning, match="inputs_kv"):
        ckv = _build(nn, cfg).apply(cv2, X, inputs_kv=XK)
    np.testing.assert_array_equal(np.asarray(ckv), np.asarray(_build(nn, cfg).apply(cv2, X, XK)))
    # two batch dims, causal mask with an extra batch dim for the heads' leading 1
    m4 = nn.make_causal_mask(np.ones((2, 3, 4)))
    cv4 = _init(nn, random, dict(num_heads=2), key, x4)
    np.testing.assert_allclose(
        np.asarray(_build(nn, dict(num_heads=2)).apply(cv4, x4, mask=m4)), want["out4"],
        rtol=1e-5, atol=2e-6)


def _parent(nn_mod):
    """Both layer names in one parent: their auto names (MultiHeadAttention_0 vs
    MultiHeadDotProductAttention_0)."""
    class M(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            return nn_mod.MultiHeadAttention(2)(x) + nn_mod.MultiHeadDotProductAttention(2)(x)
    return M()


def test_self_attention_and_alias_match_flax(jax_ref):
    key = np.asarray(random.PRNGKey(4))
    mask = nn.make_causal_mask(TOKENS)

    def flax_side(jax, fnn):
        fkey = jax.numpy.asarray(key)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            fv = _init(fnn, jax.random, dict(num_heads=3), fkey, X, cls="SelfAttention")
        with pytest.warns(DeprecationWarning):
            fo = fnn.SelfAttention(num_heads=3).apply(fv, X, mask)
        fp = _parent(fnn).init(fkey, X)["params"]
        return {"params": _host(fv["params"]), "out": fo, "parent_names": sorted(fp),
                "parent_params": _host(fp), "parent_out": _parent(fnn).apply({"params": fp}, X)}

    want = jax_ref("flax", flax_side)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        cv = _init(nn, random, dict(num_heads=3), key, X, cls="SelfAttention")
    _assert_trees_close(_host(cv["params"]), want["params"], rtol=0)
    with pytest.warns(DeprecationWarning, match="SelfAttention"):
        co = nn.SelfAttention(num_heads=3).apply(cv, X, mask)
    np.testing.assert_allclose(np.asarray(co), want["out"], rtol=1e-5, atol=2e-6)
    # same as MultiHeadDotProductAttention on inputs_q alone
    np.testing.assert_array_equal(
        np.asarray(co), np.asarray(nn.MultiHeadDotProductAttention(3).apply(cv, X, mask=mask)))
    cp = _parent(nn).init(key, X)["params"]
    assert sorted(cp) == want["parent_names"] == ["MultiHeadAttention_0",
                                                   "MultiHeadDotProductAttention_0"]
    _assert_trees_close(_host(cp), want["parent_params"], rtol=0)
    np.testing.assert_allclose(np.asarray(_parent(nn).apply({"params": cp}, X)),
                               want["parent_out"], rtol=1e-5, atol=2e-6)


def _two_dropout_layers(nn_mod):
    """Flax's docstring example: two attention layers with dropout, called with an optional
    dropout_rng shared by both."""
    kw = dict(num_heads=4, qkv_features=8, dropout_rate=0.5, deterministic=False,
              kernel_init=nn_mod.initializers.ones, bias_init=nn_mod.initializers.zeros)

    class M(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x, dropout_rng=None):
            a = nn_mod.MultiHeadDotProductAttention(**kw)(x, dropout_rng=dropout_rng)
            b = nn_mod.MultiHeadDotProductAttention(**kw)(x, dropout_rng=dropout_rng)
            return a, b
    return M()


def test_mha_dropout_rng_argument_and_streams_match_flax(jax_ref):
    """Flax's docstring example: two layers with dropout, keys from rngs={'dropout'} (each
    layer its own) or one dropout_rng for both (same masks)."""
    def flax_side(jax, fnn):
        two = _two_dropout_layers(fnn)
        fv = two.init({"params": jax.random.PRNGKey(1), "dropout": jax.random.PRNGKey(2)}, X)
        f1, f2 = two.apply(fv, X, rngs={"dropout": jax.random.PRNGKey(3)})
        g1, _ = two.apply(fv, X, dropout_rng=jax.random.PRNGKey(5))
        return {"params": _host(fv["params"]), "out1": f1, "out2": f2, "shared_key_out1": g1}

    want = jax_ref("flax", flax_side)
    two = _two_dropout_layers(nn)
    cv = two.init({"params": random.PRNGKey(1), "dropout": random.PRNGKey(2)}, X)
    _assert_trees_close(_host(cv["params"]), want["params"], rtol=0)
    c1, c2 = two.apply(cv, X, rngs={"dropout": random.PRNGKey(3)})
    np.testing.assert_allclose(np.asarray(c1), want["out1"], rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(c2), want["out2"], rtol=1e-5, atol=2e-6)
    assert not np.allclose(np.asarray(c1), np.asarray(c2))   # each layer its own dropout key
    s1, s2 = two.apply(cv, X, dropout_rng=random.PRNGKey(5))
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))     # one key, same masks
    np.testing.assert_allclose(np.asarray(s1), want["shared_key_out1"], rtol=1e-5, atol=2e-6)


def test_mha_eval_shape_matches_flax_structure(jax_ref):
    mask = nn.make_causal_mask(TOKENS)

    def flax_side(jax, fnn):
        from flax.traverse_util import flatten_dict
        finit = fnn.with_logical_partitioning(fnn.initializers.lecun_normal(),
                                              ("embed", "heads", "kv"))
        fa = jax.eval_shape(fnn.MultiHeadDotProductAttention(3, kernel_init=finit).init,
                            jax.random.PRNGKey(0), X, mask=mask)
        return {"specs": {"/".join(k): tuple(v) for k, v in
                          flatten_dict(fnn.get_partition_spec(fa)["params"]).items()},
                "shapes": {"/".join(k): tuple(v.shape) for k, v in
                           flatten_dict(fnn.unbox(fa)["params"]).items()}}

    want = jax_ref("flax", flax_side)
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "heads", "kv"))
    a = cts.eval_shape(nn.MultiHeadDotProductAttention(3, kernel_init=init).init,
                       random.PRNGKey(0), X, mask=mask)
    specs = {k: tuple(v) for k, v in _flat(nn.get_partition_spec(a)["params"]).items()}
    assert specs == want["specs"] and specs["out/kernel"] == ("embed", "heads", "kv")
    shapes = {k: v.shape for k, v in _flat(nn.unbox(a)["params"]).items()}
    assert shapes == want["shapes"]


# --- dot_product_attention and the mask helpers against Flax ----------------------------------

def test_dot_product_attention_matches_flax_values_and_grads(jax_ref):
    q, k, v = _qkv()
    bias = np.random.RandomState(2).randn(2, 3, 4, 6).astype(np.float32)
    mask = np.random.RandomState(3).rand(2, 1, 4, 6) > 0.3
    g = np.random.RandomState(4).randn(2, 4, 3, 7).astype(np.float32)
    kws = (dict(), dict(mask=mask, bias=bias), dict(mask=mask, dropout_rate=0.3),
           dict(mask=mask, dropout_rate=0.3, broadcast_dropout=False))

    def flax_side(jax, fnn):
        out = []
        for kw in kws:
            fkw = dict(kw, dropout_rng=jax.random.PRNGKey(6)) if "dropout_rate" in kw else kw
            fl, fg = jax.value_and_grad(
                lambda q, k, v, b: jax.numpy.sum(
                    fnn.dot_product_attention(q, k, v, **dict(fkw, bias=b)) * g),
                argnums=(0, 1, 2, 3))(q, k, v, bias)
            out.append({"out": fnn.dot_product_attention(q, k, v, **fkw), "loss": fl,
                        "grads": dict(zip("qkvb", fg))})
        return out

    for kw, want in zip(kws, jax_ref("flax", flax_side)):
        ckw = dict(kw, dropout_rng=random.PRNGKey(6)) if "dropout_rate" in kw else kw
        co = nn.dot_product_attention(q, k, v, **ckw)
        np.testing.assert_allclose(np.asarray(co), want["out"], rtol=1e-5, atol=1e-6)
        cl, cg = cts.value_and_grad(
            lambda q, k, v, b: cnp.sum(nn.dot_product_attention(q, k, v, **dict(ckw, bias=b)) * g),
            argnums=(0, 1, 2, 3))(q, k, v, bias)
        np.testing.assert_allclose(float(cl), float(want["loss"]), rtol=1e-5)
        _assert_trees_close(dict(zip("qkvb", map(np.asarray, cg))), want["grads"], what=str(kw))


def test_mask_helpers_match_flax(jax_ref):
    a = np.array([[1, 2, 0], [3, 0, 0]])
    b = np.array([[5, 0, 1, 1], [0, 2, 2, 0]])
    cases = [((a > 0, b > 0), {}), ((a, b), {}), ((a > 0, b > 0), dict(extra_batch_dims=2)),
             ((a, b), dict(pairwise_fn="greater_equal")), ((a > 0, a > 0), dict(dtype="bool"))]
    causal_cases = ((np.ones((2, 5)), {}), (np.ones((3, 2, 4)), dict(extra_batch_dims=1)),
                    (np.ones(6), {}))
    m1 = nn.make_attention_mask(a > 0, a > 0)
    m2 = nn.make_causal_mask(a)

    def named(kw, jnp):
        """kw with the pairwise_fn and dtype its strings name, of numpy or jax.numpy."""
        kw = dict(kw)
        if kw.get("pairwise_fn") == "greater_equal":
            kw["pairwise_fn"] = jnp.greater_equal
        if kw.get("dtype") == "bool":
            kw["dtype"] = jnp.bool_
        return kw

    want = jax_ref("flax", lambda jnp, fnn: {
        "attention": [fnn.make_attention_mask(x, y, **named(kw, jnp)) for (x, y), kw in cases],
        "causal": [fnn.make_causal_mask(x, **kw) for x, kw in causal_cases],
        "combined": fnn.combine_masks(m1, None, m2),
        "combined_none": fnn.combine_masks(None),
        "combined_bool": fnn.combine_masks(m1, m2, dtype=jnp.bool_)})
    for ((x, y), kw), fm in zip(cases, want["attention"]):
        got = nn.make_attention_mask(x, y, **named(kw, np))
        assert isinstance(got, np.ndarray) and got.dtype == fm.dtype and got.shape == fm.shape
        np.testing.assert_array_equal(got, fm)
    for (x, kw), fm in zip(causal_cases, want["causal"]):
        got = nn.make_causal_mask(x, **kw)
        assert got.dtype == fm.dtype
        np.testing.assert_array_equal(got, fm)
    np.testing.assert_array_equal(nn.combine_masks(m1, None, m2), want["combined"])
    assert nn.combine_masks(None, None) is None and want["combined_none"] is None
    np.testing.assert_array_equal(nn.combine_masks(m1, m2, dtype=np.bool_), want["combined_bool"])


# --- DenseGeneral with boxed initializers (the projections) ------------------------------------

def test_dense_general_boxed_kernel_init_matches_flax(jax_ref):
    x = np.random.RandomState(0).randn(2, 3, 8).astype(np.float32)
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    cases = (((4, 2), -1, ("embed", "heads", "kv")), (5, (-2, -1), ("heads", "kv", "embed")))
    inputs = [x if axis == -1 else x.reshape(2, 3, 4, 2) for _, axis, _ in cases]

    def flax_side(jax, fnn):
        out = []
        for (feats, axis, names), xi in zip(cases, inputs):
            f = fnn.DenseGeneral(feats, axis=axis, kernel_init=fnn.with_logical_partitioning(
                fnn.initializers.lecun_normal(), names))
            fv = f.init(jax.random.PRNGKey(1), xi)
            out.append({"names": tuple(fv["params"]["kernel"].names),
                        "params": _host(fv["params"]), "y": f.apply(fv, xi)})
        return out

    for (feats, axis, names), xi, want in zip(cases, inputs, jax_ref("flax", flax_side)):
        c = nn.DenseGeneral(feats, axis=axis, kernel_init=_LP(nn.initializers.lecun_normal(), names))
        cv = c.init(random.PRNGKey(1), xi)
        assert cv["params"]["kernel"].names == want["names"] == names
        _assert_trees_close(_host(cv["params"]), want["params"], rtol=0)
        with mesh, nn.logical_axis_rules((("heads", "model"), ("kv", "data"))):
            sv = c.init(random.PRNGKey(1), xi)
            k = sv["params"]["kernel"].value
            assert k.sharding == NamedSharding(mesh, nn.logical_to_mesh_axes(names))
            np.testing.assert_allclose(np.asarray(c.apply(sv, xi)), want["y"],
                                       rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(k), want["params"]["kernel"])


# --- RMSNorm and LayerNorm options ------------------------------------------------------------

NORM_CASES = [
    ("RMSNorm", {}), ("RMSNorm", dict(use_scale=False)), ("RMSNorm", dict(epsilon=1e-2)),
    ("RMSNorm", dict(reduction_axes=(1, 2), feature_axes=-1)),
    ("RMSNorm", dict(reduction_axes=-1, feature_axes=(1, 2))),
    ("RMSNorm", dict(scale_init="normal")),
    ("LayerNorm", {}), ("LayerNorm", dict(use_bias=False)), ("LayerNorm", dict(use_scale=False)),
    ("LayerNorm", dict(use_fast_variance=False)),
    ("LayerNorm", dict(reduction_axes=(1, 2, 3), feature_axes=-1)),
    ("LayerNorm", dict(reduction_axes=(1, 2), feature_axes=(-2, -1), bias_init="normal")),
]


def _norm(nn_mod, cls, kw):
    kw = dict(kw)
    for k in ("scale_init", "bias_init"):
        if kw.get(k) == "normal":
            kw[k] = nn_mod.initializers.normal(0.5)
    return getattr(nn_mod, cls)(**kw)


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("cls,kw", NORM_CASES, ids=[f"{c}-{i}" for i, (c, _) in enumerate(NORM_CASES)])
def test_norms_match_flax(cls, kw, masked, jax_ref):
    r = np.random.RandomState(2)
    x = (r.randn(2, 3, 4, 5) * 3 + 1).astype(np.float32)
    g = r.randn(2, 3, 4, 5).astype(np.float32)
    mask = (r.rand(2, 3, 4, 5) > 0.3) if masked else None

    def flax_side(jax, fnn):
        fv = _norm(fnn, cls, kw).init(jax.random.PRNGKey(3), x)
        fl, (fgp, fgx) = jax.value_and_grad(lambda p, x: jax.numpy.sum(
            _norm(fnn, cls, kw).apply({"params": p}, x, mask=mask) * g), argnums=(0, 1))(
            fv.get("params", {}), x)
        return {"names": sorted(fv.get("params", {})), "params": _host(fv.get("params", {})),
                "out": _norm(fnn, cls, kw).apply(fv, x, mask=mask), "loss": fl,
                "d/dparams": _host(fgp), "d/dx": fgx}

    want = jax_ref("flax", flax_side)
    cv = _norm(nn, cls, kw).init(random.PRNGKey(3), x)
    assert sorted(cv.get("params", {})) == want["names"]    # 'scale', 'bias'
    if want["params"]:
        _assert_trees_close(_host(cv["params"]), want["params"], rtol=0)
    co = _norm(nn, cls, kw).apply(cv, x, mask=mask)
    np.testing.assert_allclose(np.asarray(co), want["out"], rtol=1e-5, atol=1e-5)
    cl, (cgp, cgx) = cts.value_and_grad(lambda p, x: cnp.sum(
        _norm(nn, cls, kw).apply({"params": p}, x, mask=mask) * g), argnums=(0, 1))(
        cv.get("params", {}), x)
    np.testing.assert_allclose(float(cl), float(want["loss"]), rtol=1e-5, atol=1e-4)
    if want["params"]:
        _assert_trees_close(_host(cgp), want["d/dparams"], what=f"{cls}{kw} d/dparams")
    _assert_trees_close({"x": np.asarray(cgx)}, {"x": want["d/dx"]}, what="d/dx")
