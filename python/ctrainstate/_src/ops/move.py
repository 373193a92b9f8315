"""jax.numpy's data-movement functions on sharded Arrays, differentiable: ``take``,
``take_along_axis``, ``repeat``, ``tile``, ``flip`` / ``fliplr`` / ``flipud``, ``roll``,
``pad``, ``tril`` / ``triu``, ``eye``, ``diag`` / ``diagonal``, ``moveaxis``, ``swapaxes``,
``atleast_1d`` / ``atleast_2d`` / ``atleast_3d`` and ``prod``.

They are built from the indexing and joining of :mod:`ctrainstate._src.ops.slicing` (basic slices,
row gathers with host-planned index arrays, ``concatenate``) and the layout ops of
:mod:`ctrainstate._src.ops.ops` (``reshape``, ``transpose``), so they move the bits of every stored
dtype (the floats, the ints, bool) as they are, run on each device's own
block, and differentiate as those do (a gather's cotangent is scatter-added back, duplicates
adding up; a join's is sliced). Index arrays are derived on the host from the shapes (and, for
``take``, from the given indices, which are read to the host as ``x[idx]`` reads them), except
in ``take_along_axis`` of an Array that each device holds whole, which computes its positions
on the devices.

Sharding follows the slicing rule: a dimension taken whole keeps its mesh axes; a dimension
that is gathered, padded, rolled, flipped or tiled comes out unsharded (each device first
gathers that dimension of its operand where it was sharded, except for float32 gathers, which
keep it sharded and all-reduce the rows instead -- see ``_slicing``). Exceptions, which keep
more: ``repeat`` with an int count keeps the repeated dimension's mesh axes (a gather on a new
unit axis, then a reshape that merges it); ``tril`` / ``triu`` on float Arrays are a select
against a 0/1 mask that is placed with the operand's sharding of its last two dimensions (each
device receives only its block of the mask), so nothing is gathered.

Every function also takes ``ShapeDtypeStruct`` operands (inside ``eval_shape``) and checks its
arguments the same way there; errors are ``TypeError`` / ``ValueError`` naming the function,
the argument and the shapes.

>>> import numpy as np, ctrainstate as cts, ctrainstate.numpy as cnp
>>> x = cts.device_put(np.arange(6, dtype=np.float32).reshape(2, 3))
>>> np.asarray(cnp.take(x, np.array([2, 0, -1]), axis=1)).tolist()
[[2.0, 0.0, 2.0], [5.0, 3.0, 5.0]]
>>> np.asarray(cnp.pad(x, ((0, 1), (1, 0)), mode="edge")).tolist()
[[0.0, 0.0, 1.0, 2.0], [3.0, 3.0, 4.0, 5.0], [3.0, 3.0, 4.0, 5.0]]
>>> np.asarray(cnp.tril(cnp.ones((3, 3)))).tolist()
[[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
"""
from __future__ import annotations
from ..base.hooks import provide as _provide
_provide('_move', __name__)   # lower layers call into this module through _hooks.upper

import math
import operator

import numpy as np

from ..base import dtypes as _dtypes
from .slicing import concatenate, getitem
from ..array.array import Array
from . import ops as _ops
from ..array.abstract import ShapeDtypeStruct
from .elementwise import sum_dtype
from .slicing import _layout_of as lo
from .slicing import (_INT32_LIMIT, _KEPT, _KEPT_MAX, _device_index, _gather_rows_at, _kept,
                      _rows_in_range, _whole)
from ..array.array import device_put
from ..array.sharding import NamedSharding

__all__ = [
    "take", "take_along_axis", "repeat", "tile", "flip", "fliplr", "flipud", "roll", "pad",
    "tril", "triu", "eye", "diag", "diagonal", "moveaxis", "swapaxes", "atleast_1d",
    "atleast_2d", "atleast_3d", "prod", "sort", "argsort",
]


def _o():
    return _ops


def _sds():
    return ShapeDtypeStruct


def _is_abstract(x) -> bool:
    return isinstance(x, _sds())


def _operand(x, who: str, name: str = "a"):
    """An Array or ShapeDtypeStruct operand (host values are placed as ``device_put`` places
    them, with their canonical dtype)."""
    if _is_abstract(x):
        return x
    if isinstance(x, Array):
        x._check_alive()
        return x
    try:
        h = np.asarray(x)
    except Exception:  # noqa: BLE001 - reported as a TypeError below
        h = None
    if h is None or h.dtype == object or h.dtype.kind not in "biuf" and h.dtype not in _o()._FLOATS:
        what = f"{type(x).__name__} of dtype {h.dtype}" if h is not None and h.dtype != object \
            else type(x).__name__
        raise TypeError(f"{who}: argument {name!r} must be an array (an Array, a numpy array or "
                        f"a number) of a dtype ctrainstate stores, got {what}")
    return _o()._lift_any(h)


def _int(v, who: str, name: str) -> int:
    if isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{who}: {name} must be an int, got a bool ({v!r})")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{who}: {name} must be an int, got {type(v).__name__} {v!r}") from None


def _axis(axis, nd: int, who: str, shape=None, name: str = "axis") -> int:
    """One axis as a non-negative int (negative ones count from the end); the errors name
    ``who``, the argument and the array's dimension (and shape, when given). Shared by the
    ops that take an axis (lax's *_in_dim forms, linalg.norm)."""
    a = _int(axis, who, name)
    if not -nd <= a < nd:
        where = f" (shape {tuple(shape)})" if shape is not None else ""
        raise ValueError(f"{who}: {name} {a} is out of bounds for an array of dimension {nd}"
                         f"{where}")
    return a % nd


def _axes(axis, nd: int, who: str, shape, name: str = "axis") -> tuple:
    """An int or a sequence of ints, each in range and none repeated, as non-negative ints."""
    seq = axis if isinstance(axis, (tuple, list)) else (axis,)
    out = tuple(_axis(a, nd, who, shape, name) for a in seq)
    if len(set(out)) != len(out):
        raise ValueError(f"{who}: repeated axis in {name}={axis!r} (dimensions {out}, shape "
                         f"{tuple(shape)})")
    return out


def _along(axis: int, idx) -> tuple:
    """The index tuple that applies ``idx`` to dimension ``axis`` (the others taken whole)."""
    return (slice(None),) * axis + (idx,)


def _gather(a, idx, axis: int):
    """``a`` indexed along ``axis`` by the host int array ``idx`` (every entry in range):
    the result has ``idx``'s dimensions in place of ``axis``."""
    return getitem(a, _along(axis, np.asarray(idx, np.int64)))


def _reshape(a, shape):
    shape = tuple(int(s) for s in shape)
    if _is_abstract(a):
        return _sds()(shape, a.dtype)
    return _o().reshape(a, shape)


def _fill_value(dtype, fill_value, who):
    """jax's fill for out-of-range reads: NaN for floats, the most negative value for signed
    integers, the largest for unsigned ones, True for bools (or ``fill_value`` cast)."""
    dtype = np.dtype(dtype)
    if fill_value is not None:
        try:
            return np.asarray(fill_value).astype(dtype)
        except (TypeError, ValueError):
            raise TypeError(f"{who}: fill_value {fill_value!r} cannot be cast to {dtype}") from None
    if dtype == np.bool_:
        return np.asarray(True)
    if dtype.kind == "i":
        return np.asarray(np.iinfo(dtype).min, dtype)
    if dtype.kind == "u":
        return np.asarray(np.iinfo(dtype).max, dtype)
    return np.asarray(np.nan, dtype)


