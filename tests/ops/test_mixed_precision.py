"""Mixed precision: dtype conversions on devices (the core's convert kernel), ops on
bfloat16 / float16 Arrays (jax's promotion, float32 compute, one rounding per op), their
gradients, and the layers' ``dtype=`` (Flax's mixed precision) against Flax. jax's and Flax's
values are recorded (conftest's ``jax_ref``: tests/data/recorded/test_mixed_precision.npz)."""
import math

import ml_dtypes
import numpy as np
import pytest
from conftest import flat_tree
from recorded import dtype as rec_dtype

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import nn, random

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = [F32, F16, BF16, np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.bool_)]
FLOATS = (F32, F16, BF16)


@pytest.fixture
def mesh24():
    return cts.make_mesh((2, 4), ("data", "model"))


def _host(x):
    return np.asarray(x)


def _f32(a):
    return np.asarray(a).astype(np.float32)


# --- the convert kernel -------------------------------------------------------------------

def _sources(dt):
    """Values of dtype ``dt`` covering the conversion rules' edges, plus random ones."""
    r = np.random.default_rng(7)
    if dt in FLOATS:
        edges = np.array([0.0, -0.0, 0.5, 1.5, 2.5, -1.5, -2.7, 1e-8, 6e-8, 65504.0, 65519.9,
                          65520.0, 70000.0, 2.0 ** 24 + 1, 2.0 ** 31, -(2.0 ** 31), 3e9, -3e9,
                          4.3e9, 1e30, np.inf, -np.inf, np.nan, -np.nan], np.float32)
        rand = (r.standard_normal(500) * 10.0 ** r.integers(-6, 10, 500)).astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            return np.concatenate([edges, rand]).astype(dt)
    if dt == np.bool_:
        return np.array([True, False, True, True])
    ints = [0, 1, -1, 7, 2 ** 24 + 1, 2 ** 24 + 3, 33554435, 123456789, 2 ** 31 - 1, -(2 ** 31),
            65504, 65520, 70000]
    rand = r.integers(-(2 ** 31), 2 ** 31, 300)
    return np.array(ints + list(rand), np.int64).astype(dt)


def _reference(src, dst):
    """jax's convert_element_type, spelled independently with numpy / ml_dtypes."""
    s = src.dtype
    if dst == np.bool_:
        return src.astype(np.float64) != 0 if s in FLOATS else src != 0
    if s == np.bool_:
        return src.astype(np.int64).astype(dst)
    if s in FLOATS and dst in FLOATS:
        with np.errstate(over="ignore"):
            return src.astype(np.float32).astype(dst)        # widening exact, narrowing RNE
    if s in FLOATS:                                          # truncate, saturate, NaN -> 0
        v = src.astype(np.float64)
        info = np.iinfo(dst)
        out = np.trunc(np.nan_to_num(v, nan=0.0, posinf=info.max, neginf=info.min))
        return np.clip(out, info.min, info.max).astype(np.int64).astype(dst)
    v = src.astype(np.int64)
    if dst in FLOATS:                        # one rounding from the exact integer
        with np.errstate(over="ignore"):
            return v.astype(np.float64).astype(dst) if dst != BF16 else \
                v.astype(np.float64).astype(BF16)
    return (v % 2 ** 32).astype(np.uint32).view(np.int32).astype(dst) if dst == np.int32 \
        else (v % 2 ** 32).astype(np.uint32)


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype in FLOATS:
        a32, b32 = a.astype(np.float32), b.astype(np.float32)
        np.testing.assert_array_equal(np.isnan(a32), np.isnan(b32))
        ok = ~np.isnan(a32)
        np.testing.assert_array_equal(a32[ok].view(np.uint32), b32[ok].view(np.uint32))
    else:
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("src", DTYPES, ids=str)
def test_astype_every_dtype_pair_matches_the_reference(src):
    x = _sources(src)
    a = cts.device_put(x)
    for dst in DTYPES:
        y = a.astype(dst)
        assert y.dtype == dst and y.sharding == a.sharding
        _same(_host(y), _reference(x, dst))


