"""Logical partitioning API (mirror of ``flax.linen.partitioning``).

Ported t5x / HuggingFace scripts change only the import::

    from ctrainstate import partitioning as nn_partitioning

Version profile: current Flax (0.12.3+) resolution semantics, the ≥0.6.8
``with_sharding_constraint(x, axes, rules=None, mesh=None, fallback=...)``
signature, and ``variable_with_axes(axes=())`` recording empty metadata (≥0.6.2).
One deliberate difference: ``param_with_axes`` / ``variable_with_axes`` raise a
``ValueError`` naming the parameter path, its shape and the axes when a non-empty
tuple of axes does not match the value's rank (Flax stays silent until JAX fails);
``axes=()`` means replicated on a value of any rank, as in Flax.

>>> import numpy as np
>>> from ctrainstate import partitioning as nn_partitioning
>>> from ctrainstate.nn.scope import Scope
>>> rules = (('embed', None), ('mlp', 'model'))
>>> scope = Scope(rngs={'params': lambda: 0}, mutable=True)
>>> with nn_partitioning.axis_rules(rules), scope:
...     w = nn_partitioning.param_with_axes('wi', lambda k, s: np.zeros(s), (4, 8),
...                                         axes=('embed', 'mlp'))
>>> axes = nn_partitioning.get_axis_names(scope.variables()['params_axes'])
>>> from ctrainstate.sharding import PartitionSpec
>>> axes == {'wi': PartitionSpec('embed', 'mlp')}
True
>>> dict(nn_partitioning.logical_to_mesh(axes, rules))
{'wi': PartitionSpec(None, 'model')}
"""
from __future__ import annotations
from ._src.base.hooks import provide as _provide
_provide('partitioning', __name__)   # lower layers call into this module through _hooks.upper

# Non-API names are imported under private aliases: this module's public names are
# exactly its __all__ (the API of flax.linen.partitioning).
import re as _re
import typing as _typing

import numpy as _np

from ._src.base import tree_util as _tree_util
from .core import FrozenDict as _FrozenDict
from ._src.nn import spmd as _spmd
from ._src.nn.scope import Variable as _Variable
from ._src.nn.scope import Scope as _Scope
from ._src.nn.scope import _plain_fn_key, _plain_value
from . import _C as _C
from ._src.nn.module import Module as _Module
from ._src.array.array import Array as _Array
from ._src.nn.scope import ScopeVariableNotFoundError as _ScopeVariableNotFoundError
from ._src.nn.scope import current_scope as _current_scope
from ._src.nn.spmd import (LogicalRules, RulesFallback, logical_to_mesh, logical_to_mesh_axes,
                           logical_to_mesh_sharding, _is_logical_spec)
from ._src.array.sharding import PartitionSpec as _PartitionSpec
from ._src.base.trace_state import in_jit as _in_jit
from ._src.base.trace_state import _jit_tls
from ._src.nn.module import current_module as _current_module
from ._src.nn.module import _ctx as _module_ctx
from ._src.nn.module import sharded_initializer as _sharded_initializer
from ._src.array.sharding import NamedSharding as _NamedSharding, get_mesh as _get_mesh
from ._src.array import sharding as _sharding

axis_rules = _spmd.logical_axis_rules
set_axis_rules = _spmd.set_logical_axis_rules
get_axis_rules = _spmd.get_logical_axis_rules
with_sharding_constraint = _spmd.with_logical_constraint

__all__ = [
    'LogicalRules', 'axis_rules', 'set_axis_rules', 'get_axis_rules', 'logical_to_mesh_axes',
    'logical_to_mesh', 'logical_to_mesh_sharding', 'RulesFallback', 'with_sharding_constraint',
    'AxisMetadata', 'param_with_axes', 'variable_with_axes', 'get_axis_names',
    'PartitionedVariable', 'scan_with_axes', 'vmap_with_axes', 'remat', 'core_remat_static',
    'ScanIn', 'ScanOut',
]


