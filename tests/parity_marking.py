"""Which tests use jax, flax or optax live: the static half of the `parity` marker.

tests/conftest.py marks a test `parity` when this module finds that it uses jax/flax/optax (and
also when it requests one of conftest's `jax`, `jnp`, `flax`, `optax` fixtures, or the live
side of the `jax_ref` fixture). The README's test command deselects those tests and blocks the
import of jax, flax and optax; a test that imports one of them anyway fails there (conftest's
import guard), so a miss here is loud, not a silent skip.

A module is read once (its AST, not its code). A test uses jax live when its function (body,
decorators, default values) or its class

- imports jax/jaxlib/flax/optax (``import jax``, ``from flax import linen``), or calls
  ``pytest.importorskip`` / ``importlib.import_module`` / ``__import__`` with such a name;
- refers to a module-level name that is bound by such an import, bound in a module-level
  ``try`` (or ``if``) statement that contains one (``HAVE_OPTAX``, ``jnp = None``), or bound
  by a module-level ``def``/``class``/assignment that itself uses jax live (``_jax()``,
  ``_run_optax``), transitively;
- refers to such a name of a helper module of tests/ that it imports (``optim_cases.run_optax``).

What a test passes to ``jax_ref(key, fn)`` (conftest's fixture: jax's side, live or recorded)
does not count: the fixture marks the live twin itself, and the recorded twin must not use jax
(if it does, the import guard fails it in the README's test command).

A module whose top level imports jax (outside ``try``), or whose ``pytestmark`` uses jax, is
live as a whole.
"""
from __future__ import annotations

import ast
import os

LIVE_ROOTS = frozenset({"jax", "jaxlib", "flax", "optax"})
_IMPORTERS = frozenset({"importorskip", "import_module", "__import__"})


def _walk(node: ast.AST):
    """ast.walk, except inside a call of ``jax_ref(key, fn)``: what computes jax's side of a
    comparison there (``fn``, any argument after the key) runs only in the live twin, which the
    fixture marks itself, so it does not make the test live."""
    todo = [node]
    while todo:
        n = todo.pop()
        yield n
        if isinstance(n, ast.Call) and _callee(n) == "jax_ref":
            todo.append(n.func)
            todo.extend(n.args[:1])
            continue
        todo.extend(ast.iter_child_nodes(n))


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)


def _is_live_name(mod: str | None) -> bool:
    return bool(mod) and mod.split(".")[0] in LIVE_ROOTS


def _imports_live(node: ast.AST) -> bool:
    """node contains an import of jax/flax/optax, or an importorskip/import_module of one."""
    for n in _walk(node):
        if isinstance(n, ast.Import):
            if any(_is_live_name(a.name) for a in n.names):
                return True
        elif isinstance(n, ast.ImportFrom):
            if n.level == 0 and _is_live_name(n.module):
                return True
        elif isinstance(n, ast.Call) and n.args:
            name = _callee(n)
            a = n.args[0]
            if (name in _IMPORTERS and isinstance(a, ast.Constant) and isinstance(a.value, str)
                    and _is_live_name(a.value)):
                return True
    return False


def _bound_names(stmt: ast.stmt) -> set[str]:
    """Names a module-level statement binds (functions, classes, assignments, imports, loop
    and with targets, anywhere in a compound statement but not inside a def or class body)."""
    out: set[str] = set()

    def visit(n):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
            return  # their bodies are their own scope
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            for a in n.names:
                out.add(a.asname or a.name.split(".")[0])
            return
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            out.add(n.id)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            out.add(n.name)
        for c in ast.iter_child_nodes(n):
            visit(c)

    visit(stmt)
    return out


def _local_names(fn) -> set[str]:
    """The names a function or lambda binds itself (its parameters, and what its body assigns,
    imports, defines or loops over, outside nested functions): Python's local scope, which
    hides a module-level name of the same spelling (``import ctrainstate.numpy as jnp``)."""
    a = fn.args
    out = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    out |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
    if isinstance(fn, ast.Lambda):
        return out
    declared = set()
    for st in fn.body:
        for n in ast.walk(st) if not isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                     ast.ClassDef)) else [st]:
            if isinstance(n, (ast.Global, ast.Nonlocal)):
                declared |= set(n.names)
        out |= _bound_names(st)
    return out - declared


