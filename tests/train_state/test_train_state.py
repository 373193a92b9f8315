"""TrainState (flax semantics, table 3.6) and the in-place fused step: donation, errors, leaks."""
import dataclasses
import threading
import time
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.optim as optim
from ctrainstate.train_state import TrainState, field

from conftest import bytes_in_use
from ctrainstate import serialization


def _params():
    return {"w": np.ones((4, 3), np.float32), "b": np.zeros(3, np.float32)}


def _grads(v=1.0):
    return {"w": np.full((4, 3), v, np.float32), "b": np.full(3, v, np.float32)}


def test_create_T1():
    tx = optim.adam(1e-3)
    f = lambda x: x  # noqa: E731
    p = cts.device_put(_params())
    s = TrainState.create(apply_fn=f, params=p, tx=tx)
    assert s.step == 0 and isinstance(s.step, int)
    assert s.apply_fn is f and s.tx is tx and s.params is p
    assert cts.tree_util.tree_structure(s.opt_state) == cts.tree_util.tree_structure(tx.init(p))
    assert type(s.opt_state[0]).__name__ == "ScaleByAdamState"


def test_apply_gradients_T2_and_kwargs():
    class TS(TrainState):
        extra: Any = None
    s = TS.create(apply_fn=None, params=_params(), tx=optim.sgd(0.5), extra=1)
    s2 = s.apply_gradients(grads=_grads(), extra=2)
    assert s2.step == 1 and s2.extra == 2
    np.testing.assert_array_equal(np.asarray(s2.params["w"]), np.full((4, 3), 0.5, np.float32))


def test_subclass_dropout_rng_and_replace_T3():
    class TS(TrainState):
        dropout_rng: Any
        batch_stats: Any = field(pytree_node=True, default=None)
    s = TS.create(apply_fn=None, params=_params(), tx=optim.adamw(1e-2), dropout_rng=np.uint32(7),
                  batch_stats={"m": 0})
    losses = []
    for i in range(10):
        w = np.asarray(s.params["w"])
        losses.append(float((w ** 2).sum()))
        s = s.apply_gradients(grads={"w": 2 * w, "b": np.zeros(3, np.float32)})
        s = s.replace(batch_stats={"m": i})
    assert all(b < a for a, b in zip(losses, losses[1:]))
    assert s.batch_stats == {"m": 9} and s.dropout_rng == 7


def test_frozen_T7():
    s = TrainState.create(apply_fn=None, params=_params(), tx=optim.sgd(0.1))
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'step'"):
        s.step = 1


def test_leaves_order_T9():
    class TS(TrainState):
        rng: Any
    s = TS.create(apply_fn=len, params=_params(), tx=optim.adam(1e-3), rng=5)
    leaves = cts.tree_util.tree_leaves(s)
    assert leaves[0] == 0 and leaves[-1] == 5
    assert len(leaves) == 1 + 2 + (1 + 2 + 2) + 1   # step, params, adam(count, mu, nu), rng


def test_overwrite_with_gradient_T8():
    params = {"params": _params(), "_overwrite_with_gradient": {"s": np.zeros(2, np.float32)}}
    s = TrainState.create(apply_fn=None, params=params, tx=optim.sgd(1.0))
    owg = {"s": np.full(2, 3.0, np.float32)}
    s2 = s.apply_gradients(grads={"params": _grads(), "_overwrite_with_gradient": owg})
    assert s2.params["_overwrite_with_gradient"] is owg
    np.testing.assert_array_equal(np.asarray(s2.params["params"]["b"]), -np.ones(3, np.float32))


def test_python_int_params_T5():
    s = TrainState.create(apply_fn=lambda x: x, params={"a": 1, "b": (2, 3), "c": [4, 5]},
                          tx=optim.adam(1e-3))
    assert s.step == 0


def test_old_state_is_donated():
    s = TrainState.create(apply_fn=None, params=_params(), tx=optim.adamw(1e-2))
    s2 = s.apply_gradients(grads=_grads())
    with pytest.raises(cts.DonatedBufferError, match="donated"):
        np.asarray(s.params["w"])
    with pytest.raises(cts.DonatedBufferError, match="donated"):
        np.asarray(s.opt_state[0].mu["b"])
    with pytest.raises(cts.DonatedBufferError):
        s.apply_gradients(grads=_grads())
    np.asarray(s2.params["w"])  # the new state owns the buffers


def test_in_place_no_new_buffers(mem_baseline):
    s = TrainState.create(apply_fn=None, params=_params(), tx=optim.adamw(1e-2))
    g = cts.device_put(_grads())
    before = bytes_in_use()
    w_buf = s.params["w"]._blocks[0][1]
    s = s.apply_gradients(grads=g)
    assert s.params["w"]._blocks[0][1] is w_buf
    assert bytes_in_use() == before


def test_functional_update_keeps_state_valid():
    tx = optim.adam(1e-2)
    p = cts.device_put(_params())
    st = tx.init(p)
    u, st2 = tx.update(_grads(), st, p)
    assert int(np.asarray(st[0].count)) == 0 and int(np.asarray(st2[0].count)) == 1
    np.testing.assert_array_equal(np.asarray(st[0].mu["w"]), 0)
    assert np.asarray(st2[0].mu["w"]).max() > 0
    np.asarray(p["w"])  # not donated


