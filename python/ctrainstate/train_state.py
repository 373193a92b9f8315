"""TrainState (mirror of ``flax.training.train_state.TrainState``) and a small ``struct``.

``TrainState`` is a frozen dataclass registered as a pytree: children
``step, params, opt_state`` (+ data fields of subclasses), static ``apply_fn``
and ``tx``. ``apply_gradients`` runs the optimizer as one fused C pass per
device over all leaves, with the GIL released, **in place**: params and
optimizer-state buffers are updated where they are (what t5x gets from
``donate_argnums``), the returned state owns them, and the Arrays of the old
state are marked *donated* — using them afterwards raises
``ctrainstate.DonatedBufferError``. Keep only the returned state::

    state = state.apply_gradients(grads=grads)   # old `state` is now donated

>>> import numpy as np, ctrainstate.optim as optim
>>> from ctrainstate.train_state import TrainState
>>> s = TrainState.create(apply_fn=None, params={'w': np.ones(2, np.float32)}, tx=optim.sgd(0.5))
>>> s2 = s.apply_gradients(grads={'w': np.ones(2, np.float32)})
>>> s2.step, np.asarray(s2.params['w']).tolist()
(1, [0.5, 0.5])
>>> try:
...     np.asarray(s.params['w'])
... except Exception as e:
...     print(type(e).__name__)
DonatedBufferError
"""
from ._src.train_state.train_state import *  # noqa: F401,F403
from ._src.train_state.train_state import __all__  # noqa: F401

from ._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
