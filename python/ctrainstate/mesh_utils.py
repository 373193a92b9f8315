"""Helpers to build device meshes (mirror of ``jax.experimental.mesh_utils``)."""
from ._src.array.mesh_utils import *  # noqa: F401,F403
from ._src.array.mesh_utils import __all__  # noqa: F401
# names the module had outside __all__, kept importable
from ._src.array.mesh_utils import (Device, Mesh)  # noqa: F401

from ._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
