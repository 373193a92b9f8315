"""Helpers for ports of HuggingFace Flax examples (model-parallel regex partition rules).

>>> from ctrainstate.hf import partitions
>>> partitions.match(('ln_f', 'scale'), ('transformer', 'ln_f', 'scale'))
True
"""
from . import partitions

__all__ = ['partitions']
