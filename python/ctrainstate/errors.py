"""Errors ctrainstate raises with the names of ``jax.errors`` (so ``except`` clauses of ported
code keep working).

``ConcretizationTypeError``: a value traced by :func:`ctrainstate.jit` was read on the host —
``float(x)``, ``int(x)``, ``bool(x)`` or ``if x:``, ``np.asarray(x)``, printing — while the
function was being traced. Its value is not known then (it is computed from the function's
arguments at each call). Mark the argument static (``static_argnums`` / ``static_argnames``),
compute with ops instead of Python control flow (``cnp.where``, ``lax.cond``,
``lax.fori_loop``), or read the value outside the jitted function.

>>> import ctrainstate as cts, ctrainstate.numpy as cnp, numpy as np
>>> @cts.jit
... def f(x):
...     return x * 2 if float(cnp.sum(x)) > 0 else x
>>> try:
...     f(np.ones(3, np.float32))
... except cts.errors.ConcretizationTypeError as e:
...     print(type(e).__name__, isinstance(e, TypeError))
ConcretizationTypeError True
"""
from ._C import ConcretizationTypeError, DonatedBufferError, ResourceExhaustedError

__all__ = ["ConcretizationTypeError", "DonatedBufferError", "ResourceExhaustedError"]
