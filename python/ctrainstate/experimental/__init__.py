"""``jax.experimental``'s module paths that ported scripts import:
``ctrainstate.experimental.pjit`` (``pjit``), ``ctrainstate.experimental.mesh_utils``
(``create_device_mesh``) and ``ctrainstate.experimental.multihost_utils`` (``process_allgather``,
``sync_global_devices``, ``broadcast_one_to_all``).

>>> from ctrainstate.experimental import mesh_utils
>>> from ctrainstate.experimental.pjit import pjit
>>> mesh_utils.create_device_mesh((1,)).shape
(1,)
"""
from . import mesh_utils, multihost_utils, pjit

__all__ = ["mesh_utils", "multihost_utils", "pjit"]
