"""The implementation of :mod:`ctrainstate.optim.base` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations
from ..base.hooks import provide as _provide, upper as _upper
_provide('optim.base', __name__)   # lower layers call into this module through _hooks.upper

import inspect
import operator
import os
import threading
import weakref
from typing import Any, Callable, NamedTuple

import numpy as np
import optree

from ... import _C
from ..base import dtypes as _dtypes
from ..base.devices import _process
from ..array.array import Array, DonatedBufferError, device_put
from ..array.sharding import NamedSharding, PartitionSpec, default_sharding
from ..base.tree_util import (_leaves_as, keystr, tree_flatten, tree_flatten_with_path,
                              tree_leaves, tree_map, tree_structure, tree_unflatten)
from ..array.abstract import ShapeDtypeStruct

__all__ = ["GradientTransformation", "GradientTransformationExtraArgs", "EmptyState", "MaskedNode",
           "identity", "apply_updates", "safe_increment", "with_extra_args_support"]

# Stage kinds (ct_opt_kind in csrc/core/ct_optim.h, read from the extension) and the state
# slots each owns per leaf.
(SCALE, ADAM, DECAY, TRACE, LION, RMS, RSS, CLIP, GLOBAL_NORM, TRUST_RATIO, FINITE_GATE, EMA,
 FACTORED, BLOCK_RMS, PARAM_RMS, ZERO, BELIEF, YOGI, STDDEV, ACCUM, ADAMAX, AMSGRAD) = (
    _C.optim_kinds[n] for n in (
        "SCALE", "ADAM", "DECAY", "TRACE", "LION", "RMS", "RSS", "CLIP", "GLOBAL_NORM",
        "TRUST_RATIO", "FINITE_GATE", "EMA", "FACTORED", "BLOCK_RMS", "PARAM_RMS", "ZERO",
        "BELIEF", "YOGI", "STDDEV", "ACCUM", "ADAMAX", "AMSGRAD"))
NSLOTS = dict(enumerate(_C.optim_nslots))
_INT32_MAX = 2**31 - 1
_NEEDS_PARAMS = (DECAY, TRUST_RATIO, PARAM_RMS)   # kind_needs_params in csrc/core/ct_optim.c
# stages that reduce over the blocks of a leaf or over the tree: over params that span
# processes they exchange their partial results (ct_opt_procs)
_ACROSS_BLOCKS = (GLOBAL_NORM, TRUST_RATIO, FINITE_GATE, FACTORED, BLOCK_RMS, PARAM_RMS)


class EmptyState(NamedTuple):
    """An empty state for stateless transforms (optax.EmptyState)."""


class MaskedNode(NamedTuple):
    """Stands in for a masked-out leaf of a state tree (optax.MaskedNode); has no leaves."""


def safe_increment(count: int) -> int:
    """count + 1, saturating at the int32 maximum (optax.safe_increment)."""
    return min(int(count) + 1, _INT32_MAX)


class _GradientTransformationFields(NamedTuple):
    init: Callable
    update: Callable


class GradientTransformation(_GradientTransformationFields):
    """A pair of pure functions ``init(params) -> state`` and
    ``update(updates, state, params=None) -> (updates, state)``: optax's NamedTuple
    (``tx[0]``, ``isinstance(tx, tuple)``, ``init, update = tx``).

    ``fuse`` (keyword): the transformation's description as stages of the fused kernel
    (see :func:`run_fused`); without an ``update``, ``update`` runs that kernel
    functionally. The fused path recognises a transformation by its ``fusable`` and
    ``_fuse`` attributes only, so a tuple rebuilt from this one (``tx._replace(...)``,
    ``tree_map`` over it) is a plain, unfused transformation running its ``update``.

    >>> import numpy as np, ctrainstate.optim as optim
    >>> tx = optim.sgd(0.1)
    >>> p = {'w': np.ones(3, np.float32)}
    >>> u, s = tx.update({'w': np.ones(3, np.float32)}, tx.init(p), p)
    >>> np.asarray(u['w']).tolist()
    [-0.10000000149011612, -0.10000000149011612, -0.10000000149011612]
    >>> init, update = tx
    >>> isinstance(tx, tuple), tx[0] is init
    (True, True)
    """

    _fuse = None   # a fusable instance sets its own (a tuple subclass: no __slots__ possible)

    def __new__(cls, init: Callable, update: Callable | None = None, *,
                fuse: Callable | None = None):
        if update is None:
            if fuse is None:
                raise TypeError("a GradientTransformation needs an update or a fuse function")
            update = _FusedUpdate(fuse)
        self = super().__new__(cls, init, update)
        if fuse is not None:
            self._fuse = fuse
        return self

    @property
    def fusable(self) -> bool:
        """True when the whole transformation runs as one fused kernel pass."""
        return self._fuse is not None

    def __repr__(self):
        return f"{type(self).__name__}(fused={self.fusable})"


class GradientTransformationExtraArgs(GradientTransformation):
    """A GradientTransformation whose ``update`` takes extra keyword arguments:
    ``update(updates, state, params=None, **extra_args)`` (optax's). Every transformation
    ctrainstate.optim builds is one; the transforms that do not use extra arguments ignore
    them, combinators forward them to their inner transformations.

    >>> import numpy as np, ctrainstate.optim as optim
    >>> tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adam(0.1))
    >>> p = {'w': np.ones(2, np.float32)}
    >>> u, s = tx.update(p, tx.init(p), p, value=np.float32(3.0))
    >>> isinstance(tx, optim.GradientTransformationExtraArgs)
    True
    """


class _FusedUpdate:
    """The ``update`` of a transformation given only as fused stages: one functional run of
    the fused kernel (extra keyword arguments are accepted and unused: no fused stage reads
    them)."""

    __slots__ = ("_fuse",)

    def __init__(self, fuse):
        self._fuse = fuse

    def __call__(self, updates, state, params=None, **extra_args):
        del extra_args
        return run_fused(self, updates, state, params, inplace=False)


def _takes_extra_args(tx) -> bool:
    """Whether ``tx.update`` accepts extra keyword arguments: an ExtraArgs transformation
    (ctrainstate's or optax's, by class name as optax may not be imported), or an update
    function with a ``**kwargs`` parameter."""
    if isinstance(tx, GradientTransformationExtraArgs) or any(
            c.__name__ == "GradientTransformationExtraArgs" for c in type(tx).__mro__):
        return True
    update = getattr(tx, "update", None)
    if isinstance(update, _FusedUpdate):
        return True
    try:
        params = inspect.signature(update).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def call_update(tx, updates, state, params=None, extra_args=None):
    """``tx.update(updates, state, params, **extra_args)``, leaving the extra arguments out
    for a transformation that does not take them (optax.with_extra_args_support's rule)."""
    if extra_args and _takes_extra_args(tx):
        return tx.update(updates, state, params, **extra_args)
    return tx.update(updates, state, params)


def identity() -> GradientTransformationExtraArgs:
    """The identity transformation (optax.identity)."""
    return GradientTransformationExtraArgs(
        lambda params: EmptyState(),
        fuse=lambda state, ctx: ([], lambda advance=True: ctx.keep(state)))


def with_extra_args_support(tx: GradientTransformation) -> GradientTransformationExtraArgs:
    """``tx`` with an ``update(updates, state, params=None, **extra_args)`` that ignores the
    extra keyword arguments (optax.with_extra_args_support); ``tx`` itself when it takes
    them already. A fusable ``tx`` stays fusable."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"with_extra_args_support: expected a GradientTransformation, got "
                        f"{type(tx).__name__}")
    if isinstance(tx, GradientTransformationExtraArgs):
        return tx

    def update(updates, state, params=None, **extra_args):
        return call_update(tx, updates, state, params, extra_args)
    return GradientTransformationExtraArgs(tx.init, update, fuse=getattr(tx, "_fuse", None))


# --- Arrays helpers ----------------------------------------------------------------------------


def _scalar_sharding(ref):
    """Where scalar counters live: replicated over the mesh of the first Array in ``ref``."""
    for leaf in tree_leaves(ref):
        if isinstance(leaf, (Array, ShapeDtypeStruct)) and leaf.sharding is not None:
            s = leaf.sharding
            if isinstance(s, NamedSharding):
                return NamedSharding(s.mesh, PartitionSpec())
            return s
    return default_sharding()


def scalar(value, dtype, ref=None, sharding=None) -> Array:
    """A replicated scalar Array (counters, flags) that remembers its value on the host."""
    v = np.asarray(value, dtype=dtype)
    out = device_put(v, sharding if sharding is not None else _scalar_sharding(ref))
    if isinstance(out, Array):   # (under eval_shape device_put gives a ShapeDtypeStruct)
        # the value the device holds: device_put narrows (int64 -> int32, float64 -> float32)
        out._host_scalar = v.astype(out.dtype)[()]
    return out


def full_like(x, value, dtype=None) -> Array:
    """An Array of x's shape and sharding, of ``dtype`` (default: x's), filled with ``value``
    (numpy inputs are placed like ``device_put``)."""
    if isinstance(x, ShapeDtypeStruct):
        return ShapeDtypeStruct(x.shape, x.dtype if dtype is None else np.dtype(dtype),
                                x.sharding)
    if not isinstance(x, Array):
        x = np.asarray(x)
        return device_put(np.full(x.shape, value, _dtypes.canonicalize(
            x.dtype if dtype is None else dtype)))
    dtype = x.dtype if dtype is None else np.dtype(dtype)
    code = _dtypes.code(dtype)
    blocks = []
    for dev, _, start, rid in x._blocks:
        buf = _C.Buffer(dev.id, x._shard_shape, code)
        _fill(buf, x._shard_shape, dtype, value)
        blocks.append((dev, buf, start, rid))
    return Array._create(x.shape, dtype, x.sharding, blocks)


_B_ADD = 0  # ct_ops.h CT_BIN_ADD (ctrainstate._src.ops.ops.B_ADD)
_U_AFFINE = 0  # ct_ops.h CT_UN_AFFINE (ctrainstate._src.ops.ops.U_AFFINE): alpha*x + beta, x unread at alpha 0


def _fill(buf, shape, dtype, value) -> None:
    """Fill one shard buffer with ``value`` on its own device (CPU or GPU): float32 by the
    backend's affine kernel (0*x + value, which never reads x), other dtypes by one copy
    of a shard-sized host array."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        _C.op_unary(_U_AFFINE, 0.0, float(value), [buf], [buf])
    else:
        _C.copy_from_host(buf, np.full(shape, value, dtype), [0] * len(shape))


