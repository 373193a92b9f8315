"""``jit`` / ``pjit`` with sharding arguments (mirror of ``jax.jit`` and the legacy
``jax.experimental.pjit.pjit``): traced once, replayed from C.

The first call with given argument shapes, dtypes, shardings and static values runs the
function and records its primitive calls (:class:`ctrainstate._C.Program`,
csrc/python/py_dispatch.c); later calls replay the recorded plans from C, with no Python
per op. A function that does anything else to its traced values (a Python op without a C
plan, a host read such as ``float(x)``, an optimizer step in place) cannot be replayed and
runs eagerly on every call, with the same results; ``f.lower(*args).as_text()`` shows the
program or the reason, and ``f.lower(*args).compile().memory_analysis()`` the bytes a replay
holds per device (:class:`MemoryAnalysis`). ``TrainState.apply_gradients`` inside the function
is one node of the program (the fused optimizer step, in place); Python int arguments are
traced as int32 Arrays, as jax traces them. The wrappers place
the inputs by ``in_shardings`` / ``in_axis_resources``, call the function (inside
the active mesh), and place the outputs by ``out_shardings`` /
``out_axis_resources``. Specs may be pytree prefixes of the arguments/outputs; a
``PartitionSpec`` resolves against the active mesh (``with mesh:``); a box
(``nn.Partitioned``) takes the spec of its value. Parameters created under
``with mesh, axis_rules(rules):`` are already born sharded, so placing them by
their own specs costs nothing; anything else is resharded device to device.
Host outputs come back as Arrays; keywords jax accepts but that
change nothing here are listed in :func:`jit`'s docstring, and unknown keywords raise
``TypeError``.

>>> import numpy as np, ctrainstate as cts
>>> from ctrainstate import P
>>> mesh = cts.make_mesh((1,), ('x',))
>>> with mesh:
...     y = cts.pjit(lambda a: a * 2.0, in_axis_resources=P('x'), out_axis_resources=P())(np.ones(4, np.float32))
>>> y.sharding.spec
PartitionSpec()
"""
from __future__ import annotations

import collections
import functools
import inspect
from typing import Any, Callable, Sequence

import numpy as np

from ... import _C
from ..base import config as _config
from ..base import tree_util
from ..array.abstract import ShapeDtypeStruct
from ..base.trace_state import jit_scope
from ..array.array import Array, device_put
from ..array.sharding import NamedSharding, PartitionSpec, Sharding, get_mesh
from ..base.devices import _normalize_backend, local_devices
from ..ops.ops import _tape, _put

__all__ = ["jit", "pjit", "MemoryAnalysis"]


def _is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, (PartitionSpec, Sharding))


def _resolve(spec, *, none_means_replicated: bool, what: str):
    if isinstance(spec, Sharding):
        return spec
    if spec is None and not none_means_replicated:
        return None
    mesh = get_mesh()
    if mesh is None:
        raise RuntimeError(
            f"{what}: a PartitionSpec needs an active mesh: call inside `with mesh:` or pass "
            f"NamedSharding objects")
    return NamedSharding(mesh, PartitionSpec() if spec is None else spec)


def _place(spec_tree, tree, *, none_means_replicated: bool, what: str):
    if spec_tree is None and not none_means_replicated:
        return tree

    def put(spec, sub, prefix):
        s = _resolve(spec, none_means_replicated=none_means_replicated, what=what)
        if s is None:
            return sub

        def place(path, leaf):
            if not (isinstance(leaf, (Array, ShapeDtypeStruct)) or _is_array_like(leaf)):
                return leaf
            try:
                # (an Array inside a trace: resharded by an op node of the program)
                return _put(leaf, s) if type(leaf) is Array else device_put(leaf, s)
            except ValueError as e:   # name the value in a tree that does not fit its spec
                where = tree_util.keystr(prefix + tuple(path))
                if not where:
                    raise
                raise ValueError(f"{where} (shape {tuple(leaf.shape)}, spec {s.spec}): "
                                 f"{e}") from None
        return tree_util.tree_map_with_path(place, sub)

    s_items, s_td = tree_util.tree_flatten_with_path(spec_tree, is_leaf=_is_spec_leaf)
    try:   # only a structure mismatch is reported as one (a placement error is its own)
        subtrees = tree_util._flatten_up_to(s_td, tree)
    except ValueError as e:
        raise ValueError(f"{what}: the sharding tree does not match the values: {e}") from None
    out = []
    for (sp_path, sp), sub in zip(s_items, subtrees):
        try:
            out.append(put(sp, sub, tuple(sp_path)))
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    return tree_util.tree_unflatten(s_td, out)


