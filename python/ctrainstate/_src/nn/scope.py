"""The implementation of :mod:`ctrainstate.nn.scope` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import numpy as np
import functools
import types
from typing import Any, Callable, Iterable

from numpy import dtype as _np_dtype

from . import meta
from ..array.abstract import abstract_mode
from ..base.tree_util import tree_leaves
from ..base.threadlocal import NotifyingLocal

__all__ = ['Scope', 'Variable', 'current_scope', 'ScopeVariableNotFoundError', 'NameInUseError',
           'ScopeParamShapeError',
           'DenyList', 'in_filter', 'union_filters', 'check_filter']


class DenyList:
    """Every collection except ``deny`` (a name, an iterable of names, or ``True`` for
    none at all): flax.core.DenyList. ``Module.init`` uses ``DenyList('intermediates')``
    by default, so values ``sow``-n into ``'intermediates'`` during init are not kept.

    >>> from ctrainstate.nn.scope import DenyList, in_filter
    >>> in_filter(DenyList('intermediates'), 'params'), in_filter(DenyList('intermediates'), 'intermediates')
    (True, False)
    """

    __slots__ = ('deny',)

    def __init__(self, deny):
        self.deny = deny

    def __eq__(self, other):
        return isinstance(other, DenyList) and self.deny == other.deny

    def __hash__(self):
        return hash(('DenyList', self.deny if isinstance(self.deny, (str, bool)) else
                     tuple(self.deny)))

    def __repr__(self):
        return f'DenyList(deny={self.deny!r})'


def _filter_set(f):
    return {f} if isinstance(f, str) else set(f)


def union_filters(a, b):
    """The collections either filter passes (flax.core.scope.union_filters), for filters of
    :func:`in_filter`'s kinds.

    >>> from ctrainstate.nn.scope import DenyList, union_filters
    >>> union_filters(False, 'intermediates'), union_filters(DenyList('intermediates'), 'intermediates')
    ('intermediates', DenyList(deny=False))
    """
    if a is True or b is True:
        return True
    if a is False:
        return b
    if b is False:
        return a
    if isinstance(a, DenyList) and isinstance(b, DenyList):
        if a.deny is True or b.deny is True:
            return DenyList(b.deny if a.deny is True else a.deny)
        if a.deny is False or b.deny is False:
            return DenyList(False)
        return DenyList(tuple(sorted(_filter_set(a.deny) & _filter_set(b.deny))) or False)
    if isinstance(b, DenyList):
        a, b = b, a
    if isinstance(a, DenyList):
        if a.deny is True:
            return b
        if a.deny is False:
            return a
        rest = _filter_set(a.deny) - _filter_set(b)
        return DenyList(tuple(sorted(rest)) if len(rest) != 1 else next(iter(rest))) if rest \
            else DenyList(False)
    return tuple(sorted(_filter_set(a) | _filter_set(b)))


def check_filter(filter_, who: str = 'mutable') -> None:
    """Refuse a value that is not a collection filter (Flax's InvalidFilterError): True/False,
    a name, a list/tuple/set of names, or a :class:`DenyList` of those."""
    f = filter_.deny if isinstance(filter_, DenyList) else filter_
    if isinstance(f, (bool, str)):
        return
    if isinstance(f, (list, tuple, set, frozenset)) and all(isinstance(c, str) for c in f):
        return
    raise TypeError(f'{who} must be True/False, a collection name, a list of names or a '
                    f'DenyList, got {filter_!r}')


def in_filter(filter_, col: str) -> bool:
    """Whether collection ``col`` passes a mutability filter: ``True``/``False``, a name,
    an iterable of names, or a :class:`DenyList` (flax.core.scope.in_filter)."""
    if isinstance(filter_, bool):
        return filter_
    if isinstance(filter_, str):
        return col == filter_
    if isinstance(filter_, DenyList):
        return not in_filter(filter_.deny, col)
    return col in filter_


class ScopeVariableNotFoundError(KeyError):
    """A variable is missing and its collection is immutable."""

    def __init__(self, name, col, scope_path):
        super().__init__(f'No Variable named "{name}" for collection "{col}" exists in "{scope_path}".')

    def __str__(self):
        return self.args[0]


class NameInUseError(ValueError):
    """A name was declared twice in one scope."""


class ScopeParamShapeError(ValueError):
    """An existing parameter's shape is not the one its initializer would make (Flax's)."""

    def __init__(self, name, scope_path, expected, got):
        super().__init__(f'For parameter "{name}" in "{scope_path}", the given initializer is '
                         f'expected to generate shape {expected}, but the existing parameter '
                         f'it received has shape {got}.')


def _leaves(value) -> list:
    """The unboxed leaves of a parameter value (one array, the common case, without a walk)."""
    if hasattr(value, 'shape') and not meta.is_axis_metadata(value):
        return [value]
    return tree_leaves(meta.unbox(value))


def _expected_shapes(init_fn, init_args, init_kwargs):
    """The leaf shapes of ``init_fn(key, *init_args, **init_kwargs)`` made abstractly (Flax's
    ``jax.eval_shape`` of the initializer), or None when it cannot run abstractly."""
    try:
        with abstract_mode():
            value = init_fn(np.zeros(2, np.uint32), *init_args, **init_kwargs)
        return [tuple(np.shape(leaf)) for leaf in _leaves(value)]
    except Exception:   # noqa: BLE001 -- an initializer that needs real values: no check
        return None


# The expected shapes per (initializer, arguments). An initializer's shapes depend on its
# code, the values it closes over and its arguments only, so the abstract run happens once per
# distinct declaration instead of at every call. The key is built from those parts, not from
# the function object: modules often make a new closure per call (`siren_uniform(bound)` in
# examples/siren.py, `nn.initializers.normal(0.02)` written inline), which an identity key
# would miss every time (a closed-over object hashed by identity keys by identity: one mutated
# in place to change a shape is not seen). Measured on examples/siren.py's model (3x256, 256 pixels, 1 CPU
# device): `model.apply` took 1.22 ms before the check, 1.42 ms with it uncached. A closure
# over something unhashable (a list, a module) is not cached. Bounded: a full table is cleared.
_SHAPES_CACHE: dict = {}
_SHAPES_CACHE_MAX = 4096


def _fn_key(f, depth=0):
    """A hashable key that is equal for two initializers that compute the same thing; raises
    TypeError (or ValueError, for an empty closure cell) when there is none."""
    if depth > 4:
        raise TypeError('initializer nested too deeply to key')
    if isinstance(f, types.FunctionType):
        cells = tuple(_value_key(c.cell_contents, depth) for c in (f.__closure__ or ()))
        kwd = tuple(sorted(f.__kwdefaults__.items())) if f.__kwdefaults__ else ()
        return (f.__code__, tuple(_value_key(v, depth) for v in f.__defaults__ or ()), kwd, cells)
    if isinstance(f, functools.partial):
        return ('partial', _fn_key(f.func, depth + 1), tuple(_value_key(a, depth) for a in f.args),
                tuple(sorted((k, _value_key(v, depth)) for k, v in f.keywords.items())))
    hash(f)
    return f


def _value_key(v, depth):
    if isinstance(v, (types.FunctionType, functools.partial)):
        return _fn_key(v, depth + 1)
    hash(v)
    return v


_PLAIN = frozenset({int, float, complex, str, bytes, bool, type(None), type})


def _plain_fn_key(f, depth=0):
    """:func:`_fn_key` for an initializer whose defaults and closed-over values are all
    plain values (numbers, strings, None, classes, numpy dtypes, tuples of those, other such
    functions): a key holding nothing else (no Array, no object hashed by identity), each
    value with its type (``1`` and ``1.0`` are different keys). Raises TypeError otherwise."""
    if depth > 4:
        raise TypeError('initializer nested too deeply to key')
    t = type(f)
    if t is types.FunctionType:
        cells = f.__closure__
        kwd = f.__kwdefaults__
        if cells:
            # _plain_value of each cell, its common cases inline (an initializer made per call,
            # siren_uniform(bound) or normal(0.02), closes over a number or two)
            ck = []
            for c in cells:
                v = c.cell_contents
                tv = type(v)
                if tv is int or tv is str or v is None:
                    ck.append(v)
                elif tv is float:
                    ck.append((float, v))
                else:
                    ck.append(_plain_value(v, depth))
            ck = tuple(ck)
        else:
            ck = ()
        defaults = f.__defaults__
        if defaults:
            # _plain_value(defaults), its common cases inline (dtype=np.float32, out_sharding=None)
            dk = []
            for v in defaults:
                tv = type(v)
                if tv is int or tv is str or v is None:
                    dk.append(v)
                elif tv is type or tv is float or tv is bool:
                    dk.append((tv, v))
                else:
                    dk.append(_plain_value(v, depth))
            defaults = tuple(dk)
        else:
            defaults = ()
        return (f.__code__, defaults,
                tuple(sorted((k, _plain_value(v, depth)) for k, v in kwd.items())) if kwd else (),
                ck)
    if t is functools.partial:
        return ('partial', _plain_fn_key(f.func, depth + 1), _plain_value(f.args, depth),
                tuple(sorted((k, _plain_value(v, depth)) for k, v in f.keywords.items())))
    raise TypeError('not a plain initializer')


def _plain_value(v, depth):
    t = type(v)
    if t is int or t is str or v is None:
        return v          # no value of another type keys equal to these (bool, float are tagged)
    if t is tuple:
        for e in v:
            te = type(e)
            if not (te is int or te is str or e is None):
                break
        else:
            return v      # ints, strings and None only: each is its own key
        out = []          # the cases below, the common ones inline
        for e in v:
            te = type(e)
            if te is int or te is str or e is None:
                out.append(e)
            elif te in _PLAIN:
                out.append((te, e))
            else:
                out.append(_plain_value(e, depth))
        return tuple(out)
    if t in _PLAIN:
        return (t, v)
    if t is types.FunctionType or t is functools.partial:
        return _plain_fn_key(v, depth + 1)
    if isinstance(v, _np_dtype):
        return (_np_dtype, v)
    raise TypeError('not a plain value')


def _expected_shapes_cached(init_fn, init_args, init_kwargs):
    if not init_kwargs:
        # the same initializer object with the same arguments as before: its entry in
        # _SHAPES_BY_ID, without building _fn_key (a walk of its closure) again
        try:
            entry = _SHAPES_BY_ID.get((id(init_fn), init_args))
        except TypeError:     # unhashable arguments
            entry = None
        if entry is not None and entry[0] is init_fn:
            return entry[1]
    try:
        key = (_fn_key(init_fn), init_args,
               tuple(sorted(init_kwargs.items())) if init_kwargs else ())
        hash(key)
    except (TypeError, ValueError):
        return _expected_shapes(init_fn, init_args, init_kwargs)
    shapes = _SHAPES_CACHE.get(key, _SHAPES_CACHE)
    if shapes is _SHAPES_CACHE:
        shapes = _expected_shapes(init_fn, init_args, init_kwargs)
        if len(_SHAPES_CACHE) >= _SHAPES_CACHE_MAX:
            _SHAPES_CACHE.clear()
        _SHAPES_CACHE[key] = shapes
    if not init_kwargs:
        if len(_SHAPES_BY_ID) >= _SHAPES_CACHE_MAX:
            _SHAPES_BY_ID.clear()
        _SHAPES_BY_ID[(id(init_fn), init_args)] = (init_fn, shapes)
    return shapes


# _SHAPES_CACHE's answers per (initializer object by id, arguments) for calls without keyword
# arguments: the entry holds the initializer, so its id is not reused while stored; an
# initializer is taken as fixed once used, as _fn_key takes a closed-over object hashed by
# identity (one whose closed-over values are rebound is not seen). Bounded: a full table is
# cleared.
_SHAPES_BY_ID: dict = {}


class _ScopeLocal(NotifyingLocal):
    """This thread's ``scopes`` (entered with ``with scope:``, innermost last; None before
    the first) and ``writes`` (variable writes so far, for nn.remat). The class attributes
    are what a thread that never set them reads, without an AttributeError raised and
    caught."""

    scopes = None
    writes = 0


_stack = _ScopeLocal()


def current_scope():
    """The innermost scope entered with ``with scope:`` in this thread, or ``None``.

    >>> from ctrainstate.nn.scope import Scope, current_scope
    >>> s = Scope()
    >>> with s:
    ...     current_scope() is s
    True
    >>> current_scope() is None
    True
    """
    st = _stack.scopes
    return st[-1] if st else None


class Variable:
    """Read/write handle to one variable of a scope (``.value``)."""

    def __init__(self, scope: 'Scope', collection: str, name: str, unbox: bool = True):
        self.scope = scope
        self.collection = collection
        self.name = name
        self.unbox = unbox

    @property
    def value(self):
        v = self.scope.get_variable(self.collection, self.name)
        return meta.unbox(v) if self.unbox else v

    @value.setter
    def value(self, value):
        old = self.scope.get_variable(self.collection, self.name)
        if self.unbox and meta.is_axis_metadata(old):
            value = meta.replace_boxed(old, value)
        self.scope.put_variable(self.collection, self.name, value)

    def is_mutable(self) -> bool:
        return self.scope.is_mutable_collection(self.collection)


class Scope:
    """Variables of one position (``path``) in a model, with RNG streams and mutability.

    Args:
      variables: ``{collection: nested dict}`` to read (and write, where mutable).
      rngs: ``{stream: callable}``; ``make_rng(stream)`` calls it and returns the key.
      mutable: ``True``, ``False``, a collection name, an iterable of names, or a
        :class:`DenyList`.
      path: names of the enclosing scopes, outermost first.
    """

    # (slots: a scope made for every module at every apply stores its attributes without an
    # instance dict; one is made only for an attribute outside them)
    __slots__ = ("_variables", "rngs", "mutable", "path", "_reserved", "_children", "__dict__",
                 "__weakref__")

    def __init__(self, variables: dict | None = None, rngs: dict | None = None,
                 mutable: bool | str | Iterable[str] = False, path: tuple = ()):
        self._variables = variables if variables is not None else {}
        self.rngs = dict(rngs) if rngs else {}
        self.mutable = mutable
        self.path = path if type(path) is tuple else tuple(path)
        self._reserved: set = set()
        self._children: dict = {}

    # -- paths, mutability, reservations
    @property
    def path_text(self) -> str:
        return '/' + '/'.join(self.path)

    def is_mutable_collection(self, col: str) -> bool:
        return in_filter(self.mutable, col)

    def reserve(self, name: str, col: str | None = None) -> None:
        if not isinstance(name, str):
            raise TypeError(f'Variable names are strings, got {name!r} '
                            f'({type(name).__name__}) in scope "{self.path_text}".')
        key = (col, name) if col is not None else name
        if key in self._reserved or name in self._reserved:
            raise NameInUseError(f'Name "{name}" is already in use in scope "{self.path_text}".')
        if col is not None and name in self._children:
            # a variable and a submodule may not share a name (Flax's NameInUseError): the
            # variable would read or overwrite the submodule's whole subtree
            raise NameInUseError(f'Could not create variable "{name}" (collection "{col}") in '
                                 f'scope "{self.path_text}": a submodule is named "{name}".')
        self._reserved.add(key)

    def check_submodule_name(self, name: str) -> None:
        """Refuse a submodule named like a variable declared in this scope (Flax's
        NameInUseError), before its scope is created."""
        for k in self._reserved:
            if isinstance(k, tuple) and k[1] == name:
                raise NameInUseError(f'Could not create submodule "{name}" in scope '
                                     f'"{self.path_text}": a variable (collection "{k[0]}") is '
                                     f'named "{name}".')

    def push(self, name: str) -> 'Scope':
        """Child scope ``name`` (shares variables, RNG streams and mutability)."""
        if name not in self._children:
            child = Scope(self._variables, self.rngs, self.mutable, self.path + (name,))
            self._children[name] = child
        return self._children[name]

    # -- storage
    def _collection(self, col: str, create: bool):
        d = self._variables.get(col)
        if d is None:
            if not create:
                return None
            d = self._variables[col] = {}
        for p in self.path:
            nxt = d.get(p)
            if nxt is None:
                if not create:
                    return None
                nxt = d[p] = {}
            d = nxt
        return d

    def variables(self) -> dict:
        """The ``{collection: nested dict}`` variables of this scope, as Flax's
        ``Scope.variables``: the whole model's at the root, a child's own subtrees (relative
        to its path, collections it has nothing in left out) below it.

        >>> s = Scope(rngs={'params': lambda: 0}, mutable=True)
        >>> s.push('Dense_0').param('b', lambda key: 1.0)
        1.0
        >>> s.push('Dense_0').variables(), sorted(s.variables()['params'])
        ({'params': {'b': 1.0}}, ['Dense_0'])
        """
        if not self.path:
            return self._variables
        out = {}
        for col in self._variables:
            d = self._collection(col, create=False)
            if d:
                out[col] = d
        return out

    def has_variable(self, col: str, name: str) -> bool:
        d = self._collection(col, create=False)
        return d is not None and name in d

    def get_variable(self, col: str, name: str, default: Any = None) -> Any:
        d = self._collection(col, create=False)
        return default if d is None else d.get(name, default)

    def put_variable(self, col: str, name: str, value: Any) -> None:
        if not self.is_mutable_collection(col):
            raise ValueError(f'Cannot update variable "{name}" in "{self.path_text}" because '
                             f'collection "{col}" is immutable.')
        self._collection(col, create=True)[name] = value
        _stack.writes += 1  # seen by nn.remat (state it cannot replay)

    # -- RNG
    def make_rng(self, name: str = 'params'):
        if name not in self.rngs:
            raise ValueError(f'No RNG stream "{name}" in scope "{self.path_text}"; pass '
                             f'rngs={{"{name}": ...}}.')
        return self.rngs[name]()

    # -- declarations
    def param(self, name: str, init_fn: Callable[..., Any], *init_args, unbox: bool = True,
              **init_kwargs):
        """Declare/fetch parameter ``name``; ``init_fn`` gets a ``'params'`` key first."""
        self.reserve(name, 'params')
        if self.has_variable('params', name):
            value = self.get_variable('params', name)
            self._check_param_shape(name, value, init_fn, init_args, init_kwargs)
        else:
            if not self.is_mutable_collection('params'):
                raise ScopeVariableNotFoundError(name, 'params', self.path_text)
            value = init_fn(self.make_rng('params'), *init_args, **init_kwargs)
            self.put_variable('params', name, value)
        return meta.unbox(value) if unbox else value

    def _check_param_shape(self, name, value, init_fn, init_args, init_kwargs) -> None:
        """Flax's check that an existing parameter has the shape its initializer makes (the
        module's hyperparameters match the variables given to ``apply``): compared leaf by
        leaf, dtypes not (a half-precision copy for inference is fine)."""
        expected = _expected_shapes_cached(init_fn, init_args, init_kwargs)
        if expected is None:
            return
        for got, want in zip(_leaves(value), expected):
            if tuple(np.shape(got)) != want:
                raise ScopeParamShapeError(name, self.path_text, want, tuple(np.shape(got)))

    def variable(self, col: str, name: str, init_fn: Callable[..., Any] | None = None, *init_args,
                 unbox: bool = True, **init_kwargs) -> Variable:
        """Declare/fetch variable ``col/name``; ``init_fn(*args)`` gets no RNG."""
        self.reserve(name, col)
        if not self.has_variable(col, name):
            if not self.is_mutable_collection(col) or init_fn is None:
                raise ScopeVariableNotFoundError(name, col, self.path_text)
            self.put_variable(col, name, init_fn(*init_args, **init_kwargs))
        return Variable(self, col, name, unbox=unbox)

    def sow(self, col: str, name: str, value: Any,
            reduce_fn: Callable[[Any, Any], Any] = lambda xs, x: xs + (x,),
            init_fn: Callable[[], Any] = lambda: ()) -> bool:
        """Store ``reduce_fn(previous or init_fn(), value)`` if ``col`` is mutable."""
        if not self.is_mutable_collection(col):
            return False
        prev = self.get_variable(col, name) if self.has_variable(col, name) else init_fn()
        self.put_variable(col, name, reduce_fn(prev, value))
        return True

    # -- current-scope context
    def __enter__(self):
        st = _stack.scopes
        if st is None:
            st = _stack.scopes = []
        st.append(self)
        return self

    def __exit__(self, *exc):
        _stack.scopes.pop()
        return False


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
