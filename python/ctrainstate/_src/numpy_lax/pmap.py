"""``pmap`` (mirror of ``jax.pmap``) and the collectives over its named axis (``lax.psum``,
``pmean``, ``pmax``, ``pmin``, ``all_gather``, ``psum_scatter``, ``ppermute``,
``axis_index``).

ctrainstate runs eagerly, so ``pmap(f, axis_name)(x)`` runs ``f`` once per device on that
device's slice of the mapped arguments (SPMD, as XLA does with a pmapped program). Each
replica runs in a thread of its own (its own autodiff tape, so ``grad`` inside the mapped
function differentiates that replica only), and the replicas take turns: one runs at a time,
until it reaches a collective or returns, then the next one runs. When the last replica
reaches a collective, it is evaluated over all of them (in replica order, so results are
deterministic) and replica 0 resumes. The device kernels of each op still use all cores;
what is serial is the Python between them, as in any eager run.

Layout. A mapped argument's slice ``i`` is copied onto ``devices[i]`` (the first ``n`` local
devices, or ``devices=``), where replica ``i`` computes; the results are stacked along a new
leading axis of size ``n`` sharded one slice per device over a 1-D mesh named ``axis_name``
(pmap's layout, and that of :func:`ctrainstate.hf.replicate` / :func:`~ctrainstate.hf.shard`,
so a pmapped step's outputs go back into the next step with one device copy per slice and no
gather). Inside a replica, values created without an operand (``jnp.zeros``, a constant)
go on the replica's device: each replica runs inside ``with Mesh([device], (axis_name,))``.
The thread's logical axis rules and matmul precision are carried into the replicas.

What differs from jax: the mapped function runs eagerly, once per replica (jax traces it once
and compiles); ``donate_argnums`` is accepted and changes nothing (the inputs are copied per
replica and stay valid); ``out_axes=None`` returns replica 0's value without checking that
the replicas agree; ``axis_index_groups``, nested ``pmap`` and differentiating *through* a
``pmap`` from outside (``grad(lambda p: pmap(f)(p))``) are refused with an error that says
so (differentiate inside the mapped function, as data-parallel training steps do).

>>> import numpy as np, ctrainstate as cts
>>> n = cts.local_device_count()
>>> f = cts.pmap(lambda x: x - cts.lax.pmean(x, 'i'), axis_name='i')
>>> out = f(np.arange(n, dtype=np.float32))
>>> out.shape == (n,), float(np.asarray(out).sum())
(True, 0.0)
"""
from __future__ import annotations

import functools
import threading
from typing import Callable, Sequence

import numpy as np

from ... import _C
from ..base import tree_util
from ..array.array import Array, device_put
from ..array.sharding import Mesh, NamedSharding, PartitionSpec
from ..base import dtypes as _dtypes, precision as _precision
from ..ops import ops as _ops
from . import numpy as cnp
from ..base.devices import local_devices

__all__ = ["pmap", "device_put_sharded", "device_put_replicated", "psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute",
           "axis_index"]

# the pmap axes bound in this thread: {axis_name: (group, replica index)}
_tls = threading.local()


def _bound() -> dict:
    return getattr(_tls, "axes", None) or {}


class _Aborted(BaseException):
    """Raised in a waiting replica when another replica failed (not an Exception, so user
    code's ``except Exception`` does not swallow it)."""


class _Group:
    """The replicas of one pmap call: whose turn it is, and the collective being gathered."""

    def __init__(self, name, devices, meshes):
        self.name, self.devices, self.meshes = name, devices, meshes
        self.n = len(devices)
        # one lock; a condition per replica, so that passing the turn wakes only its taker
        self.lock = threading.Lock()
        self.conds = [threading.Condition(self.lock) for _ in range(self.n)]
        self.turn = -1           # nobody's until every replica's thread has started (go())
        self.pending: list = [None] * self.n
        self.results: list = [None] * self.n
        self.error = None        # (replica, exception): the first failure
        self.aborted = False

    def _give_turn(self, i):
        self.turn = i
        if 0 <= i < self.n:
            self.conds[i].notify()

    def _wait_turn(self, i):
        while self.turn != i and not self.aborted:
            self.conds[i].wait()
        if self.aborted:
            raise _Aborted()

    def go(self):
        with self.lock:
            self._give_turn(0)

    def start(self, i):
        with self.lock:
            self._wait_turn(i)

    def _abort(self):
        self.aborted = True
        for c in self.conds:
            c.notify_all()

    def fail(self, i, exc):
        with self.lock:
            if self.error is None and not isinstance(exc, _Aborted):
                self.error = (i, exc)
            self._abort()

    def arrive(self, i, kind, what, payload):
        """Replica ``i`` reached collective ``kind`` (or ``'return'``); the others run their
        turn; returns this replica's result once the last one has arrived."""
        with self.lock:
            self.pending[i] = (kind, what, payload)
            if i + 1 < self.n:
                self._give_turn(i + 1)
            else:
                try:
                    done = self._resolve()
                except BaseException as exc:   # a mismatch or a failing reduction: all stop
                    if self.error is None:
                        self.error = (i, exc)
                    self._abort()
                    raise _Aborted() from None
                self._give_turn(self.n if done else 0)
            if kind == "return":
                return None
            self._wait_turn(i)
            out, self.results[i] = self.results[i], None
            return out

    def _resolve(self) -> bool:
        kinds = [(p[0], p[1]) for p in self.pending]
        if len(set(kinds)) != 1:
            desc = "; ".join(f"replica {r}: {_describe(k)}" for r, k in enumerate(kinds))
            raise RuntimeError(
                f"pmap over {self.name!r}: the replicas reached different collectives ({desc}). "
                "Every replica must call the same collectives, over the same axis and on "
                "trees of the same structure, in the same order (data-dependent Python "
                "branches around a collective break this)")
        kind = kinds[0][0]
        payloads = [p[2] for p in self.pending]
        self.pending = [None] * self.n
        if kind == "return":
            return True
        saved = getattr(_ops._tls, "tapes", None)
        _ops._tls.tapes = None      # the reduction itself is not differentiated (see _record)
        try:
            with self.meshes[0]:    # computed on replica 0's device, then copied to each
                self.results = _COLLECTIVES[kind](self, payloads)
        finally:
            _ops._tls.tapes = saved
        return False