@pytest.mark.parametrize("bad, match, exc", [
    ({"w": np.ones((4, 3), np.float32)}, r"first difference at \['b'\]|\['b'\]", ValueError),
    ({"w": np.ones((4, 2), np.float32), "b": np.ones(3, np.float32)}, r"grads\['w'\] has shape", ValueError),
    ({"w": np.ones((4, 3), np.int32), "b": np.ones(3, np.float32)}, r"grads\['w'\] has dtype int32", TypeError),
    ({"w": np.ones((4, 3), np.float32), "c": np.ones(3, np.float32)}, r"\['b'\]|\['c'\]", ValueError),
])
def test_grads_mismatch_names_path(bad, match, exc):
    s = TrainState.create(apply_fn=None, params=_params(), tx=optim.adam(1e-3))
    with pytest.raises(exc, match=match):
        s.apply_gradients(grads=bad)
    s.apply_gradients(grads=_grads())  # failed call left the state usable


def test_opt_state_sharded_like_params_and_counters_replicated():
    mesh = cts.make_mesh((2, 4), ("i", "j"))
    p = {"w": cts.device_put(np.ones((8, 4), np.float32), cts.NamedSharding(mesh, cts.P("i", "j")))}
    s = TrainState.create(apply_fn=None, params=p, tx=optim.adamw(1e-3))
    assert s.opt_state[0].mu["w"].sharding == p["w"].sharding
    assert s.opt_state[0].nu["w"].sharding == p["w"].sharding
    assert s.opt_state[0].count.sharding == cts.NamedSharding(mesh, cts.P())
    # grads given as Arrays with another sharding are resharded
    g = {"w": cts.device_put(np.ones((8, 4), np.float32), cts.NamedSharding(mesh, cts.P()))}
    s2 = s.apply_gradients(grads=g)
    assert s2.params["w"].sharding == p["w"].sharding


def test_global_norm_counts_replicas_once():
    """Fully replicated over 8 devices vs one device: the same clipped step."""
    mesh = cts.make_mesh((8,), ("x",))
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(1.0))
    g = {"w": np.full(4, 3.0, np.float32)}  # norm 6 -> scaled by 1/6
    res = []
    for sh in (None, cts.NamedSharding(mesh, cts.P()), cts.NamedSharding(mesh, cts.P("x"))):
        p = {"w": cts.device_put(np.zeros(8, np.float32)[:4].copy() if sh is None or
                                 sh.spec == cts.P() else np.zeros(8, np.float32)[:4], sh)} \
            if sh is None or sh.spec == cts.P() else None
        if p is None:
            p = {"w": cts.device_put(np.zeros(8, np.float32), sh)}
            gg = {"w": np.full(8, 3.0, np.float32) / np.sqrt(2)}  # same norm 6
        else:
            gg = g
        s = TrainState.create(apply_fn=None, params=p, tx=tx).apply_gradients(grads=gg)
        w = np.asarray(s.params["w"])
        res.append(np.linalg.norm(w))
    np.testing.assert_allclose(res, [1.0, 1.0, 1.0], rtol=1e-6)


def test_non_fusable_tx_falls_back():
    # a user transform with only init/update (no fuse) makes the chain non-fusable
    half = optim.GradientTransformation(
        lambda params: optim.EmptyState(),
        lambda u, s, p=None: (cts.tree_util.tree_map(lambda x: np.asarray(x) * np.float32(0.5), u), s))
    s = TrainState.create(apply_fn=None, params=_params(), tx=optim.chain(half, optim.sgd(1.0)))
    assert not s.tx.fusable
    s2 = s.apply_gradients(grads=_grads())
    np.asarray(s.params["w"])  # not donated on the fallback path
    assert s2.step == 1
    np.testing.assert_array_equal(np.asarray(s2.params["w"]), np.full((4, 3), 0.5, np.float32))


def test_adafactor_is_fused_and_donates():
    s = TrainState.create(apply_fn=None, params=_params(), tx=optim.adafactor(1e-2))
    assert s.tx.fusable
    s2 = s.apply_gradients(grads=_grads())
    assert s2.step == 1
    with pytest.raises(cts.DonatedBufferError):
        np.asarray(s.params["w"])


def test_gil_released_during_step():
    """Another Python thread makes progress while a large step runs."""
    n = 1 << 22
    s = TrainState.create(apply_fn=None, params={"w": np.zeros(n, np.float32)}, tx=optim.adamw(1e-3))
    g = cts.device_put({"w": np.ones(n, np.float32)})
    ticks = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(1)
    t = threading.Thread(target=spin)
    t.start()
    try:
        for _ in range(5):
            s = s.apply_gradients(grads=g)
    finally:
        stop.set()
        t.join()
    assert len(ticks) > 0


