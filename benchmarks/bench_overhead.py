"""Host time per call: the optimizer step on many tiny leaves, and single ops on tiny arrays.

    python benchmarks/bench_overhead.py [--steps 400] [--calls 3000]

Where the device work is negligible, what is left is the host's share of a call: Python,
the bindings, the launch. On a GPU that share decides whether the host or the GPU sets the
pace (issue #6's 148-leaf GPT-2 step was host-bound on the H200), so it is measured here on
CPU devices, where it can be measured on any machine:

* ``TrainState.apply_gradients`` with AdamW on 148 leaves of 16 elements (one dict, and
  GPT-2's shape: 74 dicts of a (4, 4) kernel and a bias; and (2, 8) leaves sharded over a
  2x4 mesh of CPU devices), and the same step through t5x's ``OptaxWrapper``
  (``Optimizer.apply_gradient``): median, 10th and 90th percentiles and minimum over
  ``--steps`` steps after 20 warm-up steps (the first runs the general path and builds the
  persistent plan the others run from), with Python's garbage collector on (as in a
  training loop) and off;
* the peer, when jax, flax and optax are installed: Flax's ``TrainState.apply_gradients``
  with ``optax.adamw`` on the same 148 leaves, jitted with the state donated, on jax-cpu,
  timed the same way, each step waited for (``block_until_ready``: ctrainstate's step is
  synchronous); the ratio of the medians is printed (issue #30's goal: <= 0.1x, and
  <= 40 us on 1 device, <= 80 us on the 2x4 mesh);
* single ops on tiny arrays (1 device, and a 2x4 mesh of CPU devices): the best of 5 rounds
  of ``--calls`` calls (``timeit``).

The single ops have no peer here: they are compared with an earlier commit run the same way
in the same session (benchmarks/RESULTS.md).
"""
import argparse
import gc
import os
import time
import timeit

os.environ.setdefault("CTRAINSTATE_NUM_CPU_DEVICES", "8")

import numpy as np  # noqa: E402

import ctrainstate as cts  # noqa: E402
import ctrainstate.numpy as cnp  # noqa: E402
from ctrainstate import optim  # noqa: E402
from ctrainstate.train_state import TrainState  # noqa: E402

LEAVES = 148


def _percentiles(step, steps):
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    ts = np.array(ts) * 1e3
    return np.median(ts), np.percentile(ts, 10), np.percentile(ts, 90), ts.min()