def zeros_like(x, dtype=None) -> Array:
    return full_like(x, 0, dtype)


def copy_array(x: Array) -> Array:
    """A new Array with x's sharding and a copy of every block."""
    x._check_alive()
    blocks = []
    for dev, buf, start, rid in x._blocks:
        nb = _C.Buffer(dev.id, x._shard_shape, _dtypes.code(x.dtype))
        _C.copy_bytes(nb, buf)  # on the buffers' device (device-to-device on GPUs)
        blocks.append((dev, nb, start, rid))
    return Array._create(x.shape, x.dtype, x.sharding, blocks)


def rewrap(x: Array) -> Array:
    """A new Array owning x's buffers; x is marked donated."""
    return x._moved()


def _live_arrays(xs) -> list:
    """``[to_array(x) for x in xs]`` for a step's own leaves: Arrays not donated pass as
    they are (whether their buffers were deleted is checked by ``_C.optim_step``, which
    raises before any kernel runs), anything else goes through ``to_array``."""
    return [x if type(x) is Array and not x._donated else to_array(x) for x in xs]


def _own(x) -> Array:
    a = to_array(x)
    a._check_not_view()
    return a


def _own_arrays(xs, cow=None, claims=None) -> list:
    """``_live_arrays`` for the leaves an in-place step updates (params, state slots): a view
    of another Array's shard (a GPU ``Shard.data``) is refused here, before any kernel runs,
    as it cannot be donated. ``claims``: a list the Arrays are appended to (claimed before the
    kernel, see :func:`_claim`). ``cow``: a dict (per step) of the copies made of borrowed
    Arrays (see :func:`mark_borrowed`): the step updates and donates the copy, the caller's
    Array is left as it is; the same borrowed Array twice gets the same copy."""
    out = [x if type(x) is Array and not x._donated and x._base is None else _own(x)
           for x in xs]
    if claims is not None:
        claims.extend(out)
    # (the ids first, in one C-level pass: a state's own Arrays are never borrowed after its
    # first step, while the caller's still are, so the per-leaf lookup runs only then)
    if cow is not None and _BORROWED_IDS and not _BORROWED_IDS.isdisjoint(map(id, out)):
        out = [_cow_copy(a, cow) if _BORROWED.get(id(a)) is a else a for a in out]
    return out


# --- ownership of an in-place step's Arrays ----------------------------------------------------

# Arrays the caller still holds although a train state refers to them (the params given to
# TrainState.create), by id; an entry goes when its Array is garbage collected.
_BORROWED: "weakref.WeakValueDictionary[int, Array]" = weakref.WeakValueDictionary()
# their ids (a set: one C-level disjointness test per step); an id leaves with its Array
_BORROWED_IDS: set = set()


def mark_borrowed(tree) -> None:
    """Mark the Arrays of ``tree`` as still held by the caller: an in-place step
    (``TrainState.apply_gradients``) never writes their buffers nor donates them; it updates
    a copy of each, once (copy on write), so eager code that reuses the Arrays it passed to
    ``TrainState.create`` keeps working."""
    for x in tree_leaves(tree):
        if type(x) is Array and _BORROWED.get(id(x)) is not x:
            _BORROW_EPOCH[0] += 1
            _BORROWED[id(x)] = x
            _BORROWED_IDS.add(id(x))
            weakref.finalize(x, _BORROWED_IDS.discard, id(x))


def is_borrowed(x) -> bool:
    """Whether ``x`` is an Array marked by :func:`mark_borrowed` (an in-place step copies it)."""
    return type(x) is Array and _BORROWED.get(id(x)) is x


