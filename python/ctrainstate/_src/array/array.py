"""The implementation of :mod:`ctrainstate.array` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations
from ..base.hooks import provide as _provide
_provide('array', __name__)   # lower layers call into this module through _hooks.upper

import warnings
import html
from typing import Any, Callable, NamedTuple

import numpy as np

from ... import _C
from ..base import dtypes as _dtypes
from ..base.devices import Device
from .operators import OperatorsMixin
from .sharding import (NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding,
                       default_sharding, shard_index)
from ..base.tree_util import register_leaf_type, tree_leaves, tree_map
from .abstract import is_abstract, ShapeDtypeStruct
from ..base.devices import _by_id, _device_by_id, _ids, devices, devices as _devices, local_devices
from ..base.devices import _process as _devices_process
from .sharding import get_mesh, Mesh
from ..base.tree_util import _flatten_up_to, tree_flatten, tree_unflatten
from ..base.hooks import upper as _upper

__all__ = ["Array", "Shard", "device_put", "device_get", "from_dlpack", "block_until_ready",
           "visualize_sharding",
           "visualize_array_sharding", "make_array_from_callback",
           "make_array_from_single_device_arrays", "make_array_from_process_local_data"]

DonatedBufferError = _C.DonatedBufferError


class Shard(NamedTuple):
    """One device's block of an Array."""

    device: Device
    index: tuple          # tuple of slices into the global array
    replica_id: int
    data: Any             # numpy view of the block (CPU devices); on GPUs a single-device
                          # Array sharing the device buffer (np.asarray copies it to the host;
                          # __dlpack__ hands it to torch/cupy/jax without a copy)


def _buffer_view(buf, shape, dtype) -> np.ndarray:
    """Zero-copy numpy view of a CPU buffer."""
    return np.frombuffer(buf, dtype=np.uint8).view(dtype).reshape(shape)