def _steppers():
    tx = lambda: optim.adamw(1e-3, 0.9, 0.999, 1e-8, weight_decay=0.01)  # noqa: E731
    params = {f"l{i}": np.ones(16, np.float32) for i in range(LEAVES)}
    g = cts.device_put({f"l{i}": np.ones(16, np.float32) for i in range(LEAVES)})
    st = [TrainState.create(apply_fn=None, params=params, tx=tx())]

    def ts_step():
        st[0] = st[0].apply_gradients(grads=g)
    from ctrainstate.t5x import optimizers as t5opt
    opt = [t5opt.OptaxWrapper(tx()).create(params)]

    def t5x_step():
        opt[0] = opt[0].apply_gradient(g)

    # the same leaf count in GPT-2's shape: 74 layers of {kernel, bias} (nested dicts)
    nested = {f"layer{i}": {"kernel": np.ones((4, 4), np.float32), "bias": np.ones(4, np.float32)}
              for i in range(LEAVES // 2)}
    gn = cts.device_put(cts.tree_util.tree_map(lambda a: np.full(a.shape, 0.1, np.float32), nested))
    stn = [TrainState.create(apply_fn=None, params=nested, tx=tx())]

    def nested_step():
        stn[0] = stn[0].apply_gradients(grads=gn)

    # 148 (2, 8) leaves sharded over a 2x4 mesh: 8 blocks of (1, 2) each, on 8 devices
    mesh = cts.Mesh(np.array(cts.devices()[:8]).reshape(2, 4), ("x", "y"))
    sh = cts.NamedSharding(mesh, cts.P("x", "y"))
    pm = {f"l{i}": cts.device_put(np.ones((2, 8), np.float32), sh) for i in range(LEAVES)}
    gm = {f"l{i}": cts.device_put(np.full((2, 8), 0.1, np.float32), sh) for i in range(LEAVES)}
    stm = [TrainState.create(apply_fn=None, params=pm, tx=tx())]

    def mesh_step():
        stm[0] = stm[0].apply_gradients(grads=gm)
    return [("TrainState.apply_gradients", ts_step),
            ("t5x Optimizer.apply_gradient (OptaxWrapper)", t5x_step),
            ("TrainState.apply_gradients, 74 x {kernel, bias}", nested_step),
            ("TrainState.apply_gradients, 2x4 mesh, (2, 8) leaves", mesh_step)]


def _optax_stepper():
    """Flax's TrainState with optax.adamw on the same leaves, jitted (state donated)."""
    try:
        import jax
        import optax
        from flax.training import train_state
    except ImportError:
        return None
    cpu = jax.devices("cpu")[0]
    params = {f"l{i}": jax.device_put(np.ones(16, np.float32), cpu) for i in range(LEAVES)}
    g = {f"l{i}": jax.device_put(np.ones(16, np.float32), cpu) for i in range(LEAVES)}
    st = [train_state.TrainState.create(
        apply_fn=None, params=params, tx=optax.adamw(1e-3, 0.9, 0.999, 1e-8, weight_decay=0.01))]
    step = jax.jit(lambda s, grads: s.apply_gradients(grads=grads), donate_argnums=0)

    def optax_step():
        st[0] = jax.block_until_ready(step(st[0], g))
    return optax_step


def run_steps(steps):
    print(f"## optimizer step, AdamW on {LEAVES} leaves x 16 elements, 1 CPU device: "
          f"ms per step over {steps} steps")
    print(f"{'step':50s} {'gc':>4s} {'median':>8s} {'p10':>7s} {'p90':>7s} {'min':>7s}")
    steppers = _steppers()
    peer = _optax_stepper()
    if peer is not None:
        steppers.append(("peer: Flax TrainState + optax.adamw, jit (jax-cpu)", peer))
    medians = {}
    for name, step in steppers:
        for _ in range(20):
            step()
        for gc_on in (True, False):
            if not gc_on:
                gc.disable()
            try:
                med, p10, p90, mn = _percentiles(step, steps)
            finally:
                gc.enable()
            medians.setdefault(name, med)
            print(f"{name:50s} {'on' if gc_on else 'off':>4s} {med:8.3f} {p10:7.3f} {p90:7.3f} "
                  f"{mn:7.3f}")
    ours = medians["TrainState.apply_gradients"]
    mesh = medians["TrainState.apply_gradients, 2x4 mesh, (2, 8) leaves"]
    print(f"\nTrainState step, 1 device: {ours * 1e3:.1f} us (goal <= 40); 2x4 mesh: "
          f"{mesh * 1e3:.1f} us (goal <= 80)")
    if peer is not None:
        theirs = medians["peer: Flax TrainState + optax.adamw, jit (jax-cpu)"]
        print(f"ratio to the jitted optax step (medians, gc on): {ours / theirs:.3f}x "
              f"(goal <= 0.1x)")
    else:
        print("jax / flax / optax not installed: no peer")


def run_ops(calls):
    a = cts.device_put(np.ones((4, 16), np.float32))
    b = cts.device_put(np.ones((16,), np.float32))
    mesh = cts.Mesh(np.array(cts.devices()[:8]).reshape(2, 4), ("x", "y"))
    sh = cts.NamedSharding(mesh, cts.P("x", "y"))
    am = cts.device_put(np.ones((8, 16), np.float32), sh)
    bm = cts.device_put(np.ones((8, 16), np.float32), sh)
    print(f"\n## single ops on tiny arrays: us per call, best of 5 x {calls} calls")
    for name, f in [("a + b (1 device, broadcast)", lambda: a + b),
                    ("sin(a) (1 device)", lambda: cnp.sin(a)),
                    ("am * bm (2x4 mesh)", lambda: am * bm),
                    ("a @ b (1 device)", lambda: a @ b)]:
        t = min(timeit.repeat(f, number=calls, repeat=5)) / calls * 1e6
        print(f"{name:32s} {t:8.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    print(f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")
    run_steps(args.steps)
    run_ops(args.calls)


if __name__ == "__main__":
    main()