def test_astype_matches_jax(jax_ref):
    want = jax_ref("jax", lambda jnp: [[jnp.asarray(_sources(src)).astype(dst) for dst in DTYPES]
                                       for src in DTYPES])
    for src, want_src in zip(DTYPES, want, strict=True):
        x = _sources(src)
        for dst, w in zip(DTYPES, want_src, strict=True):
            _same(_host(cts.device_put(x).astype(dst)), w)


@pytest.mark.parametrize("half", [F16, BF16], ids=str)
def test_every_16_bit_pattern_widens_and_narrows_back_exactly(half):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    h = bits.view(half)
    wide = cts.device_put(h).astype(np.float32)
    _same(_host(wide), h.astype(np.float32))
    back = _host(wide.astype(half)).view(np.uint16)
    nan = np.isnan(h.astype(np.float32))
    np.testing.assert_array_equal(back[~nan], bits[~nan])
    assert np.isnan(_host(wide.astype(half))[nan].astype(np.float32)).all()


def test_float32_rounding_ties_and_boundaries():
    """Nearest-even ties, overflow to inf, subnormals, on 2^20 float32 patterns around the
    16-bit formats' rounding points (the last kept bit 0/1 and the dropped bits 0x7fff..)."""
    r = np.random.default_rng(3)
    hi = r.integers(0, 1 << 16, 1 << 14, dtype=np.uint32) << 16
    low = np.array([0, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1000, 0x0fff, 0x2000, 0x1fff,
                    0x3000, 0x0001, 0x4000, 0x5fff, 0x6000, 0x7000], np.uint32)
    bits = (hi[:, None] | low[None, :]).ravel()
    x = bits.view(np.float32)
    a = cts.device_put(x)
    for half in (F16, BF16):
        with np.errstate(over="ignore", invalid="ignore"):
            _same(_host(a.astype(half)), x.astype(half))


def test_astype_on_a_mesh_converts_each_block_in_place(mesh24):
    x = np.random.default_rng(0).standard_normal((8, 12)).astype(np.float32)
    a = cts.device_put(x, cts.NamedSharding(mesh24, cts.P("data", "model")))
    b = a.astype(BF16)
    assert b.sharding == a.sharding
    for s in b.addressable_shards:
        assert s.data.shape == (4, 3)
        _same(np.asarray(s.data), x[s.index].astype(BF16))
    _same(_host(b.astype(np.float32)), x.astype(BF16).astype(np.float32))


def test_astype_errors_and_identity():
    a = cts.device_put(np.ones(3, np.float32))
    assert a.astype(np.float32) is a
    with pytest.raises(TypeError, match="not supported"):
        a.astype(np.complex64)
    s = cts.ShapeDtypeStruct((2, 3), np.float32)
    assert cnp.astype(s, BF16) == cts.ShapeDtypeStruct((2, 3), BF16)


# --- ops on 16-bit floats -----------------------------------------------------------------

def _rand(shape, dt, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32).astype(dt)


UNARY = ["negative", "sin", "cos", "tanh", "relu", "gelu", "exp", "sqrt", "rsqrt", "square",
         "sigmoid", "abs", "log"]


