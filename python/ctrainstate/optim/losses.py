"""optax's losses (``optax.losses``), as ctrainstate.numpy compositions: they run on
sharded Arrays (reductions over sharded dims end in all-reduces) and are differentiable
with ``ctrainstate.grad``. Formulas, argument names and defaults are optax 0.2.8's; where
optax uses a stable formula (``log_sigmoid``, ``logsumexp`` with weights, a custom JVP)
the same formula, and so the same gradient, is used here.

16-bit float inputs are computed in float32 and the loss rounded once to their dtype (the
``ctrainstate._src.ops.ops`` dtype policy); optax's sigmoid losses cast the labels to the logits'
dtype first, and so do these.

Differences from optax, all on inputs optax silently accepts: ``huber_loss``, ``log_cosh``
and ``hinge_loss`` require ``targets`` of the predictions' shape (as optax's
``squared_error`` and ``perceptron_loss`` do; a ValueError instead of a broadcast);
``multiclass_*`` labels must be integers of ``scores.shape[:-1]`` in ``[0, classes)``;
``where=`` is not supported (NotImplementedError, as ``softmax_cross_entropy``'s).

>>> import numpy as np, ctrainstate.optim as optim
>>> np.asarray(optim.losses.huber_loss(np.array([0.5, 3.0], np.float32),
...                                    np.zeros(2, np.float32))).tolist()
[0.125, 2.5]
"""
from .._src.optim.losses import *  # noqa: F401,F403
from .._src.optim.losses import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
