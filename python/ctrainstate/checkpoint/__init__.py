"""Checkpoints: sharded, atomic, checksummed, asynchronous; restored onto any mesh.

A checkpoint is a directory: the arrays in safetensors files (each unique block written once,
by the process holding it, cut into slices of at most 4 MiB) and ``index.json`` — the tree
paths ('/'-joined state-dict keys), global shapes, dtypes, each array's sharding at save
time, the file, byte range and checksum (XXH3-64) of every slice (each slice keyed by its global index
range), the values of non-array leaves, and the step's metadata. Every file opens with the
``safetensors`` package.

Saving writes to a temporary directory, fsyncs the files and the directory, and renames it:
a crash at any point leaves the previous checkpoints restorable; the partial one is ignored
and removed at the next save. Restoring reads, for each device, only the slices that overlap
its block (``pread``, straight into CPU device buffers), checks each slice's checksum (a
mismatch raises :class:`CorruptCheckpointError` naming the array) and checks shapes and dtypes
against the target (``cast=True`` converts dtypes).

In a job of several processes (``ctrainstate.distributed.initialize()``) every process calls
the same functions with the same state: each writes the unique blocks it holds into its own
file, process 0 gathers the index and commits once every file is fsync'd (a failure on any
process commits nothing and raises on every process), and each restores only its devices'
blocks, onto any global mesh and number of processes (``_src/checkpoint/processes.py``). An
async save's writes and commit run in a background thread on every process, its collectives
on a communicator of their own.

Front ends, with the names of the libraries ported scripts use:

* orbax: :class:`CheckpointManager` (+ :class:`CheckpointManagerOptions`, ``args``),
  :class:`StandardCheckpointer` / :class:`AsyncCheckpointer`;
* ``flax.training.checkpoints``: :func:`save_checkpoint`, :func:`restore_checkpoint`,
  :func:`latest_checkpoint`, :class:`AsyncManager`;
* t5x: ``ctrainstate.t5x.checkpoints.Checkpointer``;
* HuggingFace weights: :func:`load_pretrained_params` (``flax_model.msgpack``,
  ``model.safetensors``, sharded ``*.index.json``), born sharded.

``ctrainstate.checkpoint`` is also callable, as ``jax.checkpoint`` is: ``cts.checkpoint(fn)``
is :func:`ctrainstate.remat` (rematerialisation), so scripts using either name keep working.

>>> import tempfile, numpy as np, ctrainstate as cts
>>> from ctrainstate import checkpoint as ocp
>>> d = tempfile.mkdtemp()
>>> mngr = ocp.CheckpointManager(d)
>>> mngr.save(5, {'w': cts.device_put(np.ones(3, np.float32))})
True
>>> mngr.wait_until_finished(); mngr.latest_step()
5
>>> np.asarray(mngr.restore(5, {'w': cts.device_put(np.zeros(3, np.float32))})['w']).tolist()
[1.0, 1.0, 1.0]
"""
import sys as _sys
import types as _types

from . import args, manager, pretrained
from .._src.checkpoint.store import CorruptCheckpointError
from .._src.checkpoint.manager import (AsyncCheckpointer, AsyncManager, CheckpointManager,
                                      CheckpointManagerOptions, Checkpointer,
                                      InvalidCheckpointError, PyTreeCheckpointer,
                                      StandardCheckpointer, StepAlreadyExistsError,
                                      available_steps, latest_checkpoint, restore_checkpoint,
                                      save_checkpoint)
from .._src.checkpoint.pretrained import load_pretrained_params, read_pretrained_shapes
from .._src.autodiff.remat import checkpoint as _remat_checkpoint

__all__ = ["CheckpointManager", "CheckpointManagerOptions", "args", "StandardCheckpointer",
           "AsyncCheckpointer", "PyTreeCheckpointer", "Checkpointer", "AsyncManager",
           "save_checkpoint", "restore_checkpoint", "latest_checkpoint", "available_steps",
           "load_pretrained_params", "read_pretrained_shapes", "CorruptCheckpointError",
           "StepAlreadyExistsError", "InvalidCheckpointError"]


class _CallableModule(_types.ModuleType):
    """This module, callable as ``jax.checkpoint`` (rematerialisation): ``import
    ctrainstate.checkpoint`` replaces the package attribute ``ctrainstate.checkpoint``, which
    was ``jax.checkpoint``'s name before."""

    def __call__(self, *args, **kwargs):
        return _remat_checkpoint(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
