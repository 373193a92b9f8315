"""Public modules export only their API: ``__all__`` lists what ``from m import *`` gives and
``dir(m)`` shows (the names an editor completes), without the modules and typing helpers
the implementation imports (``np``, ``re``, ``Any``, ``annotations``)."""
import importlib
import pkgutil
import sys
import types

import pytest

import ctrainstate

_STDLIB = set(sys.stdlib_module_names) | {"__future__"}
_MISSING = object()


def _public_modules() -> list:
    names = ["ctrainstate"]
    for info in pkgutil.walk_packages(ctrainstate.__path__, "ctrainstate."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


def _foreign(name: str, value) -> str:
    """Why ``value``, found under ``name``, is not API of a ctrainstate module ('' when it
    may be): a module from outside ctrainstate, or an object of the standard library
    (typing's ``Any``, ``Callable``, ``__future__.annotations``, ``itertools.islice``)
    under its own name there. Type aliases a module defines (``LogicalRules =
    Sequence[...]``) are API, as in Flax and optax."""
    if isinstance(value, types.ModuleType):
        return "" if value.__name__.split(".")[0] == "ctrainstate" else f"module {value.__name__}"
    mod = getattr(value, "__module__", None)
    for m in ("typing", "typing_extensions", "__future__", "collections.abc",
              mod if isinstance(mod, str) and mod.split(".")[0] in _STDLIB else None):
        if m is not None and m in sys.modules and getattr(sys.modules[m], name, _MISSING) is value:
            return f"{m}.{name}"
    return ""


def _problems(name: str) -> list:
    mod = importlib.import_module(name)
    out = []
    api = getattr(mod, "__all__", None)
    if api is None:
        return ["no __all__"]
    for n in api:
        if not hasattr(mod, n):
            out.append(f"__all__ lists {n!r}, which does not exist")
        elif _foreign(n, getattr(mod, n)):
            out.append(f"__all__ lists {n!r} ({_foreign(n, getattr(mod, n))})")
    for n in dir(mod):
        # ('@py_builtins', '@pytest_ar': pytest's assertion rewriter adds these to the modules
        # of a distribution with a pytest plugin, as ctrainstate is; they are no identifiers)
        if n.startswith(("_", "@")):
            continue
        why = _foreign(n, getattr(mod, n, None))
        if why:
            out.append(f"dir() shows {n!r} ({why})")
    return out


MODULES = _public_modules()


def test_public_modules_are_walked():
    for name in ("ctrainstate", "ctrainstate.numpy", "ctrainstate.random", "ctrainstate.sharding",
                 "ctrainstate.tree_util", "ctrainstate.nn", "ctrainstate.optim",
                 "ctrainstate.train_state", "ctrainstate.t5x", "ctrainstate.hf",
                 "ctrainstate.serialization", "ctrainstate.struct", "ctrainstate.lax",
                 "ctrainstate.debug", "ctrainstate.config", "ctrainstate.partitioning",
                 "ctrainstate.experimental.pjit", "ctrainstate.nn.partitioning"):
        assert name in MODULES, name
    assert not any("._" in m for m in MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_public_module_exports_only_its_api(name):
    problems = _problems(name)
    assert not problems, f"{name}: " + "; ".join(problems)


def test_exports_check_can_fail():
    fake = types.ModuleType("ctrainstate.fake")
    import re
    from typing import Any
    fake.re, fake.Any, fake.ok = re, Any, 1
    fake.__all__ = ["ok", "Any"]
    sys.modules["ctrainstate.fake"] = fake
    try:
        problems = _problems("ctrainstate.fake")
    finally:
        del sys.modules["ctrainstate.fake"]
    assert problems == ["__all__ lists 'Any' (typing.Any)", "dir() shows 'Any' (typing.Any)",
                        "dir() shows 're' (module re)"]
