"""The examples under an MPI launcher (``mpirun -n 2 python examples/siren.py ...``): how many
processes the launcher started, read from its environment before ctrainstate is imported
(so that an example can choose its per-process device count), and the call that joins them.

Open MPI's ``mpirun`` sets ``OMPI_COMM_WORLD_SIZE``/``OMPI_COMM_WORLD_RANK`` in every process,
MPICH's ``mpiexec`` ``PMI_SIZE``/``PMI_RANK``; Slurm's ``srun`` ``SLURM_NTASKS``/``SLURM_PROCID``
only in the processes of a job step, where ``SLURM_STEP_ID`` is set too (a batch script's own
shell has ``SLURM_NTASKS`` but is one process). ``ctrainstate.distributed.initialize()`` reads
the same variables; a script started without a launcher is one process and does not call it.
"""
from __future__ import annotations

import os

_LAUNCHERS = (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", None),
              ("PMI_SIZE", "PMI_RANK", None),
              ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_STEP_ID"))


def launched_processes(environ=None) -> int:
    """The number of processes the launcher started (1 without a launcher). Raises
    ``SystemExit`` naming the variable where its value is not a positive integer."""
    environ = os.environ if environ is None else environ
    for size_var, rank_var, step_var in _LAUNCHERS:
        if size_var not in environ or rank_var not in environ:
            continue
        if step_var is not None and step_var not in environ:
            continue
        text = environ[size_var]
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise SystemExit(f"{size_var}={text!r} (set by the launcher) is not a positive "
                             f"integer")
        return n
    return 1


def devices_per_process(total: int, what: str) -> int:
    """``total`` devices (a mesh's size) split over the launched processes: how many each
    process needs. Raises ``SystemExit`` where they do not split evenly."""
    n = launched_processes()
    if total % n:
        raise SystemExit(f"{what} needs {total} devices, which do not split over {n} "
                         f"processes (choose a mesh whose size is a multiple of {n})")
    return total // n


def initialize() -> tuple[int, int]:
    """Join the launched processes (``ctrainstate.distributed.initialize()``) where there are
    several; must come before anything uses devices. Returns (process index, process count)."""
    import ctrainstate.distributed as dist
    if launched_processes() > 1:
        dist.initialize()
    return dist.process_index(), dist.process_count()