@pytest.mark.parametrize("dt", [BF16, F16], ids=str)
def test_ops_round_the_float32_result_once(dt):
    """Each op on 16-bit Arrays equals the float32 op on the widened values, rounded once to
    the dtype (XLA's CPU semantics for 16-bit floats), and returns that dtype."""
    x = _rand((6, 5), dt, 1)
    y = _rand((6, 5), dt, 2)
    pos = np.abs(x.astype(np.float32)).astype(dt) + dt.type(0.5)
    ax, ay, ap = cts.device_put(x), cts.device_put(y), cts.device_put(pos)
    wx, wy, wp = (cts.device_put(v.astype(np.float32)) for v in (x, y, pos))
    for name in UNARY:
        f = getattr(cnp, name)
        arg, warg = (ap, wp) if name in ("sqrt", "rsqrt", "log") else (ax, wx)
        out = f(arg)
        assert out.dtype == dt, name
        _same(_host(out), _host(f(warg)).astype(dt))
    for name in ("add", "subtract", "multiply", "divide", "maximum", "minimum"):
        f = getattr(cnp, name)
        out = f(ax, ay)
        assert out.dtype == dt, name
        _same(_host(out), _host(f(wx, wy)).astype(dt))
    for f in (cnp.sum, cnp.mean, cnp.max, cnp.min):
        out = f(ax, axis=1)
        assert out.dtype == dt
        _same(_host(out), _host(f(wx, axis=1)).astype(dt))
    m = cnp.matmul(ax, cnp.transpose(ay))
    assert m.dtype == dt
    _same(_host(m), _host(cnp.matmul(wx, cnp.transpose(wy))).astype(dt))
    e = cnp.einsum("ij,kj->ik", ax, ay)
    _same(_host(e), _host(m))
    sm = nn.softmax(ax)
    assert sm.dtype == dt
    _same(_host(sm), _host(nn.softmax(wx)).astype(dt))
    for f, args in ((cnp.reshape, ((30,),)), (cnp.transpose, ()), (cnp.broadcast_to, ((2, 6, 5),)),
                    (cnp.expand_dims, (0,))):
        out = f(ax, *args)
        assert out.dtype == dt
        _same(_host(out), np.asarray(getattr(np, f.__name__)(x, *args)))


@pytest.mark.parametrize("dt", [np.int32, np.uint32, np.bool_, BF16], ids=str)
def test_layout_ops_move_any_dtype_natively(dt, mesh24):
    """reshape / transpose / expand_dims copy bytes: integers keep every bit (no float32 trip),
    sharded or not, and eval_shape keeps the dtype."""
    x = (np.arange(48, dtype=np.int64) * 2654435761 % (1 << 32)).astype(np.uint32).astype(dt)
    x = x.reshape(8, 6)
    a = cts.device_put(x, cts.NamedSharding(mesh24, cts.P("data", None)))
    for out, want in ((cnp.reshape(a, (4, 12)), x.reshape(4, 12)), (cnp.transpose(a), x.T),
                      (cnp.expand_dims(a, 1), x[:, None]), (a.reshape(2, 24), x.reshape(2, 24))):
        assert out.dtype == dt
        np.testing.assert_array_equal(np.asarray(out).view(np.uint8),
                                      np.ascontiguousarray(want).view(np.uint8))
    assert cnp.reshape(a, (4, 12)).sharding.spec == cts.P("data")
    s = cts.ShapeDtypeStruct((8, 6), dt)
    assert cts.eval_shape(lambda v: cnp.transpose(cnp.reshape(v, (6, 8))), s) == \
        cts.ShapeDtypeStruct((8, 6), dt)


def test_promotion_follows_jax(jax_ref):
    vals = {
        "bf16": np.ones(3, BF16), "f16": np.ones(3, F16), "f32": np.ones(3, np.float32),
        "i32": np.ones(3, np.int32), "pyfloat": 2.0, "pyint": 3, "npf32": np.float32(2.0),
    }
    arrays = ("bf16", "f16", "f32", "i32")
    want = jax_ref("jax", lambda jnp: {
        "sums": [[jnp.add(jnp.asarray(vals[a]), jnp.asarray(v) if b in arrays else v)
                  for b, v in vals.items()] for a in arrays],
        "doubled": jnp.multiply(jnp.asarray(vals["i32"]), 2)})
    for a, want_a in zip(arrays, want["sums"], strict=True):
        for (b, v), w in zip(vals.items(), want_a, strict=True):
            ours = cnp.add(cts.device_put(vals[a]), cts.device_put(v) if b in arrays else v)
            assert ours.dtype == w.dtype, (a, b, ours.dtype, w.dtype)
            np.testing.assert_array_equal(_f32(ours), _f32(w))
    doubled = cnp.multiply(cts.device_put(vals["i32"]), 2)   # int32 (weak int), as jax
    assert doubled.dtype == want["doubled"].dtype == np.int32


