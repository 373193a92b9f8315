"""The implementation of :mod:`ctrainstate.nn.module` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations
from ..base.hooks import provide as _provide
_provide('nn.module', __name__)   # lower layers call into this module through _hooks.upper

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import operator
import types
from typing import Any, Callable, Iterable

import numpy as np

from ... import _C
from ... import random as _random
from ..base.threadlocal import NotifyingLocal
from ..array.array import Array, device_put
from ..array.sharding import NamedSharding, get_mesh
from . import meta
from . import spmd as _spmd
from .scope import DenyList, NameInUseError, Scope, check_filter, in_filter, union_filters
from .scope import ScopeParamShapeError
from .scope import _stack as _scope_tls
from .scope import _SHAPES_BY_ID, _expected_shapes_cached, _leaves as _param_leaves
from ...core import FrozenDict
from .spmd import _replicate_uneven
from .summary import tabulate

__all__ = ["Module", "compact", "nowrap", "ModuleScope", "current_module", "fold_in_static",
           "sharded_initializer"]


# --- RNG derivation (Flax's LazyRng / _fold_in_static) ------------------------------------

def fold_in_static(key, data) -> np.ndarray:
    """Fold static data (str / int items) into ``key`` via the first 4 bytes of their SHA-1.

    >>> from ctrainstate import random
    >>> fold_in_static(random.PRNGKey(0), ()).tolist()
    [0, 0]
    """
    if not data:
        return np.asarray(key, dtype=np.uint32)
    m = hashlib.sha1()
    for x in data:
        if isinstance(x, str):
            m.update(x.encode("utf-8"))
        elif isinstance(x, (int, np.integer)) and not isinstance(x, bool):
            x = int(x)
            m.update(x.to_bytes((x.bit_length() + 7) // 8, byteorder="big"))
        else:
            raise ValueError(f"Expected int or string, got: {x!r}")
    h = int.from_bytes(m.digest()[:4], byteorder="big")
    return _random.fold_in(key, h)


class ModuleScope(Scope):
    """A :class:`Scope` whose ``make_rng`` derives keys like Flax: per-scope counters."""

    __slots__ = ("root_rngs", "rng_counters", "initializing", "adopted")

    def __init__(self, variables=None, root_rngs=None, mutable=False, path=()):
        super().__init__(variables, rngs=None, mutable=mutable, path=path)
        self.root_rngs = dict(root_rngs) if root_rngs else {}
        self.rng_counters: dict = dict.fromkeys(self.root_rngs, 0)
        self.rngs = dict.fromkeys(self.root_rngs)  # for has-stream checks
        self.initializing = False
        # unbound modules adopted in this run, shared by the whole tree (Flax's per-root cache):
        # id(user's instance) -> (instance, its bound clone), so one instance used twice is one
        # submodule with one parameter set
        self.adopted: dict = {}


    def push(self, name: str) -> "ModuleScope":
        child = self._children.get(name)
        if child is None:
            child = _new_child_scope(self, name)
        return child

    def has_rng(self, name: str) -> bool:
        return name in self.root_rngs

    def make_rng(self, name: str = "params"):
        if name not in self.root_rngs:
            if "params" in self.root_rngs:
                name = "params"
            else:
                raise ValueError(
                    f'No RNG stream "{name}" in scope "{self.path_text}"; pass rngs={{"{name}": key}}'
                    f" to init/apply")
        self.rng_counters[name] = self.rng_counters.get(name, 0) + 1
        return fold_in_static(self.root_rngs[name], self.path + (self.rng_counters[name],))


def _new_child_scope(scope: ModuleScope, name: str) -> ModuleScope:
    """The new child ``name`` of ``scope`` (ModuleScope.push's): ModuleScope(scope._variables,
    scope.root_rngs, scope.mutable, scope.path + (name,)) with the two __init__ bodies inline
    (the same attributes, in the same order), sharing ``initializing`` and ``adopted``."""
    root = dict(scope.root_rngs)
    child = _scope_made(scope._variables, dict.fromkeys(root), scope.mutable,
                        scope.path + (name,), root, dict.fromkeys(root, 0), scope.initializing,
                        scope.adopted)
    scope._children[name] = child
    return child


def _scope_made(variables, rngs, mutable, path, root_rngs, rng_counters, initializing,
                adopted) -> ModuleScope:
    """A ModuleScope with these attributes (and new empty ``_reserved`` and ``_children``)
    made without its ``__init__`` calls, as the C paths make one (``ms_scope_new``)."""
    child = _object_new(ModuleScope)
    child._variables = variables
    child.rngs = rngs
    child.mutable = mutable
    child.path = path
    child._reserved = set()
    child._children = {}
    child.root_rngs = root_rngs
    child.rng_counters = rng_counters
    child.initializing = initializing
    child.adopted = adopted
    return child


# --- binding state ----------------------------------------------------------------------------

class _Context(NotifyingLocal):
    """This thread's module state: ``stack``, the frames of the module methods running
    (innermost last), made for each thread when it first looks; ``recorders`` and
    ``capture`` (below) are set when first used, None before (the class attributes: a
    read of a missing thread-local attribute would raise and catch an AttributeError)."""

    recorders = None
    capture = None

    def __init__(self):
        self.stack = []


_ctx = _Context()


def _module_stack() -> list:
    return _ctx.stack


def _map_modules(v, fn):
    """``v`` with every Module inside its dicts, lists and tuples (namedtuples included)
    replaced by ``fn(module)``; the containers are rebuilt with their own types (a dict
    subclass that cannot be built from a dict becomes a dict)."""
    if isinstance(v, Module):
        return fn(v)
    if isinstance(v, dict):
        d = {k: _map_modules(x, fn) for k, x in v.items()}
        try:
            return d if type(v) is dict else type(v)(d)
        except TypeError:
            return d
    if isinstance(v, (list, tuple)):
        items = [_map_modules(x, fn) for x in v]
        return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
    return v


class _Frame(tuple):
    """A module method being executed: where new submodules attach. ``_Frame(module,
    compact)``; a tuple with named fields made by ``tuple.__new__`` (no Python ``__init__``
    call per method call). Frames are compared by identity only (``f.module is self``)."""

    __slots__ = ()

    def __new__(cls, module: "Module", compact: bool):
        return _tuple_new(cls, (module, compact))

    module = property(operator.itemgetter(0), doc="the module whose method runs")
    compact = property(operator.itemgetter(1), doc="whether the method is @compact")


_tuple_new = tuple.__new__
_object_new = object.__new__
# writes a module's own state (a ModuleBase field) without Module.__setattr__'s checks
_state_set = object.__setattr__
# a module's own state: the _C.ModuleBase fields, in their order (a field never set reads None)
_STATE_NAMES = ("_scope", "_parent", "_setup_done", "_in_setup", "_auto_counts", "_call_names",
                "_field_names", "_setup_names", "_setup_reserved", "_fields_adopted",
                "_children")


def _module_state(module) -> dict:
    """``{name: value}`` of a module's own state (its ``_C.ModuleBase`` fields)."""
    return {k: getattr(module, k) for k in _STATE_NAMES}


def _scope_state(scope) -> dict:
    """``{name: value}`` of a scope's attributes: its slots that are set (Scope's, then its
    subclasses'), then its instance dict."""
    out = {}
    for klass in reversed(type(scope).__mro__):
        for k in klass.__dict__.get("__slots__", ()):
            if k not in ("__dict__", "__weakref__") and hasattr(scope, k):
                out[k] = getattr(scope, k)
    out.update(getattr(scope, "__dict__", {}))
    return out
