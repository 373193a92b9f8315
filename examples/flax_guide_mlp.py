"""The Flax "Scale up on multiple devices" guide's DotReluDot MLP, ported to ctrainstate.

Mesh (data=2, model=4) of CPU virtual devices. ``DotReluDot`` has a column-parallel
``Dense`` (kernel split over ``model``), relu, a sharding constraint
``('data','model')``, a row-parallel ``W2`` (split over ``model`` on its input
dimension) and a constraint ``('data', None)``. The state is built the guide's way —
``eval_shape`` of an init function that returns a TrainState, ``get_sharding``, then
a ``jit`` with ``out_shardings`` — and trained for a few steps. The logical variant
uses ``with_logical_partitioning`` with rules ``(('batch','data'), ('hidden','model'))``
and must give the same shardings. The assertions are the guide's.

    python examples/flax_guide_mlp.py [--depth 1024] [--layers 4] [--steps 3]
"""
from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("CTRAINSTATE_NUM_CPU_DEVICES", "8")

import numpy as np  # noqa: E402

import ctrainstate as cts  # noqa: E402
import ctrainstate.numpy as cnp  # noqa: E402
from ctrainstate import NamedSharding, P, nn, optim, random  # noqa: E402
from ctrainstate.mesh_utils import create_device_mesh  # noqa: E402
from ctrainstate.train_state import TrainState  # noqa: E402


class DotReluDot(nn.Module):
    depth: int
    logical: bool = False

    @nn.compact
    def __call__(self, x):
        if self.logical:
            k1 = nn.with_logical_partitioning(nn.initializers.xavier_normal(), ("embed", "hidden"))
            k2 = nn.with_logical_partitioning(nn.initializers.xavier_normal(), ("hidden", "embed"))
        else:
            k1 = nn.with_partitioning(nn.initializers.xavier_normal(), (None, "model"))
            k2 = nn.with_partitioning(nn.initializers.xavier_normal(), ("model", None))
        y = nn.Dense(self.depth, use_bias=False, kernel_init=k1)(x)
        y = nn.relu(y)
        y = self.constrain(y, ("batch", "hidden") if self.logical else P("data", "model"))
        w2 = self.param("W2", k2, (self.depth, x.shape[-1]))
        z = cnp.matmul(y, w2)
        z = self.constrain(z, ("batch", "embed") if self.logical else P("data", None))
        return z

    def constrain(self, v, spec):
        if self.logical:
            return nn.with_logical_constraint(v, spec)
        mesh = cts.get_mesh()
        return cnp.with_sharding(v, NamedSharding(mesh, spec))


class MLP(nn.Module):
    num_layers: int
    depth: int
    logical: bool = False

    @nn.compact
    def __call__(self, x):
        for _ in range(self.num_layers):
            x = DotReluDot(self.depth, self.logical)(x)
        return x


def init_fn(k, x, model, optimizer):
    variables = model.init(k, x)
    return TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optimizer)


def train_step(state, x):
    def loss(params):
        y = state.apply_fn({"params": params}, x)
        return cnp.sum(y)
    grads = cts.grad(loss)(state.params)
    return state.apply_gradients(grads=grads)


def build(mesh, model, x, logical, rules):
    optimizer = optim.adam(0.001)
    k = random.key(0)
    abstract = cts.eval_shape(functools.partial(init_fn, model=model, optimizer=optimizer), k, x)
    if logical:
        spec = nn.get_partition_spec(abstract)
        sharding = nn.logical_to_mesh_sharding(spec, mesh, rules)
    else:
        sharding = nn.get_sharding(abstract, mesh)
    x_sharding = NamedSharding(mesh, P("data", None))
    jit_init = cts.jit(init_fn, static_argnums=(2, 3),
                       in_shardings=(NamedSharding(mesh, P()), x_sharding), out_shardings=sharding)
    state = jit_init(k, x, model, optimizer)
    return state, sharding


def main(argv=None):
    ap = argparse.ArgumentParser(description="Flax guide DotReluDot MLP on a (2, 4) mesh")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--depth", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args(argv)
    mesh = cts.Mesh(create_device_mesh((2, 4)), ("data", "model"))
    rules = (("batch", "data"), ("hidden", "model"))
    x = cts.device_put(np.ones((a.batch, a.depth), np.float32), NamedSharding(mesh, P("data", None)))

    results = {}
    for logical in (False, True):
        model = MLP(a.layers, a.depth, logical)
        with mesh, nn.logical_axis_rules(rules if logical else ()):
            state, sharding = build(mesh, model, x, logical, rules)
            k = state.params["DotReluDot_0"]["Dense_0"]["kernel"]
            w2 = state.params["DotReluDot_0"]["W2"]
            # the guide's assertions
            assert isinstance(k, nn.Partitioned if not logical else nn.LogicallyPartitioned)
            assert k.value.sharding == NamedSharding(mesh, P(None, "model")), k.value.sharding
            assert w2.value.sharding == NamedSharding(mesh, P("model", None)), w2.value.sharding
            mu = state.opt_state[0].mu["DotReluDot_0"]["Dense_0"]["kernel"]
            assert mu.value.sharding == k.value.sharding  # optimizer state sharded like params
            for _ in range(a.steps):
                state = train_step(state, x)
            y = model.apply({"params": state.params}, x)
            assert y.sharding == NamedSharding(mesh, P("data", None)), y.sharding
        name = "logical" if logical else "mesh axes"
        print(f"[{name}] kernel {k.value.sharding.spec}, W2 {w2.value.sharding.spec}, "
              f"output {y.sharding.spec}, step {int(state.step)}")
        cts.visualize_array_sharding(state.params["DotReluDot_0"]["W2"].value)
        results[logical] = cts.tree_util.tree_map(lambda v: v.sharding, nn.meta.unbox(state.params))
    assert results[False] == results[True], "logical and mesh-axis variants must shard alike"
    print("logical variant shards exactly like the mesh-axis variant: OK")


if __name__ == "__main__":
    main()
