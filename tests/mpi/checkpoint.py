"""Checkpoints of a TrainState on a global mesh, saved and restored by several processes
(tests/distributed/test_distributed_mpi.py runs it), each process with 2 CPU devices:

    python tests/mpi/checkpoint.py save1 D1         # one process (4+ devices) saves D1
    mpirun -n N python tests/mpi/checkpoint.py main D D1
    python tests/mpi/checkpoint.py restore D        # one process (any devices) restores D
    mpirun -n M python tests/mpi/checkpoint.py restore D

``main`` saves the state (async, max_to_keep=2) on a (N, 2) mesh into D, writes the state's
values to D/known.npz (gathered), checks the index and the safetensors files
(``safetensors.numpy.load_file``), makes process N-1 fail mid-save (nothing is committed,
every process raises, the last checkpoint restores), commits in the background while the
main thread runs all-reduces (best_fn retention), restores D onto another mesh and spec,
and restores D1 (saved by one process) onto the global mesh. ``restore`` restores D onto
this job's devices in two layouts. Every restore is compared bit for bit with the known
values, into a target whose values differ. Each process prints "OK <process> <count>
<checks>" at the end (and writes it to a file in CT_TEST_OUT); any failure raises.
"""
import json
import os
import sys
import time

import numpy as np

from report import report

import ctrainstate as cts
from ctrainstate import Mesh, NamedSharding, P, optim
from ctrainstate import checkpoint as ocp
from ctrainstate.serialization import to_state_dict
from ctrainstate.train_state import TrainState

SHAPES = {"w1": (16, 8), "b": (8,), "w2": (8, 16), "scale": ()}
# on the (processes, 2) mesh: split across processes, within them, replicated on every
# device (b's replicas sit on every process: one copy is written)
SPECS_2D = {"w1": P("data", "model"), "b": P("model"), "w2": P(None, "data"), "scale": P()}
# another mesh and spec for the same arrays: one axis over every device
SPECS_1D = {"w1": P(None, "data"), "b": P("data"), "w2": P("data", None), "scale": P()}


def build_state(mesh, specs, seed):
    """A TrainState (adamw, one step applied) whose values depend on ``seed`` only."""
    rng = np.random.default_rng(seed)
    params = {k: cts.device_put(rng.standard_normal(s).astype(np.float32),
                                NamedSharding(mesh, specs[k])) for k, s in SHAPES.items()}
    state = TrainState.create(apply_fn=None, params=params, tx=optim.adamw(1e-2))
    grads = {k: v * 0.5 + 0.125 for k, v in params.items()}
    return state.apply_gradients(grads=grads)


def flat(sd, keys=()):
    if isinstance(sd, dict):
        out = {}
        for k, v in sd.items():
            out.update(flat(v, keys + (str(k),)))
        return out
    return {"/".join(keys): sd}


def host(x):
    if isinstance(x, cts.Array) and not x.is_fully_addressable:
        from ctrainstate.experimental import multihost_utils as mhu
        return mhu.process_allgather(x)
    return np.asarray(x)


def values(state):
    return {k: host(v) for k, v in flat(to_state_dict(state)).items()
            if isinstance(v, (cts.Array, np.ndarray))}


def check_equal(got: dict, known) -> int:
    assert sorted(got) == sorted(known.files), (sorted(got), known.files)
    for k, v in got.items():
        want = known[k]
        assert v.dtype == want.dtype and v.shape == want.shape, (k, v.dtype, v.shape)
        assert np.array_equal(v.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)), k
    return len(got)


