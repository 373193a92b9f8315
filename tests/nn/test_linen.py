"""flax.linen names added to ctrainstate.nn: Einsum, PReLU, soft_sign / normalize, WeightNorm,
SpectralNorm, map_variables, the lifted vjp / grad / value_and_grad, cond / switch /
while_loop, jit, share_scope, the function forms of init / apply, and the re-exports.

Each behaviour is checked from its definition (numpy), and against flax (`jax_ref`: recorded in
tests/data/recorded/test_linen.npz, live in the `parity` twins): the same key gives the same
variables, and outputs, gradients and updated collections agree. The flax side is jitted (one
XLA program per model) to keep compile time small."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import nn, random


def _flat(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, prefix + (k,)))
        else:
            out["/".join(prefix + (k,))] = np.asarray(v)
    return out


def _same(a, b, tol=0.0, what=""):
    fa, fb = _flat(dict(a)), _flat(_unfreeze(b))
    assert sorted(fa) == sorted(fb), what
    for k in fb:
        np.testing.assert_allclose(fa[k], fb[k], rtol=tol, atol=tol, err_msg=f"{what} {k}")


def _unfreeze(t):
    if hasattr(t, "items"):
        return {k: _unfreeze(v) for k, v in t.items()}
    return t


X = np.random.RandomState(0).randn(2, 3).astype(np.float32)
KEY = random.PRNGKey(5)


# --- Einsum ------------------------------------------------------------------------------------

EINSUMS = [((5, 6, 7), "abc,cde->abde"), ((5, 6), "...c,cd->...d"), ((4, 6), "abc,bd->adc")]


def test_einsum_from_definition():
    x = np.random.RandomState(1).randn(3, 4, 5).astype(np.float32)
    for shape, eq in EINSUMS:
        m = nn.Einsum(shape, eq, bias_init=nn.initializers.normal(1.0))
        v = m.init(KEY, x)
        k, b = np.asarray(v["params"]["kernel"]), np.asarray(v["params"]["bias"])
        assert k.shape == shape
        out = eq.split("->")[1]
        rhs = eq.split("->")[0].split(",")[1]
        want_b = tuple(shape[rhs.index(c)] for c in out if c in rhs)
        assert b.shape == want_b, eq
        bcast = [shape[rhs.index(c)] if c in rhs else 1 for c in out.replace("...", "ab")]
        want = np.einsum(eq, x, k) + b.reshape(bcast)
        np.testing.assert_allclose(np.asarray(m.apply(v, x)), want, rtol=1e-5, atol=1e-5,
                                   err_msg=eq)
    # einsum_str at call time; no bias
    v = nn.Einsum((5, 2), use_bias=False).init(KEY, x, "abc,cd->abd")
    assert sorted(v["params"]) == ["kernel"]
    with pytest.raises(ValueError, match="explicit"):
        nn.Einsum((5, 2), "abc,cd").init(KEY, x)
    with pytest.raises(ValueError, match="exactly two operands"):
        nn.Einsum((5, 2), "abc,cd,de->abe").init(KEY, x)
    with pytest.raises(ValueError, match="just once"):
        nn.Einsum((5, 2), "abc,cd->abd").init(KEY, x, "abc,cd->abd")


def test_einsum_matches_flax(jax_ref):
    x = np.random.RandomState(1).randn(3, 4, 5).astype(np.float32)
    for shape, eq in EINSUMS:
        init = nn.initializers.normal(1.0)
        v = nn.Einsum(shape, eq, bias_init=init).init(KEY, x)

        def flax_side(jnp, fnn):
            fm = fnn.Einsum(shape, eq, bias_init=fnn.initializers.normal(1.0))
            fv = fm.init(jnp.asarray(KEY), x)
            return {"vars": _unfreeze(fv), "out": fm.apply(fv, x)}

        want = jax_ref(f"{shape} {eq}", flax_side)
        _same(v, want["vars"], 0.0, eq)
        np.testing.assert_allclose(np.asarray(nn.Einsum(shape, eq).apply(v, x)),
                                   want["out"], rtol=1e-5, atol=1e-5)


# --- PReLU, soft_sign, normalize --------------------------------------------------------------

def test_prelu_soft_sign_normalize():
    x = np.array([[-2.0, -0.5, 0.0, 3.0]], np.float32)
    v = nn.PReLU(negative_slope_init=0.25).init(KEY, x)
    assert np.asarray(v["params"]["negative_slope"]).shape == ()
    np.testing.assert_allclose(np.asarray(nn.PReLU().apply(v, x)), np.where(x >= 0, x, 0.25 * x))
    g = cts.grad(lambda p: cnp.sum(nn.PReLU().apply({"params": p}, x)))(v["params"])
    np.testing.assert_allclose(float(np.asarray(g["negative_slope"])), -2.5)   # sum of x < 0
    np.testing.assert_allclose(np.asarray(nn.soft_sign(x)), x / (np.abs(x) + 1), rtol=1e-6)
    assert nn.normalize is nn.standardize


def test_prelu_matches_flax(jax_ref):
    def flax_side(jnp, fnn):
        fv = fnn.PReLU(negative_slope_init=0.3).init(jnp.asarray(KEY), X)
        return {"vars": _unfreeze(fv), "out": fnn.PReLU().apply(fv, X)}

    want = jax_ref("flax", flax_side)
    v = nn.PReLU(negative_slope_init=0.3).init(KEY, X)
    _same(v, want["vars"])
    np.testing.assert_allclose(np.asarray(nn.PReLU().apply(v, X)), want["out"], rtol=1e-6)


# --- WeightNorm / SpectralNorm --------------------------------------------------------------------

def _wrapped(n, kind, **kw):
    class Foo(n.Module):
        @n.compact
        def __call__(self, x, train=True):
            x = n.Dense(3)(x)
            if kind == "weight":
                x = n.WeightNorm(n.Dense(4), **kw)(x)
            else:
                x = n.SpectralNorm(n.Dense(4), **kw)(x, update_stats=train)
            return n.Dense(2)(x)
    return Foo()


def test_weight_norm_from_definition():
    m = _wrapped(nn, "weight")
    v = m.init(KEY, X)
    p = v["params"]
    assert sorted(p) == ["Dense_0", "Dense_1", "Dense_2", "WeightNorm_0"]
    assert sorted(p["WeightNorm_0"]) == ["Dense_1/kernel/scale"]
    # as Flax's map_variables(init=True): the normalized kernel (scale ones) is what init stores
    np.testing.assert_allclose(np.linalg.norm(np.asarray(p["Dense_1"]["kernel"]), axis=0),
                               np.ones(4), rtol=1e-5)
    # kernel = g * v / ||v|| (norm over the input axis), from arbitrary params
    rs = np.random.RandomState(2)
    vk = rs.randn(3, 4).astype(np.float32)
    g = rs.rand(4).astype(np.float32) + 0.5
    p = {**p, "Dense_1": {**p["Dense_1"], "kernel": vk},
         "WeightNorm_0": {"Dense_1/kernel/scale": g}}
    h = X @ np.asarray(p["Dense_0"]["kernel"]) + np.asarray(p["Dense_0"]["bias"])
    h = h @ (g * vk / np.linalg.norm(vk, axis=0)) + np.asarray(p["Dense_1"]["bias"])
    want = h @ np.asarray(p["Dense_2"]["kernel"]) + np.asarray(p["Dense_2"]["bias"])
    np.testing.assert_allclose(np.asarray(m.apply({"params": p}, X)), want, rtol=1e-5, atol=1e-5)
    # variable_filter: the bias too
    v = _wrapped(nn, "weight", variable_filter={"kernel", "bias"}).init(KEY, X)
    assert sorted(v["params"]["WeightNorm_0"]) == ["Dense_1/bias/scale", "Dense_1/kernel/scale"]


def test_spectral_norm_sigma_is_the_largest_singular_value():
    m = _wrapped(nn, "spectral", n_steps=60)
    v = m.init(KEY, X)
    bs = v["batch_stats"]["SpectralNorm_0"]
    assert sorted(bs) == ["Dense_1/kernel/sigma", "Dense_1/kernel/u"]
    assert np.asarray(bs["Dense_1/kernel/u"]).shape == (1, 4)
    w = np.random.RandomState(3).randn(3, 4).astype(np.float32)
    p = {**v["params"], "Dense_1": {**v["params"]["Dense_1"], "kernel": w}}
    y, upd = m.apply({**v, "params": p}, X, mutable=["batch_stats"])
    sigma = float(np.asarray(upd["batch_stats"]["SpectralNorm_0"]["Dense_1/kernel/sigma"]))
    s_max = np.linalg.svd(w, compute_uv=False)[0]
    np.testing.assert_allclose(sigma, s_max, rtol=1e-4)
    h = X @ np.asarray(p["Dense_0"]["kernel"]) + np.asarray(p["Dense_0"]["bias"])
    h = h @ (w / s_max) + np.asarray(p["Dense_1"]["bias"])
    want = h @ np.asarray(p["Dense_2"]["kernel"]) + np.asarray(p["Dense_2"]["bias"])
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-5)
    # update_stats=False leaves the statistics alone
    _, upd = m.apply({**v, "params": p}, X, False, mutable=["batch_stats"])
    _same(upd["batch_stats"], v["batch_stats"])


@pytest.mark.parametrize("kind,kw", [("weight", {}), ("spectral", {"n_steps": 3})])
def test_weight_and_spectral_norm_match_flax(kind, kw, jax_ref):
    def flax_side(jax, jnp, fnn):
        fm = _wrapped(fnn, kind, **kw)
        fv = jax.jit(fm.init)(jnp.asarray(KEY), X)

        def fl_loss(p, other):
            y, upd = fm.apply({**other, "params": p}, X, mutable=["batch_stats"])
            return jnp.sum(y * y), (y, upd)
        other = {k: t for k, t in fv.items() if k != "params"}
        (_, (fy, fupd)), fg = jax.jit(jax.value_and_grad(fl_loss, has_aux=True))(
            fv["params"], other)
        return _unfreeze({"vars": fv, "y": fy, "upd": fupd, "grad": fg})

    want = jax_ref("flax", flax_side)
    v = _wrapped(nn, kind, **kw).init(KEY, X)
    _same(v, want["vars"], 1e-6, "init")
    y, upd = _wrapped(nn, kind, **kw).apply(v, X, mutable=True)
    np.testing.assert_allclose(np.asarray(y), want["y"], rtol=1e-5, atol=1e-5)
    if kind == "spectral":
        _same(upd["batch_stats"], want["upd"]["batch_stats"], 1e-5, "batch_stats")
    rest = {k: t for k, t in v.items() if k != "params"}
    g = cts.grad(lambda p: cnp.sum(cnp.square(_wrapped(nn, kind, **kw).apply(
        {**rest, "params": p}, X, mutable=["batch_stats"])[0])))(v["params"])
    _same(g, want["grad"], 1e-5, "grad")


def test_map_variables_masks_and_keeps_mutable_rules():
    upper = np.triu(np.ones((3, 3), np.float32))

    class Causal(nn.Module):
        def setup(self):
            mask = lambda vs: {"params": {**vs["params"],  # noqa: E731
                                          "kernel": cnp.multiply(vs["params"]["kernel"], upper)}}
            self.dense = nn.map_variables(nn.Dense, "params", mask,
                                          init=self.is_initializing())(3, use_bias=False)

        def __call__(self, x):
            return self.dense(x)

    assert nn.map_variables(nn.Dense).__name__ == "Map_variablesDense"
    v = Causal().init(KEY, X)
    k = np.asarray(v["params"]["dense"]["kernel"])
    np.testing.assert_array_equal(k, k * upper)
    full = {"params": {"dense": {"kernel": np.ones((3, 3), np.float32)}}}
    np.testing.assert_allclose(np.asarray(Causal().apply(full, X)), X @ upper, rtol=1e-6)


# --- lifted autodiff --------------------------------------------------------------------------------

def _autodiff_model(n, ones):
    class Foo(n.Module):
        @n.compact
        def __call__(self, x):
            d = n.Dense(2)
            y, bwd = n.vjp(lambda mdl, x: mdl(x) * 2.0, d, x)
            pg, xg = bwd(ones((2, 2)))
            g = n.grad(lambda mdl, x: (mdl(x) ** 2).sum(), d, x)
            (val, aux), g2 = n.value_and_grad(lambda mdl, x: ((mdl(x) ** 2).sum(), 7), d, x,
                                              has_aux=True)
            return {"y": y, "pg": pg, "xg": xg, "g": g[0], "val": val, "g2": g2[0], "aux": aux,
                    "n": len(g)}
    return Foo()


def test_lifted_autodiff_equals_cts_grad():
    m = _autodiff_model(nn, lambda s: np.ones(s, np.float32))
    v = m.init(KEY, X)
    out = m.apply(v, X)
    p = v["params"]["Dense_0"]
    f = lambda p, x: cnp.add(cnp.matmul(x, p["kernel"]), p["bias"])  # noqa: E731
    np.testing.assert_allclose(np.asarray(out["y"]), 2 * np.asarray(f(p, X)), rtol=1e-6)
    want_p = cts.grad(lambda p: cnp.sum(f(p, X) * 2.0))(p)
    _same(out["pg"]["params"], want_p, 1e-6, "vjp params")
    want_x = cts.grad(lambda x: cnp.sum(f(p, x) * 2.0))(X)
    np.testing.assert_allclose(np.asarray(out["xg"]), np.asarray(want_x), rtol=1e-6)
    gx = cts.grad(lambda x: cnp.sum(cnp.square(f(p, x))))(X)
    np.testing.assert_allclose(np.asarray(out["g"]), np.asarray(gx), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out["g2"]), np.asarray(gx), rtol=1e-6)
    assert out["aux"] == 7 and out["n"] == 1
    np.testing.assert_allclose(float(np.asarray(out["val"])),
                               float(np.sum(np.asarray(f(p, X)) ** 2)), rtol=1e-6)
    with pytest.raises(NotImplementedError, match="forward-mode"):
        class J(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.jvp(lambda m, x: m(x), nn.Dense(2), (x,), (x,), {})
        J().init(KEY, X)


def test_lifted_grad_inside_cts_grad_sees_the_module_gradient():
    # nn.vjp's parameter cotangent, used as a loss term, must not break the outer gradient
    class Foo(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.grad(lambda m, x: cnp.sum(m(x)), nn.Dense(2), x)[0]

    v = Foo().init(KEY, X)
    # the input gradient of sum(x @ k + b) is sum_j k[:, j] for every row
    k = np.asarray(v["params"]["Dense_0"]["kernel"])
    np.testing.assert_allclose(np.asarray(Foo().apply(v, X)), np.tile(k.sum(1), (2, 1)),
                               rtol=1e-6)


def test_lifted_autodiff_matches_flax(jax_ref):
    def flax_side(jax, jnp, fnn):
        fm = _autodiff_model(fnn, jnp.ones)
        fv = jax.jit(fm.init)(jnp.asarray(KEY), X)
        fout = fm.apply(fv, X)   # eager: the aux and len are Python values
        return _unfreeze({"vars": fv, "out": fout})

    want = jax_ref("flax", flax_side)
    v = _autodiff_model(nn, lambda s: np.ones(s, np.float32)).init(KEY, X)
    _same(v, want["vars"], 0.0, "init")
    out = _autodiff_model(nn, lambda s: np.ones(s, np.float32)).apply(v, X)
    fout = want["out"]
    for k in ("y", "xg", "g", "val", "g2"):
        np.testing.assert_allclose(np.asarray(out[k]), fout[k], rtol=1e-5,
                                   atol=1e-6, err_msg=k)
    _same(out["pg"], fout["pg"], 1e-5, "vjp params")
    assert out["n"] == fout["n"] and out["aux"] == fout["aux"]


# --- cond / switch / while_loop ----------------------------------------------------------------------

def _branch_model(n, zeros):
    class Foo(n.Module):
        @n.compact
        def __call__(self, x, pred, idx):
            self.variable("state", "count", zeros)

            def true_fn(m, x):
                m.variable("state", "count").value += 1
                return n.Dense(2, name="dense")(x)

            def false_fn(m, x):
                m.variable("state", "count").value += 10
                return -n.Dense(2, name="dense")(x)
            a = n.cond(pred, true_fn, false_fn, self, x)
            b = n.switch(idx, [lambda m, x: n.Dense(3, name="sw")(x),
                               lambda m, x: 2 * n.Dense(3, name="sw")(x),
                               lambda m, x: 3 * n.Dense(3, name="sw")(x)], self, x)
            return a, b
    return Foo()


def _czeros():
    return cnp.zeros(())


def test_cond_and_switch_pick_the_branch():
    m = _branch_model(nn, _czeros)
    v = m.init(KEY, X, False, 0)
    assert sorted(v["params"]) == ["dense", "sw"]          # made by every branch, as Flax
    assert float(np.asarray(v["state"]["count"])) == 10.0   # only the taken branch's write
    k = np.asarray(v["params"]["dense"]["kernel"])
    b = np.asarray(v["params"]["dense"]["bias"])
    sk = np.asarray(v["params"]["sw"]["kernel"])
    sb = np.asarray(v["params"]["sw"]["bias"])
    for pred, idx, sign, mul in ((True, 0, 1, 1), (False, 1, -1, 2), (True, 9, 1, 3),
                                 (False, -4, -1, 1)):
        (a, bb), upd = m.apply(v, X, pred, idx, mutable=["state"])
        np.testing.assert_allclose(np.asarray(a), sign * (X @ k + b), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(bb), mul * (X @ sk + sb), rtol=1e-5, atol=1e-6)
        assert float(np.asarray(upd["state"]["count"])) == 10.0 + (1 if pred else 10)
    # the gradient goes through the branch taken only
    g = cts.grad(lambda p: cnp.sum(m.apply({**v, "params": p}, X, False, 0,
                                           mutable=["state"])[0][0]))(v["params"])
    np.testing.assert_allclose(np.asarray(g["dense"]["bias"]), -2.0 * np.ones(2))

    class OneSided(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.cond(True, lambda m, x: nn.Dense(2, name="a")(x),
                           lambda m, x: nn.Dense(2, name="b")(x), self, x)
    with pytest.raises(TypeError, match="same pytree structure"):
        OneSided().init(KEY, X)


def test_cond_and_switch_match_flax(jax_ref):
    cases = ((True, 0), (False, 2), (False, 7))

    def flax_side(jax, jnp, fnn):
        fm = _branch_model(fnn, lambda: jnp.zeros(()))
        fv = jax.jit(fm.init, static_argnums=(2, 3))(jnp.asarray(KEY), X, True, 1)
        fapply = jax.jit(lambda v, x, p, i: fm.apply(v, x, p, i, mutable=["state"]))
        return _unfreeze({"vars": fv, "apply": [fapply(fv, X, pred, idx) for pred, idx in cases]})

    want = jax_ref("flax", flax_side)
    v = _branch_model(nn, _czeros).init(KEY, X, True, 1)
    _same(v, want["vars"], 0.0, "init")
    for (pred, idx), ((fa, fb), fs) in zip(cases, want["apply"]):
        (a, b), s = _branch_model(nn, _czeros).apply(v, X, pred, idx, mutable=["state"])
        np.testing.assert_allclose(np.asarray(a), fa, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(b), fb, rtol=1e-5, atol=1e-6)
        _same(s, fs, 0.0, "state")


def _loop_model(n, zeros):
    class Foo(n.Module):
        @n.compact
        def __call__(self, x):
            d = n.Dense(3, name="d")
            self.variable("state", "acc", zeros)
            x = d(x)

            def body(m, c):
                i, x = c
                m.variable("state", "acc").value += 1.0
                return i + 1, d(x)
            return n.while_loop(lambda m, c: c[0] < 3, body, self, (0, x),
                                carry_variables="state")
    return Foo()


def test_while_loop_carries_variables():
    m = _loop_model(nn, _czeros)
    v = m.init(KEY, X)
    (i, y), upd = m.apply(v, X, mutable=["state"])
    k, b = np.asarray(v["params"]["d"]["kernel"]), np.asarray(v["params"]["d"]["bias"])
    want = X
    for _ in range(4):
        want = want @ k + b
    assert int(i) == 3
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    assert float(np.asarray(upd["state"]["acc"])) == float(np.asarray(v["state"]["acc"])) + 3


def test_while_loop_matches_flax(jax_ref):
    def flax_side(jax, jnp, fnn):
        fm = _loop_model(fnn, lambda: jnp.zeros(()))
        fv = jax.jit(fm.init)(jnp.asarray(KEY), X)
        (_, fy), fs = jax.jit(lambda v, x: fm.apply(v, x, mutable=["state"]))(fv, X)
        return _unfreeze({"vars": fv, "y": fy, "state": fs})

    want = jax_ref("flax", flax_side)
    v = _loop_model(nn, _czeros).init(KEY, X)
    _same(v, want["vars"], 0.0, "init")
    (_, y), s = _loop_model(nn, _czeros).apply(v, X, mutable=["state"])
    np.testing.assert_allclose(np.asarray(y), want["y"], rtol=1e-5, atol=1e-5)
    _same(s, want["state"], 0.0, "state")


# --- jit, share_scope, function forms, exports ----------------------------------------------------

def _jit_model(n):
    class Inner(n.Module):
        @n.jit
        @n.compact
        def __call__(self, x):
            return n.Dense(2)(n.Dense(3)(x))

    class Foo(n.Module):
        @n.compact
        def __call__(self, x):
            x = n.jit(n.Dense)(3)(x)
            y = Inner()(x)
            return n.jit(lambda m, x: m(x))(n.Dense(2), y) + y
    return Foo()


def test_jit_runs_eagerly_with_flax_names_and_keys():
    v = _jit_model(nn).init(KEY, X)
    assert sorted(v["params"]) == ["Dense_0", "Inner_0", "JitDense_0"]
    # Flax forks the stream (one make_rng of the jitted module) and folds below it
    forked = nn.module.fold_in_static(KEY, ("JitDense_0", 1))
    want = nn.initializers.lecun_normal()(nn.module.fold_in_static(forked, (2,)), (3, 3))
    np.testing.assert_array_equal(np.asarray(v["params"]["JitDense_0"]["kernel"]),
                                  np.asarray(want))
    p = v["params"]
    h = X @ np.asarray(p["JitDense_0"]["kernel"]) + np.asarray(p["JitDense_0"]["bias"])
    i = p["Inner_0"]
    # Dense(2)(Dense(3)(x)): the outer Dense(2) is made first (Dense_0)
    y = (h @ np.asarray(i["Dense_1"]["kernel"]) + np.asarray(i["Dense_1"]["bias"])) \
        @ np.asarray(i["Dense_0"]["kernel"]) + np.asarray(i["Dense_0"]["bias"])
    want = y @ np.asarray(p["Dense_0"]["kernel"]) + np.asarray(p["Dense_0"]["bias"]) + y
    np.testing.assert_allclose(np.asarray(_jit_model(nn).apply(v, X)), want, rtol=1e-5,
                               atol=1e-5)


def _lora_model(n):
    class DenseLoRA(n.Module):
        base: n.Dense
        rank: int

        def setup(self):
            n.share_scope(self, self.base)

        @n.compact
        def __call__(self, x):
            din, dout = x.shape[-1], self.base.features
            a = self.param("A", n.initializers.normal(1.0), (din, self.rank))
            b = self.param("B", n.initializers.normal(1.0), (self.rank, dout))
            return self.base(x) + x @ a @ b

    class Model(n.Module):
        @n.compact
        def __call__(self, x):
            return DenseLoRA(n.Dense(4), rank=2)(x)
    return Model()


def test_share_scope_and_function_forms():
    v = _lora_model(nn).init(KEY, X)
    p = v["params"]
    assert list(p) == ["Dense_0"] and sorted(p["Dense_0"]) == ["A", "B", "bias", "kernel"]
    d = p["Dense_0"]
    want = X @ np.asarray(d["kernel"]) + np.asarray(d["bias"]) + \
        X @ np.asarray(d["A"]) @ np.asarray(d["B"])
    np.testing.assert_allclose(np.asarray(_lora_model(nn).apply(v, X)), want, rtol=1e-5,
                               atol=1e-5)
    f = lambda m, x: m(x) * 3.0  # noqa: E731
    vi = nn.init(f, nn.Dense(2))(KEY, X)
    _same(vi, nn.Dense(2).init(KEY, X))
    y, vw = nn.init_with_output(f, nn.Dense(2))(KEY, X)
    np.testing.assert_allclose(np.asarray(y), 3 * np.asarray(nn.Dense(2).apply(vi, X)),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nn.apply(f, nn.Dense(2))(vi, X)), np.asarray(y))
    # re-exports and the profiling no-ops
    assert nn.Variable is nn.scope.Variable and nn.FrozenDict is cts.core.FrozenDict
    g = lambda x: x  # noqa: E731
    assert nn.named_call(g) is g
    nn.enable_named_call()
    nn.disable_named_call()
    with nn.override_named_call(True):
        pass


def test_jit_and_share_scope_and_function_forms_match_flax(jax_ref):
    for build in (_jit_model, _lora_model):
        def flax_side(jax, jnp, fnn):
            fm = build(fnn)
            fv = jax.jit(fm.init)(jnp.asarray(KEY), X)
            return {"vars": _unfreeze(fv), "out": jax.jit(fm.apply)(fv, X)}

        want = jax_ref(build.__name__, flax_side)
        v = build(nn).init(KEY, X)
        _same(v, want["vars"], 0.0, build.__name__)
        np.testing.assert_allclose(np.asarray(build(nn).apply(v, X)), want["out"], rtol=1e-5,
                                   atol=1e-5)
    f = lambda m, x: m(x) * 3.0  # noqa: E731
    _same(nn.init(f, nn.Dense(2))(KEY, X), jax_ref(
        "init form", lambda jax, jnp, fnn: _unfreeze(jax.jit(fnn.init(f, fnn.Dense(2)))(
            jnp.asarray(KEY), X))))
