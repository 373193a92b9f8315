"""t5x's optimizer layer (mirror of ``t5x.optimizers``) over :mod:`ctrainstate.optim`.

``OptimizerDef`` / ``Optimizer`` / ``OptimizerState`` are the legacy flax.optim
interface t5x's ``FlaxOptimTrainState`` drives. ``OptaxWrapper(tx)`` adapts any
ctrainstate.optim transformation; ``adam``, ``adamw``, ``sgd``, ... are the
wrapped constructors. ``derive_logical_axes`` gives the optimizer state the
logical axes of the params it tracks, so optimizer state is sharded exactly like
the params (:func:`derive_optax_logical_axes`; no per-optimizer tree surgery).

As in t5x, ``OptaxWrapper.apply_gradient`` ignores the ``learning_rate`` passed to
it: the rate lives in the optax transformation (a schedule). A fusable
transformation runs ctrainstate's fused kernel in place, donating the old
params and state (what t5x's ``donate_argnums=(0,)`` train step does).

>>> import numpy as np
>>> from ctrainstate.t5x import optimizers
>>> opt = optimizers.sgd(0.5).create({'w': np.ones(2, np.float32)})
>>> opt = opt.apply_gradient({'w': np.ones(2, np.float32)}, learning_rate=123.0)
>>> int(opt.state.step), np.asarray(opt.target['w']).tolist()
(1, [0.5, 0.5])
"""
from .._src.ports.t5x.optimizers import *  # noqa: F401,F403
from .._src.ports.t5x.optimizers import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