def _is_array_like(x) -> bool:
    return isinstance(x, (np.ndarray, np.generic))


def _to_arrays(tree):
    """Host leaves of a function's outputs (numpy arrays and scalars, Python numbers) as
    Arrays placed as ``device_put`` places them, as ``jax.jit`` returns ``jax.Array``s."""
    def conv(leaf):
        if _is_array_like(leaf) or (isinstance(leaf, (bool, int, float))):
            return device_put(leaf)
        return leaf
    return tree_util.tree_map(conv, tree)


def _argnums(value, what: str) -> tuple:
    if value is None:
        return ()
    if isinstance(value, bool) or not isinstance(value, (int, tuple, list)):
        raise TypeError(f"jit: {what} must be an int or a sequence of ints, got "
                        f"{type(value).__name__}")
    vals = (value,) if isinstance(value, int) else tuple(value)
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"jit: {what} must be an int or a sequence of ints, got "
                            f"{v!r} in {value!r}")
    return vals


def _argnames(value, what: str) -> tuple:
    if value is None:
        return ()
    vals = (value,) if isinstance(value, str) else value
    try:
        vals = tuple(vals)
    except TypeError:
        raise TypeError(f"jit: {what} must be a str or a sequence of str, got "
                        f"{type(value).__name__}") from None
    for v in vals:
        if not isinstance(v, str):
            raise TypeError(f"jit: {what} must be a str or a sequence of str, got {v!r} in "
                            f"{value!r}")
    return vals


def _positional_params(fun):
    """(names of positional parameters, whether fun takes *args, whether it takes
    **kwargs, all parameter names) or None when the signature is unknown."""
    try:
        sig = inspect.signature(fun)
    except (TypeError, ValueError):
        return None
    names, var, var_kw = [], False, False
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            var = True
        elif p.kind == p.VAR_KEYWORD:
            var_kw = True
    return names, var, var_kw, set(sig.parameters)


def _static_positions(fun, static_argnums, static_argnames) -> tuple:
    """Positions of static arguments: ``static_argnums`` plus the positions of
    ``static_argnames`` (jax infers one from the other through the signature)."""
    nums = _argnums(static_argnums, "static_argnums")
    names = _argnames(static_argnames, "static_argnames")
    params = _positional_params(fun)
    if params is None:
        return nums
    pos, var, var_kw, all_names = params
    bad = set(names) - all_names
    if bad and not var_kw:   # a function taking **kwargs takes any name, as in jax
        raise ValueError(f"jit: static_argnames {sorted(bad)} are not parameters of "
                         f"{getattr(fun, '__qualname__', fun)!r}")
    if not var:
        over = [i for i in nums if not -len(pos) <= i < len(pos)]
        if over:
            raise ValueError(f"jit: static_argnums={nums} but the function takes only "
                             f"{len(pos)} positional arguments")
    nums = tuple(i % len(pos) if i < 0 and pos else i for i in nums)
    return tuple(sorted(set(nums) | {pos.index(n) for n in names if n in pos}))


