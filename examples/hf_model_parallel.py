"""HuggingFace's GPT-Neo model-parallel example (run_clm_mp.py), ported to ctrainstate.

A small GPT-Neo-shaped causal LM — parameter paths exactly those of
``FlaxGPTNeoForCausalLM`` (``transformer/{wte,wpe}``, ``transformer/h/<i>/{ln_1,
attn/attention/{q,k,v,out}_proj, ln_2, mlp/{c_fc,c_proj}}``, ``transformer/ln_f``,
tied output embedding) — is partitioned with HF's GPT-Neo regex table on a
``('dp', 'mp')`` mesh of shape ``(1, devices)`` as in run_clm_mp, and trained for
a few steps with AdamW (warmup + linear decay) and a dropout-rng ``TrainState``
(run_clm_flax's), on a synthetic corpus. What changes from the HF scripts:

* the optimizer-state spec comes from ``hf.train_state_spec(state, param_spec)``
  (derived from the param specs; no adamw-specific tree surgery);
* the state is created from params already placed by their specs, so the AdamW
  moments are born sharded;
* ``p_train_step`` (forward, backward and the AdamW step) is traced once and replayed from C;
  ops without a C plan (the embedding gather, dropout's random bits, the batched attention
  products) replay as op nodes of the program.

``--dtype bfloat16`` (or ``float16``) is run_clm_mp's ``--dtype``: the modules compute in that
dtype (``dtype=`` on every Dense, Embed and LayerNorm, the causal bias and the dropout
multiplier in it too, as FlaxGPTNeo does) while params and AdamW state stay float32; the
loss is taken on the logits cast to float32.

    python examples/hf_model_parallel.py [--steps 30] [--layers 2] [--embed 32] [--dtype bfloat16]
    python examples/hf_model_parallel.py --eager     # the same steps op by op (no replay)
    mpirun -n 2 python examples/hf_model_parallel.py --print-losses   # mp spans 2 processes

Under a launcher the processes join (``ctrainstate.distributed.initialize``), the ``mp`` axis
spans every process's devices (8 in all by default, split over the processes), and process 0
prints; the losses are the one-process run's with as many devices, bit for bit.
"""
from __future__ import annotations

import argparse
import math
from typing import Any
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launcher  # noqa: E402  (reads the launcher's environment; imports no ctrainstate)

if "CTRAINSTATE_NUM_CPU_DEVICES" not in os.environ:
    # 8 CPU devices in all: one process has them all, under mpirun -n N each has 8 / N
    os.environ["CTRAINSTATE_NUM_CPU_DEVICES"] = str(launcher.devices_per_process(8, "the mesh"))

import numpy as np  # noqa: E402

import ctrainstate as cts  # noqa: E402
import ctrainstate.numpy as cnp  # noqa: E402
from ctrainstate import hf, nn, optim, random  # noqa: E402
from ctrainstate.experimental import multihost_utils  # noqa: E402
from ctrainstate.lax import stop_gradient  # noqa: E402
from ctrainstate.hf.partitions import gpt_neo_rules, set_partitions  # noqa: E402


def dropout(module, x, rate, deterministic):
    if deterministic or rate == 0.0:
        return x
    keep = random.bernoulli(module.make_rng("dropout"), 1.0 - rate, tuple(x.shape))
    # (under jit the key and so `keep` are traced Arrays: no host read, Array ops only)
    return x * (keep.astype(x.dtype) / (1.0 - rate))


