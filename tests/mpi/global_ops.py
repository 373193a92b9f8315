"""Run under mpirun (tests/distributed/test_distributed_mpi.py), each process with 2 CPU
devices: operations on Arrays that span processes and training steps (value_and_grad,
apply_gradients) on a global mesh, compared bit for bit with a run of one process that has
as many devices as the whole job (the reference run writes what it computed).

    python tests/mpi/global_ops.py --reference ref.npz   # one process, 2 * N devices
    mpirun -n N python tests/mpi/global_ops.py ref.npz   # N processes, 2 devices each

Each process prints "OK <process> <count> <checks>" at the end (and writes it to a file in
CT_TEST_OUT); any failure raises (non-zero exit).
"""
import sys

import numpy as np

from report import report

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
    return out


def reference(path):
    n = cts.device_count() // 2
    out = computed(cts.make_mesh((n, 2), ("data", "model")), np.asarray)
    np.savez(path, **out)
    print("REFERENCE", n, len(out))


def main(ref_path):
    from ctrainstate import distributed as dist
    from ctrainstate.experimental import multihost_utils as mhu

    dist.initialize(timeout=60)
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
    # what is not supported yet raises on every process, naming what to do
    x = cts.device_put(np.ones((4 * n, 8), np.float32), NamedSharding(mesh, P("data", "model")))
    state = TrainState.create(apply_fn=None, params={"w": x},
                              tx=optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1)))
    try:
        state.apply_gradients(grads={"w": x * 0.5})
    except ValueError as e:
        assert "span processes are not supported yet" in str(e), e
        checks += 1
    else:
        raise AssertionError("no ValueError for clip_by_global_norm across processes")
    for op in (lambda: x[0], lambda: jnp.concatenate([x, x]), lambda: x.at[0].set(2.0)):
        try:
            op()
        except ValueError as e:
            assert "span processes yet" in str(e) and "process_allgather" in str(e), e
            checks += 1
        else:
            raise AssertionError("no ValueError")
    dist.shutdown()
    report(me, f"OK {me} {n} {checks}")


if __name__ == "__main__":
    if sys.argv[1] == "--reference":
        reference(sys.argv[2])
    else:
        main(sys.argv[1])
