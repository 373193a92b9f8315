"""The implementation of :mod:`ctrainstate.train_state` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from ... import _C
from ..array.array import Array, device_put
from ..optim.base import (_BORROW_EPOCH, apply_updates, mark_borrowed, run_fused,
                          traced_step)
from ..base.tree_util import GetAttrKey, register_pytree_with_keys, tree_leaves

try:   # signal's C module: signal.signal's enum conversions cost ~20 us a step
    import _signal as _sig
except ImportError:   # pragma: no cover - another Python implementation
    import signal as _sig

__all__ = ["TrainState", "PyTreeNode", "field", "dataclass"]


def field(pytree_node: bool = True, **kwargs):
    """A dataclass field; ``pytree_node=False`` makes it static (aux data), like flax.struct."""
    return dataclasses.field(
        metadata={"pytree_node": pytree_node, **(kwargs.pop("metadata", None) or {})}, **kwargs)


def dataclass(cls=None, **kwargs):
    """Make ``cls`` a frozen dataclass registered as a pytree (flax.struct.dataclass).

    Keyword arguments (``kw_only=True``, ...) go to ``dataclasses.dataclass``; used with
    them, ``@dataclass(kw_only=True)`` decorates. As in Flax, the class is frozen unless
    ``frozen=False`` is given."""
    if cls is None:
        return lambda c: dataclass(c, **kwargs)
    if "_ct_struct" in cls.__dict__:
        return cls
    kwargs.setdefault("frozen", True)
    cls = dataclasses.dataclass(**kwargs)(cls)
    fields = dataclasses.fields(cls)
    data = tuple(f.name for f in fields if f.metadata.get("pytree_node", True))
    meta = tuple(f.name for f in fields if not f.metadata.get("pytree_node", True))

    def flatten_with_keys(x):
        return ([(GetAttrKey(n), getattr(x, n)) for n in data],
                tuple(getattr(x, n) for n in meta))

    def unflatten(aux, children):
        obj = object.__new__(cls)
        for n, v in zip(data, children):
            object.__setattr__(obj, n, v)
        for n, v in zip(meta, aux):
            object.__setattr__(obj, n, v)
        return obj

    if hasattr(cls, "__post_init__"):
        init = {f.name for f in fields if f.init}

        def unflatten(aux, children):   # noqa: F811 - through __init__, as Flax's
            values = dict(zip(data, children))   # register_dataclass does: __post_init__ runs
            values.update(zip(meta, aux))
            obj = cls(**{n: v for n, v in values.items() if n in init})
            for n, v in values.items():
                if n not in init:
                    object.__setattr__(obj, n, v)
            return obj

    register_pytree_with_keys(cls, flatten_with_keys, unflatten)
    cls._ct_struct = True
    # (data fields, static fields): ctrainstate.jit flattens a state of this class in C by them
    # (csrc/python/py_tree.c), where unflatten is object.__new__ and the fields set
    cls._ct_fields = None if hasattr(cls, "__post_init__") else (data, meta)
    cls._flax_dataclass = True   # flax.struct's marker, which libraries test for
    cls.replace = lambda self, **kw: dataclasses.replace(self, **kw)
    return cls


class PyTreeNode:
    """Base class: subclasses become frozen, pytree-registered dataclasses (flax.struct.PyTreeNode);
    class keywords (``class A(PyTreeNode, kw_only=True)``) go to :func:`dataclass`."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__()
        dataclass(cls, **kwargs)

    def replace(self, **overrides):
        """A copy with some fields replaced (``dataclasses.replace``)."""
        return dataclasses.replace(self, **overrides)


_OWG = "_overwrite_with_gradient"


def _place(params):
    """numpy leaves -> Arrays on the default device (or replicated over the active mesh)."""
    if all(isinstance(x, Array) for x in tree_leaves(params)):
        return params
    return device_put(params)


def _check_replace(state, kwargs):
    """The fields apply_gradients(**kwargs) would replace exist and are not its own."""
    own = {"step", "params", "opt_state"} & set(kwargs)
    if own:
        raise TypeError(f"{type(state).__name__}.apply_gradients sets {sorted(own)} itself; "
                        f"pass only other fields as keyword arguments")
    names = {f.name for f in dataclasses.fields(state) if f.init}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise TypeError(f"{type(state).__name__}.apply_gradients got keyword arguments "
                        f"{unknown} that are not fields of {type(state).__name__} (its fields: "
                        f"{sorted(names)})")


