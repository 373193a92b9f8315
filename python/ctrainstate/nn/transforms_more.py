"""More lifted transforms of ``flax.linen``: ``map_variables``, ``vjp``, ``value_and_grad``,
``grad``, ``jvp``, ``cond``, ``switch``, ``while_loop``, ``jit``, and the function forms
``apply`` / ``init`` / ``init_with_output``, ``share_scope`` and the ``named_call`` family.

Each direct transform (``nn.vjp(fn, mdl, *args)``, ``nn.cond(pred, f, g, mdl, *args)``...)
runs ``fn`` on a clone of the bound module ``mdl``, on a scope that sees ``mdl``'s variables
(the ``variables`` filter, all by default) and shares ``mdl``'s RNG counters, its children's
included, as Flax's ``pack`` does (so the branches of ``nn.switch`` draw the keys of one
submodule one after the other); the mutable collections it writes are published back to
``mdl``. ``fn`` runs like an ``@compact`` method of the clone: it may create submodules and
parameters.

ctrainstate runs eagerly, so nothing is traced: ``nn.jit`` calls the module on a scope
with Flax's jit keys (see :func:`jit`), ``nn.cond`` / ``nn.switch`` run every branch as ``lax.cond`` traces them (the
branches not taken without recording for autodiff, their writes dropped), and
``nn.while_loop`` is a host loop.

>>> import numpy as np
>>> from ctrainstate import nn, random
>>> class Foo(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         y, bwd = nn.vjp(lambda mdl, x: mdl(x), nn.Dense(2), x)
...         params_grad, x_grad = bwd(np.ones((1, 2), np.float32))
...         return y, params_grad, x_grad
>>> v = Foo().init(random.PRNGKey(0), np.ones((1, 3), np.float32))
>>> y, pg, xg = Foo().apply(v, np.ones((1, 3), np.float32))
>>> pg['params']['kernel'].shape, xg.shape
((3, 2), (1, 3))
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Mapping

import numpy as np

from .._src.ops import ops as _ops
from .._src.base.tree_util import tree_flatten, tree_unflatten
from .._src.nn import module as _module
from .._src.nn.lifted import (_Intersection, _LiftedScope, _Union, _clone_on, _copy_dicts, _nest,
                              _no_adopt, _no_tape, _present, _seed_store, _write_back)
from .._src.nn.module import Module
from .._src.nn.scope import DenyList, in_filter
from .._src.numpy_lax.lax_control import (_check_carry, _check_same_outputs, _host_scalar,
                                          _predicate)

__all__ = ["map_variables", "vjp", "value_and_grad", "grad", "jvp", "cond", "switch",
           "while_loop", "jit", "apply", "init", "init_with_output", "share_scope",
           "named_call", "enable_named_call", "disable_named_call", "override_named_call"]


# --- running a function on a clone of a bound module ----------------------------------------

class _Not:
    """A filter matching what ``f`` does not."""
    __slots__ = ("f",)

    def __init__(self, f):
        self.f = f

    def __contains__(self, col):
        return not in_filter(self.f, col)


def _empty_filter(f) -> bool:
    if f is False:
        return True
    if isinstance(f, (list, tuple, set, frozenset)):
        return len(f) == 0
    return False


def _bound(mdl, who):
    if not isinstance(mdl, Module):
        raise TypeError(f"nn.{who}: expected a Module (the one whose variables are lifted), "
                        f"got {type(mdl).__name__}")
    _module._require_bound(mdl, f"nn.{who} needs a module bound to a parent: create it inside "
                                f"a compact method or setup, and call nn.{who} from a method "
                                f"running under init/apply")
    mdl._try_setup()
    return mdl._scope


def _as_method(fn):
    """``fn(module, *args)`` run as an ``@compact`` method of the module it is given."""
    if getattr(fn, "_ct_wrapped", False):
        return fn

    @functools.wraps(fn)
    def body(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    body._ct_compact = True
    return _module._wrap_method(body)


def _variables_of(S, variables) -> dict:
    return {c: _copy_dicts(t) for c, t in _present(S).items() if in_filter(variables, c)}


def _run(mdl, method, args, kwargs, variables: dict, mutable, rngs=None, cls=None,
         scope_cls=_LiftedScope):
    """``method(clone, *args, **kwargs)`` on a clone of ``mdl`` bound to a fresh scope at
    ``mdl``'s path with ``variables`` (collection -> tree at that path). The RNG counters of
    the scope and of every scope below it are ``mdl``'s (Flax keeps a child's counters in its
    parent's, under the child's name, and a lifted scope shares ``mdl``'s): the branches of a
    switch draw one after the other. Returns (out, scope)."""
    S = mdl._scope
    store = _seed_store(S)
    inner = scope_cls({col: _nest(S.path, t) for col, t in variables.items()},
                         S.root_rngs if rngs is None else rngs, mutable, S.path, store)
    inner.initializing = getattr(S, "initializing", False)
    clone = _clone_on(mdl, cls if cls is not None else type(mdl), inner)
    with inner:
        out = method(clone, *args, **kwargs)
    _write_back(S, store)
    return out, inner


def _written(inner) -> dict:
    """The mutable collections of a run's scope, at its path."""
    out = {}
    for col in list(inner._variables):
        if in_filter(inner.mutable, col):
            d = inner._collection(col, create=False)
            if d is not None:
                out[col] = d
    return out


