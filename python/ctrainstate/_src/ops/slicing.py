"""Indexing and joining on sharded Arrays, with gradients: ``x[idx]`` and jax's functional
updates ``x.at[idx]`` with numpy's indexing; ``concatenate``, ``stack`` and ``split``.

Basic indices (ints, slices with step 1, ``None``, ``...``) are copies of whole sub-blocks
between shards (the core's ``copy_overlap``, on the shards' own device), so they run on every
backend and any dtype. Sharding: a dimension that is sliced (or joined along) comes out
unsharded -- each device first gathers that dimension of its operand if it was sharded (as
``reshape`` does for what it cannot keep) -- and every other dimension keeps its mesh axes, so
``logits[:, :-1, :]`` on a ``('batch', None, 'vocab')`` layout stays sharded over batch and
vocab. The gradient of a slice is the cotangent copied into a zero array of the operand's
shape; that of a join, the slices of the cotangent.

Advanced indices -- slices with any step (``x[::2]``, ``x[::-1]``, ``x[5:1:-2]``), integer
arrays (numpy arrays, lists, integer Arrays) and boolean masks (numpy or bool Arrays) --
follow numpy's rules, as jax does: index arrays broadcast together; their dimensions replace
the indexed ones in place when the array indices are adjacent in the index and go first
otherwise (an int among arrays counts as an array, ``None``, a slice or a ``...`` between
them separates); a k-d mask stands for its ``nonzero()`` (k integer arrays; ``x[True]`` adds
a dimension of 1, ``x[False]`` one of 0). They run as a row gather: the index's bounding box
is cut out first (a basic slice), then every device copies the selected rows of its block
(rows: the trailing dimensions taken whole), on its own device -- float32 through the core's
row gather, other dtypes too when a row is whole 4-byte words (the bits are moved, never
converted), else through the host block by block. Dimensions taken whole keep their mesh
axes; indexed ones come out unsharded. An indexed dimension that is sharded is gathered onto
every device first for dtypes other than float32; a float32 array keeps it sharded instead:
every device gathers the rows its block owns and an all-reduce over that dimension's mesh axes
completes the result (exact: -0.0 stands in for the rows of other blocks), so an embedding
lookup ``table[ids]`` never gathers the table.

jax's conventions, checked against jax 0.10.2:

- out-of-range entries of an index array are clamped in reads (``x[idx]``, ``x.at[idx].get()``)
  and dropped in updates (``set``/``add``/...) and in the gradient of a read (jax's default
  mode "promise_in_bounds": XLA's gather clamps, its scatter drops). Negative entries wrap as
  in numpy. A Python int out of range raises ``IndexError`` (jax clamps it).
- ``x.at[idx].add`` sums the values of duplicate indices (in index order) and adds the sum
  once; ``multiply`` multiplies by their product once (jax's CPU scatter applies duplicates
  one at a time: with rounding the results can differ; values exact in the dtype agree);
  ``divide`` is ``x / ones.at[idx].multiply(v)`` as in jax; for ``set`` jax leaves the winner
  among duplicates unspecified: here the last value in index order wins, as numpy's
  assignment. Elements not indexed keep their bits (-0.0, inf, NaN).
- a boolean mask needs concrete values: inside ``eval_shape`` an abstract mask (a
  ShapeDtypeStruct argument) raises ``IndexError`` as jax's NonConcreteBooleanIndexError; a
  numpy or Array mask closed over works, as in jax.
- a bare list is an index array (numpy >= 1.23; jax refuses it, ``x[np.array(seq)]`` works
  in both).

Arrays that span processes (a mesh over several processes' devices) take the same paths:
every process allocates and fills only its own devices' blocks, from its blocks of the operand
laid out as above (a reshard that needs another process's blocks gathers them: for a sliced
or joined dimension sharded over processes, the whole operand reaches every process), so the
result has the one-process run's sharding and bits.

Index values are read to the host (an Array index is copied there; one sharded over processes
is gathered to every process) to plan the copies -- except where an Array that every device
holds whole (one device, or replicated) is indexed by integer Arrays on the same devices (and
Python ints) in its leading dimensions, ``logits[rows, labels]``, ``table[ids]``: the row
numbers are then computed on the devices and the rows read there, nothing copied to the host.
Gradients (float dtypes): the cotangent of a read is scatter-added back (duplicates
accumulate, in index order: the same bits on any mesh); the transpose of a row gather is a
row scatter-add and back, so updates differentiate in ``x`` and ``v``. Basic slices and joins
of 16-bit floats are recorded as they are (copies); their advanced gathers and ``.at``
updates run on the float32 widening and round back (exact for gathers and sets).

>>> import numpy as np, ctrainstate as cts, ctrainstate.numpy as cnp
>>> x = cts.device_put(np.arange(12, dtype=np.float32).reshape(3, 4))
>>> np.asarray(x[1:, ::1][..., 2]).tolist()
[6.0, 10.0]
>>> np.asarray(x[::-2, [0, 3]]).tolist()
[[8.0, 11.0], [0.0, 3.0]]
>>> np.asarray(x[np.array([True, False, True])][:, 1]).tolist()
[1.0, 9.0]
>>> np.asarray(x.at[0, [1, 1]].add(1.0)[0]).tolist()
[0.0, 3.0, 2.0, 3.0]
>>> np.asarray(cnp.concatenate([x[:1], x[2:]], axis=0)).tolist()
[[0.0, 1.0, 2.0, 3.0], [8.0, 9.0, 10.0, 11.0]]
"""
from __future__ import annotations
from ..base.hooks import provide as _provide
_provide('_slicing', __name__)   # lower layers call into this module through _hooks.upper

import math
import operator

import numpy as np

from ... import _C
from ..base import dtypes as _dtypes
from ..array.array import Array, _alloc_blocks
from ..array.abstract import ShapeDtypeStruct
from ..array.array import device_put
from ..base.hooks import upper as _upper

__all__ = ["getitem", "concatenate", "stack", "split", "array_split"]


def _o():
    _ops = _upper('_ops')
    return _ops


def _layout_of(x: Array):
    o = _o()
    place = o._place_of(x)
    norm = o._norm(x.sharding, x.ndim) if o._mesh_key(x)[0] == "mesh" else [()] * x.ndim
    return place, [tuple(e) for e in norm]


def _alloc(shape, dtype, place, norm) -> Array:
    """An output Array laid out as ``norm`` on ``place`` (uninitialised): a block per device
    of this process, in mesh order, as the operands' blocks are (every device, in a job of
    one process). Every copy here runs device by device from the operand's block on the same
    device (resharded first where needed: ``_to``), so on a mesh that spans processes each
    process fills its own blocks."""
    sharding = _o()._sharding_for(place, norm)
    _, blocks = _alloc_blocks(tuple(shape), dtype, sharding, addressable=True)
    return Array._create(tuple(shape), np.dtype(dtype), sharding, blocks)


def _to(x: Array, place, norm) -> Array:
    """``x`` laid out with ``norm`` on ``place`` (any dtype)."""
    o = _o()
    if x.dtype == np.float32:
        return o._to(x, place, norm)
    want = o._sharding_for(place, norm)
    return x if x.sharding == want else device_put(x, want)


def _by_device(a: Array) -> dict:
    return {dev.id: (buf, start) for dev, buf, start, _ in a._blocks}


def _fill(a: Array, value: float):
    """Every element of the float Array ``a`` set to ``value`` (a kernel per device; a 16-bit
    float array is filled through a float32 block converted in place)."""
    o = _o()
    if a.dtype != np.float32:
        tmp = _alloc(a.shape, np.float32, *_layout_of(a))
        _fill(tmp, value)
        _C.op_convert([b for _, b, _, _ in tmp._blocks], [b for _, b, _, _ in a._blocks])
        return
    bufs = [buf for _, buf, _, _ in a._blocks if buf.nbytes]
    _C.op_unary(o.U_AFFINE, 0.0, float(value), bufs, bufs)


def _differentiable(dtype) -> bool:
    """Whether copies of this dtype are recorded for autodiff (the float dtypes)."""
    return np.dtype(dtype) in _o()._FLOATS


def _lowp_tracked(x) -> bool:
    """A 16-bit float Array being differentiated (its gathers and updates run on float32)."""
    o = _o()
    t = o._tape()
    return (isinstance(x, Array) and x.dtype in o._LOWP and t is not None
            and id(x) in t.tracked)


def _copy_region(dst: Array, src: Array, offset, dst_is_big: bool) -> dict:
    """For each device: copy the elements its ``dst`` and ``src`` blocks share, where the
    smaller array sits at ``offset`` inside the bigger one (``dst_is_big``: src is the
    smaller). Returns device id -> elements copied."""
    srcs = _by_device(src)
    copied = {}
    for dev, dbuf, dstart, _ in dst._blocks:
        sbuf, sstart = srcs[dev.id]
        n = 0
        if dbuf.nbytes and sbuf.nbytes:
            if dst_is_big:
                n = _C.copy_overlap(dbuf, list(dstart), sbuf, [s + k for s, k in zip(sstart, offset)])
            else:
                n = _C.copy_overlap(dbuf, [s + k for s, k in zip(dstart, offset)], sbuf, list(sstart))
        copied[dev.id] = copied.get(dev.id, 0) + n
    return copied


def _check_filled(out: Array, copied: dict, who: str):
    for dev, buf, _, _ in out._blocks:
        want = math.prod(buf.shape)
        if copied.get(dev.id, 0) != want:
            raise RuntimeError(f"internal error: {who} filled {copied.get(dev.id, 0)} of {want} "
                               f"elements of the shard on device {dev.id}")