def test_ops_match_jax_within_a_few_ulp(jax_ref):
    def f(mod, nnmod, x, w):
        h = mod.tanh(mod.matmul(x, w) * 2.0 + 1.0)
        return nnmod.softmax(h) * mod.exp(mod.sin(h))

    inputs = [(dt, _rand((4, 16), dt, 3), _rand((16, 8), dt, 4, 0.25)) for dt in (BF16, F16)]
    wants = jax_ref("jax", lambda jax: [f(jax.numpy, jax.nn, jax.numpy.asarray(x),
                                          jax.numpy.asarray(w)) for _, x, w in inputs])
    for (dt, x, w), want in zip(inputs, wants, strict=True):
        ours = f(cnp, nn, cts.device_put(x), cts.device_put(w))
        assert ours.dtype == want.dtype == dt
        ulp = 2.0 ** -7 if dt == BF16 else 2.0 ** -10
        np.testing.assert_allclose(_f32(ours), _f32(want), rtol=4 * ulp, atol=4 * ulp)


# --- gradients ----------------------------------------------------------------------------

def test_gradients_through_bfloat16_compute_match_jax(jax_ref):
    x = _rand((8, 16), np.float32, 5)
    w1, w2 = _rand((16, 32), np.float32, 6, 0.3), _rand((32, 4), np.float32, 7, 0.3)

    def loss(mod, act, params, x):
        h = act(mod.matmul(x.astype(BF16), params["w1"].astype(BF16)))
        y = mod.matmul(h, params["w2"].astype(BF16))
        return mod.mean(mod.square(y.astype(np.float32)))

    def jax_side(jax):
        jnp = jax.numpy
        return jax.value_and_grad(lambda p: loss(jnp, jnp.tanh, p, jnp.asarray(x)))(
            {"w1": jnp.asarray(w1), "w2": jnp.asarray(w2)})

    jv, jg = jax_ref("jax", jax_side)
    p = {"w1": cts.device_put(w1), "w2": cts.device_put(w2)}
    v, g = cts.value_and_grad(lambda p: loss(cnp, cnp.tanh, p, cts.device_put(x)))(p)
    assert g["w1"].dtype == np.float32          # the params' dtype, as in jax
    np.testing.assert_allclose(float(v), float(jv), rtol=2 ** -6)
    for k in ("w1", "w2"):
        scale = np.abs(np.asarray(jg[k])).max()
        np.testing.assert_allclose(_host(g[k]), np.asarray(jg[k]), atol=scale * 2 ** -5)


def test_bfloat16_inputs_get_bfloat16_cotangents(jax_ref):
    x = _rand((5, 3), BF16, 8)

    def f(mod, x):
        return mod.sum(mod.sin(x) * x).astype(np.float32)
    g = cts.grad(lambda a: f(cnp, a))(cts.device_put(x))
    jg = jax_ref("jax", lambda jax: jax.grad(lambda a: f(jax.numpy, a))(jax.numpy.asarray(x)))
    assert g.dtype == jg.dtype == BF16
    np.testing.assert_allclose(_f32(g), _f32(jg), rtol=2 ** -6, atol=2 ** -6)
    # a bfloat16 input used twice: its cotangents add in bfloat16
    g2 = cts.grad(lambda a: cnp.sum(a * 3.0 + a).astype(np.float32))(cts.device_put(x))
    assert g2.dtype == BF16 and np.all(_f32(g2) == 4.0)


def test_astype_between_floats_is_differentiable_and_ints_stop_the_gradient():
    x = cts.device_put(np.array([1.0, 2.0 + 2 ** -10, -3.0], np.float32))
    g = cts.grad(lambda a: cnp.sum(a.astype(BF16).astype(np.float32) * 2.0))(x)
    assert g.dtype == np.float32 and _host(g).tolist() == [2.0, 2.0, 2.0]
    g = cts.grad(lambda a: cnp.sum(a * a.astype(np.int32)))(x)   # int32 branch: no gradient
    assert _host(g).tolist() == [1.0, 2.0, -3.0]


