"""The implementation of :mod:`ctrainstate.nn.lifted` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
import weakref
from typing import Any, Callable, Mapping

import numpy as np

from ..array import abstract as _abstract
from ... import random as _random
from ..array.array import Array
from ..base.tree_util import tree_flatten, tree_leaves, tree_map, tree_unflatten
from . import meta
from . import module as _module
from .module import Module, ModuleScope
from .scope import in_filter
from ..ops import ops as _ops, slicing as _slicing
from ..ops.slicing import getitem
from . import spmd
from ..array.sharding import get_mesh, PartitionSpec

__all__ = ["scan", "vmap", "broadcast", "In", "Out"]


# --- markers -----------------------------------------------------------------------------------

class _Broadcast:
    """``nn.broadcast``: an ``in_axes`` / ``out_axes`` entry of :func:`scan` meaning "give
    every step the whole value" (flax.core.broadcast)."""

    def __repr__(self):
        return "broadcast"


broadcast = _Broadcast()


@dataclasses.dataclass(frozen=True)
class In:
    """A ``variable_axes`` value lifting a collection as input only (flax.core.lift.In;
    ``partitioning.ScanIn``): it is sliced on the way in, but not mutable inside.

    >>> from ctrainstate.nn.lifted import In
    >>> In(0)
    In(axis=0)
    """
    axis: Any


@dataclasses.dataclass(frozen=True)
class Out:
    """A ``variable_axes`` value lifting a collection as output only (flax.core.lift.Out;
    ``partitioning.ScanOut``): invisible on the way in, stacked on the way out."""
    axis: Any


def _split_in_out_axes(xs: Mapping) -> tuple[dict, dict]:
    unpack = lambda v: v.axis if isinstance(v, (In, Out)) else v  # noqa: E731
    ins = {k: unpack(v) for k, v in xs.items() if not isinstance(v, Out)}
    outs = {k: unpack(v) for k, v in xs.items() if not isinstance(v, In)}
    return ins, outs


# --- collection filters (flax.core.scope: group_collections, union / intersect) -----------------

class _Union:
    """A filter matching what any of ``filters`` matches."""
    __slots__ = ("filters",)

    def __init__(self, *filters):
        self.filters = filters

    def __contains__(self, col):
        return any(in_filter(f, col) for f in self.filters)


class _Intersection:
    """A filter matching what all of ``filters`` match."""
    __slots__ = ("filters",)

    def __init__(self, *filters):
        self.filters = filters

    def __contains__(self, col):
        return all(in_filter(f, col) for f in self.filters)


def _group(names, filters) -> list:
    """Each name goes to the first filter that matches it (flax's group_collections)."""
    groups, rest = [], list(names)
    for f in filters:
        groups.append([n for n in rest if in_filter(f, n)])
        rest = [n for n in rest if not in_filter(f, n)]
    return groups


# --- scopes whose RNG counters live in a shared store --------------------------------------------

class _LiftedScope(ModuleScope):
    """The scope one step of a lifted transform runs in: variables of that step, the step's
    RNG keys, and RNG counters taken from ``store`` (relative path -> counters dict), shared
    with the lifted module's own scope so they keep counting across steps and traces, as
    Flax's do."""

    def __init__(self, variables, root_rngs, mutable, path, store: dict, rel: tuple = ()):
        super().__init__(variables, root_rngs, mutable, path)
        self._store = store
        self._rel = rel
        self.rng_counters = store.setdefault(rel, {k: 0 for k in self.root_rngs})

    def push(self, name: str) -> "_LiftedScope":
        if name not in self._children:
            child = _LiftedScope(self._variables, self.root_rngs, self.mutable,
                                 self.path + (name,), self._store, self._rel + (name,))
            child.initializing = self.initializing
            child.adopted = self.adopted
            self._children[name] = child
        return self._children[name]


def _seed_store(scope) -> dict:
    """relative path -> the counters dict (by reference) of ``scope`` and its descendants."""
    store: dict = {}

    def walk(s, rel):
        store[rel] = s.rng_counters
        for name, child in list(s._children.items()):
            walk(child, rel + (name,))
    walk(scope, ())
    return store


def _snapshot(store: dict) -> dict:
    return {rel: dict(d) for rel, d in store.items()}


def _restore(store: dict, snap: dict):
    """Counters back to ``snap`` in place (the dicts stay shared); paths created since are
    dropped, so they start from zero again."""
    for rel in list(store):
        if rel in snap:
            d = store[rel]
            d.clear()
            d.update(snap[rel])
        else:
            del store[rel]


def _write_back(scope, store: dict):
    """Make the counters of paths first used inside the transform those of ``scope``'s own
    child scopes, so a later call (or a later trace) continues from them."""
    for rel, d in store.items():
        s = scope
        for name in rel:
            s = s.push(name)
        if s.rng_counters is not d:
            s.rng_counters = d
            if isinstance(s, _LiftedScope):
                s._store[s._rel] = d


# --- the tape -------------------------------------------------------------------------------------

def _no_tape():
    """Run without recording on the active tape (``ctrainstate._src.ops.ops._no_tape``: a throw-away
    pass, a vjp's own ops)."""
    return _ops._no_tape()