class AxisMetadata:
    """Logical axis names of one variable, sown into ``<collection>_axes``.

    Frozen; a pytree node with no leaves (``names`` is static), equal when the
    names are equal. Distinct from :class:`ctrainstate.nn.meta.AxisMetadata`.

    >>> from ctrainstate.partitioning import AxisMetadata
    >>> AxisMetadata(names=('embed', 'mlp'))
    AxisMetadata(names=('embed', 'mlp'))
    >>> from ctrainstate import tree_util
    >>> tree_util.tree_leaves({'w_axes': AxisMetadata(('a',))})
    []
    """

    __slots__ = ('names',)

    def __init__(self, names):
        object.__setattr__(self, 'names', names)

    def __setattr__(self, name, value):
        raise AttributeError(f"cannot assign to field '{name}'")

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self.names == other.names

    def __hash__(self):
        return hash((AxisMetadata, self.names))

    def __repr__(self):
        return f'AxisMetadata(names={self.names!r})'

    def replace(self, **updates):
        return AxisMetadata(updates.get('names', self.names))


_tree_util.register_pytree_node(
    AxisMetadata,
    lambda m: ((), m.names),
    lambda names, children: AxisMetadata(names),
)


def _param_with_axes_sow_reduce_fn(x, y):
    """Sow reduction for axis metadata: first value wins; a second must be equal."""
    if not isinstance(y, AxisMetadata):
        raise TypeError('Expected newly sown value to be an AxisMetadata')
    if isinstance(x, AxisMetadata):
        if x != y:
            raise ValueError('If axis names are sown twice, expected them to match. '
                             f'Got {x} and {y}.')
    elif x:
        raise ValueError(f'Non-initial-or-AxisMetadata value encountered: {x}')
    return y


def _resolve_module(module):
    if module is None:
        module = _current_module()
    if module is None:
        module = _current_scope()
        if module is None:
            raise ValueError('param_with_axes/variable_with_axes need a module or scope: call them '
                             'inside a module method or a `with scope:` block, or pass module=.')
    return module


def _path_of(module) -> tuple:
    path = getattr(module, 'path', None)
    if path is None:
        path = getattr(getattr(module, 'scope', None), 'path', ())
    return tuple(path)


def _check_spec_rank(where: str, spec, shape) -> None:
    """Raise if a non-empty logical spec's length differs from the rank of ``shape``.

    ``None`` names nothing and ``()`` means replicated (Flax stores ``names=()``), so
    neither is checked against the rank.
    """
    if spec is None or len(spec) == 0:
        return
    if len(spec) != len(shape):
        raise ValueError(f'Logical axes {tuple(spec)} of "{where}" do not match its rank: '
                         f'shape {tuple(shape)} has {len(shape)} dimension(s), the axes name '
                         f'{len(spec)}.')


def _check_born_shape(where: str, axes, sharding, shape) -> None:
    """A parameter born with ``sharding`` (resolved from ``axes``) fits it: its rank is
    the axes' and, outside ``jit`` (where such a dimension is replicated instead), its mesh
    axes divide their dimensions."""
    _check_spec_rank(where, axes, shape)
    if _in_jit():
        return
    for i, mesh_axes, parts in _spmd._uneven_dims(sharding, shape):
        raise ValueError(
            f'parameter "{where}" of shape {tuple(shape)}: dimension {i} (logical axis '
            f'{axes[i]!r}) of size {shape[i]} is not divisible by mesh axes {mesh_axes} '
            f'({parts} devices); under jit / pjit that dimension is replicated, or map '
            f'{axes[i]!r} to another mesh axis (or None) in the rules')


def _check_rank(module, name, value, axes):
    """Raise if a logical spec in ``axes`` does not fit the rank of the value it annotates."""
    where = '/'.join(_path_of(module) + (name,))

    def check(spec, sub):
        shape = getattr(sub, 'shape', None)
        _check_spec_rank(where, spec, _np.shape(sub) if shape is None else shape)
        return sub

    try:
        _spmd._tree_map_prefix(check, axes, value, _is_logical_spec)
    except ValueError:
        raise
    except Exception as e:  # structure mismatch between the axes pytree and the value
        raise ValueError(f'Logical axes {axes!r} of "{where}" do not match the structure of '
                         f'its value: {e}') from None