# --- layers: Flax's dtype= ------------------------------------------------------------------

def _flax_outputs(jax_ref, layers, inits):
    """Flax's output of each layer ``make(flax.linen)`` of (make, input) ``layers``, applied to
    our variables (``inits``, as host arrays) and the input."""
    host = [cts.tree_util.tree_map(np.asarray, v) for v in inits]
    return jax_ref("flax", lambda fnn: [make(fnn).apply(hv, inp)
                                        for (make, inp), hv in zip(layers, host, strict=True)])


def _close(ours, want, dt):
    assert ours.dtype == want.dtype, (ours.dtype, want.dtype)
    o, w = _f32(ours), _f32(want)
    ulp = {BF16: 2.0 ** -7, F16: 2.0 ** -10}.get(np.dtype(dt), 2.0 ** -20)
    scale = max(1.0, float(np.abs(w).max()))
    np.testing.assert_allclose(o, w, rtol=4 * ulp, atol=4 * ulp * scale)


@pytest.mark.parametrize("dt", [BF16, F16], ids=str)
@pytest.mark.parametrize("param_dt", [F32, BF16], ids=str)
def test_layers_with_dtype_match_flax(dt, param_dt, jax_ref):
    x = _rand((2, 5, 8), np.float32, 9)
    ids = np.array([[1, 4, 0], [3, 3, 2]], np.int32)
    layers = [   # (the layer of a module library m: ctrainstate.nn or flax.linen, its input)
        (lambda m: m.Dense(6, dtype=dt, param_dtype=param_dt), x),
        (lambda m: m.DenseGeneral((2, 3), axis=(-2, -1), dtype=dt, param_dtype=param_dt), x),
        (lambda m: m.LayerNorm(dtype=dt, param_dtype=param_dt), x),
        (lambda m: m.RMSNorm(dtype=dt, param_dtype=param_dt), x),
        (lambda m: m.Embed(5, 4, dtype=dt, param_dtype=param_dt), ids),
        (lambda m: m.MultiHeadDotProductAttention(2, qkv_features=8, dtype=dt,
                                                  param_dtype=param_dt), x),
    ]
    inits = [make(nn).init(random.PRNGKey(0), inp) for make, inp in layers]
    wants = _flax_outputs(jax_ref, layers, inits)
    for (make, inp), v, want in zip(layers, inits, wants, strict=True):
        ours = make(nn)
        assert {a.dtype for a in flat_tree(v["params"]).values()} == {param_dt}
        out = ours.apply(v, inp)
        _close(out, want, dt)
        assert cts.eval_shape(ours.apply, v, inp).dtype == want.dtype


def test_layers_without_dtype_promote_inputs_and_params(jax_ref):
    xb = _rand((3, 8), BF16, 10)
    layers = [(lambda m: m.Dense(4), xb), (lambda m: m.LayerNorm(), xb),
              (lambda m: m.Dense(4, param_dtype=BF16), xb)]
    inits = [make(nn).init(random.PRNGKey(1), inp) for make, inp in layers]
    wants = _flax_outputs(jax_ref, layers, inits)
    for (make, inp), v, want in zip(layers, inits, wants, strict=True):
        out = make(nn).apply(v, inp)
        _close(out, want, want.dtype)