def _relabel(x: Array, shape, norm) -> Array:
    """The same dense blocks under another shape that only adds or drops unsharded size-1
    dimensions (a copy per device, any dtype)."""
    place, _ = _layout_of(x)
    out = _alloc(shape, x.dtype, place, norm)
    for (_, ob, _, _), (_, ib, _, _) in zip(out._blocks, x._blocks):
        if ob.nbytes:
            _C.copy_bytes(ob, ib)
    if _differentiable(x.dtype):
        in_shape, (_, in_norm) = x.shape, _layout_of(x)
        _o()._record(out, (x,), lambda g: (_relabel(_to(g, place, norm), in_shape, in_norm),))
    return out


def _slice(x: Array, starts, sizes) -> Array:
    """``x[starts : starts + sizes]`` (every dimension kept)."""
    if tuple(sizes) == x.shape:
        return x
    place, big = _layout_of(x)
    norm = _region_norm(big, sizes, x.shape)
    src = _to(x, place, norm)
    out = _alloc(sizes, x.dtype, place, norm)
    _check_filled(out, _copy_region(out, src, starts, dst_is_big=False), "slice")
    if _differentiable(x.dtype):
        shape = x.shape
        _o()._record(out, (x,), lambda g: (_embed(g, shape, starts, 0.0, place, big),))
    return out


def _region_norm(big_norm, sizes, shape):
    """A region's layout inside an array laid out as ``big_norm``: the dimensions it takes
    whole keep their mesh axes, the others are unsharded."""
    return [() if n != s else e for e, n, s in zip(big_norm, sizes, shape)]


def _embed(v: Array, shape, starts, fill: float, place, big_norm) -> Array:
    """An array of ``shape`` laid out as ``big_norm`` on ``place``, equal to ``fill``
    except for ``v`` at ``starts`` (the gradient of a slice, with fill 0). Every device's
    block takes its part of ``v`` from ``v``'s block on that device, ``v`` being laid out
    as the region (so it holds all of it)."""
    src = _to(v, place, _region_norm(big_norm, v.shape, shape))
    out = _alloc(shape, v.dtype, place, big_norm)
    _fill(out, fill)
    _copy_region(out, src, starts, dst_is_big=True)
    sizes = v.shape
    _o()._record(out, (v,), lambda h: (_slice(h, starts, sizes),))  # v: the tracked one
    return out


def _overwrite(base: Array, starts, r: Array, place, big_norm) -> Array:
    """A copy of ``base`` (laid out as ``big_norm``) with the region at ``starts`` replaced by
    ``r``'s elements: copies only, so every other element keeps its bits (-0.0, inf, NaN)."""
    out = _alloc(base.shape, base.dtype, place, big_norm)
    for (_, ob, _, _), (_, ib, _, _) in zip(out._blocks, base._blocks):
        if ob.nbytes:
            _C.copy_bytes(ob, ib)
    src = _to(r, place, _region_norm(big_norm, r.shape, base.shape))
    _copy_region(out, src, starts, dst_is_big=True)
    return out


def _set_region(x: Array, starts, r: Array, place, big_norm) -> Array:
    """``x`` with ``r`` at ``starts`` (``x.at[...].set``), in ``x``'s layout. Gradients: the
    cotangent with the region zeroed for ``x``, its region for ``r``."""
    out = _overwrite(x, starts, r, place, big_norm)
    sizes = r.shape

    def vjp(g):
        g = _to(g, place, big_norm)
        zeros = _alloc(sizes, g.dtype, place, _region_norm(big_norm, sizes, g.shape))
        _fill(zeros, 0.0)
        return _overwrite(g, starts, zeros, place, big_norm), _slice(g, starts, sizes)
    _o()._record(out, (x, r), vjp)
    return out


def _fresh(x: Array) -> Array:
    """A copy of ``x`` with its own buffers (recorded as the identity for floats)."""
    y = x.copy()
    if _differentiable(x.dtype):
        _o()._record(y, (x,), lambda g: (g,))
    return y


def _index_int(i, n, d):
    i = operator.index(i)
    if not -n <= i < n:
        raise IndexError(f"index {i} is out of bounds for axis {d} with size {n}")
    return i + n if i < 0 else i


# --- index normalisation ----------------------------------------------------------------------

class _IntArray:
    """An integer index array (host, int64, as given: not yet wrapped or clamped)."""
    __slots__ = ("a",)

    def __init__(self, a):
        self.a = a


class _Mask:
    """A boolean index array (host), ``ndim`` >= 0."""
    __slots__ = ("a",)

    def __init__(self, a):
        self.a = a


class _Abstract:
    """An index that is a ShapeDtypeStruct (inside eval_shape): its shape only."""
    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)


def _bad_index(i, where=""):
    return TypeError(
        f"Array indices must be ints, slices, None, ..., or integer or boolean arrays (numpy "
        f"arrays, lists, Arrays); got {type(i).__name__} {i!r}{where}")


def _from_host(a, i):
    """A host array used as an index: an int (0-d integer), an _IntArray or a _Mask."""
    if a.dtype == np.bool_:
        return _Mask(a)
    if a.dtype.kind not in "iu":
        if a.size == 0 and a.dtype == np.float64 and isinstance(i, list):
            a = a.astype(np.int64)  # x[[]]: an empty integer index, as numpy
        else:
            raise TypeError(f"Array indices must have an integer or boolean dtype, got an "
                            f"indexer of dtype {a.dtype} ({type(i).__name__})")
    if a.ndim == 0:
        return int(a)
    if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
        a = np.minimum(a, np.iinfo(np.int64).max)  # clamped below anyway
    return _IntArray(a.astype(np.int64))


def _normalize(idx) -> tuple:
    """``idx`` as a tuple of ints, slices, None, ..., _IntArray, _Mask and _Abstract. Lists,
    numpy arrays and Arrays are read to the host (an index's values plan the copies)."""
    if isinstance(idx, list):
        idx = (idx,)  # a list is one index array, as in numpy >= 1.23 (jax refuses it)
    elif not isinstance(idx, tuple):
        idx = (idx,)
    out = []
    for i in idx:
        if i is None or i is Ellipsis or isinstance(i, slice):
            out.append(i)
        elif isinstance(i, (bool, np.bool_)):
            out.append(_Mask(np.asarray(i, np.bool_)))
        elif isinstance(i, (int, np.integer)):
            out.append(int(i))
        elif isinstance(i, ShapeDtypeStruct):
            if i.dtype != np.bool_ and np.dtype(i.dtype).kind not in "iu":
                raise TypeError(f"Array indices must have an integer or boolean dtype, got an "
                                f"indexer of dtype {i.dtype}")
            out.append(_Abstract(i.shape, i.dtype))
        elif isinstance(i, Array):
            i._check_alive()
            if i.is_fully_addressable or i.sharding.is_fully_replicated:
                out.append(_from_host(np.asarray(i), i))
            else:   # sharded over processes: every process gathers it (as every one indexes)
                out.append(_from_host(_upper('distributed')._gather_global(i), i))
        elif isinstance(i, (list, np.ndarray)):
            try:
                a = np.asarray(i)
            except ValueError:
                raise _bad_index(i, " (a ragged list)") from None
            out.append(_from_host(a, i))
        else:
            try:
                out.append(operator.index(i))
            except TypeError:
                raise _bad_index(i) from None
    return tuple(out)


def _is_basic(nidx) -> bool:
    """Only ints, slices with step 1 (or None), None and ...: the region copies of _parse."""
    for i in nidx:
        if isinstance(i, (_IntArray, _Mask, _Abstract)):
            return False
        if isinstance(i, slice) and i.step is not None:
            try:
                if operator.index(i.step) != 1:
                    return False
            except TypeError:
                pass  # slice.indices raises the error
    return True


def _consumed(i) -> int:
    """How many dimensions of the array index ``i`` consumes."""
    if i is None or i is Ellipsis:
        return 0
    if isinstance(i, _Mask):
        return i.a.ndim
    if isinstance(i, _Abstract) and i.dtype == np.bool_:
        return len(i.shape)
    return 1


def _check_count(shape, nidx):
    """The index's ellipsis and its number of indexed dimensions, checked against ``shape``;
    returns how many dimensions ``...`` stands for."""
    if sum(1 for i in nidx if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(_consumed(i) for i in nidx)
    if used > len(shape):
        raise IndexError(f"too many indices for an array of rank {len(shape)}: {used} were given")
    return len(shape) - used


def _parse(shape, idx):
    """Basic index (normalized) -> (starts, sizes, keep, out_shape): the region ``x[starts :
    starts + sizes]`` (rank kept) and how the result's dimensions map onto it (``keep[j]``:
    the region dimension of result dimension j, None for a new axis)."""
    fill = _check_count(shape, idx)
    k = next((j for j, i in enumerate(idx) if i is Ellipsis), None)
    if k is not None:
        idx = idx[:k] + (slice(None),) * fill + idx[k + 1:]
    else:
        idx = idx + (slice(None),) * fill
    starts, sizes, keep, out_shape = [], [], [], []
    d = 0
    for i in idx:
        if i is None:
            out_shape.append(1)
            keep.append(None)
            continue
        n = shape[d]
        if isinstance(i, slice):
            a, b, _ = i.indices(n)
            m = max(0, b - a)
            starts.append(a)
            sizes.append(m)
            keep.append(d)
            out_shape.append(m)
        else:
            starts.append(_index_int(i, n, d))
            sizes.append(1)
        d += 1
    return starts, sizes, keep, tuple(out_shape)


def getitem(x, idx):
    """``x[idx]``: numpy indexing -- basic (ints, slices of any step, ``None``, ``...``) and
    advanced (integer arrays, boolean masks) -- with jax's conventions (see the module's
    docstring); differentiable for the float dtypes."""
    y = _device_getitem(x, idx)
    if y is not None:
        return y
    nidx = _normalize(idx)
    if not _is_basic(nidx):
        adv = _Advanced(tuple(x.shape), nidx)
        if isinstance(x, ShapeDtypeStruct) or adv.abstract:
            return ShapeDtypeStruct(adv.out_shape, x.dtype)
        x._check_alive()
        if _lowp_tracked(x):   # the gather's gradient is float32's: run it on float32
            o = _o()
            return o.astype(getitem(o.astype(x, np.float32), idx), x.dtype)
        return adv.gather(x)
    starts, sizes, keep, out_shape = _parse(tuple(x.shape), nidx)
    if isinstance(x, ShapeDtypeStruct):
        return ShapeDtypeStruct(out_shape, x.dtype)
    x._check_alive()
    y = _slice(x, starts, sizes)
    if y is x:
        y = _fresh(x)  # x[:], x[...]: a new Array, as in jax (deleting x leaves it intact)
    if out_shape == y.shape:
        return y
    _, norm = _layout_of(y)
    return _relabel(y, out_shape, [() if k is None else norm[k] for k in keep])


# --- gathers at row numbers computed on the devices -----------------------------------------
#
# An Array that every device holds whole (one device, or replicated), indexed by integer
# Arrays that live whole on the same devices: the row numbers are computed there (int32 ops
# from C plans, the bounds kept constants), each device reads its rows from its own copy with
# the row gather, and nothing goes through the host. The gradient scatter-adds at the rows
# read, planned on the host from them when the backward pass runs. Every other index takes
# the host-planned gather below.

_INT32_LIMIT = 2 ** 31
# index dtypes converted to int32 exactly on the devices (uint32 indices are read on the host)
_DEVICE_INDEX_DTYPES = frozenset(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.uint8,
                                                       np.uint16))
