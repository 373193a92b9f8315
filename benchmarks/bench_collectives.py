"""Host collectives across processes: ctrainstate's MPI engine (csrc/process/ct_dist.c:
non-blocking MPI polled against a deadline) against MPI's own blocking MPI_Allreduce,
MPI_Allgather and MPI_Reduce_scatter_block, called through ctypes on the same libmpi, on the
same buffers, in the same run.

    mpirun -n 2 python benchmarks/bench_collectives.py [--max-bytes 256MiB] [--iters 20]

(as root: mpirun --allow-run-as-root; more processes than cores: --oversubscribe)

Sizes double from --min-bytes (1 KiB) to --max-bytes (256 MiB), float32, sum. As in
nccl-tests, the size of a row is the bytes of the larger buffer: all_reduce's buffer,
all_gather's output, reduce_scatter's input; algbw = size / time, and the bus bandwidth
busbw = algbw * 2(n-1)/n for all_reduce and algbw * (n-1)/n for all_gather and
reduce_scatter (n processes). A time is the slowest process's mean over --iters calls
(fewer above 16 MiB), the best of --rounds rounds that alternate the two implementations.
The ratio is ctrainstate's busbw over MPI's. Every call's result is checked once.
"""
import argparse
import ctypes
import re
import sys
import time

import numpy as np

from ctrainstate import _C
from ctrainstate import distributed as dist


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B?|B)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1024, 64KiB, 256MiB)")
    unit = (m.group(2) or "B").upper()[:1]
    return int(m.group(1)) * {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit]


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


class Mpi:
    """MPI's own blocking collectives on MPI_COMM_WORLD, through ctypes on the libmpi that
    ctrainstate loaded (Open MPI: predefined handles are addresses of global symbols)."""

    def __init__(self):
        self.lib = ctypes.CDLL(_C.dist_info()["library"], mode=ctypes.RTLD_GLOBAL)
        h = lambda name: ctypes.c_void_p(ctypes.addressof(ctypes.c_char.in_dll(self.lib, name)))
        self.world, self.float, self.sum = (h("ompi_mpi_comm_world"), h("ompi_mpi_float"),
                                            h("ompi_mpi_op_sum"))
        vp, i = ctypes.c_void_p, ctypes.c_int
        self.lib.MPI_Allreduce.argtypes = [vp, vp, i, vp, vp, vp]
        self.lib.MPI_Allgather.argtypes = [vp, i, vp, vp, i, vp, vp]
        self.lib.MPI_Reduce_scatter_block.argtypes = [vp, vp, i, vp, vp, vp]

    # Each returns a call bound to its buffers (the pointers taken once, outside the timing)
    def all_reduce(self, send, recv):
        f, a = self.lib.MPI_Allreduce, (send.ctypes.data, recv.ctypes.data, send.size,
                                        self.float, self.sum, self.world)
        return lambda: f(*a)

    def all_gather(self, send, recv):
        f, a = self.lib.MPI_Allgather, (send.ctypes.data, send.size, self.float,
                                        recv.ctypes.data, send.size, self.float, self.world)
        return lambda: f(*a)

    def reduce_scatter(self, send, recv):
        f, a = self.lib.MPI_Reduce_scatter_block, (send.ctypes.data, recv.ctypes.data,
                                                   recv.size, self.float, self.sum, self.world)
        return lambda: f(*a)


def ours(timeout):
    """ctrainstate's bindings, bound to their buffers likewise."""
    return {
        "all_reduce": lambda s, r: lambda: _C.dist_allreduce(s, r, "sum", timeout),
        "all_gather": lambda s, r: lambda: _C.dist_allgather(s, r, timeout),
        "reduce_scatter": lambda s, r: lambda: _C.dist_reduce_scatter(s, r, "sum", timeout),
    }


def buffers(name, size, n, me):
    """(send, recv, expected recv) for a row of `size` bytes (nccl-tests' meaning)."""
    count = size // 4
    if name == "all_reduce":
        send = np.full(count, me + 1, np.float32)
        return send, np.empty_like(send), n * (n + 1) / 2
    if name == "all_gather":
        send = np.full(count // n, me + 1, np.float32)
        want = np.repeat(np.arange(1, n + 1, dtype=np.float32), count // n)
        return send, np.empty(count // n * n, np.float32), want
    send = np.full(count // n * n, me + 1, np.float32)
    return send, np.empty(count // n, np.float32), n * (n + 1) / 2


def bus_factor(name, n):
    return 2 * (n - 1) / n if name == "all_reduce" else (n - 1) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--min-bytes", type=parse_bytes, default=1 << 10)
    ap.add_argument("--max-bytes", type=parse_bytes, default=256 << 20)
    ap.add_argument("--iters", type=int, default=20, help="calls per timing (up to 16 MiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter")
    args = ap.parse_args()
    dist.initialize(timeout=600)
    me, n = dist.process_index(), dist.process_count()
    mpi = Mpi()
    engine = ours(600.0)
    impls = {"ctrainstate": engine, "MPI": {k: getattr(mpi, k) for k in engine}}
    if me == 0:
        info = _C.dist_info()
        print(f"# {n} processes, {info['version']} ({info['library']}); float32 sum; busbw in "
              f"GB/s (1e9 B/s); time: slowest process's mean per call")
        print(f"{'collective':<15}{'size':>10}{'ct time us':>12}{'ct busbw':>10}"
              f"{'MPI time us':>13}{'MPI busbw':>11}{'ratio':>8}")
    sizes = []
    s = args.min_bytes
    while s <= args.max_bytes:
        sizes.append(s)
        s *= 2
    for name in args.ops.split(","):
        for size in sizes:
            if size // 4 < n:
                continue
            send, recv, want = buffers(name, size, n, me)
            iters = args.iters if size <= 16 << 20 else max(2, args.iters * (16 << 20) // size)
            best = {}
            for rnd in range(args.rounds):
                for label in (("ctrainstate", "MPI") if rnd % 2 == 0 else ("MPI", "ctrainstate")):
                    fn = impls[label][name](send, recv)
                    recv.fill(-1)
                    if fn() not in (None, 0):  # warm, and checked (MPI: its return code)
                        raise SystemExit(f"{label} {name} {size}: error on process {me}")
                    if not np.array_equal(recv, np.broadcast_to(np.float32(want), recv.shape)
                                          if np.isscalar(want) else want):
                        raise SystemExit(f"{label} {name} {size}: wrong result on process {me}")
                    _C.dist_barrier(600.0)
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        fn()
                    dt = np.array([(time.perf_counter() - t0) / iters])
                    slowest = np.empty(1)
                    _C.dist_allreduce(dt, slowest, "max", 600.0)
                    best[label] = min(best.get(label, np.inf), float(slowest[0]))
            if me == 0:
                bw = {k: size / t / 1e9 * bus_factor(name, n) for k, t in best.items()}
                print(f"{name:<15}{human(size):>10}{best['ctrainstate'] * 1e6:>12.1f}"
                      f"{bw['ctrainstate']:>10.3f}{best['MPI'] * 1e6:>13.1f}{bw['MPI']:>11.3f}"
                      f"{bw['ctrainstate'] / bw['MPI']:>8.2f}", flush=True)
            del send, recv
    dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