def param_with_axes(name: str, init_fn: _typing.Callable[..., _typing.Any], *init_args,
                    axes=None, module=None, **init_kwargs):
    """Declare a parameter and record its logical axes in ``params_axes``.

    Calls ``module.param(name, init_fn, *init_args, **init_kwargs)`` (``module``
    defaults to the current scope). With ``axes`` given, the value gets a logical
    sharding constraint and ``AxisMetadata(names=axes)`` is sown into
    ``'params_axes'`` under ``f'{name}_axes'``. ``axes=()`` means replicated, on a
    value of any rank; a non-empty tuple whose length is not the value's rank
    raises ``ValueError``. Under ``with mesh, axis_rules(rules):`` the value is born
    sharded as the axes resolve.

    >>> import numpy as np
    >>> from ctrainstate.partitioning import param_with_axes
    >>> from ctrainstate.nn.scope import Scope
    >>> s = Scope(rngs={'params': lambda: 0}, mutable=True)
    >>> _ = param_with_axes('w', lambda k, shape: np.ones(shape), (2, 3), axes=('a', 'b'), module=s)
    >>> s.variables()['params_axes']
    {'w_axes': AxisMetadata(names=('a', 'b'))}
    """
    if module is None:
        if type(axes) is tuple and _strict.rules is None and not init_kwargs:
            # the hit path of an existing parameter's declaration, in C (see _CHECKED and
            # py_rules.c's param_hit); _NO_KEY where the path below must run
            value = _param_hit(name, init_fn, init_args, axes)
            if value is not _NO_KEY:
                return value
        stack = _module_ctx.stack    # _current_module(), inline
        module = stack[-1][0] if stack else _resolve_module(None)
    key = _NO_KEY
    if type(axes) is tuple and _strict.rules is None:
        # The hit path: a declaration of an existing parameter found in _CHECKED is done
        # here, less the checks it passed before (see _CHECKED); what it reads and calls is
        # inline where the classes keep the base methods (_plain_class).
        if isinstance(module, _Module):
            plain = _PLAIN_CLASSES.get(type(module))
            if plain is None:
                plain = _plain_class(type(module), _Module, _MODULE_METHODS)
            scope = module._scope if plain else None
        else:
            scope = module
        plain = _PLAIN_CLASSES.get(type(scope))
        if plain is None:
            plain = isinstance(scope, _Scope) and _plain_class(type(scope), _Scope, _SCOPE_METHODS)
        if plain:
            # scope._collection('params', create=False)
            d = scope._variables.get('params')
            for p in scope.path:
                if d is None:
                    break
                d = d.get(p)
            if d is not None and name in d:
                value = d[name]
                tv = type(value)
                if tv is _Array or tv is _np.ndarray:
                    mesh = _get_mesh()
                    key = _checked_key(init_fn, init_args, init_kwargs, axes, value, mesh)
                    try:
                        entry = _CHECKED.get(key)
                    except TypeError:        # unhashable axes or rules
                        key = entry = None
                    if entry is not None and entry[0] is mesh:
                        return _checked_declaration(module, scope, name, axes, value, tv, entry)
                    if key is None:
                        key = _NO_KEY
    where = '/'.join(_path_of(module) + (name,))
    with _spmd._declaring(f'parameter {where!r}'):
        sharding = _born_sharding(axes)
        init = init_fn
        if sharding is not None:
            # rank and divisibility are checked before the sharded value is laid out, so a
            # wrong one is reported with the parameter's path rather than by the layout
            init = _sharded_initializer(
                init_fn, sharding,
                check_shape=lambda shape: _check_born_shape(where, axes, sharding, shape))
        value = module.param(name, init, *init_args, **init_kwargs)
        if axes is not None:
            _check_rank(module, name, value, axes)
            value = with_sharding_constraint(value, _PartitionSpec(*axes))
            module.sow('params_axes', f'{name}_axes', AxisMetadata(axes),
                       reduce_fn=_param_with_axes_sow_reduce_fn)
    if key is not _NO_KEY:
        # an existing parameter passed every check above: the same declaration of a value
        # of the same shape, under the same rules and mesh, passes them again
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        rules, mesh = key[4], _get_mesh()
        spec = _PartitionSpec(*axes)
        try:
            target = _spmd._constraint_target(spec, rules, RulesFallback.AXIS_IS_UNSHARDED,
                                              mesh) if rules else None
        except (TypeError, ValueError):
            return value    # (a constraint the value's type skipped and an Array would not)
        _CHECKED[key] = [mesh, spec, target, ()]
    return value



