"""Run under mpirun (tests/distributed/test_distributed_mpi.py): the engine's reductions on
real-valued data, bit for bit against numpy adding the processes' buffers in process order,
((x_0 op x_1) op x_2) ..., in each path of csrc/process/ct_dist.c: the small all-reduce
(<= 64 KiB: gather, then reduce locally), the large one (reduce-scatter, then all-gather),
reduce-scatter, each in place and not, float32 / float64 / integers / float16 / bfloat16,
NaN through max and min, and sizes that grow and shrink from one call to the next (the
receive buffer the engine keeps between collectives). Prints "OK <process> <count>
<checks>"; any failure raises (non-zero exit).

    mpirun -n 3 python tests/mpi/reductions.py
"""
import sys

import ml_dtypes
import numpy as np

from report import report

from ctrainstate import _C
from ctrainstate import distributed as dist

dist.initialize(timeout=60)
me, n = dist.process_index(), dist.process_count()
BF16 = np.dtype(ml_dtypes.bfloat16)


SCALES = 10.0 ** np.arange(-3, 4)   # 10^-3 .. 10^3, looked up instead of a power per element
_drawn = {}


def data(p, count, dtype, salt):
    """Process p's input: normal floats (sums round, so the order shows) with a few NaNs and
    infinities, or integers that overflow when added (sums wrap). A new copy on every call
    (the in-place all-reduce overwrites its input) of the values drawn once per case: each
    process draws every process's input for the expected result, and its own again."""
    key = (p, count, np.dtype(dtype).str, salt)
    if key not in _drawn:
        if any(k[3] != salt for k in _drawn):   # a new case: the last one's are done with
            _drawn.clear()
        rng = np.random.default_rng(7919 * salt + p)
        if np.dtype(dtype).kind in "iu":
            info = np.iinfo(dtype)
            x = rng.integers(info.min, info.max, size=count, dtype=dtype, endpoint=True)
        else:
            x = rng.standard_normal(count) * SCALES[rng.integers(-3, 4, size=count) + 3]
            if count > 10:
                x[rng.integers(0, count, 3)] = np.nan
                x[rng.integers(0, count, 2)] = np.inf * (1 - 2 * (p % 2))
            x = x.astype(dtype)
        _drawn[key] = x
    return _drawn[key].copy()


def in_order(op, count, dtype, salt):
    """numpy's reduction in process order, float16 / bfloat16 in float32 rounded once."""
    wide = np.float32 if np.dtype(dtype) in (np.dtype(np.float16), BF16) else dtype
    acc = data(0, count, dtype, salt).astype(wide)
    with np.errstate(over="ignore", invalid="ignore"):
        for p in range(1, n):
            x = data(p, count, dtype, salt).astype(wide)
            if op == "sum":
                acc = acc + x
            else:   # jax's max / min: NaN wins
                pick = (acc > x) if op == "max" else (acc < x)
                acc = np.where(pick | np.isnan(acc), acc, x)
    return acc.astype(dtype)


def same(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape)
    if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
        bad = np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))[:5]
        raise AssertionError(f"{what}: process {me}: bytes differ at {bad}")


checked = 0
salt = 0
# sizes around the small / large boundary (64 KiB) and a few MiB, growing and shrinking
for count in (3, 16384, 16385 * n + 1, 1000, 1 << 20, 5):
    for dtype in ((np.float32, BF16) if count > 1 << 16 else
                  (np.float32, np.float64, np.int32, np.uint64, np.float16, BF16)):
        for op in ("sum", "max", "min"):
            salt += 1
            want = in_order(op, count, dtype, salt)
            x = data(me, count, dtype, salt)
            same(dist.allreduce(x, op), want, f"allreduce {op} {np.dtype(dtype).name}[{count}]")
            same(x, data(me, count, dtype, salt), "allreduce left its input alone")
            _C.dist_allreduce(x, x, op, 60.0)   # in place
            same(x, want, f"allreduce in place {op} {np.dtype(dtype).name}[{count}]")
            checked += 3
# reduce-scatter: this process's block of the reduction
for rows in (1, 4099, 100_000):
    for dtype in (np.float32, np.float64, np.int64, BF16):
        for op in ("sum", "max", "min"):
            salt += 1
            want = in_order(op, n * rows, dtype, salt)[me * rows:(me + 1) * rows]
            same(dist.reduce_scatter(data(me, n * rows, dtype, salt), op), want,
                 f"reduce_scatter {op} {np.dtype(dtype).name}[{n} x {rows}]")
            checked += 1
dist.shutdown()
report(me, f"OK {me} {n} {checked}")
sys.exit(0)