class _ArrayMethods(OperatorsMixin):
    """A global array stored as per-device shards.

    Attributes mirror ``jax.Array``: ``shape``, ``dtype``, ``ndim``, ``size``,
    ``nbytes`` (of the global array), ``sharding``, ``addressable_shards``,
    ``is_fully_replicated``. ``np.asarray(a)`` gathers.

    ``Array`` is a C type (``ctrainstate._C.Array``): its fields, ``shape``, ``dtype``,
    ``ndim``, ``sharding``, the arithmetic operators (through the ops' C plan caches),
    ``_create``, ``_moved`` and ``_check_alive`` are C; the methods below are attached to it
    once at import (``_C.array_type_extend``), after which the type is immutable.
    """

    __slots__ = ()

    # As jax.Array: numpy's operators defer to ours (``ndarray @ Array`` is ctrainstate's
    # matmul, differentiated and sharded) because the priority is higher than ndarray's, while
    # numpy functions and ufuncs called on an Array (``np.sqrt(x)``, ``np.isfinite(x)``) read
    # it with ``__array__`` (a gather to the host) and return numpy arrays.
    __array_priority__ = 100

    # --- metadata (shape, dtype, ndim, sharding: C) ------------------------------------
    @property
    def size(self) -> int:
        return int(np.prod(self._shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self._dtype.itemsize

    @property
    def is_fully_replicated(self) -> bool:
        return self._sharding.is_fully_replicated

    @property
    def is_fully_addressable(self) -> bool:
        """Whether this process holds every shard (always, in a job of one process); an
        Array over a mesh of several processes holds only this process's shards."""
        return self._sharding.is_fully_addressable

    def __len__(self):
        if not self._shape:
            raise TypeError("len() of a 0-d Array")
        return self._shape[0]

    # --- liveness -----------------------------------------------------------------
    def is_deleted(self) -> bool:
        return self._donated or any(b.is_deleted for _, b, _, _ in self._blocks)

    def delete(self) -> None:
        """Free the device memory now; later use raises ``DonatedBufferError``. A view of
        another Array's shard (a GPU ``Shard.data``) only becomes unusable itself. All
        shards are freed or none: ``RuntimeError`` (nothing freed) while a numpy view of a
        shard is alive or an operation in another thread is using one."""
        if self._base is not None:
            self._donated = True
            return
        _C.delete_buffers([buf for _, buf, _, _ in self._blocks])

    def _check_not_view(self):
        if self._base is not None:
            raise ValueError(
                "this Array is a view of another Array's shard (Shard.data): it cannot be "
                "donated or updated in place (e.g. as TrainState params); pass a copy, "
                "cts.device_put(np.asarray(x), x.sharding)")

    def _donate(self):
        """Hand the buffers to a new owner; this Array becomes unusable."""
        self._check_alive()
        self._check_not_view()
        self._donated = True
        return self._blocks

    @staticmethod
    def _moved_all(arrays) -> list:
        """``[a._moved() for a in arrays]`` in one C loop (``_C.move_arrays``: the optimizer
        step moves every param and state Array, 444 of them for a 148-leaf AdamW state).
        If an Array is a view or already donated, none is moved and ``_moved`` raises for
        it."""
        arrays = arrays if type(arrays) is list else list(arrays)
        out = _C.move_arrays(arrays)
        if type(out) is int:
            arrays[out]._moved()   # raises DonatedBufferError / ValueError
            raise AssertionError(f"move_arrays refused Array {out}, which _moved accepted")
        return out

    # --- data -----------------------------------------------------------------
    @property
    def addressable_shards(self) -> list:
        self._check_alive()
        out = []
        parts = self._sharding._dim_parts(len(self._shape))
        for dev, buf, start, rid in self._blocks:
            index = shard_index(start, self._shard_shape, parts)
            if dev.platform == "cpu":
                data = _buffer_view(buf, self._shard_shape, self._dtype)
            else:  # the same buffer, as an Array of its own (as jax's Shard.data): a view
                data = Array._create(self._shard_shape, self._dtype, SingleDeviceSharding(dev),
                                     [(dev, buf, (0,) * len(self._shard_shape), 0)])
                data._base = self
            out.append(Shard(dev, index, rid, data))
        return out

    @property
    def global_shards(self) -> list:
        """A :class:`Shard` for every device of the sharding, in mesh order (jax's
        ``global_shards``): this process's as :attr:`addressable_shards` gives them, other
        processes' with ``data=None``."""
        self._check_alive()
        if self.is_fully_addressable:
            return self.addressable_shards
        mine = {s.device: s for s in self.addressable_shards}
        shard_shape, layout, _ = self._sharding._layout(self._shape)
        parts = self._sharding._dim_parts(len(self._shape))
        return [mine[dev] if dev in mine else
                Shard(dev, shard_index(start, shard_shape, parts), rid, None)
                for dev, start, rid in layout]

    def addressable_data(self, index: int) -> "Array":
        """This process's shard ``index`` (in :attr:`addressable_shards`' order) as an
        Array on its one device (``jax.Array.addressable_data``), sharing the shard's buffer:
        a view, which cannot be donated.

        >>> import numpy as np, ctrainstate as cts
        >>> a = cts.device_put(np.float32([1, 2]))
        >>> a.addressable_data(0).tolist()
        [1.0, 2.0]
        """
        self._check_alive()
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"addressable_data: index must be an int, got {index!r}")
        n = len(self._blocks)
        if not -n <= index < n:
            raise IndexError(f"addressable_data: index {index} out of range for {n} "
                             f"addressable shards")
        dev, buf, _, _ = self._blocks[index]
        view = Array._create(self._shard_shape, self._dtype, SingleDeviceSharding(dev),
                             [(dev, buf, (0,) * len(self._shard_shape), 0)])
        view._base = self
        return view

    # __array__(dtype=None, copy=None): C (csrc/python/py_array.c), the Array gathered to a
    # new numpy array. There is no __array_ufunc__, as on jax.Array: a numpy ufunc of an
    # Array converts it with __array__ and returns numpy, while `ndarray (op) Array` runs the
    # Array's reflected operator (__array_priority__), an Array.

    # --- DLPack: __dlpack__ and __dlpack_device__ are C (py_array.c): the first device's
    # buffer when the Array is held whole by each device, BufferError when sharded.

    def devices(self) -> set:
        """The devices holding a shard (``jax.Array.devices()``): of every process, for an
        Array that spans processes."""
        if not self.is_fully_addressable:
            return self._sharding.device_set
        return {d for d, _, _, _ in self._blocks}

    def block_until_ready(self) -> "Array":
        self._check_alive()
        for dev in {d for d, _, _, _ in self._blocks}:
            dev.synchronize()
        return self

    # item(), __float__, __int__, __bool__: C (py_array.c), the one element read through
    # __array__'s gather (ValueError for another size).

    def __repr__(self):
        """``Array([1., 2.], dtype=float32)`` as jax prints it (numpy's layout, summarised
        with ``...`` beyond numpy's print threshold), followed by
        ``sharding=P(...) on Mesh(...)`` when more than one device holds the Array. A large
        Array reads only the edge items the summary shows (see :meth:`_host_preview`)."""
        gone = self._gone_text()
        if gone:
            return gone
        prefix, dtype_str = "Array(", f"dtype={self._dtype.name}"
        if not self._has_full_value():   # (jax prints no values for such an Array)
            return (f"{prefix}shape={self._shape}, {dtype_str}, "
                    f"sharding={self._sharding_text()}, is_fully_addressable=False)")
        sharded = self._sharding_text()
        if not self._shape:
            text = f"{prefix}{_scalar_text(self._scalar_value())}, {dtype_str}"
        else:   # jax's ArrayImpl.__repr__ layout
            line_width = np.get_printoptions()["linewidth"]
            if self.size == 0:
                s = f"[], shape={self._shape}"
            else:
                host, summarise = self._host_preview()
                with np.printoptions(**({"threshold": 0} if summarise else {})):
                    s = np.array2string(host, prefix=prefix, suffix=",", separator=", ",
                                        max_line_width=line_width)
            last_line_len = len(s) - s.rfind("\n") + 1
            sep = " " * len(prefix) if last_line_len + len(dtype_str) + 2 > line_width else " "
            text = f"{prefix}{s},{sep}{dtype_str}"
        if sharded:
            sharded = f"sharding={sharded}"
            last = len(text) - text.rfind("\n")
            text += (f",\n{' ' * len(prefix)}{sharded}"
                     if last + len(sharded) + 3 > np.get_printoptions()["linewidth"]
                     else f", {sharded}")
        return text + ")"

    def __str__(self):
        """The values as numpy prints them (``[1. 2.]``), as ``str(jax_array)``."""
        gone = self._gone_text()
        if gone:
            return gone
        if not self._shape:
            return _scalar_text(self._scalar_value())
        if self.size == 0:
            return "[]"
        host, summarise = self._host_preview()
        with np.printoptions(**({"threshold": 0} if summarise else {})):
            return np.array2string(host, separator=" ")

    def _has_full_value(self) -> bool:
        """Whether this process holds every element: a fully addressable Array, or one
        whose shards here cover it (replicated across processes)."""
        if self._sharding.is_fully_addressable:
            return True
        starts = {start for _, _, start, _ in self._blocks}
        return len(starts) * int(np.prod(self._shard_shape, dtype=np.int64)) == self.size

    def _gone_text(self) -> str:
        if self._donated:
            return f"Array(<donated>, shape={self._shape}, dtype={self._dtype})"
        if self.is_deleted():
            return f"Array(<deleted>, shape={self._shape}, dtype={self._dtype})"
        return ""

    def _sharding_text(self) -> str:
        """'' on one device; ``P('x', None) on Mesh('x': 4)`` for a NamedSharding."""
        if len(self._blocks) <= 1 and self._sharding.is_fully_addressable:
            return ""
        s = self._sharding
        if isinstance(s, NamedSharding):
            return f"P{tuple.__repr__(s.spec)} on {s.mesh!r}"
        return repr(s)

    def _host_preview(self):
        """(host array, summarise). Up to numpy's print threshold, the whole Array. Beyond
        it, only what numpy's summary shows: along each dimension longer than twice
        ``edgeitems``, the first and last ``edgeitems`` indices plus one more (a stand-in
        for the elided middle, never printed), read from each device's block; printed with
        ``threshold=0`` so that numpy elides exactly those dimensions, as it would for the
        whole array (numpy formats a summary from the shown items only)."""
        opts = np.get_printoptions()
        if self.size <= opts["threshold"]:
            return np.asarray(self), False
        e = opts["edgeitems"]
        idx = [np.r_[0:e, n - e - 1:n] if n > 2 * e + 1 else np.arange(n)
               for n in self._shape]
        if any(dev.platform != "cpu" for dev, _, _, _ in self._blocks) or (
                not self._sharding.is_fully_addressable):
            return self._gather_items(idx), True
        return self._read_items(idx), True

    def _gather_items(self, idx) -> np.ndarray:
        """``np.asarray(self)[np.ix_(*idx)]`` by a gather on the devices (only the selected
        items reach the host)."""
        return np.asarray(self[np.ix_(*idx)])

    def _read_items(self, idx) -> np.ndarray:
        """``np.asarray(self)[np.ix_(*idx)]`` read from the blocks' host views (CPU devices):
        each block gives the selected items it holds."""
        out = np.empty(tuple(len(i) for i in idx), self._dtype)
        for dev, buf, start, rid in self._blocks:
            if rid != 0:
                continue
            view = _buffer_view(buf, self._shard_shape, self._dtype)
            pos, local = [], []
            for i, s0, n in zip(idx, start, self._shard_shape):
                inside = (i >= s0) & (i < s0 + n)
                pos.append(np.nonzero(inside)[0])
                local.append(i[inside] - s0)
            if all(len(p) for p in pos):
                out[np.ix_(*pos)] = view[np.ix_(*local)]
        return out

    def _scalar_value(self):
        """The value of a 0-d Array as a numpy scalar (from the host copy a counter keeps,
        else read from the device)."""
        if self._host_scalar is not None:
            return np.asarray(self._host_scalar, self._dtype)[()]
        return np.asarray(self)[()]

    def __format__(self, spec):
        # f"{loss:.4f}": a scalar formats like its value (jax.Array does the same)
        if not self._shape:
            v = self._scalar_value()
            return format(_py_scalar(v), spec) if spec else _scalar_text(v)
        if not spec:
            return str(self)
        raise TypeError(f"format spec {spec!r} applies to scalars; this Array has shape "
                        f"{self._shape}: format np.asarray(x) (gathers to the host) instead")

    # --- comparisons: elementwise, bool Arrays ------------------------------------------------
    # x < y, <=, ==, !=, >, >= are the C type's (csrc/python/py_dispatch.c): the primitives
    # ctrainstate.numpy.less ... greater_equal for an Array, a Python number or a numpy array or
    # scalar on the other side, NotImplemented for anything else; hashed by identity (C too)

    # --- indexing (numpy's basic and advanced indices): ctrainstate._src.ops.slicing ------------------
    # x[idx] (numpy's indexing, as jax.Array; the docstring is C's): basic indices of an Array
    # every device holds whole run in C (csrc/python/py_slice.c), every other index goes to
    # ops.slicing.getitem, which registers itself there
    __getitem__ = _C.array_getitem

    @property
    def at(self):
        """Functional updates, as in jax: ``x.at[idx].set(v)``, ``.add(v)``,
        ``.multiply(v)``, ``.divide(v)``, ``.get()`` for any index ``x[idx]`` takes (float32
        Arrays; duplicate indices accumulate in add/multiply, the last value wins in set;
        out-of-range index entries are dropped, as in jax)."""
        return _upper('_slicing')._IndexUpdateHelper(self)

    def __iter__(self):
        if not self._shape:
            raise TypeError("iteration over a 0-d Array")
        return (self[i] for i in range(self._shape[0]))   # (as jax.Array: x[0], x[1], ...)

    # --- host conversions and copies ---------------------------------------------------------
    def tolist(self):
        """The values as nested Python lists (gathers to the host, like ``jax.Array.tolist``)."""
        return np.asarray(self).tolist()

    def astype(self, dtype) -> "Array":
        """A copy converted to ``dtype`` with the same sharding, on each device's own block
        (nothing is gathered): :func:`ctrainstate.numpy.astype` (jax's conversion rules;
        differentiable between float dtypes). An Array already of ``dtype`` is returned as
        it is."""
        return _upper('_ops').astype(self, dtype)

    def conj(self) -> "Array":
        """``jnp.conj(x)``: for the real dtypes ctrainstate stores, the Array itself."""
        return _upper('_numpy_more').conj(self)

    def conjugate(self) -> "Array":
        """``jnp.conjugate(x)``: for real dtypes, the Array itself."""
        return _upper('_numpy_more').conjugate(self)

    @property
    def real(self) -> "Array":
        """``jnp.real(x)``: for real dtypes, the Array itself."""
        return _upper('_numpy_more').real(self)

    @property
    def imag(self) -> "Array":
        """``jnp.imag(x)``: for real dtypes, zeros with the Array's shape, dtype and
        sharding.

        >>> import numpy as np, ctrainstate as cts
        >>> x = cts.device_put(np.float32([1, -2]))
        >>> x.real.tolist(), x.imag.tolist(), x.conj().tolist()
        ([1.0, -2.0], [0.0, 0.0], [1.0, -2.0])
        """
        return _upper('_numpy_more').imag(self)

    def copy(self) -> "Array":
        """A new Array with the same sharding and a copy of every block."""
        return _upper('optim.base').copy_array(self)

    def __copy__(self) -> "Array":
        """``copy.copy``: :meth:`copy` (a new Array with the same sharding)."""
        return self.copy()

    def __deepcopy__(self, memo) -> "Array":
        """``copy.deepcopy``: :meth:`copy`, device to device (each device copies its own
        block; nothing is gathered), so the copy keeps the sharding.

        >>> import copy, numpy as np, ctrainstate as cts
        >>> a = cts.device_put(np.float32([1, 2]))
        >>> b = copy.deepcopy(a)
        >>> b is not a and b.sharding == a.sharding and b.tolist() == [1.0, 2.0]
        True
        """
        return self.copy()

    def __reduce__(self):
        """``pickle``: the values (gathered to the host, as ``np.asarray``) and a description
        of the sharding by device ids. Unpickling places the values with that sharding when
        this process has those devices; otherwise (a process with fewer devices) on the
        first device, with a ``UserWarning`` naming the missing devices, as jax unpickles an
        Array onto a single device.

        >>> import pickle, numpy as np, ctrainstate as cts
        >>> a = cts.device_put(np.float32([1, 2]))
        >>> pickle.loads(pickle.dumps(a))
        Array([1., 2.], dtype=float32)
        """
        self._check_alive()
        return (_unpickle_array, (np.asarray(self), _sharding_state(self._sharding)))

    def _repr_html_(self):
        """The notebook view: the repr (values, dtype, sharding) and, for a 1-d or 2-d
        Array on more than one device, a table of which devices hold which block."""
        return _sharding_html(self)


Array = _C.Array


def _extend_array_type():
    """Attach _ArrayMethods (with OperatorsMixin's methods) to the C type, once."""
    ns: dict = {}
    for klass in reversed(_ArrayMethods.__mro__[:-1]):
        ns.update(vars(klass))
    for name, v in ns.items():
        f = v.fget if isinstance(v, property) else getattr(v, "__func__", v)
        if hasattr(f, "__qualname__") and getattr(f, "__module__", None) in (
                __name__, "ctrainstate._src.array.operators"):
            try:
                f.__qualname__ = f"Array.{name}"
            except (AttributeError, TypeError):
                pass
    _C.array_type_extend(ns)


_extend_array_type()
register_leaf_type(Array)

def _sharding_state(s: Sharding):
    """A sharding as plain data (device ids, axis names, spec) for pickling; None for a
    sharding kind that has no such description (the value is then placed by default)."""
    if isinstance(s, NamedSharding):
        return ("named", s.mesh.device_ids.tolist(), tuple(s.mesh.axis_names), tuple(s.spec))
    if isinstance(s, SingleDeviceSharding):
        return ("single", s.device.id)
    return None


def _unpickle_array(host: np.ndarray, state) -> Array:
    """Place the values of a pickled Array by ``state`` (see :meth:`Array.__reduce__`)."""
    if state is None:
        return device_put(host, local_devices()[0])
    kind, rest = state[0], state[1:]
    ids = np.asarray(rest[0]).reshape(-1).tolist() if kind == "named" else [rest[0]]
    known = {d.id for d in devices("cpu")} | {d.id for d in _gpu_devices()}
    missing = [i for i in ids if i not in known]
    if missing:
        warnings.warn(f"unpickling an Array that was on devices {ids}: this process has no "
                      f"device {missing[0]} ({len(known)} devices); it is placed on "
                      f"{local_devices()[0]!r} instead", UserWarning, stacklevel=2)
        return device_put(host, local_devices()[0])
    if kind == "single":
        return device_put(host, _device_by_id(rest[0]))
    id_grid, names, spec = rest
    devs = np.empty(len(ids), dtype=object)
    devs[:] = [_device_by_id(i) for i in ids]
    mesh = Mesh(devs.reshape(np.shape(id_grid)), names)
    return device_put(host, NamedSharding(mesh, PartitionSpec(*spec)))


def _gpu_devices() -> list:
    return [_by_id[i] for i in _ids("gpu")]


def _scalar_text(v) -> str:
    """A scalar as jax prints it, which is numpy's ``str`` of the scalar: float32 and float16
    in shortest round-trip digits (0.9 for float32(0.9)), bfloat16 as ml_dtypes prints it
    (6 significant digits: 0.100098 for bfloat16(0.1), 1 for 1.0)."""
    if isinstance(v, (np.bool_, np.integer)):
        return str(v.item())
    return str(np.float32(v)) if v.dtype == np.float32 else str(v)


def _py_scalar(v):
    """A numpy scalar as a Python bool/int/float (bfloat16 included) for printing."""
    if isinstance(v, (np.bool_, np.integer)):
        return v.item()
    return float(v)


# --- device_put ------------------------------------------------------------------


def _as_sharding(s) -> Sharding:
    if s is None:
        return default_sharding()
    if isinstance(s, Sharding):
        return s
    if isinstance(s, Device):
        return SingleDeviceSharding(s)
    raise TypeError(
        f"device_put: expected a NamedSharding, SingleDeviceSharding or Device, got "
        f"{type(s).__name__}")


def _alloc_blocks(shape, dtype, sharding, *, addressable: bool = False):
    """(shard_shape, [(device, new Buffer, start, replica_id)]): a buffer for every block of
    ``sharding``'s layout of ``shape``. A sharding with devices of other processes raises
    ``ValueError`` (the caller would compute on blocks it does not have), unless
    ``addressable``: then only this process's blocks, for the callers that make each
    process fill its own (placement from the host, initializers)."""
    if addressable:
        shard_shape, layout = sharding._addressable_layout(shape)
    else:
        shard_shape, layout, _ = sharding._layout(shape)
        if not sharding.is_fully_addressable:
            raise ValueError(
                f"this operation does not support Arrays that span processes yet (the "
                f"sharding {sharding!r} has devices of other processes); gather such an Array "
                f"with ctrainstate.experimental.multihost_utils.process_allgather(x), or work "
                f"on x.addressable_shards")
    code = _dtypes.code(dtype)
    return shard_shape, [
        (dev, _C.Buffer(dev.id, shard_shape, code), start, rid) for dev, start, rid in layout
    ]


def _from_host(x: np.ndarray, sharding: Sharding) -> Array:
    """An Array of ``sharding`` holding ``x``; with devices of other processes, this
    process's blocks of ``x`` (every process passes the same global value)."""
    dtype = x.dtype
    shard_shape, blocks = _alloc_blocks(x.shape, dtype, sharding, addressable=True)
    if dtype == _dtypes.bool_:
        x = x.view(np.uint8)
    for _, buf, start, _ in blocks:
        _C.copy_from_host(buf, x, start)
    return Array._create(x.shape, dtype, sharding, blocks)


def _reshard(a: Array, sharding: Sharding) -> Array:
    """``a`` copied device to device into ``sharding``'s blocks. With devices of other
    processes, each process fills its own blocks from the blocks of ``a`` it holds
    (ValueError where those do not hold the values: that would need data of another
    process)."""
    a._check_alive()
    if not a.is_fully_addressable and not _each_process_holds(a.sharding, sharding, a.shape):
        # a block of some process needs values of another: every process gathers the whole
        # value (a host all-gather; every process runs this same reshard) and places its part
        return _from_host(_upper('distributed')._gather_global(a), sharding)
    shard_shape, blocks = _alloc_blocks(a.shape, a.dtype, sharding, addressable=True)
    want = int(np.prod(shard_shape, dtype=np.int64))
    if a.is_fully_addressable:
        sources = [(dev, buf, start) for dev, buf, start, rid in a._blocks if rid == 0]
    else:   # this process's blocks, one per start (its primaries may be on other processes)
        seen = {}
        for dev, buf, start, rid in a._blocks:
            if rid == 0 or start not in seen:
                seen[start] = (dev, buf, start)
        sources = list(seen.values())
    for dev, buf, start, _ in blocks:
        # Prefer a source block on the same device that covers ours: no cross-device traffic.
        local = [s for s in a._blocks if s[0] is dev and all(
            ss <= ds and ds + n <= ss + m
            for ss, ds, n, m in zip(s[2], start, shard_shape, a._shard_shape))]
        srcs = [(d, b, s) for d, b, s, _ in local[:1]] or sources
        copied = 0
        for _, sbuf, sstart in srcs:
            copied += _C.copy_overlap(buf, start, sbuf, sstart)
            if copied == want:
                break
        if copied != want:
            if not a.is_fully_addressable:
                raise ValueError(
                    f"device_put: resharding an Array that spans processes from "
                    f"{a.sharding!r} to {sharding!r} needs values held by other processes, "
                    f"which is not supported yet; gather it with "
                    f"ctrainstate.experimental.multihost_utils.process_allgather(x) and place "
                    f"the host value instead")
            raise RuntimeError(
                f"internal error: resharding filled {copied} of {want} elements of a shard")
    return Array._create(a.shape, a.dtype, sharding, blocks)


_HOLDS: dict = {}


def _each_process_holds(src: Sharding, dst: Sharding, shape) -> bool:
    """Whether every process's blocks under ``dst`` are covered by that process's own
    blocks under ``src`` (so resharding needs no data from another process). The same
    answer on every process: it reads the layouts only."""
    key = (src, dst, tuple(shape))
    hit = _HOLDS.get(key)
    if hit is None:
        s_shape, s_layout, _ = src._layout(tuple(shape))
        d_shape, d_layout, _ = dst._layout(tuple(shape))
        starts: dict = {}
        for dev, start, _ in s_layout:
            starts.setdefault(dev.process_index, set()).add(start)
        want = int(np.prod(d_shape, dtype=np.int64))
        hit = True
        for dev, start, _ in d_layout:
            have = 0
            for ss in starts.get(dev.process_index, ()):
                have += int(np.prod([max(0, min(d0 + n, s0 + m) - max(d0, s0)) for d0, n, s0, m
                                     in zip(start, d_shape, ss, s_shape)], dtype=np.int64))
            if have < want:
                hit = False
                break
        if len(_HOLDS) > 256:
            _HOLDS.clear()
        _HOLDS[key] = hit
    return hit


def _spec_on_active_mesh(spec) -> NamedSharding:
    mesh = get_mesh()
    if mesh is None:
        raise ValueError(f"device_put got {spec!r} with no active mesh: use it inside "
                         f"`with set_mesh(mesh):` / `with mesh:`, or pass NamedSharding(mesh, spec)")
    return NamedSharding(mesh, spec)


def device_put(x, sharding=None, *, may_alias: bool | None = None, donate: bool = False):
    """Place ``x`` (numpy array, Python scalar, list, or Array) on devices.

    ``sharding``: a :class:`NamedSharding`, a :class:`SingleDeviceSharding`, a
    :class:`Device`, a :class:`PartitionSpec` (on the active mesh, ``with mesh:`` or
    ``set_mesh``), or None — replicated over the active mesh, else the first
    device (an Array with ``sharding=None`` is returned as is). An Array with a
    new sharding is resharded device to device; each device allocates only its
    block. Pytrees are placed leaf by leaf; as in ``jax.device_put``, ``sharding``
    may also be a pytree of shardings that is a prefix of ``x``'s (one sharding per
    leaf, or per subtree).

    >>> import numpy as np, ctrainstate as cts
    >>> a = cts.device_put(np.ones((4, 2), np.float32))
    >>> [s.index for s in a.addressable_shards]
    [(slice(None, None, None), slice(None, None, None))]
    >>> d = cts.local_devices()[0]
    >>> t = cts.device_put({"a": np.zeros(2), "b": [np.ones(3), 1.0]}, {"a": d, "b": d})
    >>> t["b"][0].shape, t["a"].devices() == {d}
    ((3,), True)
    """
    if isinstance(sharding, PartitionSpec):
        sharding = _spec_on_active_mesh(sharding)
    if sharding is not None and not isinstance(sharding, (Sharding, Device)):
        if not isinstance(sharding, (list, tuple, dict)) and not hasattr(sharding, "__dict__"):
            raise TypeError(f"device_put: expected a NamedSharding, SingleDeviceSharding, Device "
                            f"or a pytree of them, got {type(sharding).__name__}")
        s_leaves, s_td = tree_flatten(
            sharding, is_leaf=lambda v: v is None or isinstance(v, (Sharding, Device,
                                                                   PartitionSpec)))
        s_leaves = [_spec_on_active_mesh(v) if isinstance(v, PartitionSpec) else v
                    for v in s_leaves]
        for v in s_leaves:
            if v is not None and not isinstance(v, (Sharding, Device)):
                raise TypeError(f"device_put: a sharding tree holds a {type(v).__name__}, "
                                f"not a sharding or device")
        subtrees = _flatten_up_to(s_td, x)  # x's subtrees at the sharding tree's leaves
        return tree_unflatten(s_td, [device_put(xs, sv, may_alias=may_alias, donate=donate)
                                     for xs, sv in zip(subtrees, s_leaves)])
    if isinstance(x, ShapeDtypeStruct) or (is_abstract() and isinstance(
            x, (Array, np.ndarray, np.generic, int, float, bool))):
        s = _as_sharding(sharding) if sharding is not None else getattr(x, "sharding", None)
        if s is not None:
            s.shard_shape(np.shape(x) if not isinstance(x, (ShapeDtypeStruct, Array)) else x.shape)
        shape = x.shape if isinstance(x, (ShapeDtypeStruct, Array)) else np.shape(x)
        dtype = x.dtype if isinstance(x, (ShapeDtypeStruct, Array)) else _dtypes.canonicalize(np.asarray(x).dtype)
        return ShapeDtypeStruct(shape, dtype, s)
    if not isinstance(x, (Array, np.ndarray, np.generic, int, float, bool)) and not (
            isinstance(x, (list, tuple, dict)) and _is_numeric_list(x)):
        leaves, _ = tree_flatten(x)
        if not (len(leaves) == 1 and leaves[0] is x):
            return tree_map(lambda leaf: device_put(leaf, sharding), x)  # pytrees of arrays
        x = _foreign_array(x)   # a leaf of another type: a jax/torch array, a buffer
    if isinstance(x, Array):
        if sharding is None:
            x._check_alive()
            return x
        s = _as_sharding(sharding)
        if s == x.sharding:
            x._check_alive()
            return x
        if _C.trace_active():   # inside a jit trace: the reshard is an op node of the program
            return _upper('_ops')._put_node(x, s)
        return _reshard(x, s)
    s = _as_sharding(sharding)
    arr = np.asarray(x)
    check_python_ints(x, arr)
    dtype = _dtypes.canonicalize(arr.dtype)
    if arr.dtype != dtype:
        arr = arr.astype(dtype)
    return _from_host(arr, s)


def _foreign_array(x) -> np.ndarray:
    """A leaf that is neither an Array, numpy data nor a Python scalar, as a host array: a jax
    or torch (CPU) array, anything with ``__array__`` or the buffer protocol."""
    if isinstance(x, (str, bytes)):
        raise TypeError(f"device_put: cannot place a {type(x).__name__} ({x!r:.40}): expected "
                        f"an array, a Python scalar or a pytree of them")
    try:
        return np.asarray(x)
    except Exception as e:
        raise TypeError(f"device_put: cannot place a {type(x).__name__}: expected an array "
                        f"(numpy, jax, torch, or with __array__ / the buffer protocol), a Python "
                        f"scalar or a pytree of them ({e})") from None


def check_python_ints(x, arr) -> None:
    """Python ints (a scalar, or in lists / tuples; ``arr`` is ``np.asarray(x)``) that int32,
    their dtype without x64, cannot hold raise OverflowError, as in jax; numpy int64 data is
    narrowed as jax narrows it. Beyond int64 numpy holds them as objects."""
    if isinstance(x, (bool, np.ndarray, np.generic)) or not isinstance(x, (int, list, tuple)):
        return
    if arr.dtype == object:
        vals = [v for v in arr.flat if isinstance(v, int) and not isinstance(v, bool)]
    elif arr.dtype.kind in "iu" and arr.size:
        vals = arr[(arr < -2 ** 31) | (arr >= 2 ** 31)].tolist()
    else:
        return
    bad = [v for v in vals if not -2 ** 31 <= v < 2 ** 31]
    if bad:
        raise OverflowError(f"Python int {bad[0]} too large to convert to int32")


def from_dlpack(x, device=None) -> Array:
    """An Array holding a copy of a DLPack tensor (numpy, torch, cupy, jax, ...).

    CPU tensors go to ``device`` (default: the first device, or replicated over the
    active mesh); CUDA tensors go to a device of the same GPU (the first logical
    device of that GPU unless ``device`` is given), copied device to device.
    """
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"from_dlpack needs an object with __dlpack__, got {type(x).__name__}")
    dev_type, dev_id = x.__dlpack_device__()
    if int(dev_type) in (1, 3):  # kDLCPU, kDLCUDAHost
        return device_put(np.from_dlpack(x), device)
    if int(dev_type) not in (2, 13):
        raise ValueError(f"DLPack device type {dev_type} is not supported")
    gpus = [d for d in _devices("gpu") if _C.device_ordinal(d.id) == int(dev_id)]
    if device is None:
        if not gpus:
            raise ValueError(f"no ctrainstate device on GPU {dev_id}")
        device = gpus[0]
    if not isinstance(device, Device) or device.platform != "gpu":
        raise ValueError("a CUDA tensor is imported onto a GPU device of the same GPU")
    shape = tuple(int(s) for s in getattr(x, "shape"))
    dtype = _dtypes.canonicalize(str(getattr(x, "dtype")).replace("torch.", ""))
    buf = _C.Buffer(device.id, shape, _dtypes.code(dtype))
    _C.dlpack_copy_into(buf, x.__dlpack__(stream=1))  # ordered after the producer's default stream
    sharding = SingleDeviceSharding(device)
    shard_shape, layout, _ = sharding._layout(shape)
    return Array._create(shape, dtype, sharding, [(device, buf, layout[0][1], 0)])