def _publish(S, cols: dict):
    for col, tree in cols.items():
        if not S.is_mutable_collection(col):
            continue
        for name, value in tree.items():
            S.put_variable(col, name, value)


# --- map_variables -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _MapConfig:
    mapped_collections: Any = True
    trans_in_fn: Callable = lambda x: x
    trans_out_fn: Callable = lambda x: x
    init: bool = False
    mutable: bool = False
    rngs: Any = True
    variables: Any = True


def _map_call(mdl, method, cfg: _MapConfig, args, kwargs, cls=None):
    """Flax's ``lift.map_variables``: with ``init`` (and something mutable) ``method`` first
    runs on the variables as they are (creating them); then on ``trans_in_fn(mapped
    collections)`` (the others as they are), the mapped collections immutable unless ``init``
    or ``mutable``; with either, the mapped collections it leaves go through ``trans_out_fn``
    and are written back."""
    S = mdl._scope
    mapped = cfg.mapped_collections
    visible = _Union(mapped, cfg.variables)
    if cfg.init and not _empty_filter(S.mutable):
        _, inner = _run(mdl, method, args, kwargs, _variables_of(S, visible),
                        _Intersection(S.mutable, visible), cls=cls)
        _publish(S, _written(inner))
    present = _variables_of(S, visible)
    target = {c: t for c, t in present.items() if in_filter(mapped, c)}
    rest = {c: t for c, t in present.items() if not in_filter(mapped, c)}
    target = cfg.trans_in_fn(target)
    out_target = cfg.mutable or cfg.init
    mut = _Intersection(S.mutable, visible) if out_target else \
        _Intersection(S.mutable, cfg.variables, _Not(mapped))
    y, inner = _run(mdl, method, args, kwargs, {**rest, **dict(target)}, mut, cls=cls)
    written = _written(inner)
    if out_target:
        mapped_out = cfg.trans_out_fn({c: t for c, t in written.items() if in_filter(mapped, c)})
        _publish(S, dict(mapped_out))
    _publish(S, {c: t for c, t in written.items() if not in_filter(mapped, c)})
    return y


def _lifted_class(target, methods, kind: str, make):
    """A subclass of the Module class ``target`` whose ``methods`` (``__call__`` by default; a
    name or several) are ``make(method)``, named as Flax names its lifted classes
    (``Jit<Name>``, ``Map_variables<Name>``)."""
    names = ("__call__",) if methods is None else \
        ((methods,) if isinstance(methods, str) else tuple(methods))
    body = {"__module__": target.__module__, "__doc__": target.__doc__,
            "_adopt_fields": _no_adopt}
    for m in names:
        fn = getattr(target, m, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"nn.{kind}: {target.__name__} has no method {m!r}")
        body[m] = make(fn)
    return type(f"{kind[0].upper()}{kind[1:]}{target.__name__}", (target,), body)