_module_bind_new = _C.module_bind_new
_module_post_init = _C.module_post_init
_module_release = _C.module_release
_copy_tree_c = _C.copy_tree


def current_module() -> "Module | None":
    """The module whose method is executing on this thread (innermost), or None."""
    stack = _ctx.stack
    return stack[-1].module if stack else None


def compact(fn: Callable) -> Callable:
    """Mark a method whose body may create submodules and params inline (``@nn.compact``)."""
    fn._ct_compact = True
    return fn


def nowrap(fn: Callable) -> Callable:
    """Leave a method unwrapped (``@nn.nowrap``, Flax's): it runs in its caller's context, so
    a helper that builds submodules makes them for the method (setup / @compact) calling it.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> class M(nn.Module):
    ...     @nn.nowrap
    ...     def make(self, n):
    ...         return nn.Dense(n)
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return self.make(2)(x)
    >>> sorted(M().init(random.PRNGKey(0), np.ones((1, 3), np.float32))['params'])
    ['Dense_0']
    """
    fn._ct_nowrap = True
    return fn


def _require_bound(module, hint: str = "call it through .init(...) or .apply(...) (or from "
                                        "another module's method)") -> None:
    """Raise the unbound-module error (``hint``: what the user should do) if ``module`` has
    no scope."""
    if module._scope is None:
        raise RuntimeError(f"{type(module).__name__} is unbound: {hint}")


def _wrap_method(fn: Callable) -> Callable:
    """Run a user method with the module's frame active (so submodules attach to it): the
    call ``wrapped(self, *args, **kwargs)`` is ``_call_method(fn, self, args, kwargs)``, its
    common case in C. ``wrapped`` is a ``_C.ModuleMethod`` (py_module.c): a C callable
    without a Python frame of its own, a method descriptor as a function is (itself on the
    class, a bound method on an instance), carrying what ``functools.wraps`` copies
    (``__name__``, ``__qualname__``, ``__doc__``, ``__module__``, ``__wrapped__``, so
    ``inspect.signature`` shows ``fn``'s, and ``fn``'s own attributes such as
    ``_ct_compact``) and pickled by reference. A method already wrapped is returned as it
    is.

    >>> from ctrainstate import nn
    >>> class M(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         "Doubles x."
    ...         return 2 * x
    >>> M.__call__.__name__, M.__call__.__doc__, M.__call__._ct_compact, M.__call__._ct_wrapped
    ('__call__', 'Doubles x.', True, True)
    """
    if getattr(fn, "_ct_wrapped", False):
        return fn
    wrapped = functools.update_wrapper(_C.ModuleMethod(fn), fn)
    wrapped._ct_wrapped = True
    return wrapped


def _is_module_method(obj) -> bool:
    """Whether ``obj`` is a Module method as its class holds it (``Model.__call__``): a
    function wrapped by :func:`_wrap_method`, a ``_C.ModuleMethod``."""
    return type(obj) is _C.ModuleMethod


def _call_method(fn: Callable, self, args: tuple, kwargs: dict):
    """``fn(self, *args, **kwargs)`` with the module's frame active: its setup done first, a
    new call of an ``@compact`` method restarting its auto names and declarations, the call
    reported to nn.tabulate's recorders and its result sown for ``capture_intermediates``.
    (``_C.module_call`` does the same for the common case, and calls this for the rest.)"""
    scope = self._scope
    if scope is None:
        orphan = self.__dict__.get("_orphan_of")
        if orphan is not None:
            _require_bound(self, f"submodules must be defined in `setup()` or in a method "
                                 f"wrapped in `@compact`; this one was created in another "
                                 f"method of {orphan}")
        _require_bound(self)
    if not self._setup_done:
        if self._fields_adopted and type(self).setup is _base_setup \
                and "setup" not in self.__dict__ and type(self)._try_setup is _base_try_setup:
            # self._try_setup() where there is no setup() to run (its first branch)
            _state_set(self, "_setup_done", True)
            _state_set(self, "_setup_reserved", set(scope._reserved))
        else:
            self._try_setup()
    is_compact = getattr(fn, "_ct_compact", False)
    ctx = _ctx
    stack = ctx.stack
    if is_compact:
        for f in stack:
            if f[0] is self:            # (f.module)
                break
        else:
            # A new call of this module: auto names restart and its names may be declared
            # again (so a module called twice reuses its submodules and params, as in
            # Flax).
            _state_set(self, "_auto_counts", {})
            names = set(self._field_names)
            setup_names = self._setup_names
            if setup_names:
                names |= setup_names
            _state_set(self, "_call_names", names)
            reserved = scope._reserved
            reserved.clear()
            setup_reserved = self._setup_reserved
            if setup_reserved:
                reserved.update(setup_reserved)   # setup()'s params stay taken
    stack.append(_tuple_new(_Frame, (self, is_compact)))    # _Frame(self, is_compact)
    recorders = ctx.recorders
    call = recorders[-1].enter(self, fn.__name__, args, kwargs) if recorders else None
    try:
        out = fn(self, *args, **kwargs)
        if call is not None:
            call.outputs = out     # nn.tabulate's outputs column
        capture = ctx.capture      # _capture_stack(), read inline
        if capture and capture[-1] is not None and capture[-1](self, fn.__name__):
            # apply(..., capture_intermediates=...): the method's return value, sown as
            # Flax does (a tuple per method name, one entry per call)
            self.sow("intermediates", fn.__name__, out)
        return out
    finally:
        stack.pop()


@contextlib.contextmanager
def _recording(recorder):
    """Within: every wrapped module method call on this thread is reported to ``recorder``
    (``enter(module, method_name, args, kwargs)`` returns the record; its ``outputs`` is set
    on return). Used by :func:`ctrainstate.nn.tabulate`."""
    stack = _ctx.recorders
    if stack is None:
        stack = _ctx.recorders = []
    stack.append(recorder)
    try:
        yield recorder
    finally:
        stack.pop()


def _capture_stack() -> list:
    """Filters of the capture_intermediates runs on this thread (innermost last)."""
    s = _ctx.capture
    if s is None:
        s = _ctx.capture = []
    return s


def _capture_filter(capture_intermediates):
    """Flax's capture_intermediates: False, True (every ``__call__``), or a function of
    ``(module, method_name)`` choosing which return values are kept."""
    if capture_intermediates is False or capture_intermediates is None:
        return None
    if capture_intermediates is True:
        return lambda mdl, method_name: method_name == "__call__"
    if callable(capture_intermediates):
        return capture_intermediates
    raise TypeError(f"capture_intermediates must be a bool or a function (module, method_name) "
                    f"-> bool, got {type(capture_intermediates).__name__}")


_UNSET = object()


@contextlib.contextmanager
def _detached():
    """Construct modules as if no module method were running: they attach to no parent (a
    free module, adopted where it is passed or assigned, as Flax's ``parent=None``)."""
    stack = _module_stack()
    saved = list(stack)
    stack.clear()
    try:
        yield
    finally:
        stack.extend(saved)


def _accept_parent(init: Callable) -> Callable:
    """The dataclass ``__init__`` taking Flax's keyword ``parent``: ``parent=None`` makes a
    free (unbound) module even inside ``setup()`` or an ``@compact`` method."""
    @functools.wraps(init)
    def __init__(self, *args, parent=_UNSET, **kwargs):
        if parent is _UNSET:
            return init(self, *args, **kwargs)
        _free_init(self, parent, init, args, kwargs)
    return __init__


