"""``jax.lax``'s control flow, eagerly: ``fori_loop``, ``while_loop``, ``cond``, ``switch``,
``scan`` and ``map`` run their bodies as Python on the host, one iteration after another.

There is no tracing, so there is no abstract predicate: a loop bound, a ``cond`` predicate,
a ``switch`` index and what ``while_loop``'s ``cond_fun`` returns are read to the host (a
0-d Array costs one read). Every op a body runs is an ordinary op, recorded on the
``value_and_grad`` tape, so all of these are differentiable -- ``while_loop`` and a
``fori_loop`` with Array bounds included, which jax cannot reverse-differentiate.

What jax checks when it traces, these check on every iteration: the carry that a body
returns has the structure, shapes and dtypes of the carry it was given (a ``TypeError``
naming the component otherwise; a Python scalar is weakly typed as in jax: an input
``0`` may come back as a float32 scalar, but an output ``0`` for a float32 carry is int32
and refused), ``scan``'s body returns a pair, the scanned leaves agree on their length.
Differences from jax: ``cond`` / ``switch`` run only the branch taken, so a branch whose
outputs do not match the others' is found only inside ``eval_shape`` (where every branch
runs, as jax traces them); the ``fori_loop`` index is a Python int (jax: an int32 scalar);
results are whatever the body returned (a Python scalar carry stays a Python scalar).

>>> import numpy as np, ctrainstate as cts
>>> from ctrainstate import lax
>>> lax.fori_loop(0, 4, lambda i, c: c + i, 0)
6
>>> carry, ys = lax.scan(lambda c, x: (c + x, c * x), 0.0, np.arange(3, dtype=np.float32))
>>> float(carry), np.asarray(ys).tolist()
(3.0, [0.0, 0.0, 2.0])
"""
from __future__ import annotations
from ..base.hooks import provide as _provide
_provide('_lax_control', __name__)   # lower layers call into this module through _hooks.upper

import operator

import numpy as np

from ... import _C
from ..base import dtypes as _dtypes
from ..array.abstract import ShapeDtypeStruct, is_abstract
from ..array.array import Array
from ..base.tree_util import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten
from . import numpy as cnp
from ..array.abstract import eval_shape
from .lax_ops import pad, rev
from ..ops.slicing import concatenate, getitem, stack

_NO_OPERAND = object()


# --- carry types -----------------------------------------------------------------------------

def _leaf_type(v):
    """(shape, dtype, weak) of a leaf as jax types it, or None for a leaf that is no array."""
    if isinstance(v, (Array, ShapeDtypeStruct)):
        return tuple(v.shape), np.dtype(v.dtype), False
    if isinstance(v, (bool, np.bool_)) and not isinstance(v, np.ndarray):
        return (), _dtypes.bool_, isinstance(v, bool)
    if isinstance(v, int):
        return (), _dtypes.int32, True
    if isinstance(v, float):
        return (), _dtypes.float32, True
    if isinstance(v, (np.ndarray, np.generic)):
        try:
            return tuple(v.shape), _dtypes.canonicalize(v.dtype), False
        except TypeError:
            return None
    return None


def _type_str(t) -> str:
    return f"{t[1].name}[{','.join(str(n) for n in t[0])}]"


def _check_carry(who: str, c_in, c_out, name: str = "carry"):
    """The carry ``c_out`` a body returned has ``c_in``'s pytree structure, shapes and
    dtypes (jax's check; a weakly typed input leaf -- a Python scalar -- may change dtype)."""
    pin, tin = tree_flatten_with_path(c_in)
    pout, tout = tree_flatten_with_path(c_out)
    if tin != tout:
        raise TypeError(f"{who}: the body function's carry output must have the same pytree "
                        f"structure as its carry input, but they differ:\n  input:  {tin}\n"
                        f"  output: {tout}\nRevise the function so that the carry output has "
                        f"the same pytree structure as the carry input.")
    for (path, a), (_, b) in zip(pin, pout):
        ta, tb = _leaf_type(a), _leaf_type(b)
        if ta is None or tb is None:
            continue
        if ta[0] != tb[0]:
            what = "shapes"
        elif ta[1] != tb[1] and not ta[2]:
            what = "dtypes"
        else:
            continue
        raise TypeError(f"{who}: the body function's carry input and carry output must have "
                        f"equal types, but they differ: the input carry component "
                        f"{name}{keystr(path)} has type {_type_str(ta)} but the corresponding "
                        f"output carry component has type {_type_str(tb)}, so the {what} do "
                        f"not match. Revise the function so that all output types match the "
                        f"corresponding input types.")


