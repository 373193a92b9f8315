"""Autoregressive decoding: ``MultiHeadDotProductAttention(decode=True)`` (Flax's 'cache'
collection) and the ops it is built on, ``lax.dynamic_slice`` / ``lax.dynamic_update_slice``.

Without Flax: decoding step by step equals the full causal forward pass with the same
parameters; the errors (query length, a missing or immutable cache); a run on a (2, 4) mesh
(batch over data, heads over model) equals the single-device one, with the cache born sharded
and no device gathering it. The lax ops against a numpy reference of jax's index rules (a
negative index counts from the end once, then the start is clamped so the region fits).
Against Flax (`jax_ref`: recorded in tests/data/recorded/test_attention_decode.npz, live in the
`parity` twins): init's parameters, cache and output, and every decoding step's output and
cache (also past max_length), the errors and eval_shape; the lax ops' values against jax.lax
and their gradients against jax.grad."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import NamedSharding, P, lax, nn, random
from ctrainstate.nn.scope import ScopeVariableNotFoundError
from conftest import flat_tree as _flat

_RS = np.random.RandomState(0)
B, L, E = 2, 5, 12
X = _RS.randn(B, L, E).astype(np.float32)
TOKENS = np.array([[3, 4, 5, 6, 0], [1, 2, 3, 0, 0]])   # 0 = padding (at the end)

CONFIGS = {
    "default": dict(num_heads=3),
    "qkv6_out7": dict(num_heads=3, qkv_features=6, out_features=7),
    "normalize_qk": dict(num_heads=2, normalize_qk=True),
    "no_bias": dict(num_heads=4, use_bias=False),
}


def _host(tree):
    return {k: np.asarray(v) for k, v in _flat(tree).items()}


def _decode(model, params, cache, xs, mask=None, **kw):
    """Run ``model`` one position of ``xs`` at a time; (outputs [B, T, F], caches after
    every step)."""
    outs, caches = [], []
    for t in range(xs.shape[1]):
        y, upd = model.apply({"params": params, "cache": cache}, xs[:, t:t + 1], mask=mask,
                             mutable=["cache"], **kw)
        cache = upd["cache"]
        outs.append(np.asarray(y))
        caches.append(cache)
    return np.concatenate(outs, axis=1), caches


# --- step by step == the full causal forward pass --------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decoding_equals_full_causal_forward(name):
    cfg = CONFIGS[name]
    dec = nn.MultiHeadDotProductAttention(decode=True, **cfg)
    full = nn.MultiHeadDotProductAttention(**cfg)
    v = dec.init(random.PRNGKey(1), X)
    assert sorted(v) == ["cache", "params"]
    assert _host(v["params"]).keys() == _host(full.init(random.PRNGKey(1), X)["params"]).keys()
    heads = cfg["num_heads"]
    hd = cfg.get("qkv_features", E) // heads
    c = v["cache"]
    assert c["cached_key"].shape == c["cached_value"].shape == (B, L, heads, hd)
    assert c["cached_key"].dtype == np.float32 and not np.asarray(c["cached_key"]).any()
    assert c["cache_index"].shape == () and c["cache_index"].dtype == np.int32
    assert int(np.asarray(c["cache_index"])) == 0

    want = np.asarray(full.apply({"params": v["params"]}, X, mask=nn.make_causal_mask(X[..., 0])))
    got, caches = _decode(dec, v["params"], c, X)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert [int(np.asarray(k["cache_index"])) for k in caches] == list(range(1, L + 1))
    # the cache holds the projected keys of the whole sequence
    keys = nn.DenseGeneral(features=(heads, hd), axis=-1, use_bias=full.use_bias).apply(
        {"params": v["params"]["key"]}, X)
    if full.normalize_qk:
        keys = nn.LayerNorm(use_bias=False).apply({"params": v["params"]["key_ln"]}, keys)
    np.testing.assert_allclose(np.asarray(caches[-1]["cached_key"]), np.asarray(keys),
                               rtol=1e-6, atol=1e-6)


def test_decoding_with_a_padding_mask_equals_causal_and_padding_forward():
    dec = nn.MultiHeadDotProductAttention(3, decode=True)
    full = nn.MultiHeadDotProductAttention(3)
    v = dec.init(random.PRNGKey(2), X)
    pad = nn.make_attention_mask(np.ones_like(TOKENS), TOKENS > 0)   # padded keys only
    want = np.asarray(full.apply({"params": v["params"]}, X,
                                 mask=nn.combine_masks(pad, nn.make_causal_mask(TOKENS))))
    key_mask = (TOKENS > 0)[:, None, None, :]            # [B, 1, 1, max_length]
    got, _ = _decode(dec, v["params"], v["cache"], X, mask=key_mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_decoding_bfloat16_cache_and_outputs():
    dec = nn.MultiHeadDotProductAttention(3, dtype=cnp.bfloat16, decode=True)
    full = nn.MultiHeadDotProductAttention(3, dtype=cnp.bfloat16)
    v = dec.init(random.PRNGKey(3), X)
    assert v["cache"]["cached_key"].dtype == cnp.bfloat16          # the projections' dtype
    assert v["params"]["query"]["kernel"].dtype == np.float32       # param_dtype
    got, caches = _decode(dec, v["params"], v["cache"], X)
    assert caches[-1]["cached_value"].dtype == cnp.bfloat16
    want = np.asarray(full.apply({"params": v["params"]}, X, mask=nn.make_causal_mask(X[..., 0])))
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-2,
                               atol=2e-2)


def test_mutable_cache_absent_initialises_it_like_init():
    """apply(params, full-length x, mutable=['cache']) with no cache creates it (Flax:
    initialisation is detected by the absence of cached_key) and runs as decode=False."""
    dec = nn.MultiHeadDotProductAttention(3, decode=True)
    v = dec.init(random.PRNGKey(4), X)
    y, upd = dec.apply({"params": v["params"]}, X, mutable=["cache"])
    y0 = nn.MultiHeadDotProductAttention(3).apply({"params": v["params"]}, X)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y0), rtol=1e-6, atol=1e-6)
    assert {k: a.shape for k, a in upd["cache"].items()} == \
        {k: a.shape for k, a in v["cache"].items()}


def test_past_max_length_overwrites_the_last_position():
    """Flax's dynamic_update_slice clamps the index: step max_length + k writes the last
    slot again, the index keeps counting and every position is attended."""
    dec = nn.MultiHeadDotProductAttention(3, decode=True)
    v = dec.init(random.PRNGKey(5), X)
    more = np.concatenate([X, X[:, :2] * 2.0], axis=1)
    _, caches = _decode(dec, v["params"], v["cache"], more)
    assert int(np.asarray(caches[-1]["cache_index"])) == L + 2
    k4, k5, k6 = (np.asarray(caches[i]["cached_key"]) for i in (L - 1, L, L + 1))
    np.testing.assert_array_equal(k5[:, :L - 1], k4[:, :L - 1])
    np.testing.assert_array_equal(k6[:, :L - 1], k4[:, :L - 1])
    assert not np.array_equal(k5[:, L - 1], k4[:, L - 1])
    assert not np.array_equal(k6[:, L - 1], k5[:, L - 1])


# --- errors -----------------------------------------------------------------------------------

def test_decode_errors():
    dec = nn.MultiHeadDotProductAttention(3, qkv_features=6, decode=True)
    v = dec.init(random.PRNGKey(0), X)
    with pytest.raises(ValueError, match=r"Autoregressive cache shape error, expected query "
                                         r"shape \(2, 1, 3, 2\) instead got \(2, 2, 3, 2\)\."):
        dec.apply(v, X[:, :2], mutable=["cache"])
    with pytest.raises(ScopeVariableNotFoundError,
                       match=r'Tried to access "cached_key" from collection "cache" in "/" but the '
                             r'collection is empty\. .*mutable=\["cache"\]'):
        dec.apply({"params": v["params"]}, X[:, :1])
    with pytest.raises(ValueError, match=r'Cannot update variable "cached_key" in "/" because '
                                         r'collection "cache" is immutable\.'):
        dec.apply(v, X[:, :1])
    with pytest.raises(ScopeVariableNotFoundError,     # a cache without this layer's variables
                       match=r'No Variable named "cached_key" for collection "cache" exists'):
        dec.apply({"params": v["params"], "cache": {"other": np.zeros(2)}}, X[:, :1])

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.MultiHeadDotProductAttention(3, decode=True, name="attn")(x)
    sv = Stack().init(random.PRNGKey(0), X)
    with pytest.raises(ScopeVariableNotFoundError, match=r'in "/attn" but the collection is empty'):
        Stack().apply({"params": sv["params"]}, X[:, :1])


def test_decode_eval_shape():
    dec = nn.MultiHeadDotProductAttention(3, decode=True)
    a = cts.eval_shape(dec.init, random.PRNGKey(0), X)
    assert {k: (s.shape, s.dtype) for k, s in a["cache"].items()} == {
        "cached_key": ((B, L, 3, 4), np.float32), "cached_value": ((B, L, 3, 4), np.float32),
        "cache_index": ((), np.int32)}
    v = dec.init(random.PRNGKey(0), X)
    y, upd = cts.eval_shape(lambda v, x: dec.apply(v, x, mutable=["cache"]), v, X[:, :1])
    assert y.shape == (B, 1, E) and upd["cache"]["cached_key"].shape == (B, L, 3, 4)


# --- sharded ----------------------------------------------------------------------------------

def test_sharded_decoding_equals_single_device():
    lp, init = nn.with_logical_partitioning, nn.initializers.lecun_normal()
    b, l, e, heads, hd = 4, 128, 16, 8, 8
    dec = nn.MultiHeadDotProductAttention(
        heads, qkv_features=heads * hd, decode=True,
        kernel_init=lp(init, ("embed", "heads", "kv")),
        out_kernel_init=lp(init, ("heads", "kv", "embed")))
    x = np.random.RandomState(6).randn(b, l, e).astype(np.float32)
    steps = 4
    v0 = dec.init(random.PRNGKey(0), x)
    p0 = nn.unbox(v0["params"])
    out0, caches0 = _decode(dec, p0, v0["cache"], x[:, :steps])

    mesh = cts.make_mesh((2, 4), ("data", "model"))
    with mesh, nn.logical_axis_rules((("batch", "data"), ("heads", "model"))):
        xs = cts.device_put(x, NamedSharding(mesh, P("data")))
        v = dec.init(random.PRNGKey(0), xs)
        p = nn.unbox(v["params"])
        c = v["cache"]
        spec = P("data", None, "model")         # the projected key's: batch and heads sharded
        assert c["cached_key"].sharding == NamedSharding(mesh, spec)
        assert c["cached_value"].sharding == NamedSharding(mesh, spec)
        assert c["cache_index"].sharding == NamedSharding(mesh, P())
        assert {blk[1].shape for blk in c["cached_key"]._blocks} == {(b // 2, l, heads // 4, hd)}
        outs = []
        for t in range(steps):
            cts.reset_peak_memory_stats()
            before = [d.memory_stats()["bytes_in_use"] for d in cts.devices()]
            y, upd = dec.apply({"params": p, "cache": c}, xs[:, t:t + 1], mutable=["cache"])
            grew = [d.memory_stats()["peak_bytes_in_use"] - before[i]
                    for i, d in enumerate(cts.devices())]
            # the new key and value blocks (1/8 of a cache each: 16 KiB) and small activations;
            # a device gathering a cache would need 128 KiB more
            full = b * l * heads * hd * 4
            assert max(grew) < 2 * full // 8 + full // 4, grew
            c = upd["cache"]
            assert c["cached_key"].sharding == NamedSharding(mesh, spec)
            assert c["cache_index"].sharding == NamedSharding(mesh, P())
            assert y.sharding.spec[0] == "data"
            outs.append(np.asarray(y))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), out0, rtol=1e-5, atol=1e-5)
    for k in ("cached_key", "cached_value", "cache_index"):
        np.testing.assert_allclose(np.asarray(c[k]), np.asarray(caches0[-1][k]), rtol=1e-5,
                                   atol=1e-6, err_msg=k)


# --- against Flax ----------------------------------------------------------------------------

# (layer kwargs, a key mask for every step or None, tolerance): jax compiles each, so few
FLAX_CONFIGS = {
    "dropout": (dict(num_heads=3, dropout_rate=0.3, deterministic=False), None, 1e-5),
    "qkv8_out7_normalize_qk_mask": (dict(num_heads=2, qkv_features=8, out_features=7,
                                         normalize_qk=True), "keys", 1e-5),
    "bfloat16_no_bias": (dict(num_heads=3, dtype=cnp.bfloat16, use_bias=False), None, 2e-2),
}


@pytest.mark.parametrize("name", sorted(FLAX_CONFIGS))
def test_decoding_matches_flax(name, jax_ref):
    cfg, mask, tol = FLAX_CONFIGS[name]
    key = np.asarray(random.PRNGKey(7))
    # L + 2 steps: past max_length Flax's clamped index overwrites the last position
    xs = np.concatenate([X, X[:, :2] * -1.5], axis=1)
    mask = (TOKENS > 0)[:, None, None, :] if mask == "keys" else None
    drop = cfg.get("dropout_rate")

    def flax_side(jax, fnn):
        rngs_f = {"params": jax.numpy.asarray(key), "dropout": jax.random.PRNGKey(11)}
        fdec = fnn.MultiHeadDotProductAttention(decode=True, **cfg)
        fy, fv = jax.jit(fdec.init_with_output)(rngs_f, X)      # jitted: one compile
        fkw = {"rngs": {"dropout": jax.random.PRNGKey(3)}} if drop else {}
        fstep = jax.jit(lambda v, x: fdec.apply(v, x, mask=mask, mutable=["cache"], **fkw))
        fc, steps = fv["cache"], []
        for t in range(xs.shape[1]):
            sy, fupd = fstep({"params": fv["params"], "cache": fc},
                             jax.numpy.asarray(xs[:, t:t + 1]))
            fc = fupd["cache"]
            steps.append({"y": sy, "cache": dict(fc)})
        return {"collections": sorted(fv), "params": _host(fv["params"]),
                "cache": dict(fv["cache"]), "y": fy, "steps": steps}

    f = jax_ref("flax", flax_side)
    rngs_c = {"params": key, "dropout": random.PRNGKey(11)}
    dec = nn.MultiHeadDotProductAttention(decode=True, **cfg)
    y, v = dec.init_with_output(rngs_c, X)
    assert sorted(v) == f["collections"] == ["cache", "params"]
    got, want = _host(v["params"]), f["params"]
    assert got.keys() == want.keys()
    for k in want:                       # the same parameters as Flax for the same key
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
    for k, a in f["cache"].items():
        assert v["cache"][k].shape == a.shape and v["cache"][k].dtype == a.dtype, k
        np.testing.assert_array_equal(np.asarray(v["cache"][k]), a)
    np.testing.assert_allclose(np.asarray(y).astype(np.float32),
                               f["y"].astype(np.float32), rtol=tol, atol=tol)

    kw = {"rngs": {"dropout": random.PRNGKey(3)}} if drop else {}
    c = v["cache"]
    for t in range(xs.shape[1]):
        y, upd = dec.apply({"params": v["params"], "cache": c}, xs[:, t:t + 1], mask=mask,
                           mutable=["cache"], **kw)
        fy, fc = f["steps"][t]["y"], f["steps"][t]["cache"]
        c = upd["cache"]
        np.testing.assert_allclose(np.asarray(y).astype(np.float32),
                                   np.asarray(fy).astype(np.float32), rtol=tol, atol=tol,
                                   err_msg=f"step {t}")
        assert int(np.asarray(c["cache_index"])) == int(fc["cache_index"]) == t + 1
        for k in ("cached_key", "cached_value"):
            assert c[k].dtype == fc[k].dtype
            np.testing.assert_allclose(np.asarray(c[k]).astype(np.float32),
                                       np.asarray(fc[k]).astype(np.float32), rtol=tol,
                                       atol=tol / 10, err_msg=f"step {t} {k}")


def test_decode_errors_and_eval_shape_match_flax(jax_ref):
    calls = [lambda m, v: m.apply(v, X[:, :2], mutable=["cache"]),
             lambda m, v: m.apply({"params": v["params"]}, X[:, :1]),
             lambda m, v: m.apply(v, X[:, :1])]

    def flax_side(jax, fnn):
        fdec = fnn.MultiHeadDotProductAttention(3, decode=True)
        fv = jax.jit(fdec.init)(jax.random.PRNGKey(0), X)
        errors = []
        for call in calls:
            try:
                call(fdec, fv)
                errors.append(None)
            except Exception as e:   # (what pytest.raises(Exception) would take)
                errors.append(str(e))
        fa = jax.eval_shape(fdec.init, jax.random.PRNGKey(0), X)
        return {"errors": errors, "eval_shape": {
            k: (tuple(s.shape), np.dtype(s.dtype).name) for k, s in fa["cache"].items()}}

    f = jax_ref("flax", flax_side)
    dec = nn.MultiHeadDotProductAttention(3, decode=True)
    v = dec.init(random.PRNGKey(0), X)
    for call, theirs in zip(calls, f["errors"]):
        with pytest.raises(Exception) as ours:
            call(dec, v)
        assert theirs is not None, "flax raised no error"
        # Flax's message, then (ctrainstate) a hint; Flax appends its docs link
        assert theirs.startswith(str(ours.value).split(" (")[0]), (str(ours.value), theirs)
    a = cts.eval_shape(dec.init, random.PRNGKey(0), X)
    assert {k: (s.shape, np.dtype(s.dtype)) for k, s in a["cache"].items()} == \
        {k: (shape, np.dtype(dt)) for k, (shape, dt) in f["eval_shape"].items()}


# --- lax.dynamic_slice / dynamic_update_slice -------------------------------------------------

def _np_starts(shape, starts, sizes, allow=True):
    """jax's rule, independently: i < 0 -> i + n (once), then clamp into [0, n - size]."""
    out = []
    for i, n, m in zip(starts, shape, sizes):
        i = int(i)
        if i < 0 and allow:
            i += n
        out.append(min(max(i, 0), n - m))
    return out


