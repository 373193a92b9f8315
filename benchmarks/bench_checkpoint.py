"""Checkpoint save / restore of sharded state against the disk's bandwidth, measured in the
same run.

    CTRAINSTATE_NUM_CPU_DEVICES=8 PYTHONPATH=python python3 benchmarks/bench_checkpoint.py \
        [--gib 1] [--dir /path/on/the/disk] [--reps 5]

The state: four float32 arrays of gib/4 each, sharded over a (2, 4) mesh of CPU devices
with four layouts (P('data','model'), P('model','data'), P(('data','model')),
P(None, ('data','model'))), so every array has 8 unique blocks.

Peers, on the same disk and in the same run:

* write: the state's bytes from one host buffer to one file with os.write in 64 MiB
  pieces, then fsync — the disk's sequential write bandwidth with fsync;
* read: the same file, dropped from the page cache (posix_fadvise DONTNEED after the
  fsync), read with preadv in 64 MiB pieces into a host buffer allocated and touched
  beforehand — the sequential read bandwidth; and into a new buffer, its allocation timed
  too, as a restore's is (new arrays); and in pieces of one slice (SLICE_BYTES, 4 MiB), the
  size a restore reads at a time, nothing else done — what the request size alone costs
  on this disk (the kernel reads ahead less for smaller requests).

ctrainstate:

* save: ``CheckpointManager.save`` with async off (each slice written from its device
  buffer with its XXH3-64 checksum, fsync of the file, index and directories, rename);
* restore: ``CheckpointManager.restore`` onto the same shardings and onto an (8,) mesh with
  other specs, after dropping the checkpoint's files from the page cache;
* peak extra host memory of a save and of a restore: the peak of what Python and numpy
  allocate (tracemalloc, in separate untimed runs): scratch buffers, snapshots, the index;
  device buffers (on CPU devices, host memory too) hold the state itself and are not counted;
* an async save: how long ``save`` blocks the caller, against a bare device-to-host copy of
  every block (np.empty + _C.copy_to_host), the snapshot it needs, timed alternately.

Times are the best of --reps (a fresh checkpoint directory each), and the ratios are of
those best times. Each rep also gives its own ratios (a peer and the ctrainstate step of the
same rep, a second or so apart, meet about the same load from other processes); their
median is printed beside, as a check on a busy machine. The checkpoint I/O uses
CTRAINSTATE_CHECKPOINT_THREADS threads (default 1); a restore checks what it reads on one
more thread.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time
import tracemalloc

os.environ.setdefault("CTRAINSTATE_NUM_CPU_DEVICES", "8")

import numpy as np  # noqa: E402

import ctrainstate as cts  # noqa: E402
from ctrainstate import NamedSharding, P, _C  # noqa: E402
from ctrainstate import checkpoint as ocp  # noqa: E402
from ctrainstate._src.checkpoint.fileio import SLICE_BYTES  # noqa: E402

MiB = 1 << 20


def drop_cache(path):
    """Drop a file's (clean, fsync'd) pages from the page cache."""
    paths = [path] if os.path.isfile(path) else [
        os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_write(path, buf):
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    mv = memoryview(buf).cast("B")
    for off in range(0, len(mv), 64 * MiB):
        piece = mv[off:off + 64 * MiB]
        done = 0
        while done < len(piece):
            done += os.write(fd, piece[done:])
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t


def disk_read(path, out, piece=64 * MiB):
    """Seconds to read the file into ``out`` (allocated and touched beforehand, so only the
    read is timed), or with ``out=None`` into a new buffer (its allocation timed too), in
    preads of ``piece`` bytes."""
    drop_cache(path)
    nbytes = os.path.getsize(path)
    t = time.perf_counter()
    if out is None:
        out = np.empty(nbytes, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    mv = memoryview(out)
    off = 0
    while off < nbytes:
        off += os.preadv(fd, [mv[off:off + piece]], off)
    os.close(fd)
    return time.perf_counter() - t


def make_state(gib):
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    n = int(gib * (1 << 30) / 4 / 4)          # elements per array
    side = int(np.sqrt(n)) // 64 * 64
    specs = [P("data", "model"), P("model", "data"), P(("data", "model")),
             P(None, ("data", "model"))]
    state = {}
    for i, spec in enumerate(specs):
        s = NamedSharding(mesh, spec)
        # filled block by block (no full host copy), values random so nothing compresses
        state[f"w{i}"] = cts.random.uniform(cts.random.PRNGKey(i), (side, side), np.float32,
                                            out_sharding=s)
    state["step"] = 7
    return state


def snapshot_copy(state):
    out = []
    for a in state.values():
        if isinstance(a, cts.Array):
            for dev, buf, start, rid in a._blocks:
                if rid == 0:
                    h = np.empty(a._shard_shape, a.dtype)
                    _C.copy_to_host(buf, h, (0,) * a.ndim)
                    out.append(h)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--dir", default=None, help="a directory on the disk to measure "
                    "(default: a temporary directory under the current one)")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=a.dir or os.getcwd())
    try:
        run(a, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(a, root):
    state = make_state(a.gib)
    arrays = [v for v in state.values() if isinstance(v, cts.Array)]
    nbytes = sum(x.nbytes for x in arrays)
    shard = max(x.nbytes // 8 for x in arrays)
    print(f"state: {len(arrays)} float32 arrays, {nbytes / (1 << 30):.2f} GiB on "
          f"{cts.device_count()} CPU devices, largest shard {shard / MiB:.0f} MiB; "
          f"disk {root}")

    host = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    into = np.ones(nbytes, np.uint8)
    raw = os.path.join(root, "raw.bin")
    t_w, t_r, t_rn, t_rs = [], [], [], []

    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    t_save, t_rest, t_resh = [], [], []
    mesh8 = cts.make_mesh((8,), ("x",))
    other = {k: cts.ShapeDtypeStruct(v.shape, v.dtype, NamedSharding(
        mesh8, P("x", None) if i % 2 else P(None, "x")))
        for i, (k, v) in enumerate(state.items()) if isinstance(v, cts.Array)}
    other["step"] = 0
    same = {k: (cts.ShapeDtypeStruct(v.shape, v.dtype, v.sharding)
                if isinstance(v, cts.Array) else 0) for k, v in state.items()}
    # peers and ctrainstate alternate, rep by rep, so both meet the same load on the machine
    for rep in range(a.reps):
        t_w.append(disk_write(raw, host))
        t_r.append(disk_read(raw, into))
        t_rn.append(disk_read(raw, None))
        t_rs.append(disk_read(raw, into, SLICE_BYTES))
        os.remove(raw)
        d = os.path.join(root, f"m{rep}")
        m = ocp.CheckpointManager(d, options=opts)
        t = time.perf_counter()
        m.save(1, state)
        t_save.append(time.perf_counter() - t)
        for target, times in ((same, t_rest), (other, t_resh)):
            drop_cache(os.path.join(d, "1"))
            t = time.perf_counter()
            r = m.restore(1, target)
            times.append(time.perf_counter() - t)
            if target is same:   # bit-exact, block by block
                for k, x in state.items():
                    if isinstance(x, cts.Array):
                        for s0, s1 in zip(x.addressable_shards, r[k].addressable_shards):
                            assert s0.data.tobytes() == s1.data.tobytes(), k
            del r
        shutil.rmtree(d)
    # each rep's own ratios: the peer against the ctrainstate step of the same rep
    paired = {"save": np.median([w / s for w, s in zip(t_w, t_save)]),
              "same": np.median([r / x for r, x in zip(t_r, t_rest)]),
              "other": np.median([r / x for r, x in zip(t_r, t_resh)])}
    t_w, t_r, t_rn, t_rs = min(t_w), min(t_r), min(t_rn), min(t_rs)
    del host, into
    # peak extra host memory, in untimed passes: what Python and numpy allocate (scratch
    # buffers, snapshots, the index), which tracemalloc follows; device buffers (the state
    # and the restored arrays) are allocated by the C backend and not counted
    d = os.path.join(root, "mem")
    m = ocp.CheckpointManager(d, options=opts)
    peak_save = [traced_peak(lambda: m.save(1, state))]
    peak_rest = [traced_peak(lambda: m.restore(1, same))]
    peak_resh = [traced_peak(lambda: m.restore(1, other))]
    shutil.rmtree(d)
    # onto other shardings: one array compared in full
    m = ocp.CheckpointManager(os.path.join(root, "check"), options=opts)
    m.save(1, {"w0": state["w0"]})
    assert np.asarray(m.restore(1, {"w0": other["w0"]})["w0"]).tobytes() == \
        np.asarray(state["w0"]).tobytes()
    shutil.rmtree(os.path.join(root, "check"))

    # async: the time save() blocks, against the bare device-to-host copy (interleaved, so
    # both meet the same machine load and allocator state)
    t_copy, t_block = [], []
    for rep in range(a.reps + 1):
        t_copy.append(_time(lambda: snapshot_copy(state)))
        d = os.path.join(root, f"a{rep}")
        m = ocp.CheckpointManager(d)
        t = time.perf_counter()
        m.save(1, state)
        t_block.append(time.perf_counter() - t)
        m.wait_until_finished()
        shutil.rmtree(d)
    t_copy, t_block = min(t_copy), min(t_block)

    gb = nbytes / 1e9
    rows = [
        ("disk write + fsync (peer)", t_w, gb / t_w, ""),
        ("save (sync)", min(t_save), gb / min(t_save),
         f"{t_w / min(t_save):.2f}x write (reps' median {paired['save']:.2f}x)"),
        ("disk read, cold (peer)", t_r, gb / t_r, ""),
        ("disk read, cold, into new memory", t_rn, gb / t_rn, ""),
        ("disk read, cold, 4 MiB preads", t_rs, gb / t_rs, f"{t_r / t_rs:.2f}x read"),
        ("restore, same shardings", min(t_rest), gb / min(t_rest),
         f"{t_r / min(t_rest):.2f}x read ({t_rn / min(t_rest):.2f}x into new memory; "
         f"reps' median {paired['same']:.2f}x read)"),
        ("restore onto (8,), other specs", min(t_resh), gb / min(t_resh),
         f"{t_r / min(t_resh):.2f}x read ({t_rn / min(t_resh):.2f}x into new memory; "
         f"reps' median {paired['other']:.2f}x read)"),
    ]
    print(f"\n{'':34s} {'seconds':>8s} {'GB/s':>7s}  ratio")
    for name, t, bw, ratio in rows:
        print(f"{name:34s} {t:8.3f} {bw:7.2f}  {ratio}")
    budget = shard + 64 * MiB
    print(f"\npeak extra host memory: save {max(peak_save) / MiB:.1f} MiB, restore "
          f"{max(peak_rest) / MiB:.1f} MiB, restore onto (8,) {max(peak_resh) / MiB:.1f} MiB "
          f"(budget: largest shard + 64 MiB = {budget / MiB:.0f} MiB)")
    print(f"async save: save() blocked {t_block * 1e3:.1f} ms; device-to-host copy of every "
          f"block {t_copy * 1e3:.1f} ms ({t_block / t_copy:.2f}x the copy)")


def traced_peak(f):
    tracemalloc.start()
    try:
        f()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _time(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


if __name__ == "__main__":
    sys.exit(main())