def _cow_copy(a: Array, cow: dict) -> Array:
    c = cow.get(id(a))
    if c is None:
        c = cow[id(a)] = copy_array(a)
        c._host_scalar = a._host_scalar
    return c


# The buffers in-place steps are updating now, by the id of an Array's block list (which the
# Arrays an in-place step returns share with the ones it donated): a second step of the same
# state (from another thread, while the first one's kernel runs without the GIL) is refused
# before its kernel, so an update is never applied twice.
_CLAIM_LOCK = threading.Lock()
_CLAIMED: set = set()


def _claim(arrays) -> list:
    """Claim the Arrays an in-place step updates and donates (params, then state, in the
    order the step takes them), atomically. A state's Arrays are stepped together, so its
    first Array the step owns (not borrowed, see :func:`mark_borrowed`) stands for all:
    when it is donated already, or claimed by a step running now, DonatedBufferError is
    raised and nothing is claimed. (When the step owns none of them, every one is claimed.)
    O(1) per step in the usual case. Returns the keys to give to :func:`_release` once the
    step is committed or failed."""
    if _BORROWED:
        token = next((a for a in arrays if _BORROWED.get(id(a)) is not a), None)
    else:
        token = arrays[0] if arrays else None
    group = [token] if token is not None else list(arrays)
    ids = [id(a._blocks) for a in group]
    with _CLAIM_LOCK:
        for a, i in zip(group, ids):
            if a._donated or i in _CLAIMED:
                raise DonatedBufferError(
                    "this train state is being stepped by another apply_gradients call (in "
                    "another thread) or was stepped already: its params and optimizer state "
                    "were donated to that step's result. Step each state once, from one "
                    "thread, and use the state it returns" if i in _CLAIMED else
                    "this train state's Arrays were donated: its params and optimizer state "
                    "now belong to the state a previous apply_gradients returned; use that one")
        _CLAIMED.update(ids)
    return ids


def _release(ids) -> None:
    with _CLAIM_LOCK:
        _CLAIMED.difference_update(ids)


def _reset_claims_in_child() -> None:
    """A forked child has only the forking thread: no step of another thread runs there,
    and a lock another thread held at the fork would never be released."""
    _CLAIM_LOCK._at_fork_reinit()   # the same object: persistent plans (FastPlan) hold it
    _CLAIMED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_claims_in_child)


def to_array(x, like=None) -> Array:
    """``x`` as an Array; numpy inputs take ``like``'s sharding when given."""
    if isinstance(x, Array):
        if like is not None and isinstance(like, Array) and x.sharding != like.sharding:
            return device_put(x, like.sharding)
        x._check_alive()
        return x
    if like is not None and isinstance(like, Array):
        return device_put(np.asarray(x), like.sharding)
    return device_put(np.asarray(x))


def read_scalar(x) -> Any:
    """The value of a 0-d state entry: from the host copy a counter Array keeps (no device
    read, so no GPU synchronisation), else read from the device."""
    if isinstance(x, Array) and x._host_scalar is not None and not x.is_deleted():
        return x._host_scalar.item()
    return np.asarray(x).item()


def _add(p, u):
    p = to_array(p)
    u = to_array(u, like=p)
    blocks = []
    for (dev, pb, start, rid), (_, ub, _, _) in zip(p._blocks, u._blocks):
        # on the shard's device (CPU or GPU): 16-bit operands are converted to float32, added
        # and the sum rounded once to p's dtype (optax's (p + u).astype(p.dtype))
        f32 = [b if np.dtype(a.dtype) == np.float32 else _widened_buffer(dev, a, b)
               for a, b in ((p, pb), (u, ub))]
        nb = _C.Buffer(dev.id, p._shard_shape, 0)
        _C.op_binary(_B_ADD, [nb], [f32[0]], [f32[1]])
        if np.dtype(p.dtype) != np.float32:
            rounded = _C.Buffer(dev.id, p._shard_shape, _dtypes.code(p.dtype))
            _C.op_convert([nb], [rounded])
            nb = rounded
        blocks.append((dev, nb, start, rid))
    return Array._create(p.shape, p.dtype, p.sharding, blocks)


def _widened_buffer(dev, a, buf):
    """A float32 copy of one block ``buf`` of ``a`` (converted on its device)."""
    w = _C.Buffer(dev.id, a._shard_shape, 0)
    _C.op_convert([buf], [w])
    return w


def apply_updates(params, updates):
    """``params + updates`` leaf by leaf, in the params' dtype and sharding
    (optax.apply_updates). ``None`` leaves of updates leave params unchanged.

    >>> import numpy as np, ctrainstate.optim as optim
    >>> np.asarray(optim.apply_updates({'w': np.ones(2, np.float32)},
    ...                                {'w': np.full(2, 0.5, np.float32)})['w']).tolist()
    [1.5, 1.5]
    """
    return tree_map(lambda p, u: p if u is None else _add(p, u), params, updates,
                    is_leaf=lambda x: x is None)


# --- the fused step -----------------------------------------------------------------------------


# A stage's ``at`` for scalars that do not change from step to step.
CONST = "const"


class Stage:
    """One stage of the fused kernel: a kind, its per-step scalars, its state arrays
    (``slots[q][leaf]``: Array or None where masked out) and the leaves it is active on.

    ``at`` says how the scalars of later steps follow (what lets an in-place step run from a
    persistent plan, :class:`FastPlan`, without calling the transform again): ``CONST`` (the
    same every step), or ``at(c)`` giving the scalars of the step whose counter reads ``c``
    before it (the value ``ctx.count`` returned; the transform's counter goes to
    ``safe_increment(c)``). None (the default): not known, every step runs the transform."""

    __slots__ = ("kind", "scalars", "slots", "active", "result", "geom", "at")

    def __init__(self, kind, scalars=(), slots=(), active=None, at=None):
        self.geom = None                 # FACTORED: per leaf (d0, d1) or None
        self.kind = kind
        self.scalars = tuple(float(s) for s in scalars)
        self.slots = list(slots)
        self.active = active
        self.result = None
        self.at = at