def _tracked(x) -> bool:
    t = _ops._tape()
    return t is not None and isinstance(x, Array) and id(x) in t.tracked


def _index(axis: int, i: int) -> tuple:
    return (slice(None),) * axis + (i,)


def _unstack_tracked(x: Array, axis: int) -> list:
    """The slices of ``x`` along ``axis`` as one tape node: its vjp stacks the slices'
    cotangents (zeros where a slice got none) into one array in ``x``'s layout."""
    with _no_tape():
        parts = [_slicing.getitem(x, _index(axis, i)) for i in range(x.shape[axis])]
    place, norm = _slicing._layout_of(x)

    def vjp(gs, prev):
        with _no_tape():
            full = _slicing.stack([g if g is not None else _ops.zeros_like(p)
                                   for g, p in zip(gs, parts)], axis)
            full = _slicing._to(full, place, norm)
            if prev[0] is not None:
                full = _ops._binary_raw(_ops.B_ADD, prev[0], full)
        return [full]

    tape = _ops._tape()
    for p in parts:
        tape.track(p)
    tape.nodes.append(_ops._Group(parts, [x], vjp))
    return parts


class _Slicer:
    """Step ``i``'s slice of one scanned (mapped) leaf: an Array on the tape is cut into
    all its slices at once (one tape node), anything else is sliced when asked."""
    __slots__ = ("x", "axis", "parts")

    def __init__(self, x, axis: int, n: int, who: str):
        shape = np.shape(x) if not hasattr(x, "shape") else tuple(x.shape)
        if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
            raise TypeError(f"{who}: axis {axis!r} is not an int")
        if not -len(shape) <= axis < len(shape):
            raise ValueError(f"{who}: a value of shape {shape} has no axis {axis} to slice")
        axis = int(axis) % len(shape)
        if shape[axis] != n:
            raise ValueError(f"{who}: a value of shape {shape} has size {shape[axis]} along "
                             f"axis {axis}, but the transform's length is {n}")
        self.x, self.axis = x, axis
        self.parts = _unstack_tracked(x, axis) if _tracked(x) else None

    def __getitem__(self, i: int):
        if self.parts is not None:
            return self.parts[i]
        x = self.x
        if isinstance(x, (Array, _abstract.ShapeDtypeStruct)):
            return getitem(x, _index(self.axis, i))
        return np.take(np.asarray(x), i, axis=self.axis)

    def abstract(self):
        shape = list(np.shape(self.x) if not hasattr(self.x, "shape") else self.x.shape)
        del shape[self.axis]
        dt = self.x.dtype if hasattr(self.x, "dtype") else np.asarray(self.x).dtype
        return _abstract.ShapeDtypeStruct(tuple(shape), dt)


def _is_slicer(x) -> bool:
    return isinstance(x, _Slicer)


def _pick(tree, i: int):
    return tree_map(lambda s: s[i] if isinstance(s, _Slicer) else s, tree, is_leaf=_is_slicer)


def _slicers(tree, axis, n, who):
    return tree_map(lambda x: _Slicer(x, axis, n, who), tree)


def _stack_leaves(xs, axis):
    if any(isinstance(x, (Array, _abstract.ShapeDtypeStruct)) for x in xs):
        return _slicing.stack(list(xs), axis)
    return np.stack([np.asarray(x) for x in xs], axis)


def _stack_trees(trees: list, axis: int, who: str):
    """Leaf-wise stack of ``trees`` (all with one structure) along ``axis``."""
    leaves0, td = tree_flatten(trees[0])
    rest = []
    for k, t in enumerate(trees[1:], 1):
        leaves, td_k = tree_flatten(t)
        if td_k != td:
            raise ValueError(f"{who}: step {k} returned a different structure than step 0:\n"
                             f"  {td_k}\nvs\n  {td}")
        rest.append(leaves)
    cols = list(zip(leaves0, *rest))
    out = []
    for col in cols:
        shapes = {tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape) for x in col}
        if len(shapes) > 1:
            raise ValueError(f"{who}: the steps returned values of different shapes "
                             f"{sorted(shapes)}; they must have one shape to be stacked")
        nd = len(next(iter(shapes))) + 1
        if not -nd <= axis < nd:
            raise ValueError(f"{who}: axis {axis} is out of range for stacking values of rank "
                             f"{nd - 1}")
        out.append(_stack_leaves(col, axis))
    return tree_unflatten(td, out)


# --- boxes: born sharded with the new axis --------------------------------------------------------

def _reshard_boxes(tree):
    """Each box's value resharded to the box's spec (a ``LogicallyPartitioned`` through the
    rules, a ``Partitioned`` when its names are axes of the mesh) when a mesh is in reach."""

    def fix(box):
        v = box.value
        if not isinstance(v, Array):
            return box
        if isinstance(box, spmd.LogicallyPartitioned):
            if box.mesh is None and get_mesh() is None:
                return box
            nv = spmd.with_logical_constraint(v, box.get_partition_spec(), rules=box.rules,
                                              mesh=box.mesh)
        elif isinstance(box, meta.Partitioned):
            mesh = box.mesh if box.mesh is not None else get_mesh()
            if mesh is None:
                return box
            axes = set(mesh.axis_names)
            names = [n for e in box.names for n in ((e,) if not isinstance(e, tuple) else e)]
            if len(box.names) > v.ndim or any(n is not None and n not in axes for n in names):
                return box
            nv = spmd._constrain_array(v, PartitionSpec(*box.names), mesh)
        else:
            return box
        return box if nv is v else box.replace_boxed(nv)

    return meta.map_axis_meta(fix, tree)


