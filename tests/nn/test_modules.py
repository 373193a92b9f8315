"""Modules: naming, Flax-identical init (recorded vectors + live Flax), apply, born-sharded
init, eval_shape, and the seed recipe eval_shape -> get_axis_names -> logical_to_mesh -> pjit."""
import gc
import os
import sys

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import NamedSharding, P, nn, optim, random
from ctrainstate import partitioning as nn_partitioning
from ctrainstate.core import unfreeze
from ctrainstate.train_state import TrainState
from conftest import bytes_in_use, flat_tree as _flat

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")  # tests/data
sys.path.insert(0, DATA)
from make_flax_module_vectors import cases  # noqa: E402

VECTORS = np.load(os.path.join(DATA, "flax_module_vectors.npz"))




@pytest.mark.parametrize("name,build,seed,x", cases(), ids=[c[0] for c in cases()])
def test_init_and_apply_match_recorded_flax(name, build, seed, x):
    m = build(nn)
    v = m.init(random.PRNGKey(seed), x)
    got = _flat(v["params"])
    want = {k[len(name) + 8:]: VECTORS[k] for k in VECTORS.files if k.startswith(name + "/params/")}
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=f"{name}: {k}")
    np.testing.assert_allclose(np.asarray(m.apply(v, x)), VECTORS[f"{name}/output"], rtol=2e-5,
                               atol=2e-6)


@pytest.mark.parametrize("name,build,seed,x", cases(), ids=[c[0] for c in cases()])
def test_init_matches_live_flax(name, build, seed, x):
    jax = pytest.importorskip("jax")
    fnn = pytest.importorskip("flax.linen")
    key = np.asarray(random.fold_in(random.PRNGKey(seed), 77))  # a key not in the recordings
    v = build(nn).init(key, x)
    fv = build(fnn).init(jax.numpy.asarray(key), x)
    from flax.traverse_util import flatten_dict
    fl = {"/".join(k): np.asarray(a) for k, a in flatten_dict(fv["params"]).items()}
    got = _flat(v["params"])
    assert sorted(got) == sorted(fl)
    for k in fl:
        np.testing.assert_array_equal(np.asarray(got[k]), fl[k], err_msg=k)


def test_names_auto_explicit_and_setup():
    class Inner(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x) + nn.Dense(2, name="second")(x)

    class Outer(nn.Module):
        def setup(self):
            self.blocks = [Inner(), Inner()]
            self.head = nn.Dense(1)

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    v = Outer().init(random.PRNGKey(0), np.ones((1, 2), np.float32))
    assert sorted(v["params"]) == ["blocks_0", "blocks_1", "head"]
    assert sorted(v["params"]["blocks_0"]) == ["Dense_0", "second"]


def test_module_called_twice_reuses_params():
    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            d = nn.Dense(3, name="shared")
            return d(x) + d(x)

    x = np.ones((2, 3), np.float32)
    v = Twice().init(random.PRNGKey(0), x)
    assert list(v["params"]) == ["shared"]
    y = Twice().apply(v, x)
    single = nn.Dense(3).apply({"params": v["params"]["shared"]}, x)
    np.testing.assert_allclose(np.asarray(y), 2 * np.asarray(single), rtol=1e-6)


def test_module_errors():
    with pytest.raises(RuntimeError, match="unbound"):
        nn.Dense(3)(np.ones((1, 2), np.float32))

    class Dup(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, name="a")(x) + nn.Dense(2, name="a")(x)

    with pytest.raises(ValueError, match='named "a" already exists'):
        Dup().init(random.PRNGKey(0), np.ones((1, 2), np.float32))
    v = nn.Dense(3).init(random.PRNGKey(0), np.ones((1, 2), np.float32))
    with pytest.raises(Exception, match='No Variable named "kernel"'):
        nn.Dense(3).apply({"params": {}}, np.ones((1, 2), np.float32))
    with pytest.raises(TypeError, match="PRNG key"):
        nn.Dense(3).init(np.zeros(3, np.uint32), np.ones((1, 2), np.float32))
    assert v["params"]["kernel"].shape == (2, 3)


