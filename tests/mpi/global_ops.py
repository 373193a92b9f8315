"""Run under mpirun (tests/distributed/test_distributed_mpi.py), each process with 2 CPU
devices: operations on Arrays that span processes and training steps (value_and_grad,
apply_gradients; optimizers whose fused step reduces over the tree or a leaf's blocks:
clip_by_global_norm, apply_if_finite, lamb, adafactor) on a global mesh, compared bit for
bit with a run of one process that has
as many devices as the whole job (the reference run writes what it computed).

    python tests/mpi/global_ops.py --reference ref.npz   # one process, 2 * N devices
    mpirun -n N python tests/mpi/global_ops.py ref.npz   # N processes, 2 devices each

Each process prints "OK <process> <count> <checks>" at the end (and writes it to a file in
CT_TEST_OUT); any failure raises (non-zero exit).
"""

import numpy as np

from report import finish, report, run, start

import ctrainstate as cts
import ctrainstate.numpy as jnp
from ctrainstate import NamedSharding, P, nn, optim, random, partitioning as nn_partitioning
from ctrainstate.train_state import TrainState


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        w1 = nn_partitioning.param_with_axes("w1", nn.initializers.lecun_normal(), (16, 64),
                                             axes=("embed", "mlp"))
        b1 = nn_partitioning.param_with_axes("b1", nn.initializers.zeros, (64,), axes=("mlp",))
        w2 = nn_partitioning.param_with_axes("w2", nn.initializers.lecun_normal(), (64, 16),
                                             axes=("mlp", "embed"))
        return jnp.tanh(x @ w1 + b1) @ w2


def computed(mesh, host):
    """{name: value} of every computation compared; ``host(a)`` reads an Array whole."""
    n = mesh.shape["data"]
    rng = np.random.default_rng(0)
    g = rng.standard_normal((4 * n, 8)).astype(np.float32)
    h = rng.standard_normal((8, 6)).astype(np.float32)
    x = cts.device_put(g, NamedSharding(mesh, P("data", "model")))
    y = cts.device_put(g * 0.5 + 0.25, NamedSharding(mesh, P("data", None)))
    w = cts.device_put(h, NamedSharding(mesh, P("model", None)))
    wd = cts.device_put(g.T.copy(), NamedSharding(mesh, P(None, "data")))
    out = {}
    jitted = cts.jit(lambda a, b: jnp.sum(a * b + 1.0, axis=0))
    ops = {
        "add": lambda: x + 1, "mul": lambda: x * y, "neg": lambda: -x,
        "exp": lambda: jnp.exp(x), "div": lambda: x / y, "maximum": lambda: jnp.maximum(x, y),
        "tanh_sq": lambda: jnp.tanh(x) ** 2, "where": lambda: jnp.where(x > 0, x, 0.0),
        "sum": lambda: jnp.sum(x), "sum_data": lambda: jnp.sum(x, axis=0),
        "sum_model": lambda: jnp.sum(x, axis=1), "mean": lambda: jnp.mean(x),
        "max_data": lambda: jnp.max(x, axis=0), "var": lambda: jnp.var(x, axis=0),
        "norm": lambda: jnp.linalg.norm(x), "softmax": lambda: nn.softmax(x, axis=-1),
        "matmul_model": lambda: x @ w, "matmul_data": lambda: wd @ x,
        "transpose": lambda: x.T, "astype": lambda: x.astype(np.float16),
        "bf16_sum": lambda: jnp.sum(x.astype(jnp.bfloat16), axis=0).astype(np.float32),
        "reshape": lambda: x.reshape(4 * n, 2, 4),
        "regather": lambda: cts.device_put(x, NamedSharding(mesh, P(None, "model"))),
        "xent": lambda: optim.softmax_cross_entropy(x, nn.softmax(y)),
        "jit": lambda: [jitted(x * float(i), y) for i in range(3)][-1],   # traced, replayed
        "grad": lambda: cts.grad(lambda a: jnp.mean(jnp.tanh(a @ w) ** 2))(x),
    }
    for name, f in ops.items():
        r = f()
        assert isinstance(r, cts.Array), name
        out[name] = host(r)
    # training steps: params sharded within processes ("embed" unsplit) or across them
    X = rng.standard_normal((8 * n, 16)).astype(np.float32)
    Y = rng.standard_normal((8 * n, 16)).astype(np.float32)
    for embed, tx in ((None, optim.adamw(1e-2)),
                      ("data", optim.chain(optim.clip(0.05), optim.adam(1e-2)))):
        rules = (("batch", "data"), ("mlp", "model"), ("embed", embed))
        tag = f"train_{embed}"
        with mesh, nn_partitioning.axis_rules(rules):
            xb = cts.device_put(X, NamedSharding(mesh, P("data")))
            yb = cts.device_put(Y, NamedSharding(mesh, P("data")))
            model = MLP()
            params = model.init(random.PRNGKey(0), xb)["params"]
            state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)

            def loss_fn(p):
                return jnp.mean(jnp.square(state.apply_fn({"params": p}, xb) - yb))

            for i in range(3):
                loss, grads = cts.value_and_grad(loss_fn)(state.params)
                out[f"{tag}_loss{i}"] = np.float32(float(loss))   # replicated: read here
                state = state.apply_gradients(grads=grads)
            assert int(state.step) == 3
        for k, v in nn.unbox(state.params).items():
            out[f"{tag}_param_{k}"] = host(v)
        if embed == "data" and cts.process_count() > 1:   # a param spanning processes
            assert not nn.unbox(state.params)["w1"].is_fully_addressable
    # the fused step's reductions over the tree or over a leaf's blocks (global norm, finite
    # gate, trust ratios, adafactor's factored statistics and block RMS): params sharded
    # across processes ("embed" over "data"), or within them and replicated across them
    txs = {
        "clipnorm": lambda: optim.chain(optim.clip_by_global_norm(0.05), optim.adamw(1e-2)),
        "finite": lambda: optim.apply_if_finite(optim.adam(1e-2), 2),
        "lamb": lambda: optim.lamb(1e-2, weight_decay=1e-3),
        "adafactor": lambda: optim.adafactor(1e-2, min_dim_size_to_factor=8),
    }
    for embed in ("data", None):
        rules = (("batch", "data"), ("mlp", "model"), ("embed", embed))
        with mesh, nn_partitioning.axis_rules(rules):
            xb = cts.device_put(X, NamedSharding(mesh, P("data")))
            yb = cts.device_put(Y, NamedSharding(mesh, P("data")))
            model = MLP()
            params0 = model.init(random.PRNGKey(1), xb)["params"]

            def loss_fn(p):
                return jnp.mean(jnp.square(model.apply({"params": p}, xb) - yb))

            def step(state):
                loss, grads = cts.value_and_grad(loss_fn)(state.params)
                return state.apply_gradients(grads=grads), loss

            jstep = cts.jit(step)
            for name, make in txs.items():
                tag = f"red_{name}_{embed}"
                state = TrainState.create(apply_fn=model.apply, params=params0, tx=make())
                for i in range(2):
                    if name == "finite" and i == 0:   # a non-finite step is skipped
                        loss, grads = cts.value_and_grad(loss_fn)(state.params)
                        grads = dict(grads, b1=grads["b1"] * np.float32(np.inf))
                        state = state.apply_gradients(grads=grads)
                    elif name == "clipnorm" and i == 1:   # the jitted step (a JitStep node)
                        state, loss = jstep(state)
                    else:
                        state, loss = step(state)
                    out[f"{tag}_loss{i}"] = np.float32(float(loss))
                for k, v in nn.unbox(state.params).items():
                    out[f"{tag}_param_{k}"] = host(v)
                for j, v in enumerate(cts.tree_util.tree_leaves(state.opt_state)):
                    out[f"{tag}_state{j}"] = host(v) if isinstance(v, cts.Array) else np.asarray(v)
    # a mesh whose rows mix the processes' devices (the kernel's device groups are then not
    # in process order), leaves of several tasks per block, functional updates
    devs = np.array(cts.devices())[::-1].reshape(2, n).T.copy()
    mix = cts.sharding.Mesh(devs, ("data", "model"))
    W = rng.standard_normal((320, 1024)).astype(np.float32)   # 2-3 tasks a block
    params = {"w": cts.device_put(W, NamedSharding(mix, P("data", "model"))),
              "b": cts.device_put(W[0], NamedSharding(mix, P("model")))}
    for name, make in txs.items():
        tx = make()
        state = TrainState.create(apply_fn=None, params=params, tx=tx)
        for i in range(2):
            grads = {k: v * np.float32(0.5 + i) + 0.01 for k, v in state.params.items()}
            state = state.apply_gradients(grads=grads)
        updates, _ = tx.update(grads, tx.init(params), params)
        for k in params:
            out[f"mix_{name}_param_{k}"] = host(state.params[k])
            out[f"mix_{name}_update_{k}"] = host(updates[k])
        for j, v in enumerate(cts.tree_util.tree_leaves(state.opt_state)):
            out[f"mix_{name}_state{j}"] = host(v) if isinstance(v, cts.Array) else np.asarray(v)
    return out


