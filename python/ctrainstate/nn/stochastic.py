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

from .. import _C, _ops
from .. import random as _random
from ..array import Array, _buffer_view
from ..sharding import NamedSharding, PartitionSpec
from .module import Module, compact

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
        if self.rate == 1.0:
            # Flax: jnp.zeros_like(inputs) (zeros even where inputs are inf/NaN; no gradient)
            x = inputs if isinstance(inputs, Array) else _ops._lift(inputs)
            return _ops.zeros_like(x)
        keep = 1.0 - float(self.rate)
        if rng is None:
            rng = self.make_rng(self.rng_collection)
        x = inputs if isinstance(inputs, Array) else _ops._lift(inputs)
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
        # Flax: lax.select(mask, inputs / keep, zeros): a dropped element is 0 even where the
        # input is inf or NaN (a product with the mask would give NaN there)
        out = _select_kept(_ops.divide(x, keep), mask)
        # d out / d x: the same selection of g / keep
        return _ops._record(out, (x,), lambda g: (_select_kept(_ops.divide(g, keep), mask),))


def _select_kept(v: Array, mask: Array) -> Array:
    """``lax.select(mask, v, 0)`` for a 0/1 ``mask`` broadcastable to ``v``, with no tape:
    exactly ``v`` where kept (inf and NaN included) and exactly 0 where dropped, whatever
    ``v`` is there; sharded like ``v``.

    The product ``v * mask`` (one kernel pass per device) is that wherever ``v`` is finite;
    only an inf or NaN dropped gives NaN (``inf * 0``). So one scalar, ``sum(v * 0)`` (NaN
    iff some element of ``v`` is not finite), decides: in the common case the product is the
    answer; otherwise each device's block is selected exactly on the host (a view of the
    buffer on CPU devices, a copy of the block on GPUs). No elementwise kernel can do it
    alone: they all keep a NaN (relu, maximum and minimum as jnp's) or keep only a bit (>)."""
    R = _ops._binary_raw
    place = _ops._place_of(v)
    out = R(_ops.B_MUL, v, mask)
    probe = _ops._reduce_raw(_ops._RED_SUM, R(_ops.B_MUL, v, _ops._lift(np.float32(0.0), place)),
                             tuple(range(v.ndim)))
    if np.isfinite(np.asarray(probe)).all():
        return out
    # the rare path: exact selection, block by block, on each device's own block
    norm = _ops._norm(v.sharding, v.ndim) if isinstance(v.sharding, NamedSharding) \
        else [()] * v.ndim
    keep_full = _ops._to(R(_ops.B_ADD, _ops.zeros_like(v), mask), place, norm)
    out = _ops._to(out, place, norm)
    shape = out._shard_shape
    zero = (0,) * len(shape)
    for (dev, ob, start, _), (vd, vb, vs, _), (kd, kb, ks, _) in zip(
            out._blocks, v._blocks, keep_full._blocks):
        if not (dev is vd is kd and start == vs == ks):
            raise RuntimeError("Dropout: internal error: the blocks of the input, the mask and "
                               "the output are not laid out alike")
        if dev.platform == "cpu":
            ov, vv, kv = (_buffer_view(b, shape, np.float32) for b in (ob, vb, kb))
            ov[...] = np.where(kv != 0, vv, np.float32(0.0))
        else:
            hv, hk = np.empty(shape, np.float32), np.empty(shape, np.float32)
            _C.copy_to_host(vb, hv, zero)
            _C.copy_to_host(kb, hk, zero)
            _C.copy_from_host(ob, np.ascontiguousarray(np.where(hk != 0, hv, np.float32(0.0))),
                              zero)
    return out