class FuseContext:
    """What a transform's ``fuse(state, ctx)`` sees: the params' leaves, the
    active-leaf mask of enclosing ``masked`` transforms, and helpers that read
    counters and prepare state arrays (copies in functional mode, the arrays
    themselves — donated afterwards — in place)."""

    def __init__(self, params_leaves, params_tree, inplace, tree=None, cow=None, claims=None,
                 pdef=None):
        self.leaves = params_leaves      # Arrays (or None when no params were given)
        self.pdef = pdef                 # the params' (or updates') treedef
        self.params = params_tree
        self.tree = tree if tree is not None else params_tree  # params, else the updates
        self.nleaves = len(params_leaves)
        self.inplace = inplace
        self.active = [True] * self.nleaves
        self._finish = []                # run after the kernel: donation of old arrays
        self._slot_defs = []             # (treedef, tree) of the per-param state trees taken
        self._cow = cow                  # in place: copies of borrowed Arrays (_own_arrays)
        self._claims = claims            # in place: the Arrays the step updates (_claim)
        # what a FastPlan needs to know of this step's state (in place): the counters read
        # (Array, value), the scalars written (new Array, value, dtype), the new Arrays of
        # the slots and of the state kept as it was
        self._counted = []
        self._scalars_new = []
        self._slot_news = []
        self._kept = []
        # (in place, run_fused took params_leaves through _own_arrays, and slot() takes the
        # state's arrays through it: views were refused before any kernel writes)

    # masks
    def push_mask(self, mask_flat):
        prev = self.active
        self.active = [a and bool(m) for a, m in zip(prev, mask_flat)]
        return prev

    def pop_mask(self, prev):
        self.active = prev

    # state arrays
    def slot(self, tree, same_shape=True):
        """Prepare a per-param state tree: returns (per-leaf list for the kernel, rebuild()).
        ``same_shape=False``: arrays of another shape (factored statistics; the core checks)."""
        leaves = None
        if self.pdef is not None and self.nleaves and all(self.active):
            leaves = _leaves_as(self.pdef, tree, Array)     # the params' structure: the usual
        if leaves is None:
            leaves, td = tree_flatten(tree)
        else:
            td = self.pdef
        if len(leaves) != sum(self.active):
            raise ValueError(
                f"optimizer state has {len(leaves)} arrays where the params have "
                f"{sum(self.active)} (unmasked) leaves: was it built by this tx.init?")
        if all(self.active):   # its structure is checked against the params' (check_slots)
            self._slot_defs.append((td, tree))
        if self.inplace:
            arrs = _own_arrays(leaves, self._cow, self._claims)
        else:
            arrs = [copy_array(to_array(x)) for x in leaves]
        if all(self.active):
            per_leaf = arrs
        else:
            it = iter(arrs)
            per_leaf = [next(it) if a else None for a in self.active]
        if same_shape:
            for i, (a, p) in enumerate(zip(per_leaf, self.leaves)):
                if (a is not None and p is not None and a._shape is not p._shape
                        and a._shape != p._shape):
                    raise ValueError(f"optimizer state array {i} has shape {a.shape}, its "
                                     f"param {p.shape}")
        if self.inplace:
            news = []
            self._slot_news.append(news)

            def finish():
                news[:] = Array._moved_all(arrs)
            self._finish.append(finish)
            return per_leaf, lambda: tree_unflatten(td, news)
        return per_leaf, lambda: tree_unflatten(td, arrs)

    def check_slots(self, pdef) -> None:
        """Every per-param state tree taken (without an enclosing mask) must have the params'
        structure, as optax's tree_map requires: a state built for params of other paths (the
        same number of arrays, even of the same shapes) was paired with them by position
        before, and stepped the wrong arrays silently. Raises before anything runs."""
        for td, tree in self._slot_defs:
            if td != pdef:
                want = [keystr(p) for p, _ in tree_flatten_with_path(self.tree)[0]]
                got = [keystr(p) for p, _ in tree_flatten_with_path(tree)[0]]
                diff = next(((g, w) for g, w in zip(got, want) if g != w), None)
                where = (f"state array {diff[0]} where the params have {diff[1]}" if diff
                         else f"the same paths in another container structure")
                raise ValueError(
                    f"optimizer state does not match the params' tree: {where}. Was it built "
                    f"by tx.init of these params? (optax raises a pytree structure error here)")

    def snapshot(self):
        """The active mask as a stage's ``active`` (None when every leaf is active)."""
        return None if all(self.active) else list(self.active)

    def count(self, x) -> int:
        """The value of a counter of the state (updated in place by :meth:`new_scalar`)."""
        if self._claims is not None and type(x) is Array:
            self._claims.append(x)
        c = int(read_scalar(x))
        self._counted.append(c)
        return c

    def new_scalar(self, old, value, dtype=np.int32):
        """The next value of a scalar state entry (in place when donating). A view of another
        Array's shard (a GPU ``Shard.data``) is not written: it cannot be donated, and this
        runs after the kernel, where raising would leave the step half done; the new value
        goes to a new Array instead, and the view and its parent are left as they were."""
        if (self.inplace and isinstance(old, Array) and old._base is None
                and not old.is_deleted() and not is_borrowed(old)):
            v = np.asarray(value, dtype=old.dtype)
            if v.dtype.itemsize == 4:   # a kernel on the device's stream: no GPU sync
                _C.fill_bits32([buf for _, buf, _, _ in old._blocks], int(v.view(np.uint32)))
            else:
                for _, buf, _, _ in old._blocks:
                    _fill(buf, (), old.dtype, value)
            new = rewrap(old)
            new._host_scalar = v[()]
        else:
            new = scalar(value, dtype, self.params,
                         sharding=old.sharding if isinstance(old, Array) else None)
        self._scalars_new.append((new, value, np.dtype(dtype)))
        return new

    def keep(self, tree):
        """State left as it is (rewrapped when donating; a view, which cannot be donated, is
        kept as it is: see new_scalar)."""
        if not self.inplace:
            return tree
        leaves, td = tree_flatten(tree)
        new = [rewrap(x) if isinstance(x, Array) and x._base is None and not is_borrowed(x)
               else x for x in leaves]
        self._kept.extend(n for n, o in zip(new, leaves) if n is not o)
        return tree_unflatten(td, new)


def _first_mismatch(paths_a, paths_b):
    try:   # a path one side lacks (a missing or an extra leaf) names it best
        sb, sa = set(paths_b), set(paths_a)
        missing = next((p for p in paths_a if p not in sb), None)
        if missing is not None:
            return missing
        extra = next((p for p in paths_b if p not in sa), None)
        if extra is not None:
            return extra
    except TypeError:   # an unhashable key
        pass
    for pa, pb in zip(paths_a, paths_b):
        if pa != pb:
            return pa
    return paths_a[min(len(paths_a), len(paths_b))] if len(paths_a) > len(paths_b) else (
        paths_b[len(paths_a)] if len(paths_b) > len(paths_a) else None)


def check_grads(grads, params_paths, params_def, params_leaves):
    """Flatten ``grads`` and check it against the params (structure, shapes, dtypes);
    returns Arrays with the params' shardings. Errors name the first mismatching path."""
    g_pl, g_def = tree_flatten_with_path(grads)
    g_paths = [p for p, _ in g_pl]
    if g_def != params_def:
        where = _first_mismatch(list(params_paths), g_paths)
        raise ValueError(
            f"grads do not have the structure of params: first difference at "
            f"{keystr(where) if where is not None else 'the root'} (params {params_def!r}, "
            f"grads {g_def!r})")
    out = []
    for path, (_, g), p in zip(params_paths, g_pl, params_leaves):
        gshape = tuple(np.shape(g))
        if gshape != tuple(p.shape):
            raise ValueError(f"grads{keystr(path)} has shape {gshape}, params{keystr(path)} has "
                             f"{tuple(p.shape)}")
        gdt = _dtypes.canonicalize(g.dtype if hasattr(g, "dtype") else np.asarray(g).dtype)
        if gdt != p.dtype and gdt not in _FLOATS:
            raise TypeError(f"grads{keystr(path)} has dtype {gdt}, params{keystr(path)} has "
                            f"{p.dtype}: grads must be float32, bfloat16 or float16")
        out.append(to_array(g, like=p))
    return out