# --- running one step ----------------------------------------------------------------------------

def _nest(path: tuple, tree):
    for name in reversed(path):
        tree = {name: tree}
    return tree


def _copy_dicts(tree):
    if isinstance(tree, dict):
        return {k: _copy_dicts(v) for k, v in tree.items()}
    return tree


def _present(scope) -> dict:
    """``{collection: the dict at scope's path}`` for the collections that have one."""
    out = {}
    for col in list(scope._variables):
        d = scope._collection(col, create=False)
        if d is not None:
            out[col] = d
    return out


def _check_fields(self, who):
    def walk(v, where):
        if isinstance(v, Module):
            if v._scope is not None:
                raise NotImplementedError(
                    f"{who}: field {where} of {type(self).__name__} holds a module bound "
                    f"elsewhere ({v._scope.path_text}); ctrainstate lifts only the transformed "
                    f"module's own variables. Pass an unbound module (created outside setup) "
                    f"or create it inside the scanned module.")
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{where}[{k!r}]")
        elif isinstance(v, (list, tuple)):
            for k, x in enumerate(v):
                walk(x, f"{where}[{k}]")
    for f in dataclasses.fields(self):
        if f.name != "name":
            walk(getattr(self, f.name), f.name)


def _clone_on(self, target: type, scope) -> Module:
    """A fresh instance of ``target`` with ``self``'s fields, bound to ``scope`` (Flax clones
    the module with its attributes for every trace)."""
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    stack = _module._module_stack()
    saved = list(stack)
    stack.clear()  # the clone must not attach to the module being run
    try:
        m = target(**fields)
    finally:
        stack.extend(saved)
    object.__setattr__(m, "_scope", scope)
    return m


class _Step:
    """What one lifted step needs: the module, the target method, the lifted scope."""

    def __init__(self, module, target, method, who, memo: dict):
        self.module, self.target, self.method, self.who = module, target, method, who
        self.scope = module._scope
        self.memo = memo  # per lifted method: whether its first trace can run abstractly

    def run(self, variables: dict, rngs: dict, mutable, store: dict, args: tuple):
        """Run the target method on a clone bound to a step scope; returns (output, scope)."""
        S = self.scope
        inner = _LiftedScope({col: _nest(S.path, t) for col, t in variables.items()}, rngs,
                             mutable, S.path, store)
        inner.initializing = getattr(S, "initializing", False)
        # the child scopes whose counters the store already holds exist from the start, so
        # a remat'd submodule's replay (nn.remat saves the counters of the scopes it finds)
        # restores them instead of restarting them from zero
        for rel in sorted(store, key=len):
            s = inner
            for name in rel:
                s = s.push(name)
        clone = _clone_on(self.module, self.target, inner)
        with inner:
            out = self.method(clone, *args)
        return out, inner

    @staticmethod
    def harvest(inner, filters) -> list:
        """The step's mutable collections, grouped by ``filters``."""
        cols = {}
        for col in list(inner._variables):
            if in_filter(inner.mutable, col):
                d = inner._collection(col, create=False)
                if d is not None:
                    cols[col] = d
        return [{c: cols[c] for c in names} for names in _group(list(cols), filters)]

    def publish(self, groups):
        S = self.scope
        for g in groups:
            for col, tree in g.items():
                if not S.is_mutable_collection(col):
                    continue  # Flax skips the redundant outputs of immutable collections
                for name, value in tree.items():
                    S.put_variable(col, name, value)


def _rng_groups(scope, split_rngs: Mapping) -> dict:
    """stream -> split? for the module's streams that ``split_rngs`` lifts."""
    filters, splits = list(split_rngs.keys()), list(split_rngs.values())
    out = {}
    for names, split in zip(_group(list(scope.root_rngs), filters), splits):
        for n in names:
            out[n] = bool(split)
    return out


def _split_keys(scope, lifted: dict, n: int) -> dict:
    return {k: (_random.split(scope.root_rngs[k], n) if split else scope.root_rngs[k])
            for k, split in lifted.items()}


def _step_rngs(keys: dict, lifted: dict, i: int) -> dict:
    return {k: (keys[k][i] if lifted[k] else keys[k]) for k in lifted}


def _warn_kwargs(kwargs, name):
    if kwargs:
        warnings.warn(f'kwargs are not supported in {name}, so "{", ".join(kwargs.keys())}" '
                      f'is(are) ignored', RuntimeWarning, stacklevel=3)


def _first_leaf_size(tree, axis):
    leaves = tree_leaves(tree)
    if not leaves:
        return None
    shape = tuple(leaves[0].shape) if hasattr(leaves[0], "shape") else np.shape(leaves[0])
    try:
        return shape[axis]
    except IndexError:
        raise ValueError(f"a value of shape {shape} has no axis {axis} to map over") from None


