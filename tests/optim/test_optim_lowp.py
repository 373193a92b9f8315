"""16-bit float params, grads and optimizer state in the fused optimizers.

The fused kernel computes in float32; it loads bfloat16 / float16 params, grads and state
in their own dtype, and what the step writes is rounded once to the array's own dtype.
Checked here:

* exactly: a 16-bit step gives the bits of the float32 step on the converted inputs,
  rounded to each array's dtype (every optimizer case of tests/optim_cases.py, bfloat16 and
  float16, in place through TrainState and functionally through tx.update);
* against optax on bfloat16 params (live jax): state dtypes equal, and params within 2
  bfloat16 ulps after 4 steps (optax rounds each bfloat16 operation; XLA may keep excess
  precision; ctrainstate rounds once);
* optax's ``mu_dtype`` / ``accumulator_dtype``: float32 params with 16-bit moments;
* meshes: the same bits on (8,) and (2, 4) as on one device; errors.
"""
import numpy as np
import ml_dtypes
import pytest

import ctrainstate as cts
import ctrainstate.optim as optim
from ctrainstate.train_state import TrainState
from ctrainstate.tree_util import tree_flatten_with_path, tree_leaves, tree_map, keystr

import optim_cases as oc

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
LOWP = {"bfloat16": BF16, "float16": F16}

# Cases whose 16-bit run is not "the float32 run, rounded": noise is sampled in the updates'
# dtype (jax draws bfloat16 normals from 16-bit bits), and the unfused MultiSteps adds in
# Python ops (rounded per op); both are compared with optax below instead.
_NOT_WIDENED = {"noisy_sgd", "noisy_sgd_momentum", "multisteps_skip_not_finite"}
# optax casts injected hyperparameters to the params' dtype (with bfloat16 params adam's
# b2 = 0.999 becomes 1.0 and the step is NaN); ctrainstate keeps them float32, so these
# are compared with optax's hyperparam_dtype=float32 (test_inject_hyperparams_float32).
_INJECT = {"inject_adamw_schedule", "inject_static_sgd"}


def _is_float_leaf(x):
    return hasattr(x, "dtype") and np.dtype(x.dtype) in (np.dtype(np.float32), BF16, F16)


def _host(tree):
    """Every Array / array leaf as a host numpy array (other leaves as they are)."""
    return tree_map(lambda x: np.asarray(x) if hasattr(x, "dtype") else x, tree)


def _widened(tree):
    """The float leaves of a state tree converted to float32 (a copy placed like the leaf)."""
    return tree_map(lambda x: x.astype(np.float32) if _is_float_leaf(x) and
                    np.dtype(x.dtype) != np.float32 else x, tree)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)


def _assert_same_bits(got, want, what):
    gl = tree_flatten_with_path(got)[0]
    wl = tree_flatten_with_path(want)[0]
    assert [k for k, _ in gl] == [k for k, _ in wl], what
    for (k, g), (_, w) in zip(gl, wl):
        if not hasattr(w, "dtype"):
            continue
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype, f"{what}{keystr(k)}: dtype {g.dtype}, expected {w.dtype}"
        if g.dtype.kind == "f":
            same = (_bits(g) == _bits(w)) | (np.isnan(g.astype(np.float32)) &
                                             np.isnan(w.astype(np.float32)))
            assert same.all(), (f"{what}{keystr(k)}: {int((~same).sum())} of {g.size} "
                                f"elements differ, e.g. {g.ravel()[~same.ravel()][:4]} vs "
                                f"{w.ravel()[~same.ravel()][:4]}")
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"{what}{keystr(k)}")


def _round_like(tree32, like):
    """tree32's float leaves rounded to the dtype of the matching leaf of ``like``."""
    return tree_map(lambda a, b: np.asarray(a).astype(np.asarray(b).dtype)
                    if hasattr(b, "dtype") else a, tree32, like)


def _grads(i, gk, dtype):
    return tree_map(lambda x: x.astype(dtype), oc.grads_for(i, **gk))


