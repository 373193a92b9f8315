"""Modules: naming, Flax-identical init (against flax's recorded values), apply, born-sharded
init, eval_shape, and the seed recipe eval_shape -> get_axis_names -> logical_to_mesh -> pjit.

Flax's side of a comparison is recorded (conftest's ``jax_ref``: tests/data/recorded/
test_modules.npz; tests/data/flax_module_vectors.npz for the ``cases()`` of
make_flax_module_vectors.py): the README's test command runs these tests without flax."""
import gc
import os
import re
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
def test_init_matches_flax_for_another_key(name, build, seed, x, jax_ref):
    key = np.asarray(random.fold_in(random.PRNGKey(seed), 77))  # a key not in VECTORS

    def flax_side(jax, fnn):
        from flax.traverse_util import flatten_dict
        fv = build(fnn).init(jax.numpy.asarray(key), x)
        return {"/".join(k): a for k, a in flatten_dict(fv["params"]).items()}

    fl = jax_ref("flax", flax_side)
    v = build(nn).init(key, x)
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
    # Under the sanitizers (tools/sanitize.sh), where each replica's draws run ~15x slower, a
    # vocabulary of 4099, which 'mp' does not divide either: the same paths, draws still above
    # the CPU kernels' parallel threshold (32768 elements); the README's run draws GPT-2's.
    vocab = 4099 if os.environ.get("CTRAINSTATE_SANITIZED") == "1" else 50257
    class Model(nn.Module):
        @nn.compact
        def __call__(self, ids):
            emb = nn.Embed(vocab, 16, embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(0.02), ("vocab", "embed")))
            w = nn_partitioning.param_with_axes("wpe", nn.initializers.normal(0.02), (vocab, 16),
                                                axes=("vocab", "embed"))
            h = nn.DenseGeneral((5, 4), kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), ("embed", "vocab", "heads")))(emb(ids) + w[ids])
            return h

    mesh = cts.make_mesh((4, 2), ("data", "mp"))
    rules = (("vocab", "mp"), ("embed", None), ("heads", "data"))
    ids = np.array([[1, vocab - 1]], np.int32)
    with mesh, nn_partitioning.axis_rules(rules):
        v = cts.jit(Model().init)(random.PRNGKey(0), ids)
        assert cts.jit(Model().apply)(v, ids).shape == (1, 2, 5, 4)
        with pytest.raises(ValueError, match=rf"{vocab} is not divisible by mesh axes \('mp',\)"):
            Model().init(random.PRNGKey(0), ids)
    p = nn.meta.unbox(v["params"])   # (outside the mesh: an eager constraint would raise)
    assert p["Embed_0"]["embedding"].sharding == NamedSharding(mesh, P(None, None))
    assert p["wpe"].sharding == NamedSharding(mesh, P(None, None))
    assert p["DenseGeneral_0"]["kernel"].sharding == NamedSharding(mesh, P(None, None, "data"))
    # the same values as an init without a mesh: only the placement differs
    ref = nn.meta.unbox(Model().init(random.PRNGKey(0), ids)["params"])
    np.testing.assert_array_equal(np.asarray(p["Embed_0"]["embedding"]),
                                  np.asarray(ref["Embed_0"]["embedding"]))


# --- Flax-parity regressions of the module system (nn/module.py, nn/scope.py): each behaviour
# checked by hand and against flax's recorded values.

def _with_flax_init_errors(models, jax_ref):
    """[(what Flax's init of a (2, 3) input raises, ours)] for each model of models(nn_mod)."""
    errors = jax_ref("flax", lambda jax, fnn: [
        _raised(lambda: m.init(jax.random.PRNGKey(0), jax.numpy.ones((2, 3))))
        for m in models(fnn)])
    ours = models(nn)
    assert len(errors) == len(ours)
    return list(zip(errors, ours))


def _raised(fn):
    """What ``fn()`` raises, as a recording holds it: the module-qualified names of the
    exception's class and of its bases (an isinstance check reads them) and its message; None
    when fn returns."""
    try:
        fn()
    except Exception as e:   # noqa: BLE001 (any error is the value recorded)
        return {"classes": [f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__],
                "message": str(e)}
    return None


