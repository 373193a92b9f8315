"""The implementation of :mod:`ctrainstate.optim.lookahead` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import logging
from typing import Any, NamedTuple

import numpy as np

from ..ops import ops as _ops
from ..base.tree_util import tree_map
from .base import (GradientTransformation, GradientTransformationExtraArgs, call_update,
                   read_scalar, scalar)

__all__ = ["LookaheadState", "LookaheadParams", "lookahead"]


class LookaheadState(NamedTuple):
    """State of :func:`lookahead`: the fast optimizer's state and the number of fast steps
    since the last synchronization (optax.LookaheadState)."""
    fast_state: Any
    steps_since_sync: Any


class LookaheadParams(NamedTuple):
    """The fast (compute gradients with these) and slow (evaluate with these) params of
    :func:`lookahead` (optax.LookaheadParams)."""
    fast: Any
    slow: Any

    @classmethod
    def init_synced(cls, params) -> "LookaheadParams":
        """A pair of synchronized params: ``fast`` and ``slow`` are both ``params``."""
        return cls(slow=params, fast=params)


def lookahead(fast_optimizer: GradientTransformation, sync_period, slow_step_size,
              reset_state: bool = False) -> GradientTransformation:
    """Lookahead (optax.lookahead, Zhang et al. 2019). ``update(grads_of_fast, state,
    LookaheadParams)`` returns LookaheadParams of updates: every step the fast params take
    the fast optimizer's step; at every ``sync_period``-th the slow params move
    ``slow_step_size`` of the way to the fast ones and the fast params are set to the
    new slow ones. ``reset_state``: the fast optimizer's state is re-initialized after each
    synchronization. State: LookaheadState(fast_state, steps_since_sync).

    ``sync_period < 1`` raises ValueError, as optax; ``update`` without LookaheadParams
    raises a ValueError (optax: an AttributeError)."""
    if sync_period < 1:
        raise ValueError("Synchronization period must be >= 1.")
    if not (callable(getattr(fast_optimizer, "init", None))
            and callable(getattr(fast_optimizer, "update", None))):
        raise TypeError(f"lookahead: fast_optimizer must be a GradientTransformation, got "
                        f"{type(fast_optimizer).__name__}")

    def init(params):
        fast_params = getattr(params, "fast", None)
        if fast_params is None:
            logging.warning("`params` has no attribute `fast`. Continuing by assuming that "
                            "only fast parameters were passed to lookahead init.")
            fast_params = params
        return LookaheadState(fast_state=fast_optimizer.init(fast_params),
                              steps_since_sync=scalar(0, np.int32, fast_params))

    def update(updates, state, params=None, **extra_args):
        if not (hasattr(params, "fast") and hasattr(params, "slow")):
            raise ValueError("lookahead: update needs the params as LookaheadParams(fast, "
                             "slow) (LookaheadParams.init_synced(params)); got "
                             f"{type(params).__name__}")
        updates, fast_state = call_update(fast_optimizer, updates, state.fast_state,
                                          params.fast, extra_args)
        n = int(read_scalar(state.steps_since_sync))
        sync_next = float(n == sync_period - 1)
        # optax's merged form: last_difference = fast + updates - slow;
        # slow += slow_step_size * sync * diff; fast += updates - sync * (1 - s) * diff
        diff = tree_map(lambda f, u, s: _ops.subtract(_ops.add(f, u), s),
                        params.fast, updates, params.slow)
        slow_u = tree_map(lambda d: _ops.multiply(_ops.multiply(d, slow_step_size), sync_next),
                          diff)
        fast_u = tree_map(lambda u, d: _ops.subtract(
            u, _ops.multiply(_ops.multiply(d, sync_next), 1 - slow_step_size)), updates, diff)
        if reset_state and sync_next:
            fast_state = fast_optimizer.init(params.fast)
        return LookaheadParams(fast=fast_u, slow=slow_u), LookaheadState(
            fast_state, scalar((n + 1) % sync_period, np.int32,
                               sharding=getattr(state.steps_since_sync, "sharding", None)))
    return GradientTransformationExtraArgs(init, update)


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
