"""Basic indexing and joining: ``x[...]`` with ints, slices, ``None`` and ``...``;
``concatenate``, ``stack`` and ``split`` -- on sharded Arrays, with gradients.

Every one is a copy of whole sub-blocks between shards (the core's ``copy_overlap``, on
the shards' own device), so they run on every backend and any dtype. Sharding: a dimension
that is sliced (or joined along) comes out unsharded -- each device first gathers that
dimension of its operand if it was sharded (as ``reshape`` does for what it cannot keep) --
and every other dimension keeps its mesh axes, so ``logits[:, :-1, :]`` on a
``('batch', None, 'vocab')`` layout stays sharded over batch and vocab.

The gradient of a slice is the cotangent copied into a zero array of the operand's shape;
that of a join, the slices of the cotangent.

>>> import numpy as np, ctrainstate as cts, ctrainstate.numpy as cnp
>>> x = cts.device_put(np.arange(12, dtype=np.float32).reshape(3, 4))
>>> np.asarray(x[1:, ::1][..., 2]).tolist()
[6.0, 10.0]
>>> np.asarray(cnp.concatenate([x[:1], x[2:]], axis=0)).tolist()
[[0.0, 1.0, 2.0, 3.0], [8.0, 9.0, 10.0, 11.0]]
"""
from __future__ import annotations

import math
import operator

import numpy as np

from . import _C
from .array import Array, _alloc_blocks

__all__ = ["getitem", "concatenate", "stack", "split", "array_split"]


def _o():
    from . import _ops
    return _ops


def _layout_of(x: Array):
    o = _o()
    place = o._place_of(x)
    norm = o._norm(x.sharding, x.ndim) if o._mesh_key(x)[0] == "mesh" else [()] * x.ndim
    return place, [tuple(e) for e in norm]


def _alloc(shape, dtype, place, norm) -> Array:
    sharding = _o()._sharding_for(place, norm)
    _, blocks = _alloc_blocks(tuple(shape), dtype, sharding)
    return Array._create(tuple(shape), np.dtype(dtype), sharding, blocks)


def _to(x: Array, place, norm) -> Array:
    """``x`` laid out with ``norm`` on ``place`` (any dtype)."""
    o = _o()
    if x.dtype == np.float32:
        return o._to(x, place, norm)
    from .array import device_put
    want = o._sharding_for(place, norm)
    return x if x.sharding == want else device_put(x, want)


def _by_device(a: Array) -> dict:
    return {dev.id: (buf, start) for dev, buf, start, _ in a._blocks}


def _fill(a: Array, value: float):
    """Every element of the float32 Array ``a`` set to ``value`` (a kernel per device)."""
    o = _o()
    bufs = [buf for _, buf, _, _ in a._blocks if buf.nbytes]
    _C.op_unary(o.U_AFFINE, 0.0, float(value), bufs, bufs)


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
    if x.dtype == np.float32:
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
    if x.dtype == np.float32:
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
    """A copy of ``x`` with its own buffers (recorded as the identity for float32)."""
    y = x.copy()
    if x.dtype == np.float32:
        _o()._record(y, (x,), lambda g: (g,))
    return y


def _index_int(i, n, d):
    try:
        i = operator.index(i)
    except TypeError:
        raise TypeError(
            f"Array indices must be ints, slices, None or ...; got {type(i).__name__} {i!r} for "
            f"dimension {d} (integer-array and boolean indexing are not supported: use "
            f"ctrainstate.numpy.take_rows or where)") from None
    if not -n <= i < n:
        raise IndexError(f"index {i} is out of bounds for axis {d} with size {n}")
    return i + n if i < 0 else i


