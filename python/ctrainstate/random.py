"""``ctrainstate.random``: jax.random's Threefry PRNG, sharded.

Mirrors ``jax.random`` with ``jax_threefry_partitionable=True`` (JAX's default):
for the same key and shape, :func:`bits`, :func:`uniform`, :func:`normal`,
:func:`truncated_normal` and :func:`bernoulli` return the same values as JAX on
CPU (bit-identical; the C core reproduces XLA's float32 ``erf_inv``/``log1p``
polynomials). Keys are raw ``uint32[2]`` arrays (JAX's legacy layout), so a
``jax.random.PRNGKey`` can be passed in and a ctrainstate key handed to JAX.

:func:`gumbel` (whose logs are XLA's float32 log, reproduced in the C core), and the
:func:`categorical` and :func:`choice` built on it, :func:`randint` and :func:`permutation`,
return JAX's values too.

:func:`exponential`, :func:`laplace`, :func:`logistic`, :func:`cauchy`, :func:`rademacher`,
:func:`lognormal`, :func:`maxwell`, :func:`double_sided_maxwell`, :func:`weibull_min`,
:func:`pareto`, :func:`rayleigh`, :func:`wald`, :func:`triangular`, :func:`geometric`,
:func:`multivariate_normal` and :func:`orthogonal` (``_src/random/dist.py``) apply JAX's formulas
to these draws: bit-identical where the formula has only correctly rounded ops and log/log1p,
within a few ulp where it uses exp, tan or pow (each docstring says which).

:func:`gamma`, :func:`loggamma`, :func:`beta`, :func:`dirichlet`, :func:`chisquare`, :func:`f`,
:func:`t`, :func:`generalized_normal` and :func:`ball` (``_src/random/gamma.py``) run JAX's
Marsaglia-Tsang rejection loop with JAX's per-element keys: float16 / bfloat16 bit-identical,
float32 bit-identical except where XLA's CPU-specific ``rsqrt`` estimate differs from the
correctly rounded one (within a few 1e-6 relative there; the module docstring has the table).
Differentiating through their parameters raises (JAX's implicit-reparameterisation gradient is
not implemented).

:func:`poisson`, :func:`binomial` and :func:`multinomial` (``_src/random/discrete.py``) run JAX's
Knuth / transformed-rejection / inversion loops with JAX's key splits and round counts: the
same integers as JAX on CPUs with FMA. :func:`clone`, :func:`key_impl` and :func:`key_dtype`
answer for ctrainstate's raw keys.

Every element is a pure function of (key, global index). With
``out_sharding=NamedSharding(...)`` each device computes only its own block,
directly in its buffer, and the result is a sharded :class:`ctrainstate.Array`
with the same bits on any mesh. Without ``out_sharding`` the result is a host
``numpy.ndarray``.

>>> import numpy as np
>>> from ctrainstate import random
>>> k = random.PRNGKey(0)
>>> k1, k2 = random.split(k)
>>> x = random.normal(k1, (2, 3))
>>> x.shape, str(x.dtype)
((2, 3), 'float32')
"""
from ._src.random.core import *  # noqa: F401,F403
from ._src.random.core import __all__ as _core_all

__all__ = list(_core_all)

# --- more samplers (transforms of uniform / normal draws; see _src/random/dist.py) --------------

from ._src.random.dist import (cauchy, double_sided_maxwell, exponential, geometric, laplace,
                               logistic, lognormal, maxwell, multivariate_normal, orthogonal,
                               pareto, rademacher, rayleigh, triangular, wald, weibull_min)

__all__ += [
    "exponential", "laplace", "logistic", "cauchy", "rademacher", "lognormal", "maxwell",
    "double_sided_maxwell", "weibull_min", "pareto", "rayleigh", "wald", "triangular",
    "geometric", "multivariate_normal", "orthogonal",
]

# --- the gamma family (Marsaglia-Tsang rejection per element; see _src/random/gamma.py) ---------

from ._src.random.gamma import (ball, beta, chisquare, dirichlet, f, gamma, generalized_normal,
                                loggamma, t)

__all__ += ["gamma", "loggamma", "beta", "dirichlet", "chisquare", "f", "t",
            "generalized_normal", "ball"]

# --- discrete rejection samplers and key helpers (see _src/random/discrete.py) -------------------

from ._src.random.discrete import binomial, clone, key_dtype, key_impl, multinomial, poisson

__all__ += ["poisson", "binomial", "multinomial", "clone", "key_impl", "key_dtype"]


from ._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
