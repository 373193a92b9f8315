"""ctrainstate.hf's training helpers (hf/train_state.py: flax.training.common_utils' onehot, get_metrics,
stack_forest, shard): against live flax where installed, and by hand (shared/reference/t5x_hf.md §1.5)."""

import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import hf


def test_onehot_matches_flax():
    """flax.training.common_utils.onehot (t5x_hf.md §1.5 "onehot, get_metrics, stack_forest:
    helpers used by HF"): float32, a new last axis, on/off values. ctrainstate.hf had none."""
    common_utils = pytest.importorskip('flax.training.common_utils')
    labels = np.array([[1, 3, 0], [2, 2, 4]], np.int32)
    for kw in ({}, {'on_value': 0.9, 'off_value': 0.025}):
        want = np.asarray(common_utils.onehot(labels, 5, **kw))
        got = hf.onehot(cts.device_put(labels), 5, **kw)
        assert got.dtype == np.float32 and got.shape == want.shape == (2, 3, 5)
        np.testing.assert_array_equal(np.asarray(got), want)
        np.testing.assert_array_equal(np.asarray(hf.onehot(labels, 5, **kw)), want)


def test_get_metrics_and_stack_forest_match_flax():
    """flax's get_metrics: copy 0 of each replicated leaf, on the host, stacked over the
    list of steps; stack_forest stacks matching leaves (t5x_hf.md §1.5, §3.3 step 8)."""
    common_utils = pytest.importorskip('flax.training.common_utils')
    jax_utils = pytest.importorskip('flax.jax_utils')
    steps = [{'loss': np.float32(1.5 + i), 'acc': np.array([i, 2 * i], np.float32)}
             for i in range(3)]
    want = common_utils.get_metrics([jax_utils.replicate(m) for m in steps])
    got = hf.get_metrics([hf.replicate(m) for m in steps])
    for k in ('loss', 'acc'):
        assert np.shape(got[k]) == np.shape(want[k]) and got[k].dtype == want[k].dtype
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
    want = common_utils.stack_forest(steps)
    got = hf.stack_forest(steps)
    for k in ('loss', 'acc'):
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


def test_shard_names_a_batch_that_does_not_divide():
    """flax's shard reshapes to (local_device_count, -1, ...) and numpy's reshape error names
    neither the leaf nor the device count; ctrainstate names both."""
    n = cts.local_device_count()
    ok = hf.shard({'ids': np.zeros((2 * n, 3))})
    assert ok['ids'].shape == (n, 2, 3)
    with pytest.raises(ValueError, match=r"shard: \['labels'\] has shape \(%d, 3\); its leading "
                                         r"dimension must divide by the %d local devices"
                                         % (n + 1, n)):
        hf.shard({'ids': np.zeros((2 * n, 3)), 'labels': np.zeros((n + 1, 3))})
