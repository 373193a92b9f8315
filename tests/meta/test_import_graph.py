"""The package's Python is in one-way layers (docs: DESIGN.md, "Layers"): no import cycle among
its modules, counting the imports inside functions; no function-level import of a ctrainstate
module at all; every module imports only from its own layer or lower ones. An upward call goes
through ``ctrainstate._src.base.hooks`` (the upper module registers itself, the lower one
looks it up),
and the keys looked up there must be provided by a module of a higher (or the same) layer.

The graph is read from the source with ``ast`` (module level and inside functions and methods,
relative and absolute, ``from . import x`` resolved to the module ``x``). A self-test runs the
same code on a small package with a cycle, so the check is known to fail when it should.
"""
from __future__ import annotations

import ast
import fnmatch
import functools
import sys
from pathlib import Path

import pytest

PKG = "ctrainstate"
ROOT = Path(__file__).resolve().parents[2] / "python" / PKG

# bottom to top; a module may import modules of its own layer or of a layer listed before it.
# Patterns name modules relative to the package ("nn.*": nn's submodules).
LAYERS = [
    ("base", "_C _cuda_backend config errors tree_util tree traverse_util _src _src.base "
             "_src.base.*"),
    ("array", "sharding mesh_utils array _src.array _src.array.*"),
    ("ops", "scipy scipy.* _src.ops _src.ops.*"),
    ("numpy_lax", "numpy lax _src.numpy_lax _src.numpy_lax.*"),
    ("autodiff", "_src.autodiff _src.autodiff.*"),
    ("models", "random nn nn.* optim optim.* partitioning core _src.random _src.random.* "
               "_src.partitioning _src.partitioning.* _src.nn _src.nn.* _src.core _src.core.* "
               "_src.optim _src.optim.*"),
    ("jit", "_src.jit _src.jit.*"),
    ("app", "train_state struct checkpoint checkpoint.* distributed serialization debug "
            "experimental experimental.* _src.train_state _src.train_state.* "
            "_src.serialization _src.serialization.* _src.checkpoint _src.checkpoint.* "
            "_src.distributed _src.distributed.* _src.debug _src.debug.*"),
    ("ports", "t5x t5x.* hf hf.* testing _src.ports _src.ports.* _src.testing _src.testing.*"),
    ("facade", PKG),
]


def layer_of(module: str, layers=LAYERS, pkg: str = PKG) -> int:
    short = module if module == pkg else module[len(pkg) + 1:]
    for i, (_, patterns) in enumerate(layers):
        if any(fnmatch.fnmatchcase(short, p) for p in patterns.split()):
            return i
    raise KeyError(f"{module} is in no layer of tests/test_import_graph.py: add it to LAYERS")


# --- the graph --------------------------------------------------------------------------------

def _parse(path: Path) -> ast.Module:
    """The module's AST (parsed once per source text: the checks below walk each module)."""
    return _parse_text(path.read_text(), str(path))


@functools.lru_cache(maxsize=None)
def _parse_text(text: str, filename: str) -> ast.Module:
    return ast.parse(text, filename)