# --- scan ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _ScanConfig:
    variable_axes: Mapping = dataclasses.field(default_factory=dict)
    variable_broadcast: Any = False
    variable_carry: Any = False
    split_rngs: Mapping = dataclasses.field(default_factory=dict)
    in_axes: Any = 0
    out_axes: Any = 0
    length: int | None = None
    reverse: bool = False
    unroll: int = 1
    data_transform: Callable | None = None
    metadata_params: Mapping = dataclasses.field(default_factory=dict)
    check_constancy_invariants: bool = True
    _split_transpose: bool = False


def _scan_length(cfg: _ScanConfig, xs: tuple) -> int:
    lengths: set = set()

    def find(axis, x):
        if axis is broadcast:
            return
        if axis is None:
            raise ValueError("scan: an in_axes entry is None; use nn.broadcast to give every "
                             "step the whole value")
        n = _first_leaf_size(x, axis)
        if n is not None:
            lengths.add(n)
    tree_map(find, cfg.in_axes, xs)
    if cfg.length is None and len(lengths) == 1:
        return next(iter(lengths))
    if len(lengths) > 1:
        raise ValueError(f"Inconsistent scan lengths: {lengths}")
    if cfg.length is None:
        raise ValueError("length should be specified manually.")
    if lengths and cfg.length not in lengths:
        raise ValueError(f"scan: length={cfg.length} disagrees with the scanned inputs' "
                         f"size {next(iter(lengths))} along their scan axis")
    return int(cfg.length)


def _abstract_tree(tree, keep: dict):
    """Every array leaf as a ShapeDtypeStruct; ``keep`` maps the structs' ids back to the
    concrete leaves."""
    def conv(x):
        a = _abstract.to_abstract(x)
        if a is not x:
            keep[id(a)] = x
        return a
    return tree_map(conv, tree)


def _check_carry(c_in, c_out, who):
    li, ti = tree_flatten(c_in)
    lo, to = tree_flatten(c_out)
    if ti != to:
        raise TypeError(f"{who}: the carry returned by the body has a different structure than "
                        f"the carry it was given:\n  in:  {ti}\n  out: {to}")
    for a, b in zip(li, lo):
        sa = tuple(np.shape(a)) if not hasattr(a, "shape") else tuple(a.shape)
        sb = tuple(np.shape(b)) if not hasattr(b, "shape") else tuple(b.shape)
        if sa != sb:
            raise TypeError(f"{who}: the carry must keep its shapes from step to step; a leaf "
                            f"of shape {sa} came back with shape {sb}")


def _check_carry_vars(before: dict, after: dict, who):
    for col in set(before) | set(after):
        tb = tree_flatten(before.get(col, {}))[1]
        ta = tree_flatten(after.get(col, {}))[1]
        if tb != ta:
            raise TypeError(
                f"{who}: the carried collection '{col}' changed its variables inside the loop "
                f"(a carried variable must exist before the scan, e.g. created by a method that "
                f"is not scanned):\n  before: {tb}\n  after:  {ta}")


