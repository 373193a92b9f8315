"""The implementation of :mod:`ctrainstate.t5x.train_state` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .... import partitioning as flax_partitioning
from ...array.array import device_put
from ...core.frozen_dict import FrozenDict, freeze, unfreeze
from ...array.sharding import PartitionSpec
from ...train_state.train_state import PyTreeNode, field
from ...base.tree_util import tree_map
from .optimizers import Optimizer, _place
from ...serialization.state_dict import flatten_dict, from_state_dict, to_state_dict

__all__ = ['TrainState', 'FlaxOptimTrainState', 'InferenceState', 'EMPTY_DICT']

EMPTY_DICT = freeze({})


def _validate_axes(axes, variables, collection='params'):
    """Every leaf of ``variables`` needs an entry ``<name>_axes`` in ``axes``."""
    have = {k[:-len('_axes')] if k.endswith('_axes') else k
            for k in flatten_dict(dict(axes), sep='/')}
    need = set(flatten_dict(dict(variables), sep='/'))
    missing = need - have
    if missing:
        raise ValueError(f'Missing axis names for parameters: {missing}')


def _split_variables_and_axes(variables):
    """``(mutables, axes)``, both frozen: ``<name>_axes`` collections (checked against
    ``<name>``) apart from the others."""
    mutables, axes = {}, {}
    for k, v in variables.items():
        if k.endswith('_axes'):
            base = k[:-len('_axes')]
            if base not in variables:
                raise ValueError(f'Axes collection {k!r} has no collection {base!r}')
            _validate_axes(v, variables[base], base)
            axes[base] = v
        else:
            mutables[k] = v
    return freeze(mutables), freeze(axes)


def _split(model_variables):
    """``(params, params_axes, flax_mutables, flax_mutables_axes)`` of ``model.init``'s
    variables: params and their axes as given, the others frozen (axes None if none)."""
    variables = dict(model_variables)
    if 'params' not in variables:
        raise ValueError("model_variables has no 'params' collection")
    params = variables.pop('params')
    params_axes = variables.pop('params_axes', None)
    if params_axes is not None:
        _validate_axes(params_axes, params)
    flax_mutables, flax_mutables_axes = _split_variables_and_axes(variables)
    return params, params_axes, flax_mutables, flax_mutables_axes or None


def _axis_names_or_none(params, params_axes):
    """The logical axes of ``params`` (None leaves without ``params_axes``), a FrozenDict
    when the params are one and plain dicts otherwise: t5x derives the optimizer's axes
    through ``restore_state`` into the live optimizer, which keeps the params' kind."""
    if params_axes is None:  # no axes: every param replicated
        return tree_map(lambda x: None, params)
    names = flax_partitioning.get_axis_names(params_axes)
    return names if isinstance(params, FrozenDict) else unfreeze(names)


def _check_same_params(old, new) -> None:
    """``new`` has the '/'-paths of ``old`` and, where both leaves have one, the same shape."""
    if not (isinstance(old, Mapping) and isinstance(new, Mapping)):
        return
    fo, fn = flatten_dict(dict(old), sep='/'), flatten_dict(dict(new), sep='/')
    missing, extra = [k for k in fo if k not in fn], [k for k in fn if k not in fo]
    if missing or extra:
        raise ValueError(f'replace_params: the params differ from the optimizer\'s: missing '
                         f'{missing}, unexpected {extra}')
    for k, v in fo.items():
        a, b = getattr(v, 'shape', None), getattr(fn[k], 'shape', None)
        if a is not None and b is not None and tuple(a) != tuple(b):
            raise ValueError(f'replace_params: {k} has shape {tuple(b)}, the optimizer state '
                             f'is for shape {tuple(a)}')


def _frozen_mutables(state_dict) -> FrozenDict:
    """A state dict's ``flax_mutables``, frozen; empty when it has none."""
    return freeze(state_dict['flax_mutables']) if 'flax_mutables' in state_dict else EMPTY_DICT


class TrainState:
    """The interface t5x's partitioner and trainer use (a Protocol in t5x)."""


