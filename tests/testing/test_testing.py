"""ctrainstate.testing: the assertions pass on what they should and fail with messages that
name the path, the sizes of the errors and the shardings."""
import re

import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import NamedSharding, P, nn, random, testing
from ctrainstate.sharding import get_mesh


def _mesh(shape, names):
    return cts.make_mesh(shape, names)


# --- assert_trees_all_close / assert_trees_all_equal -----------------------------------------

def test_all_close_passes_within_tolerance_and_on_arrays():
    m = _mesh((2, 4), ("data", "model"))
    h = np.arange(32, dtype=np.float32).reshape(4, 8)
    a = cts.device_put(h, NamedSharding(m, P("data", "model")))
    testing.assert_trees_all_close({"w": a, "b": [1.0]}, {"w": h * (1 + 1e-7), "b": [1.0]})
    testing.assert_trees_all_close([np.float32(np.nan)], [np.nan])          # NaN equals NaN
    testing.assert_trees_all_close([1.0], [1.05], [1.1], rtol=0, atol=0.2)  # three trees


def test_all_close_message_names_the_leaf_count_and_errors():
    x = {"layer": {"kernel": np.ones((2, 3)), "bias": np.zeros(3)}}
    y = {"layer": {"kernel": np.ones((2, 3)), "bias": np.array([0.0, 0.5, -2.0])}}
    with pytest.raises(AssertionError, match=re.escape(
            "Trees 0 and 1 differ in leaves 'layer/bias': 2 of 3 elements differ beyond "
            "rtol=1e-06, atol=0.0: max abs error 2, max rel error 1")):
        testing.assert_trees_all_close(x, y)
    with pytest.raises(AssertionError, match=r"'layer/kernel': shapes \(2, 3\) and \(3, 2\)"):
        testing.assert_trees_all_close(x, {"layer": {"kernel": np.ones((3, 2)),
                                                     "bias": np.zeros(3)}})
    with pytest.raises(AssertionError, match=r"trees 0 and 1 differ in structure: .*\['layer'\]"):
        testing.assert_trees_all_close(x, {"layer": {"kernel": np.ones((2, 3))}})
    with pytest.raises(ValueError, match="at least two trees"):
        testing.assert_trees_all_close(x)
    with pytest.raises(ValueError, match="rtol and atol must be >= 0"):
        testing.assert_trees_all_close(x, x, rtol=-1)


def test_all_equal_checks_dtypes_and_names_the_first_differing_element():
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    testing.assert_trees_all_equal({"a": a}, {"a": cts.device_put(a)})
    b = a.copy()
    b[1, 2] = 9
    with pytest.raises(AssertionError, match=re.escape(
            "Trees 0 and 1 differ in leaves 'a': 1 of 6 elements differ (first at index "
            "(1, 2): 5 != 9)")):
        testing.assert_trees_all_equal({"a": a}, {"a": b})
    with pytest.raises(AssertionError, match="dtypes int32 and float32"):
        testing.assert_trees_all_equal([a], [a.astype(np.float32)])
    with pytest.raises(AssertionError, match="Trees 0 and 1 differ in leaves '0': 'x' != 'y'"):
        testing.assert_trees_all_equal(["x"], ["y"])


# --- assert_shape ----------------------------------------------------------------------------

def test_assert_shape_wildcards_and_lists():
    testing.assert_shape(np.zeros((2, 3, 4)), (2, ..., 4))
    testing.assert_shape(np.zeros((2, 3, 4)), (...,))
    testing.assert_shape([np.zeros((5, 3)), cts.device_put(np.zeros((7, 3)))], (None, 3))
    testing.assert_shape([np.zeros(2), np.zeros((1, 1))], [(2,), (1, 1)])
    with pytest.raises(AssertionError, match=r"input 1 has shape \(7, 2\), expected \(None, 3\)"):
        testing.assert_shape([np.zeros((5, 3)), np.zeros((7, 2))], (None, 3))
    with pytest.raises(AssertionError, match="2 inputs but 1 expected shapes"):
        testing.assert_shape([np.zeros(1), np.zeros(1)], [(1,)])
    with pytest.raises(AssertionError, match=r"expected \(2, \.\.\., 4\)"):
        testing.assert_shape(np.zeros((2,)), (2, ..., 4))
    with pytest.raises(TypeError, match="a shape holds ints, None and"):
        testing.assert_shape(np.zeros(2), ("2",))


# --- shardings -------------------------------------------------------------------------------