def _c_hit_path(fn):
    """``fn`` (param_with_axes) as a ``_C.ParamWithAxes``: its hit path (a declaration found
    in _CHECKED, what ``_param_hit`` answers) runs in C without entering the Python function;
    every other call runs ``fn``. The object carries ``fn``'s name, docstring and signature."""
    c = _C.ParamWithAxes(fn)
    for attr in ('__module__', '__name__', '__qualname__', '__doc__'):
        setattr(c, attr, getattr(fn, attr))
    c.__wrapped__ = fn
    return c

# The declarations of existing parameters that passed param_with_axes' checks (the born
# sharding's resolution, the shape the initializer would make, the axes' rank), keyed by
# everything those checks read: the initializer (its code and plain closed-over values, see
# scope._plain_fn_key), its arguments, the axes, the active rules (by value), the active
# mesh (by identity: the entry keeps the mesh, so the id is not reused while it is stored),
# whether a jit trace is active, and the value's shape. `model.apply` declares the same
# parameters at every call; a declaration found here skips the pure checks and still does
# what has effects or depends on the module's state (the declaration rule, the name's
# reservation, the sharding constraint, the sow where 'params_axes' is mutable). An entry is
# [mesh, PartitionSpec(*axes), the constraint's target (spmd._constraint_target's, a pure
# function of the key), the sharding objects last seen equal to that target (a tuple, the
# newest first, at most _SEEN_MAX: the parameters of repeated layers share a key, each with
# its own sharding object)]: a parameter's Array keeps its sharding object, so at the next
# call `value.sharding` being one of entry[3] says what the comparison would (shardings are immutable; the target, less the dimensions jit
# replicates, is fixed by the key's shape and jit flag). Holds no Array; strict rules, boxed
# or non-array values, other initializers take the full path. Bounded: a full table is
# cleared.
_CHECKED: dict = {}
_CHECKED_MAX = 4096
_SEEN_MAX = 32
_get_axis_rules = _C.get_axis_rules     # spmd.get_logical_axis_rules, one call less
_strict = _spmd._strict                 # (the thread-local object itself: fixed)
_NO_KEY = object()
_param_hit = _C.param_hit


_SCOPE_METHODS = ('param', 'reserve', 'sow', '_collection', 'is_mutable_collection',
                  'has_variable', 'get_variable')
_MODULE_METHODS = ('param', 'sow', '_check_declaring')
_PLAIN_CLASSES: dict = {}
_C.param_hit_setup(_module_ctx, _PLAIN_CLASSES, _Module, _CHECKED, _get_mesh, _jit_tls, _Array,
                   _NO_KEY, _spmd._LONG_PATH, _sharding._mesh_tls, _sharding._UNSET, _strict)
param_with_axes = _c_hit_path(param_with_axes)


def _plain_class(cls, base, methods) -> bool:
    """Whether ``cls`` keeps ``base``'s ``methods`` (which the shortcut stands for). (A
    class's methods are taken as fixed once it is used: a method patched onto a class
    afterwards is not seen.)"""
    plain = _PLAIN_CLASSES.get(cls)
    if plain is None:
        plain = _PLAIN_CLASSES[cls] = all(getattr(cls, m) is getattr(base, m) for m in methods)
    return plain


def _checked_key(init_fn, init_args, init_kwargs, axes, value, mesh):
    """The key of a param_with_axes declaration in ``_CHECKED`` (see there) under ``mesh``
    (the active one), or ``_NO_KEY`` where its initializer or arguments have none (not plain
    values)."""
    try:
        for a in init_args:   # _plain_value(init_args): the args themselves where they are
            ta = type(a)      # ints and tuples of ints (a shape)
            if ta is tuple:
                for e in a:
                    if type(e) is not int:
                        break
                else:
                    continue
            elif ta is int:
                continue
            init_args = _plain_value(init_args, 0)
            break
        return (_plain_fn_key(init_fn), init_args,
                tuple(sorted((k, _plain_value(v, 0)) for k, v in init_kwargs.items()))
                if init_kwargs else (),
                axes, _get_axis_rules(), id(mesh), _jit_tls.depth > 0, value.shape)
    except (TypeError, ValueError):
        return _NO_KEY


