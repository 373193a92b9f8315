"""Time per SIREN training step: ctrainstate (1 device and the 2x4 mesh of CPU devices)
against the same model in Flax on jax-cpu (jit), in the same process.

    python benchmarks/bench_siren.py [--size 64] [--hidden 256] [--steps 20]
    python benchmarks/bench_siren.py --gpu     # GPU devices vs Flax on jax-gpu
    python benchmarks/bench_siren.py --gpu --profile   # and where the host time per step goes

The implementations run in alternating rounds (``--rounds``), each a block of every one's steps
in turn, so that a machine whose speed drifts slows them alike; the median step is reported.
Prints a table with ms/step and the ratio to Flax (>1 means ctrainstate is slower): ctrainstate
eager, and with the whole training step (``value_and_grad`` + ``apply_gradients``) under
``cts.jit`` (traced once, replayed from C), as Flax's step is under ``jax.jit``. With ``--gpu``
one more row: the jitted step on one device kernel by kernel (``CTRAINSTATE_CUDA_GRAPHS=0`` at
the trace), beside the default, whose runs of GPU steps replay as CUDA graphs.
"""
import argparse
import math
import os
import statistics
import sys
import time

GPU = "--gpu" in sys.argv
os.environ.setdefault("CTRAINSTATE_NUM_CPU_DEVICES", "8")
if not GPU:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import numpy as np  # noqa: E402

import ctrainstate as cts  # noqa: E402
import ctrainstate.numpy as cnp  # noqa: E402
from ctrainstate import NamedSharding, P, optim, random  # noqa: E402
from ctrainstate import partitioning as nn_partitioning  # noqa: E402
from ctrainstate.train_state import TrainState  # noqa: E402
import siren  # noqa: E402


def make_ctrainstate(mesh_shape, coords, target, hidden, layers, jit=False):
    """The ctrainstate step on a mesh: a function run(n, times) that runs n training steps
    (each synchronised by reading its loss) inside the mesh and rules contexts, appending each
    step's seconds to `times`, and returns the last loss."""
    devs = cts.devices("gpu" if GPU else "cpu")[: math.prod(mesh_shape)]
    if len(devs) < math.prod(mesh_shape):
        raise RuntimeError(f"needs {math.prod(mesh_shape)} devices (CTRAINSTATE_GPU_SPLIT)")
    mesh = cts.Mesh(np.array(devs, dtype=object).reshape(mesh_shape), ("data", "model"))
    model = siren.Siren(hidden=hidden, layers=layers, out_features=target.shape[1])
    with mesh, nn_partitioning.axis_rules(siren.RULES):
        c = cts.device_put(coords, NamedSharding(mesh, P("data", None)))
        t = cts.device_put(target, NamedSharding(mesh, P("data", None)))
        v = model.init(random.PRNGKey(0), c)
        state = [TrainState.create(apply_fn=model.apply, params=v["params"], tx=optim.adam(1e-4))]

    def train_step(state, c, t):
        def loss_fn(p):
            return cnp.mean(cnp.square(state.apply_fn({"params": p}, c) - t))
        loss, g = cts.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=g), loss
    if jit:   # the whole step traced once, replayed from C (the optimizer step a node)
        train_step = cts.jit(train_step)

    def run(n, times):
        loss = None
        with mesh, nn_partitioning.axis_rules(siren.RULES):
            for _ in range(n):
                t0 = time.perf_counter()
                state[0], loss = train_step(state[0], c, t)
                loss = float(loss)
                times.append(time.perf_counter() - t0)
        return loss
    return run


def profile_ctrainstate(run, steps, mesh_shape):
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
    run(steps, [])
    prof.disable()
    _print_profile(prof, steps, mesh_shape)


def _print_profile(prof, steps, mesh_shape):
    """Where a step's host time goes (--profile): the calls with the most own time per step,
    C entry points (kernel launches, copies, synchronisations) among them."""
    import pstats
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:15]
    total = sum(v[2] for v in st.stats.values())
    print(f"profile, mesh {mesh_shape}: {total / steps * 1e3:.2f} ms/step of host time "
          f"(under cProfile); the 15 largest by own time:")
    print(f"  {'ms/step':>8s} {'calls/step':>10s}  function")
    for (fn, line, name), (cc, nc, tt, ct, _) in rows:
        where = name if fn == "~" else f"{os.path.basename(fn)}:{line}({name})"
        print(f"  {tt / steps * 1e3:8.3f} {nc / steps:10.1f}  {where}")


