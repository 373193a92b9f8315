"""The implementation of :mod:`ctrainstate.lax` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations
from ..base.hooks import provide as _provide
_provide('lax', __name__)   # lower layers call into this module through _hooks.upper

import builtins

import numpy as np

from ..base import tree_util
from ..array.abstract import ShapeDtypeStruct
from ..base.devices import Device
from ..array.array import Array, device_put
from ..array.sharding import NamedSharding, PartitionSpec, Sharding, _replicate_uneven, get_mesh

from ..ops.ops import stop_gradient  # noqa: E402,F401
# jax.lax's elementwise functions that ctrainstate.numpy also has (the same kernels; lax.round,
# whose default rounds halves away from zero unlike jnp.round, is not among them)
from ..ops.ops import ceil, erf, erfc, expm1, floor, log1p, sign  # noqa: E402,F401
from ..base import dtypes as _dtypes
from ..ops import ops as _ops, slicing as _slicing
from ..array.abstract import is_abstract
from ..ops.move import _axis as one_axis
from ..ops.ops import with_sharding


def _abstract_dtype(operand):
    """The dtype an operand has once placed (host values narrowed as device_put does)."""
    if isinstance(operand, (Array, ShapeDtypeStruct)):
        return operand.dtype
    return _dtypes.canonicalize(np.asarray(operand).dtype)
from ..base.precision import Precision  # noqa: E402,F401
from .lax_more import (RoundingMethod, acos, acosh, asin, asinh, atan, atan2, atanh, batch_matmul,
                       bitwise_and, bitwise_not, bitwise_or, bitwise_xor, cbrt, clz, cosh, dot, eq,
                       exp2, ge, gt, is_finite, le, lt, ne, nextafter, population_count,
                       reciprocal, reduce_and, reduce_or, reduce_xor, round, shift_left,
                       shift_right_arithmetic, shift_right_logical, sinh, split, tan)

# control flow, run eagerly (see ctrainstate._src.numpy_lax.lax_control), and the strict primitives
# (no implicit promotion or rank broadcasting; see ctrainstate._src.numpy_lax.lax_ops)
from .lax_control import associative_scan, cond, fori_loop, map, scan, switch, while_loop
from .lax_ops import (abs, add, argmax, argmin, broadcast, broadcast_in_dim, broadcasted_iota,
                      clamp, concatenate, convert_element_type, cos, cummax, cummin, cumprod,
                      cumsum, div, dot_general, exp, expand_dims, full, full_like, index_in_dim,
                      integer_pow, iota, log, logistic, max, min, mul, neg, pad, pow, reduce_max,
                      reduce_min, reduce_prod, reduce_sum, rem, reshape, rev, rsqrt, select,
                      select_n, sin, slice, slice_in_dim, sort, sort_key_val, sqrt, square,
                      squeeze, sub, tanh, top_k, transpose)

__all__ = ["with_sharding_constraint", "stop_gradient", "Precision", "dynamic_slice",
           "dynamic_update_slice", "dynamic_slice_in_dim", "dynamic_index_in_dim",
           "dynamic_update_slice_in_dim", "dynamic_update_index_in_dim",
           "ceil", "erf", "erfc", "expm1", "floor", "log1p", "sign",
           "associative_scan", "cond", "fori_loop", "map", "scan", "switch", "while_loop",
           "abs", "add", "argmax", "argmin", "broadcast", "broadcast_in_dim",
           "broadcasted_iota", "clamp", "concatenate", "convert_element_type", "cos", "cummax",
           "cummin", "cumprod", "cumsum", "div", "dot_general", "exp", "expand_dims", "full",
           "full_like", "index_in_dim", "integer_pow", "iota", "log", "logistic", "max", "min",
           "mul", "neg", "pad", "pow", "reduce_max", "reduce_min", "reduce_prod", "reduce_sum",
           "rem", "reshape", "rev", "rsqrt", "select", "select_n", "sin", "slice",
           "slice_in_dim", "sort", "sort_key_val", "sqrt", "square", "squeeze", "sub", "tanh",
           "top_k", "transpose",
           # ctrainstate._src.numpy_lax.lax_more
           "RoundingMethod", "eq", "ne", "lt", "le", "gt", "ge", "bitwise_and", "bitwise_or",
           "bitwise_xor", "bitwise_not", "shift_left", "shift_right_logical",
           "shift_right_arithmetic", "population_count", "clz", "reduce_and", "reduce_or",
           "reduce_xor", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh",
           "atanh", "exp2", "cbrt", "is_finite", "atan2", "nextafter", "reciprocal", "round",
           "dot", "batch_matmul", "split"]


def _is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, (PartitionSpec, Sharding))


def _as_sharding(spec) -> Sharding:
    if isinstance(spec, Sharding):
        return spec
    if spec is not None and not isinstance(spec, PartitionSpec):
        hint = ""
        if isinstance(spec, Device):
            hint = f"; to place on one device, pass SingleDeviceSharding({spec!r})"
        # jax.lax.with_sharding_constraint raises a TypeError too
        raise TypeError(f"with_sharding_constraint: shardings must be Shardings, PartitionSpecs "
                        f"or None (or a pytree of them), got {type(spec).__name__} {spec!r}{hint}")
    mesh = get_mesh()
    if mesh is None:
        raise ValueError(
            f"with_sharding_constraint was given {spec!r} outside a mesh: a PartitionSpec "
            f"needs an active `with mesh:`; or pass NamedSharding(mesh, spec)")
    return NamedSharding(mesh, PartitionSpec() if spec is None else spec)


def with_sharding_constraint(x, shardings):
    """``x`` with every Array placed by ``shardings`` (see the module docstring)."""

    def constrain(spec, subtree):
        s0 = _as_sharding(spec)

        def one(leaf):
            if not isinstance(leaf, (Array, ShapeDtypeStruct, np.ndarray, np.generic, float, int)):
                return leaf
            s = _replicate_uneven(s0, tuple(getattr(leaf, "shape", ())))   # under jit (see there)
            dt = getattr(leaf, "dtype", None)
            if isinstance(leaf, float) or (dt is not None and np.dtype(dt) in (np.float32,
                                                                               np.float64)):
                return with_sharding(leaf, s)          # float32: differentiable
            return device_put(leaf, s)                 # ints, bools, 16-bit floats: placed
        return tree_util.tree_map(one, subtree)

    s_leaves, s_td = tree_util.tree_flatten(shardings, is_leaf=_is_spec_leaf)
    try:   # only a structure mismatch is reported as one (a placement error is its own)
        subtrees = tree_util._flatten_up_to(s_td, x)
    except ValueError as e:
        raise ValueError(f"with_sharding_constraint: the shardings tree is not a prefix of the "
                         f"values: {e}") from None
    out = []
    for sp, subtree in zip(s_leaves, subtrees):
        try:
            out.append(constrain(sp, subtree))
        except ValueError as e:
            if "outside a mesh" in str(e):
                raise
            raise ValueError(f"with_sharding_constraint: {e}") from None
    return tree_util.tree_unflatten(s_td, out)


# --- dynamic_slice / dynamic_update_slice ---------------------------------------------------
# jax's semantics: one scalar start index per dimension (ints, integer numpy scalars, 0-d
# integer Arrays, or one 1-D integer array of them); a negative index counts from the end
# once (``i + n``; with ``allow_negative_indices=False`` a negative Python/numpy int is a
# ValueError and a negative Array index clamps to 0), then every start is clamped to
# ``[0, n - size]`` so the region always fits (XLA's DynamicSlice / DynamicUpdateSlice).
# ctrainstate runs eagerly, so an Array index is read back to the host (one scalar per index)
# before the copies; inside ``eval_shape`` it is not read (the shapes do not depend on it).

def _index_value(i, who: str, abstract: bool):
    """A start index as a Python int (None inside eval_shape for an abstract index)."""
    if isinstance(i, ShapeDtypeStruct):
        dt = np.dtype(i.dtype)
        val = None
    elif isinstance(i, Array):
        dt = np.dtype(i.dtype)
        val = None if abstract else _ops._host_value(i)
    else:
        if isinstance(i, bool):
            dt, val = np.dtype(np.bool_), np.asarray(i)
        elif isinstance(i, int):
            dt, val = np.dtype(np.int32), np.asarray(i)
        else:
            val = np.asarray(i)
            dt = val.dtype
    shape = tuple(i.shape) if isinstance(i, (Array, ShapeDtypeStruct)) else np.shape(val)
    if shape != ():
        raise TypeError(f"start_indices arguments to {who} must be scalars, got an index of "
                        f"shape {shape}")
    if dt == np.bool_ or not np.issubdtype(dt, np.integer):
        raise TypeError(f"index arguments to {who} must be integers, got {dt.name}")
    return None if val is None else int(val)


def _starts(operand_shape, start_indices, sizes, allow_negative, who: str, abstract: bool):
    """The clamped start of the region in every dimension (None inside eval_shape when an
    index is abstract)."""
    if isinstance(start_indices, (Array, ShapeDtypeStruct, np.ndarray)):
        if len(start_indices.shape) != 1:
            raise ValueError(f"Slice indices must be a 1D sequence, got "
                             f"{tuple(start_indices.shape)}")
        if isinstance(start_indices, ShapeDtypeStruct) or (
                abstract and isinstance(start_indices, Array)):
            start_indices = [ShapeDtypeStruct((), start_indices.dtype)] * start_indices.shape[0]
        else:
            start_indices = list(np.asarray(start_indices))    # one read of the whole vector
    else:
        try:
            start_indices = list(start_indices)
        except TypeError:
            raise TypeError(f"{who}: start_indices must be a sequence of scalar indices, one per "
                            f"dimension, got {type(start_indices).__name__}") from None
    nd = len(operand_shape)
    if len(start_indices) != nd:
        raise ValueError(f"Length of slice indices must match number of operand dimensions "
                         f"({len(start_indices)} vs {tuple(operand_shape)})")
    allow = ([bool(allow_negative)] * nd if isinstance(allow_negative, (bool, np.bool_))
             else [bool(a) for a in allow_negative])
    if len(allow) != nd:
        raise ValueError(f"{who}: allow_negative_indices must be a bool or one bool per "
                         f"dimension ({nd}), got {allow_negative!r}")
    out = []
    for i, n, m, ok in zip(start_indices, operand_shape, sizes, allow):
        v = _index_value(i, who, abstract)
        if v is None:
            return None
        if v < 0:
            if ok:
                v += n
            elif not isinstance(i, (Array, ShapeDtypeStruct)):
                raise ValueError(f"Index {v} is out of bounds for dimension {n} if "
                                 f"allow_negative_indices=False")
        out.append(builtins.min(builtins.max(v, 0), n - m))
    return out


def _lowp_on_tape(*xs) -> bool:
    """16-bit floats under a gradient trace: the copies run on float32 views (exact for
    these dtypes) so that the cotangents flow through recorded conversions."""
    return _ops._tape() is not None and any(
        isinstance(x, Array) and x.dtype in _ops._LOWP for x in xs)


def _place_host(x, like: Array | None, dtype=None):
    """A host operand (numpy or Python scalar) as an Array: replicated where ``like`` lives,
    else as ``device_put`` places it. 64-bit types narrow as jax's (float64 -> float32)."""
    h = np.asarray(x)
    h = h.astype(dtype if dtype is not None else _dtypes.canonicalize(h.dtype))
    if like is None:
        return device_put(h)
    return device_put(h, _ops._sharding_for(_ops._place_of(like), [()] * h.ndim))