def _np_dynamic_slice(x, starts, sizes, allow=True):
    s = _np_starts(x.shape, starts, sizes, allow)
    return x[tuple(slice(a, a + m) for a, m in zip(s, sizes))]


def _np_dynamic_update_slice(x, u, starts, allow=True):
    s = _np_starts(x.shape, starts, u.shape, allow)
    y = x.copy()
    y[tuple(slice(a, a + m) for a, m in zip(s, u.shape))] = u
    return y


# (operand shape, start indices, slice / update shape)
LAX_CASES = [
    ((6,), (2,), (3,)),
    ((6,), (5,), (3,)),             # clamped to 3
    ((6,), (-2,), (3,)),            # -2 + 6 = 4 -> clamped to 3
    ((6,), (-10,), (3,)),           # -4 -> 0
    ((6,), (0,), (6,)),             # the whole operand
    ((6,), (3,), (0,)),             # empty
    ((3, 4, 5), (1, -1, 2), (2, 1, 3)),
    ((3, 4, 5), (7, 7, 7), (1, 4, 2)),
    ((2, 5, 3, 4), (0, 3, 0, 0), (2, 1, 3, 4)),    # a decoding cache write
]


@pytest.mark.parametrize("shape,starts,sizes", LAX_CASES)
def test_lax_dynamic_slice_and_update_against_numpy(shape, starts, sizes):
    r = np.random.RandomState(len(shape))
    x = r.randn(*shape).astype(np.float32)
    u = r.randn(*sizes).astype(np.float32)
    xa = cts.device_put(x)
    for idx in (starts, tuple(cnp.array(i, dtype=np.int32) for i in starts),
                np.asarray(starts, np.int32), cnp.asarray(np.asarray(starts, np.int32))):
        np.testing.assert_array_equal(np.asarray(lax.dynamic_slice(xa, idx, sizes)),
                                      _np_dynamic_slice(x, starts, sizes))
        np.testing.assert_array_equal(np.asarray(lax.dynamic_update_slice(xa, u, idx)),
                                      _np_dynamic_update_slice(x, u, starts))
    np.testing.assert_array_equal(np.asarray(xa), x)           # functional: xa unchanged
    if any(s < 0 for s in starts):
        # allow_negative_indices=False: a negative int is an error, a negative Array clamps
        with pytest.raises(ValueError, match="out of bounds for dimension"):
            lax.dynamic_slice(xa, starts, sizes, allow_negative_indices=False)
        arr = tuple(cnp.array(i, dtype=np.int32) for i in starts)
        np.testing.assert_array_equal(
            np.asarray(lax.dynamic_update_slice(xa, u, arr, allow_negative_indices=False)),
            _np_dynamic_update_slice(x, u, starts, allow=False))


