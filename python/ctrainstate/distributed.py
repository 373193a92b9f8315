"""Multi-process runs (``jax.distributed``): one process per host, started by a launcher.

:func:`initialize` joins the processes of a job, as ``jax.distributed.initialize`` does. The
processes talk through MPI (Open MPI), which ctrainstate loads when ``initialize`` is called,
so ``import ctrainstate`` never needs it. Start every process with an MPI launcher::

    mpirun -n 2 python train.py            # Open MPI (Debian: apt-get install openmpi-bin)
    srun -n 2 --mpi=pmix python train.py   # Slurm with Open MPI

and call ``ctrainstate.distributed.initialize()`` first thing in the script: the process id
and count come from the launcher's environment (Open MPI's ``OMPI_COMM_WORLD_*``, MPICH's
``PMI_RANK``/``PMI_SIZE``, Slurm's ``SLURM_PROCID``/``SLURM_NTASKS``, torchrun-style
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``), or from the arguments, which take precedence.
MPI must agree: a process started without an MPI launcher is a world of one, and
``initialize`` then raises instead of waiting for peers that will never come.

What works so far: the job (:func:`process_index`, :func:`process_count`), host collectives
on numpy data between processes (:func:`allreduce`, :func:`allgather`,
:func:`reduce_scatter`, :func:`broadcast`, :func:`barrier`; these are ctrainstate's, jax has
no such functions) and ``ctrainstate.experimental.multihost_utils``. Each collective waits
at most ``timeout`` seconds: a peer that died or never arrives makes the others raise
``TimeoutError`` instead of hanging. In a job of several processes ``initialize`` also makes
the devices global: ``ctrainstate.devices()`` lists every process's (ids ordered by process,
``Device.process_index``), ``ctrainstate.local_devices()`` this process's, so a ``Mesh``
can span processes and an Array over it holds this process's shards only (placed with
``ctrainstate.make_array_from_process_local_data`` and its kin, gathered with
``multihost_utils.process_allgather``). It must therefore come before anything uses devices.
Operations on such Arrays communicate where their plans reduce or reshard over processes,
with the one-process run's results bit for bit, so a training step (``value_and_grad``,
``apply_gradients`` with elementwise optimizers) runs across processes. What does not work
yet: indexing and other gathers of such Arrays, the fused optimizer's norms over them, and
NCCL across processes.

Open MPI only: MPICH, Intel MPI and other libraries on MPICH's ABI use integer handles,
which the engine does not support yet (``initialize`` says so). ``CTRAINSTATE_MPI_LIBRARY``
names the library to load (default: ``libmpi.so.40``, then ``libmpi.so``);
``CTRAINSTATE_DIST_TIMEOUT`` the default timeout in seconds.

>>> import ctrainstate.distributed as dist
>>> dist.is_initialized(), dist.process_count()
(False, 1)
"""
from ._src.distributed.distributed import *  # noqa: F401,F403
from ._src.distributed.distributed import __all__  # noqa: F401

from ._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
