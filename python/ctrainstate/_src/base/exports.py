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

__all__ = ["module_dir", "forward_settings"]


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


def forward_settings(name: str, impl: types.ModuleType, settings) -> None:
    """Make the facade module ``name`` read and assign the module-level ``settings`` of its
    implementation ``impl`` (values the code reads at call time, such as flax's
    ``serialization.MAX_CHUNK_SIZE``): ``facade.X = v`` and ``monkeypatch.setattr(facade,
    "X", v)`` change what ``impl`` uses, as they did when the code lived in the facade.

    >>> m = types.ModuleType("ctrainstate.example2"); impl = types.ModuleType("impl")
    >>> sys.modules[m.__name__] = m; impl.LIMIT = 1
    >>> forward_settings(m.__name__, impl, ["LIMIT"])
    >>> m.LIMIT = 5; impl.LIMIT, m.LIMIT
    (5, 5)
    >>> del sys.modules[m.__name__]
    """
    mod = sys.modules[name]
    ns = {n: property(lambda self, n=n: getattr(impl, n),
                      lambda self, value, n=n: setattr(impl, n, value)) for n in settings}
    for n in settings:
        vars(mod).pop(n, None)
    mod.__class__ = type("FacadeModule", (type(mod),), ns)
