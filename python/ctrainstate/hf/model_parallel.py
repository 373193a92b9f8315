"""run_clm_mp-style model parallelism: specs for ``(params, opt_state)`` and train states.

HF's run_clm_mp.py derives the optimizer-state spec by hand (every dict subtree
gets the whole param spec, everything else None — "very specific to adamw").
Here the spec of any optax-structured state is derived from the param specs:
each state subtree shaped like the params gets the param specs, counters and
empty states get None (see :func:`ctrainstate.t5x.optimizers.derive_optax_logical_axes`).

>>> import numpy as np, ctrainstate.optim as optim
>>> from ctrainstate import P
>>> from ctrainstate.hf.model_parallel import opt_state_spec
>>> params = {'w': np.zeros((8, 2), np.float32)}
>>> opt_state_spec(optim.adamw(1e-3).init(params), params, {'w': P('mp', None)})
(ScaleByAdamState(count=None, mu={'w': PartitionSpec('mp', None)}, nu={'w': PartitionSpec('mp', None)}), None, None)
"""
from .._src.ports.hf.model_parallel import *  # noqa: F401,F403
from .._src.ports.hf.model_parallel import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
