"""Array operators (``+ - * / // % @ ** -``, ``& | ^ ~ << >>``, ``abs()``, ``.T``, ``.reshape``, ``.sum``, ``.mean``, ``.max``,
``.min``, ``.argmax``, ``.argmin``, ``.var``, ``.std``, ``.prod``, ``.cumsum``, ``.cumprod``, ``.round``,
``.dot``, ``.swapaxes``, ``.take``, ``.repeat``, ``.sort``, ``.argsort``) mapped to
``ctrainstate.numpy``, shared by :class:`~ctrainstate.Array` and
:class:`~ctrainstate.ShapeDtypeStruct` (whose ops follow the shape rules)."""
from __future__ import annotations

import numpy as np
from ..base import dtypes as _dtypes
from ..base.hooks import upper as _upper


_MODS: dict = {}   # the op modules (an upper layer: looked up in _hooks on first use)


def _ops():
    m = _MODS.get("ops")
    if m is None:
        m = _upper('_ops')
        _MODS["ops"] = m
    return m


def _ew():
    m = _MODS.get("ew")
    if m is None:
        m = _upper('_elementwise')
        _MODS["ew"] = m
    return m


class OperatorsMixin:
    __slots__ = ()

    def __add__(self, o):
        return _ops().add(self, o)

    def __radd__(self, o):
        return _ops().add(o, self)

    def __sub__(self, o):
        return _ops().subtract(self, o)

    def __rsub__(self, o):
        return _ops().subtract(o, self)

    def __mul__(self, o):
        return _ops().multiply(self, o)

    def __rmul__(self, o):
        return _ops().multiply(o, self)

    def __truediv__(self, o):
        return _ops().divide(self, o)

    def __rtruediv__(self, o):
        return _ops().divide(o, self)

    def __matmul__(self, o):
        return _ops().matmul(self, o)

    def __rmatmul__(self, o):
        return _ops().matmul(o, self)

    def __neg__(self):
        return _ops().negative(self)

    def __abs__(self):
        return _ops().abs(self)

    def __floordiv__(self, o):
        return _ew().floor_divide(self, o)

    def __rfloordiv__(self, o):
        return _ew().floor_divide(o, self)

    def __mod__(self, o):
        return _ew().remainder(self, o)

    def __rmod__(self, o):
        return _ew().remainder(o, self)

    def __and__(self, o):
        return _ew().bitwise_and(self, o)

    def __rand__(self, o):
        return _ew().bitwise_and(o, self)

    def __or__(self, o):
        return _ew().bitwise_or(self, o)

    def __ror__(self, o):
        return _ew().bitwise_or(o, self)

    def __xor__(self, o):
        return _ew().bitwise_xor(self, o)

    def __rxor__(self, o):
        return _ew().bitwise_xor(o, self)

    def __invert__(self):
        return _ew().invert(self)

    def __lshift__(self, o):
        return _ew().left_shift(self, o)

    def __rlshift__(self, o):
        return _ew().left_shift(o, self)

    def __rshift__(self, o):
        return _ew().right_shift(self, o)

    def __rrshift__(self, o):
        return _ew().right_shift(o, self)

    def __pow__(self, p):
        # x ** 2 with a Python (or numpy) scalar 2 is x * x, as jax's integer_pow; any other
        # exponent, Arrays included, is cnp.power (so is a numpy float 2 of another dtype:
        # it is strongly typed, float16_array ** np.float32(2) is float32 in jax)
        if isinstance(p, (int, float, np.integer, np.floating)) and not isinstance(p, bool) \
                and p == 2 and not (isinstance(p, np.floating) and p.dtype != self.dtype):
            return _ops().square(self)
        return _ops().power(self, p)

    def __rpow__(self, b):
        return _ops().power(b, self)

    @property
    def T(self):
        return _ops().transpose(self)

    @property
    def mT(self):
        """The last two dimensions swapped (``jax.Array.mT``)."""
        return _upper('numpy').swapaxes(self, -1, -2)

    def transpose(self, *axes):
        """``jnp.transpose(x, axes)``: ``x.transpose()``, ``x.transpose(1, 0)`` or
        ``x.transpose((1, 0))``."""
        if len(axes) == 1 and (axes[0] is None or isinstance(axes[0], (tuple, list))):
            axes = axes[0]
        return _upper('numpy').transpose(self, axes if axes else None)

    def squeeze(self, axis=None):
        return _upper('numpy').squeeze(self, axis)

    def flatten(self):
        return _ops().reshape(self, (-1,))

    def ravel(self):
        return _ops().reshape(self, (-1,))

    def clip(self, min=None, max=None):  # noqa: A002 - jax's parameter names
        return _upper('numpy').clip(self, min, max)

    def __pos__(self):
        return self

    def __index__(self):
        """An integer 0-d Array as a Python int (e.g. as a list index)."""
        if self.ndim != 0 or np.dtype(self.dtype).kind not in "iu":   # bool: a mask, not 0/1
            raise TypeError(f"only integer scalar arrays can be converted to a scalar index "
                            f"(this one: shape {self.shape}, dtype {self.dtype})")
        return int(np.asarray(self))

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, np.ndarray)):
            shape = shape[0]
        return _ops().reshape(self, shape)

    # dtype/out: what np.sum(x) / np.mean(x) pass to the method
    def sum(self, axis=None, dtype=None, out=None, keepdims=False, *, where=None):
        if where is not None:
            return _upper('numpy').sum(self, axis, dtype, out, keepdims, where=where)
        res = _ops().sum(reduce_operand("sum", self, dtype, out), axis=axis, keepdims=keepdims)
        if dtype is not None and res.dtype != np.dtype(dtype):
            res = _ops().astype(res, dtype)    # a narrow int dtype= wraps (cnp.sum's rule)
        return res

    def mean(self, axis=None, dtype=None, out=None, keepdims=False, *, where=None):
        if where is not None:
            return _upper('numpy').mean(self, axis, dtype, out, keepdims, where=where)
        return _ops().mean(reduce_operand("mean", self, dtype, out), axis=axis,
                           keepdims=keepdims)

    def max(self, axis=None, out=None, keepdims=False):
        _check_reduce_args("max", None, out)
        return _ops().max(self, axis=axis, keepdims=keepdims)

    def min(self, axis=None, out=None, keepdims=False):
        _check_reduce_args("min", None, out)
        return _ops().min(self, axis=axis, keepdims=keepdims)

    # out/keepdims: what np.argmax(x) / np.argmin(x) pass to the method
    def argmax(self, axis=None, out=None, keepdims=False):
        _check_reduce_args("argmax", None, out)
        return _ops().argmax(self, axis=axis, keepdims=keepdims)

    def argmin(self, axis=None, out=None, keepdims=False):
        _check_reduce_args("argmin", None, out)
        return _ops().argmin(self, axis=axis, keepdims=keepdims)

    def var(self, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
        return _upper('numpy').var(reduce_operand("var", self, dtype, out), axis=axis, keepdims=keepdims,
                       ddof=ddof)

    def std(self, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
        return _upper('numpy').std(reduce_operand("std", self, dtype, out), axis=axis, keepdims=keepdims,
                       ddof=ddof)

    def prod(self, axis=None, dtype=None, out=None, keepdims=False):
        return _upper('numpy').prod(reduce_operand("prod", self, dtype, out), axis=axis, keepdims=keepdims)

    def cumsum(self, axis=None, dtype=None, out=None):
        return _ew().cumsum(reduce_operand("cumsum", self, dtype, out), axis)

    def cumprod(self, axis=None, dtype=None, out=None):
        return _ew().cumprod(reduce_operand("cumprod", self, dtype, out), axis)

    def round(self, decimals=0, out=None):
        _check_reduce_args("round", None, out)
        return _ops().round(self, decimals)

    def dot(self, b, *, precision=None):
        return _ops().dot(self, b, precision=precision)

    def swapaxes(self, axis1, axis2):
        return _upper('numpy').swapaxes(self, axis1, axis2)

    def take(self, indices, axis=None, out=None, mode=None, unique_indices=False,
             indices_are_sorted=False, fill_value=None):
        _check_reduce_args("take", None, out)
        return _upper('numpy').take(self, indices, axis=axis, mode=mode, fill_value=fill_value)

    def repeat(self, repeats, axis=None, *, total_repeat_length=None):
        return _upper('numpy').repeat(self, repeats, axis, total_repeat_length=total_repeat_length)

    def sort(self, axis=-1, *, kind=None, order=None, stable=True, descending=False):
        return _upper('numpy').sort(self, axis, kind=kind, order=order, stable=stable, descending=descending)

    def argsort(self, axis=-1, *, kind=None, order=None, stable=True, descending=False):
        return _upper('numpy').argsort(self, axis, kind=kind, order=order, stable=stable,
                           descending=descending)

    def any(self, axis=None, out=None, keepdims=False):
        _check_reduce_args("any", None, out)
        return _ew().any(self, axis=axis, keepdims=keepdims)

    def all(self, axis=None, out=None, keepdims=False):
        _check_reduce_args("all", None, out)
        return _ew().all(self, axis=axis, keepdims=keepdims)


def _check_reduce_args(name, dtype, out):
    if out is not None:
        raise TypeError(f"{name}: out= is not supported (Arrays are immutable)")


def reduce_operand(name, x, dtype, out):
    """The operand of ``sum`` / ``mean`` with jnp's ``dtype=``: ``x`` converted to ``dtype``
    first (the reduction accumulates in it, as jnp's does), on its devices."""
    _check_reduce_args(name, dtype, out)
    if dtype is None:
        return x
    dt = _dtypes.canonicalize(dtype)
    if np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype) == dt:
        return x
    ShapeDtypeStruct = _upper('_abstract').ShapeDtypeStruct
    if isinstance(x, ShapeDtypeStruct):
        return ShapeDtypeStruct(x.shape, dt, x.sharding)
    return _ops().astype(x, dt)
