"""t5x's ``TrainStateInitializer``: the abstract state, its mesh axes, and a state born sharded.

>>> import numpy as np
>>> from ctrainstate.t5x import optimizers, partitioning, utils
>>> init_fn = lambda rng, input_shapes, input_types=None: {'params': {'w': np.ones(4, np.float32)}}
>>> p = partitioning.PjitPartitioner(num_partitions=1)
>>> i = utils.TrainStateInitializer(optimizers.sgd(0.1), init_fn, {}, p)
>>> i.train_state_axes.params
FrozenDict({
    w: None,
})
"""
from .._src.ports.t5x.utils import *  # noqa: F401,F403
from .._src.ports.t5x.utils import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