def _fast_grads(grads, pdef, p_leaves, seen=None):
    """The grads' leaves when they are Arrays placed exactly like the params (the common
    training-loop case: no checks with paths, no resharding), else None. ``seen``: a Plan's
    (grads' shardings, params' shardings) of its last step, pairs found equal then."""
    g_leaves = _leaves_as(pdef, grads, Array)
    if g_leaves is None:
        return None
    seen_g, seen_p = seen if seen is not None and len(seen[0]) == len(g_leaves) else ((), ())
    for i, (g, p) in enumerate(zip(g_leaves, p_leaves)):
        if not (type(g) is Array and (g._shape is p._shape or g._shape == p._shape)
                and (g._dtype is p._dtype or g._dtype == p._dtype) and not g._donated):
            return None
        gs, ps = g._sharding, p._sharding
        if not (gs is ps or (seen_g and seen_g[i] is gs and seen_p[i] is ps) or gs == ps):
            return None
    return g_leaves


class Plan:
    """The kernel's block tuples of one in-place step, reused by the next step while the
    tree structure, the stages (kinds, masks, factored dims) and the params and state
    buffers are the same (identity of each Array's block list, which in-place steps hand on
    to the returned Arrays). Grads are not part of it: their buffers are passed per step.
    A plan lives on the TrainState that a step returns (``TrainState._ct_plan``), so it
    keeps no buffer alive longer than the state that owns them."""

    __slots__ = ("key", "ident", "groups", "order", "gshard", "fast", "gprocs")

    def __init__(self, key, ident, groups, order, gprocs=None):
        self.key, self.ident, self.groups, self.order = key, ident, groups, order
        self.gprocs = gprocs   # params spanning processes: the process of each group
        self.gshard = None   # the last step's (grads' shardings, params' shardings): equal
        self.fast = None     # a FastPlan of the state the last step returned, when it has one

    def matches(self, key, ident) -> bool:
        return (self.key == key and len(self.ident) == len(ident)
                and all(map(operator.is_, self.ident, ident)))


# --- the persistent step plan ------------------------------------------------------------------

# Bumped by mark_borrowed: a FastPlan built before the caller borrowed some of its Arrays is
# not used again (the general step copies borrowed Arrays instead of writing them).
_BORROW_EPOCH = [0]


class FastPlan:
    """An in-place step as one C call (``_C.OptimPlan``): what TrainState.apply_gradients
    (and t5x's Optimizer.apply_gradient) runs while the state is the one the last step
    returned. Built after a general step (:func:`run_fused` with ``want_plan``) when every
    stage says how its scalars follow (``Stage.at``) and the optimizer state holds only the
    kernel's state arrays, int32 step counters (all at one value, each advanced by one per
    step) and Arrays kept as they are. It holds the params' and the state's treedefs, the
    C plan and the counters' value; a step flattens the grads against the params' treedef
    (C++), computes the stages' scalars, and makes one C call that checks the grads' placement
    and the state's Arrays, runs the kernel and hands the Arrays on. ``step`` returns None
    (nothing done) whenever the general path must decide: grads of another structure,
    placement or dtype, a state not stepped by this plan, Arrays borrowed since."""

    __slots__ = ("cplan", "pdef", "sdef", "nparams", "scalars", "count", "epoch", "dicts")

    def __init__(self, cplan, pdef, sdef, nparams, scalars, count):
        self.cplan, self.pdef, self.sdef, self.nparams = cplan, pdef, sdef, nparams
        self.scalars = scalars   # per stage: (constant scalars, None) or (None, at)
        self.count = count       # the counters' value before the next step (None: none)
        self.epoch = _BORROW_EPOCH[0]
        # params of plain dicts (Flax's): the C plan flattens the grads and builds the
        # params' dicts itself
        try:
            prog = _dict_program(pdef)
        except _NotDicts:
            prog = None
        self.dicts = prog is not None
        if self.dicts:
            # the state tree built in C too where its nodes allow (_state_template)
            cplan.set_structure(prog, *(_state_template(sdef) or (None, None)))

    def step(self, arrays, grads, params=None):
        """``(arrays, params, opt_state)`` after one step of the state holding ``arrays``
        (the list the last step returned), or None (nothing changed). ``params``: the params
        tree when the caller keeps it apart from the state (t5x); it must hold the state's
        own param Arrays."""
        if self.epoch != _BORROW_EPOCH[0]:
            return None
        if self.dicts:
            c = self.count
            if c is None:
                r = self.cplan.step_tree(arrays, grads, [s for s, _ in self.scalars], 0, params)
            elif c < _INT32_MAX - 1:
                scalars = []   # (a loop, not a comprehension: no frame of its own)
                for s, f in self.scalars:
                    scalars.append(s if f is None else f(c))
                r = self.cplan.step_tree(arrays, grads, scalars, np.int32(c + 1), params)
            else:
                return None
            if r is None:
                return None
            if c is not None:
                self.count = c + 1
            if len(r) == 3:
                return r
            return r[0], r[1], self.sdef.unflatten(r[0][self.nparams:])
        try:
            g = self.pdef.flatten_up_to(grads)
            p = None if params is None else self.pdef.flatten_up_to(params)
        except (ValueError, TypeError):
            return None
        c = self.count
        if c is None:
            new = self.cplan.step(arrays, g, [s for s, _ in self.scalars], 0, p)
        elif c < _INT32_MAX - 1:
            new = self.cplan.step(arrays, g, [s if f is None else f(c) for s, f in self.scalars],
                                  np.int32(c + 1), p)
        else:   # a saturating counter: the general path
            return None
        if new is None:
            return None
        if c is not None:
            self.count = c + 1
        n = self.nparams
        return new, self.pdef.unflatten(new[:n]), self.sdef.unflatten(new[n:])


    def step_list(self, values):
        """The new state Arrays after one step of the state whose Arrays lead ``values``
        (followed by the grads' leaves in the params' order): the step of a jitted program's
        :class:`JitStep` node, or None (nothing changed) when the general path must decide."""
        if self.epoch != _BORROW_EPOCH[0]:
            return None
        c = self.count
        if c is None:
            return self.cplan.step_list(values, [s for s, _ in self.scalars], 0)
        if c >= _INT32_MAX - 1:   # a saturating counter: the general path
            return None
        new = self.cplan.step_list(values, [s if f is None else f(c) for s, f in self.scalars],
                                   np.int32(c + 1))
        if new is not None:
            self.count = c + 1
        return new