def test_no_leak_10000_steps(mem_baseline):
    # 1,000 steps on the host emulation of the CUDA backend's sources (tools/cuda_emu.sh, which
    # runs this file on 8 emulated GPU devices), where a step costs ~5 ms instead of ~0.3 ms;
    # the checks are exact: one buffer leaked by any step fails them
    import os
    steps = 1_000 if os.environ.get("CTRAINSTATE_CUDA_BACKEND") else 10_000
    s = TrainState.create(apply_fn=None, params=_params(), tx=optim.chain(
        optim.clip_by_global_norm(1.0), optim.adamw(optim.warmup_cosine_decay_schedule(0, 1e-3, 10, 100))))
    g = cts.device_put(_grads(0.1))
    s = s.apply_gradients(grads=g)
    after_first = bytes_in_use()
    for _ in range(steps):
        s = s.apply_gradients(grads=g)
    import gc
    gc.collect()
    assert bytes_in_use() == after_first
    assert s.step == steps + 1
    del s, g
    gc.collect()
    assert bytes_in_use() == mem_baseline


def _reference_chains():
    from ctrainstate.optim import base
    adam = (0.9, 0.999, 1e-8, 1e-9, 0.1, 0.001)
    return {
        "elementwise": [(base.ADAM, adam + (0.0, 0.19)),
                        (base.DECAY, (0.01,)), (base.TRACE, (0.5, 1.0)),
                        (base.RMS, (0.9, 1e-8, 0.0, 1.0)), (base.RSS, (1e-7,)),
                        (base.LION, (0.9, 0.99)), (base.EMA, (0.9, 0.5)),
                        (base.CLIP, (0.7,)), (base.SCALE, (-0.1,))],
        # adabelief / yogi / radam's moment-only adam (mode 2, and 3 with nesterov)
        "belief_yogi_radam": [(base.BELIEF, adam + (1.0, 0.19)), (base.YOGI, adam + (0.0, 0.0)),
                              (base.ADAM, adam + (2.0, 0.19)), (base.ADAM, adam + (3.0, 0.19)),
                              (base.STDDEV, (0.9, 1e-8, 1.0, 0.5)),
                              (base.STDDEV, (0.8, 1e-3, 0.0, 1.0)),
                              (base.ADAMAX, (0.9, 0.99, 1e-3, 0.0, 0.19, 1.0, 0.0, 1.0)),
                              (base.DECAY, (0.01,)), (base.SCALE, (-0.1,))],
        "accum": [(base.AMSGRAD, (0.9, 0.99, 1e-8, 1e-9, 0.19, 0.02, 0.0, 1.0)),
                  (base.ACCUM, (3.0, 0.0, 0.0)), (base.DECAY, (0.01,)),
                  (base.ACCUM, (2.0, 1.0, 0.0)), (base.ACCUM, (1.0, 1.0, 1.0)),
                  (base.ADAM, adam + (0.0, 0.19)), (base.SCALE, (-0.1,))],
        "zero": [(base.ADAM, adam + (0.0, 0.19)), (base.ZERO, ()), (base.DECAY, (0.01,)),
                 (base.LION, (0.9, 0.99)), (base.SCALE, (-0.1,))],
    }


@pytest.mark.parametrize("chain", ["elementwise", "belief_yogi_radam", "accum", "zero"])
def test_fused_kernel_matches_scalar_reference(chain):
    """The chunked OpenMP driver against the plain one-element-at-a-time C reference."""
    from ctrainstate import _C
    from ctrainstate.optim import base
    rng = np.random.default_rng(0)
    n = 3 * 2048 + 77
    stages = _reference_chains()[chain]
    nslots = sum(base.NSLOTS[k] for k, _ in stages)

    def bufs():
        out = []
        for _ in range(2 + nslots):
            b = _C.Buffer(0, (n,), 0)
            np.frombuffer(b, np.float32)[:] = rng.standard_normal(n).astype(np.float32) ** 2
            out.append(b)
        return out
    a = bufs()
    b = []
    for x in a:
        y = _C.Buffer(0, (n,), 0)
        np.frombuffer(y, np.float32)[:] = np.frombuffer(x, np.float32)
        b.append(y)
    bits = (1 << len(stages)) - 1 - (1 << 4)   # stage 4 off for this leaf
    _C.optim_step(stages, [[(a[0], a[1], None, a[2:], bits, 0, True)]], 1)
    _C.optim_reference(stages, (b[0], b[1], None, b[2:], bits, 0, True))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.frombuffer(x, np.float32), np.frombuffer(y, np.float32))


def test_step_rejects_bad_blocks():
    from ctrainstate import _C
    from ctrainstate.optim import base
    g = _C.Buffer(0, (4,), 0)
    p = _C.Buffer(0, (5,), 0)
    with pytest.raises(ValueError, match="elements"):
        _C.optim_step([(base.SCALE, (1.0,))], [[(p, g, None, [], 1, 0, True)]], 1)
    with pytest.raises(ValueError, match="unknown kind"):
        _C.optim_step([(99, ())], [[(g, g, None, [], 1, 0, True)]], 1)
    with pytest.raises(ValueError, match="no state array"):
        _C.optim_step([(base.ADAM, ())], [[(g, g, None, [None, None], 1, 0, True)]], 1)
    i = _C.Buffer(0, (4,), 3)
    with pytest.raises(TypeError, match="float32"):
        _C.optim_step([(base.SCALE, (1.0,))], [[(i, g, None, [], 1, 0, True)]], 1)


