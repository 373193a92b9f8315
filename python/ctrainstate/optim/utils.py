"""optax's helpers outside the transforms: losses (``l2_loss``, ``squared_error``),
``global_norm``, target-network updates (``incremental_update``, ``periodic_update``),
user transforms from plain functions (``stateless``, ``stateless_with_tree_map``) and the
type aliases scripts annotate with (``Params``, ``Updates``, ``OptState``, ``Schedule``).

The losses and ``global_norm`` are ctrainstate.numpy ops: they run on sharded Arrays and
are differentiable. ``stateless`` transforms run through ``tx.update`` (not fused).

>>> import numpy as np, ctrainstate.optim as optim
>>> float(optim.global_norm({'a': np.full(4, 0.5, np.float32), 'b': np.ones(3, np.float32)}))
2.0
>>> np.asarray(optim.l2_loss(np.array([1.0, 3.0], np.float32), np.array([0.0, 1.0], np.float32))).tolist()
[0.5, 2.0]
"""
from __future__ import annotations

from typing import Any, Callable

from .. import _ops
from ..tree_util import tree_leaves, tree_map
from .base import EmptyState, GradientTransformation

__all__ = ["l2_loss", "squared_error", "global_norm", "incremental_update", "periodic_update",
           "stateless", "stateless_with_tree_map", "Params", "Updates", "OptState", "Schedule",
           "ScalarOrSchedule"]

Params = Any
Updates = Any
OptState = Any
Schedule = Callable[[Any], Any]
ScalarOrSchedule = Any


def squared_error(predictions, targets=None):
    """Elementwise ``(predictions - targets) ** 2`` (``targets=None``: zeros)."""
    d = predictions if targets is None else _ops.subtract(predictions, targets)
    return _ops.square(d)


def l2_loss(predictions, targets=None):
    """Elementwise ``0.5 * (predictions - targets) ** 2``, optax's convention (no mean)."""
    return _ops.multiply(squared_error(predictions, targets), 0.5)


def global_norm(updates):
    """``sqrt`` of the sum of squares of every leaf: a 0-d Array (each global element counted
    once, whatever the sharding)."""
    leaves = [x for x in tree_leaves(updates) if x is not None]
    if not leaves:
        return _ops._lift(0.0)
    total = None
    for x in leaves:
        s = _ops.sum(_ops.square(x))
        total = s if total is None else _ops.add(total, s)
    return _ops.sqrt(total)


def incremental_update(new_tensors, old_tensors, step_size):
    """``step_size * new + (1 - step_size) * old`` leaf by leaf (Polyak averaging of target
    networks)."""
    a = float(step_size)
    return tree_map(lambda new, old: _ops.add(_ops.multiply(new, a), _ops.multiply(old, 1.0 - a)),
                    new_tensors, old_tensors)


def periodic_update(new_tensors, old_tensors, steps, update_period: int):
    """``new_tensors`` when ``steps`` is a multiple of ``update_period``, else ``old_tensors``."""
    return new_tensors if int(steps) % int(update_period) == 0 else old_tensors


def stateless(f: Callable) -> GradientTransformation:
    """A transform with no state: ``update(updates, state, params)`` returns
    ``f(updates, params)``."""
    return GradientTransformation(lambda params: EmptyState(),
                                  lambda updates, state, params=None: (f(updates, params),
                                                                       EmptyState()))


def stateless_with_tree_map(f: Callable) -> GradientTransformation:
    """Like :func:`stateless`, with ``f(g, p)`` applied leaf by leaf (``p`` is None without
    params)."""
    def apply(updates, params):
        if params is None:
            return tree_map(lambda g: f(g, None), updates)
        return tree_map(f, updates, params)
    return stateless(apply)
