"""Fused adafactor: factored statistics sharded like the params (v_row without d0, v_col
without d1), sums across the devices of a sharded factored dim counting each global element
once, in place and donating; parity with optax (live) on meshes that shard d0, d1, both, a
middle dim, and replicate."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.optim as optim
from ctrainstate.train_state import TrainState
from ctrainstate.tree_util import tree_leaves

P = cts.P
STEPS = 6
# w: d0=0 (256), d1=1 (192); e: d0=2 (160), d1=0 (136), a middle dim; s: not factored (2 < 128)
SHAPES = {"w": (256, 192), "e": (136, 4, 160), "s": (2, 304), "b": (192,)}
MESHES = {
    "single": None,
    "8_d0": ((8,), ("x",), {"w": P("x"), "e": P(None, None, "x"), "s": P(None, "x"), "b": P("x")}),
    "8_d1": ((8,), ("x",), {"w": P(None, "x"), "e": P("x"), "s": P(), "b": P()}),
    "2x4": ((2, 4), ("i", "j"), {"w": P("i", "j"), "e": P("i", None, "j"), "s": P(None, "j"),
                                 "b": P("j")}),
    "2x4_rep": ((2, 4), ("i", "j"), {"w": P("j"), "e": P(None, "i"), "s": P(), "b": P("i")}),
}


def _params():
    rng = np.random.default_rng(5)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _grads(i):
    rng = np.random.default_rng(100 + i)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _run_ours(mesh_kind, make):
    params = _params()
    m = MESHES[mesh_kind]
    if m is None:
        params = cts.device_put(params)
    else:
        mesh = cts.make_mesh(m[0], m[1])
        params = {k: cts.device_put(v, cts.NamedSharding(mesh, m[2][k])) for k, v in params.items()}
    s = TrainState.create(apply_fn=None, params=params, tx=make(optim))
    for i in range(STEPS):
        s = s.apply_gradients(grads=_grads(i))
    return s


def _run_optax(make):
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp
    tx = make(optax)
    p = jax.tree.map(jnp.asarray, _params())
    st = tx.init(p)
    for i in range(STEPS):
        u, st = tx.update(jax.tree.map(jnp.asarray, _grads(i)), st, p)
        p = optax.apply_updates(p, u)
    return p, st


def _every13(a):
    """Every 13th element of a flattened array (what the recordings keep)."""
    return np.asarray(a).reshape(-1)[::13]


def _close(ours, ref, msg):
    ref = np.asarray(ref)
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-5,
                               atol=1e-5 * np.abs(ref).max(), err_msg=msg)


CASES = {
    "defaults": lambda o: o.adafactor(1e-2),
    "momentum_wd": lambda o: o.adafactor(1e-2, momentum=0.9, weight_decay_rate=0.01),
    "no_clip_no_scale": lambda o: o.adafactor(1e-2, clipping_threshold=None,
                                              multiply_by_parameter_scale=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mesh_kind", sorted(MESHES))
def test_adafactor_matches_optax_on_meshes(mesh_kind, case, jax_ref):
    make = CASES[case]
    s = _run_ours(mesh_kind, make)
    fs = s.opt_state[0]
    ours = {"params": s.params, "v_row": fs.v_row, "v_col": fs.v_col, "v": fs.v}

    def check(ref, sub):
        for part in ("params", "v_row", "v_col", "v"):
            for k in SHAPES:
                _close(sub(ours[part][k]), ref[part][k], f"{part}[{k}] on {mesh_kind}")

    def theirs(jax):
        ref_p, ref_st = _run_optax(make)
        return {"params": dict(ref_p), "v_row": dict(ref_st[0].v_row),
                "v_col": dict(ref_st[0].v_col), "v": dict(ref_st[0].v)}

    full = None
    if jax_ref.live:   # every element against optax itself
        full = theirs(jax_ref.jax)
        check(full, np.asarray)
    # recorded: every 13th element (optax's run is the same for every mesh)
    ref = jax_ref(case, lambda jax: {part: {k: _every13(v) for k, v in t.items()}
                                     for part, t in (full or theirs(jax)).items()}, shared=True)
    check(ref, _every13)
    assert int(np.asarray(fs.count)) == STEPS


def test_factored_state_sharded_like_params_without_the_dim():
    mesh = cts.make_mesh((2, 4), ("i", "j"))
    p = {"w": cts.device_put(np.ones((256, 192), np.float32), cts.NamedSharding(mesh, P("i", "j"))),
         "e": cts.device_put(np.ones((136, 4, 160), np.float32),
                             cts.NamedSharding(mesh, P("i", None, "j")))}
    s = TrainState.create(apply_fn=None, params=p, tx=optim.adafactor(1e-2))
    fs = s.opt_state[0]
    # w: d0 = 0 -> v_row (192,) sharded P("j"); d1 = 1 -> v_col (256,) sharded P("i")
    assert fs.v_row["w"].shape == (192,) and fs.v_row["w"].sharding == cts.NamedSharding(mesh, P("j"))
    assert fs.v_col["w"].shape == (256,) and fs.v_col["w"].sharding == cts.NamedSharding(mesh, P("i"))
    # e: d0 = 2 -> v_row (136, 4) P("i", None); d1 = 0 -> v_col (4, 160) P(None, "j")
    assert fs.v_row["e"].shape == (136, 4)
    assert fs.v_row["e"].sharding == cts.NamedSharding(mesh, P("i", None))
    assert fs.v_col["e"].shape == (4, 160)
    assert fs.v_col["e"].sharding == cts.NamedSharding(mesh, P(None, "j"))
    # each device holds only its shard of the statistics
    assert fs.v_row["w"]._shard_shape == (48,) and fs.v_col["w"]._shard_shape == (128,)
    g = {"w": np.ones((256, 192), np.float32), "e": np.ones((136, 4, 160), np.float32)}
    s2 = s.apply_gradients(grads=g)
    with pytest.raises(cts.DonatedBufferError):
        np.asarray(fs.v_row["w"])      # updated in place: the old state is donated
    assert s2.opt_state[0].v_row["w"].sharding == cts.NamedSharding(mesh, P("j"))


def test_mesh_results_identical_to_single_device():
    single = _run_ours("single", CASES["defaults"])
    for kind in ("8_d0", "2x4"):
        other = _run_ours(kind, CASES["defaults"])
        for k in SHAPES:
            np.testing.assert_allclose(np.asarray(other.params[k]), np.asarray(single.params[k]),
                                       rtol=1e-6, atol=1e-7, err_msg=f"{k} on {kind}")


# --- optax-parity regressions of adafactor (found probing ctrainstate.optim against optax 0.2.8)

@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_adafactor_non_finite_grad_matches_optax(bad, jax_ref):
    rng = np.random.default_rng(2)
    p = {"m": rng.standard_normal((4, 6)).astype(np.float32),
         "v": rng.standard_normal(5).astype(np.float32)}
    g = {"m": rng.standard_normal((4, 6)).astype(np.float32),
         "v": rng.standard_normal(5).astype(np.float32)}
    g["m"][1, 2] = bad
    g["v"][3] = bad
    for i, make in enumerate((lambda o: o.adafactor(0.1, min_dim_size_to_factor=2),  # factored "m"
                              lambda o: o.adafactor(0.1),                            # nothing factored
                              lambda o: o.chain(o.clip_by_block_rms(0.5), o.scale(-1.0)))):
        def theirs(jax):
            txo = make(__import__("optax"))
            pj = jax.tree.map(jax.numpy.asarray, p)
            return dict(txo.update(jax.tree.map(jax.numpy.asarray, g), txo.init(pj), pj)[0])

        uo = jax_ref(i, theirs)
        txc = make(optim)
        uc, _ = txc.update(g, txc.init(p), p)
        for k in p:
            np.testing.assert_allclose(np.asarray(uc[k]), np.asarray(uo[k]), rtol=1e-5,
                                       atol=1e-7, equal_nan=True, err_msg=k)


@pytest.mark.parametrize("min_dim", [4, 128])   # factored leaves, and none factored
def test_eval_shape_of_adafactor_init(min_dim):
    # jax.eval_shape(optax.adafactor(...).init, params) is how t5x / Flax scripts get the
    # optimizer state's shapes for its partition specs; scale_by_factored_rms's init called
    # to_array on the ShapeDtypeStructs and raised "dtype object is not supported". The
    # abstract state must be the concrete one's shapes, dtypes and shardings, on a mesh too.
    from ctrainstate.t5x.optimizers import OptaxWrapper
    from ctrainstate.t5x.train_state import FlaxOptimTrainState
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    sharded = {"a": cts.device_put(np.ones((8, 16), np.float32),
                                   cts.NamedSharding(mesh, cts.P("data", "model"))),
               "b": cts.device_put(np.ones(16, np.float32), cts.NamedSharding(mesh, cts.P("model")))}
    tx = optim.adafactor(0.1, min_dim_size_to_factor=min_dim, momentum=0.9)
    abstract = cts.eval_shape(tx.init, sharded)
    concrete = tx.init(sharded)
    assert [(tuple(x.shape), x.dtype, x.sharding) for x in tree_leaves(abstract)] == \
        [(tuple(x.shape), x.dtype, x.sharding) for x in tree_leaves(concrete)]
    st = cts.eval_shape(lambda: FlaxOptimTrainState.create(
        OptaxWrapper(tx), {"params": {"w": np.ones((16, 16), np.float32)}}))
    assert isinstance(st, FlaxOptimTrainState)


def _shapes(jax, leaves):
    return [[list(x.shape), str(x.dtype)] for x in leaves]


@pytest.mark.parametrize("min_dim", [4, 128])
def test_eval_shape_of_adafactor_init_matches_optax(min_dim, jax_ref):
    p = {"a": np.ones((8, 16), np.float32), "b": np.ones(16, np.float32),
         "c": np.ones((4, 6, 5), np.float32)}
    want = jax_ref("shapes", lambda jax: _shapes(jax, jax.tree.leaves(jax.eval_shape(
        __import__("optax").adafactor(0.1, min_dim_size_to_factor=min_dim).init,
        jax.tree.map(jax.numpy.asarray, p)))))
    got = cts.eval_shape(optim.adafactor(0.1, min_dim_size_to_factor=min_dim).init, p)
    assert _shapes(None, tree_leaves(got)) == want
