"""Lifted scan and vmap (mirror of ``flax.linen.scan`` / ``flax.linen.vmap``).

ctrainstate runs eagerly, so a lifted transform is a Python loop over the scanned (mapped)
axis: each step runs a fresh clone of the target module on a scope that sees that step's
slice of the scanned variables and inputs, and the steps' outputs and new variables are
stacked. What is kept from Flax is everything observable:

* the class (``Scan<Name>`` / ``Vmap<Name>``, so auto names are ``ScanBlock_0``, ...) and the
  variable layout: collections in ``variable_axes`` are stacked along their axis, broadcast
  collections are shared, carried collections flow from step to step; collections that no
  filter names are invisible inside, as in Flax;
* the parameter values: ``split_rngs={'params': True}`` gives step ``i`` the key
  ``random.split(key, length)[i]`` of each split stream (streams that ``split_rngs`` does not
  name are not visible inside: ``make_rng`` falls back to ``'params'`` as in Flax), and the
  per-scope RNG counters advance as Flax's do -- Flax traces a scan body twice (once to find
  the loop-invariant broadcast variables, once for ``lax.scan``) and a vmap body once, and its
  counters keep counting across traces, so a ``Dense`` kernel in a scanned body is drawn with
  count 3, not 1. ctrainstate runs that first trace too (abstractly when it can, see
  :func:`scan`), so init gives the same values as ``flax.linen`` for the same key;
* gradients: the slices of a stacked Array are one tape node whose cotangent is the stack of
  the slices' cotangents, so ``value_and_grad`` reaches the stacked parameters and the scanned
  inputs (one stacked-size buffer, not one per step);
* boxed metadata: with ``metadata_params={nn.PARTITION_NAME: 'layers'}`` each
  :class:`~ctrainstate.nn.Partitioned` box of a stacked collection gets the axis inserted
  (``add_axis``) on the way out and checked and removed on the way in; a stacked value whose
  box resolves to a sharding under an active mesh is resharded to it (born sharded with the
  layer axis).

>>> import numpy as np, ctrainstate as cts
>>> from ctrainstate import nn, random
>>> class Block(nn.Module):
...     @nn.compact
...     def __call__(self, c, x):
...         return nn.tanh(nn.Dense(3)(c) + x), None
>>> Stack = nn.scan(Block, variable_axes={'params': 0}, split_rngs={'params': True},
...                 in_axes=0, length=4)
>>> Stack.__name__
'ScanBlock'
>>> c, xs = np.ones((2, 3), np.float32), np.zeros((4, 2, 3), np.float32)
>>> v = Stack().init(random.PRNGKey(0), c, xs)
>>> v['params']['Dense_0']['kernel'].shape
(4, 3, 3)
>>> out, ys = Stack().apply(v, c, xs)
>>> out.shape, ys
((2, 3), None)
"""
from .._src.nn.lifted import *  # noqa: F401,F403
from .._src.nn.lifted import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