def _check_same_outputs(who: str, outs, names):
    """Branch outputs (``cond`` / ``switch`` inside eval_shape) of one structure and type."""
    l0, t0 = tree_flatten_with_path(outs[0])
    for out, nm in zip(outs[1:], names[1:]):
        lk, tk = tree_flatten_with_path(out)
        if tk != t0:
            raise TypeError(f"{who} branch outputs must have the same pytree structure, but "
                            f"they differ: {names[0]} returns {t0}, {nm} returns {tk}.")
        for (path, a), (_, b) in zip(l0, lk):
            ta, tb = _leaf_type(a), _leaf_type(b)
            if ta is not None and tb is not None and ta[:2] != tb[:2]:
                raise TypeError(f"{who} branches must have equal output types but they differ: "
                                f"the output{keystr(path)} of {names[0]} has type "
                                f"{_type_str(ta)} but that of {nm} has type {_type_str(tb)}.")


# --- concrete scalars ------------------------------------------------------------------------

def _host_scalar(v, who: str, what: str):
    """``v`` (a Python / numpy scalar or a 0-d Array) read to the host as a 0-d numpy array,
    or None for an abstract value (a ShapeDtypeStruct, inside eval_shape)."""
    if isinstance(v, ShapeDtypeStruct):
        if v.shape != ():
            raise TypeError(f"{what} must be a scalar, got a value of shape {v.shape}.")
        return None
    if isinstance(v, Array):
        if v.shape != ():
            raise TypeError(f"{what} must be a scalar, got an Array of shape {tuple(v.shape)}.")
        # under jit, a traced value: control flow runs on the host, so the function cannot be
        # replayed (it runs eagerly at every call, with the same results)
        _C.trace_break(f"lax.{who} on a traced value (control flow runs eagerly)", v)
        return np.asarray(v)
    if isinstance(v, (str, bytes)) or v is None:
        raise TypeError(f"{what} must be a scalar, got {v!r} of type {type(v)}")
    try:
        h = np.asarray(v)
    except Exception:     # noqa: BLE001 - anything numpy cannot read is no scalar
        h = None
    if h is None or h.dtype == object:
        raise TypeError(f"{what} must be a scalar, got {v!r} of type {type(v)}")
    if h.shape != ():
        raise TypeError(f"{what} must be a scalar, got {v!r} of shape {h.shape}.")
    return h


def _int_bound(v, who: str, name: str) -> tuple:
    """A fori_loop bound as (int, dtype or None for a weak Python int)."""
    if isinstance(v, ShapeDtypeStruct):
        raise TypeError(f"{who}: the {name} bound is abstract (inside eval_shape); "
                        f"ctrainstate's loops run on the host and need concrete bounds")
    if isinstance(v, bool) or (isinstance(v, (np.ndarray, np.generic, Array))
                               and np.dtype(v.dtype) == np.bool_):
        raise TypeError(f"{who}: {name} must be an integer, got {v!r}")
    if isinstance(v, int):
        return v, None
    h = _host_scalar(v, who, f"{who}: {name}")
    if h.dtype.kind not in "iu":
        raise TypeError(f"{who}: {name} must be an integer (a Python int or an integer "
                        f"scalar), got {v!r} of dtype {h.dtype}")
    return int(h), _dtypes.canonicalize(h.dtype)


# --- loops -----------------------------------------------------------------------------------