def map_variables(target, mapped_collections=True, trans_in_fn: Callable = lambda x: x,
                  trans_out_fn: Callable = lambda x: x, init: bool = False,
                  mutable: bool = False, rngs=True, variables=True, methods=None):
    """``flax.linen.map_variables``: ``target`` (a Module class, or a function
    ``fn(module, *args)``) seeing its ``mapped_collections`` through ``trans_in_fn``
    (``{collection: tree} -> {collection: tree}``), e.g. a masked kernel; with ``init`` (pass
    ``self.is_initializing()``) the variables are first created untransformed, and with
    ``init`` or ``mutable`` the mapped collections it writes go back through
    ``trans_out_fn``. A Module class gives ``Map_variables<Name>`` (Flax's name) whose
    ``methods`` (default ``__call__``) are mapped.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> from ctrainstate import nn, random
    >>> upper = np.triu(np.ones((3, 3), np.float32))
    >>> class CausalDense(nn.Module):
    ...     def setup(self):
    ...         mask = lambda vs: {'params': {**vs['params'],
    ...                            'kernel': cnp.multiply(vs['params']['kernel'], upper)}}
    ...         self.dense = nn.map_variables(nn.Dense, 'params', mask,
    ...                                       init=self.is_initializing())(3, use_bias=False)
    ...     def __call__(self, x):
    ...         return self.dense(x)
    >>> v = CausalDense().init(random.PRNGKey(0), np.ones((1, 3), np.float32))
    >>> float(np.asarray(v['params']['dense']['kernel'])[2, 0])    # stored masked at init, as Flax
    0.0
    """
    cfg = _MapConfig(mapped_collections, trans_in_fn, trans_out_fn, bool(init), bool(mutable),
                     rngs, variables)
    if isinstance(target, type) and issubclass(target, Module):
        return _lifted_class(target, methods, "map_variables",
                             lambda fn: _mapped_method(target, fn, cfg))
    if not callable(target):
        raise TypeError(f"nn.map_variables: expected a Module class or a function of a module, "
                        f"got {target!r}")
    method = _as_method(target)

    @functools.wraps(target)
    def mapped(mdl, *args, **kwargs):
        _bound(mdl, "map_variables")
        return _map_call(mdl, method, cfg, args, kwargs)
    mapped._ct_wrapped = True
    return mapped


def _mapped_method(target, fn, cfg):
    @functools.wraps(fn)
    def wrapped(self, *args, **kwargs):
        _module._require_bound(self)
        return _map_call(self, fn, cfg, args, kwargs, cls=target)
    wrapped._ct_wrapped = True
    return wrapped


# --- autodiff ------------------------------------------------------------------------------------

def _tracked_leaves(tree, tape, who):
    leaves, td = tree_flatten(tree)
    new = []
    for leaf in leaves:
        x = leaf if isinstance(leaf, _ops.Array) else _ops._lift(leaf)
        if x.dtype not in _ops._FLOATS:
            raise TypeError(f"nn.{who}: differentiates float inputs, got {x.dtype}")
        x = _ops._alias(x)
        tape.track(x)
        new.append(x)
    return new, td


def _grads_of(cot, leaves, td):
    return tree_unflatten(td, [cot.get(id(x)) if cot.get(id(x)) is not None
                               else _ops.zeros_like(x) for x in leaves])


