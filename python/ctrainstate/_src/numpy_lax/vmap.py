"""``vmap`` (mirror of ``jax.vmap``): a function of one example mapped over an axis.

ctrainstate runs eagerly, so ``vmap(f)(x)`` calls ``f`` once per element of the mapped axis,
in a loop in the calling thread, on the element's slice (an ordinary differentiable
indexing), and stacks the results along ``out_axes`` (an ordinary differentiable stack).
So ``grad`` of a vmapped function, ``vmap`` of a ``grad`` (per-example gradients), nested
``vmap`` and ``vmap`` inside ``pmap`` all work as the composition of those ops does, with
the same values as jax's batched program up to the rounding of reordered sums (a batched
matmul and a loop of matrix-vector products sum in different orders). The cost is one call
of ``f`` per element: for large batches, write the batched function directly (``x @ w`` on
the whole batch) and keep ``vmap`` for the per-example pieces.

``in_axes``, ``out_axes`` and ``axis_size`` are jax's (ints, ``None``, tree prefixes;
keyword arguments are mapped over axis 0); a mapped size of 0 gives empty outputs of the
shapes :func:`ctrainstate.eval_shape` finds. ``axis_name`` is accepted, but collectives over
a vmap axis (``lax.psum(x, name)`` inside) are refused with an error that says so;
``spmd_axis_name`` is accepted and ignored (the slices keep their input's sharding).

>>> import numpy as np, ctrainstate as cts, ctrainstate.numpy as jnp
>>> w = np.float32([[1., 2.], [3., 4.]])
>>> per_row = cts.vmap(lambda x: w @ x)            # w @ x for each row x
>>> np.asarray(per_row(np.float32([[1., 0.], [0., 1.]]))).tolist()
[[1.0, 3.0], [2.0, 4.0]]
>>> np.asarray(cts.vmap(lambda x, y: x * y, in_axes=(0, None))(np.float32([1., 2.]), 3.0)).tolist()
[3.0, 6.0]
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from ..base import tree_util
from .pmap import _axes_of, _map_size, _tls
from ..array.array import Array
from . import numpy as cnp
from ..array.abstract import eval_shape, ShapeDtypeStruct

__all__ = ["vmap"]


def _element(x, axis, i):
    """Element ``i`` of ``x`` along ``axis`` (an Array: a differentiable index)."""
    if axis is None:
        return x
    if isinstance(x, Array):
        return x[(slice(None),) * axis + (i,)]
    return np.take(np.asarray(x), i, axis=axis)


def _abstract_element(x, axis):
    if axis is None:
        return x
    shape = np.shape(x)
    dt = x.dtype if isinstance(x, Array) else np.asarray(x).dtype
    return ShapeDtypeStruct(shape[:axis] + shape[axis + 1:], dt)


def _out_axes_list(out_axes, tree):
    leaves = tree_util.tree_leaves(tree)
    if out_axes is None or isinstance(out_axes, (int, np.integer)):
        axes = [out_axes] * len(leaves)
    else:
        if isinstance(out_axes, list):
            out_axes = tuple(out_axes)
        try:
            axes = tree_util.tree_leaves(
                tree_util.tree_broadcast(out_axes, tree, is_leaf=lambda v: v is None),
                is_leaf=lambda v: v is None)
        except (ValueError, TypeError) as e:
            raise ValueError(f"vmap out_axes specification must be a tree prefix of the "
                             f"corresponding value: {e}") from None
    for a in axes:
        if a is not None and (not isinstance(a, (int, np.integer)) or isinstance(a, bool)):
            raise TypeError(f"vmap out_axes: each entry must be an int or None, got {a!r}")
    return leaves, axes


def _stack(values, axis, n, where):
    first = values[0]
    nd = np.ndim(first) + 1
    if axis is None:
        if all(v is first for v in values):
            return first
        ref = np.asarray(first)
        for v in values[1:]:
            h = np.asarray(v)
            if h.shape != ref.shape or h.tobytes() != ref.tobytes():
                raise ValueError(f"vmap has mapped output but out_axes is None ({where} differs "
                                 "between the mapped elements); give it an out axis")
        return first
    if not -nd <= axis < nd:
        raise ValueError(f"vmap out_axes {axis} is out of range for an output of rank "
                         f"{nd - 1} ({where})")
    shapes = {np.shape(v) for v in values}
    if len(shapes) != 1:
        raise ValueError(f"vmap: the mapped elements returned different shapes for {where}: "
                         f"{sorted(shapes)}")
    return cnp.stack(list(values), axis=axis % nd)


def vmap(fun: Callable, in_axes=0, out_axes=0, axis_name=None, axis_size: int | None = None,
         spmd_axis_name=None) -> Callable:
    """``jax.vmap``: ``fun`` mapped over an axis of its arguments (see the module docstring).

    Args:
      fun: a function of one element (pytrees of arrays in and out).
      in_axes: the mapped axis of each positional argument: an int, None (the argument is
        passed whole to every call), or a tuple with a tree prefix per argument.
      out_axes: where the mapped axis goes in each output (int, None, or a tree prefix).
      axis_name: accepted (collectives over it are refused: they need all elements at once).
      axis_size: the mapped size when no argument is mapped.
      spmd_axis_name: accepted and ignored.
    """
    if not callable(fun):
        raise TypeError(f"vmap: the first argument must be a function, got {fun!r}")
    if isinstance(in_axes, list):
        raise TypeError("vmap in_axes must be an int, None, or a tuple of entries corresponding "
                        f"to the positional arguments passed to the function, but got {in_axes}")
    if axis_size is not None and (not isinstance(axis_size, (int, np.integer))
                                  or isinstance(axis_size, bool) or axis_size < 0):
        raise ValueError(f"vmap axis_size must be a non-negative int, got {axis_size!r}")
    del spmd_axis_name

    @functools.wraps(fun)
    def batched(*args, **kwargs):
        axes = list(_axes_of(in_axes, args, "in_axes", "vmap"))
        leaves, td = tree_util.tree_flatten(args)
        kw_leaves, kw_td = tree_util.tree_flatten(kwargs)
        all_leaves = leaves + kw_leaves
        all_axes = axes + [0] * len(kw_leaves)
        n = _map_size(all_leaves, all_axes, axis_size, "vmap")

        def call(vals):
            a = tree_util.tree_unflatten(td, vals[:len(leaves)])
            kw = tree_util.tree_unflatten(kw_td, vals[len(leaves):])
            return fun(*a, **kw)

        names = list(getattr(_tls, "vmap_names", ()))
        _tls.vmap_names = names + ([axis_name] if axis_name is not None else [])
        try:
            if n == 0:
                return _empty(call, all_leaves, all_axes)
            outs = [call([_element(v, a, i) for v, a in zip(all_leaves, all_axes)])
                    for i in range(n)]
        finally:
            _tls.vmap_names = names
        structs = {str(tree_util.tree_structure(o)) for o in outs}
        if len(structs) != 1:
            raise ValueError(f"vmap: the mapped elements returned trees of different "
                             f"structures: {sorted(structs)}")
        o_leaves, o_axes = _out_axes_list(out_axes, outs[0])
        per = [tree_util.tree_leaves(o) for o in outs]
        paths = [tree_util.keystr(p) for p, _ in tree_util.tree_leaves_with_path(outs[0])]
        stacked = [_stack([p[k] for p in per], o_axes[k], n, f"output {paths[k] or 'value'}")
                   for k in range(len(o_leaves))]
        return tree_util.tree_unflatten(tree_util.tree_structure(outs[0]), stacked)

    def _empty(call, all_leaves, all_axes):
        abstract = [_abstract_element(v, a) for v, a in zip(all_leaves, all_axes)]
        shapes = eval_shape(lambda *vals: call(list(vals)), *abstract)
        o_leaves, o_axes = _out_axes_list(out_axes, shapes)
        made = []
        for s, a in zip(o_leaves, o_axes):
            shape = tuple(s.shape)
            if a is not None:
                a %= len(shape) + 1
                shape = shape[:a] + (0,) + shape[a:]
            made.append(cnp.zeros(shape, s.dtype))
        return tree_util.tree_unflatten(tree_util.tree_structure(shapes), made)

    return batched