_SUMMARIES: dict[int, tuple] = {}  # id(node) -> (node, its free names, its free attributes)


def _free_refs(node: ast.AST) -> tuple[frozenset, frozenset]:
    """The names node refers to, and the ``ALIAS.attr`` pairs, that no function's own local
    of the same name hides (what ``jax_ref(key, fn)`` computes jax's side with left out).
    Computed once per node (the fixpoints below ask again with more tainted names)."""
    hit = _SUMMARIES.get(id(node))
    if hit is not None and hit[0] is node:
        return hit[1], hit[2]
    names: set[str] = set()
    attrs: set[tuple[str, str]] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
            attrs.add((n.value.id, n.attr))
        if isinstance(n, ast.Call) and _callee(n) == "jax_ref":
            todo.append(n.func)
            todo.extend(n.args[:1])
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            # decorators and defaults are evaluated outside; the body sees the locals
            todo.extend(n.args.defaults)
            todo.extend(d for d in n.args.kw_defaults if d is not None)
            if not isinstance(n, ast.Lambda):
                todo.extend(n.decorator_list)
            local = _local_names(n)
            for c in ([n.body] if isinstance(n, ast.Lambda) else n.body):
                inner_names, inner_attrs = _free_refs(c)
                names |= inner_names - local
                attrs |= {a for a in inner_attrs if a[0] not in local}
        else:
            todo.extend(ast.iter_child_nodes(n))
    out = frozenset(names), frozenset(attrs)
    _SUMMARIES[id(node)] = (node, *out)
    return out


def _refs(node: ast.AST, names: set[str], modules: dict[str, set[str]]) -> bool:
    """node refers to one of names, or to ALIAS.attr with attr among modules[ALIAS], where those
    are not hidden by a function's own local of the same name."""
    free, attrs = _free_refs(node)
    if not free.isdisjoint(names):
        return True
    return any(attr in modules.get(alias, ()) for alias, attr in attrs)


_LIVE_IMPORTS: dict[int, tuple] = {}  # id(node) -> (node, _imports_live(node))


def _imports_live_cached(node: ast.AST) -> bool:
    hit = _LIVE_IMPORTS.get(id(node))
    if hit is None or hit[0] is not node:
        hit = _LIVE_IMPORTS[id(node)] = (node, _imports_live(node))
    return hit[1]


_TESTS = os.path.dirname(os.path.abspath(__file__))  # tests/, where the helper modules are