def test_step_rejects_bad_state_sizes_and_factored_geometry():
    from ctrainstate import _C
    from ctrainstate.optim import base
    g = _C.Buffer(0, (8,), 0)
    short = _C.Buffer(0, (4,), 0)
    adam = [(base.ADAM, (0.9, 0.999, 1e-8, 0.0, 0.1, 0.001, 0.0, 0.19))]
    with pytest.raises(ValueError, match="4 elements, expected 8"):
        _C.optim_step(adam, [[(g, g, None, [short, g], 1, 0, True)]], 1)
    with pytest.raises(ValueError, match="not of 8 elements"):
        _C.optim_reference(adam, (g, g, None, [short, g], 1, 0, True))
    # a (4, 2) leaf factored over d0=0, d1=1: v_row has 2 elements, v_col 4
    fac = [(base.FACTORED, (0.5, 1e-30))]
    one = _C.Buffer(0, (1,), 0)
    vr, vc = _C.Buffer(0, (2,), 0), _C.Buffer(0, (4,), 0)
    geom = (0, 1, (4, 2), (0, 0), (4, 2))
    _C.optim_step(fac, [[(g, g, None, [vr, vc, one], 1, 0, True, geom)]], 1)
    with pytest.raises(ValueError, match="v_row/v_col"):
        _C.optim_step(fac, [[(g, g, None, [vc, vr, one], 1, 0, True, geom)]], 1)
    with pytest.raises(ValueError, match="outside"):
        _C.optim_step(fac, [[(g, g, None, [vr, vc, one], 1, 0, True, (0, 1, (4, 2), (2, 0), (4, 2)))]], 1)
    with pytest.raises(ValueError, match="factored dims"):
        _C.optim_step(fac, [[(g, g, None, [vr, vc, one], 1, 0, True, (0, 0, (4, 2), (0, 0), (4, 2)))]], 1)
    with pytest.raises(ValueError, match="state v"):   # not factored: v must be full size
        _C.optim_step(fac, [[(g, g, None, [one, one, one], 1, 0, True)]], 1)


def test_eval_shape_step_is_a_0d_struct_with_spec_P():
    """jax traces TrainState.create's ``step=0``: under eval_shape it is a 0-d int32
    struct and Flax's get_partition_spec gives it P(); Python scalars of any output
    likewise (int -> int32, float -> float32, bool -> bool)."""
    import ctrainstate.nn as cnn
    from ctrainstate import random as cr

    def create(key):
        v = cnn.Dense(4).init(key, np.ones((2, 3), np.float32))
        return TrainState.create(apply_fn=None, params=v["params"], tx=optim.adam(1e-3))

    ab = cts.eval_shape(create, cr.PRNGKey(0))
    assert isinstance(ab.step, cts.ShapeDtypeStruct)
    assert (ab.step.shape, ab.step.dtype) == ((), np.dtype(np.int32))
    assert cnn.get_partition_spec(ab).step == cts.sharding.PartitionSpec()
    out = cts.eval_shape(lambda: {"a": 1, "b": 2.0, "c": False, "s": "name"})
    assert [(out[k].shape, out[k].dtype) for k in "abc"] == [
        ((), np.dtype(np.int32)), ((), np.dtype(np.float32)), ((), np.dtype(np.bool_))]
    assert out["s"] == "name"  # not a number: left alone


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
@pytest.mark.parametrize("where", ["params", "state"])
def test_shared_buffer_is_refused_before_any_update(where, dtype):
    # an in-place step writes each buffer once: one Array in two places would be updated
    # twice (and one result lost). Refused before the kernel; nothing donated or changed.
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    w = cts.device_put(np.ones((4, 3), dt))
    tx = optim.adam(0.1)
    if where == "params":
        s = TrainState.create(apply_fn=None, params={"a": w, "b": w}, tx=tx)
        match = r"params\['a'\] and params\['b'\] share a buffer"
    else:
        s = TrainState.create(apply_fn=None, params={"a": w}, tx=tx)
        adam = s.opt_state[0]
        s = s.replace(opt_state=(adam._replace(mu={"a": w}),) + tuple(s.opt_state[1:]))
        match = r"params\['a'\] and an optimizer-state array of params\['a'\] share a buffer"
    g = {k: np.ones((4, 3), dt) for k in s.params}
    with pytest.raises(ValueError, match=match):
        s.apply_gradients(grads=g)
    np.testing.assert_array_equal(np.asarray(w).astype(np.float32), 1.0)
    for leaf in cts.tree_util.tree_leaves((s.params, s.opt_state)):
        if isinstance(leaf, cts.Array):
            assert not leaf.is_deleted()
    nu = s.opt_state[0].nu["a"]
    np.testing.assert_array_equal(np.asarray(nu).astype(np.float32), 0.0)