def dynamic_slice(operand, start_indices, slice_sizes, *, allow_negative_indices=True):
    """``operand[start : start + slice_sizes]`` with start indices known at run time
    (``jax.lax.dynamic_slice``): the starts are clamped so that the slice fits (see the
    section comment above), so ``dynamic_slice(x, (5,), (3,))`` of a length-6 ``x`` is
    ``x[3:6]``; likewise ``dynamic_update_slice(x, ones(3), (5,))`` writes at 3.

    Any dtype. Sharding as basic indexing: a dimension sliced to less than its size comes out
    unsharded, the others keep their mesh axes; each device copies from its own block.
    Differentiable (float32, and 16-bit floats through float32): the gradient is the cotangent
    placed into zeros of ``operand``'s shape at the clamped starts.

    >>> import numpy as np, ctrainstate as cts
    >>> from ctrainstate import lax
    >>> x = cts.device_put(np.arange(12, dtype=np.float32).reshape(3, 4))
    >>> np.asarray(lax.dynamic_slice(x, (1, 1), (2, 3))).tolist()
    [[5.0, 6.0, 7.0], [9.0, 10.0, 11.0]]
    >>> np.asarray(lax.dynamic_slice(x, (1, 1), (2, 4))).tolist()    # start clamped to (1, 0)
    [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]]
    """
    who = "dynamic_slice"
    shape = (tuple(operand.shape) if isinstance(operand, (Array, ShapeDtypeStruct))
             else np.shape(operand))
    try:
        sizes = tuple(int(s) for s in slice_sizes)
    except TypeError:
        raise TypeError(f"{who}: slice_sizes must be a sequence of ints, got "
                        f"{slice_sizes!r}") from None
    if len(sizes) != len(shape):
        raise ValueError(f"{who}: slice_sizes {sizes} must have one size per dimension of the "
                         f"operand of shape {shape}")
    if any(s < 0 for s in sizes):
        raise TypeError(f"slice slice_sizes must be greater than or equal to zero, got "
                        f"slice_sizes of {sizes}.")
    if any(s > n for s, n in zip(sizes, shape)):
        raise TypeError(f"slice slice_sizes must be less than or equal to operand shape, got "
                        f"slice_sizes {sizes} for operand shape {shape}.")
    abstract = isinstance(operand, ShapeDtypeStruct) or is_abstract()
    starts = _starts(shape, start_indices, sizes, allow_negative_indices, who, abstract)
    if abstract:
        return ShapeDtypeStruct(sizes, _abstract_dtype(operand))
    x = operand if isinstance(operand, Array) else _place_host(operand, None)
    x._check_alive()
    if _lowp_on_tape(x):
        return _ops.astype(dynamic_slice(_ops.astype(x, np.float32), starts, sizes), x.dtype)
    y = _slicing._slice(x, starts, sizes)
    return _slicing._fresh(x) if y is x else y


