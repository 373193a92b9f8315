"""``jax.experimental.mesh_utils``: :func:`create_device_mesh` (the same function as
:func:`ctrainstate.mesh_utils.create_device_mesh`).

>>> from ctrainstate.experimental import mesh_utils
>>> from ctrainstate.sharding import Mesh
>>> Mesh(mesh_utils.create_device_mesh((1,)), ('data',)).shape['data']
1
"""
from .._src.array.mesh_utils import create_device_mesh

__all__ = ["create_device_mesh"]