def _vjp_core(fn, mdl, primals, has_aux, vjp_variables, variables, who):
    """Run ``fn(clone, *primals)`` on a tape tracking ``primals`` and the ``vjp_variables``
    of ``mdl``; returns ``(y, aux, backward)`` with ``backward(ct) -> (vars_grad, *grads)``."""
    S = _bound(mdl, who)
    method = _as_method(fn)
    vis = _variables_of(S, _Union(vjp_variables, variables))
    dvars = {c: t for c, t in vis.items() if in_filter(vjp_variables, c)}
    other = {c: t for c, t in vis.items() if not in_filter(vjp_variables, c)}
    tape, stack = _ops._open_tape()
    v_leaves, v_td = _tracked_leaves(dvars, tape, who)
    p_flat = [_tracked_leaves(p, tape, who) for p in primals]
    args = tuple(tree_unflatten(td, lv) for lv, td in p_flat)
    stack.append(tape)
    try:
        res, inner = _run(mdl, method, args, {}, {**other, **tree_unflatten(v_td, v_leaves)},
                          _Intersection(S.mutable, _Union(vjp_variables, variables)))
    finally:
        stack.pop()
    _publish(S, _written(inner))
    y, aux = res if has_aux else (res, None)

    def backward(ct):
        y_leaves, y_td = tree_flatten(y)
        c_leaves, c_td = tree_flatten(ct)
        if c_td != y_td:
            raise ValueError(f"nn.{who}: the cotangent's structure {c_td} is not the "
                             f"output's {y_td}")
        seeds = {}
        for yl, cl in zip(y_leaves, c_leaves):
            if not isinstance(yl, _ops.Array) or id(yl) not in tape.tracked:
                continue
            c = _ops._lift(cl, _ops._place_of(yl))
            if tuple(c.shape) != tuple(yl.shape):
                raise ValueError(f"nn.{who}: a cotangent of shape {tuple(c.shape)} for an "
                                 f"output of shape {tuple(yl.shape)}")
            if c.dtype != yl.dtype:
                c = _ops._convert(c, yl.dtype)
            seeds[id(yl)] = _ops.add(seeds[id(yl)], c) if id(yl) in seeds else c
        with _no_tape():
            cot = _ops._backward(tape, None, seeds=seeds)
            vg = _grads_of(cot, v_leaves, v_td)
            pg = tuple(_grads_of(cot, lv, td) for lv, td in p_flat)
        return (vg,) + pg
    return y, aux, backward


def vjp(fn: Callable, mdl: Module, *primals, has_aux: bool = False, reduce_axes=(),
        vjp_variables="params", variables=True, rngs=True, multi_scope: bool = False):
    """``flax.linen.vjp``: ``(fn(mdl, *primals), vjp_fn)`` (``(y, vjp_fn, aux)`` with
    ``has_aux``), where ``vjp_fn(cotangent)`` returns ``(vars_grad, *primals_grad)`` --
    ``vars_grad`` the cotangents of ``mdl``'s ``vjp_variables`` collections (``{'params':
    ...}``). One forward pass is recorded; ``vjp_fn`` may be called several times."""
    if reduce_axes:
        raise NotImplementedError("reduce_axes argument to vjp is deprecated")
    y, aux, backward = _vjp_core(fn, mdl, primals, has_aux, vjp_variables, variables, "vjp")
    return (y, backward, aux) if has_aux else (y, backward)


def value_and_grad(fn: Callable, mdl: Module, *primals, has_aux: bool = False, reduce_axes=(),
                   variables=True, rngs=True):
    """``flax.linen.value_and_grad``: ``(y, grads)`` (``((y, aux), grads)`` with
    ``has_aux``), ``grads`` a tuple with the gradient of the scalar ``y = fn(mdl, *primals)``
    for each primal -- not for the module's variables (use :func:`vjp` for those)."""
    if reduce_axes:
        raise NotImplementedError("reduce_axes argument to value_and_grad is deprecated")
    y, aux, backward = _vjp_core(fn, mdl, primals, has_aux, False, variables, "value_and_grad")
    shape = tuple(getattr(y, "shape", np.shape(y)))
    if shape != ():
        raise ValueError(f"grad can only work on functions with scalar-valued outputs. out "
                         f"shape={shape}")
    grads = backward(np.ones((), np.dtype(getattr(y, "dtype", np.float32))))[1:]
    return ((y, aux), grads) if has_aux else (y, grads)


def grad(fn: Callable, mdl: Module, *primals, has_aux: bool = False, reduce_axes=(),
         variables=True, rngs=True):
    """``flax.linen.grad``: the tuple of gradients of :func:`value_and_grad` (``(grads,
    aux)`` with ``has_aux``)."""
    r, g = value_and_grad(fn, mdl, *primals, has_aux=has_aux, reduce_axes=reduce_axes,
                          variables=variables, rngs=rngs)
    return (g, r[1]) if has_aux else g


def jvp(fn: Callable, mdl: Module, primals, tangents, variable_tangents, variables=True,
        rngs=True):
    """``flax.linen.jvp`` is not available: ctrainstate's autodiff is reverse mode only (a
    tape of vector-Jacobian products), with no forward mode and no derivative of a backward
    pass to build one from. Use :func:`vjp` (a Jacobian-vector product of a function with few
    outputs is one ``vjp`` per output element)."""
    raise NotImplementedError("nn.jvp: ctrainstate has no forward-mode autodiff (reverse mode "
                              "only); use nn.vjp")


