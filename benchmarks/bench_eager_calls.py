"""Host time of common eager calls beyond single ops -- reductions with ``keepdims``, softmax
and the losses built on it, LayerNorm, basic indexing, Python scalar operands, random draws,
``grad`` of a small function, argmax, stack, concatenate, take_along_axis with int32 Array
indices, int32 label arithmetic and selects, ``x[rows, labels]`` and the integer-label
cross-entropy -- on a 16x8 float32 Array (int32 labels) on one CPU device, against the same
call in jax's eager mode (jax.numpy / jax.nn / optax / flax.linen) in the same run.

    python benchmarks/bench_eager_calls.py [--calls 1500] [--repeats 5]

Prints microseconds per call (best of ``repeats`` x ``calls``) and the ratio ours / jax. jax,
optax and flax are optional (without them the peer column is empty). These are the calls that
used to leave the C plans for the Python ops (benchmarks/RESULTS.md, 2026-12-06, eleventh
session); a call that falls off them again shows here as a ratio near or above 1.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("CTRAINSTATE_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

import ctrainstate as cts  # noqa: E402
import ctrainstate.numpy as cnp  # noqa: E402
from ctrainstate import nn, optim, random  # noqa: E402


def best_us(f, calls, repeats):
    """Best of ``repeats`` runs of ``calls`` calls of ``f``, in us per call (one warm-up)."""
    f()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def _indices():
    """(16, 3) int32 positions along the 8 columns, some negative, one out of range."""
    i = np.random.default_rng(1).integers(-8, 8, (16, 3)).astype(np.int32)
    i[0, 0] = 9
    return i


def ours():
    rng = np.random.default_rng(0)
    x = cts.device_put(rng.standard_normal((16, 8)).astype(np.float32))
    key = random.PRNGKey(0)
    ln = nn.LayerNorm()
    v = ln.init(random.PRNGKey(0), x)
    g = cts.grad(lambda a: cnp.sum(cnp.sin(a)))
    i = cts.device_put(_indices())
    labels = cts.device_put(np.abs(_indices()[:, 0]) % 8)
    rows = cts.device_put(np.arange(16, dtype=np.int32))
    return {
        "sum(x, -1, keepdims=True)": lambda: cnp.sum(x, axis=-1, keepdims=True),
        "max(x, -1, keepdims=True)": lambda: cnp.max(x, axis=-1, keepdims=True),
        "softmax(x)": lambda: nn.softmax(x),
        "log_softmax(x)": lambda: nn.log_softmax(x),
        "softmax_cross_entropy(x, x)": lambda: optim.softmax_cross_entropy(x, x),
        "var(x, -1)": lambda: cnp.var(x, axis=-1),
        "LayerNorm apply": lambda: ln.apply(v, x),
        "reshape(x, [16, 8, 1])": lambda: cnp.reshape(x, [16, 8, 1]),
        "maximum(x, 0.0)": lambda: cnp.maximum(x, 0.0),
        "clip(x, -1.0, 1.0)": lambda: cnp.clip(x, -1.0, 1.0),
        "x > 0": lambda: x > 0,
        "where(x > 0, x, 0.0)": lambda: cnp.where(x > 0, x, 0.0),
        "x[0]": lambda: x[0],
        "x[1:3]": lambda: x[1:3],
        "x[:, -1]": lambda: x[:, -1],
        "random.split(key)": lambda: random.split(key),
        "random.normal(key, (16, 8))": lambda: random.normal(key, (16, 8)),
        "grad(sum(sin(x)))(x)": lambda: g(x),
        "argmax(x, -1)": lambda: cnp.argmax(x, axis=-1),
        "stack([x, x])": lambda: cnp.stack([x, x]),
        "concatenate([x, x])": lambda: cnp.concatenate([x, x]),
        "take_along_axis(x, i, 1)": lambda: cnp.take_along_axis(x, i, axis=1),
        "labels + 1 (int32)": lambda: labels + 1,
        "where(labels > 3, labels, 0)": lambda: cnp.where(labels > 3, labels, 0),
        "x[rows, labels]": lambda: x[rows, labels],
        "int-label cross-entropy": lambda: (
            optim.softmax_cross_entropy_with_integer_labels(x, labels)),
    }


def peers():
    """The same calls in jax's eager mode, or {} without jax."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return {}
    try:
        import optax
    except ImportError:
        optax = None
    try:
        import flax.linen as fnn
    except ImportError:
        fnn = None
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 8)).astype(np.float32))
    key = jax.random.PRNGKey(0)
    g = jax.grad(lambda a: jnp.sum(jnp.sin(a)))
    i = jnp.asarray(_indices())
    labels = jnp.asarray(np.abs(_indices()[:, 0]) % 8)
    rows = jnp.arange(16, dtype=jnp.int32)
    out = {
        "sum(x, -1, keepdims=True)": lambda: jnp.sum(x, axis=-1, keepdims=True),
        "max(x, -1, keepdims=True)": lambda: jnp.max(x, axis=-1, keepdims=True),
        "softmax(x)": lambda: jax.nn.softmax(x),
        "log_softmax(x)": lambda: jax.nn.log_softmax(x),
        "var(x, -1)": lambda: jnp.var(x, axis=-1),
        "reshape(x, [16, 8, 1])": lambda: jnp.reshape(x, [16, 8, 1]),
        "maximum(x, 0.0)": lambda: jnp.maximum(x, 0.0),
        "clip(x, -1.0, 1.0)": lambda: jnp.clip(x, -1.0, 1.0),
        "x > 0": lambda: x > 0,
        "where(x > 0, x, 0.0)": lambda: jnp.where(x > 0, x, 0.0),
        "x[0]": lambda: x[0],
        "x[1:3]": lambda: x[1:3],
        "x[:, -1]": lambda: x[:, -1],
        "random.split(key)": lambda: jax.random.split(key),
        "random.normal(key, (16, 8))": lambda: jax.random.normal(key, (16, 8)),
        "grad(sum(sin(x)))(x)": lambda: g(x),
        "argmax(x, -1)": lambda: jnp.argmax(x, axis=-1),
        "stack([x, x])": lambda: jnp.stack([x, x]),
        "concatenate([x, x])": lambda: jnp.concatenate([x, x]),
        "take_along_axis(x, i, 1)": lambda: jnp.take_along_axis(x, i, axis=1),
        "labels + 1 (int32)": lambda: labels + 1,
        "where(labels > 3, labels, 0)": lambda: jnp.where(labels > 3, labels, 0),
        "x[rows, labels]": lambda: x[rows, labels],
    }
    if optax is not None:
        out["softmax_cross_entropy(x, x)"] = lambda: optax.softmax_cross_entropy(x, x)
        out["int-label cross-entropy"] = lambda: (
            optax.softmax_cross_entropy_with_integer_labels(x, labels))
    if fnn is not None:
        ln = fnn.LayerNorm()
        v = ln.init(jax.random.PRNGKey(0), x)
        out["LayerNorm apply"] = lambda: ln.apply(v, x)
    # jax dispatches asynchronously, while ours returns once its CPU kernels ran: each jax
    # call waits for its result
    return {k: (lambda f: lambda: jax.block_until_ready(f()))(f) for k, f in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    if a.calls < 1 or a.repeats < 1:
        ap.error("--calls and --repeats must be positive")
    mine, theirs = ours(), peers()
    print(f"## eager calls on a 16x8 float32 Array, 1 CPU device: us per call, best of "
          f"{a.repeats} x {a.calls} (load average {os.getloadavg()[0]:.2f})")
    print(f"{'call':30s} {'ours':>9s} {'jax eager':>10s} {'ours/jax':>9s}")
    for name, f in mine.items():
        t = best_us(f, a.calls, a.repeats)
        p = theirs.get(name)
        tp = best_us(p, a.calls, a.repeats) if p is not None else None
        print(f"{name:30s} {t:9.2f} " + (f"{tp:10.2f} {t / tp:8.3f}x" if tp else f"{'':10s} {'':9s}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