def dynamic_update_slice(operand, update, start_indices, *, allow_negative_indices=True):
    """A copy of ``operand`` with ``update`` written at ``start_indices``
    (``jax.lax.dynamic_update_slice``): the starts are clamped so that ``update`` fits (see
    the section comment above). ``update`` has ``operand``'s rank and dtype (a ``TypeError``
    otherwise, as in jax; host values are narrowed first, float64 -> float32) and no
    dimension larger than ``operand``'s.

    Any dtype. The result has ``operand``'s sharding; ``update`` is laid out as the region
    (the dimensions it covers whole keep their mesh axes, the others are unsharded) and each
    device copies the part that falls into its own block, so no device gathers ``operand``
    -- a decoding cache sharded over batch and heads takes a one-position update with one
    copy of its own block per device. Every other element keeps its bits. Differentiable
    (float32, and 16-bit floats through float32): ``operand`` gets the cotangent with the
    region zeroed, ``update`` the cotangent's region.

    >>> import numpy as np, ctrainstate as cts
    >>> from ctrainstate import lax
    >>> x = cts.device_put(np.zeros(6, np.float32))
    >>> np.asarray(lax.dynamic_update_slice(x, np.ones(3, np.float32), (2,))).tolist()
    [0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    >>> np.asarray(lax.dynamic_update_slice(x, np.ones(3, np.float32), (5,))).tolist()
    [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    """
    who = "dynamic_update_slice"

    def meta(v):
        if isinstance(v, (Array, ShapeDtypeStruct)):
            return tuple(v.shape), np.dtype(v.dtype), False
        if isinstance(v, (bool, int, float)):       # weakly typed: takes the other's dtype
            return (), None, True
        h = np.asarray(v)
        return h.shape, _dtypes.canonicalize(h.dtype), False

    oshape, odt, oweak = meta(operand)
    ushape, udt, uweak = meta(update)
    if len(ushape) != len(oshape):
        raise TypeError(f"dynamic_update_slice update must have the same rank as operand, got "
                        f"update shape {ushape} for operand shape {oshape}.")
    if any(u > n for u, n in zip(ushape, oshape)):
        raise TypeError(f"dynamic_update_slice update shape must be smaller than operand shape, "
                        f"got update shape {ushape} for operand shape {oshape}.")
    dt = odt if odt is not None else (udt if udt is not None else np.dtype(np.float32))
    if odt is not None and udt is not None and odt != udt:
        raise TypeError(f"lax.dynamic_update_slice requires arguments to have the same dtypes, "
                        f"got {odt.name}, {udt.name}.")
    abstract = is_abstract() or any(isinstance(v, ShapeDtypeStruct) for v in (operand, update))
    starts = _starts(oshape, start_indices, ushape, allow_negative_indices, who, abstract)
    if abstract:
        return ShapeDtypeStruct(oshape, dt, getattr(operand, "sharding", None))
    x = operand if isinstance(operand, Array) else _place_host(
        operand, update if isinstance(update, Array) else None, dt)
    x._check_alive()
    place, big = _slicing._layout_of(x)
    region = _ops._sharding_for(place, _slicing._region_norm(big, ushape, oshape))
    u = update if isinstance(update, Array) else device_put(np.asarray(update, dt), region)
    u._check_alive()
    if _lowp_on_tape(x, u):
        f32 = np.float32
        out = dynamic_update_slice(_ops.astype(x, f32), _ops.astype(u, f32), starts)
        return _ops.astype(out, dt)
    return _slicing._set_region(x, starts, u, place, big)