@pytest.mark.parametrize("dtype", sorted(LOWP))
@pytest.mark.parametrize("name", sorted(set(oc.CASES) - _NOT_WIDENED))
def test_step_is_the_float32_step_rounded_once(name, dtype):
    """In place (TrainState) and functional (tx.update): each of 3 steps on 16-bit params,
    grads and state gives exactly the float32 step on their float32 values, rounded once."""
    dt = LOWP[dtype]
    make, gk = oc.CASES[name]
    tx = make(optim)
    p16 = tree_map(lambda x: cts.device_put(x.astype(dt)), oc.init_params())
    ts = TrainState.create(apply_fn=None, params=p16, tx=tx)
    p_f = tree_map(lambda x: cts.device_put(x.astype(dt)), oc.init_params())  # not donated
    st_f = tx.init(p_f)
    for i in range(3):
        g16 = tree_map(cts.device_put, _grads(i, gk, dt))
        # the float32 reference, from the same 16-bit inputs as the in-place step
        p_in, st_in = _host(ts.params), _host(ts.opt_state)
        u32, st32 = tx.update(tree_map(lambda g: g.astype(np.float32), g16),
                              _widened(ts.opt_state), _widened(ts.params))
        want_p = tree_map(lambda p, u: (np.asarray(p, np.float32) + np.asarray(u)).astype(dt),
                          p_in, _host(u32))
        want_st = _round_like(_host(st32), st_in)
        ts = ts.apply_gradients(grads=g16)
        _assert_same_bits(ts.params, want_p, f"{name} step {i} params")
        _assert_same_bits(_host(ts.opt_state), want_st, f"{name} step {i} state")
        # functional: the updates are the float32 updates rounded to the grads' dtype
        u32f, st32f = tx.update(tree_map(lambda g: g.astype(np.float32), g16),
                                _widened(st_f), _widened(p_f))
        want_u = tree_map(lambda u: np.asarray(u).astype(dt), _host(u32f))
        want_stf = _round_like(_host(st32f), _host(st_f))
        u16, st_f = tx.update(g16, st_f, p_f)
        _assert_same_bits(u16, want_u, f"{name} step {i} updates")
        _assert_same_bits(_host(st_f), want_stf, f"{name} step {i} functional state")
        p_f = optim.apply_updates(p_f, u16)


