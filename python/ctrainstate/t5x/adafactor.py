"""t5x's Adafactor (mirror of ``t5x.adafactor``): factorisation chosen by logical axis names.

``Adafactor(learning_rate, ..., logical_factor_rules={'embed': ROW, 'mlp': COLUMN, ...})``
is an ``OptimizerDef``. ``FlaxOptimTrainState.create`` calls ``set_param_axes``
with the params' logical axes, which turns the rules into a per-param
``factor_map`` (``{'dense/kernel': (COLUMN, ROW)}``). Each param keeps an
``_AdafactorParamState(v_row, v_col, v, m)``; unused entries are ``zeros((1,))``.
``derive_logical_axes`` gives ``v`` (when unfactored) and ``m`` (with momentum) the
param's axes, so they are sharded like the param; ``v_row``/``v_col`` are replicated.

The step runs per param on the host in float32 (factored means need the whole
array) and writes results back with each array's sharding.

>>> import numpy as np
>>> from ctrainstate.t5x.adafactor import Adafactor
>>> opt = Adafactor(0.1).create({'w': np.ones((2, 4), np.float32)})
>>> sorted(opt.state_dict()['state']['param_states']['w'])
['m', 'v', 'v_col', 'v_row']
"""
from .._src.ports.t5x.adafactor import *  # noqa: F401,F403
from .._src.ports.t5x.adafactor import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
