"""optax's gradient transformations, with optax's names, arguments, states and numerics.

Elementwise transforms and the reductions (clip_by_global_norm,
scale_by_trust_ratio) are *fused*: in a chain they become stages of one C pass
per device (see :mod:`ctrainstate.optim.base`). So are the adafactor pieces
(scale_by_factored_rms, clip_by_block_rms, scale_by_param_block_rms): their
statistics are read-only passes before the fused pass, sharded like the params.

>>> import numpy as np, ctrainstate.optim as optim
>>> tx = optim.scale_by_adam()
>>> st = tx.init({'w': np.zeros(2, np.float32)})
>>> type(st).__name__, st._fields
('ScaleByAdamState', ('count', 'mu', 'nu'))
"""
from .._src.optim.transforms import *  # noqa: F401,F403
from .._src.optim.transforms import __all__  # noqa: F401
# names the module had outside __all__, kept importable
from .._src.optim.transforms import (ApplyEvery, ScaleByAdaDeltaState, ScaleByAdanState,
                                     ScaleByDistanceOverGradientsState, ScaleByNovogradState,
                                     ScaleByOptimisticGradientState, ScaleByRpropState, apply_every,
                                     centralize, device_put, normalize_by_update_norm,
                                     scale_by_adadelta, scale_by_adan,
                                     scale_by_distance_over_gradients, scale_by_novograd,
                                     scale_by_optimistic_gradient, scale_by_param_block_norm,
                                     scale_by_rprop, scale_by_sign)  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
