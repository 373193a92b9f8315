"""The ``jax.lax`` names a sharded training script uses: ``with_sharding_constraint``,
``stop_gradient``, ``Precision`` (the ``precision=`` of matrix products: DEFAULT and HIGHEST
are float32 here, HIGH is TF32; see :mod:`ctrainstate._src.base.precision`), and ``dynamic_slice`` /
``dynamic_update_slice`` (a region at start indices known at run time, e.g. a decoding
cache's position; see :func:`dynamic_update_slice`), and the elementwise ``erf``, ``erfc``,
``log1p``, ``expm1``, ``floor``, ``ceil`` and ``sign`` (those of :mod:`ctrainstate.numpy`).

Control flow (``fori_loop``, ``while_loop``, ``cond``, ``switch``, ``scan``, ``map``) runs
eagerly on the host, differentiably, with jax's carry checks (:mod:`ctrainstate._src.numpy_lax.lax_control`).
The primitives (``add`` ... ``dot_general``, ``pad``, ``slice``, ``select``, ``reduce_*``,
``cum*``, ``sort``, ``top_k``, ...) keep lax's strictness: one dtype, no rank broadcasting,
non-negative axes, jax's error messages (:mod:`ctrainstate._src.numpy_lax.lax_ops`).

``with_sharding_constraint(x, shardings)`` reshards every Array of ``x`` to the given
sharding (eagerly: there is no compiler to hand a constraint to). ``shardings`` is a
``NamedSharding``, a ``SingleDeviceSharding``, a ``PartitionSpec`` (resolved against the
active ``with mesh:``), or a pytree of them that is a prefix of ``x``; anything else (a
bare ``Device``, a string) is a ``TypeError``, as in JAX. The reshard is differentiable: the cotangent goes
back to the input's sharding. numpy leaves are placed like Arrays.

>>> import numpy as np, ctrainstate as cts
>>> from ctrainstate.lax import with_sharding_constraint
>>> mesh = cts.make_mesh((1,), ('data',))
>>> y = with_sharding_constraint(np.ones((4, 2), np.float32), cts.NamedSharding(mesh, cts.P('data')))
>>> y.sharding.spec
PartitionSpec('data',)
"""
from ._src.numpy_lax.lax import *  # noqa: F401,F403
from ._src.numpy_lax.lax import __all__  # noqa: F401
# names the module had outside __all__, kept importable
from ._src.numpy_lax.lax import (ShapeDtypeStruct, Device, Array, device_put, NamedSharding,
                                 PartitionSpec, Sharding, get_mesh, is_abstract, one_axis,
                                 with_sharding)  # noqa: F401

from ._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
