"""take_rows (the embedding lookup behind nn.Embed): rows gathered per device without a
one-hot, on every mesh and table sharding; gradients are scatter-adds, checked against numpy's
np.add.at (repeated ids included)."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import nn, random

MESHES = [((1,), ("x",)), ((8,), ("x",)), ((2, 4), ("data", "model")), ((4, 2), ("data", "model"))]


def _specs(names):
    if len(names) == 1:
        return [cts.P(), cts.P("x", None), cts.P(None, "x")]
    return [cts.P(), cts.P("model", None), cts.P(None, "model"), cts.P("model", "data"),
            cts.P(("data", "model"), None)]


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_values_and_gradients_on_meshes(mesh_shape, names):
    rng = np.random.default_rng(0)
    table = rng.standard_normal((16, 8)).astype(np.float32)
    ids = rng.integers(0, 16, (3, 5))
    ids[0, :3] = 7  # repeated ids: their cotangents add up
    w = rng.standard_normal((3, 5, 8)).astype(np.float32)
    want_grad = np.zeros_like(table)
    np.add.at(want_grad, ids.reshape(-1), w.reshape(-1, 8))
    mesh = cts.make_mesh(mesh_shape, names)
    for spec in _specs(names):
        t = cts.device_put(table, cts.NamedSharding(mesh, spec))
        out = cnp.take_rows(t, ids)
        assert out.shape == (3, 5, 8)
        np.testing.assert_array_equal(np.asarray(out), table[ids], err_msg=str(spec))
        g = cts.grad(lambda v: cnp.sum(cnp.take_rows(v, ids) * w))(t)
        assert g.sharding.is_equivalent_to(t.sharding, 2), (g.sharding, t.sharding)
        np.testing.assert_allclose(np.asarray(g), want_grad, rtol=1e-6, atol=1e-6, err_msg=str(spec))


def test_shapes_and_errors():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    assert np.asarray(cnp.take_rows(table, np.int64(2))).tolist() == [6.0, 7.0, 8.0]     # 0-d
    assert np.asarray(cnp.take_rows(table, np.zeros((0,), np.int32))).shape == (0, 3)  # empty
    assert np.asarray(cnp.take_rows(table, [[3], [1]])).tolist() == [[[9.0, 10.0, 11.0]], [[3.0, 4.0, 5.0]]]
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        cnp.take_rows(table, np.array([4]))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        cnp.take_rows(table, np.array([-1]))
    with pytest.raises(TypeError, match="integers"):
        cnp.take_rows(table, np.array([1.0]))
    with pytest.raises(ValueError, match="2-d"):
        cnp.take_rows(np.zeros(4, np.float32), np.array([1]))
    # gradients with no ids, and of a table without columns
    g = cts.grad(lambda t: cnp.sum(cnp.take_rows(t, np.zeros((0,), np.int32))))(cts.device_put(table))
    np.testing.assert_array_equal(np.asarray(g), np.zeros((4, 3), np.float32))
    g = cts.grad(lambda t: cnp.sum(cnp.take_rows(t, np.array([1, 1]))))(cts.device_put(np.zeros((4, 0), np.float32)))
    assert np.asarray(g).shape == (4, 0)
    s = cts.eval_shape(lambda t: cnp.take_rows(t, np.zeros((2, 7), np.int32)),
                       cts.ShapeDtypeStruct((5, 3), np.float32))
    assert s.shape == (2, 7, 3)


def test_embed_uses_rows_and_trains_sharded():
    """nn.Embed on a vocabulary sharded over 'model': the same values and gradients as on one
    device (the one-hot it used to build would be tokens x vocab floats on the host)."""
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    model = nn.Embed(num_embeddings=32, features=6, embedding_axes=("vocab", "embed"))
    ids = np.random.default_rng(1).integers(0, 32, (4, 9))
    key = random.PRNGKey(0)
    ref = model.init(key, ids)["params"]
    rules = (("vocab", "model"), ("embed", None))
    from ctrainstate.partitioning import axis_rules
    with mesh, axis_rules(rules):
        sharded = model.init(key, ids)["params"]
    assert sharded["embedding"].sharding.spec[0] == "model"
    np.testing.assert_array_equal(np.asarray(sharded["embedding"]), np.asarray(ref["embedding"]))
    w = np.random.default_rng(2).standard_normal((4, 9, 6)).astype(np.float32)

    def loss(p):
        return cnp.sum(model.apply({"params": p}, ids) * w)
    l1, g1 = cts.value_and_grad(loss)(ref)
    l2, g2 = cts.value_and_grad(loss)(sharded)
    np.testing.assert_allclose(float(np.asarray(l2)), float(np.asarray(l1)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g2["embedding"]), np.asarray(g1["embedding"]), rtol=1e-6,
                               atol=1e-6)
    table = np.asarray(ref["embedding"])
    np.testing.assert_array_equal(np.asarray(model.apply({"params": ref}, ids)), table[ids])


def test_embed_negative_ids_count_from_the_end():
    """nn.Embed reads ids as Flax's jnp.take does: [-n, 0) from the end (numpy's rule, the
    reference here), the gradient landing on those rows; ids outside [-n, n) raise (Flax gives
    NaN rows); with one row only 0 is valid (Flax compares ids with 0)."""
    model = nn.Embed(num_embeddings=7, features=3)
    ids = np.array([[0, -1, 6, -7], [3, -4, 2, -2]])
    params = model.init(random.PRNGKey(3), np.zeros((1,), np.int32))["params"]
    table = np.asarray(params["embedding"])
    out = model.apply({"params": params}, ids)
    np.testing.assert_array_equal(np.asarray(out), table[ids])
    w = np.random.default_rng(4).standard_normal((2, 4, 3)).astype(np.float32)
    g = cts.grad(lambda p: cnp.sum(model.apply({"params": p}, ids) * w))(params)
    want = np.zeros_like(table)
    np.add.at(want, ids % 7, w)
    np.testing.assert_allclose(np.asarray(g["embedding"]), want, rtol=1e-6)
    for bad in (7, -8, 100):
        with pytest.raises(ValueError, match=r"ids must be in \[-7, 7\).*e\.g\. " + str(bad)):
            model.apply({"params": params}, np.array([1, bad, 2]))
    one = nn.Embed(num_embeddings=1, features=2)
    p1 = one.init(random.PRNGKey(0), np.zeros((1,), np.int32))["params"]
    np.testing.assert_array_equal(np.asarray(one.apply({"params": p1}, np.array([0, 0]))),
                                  np.asarray(p1["embedding"])[[0, 0]])
    with pytest.raises(ValueError, match=r"ids must be in \[0, 1\)"):
        one.apply({"params": p1}, np.array([0, -1]))


def test_embed_negative_ids_match_flax():
    flax_nn = pytest.importorskip("flax.linen")
    jnp = pytest.importorskip("jax.numpy")
    ids = np.array([[0, -1, 6], [-7, -3, 2]])
    table = np.random.default_rng(5).standard_normal((7, 4)).astype(np.float32)
    want = flax_nn.Embed(7, 4).apply({"params": {"embedding": jnp.asarray(table)}}, ids)
    got = nn.Embed(7, 4).apply({"params": {"embedding": table}}, ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