def test_deleted_buffer_in_a_reused_plan_raises_before_any_update():
    # after the first step the kernel's block list is reused (TrainState._ct_plan); a buffer
    # deleted since must still be refused before the kernel, leaving the state usable
    tx = optim.adamw(1e-2)
    s = TrainState.create(apply_fn=None, params=_params(), tx=tx)
    g = cts.device_put(_grads())
    s = s.apply_gradients(grads=g)
    s = s.apply_gradients(grads=g)
    w_before = np.asarray(s.params["w"]).copy()
    mu_before = np.asarray(s.opt_state[0].mu["w"]).copy()
    s.opt_state[0].nu["b"].delete()
    with pytest.raises(cts.DonatedBufferError):
        s.apply_gradients(grads=g)
    np.testing.assert_array_equal(np.asarray(s.params["w"]), w_before)
    np.testing.assert_array_equal(np.asarray(s.opt_state[0].mu["w"]), mu_before)
    assert not s.params["w"].is_deleted()


def test_moved_all_refuses_before_moving_any():
    a, b = cts.device_put(np.ones(3, np.float32)), cts.device_put(np.zeros(3, np.float32))
    b._moved()   # b is now donated
    with pytest.raises(cts.DonatedBufferError):
        cts.Array._moved_all([a, b])
    assert not a.is_deleted()   # a was not moved
    new = cts.Array._moved_all([a])
    np.testing.assert_array_equal(np.asarray(new[0]), 1.0)
    with pytest.raises(cts.DonatedBufferError):
        np.asarray(a)


def test_moved_all_copies_every_slot_and_donates_only_after():
    """Array._moved_all's C loop (_C.move_arrays): each new Array has its old one's shape,
    dtype, sharding, shard shape, host scalar and the very same block list; it is live, not a
    view, and weak-referenceable; the old ones are donated; a view in the list (a GPU
    Shard.data, here faked with _base) is refused with nothing moved; a non-Array is a
    TypeError with nothing moved."""
    import gc
    import weakref
    mesh = cts.Mesh(np.array(cts.devices()[:4]).reshape(2, 2), ("x", "y"))
    sh = cts.NamedSharding(mesh, cts.PartitionSpec("x", None))
    a = cts.device_put(np.arange(12, dtype=np.float32).reshape(4, 3), sh)
    c = cts.device_put(np.float32(2.5))
    c._host_scalar = 2.5
    olds = [a, c]
    blocks = [x._blocks for x in olds]
    new = cts.Array._moved_all(olds)
    assert [type(x) for x in new] == [cts.Array, cts.Array]
    for o, n, bl in zip(olds, new, blocks):
        assert o.is_deleted() and not n.is_deleted()
        assert n._blocks is bl
        assert (n.shape, n.dtype, n.sharding, n._shard_shape) == (o._shape, o._dtype, o._sharding,
                                                                    o._shard_shape)
        assert n._base is None and n._donated is False
        with pytest.raises(cts.DonatedBufferError):
            np.asarray(o)
    assert new[1]._host_scalar == 2.5 and new[0]._host_scalar is None
    np.testing.assert_array_equal(np.asarray(new[0]), np.arange(12, dtype=np.float32).reshape(4, 3))
    r = weakref.ref(new[0])
    assert r() is new[0]
    # a view anywhere in the list: refused, nothing moved
    live = cts.device_put(np.ones(2, np.float32))
    view = cts.device_put(np.zeros(2, np.float32))
    view._base = live
    with pytest.raises(ValueError, match="view"):
        cts.Array._moved_all([live, view])
    assert not live.is_deleted() and not view._donated
    # not an Array: a TypeError, nothing moved
    with pytest.raises(TypeError, match="not an Array"):
        cts.Array._moved_all([live, np.ones(2)])
    assert not live.is_deleted()
    # the moved Arrays are freed like any other (no reference leaked by the C loop)
    moved = cts.Array._moved_all([live])
    r2 = weakref.ref(moved[0])
    del moved, live
    gc.collect()
    assert r2() is None


