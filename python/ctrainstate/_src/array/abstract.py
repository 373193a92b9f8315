"""Abstract evaluation: :class:`ShapeDtypeStruct` and :func:`eval_shape`.

``eval_shape(fn, *args)`` runs ``fn`` with every array replaced by a
``ShapeDtypeStruct`` and every array *creation* (initializers, samplers,
``device_put``, optimizer state) answered with one, so nothing is allocated on
any device. Ops propagate shapes; parameters created under ``with mesh,
axis_rules(...)`` carry the sharding they would be born with.

>>> import numpy as np, ctrainstate as cts
>>> from ctrainstate import nn, random
>>> shapes = cts.eval_shape(nn.Dense(3).init, random.PRNGKey(0), np.ones((2, 5), np.float32))
>>> shapes['params']['kernel']
ShapeDtypeStruct(shape=(5, 3), dtype=float32)
"""
from __future__ import annotations
from ..base.hooks import provide as _provide
_provide('_abstract', __name__)   # lower layers call into this module through _hooks.upper

import numpy as np

from .operators import OperatorsMixin
from ..base.trace_state import Depth
from ..base.tree_util import register_leaf_type
from ..base import dtypes as _dtypes
from ..base.trace_state import jit_scope
from ..base.tree_util import tree_map
from ..base.hooks import upper as _upper

__all__ = ["ShapeDtypeStruct", "eval_shape", "is_abstract"]


class ShapeDtypeStruct(OperatorsMixin):
    """A shape, a dtype and (optionally) a sharding — an array without data."""

    __slots__ = ("shape", "dtype", "sharding")
    __array_ufunc__ = None

    def __init__(self, shape, dtype, sharding=None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.sharding = sharding

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))

    def __eq__(self, other):
        # two structs compare as descriptions (jax's ShapeDtypeStruct equality); against a
        # number or an array, as the array op it stands for under eval_shape (a bool struct)
        if isinstance(other, ShapeDtypeStruct) or other is None or isinstance(other, str):
            return (isinstance(other, ShapeDtypeStruct) and self.shape == other.shape
                    and self.dtype == other.dtype and self.sharding == other.sharding)
        return _upper('_elementwise').equal(self, other)

    def __ne__(self, other):
        if isinstance(other, ShapeDtypeStruct) or other is None or isinstance(other, str):
            return not self.__eq__(other)
        return _upper('_elementwise').not_equal(self, other)

    def __lt__(self, other):
        return _upper('_elementwise').less(self, other)

    def __le__(self, other):
        return _upper('_elementwise').less_equal(self, other)

    def __gt__(self, other):
        return _upper('_elementwise').greater(self, other)

    def __ge__(self, other):
        return _upper('_elementwise').greater_equal(self, other)

    def __hash__(self):
        return hash((self.shape, self.dtype.str))

    def __repr__(self):
        s = f", sharding={self.sharding!r}" if self.sharding is not None else ""
        return f"ShapeDtypeStruct(shape={self.shape}, dtype={self.dtype}{s})"

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d ShapeDtypeStruct")
        return self.shape[0]

    def __getitem__(self, idx):
        return _upper('_slicing').getitem(self, idx)

    @property
    def at(self):
        return _upper('_slicing')._IndexUpdateHelper(self)

    # the Array methods a model's __call__ uses, so eval_shape(model.init, ...) runs it
    def astype(self, dtype):
        """The struct of ``x.astype(dtype)`` (as the Array method, under eval_shape)."""
        return _upper('numpy').astype(self, dtype)

    def copy(self):
        return ShapeDtypeStruct(self.shape, self.dtype, self.sharding)

    @property
    def nbytes(self):
        return self.size * self.dtype.itemsize

    def block_until_ready(self):
        return self


register_leaf_type(ShapeDtypeStruct)


_abstract = Depth()


def is_abstract() -> bool:
    """True inside :func:`eval_shape`: array creation returns ShapeDtypeStructs."""
    return _abstract.active()


def abstract_mode():
    """The block in which array creation returns ShapeDtypeStructs (per thread; nests)."""
    return _abstract.scope()


def to_abstract(x):
    """ShapeDtypeStruct of an array-like leaf (others unchanged)."""
    Array = _upper('array').Array
    if isinstance(x, ShapeDtypeStruct):
        return x
    if isinstance(x, Array):
        return ShapeDtypeStruct(x.shape, x.dtype, x.sharding)
    if isinstance(x, (np.ndarray, np.generic)):
        dt = x.dtype
        try:
            dt = _dtypes.canonicalize(dt)
        except TypeError:
            pass
        return ShapeDtypeStruct(x.shape, dt)
    return x


def eval_shape(fn, *args, **kwargs):
    """Shapes, dtypes (and shardings) of ``fn(*args, **kwargs)``'s outputs, allocating nothing.

    Array arguments become ShapeDtypeStructs; PRNG keys (uint32[2]) stay concrete
    so that code deriving keys runs unchanged. Python scalars returned by ``fn`` become
    0-d ShapeDtypeStructs as jax's tracers do (int -> int32, float -> float32,
    bool -> bool), e.g. ``TrainState.create``'s ``step=0``.
    """

    def conv(x):
        if isinstance(x, np.ndarray) and x.dtype == np.uint32 and x.shape == (2,):
            return x  # a PRNG key
        return to_abstract(x)

    def out_leaf(x):
        # Python scalars in the output are traced values in jax: 0-d structs with jax's
        # default dtypes (so TrainState.step, the int 0, gets a spec P() as in Flax)
        if isinstance(x, bool):
            return ShapeDtypeStruct((), np.dtype(np.bool_))
        if isinstance(x, int):
            return ShapeDtypeStruct((), np.dtype(np.int32))
        if isinstance(x, float):
            return ShapeDtypeStruct((), np.dtype(np.float32))
        if isinstance(x, complex):
            return ShapeDtypeStruct((), np.dtype(np.complex64))
        return to_abstract(x)

    args = tree_map(conv, args)
    kwargs = tree_map(conv, kwargs)
    with abstract_mode(), jit_scope():   # jax's eval_shape traces as jit does
        out = fn(*args, **kwargs)
    return tree_map(out_leaf, out)
