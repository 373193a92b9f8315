"""Run under mpirun (tests/distributed/test_distributed_mpi.py): every host collective of
ctrainstate.distributed and every function of experimental.multihost_utils, checked against
numpy on values every process can compute for every other process (process p's input is a
function of p). Prints "OK <process> <count>" at the end; any failure raises (non-zero exit).

    mpirun -n 2 python tests/mpi/collectives.py
"""
import os
import sys

import ml_dtypes
import numpy as np

from report import report

import ctrainstate as cts
from ctrainstate import _C
from ctrainstate import distributed as dist
from ctrainstate.experimental import multihost_utils as mhu

dist.initialize(timeout=60)
me, n = dist.process_index(), dist.process_count()
assert (me, n) == (int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"]))
assert dist.is_initialized()
info = _C.dist_info()
assert info["initialized"] and info["owns_mpi"] and info["thread_level"] >= 2, info
assert "Open MPI" in info["version"], info

BF16 = np.dtype(ml_dtypes.bfloat16)
REDUCIBLE = [np.float32, np.float64, np.int32, np.int64, np.uint32, np.uint64, np.float16, BF16]
NUMPY_OP = {"sum": np.sum, "max": np.max, "min": np.min}


def data(p, count, dtype, salt=0):
    """Process p's input: small integers (exact in every dtype, sums of 4 included, so the
    expected values do not depend on MPI's reduction order)."""
    rng = np.random.default_rng(1000 * salt + p)
    lo = 0 if np.dtype(dtype).kind == "u" else -60
    return rng.integers(lo, 60, size=count).astype(dtype)


def expect(op, count, dtype, salt=0):
    stack = np.stack([data(p, count, dtype, salt).astype(np.float64) for p in range(n)])
    return NUMPY_OP[op](stack, axis=0).astype(dtype)


def check(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape,
                                                                 want.dtype, want.shape)
    if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
        bad = np.flatnonzero(got != want)[:5]
        raise AssertionError(f"{what}: process {me}: differs at {bad}: {got[bad]} != {want[bad]}")


checked = 0
# allreduce: every dtype and op, sizes from empty to past Open MPI's small-message algorithms
for salt, (dtype, count) in enumerate([(t, c) for t in REDUCIBLE for c in (0, 1, 7, 1000)]
                                      + [(np.float32, 1 << 20), (BF16, 300_000)]):
    for op in ("sum", "max", "min"):
        got = dist.allreduce(data(me, count, dtype, salt), op)
        check(got, expect(op, count, dtype, salt), f"allreduce {op} {np.dtype(dtype).name}[{count}]")
        checked += 1

# allreduce of real-valued float32 / float64 (the order of the additions may differ from
# numpy's: close, not equal), a 2-d shape, and in place through the binding
x = np.random.default_rng(me).standard_normal((64, 33))
want = sum(np.random.default_rng(p).standard_normal((64, 33)) for p in range(n))
np.testing.assert_allclose(dist.allreduce(x), want, rtol=1e-12, atol=1e-12)
np.testing.assert_allclose(dist.allreduce(x.astype(np.float32)), want.astype(np.float32),
                           rtol=1e-5, atol=1e-5)
y = data(me, 500, np.int64, 7)
_C.dist_allreduce(y, y, "sum", 60.0)
check(y, expect("sum", 500, np.int64, 7), "allreduce in place")
checked += 3

# float16 / bfloat16 sums are float32 sums rounded once: 1 + (n - 1) * 2**-8 in bfloat16 is
# 1.015625 for n = 4 (float32 sum 1.01171875, rounded to even), where additions rounded to
# bfloat16 one at a time would give 1.0 or 1.0078125
mine = np.full(3, 1.0 if me == 0 else 2.0 ** -8, BF16)
want = np.full(3, np.float32(1 + (n - 1) * 2.0 ** -8), np.float32).astype(BF16)
check(dist.allreduce(mine), want, "bfloat16 sum rounded once")
mine = np.full(3, 1.0 if me == 0 else 2.0 ** -11, np.float16)
want = np.full(3, np.float32(1 + (n - 1) * 2.0 ** -11), np.float32).astype(np.float16)
check(dist.allreduce(mine), want, "float16 sum rounded once")
checked += 2

# allgather: any dtype of 1, 2, 4, 8 or 16 bytes, stacked along a new axis 0
for salt, dtype in enumerate([np.float32, np.float64, np.int32, np.int64, np.uint8, np.int8,
                              np.bool_, np.float16, BF16, np.complex128, np.uint16]):
    for shape in ((), (0,), (5,), (3, 4)):
        mine = (data(me, int(np.prod(shape)), np.int64, salt) % 50).astype(dtype).reshape(shape)
        got = dist.allgather(mine)
        want = np.stack([(data(p, int(np.prod(shape)), np.int64, salt) % 50).astype(dtype)
                         .reshape(shape) for p in range(n)])
        check(got, want, f"allgather {np.dtype(dtype).name}{shape}")
        checked += 1

# reduce_scatter: this process gets block `me` of the reduction along axis 0
for salt, dtype in enumerate(REDUCIBLE):
    for op in ("sum", "max", "min"):
        rows = 3
        full = [data(p, n * rows * 5, dtype, salt).reshape(n * rows, 5) for p in range(n)]
        got = dist.reduce_scatter(full[me], op)
        want = expect(op, n * rows * 5, dtype, salt).reshape(n * rows, 5)[me * rows:(me + 1) * rows]
        check(got, want, f"reduce_scatter {op} {np.dtype(dtype).name}")
        checked += 1

# broadcast from every root, in several dtypes; x of the other processes is not changed
for root in range(n):
    for salt, dtype in enumerate([np.float32, np.int64, BF16, np.bool_, np.complex128]):
        mine = (data(me, 12, np.int64, salt) % 7).astype(dtype).reshape(3, 4)
        before = mine.copy()
        got = dist.broadcast(mine, root)
        check(got, (data(root, 12, np.int64, salt) % 7).astype(dtype).reshape(3, 4),
              f"broadcast root {root} {np.dtype(dtype).name}")
        check(mine, before, "broadcast leaves its argument")
        checked += 1
dist.barrier()

# checks that raise on this process before any message is sent
for call, err in [(lambda: _C.dist_allgather(np.zeros(3), np.zeros(3 * n + 1), 5.0), ValueError),
                  (lambda: dist.reduce_scatter(np.zeros(n * 2 + 1)), ValueError),
                  (lambda: dist.broadcast(np.zeros(2), n), ValueError),
                  (lambda: dist.allreduce(np.zeros(2, bool)), TypeError),
                  (lambda: dist.allreduce(np.zeros(2), "prod"), ValueError),
                  (lambda: dist.allreduce(np.zeros(2), timeout=0), ValueError)]:
    try:
        call()
    except err:
        checked += 1
    else:
        raise AssertionError(f"no {err.__name__}")

# multihost_utils: a pytree of numpy data, scalars and an Array sharded over this process's
# two CPU devices
mesh = cts.sharding.Mesh(np.array(cts.local_devices()), ("x",))
arr = cts.device_put(np.arange(8, dtype=np.float32) + 10 * me,
                     cts.sharding.NamedSharding(mesh, cts.sharding.PartitionSpec("x")))
tree = {"a": np.full((2, 3), me, np.int32), "b": [np.float32(me + 0.5), arr],
        "c": np.full(3, me, BF16)}
got = mhu.process_allgather(tree)
check(got["a"], np.stack([np.full((2, 3), p, np.int32) for p in range(n)]), "process_allgather a")
check(got["b"][0], np.arange(n, dtype=np.float32) + 0.5, "process_allgather scalar")
check(got["b"][1], np.stack([np.arange(8, dtype=np.float32) + 10 * p for p in range(n)]),
      "process_allgather Array")
check(got["c"], np.stack([np.full(3, p, BF16) for p in range(n)]), "process_allgather bfloat16")
tiled = mhu.process_allgather(tree["a"], tiled=True)
check(tiled, np.concatenate([np.full((2, 3), p, np.int32) for p in range(n)]), "tiled")
got = mhu.broadcast_one_to_all({"w": np.full(4, me, np.float64), "s": me})
check(got["w"], np.zeros(4), "broadcast_one_to_all")
got = mhu.broadcast_one_to_all(np.full(2, me, np.int32), is_source=me == n - 1)
check(got, np.full(2, n - 1, np.int32), "broadcast_one_to_all is_source")
mhu.sync_global_devices("step 1")
mhu.assert_equal({"k": np.arange(3)})
checked += 9

# differences between processes raise on every process (the processes stay matched)
for call, text in [(lambda: mhu.process_allgather(np.zeros(me + 1)), "shapes or dtypes differ"),
                   (lambda: mhu.sync_global_devices(f"name {me}"), "name mismatch"),
                   (lambda: mhu.broadcast_one_to_all(np.zeros(2), is_source=True),
                    "exactly one process")]:
    try:
        call()
    except (AssertionError, ValueError) as e:
        assert text in str(e), e
        checked += 1
    else:
        raise AssertionError(f"no error for {text}")
try:
    mhu.assert_equal(np.array([me]))
except AssertionError:
    assert me != 0
else:
    assert me == 0
mhu.sync_global_devices("end")

dist.shutdown()
assert not dist.is_initialized() and dist.process_count() == 1
try:
    dist.initialize(timeout=5)
except RuntimeError as e:
    assert "cannot be initialized twice" in str(e), e
else:
    raise AssertionError("initialize after shutdown")
report(me, f"OK {me} {n} {checked}")
sys.exit(0)
