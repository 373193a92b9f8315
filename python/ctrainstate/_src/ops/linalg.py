"""``ctrainstate.numpy.linalg``: the norms of ``jax.numpy.linalg`` that reduce to sums and
maxima (differentiable, sharded like the ops they are built from).

Supported: vector norms (one axis, or a 1-d ``x``) of ``ord`` None / 2 (the Euclidean norm,
``sqrt(sum(x * x))`` as jax computes it), 1, ``inf``, ``-inf``, 0 (the count of nonzeros;
zero gradient) and any other nonzero number ``p`` (``sum(|x| ** p) ** (1 / p)``); matrix norms
(two axes, or a 2-d ``x`` with ``ord`` given) of ``ord`` None / ``'fro'`` / ``'f'``
(Frobenius), 1, -1, ``inf`` and ``-inf``. ``ord`` 2, -2 and ``'nuc'`` on matrices need
singular values and raise ``NotImplementedError``. With ``axis=None`` and ``ord=None`` any
rank is the 2-norm of the flattened array (numpy's and jax's rule).

>>> import numpy as np, ctrainstate.numpy as cnp
>>> float(np.asarray(cnp.linalg.norm(np.array([3., 4.], np.float32))))
5.0
>>> float(np.asarray(cnp.linalg.norm(np.array([[1., -2.], [3., 4.]], np.float32), ord=1)))
6.0
"""
from __future__ import annotations

import math

import numpy as np

from . import ops as _ops
from ..array.abstract import ShapeDtypeStruct
from .move import _axis

__all__ = ["norm", "vector_norm", "matrix_norm"]


def _canon_axis(a, ndim: int) -> int:
    return _axis(a, ndim, "norm")


def _euclid(x, axis, keepdims):
    return _ops.sqrt(_ops.sum(_ops.multiply(x, x), axis=axis, keepdims=keepdims))


def _vector(x, ord, axis, keepdims):  # noqa: A002 - jnp's name
    if ord is None or (not isinstance(ord, str) and ord == 2):
        return _euclid(x, axis, keepdims)
    if isinstance(ord, str):
        raise ValueError(f"norm: invalid order {ord!r} for a vector norm (use np.inf, not "
                         f"'inf')")
    if not isinstance(ord, (int, float, np.integer, np.floating)) or isinstance(ord, bool):
        raise TypeError(f"norm: ord must be a number, None or a string, got {ord!r}")
    a = _ops.abs(x)
    if ord == math.inf:   # jnp: amax(|x|, initial=0)
        return _ops.maximum(_ops.max(a, axis=axis, keepdims=keepdims), 0.0)
    if ord == -math.inf:
        return _ops.min(a, axis=axis, keepdims=keepdims)
    if ord == 0:          # the number of nonzeros (NaN counts, as x != 0 in jnp)
        nz = _ops._nonzero(_ops.stop_gradient(x))
        return _ops.sum(nz, axis=axis, keepdims=keepdims)
    if ord == 1:
        return _ops.sum(a, axis=axis, keepdims=keepdims)
    p = float(np.float32(ord))
    inv = float(np.float32(1.0) / np.float32(ord))
    return _ops.power(_ops.sum(_ops.power(a, p), axis=axis, keepdims=keepdims), inv)


def _matrix(x, ord, axes, keepdims):  # noqa: A002 - jnp's name
    row, col = axes
    if ord is None or ord in ("f", "fro"):
        return _euclid(x, axes, keepdims)
    if isinstance(ord, str) or ord in (2, -2):
        if ord in ("nuc", 2, -2):
            raise NotImplementedError(f"norm: the matrix norm ord={ord!r} needs singular "
                                      f"values (an SVD), which ctrainstate does not have")
        raise ValueError(f"norm: invalid order {ord!r} for a matrix norm")
    if ord in (1, -1):
        red, keep = row, col
    elif ord in (math.inf, -math.inf):
        red, keep = col, row
    else:
        raise ValueError(f"norm: invalid order {ord!r} for a matrix norm")
    if not keepdims and keep > red:
        keep -= 1
    s = _ops.sum(_ops.abs(x), axis=red, keepdims=keepdims)
    if ord > 0:           # jnp: amax(..., initial=0)
        return _ops.maximum(_ops.max(s, axis=keep, keepdims=keepdims), 0.0)
    return _ops.min(s, axis=keep, keepdims=keepdims)


def norm(x, ord=None, axis=None, keepdims: bool = False):  # noqa: A002 - jnp's name
    """The vector or matrix norm of ``x`` (``jnp.linalg.norm``; the ``ord`` values supported
    are in the module's docstring). ``axis``: None, an int (vector norms) or a pair (matrix
    norms); a bfloat16 / float16 ``x`` is computed in float32 and rounded once."""
    x = _ops._lift(x)
    nd = x.ndim
    if axis is None:
        if ord is None:
            return _euclid(x, None, keepdims)
        axes = tuple(range(nd))
    elif isinstance(axis, tuple):
        axes = tuple(_canon_axis(a, nd) for a in axis)
    else:
        axes = (_canon_axis(axis, nd),)
    if len(axes) == 1:
        return _vector(x, ord, axes, keepdims)
    if len(axes) == 2:
        if axes[0] == axes[1]:
            raise ValueError(f"norm: repeated axis {axis!r}")
        return _matrix(x, ord, axes, keepdims)
    raise ValueError(f"norm: improper number of axes {axes} (one axis for a vector norm, two "
                     f"for a matrix norm)")


def vector_norm(x, axis=None, keepdims: bool = False, ord=2):  # noqa: A002 - jnp's name
    """``jnp.linalg.vector_norm``: the vector norm over ``axis`` (None: all elements)."""
    x = _ops._lift(x)
    if axis is None:
        axes = tuple(range(x.ndim))
    elif isinstance(axis, tuple):
        axes = tuple(_canon_axis(a, x.ndim) for a in axis)
    else:
        axes = (_canon_axis(axis, x.ndim),)
    return _vector(x, ord, axes, keepdims)


def matrix_norm(x, /, *, keepdims: bool = False, ord="fro"):  # noqa: A002 - jnp's name
    """``jnp.linalg.matrix_norm``: the matrix norm over the last two axes."""
    x = _ops._lift(x)
    if x.ndim < 2:
        raise ValueError(f"matrix_norm: x must have at least 2 dimensions, got shape {x.shape}")
    return _matrix(x, ord, (x.ndim - 2, x.ndim - 1), keepdims)


def _norm_rule(x, ord=None, axis=None, keepdims: bool = False):  # noqa: A002
    shape = _ops._shp(x)
    if axis is None:
        axes = tuple(range(len(shape)))
    elif isinstance(axis, tuple):
        axes = tuple(_canon_axis(a, len(shape)) for a in axis)
    else:
        axes = (_canon_axis(axis, len(shape)),)
    if keepdims:
        return tuple(1 if d in axes else n for d, n in enumerate(shape))
    return tuple(n for d, n in enumerate(shape) if d not in axes)


def _with_abstract(fn, rule):
    return _ops._with_rule(fn, rule, ShapeDtypeStruct)


norm = _with_abstract(_ops._with_dtype_policy(norm), _norm_rule)
vector_norm = _ops._with_dtype_policy(vector_norm)
matrix_norm = _ops._with_dtype_policy(matrix_norm)