def _describe(k) -> str:
    kind, what = k
    return "returned" if kind == "return" else f"{kind}{what}"


# --- the collectives: payloads (one per replica) -> results (one per replica) ---------------

def _on(x, g, j):
    """``x`` placed on replica ``j``'s device (an Array leaf; host values stay host)."""
    if isinstance(x, Array):
        return device_put(x, _rep(g.meshes[j]))
    return x


def _copy_on(x: Array, g, j) -> Array:
    """A fresh copy of the one-block Array ``x`` (on replica ``j``'s device), on its mesh."""
    return _block_copy(x._blocks[0][1], x.shape, x.dtype, x._blocks[0][0], g.meshes[j])


def _block_copy(src, shape, dtype, dev, mesh) -> Array:
    """A new one-block Array of ``shape`` on ``dev`` (replicated over the one-device
    ``mesh``) holding a device copy of the buffer ``src`` (as many bytes): the replicas'
    inputs and the collectives' copies, without the general layout machinery."""
    shape = tuple(shape)
    new = _C.Buffer(dev.id, shape, _dtypes.code(dtype))
    _C.copy_bytes(new, src)
    return Array._create(shape, dtype, _rep(mesh), [(dev, new, (0,) * len(shape), 0)])


def _on_own_device(xs, g) -> bool:
    """Whether ``xs[j]`` are float32 Arrays of one shape, each one block on replica j's
    device: the leaves the device all-reduce takes directly."""
    shape = getattr(xs[0], "shape", None)
    for j, x in enumerate(xs):
        if (not isinstance(x, Array) or x.dtype != np.float32 or x.shape != shape
                or len(x._blocks) != 1 or x._blocks[0][0] != g.devices[j]):
            return False
        x._check_alive()
    return True


def _leafwise(fn, allreduce_op=None):
    """A collective over trees: ``fn(g, [leaf of each replica]) -> [result of each]`` applied
    to every leaf; the trees have one structure (checked with the kind). With
    ``allreduce_op`` (a CT_RED_* op), the float32 leaves that live on their replica's device
    are reduced together by one device all-reduce (``_C.op_allreduce``: each group summed or
    maxed in replica order, in place) over fresh copies, the others by ``fn``."""
    def run(g, payloads):
        leaves = [tree_util.tree_leaves(p) for p in payloads]
        td = tree_util.tree_structure(payloads[0])
        per_leaf: list = [None] * len(leaves[0])
        fast = []
        for k in range(len(leaves[0])):
            xs = [lv[k] for lv in leaves]
            if allreduce_op is not None and _on_own_device(xs, g):
                fast.append(k)
                per_leaf[k] = [_copy_on(x, g, j) for j, x in enumerate(xs)]
            else:
                per_leaf[k] = fn(g, xs)
        if fast:
            _C.op_allreduce([[_ops._bufs(a)[0] for a in per_leaf[k]] for k in fast],
                            allreduce_op)
            if fn is _PMEAN:
                for k in fast:
                    per_leaf[k] = [cnp.true_divide(a, g.n) for a in per_leaf[k]]
        return [tree_util.tree_unflatten(td, [r[j] for r in per_leaf]) for j in range(g.n)]
    return run


