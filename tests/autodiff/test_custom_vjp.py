"""``ctrainstate.vjp`` and ``ctrainstate.custom_vjp``: checked against hand-derived
cotangents and against ``jax.vjp`` / ``jax.custom_vjp`` (live, or their recorded values)
with the same rules written in jax.numpy."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import NamedSharding, P

RNG = np.random.default_rng(0)
A = RNG.standard_normal((3, 4)).astype(np.float32)
B = RNG.standard_normal((3, 4)).astype(np.float32)


def test_vjp_pytrees_aux_repeated_calls_and_errors():
    def f(p, x):
        return {"y": p["w"] * x, "s": cnp.sum(cnp.sin(x))}, "aux"
    out, f_vjp, aux = cts.vjp(f, {"w": A}, B, has_aux=True)
    assert aux == "aux"
    np.testing.assert_allclose(np.asarray(out["y"]), A * B, rtol=1e-6)
    ct = {"y": np.ones((3, 4), np.float32) * 2, "s": np.float32(3.0)}
    for _ in range(2):       # the recorded tape serves several calls
        gp, gx = f_vjp(ct)
        np.testing.assert_allclose(np.asarray(gp["w"]), 2 * B, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(gx), 2 * A + 3 * np.cos(B), rtol=1e-5)
    # a primal the output does not depend on gets zeros
    _, g_vjp = cts.vjp(lambda a, b: a * 2.0, A, B)
    ga, gb = g_vjp(np.ones((3, 4), np.float32))
    np.testing.assert_array_equal(np.asarray(gb), np.zeros((3, 4)))
    with pytest.raises(TypeError, match="structure"):
        f_vjp({"y": np.ones((3, 4), np.float32)})
    with pytest.raises(ValueError, match="cotangent of shape"):
        g_vjp(np.ones((4, 3), np.float32))
    with pytest.raises(TypeError, match="real-valued inputs"):
        cts.vjp(lambda i: i, np.int32(3))


@cts.custom_vjp
def _clip_gradient(lo, hi, x):
    return x


def _clip_fwd(lo, hi, x):
    return x, (lo, hi)


def _clip_bwd(res, g):
    lo, hi = res
    return (None, None, cnp.clip(g, lo, hi))


_clip_gradient.defvjp(_clip_fwd, _clip_bwd)


def test_custom_vjp_rules_are_used_under_grad_and_not_outside():
    calls = []

    @cts.custom_vjp
    def f(x, y):
        calls.append("fun")
        return cnp.sin(x) * y

    def f_fwd(x, y):
        calls.append("fwd")
        return cnp.sin(x) * y, (cnp.cos(x), cnp.sin(x), y)

    def f_bwd(res, g):
        cos_x, sin_x, y = res
        return (cos_x * g * y * 10.0, sin_x * g)     # 10x the true x-gradient: the rule is used
    f.defvjp(f_fwd, f_bwd)
    np.testing.assert_allclose(np.asarray(f(A, B)), np.sin(A) * B, rtol=1e-6)
    assert calls == ["fun"]
    gx, gy = cts.grad(lambda a, b: cnp.sum(f(a, b) * 2.0), argnums=(0, 1))(A, B)
    assert calls == ["fun", "fwd"]
    np.testing.assert_allclose(np.asarray(gx), 20.0 * np.cos(A) * B, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gy), 2.0 * np.sin(A), rtol=1e-5)
    # used twice in one graph, and with keyword arguments
    g = cts.grad(lambda a: cnp.sum(f(a, B) + f(x=a, y=B)))(A)
    np.testing.assert_allclose(np.asarray(g), 20.0 * np.cos(A) * B, rtol=1e-5)
    # clipping the gradient in the backward pass; None for the untracked arguments
    g = cts.grad(lambda a: cnp.sum(_clip_gradient(-0.5, 0.5, a) * 3.0))(A)
    np.testing.assert_array_equal(np.asarray(g), np.full((3, 4), 0.5, np.float32))
    # straight-through rounding
    st = cts.custom_vjp(lambda x: cnp.round(x))
    st.defvjp(lambda x: (cnp.round(x), None), lambda _, g: (g,))
    g = cts.grad(lambda a: cnp.sum(st(a) * B))(A)
    np.testing.assert_array_equal(np.asarray(g), B)


def test_custom_vjp_nondiff_argnums_pytrees_sharding_and_errors():
    def scale_fwd(k, p):
        return {"a": p["a"] * k, "b": p["b"]}, None

    def scale_bwd(k, _, g):
        return ({"a": g["a"] * (2 * k), "b": g["b"]},)
    scale = cts.custom_vjp(lambda k, p: {"a": p["a"] * k, "b": p["b"]}, nondiff_argnums=(0,))
    scale.defvjp(scale_fwd, scale_bwd)
    g = cts.grad(lambda p: cnp.sum(scale(3.0, p)["a"]) + cnp.sum(scale(3.0, p)["b"]))(
        {"a": A, "b": B})
    np.testing.assert_allclose(np.asarray(g["a"]), np.full((3, 4), 6.0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g["b"]), np.ones((3, 4)), rtol=1e-6)
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    xs = cts.device_put(np.ones((4, 8), np.float32), NamedSharding(mesh, P("data", "model")))
    g = cts.grad(lambda a: cnp.sum(_clip_gradient(-1.0, 1.0, a) * 4.0))(xs)
    assert g.sharding.spec == P("data", "model")
    np.testing.assert_array_equal(np.asarray(g), np.ones((4, 8)))

    bad = cts.custom_vjp(lambda x, y: x * y)
    bad.defvjp(lambda x, y: (x * y, (x, y)), lambda r, g: (g * r[1],))
    with pytest.raises(TypeError, match="one cotangent per differentiable argument \\(2\\)"):
        cts.grad(lambda a: cnp.sum(bad(a, B)))(A)
    wrong = cts.custom_vjp(lambda p: p["a"])
    wrong.defvjp(lambda p: (p["a"], None), lambda r, g: ([g],))
    with pytest.raises(TypeError, match="has structure"):
        cts.grad(lambda a: cnp.sum(wrong({"a": a})))(A)
    shape = cts.custom_vjp(lambda x: x)
    shape.defvjp(lambda x: (x, None), lambda r, g: (cnp.sum(g),))
    with pytest.raises(ValueError, match="cotangent of shape \\(\\) for an input of shape"):
        cts.grad(lambda a: cnp.sum(shape(a)))(A)
    none = cts.custom_vjp(lambda x: x)
    with pytest.raises(AttributeError, match="No VJP defined"):
        none(A)
    with pytest.raises(NotImplementedError, match="symbolic_zeros"):
        none.defvjp(lambda x: (x, None), lambda r, g: (g,), symbolic_zeros=True)


def _custom_clip(lib, sin, cos, clip):
    f = lib.custom_vjp(lambda x, y: sin(x) * y)
    f.defvjp(lambda x, y: (sin(x) * y, (cos(x), sin(x), y)),
             lambda r, g: (clip(r[0] * g * r[2], -0.3, 0.3), r[1] * g))
    return f


def test_vjp_and_custom_vjp_match_jax(jax_ref):
    def fj(x, y, jnp):
        return jnp.tanh(x) * y + jnp.exp(-x * x)

    def fc(x, y):
        return cnp.tanh(x) * y + cnp.exp(-x * x)
    ct = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    want = jax_ref("vjp", lambda jax, jnp: jax.vjp(lambda x, y: fj(x, y, jnp), A, B)[1](ct))
    _, vc = cts.vjp(fc, A, B)
    for a, b in zip(vc(ct), want, strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)

    f_c = _custom_clip(cts, cnp.sin, cnp.cos, cnp.clip)
    gj = jax_ref("custom_vjp_grad", lambda jax, jnp: jax.grad(
        lambda a, b: jnp.sum(_custom_clip(jax, jnp.sin, jnp.cos, jnp.clip)(a, b) * jnp.cos(b)),
        argnums=(0, 1))(A, B))
    gc = cts.grad(lambda a, b: cnp.sum(f_c(a, b) * cnp.cos(b)), argnums=(0, 1))(A, B)
    for a, b in zip(gc, gj, strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)


def test_jacrev_blocks_pytrees_aux_and_against_the_definition():
    W = RNG.standard_normal((2, 3)).astype(np.float32) * 0.5
    x = RNG.standard_normal(3).astype(np.float32)
    J = np.asarray(cts.jacrev(lambda v: cnp.tanh(W @ v))(x))
    want = (1 - np.tanh(W @ x) ** 2)[:, None] * W             # d tanh(Wx)_i / dx_j
    np.testing.assert_allclose(J, want, rtol=1e-5, atol=1e-6)
    assert cts.jacobian is cts.jacrev

    def f(p, v):
        return {"a": cnp.sin(p["w"] @ v), "b": cnp.sum(p["w"])}, 7
    (J, aux) = cts.jacrev(f, argnums=(0, 1), has_aux=True)({"w": W}, x)
    assert aux == 7
    # blocks: output shape + input shape; structure output outside, inputs inside
    assert np.asarray(J["a"][0]["w"]).shape == (2, 2, 3)
    assert np.asarray(J["a"][1]).shape == (2, 3)
    assert np.asarray(J["b"][0]["w"]).shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(J["b"][0]["w"]), np.ones((2, 3)))
    np.testing.assert_allclose(np.asarray(J["a"][1]), np.cos(W @ x)[:, None] * W, rtol=1e-5,
                               atol=1e-6)
    da = np.zeros((2, 2, 3))
    for i in range(2):
        da[i, i] = np.cos(W @ x)[i] * x
    np.testing.assert_allclose(np.asarray(J["a"][0]["w"]), da, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="argnums"):
        cts.jacrev(lambda v: v, argnums=2)(x)


def test_jacrev_matches_jax(jax_ref):
    rng = np.random.default_rng(2)
    W = rng.standard_normal((3, 4)).astype(np.float32)
    x = rng.standard_normal(4).astype(np.float32)
    got = cts.jacrev(lambda w, v: cnp.exp(-cnp.square(w @ v)), argnums=(0, 1))(W, x)
    want = jax_ref("jacrev", lambda jax, jnp: jax.jacrev(
        lambda w, v: jnp.exp(-jnp.square(w @ v)), argnums=(0, 1))(W, x))
    for a, b in zip(got, want, strict=True):
        assert np.asarray(a).shape == b.shape
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-6)


def test_debug_helpers_and_no_op_contexts(capsys):
    cts.debug.print("v={} w={w}", cts.device_put(np.float32([1, 2])), w=3)
    seen = []
    cts.debug.callback(lambda a, b=None: seen.append((type(a).__name__, b)),
                       cts.device_put(np.float32([1])), b="k")
    assert capsys.readouterr().out == "v=[1. 2.] w=3\n"
    assert seen == [("ndarray", "k")]
    with pytest.raises(TypeError, match="format must be a string"):
        cts.debug.print(3)
    with cts.named_scope("block"), cts.disable_jit(), cts.ensure_compile_time_eval():
        y = cnp.sum(cts.device_put(np.float32([1, 2])))
    assert float(y) == 3.0

    @cts.named_scope("f")
    def f(v):
        return v + 1
    assert f(1) == 2


def test_review_fixes_argnums_dtypes_and_keyword_only():
    a, b = np.float32([1, 2]), np.float32([3, 4])
    # a negative argnums counts from the end, as jax's
    np.testing.assert_array_equal(np.asarray(cts.jacrev(lambda u, v: u * v, argnums=-1)(a, b)),
                                  np.diag(a))
    # an empty output's Jacobian has the input's dtype (a cotangent's), as the non-empty one
    j = cts.jacrev(lambda x: cnp.astype(x, cnp.float32)[:0])(np.float16([1, 2]))
    assert j.dtype == np.float16 and j.shape == (0, 2)
    # cotangents must have the outputs' dtypes (jax raises too); Python scalars are weak
    _, f_vjp = cts.vjp(lambda x: x * 2, a)
    with pytest.raises(ValueError, match="float16 cotangent for a float32 output"):
        f_vjp(np.float16([1, 1]))
    _, s_vjp = cts.vjp(lambda x: cnp.sum(x), a)
    np.testing.assert_array_equal(np.asarray(s_vjp(2.0)[0]), [2.0, 2.0])
    # keyword-only arguments cannot be made positional: jax's TypeError
    def kwo(x, *, scale):
        return x * scale
    f = cts.custom_vjp(kwo)
    f.defvjp(lambda x, scale: (x * scale, scale), lambda s, g: (g * s,))
    with pytest.raises(TypeError, match="keyword-only arguments \\['scale'\\]"):
        f(a, scale=2.0)
