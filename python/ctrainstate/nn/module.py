"""A small Flax-style Module system (mirror of ``flax.linen.Module``).

Modules are dataclasses: attributes are fields, ``name=`` is a keyword field.
Submodules are created in ``setup()`` (named after the attribute) or inside an
``@compact`` method (named ``ClassName_N`` in call order, or by ``name=``).
``init(key, *args)`` returns the variables (``{'params': ..., 'params_axes':
...}``); ``apply(variables, *args, rngs=None, mutable=False)`` runs the model.

Parameter keys are derived exactly as Flax derives them: each scope keeps a
counter per RNG stream, and ``make_rng`` folds the SHA-1 hash of ``(*scope_path,
count)`` into the stream's root key — so ``Dense(3).init(key, x)`` gives the same
kernel as ``flax.linen.Dense(3).init(key, x)``.

Born sharded: inside ``with mesh, axis_rules(rules):``, parameters declared
with ``param_with_axes`` (or boxed with ``with_logical_partitioning``) are
created directly as sharded Arrays by the initializers of
``ctrainstate.nn.initializers`` (each device generating only its block); other
parameters are replicated over the mesh. Outside a mesh they live on the
default device.

>>> import numpy as np, ctrainstate as cts
>>> from ctrainstate import nn, random
>>> class MLP(nn.Module):
...     hidden: int
...     @nn.compact
...     def __call__(self, x):
...         x = nn.relu(nn.Dense(self.hidden)(x))
...         return nn.Dense(1)(x)
>>> variables = MLP(4).init(random.PRNGKey(0), np.ones((2, 3), np.float32))
>>> sorted(variables['params'])
['Dense_0', 'Dense_1']
>>> MLP(4).apply(variables, np.ones((2, 3), np.float32)).shape
(2, 1)
"""
from .._src.nn.module import *  # noqa: F401,F403
from .._src.nn.module import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