# --- control flow ----------------------------------------------------------------------------------

def _branches(who, branches, mdl, operands, pick: int, variables):
    """Run every branch in order (as lax.cond / lax.switch trace them, so the RNG counters
    advance as Flax's); only ``pick``'s run is recorded and its writes published."""
    S = _bound(mdl, who)
    outs, writes = [], []
    mut = _Intersection(S.mutable, variables)
    result = None
    for k, b in enumerate(branches):
        ctx = contextlib.nullcontext() if k == pick else _no_tape()
        with ctx:
            y, inner = _run(mdl, _as_method(b), operands, {}, _variables_of(S, variables), mut)
        outs.append(y)
        writes.append(_written(inner))
        if k == pick:
            result = (y, writes[-1])
    names = ["true_fun", "false_fun"] if who == "cond" else \
        [f"branch {k}" for k in range(len(branches))]
    _check_same_outputs(f"nn.{who}", outs, names)
    _check_same_outputs(f"nn.{who} (the variables the branches leave)", writes, names)
    _publish(S, result[1])
    return result[0]


def cond(pred, true_fun: Callable, false_fun: Callable, mdl: Module, *operands, variables=True,
         rngs=True):
    """``flax.linen.cond``: ``true_fun(mdl, *operands)`` if ``pred`` else
    ``false_fun(mdl, *operands)``. As under ``lax.cond`` both branches run (in that order:
    their variables are created at init, and must be the same, Flax's constraint); the one not
    taken without recording for autodiff, its outputs and writes dropped.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> class Foo(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x, pred):
    ...         return nn.cond(pred, lambda m, x: nn.Dense(2, name='dense')(x),
    ...                        lambda m, x: -nn.Dense(2, name='dense')(x), self, x)
    >>> x = np.ones((1, 3), np.float32)
    >>> v = Foo().init(random.PRNGKey(0), x, True)
    >>> bool((np.asarray(Foo().apply(v, x, True)) == -np.asarray(Foo().apply(v, x, False))).all())
    True
    """
    h = _host_scalar(pred, "nn.cond", "Pred")
    if h is None:
        raise TypeError("nn.cond: the predicate must be concrete (ctrainstate runs eagerly)")
    return _branches("cond", (true_fun, false_fun), mdl, operands, 0 if bool(h != 0) else 1,
                     variables)


def switch(index, branches, mdl: Module, *operands, variables=True, rngs=True):
    """``flax.linen.switch``: ``branches[index](mdl, *operands)``, ``index`` clamped to the
    branches as ``lax.switch`` does; every branch runs, as in :func:`cond`."""
    branches = tuple(branches)
    if not branches:
        raise ValueError("Empty branch sequence")
    h = _host_scalar(index, "nn.switch", "Branch index")
    if h is None or h.dtype.kind not in "iu":
        raise TypeError(f"nn.switch: the index must be a concrete integer, got {index!r}")
    i = min(max(int(h), 0), len(branches) - 1)
    return _branches("switch", branches, mdl, operands, i, variables)


