"""ctrainstate.checkpoint: round trips across meshes, crash safety, corruption, the manager's
policies, the flax / t5x front ends, async saves and HuggingFace pretrained loading."""
import importlib
import json
import os
import random as pyrandom
import re
import shutil
import signal
import sys
import threading
import time

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import NamedSharding, P, SingleDeviceSharding, checkpoint as ocp, optim
from ctrainstate import random as crandom
from ctrainstate._src.checkpoint import fileio as _io, processes as _procs, store as _store
from ctrainstate.train_state import TrainState
from recorded import bits_digest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example(name):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def mesh24():
    return cts.make_mesh((2, 4), ("data", "model"))


# --- the examples' states ---------------------------------------------------------------------

def siren_state():
    ex = _example("siren")
    mesh = mesh24()
    coords = np.random.default_rng(0).uniform(-1, 1, (64, 2)).astype(np.float32)
    target = np.random.default_rng(1).uniform(-1, 1, (64, 3)).astype(np.float32)
    model = ex.Siren(hidden=32, layers=3, out_features=3)
    with mesh, ex.nn_partitioning.axis_rules(ex.RULES):
        c = cts.device_put(coords, NamedSharding(mesh, P("data", None)))
        t = cts.device_put(target, NamedSharding(mesh, P("data", None)))
        variables = model.init(crandom.PRNGKey(0), c)
        state = TrainState.create(apply_fn=model.apply, params=variables["params"],
                                  tx=optim.adam(1e-3))
        grads = cts.grad(lambda p: cnp.mean(cnp.square(model.apply({"params": p}, c) - t)))(
            state.params)
        state = state.apply_gradients(grads=grads)
    return state


def flax_guide_state():
    ex = _example("flax_guide_mlp")
    mesh = mesh24()
    x = cts.device_put(np.ones((8, 32), np.float32), NamedSharding(mesh, P("data", None)))
    with mesh:
        state, _ = ex.build(mesh, ex.MLP(2, 32), x, False, ())
        state = ex.train_step(state, x)
    return state


def hf_state():
    ex = _example("hf_model_parallel")
    from ctrainstate import hf
    from ctrainstate.hf.partitions import gpt_neo_rules, set_partitions
    model = ex.GPTNeoForCausalLM(64, 16, 1, 32, 4)
    rng, drng = crandom.split(crandom.PRNGKey(0))
    params = model.init(rng, np.zeros((1, 16), np.int32))["params"]
    params = cts.tree_util.tree_map(np.asarray, params)
    spec = set_partitions(params, gpt_neo_rules())
    mesh = cts.Mesh(np.array(cts.devices()).reshape(2, 4), ("dp", "mp"))
    with mesh:
        params = cts.pjit(lambda p: p, in_axis_resources=(spec,), out_axis_resources=spec)(params)
        return hf.TrainState.create(apply_fn=model.apply, params=params,
                                    tx=optim.adamw(1e-3, weight_decay=0.01), dropout_rng=drng)


def t5x_state():
    ex = _example("t5x_partitioner")
    from ctrainstate.t5x import adafactor, partitioning, utils
    partitioner = partitioning.PjitPartitioner(
        num_partitions=4, logical_axis_rules=partitioning.standard_logical_axis_rules())
    model = ex.Encoder(64, 32, 8, 8, 64, 1, dtype=np.float32)
    opt_def = adafactor.Adafactor(learning_rate=0.05, beta1=0.9, min_dim_size_to_factor=32,
                                  logical_factor_rules=adafactor.standard_logical_factor_rules())

    def get_initial_variables(rng, input_shapes, input_types=None):
        return model.init(rng, np.zeros(input_shapes["tokens"], np.int32))

    init = utils.TrainStateInitializer(opt_def, get_initial_variables, {"tokens": (8, 16)},
                                       partitioner)
    return init.from_scratch(crandom.PRNGKey(0)), partitioner


def bloom_params():
    ex = _example("bloom_sharding")
    from ctrainstate import hf
    model = ex.Bloom(256, 64, 8, 2)
    ids = np.ones((1, 1), np.int32)
    params = cts.tree_util.tree_map(np.asarray, model.init(crandom.PRNGKey(0), ids)["params"])
    shapes = cts.eval_shape(lambda: ex.InferenceState.create(model.init(crandom.PRNGKey(0), ids)))
    partitioner = ex.partitioning.PjitPartitioner(4, logical_axis_rules=ex.logical_axis_rules_full)
    spec = partitioner.get_mesh_axes(shapes).params
    from ctrainstate.core import freeze     # (the specs are frozen, as t5x's are)
    return partitioner.partition(hf.to_bf16, (spec,), spec)(freeze(params))   # sharded bf16


EXAMPLES = {"siren": siren_state, "bloom_sharding": bloom_params, "flax_guide_mlp": flax_guide_state,
            "hf_model_parallel": hf_state, "t5x_partitioner": lambda: t5x_state()[0]}


# --- helpers ----------------------------------------------------------------------------------

def _is_array(x):
    return isinstance(x, (cts.Array, cts.ShapeDtypeStruct))


def _leaves(tree):
    return cts.tree_util.tree_leaves(tree, is_leaf=lambda x: x is None)


def assert_bit_exact(a_tree, b_tree):
    la, lb = _leaves(a_tree), _leaves(b_tree)
    assert len(la) == len(lb)
    for a, b in zip(la, lb):
        if isinstance(a, cts.Array) or isinstance(a, np.ndarray):
            x, y = np.asarray(a), np.asarray(b)
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.tobytes() == y.tobytes()
        else:
            assert a == b or (a is None and b is None), (a, b)


def _spec_for(mesh, shape, old_spec):
    """The old spec's sharded dims moved onto ``mesh``'s axes where they divide."""
    names = mesh.axis_names
    out, used = [], set()
    for d, n in enumerate(shape):
        e = old_spec[d] if d < len(old_spec) else None
        if e is None:
            out.append(None)
            continue
        pick = None
        for ax in names:
            if ax not in used and n % mesh.shape[ax] == 0:
                pick = ax
                break
        if pick is not None:
            used.add(pick)
        out.append(pick)
    return P(*out)


def retarget(state, mesh):
    """``state`` as an abstract target on ``mesh`` (None: one device): every array keeps its
    sharded dims, moved onto the new mesh's axes."""
    def f(x):
        if not isinstance(x, cts.Array):
            return x
        if mesh is None:
            s = SingleDeviceSharding(cts.devices()[0])
        else:
            old = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
            s = NamedSharding(mesh, _spec_for(mesh, x.shape, old))
        return cts.ShapeDtypeStruct(x.shape, x.dtype, s)
    return cts.tree_util.tree_map(f, state)


def check_safetensors(step_dir, state):
    """Every tensor of the checkpoint's files, read with the safetensors package, equals the
    global slice of its array that the index says it holds."""
    from safetensors.numpy import load_file
    index = json.load(open(os.path.join(step_dir, "index.json")))
    tensors = {}
    for f in os.listdir(step_dir):
        if f.endswith(".safetensors"):
            tensors.update({(f, k): v for k, v in load_file(os.path.join(step_dir, f)).items()})
    sd = dict(_store.flatten(cts.serialization.to_state_dict(state)))
    n = 0
    for e in index["leaves"]:
        if e["kind"] != "array":
            continue
        full = np.asarray(sd[tuple(e["keys"])])
        for sl in e["slices"]:
            t = tensors[(sl["file"], sl["tensor"])]
            box = tuple(slice(a, b) for a, b in sl["index"])
            assert t.dtype == full.dtype
            assert t.tobytes() == np.ascontiguousarray(full[box]).tobytes()
            n += 1
    assert n == len(tensors)
    return n