def _field_info(cls) -> tuple:
    """``(dataclass fields dict, names of the fields, names of the init fields)`` of a Module
    class, in ``dataclasses.fields`` order: computed once per class instead of at every
    construction, adoption and comparison. Stored on the class with the class itself and
    its ``__dataclass_fields__``, and recomputed when either is not the one it was made for
    (a subclass reads its parent's entry through inheritance; a class decorated again gets
    a new fields dict), so it cannot go stale. A class that is not a dataclass raises
    ``TypeError`` as ``dataclasses.fields`` does."""
    info = cls.__dict__.get("_ct_field_info")
    fields = getattr(cls, "__dataclass_fields__", None)
    if info is None or info[0] is not fields:
        fs = dataclasses.fields(cls)
        info = (fields, tuple(f.name for f in fs), tuple(f.name for f in fs if f.init))
        type.__setattr__(cls, "_ct_field_info", info)
    return info


def _plain_fields_info(cls) -> tuple:
    """``(the class's __dataclass_fields__, names of its fields but name)``, or with ``()``
    where the class does not keep :meth:`Module._adopt_fields` (Module._attach's fast check):
    computed once per class, recomputed as ``_field_info`` is."""
    names = tuple(n for n in _field_info(cls)[1] if n != "name")
    if cls._adopt_fields is not Module._adopt_fields or not names:
        names = ()
    info = (cls.__dataclass_fields__, names)
    type.__setattr__(cls, "_ct_plain_fields", info)
    return info


def _storing_init(cls) -> Callable:
    """The dataclass ``__init__`` of ``cls``, made to store the fields with
    ``object.__setattr__`` (as dataclasses does for a frozen class) instead of through
    :meth:`Module.__setattr__`, which for a module being constructed (no scope, not in
    setup) does just that: five to ten Python calls fewer per submodule created at every
    ``apply``. It is dataclasses' own ``__init__`` for a frozen twin of ``cls`` (the same
    fields, defaults, factories, ``init=``/``kw_only=``, name and module; ``cls`` itself
    stays a plain dataclass); the twin's signature must be the generated one's, and a class
    with ``InitVar`` or ``ClassVar`` fields keeps its generated ``__init__``."""
    init = cls.__init__
    fields = dataclasses.fields(cls)
    if len(fields) != len(cls.__dataclass_fields__):
        return init        # InitVar / ClassVar pseudo-fields: left to dataclasses
    ns = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
          "__annotations__": {f.name: f.type for f in fields},
          "__post_init__": Module.__post_init__}     # (so the twin's __init__ calls it)
    for f in fields:
        ns[f.name] = dataclasses.field(default=f.default, default_factory=f.default_factory,
                                       init=f.init, kw_only=f.kw_only)
    try:
        twin = dataclasses.dataclass(type(cls.__name__, (), ns), eq=False, repr=False,
                                     frozen=True, match_args=False)
        a = inspect.signature(init).parameters
        b = inspect.signature(twin.__init__).parameters
        same = list(a) == list(b) and all(
            a[k].kind == b[k].kind and a[k].default is b[k].default
            and a[k].annotation == b[k].annotation for k in a)
    except Exception:   # noqa: BLE001 -- whatever the twin cannot mirror keeps its __init__
        return init
    return twin.__init__ if same else init


def _generated_init(cls, init: Callable) -> Callable | None:
    """The ``__init__`` of a Module class whose fields are plain (no ``InitVar`` /
    ``ClassVar``, no data descriptor under a field's name, no ``__slots__``), or None: the
    dataclass ``__init__`` ``init`` (its signature, defaults, factories, ``init=`` and
    ``kw_only=``) taking Flax's keyword ``parent`` too, written so a module made at every
    ``apply`` costs a few dictionary stores: the fields go into the instance ``__dict__``
    (what ``object.__setattr__`` does for names without a data descriptor), and
    :meth:`Module.__post_init__`'s work (its state, in its ``_C.ModuleBase`` fields, the name
    check, attaching to the module whose method runs) is one C call,
    ``_C.module_post_init(self, self.__dict__)`` (py_module.c), where the instance's class keeps
    ``Module.__post_init__``; elsewhere ``self.__post_init__()`` runs, as dataclasses does.
    ``parent=None`` builds a free module (see :func:`_accept_parent`). The function carries
    ``init`` as ``__wrapped__`` (so ``inspect.signature`` shows the dataclass signature, as
    under :func:`_accept_parent`), and is used only when its own signature, less ``parent``,
    is ``init``'s. What the class gets is that function's twin in C, a ``_C.ModuleInit``
    (py_module.c: no Python frame, the arguments bound, the fields stored and the post-init
    work done in one call), which hands every call it does not bind cleanly (an argument
    error, ``parent=``) to the Python function, kept as its ``_ct_slow``."""
    fields = dataclasses.fields(cls)
    factory = getattr(dataclasses, "_HAS_DEFAULT_FACTORY", None)
    if len(fields) != len(cls.__dataclass_fields__) or factory is None:
        return None
    for f in fields:
        for klass in cls.__mro__:
            if f.name in klass.__dict__:
                attr = type(klass.__dict__[f.name])
                if hasattr(attr, "__set__") or hasattr(attr, "__delete__"):
                    return None      # a descriptor-typed field: dataclasses calls its __set__
                break
    if any("__slots__" in klass.__dict__ for klass in cls.__mro__[:-1]):
        return None
    # the generated code's own names: none may be a field's (a field `type` or `dict`
    # would shadow the builtin)
    ns = {"__ct_UNSET": _UNSET, "__ct_FACTORY": factory,
          "__ct_post_init_c": _module_post_init, "__ct_post_init": Module.__post_init__,
          "__ct_free_init": _free_init, "__ct_type": type, "__ct_dict": dict}
    if any(f.name.startswith("__ct_") or f.name in ("self", "parent", "__init__")
           for f in fields):
        return None
    pos, kw, body, call_pos, call_kw = [], [], [], [], []
    for i, f in enumerate(fields):
        has_default = f.default is not dataclasses.MISSING
        has_factory = f.default_factory is not dataclasses.MISSING
        if has_default:
            ns[f"__ct_dflt_{i}"] = f.default
        if has_factory:
            ns[f"__ct_factory_{i}"] = f.default_factory
        if f.init:
            param = f.name + (f"=__ct_dflt_{i}" if has_default else
                              "=__ct_FACTORY" if has_factory else "")
            (kw if f.kw_only else pos).append(param)
            (call_kw.append(f"{f.name}={f.name}") if f.kw_only else call_pos.append(f.name))
            value = f"__ct_factory_{i}() if {f.name} is __ct_FACTORY else {f.name}" \
                if has_factory else f.name
        elif has_factory:
            value = f"__ct_factory_{i}()"
        elif has_default:
            value = f"__ct_dflt_{i}"
        else:
            continue
        body.append(f"    __ct_d[{f.name!r}] = {value}")
    kw.append("parent=__ct_UNSET")
    src = "\n".join([
        f"def __init__(self, {', '.join(pos + ['*'] + kw)}):",
        "    if parent is not __ct_UNSET:",
        f"        return __ct_free_init(self, parent, __init__, "
        f"({''.join(a + ', ' for a in call_pos)}), __ct_dict({', '.join(call_kw)}))",
        "    __ct_d = self.__dict__",
        *body,
        "    if __ct_type(self).__post_init__ is not __ct_post_init:",
        "        self.__post_init__()",
        "        return",
        "    # Module.__post_init__'s work (the same state, in the same order), in C",
        "    __ct_post_init_c(self, __ct_d)",
    ])
    try:
        exec(compile(src, f"<{cls.__qualname__}.__init__ (ctrainstate)>", "exec"), ns)
        gen = ns["__init__"]
        gen.__annotations__ = dict(getattr(init, "__annotations__", {}))
        a = inspect.signature(init).parameters
        b = dict(inspect.signature(gen, follow_wrapped=False).parameters)
        b.pop("parent")
        same = list(a) == list(b) and all(
            a[k].kind == b[k].kind and a[k].default is b[k].default
            and a[k].annotation == b[k].annotation for k in a)
    except Exception:   # noqa: BLE001 -- whatever it cannot mirror keeps the dataclass __init__
        return None
    if not same:
        return None
    functools.update_wrapper(gen, init)
    gen._ct_generated = True
    if _module_post_init is not _C.module_post_init:
        return gen      # (the post-init replaced, as tests route it through Python)
    # the same __init__ in C for the calls that bind (py_module.c's ModuleInit); the rest
    # (argument errors, parent=) goes to `gen`
    params = [f for f in fields if f.init and not f.kw_only] + \
        [f for f in fields if f.init and f.kw_only]
    index = {f.name: i for i, f in enumerate(params)}
    missing = dataclasses.MISSING
    defaults = tuple(f.default if f.default is not missing else
                     factory if f.default_factory is not missing else missing for f in params)
    stores = tuple((f.name, index.get(f.name, -1), f.default, f.default_factory)
                   for f in fields if f.init or f.default is not missing
                   or f.default_factory is not missing)
    fast = _C.ModuleInit(gen, tuple(f.name for f in params),
                         sum(1 for f in params if not f.kw_only), defaults, stores, missing,
                         factory, Module.__post_init__)
    functools.update_wrapper(fast, init)
    fast._ct_generated = True
    return fast


