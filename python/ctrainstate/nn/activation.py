"""Activation helpers of ``flax.linen`` / ``jax.nn`` built from ctrainstate.numpy ops
(differentiable, sharded): ``silu``/``swish``, ``leaky_relu``, ``softplus``, ``log_sigmoid``,
``elu``, ``celu``, ``selu``, ``relu6``, ``hard_tanh``, ``hard_sigmoid``,
``hard_silu``/``hard_swish``, ``glu``, ``standardize`` (alias ``normalize``), ``soft_sign``,
``one_hot``, the :class:`PReLU` layer, and the numerically stable
``softmax``, ``log_softmax`` and ``logsumexp`` (shifted by the maximum, which stops the
gradient, as jax.nn does; over a dimension sharded on mesh axes the maximum and the sum end in
all-reduces over them).

The formulas are jax.nn's (jax 0.10): ``softplus(x) = logaddexp(x, 0)`` computed as
``max(x, 0) + log1p(exp(-|x|))``, ``log_sigmoid(x) = -softplus(-x)``, elu / celu / selu with
``expm1``; so are the gradients, including jax's choices at the kinks: ``relu6`` has gradient
0 at both 0 and 6 and ``hard_tanh`` gradient 1 at both -1 and 1 (jax's custom jvp and
``where`` rule), ``hard_sigmoid`` / ``hard_silu`` follow relu6, ``celu`` and ``elu`` take 1
(for alpha = 1) at 0. Every function takes bfloat16 / float16 Arrays: computed in float32
and rounded once to the input's dtype.

>>> import numpy as np
>>> from ctrainstate import nn
>>> nn.one_hot(np.array([0, 2]), 3).tolist()
[[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
"""
from __future__ import annotations

import operator

import numpy as np

from typing import Any

from .._src.base import dtypes as _dtypes
from .._src.ops import ops as _ops
from .._src.array.array import Array as _Array, device_put
from .._src.nn.module import Module as _Module, compact as _compact
from .._src.numpy_lax import numpy as cnp
from .._src.array.abstract import ShapeDtypeStruct
from .._src.ops.slicing import split

