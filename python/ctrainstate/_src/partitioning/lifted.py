"""t5x/Flax's scan, vmap and remat helpers of ``flax.linen.partitioning``: ``scan_with_axes``,
``vmap_with_axes``, ``remat``, ``core_remat_static``, ``ScanIn``, ``ScanOut`` (re-exported by
:mod:`ctrainstate.partitioning`).

``scan_with_axes`` is ``nn.scan`` that also keeps the logical axis metadata of the scanned
collections right: the ``<col>_axes`` collections (sown by ``param_with_axes`` /
``variable_with_axes``) are broadcast, not scanned, and on the way out the scan's axis name
is inserted into every names tuple at the collection's scan axis; on the way in it is checked
and removed. Under ``with mesh, axis_rules(rules)`` the stacked values are then constrained to
the sharding their full names resolve to, so a scanned model's parameters are born sharded
with the layer axis (a rule such as ``('layers', None)`` keeps that axis whole). Each layer's
parameters are made sharded by their own axes, then stacked; a layer axis mapped onto a mesh
axis is resharded after stacking, so for that moment a device holds every layer of its block.

>>> import numpy as np
>>> from ctrainstate import nn, random
>>> from ctrainstate import partitioning as nn_partitioning
>>> class Layer(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         w = nn_partitioning.param_with_axes('w', nn.initializers.lecun_normal(), (4, 4),
...                                             axes=('embed', 'mlp'))
...         return x @ w, None
>>> Stack = nn_partitioning.scan_with_axes(Layer, variable_axes={'params': 0},
...                                        split_rngs={'params': True}, in_axes=(), length=3)
>>> v = Stack().init(random.PRNGKey(0), np.ones((2, 4), np.float32))
>>> v['params']['w'].shape, v['params_axes']['w_axes']
((3, 4, 4), AxisMetadata(names=('layers', 'embed', 'mlp')))
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

from ..base import tree_util
from ..nn import lifted as _lifted
from ..nn import transforms as _transforms
from ..nn.lifted import In as ScanIn, Out as ScanOut  # noqa: N814  (Flax's names)
from ..autodiff import remat as _remat
from ..nn.spmd import _is_logical_spec as f, with_logical_constraint
from ..base.hooks import upper as _upper

__all__ = ['scan_with_axes', 'vmap_with_axes', 'remat', 'core_remat_static', 'ScanIn',
           'ScanOut']


def _axis_metadata_cls():
    AxisMetadata = _upper('partitioning').AxisMetadata
    return AxisMetadata


def _tree_map_axes(fn, tree):
    """``fn`` over the (partitioning) AxisMetadata leaves of ``tree``; others kept."""
    cls = _axis_metadata_cls()
    return tree_util.tree_map(lambda x: fn(x) if isinstance(x, cls) else x, tree,
                              is_leaf=lambda x: isinstance(x, cls))


def _is_logical_spec(x):
    return f(x)


def _get_subtree(scope, col):
    return scope._collection(col, create=False)


def _set_subtree(scope, col, tree):
    """Put ``tree`` (or remove it, for ``None``) at ``scope``'s path of collection ``col``."""
    root, path = scope._variables, scope.path
    if not path:
        if tree is None:
            root.pop(col, None)
        else:
            root[col] = tree
        return
    d = root.get(col)
    if d is None:
        if tree is None:
            return
        d = root[col] = {}
    for p in path[:-1]:
        nxt = d.get(p)
        if nxt is None:
            if tree is None:
                return
            nxt = d[p] = {}
        d = nxt
    if tree is None:
        d.pop(path[-1], None)
    else:
        d[path[-1]] = tree


def _constrain_values(scope, col: str, axes_tree):
    """Constrain each value of ``col`` at ``scope`` to the logical names of its
    ``<name>_axes`` entry (the sharding that ``param_with_axes`` gives a new parameter)."""
    cls = _axis_metadata_cls()
    values = _get_subtree(scope, col)
    if values is None or not scope.is_mutable_collection(col):
        return

    def walk(axes, vals):
        for k, a in axes.items():
            if isinstance(a, cls):
                name = k[:-len('_axes')] if k.endswith('_axes') else k
                if name in vals and a.names is not None:
                    vals[name] = with_logical_constraint(vals[name], a.names)
            elif isinstance(a, dict) and isinstance(vals.get(k), dict):
                walk(a, vals[k])
    walk(axes_tree, values)


