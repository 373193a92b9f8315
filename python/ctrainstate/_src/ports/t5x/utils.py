"""The implementation of :mod:`ctrainstate.t5x.utils` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

from ...array.abstract import eval_shape
from ...core.frozen_dict import freeze
from .train_state import FlaxOptimTrainState, InferenceState
from .... import partitioning as flax_partitioning, random

__all__ = ['TrainStateInitializer']


class TrainStateInitializer:
    """``init_fn(rng=, input_shapes=, input_types=)`` -> variables, wrapped in a train state.

    The variables of ``init_fn`` are frozen (``FrozenDict``), as in t5x.
    ``global_train_state_shape`` is the abstract state (nothing allocated),
    ``train_state_axes`` its mesh specs, and ``from_scratch(rng)`` runs the init
    partitioned with ``out_axis_resources=train_state_axes``: parameters declared with
    logical axes are born sharded.
    """

    def __init__(self, optimizer_def, init_fn, input_shapes, partitioner, input_types=None):
        self._partitioner = partitioner

        def initialize_train_state(rng):
            # frozen, as t5x does: params, the axes trees and the state dicts then agree
            variables = freeze(init_fn(rng=rng, input_shapes=input_shapes,
                                       input_types=input_types))
            if optimizer_def is None:
                return InferenceState.create(variables)
            return FlaxOptimTrainState.create(optimizer_def, variables)

        self._initialize_train_state = initialize_train_state
        with partitioner.mesh:
            with flax_partitioning.axis_rules(partitioner.logical_axis_rules):
                self.global_train_state_shape = eval_shape(initialize_train_state,
                                                           random.PRNGKey(0))
        self.train_state_axes = partitioner.get_mesh_axes(self.global_train_state_shape)

    def from_scratch(self, init_rng):
        """A fresh train state, placed by ``train_state_axes``."""
        p = self._partitioner.partition(self._initialize_train_state, in_axis_resources=None,
                                        out_axis_resources=self.train_state_axes)
        return p(init_rng)


from ...base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
