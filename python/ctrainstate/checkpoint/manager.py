"""Checkpoint front ends with the names ported scripts use: orbax's ``CheckpointManager``,
``StandardCheckpointer`` and ``args``; ``flax.training.checkpoints``' ``save_checkpoint`` /
``restore_checkpoint`` / ``latest_checkpoint`` / ``AsyncManager``; t5x's ``Checkpointer``.
All of them write and read the directory format of :mod:`ctrainstate._src.checkpoint.store`.
"""
from .._src.checkpoint.manager import *  # noqa: F401,F403
from .._src.checkpoint.manager import __all__  # noqa: F401
# names the module had outside __all__, kept importable
from .._src.checkpoint.manager import T5xCheckpointer  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
