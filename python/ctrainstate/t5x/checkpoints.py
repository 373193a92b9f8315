"""t5x's ``checkpoints`` module names over :mod:`ctrainstate.checkpoint`
(``from ctrainstate.t5x import checkpoints; checkpoints.Checkpointer(...)``).

>>> from ctrainstate.t5x import checkpoints
>>> checkpoints.Checkpointer.__name__
'T5xCheckpointer'
"""
from .._src.checkpoint.manager import T5xCheckpointer as Checkpointer
from .._src.checkpoint.manager import available_steps, latest_checkpoint

__all__ = ["Checkpointer", "latest_checkpoint", "available_steps"]