def _free_init(self, parent, init, args, kwargs):
    """``init(self, *args, **kwargs)`` for ``parent=``: None (a free module) only."""
    if parent is not None:
        raise TypeError(f"{type(self).__name__}(parent={type(parent).__name__}): only "
                        f"parent=None (a free module) is supported; a module created in "
                        f"setup() or an @compact method gets its parent by itself")
    with _detached():
        init(self, *args, **kwargs)


def _bad_name(module):
    raise TypeError(f"{type(module).__name__}: name must be a string, got {module.name!r}")


def _bind_new(module, stack):
    """A module just constructed while a module method runs (``stack``, not empty): attach
    it to that module (see :meth:`Module.__post_init__`)."""
    frame = stack[-1]
    parent = frame[0]                   # (frame.module, frame.compact)
    if frame[1] or any(f[1] and f[0] is parent for f in stack):
        # in an @compact method, or in a helper method it calls on the same module
        # (Flax: the parent is still in its compact method)
        parent._attach(module, module.__dict__["name"])
    elif parent._in_setup:
        object.__setattr__(module, "_parent", parent)  # named on attribute assignment
    else:
        # created in another method: it stays unbound, and calling it says why (Flax
        # raises AssignSubModuleError here)
        object.__setattr__(module, "_orphan_of", type(parent).__name__)


def _adopt_tail(child: "Module") -> None:
    """The end of :meth:`Module._attach` for a child whose fields are not adopted yet:
    ``child._adopt_fields()``, skipped where the class keeps the base method and every field
    holds a scalar, a tuple of scalars or another value that is no module, dict, list or
    tuple (no module inside, _freeze_attr keeps it): what it would do then is mark the fields
    adopted, with no field submodule."""
    cd = child.__dict__
    cls = type(child)
    plain = cls.__dict__.get("_ct_plain_fields")
    if plain is None or plain[0] is not cls.__dataclass_fields__:
        plain = _plain_fields_info(cls)
    if plain[1]:
        for n in plain[1]:
            v = cd[n]
            tv = type(v)
            if tv in _SCALARS:
                continue
            if tv is tuple:
                for e in v:
                    if type(e) not in _SCALARS:
                        break
                else:
                    continue
                break
            if isinstance(v, (Module, dict, list, tuple)):
                break
            # (an initializer function, a dtype, an activation: no module inside)
        else:
            _state_set(child, "_fields_adopted", True)
            _state_set(child, "_field_names", ())
            return
    child._adopt_fields()


_RESERVED = {"parent", "name", "scope", "variables", "init", "apply", "param", "variable",
             "setup", "make_rng", "is_mutable_collection", "has_variable", "sow", "path",
             "is_initializing", "bind"}


def _lazy_setup_getattr(self, item):
    """``Module.__getattr__`` of a class that can define attributes in ``setup()``: they are
    created lazily, on the first access to one. Only such classes have it (see
    ``Module.__init_subclass__``): a class attribute ``__getattr__`` makes CPython read every
    attribute of every instance through a slower generic path, which the many small modules of
    a model would pay at each ``apply``; without one, a missing attribute raises the same
    AttributeError."""
    if not item.startswith("_") and self._scope is not None and self._setup_done is False:
        self._try_setup()
        try:
            return object.__getattribute__(self, item)
        except AttributeError:
            pass
    raise AttributeError(f"'{type(self).__name__}' object has no attribute '{item}'")


def _can_set_up_lazily(cls) -> bool:
    """Whether instances of ``cls`` can have a ``setup()`` to run on an attribute access: the
    class overrides ``setup`` or ``_try_setup``."""
    return cls.setup is not Module.setup or cls._try_setup is not Module._try_setup


