"""dtype casts of sharded params, block by block (HF ``model.to_bf16(params)``/``to_fp32``).

Each device converts its own block into a new buffer on the same device (the core's
convert kernel, :func:`ctrainstate.numpy.astype`), so no device ever holds more than its
own block and nothing goes through the host. Arrays keep their shardings; numpy leaves
are cast on the host.

>>> import numpy as np, ctrainstate as cts
>>> from ctrainstate.hf.cast import to_bf16
>>> x = cts.device_put(np.arange(4, dtype=np.float32))
>>> y = to_bf16({'w': x})['w']
>>> str(y.dtype), y.sharding == x.sharding
('bfloat16', True)
"""
from .._src.ports.hf.cast import *  # noqa: F401,F403
from .._src.ports.hf.cast import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
