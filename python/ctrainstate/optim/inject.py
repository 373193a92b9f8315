"""inject_hyperparams (optax.inject_hyperparams): hyper-parameters kept in the optimizer state,
where a training loop can read them (the current learning rate) or change them between steps.

>>> import numpy as np, ctrainstate.optim as optim
>>> tx = optim.inject_hyperparams(optim.adam)(learning_rate=optim.linear_schedule(0.1, 0.0, 10))
>>> st = tx.init({'w': np.ones(2, np.float32)})
>>> type(st).__name__, sorted(st.hyperparams)
('InjectStatefulHyperparamsState', ['b1', 'b2', 'eps', 'eps_root', 'learning_rate'])
>>> float(np.asarray(st.hyperparams['learning_rate']))
0.10000000149011612
"""
from .._src.optim.inject import *  # noqa: F401,F403
from .._src.optim.inject import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