def _wrap(fun, in_specs, out_specs, static_argnums, static_argnames, none_means_replicated,
          names, donate_argnums=None, donate_argnames=None):
    if not callable(fun):
        raise TypeError(f"{names[0].split()[0]}: expected a function, got "
                        f"{type(fun).__name__}")
    static = _static_positions(fun, static_argnums, static_argnames)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        args = list(args)
        dyn = [i for i in range(len(args)) if i not in static]
        if in_specs is not None:
            specs = in_specs
            if type(specs) is not tuple:  # one spec (or prefix) for every argument
                specs = (specs,) * len(dyn)
            if len(specs) != len(dyn):
                if len(specs) == len(args):  # specs given for every argument (jax allows None for statics)
                    specs = tuple(s for i, s in enumerate(specs) if i not in static)
                else:
                    raise ValueError(
                        f"{names[0]}: {len(specs)} input shardings for {len(dyn)} non-static "
                        f"arguments")
            for i, spec in zip(dyn, specs):
                args[i] = _place(spec, args[i], none_means_replicated=none_means_replicated,
                                 what=names[0])
        if _config._values["jax_disable_jit"]:
            return finish(fun(*args, **kwargs))
        if _C.trace_active():   # inside another jit's trace: inlined, as in jax
            return run(args, kwargs)
        return programs.call(args, kwargs)

    def run(args, kwargs):
        with jit_scope():   # inside jit, a non-dividing sharding replicates that dimension
            return finish(fun(*args, **kwargs))

    def finish(out):
        if out_specs is not None:
            out = _place(out_specs, out, none_means_replicated=none_means_replicated, what=names[1])
        return _to_arrays(out)

    donate = _static_positions(fun, donate_argnums, donate_argnames)
    both = sorted(set(donate) & set(static))
    if both:
        raise ValueError(f"{names[0].split()[0]}: argument(s) {both} are both static and "
                         f"donated; a static argument is not an Array and cannot be donated")
    programs = _Programs(run, static, _argnames(static_argnames, "static_argnames"), donate,
                         _argnames(donate_argnames, "donate_argnames"))
    wrapped.lower = lambda *a, **k: _Lowered(wrapped, programs, a, k)
    wrapped.compile = lambda *a, **k: wrapped
    wrapped._programs = programs
    return wrapped


_MAX_PROGRAMS = 8   # traced programs kept per jitted function (the least recently used go)
_INT_TEMPLATE: list = []


def _int_template():
    """A 0-d int32 Array on this process's first device: how a Python int argument is placed
    (C copies its placement for each int it converts)."""
    if not _INT_TEMPLATE:
        _INT_TEMPLATE.append(device_put(np.int32(0), local_devices()[0]))
    return _INT_TEMPLATE[0]


_SK = _C.spec_kinds


class _NoSpec(Exception):
    pass


def _spec_of(x, depth: int = 0):
    """The structure of ``x`` as a spec for ``_C.flatten_spec`` (csrc/python/py_tree.c), or
    :class:`_NoSpec` where a node is not one the spec describes (any other registered pytree
    node, a leaf a jitted call cannot take)."""
    t = type(x)
    if depth > 60:
        raise _NoSpec
    if t is Array or t is int or t is float or t is bool or t is str or t is np.ndarray \
            or isinstance(x, np.generic):
        return (_SK["LEAF"], t)
    if x is None:
        return (_SK["NONE"],)
    if t is dict:
        keys = tuple(tree_util._sorted_keys(x))
        return (_SK["DICT"], keys, tuple(_spec_of(x[k], depth + 1) for k in keys))
    if t is tuple or t is list:
        return (_SK["TUPLE" if t is tuple else "LIST"], len(x),
                tuple(_spec_of(v, depth + 1) for v in x))
    if isinstance(x, tuple) and isinstance(getattr(t, "_fields", None), tuple):
        return (_SK["NAMED"], t, tuple(_spec_of(v, depth + 1) for v in x))
    fields = t.__dict__.get("_ct_fields") if "_ct_struct" in t.__dict__ else None
    if fields is not None:
        data, meta = fields
        return (_SK["STRUCT"], t, data, tuple(_spec_of(getattr(x, n), depth + 1) for n in data),
                meta, tuple(getattr(x, n) for n in meta))
    raise _NoSpec


def _split(leaves, tmpl):
    """``_C.split_args``, with numpy arrays and scalars among the leaves placed as Arrays first
    (``device_put``: the default device, or replicated over the active mesh), as ``jax.jit``
    transfers them at each call: such a call replays too."""
    arrays, parts, traced = _C.split_args(leaves, tmpl)
    if arrays is not None or not any(isinstance(x, _HOST) for x in leaves):
        return arrays, parts, traced
    placed = [device_put(x) if isinstance(x, _HOST) else x for x in leaves]
    arrays, parts, traced = _C.split_args(placed, tmpl)
    return arrays, parts, (placed if traced is None else traced)


_HOST = (np.ndarray, np.generic)


def _checked_spec(x, leaves):
    """A spec of ``x`` that flattens it to exactly ``leaves`` (optree's, object for object),
    or None."""
    try:
        spec = _spec_of(x)
    except _NoSpec:
        return None
    got = _C.flatten_spec(spec, x)
    if got is None or len(got) != len(leaves) or any(a is not b for a, b in zip(got, leaves)):
        return None
    return spec