class _DeferInterrupt:
    """Holds SIGINT (Ctrl-C) back while an in-place step writes: armed in the main thread,
    a temporary handler records the signal; ``before_kernel`` honours one that came before
    the kernel started (nothing is written yet), ``release`` restores the handler and
    re-delivers a recorded signal (``KeyboardInterrupt`` with Python's default handler) once
    the step is committed. Other threads never receive signals: nothing to hold back."""

    # (class defaults instead of an __init__: one Python call less per step)
    _old = None
    _pending = False
    _armed = False

    def arm(self) -> None:
        old = _sig.getsignal(_sig.SIGINT)
        if old is None:   # a handler installed outside Python: left alone
            return
        try:
            _sig.signal(_sig.SIGINT, self._record)
        except ValueError:   # not the main thread (of the main interpreter): no signals here
            return
        self._old = old
        self._armed = True

    def _record(self, signum, frame):
        self._pending = True

    def before_kernel(self) -> None:
        if self._pending:
            self.release()

    def commit(self, old, new):
        """Once a step is committed: restore the handler and re-deliver a held Ctrl-C; when
        that raises, the state object ``old`` (whose Arrays the step donated) first becomes
        ``new`` (:func:`_adopt`; not with ``new`` None, :meth:`release`'s call). Returns
        ``new``."""
        if self._armed:
            try:
                self._armed = False
                _sig.signal(_sig.SIGINT, self._old)
                if self._pending:
                    self._pending = False
                    _sig.raise_signal(_sig.SIGINT)   # runs the restored handler now
            except BaseException:
                if new is not None:
                    _adopt(old, new)
                raise
        return new

    def release(self) -> None:
        """Restore the handler; re-deliver a Ctrl-C that came meanwhile (``KeyboardInterrupt``
        with Python's default handler)."""
        self.commit(None, None)


def _adopt(old, new) -> None:
    """Make the state object ``old`` the committed state ``new`` (every field, and the
    kernel plan): used when an interrupt is re-raised after an in-place step committed, so
    the caller's reference, whose Arrays were donated to ``new``, holds the whole new step
    instead of an unusable state."""
    for f in dataclasses.fields(old):
        object.__setattr__(old, f.name, getattr(new, f.name))
    if hasattr(old, "__dict__"):
        for k in ("_ct_plan", "_ct_cur"):
            if k in getattr(new, "__dict__", {}):
                object.__setattr__(old, k, new.__dict__[k])


_C.state_step_setup(_adopt, _BORROW_EPOCH, np.int32)


def _plain_fields(cls) -> bool:
    """Whether a state of ``cls`` can be copied by its ``__dict__`` (what
    ``dataclasses.replace`` does but for ``__post_init__`` and fields not in ``__init__``)."""
    return (not hasattr(cls, "__post_init__") and "__slots__" not in cls.__dict__
            and all(f.init for f in dataclasses.fields(cls)))