class JitStep:
    """An in-place optimizer step as one node of a jitted program (``_C.trace_node``):
    ``TrainState.apply_gradients`` (and t5x's ``apply_gradient``) inside ``ctrainstate.jit``.
    Called with the state's Arrays (the params' leaves, then the optimizer state's), the
    grads' leaves and, with ``has_step``, the train state's step (a 0-d int32 Array), it steps
    the state in place and returns the new state's Arrays in the same order, then the new
    step (step + 1, a new Array). The step's scalars (bias corrections, a schedule's value)
    follow the optimizer's own counter on every call: nothing of the traced step is a
    constant of the program. The first call (at the trace) and any call the persistent plan
    declines run the general path (:func:`run_fused`), which validates and raises as eager
    ``apply_gradients`` does."""

    __slots__ = ("tx", "pdef", "sdef", "nparams", "nstate", "plan", "has_step", "step_fn",
                 "_step")

    def __init__(self, tx, pdef, sdef, nparams: int, nstate: int, plan=None,
                 has_step: bool = False, step_fn=None):
        self.tx, self.pdef, self.sdef = tx, pdef, sdef
        self.nparams, self.nstate, self.plan = nparams, nstate, plan
        self.has_step = has_step
        self.step_fn = step_fn   # the new step from the old (None: a 0-d int32 Array, + 1)
        self._step = (None, 0)   # the last step Array this node returned, and its value

    def __call__(self, values: list) -> list:
        if self.has_step:
            step = values[-1]
            values = values[:-1]
        plan = self.plan
        new = None
        if plan is not None and plan.fast is not None:
            new = plan.fast.step_list(values)
        if new is None:
            n, m = self.nparams, self.nstate
            p = self.pdef.unflatten(values[:n])
            s = self.sdef.unflatten(values[n:n + m])
            g = self.pdef.unflatten(values[n + m:])
            new_p, new_s, self.plan = run_fused(self.tx, g, s, p, inplace=True, want_plan=True,
                                                plan=plan)
            new = list(self.pdef.flatten_up_to(new_p)) + list(self.sdef.flatten_up_to(new_s))
        if self.has_step and self.step_fn is not None:
            return new + [self.step_fn(step)]
        if self.has_step:   # step + 1, the host value kept while the state is this node's
            last, v = self._step
            v = (v if step is last else int(step)) + 1
            nxt = _C.int_like(step, v)
            self._step = (nxt, v)
            return new + [nxt]   # (a new list: the plan keeps `new` as its current Arrays)
        return new


def traced_step(tx, params, opt_state, grads, step, plan=None, step_fn=None):
    """An in-place optimizer step inside a jit trace as one node of the program
    (:class:`JitStep` through ``_C.trace_node``): ``(new params, new optimizer state, new
    step)``, or None where it cannot be one (grads of another structure, leaves that are not
    Arrays: the caller's eager step then runs, and raises where it must). ``step`` is the
    train state's step: an Array is advanced inside the node (by ``step_fn``, or + 1 for a
    0-d int32 Array on one device), anything else is returned + 1 as it is."""
    p_leaves, pdef = tree_flatten(params)
    s_leaves, sdef = tree_flatten(opt_state)
    try:
        g_leaves = pdef.flatten_up_to(grads)
    except (ValueError, TypeError):
        return None
    values = p_leaves + s_leaves + list(g_leaves)
    if any(type(x) is not Array for x in values):
        return None
    has_step = type(step) is Array and (step_fn is not None or (
        step.shape == () and step.dtype == np.int32 and len(step._blocks) == 1))
    if has_step:
        values.append(step)
    node = JitStep(tx, pdef, sdef, len(p_leaves), len(s_leaves), plan, has_step, step_fn)
    out = _C.trace_node("optimizer_step", node, values)
    n, m = len(p_leaves), len(s_leaves)
    new_step = out[n + m] if has_step else (step_fn(step) if step_fn is not None else step + 1)
    return pdef.unflatten(out[:n]), sdef.unflatten(out[n:n + m]), new_step


def _dict_program(td):
    """The structure of a tree of plain dicts as nested ``((key, program), ...)`` tuples in
    the treedef's key order (None for a leaf), or None when another node type is in it."""
    if optree.treespec_is_leaf(td):
        return None
    if td.type is not dict:
        raise _NotDicts
    return tuple((k, _dict_program(c)) for k, c in zip(td.entries(), td.children()))


class _NotDicts(Exception):
    pass


_TEMPLATE_KINDS = frozenset({optree.PyTreeKind.LEAF, optree.PyTreeKind.NONE,
                             optree.PyTreeKind.TUPLE, optree.PyTreeKind.DICT,
                             optree.PyTreeKind.NAMEDTUPLE})


def _plain_namedtuple(cls) -> bool:
    """Whether ``cls(*items)`` is ``tuple.__new__(cls, items)``: a namedtuple class (or a
    subclass) whose ``__new__`` is the one ``collections.namedtuple`` generates and which has
    no ``__init__`` of its own."""
    new = getattr(cls, "__new__", None)
    g = getattr(new, "__globals__", None)
    return (isinstance(cls, type) and issubclass(cls, tuple) and cls.__init__ is object.__init__
            and isinstance(g, dict) and g.get("_tuple_new") is tuple.__new__
            and str(g.get("__name__", "")).startswith("namedtuple_"))


def _state_template(sdef):
    """``(template, types)`` for ``OptimPlan.set_structure``: the optimizer state's tree with
    each leaf replaced by its index (what ``sdef.unflatten`` makes of ``range(n)``) and the
    namedtuple classes in it, so that the C step builds the state tree as ``sdef.unflatten``
    would, without calling Python code. None where a node is not a dict, tuple, None or plain
    namedtuple (a registered node's unflatten is Python code: optree runs it)."""
    types = set()
    todo = [sdef]
    while todo:
        td = todo.pop()
        if td.kind not in _TEMPLATE_KINDS:
            return None
        if td.kind == optree.PyTreeKind.NAMEDTUPLE:
            if not _plain_namedtuple(td.type):
                return None
            types.add(td.type)
        if td.kind != optree.PyTreeKind.LEAF:
            todo.extend(td.children())
    return sdef.unflatten(list(range(sdef.num_leaves))), frozenset(types)


def _build_fast_plan(stages, ctx, plan, pdef, new_p, new_state, g_leaves):
    """A :class:`FastPlan` for the state an in-place step just made, or None when this
    optimizer cannot run from one (a stage without ``at``, a state entry written with
    another value than its counter's next one, leaves that are not Arrays...)."""
    if any(s.at is None for s in stages) or any(s.result is None for s in stages):
        return None
    if plan.gprocs is not None:   # the persistent C plan runs one process's step
        return None
    values = set(ctx._counted)
    if len(values) > 1:
        return None
    c0 = values.pop() if values else None
    scalars = []
    for s in stages:
        if s.at is CONST:
            scalars.append((s.scalars, None))
            continue
        if c0 is None:
            return None
        try:   # the annotation is checked against this step's own scalars
            again = tuple(float(v) for v in s.at(c0))
        except Exception:   # noqa: BLE001 - an annotation that does not work: no plan
            return None
        if again != s.scalars:
            return None
        scalars.append((None, s.at))
    roles = {id(a): a for news in ctx._slot_news for a in news}
    roles.update((id(a), a) for a in ctx._kept)
    counters = {}
    for new, value, dt in ctx._scalars_new:
        if (c0 is None or dt != np.int32 or type(new) is not Array or new._shape != ()
                or int(value) != c0 + 1):
            return None
        counters[id(new)] = new
    s_leaves, sdef = tree_flatten(new_state)
    nparams = len(new_p)
    idx, seen = [], set()
    for j, x in enumerate(s_leaves):
        if type(x) is not Array or id(x) in seen:
            return None
        seen.add(id(x))
        if counters.get(id(x)) is x:
            idx.append(nparams + j)
        elif roles.get(id(x)) is not x:
            return None
    if len(idx) != len(counters) or any(is_borrowed(a) for a in new_p):
        return None
    try:
        cplan = _C.OptimPlan([(s.kind, s.scalars) for s in stages], plan.groups, plan.order,
                             nparams, list(g_leaves), list(new_p) + s_leaves, nparams, idx,
                             _CLAIM_LOCK, _CLAIMED)
    except (TypeError, ValueError):
        return None
    return FastPlan(cplan, pdef, sdef, nparams, scalars, None if c0 is None else c0 + 1)


