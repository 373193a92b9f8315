"""MultiSteps: gradient accumulation (optax.MultiSteps), with optax's state and semantics.

>>> import numpy as np, ctrainstate.optim as optim
>>> ms = optim.MultiSteps(optim.sgd(1.0), every_k_schedule=2)
>>> p = {'w': np.zeros(2, np.float32)}
>>> st = ms.init(p)
>>> u, st = ms.update({'w': np.full(2, 1.0, np.float32)}, st, p)   # accumulates, no step
>>> np.asarray(u['w']).tolist(), bool(ms.has_updated(st))
([0.0, 0.0], False)
>>> u, st = ms.update({'w': np.full(2, 3.0, np.float32)}, st, p)   # mean of 1 and 3, applied
>>> np.asarray(u['w']).tolist(), bool(ms.has_updated(st))
([-2.0, -2.0], True)
"""
from .._src.optim.wrappers import *  # noqa: F401,F403
from .._src.optim.wrappers import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
