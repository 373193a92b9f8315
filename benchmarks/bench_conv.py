"""Time per forward + backward of a small CNN block: ctrainstate's im2col convolution
(``nn.Conv``, ``nn.max_pool``) against the same Flax model on jax-cpu (jit), in the same
process, and where ctrainstate's time goes (the patch copies, the matrix products).

    python benchmarks/bench_conv.py [--batch 32] [--size 32] [--channels 16] [--reps 5]

The block: Conv(C, 3x3) -> relu -> Conv(C, 3x3) -> relu -> max_pool 2x2 -> mean, on inputs
(batch, size, size, C), one CPU device. Prints ms per value_and_grad and the ratio to Flax
(>1: ctrainstate is slower).
"""
import argparse
import os

os.environ.setdefault("CTRAINSTATE_NUM_CPU_DEVICES", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from _timing import best  # noqa: E402
import ctrainstate as cts  # noqa: E402
import ctrainstate.numpy as cnp  # noqa: E402
from ctrainstate import nn, random  # noqa: E402


def block(m, mean, channels):
    class Block(m.Module):
        @m.compact
        def __call__(self, x):
            x = m.relu(m.Conv(channels, (3, 3))(x))
            x = m.relu(m.Conv(channels, (3, 3))(x))
            return mean(m.max_pool(x, (2, 2), strides=(2, 2)))
    return Block()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    x = np.random.default_rng(0).standard_normal(
        (a.batch, a.size, a.size, a.channels)).astype(np.float32)
    cm = block(nn, cnp.mean, a.channels)
    cv = cm.init(random.PRNGKey(0), x)
    cgrad = cts.value_and_grad(lambda p: cm.apply({"params": p}, x))
    tc = best(lambda: cts.block_until_ready(cgrad(cv["params"])), a.reps)
    flops = 2 * 3 * 2 * a.batch * a.size * a.size * 9 * a.channels * a.channels  # fwd+2 bwd
    print(f"block: 2 x Conv({a.channels}, 3x3) + relu + max_pool 2x2, input {x.shape}, "
          f"value_and_grad")
    print(f"ctrainstate  {tc * 1e3:8.1f} ms   {flops / tc / 1e9:6.1f} GFLOP/s in the products")
    try:
        import jax
        import jax.numpy as jnp
        import flax.linen as fnn
    except ImportError:
        print("flax / jax not installed: no peer")
        return
    fm = block(fnn, jnp.mean, a.channels)
    fv = fm.init(jax.random.PRNGKey(0), x)
    fgrad = jax.jit(jax.value_and_grad(lambda p: fm.apply({"params": p}, x)))
    tf = best(lambda: jax.block_until_ready(fgrad(fv["params"])), a.reps)
    print(f"flax (jit)   {tf * 1e3:8.1f} ms   {flops / tf / 1e9:6.1f} GFLOP/s")
    print(f"ratio ctrainstate / flax: {tc / tf:.2f}")


if __name__ == "__main__":
    main()