def make_flax(coords, target, hidden, layers):
    """The same model and step in Flax, jitted: run(n, times) as make_ctrainstate's."""
    import jax
    import jax.numpy as jnp
    import flax.linen as fnn
    import optax
    from flax.training.train_state import TrainState as FState

    class SineDense(fnn.Module):
        features: int
        first: bool = False
        last: bool = False

        @fnn.compact
        def __call__(self, x):
            fan = x.shape[-1]
            b = 1.0 / fan if self.first else math.sqrt(6.0 / fan) / 30.0
            u = lambda bound: (lambda k, s, d=jnp.float32: jax.random.uniform(k, s, d, -bound, bound))
            k = self.param("kernel", u(b), (fan, self.features))
            bias = self.param("bias", u(1.0 / math.sqrt(fan)), (self.features,))
            y = x @ k + bias
            return y if self.last else jnp.sin(30.0 * y)

    class FSiren(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            x = SineDense(hidden, first=True)(x)
            for _ in range(layers - 1):
                x = SineDense(hidden)(x)
            return SineDense(target.shape[1], last=True)(x)

    m = FSiren()
    st = [FState.create(apply_fn=m.apply, params=m.init(jax.random.PRNGKey(0), coords)["params"],
                       tx=optax.adam(1e-4))]

    @jax.jit
    def step(st, c, t):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(jnp.square(st.apply_fn({"params": p}, c) - t)))(st.params)
        return st.apply_gradients(grads=g), loss

    c, t = jnp.asarray(coords), jnp.asarray(target)

    def run(n, times):
        loss = None
        for _ in range(n):
            t0 = time.perf_counter()
            st[0], loss = step(st[0], c, t)
            loss = float(loss)
            times.append(time.perf_counter() - t0)
        return loss
    return run


def measure(runs, steps, rounds):
    """Per-step median ms of each run(n, times) in `runs` (a dict name -> run): two warm-up
    steps each (compilation, traces, plans), then `rounds` rounds, each a block of
    steps / rounds steps of every run in turn, so that a machine whose speed drifts during
    the benchmark (a shared VM) slows all of them alike."""
    for run in runs.values():
        run(2, [])
    times = {name: [] for name in runs}
    losses = {}
    block = max(1, -(-steps // rounds))
    done = 0
    while done < steps:
        n = min(block, steps - done)
        for name, run in runs.items():
            losses[name] = run(n, times[name])
        done += n
    return {name: (statistics.median(times[name]) * 1e3, losses[name]) for name in runs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=10,
                    help="the steps are run in this many rounds, each a block of every "
                         "implementation's steps in turn")
    ap.add_argument("--gpu", action="store_true", help="GPU devices, and Flax on jax-gpu")
    ap.add_argument("--profile", action="store_true",
                    help="also print where ctrainstate's host time per step goes (cProfile)")
    a = ap.parse_args()
    if GPU and not cts._C.device_ids("gpu"):
        print(f"--gpu: skipped, no GPU devices ({cts.gpu_status()})")
        return
    img = siren.test_image(a.size)
    h, w, c = img.shape
    ys, xs = np.meshgrid(np.linspace(-1, 1, h), np.linspace(-1, 1, w), indexing="ij")
    coords = np.stack([ys, xs], -1).reshape(-1, 2).astype(np.float32)
    target = (img.reshape(-1, c) * 2 - 1).astype(np.float32)
    print(f"SIREN {a.layers}x{a.hidden}, {h}x{w} image ({coords.shape[0]} pixels), "
          f"median of {a.steps} steps in {a.rounds} alternating rounds, load average {os.getloadavg()[0]:.2f}")
    kind = "GPU" if GPU else "CPU"
    runs = {}
    for jit in (False, True):
        how = "jit" if jit else "eager"
        runs[f"ctrainstate {how}, 1 {kind} device"] = run = make_ctrainstate(
            (1, 1), coords, target, a.hidden, a.layers, jit=jit)
        if a.profile:
            run(2, [])
            profile_ctrainstate(run, a.steps, (1, 1))
        try:
            runs[f"ctrainstate {how}, 2x4 mesh (8 {kind})"] = make_ctrainstate(
                (2, 4), coords, target, a.hidden, a.layers, jit=jit)
        except RuntimeError as e:
            print(f"2x4 mesh skipped: {e}")
    if GPU:   # the jitted step kernel by kernel (CUDA graphs off when it is traced)
        os.environ["CTRAINSTATE_CUDA_GRAPHS"] = "0"
        run = make_ctrainstate((1, 1), coords, target, a.hidden, a.layers, jit=True)
        run(1, [])    # (traced now)
        del os.environ["CTRAINSTATE_CUDA_GRAPHS"]
        runs[f"ctrainstate jit, no CUDA graphs, 1 {kind}"] = run
    peer = None
    try:
        import jax
        backend = jax.default_backend()  # the label says where the peer really ran
        if GPU and backend != "gpu":
            print(f"jax has no GPU here (default backend {backend!r}): the peer runs on jax-{backend}")
        peer = f"flax on jax-{backend} (jit)"
        runs[peer] = make_flax(coords, target, a.hidden, a.layers)
    except ImportError as e:
        print(f"flax/jax/optax not installed ({e}): peer skipped")
    rows = list(measure(runs, a.steps, a.rounds).items())
    ref = dict(rows)[peer][0] if peer is not None else None
    print(f"{'implementation':40s} {'ms/step':>9s} {'vs flax':>8s}")
    for name, (ms, _) in rows:
        ratio = f"{ms / ref:7.2f}x" if ref else "   n/a"
        print(f"{name:40s} {ms:9.2f} {ratio}" if ms >= 1.0 else f"{name:40s} {ms:9.4f} {ratio}")


if __name__ == "__main__":
    main()