def _combine(op):
    def fn(g, xs):
        if not any(isinstance(x, Array) for x in xs):     # host values: reduce on the host
            r = _HOST_OPS[op](xs if all(isinstance(x, (int, float)) for x in xs)
                              else [np.asarray(x) for x in xs])
            if isinstance(r, (int, float)):
                return [r] * g.n                # psum(1, name): the axis size, a Python int
            return [device_put(r, NamedSharding(m, PartitionSpec())) for m in g.meshes]
        binop = {"psum": cnp.add, "pmean": cnp.add, "pmax": cnp.maximum,
                 "pmin": cnp.minimum}[op]
        acc = _on(xs[0], g, 0) if isinstance(xs[0], Array) else xs[0]
        for x in xs[1:]:
            acc = binop(acc, _on(x, g, 0))
        if op == "pmean":
            acc = cnp.true_divide(acc, g.n)
        return [_on(acc, g, j) for j in range(g.n)]
    return fn


def _host_sum(xs):
    out = xs[0]
    for x in xs[1:]:
        out = out + x
    return out


_HOST_OPS = {
    "psum": _host_sum,
    "pmean": lambda xs: _host_sum(xs) / len(xs),
    "pmax": lambda xs: functools.reduce(np.maximum, xs) if isinstance(xs[0], np.ndarray) else max(xs),
    "pmin": lambda xs: functools.reduce(np.minimum, xs) if isinstance(xs[0], np.ndarray) else min(xs),
}


def _with_options(fn):
    """A collective whose payloads are ``(tree, options)``: ``fn(g, [the replicas' Arrays of
    one leaf], options) -> [each replica's result]`` for every leaf (host leaves placed
    first)."""
    def run(g, payloads):
        opts = payloads[0][1]
        leaves = [tree_util.tree_leaves(p[0]) for p in payloads]
        td = tree_util.tree_structure(payloads[0][0])
        per_leaf = []
        for k in range(len(leaves[0])):
            xs = [lv[k] if isinstance(lv[k], Array) else device_put(np.asarray(lv[k]))
                  for lv in leaves]
            per_leaf.append(fn(g, xs, opts))
        return [tree_util.tree_unflatten(td, [r[j] for r in per_leaf]) for j in range(g.n)]
    return run


def _gather(g, xs, opts):
    """all_gather: the replicas' values stacked (or concatenated) along ``axis``, on each."""
    axis, tiled = opts
    xs = [_on(x, g, 0) for x in xs]
    whole = cnp.concatenate(xs, axis=axis) if tiled else cnp.stack(xs, axis=axis)
    return [_on(whole, g, j) for j in range(g.n)]


def _scatter(g, xs, opts):
    """psum_scatter: the replicas' sum, split along ``dim``; replica ``j`` keeps part ``j``."""
    dim, tiled = opts
    total = _on(xs[0], g, 0)
    for x in xs[1:]:
        total = cnp.add(total, _on(x, g, 0))
    d = dim % total.ndim
    if tiled:
        b = total.shape[d] // g.n
        parts = [cnp.take(total, np.arange(j * b, (j + 1) * b), axis=d) for j in range(g.n)]
    else:
        parts = [cnp.take(total, j, axis=d) for j in range(g.n)]
    return [_on(parts[j], g, j) for j in range(g.n)]


def _permute(g, xs, perm):
    """ppermute: replica ``d`` gets the value of ``s`` for ``(s, d)`` in ``perm``, else zeros
    (as jax)."""
    src_of = {dst: src for src, dst in perm}
    return [_on(xs[src_of[j]], g, j) if j in src_of else _on(cnp.zeros_like(xs[j]), g, j)
            for j in range(g.n)]


_PMEAN = _combine("pmean")
_COLLECTIVES = {"psum": _leafwise(_combine("psum"), 0), "pmean": _leafwise(_PMEAN, 0),
                "pmax": _leafwise(_combine("pmax"), 1), "pmin": _leafwise(_combine("pmin")),
                "all_gather": _with_options(_gather), "ppermute": _with_options(_permute),
                "psum_scatter": _with_options(_scatter)}


# --- the public collectives -----------------------------------------------------------------

def _group_of(axis_name, who):
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    bound = _bound()
    if not names:
        raise ValueError(f"{who}: axis_name is empty")
    for nm in names:
        if nm not in bound and nm in getattr(_tls, "vmap_names", ()):
            raise NotImplementedError(
                f"{who} over the vmap axis {nm!r}: collectives over a vmap axis are not "
                "supported (ctrainstate.vmap runs the function once per element, in a loop); "
                "reduce the vmapped outputs instead (e.g. jnp.sum(vmap(f)(x), axis=0))")
        if nm not in bound:
            raise NameError(
                f"unbound axis name: {nm!r}. {who} reduces over the named axis of an enclosing "
                f"ctrainstate.pmap(..., axis_name={nm!r}); the axis names bound here: "
                f"{sorted(bound)}. Outside pmap, a sharded Array's reductions (jnp.sum, the "
                "mean of a loss) already combine every device")
    if len(set(names)) != len(names) or len(names) > 1:
        raise NotImplementedError(f"{who}: one axis name at a time (nested pmap is not "
                                  f"supported); got {tuple(names)}")
    return bound[names[0]]