def fori_loop(lower, upper, body_fun, init_val, *, unroll=None):
    """``jax.lax.fori_loop``: ``val = body_fun(i, val)`` for ``i`` in ``range(lower, upper)``,
    run eagerly; returns the last ``val`` (``init_val`` itself when the range is empty).
    ``lower`` / ``upper`` are ints or integer scalars (Arrays are read once), of one dtype
    when both are typed (jax's rule). The index ``i`` is a Python int (jax passes an int32
    scalar; it indexes, slices and adds the same). The carry must keep its structure, shapes
    and dtypes (see the module docstring). ``unroll`` is accepted and has no effect.
    Differentiable through every iteration.

    >>> from ctrainstate import lax
    >>> lax.fori_loop(1, 5, lambda i, acc: acc * i, 1)
    24
    """
    del unroll
    who = "fori_loop"
    lo, dlo = _int_bound(lower, who, "lower")
    hi, dhi = _int_bound(upper, who, "upper")
    if dlo is not None and dhi is not None and dlo != dhi:
        raise TypeError(f"lower and upper arguments to fori_loop must have equal types, got "
                        f"{dlo.name} and {dhi.name}")
    if not callable(body_fun):
        raise TypeError(f"{who}: body_fun must be callable, got {body_fun!r}")
    val = init_val
    for i in range(lo, hi):
        new = body_fun(i, val)
        _check_carry(who, val, new, "loop_carry")
        val = new
    return val


def _predicate(p, who: str) -> bool:
    t = _leaf_type(p) if not isinstance(p, (tuple, list, dict)) else None
    if t is None or t[0] != () or t[1] != _dtypes.bool_:
        got = _type_str(t) if t is not None else type(p).__name__
        raise TypeError(f"cond_fun must return a boolean scalar, but got output type(s) "
                        f"[{got}].")
    if isinstance(p, ShapeDtypeStruct):
        raise TypeError(f"{who}: cond_fun returned an abstract value (inside eval_shape); "
                        f"ctrainstate's while_loop runs on the host and needs a concrete "
                        f"predicate each iteration")
    if isinstance(p, Array):
        _C.trace_break(f"lax.{who} on a traced value (control flow runs eagerly)", p)
    return bool(np.asarray(p))


def while_loop(cond_fun, body_fun, init_val):
    """``jax.lax.while_loop``: ``val = body_fun(val)`` while ``cond_fun(val)``, run eagerly on
    the host: ``cond_fun`` must return a concrete boolean scalar (a Python / numpy bool or a
    0-d bool Array, read back each iteration; anything else is a ``TypeError``, as jax's).
    The carry must keep its structure, shapes and dtypes. Unlike jax's, differentiable (the
    iterations run are on the tape).

    >>> from ctrainstate import lax
    >>> lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, 1.0))
    (3, 8.0)
    """
    who = "while_loop"
    if not callable(cond_fun) or not callable(body_fun):
        raise TypeError(f"{who}: cond_fun and body_fun must be callable")
    val = init_val
    while _predicate(cond_fun(val), who):
        new = body_fun(val)
        _check_carry(who, val, new)
        val = new
    return val


# --- branches --------------------------------------------------------------------------------

def _operands(operands, operand, who):
    if operand is not _NO_OPERAND:
        if operands:
            raise TypeError(f"if 'operand' keyword is passed then no positional operands can be "
                            f"passed, got operand={operand!r} and positional operands "
                            f"{operands!r}")
        return (operand,)
    return operands


def cond(pred, true_fun, false_fun, *operands, operand=_NO_OPERAND):
    """``jax.lax.cond``: ``true_fun(*operands)`` if ``pred`` else ``false_fun(*operands)``.
    ``pred`` is a scalar (bool or a number: nonzero is true; an Array is read to the host).
    Only the branch taken runs (eagerly), so it alone is differentiated; inside ``eval_shape``
    both run and their outputs must match (jax's check). jax's forms are accepted: the
    ``operand=`` keyword and the old ``cond(pred, true_operand, true_fun, false_operand,
    false_fun)``.

    >>> from ctrainstate import lax
    >>> lax.cond(3 > 2, lambda x: x + 1, lambda x: x - 1, 10)
    11
    """
    who = "cond"
    operands = _operands(operands, operand, who)
    if not (callable(true_fun) and callable(false_fun)):
        if callable(false_fun) and len(operands) == 2 and callable(operands[1]):
            x_true, f_true, x_false, f_false = true_fun, false_fun, *operands   # the old form
            return cond(pred, lambda xt, xf: f_true(xt), lambda xt, xf: f_false(xf),
                        x_true, x_false)
        raise TypeError("lax.cond: true_fun and false_fun arguments should be callable.")
    h = _host_scalar(pred, who, "Pred")
    if h is not None and h.dtype.kind not in "biuf":
        raise TypeError(f"Pred must be a scalar number or bool, got dtype {h.dtype}")
    if h is None:    # eval_shape: both branches, as jax traces them
        outs = [true_fun(*operands), false_fun(*operands)]
        _check_same_outputs(who, outs, ["true_fun", "false_fun"])
        return outs[0]
    return (true_fun if bool(h != 0) else false_fun)(*operands)