_MAX_SPECS = 8   # argument structures a jitted function keys in C (the most recent first)


class _Programs:
    """A jitted function's traced programs, by the static part of its arguments (static
    arguments, the pytree structure, non-Array leaves by value); the Array leaves' shapes,
    dtypes and shardings are checked by ``Program.run``."""

    def __init__(self, run: Callable, static: tuple, static_names: tuple = (),
                 donate: tuple = (), donate_names: tuple = ()):
        self._run, self._static, self._static_names = run, static, frozenset(static_names)
        self._donate, self._donate_names = frozenset(donate), frozenset(donate_names)
        # key -> [(program, output treedef, output spec or None)], most recent first
        self._cache: dict = {}
        # argument structures seen (without static arguments): [(spec, key, parts, treedef)]
        self._specs: list = []
        self._nospec: set = set()   # keys whose structure has no spec
        self.donated: tuple = ()    # the last keyed call's donated argument Arrays
        self.traces = 0          # (the number of traces so far, for tests)

    def _key(self, args, kwargs):
        """(key, argument Arrays, the (args, kwargs) to trace with) or (None, reason, None)
        when the call cannot be replayed."""
        skw = ()
        if self._static_names and kwargs and not self._static_names.isdisjoint(kwargs):
            # static arguments given by name: keys by value, never traced
            skw = tuple(sorted((k, v) for k, v in kwargs.items() if k in self._static_names))
            dkw = {k: v for k, v in kwargs.items() if k not in self._static_names}
        else:
            dkw = kwargs
        tree = (tuple(a for i, a in enumerate(args) if i not in self._static), dkw) \
            if self._static else (tuple(args), dkw)
        tmpl = _INT_TEMPLATE[0] if _INT_TEMPLATE else _int_template()
        for spec, key, parts, td, don in (self._specs if not skw else ()):   # keyed in C
            leaves = _C.flatten_spec(spec, tree)
            if leaves is not None:
                arrays, got, traced = _split(leaves, tmpl)
                if arrays is not None and got == parts:
                    self.donated = don
                    return key, arrays, ((args, kwargs) if traced is None
                                         else self._traced(args, kwargs, td, traced))
                break
        leaves, td = tree_util.tree_flatten(tree)
        # (C: the Arrays, and the other leaves by value, constants of the program; Python
        # ints become int32 Arrays and numpy arrays Arrays, traced as jax traces them)
        arrays, parts, traced = _split(leaves, tmpl)
        if arrays is None:
            return None, f"an argument of type {parts} (pass Arrays, or mark it static)", None
        key = (tuple((i, args[i]) for i in self._static if i < len(args)), skw, td, parts)
        try:
            hash(key)
        except TypeError:
            return None, "an unhashable static argument", None
        self.donated = self._donated_arrays(tree, leaves) if self._donate or \
            self._donate_names else ()
        if not self._static and not skw and key not in self._nospec:
            spec = _checked_spec(tree, leaves)
            if spec is None:
                self._nospec.add(key)
            else:
                self._specs.insert(0, (spec, key, parts, td, self.donated))
                del self._specs[_MAX_SPECS:]
        return key, arrays, self._traced(args, kwargs, td, traced)

    def _donated_arrays(self, tree, leaves) -> tuple:
        """The positions, among the call's argument Arrays, of the leaves of donated
        arguments (``donate_argnums`` / ``donate_argnames``)."""
        dyn, kw = tree
        positions = [i for i in range(len(dyn) + len(self._static)) if i not in self._static]
        owners = []   # per leaf: donated or not
        for pos, arg in zip(positions, dyn):
            owners += [pos in self._donate] * len(tree_util.tree_leaves(arg))
        for name in tree_util._sorted_keys(kw):
            owners += [name in self._donate_names] * len(tree_util.tree_leaves(kw[name]))
        out, k = [], 0
        for leaf, donated in zip(leaves, owners):
            t = type(leaf)
            if t is Array or isinstance(leaf, _HOST) or (
                    t is int and -2 ** 31 <= leaf < 2 ** 31):   # (the leaves split_args keeps)
                if donated:
                    out.append(k)
                k += 1
        return tuple(out)

    def _traced(self, args, kwargs, td, traced):
        """The (args, kwargs) a trace runs with: the ints (and numpy arrays) replaced by their
        Arrays; static arguments as they are."""
        if traced is None:
            return args, kwargs
        t_dyn, t_kw = tree_util.tree_unflatten(td, traced)
        kwargs = {**kwargs, **t_kw}
        t_dyn = iter(t_dyn)
        return [a if i in self._static else next(t_dyn) for i, a in enumerate(args)], kwargs

    def call(self, args, kwargs):
        if _tape() is not None:   # differentiated from outside: the ops must reach the tape
            return self._run(args, kwargs)
        key, arrays, traced = self._key(args, kwargs)
        if key is None:
            return self._run(args, kwargs)
        entries = self._cache.get(key)
        if entries:
            for prog, out_td, out_spec in entries:
                if prog.broken is not None:
                    return self._run(args, kwargs)
                outs = prog.run_donating(arrays, self.donated) if self.donated else \
                    prog.run(arrays)
                if outs is not None:
                    if out_spec is not None:
                        return _C.unflatten_spec(out_spec, outs)
                    return tree_util.tree_unflatten(out_td, outs)
        return self._trace(key, arrays, *traced, donate=self.donated)[0]

    def _trace(self, key, arrays, args, kwargs, donate=()):
        prog = _C.Program()
        try:
            _C.trace_begin(prog, arrays)
        except RuntimeError:     # another thread is tracing: this call runs eagerly
            return self._run(args, kwargs), None
        try:
            out = self._run(args, kwargs)
        finally:
            _C.trace_end()
        leaves, out_td = tree_util.tree_flatten(out)
        prog.finish(list(leaves))
        if donate:   # the traced call donates too (not an argument it returns)
            returned = {id(x) for x in leaves}
            for i in donate:
                x = arrays[i]
                if id(x) not in returned and not x._donated:
                    try:
                        x.delete()
                    except RuntimeError:   # (a numpy view of a shard keeps the buffers)
                        pass
                    x._donated = True
        self.traces += 1
        entries = self._cache.setdefault(key, [])
        entries.insert(0, (prog, out_td, _checked_spec(out, leaves)))
        del entries[_MAX_PROGRAMS:]
        return out, prog

    def program(self, args, kwargs):
        """(the program of a call with these arguments — the one traced before, else traced
        now — or None; why not)."""
        key, arrays, traced = self._key(args, kwargs)
        if key is None:
            return None, arrays
        for prog, _, _ in self._cache.get(key, ()):
            if prog.broken is not None or prog.matches(arrays):
                return prog, None
        prog = self._trace(key, arrays, *traced)[1]
        return prog, ("another thread was tracing" if prog is None else None)