def _index_host(indices, who: str):
    """(host int64 array or None when abstract, shape) of an index operand."""
    if _is_abstract(indices):
        if indices.dtype.kind not in "iu":
            raise TypeError(f"{who}: indices must have an integer dtype, got {indices.dtype}")
        return None, tuple(indices.shape)
    if isinstance(indices, Array):
        indices._check_alive()
    h = np.asarray(indices)
    if h.dtype.kind not in "iu":
        raise TypeError(f"{who}: indices must have an integer dtype, got {h.dtype} (shape "
                        f"{h.shape})")
    if h.dtype.kind == "u" and h.size and int(h.max()) > np.iinfo(np.int64).max:
        h = np.minimum(h, np.iinfo(np.int64).max)
    return h.astype(np.int64), h.shape


def _read_with_mode(a, idx, axis: int, mode, fill_value, who: str, clip_wraps: bool):
    """``a`` gathered along ``axis`` at the host indices ``idx`` under jax's ``mode``:
    "fill" (None: the default) -- negative entries in [-n, 0) wrap, other out-of-range entries
    read ``fill_value``; "clip" -- entries clamped to [0, n - 1] (negative ones wrapped first
    when ``clip_wraps``, as take_along_axis, not as take); "wrap" -- entries taken modulo n.
    Out-of-range entries pass no cotangent ("fill"), as in jax."""
    n = a.shape[axis]
    if mode is None or mode == "fill":
        w = np.where(idx < 0, idx + n, idx)
        ok = (w >= 0) & (w < n)
        if ok.all():
            return _gather(a, w, axis)
        fill = _fill_value(a.dtype, fill_value, who)
        shape = list(a.shape)
        shape[axis] = 1
        ext = concatenate([a, np.full(shape, fill, a.dtype)], axis)  # row n: the fill
        return _gather(ext, np.where(ok, w, n), axis)
    if n == 0 and idx.size:
        raise ValueError(f"{who}: cannot index an empty dimension {axis} (shape "
                         f"{tuple(a.shape)}) with mode {mode!r}")
    if mode == "clip":
        if clip_wraps:
            idx = np.where(idx < 0, idx + n, idx)
        return _gather(a, np.clip(idx, 0, max(n - 1, 0)), axis)
    if mode == "wrap":
        return _gather(a, np.mod(idx, n) if n else idx, axis)
    raise AssertionError(mode)


def _check_mode(mode, who, allowed):
    if mode is not None and mode not in allowed:
        raise ValueError(f"{who}: mode {mode!r} is not supported; use one of "
                         f"{', '.join(repr(m) for m in allowed)} (None: 'fill', jax's default)")


# --- take, take_along_axis --------------------------------------------------------------------

def take(a, indices, axis=None, mode=None, unique_indices=False, indices_are_sorted=False,
         fill_value=None):
    """``jnp.take``: the elements of ``a`` at ``indices`` along ``axis`` (``a`` flattened when
    ``axis`` is None); the result has ``indices``' dimensions in place of ``axis``.

    Modes, as jax's: ``None`` / ``"fill"`` (the default) -- a negative index in [-n, 0) counts
    from the end, any other out-of-range one reads ``fill_value`` (default NaN for floats, the
    most negative int32, the largest uint32, True for bools) and passes no gradient;
    ``"clip"`` -- indices clamped to [0, n - 1] (negative ones to 0: jax's take does not wrap
    them in this mode); ``"wrap"`` -- indices modulo n. (``"raise"`` / ``"promise_in_bounds"``
    raise ``ValueError``, as jax refuses them.)

    Where it runs: an ``a`` that every device holds whole (one device, or replicated), in
    modes "fill" and "clip", is read on the devices at row numbers computed there from the
    indices (an integer Array on the same devices, held whole there, stays there; host
    indices are placed there first): nothing is copied to the host, and the result is placed
    as ``a``. Otherwise the indices are read to the host (an Array too) to plan the gather.
    Sharding: the other dimensions keep their mesh axes; ``axis`` comes out unsharded (a
    float32 ``a`` keeps it sharded while gathering: each device takes the rows its block holds
    and an all-reduce completes them). The gradient scatter-adds the cotangent (duplicates
    add). When some index is out of range in "fill" mode, the fill is a row joined to ``a``
    along ``axis`` (``concatenate``: that dimension is gathered first).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.take(np.array([1., 2., 3.], np.float32), np.array([2, -1, 3]))).tolist()
    [3.0, 3.0, nan]
    >>> np.asarray(cnp.take(np.arange(4, dtype=np.int32), [5, -6], mode="clip")).tolist()
    [3, 0]
    """
    who = "take"
    _check_mode(mode, who, ("fill", "clip", "wrap"))
    a = _operand(a, who)
    on_devices = isinstance(a, Array) and _whole(a) and _device_index(indices, _o()._place_of(a))
    idx, ishape = (None, tuple(indices.shape)) if on_devices else _index_host(indices, who)
    if axis is None:
        a = _reshape(a, (math.prod(a.shape),))
        axis = 0
    else:
        axis = _axis(axis, len(a.shape), who, a.shape)
    out_shape = tuple(a.shape[:axis]) + tuple(ishape) + tuple(a.shape[axis + 1:])
    if a.shape[axis] == 0 and math.prod(ishape) > 0:
        raise IndexError(f"{who}: cannot take a non-empty selection (indices of shape "
                         f"{tuple(ishape)}) from the empty axis {axis} of an array of shape "
                         f"{tuple(a.shape)}")
    if _is_abstract(a) or (idx is None and not on_devices):
        return _sds()(out_shape, a.dtype)
    if (mode != "wrap" and _whole(a) and a.shape[axis] and math.prod(out_shape)
            and math.prod(a.shape) < _INT32_LIMIT):
        if not on_devices:
            indices = _placed_indices(idx, a)
        fill = None if mode == "clip" else _fill_value(a.dtype, fill_value, who)
        return _take_devices(a, indices, axis, out_shape, fill)
    if on_devices:
        idx, _ = _index_host(indices, who)
    return _read_with_mode(a, idx, axis, mode, fill_value, who, clip_wraps=False)


