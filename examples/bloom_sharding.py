"""bloom-jax-inference's sharding example, ported: host params -> sharded bfloat16 params.

The BLOOM parameter layout (scanned layers: a leading ``layers`` axis) with the
logical axes of the final bloom-jax-inference model code (reference §2.6). As in
``sharding_example.py``:

1. host (numpy, float32) params, as ``from_pretrained(..., _do_init=False)`` returns;
2. ``state_shapes = eval_shape(init_state)`` where ``init_state`` wraps ``model.init`` in
   an ``InferenceState`` — the logical axes, with nothing allocated;
3. ``PjitPartitioner(num_partitions, logical_axis_rules=...)`` with bloom's GShard
   ("full", default) or Optimus rule table, ``params_spec = get_mesh_axes(state_shapes).params``;
4. ``partitioner.partition(to_bf16, (params_spec,), params_spec)(params)``: each device
   receives only its block of each param and converts it to bfloat16 in place of the
   float32 block (the full array is never gathered on a device).

    python examples/bloom_sharding.py [--rules full|optimus] [--layers 2] [--embed 64]
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("CTRAINSTATE_NUM_CPU_DEVICES", "8")

import numpy as np  # noqa: E402

import ctrainstate as cts  # noqa: E402
from ctrainstate import hf, nn, random  # noqa: E402
from ctrainstate import partitioning as nn_partitioning  # noqa: E402
from ctrainstate.core import freeze  # noqa: E402
from ctrainstate.t5x import partitioning  # noqa: E402
from ctrainstate.t5x.train_state import InferenceState  # noqa: E402

REPLICATED = [("relpos_buckets", None), ("abspos_buckets", None), ("length", None),
              ("layers", None), ("stack", None), ("mlp_activations", None)]
# bloom-jax-inference: "Optimus" (1-D params, 2-D activations) and "full" (GShard 2-D) tables
logical_axis_rules = [("batch", "data"), ("mlp", "model"), ("heads", "model"), ("vocab", "model"),
                      ("embed", "model"), ("kv", None), ("joined_kv", None)] + REPLICATED
logical_axis_rules_full = [("batch", "data"), ("mlp", "model"), ("heads", "model"),
                           ("vocab", "model"), ("embed", "model"), ("embed", "data"), ("kv", None),
                           ("joined_kv", None)] + REPLICATED


class Bloom(nn.Module):
    """BLOOM's parameters with their logical axes (scanned layers stacked on ``layers``)."""
    vocab: int
    embed: int
    heads: int
    layers: int

    @nn.compact
    def __call__(self, input_ids):
        L, E, H, D = self.layers, self.embed, self.heads, self.embed // self.heads
        normal = nn.initializers.normal(0.02)
        zeros, ones = nn.initializers.zeros_init(), nn.initializers.ones_init()

        def p(name, init, shape, axes):
            return nn_partitioning.param_with_axes(name, init, shape, np.float32, axes=axes)

        class Sub(nn.Module):
            spec: tuple

            @nn.compact
            def __call__(self):
                return [p(*s) for s in self.spec]

        ln = lambda lead, ax: ((("scale", ones, lead + (E,), ax + ("embed",)),  # noqa: E731
                                ("bias", zeros, lead + (E,), ax + ("embed",))))
        lay, lax = (L,), ("layers",)
        Sub(((("embedding", normal, (self.vocab, E), ("vocab", "embed")),)),
            name="word_embeddings")()
        Sub(ln((), ()), name="word_embeddings_layernorm")()
        Sub(ln(lay, lax), name="input_layernorm")()
        Sub(((("kernel", normal, (L, E, H, 3 * D), ("layers", "embed", "heads", "kv")),
              ("bias", zeros, (L, H, 3 * D), ("layers", "heads", "kv")))),
            name="self_attention_query_key_value")()
        Sub(((("kernel", normal, (L, H, D, E), ("layers", "heads", "kv", "embed")),
              ("bias", zeros, (L, E), ("layers", "embed")))), name="self_attention_dense")()
        Sub(ln(lay, lax), name="post_attention_layernorm")()
        Sub(((("kernel", normal, (L, E, 4 * E), ("layers", "embed", "mlp")),
              ("bias", zeros, (L, 4 * E), ("layers", "mlp")))), name="mlp_dense_h_to_4h")()
        Sub(((("kernel", normal, (L, 4 * E, E), ("layers", "mlp", "embed")),
              ("bias", zeros, (L, E), ("layers", "embed")))), name="mlp_dense_4h_to_h")()
        Sub(ln((), ()), name="ln_f")()
        Sub(((("kernel", normal, (E, self.vocab), ("embed", "vocab")),)), name="lm_head")()
        return input_ids


def per_device_bytes(tree):
    out = {}
    for leaf in cts.tree_util.tree_leaves(tree):
        for s in leaf.addressable_shards:
            n = int(np.prod(s.data.shape)) * leaf.dtype.itemsize
            out[s.device.id] = out.get(s.device.id, 0) + n
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rules", choices=("full", "optimus"), default="full")
    ap.add_argument("--num-partitions", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embed", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    a = ap.parse_args(argv)

    model = Bloom(a.vocab, a.embed, a.heads, a.layers)
    ids = np.ones((1, 1), np.int32)
    # 1. host params (float32 numpy), as from_pretrained(_do_init=False) gives them
    params = cts.tree_util.tree_map(np.asarray, model.init(random.PRNGKey(0), ids)["params"])

    # 2. logical axes, abstractly
    def init_state():
        return InferenceState.create(model.init(random.PRNGKey(0), ids))
    state_shapes = cts.eval_shape(init_state)

    # 3. partitioner and param specs
    nparts = min(a.num_partitions, cts.local_device_count())
    rules = logical_axis_rules_full if a.rules == "full" else logical_axis_rules
    partitioner = partitioning.PjitPartitioner(nparts, logical_axis_rules=rules)
    params_spec = partitioner.get_mesh_axes(state_shapes).params
    print(f"mesh {dict(partitioner.mesh.shape)}, rules: {a.rules}")
    for name in ("word_embeddings", "self_attention_query_key_value", "self_attention_dense",
                 "mlp_dense_h_to_4h", "mlp_dense_4h_to_h", "ln_f", "lm_head"):
        for k, v in params_spec[name].items():
            print(f"  {name}/{k}: {v}")

    # 4. shard + cast, inside the partitioner's mesh (the params frozen like their specs)
    shard_params = partitioner.partition(hf.to_bf16, (params_spec,), params_spec)
    sharded = shard_params(freeze(params))

    total = sum(v.size for v in cts.tree_util.tree_leaves(params))
    for path, leaf in cts.tree_util.tree_flatten_with_path(sharded)[0]:
        assert str(leaf.dtype) == "bfloat16", path
    ok = all(np.array_equal(np.asarray(s).astype(np.float32),
                            h.astype(cts._src.base.dtypes.bfloat16).astype(np.float32))
             for s, h in zip(cts.tree_util.tree_leaves(sharded), cts.tree_util.tree_leaves(params)))
    per_dev = per_device_bytes(sharded)
    print(f"{total} params -> bfloat16, values exact: {ok}")
    print(f"bytes per device: min {min(per_dev.values())}, max {max(per_dev.values())} "
          f"(all params in bf16: {2 * total})")
    k = sharded["self_attention_query_key_value"]["kernel"]
    print(f"query_key_value kernel {k.shape} {k.dtype} spec {k.sharding.spec}, "
          f"device 0 holds {k.addressable_shards[0].index}")
    assert ok
    return sharded, params_spec


if __name__ == "__main__":
    main()