class MemoryAnalysis:
    """What one replay of a jitted program holds on each device, from its recorded program
    (``f.lower(*args).compile().memory_analysis()``), computed without running it. The
    attributes are ``jax.stages.Compiled.memory_analysis()``'s, each the largest over the
    devices; ``per_device`` maps a device id to the same figures for that device.

    - ``argument_size_in_bytes``: the arguments' buffers;
    - ``output_size_in_bytes``: the outputs' (an output that is an argument counts here too);
    - ``alias_size_in_bytes``: outputs that take over an argument's buffers (an optimizer
      step in place: ``apply_gradients``), so they need no memory of their own;
    - ``temp_size_in_bytes``: the most memory the replay's intermediates (not outputs) hold at
      once, each freed after its last use;
    - ``constant_size_in_bytes``: Arrays the function closes over that the program reads;
    - ``peak_size_in_bytes``: arguments, constants, and the most the intermediates and the
      new outputs hold at once — what a replay needs on that device;
    - ``generated_code_size_in_bytes``: 0 (plans, no generated code).

    Scratch memory inside a kernel (a BLAS's packing buffers) is not counted."""

    _FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
               "temp_size_in_bytes", "constant_size_in_bytes", "peak_size_in_bytes")

    def __init__(self, per_device: dict):
        self.per_device = per_device
        for f in self._FIELDS:
            setattr(self, f, max((d[f] for d in per_device.values()), default=0))
        self.generated_code_size_in_bytes = 0
        self.host_argument_size_in_bytes = self.host_output_size_in_bytes = 0
        self.host_alias_size_in_bytes = self.host_temp_size_in_bytes = 0

    def __repr__(self):
        return ("MemoryAnalysis(" + ", ".join(f"{f}={getattr(self, f)}" for f in self._FIELDS)
                + f", devices={len(self.per_device)})")


