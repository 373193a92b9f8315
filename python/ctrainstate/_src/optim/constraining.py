"""The implementation of :mod:`ctrainstate.optim.constraining` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..ops import ops as _ops
from ..base.tree_util import tree_map
from .base import EmptyState, GradientTransformation, GradientTransformationExtraArgs, scalar
from ..numpy_lax import numpy as cnp

__all__ = ["NonNegativeParamsState", "keep_params_nonnegative", "ZeroNansState", "zero_nans"]

NonNegativeParamsState = EmptyState

_NO_PARAMS_MSG = ("You are using a transformation that requires the current value of "
                  "parameters, but you are not passing `params` when calling `update`.")


def keep_params_nonnegative() -> GradientTransformation:
    """Modify the updates so that ``params + updates`` stays >= 0: where it would be
    negative the update becomes ``-params`` (optax.keep_params_nonnegative; the params
    themselves must start non-negative). State: NonNegativeParamsState() (EmptyState).
    ``tx.update`` without params raises ValueError, as optax."""
    def update(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(_NO_PARAMS_MSG)
        out = tree_map(
            lambda p, u: None if p is None else _ops.where(_ops.add(p, u) < 0.0,
                                                           _ops.negative(p), u),
            params, updates, is_leaf=lambda x: x is None)
        return out, state
    return GradientTransformationExtraArgs(lambda params: NonNegativeParamsState(), update)


class ZeroNansState(NamedTuple):
    """State of :func:`zero_nans`: ``found_nan``, per leaf a bool scalar, whether the last
    updates of that leaf held a NaN (optax.ZeroNansState)."""
    found_nan: Any


def zero_nans() -> GradientTransformation:
    """Replace NaN updates by 0 and record, per leaf, whether there was one
    (optax.zero_nans; infinities pass). State: ZeroNansState(found_nan)."""

    def init(params):
        return ZeroNansState(found_nan=tree_map(
            lambda p: scalar(False, np.bool_, p), params))

    def update(updates, state, params=None, **extra_args):
        del params, state
        found = tree_map(lambda u: cnp.any(cnp.isnan(u)), updates)
        out = tree_map(lambda u: _ops.where(cnp.isnan(u), 0.0, u), updates)
        return out, ZeroNansState(found_nan=found)
    return GradientTransformationExtraArgs(init, update)


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
