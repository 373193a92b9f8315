"""HuggingFace Flax example helpers: the dropout-rng ``TrainState`` of run_clm_flax.py and
flax's pmap-style helpers (``replicate``, ``unreplicate``, ``shard``, ``shard_prng_key``,
``onehot``, ``get_metrics``, ``stack_forest``).

``replicate(tree)`` puts one copy of every leaf on each local device, as a
leading axis of size ``local_device_count`` sharded over a 1-D ``('batch',)``
mesh (pmap's layout: each device holds exactly its copy). ``unreplicate`` takes
copy 0 from device 0 without gathering the others.

>>> import numpy as np, ctrainstate as cts
>>> from ctrainstate.hf import train_state as hts
>>> n = cts.local_device_count()
>>> r = hts.replicate({'w': np.ones(3, np.float32)})
>>> r['w'].shape == (n, 3), np.asarray(hts.unreplicate(r)['w']).tolist()
(True, [1.0, 1.0, 1.0])
>>> hts.shard(np.zeros((2 * n, 5))).shape == (n, 2, 5)
True
"""
from .._src.ports.hf.train_state import *  # noqa: F401,F403
from .._src.ports.hf.train_state import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
