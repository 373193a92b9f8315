"""ctrainstate: Flax's partitioning model, sharded init and fused TrainState
optimizers in a C extension, on CPU virtual devices and NVIDIA GPUs, without JAX.

>>> import numpy as np, ctrainstate as cts
>>> cts.device_count() >= 1
True
"""
import functools as _functools

from . import _C, config
from ._C import DonatedBufferError, ResourceExhaustedError
from ._src.base.devices import (Device, default_backend, device_count, devices, gpu_status,
                                local_device_count, local_devices, process_count, process_index,
                                reset_peak_memory_stats)
from . import tree_util, tree, sharding, mesh_utils
from ._src.array.sharding import (Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding,
                                  get_mesh, set_mesh)
from ._src.array.sharding import PartitionSpec as P
from ._src.array.mesh_utils import make_mesh
from ._src.array.array import (Array, Shard, block_until_ready, device_get, device_put,
                               from_dlpack, make_array_from_callback,
                               make_array_from_process_local_data,
                               make_array_from_single_device_arrays, visualize_array_sharding)
from . import numpy
from ._src.ops.ops import grad, value_and_grad
from ._src.autodiff.custom import custom_vjp, jacobian, jacrev, vjp
from ._src.autodiff.remat import checkpoint, checkpoint_policies, remat
from ._src.base.precision import default_matmul_precision
from ._src.array.abstract import ShapeDtypeStruct, eval_shape
from ._src.jit.jit import jit, pjit
from ._src.numpy_lax.pmap import device_put_replicated, device_put_sharded, pmap
from ._src.numpy_lax.vmap import vmap
from . import optim, train_state, lax, serialization, struct, traverse_util, core, debug
from . import distributed, errors
# `checkpoint` names the checkpoint package, which is also callable as jax.checkpoint (remat);
# `remat` names the same object, as jax.remat is jax.checkpoint. (`from . import checkpoint`
# alone would find _remat's function under that name and import nothing.)
from .checkpoint import CheckpointManager as _CheckpointManager  # noqa: F401
from . import checkpoint  # noqa: E402
remat = checkpoint
from ._src.numpy_lax.lax import with_sharding_constraint

__version__ = "0.1.0"


class _NoOpContext:
    """A context manager (and decorator) that changes nothing: jax's tracing and naming
    controls, for code ported from jax (ctrainstate runs eagerly, with no traces or HLO
    names)."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __call__(self, fn):
        return fn


class named_scope(_NoOpContext):
    """``jax.named_scope(name)``: names ops in jax's HLO and profiles; nothing to name here."""


class disable_jit:
    """``jax.disable_jit(disable=True)``: inside the block (or the decorated function) a
    jitted function runs eagerly, op by op, as outside ``jit`` (no trace, no replay), as
    ``config.update("jax_disable_jit", True)`` makes it (process-wide, restored on exit).

    >>> import ctrainstate as cts
    >>> with cts.disable_jit():
    ...     cts.config.jax_disable_jit
    True
    >>> cts.config.jax_disable_jit
    False
    """

    def __init__(self, disable: bool = True):
        self._disable = bool(disable)
        self._saved = []

    def __enter__(self):
        self._saved.append(config.read("jax_disable_jit"))
        config.update("jax_disable_jit", self._disable)
        return self

    def __exit__(self, *exc):
        config.update("jax_disable_jit", self._saved.pop())
        return False

    def __call__(self, fn):

        @_functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with disable_jit(self._disable):
                return fn(*args, **kwargs)
        return wrapped


class ensure_compile_time_eval(_NoOpContext):
    """``jax.ensure_compile_time_eval()``: every value is concrete here already."""

__all__ = [
    "Array", "Device", "DonatedBufferError", "Mesh", "NamedSharding", "P", "PartitionSpec",
    "ResourceExhaustedError", "Shard", "SingleDeviceSharding", "block_until_ready",
    "default_backend", "device_count", "device_put", "devices", "get_mesh", "set_mesh", "gpu_status", "local_device_count",
    "local_devices", "make_mesh", "mesh_utils", "process_count", "process_index",
    "reset_peak_memory_stats", "sharding", "tree", "tree_util", "visualize_array_sharding",
    "numpy", "grad", "value_and_grad", "vjp", "custom_vjp", "jacrev", "jacobian", "checkpoint", "checkpoint_policies", "remat", "lax", "with_sharding_constraint", "device_get", "serialization", "struct", "traverse_util", "core", "from_dlpack", "ShapeDtypeStruct", "eval_shape", "jit", "pjit", "pmap", "vmap", "device_put_sharded",
    "device_put_replicated",
    "default_matmul_precision", "debug", "named_scope", "disable_jit",
    "ensure_compile_time_eval", "config", "distributed", "errors", "make_array_from_callback",
    "make_array_from_process_local_data", "make_array_from_single_device_arrays",
]