def _scan_call(step: _Step, cfg: _ScanConfig, args: tuple, kwargs: dict):
    who = f"nn.scan({step.target.__name__})"
    _warn_kwargs(kwargs, "scan")
    if not args:
        raise TypeError(f"{who}: a scanned method takes (carry, *xs); no carry was given")
    init, xs = args[0], tuple(args[1:])
    S = step.scope
    vin, vout = _split_in_out_axes(cfg.variable_axes)
    in_filters = (cfg.variable_broadcast, cfg.variable_carry) + tuple(vin)
    out_filters = (cfg.variable_broadcast, cfg.variable_carry) + tuple(vout)
    present = _present(S)
    groups = [{c: _copy_dicts(present[c]) for c in names}
              for names in _group(list(present), in_filters)]
    bcast_in, carry_vars = groups[0], groups[1]
    scan_in = [meta.remove_axis(g, ax, dict(cfg.metadata_params))
               for g, ax in zip(groups[2:], vin.values())]
    if not cfg.check_constancy_invariants and any(
            a is broadcast for a in tree_leaves(cfg.out_axes)):
        raise ValueError(f"nn.scan run with check_constancy_invariants=False does not support "
                         f"broadcast non-carry function outputs.  out_axes was given as "
                         f"{cfg.out_axes}")
    n = _scan_length(cfg, xs)
    if n < 1:
        raise ValueError(f"{who}: a scan of length {n} is not supported (nothing to run)")
    lifted = _rng_groups(S, cfg.split_rngs)
    keys = _split_keys(S, lifted, n)
    mutable = _Intersection(S.mutable, _Union(*out_filters))
    store = _seed_store(S)

    rng_names = _group(list(lifted), list(cfg.split_rngs))

    def transform(variable_groups, rngs):
        if cfg.data_transform is None:
            return variable_groups, rngs
        # Flax's groups: (broadcast, carry, *scanned) collection dicts, and one dict of
        # streams per split_rngs entry (here raw keys, not Flax's LazyRng wrappers)
        vg, rg = cfg.data_transform(tuple(variable_groups),
                                    tuple({k: rngs[k] for k in names} for names in rng_names))
        out = {}
        for g in rg:
            out.update(g)
        return list(vg), out

    def variables_of(vgroups):
        out = {}
        for g in vgroups:
            out.update(g)
        return out

    # slicers of the scanned inputs and variables
    xs_s = tree_map(lambda ax, x: x if ax is broadcast else _slicers(x, ax, n, f"{who} input"),
                    cfg.in_axes, xs)
    scan_s = [{col: _slicers(t, ax, n, f"{who} variable collection '{col}'")
               for col, t in g.items()} for g, ax in zip(scan_in, vin.values())]

    # 1. Flax's first trace (finds the broadcast variables and advances the RNG counters):
    #    abstract when that suffices, else on step 0's values without recording
    if cfg.check_constancy_invariants:
        before = _snapshot(store)
        bcast = _first_pass(step, cfg, init, xs_s, scan_s, bcast_in, carry_vars, keys, lifted,
                            mutable, store, transform, variables_of, out_filters, before, who)
    else:  # Flax's simple scan: one trace, broadcast variables are not made
        bcast = bcast_in

    # 2. the loop: every step is the same second trace
    snap = _snapshot(store)
    ys, scan_out = [None] * n, [None] * n
    c = init
    for i in (reversed(range(n)) if cfg.reverse else range(n)):
        _restore(store, snap)
        vg = [_copy_dicts(bcast), carry_vars] + [{col: _pick(t, i) for col, t in g.items()}
                                                 for g in scan_s]
        vg, rngs = transform(vg, _step_rngs(keys, lifted, i))
        res, inner = step.run(variables_of(vg), rngs, mutable, store,
                              (c,) + tuple(_pick(xs_s, i)))
        if not isinstance(res, tuple) or len(res) != 2:
            raise TypeError(f"{who}: a scanned method must return (carry, ys), got "
                            f"{type(res).__name__}")
        c2, y = res
        _check_carry(c, c2, who)
        c = c2
        out = _Step.harvest(inner, out_filters)
        new_carry = {**carry_vars, **out[1]}
        _check_carry_vars(carry_vars, new_carry, who)
        carry_vars = new_carry
        scan_out[i] = out[2:]
        ys[i] = y

    # 3. outputs: stacked along out_axes; variables stacked along their axes
    def stack_ys(ax, *sub):
        if ax is broadcast:
            return sub[-1]
        return _stack_trees(list(sub), ax, f"{who} output")
    ys_out = tree_map(stack_ys, cfg.out_axes, *ys)
    stacked = []
    for k, ax in enumerate(vout.values()):
        g = {}
        cols = set().union(*(set(scan_out[i][k]) for i in range(n))) if n else set()
        for col in sorted(cols):
            trees = [scan_out[i][k].get(col) for i in range(n)]
            if any(t is None for t in trees):
                raise ValueError(f"{who}: collection '{col}' was written in some steps only")
            g[col] = _reshard_boxes(meta.add_axis(_stack_trees(trees, ax, f"{who} variable "
                                                                          f"collection '{col}'"),
                                                  ax, dict(cfg.metadata_params)))
        stacked.append(g)
    step.publish([bcast, carry_vars] + stacked)
    _write_back(S, store)
    return c, ys_out


def _first_pass(step, cfg, init, xs_s, scan_s, bcast_in, carry_vars, keys, lifted, mutable,
                store, transform, variables_of, out_filters, before, who):
    """Flax's constancy trace: returns the broadcast collections the loop sees. Run in
    abstract mode (no arrays made) unless that fails or creates broadcast variables, which
    need real values: then run on step 0's values, off the tape."""
    def once(abstract: bool):
        keep: dict = {}
        rngs = _step_rngs(keys, lifted, 0)
        if abstract:
            conv = lambda t: _abstract_tree(t, keep)  # noqa: E731
            vg = [conv(bcast_in), conv(carry_vars)] + [
                {col: tree_map(lambda s: s.abstract(), t, is_leaf=_is_slicer)
                 for col, t in g.items()} for g in scan_s]
            xs0 = tree_map(lambda s: s.abstract() if isinstance(s, _Slicer)
                           else _abstract.to_abstract(s), xs_s, is_leaf=_is_slicer)
            c0 = conv(init)
        else:
            vg = [_copy_dicts(bcast_in), _copy_dicts(carry_vars)] + [
                {col: _pick(t, 0) for col, t in g.items()} for g in scan_s]
            xs0, c0 = _pick(xs_s, 0), init
        vg, rngs = transform(vg, rngs)
        ctx = _abstract.abstract_mode() if abstract else contextlib.nullcontext()
        with _no_tape(), ctx:
            _, inner = step.run(variables_of(vg), rngs, mutable, store, (c0,) + tuple(xs0))
        out = _Step.harvest(inner, out_filters)[0]
        bc = {**bcast_in, **out}
        if not abstract:
            return bc
        fresh = []

        def back(x):
            if id(x) in keep:
                return keep[id(x)]
            if isinstance(x, _abstract.ShapeDtypeStruct):
                fresh.append(x)
            return x
        bc = tree_map(back, bc)
        return None if fresh else bc

    if _abstract.is_abstract():
        return once(False)  # under eval_shape everything is abstract already
    bc = None
    if not step.memo.get("concrete"):
        try:
            bc = once(True)
        except Exception:  # an op without a shape rule, data-dependent Python: run it for
            step.memo["concrete"] = True  # real, now and in later calls
            bc = None
    if bc is None:
        _restore(store, before)
        bc = once(False)
    return bc