def test_state_sharded_unlike_resharded_params_is_refused_and_nothing_changes():
    """Params resharded after the state was made, with shards of the same size on the same
    devices (P('data', 'model') -> P('model', 'data')): pairing the blocks by position would
    update each mu/nu block with another block's gradient. The step refuses before the kernel
    (the state is intact), and once the state is put on the params' shardings the step is
    Adam's."""
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    g = np.arange(64, dtype=np.float32).reshape(8, 8)
    p0 = cts.device_put(np.zeros((8, 8), np.float32),
                        cts.NamedSharding(mesh, cts.P("data", "model")))
    s = TrainState.create(apply_fn=None, params={"w": p0}, tx=optim.adam(0.1))
    resharded = cts.NamedSharding(mesh, cts.P("model", "data"))
    s = s.replace(params={"w": cts.device_put(s.params["w"], resharded)})
    with pytest.raises(ValueError, match=r"optimizer state of params\['w'\] is not sharded like"):
        s.apply_gradients(grads={"w": g})
    np.testing.assert_array_equal(np.asarray(s.params["w"]), 0.0)
    np.testing.assert_array_equal(np.asarray(s.opt_state[0].mu["w"]), 0.0)
    assert int(s.step) == 0
    st = cts.tree_util.tree_map(lambda fresh, old: cts.device_put(old, fresh.sharding),
                                s.tx.init(s.params), s.opt_state)   # the error's remedy
    s = s.replace(opt_state=st).apply_gradients(grads={"w": g})
    np.testing.assert_allclose(np.asarray(s.opt_state[0].mu["w"]), 0.1 * g, rtol=1e-6)
    one_minus_b2 = np.float32(1.0) - np.float32(0.999)   # optax's (1 - b2), in float32
    np.testing.assert_allclose(np.asarray(s.opt_state[0].nu["w"]), one_minus_b2 * g * g,
                               rtol=1e-6)
    # Adam's first step: -lr * sign(g) (g / |g|, up to eps), 0 where g == 0
    want = -0.1 * g / (np.abs(g) + 1e-8)
    np.testing.assert_allclose(np.asarray(s.params["w"]), want, rtol=1e-5, atol=1e-6)


def test_apply_gradients_with_a_bad_keyword_changes_nothing():
    """flax's apply_gradients(grads=..., **kwargs) replaces fields after the step; here the
    step runs in place, so a keyword that is not a field (or is one the step sets) must be
    refused before it: the state stays readable and usable."""
    p = {"w": np.ones(4, np.float32)}
    s = TrainState.create(apply_fn=None, params=p, tx=optim.adam(0.1))
    g = {"w": np.ones(4, np.float32)}
    with pytest.raises(TypeError, match=r"\['bogus'\] that are not fields of TrainState"):
        s.apply_gradients(grads=g, bogus=1)
    with pytest.raises(TypeError, match=r"sets \['params'\] itself"):
        s.apply_gradients(grads=g, params=p)
    np.testing.assert_array_equal(np.asarray(s.params["w"]), 1.0)
    assert int(s.step) == 0
    s2 = s.apply_gradients(grads=g)
    np.testing.assert_allclose(np.asarray(s2.params["w"]), 0.9, rtol=1e-6)


def test_apply_gradients_replaces_subclass_fields():
    class State(TrainState):
        batch_stats: Any = None

    s = State.create(apply_fn=None, params={"w": np.ones(2, np.float32)}, tx=optim.sgd(0.5),
                     batch_stats={"m": 0})
    s = s.apply_gradients(grads={"w": np.ones(2, np.float32)}, batch_stats={"m": 1})
    assert s.batch_stats == {"m": 1} and int(s.step) == 1
    np.testing.assert_allclose(np.asarray(s.params["w"]), 0.5)


