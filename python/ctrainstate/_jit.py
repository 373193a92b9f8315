"""``jit`` / ``pjit`` with sharding arguments (mirror of ``jax.jit`` and the legacy
``jax.experimental.pjit.pjit``), executed eagerly.

ctrainstate runs ops eagerly, so there is nothing to compile: the wrappers place
the inputs by ``in_shardings`` / ``in_axis_resources``, call the function (inside
the active mesh), and place the outputs by ``out_shardings`` /
``out_axis_resources``. Specs may be pytree prefixes of the arguments/outputs; a
``PartitionSpec`` resolves against the active mesh (``with mesh:``); a box
(``nn.Partitioned``) takes the spec of its value. Parameters created under
``with mesh, axis_rules(rules):`` are already born sharded, so placing them by
their own specs costs nothing; anything else is resharded device to device.
``donate_argnums`` is accepted for compatibility (``TrainState.apply_gradients``
already updates in place).

>>> import numpy as np, ctrainstate as cts
>>> from ctrainstate import P
>>> mesh = cts.make_mesh((1,), ('x',))
>>> with mesh:
...     y = cts.pjit(lambda a: a * 2.0, in_axis_resources=P('x'), out_axis_resources=P())(np.ones(4, np.float32))
>>> y.sharding.spec
PartitionSpec()
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from . import tree_util
from ._abstract import ShapeDtypeStruct
from ._trace_state import jit_scope
from .array import Array, device_put
from .sharding import NamedSharding, PartitionSpec, Sharding, get_mesh

__all__ = ["jit", "pjit"]


def _is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, (PartitionSpec, Sharding))


def _resolve(spec, *, none_means_replicated: bool, what: str):
    if isinstance(spec, Sharding):
        return spec
    if spec is None and not none_means_replicated:
        return None
    mesh = get_mesh()
    if mesh is None:
        raise RuntimeError(
            f"{what}: a PartitionSpec needs an active mesh: call inside `with mesh:` or pass "
            f"NamedSharding objects")
    return NamedSharding(mesh, PartitionSpec() if spec is None else spec)


def _place(spec_tree, tree, *, none_means_replicated: bool, what: str):
    if spec_tree is None and not none_means_replicated:
        return tree

    def put(spec, sub, prefix):
        s = _resolve(spec, none_means_replicated=none_means_replicated, what=what)
        if s is None:
            return sub

        def place(path, leaf):
            if not (isinstance(leaf, (Array, ShapeDtypeStruct)) or _is_array_like(leaf)):
                return leaf
            try:
                return device_put(leaf, s)
            except ValueError as e:   # name the value in a tree that does not fit its spec
                where = tree_util.keystr(prefix + tuple(path))
                if not where:
                    raise
                raise ValueError(f"{where} (shape {tuple(leaf.shape)}, spec {s.spec}): "
                                 f"{e}") from None
        return tree_util.tree_map_with_path(place, sub)

    s_items, s_td = tree_util.tree_flatten_with_path(spec_tree, is_leaf=_is_spec_leaf)
    try:   # only a structure mismatch is reported as one (a placement error is its own)
        subtrees = tree_util._flatten_up_to(s_td, tree)
    except ValueError as e:
        raise ValueError(f"{what}: the sharding tree does not match the values: {e}") from None
    out = []
    for (sp_path, sp), sub in zip(s_items, subtrees):
        try:
            out.append(put(sp, sub, tuple(sp_path)))
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    return tree_util.tree_unflatten(s_td, out)


def _is_array_like(x) -> bool:
    import numpy as np
    return isinstance(x, (np.ndarray, np.generic))


def _wrap(fun, in_specs, out_specs, static_argnums, none_means_replicated, names):
    static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums or ())

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        args = list(args)
        dyn = [i for i in range(len(args)) if i not in static]
        if in_specs is not None:
            specs = in_specs
            if type(specs) is not tuple:  # one spec (or prefix) for every argument
                specs = (specs,) * len(dyn)
            if len(specs) != len(dyn):
                if len(specs) == len(args):  # specs given for every argument (jax allows None for statics)
                    specs = tuple(s for i, s in enumerate(specs) if i not in static)
                else:
                    raise ValueError(
                        f"{names[0]}: {len(specs)} input shardings for {len(dyn)} non-static "
                        f"arguments")
            for i, spec in zip(dyn, specs):
                args[i] = _place(spec, args[i], none_means_replicated=none_means_replicated,
                                 what=names[0])
        with jit_scope():   # inside jit, a non-dividing sharding replicates that dimension
            out = fun(*args, **kwargs)
        if out_specs is not None:
            out = _place(out_specs, out, none_means_replicated=none_means_replicated, what=names[1])
        return out

    wrapped.lower = lambda *a, **k: wrapped  # `.lower(...).compile()` chains keep working
    wrapped.compile = lambda *a, **k: wrapped
    return wrapped


def jit(fun: Callable, in_shardings=None, out_shardings=None, static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = (), **unused) -> Callable:
    """``jax.jit`` with shardings: ``None`` leaves a value where it is."""
    return _wrap(fun, in_shardings, out_shardings, static_argnums, False,
                 ("jit in_shardings", "jit out_shardings"))


def pjit(fun: Callable, in_axis_resources=None, out_axis_resources=None,
         static_argnums: int | Sequence[int] = (), donate_argnums: int | Sequence[int] = (),
         in_shardings=None, out_shardings=None, **unused) -> Callable:
    """Legacy ``pjit``: PartitionSpecs against the active mesh; ``None`` means replicated."""
    ins = in_axis_resources if in_axis_resources is not None else in_shardings
    outs = out_axis_resources if out_axis_resources is not None else out_shardings
    return _wrap(fun, ins, outs, static_argnums, True, ("pjit in_axis_resources",
                                                          "pjit out_axis_resources"))
