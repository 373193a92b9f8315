"""Lifted transforms (mirror of ``flax.linen.remat`` / ``flax.linen.checkpoint``).

``nn.remat(Block)`` is a Module class like ``Block`` (named ``CheckpointBlock``, so its
auto names are ``CheckpointBlock_0``, ... as in Flax) whose methods run under
:func:`ctrainstate.checkpoint`: inside ``value_and_grad`` none of the block's
activations are kept for the backward pass; they are recomputed there from the block's
inputs and parameters. Parameters, names and values are those of ``Block``.

>>> import numpy as np, ctrainstate as cts
>>> from ctrainstate import nn, random
>>> class MLP(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         h = nn.tanh(nn.remat(nn.Dense)(4)(x))
...         return nn.remat(nn.Dense)(2)(h)
>>> x = np.ones((3, 5), np.float32)
>>> v = MLP().init(random.PRNGKey(0), x)
>>> sorted(v['params'])
['CheckpointDense_0', 'CheckpointDense_1']
>>> g = cts.grad(lambda p: cts.numpy.sum(MLP().apply({'params': p}, x)))(v['params'])
>>> g['CheckpointDense_0']['kernel'].shape
(5, 4)
"""
from .._src.nn.transforms import *  # noqa: F401,F403
from .._src.nn.transforms import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
