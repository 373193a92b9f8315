"""The implementation of :mod:`ctrainstate.t5x.partitioning` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from ...base import devices as _devices
from .... import partitioning as flax_partitioning
from ...jit.jit import pjit as _pjit
from ...array.mesh_utils import create_device_mesh
from ...array.sharding import Mesh, PartitionSpec
from ...base.tree_util import tree_map
from ...array.array import device_put
from ...nn.spmd import _replicate_uneven
from ...numpy_lax.numpy import with_sharding
from ...array.sharding import get_mesh as _active, NamedSharding

__all__ = [
    'AxisNames', 'DataLayout', 'LocalChunkInfo', 'LocalChunker', 'PartitionSpec',
    'PjitPartitioner', 'PjittedFnWithContext', 'MeshError', 'bounds_from_last_device',
    'default_mesh', 'default_submesh', 'get_coords', 'get_cpu_mesh', 'get_gpu_mesh', 'get_mesh',
    'global_mesh_defined', 'standard_logical_axis_rules', 'with_sharding_constraint',
    'LogicalAxisRules', 'HardwareMesh', 'pjit', 'host_local_array_to_global_array',
]

_log = logging.getLogger(__name__)

# t5x's type aliases (scripts use them in annotations) and its pjit (``backend=`` accepted)
LogicalAxisRules = Sequence[Tuple[str, Optional[str]]]
HardwareMesh = Tuple[int, ...]
pjit = _pjit

# Indirections so tests can simulate other host/device counts (t5x reads them from jax).
process_count = _devices.process_count
local_device_count = _devices.local_device_count
devices = _devices.devices


class MeshError(ValueError, AssertionError):
    """A mesh request the devices cannot satisfy. t5x asserts here, so this is both a
    ``ValueError`` (ctrainstate's rule for bad user input) and an ``AssertionError``."""


class AxisNames(tuple):
    """A tuple of axis names that pytree utilities treat as a leaf (t5x.partitioning.AxisNames).

    >>> AxisNames('embed', 'mlp')
    AxisNames('embed', 'mlp')
    """

    def __new__(cls, *names):
        return tuple.__new__(AxisNames, names)

    def __repr__(self):
        return 'AxisNames' + tuple.__repr__(self)


# --- rule tables ------------------------------------------------------------------------------

def standard_logical_axis_rules(activation_partitioning_dims: int = 1,
                                parameter_partitioning_dims: int = 1,
                                additional_rules=None) -> list:
    """t5x's four standard logical-axis rule tables (priority order), plus ``additional_rules``
    appended last. ``(activation, parameter)`` dims must each be 1 or 2.

    >>> standard_logical_axis_rules(1, 2)[6]
    ('embed', 'data')
    >>> standard_logical_axis_rules(3, 1)
    Traceback (most recent call last):
    ...
    ValueError: `activation_partitioning_dims` = 3 `parameter_partitioning_dims` = 1 is not supported.
    """
    a, p = activation_partitioning_dims, parameter_partitioning_dims
    head = [('batch', 'data'), ('vocab', 'model')]
    if (a, p) == (1, 1):
        body = [('embed', None), ('mlp', 'model'), ('heads', 'model'), ('kv', None),
                ('joined_kv', 'model')]
    elif (a, p) in ((2, 1), (1, 2), (2, 2)):
        body = [('mlp', 'model'), ('heads', 'model'), ('kv', None), ('joined_kv', 'model')]
        if (a, p) == (2, 1):
            body.append(('embed', 'model'))
        elif (a, p) == (1, 2):
            body.append(('embed', 'data'))
        else:
            body += [('embed', 'model'), ('embed', 'data')]
    else:
        raise ValueError(f'`activation_partitioning_dims` = {a} `parameter_partitioning_dims` = '
                         f'{p} is not supported.')
    replicated = [('relpos_buckets', None), ('abspos_buckets', None), ('length', None),
                  ('layers', None), ('stack', None), ('mlp_activations', None)]
    extra = list(additional_rules or ())
    for i, r in enumerate(extra):
        _check_rule(r, f'additional_rules[{i}]')
    return head + body + replicated + extra


def _check_rule(rule, where: str) -> None:
    """A rule is a ``(logical_name, mesh_axes)`` pair; a bare string (one rule passed where
    a sequence of rules belongs) would otherwise be split into characters."""
    if isinstance(rule, str) or not hasattr(rule, '__len__') or len(rule) != 2 or \
            not isinstance(rule[0], str):
        raise ValueError(f'{where} = {rule!r} is not a (logical_name, mesh_axes) pair; '
                         'rules are a sequence of such pairs')


# --- meshes ----------------------------------------------------------------------------------

def bounds_from_last_device(last_device) -> tuple:
    """Hardware mesh bounds: ``(x+1, y+1, z+1, core+1)`` for a TPU-like device with
    ``coords``, else ``(process_count, local_device_count)``."""
    if hasattr(last_device, 'coords'):
        x, y, z = last_device.coords
        return x + 1, y + 1, z + 1, last_device.core_on_chip + 1
    return process_count(), local_device_count()


def get_coords(device) -> tuple:
    """A device's hardware coordinates: ``(*coords, core_on_chip)`` on TPU-like devices, else
    ``(process_index, id % local_device_count)``."""
    if hasattr(device, 'coords'):
        return (*device.coords, device.core_on_chip)
    return (getattr(device, 'process_index', 0), device.id % local_device_count())


def global_mesh_defined() -> bool:
    """True inside ``with mesh:`` (a non-empty mesh is active on this thread)."""
    m = _active()
    return m is not None and m.size > 0


def with_sharding_constraint(x, axis_resources):
    """t5x's mesh-axis constraint: a no-op without an active mesh, else the value placed by
    ``axis_resources`` (a ``PartitionSpec`` of mesh axes). Under ``jit`` / ``pjit`` a
    dimension those mesh axes do not divide is replicated, as XLA keeps such a constraint."""
    if not global_mesh_defined() or axis_resources is None:
        return x
    shape = getattr(x, 'shape', None)
    target = NamedSharding(_active(), axis_resources)
    return with_sharding(x, _replicate_uneven(target, np.shape(x) if shape is None else shape))


def _device_grid(model_parallel_submesh, input_devices=(), input_local_devices=(),
                 tile_by_host_if_needed=True) -> np.ndarray:
    """The ``(data, model)`` device array of :func:`get_mesh` (plain objects, no Mesh)."""
    input_devices = list(input_devices) or devices()
    input_local_devices = list(input_local_devices) or [
        d for d in input_devices if getattr(d, 'process_index', 0) == 0]
    global_hw = tuple(bounds_from_last_device(input_devices[-1]))
    local_hw = tuple(bounds_from_last_device(input_local_devices[-1]))
    sub = tuple(model_parallel_submesh)
    ndim = len(global_hw)
    if len(sub) != ndim or any(g % m for g, m in zip(global_hw, sub)):
        raise MeshError(f'each dimension of the model parallel submesh {sub} must be a factor of '
                        f'the corresponding dimension of the global device mesh {global_hw}')
    if any(g % l for g, l in zip(global_hw, local_hw)):
        raise MeshError(f'the per-host device mesh {local_hw} does not tile the global device '
                        f'mesh {global_hw}')
    grid = np.empty(global_hw, dtype=object)
    for d in input_devices:
        grid[get_coords(d)] = d
    tile_by_host = tile_by_host_if_needed
    if ndim == 4:  # make Z major where that keeps host chunks contiguous
        gx, gy, gz, gc = global_hw
        mx, my, mz, mc = sub
        if (mx == gx > 1 and my == mz == 1) or (mx == 1 and my == gy > 1 and mz == gz > 1):
            global_hw, sub = (gx, gz, gy, gc), (mx, mz, my, mc)
            grid = grid.swapaxes(1, 2)
            tile_by_host = False
        if (my == gy > 1 and mx == mz == 1) or (my == 1 and mx == gx > 1 and mz == gz > 1):
            global_hw, sub = (gz, gy, gx, gc), (mz, my, mx, mc)
            grid = grid.swapaxes(0, 2)
            tile_by_host = False
    if tile_by_host:
        parts = []
        for g, m, l in zip(global_hw, sub, local_hw):
            d = g // m
            if m >= l:
                if m % l:
                    raise MeshError('to tile the mesh by hosts, each submesh dimension must be a '
                                    'factor or a multiple of the per-host mesh dimension')
                parts.append((d, 1, m // l, l))
            else:
                if l % m:
                    raise MeshError('to tile the mesh by hosts, each submesh dimension must be a '
                                    'factor or a multiple of the per-host mesh dimension')
                parts.append((d // (l // m), l // m, 1, m))
        grid = grid.reshape([s for t in parts for s in t])
        grid = grid.transpose([4 * i + j for j in range(4) for i in range(ndim)])
    else:
        grid = grid.reshape([s for g, m in zip(global_hw, sub) for s in (g // m, m)])
        grid = grid.transpose([2 * i for i in range(ndim)] + [2 * i + 1 for i in range(ndim)])
    return grid.reshape(-1, int(np.prod(sub)))


def get_mesh(model_parallel_submesh, input_devices=(), input_local_devices=(),
             tile_by_host_if_needed=True, backend=None) -> Mesh:
    """A ``('data', 'model')`` mesh whose ``model`` axis is one submesh of the hardware mesh.

    On CPUs and GPUs the hardware mesh is ``(process_count, local_device_count)``, so the
    submesh is a pair, e.g. ``(1, 2)`` gives ``model=2``.
    """
    if not input_devices and backend is not None:
        input_devices = devices(backend)
    return Mesh(_device_grid(model_parallel_submesh, input_devices, input_local_devices,
                             tile_by_host_if_needed), ('data', 'model'))


def get_cpu_mesh(backend=None) -> Mesh:
    """t5x's CPU mesh: ``(process_count, local_device_count)`` devices, so one host gives
    ``data=1, model=<number of devices>``."""
    devs = devices(backend or 'cpu')
    n = local_device_count(backend or 'cpu')
    grid = np.empty((process_count(), n), dtype=object)
    for d in devs:
        grid[getattr(d, 'process_index', 0), d.id % n] = d
    return Mesh(grid, ('data', 'model'))


def get_gpu_mesh(num_partitions: int, backend=None) -> Mesh:
    """t5x's GPU mesh: ``model = num_partitions`` (NVLink-local first), ``data`` the rest."""
    local = local_device_count(backend or 'gpu')
    if num_partitions < 1 or (num_partitions % local and local % num_partitions):
        raise MeshError('number of partitions on GPU must be a factor or multiple of the number '
                        f'of local devices ({num_partitions} partitions, {local} local devices)')
    nvlink_mp = min(num_partitions, local)
    nvlink_dp = local // nvlink_mp
    dcn_mp = num_partitions // nvlink_mp
    dcn_dp = process_count() // dcn_mp
    if dcn_dp < 1:
        raise MeshError(f'{num_partitions} partitions need {dcn_mp} processes of {local} GPUs; '
                        f'there are {process_count()}')
    devs = devices(backend or 'gpu')
    grid = np.array(devs, dtype=object).reshape(dcn_dp, dcn_mp, nvlink_dp, nvlink_mp)
    grid = grid.transpose(0, 2, 1, 3).reshape(dcn_dp * nvlink_dp, dcn_mp * nvlink_mp)
    return Mesh(grid, ('data', 'model'))


_TPU_V3 = {1: (1, 1, 1, 1), 2: (1, 1, 1, 2), 4: (2, 1, 1, 2), 8: (2, 2, 1, 2), 16: (4, 2, 1, 2)}


def _tpu_v4_submesh(n, bounds):
    bx, _, bz, _ = bounds
    if n == 1:
        return (1, 1, 1, 1)
    if n == 2:
        return (1, 2, 1, 1)
    if n == 4:
        return (4, 1, 1, 1) if bx >= 4 else (2, 2, 1, 1)
    if n == 8:
        return (1, 1, 8, 1) if bz >= 8 else (4, 2, 1, 1)
    if n == 16:
        if bz >= 16:
            return (1, 1, 16, 1)
        return (8, 2, 1, 1) if bx >= 8 else ((4, 4, 1, 1) if bx >= 4 else (2, 2, 4, 1))
    return None


def default_submesh(num_partitions, last_device):
    """t5x's default TPU model-parallel submesh for ``num_partitions`` (None if none)."""
    kind = getattr(last_device, 'device_kind', '')
    bounds = bounds_from_last_device(last_device)
    if kind in ('TPU v2', 'TPU v3'):
        return _TPU_V3.get(num_partitions)
    if kind in ('TPU v4', 'TPU v4 lite') and len(bounds) == 4 and bounds[3] == 1:
        return _tpu_v4_submesh(num_partitions, bounds)
    return None


def default_mesh(num_partitions, model_parallel_submesh=None, backend=None,
                 ici_mesh_shape=None, dcn_mesh_shape=None) -> Mesh:
    """The mesh t5x would pick: a hybrid ``('replica','data','model')`` mesh when both ICI and
    DCN shapes are given; else the submesh's mesh; else CPU → :func:`get_cpu_mesh` (ignores
    ``num_partitions``), GPU → :func:`get_gpu_mesh`."""
    if ici_mesh_shape is not None and dcn_mesh_shape is not None:
        if len(ici_mesh_shape) != 3 or len(dcn_mesh_shape) != 3:
            raise ValueError(f'ici_mesh_shape {tuple(ici_mesh_shape)} and dcn_mesh_shape '
                             f'{tuple(dcn_mesh_shape)} must each have 3 entries, one per mesh '
                             "axis ('replica', 'data', 'model')")
        shape = [i * d for i, d in zip(ici_mesh_shape, dcn_mesh_shape)]
        return Mesh(create_device_mesh(shape, devices(backend) if backend else None),
                    ('replica', 'data', 'model'))
    if model_parallel_submesh:
        return get_mesh(model_parallel_submesh, backend=backend)
    platform = _devices._normalize_backend(backend) if backend else _devices.default_backend()
    if platform == 'cpu':
        return get_cpu_mesh(backend)
    if platform == 'gpu':
        return get_gpu_mesh(num_partitions, backend)
    raise ValueError('No default mesh for this configuration: specify '
                     'config.model_parallel_submesh explicitly.')


# --- data layout -------------------------------------------------------------------------------

@dataclasses.dataclass
class LocalChunkInfo:
    """The slice of a global array held by this host, and its index among equal slices."""
    slice: tuple
    replica_id: int


class LocalChunker:
    """Which chunk of each mesh axis this host holds (t5x.partitioning.LocalChunker).

    ``global_mesh`` needs ``.devices`` (an object ndarray) and ``.axis_names``; devices
    carry ``process_index`` (0 when absent).
    """

    def __init__(self, global_mesh, process_index: int | None = None):
        self.global_mesh = global_mesh
        grid = np.asarray(global_mesh.devices)
        names = tuple(global_mesh.axis_names)
        me = _devices.process_index() if process_index is None else process_index
        mine = np.vectorize(lambda d: getattr(d, 'process_index', 0) == me, otypes=[bool])(grid)
        idx = np.nonzero(mine)
        if not len(idx[0]):
            raise ValueError(f'no device of process {me} in the mesh')
        first = tuple(int(i[0]) for i in idx)
        local_shape = tuple(int(i.max() - i.min() + 1) for i in idx)
        self.local_mesh_shape = collections.OrderedDict(zip(names, local_shape))
        self.mesh_axes = list(names)
        self.num_chunks = collections.OrderedDict()
        self.chunk_ids = collections.OrderedDict()
        for ax, n, loc, pos in zip(names, grid.shape, local_shape, first):
            self.num_chunks[ax] = n // loc
            self.chunk_ids[ax] = pos // loc

    def get_local_chunk_info(self, global_shape, mesh_axes) -> LocalChunkInfo:
        """This host's slice of an array sharded by ``mesh_axes`` (one entry per dim)."""
        local_slice = [slice(None) for _ in global_shape]
        sharded = set()
        for i, ax in enumerate(mesh_axes):
            if ax is None:
                continue
            axes = (ax,) if isinstance(ax, str) else tuple(ax)
            n, cid = 1, 0
            for a in axes:
                cid = cid * self.num_chunks[a] + self.chunk_ids[a]
                n *= self.num_chunks[a]
                sharded.add(a)
            size = global_shape[i] // n
            local_slice[i] = slice(cid * size, (cid + 1) * size)
        replica_id = self.get_replica_id(sharded)
        return LocalChunkInfo(tuple(local_slice), replica_id)

    def get_shard_id(self, sharded_mesh_axes) -> int:
        """This host's index along ``sharded_mesh_axes`` (a name or a sequence of names)."""
        axes = (sharded_mesh_axes,) if isinstance(sharded_mesh_axes, str) else sharded_mesh_axes
        sid = 0
        for a in axes:
            sid = sid * self.num_chunks[a] + self.chunk_ids[a]
        return sid

    def get_replica_id(self, sharded_mesh_axes) -> int:
        """This host's index among the hosts holding the same slice."""
        axes = (sharded_mesh_axes,) if isinstance(sharded_mesh_axes, str) else sharded_mesh_axes
        rid = 0
        for a in self.mesh_axes:
            if a not in axes:
                rid = rid * self.num_chunks[a] + self.chunk_ids[a]
        return rid


@dataclasses.dataclass
class DataLayout:
    """How a global batch is split over hosts (t5x.partitioning.DataLayout)."""
    batch_size: int
    shard_id: int
    num_shards: int
    is_first_host_in_replica_set: bool


# --- the partitioner -----------------------------------------------------------------------------

class PjittedFnWithContext:
    """A partitioned function: each call (and ``lower``) enters the partitioner's mesh and
    axis-rules contexts, then places inputs and outputs by their specs."""

    def __init__(self, fn, in_axis_resources, out_axis_resources, mesh, rules,
                 static_argnums=(), donate_argnums=()):
        self._fn = fn
        self._mesh = mesh
        self._rules = rules
        self._pjitted = _pjit(fn, in_axis_resources=in_axis_resources,
                              out_axis_resources=out_axis_resources,
                              static_argnums=static_argnums, donate_argnums=donate_argnums)

    def __call__(self, *args, **kwargs):
        with self._mesh, flax_partitioning.axis_rules(self._rules):
            return self._pjitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        """The traced program of this call (``jit``'s ``lower``, inside the partitioner's mesh
        and rules): ``.compile()`` gives a callable with ``as_text()`` and
        ``memory_analysis()``."""
        with self._mesh, flax_partitioning.axis_rules(self._rules):
            return _Lowered(self, self._pjitted.lower(*args, **kwargs))

    def lower_and_compile(self, *args, **kwargs):
        """``lower(...).compile()`` in one call (what t5x's ``PjitPartitioner.compile`` uses)."""
        return self.lower(*args, **kwargs).compile()


class _Lowered:
    """A partitioned function's lowered program (see ``jit``'s ``lower``); calling it (or what
    ``compile()`` returns) calls the partitioned function."""

    def __init__(self, fn, lowered):
        self._fn = fn
        self._lowered = lowered

    def compile(self):
        return self

    def as_text(self) -> str:
        return self._lowered.as_text()

    def memory_analysis(self):
        return self._lowered.memory_analysis()

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


class PjitPartitioner:
    """t5x's partitioner: a ``('data', 'model')`` mesh, logical axis rules, and ``partition``.

    >>> from ctrainstate.t5x.partitioning import PjitPartitioner
    >>> PjitPartitioner()
    Traceback (most recent call last):
    ...
    ValueError: At least one of `num_partitions` or `model_parallel_submesh` must be set.
    """

    def __init__(self, num_partitions: Optional[int] = None, model_parallel_submesh=None,
                 params_on_devices: bool = True, backend: Optional[str] = None,
                 ici_mesh_shape=None, dcn_mesh_shape=None, logical_axis_rules=None, *,
                 use_cpu_pjit: bool = False):
        # use_cpu_pjit (t5x 2022-08..2023-03) is accepted and ignored.
        if not num_partitions and not model_parallel_submesh:
            raise ValueError('At least one of `num_partitions` or `model_parallel_submesh` must '
                             'be set.')
        if model_parallel_submesh is not None and len(model_parallel_submesh) != 4:
            _log.error('`model_parallel_submesh` must be either None or a 4-tuple. Got `%s`. '
                       'Other values will not be supported on TPU.', model_parallel_submesh)
        if num_partitions and model_parallel_submesh:
            _log.error('At most one of `num_partitions` or `model_parallel_submesh` can be set. '
                       'Got `num_partitions=%s` and `model_parallel_submesh=%s`.',
                       num_partitions, model_parallel_submesh)
        self._num_partitions = num_partitions
        self._model_parallel_submesh = model_parallel_submesh
        self._params_on_devices = params_on_devices
        self._backend = backend
        self._ici_mesh_shape = ici_mesh_shape
        self._dcn_mesh_shape = dcn_mesh_shape
        if logical_axis_rules is None:
            logical_axis_rules = standard_logical_axis_rules()
        if isinstance(logical_axis_rules, str):
            raise ValueError(f'logical_axis_rules = {logical_axis_rules!r}: expected a sequence '
                             'of (logical_name, mesh_axes) pairs')
        logical_axis_rules = list(logical_axis_rules)
        for i, r in enumerate(logical_axis_rules):
            _check_rule(r, f'logical_axis_rules[{i}]')
        if ici_mesh_shape is not None and dcn_mesh_shape is not None:
            logical_axis_rules = [(k, ('replica', 'data')) if k == 'batch' else (k, v)
                                  for k, v in logical_axis_rules]
        self._logical_axis_rules = tuple(tuple(r) for r in logical_axis_rules)
        self._data_axis = flax_partitioning.logical_to_mesh_axes(
            ('batch',), self._logical_axis_rules)[0]
        self._mesh = None

    # properties
    @property
    def mesh(self) -> Mesh:
        """The ``('data', 'model')`` mesh (built on first use)."""
        if self._mesh is None:
            self._mesh = default_mesh(self._num_partitions, self._model_parallel_submesh,
                                      self._backend, self._ici_mesh_shape, self._dcn_mesh_shape)
        return self._mesh

    @property
    def logical_axis_rules(self) -> tuple:
        """The logical axis rules, as a tuple of pairs."""
        return self._logical_axis_rules

    @property
    def params_on_devices(self) -> bool:
        """A flag kept for t5x compatibility."""
        return self._params_on_devices

    @params_on_devices.setter
    def params_on_devices(self, value: bool):
        self._params_on_devices = value

    @property
    def data_partition_spec(self) -> PartitionSpec:
        """``PartitionSpec(<mesh axis of 'batch'>)``: ``P('data')`` under the standard rules."""
        return PartitionSpec(self._data_axis)

    def _data_axes(self) -> tuple:
        ax = self._data_axis
        if ax is None:
            return ()
        return (ax,) if isinstance(ax, str) else tuple(ax)

    @property
    def data_mesh_size(self) -> int:
        """Devices along the data axes (the batch must divide by it)."""
        shape = self.mesh.shape
        return int(np.prod([shape[a] for a in self._data_axes()], dtype=np.int64))

    @property
    def _local_chunker(self) -> LocalChunker:
        return LocalChunker(self.mesh)

    @property
    def data_shards(self) -> int:
        """Number of host chunks along the data axes."""
        ch = self._local_chunker
        return int(np.prod([ch.num_chunks[a] for a in self._data_axes()], dtype=np.int64))

    @property
    def data_shard_id(self) -> int:
        """This host's index along the data axes."""
        return self._local_chunker.get_shard_id(self._data_axes())

    def get_data_layout(self, batch_size: Optional[int] = None,
                        host_index: Optional[int] = None) -> DataLayout:
        """The batch size and this host's shard of it (one host: ``shard_id=0, num_shards=1``).
        When the rules leave ``'batch'`` unsharded, ``batch_size`` is returned as given (None
        by default) with one shard, as in t5x."""
        if host_index is not None:
            raise NotImplementedError('Explicit host_index is not yet implemented.')
        if self._data_axis is None:  # 'batch' is not sharded: every host reads the whole batch
            return DataLayout(batch_size=batch_size, shard_id=0, num_shards=1,
                              is_first_host_in_replica_set=(_devices.process_index() == 0))
        if batch_size is None:
            batch_size = self.data_mesh_size
        if batch_size % self.data_mesh_size:
            raise ValueError(f'Batch size ({batch_size}) must be divisible by corresponding data '
                             f'mesh size ({self.data_mesh_size}).')
        num_shards = self.data_shards
        if batch_size % num_shards:
            raise ValueError(f'Batch size ({batch_size}) must be divisible by number of data '
                             f'shards ({num_shards}).')
        ch = self._local_chunker
        replica_id = ch.get_replica_id(self._data_axes())
        return DataLayout(batch_size=int(batch_size), shard_id=int(self.data_shard_id),
                          num_shards=int(num_shards),
                          is_first_host_in_replica_set=(replica_id == 0))

    def get_local_chunk_info(self, global_shape, mesh_axes) -> LocalChunkInfo:
        """This host's slice of an array of ``global_shape`` sharded by ``mesh_axes``."""
        return self._local_chunker.get_local_chunk_info(global_shape, mesh_axes)

    # partitioning
    def partition(self, fn: Callable, in_axis_resources, out_axis_resources,
                  static_argnums=(), donate_argnums=()) -> PjittedFnWithContext:
        """``fn`` wrapped to run inside this mesh and these rules, with inputs and outputs placed
        by the specs (``None`` = replicated; a pytree prefix of the values is fine)."""
        return PjittedFnWithContext(fn, in_axis_resources, out_axis_resources, self.mesh,
                                    self._logical_axis_rules, static_argnums, donate_argnums)

    def compile(self, partitioned_fn: PjittedFnWithContext, *args):
        """``partitioned_fn.lower(*args).compile()``: a callable taking the same arguments."""
        return partitioned_fn.lower(*args).compile()

    def get_logical_axes(self, train_state):
        """The train state with logical ``PartitionSpec`` leaves (``train_state.as_logical_axes()``)."""
        return train_state.as_logical_axes()

    def get_mesh_axes(self, train_state):
        """The train state with mesh ``PartitionSpec`` (or None) leaves, from its logical axes
        under this partitioner's rules. Works on :func:`ctrainstate.eval_shape` output."""
        logical = self.get_logical_axes(train_state)
        sd = logical.state_dict()

        def resolve(path, names):
            if names is None:
                return None
            try:
                return flax_partitioning.logical_to_mesh_axes(names, self._logical_axis_rules)
            except ValueError as e:
                raise ValueError(f'Failed to map logical axes for {path}: {e}') from e

        return logical.restore_state(_map_state_dict(resolve, sd))

    def move_params_to_devices(self, train_state, train_state_axes):
        """Place a (host) train state by ``train_state_axes``."""
        def identity(state):
            return state
        return self.partition(identity, (train_state_axes,), train_state_axes,
                              donate_argnums=(0,))(train_state)


def _map_state_dict(fn, sd, prefix=''):
    """Map ``fn(path, leaf)`` over a nested state dict; None leaves and empty dicts are kept."""
    if isinstance(sd, dict) and not isinstance(sd, PartitionSpec):
        return {k: _map_state_dict(fn, v, f'{prefix}/{k}' if prefix else str(k))
                for k, v in sd.items()}
    return fn(prefix, sd)


def host_local_array_to_global_array(arr_tree, mesh, pspecs):
    """Single process: place each host array by its spec on ``mesh`` (None = replicated)."""

    def put(spec, sub):
        s = NamedSharding(mesh, PartitionSpec() if spec is None else spec)
        return tree_map(lambda x: device_put(x, s), sub)
    return tree_map(put, pspecs, arr_tree,
                    is_leaf=lambda x: x is None or isinstance(x, PartitionSpec))


from ...base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
