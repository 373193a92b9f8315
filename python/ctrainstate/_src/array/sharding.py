"""The implementation of :mod:`ctrainstate.sharding` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import math

import collections
import itertools
from typing import Any, Mapping

import numpy as np

from ... import _C
from ..base import dtypes as _dtypes
from ..base.devices import Device, local_devices as _local_devices, _process
from ..base.trace_state import in_jit
from ..base.threadlocal import NotifyingLocal

__all__ = [
    "Mesh",
    "set_mesh",
    "PartitionSpec",
    "NamedSharding",
    "SingleDeviceSharding",
    "Sharding",
    "get_mesh",
]


# --- PartitionSpec ------------------------------------------------------------



def shard_index(start, shard_shape, parts) -> tuple:
    """The global slices of a shard starting at ``start``: ``slice(None)`` for a dimension
    split into one piece (not split, or over mesh axes of size 1), ``slice(a, b)`` otherwise
    -- also when the dimension has size 0 (jax's Shard.index). ``parts``: the number of
    pieces of each dimension (:meth:`Sharding._dim_parts`)."""
    return tuple(slice(None) if p == 1 else slice(s, s + n)
                 for s, n, p in zip(start, shard_shape, parts))

class _UnconstrainedPartitionSingleton:
    """Marker for a dimension whose sharding a constraint leaves free."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self):
        return "UNCONSTRAINED"

    __str__ = __repr__

    def __reduce__(self):
        return (_UnconstrainedPartitionSingleton, ())


UNCONSTRAINED = _UnconstrainedPartitionSingleton()


def _check_entry(e):
    if e is None or isinstance(e, str) or e is UNCONSTRAINED:
        return e
    if isinstance(e, (tuple, list)):
        if not all(isinstance(x, str) for x in e):
            raise TypeError(
                f"a PartitionSpec entry that is a tuple must hold mesh-axis names (strings), got {e!r}")
        # as jax: ('x',) is the name 'x' and () is None (the same split), so the specs compare
        # and hash equal
        return None if len(e) == 0 else (e[0] if len(e) == 1 else tuple(e))
    raise TypeError(
        f"a PartitionSpec entry must be None, a mesh-axis name, a tuple of names or "
        f"PartitionSpec.UNCONSTRAINED; got {e!r} of type {type(e).__name__}")


class PartitionSpec(tuple):
    """How each dimension of an array is split over mesh axes.

    A tuple subclass: ``PartitionSpec('x', None) == ('x', None)``. Each entry is
    ``None`` (not split), a mesh-axis name, a tuple of names (split over their
    product, first name major), or ``PartitionSpec.UNCONSTRAINED`` (only in
    sharding constraints). Trailing dimensions not mentioned are not split.

    >>> PartitionSpec('data', None)
    PartitionSpec('data', None)
    >>> PartitionSpec(('x', 'y')) == (('x', 'y'),)
    True
    >>> PartitionSpec(('x',), ()) == PartitionSpec('x', None)   # normalised, as in jax
    True
    """

    UNCONSTRAINED = UNCONSTRAINED

    def __new__(cls, *partitions):
        return super().__new__(cls, tuple(_check_entry(p) for p in partitions))

    def __repr__(self):
        return "PartitionSpec" + tuple.__repr__(self)

    def __reduce__(self):
        return (PartitionSpec, tuple(self))

    def __getnewargs__(self):
        return tuple(self)


P = PartitionSpec


# --- Mesh --------------------------------------------------------------------

_UNSET = object()


class _MeshLocal(NotifyingLocal):
    """This thread's mesh state: ``stack``, the ``with mesh:`` blocks as ``(mesh, tick)``
    (None until the first), and ``set``, the ``set_mesh`` value and its tick. The class
    attributes are what a thread that never set them reads: without them a read on such a
    thread raises and catches an AttributeError (~0.3 us; get_mesh runs a dozen times per
    model call)."""

    stack = None
    set = (_UNSET, -1)


_mesh_tls = _MeshLocal()
_mesh_tick = itertools.count()   # orders ``with mesh:`` entries and set_mesh calls


def _mesh_stack() -> list:
    """This thread's ``with mesh:`` blocks, innermost last, as ``(mesh, tick)``."""
    s = _mesh_tls.stack
    if s is None:
        s = _mesh_tls.stack = []
    return s


def _set_slot() -> tuple:
    """This thread's ``set_mesh`` value and its tick (``(_UNSET, -1)`` before any)."""
    return _mesh_tls.set


class Mesh:
    """An n-d array of devices with a name per axis (mirror of ``jax.sharding.Mesh``).

    Usable as a context manager: inside ``with mesh:`` it is the active mesh
    (thread-local, nestable) returned by :func:`get_mesh`.

    >>> import numpy as np, ctrainstate as cts
    >>> m = cts.Mesh(np.array(cts.devices()[:1]), ('x',))
    >>> dict(m.shape), m.size
    ({'x': 1}, 1)
    """

    def __init__(self, devices, axis_names):
        if isinstance(axis_names, str):
            axis_names = (axis_names,)
        try:
            names = tuple(axis_names)
        except TypeError:
            raise TypeError(f"axis_names must be a tuple of strings, got {axis_names!r}") from None
        for n in names:
            if not isinstance(n, str):
                raise TypeError(f"mesh axis names must be strings, got {n!r} in {names!r}")
        if isinstance(devices, np.ndarray):
            arr = devices.astype(object, copy=True)
        else:
            arr = np.array(devices, dtype=object)
        for d in arr.flat:
            if not isinstance(d, Device):
                raise TypeError(f"a Mesh holds Device objects, got {d!r}")
        if arr.ndim == 0:
            raise ValueError("Mesh: the device array must have rank >= 1")
        if arr.ndim != len(names):
            raise ValueError(
                f"Mesh: got {len(names)} axis names {names!r} for a device array of rank "
                f"{arr.ndim} (shape {arr.shape}); give one name per dimension")
        ids = [d.id for d in arr.flat]
        _C.mesh_check(arr.shape, names, ids)
        arr.flags.writeable = False
        self._devices = arr
        self._axis_names = names
        self._ids = tuple(ids)
        self._shape = collections.OrderedDict(zip(names, arr.shape))

    @property
    def devices(self) -> np.ndarray:
        return self._devices

    @property
    def axis_names(self) -> tuple:
        return self._axis_names

    @property
    def shape(self) -> "collections.OrderedDict[str, int]":
        """Ordered mapping from axis name to size."""
        return collections.OrderedDict(self._shape)

    @property
    def axis_sizes(self) -> tuple:
        return tuple(self._shape.values())

    @property
    def size(self) -> int:
        return int(self._devices.size)

    @property
    def device_ids(self) -> np.ndarray:
        return np.array(self._ids, dtype=np.int64).reshape(self._devices.shape)

    @property
    def local_devices(self) -> list:
        """This process's devices of the mesh, in mesh order."""
        if _process["count"] == 1:
            return list(self._devices.flat)
        return [d for d in self._devices.flat if d._is_local()]

    @property
    def is_multi_process(self) -> bool:
        """Whether the mesh holds devices of more than one process."""
        return len({d.process_index for d in self._devices.flat}) > 1

    @property
    def local_mesh(self) -> "Mesh":
        """The sub-mesh of this process's devices, with the same axis names (jax's
        ``Mesh.local_mesh``): along each axis, the positions where this process has
        devices. ``ValueError`` when those devices do not form such a block (then the
        positions hold another process's devices too) or when the mesh has none of them.

        >>> import ctrainstate as cts
        >>> m = cts.make_mesh((1,), ('x',))
        >>> m.local_mesh == m   # one process
        True
        """
        if _process["count"] == 1:
            return self
        mine = np.vectorize(lambda d: d._is_local(), otypes=[bool])(self._devices)
        if not mine.any():
            raise ValueError(f"{self!r} has none of this process's devices "
                             f"(process {_process['index']})")
        idx = [np.flatnonzero(mine.any(axis=tuple(a for a in range(mine.ndim) if a != k)))
               for k in range(mine.ndim)]
        block = np.ix_(*idx)
        if not mine[block].all():
            raise ValueError(
                f"{self!r}: the devices of process {_process['index']} do not form a block of "
                f"the mesh (along each axis, the positions where it has devices hold other "
                f"processes' devices too), so it has no local mesh")
        return Mesh(self._devices[block], self._axis_names)

    @property
    def empty(self) -> bool:
        return self.size == 0

    def __enter__(self):
        _mesh_stack().append((self, next(_mesh_tick)))
        return self

    def __exit__(self, *exc):
        stack = _mesh_stack()
        if not stack or stack[-1][0] is not self:
            raise RuntimeError("Mesh contexts exited out of order")
        stack.pop()
        return False

    def _key(self):
        return (self._axis_names, self._devices.shape, self._ids)

    def __eq__(self, other):
        return isinstance(other, Mesh) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return "Mesh(%s)" % ", ".join(f"{n!r}: {s}" for n, s in self._shape.items())


def get_mesh() -> Mesh | None:
    """The active mesh of this thread, or None: the innermost ``with mesh:`` block or the
    last :func:`set_mesh`, whichever came later."""
    # (_mesh_stack() and _set_slot() read inline: this runs several times per module call)
    tls = _mesh_tls
    stack = tls.stack
    mesh, tick = tls.set
    if stack and stack[-1][1] > tick:
        return stack[-1][0]
    return None if mesh is _UNSET else mesh


class _SetMesh:
    """What ``set_mesh`` returns: leaving it as a ``with`` block restores the previous
    ``set_mesh`` value (``with mesh:`` blocks are not touched)."""

    def __init__(self, mesh, saved):
        self._mesh, self._saved = mesh, saved

    def __enter__(self):
        return self._mesh

    def __exit__(self, *exc):
        _mesh_tls.set = self._saved
        return False


def set_mesh(mesh: Mesh | None) -> _SetMesh:
    """Make ``mesh`` the active mesh of this thread (``jax.set_mesh``): at once, as a
    setter, or for a block, ``with set_mesh(mesh):``, after which the previous ``set_mesh``
    value is back. ``set_mesh(None)`` deactivates any mesh. Equivalent to ``with mesh:`` for
    everything that reads the active mesh (PartitionSpecs in jit/device_put, axis rules,
    constraints, born-sharded params).

    As in JAX, the value lives in one thread-local slot, apart from the ``with mesh:``
    blocks: the setter replaces it (calling it in a loop keeps nothing else), and calling
    it inside ``with a:`` makes its mesh active there and after the block. Whichever of
    the slot and the innermost ``with mesh:`` was set later is the active mesh.

    >>> import ctrainstate as cts
    >>> m = cts.make_mesh((1,), ('x',))
    >>> with cts.set_mesh(m):
    ...     cts.get_mesh() is m
    True
    >>> cts.get_mesh() is None
    True
    """
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"set_mesh needs a Mesh (or None), got {type(mesh).__name__}")
    saved = _set_slot()
    _mesh_tls.set = (mesh, next(_mesh_tick))
    return _SetMesh(mesh, saved)