def test_attention_dropout_and_fp32_softmax_in_bfloat16(jax_ref):
    q = _rand((2, 4, 2, 8), BF16, 11)
    k = _rand((2, 6, 2, 8), BF16, 12)
    mask = np.tril(np.ones((4, 6), bool))[None, None]
    key = random.PRNGKey(5)
    hkey = np.asarray(key)

    def flax_side(jax, fnn):
        return {"w": fnn.dot_product_attention_weights(q, k, mask=mask),
                "w32": fnn.dot_product_attention_weights(q, k, mask=mask,
                                                         force_fp32_for_softmax=True),
                "dropout": fnn.dot_product_attention_weights(
                    q, k, dropout_rng=jax.numpy.asarray(hkey), dropout_rate=0.25)}

    want = jax_ref("flax", flax_side)
    w = nn.dot_product_attention_weights(q, k, mask=mask)
    jw = want["w"]
    _close(w, jw, BF16)
    w32 = nn.dot_product_attention_weights(q, k, mask=mask, force_fp32_for_softmax=True)
    jw32 = want["w32"]
    assert w32.dtype == jw32.dtype == np.float32
    np.testing.assert_allclose(_host(w32), jw32, rtol=1e-5, atol=1e-6)
    d = nn.dot_product_attention_weights(q, k, dropout_rng=key, dropout_rate=0.25)
    jd = want["dropout"]
    np.testing.assert_array_equal(_f32(d) == 0, np.asarray(jd).astype(np.float32) == 0)
    _close(d, jd, BF16)


def test_bfloat16_compute_on_a_mesh_equals_one_device(mesh24):
    """x[batch:data] @ W[:, hidden:model] in bfloat16: the same bits as on one device (no
    contraction is split, so each element's float32 sum is the same before rounding)."""
    x = _rand((8, 16), BF16, 13)
    w = _rand((16, 12), np.float32, 14)
    with mesh24:
        xs = cts.device_put(x, cts.P("data", None))
        ws = cts.device_put(w, cts.P(None, "model"))
        y = cnp.matmul(xs, ws.astype(BF16))
    assert y.dtype == BF16 and y.sharding.spec == cts.P("data", "model")
    _same(_host(y), _host(cnp.matmul(cts.device_put(x), cts.device_put(w).astype(BF16))))


def test_train_step_with_bfloat16_activations_and_float32_params():
    """The t5x setup: float32 params and optimizer state, bfloat16 compute; the loss falls."""
    from ctrainstate import optim
    from ctrainstate.train_state import TrainState

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.Dense(32, dtype=BF16)(x))
            return nn.Dense(1, dtype=BF16)(h)
    x = _rand((64, 4), np.float32, 15)
    t = np.sin(x.sum(axis=1, keepdims=True))
    model = MLP()
    st = TrainState.create(apply_fn=model.apply, params=model.init(random.PRNGKey(0), x)["params"],
                           tx=optim.adam(1e-2))

    def loss(p):
        y = st.apply_fn({"params": p}, x)
        return cnp.mean(cnp.square(y.astype(np.float32) - t))
    losses = []
    for _ in range(30):
        v, g = cts.value_and_grad(loss)(st.params)
        assert {a.dtype for a in flat_tree(g).values()} == {F32}
        st = st.apply_gradients(grads=g)
        losses.append(float(v))
    assert math.isfinite(losses[-1]) and losses[-1] < 0.5 * losses[0]


# --- indexing and joins of 16-bit floats under autodiff --------------------------------------

_INDEXING = [
    ("slice", lambda m, a: m.sum(a[1:, :2] * 2.0)),
    ("concat", lambda m, a: m.sum(m.concatenate([a, a * 3.0], 0))),
    ("split", lambda m, a: m.sum(m.split(a, 2, axis=1)[0] * a[:, :2])),
    ("stack", lambda m, a: m.sum(m.stack([a, a * 2.0]))),
    ("at_set", lambda m, a: m.sum(a.at[0].set(5.0) * a)),
    ("at_add", lambda m, a: m.sum(a.at[1:, 1].add(a[0, :2]) * a)),
    ("gather", lambda m, a: m.sum(a[np.array([0, 2, 2])] * 2.0)),
    ("steps", lambda m, a: m.sum(a[::-1, ::2] * a[:, 1:3])),
    ("mask", lambda m, a: m.sum(a[np.array([True, False, True])])),
]