# --- round trips ---------------------------------------------------------------------------------

@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_state_round_trips_across_meshes(tmp_path, example):
    state = EXAMPLES[example]()
    with ocp.CheckpointManager(tmp_path) as m:
        assert m.save(1, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
        assert check_safetensors(os.path.join(tmp_path, "1"), state) > 0
        targets = {"(8,)": cts.make_mesh((8,), ("x",)),
                   "(4,2)": cts.make_mesh((4, 2), ("data", "model")),
                   "(2,4)": mesh24(), "1 device": None}
        for label, mesh in targets.items():
            target = retarget(state, mesh)
            r = m.restore(1, args=ocp.args.StandardRestore(target))
            assert_bit_exact(state, r)
            for t, x in zip(_leaves(target), _leaves(r)):
                if isinstance(t, cts.ShapeDtypeStruct):
                    assert x.sharding == t.sharding, (label, x.sharding, t.sharding)
        # a real state as target works too (its shardings)
        assert_bit_exact(state, m.restore(1, state))


@pytest.mark.parametrize("threads", ["1", "3"])
def test_resharding_moves_dims_and_reads_each_slice_once(tmp_path, monkeypatch, threads):
    monkeypatch.setenv("CTRAINSTATE_CHECKPOINT_THREADS", threads)
    x = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
    a = cts.device_put(x, NamedSharding(mesh24(), P("data", "model")))
    ocp.StandardCheckpointer().save(tmp_path / "c", {"a": a})
    read = []
    real = os.preadv

    def counting(fd, bufs, off):
        read.append(sum(len(memoryview(b)) for b in bufs))
        return real(fd, bufs, off)
    monkeypatch.setattr(os, "preadv", counting)
    for mesh, spec in [((8,), P(None, "x")), ((8,), P("x")), ((4, 2), P("model", "data")),
                       ((2, 4), P("data", "model"))]:
        names = ("x",) if len(mesh) == 1 else ("data", "model")
        s = NamedSharding(cts.make_mesh(mesh, names), spec)
        read.clear()
        r = ocp.StandardCheckpointer().restore(tmp_path / "c",
                                               {"a": cts.ShapeDtypeStruct(x.shape, x.dtype, s)})
        assert r["a"].sharding == s and np.asarray(r["a"]).tobytes() == x.tobytes()
        assert sum(read) == x.nbytes   # every saved byte read once, whatever the layout
        for sh in r["a"].addressable_shards:
            assert np.array_equal(sh.data, x[sh.index])


def test_leaves_of_every_kind(tmp_path):
    mesh = mesh24()
    bf = cts.device_put(np.arange(16, dtype=np.float32).reshape(4, 4).astype(cnp.bfloat16),
                        NamedSharding(mesh, P("data")))
    state = {"f16": cts.device_put(np.linspace(-2, 2, 8).astype(np.float16),
                                   NamedSharding(mesh, P("model"))),
             "bf16": bf,
             "i32": cts.device_put(np.arange(-8, 8, dtype=np.int32), NamedSharding(mesh, P())),
             "u32": cts.device_put(np.arange(8, dtype=np.uint32) * 2**30,
                                   NamedSharding(mesh, P("model"))),
             "bool": cts.device_put(np.arange(8) % 3 == 0, NamedSharding(mesh, P("data"))),
             "scalar": cts.device_put(np.float32(3.5)),
             "host": np.arange(6, dtype=np.int64).reshape(2, 3),
             "np_scalar": np.float64(2.25),
             "empty": np.zeros((0, 3), np.float32),
             "nested": {"none": None, "s": "text", "i": 7, "f": 0.5, "b": True, "e": {}},
             "list": [1, 2.0]}
    p = tmp_path / "c"
    ocp.StandardCheckpointer().save(p, state)
    r = ocp.StandardCheckpointer().restore(p, state)
    assert_bit_exact(state, r)
    assert r["nested"]["e"] == {} and r["list"] == [1, 2.0] and r["nested"]["s"] == "text"
    assert r["bf16"].dtype == bf.dtype and r["bf16"].sharding == bf.sharding
    raw = ocp.StandardCheckpointer().restore(p)   # no target: host arrays in dicts
    assert isinstance(raw["f16"], np.ndarray) and raw["i32"].tolist() == list(range(-8, 8))
    assert raw["list"] == {"0": 1, "1": 2.0} and raw["nested"]["none"] is None


def test_dtype_and_shape_mismatches_name_the_path(tmp_path):
    s = {"params": {"w": cts.device_put(np.ones((4, 8), np.float16))}}
    ocp.StandardCheckpointer().save(tmp_path / "c", s)
    c = ocp.StandardCheckpointer()
    with pytest.raises(ValueError, match=r"params/w is float16 in the checkpoint, the target "
                                         r"float32 \(pass cast=True"):
        c.restore(tmp_path / "c", {"params": {"w": cts.ShapeDtypeStruct((4, 8), np.float32)}})
    with pytest.raises(ValueError, match=r"params/w has shape \(4, 8\) in the checkpoint, the "
                                         r"target \(8, 4\)"):
        c.restore(tmp_path / "c", {"params": {"w": cts.ShapeDtypeStruct((8, 4), np.float16)}})
    r = c.restore(tmp_path / "c", {"params": {"w": cts.ShapeDtypeStruct(
        (4, 8), np.float32, NamedSharding(mesh24(), P("data", "model")))}}, cast=True)
    assert r["params"]["w"].dtype == np.float32 and np.asarray(r["params"]["w"]).min() == 1.0
    with pytest.raises(ValueError, match="has no entry params/b"):
        c.restore(tmp_path / "c", {"params": {"w": s["params"]["w"], "b": np.zeros(2)}})
    with pytest.raises(ValueError, match="entries the target lacks: params/w"):
        c.restore(tmp_path / "c", {"params": {}})


# --- corruption --------------------------------------------------------------------------------

def test_a_flipped_byte_in_any_array_raises_naming_it(tmp_path):
    state = flax_guide_state()
    src = tmp_path / "c"
    ocp.StandardCheckpointer().save(src, state)
    index = json.load(open(src / "index.json"))
    arrays = [e for e in index["leaves"] if e["kind"] == "array"]
    assert len(arrays) >= 10
    rng = pyrandom.Random(0)
    for e in arrays:
        name = "/".join(e["keys"])
        sl = rng.choice(e["slices"])
        a, b = sl["offsets"]
        pos = rng.randrange(a, b)
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(src, bad)
        with open(bad / sl["file"], "r+b") as f:
            f.seek(pos)
            byte = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
        with pytest.raises(ocp.CorruptCheckpointError,
                           match=f"checksum mismatch in array '{name}'"):
            ocp.StandardCheckpointer().restore(bad, retarget(state, cts.make_mesh((8,), ("x",))))
    # a malformed index entry, a truncated file and a missing file are errors too
    idx = json.load(open(bad / "index.json"))
    broken = json.loads(json.dumps(idx))
    del next(e for e in broken["leaves"] if e["kind"] == "array")["slices"][0]["offsets"]
    json.dump(broken, open(bad / "index.json", "w"))
    with pytest.raises(ocp.CorruptCheckpointError, match="is malformed"):
        ocp.StandardCheckpointer().restore(bad, state)
    json.dump(idx, open(bad / "index.json", "w"))
    bad = tmp_path / "bad"
    with open(bad / "arrays.p00000.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(bad / "arrays.p00000.safetensors") - 3)
    with pytest.raises(ocp.CorruptCheckpointError):
        ocp.StandardCheckpointer().restore(bad, state)
    os.remove(bad / "arrays.p00000.safetensors")
    with pytest.raises(ocp.CorruptCheckpointError, match="is missing"):
        ocp.StandardCheckpointer().restore(bad, state)


@pytest.mark.parametrize("threads", ["1", "2", "1+prefetch"])
def test_slices_of_a_big_array_each_way_a_flipped_byte_or_truncation_raises(tmp_path,
                                                                            monkeypatch,
                                                                            threads):
    """Many slices of a big array, read each way (straight into a run of the target block,
    through a scratch buffer copied into the blocks, into a host array) on 1 and 2 I/O
    threads, and on 1 with the disk read ahead of it (prefetch chunks made small enough
    for this array): a restore is bit-exact, a flipped byte in any slice (early, middle,
    last) raises naming the array and the slice, a truncated file raises
    CorruptCheckpointError, and no I/O thread outlives a restore."""
    import threading
    prefetches, read_ahead = [], threads == "1+prefetch"
    if read_ahead:
        if not _io.can_prefetch():
            pytest.skip("read-ahead needs Linux's sendfile")
        threads = "1"
        monkeypatch.setattr(_io, "PREFETCH_CHUNK", 64 << 10)
        monkeypatch.setattr(_io, "PREFETCH_AHEAD", 256 << 10)
        real_prefetch = _io.Prefetch

        def counted(ranges):
            prefetches.append(list(ranges))
            return real_prefetch(ranges)
        monkeypatch.setattr(_io, "Prefetch", counted)
    else:   # no read-ahead: this array is below two prefetch chunks
        assert 2048 * 1024 * 4 < 2 * _io.PREFETCH_CHUNK
    monkeypatch.setenv("CTRAINSTATE_CHECKPOINT_THREADS", threads)
    monkeypatch.setattr(_io, "SLICE_BYTES", 512 << 10)    # 2 slices a block
    x = np.random.default_rng(3).standard_normal((2048, 1024)).astype(np.float32)
    a = cts.device_put(x, NamedSharding(mesh24(), P("data", "model")))
    src = tmp_path / "c"
    ocp.StandardCheckpointer().save(src, {"w": a, "n": 5})
    w = next(e for e in json.load(open(src / "index.json"))["leaves"] if e["keys"] == ["w"])
    assert len(w["slices"]) == 16
    mesh8 = cts.make_mesh((8,), ("x",))
    targets = {   # straight into the blocks / through scratch buffers / into a host array
        "same": {"w": cts.ShapeDtypeStruct(x.shape, x.dtype, a.sharding), "n": 0},
        "cols": {"w": cts.ShapeDtypeStruct(x.shape, x.dtype,
                                           NamedSharding(mesh8, P(None, "x"))), "n": 0},
        "host": {"w": np.zeros_like(x), "n": 0}}

    def io_threads():
        return [t for t in threading.enumerate() if t.name.startswith("ctrainstate-ckpt")]
    for t in targets.values():
        r = ocp.StandardCheckpointer().restore(src, t)
        assert np.asarray(r["w"]).tobytes() == x.tobytes() and r["n"] == 5
    assert not io_threads()
    if read_ahead:   # each restore read its array's bytes ahead: one range, the whole file's
        assert len(prefetches) == len(targets)
        ends = (w["slices"][0]["offsets"][0], w["slices"][-1]["offsets"][1])
        assert all([(os.path.basename(p), lo, hi) for p, lo, hi in r_] ==
                   [(w["slices"][0]["file"], *ends)] for r_ in prefetches)
    for k in (0, 1, 7, 15):
        sl = w["slices"][k]
        bad = tmp_path / f"bad{k}"
        shutil.copytree(src, bad)
        pos = (sl["offsets"][0] + sl["offsets"][1]) // 2 if k != 15 else sl["offsets"][1] - 1
        with open(bad / sl["file"], "r+b") as f:
            f.seek(pos)
            byte = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([byte ^ 0x04]))
        for t in targets.values():
            with pytest.raises(ocp.CorruptCheckpointError,
                               match="checksum mismatch in array 'w': slice "
                                     + re.escape(str(sl["index"]))):
                ocp.StandardCheckpointer().restore(bad, t)
        assert not io_threads()
    f = src / w["slices"][0]["file"]
    os.truncate(f, w["slices"][15]["offsets"][0] + 100)
    for t in targets.values():
        with pytest.raises(ocp.CorruptCheckpointError, match="array 'w'.*truncated"):
            ocp.StandardCheckpointer().restore(src, t)
    assert not io_threads()


# --- crash safety ------------------------------------------------------------------------------

def _small_state(seed):
    mesh = mesh24()
    rng = np.random.default_rng(seed)
    return {"step": seed,
            "params": {f"w{i}": cts.device_put(rng.standard_normal((16, 32)).astype(np.float32),
                                               NamedSharding(mesh, P("data", "model")))
                       for i in range(3)}}


_EVENTS = ("write", "pwrite", "fsync", "rename", "mkdir", "unlink", "rmdir")


def _arm(n):
    """Patch os so that the n-th durable step (a write, pwrite, fsync, rename, mkdir, unlink, rmdir)
    kills this process with SIGKILL just before it runs; n=0 only counts."""
    count = [0]
    for ev in _EVENTS:
        real = getattr(os, ev)

        def wrapped(*a, _real=real, **k):
            count[0] += 1
            if count[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(*a, **k)
        setattr(os, ev, wrapped)
    return count


def test_sigkill_at_20_points_leaves_the_last_commit_restorable(tmp_path):
    s1, s2, s3 = _small_state(1), _small_state(2), _small_state(3)
    base = tmp_path / "base"
    opts = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=False)
    with ocp.CheckpointManager(base, options=opts) as m:
        m.save(1, s1)
    # how many durable steps a save of step 2 takes (including the removal of step 1)
    probe = tmp_path / "probe"
    shutil.copytree(base, probe)
    saved = {ev: getattr(os, ev) for ev in _EVENTS}
    try:
        count = _arm(0)
        with ocp.CheckpointManager(probe, options=opts) as m:
            m.save(2, s2)
        total = count[0]
    finally:
        for ev, f in saved.items():
            setattr(os, ev, f)
    assert total >= 20
    points = sorted(pyrandom.Random(34).sample(range(1, total + 1), 20))
    outcomes = []
    t0 = time.time()
    for i, n in enumerate(points):
        d = tmp_path / f"run{n}"
        shutil.copytree(base, d)
        use_async = i % 2 == 1
        pid = os.fork()
        if pid == 0:   # the saving child: killed at its n-th durable step
            try:
                _arm(n)
                o = ocp.CheckpointManagerOptions(max_to_keep=1,
                                                 enable_async_checkpointing=use_async)
                m = ocp.CheckpointManager(d, options=o)
                m.save(2, s2)
                m.wait_until_finished()
            finally:
                os._exit(0)
        deadline = time.time() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.time() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the saving child hung (point {n})")
            time.sleep(0.005)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (n, status)
        with ocp.CheckpointManager(d, options=opts) as m:
            latest = m.latest_step()
            assert latest in (1, 2), (n, os.listdir(d))
            expect = s2 if latest == 2 else s1
            assert_bit_exact(expect, m.restore(latest, expect))
            outcomes.append(latest)
            m.save(3, s3)   # the next save removes what the killed one left
            assert sorted(os.listdir(d)) == ["3"], (n, os.listdir(d))
            assert_bit_exact(s3, m.restore(3, s3))
    assert len(outcomes) == 20 and set(outcomes) == {1, 2}   # killed before and after commit
    assert time.time() - t0 < 60


# --- the manager ------------------------------------------------------------------------------

def test_manager_policies(tmp_path):
    s = _small_state(0)
    o = ocp.CheckpointManagerOptions(max_to_keep=2, keep_period=4, save_interval_steps=2)
    with ocp.CheckpointManager(tmp_path, options=o) as m:
        saved = [step for step in range(1, 11) if m.save(step, s)]
        assert saved == [1, 2, 4, 6, 8, 10]   # the first step, then every 2nd (orbax's)
        m.wait_until_finished()
        assert m.all_steps() == [4, 8, 10] and m.latest_step() == 10
        assert not m.should_save(10) and m.should_save(12) and not m.should_save(11)
        assert m.save(11, s, force=True, metrics={"loss": np.float32(0.5)},
                      custom_metadata={"run": "a"})
        with pytest.raises(ocp.StepAlreadyExistsError):
            m.save(11, s, force=True)
        md = m.metadata(11)
        assert md["step"] == 11 and md["metrics"] == {"loss": 0.5} and md["custom"] == {"run": "a"}
        assert m.item_metadata(11)["params"]["w0"].shape == (16, 32)
        m.delete(4)
        m.wait_until_finished()
        assert m.all_steps() == [8, 10, 11]
    # a partial directory from an interrupted save is ignored, then removed by the next save
    os.mkdir(tmp_path / "12.tmp-0123456789ab")
    with ocp.CheckpointManager(tmp_path, options=o) as m:
        assert m.latest_step() == 11
        m.save(12, s)
        m.wait_until_finished()
        assert not any(".tmp-" in n for n in os.listdir(tmp_path))
    with ocp.CheckpointManager(tmp_path / "prefixed",
                               options=ocp.CheckpointManagerOptions(step_prefix="ckpt")) as m:
        m.save(3, s)
        m.wait_until_finished()
        assert os.listdir(tmp_path / "prefixed") == ["ckpt_3"] and m.all_steps() == [3]


def test_best_fn_keeps_the_best_steps_by_their_metrics(tmp_path):
    s = {"x": np.arange(3)}
    o = ocp.CheckpointManagerOptions(max_to_keep=2, best_fn=lambda m: m["acc"])
    with ocp.CheckpointManager(tmp_path, options=o) as m:
        assert m.best_step() is None
        for step, acc in zip(range(1, 6), (0.5, 0.9, 0.1, 0.7, 0.8)):
            m.save(step, s, metrics={"acc": np.float64(acc) if step == 3 else acc})
            assert m.best_step() == (2 if step >= 2 else 1)   # the pending step counts
        m.wait_until_finished()
        assert m.all_steps() == [2, 5] and m.best_step() == 2
        with pytest.warns(UserWarning, match="without metrics"):
            m.save(6, s)   # kept: keep_checkpoints_without_metrics
        m.save(7, s, metrics={"acc": 0.8})   # a tie: the later step ranks better
        m.wait_until_finished()
        assert m.all_steps() == [2, 6, 7] and m.best_step() == 2
        m.save(8, s, metrics={"acc": float("nan")})   # NaN ranks worst
        m.wait_until_finished()
        assert m.all_steps() == [2, 6, 7]
    # the metrics are in the steps' metadata: a new manager ranks them alike
    with ocp.CheckpointManager(tmp_path, options=o) as m:
        assert m.best_step() == 2 and m.metadata(7)["metrics"] == {"acc": 0.8}
        m.save(9, s, metrics={"acc": 0.95})
        m.wait_until_finished()
        assert m.all_steps() == [2, 6, 9] and m.best_step() == 9
    with ocp.CheckpointManager(tmp_path) as m:   # without best_fn: the latest
        assert m.best_step() == 9
    # best_mode='min'; steps without metrics deleted first; keep_period still kept
    o = ocp.CheckpointManagerOptions(max_to_keep=2, best_fn=lambda m: m["eval"]["loss"],
                                     best_mode="min", keep_checkpoints_without_metrics=False,
                                     keep_period=10, enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path / "min", options=o) as m, \
            pytest.warns(UserWarning, match="deleted first"):
        m.save(1, s)
        m.save(2, s, metrics={"eval": {"loss": 0.3}})
        m.save(3, s, metrics={"eval": {"loss": np.array(0.1)}})
        assert m.all_steps() == [2, 3]
        m.save(4, s, metrics={"eval": {"loss": 0.2}})
        assert m.all_steps() == [3, 4] and m.best_step() == 3
        m.save(10, s, metrics={"eval": {"loss": 9.0}})
        m.save(11, s, metrics={"eval": {"loss": 0.05}})
        assert m.all_steps() == [3, 10, 11] and m.best_step() == 11


def test_best_fn_options_and_metrics_are_checked(tmp_path):
    with pytest.raises(ValueError, match="best_mode must be 'min' or 'max', got 'avg'"):
        ocp.CheckpointManagerOptions(best_mode="avg")
    with pytest.raises(TypeError, match="best_fn must be a function"):
        ocp.CheckpointManagerOptions(best_fn="loss")
    with pytest.raises(TypeError, match="keep_checkpoints_without_metrics must be a bool"):
        ocp.CheckpointManagerOptions(keep_checkpoints_without_metrics="yes")
    s = {"x": np.arange(3)}
    o = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"])
    with ocp.CheckpointManager(tmp_path, options=o) as m:
        with pytest.raises(TypeError, match="metrics must be a dict"):
            m.save(1, s, metrics=0.5)
        with pytest.raises(TypeError, match=r"metrics\['loss'\] must be a number"):
            m.save(1, s, metrics={"loss": np.ones(3)})
        with pytest.raises(KeyError, match="best_fn raised on the metrics of step 1"):
            m.save(1, s, metrics={"acc": 1.0})
        o.best_fn = lambda m: str(m["loss"])
        with pytest.raises(TypeError, match="best_fn must return a number.*step 1.*str"):
            m.save(1, s, metrics={"loss": 1.0})
        assert m.all_steps() == []   # nothing was saved


def test_async_save_snapshots_then_writes_in_the_background(tmp_path):
    state = siren_state()
    before = cts.device_get(state.params)
    m = ocp.CheckpointManager(tmp_path)
    assert m.save(1, state)
    # training goes on at once: the step donates (updates in place) the saved arrays
    grads = cts.tree_util.tree_map(lambda p: cnp.ones_like(p), state.params)
    state = state.apply_gradients(grads=grads)
    m.wait_until_finished()
    r = m.restore(1, state)
    assert_bit_exact(before, r.params) and r.step == 1


def test_async_errors_surface_at_wait_and_next_save(tmp_path, monkeypatch):
    import threading
    m = ocp.CheckpointManager(tmp_path)
    real = _io.write_all
    failed = threading.Event()

    def failing(fd, buf):
        failed.set()
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(_io, "write_all", failing)
    assert m.save(1, _small_state(1))   # returns: the write fails in the background
    with pytest.raises(OSError, match="No space left"):
        m.wait_until_finished()
    m.wait_until_finished()   # raised once
    assert m.all_steps() == [] and os.listdir(tmp_path) == []   # nothing half-written kept
    failed.clear()
    m.save(2, _small_state(1))
    assert failed.wait(30)
    monkeypatch.setattr(_io, "write_all", real)
    with pytest.raises(OSError, match="No space left"):
        m.save(3, _small_state(1))   # the error of step 2 surfaces here
    assert m.save(4, _small_state(4))
    m.wait_until_finished()
    assert m.all_steps() == [4]


# --- flax / t5x front ends ------------------------------------------------------------------------

def test_flax_save_restore_checkpoint(tmp_path):
    s = _small_state(1)
    p = ocp.save_checkpoint(tmp_path, s, step=1, keep=2)
    assert p.endswith("checkpoint_1")
    ocp.save_checkpoint(tmp_path, _small_state(2), step=2, keep=2)
    am = ocp.AsyncManager()
    ocp.save_checkpoint(tmp_path, _small_state(3), step=3, keep=2, keep_every_n_steps=None,
                        async_manager=am)
    am.wait_previous_save()
    assert ocp.available_steps(tmp_path) == [2, 3]
    assert ocp.latest_checkpoint(tmp_path).endswith("checkpoint_3")
    with pytest.raises(ocp.InvalidCheckpointError):
        ocp.save_checkpoint(tmp_path, s, step=3)
    assert_bit_exact(_small_state(3), ocp.restore_checkpoint(tmp_path, s))
    assert_bit_exact(_small_state(2), ocp.restore_checkpoint(tmp_path, s, step=2))
    assert_bit_exact(_small_state(2), ocp.restore_checkpoint(tmp_path / "checkpoint_2", s))
    assert ocp.restore_checkpoint(tmp_path / "none", s) is s   # nothing there: the target
    with pytest.raises(ValueError, match="Matching checkpoint not found"):
        ocp.restore_checkpoint(tmp_path, s, step=7)
    ocp.save_checkpoint(tmp_path, s, step=2, overwrite=True, keep=5)
    assert ocp.available_steps(tmp_path) == [2]
    assert_bit_exact(s, ocp.restore_checkpoint(tmp_path, s))


def test_t5x_checkpointer(tmp_path):
    from ctrainstate.t5x import checkpoints
    state, partitioner = t5x_state()
    c = checkpoints.Checkpointer(state, partitioner, tmp_path, keep=1)
    path = c.save(state)
    assert os.path.basename(path) == f"checkpoint_{int(state.step)}"
    target = cts.eval_shape(lambda: state)
    r = checkpoints.Checkpointer(target, partitioner, tmp_path).restore()
    assert_bit_exact(state, r)
    # save_dtype casts float params on save; restore casts back to the target's dtype
    c16 = checkpoints.Checkpointer(state, partitioner, tmp_path / "b", save_dtype=np.float16)
    c16.save(state)
    idx = json.load(open(tmp_path / "b" / f"checkpoint_{int(state.step)}" / "index.json"))
    dts = {"/".join(e["keys"]): e["dtype"] for e in idx["leaves"] if e["kind"] == "array"}
    assert {v for k, v in dts.items() if k.startswith("target/")} == {"float16"}
    r16 = c16.restore()
    k = r16.params["layers_0"]["wi"]["kernel"]
    assert k.dtype == np.float32
    ref = np.asarray(state.params["layers_0"]["wi"]["kernel"])
    assert np.array_equal(np.asarray(k), ref.astype(np.float16).astype(np.float32))


# --- pretrained weights ------------------------------------------------------------------------------

def _tiny_params():
    rng = np.random.default_rng(5)
    return {"transformer": {
        "wte": {"embedding": rng.standard_normal((64, 64)).astype(np.float32)},
        "h": {"0": {"attention": {"q_proj": {"kernel": rng.standard_normal((64, 64)).astype(np.float32)}},
                    "mlp": {"c_fc": {"kernel": rng.standard_normal((64, 256)).astype(np.float32),
                                     "bias": rng.standard_normal(256).astype(np.float32)}}}},
        "ln_f": {"scale": np.ones(64, np.float32), "bias": np.zeros(64, np.float32)}}}


def _flat(tree, sep, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, sep, f"{prefix}{k}{sep}"))
        else:
            out[prefix + k] = v
    return out


