"""``jax.experimental``'s module paths that ported scripts import:
``ctrainstate.experimental.pjit`` (``pjit``) and ``ctrainstate.experimental.mesh_utils``
(``create_device_mesh``).

>>> from ctrainstate.experimental import mesh_utils
>>> from ctrainstate.experimental.pjit import pjit
>>> mesh_utils.create_device_mesh((1,)).shape
(1,)
"""
from . import mesh_utils, pjit

__all__ = ["mesh_utils", "pjit"]