def while_loop(cond_fn: Callable, body_fn: Callable, mdl: Module, init, carry_variables=False,
               broadcast_variables=True, split_rngs: Mapping = {}):
    """``flax.linen.while_loop``: ``carry = body_fn(mdl, carry)`` while ``cond_fn(mdl,
    carry)``, a host loop. ``carry_variables`` are mutable and carried from iteration to
    iteration (the final ones are written back); ``broadcast_variables`` are read-only. As in
    Flax no variable can be created inside (call ``body_fn`` once before, at init). Every
    iteration sees the RNG counters as they were before the loop (Flax traces each function
    once); ``split_rngs`` that split a stream are not supported."""
    S = _bound(mdl, "while_loop")
    if any(bool(v) for v in dict(split_rngs).values()):
        raise NotImplementedError("nn.while_loop: split_rngs={...: True} (a key folded with "
                                  "the iteration) is not supported")
    present = _present(S)
    carry_cols = {c: _copy_dicts(t) for c, t in present.items() if in_filter(carry_variables, c)}
    bcast = {c: t for c, t in present.items()
             if not in_filter(carry_variables, c) and in_filter(broadcast_variables, c)}
    snap = dict(S.rng_counters)
    cm, bm = _as_method(cond_fn), _as_method(body_fn)

    def reset():
        S.rng_counters.clear()
        S.rng_counters.update(snap)
    carry = init
    while True:
        reset()
        p, _ = _run(mdl, cm, (carry,), {}, {**bcast, **_copy_dicts(carry_cols)}, False)
        if not _predicate(p, "nn.while_loop"):
            break
        new, inner = _run(mdl, bm, (carry,), {}, {**bcast, **_copy_dicts(carry_cols)},
                          _Intersection(S.mutable, carry_variables))
        _check_carry("nn.while_loop", carry, new)
        written = _written(inner)
        for c in written:
            if c not in carry_cols:
                raise ValueError(f"nn.while_loop: collection '{c}' was created inside the loop "
                                 f"(carried variables must exist before it)")
        _check_carry("nn.while_loop (carry_variables)", carry_cols, written)
        carry_cols = {**carry_cols, **written}
        carry = new
    _publish(S, carry_cols)
    return carry


# --- jit ------------------------------------------------------------------------------------------

class _JitScope(_LiftedScope):
    """The scope a ``nn.jit`` call runs in. Flax forks the jitted module's RNG streams first
    (``fork_rngs``: each stream's key becomes ``module.make_rng(stream)``, one count of the
    module's counters) and passes them in without a path suffix, so the keys drawn inside fold
    only the path below the jitted module into the forked key: ``fold(forked, (*relative path,
    count))`` -- a parameter of ``JitDense_0`` is not the one ``Dense_0`` would get."""

    def push(self, name: str) -> "_JitScope":
        if name not in self._children:
            child = _JitScope(self._variables, self.root_rngs, self.mutable,
                              self.path + (name,), self._store, self._rel + (name,))
            child.initializing = self.initializing
            child.adopted = self.adopted
            self._children[name] = child
        return self._children[name]

    def make_rng(self, name: str = "params"):
        if name not in self.root_rngs:
            if "params" not in self.root_rngs:
                raise ValueError(f'No RNG stream "{name}" in scope "{self.path_text}"; pass '
                                 f'rngs={{"{name}": key}} to init/apply')
            name = "params"
        self.rng_counters[name] = self.rng_counters.get(name, 0) + 1
        return _module.fold_in_static(self.root_rngs[name],
                                      self._rel + (self.rng_counters[name],))


def _jit_call(mdl, method, args, kwargs, cls=None):
    S = mdl._scope
    forked = {name: S.make_rng(name) for name in list(S.root_rngs)}   # Flax's fork_rngs
    y, inner = _run(mdl, method, args, kwargs, _variables_of(S, True), S.mutable, rngs=forked,
                    cls=cls, scope_cls=_JitScope)
    _publish(S, _written(inner))
    return y


def jit(target, variables=True, rngs=True, static_argnums=(), static_argnames=(),
        donate_argnums=(), device=None, backend=None, methods=None):
    """``flax.linen.jit``: ctrainstate compiles nothing, so the module (or function of a
    module) runs eagerly, call by call, with Flax's names, variables and results: a Module
    class gives ``Jit<Name>`` (auto names ``JitDense_0``) whose ``methods`` (default
    ``__call__``) run on a scope whose RNG keys are folded as Flax's jit folds them (forked,
    then the path below the jitted module, see ``_JitScope``), so init gives Flax's
    parameters. A function ``fn(module, *args)`` (or a method decorated with ``@nn.jit``) is lifted the same way over
    ``module``. The other arguments are accepted for Flax's signature."""
    if isinstance(target, type) and issubclass(target, Module):
        return _lifted_class(target, methods, "jit", lambda fn: _jitted_method(target, fn))
    if not callable(target):
        raise TypeError(f"nn.jit: expected a Module class or a function, got {target!r}")
    method = _module._wrap_method(target) if getattr(target, "_ct_compact", False) else \
        _as_method(target)

    @functools.wraps(target)
    def jitted(mdl, *args, **kwargs):
        _bound(mdl, "jit")
        return _jit_call(mdl, method, args, kwargs)
    jitted._ct_wrapped = True
    return jitted