def _check_loaded(params, ref, mesh):
    from ctrainstate.hf.partitions import gpt_neo_rules, set_partitions
    specs = _flat(set_partitions(ref, gpt_neo_rules()), "/")
    for k, v in _flat(ref, "/").items():
        got = _flat(params, "/")[k]
        assert isinstance(got, cts.Array) and np.asarray(got).tobytes() == v.tobytes(), k
        assert got.sharding == NamedSharding(mesh, specs[k] or P()), k


def test_pretrained_from_flax_msgpack_and_safetensors(tmp_path, monkeypatch, jax_ref):
    from safetensors.numpy import save_file
    from ctrainstate import serialization
    from ctrainstate.hf.partitions import gpt_neo_rules
    ref = _tiny_params()
    mesh = cts.Mesh(np.array(cts.devices()).reshape(2, 4), ("dp", "mp"))
    # Flax's own writer's bytes: ctrainstate's are the same (recorded as a digest)
    data = serialization.msgpack_serialize(ref)
    want = jax_ref("flax msgpack digest", lambda jax: bits_digest(np.frombuffer(
        __import__("flax.serialization").serialization.msgpack_serialize(ref), np.uint8)))
    assert bits_digest(np.frombuffer(data, np.uint8)) == want
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "flax_model.msgpack").write_bytes(data)
    read = []
    real = os.preadv

    def counting(fd, bufs, off):
        read.append(sum(len(memoryview(b)) for b in bufs))
        return real(fd, bufs, off)
    monkeypatch.setattr(os, "preadv", counting)
    p = ocp.load_pretrained_params(tmp_path / "m", mesh=mesh, rules=gpt_neo_rules())
    _check_loaded(p, ref, mesh)
    # each array's bytes read once over all devices (the replicas copy device to device)
    assert sum(read) == sum(v.nbytes for v in _flat(ref, "/").values())
    monkeypatch.setattr(os, "preadv", real)

    # one safetensors file, '.'-joined keys as HF's Flax save_pretrained writes them
    (tmp_path / "s").mkdir()
    save_file(_flat(ref, "."), str(tmp_path / "s" / "model.safetensors"))
    _check_loaded(ocp.load_pretrained_params(tmp_path / "s", mesh=mesh, rules=gpt_neo_rules()),
                  ref, mesh)

    # sharded: two files and model.safetensors.index.json
    flat = _flat(ref, ".")
    keys = sorted(flat)
    (tmp_path / "sh").mkdir()
    parts = {"model-00001-of-00002.safetensors": keys[:3],
             "model-00002-of-00002.safetensors": keys[3:]}
    for f, ks in parts.items():
        save_file({k: flat[k] for k in ks}, str(tmp_path / "sh" / f))
    json.dump({"metadata": {"total_size": 0},
               "weight_map": {k: f for f, ks in parts.items() for k in ks}},
              open(tmp_path / "sh" / "model.safetensors.index.json", "w"))
    _check_loaded(ocp.load_pretrained_params(tmp_path / "sh", mesh=mesh, rules=gpt_neo_rules()),
                  ref, mesh)

    # a target tree of ShapeDtypeStruct gives the shardings and the dtypes (cast on request)
    s = NamedSharding(cts.make_mesh((8,), ("x",)), P(None, "x"))
    target = cts.tree_util.tree_map(lambda v: cts.ShapeDtypeStruct(
        v.shape, cnp.bfloat16, s if v.ndim == 2 else None), ref)
    with pytest.raises(ValueError, match="is float32 in .* the target bfloat16"):
        ocp.load_pretrained_params(tmp_path / "s" / "model.safetensors", target)
    got = ocp.load_pretrained_params(tmp_path / "s" / "model.safetensors", target, cast=True)
    k = got["transformer"]["h"]["0"]["mlp"]["c_fc"]["kernel"]
    assert k.dtype == cnp.bfloat16 and k.sharding == s
    assert np.array_equal(np.asarray(k), ref["transformer"]["h"]["0"]["mlp"]["c_fc"]["kernel"]
                          .astype(cnp.bfloat16))
    bad = dict(ref["transformer"])
    with pytest.raises(ValueError, match="missing transformer/extra"):
        ocp.load_pretrained_params(tmp_path / "s", {"transformer": dict(
            bad, extra=cts.ShapeDtypeStruct((2,), np.float32))}, cast=True)


