"""The implementation of :mod:`ctrainstate.t5x.serialization` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Callable

from ..array.sharding import PartitionSpec
from ..base.tree_util import Partial

__all__ = ['to_state_dict', 'from_state_dict', 'flatten_dict', 'unflatten_dict',
           'register_serialization_state', 'is_serializable', 'current_path']

# type -> (to_state_dict(x), from_state_dict(target, state)): classes registered by the user
_REGISTRY: dict[type, tuple[Callable, Callable]] = {}
_path = threading.local()


def register_serialization_state(ty: type, ty_to_state_dict: Callable,
                                 ty_from_state_dict: Callable, override: bool = False) -> None:
    """Serialize instances of ``ty`` (exactly that type) with ``ty_to_state_dict(x) -> dict``
    and restore them with ``ty_from_state_dict(target, state) -> new instance``
    (flax.serialization.register_serialization_state). Those functions may call
    :func:`to_state_dict` / :func:`from_state_dict` on their members.

    >>> class Box:
    ...     def __init__(self, v): self.v = v
    >>> register_serialization_state(Box, lambda b: {'v': b.v}, lambda b, sd: Box(sd['v']))
    >>> to_state_dict({'b': Box(3)}), from_state_dict(Box(0), {'v': 5}).v
    ({'b': {'v': 3}}, 5)
    """
    if ty in _REGISTRY and not override:
        raise ValueError(f'a serialization handler for "{ty.__name__}" is already registered '
                         f'(pass override=True to replace it)')
    _REGISTRY[ty] = (ty_to_state_dict, ty_from_state_dict)


def is_serializable(target) -> bool:
    """Whether ``target`` (an instance or a type) was registered with
    :func:`register_serialization_state`."""
    return (target if isinstance(target, type) else type(target)) in _REGISTRY


def current_path() -> str:
    """The state-dict path being restored, for the error messages of a registered
    ``ty_from_state_dict`` (flax.serialization.current_path)."""
    stack = getattr(_path, 'stack', None)
    if not stack:
        return ''
    return stack[-1] if stack[-1].startswith('.') else './' + stack[-1]   # Flax's './a/b'


def _is_struct(x) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and hasattr(x, '_ct_struct')


def _struct_fields(x):
    return [f.name for f in dataclasses.fields(x) if f.metadata.get('pytree_node', True)]


def _is_leaf(x) -> bool:
    return isinstance(x, PartitionSpec) or not (
        isinstance(x, (dict, list, tuple)) or _is_struct(x))


def _register_partial():
    register_serialization_state(
        Partial, lambda x: {'args': to_state_dict(x.args), 'keywords': to_state_dict(x.keywords)},
        lambda x, sd: Partial(x.func, *from_state_dict(x.args, sd['args']),
                              **from_state_dict(x.keywords, sd['keywords'])))


def to_state_dict(x: Any) -> Any:
    """``x`` as nested dicts with string keys (leaves unchanged)."""
    if _REGISTRY and type(x) in _REGISTRY:
        return _REGISTRY[type(x)][0](x)
    if _is_leaf(x):
        return x
    if isinstance(x, dict):
        if len({str(k) for k in x}) != len(x):
            raise ValueError(f'Dict keys do not have a unique string representation: '
                             f'{list(x)!r} (a state dict has string keys)')
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
    optimizer states); otherwise ``ValueError`` names the path, as it does for entries
    ``target`` does not have (a longer list, other NamedTuple or struct fields).
    """
    if _REGISTRY and type(target) in _REGISTRY:
        stack = _path.__dict__.setdefault('stack', [])
        stack.append(name)
        try:
            return _REGISTRY[type(target)][1](target, state)
        finally:
            stack.pop()
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
        items = [(k, get(str(k), v)) for k, v in target.items()]
        if isinstance(target, collections.defaultdict):   # takes its factory first
            return type(target)(target.default_factory, items)
        return type(target)(items)
    if isinstance(target, tuple) and hasattr(type(target), '_fields'):
        if set(state) == {'name', 'fields', 'values'}:   # Flax's pre-2022 NamedTuple layout
            state = {state['fields'][str(i)]: state['values'][str(i)]
                     for i in range(len(state['fields']))}
        extra = set(state) - set(type(target)._fields)
        if extra:
            raise ValueError(f'The field names of the state dict and the named tuple do not '
                             f'match: the state dict has fields {sorted(extra)} that '
                             f'{type(target).__name__} {type(target)._fields} has not, at {name}')
        return type(target)(*[get(f, getattr(target, f)) for f in type(target)._fields])
    if isinstance(target, (list, tuple)):
        if set(state) - {str(i) for i in range(len(target))}:
            raise ValueError(f'The size of the {type(target).__name__} and the state dict do not '
                             f'match, got {len(target)} and {len(state)} (keys '
                             f'{sorted(state)}) at {name}')
        return type(target)(get(str(i), v) for i, v in enumerate(target))
    fields = _struct_fields(target)
    extra = set(state) - set(fields)
    if extra:
        raise ValueError(f'Unknown field(s) {sorted(extra)} in state dict while restoring an '
                         f'instance of {type(target).__name__} (its data fields: {fields}) '
                         f'at {name}')
    return target.replace(**{n: get(n, getattr(target, n)) for n in fields})


_register_partial()


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


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
