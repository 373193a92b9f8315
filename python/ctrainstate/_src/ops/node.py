"""Op nodes: ops without a C plan as single steps of a jitted program.

An op whose Python code computes on host values (a gather reading its indices, a random draw
reading its key, a concatenation) cannot be recorded primitive by primitive: a host read of a
traced value breaks the program. Decorated with :func:`op_node`, such an op called while a
program records (``ctrainstate.jit`` tracing) becomes one *op node* of the program
(``_C.trace_node(..., pure=True)``): its Array arguments (also inside lists, tuples and dicts
of its arguments, and keyword arguments) are the node's inputs, everything else is static. On
replay the op's Python code runs again on the new input Arrays with the same static
arguments; its host reads are then the op computing on concrete values. The outputs are
checked against the traced shapes, dtypes and shardings (a mismatch raises ``RuntimeError``
naming the step), and counted as new memory by ``memory_analysis()``.

Under ``value_and_grad`` inside the trace, an op node whose inputs are differentiated records
one tape node whose vjp is itself a node of the program (``<name>.vjp``): the forward node
runs the op with a tape of its own on every replay and keeps that tape (the op's own vjp
closures and residuals, e.g. indices it read) until the backward node consumes it with the
replay's cotangent. Nothing computed from a traced input at trace time is a constant of the
backward pass: gradients follow each call's inputs. A forward node whose backward node a
replay does not run (its cotangents unused) keeps that tape until its next run.

Outside a trace the decorated op is the op itself (one ``_C.trace_active()`` check).
"""
from __future__ import annotations

import functools
from typing import Callable

from ... import _C
from ..array.array import Array
from ..base.tree_util import tree_flatten, tree_unflatten
# the tape's helpers (_Tape, _tape, _tls, _record, _backward, _no_tape, _alias, zeros_like):
# the ops module, set by ops.py when it imports this one (no import back: no cycle)
_ops = None


def _bind(ops_module) -> None:
    global _ops
    _ops = ops_module

__all__ = ["op_node"]


def _outs(r, name: str, fwd=None) -> list:
    """The op's result as the node's list of output Arrays: an Array, a tuple or list of
    them, or any pytree of Arrays (its structure kept on ``fwd`` to rebuild the result)."""
    if type(r) is Array:
        return [r]
    if isinstance(r, (tuple, list)) and all(type(x) is Array for x in r):
        return list(r)
    leaves, td = tree_flatten(r)
    bad = [type(x).__name__ for x in leaves if type(x) is not Array]
    if bad or not leaves:
        raise TypeError(f"{name}: an op node must return Arrays (or a pytree of them), got "
                        f"{type(r).__name__}" + (f" holding {bad[0]}" if bad else ""))
    if fwd is not None:
        fwd.td_out = td
    return leaves


def _fresh(outs: list, vals: list) -> list:
    """The outputs, each one over an input's buffers (a view: ``x[:, None]``, a reshape)
    replaced by a copy: a node's output is a value of its own in the program."""
    bufs = None
    for j, o in enumerate(outs):
        if bufs is None:
            bufs = {id(b[1]) for v in vals for b in v._blocks}
        if any(id(b[1]) in bufs for b in o._blocks):
            outs[j] = o.copy()
    return outs