def _no_groups(axis_index_groups, who):
    if axis_index_groups is not None:
        raise NotImplementedError(f"{who}: axis_index_groups is not supported (every replica "
                                  "of the pmap takes part)")


def _structure_key(x) -> str:
    return str(tree_util.tree_structure(x))


def _record_collective(outs, ins, vjp_leaf):
    """Each Array result of a collective on this replica's tape: its cotangent is
    ``vjp_leaf(g)`` (itself a collective, which every replica's backward pass reaches in the
    same order)."""
    if _ops._tape() is None:
        return
    for o, x in zip(tree_util.tree_leaves(outs), tree_util.tree_leaves(ins)):
        if isinstance(o, Array) and isinstance(x, Array):
            _ops._record(o, (x,), lambda g, _x=x: (vjp_leaf(g),))


def _reduce(kind, x, axis_name, axis_index_groups, who):
    _no_groups(axis_index_groups, who)
    g, i = _group_of(axis_name, who)
    out = g.arrive(i, kind, f"(structure {_structure_key(x)})", x)
    if kind == "psum":
        _record_collective(out, x, lambda ct: psum(ct, axis_name))
    elif kind == "pmean":
        _record_collective(out, x, lambda ct: pmean(ct, axis_name))
    # pmax / pmin: jax has no derivative for them (it raises); the outputs are not recorded,
    # so no gradient flows through them
    return out


def psum(x, axis_name, *, axis_index_groups=None):
    """The sum of ``x`` (a pytree) over the replicas of the enclosing ``pmap`` axis
    ``axis_name``, on every replica (``jax.lax.psum``). ``psum(1, name)`` is the axis size.
    Differentiable: the cotangent is the psum of the cotangents, as jax's transpose rule."""
    return _reduce("psum", x, axis_name, axis_index_groups, "psum")


def pmean(x, axis_name, *, axis_index_groups=None):
    """The mean of ``x`` over the replicas (``jax.lax.pmean``: psum / axis size; integer
    Arrays give float32). Differentiable (cotangent: the pmean of the cotangents)."""
    return _reduce("pmean", x, axis_name, axis_index_groups, "pmean")


def pmax(x, axis_name, *, axis_index_groups=None):
    """The elementwise maximum over the replicas (``jax.lax.pmax``; NaN wins, as jnp.maximum)."""
    return _reduce("pmax", x, axis_name, axis_index_groups, "pmax")


def pmin(x, axis_name, *, axis_index_groups=None):
    """The elementwise minimum over the replicas (``jax.lax.pmin``)."""
    return _reduce("pmin", x, axis_name, axis_index_groups, "pmin")


def all_gather(x, axis_name, *, axis_index_groups=None, axis: int = 0, tiled: bool = False):
    """Every replica's ``x`` stacked along a new axis ``axis`` (``tiled=True``: concatenated
    along the existing ``axis``), on every replica (``jax.lax.all_gather``). Differentiable:
    replica ``i``'s cotangent is its slice of the psum of the cotangents."""
    _no_groups(axis_index_groups, "all_gather")
    g, i = _group_of(axis_name, "all_gather")
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"all_gather: axis must be an int, got {axis!r}")
    for v in tree_util.tree_leaves(x):
        r = np.ndim(v) + (0 if tiled else 1)
        if not -r <= axis < r or (tiled and r == 0):
            raise ValueError(f"all_gather: axis {axis} is out of range for an operand of rank "
                             f"{np.ndim(v)}{' (tiled)' if tiled else ''}")
    out = g.arrive(i, "all_gather", f"(axis={axis}, tiled={tiled}, structure "
                   f"{_structure_key(x)})", (x, (axis, tiled)))

    def vjp_leaf(ct, _i=i, _axis=axis, _tiled=tiled):
        total = psum(ct, axis_name)
        if _tiled:
            k = total.shape[_axis % total.ndim] // g.n
            return cnp.take(total, np.arange(_i * k, (_i + 1) * k), axis=_axis)
        return cnp.take(total, _i, axis=_axis)
    _record_collective(out, x, vjp_leaf)
    return out


