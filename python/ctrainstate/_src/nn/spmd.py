"""The implementation of :mod:`ctrainstate.nn.spmd` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations
from ..base.hooks import provide as _provide
_provide('nn.spmd', __name__)   # lower layers call into this module through _hooks.upper

import contextlib
import enum
import functools
import threading
from typing import Any, Callable, Sequence

import numpy as np

from ... import _C
from ..base import tree_util
from ..base.threadlocal import NotifyingLocal
from ..array.sharding import (NamedSharding, PartitionSpec, _replicate_uneven, _uneven_dims)  # noqa: F401
from . import meta
from ..ops.ops import with_sharding, _put
from ..array.array import Array, device_put
from ..array.sharding import get_mesh
from ..base.hooks import upper as _upper
from ..base.trace_state import _jit_tls     # (in_jit(), read inline in _constrain_to)

_C._rules_set_unconstrained(PartitionSpec.UNCONSTRAINED)

LogicalRules = Sequence[tuple]

__all__ = [
    'LogicalRules', 'logical_axis_rules', 'set_logical_axis_rules', 'get_logical_axis_rules',
    'logical_to_mesh_axes', 'logical_to_mesh', 'logical_to_mesh_sharding', 'RulesFallback',
    'with_logical_constraint', 'LogicallyPartitioned', 'with_logical_partitioning',
]


class _UnassignedAxis:
    """Private sentinel for a dimension no rule assigned (falsy, compared by identity)."""

    def __repr__(self):
        return 'UnassignedAxis'

    def __bool__(self):
        return False


_unassigned_axis = _UnassignedAxis()

# --- rules context -----------------------------------------------------------

class _StrictState(NotifyingLocal):
    """This thread's strict rules: the rules object an ``axis_rules(..., strict=True)``
    installed (strict while it is the active rules object), and the path of the variable
    being declared, for the error."""

    rules = None
    where = None


_strict = _StrictState()


def logical_axis_rules(rules: LogicalRules, strict: bool = False):
    """Context manager: ``rules`` are this thread's logical axis rules inside the block.

    Nesting replaces (the inner rules alone are visible) and the previous rules come back
    on exit, also on an exception; ``with ... as x`` gives ``None``. By default a logical
    name that matches no rule is replicated, as Flax does. With ``strict=True`` such a name
    raises a ``ValueError`` naming the parameter (or constraint) and the name, wherever
    these rules resolve names, so a typo in a rule table or an annotation cannot shard
    nothing silently. Strictness belongs to these rules: a nested ``axis_rules(other)``
    is not strict unless it says so. (A default context is the C type
    ``ctrainstate._C.axis_rules``.)

    >>> from ctrainstate.nn import logical_axis_rules, logical_to_mesh_axes
    >>> with logical_axis_rules((('batch', 'data'),)):
    ...     logical_to_mesh_axes(('batch', 'embd'))
    PartitionSpec('data', None)
    >>> with logical_axis_rules((('batch', 'data'),), strict=True):
    ...     logical_to_mesh_axes(('batch', 'embd'))
    Traceback (most recent call last):
    ...
    ValueError: logical axis name 'embd' of ('batch', 'embd') matches no rule of axis_rules(..., strict=True) (rules for: 'batch'); add ('embd', None) to replicate it on purpose
    """
    if not strict:
        return _C.axis_rules(rules)
    return _StrictAxisRules(rules)


class _StrictAxisRules:
    """``axis_rules(rules, strict=True)``: the C context for the rules, plus this thread's
    strict marker; re-entrant like the C context (each ``__enter__`` saves what it replaces)."""

    __slots__ = ('_rules', '_contexts', '_saved')

    def __init__(self, rules):
        self._rules = rules
        self._contexts = []
        self._saved = []

    def __enter__(self):
        ctx = _C.axis_rules(self._rules)
        ctx.__enter__()
        self._contexts.append(ctx)
        self._saved.append(_strict.rules)
        _strict.rules = self._rules
        return None

    def __exit__(self, *exc):
        _strict.rules = self._saved.pop()
        self._contexts.pop().__exit__(*exc)
        return False

    def __repr__(self):
        return f'axis_rules({self._rules!r}, strict=True)'


def _is_strict(rules) -> bool:
    """Whether names resolved against ``rules`` (None: the context's) must all match a rule."""
    strict = _strict.rules
    if strict is None:
        return False
    return (_C.get_axis_rules() if rules is None else rules) is strict


def _check_strict(array_dim_names, rules) -> None:
    """In strict mode, raise for a logical name no rule mentions (after the resolver
    accepted the rules, so a malformed table is reported as such first)."""
    rules = _C.get_axis_rules() if rules is None else rules
    known = {r[0] for r in rules}
    for name in array_dim_names:
        if isinstance(name, str) and name not in known:
            where = _strict.where
            head = f'{where}: ' if where else ''
            listed = ', '.join(repr(n) for n in dict.fromkeys(r[0] for r in rules))
            raise ValueError(f'{head}logical axis name {name!r} of {tuple(array_dim_names)!r} '
                             f'matches no rule of axis_rules(..., strict=True) (rules for: '
                             f'{listed}); add ({name!r}, None) to replicate it on purpose')


def _declaring(where: str):
    """A context naming the variable being declared in a strict-rules error raised inside
    it (nothing to do, and nothing done, while no strict rules are installed)."""
    if _strict.rules is None:
        return contextlib.nullcontext()
    return _declaring_variable(where)


@contextlib.contextmanager
def _declaring_variable(where: str):
    saved = _strict.where
    _strict.where = where
    try:
        yield
    finally:
        _strict.where = saved


def set_logical_axis_rules(rules: LogicalRules) -> None:
    """Set this thread's logical axis rules (stored as given, no validation).

    >>> from ctrainstate.nn import set_logical_axis_rules, get_logical_axis_rules
    >>> set_logical_axis_rules((('batch', 'data'),))
    >>> get_logical_axis_rules()
    (('batch', 'data'),)
    >>> set_logical_axis_rules(())
    """
    _C.set_axis_rules(rules)


def get_logical_axis_rules() -> LogicalRules:
    """Return this thread's logical axis rules; ``()`` in a thread that never set any.

    >>> import threading
    >>> from ctrainstate.nn import get_logical_axis_rules
    >>> seen = []
    >>> t = threading.Thread(target=lambda: seen.append(get_logical_axis_rules()))
    >>> t.start(); t.join(); seen
    [()]
    """
    return _C.get_axis_rules()


# --- resolution --------------------------------------------------------------

def _check_dim_names(array_dim_names, who: str):
    """``array_dim_names`` (None or a sequence of names, one per dimension) as a tuple or
    list the resolver and the strict check can both read."""
    if array_dim_names is None or isinstance(array_dim_names, (tuple, list)):
        return array_dim_names
    if isinstance(array_dim_names, str):
        raise TypeError(f'{who}: array_dim_names must be a sequence of logical axis names, one '
                        f'per dimension, not the string {array_dim_names!r}; for a 1-d array '
                        f'write ({array_dim_names!r},)')
    if isinstance(array_dim_names, dict) or not hasattr(array_dim_names, '__iter__'):
        raise TypeError(f'{who}: array_dim_names must be a sequence of logical axis names (a '
                        f'tuple, list or PartitionSpec, one entry per dimension) or None, got '
                        f'{type(array_dim_names).__name__} {array_dim_names!r}')
    return tuple(array_dim_names)


def _logical_to_mesh_axes(array_dim_names, rules=None):
    """Raw resolution: a list with ``_unassigned_axis`` where no rule applied."""
    array_dim_names = _check_dim_names(array_dim_names, 'with_logical_constraint')
    result = _C.resolve_logical_axes(array_dim_names, rules, _unassigned_axis)
    if result is not None and _is_strict(rules):
        _check_strict(array_dim_names, rules)
    return result


def logical_to_mesh_axes(array_dim_names: Sequence[Any] | None,
                         rules: LogicalRules | None = None) -> PartitionSpec | None:
    """Resolve a tuple of logical axis names to a mesh ``PartitionSpec``.

    ``rules`` defaults to the thread's context rules. ``None`` names give ``None``.
    A logical name used twice raises ``ValueError``; so does a rules object that
    is not a tuple or list.

    >>> from ctrainstate.nn import logical_to_mesh_axes
    >>> rules = (('batch', 'X'), ('features', 'X'), ('heads', 'Y'), ('batch', 'Z'))
    >>> logical_to_mesh_axes(('batch', 'length', 'heads', 'features'), rules)
    PartitionSpec('X', None, 'Y', None)
    >>> logical_to_mesh_axes(('a', 'a'), rules)
    Traceback (most recent call last):
    ...
    ValueError: Unsupported: Dimensions ('a',) occur more than once in array names.
    >>> logical_to_mesh_axes(3, rules)
    Traceback (most recent call last):
    ...
    TypeError: logical_to_mesh_axes: array_dim_names must be a sequence of logical axis names (a tuple, list or PartitionSpec, one entry per dimension) or None, got int 3
    """
    array_dim_names = _check_dim_names(array_dim_names, 'logical_to_mesh_axes')
    result = _C.resolve_logical_axes(array_dim_names, rules, None)
    if result is None:
        return None
    if _is_strict(rules):
        _check_strict(array_dim_names, rules)
    return PartitionSpec(*result)


def _is_partition_spec(x):
    return isinstance(x, PartitionSpec)


def logical_to_mesh(tree: Any, rules: LogicalRules | None = None) -> Any:
    """Apply :func:`logical_to_mesh_axes` to every ``PartitionSpec`` leaf of a pytree.

    Plain tuples are containers, not specs: pass ``PartitionSpec`` leaves.

    >>> from ctrainstate.nn import logical_to_mesh
    >>> from ctrainstate.sharding import PartitionSpec as P
    >>> logical_to_mesh({'w': P('embed', 'mlp'), 'b': None}, (('mlp', 'model'),))
    {'b': None, 'w': PartitionSpec(None, 'model')}
    """
    return tree_util.tree_map(lambda x: logical_to_mesh_axes(x, rules), tree,
                              is_leaf=_is_partition_spec)


def logical_to_mesh_sharding(tree: Any, mesh, rules: LogicalRules | None = None) -> Any:
    """Resolve a pytree of logical ``PartitionSpec``\\ s into ``NamedSharding``\\ s on ``mesh``.

    >>> import numpy as np
    >>> from ctrainstate.nn import logical_to_mesh_sharding
    >>> from ctrainstate.sharding import Mesh, PartitionSpec as P
    >>> from ctrainstate import devices
    >>> mesh = Mesh(np.array(devices()[:1]).reshape(1, 1), ('data', 'model'))
    >>> s = logical_to_mesh_sharding({'w': P('embed', 'mlp')}, mesh, (('mlp', 'model'),))
    >>> s['w'].spec
    PartitionSpec(None, 'model')
    """
    return tree_util.tree_map(lambda x: NamedSharding(mesh, x), logical_to_mesh(tree, rules),
                              is_leaf=_is_partition_spec)


class RulesFallback(enum.Enum):
    """What a logical constraint does when some name matches no rule.

    ``AXIS_IS_UNSHARDED`` (default): the dimension is replicated.
    ``RAISE_ERROR``: ``ValueError('Axis names ... did not match a rule')``.
    ``NO_CONSTRAINT``: the whole constraint is skipped.

    >>> from ctrainstate.nn import RulesFallback
    >>> RulesFallback('raise_error')
    <RulesFallback.RAISE_ERROR: 'raise_error'>
    """

    AXIS_IS_UNSHARDED = 'axis_is_unsharded'
    RAISE_ERROR = 'raise_error'
    NO_CONSTRAINT = 'no_constraint'


# --- constraints ---------------------------------------------------------------

def _with_sharding_constraint(x, axis_resources, mesh=None):
    """Apply a mesh-axis constraint: reshard an Array onto ``NamedSharding(mesh, spec)``.

    The mesh is ``mesh`` or the active ``with Mesh(...):`` context. Without a mesh,
    or for values that are not ctrainstate Arrays (numpy arrays, Python scalars),
    this is a documented no-op that returns ``x``. A ``None`` spec means fully
    replicated; an ``UNCONSTRAINED`` entry keeps that dimension's current split
    (when ``x`` already lives on the same mesh) or leaves it unsplit. ``x`` may be
    a pytree: every Array leaf is constrained. Kept as a separate function so
    tests can mock it.
    """
    if mesh is None:
        mesh = get_mesh()
    if mesh is None:
        return x
    if isinstance(x, Array):
        return _constrain_array(x, axis_resources, mesh)
    return tree_util.tree_map(
        lambda leaf: _constrain_array(leaf, axis_resources, mesh) if isinstance(leaf, Array) else leaf,
        x)


def _constrain_array(x, axis_resources, mesh):
    spec = PartitionSpec() if axis_resources is None else axis_resources
    if PartitionSpec.UNCONSTRAINED in spec:   # (compared by identity: it defines no __eq__)
        cur = x.sharding
        cur_spec = tuple(cur.spec) if isinstance(cur, NamedSharding) and cur.mesh == mesh else ()
        # an unconstrained dimension keeps its current split, less the mesh axes the
        # constrained dimensions take (as jax: P('model', None) constrained to
        # (UNCONSTRAINED, 'model') becomes P(None, 'model'))
        taken = {a for e in spec if e is not PartitionSpec.UNCONSTRAINED and e is not None
                 for a in ((e,) if isinstance(e, str) else e)}

        def keep(i):
            e = cur_spec[i] if i < len(cur_spec) else None
            if e is None:
                return None
            left = tuple(a for a in ((e,) if isinstance(e, str) else e) if a not in taken)
            return left if left else None
        spec = PartitionSpec(*[keep(i) if e is PartitionSpec.UNCONSTRAINED else e
                               for i, e in enumerate(spec)])
    return _constrain_to(x, _named_sharding(mesh, spec))


def _constrain_to(x, sharding):
    """An Array ``x`` constrained to the NamedSharding ``sharding`` (less the dimensions its
    mesh axes do not divide, under jit): ``x`` itself when it is placed so already."""
    target = _replicate_uneven(sharding, x.shape) if _jit_tls.depth > 0 else sharding  # in_jit()
    cur = x.sharding
    if cur is target or cur == target:
        return x
    if x.dtype == np.float32:
        return with_sharding(x, target)
    return _put(x, target)   # (device_put; under a jit trace an op node of the program)


# NamedSharding(mesh, spec) per (mesh, spec): a constraint inside a model resolves to the same
# few shardings at every call, and a NamedSharding validates its layout when it is made. Keyed
# on the mesh's identity (the entry keeps the mesh, so the id is not reused while it is in the
# table) and the spec's value; a spec or mesh that is refused raises and is not stored. Bounded:
# a full table is cleared. Holds no Array.
_SHARDINGS: dict = {}
_SHARDINGS_MAX = 1024


def _named_sharding(mesh, spec):
    try:
        entry = _SHARDINGS.get((id(mesh), spec))
    except TypeError:   # an unhashable entry in the spec: made every time
        return NamedSharding(mesh, spec)
    if entry is not None and entry[0] is mesh:
        return entry[1]
    sharding = NamedSharding(mesh, spec)
    if len(_SHARDINGS) >= _SHARDINGS_MAX:
        _SHARDINGS.clear()
    _SHARDINGS[(id(mesh), spec)] = (mesh, sharding)
    return sharding


def _with_sharding_constraint_one_fallback(axis_resources, x, fallback=RulesFallback.AXIS_IS_UNSHARDED,
                                           rules=None, mesh=None):
    if rules is not None and _strict.rules is None:
        spec = _resolved_spec(axis_resources, fallback, rules)
        if spec is _NO_CONSTRAINT:
            return x
        return _with_sharding_constraint(x, spec, mesh=mesh)
    return _with_sharding_constraint_one_fallback_uncached(axis_resources, x, fallback, rules, mesh)


# The mesh-axis spec per (logical spec, rules, fallback), as _with_sharding_constraint_one_fallback
# resolves it (_NO_CONSTRAINT: the constraint is skipped); for rules given by value and no strict
# rules installed (a strict error names the variable being declared). A resolution that raises
# is not stored. Bounded: a full table is cleared.
_RESOLVED: dict = {}
_RESOLVED_MAX = 4096
_NO_CONSTRAINT = object()


def _resolved_spec(axis_resources, fallback, rules):
    try:
        key = (axis_resources, rules, fallback)
        spec = _RESOLVED.get(key, _RESOLVED)
    except TypeError:   # unhashable rules or spec
        return _resolve_one(axis_resources, fallback, rules)
    if spec is _RESOLVED:
        spec = _resolve_one(axis_resources, fallback, rules)
        if len(_RESOLVED) >= _RESOLVED_MAX:
            _RESOLVED.clear()
        _RESOLVED[key] = spec
    return spec


def _resolve_one(axis_resources, fallback, rules):
    """The spec _with_sharding_constraint_one_fallback_uncached constrains to: a PartitionSpec,
    None (replicated) or _NO_CONSTRAINT."""
    mesh_axes = _logical_to_mesh_axes(axis_resources, rules)
    if mesh_axes is None:
        return None
    if fallback == RulesFallback.AXIS_IS_UNSHARDED:
        mesh_axes = [None if a is _unassigned_axis else a for a in mesh_axes]
    elif any(a is _unassigned_axis for a in mesh_axes):
        if fallback == RulesFallback.RAISE_ERROR:
            raise ValueError(f'Axis names {axis_resources} did not match a rule')
        return _NO_CONSTRAINT
    return PartitionSpec(*mesh_axes)


def _with_sharding_constraint_one_fallback_uncached(axis_resources, x, fallback, rules, mesh):
    mesh_axes = _logical_to_mesh_axes(axis_resources, rules)
    if mesh_axes is None:
        return _with_sharding_constraint(x, None, mesh=mesh)
    if fallback == RulesFallback.AXIS_IS_UNSHARDED:
        mesh_axes = [None if a is _unassigned_axis else a for a in mesh_axes]
    elif any(a is _unassigned_axis for a in mesh_axes):
        if fallback == RulesFallback.RAISE_ERROR:
            raise ValueError(f'Axis names {axis_resources} did not match a rule')
        return x
    return _with_sharding_constraint(x, PartitionSpec(*mesh_axes), mesh=mesh)


def _is_axis_spec(x):
    return isinstance(x, str) or x is PartitionSpec.UNCONSTRAINED or x is None


def _is_logical_spec(x):
    return x is None or (isinstance(x, tuple) and all(_is_axis_spec(e) for e in x))


# What a logical constraint of an Array does, per (logical spec, rules, fallback, mesh): the
# NamedSharding it constrains to (before _replicate_uneven, which depends on the shape and on
# jit), None when it leaves the value as it is (no mesh, or the NO_CONSTRAINT fallback), or
# _LONG_PATH when the spec keeps an UNCONSTRAINED dimension (its target depends on the value's
# current sharding). Everything these depend on is in the key: the spec and rules by value
# (the resolution is a pure function of them, see _RESOLVED), the fallback (the default one
# as a sentinel: the enum hashes in Python), the mesh by identity (the entry keeps the mesh,
# so its id is not reused while the entry is stored; a mesh is immutable). Filled only for
# logical specs (a tuple of names / None / UNCONSTRAINED) while no strict rules are installed
# (their error names the variable being declared); a resolution or sharding that raises is
# not stored, so it raises again. Holds no Array. Bounded: a full table is cleared.
_TARGETS: dict = {}
_TARGETS_MAX = 4096
_LONG_PATH = object()
_DEFAULT_FALLBACK = object()
# Per constraint target (by id; the entry keeps it, so the id is not reused while stored):
# (target, the shardings of constrained Arrays found equal to it that are not the same object,
# newest first, at most _SEEN_EQUAL_PER), e.g. an op's output sharding, a SingleDeviceSharding
# or a spec naming size-1 mesh axes. The C hit path (py_rules.c, LogicalConstraint) reads it. An op's output sharding is one
# object per placement (ops._SHARDINGS), so a model's activations meet the same one at every
# call; shardings are immutable, so the comparison's answer holds. Bounded: a full table is
# cleared.
_SEEN_EQUAL: dict = {}
_SEEN_EQUAL_MAX = 1024
_SEEN_EQUAL_PER = 8


def _constraint_target(logical, rules, fallback, mesh):
    """The target of _TARGETS for these (computed on a miss; ``_LONG_PATH`` when the key is
    unhashable, e.g. rules in lists)."""
    fb = _DEFAULT_FALLBACK if fallback is RulesFallback.AXIS_IS_UNSHARDED else fallback
    key = (logical, rules, fb, id(mesh))
    try:
        entry = _TARGETS.get(key)
    except TypeError:
        return _LONG_PATH
    if entry is not None and entry[0] is mesh:
        return entry[1]
    spec = _resolved_spec(logical, fallback, rules)
    if spec is _NO_CONSTRAINT or mesh is None:
        target = None
    else:
        spec = PartitionSpec() if spec is None else spec
        if PartitionSpec.UNCONSTRAINED in spec:
            target = _LONG_PATH
        else:
            target = _named_sharding(mesh, spec)
    if len(_TARGETS) >= _TARGETS_MAX:
        _TARGETS.clear()
    _TARGETS[key] = (mesh, target)
    return target


def with_logical_constraint(x: Any, logical_axis_resources: Any, rules: LogicalRules | None = None,
                            mesh=None, fallback: RulesFallback = RulesFallback.AXIS_IS_UNSHARDED):
    """Constrain ``x`` to the sharding its logical axis names resolve to.

    A no-op (returning ``x`` unvalidated) when the rules are empty or the spec is
    ``None``. Otherwise each logical spec leaf (a tuple of names, or ``None``) is
    resolved, resolution errors raise, the fallback applies, and the matching
    sub-tree of ``x`` goes through the mesh-axis constraint: with an active mesh
    (or ``mesh=``) a ctrainstate ``Array`` is resharded; numpy arrays and the
    no-mesh case are returned unchanged.

    >>> import numpy as np
    >>> from ctrainstate.nn import with_logical_constraint
    >>> x = np.zeros((4, 2))
    >>> with_logical_constraint(x, ('batch', 'embed'), rules=(('batch', 'data'),)) is x
    True
    """
    if rules is None:
        rules = _C.get_axis_rules()    # get_logical_axis_rules()
    if not rules or logical_axis_resources is None:
        return x
    if isinstance(x, Array) and _strict.rules is None:
        # one Array, one spec (a model's activations): what the long way below does, through
        # the per-(spec, rules, fallback, mesh) target (_TARGETS, looked up here first)
        m = get_mesh() if mesh is None else mesh
        try:
            entry = _TARGETS.get((logical_axis_resources, rules, _DEFAULT_FALLBACK
                                  if fallback is RulesFallback.AXIS_IS_UNSHARDED else fallback,
                                  id(m)))
        except TypeError:   # an unhashable spec or rules: the long way
            entry = None
        if entry is not None and entry[0] is m:
            target = entry[1]     # (only a logical spec is stored, see _constraint_target)
        elif _is_logical_spec(logical_axis_resources):
            target = _constraint_target(logical_axis_resources, rules, fallback, m)
        else:
            target = _LONG_PATH
        if target is None:
            return x
        if target is not _LONG_PATH:
            if _jit_tls.depth <= 0:
                # _constrain_to(x, target) outside jit where x is placed so already (its
                # first return; NamedSharding.__eq__'s same-mesh case inline)
                cur = x.sharding
                if cur is target:
                    return x
                seen = _SEEN_EQUAL.get(id(target))
                if seen is not None and seen[0] is target:
                    for s in seen[1]:
                        if s is cur:
                            return x      # found equal before (shardings are immutable)
                if (type(cur) is NamedSharding and cur.mesh is target.mesh
                        and cur._norm == target._norm) or cur == target:
                    if len(_SEEN_EQUAL) >= _SEEN_EQUAL_MAX:
                        _SEEN_EQUAL.clear()
                    prev = seen[1] if seen is not None and seen[0] is target else ()
                    _SEEN_EQUAL[id(target)] = (target, (cur,) + prev[:_SEEN_EQUAL_PER - 1])
                    return x
            return _constrain_to(x, target)
    if _is_logical_spec(logical_axis_resources):
        # one spec for the whole of x (the common case): what the prefix map below does for
        # a spec leaf at the root, without the map
        return _with_sharding_constraint_one_fallback(logical_axis_resources, x,
                                                      fallback=fallback, rules=rules, mesh=mesh)
    fn = functools.partial(_with_sharding_constraint_one_fallback, fallback=fallback, rules=rules,
                           mesh=mesh)
    return _tree_map_prefix(fn, logical_axis_resources, x, _is_logical_spec)



def _c_hit_path(fn):
    """``fn`` (with_logical_constraint) as a ``_C.LogicalConstraint``: a call ``(x, spec)``
    that the fast path above would answer with ``x`` (its target found in _TARGETS, ``x``
    placed so already) is answered in C without entering the Python function; every other
    call runs ``fn``. The object carries ``fn``'s name, docstring and signature."""
    c = _C.LogicalConstraint(fn)
    for attr in ('__module__', '__name__', '__qualname__', '__doc__'):
        setattr(c, attr, getattr(fn, attr))
    c.__wrapped__ = fn
    return c


_C.constraint_setup(_TARGETS, _SEEN_EQUAL, _DEFAULT_FALLBACK, _LONG_PATH, _strict, _jit_tls, Array)
with_logical_constraint = _c_hit_path(with_logical_constraint)

def _tree_map_prefix(fn, prefix_tree, tree, is_leaf):
    """Map ``fn(prefix_leaf, subtree)`` where ``prefix_tree`` is a pytree prefix of ``tree``."""
    return tree_util.tree_map(fn, prefix_tree, tree, is_leaf=is_leaf)


# --- logical boxes -----------------------------------------------------------------

class LogicallyPartitioned(meta.Partitioned):
    """A ``Partitioned`` box whose ``names`` are logical axis names.

    ``get_partition_spec()`` gives the logical spec; :func:`logical_to_mesh` or
    :func:`logical_to_mesh_sharding` map it onto the mesh. ``unbox()`` applies a
    logical constraint when a mesh is active or ``mesh`` is set.

    >>> import numpy as np
    >>> from ctrainstate.nn import LogicallyPartitioned
    >>> box = LogicallyPartitioned(np.zeros((2, 3)), ('embed', 'mlp'), rules=(('mlp', 'model'),))
    >>> box.get_partition_spec()
    PartitionSpec('embed', 'mlp')
    """

    def __init__(self, value, names, mesh=None, rules=None):
        super().__init__(value, names, mesh)
        object.__setattr__(self, 'rules', rules)

    def _fields(self):
        return dict(value=self.value, names=self.names, mesh=self.mesh, rules=self.rules)

    def __eq__(self, other):
        if self is other:
            return True
        if other.__class__ is self.__class__:
            return (self.value,) == (other.value,)
        return NotImplemented

    __hash__ = None

    def __repr__(self):
        return (f'LogicallyPartitioned(value={self.value!r}, names={self.names!r}, '
                f'mesh={self.mesh!r}, rules={self.rules!r})')

    def unbox(self, apply_constraint=True):
        """Return the value, constrained to the resolved spec when a mesh is in reach."""
        if apply_constraint and (get_mesh() is not None or self.mesh is not None):
            return with_logical_constraint(self.value, self.get_partition_spec(), rules=self.rules,
                                           mesh=self.mesh)
        return self.value


tree_util.register_pytree_with_keys(   # key path '.value', as Flax's struct has it
    LogicallyPartitioned,
    lambda b: (((tree_util.GetAttrKey("value"), b.value),), (b.names, b.mesh, b.rules)),
    lambda aux, children: LogicallyPartitioned(children[0], aux[0], mesh=aux[1], rules=aux[2]),
)


def with_logical_partitioning(fn: Callable[..., Any], names, mesh=None, rules=None
                              ) -> Callable[..., LogicallyPartitioned]:
    """Wrap an initializer so its result is boxed in :class:`LogicallyPartitioned`.

    >>> import numpy as np
    >>> from ctrainstate.nn import with_logical_partitioning
    >>> init = with_logical_partitioning(lambda key, shape: np.ones(shape), ('embed', 'mlp'))
    >>> init(None, (2, 3)).names
    ('embed', 'mlp')
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_strict(rules):   # a typo is reported at init, with or without a mesh
            logical_to_mesh_axes(tuple(names), rules)
        m = mesh if mesh is not None else get_mesh()
        init = fn
        if m is not None and 'out_sharding' not in kwargs:  # born sharded
            spec = logical_to_mesh_axes(tuple(names), rules)
            if spec is not None and all(e is not PartitionSpec.UNCONSTRAINED for e in spec):
                sharded_initializer = _upper('nn.module').sharded_initializer
                init = sharded_initializer(fn, NamedSharding(m, spec))
        return LogicallyPartitioned(init(*args, **kwargs), names, mesh=mesh, rules=rules)

    def born():
        m = mesh if mesh is not None else get_mesh()
        if m is None:
            return None
        spec = logical_to_mesh_axes(tuple(names), rules)
        if spec is None or any(e is PartitionSpec.UNCONSTRAINED for e in spec):
            return None
        return NamedSharding(m, spec)

    # (unboxed init, boxing, born sharding): see meta.with_partitioning
    wrapper._ct_boxing = (fn, lambda v: LogicallyPartitioned(v, names, mesh=mesh, rules=rules),
                          born)
    return wrapper


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