@pytest.mark.parametrize("name,f", _INDEXING, ids=[n for n, _ in _INDEXING])
def test_indexing_of_16_bit_floats_differentiates_like_float32(name, f):
    """Slices, joins, gathers and .at updates of a bfloat16 Array carry gradients (bfloat16
    cotangents): with every intermediate exact in bfloat16 (multiples of 1/8 up to 11/8, their
    products and sums) the gradients equal the float32 run's; the value is that of the float32
    run rounded once (the final sum accumulates in float32)."""
    x = (np.arange(12, dtype=np.float32).reshape(3, 4) / 8).astype(BF16)
    v, g = cts.value_and_grad(lambda a: f(cnp, a).astype(np.float32))(cts.device_put(x))
    v32, g32 = cts.value_and_grad(lambda a: f(cnp, a))(cts.device_put(x.astype(np.float32)))
    assert g.dtype == BF16 and np.any(_f32(g) != 0)
    np.testing.assert_array_equal(_f32(g), _host(g32))
    assert float(v) == float(np.float32(float(v32)).astype(BF16))


def test_indexing_of_16_bit_floats_matches_jax(jax_ref):
    x = (np.arange(12, dtype=np.float32).reshape(3, 4) / 7).astype(BF16)
    wants = jax_ref("jax", lambda jax: [
        jax.value_and_grad(lambda a, f=f: f(jax.numpy, a).astype(np.float32))(jax.numpy.asarray(x))
        for _, f in _INDEXING])
    for (name, f), (jv, jg) in zip(_INDEXING, wants, strict=True):
        v, g = cts.value_and_grad(lambda a: f(cnp, a).astype(np.float32))(cts.device_put(x))
        assert g.dtype == jg.dtype, name
        assert float(v) == float(jv), name
        np.testing.assert_allclose(_f32(g), _f32(jg), rtol=2 ** -7, atol=2 ** -7, err_msg=name)


# --- review fixes: composite reductions, dropout multiplier, .at values, keywords --------------

def test_var_and_std_of_16_bit_floats_round_once(jax_ref):
    """jnp.var/std upcast 16-bit floats: var of values near 200 (where bfloat16's spacing is 1)
    is that of the float32 widening, rounded once -- not a chain of bfloat16 roundings."""
    y = (np.random.default_rng(16).standard_normal(4096) + 200.4).astype(BF16)
    wide = y.astype(np.float64)
    for f, ref in ((cnp.var, wide.var()), (cnp.std, wide.std())):
        out = f(cts.device_put(y))
        assert out.dtype == BF16
        assert abs(float(out) - ref) <= 2 ** -7 * ref, (f.__name__, float(out), ref)
    assert float(cnp.var(cts.device_put(y))) == float(jax_ref("var", lambda jnp: jnp.var(
        jnp.asarray(y))))


def test_attention_dropout_multiplier_is_in_the_compute_dtype(jax_ref):
    """Flax: multiplier = keep.astype(dtype) / asarray(keep_prob, dtype), in the compute dtype
    even when force_fp32_for_softmax leaves the weights float32: kept weights are the undropped
    ones times bf16(1) / bf16(0.9), exactly."""
    q = _rand((1, 4, 2, 8), BF16, 17)
    k = _rand((1, 6, 2, 8), BF16, 18)
    key = random.PRNGKey(3)
    full = _host(nn.dot_product_attention_weights(q, k, force_fp32_for_softmax=True))
    d = _host(nn.dot_product_attention_weights(q, k, dropout_rng=key, dropout_rate=0.1,
                                               force_fp32_for_softmax=True))
    assert d.dtype == np.float32
    mult = np.float32(np.asarray(1.0, BF16) / np.asarray(0.9, BF16))
    kept = d != 0
    assert kept.any() and (~kept).any()
    np.testing.assert_array_equal(d[kept], full[kept] * mult)
    jd = jax_ref("flax", lambda jax, fnn: fnn.dot_product_attention_weights(
        q, k, dropout_rng=jax.numpy.asarray(np.asarray(key)), dropout_rate=0.1,
        force_fp32_for_softmax=True))
    np.testing.assert_allclose(d, jd, rtol=1e-6, atol=1e-7)