_DT_I32 = np.dtype(np.int32)


def _whole(a) -> bool:
    """Whether every device ``a`` lives on holds all of it (one device, or replicated)."""
    return isinstance(a, Array) and not any(_layout_of(a)[1])


def _device_index(i, place) -> bool:
    """Whether ``i`` is an integer Array read on the devices of ``place``: whole there."""
    if type(i) is not Array or i.dtype not in _DEVICE_INDEX_DTYPES:
        return False
    i._check_alive()
    return _whole(i) and _o()._place_of(i) is place


# the 0-d constants (index bounds, strides, fill values) and the position bases of the device
# gathers, kept per placement
_KEPT: dict = {}
_KEPT_MAX = 128


def _kept(value, dtype, place):
    """``value`` (a Python int, or a 0-d numpy array of ``dtype``) as a kept 0-d Array of
    ``dtype`` on ``place``: no scalar is copied from the host at each call."""
    key = (id(place), dtype, value if type(value) is int else value.tobytes())
    return _o().kept_constant(_KEPT, _KEPT_MAX, key, place, _kept_on, (value, dtype))


def _kept_on(value_dtype, place):
    return _o()._lift_any(np.asarray(*value_dtype), place)


def _rows_in_range(i, n: int, place, wrap: bool = True):
    """(the int32 Array of the integer Array ``i``'s entries -- negative ones wrapped as numpy
    wraps them, with ``wrap`` -- clamped to [0, n - 1]; the bool Array of the entries in
    range before the clamp)."""
    o = _o()

    def c(v):
        return _kept(v, _DT_I32, place)
    w = i if i.dtype == _DT_I32 else o._convert_to(i, _DT_I32)
    if wrap:
        w = o.add(w, o.multiply(o._convert_to(w < c(0), _DT_I32), c(n)))
    ok = (w >= c(0)) & (w < c(n))
    return o.minimum(o.maximum(w, c(0)), c(n - 1)), ok


def _device_getitem(x, idx):
    """``x[idx]`` read on the devices, or None where that does not apply: ``x`` whole on each
    device and ``idx`` one integer Array on those devices (whole there) or a tuple of them and
    Python ints (at least one Array) for leading dimensions. The rows (the dimensions after
    the indexed ones, taken whole) at the broadcast index are read, out-of-range entries
    clamped after numpy's wrap (jax's gather), their cotangents dropped."""
    entries = idx if type(idx) is tuple else (idx,)
    if type(x) is not Array or len(entries) > len(x.shape):
        return None
    arrays = False
    for i in entries:
        if type(i) is Array:
            arrays = True
        elif type(i) is not int:
            return None
    if not arrays:
        return None
    place = _o()._place_of(x)
    if not (_whole(x) and all(type(i) is int or _device_index(i, place) for i in entries)):
        return None
    shape = tuple(x.shape)
    k = len(entries)
    try:
        bshape = tuple(np.broadcast_shapes(*(i.shape for i in entries if type(i) is Array)))
    except ValueError:
        return None   # (the general path raises numpy's IndexError)
    nrows, q = math.prod(shape[:k]), math.prod(shape[k:])
    if not (nrows and q and math.prod(bshape)) or nrows >= _INT32_LIMIT:
        return None
    o = _o()
    rows = ok = None
    const, stride = 0, nrows
    with o._no_tape():   # row numbers: nothing of them is differentiated
        for d, i in enumerate(entries):
            n = shape[d]
            stride //= n
            if type(i) is int:
                if not -n <= i < n:
                    return None   # (the general path raises IndexError)
                const += (i % n) * stride
                continue
            w, inb = _rows_in_range(i, n, place)
            ok = inb if ok is None else ok & inb
            term = o.multiply(w, _kept(stride, _DT_I32, place)) if stride != 1 else w
            rows = term if rows is None else o.add(rows, term)
        if const:
            rows = o.add(rows, _kept(const, _DT_I32, place))
    return _gather_rows_at(x, rows, q, bshape + shape[k:], ok)