def test_pretrained_chunked_msgpack(tmp_path, monkeypatch):
    """Flax splits arrays over MAX_CHUNK_SIZE into chunks; a small limit makes one here."""
    from ctrainstate import serialization
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 1000)
    w = np.random.default_rng(0).standard_normal((40, 24)).astype(np.float32)
    (tmp_path / "flax_model.msgpack").write_bytes(serialization.msgpack_serialize({"w": w}))
    mesh = cts.make_mesh((8,), ("x",))
    for spec in (P("x", None), P(None, "x")):
        got = ocp.load_pretrained_params(tmp_path / "flax_model.msgpack", mesh=mesh,
                                         rules=[(("w",), spec)])["w"]
        assert got.sharding.spec == spec and np.asarray(got).tobytes() == w.tobytes()


def test_read_box_layouts():
    """_io.read_box against numpy slicing, for boxes of every contiguity, with a small limit
    so the splitting paths run."""
    import tempfile
    x = np.arange(6 * 10 * 7, dtype=np.float32).reshape(6, 10, 7)
    with tempfile.NamedTemporaryFile() as f:
        f.write(b"pad" + x.tobytes())
        f.flush()
        fd = os.open(f.name, os.O_RDONLY)
        try:
            src = _io.Source(fd, [(3, 100), (103, x.nbytes - 100)], x.shape, x.dtype, "x")
            scratch = np.empty(4096, np.uint8)
            rng = np.random.default_rng(1)
            for _ in range(200):
                lo = [int(rng.integers(0, n)) for n in x.shape]
                hi = [int(rng.integers(l + 1, n + 1)) for l, n in zip(lo, x.shape)]
                out = np.empty([h - l for l, h in zip(lo, hi)], x.dtype)
                _io.read_box(src, lo, hi, out, scratch, limit=int(rng.choice([32, 200, 4096])))
                assert np.array_equal(out, x[tuple(slice(l, h) for l, h in zip(lo, hi))])
        finally:
            os.close(fd)