# --- Shardings -------------------------------------------------------------------


class Sharding:
    """Base of the shardings: how an array of a given shape is split over devices."""

    _cache: dict

    def _mesh_args(self):
        raise NotImplementedError

    def _norm_spec(self) -> tuple:
        raise NotImplementedError

    @property
    def _mesh_devices(self) -> list:
        raise NotImplementedError

    def _layout(self, shape: tuple):
        """(shard_shape, [(device, start, replica_id)], num_replicas) for ``shape``; validated in C."""
        if type(shape) is not tuple:
            shape = _dtypes.int_tuple(shape, "a global shape")
        hit = self._cache.get(shape)   # (ints and numpy ints hash and compare alike)
        if hit is None:
            shape = _dtypes.int_tuple(shape, "a global shape")
            mshape, names, ids = self._mesh_args()
            shard_shape, blocks, nrep = _C.layout(mshape, names, ids, self._norm_spec(), shape)
            devs = self._mesh_devices
            hit = (shard_shape, [(devs[i], b[0], b[1]) for i, b in enumerate(blocks)], nrep)
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[shape] = hit
        return hit

    def shard_shape(self, global_shape) -> tuple:
        """Shape of every shard of an array of ``global_shape``."""
        return self._layout(global_shape)[0]

    def devices_indices_map(self, global_shape) -> dict:
        """Device -> tuple of slices of the global array that device holds; as in jax, a
        dimension that is not split is ``slice(None)``."""
        shard_shape, blocks, _ = self._layout(global_shape)
        parts = self._dim_parts(len(tuple(global_shape)))
        return {d: shard_index(start, shard_shape, parts) for d, start, _ in blocks}

    def _dim_parts(self, ndim: int) -> tuple:
        """How many pieces each of ``ndim`` dimensions is split into (the product of the
        sizes of its mesh axes; 1 for an unsharded dimension)."""
        mshape, names, _ = self._mesh_args()
        sizes = dict(zip(names, mshape))
        norm = tuple(self._norm_spec())
        return tuple(math.prod(sizes[a] for a in (norm[d] if d < len(norm) else ()))
                     for d in range(ndim))

    @property
    def device_set(self) -> set:
        return set(self._mesh_devices)

    @property
    def addressable_devices(self) -> set:
        """The devices of the sharding that belong to this process."""
        if _process["count"] == 1:
            return self.device_set
        return {d for d in self._mesh_devices if d._is_local()}

    @property
    def is_fully_addressable(self) -> bool:
        """Whether every device of the sharding belongs to this process (always, in a job
        of one process)."""
        if _process["count"] == 1:
            return True
        return all(d._is_local() for d in self._mesh_devices)

    def _addressable_layout(self, shape: tuple):
        """:meth:`_layout`'s blocks of this process's devices: (shard_shape, [(device,
        start, replica_id)]), in mesh order."""
        shard_shape, layout, _ = self._layout(shape)
        if _process["count"] == 1:
            return shard_shape, layout
        return shard_shape, [b for b in layout if b[0]._is_local()]

    def addressable_devices_indices_map(self, global_shape) -> dict:
        """:meth:`devices_indices_map` for this process's devices only."""
        return {d: i for d, i in self.devices_indices_map(global_shape).items()
                if d._is_local()}

    @property
    def num_devices(self) -> int:
        return len(self._mesh_devices)

    def is_equivalent_to(self, other: "Sharding", ndim: int) -> bool:
        """True when both place every element of an ``ndim``-d array on the same devices
        (``P('x')`` and ``P('x', None)``, or one device as a mesh and as a single device)."""
        if not isinstance(other, Sharding):
            return False
        # a dimension of the product of both device counts splits evenly over any mesh axes
        shape = (math.lcm(self.num_devices, other.num_devices),) * ndim
        try:
            a = self.devices_indices_map(shape)
            b = other.devices_indices_map(shape)
        except ValueError:
            return False
        return a == b and self._mesh_devices == other._mesh_devices


