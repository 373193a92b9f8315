"""Run under mpirun (tests/distributed/test_distributed_mpi.py): a process that fails mid-collective, and
what the others do. Every process prints what happened to it:

    RAISED <process> <exception type> <seconds waited> <engine failure kind> [step i:] <message>
    AFTER <process> <exception type of the next collective>
    INTERRUPTED <process> <seconds>

Modes (argv[1]; the timeout in seconds is argv[2]):
  exit     process 1 enters an allreduce and exits (os._exit) 0.3 s later, while process
           n - 1 is still to join: the others wait for it until their timeout (run under
           `mpirun --enable-recovery`, which keeps the survivors running; plain mpirun ends
           them itself when a process dies).
  hang     process 1 never enters the collective (it sleeps): the others time out; then
           they exit with status 1 and mpirun ends process 1.
  mismatch process 0 passes 3 elements per process to an allgather, the others 4: every
           process raises RuntimeError naming the difference (no timeout needed).
  sigint   process 0 prints its pid ("PID <pid>") and waits in a barrier that process 1
           never enters; the test sends it SIGINT, which must raise KeyboardInterrupt within
           a fraction of a second.
"""
import os
import sys
import threading
import time

import numpy as np

from report import report as _report

from ctrainstate import _C
from ctrainstate import distributed as dist

mode, timeout = sys.argv[1], float(sys.argv[2])
dist.initialize(timeout=timeout)
me, n = dist.process_index(), dist.process_count()


def report(line):
    _report(me, line)


x = np.full(1000, me, np.float32)
assert dist.allreduce(x)[0] == n * (n - 1) / 2  # all alive and connected
dist.barrier()

if mode == "sigint":
    if me == 0:
        report(f"PID {os.getpid()}")
        t0 = time.monotonic()
        try:
            dist.barrier()
        except KeyboardInterrupt:
            report(f"INTERRUPTED {me} {time.monotonic() - t0:.2f} {_C.dist_info()['failure']}")
            sys.exit(1)
        report(f"NOT INTERRUPTED {me}")
        sys.exit(0)
    time.sleep(60)
    sys.exit(0)

if mode == "mismatch":
    count = 3 if me == 0 else 4
    t0 = time.monotonic()
    try:
        _C.dist_allgather(np.zeros(count, np.float32), np.zeros(count * n, np.float32), timeout)
    except RuntimeError as e:
        report(f"RAISED {me} {type(e).__name__} {time.monotonic() - t0:.2f} "
               f"{_C.dist_info()['failure']} {e}")
        sys.exit(0)
    report(f"COMPLETED {me}")
    sys.exit(0)

if me == 1:
    if mode == "hang":
        time.sleep(120)
        sys.exit(0)
    # die in the middle of the collective
    threading.Timer(0.3, lambda: os._exit(7)).start()
if me == n - 1 and mode == "exit":
    time.sleep(1.0)  # joins after process 1 died
# a survivor whose part of the collective had completed before process 1 died (its data had
# left process 1 already) goes on to the next collective, as a training loop would, and
# raises there: up to three collectives, each within its timeout
t0 = time.monotonic()
for step in range(3):
    try:
        dist.allreduce(x)
    except (TimeoutError, RuntimeError) as e:
        waited = time.monotonic() - t0
        kind = _C.dist_info()["failure"]
        report(f"RAISED {me} {type(e).__name__} {waited:.2f} {kind} step {step}: {e}")
        try:
            dist.barrier(timeout=1)
        except Exception as e2:  # noqa: BLE001 - reported
            report(f"AFTER {me} {type(e2).__name__} {e2}")
        sys.exit(1 if mode == "hang" else 0)
    t0 = time.monotonic()
report(f"COMPLETED {me}")
sys.exit(0)