def _check_no_shared_buffers(p_leaves, stages, paths):
    """An in-place step writes every param and state buffer once. Two leaves holding one
    buffer (the same Array twice in the params or the state, or a param that is also
    state) would be updated twice, and one of the two results lost: refuse before any
    kernel runs."""
    seen = {}
    names = []   # (None for a param / a state slot number, leaf): formatted for the error

    def visit(a, what):
        for _, buf, _, _ in a._blocks:
            prev = seen.setdefault(id(buf), what)
            if prev != what:
                raise ValueError(
                    f"{_where(prev)} and {_where(what)} share a buffer (the same Array in two "
                    f"places of the train state?): an in-place step would update it twice. "
                    f"Give each leaf its own Array (a copy: cts.device_put(np.asarray(x), "
                    f"x.sharding)), or tie the weights in the model instead of the params tree")

    def _where(what):
        kind, i = names[what]
        return f"params{keystr(paths()[i])}" if kind is None else (
            f"an optimizer-state array of params{keystr(paths()[i])}")

    for i, p in enumerate(p_leaves):
        names.append((None, i))
        visit(p, len(names) - 1)
    n = 0
    for s in stages:
        for q in s.slots:
            for i, a in enumerate(q):
                if a is not None:
                    names.append((n, i))
                    visit(a, len(names) - 1)
            n += 1


def _across_processes(stages, p_leaves, paths) -> bool:
    """Whether the step's reductions (norms, finite gate, trust ratios, factored statistics)
    combine blocks of several processes: then the kernel gets every process's groups
    (:func:`_build_groups`) and exchanges its partial results (on CPU and on GPU devices:
    each device's partial sums come to the host and travel through the MPI engine). Every
    leaf must then live on devices of the whole job (a value of this process's devices
    alone is not the same value on every process)."""
    if not any(s.kind in _ACROSS_BLOCKS for s in stages) or all(
            p.is_fully_addressable for p in p_leaves):
        return False
    nproc = _process["count"]
    for i, p in enumerate(p_leaves):
        procs = {d.process_index for d in p._sharding._mesh_devices}
        if len(procs) != nproc:
            raise ValueError(
                f"params{keystr(paths()[i])} lives on the devices of process(es) "
                f"{sorted(procs)} while other params span processes: the optimizer's norms, "
                f"finite gate or factored statistics combine every param over the whole job. "
                f"Put it on the global mesh (cts.device_put(x, NamedSharding(mesh, P())))")
    return True


def _build_groups(stages, p_leaves, g_leaves, paths, outs, inplace, have_params):
    """Per device: the block tuples of the kernel, and (leaf, block) of each; third, None, or,
    where the reductions combine blocks of several processes (:func:`_across_processes`),
    the process of each group. Then the groups are those of the one-process step on the same
    global devices, in its order (each leaf's global layout), another process's blocks as
    ``(n, active, leaf, counts, geom)`` (what the kernel must know of them)."""
    across = _across_processes(stages, p_leaves, paths)
    nslots = [NSLOTS[s.kind] for s in stages]
    gproc: dict[int, int] = {}
    groups: dict[int, list] = {}
    order: dict[int, list] = {}
    for i, p in enumerate(p_leaves):
        bits = 0
        slots_i, drops_i = [], []
        dims = None
        for k, s in enumerate(stages):
            on = s.active is None or s.active[i]
            if on:
                bits |= 1 << k
                if s.geom is not None and s.geom[i] is not None:
                    if dims is not None and dims != s.geom[i]:
                        raise NotImplementedError(
                            f"params{keystr(paths()[i])}: two factored stages factor different "
                            f"dims")
                    dims = s.geom[i]
            for q in range(nslots[k]):
                slots_i.append(s.slots[q][i] if on else None)
                # a factored statistic (v_row q=0, v_col q=1) is the param less dim d0 / d1
                g = s.geom[i] if (on and s.geom is not None and q < 2) else None
                drops_i.append(None if g is None else g[q])
        if across:
            blocks = _global_blocks(p, paths, i)
        else:
            blocks = enumerate(p._blocks)
        for b, blk in blocks:
            if b is None:   # another process's block
                dev, start, rid = blk
                geom = None if dims is None else (dims[0], dims[1], tuple(p.shape), tuple(start),
                                                  tuple(p._shard_shape))
                groups.setdefault(dev.id, []).append(
                    (int(np.prod(p._shard_shape, dtype=np.int64)), bits, i, rid == 0, geom))
                order.setdefault(dev.id, [])
                gproc[dev.id] = dev.process_index
                continue
            dev, pbuf, start, rid = blk
            sb = []
            for a, drop in zip(slots_i, drops_i):
                if a is None:
                    sb.append(None)
                else:
                    # the kernel pairs the param's and the state's blocks one by one: as
                    # many blocks, on the same devices, holding the same elements (of the
                    # param, or of its factored slice)
                    want = (start if drop is None else
                            tuple(start[:drop]) + tuple(start[drop + 1:]))
                    blk = a._blocks[b] if len(a._blocks) == len(p._blocks) else None
                    if blk is None or blk[0] is not dev or (tuple(blk[2]) != tuple(want) and (
                            drop is not None or a._shape == p._shape)):
                        raise ValueError(
                            f"optimizer state of params{keystr(paths()[i])} is not sharded like "
                            f"the param (state {a.sharding}, param {p.sharding}); were the "
                            f"params resharded after the state was made? Put the state on the "
                            f"new layout: tree_util.tree_map(lambda fresh, old: "
                            f"device_put(old, fresh.sharding), tx.init(params), opt_state)")
                    sb.append(blk[1])
            geom = None if dims is None else (dims[0], dims[1], tuple(p.shape), tuple(start),
                                              tuple(p._shard_shape))
            gbuf = None if g_leaves is None else g_leaves[i]._blocks[b][1]
            groups.setdefault(dev.id, []).append(
                (pbuf if (inplace or have_params) else None, gbuf,
                 None if inplace else outs[i]._blocks[b][1], sb, bits, i, rid == 0, geom))
            order.setdefault(dev.id, []).append((i, b))
            gproc[dev.id] = dev.process_index
    return (list(groups.values()), list(order.values()),
            [gproc[d] for d in groups] if across else None)