class Module(_C.ModuleBase):
    """Base class of modules; subclasses are dataclasses (see the module docstring).

    A module's own state (``_scope``, ``_parent``, its setup flags, the names of its
    submodules, ``_children``) lives in the fields of ``_C.ModuleBase``, read and written as
    attributes (``object.__setattr__``); the instance ``__dict__`` holds the dataclass fields.
    """

    name: str | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        ann = cls.__dict__.get("__annotations__", {})
        for f in ann:
            if f in _RESERVED and f != "name":
                raise TypeError(f"{cls.__name__}.{f}: '{f}' is a reserved Module attribute")
        # wrap user methods so submodules created inside attach to this module
        for k, v in list(cls.__dict__.items()):
            if k in ann or (k.startswith("__") and k != "__call__"):
                continue  # field defaults (e.g. kernel_init) are values, not methods
            if getattr(v, "_ct_nowrap", False):
                continue
            if inspect.isfunction(v) and k not in ("setup",) and not k.startswith("_"):
                setattr(cls, k, _wrap_method(v))
            elif k == "__call__" and inspect.isfunction(v):
                setattr(cls, k, _wrap_method(v))
        # `name` is keyword-only so positional fields work in subclasses of subclasses
        if "name" in ann:
            ann = {k: v for k, v in ann.items() if k != "name"}
        cls.__annotations__ = {**ann, "name": "str | None"}
        cls.name = dataclasses.field(default=None, kw_only=True)
        if not hasattr(cls, "__getattr__") and _can_set_up_lazily(cls):
            cls.__getattr__ = _lazy_setup_getattr
        own_init = "__init__" in cls.__dict__
        dataclasses.dataclass(cls, eq=False, repr=False)
        cls.__setattr__ = Module.__setattr__  # keep our setattr after dataclass
        gen = None if own_init else _generated_init(cls, cls.__init__)
        if gen is not None:
            cls.__init__ = gen
            return
        if not own_init:
            cls.__init__ = _storing_init(cls)
        cls.__init__ = _accept_parent(cls.__init__)

    # dataclass calls __post_init__ after field assignment
    def __post_init__(self):
        # (the _STATE_NAMES, in their order)
        for k, v in zip(_STATE_NAMES, (
                None, None, False, False, {}, set(), (),
                set(),      # _setup_names: submodules setup() defined
                set(),      # _setup_reserved: and its variables' reservations
                False, {})):
            _state_set(self, k, v)
        if self.name is not None and not isinstance(self.name, str):
            _bad_name(self)
        stack = _ctx.stack
        if stack:
            _module_bind_new(self, stack)

    def __getstate__(self):
        """``(instance dict, own state)``: what pickle and ``copy`` save of a module (its
        ``_C.ModuleBase`` fields are not in its ``__dict__``)."""
        return self.__dict__, _module_state(self)

    def __setstate__(self, state):
        d, own = state
        self.__dict__.update(d)
        for k in _STATE_NAMES:
            _state_set(self, k, own.get(k))

    def __setattr__(self, key, value):
        # (the instance's own state, in its ModuleBase fields: None until __post_init__)
        in_setup = self._in_setup
        if self._scope is not None and not in_setup and not key.startswith("_"):
            raise AttributeError(f"{type(self).__name__} is frozen: cannot set '{key}' outside setup()")
        if in_setup and not key.startswith("_"):
            field = type(self).__dataclass_fields__.get(key)
            if field is not None and field.init:
                # Flax's SetAttributeInModuleSetupError: a field is the module's hyperparameter
                raise AttributeError(f"{type(self).__name__}.{key}: module construction "
                                     f"attributes are frozen; pass {key}= when constructing "
                                     f"the module instead of setting it in setup()")
            value = _freeze_attr(self._adopt(key, value))
        object.__setattr__(self, key, value)

    # --- tree position -----------------------------------------------------------------------
    def _attach(self, child: "Module", name: str | None):
        if name is None:
            cls = type(child).__name__
            counts = self._auto_counts
            n = counts.get(cls, 0)
            counts[cls] = n + 1
            name = f"{cls}_{n}"
        parent_scope = self._scope
        call_names = self._call_names
        if name in call_names:
            raise NameInUseError(
                f'A submodule named "{name}" already exists in "{parent_scope.path_text}"; '
                f"give submodules distinct names")
        if parent_scope._reserved:      # (with nothing declared there is nothing to clash)
            parent_scope.check_submodule_name(name)
        call_names.add(name)
        if self._in_setup:
            self._setup_names.add(name)   # an @compact call may not reuse it
        child.__dict__["name"] = name   # (object.__setattr__: no data descriptor has the name)
        _state_set(child, "_parent", self)
        if type(parent_scope) is ModuleScope:
            # parent_scope.push(name), inline (ModuleScope.push)
            scope = parent_scope._children.get(name)
            if scope is None:
                scope = _new_child_scope(parent_scope, name)
        else:
            scope = parent_scope.push(name)
        # a new instance at this path (the submodule re-created by a later call of this
        # module) declares its variables afresh, as Flax gives it a fresh scope; the scope
        # object is kept for its RNG counters
        scope._reserved.clear()
        _state_set(child, "_scope", scope)
        self._children[name] = child
        # eagerly, as Flax registers a bound module's field submodules (see _adopt_tail)
        if not child._fields_adopted:
            _adopt_tail(child)

    # --- submodules passed as attributes (``Wrapper(inner=nn.Dense(3))``, nn.Sequential) ---
    def _adopt(self, name: str, value):
        """Bind the unbound modules in ``value`` (a module, or lists, tuples and dicts of them,
        nested) as children of this module, named as Flax names them: ``name`` for a module,
        ``name_<key>_<key>...`` for one inside containers (``layers_0``, ``blocks_1_0``,
        ``table_a``), adopted in the order of those keys sorted as strings. Returns ``value``
        with each adopted module replaced by its bound child.

        A module created by this module's ``setup()`` is bound itself; any other (passed from
        outside) is cloned, so the user's instance stays unbound and can be passed to several
        parents or calls. One instance met twice in one ``init``/``apply`` (``Sequential([d,
        d])``, ``W(a=d, b=d)``) is adopted once, at its first place, and shared: one submodule,
        one parameter set, as in Flax."""
        leaves = []

        def walk(v, path):
            if isinstance(v, Module):
                leaves.append((path, v))
            elif isinstance(v, dict):
                for k, x in v.items():
                    walk(x, path + (str(k),))
            elif isinstance(v, (list, tuple)):
                keys = v._fields if hasattr(v, "_fields") else range(len(v))
                for k, x in zip(keys, v):
                    walk(x, path + (str(k),))

        walk(value, ())
        if not any(m._scope is None for _, m in leaves):
            return value
        cache = getattr(self._scope, "adopted", None)
        if cache is None:
            cache = {}
        new = {}
        for path, m in sorted(leaves, key=lambda t: t[0]):
            if m._scope is not None:
                continue
            if m._parent is self and self._in_setup:
                child = m             # created by this setup(): bind it, as Flax does
                if m.name is not None:
                    self._attach(child, m.name)
                    cache[id(m)] = (m, child)
                    new[id(m)] = child
                    continue
            elif id(m) in cache:
                new[id(m)] = cache[id(m)][1]
                continue
            else:
                child = m._unbound_clone()
            self._attach(child, "_".join((name,) + path))
            cache[id(m)] = (m, child)
            new[id(m)] = child

        return _map_modules(value, lambda v: new.get(id(v), v))

    def _adopt_fields(self):
        """Adopt the unbound modules held by dataclass fields (see :meth:`_adopt`: ``inner``,
        ``layers_0``, ``blocks_1_0``, ``table_a``), once, when the module is bound."""
        if self._fields_adopted:
            return
        _state_set(self, "_fields_adopted", True)
        children = self._children
        before = set(children) if children else ()
        cls = type(self)
        info = cls.__dict__.get("_ct_field_info")   # _field_info(cls), inline
        if info is None or info[0] is not getattr(cls, "__dataclass_fields__", None):
            info = _field_info(cls)
        for name in info[1]:
            if name == "name":
                continue
            v = getattr(self, name)
            tv = type(v)
            if tv in _SCALARS:
                continue          # no module inside, and _freeze_attr keeps it
            if tv is tuple:
                for e in v:
                    if type(e) not in _SCALARS:
                        break
                else:
                    continue      # a plain tuple of scalars: _freeze_attr keeps it (an equal tuple)
            elif not isinstance(v, (Module, dict, list, tuple)):
                continue          # _adopt finds no module in it, _freeze_attr returns it
            nv = _freeze_attr(self._adopt(name, v))
            if nv is not v:
                object.__setattr__(self, name, nv)
        _state_set(self, "_field_names", tuple(n for n in children if n not in before)
                   if before else tuple(children))

    def _unbound_clone(self) -> "Module":
        fields = {n: getattr(self, n) for n in _field_info(type(self))[1]}
        with _detached():  # a free clone: it must not attach to the module being set up
            return type(self)(**fields)

    def clone(self, *, parent=None, **updates) -> "Module":
        """A free copy of this module with ``updates`` to its fields (Flax's ``clone``): no
        parent (``parent=None``, the only parent supported), so it is unbound until passed to
        ``init``/``apply``/``bind`` or adopted by a module. Submodules among the fields that
        are bound are copied free too (one copy per instance).

        >>> from ctrainstate import nn
        >>> d = nn.Dense(3, use_bias=False).clone(features=4)
        >>> d.features, d.use_bias, d.scope is None
        (4, False, True)
        """
        if parent is not None:
            raise TypeError(f"{type(self).__name__}.clone(parent=...): only parent=None (a "
                            f"free module) is supported")
        with _detached():
            return self._copy_with(updates)

    def copy(self, *, parent=_UNSET, name=None, **updates) -> "Module":
        """A copy with ``updates`` (Flax's ``copy``): ``name`` reset (``None``: an auto name),
        and created where it is called, so inside an ``@compact`` method it is a new
        submodule of that module (``parent=None``: a free module, as :meth:`clone`)."""
        if parent is _UNSET:
            return self._copy_with({**updates, "name": name})
        return self.clone(parent=parent, name=name, **updates)

    def _copy_with(self, updates: dict) -> "Module":
        fields = {n: getattr(self, n) for n in _field_info(type(self))[2]}
        fields.update(updates)
        cache: dict = {}

        def free(v):
            if v._scope is None:
                return v
            if id(v) not in cache:
                cache[id(v)] = v.clone()
            return cache[id(v)]

        return type(self)(**{k: _map_modules(v, free) for k, v in fields.items()})

    def unbind(self) -> "tuple[Module, dict]":
        """``(a free copy without its name, its variables)`` of a bound module (Flax's
        ``unbind``), e.g. a submodule defined in ``setup()`` taken out of ``model.bind(v)``."""
        if self._scope is None:
            raise ValueError(f"{type(self).__name__}.unbind: the module is not bound (bind "
                             f"it with .bind(variables) first)")
        return self.clone(name=None), self.variables

    def _try_setup(self):
        if self._setup_done:
            return
        if not self._fields_adopted:
            self._adopt_fields()
        _state_set(self, "_setup_done", True)
        if type(self).setup is Module.setup and "setup" not in self.__dict__:
            # no setup() to run (Module.setup does nothing): what the frame and the
            # _in_setup flag below would bracket is empty
            _state_set(self, "_setup_reserved", set(self._scope._reserved))
            return
        object.__setattr__(self, "_in_setup", True)
        stack = _module_stack()
        stack.append(_Frame(self, False))
        try:
            self.setup()
        finally:
            stack.pop()
            object.__setattr__(self, "_in_setup", False)
            object.__setattr__(self, "_setup_reserved", set(self._scope._reserved))

    def setup(self):
        """Override to define submodules and params lazily (called once, when first used)."""

    # --- variables ---------------------------------------------------------------------------
    @property
    def scope(self) -> ModuleScope:
        return self._scope

    @property
    def parent(self) -> "Module | None":
        """The module this one is a submodule of (None for a root or a free module)."""
        return self._parent

    @property
    def path(self) -> tuple:
        return self._scope.path if self._scope is not None else ()

    def _need_scope(self, what):
        if self._scope is None:
            raise RuntimeError(f"{type(self).__name__}.{what}: the module is unbound; use "
                               f".init(...) or .apply(...)")
        return self._scope

    def _check_declaring(self, what: str) -> None:
        """Flax's rule: variables are declared in ``setup()`` or while the module is in an
        ``@compact`` method (a helper it calls included), not in another method."""
        if self._in_setup:
            return
        for f in _ctx.stack:
            if f.compact and f.module is self:
                return
        raise ValueError(f"{what} must be initialized in `setup()` or in a method wrapped in "
                         f"`@compact` ({type(self).__name__} at {self._scope.path_text})")

    def param(self, name: str, init_fn: Callable, *init_args, unbox: bool = True, **init_kwargs):
        """Declare/fetch a parameter (``init_fn(key, *init_args)`` on init).

        The value becomes an Array: a sharded one when ``init_fn`` returns a box
        (``with_partitioning``/``with_logical_partitioning``) under an active mesh, else
        replicated over the active mesh or on the default device.
        """
        scope = self._need_scope("param")
        self._check_declaring("Parameters")
        if _spmd._strict.rules is None:
            if not init_kwargs:
                value = _existing_param(scope, name, init_fn, init_args)
                if value is not _MISS:
                    return meta.unbox(value) if unbox else value
            return scope.param(name, _placing(init_fn), *init_args, unbox=unbox, **init_kwargs)
        with _spmd._declaring(f"parameter {'/'.join(tuple(scope.path) + (name,))!r}"):
            return scope.param(name, _placing(init_fn), *init_args, unbox=unbox, **init_kwargs)

    def variable(self, col: str, name: str, init_fn: Callable | None = None, *init_args,
                 unbox: bool = True, **init_kwargs):
        scope = self._need_scope("variable")
        self._check_declaring("Variables")
        return scope.variable(col, name, init_fn, *init_args, unbox=unbox, **init_kwargs)

    def has_variable(self, col: str, name: str) -> bool:
        return self._need_scope("has_variable").has_variable(col, name)

    def get_variable(self, col: str, name: str, default=None):
        """The value of variable ``col/name`` of this module, or ``default`` (Flax's)."""
        return self._need_scope("get_variable").get_variable(col, name, default)

    def put_variable(self, col: str, name: str, value) -> None:
        """Set variable ``col/name`` of this module; its collection must be mutable."""
        self._need_scope("put_variable").put_variable(col, name, value)

    def has_rng(self, name: str) -> bool:
        """Whether an RNG stream ``name`` was given to ``init``/``apply`` (Flax's)."""
        return self._need_scope("has_rng").has_rng(name)

    def is_mutable_collection(self, col: str) -> bool:
        return self._need_scope("is_mutable_collection").is_mutable_collection(col)

    def sow(self, col: str, name: str, value, reduce_fn=lambda xs, x: xs + (x,), init_fn=lambda: ()):
        return self._need_scope("sow").sow(col, name, value, reduce_fn, init_fn)

    def make_rng(self, name: str = "params"):
        return self._need_scope("make_rng").make_rng(name)

    def is_initializing(self) -> bool:
        """True while the module runs under ``init``/``init_with_output`` (flax's
        ``Module.is_initializing``)."""
        return bool(getattr(self._need_scope("is_initializing"), "initializing", False))

    @property
    def variables(self) -> dict:
        return self._need_scope("variables").variables()

    # --- entry points --------------------------------------------------------------------------
    def _clone_bound(self, scope: ModuleScope) -> "Module":
        fields = {n: getattr(self, n) for n in _field_info(type(self))[1]}
        stack = _ctx.stack
        if not stack:
            m = type(self)(**fields)
        else:
            saved = list(stack)
            stack.clear()  # the clone is a root: it must not attach to a caller's module
            try:
                m = type(self)(**fields)
            finally:
                stack.extend(saved)
        object.__setattr__(m, "_scope", scope)
        return m

    def _run(self, variables, rngs, mutable, method, args, kwargs, initializing=False,
             capture=None):
        if rngs is not None and not isinstance(rngs, dict):
            rngs = {"params": rngs}
        root_rngs = {}
        for k, v in (rngs or {}).items():
            # an Array key stays on its device (under jit it is traced: make_rng's fold_in
            # reads it in an op node at each call), a host key becomes uint32[2]
            key = v if type(v) is Array else np.asarray(v)
            if tuple(key.shape) != (2,):
                raise TypeError(f"rngs['{k}'] must be a PRNG key (uint32[2]); got shape "
                                f"{tuple(key.shape)}")
            if type(key) is Array and key.dtype == np.uint32:
                root_rngs[k] = key
            else:
                root_rngs[k] = np.asarray(key).astype(np.uint32)
        # ModuleScope(variables, root_rngs, mutable) with its __init__ bodies inline (the same
        # attributes, in the same order; root_rngs is this call's own dict)
        scope = _scope_made(variables if variables is not None else {},
                            dict.fromkeys(root_rngs), mutable, (), root_rngs,
                            dict.fromkeys(root_rngs, 0), initializing, {})
        bound = self._clone_bound(scope)
        if method is None:
            fn = type(bound).__call__
        elif isinstance(method, str):
            fn = getattr(type(bound), method)
        elif isinstance(method, types.MethodType) and isinstance(method.__self__, Module):
            fn = method.__func__   # method=model.encode: run it on the bound clone, as Flax does
        else:
            fn = method
        stack = _ctx.capture        # _capture_stack(), inline
        if stack is None:
            stack = _capture_stack()
        stack.append(capture)
        scopes = _scope_tls.scopes      # `with scope:` (Scope.__enter__/__exit__), inline
        if scopes is None:
            scopes = _scope_tls.scopes = []
        scopes.append(scope)
        try:
            out = fn(bound, *args, **kwargs)
        finally:
            scopes.pop()
            stack.pop()
        # the bound tree is a cycle (parents hold children, children their parent): where
        # nothing references it any more, the cycle is cut so it is freed now rather than by
        # the cycle collector (py_module.c's module_release)
        holder = [bound]
        del bound
        _module_release(holder)
        return out, scope._variables    # scope.variables() (the root's: path ())

    def init_with_output(self, rngs, *args, method=None, mutable=DenyList("intermediates"),
                         capture_intermediates=False, **kwargs):
        """``(output, variables)`` of running the model with fresh variables."""
        check_filter(mutable, "init: mutable")
        capture = _capture_filter(capture_intermediates)
        if capture is not None:
            mutable = union_filters(mutable, "intermediates")
        out, variables = self._run({}, rngs, mutable, method, args, kwargs, initializing=True,
                                   capture=capture)
        return out, {k: v for k, v in variables.items() if in_filter(mutable, k)}

    def init(self, rngs, *args, method=None, mutable=DenyList("intermediates"),
             capture_intermediates=False, **kwargs) -> dict:
        """Create the variables: ``{'params': ..., 'params_axes': ..., ...}``.

        ``rngs`` is a key (the ``'params'`` stream) or ``{'params': key, 'dropout': key}``.
        As in Flax, every collection is mutable except ``'intermediates'`` (values sown
        there during init are dropped; pass ``mutable=True`` to keep them).
        ``capture_intermediates``: as :meth:`apply`'s.
        """
        return self.init_with_output(rngs, *args, method=method, mutable=mutable,
                                     capture_intermediates=capture_intermediates, **kwargs)[1]

    def apply(self, variables: dict, *args, rngs=None, method=None, mutable=False,
              capture_intermediates=False, **kwargs):
        """Run the model with ``variables``; with ``mutable`` also return the updated ones.

        ``capture_intermediates`` (Flax's): ``True`` sows the return value of every module's
        ``__call__`` into ``'intermediates'`` under the name ``'__call__'`` (a tuple, one
        entry per call), a function ``(module, method_name) -> bool`` chooses the methods
        instead; ``'intermediates'`` is then mutable, so the result is ``(output, variables)``.
        """
        if not isinstance(variables, dict):
            raise TypeError(f"apply: variables must be a dict of collections, got {type(variables).__name__}")
        if mutable is False and capture_intermediates is False:
            capture = None      # (what the checks below give for these)
        else:
            check_filter(mutable, "apply: mutable")
            capture = _capture_filter(capture_intermediates)
            if capture is not None:
                mutable = union_filters(mutable, "intermediates")
        vs = _copy_tree_c(variables)    # ({k: _copy_tree(v) for k, v in variables.items()})
        out, new_vars = self._run(vs, rngs, mutable, method, args, kwargs, capture=capture)
        if mutable is False:
            return out
        keep = {k: v for k, v in new_vars.items() if in_filter(mutable, k)}
        return out, keep

    def bind(self, variables: dict, *args, rngs=None, mutable=False) -> "Module":
        """A copy of this module bound to ``variables`` (flax's ``Module.bind``): its
        methods can be called directly, e.g. ``model.bind({'params': p}).encode(x)``."""
        if not isinstance(variables, dict):
            raise TypeError(f"bind: variables must be a dict of collections, got "
                            f"{type(variables).__name__}")
        check_filter(mutable, "bind: mutable")
        if rngs is not None and not isinstance(rngs, dict):
            rngs = {"params": rngs}
        root_rngs = {k: np.asarray(v).astype(np.uint32) for k, v in (rngs or {}).items()}
        scope = ModuleScope(_copy_tree_c(variables), root_rngs, mutable)
        return self._clone_bound(scope)

    def __repr__(self):
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in _field_info(type(self))[1]
                           if n != "name")
        return f"{type(self).__name__}({fields})"

    def tabulate(self, rngs, *args, depth=None, show_repeated=False, mutable=None,
                 console_kwargs=None, table_kwargs=None, column_kwargs=None,
                 compute_flops=False, compute_vjp_flops=False, **kwargs) -> str:
        """Flax's ``Module.tabulate``: the summary table of ``self.init(rngs, *args,
        **kwargs)`` as a string (:func:`ctrainstate.nn.tabulate`: the module calls, their
        inputs and outputs, each module's variables and Flax's parameter counts).

        >>> import numpy as np
        >>> from ctrainstate import nn, random
        >>> print(nn.Dense(3).tabulate(random.PRNGKey(0), np.ones((2, 4), np.float32)).strip().splitlines()[-1].strip())
        Total Parameters: 15 (60 B)
        """
        return tabulate(self, rngs, depth=depth, show_repeated=show_repeated, mutable=mutable,
                        console_kwargs=console_kwargs, table_kwargs=table_kwargs,
                        column_kwargs=column_kwargs, compute_flops=compute_flops,
                        compute_vjp_flops=compute_vjp_flops)(*args, **kwargs)

    # --- equality and hashing: Flax's dataclass semantics ------------------------------------
    def _eq_key(self) -> tuple:
        """What two modules of one class are compared and hashed by, as Flax's dataclasses:
        every field (``name`` included) and the parent module. The parent counts by identity
        (Flax compares it as a field, which recurses without end between a parent and the
        children among its fields); it is the same object for siblings anyway."""
        return tuple([getattr(self, n) for n in _field_info(type(self))[1]]) + (
            _Identity(self._parent),)

    def __eq__(self, other):
        """Flax's: modules of the same class with equal fields (hyperparameters and ``name``)
        and the same parent are equal, so ``nn.Dense(3) == nn.Dense(3)`` and a module equals
        its ``clone()``; two submodules of one parent differ by their names.

        >>> from ctrainstate import nn
        >>> nn.Dense(3) == nn.Dense(3), nn.Dense(3) == nn.Dense(4), nn.Dense(3).clone() == nn.Dense(3)
        (True, False, True)
        """
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._eq_key() == other._eq_key()

    def __hash__(self):
        """The hash of :meth:`__eq__`'s key (Flax's ``unsafe_hash``), so modules can be the
        static arguments of ``jit`` or dictionary keys; a module holding an unhashable
        attribute (a list, an array) raises ``TypeError`` saying which."""
        key = self._eq_key()
        try:
            return hash(key)
        except TypeError:
            names = list(_field_info(type(self))[1]) + ["parent"]
            bad = []
            for n, v in zip(names, key):
                try:
                    hash(v)
                except TypeError:
                    bad.append(f"{n} ({type(v).__name__})")
            raise TypeError(f"Failed to hash {type(self).__name__}: its attribute(s) "
                            f"{', '.join(bad)} are unhashable; pass tuples instead of lists, "
                            f"or leave the module out of static arguments") from None