def switch(index, branches, *operands, operand=_NO_OPERAND):
    """``jax.lax.switch``: ``branches[index](*operands)``, ``index`` an integer scalar clamped
    to ``[0, len(branches) - 1]`` as jax does (an Array is read to the host). Only the branch
    taken runs; inside ``eval_shape`` all run and their outputs must match.

    >>> from ctrainstate import lax
    >>> lax.switch(7, [lambda x: x, lambda x: 2 * x], 5)    # clamped to the last branch
    10
    """
    who = "switch"
    operands = _operands(operands, operand, who)
    try:
        branches = tuple(branches)
    except TypeError:
        raise TypeError(f"lax.switch: branches argument should be a sequence of callables, got "
                        f"{branches!r}") from None
    if not branches:
        raise ValueError("Empty branch sequence")
    if not all(callable(b) for b in branches):
        raise TypeError("lax.switch: branches argument should be a sequence of callables.")
    h = _host_scalar(index, who, "Branch index")
    if h is None:
        if np.dtype(index.dtype).kind not in "iu":
            raise TypeError(f"Index type must be an integer, got {index.dtype}")
        outs = [b(*operands) for b in branches]
        _check_same_outputs(who, outs, [f"branch {k}" for k in range(len(branches))])
        return outs[0]
    if h.dtype.kind not in "iu":
        raise TypeError(f"Index type must be an integer, got {h} as {h.dtype}")
    i = int(h)
    i = 0 if i < 0 else (len(branches) - 1 if i >= len(branches) else i)
    return branches[i](*operands)


# --- scan / map ------------------------------------------------------------------------------

def _lead(x):
    shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
    if not shape:
        raise ValueError(f"scan got value with no leading axis to scan over: {x!r}")
    return shape[0]


def _step(x, i):
    if isinstance(x, ShapeDtypeStruct):
        return ShapeDtypeStruct(x.shape[1:], x.dtype)
    if isinstance(x, Array):
        return getitem(x, i)
    return np.asarray(x)[i]


def _stack(col, who):
    """One output leaf of every iteration, stacked along a new leading axis."""
    types = [_leaf_type(v) for v in col]
    shapes = {t[0] for t in types if t is not None}
    if len(shapes) > 1:
        raise TypeError(f"{who}: the body returned values of different shapes across "
                        f"iterations ({sorted(shapes)}); they must have one shape to be stacked")
    if any(isinstance(v, ShapeDtypeStruct) for v in col):
        t = types[0]
        return ShapeDtypeStruct((len(col),) + t[0], t[1])
    if any(isinstance(v, Array) for v in col):
        return stack(list(col), 0)
    if any(t is None for t in types):
        raise TypeError(f"{who}: the body returned a non-array value {col[0]!r} among its "
                        f"outputs")
    return cnp.asarray(np.stack([np.asarray(v, dtype=t[1]) for v, t in zip(col, types)]))