def _add_axis_to_metadata(target, axis_pos, axis_name: str, axis_col: str = 'params_axes'):
    """A subclass ``Map_variables<Name>`` of the lifted class ``target`` whose ``__call__``
    sees ``axis_col`` without ``axis_name`` at ``axis_pos`` and writes it back with it (Flax's
    ``_add_axis_to_metadata``, a ``map_variables``)."""
    partial = None
    if isinstance(target, functools.partial):
        partial, target = target, target.func
    if hasattr(axis_pos, 'axis'):  # ScanIn / ScanOut markers
        axis_pos = axis_pos.axis
    col = axis_col[:-len('_axes')] if axis_col.endswith('_axes') else None

    def insert_leaf(names):
        if names is None:
            return names
        names = list(names)
        names.insert(axis_pos, axis_name)
        return tuple(names)

    def remove_leaf(names):
        if names is None:
            return names
        names = list(names)
        if names[axis_pos] != axis_name:
            raise ValueError(f'Expected axis {axis_name} at position {axis_pos} in '
                             f'axis metadata {names}.')
        names.pop(axis_pos)
        return tuple(names)

    def insert_fn(x):
        return x.replace(names=tree_util.tree_map(insert_leaf, x.names, is_leaf=_is_logical_spec))

    def remove_fn(x):
        return x.replace(names=tree_util.tree_map(remove_leaf, x.names, is_leaf=_is_logical_spec))

    method = target.__call__

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        S = self._scope
        if S is None:
            return method(self, *args, **kwargs)  # raises the unbound error
        old = _get_subtree(S, axis_col)
        if old is not None:
            _set_subtree(S, axis_col, _tree_map_axes(remove_fn, _lifted._copy_dicts(old)))
        try:
            out = method(self, *args, **kwargs)
        except BaseException:
            _set_subtree(S, axis_col, old)
            raise
        new = _get_subtree(S, axis_col)
        if S.is_mutable_collection(axis_col) and new is not None:
            new = _tree_map_axes(insert_fn, new)
            _set_subtree(S, axis_col, new)
            if col is not None:
                _constrain_values(S, col, new)
        else:
            _set_subtree(S, axis_col, old)
        return out
    wrapped._ct_wrapped = True

    cls = type(f'Map_variables{target.__name__}', (target,),
               {'__module__': target.__module__, '__doc__': target.__doc__, '__call__': wrapped})
    if partial is not None:
        return functools.partial(cls, *partial.args, **partial.keywords)
    return cls


def scan_with_axes(target, variable_axes: Mapping = {}, variable_broadcast=False,
                   variable_carry=False, split_rngs: Mapping = {}, in_axes=0, out_axes=0,
                   length: int | None = None, reverse: bool = False, unroll: int = 1,
                   axis_name: str = 'layers', axes_collections: tuple = ('params',),
                   data_transform: Callable | None = None, methods=None):
    """``nn.scan`` that handles logical axis metadata (``flax.linen.partitioning.scan_with_axes``).

    The ``f'{col}_axes'`` collections of ``axes_collections`` are added to
    ``variable_broadcast``; for each ``col`` of ``axes_collections`` that ``variable_axes``
    scans, ``axis_name`` is inserted into its metadata at ``variable_axes[col]`` on the way out
    and checked and removed on the way in (``ValueError: Expected axis {axis_name} at position
    {pos} in axis metadata {names}.``). The class is named as Flax names it
    (``Map_variablesScan<Name>``, one ``Map_variables`` per such collection)."""
    axes_filters = tuple(f'{col}_axes' for col in axes_collections)
    broadcast = _lifted._Union(variable_broadcast, axes_filters)
    scanned = _lifted.scan(target, variable_axes=variable_axes, variable_broadcast=broadcast,
                           variable_carry=variable_carry, split_rngs=split_rngs, in_axes=in_axes,
                           out_axes=out_axes, length=length, reverse=reverse, unroll=unroll,
                           data_transform=data_transform, methods=methods)
    for col in axes_collections:
        if col in variable_axes:
            scanned = _add_axis_to_metadata(scanned, variable_axes[col], axis_name, f'{col}_axes')
    return scanned


