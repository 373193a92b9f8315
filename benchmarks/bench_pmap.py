"""Time per data-parallel train step (run_clm_flax's shape: value_and_grad, pmean of the
grads, AdamW) three ways, in the same process: ``ctrainstate.pmap`` (one replica per device,
run in turn), ctrainstate's sharded eager step (the state replicated over a ('batch',) mesh,
the batch sharded along it, one op over all devices), and ``jax.pmap`` (compiled), where jax
is installed.

    python benchmarks/bench_pmap.py [--devices 8] [--width 256] [--per-device 32] [--reps 5]

The model: Dense(width) -> relu -> Dense(width) -> relu -> Dense(16), softmax cross entropy.
Prints ms per step and each time's ratio to ctrainstate's sharded step (>1: slower).
"""
import argparse
import os
import sys

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--devices", type=int, default=8)
ap.add_argument("--width", type=int, default=256)
ap.add_argument("--per-device", type=int, default=32)
ap.add_argument("--reps", type=int, default=5)
args = ap.parse_args()
os.environ.setdefault("CTRAINSTATE_NUM_CPU_DEVICES", str(args.devices))
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "python"))

import numpy as np  # noqa: E402

from _timing import best  # noqa: E402
import ctrainstate as cts  # noqa: E402
from ctrainstate import hf, nn, optim, random  # noqa: E402


def model_of(m, width):
    class MLP(m.Module):
        @m.compact
        def __call__(self, x):
            x = m.relu(m.Dense(width)(x))
            x = m.relu(m.Dense(width)(x))
            return m.Dense(16)(x)
    return MLP()


def best_ms(step, reps):
    return best(step, reps) * 1e3


def main():
    n = args.devices
    assert cts.local_device_count() >= n, "set CTRAINSTATE_NUM_CPU_DEVICES"
    rs = np.random.RandomState(0)
    x = rs.randn(n * args.per_device, 64).astype(np.float32)
    y = rs.randint(0, 16, n * args.per_device).astype(np.int32)
    model = model_of(nn, args.width)
    params = model.init(random.PRNGKey(0), x[:1])["params"]
    xent = optim.softmax_cross_entropy_with_integer_labels

    def step_fn(state, batch):
        def loss_fn(p):
            return xent(state.apply_fn({"params": p}, batch["x"]), batch["y"]).mean()
        loss, grad = cts.value_and_grad(loss_fn)(state.params)
        grad = cts.lax.pmean(grad, "batch")
        return state.apply_gradients(grads=grad), cts.lax.pmean(loss, "batch")

    devs = cts.local_devices()[:n]
    rows = []
    # ctrainstate.pmap
    state = [hf.replicate(cts.train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optim.adamw(1e-3)), devs)]
    p_step = cts.pmap(step_fn, "batch", devices=devs)
    sb = {"x": x.reshape(n, -1, 64), "y": y.reshape(n, -1)}

    def run_pmap():
        state[0], loss = p_step(state[0], sb)
        cts.block_until_ready(loss)
    rows.append(("ctrainstate.pmap", best_ms(run_pmap, args.reps)))
    # ctrainstate sharded eager step over a ('batch',) mesh
    mesh = cts.Mesh(np.array(devs, dtype=object), ("batch",))
    rep = cts.NamedSharding(mesh, cts.P())
    st = [cts.train_state.TrainState.create(apply_fn=model.apply,
                                            params=cts.device_put(params, rep),
                                            tx=optim.adamw(1e-3))]
    gb = {"x": cts.device_put(x, cts.NamedSharding(mesh, cts.P("batch"))),
          "y": cts.device_put(y, cts.NamedSharding(mesh, cts.P("batch")))}

    def run_sharded():
        def loss_fn(p):
            return xent(st[0].apply_fn({"params": p}, gb["x"]), gb["y"]).mean()
        loss, grad = cts.value_and_grad(loss_fn)(st[0].params)
        st[0] = st[0].apply_gradients(grads=grad)
        cts.block_until_ready(loss)
    rows.append(("ctrainstate sharded step", best_ms(run_sharded, args.reps)))
    try:
        import jax
        import flax.linen as fnn
        import optax
        from flax.training import train_state
    except ImportError:
        jax = None
    if jax is not None and len(jax.devices()) >= n:
        jmodel = model_of(fnn, args.width)
        jparams = jmodel.init(jax.random.PRNGKey(0), x[:1])["params"]
        from flax import jax_utils
        jstate = jax_utils.replicate(
            train_state.TrainState.create(apply_fn=jmodel.apply, params=jparams,
                                          tx=optax.adamw(1e-3)), jax.devices()[:n])

        def jstep(state, batch):
            def loss_fn(p):
                return optax.softmax_cross_entropy_with_integer_labels(
                    state.apply_fn({"params": p}, batch["x"]), batch["y"]).mean()
            loss, grad = jax.value_and_grad(loss_fn)(state.params)
            grad = jax.lax.pmean(grad, "batch")
            return state.apply_gradients(grads=grad), jax.lax.pmean(loss, "batch")
        jp = jax.pmap(jstep, "batch", devices=jax.devices()[:n])
        js = [jstate]
        jb = {"x": x.reshape(n, -1, 64), "y": y.reshape(n, -1)}

        def run_jax():
            js[0], loss = jp(js[0], jb)
            loss.block_until_ready()
        rows.append(("jax.pmap (jit)", best_ms(run_jax, args.reps)))
    ref = rows[1][1]
    print(f"step: MLP 64 -> {args.width} -> {args.width} -> 16, AdamW, {n} devices x "
          f"{args.per_device} examples")
    for name, t in rows:
        print(f"{name:26s} {t:8.2f} ms   {t / ref:5.2f}x the sharded step")


if __name__ == "__main__":
    main()