class TrainState(PyTreeNode):
    """Training state: step, params, optimizer and its state (flax's TrainState).

    Subclass to add fields (e.g. ``dropout_rng: Any``, ``batch_stats: Any``);
    mark static ones with ``field(pytree_node=False)``.
    """

    step: Any
    apply_fn: Callable = field(pytree_node=False)
    params: Any = field(pytree_node=True)
    tx: Any = field(pytree_node=False)
    opt_state: Any = field(pytree_node=True)

    def apply_gradients(self, *, grads, **kwargs):
        """One optimizer step; returns the new state with ``step + 1`` and ``kwargs`` replaced.

        ``grads`` must have the params' structure and shapes (else an error names
        the first mismatching path) and float dtypes (float32, bfloat16, float16:
        the step computes in float32, see ctrainstate.optim "Precision"); Arrays
        with the params' shardings are used as they are, numpy arrays are
        scattered on the fly.
        A fusable ``tx`` (every ctrainstate.optim transform, adafactor's pieces
        included) runs in place and **donates** this state's params and
        optimizer-state Arrays to the result: reading them afterwards raises
        ``DonatedBufferError``. Params the caller still holds (those given to
        :meth:`create`) are not donated: the step updates a copy of them (copy on
        write). A non-fusable ``tx`` runs ``tx.update`` + ``apply_updates`` and
        donates nothing.

        The in-place step is applied whole or not at all. A second call on the same
        state (from another thread, while this one runs) raises
        ``DonatedBufferError`` before touching anything. Ctrl-C (SIGINT, in the main
        thread) is honoured before the kernel starts (this state is left as it was)
        or after the step is committed: then ``KeyboardInterrupt`` is raised and this
        state object, whose Arrays were donated, becomes the new state (step + 1).
        """
        if kwargs:   # checked before the in-place kernel: a failing replace after it would
            _check_replace(self, kwargs)   # leave this state donated and no new one
        if _C.trace_active():   # inside a jit trace: the step becomes one node of the program
            new = self._traced_step(grads, kwargs)
            if new is not None:
                return new
        d = getattr(self, "__dict__", None)
        last = d.get("_ct_plan") if d is not None else None
        if last is not None and last.fast is not None and "_ct_cur" in d:
            # the persistent plan of the last step (optim.base.FastPlan): one C call, which
            # for params of plain dicts (the plan building the state tree) also makes the
            # new state (_C.state_step: _fast_step's and FastPlan.step's work)
            fast = last.fast
            if fast.dicts and fast.cplan.has_state_template:
                new = _C.state_step(self, d, fast, grads, kwargs)
            else:
                new = self._fast_step(fast, d, grads, kwargs)
            if new is not None:
                return new
        new_step = self.step + 1
        if _OWG in (grads if isinstance(grads, dict) else {}):
            g, p = grads["params"], self.params["params"]
        else:
            g, p = grads, self.params
        if not getattr(self.tx, "fusable", False):   # functional: nothing is donated
            updates, new_opt_state = self.tx.update(g, self.opt_state, p)
            return self._stepped(grads, new_step, apply_updates(p, updates), new_opt_state,
                                 None, kwargs)
        guard = _DeferInterrupt()
        guard.arm()
        try:
            new_p, new_opt_state, plan = run_fused(
                self.tx, g, self.opt_state, p, inplace=True, want_plan=True,
                plan=getattr(self, "__dict__", {}).get("_ct_plan"),
                before_kernel=guard.before_kernel)
            new = self._stepped(grads, new_step, new_p, new_opt_state, plan, kwargs)
        except BaseException:
            guard.release()
            raise
        return guard.commit(self, new)

    def _traced_step(self, grads, kwargs):
        """The step as a node of the program a jit trace records (``optim.base.traced_step``),
        or None where it cannot be one (a functional ``tx``, leaves that are not Arrays): then
        the eager step runs and the traced function replays eagerly."""
        if not getattr(self.tx, "fusable", False):
            return None
        if _OWG in (grads if isinstance(grads, dict) else {}):
            g, p = grads["params"], self.params["params"]
        else:
            g, p = grads, self.params
        d = getattr(self, "__dict__", None)
        r = traced_step(self.tx, p, self.opt_state, g, self.step,
                        d.get("_ct_plan") if d is not None else None)
        if r is None:
            return None
        new_p, new_opt_state, new_step = r
        return self._stepped(grads, new_step, new_p, new_opt_state, None, kwargs)

    def _fast_step(self, fast, d, grads, kwargs):
        """The step through ``fast`` (optim.base.FastPlan), or None when it declines (nothing
        changed then: the general path runs). The new state is this one's copy with the
        stepped fields; Ctrl-C is held back from the kernel's start to the return."""
        guard = _DeferInterrupt()
        guard.arm()
        try:
            r = fast.step(d["_ct_cur"], grads)
            if r is None:
                guard.release()
                return None
            new = object.__new__(type(self))
            nd = new.__dict__
            nd.update(d)
            nd["_ct_cur"], nd["params"], nd["opt_state"] = r
            nd["step"] = self.step + 1
            if kwargs:
                nd.update(kwargs)
        except BaseException:
            guard.release()
            raise
        return guard.commit(self, new)

    def _stepped(self, grads, new_step, new_p, new_opt_state, plan, kwargs):
        """The state after a step: new params (the ``_overwrite_with_gradient`` collection
        taken from ``grads``), optimizer state, ``step`` and ``kwargs``."""
        if _OWG in (grads if isinstance(grads, dict) else {}):
            new_params = {"params": new_p, _OWG: grads[_OWG]}
        else:
            new_params = new_p
        new = self.replace(step=new_step, params=new_params, opt_state=new_opt_state, **kwargs)
        if plan is not None and hasattr(new, "__dict__"):
            # the kernel's block tuples, reused by the next step while the buffers are these
            object.__setattr__(new, "_ct_plan", plan)
            if plan.fast is not None and new_params is new_p and _plain_fields(type(new)):
                # the persistent plan: the next steps are one C call each (see _fast_step)
                object.__setattr__(new, "_ct_cur", plan.fast.cplan.arrays)
        return new

    @classmethod
    def create(cls, *, apply_fn, params, tx, **kwargs):
        """A state with ``step=0`` and ``opt_state = tx.init(params)``. numpy params are placed
        on the default device (replicated over the active mesh); Arrays keep their shardings.

        The caller keeps its Arrays: they are not donated by the first
        :meth:`apply_gradients`, which updates a copy of them (copy on write), so ``params``
        stays readable (for evaluation, a second state, ...)."""
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise TypeError(f"{cls.__name__}.create: tx must be a gradient transformation (with "
                            f"init and update, e.g. ctrainstate.optim.adamw(1e-3)), got {tx!r}")
        mark_borrowed(params)   # the caller's Arrays: never donated, copied on the first step
        params = _place(params)
        params_for_opt = params["params"] if (isinstance(params, dict) and _OWG in params) else params
        return cls(step=0, apply_fn=apply_fn, params=params, tx=tx,
                   opt_state=tx.init(params_for_opt), **kwargs)


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