# --- vmap -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _VmapConfig:
    variable_axes: Mapping = dataclasses.field(default_factory=dict)
    split_rngs: Mapping = dataclasses.field(default_factory=dict)
    in_axes: Any = 0
    out_axes: Any = 0
    axis_size: int | None = None
    axis_name: str | None = None
    spmd_axis_name: str | None = None
    metadata_params: Mapping = dataclasses.field(default_factory=dict)


def _is_none(x):
    return x is None


def _vmap_call(step: _Step, cfg: _VmapConfig, args: tuple, kwargs: dict):
    who = f"nn.vmap({step.target.__name__})"
    _warn_kwargs(kwargs, "vmap")
    S = step.scope
    vin, vout = _split_in_out_axes(cfg.variable_axes)
    present = _present(S)
    groups = [{c: _copy_dicts(present[c]) for c in names}
              for names in _group(list(present), tuple(vin))]
    groups = [meta.remove_axis(g, ax, dict(cfg.metadata_params)) if ax is not None else g
              for g, ax in zip(groups, vin.values())]
    # the mapped size
    sizes: set = set()
    for g, ax in zip(groups, vin.values()):
        if ax is not None:
            s = _first_leaf_size(g, ax)
            if s is not None:
                sizes.add(s)

    def find(ax, x):
        if ax is not None:
            s = _first_leaf_size(x, ax)
            if s is not None:
                sizes.add(s)
    tree_map(find, cfg.in_axes, args, is_leaf=_is_none)
    if cfg.axis_size is None and len(sizes) == 1:
        n = next(iter(sizes))
    elif len(sizes) > 1:
        raise ValueError(f"Inconsistent batch axis sizes: {sizes}")
    elif cfg.axis_size is None:
        raise ValueError("axis_size should be specified manually.")
    else:
        n = int(cfg.axis_size)
        if sizes and n not in sizes:
            raise ValueError(f"vmap: axis_size={n} disagrees with the mapped inputs' size "
                             f"{next(iter(sizes))}")
    if n < 1:
        raise ValueError(f"{who}: a vmap over an axis of size {n} is not supported")
    lifted = _rng_groups(S, cfg.split_rngs)
    keys = _split_keys(S, lifted, n)
    mutable = _Intersection(S.mutable, _Union(*tuple(vout)))
    store = _seed_store(S)
    args_s = tree_map(lambda ax, x: x if ax is None else _slicers(x, ax, n, f"{who} input"),
                      cfg.in_axes, args, is_leaf=_is_none)
    var_s = [g if ax is None else {col: _slicers(t, ax, n, f"{who} variable collection "
                                                           f"'{col}'")
                                   for col, t in g.items()}
             for g, ax in zip(groups, vin.values())]
    snap = _snapshot(store)  # jax.vmap traces the body once: every step is that trace
    ys, outs = [], []
    for i in range(n):
        _restore(store, snap)
        variables = {}
        for g in var_s:
            for col, t in g.items():
                variables[col] = _copy_dicts(_pick(t, i))
        y, inner = step.run(variables, _step_rngs(keys, lifted, i), mutable, store,
                            tuple(_pick(args_s, i)))
        ys.append(y)
        outs.append(_Step.harvest(inner, tuple(vout)))

    def stack_ys(ax, *sub):
        if ax is None:
            return sub[-1]
        return _stack_trees(list(sub), ax, f"{who} output")
    ys_out = tree_map(stack_ys, cfg.out_axes, *ys, is_leaf=_is_none)
    result = []
    for k, ax in enumerate(vout.values()):
        g = {}
        cols = set().union(*(set(outs[i][k]) for i in range(n))) if n else set()
        for col in sorted(cols):
            trees = [outs[i][k].get(col) for i in range(n)]
            if any(t is None for t in trees):
                raise ValueError(f"{who}: collection '{col}' was written in some steps only")
            if ax is None:
                g[col] = trees[-1]
            else:
                g[col] = _reshard_boxes(meta.add_axis(
                    _stack_trees(trees, ax, f"{who} variable collection '{col}'"), ax,
                    dict(cfg.metadata_params)))
        result.append(g)
    step.publish(result)
    _write_back(S, store)
    return ys_out


# --- the lifted Module classes --------------------------------------------------------------------

def _no_adopt(self):
    # the lifted module's field submodules are adopted by each step's clone, in the step's
    # scope, not by the lifted module itself
    object.__setattr__(self, "_fields_adopted", True)


# target class -> method name -> {'concrete': True} once its first trace failed abstractly
# (lifted classes are often made anew in every call of a compact method; the target is not)
_MEMO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _lifted_method(kind: str, target: type, name: str, cfg, call):
    method = getattr(target, name)
    memo = _MEMO.setdefault(target, {}).setdefault(name, {})

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        _module._require_bound(self)
        _check_fields(self, f"nn.{kind}")
        return call(_Step(self, target, method, f"nn.{kind}", memo), cfg, args, kwargs)
    wrapped._ct_wrapped = True  # Module.__init_subclass__ must not wrap it again
    return wrapped


