"""How long ``CheckpointManager.save`` blocks the training loop in a job of several processes
(async saves, the default), while the loop runs its own collectives between saves.

    mpirun -n 2 python benchmarks/bench_checkpoint_mpi.py [--mib 64] [--saves 6] [--train 0.6]

(as root: mpirun --allow-run-as-root; more processes than cores: --oversubscribe)

Each process holds --mib MiB of a TrainState's arrays (params and adam moments) on a
(processes, 2) global mesh. Every iteration saves a step (max_to_keep=2, so old steps are
deleted too), then "trains" for about --train seconds: 1 MiB all-reduces on the main thread,
10 ms apart. Printed: the slowest process's median and largest time inside
``save()`` (the first save is left out: nothing is in flight then), the time
``wait_until_finished()`` takes at the end, and the all-reduces' median time while a
checkpoint is being written and committed. No peer: the figure to compare is the same
script at another commit.
"""
import argparse
import os
import shutil
import tempfile
import time

import numpy as np

import ctrainstate as cts
from ctrainstate import NamedSharding, P, checkpoint as ocp, distributed as dist, optim
from ctrainstate.train_state import TrainState


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64, help="MiB of state a process holds")
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--train", type=float, default=0.6, help="seconds between saves")
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    a = ap.parse_args()
    dist.initialize()
    me, n = dist.process_index(), dist.process_count()
    mesh = cts.make_mesh((n, cts.device_count() // n), ("data", "model"))
    # params + two adam moments = 3 arrays of rows x 1024 float32 per process
    rows = max(1, a.mib * (1 << 20) // (3 * 4 * 1024)) * n
    rows -= rows % (2 * n)
    w = np.ones((rows, 1024), np.float32)
    params = {"w": cts.device_put(w, NamedSharding(mesh, P("data", "model")))}
    state = TrainState.create(apply_fn=None, params=params, tx=optim.adam(1e-3))
    root = a.dir or (tempfile.mkdtemp() if me == 0 else None)
    root = bytes(dist.broadcast(np.frombuffer(
        (root or "").encode().ljust(4096, b"\0"), np.uint8))).rstrip(b"\0").decode()
    d = os.path.join(root, "ckpt")
    x = np.ones(1 << 18, np.float32)
    save_s, reduce_s = [], []
    with ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(max_to_keep=2)) as m:
        for step in range(1, a.saves + 1):
            dist.barrier()
            t0 = time.perf_counter()
            m.save(step, args=ocp.args.StandardSave(state))
            save_s.append(time.perf_counter() - t0)
            for _ in range(int(a.train / 0.01)):   # the training loop's collectives (as
                t = time.perf_counter()              # many on every process)
                dist.allreduce(x)
                reduce_s.append(time.perf_counter() - t)
                time.sleep(0.01)
        t0 = time.perf_counter()
        m.wait_until_finished()
        wait_s = time.perf_counter() - t0
        steps = m.all_steps()
    got = dist.allgather(np.array([np.median(save_s[1:]), max(save_s[1:]), wait_s,
                                   np.median(reduce_s)]))
    if me == 0:
        worst = got.max(axis=0)
        print(f"{n} processes, {a.mib} MiB of state each, {a.saves} saves, steps kept {steps}")
        print(f"save() median {worst[0] * 1e3:8.1f} ms   max {worst[1] * 1e3:8.1f} ms")
        print(f"wait_until_finished() {worst[2] * 1e3:8.1f} ms")
        print(f"allreduce 1 MiB median {worst[3] * 1e3:8.3f} ms")
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    dist.shutdown()


if __name__ == "__main__":
    main()