def psum_scatter(x, axis_name, *, scatter_dimension: int = 0, axis_index_groups=None,
                 tiled: bool = False):
    """The sum of ``x`` over the replicas, split along ``scatter_dimension``: replica ``i``
    gets part ``i`` (``jax.lax.psum_scatter``, a reduce-scatter). Without ``tiled`` that
    dimension must have the axis size and is removed; with ``tiled`` it must divide by it and
    each replica keeps its block. Differentiable: the cotangents are all-gathered back."""
    _no_groups(axis_index_groups, "psum_scatter")
    g, i = _group_of(axis_name, "psum_scatter")
    if not isinstance(scatter_dimension, (int, np.integer)) or isinstance(scatter_dimension, bool):
        raise TypeError(f"psum_scatter: scatter_dimension must be an int, got "
                        f"{scatter_dimension!r}")
    for v in tree_util.tree_leaves(x):
        shape = np.shape(v)
        if not -len(shape) <= scatter_dimension < len(shape) or not shape:
            raise ValueError(f"psum_scatter: scatter_dimension {scatter_dimension} is out of "
                             f"range for an operand of shape {shape}")
        size = shape[scatter_dimension]
        if (size % g.n) if tiled else (size != g.n):
            want = f"a multiple of the axis size {g.n}" if tiled else f"the axis size {g.n}"
            raise ValueError(f"psum_scatter: dimension {scatter_dimension} of an operand of "
                             f"shape {shape} has size {size}; it must be {want}"
                             f"{'' if tiled else ' (tiled=True splits it in blocks)'}")
    out = g.arrive(i, "psum_scatter", f"(scatter_dimension={scatter_dimension}, tiled={tiled}, "
                   f"structure {_structure_key(x)})", (x, (scatter_dimension, tiled)))

    def vjp_leaf(ct, _d=scatter_dimension, _tiled=tiled):
        nd = np.ndim(ct) + (0 if _tiled else 1)
        return all_gather(ct, axis_name, axis=_d % nd, tiled=_tiled)
    _record_collective(out, x, vjp_leaf)
    return out


def ppermute(x, axis_name, perm):
    """``x`` sent along ``perm`` (pairs ``(source, destination)`` of replica indices): replica
    ``d`` gets the ``x`` of the ``s`` with ``(s, d)`` in ``perm``, zeros if none
    (``jax.lax.ppermute``). Differentiable (the cotangents go back along the inverse pairs)."""
    g, i = _group_of(axis_name, "ppermute")
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise TypeError(f"ppermute: perm must be a sequence of (source, destination) pairs, "
                        f"got {perm!r}") from None
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    bad = [v for v in srcs + dsts if not 0 <= v < g.n]
    if bad or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"ppermute sources and destinations must be unique indices in "
                         f"[0, {g.n}) (the axis size), got {pairs}")
    out = g.arrive(i, "ppermute", f"(perm={pairs}, structure {_structure_key(x)})", (x, pairs))
    inverse = [(d, s) for s, d in pairs]
    _record_collective(out, x, lambda ct: ppermute(ct, axis_name, inverse))
    return out


def axis_index(axis_name):
    """This replica's index along the pmap axis ``axis_name``, a 0-d int32 Array on its device
    (``jax.lax.axis_index``)."""
    g, i = _group_of(axis_name, "axis_index")
    return device_put(np.int32(i), NamedSharding(g.meshes[i], PartitionSpec()))


# --- pmap ----------------------------------------------------------------------------------

def _axes_of(in_axes, args, what, who="pmap"):
    """The mapped axis (int or None) of every leaf of ``args``, from the prefix ``in_axes``."""
    if isinstance(in_axes, list):
        in_axes = tuple(in_axes)
    if in_axes is None or isinstance(in_axes, (int, np.integer)):
        prefix = tuple(in_axes for _ in args)
    elif isinstance(in_axes, tuple):
        if len(in_axes) != len(args):
            raise ValueError(f"{who} in_axes specification must be a tree prefix of the "
                             f"corresponding value, got specification {in_axes} for value "
                             f"tree of {len(args)} positional arguments")
        prefix = in_axes
    else:
        prefix = in_axes    # a single tree prefix, e.g. a dict for one argument
        if len(args) != 1:
            raise ValueError(f"{who} in_axes: {in_axes!r} is neither an int, None nor a tuple "
                             f"with one entry per positional argument ({len(args)})")
        prefix = (in_axes,)
    for a in tree_util.tree_leaves(prefix, is_leaf=lambda v: v is None):
        if a is not None and (not isinstance(a, (int, np.integer)) or isinstance(a, bool)):
            raise TypeError(f"{who} {what}: each entry must be an int or None, got {a!r}")
    try:
        full = tree_util.tree_broadcast(prefix, tuple(args), is_leaf=lambda v: v is None)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{who} in_axes specification must be a tree prefix of the positional "
                         f"arguments: {e}") from None
    return tree_util.tree_leaves(full, is_leaf=lambda v: v is None)


def _block_for(x: Array, axis: int, i: int, dev):
    """The buffer holding exactly slice ``i`` of ``x`` along ``axis`` on ``dev``, or None."""
    if axis != 0 or x._shard_shape[0] != 1 or tuple(x._shard_shape[1:]) != tuple(x.shape[1:]):
        return None
    for d, buf, start, _ in x._blocks:
        if d == dev and start[0] == i:
            return buf
    return None


_REP: dict = {}