def modules(root: Path, pkg: str) -> dict:
    """``{module name: (path or None for an extension module, is a package)}``."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = [pkg, *p.relative_to(root).with_suffix("").parts]
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    for p in sorted(root.rglob("*.so")):
        parts = [pkg, *p.relative_to(root).parent.parts, p.name.split(".")[0]]
        out[".".join(parts)] = (None, False)
    return out


def imports(name: str, path: Path, is_pkg: bool, mods: dict, pkg: str,
            packages: bool = False) -> list:
    """``[(imported module, line, inside a function)]`` for the package's own modules; with
    ``packages``, importing ``a.b.c`` also depends on the subpackage ``a.b`` (its
    ``__init__`` runs first)."""
    if path is None:
        return []
    tree = _parse(path)
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out = []

    def owner(m):
        while m and m not in mods:
            m = m.rpartition(".")[0]
        return m

    def resolve(base, level):
        if not level:
            return base
        parts = here[:len(here) - (level - 1)]
        return ".".join(parts + ([base] if base else []))

    def visit(node, in_func):
        for child in ast.iter_child_nodes(node):
            targets = []
            if isinstance(child, ast.Import):
                targets = [owner(a.name) for a in child.names if a.name.split(".")[0] == pkg]
            elif isinstance(child, ast.ImportFrom):
                base = resolve(child.module or "", child.level)
                if base.split(".")[0] == pkg:
                    targets = [base + "." + a.name if base + "." + a.name in mods else owner(base)
                               for a in child.names]
            for t in targets:
                out.append((t, child.lineno, in_func))
                # importing a.b.c runs the subpackage a.b first (not the root: it is running)
                parent = t.rpartition(".")[0]
                while packages and parent and parent != pkg:
                    if not name.startswith(parent + ".") and name != parent:
                        out.append((parent, child.lineno, in_func))
                    parent = parent.rpartition(".")[0]
            visit(child, in_func or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return out


def graph(root: Path, pkg: str, packages: bool = False):
    """``(edges {module: {module}}, function-level imports [(module, imported, line)],
    hook lookups [(module, key)], hook providers {key: module})``."""
    mods = modules(root, pkg)
    edges = {m: set() for m in mods}
    in_functions, lookups, providers = [], [], {}
    for m, (path, is_pkg) in mods.items():
        for t, line, in_func in imports(m, path, is_pkg, mods, pkg, packages):
            edges[m].add(t)
            if in_func:
                in_functions.append((m, t, line))
        if path is not None:
            for node in ast.walk(_parse(path)):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.args and isinstance(node.args[0], ast.Constant)):
                    if node.func.id == "_upper":
                        lookups.append((m, node.args[0].value))
                    elif node.func.id == "_provide":
                        providers[node.args[0].value] = m
    return edges, in_functions, lookups, providers


def cycles(edges: dict) -> list:
    """The strongly connected components with more than one module, and self-imports."""
    index, low, stack, on, found = {}, {}, [], set(), []
    counter = [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                found.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10000))
    try:
        for v in sorted(edges):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def upward(edges: dict, layers=LAYERS, pkg: str = PKG) -> list:
    return sorted(f"{m} ({layers[layer_of(m, layers, pkg)][0]}) imports {t} "
                  f"({layers[layer_of(t, layers, pkg)][0]})"
                  for m, ts in edges.items() for t in ts
                  if layer_of(t, layers, pkg) > layer_of(m, layers, pkg))


# --- the package ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def package_graph():
    return graph(ROOT, PKG)


def test_no_import_cycle(package_graph):
    edges, _, _, _ = package_graph
    assert len(edges) > 50          # the package was found
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_function_level_import_of_the_package(package_graph):
    _, in_functions, _, _ = package_graph
    assert not in_functions, "imports inside functions:\n" + "\n".join(
        f"{m}:{line} imports {t}" for m, t, line in in_functions)


# packages a function may import on use: optional dependencies (extras, peers, launchers)
OPTIONAL = {"jax", "jaxlib", "flax", "optax", "orbax", "t5x", "transformers", "scipy",
            "matplotlib", "tqdm", "safetensors", "msgpack", "xxhash", "mpi4py", "torch", "cupy",
            "IPython", "nbformat", "nbclient", "ipywidgets", "tensorflow"}


def function_level_imports(root: Path, optional=OPTIONAL) -> list:
    """'path:line: statement' of every import inside a function of a module under ``root``
    that is not of an optional dependency (a relative import counts)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(_parse(path)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for n in ast.walk(node):
                if isinstance(n, ast.Import):
                    tops = {a.name.split(".")[0] for a in n.names}
                elif isinstance(n, ast.ImportFrom):
                    tops = {"." if n.level else n.module.split(".")[0]}
                else:
                    continue
                if tops - optional:
                    found.append(f"{path.relative_to(root.parent)}:{n.lineno}: {ast.unparse(n)}")
    return found


def test_no_function_level_import_but_optional_dependencies():
    """Standard-library, numpy and package imports are at module level; only optional
    dependencies are imported where they are used."""
    assert function_level_imports(ROOT) == []


def test_self_test_function_level_imports(tmp_path):
    _write(tmp_path / "pkg", {"__init__.py": "", "a.py": "def f():\n    import os\n    import jax\n"})
    assert [x.split(": ", 1)[1] for x in function_level_imports(tmp_path / "pkg")] == ["import os"]


def test_no_import_cycle_through_package_inits():
    """Importing ``a.b.c`` runs ``a/b/__init__.py`` first: a module that imports from a package
    whose ``__init__`` imports it back is in a cycle too (why nn's core is in _src)."""
    edges, _, _, _ = graph(ROOT, PKG, packages=True)
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_every_module_is_in_a_layer(package_graph):
    edges, _, _, _ = package_graph
    missing = []
    for m in edges:
        try:
            layer_of(m)
        except KeyError:
            missing.append(m)
    assert not missing, missing


def test_layers_import_only_downward(package_graph):
    edges, _, _, _ = package_graph
    bad = upward(edges)
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_upward_calls_go_to_providers_of_higher_layers(package_graph):
    _, _, lookups, providers = package_graph
    bad = []
    for m, key in lookups:
        if key not in providers:
            bad.append(f"{m} looks up {key!r}, which no module provides")
        elif layer_of(providers[key]) < layer_of(m):
            bad.append(f"{m} looks up {key!r} from the lower {providers[key]} (import it)")
    assert not bad, "\n".join(bad)


def test_every_provider_is_registered_by_import_ctrainstate(package_graph):
    """The lower layers' lookups run after ``import ctrainstate``: every provider they look up
    must be imported by it."""
    import ctrainstate  # noqa: F401
    from ctrainstate._src.base import hooks as _hooks
    _, _, lookups, providers = package_graph
    missing = sorted({key for _, key in lookups} - set(_hooks.provided()))
    assert not missing, missing


# --- the check itself -------------------------------------------------------------------------

def _write(root: Path, files: dict) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_self_test_detects_cycles_and_function_imports(tmp_path):
    root = tmp_path / "toy"
    _write(root, {
        "__init__.py": "from . import a\n",
        "a.py": "from .b import f\n",
        "b.py": "def f():\n    from . import c\n    return c\n",
        "c.py": "import toy.sub.d as d\n",
        "sub/__init__.py": "",
        "sub/d.py": "from .. import a\n",
        "e.py": "from . import e\n",
        "ok.py": "from . import a\nimport os\n\ndef g():\n    import json\n    return json\n",
        "f.py": "from .pkg.m import X\n",          # runs pkg/__init__, which imports f
        "pkg/__init__.py": "from ..f import X\n",
        "pkg/m.py": "X = 1\n",
    })
    edges, in_functions, _, _ = graph(root, "toy", packages=True)
    found = cycles(edges)
    assert ["toy.a", "toy.b", "toy.c", "toy.sub.d"] in found
    assert ["toy.f", "toy.pkg"] in found
    assert ["toy.e"] in found
    assert not any("toy.ok" in c for c in found)
    assert in_functions == [("toy.b", "toy.c", 2)]
    edges, _, _, _ = graph(root, "toy")
    assert ["toy.a", "toy.b", "toy.c", "toy.sub.d"] in cycles(edges)
    assert ["toy.f", "toy.pkg"] not in cycles(edges)
    layers = [("low", "a b c e f ok sub sub.* pkg pkg.*"), ("top", "toy")]
    assert upward(edges, layers, "toy") == []
    layers = [("low", "b c e f ok sub sub.* pkg pkg.*"), ("high", "a"), ("top", "toy")]
    assert upward(edges, layers, "toy") == [
        "toy.ok (low) imports toy.a (high)", "toy.sub.d (low) imports toy.a (high)"]


def test_self_test_acyclic_package(tmp_path):
    root = tmp_path / "toy"
    _write(root, {"__init__.py": "from .b import g\n", "a.py": "X = 1\n",
                  "b.py": "from . import a\nfrom .a import X\n\ndef g():\n    return X\n"})
    edges, in_functions, _, _ = graph(root, "toy")
    assert cycles(edges) == [] and in_functions == []
    assert edges["toy.b"] == {"toy.a"} and edges["toy"] == {"toy.b"}