def take_along_axis(arr, indices, axis=-1, mode=None, fill_value=None, *,
                    wrap_negative_indices=True):
    """``jnp.take_along_axis``: ``out[..., i, ...] = arr[..., indices[..., i, ...], ...]``
    along ``axis`` (``arr`` and ``indices`` flattened when ``axis`` is None); ``indices`` has
    ``arr``'s rank and broadcasts against it in the other dimensions (either side may be 1).

    Modes as jax's: ``None`` / ``"fill"`` (default) -- negative indices in [-n, 0) count from
    the end (``wrap_negative_indices=False``: they are out of range), others out of range read
    ``fill_value`` (NaN for floats, ...: see :func:`take`) and pass no gradient; ``"clip"`` --
    negative indices wrapped, then clamped to [0, n - 1]. The gradient scatter-adds the
    cotangent (duplicates add), e.g. the label log-probabilities of a loss,
    ``take_along_axis(logp, labels[..., None], -1)``.

    Where it runs: an ``arr`` that every device holds whole (one device, or replicated) is
    read on the devices at positions computed there from the indices (an integer Array on
    the same devices, held whole there, stays there; host indices are placed there first):
    nothing is copied to the host, and the result is placed as ``arr``. A sharded ``arr`` is
    gathered from a plan made on the host (the indices read there): every dimension is
    indexed (the other dimensions pair with the indices element by element), so the result
    is unsharded; a float32 ``arr`` is not gathered (each device takes the elements its block
    holds, and an all-reduce completes the result), other dtypes gather their sharded
    dimensions first.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> x = np.array([[1., 2., 3.], [4., 5., 6.]], np.float32)
    >>> np.asarray(cnp.take_along_axis(x, np.array([[2], [0]]), axis=1)).tolist()
    [[3.0], [4.0]]
    """
    who = "take_along_axis"
    _check_mode(mode, who, ("fill", "clip"))
    arr = _operand(arr, who, "arr")
    on_devices = isinstance(arr, Array) and _whole(arr) and \
        _device_index(indices, _o()._place_of(arr))
    idx, ishape = (None, tuple(indices.shape)) if on_devices else _index_host(indices, who)
    if axis is None:
        if len(ishape) != 1:
            raise ValueError(f"{who}: indices must be 1-d when axis is None (arr is "
                             f"flattened), got shape {tuple(ishape)}")
        arr = _reshape(arr, (math.prod(arr.shape),))
        axis = 0
    nd = len(arr.shape)
    if len(ishape) != nd:
        raise ValueError(f"{who}: indices and arr must have the same number of dimensions; "
                         f"indices has shape {tuple(ishape)}, arr {tuple(arr.shape)}")
    axis = _axis(axis, nd, who, arr.shape)
    out_shape = []
    for d, (n, m) in enumerate(zip(arr.shape, ishape)):
        if d == axis:
            out_shape.append(m)
        elif n == m or n == 1 or m == 1:
            out_shape.append(max(n, m) if min(n, m) else 0)
        else:
            raise ValueError(f"{who}: indices of shape {tuple(ishape)} do not broadcast against "
                             f"arr of shape {tuple(arr.shape)} in dimension {d}")
    out_shape = tuple(out_shape)
    if _is_abstract(arr) or (idx is None and not on_devices):
        return _sds()(out_shape, arr.dtype)
    n = arr.shape[axis]
    if _whole(arr) and n and math.prod(out_shape) and math.prod(arr.shape) < _INT32_LIMIT:
        if not on_devices:
            indices = _placed_indices(idx, arr)
        fill = None if mode == "clip" else _fill_value(arr.dtype, fill_value, who)
        return _take_along_devices(arr, indices, axis, out_shape, fill, wrap_negative_indices,
                                   who)
    if on_devices:
        idx, _ = _index_host(indices, who)
    w = np.where(idx < 0, idx + n, idx) if wrap_negative_indices else idx
    # the gather runs along `axis` of an index that pairs every other dimension elementwise
    # (arange arrays): first the values of `axis` with the mode, as a take on a new axis
    shaped = []
    for d in range(nd):
        if d == axis:
            continue
        k = np.arange(arr.shape[d], dtype=np.int64)
        shaped.append((d, k.reshape((1,) * d + (-1,) + (1,) * (nd - d - 1))))
    if mode == "clip":
        if n == 0 and idx.size:
            raise ValueError(f"{who}: cannot index an empty dimension {axis} (shape "
                             f"{tuple(arr.shape)}) with mode 'clip'")
        w = np.clip(w, 0, max(n - 1, 0))
        src = arr
    else:
        ok = (w >= 0) & (w < n)
        src = arr
        if not ok.all():
            fill = _fill_value(arr.dtype, fill_value, who)
            shape = list(arr.shape)
            shape[axis] = 1
            src = concatenate([arr, np.full(shape, fill, arr.dtype)], axis)
            w = np.where(ok, w, n)
    full = [None] * nd
    for d, k in shaped:
        full[d] = np.broadcast_to(k, out_shape) if arr.shape[d] != 1 else \
            np.zeros(out_shape, np.int64)
    full[axis] = np.broadcast_to(w, out_shape)
    return getitem(src, tuple(np.ascontiguousarray(f) for f in full))


# take_along_axis on the devices (an ``arr`` each device holds whole: the slicing module's
# device gathers): the flat position of every element read, computed there from the indices.

def _flat_base(arg, place):
    """The int32 flat position in ``arr`` (shape ``ashape``, C order) of each result element
    with its ``axis`` coordinate 0 (``arg``: ashape, out_shape, axis), placed on ``place``: an
    Array of ``out_shape`` with size 1 along ``axis`` (a dimension of size 1 in ``arr``
    broadcasts: coordinate 0)."""
    ashape, out_shape, axis = arg
    nd = len(ashape)
    base = np.zeros([1 if d == axis else s for d, s in enumerate(out_shape)], np.int64)
    stride = 1
    for d in reversed(range(nd)):
        if d != axis and ashape[d] != 1:
            k = np.arange(out_shape[d], dtype=np.int64) * stride
            base = base + k.reshape((1,) * d + (-1,) + (1,) * (nd - d - 1))
        stride *= ashape[d]
    return _o()._lift_any(base.astype(np.int32), place)


def _placed_indices(idx, a):
    """Host indices (int64) as an int32 Array where ``a`` lives (an entry out of int32's
    range is out of ``a``'s too, as its int32 clip)."""
    return _o()._lift_any(np.clip(idx, -_INT32_LIMIT, _INT32_LIMIT - 1).astype(np.int32),
                          _o()._place_of(a))


def _with_fill(out, ok, fill, floats: bool, place):
    """``out`` where the bool Array ``ok`` (broadcasting) is set, else ``fill``: a select for
    floats (which drops the cotangents there); for ints, whose ``out`` holds zeros there, the
    fill added (exact: wrapping ints)."""
    o = _o()
    fill_at = _kept(fill, np.dtype(out.dtype), place)
    if floats:
        return o.where(ok, out, fill_at)
    with o._no_tape():
        return o.add(out, o.multiply(o._convert_to(~ok, np.dtype(out.dtype)), fill_at))


def _take_devices(a, ind, axis, out_shape, fill):
    """take of an ``a`` whole on each device with int Array indices on its placement, in
    mode "fill" (``fill``: the value of out-of-range entries; negative ones in range wrap) or
    "clip" (None: clamped, negative ones to 0): each device reads the rows (the dimensions
    after ``axis``) of its own copy at ``p * n + index`` for every leading position ``p``."""
    o = _o()
    dt = np.dtype(a.dtype)
    place = o._place_of(a)
    i32 = _dtypes.int32
    n, lead = a.shape[axis], math.prod(a.shape[:axis])
    ni = math.prod(ind.shape)
    floats = dt.kind == "f" or dt in o._FLOATS
    with o._no_tape():   # integer positions: nothing of them is differentiated
        w, ok = _rows_in_range(ind, n, place, fill is not None)
        rows = o.reshape(w, (1, ni))
        if lead > 1:
            rows = o.add(rows, o.kept_constant(_KEPT, _KEPT_MAX, (id(place), "take", lead, n),
                                               place, _lead_rows, (lead, n)))
        if fill is not None and not floats:   # (a zero read where out of range)
            one = _kept(1, i32, place)
            rows = o.subtract(o.multiply(o.add(rows, one),
                                         o._convert_to(o.reshape(ok, (1, ni)), i32)), one)
    out = _gather_rows_at(a, rows, math.prod(a.shape[axis + 1:]), out_shape)
    if fill is None:
        return out
    at = (1,) * axis + tuple(ind.shape) + (1,) * (len(a.shape) - axis - 1)
    return _with_fill(out, o.reshape(ok, at), fill, floats, place)


