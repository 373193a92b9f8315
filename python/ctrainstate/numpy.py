"""``ctrainstate.numpy``: array ops on (sharded) Arrays, differentiable.

The names follow ``jax.numpy``. Operands may be Arrays, numpy arrays or Python
scalars (placed replicated on the Arrays' mesh). Sharding propagation, the
collectives it implies and the autodiff rules are described in
:mod:`ctrainstate._src.ops.ops`. Arithmetic is float32; bfloat16 / float16 Arrays follow jax's
dtype promotion and are computed in float32 and rounded once per op (``astype`` converts
on the devices). Comparisons (``equal``, ``greater``, ... and ``== < >`` on Arrays) return bool
Arrays; ``logical_*``, ``bitwise_*`` / ``& | ^ ~``, shifts, ``floor_divide`` / ``remainder``
(``// %``), ``isnan`` / ``isinf`` / ``isfinite``, ``any`` / ``all``, ``cumsum`` / ``cumprod`` (any dtype), and
``add`` / ``subtract`` / ``multiply`` / ``maximum`` / ``minimum`` / ``negative`` / ``abs`` /
``sum`` / ``max`` / ``min`` / ``where`` on int32 / uint32 / int16 / uint16 / int8 / uint8 /
bool Arrays compute in the operands' own (jax-promoted) dtype on each device's blocks, with
jax's results (:mod:`ctrainstate._src.ops.elementwise`).

>>> import numpy as np, ctrainstate as cts, ctrainstate.numpy as cnp
>>> x = cts.device_put(np.arange(6, dtype=np.float32).reshape(2, 3))
>>> np.asarray(cnp.sum(x * 2.0, axis=0)).tolist()
[6.0, 10.0, 14.0]
"""
from ._src.numpy_lax.numpy import *  # noqa: F401,F403
from ._src.numpy_lax.numpy import __all__  # noqa: F401
# names the module had outside __all__, kept importable
from ._src.numpy_lax.numpy import (astype, is_abstract, ShapeDtypeStruct, getitem, Array,
                                   check_python_ints, device_put, isclose, allclose, hstack,
                                   vstack, diff)  # noqa: F401
