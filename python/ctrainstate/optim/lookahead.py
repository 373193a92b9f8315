"""optax's lookahead optimizer (optax.lookahead): fast params stepped by an inner optimizer,
slow params pulled toward them every ``sync_period`` steps. Not fused: the fast optimizer
runs through its own ``update`` (fused there when it is), the lookahead arithmetic is
elementwise ctrainstate.numpy ops per leaf.

>>> import numpy as np, ctrainstate.optim as optim
>>> opt = optim.lookahead(optim.sgd(0.5), sync_period=2, slow_step_size=0.5)
>>> params = optim.LookaheadParams.init_synced({'w': np.ones(2, np.float32)})
>>> state = opt.init(params)
>>> for _ in range(2):
...     updates, state = opt.update({'w': np.ones(2, np.float32)}, state, params)
...     params = optim.apply_updates(params, updates)
>>> np.asarray(params.fast['w']).tolist(), np.asarray(params.slow['w']).tolist()
([0.5, 0.5], [0.5, 0.5])
"""
from .._src.optim.lookahead import *  # noqa: F401,F403
from .._src.optim.lookahead import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
