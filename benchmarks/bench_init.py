"""Sharded-init throughput: ctrainstate.random normal/uniform vs numpy, vs copy bandwidth.

    CTRAINSTATE_NUM_CPU_DEVICES=8 PYTHONPATH=python python3 benchmarks/bench_init.py [--n 2**25]

Prints elements/s and GB/s written for float32 normal and uniform (host and sharded
over all devices), numpy's Generator (standard_normal / random with out=), and the
copy bandwidth (np.copyto of the same size) measured in the same run, with ratios.

The "(host)" and "(N devices)" rows are what a user gets: a fresh output each call,
so its page faults are included (numpy asks for transparent huge pages on large
arrays; the CPU backend's shard buffers fault in 4 KiB pages). The "generation
only" rows fill an existing array (pages already mapped), like numpy's out= rows:
the cost of the PRNG itself.
"""
import argparse
import time

import numpy as np

import ctrainstate as cts
from ctrainstate import _C, _dtypes
from ctrainstate import random as R


def best(f, reps):
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        t.append(time.perf_counter() - t0)
    return min(t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=lambda s: int(eval(s)), default=2 ** 25)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    n, reps = a.n, a.reps
    key = R.PRNGKey(0)
    out = np.empty(n, np.float32)
    src = np.ones(n, np.float32)
    rng = np.random.default_rng(0)
    t_copy = best(lambda: np.copyto(out, src), reps)
    copy_gbs = n * 4 / t_copy / 1e9  # bytes written
    ndev = cts.device_count()
    mesh = cts.make_mesh((ndev,), ("x",))
    sh = cts.NamedSharding(mesh, cts.P("x"))
    k0, k1 = (int(w) for w in np.asarray(key, np.uint32))
    f32 = _dtypes.code(np.float32)

    def fill(dist):  # dist 0 uniform [0, 1), 1 normal; same kernel as R.uniform / R.normal
        return lambda: _C.random_fill(out, k0, k1, (n,), (0,), dist, f32, 0.0, 1.0, 0.0, 0.0,
                                      0.0, None)

    rows = [
        ("numpy standard_normal(out=)", lambda: rng.standard_normal(dtype=np.float32, out=out)),
        ("numpy random(out=)", lambda: rng.random(dtype=np.float32, out=out)),
        ("ctrainstate normal (host)", lambda: R.normal(key, (n,))),
        ("ctrainstate uniform (host)", lambda: R.uniform(key, (n,))),
        (f"ctrainstate normal ({ndev} devices)", lambda: R.normal(key, (n,), out_sharding=sh)),
        (f"ctrainstate uniform ({ndev} devices)", lambda: R.uniform(key, (n,), out_sharding=sh)),
        ("ctrainstate normal (generation only)", fill(1)),
        ("ctrainstate uniform (generation only)", fill(0)),
    ]
    print(f"n = {n} float32 elements ({n * 4 / 2**20:.0f} MiB); copy bandwidth "
          f"(np.copyto, bytes written) {copy_gbs:.2f} GB/s")
    print(f"{'kernel':38s} {'Melem/s':>9s} {'GB/s':>7s} {'vs copy':>8s} {'vs numpy':>9s}")
    times = {}
    for name, f in rows:
        f()  # warm up (page faults of a fresh output are part of every real init, kept)
        times[name] = best(f, reps)
    for name, _ in rows:
        t = times[name]
        peer = "numpy standard_normal(out=)" if "normal" in name else "numpy random(out=)"
        print(f"{name:38s} {n / t / 1e6:9.1f} {n * 4 / t / 1e9:7.2f} {n * 4 / t / 1e9 / copy_gbs:8.2f}"
              f" {times[peer] / t:9.2f}")


if __name__ == "__main__":
    main()
