"""The implementation of :mod:`ctrainstate.hf.model_parallel` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

from ..t5x.optimizers import derive_optax_logical_axes
from ...base.tree_util import tree_map

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


from ...base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
