"""Optimizers with optax's names, arguments, defaults and state structure.

>>> import numpy as np, ctrainstate.optim as optim
>>> tx = optim.adamw(1e-3, weight_decay=0.01)
>>> [type(s).__name__ for s in tx.init({'w': np.zeros(2, np.float32)})]
['ScaleByAdamState', 'EmptyState', 'EmptyState']
"""
from .._src.optim.alias import *  # noqa: F401,F403
from .._src.optim.alias import __all__  # noqa: F401
# names the module had outside __all__, kept importable
from .._src.optim.alias import (MaskOrFn, adadelta, adan, novograd, optimistic_adam,
                                optimistic_gradient_descent, rprop)  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
