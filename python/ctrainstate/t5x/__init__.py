"""Ports of t5x's partitioner, train states and optimizers (``from ctrainstate.t5x import ...``).

>>> from ctrainstate.t5x import partitioning, train_state, optimizers, adafactor
>>> partitioning.PjitPartitioner(num_partitions=1).logical_axis_rules[0]
('batch', 'data')
"""
from . import serialization, optimizers, adafactor, train_state, partitioning, utils

__all__ = ['adafactor', 'optimizers', 'partitioning', 'serialization', 'train_state', 'utils']