def test_eval_shape_allocates_nothing():
    class Big(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4096)(nn.Dense(4096)(x))

    gc.collect()
    before = bytes_in_use()
    cts.reset_peak_memory_stats()
    shapes = cts.eval_shape(Big().init, random.PRNGKey(0), np.ones((8, 1024), np.float32))
    # construction order names them: the outer Dense is Dense_0 (as in Flax)
    assert shapes["params"]["Dense_0"]["kernel"].shape == (4096, 4096)
    assert shapes["params"]["Dense_1"]["kernel"].shape == (1024, 4096)
    assert isinstance(shapes["params"]["Dense_0"]["bias"], cts.ShapeDtypeStruct)
    assert [d.memory_stats()["peak_bytes_in_use"] for d in cts.devices()] == before


RULES = (("batch", "data"), ("embed", None), ("mlp", "model"))


class MlpBlock(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        w1 = nn_partitioning.param_with_axes("wi", nn.initializers.lecun_normal(),
                                             (x.shape[-1], self.hidden), axes=("embed", "mlp"))
        w2 = nn_partitioning.param_with_axes("wo", nn.initializers.lecun_normal(),
                                             (self.hidden, x.shape[-1]), axes=("mlp", "embed"))
        h = nn.gelu(x @ w1)
        h = nn_partitioning.with_sharding_constraint(h, ("batch", "mlp"))
        return h @ w2


def test_born_sharded_no_device_holds_more_than_its_shard(mem_baseline):
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    x = np.ones((8, 256), np.float32)
    cts.reset_peak_memory_stats()
    with mesh, nn_partitioning.axis_rules(RULES):
        v = MlpBlock(4096).init(random.PRNGKey(0), x)
    shard_bytes = 2 * 256 * 4096 * 4 // 4  # two 4 MiB kernels split over model=4
    for i, d in enumerate(cts.devices()):  # mem_baseline is in cts.devices() order
        grew = d.memory_stats()["peak_bytes_in_use"] - mem_baseline[i]
        # the kernels' shards plus the (small) activations of the init forward pass
        assert shard_bytes <= grew <= shard_bytes + 8 * 4096 * 4 * 2, (d, grew)
    assert v["params"]["wi"].sharding == NamedSharding(mesh, P(None, "model"))
    assert v["params"]["wo"].sharding == NamedSharding(mesh, P("model", None))
    # same values as an unsharded init
    ref = MlpBlock(4096).init(random.PRNGKey(0), x)
    for k in ("wi", "wo"):
        np.testing.assert_array_equal(np.asarray(v["params"][k]), np.asarray(ref["params"][k]))


def test_seed_recipe_step_by_step_and_one_call_agree():
    """The Flax pjit recipe with ctrainstate names: eval_shape -> get_axis_names ->
    logical_to_mesh -> pjit(init, out_axis_resources); and the one-call born-sharded init."""
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    model = MlpBlock(64)
    x = np.ones((8, 32), np.float32)
    key = random.PRNGKey(0)
    with nn_partitioning.axis_rules(RULES):
        abstract = cts.eval_shape(model.init, key, x)                      # 1. shapes only
        logical = nn_partitioning.get_axis_names(abstract["params_axes"])  # 2. logical specs
        mesh_specs = nn_partitioning.logical_to_mesh(logical)             # 3. mesh specs
        assert mesh_specs == {"wi": P(None, "model"), "wo": P("model", None)}
        # get_axis_names gives a FrozenDict and init plain dicts, as in Flax >= 0.7: the
        # spec tree is unfrozen to match the params' (a FrozenDict is another pytree node)
        mesh_specs = unfreeze(mesh_specs)
        with mesh:
            p_init = cts.pjit(lambda k, x: model.init(k, x)["params"], in_axis_resources=None,
                              out_axis_resources=mesh_specs)            # 4. partitioned init
            params = p_init(key, x)
            one_call = model.init(key, x)["params"]                     # the one-call version
    for k in ("wi", "wo"):
        assert params[k].sharding == NamedSharding(mesh, mesh_specs[k])
        assert one_call[k].sharding == params[k].sharding
        np.testing.assert_array_equal(np.asarray(params[k]), np.asarray(one_call[k]))


def test_colab_block_axis_rules_init_trainstate_train():
    """The seed's Colab block: axis_rules + init + TrainState.create + a value_and_grad step."""
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    model = MlpBlock(32)
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    y = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    with mesh, nn_partitioning.axis_rules(RULES):
        xs = cts.device_put(x, NamedSharding(mesh, P("data", None)))
        ys = cts.device_put(y, NamedSharding(mesh, P("data", None)))
        variables = model.init(random.PRNGKey(0), xs)
        state = TrainState.create(apply_fn=model.apply, params=variables["params"],
                                  tx=optim.adam(1e-2))
        losses = []
        for _ in range(5):
            def loss_fn(p):
                return cnp.mean(cnp.square(state.apply_fn({"params": p}, xs) - ys))
            loss, grads = cts.value_and_grad(loss_fn)(state.params)
            assert grads["wi"].sharding == state.params["wi"].sharding
            state = state.apply_gradients(grads=grads)
            losses.append(float(loss))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert state.opt_state[0].mu["wi"].sharding == state.params["wi"].sharding


def test_param_with_axes_rank_mismatch_names_the_param_under_a_mesh():
    class Bad(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn_partitioning.param_with_axes("w", nn.initializers.zeros, (2, 3),
                                                   axes=("embed", "mlp", "extra"))

    mesh = cts.make_mesh((2, 4), ("data", "model"))
    with mesh, nn_partitioning.axis_rules(RULES):
        with pytest.raises(ValueError, match='"w"'):
            Bad().init(random.PRNGKey(0), np.ones(1, np.float32))


def test_dense_arguments_are_validated_like_flax():
    """DenseGeneral's axis out of range contracted another dimension silently; numpy-integer
    features and axes were refused; Dense(features=2.0) was accepted."""
    x = np.ones((2, 3), np.float32)
    k = random.PRNGKey(0)
    for axis in (4, -3):
        with pytest.raises(ValueError, match=f"axis {axis} is out of range"):
            nn.DenseGeneral(5, axis=axis).init(k, x)
    with pytest.raises(ValueError, match="repeated axis"):
        nn.DenseGeneral(5, axis=(1, -1)).init(k, x)
    assert nn.DenseGeneral(np.int64(2)).init(k, x)["params"]["kernel"].shape == (3, 2)
    assert nn.DenseGeneral(5, axis=np.int64(1)).init(k, x)["params"]["kernel"].shape == (3, 5)
    assert nn.Dense(np.int64(2)).init(k, x)["params"]["kernel"].shape == (3, 2)
    with pytest.raises(TypeError, match="features must be an int"):
        nn.Dense(features=2.0).init(k, x)
    with pytest.raises(ValueError, match="non-negative"):
        nn.Dense(features=-1).init(k, x)


def _dense_general_batched_ref(x, kernel, bias, nb, axes):
    """Flax's dot_general with batch dimensions, by numpy's einsum in float64."""
    nd = x.ndim
    letters = "abcdefghijkl"
    sx = letters[:nd]
    nf = kernel.ndim - nb - len(axes)
    sf = "uvwxyz"[:nf]
    keep = [d for d in range(nb, nd) if d not in axes]
    sk = sx[:nb] + "".join(sx[a] for a in axes) + sf
    so = sx[:nb] + "".join(sx[d] for d in keep) + sf
    y = np.einsum(f"{sx},{sk}->{so}", x.astype(np.float64), kernel.astype(np.float64))
    if bias is not None:
        y = y + bias.reshape(bias.shape[:nb] + (1,) * len(keep) + bias.shape[nb:])
    return y


@pytest.mark.parametrize("batch_dims,axis,features", [
    ((0,), -1, 5), ((0, 1), -1, (2, 3)), ((0,), (1, 3), 4), ((0,), 2, 3)])
def test_dense_general_batch_dims(batch_dims, axis, features, jax_ref):
    """Flax's batch_dims: a kernel and bias per batch index, initialised on Flax's flattened
    shapes; the output against numpy's einsum of the same parameters, the gradient through
    it, and (where installed) flax's parameters and output for the same key."""
    x = np.random.default_rng(7).standard_normal((3, 4, 5, 2)).astype(np.float32)
    m = nn.DenseGeneral(features, axis=axis, batch_dims=batch_dims,
                        bias_init=nn.initializers.normal(0.5))
    v = m.init(random.PRNGKey(2), x)["params"]
    nb = len(batch_dims)
    axes = tuple(a % 4 for a in ((axis,) if isinstance(axis, int) else axis))
    feats = (features,) if isinstance(features, int) else features
    assert v["kernel"].shape == x.shape[:nb] + tuple(x.shape[a] for a in axes) + feats
    assert v["bias"].shape == x.shape[:nb] + feats
    k, b = np.asarray(v["kernel"]), np.asarray(v["bias"])
    y = m.apply({"params": v}, x)
    want = _dense_general_batched_ref(x, k, b, nb, axes)
    assert y.shape == want.shape
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    w = np.random.default_rng(8).standard_normal(want.shape).astype(np.float32)
    g = cts.grad(lambda p: cnp.sum(m.apply({"params": p}, x) * w))(v)
    # d/dbias: w summed over the kept input axes; d/dkernel by numpy from the reference's form
    keep = [d for d in range(nb, 4) if d not in axes]
    gb = w.astype(np.float64).sum(axis=tuple(range(nb, nb + len(keep))))
    np.testing.assert_allclose(np.asarray(g["bias"]), gb, rtol=1e-5, atol=1e-5)
    eps = 1e-3
    kk = k.astype(np.float64).reshape(-1)
    for j in np.random.default_rng(9).choice(kk.size, 5, replace=False):
        d = np.zeros_like(kk)
        d[j] = eps
        up = _dense_general_batched_ref(x, (kk + d).reshape(k.shape), b, nb, axes)
        dn = _dense_general_batched_ref(x, (kk - d).reshape(k.shape), b, nb, axes)
        fd = float(((up - dn) * w).sum() / (2 * eps))
        assert abs(float(np.asarray(g["kernel"]).reshape(-1)[j]) - fd) <= 1e-3 * (1 + abs(fd))
    def flax_side(jax):
        fnn = pytest.importorskip("flax.linen")
        fm = fnn.DenseGeneral(features, axis=axis, batch_dims=batch_dims,
                              bias_init=jax.nn.initializers.normal(0.5))
        fv = fm.init(jax.random.PRNGKey(2), x)["params"]
        return {"kernel": fv["kernel"], "bias": fv["bias"], "y": fm.apply({"params": fv}, x)}

    want = jax_ref("flax", flax_side)
    np.testing.assert_array_equal(k, want["kernel"])
    np.testing.assert_array_equal(b, want["bias"])
    np.testing.assert_allclose(np.asarray(y), want["y"], rtol=1e-5, atol=1e-5)


def test_dense_general_batch_dims_errors():
    x = np.ones((2, 3, 4), np.float32)
    k = random.PRNGKey(0)
    for bad in ((1,), (0, 2), (0, 0), (-1,)):
        with pytest.raises(ValueError, match="consecutive leading dimensions"):
            nn.DenseGeneral(5, batch_dims=bad).init(k, x)
    with pytest.raises(ValueError, match="contracts batch dimension"):
        nn.DenseGeneral(5, axis=0, batch_dims=(0,)).init(k, x)
    with pytest.raises(ValueError, match="more axes than the input's rank"):
        nn.DenseGeneral(5, axis=0, batch_dims=(0, 1, 2, 3)).init(k, x)


def test_dropout_keeps_a_host_input_dtype():
    import ml_dtypes
    k = random.PRNGKey(0)
    for dt in (np.float16, ml_dtypes.bfloat16):
        for rate in (0.5, 1.0):
            y = nn.Dropout(rate).apply({}, np.ones((2, 3), dt), deterministic=False,
                                       rngs={"dropout": k})
            assert y.dtype == dt, (dt, rate)


def _capture_model(m):
    class Block(m.Module):
        @m.compact
        def __call__(self, x):
            return m.Dense(3)(x) * 2.0

        def extra(self, x):
            return x + 1.0

    class Net(m.Module):
        @m.compact
        def __call__(self, x):
            b = Block()
            h = b(x)
            h = b(h)                      # one submodule called twice: two entries
            return m.Dense(2)(b.extra(h))
    return Net


def _tree_np(t):
    if isinstance(t, dict):
        return {k: _tree_np(v) for k, v in t.items()}
    if isinstance(t, tuple):
        return tuple(_tree_np(v) for v in t)
    return np.asarray(t)


def test_capture_intermediates(jax_ref):
    """Flax's capture_intermediates: every __call__'s output in 'intermediates' (a tuple per
    call site), a filter function choosing methods; 'intermediates' becomes mutable, so apply
    returns (output, variables) even with mutable=False."""
    Net = _capture_model(nn)
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    v = Net().init(random.PRNGKey(0), x)
    assert "intermediates" not in v
    y, st = Net().apply(v, x, capture_intermediates=True)
    inter = st["intermediates"]
    assert sorted(st) == ["intermediates"]
    assert sorted(inter) == ["Block_0", "Dense_0", "__call__"]
    np.testing.assert_array_equal(np.asarray(inter["__call__"][0]), np.asarray(y))
    assert len(inter["Block_0"]["__call__"]) == 2 and len(inter["Block_0"]["Dense_0"]["__call__"]) == 2
    # the entries are the values the model computed: recompute them from the parameters
    p = v["params"]
    k1, b1 = np.asarray(p["Block_0"]["Dense_0"]["kernel"]), np.asarray(p["Block_0"]["Dense_0"]["bias"])
    h1 = (x @ k1 + b1) * 2.0
    h2 = (h1 @ k1 + b1) * 2.0
    np.testing.assert_allclose(np.asarray(inter["Block_0"]["__call__"][0]), h1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(inter["Block_0"]["__call__"][1]), h2, rtol=1e-5, atol=1e-6)
    only_extra = Net().apply(v, x, capture_intermediates=lambda mdl, name: name == "extra")[1]
    assert list(only_extra["intermediates"]) == ["Block_0"]
    np.testing.assert_allclose(np.asarray(only_extra["intermediates"]["Block_0"]["extra"][0]),
                               h2 + 1.0, rtol=1e-5, atol=1e-6)
    # with another mutable collection, and at init (Flax keeps them when asked)
    _, both = Net().apply(v, x, capture_intermediates=True, mutable=["batch_stats"])
    assert "intermediates" in both
    vi = Net().init(random.PRNGKey(0), x, capture_intermediates=True)
    assert "intermediates" in vi and "params" in vi
    with pytest.raises(TypeError, match="capture_intermediates must be a bool or a function"):
        Net().apply(v, x, capture_intermediates="yes")
    def flax_side(jax):
        fnn = pytest.importorskip("flax.linen")
        fy, fst = _capture_model(fnn)().apply({"params": _tree_np(p)}, jax.numpy.asarray(x),
                                              capture_intermediates=True)
        return _flat(_tree_np(fst["intermediates"]))

    got, want = _flat(_tree_np(st["intermediates"])), jax_ref("flax", flax_side)
    assert sorted(got) == sorted(want)
    for k in got:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_jit_init_of_an_embedding_the_model_axis_does_not_divide_is_born_replicated_there():
    """jit(model.init) of a GPT-2 embedding (50257 tokens) with 'vocab' on an 'mp' axis of 2:
    under jit XLA replicates the dimension the axis does not divide (eager init raises)."""
    class Model(nn.Module):
        @nn.compact
        def __call__(self, ids):
            emb = nn.Embed(50257, 16, embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(0.02), ("vocab", "embed")))
            w = nn_partitioning.param_with_axes("wpe", nn.initializers.normal(0.02), (50257, 16),
                                                axes=("vocab", "embed"))
            h = nn.DenseGeneral((5, 4), kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), ("embed", "vocab", "heads")))(emb(ids) + w[ids])
            return h

    mesh = cts.make_mesh((4, 2), ("data", "mp"))
    rules = (("vocab", "mp"), ("embed", None), ("heads", "data"))
    ids = np.array([[1, 50256]], np.int32)
    with mesh, nn_partitioning.axis_rules(rules):
        v = cts.jit(Model().init)(random.PRNGKey(0), ids)
        assert cts.jit(Model().apply)(v, ids).shape == (1, 2, 5, 4)
        with pytest.raises(ValueError, match=r"50257 is not divisible by mesh axes \('mp',\)"):
            Model().init(random.PRNGKey(0), ids)
    p = nn.meta.unbox(v["params"])   # (outside the mesh: an eager constraint would raise)
    assert p["Embed_0"]["embedding"].sharding == NamedSharding(mesh, P(None, None))
    assert p["wpe"].sharding == NamedSharding(mesh, P(None, None))
    assert p["DenseGeneral_0"]["kernel"].sharding == NamedSharding(mesh, P(None, None, "data"))
    # the same values as an init without a mesh: only the placement differs
    ref = nn.meta.unbox(Model().init(random.PRNGKey(0), ids)["params"])
    np.testing.assert_array_equal(np.asarray(p["Embed_0"]["embedding"]),
                                  np.asarray(ref["Embed_0"]["embedding"]))
