"""``jax.vjp`` and ``jax.custom_vjp`` on ctrainstate's reverse-mode tape.

``vjp(fun, *primals)`` runs ``fun`` once with its primals tracked and returns the outputs and
a function mapping output cotangents (a pytree of the outputs' structure) to the primals'
cotangents; it may be called several times (the recorded tape is kept).

``custom_vjp(fun)`` with ``f.defvjp(fwd, bwd)`` is jax's: outside differentiation a call
runs ``fun``; inside ``value_and_grad`` / ``grad`` / ``vjp`` a call runs ``fwd(*args) ->
(outputs, residuals)`` with nothing of it recorded, and the backward pass calls
``bwd(*nondiff_args, residuals, output_cotangents)``, which returns one cotangent per
differentiable positional argument (a tuple of pytrees of those arguments' structures;
``None`` for a zero). Straight-through estimators, gradient clipping in the backward pass and
numerically safer gradients work as in jax. ``bwd`` is itself run with the tape off (no
higher-order derivatives, as everywhere here); ``symbolic_zeros=True`` is not supported.
"""
from __future__ import annotations

import functools
import inspect
import operator
from typing import Callable

import numpy as np

from ..array.array import Array
from ..ops import ops as o
from ..numpy_lax import numpy as cnp
from ..ops.slicing import stack
from ..base.tree_util import tree_flatten, tree_unflatten

__all__ = ["vjp", "custom_vjp", "jacrev", "jacobian"]


def _ops():
    return o


def _float_leaf(x) -> bool:
    return isinstance(x, Array) and x.dtype in _ops()._FLOATS


def vjp(fun: Callable, *primals, has_aux: bool = False):
    """``jax.vjp``: ``(fun(*primals), vjp_fn)`` (with ``has_aux``: ``(out, vjp_fn, aux)``),
    ``vjp_fn(cotangents)`` returning a tuple with one cotangent per primal (of its pytree
    structure and shardings). ``cotangents`` has the structure of ``fun``'s output (arrays of
    the output leaves' shapes). Float primals only, as ``grad``.

    >>> import numpy as np, ctrainstate as cts, ctrainstate.numpy as cnp
    >>> y, f_vjp = cts.vjp(lambda a, b: a * b, np.float32([1, 2]), np.float32([3, 4]))
    >>> [np.asarray(g).tolist() for g in f_vjp(np.float32([1, 10]))]
    [[3.0, 40.0], [1.0, 20.0]]
    """
    o = _ops()
    tape, stack = o._open_tape()
    enclosing = tape.outer
    flat_in, args = [], []
    for p in primals:
        leaves, td = tree_flatten(p)
        new = []
        for leaf in leaves:
            x = leaf if isinstance(leaf, Array) else o._lift_any(np.asarray(leaf))
            if x.dtype not in o._FLOATS:
                raise TypeError(f"vjp requires real-valued inputs (float32, bfloat16 or "
                                f"float16), got {x.dtype}")
            if enclosing:
                o._check_not_nested(tape, (x,))
            x = o._alias(x)
            tape.track(x)
            new.append(x)
        flat_in.append((new, td))
        args.append(tree_unflatten(td, new))
    stack.append(tape)
    try:
        res = fun(*args)
    finally:
        stack.pop()
    if has_aux:
        if not (isinstance(res, tuple) and len(res) == 2):
            raise TypeError("vjp(..., has_aux=True): fun must return a pair (output, aux)")
        out, aux = res
    else:
        out, aux = res, None
    out_leaves, out_td = tree_flatten(out)
    for leaf in out_leaves:
        if not isinstance(leaf, Array):
            raise TypeError(f"vjp: fun's outputs must be Arrays, got {type(leaf).__name__}")

    def vjp_fn(cotangents):
        ct_leaves, ct_td = tree_flatten(cotangents)
        if ct_td != out_td:
            raise TypeError(f"vjp: the cotangents' structure {ct_td} is not the output's "
                            f"{out_td}")
        seeds = {}
        for y, ct in zip(out_leaves, ct_leaves):
            if isinstance(ct, Array):
                c = ct
            elif isinstance(ct, (int, float)) and not isinstance(ct, bool):
                c = o._lift_any(np.asarray(ct, y.dtype))      # a weak Python scalar
            else:
                h = np.asarray(ct)
                if h.dtype == np.float64:                       # numpy's default float
                    h = h.astype(np.float32)
                c = o._lift_any(h)
            if tuple(c.shape) != tuple(y.shape):
                raise ValueError(f"vjp: a cotangent of shape {tuple(c.shape)} for an output "
                                 f"of shape {tuple(y.shape)}")
            if np.dtype(c.dtype) != np.dtype(y.dtype):
                raise ValueError(f"vjp: a {np.dtype(c.dtype).name} cotangent for a "
                                 f"{np.dtype(y.dtype).name} output of shape {tuple(y.shape)}; "
                                 f"cotangents must have the outputs' dtypes, as in jax")
            if id(y) in tape.tracked:
                prev = seeds.get(id(y))
                seeds[id(y)] = c if prev is None else o.add(prev, c)
        cot = o._backward(tape, None, seeds=seeds)
        outs = []
        for new, td in flat_in:
            gl = []
            for x in new:
                g = cot.get(id(x))
                if g is None:
                    g = o.zeros_like(x)
                elif g.sharding != x.sharding:
                    g = o.device_put(g, x.sharding)
                gl.append(g)
            outs.append(tree_unflatten(td, gl))
        return tuple(outs)
    return (out, vjp_fn, aux) if has_aux else (out, vjp_fn)