def _is_numeric_list(x):
    return isinstance(x, list) and all(isinstance(v, (int, float, bool, list)) for v in x)


def _fill_array(shape, dtype, sharding: Sharding, fill: Callable, *,
                device_fill: bool = False) -> Array:
    """Create an Array whose shards are written in place by ``fill(target, start, shard_shape)``.

    The building block for sharded initialisers: each device's buffer is
    allocated on that device and filled with its own block only. ``target`` is
    the device's ``_C.Buffer`` on CPU devices, and on GPU devices too when
    ``device_fill`` (``fill`` is a ``_C.random_fill``) and the device's backend
    has a random kernel (``_C.random_on_device``); otherwise, on GPU devices, a
    host numpy block of the shard's shape that is copied to the device afterwards.
    """
    dtype = _dtypes.canonicalize(dtype)
    sharding = _as_sharding(sharding)
    if is_abstract():
        sharding.shard_shape(tuple(shape))  # validate
        return ShapeDtypeStruct(shape, dtype, sharding)
    shard_shape, blocks = _alloc_blocks(tuple(shape), dtype, sharding, addressable=True)
    for dev, buf, start, _ in blocks:
        if dev.platform == "cpu" or (device_fill and _C.random_on_device(buf)):
            fill(buf, start, shard_shape)
        else:  # devices without host-addressable memory: fill a host block, then copy it over
            host = np.empty(shard_shape, dtype)
            fill(host, start, shard_shape)
            _C.copy_from_host(buf, host.view(np.uint8) if dtype == _dtypes.bool_ else host,
                              (0,) * len(shard_shape))
    return Array._create(tuple(shape), dtype, sharding, blocks)