class NamedSharding(Sharding):
    """A mesh and a :class:`PartitionSpec` (mirror of ``jax.sharding.NamedSharding``).

    >>> import numpy as np, ctrainstate as cts
    >>> mesh = cts.Mesh(np.array(cts.devices()[:1]), ('x',))
    >>> cts.NamedSharding(mesh, cts.P('x')).shard_shape((8, 2))
    (8, 2)
    """

    def __init__(self, mesh: Mesh, spec: PartitionSpec = PartitionSpec()):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"NamedSharding needs a Mesh, got {type(mesh).__name__}")
        if spec is None:
            spec = PartitionSpec()
        if not isinstance(spec, PartitionSpec):
            if isinstance(spec, (tuple, list)):
                spec = PartitionSpec(*spec)
            else:
                raise TypeError(f"NamedSharding needs a PartitionSpec, got {spec!r}")
        norm = []
        for i, e in enumerate(spec):
            if e is UNCONSTRAINED:
                raise ValueError(
                    f"{spec!r}: UNCONSTRAINED (dimension {i}) is only allowed in sharding "
                    f"constraints, not in a NamedSharding")
            norm.append(() if e is None else ((e,) if isinstance(e, str) else tuple(e)))
        self.mesh = mesh
        self.spec = spec
        self._norm = tuple(norm)
        self._cache = {}
        mshape, names, ids = self._mesh_args()
        _C.layout(mshape, names, ids, self._norm, None)  # unknown / repeated mesh axes

    def _mesh_args(self):
        return (self.mesh.devices.shape, self.mesh.axis_names, self.mesh._ids)

    def _norm_spec(self):
        return self._norm

    @property
    def _mesh_devices(self):
        return list(self.mesh.devices.flat)

    @property
    def is_fully_replicated(self) -> bool:
        sizes = self.mesh.shape
        n = 1
        for e in self._norm:
            for a in e:
                n *= sizes[a]
        return n == 1

    def _key(self):
        norm = list(self._norm)
        while norm and norm[-1] == ():
            norm.pop()
        return (self.mesh, tuple(norm))

    def __eq__(self, other):
        if other is self:
            return True
        if not isinstance(other, NamedSharding):
            return False
        if other.mesh is self.mesh:
            # what _key() compares, without building the keys: the splits, less trailing
            # unsplit dimensions
            a, b = self._norm, other._norm
            if a == b:
                return True
            n = min(len(a), len(b))
            return a[:n] == b[:n] and not any(a[n:]) and not any(b[n:])
        return self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return f"NamedSharding(mesh={self.mesh!r}, spec={self.spec!r})"