class custom_vjp:
    """``jax.custom_vjp``: a function with a user-defined backward pass (see the module
    docstring); ``nondiff_argnums`` as jax's (those arguments get no cotangent and come first
    in ``bwd``'s arguments).

    >>> import numpy as np, ctrainstate as cts, ctrainstate.numpy as cnp
    >>> @cts.custom_vjp
    ... def clip_gradient(x):
    ...     return x
    >>> clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (cnp.clip(g, -1.0, 1.0),))
    >>> np.asarray(cts.grad(lambda x: cnp.sum(clip_gradient(x) * 5.0))(np.float32([1, 2]))).tolist()
    [1.0, 1.0]
    """

    def __init__(self, fun: Callable, nondiff_argnums=()):
        if not callable(fun):
            raise TypeError(f"custom_vjp: expected a function, got {type(fun).__name__}")
        self.fun = fun
        try:
            self.nondiff_argnums = tuple(sorted(operator.index(i) for i in nondiff_argnums))
        except TypeError:
            raise TypeError(f"custom_vjp: nondiff_argnums must be ints, got "
                            f"{nondiff_argnums!r}") from None
        self.fwd = self.bwd = None
        functools.update_wrapper(self, fun)

    def defvjp(self, fwd: Callable, bwd: Callable, symbolic_zeros: bool = False):
        """Set the forward rule ``fwd(*args) -> (out, residuals)`` and the backward rule
        ``bwd(*nondiff_args, residuals, out_cotangent) -> tuple of cotangents``."""
        if symbolic_zeros:
            raise NotImplementedError("custom_vjp.defvjp(symbolic_zeros=True) is not supported")
        if not callable(fwd) or not callable(bwd):
            raise TypeError("custom_vjp.defvjp: fwd and bwd must be callables")
        self.fwd, self.bwd = fwd, bwd

    def _positional(self, args, kwargs):
        if not kwargs:
            return tuple(args)
        try:
            bound = inspect.signature(self.fun).bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"custom_vjp {getattr(self.fun, '__name__', 'function')}: {e}") \
                from None
        bound.apply_defaults()
        if bound.kwargs:
            raise TypeError(f"custom_vjp {getattr(self.fun, '__name__', 'function')}: the "
                            f"keyword-only arguments {sorted(bound.kwargs)} could not be "
                            f"resolved to positional arguments (jax's rule: pass them "
                            f"positionally or through functools.partial)")
        return tuple(bound.args)

    def __call__(self, *args, **kwargs):
        o = _ops()
        if self.fwd is None:
            raise AttributeError(f"No VJP defined for custom_vjp function "
                                 f"{getattr(self.fun, '__name__', '')} using defvjp.")
        args = self._positional(args, kwargs)
        for i in self.nondiff_argnums:
            if i >= len(args):
                raise ValueError(f"custom_vjp: nondiff_argnums {i} but only {len(args)} "
                                 f"arguments")
        tape = o._tape()
        diff_idx = [i for i in range(len(args)) if i not in self.nondiff_argnums]
        flat = {i: tree_flatten(args[i]) for i in diff_idx}
        tracked = tape is not None and any(
            isinstance(x, Array) and id(x) in tape.tracked
            for i in diff_idx for x in flat[i][0])
        if not tracked:
            return self.fun(*args)
        if tape.outer:
            o._check_not_nested(tape, [x for i in diff_idx for x in flat[i][0]])
        with _ops()._no_tape():
            pair = self.fwd(*args)
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(f"Custom VJP fwd rule {getattr(self.fwd, '__name__', '')} must "
                            f"produce a pair (list or tuple of length two) representing "
                            f"primal outputs and residuals, got {type(pair).__name__}")
        out, res = pair
        out_leaves, out_td = tree_flatten(out)
        outs = []
        for leaf in out_leaves:
            if isinstance(leaf, Array):
                leaf = o._alias(leaf)       # a node of its own, even if fwd returned an input
                if _float_leaf(leaf):
                    tape.track(leaf)
            outs.append(leaf)
        inputs = [x for i in diff_idx for x in flat[i][0]]
        nondiff = [args[i] for i in self.nondiff_argnums]
        bwd, name = self.bwd, getattr(self.bwd, "__name__", "bwd")

        def node_vjp(gs, prev):
            cts = [g if g is not None else (o.zeros_like(y) if _float_leaf(y) else None)
                   for g, y in zip(gs, outs)]
            with _ops()._no_tape():
                got = bwd(*nondiff, res, tree_unflatten(out_td, cts))
            if not isinstance(got, (tuple, list)) or len(got) != len(diff_idx):
                raise TypeError(f"Custom VJP bwd rule {name} must produce a tuple with one "
                                f"cotangent per differentiable argument ({len(diff_idx)}), "
                                f"got {type(got).__name__}"
                                f"{'' if not isinstance(got, (tuple, list)) else ' of length ' + str(len(got))}")
            new = []
            for i, g in zip(diff_idx, got):
                leaves, td = flat[i]
                if g is None:
                    new.extend([None] * len(leaves))
                    continue
                gl, gtd = tree_flatten(g)
                if gtd != td:
                    raise TypeError(f"Custom VJP bwd rule {name}: the cotangent for argument "
                                    f"{i} has structure {gtd}, expected {td}")
                new.extend(gl)
            acc = []
            for x, p, g in zip(inputs, prev, new):
                if g is None or not isinstance(x, Array):
                    acc.append(p)
                    continue
                if not isinstance(g, Array):
                    g = o._lift(np.asarray(g, x.dtype), o._place_of(x))
                if tuple(g.shape) != tuple(x.shape):
                    raise ValueError(f"Custom VJP bwd rule {name} produced a cotangent of "
                                     f"shape {tuple(g.shape)} for an input of shape "
                                     f"{tuple(x.shape)}")
                if g.dtype != x.dtype:
                    g = o.astype(g, x.dtype)
                acc.append(g if p is None else o.add(p, g))
            return acc
        tape.nodes.append(o._Group(outs, inputs, node_vjp))
        return tree_unflatten(out_td, outs)