def _global_blocks(p, paths, i):
    """``(b, (dev, buf, start, rid))`` for each of this process's blocks of ``p`` (its index
    in ``p._blocks``) and ``(None, (dev, start, rid))`` for another process's, in the order
    of the global layout (mesh order: the order of ``_blocks`` in one process)."""
    _, layout, _ = p._sharding._layout(p._shape)
    mine = p._blocks
    out, b = [], 0
    for dev, start, rid in layout:
        if dev._is_local():
            if b >= len(mine) or mine[b][0] is not dev:
                raise ValueError(f"params{keystr(paths()[i])}: its blocks are not in its "
                                 f"sharding's device order")
            out.append((b, mine[b]))
            b += 1
        else:
            out.append((None, (dev, start, rid)))
    if b != len(mine):
        raise ValueError(f"params{keystr(paths()[i])}: its blocks are not its sharding's")
    return out


def _procs(gprocs):
    """optim_step's ``procs`` of a step whose groups are on processes ``gprocs`` (None: a
    step of this process's devices)."""
    if gprocs is None:
        return None
    dist = _upper("distributed")
    return (_process["index"], _process["count"], gprocs, dist.default_timeout())


_FLOATS = (_dtypes.float32, _dtypes.bfloat16, _dtypes.float16)


def run_fused(tx, updates, state, params, *, inplace, plan=None, want_plan=False,
              before_kernel=None):
    """Run the fused kernel for ``tx``. Returns (new_params or updates, new_state), and the
    step's :class:`Plan` third when ``want_plan`` (in place only; pass it as ``plan`` to the
    next step to skip rebuilding the kernel's block list).

    In place, everything is checked and the step's Arrays are claimed (:func:`_claim`)
    before the kernel runs; ``before_kernel()`` is called just before that (it may raise:
    nothing has been written then). Borrowed params (:func:`mark_borrowed`) are updated in
    copies."""
    ref = params if params is not None else updates
    leaves = None
    if plan is not None:          # the last step's structure (a Plan's key holds its treedef)
        pdef = plan.key[0]
        leaves = _leaves_as(pdef, ref, Array)
    if leaves is None:
        leaves, pdef = tree_flatten(ref)
    cow = {} if inplace and _BORROWED else None
    claims = [] if inplace else None
    p_leaves = _own_arrays(leaves, cow, claims) if inplace else _live_arrays(leaves)
    _paths = []

    def paths():
        if not _paths:
            _paths.extend(p for p, _ in tree_flatten_with_path(ref)[0])
        return _paths
    f32 = _dtypes.float32
    for i, p in enumerate(p_leaves):
        if p._dtype is not f32 and p._dtype not in _FLOATS:
            raise TypeError(f"params{keystr(paths()[i])} is {p.dtype}: optimizers update float "
                            f"params (float32, bfloat16 or float16)")
    g_leaves = _fast_grads(updates, pdef, p_leaves, plan.gshard if plan is not None else None)
    if g_leaves is None:
        g_leaves = check_grads(updates, paths(), pdef, p_leaves)
    ctx = FuseContext(p_leaves, params if params is not None else None, inplace, ref, cow, claims,
                      pdef)
    stages, rebuild = tx._fuse(state, ctx)
    have_params = params is not None
    reuse = False
    key = ident = out_dt = None
    if inplace:
        key = (pdef, have_params, tuple(
            (s.kind, None if s.active is None else tuple(s.active),
             None if s.geom is None else tuple(s.geom)) for s in stages))
        ident = [p._blocks for p in p_leaves]
        for s in stages:
            for q in s.slots:
                ident.extend([a._blocks for a in q if a is not None])
        reuse = plan is not None and plan.matches(key, ident)
    if not reuse:   # (a reused plan was checked when it was built)
        ctx.check_slots(pdef)
    if inplace and not reuse:
        _check_no_shared_buffers(p_leaves, stages, paths)
    if not inplace:
        # updates (functional mode): the params' dtype when the grads have it, else float32
        # (optax promotes 16-bit with float32 to float32; bfloat16 with float16 too)
        out_dt = [p.dtype if p.dtype == g.dtype else _dtypes.float32
                  for p, g in zip(p_leaves, g_leaves)]
    if not have_params and any(s.kind in _NEEDS_PARAMS for s in stages):
        raise ValueError(
            "this optimizer reads the current params (weight decay: adamw, "
            "add_decayed_weights; trust ratios: lamb, lars, fromage; adafactor's param scale) "
            "but tx.update(updates, state) got none: call tx.update(updates, state, params)")
    stage_args = [(s.kind, s.scalars) for s in stages]
    if before_kernel is not None:
        before_kernel()
    claimed = _claim(claims) if inplace else None
    try:
        return _kernel_and_commit(stages, stage_args, ctx, rebuild, p_leaves, g_leaves,
                                  pdef, paths, have_params, plan, reuse, key, ident, want_plan,
                                  out_dt)
    finally:
        if claimed is not None:
            _release(claimed)


def _kernel_and_commit(stages, stage_args, ctx, rebuild, p_leaves, g_leaves, pdef, paths,
                       have_params, plan, reuse, key, ident, want_plan, out_dt):
    """The second half of :func:`run_fused`, after every check: the kernel, then the new
    params and state (in place: the old Arrays donated to them)."""
    inplace = ctx.inplace
    nleaves = len(p_leaves)
    if inplace:
        if not reuse:
            groups, order, gprocs = _build_groups(stages, p_leaves, None, paths, None, True,
                                                  have_params)
            plan = Plan(key, ident, groups, order, gprocs)
        grads = [[g_leaves[i]._blocks[b][1] for i, b in o] for o in plan.order]
        results = _C.optim_step(stage_args, plan.groups, nleaves, grads, _procs(plan.gprocs))
        plan.gshard = ([g._sharding for g in g_leaves], [p._sharding for p in p_leaves])
    else:
        plan = None
        outs = [Array._create(p.shape, np.dtype(dt), p.sharding,
                              [(d, _C.Buffer(d.id, p._shard_shape, _dtypes.code(dt)), st, r)
                               for d, _, st, r in p._blocks])
                for p, dt in zip(p_leaves, out_dt)]
        groups, _, gprocs = _build_groups(stages, p_leaves, g_leaves, paths, outs, False,
                                          have_params)
        results = _C.optim_step(stage_args, groups, nleaves, None, _procs(gprocs))
    for s, r in zip(stages, results):
        s.result = r
    for f in ctx._finish:
        f()
    new_state = rebuild()
    if inplace:
        new_p = Array._moved_all(p_leaves)
        out = tree_unflatten(pdef, new_p), new_state
        if want_plan and plan is not None and have_params:
            plan.fast = _build_fast_plan(stages, ctx, plan, pdef, new_p, new_state, g_leaves)
    else:
        out = tree_unflatten(pdef, outs), new_state
    return out + (plan,) if want_plan else out


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