# --- global Arrays from this process's data (jax.make_array_from_*) ----------------------


def _check_sharding(sharding, who: str) -> Sharding:
    if not isinstance(sharding, Sharding):
        raise TypeError(f"{who}: sharding must be a NamedSharding or SingleDeviceSharding, got "
                        f"{type(sharding).__name__}")
    return sharding


def make_array_from_callback(shape, sharding, data_callback: Callable, dtype=None) -> Array:
    """An Array of ``shape`` and ``sharding`` whose shards come from ``data_callback``
    (``jax.make_array_from_callback``): for each of this process's blocks,
    ``data_callback(index)`` gets the block's tuple of slices into the global array
    (``slice(None)`` for a dimension that is not split) and returns its values (a numpy
    array, anything ``np.asarray`` takes, or an Array) of the shard's shape. The callback
    runs once per distinct index (replicas share its result) and only for this process's
    devices, so in a job of several processes each process supplies its own part.

    ``dtype`` (default: the dtype of the first result, canonicalized as ``device_put``
    does) converts every result.

    >>> import numpy as np, ctrainstate as cts
    >>> from ctrainstate import NamedSharding, P
    >>> mesh = cts.make_mesh((1,), ('x',))
    >>> data = np.arange(8.0, dtype=np.float32).reshape(4, 2)
    >>> a = cts.make_array_from_callback((4, 2), NamedSharding(mesh, P('x')), lambda i: data[i])
    >>> np.array_equal(np.asarray(a), data)
    True
    """
    shape = _dtypes.int_tuple(shape, "make_array_from_callback: shape")
    sharding = _check_sharding(sharding, "make_array_from_callback")
    if not callable(data_callback):
        raise TypeError(f"make_array_from_callback: data_callback must be callable, got "
                        f"{type(data_callback).__name__}")
    shard_shape, layout = sharding._addressable_layout(shape)
    parts = sharding._dim_parts(len(shape))
    want = None if dtype is None else _dtypes.canonicalize(dtype)
    values: dict = {}
    for _, start, _ in layout:
        if start in values:
            continue
        index = shard_index(start, shard_shape, parts)
        v = data_callback(index)
        host = np.asarray(v)
        if host.dtype.hasobject:
            raise TypeError(f"make_array_from_callback: data_callback({index}) returned "
                            f"{type(v).__name__} that is not numeric data")
        if tuple(host.shape) != shard_shape:
            raise ValueError(f"make_array_from_callback: data_callback({index}) returned shape "
                             f"{tuple(host.shape)}; the shard at that index has shape "
                             f"{shard_shape} (global shape {shape}, {sharding!r})")
        if want is None:
            want = _dtypes.canonicalize(host.dtype)
        values[start] = host
    if want is None:   # this process has no block: the dtype only matters for metadata
        want = _dtypes.canonicalize(np.float32)
    _, blocks = _alloc_blocks(shape, want, sharding, addressable=True)
    for _, buf, start, _ in blocks:
        host = np.ascontiguousarray(values[start], dtype=want)
        _C.copy_from_host(buf, host.view(np.uint8) if want == _dtypes.bool_ else host,
                          (0,) * len(shape))
    return Array._create(shape, want, sharding, blocks)


