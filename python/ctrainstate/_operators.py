"""Array operators (``+ - * / @ ** -``, ``.T``, ``.reshape``, ``.sum``, ``.mean``) mapped to
``ctrainstate.numpy``, shared by :class:`~ctrainstate.Array` and
:class:`~ctrainstate.ShapeDtypeStruct` (whose ops follow the shape rules)."""
from __future__ import annotations


def _ops():
    from . import _ops
    return _ops


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

    def __pow__(self, p):
        return _ops().square(self) if p == 2 else _ops().power(self, p)

    @property
    def T(self):
        return _ops().transpose(self)

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = shape[0]
        return _ops().reshape(self, shape)

    def sum(self, axis=None, keepdims=False):
        return _ops().sum(self, axis=axis, keepdims=keepdims)

    def mean(self, axis=None, keepdims=False):
        return _ops().mean(self, axis=axis, keepdims=keepdims)
