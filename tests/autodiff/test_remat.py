"""checkpoint / remat (jax.checkpoint) and nn.remat (flax.linen.remat): the same values and
gradients as without them, bit for bit, on any mesh; the checkpointed function really runs
twice and its intermediates are really not kept; Flax's names and values for nn.remat."""
import gc

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import nn, random

from conftest import bytes_in_use


def _mlp(x, w1, w2):
    h = cnp.tanh(x @ w1)
    h = cnp.sin(h) * h
    return cnp.tanh(h @ w2)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 6)).astype(np.float32)
    w1 = rng.standard_normal((6, 16)).astype(np.float32) * 0.5
    w2 = rng.standard_normal((16, 4)).astype(np.float32) * 0.5
    return x, w1, w2


def _bits(tree):
    """The leaves' shapes and exact bits (comparable with ==)."""
    return [(np.shape(a), np.asarray(a).tobytes()) for a in cts.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("mesh_shape,names", [(None, None), ((8,), ("x",)),
                                              ((2, 4), ("data", "model"))])
def test_checkpoint_same_value_and_grads_bitwise(mesh_shape, names):
    x, w1, w2 = _data()
    if mesh_shape is not None:
        mesh = cts.make_mesh(mesh_shape, names)
        batch, model = names[0], names[-1]
        x = cts.device_put(x, cts.NamedSharding(mesh, cts.P(batch, None)))
        w1 = cts.device_put(w1, cts.NamedSharding(mesh, cts.P(None, model)))
        w2 = cts.device_put(w2, cts.NamedSharding(mesh, cts.P(model, None)))

    def loss(block):
        def f(w1, w2):
            return cnp.mean(cnp.square(block(x, w1, w2)))
        return f

    v0, g0 = cts.value_and_grad(loss(_mlp), argnums=(0, 1))(w1, w2)
    v1, g1 = cts.value_and_grad(loss(cts.checkpoint(_mlp)), argnums=(0, 1))(w1, w2)
    assert _bits(v0) == _bits(v1)
    assert _bits(g0) == _bits(g1)
    assert g1[0].sharding.is_equivalent_to(w1.sharding if mesh_shape else g0[0].sharding, 2)


def test_checkpoint_reruns_once_per_backward_and_not_outside_grad():
    x, w1, w2 = _data()
    calls = []

    @cts.checkpoint
    def block(x, w1, w2):
        calls.append(1)
        return _mlp(x, w1, w2)

    block(x, w1, w2)
    assert len(calls) == 1  # no tape: a plain call
    cts.grad(lambda w: cnp.sum(block(x, w, w2)))(w1)
    assert len(calls) == 3  # forward + one recomputation
    calls.clear()
    keep_all = cts.checkpoint(block.__wrapped__, policy=cts.checkpoint_policies.everything_saveable)
    cts.grad(lambda w: cnp.sum(keep_all(x, w, w2)))(w1)
    assert len(calls) == 1
    calls.clear()
    # a block whose output does not depend on what is differentiated is not recomputed
    cts.grad(lambda w: cnp.sum(block(x, w1, w2)) + cnp.sum(w))(w1)
    assert len(calls) == 1


def test_closed_over_params_get_gradients():
    """The tracked Arrays a checkpointed function reads without taking them as arguments
    (a module's parameters) are its inputs too."""
    x, w1, w2 = _data(1)

    def loss(w1, w2, remat):
        f = (lambda x: _mlp(x, w1, w2))
        f = cts.checkpoint(f) if remat else f
        return cnp.sum(f(x))

    g0 = cts.grad(lambda a, b: loss(a, b, False), argnums=(0, 1))(w1, w2)
    g1 = cts.grad(lambda a, b: loss(a, b, True), argnums=(0, 1))(w1, w2)
    assert _bits(g0) == _bits(g1)
    assert np.abs(np.asarray(g1[0])).sum() > 0 and np.abs(np.asarray(g1[1])).sum() > 0


def test_pytree_outputs_unused_output_and_nesting():
    x, w1, w2 = _data(2)

    def block(x, w1, w2):
        h = cnp.tanh(x @ w1)
        return {"h": h, "y": cnp.tanh(h @ w2), "const": cnp.sin(x)}

    inner = cts.checkpoint(lambda x, w1, w2: _mlp(x, w1, w2))

    def loss(w1, w2, ck, nest):
        b = cts.checkpoint(block) if ck else block
        out = b(x, w1, w2)
        y = inner(x, w1, w2) if nest else _mlp(x, w1, w2)
        return cnp.sum(out["y"]) + 0.5 * cnp.sum(out["h"] * out["h"]) + cnp.mean(y)

    g0 = cts.grad(lambda a, b: loss(a, b, False, False), argnums=(0, 1))(w1, w2)
    g1 = cts.grad(lambda a, b: loss(a, b, True, True), argnums=(0, 1))(w1, w2)
    assert _bits(g0) == _bits(g1)
    # nested: a checkpoint inside a checkpoint
    outer = cts.checkpoint(lambda x, w1, w2: inner(x, w1, w2) * 2.0)
    g2 = cts.grad(lambda a: cnp.sum(outer(x, a, w2)))(w1)
    g3 = cts.grad(lambda a: cnp.sum(_mlp(x, a, w2) * 2.0))(w1)
    np.testing.assert_array_equal(np.asarray(g2), np.asarray(g3))


def test_input_used_inside_twice_and_outside_accumulates_in_the_same_order():
    """The gradient of an input used twice inside the block and again outside it adds up
    in the order it does without checkpoint: the same bits, not just the same value."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 6)).astype(np.float32)
    w = (rng.standard_normal((6, 16)) * 0.7).astype(np.float32)

    def block(x, w):
        h = cnp.tanh(x @ w)
        return cnp.sin(h @ cnp.transpose(w))

    def loss(w, b):
        return cnp.sum(b(x, w) * 3.0) + cnp.sum(cnp.square(w) * 0.37) + cnp.sum(cnp.tanh(x @ w))

    g0 = cts.grad(lambda w: loss(w, block))(w)
    g1 = cts.grad(lambda w: loss(w, cts.checkpoint(block)))(w)
    assert _bits(g0) == _bits(g1)


def test_intermediates_are_not_kept():
    """Live device memory right after the forward: a chain of 8 ops on 1 MiB arrays keeps 8
    intermediates without checkpoint and none with it."""
    n = 1 << 18  # float32: 1 MiB
    x = cts.device_put(np.linspace(-1, 1, n, dtype=np.float32))

    def chain(x):
        for _ in range(8):
            x = cnp.sin(x)
        return x

    seen = {}

    def loss(x, block, tag):
        gc.collect()
        before = sum(bytes_in_use())
        y = block(x)
        gc.collect()
        seen[tag] = sum(bytes_in_use()) - before
        return cnp.sum(y)

    g0 = cts.grad(lambda v: loss(v, chain, "plain"))(x)
    g1 = cts.grad(lambda v: loss(v, cts.checkpoint(chain), "remat"))(x)
    np.testing.assert_array_equal(np.asarray(g0), np.asarray(g1))
    mib = 1 << 20
    assert seen["plain"] >= 8 * mib, seen
    assert seen["remat"] <= 1 * mib + 4096, seen  # the output only


def test_checkpoint_errors_and_signature():
    with pytest.raises(TypeError, match="expected a function"):
        cts.checkpoint(3)
    with pytest.raises(TypeError, match="policy must be a callable"):
        cts.checkpoint(lambda x: x, policy="dots")
    with pytest.raises(TypeError, match="static_argnums must be ints"):
        cts.checkpoint(lambda x: x, static_argnums=("a",))
    assert cts.remat is cts.checkpoint
    f = cts.checkpoint(prevent_cse=False, static_argnums=(1,),
                       policy=cts.checkpoint_policies.dots_saveable)(lambda x, n: x * n)
    np.testing.assert_array_equal(np.asarray(cts.grad(lambda x: cnp.sum(f(x, 3.0)))(
        np.ones(3, np.float32))), np.full(3, 3.0, np.float32))


# --- nn.remat ---------------------------------------------------------------------------------

class Block(nn.Module):
    features: int = 8
    rate: float = 0.25

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(self.features)(x)
        x = nn.Dropout(self.rate, deterministic=not train)(x)
        return nn.tanh(x)


def _model(remat: bool):
    blk = nn.remat(Block) if remat else Block

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            for i in range(3):
                # without remat, the names nn.remat gives: the same paths, keys and values
                x = blk(name=None if remat else f"CheckpointBlock_{i}")(x, train)
            return nn.Dense(2)(x)
    return Net()


def test_nn_remat_names_values_and_grads_match_the_plain_module():
    x = np.random.default_rng(3).standard_normal((4, 5)).astype(np.float32)
    rngs = {"params": random.PRNGKey(0), "dropout": random.PRNGKey(1)}
    va = _model(True).init(rngs, x)
    vb = _model(False).init(rngs, x)
    assert sorted(va["params"]) == ["CheckpointBlock_0", "CheckpointBlock_1",
                                   "CheckpointBlock_2", "Dense_0"]
    assert _bits(va) == _bits(vb)

    def loss(model):
        return lambda p: cnp.sum(cnp.square(model.apply({"params": p}, x, rngs={"dropout": random.PRNGKey(7)})))

    la, ga = cts.value_and_grad(loss(_model(True)))(va["params"])
    lb, gb = cts.value_and_grad(loss(_model(False)))(vb["params"])
    assert _bits(la) == _bits(lb)
    assert _bits(ga) == _bits(gb)  # the recomputation drew the same dropout masks
    assert type(nn.remat(Block)()).__name__ == "CheckpointBlock"
    assert nn.checkpoint is nn.remat


def test_nn_remat_reruns_the_block():
    calls = []

    class Counted(nn.Module):
        @nn.compact
        def __call__(self, x):
            calls.append(1)
            return nn.tanh(nn.Dense(3)(x))

    x = np.ones((2, 3), np.float32)
    R = nn.remat(Counted)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return R()(R()(x))

    v = Net().init(random.PRNGKey(0), x)
    calls.clear()
    Net().apply(v, x)
    assert len(calls) == 2
    calls.clear()
    cts.grad(lambda p: cnp.sum(Net().apply({"params": p}, x)))(v["params"])
    assert len(calls) == 4  # each block once more in the backward pass


def _method_form_models(decorated: bool, calls: list):
    """A block whose @nn.compact __call__ is decorated with @nn.remat (Flax's method form),
    or the same block undecorated; with dropout, so the rerun must redraw the same masks."""
    def body(self, x):
        calls.append(1)
        h = nn.Dense(6)(x)
        h = nn.Dropout(0.3, deterministic=False)(h)
        return nn.Dense(3)(cnp.tanh(h))

    body.__name__ = "__call__"
    fn = nn.compact(body)

    class Block(nn.Module):
        __call__ = nn.remat(fn) if decorated else fn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Block()(x) * Block()(x)

    return Net


def test_nn_remat_method_form_same_names_values_and_grads_and_reruns():
    x = np.random.default_rng(5).standard_normal((4, 5)).astype(np.float32)
    rngs = {"params": random.PRNGKey(0), "dropout": random.PRNGKey(1)}
    calls_a, calls_b = [], []
    A, B = _method_form_models(True, calls_a), _method_form_models(False, calls_b)
    va, vb = A().init(rngs, x), B().init(rngs, x)
    # the module's own names, no Checkpoint prefix (as Flax's method form)
    assert sorted(va["params"]) == ["Block_0", "Block_1"]
    assert sorted(va["params"]["Block_0"]) == ["Dense_0", "Dense_1"]
    assert _bits(va) == _bits(vb)

    def loss(model):
        return lambda p: cnp.sum(model().apply({"params": p}, x,
                                               rngs={"dropout": random.PRNGKey(7)}))

    calls_a.clear()
    la, ga = cts.value_and_grad(loss(A))(va["params"])
    assert len(calls_a) == 4      # each block's body once more in the backward pass
    lb, gb = cts.value_and_grad(loss(B))(vb["params"])
    assert _bits(la) == _bits(lb)
    assert _bits(ga) == _bits(gb)  # the rerun made the same submodules and dropout masks
    calls_a.clear()
    A().apply({"params": va["params"]}, x, rngs={"dropout": random.PRNGKey(7)})
    assert len(calls_a) == 2      # outside grad nothing is rerun


def test_nn_remat_function_form_on_a_submodule():
    x = np.random.default_rng(6).standard_normal((3, 5)).astype(np.float32)
    calls = []

    def through(mdl, y):
        calls.append(1)
        return cnp.tanh(mdl(y))

    class F(nn.Module):
        remat: bool

        @nn.compact
        def __call__(self, x):
            d = nn.Dense(4)
            return (nn.remat(through) if self.remat else through)(d, x)

    va = F(True).init(random.PRNGKey(0), x)
    vb = F(False).init(random.PRNGKey(0), x)
    assert sorted(va["params"]) == ["Dense_0"] and _bits(va) == _bits(vb)
    calls.clear()
    ga = cts.grad(lambda p: cnp.sum(F(True).apply({"params": p}, x)))(va["params"])
    assert len(calls) == 2
    gb = cts.grad(lambda p: cnp.sum(F(False).apply({"params": p}, x)))(vb["params"])
    assert _bits(ga) == _bits(gb)


def _flax_method_form(jax, jnp, fnn, x):
    """Flax's side of test_nn_remat_method_form_matches_flax: the init's leaf paths and
    values, and the gradient's leaves."""
    class Block(fnn.Module):
        @fnn.remat
        @fnn.compact
        def __call__(self, x):
            return fnn.Dense(3)(jnp.tanh(fnn.Dense(6)(x)))

    class Net(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            return Block()(x) * Block()(x)

    fv = Net().init(jax.random.PRNGKey(0), x)
    fl = jax.tree_util.tree_leaves_with_path(fv)
    fg = jax.grad(lambda p: jnp.sum(Net().apply({"params": p}, x)))(fv["params"])
    return {"paths": [jax.tree_util.keystr(p) for p, _ in fl], "init": [a for _, a in fl],
            "grad": jax.tree_util.tree_leaves(fg)}


def test_nn_remat_method_form_matches_flax(jax_ref):
    class CBlock(nn.Module):
        @nn.remat
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(cnp.tanh(nn.Dense(6)(x)))

    CBlock.__name__ = "Block"   # Flax's auto names come from the class name

    class CNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            return CBlock()(x) * CBlock()(x)

    x = np.random.default_rng(8).standard_normal((4, 5)).astype(np.float32)
    want = jax_ref("flax", lambda jax, jnp, fnn: _flax_method_form(jax, jnp, fnn, x))
    cv = CNet().init(random.PRNGKey(0), x)
    cl = cts.tree_util.tree_leaves_with_path(dict(cv))
    assert want["paths"] == [cts.tree_util.keystr(p) for p, _ in cl]
    for path, a, (_, b) in zip(want["paths"], want["init"], cl, strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), path
    cg = cts.grad(lambda p: cnp.sum(CNet().apply({"params": p}, x)))(cv["params"])
    for a, b in zip(want["grad"], cts.tree_util.tree_leaves(cg), strict=True):
        np.testing.assert_allclose(np.asarray(b), a, rtol=1e-4, atol=1e-6)


def _flax_remat(jax, jnp, fnn, x):
    """Flax's side of test_nn_remat_matches_flax: the init's leaf paths and values, and the
    loss and gradient leaves with dropout."""
    class Block(fnn.Module):  # the same class name: the same param paths and keys
        @fnn.compact
        def __call__(self, x, train: bool = True):
            x = fnn.Dense(8)(x)
            x = fnn.Dropout(0.25, deterministic=not train)(x)
            return fnn.tanh(x)

    class FNet(fnn.Module):
        @fnn.compact
        def __call__(self, x, train: bool = True):
            for _ in range(3):
                x = fnn.remat(Block, static_argnums=(2,))()(x, train)
            return fnn.Dense(2)(x)

    fv = FNet().init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}, x)
    fleaves = jax.tree_util.tree_leaves_with_path(fv)

    def floss(p):
        y = FNet().apply({"params": p}, x, rngs={"dropout": jax.random.PRNGKey(7)})
        return jnp.sum(jnp.square(y))

    fl, fg = jax.value_and_grad(floss)(fv["params"])
    return {"paths": [jax.tree_util.keystr(p) for p, _ in fleaves],
            "init": [a for _, a in fleaves], "loss": fl, "grad": jax.tree_util.tree_leaves(fg)}


def test_nn_remat_matches_flax(jax_ref):
    x = np.random.default_rng(4).standard_normal((4, 5)).astype(np.float32)
    want = jax_ref("flax", lambda jax, jnp, fnn: _flax_remat(jax, jnp, fnn, x))
    v = _model(True).init({"params": random.PRNGKey(0), "dropout": random.PRNGKey(1)}, x)
    cleaves = cts.tree_util.tree_leaves(v)
    assert len(want["init"]) == len(cleaves)
    for path, a, b in zip(want["paths"], want["init"], cleaves):
        np.testing.assert_allclose(np.asarray(b), a, rtol=1e-6, atol=1e-7, err_msg=path)

    def closs(p):
        y = _model(True).apply({"params": p}, x, rngs={"dropout": random.PRNGKey(7)})
        return cnp.sum(cnp.square(y))

    cl, cg = cts.value_and_grad(closs)(v["params"])
    np.testing.assert_allclose(float(cl), float(want["loss"]), rtol=1e-5)
    for a, b in zip(want["grad"], cts.tree_util.tree_leaves(cg)):
        np.testing.assert_allclose(np.asarray(b), a, rtol=1e-4, atol=1e-6)


def test_nn_remat_refuses_state_it_cannot_replay_and_bad_targets():
    class Sower(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.Dense(2)(x)
            self.sow("intermediates", "y", y)
            return y

    x = np.ones((2, 3), np.float32)
    R = nn.remat(Sower)
    v = R().init(random.PRNGKey(0), x)
    # not differentiated: nothing is re-run, so sow is fine
    _, state = R().apply({"params": v["params"]}, x, mutable=["intermediates"])
    assert "y" in state["intermediates"]
    with pytest.raises(NotImplementedError, match="wrote to a mutable collection"):
        cts.grad(lambda p: cnp.sum(R().apply({"params": p}, x, mutable=["intermediates"])[0]))(
            v["params"])
    # immutable intermediates: sow is a no-op and remat works
    g = cts.grad(lambda p: cnp.sum(R().apply({"params": p}, x)))(v["params"])
    assert g["Dense_0"]["kernel"].shape == (3, 2)
    with pytest.raises(TypeError, match="expected a Module class"):
        nn.remat(3)
    with pytest.raises(TypeError, match="takes a Module as its first argument"):
        nn.remat(lambda x: x)(np.ones(2, np.float32))
    with pytest.raises(TypeError, match="methods= applies to a Module class"):
        nn.remat(lambda m, x: m(x), methods=["encode"])
    with pytest.raises(AttributeError, match="has no method 'encode'"):
        nn.remat(Block, methods=["encode"])


def test_rerun_sees_the_mesh_and_rules_the_forward_ran_under():
    """A loss that enters ``with mesh, axis_rules`` itself: the backward pass runs after it
    left them, and the recomputation must still see them (same layouts, same bits)."""
    x, w1, w2 = _data(6)
    mesh = cts.make_mesh((2, 4), ("a", "b"))

    def block(x, w1, w2):
        h = cts.lax.with_sharding_constraint(cnp.tanh(x @ w1), cts.P(None, "b"))
        h = nn.with_logical_constraint(cnp.sin(h), ("batch", "hidden"))
        return cnp.tanh(h @ w2)

    def loss(w1, w2, b):
        with mesh, nn.logical_axis_rules((("batch", "a"), ("hidden", "b"))):
            return cnp.sum(b(x, w1, w2))

    g0 = cts.grad(lambda a, c: loss(a, c, block), argnums=(0, 1))(w1, w2)
    g1 = cts.grad(lambda a, c: loss(a, c, cts.checkpoint(block)), argnums=(0, 1))(w1, w2)
    assert _bits(g0) == _bits(g1)
    assert cts.sharding.get_mesh() is None and nn.get_logical_axis_rules() == ()