def scan(f, init, xs=None, length=None, reverse=False, unroll=1, _split_transpose=False):
    """``jax.lax.scan``: ``carry, y = f(carry, x)`` for each ``x`` in ``xs`` (a pytree; its
    leaves are sliced along axis 0 and must agree on that length, or equal ``length``; with
    ``xs=None``, ``length`` steps of ``x=None``), run eagerly; returns the last carry and the
    ``y``s stacked along a new axis 0. ``reverse=True`` runs from the last ``x`` to the first,
    with ``ys[i]`` still the output for ``xs[i]``. The carry keeps its structure, shapes and
    dtypes (see the module docstring); ``unroll`` has no effect. Differentiable: each slice of
    an Array ``xs``, each body op and the stacking are on the tape. A zero-length scan finds
    the shapes of ``ys`` with ``eval_shape(f, ...)``.

    >>> import numpy as np
    >>> from ctrainstate import lax
    >>> c, ys = lax.scan(lambda c, x: (c + x, c), 0.0, np.arange(3, dtype=np.float32), reverse=True)
    >>> float(c), np.asarray(ys).tolist()
    (3.0, [3.0, 2.0, 0.0])
    """
    del unroll, _split_transpose
    who = "scan"
    if not callable(f):
        raise TypeError(f"{who}: f must be callable, got {f!r}")
    leaves, xtd = tree_flatten(xs)
    lens = [_lead(x) for x in leaves]
    if length is not None:
        try:
            length = operator.index(length)
        except TypeError:
            raise TypeError(f"{who}: length must be an int, got {length!r}") from None
        if any(n != length for n in lens):
            raise ValueError(f"scan got `length` argument of {length} which disagrees with "
                             f"leading axis sizes {lens}.")
    else:
        if not lens:
            raise ValueError("scan got no values to scan over and `length` not provided.")
        if len(set(lens)) > 1:
            raise ValueError(f"scan got values with different leading axis sizes: "
                             f"{', '.join(str(n) for n in lens)}.")
        length = lens[0]

    def run(carry, i):
        x = tree_unflatten(xtd, [_step(v, i) for v in leaves])
        out = f(carry, x)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError(f"scan body output must be a pair, got {out!r}.")
        new, y = out
        _check_carry(who, carry, new)
        return new, y

    carry = init
    ys = [None] * length
    for i in (range(length - 1, -1, -1) if reverse else range(length)):
        carry, ys[i] = run(carry, i)
    if length == 0:
        x0 = tree_unflatten(xtd, [ShapeDtypeStruct(tuple(np.shape(v) if not hasattr(v, "shape")
                                                         else v.shape)[1:],
                                                   _leaf_type(v)[1] if _leaf_type(v) else
                                                   np.float32) for v in leaves])
        out = eval_shape(f, init, x0)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError(f"scan body output must be a pair, got {out!r}.")
        empty = [ShapeDtypeStruct((0,) + s.shape, s.dtype) if is_abstract() else
                 cnp.zeros((0,) + s.shape, s.dtype) for s in tree_flatten(out[1])[0]]
        return carry, tree_unflatten(tree_flatten(out[1])[1], empty)
    y_leaves0, ytd = tree_flatten(ys[0])
    cols = [[v] for v in y_leaves0]
    for k, y in enumerate(ys[1:], 1):
        lk, tk = tree_flatten(y)
        if tk != ytd:
            raise TypeError(f"{who}: iteration {k} returned ys of structure {tk}, iteration 0 "
                            f"{ytd}; the body must return one structure")
        for c, v in zip(cols, lk):
            c.append(v)
    return carry, tree_unflatten(ytd, [_stack(c, who) for c in cols])


def map(f, xs, *, batch_size=None):  # noqa: A001 - lax's name
    """``jax.lax.map``: ``f`` applied to each slice of ``xs`` along axis 0 (a pytree), the
    results stacked: ``scan`` without a carry. ``batch_size`` is accepted and changes nothing
    here (the slices run one by one, eagerly).

    >>> import numpy as np
    >>> from ctrainstate import lax
    >>> np.asarray(lax.map(lambda x: x * 2, np.arange(3, dtype=np.float32))).tolist()
    [0.0, 2.0, 4.0]
    """
    if batch_size is not None and operator.index(batch_size) < 1:
        raise ValueError(f"map: batch_size must be a positive int, got {batch_size!r}")
    _, ys = scan(lambda c, x: (c, f(x)), None, xs)
    return ys


