"""``jax.experimental.pjit``: :func:`ctrainstate.pjit` (legacy ``in_axis_resources`` /
``out_axis_resources`` names accepted) and ``with_sharding_constraint``.

>>> import numpy as np
>>> from ctrainstate.experimental.pjit import pjit
>>> pjit(lambda a: a * 2)(np.float32([1])).tolist()
[2.0]
"""
from .._src.jit.jit import pjit
from .._src.numpy_lax.lax import with_sharding_constraint

__all__ = ["pjit", "with_sharding_constraint"]