def make_array_from_single_device_arrays(shape, sharding, arrays, *, dtype=None) -> Array:
    """An Array of ``shape`` and ``sharding`` from one single-device Array per device of
    ``sharding`` that belongs to this process (``jax.make_array_from_single_device_arrays``):
    each of ``arrays`` lives on one such device, every device has exactly one, and each
    has the shard shape. In a job of several processes each process passes its own.

    Unlike jax, the values are copied (device to device, each on its own device) into
    buffers the new Array owns, so that donating either Array later never changes the
    other.

    >>> import numpy as np, ctrainstate as cts
    >>> from ctrainstate import NamedSharding, P
    >>> s = NamedSharding(cts.make_mesh((1,), ('x',)), P('x'))
    >>> parts = [cts.device_put(np.float32([1, 2]), d) for d in s.addressable_devices]
    >>> cts.make_array_from_single_device_arrays((2,), s, parts).tolist()
    [1.0, 2.0]
    """
    who = "make_array_from_single_device_arrays"
    shape = _dtypes.int_tuple(shape, f"{who}: shape")
    sharding = _check_sharding(sharding, who)
    try:
        arrays = list(arrays)
    except TypeError:
        raise TypeError(f"{who}: arrays must be a sequence of Arrays, got "
                        f"{type(arrays).__name__}") from None
    shard_shape, layout = sharding._addressable_layout(shape)
    if len(arrays) != len(layout):
        raise ValueError(f"{who}: got {len(arrays)} arrays; {sharding!r} has {len(layout)} "
                         f"devices in this process, and each needs one")
    by_device: dict = {}
    dt = None if dtype is None else _dtypes.canonicalize(dtype)
    for k, a in enumerate(arrays):
        if not isinstance(a, Array):
            raise TypeError(f"{who}: arrays[{k}] is a {type(a).__name__}, not an Array (place "
                            f"host data with make_array_from_callback or device_put)")
        a._check_alive()
        devs = {d for d, _, _, _ in a._blocks}
        if len(devs) != 1 or not a.is_fully_addressable:
            raise ValueError(f"{who}: arrays[{k}] is on {len(a.devices())} devices; each must "
                             f"be on one")
        dev = devs.pop()
        if tuple(a.shape) != shard_shape:
            raise ValueError(f"{who}: arrays[{k}] has shape {tuple(a.shape)}; the shards of "
                             f"shape {shape} under {sharding!r} have shape {shard_shape}")
        if dt is None:
            dt = a.dtype
        if a.dtype != dt:
            raise ValueError(f"{who}: arrays[{k}] has dtype {a.dtype}, not {dt}")
        if dev in by_device:
            raise ValueError(f"{who}: arrays[{by_device[dev][0]}] and arrays[{k}] are both on "
                             f"{dev!r}")
        by_device[dev] = (k, a)
    missing = [d for d, _, _ in layout if d not in by_device]
    if missing:
        extra = [by_device[d][0] for d in by_device if d not in {b[0] for b in layout}]
        raise ValueError(f"{who}: no array on {missing[0]!r} of {sharding!r}"
                         + (f" (arrays[{extra[0]}] is on a device outside it)" if extra else ""))
    _, blocks = _alloc_blocks(shape, dt, sharding, addressable=True)
    zero = (0,) * len(shard_shape)
    for dev, buf, _, _ in blocks:
        src = by_device[dev][1]._blocks[0]
        _C.copy_overlap(buf, zero, src[1], src[2])
    return Array._create(shape, dt, sharding, blocks)


