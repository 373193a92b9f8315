"""optax's constraining transforms (optax.transforms._constraining): ``keep_params_nonnegative``
and ``zero_nans``, with optax's states. Not fused: elementwise ctrainstate.numpy ops per
leaf through ``tx.update`` (sharded leaves stay sharded).

>>> import numpy as np, ctrainstate.optim as optim
>>> u, st = optim.zero_nans().update({'w': np.array([1., np.nan], np.float32)},
...                                  optim.zero_nans().init({'w': np.zeros(2, np.float32)}))
>>> np.asarray(u['w']).tolist(), bool(st.found_nan['w'])
([1.0, 0.0], True)
"""
from .._src.optim.constraining import *  # noqa: F401,F403
from .._src.optim.constraining import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