def test_checkpoint_is_still_jax_checkpoint():
    f = cts.checkpoint(lambda v: cnp.sin(v) * 2.0)
    g = cts.grad(lambda v: cnp.sum(f(v)))(cts.device_put(np.zeros(3, np.float32)))
    assert np.asarray(g).tolist() == [2.0, 2.0, 2.0]
    assert cts.remat is cts.checkpoint and ocp is cts.checkpoint


def test_index_records_layout_and_crc32_fallback(tmp_path, monkeypatch):
    mesh = mesh24()
    x = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    s = {"w": cts.device_put(x, NamedSharding(mesh, P("data", None))), "n": 3}
    ocp.StandardCheckpointer().save(tmp_path / "a", s)
    index = json.load(open(tmp_path / "a" / "index.json"))
    assert index["checksum"] == "xxh3_64" and index["format"] == "ctrainstate.checkpoint"
    w = next(e for e in index["leaves"] if e["keys"] == ["w"])
    assert w["shape"] == [8, 12] and w["dtype"] == "float32"
    assert w["sharding"] == {"type": "NamedSharding", "mesh_shape": [2, 4],
                             "axis_names": ["data", "model"],
                             "device_ids": [[0, 1, 2, 3], [4, 5, 6, 7]],
                             "spec": ["data", None]}
    # replicas write nothing: one slice per unique block, keyed by its global index range
    assert [sl["index"] for sl in w["slices"]] == [[[0, 4], [0, 12]], [[4, 8], [0, 12]]]
    raw = open(tmp_path / "a" / w["slices"][1]["file"], "rb").read()
    a, b = w["slices"][1]["offsets"]
    assert raw[a:b] == x[4:].tobytes()
    assert {"keys": ["n"], "kind": "value", "value": 3} in index["leaves"]
    # without xxhash, CRC-32 (zlib) is written, named in the index and verified the same way
    monkeypatch.setattr(_io, "DEFAULT_CHECKSUM", "crc32")
    ocp.StandardCheckpointer().save(tmp_path / "b", s)
    assert json.load(open(tmp_path / "b" / "index.json"))["checksum"] == "crc32"
    assert_bit_exact(s, ocp.StandardCheckpointer().restore(tmp_path / "b", s))
    with open(tmp_path / "b" / "arrays.p00000.safetensors", "r+b") as f:
        f.seek(b - 1)
        last = f.read(1)[0]
        f.seek(b - 1)
        f.write(bytes([last ^ 0x10]))
    with pytest.raises(ocp.CorruptCheckpointError, match="checksum mismatch in array 'w'"):
        ocp.StandardCheckpointer().restore(tmp_path / "b", s)