def test_assert_sharding_equivalent_specs_and_the_message():
    m = _mesh((2, 4), ("data", "model"))
    a = cts.device_put(np.zeros((4, 8), np.float32), NamedSharding(m, P("data")))
    testing.assert_sharding(a, P("data", None))                 # a's own mesh
    testing.assert_sharding(a, NamedSharding(m, P("data")))
    with m:
        testing.assert_sharding(a, P(("data",)))
    with pytest.raises(AssertionError, match=re.escape(
            "Array of shape (4, 8) is sharded as NamedSharding(mesh=Mesh('data': 2, "
            "'model': 4), spec=PartitionSpec('data',)), expected NamedSharding(mesh=Mesh("
            "'data': 2, 'model': 4), spec=PartitionSpec(None, 'model'))")):
        testing.assert_sharding(a, P(None, "model"))
    with pytest.raises(AssertionError, match="is a ndarray, not a ctrainstate Array"):
        testing.assert_sharding(np.zeros(3), P())
    with pytest.raises(ValueError, match="a PartitionSpec needs a mesh"):
        testing.assert_sharding(cts.device_put(np.zeros(3)), P())


def test_assert_tree_shardings_from_axes_and_from_boxes():
    m = _mesh((2, 4), ("data", "model"))
    rules = (("embed", "data"), ("mlp", "model"))
    w = cts.device_put(np.zeros((4, 8), np.float32), NamedSharding(m, P("data", "model")))
    b = cts.device_put(np.zeros(8, np.float32), NamedSharding(m, P("model")))
    params = {"dense": {"kernel": w, "bias": b}}
    axes = {"dense": {"kernel": P("embed", "mlp"), "bias": ("mlp",)}}
    testing.assert_tree_shardings(params, axes, rules)
    with m, nn.partitioning.axis_rules(rules):           # rules and mesh from the context
        testing.assert_tree_shardings(params, axes)
    wrong = (("embed", "model"), ("mlp", "data"))
    with pytest.raises(AssertionError, match=re.escape(
            "parameter 'dense/bias' with logical axes ('mlp',) should be sharded as "
            "PartitionSpec('data',) (on mesh {'data': 2, 'model': 4}), but is")):
        testing.assert_tree_shardings(params, axes, wrong)
    boxed = {"dense": {"kernel": nn.LogicallyPartitioned(w, ("embed", "mlp")),
                       "bias": nn.LogicallyPartitioned(b, ("mlp",))}}
    testing.assert_tree_shardings(boxed, rules=rules)
    with pytest.raises(AssertionError, match="parameter 'dense/bias'"):   # (flatten order)
        testing.assert_tree_shardings(boxed, rules=(("mlp", "data"),))
    with pytest.raises(ValueError, match="holds no nn.Partitioned boxes"):
        testing.assert_tree_shardings(params, rules=rules)
    with pytest.raises(ValueError, match="`axes` does not have the tree's structure"):
        testing.assert_tree_shardings(params, {"dense": {"kernel": P()}}, rules)


def test_assert_tree_shardings_of_params_born_sharded_by_init():
    m = _mesh((2, 4), ("data", "model"))
    rules = (("embed", "data"), ("mlp", "model"))

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), ("embed", "mlp")), use_bias=False)(x)
    with m, nn.partitioning.axis_rules(rules):
        boxed = Block().init(random.PRNGKey(0), np.ones((2, 4), np.float32))["params"]
        testing.assert_tree_shardings(boxed)


def test_assert_mesh_invariant_passes_on_sharded_random_and_names_differing_meshes():
    meshes = [_mesh((8,), ("x",)), _mesh((2, 4), ("x", "y")), _mesh((4, 2), ("x", "y"))]

    def draw():
        s = NamedSharding(get_mesh(), P("x"))
        return {"n": random.normal(random.PRNGKey(3), (8, 16), out_sharding=s)}
    outs = testing.assert_mesh_invariant(draw, meshes)
    assert len(outs) == 3 and [o["n"].sharding.mesh.shape for o in outs] == [
        m.shape for m in meshes]
    with pytest.raises(AssertionError, match=re.escape(
            "results differ between mesh 0 {'x': 8} and mesh 1 {'x': 2, 'y': 4}: Trees 0 "
            "and 1 differ in leaves 'n'")):
        testing.assert_mesh_invariant(lambda: {"n": np.float32(len(get_mesh().shape))},
                                      meshes)
    with pytest.raises(ValueError, match="at least two meshes"):
        testing.assert_mesh_invariant(draw, meshes[:1])


def test_assert_tree_shardings_pairs_axes_in_other_containers_by_path():
    # get_axis_names gives a FrozenDict; params are a dict: paired by key path, and a
    # wrongly sharded leaf is still reported
    from ctrainstate.core import FrozenDict
    mesh = cts.Mesh(np.array(cts.devices()[:2]), ("model",))
    w = cts.device_put(np.zeros((4, 2), np.float32), cts.NamedSharding(mesh, cts.P(None, "model")))
    axes = FrozenDict({"dense": {"w": cts.P("embed", "mlp")}})
    testing.assert_tree_shardings({"dense": {"w": w}}, axes, (("mlp", "model"),))
    with pytest.raises(AssertionError, match="dense"):
        testing.assert_tree_shardings({"dense": {"w": w}}, axes, (("embed", "model"),))
    with pytest.raises(ValueError, match="structure"):
        testing.assert_tree_shardings({"dense": {"w": w}}, FrozenDict({"other": {"w": None}}),
                                      (("mlp", "model"),))
