"""``dir()`` of a public module as its API: the names of its ``__all__`` and the
ctrainstate submodules it holds, not the modules and typing names its code imports (``np``,
``Any``, ``annotations``). Editors complete from ``dir()``; ``from m import *`` already
follows ``__all__``. The imported names stay importable attributes (``module.np``); only
the listing changes.

>>> import types
>>> m = types.ModuleType("ctrainstate.example")
>>> import sys; sys.modules[m.__name__] = m
>>> m.__all__, m.np, m.f = ["f"], __import__("numpy"), len
>>> module_dir(m.__name__)()[-1:]
['f']
>>> del sys.modules[m.__name__]
"""
from __future__ import annotations

import sys
import types

__all__ = ["module_dir"]


def module_dir(name: str):
    """A module-level ``__dir__`` for module ``name`` (assign it as ``__dir__``)."""
    def __dir__() -> list:
        mod = sys.modules[name]
        ns = vars(mod)
        names = set(ns.get("__all__", ()))
        names.update(n for n in ns if n.startswith("__") and n.endswith("__"))
        names.update(n for n, v in ns.items() if isinstance(v, types.ModuleType)
                     and v.__name__.startswith(name + ".") and not n.startswith("_"))
        return sorted(names)
    return __dir__
