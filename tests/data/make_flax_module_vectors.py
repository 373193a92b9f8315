"""Generate tests/data/flax_module_vectors.npz from flax.linen (run once; needs jax + flax).

Each case: a module, a seed and an input; stored are every parameter after
init and the output of apply, so tests/nn/test_modules.py can check ctrainstate's
modules against Flax without Flax installed.

    python tests/data/make_flax_module_vectors.py
"""
import os

import numpy as np


def cases():
    """(name, builder(nn_module_namespace) -> module, seed, input)."""
    rng = np.random.default_rng(1234)
    x23 = rng.standard_normal((2, 3)).astype(np.float32)
    x246 = rng.standard_normal((2, 4, 6)).astype(np.float32)
    ids = rng.integers(0, 10, size=(2, 5)).astype(np.int32)

    def mlp(nn):
        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x):
                x = nn.relu(nn.Dense(4)(x))
                x = nn.LayerNorm()(x)
                return nn.Dense(2, name="head")(nn.gelu(nn.Dense(4)(x)))
        return MLP()

    def setup_model(nn):
        class Enc(nn.Module):
            def setup(self):
                self.proj = nn.Dense(5)
                self.out = nn.Dense(3)

            def __call__(self, x):
                return self.out(nn.tanh(self.proj(x)))
        return Enc()

    return [
        ("dense", lambda nn: nn.Dense(3), 0, x23),
        ("dense_nobias", lambda nn: nn.Dense(7, use_bias=False), 5, x246),
        ("mlp", mlp, 1, x23),
        ("setup", setup_model, 2, x23),
        ("densegeneral", lambda nn: nn.DenseGeneral((2, 3), axis=(-2, -1)), 3, x246),
        ("embed", lambda nn: nn.Embed(10, 4), 4, ids),
        ("layernorm", lambda nn: nn.LayerNorm(), 6, x246),
    ]


def main():
    import jax
    import flax.linen as fnn
    from flax.traverse_util import flatten_dict
    out = {}
    for name, build, seed, x in cases():
        m = build(fnn)
        v = m.init(jax.random.PRNGKey(seed), x)
        y = m.apply(v, x)
        for path, val in flatten_dict(v["params"]).items():
            out[f"{name}/params/" + "/".join(path)] = np.asarray(val)
        out[f"{name}/output"] = np.asarray(y)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flax_module_vectors.npz")
    np.savez_compressed(path, **out)
    print(f"wrote {len(out)} arrays to {path} (flax {__import__('flax').__version__})")


if __name__ == "__main__":
    main()