class SingleDeviceSharding(Sharding):
    """The whole array on one device.

    One object per device: ``SingleDeviceSharding(d) is SingleDeviceSharding(d)``, so the
    Arrays placed on a device (``device_put(numpy_value)``, numpy operands of ops) share
    their sharding, and the ops' plan caches, keyed by sharding object, hit for them as
    for the Arrays an op makes. (A sharding is immutable; a subclass gets new objects.)
    """

    def __new__(cls, device: Device):
        if cls is SingleDeviceSharding:
            s = _SINGLE.get(id(device))
            if s is not None and s.device is device:
                return s
        return super().__new__(cls)

    def __init__(self, device: Device):
        if self.__dict__.get("device") is device:
            return      # the device's object, made before
        if not isinstance(device, Device):
            raise TypeError(f"SingleDeviceSharding needs a Device, got {device!r}")
        self.device = device
        self._cache = {}
        if type(self) is SingleDeviceSharding:
            _SINGLE[id(device)] = self   # (devices live as long as the process)

    def __reduce__(self):
        # (copies and pickles are made by the constructor: the device's object)
        return type(self), (self.device,)

    def _mesh_args(self):
        return ((1,), ("__single__",), (self.device.id,))

    def _norm_spec(self):
        return ()

    @property
    def _mesh_devices(self):
        return [self.device]

    @property
    def is_fully_replicated(self) -> bool:
        return True

    def __eq__(self, other):
        return isinstance(other, SingleDeviceSharding) and other.device is self.device

    def __hash__(self):
        return hash(("single", self.device.id))

    def __repr__(self):
        return f"SingleDeviceSharding(device={self.device!r})"