class ModuleInfo:
    """What one test (or helper) module's AST says about its use of jax."""

    def __init__(self, path: str, helper_info=None):
        with open(path, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source, path)
        self.path = path
        self.whole = False        # every test of the module uses jax
        self.tainted: set[str] = set()  # module-level names that use jax
        here = os.path.dirname(path)
        # a helper module is beside the test module or in tests/ (the test modules live in
        # tests/<layer>/ and import the helpers of tests/ as top-level modules)
        dirs = [here] + ([_TESTS] if os.path.abspath(here) != _TESTS else [])

        def helper(name):
            if helper_info is None:
                return None
            for d in dirs:
                if os.path.isfile(os.path.join(d, name + ".py")):
                    return helper_info(os.path.join(d, name + ".py"))
            return None

        modules: dict[str, set[str]] = {}  # alias of a helper module -> its tainted names
        stmts = list(tree.body)
        # helper modules of tests/ (optim_cases, sampler_checks, ...): their tainted names
        for s in stmts:
            if isinstance(s, ast.Import):
                for a in s.names:
                    h = helper(a.name)
                    if h is not None:
                        modules[a.asname or a.name] = h.tainted
                        self.whole |= h.whole
            elif isinstance(s, ast.ImportFrom) and s.level == 0 and s.module:
                h = helper(s.module)
                if h is not None:
                    self.whole |= h.whole
                    for a in s.names:
                        if a.name in h.tainted:
                            self.tainted.add(a.asname or a.name)
        for s in stmts:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if _imports_live(s):
                if isinstance(s, (ast.Try, ast.If)) or not _module_level_import(s):
                    # a guarded import (try/except ImportError, if ...): the names it binds
                    self.tainted |= _bound_names(s)
                else:
                    self.whole = True
                    self.tainted |= _bound_names(s)
        defs = {}
        for s in stmts:
            for name in _bound_names(s):
                defs.setdefault(name, []).append(s)
        # A statement can only import jax, or refer to a tainted name, if its source text holds
        # that name: the text decides first, and only a statement that names one is analysed
        # (most tests of a module that uses jax somewhere never name it).
        lines = source.splitlines()
        texts = {}
        for s in stmts:
            first = min([s.lineno] + [d.lineno for d in getattr(s, "decorator_list", ())])
            texts[id(s)] = "\n".join(lines[first - 1:s.end_lineno])

        def names_any(s, words):
            text = texts[id(s)]
            return any(w in text for w in words)

        changed = True
        while changed:  # the fixpoint of "refers to a tainted name"
            changed = False
            words = self.tainted | {alias for alias, names in modules.items() if names}
            for name, ss in defs.items():
                if name in self.tainted:
                    continue
                if any((names_any(s, LIVE_ROOTS) and _imports_live_cached(s))
                       or (names_any(s, words) and _refs(s, self.tainted, modules))
                       for s in ss):
                    self.tainted.add(name)
                    words.add(name)
                    changed = True
        self._modules = modules
        if "pytestmark" in self.tainted:
            self.whole = True
        self._defs = {s.name: s for s in stmts
                      if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}

    def uses_jax(self, name: str, cls: str | None = None) -> bool:
        """Whether test function `name` (a method of class `cls`) uses jax live."""
        if self.whole:
            return True
        if cls is not None:
            c = self._defs.get(cls)
            return c is not None and _class_method_live(c, name, self.tainted, self._modules)
        return name in self.tainted


def _module_level_import(s: ast.stmt) -> bool:
    """s is a plain statement at module level that imports jax when the module is imported
    (``import jax``, ``flax = pytest.importorskip("flax")``): not a def, class, try or if."""
    return not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Try,
                              ast.If))


def _class_method_live(c: ast.ClassDef, name: str, tainted, modules) -> bool:
    members = {}
    for s in c.body:
        for n in _bound_names(s):
            members.setdefault(n, []).append(s)
    live = {n for n, ss in members.items()
            if any(_imports_live_cached(s) or _refs(s, tainted, modules) for s in ss)}

    def calls_live(s):   # a method's body (where `self` is its parameter) uses self.<live>
        parts = (s.body + s.decorator_list if isinstance(s, (ast.FunctionDef,
                                                             ast.AsyncFunctionDef)) else [s])
        return any(_refs(p, set(), {"self": live, "cls": live}) for p in parts)

    changed = True
    while changed:  # methods that call self.<live member>
        changed = False
        for n, ss in members.items():
            if n not in live and any(calls_live(s) for s in ss):
                live.add(n)
                changed = True
    return name in live or any(_imports_live_cached(d) or _refs(d, tainted, modules)
                               for d in c.decorator_list)


class Analyzer:
    """ModuleInfo per path, cached (a helper module is read once)."""

    def __init__(self):
        self._cache: dict[str, ModuleInfo | None] = {}

    def _helper(self, path: str):
        path = os.path.abspath(path)
        if not os.path.isfile(path):
            return None
        return self.info(path)

    def info(self, path: str) -> ModuleInfo | None:
        path = os.path.abspath(path)
        if path not in self._cache:
            self._cache[path] = None  # an import cycle between helpers reads as no taint
            try:
                self._cache[path] = ModuleInfo(path, self._helper)
            except (OSError, SyntaxError):
                self._cache[path] = None
        return self._cache[path]
