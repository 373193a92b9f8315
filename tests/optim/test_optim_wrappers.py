"""The wrappers of optim/wrappers.py (optax.MultiSteps ...): checked by hand and against optax (live,
marked `parity`)."""

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.optim as optim
from ctrainstate.tree_util import tree_leaves


def _shapes(jax, leaves):
    return [[list(x.shape), str(x.dtype)] for x in leaves]


@pytest.mark.parametrize("skip", ["not_finite", "large"])
def test_eval_shape_of_multisteps_init_with_skip_fn(skip):
    # MultiSteps.init calls should_skip_update_fn on zeros like the params to get the skip
    # state; under eval_shape those are ShapeDtypeStructs and skip_not_finite /
    # skip_large_updates raised (np.isfinite of a struct). The abstract state has the
    # concrete one's structure, shapes and dtypes.
    import functools
    fn = optim.skip_not_finite if skip == "not_finite" else functools.partial(
        optim.skip_large_updates, max_squared_norm=1.0)
    tx = optim.MultiSteps(optim.adam(0.1), 2, should_skip_update_fn=fn)
    p = {"a": np.ones((4, 8), np.float32), "b": np.ones(8, np.float32)}
    abstract, concrete = cts.eval_shape(tx.init, p), tx.init(p)
    key = "num_not_finite" if skip == "not_finite" else "norm_squared"
    assert sorted(abstract.skip_state) == sorted(concrete.skip_state) == sorted(["should_skip", key])
    assert [(tuple(np.shape(x)), np.dtype(x.dtype)) for x in tree_leaves(abstract)] == \
        [(tuple(np.shape(x)), np.dtype(x.dtype)) for x in tree_leaves(concrete)]


@pytest.mark.parametrize("skip", ["not_finite", "large"])
def test_eval_shape_of_multisteps_init_with_skip_fn_matches_optax(skip, jax_ref):
    import functools

    def make(o):
        fn = o.skip_not_finite if skip == "not_finite" else functools.partial(
            o.skip_large_updates, max_squared_norm=1.0)
        return o.MultiSteps(o.adam(0.1), 2, should_skip_update_fn=fn)
    p = {"a": np.ones((4, 8), np.float32), "b": np.ones(8, np.float32)}
    want = jax_ref("shapes", lambda jax: _shapes(jax, jax.tree.leaves(jax.eval_shape(
        make(__import__("optax")).init, jax.tree.map(jax.numpy.asarray, p)))))
    got = cts.eval_shape(make(optim).init, p)
    assert _shapes(None, tree_leaves(got)) == want