__all__ = ["silu", "swish", "leaky_relu", "one_hot", "softmax", "log_softmax", "logsumexp",
           "softplus", "log_sigmoid", "elu", "celu", "selu", "relu6", "hard_tanh",
           "hard_sigmoid", "hard_silu", "hard_swish", "glu", "standardize", "normalize",
           "soft_sign", "PReLU"]

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
    an index outside ``[0, num_classes)`` gives a row of zeros.

    Labels given as an Array are compared on their own devices (jax's compare against an
    iota): the result keeps their sharding, the new axis unsharded, and nothing is read to
    the host -- labels sharded over processes (data-parallel batches) included, and under
    ``jit`` the compare is recorded as any elementwise op. Host labels (numpy, lists) are
    compared on the host and placed like ``device_put``.

    >>> import numpy as np, ctrainstate as cts
    >>> from ctrainstate import nn
    >>> nn.one_hot(cts.device_put(np.array([1, -1], np.int32)), 3).tolist()
    [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    """
    try:
        num_classes = operator.index(num_classes)   # jax: 2.5 classes is a TypeError
    except TypeError:
        raise TypeError(f"one_hot: num_classes must be an int, got {num_classes!r}") from None
    dtype = _dtypes.canonicalize(dtype)
    if isinstance(x, _Array):
        return _one_hot_array(x, num_classes, dtype, axis)
    idx = np.asarray(x)
    if not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"one_hot expects integer labels, got {idx.dtype}")
    out = (idx[..., None] == np.arange(num_classes)).astype(dtype)
    if axis != -1:
        out = np.moveaxis(out, -1, axis)
    return device_put(out)


def _one_hot_array(x, num_classes: int, dtype, axis: int):
    """one_hot of an integer Array: ``expand_dims(x, -1) == iota`` on each device's own
    blocks (the iota a small replicated constant; compared in int32, or uint32 for uint32
    labels, so no class number wraps in a narrow dtype), converted to ``dtype``."""
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"one_hot expects integer labels, got {x.dtype}")
    nd = x.ndim + 1
    if not -nd <= axis < nd:
        raise ValueError(f"one_hot: axis {axis} is out of range for {nd} dimensions")
    if x.dtype.itemsize < 4:
        x = cnp.astype(x, np.int32)
    iota = _iota(num_classes, np.uint32 if x.dtype == np.uint32 else np.int32, x)
    out = cnp.astype(cnp.equal(cnp.expand_dims(x, -1), iota), dtype)
    return out if axis in (-1, nd - 1) else cnp.moveaxis(out, -1, axis)


_IOTAS: dict = {}
_IOTAS_MAX = 64


def _iota(n: int, dt, like):
    """``arange(n)`` of dtype ``dt`` as an Array replicated where ``like`` lives, kept per
    (n, dtype, placement) so that the compare with it runs from its C plan at the next call
    (a new one while a jit trace records)."""
    place = _ops._place_of(like)
    dt = np.dtype(dt)
    return _ops.kept_constant(_IOTAS, _IOTAS_MAX, (n, dt, id(place)), place, _arange_on,
                              (n, dt))


def _arange_on(n_dt, place):
    n, dt = n_dt
    return _ops._lift_any(np.arange(n, dtype=dt), place)


def _const(v, like):
    """The float32 scalar ``v`` as an Array where ``like`` lives (so products and quotients
    with it run as the binary kernels, bit for bit as jax's ``x * c`` and ``x / c``)."""
    return _ops._lift(np.float32(v), _ops._place_of(like))


def softplus(x):
    """``log(1 + exp(x))``, stable: ``max(x, 0) + log1p(exp(-|x|))`` (jax.nn.softplus's
    ``logaddexp(x, 0)``); gradient ``sigmoid(x)``."""
    x = _ops._lift(x)
    ax = _ops._unary_raw(_ops.U_ABS, x)
    tail = _ops._unary_raw(_ops.U_LOG1P, _ops._unary_raw(_ops.U_EXP, _ops._unary_raw(_ops.U_NEG, ax)))
    out = _ops._binary_raw(_ops.B_ADD, _ops._unary_raw(_ops.U_RELU, x), tail)
    return _ops._record(out, (x,), lambda g: (_ops.multiply(g, _ops.sigmoid(x)),))


def log_sigmoid(x):
    """``log(sigmoid(x)) = -softplus(-x)`` (jax.nn.log_sigmoid); gradient ``sigmoid(-x)``."""
    return _ops.negative(softplus(_ops.negative(x)))


def elu(x, alpha: float = 1.0):
    """``x`` where ``x > 0``, else ``alpha * expm1(x)`` (jax.nn.elu; the gradient at 0 is
    ``alpha``, that of the expm1 branch, as jax's ``where``)."""
    x = _ops._lift(x)
    pos = _ops._binary_raw(_ops.B_GT, x, _const(0.0, x))
    neg_part = _ops.where(pos, _const(0.0, x), x)
    return _ops.where(pos, x, _ops.multiply(_const(alpha, x), _ops.expm1(neg_part)))


def celu(x, alpha: float = 1.0):
    """``max(x, 0) + alpha * expm1(min(x, 0) / alpha)`` (jax.nn.celu)."""
    x = _ops._lift(x)
    a = _const(alpha, x)
    return _ops.add(_ops.maximum(x, 0.0),
                    _ops.multiply(a, _ops.expm1(_ops.divide(_ops.minimum(x, 0.0), a))))


_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def selu(x):
    """``scale * elu(x, alpha)`` with jax.nn.selu's constants (alpha 1.67326..., scale
    1.05070...)."""
    x = _ops._lift(x)
    return _ops.multiply(_const(_SELU_SCALE, x), elu(x, _SELU_ALPHA))


def _between(x, lo, hi, closed: bool):
    """1.0 where ``lo < x < hi`` (``closed``: ``lo <= x <= hi``; NaN counts as inside when
    closed, outside when open, as jax's masks), else 0.0; not recorded."""
    if closed:   # 1 - (x > hi) - (lo > x)
        out = _ops._binary_raw(_ops.B_SUB, _ops._binary_raw(_ops.B_GT, x, _const(hi, x)),
                               _ops._unary_raw(_ops.U_AFFINE, _ops._binary_raw(
                                   _ops.B_GT, _const(lo, x), x), -1.0, 0.0))
        return _ops._unary_raw(_ops.U_AFFINE, out, -1.0, 1.0)
    return _ops._binary_raw(_ops.B_MUL, _ops._binary_raw(_ops.B_GT, x, _const(lo, x)),
                            _ops._binary_raw(_ops.B_GT, _const(hi, x), x))


def relu6(x):
    """``min(max(x, 0), 6)`` (jax.nn.relu6: NaN stays NaN; the gradient is 1 strictly
    between 0 and 6 and 0 elsewhere, at 0 and 6 too, jax's custom jvp)."""
    x = _ops._lift(x)
    out = _ops._binary_raw(_ops.B_MIN, _ops._binary_raw(_ops.B_MAX, x, _const(0.0, x)),
                           _const(6.0, x))
    return _ops._record(out, (x,), lambda g: (_ops.multiply(g, _between(x, 0.0, 6.0, False)),))


def hard_tanh(x):
    """``x`` clipped to [-1, 1] (jax.nn.hard_tanh; gradient 1 on the closed interval,
    0 outside)."""
    x = _ops._lift(x)
    out = _ops._binary_raw(_ops.B_MIN, _ops._binary_raw(_ops.B_MAX, x, _const(-1.0, x)),
                           _const(1.0, x))
    return _ops._record(out, (x,), lambda g: (_ops.multiply(g, _between(x, -1.0, 1.0, True)),))


def hard_sigmoid(x):
    """``relu6(x + 3) / 6`` (jax.nn.hard_sigmoid)."""
    x = _ops._lift(x)
    return _ops.divide(relu6(_ops.add(x, 3.0)), _const(6.0, x))


def hard_silu(x):
    """``x * hard_sigmoid(x)`` (jax.nn.hard_silu, also called hard_swish)."""
    x = _ops._lift(x)
    return _ops.multiply(x, hard_sigmoid(x))


hard_swish = hard_silu


def glu(x, axis: int = -1):
    """Gated linear unit: ``x1 * sigmoid(x2)`` with ``x1, x2`` the two halves of ``x`` along
    ``axis`` (jax.nn.glu); that dimension must be even."""
    x = _ops._lift(x)
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"glu: axis must be an int, got {axis!r}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"glu: axis {axis} is out of bounds for an array of shape {x.shape}")
    n = x.shape[axis]
    if n % 2:
        raise ValueError(f"glu: dimension {axis % x.ndim} of shape {x.shape} has odd size {n}; "
                         f"it must split in two halves")
    x1, x2 = split(x, 2, axis=int(axis))
    return _ops.multiply(x1, _ops.sigmoid(x2))


def standardize(x, axis=-1, mean=None, variance=None, epsilon: float = 1e-5, where=None, *,
                algorithm: str = "fast"):
    """``(x - mean) * rsqrt(variance + epsilon)`` over ``axis`` (jax.nn.standardize): without
    ``mean``, the mean over ``axis``; without ``variance``, ``algorithm='fast'`` (jax's
    default) takes ``mean(x**2) - mean**2`` clipped at 0, ``'stable'`` the two-pass
    ``mean((x - mean)**2)``. ``where=`` is not supported."""
    if where is not None:
        raise NotImplementedError("standardize: where= is not supported")
    x = _ops._lift(x)
    if mean is None:
        mean = _ops.mean(x, axis, keepdims=True)
    if variance is None:
        if algorithm == "stable":
            variance = _ops.mean(_ops.square(_ops.subtract(x, mean)), axis, keepdims=True)
        elif algorithm == "fast":
            variance = _ops.subtract(_ops.mean(_ops.square(x), axis, keepdims=True),
                                     _ops.square(mean))
            variance = _ops.maximum(variance, 0.0)
        else:
            raise ValueError(f"standardize: unknown algorithm {algorithm!r}; expected 'fast' "
                             f"or 'stable'")
    return _ops.multiply(_ops.subtract(x, mean), _ops.rsqrt(_ops.add(variance, float(epsilon))))


# 16-bit float inputs: computed in float32, the result rounded once to the input's dtype
# (ctrainstate._src.ops.ops's dtype policy)
silu = _ops._with_dtype_policy(silu)
swish = silu
softplus = _ops._with_dtype_policy(softplus)
log_sigmoid = _ops._with_dtype_policy(log_sigmoid)
elu = _ops._with_dtype_policy(elu)
celu = _ops._with_dtype_policy(celu)
selu = _ops._with_dtype_policy(selu)
relu6 = _ops._with_dtype_policy(relu6)
hard_tanh = _ops._with_dtype_policy(hard_tanh)
hard_sigmoid = _ops._with_dtype_policy(hard_sigmoid)
hard_silu = _ops._with_dtype_policy(hard_silu)
hard_swish = hard_silu
glu = _ops._with_dtype_policy(glu)
standardize = _ops._with_dtype_policy(standardize, (0, 2, 3))
softmax = _ops._with_dtype_policy(softmax)


def soft_sign(x):
    """``x / (|x| + 1)`` (jax.nn.soft_sign)."""
    x = _ops._lift(x)
    return _ops.divide(x, _ops.add(_ops.abs(x), 1.0))


soft_sign = _ops._with_dtype_policy(soft_sign)


def _abstract_rules():
    """Inside ``eval_shape`` (ShapeDtypeStruct arguments) these return ShapeDtypeStructs."""
    g = globals()
    for name in ("silu", "softplus", "log_sigmoid", "elu", "celu", "selu", "relu6", "hard_tanh",
                 "hard_sigmoid", "hard_silu", "standardize", "soft_sign"):
        g[name] = _ops._with_rule(g[name], _ops._rule_same, ShapeDtypeStruct)

    def glu_rule(x, axis=-1):
        shape = list(_ops._shp(x))
        shape[axis] //= 2
        return tuple(shape)
    g["glu"] = _ops._with_rule(g["glu"], glu_rule, ShapeDtypeStruct)
    g["swish"], g["hard_swish"] = g["silu"], g["hard_silu"]


_abstract_rules()
log_softmax = _ops._with_dtype_policy(log_softmax)
logsumexp = _ops._with_dtype_policy(logsumexp)
leaky_relu = _ops._with_dtype_policy(leaky_relu)
normalize = standardize   # flax.linen's alias


class PReLU(_Module):
    """Parametric ReLU (``flax.linen.PReLU``): ``x`` where ``x >= 0``, else
    ``negative_slope * x``, with a learned scalar ``'negative_slope'`` parameter (initialised
    to ``negative_slope_init``, 0.01, in ``param_dtype``; cast to the input's dtype).

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> x = np.array([-2.0, 3.0], np.float32)
    >>> v = nn.PReLU().init(random.PRNGKey(0), x)
    >>> v['params']['negative_slope'].shape
    ()
    >>> np.asarray(nn.PReLU().apply(v, x)).tolist()
    [-0.019999999552965164, 3.0]
    """

    param_dtype: Any = np.float32
    negative_slope_init: float = 0.01

    @_compact
    def __call__(self, inputs):
        slope = self.param("negative_slope",
                           lambda k: device_put(np.asarray(self.negative_slope_init,
                                                           self.param_dtype)))
        x = _ops._lift(inputs)
        slope = cnp.asarray(slope, x.dtype) if slope.dtype != x.dtype else slope
        return cnp.where(cnp.greater_equal(x, 0.0), x, cnp.multiply(slope, x))


from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