@pytest.mark.gpu
def test_gpu_devices_save_restore_and_pretrained(tmp_path):
    """GPU devices: blocks are copied to the host to be written, and staged on the host one
    block at a time to be restored (run on a GPU, and on tools/mock_gpu.sh's emulation,
    whose device pointers crash any host dereference)."""
    gpus = cts.devices("gpu")
    if len(gpus) < 4:
        pytest.skip("needs 4 GPU devices (set CTRAINSTATE_GPU_SPLIT)")
    gmesh = cts.Mesh(np.array(gpus[:4], dtype=object).reshape(2, 2), ("data", "model"))
    cpu8 = cts.Mesh(np.array(cts.devices("cpu")[:8], dtype=object), ("x",))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 12)).astype(np.float32)
    state = {"f32": cts.device_put(x, NamedSharding(gmesh, P("data", "model"))),
             "bf16": cts.device_put(x.astype(cnp.bfloat16), NamedSharding(gmesh, P(None, "model"))),
             "bool": cts.device_put(x > 0, NamedSharding(gmesh, P("data"))),
             "step": 2}
    for async_ in (False, True):
        d = tmp_path / f"m{async_}"
        with ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(
                enable_async_checkpointing=async_)) as m:
            m.save(1, state)
            m.wait_until_finished()
            check_safetensors(os.path.join(d, "1"), state)
            on_gpu = {k: cts.ShapeDtypeStruct(v.shape, v.dtype, NamedSharding(
                gmesh, P("model", None))) if isinstance(v, cts.Array) else 0
                for k, v in state.items()}
            assert_bit_exact(state, m.restore(1, on_gpu))
            assert_bit_exact(state, m.restore(1, retarget(state, cpu8)))
    # saved from CPU devices, restored onto GPU devices
    cpu = {k: cts.device_put(np.asarray(v), NamedSharding(cpu8, P("x")))
           if isinstance(v, cts.Array) else v for k, v in state.items()}
    ocp.StandardCheckpointer().save(tmp_path / "cpu", cpu)
    r = ocp.StandardCheckpointer().restore(tmp_path / "cpu", state)
    assert_bit_exact(state, r) and r["f32"].sharding == state["f32"].sharding
    from safetensors.numpy import save_file
    save_file({"w.kernel": x}, str(tmp_path / "model.safetensors"))
    p = ocp.load_pretrained_params(tmp_path / "model.safetensors", mesh=gmesh,
                                   rules=[(("w", "kernel"), P(None, "model"))])
    assert np.asarray(p["w"]["kernel"]).tobytes() == x.tobytes()
    assert p["w"]["kernel"].sharding == NamedSharding(gmesh, P(None, "model"))