# SingleDeviceSharding's object per device (by the device's id(); the entry keeps the device)
_SINGLE: dict = {}


def default_sharding() -> Sharding:
    """Replicated over the active mesh, else the first device."""
    m = get_mesh()
    if m is not None:
        return NamedSharding(m, PartitionSpec())
    return SingleDeviceSharding(_local_devices()[0])   # (this process's first, as jax)


def _replicate_uneven(sharding, shape):
    """Under ``jit`` / ``pjit``, ``sharding`` with every dimension its mesh axes do not
    divide replicated; elsewhere (or for a sharding without a spec) ``sharding`` itself.

    Inside a jitted function XLA keeps a logical constraint on such a dimension without
    failing (jax pads the shards); ctrainstate shards only evenly, so that dimension is
    replicated instead. An eager placement of such a spec raises, as ``jax.device_put`` does.

    >>> import numpy as np, ctrainstate as cts
    >>> from ctrainstate._src.base.trace_state import jit_scope
    >>> mesh = cts.Mesh(np.array(cts.devices()[:1]).reshape(1), ('mp',))
    >>> s = cts.NamedSharding(mesh, cts.P('mp', None))
    >>> _replicate_uneven(s, (7, 2)) is s   # outside jit: as given
    True
    >>> with jit_scope():                    # a size-1 axis divides every dimension
    ...     _replicate_uneven(s, (7, 2)).spec
    PartitionSpec('mp', None)
    """
    if not in_jit() or not isinstance(sharding, NamedSharding):
        return sharding
    uneven = _uneven_dims(sharding, shape)
    if not uneven:
        return sharding
    spec = list(sharding.spec)
    for i, _, _ in uneven:
        spec[i] = None
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def _uneven_dims(sharding, shape) -> list:
    """``[(dimension, mesh axes, parts)]`` for each dimension of ``shape`` that the mesh
    axes ``sharding`` gives it do not divide (unknown mesh axes are left to the layout)."""
    sizes = dict(sharding.mesh.shape)
    out = []
    for i, e in enumerate(list(sharding.spec)[:len(shape)]):
        if e is None or e is PartitionSpec.UNCONSTRAINED:
            continue
        axes = (e,) if isinstance(e, str) else tuple(e)
        if any(a not in sizes for a in axes):
            continue
        parts = int(np.prod([sizes[a] for a in axes], dtype=np.int64))
        if parts > 1 and int(shape[i]) % parts:
            out.append((i, axes, parts))
    return out


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