def _memory_analysis(plan, donated=()) -> MemoryAnalysis:
    """A :class:`MemoryAnalysis` of ``Program.memory_plan()``: replays the program's
    allocations and frees (as ``Program.run`` does them) on byte counters; ``donated``: the
    arguments given up at their last use (``donate_argnums``)."""
    values, steps, outs, arenas = plan
    per = {}

    def dev(d):
        if d not in per:
            per[d] = dict.fromkeys(MemoryAnalysis._FIELDS, 0)
            per[d]["_live"] = per[d]["_temp"] = per[d]["_new"] = 0
        return per[d]
    out_set = {v for v in outs if v >= 0}
    for v, (kind, nbytes, last) in enumerate(values):
        if kind == "arg":
            for d, b in nbytes:
                dev(d)["argument_size_in_bytes"] += b
        elif kind == "const" and (last != -1 or v in out_set):
            for d, b in nbytes:
                dev(d)["constant_size_in_bytes"] += b
    for v in out_set:
        for d, b in values[v][1]:
            dev(d)["output_size_in_bytes"] += b
    held = set()   # step values (and donated arguments) holding memory of their own now
    gone = {}      # donated arguments, by the step after which they are given up
    for v in donated:
        if values[v][2] is None:   # (an output: not donated)
            continue
        gone.setdefault(values[v][2], []).append(v)
        for d, b in values[v][1]:   # counted as live memory from the start, not as a base
            s = dev(d)
            s["argument_size_in_bytes"] -= b
            s["_live"] += b
            s["_donated"] = s.get("_donated", 0) + b
    for v in gone.pop(-1, ()):   # never read: given up at once
        for d, b in values[v][1]:
            dev(d)["_live"] -= b
    # the static memory plan: one arena per device, held from before step a_first to after
    # step a_last, holding every value that only plain steps make and read ("arena" values:
    # no memory of their own)
    a_first, a_last, a_sizes = arenas

    def arena(sign):
        for d, b in a_sizes:
            s = dev(d)
            s["_live"] += sign * b
            s["_temp"] += sign * b
            s["peak_size_in_bytes"] = max(s["peak_size_in_bytes"], s["_live"])
            s["temp_size_in_bytes"] = max(s["temp_size_in_bytes"], s["_temp"])
    kept = {}      # an op node's first output -> what the node holds besides its outputs
    last_read = {}   # value -> the last step that reads it (outputs included)
    for k, (ins, *_) in enumerate(steps):
        for i in ins:
            last_read[i] = k
    # a node's output over an input's buffers (a vjp passing its cotangent through) holds that
    # input's memory: memory is freed when the last value over it is
    owner = {}     # held value -> the value whose allocation it is
    users = collections.Counter()   # allocation -> held values over it

    def release(v):
        held.discard(v)
        t = owner.pop(v)
        users[t] -= 1
        if not users[t]:
            for d, b in values[t][1]:
                dev(d)["_live"] -= b
                dev(d)["_temp"] -= b
    for k, (ins, outs_k, node, scratch, aliases) in enumerate(steps):
        over = dict(aliases)
        if k == a_first:
            arena(+1)
        # an op node's own allocations while it runs (its outputs and its Python code's
        # temporaries), and what it holds after besides its outputs (a differentiated op's
        # residuals, until its backward node: its first output's last use), measured at the
        # trace
        for d, b, keep in scratch or ():
            s = dev(d)
            s["peak_size_in_bytes"] = max(s["peak_size_in_bytes"], s["_live"] + b)
            s["temp_size_in_bytes"] = max(s["temp_size_in_bytes"], s["_temp"] + b)
            if keep and outs_k:
                kept.setdefault(outs_k[0], []).append((d, keep))
                s["_live"] += keep
                s["_temp"] += keep
        for o in outs_k:
            if values[o][0] == "arena":   # (in the arena, counted from the start)
                continue
            if node:   # takes over an input's buffers: no new memory
                if o in out_set:
                    for d, b in values[o][1]:
                        dev(d)["alias_size_in_bytes"] += b
                continue
            if o in over:   # an input's buffers (no memory of its own)
                i = over[o]
                if i in held:
                    held.add(o)
                    owner[o] = owner[i]
                    users[owner[i]] += 1
                continue
            held.add(o)
            owner[o] = o
            users[o] = 1
            for d, b in values[o][1]:
                s = dev(d)
                s["_live"] += b
                s["_new" if o in out_set else "_temp"] += b
        for s in per.values():
            s["peak_size_in_bytes"] = max(s["peak_size_in_bytes"], s["_live"])
            s["temp_size_in_bytes"] = max(s["temp_size_in_bytes"], s["_temp"])
        for o in outs_k:   # an output nothing reads (of an op node kept for another): freed
            if not node and values[o][2] == -1 and o not in out_set and o in held:
                release(o)
        for i in set(ins):   # each input freed after its last use (outputs stay)
            if i in held and values[i][2] == k and i not in out_set:
                release(i)
        for v in [v for v in kept if last_read.get(v, -1) <= k]:   # read for the last time
            for d, b in kept.pop(v):
                dev(d)["_live"] -= b
                dev(d)["_temp"] -= b
        for v in gone.pop(k, ()):
            for d, b in values[v][1]:
                dev(d)["_live"] -= b
        if k == a_last:
            arena(-1)
    for s in per.values():
        s["peak_size_in_bytes"] += s["argument_size_in_bytes"] + s["constant_size_in_bytes"]
        s["argument_size_in_bytes"] += s.pop("_donated", 0)   # (reported whole, as jax does)
        del s["_live"], s["_temp"], s["_new"]
    return MemoryAnalysis(per)


