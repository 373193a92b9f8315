"""The implementation of :mod:`ctrainstate.nn.transforms` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import functools
import inspect

from ..autodiff import remat as _remat
from . import module as _module
from . import scope as _scope
from .module import Module
from ..ops import ops as _ops

__all__ = ["remat", "checkpoint"]


def _scopes(scope):
    yield scope
    for child in list(scope._children.values()):
        yield from _scopes(child)


def _rng_counters(scope) -> dict:
    return {id(s): (s, dict(getattr(s, "rng_counters", {}))) for s in _scopes(scope)}


def _set_counters(scope, saved: dict):
    """Put every scope under ``scope`` back to its counters in ``saved``; scopes created
    since (not in ``saved``) start from zero again, as they did."""
    for s in _scopes(scope):
        if not hasattr(s, "rng_counters"):
            continue
        hit = saved.get(id(s))
        s.rng_counters = dict(hit[1]) if hit is not None and hit[0] is s else \
            {k: 0 for k in s.rng_counters}


def _compact_state(module):
    """What a compact method's run changes in its module (auto-name counts, the names and
    variables declared in this call), to run it again from the same point."""
    return (dict(module._auto_counts or {}), set(module._call_names or ()),
            set(module._scope._reserved))


def _put_compact_state(module, state):
    object.__setattr__(module, "_auto_counts", dict(state[0]))
    object.__setattr__(module, "_call_names", set(state[1]))
    module._scope._reserved.clear()
    module._scope._reserved.update(state[2])


def _checkpointed(method, name: str, static_argnums, lifted_fn: bool = False):
    """``method(self, ...)`` rematerialised. ``lifted_fn``: a function given to ``nn.remat``
    (Flax's function form, or a method decorated with ``@nn.remat``), which runs inside its
    module's frame: the module's compact state is put back before the rerun too, so the
    second run makes the same submodule names (``Dense_0``, not ``Dense_2``)."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        if lifted_fn and not isinstance(self, Module):
            raise TypeError(f"nn.remat({name}): a function target takes a Module as its "
                            f"first argument (as in Flax), got {type(self).__name__}")
        if self._scope is None or _ops._tape() is None or _remat.in_rerun():
            return method(self, *args, **kwargs)  # nothing to save (init, plain apply)
        frames = list(_module._module_stack())
        scopes = list(getattr(_scope._stack, "scopes", None) or [])
        before = _rng_counters(self._scope)
        compact0 = _compact_state(self) if lifted_fn else None
        writes = getattr(_scope._stack, "writes", 0)

        def call(*a, **k):
            return method(self, *a, **k)

        def before_rerun():
            # the module tree and RNG counters as at the first run: the same names, the
            # same dropout keys
            mstack, sstack = _module._module_stack(), _scope._stack.__dict__.get("scopes")
            if sstack is None:   # (set as an attribute: the C readers' memo hears of it)
                sstack = _scope._stack.scopes = []
            token = (list(mstack), list(sstack), _rng_counters(self._scope),
                     _compact_state(self) if lifted_fn else None)
            mstack[:] = frames
            sstack[:] = scopes
            _set_counters(self._scope, before)
            if lifted_fn:
                _put_compact_state(self, compact0)
            return token

        def after_rerun(token):
            mstack, sstack = _module._module_stack(), _scope._stack.scopes
            mstack[:], sstack[:] = token[0], token[1]
            _set_counters(self._scope, token[2])
            if lifted_fn:
                _put_compact_state(self, token[3])

        out = _remat.remat_call(call, args, kwargs, before_rerun, after_rerun)
        if getattr(_scope._stack, "writes", 0) != writes:
            raise NotImplementedError(
                f"nn.remat: {type(self).__name__}.{name} at {self._scope.path_text} wrote to a "
                f"mutable collection (batch statistics, sow, a cache) while being "
                f"differentiated; ctrainstate's remat runs the module again in the backward "
                f"pass and cannot replay such updates. Apply it with those collections "
                f"immutable, or without nn.remat.")
        return out
    if not lifted_fn:
        wrapped._ct_wrapped = True  # Module.__init_subclass__ must not wrap it again
    # (a lifted function is left to it: as a method, the module's frame is entered first)
    return wrapped


def remat(target, variables=True, rngs=True, concrete: bool = False, prevent_cse: bool = True,
          static_argnums=(), policy=None, methods=None):
    """Like ``flax.linen.remat`` (alias ``checkpoint``): a subclass of the Module class
    ``target`` named ``Checkpoint<Name>`` whose ``methods`` (default ``__call__``) are
    rematerialised (see the module docstring). A function ``target`` whose first argument
    is a Module is Flax's function form: ``@nn.remat`` over ``@nn.compact def __call__``
    (the module's own names and parameters, no ``Checkpoint`` prefix), or
    ``nn.remat(lambda mdl, x: mdl(x))(submodule, x)``.

    ``variables``, ``rngs``, ``concrete``, ``prevent_cse`` and ``static_argnums`` are
    accepted for Flax's signature: all collections and RNG streams are visible to the
    module as without remat, and nothing is traced, so nothing is static. ``policy``: as
    :func:`ctrainstate.checkpoint`. A module that writes a mutable collection while being
    differentiated (batch statistics, ``sow``) raises ``NotImplementedError``.
    """
    is_class = isinstance(target, type) and issubclass(target, Module)
    # (a module method, Model.__call__, is a function wrapped as a _C.ModuleMethod)
    if not is_class and not (inspect.isfunction(target) or _module._is_module_method(target)):
        raise TypeError(
            f"nn.remat: expected a Module class (e.g. nn.remat(nn.Dense)) or a function whose "
            f"first argument is a Module (a method), got {target!r}; for a function of arrays "
            f"use ctrainstate.checkpoint")
    if concrete:
        raise NotImplementedError("nn.remat(concrete=True) is deprecated in Flax and not supported")
    saves_all = _remat._check_policy(policy)
    static = _remat._check_static(static_argnums, "nn.remat")
    if not is_class:
        if methods is not None:
            raise TypeError("nn.remat: methods= applies to a Module class target only")
        return target if saves_all else _checkpointed(target, target.__name__, static,
                                                      lifted_fn=True)
    if methods is None:
        methods = ("__call__",)
    elif isinstance(methods, str):
        methods = (methods,)
    body = {"__module__": target.__module__, "__doc__": target.__doc__}
    for m in methods:
        fn = getattr(target, m, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"nn.remat: {target.__name__} has no method {m!r}")
        if not saves_all:
            body[m] = _checkpointed(fn, m, static)
    return type(f"Checkpoint{target.__name__}", (target,), body)


checkpoint = remat


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