def _clash_models(nn_mod, ones, zeros):
    class ParamThenModule(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            self.param("Dense_0", ones, (3,))
            return nn_mod.Dense(2)(x)

    class ModuleThenParam(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            y = nn_mod.Dense(2)(x)
            self.param("Dense_0", ones, (3,))
            return y

    class StatThenModule(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            self.variable("stats", "inner", zeros)
            return nn_mod.Dense(2, name="inner")(x)

    class SetupClash(nn_mod.Module):
        def setup(self):
            self.d = nn_mod.Dense(2)
            self.w = self.param("d", ones, (3,))

        def __call__(self, x):
            return self.d(x)

    return [ParamThenModule(), ModuleThenParam(), StatThenModule(), SetupClash()]


def test_variable_and_submodule_sharing_a_name_is_refused():
    # Flax reserves a name for one submodule or for variables (one per collection): a param
    # named like a submodule would read (or overwrite) the submodule's whole subtree.
    x = np.ones((2, 3), np.float32)
    zeros = lambda: np.zeros((), np.float32)
    for m in _clash_models(nn, nn.initializers.ones, zeros):
        with pytest.raises(ValueError, match="Dense_0|inner|\"d\""):
            m.init(random.PRNGKey(0), x)


def test_variables_sharing_a_name_across_collections_is_allowed():
    # Flax allows one name in several collections (a param and a batch stat 'mean')
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("mean", nn.initializers.ones, (3,))
            s = self.variable("stats", "mean", lambda: np.full((3,), 2.0, np.float32))
            return x * w + s.value

    v = M().init(random.PRNGKey(0), np.ones((2, 3), np.float32))
    assert sorted(v) == ["params", "stats"]
    np.testing.assert_array_equal(np.asarray(M().apply(v, np.ones((2, 3), np.float32))),
                                  np.full((2, 3), 3.0, np.float32))


def test_variable_and_submodule_sharing_a_name_matches_flax(jax_ref):
    x = np.ones((2, 3), np.float32)

    def flax_side(jax, fnn):
        fl = _clash_models(fnn, fnn.initializers.ones, lambda: jax.numpy.zeros(()))
        return [_raised(lambda: fm.init(jax.random.PRNGKey(0), jax.numpy.asarray(x))) for fm in fl]

    errors = jax_ref("flax", flax_side)
    ct = _clash_models(nn, nn.initializers.ones, lambda: np.zeros((), np.float32))
    assert len(errors) == len(ct)
    for error, cm in zip(errors, ct):
        assert "flax.errors.NameInUseError" in error["classes"], error
        with pytest.raises(nn.scope.NameInUseError):
            cm.init(random.PRNGKey(0), x)


def _variables_model(nn_mod, zeros):
    class Inner(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            return nn_mod.Dense(2)(x)

    class M(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            self.variable("stats", "c", zeros)
            a = Inner()
            a(x)
            b = nn_mod.Dense(3)
            b(x)
            return a.variables, b.variables, self.variables

    class S(nn_mod.Module):
        def setup(self):
            self.enc = nn_mod.Dense(4)

        def __call__(self, x):
            return self.enc(x)

    return M(), S()


def _shapes(tree):
    if isinstance(tree, dict) or hasattr(tree, "items"):
        return {k: _shapes(v) for k, v in tree.items()}
    return tuple(np.shape(tree))


def test_submodule_variables_are_its_own_subtree():
    # Flax's Module.variables is the module's scope's view: a child sees its own params
    # (relative to its path), not the root's; collections it has nothing in are left out.
    x = np.ones((2, 3), np.float32)
    m, s = _variables_model(nn, lambda: np.zeros((), np.float32))
    v = m.init(random.PRNGKey(0), x)
    va, vb, vroot = m.apply(v, x)
    assert _shapes(va) == {"params": {"Dense_0": {"kernel": (3, 2), "bias": (2,)}}}
    assert _shapes(vb) == {"params": {"kernel": (3, 3), "bias": (3,)}}
    assert sorted(vroot) == ["params", "stats"]
    sv = s.init(random.PRNGKey(0), x)
    bound = s.bind(sv)
    assert _shapes(bound.enc.variables) == {"params": {"kernel": (3, 4), "bias": (4,)}}
    np.testing.assert_array_equal(np.asarray(bound.enc.variables["params"]["kernel"]),
                                  np.asarray(sv["params"]["enc"]["kernel"]))


def test_submodule_variables_match_flax(jax_ref):
    x = np.ones((2, 3), np.float32)

    def flax_side(jax, fnn):
        jnp = jax.numpy
        fm, fs = _variables_model(fnn, lambda: jnp.zeros(()))
        fv = fm.init(jax.random.PRNGKey(0), jnp.asarray(x))
        fsv = fs.init(jax.random.PRNGKey(0), jnp.asarray(x))
        return {"apply": [_shapes(t) for t in fm.apply(fv, jnp.asarray(x))],
                "enc": _shapes(fs.bind(fsv).enc.variables)}

    want = jax_ref("flax", flax_side)
    cm, cs = _variables_model(nn, lambda: np.zeros((), np.float32))
    cv = cm.init(random.PRNGKey(0), x)
    assert [_shapes(t) for t in cm.apply(cv, x)] == want["apply"]
    csv = cs.init(random.PRNGKey(0), x)
    assert _shapes(cs.bind(csv).enc.variables) == want["enc"]


def test_existing_param_of_the_wrong_shape_is_refused():
    # Flax compares each existing parameter with the shape its initializer would make
    # (ScopeParamShapeError): Dense(4) applied to Dense(1)'s params must not silently return a
    # (2, 1) output, and an Embed / LayerNorm of other sizes must say which parameter differs.
    x = np.ones((2, 3), np.float32)
    v1 = nn.Dense(1).init(random.PRNGKey(0), x)
    with pytest.raises(nn.scope.ScopeParamShapeError,
                       match=r'"kernel" in "/".*shape \(3, 4\).*shape \(3, 1\)'):
        nn.Dense(4).apply(v1, x)
    with pytest.raises(ValueError, match=r'"embedding".*\(20, 8\).*\(10, 8\)'):
        nn.Embed(20, 8).apply(nn.Embed(10, 8).init(random.PRNGKey(0), np.array([0])),
                              np.array([1]))

    class Net(nn.Module):
        feats: int

        @nn.compact
        def __call__(self, x):
            return nn.LayerNorm()(nn.Dense(self.feats)(x))

    v = Net(3).init(random.PRNGKey(0), x)
    v["params"]["Dense_0"]["kernel"] = np.ones((3, 1), np.float32)   # a wrong checkpoint entry
    v["params"]["Dense_0"]["bias"] = np.ones((1,), np.float32)
    with pytest.raises(ValueError, match=r'"kernel" in "/Dense_0"'):
        Net(3).apply(v, x)
    # the right shapes in another dtype pass (Flax checks shapes only)
    half = {"params": {k: np.asarray(a).astype(np.float16) for k, a in v1["params"].items()}}
    assert np.shape(nn.Dense(1).apply(half, x)) == (2, 1)


def test_param_shape_check_keys_closures_by_what_they_compute(monkeypatch):
    """The shape check runs each initializer abstractly once per distinct declaration: a
    closure made anew at every call (as examples/siren.py does) is keyed by its code and the
    values it closes over, so a second apply reruns nothing, and a closure over another size
    is another key, whose mismatch is still caught."""
    from ctrainstate._src.nn import scope as S

    def sized_zeros(n):   # a new closure per call; its shape comes from the closed-over n
        def init(key):
            return np.zeros((n,), np.float32)
        return init

    class Net(nn.Module):
        n: int

        @nn.compact
        def __call__(self, x):
            return x * self.param("w", sized_zeros(self.n)).sum()

    calls = []
    real = S._expected_shapes
    monkeypatch.setattr(S, "_expected_shapes", lambda *a: calls.append(1) or real(*a))
    S._SHAPES_CACHE.clear()
    x = np.ones((2,), np.float32)
    v3 = Net(3).init(random.PRNGKey(0), x)
    Net(3).apply(v3, x)
    first = len(calls)
    assert first == 1                     # computed once for this declaration ...
    Net(3).apply(v3, x)
    assert len(calls) == first            # ... and not again for the same one
    with pytest.raises(S.ScopeParamShapeError, match=r'"w".*shape \(5,\).*shape \(3,\)'):
        Net(5).apply(v3, x)               # the closure over 5 is another key
    assert len(calls) == first + 1

    class Holder:                         # hashed by identity: still keyed, per object
        def __init__(self, n):
            self.n = n

    def init_from(h):
        return lambda key: np.zeros((h.n,), np.float32)

    class Net2(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x * self.param("w", init_from(Holder(2))).sum()

    v = Net2().init(random.PRNGKey(0), x)
    Net2().apply(v, x)                    # a new Holder per call: a new key, still right


def test_existing_param_of_the_wrong_shape_matches_flax(jax_ref):
    x = np.ones((2, 3), np.float32)
    x5 = np.ones((2, 5), np.float32)
    cases = [(lambda m: m.Dense(1), lambda m: m.Dense(4), x, x),
             (lambda m: m.LayerNorm(), lambda m: m.LayerNorm(), x, x5),   # 3 features vs 5
             (lambda m: m.DenseGeneral((2, 2)), lambda m: m.DenseGeneral((2, 3)), x, x)]

    def flax_side(jax, fnn):
        jnp = jax.numpy
        out = []
        for make_init, make_apply, xi, xa in cases:
            fv = make_init(fnn).init(jax.random.PRNGKey(0), jnp.asarray(xi))
            out.append(_raised(lambda: make_apply(fnn).apply(fv, jnp.asarray(xa))))
        return out

    errors = jax_ref("flax", flax_side)
    assert len(errors) == len(cases)
    for (make_init, make_apply, xi, xa), error in zip(cases, errors):
        assert "flax.errors.ScopeParamShapeError" in error["classes"], error
        cv = make_init(nn).init(random.PRNGKey(0), xi)
        with pytest.raises(nn.scope.ScopeParamShapeError) as ce:
            make_apply(nn).apply(cv, xa)
        # the same sentence (Flax appends a link to its docs)
        assert error["message"].startswith(str(ce.value))


def _free_module_models(nn_mod):
    class W(nn_mod.Module):
        inner: nn_mod.Module

        @nn_mod.compact
        def __call__(self, x):
            return self.inner(x)

    class CompactFree(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            # parent=None: a free module, adopted by W as 'inner' (not this module's Dense_0)
            return W(nn_mod.Dense(3, parent=None))(x) + W(nn_mod.Dense(3))(x)

    class SetupFree(nn_mod.Module):
        def setup(self):
            self.w = W(nn_mod.Dense(3, parent=None))
            self.e = nn_mod.Dense(3, parent=None)

        def __call__(self, x):
            return self.w(x) + self.e(x)

    class Copies(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            d = nn_mod.Dense(3)
            y = d(x)
            y = y + d.copy(features=3)(x)              # a new submodule: Dense_1
            return y + d.copy(name="named")(x)

    return [CompactFree(), SetupFree(), Copies()]


def _param_paths(tree, prefix=()):
    out = []
    for k, v in tree.items():
        if isinstance(v, dict) or hasattr(v, "items"):
            out += _param_paths(v, prefix + (k,))
        else:
            out.append("/".join(prefix + (k,)))
    return sorted(out)


def test_parent_none_copy_and_clone_name_modules_as_flax():
    # Flax's parent=None makes a free module: passed to W it is adopted as W's 'inner'
    # (params W_0/inner) where an attached one stays the creator's Dense_0; in setup it is
    # adopted under the attribute's name. copy() inside @compact is a new auto-named submodule.
    x = np.ones((2, 3), np.float32)
    compact_free, setup_free, copies = _free_module_models(nn)
    assert _param_paths(compact_free.init(random.PRNGKey(0), x)["params"]) == [
        "Dense_0/bias", "Dense_0/kernel", "W_0/inner/bias", "W_0/inner/kernel"]
    assert _param_paths(setup_free.init(random.PRNGKey(0), x)["params"]) == [
        "e/bias", "e/kernel", "w/inner/bias", "w/inner/kernel"]
    assert _param_paths(copies.init(random.PRNGKey(0), x)["params"]) == [
        "Dense_0/bias", "Dense_0/kernel", "Dense_1/bias", "Dense_1/kernel", "named/bias",
        "named/kernel"]
    d = nn.Dense(3, use_bias=False, name="d")
    c = d.clone(features=4)
    assert (c.features, c.use_bias, c.name, c.scope, c.parent) == (4, False, "d", None, None)
    with pytest.raises(TypeError):
        nn.Dense(3).clone(foo=1)
    with pytest.raises(TypeError, match="parent"):
        nn.Dense(3, parent=object())


def test_unbind_get_put_variable_and_has_rng():
    x = np.ones((2, 3), np.float32)

    class Enc(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x)

    class AE(nn.Module):
        def setup(self):
            self.encoder = Enc()
            self.decoder = nn.Dense(3)

        def __call__(self, x):
            return self.decoder(self.encoder(x))

    v = AE().init(random.PRNGKey(0), x)
    enc, ev = AE().bind(v).encoder.unbind()
    assert enc.scope is None and enc.name is None
    assert _param_paths(ev["params"]) == ["Dense_0/bias", "Dense_0/kernel"]
    k = np.asarray(v["params"]["encoder"]["Dense_0"]["kernel"])
    b = np.asarray(v["params"]["encoder"]["Dense_0"]["bias"])
    np.testing.assert_allclose(np.asarray(enc.apply(ev, x)), x @ k + b, rtol=1e-6)
    with pytest.raises(ValueError, match="not bound"):
        Enc().unbind()

    class S(nn.Module):
        @nn.compact
        def __call__(self, x):
            self.put_variable("state", "a", 1.0)
            return (self.get_variable("state", "a"), self.get_variable("state", "b", 7),
                    self.has_rng("dropout"), self.has_rng("params"))

    out, state = S().apply({}, x, mutable=["state"], rngs={"dropout": random.PRNGKey(1)})
    assert out == (1.0, 7, True, False) and state == {"state": {"a": 1.0}}
    with pytest.raises(ValueError, match="immutable"):
        S().apply({}, x)


def test_parent_none_copy_clone_unbind_match_flax(jax_ref):
    x = np.ones((2, 3), np.float32)

    def flax_side(jax, fnn):
        out = []
        for fm in _free_module_models(fnn):
            fv = fm.init(jax.random.PRNGKey(0), jax.numpy.asarray(x))
            out.append({"paths": _param_paths(fv["params"]),
                        "y": fm.apply(fv, jax.numpy.asarray(x))})
        fc = fnn.Dense(3, name="d").clone(features=4)
        return {"models": out, "clone": (fc.features, fc.name, fc.parent)}

    want = jax_ref("flax", flax_side)
    models = _free_module_models(nn)
    assert len(models) == len(want["models"])
    for cm, fw in zip(models, want["models"]):
        cv = cm.init(random.PRNGKey(0), x)
        assert _param_paths(cv["params"]) == fw["paths"]
        np.testing.assert_allclose(np.asarray(cm.apply(cv, x)), fw["y"], rtol=1e-5, atol=1e-6)
    cc = nn.Dense(3, name="d").clone(features=4)
    assert (cc.features, cc.name, cc.parent) == want["clone"]


def _helper_model(nn_mod):
    class M(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            x = self.block(x)
            return self.block(x) + self._private(x) + nn_mod.Dense(3)(x)

        def block(self, x):          # a public (wrapped) method that is not @compact
            return nn_mod.Dense(3)(x)

        def _private(self, x):
            return nn_mod.Dense(3, name="p")(x)

    return M()


def test_helper_method_called_from_compact_creates_submodules():
    # Flax: while a module is in its @compact method, a helper method of the same module may
    # create submodules; they take the module's auto names in creation order
    x = np.ones((2, 3), np.float32)
    m = _helper_model(nn)
    v = m.init(random.PRNGKey(0), x)
    assert sorted(v["params"]) == ["Dense_0", "Dense_1", "Dense_2", "p"]
    p = {k: (np.asarray(d["kernel"]), np.asarray(d["bias"])) for k, d in v["params"].items()}
    lin = lambda name, h: h @ p[name][0] + p[name][1]   # noqa: E731
    h1 = lin("Dense_0", x)     # both block() calls: Dense_0 then Dense_1
    want = lin("Dense_1", h1) + lin("p", h1) + lin("Dense_2", h1)
    np.testing.assert_allclose(np.asarray(m.apply(v, x)), want, rtol=1e-5, atol=1e-6)
    # called on its own (not from the compact method) it is an error, as in Flax
    with pytest.raises(RuntimeError, match="unbound"):
        m.apply(v, x, method="block")


def _init_both(make, jax_ref):
    """The model ``make(lib)`` initialised by flax (recorded) and by ctrainstate on
    ones((2, 3)); the param paths and kernels must be the same. Returns (flax's param paths,
    kernels and output, our variables, x)."""
    x = np.ones((2, 3), np.float32)

    def flax_side(jax, fnn):
        fv = make(fnn).init(jax.random.PRNGKey(0), jax.numpy.asarray(x))
        return {"paths": _param_paths(fv["params"]),
                "kernels": {k: fv["params"][k]["kernel"] for k in fv["params"]},
                "y": make(fnn).apply(fv, jax.numpy.asarray(x))}

    want = jax_ref("flax", flax_side)
    cv = make(nn).init(random.PRNGKey(0), x)
    assert _param_paths(cv["params"]) == want["paths"]
    assert sorted(want["kernels"]) == sorted(cv["params"])
    for k, kernel in want["kernels"].items():
        np.testing.assert_array_equal(np.asarray(cv["params"][k]["kernel"]), kernel)
    return want, cv, x


def test_helper_method_called_from_compact_matches_flax(jax_ref):
    want, cv, x = _init_both(_helper_model, jax_ref)
    np.testing.assert_allclose(np.asarray(_helper_model(nn).apply(cv, x)), want["y"],
                               rtol=1e-5, atol=1e-6)


def test_non_string_variable_name_and_bad_mutable_filter_are_refused():
    # Flax: 'The type of scope ... should be string' (TypeError) and InvalidFilterError; here a
    # TypeError naming the value, before anything runs (an int key in the params tree would
    # break checkpoints later; mutable=3 crashed with 'int is not iterable')
    x = np.ones((2, 3), np.float32)

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return self.param(3, nn.initializers.ones, (2,))

    with pytest.raises(TypeError, match="strings, got 3"):
        M().init(random.PRNGKey(0), x)
    v = nn.Dense(2).init(random.PRNGKey(0), x)
    for bad in (3, ["params", 1], nn.DenyList(4)):
        with pytest.raises(TypeError, match="mutable must be"):
            nn.Dense(2).apply(v, x, mutable=bad)
    with pytest.raises(TypeError, match="mutable must be"):
        nn.Dense(2).init(random.PRNGKey(0), x, mutable=2.5)
    # the valid kinds still work
    for ok in (True, False, "params", ["params"], ("params", "stats"), nn.DenyList("x")):
        nn.Dense(2).apply(v, x, mutable=ok)


def _nowrap_model(nn_mod):
    class M(nn_mod.Module):
        width: int = 3

        @nn_mod.nowrap
        def make(self, n):
            return nn_mod.Dense(n * self.width, use_bias=False)

        def setup(self):
            self.first = self.make(1)
            self.rest = [self.make(2), self.make(1)]

        def __call__(self, x):
            for layer in [self.first, *self.rest]:
                x = layer(x)
            return x

    return M()


def test_nowrap_helper_builds_submodules_for_its_caller():
    x = np.ones((2, 3), np.float32)
    m = _nowrap_model(nn)
    v = m.init(random.PRNGKey(0), x)
    # named by the setup() attributes they are assigned to (the helper adds no level)
    assert _param_paths(v["params"]) == ["first/kernel", "rest_0/kernel", "rest_1/kernel"]
    assert np.shape(v["params"]["rest_0"]["kernel"]) == (3, 6)
    assert not getattr(type(m).make, "_ct_wrapped", False)
    # flax.linen's top-level initializer names
    assert np.asarray(nn.zeros(None, (2,))).tolist() == [0.0, 0.0]
    assert np.asarray(nn.ones_init()(None, (1, 2))).tolist() == [[1.0, 1.0]]
    assert np.asarray(nn.zeros_init()(None, (1,))).tolist() == [0.0]


def test_nowrap_helper_matches_flax(jax_ref):
    _init_both(_nowrap_model, jax_ref)


def _frozen_attr_model(nn_mod):
    class M(nn_mod.Module):
        feats: list
        layers: list = None

        def setup(self):
            self.sizes = [1, 2]
            self.table = {"a": nn_mod.Dense(2)}
            self.blocks = [nn_mod.Dense(2)]
            self.cfg = {"k": [1]}

        def __call__(self, x):
            # Flax-valid code: tuple concatenation and hashing of the frozen attributes
            shape = self.sizes + (3,)
            key = hash((self.feats, self.sizes))
            return ([type(a).__name__ for a in (self.feats, self.layers, self.sizes, self.table,
                                                self.blocks, self.cfg, self.cfg["k"])],
                    shape, isinstance(key, int), self.table["a"](x) + self.blocks[0](x))

    return M([4, 5], [nn_mod.Dense(2)])


def test_bound_module_attributes_are_frozen():
    # Flax's _freeze_attr: a bound module's fields and its setup() attributes have lists as
    # tuples and dicts as FrozenDicts (nested), so Flax code may concatenate or hash them
    x = np.ones((2, 3), np.float32)
    m = _frozen_attr_model(nn)
    (types, shape, hashed, _), v = m.init_with_output(random.PRNGKey(0), x)
    assert types == ["tuple", "tuple", "tuple", "FrozenDict", "tuple", "FrozenDict", "tuple"]
    assert shape == (1, 2, 3) and hashed
    assert _param_paths(v["params"]) == ["blocks_0/bias", "blocks_0/kernel", "table_a/bias",
                                         "table_a/kernel"]
    assert type(m.feats) is list       # the user's (unbound) instance is left as it was

    class Mut(nn.Module):
        def setup(self):
            self.cfg = {"k": 1}

        def __call__(self, x):
            self.cfg["k"] = 2
            return x

    with pytest.raises(TypeError, match="immutable"):
        Mut().init(random.PRNGKey(0), x)


def test_bound_module_attributes_are_frozen_like_flax(jax_ref):
    x = np.ones((2, 3), np.float32)

    def flax_side(jax, fnn):
        (ft, fs, fh, fo), fv = _frozen_attr_model(fnn).init_with_output(
            jax.random.PRNGKey(0), jax.numpy.asarray(x))
        return {"attrs": (ft, fs, fh), "paths": _param_paths(fv["params"]), "y": fo}

    want = jax_ref("flax", flax_side)
    (ct, cs, ch, co), cv = _frozen_attr_model(nn).init_with_output(random.PRNGKey(0), x)
    assert (ct, cs, ch) == want["attrs"]
    assert _param_paths(cv["params"]) == want["paths"]
    np.testing.assert_allclose(np.asarray(co), want["y"], rtol=1e-6)


def _setup_compact_clash(nn_mod):
    class M(nn_mod.Module):
        def setup(self):
            self.d = nn_mod.Dense(3)

        @nn_mod.compact
        def __call__(self, x):
            return self.d(x) + nn_mod.Dense(3, name="d")(x)

    return M()


def test_compact_submodule_may_not_reuse_a_setup_name():
    # Flax reserves setup()'s names for the module's lifetime: a compact Dense(name='d') next
    # to setup's self.d is a NameInUseError (it silently shared d's parameters here)
    x = np.ones((2, 3), np.float32)
    with pytest.raises(nn.scope.NameInUseError, match='"d"'):
        _setup_compact_clash(nn).init(random.PRNGKey(0), x)

    class Ok(nn.Module):          # setup + compact with distinct names still works, twice
        def setup(self):
            self.d = nn.Dense(3)

        @nn.compact
        def __call__(self, x):
            return self.d(x) + nn.Dense(3)(x)

    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            m = Ok()
            return m(m(x))

    v = Twice().init(random.PRNGKey(0), x)
    assert _param_paths(v["params"]) == ["Ok_0/Dense_0/bias", "Ok_0/Dense_0/kernel",
                                         "Ok_0/d/bias", "Ok_0/d/kernel"]


def test_compact_submodule_may_not_reuse_a_setup_name_like_flax(jax_ref):
    x = np.ones((2, 3), np.float32)
    error = jax_ref("flax", lambda jax, fnn: _raised(
        lambda: _setup_compact_clash(fnn).init(jax.random.PRNGKey(0), jax.numpy.asarray(x))))
    assert "flax.errors.NameInUseError" in error["classes"], error
    with pytest.raises(nn.scope.NameInUseError):
        _setup_compact_clash(nn).init(random.PRNGKey(0), x)


def _setup_param_clash(nn_mod):
    class M(nn_mod.Module):
        def setup(self):
            self.w = self.param("w", nn_mod.initializers.ones, (3,))

        @nn_mod.compact
        def __call__(self, x):
            return x * self.w + self.param("w", nn_mod.initializers.zeros, (3,))

    return M()


def test_compact_param_may_not_reuse_a_setup_param_name(jax_ref):
    # the same for a param: setup()'s 'w' stays reserved when the compact method starts
    # (the second declaration silently returned setup's 'w' here); Flax's NameInUseError
    x = np.ones((2, 3), np.float32)
    error = jax_ref("flax", lambda jax, fnn: _raised(
        lambda: _setup_param_clash(fnn).init(jax.random.PRNGKey(0), jax.numpy.ones((2, 3)))))
    assert "flax.errors.NameInUseError" in error["classes"], error
    with pytest.raises(nn.scope.NameInUseError, match='"w"'):
        _setup_param_clash(nn).init(random.PRNGKey(0), x)


def _recreated_setup_models(nn_mod):
    class M(nn_mod.Module):
        def setup(self):
            self.w = self.param("w", nn_mod.initializers.normal(1.0), (8,))
            self.drop = nn_mod.Dropout(0.5, deterministic=False)

        def __call__(self, x):
            return self.drop(x * self.w)

    class P(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            return M()(x) + nn_mod.Dense(8)(x)

    class Q(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            p = P()
            return p(p(x))

    class E(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, ids):
            return nn_mod.Embed(5, 8)(ids)       # Embed is a setup() module

    class Twice(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, ids):
            e = E()
            return e(ids) + e(ids)

    return Q(), Twice()


def test_setup_submodule_recreated_by_a_second_parent_call():
    # Flax: each call of a compact module re-creates its submodules with fresh scopes (same
    # names, same variables). A setup() submodule (nn.Embed among them) re-created by the second
    # call raised NameInUseError here ('Name "embedding" is already in use').
    x = np.ones((2, 8), np.float32)
    ids = np.array([[1, 2, 3]])
    q, twice = _recreated_setup_models(nn)
    v = q.init({"params": random.PRNGKey(0), "dropout": random.PRNGKey(1)}, x)
    assert _param_paths(v["params"]) == ["P_0/Dense_0/bias", "P_0/Dense_0/kernel", "P_0/M_0/w"]
    q.apply(v, x, rngs={"dropout": random.PRNGKey(2)})
    tv = twice.init(random.PRNGKey(0), ids)
    table = np.asarray(tv["params"]["E_0"]["Embed_0"]["embedding"])
    np.testing.assert_array_equal(np.asarray(twice.apply(tv, ids)), 2 * table[ids])


def test_setup_submodule_recreated_by_a_second_parent_call_matches_flax(jax_ref):
    x = np.ones((2, 8), np.float32)
    ids = np.array([[1, 2, 3]])

    def flax_side(jax, fnn):
        jnp = jax.numpy
        fq, ftw = _recreated_setup_models(fnn)
        fv = fq.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)},
                     jnp.asarray(x))
        ftv = ftw.init(jax.random.PRNGKey(0), jnp.asarray(ids))
        return {"w": fv["params"]["P_0"]["M_0"]["w"],
                "y": fq.apply(fv, jnp.asarray(x), rngs={"dropout": jax.random.PRNGKey(2)}),
                "twice": ftw.apply(ftv, jnp.asarray(ids))}

    want = jax_ref("flax", flax_side)
    cq, ctw = _recreated_setup_models(nn)
    cv = cq.init({"params": random.PRNGKey(0), "dropout": random.PRNGKey(1)}, x)
    np.testing.assert_array_equal(np.asarray(cv["params"]["P_0"]["M_0"]["w"]), want["w"])
    # the same dropout masks (the re-created module draws its keys as Flax's does)
    np.testing.assert_allclose(np.asarray(cq.apply(cv, x, rngs={"dropout": random.PRNGKey(2)})),
                               want["y"], rtol=1e-5, atol=1e-6)
    ctv = ctw.init(random.PRNGKey(0), ids)
    np.testing.assert_allclose(np.asarray(ctw.apply(ctv, ids)), want["twice"], rtol=1e-6)


def _field_in_setup_models(nn_mod):
    class Features(nn_mod.Module):
        features: int = 2

        def setup(self):
            self.features = 5          # the Dense below would silently get 5 features
            self.d = nn_mod.Dense(self.features)

        def __call__(self, x):
            return self.d(x)

    class Name(nn_mod.Module):
        def setup(self):
            self.name = "renamed"

        def __call__(self, x):
            return x

    return [Features(), Name()]


def test_setting_a_field_in_setup_is_refused(jax_ref):
    # Flax's SetAttributeInModuleSetupError ("Module construction attributes are frozen.")
    x = np.ones((2, 3), np.float32)
    for error, m in _with_flax_init_errors(_field_in_setup_models, jax_ref):
        assert "flax.errors.SetAttributeInModuleSetupError" in error["classes"], error
        with pytest.raises(AttributeError, match="construction attributes are frozen"):
            m.init(random.PRNGKey(0), x)


def _declare_outside_models(nn_mod):
    class Param(nn_mod.Module):
        def __call__(self, x):                 # not @compact
            return x * self.param("w", nn_mod.initializers.ones, (3,))

    class Var(nn_mod.Module):
        def setup(self):
            self.d = nn_mod.Dense(3)

        def __call__(self, x):
            self.variable("stats", "n", lambda: 0)
            return self.d(x)

    return [Param(), Var()]


def test_declaring_outside_setup_or_compact_is_refused(jax_ref):
    # Flax: 'Parameters/Variables must be initialized in `setup()` or in a method wrapped in
    # `@compact`'. Here such a param was created, and a second call of the module then failed
    # with a NameInUseError that did not say why.
    x = np.ones((2, 3), np.float32)
    for error, m in _with_flax_init_errors(_declare_outside_models, jax_ref):
        assert "builtins.ValueError" in error["classes"], error
        assert re.search("must be initialized in `setup\\(\\)`", error["message"]), error
        with pytest.raises(ValueError, match="must be initialized in `setup\\(\\)` or in a "
                                             "method wrapped in `@compact`"):
            m.init(random.PRNGKey(0), x)

    class Helper(nn.Module):             # a helper called from @compact (or setup) may declare
        def setup(self):
            self.a = self.make("a")

        def make(self, name):
            return self.param(name, nn.initializers.ones, (3,))

        @nn.compact
        def __call__(self, x):
            return x * self.a * self.make("b")

    v = Helper().init(random.PRNGKey(0), x)
    assert sorted(v["params"]) == ["a", "b"]


def test_submodule_created_in_a_plain_method_says_where_it_must_be_defined():
    # Flax: AssignSubModuleError 'Submodule Dense must be defined in `setup()` or in a method
    # wrapped in `@compact`'; the hint here said to call it through .init/.apply
    class M(nn.Module):
        def __call__(self, x):
            return nn.Dense(2)(x)

    x = np.ones((2, 3), np.float32)
    with pytest.raises(RuntimeError, match="must be defined in `setup\\(\\)` or in a method "
                                           "wrapped in `@compact`.*method of M"):
        M().init(random.PRNGKey(0), x)

    class Nested(nn.Module):             # such a module can still be run on its own
        def __call__(self, x):
            d = nn.Dense(2)
            return d.apply(d.init(random.PRNGKey(0), x), x)

    assert np.shape(Nested().apply({}, x)) == (2, 2)


def _equality_table(m, init_fn):
    """The comparisons Flax users rely on, for the module library ``m`` (flax.linen or
    ctrainstate.nn); ``init_fn(module, x)`` runs ``init`` so compact submodules are seen."""
    out = {
        "same_fields": m.Dense(3) == m.Dense(3),
        "same_fields_hash": hash(m.Dense(3)) == hash(m.Dense(3)),
        "other_field": m.Dense(3) == m.Dense(4),
        "other_field_ne": m.Dense(3) != m.Dense(4),
        "other_name": m.Dense(3) == m.Dense(3, name="x"),
        "other_class": m.Dense(3) == m.DenseGeneral(3),
        "not_a_module": m.Dense(3) == 3,
        "clone": m.Dense(3, use_bias=False).clone() == m.Dense(3, use_bias=False),
        "clone_update": m.Dense(3).clone(features=4) == m.Dense(4),
        "nested": m.Sequential([m.Dense(3), m.relu]) == m.Sequential([m.Dense(3), m.relu]),
        "dict_key": {m.Dense(3): "a"}.get(m.Dense(3)),
    }
    seen = {}

    class Two(m.Module):
        @m.compact
        def __call__(self, x):
            d1, d2 = m.Dense(3), m.Dense(3)
            seen["siblings"] = d1 == d2          # named Dense_0 and Dense_1
            seen["self"] = d1 == d1
            return d1(x) + d2(x)
    init_fn(Two(), np.ones((1, 2), np.float32))
    out.update(seen)
    try:
        hash(m.Sequential([m.Dense(3)]))        # a list field
        out["unhashable"] = "hashed"
    except TypeError:
        out["unhashable"] = "TypeError"
    return out


def test_modules_compare_by_fields_name_and_parent():
    got = _equality_table(nn, lambda mod, x: mod.init(random.PRNGKey(0), x))
    assert got == {"same_fields": True, "same_fields_hash": True, "other_field": False,
                   "other_field_ne": True, "other_name": False, "other_class": False,
                   "not_a_module": False, "clone": True, "clone_update": True, "nested": True,
                   "dict_key": "a", "siblings": False, "self": True, "unhashable": "TypeError"}
    with pytest.raises(TypeError, match=r"Failed to hash Sequential: .*layers \(list\)"):
        hash(nn.Sequential([nn.Dense(3)]))
    # a bound module's wrappers of one parent are distinct, and comparing them terminates
    # (the parent counts by identity: its fields hold the children that point back to it)
    class Wrap(nn.Module):
        layers: tuple

        @nn.compact
        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x
    seen = {}

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            a, b = Wrap((nn.Dense(3),)), Wrap((nn.Dense(3),))
            y = a(x) + b(x)
            seen["wrappers"] = (a == b, a.layers[0] == b.layers[0], a == a)
            return y
    Outer().init(random.PRNGKey(0), np.ones((1, 2), np.float32))
    assert seen["wrappers"] == (False, False, True)


def test_module_equality_matches_flax(jax_ref):
    want = jax_ref("flax", lambda jax, fnn: _equality_table(
        fnn, lambda mod, x: mod.init(jax.random.PRNGKey(0), x)))
    got = _equality_table(nn, lambda mod, x: mod.init(random.PRNGKey(0), x))
    assert got == want


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define (recorded) and derived by hand

def _sow_model(nn_mod):
    class M(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            h = nn_mod.Dense(4)(x)
            self.sow("intermediates", "h", h)
            self.sow("intermediates", "init_flag", self.is_initializing())
            return h
    return M()


def test_init_does_not_keep_intermediates():
    x = np.ones((2, 3), np.float32)
    m = _sow_model(nn)
    v = m.init(random.PRNGKey(1), x)
    # Flax: init's default mutable is DenyList('intermediates')
    assert sorted(v) == ["params"]
    _, mut = m.apply(v, x, mutable=["intermediates"])
    assert len(mut["intermediates"]["h"]) == 1          # one call, one sown value
    assert mut["intermediates"]["init_flag"] == (False,)
    # explicit mutable=True keeps them, and is_initializing is True during init
    v_all = m.init(random.PRNGKey(1), x, mutable=True)
    assert v_all["intermediates"]["init_flag"] == (True,)
    _, v2 = m.init_with_output(random.PRNGKey(1), x)
    assert sorted(v2) == ["params"]
    assert m.apply(v, x, mutable=nn.DenyList("params"))[1].keys() == {"intermediates"}


def test_init_intermediates_match_flax(jax_ref):
    x = np.ones((2, 3), np.float32)

    def flax_side(jax, fnn):
        fv = _sow_model(fnn).init(jax.random.PRNGKey(1), x)
        _, fm = _sow_model(fnn).apply(fv, x, mutable=["intermediates"])
        return {"collections": sorted(fv), "h": list(fm["intermediates"]["h"])}

    want = jax_ref("flax", flax_side)
    cv = _sow_model(nn).init(random.PRNGKey(1), x)
    assert sorted(cv) == want["collections"]
    _, cm = _sow_model(nn).apply(cv, x, mutable=["intermediates"])
    assert len(cm["intermediates"]["h"]) == len(want["h"])
    np.testing.assert_allclose(np.asarray(cm["intermediates"]["h"][0]), want["h"][0], rtol=1e-6)


def _autoencoder(nn_mod):
    class AE(nn_mod.Module):
        def setup(self):
            self.enc = nn_mod.Dense(3)
            self.dec = nn_mod.Dense(5)

        def encode(self, x):
            return self.enc(x)

        def decode(self, z):
            return self.dec(z)

        def __call__(self, x):
            return self.decode(self.encode(x))
    return AE()


def test_apply_with_bound_method_and_bind():
    x = np.random.RandomState(0).randn(2, 5).astype(np.float32)
    m = _autoencoder(nn)
    v = m.init(random.PRNGKey(0), x)
    z_str = np.asarray(m.apply(v, x, method="encode"))
    # Flax's docs write method=model.encode (a method of the unbound module)
    np.testing.assert_array_equal(np.asarray(m.apply(v, x, method=m.encode)), z_str)
    np.testing.assert_array_equal(np.asarray(m.apply(v, x, method=type(m).encode)), z_str)
    # derived: encode is the Dense 'enc', x @ kernel + bias
    p = v["params"]["enc"]
    np.testing.assert_allclose(z_str, x @ np.asarray(p["kernel"]) + np.asarray(p["bias"]), rtol=1e-5)
    assert sorted(m.init(random.PRNGKey(0), x, method=m.encode)["params"]) == ["enc"]
    b = m.bind(v)
    np.testing.assert_array_equal(np.asarray(b.encode(x)), z_str)
    np.testing.assert_allclose(np.asarray(b(x)), np.asarray(m.apply(v, x)), rtol=1e-6)
    with pytest.raises(TypeError, match="dict"):
        m.bind([1])


def test_apply_with_bound_method_matches_flax(jax_ref):
    x = np.random.RandomState(0).randn(2, 5).astype(np.float32)

    def flax_side(jax, fnn):
        fm = _autoencoder(fnn)
        fv = fm.init(jax.random.PRNGKey(0), x)
        return {"apply": fm.apply(fv, x, method=fm.encode), "bound": fm.bind(fv).encode(x)}

    want = jax_ref("flax", flax_side)
    cm = _autoencoder(nn)
    cv = cm.init(random.PRNGKey(0), x)
    np.testing.assert_allclose(np.asarray(cm.apply(cv, x, method=cm.encode)), want["apply"],
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(cm.bind(cv).encode(x)), want["bound"], rtol=1e-5)


def _wrapper_model(nn_mod):
    from typing import Any

    class W(nn_mod.Module):
        inner: Any
        blocks: Any = ()
        table: Any = None

        @nn_mod.compact
        def __call__(self, x):
            y = self.inner(x)
            for b in self.blocks:
                y = b(y)
            if self.table:
                y = self.table["a"](y)
            return nn_mod.Dense(2)(y)
    return W(nn_mod.Dense(3, name="foo"), (nn_mod.Dense(3), nn_mod.Dense(3)),
             {"a": nn_mod.Dense(3)})


def _seq_model(nn_mod):
    return nn_mod.Sequential([nn_mod.Dense(4), nn_mod.relu, nn_mod.Dense(2)])


def test_module_attributes_are_adopted():
    x = np.ones((2, 3), np.float32)
    m = _wrapper_model(nn)
    v = m.init(random.PRNGKey(0), x)
    # Flax names them after the attribute (the module's own name= does not count)
    assert sorted(v["params"]) == ["Dense_0", "blocks_0", "blocks_1", "inner", "table_a"]
    y = m.apply(v, x)
    p = cts.tree_util.tree_map(np.asarray, v["params"])
    h = x @ p["inner"]["kernel"] + p["inner"]["bias"]
    for name in ("blocks_0", "blocks_1", "table_a"):
        h = h @ p[name]["kernel"] + p[name]["bias"]
    np.testing.assert_allclose(np.asarray(y), h @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"],
                               rtol=1e-5)
    assert m.inner.scope is None                # the user's instance stays unbound
    assert sorted(m.init(random.PRNGKey(1), x)["params"]) == sorted(v["params"])   # reusable
    s = _seq_model(nn)
    sv = s.init(random.PRNGKey(0), x)
    assert sorted(sv["params"]) == ["layers_0", "layers_2"]
    sp = cts.tree_util.tree_map(np.asarray, sv["params"])
    want = np.maximum(x @ sp["layers_0"]["kernel"] + sp["layers_0"]["bias"], 0)
    want = want @ sp["layers_2"]["kernel"] + sp["layers_2"]["bias"]
    np.testing.assert_allclose(np.asarray(s.apply(sv, x)), want, rtol=1e-5)
    with pytest.raises(ValueError, match="Empty Sequential"):
        nn.Sequential([]).init(random.PRNGKey(0), x)


def test_module_attributes_match_flax(jax_ref):
    x = np.random.RandomState(0).randn(2, 3).astype(np.float32)
    _assert_models_match_flax(lambda m: {"wrapper": _wrapper_model(m), "seq": _seq_model(m)},
                              x, jax_ref)


def _shared_models(nn_mod):
    """Models where one module instance appears twice (Flax: one submodule, one parameter set,
    named at its first place)."""
    from typing import Any

    class W(nn_mod.Module):
        a: Any
        b: Any

        @nn_mod.compact
        def __call__(self, x):
            return self.b(self.a(x))

    class L(nn_mod.Module):
        blocks: Any

        @nn_mod.compact
        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    d, e, f = nn_mod.Dense(3), nn_mod.Dense(3), nn_mod.Dense(3)
    # list entries are adopted in the order of their keys as strings: '10' < '2'
    many = [nn_mod.Dense(3) for _ in range(2)] + [f] + [nn_mod.Dense(3) for _ in range(7)] + [f]
    return {"seq": nn_mod.Sequential([d, d]), "fields": W(e, e), "list": L(many)}


def test_shared_module_instance_is_one_submodule():
    x = np.random.RandomState(0).randn(2, 3).astype(np.float32)
    models = _shared_models(nn)
    v = models["seq"].init(random.PRNGKey(0), x)
    assert sorted(v["params"]) == ["layers_0"]                 # not layers_1: the weights are tied
    p = cts.tree_util.tree_map(np.asarray, v["params"]["layers_0"])
    h = x @ p["kernel"] + p["bias"]
    np.testing.assert_allclose(np.asarray(models["seq"].apply(v, x)), h @ p["kernel"] + p["bias"],
                               rtol=1e-5, atol=1e-6)
    v = models["fields"].init(random.PRNGKey(0), x)
    assert sorted(v["params"]) == ["a"]
    assert sorted(models["list"].init(random.PRNGKey(0), x)["params"]) == \
        ["blocks_0", "blocks_1", "blocks_10", "blocks_3", "blocks_4", "blocks_5", "blocks_6",
         "blocks_7", "blocks_8", "blocks_9"]


def _assert_models_match_flax(make, x, jax_ref):
    """Each model of ``make(lib)`` (a dict) by flax (recorded) and by ctrainstate: the same
    parameter paths and values from the same key, and the same outputs."""
    def flax_side(jax, fnn):
        out = {}
        for k, fm in make(fnn).items():
            fv = fm.init(jax.random.PRNGKey(0), x)
            fl = jax.tree_util.tree_flatten_with_path(fv["params"])[0]
            out[k] = {"paths": [jax.tree_util.keystr(p) for p, _ in fl],
                      "leaves": [a for _, a in fl], "y": fm.apply(fv, x)}
        return out

    want = jax_ref("flax", flax_side)
    cm = make(nn)
    assert sorted(cm) == sorted(want)
    for k in cm:
        cv = cm[k].init(random.PRNGKey(0), x)
        cl = cts.tree_util.tree_flatten_with_path(cv["params"])[0]
        assert want[k]["paths"] == [cts.tree_util.keystr(p) for p, _ in cl], k
        for a, (_, b) in zip(want[k]["leaves"], cl):
            np.testing.assert_array_equal(np.asarray(b), a)
        np.testing.assert_allclose(np.asarray(cm[k].apply(cv, x)), want[k]["y"],
                                   rtol=1e-5, atol=1e-6)


def test_shared_module_instance_matches_flax(jax_ref):
    x = np.random.RandomState(0).randn(2, 3).astype(np.float32)
    _assert_models_match_flax(_shared_models, x, jax_ref)


def _nested_container_models(nn_mod):
    from typing import Any

    class N(nn_mod.Module):
        blocks: Any

        @nn_mod.compact
        def __call__(self, x):
            for grp in self.blocks:
                for b in grp:
                    x = b(x)
            return x

    class S(nn_mod.Module):
        def setup(self):
            self.d = {"a": nn_mod.Dense(3), "b": [nn_mod.Dense(3), {"c": nn_mod.Dense(2)}]}

        def __call__(self, x):
            return self.d["b"][1]["c"](self.d["b"][0](self.d["a"](x)))

    return {"nested": N(((nn_mod.Dense(2),), (nn_mod.Dense(3),))), "setup_dict": S()}


def test_nested_module_containers_are_adopted():
    x = np.random.RandomState(1).randn(2, 3).astype(np.float32)
    models = _nested_container_models(nn)
    v = models["nested"].init(random.PRNGKey(0), x)
    assert sorted(v["params"]) == ["blocks_0_0", "blocks_1_0"]
    p = cts.tree_util.tree_map(np.asarray, v["params"])
    assert p["blocks_0_0"]["kernel"].shape == (3, 2) and p["blocks_1_0"]["kernel"].shape == (2, 3)
    h = x @ p["blocks_0_0"]["kernel"] + p["blocks_0_0"]["bias"]
    np.testing.assert_allclose(np.asarray(models["nested"].apply(v, x)),
                               h @ p["blocks_1_0"]["kernel"] + p["blocks_1_0"]["bias"], rtol=1e-5)
    v = models["setup_dict"].init(random.PRNGKey(0), x)
    assert sorted(v["params"]) == ["d_a", "d_b_0", "d_b_1_c"]
    assert models["setup_dict"].apply(v, x).shape == (2, 2)


def test_nested_module_containers_match_flax(jax_ref):
    x = np.random.RandomState(1).randn(2, 3).astype(np.float32)
    _assert_models_match_flax(_nested_container_models, x, jax_ref)