def _parse(shape, idx):
    """Basic index -> (starts, sizes, keep, out_shape): the region ``x[starts : starts +
    sizes]`` (rank kept) and how the result's dimensions map onto it (``keep[j]``: the
    region dimension of result dimension j, None for a new axis)."""
    from ._abstract import ShapeDtypeStruct
    if not isinstance(idx, tuple):
        idx = (idx,)
    for i in idx:
        if isinstance(i, (list, np.ndarray, Array, ShapeDtypeStruct)) or isinstance(i, bool):
            raise TypeError(
                f"Array indexing with {type(i).__name__} (integer-array or boolean indexing) is "
                f"not supported: use ctrainstate.numpy.take_rows (rows of a table) or "
                f"ctrainstate.numpy.where (masks)")
    nell = sum(1 for i in idx if i is Ellipsis)
    if nell > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    ndim = len(shape)
    used = sum(1 for i in idx if i is not None and i is not Ellipsis)
    if used > ndim:
        raise IndexError(f"too many indices for an array of rank {ndim}: {used} were given")
    if nell:
        k = idx.index(Ellipsis)
        idx = idx[:k] + (slice(None),) * (ndim - used) + idx[k + 1:]
    else:
        idx = idx + (slice(None),) * (ndim - used)
    starts, sizes, keep, out_shape = [], [], [], []
    d = 0
    for i in idx:
        if i is None:
            out_shape.append(1)
            keep.append(None)
            continue
        n = shape[d]
        if isinstance(i, slice):
            a, b, step = i.indices(n)
            if step != 1:
                raise NotImplementedError(
                    f"slice steps other than 1 are not supported (dimension {d}: {i}); reshape "
                    f"and slice instead, e.g. x.reshape(n // k, k)[:, 0] for x[::k]")
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
    """``x[idx]`` for basic indices: ints, slices with step 1, ``None`` and ``...``."""
    from ._abstract import ShapeDtypeStruct
    starts, sizes, keep, out_shape = _parse(tuple(x.shape), idx)
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


# --- functional updates: x.at[idx].set / add / multiply / get ------------------------------

class _IndexUpdateHelper:
    """``x.at``: ``x.at[idx].set(v)`` and friends (jax's functional updates), for basic
    indices."""
    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def __getitem__(self, idx):
        return _IndexUpdateRef(self.array, idx)

    def __repr__(self):
        return f"_IndexUpdateHelper({self.array!r})"


class _IndexUpdateRef:
    """``x.at[idx]``: ``get()``, ``set(v)``, ``add(v)``, ``multiply(v)``/``mul(v)``,
    ``divide(v)``/``div(v)`` return new arrays (``x`` is unchanged); ``v`` broadcasts to
    ``x[idx]``'s shape. Gradients flow to ``x`` and ``v``."""
    __slots__ = ("array", "index")

    def __init__(self, array, index):
        self.array, self.index = array, index

    def get(self, **_kwargs):
        return getitem(self.array, self.index)

    def _update(self, v, kind):
        from ._abstract import ShapeDtypeStruct
        x = self.array
        starts, sizes, keep, out_shape = _parse(tuple(x.shape), self.index)
        if isinstance(x, ShapeDtypeStruct):
            np.broadcast_shapes(np.shape(v), out_shape)
            return ShapeDtypeStruct(x.shape, x.dtype)
        o = _o()
        x = o._lift(x)
        place, big = _layout_of(x)
        try:
            np.broadcast_shapes(tuple(np.shape(v)), out_shape)
        except ValueError:
            raise ValueError(f"x.at[...].{kind}: a value of shape {tuple(np.shape(v))} does not "
                             f"broadcast to the indexed shape {out_shape}") from None
        v = o._lift(v, place)
        v = o.broadcast_to(v, out_shape)
        # the value as the region (rank kept): drop new axes, put back indexed ones as size 1
        region = o.reshape(v, tuple(sizes)) if tuple(sizes) != out_shape else v
        if kind != "set":  # x[idx] op v, elementwise on the region only (as jax)
            op = {"add": o.add, "multiply": o.multiply, "divide": o.divide}[kind]
            region = op(_slice(x, starts, sizes), region)
        return _set_region(x, starts, region, place, big)

    def set(self, values, **_kwargs):
        return self._update(values, "set")

    def add(self, values, **_kwargs):
        return self._update(values, "add")

    def multiply(self, values, **_kwargs):
        return self._update(values, "multiply")

    mul = multiply

    def divide(self, values, **_kwargs):
        return self._update(values, "divide")

    div = divide

    def __getattr__(self, name):
        if name in ("min", "max", "power", "apply"):
            raise NotImplementedError(
                f"x.at[...].{name} is not supported; set, add, multiply, divide and get are")
        raise AttributeError(name)