_base_setup = Module.setup
_base_try_setup = Module._try_setup
# the common cases of a method call and of a submodule's attach, in C (py_module.c); what
# they decline goes to _call_method and _bind_new
_C.module_setup(_ctx, Module, _Frame, ModuleScope, Module._attach, Module._adopt_fields, _base_setup,
                _base_try_setup, _plain_fields_info, _call_method, _bind_new, _adopt_tail)


class _Identity:
    """A value that compares and hashes by the identity of what it holds."""
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)


_SCALARS = frozenset({int, float, complex, str, bytes, bool, type(None)})


def _freeze_attr(val):
    """A bound module's attribute as Flax keeps it (``_freeze_attr``): lists become tuples and
    dicts ``FrozenDict``, recursively (namedtuples and PartitionSpecs keep their type)."""
    if isinstance(val, dict):
        return FrozenDict({k: _freeze_attr(v) for k, v in val.items()})
    if isinstance(val, tuple):
        if hasattr(val, "_fields") or type(val).__name__ == "PartitionSpec":
            return type(val)(*[_freeze_attr(v) for v in val])
        return tuple(_freeze_attr(v) for v in val)
    if isinstance(val, list):
        return tuple(_freeze_attr(v) for v in val)
    return val


def _copy_tree(d):
    """``d`` with every dict in it copied (a plain dict; leaves kept as they are). The
    reference of ``_C.copy_tree`` (py_module.c), which apply and bind use."""
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():   # (a leaf is kept as it is: recurse into dicts only)
            if isinstance(v, dict):
                # the next level inline (a model's variables: collection -> module -> leaf)
                sub = {}
                for k2, v2 in v.items():
                    sub[k2] = _copy_tree(v2) if isinstance(v2, dict) else v2
                v = sub
            out[k] = v
        return out
    return d


