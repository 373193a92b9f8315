"""Fused adafactor: factored statistics sharded like the params (v_row without d0, v_col
without d1), sums across the devices of a sharded factored dim counting each global element
once, in place and donating; parity with optax (live) on meshes that shard d0, d1, both, a
middle dim, and replicate."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.optim as optim
from ctrainstate.train_state import TrainState

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