def _method_configs(methods, cfg, make):
    if methods is None:
        return {"__call__": cfg}
    if isinstance(methods, str):
        return {methods: cfg}
    if isinstance(methods, (list, tuple)):
        return {m: cfg for m in methods}
    if isinstance(methods, dict):
        return {m: make(**dict(kw)) for m, kw in methods.items()}  # Flax: per-method kwargs only
    raise ValueError("transform methods argument must be None, tuple, list, or dict.")


def _lift_function(kind: str, fn, cfg, call):
    """The function (decorator) form of a lifted transform: ``nn.scan(body, ...)`` for
    ``body(module, *args)``, called as ``lifted(module, *args)`` -- or used as a method
    decorator (``@functools.partial(nn.scan, ...)`` over ``@nn.compact def __call__``), where
    ``module`` is ``self``. The lifted variables are ``module``'s own (its scope), as in
    Flax's ``decorator_lift_transform``; each step runs ``body`` on a clone of ``module``."""
    body = _module._wrap_method(fn)   # frames, setup and @compact naming, as a method
    memo: dict = {}

    @functools.wraps(fn)
    def lifted(module, *args, **kwargs):
        if not isinstance(module, Module):
            raise TypeError(f"nn.{kind}({getattr(fn, '__name__', fn)!r}): the first argument "
                            f"must be a Module (the one whose variables are lifted), got "
                            f"{type(module).__name__}")
        _module._require_bound(
            module, f"a function lifted by nn.{kind} needs a module bound to a parent (create "
                    f"it inside a compact method or setup, and call the lifted function from a "
                    f"method running under init/apply)")
        module._try_setup()
        _check_fields(module, f"nn.{kind}")
        step_fn = body
        if not getattr(fn, "_ct_compact", False) and any(
                f.compact and f.module is module for f in _module._module_stack()):
            step_fn = _module._wrap_method(_compact_as_caller(fn, module))
        return call(_Step(module, type(module), step_fn, f"nn.{kind}", memo), cfg, args, kwargs)
    lifted._ct_wrapped = True   # as a method: Module.__init_subclass__ must not wrap it again
    return lifted


def _compact_as_caller(fn, module):
    """``fn`` run as a compact method of ``module``'s clone: Flax runs a lifted function on a
    clone that carries the caller's state, so a function lifted inside an ``@compact`` method
    may create submodules, numbered after those the caller already made
    (``nn.scan(lambda m, c: (nn.Dense(2)(c), ()), ...)(self, x)``)."""
    def step(clone, *args, **kwargs):
        object.__setattr__(clone, "_auto_counts", dict(module._auto_counts))
        object.__setattr__(clone, "_call_names", set(module._call_names))
        return fn(clone, *args, **kwargs)
    step._ct_compact = True
    step.__name__ = getattr(fn, "__name__", "lifted")
    return step


def _lift_class(kind: str, prefix: str, target, cfgs: dict, call):
    partial = None
    if isinstance(target, functools.partial):
        partial, target = target, target.func
    if not (isinstance(target, type) and issubclass(target, Module)):
        if callable(target) and not isinstance(target, (type, Module)):
            if len(cfgs) != 1 or "__call__" not in cfgs:
                raise ValueError(f"nn.{kind}: methods= applies to a Module class, not to a "
                                 f"function")
            return _lift_function(kind, target, cfgs["__call__"], call)
        raise TypeError(
            f"nn.{kind}: expected a Module class (e.g. nn.{kind}(Block, ...)) or a function "
            f"of a module (body(module, *args)), got {target!r}")
    body = {"__module__": target.__module__, "__doc__": target.__doc__,
            "_adopt_fields": _no_adopt}
    for m, cfg in cfgs.items():
        fn = getattr(target, m, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"nn.{kind}: {target.__name__} has no method {m!r}")
        body[m] = _lifted_method(kind, target, m, cfg, call)
    cls = type(f"{prefix}{target.__name__}", (target,), body)
    if partial is not None:
        return functools.partial(cls, *partial.args, **partial.keywords)
    return cls