def associative_scan(fn, elems, reverse=False, axis=0):
    """``jax.lax.associative_scan``: the inclusive scan of an associative ``fn`` along
    ``axis`` of ``elems`` (a pytree of arrays of one length there), from the end with
    ``reverse``. ``fn(a, b)`` takes and returns pytrees of ``elems``' structure, elementwise
    over slices (it is called on strided slices of several elements at once).

    The same parallel prefix scan as jax's: adjacent pairs combined, the half-length scan of
    those computed recursively (the odd outputs), each combined with the next even element
    (the even outputs), the two interleaved (as jax does, by adding zero-padded halves: an
    output ``-0.0`` comes back ``+0.0``, as in jax). So a non-associative ``fn`` (floating
    rounding) gives jax's grouping and values, and gradients where ``fn``'s depend on the
    grouping (``maximum`` at ties) are jax's. Differentiable through ``fn``.

    >>> import numpy as np
    >>> from ctrainstate import lax
    >>> np.asarray(lax.associative_scan(lambda a, b: a + b, np.arange(1, 6, dtype=np.float32))).tolist()
    [1.0, 3.0, 6.0, 10.0, 15.0]
    """
    if not callable(fn):
        raise TypeError(f"associative_scan: fn must be callable, got {type(fn).__name__}")
    flat, tree = tree_flatten(elems)
    if not flat:
        raise ValueError("associative_scan: elems holds no arrays")
    flat = [v if isinstance(v, Array) else cnp.asarray(v) for v in flat]
    nd = flat[0].ndim
    try:
        ax = operator.index(axis)
    except TypeError:
        raise TypeError(f"associative_scan: axis must be an int, got {axis!r}") from None
    if not -nd <= ax < nd:
        raise ValueError(f"associative_scan: axis {axis} is out of bounds for the "
                         f"{nd}-d elems (shape {tuple(flat[0].shape)})")
    ax %= nd
    n = int(flat[0].shape[ax])
    if any(v.ndim <= ax or int(v.shape[ax]) != n for v in flat[1:]):
        raise ValueError(f"Array inputs to associative_scan must have the same first "
                         f"dimension. (saw: {[tuple(v.shape) for v in flat]})")
    if reverse:
        flat = [rev(v, (ax,)) for v in flat]

    def combine(a, b):
        out = fn(tree_unflatten(tree, a), tree_unflatten(tree, b))
        leaves, otree = tree_flatten(out)
        if otree != tree:
            raise TypeError(f"associative_scan: fn must return the structure of its operands "
                            f"({tree}), got {otree}")
        leaves = [v if isinstance(v, Array) else cnp.asarray(v) for v in leaves]
        for v, x in zip(leaves, a):
            if tuple(v.shape) != tuple(x.shape):
                raise ValueError(f"associative_scan: fn must return arrays of its operands' "
                                 f"shapes (it is applied elementwise to slices), got "
                                 f"{tuple(v.shape)} for operands of shape {tuple(x.shape)}")
        return leaves

    def interleave(a, b):
        # jax's: a's elements at the even positions, b's at the odd, by padding each with
        # zeros between its elements and adding (or-ing booleans)
        same = a.shape[ax] == b.shape[ax]
        cfg_a = [(0, 0, 0)] * a.ndim
        cfg_b = [(0, 0, 0)] * b.ndim
        cfg_a[ax] = (0, 1 if same else 0, 1)
        cfg_b[ax] = (1, 0 if same else 1, 1)
        pa, pb = pad(a, np.zeros((), a.dtype), cfg_a), pad(b, np.zeros((), b.dtype), cfg_b)
        return cnp.logical_or(pa, pb) if a.dtype == np.bool_ else cnp.add(pa, pb)

    out = _prefix_scan(flat, ax, combine, interleave)
    if reverse:
        out = [rev(v, (ax,)) for v in out]
    return tree_unflatten(tree, out)


def _axis_slice(v, ax, start, stop, step=1):
    idx = [slice(None)] * v.ndim
    idx[ax] = slice(start, stop, step)
    return v[tuple(idx)]


def _prefix_scan(es, ax, combine, interleave):
    """jax's ``associative_scan`` recursion over the list of arrays ``es`` along ``ax``:
    ``combine(a_list, b_list)`` combines lists of slices, ``interleave(even, odd)`` merges two
    halves (even positions first). Shared by :func:`associative_scan` and ``lax.cummax``."""
    sl = _axis_slice
    m = int(es[0].shape[ax])
    if m < 2:
        return es
    odd = _prefix_scan(combine([sl(e, ax, 0, m - 1, 2) for e in es],
                               [sl(e, ax, 1, None, 2) for e in es]), ax, combine, interleave)
    if m % 2 == 0:
        even = combine([sl(o, ax, 0, int(o.shape[ax]) - 1) for o in odd],
                       [sl(e, ax, 2, None, 2) for e in es])
    else:
        even = combine(odd, [sl(e, ax, 2, None, 2) for e in es])
    even = [concatenate([sl(e, ax, 0, 1), r], axis=ax) for e, r in zip(es, even)]
    return [interleave(e, o) for e, o in zip(even, odd)]