# --- joins ----------------------------------------------------------------------------------

def _operands(arrays, who):
    from ._abstract import ShapeDtypeStruct
    arrays = list(arrays)
    if not arrays:
        raise ValueError(f"{who}: need at least one array")
    if any(isinstance(a, ShapeDtypeStruct) for a in arrays):
        return arrays, True
    o = _o()
    from . import _dtypes
    hosts = {k: np.asarray(a) for k, a in enumerate(arrays) if not isinstance(a, Array)}
    # numpy's promotion over every operand, narrowed as jax does without x64 (float64 ->
    # float32, int64 -> int32); an Array is never converted: one of another dtype raises
    dt = _dtypes.canonicalize(np.result_type(*[a.dtype if isinstance(a, Array) else hosts[k].dtype
                                               for k, a in enumerate(arrays)]))
    odd = sorted({str(a.dtype) for a in arrays if isinstance(a, Array) and a.dtype != dt})
    if odd:
        raise TypeError(
            f"{who}: the operands promote to {dt} but Arrays of {', '.join(odd)} are among them; "
            f"convert them first (x.astype({dt}))")
    places = [a for a in arrays if isinstance(a, Array)]
    place = o._common_placement(places) if places else None
    out = []
    for a in arrays:
        if isinstance(a, Array):
            a._check_alive()
            out.append(a)
        else:
            from .array import device_put
            h = hosts[len(out)].astype(dt)
            out.append(o._lift(h, place) if dt == np.float32 else device_put(
                h, o._sharding_for(place if place is not None else o._place_of(o._lift(0.0)), [()] * h.ndim)))
    return out, False


def concatenate(arrays, axis: int = 0):
    """Join arrays along an existing dimension (``jnp.concatenate``). The result is
    unsharded along ``axis`` and takes the other dimensions' mesh axes of the first
    operand placed on a mesh (the others are resharded to match)."""
    arrays, abstract = _operands(arrays, "concatenate")
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
        from ._abstract import ShapeDtypeStruct
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
    if out.dtype == np.float32:
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
        from ._abstract import ShapeDtypeStruct
        s = list(arrays[0].shape)
        s.insert(axis, len(arrays))
        return ShapeDtypeStruct(tuple(s), arrays[0].dtype)
    idx = (slice(None),) * axis + (None,)
    return concatenate([getitem(a, idx) for a in arrays], axis)


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
    return [int(i) for i in indices_or_sections]


def split(x, indices_or_sections, axis: int = 0):
    """``jnp.split``: a list of slices of ``x`` along ``axis`` (equal sections, or cut at
    the given indices)."""
    return _split(x, indices_or_sections, axis, "split", even=True)


def array_split(x, indices_or_sections, axis: int = 0):
    """``jnp.array_split``: like :func:`split`, sections may differ by one."""
    return _split(x, indices_or_sections, axis, "array_split", even=False)


def _split(x, indices_or_sections, axis, who, even):
    nd = len(x.shape)
    if not -nd <= axis < nd:
        raise ValueError(f"{who}: axis {axis} is out of bounds for rank {nd}")
    axis %= nd
    n = x.shape[axis]
    cuts = _split_points(n, indices_or_sections, who, even)
    bounds = [0] + [min(max(c if c >= 0 else c + n, 0), n) for c in cuts] + [n]
    pre = (slice(None),) * axis
    return [getitem(x, pre + (slice(a, max(a, b)),)) for a, b in zip(bounds[:-1], bounds[1:])]
