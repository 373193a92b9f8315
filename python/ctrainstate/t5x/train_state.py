"""t5x's train states (mirror of ``t5x.train_state``): ``FlaxOptimTrainState``, ``InferenceState``.

``FlaxOptimTrainState.create(optimizer_def, model_variables)`` splits the
variables of ``model.init``: ``params``, their ``params_axes`` (checked: every
param needs axis names), other ``<name>_axes`` collections, and the remaining
collections (``flax_mutables``). ``apply_gradient(grads, learning_rate,
flax_mutables=...)`` runs one optimizer step and — as in t5x — resets the
mutables to empty when they are not passed. As in t5x, the mutables, their axes and
the trees of ``as_logical_axes`` are ``FrozenDict`` objects; params keep the kind they
were given. ``as_logical_axes()`` is the same
state with logical ``PartitionSpec`` leaves, which ``PjitPartitioner.get_mesh_axes``
resolves to mesh specs.

>>> import numpy as np
>>> from ctrainstate.t5x import optimizers
>>> from ctrainstate.t5x.train_state import FlaxOptimTrainState
>>> s = FlaxOptimTrainState.create(optimizers.sgd(0.1), {'params': {'w': np.ones(2, np.float32)}})
>>> int(s.step), s.params_axes, s.flax_mutables
(0, None, FrozenDict({}))
"""
from .._src.ports.t5x.train_state import *  # noqa: F401,F403
from .._src.ports.t5x.train_state import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
