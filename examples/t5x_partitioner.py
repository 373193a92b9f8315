"""t5x's partitioner workflow, ported: PjitPartitioner + FlaxOptimTrainState + Adafactor.

A small T5-style encoder stack (attention-free: each block has a per-head
``(embed, heads, kv)`` projection back to ``embed`` and a ``(embed, mlp)`` MLP)
declares every parameter with t5x logical axes — ``vocab``, ``embed``, ``mlp``,
``heads``, ``kv`` — and learns a fixed token mapping. The steps are those of
t5x's trainer (reference §3.1):

1. ``PjitPartitioner(num_partitions=4)`` with ``standard_logical_axis_rules()``;
2. ``TrainStateInitializer``: the abstract ``FlaxOptimTrainState`` (``eval_shape``), its
   mesh axes (``get_mesh_axes``: params and the Adafactor state they imply), and
   ``from_scratch``: the state born sharded;
3. a train step partitioned with ``in=(state_axes, data_partition_spec)``,
   ``out=(state_axes, None)`` that calls ``apply_gradient(grads, learning_rate=...)``.

As in t5x, on CPU the mesh is ``data=1, model=<all devices>`` whatever
``num_partitions`` is; on GPUs ``model=num_partitions`` (capped to the GPUs present).

``--dtype bfloat16`` is t5x's usual activation dtype (``T5Config.dtype``): float32
parameters and Adafactor state, the layers computing in bfloat16 (``dtype=`` on Embed and
DenseGeneral; the RMS norm in float32, cast back), the logits cast to float32 for the loss.

    python examples/t5x_partitioner.py [--steps 30] [--layers 2] [--embed 32] [--dtype bfloat16]
    python examples/t5x_partitioner.py --eager   # the same steps op by op (no replay)
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("CTRAINSTATE_NUM_CPU_DEVICES", "8")

import numpy as np  # noqa: E402

import ctrainstate as cts  # noqa: E402
import ctrainstate.numpy as cnp  # noqa: E402
from ctrainstate import nn, optim, random  # noqa: E402
from ctrainstate import partitioning as nn_partitioning  # noqa: E402
from ctrainstate.t5x import adafactor, partitioning, utils  # noqa: E402


class T5LayerNorm(nn.Module):
    """t5x's RMS layer norm: a ``scale`` with logical axes ``('embed',)``; statistics in
    float32, the result and the scale cast to ``dtype``."""
    epsilon: float = 1e-6
    dtype: object = np.float32

    @nn.compact
    def __call__(self, x):
        scale = nn_partitioning.param_with_axes(
            "scale", nn.initializers.ones_init(), (x.shape[-1],), np.float32, axes=("embed",))
        x = cnp.astype(x, np.float32)
        var = cnp.mean(cnp.square(x), axis=-1, keepdims=True)
        y = cnp.astype(x * cnp.rsqrt(var + self.epsilon), self.dtype)
        return y * cnp.astype(scale, self.dtype)


class EncoderBlock(nn.Module):
    """Pre-norm residual block: a per-head projection, then an MLP (no attention)."""
    heads: int
    kv: int
    mlp: int
    dtype: object = np.float32

    @nn.compact
    def __call__(self, x):
        dt = self.dtype
        y = T5LayerNorm(name="pre_mix_layer_norm", dtype=dt)(x)
        y = nn.DenseGeneral((self.heads, self.kv), kernel_axes=("embed", "heads", "kv"),
                            use_bias=False, dtype=dt, name="value")(y)
        y = nn_partitioning.with_sharding_constraint(y, ("batch", "length", "heads", "kv"))
        y = nn.DenseGeneral(x.shape[-1], axis=(-2, -1), kernel_axes=("heads", "kv", "embed"),
                            use_bias=False, dtype=dt, name="out")(nn.gelu(y))
        x = x + y
        y = T5LayerNorm(name="pre_mlp_layer_norm", dtype=dt)(x)
        y = nn.DenseGeneral(self.mlp, kernel_axes=("embed", "mlp"), use_bias=False, dtype=dt,
                            name="wi")(y)
        y = nn_partitioning.with_sharding_constraint(nn.relu(y), ("batch", "length", "mlp"))
        y = nn.DenseGeneral(x.shape[-1], kernel_axes=("mlp", "embed"), use_bias=False, dtype=dt,
                            name="wo")(y)
        return x + y


class Encoder(nn.Module):
    vocab: int
    embed: int
    heads: int
    kv: int
    mlp: int
    layers: int
    dtype: object = np.float32

    @nn.compact
    def __call__(self, tokens):
        dt = self.dtype
        x = nn.Embed(self.vocab, self.embed, embedding_axes=("vocab", "embed"), dtype=dt,
                     embedding_init=nn.initializers.normal(1.0), name="token_embedder")(tokens)
        x = nn_partitioning.with_sharding_constraint(x, ("batch", "length", "embed"))
        for i in range(self.layers):
            x = EncoderBlock(self.heads, self.kv, self.mlp, dtype=dt, name=f"layers_{i}")(x)
        x = T5LayerNorm(name="encoder_norm", dtype=dt)(x)
        logits = nn.DenseGeneral(self.vocab, kernel_axes=("embed", "vocab"), use_bias=False,
                                 dtype=dt, name="logits_dense")(x)
        return cnp.astype(logits, np.float32)     # t5x: the loss in float32


def cross_entropy(logits, targets, vocab):
    """Mean softmax cross-entropy over the vocabulary (stable: shifted by the maximum)."""
    assert logits.shape[-1] == vocab, (logits.shape, vocab)
    return cnp.mean(optim.softmax_cross_entropy_with_integer_labels(logits, targets))


def describe(tree, prefix=""):
    """'path: spec' lines of a nested dict of specs."""
    out = []
    for k, v in (tree.items() if isinstance(tree, dict) else []):
        if isinstance(v, dict):
            out += describe(v, f"{prefix}{k}/")
        else:
            out.append(f"  {prefix}{k}: {v}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embed", type=int, default=32)
    ap.add_argument("--mlp", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--num-partitions", type=int, default=4)
    ap.add_argument("--eager", action="store_true",
                    help="run the partitioned train step eagerly, op by op (cts.disable_jit); by "
                         "default it is traced once and replayed from C, with the same losses")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="activation (compute) dtype; params and optimizer state stay float32")
    a = ap.parse_args(argv)

    nparts = a.num_partitions
    if cts.default_backend() == "gpu" and nparts > cts.local_device_count():
        print(f"only {cts.local_device_count()} GPU(s): num_partitions {nparts} -> "
              f"{cts.local_device_count()}")
        nparts = cts.local_device_count()
    partitioner = partitioning.PjitPartitioner(
        num_partitions=nparts, logical_axis_rules=partitioning.standard_logical_axis_rules())
    print(f"mesh {dict(partitioner.mesh.shape)} on {cts.default_backend()}; compute {a.dtype}; "
          f"data spec {partitioner.data_partition_spec}")

    dtype = {"float32": cnp.float32, "bfloat16": cnp.bfloat16}[a.dtype]
    model = Encoder(a.vocab, a.embed, a.heads, a.kv, a.mlp, a.layers, dtype=dtype)
    opt_def = adafactor.Adafactor(learning_rate=a.lr, beta1=0.9, min_dim_size_to_factor=32,
                                  logical_factor_rules=adafactor.standard_logical_factor_rules())

    def get_initial_variables(rng, input_shapes, input_types=None):
        return model.init(rng, np.zeros(input_shapes["tokens"], np.int32))

    init = utils.TrainStateInitializer(opt_def, get_initial_variables,
                                       {"tokens": (a.batch, a.length)}, partitioner)
    axes = init.train_state_axes
    print("param specs:")
    print("\n".join(describe(axes.params)))
    print("optimizer-state specs (Adafactor v / m; v_row, v_col replicated):")
    ps = axes.param_states
    flat = {}
    for path, st in ((p, s) for p, s in _walk(ps)):
        flat[path] = f"v={st.v} m={st.m}"
    print("\n".join(f"  {k}: {v}" for k, v in flat.items()))

    t0 = time.time()
    state = init.from_scratch(random.PRNGKey(0))
    kernel = state.params["layers_0"]["wi"]["kernel"]
    print(f"layers_0/wi/kernel born with {kernel.sharding.spec}, "
          f"{kernel.addressable_shards[0].index} on device 0 ({time.time() - t0:.2f}s)")

    def train_step(st, batch):
        def loss_fn(params):
            logits = model.apply({"params": params}, batch["inputs"])
            return cross_entropy(logits, batch["targets"], a.vocab)
        loss, grads = cts.value_and_grad(loss_fn)(st.params)
        return st.apply_gradient(grads, learning_rate=a.lr), loss

    p_train_step = partitioner.partition(
        train_step, in_axis_resources=(axes, partitioner.data_partition_spec),
        out_axis_resources=(axes, None), donate_argnums=(0,))
    layout = partitioner.get_data_layout(a.batch)
    rng = np.random.default_rng(0)
    losses = []
    t0 = time.time()
    for step in range(a.steps):
        inputs = rng.integers(0, a.vocab, (layout.batch_size, a.length)).astype(np.int32)
        targets = (inputs * 5 + 3) % a.vocab  # a fixed token mapping to learn
        with cts.disable_jit(a.eager):
            state, loss = p_train_step(state, {"inputs": inputs, "targets": targets})
        losses.append(float(np.asarray(loss)))
    dt = time.time() - t0
    print("loss curve: " + " ".join(f"{v:.3f}" for v in losses))
    print(f"{a.steps} steps in {dt:.1f}s; step {int(np.asarray(state.step))}")
    assert state.params["layers_0"]["wi"]["kernel"].sharding.spec == axes.params["layers_0"]["wi"]["kernel"]
    print(f"final loss {losses[-1]:.4f} (initial {losses[0]:.4f})")
    return losses
    return losses


def _walk(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _walk(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


if __name__ == "__main__":
    main()