def vmap_with_axes(target, variable_axes: Mapping, split_rngs: Mapping = {}, in_axes=0,
                   out_axes=0, axis_size: int | None = None, axis_name: str | None = None,
                   partitioning_axis_names: Mapping[Any, str] = {},
                   spmd_axis_name: str | None = None, methods=None):
    """``nn.vmap`` that handles logical axis metadata (``flax.linen.partitioning.vmap_with_axes``):
    each ``f'{col}_axes'`` of ``partitioning_axis_names`` is broadcast, and the mapped axis is
    named ``partitioning_axis_names[col]`` at position ``variable_axes[col]``.

    >>> import numpy as np
    >>> from ctrainstate import nn, random, partitioning
    >>> class Foo(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         w = partitioning.param_with_axes('w', nn.initializers.uniform(), (4, 3),
    ...                                          axes=('out', 'in'))
    ...         return w @ x
    >>> V = partitioning.vmap_with_axes(Foo, variable_axes={'params': 1},
    ...                                 split_rngs={'params': True},
    ...                                 partitioning_axis_names={'params': 'vmap_axis'})
    >>> v = V().init(random.PRNGKey(0), np.ones((2, 3), np.float32))
    >>> v['params']['w'].shape, v['params_axes']['w_axes']
    ((4, 2, 3), AxisMetadata(names=('out', 'vmap_axis', 'in')))
    """
    variable_axes = dict(variable_axes)
    for name in partitioning_axis_names:
        variable_axes[f'{name}_axes'] = None
    vmapped = _lifted.vmap(target, variable_axes=variable_axes, split_rngs=split_rngs,
                           in_axes=in_axes, out_axes=out_axes, axis_size=axis_size,
                           axis_name=axis_name, spmd_axis_name=spmd_axis_name, methods=methods)
    for col, axis in variable_axes.items():
        if col in partitioning_axis_names:
            vmapped = _add_axis_to_metadata(vmapped, axis, partitioning_axis_names[col],
                                            f'{col}_axes')
    return vmapped


def remat(target, variables=True, rngs=True, concrete: bool = False, prevent_cse: bool = True,
          static_argnums=(), policy=None, methods=None):
    """Flax's lifted remat with ``static_argnums`` (``flax.linen.partitioning.remat``): the
    class ``Core_remat_static<Name>``, rematerialised as :func:`ctrainstate.nn.remat` does it
    (nothing is traced, so ``static_argnums`` changes nothing but is checked)."""
    if concrete:
        raise NotImplementedError(
            'The concrete argument is deprecated. Use static_argnums instead. for more '
            'information, see https://docs.jax.dev/en/latest/jep/11830-new-remat-checkpoint.html')
    base = _transforms.remat(target, variables=variables, rngs=rngs, prevent_cse=prevent_cse,
                             static_argnums=static_argnums, policy=policy, methods=methods)
    return type(f'Core_remat_static{target.__name__}', (base,),
                {'__module__': target.__module__, '__doc__': target.__doc__})


def core_remat_static(fn, variables=True, rngs=True, concrete: bool = False,
                      prevent_cse: bool = True, static_argnums=(), policy=None):
    """The functional form: ``fn(scope, *args)`` rematerialised (see :func:`remat`); the
    scope tree's RNG counters are replayed when it runs again in the backward pass."""
    if concrete:
        raise NotImplementedError('The concrete argument is deprecated. Use static_argnums '
                                  'instead.')
    saves_all = _remat._check_policy(policy)
    _remat._check_static(static_argnums, 'core_remat_static')

    @functools.wraps(fn)
    def inner(scope, *args):
        if saves_all:
            return fn(scope, *args)
        before = _transforms._rng_counters(scope)

        def before_rerun():
            token = _transforms._rng_counters(scope)
            _transforms._set_counters(scope, before)
            return token

        def after_rerun(token):
            _transforms._set_counters(scope, token)

        return _remat.remat_call(lambda *a: fn(scope, *a), args, {}, before_rerun, after_rerun)
    return inner