class _Lowered:
    """``f.lower(*args)``: the program of this call — the one an earlier call traced, else
    traced now (tracing runs the function once) — and ``compile()`` (itself), ``as_text()``,
    ``memory_analysis()``, ``graph_stats()``; calling it calls ``f``."""

    def __init__(self, f, programs, args, kwargs):
        self._f = f
        self._prog, self._why = programs.program(list(args), kwargs)
        self._donated = programs.donated if self._prog is not None else ()

    def compile(self, *a, **k):
        return self

    def as_text(self) -> str:
        if self._prog is None:
            return f"# not replayable: {self._why}\n"
        return self._prog.as_text()

    def memory_analysis(self) -> MemoryAnalysis:
        """Bytes per device a replay holds (:class:`MemoryAnalysis`), from the program alone.
        Raises ``RuntimeError`` naming the reason when the function is not replayable (it
        runs eagerly: there is no program to analyse)."""
        if self._prog is None or self._prog.broken is not None:
            why = self._why if self._prog is None else self._prog.broken
            raise RuntimeError(f"memory_analysis: the function is not replayable ({why}); it "
                               f"runs eagerly, so there is no program to analyse")
        return _memory_analysis(self._prog.memory_plan(), self._donated)

    def graph_stats(self) -> list:
        """The runs of steps replayed as CUDA graphs (GPU devices; README, "How jit replays a
        function"): per run a dict of its ``steps`` (first, last), ``devices``, and the
        ``captures``, in-place ``updates`` and ``launches`` so far; ``capture_failed`` when it
        runs kernel by kernel instead. Empty on CPU devices, for a function that is not
        replayable, and with graphs off (``CTRAINSTATE_CUDA_GRAPHS=0``)."""
        if self._prog is None or self._prog.broken is not None:
            return []
        keys = ("devices", "captures", "updates", "launches", "capture_failed")
        return [dict(steps=(a, b), **dict(zip(keys, rest)))
                for a, b, *rest in self._prog.graph_stats()]

    def __call__(self, *args, **kwargs):
        return self._f(*args, **kwargs)


# jax.jit keywords that change nothing here; accepted (and type-checked) so ported code runs.
_NO_EFFECT = ("keep_unused", "device", "backend", "inline", "abstracted_axes",
              "compiler_options")


def _check_no_effect(who, donate_argnums, donate_argnames, keep_unused, device, backend,
                     inline, compiler_options):
    _argnums(donate_argnums, "donate_argnums")
    _argnames(donate_argnames, "donate_argnames")
    if backend is not None:
        _normalize_backend(backend)
    if compiler_options is not None and not isinstance(compiler_options, dict):
        raise TypeError(f"{who}: compiler_options must be a dict, got "
                        f"{type(compiler_options).__name__}")