def _checked_declaration(module, scope, name, axes, value, tv, entry):
    """What param_with_axes does for the existing parameter ``value`` (of type ``tv``, an
    Array or an ndarray) of a declaration found in ``_CHECKED`` (its ``entry``), less the
    checks it passed before."""
    if scope is not module and not module._in_setup:
        for f in _module_ctx.stack:      # module._check_declaring('Parameters'), inline
            if f[1] and f[0] is module:  # (f.compact, f.module)
                break
        else:
            module._check_declaring('Parameters')   # raises
    reserved = scope._reserved      # scope.reserve(name, 'params') where it cannot raise
    rkey = ('params', name)
    if type(name) is str and rkey not in reserved and name not in reserved \
            and name not in scope._children:
        reserved.add(rkey)
    else:
        scope.reserve(name, 'params')
    target = entry[2]   # with_sharding_constraint(value, PartitionSpec(*axes)), resolved before
    if target is not None:
        if tv is _Array and target is not _spmd._LONG_PATH:
            cur = value.sharding
            for seen in entry[3]:
                if seen is cur:
                    break
            else:
                out = _spmd._constrain_to(value, target)
                if out is value:         # equal to the target (see _CHECKED)
                    entry[3] = (cur,) + entry[3][:_SEEN_MAX - 1]
                value = out
        else:
            value = with_sharding_constraint(value, entry[1])
    if scope.mutable is not False and scope.is_mutable_collection('params_axes'):
        module.sow('params_axes', f'{name}_axes', AxisMetadata(axes),
                   reduce_fn=_param_with_axes_sow_reduce_fn)
    return value


def _born_sharding(axes):
    """The NamedSharding a parameter with logical ``axes`` is created with: under an active
    mesh, the axes resolved through the active rules; otherwise None (default placement)."""
    mesh = _get_mesh()
    if mesh is None or axes is None or not _is_logical_spec(axes):
        return None
    spec = logical_to_mesh_axes(tuple(axes))
    if spec is None or any(e is _PartitionSpec.UNCONSTRAINED for e in spec):
        return None
    return _NamedSharding(mesh, spec)


class PartitionedVariable(_Variable):
    """A variable that re-applies its logical constraint on every read and write.

    >>> import numpy as np
    >>> from ctrainstate.partitioning import variable_with_axes
    >>> from ctrainstate.nn.scope import Scope
    >>> v = variable_with_axes('stats', 'mean', np.zeros, (3,), axes=('embed',), module=Scope(mutable=True))
    >>> v.value = v.value + 1
    >>> v.value
    array([1., 1., 1.])
    """

    def __init__(self, scope, collection: str, name: str, axes=None,
                 fallback: RulesFallback = RulesFallback.AXIS_IS_UNSHARDED):
        super().__init__(scope, collection, name, unbox=False)
        self.axes = axes
        self.fallback = fallback

    @property
    def value(self):
        value = self.scope.get_variable(self.collection, self.name)
        if self.axes is not None:
            value = with_sharding_constraint(value, self.axes, fallback=self.fallback)
        return value

    @value.setter
    def value(self, value):
        if self.axes is not None:
            value = with_sharding_constraint(value, self.axes, fallback=self.fallback)
        self.scope.put_variable(self.collection, self.name, value)