def test_lax_dtypes_sharding_and_abstract():
    x = np.arange(2 * 6 * 4 * 3).reshape(2, 6, 4, 3)
    u = -np.arange(2 * 1 * 4 * 3).reshape(2, 1, 4, 3) - 1
    for dt in (np.int32, cnp.bfloat16, np.float16, np.uint32):
        xa, ua = cts.device_put(x.astype(dt)), cts.device_put(u.astype(dt))
        y = lax.dynamic_update_slice(xa, ua, (0, 4, 0, 0))
        assert y.dtype == dt
        np.testing.assert_array_equal(np.asarray(y), _np_dynamic_update_slice(
            x.astype(dt), u.astype(dt), (0, 4, 0, 0)))
        s = lax.dynamic_slice(xa, (1, 2, 1, 0), (1, 3, 2, 3))
        assert s.dtype == dt
        np.testing.assert_array_equal(np.asarray(s), x.astype(dt)[1:2, 2:5, 1:3])
    # sharded: batch over data, heads over model; the result keeps the operand's sharding
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    sh = NamedSharding(mesh, P("data", None, "model"))
    xs = cts.device_put(x.astype(np.float32), sh)
    for upd in (cts.device_put(u.astype(np.float32), sh), cts.device_put(u.astype(np.float32)),
                u.astype(np.float32)):
        y = lax.dynamic_update_slice(xs, upd, (0, cnp.array(2, dtype=np.int32), 0, 0))
        assert y.sharding == sh
        np.testing.assert_array_equal(np.asarray(y), _np_dynamic_update_slice(
            x.astype(np.float32), u.astype(np.float32), (0, 2, 0, 0)))
    s = lax.dynamic_slice(xs, (0, 3, 0, 0), (2, 2, 4, 3))
    assert s.sharding.spec == P("data", None, "model")      # whole dims keep their mesh axes
    np.testing.assert_array_equal(np.asarray(s), x[:, 3:5].astype(np.float32))
    # eval_shape: shapes only, the index is not read
    a = cts.eval_shape(lambda x, i: lax.dynamic_update_slice(x, x[:, :1], (0, i, 0, 0)),
                       xs, cnp.array(1, dtype=np.int32))
    assert a.shape == x.shape and a.dtype == np.float32
    a = cts.eval_shape(lambda x: lax.dynamic_slice(x, (0, 1, 0, 0), (1, 2, 3, 1)), xs)
    assert a.shape == (1, 2, 3, 1)


