"""python/ctrainstate/_C.pyi declares what ctrainstate._C exports: every public name of the
extension has a stub, every stub names something the extension has, and where the C binding
states its signature (``__text_signature__``), the stub's parameters are the same."""
import ast
import inspect
import os

import ctrainstate
from ctrainstate import _C

STUB = os.path.join(os.path.dirname(ctrainstate.__file__), "_C.pyi")


def _stub_defs():
    tree = ast.parse(open(STUB).read())
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def _public(mod):
    return {n for n in dir(mod) if not n.startswith("__")
            and not isinstance(getattr(mod, n), type(os))}


def test_every_export_has_a_stub_and_every_stub_an_export():
    stubs = _stub_defs()
    exported = _public(_C)
    # stubs of private helpers (a leading underscore, e.g. _Block) may be typing aliases only
    declared = {n for n in stubs if not n.startswith("_") or n in exported}
    assert sorted(exported - set(stubs)) == [], "exports of _C without a stub in _C.pyi"
    assert sorted(declared - exported) == [], "stubs in _C.pyi that _C does not export"


def test_stub_parameters_match_the_text_signatures():
    stubs = _stub_defs()
    checked = 0
    for name, node in stubs.items():
        fn = getattr(_C, name, None)
        if not isinstance(node, ast.FunctionDef) or getattr(fn, "__text_signature__", None) is None:
            continue
        want = [p.arg for p in node.args.posonlyargs + node.args.args]
        got = [p for p in inspect.signature(fn).parameters]
        assert got == want, (name, got, want)
        checked += 1
    assert checked >= 10, checked     # most bindings state their signature