def reference(path):
    n = cts.device_count() // 2
    out = computed(cts.make_mesh((n, 2), ("data", "model")), np.asarray)
    np.savez(path, **out)
    print("REFERENCE", n, len(out))


def main(ref_path):
    from ctrainstate import distributed as dist
    from ctrainstate.experimental import multihost_utils as mhu

    start(dist)
    me, n = cts.process_index(), cts.process_count()
    mesh = cts.make_mesh((n, 2), ("data", "model"))
    out = computed(mesh, mhu.process_allgather)
    ref = np.load(ref_path)
    assert sorted(ref.files) == sorted(out), (sorted(ref.files), sorted(out))
    checks = 0
    for k, v in out.items():
        want = ref[k]
        v = np.asarray(v)
        assert v.dtype == want.dtype and v.shape == want.shape, (k, v.dtype, v.shape)
        assert np.array_equal(v.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)), (
            k, np.max(np.abs(v.astype(np.float64) - want.astype(np.float64))))
        checks += 1
    # what is not supported raises on every process, naming what to do: a global norm over
    # params of which one lives on this process's devices only (a different value on each)
    x = cts.device_put(np.ones((4 * n, 8), np.float32), NamedSharding(mesh, P("data", "model")))
    b = cts.device_put(np.ones(3, np.float32))
    state = TrainState.create(apply_fn=None, params={"w": x, "b": b},
                              tx=optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1)))
    try:
        state.apply_gradients(grads={"w": x * 0.5, "b": b})
    except ValueError as e:
        assert "while other params span processes" in str(e) and "global mesh" in str(e), e
        checks += 1
    else:
        raise AssertionError("no ValueError for a global norm over a process-local param")
    finish(dist, me, n, checks)


if __name__ == "__main__":
    run(main, reference)