def _lead_rows(lead_n, place):
    """The first row of every leading position in the (lead * n, q) view: (lead, 1)."""
    lead, n = lead_n
    return _o()._lift_any((np.arange(lead, dtype=np.int64) * n).astype(np.int32)
                          .reshape(lead, 1), place)


def _take_along_devices(arr, ind, axis, out_shape, fill, wrap, who):
    """take_along_axis of an ``arr`` whole on each device with int Array indices on its
    placement; ``fill``: the value of out-of-range entries (mode "fill"; None: "clip")."""
    o = _o()
    dt = np.dtype(arr.dtype)
    place = o._place_of(arr)
    with o._no_tape():   # integer positions: nothing of them is differentiated
        w, ok = _rows_in_range(ind, arr.shape[axis], place, wrap)
    floats = dt.kind == "f" or dt in o._FLOATS
    # (floats: the select below replaces an out-of-range entry's value and drops its
    # cotangent; ints: it reads a zero, to which the fill is added)
    out = _gather_along(arr, w, axis, out_shape, None if fill is None or floats else ok)
    return out if fill is None else _with_fill(out, ok, fill, floats, place)


def _gather_along(arr, w, axis: int, out_shape, ok=None):
    """``arr``'s elements (``arr`` whole on each device) at the int32 positions ``w`` along
    ``axis``, each in range (``w`` has ``arr``'s rank and broadcasts against it in the other
    dimensions, to ``out_shape``); where the bool Array ``ok`` is unset, zeros and no
    cotangent."""
    o = _o()
    place = o._place_of(arr)
    i32 = _dtypes.int32
    with o._no_tape():
        shapes = (tuple(arr.shape), tuple(out_shape), axis)
        base = o.kept_constant(_KEPT, _KEPT_MAX, (id(place),) + shapes, place, _flat_base,
                               shapes)
        stride = math.prod(arr.shape[axis + 1:])
        flat = o.add(o.multiply(w, _kept(stride, i32, place)) if stride != 1 else w, base)
        if ok is not None:   # an entry not ok reads position -1: zeros, no cotangent
            one = _kept(1, i32, place)
            flat = o.subtract(o.multiply(o.add(flat, one), o._convert_to(ok, i32)), one)
    if tuple(flat.shape) != tuple(out_shape):
        raise RuntimeError(f"internal error: take_along_axis's positions have shape "
                           f"{flat.shape}, not {tuple(out_shape)}")
    return _gather_rows_at(arr, flat, 1, tuple(out_shape))


# --- repeat, tile -----------------------------------------------------------------------------

def repeat(a, repeats, axis=None, *, total_repeat_length=None):
    """``jnp.repeat``: every element of ``a`` along ``axis`` (``a`` flattened when None)
    repeated ``repeats`` times: an int, or a host array with one count per element (read to
    the host; a one-element array counts as an int). ``total_repeat_length``, as jax: the
    result is cut to that length, or extended by repeating the last element.

    Sharding: with an int count the repeated dimension keeps its mesh axes (a gather on a new
    unit axis, then a reshape merging it: GQA's ``repeat(k, n_rep, axis=2)`` stays sharded
    over heads); with per-element counts it comes out unsharded. The gradient sums the
    cotangent over the copies.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.repeat(np.array([[1, 2], [3, 4]], np.int32), 2, axis=1)).tolist()
    [[1, 1, 2, 2], [3, 3, 4, 4]]
    >>> np.asarray(cnp.repeat(np.array([1., 2., 3.], np.float32), np.array([0, 2, 1]))).tolist()
    [2.0, 2.0, 3.0]
    """
    who = "repeat"
    a = _operand(a, who)
    if _is_abstract(repeats) or isinstance(repeats, Array):
        if isinstance(repeats, Array):
            repeats._check_alive()
            repeats = np.asarray(repeats)
        elif total_repeat_length is None:
            raise ValueError(f"{who}: the repeats (shape {repeats.shape}) are abstract; pass "
                             f"total_repeat_length to fix the result's shape, as in jax")
    if axis is None or len(a.shape) == 0:   # (a 0-d a repeats as a 1-d one, any axis: jax)
        a = _reshape(a, (math.prod(a.shape),))
        axis = 0
    else:
        axis = _axis(axis, len(a.shape), who, a.shape)
    n = a.shape[axis]
    counts = None
    if not _is_abstract(repeats):
        r = np.asarray(repeats)
        if r.dtype.kind not in "iu":
            raise TypeError(f"{who}: repeats must be an int or an integer array, got "
                            f"{type(repeats).__name__} {repeats!r} (dtype {r.dtype})")
        if r.ndim > 1:
            raise ValueError(f"{who}: repeats must be an int or a 1-d array, got shape {r.shape}")
        if r.size and int(r.min()) < 0:
            raise ValueError(f"{who}: repeats must be non-negative, got {repeats!r}")
        if r.ndim == 0 or r.size == 1:
            counts = int(r.reshape(-1)[0])
        elif r.size != n:
            raise ValueError(f"{who}: {r.size} repeats for dimension {axis} of size {n} "
                             f"(shape {tuple(a.shape)})")
        else:
            counts = r.astype(np.int64)
    if total_repeat_length is not None:
        total = _int(total_repeat_length, who, "total_repeat_length")
        if total < 0:
            raise ValueError(f"{who}: total_repeat_length must be non-negative, got {total}")
    elif isinstance(counts, int):
        total = n * counts
    else:
        total = int(counts.sum())
    out_shape = tuple(a.shape[:axis]) + (total,) + tuple(a.shape[axis + 1:])
    if _is_abstract(a) or counts is None:
        return _sds()(out_shape, a.dtype)
    if isinstance(counts, int) and total == n * counts:
        if counts == 1:
            return getitem(a, (slice(None),) * len(a.shape))
        # a new unit axis after `axis`, gathered `counts` times (a dimension of size 1 is never
        # sharded, so every other dimension keeps its axes), merged back by a reshape
        y = getitem(a, (slice(None),) * (axis + 1) + (None,))
        y = _gather(y, np.zeros(counts, np.int64), axis + 1)
        return _reshape(y, out_shape)
    src = np.repeat(np.arange(n, dtype=np.int64), counts)
    if total <= src.size:
        src = src[:total]
    else:
        if not src.size:
            raise ValueError(f"{who}: total_repeat_length {total} with no element repeated")
        src = np.concatenate([src, np.full(total - src.size, src[-1], np.int64)])
    return _gather(a, src, axis)


