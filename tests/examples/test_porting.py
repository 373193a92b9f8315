"""README.md, "Porting from Flax, t5x and HuggingFace": every ctrainstate recipe runs; Flax/t5x originals differ only in imports;
the Flax originals give the same parameters (recorded, checked live in the parity twin)."""
import os
import re

import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import P

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def snippets():
    text = open(DOC).read()
    return {m.group(1): m.group(2) for m in re.finditer(
        r"<!-- snippet: (\S+) -->\s*```python\n(.*?)```", text, re.S)}


def body(code):
    """The code without import lines and comments (what a port must not change)."""
    return [ln for ln in code.splitlines()
            if ln.strip() and not re.match(r"(import|from) \S", ln) and not ln.startswith("#")]


def test_doc_has_all_recipes():
    assert set(snippets()) == {"colab/flax", "colab/ctrainstate", "pjit/flax", "pjit/ctrainstate",
                               "t5x/t5x", "t5x/ctrainstate", "hf/ctrainstate",
                               "clm_flax/ctrainstate"}


@pytest.mark.parametrize("name", ["colab", "pjit", "t5x"])
def test_ports_change_only_imports(name):
    s = snippets()
    orig = s[f"{name}/flax"] if f"{name}/flax" in s else s[f"{name}/t5x"]
    assert body(orig) == body(s[f"{name}/ctrainstate"])
    for line in s[f"{name}/ctrainstate"].splitlines():
        if re.match(r"(import|from) \S", line):
            assert "jax" not in line and "flax" not in line and "t5x import" not in line.replace(
                "ctrainstate.t5x", ""), line


def module_ns(name):
    """A fresh module namespace registered in sys.modules (dataclass fields need it)."""
    import sys
    import types
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    return mod.__dict__


def run_ct(*names):
    ns = module_ns("porting_snippet_ct")
    s = snippets()
    for n in names:
        exec(compile(s[n], f"README.md:{n}", "exec"), ns)
    return ns


def test_colab_recipe():
    ns = run_ct("colab/ctrainstate")
    state = ns["state"]
    assert state.params["w1"].sharding.spec == P(None, "model")  # born sharded
    assert state.params["w2"].sharding.spec == P("model", None)
    assert state.opt_state[0].mu["w1"].sharding == state.params["w1"].sharding
    assert ns["variables"]["params_axes"]["w1_axes"] == cts.partitioning.AxisMetadata(
        ("embed", "hidden"))
    assert state.step == 0


def test_pjit_recipe():
    ns = run_ct("colab/ctrainstate", "pjit/ctrainstate")
    assert ns["logical"] == {"w1": P("embed", "hidden"), "w2": P("hidden", "embed")}
    assert ns["mesh_axes"] == {"w1": P(None, "model"), "w2": P("model", None)}
    assert ns["abstract"]["params"]["w1"].shape == (16, 64)
    p = ns["params"]
    assert p["w1"].sharding.spec == P(None, "model") and p["w2"].sharding.spec == P("model", None)
    np.testing.assert_array_equal(np.asarray(p["w1"]), np.asarray(ns["state"].params["w1"]))


def test_t5x_recipe():
    ns = run_ct("colab/ctrainstate", "t5x/ctrainstate")
    axes, state = ns["state_axes"], ns["state"]
    assert axes.params == {"w1": P(None, "model"), "w2": P("model", None)}
    assert axes.param_states[0].mu == axes.params and axes.step is None
    assert int(state.step) == 3
    assert state.params["w1"].sharding.spec == P(None, "model")
    assert state.param_states[0].nu["w2"].sharding.spec == P("model", None)
    assert dict(ns["partitioner"].mesh.shape) == {"data": 1, "model": 8}
    assert np.isfinite(float(np.asarray(ns["loss"])))


def test_hf_recipe():
    ns = run_ct("hf/ctrainstate")
    mu = ns["opt_state"][0].mu["transformer"]["h"]["0"]["mlp"]["c_fc"]["kernel"]
    assert mu.sharding.spec == P(None, "mp")
    assert ns["opt_spec"][1] is None and ns["opt_spec"][0].count is None
    assert ns["params"]["transformer"]["wte"]["embedding"].sharding.spec == P("mp", None)


def test_clm_flax_recipe():
    """run_clm_flax's pmap step: the state stays replicated (one copy per device, the same
    params on each), a dropout key per device, and the loss falls on the toy task."""
    ns = run_ct("clm_flax/ctrainstate")
    n = cts.local_device_count()
    state, losses = ns["state"], ns["losses"]
    assert np.asarray(state.step).tolist() == [20] * n
    k = np.asarray(state.params["Dense_0"]["kernel"])
    assert k.shape == (n, 8, 32) and all(np.array_equal(k[0], k[j]) for j in range(n))
    assert state.params["Dense_0"]["kernel"].sharding.spec == P("batch")
    keys = np.asarray(state.dropout_rng)
    assert keys.shape == (n, 2) and len({tuple(r) for r in keys.tolist()}) == n
    assert all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses


def test_flax_originals_give_the_same_params(jax_ref):
    import warnings

    def theirs(jax):
        if len(jax.devices()) < 8:
            pytest.skip("needs 8 XLA CPU devices")
        ns = module_ns("porting_snippet_flax")
        s = snippets()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            exec(compile(s["colab/flax"], "README.md:colab/flax", "exec"), ns)
            exec(compile(s["pjit/flax"], "README.md:pjit/flax", "exec"), ns)
        return {"state": {k: ns["state"].params[k] for k in ("w1", "w2")},
                "params": {k: ns["params"][k] for k in ("w1", "w2")},
                "specs": {k: tuple(ns["params"][k].sharding.spec) for k in ("w1", "w2")},
                "mesh_axes": {k: tuple(v) for k, v in ns["mesh_axes"].items()}}

    want = jax_ref("flax", theirs)
    ct = run_ct("colab/ctrainstate", "pjit/ctrainstate")
    for k in ("w1", "w2"):
        np.testing.assert_array_equal(want["state"][k], np.asarray(ct["state"].params[k]))
        np.testing.assert_array_equal(want["params"][k], np.asarray(ct["params"][k]))
        assert want["specs"][k] == tuple(ct["params"][k].sharding.spec)
    assert want["mesh_axes"] == {k: tuple(v) for k, v in ct["mesh_axes"].items()}


def test_mechanical_port_module_paths():
    """jax / Flax import paths, with the package name changed, reach the same functions."""
    import importlib
    for path, name, target in [
            ("ctrainstate.experimental.pjit", "pjit", cts.pjit),
            ("ctrainstate.experimental.pjit", "with_sharding_constraint",
             cts.with_sharding_constraint),
            ("ctrainstate.experimental.mesh_utils", "create_device_mesh",
             cts.mesh_utils.create_device_mesh),
            ("ctrainstate.debug", "visualize_array_sharding", cts.visualize_array_sharding)]:
        assert getattr(importlib.import_module(path), name) is target, (path, name)
    from ctrainstate import partitioning
    from ctrainstate.nn import partitioning as nn_partitioning
    assert nn_partitioning.__all__ == partitioning.__all__
    for name in partitioning.__all__:
        assert getattr(nn_partitioning, name) is getattr(partitioning, name), name
    from ctrainstate.experimental import mesh_utils
    mesh = cts.sharding.Mesh(mesh_utils.create_device_mesh((2, 4)), ("data", "model"))
    with mesh:
        y = cts.experimental.pjit.pjit(lambda a: a * 2, in_shardings=P("data"),
                                       out_shardings=P())(np.ones((4, 2), np.float32))
    assert y.sharding.spec == P() and np.asarray(y).sum() == 16


def test_create_device_mesh_takes_jax_keywords_only():
    from ctrainstate.experimental import mesh_utils
    assert mesh_utils.create_device_mesh((2,), contiguous_submeshes=True,
                                         allow_split_physical_axes=True,
                                         devices=cts.devices()[:2]).shape == (2,)
    with pytest.raises(TypeError, match="contigous"):
        mesh_utils.create_device_mesh((8,), contigous_submeshes=True)


# --- the public modules of the Flax / t5x / HF ports list their API ----------------------------

def _port_modules():
    import importlib
    import pkgutil
    names = ["ctrainstate.partitioning", "ctrainstate.struct"]
    for pkg in ("ctrainstate.nn", "ctrainstate.t5x", "ctrainstate.hf"):
        names.append(pkg)
        path = importlib.import_module(pkg).__path__
        names += [f"{pkg}.{m.name}" for m in pkgutil.iter_modules(path)
                  if not m.name.startswith("_")]
    return names


@pytest.mark.parametrize("name", _port_modules())
def test_port_module_all_lists_its_public_api(name):
    """Every public module of the ports has an ``__all__``: each entry exists, none is a
    helper imported from numpy/typing/re, and every public class or function the module
    defines is listed (a star import gives exactly the API)."""
    import importlib
    import types
    mod = importlib.import_module(name)
    assert hasattr(mod, "__all__"), name
    listed = set(mod.__all__)
    assert len(listed) == len(mod.__all__), f"{name}: __all__ repeats a name"
    helpers = {"np", "re", "Any", "Callable", "Sequence", "Mapping", "Optional", "Tuple",
               "Iterable", "annotations", "functools", "dataclasses", "tree_util"}
    assert not listed & helpers, (name, sorted(listed & helpers))
    for n in mod.__all__:
        obj = getattr(mod, n)            # AttributeError: listed but missing
        if isinstance(obj, types.ModuleType):
            assert obj.__name__.startswith("ctrainstate."), (name, n)
    defined = {n for n, v in vars(mod).items() if not n.startswith("_")
               and getattr(v, "__module__", None) == name
               and (isinstance(v, type) or callable(v))}
    assert defined <= listed, f"{name}: public but not in __all__: {sorted(defined - listed)}"
    star = {}
    exec(f"from {name} import *", star)
    assert set(star) - {"__builtins__"} == listed


@pytest.mark.parametrize("name", ["ctrainstate.partitioning", "ctrainstate.struct"])
def test_facade_module_namespace_is_exactly_its_api(name):
    """The facade's public attributes are exactly ``__all__`` (no np, re, Any, Scope...).
    ('@py_builtins' and '@pytest_ar' are what pytest's assertion rewriter adds to the modules
    of a distribution that carries a pytest plugin, as ctrainstate does.)"""
    import importlib
    mod = importlib.import_module(name)
    public = {n for n in vars(mod) if not n.startswith(("_", "@"))} - {"annotations"}
    assert public == set(mod.__all__), sorted(public ^ set(mod.__all__))