# --- the one-dimension forms (jax.lax.dynamic_*_in_dim) -------------------------------------

def _axis(axis, ndim: int, who: str) -> int:
    return one_axis(axis, ndim, who)


def _shape_of(x):
    return tuple(np.shape(x)) if not isinstance(x, (Array, ShapeDtypeStruct)) else tuple(x.shape)


def dynamic_slice_in_dim(operand, start_index, slice_size: int = 1, axis: int = 0, *,
                         allow_negative_indices=True):
    """``jax.lax.dynamic_slice_in_dim``: :func:`dynamic_slice` along ``axis`` only (the other
    dimensions whole), with jax's clamping of ``start_index``.

    >>> import numpy as np
    >>> from ctrainstate import lax
    >>> np.asarray(lax.dynamic_slice_in_dim(np.arange(10.0, dtype=np.float32), 8, 3)).tolist()
    [7.0, 8.0, 9.0]
    """
    shape = _shape_of(operand)
    ax = _axis(axis, len(shape), "dynamic_slice_in_dim")
    starts = [0] * len(shape)
    starts[ax] = start_index
    sizes = list(shape)
    sizes[ax] = int(slice_size)
    return dynamic_slice(operand, starts, sizes, allow_negative_indices=allow_negative_indices)


def dynamic_index_in_dim(operand, index, axis: int = 0, keepdims: bool = True, *,
                         allow_negative_indices=True):
    """``jax.lax.dynamic_index_in_dim``: the slice of size 1 at ``index`` along ``axis``,
    that dimension dropped unless ``keepdims``."""
    shape = _shape_of(operand)
    ax = _axis(axis, len(shape), "dynamic_index_in_dim")
    out = dynamic_slice_in_dim(operand, index, 1, ax,
                               allow_negative_indices=allow_negative_indices)
    if keepdims:
        return out
    new = tuple(n for d, n in enumerate(out.shape) if d != ax)
    if isinstance(out, ShapeDtypeStruct):
        return ShapeDtypeStruct(new, out.dtype)
    return _ops.reshape(out, new)


