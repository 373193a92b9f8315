"""ctrainstate.traverse_util (flax.traverse_util): the traversals t5x's MultiOptimizer is built with."""

import numpy as np
import pytest

from ctrainstate.t5x import adafactor
from ctrainstate.t5x import optimizers


@pytest.mark.filterwarnings('ignore:`flax.traverse_util.Traversal` will be deprecated')
def test_model_param_traversal_in_traverse_util_matches_flax():
    """t5x's MultiOptimizer docstring (t5x_hf.md §1.3) builds its traversals with
    ``flax.traverse_util.ModelParamTraversal``; ``from ctrainstate import traverse_util``
    had none. iterate/update compare with live flax; the traversal drives MultiOptimizer."""
    flax_tu = pytest.importorskip('flax.traverse_util')
    from ctrainstate import traverse_util
    params = {'dense': {'kernel': 1.0, 'bias': 2.0}, 'a': {'kernel': 3.0}, 'e': {}}
    for f in (lambda p, _: 'kernel' in p, lambda p, v: p.startswith('/dense') or v > 2.5):
        ours, theirs = traverse_util.ModelParamTraversal(f), flax_tu.ModelParamTraversal(f)
        assert list(ours.iterate(params)) == list(theirs.iterate(params))
        assert ours.update(lambda x: -x, params) == theirs.update(lambda x: -x, params)
    kernels = traverse_util.ModelParamTraversal(lambda path, _: 'kernel' in path)
    biases = traverse_util.ModelParamTraversal(lambda path, _: 'bias' in path)
    mo = optimizers.MultiOptimizer([(kernels, adafactor.Adafactor(0.1)),
                                    (biases, adafactor.Adafactor(0.2))])
    opt = mo.create({'dense': {'kernel': np.ones((2, 2), np.float32),
                               'bias': np.ones(2, np.float32)}})
    assert set(opt.state.param_states['dense']) == {'kernel', 'bias'}


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define, live when installed (those parts skip cleanly otherwise) and derived
# by hand

def _hf_decay_mask(traverse_util):
    def decay_mask_fn(params):
        flat = traverse_util.flatten_dict(params)
        ln = {p[-2:] for name in ("layernorm", "layer_norm", "ln") for p in flat
              if name in "".join(p).lower()}
        return traverse_util.unflatten_dict(
            {p: (p[-1] != "bias" and p[-2:] not in ln) for p in flat})
    return decay_mask_fn


_TU_PARAMS = {"dense": {"kernel": 1, "bias": 2}, "ln_f": {"scale": 3, "bias": 4},
              "h": {"0": {"mlp": {"kernel": 5}}}, "empty": {}}


def test_traverse_util():
    from ctrainstate import traverse_util as tu
    flat = tu.flatten_dict(_TU_PARAMS)
    assert flat == {("dense", "kernel"): 1, ("dense", "bias"): 2, ("ln_f", "scale"): 3,
                    ("ln_f", "bias"): 4, ("h", "0", "mlp", "kernel"): 5}
    assert tu.flatten_dict(_TU_PARAMS, sep="/")["h/0/mlp/kernel"] == 5
    kept = tu.flatten_dict(_TU_PARAMS, keep_empty_nodes=True)
    assert kept[("empty",)] is tu.empty_node and tu.unflatten_dict(kept) == _TU_PARAMS
    assert tu.unflatten_dict({"a/b": 1, "c": 2}, sep="/") == {"a": {"b": 1}, "c": 2}
    assert tu.flatten_dict({"a": {"b": 1}}, is_leaf=lambda p, x: p == ("a",)) == {("a",): {"b": 1}}
    assert tu.path_aware_map(lambda p, x: "/".join(p), {"a": {"b": 1}, "c": 2}) == \
        {"a": {"b": "a/b"}, "c": "c"}
    assert _hf_decay_mask(tu)(_TU_PARAMS) == {
        "dense": {"kernel": True, "bias": False}, "ln_f": {"scale": False, "bias": False},
        "h": {"0": {"mlp": {"kernel": True}}}}


def test_traverse_util_matches_flax():
    ftu = pytest.importorskip("flax.traverse_util")
    from ctrainstate import traverse_util as tu
    for kw in ({}, {"sep": "/"}, {"keep_empty_nodes": True}):
        want = ftu.flatten_dict(_TU_PARAMS, **kw)
        got = tu.flatten_dict(_TU_PARAMS, **kw)
        assert list(got) == list(want)
        assert [type(v).__name__ for v in got.values()] == [type(v).__name__ for v in want.values()]
    assert _hf_decay_mask(tu)(_TU_PARAMS) == _hf_decay_mask(ftu)(_TU_PARAMS)
    f = lambda p, x: len(p) * 10 + (x if isinstance(x, int) else 0)
    assert tu.path_aware_map(f, _TU_PARAMS) == ftu.path_aware_map(f, _TU_PARAMS)
