"""State dicts (mirror of ``flax.serialization.to_state_dict`` / ``from_state_dict``).

A state dict is nested plain dicts with string keys: dicts keep their keys,
tuples and lists become ``{'0': ..., '1': ...}``, NamedTuples ``{field: ...}``
and ctrainstate structs (``PyTreeNode``) ``{data field: ...}``. Anything else —
Arrays, numbers, ``PartitionSpec`` — is a leaf.

>>> from ctrainstate.t5x.serialization import to_state_dict, from_state_dict
>>> sd = to_state_dict({'opt': (1, {'mu': 2})})
>>> sd
{'opt': {'0': 1, '1': {'mu': 2}}}
>>> from_state_dict({'opt': (0, {'mu': 0})}, sd)
{'opt': (1, {'mu': 2})}
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..sharding import PartitionSpec

__all__ = ['to_state_dict', 'from_state_dict', 'flatten_dict', 'unflatten_dict']


def _is_struct(x) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and hasattr(x, '_ct_struct')


def _struct_fields(x):
    return [f.name for f in dataclasses.fields(x) if f.metadata.get('pytree_node', True)]


def _is_leaf(x) -> bool:
    return isinstance(x, PartitionSpec) or not (
        isinstance(x, (dict, list, tuple)) or _is_struct(x))


def to_state_dict(x: Any) -> Any:
    """``x`` as nested dicts with string keys (leaves unchanged)."""
    if _is_leaf(x):
        return x
    if isinstance(x, dict):
        return {str(k): to_state_dict(v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(type(x), '_fields'):
        return {f: to_state_dict(getattr(x, f)) for f in type(x)._fields}
    if isinstance(x, (list, tuple)):
        return {str(i): to_state_dict(v) for i, v in enumerate(x)}
    return {n: to_state_dict(getattr(x, n)) for n in _struct_fields(x)}


def _has_leaves(x) -> bool:
    if _is_leaf(x):
        return x is not None
    if isinstance(x, dict):
        return any(_has_leaves(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_has_leaves(v) for v in x)
    return any(_has_leaves(getattr(x, n)) for n in _struct_fields(x))


def from_state_dict(target: Any, state: Any, name: str = '.') -> Any:
    """Rebuild ``target``'s structure with the leaves of ``state``.

    A key missing from ``state`` is allowed only where ``target`` holds no leaves (empty
    optimizer states); otherwise ``ValueError`` names the path.
    """
    if _is_leaf(target):
        return state
    if not isinstance(state, dict):
        raise ValueError(f'state dict at {name} is a {type(state).__name__}, the target a '
                         f'{type(target).__name__}')

    def get(key, sub):
        if key in state:
            return from_state_dict(sub, state[key], f'{name}/{key}' if name != '.' else key)
        if not _has_leaves(sub):
            return sub
        raise ValueError(f'state dict has no entry {key!r} at {name}')

    if isinstance(target, dict):
        extra = set(state) - {str(k) for k in target}
        if extra:
            raise ValueError(f'state dict has unexpected keys {sorted(extra)} at {name}')
        return type(target)((k, get(str(k), v)) for k, v in target.items())
    if isinstance(target, tuple) and hasattr(type(target), '_fields'):
        return type(target)(*[get(f, getattr(target, f)) for f in type(target)._fields])
    if isinstance(target, (list, tuple)):
        return type(target)(get(str(i), v) for i, v in enumerate(target))
    return target.replace(**{n: get(n, getattr(target, n)) for n in _struct_fields(target)})


def flatten_dict(d: dict, sep: str | None = None, keep_empty_nodes: bool = False) -> dict:
    """``{path: leaf}`` with tuple paths, or ``sep``-joined ones (flax.traverse_util.flatten_dict)."""
    out = {}

    def rec(x, path):
        if isinstance(x, dict) and not isinstance(x, PartitionSpec):
            if not x and keep_empty_nodes and path:
                out[path] = {}
            for k, v in x.items():
                rec(v, path + (k,))
        else:
            out[path] = x
    rec(d, ())
    if sep is not None:
        return {sep.join(map(str, k)): v for k, v in out.items()}
    return out


def unflatten_dict(flat: dict, sep: str | None = None) -> dict:
    """Inverse of :func:`flatten_dict`."""
    out: dict = {}
    for k, v in flat.items():
        path = tuple(k.split(sep)) if sep is not None else k
        d = out
        for p in path[:-1]:
            d = d.setdefault(p, {})
        d[path[-1]] = v
    return out