def jacrev(fun: Callable, argnums=0, has_aux: bool = False):
    """``jax.jacrev`` (and ``jax.jacobian``): the Jacobian of ``fun`` with respect to the
    positional arguments ``argnums``, by reverse mode: one recorded forward pass (:func:`vjp`)
    and one backward pass per output element, the rows stacked. For an output leaf of shape
    ``O`` and an input leaf of shape ``I`` the block has shape ``O + I`` (pytrees nest as
    jax's: output structure outside, input structure inside); an int ``argnums`` gives one
    input's blocks, a tuple a tuple of them. Cost: ``prod(O)`` backward passes, for small
    outputs (as jax's jacrev, whose vmap here would be a loop anyway).

    >>> import numpy as np, ctrainstate as cts, ctrainstate.numpy as cnp
    >>> np.asarray(cts.jacrev(lambda x: x * x)(np.float32([1, 2]))).tolist()
    [[2.0, 0.0], [0.0, 4.0]]
    """
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)

    def jac(*args, **kwargs):
        o = _ops()
        idx = []
        for i in nums:
            if not isinstance(i, int) or not -len(args) <= i < len(args):
                raise ValueError(f"jacrev: argnums {argnums!r} out of range for "
                                 f"{len(args)} positional arguments")
            idx.append(i % len(args))
        diff = [args[i] for i in idx]

        def f(*d):
            full = list(args)
            for i, v in zip(idx, d):
                full[i] = v
            return fun(*full, **kwargs)
        if has_aux:
            out, f_vjp, aux = vjp(f, *diff, has_aux=True)
        else:
            out, f_vjp = vjp(f, *diff)
        out_leaves, out_td = tree_flatten(out)
        in_flat = [tree_flatten(d) for d in diff]
        # rows[k][j][m]: d out_leaves[k] / d (input j's leaf m), shape O_k + I_jm
        per_out = []
        for k, y in enumerate(out_leaves):
            n = int(np.prod(y.shape, dtype=np.int64))
            rows = []
            for e in range(n):
                cts_ = []
                for kk, yy in enumerate(out_leaves):
                    basis = np.zeros(int(np.prod(yy.shape, dtype=np.int64)), np.float32)
                    if kk == k:
                        basis[e] = 1.0
                    cts_.append(o.astype(o._lift(basis.reshape(yy.shape), o._place_of(yy)),
                                         yy.dtype))
                rows.append(f_vjp(tree_unflatten(out_td, cts_)))
            blocks = []
            for j, (leaves, td) in enumerate(in_flat):
                bl = []
                for m, x in enumerate(leaves):
                    shape = tuple(y.shape) + tuple(np.shape(x))
                    if n == 0:
                        bl.append(cnp.zeros(shape, x.dtype))   # a cotangent's dtype
                        continue
                    col = [tree_flatten(r[j])[0][m] for r in rows]
                    bl.append(o.reshape(stack(col, axis=0), shape))
                blocks.append(tree_unflatten(td, bl))
            per_out.append(blocks[0] if single else tuple(blocks))
        res = tree_unflatten(out_td, per_out)
        return (res, aux) if has_aux else res
    return jac


jacobian = jacrev