def _gather_rows_at(x, rows, q: int, out_shape, keep=None) -> Array:
    """The Array of ``out_shape`` whose every ``q`` elements are the row ``rows[...]`` of
    ``x`` seen as (rows, q) (``x`` whole on each device; ``rows`` an int32 Array there, -1
    for a row of zeros), placed as ``x``. Rows of whole 4-byte words are moved as they are
    (any dtype); others, and 16-bit floats being differentiated, through an exact float32 /
    int32 widening. Float32: the gradient scatter-adds the cotangent at ``rows`` (where the
    bool Array ``keep``, if any, is set)."""
    o = _o()
    dt = np.dtype(x.dtype)
    if (q * dt.itemsize) % 4 or _lowp_tracked(x):
        wide = np.dtype(np.float32 if dt.kind == "f" or dt in o._FLOATS else np.int32)
        return o.astype(_gather_rows_at(o.astype(x, wide), rows, q, out_shape, keep), dt)
    place = o._place_of(x)
    out = _alloc(out_shape, dt, place, [()] * len(out_shape))
    if rows.dtype != _DT_I32 or math.prod(rows.shape) * q != math.prod(out_shape):
        raise RuntimeError(f"internal error: {rows.dtype} row numbers of shape {rows.shape} "
                           f"for {out_shape} in rows of {q}")
    if len({tuple(b[0].id for b in a._blocks) for a in (out, x, rows)}) != 1:
        raise RuntimeError("internal error: a device gather's blocks are out of device order")
    _C.op_gather_rows([b[1] for b in x._blocks], [b[1] for b in rows._blocks],
                      [b[1] for b in out._blocks], [0] * len(out._blocks),
                      q * dt.itemsize // 4)
    if dt == np.float32:
        def vjp(g):   # (the row numbers read to the host when the backward pass runs)
            pos = np.asarray(rows).reshape(-1)
            if keep is not None:
                pos = np.where(np.broadcast_to(np.asarray(keep), rows.shape).reshape(-1), pos, -1)
            return (_scatter_rows(g, [()] * len(out_shape), pos, q, tuple(x.shape),
                                  [()] * len(x.shape), place, 0.0),)
        o._record(out, (x,), vjp)
    return out


# --- advanced indexing: a row gather -------------------------------------------------------
#
# The index's region is cut out first (its bounding box, a _slice, where that at least halves
# a dimension); then the result is a gather of rows: with every block seen as (rows, Q), Q the
# product of the trailing dimensions taken whole after the last indexed one, every result row
# is one row of a block. Every other dimension keeps its mesh axes, so each device gathers from
# its own block. An indexed dimension is either whole on every device (gathered first where it
# was sharded: the slicing rule) or, for float32, left sharded: each device takes the rows its
# block owns and an all-reduce over the owner axes completes them. All blocks have one shape
# (shardings divide evenly), so the host plans (`sel`: the rows, -1 for another block's) are
# one per distinct block position along the owner axes.
#
# _rows (gather rows of stacked sources) and _scatter_rows (scatter-add rows) are each
# other's transpose, which gives the gradients; x.at[...] updates are built from them.

class _Item:
    """One dimension of the indexed array, extended with the new axes of ``None`` (and of
    0-d boolean indices): ``pos`` the index position it came from, ``src`` the array's
    dimension (None for a new axis), ``kind`` "all" | "int" | "slice" | "arr", ``val``
    None | int | (first, step, length) | int64 array (wrapped and clamped) and ``ok`` the
    in-bounds entries of an array that had some out of range (else None)."""
    __slots__ = ("pos", "src", "kind", "val", "ok")

    def __init__(self, pos, src, kind, val=None, ok=None):
        self.pos, self.src, self.kind, self.val, self.ok = pos, src, kind, val, ok


def _int_array(a, n, d, abstract=False):
    """(index, in_bounds) for an integer index array into a dimension of size ``n``:
    negative entries wrap (numpy) and out-of-range ones are clamped to [0, n - 1], as jax's
    gathers do by default; ``in_bounds`` (None when all are) marks the entries a scatter
    keeps (jax's updates drop out-of-range ones)."""
    if abstract:
        return np.zeros(a.shape, np.int64), None
    if n == 0 and a.size:
        raise IndexError(f"index array of shape {a.shape} into dimension {d} of size 0")
    a = np.where(a < 0, a + n, a)
    ok = (a >= 0) & (a < n)
    return np.clip(a, 0, max(n - 1, 0)), (None if ok.all() else ok)


class _Advanced:
    """A parsed index with slice steps other than 1, integer arrays or boolean masks: the
    extended dimensions (``items``), the broadcast shape of the index arrays (``bshape``),
    the result's dimensions (``dims``: ("B", j) or ("item", k)) and ``out_shape``."""

    def __init__(self, shape, nidx):
        self.shape = shape
        fill = _check_count(shape, nidx)
        self.abstract = False
        items = []
        d = 0
        for pos, i in enumerate(nidx):
            if i is Ellipsis:
                for _ in range(fill):
                    items.append(_Item(pos, d, "all"))
                    d += 1
            elif i is None:
                items.append(_Item(pos, None, "all"))
            elif isinstance(i, slice):
                n = shape[d]
                a, b, s = i.indices(n)
                m = len(range(a, b, s))
                items.append(_Item(pos, d, "all") if s == 1 and m == n else
                             _Item(pos, d, "slice", (a, s, m)))
                d += 1
            elif isinstance(i, int):
                items.append(_Item(pos, d, "int", _index_int(i, shape[d], d)))
                d += 1
            elif isinstance(i, _IntArray):
                items.append(_Item(pos, d, "arr", *_int_array(i.a, shape[d], d)))
                d += 1
            elif isinstance(i, _Mask):
                k = i.a.ndim
                if k == 0:  # x[True] / x[False]: a new axis of length 1 / 0
                    items.append(_Item(pos, None, "arr", np.zeros(int(bool(i.a)), np.int64)))
                    continue
                if i.a.shape != shape[d:d + k]:
                    raise IndexError(
                        f"boolean index did not match shape of indexed array in index {pos}: "
                        f"got {i.a.shape}, expected {shape[d:d + k]}")
                for j, nz in enumerate(np.nonzero(i.a)):
                    items.append(_Item(pos, d + j, "arr", nz.astype(np.int64)))
                d += k
            else:  # _Abstract
                if i.dtype == np.bool_:
                    raise IndexError(
                        f"boolean mask indexing needs a concrete mask: the result's shape "
                        f"depends on the mask's values, and inside eval_shape this mask (shape "
                        f"{i.shape}) is abstract, as a traced mask in jax "
                        f"(NonConcreteBooleanIndexError); use where(mask, x, 0) or pass the "
                        f"mask as a numpy array")
                self.abstract = True
                items.append(_Item(pos, d, "arr", *_int_array(np.zeros(i.shape, np.int64),
                                                              shape[d], d, abstract=True)))
                d += 1
        for dd in range(d, len(shape)):
            items.append(_Item(len(nidx), dd, "all"))
        if any(it.kind == "arr" for it in items):
            for it in items:  # with index arrays present, an int is a 0-d index array
                if it.kind == "int":
                    it.kind, it.val = "arr", np.array(it.val, np.int64)
            shapes = [it.val.shape for it in items if it.kind == "arr"]
            try:
                self.bshape = tuple(np.broadcast_shapes(*shapes))
            except ValueError:
                raise IndexError("shape mismatch: indexing arrays could not be broadcast "
                                 "together with shapes " + " ".join(str(s) for s in shapes)) from None
        else:
            self.bshape = None
        self.items = items
        self.dims = _result_dims(items, self.bshape)
        self.out_shape = tuple(self.bshape[j] if t == "B" else _item_len(items[j], shape)
                               for t, j in self.dims)

    def region(self, whole=()):
        """(starts, sizes, items relative to the region): the bounding box of the index in
        every dimension but those in ``whole`` (kept whole: sharded ones that each device
        indexes in its own block) and those where an array or a stepped slice spans more
        than half the dimension (cutting would copy more than it saves: the gather reads
        only the selected rows); a slice with step 1 becomes "all" of the region."""
        starts, sizes = [0] * len(self.shape), list(self.shape)
        rel = []
        for it in self.items:
            if it.src is None or it.kind == "all":
                rel.append(it)
                continue
            if it.src in whole:
                lo, hi = 0, self.shape[it.src]
            elif it.kind == "int":
                lo, hi = it.val, it.val + 1
            elif it.kind == "slice":
                a, s, m = it.val
                lo, hi = (min(a, a + (m - 1) * s), max(a, a + (m - 1) * s) + 1) if m else (0, 0)
            else:
                lo, hi = (int(it.val.min()), int(it.val.max()) + 1) if it.val.size else (0, 0)
            if (it.kind == "arr" or (it.kind == "slice" and it.val[1] != 1)) and \
                    2 * (hi - lo) > self.shape[it.src]:
                lo, hi = 0, self.shape[it.src]
            starts[it.src], sizes[it.src] = lo, hi - lo
            if it.kind == "int":
                rel.append(_Item(it.pos, it.src, "int", it.val - lo))
            elif it.kind == "slice":
                a, s, m = it.val
                rel.append(_Item(it.pos, it.src, "all") if s == 1 and lo == a and hi - lo == m else
                           _Item(it.pos, it.src, "slice", (a - lo, s, m)))
            else:
                rel.append(_Item(it.pos, it.src, "arr", it.val - lo, it.ok))
        return starts, sizes, rel

    def plan(self, rel, shard_shape, block_starts, owned):
        """(sels, Q, rows, in_bounds): every block of the region (``shard_shape``, starting
        at ``block_starts``) seen as (rows, Q), the rows of the result's block in order
        (-1 where the row lies in another device's block: the indexed dimensions in
        ``owned`` are sharded, the others whole), one array per block; ``in_bounds``: the
        result rows no out-of-range index entry touched (None: all)."""
        last = max(k for k, it in enumerate(rel) if it.kind != "all")
        lead = rel[:last + 1]
        local = [1 if it.src is None else shard_shape[it.src] for it in lead]
        q = math.prod(1 if it.src is None else shard_shape[it.src] for it in rel[last + 1:])
        rows = math.prod(local)
        strides = [math.prod(local[k + 1:]) for k in range(len(local))]
        dims = self.dims[:len(self.dims) - (len(rel) - last - 1)]
        oshape = tuple(self.bshape[j] if t == "B" else
                       (local[j] if rel[j].kind == "all" else rel[j].val[2]) for t, j in dims)
        nd = len(oshape)
        nb = next((p for p, (t, _) in enumerate(dims) if t == "B"), 0)

        def at_b(a):  # an array of the broadcast shape, placed at the result's B dims
            return a.reshape((1,) * nb + self.bshape + (1,) * (nd - nb - len(self.bshape)))

        coords = []  # per lead item: (region coordinate broadcastable to oshape, item)
        for k, it in enumerate(lead):
            if it.kind == "int":
                c = np.int64(it.val)
            elif it.kind == "arr":
                c = at_b(np.broadcast_to(it.val, self.bshape))
            else:
                p = dims.index(("item", k))
                c = np.arange(local[k], dtype=np.int64) if it.kind == "all" else \
                    it.val[0] + it.val[1] * np.arange(it.val[2], dtype=np.int64)
                c = c.reshape((1,) * p + (-1,) + (1,) * (nd - p - 1))
            coords.append((c, it, strides[k]))
        cache, sels = {}, []
        for st in block_starts:
            key = tuple(st[d] for d in sorted(owned))
            if key not in cache:
                sel = np.zeros(oshape, np.int64)
                own = np.ones(oshape, bool)
                for c, it, stride in coords:
                    if it.src in owned:
                        c = c - st[it.src]
                        own &= (c >= 0) & (c < shard_shape[it.src])
                    sel += c * stride
                cache[key] = np.where(own, sel, -1).reshape(-1) if owned else sel.reshape(-1)
            sels.append(cache[key])
        if rows + math.prod(oshape) >= 2 ** 31:
            raise ValueError(f"indexing: {rows} rows and {math.prod(oshape)} selected rows per "
                             f"block do not fit the int32 row numbers of the gather")
        oks = [it.ok for it in lead if it.kind == "arr" and it.ok is not None]
        ok = None
        if oks:
            b = np.ones(self.bshape, bool)
            for o_ in oks:
                b &= o_
            ok = np.broadcast_to(at_b(b), oshape).reshape(-1)
        return sels, q, rows, ok

    def layout(self, rel, region_norm):
        """The result's per-dimension mesh axes: those of the region's dimensions it takes
        whole; none for indexed dimensions and new axes."""
        return [() if t == "B" or rel[j].kind != "all" or rel[j].src is None
                else tuple(region_norm[rel[j].src]) for t, j in self.dims]

    def prepare(self, x, owner: bool):
        """The plan for the concrete Array ``x``: (region, its layout, place, starts, sels,
        Q, rows, in_bounds, result layout, owner axes). With ``owner``, an indexed
        dimension sharded in ``x`` stays sharded: each device takes the rows in its own
        block (the others' rows are left to them: -1 in ``sels``) and the owner axes are
        the mesh axes those dimensions are sharded over. Without, every indexed dimension
        is gathered whole onto every device first (the slicing rule)."""
        place, big = _layout_of(x)
        indexed = {it.src for it in self.items if it.kind != "all" and it.src is not None}
        owned = {d for d in indexed if big[d]} if owner else set()
        starts, sizes, rel = self.region(whole=owned)
        y = _slice(x, starts, sizes)
        _, ynorm = _layout_of(y)
        gnorm = [() if d in indexed and d not in owned else e for d, e in enumerate(ynorm)]
        # the plans of this process's blocks (all of them, in a job of one process), in the
        # order of the blocks _alloc makes
        shard, blocks = _o()._sharding_for(place, gnorm)._addressable_layout(tuple(y.shape))
        sels, q, rows, ok = self.plan(rel, shard, [st for _, st, _ in blocks], owned)
        axes = tuple(a for d in sorted(owned) for a in gnorm[d])
        return y, gnorm, place, starts, sels, q, rows, ok, self.layout(rel, gnorm), axes

    def gather(self, x):
        """``x[idx]``. A float32 ``x`` keeps its sharded indexed dimensions: every device
        gathers the selected rows its block holds, -0.0 for the others, and an all-reduce
        over the owner axes completes the rows (exact: each element has one owner, and
        -0.0 + v is v); the gradient scatter-adds each device's rows into its own block.
        Other dtypes gather those dimensions whole first."""
        y, gnorm, place, _, sels, q, rows, ok, onorm, axes = self.prepare(
            x, owner=x.dtype == np.float32)
        # out-of-range entries read the clamped element, and their cotangents are dropped:
        # jax's default (mode "promise_in_bounds": XLA's gather clamps, its scatter drops)
        if axes:
            sels = [np.where(s < 0, rows, s) for s in sels]  # row `rows`: the -0.0 row
            return _rows([(y, gnorm), -0.0], sels, q, self.out_shape, onorm, place, x.dtype,
                         grad_keep=ok, axes=axes)
        return _rows([(y, gnorm)], sels, q, self.out_shape, onorm, place, x.dtype, grad_keep=ok)


def _item_len(it, shape):
    if it.kind == "slice":
        return it.val[2]
    return 1 if it.src is None else shape[it.src]


def _result_dims(items, bshape):
    """numpy's placement of the result's dimensions: ("item", k) for a dimension taken by a
    slice (or a new axis), ("B", j) for the index arrays' broadcast dimensions, which replace
    the indexed dimensions when the array indices are adjacent in the index (positions in the
    index tuple: ``x[:, [0], ..., [1]]`` counts as separated even when ``...`` stands for
    nothing) and go first otherwise; an int without arrays drops its dimension."""
    adv = [k for k, it in enumerate(items) if it.kind == "arr"]
    rest = [("item", k) for k, it in enumerate(items) if it.kind in ("all", "slice")]
    if not adv:
        return rest
    bdims = [("B", j) for j in range(len(bshape))]
    keys = sorted({items[k].pos for k in adv})
    if keys[-1] - keys[0] + 1 == len(keys):
        return [r for r in rest if r[1] < adv[0]] + bdims + [r for r in rest if r[1] > adv[0]]
    return bdims + rest


# --- the two row primitives ------------------------------------------------------------------

def _paired(arrays_norms, out: Array, place):
    """Each source laid out as asked, its blocks in the output's device order."""
    res = []
    for a, norm in arrays_norms:
        b = _to(a, place, norm)
        if [d.id for d, _, _, _ in b._blocks] != [d.id for d, _, _, _ in out._blocks]:
            raise RuntimeError("internal error: indexing blocks are out of device order")
        res.append(b)
    return res


def _view2d(dev, buf, rows, width, code):
    """``buf``'s bytes as a dense (rows, width) buffer of dtype ``code`` (itself when it is one)."""
    if buf.dtype == code and tuple(buf.shape) == (rows, width):
        return buf
    b = _C.Buffer(dev.id, (rows, width), code)
    if b.nbytes:
        _C.copy_bytes(b, buf)
    return b


def _bits32(value) -> int:
    return int(np.asarray(value, np.float32).view(np.uint32))


def _host_block(buf, dtype):
    h = np.empty(tuple(buf.shape), dtype)
    if h.size:
        _C.copy_to_host(buf, h.view(np.uint8) if dtype == np.bool_ else h, (0,) * h.ndim)
    return h


def _per_block(sel, a: Array) -> list:
    """One row plan per block of ``a`` (a single plan serves them all)."""
    return list(sel) if isinstance(sel, list) else [sel] * len(a._blocks)


def _rows(srcs, sel, q, shape, norm, place, dtype, grad_keep=None, axes=()) -> Array:
    """An Array of ``shape`` laid out as ``norm`` whose every block, seen as (rows, q), is the
    rows ``sel`` (one int array, or a list of one per block) of the sources' blocks stacked:
    each source is (Array, layout), its block seen as (rows_s, q), or a float, one row of
    that value. A copy of whole rows (any dtype: rows of a multiple of 4 bytes go through
    the row gather as 32-bit words, reading a single source's blocks and writing the output's
    in place; others through the host, block by block). Float32: the
    gradient scatter-adds back into the sources (only the rows ``grad_keep`` marks, when
    given).

    The plans may differ only along the mesh ``axes`` (each device taking the rows its
    block owns, a zero row for the others'); an output replicated along some of them holds
    partial rows there, completed by an all-reduce over them (float32)."""
    dtype = np.dtype(dtype)
    out = _alloc(shape, dtype, place, norm)
    pairs = [s for s in srcs if not isinstance(s, float)]
    blocks = _paired(pairs, out, place)
    sels = _per_block(sel, out)
    n = len(sels[0])
    size = math.prod(out._blocks[0][1].shape)
    if size and (q == 0 or size != n * q):
        raise RuntimeError(f"internal error: indexing plans {n} rows of {q} for a block of {size}")
    # the sources' row counts and where each starts in the stack
    counts, it = [], iter(blocks)
    for s in srcs:
        if isinstance(s, float):
            counts.append(1)
        else:
            counts.append(math.prod(next(it)._blocks[0][1].shape) // q if q else 0)
    offs = [sum(counts[:i]) for i in range(len(counts))]
    if size:
        item = dtype.itemsize
        if (q * item) % 4 == 0:
            w = q * item // 4
            tabs, idss, outs2, ids32 = [], [], [], {}
            for bi, (dev, obuf, _, _) in enumerate(out._blocks):
                parts = []
                one = len(srcs) == 1 and not isinstance(srcs[0], float)
                for s, b, c in zip(srcs, _block_iter(srcs, blocks, bi), counts):
                    if isinstance(s, float):
                        t = _C.Buffer(dev.id, (1, w), 0)
                        _C.fill_bits32([t], _bits32(s))
                    elif one:   # the gather reads the block's bytes as rows of w words
                        t = b
                    else:
                        t = _view2d(dev, b, c, w, 0) if c else None
                    parts.append(t)
                if len(parts) == 1:
                    tab = parts[0]
                else:
                    tab = _C.Buffer(dev.id, (sum(counts), w), 0)
                    for t, off in zip(parts, offs):
                        if t is not None and t.nbytes:
                            _C.copy_overlap(tab, [0, 0], t, [off, 0])
                ids = _C.Buffer(dev.id, (n,), _dtypes.code(_dtypes.int32))
                if id(sels[bi]) not in ids32:  # blocks with one plan share its int32 copy
                    ids32[id(sels[bi])] = np.ascontiguousarray(sels[bi], np.int32)
                _C.copy_from_host(ids, ids32[id(sels[bi])], (0,))
                tabs.append(tab)
                idss.append(ids)
                outs2.append(obuf)    # written as rows of w words: any dtype, any shape
            _C.op_gather_rows(tabs, idss, outs2, [0] * len(tabs), w)
        else:  # rows of 2-byte or 1-byte elements that are not whole 4-byte words
            for bi, (dev, obuf, _, _) in enumerate(out._blocks):
                parts = [np.full((1, q), s, dtype) if isinstance(s, float) else
                         _host_block(b, dtype).reshape(c, q)
                         for s, b, c in zip(srcs, _block_iter(srcs, blocks, bi), counts)]
                o = np.ascontiguousarray(np.concatenate(parts)[sels[bi]].reshape(obuf.shape))
                _C.copy_from_host(obuf, o.view(np.uint8) if dtype == np.bool_ else o, (0,) * o.ndim)
    if dtype == np.float32 and pairs:
        spans = [(c, off) for s, c, off in zip(srcs, counts, offs) if not isinstance(s, float)]
        backs = sels if grad_keep is None else [np.where(grad_keep, s_, -1) for s_ in sels]

        def vjp(g):
            return tuple(_scatter_rows(g, norm, [np.where((b >= off) & (b < off + c), b - off, -1)
                                                 for b in backs],
                                       q, a.shape, anorm, place, 0.0, axes)
                         for (a, anorm), (c, off) in zip(pairs, spans))
        _o()._record(out, tuple(a for a, _ in pairs), vjp)
    _complete(out, norm, axes)
    return out


def _complete(out: Array, norm, axes):
    """Sum the partial rows of an output replicated along some of the plans' ``axes``."""
    used = {a for e in norm for a in e}
    red = [a for a in axes if a not in used]
    if red:
        if out.dtype != np.float32:
            raise RuntimeError("internal error: a partial row gather of a non-float32 array")
        _o()._allreduce(out, red)


def _block_iter(srcs, blocks, bi):
    """Per source: its block ``bi``'s buffer (None for a float source)."""
    it = iter(blocks)
    return [None if isinstance(s, float) else next(it)._blocks[bi][1] for s in srcs]


def _scatter_rows(g: Array, gnorm, targets, q, shape, norm, place, init: float, axes=()) -> Array:
    """The float32 Array of ``shape`` laid out as ``norm``, every element ``init``, with the
    rows of ``g``'s blocks (seen as (len(targets), q), ``g`` laid out as ``gnorm``) added into
    the rows ``targets`` (one int array, or a list of one per block; -1: dropped) of its
    blocks, a target's terms in order (the same bits on any mesh). The transpose of _rows
    (``axes`` as there); ``init`` -0.0 makes a single term exact."""
    out = _alloc(shape, np.float32, place, norm)
    (gb,) = _paired([(g, gnorm)], out, place)
    tlist = [np.asarray(t, np.int64) for t in _per_block(targets, out)]
    size = math.prod(out._blocks[0][1].shape)
    rows = size // q if q else 0
    if size:
        plans = {}
        for (dev, obuf, _, _), (_, gbuf, _, _), t in zip(out._blocks, gb._blocks, tlist):
            key = id(t)
            if key not in plans:
                valid = np.nonzero(t >= 0)[0]
                pos = valid[np.argsort(t[valid], kind="stable")]
                hit, first = np.unique(t[pos], return_index=True)
                # [hit | start (nhit + 1) | every g row]: dropped rows follow start[nhit], unread
                plans[key] = (np.concatenate([hit, first, [len(pos)], pos, np.nonzero(t < 0)[0]])
                              .astype(np.int32), int(hit.size))
            plan, nhit = plans[key]
            tab = obuf if tuple(obuf.shape) == (rows, q) else _C.Buffer(dev.id, (rows, q), 0)
            _C.fill_bits32([tab], _bits32(init))
            if nhit:
                p = _C.Buffer(dev.id, (len(plan),), _dtypes.code(_dtypes.int32))
                _C.copy_from_host(p, plan, (0,))
                _C.op_scatter_add_rows([tab], [p], [_view2d(dev, gbuf, len(t), q, 0)], [0], nhit)
            if tab is not obuf:
                _C.copy_bytes(obuf, tab)

    def vjp(h):
        back = [np.where(t >= 0, t, rows) for t in tlist]  # row `rows`: the zero row
        return (_rows([(h, norm), 0.0], back, q, g.shape, gnorm, place, np.float32, axes=axes),)
    _o()._record(out, (g,), vjp)
    _complete(out, norm, axes)
    return out


# --- functional updates: x.at[idx].set / add / multiply / get ------------------------------

class _IndexUpdateHelper:
    """``x.at``: ``x.at[idx].set(v)`` and friends (jax's functional updates), for any index
    ``x[idx]`` takes."""
    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def __getitem__(self, idx):
        return _IndexUpdateRef(self.array, idx)

    def __repr__(self):
        return f"_IndexUpdateHelper({self.array!r})"


class _Dropped:
    """An update whose index lies outside the array (mode "drop"): nothing is written."""
    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def _update(self, values, kind, fn=None):
        return self.array


def _scatter_method(kind):
    """The ``x.at[idx].<kind>(values, ...)`` method (jax's signature; ``mode``: see
    ``_IndexUpdateRef._moded``; the sortedness / uniqueness hints change nothing here)."""
    def method(self, values, *, indices_are_sorted=False, unique_indices=False, mode=None):
        return self._moded(mode)._update(values, kind)
    method.__name__ = kind
    method.__qualname__ = f"_IndexUpdateRef.{kind}"
    return method


class _IndexUpdateRef:
    """``x.at[idx]``: ``get()``, ``set(v)``, ``add(v)``, ``subtract(v)``,
    ``multiply(v)``/``mul(v)``, ``divide(v)``/``div(v)``, ``min(v)``, ``max(v)``,
    ``power(v)`` and ``apply(fn)`` return new arrays (``x`` is unchanged; float32, or a
    16-bit float ``x``: ``v`` cast to its dtype, the update computed on the float32 widening
    and rounded once; an integer ``x`` with a basic index: set / add / subtract /
    multiply / min / max, a bool one: set, see ``_update_typed``); ``v`` broadcasts to ``x[idx]``'s shape. Duplicate indices (jax 0.10's
    results, measured): ``add``/``subtract`` accumulate (the values summed, then added once),
    ``multiply``/``divide``/``power``/``apply`` apply once per occurrence in index order
    (``x.at[[1, 1]].apply(f)`` is ``f(f(x[1]))``), ``min``/``max`` take the extreme of all
    (order free), ``set`` keeps the last value; out-of-range index entries are dropped (the
    module's docstring). Gradients flow to ``x`` and ``v`` (``apply``: to ``x``, through
    ``fn``); ``min``/``max`` split the cotangent evenly at a tie between ``x`` and one value,
    as jax, but a tie among three or more (``x`` and duplicates of one index) is split
    pairwise, one occurrence at a time (jax: evenly among all)."""
    __slots__ = ("array", "index")

    def __init__(self, array, index):
        self.array, self.index = array, index

    def get(self, *, indices_are_sorted=False, unique_indices=False, mode=None,
            fill_value=None):
        """``x[idx]``. ``mode``: None, ``"promise_in_bounds"`` or ``"clip"`` clamp
        out-of-range index entries (jax's default for gathers); ``"fill"`` / ``"drop"`` give
        ``fill_value`` there (default NaN for floats, the most negative int for signed
        ints, the largest for unsigned, True for bool; other modes ignore it, as jax)."""
        m = _mode_name(mode, "gather")
        if m == "clip":   # Python ints too (x[5] on 3 rows raises; clip asks for row 2)
            return getitem(self.array, _remap_index(tuple(np.shape(self.array)), self.index,
                                                    "clip")[0])
        if m in ("fill", "drop"):
            x = self.array
            idx, pads = _remap_index(tuple(x.shape), self.index, "fill")
            if pads:
                fv = _default_fill(x.dtype) if fill_value is None else fill_value
                widths = [(0, 1) if d in pads else (0, 0) for d in range(len(x.shape))]
                x = _o_move().pad(x, widths, constant_values=fv)
                return getitem(x, idx)
        return getitem(self.array, self.index)   # fill_value unused, as in jax

    def _moded(self, mode):
        """This reference with its index clipped into range for ``mode="clip"`` (jax's
        scatter modes: None / "drop" / "fill" / "promise_in_bounds" drop out-of-range
        entries, "clip" clamps them)."""
        m = _mode_name(mode, "scatter")
        if m == "clip":
            idx, _ = _remap_index(tuple(np.shape(self.array)), self.index, "clip")
            return _IndexUpdateRef(self.array, idx)
        if m in ("drop", "fill"):   # an out-of-range Python int: the update writes nothing
            outside = []

            def probe(i, d, n):
                if isinstance(i, int) and not 0 <= int(_wrapped(i, n)) < n:
                    outside.append(d)
                return i
            _walk_ints(tuple(np.shape(self.array)), _normalize(self.index), probe)
            if outside:
                return _Dropped(self.array)
        return self

    def _update(self, v, kind, fn=None):
        x = self.array
        nidx = _normalize(self.index)
        adv = None if _is_basic(nidx) else _Advanced(tuple(x.shape), nidx)
        if adv is None:
            starts, sizes, keep, out_shape = _parse(tuple(x.shape), nidx)
        else:
            out_shape = adv.out_shape
        try:
            np.broadcast_shapes(tuple(np.shape(v)), out_shape)
        except ValueError:
            raise ValueError(f"x.at[...].{kind}: a value of shape {tuple(np.shape(v))} does not "
                             f"broadcast to the indexed shape {out_shape}") from None
        if isinstance(x, ShapeDtypeStruct) or (adv is not None and adv.abstract):
            return ShapeDtypeStruct(x.shape, x.dtype)
        o = _o()
        if isinstance(x, Array) and x.dtype in o._LOWP:
            # jax casts the values to x's dtype; the update runs on the float32 widening
            # (exact) and is rounded once back: a 16-bit add / multiply / divide as jax's
            dt = x.dtype
            v = o.astype(v, dt) if isinstance(v, Array) else np.asarray(v, dtype=dt)
            v = o.astype(v, np.float32) if isinstance(v, Array) else v.astype(np.float32)
            fn16 = None
            if fn is not None:  # fn sees x's dtype, its result is cast to it (as jax's)
                def fn16(t):
                    return o.astype(o.astype(_apply_fn(fn, o.astype(t, dt)), dt), np.float32)
            out = _IndexUpdateRef(o.astype(x, np.float32), self.index)._update(v, kind, fn16)
            return o.astype(out, dt)
        if isinstance(x, Array) and x.dtype not in o._FLOATS:
            return _update_typed(x, v, kind, adv, starts if adv is None else None,
                                 sizes if adv is None else None, out_shape)
        x = o._lift(x)
        if isinstance(v, Array) and v.dtype != np.float32:
            v = o.astype(v, np.float32)       # jax casts the values to x's dtype
        place, big = _layout_of(x)
        if not isinstance(v, Array):  # broadcast on the host: exact (-0.0 too)
            v = np.broadcast_to(np.asarray(v, np.float32), out_shape)
        v = o._lift(v, place)
        v = o.broadcast_to(v, out_shape)
        if adv is not None:
            if kind == "subtract":   # x + scatter_add(-v): duplicates accumulate as add's
                v, kind = o.negative(v), "add"
            return _update_advanced(x, adv, v, kind, place, big, fn)
        # the value as the region (rank kept): drop new axes, put back indexed ones as size 1
        region = o.reshape(v, tuple(sizes)) if tuple(sizes) != out_shape else v
        if kind == "apply":
            cur = _slice(x, starts, sizes)
            region = _apply_fn(fn, cur)
        elif kind != "set":  # x[idx] op v, elementwise on the region only (as jax)
            op = {"add": o.add, "subtract": o.subtract, "multiply": o.multiply,
                  "divide": o.divide, "min": o.minimum, "max": o.maximum,
                  "power": o.power}[kind]
            region = op(_slice(x, starts, sizes), region)
        return _set_region(x, starts, region, place, big)

    set = _scatter_method("set")
    add = _scatter_method("add")
    subtract = _scatter_method("subtract")
    multiply = mul = _scatter_method("multiply")
    divide = div = _scatter_method("divide")
    min = _scatter_method("min")  # noqa: A003 - jax's names
    max = _scatter_method("max")  # noqa: A003
    power = _scatter_method("power")

    def apply(self, func, *, indices_are_sorted=False, unique_indices=False, mode=None):
        """``func`` (an elementwise function of Arrays, e.g. ``cnp.sin``) applied to the
        indexed elements, once per occurrence of each index (jax's ``.at[].apply``)."""
        if not callable(func):
            raise TypeError(f"x.at[...].apply: func must be callable, got {func!r}")
        return self._moded(mode)._update(0.0, "apply", func)


def _update_typed(x: Array, v, kind: str, adv, starts, sizes, out_shape) -> Array:
    """``x.at[idx].<kind>(v)`` for an integer / bool ``x`` and a basic index (ints,
    slices with step 1, None, ...), as jax: ``set`` casts ``v`` to ``x``'s dtype; ``add`` /
    ``subtract`` / ``multiply`` / ``min`` / ``max`` (ints) compute ``x[idx] op v`` with jax's
    promotion (ints wrap; ``int32 + 2.7`` in float32) and cast the result back. The region is
    copied into a copy of ``x``, in ``x``'s layout. No gradient (integer Arrays carry none)."""
    o, ew = _o(), _o_ew()
    ops = {"set": None, "add": o.add, "subtract": o.subtract, "multiply": o.multiply,
           "min": o.minimum, "max": o.maximum}
    if adv is not None or kind not in ops or (x.dtype == np.bool_ and kind != "set"):
        raise TypeError(f"x.at[...].{kind} of a {x.dtype} Array: other than set (bool) or set / "
                        f"add / subtract / multiply / min / max (ints) with a basic index "
                        f"(ints, slices with step 1, None, ...), updates compute in float32 "
                        f"here; convert with .astype(float32) first")
    place, big = _layout_of(x)
    if kind == "set" or not isinstance(v, (int, float)):   # (Python scalars stay weak)
        v = ew._as(v, x.dtype, place) if kind == "set" else o._lift_any(v, place)
        v = o.broadcast_to(v, out_shape)
        v = o.reshape(v, tuple(sizes)) if tuple(sizes) != out_shape else v
    if kind == "set":
        return _overwrite(x, starts, v, place, big)
    region = ops[kind](_slice(x, starts, sizes), v)
    if region.dtype != x.dtype:
        region = o.astype(region, x.dtype)
    return _overwrite(x, starts, region, place, big)


def _o_ew():
    _elementwise = _upper('_elementwise')
    return _elementwise


_MODES = ("promise_in_bounds", "clip", "drop", "fill")


def _mode_name(mode, what: str):
    """jax's GatherScatterMode as a string (None: the default), or ValueError."""
    if mode is None:
        return None
    name = getattr(mode, "name", mode)   # lax.GatherScatterMode members too
    name = name.lower() if isinstance(name, str) else name
    if name == "fill_or_drop":
        name = "fill"
    if name not in _MODES:
        raise ValueError(f'Unknown {what} mode "{mode}"')
    return name


def _default_fill(dtype):
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return True
    if dt.kind == "i":
        return np.iinfo(dt).min
    if dt.kind == "u":
        return np.iinfo(dt).max
    return float("nan")


def _o_move():
    _move = _upper('_move')
    return _move


def _walk_ints(shape, nidx, fn):
    """``nidx`` (normalized) with ``...`` expanded and each int / _IntArray entry replaced by
    ``fn(entry, dimension, its size)``; None if it holds an abstract index (eval_shape)."""
    fill = _check_count(shape, nidx)
    k = next((j for j, i in enumerate(nidx) if i is Ellipsis), None)
    if k is not None:
        nidx = nidx[:k] + (slice(None),) * fill + nidx[k + 1:]
    out, d = [], 0
    for i in nidx:
        if isinstance(i, _Abstract):
            return None
        out.append(fn(i, d, shape[d]) if isinstance(i, (int, _IntArray)) else i)
        d += _consumed(i)
    return tuple(out)


def _wrapped(i, n):
    a = np.asarray(i.a if isinstance(i, _IntArray) else i, np.int64)
    return np.where(a < 0, a + n, a)


def _remap_index(shape, idx, mode):
    """The index with its integer entries (ints and integer arrays, negatives wrapped once)
    clipped into range (mode "clip"), or with out-of-range entries sent to position n of
    their dimension (mode "fill": the caller pads that dimension with the fill value);
    returns (index, the dimensions that need the pad). Slices, masks and abstract indices
    are left as they are."""
    pads = set()

    def remap(i, d, n):
        a = _wrapped(i, n)
        if mode == "clip":
            a = np.clip(a, 0, max(n - 1, 0))
        else:
            bad = (a < 0) | (a >= n)
            if bad.any():
                a = np.where(bad, n, a)
                pads.add(d)
        return int(a) if isinstance(i, int) else a
    out = _walk_ints(shape, _normalize(idx), remap)
    if out is None:
        return idx, set()
    return tuple(x.a if isinstance(x, _Mask) else x for x in out), pads


def _apply_fn(fn, t: Array) -> Array:
    """``fn(t)`` as a float32 Array of ``t``'s shape (``.at[].apply``'s function)."""
    o = _o()
    r = fn(t)
    if not isinstance(r, Array):
        r = o._lift(np.asarray(r, np.float32), o._place_of(t))
    if tuple(r.shape) != tuple(t.shape):
        raise ValueError(f"x.at[...].apply: func must be elementwise; it returned shape "
                         f"{tuple(r.shape)} for an input of shape {tuple(t.shape)}")
    return r if r.dtype == t.dtype else o.astype(r, t.dtype)


def _update_advanced(x: Array, adv: _Advanced, v: Array, kind: str, place, big, fn=None) -> Array:
    """``x.at[idx].<kind>(v)`` for an advanced index (``v`` already of the indexed shape):
    on the index's region, as copies of rows, so elements not indexed keep their bits; each
    device updates its own block (a sharded indexed dimension stays sharded), and entries of
    an index array that are out of range write nothing (jax drops them).

    set: each indexed element takes its last value in index order (jax leaves the winner
    among duplicates unspecified; numpy's assignment keeps the last). add: the duplicates'
    values are summed (in index order) and added once, ``x + scatter_add(v)`` over a -0.0
    background (exact where nothing is added). multiply / divide: ``x * P`` / ``x / P``
    with P the product of the duplicates' values (one round of distinct indices at a time)
    over a 1.0 background, as jax's ``scatter_mul`` (divide is ``x / ones.at[idx].multiply(v)``
    there too). min / max / power / apply: one round per occurrence rank (the k-th
    occurrence of every index in round k), each ``where(hit_k, op(cur, v_k), cur)`` with
    ``hit_k`` a 0/1 mask of the rows round k writes (apply: ``op`` is ``fn`` of the gathered
    current values); rows not hit keep their bits and their whole cotangent."""
    o = _o()
    y, gnorm, _, starts, sels, q, rows, ok, onorm, axes = adv.prepare(x, owner=True)
    memo = {}

    def written(sel):
        """(the v rows this block writes, their rows in the block): in bounds and its own."""
        if id(sel) not in memo:
            w = sel >= 0 if ok is None else (sel >= 0) & ok
            keep = np.nonzero(w)[0]
            memo[id(sel)] = keep, sel[keep]
        return memo[id(sel)]

    if kind == "set":
        picks = []
        for sel in sels:
            keep, ks = written(sel)
            hit, ridx = np.unique(ks[::-1], return_index=True)
            pick = np.arange(rows, dtype=np.int64)
            pick[hit] = rows + keep[len(ks) - 1 - ridx]  # the last occurrence of each index
            picks.append(pick)
        new = _rows([(y, gnorm), (v, onorm)], picks, q, y.shape, gnorm, place, np.float32,
                    axes=axes)
    elif kind == "add":
        targets = []
        for sel in sels:
            keep, ks = written(sel)
            t = np.full(len(sel), -1, np.int64)
            t[keep] = ks
            targets.append(t)
        new = o.add(y, _scatter_rows(v, onorm, targets, q, y.shape, gnorm, place, -0.0, axes))
    elif kind in ("min", "max", "power", "apply"):
        ranks = _occurrence_ranks(sels, written)
        new = y
        for r in range(max((int(rk.max()) + 1 for _, _, rk in ranks if len(rk)), default=0)):
            mpicks, vpicks = [], []
            for keep, ks, rank in ranks:
                mine = rank == r
                mp = np.zeros(rows, np.int64)   # row 0: 0.0 (not hit), row 1: 1.0 (hit)
                mp[ks[mine]] = 1
                vp = np.zeros(rows, np.int64)   # row 0: the background, then v's rows
                vp[ks[mine]] = 1 + keep[mine]
                mpicks.append(mp)
                vpicks.append(vp)
            hit = _rows([0.0, 1.0], mpicks, q, y.shape, gnorm, place, np.float32, axes=axes)
            if kind == "apply":
                if axes:
                    gs = [np.where(s_ < 0, rows, s_) for s_ in sels]
                    cur = _rows([(new, gnorm), -0.0], gs, q, adv.out_shape, onorm, place,
                                np.float32, grad_keep=ok, axes=axes)
                else:
                    cur = _rows([(new, gnorm)], sels, q, adv.out_shape, onorm, place,
                                np.float32, grad_keep=ok)
                fv = _apply_fn(fn, cur)
                upd = _rows([0.0, (fv, onorm)], vpicks, q, y.shape, gnorm, place, np.float32,
                            axes=axes)
            else:
                bg = 1.0 if kind == "power" else 0.0   # (rows not hit are not selected)
                f = _rows([bg, (v, onorm)], vpicks, q, y.shape, gnorm, place, np.float32,
                          axes=axes)
                op = {"min": o.minimum, "max": o.maximum, "power": o.power}[kind]
                upd = op(new, f)
            new = o.where(hit, upd, new)
    else:
        ranks = _occurrence_ranks(sels, written)
        factors = []
        for r in range(max((int(rk.max()) + 1 for _, _, rk in ranks if len(rk)), default=0)):
            picks = []
            for keep, ks, rank in ranks:
                pick = np.zeros(rows, np.int64)  # row 0: the 1.0 background
                mine = rank == r
                pick[ks[mine]] = 1 + keep[mine]
                picks.append(pick)
            factors.append(_rows([1.0, (v, onorm)], picks, q, y.shape, gnorm, place, np.float32,
                                 axes=axes))
        new = y
        if kind == "multiply":
            for f in factors:
                new = o.multiply(new, f)
        elif factors:
            p = factors[0]
            for f in factors[1:]:
                p = o.multiply(p, f)
            new = o.divide(y, p)
    return _set_region(x, starts, new, place, big)


def _occurrence_ranks(sels, written) -> list:
    """Per block plan: (the v rows it writes, their region rows, each one's occurrence rank:
    0 for the first time its row is written in index order, 1 for the second, ...)."""
    out = []
    for sel in sels:
        keep, ks = written(sel)
        order = np.argsort(ks, kind="stable")
        n = len(ks)
        first = np.r_[0, np.nonzero(np.diff(ks[order]))[0] + 1] if n else np.zeros(0, np.int64)
        rank = np.empty(n, np.int64)
        rank[order] = np.arange(n) - np.repeat(first, np.diff(np.r_[first, n]))
        out.append((keep, ks, rank))
    return out


# --- joins ----------------------------------------------------------------------------------

def _operands(arrays, who):
    arrays = list(arrays)
    if not arrays:
        raise ValueError(f"{who}: need at least one array")
    if any(isinstance(a, ShapeDtypeStruct) for a in arrays):
        return arrays, True
    o = _o()
    dt0 = arrays[0].dtype if type(arrays[0]) is Array else None
    if all(type(a) is Array and a.dtype == dt0 for a in arrays):
        # Arrays of one dtype: nothing to promote, nothing to lift (the placement still has
        # to be common)
        o._common_placement(arrays)
        for a in arrays:
            a._check_alive()
        return arrays, False
    hosts = {k: np.asarray(a) for k, a in enumerate(arrays) if not isinstance(a, Array)}
    # the operands' promoted dtype, as jax: with a float among them jax's float promotion
    # (bfloat16 with float16 or float32 -> float32, an integer with a float -> the float);
    # otherwise numpy's, narrowed as jax does without x64 (int64 -> int32). Operands of
    # another dtype are converted up to it (Arrays on their devices, differentiably).
    dts = [_dtypes.canonicalize(a.dtype if isinstance(a, Array) else hosts[k].dtype)
           for k, a in enumerate(arrays)]
    if any(d in o._FLOATS for d in dts):
        dt = o._result_dtype([a if isinstance(a, Array) else hosts[k]
                              for k, a in enumerate(arrays)], who)
    else:
        dt = _dtypes.canonicalize(np.result_type(*dts))
    places = [a for a in arrays if isinstance(a, Array)]
    place = o._common_placement(places) if places else None
    out = []
    for a in arrays:
        if isinstance(a, Array):
            a._check_alive()
            out.append(a if a.dtype == dt else o.astype(a, dt))
        else:
            h = hosts[len(out)].astype(dt)
            out.append(o._lift(h, place) if dt == np.float32 else device_put(
                h, o._sharding_for(place if place is not None else o._place_of(o._lift(0.0)), [()] * h.ndim)))
    return out, False


def concatenate(arrays, axis: int = 0):
    """Join arrays along an existing dimension (``jnp.concatenate``). The result is
    unsharded along ``axis`` and takes the other dimensions' mesh axes of the first
    operand placed on a mesh (the others are resharded to match)."""
    if axis is None:   # jnp: the operands flattened, then joined
        o = _o()
        return concatenate([o.reshape(a, (-1,)) if isinstance(a, Array) else
                            np.ravel(np.asarray(a)) for a in arrays], 0)
    arrays, abstract = _operands(arrays, "concatenate")
    return _concatenate(arrays, axis, abstract)


def _concatenate(arrays, axis, abstract: bool):
    """:func:`concatenate` of operands that :func:`_operands` made (``abstract``: its
    ShapeDtypeStruct flag)."""
    nd = len(arrays[0].shape)
    if nd == 0:
        raise ValueError("concatenate: zero-dimensional arrays cannot be concatenated")
    if not -nd <= axis < nd:
        raise ValueError(f"concatenate: axis {axis} is out of bounds for rank {nd}")
    axis %= nd
    for k, a in enumerate(arrays):
        if len(a.shape) != nd or any(s != t for j, (s, t) in enumerate(zip(a.shape, arrays[0].shape))
                                    if j != axis):
            raise ValueError(
                f"concatenate: all dimensions except {axis} must match; operand 0 has shape "
                f"{tuple(arrays[0].shape)}, operand {k} has shape {tuple(a.shape)}")
    total = sum(a.shape[axis] for a in arrays)
    shape = tuple(total if j == axis else s for j, s in enumerate(arrays[0].shape))
    if abstract:
        return ShapeDtypeStruct(shape, arrays[0].dtype)
    if len(arrays) == 1:
        return _fresh(arrays[0])
    o = _o()
    lead = next((a for a in arrays if o._mesh_key(a)[0] == "mesh"), arrays[0])
    place, norm = _layout_of(lead)
    norm[axis] = ()
    parts = [_to(a, place, norm) for a in arrays]
    out = _alloc(shape, arrays[0].dtype, place, norm)
    offs, copied = [], {}
    off = 0
    for p in parts:
        offs.append(off)
        start = [off if j == axis else 0 for j in range(nd)]
        for k, v in _copy_region(out, p, start, dst_is_big=True).items():
            copied[k] = copied.get(k, 0) + v
        off += p.shape[axis]
    _check_filled(out, copied, "concatenate")
    if _differentiable(out.dtype):
        def vjp(g):
            return tuple(_slice(_to(g, place, norm), [o_ if j == axis else 0 for j in range(nd)],
                                [p.shape[j] for j in range(nd)]) for o_, p in zip(offs, parts))
        o._record(out, tuple(arrays), vjp)
    return out


def stack(arrays, axis: int = 0):
    """Join arrays along a new dimension (``jnp.stack``)."""
    arrays, abstract = _operands(arrays, "stack")
    nd = len(arrays[0].shape) + 1
    if not -nd <= axis < nd:
        raise ValueError(f"stack: axis {axis} is out of bounds for rank {nd}")
    axis %= nd
    for k, a in enumerate(arrays):
        if tuple(a.shape) != tuple(arrays[0].shape):
            raise ValueError(f"stack: all arrays must have the same shape; operand 0 has "
                             f"{tuple(arrays[0].shape)}, operand {k} has {tuple(a.shape)}")
    if abstract:
        s = list(arrays[0].shape)
        s.insert(axis, len(arrays))
        return ShapeDtypeStruct(tuple(s), arrays[0].dtype)
    idx = (slice(None),) * axis + (None,)
    # (a[idx]: the Array's own indexing, whose C path serves a new axis of size 1)
    return _concatenate([a[idx] for a in arrays], axis, False)


def _split_points(n, indices_or_sections, who, even):
    if isinstance(indices_or_sections, (int, np.integer)):
        k = int(indices_or_sections)
        if k <= 0:
            raise ValueError(f"{who}: number of sections must be larger than 0")
        if even and n % k:
            raise ValueError(f"{who}: array split does not result in an equal division "
                             f"({n} into {k})")
        q, r = divmod(n, k)
        sizes = [q + (1 if i < r else 0) for i in range(k)]
        return [sum(sizes[:i]) for i in range(1, k)]
    try:
        return [operator.index(i) for i in indices_or_sections]
    except TypeError:
        raise TypeError(f"{who}: indices_or_sections must be an int or a sequence of ints, got "
                        f"{indices_or_sections!r}") from None


def split(x, indices_or_sections, axis: int = 0):
    """``jnp.split``: a list of slices of ``x`` along ``axis`` (equal sections, or cut at
    the given indices)."""
    return _split(x, indices_or_sections, axis, "split", even=True)


def array_split(x, indices_or_sections, axis: int = 0):
    """``jnp.array_split``: like :func:`split`, sections may differ by one."""
    return _split(x, indices_or_sections, axis, "array_split", even=False)


def _split(x, indices_or_sections, axis, who, even):
    if not isinstance(x, (Array, ShapeDtypeStruct)):   # a numpy array, a list or a number are
        x = _o()._lift_any(x)                          # placed, as jnp (None, str: TypeError)
    nd = len(x.shape)
    if not -nd <= axis < nd:
        raise ValueError(f"{who}: axis {axis} is out of bounds for rank {nd}")
    axis %= nd
    n = x.shape[axis]
    cuts = _split_points(n, indices_or_sections, who, even)
    bounds = [0] + [min(max(c if c >= 0 else c + n, 0), n) for c in cuts] + [n]
    pre = (slice(None),) * axis
    return [getitem(x, pre + (slice(a, max(a, b)),)) for a, b in zip(bounds[:-1], bounds[1:])]


# ops that read host values: under jit, single nodes of the program (node.py)
from .node import op_node as _op_node  # noqa: E402

getitem = _op_node("getitem")(getitem)
concatenate = _op_node("concatenate")(concatenate)
split = _op_node("split")(split)


def _getitem_plan(x: Array, out_ndim: int):
    """The plan of ``Array.__getitem__``'s C path (csrc/python/py_slice.c), made once per
    (``x``'s sharding object, its rank, the result's rank ``out_ndim``): ``(tape_local,
    sharding, devices, replica_ids)`` when every block of ``x`` holds the whole array,
    unsharded (one device, or replicated over a mesh with no mesh axis in its spec), so that
    a basic index's result is each block's region copied on the block's own device, laid
    out as :func:`getitem` lays it out: ``sharding`` as ``_alloc`` of an unsharded layout of
    rank ``out_ndim`` gives it, ``devices`` ``x``'s blocks' devices in block order (the same
    as the result's), ``replica_ids`` the result's blocks'; ``tape_local`` is the thread-local
    tape stack (the C path leaves a call under a recording tape to :func:`getitem`). None
    otherwise: :func:`getitem` runs for Arrays of this layout."""
    o = _o()
    place, norm = _layout_of(x)
    if any(norm) or tuple(x._shard_shape) != tuple(x.shape):
        return None
    devices = tuple(dev for dev, _, _, _ in x._blocks)
    sharding = o._sharding_for(place, [()] * out_ndim)
    _, layout = sharding._addressable_layout((1,) * out_ndim)
    if not devices or tuple(dev for dev, _, _ in layout) != devices or any(
            any(start) for _, start, _ in layout):
        return None
    return o._tls, sharding, devices, tuple(rid for _, _, rid in layout)


# Array.__getitem__ (_C.array_getitem): basic indices of an Array every device holds whole in
# C, every other call through getitem
_C.getitem_register(getitem, _getitem_plan)