def tile(A, reps):
    """``jnp.tile``: ``A`` repeated ``reps`` times along each dimension (``reps`` an int or a
    tuple; the shorter of ``A.shape`` and ``reps`` is padded with leading 1s). Sharding:
    dimensions tiled once keep their mesh axes; tiled ones come out unsharded. The gradient
    sums the cotangent over the tiles.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.tile(np.array([1, 2], np.int32), (2, 2))).tolist()
    [[1, 2, 1, 2], [1, 2, 1, 2]]
    """
    who = "tile"
    a = _operand(A, who, "A")
    reps = tuple(_int(r, who, "reps") for r in (reps if isinstance(reps, (tuple, list)) else
                                                (reps,)))
    if any(r < 0 for r in reps):
        raise ValueError(f"{who}: reps must be non-negative, got {reps}")
    nd = max(len(a.shape), len(reps))
    reps = (1,) * (nd - len(reps)) + reps
    shape = (1,) * (nd - len(a.shape)) + tuple(a.shape)
    out_shape = tuple(n * r for n, r in zip(shape, reps))
    if _is_abstract(a):
        return _sds()(out_shape, a.dtype)
    y = _reshape(a, shape) if shape != tuple(a.shape) else getitem(a, (slice(None),) * nd)
    for d, (n, r) in enumerate(zip(shape, reps)):
        if r != 1:
            y = _gather(y, np.tile(np.arange(n, dtype=np.int64), r), d)
    return y


# --- flip, roll ------------------------------------------------------------------------------

def flip(m, axis=None):
    """``jnp.flip``: ``m`` with the order of its elements reversed along ``axis`` (an int, a
    tuple, or None: every dimension). Flipped dimensions come out unsharded (a stepped
    slice ``m[::-1]``); the gradient is the cotangent flipped back.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.flip(np.arange(6, dtype=np.int32).reshape(2, 3), -1)).tolist()
    [[2, 1, 0], [5, 4, 3]]
    """
    who = "flip"
    m = _operand(m, who, "m")
    nd = len(m.shape)
    axes = tuple(range(nd)) if axis is None else _axes(axis, nd, who, m.shape)
    if _is_abstract(m):
        return _sds()(m.shape, m.dtype)
    return getitem(m, tuple(slice(None, None, -1) if d in axes else slice(None)
                            for d in range(nd)))


def fliplr(m):
    """``jnp.fliplr``: ``flip(m, 1)`` (``m`` at least 2-d).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.fliplr(np.array([[1., 2.]], np.float32))).tolist()
    [[2.0, 1.0]]
    """
    m = _operand(m, "fliplr", "m")
    if len(m.shape) < 2:
        raise ValueError(f"fliplr: m must be at least 2-d, got shape {tuple(m.shape)}")
    return flip(m, 1)


def flipud(m):
    """``jnp.flipud``: ``flip(m, 0)`` (``m`` at least 1-d).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.flipud(np.array([1., 2.], np.float32))).tolist()
    [2.0, 1.0]
    """
    m = _operand(m, "flipud", "m")
    if len(m.shape) < 1:
        raise ValueError("flipud: m must be at least 1-d, got a 0-d array")
    return flip(m, 0)


def roll(a, shift, axis=None):
    """``jnp.roll``: elements shifted by ``shift`` along ``axis`` (ints or equal-length
    sequences; shifts on one axis add up), wrapping around; with ``axis`` None ``a`` is
    rolled flattened. Each rolled dimension is two slices joined (``concatenate``): it comes
    out unsharded, the others keep their mesh axes; the gradient is the cotangent rolled back.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.roll(np.arange(5, dtype=np.float32), 2)).tolist()
    [3.0, 4.0, 0.0, 1.0, 2.0]
    """
    who = "roll"
    a = _operand(a, who)
    if isinstance(shift, Array):
        shift = np.asarray(shift)
    sh = np.asarray(shift)
    if sh.dtype.kind not in "iu" or sh.ndim > 1:
        raise TypeError(f"{who}: shift must be an int or a sequence of ints, got {shift!r}")
    if axis is None:
        if sh.ndim:
            raise ValueError(f"{who}: with axis=None shift must be an int, got {shift!r}")
        flat = _reshape(a, (math.prod(a.shape),))
        return _reshape(roll(flat, int(sh), 0), a.shape)
    ax = np.asarray(axis)
    if ax.dtype.kind not in "iu" or ax.ndim > 1:
        raise TypeError(f"{who}: axis must be an int or a sequence of ints, got {axis!r}")
    try:
        sh, ax = np.broadcast_arrays(sh, ax)
    except ValueError:
        raise ValueError(f"{who}: shift {shift!r} and axis {axis!r} do not broadcast "
                         f"together") from None
    nd = len(a.shape)
    total = {}
    for s, d in zip(sh.reshape(-1).tolist(), ax.reshape(-1).tolist()):
        d = _axis(d, nd, who, a.shape)
        total[d] = total.get(d, 0) + int(s)
    if _is_abstract(a):
        return _sds()(a.shape, a.dtype)
    y = a
    for d, s in sorted(total.items()):
        n = a.shape[d]
        s = s % n if n else 0
        if s:
            pre = (slice(None),) * d
            y = concatenate([getitem(y, pre + (slice(n - s, n),)),
                             getitem(y, pre + (slice(0, n - s),))], d)
    return y if y is not a else getitem(a, (slice(None),) * nd)


# --- pad -------------------------------------------------------------------------------------

_PAD_MODES = ("constant", "edge", "reflect", "symmetric", "wrap")


def _pad_pairs(pad_width, nd, who, shape):
    if isinstance(pad_width, Array):
        pad_width = np.asarray(pad_width)
    try:
        pw = np.asarray(pad_width)
    except ValueError:
        raise ValueError(f"{who}: pad_width {pad_width!r} is ragged") from None
    if pw.dtype.kind not in "iu" and (pw.size or pw.dtype.kind != "f"):
        # (jax refuses float widths, even integral ones; an empty list is float64 in numpy)
        raise TypeError(f"{who}: pad_width must hold ints, got {pad_width!r}")
    pw = pw.astype(np.int64)
    if pw.shape not in ((nd, 2), (1, 2), (2,), (1,), ()):
        raise ValueError(f"{who}: pad_width of shape {pw.shape} for an array of dimension {nd} "
                         f"(shape {tuple(shape)}); valid shapes are ({nd}, 2), (1, 2), (2,), "
                         f"(1,) or ()")
    if pw.size and int(pw.min()) < 0:
        raise ValueError(f"{who}: pad widths must be non-negative, got {pad_width!r}")
    return [tuple(int(v) for v in p) for p in np.broadcast_to(pw, (nd, 2))]


