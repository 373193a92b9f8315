"""AdamW step throughput: ctrainstate's fused TrainState.apply_gradients vs peers.

Cases: one flat leaf of 2^24 fp32 params, and a 148-leaf GPT-2-small-shaped tree
(124M params). Reports ms/step (median of --reps after a warm-up), GB/s at 28
bytes/param (read p, g, m, v; write p, m, v), the ratio to the copy bandwidth
measured in the same run, and the ratio to a vectorised numpy AdamW, optax on
jax-cpu (jit, donated buffers) and torch.optim.AdamW(foreach=True) when those
are installed. Also prints the RSS before/after a run of steps (the optimizer
must not grow it), and adafactor (defaults) on the tree against optax's.

Copy bandwidth (bytes read + written, 256 MiB) is measured three ways: np.copyto
on one thread, numpy copies of two halves on two threads, and ctrainstate's own
OpenMP block copy (_C.copy_overlap of a (64, n/64) buffer). "x copy bw" is
against the fastest of them, so it is not flattered by a one-thread peer.
Every implementation and copy runs once per rep, round-robin, so that on a
shared machine they all see the same load; medians are reported.

    python benchmarks/bench_optim.py [--reps 7] [--skip-tree] [--skip-adafactor] [--overhead-only]
    python benchmarks/bench_optim.py --lowp [--reps 7]   # 16-bit arrays vs float32 (run_lowp)
    python benchmarks/bench_optim.py --gpu [--reps 7]

--lowp: AdamW on a flat 2^24 leaf with bfloat16 / float16 arrays against float32 in the same
run: the fused kernel alone (_C.optim_step), in GB/s of the bytes the step must move (28 per
param in float32, 14 in all-bfloat16; wall and CPU time), the ratio to float32's GB/s (issue
#30: all-bfloat16 >= 0.90x), then TrainState.apply_gradients end to end and optax.

--gpu: AdamW on one GPU device (csrc/backend/cuda/cuda_optim.cu): a flat 2^28 fp32 leaf and
the 148-leaf GPT-2-small tree. Each rep times --gpu-steps steps between device
synchronisations; reports ms/step, GB/s at 28 bytes/param, the ratio to a device-to-device
copy of 2 x 1 GiB buffers (_C.copy_bytes, bytes read + written) measured in the same run,
and torch.optim.AdamW(fused=True) / optax on jax-gpu when importable. Issue #6 goals on
an H200: 2^28 <= 1.90 ms (floor 1.80 ms), GPT-2 tree <= 0.95 ms (floor 0.83 ms).
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

import ctrainstate as cts  # noqa: E402
import ctrainstate.optim as optim  # noqa: E402
from ctrainstate.train_state import TrainState  # noqa: E402

LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01
BYTES_PER_PARAM = 28


def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def gpt2_small_shapes():
    d, v, ctx, L = 768, 50257, 1024, 12
    shapes = {"wte": (v, d), "wpe": (ctx, d), "ln_f": {"scale": (d,), "bias": (d,)}}
    for i in range(L):
        shapes[f"h{i}"] = {
            "ln_1": {"scale": (d,), "bias": (d,)},
            "attn": {"c_attn": {"kernel": (d, 3 * d), "bias": (3 * d,)},
                     "c_proj": {"kernel": (d, d), "bias": (d,)}},
            "ln_2": {"scale": (d,), "bias": (d,)},
            "mlp": {"c_fc": {"kernel": (d, 4 * d), "bias": (4 * d,)},
                    "c_proj": {"kernel": (4 * d, d), "bias": (d,)}},
        }
    return shapes


def make_tree(shapes, rng):
    return cts.tree_util.tree_map(
        lambda s: rng.standard_normal(s, dtype=np.float32) * np.float32(0.02), shapes,
        is_leaf=lambda x: isinstance(x, tuple))


def copy_steps(nbytes):
    """Three copies of nbytes (label -> step); GB/s = 2 * nbytes / time (read + write)."""
    from ctrainstate import _C
    from ctrainstate._src.array.array import _buffer_view
    n = nbytes // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    h = n // 2

    def two():
        t = threading.Thread(target=np.copyto, args=(dst[:h], src[:h]))
        t.start()
        np.copyto(dst[h:], src[h:])
        t.join()
    shape = (64, n // 64)
    sb, db = _C.Buffer(0, shape, 0), _C.Buffer(0, shape, 0)
    _buffer_view(sb, shape, np.float32)[...] = 1
    return {"copy: np.copyto, 1 thread": lambda: np.copyto(dst, src),
            "copy: numpy, 2 threads (halves)": two,
            "copy: ctrainstate _C (OpenMP)": lambda: _C.copy_overlap(db, (0, 0), sb, (0, 0))}


def interleaved(steps, reps, warmup=2):
    """Run the steps round-robin (one of each per rep) so that all of them see the same load
    on a shared machine; label -> median seconds."""
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    ts = {k: [] for k in steps}
    for _ in range(reps):
        for k, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in ts.items()}


def make_ctrainstate(params_np, grads_np):
    tx = optim.adamw(LR, B1, B2, EPS, weight_decay=WD)
    st = [TrainState.create(apply_fn=None, params=params_np, tx=tx)]
    g = cts.device_put(grads_np)

    def step():
        st[0] = st[0].apply_gradients(grads=g)
    return step


def make_numpy(params_np, grads_np):
    ps = [p.copy() for p in cts.tree_util.tree_leaves(params_np)]
    gs = cts.tree_util.tree_leaves(grads_np)
    ms = [np.zeros_like(p) for p in ps]
    vs = [np.zeros_like(p) for p in ps]
    tmp = [np.empty_like(p) for p in ps]
    count = [0]

    def step():
        count[0] += 1
        bc1 = 1 - B1 ** count[0]
        bc2 = 1 - B2 ** count[0]
        for p, g, m, v, t in zip(ps, gs, ms, vs, tmp):
            m *= B1
            m += (1 - B1) * g
            np.multiply(g, g, out=t)
            t *= (1 - B2)
            v *= B2
            v += t
            np.divide(v, bc2, out=t)
            np.sqrt(t, out=t)
            t += EPS
            np.divide(m, t, out=t)
            t *= 1 / bc1
            t += WD * p
            t *= -LR
            p += t
    return step


def make_optax(params_np, grads_np):
    try:
        import jax
        import jax.numpy as jnp
        import optax
    except Exception:
        return None
    tx = optax.adamw(LR, B1, B2, EPS, weight_decay=WD)
    params = jax.tree.map(jnp.asarray, params_np)
    grads = jax.tree.map(jnp.asarray, grads_np)
    state = tx.init(params)

    @jax.jit
    def _step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    step_j = jax.jit(_step.__wrapped__ if hasattr(_step, "__wrapped__") else _step,
                     donate_argnums=(0, 1))
    box = [params, state]

    def step():
        box[0], box[1] = step_j(box[0], box[1], grads)
        jax.block_until_ready(box[0])
    return step


def make_torch(params_np, grads_np):
    try:
        import torch
    except Exception:
        return None
    ps = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in cts.tree_util.tree_leaves(params_np)]
    for p, g in zip(ps, cts.tree_util.tree_leaves(grads_np)):
        p.grad = torch.from_numpy(g)
    opt = torch.optim.AdamW(ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, foreach=True)
    return opt.step


def run_adafactor(params_np, grads_np, reps):
    """adafactor(1e-3) with optax's defaults: ctrainstate (in place) vs optax (jit, donated),
    interleaved; label -> median seconds."""
    st = [TrainState.create(apply_fn=None, params=params_np, tx=optim.adafactor(1e-3))]
    g = cts.device_put(grads_np)

    def step():
        st[0] = st[0].apply_gradients(grads=g)
    steps = {"ctrainstate": step}
    try:
        import jax
        import jax.numpy as jnp
        import optax
    except Exception:
        return interleaved(steps, reps)
    tx = optax.adafactor(1e-3)
    params = jax.tree.map(jnp.asarray, params_np)
    grads = jax.tree.map(jnp.asarray, grads_np)

    def _step(p, s, gr):
        u, s = tx.update(gr, s, p)
        return optax.apply_updates(p, u), s
    step_j = jax.jit(_step, donate_argnums=(0, 1))
    box = [params, tx.init(params)]

    def ostep():
        box[0], box[1] = step_j(box[0], box[1], grads)
        jax.block_until_ready(box[0])
    steps["optax"] = ostep
    return interleaved(steps, reps)


def run_overhead(steps=200):
    """Per-step Python cost: AdamW on 148 leaves of 16 elements (the kernel is negligible)."""
    tx = optim.adamw(LR, B1, B2, EPS, weight_decay=WD)
    small = {f"l{i}": np.ones(16, np.float32) for i in range(148)}
    g = cts.device_put({f"l{i}": np.ones(16, np.float32) for i in range(148)})
    st = [TrainState.create(apply_fn=None, params=small, tx=tx)]
    for _ in range(20):
        st[0] = st[0].apply_gradients(grads=g)
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        st[0] = st[0].apply_gradients(grads=g)
        ts.append(time.perf_counter() - t0)
    print(f"\n## per-step overhead: AdamW apply_gradients on 148 leaves x 16 elements: median "
          f"{np.median(ts) * 1e3:.3f} ms, min {min(ts) * 1e3:.3f} ms over {steps} steps, "
          f"load average {os.getloadavg()[0]:.2f}")


def run_case(name, params_np, grads_np, n, copies, reps):
    """All implementations and the copies interleaved rep by rep; prints the table."""
    labels = {"ctrainstate": "ctrainstate (fused, in place)",
              "numpy": "numpy (vectorised, in place)",
              "optax": "optax on jax-cpu (jit, donated)",
              "torch": "torch AdamW(foreach=True)"}
    makers = {"ctrainstate": make_ctrainstate, "numpy": make_numpy, "optax": make_optax,
              "torch": make_torch}
    steps = {}
    for k, make in makers.items():
        fn = make(params_np, grads_np)
        if fn is not None:
            steps[k] = fn
    steps.update(copies)
    t = interleaved(steps, reps)
    r0 = rss_mb()
    for _ in range(20):
        steps["ctrainstate"]()
    r1 = rss_mb()
    copy_gbs = {k: (2 << 28) / t[k] / 1e9 for k in copies}
    best = max(copy_gbs.values())
    print(f"\n## {name}: {n:,} params, {len(cts.tree_util.tree_leaves(params_np))} leaves, "
          f"load average {os.getloadavg()[0]:.2f}")
    for k, v in copy_gbs.items():
        print(f"{k + ' (256 MiB, read+write)':48s} {v:6.2f} GB/s")
    print(f"{'implementation':34s} {'ms/step':>9s} {'GB/s':>7s} {'x copy bw':>9s} {'ctrainstate speedup':>20s}")
    t_cts = t["ctrainstate"]
    for k, label in labels.items():
        if k not in t:
            print(f"{label:34s} {'(not installed: skipped)':>40s}")
            continue
        gbs = n * BYTES_PER_PARAM / t[k] / 1e9
        print(f"{label:34s} {t[k] * 1e3:9.2f} {gbs:7.2f} {gbs / best:9.2f} {t[k] / t_cts:19.2f}x")
    print(f"('x copy bw': against the fastest copy above, {best:.2f} GB/s)")
    print(f"RSS around 20 extra ctrainstate steps: {r0:.0f} MB -> {r1:.0f} MB")
    return t_cts


# --- GPU ----------------------------------------------------------------------------------------

def _gpu_time(step, sync, reps, steps, host=False):
    """Median seconds per step: `steps` steps between synchronisations, `reps` times. With
    host=True also the median host time per step to enqueue them (before the closing sync):
    when it is close to the step time, the host, not the GPU, sets the pace."""
    for _ in range(2):
        step()
    sync()
    ts, hs = [], []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        t1 = time.perf_counter()
        sync()
        ts.append((time.perf_counter() - t0) / steps)
        hs.append((t1 - t0) / steps)
    if host:
        return float(np.median(ts)), float(np.median(hs))
    return float(np.median(ts))


_OPT_KEYS = ("CTRAINSTATE_OPT_UNROLL", "CTRAINSTATE_OPT_PREFETCH", "CTRAINSTATE_OPT_WAVES",
             "CTRAINSTATE_OPT_CHAIN", "CTRAINSTATE_OPT_VSTORE")


class _env:
    """The fused kernel's launch settings for a block: the given ones set, the others unset
    (the defaults; an outer setting would mislabel the rows). The CUDA backend reads them at
    each launch."""

    def __init__(self, **kv):
        self.kv, self.old = kv, {}

    def __enter__(self):
        for k in set(_OPT_KEYS) | set(self.kv):
            self.old[k] = os.environ.get(k)
            if k in self.kv:
                os.environ[k] = self.kv[k]
            else:
                os.environ.pop(k, None)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# The fused kernel's launch settings compared in one run (cuda_optim.cu, launch_variant /
# main_grid / chain_id): every one computes the same bits. The default (first row): AdamW's
# own chain kernel, unroll 2, one wave of CTAs looping over tiles (not timed on a GPU before
# stop 17). "16-byte ld/st": the chain kernel's form with explicit 16-byte global loads and
# stores, quad by quad (CTRAINSTATE_OPT_VSTORE=1, stop 18; the default form stores p 32 bits
# at a time, see cuda_optim.cu's st_v4); with one CTA per tile it is the shape of XLA's fused
# elementwise kernel. "generic": the kernel that reads the stage kinds at run time; its row with unroll 2, no
# slot prefetch and one wave was the fastest setting on the H200 at stop 16 (RESULTS.md).
_GPU_VARIANTS = [("ctrainstate (fused, one launch)", {}),
                 ("  chain kernel, unroll 1", {"CTRAINSTATE_OPT_UNROLL": "1"}),
                 ("  chain kernel, 16-byte ld/st", {"CTRAINSTATE_OPT_VSTORE": "1"}),
                 ("  chain, 16-byte ld/st, unroll 1", {"CTRAINSTATE_OPT_VSTORE": "1",
                                                       "CTRAINSTATE_OPT_UNROLL": "1"}),
                 ("  chain kernel, 2 waves of CTAs", {"CTRAINSTATE_OPT_WAVES": "2"}),
                 ("  chain kernel, CTA per tile", {"CTRAINSTATE_OPT_WAVES": "0"}),
                 ("  chain, 16-byte, CTA per tile", {"CTRAINSTATE_OPT_VSTORE": "1",
                                                     "CTRAINSTATE_OPT_WAVES": "0"}),
                 ("  generic (stop 16 default)", {"CTRAINSTATE_OPT_CHAIN": "0"}),
                 ("  generic, unroll 1", {"CTRAINSTATE_OPT_CHAIN": "0",
                                          "CTRAINSTATE_OPT_UNROLL": "1"}),
                 ("  generic, slot prefetch", {"CTRAINSTATE_OPT_CHAIN": "0",
                                               "CTRAINSTATE_OPT_PREFETCH": "1"}),
                 ("  generic, CTA per tile, unroll 1", {"CTRAINSTATE_OPT_CHAIN": "0",
                                                        "CTRAINSTATE_OPT_UNROLL": "1",
                                                        "CTRAINSTATE_OPT_WAVES": "0"})]


def _chain_launches():
    """Update passes that ran a chain kernel so far (the CUDA backend's counter), or None."""
    import ctypes
    path = os.environ.get("CTRAINSTATE_CUDA_BACKEND")
    try:
        lib = ctypes.CDLL(path) if path else None
    except OSError:
        return None
    if lib is None or not hasattr(lib, "ct_cuda_optim_chain_launches"):
        return None
    lib.ct_cuda_optim_chain_launches.restype = ctypes.c_longlong
    return lib.ct_cuda_optim_chain_launches()


def _gpu_torch(params_np, grads_np):
    try:
        import torch
        if not torch.cuda.is_available():
            return None
    except Exception:
        return None
    ps = [torch.nn.Parameter(torch.from_numpy(p).cuda()) for p in cts.tree_util.tree_leaves(params_np)]
    for p, g in zip(ps, cts.tree_util.tree_leaves(grads_np)):
        p.grad = torch.from_numpy(g).cuda()
    opt = torch.optim.AdamW(ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, fused=True)
    return opt.step, torch.cuda.synchronize


def _gpu_optax(params_np, grads_np):
    try:
        import jax
        import optax
        gdev = jax.devices("gpu")[0]
    except Exception:
        return None
    tx = optax.adamw(LR, B1, B2, EPS, weight_decay=WD)
    p = jax.device_put(params_np, gdev)
    g = jax.device_put(grads_np, gdev)
    s = [p, tx.init(p)]

    def _step(p, st, g):
        u, st = tx.update(g, st, p)
        return optax.apply_updates(p, u), st
    step_d = jax.jit(_step, donate_argnums=(0, 1))

    def step():
        s[0], s[1] = step_d(s[0], s[1], g)
    return step, lambda: jax.block_until_ready(s[0])


def run_gpu(args):
    from ctrainstate import _C
    try:
        gdevs = cts.devices(args.gpu_platform)
    except RuntimeError as e:
        print(e)
        return
    dev = gdevs[0]
    print(f"ctrainstate AdamW on {dev!r}; load average {os.getloadavg()[0]:.2f}")
    sync = lambda: _C.synchronize(dev.id)  # noqa: E731
    nb = 1 << args.gpu_copy_log2
    src, dst = _C.Buffer(dev.id, (nb // 4,), 0), _C.Buffer(dev.id, (nb // 4,), 0)
    t_copy = _gpu_time(lambda: _C.copy_bytes(dst, src), sync, args.reps, 10)
    copy_gbs = 2 * nb / t_copy / 1e9
    print(f"copy: _C.copy_bytes GPU->GPU ({nb / 2**20:g} MiB, read+write)   {copy_gbs:8.1f} GB/s")
    del src, dst
    rng = np.random.default_rng(0)
    nf = 1 << args.gpu_flat_log2
    cases = [(f"flat 2^{args.gpu_flat_log2}", {"w": rng.standard_normal(nf, dtype=np.float32)},
              {"w": rng.standard_normal(nf, dtype=np.float32)}, 1.90, 1.80)]
    if not args.skip_tree:
        shapes = gpt2_small_shapes()
        cases.append(("GPT-2-small tree", make_tree(shapes, rng), make_tree(shapes, rng), 0.95, 0.83))
    best = {}   # case name: (seconds, settings) of its fastest ctrainstate row
    for name, p_np, g_np, goal, floor in cases:
        n = sum(x.size for x in cts.tree_util.tree_leaves(p_np))
        tx = optim.adamw(LR, B1, B2, EPS, weight_decay=WD)
        st = [TrainState.create(apply_fn=None, params=cts.device_put(p_np, dev), tx=tx)]
        g = cts.device_put(g_np, dev)

        def step():
            st[0] = st[0].apply_gradients(grads=g)
        rows = {label: (step, sync, env) for label, env in _GPU_VARIANTS}
        for label, make in (("torch AdamW(fused=True)", _gpu_torch), ("optax on jax-gpu (jit, donated)", _gpu_optax)):
            r = make(p_np, g_np)
            rows[label] = None if r is None else (r[0], r[1], None)
        print(f"\n## {name}: {n:,} params, {len(cts.tree_util.tree_leaves(p_np))} leaves "
              f"(issue #6 goal {goal:.2f} ms, floor {floor:.2f} ms)")
        print(f"{'implementation':34s} {'ms/step':>9s} {'GB/s':>8s} {'x copy bw':>9s} "
              f"{'vs ctrainstate':>15s} {'host ms/step':>13s} {'kernel':>8s}")
        t0 = None
        for label, r in rows.items():
            if r is None:
                print(f"{label:34s} {'(not importable: skipped)':>40s}")
                continue
            host = ""
            if r[2] is not None:  # ctrainstate: its launch settings, and the host's share
                c0 = _chain_launches()
                with _env(**r[2]):
                    t, h = _gpu_time(r[0], r[1], args.reps, args.gpu_steps, host=True)
                c1 = _chain_launches()
                kern = "?" if c0 is None or c1 is None else ("chain" if c1 > c0 else "generic")
                host = f"{h * 1e3:13.3f} {kern:>8s}"
            else:
                t = _gpu_time(r[0], r[1], args.reps, args.gpu_steps)
            t0 = t if t0 is None else t0
            gbs = n * BYTES_PER_PARAM / t / 1e9
            print(f"{label:34s} {t * 1e3:9.3f} {gbs:8.1f} {gbs / copy_gbs:9.2f} {t / t0:14.2f}x {host}")
            if r[2] is not None and (name not in best or t < best[name][0]):
                best[name] = (t, r[2])
        del st, g
    # one line for gpu_check.sh's table: the fastest launch settings of each case
    parts = []
    for name, (t, env) in best.items():
        how = " ".join(f"{k.replace('CTRAINSTATE_OPT_', '')}={v}" for k, v in sorted(env.items()))
        parts.append(f"{name.split()[0]} {t * 1e3:.3f} ms ({how or 'defaults'})")
    if parts:
        print("best: " + "; ".join(parts))


def _kernel_adamw(n, dts, rng):
    """One AdamW step of the fused kernel itself (_C.optim_step, apply mode) on a flat block of
    n params on CPU device 0, each array (p, g, m, v) in its dtype of dts. Returns (step,
    bytes the step must move per param: p, m, v read and written, g read)."""
    from ctrainstate import _C
    from ctrainstate._src.base import dtypes as _dtypes
    from ctrainstate.optim import base
    dev = cts.devices("cpu")[0]
    bufs = []
    for name, dt in zip("pgmv", dts):
        x = (rng.standard_normal(n, dtype=np.float32) if name in "pg" else
             np.abs(rng.standard_normal(n, dtype=np.float32)) * np.float32(1e-3)).astype(dt)
        b = _C.Buffer(dev.id, (n,), _dtypes.code(np.dtype(dt)))
        _C.copy_from_host(b, x, (0,))
        bufs.append(b)
    t = 10
    stages = [(base.ADAM, (B1, B2, EPS, 0.0, 1 - B1 ** t, 1 - B2 ** t, 0.0, 1 - B1 ** (t + 1))),
              (base.DECAY, (WD,)), (base.SCALE, (-LR,))]
    groups = [[(bufs[0], bufs[1], None, bufs[2:], 7, 0, True)]]
    sizes = [np.dtype(dt).itemsize for dt in dts]
    nbytes = 2 * sizes[0] + sizes[1] + 2 * sizes[2] + 2 * sizes[3]

    def step():
        _C.optim_step(stages, groups, 1)
    return step, nbytes


def run_lowp(reps):
    """AdamW on a flat 2^24 leaf with 16-bit arrays against float32, in the same run
    (round-robin reps): the fused kernel alone (_C.optim_step: each array loaded and stored in
    its own dtype, float32 arithmetic in registers) in GB/s of the bytes the step must move
    (all bfloat16: 14 bytes/param, float32: 28), and the ratio of each to float32's GB/s
    (issue #30's goal: all-bfloat16 >= 0.90x); then TrainState.apply_gradients end to end,
    and optax with the same dtypes on jax-cpu when installed."""
    import ml_dtypes
    bf = np.dtype(ml_dtypes.bfloat16)
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    n = 1 << 24
    rng = np.random.default_rng(0)
    # p, g, m, v
    kcases = {"float32 (p, g, m, v)": (f32, f32, f32, f32),
              "bfloat16 (p, g, m, v)": (bf, bf, bf, bf),
              "float16 (p, g, m, v)": (f16, f16, f16, f16),
              "float32 p, g, v; bfloat16 m": (f32, f32, bf, f32),
              "bfloat16 p; float32 g, m, v": (bf, f32, f32, f32)}
    steps, nbytes = {}, {}
    for label, dts in kcases.items():
        steps[("kernel", label)], nbytes[label] = _kernel_adamw(n, dts, rng)
    p32 = rng.standard_normal(n, dtype=np.float32)
    g32 = rng.standard_normal(n, dtype=np.float32)
    tcases = {"float32 (p, g, m, v)": (np.float32, None), "bfloat16 (p, g, m, v)": (bf, bf),
              "float32 p, g, v; bfloat16 m": (np.float32, bf)}
    peers = {}
    for label, (dt, mu) in tcases.items():
        tx = optim.adamw(LR, B1, B2, EPS, weight_decay=WD, mu_dtype=mu)
        st = [TrainState.create(apply_fn=None, params={"w": p32.astype(dt)}, tx=tx)]
        g = cts.device_put({"w": g32.astype(dt)})

        def step(st=st, g=g):
            st[0] = st[0].apply_gradients(grads=g)
        steps[("train_state", label)] = step
        try:
            import jax
            import jax.numpy as jnp
            import optax
            jdt = jnp.bfloat16 if dt is bf else jnp.float32
            otx = optax.adamw(LR, B1, B2, EPS, weight_decay=WD,
                              mu_dtype=None if mu is None else jnp.bfloat16)
            op = [{"w": jnp.asarray(p32).astype(jdt)}]
            os_ = [otx.init(op[0])]
            og = {"w": jnp.asarray(g32).astype(jdt)}

            @jax.jit
            def ostep(p, s, g, otx=otx):
                u, s = otx.update(g, s, p)
                return optax.apply_updates(p, u), s

            def peer(op=op, os_=os_, og=og, ostep=ostep):
                op[0], os_[0] = ostep(op[0], os_[0], og)
                jax.block_until_ready(op[0])
            peers[("optax", label)] = peer
        except ImportError:
            pass
    # wall and CPU time (all threads) of each call, round-robin in a new order each rep (what
    # runs after optax's step finds the caches cold); on a shared machine the CPU time is the
    # steadier of the two (a descheduled thread adds to the wall time only)
    calls = {**steps, **peers}
    for _ in range(2):
        for fn in calls.values():
            fn()
    wall = {k: [] for k in calls}
    cpu = {k: [] for k in calls}
    order = list(calls)
    shuffle = np.random.default_rng(1)
    for _ in range(reps):
        shuffle.shuffle(order)
        for k in order:
            fn = calls[k]
            c0, t0_ = time.process_time(), time.perf_counter()
            fn()
            wall[k].append(time.perf_counter() - t0_)
            cpu[k].append(time.process_time() - c0)
    t = {k: float(np.median(v)) for k, v in wall.items()}
    tc_ = {k: float(np.median(v)) for k, v in cpu.items()}
    f32k, bfk = ("kernel", "float32 (p, g, m, v)"), ("kernel", "bfloat16 (p, g, m, v)")
    gb0, gc0 = (nbytes[f32k[1]] * n / x[f32k] / 1e9 for x in (t, tc_))
    print(f"\n## AdamW, flat 2^24, 16-bit arrays in the fused kernel (_C.optim_step, in place); "
          f"threads {os.environ.get('OMP_NUM_THREADS', 'default')}, cpus {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.2f}, median of {reps}")
    print(f"{'dtypes':32s} {'B/param':>7s} {'ms/step':>8s} {'GB/s':>6s} {'vs f32':>7s} "
          f"{'CPU ms':>7s} {'GB/CPU-s':>8s} {'vs f32':>7s}")
    for label in kcases:
        k = ("kernel", label)
        gb, gc = nbytes[label] * n / t[k] / 1e9, nbytes[label] * n / tc_[k] / 1e9
        print(f"{label:32s} {nbytes[label]:7d} {t[k] * 1e3:8.2f} {gb:6.2f} {gb / gb0:6.2f}x "
              f"{tc_[k] * 1e3:7.2f} {gc:8.2f} {gc / gc0:6.2f}x")
    gb_bf, gc_bf = (nbytes[bfk[1]] * n / x[bfk] / 1e9 for x in (t, tc_))
    print(f"all-bfloat16 GB/s / float32 GB/s = {gb_bf / gb0:.2f}x wall, {gc_bf / gc0:.2f}x CPU time "
          f"(goal >= 0.90x)")
    t0 = t[("train_state", "float32 (p, g, m, v)")]
    print(f"\n## the same through TrainState.apply_gradients (end to end), and optax on jax-cpu")
    print(f"{'dtypes':32s} {'ms/step':>9s} {'vs f32':>7s} {'optax ms':>9s} {'optax/ours':>10s}")
    for label in tcases:
        tc = t[("train_state", label)]
        to = t.get(("optax", label))
        ot = f"{to * 1e3:9.2f} {to / tc:9.2f}x" if to is not None else f"{'-':>9s} {'-':>10s}"
        print(f"{label:32s} {tc * 1e3:9.2f} {tc / t0:6.2f}x {ot}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--skip-tree", action="store_true")
    ap.add_argument("--skip-adafactor", action="store_true")
    ap.add_argument("--overhead-only", action="store_true",
                    help="only the per-step Python overhead case (148 tiny leaves)")
    ap.add_argument("--lowp", action="store_true",
                    help="only AdamW with 16-bit params / grads / state against float32 (flat 2^24): "
                         "the kernel's GB/s and TrainState end to end")
    ap.add_argument("--gpu", action="store_true", help="AdamW on one GPU device (see the module doc)")
    ap.add_argument("--gpu-steps", type=int, default=20, help="--gpu: steps per timed rep")
    ap.add_argument("--gpu-flat-log2", type=int, default=28, help="--gpu: log2 params of the flat case")
    ap.add_argument("--gpu-copy-log2", type=int, default=30, help="--gpu: log2 bytes of the copy")
    ap.add_argument("--gpu-platform", default="gpu", help=argparse.SUPPRESS)  # "cpu": dry run here
    args = ap.parse_args()
    if args.gpu:
        run_gpu(args)
        return
    if args.overhead_only:
        run_overhead()
        return
    if args.lowp:
        run_lowp(args.reps)
        return

    print(f"ctrainstate AdamW benchmark; OMP threads={os.environ.get('OMP_NUM_THREADS', 'default')}, "
          f"cpus={os.cpu_count()}, devices={cts.device_count()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    copies = copy_steps(1 << 28)
    rng = np.random.default_rng(0)
    n = 1 << 24
    flat_p = {"w": rng.standard_normal(n, dtype=np.float32)}
    flat_g = {"w": rng.standard_normal(n, dtype=np.float32)}
    t_flat = run_case("flat 2^24", flat_p, flat_g, n, copies, args.reps)
    if not args.skip_tree:
        shapes = gpt2_small_shapes()
        tp = make_tree(shapes, rng)
        tg = make_tree(shapes, rng)
        nt = sum(x.size for x in cts.tree_util.tree_leaves(tp))
        t_tree = run_case("GPT-2-small tree", tp, tg, nt, copies, max(3, args.reps // 2))
        per_flat = t_flat / n
        per_tree = t_tree / nt
        print(f"\ntree vs flat, time per param: {per_tree / per_flat:.2f}x (goal <= 1.30x)")
        if not args.skip_adafactor:
            t = run_adafactor(tp, tg, max(3, args.reps // 2))
            fused = optim.adafactor(1e-3).fusable
            print("\n## adafactor(1e-3) defaults, GPT-2-small tree" + (
                " (fused: 2 read-only passes + the fused pass, ~24 bytes/param)" if fused else
                " (not fused)") + f", load average {os.getloadavg()[0]:.2f}")
            print(f"{'implementation':34s} {'ms/step':>9s} {'ctrainstate speedup':>20s}")
            label = "ctrainstate (fused, in place)" if fused else "ctrainstate (not fused: host)"
            print(f"{label:34s} {t['ctrainstate'] * 1e3:9.2f} {1.0:19.2f}x")
            if "optax" not in t:
                print(f"{'optax on jax-cpu':34s} {'(not installed: skipped)':>30s}")
            else:
                print(f"{'optax on jax-cpu (jit, donated)':34s} {t['optax'] * 1e3:9.2f} "
                      f"{t['optax'] / t['ctrainstate']:19.2f}x")
    run_overhead()
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
