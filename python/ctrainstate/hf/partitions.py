"""Regex partition rules for parameter trees (HuggingFace ``model_parallel/partitions.py``).

A rule is ``(regex_tuple, spec)``. It matches a parameter whose flattened key
path contains a window of consecutive keys that the regexes match *entirely*,
one regex per key. :func:`set_partitions` gives every leaf the spec of the
first matching rule and raises a ``ValueError`` naming the paths that no rule
matches. Specs use the mesh axes ``('dp', 'mp')`` of the original scripts.

>>> import numpy as np
>>> from ctrainstate.hf.partitions import set_partitions, gpt_neo_rules
>>> params = {'transformer': {'wte': {'embedding': np.zeros((8, 4))},
...                           'ln_f': {'scale': np.ones(4), 'bias': np.zeros(4)}}}
>>> set_partitions(params, gpt_neo_rules())
{'transformer': {'wte': {'embedding': PartitionSpec('mp', None)}, 'ln_f': {'scale': None, 'bias': None}}}
"""
from .._src.partitioning.rules import Rules, gpt_neo_rules, gptj_rules, match, set_partitions

__all__ = ['match', 'set_partitions', 'gpt_neo_rules', 'gptj_rules', 'Rules']

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