# --- parameter placement ---------------------------------------------------------------------

def _accepts_out_sharding(fn) -> bool:
    if getattr(fn, "_ct_out_sharding", False):
        return True
    try:
        return "out_sharding" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


_MISS = object()
# Per scope class: whether it keeps Scope's methods that _existing_param stands for
_PLAIN_SCOPES: dict = {}
_SCOPE_PARAM_METHODS = ("param", "reserve", "_collection", "has_variable", "get_variable",
                        "_check_param_shape")


def _existing_param(scope, name, init_fn, init_args):
    """``scope.param(name, _placing(init_fn), *init_args)`` for a parameter that exists and
    passes the checks (the name free, the shape the initializer makes), less its Python calls
    (the declaration at every ``apply`` of ``nn.Dense`` and kin): the value, its name now
    reserved, or ScopeParamShapeError as scope.param raises it; or ``_MISS``, having changed
    nothing, where ``scope.param`` must run (its class overrides one of the methods this
    stands for, a new parameter, a name in use: it creates or raises). The expected shapes are those of ``init_fn`` itself (placing a
    value does not change its shape), found by identity where it was seen before."""
    cls = type(scope)
    plain = _PLAIN_SCOPES.get(cls)
    if plain is None:
        plain = _PLAIN_SCOPES[cls] = isinstance(scope, Scope) and all(
            getattr(cls, m) is getattr(Scope, m) for m in _SCOPE_PARAM_METHODS)
    if not plain or type(name) is not str:
        return _MISS
    reserved = scope._reserved
    rkey = ("params", name)
    if rkey in reserved or name in reserved or name in scope._children:
        return _MISS
    d = scope._variables.get("params")      # scope._collection("params", create=False)
    for p in scope.path:
        if d is None:
            break
        d = d.get(p)
    if d is None or name not in d:
        return _MISS
    value = d[name]
    expected = _expected_shapes_cached(init_fn, init_args, {})
    reserved.add(rkey)                          # (scope.reserve: the name was free)
    if expected is not None:                    # scope._check_param_shape
        if type(value) is Array and len(expected) == 1:
            if value.shape == expected[0]:      # (one Array: its shape, a tuple)
                return value
        for got, want in zip(_param_leaves(value), expected):
            if tuple(np.shape(got)) != want:
                raise ScopeParamShapeError(name, scope.path_text, want, tuple(np.shape(got)))
    return value


