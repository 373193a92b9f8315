"""Combinators: chain, masked, partition (multi_transform), freeze, apply_if_finite
(optax names, states and semantics).

A combinator of fusable transforms is itself fusable: ``chain`` concatenates
stages, ``masked`` restricts its inner stages to the unmasked leaves (and
``partition`` is one ``masked`` per label, ``freeze`` a masked
``set_to_zero``), and
``apply_if_finite`` puts a gate stage before its inner stages (one read-only
pass counts non-finite updates; when rejected the inner stages are skipped,
their state is left untouched and the updates are zero).
"""
from .._src.optim.combine import *  # noqa: F401,F403
from .._src.optim.combine import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