class GPTNeoSelfAttention(nn.Module):
    embed: int
    heads: int
    dropout: float
    dtype: Any = np.float32

    @nn.compact
    def __call__(self, x, deterministic):
        b, l, d = x.shape
        hd = d // self.heads
        init = nn.initializers.normal(0.02)

        def heads(y):  # (b, l, d) -> (b, h, l, hd)
            return cnp.transpose(cnp.reshape(y, (b, l, self.heads, hd)), (0, 2, 1, 3))

        q = heads(nn.Dense(d, use_bias=False, kernel_init=init, dtype=self.dtype,
                             name="q_proj")(x))
        k = heads(nn.Dense(d, use_bias=False, kernel_init=init, dtype=self.dtype,
                             name="k_proj")(x))
        v = heads(nn.Dense(d, use_bias=False, kernel_init=init, dtype=self.dtype,
                             name="v_proj")(x))
        # GPT-Neo does not scale the scores; causal mask as a large negative bias
        mask = np.triu(np.full((l, l), -1e9, np.float32), 1).astype(self.dtype)
        s = cnp.einsum("bhqd,bhkd->bhqk", q, k) + mask
        e = cnp.exp(s)
        p = e / cnp.sum(e, axis=-1, keepdims=True)
        p = dropout(self, p, self.dropout, deterministic)
        o = cnp.einsum("bhqk,bhkd->bhqd", p, v)
        o = cnp.reshape(cnp.transpose(o, (0, 2, 1, 3)), (b, l, d))
        o = nn.Dense(d, kernel_init=init, dtype=self.dtype, name="out_proj")(o)
        return dropout(self, o, self.dropout, deterministic)


class GPTNeoAttention(nn.Module):
    embed: int
    heads: int
    dropout: float
    dtype: Any = np.float32

    @nn.compact
    def __call__(self, x, deterministic):
        return GPTNeoSelfAttention(self.embed, self.heads, self.dropout, self.dtype,
                                   name="attention")(x, deterministic)


class GPTNeoMLP(nn.Module):
    inner: int
    dropout: float
    dtype: Any = np.float32

    @nn.compact
    def __call__(self, x, deterministic):
        init = nn.initializers.normal(0.02)
        h = nn.gelu(nn.Dense(self.inner, kernel_init=init, dtype=self.dtype, name="c_fc")(x))
        h = nn.Dense(x.shape[-1], kernel_init=init, dtype=self.dtype, name="c_proj")(h)
        return dropout(self, h, self.dropout, deterministic)


class GPTNeoBlock(nn.Module):
    embed: int
    heads: int
    dropout: float
    dtype: Any = np.float32

    @nn.compact
    def __call__(self, x, deterministic):
        dt = self.dtype
        x = x + GPTNeoAttention(self.embed, self.heads, self.dropout, dt, name="attn")(
            nn.LayerNorm(epsilon=1e-5, dtype=dt, name="ln_1")(x), deterministic)
        return x + GPTNeoMLP(4 * self.embed, self.dropout, dt, name="mlp")(
            nn.LayerNorm(epsilon=1e-5, dtype=dt, name="ln_2")(x), deterministic)


class GPTNeoBlockCollection(nn.Module):
    layers: int
    embed: int
    heads: int
    dropout: float
    dtype: Any = np.float32

    @nn.compact
    def __call__(self, x, deterministic):
        for i in range(self.layers):
            x = GPTNeoBlock(self.embed, self.heads, self.dropout, self.dtype, name=str(i))(
                x, deterministic)
        return x


class GPTNeoModule(nn.Module):
    vocab: int
    positions: int
    layers: int
    embed: int
    heads: int
    dropout: float
    dtype: Any = np.float32

    @nn.compact
    def __call__(self, input_ids, deterministic):
        init = nn.initializers.normal(0.02)
        wte = nn.Embed(self.vocab, self.embed, embedding_init=init, dtype=self.dtype, name="wte")
        wpe = nn.Embed(self.positions, self.embed, embedding_init=init, dtype=self.dtype,
                       name="wpe")
        # the positions from the static shape (no host read of the ids: under jit they are traced)
        pos = np.broadcast_to(np.arange(input_ids.shape[1]), input_ids.shape)
        x = dropout(self, wte(input_ids) + wpe(pos), self.dropout, deterministic)
        x = GPTNeoBlockCollection(self.layers, self.embed, self.heads, self.dropout, self.dtype,
                                  name="h")(x, deterministic)
        x = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="ln_f")(x)
        return wte.attend(x)  # tied embeddings: no lm_head


class GPTNeoForCausalLM(nn.Module):
    vocab: int
    positions: int
    layers: int
    embed: int
    heads: int
    dropout: float = 0.1
    dtype: Any = np.float32

    @nn.compact
    def __call__(self, input_ids, deterministic=True):
        return GPTNeoModule(self.vocab, self.positions, self.layers, self.embed, self.heads,
                            self.dropout, self.dtype, name="transformer")(input_ids, deterministic)


