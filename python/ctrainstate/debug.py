"""``jax.debug``'s host-side helpers. ctrainstate runs eagerly, so these run at once, in
program order: ``print`` formats its arguments (Arrays read to the host as numpy arrays, as
jax's ``debug.print`` shows them) with ``str.format`` and prints; ``callback`` calls a
function with the numpy values of its arguments. ``ordered=`` is accepted (every call here is
ordered). ``visualize_array_sharding`` / ``visualize_sharding`` print which devices hold
which block; ``inspect_array_sharding`` hands an Array's sharding to a callback.

>>> import numpy as np, ctrainstate as cts
>>> cts.debug.print("x = {x}", x=cts.device_put(np.float32([1, 2])))
x = [1. 2.]
"""
from ._src.debug.debug import *  # noqa: F401,F403
from ._src.debug.debug import __all__  # noqa: F401

from ._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