def test_save_and_restore_never_hold_the_array_on_the_host(tmp_path):
    """Host memory that Python and numpy allocate (tracemalloc: scratch buffers, snapshots;
    device buffers are the C backend's) stays within the I/O threads' scratch buffers: a
    sync save writes from the device buffers, a restore reads into them."""
    import tracemalloc
    mesh8 = cts.make_mesh((8,), ("x",))
    a = crandom.uniform(crandom.PRNGKey(0), (4096, 4096), np.float32,
                        out_sharding=NamedSharding(mesh8, P("x", None)))   # 64 MiB, 8 MiB shards
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    m = ocp.CheckpointManager(tmp_path, options=opts)

    def peak(f):
        tracemalloc.start()
        try:
            out = f()
            return tracemalloc.get_traced_memory()[1], out
        finally:
            tracemalloc.stop()
    p_save, _ = peak(lambda: m.save(1, {"a": a}))
    assert p_save < 1 << 20
    same = {"a": cts.ShapeDtypeStruct(a.shape, a.dtype, a.sharding)}
    p_same, r = peak(lambda: m.restore(1, same))
    assert p_same < 1 << 20 and np.asarray(r["a"]).tobytes() == np.asarray(a).tobytes()
    cols = {"a": cts.ShapeDtypeStruct(a.shape, a.dtype, NamedSharding(mesh8, P(None, "x")))}
    p_cols, r = peak(lambda: m.restore(1, cols))
    # a scratch buffer of one slice per I/O thread
    assert p_cols <= _io.workers() * _io.SLICE_BYTES + (1 << 20) < a.nbytes // 8
    assert np.asarray(r["a"]).tobytes() == np.asarray(a).tobytes()


def test_pretrained_from_a_flax_model_onto_an_abstract_target(tmp_path, jax_ref):
    """A Flax (linen, on jax) model's params written by flax.serialization.msgpack_serialize
    load into the same ctrainstate model's params, born with the shardings its init under
    logical axis rules would give them (the target is eval_shape of that init, boxes and
    all)."""
    from ctrainstate import nn

    x = np.ones((2, 16), np.float32)

    def theirs(jax, flax_nn, flax_ser):
        # Flax's params, their msgpack bytes and its output on them
        class FlaxMLP(flax_nn.Module):
            @flax_nn.compact
            def __call__(self, x):
                x = flax_nn.Dense(64, name="up")(x)
                return flax_nn.Dense(16, name="down")(flax_nn.relu(x))

        ref = jax.device_get(FlaxMLP().init(jax.random.PRNGKey(0), x)["params"])
        return {"params": {k: dict(v) for k, v in ref.items()},
                "msgpack": np.frombuffer(flax_ser.msgpack_serialize(dict(ref)), np.uint8),
                "y": FlaxMLP().apply({"params": ref}, x)}

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            k1 = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            k2 = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
            b1 = nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",))
            x = nn.Dense(64, kernel_init=k1, bias_init=b1, name="up")(x)
            return nn.Dense(16, kernel_init=k2, name="down")(nn.relu(x))

    want = jax_ref("flax", lambda jax, linen, flax: theirs(jax, linen, flax.serialization))
    ref = want["params"]
    (tmp_path / "flax_model.msgpack").write_bytes(want["msgpack"].tobytes())
    mesh = mesh24()
    with mesh, nn.logical_axis_rules((("mlp", "model"), ("embed", None))):
        target = cts.eval_shape(MLP().init, crandom.PRNGKey(0), x)["params"]
    params = ocp.load_pretrained_params(tmp_path, target)
    k = params["up"]["kernel"]
    assert k.sharding == NamedSharding(mesh, P(None, "model"))
    assert params["down"]["kernel"].sharding == NamedSharding(mesh, P("model", None))
    for layer in ("up", "down"):
        for name in ("kernel", "bias"):
            assert np.asarray(params[layer][name]).tobytes() == \
                np.asarray(ref[layer][name]).tobytes(), (layer, name)
    # and the model runs on them
    y = MLP().apply({"params": params}, cts.device_put(x))
    np.testing.assert_allclose(np.asarray(y), want["y"], rtol=1e-5, atol=1e-5)


# --- the pieces of a save by several processes (tests/mpi/checkpoint.py runs them for real) -----

def test_a_process_other_than_0_writes_only_blocks_of_arrays_that_span_processes(tmp_path):
    # in one process every Array is fully addressable: as process 1 of a job, the plan
    # holds no block (process 0 writes such leaves), writes no file, and still records
    # every leaf, so the processes' plans agree
    mesh = mesh24()
    sd = {"w": cts.device_put(np.arange(32, dtype=np.float32).reshape(8, 4),
                              NamedSharding(mesh, P("data", "model"))),
          "h": np.ones(3, np.int32), "step": 7}
    p0 = _store.SavePlan(sd, snapshot=False, process_index=0)
    p1 = _store.SavePlan(sd, snapshot=True, process_index=1)
    assert p1.file == "arrays.p00001.safetensors" and not p1.spans_processes
    assert [len(blocks) for _, blocks in p1.arrays] == [0, 0]
    assert [len(blocks) for _, blocks in p0.arrays] == [8, 1]
    assert p0.signature() == p1.signature()
    d = tmp_path / "step"
    d.mkdir()
    _store.write_file(p1, str(d))
    assert os.listdir(d) == [] and p1.slices() == []
    _store.write_file(p0, str(d))
    assert os.listdir(d) == ["arrays.p00000.safetensors"]
    assert [pos for pos, _ in p0.slices()] == [0, 1]   # leaf positions of w and h
    _store.write_index(str(d), p0.leaves, {"step": 7})
    r = _store.restore_dir(str(d))
    assert np.array_equal(r["w"], np.arange(32, dtype=np.float32).reshape(8, 4))
    assert r["h"].tolist() == [1, 1, 1] and r["step"] == 7