def test_factored_state_of_resharded_params_is_refused_and_the_remedy_works():
    """adafactor's v_row / v_col are the param less one dim: after a reshard with shards of
    the same sizes their blocks were paired with the wrong rows (silently wrong steps)."""
    mesh = cts.make_mesh((2, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal((8, 8)).astype(np.float32)
    gs = [rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3)]
    tx = optim.adafactor(0.1, min_dim_size_to_factor=2)

    def run(spec1, spec2):
        s = TrainState.create(apply_fn=None, tx=tx, params={
            "w": cts.device_put(p0, cts.NamedSharding(mesh, spec1))})
        s = s.apply_gradients(grads={"w": gs[0]})
        s = s.replace(params={"w": cts.device_put(s.params["w"],
                                                  cts.NamedSharding(mesh, spec2))})
        if spec1 != spec2:
            with pytest.raises(ValueError, match=r"params\['w'\] is not sharded like the param"):
                s.apply_gradients(grads={"w": gs[1]})
            s = s.replace(opt_state=cts.tree_util.tree_map(
                lambda fresh, old: cts.device_put(old, fresh.sharding), tx.init(s.params),
                s.opt_state))
        for g in gs[1:]:
            s = s.apply_gradients(grads={"w": g})
        return np.asarray(s.params["w"])
    ref = run(cts.P(), cts.P())
    np.testing.assert_array_equal(run(cts.P("data", "model"), cts.P("model", "data")), ref)


def test_create_does_not_donate_the_callers_params():
    """Eager code keeps the params it passed to create (to evaluate, to build a second
    state): the first step updates a copy of them, never their buffers."""
    p = cts.device_put(_params())
    bufs = [b for x in cts.tree_util.tree_leaves(p) for _, b, _, _ in x._blocks]
    s = TrainState.create(apply_fn=None, params=p, tx=optim.adam(0.1))
    s1 = s.apply_gradients(grads=_grads())
    s2 = s1.apply_gradients(grads=_grads())
    np.testing.assert_array_equal(np.asarray(p["w"]), 1.0)      # readable and unchanged
    np.testing.assert_array_equal(np.asarray(p["b"]), 0.0)
    assert all(not b.is_deleted for b in bufs)
    np.testing.assert_allclose(np.asarray(s2.params["w"]), 0.8, rtol=1e-5)
    assert int(s2.step) == 2
    with pytest.raises(cts.DonatedBufferError):   # the state's own Arrays are donated
        np.asarray(s1.params["w"])
    with pytest.raises(cts.DonatedBufferError):
        np.asarray(s.opt_state[0].mu["w"])
    # the caller's params still make a fresh state, stepped like the first
    t = TrainState.create(apply_fn=None, params=p, tx=optim.adam(0.1)).apply_gradients(
        grads=_grads())
    np.testing.assert_allclose(np.asarray(t.params["w"]), 0.9, rtol=1e-5)


def test_create_of_tied_caller_params_still_refuses_the_shared_buffer():
    w = cts.device_put(np.ones(3, np.float32))
    s = TrainState.create(apply_fn=None, params={"a": w, "b": w}, tx=optim.sgd(0.1))
    with pytest.raises(ValueError, match="share a buffer"):
        s.apply_gradients(grads={"a": np.ones(3, np.float32), "b": np.ones(3, np.float32)})
    np.testing.assert_array_equal(np.asarray(w), 1.0)


def _sigint_at(monkeypatch, where):
    """Deliver SIGINT (as Ctrl-C would) from inside the step: 'fuse' while the optimizer's
    stages are prepared (before the kernel), 'kernel' right after the kernel wrote the
    buffers, before the step is committed."""
    import signal
    from ctrainstate._src.optim import base
    real = base._C.optim_step

    def kernel(*args):
        out = real(*args)
        if where == "kernel":
            signal.raise_signal(signal.SIGINT)
        return out
    monkeypatch.setattr(base._C, "optim_step", kernel)
    if where == "fuse":
        tx = optim.adam(0.1)
        inner = tx._fuse
        once = [True]

        def fuse(state, ctx):
            if once.pop() if once else False:
                signal.raise_signal(signal.SIGINT)
            return inner(state, ctx)
        object.__setattr__(tx, "_fuse", fuse)
        return tx
    return optim.adam(0.1)


@pytest.mark.parametrize("where", ["fuse", "kernel"])
def test_ctrl_c_during_apply_gradients_leaves_the_old_or_the_whole_new_state(monkeypatch,
                                                                              where):
    tx = _sigint_at(monkeypatch, where)
    s = TrainState.create(apply_fn=None, params=_params(), tx=tx)
    with pytest.raises(KeyboardInterrupt):
        s.apply_gradients(grads=_grads())
    monkeypatch.undo()
    w, count = np.asarray(s.params["w"]), int(np.asarray(s.opt_state[0].count))
    mu = np.asarray(s.opt_state[0].mu["w"])
    if where == "fuse":   # before the kernel: the old state, usable, nothing applied
        assert int(s.step) == 0 and count == 0
        np.testing.assert_array_equal(w, 1.0)
        np.testing.assert_array_equal(mu, 0.0)
    else:                 # after it: the whole step, committed (counts and all)
        assert int(s.step) == 1 and count == 1
        np.testing.assert_allclose(w, 0.9, rtol=1e-5)
        np.testing.assert_allclose(mu, 0.1, rtol=1e-6)
    # a retry applies exactly one more step
    step = int(s.step)
    s2 = s.apply_gradients(grads=_grads())
    assert int(s2.step) == step + 1 == int(np.asarray(s2.opt_state[0].count))
    np.testing.assert_allclose(np.asarray(s2.params["w"]), 1.0 - 0.1 * int(s2.step), rtol=1e-5)


def test_ctrl_c_from_a_timer_never_half_applies_a_step():
    """SIGINT from another thread at arbitrary times during a loop of large steps: after
    each KeyboardInterrupt the state reachable by the loop is whole (params, moments and
    counts agree with its step) and usable."""
    import os
    import signal
    n = 1 << 20
    s = TrainState.create(apply_fn=None, params={"w": np.zeros(n, np.float32)},
                          tx=optim.sgd(1.0, momentum=0.0))
    g = cts.device_put({"w": np.ones(n, np.float32)})
    rng = np.random.default_rng(0)
    interrupts = 0
    for _ in range(12):
        timer = threading.Timer(rng.uniform(0.0, 0.01), os.kill, (os.getpid(), signal.SIGINT))
        deadline = time.monotonic() + 60
        try:
            timer.start()
            # until the timer's SIGINT (a lost one fails the test instead of looping forever)
            while time.monotonic() < deadline:
                s = s.apply_gradients(grads=g)
                # (as a loop reading its loss does: on (emulated) GPU devices a step returns
                # once its kernels are queued, and a queue of thousands would run at the read)
                s.params["w"].block_until_ready()
        except KeyboardInterrupt:
            interrupts += 1
        else:
            pytest.fail(f"no KeyboardInterrupt within 60 s of the timer's SIGINT (the SIGINT "
                        f"handler now: {signal.getsignal(signal.SIGINT)!r})")
        timer.join()
        w = np.asarray(s.params["w"])
        np.testing.assert_array_equal(w, -float(s.step))
        # (the timer may fire before the first step of the run: the state is then the first)
        np.testing.assert_array_equal(np.asarray(s.opt_state[0].trace["w"]),
                                      1.0 if s.step else 0.0)
    assert interrupts == 12


def test_interrupt_guard_arms_only_in_the_main_thread():
    """The guard that holds Ctrl-C back during an in-place step swaps the SIGINT handler in
    the main thread only (other threads receive no signals, and may not set handlers): armed
    in a worker thread it changes nothing and its release is a no-op."""
    import signal
    from ctrainstate._src.train_state.train_state import _DeferInterrupt
    before = signal.getsignal(signal.SIGINT)
    seen = []

    def worker():
        g = _DeferInterrupt()
        g.arm()
        seen.append((g._armed, signal.getsignal(signal.SIGINT)))
        g.release()
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [(False, before)]
    g = _DeferInterrupt()
    g.arm()
    try:
        assert g._armed and signal.getsignal(signal.SIGINT) == g._record
    finally:
        g.release()
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("borrowed", [False, True])
def test_apply_gradients_from_two_threads_applies_once(borrowed):
    """Two threads step the same state at once: exactly one wins, the other gets a
    DonatedBufferError, and the update is applied once."""
    n = 1 << 18
    for _ in range(25):
        p = {"w": np.zeros(n, np.float32)}
        s = TrainState.create(apply_fn=None, params=cts.device_put(p) if borrowed else p,
                              tx=optim.adam(1.0))
        g = cts.device_put({"w": np.ones(n, np.float32)})
        barrier = threading.Barrier(2)
        won, lost = [], []

        def step():
            barrier.wait()
            try:
                won.append(s.apply_gradients(grads=g))
            except cts.DonatedBufferError as e:
                lost.append(e)
        ts = [threading.Thread(target=step) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert len(won) == 1 and len(lost) == 1
        (new,) = won
        assert int(new.step) == 1 and int(np.asarray(new.opt_state[0].count)) == 1
        np.testing.assert_allclose(np.asarray(new.opt_state[0].mu["w"]), 0.1, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(new.params["w"]), -1.0, rtol=1e-5)


def test_state_made_on_host_params_stepped_with_sharded_params_is_a_clear_error():
    """An optimizer state built on single-device params, stepped with params sharded over 8
    devices (and the other way round): a ValueError naming the leaf and both shardings,
    before anything is written (the state stays usable once put on the params' layout)."""
    mesh = cts.make_mesh((8,), ("x",))
    sharded = cts.NamedSharding(mesh, cts.P("x"))
    g = {"w": np.ones((8, 4), np.float32)}
    for tx in (optim.adam(0.1), optim.adafactor(0.1, min_dim_size_to_factor=2)):
        host_state = tx.init(cts.device_put({"w": np.ones((8, 4), np.float32)}))
        ps = {"w": cts.device_put(np.ones((8, 4), np.float32), sharded)}
        s = TrainState(step=0, apply_fn=None, params=ps, tx=tx, opt_state=host_state)
        match = (r"optimizer state of params\['w'\] is not sharded like the param \(state "
                 r"SingleDeviceSharding.*param NamedSharding")
        with pytest.raises(ValueError, match=match):
            s.apply_gradients(grads=g)
        with pytest.raises(ValueError, match=match):
            tx.update(g, host_state, ps)
        np.testing.assert_array_equal(np.asarray(s.params["w"]), 1.0)
        st = cts.tree_util.tree_map(lambda fresh, old: cts.device_put(old, fresh.sharding),
                                    tx.init(ps), host_state)
        s.replace(opt_state=st).apply_gradients(grads=g)
    tx = optim.adam(0.1)
    sharded_state = tx.init({"w": cts.device_put(np.ones((8, 4), np.float32), sharded)})
    with pytest.raises(ValueError, match=r"\(state NamedSharding.*param SingleDeviceSharding"):
        tx.update(g, sharded_state, cts.device_put({"w": np.ones((8, 4), np.float32)}))


# --- a checkpoint of another optimizer's state

def test_train_state_checkpoint_of_another_optimizer_names_the_path():
    pytest.importorskip("msgpack")
    from ctrainstate import optim
    from ctrainstate.train_state import TrainState
    p = {"dense": {"kernel": np.ones((2, 3), np.float32), "bias": np.zeros(3, np.float32)}}
    adam = TrainState.create(apply_fn=None, params=p, tx=optim.adam(1e-3))
    chain = TrainState.create(apply_fn=None, params=p, tx=optim.chain(
        optim.clip_by_global_norm(1.0), optim.adam(1e-3)))
    # adam's state {'0': {count, mu, nu}, '1': {}} read into chain's (EmptyState, (adam, ...)):
    # EmptyState took the adam fields silently before
    with pytest.raises(ValueError, match=r"\['count', 'mu', 'nu'\].*EmptyState.*at opt_state/0"):
        serialization.from_bytes(chain, serialization.to_bytes(adam))
    assert np.asarray(chain.opt_state[1][0].mu["dense"]["kernel"]).sum() == 0   # untouched