def _rep(mesh) -> NamedSharding:
    """``NamedSharding(mesh, P())`` for a replica's (kept) mesh, made once."""
    hit = _REP.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        if len(_REP) > 512:
            _REP.clear()
        hit = _REP[id(mesh)] = (mesh, NamedSharding(mesh, PartitionSpec()))
    return hit[1]


def _slice_for(x, axis, i, mesh, dev):
    """Slice ``i`` of ``x`` along ``axis``, as an Array on replica ``i``'s device."""
    if isinstance(x, Array):
        buf = _block_for(x, axis, i, dev)
        if buf is not None:       # pmap's own layout: one device copy, no gather
            x._check_alive()
            return _block_copy(buf, x.shape[1:], x.dtype, dev, mesh)
    return device_put(np.take(np.asarray(x), i, axis=axis), _rep(mesh))


def _stack(outs, out_axis, group, out_mesh):
    """The replicas' values of one output leaf stacked along ``out_axis`` over ``out_mesh``:
    one device copy per replica into its block (no gather)."""
    if out_axis is None:
        return outs[0]
    arrays = [v if (isinstance(v, Array) and len(v._blocks) == 1
                    and v._blocks[0][0] == group.devices[j])
              else _on(v if isinstance(v, Array) else device_put(np.asarray(v)), group, j)
              for j, v in enumerate(outs)]
    for a in arrays:
        a._check_alive()
    shapes = {a.shape for a in arrays}
    dts = {a.dtype for a in arrays}
    if len(shapes) != 1 or len(dts) != 1:
        raise ValueError(f"pmap: the replicas returned values of different shapes or dtypes "
                         f"for one output ({sorted(map(str, shapes))}, "
                         f"{sorted(map(str, dts))})")
    shape, dt = arrays[0].shape, arrays[0].dtype
    nd = len(shape) + 1
    if not -nd <= out_axis < nd:
        raise ValueError(f"pmap out_axes {out_axis} is out of range for an output of rank "
                         f"{len(shape)}")
    out = _ops._new((group.n,) + tuple(shape), out_mesh,
                    [(out_mesh.axis_names[0],)] + [()] * len(shape), dt)
    for _, dst, start, _ in out._blocks:      # block j: slice j, on devices[j]
        _C.copy_bytes(dst, _ops._bufs(arrays[start[0]])[0])
    if out_axis % nd != 0:
        out = cnp.moveaxis(out, 0, out_axis % nd)
    return out


def _map_size(leaves, axes, axis_size, who):
    """The mapped size of ``leaves`` along ``axes`` (normalised in place; None: unmapped),
    or ``axis_size`` when nothing is mapped; jax's errors otherwise."""
    sizes = {}
    for k, (v, a) in enumerate(zip(leaves, axes)):
        if a is None:
            continue
        nd = np.ndim(v)
        if nd == 0:
            raise ValueError(f"{who} was requested to map its argument along axis {a}, which "
                             f"implies that its rank should be at least {a + 1}, but is only "
                             f"{nd} (its shape is {np.shape(v)})")
        if not -nd <= a < nd:
            raise ValueError(f"{who} in_axes {a} is out of range for an argument of shape "
                             f"{np.shape(v)}")
        axes[k] = a % nd
        sizes.setdefault(np.shape(v)[a % nd], []).append(np.shape(v))
    if len(sizes) > 1:
        detail = ", ".join(f"size {s} (shapes {sh[:3]})" for s, sh in sizes.items())
        raise ValueError(f"{who} got inconsistent sizes for array axes to be mapped: {detail}")
    if sizes:
        n = next(iter(sizes))
        if axis_size is not None and axis_size != n:
            raise ValueError(f"{who} axis_size={axis_size} does not match the mapped size {n} "
                             "of the arguments")
        return n
    if axis_size is not None:
        return int(axis_size)
    raise ValueError(f"{who}: no argument is mapped (all in_axes are None or there are no "
                     "array arguments); give axis_size=")


_MESHES: dict = {}


def _meshes_for(devs, name):
    """Each replica's one-device mesh and the stacked outputs' mesh, the same objects from
    call to call (the ops' dispatch caches key on the meshes)."""
    key = (tuple(d.id for d in devs), tuple(d.platform for d in devs), name)
    hit = _MESHES.get(key)
    if hit is None:
        if len(_MESHES) > 64:
            _MESHES.clear()
        hit = _MESHES[key] = ([Mesh(np.array([d], dtype=object), (name,)) for d in devs],
                              Mesh(np.array(devs, dtype=object), (name,)))
    return hit


def _norm_argnums(v, what) -> tuple:
    if v is None:
        return ()
    if isinstance(v, (int, np.integer)):
        return (int(v),)
    try:
        return tuple(int(a) for a in v)
    except TypeError:
        raise TypeError(f"pmap {what} must be an int or a sequence of ints, got {v!r}") from None


