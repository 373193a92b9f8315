"""``nn.Dropout`` (mirror of ``flax.linen.Dropout``).

The mask is Flax's: ``bernoulli(make_rng('dropout'), 1 - rate, shape)``, i.e. a uniform
draw below the keep probability, so the same key drops the same elements as Flax. Kept
elements are scaled by ``1 / (1 - rate)``; dropped ones are exactly 0, as Flax's
``lax.select`` makes them, even where the input is inf or NaN. On a sharded Array each device draws only its
own block of the mask (every element is a function of (key, global index), so the mask
is the same on any mesh); the mask is a constant for autodiff.

>>> import numpy as np
>>> from ctrainstate import nn, random
>>> d = nn.Dropout(0.5)
>>> y = d.apply({}, np.ones((2, 4), np.float32), deterministic=False,
...             rngs={'dropout': random.PRNGKey(0)})
>>> sorted(set(np.asarray(y).ravel().tolist())) in ([0.0, 2.0], [2.0], [0.0])
True
>>> np.asarray(d.apply({}, np.ones(3, np.float32), deterministic=True)).tolist()
[1.0, 1.0, 1.0]
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .._src.base import dtypes as _dtypes
from .._src.ops import ops as _ops
from .. import random as _random
from .._src.array.array import Array
from .._src.array.sharding import NamedSharding, PartitionSpec
from .._src.nn.module import Module, compact
from .._src.numpy_lax import numpy as cnp
from .._src.array.abstract import ShapeDtypeStruct

_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), _dtypes.bfloat16, np.dtype(np.float64))

__all__ = ["Dropout", "merge_param"]


def merge_param(name: str, a, b):
    """The one of ``a`` (module attribute) and ``b`` (call argument) that is not None
    (flax.linen.module.merge_param): both or neither is an error."""
    if a is None and b is None:
        raise ValueError(f'Parameter "{name}" must be passed to the constructor or at call '
                         f'time.')
    if a is not None and b is not None:
        raise ValueError(f'Parameter "{name}" was passed to the constructor and at call time. '
                         f'Should be passed just once.')
    return a if b is None else b


class Dropout(Module):
    """Zero each element with probability ``rate`` and scale the rest by ``1/(1-rate)``.

    ``deterministic`` (here or at call time, not both) turns it off; ``broadcast_dims``
    share one mask value along those dimensions; the key comes from the
    ``rng_collection`` stream (``rngs={'dropout': key}``) or the ``rng`` argument.
    """

    rate: float
    broadcast_dims: Sequence[int] = ()
    deterministic: Any = None
    rng_collection: str = "dropout"

    @compact
    def __call__(self, inputs, deterministic: bool | None = None, rng=None):
        deterministic = merge_param("deterministic", self.deterministic, deterministic)
        if self.rate == 0.0 or deterministic:
            return inputs
        if isinstance(inputs, ShapeDtypeStruct):  # eval_shape / a scan's first trace
            if self.rate != 1.0 and rng is None:
                self.make_rng(self.rng_collection)  # the key is drawn, as in Flax's trace
            return inputs
        if self.rate == 1.0:
            # Flax: jnp.zeros_like(inputs) (zeros even where inputs are inf/NaN; no gradient)
            x = inputs if isinstance(inputs, Array) else _host_input(inputs)
            return _ops.zeros_like(x)
        keep = 1.0 - float(self.rate)
        x = inputs if isinstance(inputs, Array) else _host_input(inputs)
        if x.dtype not in _FLOATS:
            # Flax fails here too, in lax.select ("requires arguments to have the same dtypes,
            # got int32, float32"); kept / keep of integers is no integer array
            raise TypeError(f"Dropout: inputs must be a floating-point array, got {x.dtype} "
                            f"(cast them first, e.g. x.astype(jnp.float32))")
        if rng is None:
            rng = self.make_rng(self.rng_collection)
        shape = list(x.shape)
        for d in self.broadcast_dims:
            shape[d] = 1
        sharding = None
        if isinstance(x.sharding, NamedSharding):
            spec = list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))
            for d in self.broadcast_dims:
                spec[d] = None
            sharding = NamedSharding(x.sharding.mesh, PartitionSpec(*spec))
        # Flax: mask = uniform(rng, shape) < keep (jax.random.bernoulli), kept / keep
        u = _random.uniform(rng, tuple(shape), out_sharding=sharding)
        if not isinstance(u, Array):
            u = _ops._lift(u, _ops._place_of(x))
        keep_arr = _ops._lift(keep, _ops._place_of(u))
        mask = _ops._binary_raw(_ops.B_GT, keep_arr, u)       # 1.0 where u < keep, else 0.0
        # Flax: lax.select(mask, inputs / keep, zeros): a dropped element is exactly 0, even
        # where the input is inf or NaN (a select kernel, not a product with the mask); the
        # gradient is the same selection of g / keep
        return _ops._keep(_ops.divide(x, keep), mask)




def _host_input(inputs):
    """A host input placed with its own float dtype (bfloat16 / float16 kept, as Flax)."""
    return cnp.asarray(inputs)


from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
