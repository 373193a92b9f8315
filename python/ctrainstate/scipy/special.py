"""``ctrainstate.scipy.special``: ``jax.scipy.special``'s ``erf`` and ``erfc`` on (sharded)
Arrays, differentiable; a bfloat16 / float16 Array is computed in float32 and rounded once.
Each backend's libm computes them (glibc on CPUs, CUDA's device math on GPUs: within 2 ulp of
the correctly rounded value, so CPU and GPU bits may differ by an ulp or two).

>>> import numpy as np
>>> from ctrainstate.scipy.special import erf
>>> [round(float(v), 6) for v in np.asarray(erf(np.array([0.0, 1.0], np.float32)))]
[0.0, 0.842701]
"""
from .._src.ops.ops import erf, erfc  # noqa: F401

__all__ = ["erf", "erfc"]