def _piece_positions(sharding, ndim: int) -> list:
    """Per process, per dimension: the sorted piece numbers (0 .. parts-1) of the
    dimension that the process's devices hold."""
    parts = sharding._dim_parts(ndim)
    _, layout, _ = sharding._layout(tuple(parts))   # one element per piece: start = piece
    out: dict = {}
    for dev, start, _ in layout:
        per = out.setdefault(dev.process_index, [set() for _ in range(ndim)])
        for d in range(ndim):
            per[d].add(start[d])
    return {p: [sorted(x) for x in v] for p, v in out.items()}


def make_array_from_process_local_data(sharding, local_data, global_shape=None) -> Array:
    """A global Array of ``sharding`` from the data of this process
    (``jax.make_array_from_process_local_data``): along each dimension, ``local_data``
    either holds the whole global dimension, or the consecutive pieces this process's
    devices hold, in order (the usual case: each process loads its own rows of a batch
    sharded over a mesh axis that spans processes).

    ``global_shape`` defaults to what this assumes for every dimension: the local size
    times the number of pieces of the dimension over the number this process holds
    (processes that hold different numbers of pieces of a dimension need
    ``global_shape``). Each dimension of ``local_data`` must equal ``global_shape``'s or
    the size of this process's pieces. Processes that hold the same pieces (replicas)
    must pass the same values. In a job of one process it is ``device_put(local_data,
    sharding)``.

    >>> import numpy as np, ctrainstate as cts
    >>> from ctrainstate import NamedSharding, P
    >>> s = NamedSharding(cts.make_mesh((1,), ('batch',)), P('batch'))
    >>> cts.make_array_from_process_local_data(s, np.float32([1, 2, 3])).shape
    (3,)
    """
    who = "make_array_from_process_local_data"
    sharding = _check_sharding(sharding, who)
    if isinstance(local_data, Array):
        local_data = np.asarray(local_data)
    local = np.asarray(local_data)
    if local.dtype.hasobject:
        raise TypeError(f"{who}: local_data must be numeric array data, got "
                        f"{type(local_data).__name__}")
    dtype = _dtypes.canonicalize(local.dtype)
    if global_shape is not None:
        global_shape = _dtypes.int_tuple(global_shape, f"{who}: global_shape")
        if len(global_shape) != local.ndim:
            raise ValueError(f"{who}: global_shape {global_shape} has {len(global_shape)} "
                             f"dimensions; local_data has {local.ndim} (shape {local.shape})")
    from_process = _piece_positions(sharding, local.ndim)
    me = _process_index()
    if me not in from_process:   # none of this process's devices: an Array of no shards
        if global_shape is None:
            raise ValueError(f"{who}: {sharding!r} has no device of this process (process "
                             f"{me}); pass global_shape")
        return make_array_from_callback(global_shape, sharding, lambda index: None, dtype)
    if sharding.is_fully_addressable:
        if global_shape is not None and global_shape != local.shape:
            raise ValueError(f"{who}: this process holds every piece of {sharding!r}, so "
                             f"local_data is the global value; its shape {local.shape} "
                             f"differs from global_shape {global_shape}")
        return device_put(local.astype(dtype, copy=False), sharding)
    parts = sharding._dim_parts(local.ndim)
    mine = from_process[me]
    if global_shape is None:
        inferred = []
        for d in range(local.ndim):
            counts = {len(v[d]) for v in from_process.values()}
            if len(counts) != 1:
                raise ValueError(
                    f"{who}: the processes hold different numbers of pieces of dimension {d} "
                    f"under {sharding!r}, so the global shape cannot be inferred; pass "
                    f"global_shape")
            held = len(mine[d])
            if local.shape[d] % held:
                raise ValueError(
                    f"{who}: dimension {d} of local_data ({local.shape[d]}) does not split "
                    f"into the {held} pieces this process holds")
            inferred.append(local.shape[d] // held * parts[d])
        global_shape = tuple(inferred)
    shard_shape = sharding.shard_shape(global_shape)
    full = []
    for d in range(local.ndim):
        if local.shape[d] == global_shape[d]:
            full.append(True)
            continue
        held = len(mine[d]) * shard_shape[d]
        if local.shape[d] != held:
            raise ValueError(
                f"{who}: dimension {d} of local_data has {local.shape[d]} elements; it must "
                f"be the global size {global_shape[d]} or the {held} elements this process's "
                f"devices hold (global_shape {global_shape}, {sharding!r})")
        full.append(False)

    def piece(index):
        out = []
        for d, sl in enumerate(index):
            if full[d] or parts[d] == 1:
                out.append(sl)
                continue
            k = mine[d].index(sl.start // shard_shape[d]) if shard_shape[d] else 0
            out.append(slice(k * shard_shape[d], (k + 1) * shard_shape[d]))
        return local[tuple(out)]

    return make_array_from_callback(global_shape, sharding, piece, dtype)


def _process_index() -> int:
    return _devices_process["index"]


def device_get(tree):
    """Every Array of ``tree`` gathered to a host ``numpy.ndarray`` (jax.device_get); other
    leaves are returned as they are.

    >>> import numpy as np, ctrainstate as cts
    >>> cts.device_get({'w': cts.device_put(np.ones(2, np.float32)), 'step': 3})
    {'step': 3, 'w': array([1., 1.], dtype=float32)}
    """
    return tree_map(lambda x: np.asarray(x) if isinstance(x, Array) else x, tree)


def block_until_ready(tree):
    """Wait for every Array in a pytree; returns the tree."""
    for leaf in tree_leaves(tree):
        if isinstance(leaf, Array):
            leaf.block_until_ready()
    return tree


# --- visualisation -------------------------------------------------------------------


def _grid(a, sharding=None):
    """{row block: {column block: [devices]}} of an Array, or of a shape under ``sharding``."""
    shape = tuple(a.shape) if sharding is None else tuple(a)
    sharding = a.sharding if sharding is None else sharding
    if len(shape) not in (1, 2):
        raise ValueError(
            f"visualize_array_sharding supports 1-d and 2-d arrays, got rank {len(shape)}")
    shard_shape, layout, _ = sharding._layout(shape)
    parts = sharding._dim_parts(len(shape))
    rows = {}
    for dev, start, _ in layout:
        index = shard_index(start, shard_shape, parts)
        # 1-d arrays are drawn as one row of column blocks, like jax; an unsplit dimension
        # (slice(None)) is one block spanning it
        r = index[0].indices(shape[0])[:2] if len(shape) == 2 else (0, 1)
        c = index[-1].indices(shape[-1])[:2]
        rows.setdefault(r, {}).setdefault(c, []).append(dev)
    return rows


def _label(devs):
    plat = "CPU" if devs[0].platform == "cpu" else "GPU"
    return f"{plat} " + ",".join(str(d.id) for d in sorted(devs, key=lambda d: d.id))


def visualize_array_sharding(arr: Array, *, use_color: bool = False, scale: float = 1.0,
                             min_width: int = 9, max_width: int = 80, color_map=None) -> None:
    """Print a text grid of which devices hold which block of a 1-d or 2-d Array; returns
    None, as ``jax.debug.visualize_array_sharding`` (a notebook shows the grid once).
    ``use_color``, ``scale``, ``min_width``, ``max_width`` and ``color_map`` are jax's
    keywords, accepted with no effect: the grid is plain text, one cell per block.

    >>> import numpy as np, ctrainstate as cts
    >>> cts.visualize_array_sharding(cts.device_put(np.zeros(4, np.float32)))
    ┌───────┐
    │ CPU 0 │
    └───────┘
    """
    if not isinstance(arr, Array):
        raise TypeError(f"visualize_array_sharding needs an Array, got {type(arr).__name__}")
    arr._check_alive()
    print(_grid_text(_grid(arr)))


def visualize_sharding(shape, sharding, *, use_color: bool = False, scale: float = 1.0,
                       min_width: int = 9, max_width: int = 80, color_map=None) -> None:
    """``jax.debug.visualize_sharding``: the grid :func:`visualize_array_sharding` prints, for
    an array of ``shape`` placed by ``sharding`` (nothing is allocated); returns None. The
    keywords are jax's, with no effect (see :func:`visualize_array_sharding`).

    >>> import ctrainstate as cts
    >>> from ctrainstate import NamedSharding, P
    >>> mesh = cts.make_mesh((1,), ('x',))
    >>> cts.debug.visualize_sharding((4, 2), NamedSharding(mesh, P('x')))
    ┌───────┐
    │ CPU 0 │
    └───────┘
    """
    if not isinstance(sharding, Sharding):
        raise TypeError(f"visualize_sharding: sharding must be a Sharding, got "
                        f"{type(sharding).__name__}")
    shape = _dtypes.int_tuple(shape, "visualize_sharding: shape")
    print(_grid_text(_grid(shape, sharding)))


def _grid_text(rows) -> str:
    row_keys = sorted(rows)
    col_keys = sorted({c for r in rows.values() for c in r})
    labels = [[_label(rows[r][c]) for c in col_keys] for r in row_keys]
    width = max(len(lab) for line in labels for lab in line) + 2
    ncol = len(col_keys)
    top = "┌" + "┬".join("─" * width for _ in range(ncol)) + "┐"
    mid = "├" + "┼".join("─" * width for _ in range(ncol)) + "┤"
    bot = "└" + "┴".join("─" * width for _ in range(ncol)) + "┘"
    lines = [top]
    for i, line in enumerate(labels):
        lines.append("│" + "│".join(lab.center(width) for lab in line) + "│")
        lines.append(mid if i + 1 < len(labels) else bot)
    return "\n".join(lines)


def _sharding_html(a: Array) -> str:
    head = html.escape(repr(a))
    if a.is_deleted() or a.ndim not in (1, 2) or len(a._blocks) < 2:
        return f"<pre>{head}</pre>"
    rows = _grid(a)
    col_keys = sorted({c for r in rows.values() for c in r})
    body = []
    for r in sorted(rows):
        cells = "".join(
            f"<td style='border:1px solid #888;padding:4px 10px;text-align:center'>"
            f"{html.escape(_label(rows[r][c]))}</td>" for c in col_keys)
        body.append(f"<tr>{cells}</tr>")
    return (f"<div><pre>{head}</pre><table style='border-collapse:collapse'>"
            f"{''.join(body)}</table></div>")


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
