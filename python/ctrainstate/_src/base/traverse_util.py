"""The implementation of :mod:`ctrainstate.traverse_util` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

from typing import Any, Callable, Mapping

__all__ = ["flatten_dict", "unflatten_dict", "path_aware_map", "empty_node",
           "ModelParamTraversal"]


class _EmptyNode:
    """Stands for an empty sub-dict in ``flatten_dict(..., keep_empty_nodes=True)``."""

    def __repr__(self):
        return "empty_node"


empty_node = _EmptyNode()


def flatten_dict(xs: Mapping, keep_empty_nodes: bool = False,
                 is_leaf: Callable[[tuple, Any], bool] | None = None, sep: str | None = None):
    """``{path: leaf}`` of a nested dict, with tuple paths or ``sep``-joined ones.

    An empty sub-dict vanishes, or becomes ``empty_node`` with ``keep_empty_nodes``;
    ``is_leaf(path, value)`` stops the descent at a sub-dict.
    """
    if not isinstance(xs, Mapping):
        raise TypeError(f"expected a (nested) dict, got {type(xs).__name__}")
    out: dict = {}

    def key(path):
        return sep.join(path) if sep is not None else path

    def rec(x, path):
        leaf = not isinstance(x, Mapping) or (is_leaf is not None and is_leaf(path, x))
        if leaf:
            out[key(path)] = x
            return
        if not x:
            if keep_empty_nodes and path:
                out[key(path)] = empty_node
            return
        for k, v in x.items():
            rec(v, path + (k,))
    rec(xs, ())
    return out


def unflatten_dict(xs: Mapping, sep: str | None = None) -> dict:
    """The nested dict of a ``flatten_dict`` result (``empty_node`` becomes ``{}``)."""
    out: dict = {}
    for path, v in xs.items():
        if sep is not None:
            path = tuple(path.split(sep))
        d = out
        for p in path[:-1]:
            d = d.setdefault(p, {})
        d[path[-1]] = {} if v is empty_node else v
    return out


def path_aware_map(f: Callable[[tuple, Any], Any], nested_dict: Mapping) -> dict:
    """``f(path, leaf)`` for every leaf of a nested dict, same structure (e.g. an optax label
    tree from parameter paths)."""
    flat = flatten_dict(nested_dict, keep_empty_nodes=True)
    return unflatten_dict({k: f(k, v) if v is not empty_node else v for k, v in flat.items()})


class ModelParamTraversal:
    """Selects the params of a nested dict whose path (``'/module/sub/kernel'``) and value
    pass ``filter_fn(path, value)`` (flax.traverse_util.ModelParamTraversal).

    >>> from ctrainstate.traverse_util import ModelParamTraversal
    >>> kernels = ModelParamTraversal(lambda path, _: 'kernel' in path)
    >>> params = {'dense': {'kernel': 1, 'bias': 2}}
    >>> list(kernels.iterate(params)), kernels.update(lambda x: x * 10, params)
    ([1], {'dense': {'kernel': 10, 'bias': 2}})
    """

    def __init__(self, filter_fn: Callable[[str, Any], bool]):
        self.filter_fn = filter_fn

    def _selected(self, params):
        if not isinstance(params, Mapping):
            raise ValueError(f"ModelParamTraversal traverses a nested dict, not "
                             f"{type(params).__name__}")
        flat = flatten_dict(params, keep_empty_nodes=True)
        return flat, {k for k, v in flat.items() if v is not empty_node and
                      self.filter_fn('/' + '/'.join(map(str, k)), v)}

    def paths(self, params) -> list:
        """The '/'-joined paths (no leading '/') of the params the filter selects."""
        flat, sel = self._selected(params)
        return ['/'.join(map(str, k)) for k in flat if k in sel]

    def iterate(self, inputs):
        """The selected values, in the order of their sorted paths (as flax)."""
        flat, sel = self._selected(inputs)
        for k in sorted(sel):
            yield flat[k]

    def update(self, fn, inputs) -> dict:
        """``inputs`` with ``fn`` applied to the selected values."""
        flat, sel = self._selected(inputs)
        return unflatten_dict({k: fn(v) if k in sel else v for k, v in flat.items()})



from .exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