def dynamic_update_slice_in_dim(operand, update, start_index, axis: int, *,
                                allow_negative_indices=True):
    """``jax.lax.dynamic_update_slice_in_dim``: :func:`dynamic_update_slice` with the start
    ``start_index`` along ``axis`` and 0 elsewhere."""
    shape = _shape_of(operand)
    ax = _axis(axis, len(shape), "dynamic_update_slice_in_dim")
    starts = [0] * len(shape)
    starts[ax] = start_index
    return dynamic_update_slice(operand, update, starts,
                                allow_negative_indices=allow_negative_indices)


def dynamic_update_index_in_dim(operand, update, index, axis: int, *,
                                allow_negative_indices=True):
    """``jax.lax.dynamic_update_index_in_dim``: write ``update`` (of ``operand``'s rank, or one
    less: the dimension ``axis`` is then inserted) at ``index`` along ``axis``."""
    shape = _shape_of(operand)
    ax = _axis(axis, len(shape), "dynamic_update_index_in_dim")
    ushape = _shape_of(update)
    if len(ushape) == len(shape) - 1:
        new = ushape[:ax] + (1,) + ushape[ax:]
        if isinstance(update, ShapeDtypeStruct):
            update = ShapeDtypeStruct(new, update.dtype)
        elif isinstance(update, Array):
            update = _ops.reshape(update, new)
        else:
            update = np.reshape(np.asarray(update), new)
    return dynamic_update_slice_in_dim(operand, update, index, ax,
                                       allow_negative_indices=allow_negative_indices)

from .conv import (ConvDimensionNumbers, conv, conv_dimension_numbers, conv_general_dilated,
                   conv_general_dilated_local, conv_general_dilated_patches, conv_transpose,
                   conv_with_general_padding, padtype_to_pads, reduce_window)

__all__ += ["ConvDimensionNumbers", "conv", "conv_dimension_numbers", "conv_general_dilated",
            "conv_general_dilated_local", "conv_general_dilated_patches",
            "conv_transpose", "conv_with_general_padding", "padtype_to_pads", "reduce_window"]

# the collectives over a pmap axis (ctrainstate._src.numpy_lax.pmap)
from .pmap import all_gather, axis_index, pmax, pmean, pmin, ppermute, psum, psum_scatter

__all__ += ["all_gather", "axis_index", "pmax", "pmean", "pmin", "ppermute", "psum",
            "psum_scatter"]


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