# Module.param in C for _existing_param's case (py_rules.c: ModuleParam, whose conditions are
# those above, the module bound and declaring and no strict rules besides): the declaration
# of an existing parameter at every apply of nn.Dense and kin runs no Python; every other call
# runs the Python method, which stays the reference.
_python_param = Module.param
Module.param = functools.update_wrapper(_C.ModuleParam(_python_param), _python_param)
_C.module_param_setup(Module, _ctx, _spmd._strict, _PLAIN_SCOPES, _SHAPES_BY_ID, Array)

# Module.apply in C for a call without keywords (py_rules.c: ModuleApply; py_module.c:
# module_apply does apply -> _run -> _clone_bound's work where the variables are a plain dict,
# the class keeps _run and _clone_bound and no module method runs on this thread); every other
# call runs the Python method, which stays the reference.
_python_apply = Module.apply
Module.apply = functools.update_wrapper(_C.ModuleApply(_python_apply), _python_apply)
_C.module_apply_setup(_scope_tls, Module._run, Module._clone_bound)


def _placing(init_fn: Callable) -> Callable:
    """Wrap an initializer so the parameter it makes is an Array placed as described above.
    One wrapper per initializer object (kept in _PLACING while it is stored): a module's
    initializer is the same object at every call (a field's default, ``nn.Dense``'s
    ``kernel_init``), and so is its wrapper, which the scope's shape check then finds by
    identity (scope._expected_shapes_cached) instead of building its key again."""
    entry = _PLACING.get(id(init_fn))
    if entry is not None and entry[0] is init_fn:
        return entry[1]

    def init(key, *args, **kwargs):
        value = init_fn(key, *args, **kwargs)
        return _place(value)
    if len(_PLACING) >= _PLACING_MAX:
        _PLACING.clear()
    _PLACING[id(init_fn)] = (init_fn, init)   # (holds init_fn: its id is not reused)
    return init


_PLACING: dict = {}
_PLACING_MAX = 1024


def _place(value):
    if meta.is_axis_metadata(value):
        return value  # boxes (with_partitioning...) place themselves when created
    if isinstance(value, Array):
        return value
    if isinstance(value, (np.ndarray, np.generic, float, int)):
        return device_put(np.asarray(value))
    return value


def sharded_initializer(init_fn: Callable, sharding, check_shape: Callable | None = None
                        ) -> Callable:
    """``init_fn`` producing its value directly with ``sharding``.

    ctrainstate initializers generate each device's block in place
    (``out_sharding=``); other callables run on the host and their result is
    scattered with ``device_put`` (never gathered on one device). Under ``jit``
    a dimension the sharding's mesh axes do not divide is replicated (see
    :func:`ctrainstate.nn.spmd._replicate_uneven`). ``check_shape(shape)``, when
    given, sees the value's shape before anything is placed (it raises to refuse it).
    """
    if sharding is None:
        return init_fn

    def init(key, *args, **kwargs):
        if _accepts_out_sharding(init_fn):
            shape = _shape_argument(args, kwargs)
            target = sharding
            if shape is not None:
                if check_shape is not None:
                    check_shape(shape)
                target = _replicate_uneven(sharding, shape)
            return init_fn(key, *args, out_sharding=target, **kwargs)
        value = init_fn(key, *args, **kwargs)
        if not isinstance(value, Array):
            value = np.asarray(value)
        if check_shape is not None:
            check_shape(tuple(value.shape))
        return device_put(value, _replicate_uneven(sharding, tuple(value.shape)))
    return init


def _shape_argument(args, kwargs):
    """The shape an initializer of the ``init(key, shape, dtype, out_sharding=None)``
    convention was asked for, as a tuple of ints; None when the call does not have one."""
    shape = kwargs["shape"] if "shape" in kwargs else (args[0] if args else None)
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        return (int(shape),)
    if not isinstance(shape, (tuple, list)):
        return None
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in shape):
        return None
    return tuple(int(d) for d in shape)


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