def _jitted_method(target, fn):
    @functools.wraps(fn)
    def wrapped(self, *args, **kwargs):
        _module._require_bound(self)
        return _jit_call(self, fn, args, kwargs, cls=target)
    wrapped._ct_wrapped = True
    return wrapped


# --- the function forms of init / apply ------------------------------------------------------

def apply(fn: Callable, module: Module, mutable=False, capture_intermediates=False):
    """``flax.linen.apply``: ``apply_fn(variables, *args, rngs=None, **kwargs)`` running
    ``fn(module, *args, **kwargs)`` with ``module`` bound to ``variables`` (``(out,
    new_variables)`` when ``mutable``), as ``module.apply(variables, ..., method=fn)``."""
    method = _module._wrap_method(fn)

    @functools.wraps(fn)
    def scope_fn(variables, *args, rngs=None, **kwargs):
        return module.apply(variables, *args, rngs=rngs, method=method, mutable=mutable,
                            capture_intermediates=capture_intermediates, **kwargs)
    return scope_fn


def init_with_output(fn: Callable, module: Module, mutable=DenyList("intermediates"),
                     capture_intermediates=False):
    """``flax.linen.init_with_output``: ``init_fn(rngs, *args, **kwargs) -> (out,
    variables)`` running ``fn(module, *args, **kwargs)`` with fresh variables."""
    method = _module._wrap_method(fn)

    @functools.wraps(fn)
    def scope_fn(rngs, *args, **kwargs):
        return module.init_with_output(rngs, *args, method=method, mutable=mutable,
                                       capture_intermediates=capture_intermediates, **kwargs)
    return scope_fn


def init(fn: Callable, module: Module, mutable=DenyList("intermediates"),
         capture_intermediates=False):
    """``flax.linen.init``: ``init_fn(rngs, *args, **kwargs) -> variables`` (see
    :func:`init_with_output`)."""
    f = init_with_output(fn, module, mutable, capture_intermediates)

    @functools.wraps(fn)
    def scope_fn(rngs, *args, **kwargs):
        return f(rngs, *args, **kwargs)[1]
    return scope_fn


# --- share_scope ------------------------------------------------------------------------------

def share_scope(module: Module, other: Module, /):
    """``flax.linen.share_scope``: ``module`` and ``other`` use one scope, so their variables
    are stored together (a LoRA wrapper whose ``A`` and ``B`` sit beside the wrapped
    ``Dense``'s ``kernel``). Called in ``setup()`` of ``module``: when ``other`` is a
    submodule of ``module`` (created in its setup) it takes ``module``'s scope, otherwise
    ``module`` takes ``other``'s. Both must be bound."""
    for m, what in ((module, "module"), (other, "other")):
        if not isinstance(m, Module) or m._scope is None:
            raise ValueError(f"nn.share_scope: {what} must be a bound Module (call it in "
                             f"setup())")
    if other._parent is module:
        name = other.name
        module._children.pop(name, None)
        module._scope._children.pop(name, None)
        module._call_names.discard(name)
        module._setup_names.discard(name)
        object.__setattr__(other, "_scope", module._scope)
        object.__setattr__(other, "name", module.name)
    else:
        object.__setattr__(module, "_scope", other._scope)


# --- named_call: profiling names only ------------------------------------------------------------

_NAMED_CALL = [False]


def named_call(f: Callable, name: str | None = None) -> Callable:
    """``flax.linen.named_call`` wraps a function in a profiler name scope; ctrainstate has
    no profiler names, so ``f`` is returned as it is."""
    return f


def enable_named_call():
    """Flax's switch for profiler names on module methods: a no-op here."""
    _NAMED_CALL[0] = True


def disable_named_call():
    """Flax's switch for profiler names on module methods: a no-op here."""
    _NAMED_CALL[0] = False


@contextlib.contextmanager
def override_named_call(enable: bool = True):
    """Flax's context manager for profiler names: a no-op here (the flag is restored)."""
    prev = _NAMED_CALL[0]
    _NAMED_CALL[0] = bool(enable)
    try:
        yield
    finally:
        _NAMED_CALL[0] = prev


from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
