"""Run under mpirun (tests/distributed/test_distributed_mpi.py): tests/mpi/global_arrays.py,
global_ops.py and global_slicing.py (which runs global_numpy.py's cases too) in one job,
each script's main against its own reference file, with one reference run for the three: on
a small machine most of a short job is its processes starting (a Python with numpy and
ctrainstate imported, MPI initialized), not the checks.

    python tests/mpi/global_all.py --reference DIR   # one process, 2 * N devices: DIR/<script>.npz
    mpirun -n N python tests/mpi/global_all.py DIR   # N processes, 2 devices each

Each process prints "OK <process> <count> <checks> <script>" for each script at the end (and
writes them to its file in CT_TEST_OUT); any failure raises (non-zero exit).
"""
import os

import global_arrays
import global_ops
import global_slicing
import report

import ctrainstate as cts

SCRIPTS = {"global_arrays.py": global_arrays, "global_ops.py": global_ops,
           "global_slicing.py": global_slicing}


def reference(ref_dir):
    os.makedirs(ref_dir, exist_ok=True)
    for name, script in SCRIPTS.items():
        script.reference(os.path.join(ref_dir, f"{name}.npz"))


def main(ref_dir):
    from ctrainstate import distributed as dist

    report.start(dist)
    report.collected = []
    for name, script in SCRIPTS.items():
        script.main(os.path.join(ref_dir, f"{name}.npz"))
    counts = dict(zip(SCRIPTS, report.collected, strict=True))
    me, n = cts.process_index(), cts.process_count()
    dist.shutdown()
    for name, checks in counts.items():
        report.report(me, f"OK {me} {n} {checks} {name}")


if __name__ == "__main__":
    report.run(main, reference)