def scan(target, variable_axes: Mapping = {}, variable_broadcast=False, variable_carry=False,
         split_rngs: Mapping = {}, in_axes=0, out_axes=0, length: int | None = None,
         reverse: bool = False, unroll: int = 1, data_transform: Callable | None = None,
         metadata_params: Mapping = {}, methods=None, _split_transpose: bool = False,
         check_constancy_invariants: bool = True):
    """Like ``flax.linen.scan``: a Module class ``Scan<Name>`` (a subclass of ``target``)
    whose ``methods`` (default ``__call__``) take ``(carry, *xs)`` and return ``(carry, ys)``,
    run once per step of the scanned axis (see the module docstring). With a function
    ``target(module, carry, *xs) -> (carry, ys)`` (Flax's function form, also usable as a
    method decorator), the result is that function lifted over ``module``'s variables:
    ``nn.scan(body, variable_broadcast='params', split_rngs={'params': False})(cell, c, xs)``.

    Args:
      target: a Module class (or a ``functools.partial`` of one), or a function of a module.
      variable_axes: ``{collection filter: axis}``: collections stacked along ``axis``
        (``In(axis)`` / ``Out(axis)`` lift one way only).
      variable_broadcast: collections shared by every step (e.g. shared ``'params'``, created
        by the first trace with the unsplit key).
      variable_carry: collections carried from step to step.
      split_rngs: ``{stream filter: bool}``: split streams give step ``i`` the key
        ``random.split(key, length)[i]``; unsplit ones the same key every step; streams not
        named are not visible inside.
      in_axes: the axis of ``xs`` to scan over, a prefix tree of ``xs``; ``nn.broadcast`` gives
        every step the whole value.
      out_axes: where the stacked axis goes in ``ys`` (a prefix tree; ``nn.broadcast``: the last
        step's value).
      length: the number of steps, needed when no scanned input gives it.
      reverse: run from the last step to the first (``ys`` keep their positions).
      unroll, _split_transpose: accepted for Flax's signature; nothing is traced or compiled.
      check_constancy_invariants: with ``False``, as in Flax, the first trace is skipped (the
        RNG counters advance once, broadcast variables are not created and a broadcast
        ``out_axes`` is refused).
      data_transform: ``f(variable_groups, rng_groups) -> (variable_groups, rng_groups)``,
        called in every step (and the first trace) on the ``(broadcast, carry, *scanned)``
        collection dicts and one ``{stream: key}`` dict per ``split_rngs`` entry (raw keys
        where Flax passes its ``LazyRng`` wrappers).
      metadata_params: passed to the boxes' ``add_axis`` / ``remove_axis``
        (``{nn.PARTITION_NAME: 'layers'}``).
      methods: the methods to scan (a list, or ``{name: {scan kwargs}}``).

    As in Flax, keyword arguments of a scanned call are ignored with a ``RuntimeWarning``.
    Errors: ``Inconsistent scan lengths: {...}``, ``length should be specified manually.``,
    a carry whose structure or shapes change (``TypeError``), a scanned value whose size
    along its axis is not the length.

    The first (constancy) trace runs in abstract mode, creating no arrays, when that works
    and creates no broadcast variable; otherwise it runs on step 0's values without recording
    for autodiff (one extra step of compute).
    """
    make = functools.partial(_ScanConfig)
    cfg = make(variable_axes=dict(variable_axes), variable_broadcast=variable_broadcast,
               variable_carry=variable_carry, split_rngs=dict(split_rngs), in_axes=in_axes,
               out_axes=out_axes, length=length, reverse=reverse, unroll=unroll,
               data_transform=data_transform, metadata_params=dict(metadata_params),
               check_constancy_invariants=check_constancy_invariants,
               _split_transpose=_split_transpose)
    ins, outs = _split_in_out_axes(cfg.variable_axes)
    for ax in list(ins.values()) + list(outs.values()):
        if not isinstance(ax, int) or isinstance(ax, bool):
            raise TypeError(f"nn.scan: variable_axes values must be ints (or In/Out of ints), "
                            f"got {ax!r}")
    return _lift_class("scan", "Scan", target, _method_configs(methods, cfg, make), _scan_call)


def vmap(target, variable_axes: Mapping = {}, split_rngs: Mapping = {}, in_axes=0, out_axes=0,
         axis_size: int | None = None, axis_name: str | None = None,
         spmd_axis_name: str | None = None, metadata_params: Mapping = {}, methods=None):
    """Like ``flax.linen.vmap``: a Module class ``Vmap<Name>`` (a subclass of ``target``)
    whose ``methods`` (default ``__call__``) map over an axis of their arguments: each
    element runs the module (a Python loop) and the outputs are stacked (see the module
    docstring). A function ``target(module, *args)`` is lifted over ``module``'s variables
    (Flax's function form), as in :func:`scan`.

    Args:
      target: a Module class (or a ``functools.partial`` of one), or a function of a module.
      variable_axes: ``{collection filter: axis or None}``: ``axis`` stacks the collection
        (per-element variables), ``None`` shares it.
      split_rngs: ``{stream filter: bool}`` as in :func:`scan`.
      in_axes: the mapped axis of each argument (a prefix tree; ``None``: not mapped).
      out_axes: where the mapped axis goes in the output (``None``: not mapped).
      axis_size: needed when no mapped argument or variable gives the size.
      axis_name, spmd_axis_name: accepted for Flax's signature; ctrainstate has no named-axis
        collectives inside a vmap.
      metadata_params: passed to the boxes' ``add_axis`` / ``remove_axis``.
      methods: the methods to map.

    As in Flax, keyword arguments are ignored with a ``RuntimeWarning``. Errors:
    ``Inconsistent batch axis sizes: {...}``, ``axis_size should be specified manually.``

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> Dense3 = nn.vmap(nn.Dense, variable_axes={'params': 0}, split_rngs={'params': True})
    >>> v = Dense3(2).init(random.PRNGKey(0), np.ones((3, 5, 4), np.float32))
    >>> v['params']['kernel'].shape
    (3, 4, 2)
    """
    make = functools.partial(_VmapConfig)
    cfg = make(variable_axes=dict(variable_axes), split_rngs=dict(split_rngs), in_axes=in_axes,
               out_axes=out_axes, axis_size=axis_size, axis_name=axis_name,
               spmd_axis_name=spmd_axis_name, metadata_params=dict(metadata_params))
    return _lift_class("vmap", "Vmap", target, _method_configs(methods, cfg, make), _vmap_call)


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
