"""Nested-dict helpers (mirror of ``flax.traverse_util``): ``flatten_dict``,
``unflatten_dict``, ``path_aware_map``, the ``empty_node`` marker and
``ModelParamTraversal`` (the param selector t5x's ``MultiOptimizer`` takes).

HuggingFace's ``decay_mask_fn`` (no weight decay on biases and LayerNorm scales) ports
unchanged:

>>> from ctrainstate import traverse_util
>>> params = {'dense': {'kernel': 1, 'bias': 2}, 'ln': {'scale': 3}}
>>> flat = traverse_util.flatten_dict(params)
>>> mask = {p: p[-1] not in ('bias', 'scale') for p in flat}
>>> traverse_util.unflatten_dict(mask)
{'dense': {'kernel': True, 'bias': False}, 'ln': {'scale': False}}
"""
from ._src.base.traverse_util import *  # noqa: F401,F403
from ._src.base.traverse_util import __all__  # noqa: F401

from ._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
