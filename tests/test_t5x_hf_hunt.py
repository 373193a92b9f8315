"""Regression tests for parity bugs found in ``ctrainstate.t5x`` and ``ctrainstate.hf``.

Expectations come from shared/reference/t5x_hf.md (section cited per test), from the
upstream code the reference describes, from live flax where it applies, or by hand.
"""
import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import P, _dtypes, hf, optim
from ctrainstate.t5x import adafactor, optimizers

BF16 = _dtypes.bfloat16


# --- t5x.optimizers.OptaxStatePartitionRules --------------------------------------------------

def test_optax_state_partition_rules_two_argument_form():
    """t5x_hf.md §1.3: ``OptaxStatePartitionRules.derive_optax_logical_axes(state, params_axes)``
    (t5x's signature: no params). mu/nu get the param axes, counters None, EmptyState stays,
    MaskedNode entries are kept (t5x's derive_params_axes). It raised a tree-structure
    ValueError (it flattened ``params=None``)."""
    R = optimizers.OptaxStatePartitionRules
    params = {'w': np.zeros((4, 2), np.float32), 'b': np.zeros(2, np.float32)}
    axes = {'w': P('embed', 'mlp'), 'b': None}
    got = R.derive_optax_logical_axes(optim.adam(1e-3).init(params), axes)
    adam = got[0]
    assert adam.count is None
    assert adam.mu == axes and adam.nu == axes
    assert type(got[1]).__name__ == 'EmptyState'

    st = optim.masked(optim.adam(1e-3), {'w': True, 'b': False}).init(params)
    got = R.derive_optax_logical_axes(st, axes)
    inner = got.inner_state[0]
    assert inner.count is None
    assert inner.mu['w'] == P('embed', 'mlp') and type(inner.mu['b']).__name__ == 'MaskedNode'
    # t5x's derive_params_axes: the axes, with the MaskedNode holes of the optax params
    d = R.derive_params_axes(st.inner_state[0].mu, axes)
    assert d['w'] == P('embed', 'mlp') and type(d['b']).__name__ == 'MaskedNode'