def loss_fn(logits, labels, vocab, z_loss=0.0):
    """run_clm_mp's loss: position i predicts token i + 1 (``logits[..., :-1, :]`` against
    ``labels[..., 1:]``), cross-entropy plus ``z_loss * 1e-4 * log_z**2``, with the logits
    shifted by their (gradient-stopped) maximum as there, so large logits stay finite.
    The last position, which predicts nothing, is weighted 0 instead of sliced off: the
    same loss, and no slice of logits whose vocabulary spans processes under mpirun."""
    # (no host read of the labels: under jit they are traced; slicing, concatenate and
    # one_hot run as nodes of the program)
    next_labels = cnp.concatenate([labels[..., 1:], labels[..., :1]], axis=-1)
    weights = np.ones(labels.shape, np.float32)
    weights[..., -1] = 0.0
    onehot = nn.one_hot(next_labels, vocab)
    shifted = logits - stop_gradient(cnp.max(logits, axis=-1, keepdims=True))
    log_z = cnp.log(cnp.sum(cnp.exp(shifted), axis=-1))
    nll = log_z - cnp.sum(shifted * onehot, axis=-1)
    return cnp.sum((nll + (z_loss * 1e-4) * cnp.square(log_z)) * weights) / float(weights.sum())


def synthetic_corpus(vocab, n_tokens, seed=0):
    """Sentences drawn from a small random bigram model: learnable structure."""
    rng = np.random.default_rng(seed)
    nxt = rng.integers(0, vocab, (vocab, 2))
    toks = [int(rng.integers(vocab))]
    for _ in range(n_tokens - 1):
        toks.append(int(nxt[toks[-1], rng.integers(2)]))
    return np.array(toks, np.int32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embed", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=64, help="padded to a multiple of the mp axis")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--per-device-batch", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="run_clm_mp's --dtype: the computation dtype (params stay float32)")
    ap.add_argument("--print-losses", action="store_true",
                    help="print every step's loss exactly ('loss STEP VALUE', repr of the "
                         "float): runs under mpirun and in one process compare bit for bit")
    ap.add_argument("--eager", action="store_true",
                    help="run the pjit'd steps eagerly, op by op (cts.disable_jit); by default "
                         "each is traced once and replayed from C, with the same losses")
    a = ap.parse_args(argv)

    me, nproc = launcher.initialize()   # under mpirun: join the processes (global devices)
    say = print if me == 0 else (lambda *a, **k: None)   # process 0 prints
    n = cts.device_count()   # every process's devices: the mp axis spans the processes
    vocab = int(math.ceil(a.vocab / n) * n)  # HF pads 50257 -> 50264 for the same reason
    batch = a.per_device_batch * cts.device_count()
    rng, dropout_rng = random.split(random.PRNGKey(a.seed))

    dtype = {"float32": cnp.float32, "bfloat16": cnp.bfloat16, "float16": cnp.float16}[a.dtype]
    model = GPTNeoForCausalLM(vocab, a.block_size, a.layers, a.embed, a.heads, dtype=dtype)
    mesh = cts.Mesh(np.array(cts.devices()).reshape(1, n), ("dp", "mp"))
    with mesh:   # replicated over the mesh (across processes too), then read whole
        params = model.init(rng, np.zeros((1, a.block_size), np.int32))["params"]
    # host params, like from_pretrained
    params = (multihost_utils.process_allgather(params) if nproc > 1
              else cts.tree_util.tree_map(np.asarray, params))
    param_spec = set_partitions(params, gpt_neo_rules())

    warmup = optim.linear_schedule(0.0, a.lr, a.warmup_steps)
    decay = optim.linear_schedule(a.lr, 0.0, max(a.steps - a.warmup_steps, 1))
    schedule = optim.join_schedules([warmup, decay], [a.warmup_steps])
    tx = optim.adamw(schedule, b1=0.9, b2=0.98, eps=1e-8, weight_decay=a.weight_decay)

    with mesh, cts.disable_jit(a.eager):
        # params placed by their specs; the AdamW moments are then born sharded
        params = cts.pjit(lambda p: p, in_axis_resources=(param_spec,),
                          out_axis_resources=param_spec)(params)
        state = hf.TrainState.create(apply_fn=model.apply, params=params, tx=tx,
                                     dropout_rng=dropout_rng)
        state_spec = hf.train_state_spec(state, param_spec)
        say(f"mesh {dict(mesh.shape)}{f' ({nproc} processes)' if nproc > 1 else ''}, vocab {vocab}, global batch {batch}, compute {a.dtype}")
        say("c_fc kernel spec", param_spec["transformer"]["h"]["0"]["mlp"]["c_fc"]["kernel"],
              "| opt-state mu spec", state_spec.opt_state[0].mu["transformer"]["h"]["0"]["mlp"]["c_fc"]["kernel"],
              "| count", state_spec.opt_state[0].count, "| schedule", state_spec.opt_state[2])

        def train_step(state, batch):
            dropout_rng, new_dropout_rng = random.split(state.dropout_rng)

            def compute_loss(p):
                logits = state.apply_fn({"params": p}, batch["input_ids"], deterministic=False,
                                        rngs={"dropout": dropout_rng})
                return loss_fn(logits.astype(np.float32), batch["labels"], vocab, z_loss=1.0)

            loss, grads = cts.value_and_grad(compute_loss)(state.params)
            new_state = state.apply_gradients(grads=grads, dropout_rng=new_dropout_rng)
            return new_state, {"loss": loss, "learning_rate": schedule(state.step)}

        def eval_step(params, batch):
            logits = model.apply({"params": params}, batch["input_ids"])
            return loss_fn(logits.astype(np.float32), batch["labels"], vocab)

        p_train_step = cts.pjit(train_step, in_axis_resources=(state_spec, None),
                                out_axis_resources=(state_spec, None), donate_argnums=(0,))
        p_eval_step = cts.pjit(eval_step, in_axis_resources=(param_spec, None),
                               out_axis_resources=None)

        corpus = synthetic_corpus(vocab, 4096, a.seed)
        blocks = corpus[: len(corpus) // a.block_size * a.block_size].reshape(-1, a.block_size)
        eval_batch = {"input_ids": blocks[-batch:], "labels": blocks[-batch:]}
        train_blocks = blocks[:-batch]
        order = np.random.default_rng(a.seed).permutation(len(train_blocks))
        eval0 = float(np.asarray(p_eval_step(state.params, eval_batch)))
        t0 = time.time()
        for step in range(a.steps):
            idx = order[(step * batch) % len(order):][:batch]
            if len(idx) < batch:
                idx = order[:batch]
            b = {"input_ids": train_blocks[idx], "labels": train_blocks[idx]}
            state, metrics = p_train_step(state, b)
            loss = float(np.asarray(metrics["loss"]))   # replicated: every process holds it
            say(f"step {step + 1}: loss {loss:.4f} lr {float(metrics['learning_rate']):.2e}")
            if a.print_losses:
                say(f"loss {step + 1} {loss!r}")
        dt = time.time() - t0
        eval1 = float(np.asarray(p_eval_step(state.params, eval_batch)))
        k = state.params["transformer"]["h"]["0"]["attn"]["attention"]["q_proj"]["kernel"]
        mu = state.opt_state[0].mu["transformer"]["h"]["0"]["attn"]["attention"]["q_proj"]["kernel"]
        assert k.sharding.spec == cts.P(None, "mp") and mu.sharding == k.sharding
        say(f"{a.steps} steps in {dt:.1f}s; eval loss {eval0:.4f} -> {eval1:.4f}, "
              f"perplexity {math.exp(min(eval1, 50)):.2f}")
        # jax.device_get; across processes the sharded params are gathered first
        host_params = (multihost_utils.process_allgather(state.params, tiled=True) if nproc > 1
                       else cts.tree_util.tree_map(np.asarray, state.params))
        assert all(np.all(np.isfinite(v)) for v in cts.tree_util.tree_leaves(host_params))
    return eval0, eval1


if __name__ == "__main__":
    main()