def test_lax_errors():
    x = cts.device_put(np.zeros((4, 5), np.float32))
    u = np.ones((2, 2), np.float32)
    cases = [
        (TypeError, "requires arguments to have the same dtypes, got float32, bfloat16",
         lambda: lax.dynamic_update_slice(x, cts.device_put(u).astype(cnp.bfloat16), (0, 0))),
        (TypeError, "update must have the same rank as operand",
         lambda: lax.dynamic_update_slice(x, np.ones(2, np.float32), (0, 0))),
        (TypeError, "update shape must be smaller than operand shape",
         lambda: lax.dynamic_update_slice(x, np.ones((5, 2), np.float32), (0, 0))),
        (ValueError, r"Length of slice indices must match number of operand dimensions \(1 vs",
         lambda: lax.dynamic_update_slice(x, u, (0,))),
        (TypeError, "must be integers", lambda: lax.dynamic_update_slice(x, u, (0.0, 0))),
        (TypeError, "must be integers", lambda: lax.dynamic_slice(x, (True, 0), (1, 1))),
        (TypeError, "must be scalars",
         lambda: lax.dynamic_update_slice(x, u, (cnp.array([0, 1], dtype=np.int32), 0))),
        (TypeError, "slice_sizes must be less than or equal to operand shape",
         lambda: lax.dynamic_slice(x, (0, 0), (5, 2))),
        (TypeError, "slice_sizes must be greater than or equal to zero",
         lambda: lax.dynamic_slice(x, (0, 0), (-1, 2))),
        (ValueError, "one size per dimension", lambda: lax.dynamic_slice(x, (0, 0), (1,))),
        (ValueError, "Index -1 is out of bounds for dimension 4 if allow_negative_indices=False",
         lambda: lax.dynamic_slice(x, (-1, 0), (1, 2), allow_negative_indices=False)),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()


def test_lax_values_and_gradients_match_jax(jax_ref):
    r = np.random.RandomState(9)
    for shape, starts, sizes in [LAX_CASES[i] for i in (2, 8)]:   # jax compiles each
        x = r.randn(*shape).astype(np.float32)
        u = r.randn(*sizes).astype(np.float32)
        w = r.randn(*shape).astype(np.float32)
        ws = r.randn(*sizes).astype(np.float32)

        def f(x, u, m):
            return m.sum(m.dynamic_update_slice(x, u, starts) ** 2 * w)

        def g(x, m):
            return m.sum(m.dynamic_slice(x, starts, sizes) ** 3 * ws)

        want = jax_ref(f"{shape} {starts} {sizes}", lambda jax: {
            "update": jax.lax.dynamic_update_slice(x, u, starts),
            "slice": jax.lax.dynamic_slice(x, starts, sizes),
            "grad update": jax.jit(jax.grad(lambda a, b: f(a, b, _JaxOps(jax)),
                                            argnums=(0, 1)))(x, u),
            "grad slice": jax.jit(jax.grad(lambda a: g(a, _JaxOps(jax))))(x)})
        np.testing.assert_array_equal(
            np.asarray(lax.dynamic_update_slice(cts.device_put(x), u, starts)), want["update"])
        np.testing.assert_array_equal(
            np.asarray(lax.dynamic_slice(cts.device_put(x), starts, sizes)), want["slice"])
        got = cts.grad(lambda a, b: f(a, b, _CtOps), argnums=(0, 1))(cts.device_put(x),
                                                                       cts.device_put(u))
        for a, b in zip(got, want["grad update"]):
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-6)
        gx = cts.grad(lambda a: g(a, _CtOps))(cts.device_put(x))
        np.testing.assert_allclose(np.asarray(gx), want["grad slice"], rtol=1e-6, atol=1e-6)
    # 16-bit floats: gradients in their dtype, through float32
    xb = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    ub = np.full((1, 2), 0.5, np.float32)

    def h(x, u, m, to):
        return m.sum(to(m.dynamic_update_slice(to(x), to(u), (2, 3))) * xb)
    got = cts.grad(lambda a, b: h(a, b, _CtOps, lambda v: cnp.astype(v, cnp.bfloat16)),
                   argnums=(0, 1))(cts.device_put(xb), cts.device_put(ub))
    want = jax_ref("bfloat16", lambda jax, jnp: jax.jit(jax.grad(
        lambda a, b: h(a, b, _JaxOps(jax), lambda v: v.astype(jnp.bfloat16)),
        argnums=(0, 1)))(xb, ub))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a).astype(np.float32),
                                   np.asarray(b).astype(np.float32), rtol=1e-2, atol=1e-2)