def variable_with_axes(collection: str, name: str, init_fn: _typing.Callable[..., _typing.Any],
                       *init_args, axes=None, module=None,
                       fallback: RulesFallback = RulesFallback.AXIS_IS_UNSHARDED,
                       **init_kwargs) -> PartitionedVariable:
    """Declare a variable of ``collection`` and record its axes in ``<collection>_axes``.

    ``init_fn(*init_args, **init_kwargs)`` (no RNG) runs only when the variable is
    missing and the collection is mutable; otherwise a missing variable raises
    ``ScopeVariableNotFoundError``. With ``axes`` given, the value is constrained
    (with ``fallback``) and ``AxisMetadata(axes)`` is sown under ``f'{name}_axes'``.

    >>> import numpy as np
    >>> from ctrainstate.partitioning import variable_with_axes, get_axis_names
    >>> from ctrainstate.nn.scope import Scope
    >>> s = Scope(mutable=True)
    >>> _ = variable_with_axes('cache', 'k', np.zeros, (2, 4), axes=('batch', 'kv'), module=s)
    >>> dict(get_axis_names(s.variables()['cache_axes']))
    {'k': PartitionSpec('batch', 'kv')}
    """
    module = _resolve_module(module)
    scope = getattr(module, 'scope', module)
    with _spmd._declaring(f"variable {'/'.join(_path_of(module) + (collection, name))!r}"):
        return _variable_with_axes(module, scope, collection, name, init_fn, init_args,
                                   init_kwargs, axes, fallback)


def _variable_with_axes(module, scope, collection, name, init_fn, init_args, init_kwargs, axes,
                        fallback):
    scope.reserve(name, collection)
    if not scope.has_variable(collection, name):
        if not scope.is_mutable_collection(collection):
            raise _ScopeVariableNotFoundError(name, collection, scope.path_text)
        init_value = init_fn(*init_args, **init_kwargs)
        if axes is not None:
            _check_rank(module, name, init_value, axes)
            init_value = with_sharding_constraint(init_value, axes, fallback=fallback)
        scope.put_variable(collection, name, init_value)
    if axes is not None:
        module.sow(f'{collection}_axes', f'{name}_axes', AxisMetadata(axes),
                   reduce_fn=_param_with_axes_sow_reduce_fn)
    return PartitionedVariable(scope, collection, name, axes, fallback)


def _flatten_dict(d, prefix=()):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and not isinstance(v, AxisMetadata):
            out.update(_flatten_dict(v, prefix + (k,)))
        elif isinstance(v, dict):
            continue  # empty sub-dicts vanish, as in Flax
        else:
            out[prefix + (k,)] = v
    return out


def get_axis_names(axes_metadata) -> _FrozenDict:
    """Turn one ``*_axes`` collection into a tree of logical ``PartitionSpec``\\ s.

    Paths are joined with ``'/'``, a trailing ``_axes`` is removed, and every
    logical spec inside ``names`` becomes ``PartitionSpec(*names)`` (``None``
    stays ``None``). Returns a ``FrozenDict``, as Flax does (it compares equal to
    a plain dict with the same items).

    >>> from ctrainstate.partitioning import AxisMetadata, get_axis_names
    >>> from ctrainstate.sharding import PartitionSpec
    >>> names = get_axis_names({'mlp': {'wi_axes': AxisMetadata(('embed', 'mlp'))},
    ...                         'b_axes': AxisMetadata(())})
    >>> names == {'mlp': {'wi': PartitionSpec('embed', 'mlp')}, 'b': PartitionSpec()}
    True
    >>> type(names).__name__
    'FrozenDict'
    """

    def rewrite(names):
        return _tree_util.tree_map(lambda x: None if x is None else _PartitionSpec(*x), names,
                                  is_leaf=_is_logical_spec)

    if not hasattr(axes_metadata, 'keys'):
        raise TypeError(f"get_axis_names expects a mapping (a '*_axes' collection such as "
                        f"variables['params_axes']), got {type(axes_metadata).__name__}")
    flat = {}
    for k, v in _flatten_dict(dict(axes_metadata)).items():
        if not hasattr(v, 'names'):
            raise TypeError(f"get_axis_names: {'/'.join(map(str, k))!r} holds a "
                            f"{type(v).__name__} ({v!r}), not AxisMetadata")
        flat[_re.sub(r'_axes$', '', '/'.join(k))] = rewrite(v.names)
    out: dict = {}
    for path, v in flat.items():
        keys = path.split('/')
        d = out
        for key in keys[:-1]:
            d = d.setdefault(key, {})
        d[keys[-1]] = v
    return _FrozenDict(out)


from ._src.partitioning.lifted import (ScanIn, ScanOut, core_remat_static, remat, scan_with_axes,
                                       vmap_with_axes)


from ._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