def test_plan_signatures_differ_where_processes_would_disagree():
    a = _store.SavePlan({"w": np.zeros((2, 3), np.float32), "s": 1}, snapshot=False)
    same_but_value = _store.SavePlan({"w": np.ones((2, 3), np.float32), "s": 2},
                                     snapshot=False)
    other_shape = _store.SavePlan({"w": np.zeros((3, 2), np.float32), "s": 1}, snapshot=False)
    other_keys = _store.SavePlan({"v": np.zeros((2, 3), np.float32), "s": 1}, snapshot=False)
    assert a.signature() == same_but_value.signature()   # values are process 0's
    assert a.signature() != other_shape.signature()
    assert a.signature() != other_keys.signature()


def test_async_manager_raises_the_error_of_its_thread_once():
    m = ocp.AsyncManager()
    seen = []
    m.save_async(lambda: seen.append(threading.current_thread().name))
    m.wait_previous_save()
    assert seen == ["ctrainstate-ckpt"]

    def boom():
        raise OSError("disk full")
    m.save_async(boom)
    with pytest.raises(OSError, match="disk full"):
        m.wait_previous_save()
    m.wait_previous_save()   # once


def test_background_saves_run_in_the_order_they_were_started():
    # every process must issue the checkpoint channel's collectives in one order: a
    # background save waits for those started before it, whichever thread is faster
    out, gate = [], threading.Event()
    first = _procs.in_order(lambda: (gate.wait(10), out.append(1)))
    second = _procs.in_order(lambda: out.append(2))
    t2 = threading.Thread(target=second)
    t2.start()
    t1 = threading.Thread(target=first)
    t1.start()
    time.sleep(0.05)
    assert out == []   # the second waits for the first
    gate.set()
    t1.join(10)
    t2.join(10)
    assert out == [1, 2]


def _fake_job_of_two(monkeypatch, peer_error=None):
    """This process as process 0 of 2, the exchanges answered for a process 1 that
    passes the same tree (and fails its write with ``peer_error``); records each
    exchange's (kind, thread, channel)."""
    calls = []

    def exchange(obj, channel=_procs.MAIN):
        kind = ("prepare" if isinstance(obj, dict) and "signature" in obj
                else "commit" if isinstance(obj, dict) else "agree")
        calls.append((kind, threading.current_thread().name, channel))
        if kind == "prepare":
            return [obj, {"tmp": None, "error": None, "signature": obj["signature"]}]
        if kind == "commit":
            return [obj, {"error": peer_error, "slices": []}]
        return [obj, None]
    monkeypatch.setattr(_procs, "job", lambda: (0, 2))
    monkeypatch.setattr(_procs, "exchange", exchange)
    return calls


def test_a_save_of_several_processes_commits_in_the_background(tmp_path, monkeypatch):
    # async: save() returns after the snapshot, with no collective; directory, write,
    # gather, commit and agreement run in the background thread on the checkpoint channel
    calls = _fake_job_of_two(monkeypatch)
    release = threading.Event()
    real = _store.write_file

    def slow(plan, directory):
        assert release.wait(30)
        real(plan, directory)
    monkeypatch.setattr(_store, "write_file", slow)
    state = _small_state(1)
    opts = ocp.CheckpointManagerOptions(max_to_keep=1)
    with ocp.CheckpointManager(tmp_path, options=opts) as m:
        assert m.save(1, state)
        assert m.all_steps() == [1] and not os.path.isdir(tmp_path / "1")
        assert all(k == "prepare" for k, *_ in calls), calls   # nothing committed yet
        release.set()
        m.wait_until_finished()
        assert [k for k, *_ in calls] == ["prepare", "commit", "agree"]
        assert {(t, c) for _, t, c in calls} == {("ctrainstate-ckpt", _procs.CHECKPOINT)}
        assert m.all_steps() == [1] and os.path.isdir(tmp_path / "1")
        m.save(2, state)
        m.wait_until_finished()
        assert m.all_steps() == [2]   # retention by process 0, in the background too
    r = ocp.CheckpointManager(tmp_path).restore(2)
    assert_bit_exact(cts.device_get(state["params"]), r["params"])
    # a synchronous save runs in the caller's thread on the main channel
    calls.clear()
    sync = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path / "sync", options=sync) as m:
        m.save(1, state)
    assert {(t, c) for _, t, c in calls} == {(threading.current_thread().name, _procs.MAIN)}


def test_a_failed_process_in_a_background_commit_commits_nothing(tmp_path, monkeypatch):
    _fake_job_of_two(monkeypatch, peer_error="OSError: injected")
    with ocp.CheckpointManager(tmp_path) as m:
        assert m.save(1, _small_state(1))   # returns; the failure surfaces at the wait
        with pytest.raises(RuntimeError, match=r"process 1 failed: OSError: injected"):
            m.wait_until_finished()
        assert m.all_steps() == [] and os.listdir(tmp_path) == []
        m.check_for_errors()   # raised once


def test_one_process_save_needs_no_collective(tmp_path, monkeypatch):
    # without distributed.initialize(), a save runs in one thread and never reaches the
    # exchange between processes
    assert _procs.job() == (0, 1)
    monkeypatch.setattr(_procs, "exchange", lambda *a: pytest.fail("a collective"))
    with ocp.CheckpointManager(tmp_path) as m:
        m.save(1, {"a": np.arange(3)})
        m.wait_until_finished()
        m.delete(1)
        assert m.all_steps() == []


def test_prefetch_is_best_effort_and_stops_with_its_reader(tmp_path):
    """A missing or short file stops the read-ahead thread quietly (the reader's own reads
    raise), close joins it; a slice naming a file outside the checkpoint, or slices too
    small to be worth a thread, get no read-ahead; adjacent slices make one range."""
    if not _io.can_prefetch():
        pytest.skip("read-ahead needs Linux's sendfile")
    f = tmp_path / "data.bin"
    f.write_bytes(bytes(1 << 20))
    pre = _io.Prefetch([(str(tmp_path / "missing"), 0, 100), (str(f), 0, 1 << 20)])
    pre.close()
    assert not pre._thread.is_alive()
    pre = _io.Prefetch([(str(f), 0, 64 << 20)])   # the file ends early
    pre.advance(64 << 20)
    pre._thread.join(10)
    assert not pre._thread.is_alive()
    pre.close()
    reader = _store._Reader(str(tmp_path), _io.DEFAULT_CHECKSUM)
    big = 4 * _io.PREFETCH_CHUNK
    assert reader._prefetch([{"file": "../data.bin", "offsets": [0, big]}]) is None
    assert reader._prefetch([{"file": "data.bin", "offsets": [0, 100]}]) is None   # small
    pre = reader._prefetch([{"file": "data.bin", "offsets": [0, big // 2]},
                            {"file": "data.bin", "offsets": [big // 2, big]}])
    assert pre._ranges == [[str(tmp_path / "data.bin"), 0, big]]
    pre.close()
    reader.close()
