"""optax's helpers outside the transforms: losses (``l2_loss``, ``squared_error``,
``softmax_cross_entropy``, ``softmax_cross_entropy_with_integer_labels``),
``global_norm``, target-network updates (``incremental_update``, ``periodic_update``),
user transforms from plain functions (``stateless``, ``stateless_with_tree_map``) and the
type aliases scripts annotate with (``Params``, ``Updates``, ``OptState``, ``Schedule``).

The losses and ``global_norm`` are ctrainstate.numpy ops: they run on sharded Arrays and
are differentiable. ``stateless`` transforms run through ``tx.update`` (not fused).

>>> import numpy as np, ctrainstate.optim as optim
>>> float(optim.global_norm({'a': np.full(4, 0.5, np.float32), 'b': np.ones(3, np.float32)}))
2.0
>>> np.asarray(optim.l2_loss(np.array([1.0, 3.0], np.float32), np.array([0.0, 1.0], np.float32))).tolist()
[0.5, 2.0]
"""
from .._src.optim.utils import *  # noqa: F401,F403
from .._src.optim.utils import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