def pad(array, pad_width, mode="constant", **kwargs):
    """``jnp.pad`` for the modes ``"constant"`` (``constant_values``: a scalar, a
    (before, after) pair or one pair per dimension, cast to the array's dtype), ``"edge"``,
    ``"reflect"``, ``"symmetric"`` and ``"wrap"`` (numpy's and jax's semantics; reflect and
    symmetric with the default ``reflect_type="even"``, padding wider than the array
    repeating the reflection as numpy does). ``pad_width``: an int, a (before, after) pair,
    or one pair per dimension, non-negative. Other modes (``linear_ramp``, ``maximum``,
    ``mean``, ``median``, ``minimum``, ``empty``, callables) and ``reflect_type="odd"``
    raise ``ValueError``.

    Each padded dimension is the array joined with its pads (``concatenate``; an edge,
    reflect, symmetric or wrap pad is a gather of rows of the array): it comes out
    unsharded, the others keep their mesh axes. The gradient of a constant pad is the
    cotangent's slice; the other modes add the pads' cotangents into the rows they copy.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.pad(np.array([1., 2., 3.], np.float32), (2, 1), mode="reflect")).tolist()
    [3.0, 2.0, 1.0, 2.0, 3.0, 2.0]
    >>> np.asarray(cnp.pad(np.array([1, 2], np.int32), 1, constant_values=9)).tolist()
    [9, 1, 2, 9]
    """
    who = "pad"
    if callable(mode) or mode not in _PAD_MODES:
        raise ValueError(f"{who}: mode {mode!r} is not supported; use one of "
                         f"{', '.join(repr(m) for m in _PAD_MODES)}")
    allowed = {"constant": ("constant_values",), "reflect": ("reflect_type",),
               "symmetric": ("reflect_type",)}.get(mode, ())
    for k in kwargs:
        if k not in allowed:
            raise ValueError(f"{who}: unsupported keyword argument {k!r} for mode {mode!r}")
    if kwargs.get("reflect_type", "even") != "even":
        raise ValueError(f"{who}: reflect_type {kwargs['reflect_type']!r} is not supported "
                         f"(only 'even', the default)")
    a = _operand(array, who, "array")
    nd = len(a.shape)
    pairs = _pad_pairs(pad_width, nd, who, a.shape)
    cv = None
    if mode == "constant":
        cv = kwargs.get("constant_values", 0)
        if isinstance(cv, Array):
            cv = np.asarray(cv)
        try:
            cvh = np.asarray(cv)
        except ValueError:
            raise ValueError(f"{who}: constant_values {cv!r} is ragged") from None
        if cvh.shape not in ((nd, 2), (1, 2), (2,), (1,), ()):
            raise ValueError(f"{who}: constant_values of shape {cvh.shape} for an array of "
                             f"dimension {nd} (shape {tuple(a.shape)}); valid shapes are "
                             f"({nd}, 2), (1, 2), (2,), (1,) or ()")
        if cvh.dtype == object:
            raise TypeError(f"{who}: constant_values must be numbers, got {cv!r}")
        cv = np.broadcast_to(cvh, (nd, 2))
    else:
        for d, (b, e) in enumerate(pairs):
            if (b or e) and a.shape[d] == 0:
                raise ValueError(f"{who}: cannot apply {mode!r} padding to the empty "
                                 f"dimension {d} (shape {tuple(a.shape)})")
    out_shape = tuple(n + b + e for n, (b, e) in zip(a.shape, pairs))
    if _is_abstract(a):
        return _sds()(out_shape, a.dtype)
    y = a
    for d, (b, e) in enumerate(pairs):
        if not (b or e):
            continue
        n = a.shape[d]
        parts = []
        if mode == "constant":
            for width, value in ((b, cv[d][0]), (e, cv[d][1])):
                shape = list(y.shape)
                shape[d] = width
                parts.append(_placed_like(y, np.full(shape, np.asarray(value).astype(a.dtype),
                                                     a.dtype), d) if width else None)
        else:
            src = _pad_source(n, b, e, mode)
            parts = [_gather(y, src[:b], d) if b else None,
                     _gather(y, src[b + n:], d) if e else None]
        y = concatenate([p for p in (parts[0], y, parts[1]) if p is not None], d)
    return y if y is not a else getitem(a, (slice(None),) * nd)


def _pad_source(n, before, after, mode):
    """For each position of a dimension of length ``n`` padded by (before, after): the index
    of the row it copies. Periodic for pads wider than the array, as jax and numpy >= 2 pad
    (numpy 1.x's ``wrap`` repeated only part of the array there, so numpy is not asked)."""
    p = np.arange(-before, n + after, dtype=np.int64)
    if mode == "edge":
        return np.clip(p, 0, n - 1)
    if mode == "wrap":
        return p % n
    if mode == "symmetric":   # period 2n: 0 .. n-1, n-1 .. 0
        q = p % (2 * n)
        return np.where(q < n, q, 2 * n - 1 - q)
    if n == 1:                # reflect: period 2n - 2: 0 .. n-1 .. 1
        return np.zeros_like(p)
    q = p % (2 * n - 2)
    return np.where(q < n, q, 2 * n - 2 - q)


def _placed_like(y, host, d):
    """The host block ``host`` (``y``'s shape but in dimension ``d``) laid out as ``y`` with
    ``d`` unsharded: each device receives only its block, and ``concatenate`` keeps ``y``'s
    other mesh axes."""
    place, norm = _layout_of(y)
    norm[d] = ()
    return device_put(host, _o()._sharding_for(place, norm))


# --- triangles, eye, diagonals ----------------------------------------------------------------

def _tri(m, k, who, lower: bool):
    m = _operand(m, who, "m")
    if len(m.shape) < 2:
        raise ValueError(f"{who}: m must be at least 2-d, got shape {tuple(m.shape)}")
    k = _int(k, who, "k")
    if _is_abstract(m):
        return _sds()(m.shape, m.dtype)
    o = _o()
    nd = len(m.shape)
    N, M = m.shape[-2:]
    keep = np.tri(N, M, k, dtype=bool) if lower else ~np.tri(N, M, k - 1, dtype=bool)
    if m.dtype in o._FLOATS:
        # a select against the mask (exact: kept elements keep their bits), the mask placed
        # with m's layout of its last two dimensions (each device receives only its block)
        place, norm = _layout_of(m)
        mask = device_put(keep.astype(np.float32), o._sharding_for(place, norm[-2:]))
        return o._keep(m, mask)
    # other dtypes: a gather from m joined with a zero column (column M): exact bits
    shape = list(m.shape)
    shape[-1] = 1
    ext = concatenate([m, np.zeros(shape, m.dtype)], nd - 1)
    cols = np.where(keep, np.arange(M, dtype=np.int64)[None, :], M)
    rows = np.broadcast_to(np.arange(N, dtype=np.int64)[:, None], (N, M))
    return getitem(ext, (Ellipsis, np.ascontiguousarray(rows), cols))


def _layout_of(x):
    return lo(x)


def tril(m, k=0):
    """``jnp.tril``: ``m`` with the elements above the ``k``-th diagonal of its last two
    dimensions zeroed (``m`` at least 2-d). Float Arrays: a select against a 0/1 mask placed
    with ``m``'s sharding of those dimensions (nothing is gathered; every dimension keeps its
    mesh axes; the gradient is the cotangent masked the same way). Integer and bool Arrays:
    a gather from ``m`` joined with a zero column (the last two dimensions come out
    unsharded).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.tril(np.ones((2, 3), np.float32), k=1)).tolist()
    [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    """
    return _tri(m, k, "tril", lower=True)


def triu(m, k=0):
    """``jnp.triu``: ``m`` with the elements below the ``k``-th diagonal of its last two
    dimensions zeroed; sharding and gradient as :func:`tril`.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.triu(np.ones((3, 2), np.int32))).tolist()
    [[1, 1], [0, 1], [0, 0]]
    """
    return _tri(m, k, "triu", lower=False)


