"""The benchmarks' shared timer (imported by the scripts beside it: ``python
benchmarks/bench_*.py`` puts this directory first on ``sys.path``)."""
import time


def best(f, reps, warmup=True):
    """The fastest of ``reps`` timed calls of ``f()``, in seconds; ``warmup`` makes one untimed
    call first (compilation, caches, first-touch page faults)."""
    if warmup:
        f()
    t = float("inf")
    for _ in range(max(1, int(reps))):
        s = time.perf_counter()
        f()
        t = min(t, time.perf_counter() - s)
    return t