def jit(fun: Callable | None = None, in_shardings=None, out_shardings=None, *,
        static_argnums: int | Sequence[int] | None = None,
        static_argnames: str | Sequence[str] | None = None,
        donate_argnums: int | Sequence[int] | None = None,
        donate_argnames: str | Sequence[str] | None = None, keep_unused: bool = False,
        device=None, backend: str | None = None, inline: bool = False,
        abstracted_axes=None, compiler_options: dict | None = None) -> Callable:
    """``jax.jit`` with shardings: ``None`` leaves a value where it is.

    The function is traced at the first call of each signature and replayed from C (see the
    module docstring). Inputs are placed by ``in_shardings`` (positional,
    non-static arguments), outputs by ``out_shardings``; host outputs (numpy arrays,
    Python numbers) come back as :class:`Array` objects, as from ``jax.jit``.
    ``static_argnums`` / ``static_argnames`` name arguments that are passed through
    as they are (never placed); one is inferred from the other through the
    function's signature, as in jax. ``jit(static_argnums=...)`` without a function
    returns a decorator.

    ``donate_argnums`` / ``donate_argnames`` donate arguments as jax does: a replay frees
    each at its last use in the program (``memory_analysis`` counts it so), and the
    caller's Array raises ``DonatedBufferError`` afterwards; an argument the function
    returns is not donated. ``TrainState.apply_gradients`` inside updates the state in
    place whether or not it is donated.

    Accepted for compatibility, with no effect here: ``keep_unused``, ``device``,
    ``backend``, ``inline``, ``abstracted_axes``, ``compiler_options``. Any other keyword
    raises ``TypeError``, as in jax.

    >>> import numpy as np, ctrainstate as cts
    >>> f = cts.jit(lambda x, n: x * n, static_argnames='n')
    >>> y = f(np.float32([1, 2]), n=3)
    >>> type(y).__name__, y.tolist()
    ('Array', [3.0, 6.0])
    """
    if fun is None:
        return functools.partial(
            jit, in_shardings=in_shardings, out_shardings=out_shardings,
            static_argnums=static_argnums, static_argnames=static_argnames,
            donate_argnums=donate_argnums, donate_argnames=donate_argnames,
            keep_unused=keep_unused, device=device, backend=backend, inline=inline,
            abstracted_axes=abstracted_axes, compiler_options=compiler_options)
    _check_no_effect("jit", donate_argnums, donate_argnames, keep_unused, device, backend,
                     inline, compiler_options)
    return _wrap(fun, in_shardings, out_shardings, static_argnums, static_argnames, False,
                 ("jit in_shardings", "jit out_shardings"), donate_argnums, donate_argnames)


def pjit(fun: Callable, in_axis_resources=None, out_axis_resources=None,
         static_argnums: int | Sequence[int] | None = None,
         donate_argnums: int | Sequence[int] | None = None, in_shardings=None,
         out_shardings=None, *, static_argnames: str | Sequence[str] | None = None,
         donate_argnames: str | Sequence[str] | None = None, keep_unused: bool = False,
         device=None, backend: str | None = None, inline: bool = False,
         abstracted_axes=None, compiler_options: dict | None = None) -> Callable:
    """Legacy ``pjit``: PartitionSpecs against the active mesh; ``None`` means replicated.

    ``in_axis_resources`` / ``out_axis_resources`` are the legacy names of
    ``in_shardings`` / ``out_shardings`` (give one of each pair). The other keywords are
    those of :func:`jit`, with the same effect (or none); unknown keywords raise
    ``TypeError``.

    >>> import numpy as np, ctrainstate as cts
    >>> from ctrainstate import P
    >>> with cts.make_mesh((1,), ('x',)):
    ...     y = cts.pjit(lambda a: a + 1, in_shardings=P('x'), out_shardings=P())(np.zeros(2))
    >>> y.sharding.spec
    PartitionSpec()
    """
    if in_axis_resources is not None and in_shardings is not None:
        raise ValueError("pjit: give in_shardings or its legacy name in_axis_resources, not both")
    if out_axis_resources is not None and out_shardings is not None:
        raise ValueError("pjit: give out_shardings or its legacy name out_axis_resources, "
                         "not both")
    _check_no_effect("pjit", donate_argnums, donate_argnames, keep_unused, device, backend,
                     inline, compiler_options)
    ins = in_axis_resources if in_axis_resources is not None else in_shardings
    outs = out_axis_resources if out_axis_resources is not None else out_shardings
    return _wrap(fun, ins, outs, static_argnums, static_argnames, True,
                 ("pjit in_axis_resources", "pjit out_axis_resources"), donate_argnums,
                 donate_argnames)