def eye(N, M=None, k=0, dtype=None, *, device=None):
    """``jnp.eye``: an ``N`` x ``M`` Array (``M`` defaults to ``N``) with ones on the
    ``k``-th diagonal, float32 unless ``dtype`` is given; placed as ``device_put`` places a
    host array (on ``device``, else replicated over the active mesh, else on the first
    device).

    >>> import ctrainstate.numpy as cnp, numpy as np
    >>> np.asarray(cnp.eye(2, 3, k=1, dtype=cnp.int32)).tolist()
    [[0, 1, 0], [0, 0, 1]]
    """
    who = "eye"
    N = _int(N, who, "N")
    M = N if M is None else _int(M, who, "M")
    k = _int(k, who, "k")
    if N < 0 or M < 0:
        raise ValueError(f"{who}: negative dimensions are not allowed, got N={N}, M={M}")
    dt = _dtypes.canonicalize(dtype) if dtype is not None else _dtypes.float32
    return device_put(np.eye(N, M, k, dtype=dt), device)


def diagonal(a, offset=0, axis1=0, axis2=1):
    """``jnp.diagonal``: the ``offset``-th diagonal of the 2-d planes of ``a`` spanned by
    ``axis1`` and ``axis2``, as the result's last dimension (the other dimensions first, in
    order, keeping their mesh axes). A gather: the gradient puts the cotangent back on the
    diagonal.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.diagonal(np.arange(6, dtype=np.float32).reshape(2, 3), 1)).tolist()
    [1.0, 5.0]
    """
    who = "diagonal"
    a = _operand(a, who)
    nd = len(a.shape)
    if nd < 2:
        raise ValueError(f"{who}: a must be at least 2-d, got shape {tuple(a.shape)}")
    d1 = _axis(axis1, nd, who, a.shape, "axis1")
    d2 = _axis(axis2, nd, who, a.shape, "axis2")
    if d1 == d2:
        raise ValueError(f"{who}: axis1 and axis2 must differ, both are dimension {d1} "
                         f"(shape {tuple(a.shape)})")
    off = _int(offset, who, "offset")
    N, M = a.shape[d1], a.shape[d2]
    r0, c0 = max(-off, 0), max(off, 0)
    L = max(0, min(N - r0, M - c0))
    rest = [d for d in range(nd) if d not in (d1, d2)]
    out_shape = tuple(a.shape[d] for d in rest) + (L,)
    if _is_abstract(a):
        return _sds()(out_shape, a.dtype)
    y = _o().transpose(a, rest + [d1, d2])
    i = np.arange(L, dtype=np.int64)
    return getitem(y, (Ellipsis, i + r0, i + c0))


def diag(v, k=0):
    """``jnp.diag``: for a 1-d ``v``, the square matrix with ``v`` on its ``k``-th diagonal
    and zeros elsewhere (a gather from ``v`` joined with a zero: unsharded; the gradient is
    the cotangent's diagonal); for a 2-d ``v``, its ``k``-th diagonal (:func:`diagonal`).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.diag(np.array([1, 2], np.int32), k=-1)).tolist()
    [[0, 0, 0], [1, 0, 0], [0, 2, 0]]
    """
    who = "diag"
    v = _operand(v, who, "v")
    k = _int(k, who, "k")
    if len(v.shape) == 2:
        return diagonal(v, k)
    if len(v.shape) != 1:
        raise ValueError(f"{who}: v must be 1-d or 2-d, got shape {tuple(v.shape)}")
    n = v.shape[0]
    s = n + abs(k)
    if _is_abstract(v):
        return _sds()((s, s), v.dtype)
    idx = np.full((s, s), n, np.int64)
    i = np.arange(n)
    idx[i + max(-k, 0), i + max(k, 0)] = i
    ext = concatenate([v, np.zeros(1, v.dtype)], 0)
    return getitem(ext, idx)


# --- axes and ranks --------------------------------------------------------------------------

def moveaxis(a, source, destination):
    """``jnp.moveaxis``: the dimensions ``source`` (an int or a sequence) moved to
    ``destination``, the others keeping their order (a transpose: mesh axes move with
    their dimensions; any dtype).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> cnp.moveaxis(np.zeros((2, 3, 4), np.float32), 0, -1).shape
    (3, 4, 2)
    """
    who = "moveaxis"
    a = _operand(a, who)
    nd = len(a.shape)
    src = _axes(source, nd, who, a.shape, "source")
    dst = _axes(destination, nd, who, a.shape, "destination")
    if len(src) != len(dst):
        raise ValueError(f"{who}: source {source!r} and destination {destination!r} must have "
                         f"the same number of elements")
    perm = [d for d in range(nd) if d not in src]
    for d, s in sorted(zip(dst, src)):
        perm.insert(d, s)
    return _transpose(a, perm)


def swapaxes(a, axis1, axis2):
    """``jnp.swapaxes``: dimensions ``axis1`` and ``axis2`` exchanged (a transpose).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> cnp.swapaxes(np.zeros((2, 3, 4), np.float32), 0, 2).shape
    (4, 3, 2)
    """
    who = "swapaxes"
    a = _operand(a, who)
    nd = len(a.shape)
    d1 = _axis(axis1, nd, who, a.shape, "axis1")
    d2 = _axis(axis2, nd, who, a.shape, "axis2")
    perm = list(range(nd))
    perm[d1], perm[d2] = d2, d1
    return _transpose(a, perm)


def _transpose(a, perm):
    if _is_abstract(a):
        return _sds()(tuple(a.shape[p] for p in perm), a.dtype)
    if list(perm) == list(range(len(perm))):
        return getitem(a, (slice(None),) * len(perm))
    return _o().transpose(a, perm)


def _atleast(arys, who, shape_of):
    outs = []
    for x in arys:
        x = _operand(x, who, "arys")
        shape = shape_of(tuple(x.shape))
        outs.append(x if shape == tuple(x.shape) else _reshape(x, shape))
    return outs[0] if len(outs) == 1 else outs


def atleast_1d(*arys):
    """``jnp.atleast_1d``: each argument with at least one dimension (a 0-d one as (1,));
    a list for several arguments. Arrays of that rank are returned as they are.

    >>> import ctrainstate.numpy as cnp
    >>> cnp.atleast_1d(1.0).shape
    (1,)
    """
    return _atleast(arys, "atleast_1d", lambda s: s if len(s) >= 1 else (1,))


def atleast_2d(*arys):
    """``jnp.atleast_2d``: 0-d as (1, 1), 1-d (n,) as (1, n).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> cnp.atleast_2d(np.zeros(3, np.float32)).shape
    (1, 3)
    """
    return _atleast(arys, "atleast_2d", lambda s: s if len(s) >= 2 else (1,) * (2 - len(s)) + s)


def atleast_3d(*arys):
    """``jnp.atleast_3d``: 0-d as (1, 1, 1), 1-d (n,) as (1, n, 1), 2-d (m, n) as (m, n, 1).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> cnp.atleast_3d(np.zeros((2, 3), np.float32)).shape
    (2, 3, 1)
    """
    def shape_of(s):
        return {0: (1, 1, 1), 1: (1,) + s + (1,), 2: s + (1,)}.get(len(s), s)
    return _atleast(arys, "atleast_3d", shape_of)


# --- prod ------------------------------------------------------------------------------------