class _Forward:
    """The node's callable: the op on its input Arrays (``vals``), the static rest bound."""

    __slots__ = ("name", "fn", "leaves", "td", "pos", "to_arrays", "diff", "pending", "td_out")

    def __init__(self, name, fn, leaves, td, pos, to_arrays, diff):
        self.name, self.fn, self.leaves, self.td, self.pos = name, fn, leaves, td, pos
        self.to_arrays, self.diff = to_arrays, diff
        self.pending = None   # (tape, outs, tracked input aliases) for the backward node
        self.td_out = None    # a pytree result's structure

    def _call(self, vals):
        leaves = list(self.leaves)
        for p, v in zip(self.pos, vals):
            leaves[p] = v
        args, kwargs = tree_unflatten(self.td, leaves)
        r = self.fn(*args, **kwargs)
        return self.to_arrays(r, vals) if self.to_arrays is not None else r

    def __call__(self, vals: list) -> list:
        if not self.diff:
            with _ops._no_tape():
                return _fresh(_outs(self._call(vals), self.name, self), vals)
        tape = _ops._Tape()   # the op's own (no outer tapes: nothing nested is differentiated)
        vals = list(vals)
        ins = []
        for j in self.diff:
            vals[j] = _ops._alias(vals[j])
            tape.track(vals[j])
            ins.append(vals[j])
        stack = getattr(_ops._tls, "tapes", None)
        if stack is None:
            stack = _ops._tls.tapes = []
        stack.append(tape)
        try:
            raw = _outs(self._call(vals), self.name, self)
        finally:
            stack.pop()
        self.pending = (tape, raw, ins)   # (a copy's cotangent is its original's)
        with _ops._no_tape():
            return _fresh(list(raw), vals)


class _Backward:
    """The vjp node's callable: ``[cotangent]`` -> the differentiated inputs' cotangents,
    through the tape the forward node kept on this run."""

    __slots__ = ("fwd",)

    def __init__(self, fwd: _Forward):
        self.fwd = fwd

    def __call__(self, vals: list) -> list:
        pending, self.fwd.pending = self.fwd.pending, None
        if pending is None:
            raise RuntimeError(f"jit: the backward node of {self.fwd.name} ran without its "
                               f"forward node")
        tape, outs, ins = pending
        with _ops._no_tape():
            cot = _ops._backward(tape, outs[0], vals[0])
            return [cot[id(x)] if id(x) in cot else _ops.zeros_like(x) for x in ins]


def _as_node(name: str, fn: Callable, args, kwargs, to_arrays, raw: bool = False):
    leaves, td = tree_flatten((args, kwargs))
    pos = [i for i, x in enumerate(leaves) if type(x) is Array]
    if not pos:   # nothing traced can reach it: the op as it is
        return fn(*args, **kwargs)
    ins = [leaves[i] for i in pos]
    static = [None if type(x) is Array else x for x in leaves]
    t = None if raw else _ops._tape()
    diff = () if t is None else tuple(j for j, x in enumerate(ins) if id(x) in t.tracked)
    fwd = _Forward(name, fn, static, td, pos, to_arrays, diff)
    outs = _C.trace_node(name, fwd, ins, True)
    if not diff:
        if fwd.td_out is not None:
            return tree_unflatten(fwd.td_out, outs)
        return outs[0] if len(outs) == 1 else tuple(outs)
    if len(outs) != 1:
        raise TypeError(f"{name}: a differentiated op node must have one output")
    out = outs[0]
    bwd = _Backward(fwd)
    inputs = tuple(ins[j] for j in diff)

    def vjp(g):
        # the forward node's inputs and output ride along as inputs the backward node does
        # not read: its kept tape holds them until then, so the program (and memory_analysis)
        # keeps them alive as long
        return tuple(_C.trace_node(name + ".vjp", bwd, [g, *ins, out], True))
    return _ops._record(out, inputs, vjp)


def op_node(name: str, to_arrays: Callable | None = None, raw: bool = False):
    """Decorator: the op, called while a program records on this thread, runs as one op node
    of it (see the module's docstring). ``to_arrays(result, input Arrays)``: the result as an
    Array or a tuple of Arrays, for an op that returns something else (a random draw's numpy
    array). The op must return the same kinds of outputs for inputs of the traced shapes,
    dtypes and shardings. ``raw``: the op records nothing on a tape (a kernel call whose
    caller records the derivative, as ``ops._reduce_raw``'s callers do), so the node is not
    differentiated itself."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not _C.trace_active():
                return fn(*args, **kwargs)
            return _as_node(name, fn, args, kwargs, to_arrays, raw)
        wrapper.__wrapped_op__ = fn
        return wrapper
    return deco