class _CtOps:
    dynamic_update_slice = staticmethod(lax.dynamic_update_slice)
    dynamic_slice = staticmethod(lax.dynamic_slice)
    sum = staticmethod(cnp.sum)


class _JaxOps:
    def __init__(self, jax):
        self.dynamic_update_slice = jax.lax.dynamic_update_slice
        self.dynamic_slice = jax.lax.dynamic_slice
        self.sum = jax.numpy.sum



def test_lax_in_dim_forms_match_numpy_and_jax(jax_ref):
    """dynamic_slice_in_dim / dynamic_index_in_dim / dynamic_update_slice_in_dim /
    dynamic_update_index_in_dim: the one-axis forms, jax's clamping, any axis (negative too),
    on a sharded operand; against numpy, then live jax."""
    x = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    a = cts.device_put(x, NamedSharding(mesh, P(None, "data")))
    cases = [
        (lambda m, v: m.dynamic_slice_in_dim(v, 3, 2, axis=1), x[:, 2:4]),      # clamped 3 -> 2
        (lambda m, v: m.dynamic_slice_in_dim(v, -2, 2, axis=-1), x[..., 3:5]),
        (lambda m, v: m.dynamic_index_in_dim(v, 1, axis=2), x[..., 1:2]),
        (lambda m, v: m.dynamic_index_in_dim(v, 9, axis=0, keepdims=False), x[2]),
        (lambda m, v: m.dynamic_update_slice_in_dim(v, np.ones((3, 2, 5), np.float32), 3, 1),
         np.concatenate([x[:, :2], np.ones((3, 2, 5), np.float32)], axis=1)),
        (lambda m, v: m.dynamic_update_index_in_dim(v, np.full((3, 4), -1.0, np.float32), 4, 2),
         np.concatenate([x[..., :4], np.full((3, 4, 1), -1.0, np.float32)], axis=2)),
    ]
    for f, want in cases:
        np.testing.assert_array_equal(np.asarray(f(lax, a)), want)
    with pytest.raises(ValueError, match="axis 3 is out of bounds"):
        lax.dynamic_slice_in_dim(a, 0, 1, axis=3)
    assert cts.eval_shape(lambda v: lax.dynamic_index_in_dim(v, 0, 1, False),
                          cts.ShapeDtypeStruct((3, 4, 5), np.float32)).shape == (3, 5)
    for f, _ in cases:
        np.testing.assert_array_equal(np.asarray(f(lax, a)), jax_ref(None, lambda jax: f(jax.lax, x)))
    g = cts.grad(lambda v: cnp.sum(lax.dynamic_slice_in_dim(v, 1, 2, axis=0) * 3.0))(a)
    jg = jax_ref("grad", lambda jax: jax.grad(
        lambda v: jax.numpy.sum(jax.lax.dynamic_slice_in_dim(v, 1, 2, axis=0) * 3.0))(x))
    np.testing.assert_array_equal(np.asarray(g), jg)