def _prod_f32(a, axis=None, keepdims=False):
    who = "prod"
    a = _operand(a, who)
    nd = len(a.shape)
    axes = tuple(range(nd)) if axis is None else _axes(axis, nd, who, a.shape)
    out_shape = tuple(1 if d in axes else n for d, n in enumerate(a.shape)) if keepdims else \
        tuple(n for d, n in enumerate(a.shape) if d not in axes)
    if _is_abstract(a):
        return _sds()(out_shape, a.dtype)
    o = _o()
    y = a
    for d in axes:
        n = y.shape[d]
        pre = (slice(None),) * d
        if n == 0:
            shape = list(y.shape)
            shape[d] = 1
            y = o._lift_any(np.ones(shape, y.dtype), o._place_of(y))   # (the identity)
            continue
        while n > 1:  # pairwise: the first half times the second (an odd last row kept)
            h = n // 2
            prod_ = o.multiply(getitem(y, pre + (slice(0, h),)), getitem(y, pre + (slice(h, 2 * h),)))
            y = prod_ if n == 2 * h else concatenate([prod_, getitem(y, pre + (slice(2 * h, n),))], d)
            n = y.shape[d]
    return _reshape(y, out_shape) if tuple(y.shape) != out_shape else y


def prod(a, axis=None, keepdims=False):
    """``jnp.prod``: the product of the elements over ``axis`` (None: all). 16-bit floats are
    computed in float32 and rounded once, as jnp upcasts them; integers and bools multiply as
    jnp.sum adds them (bools, int8 and int16 in int32, uint8 and uint16 in uint32: a
    conversion kernel first), wrapping. A pairwise product tree of
    slices (log2(n) multiplies): an exact derivative, zeros included (the gradient of each
    factor is the product of the others, through ``multiply``'s rule), and rounding that
    may differ from XLA's reduction order in the last bits. A reduced dimension that was
    sharded is gathered by the slicing (the others keep their mesh axes).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.prod(np.array([[1., 2., 3.], [4., 0., 6.]], np.float32), axis=1)).tolist()
    [6.0, 0.0]
    """
    a = _operand(a, "prod")
    o = _o()
    if a.dtype not in o._FLOATS:    # the typed multiply kernel: wrapping, exact in any order
        wide = sum_dtype(a.dtype)
        return _prod_f32(a if a.dtype == wide else o.astype(a, wide), axis, keepdims)
    if _is_abstract(a) or a.dtype == np.float32:
        return _prod_f32(a, axis, keepdims)
    return o.astype(_prod_f32(o.astype(a, np.float32), axis, keepdims), a.dtype)


# --- sort / argsort -------------------------------------------------------------------------

def _sort_keys(h: np.ndarray) -> np.ndarray:
    """Integer keys whose order is jax's sort order for these values (measured against
    jax.numpy.sort): floats by value with every NaN made the positive quiet NaN and -0.0
    made 0.0 first (so NaNs sort last and the two zeros are ties, each group in index
    order), ints and bools as themselves."""
    if h.dtype == np.bool_:
        return h.astype(np.int8)
    if h.dtype.kind in "iu":
        return h
    bits = {2: np.int16, 4: np.int32, 8: np.int64}[h.dtype.itemsize]
    nan = np.array(np.nan, h.dtype)
    v = np.where(np.isnan(h.astype(np.float32)) if h.dtype.itemsize == 2 else np.isnan(h), nan, h)
    v = np.where(v == 0, np.zeros((), h.dtype), v)
    b = np.ascontiguousarray(v).view(bits).astype(np.int64)
    top = np.int64(np.iinfo(bits).max)
    return np.where(b < 0, b ^ top, b)       # negative floats: reversed magnitude order


def _sort_args(a, axis, kind, order, who):
    if kind is not None:
        raise TypeError(f"{who}: 'kind' is not supported (as in jax); use stable=True or "
                        f"stable=False")
    if order is not None:
        raise TypeError(f"{who}: 'order' is not supported (as in jax)")
    a = _operand(a, who, "a")
    if axis is None:
        if _is_abstract(a):
            a = _sds()((math.prod(a.shape),), a.dtype)
        else:
            a = _reshape(a, (math.prod(a.shape),))
        axis = 0
    nd = len(a.shape)
    if nd == 0:
        raise ValueError(f"{who}: a 0-d array has no axis to sort along (pass axis=None)")
    return a, _axis(axis, nd, who, a.shape)


def _argsort_host(a, axis: int, descending: bool) -> np.ndarray:
    """jax's argsort (stable): ascending by :func:`_sort_keys`, ties in index order;
    descending reverses the array and its positions, sorts, and reverses the result (so ties
    also keep index order). Computed on the host from the gathered values."""
    keys = _sort_keys(_o()._host_value(a))
    n = keys.shape[axis]
    if descending:
        keys = np.flip(keys, axis)
    idx = np.argsort(keys, axis=axis, kind="stable")
    if descending:
        idx = np.flip(n - 1 - idx, axis)
    return idx.astype(np.int32)


def argsort(a, axis=-1, *, kind=None, order=None, stable=True, descending=False):
    """``jnp.argsort``: int32 positions that sort ``a`` along ``axis`` (None: the flattened
    array), ascending, or descending with ``descending=True``; ties keep their order in both
    (jax's stable sort; with ``stable=False`` jax may order ties differently, here they stay
    stable). Floats sort in jax's order: NaNs last, ``-0.0`` and ``0.0`` equal (ties).

    Computed on the host: the array is gathered there once (a sort compares every element
    of the axis with the others; an Array sharded over processes is gathered to every
    process). The result is replicated over ``a``'s mesh when ``a`` has one (else placed as
    ``device_put`` places it). No gradient (integer output).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.argsort(np.array([3.0, np.nan, -1.0, 3.0], np.float32))).tolist()
    [2, 0, 3, 1]
    """
    del stable   # ties always keep their order here
    a, ax = _sort_args(a, axis, kind, order, "argsort")
    if _is_abstract(a):
        return _sds()(a.shape, np.dtype(np.int32))
    # on a's mesh (replicated) when a has one, so that it is placed alike in every process
    place = _o()._place_of(a) if isinstance(a.sharding, NamedSharding) else None
    return _o()._lift_any(_argsort_host(a, ax, bool(descending)), place)


def sort(a, axis=-1, *, kind=None, order=None, stable=True, descending=False):
    """``jnp.sort``: ``a`` sorted along ``axis`` (None: the flattened array), ascending or
    with ``descending=True`` the ascending result reversed (jax's rule), in jax's order for
    floats (NaNs last, ``-0.0`` and ``0.0`` ties; bits kept, NaN payloads included).

    The positions come from :func:`argsort` (on the host); the values are a
    :func:`take_along_axis` of ``a`` on its devices, so the result is differentiable: the
    gradient returns each cotangent to the element it came from.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.sort(np.array([[3, 1, 2], [0, 5, -4]], np.int32), descending=True)).tolist()
    [[3, 2, 1], [5, 0, -4]]
    """
    del stable
    a, ax = _sort_args(a, axis, kind, order, "sort")
    if _is_abstract(a):
        return _sds()(a.shape, a.dtype)
    idx = _argsort_host(a, ax, False)
    if descending:
        idx = np.flip(idx, ax)
    return take_along_axis(a, np.ascontiguousarray(idx), axis=ax)


# ops that read host values: under jit, single nodes of the program (node.py)
from .node import op_node as _op_node  # noqa: E402

take = _op_node("take")(take)
take_along_axis = _op_node("take_along_axis")(take_along_axis)