def _ulps_bf16(a, b):
    """|a - b| in bfloat16 ulps of max(|a|, |b|, 0.5) (values near 0 measured at 0.5)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    m = np.maximum(np.maximum(np.abs(a), np.abs(b)), 0.5)
    return np.abs(a - b) / 2.0 ** (np.floor(np.log2(m)) - 7)


def _run_optax_bf16(make, gk, steps, **kw):
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    tx = make(optax, **kw) if kw else make(optax)
    params = jax.tree.map(lambda x: jnp.asarray(x.astype(BF16)), oc.init_params())
    state = tx.init(params)
    # (optax's noise keys are typed; ctrainstate keeps raw uint32[2] keys, jax's legacy layout)
    dtypes = [str(x.dtype).replace("key<fry>", "uint32") for x in jax.tree.leaves(state)]

    @jax.jit
    def step(params, state, grads):
        u, state = tx.update(grads, state, params)
        return optax.apply_updates(params, u), state

    for i in range(steps):
        params, state = step(params, state,
                             jax.tree.map(jnp.asarray, _grads(i, gk, BF16)))
    return oc.flat(jax.tree.map(lambda x: np.asarray(x, np.float32), params)), dtypes


def _run_ours_bf16(tx, gk, steps):
    params = tree_map(lambda x: cts.device_put(x.astype(BF16)), oc.init_params())
    state = tx.init(params)
    dtypes = [str(x.dtype) for x in tree_leaves(state) if hasattr(x, "dtype")]
    for i in range(steps):
        u, state = tx.update(tree_map(cts.device_put, _grads(i, gk, BF16)), state, params)
        params = optim.apply_updates(params, u)
    return oc.flat(tree_map(lambda x: np.asarray(x).astype(np.float32), params)), dtypes


@pytest.mark.parametrize("name", sorted(set(oc.CASES) - _INJECT))
def test_bfloat16_params_match_optax(name, jax_ref):
    make, gk = oc.CASES[name]
    ref, ref_dt = jax_ref("optax", lambda jax: _run_optax_bf16(make, gk, 4))
    ours, our_dt = _run_ours_bf16(make(optim), gk, 4)
    assert our_dt == ref_dt, f"{name}: state dtypes {our_dt} vs optax {ref_dt}"
    assert np.isfinite(ref).all() and np.isfinite(ours).all()
    worst = _ulps_bf16(ours, ref).max()
    assert worst <= 2.0, f"{name}: {worst} bfloat16 ulps from optax"


@pytest.mark.parametrize("name", sorted(_INJECT))
def test_inject_hyperparams_float32(name, jax_ref):
    """ctrainstate keeps injected hyperparameters in float32 with bfloat16 params, as optax
    does when asked with hyperparam_dtype=float32."""
    make, gk = oc.CASES[name]

    def theirs(jax):
        def make_f32(o):
            orig = o.inject_hyperparams

            class _O:
                def __getattr__(self, a):
                    if a == "inject_hyperparams":
                        return lambda f, **k: orig(f, hyperparam_dtype=jax.numpy.float32, **k)
                    return getattr(o, a)
            return make(_O())
        return _run_optax_bf16(make_f32, gk, 4)

    ref, ref_dt = jax_ref("optax", theirs)
    ours, our_dt = _run_ours_bf16(make(optim), gk, 4)
    assert our_dt == ref_dt
    assert _ulps_bf16(ours, ref).max() <= 2.0


# optax's 16-bit moments with float32 params: (name, make(lib, dtype), params atol)
_STATE_DTYPE_CASES = {
    "adam_mu": lambda o, d: o.adam(1e-2, mu_dtype=d),
    "adamw_mu_nesterov": lambda o, d: o.adamw(1e-2, mu_dtype=d, weight_decay=0.1, nesterov=True),
    "amsgrad_mu": lambda o, d: o.amsgrad(1e-2, mu_dtype=d),
    "lion_mu": lambda o, d: o.lion(1e-3, mu_dtype=d),
    "sgd_momentum_acc": lambda o, d: o.sgd(0.05, momentum=0.9, accumulator_dtype=d),
    "clip_adam_mu": lambda o, d: o.chain(o.clip_by_global_norm(4.0), o.adam(1e-2, mu_dtype=d)),
    "multisteps_acc": lambda o, d: o.MultiSteps(o.adam(1e-2), 2,
                                                accumulator_dtype=d).gradient_transformation(),
}


@pytest.mark.parametrize("dtype", sorted(LOWP))
@pytest.mark.parametrize("name", sorted(_STATE_DTYPE_CASES))
def test_16bit_state_with_float32_params(name, dtype, jax_ref):
    """float32 params with a 16-bit first moment / trace / accumulator (optax's mu_dtype,
    accumulator_dtype): the state dtypes are optax's, and each step is optax's float32 step
    with those moments rounded to their dtype when stored (20 steps).

    optax itself differs a little: it multiplies the stored 16-bit moment by its decay in the
    moment's dtype (jax's weak-type promotion turns b1 = 0.9 into bfloat16 0.8984375), where
    the kernel keeps the float32 constants."""
    dt = LOWP[dtype]
    tx = _STATE_DTYPE_CASES[name](optim, dt)
    ts = TrainState.create(apply_fn=None, params=cts.device_put(oc.init_params()), tx=tx)
    our_dt = [str(x.dtype) for x in tree_leaves(ts.opt_state) if hasattr(x, "dtype")]
    low = [d == str(dt) for d in our_dt]

    def theirs(jax):
        jnp = jax.numpy
        optax = pytest.importorskip("optax")
        jdt = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}[dtype]
        params = jax.tree.map(jnp.asarray, oc.init_params())
        ref_dt = [str(x.dtype) for x in
                  jax.tree.leaves(_STATE_DTYPE_CASES[name](optax, jdt).init(params))]
        txo = _STATE_DTYPE_CASES[name](optax, None)   # float32 state, rounded below
        sto = txo.init(params)

        @jax.jit
        def step(params, state, grads):
            u, state = txo.update(grads, state, params)
            leaves, td = jax.tree.flatten(state)
            leaves = [x.astype(jdt).astype(x.dtype) if lo else x for x, lo in zip(leaves, low)]
            return optax.apply_updates(params, u), jax.tree.unflatten(td, leaves)

        for i in range(20):
            params, sto = step(params, sto, jax.tree.map(jnp.asarray, oc.grads_for(i)))
        return {"dtypes": ref_dt, "params": oc.flat(jax.tree.map(np.asarray, params)),
                "state": jax.tree.leaves(sto)}

    want = jax_ref("optax", theirs)
    assert our_dt == want["dtypes"]
    assert str(dt) in our_dt
    for i in range(20):
        ts = ts.apply_gradients(grads=oc.grads_for(i))
    ref = want["params"]
    np.testing.assert_allclose(oc.flat(_host(ts.params)), ref, rtol=1e-5,
                               atol=1e-5 * np.abs(ref).max())
    # the 16-bit moments: within 2 ulps of their format at the leaf's largest magnitude. A
    # float32 difference of 1e-7 (XLA contracts FMAs) can round one element the other way
    # across a tie; the moment then carries that absolute difference on (decaying by b per
    # step) while its own value may shrink, so it is measured at the leaf's scale.
    ours = [x for x in tree_leaves(ts.opt_state) if hasattr(x, "dtype")]
    for a, b, lo in zip(ours, want["state"], low):
        if lo:
            a32, b32 = np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32)
            ulp = float(np.spacing(np.abs(b32).max().astype(dt)))
            d = np.abs(a32 - b32)
            assert d.max() <= 2 * ulp, (d.max(), ulp)
            assert (d > 0).mean() <= 0.05   # a few ties, not a different computation


def _mesh_place(tree, mesh_kind):
    if mesh_kind == "single":
        return tree_map(cts.device_put, tree)
    P = cts.P
    if mesh_kind == "8":
        mesh = cts.make_mesh((8,), ("x",))
        specs = {"a": P("x"), "b": P("x"), "c": {"d": P(None, "x"), "e": P()}}
    else:
        mesh = cts.make_mesh((2, 4), ("i", "j"))
        specs = {"a": P("i", "j"), "b": P("j"), "c": {"d": P("i", "j"), "e": P()}}
    return tree_map(lambda x, s: cts.device_put(x, cts.NamedSharding(mesh, s)), tree, specs,
                    is_leaf=lambda x: isinstance(x, cts.PartitionSpec))


@pytest.mark.parametrize("name", ["adamw", "adafactor_momentum_wd", "clip_by_global_norm_adam",
                                  "lamb", "apply_if_finite_adam"])
def test_bfloat16_same_bits_on_every_mesh(name):
    make, gk = oc.CASES[name]
    out = {}
    for mesh_kind in ("single", "8", "2x4"):
        params = _mesh_place(tree_map(lambda x: x.astype(BF16), oc.init_params()), mesh_kind)
        ts = TrainState.create(apply_fn=None, params=params, tx=make(optim))
        for i in range(4):
            ts = ts.apply_gradients(grads=_grads(i, gk, BF16))
        assert tree_leaves(ts.params)[0].dtype == BF16
        out[mesh_kind] = (_host(ts.params), _host(ts.opt_state))
    _assert_same_bits(out["8"], out["single"], f"{name} mesh (8,)")
    _assert_same_bits(out["2x4"], out["single"], f"{name} mesh (2,4)")


def test_eval_shape_of_init_keeps_16bit_dtypes():
    params = {"w": cts.ShapeDtypeStruct((4, 8), BF16), "b": cts.ShapeDtypeStruct((8,), F16)}
    st = cts.eval_shape(optim.adam(1e-3, mu_dtype=np.float32).init, params)
    dts = {keystr(k): np.dtype(v.dtype) for k, v in tree_flatten_with_path(st)[0]}
    assert dts["[0].mu['w']"] == np.float32 and dts["[0].nu['w']"] == BF16
    assert dts["[0].nu['b']"] == F16 and dts["[0].count"] == np.int32


def test_errors():
    with pytest.raises(ValueError, match="mu_dtype=.*int32.*float32, bfloat16 or float16"):
        optim.adam(1e-3, mu_dtype=np.int32)
    with pytest.raises(ValueError, match="accumulator_dtype"):
        optim.sgd(0.1, momentum=0.9, accumulator_dtype="int8")
    with pytest.raises(ValueError, match="accumulator_dtype"):
        optim.MultiSteps(optim.sgd(0.1), 2, accumulator_dtype=np.int32)
    params = {"n": cts.device_put(np.arange(4, dtype=np.int32))}
    ts = TrainState.create(apply_fn=None, params=params, tx=optim.sgd(0.1))
    with pytest.raises(TypeError, match=r"params\['n'\] is int32: optimizers update float"):
        ts.apply_gradients(grads={"n": np.ones(4, np.int32)})
    p = {"w": cts.device_put(np.ones(4, BF16))}
    ts = TrainState.create(apply_fn=None, params=p, tx=optim.adam(0.1))
    with pytest.raises(TypeError, match=r"grads\['w'\] has dtype int32.*float32, bfloat16"):
        ts.apply_gradients(grads={"w": np.ones(4, np.int32)})
    # nothing was written: the state is as created
    assert np.asarray(ts.params["w"]).astype(np.float32).tolist() == [1.0] * 4
    assert int(ts.step) == 0


@pytest.mark.parametrize("pdt,gdt", [(BF16, np.float32), (np.float32, BF16), (BF16, F16)])
def test_grads_of_another_float_dtype(pdt, gdt):
    """Grads need not have the params' dtype: the step converts them to float32. The
    functional updates are float32 when the dtypes differ (optax's promotion), and the
    in-place step gives the same params as tx.update + apply_updates computed in float32."""
    p0 = oc.init_params()
    tx = optim.sgd(0.1, momentum=0.9)
    params = tree_map(lambda x: cts.device_put(x.astype(pdt)), p0)
    g = tree_map(lambda x: x.astype(gdt), oc.grads_for(0))
    u, _ = tx.update(tree_map(cts.device_put, g), tx.init(params), params)
    assert {np.dtype(x.dtype) for x in tree_leaves(u)} == {np.dtype(np.float32)}
    want_u = tree_map(lambda x: -0.1 * x.astype(np.float32), g)   # first momentum step
    for a, b in zip(tree_leaves(_host(u)), tree_leaves(want_u)):
        np.testing.assert_array_equal(a, b)
    ts = TrainState.create(apply_fn=None, params=params, tx=tx).apply_gradients(grads=g)
    want_p = tree_map(lambda p, d: (p.astype(pdt).astype(np.float32) + d).astype(pdt), p0,
                      want_u)
    _assert_same_bits(ts.params, want_p, "params")
