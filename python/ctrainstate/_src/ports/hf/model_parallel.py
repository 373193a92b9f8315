"""run_clm_mp-style model parallelism: specs for ``(params, opt_state)`` and train states.

HF's run_clm_mp.py derives the optimizer-state spec by hand (every dict subtree
gets the whole param spec, everything else None — "very specific to adamw").
Here the spec of any optax-structured state is derived from the param specs:
each state subtree shaped like the params gets the param specs, counters and
empty states get None (see :func:`ctrainstate.t5x.optimizers.derive_optax_logical_axes`).

>>> import numpy as np, ctrainstate.optim as optim
>>> from ctrainstate import P
>>> from ctrainstate.hf.model_parallel import opt_state_spec
>>> params = {'w': np.zeros((8, 2), np.float32)}
>>> opt_state_spec(optim.adamw(1e-3).init(params), params, {'w': P('mp', None)})
(ScaleByAdamState(count=None, mu={'w': PartitionSpec('mp', None)}, nu={'w': PartitionSpec('mp', None)}), None, None)
"""
from __future__ import annotations

from ..t5x.optimizers import derive_optax_logical_axes
from .._src.base.tree_util import tree_map

__all__ = ['opt_state_spec', 'train_state_spec']


def opt_state_spec(opt_state, params, param_spec):
    """The pjit spec tree of ``opt_state`` (real or from ``eval_shape``) given the params'."""
    return derive_optax_logical_axes(opt_state, params, param_spec, empty_as_none=True)


def train_state_spec(state, param_spec):
    """A spec tree for a (HF or flax) ``TrainState``: params by ``param_spec``, the optimizer
    state derived from it, and every other field (step, dropout_rng, ...) replicated (None)."""
    params = state.params
    spec = tree_map(lambda x: None, state)
    return spec.replace(params=param_spec,
                        opt_state=opt_state_spec(state.opt_state, params, param_spec))


from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