def test_at_on_float32_casts_16_bit_array_values():
    x = cts.device_put(np.zeros(4, np.float32))
    v = cts.device_put(np.array([1.5, 2.5], BF16))
    np.testing.assert_array_equal(_host(x.at[np.array([1, 2])].set(v)), [0, 1.5, 2.5, 0])
    np.testing.assert_array_equal(_host(x.at[1:3].add(v)), [0, 1.5, 2.5, 0])


def test_policy_applies_to_operands_passed_by_keyword():
    a = cts.device_put(np.array([1.5, 2.0], BF16))
    out = cnp.add(a=a, b=1.0)
    assert out.dtype == BF16 and _f32(out).tolist() == [2.5, 3.0]
    m = cnp.matmul(a=cnp.reshape(a, (1, 2)), b=np.ones((2, 1), np.float32))
    assert m.dtype == np.float32 and _host(m).tolist() == [[3.5]]


def test_stop_gradient_keeps_every_bit():
    """Inside a trace stop_gradient copies its input: a byte copy (NaN payloads, -0.0, inf)."""
    bits = np.array([0x7d01, 0x7e00, 0xfc00, 0x8000, 0x3c00], np.uint16)
    for dt in (F16, BF16):
        x = cts.device_put(bits.view(dt))
        seen = []

        def f(a):
            seen.append(cts.lax.stop_gradient(a))
            return cnp.sum(cnp.astype(a, np.float32))
        cts.grad(f)(x)
        assert seen[0] is not x
        np.testing.assert_array_equal(np.asarray(seen[0]).view(np.uint16), bits)


def test_joins_promote_16_bit_floats_as_jax(jax_ref):
    b = cts.device_put(np.array([1.5, -2.0], BF16))
    f = cts.device_put(np.array([0.1], np.float32))
    h = cts.device_put(np.array([3.0], F16))
    i = cts.device_put(np.array([7], np.int32))
    for parts, dt in (([b, f], F32), ([b, h], F32), ([b, i], BF16), ([b, b], BF16),
                      ([b, np.array([2.5], np.float32)], F32)):
        out = cnp.concatenate(parts)
        assert out.dtype == dt, (parts, out.dtype)
        want = np.concatenate([np.asarray(p).astype(np.float32) for p in parts]).astype(dt)
        _same(_host(out), want)
    g = cts.grad(lambda a: cnp.sum(cnp.concatenate([a, f]) * 2.0))(b)   # through the cast
    assert g.dtype == BF16 and _f32(g).tolist() == [2.0, 2.0]
    for parts in ([b, f], [b, h], [b, i]):
        assert cnp.concatenate(parts).dtype == rec_dtype(jax_ref(None, lambda jnp: jnp.concatenate(
            [jnp.asarray(np.asarray(p)) for p in parts]).dtype.name))


@pytest.mark.parametrize("dt", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_python_scalars_take_the_16bit_dtype_first(dt):
    """A Python scalar is weakly typed: with a 16-bit float array it becomes that dtype
    before the op (jax): float16_array / 1e5 divides by float16(1e5) = inf, giving 0; it was
    computed with 1e5 itself."""
    x = np.array([0.1, 3.0, -2.5, 6e4], np.float32).astype(dt)
    h = cts.device_put(x)
    f32 = lambda v: np.asarray(v, np.float32)   # noqa: E731
    r = lambda s: np.float32(np.asarray(s, dt).astype(np.float32))   # the scalar, rounded
    with np.errstate(all="ignore"):
        cases = [(h / 1e5, f32(x) / r(1e5)), (h - 65520.0, f32(x) - r(65520.0)),
                 (h * 1e-8, f32(x) * r(1e-8)), (0.3 * h, r(0.3) * f32(x)),
                 (h + 70000, f32(x) + r(70000))]
        for got, want in cases:
            assert got.dtype == dt
            np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                          want.astype(dt).view(np.uint16))
