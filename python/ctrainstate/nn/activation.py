"""Activation helpers of ``flax.linen`` / ``jax.nn`` built from ctrainstate.numpy ops
(differentiable, sharded): ``silu``/``swish``, ``leaky_relu``, ``one_hot``, and the
numerically stable ``softmax``, ``log_softmax`` and ``logsumexp`` (shifted by the maximum,
which stops the gradient, as jax.nn does; over a dimension sharded on mesh axes the maximum
and the sum end in all-reduces over them).

>>> import numpy as np
>>> from ctrainstate import nn
>>> nn.one_hot(np.array([0, 2]), 3).tolist()
[[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
"""
from __future__ import annotations

import numpy as np

from .. import _dtypes, _ops
from ..array import device_put

__all__ = ["silu", "swish", "leaky_relu", "one_hot", "softmax", "log_softmax", "logsumexp"]

_FMAX = float(np.finfo(np.float32).max)


def _no_where(name, where, initial=None):
    if where is not None or initial is not None:
        raise NotImplementedError(f"{name}: where= / initial= are not supported; mask the "
                                  f"input instead (e.g. add -1e9 to masked logits)")


def softmax(x, axis=-1, where=None, initial=None):
    """``exp(x - max) / sum(exp(x - max))`` over ``axis`` (jax.nn.softmax's formula; the
    maximum is a constant for the gradient).

    >>> import numpy as np
    >>> from ctrainstate import nn
    >>> [round(float(v), 4) for v in np.asarray(nn.softmax(np.array([1000., 1001.], np.float32)))]
    [0.2689, 0.7311]
    """
    _no_where("softmax", where, initial)
    x = _ops._lift(x)
    shift = _ops.stop_gradient(_ops.max(x, axis=axis, keepdims=True))
    e = _ops.exp(_ops.subtract(x, shift))
    return _ops.divide(e, _ops.sum(e, axis=axis, keepdims=True))


def log_softmax(x, axis=-1, where=None, initial=None):
    """``x - max - log(sum(exp(x - max)))`` over ``axis`` (jax.nn.log_softmax's formula)."""
    _no_where("log_softmax", where, initial)
    x = _ops._lift(x)
    shifted = _ops.subtract(x, _ops.stop_gradient(_ops.max(x, axis=axis, keepdims=True)))
    lse = _ops.log(_ops.sum(_ops.exp(shifted), axis=axis, keepdims=True))
    return _ops.subtract(shifted, lse)


def logsumexp(a, axis=None, b=None, keepdims: bool = False, return_sign: bool = False,
              where=None):
    """``log(sum(exp(a)))`` over ``axis``, stable (jax.nn.logsumexp). The shift is the
    maximum clamped to the finite floats, so rows of ``-inf`` give ``-inf`` and rows with
    ``+inf`` give ``inf``, as in jax."""
    if b is not None or return_sign:
        raise NotImplementedError("logsumexp: b= and return_sign= are not supported")
    _no_where("logsumexp", where)
    a = _ops._lift(a)
    m = _ops.max(a, axis=axis, keepdims=True)
    m = _ops.stop_gradient(_ops.minimum(_ops.maximum(m, -_FMAX), _FMAX))
    out = _ops.add(_ops.log(_ops.sum(_ops.exp(_ops.subtract(a, m)), axis=axis, keepdims=True)), m)
    if keepdims:
        return out
    axes = _ops._axes(axis, a.ndim)
    return _ops.reshape(out, [s for d, s in enumerate(out.shape) if d not in axes])


def silu(x):
    """``x * sigmoid(x)`` (jax.nn.silu, also called swish)."""
    return _ops.multiply(x, _ops.sigmoid(x))


swish = silu


def leaky_relu(x, negative_slope: float = 1e-2):
    """``x`` where ``x >= 0``, else ``negative_slope * x`` (jax.nn.leaky_relu: infinities stay
    infinite, and the gradient at 0 is 1)."""
    s = float(negative_slope)
    x = _ops._lift(x)
    neg = _ops._unary_raw(_ops.U_NEG, x)
    # relu(x) - s * relu(-x): one side is 0 wherever the other is not, so no inf - inf
    out = _ops._binary_raw(_ops.B_SUB, _ops._unary_raw(_ops.U_RELU, x),
                           _ops._unary_raw(_ops.U_AFFINE, _ops._unary_raw(_ops.U_RELU, neg), s, 0.0))

    def vjp(g):  # 1 where x >= 0, s where x < 0: (1 - below) + s * below, each term exact
        below = _ops._unary_raw(_ops.U_STEP, neg)
        w = _ops._binary_raw(_ops.B_ADD, _ops._unary_raw(_ops.U_AFFINE, below, -1.0, 1.0),
                             _ops._unary_raw(_ops.U_AFFINE, below, s, 0.0))
        return (_ops.multiply(g, w),)
    return _ops._record(out, (x,), vjp)


def one_hot(x, num_classes: int, *, dtype=np.float32, axis: int = -1):
    """``x[..., None] == arange(num_classes)`` as ``dtype`` (float32), the new axis at ``axis``;
    an index outside ``[0, num_classes)`` gives a row of zeros. Built on the host from the
    integer labels and placed like ``device_put`` (the labels of a batch are small)."""
    idx = np.asarray(x)
    if not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"one_hot expects integer labels, got {idx.dtype}")
    out = (idx[..., None] == np.arange(int(num_classes))).astype(_dtypes.canonicalize(dtype))
    if axis != -1:
        out = np.moveaxis(out, -1, axis)
    return device_put(out)


# 16-bit float inputs: computed in float32, the result rounded once to the input's dtype
# (ctrainstate._ops's dtype policy)
softmax = _ops._with_dtype_policy(softmax)
log_softmax = _ops._with_dtype_policy(log_softmax)
logsumexp = _ops._with_dtype_policy(logsumexp)
leaky_relu = _ops._with_dtype_policy(leaky_relu)