def mesh_2d():
    return cts.make_mesh((cts.device_count() // 2, 2), ("data", "model"))


def mesh_1d():
    return Mesh(np.asarray(cts.devices())[::-1], ("data",))   # another device order too


def restore_onto(path, mesh, specs):
    """Restore the latest step of ``path`` onto ``mesh``; the values gathered, the state."""
    target = build_state(mesh, specs, seed=7)
    with ocp.CheckpointManager(path) as m:
        r = m.restore(m.latest_step(), args=ocp.args.StandardRestore(target))
    for k, v in r.params.items():
        assert v.sharding == NamedSharding(mesh, specs[k]), (k, v.sharding)
        assert {d for d, *_ in v._blocks} <= set(cts.local_devices()), k
    assert int(r.step) == 1
    return values(r)


def check_files(step_dir, known) -> int:
    """Every slice of the index read back with safetensors, each element exactly once."""
    from safetensors.numpy import load_file
    index = json.load(open(os.path.join(step_dir, "index.json")))
    files = {}
    checks = 0
    for e in index["leaves"]:
        if e["kind"] != "array":
            continue
        name = "/".join(e["keys"])
        seen = np.zeros(e["shape"], np.int32)
        for sl in e["slices"]:
            if sl["file"] not in files:
                files[sl["file"]] = load_file(os.path.join(step_dir, sl["file"]))
            box = tuple(slice(a, b) for a, b in sl["index"])
            got = files[sl["file"]][sl["tensor"]]
            want = known[name][box]
            assert got.dtype == want.dtype and np.array_equal(
                got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)), name
            seen[box] += 1
        assert (seen == 1).all(), (name, seen)   # each element once: replicas wrote nothing
        checks += 1
    return checks


def save1(path):
    state = build_state(mesh_2d(), SPECS_2D, seed=0)
    with ocp.CheckpointManager(path) as m:
        m.save(1, args=ocp.args.StandardSave(state))
    np.savez(os.path.join(path, "known.npz"), **values(state))
    print("SAVED1", cts.device_count())


def restore(path):
    me = 0
    if "OMPI_COMM_WORLD_SIZE" in os.environ:   # under mpirun
        from ctrainstate import distributed as dist
        dist.initialize(timeout=30)
        me = dist.process_index()
    known = np.load(os.path.join(path, "known.npz"))
    checks = 0
    for mesh, specs in ((mesh_2d(), SPECS_2D), (mesh_1d(), SPECS_1D)):
        checks += check_equal(restore_onto(path, mesh, specs), known)
    if cts.process_count() == 1:   # one device, and the files read with safetensors
        one = Mesh(np.asarray(cts.devices()[:1]).reshape(1, 1), ("data", "model"))
        checks += check_equal(restore_onto(path, one, SPECS_2D), known)
        with ocp.CheckpointManager(path) as m:
            checks += check_files(os.path.join(path, str(m.latest_step())), known)
    report(me, f"OK {me} {cts.process_count()} {checks}")


def main(path, path1):
    from ctrainstate import distributed as dist
    from ctrainstate._src.checkpoint import store as _store
    dist.initialize(timeout=30)
    me, n = dist.process_index(), dist.process_count()
    mesh = mesh_2d()
    state = build_state(mesh, SPECS_2D, seed=0)
    assert not state.params["w1"].is_fully_addressable
    known_values = values(state)
    checks = 0
    opts = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(path, options=opts) as m:
        for step in (1, 2, 3):
            assert m.save(step, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
        assert m.all_steps() == [2, 3] and m.latest_step() == 3, m.all_steps()
    if me == 0:
        np.savez(os.path.join(path, "known.npz"), **known_values)
    dist.barrier()
    known = np.load(os.path.join(path, "known.npz"))
    names = sorted(os.listdir(path))
    assert names == ["2", "3", "known.npz"], names
    files = sorted(f for f in os.listdir(os.path.join(path, "3")) if f.endswith(".safetensors"))
    # w1 and w2 have blocks on every process; b and scale only process 0's copy
    assert files == [f"arrays.p{p:05d}.safetensors" for p in range(n)], files
    if me == 0:
        checks += check_files(os.path.join(path, "3"), known)
    checks += 1
    dist.barrier()   # every process has listed the directory before the next save

    # a process that fails mid-save: every process raises, nothing is committed
    real = _store.write_file
    if me == n - 1:
        def failing(plan, directory):
            real(plan, directory)
            raise OSError("injected failure after writing")
        _store.write_file = failing
    with ocp.CheckpointManager(path, options=opts) as m:
        m.save(4, args=ocp.args.StandardSave(state))
        try:
            m.wait_until_finished()
        except RuntimeError as e:
            assert f"process {n - 1} failed" in str(e) and "injected" in str(e), e
            assert "nothing committed" in str(e), e
        else:
            raise AssertionError("a failed save did not raise")
        _store.write_file = real
        dist.barrier()
        assert m.all_steps() == [2, 3], m.all_steps()
        assert sorted(os.listdir(path)) == ["2", "3", "known.npz"], os.listdir(path)
        checks += 1
        dist.barrier()
        # the manager still works: the next save commits
        assert m.save(5, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
        assert m.all_steps() == [3, 5], m.all_steps()
        m.delete(5)
        assert m.all_steps() == [3], m.all_steps()
    # the commit runs in the background: process n-1 writes only once its save() has
    # returned (a save that waited for its write would time out), the training loop's
    # all-reduces go on, and the step appears with no call of ours; best_fn retention by
    # process 0, the same best_step() on every process
    import threading
    slow_write, gate = _store.write_file, threading.Event()
    if me == n - 1:
        def gated(plan, directory):
            assert gate.wait(10), "save() waited for its write"
            slow_write(plan, directory)
        _store.write_file = gated
    best = os.path.join(path, "best")
    opts = ocp.CheckpointManagerOptions(max_to_keep=2, best_fn=lambda m: m["acc"])
    with ocp.CheckpointManager(best, options=opts) as m:
        for step, acc in ((1, 0.5), (2, 0.1), (3, 0.9)):
            gate.clear()
            assert m.save(step, args=ocp.args.StandardSave(state), metrics={"acc": acc})
            gate.set()
            deadline = time.time() + 20
            while True:   # the loop's collectives: every process stops once all see the step
                got = dist.allreduce(np.full(4, me + step, np.float32))
                assert (got == sum(p + step for p in range(n))).all(), got
                seen = os.path.isdir(os.path.join(best, str(step)))
                if dist.allreduce(np.array([seen], np.int32), op="min")[0]:
                    break
                assert time.time() < deadline, f"step {step} was not committed in the background"
                time.sleep(0.01)
        m.wait_until_finished()
        assert m.all_steps() == [1, 3] and m.best_step() == 3, (m.all_steps(), m.best_step())
    _store.write_file = slow_write
    dist.barrier()
    with ocp.CheckpointManager(best, options=opts) as m:   # the metrics are on disk
        assert m.best_step() == 3
    checks += 1
    checks += check_equal(restore_onto(path, mesh_1d(), SPECS_1D), known)   # another spec
    checks += check_equal(restore_onto(path, mesh, SPECS_2D), known)
    # the other front ends: flax's save_checkpoint (with an AsyncManager), orbax's
    # StandardCheckpointer, t5x's Checkpointer
    target = build_state(mesh, SPECS_2D, seed=7)
    flax_dir = os.path.join(path, "flax")
    am = ocp.AsyncManager()
    for step in (1, 2):
        ocp.save_checkpoint(flax_dir, state, step, keep=1, async_manager=am)
    am.wait_previous_save()
    assert ocp.available_steps(flax_dir) == [2], ocp.available_steps(flax_dir)
    checks += check_equal(values(ocp.restore_checkpoint(flax_dir, target)), known)
    single = os.path.join(path, "single")
    ocp.StandardCheckpointer().save(single, state)
    checks += check_equal(values(ocp.StandardCheckpointer().restore(single, target)), known)
    # saved by one process, restored by every process onto the global mesh
    known1 = np.load(os.path.join(path1, "known.npz"))
    checks += check_equal(restore_onto(path1, mesh, SPECS_2D), known1)
    # shutdown() with a background save in flight commits it before MPI goes
    def slowed(plan, directory):
        time.sleep(0.3)
        slow_write(plan, directory)
    _store.write_file = slowed
    late = ocp.CheckpointManager(os.path.join(path, "late"))
    late.save(5, args=ocp.args.StandardSave(state))
    dist.shutdown()
    _store.write_file = slow_write
    assert ocp.available_steps(os.path.join(path, "late"), "") == [5]
    checks += 1
    report(me, f"OK {me} {n} {checks}")


def die(path):
    """Steps 1 and 2 saved, then process N-1 dies (os._exit) while it writes step 3: mpirun
    ends the job. The test then finds steps 1 and 2 only, and restores step 2."""
    from ctrainstate import distributed as dist
    from ctrainstate._src.checkpoint import store as _store
    dist.initialize(timeout=30)
    me, n = dist.process_index(), dist.process_count()
    state = build_state(mesh_2d(), SPECS_2D, seed=0)
    known_values = values(state)
    with ocp.CheckpointManager(path) as m:
        for step in (1, 2):
            m.save(step, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
        if me == 0:
            np.savez(os.path.join(path, "known.npz"), **known_values)
        dist.barrier()
        if me == n - 1:
            real = _store.write_file

            def dying(plan, directory):
                real(plan, directory)
                os._exit(3)
            _store.write_file = dying
        m.save(3, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
    report(me, f"SAVED {me} (process {n - 1} should have died)")


if __name__ == "__main__":
    {"save1": save1, "restore": restore, "main": main, "die": die}[sys.argv[1]](*sys.argv[2:])