def pmap(fun: Callable | None = None, axis_name=None, *, in_axes=0, out_axes=0,
         static_broadcasted_argnums: int | Sequence[int] = (), devices=None, backend=None,
         axis_size: int | None = None, donate_argnums: int | Sequence[int] = ()):
    """``jax.pmap``: ``fun`` run on each of ``n`` devices on its slice of the mapped axis of
    the arguments, with collectives (:func:`psum`, :func:`pmean`, ...) over ``axis_name``.

    Args:
      fun: the per-device function (a pytree of arrays in and out).
      axis_name: the name the collectives use (None: the function uses none).
      in_axes: the mapped axis of each positional argument (an int, None for broadcast, or a
        tuple with a tree prefix per argument); keyword arguments are mapped over axis 0.
      out_axes: where the mapped axis goes in the outputs (an int or None, or a tree prefix).
      static_broadcasted_argnums: positional arguments passed unchanged to every replica.
      devices: the devices to run on (default: the first ``n`` local devices, ``n`` the
        mapped size).
      backend: 'cpu' or 'gpu' (default: the default backend's devices).
      axis_size: the number of replicas when no argument is mapped.
      donate_argnums: accepted for jax's signature (the inputs stay valid).

    Returns the mapped function; its outputs are Arrays with the mapped axis first, one slice
    per device. See the module docstring for how it runs.
    """
    if fun is None:
        return lambda f: pmap(f, axis_name, in_axes=in_axes, out_axes=out_axes,
                              static_broadcasted_argnums=static_broadcasted_argnums,
                              devices=devices, backend=backend, axis_size=axis_size,
                              donate_argnums=donate_argnums)
    if not callable(fun):
        raise TypeError(f"pmap: the first argument must be a function, got {fun!r}")
    if axis_name is not None and not isinstance(axis_name, str):
        try:
            hash(axis_name)
        except TypeError:
            raise TypeError(f"pmap axis_name must be hashable, got {axis_name!r}") from None
    static = _norm_argnums(static_broadcasted_argnums, "static_broadcasted_argnums")
    _norm_argnums(donate_argnums, "donate_argnums")
    if axis_size is not None and (not isinstance(axis_size, (int, np.integer)) or axis_size < 1):
        raise ValueError(f"pmap axis_size must be a positive int, got {axis_size!r}")
    name = axis_name if axis_name is not None else "_pmap"

    @functools.wraps(fun)
    def mapped(*args, **kwargs):
        if _bound():
            raise NotImplementedError("pmap inside a pmapped function (nested pmap) is not "
                                      "supported")
        if _ops._tape() is not None:
            raise NotImplementedError(
                "differentiating through pmap from outside (grad of a function that calls a "
                "pmapped function) is not supported: take the gradient inside the mapped "
                "function and combine it with lax.pmean, as a data-parallel train step does")
        nargs = len(args)
        for s in static:
            if not -nargs <= s < nargs:
                raise ValueError(f"pmap static_broadcasted_argnums {s} is out of range for "
                                 f"{nargs} positional arguments")
        static_pos = {s % nargs for s in static} if nargs else set()
        dyn = tuple(a for k, a in enumerate(args) if k not in static_pos)
        if isinstance(in_axes, (tuple, list)) and len(in_axes) == nargs and static_pos:
            dyn_axes_spec = tuple(a for k, a in enumerate(in_axes) if k not in static_pos)
        else:
            dyn_axes_spec = in_axes
        axes = _axes_of(dyn_axes_spec, dyn, "in_axes")
        leaves, td = tree_util.tree_flatten(dyn)
        kw_leaves, kw_td = tree_util.tree_flatten(kwargs)
        all_leaves = leaves + kw_leaves
        all_axes = list(axes) + [0] * len(kw_leaves)
        n = _map_size(all_leaves, all_axes, axis_size, "pmap")
        avail = list(devices) if devices is not None else local_devices(backend=backend)
        if n > len(avail):
            raise ValueError(
                f"pmap: the mapped axis has size {n} but only {len(avail)} devices are "
                f"available ({'devices=' if devices is not None else 'local devices'}); map "
                "over at most that many (more CPU devices: CTRAINSTATE_NUM_CPU_DEVICES=k, set "
                "before the first use of ctrainstate)")
        if n == 0:
            raise ValueError("pmap: the mapped axis has size 0")
        devs = avail[:n]
        meshes, out_mesh = _meshes_for(devs, name)
        # each replica's arguments (copies on its device) before any replica runs
        per_replica = []
        for i in range(n):
            vals = []
            for v, a in zip(all_leaves, all_axes):
                if a is None:
                    vals.append(device_put(v, NamedSharding(meshes[i], PartitionSpec()))
                                if isinstance(v, Array) else v)
                else:
                    vals.append(_slice_for(v, a, i, meshes[i], devs[i]))
            d_args = tree_util.tree_unflatten(td, vals[:len(leaves)])
            kw = tree_util.tree_unflatten(kw_td, vals[len(leaves):])
            it = iter(d_args)
            full = tuple(args[k] if k in static_pos else next(it) for k in range(nargs))
            per_replica.append((full, kw))
        group = _Group(axis_name if axis_name is not None else name, devs, meshes)
        rules = _C.get_axis_rules()
        prec = dict(getattr(_precision._tls, "__dict__", {}))
        outs: list = [None] * n

        def body(i):
            try:
                _C.set_axis_rules(rules)
                for k, v in prec.items():   # (as attributes: see base.threadlocal)
                    setattr(_precision._tls, k, v)
                _tls.axes = {group.name: (group, i)}
                group.start(i)
                with meshes[i]:
                    outs[i] = fun(*per_replica[i][0], **per_replica[i][1])
                group.arrive(i, "return", "", None)
            except BaseException as exc:   # noqa: B902 - handed to the caller's thread
                group.fail(i, exc)

        threads = [threading.Thread(target=body, args=(i,), name=f"ctrainstate-pmap-{i}",
                                    daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        group.go()      # replica 0 runs once every thread is up (no GIL contention at start)
        try:
            for t in threads:
                t.join()
        except BaseException:
            group.fail(-1, _Aborted())
            for t in threads:
                t.join()
            raise
        if group.error is not None:
            i, exc = group.error
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised in replica {i} of {n} of the pmap of "
                             f"{getattr(fun, '__name__', fun)!r})")
            raise exc.with_traceback(exc.__traceback__)
        structs = {str(tree_util.tree_structure(o)) for o in outs}
        if len(structs) != 1:
            raise ValueError(f"pmap: the replicas returned trees of different structures: "
                             f"{sorted(structs)}")
        o_leaves = [tree_util.tree_leaves(o) for o in outs]
        o_td = tree_util.tree_structure(outs[0])
        if out_axes is None or isinstance(out_axes, (int, np.integer)):
            o_axes = [out_axes] * len(o_leaves[0])
        else:
            o_axes = tree_util.tree_leaves(
                tree_util.tree_broadcast(out_axes, outs[0], is_leaf=lambda v: v is None),
                is_leaf=lambda v: v is None)
        stacked = [_stack([lv[k] for lv in o_leaves], o_axes[k], group, out_mesh)
                   for k in range(len(o_leaves[0]))]
        return tree_util.tree_unflatten(o_td, stacked)

    return mapped


# --- the pmap-era placement helpers ----------------------------------------------------------

def _stacked_sharding(devices, who):
    devs = list(devices)
    if not devs:
        raise ValueError(f"{who}: devices is empty")
    if len(set(devs)) != len(devs):
        raise ValueError(f"{who}: devices must be distinct, got {devs}")
    return NamedSharding(Mesh(np.array(devs, dtype=object), ("batch",)), PartitionSpec("batch"))


def device_put_sharded(shards: Sequence, devices: Sequence):
    """``jax.device_put_sharded``: ``shards[i]`` (a pytree) on ``devices[i]``, the leaves
    stacked along a new leading axis sharded one slice per device (pmap's layout, as
    :func:`ctrainstate.hf.replicate` gives). Each device receives only its own slice.

    >>> import numpy as np, ctrainstate as cts
    >>> devs = cts.local_devices()[:1]
    >>> a = cts.device_put_sharded([np.float32([1., 2.])], devs)
    >>> a.shape, a.sharding.spec
    ((1, 2), PartitionSpec('batch',))
    """
    shards = list(shards)
    devs = list(devices)
    if len(shards) != len(devs):
        raise ValueError(f"device_put_sharded: len(shards) = {len(shards)} must equal "
                         f"len(devices) = {len(devs)}")
    sharding = _stacked_sharding(devs, "device_put_sharded")
    structs = {str(tree_util.tree_structure(s)) for s in shards}
    if len(structs) != 1:
        raise ValueError(f"device_put_sharded: the shards have different tree structures: "
                         f"{sorted(structs)}")
    per = [tree_util.tree_leaves(s) for s in shards]
    out = []
    for k in range(len(per[0])):
        vals = [np.asarray(p[k]) for p in per]
        if len({(v.shape, v.dtype) for v in vals}) != 1:
            raise ValueError(f"device_put_sharded: leaf {k} has different shapes or dtypes "
                             f"across the shards: {[(v.shape, str(v.dtype)) for v in vals]}")
        out.append(device_put(np.stack(vals), sharding))
    return tree_util.tree_unflatten(tree_util.tree_structure(shards[0]), out)


def device_put_replicated(x, devices: Sequence):
    """``jax.device_put_replicated``: one copy of every leaf of ``x`` per device, stacked along
    a new leading axis sharded one slice per device (as ``device_put_sharded([x] * n)``)."""
    devs = list(devices)
    sharding = _stacked_sharding(devs, "device_put_replicated")

    def rep(v):
        h = np.asarray(v)
        return device_put(np.broadcast_to(h, (len(devs),) + h.shape), sharding)
    return tree_util.tree_map(rep, x)