class FlaxOptimTrainState(PyTreeNode):
    """A t5x optimizer (``Optimizer``) plus axes metadata and the model's other collections."""

    _optimizer: Optimizer
    params_axes: Any = None
    flax_mutables: Any = field(default_factory=dict)
    flax_mutables_axes: Any = None

    @classmethod
    def create(cls, optimizer_def, model_variables) -> 'FlaxOptimTrainState':
        """Split ``model_variables`` and build the optimizer for its params."""
        params, params_axes, flax_mutables, flax_mutables_axes = _split(model_variables)
        if hasattr(optimizer_def, 'set_param_axes'):
            if params_axes is None:
                raise ValueError('The optimizer supports params_axes for model-based '
                                 'partitioning, but the model is not emitting them.')
            optimizer_def.set_param_axes(flax_partitioning.get_axis_names(params_axes))
        optimizer = optimizer_def.create(params)
        return cls(optimizer, params_axes=params_axes, flax_mutables=flax_mutables,
                   flax_mutables_axes=flax_mutables_axes)

    @property
    def step(self):
        """The optimizer step (a replicated int32 scalar)."""
        return self._optimizer.state.step

    @property
    def params(self):
        """The model parameters (the optimizer target)."""
        return self._optimizer.target

    @property
    def param_states(self):
        """The optimizer's per-param (or optax) state."""
        return self._optimizer.state.param_states

    def apply_gradient(self, grads, learning_rate, flax_mutables=EMPTY_DICT):
        """One optimizer step; ``flax_mutables`` (stored as given, as t5x does) replaces the
        mutables, which are reset to empty when it is omitted."""
        new_optimizer = self._optimizer.apply_gradient(grads, learning_rate=learning_rate)
        return self.replace(_optimizer=new_optimizer, flax_mutables=flax_mutables)

    def state_dict(self) -> dict:
        """``{'target', 'state': {'step', 'param_states'}}`` plus ``'flax_mutables'`` if any."""
        sd = self._optimizer.state_dict()
        if self.flax_mutables:
            sd['flax_mutables'] = to_state_dict(self.flax_mutables)
        return sd

    def restore_state(self, state_dict) -> 'FlaxOptimTrainState':
        """The state with the optimizer and (frozen) mutables of ``state_dict``."""
        new_optimizer = self._optimizer.restore_state(state_dict)
        return self.replace(_optimizer=new_optimizer,
                            flax_mutables=_frozen_mutables(state_dict))

    def replace_params(self, params) -> 'FlaxOptimTrainState':
        """The state with other params (optimizer state unchanged). They must have the
        current params' paths and shapes: the optimizer state is theirs."""
        _check_same_params(self.params, params)
        return self.replace(_optimizer=self._optimizer.replace(target=params))

    def replace_flax_mutables(self, flax_mutables) -> 'FlaxOptimTrainState':
        """The state with other flax mutables."""
        return self.replace(flax_mutables=flax_mutables)

    def replace_step(self, step) -> 'FlaxOptimTrainState':
        """The state with another step (through state_dict/restore_state)."""
        sd = self.state_dict()
        sd['state']['step'] = step
        return self.restore_state(sd)

    def as_logical_axes(self) -> 'FlaxOptimTrainState':
        """This state with logical ``PartitionSpec`` (or None) leaves; ``params_axes`` None,
        ``flax_mutables_axes`` kept (metadata without leaves)."""
        opt_def = self._optimizer.optimizer_def
        if not hasattr(opt_def, 'derive_logical_axes'):
            raise ValueError(f"Optimizer '{opt_def.__class__.__name__}' requires a "
                             '`derive_logical_axes` method to be used with named axis '
                             'partitioning.')
        return FlaxOptimTrainState(
            opt_def.derive_logical_axes(self._optimizer,
                                        _axis_names_or_none(self.params, self.params_axes)),
            params_axes=None,
            flax_mutables=flax_partitioning.get_axis_names(self.flax_mutables_axes or EMPTY_DICT),
            flax_mutables_axes=self.flax_mutables_axes)  # kept, as t5x does


class InferenceState(PyTreeNode):
    """Params and mutables without an optimizer (t5x.train_state.InferenceState)."""

    step: Any
    params: Any
    params_axes: Any = None
    flax_mutables: Any = field(default_factory=dict)
    flax_mutables_axes: Any = None

    @classmethod
    def create(cls, model_variables) -> 'InferenceState':
        """An inference state from ``model.init`` variables (same splitting and axis checks)."""
        params, params_axes, flax_mutables, flax_mutables_axes = _split(model_variables)
        return cls(step=device_put(np.asarray(0, np.int32)), params=_place(params),
                   params_axes=params_axes, flax_mutables=flax_mutables,
                   flax_mutables_axes=flax_mutables_axes)

    @property
    def param_states(self):
        """Not available: an InferenceState has no optimizer."""
        raise NotImplementedError('InferenceState has no optimizer states.')

    def apply_gradient(self, *args, **kwargs):
        """Not available: an InferenceState has no optimizer."""
        raise NotImplementedError('InferenceState does not support apply_gradient.')

    def state_dict(self) -> dict:
        """``{'target', 'state': {'step'}}`` plus ``'flax_mutables'`` if any."""
        sd = {'target': to_state_dict(self.params), 'state': {'step': self.step}}
        if self.flax_mutables:
            sd['flax_mutables'] = to_state_dict(self.flax_mutables)
        return sd

    def restore_state(self, state_dict) -> 'InferenceState':
        """The state with the params, step and mutables of ``state_dict``: the checkpoint's
        params are taken as they are (frozen, as t5x does), not fitted to this state's."""
        target = state_dict['target']
        return self.replace(params=freeze(target) if isinstance(target, Mapping) else target,
                            step=state_dict['state']['step'],
                            flax_mutables=_frozen_mutables(state_dict))

    def replace_params(self, params) -> 'InferenceState':
        """The state with other params."""
        return self.replace(params=params)

    def replace_flax_mutables(self, flax_mutables) -> 'InferenceState':
        """The state with other flax mutables."""
        return self.replace(flax_mutables=flax_mutables)

    def replace_step(self, step) -> 'InferenceState':
        """The state with another step."""
        return self.replace(step=step)

    def as_logical_axes(self) -> 'InferenceState':
        """This state with logical ``PartitionSpec`` leaves (the step None)."""
        return InferenceState(
            step=None, params=(tree_map(lambda x: None, self.params) if self.params_axes is None
                               else flax_partitioning.get_axis_names(self.params_axes)),
            flax_mutables=flax_partitioning.get_axis_names(self.flax_mutables_axes or EMPTY_DICT))


from ...base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
