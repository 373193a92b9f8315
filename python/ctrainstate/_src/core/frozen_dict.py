"""The implementation of :mod:`ctrainstate.core` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

from typing import Any, Mapping

from ..nn.scope import DenyList
from ..base.tree_util import DictKey, _sorted_keys, register_pytree_with_keys, tree_map

__all__ = ["FrozenDict", "freeze", "unfreeze", "copy", "pop", "pretty_repr", "DenyList"]


def _frozen(v):
    return FrozenDict(v) if isinstance(v, dict) and not isinstance(v, FrozenDict) else v


class FrozenDictImmutableError(TypeError, ValueError):
    """Raised by an attempt to change a FrozenDict: a ``ValueError`` as Flax's
    ``FrozenDict.__setitem__`` raises, and a ``TypeError`` as a dict's read-only views do."""


class FrozenDict(dict):
    """An immutable mapping (flax.core.FrozenDict)."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        for k, v in dict(*args, **kwargs).items():
            dict.__setitem__(self, k, _frozen(v))
        self._hash = None

    def _immutable(self, *args, **kwargs):
        raise FrozenDictImmutableError("FrozenDict is immutable: use .copy({...}) or unfreeze(...)")

    __setitem__ = __delitem__ = _immutable
    clear = popitem = setdefault = update = __ior__ = _immutable

    def __hash__(self):
        if self._hash is None:
            self._hash = hash(tuple((k, self[k]) for k in sorted(self, key=repr)))
        return self._hash

    def __repr__(self):
        return pretty_repr(self)

    def __reduce__(self):
        return FrozenDict, (unfreeze(self),)

    def copy(self, add_or_replace: Mapping = None) -> "FrozenDict":
        """A new FrozenDict with ``add_or_replace``'s entries added or replaced."""
        return FrozenDict({**self, **(add_or_replace or {})})

    def pop(self, key):
        """``(FrozenDict without key, its value)``."""
        value = self[key]
        return FrozenDict({k: v for k, v in self.items() if k != key}), value

    def unfreeze(self) -> dict:
        return unfreeze(self)

    def pretty_repr(self, num_spaces: int = 4) -> str:
        return pretty_repr(self, num_spaces)


def _flatten(d):
    keys = sorted(d)
    return [(DictKey(k), dict.__getitem__(d, k)) for k in keys], tuple(keys)


def _unflatten(keys, children):
    out = FrozenDict.__new__(FrozenDict)
    dict.__init__(out, zip(keys, children))
    out._hash = None
    return out


register_pytree_with_keys(FrozenDict, _flatten, _unflatten)


def freeze(xs: Mapping) -> FrozenDict:
    """``xs`` as a FrozenDict (nested dicts frozen too)."""
    return FrozenDict(xs)


def unfreeze(x) -> Any:
    """Plain nested dicts for a FrozenDict or dict (a copy of the dict structure; a
    FrozenDict's keys come out sorted, as Flax's ``unfreeze`` copies it with tree_map)."""
    if isinstance(x, FrozenDict):   # Flax: tree_map(lambda y: y, x._dict), keys sorted
        return {k: _thaw(dict.__getitem__(x, k)) for k in _sorted_keys(x)}
    if isinstance(x, dict):
        return {k: unfreeze(v) for k, v in x.items()}
    return x


def _thaw(v):
    """A FrozenDict's value as Flax's unfreeze copies it: its dict levels as dicts with sorted
    keys, anything else copied as a pytree (a FrozenDict inside a list stays one)."""
    if isinstance(v, dict):
        return {k: _thaw(v[k]) for k in _sorted_keys(v)}
    return tree_map(lambda y: y, v) if isinstance(v, (list, tuple)) else v


def _tree_copy(x):
    """A copy of ``x``'s pytree structure (dict keys sorted, FrozenDicts kept), as Flax's
    ``copy`` / ``pop`` of a dict make it with ``jax.tree_util.tree_map(lambda x: x, x)``."""
    new = tree_map(lambda v: v, x)
    return new if isinstance(new, dict) else dict(new)   # another Mapping: a dict copy


def copy(x: Mapping, add_or_replace: Mapping = None):
    """``x`` with entries added or replaced: a FrozenDict stays frozen, a dict stays a dict."""
    if isinstance(x, FrozenDict):
        return x.copy(add_or_replace)
    new = _tree_copy(x)
    new.update(add_or_replace or {})
    return new


def pop(x: Mapping, key):
    """``(x without key, x[key])``, keeping x's kind (FrozenDict or dict)."""
    if isinstance(x, FrozenDict):
        return x.pop(key)
    d = _tree_copy(x)
    value = d.pop(key)
    return d, value


def pretty_repr(x: Any, num_spaces: int = 4) -> str:
    """An indented multi-line repr of nested dicts (Flax's format): inside a FrozenDict every
    level prints as a dict; inside a plain dict a FrozenDict prints as ``FrozenDict({...})``
    and other mappings as their repr, as in Flax."""
    frozen = isinstance(x, FrozenDict)

    def rec(v):
        if not isinstance(v, dict) or (isinstance(v, FrozenDict) and not frozen):
            return repr(v)
        if not v:
            return "{}"
        # every line of an entry is indented, a leaf's multi-line repr too (Flax's _indent)
        pad = " " * num_spaces
        rep = "".join(f"{k}: {rec(val)},\n" for k, val in v.items())
        return "{\n" + "".join(pad + line + "\n" for line in rep.split("\n")[:-1]) + "}"
    if frozen:
        return f"FrozenDict({rec(x)})"
    return rec(x)


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
