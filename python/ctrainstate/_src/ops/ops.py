"""Array ops on sharded Arrays: sharding propagation, per-shard kernels, autodiff tape.

Every op here
  1. brings its operands onto one mesh and to shardings the op can use
     without communication (resharding an operand when it must — never a
     silently wrong result),
  2. runs the C kernel on every device's blocks in one ``_C.op_*`` call
     (GIL released), and
  3. finishes with the collectives the shardings imply (an all-reduce over the
     mesh axes of a contracted or summed dimension).
The propagation rules are those of tensor and data parallelism:
``x[batch:data, in] @ W[in, hidden:model]`` needs no communication,
``y[.., hidden:model] @ W2[hidden:model, out]`` ends in an all-reduce over
``model``, and a sum over a dimension sharded on ``data`` all-reduces over
``data`` — which is how gradients of data-replicated parameters get summed.

When a :func:`value_and_grad` trace is active, each op also records its
vector-Jacobian product on the tape. Arithmetic is float32 (bfloat16 / float16 operands are
converted, computed in float32 and rounded back per op: see "dtypes" below); matrix products
take a ``precision`` (float32, TF32 or bfloat16 inputs: :mod:`ctrainstate._src.base.precision`).
Integer and bool operands (``add``, ``sum``, ``where``, ... when jax's promotion is not a
float) go to the typed kernels of :mod:`ctrainstate._src.ops.elementwise`, which also holds the
comparisons and boolean ops.
"""
from __future__ import annotations
from ..base.hooks import provide as _provide
_provide('_ops', __name__)   # lower layers call into this module through _hooks.upper

import sys
import ctypes
import functools
import inspect
import os
import builtins
import math
import operator
import contextlib
from typing import Any, Callable, Sequence

import numpy as np

from ... import _C
from ..base import dtypes as _dtypes
from ..base.threadlocal import NotifyingLocal
from ..base.devices import Device
from ..base import precision as _precision
from ..base.precision import F32 as _precision_F32, resolve_precision as _resolve_precision
from ..array.array import Array, _as_sharding, device_put
from ..array.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding, Sharding, get_mesh
from . import elementwise as _elementwise
from . import elementwise as ew
from ..array.abstract import ShapeDtypeStruct
from ..base.devices import devices, local_devices
from ..base.devices import _process as _devices_process
from .elementwise import result_type, sum_dtype
from ..array.array import _alloc_blocks
from ..base.tree_util import tree_flatten, tree_map, tree_unflatten
from ..base.hooks import upper as _upper

# the kernels' op codes (csrc/core/ct_ops.h), read from _C.op_codes
_UN, _BIN = _C.op_codes["unary"], _C.op_codes["binary"]
(U_AFFINE, U_NEG, U_SIN, U_COS, U_TANH, U_RELU, U_STEP, U_GELU, U_GELU_GRAD, U_EXP, U_LOG,
 U_SQRT, U_RSQRT, U_SQUARE, U_SIGMOID, U_ABS, U_SIGN, U_POW, U_RDIV,
 U_LOG1P, U_EXPM1, U_ERF, U_FLOOR, U_CEIL, U_ROUND, U_TRUNC, U_ERFC) = (
    _UN[n] for n in ("AFFINE", "NEG", "SIN", "COS", "TANH", "RELU", "STEP", "GELU", "GELU_GRAD",
                     "EXP", "LOG", "SQRT", "RSQRT", "SQUARE", "SIGMOID", "ABS", "SIGN", "POW",
                     "RDIV", "LOG1P", "EXPM1", "ERF", "FLOOR", "CEIL", "ROUND", "TRUNC", "ERFC"))
B_ADD, B_SUB, B_MUL, B_DIV, B_MAX, B_MIN, B_GT, B_KEEP, B_POW, B_PICK = (
    _BIN[n] for n in ("ADD", "SUB", "MUL", "DIV", "MAX", "MIN", "GT", "KEEP", "POW", "PICK"))
_RED_SUM, _RED_MAX = _C.op_codes["reduce"]["SUM"], _C.op_codes["reduce"]["MAX"]


# --- BLAS -----------------------------------------------------------------------------

_blas_checked = False


def _ensure_blas(n: int | None = None, k: int | None = None):
    """Register scipy's OpenBLAS sgemm with the CPU backend once (built-in kernel otherwise),
    before the first product that could use it: a product whose right operand is ``k`` x
    ``n`` (after its transpose) and fits the small kernel (``_C.gemm_small``) never calls the
    BLAS, so it does not import ``scipy.linalg`` (a quarter of a second) for a process whose
    products are all small. Without sizes: registered now."""
    global _blas_checked
    if _blas_checked or (n is not None and _C.gemm_small(n, k)):
        return
    _blas_checked = True
    if os.environ.get("CTRAINSTATE_NO_BLAS"):
        return
    try:
        from scipy.linalg import cython_blas
        capsule = cython_blas.__pyx_capi__["sgemm"]
    except Exception:  # scipy absent or without the capsule: the built-in GEMM is used
        return
    if _single_thread_scipy_blas():
        _C.set_blas_sgemm(capsule)


def _single_thread_scipy_blas() -> bool:
    """Ask scipy's own OpenBLAS copy for one thread: our OpenMP loop splits GEMMs across the
    cores, and two thread pools spinning on the same cores slow each other down. numpy's
    OpenBLAS (a separate library) is left alone. False if that library cannot be found."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "scipy.libs" in line and "openblas" in line}
    except OSError:
        return False
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads", "openblas_set_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(1))
                return True
    return False


# --- the tape ------------------------------------------------------------------------

class _Tape:
    """Records (output, inputs, vjp) for ops whose inputs are tracked. Its fields are slots:
    the C dispatcher (py_dispatch.c) reads them at their offsets."""

    __slots__ = ("nodes", "tracked", "keep", "outer")

    def __init__(self):
        self.nodes: list = []
        self.tracked: set = set()
        self.keep: list = []  # keeps tracked arrays alive so ids stay unique
        # the tapes of enclosing value_and_grad calls (set on a nested value_and_grad's tape):
        # an op of the inner function that reads an array one of them tracks is refused, since
        # the inner backward pass is not itself differentiated (no higher-order derivatives)
        self.outer: tuple = ()

    def track(self, a: Array):
        self.tracked.add(id(a))
        self.keep.append(a)


class _TapeLocal(NotifyingLocal):
    """This thread's stack of tapes (``tapes``: None until a differentiated call opens one).
    The class attribute makes ``_tls.tapes`` None on a thread that never set it, so the C
    dispatcher (py_dispatch.c) reads it without raising AttributeError."""

    tapes = None


_tls = _TapeLocal()


def _tape() -> _Tape | None:
    stack = getattr(_tls, "tapes", None)
    return stack[-1] if stack else None


def _record(out: Array, inputs: Sequence, vjp: Callable):
    """Record ``vjp(g) -> tuple of cotangents (None for untracked inputs)``."""
    t = _tape()
    if t is None:
        return out
    if t.outer:
        _check_not_nested(t, inputs)
    if any(isinstance(x, Array) and id(x) in t.tracked for x in inputs):
        t.track(out)
        t.nodes.append((out, tuple(inputs), vjp))
    return out


_NESTED = ("value_and_grad/grad inside another value_and_grad/grad, of values the outer one "
           "differentiates: higher-order derivatives (Hessians, gradient penalties, MAML's "
           "inner step) are not supported, and the result would silently miss the second-order "
           "terms. Compute the inner gradient outside the outer function, or on "
           "lax.stop_gradient(...) of the outer values if the inner gradient is meant as a "
           "constant")


def _open_tape():
    """A new tape for a differentiated call, with the enclosing calls' tapes as its ``outer``
    (see :data:`_NESTED`), and this thread's tape stack to push it on: ``(tape, stack)``."""
    tape = _Tape()
    stack = getattr(_tls, "tapes", None)
    if stack is None:
        stack = _tls.tapes = []
    enclosing = tuple(t for t in stack if t is not None)
    if enclosing:
        tape.outer = enclosing
    return tape, stack


@contextlib.contextmanager
def _no_tape():
    """Within: ops are not recorded on this thread's active tape (a ``None`` on the stack):
    a throw-away pass, a custom rule's own ops, a vjp's backward computation."""
    stack = getattr(_tls, "tapes", None)
    if stack is None:
        stack = _tls.tapes = []
    stack.append(None)
    try:
        yield
    finally:
        stack.pop()


def _check_not_nested(t: _Tape, inputs: Sequence) -> None:
    for x in inputs:
        if isinstance(x, Array) and any(id(x) in o.tracked for o in t.outer):
            raise NotImplementedError(_NESTED)


# --- meshes and specs -------------------------------------------------------------------

def _norm(sharding: Sharding, ndim: int) -> list:
    """Per-dimension tuples of mesh axes, padded to ``ndim``."""
    if isinstance(sharding, NamedSharding):
        n = list(sharding._norm)
    else:
        n = []
    return n + [()] * (ndim - len(n))


def _spec_of(norm: Sequence[tuple]) -> PartitionSpec:
    entries = [None if not e else (e[0] if len(e) == 1 else tuple(e)) for e in norm]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _mesh_key(a: Array):
    s = a.sharding
    if isinstance(s, NamedSharding):
        return ("mesh", s.mesh)
    return ("device", s.device)


def _axes_of(a: Array) -> list:
    """``a``'s mesh axes per dimension (``()`` each off a mesh)."""
    nd = len(a._shape)
    return _norm(a._sharding, nd) if isinstance(a._sharding, NamedSharding) else [()] * nd


def _common_placement(arrays: Sequence[Array]):
    """The mesh all operands can live on (moving single-device operands onto it)."""
    meshes = {_mesh_key(a) for a in arrays}
    named = [k for k in meshes if k[0] == "mesh"]
    if len(named) > 1:
        raise ValueError(
            "operands live on different meshes: "
            + ", ".join(repr(k[1]) for k in named) + "; device_put them onto one mesh first")
    if named:
        return named[0][1]
    devs = {k[1] for k in meshes}
    if len(devs) > 1:
        raise ValueError(
            f"operands live on different devices {sorted(d.id for d in devs)}; device_put them "
            f"onto one device or mesh first")
    return next(iter(devs))


def _id_cached(table: dict, key, a, b, build, *args):
    """``build(*args)``, kept in ``table`` under ``key``: the dispatch caches of the ops, whose
    keys hold the ids of immutable objects (places, meshes, shardings) ``a`` and ``b`` (None:
    unused) besides plain values. Each entry keeps its ``a`` and ``b``, so an id in a live key
    is still theirs, and a key whose id was reused by a new object misses. At most 4096
    entries (then the table starts over)."""
    hit = table.get(key)
    if hit is None or hit[0] is not a or hit[1] is not b:
        hit = (a, b, build(*args))
        if len(table) > 4096:
            table.clear()
        table[key] = hit
    return hit[2]


# The output shardings of ops, one object per (place, per-dimension axes): each keeps its
# own layout cache (Sharding._layout), so an op's output layout is computed once per shape,
# not once per op call.
_SHARDINGS: dict = {}


def _new_sharding(place, norm) -> Sharding:
    if isinstance(place, Device):
        return SingleDeviceSharding(place)
    return NamedSharding(place, _spec_of(norm))


def _sharding_for(place, norm) -> Sharding:
    key = (id(place), norm if type(norm) is tuple else tuple(tuple(e) for e in norm))
    try:   # a tuple of tuples (binary ops' plans, shardings' own axes) is the key as it is
        return _id_cached(_SHARDINGS, key, place, None, _new_sharding, place, norm)
    except TypeError:   # a tuple holding lists
        key = (id(place), tuple(tuple(e) for e in norm))
        return _id_cached(_SHARDINGS, key, place, None, _new_sharding, place, norm)


def _stays(a: Array, place, norm) -> bool:
    """Whether ``a`` already has the per-dimension mesh axes ``norm`` on ``place``. Mesh axes
    of size 1 split nothing, so they are not compared: on a 1x1 mesh ``P('model')`` and
    ``P(None)`` lay out the same blocks on the same devices, and neither operand moves."""
    if isinstance(place, Device):
        return isinstance(a.sharding, SingleDeviceSharding) and a.sharding.device is place
    if not (isinstance(a.sharding, NamedSharding) and a.sharding.mesh == place):
        return False
    have = [tuple(e) for e in _norm(a.sharding, a.ndim)]
    want = [tuple(e) for e in norm]
    if have == want:
        return True
    sizes = place._shape
    return (len(have) == len(want) and
            [tuple(x for x in e if sizes.get(x) != 1) for e in have] ==
            [tuple(x for x in e if sizes.get(x) != 1) for e in want])


def _to(a: Array, place, norm) -> Array:
    """``a`` with the given per-dimension mesh axes on ``place`` (resharding if needed)."""
    if _stays(a, place, norm):
        return a
    # (_put: under a jit trace, the reshard is an op node of the program)
    if isinstance(place, Device):
        return _put(a, SingleDeviceSharding(place))
    return _put(a, NamedSharding(place, _spec_of(norm)))


def _check_host_operand(x) -> None:
    """TypeError for a host operand that holds no numbers (None, a string, an object array):
    as in jax, not converted to NaN or parsed (``x + None`` is no array of NaNs)."""
    if isinstance(x, (int, float, np.floating, np.integer)):
        return
    if isinstance(x, np.ndarray):
        kind = x.dtype.kind
    elif x is None or isinstance(x, (str, bytes)):
        kind = "O"
    else:
        try:
            kind = np.asarray(x).dtype.kind
        except Exception:  # noqa: BLE001 - reported below with the operand's type
            kind = "O"
    if kind not in "biuf" and not (isinstance(x, np.ndarray) and x.dtype == _dtypes.bfloat16):
        raise TypeError(f"expected an Array, a numpy array or a Python scalar, got "
                        f"{type(x).__name__}" + (f" of dtype {x.dtype}" if isinstance(
                            x, np.ndarray) else ""))


def _lift(x, place=None) -> Array:
    """Arrays pass through; numpy arrays and scalars are placed (replicated) on ``place``."""
    if isinstance(x, Array):
        x._check_alive()
        if x._dtype is not _DT_F32 and x._dtype != np.float32:
            raise TypeError(f"ctrainstate ops compute in float32; got an Array of {x.dtype}")
        return x
    _check_host_operand(x)
    if place is None:
        place = get_mesh()
    if place is None:
        place = local_devices()[0]
    return _place_host(x, place)


def _place_host(x, place) -> Array:
    """The numpy array or scalar ``x`` as a float32 Array replicated on ``place``."""
    arr = np.asarray(x, dtype=np.float32)
    if isinstance(place, Device):
        return device_put(arr, SingleDeviceSharding(place))
    return device_put(arr, NamedSharding(place, PartitionSpec()))


def _lift_any(x, place=None) -> Array:
    """As :func:`_lift`, for ops that move bytes (layout ops): an Array of any dtype passes
    through, a host value is placed with its own (canonical) dtype."""
    if isinstance(x, Array):
        x._check_alive()
        return x
    _check_host_operand(x)
    arr = np.asarray(x)
    if arr.dtype not in _dtypes.SUPPORTED:
        arr = arr.astype(_dtypes.canonicalize(arr.dtype))
    if arr.dtype == np.float32:
        return _lift(arr, place)
    if place is None:
        place = get_mesh()
    if place is None:
        return device_put(arr, SingleDeviceSharding(local_devices()[0]))
    if isinstance(place, Device):
        return device_put(arr, SingleDeviceSharding(place))
    return device_put(arr, NamedSharding(place, PartitionSpec()))


def _new(shape, place, norm, dtype=_dtypes.float32) -> Array:
    """Allocate an output Array (uninitialised buffers): a block per device of this process
    (every device, in a job of one process), in mesh order, as the operands' blocks are."""
    sharding = _sharding_for(place, norm)
    shard_shape, layout = sharding._addressable_layout(tuple(shape))
    code = _dtypes.code(dtype)
    blocks = [(dev, _C.Buffer(dev.id, shard_shape, code), start, rid) for dev, start, rid in layout]
    return Array._create(tuple(shape), np.dtype(dtype), sharding, blocks)


def _bufs(a: Array) -> list:
    return [b for _, b, _, _ in a._blocks]


def _place_of(a: Array):
    s = a.sharding
    return s.mesh if isinstance(s, NamedSharding) else s.device


def _host_value(a) -> np.ndarray:
    """The whole value of ``a`` on the host. An Array sharded over processes is gathered to
    every process (a collective: every process calls this, as every one computes the same
    result from it)."""
    if isinstance(a, Array) and not (a.is_fully_addressable or a.sharding.is_fully_replicated):
        return _upper('distributed')._gather_global(a)
    return np.asarray(a)


# _allreduce's device groups by (mesh, axes) (_id_cached)
_AR_GROUPS: dict = {}


def _allreduce_groups(mesh, axes) -> list:
    """The positions (in the mesh's device order) of each group of devices that differ only
    in mesh ``axes``; [] when every group is one device (nothing to reduce)."""
    names = mesh.axis_names
    idx = [names.index(x) for x in axes]
    shape = mesh.devices.shape
    groups: dict = {}
    for pos in range(mesh.size):
        coord = np.unravel_index(pos, shape)
        gkey = tuple(c for i, c in enumerate(coord) if i not in idx)
        groups.setdefault(gkey, []).append(pos)
    return [] if all(len(g) == 1 for g in groups.values()) else list(groups.values())


def _allreduce(a: Array, axes: Sequence[str], op: int = _RED_SUM):
    """Sum (or max) ``a``'s shards over the devices that differ only in mesh ``axes`` (in place)."""
    axes = tuple(axes)
    if not axes or not isinstance(a.sharding, NamedSharding):
        return
    mesh = a.sharding.mesh
    groups = _id_cached(_AR_GROUPS, (id(mesh), axes), mesh, None, _allreduce_groups, mesh, axes)
    if not groups:
        return
    bufs = _bufs(a)
    if not a._sharding.is_fully_addressable:
        _allreduce_processes(a, mesh, groups, op)
        return
    _C.op_allreduce([[bufs[p] for p in g] for g in groups], op)


def _allreduce_processes(a: Array, mesh, groups, op: int, inside=None) -> None:
    """:func:`_allreduce` of an Array over a mesh of several processes, whose blocks here
    are this process's, in mesh order. Every process of the job calls it (as it runs every
    op). A group within one process is reduced by the device all-reduce (or by
    ``inside(groups of buffers)``: the typed reductions' combine); the groups that span
    processes by every process at once: their members' blocks are gathered from their
    processes (one host all-gather for all such groups, ``distributed._allgather_padded``)
    and combined in group order as the device all-reduce combines them (element by
    element: the first member's value, then each next one's), so each member gets the bits
    of the one-process run on the same mesh. float32 blocks combine as the float kernel
    (max keeps NaN); integer and bool blocks as the typed kernels (wrapping sums, maxima),
    which are exact in any order."""
    bufs = _bufs(a)
    devs = list(mesh.devices.flat)
    local = {p: i for i, p in enumerate(p for p, d in enumerate(devs) if d._is_local())}
    inside_groups = [g for g in groups if all(p in local for p in g)]
    if inside_groups:
        grouped = [[bufs[local[p]] for p in g] for g in inside_groups]
        if inside is None:
            _C.op_allreduce(grouped, op)
        else:
            inside(grouped)
    spans = [g for g in groups if len({devs[p].process_index for p in g}) > 1]
    if spans and a.dtype == np.float32 and all(devs[p].platform == "gpu" for g in spans for p in g):
        spans = _allreduce_nccl_processes(spans, devs, bufs, local, op)
    if not spans:
        return
    dt = np.dtype(a.dtype)
    shard_shape = tuple(a._shard_shape)
    nb = int(np.prod(shard_shape, dtype=np.int64)) * dt.itemsize
    # each process sends its members of the spanning groups, group by group, in mesh order
    sends = [[(gi, p) for gi, g in enumerate(spans) for p in g if devs[p].process_index == q]
             for q in range(_devices_process["count"])]
    me = _devices_process["index"]
    mine = [_host_block(bufs[local[p]], shard_shape, dt).reshape(-1).view(np.uint8)
            for _, p in sends[me]]
    payload = np.concatenate(mine) if mine else np.zeros(0, np.uint8)
    got = _upper('distributed')._allgather_padded(payload, [len(v) * nb for v in sends])
    blocks = {key: got[q][k * nb:(k + 1) * nb].view(dt)
              for q in range(len(sends)) for k, key in enumerate(sends[q])}
    for gi, g in enumerate(spans):
        here = [p for p in g if p in local]
        if not here:
            continue
        acc = blocks[(gi, g[0])].copy()
        for p in g[1:]:
            v = blocks[(gi, p)]
            if op == _RED_SUM:
                acc += v     # integers wrap, as the typed kernel's sum
            elif dt.kind == "f":   # ct_red_combine's max: (acc > v or acc is NaN) ? acc : v
                acc = np.where((acc > v) | np.isnan(acc), acc, v)
            else:
                acc = np.maximum(acc, v)
        acc = acc.reshape(shard_shape)
        for p in here:
            _C.copy_from_host(bufs[local[p]], acc, (0,) * len(shard_shape))


# NCCL across processes (_allreduce_nccl_processes): "ok" whether every process can (None:
# not asked yet), "why" this process's reason when not, "ordinals" each GPU device's physical
# GPU (global device id -> ordinal, every process's), "ids" the unique id of each ordered set
# of (process, GPU); "comms" and "allreduces" count what ran here (tests read them through
# nccl_process_stats()).
_NCCL_PROCS: dict = {"ok": None, "why": "", "ordinals": {}, "ids": {}, "comms": 0,
                     "allreduces": 0}


def nccl_process_stats() -> dict:
    """What the NCCL engine across processes did in this process: ``available`` (None until
    a float32 all-reduce over GPU blocks of several processes asked), ``why`` (the reason when
    not), ``communicators`` (unique ids made or received) and ``allreduces`` (group
    all-reduces this process took part in)."""
    st = _NCCL_PROCS
    return {"available": st["ok"], "why": st["why"], "communicators": st["comms"],
            "allreduces": st["allreduces"]}


def _nccl_processes_ok(probe_buf) -> bool:
    """Whether every process can all-reduce through NCCL across processes: asked once per
    job, by every process together (one host all-gather, which also shares each process's
    GPU devices' physical GPUs). Off in every process where CTRAINSTATE_NO_NCCL=1 is set in
    any (each process then gathers through the host, as they must agree)."""
    st = _NCCL_PROCS
    if st["ok"] is not None:
        return st["ok"]
    ok, why = 1, ""
    if os.environ.get("CTRAINSTATE_NO_NCCL", "") not in ("", "0"):
        ok, why = 0, "CTRAINSTATE_NO_NCCL is set"
    elif probe_buf is None:
        ok, why = 0, "this process has no GPU block to ask its backend with"
    else:
        try:
            if _C.op_nccl_unique_id(probe_buf) is None:
                ok, why = 0, "the GPU backend has no NCCL across processes"
        except Exception as e:   # NCCL missing, or lacking ncclCommInitRank: say which
            ok, why = 0, str(e)
    mine = [ok]
    for d in local_devices():
        if d.platform == "gpu":
            mine += [d.id, _C.device_ordinal(d.id)]
    mine = np.asarray(mine, np.int64).view(np.uint8)
    n = _devices_process["count"]
    dist = _upper('distributed')
    sizes = [int(v) for v in dist.allgather(np.asarray([mine.size], np.int64))[:, 0]]
    got = dist._allgather_padded(mine, sizes)
    every = True
    for q in range(n):
        v = np.asarray(got[q]).view(np.int64)
        every = every and bool(v[0])
        for i in range(1, len(v) - 1, 2):
            st["ordinals"][int(v[i])] = int(v[i + 1])
    if ok and not every:
        why = "another process cannot"
    st["ok"], st["why"] = every, why
    return every


def _allreduce_nccl_processes(spans, devs, bufs, local, op) -> list:
    """All-reduce the float32 groups ``spans`` (positions in the mesh's device order, every
    member a GPU device) that span processes through NCCL communicators across processes,
    every process calling it together; the groups left for the host path ([] when NCCL ran
    them all). A group's communicator has a rank per distinct GPU of the group, in order of
    first appearance; the process holding rank 0 makes its unique id and broadcasts it
    through the MPI engine, once per ordered set of GPUs. The logical devices of one GPU are
    combined on it first, then the GPUs in rank order (NCCL's own order: see the README)."""
    probe = next((bufs[local[p]] for g in spans for p in g if p in local), None)
    if not _nccl_processes_ok(probe):
        return spans
    st = _NCCL_PROCS
    me = _devices_process["index"]
    for g in spans:
        gpus, rank = [], {}
        for p in g:
            key = (devs[p].process_index, st["ordinals"][devs[p].id])
            if key not in gpus:
                gpus.append(key)
            rank[p] = gpus.index(key)
        gpus = tuple(gpus)
        uid = st["ids"].get(gpus)
        if uid is None:
            root = gpus[0][0]
            if me == root:
                lead = next(p for p in g if rank[p] == 0)
                uid = _C.op_nccl_unique_id(bufs[local[lead]])
            buf = np.frombuffer(uid, np.uint8).copy() if me == root else np.zeros(128, np.uint8)
            uid = _upper('distributed').broadcast(buf, root).tobytes()
            st["ids"][gpus] = uid
            st["comms"] += 1
        here = [p for p in g if p in local]
        if here:
            _C.op_allreduce_ranks([bufs[local[p]] for p in here], op, uid, len(gpus),
                                  [rank[p] for p in here])
            st["allreduces"] += 1
    return []


def _host_block(buf, shard_shape, dtype=np.float32) -> np.ndarray:
    """A block's values on the host (a copy)."""
    out = np.empty(shard_shape, dtype)
    _C.copy_to_host(buf, out, (0,) * len(shard_shape))
    return out


def _axes_used(norm) -> set:
    return {x for e in norm for x in e}


# --- elementwise ---------------------------------------------------------------------------

def _unary_raw(op, x: Array, alpha=0.0, beta=0.0) -> Array:
    out = _new(x.shape, _place_of(x), _norm(x.sharding, x.ndim))
    _C.op_unary(op, float(alpha), float(beta), _bufs(x), _bufs(out))
    return out


def _unary(op, x, alpha=0.0, beta=0.0, vjp=None) -> Array:
    x = _lift(x)
    out = _unary_raw(op, x, alpha, beta)
    if vjp is not None:
        _record(out, (x,), lambda g: (vjp(g, x, out),))
    return out


def _bcast_shape(a, b):
    try:
        return tuple(np.broadcast_shapes(tuple(a), tuple(b)))
    except ValueError:
        raise ValueError(f"shapes {tuple(a)} and {tuple(b)} do not broadcast") from None


def _binary_raw(op, a: Array, b: Array) -> Array:
    place, shape, out, a2, b2 = _binary_layout(a, b)
    res = _new(shape, place, out)
    _C.op_binary(op, _bufs(res), _bufs(a2), _bufs(b2))
    return res


# _binary_layout's plans by (shapes, sharding objects) (_id_cached)
_BIN_LAYOUTS: dict = {}


def _binary_layout(a: Array, b: Array):
    """Where an elementwise op on ``a`` and ``b`` runs: (placement, broadcast shape, the
    output's per-dimension mesh axes, a and b resharded to match them where needed)."""
    sa, sb = a._sharding, b._sharding
    place, shape, out, want_a, want_b, stay_a, stay_b = _id_cached(
        _BIN_LAYOUTS, (a._shape, b._shape, id(sa), id(sb)), sa, sb, _binary_plan, a, b)
    return (place, shape, out, a if stay_a else _to(a, place, want_a),
            b if stay_b else _to(b, place, want_b))


def _binary_plan(a: Array, b: Array):
    """_binary_layout's part that depends only on the shapes and shardings: (placement,
    broadcast shape, output axes, the axes a and b must have, whether each has them)."""
    place = _common_placement([a, b])
    shape = _bcast_shape(a.shape, b.shape)
    nd = len(shape)
    an = _norm(a.sharding, a.ndim) if _mesh_key(a)[0] == "mesh" else [()] * a.ndim
    bn = _norm(b.sharding, b.ndim) if _mesh_key(b)[0] == "mesh" else [()] * b.ndim
    # Output axes: the first operand's where its dimension is not broadcast, else the second's;
    # an axis is used once.
    out = [()] * nd
    used: set = set()
    for d in range(nd):
        da, db = d - (nd - a.ndim), d - (nd - b.ndim)
        cand = []
        if da >= 0 and a.shape[da] == shape[d]:
            cand.append(an[da])
        if db >= 0 and b.shape[db] == shape[d]:
            cand.append(bn[db])
        for c in cand:
            if c and not (set(c) & used):
                out[d] = tuple(c)
                used |= set(c)
                break
    if isinstance(place, Device):
        out = [()] * nd

    def want(x):
        off = nd - x.ndim
        return tuple(out[d + off] if x.shape[d] == shape[d + off] else () for d in range(x.ndim))

    wa, wb = want(a), want(b)
    return place, tuple(shape), tuple(out), wa, wb, _stays(a, place, wa), _stays(b, place, wb)


def _unbroadcast(g: Array, shape: tuple) -> Array:
    """Sum ``g`` down to ``shape`` (the vjp of broadcasting)."""
    if type(shape) is not tuple:
        shape = tuple(shape)
    gshape = g.shape
    if gshape == shape:
        return g
    key = (gshape, shape)
    axes = _UNBROADCAST_AXES.get(key)
    if axes is None:
        lead = len(gshape) - len(shape)
        axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape)
                                          if s == 1 and gshape[lead + i] != 1)
        if len(_UNBROADCAST_AXES) >= 1024:
            _UNBROADCAST_AXES.clear()
        _UNBROADCAST_AXES[key] = axes
    r = sum(g, axis=axes, keepdims=False)
    return r if r.shape == shape else reshape(r, shape)


# the summed axes of _unbroadcast per (cotangent shape, operand shape)
_UNBROADCAST_AXES: dict = {}


def _lift_pair(a, b):
    """Both operands as Arrays; non-Arrays go where the (last) Array operand lives."""
    place = None
    for v in (a, b):
        if isinstance(v, Array):
            place = _place_of(v)
    return _lift(a, place), _lift(b, place)


def _binary(op, a, b, vjp_a=None, vjp_b=None) -> Array:
    pair = _with_const(a, b)    # a float32 Array and a Python scalar: the scalar's kept Array
    a, b = _lift_pair(a, b) if pair is None else pair
    out = _binary_raw(op, a, b)
    if vjp_a is not None or vjp_b is not None:
        def vjp(g):
            ga = _unbroadcast(vjp_a(g, a, b, out), a.shape) if vjp_a else None
            gb = _unbroadcast(vjp_b(g, a, b, out), b.shape) if vjp_b else None
            return ga, gb
        _record(out, (a, b), vjp)
    return out


def _is_scalar(x):
    return isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, bool)


# the derivatives of the binary ops: (g, a, b, out) -> the cotangent of one operand (before
# un-broadcasting), and of their scalar forms (g, x, out) -> x's cotangent; shared by the
# Python ops and the C path's tape records (_BINARY_VJPS)
def _d_pass(g, *_):
    return g


def _d_neg(g, *_):
    return negative(g)


def _d_mul_a(g, x, y, o):
    return multiply(g, y)


def _d_mul_b(g, x, y, o):
    return multiply(g, x)


def _d_div_a(g, x, y, o):
    return divide(g, y)


def _d_div_b(g, x, y, o):
    return negative(multiply(g, divide(o, y)))


def _d_rdiv(g, x, y):   # s / x (y: the output)
    return multiply(g, multiply(y, divide(-1.0, x)))


def _d_max_a(g, x, y, o):
    return multiply(g, _share(x, y))


def _d_max_b(g, x, y, o):
    return multiply(g, _share(y, x))


def add(a, b) -> Array:
    """Elementwise ``a + b`` with numpy broadcasting."""
    if _is_scalar(b) and isinstance(a, Array):
        return _unary(U_AFFINE, a, 1.0, float(b), vjp=_d_pass)
    if _is_scalar(a) and isinstance(b, Array):
        return add(b, a)
    return _binary(B_ADD, a, b, _d_pass, _d_pass)


def subtract(a, b) -> Array:
    """Elementwise ``a - b``."""
    if _is_scalar(b) and isinstance(a, Array):
        return _unary(U_AFFINE, a, 1.0, -float(b), vjp=_d_pass)
    if _is_scalar(a) and isinstance(b, Array):
        return _unary(U_AFFINE, b, -1.0, float(a), vjp=_d_neg)
    return _binary(B_SUB, a, b, _d_pass, _d_neg)


def multiply(a, b) -> Array:
    """Elementwise ``a * b``."""
    if _is_scalar(b) and isinstance(a, Array):
        s = float(b)
        if s == 0.0:   # x * ±0 keeps NaN and inf * 0 = NaN: the multiply kernel, not a fill
            return _binary(B_MUL, a, _lift(s, _place_of(a)),
                           lambda g, x, y, o: multiply(g, s), None)
        # s*x + (-0.0) is s*x exactly, a -0.0 product included (+0.0 would turn it positive)
        return _unary(U_AFFINE, a, s, -0.0, vjp=lambda g, x, y: multiply(g, s))
    if _is_scalar(a) and isinstance(b, Array):
        return multiply(b, a)
    return _binary(B_MUL, a, b, _d_mul_a, _d_mul_b)


def divide(a, b) -> Array:
    """Elementwise ``a / b``."""
    if _is_scalar(b) and isinstance(a, Array):
        s = float(b)   # (x / ±0.0 is x * ±inf: ±inf, or NaN for 0 and NaN, as jax)
        return multiply(a, 1.0 / s if s != 0.0 else math.copysign(math.inf, s))
    if _is_scalar(a) and isinstance(b, Array):
        s = float(a)
        return _unary(U_RDIV, b, s, 0.0, vjp=_d_rdiv)
    return _binary(B_DIV, a, b, _d_div_a, _d_div_b)


def _share(x: Array, y: Array) -> Array:
    """1 where ``x > y``, 0.5 where they are equal, 0 where ``x < y`` or either is NaN: jax's
    split of the gradient of maximum/minimum (``lax.max``'s ``_balanced_eq``: an operand
    equal to the output gets 1, halved when the other equals it too; a NaN output equals
    neither). Raw, not recorded: ``(x > y) - (y > x) + (neither is NaN)``, halved."""
    d = _binary_raw(B_SUB, _binary_raw(B_GT, x, y), _binary_raw(B_GT, y, x))
    place = _place_of(x)
    inf = _lift(np.asarray(np.inf, x.dtype), place)
    zero = _lift(np.asarray(0.0, x.dtype), place)
    # min(x, y, 0) is NaN where either is, else at most 0 < inf
    ok = _binary_raw(B_GT, inf, _binary_raw(B_MIN, _binary_raw(B_MIN, x, y), zero))
    return _unary_raw(U_AFFINE, _binary_raw(B_ADD, d, ok), 0.5, 0.0)


def maximum(a, b) -> Array:
    """Elementwise maximum, a NaN on either side giving NaN (``jnp.maximum``); the gradient
    goes to the larger operand, split 0.5 / 0.5 at ties, and nowhere where the output is NaN,
    as in jax."""
    pair = _with_const(a, b)
    if pair is not None:        # a float32 Array and a Python scalar: the two-Array C plan
        return globals()["maximum"](*pair)
    return _binary(B_MAX, a, b, _d_max_a, _d_max_b)


def minimum(a, b) -> Array:
    """Elementwise minimum, a NaN on either side giving NaN (``jnp.minimum``); the gradient
    goes to the smaller operand, split 0.5 / 0.5 at ties, and nowhere where the output is NaN,
    as in jax."""
    pair = _with_const(a, b)
    if pair is not None:
        return globals()["minimum"](*pair)
    return _binary(B_MIN, a, b, _d_max_b, _d_max_a)


# The 0-d float32 Arrays that _lift makes of Python scalars beside float32 Arrays, kept per
# (placement, value): an op of an Array and a Python scalar that has no scalar kernel
# (maximum(x, 0.0), clip) then runs the C plan of two Arrays -- the same kernel and
# broadcast as the Python op's, so the same bits, shape, sharding and gradient -- instead of
# placing the scalar again at every call (~8 us, more than the op). Bounded; never a NaN (no
# key equals it), never while a jit trace records (an Array made there is a value of the
# program). The Arrays are the library's own: their users (maximum, minimum, the Python
# binary ops' _binary, where's mask) compute a new Array from them and never hand one out, so
# no caller deletes or donates one; a tape node may hold one as an untracked input, as it
# holds any operand.
_CONSTS: dict = {}
_CONSTS_MAX = 256


def _with_const(a, b):
    """``(a, b)`` with the Python scalar among them (int or float, not bool) replaced by its
    kept 0-d Array (:func:`_lift`'s, beside the other, a float32 Array), or None where the
    Python op runs as it is: other operands, a NaN, a trace recording. A scalar _lift
    refuses raises its error."""
    if type(a) is Array:
        x, s, left = a, b, False
    elif type(b) is Array:
        x, s, left = b, a, True
    else:
        return None
    ts = type(s)
    if (ts is not float and ts is not int) or x._dtype is not _DT_F32 or s != s:
        return None
    c = _const(s, _place_of(x))
    return (c, x) if left else (x, c)


def kept_constant(cache: dict, limit: int, key, place, make, arg) -> Array:
    """The device constant ``make(arg, place)`` kept in ``cache`` under ``key`` (which holds
    ``id(place)``; the placement is checked by identity, so a new placement at a reused id
    makes a new one), made at its first use; at most ``limit`` kept (the cache is emptied
    when full). While a jit trace records, a new one: an Array made there is a value of the
    program, not kept. The caller never hands the Array out (it computes a new Array from it),
    so no user deletes or donates it; one deleted anyway is made again."""
    if _C.trace_active():
        return make(arg, place)
    hit = cache.get(key)
    if hit is not None and hit[0] is place:
        try:
            hit[1]._check_alive()
            return hit[1]
        except _C.DonatedBufferError:
            pass
    if len(cache) >= limit:
        cache.clear()
    cache[key] = hit = (place, make(arg, place))
    return hit[1]


def _const(s, place) -> Array:
    """The kept 0-d float32 Array of the Python float or int ``s`` (not a NaN) on ``place``
    (what :func:`_place_host` makes of it), made at its first use; while a jit trace records,
    a new one."""
    ts = type(s)
    key = (id(place), ts, s, ts is float and math.copysign(1.0, s) < 0)
    return kept_constant(_CONSTS, _CONSTS_MAX, key, place, _place_host, s)


def _keep(a, mask) -> Array:
    """``a`` where ``mask`` (broadcastable, nonzero = set) is set, else exactly 0 — also where
    ``a`` is inf or NaN: ``lax.select(mask, a, 0)``. Differentiable in ``a`` only; a 16-bit
    float ``a`` keeps its dtype (the selection is exact)."""
    if isinstance(a, Array) and a.dtype in _LOWP:
        return astype(_keep(astype(a, _dtypes.float32), mask), a.dtype)
    return _binary(B_KEEP, a, mask, lambda g, x, m, o: _binary_raw(B_KEEP, g, m))


def _pick(a, mask) -> Array:
    """``a`` where ``mask`` is set, else -0.0: one addend of an exact select. ``x + -0.0`` is
    ``x`` for every ``x``, so ``_pick(x, c) + _pick(y, 1 - c)`` is ``x`` or ``y`` bit for bit,
    a selected -0.0 included (with :func:`_keep`'s +0.0 fill, ``-0.0 + 0.0`` would come back
    +0.0). Differentiable in ``a`` (the gradient is ``g`` where set, 0 elsewhere)."""
    if isinstance(a, Array) and a.dtype in _LOWP:
        return astype(_pick(astype(a, _dtypes.float32), mask), a.dtype)
    return _binary(B_PICK, a, mask, lambda g, x, m, o: _binary_raw(B_KEEP, g, m))


def where(condition, x=None, y=None) -> Array:
    """``jnp.where(condition, x, y)``: ``x`` where ``condition`` is true (nonzero), else ``y``,
    exactly (bit for bit, a -0.0 included; an inf or NaN in the branch not taken does not leak into the result, as with a
    select), all three broadcast together. ``condition`` may be a host array or an Array of
    any dtype (a bool Array is converted block by block). The gradient goes to ``x`` where the condition
    holds and to ``y`` elsewhere.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.where(np.array([True, False]), np.array([1., np.inf], np.float32), 0.0)).tolist()
    [1.0, 0.0]
    """
    if x is None or y is None:
        raise NotImplementedError("where(condition) without x and y returns indices; use "
                                  "numpy.nonzero on a host array")
    if isinstance(condition, Array):
        if condition.dtype in (_dtypes.float32, _dtypes.bfloat16, _dtypes.float16):
            # a float condition is `condition != 0` as jax's (a subnormal counts as zero)
            condition = _elementwise.not_equal(condition, 0)
        if condition.dtype == np.bool_:     # a bool mask Array: exactly 1.0 / 0.0 as float32
            c = _convert_to(condition, _dtypes.float32)
        else:   # an int mask, or != 0 of a float one: 1 where nonzero
            if condition.dtype != np.float32:
                condition = condition.astype(np.float32)
            place = _place_of(condition)
            one = _const(1.0, place)
            c = _binary_raw(B_KEEP, one, condition)
    else:
        c = np.asarray(condition)
        if c.dtype.kind == "f":   # != 0 with float32 subnormals as zero, as jax's
            c32 = c.astype(np.float32)
            c = (c32 != 0) & ~(np.abs(c32) < np.finfo(np.float32).tiny)
        c = c.astype(bool).astype(np.float32)
        place = next((_place_of(v) for v in (x, y) if isinstance(v, Array)), None)
        c = _lift(c, place) if place is not None else _lift(c)
    not_c = subtract(1.0, c)    # (1 - c: exactly 0.0 / 1.0, the affine kernel)
    # a Python number as its kept 0-d Array, as _pick's Python op lifts it (the pick then
    # runs from its C plan: where(mask, x, 0.0))
    if type(x) is not Array and type(c) is Array:
        x = (_with_const(x, c) or (x,))[0]
    if type(y) is not Array and type(c) is Array:
        y = (_with_const(y, not_c) or (y,))[0]
    return add(_pick(x, c), _pick(y, not_c))


def _d_negative(g, x, y):
    return negative(g)


def _vjp_pick(g, out, a, mask):
    """The tape rule of ``_pick(a, mask)`` on the C path (two float32 Arrays): the Python
    op's, ``g`` where the mask is set (un-broadcast to ``a``), nothing for the mask."""
    return (_unbroadcast(_binary_raw(B_KEEP, g, mask), a.shape), None)


def negative(x) -> Array:
    return _unary(U_NEG, x, vjp=_d_negative)


def _d_sin(g, x, y):
    return multiply(g, cos(x))


def sin(x) -> Array:
    return _unary(U_SIN, x, vjp=_d_sin)


def _d_cos(g, x, y):
    return negative(multiply(g, sin(x)))


def cos(x) -> Array:
    return _unary(U_COS, x, vjp=_d_cos)


def _d_tanh(g, x, y):
    return multiply(g, subtract(1.0, square(y)))


def tanh(x) -> Array:
    return _unary(U_TANH, x, vjp=_d_tanh)


def _d_relu(g, x, y):
    return multiply(g, _unary_raw(U_STEP, x))


def relu(x) -> Array:
    return _unary(U_RELU, x, vjp=_d_relu)


def _d_gelu(g, x, y):
    return multiply(g, _unary_raw(U_GELU_GRAD, x))


def gelu(x, approximate: bool = True) -> Array:
    """GELU (``jax.nn.gelu``, ``flax.linen.gelu``). ``approximate=True`` (their default): the
    tanh approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x**3)))``, one kernel;
    ``approximate=False``: the exact ``0.5 x erfc(-x / sqrt(2))``, jax's formula (erfc keeps
    the relative accuracy for large negative x), composed from differentiable ops."""
    if approximate:
        return _unary(U_GELU, x, vjp=_d_gelu)
    x = _lift(x)
    place = _place_of(x)
    half = _lift(np.float32(0.5), place)
    sqrt_half = _lift(np.float32(np.sqrt(0.5)), place)
    return multiply(multiply(half, x), erfc(multiply(negative(x), sqrt_half)))


def _d_exp(g, x, y):
    return multiply(g, y)


def exp(x) -> Array:
    return _unary(U_EXP, x, vjp=_d_exp)


def _d_log(g, x, y):
    return divide(g, x)


def log(x) -> Array:
    return _unary(U_LOG, x, vjp=_d_log)


def _d_sqrt(g, x, y):
    return divide(multiply(g, 0.5), y)


def sqrt(x) -> Array:
    return _unary(U_SQRT, x, vjp=_d_sqrt)


def _d_rsqrt(g, x, y):
    return multiply(g, multiply(_unary_raw(U_POW, y, 3.0), -0.5))


def rsqrt(x) -> Array:
    return _unary(U_RSQRT, x, vjp=_d_rsqrt)


def _d_square(g, x, y):
    return multiply(g, multiply(x, 2.0))


def square(x) -> Array:
    return _unary(U_SQUARE, x, vjp=_d_square)


def _d_sigmoid(g, x, y):
    return multiply(g, multiply(y, subtract(1.0, y)))


def sigmoid(x) -> Array:
    return _unary(U_SIGMOID, x, vjp=_d_sigmoid)


def _d_abs(g, x, y):
    neg = _binary_raw(B_GT, _lift(0.0, _place_of(x)), x)       # 1 where x < 0
    return multiply(g, _unary_raw(U_AFFINE, neg, -2.0, 1.0))   # 1 - 2 [x < 0]


def abs(x) -> Array:  # noqa: A001 - numpy's name
    """``|x|``. Gradient as jax's: ``g`` where ``x >= 0`` (so 1 at 0 and -0.0, not 0), ``-g``
    where ``x < 0``."""
    return _unary(U_ABS, x, vjp=_d_abs)


def power(x, p) -> Array:
    """``x ** p`` (``jnp.power``), elementwise with broadcasting; ``p`` a scalar or an array.
    Gradients: ``p * x ** (p - 1)`` for ``x`` and ``log(x) * x ** p`` for an array ``p``,
    as jax's, except at the points where jax's formula gives NaN: the ``x`` gradient is 0
    where ``p == 0`` (jax: NaN at ``x == 0``) and the ``p`` gradient 0 where ``x == 0``."""
    if isinstance(p, (int, np.integer)) and not isinstance(p, (bool, np.bool_)):
        return _integer_pow(x, int(p))
    if _is_scalar(p):
        p = float(p)
        return _unary(U_POW, x, p, vjp=lambda g, x, y: multiply(g, multiply(_unary_raw(U_POW, x, p - 1.0), p)))
    if isinstance(p, bool) or (not isinstance(p, Array) and np.asarray(p).dtype == np.bool_):
        raise TypeError("power: a boolean exponent is not supported")

    def vjp_x(g, x, y, o):
        jac = multiply(y, _binary_raw(B_POW, x, _binary_raw(B_SUB, y, _lift(1.0, _place_of(y)))))
        return multiply(g, _keep(jac, _nonzero(y)))

    def vjp_y(g, x, y, o):
        safe = _binary_raw(B_ADD, x, _is_zero(x))          # 1 where x == 0, else x exactly
        return multiply(g, multiply(o, _unary_raw(U_LOG, safe)))
    return _binary(B_POW, x, p, vjp_x, vjp_y)


def _integer_pow_raw(x: Array, n: int) -> Array:
    """``x ** n`` for an integer n as ``jax.lax.integer_pow`` computes it: 1 for n == 0,
    else products by repeated squaring (the low bits of |n| first), then 1 / that for n < 0.
    A bfloat16 / float16 ``x`` stays in its dtype: each product is a float32 product rounded
    to it, as jax's integer_pow rounds every step. No tape entry."""
    lowp = x.dtype != np.float32
    f32 = _dtypes.float32

    def wide(v):
        return _convert(v, f32) if lowp else v

    def rounded(v):
        return _convert(v, x.dtype) if lowp else v

    if n == 0:
        return rounded(_unary_raw(U_AFFINE, wide(x), 0.0, 1.0))   # ones, NaN included (jax: full_like)
    m, acc, base = (n if n > 0 else -n), None, x  # (this module defines its own abs)
    while m > 0:
        if m & 1:
            acc = base if acc is None else rounded(_binary_raw(B_MUL, wide(acc), wide(base)))
        m >>= 1
        if m > 0:
            base = rounded(_binary_raw(B_MUL, wide(base), wide(base)))
    if acc is x:
        acc = _copy(x)                                    # x itself, a new Array
    return rounded(_unary_raw(U_RDIV, wide(acc), 1.0)) if n < 0 else acc


def _integer_pow(x, n: int) -> Array:
    """``jnp.power(x, n)`` with a Python / numpy integer n: ``lax.integer_pow``'s values and
    gradient ``g * (n * x ** (n - 1))`` (zero for n == 0). A bfloat16 / float16 Array (from
    :func:`power`'s 16-bit path) keeps its dtype through every step, the gradient's products
    included."""
    lowp = isinstance(x, Array) and x.dtype in _LOWP
    x = x if lowp else _lift(x)
    out = _integer_pow_raw(x, n)

    def vjp(g):
        if g.dtype != x.dtype:
            g = _convert(g, x.dtype)
        if n == 0:
            z = _unary_raw(U_AFFINE, _convert(g, _dtypes.float32) if lowp else g, 0.0, 0.0)
            return (_convert(z, x.dtype) if lowp else z,)
        return (multiply(g, multiply(float(n), _integer_pow_raw(x, n - 1))),)
    _record(out, (x,), vjp)
    return out


def _is_zero(x: Array) -> Array:
    """1.0 where ``x == 0`` (either sign; NaN is not 0 but the sum stays NaN), else 0.0."""
    z = _lift(0.0, _place_of(x))
    nz = _binary_raw(B_ADD, _binary_raw(B_GT, x, z), _binary_raw(B_GT, z, x))
    return _unary_raw(U_AFFINE, nz, -1.0, 1.0)


def _nonzero(x: Array) -> Array:
    """1.0 where ``x != 0`` (NaN included), else 0.0: a mask for :func:`_keep`."""
    return _unary_raw(U_AFFINE, _is_zero(x), -1.0, 1.0)


# --- float functions of jax.numpy / jax.lax (ABI 6 kernels) --------------------------------
# log1p, expm1, erf and erfc run each backend's libm (glibc on CPUs, CUDA's device math on
# GPUs: CUDA documents log1pf and expm1f within 1 ulp of the correctly rounded value, erff 2
# and erfcf 4; glibc's are within 2 on the tests' points; so CPU and GPU bits may differ by a
# few ulps); floor, ceil, round, trunc and sign are exact and give the same bits on every
# backend (the roundings return a NaN input quietened). The roundings and sign have a zero
# gradient, as in jax.

_TWO_OVER_SQRT_PI = 1.1283791670955126


def _d_log1p(g, x, y):
    return divide(g, add(x, 1.0))


def log1p(x) -> Array:
    """``log(1 + x)``, accurate for ``|x|`` near 0 (``jnp.log1p``)."""
    return _unary(U_LOG1P, x, vjp=_d_log1p)


def _d_expm1(g, x, y):
    return multiply(g, add(y, 1.0))


def expm1(x) -> Array:
    """``exp(x) - 1``, accurate for ``|x|`` near 0 (``jnp.expm1``); gradient ``exp(x)``."""
    return _unary(U_EXPM1, x, vjp=_d_expm1)


def _d_erf(g, x, y):
    return multiply( g, multiply(exp(negative(square(x))), _TWO_OVER_SQRT_PI))


def erf(x) -> Array:
    """The error function (``jax.scipy.special.erf`` / ``jax.lax.erf``); gradient
    ``2 / sqrt(pi) * exp(-x**2)``."""
    return _unary(U_ERF, x, vjp=_d_erf)


def _d_erfc(g, x, y):
    return multiply( g, multiply(exp(negative(square(x))), -_TWO_OVER_SQRT_PI))


def erfc(x) -> Array:
    """``1 - erf(x)``, accurate where erf is near 1 (``jax.scipy.special.erfc`` /
    ``jax.lax.erfc``)."""
    return _unary(U_ERFC, x, vjp=_d_erfc)


def _d_zero(g, x, y):
    return _unary_raw(U_AFFINE, g, 0.0, 0.0)


def _zero_grad(op, x) -> Array:
    return _unary(op, x, vjp=_d_zero)


def floor(x) -> Array:
    """The largest integer not above ``x`` (``jnp.floor``; exact; zero gradient)."""
    return _zero_grad(U_FLOOR, x)


def ceil(x) -> Array:
    """The smallest integer not below ``x`` (``jnp.ceil``; exact; zero gradient)."""
    return _zero_grad(U_CEIL, x)


def trunc(x) -> Array:
    """``x`` rounded toward zero (``jnp.trunc``; exact; zero gradient)."""
    return _zero_grad(U_TRUNC, x)


def sign(x) -> Array:
    """-1, 0 or 1 by the sign of ``x`` (``jnp.sign``: ``sign(-0.0)`` is -0.0, NaN stays NaN;
    zero gradient)."""
    return _zero_grad(U_SIGN, x)


def round(x, decimals: int = 0) -> Array:  # noqa: A001 - numpy's name
    """``x`` rounded to ``decimals`` decimal places, halves to even (``jnp.round``: with
    ``decimals`` != 0, ``round(x * 10**decimals) / 10**decimals`` in float32, as jax
    computes it). Zero gradient."""
    d = _int_arg(decimals, "round: decimals")
    if d == 0:
        return _zero_grad(U_ROUND, x)
    x = _lift(x)
    factor = _lift(np.float32(10.0 ** d), _place_of(x))
    r = _unary_raw(U_ROUND, _binary_raw(B_MUL, x, factor))
    out = _binary_raw(B_DIV, r, factor)
    return _record(out, (x,), lambda g: (_unary_raw(U_AFFINE, g, 0.0, 0.0),))


around = round


def _int_arg(v, who: str) -> int:
    if isinstance(v, bool):
        raise TypeError(f"{who} must be an int, got {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{who} must be an int, got {v!r}") from None


def reciprocal(x) -> Array:
    """``1 / x`` (``jnp.reciprocal``); gradient ``-1 / x**2``."""
    return _unary(U_RDIV, x, 1.0, vjp=lambda g, x, y: negative(multiply(g, square(y))))


# --- reductions ----------------------------------------------------------------------------

def _axes(axis, ndim) -> tuple:
    if axis is None:
        return tuple(range(ndim))
    if not isinstance(axis, (tuple, list)):
        try:
            axis = (operator.index(axis),)   # an int, a numpy integer, a 0-d int array
        except TypeError:
            raise TypeError(f"axis must be None, an int or a tuple of ints, got "
                            f"{axis!r}") from None
    out = []
    for a in axis:
        try:
            a = operator.index(a)
        except TypeError:
            raise TypeError(f"axis entries must be ints, got {a!r} in {axis!r}") from None
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of bounds for an array of rank {ndim}")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"repeated axis in {axis}")
    return tuple(sorted(out))


def _reduce_raw(op: int, x: Array, axes: tuple, keepdims: bool = False) -> Array:
    """Reduction ``op`` (_RED_SUM / _RED_MAX) of ``x`` over ``axes`` (kept dims only, or with
    ``keepdims`` size-1 dims in their place), not recorded on the tape: each device reduces
    its block, then an all-reduce with the same op over the mesh axes of the reduced dims."""
    xn = _axes_of(x)
    if keepdims:  # the same elements per device: the reduced dims become 1, unsharded
        kept_shape = [1 if d in axes else s for d, s in enumerate(x.shape)]
        kept_norm = [() if d in axes else xn[d] for d in range(x.ndim)]
    else:
        kept_shape = [s for d, s in enumerate(x.shape) if d not in axes]
        kept_norm = [xn[d] for d in range(x.ndim) if d not in axes]
    out = _new(kept_shape, _place_of(x), kept_norm)
    mask = 0
    for d in axes:
        mask |= 1 << d
    if axes:
        _C.op_reduce(_bufs(x), op, mask, _bufs(out))
    else:
        _C.op_unary(U_AFFINE, 1.0, 0.0, _bufs(x), _bufs(out))
    _allreduce(out, [m for d in axes for m in xn[d]], op)
    return out


def sum(x, axis=None, keepdims: bool = False) -> Array:  # noqa: A001 - numpy's name
    """Sum over ``axis``; a dimension sharded over mesh axes ends in an all-reduce over them."""
    x = _lift(x)
    axes = _axes(axis, x.ndim)
    out = _reduce_raw(_RED_SUM, x, axes)
    in_shape = x.shape
    keep_shape = tuple(1 if d in axes else s for d, s in enumerate(in_shape))
    _record(out, (x,), lambda g: (broadcast_to(reshape(g, keep_shape), in_shape),))
    return reshape(out, keep_shape) if keepdims else out


def _check_nonempty(name, what, x, axes):
    for d in axes:
        if x.shape[d] == 0:
            raise ValueError(f"{name}: zero-size dimension {d} of an array of shape {x.shape} "
                             f"has no {what} (the reduction has no identity)")


def max(x, axis=None, keepdims: bool = False) -> Array:  # noqa: A001 - numpy's name
    """Maximum over ``axis`` (``jnp.max``; a NaN anywhere makes the result NaN). A dimension
    sharded over mesh axes ends in an all-reduce (max) over them. The gradient is ``jax``'s:
    split equally among the elements equal to the maximum.

    >>> import numpy as np, ctrainstate as cts, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.max(cts.device_put(np.array([[1., 5.], [7., 2.]], np.float32)), axis=1)).tolist()
    [5.0, 7.0]
    """
    x = _lift(x)
    axes = _axes(axis, x.ndim)
    _check_nonempty("max", "maximum", x, axes)
    out = _reduce_raw(_RED_MAX, x, axes)
    keep_shape = tuple(1 if d in axes else s for d, s in enumerate(x.shape))
    _record(out, (x,), lambda g: (_max_vjp(g, out, x, axes),))
    return reshape(out, keep_shape) if keepdims else out


def _max_vjp(g, out, x, axes):
    """The cotangent of ``x`` in ``out = max(x, axes)`` (``out`` and ``g`` with or without the
    reduced dimensions kept): ``g`` split equally among the elements equal to the maximum."""
    keep_shape = tuple(1 if d in axes else s for d, s in enumerate(x.shape))
    m = broadcast_to(reshape(out, keep_shape), x.shape)
    # 1 where x equals the maximum (neither is greater), split among the ties
    hit = subtract(1.0, add(_binary_raw(B_GT, m, x), _binary_raw(B_GT, x, m)))
    count = sum(hit, axis=axes, keepdims=True)
    return multiply(broadcast_to(reshape(g, keep_shape), x.shape), divide(hit, count))


def min(x, axis=None, keepdims: bool = False) -> Array:  # noqa: A001 - numpy's name
    """Minimum over ``axis`` (``jnp.min``): ``-max(-x)``, same sharding and gradient rules."""
    x = _lift(x)
    _check_nonempty("min", "minimum", x, _axes(axis, x.ndim))
    return negative(max(negative(x), axis=axis, keepdims=keepdims))


# --- argmax / argmin ---------------------------------------------------------------------------
# Built from the float32 kernels every backend has (max reduction, compare, the KEEP select),
# so it runs on CPU and CUDA devices alike, sharded or not. The first index of the maximum is
# a lexicographic search: the positions equal to the maximum form a mask, and for each digit
# of the position (one per reduced dimension, most significant first) the largest
# ``radix - digit`` among the masked positions gives that digit of the first one, and narrows
# the mask to it. Every value compared is an integer in [1, 2**24]: exact in float32. A
# dimension longer than 2**24 is split into two digits (position // 4096, position % 4096).

_ARG_EXACT = 1 << 24   # float32 holds every integer up to 2**24 exactly: the largest radix
_ARG_BASE = 1 << 12    # the low digit's radix when a dimension is longer than that
_ARG_WHOLE, _ARG_LOW, _ARG_HIGH = 0, 1, 2   # a digit: a dimension's whole index, or its parts
_INT32_MAX = int(np.iinfo(np.int32).max)


def argmax(a, axis=None, keepdims: bool = False) -> Array:
    """Index of the first maximum along ``axis`` (``jnp.argmax``): an int32 Array.

    ``axis=None`` searches the flattened array (a flat index). A NaN counts as the maximum:
    the first NaN's index wins, as in jax and numpy. An empty reduced dimension raises
    ``ValueError``; an out-of-range axis ``numpy.exceptions.AxisError`` (a ``ValueError`` and an
    ``IndexError``). float16/bfloat16/bool/int32/uint32 Arrays and numpy arrays are accepted
    (32-bit integers are compared exactly, as a (high, low) pair of 16-bit halves).

    Sharding: the result has ``a``'s sharding on the kept dimensions; a reduced dimension
    sharded over mesh axes ends in all-reduces (max) over them, and gives the same index as
    on one device. Not differentiable: inside :func:`value_and_grad` the result carries no
    gradient (like jax's integer outputs) and the trace goes on. For float, bool and 8/16-bit
    integer Arrays whose reduced dimensions hold at most 2**24 positions it runs on the
    devices (maxima, comparisons, masks, the int32 conversion: no copy through the host);
    32-bit integers are split into their 16-bit halves on the host, and a longer reduction's
    position is assembled there, block by block.

    >>> import numpy as np, ctrainstate as cts, ctrainstate.numpy as cnp
    >>> x = cts.device_put(np.array([[1., 7., 7.], [np.nan, 2., np.nan]], np.float32))
    >>> np.asarray(cnp.argmax(x, axis=1)).tolist(), int(cnp.argmax(x))
    ([1, 0], 3)
    """
    return _arg_reduce(a, axis, keepdims, "argmax")


def argmin(a, axis=None, keepdims: bool = False) -> Array:
    """Index of the first minimum along ``axis`` (``jnp.argmin``), by :func:`argmax`'s rules
    (a NaN counts as the minimum: the first NaN wins).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.argmin(np.array([[3., -1., -1.], [0., 5., -2.]], np.float32), axis=1)).tolist()
    [1, 2]
    """
    return _arg_reduce(a, axis, keepdims, "argmin")


def _arg_operand(a, name) -> Array:
    """``a`` as an Array: Arrays as they are, host arrays placed like :func:`_lift` places
    them (64-bit types narrowed as jax does without x64)."""
    if isinstance(a, Array):
        a._check_alive()
        return a
    if isinstance(a, ShapeDtypeStruct):
        raise TypeError(f"{name} of a ShapeDtypeStruct outside eval_shape")
    host = np.asarray(a)
    if host.dtype.kind not in "biuf" and host.dtype != _dtypes.bfloat16:
        raise TypeError(f"{name}: expected a real or boolean array, got dtype {host.dtype}")
    host = host.astype(_dtypes.canonicalize(host.dtype), copy=False)
    place = get_mesh()
    if place is None:
        place = local_devices()[0]
    return device_put(host, _sharding_for(place, [()] * host.ndim))


def _arg_axes(axis, ndim: int, name: str) -> tuple:
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{name}: axis must be an int or None, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise _dtypes.AxisError(int(axis), ndim)
    return (int(axis) % ndim,)


def _map_blocks(x: Array, fn) -> Array:
    """A float32 Array with ``x``'s sharding whose every block is ``fn(x's block)``, computed
    on the host one block at a time (dtype conversions the kernels do not have)."""
    zero = (0,) * x.ndim
    blocks = []
    for dev, buf, start, rid in x._blocks:
        host = np.empty(x._shard_shape, x.dtype)
        _C.copy_to_host(buf, host.view(np.uint8) if x.dtype == _dtypes.bool_ else host, zero)
        nb = _C.Buffer(dev.id, x._shard_shape, 0)
        _C.copy_from_host(nb, np.ascontiguousarray(fn(host), np.float32), zero)
        blocks.append((dev, nb, start, rid))
    return Array._create(x.shape, np.float32, x.sharding, blocks)


def _arg_keys(x: Array, negate: bool) -> tuple:
    """float32 Arrays whose lexicographic maximum is ``x``'s maximum (its minimum when
    ``negate``), and whether the first may hold NaNs. After the first, every key is >= 1."""
    dt = x.dtype
    if dt == _dtypes.float32:
        return [_unary_raw(U_NEG, x) if negate else x], True
    sign = -1.0 if negate else 1.0
    if dt in (_dtypes.float16, _dtypes.bfloat16, _dtypes.bool_) or dt in _dtypes.NARROW_INTS:
        # (16-bit ints are exact in float32 too: one key)
        k = _convert_to(x, _dtypes.float32)
        return [_unary_raw(U_NEG, k) if negate else k], dt in (_dtypes.float16, _dtypes.bfloat16)
    if dt in (_dtypes.int32, _dtypes.uint32):
        # v = hi * 65536 + lo with lo in [0, 65535]: both halves are exact in float32
        hi = _map_blocks(x, lambda b: (b.astype(np.int64) >> 16).astype(np.float32) * np.float32(sign))
        lo = _map_blocks(x, lambda b: (65536.0 - (b.astype(np.int64) & 0xFFFF) if negate
                                       else (b.astype(np.int64) & 0xFFFF) + 1.0))
        return [hi, lo], False
    raise TypeError(f"argmax/argmin: unsupported dtype {dt}")


def _arg_reduce(a, axis, keepdims: bool, name: str) -> Array:
    x = _arg_operand(a, name)
    nd = x.ndim
    axes = _arg_axes(axis, nd, name)
    for d in axes:
        if x.shape[d] == 0:
            raise ValueError(f"attempt to get {name} of an empty sequence (dimension {d} of an "
                             f"array of shape {x.shape} has size 0)")
    total = math.prod(x.shape[d] for d in axes)
    if total > _INT32_MAX:
        raise ValueError(f"{name}: {total} positions do not fit the int32 result")
    place = _place_of(x)
    xn = _axes_of(x)
    out_shape = tuple(1 if d in axes else s for d, s in enumerate(x.shape)) if keepdims else \
        tuple(s for d, s in enumerate(x.shape) if d not in axes)
    out_norm = [() if d in axes else xn[d] for d in range(nd)] if keepdims else \
        [xn[d] for d in range(nd) if d not in axes]
    # the digits of a position, least significant first: (dim, part of the index along dim
    # (_ARG_WHOLE, _ARG_LOW, _ARG_HIGH), radix, weight of the digit in the flat index over the
    # reduced dims)
    digits = []
    weight = 1
    for d in reversed(axes):
        n = x.shape[d]
        if n > 1:
            if n <= _ARG_EXACT:
                digits.append((d, _ARG_WHOLE, n, weight))
            else:
                digits.append((d, _ARG_LOW, _ARG_BASE, weight))
                digits.append((d, _ARG_HIGH, -(-n // _ARG_BASE), weight * _ARG_BASE))
        weight *= n
    digits.reverse()
    sharding = _sharding_for(place, out_norm)
    with _no_tape():    # (an int32 position: nothing of it is differentiated)
        found = _arg_found(x, axes, digits, name == "argmin", xn, place) \
            if digits and math.prod(out_shape) else []
        if not found or total > _ARG_EXACT:
            return _arg_assemble(out_shape, sharding, found)
        # sum(weight * (radix - max)) on the devices: every partial sum is an integer below
        # 2**24, exact in float32
        pos = None
        for m, radix, w in found:
            term = multiply(subtract(float(radix), m), float(w))
            pos = term if pos is None else add(pos, term)
        if not keepdims:    # (indexing keeps the kept dimensions' layout, as it is)
            pos = pos[tuple(0 if d in axes else slice(None) for d in range(nd))]
        out = _convert_to(pos, _dtypes.int32)
    if out.sharding != sharding:
        raise RuntimeError(f"internal error: {name}'s result is laid out as {out.sharding}, "
                           f"not {sharding}")
    return out


def _arg_found(x, axes, digits, negate, xn, place) -> list:
    """(the maximum of radix - digit over ``axes``, radix, weight) per digit of the first
    maximum's position (the first minimum's when ``negate``): the keys of :func:`_arg_keys`
    narrow the candidates lexicographically, then each digit of ``digits`` in turn (masked
    to the candidates left, its largest radix - digit is its smallest digit)."""
    keys, may_nan = _arg_keys(x, negate)
    stages = [("key", k) for k in keys] + [("digit", dg) for dg in digits]
    found, mask = [], None
    for si, (kind, item) in enumerate(stages):
        v = item if kind == "key" else _arg_digit(item, x.shape, xn, place)
        if mask is not None:
            # radix - digit (a later key) where set, else 0: both are finite and >= 1, so
            # the product by the 1.0 / 0.0 mask is that select, exactly
            v = multiply(v, _convert_to(mask, _dtypes.float32))
        m = max(v, axis=axes, keepdims=True)
        if kind == "digit":
            found.append((m, item[2], item[3]))
        if si == len(stages) - 1:
            break
        mask = v == m
        if si == 0 and may_nan:
            # a slice holding a NaN has a NaN maximum: its NaNs are the candidates
            mask = mask | ((v != v) & (m != m))
    return found


def _arg_digit(digit, shape, xn, place) -> Array:
    """The float32 values ``radix - digit`` of position digit ``digit`` (dim, part, radix,
    weight) along its dimension, size 1 along the others, laid out as that dimension of the
    operand (``xn``: its mesh axes per dimension) on ``place``: a kept constant."""
    d, part, radix, _ = digit
    key = (id(place), len(shape), d, shape[d], part, tuple(xn[d]))
    return kept_constant(_ARG_DIGITS, _CONSTS_MAX, key, place, _place_digit, (digit, shape, xn))


def _place_digit(arg, place) -> Array:
    (d, part, radix, _), shape, xn = arg
    i = np.arange(shape[d], dtype=np.int64)
    vals = radix - (i if part == _ARG_WHOLE else i % _ARG_BASE if part == _ARG_LOW
                    else i // _ARG_BASE)
    vshape = [1] * len(shape)
    vshape[d] = shape[d]
    vnorm = [()] * len(shape)
    vnorm[d] = xn[d]
    return device_put(vals.astype(np.float32).reshape(vshape), _sharding_for(place, vnorm))


_ARG_DIGITS: dict = {}


def _arg_assemble(shape, sharding, found) -> Array:
    """The int32 Array sum(weight * (radix - max)) over ``found``, one block per device (on
    the host: the kernels write float32 only). ``found``'s Arrays have the same blocks."""
    # this process's blocks only (an Array sharded over processes holds just those)
    shard_shape, layout = sharding._addressable_layout(tuple(shape))
    code = _dtypes.code(_dtypes.int32)
    by_dev = [{b[0]: b[1] for b in m._blocks} for m, _, _ in found]
    blocks = []
    for dev, start, rid in layout:
        acc = np.zeros(shard_shape, np.int64)
        for (m, radix, w), mbufs in zip(found, by_dev):
            mbuf = mbufs.get(dev)
            if mbuf is None:
                raise RuntimeError("internal error: argmax blocks are out of order")
            h = np.empty(m._shard_shape, np.float32)
            _C.copy_to_host(mbuf, h, (0,) * h.ndim)
            acc += (radix - h.astype(np.int64)).reshape(shard_shape) * w
        buf = _C.Buffer(dev.id, shard_shape, code)
        _C.copy_from_host(buf, acc.astype(np.int32), (0,) * len(shard_shape))
        blocks.append((dev, buf, start, rid))
    return Array._create(tuple(shape), _dtypes.int32, sharding, blocks)


def stop_gradient(x):
    """``jax.lax.stop_gradient``: the same values, with no gradient flowing back (a pytree of
    Arrays works leaf by leaf; numpy leaves pass through)."""
    if _tape() is None:  # nothing is being differentiated: the values themselves
        return x
    # inside value_and_grad: an untracked copy (not an alias: it must not see later in-place
    # updates of x's buffers, e.g. by a donating apply_gradients)
    return tree_map(lambda a: _copy(a) if isinstance(a, Array) else a, x)


def mean(x, axis=None, keepdims: bool = False) -> Array:
    """Mean over ``axis`` (NaN over an empty axis: 0 / 0, as ``jnp.mean``)."""
    x = _lift(x)
    axes = _axes(axis, x.ndim)
    n = 1
    for d in axes:
        n *= x.shape[d]
    return multiply(sum(x, axis=axes, keepdims=keepdims), 1.0 / n if n else float("nan"))


def _shape_arg(shape, who: str) -> tuple:
    """A shape argument as a tuple of ints: an int (a 1-D shape), a sequence or a 1-D integer
    array of them (numpy integers included), as jax takes it."""
    if isinstance(shape, np.ndarray) and shape.ndim == 1:
        shape = shape.tolist()
    if not isinstance(shape, (tuple, list)):
        shape = (shape,)
    try:
        return tuple(operator.index(s) for s in shape)
    except TypeError:
        raise TypeError(f"{who}: a shape is an int or a sequence of ints, got "
                        f"{shape!r}") from None


def _check_broadcast_to(xshape, shape) -> None:
    """``jnp.broadcast_to``'s rule: ``shape`` has at least ``xshape``'s rank and each of
    ``xshape``'s trailing-aligned sizes is 1 or ``shape``'s (never a smaller result)."""
    if len(shape) < len(xshape) or builtins.any(
            n != 1 and n != m for n, m in zip(xshape[::-1], shape[::-1])):
        raise ValueError(f"broadcast_to: cannot broadcast an array of shape {tuple(xshape)} "
                         f"to shape {shape}")


def broadcast_to(x, shape) -> Array:
    """Broadcast to ``shape`` (materialised; int and bool Arrays too, see
    :func:`ctrainstate._src.ops.elementwise.int_broadcast_to`)."""
    x = _lift(x)
    shape = _shape_arg(shape, "broadcast_to")
    if x.shape == shape:
        return x
    _check_broadcast_to(x.shape, shape)
    zero = _new(shape, _place_of(x), [()] * len(shape))
    # x + -0.0 is x for every x (-0.0, inf and NaN included): a broadcasting copy, whose
    # output takes x's sharding where x is not broadcast
    _C.op_unary(U_AFFINE, 0.0, -0.0, _bufs(zero), _bufs(zero))
    res = _binary_raw(B_ADD, x, zero)
    _record(res, (x,), lambda g: (_unbroadcast(g, x.shape),))
    return res


# --- layout ops -------------------------------------------------------------------------------

def transpose(x, axes=None) -> Array:
    """Permute dimensions; the spec entries move with them. Any dtype (bytes are moved)."""
    x = _lift_any(x)
    nd = x.ndim
    if axes is None:
        axes = tuple(reversed(range(nd)))
    else:   # as jnp: integers within the rank (no wrapping of (0, 3) into (0, 1))
        try:
            axes = tuple(operator.index(a) for a in axes)
        except TypeError:
            raise TypeError(f"transpose: axes must be a sequence of integers, got {axes!r}") \
                from None
        for a in axes:
            if not -nd <= a < nd:
                raise ValueError(f"transpose: axis {a} is out of bounds for an array of rank {nd}")
        axes = tuple(a % nd for a in axes)
    if sorted(axes) != list(range(nd)):
        raise ValueError(f"transpose: {axes} is not a permutation of the {nd} dimensions")
    xn = _axes_of(x)
    out = _new([x.shape[a] for a in axes], _place_of(x), [xn[a] for a in axes], x.dtype)
    _C.op_transpose(_bufs(x), list(axes), _bufs(out))
    inv = [0] * nd
    for i, a in enumerate(axes):
        inv[a] = i
    return _record(out, (x,), lambda g: (transpose(g, inv),))


def _groups(old, new):
    """Pair dims of two shapes into groups with equal products: [(old_dims, new_dims)]."""
    groups = []
    i = j = 0
    while i < len(old) or j < len(new):
        oi, nj = [i], [j]
        po = old[i] if i < len(old) else 1
        pn = new[j] if j < len(new) else 1
        i += 1
        j += 1
        while po != pn:
            if po < pn:
                if i >= len(old):
                    raise ValueError(f"cannot reshape {tuple(old)} into {tuple(new)}")
                po *= old[i]
                oi.append(i)
                i += 1
            else:
                if j >= len(new):
                    raise ValueError(f"cannot reshape {tuple(old)} into {tuple(new)}")
                pn *= new[j]
                nj.append(j)
                j += 1
        groups.append(([d for d in oi if d < len(old)], [d for d in nj if d < len(new)]))
    return groups


def _reshape_layout(x: Array, shape: tuple, place):
    """``x``'s per-dimension mesh axes, those it keeps before a reshape to ``shape`` (a
    group of merged or split dimensions keeps its sharding when its sharded dimension leads
    it and the new leading dimension divides, size-1 dimensions, which hold no data, not
    counted as leading on either side; any other sharded group is gathered), and the
    result's."""
    nd = x.ndim
    xn = _axes_of(x)
    keep_old = list(xn)
    new_norm = [()] * len(shape)
    sizes = dict(zip(place.axis_names, place.devices.shape)) if not isinstance(place, Device) else {}
    for od, ndims in _groups([s for s in x.shape], list(shape)):
        sharded = [d for d in od if xn[d]]
        ok = False
        if not sharded:
            ok = True
        elif sharded == [next((d for d in od if x.shape[d] != 1), od[0])] and ndims:
            # the group's leading new dimension of more than one element (size-1 ones before
            # it hold no data) takes the sharding when the mesh axes divide it
            lead = next((d for d in ndims if shape[d] != 1), ndims[0])
            axes = xn[sharded[0]]
            if shape[lead] % math.prod(sizes[a] for a in axes) == 0:
                new_norm[lead] = axes
                ok = True
        if not ok:
            for d in od:
                keep_old[d] = ()
    return xn, keep_old, new_norm


def reshape(x, shape) -> Array:
    """Reshape. Sharding is kept where it maps onto whole blocks (a sharded dimension leading
    its merged/split group, with the new leading dimension divisible); otherwise that group is
    gathered first. Any dtype (bytes are moved)."""
    x = _lift_any(x)
    shape = list(_shape_arg(shape, "reshape"))
    if shape.count(-1) > 1:
        raise ValueError("reshape: at most one -1")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if not known:   # numpy's error (jax: ZeroDivisionError): any size would fit
            raise ValueError(f"cannot reshape {x.shape} ({x.size} elements) into "
                             f"{tuple(shape)}: the -1 is ambiguous beside a 0")
        shape[shape.index(-1)] = x.size // known
    if math.prod(shape) != x.size:
        raise ValueError(f"cannot reshape {x.shape} ({x.size} elements) into {tuple(shape)}")
    shape = tuple(shape)
    if shape == x.shape:
        return x
    place = _place_of(x)
    if 0 in shape or 0 in x.shape:
        out = _new(shape, place, [()] * len(shape), x.dtype)
        return out
    xn, keep_old, new_norm = _reshape_layout(x, shape, place)
    src = _to(x, place, keep_old)
    out = _new(shape, place, new_norm, x.dtype)
    for (_, ob, _, _), (_, ib, _, _) in zip(out._blocks, src._blocks):
        _C.copy_bytes(ob, ib)
    in_shape = x.shape
    return _record(out, (x,), lambda g: (reshape(g, in_shape),))


def expand_dims(x, axis) -> Array:
    """Insert size-1 dimensions at ``axis`` (an int or a sequence of ints: positions in the
    result, as ``jnp.expand_dims``); any dtype."""
    x = _lift_any(x)
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    nd = x.ndim + len(axes)
    pos = _axes(tuple(axes), nd)   # normalised, sorted; repeats and out of range refused
    shape = list(x.shape)
    for a in pos:
        shape.insert(a, 1)
    return reshape(x, shape)


def with_sharding(x, sharding) -> Array:
    """Reshard (differentiable: the cotangent goes back to the input's sharding); any dtype."""
    if not isinstance(x, Array):
        x = _lift(x)
    x._check_alive()
    out = _put(x, _as_sharding(sharding))   # (a jit trace: an op node)
    if out is x:
        return x
    src = x.sharding
    return _record(out, (x,), lambda g: (_put(g, src),))


# --- matmul ----------------------------------------------------------------------------------

def matmul(a, b, *, precision=None) -> Array:
    """``a @ b`` for ``a`` of shape (..., M, K) and ``b`` of shape (K, N) or (..., K, N)
    with the same batch dimensions.

    Sharding: batch and M follow ``a``, N follows ``b``; a K sharded on the same mesh axes in
    both needs no communication until the end, where the partial products are all-reduced over
    those axes. Incompatible operand shardings are resharded (the operand whose sharding
    would clash is gathered), never silently wrong.

    ``precision`` (``jnp.matmul``'s): ``None`` (the thread's default, float32 unless
    :func:`ctrainstate.default_matmul_precision` says otherwise), a
    :class:`ctrainstate.lax.Precision`, ``'float32'`` / ``'highest'``, ``'tensorfloat32'`` /
    ``'high'`` (operands rounded to TF32, float32 accumulation), ``'bfloat16'`` (rounded to
    bfloat16), ... — the table is in :mod:`ctrainstate._src.base.precision`. ``Precision.DEFAULT`` is
    full float32 here on every backend, unlike jax on GPUs (TF32). The gradient's products
    use the same precision; each shard's partial product is rounded the same way, so a
    sharded product equals the single-device one up to float32 summation order.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> x = np.array([[1 + 2.0 ** -12, 1.0]], np.float32)
    >>> np.asarray(cnp.matmul(x, np.eye(2, dtype=np.float32), precision='tensorfloat32')).tolist()
    [[1.0, 1.0]]
    """
    return _matmul_nd(a, b, None if precision is None else
                      _resolve_precision(precision, "matmul"))


def _matmul_of(a, b, prec) -> Array:
    """The product of matrices (or a batch) at precision code ``prec`` (None: the thread's
    default): the primitive (its C plan where it has one) at the thread's default precision,
    which is what the primitive's precision=None computes; else :func:`_matmul_nd`."""
    if prec is None or prec == _precision.current_default():
        return matmul(a, b)
    return _matmul_nd(a, b, prec)


def _matmul_nd(a, b, prec) -> Array:
    """:func:`matmul` with a resolved precision code (0 float32, 1 TF32, 2 bfloat16; None:
    the thread's default). A vector operand is a (1, K) / (K, 1) matrix, the product
    reshaped back."""
    if type(a) is not Array or type(b) is not Array:
        a, b = _lift_pair(a, b)
    if a.ndim < 1 or b.ndim < 1:
        raise ValueError("matmul needs arrays of rank >= 1")
    if (a.ndim == 1 or b.ndim == 1) and a.shape[-1] != b.shape[0 if b.ndim == 1 else -2]:
        raise ValueError(f"matmul: contracting dimensions differ: {a.shape} @ {b.shape}")
    if a.ndim == 1 and b.ndim == 1:    # an inner product: a scalar
        return reshape(_matmul_of(reshape(a, (1, a.shape[0])), reshape(b, (b.shape[0], 1)), prec), ())
    if a.ndim == 1:
        return reshape(_matmul_of(reshape(a, (1, a.shape[0])), b, prec), b.shape[:-2] + (b.shape[-1],))
    if b.ndim == 1:
        return reshape(_matmul_of(a, reshape(b, (b.shape[0], 1)), prec), a.shape[:-1])
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul: contracting dimensions differ: {a.shape} @ {b.shape}")
    if b.ndim > 2 and b.shape[:-2] != a.shape[:-2]:
        raise ValueError(f"matmul: batch dimensions differ: {a.shape} @ {b.shape} "
                         f"(b must be 2-d or have a's batch dimensions)")
    return _matmul(a, b, False, False, _resolve_precision(None) if prec is None else prec)


def _tview(norm, shape, t):
    """Spec/shape of the view of a stored 2-d operand (swapped when transposed)."""
    if not t:
        return list(norm), tuple(shape)
    return [norm[1], norm[0]], (shape[1], shape[0])


# _matmul's plans by (shapes, sharding objects, transposes) (_id_cached)
_MM_PLANS: dict = {}


def _matmul_plan(a: Array, b: Array, ta: bool, tb: bool):
    """_matmul's part that depends only on the shapes, shardings and transposes: (placement,
    the axes a and b must have, whether each has them, the output's shape and axes, the
    contracted mesh axes, the GEMM's batch, M, N, K on a shard, whether b is 2-d)."""
    place = _common_placement([a, b])
    mesh = not isinstance(place, Device)
    an = _norm(a.sharding, a.ndim) if mesh and _mesh_key(a)[0] == "mesh" else [()] * a.ndim
    bn = _norm(b.sharding, b.ndim) if mesh and _mesh_key(b)[0] == "mesh" else [()] * b.ndim
    an, ashape = _tview(an, a.shape, ta)
    bn, bshape = _tview(bn, b.shape, tb)
    an, bn = list(an), list(bn)
    # batch dims of a batched b follow a
    if len(bshape) > 2:
        bn[:-2] = an[:-2]
        if set(_axes_used(an[:-2])) & (set(bn[-1]) | set(bn[-2])):
            bn[-1], bn[-2] = (), ()
    aK, bK = tuple(an[-1]), tuple(bn[-2])
    if aK != bK:
        a_other = _axes_used(an[:-1])
        b_other = _axes_used(bn[:-2] + [bn[-1]])
        if aK and not (set(aK) & b_other):
            bn[-2] = aK
        elif bK and not (set(bK) & a_other):
            an[-1] = bK
        else:
            an[-1], bn[-2] = (), ()
    kax = tuple(an[-1])
    # N must not reuse an axis of a's batch/M dims
    if set(bn[-1]) & _axes_used(an[:-1]):
        bn[-1] = ()
    wa = tuple(tuple(e) for e in _tview(an, ashape, ta)[0])
    wb = tuple(tuple(e) for e in _tview(bn, bshape, tb)[0])
    stay_a, stay_b = _stays(a, place, wa), _stays(b, place, wb)
    out_shape = tuple(ashape[:-1]) + (bshape[-1],)
    out_norm = tuple(tuple(e) for e in an[:-1] + [bn[-1]])
    # the operands' shard shapes once they have wa / wb (as _to places them)
    sa = a.sharding if stay_a else _sharding_for(place, wa)
    sb = b.sharding if stay_b else _sharding_for(place, wb)
    a_loc = _tview([()] * a.ndim, sa.shard_shape(a.shape), ta)[1]
    b_loc = _tview([()] * b.ndim, sb.shard_shape(b.shape), tb)[1]
    m_loc, k_loc, n_loc = a_loc[-2], a_loc[-1], b_loc[-1]
    batch = math.prod(a_loc[:-2])
    return (place, wa, wb, stay_a, stay_b, out_shape, out_norm, kax, batch, m_loc, n_loc, k_loc,
            len(bshape) == 2)


def _matmul(a: Array, b: Array, ta: bool, tb: bool, prec: int = 0) -> Array:
    """op(a) @ op(b) where op transposes a stored 2-d operand without materialising it;
    ``prec``: the precision code every shard's GEMM (and the gradient's) runs with."""
    sa, sb = a._sharding, b._sharding
    (place, wa, wb, stay_a, stay_b, out_shape, out_norm, kax, batch, m_loc, n_loc, k_loc,
     b2d) = _id_cached(_MM_PLANS, (a._shape, b._shape, id(sa), id(sb), ta, tb), sa, sb,
                       _matmul_plan, a, b, ta, tb)
    a2 = a if stay_a else _to(a, place, wa)
    b2 = b if stay_b else _to(b, place, wb)
    out = _new(out_shape, place, out_norm)
    _ensure_blas(n_loc, k_loc)
    if b2d:  # fold a's batch into M: one GEMM per shard
        _C.op_matmul(_bufs(a2), _bufs(b2), _bufs(out), 1, batch * m_loc, n_loc, k_loc, 0, 0,
                     int(ta), int(tb), 1.0, 0.0, prec)
    else:
        _C.op_matmul(_bufs(a2), _bufs(b2), _bufs(out), batch, m_loc, n_loc, k_loc,
                     m_loc * k_loc, k_loc * n_loc, int(ta), int(tb), 1.0, 0.0, prec)
    _allreduce(out, kax)
    return _record(out, (a, b), lambda g: _matmul_grads(g, a, b, ta, tb, prec))


def _matmul_grads(g: Array, a: Array, b: Array, ta: bool, tb: bool, prec: int) -> tuple:
    """The cotangents of the stored operands of ``op(a) @ op(b)`` from the output's ``g``:
    d op(a) = g @ op(b)^T, d op(b) = op(a)^T @ g, in the forward's precision."""
    if b.ndim == 2:
        # float32 products with no tape recording run from C plans (_MM_T); a product of
        # another precision, or one recorded, is _matmul's
        mm = ((lambda x, y, t1, t2: _MM_T[t1, t2](x, y)) if prec == _precision_F32
              and _tape() is None else (lambda x, y, t1, t2: _matmul(x, y, t1, t2, prec)))
        # stored a is (K, M) when ta: its gradient is op(b) @ g^T
        ga = mm(g, b, False, not tb) if not ta else mm(b, g, tb, True)
        g2d = reshape(g, (math.prod(g.shape[:-1]), g.shape[-1])) if g.ndim > 2 else g
        a2d = reshape(a, (math.prod(a.shape[:-1]), a.shape[-1])) if a.ndim > 2 else a
        if tb:  # stored b is (N, K): gradient g^T @ op(a)
            gb = mm(g2d, a2d, True, ta)
        else:
            gb = mm(a2d, g2d, not ta, False)
    else:
        ga = _matmul_nd(g, _swap_last(b), prec)
        gb = _matmul_nd(_swap_last(a), g, prec)
    return ga, gb


def take_rows(table, ids) -> Array:
    """``table[ids]``: rows of a 2-d ``table`` (V, E) for integer ``ids`` of any shape, each in
    ``[0, V)`` (checked) — an embedding lookup without a one-hot. The output has shape
    ``ids.shape + (E,)``.

    Sharding: every device gathers, from its own block of the table, the rows of the ids that
    fall in its block (zeros for the others). The output follows the table's E dimension and
    is replicated over the ids' dimensions; a V dimension sharded over mesh axes ends in an
    all-reduce over them (each id's row lives on one shard of the group, so the sum is exact).
    The gradient scatter-adds the cotangent's rows into each device's block (ids in order:
    deterministic).

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> np.asarray(cnp.take_rows(np.arange(6, dtype=np.float32).reshape(3, 2), np.array([2, 0]))).tolist()
    [[4.0, 5.0], [0.0, 1.0]]
    """
    table = _lift(table)
    if table.ndim != 2:
        raise ValueError(f"take_rows: the table must be 2-d (rows, features), got shape {table.shape}")
    idx = np.asarray(ids)
    if not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"take_rows: ids must be integers, got {idx.dtype}")
    nrows, ncols = table.shape
    if idx.size and (idx.min() < 0 or idx.max() >= nrows):
        raise ValueError(f"take_rows: ids must be in [0, {nrows}), got [{idx.min()}, {idx.max()}]")
    place = _place_of(table)
    on_mesh = not isinstance(place, Device) and _mesh_key(table)[0] == "mesh"
    tn = _norm(table.sharding, 2) if on_mesh else [(), ()]
    vax, eax = tuple(tn[0]), tuple(tn[1])
    flat = idx.reshape(-1).astype(np.int32)
    ids_arr = device_put(flat, _sharding_for(place, [()]))  # every device gets every id
    row0s = [int(start[0]) for _, _, start, _ in table._blocks]
    out = _new((flat.size, ncols), place, [(), eax])
    _C.op_gather_rows(_bufs(table), _bufs(ids_arr), _bufs(out), row0s)
    _allreduce(out, vax)

    def vjp(g):
        # the ids grouped by row (a stable sort keeps each row's terms in id order), so the
        # devices add a row's cotangents in that order, rows in parallel: the same bits anywhere
        pos = np.argsort(flat, kind="stable").astype(np.int32)
        hit, first = np.unique(flat[pos], return_index=True)
        plan = np.concatenate([hit.astype(np.int32), first.astype(np.int32),
                               np.array([flat.size], np.int32), pos])
        plan_arr = device_put(plan, _sharding_for(place, [()]))
        g = _to(g, place, [(), eax])
        gt = _new((nrows, ncols), place, [vax, eax])
        _C.op_unary(U_AFFINE, 0.0, 0.0, _bufs(gt), _bufs(gt))  # zeros (alpha 0 ignores x)
        if flat.size and ncols:
            _C.op_scatter_add_rows(_bufs(gt), _bufs(plan_arr), _bufs(g), row0s, int(hit.size))
        return (gt,)
    _record(out, (table,), vjp)
    return reshape(out, idx.shape + (ncols,))


def _swap_last(x: Array) -> Array:
    axes = list(range(x.ndim))
    axes[-1], axes[-2] = axes[-2], axes[-1]
    return transpose(x, axes)


def dot(a, b, *, precision=None) -> Array:
    """``jnp.dot``: :func:`matmul` when ``b`` has at most 2 dimensions; a scalar operand
    multiplies; for an n-d ``b`` (n > 2) the sum over the last axis of ``a`` and the
    second-to-last of ``b``, shape ``a.shape[:-1] + b.shape[:-2] + b.shape[-1:]`` (no batch
    dimensions, unlike ``matmul``), run as :func:`ctrainstate.numpy.tensordot`."""
    na, nb = getattr(a, "ndim", None), getattr(b, "ndim", None)
    na = np.ndim(a) if na is None else na
    nb = np.ndim(b) if nb is None else nb
    if 0 < nb <= 2 and na:
        return matmul(a, b, precision=precision)
    _resolve_precision(precision, "matmul")
    if not na or not nb:
        return multiply(a, b)
    return _upper('numpy').tensordot(a, b, ([na - 1], [nb - 2]), precision=precision)


def einsum(subscripts: str, *operands, precision=None) -> Array:
    """Two-operand einsum (batched-matmul patterns), e.g. ``'bi,ij->bj'``, ``'bqd,bkd->bqk'``.

    Indices in both operands and the output are batch dims, in both but not the output are
    contracted, the rest are free; the product runs as transpose/reshape + :func:`matmul`
    with ``precision`` (as :func:`matmul`'s).
    """
    prec = _resolve_precision(precision, "einsum")
    if not isinstance(subscripts, str):
        raise TypeError(f"einsum: the first argument must be a subscripts string like "
                        f"'ab,bc->ac' (the interleaved operand/sublist form is not supported), "
                        f"got {type(subscripts).__name__}")
    if len(operands) != 2:
        raise NotImplementedError(
            f"einsum takes exactly two operands here, got {len(operands)}: write the "
            f"contraction as a chain of two-operand einsums")
    a, b = operands
    a = _lift(a)
    b = _lift(b, _place_of(a))
    try:
        ins, out = subscripts.replace(" ", "").split("->")
        sa, sb = ins.split(",")
    except ValueError:
        raise ValueError(f"einsum: expected 'ab,bc->ac' style subscripts, got {subscripts!r}") from None
    if len(sa) != a.ndim or len(sb) != b.ndim:
        raise ValueError(f"einsum: {subscripts!r} does not match ranks {a.ndim} and {b.ndim}")
    for s in (sa, sb, out):
        if len(set(s)) != len(s):
            raise ValueError(f"einsum: repeated index within one operand in {subscripts!r}")
    size = {}
    for s, x in ((sa, a), (sb, b)):
        for c, n in zip(s, x.shape):
            if size.setdefault(c, n) != n:
                raise ValueError(f"einsum: index {c!r} has sizes {size[c]} and {n}")
    if set(out) - set(sa) - set(sb):
        raise ValueError(f"einsum: output index not in the inputs: {subscripts!r}")
    batch = [c for c in sa if c in sb and c in out]
    contract = [c for c in sa if c in sb and c not in out]
    fa = [c for c in sa if c not in sb]
    fb = [c for c in sb if c not in sa]
    for c in fa + fb:
        if c not in out:
            raise NotImplementedError(f"einsum: summing a free index ({c!r}) is not supported")
    at = transpose(a, [sa.index(c) for c in batch + fa + contract])
    bt = transpose(b, [sb.index(c) for c in batch + contract + fb])
    B = [size[c] for c in batch]
    M = math.prod(size[c] for c in fa)
    K = math.prod(size[c] for c in contract)
    N = math.prod(size[c] for c in fb)
    a3 = reshape(at, B + [M, K])
    b3 = reshape(bt, B + [K, N]) if batch else reshape(bt, [K, N])
    r = _matmul_nd(a3, b3, prec)
    r = reshape(r, B + [size[c] for c in fa] + [size[c] for c in fb])
    cur = batch + fa + fb
    return transpose(r, [cur.index(c) for c in out])


# --- autodiff --------------------------------------------------------------------------------

def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False):
    """Like ``jax.value_and_grad``: ``fun``'s value and the gradient with respect to the
    positional arguments ``argnums`` (pytrees of Arrays or numpy arrays).

    ``fun`` must return a scalar Array (or ``(scalar, aux)`` with ``has_aux``). Gradients
    have the shardings of their inputs (numpy inputs are placed like ``device_put``).

    >>> import numpy as np, ctrainstate as cts, ctrainstate.numpy as cnp
    >>> f = lambda w: cnp.sum(cnp.square(w))
    >>> v, g = cts.value_and_grad(f)(np.array([1.0, 2.0], np.float32))
    >>> float(v), np.asarray(g).tolist()
    (5.0, [2.0, 4.0])
    """
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)

    def wrapped(*args, **kwargs):
        args = list(args)
        stack = _tls.tapes
        if stack:   # (inside another differentiated call, or a _no_tape)
            tape, stack = _open_tape()
        else:       # _open_tape's, for the common case: no enclosing tape
            tape = _Tape()
            if stack is None:
                stack = _tls.tapes = []
        enclosing = tape.outer
        flat_in = {}
        for i in nums:
            if i >= len(args):
                raise TypeError(f"value_and_grad: argnums {i} but only {len(args)} positional arguments")
            # (_arg_spec's first try: the most recent spec)
            leaves = _C.flatten_spec(_ARG_SPECS[0], args[i]) if _ARG_SPECS else None
            hit = (leaves, _ARG_SPECS[0]) if leaves is not None else _arg_spec(args[i])
            if hit is not None:   # a structure seen before (nested dicts of Arrays): in C
                leaves, td = hit
                new = _grad_track(leaves, tape, _FLOAT_SET)   # Arrays only, not nested: in C
                if new is not None:
                    flat_in[i] = (new, td)
                    args[i] = _C.unflatten_spec(td, new)
                    continue
                leaves, td = tree_flatten(args[i])   # (the general path below: a treedef)
            else:
                leaves, td = tree_flatten(args[i])
                new = _grad_track(leaves, tape, _FLOAT_SET)
                if new is not None:
                    _remember_spec(args[i], leaves, td)
                    flat_in[i] = (new, td)
                    args[i] = tree_unflatten(td, new)
                    continue
            new = []
            for leaf in leaves:
                x = _lift(leaf) if not isinstance(leaf, Array) else leaf
                x._check_alive()
                if enclosing:
                    _check_not_nested(tape, (x,))
                if x.dtype not in _FLOATS:   # jax's words
                    raise TypeError(f"grad requires real- or complex-valued inputs (input "
                                    f"dtype that is a sub-dtype of np.inexact), but got "
                                    f"{x.dtype}: value_and_grad differentiates float32, "
                                    f"bfloat16 and float16 inputs (pass integer inputs as "
                                    f"arguments not in argnums)")
                x = _alias(x)  # a distinct object so one Array passed twice gets two slots
                tape.track(x)
                new.append(x)
            flat_in[i] = (new, td)
            args[i] = tree_unflatten(td, new)
        stack.append(tape)
        try:
            res = fun(*args, **kwargs)
        finally:
            stack.pop()
        val, aux = (res if has_aux else (res, None))
        if not isinstance(val, Array) or val.shape != ():
            raise TypeError(f"value_and_grad: the function must return a scalar Array, got "
                            f"{type(val).__name__} {getattr(val, 'shape', '')}")
        if id(val) in tape.tracked:   # (_backward's, inlined)
            seed = _C.filled_like(val, 1.0)   # val's dtype and sharding (float32: in C)
            grads = {id(val): _filled_like(val, 1.0) if seed is None else seed}
            _C.tape_backward(tape.nodes, tape.tracked, grads, _Group)
        else:
            grads = {}
        outs = []
        for i in nums:
            leaves, td = flat_in[i]
            gl, nfix = _grad_collect(leaves, grads, True)   # (float32 zeros made in C)
            if nfix:   # no cotangent (zeros), or one of another layout (resharded)
                for k, x in enumerate(leaves):
                    if gl[k] is None:
                        g = grads.get(id(x))
                        gl[k] = zeros_like(x) if g is None else _put(g, x.sharding)
            outs.append(_C.unflatten_spec(td, gl) if type(td) is tuple else
                        tree_unflatten(td, gl))
        g = outs[0] if single else tuple(outs)
        return ((val, aux), g) if has_aux else (val, g)
    return wrapped


# The structures of the trees value_and_grad differentiated lately, as specs for
# _C.flatten_spec (csrc/python/py_tree.c): a differentiated argument that has one exactly (the
# same dict keys, list and tuple lengths, Array leaves) is flattened and rebuilt in C, not by
# optree (which costs more than the rest of a small model's bookkeeping). Only nested plain
# dicts, lists, tuples and None with Array leaves are described, and a spec is kept only if it
# flattens the tree it was made from to optree's leaves, object for object; its unflatten
# builds dicts in sorted key order, as the canonical treedef does. Most recent first; bounded.
_ARG_SPECS: list = []
_ARG_SPECS_MAX = 8


class _NoArgSpec(Exception):
    pass


def _arg_spec(tree):
    """``(leaves, spec)`` of ``tree`` by a remembered spec, or None."""
    for k, spec in enumerate(_ARG_SPECS):
        leaves = _C.flatten_spec(spec, tree)
        if leaves is not None:
            if k:
                _ARG_SPECS.insert(0, _ARG_SPECS.pop(k))
            return leaves, spec
    return None


def _spec_tree(x, depth=0):
    t = type(x)
    if t is Array:
        return (_SPEC_KINDS["LEAF"], t)
    if x is None:
        return (_SPEC_KINDS["NONE"],)
    if depth > 60:
        raise _NoArgSpec
    if t is dict:
        try:
            keys = tuple(sorted(x))
        except TypeError:
            raise _NoArgSpec from None
        return (_SPEC_KINDS["DICT"], keys, tuple(_spec_tree(x[k], depth + 1) for k in keys))
    if t is tuple or t is list:
        return (_SPEC_KINDS["TUPLE" if t is tuple else "LIST"], len(x),
                tuple(_spec_tree(v, depth + 1) for v in x))
    raise _NoArgSpec


def _remember_spec(tree, leaves, td) -> None:
    """Keep a spec of ``tree`` (flattened by optree to ``leaves``, ``td``) for _arg_spec."""
    try:
        spec = _spec_tree(tree)
    except _NoArgSpec:
        return
    got = _C.flatten_spec(spec, tree)
    if got is None or len(got) != len(leaves) or any(a is not b for a, b in zip(got, leaves)):
        return
    # the tree the spec rebuilds must be the one optree rebuilds: the same treedef (dict keys
    # in the same order) and the same leaf objects, compared by identity (comparing the
    # trees would compare the leaves' values: an Array comparison, whose truth is ambiguous)
    rebuilt, rtd = tree_flatten(_C.unflatten_spec(spec, list(leaves)))
    if rtd != td or len(rebuilt) != len(leaves) or any(
            a is not b for a, b in zip(rebuilt, leaves)):
        return
    if spec in _ARG_SPECS:
        return
    _ARG_SPECS.insert(0, spec)
    del _ARG_SPECS[_ARG_SPECS_MAX:]


_SPEC_KINDS = _C.spec_kinds


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False):
    """Like ``jax.grad``."""
    vg = value_and_grad(fun, argnums, has_aux)

    def wrapped(*args, **kwargs):
        r, g = vg(*args, **kwargs)
        return (g, r[1]) if has_aux else g
    return wrapped


def _alias(x: Array) -> Array:
    """A new Array object sharing ``x``'s buffers (read-only use inside a trace)."""
    return Array._create(x.shape, x.dtype, x.sharding, list(x._blocks))


class _Group:
    """A tape node with several outputs whose vjp continues the accumulation of its inputs'
    cotangents itself: ``vjp(output cotangents, inputs' cotangents so far)`` returns the
    inputs' new cotangents (a checkpointed call: see _remat.py)."""
    __slots__ = ("outs", "inputs", "vjp")

    def __init__(self, outs, inputs, vjp):
        self.outs, self.inputs, self.vjp = tuple(outs), tuple(inputs), vjp


def _backward(tape: _Tape, out: Array | None, g: Array | None = None,
              seeds: dict | None = None) -> dict:
    """Cotangents (id -> Array) of the tape's arrays: from 1 flowing into the scalar
    ``out``, or from the cotangents ``seeds`` (id -> Array) already there."""
    if seeds is not None:
        cot = dict(seeds)
    else:
        if id(out) not in tape.tracked:
            return {}
        if g is None:
            g = _C.filled_like(out, 1.0)   # out's dtype and sharding (float32: in C)
            if g is None:
                g = _filled_like(out, 1.0)
        cot = {id(out): g}
    # last node to first, in C: each node's vjp on its output's cotangent, the results added
    # into its tracked inputs' (by the add primitive: 16-bit float cotangents accumulate in
    # their dtype, as in jax); a _Group continues its inputs' accumulation itself
    _C.tape_backward(tape.nodes, tape.tracked, cot, _Group)
    return cot


# --- creation helpers -----------------------------------------------------------------------------

def _filled_like(x: Array, value: float) -> Array:
    if x.dtype == np.float32 and type(x) is Array:
        # x's sharding and block layout, a new float32 buffer per block (what _new makes for
        # x's placement and axes, without resolving them again)
        blocks = [(dev, _C.Buffer(dev.id, buf.shape, _F32_CODE), start, rid)
                  for dev, buf, start, rid in x._blocks]
        out = Array._create(x.shape, x.dtype, x.sharding, blocks)
        _C.op_unary(U_AFFINE, 0.0, float(value), _bufs(out), _bufs(out))
        return out
    norm = _axes_of(x)
    out = _new(x.shape, _place_of(x), norm)
    _C.op_unary(U_AFFINE, 0.0, float(value), _bufs(out), _bufs(out))
    return out if x.dtype == np.float32 else _convert(out, x.dtype)


_F32_CODE = _dtypes.code(_dtypes.float32)


def zeros_like(x: Array) -> Array:
    """Zeros of ``x``'s shape, dtype and sharding."""
    return _filled_like(x, 0.0)


def ones_like(x: Array) -> Array:
    """Ones of ``x``'s shape, dtype and sharding."""
    return _filled_like(x, 1.0)


# --- shape rules (abstract evaluation, see ctrainstate._src.array.abstract) -----------------------------

def _shp(x):
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _rule_same(x, *a, **k):
    return _shp(x)


def _rule_bcast(a, b):
    return _bcast_shape(_shp(a), _shp(b))


def _rule_broadcast_to(x, shape):
    shape = _shape_arg(shape, "broadcast_to")
    _check_broadcast_to(_shp(x), shape)
    return shape


def _rule_reduce(x, axis=None, keepdims=False):
    sh = _shp(x)
    axes = _axes(axis, len(sh))
    return tuple(1 if d in axes else s for d, s in enumerate(sh)) if keepdims else \
        tuple(s for d, s in enumerate(sh) if d not in axes)


def _rule_transpose(x, axes=None):
    sh = _shp(x)
    axes = tuple(reversed(range(len(sh)))) if axes is None else tuple(a % len(sh) for a in axes)
    return tuple(sh[a] for a in axes)


def _rule_reshape(x, shape):
    shape = [int(s) for s in shape]
    n = math.prod(_shp(x))
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if not known:
            raise ValueError(f"cannot reshape {_shp(x)} into {tuple(shape)}: the -1 is "
                             f"ambiguous beside a 0")
        shape[shape.index(-1)] = n // known
    if math.prod(shape) != n:
        raise ValueError(f"cannot reshape {_shp(x)} into {tuple(shape)}")
    return tuple(shape)


def _rule_expand(x, axis):
    sh = list(_shp(x))
    sh.insert(axis % (len(sh) + 1), 1)
    return tuple(sh)


def _rule_matmul(a, b, precision=None):
    _resolve_precision(precision, "matmul")
    sa, sb = _shp(a), _shp(b)
    if len(sa) == 1 and len(sb) == 1:
        return ()
    if len(sa) == 1:
        return sb[:-2] + (sb[-1],)
    if len(sb) == 1:
        return sa[:-1]
    if sa[-1] != sb[-2]:
        raise ValueError(f"matmul: contracting dimensions differ: {sa} @ {sb}")
    return sa[:-1] + (sb[-1],)


def _rule_einsum(sub, *operands, precision=None):
    _resolve_precision(precision, "einsum")
    if len(operands) != 2:
        raise NotImplementedError(f"einsum takes exactly two operands here, got {len(operands)}")
    a, b = operands
    ins, out = sub.replace(" ", "").split("->")
    size = {}
    for s, x in zip(ins.split(","), (a, b)):
        for c, n in zip(s, _shp(x)):
            size[c] = n
    return tuple(size[c] for c in out)


def _rule_arg(x, axis=None, keepdims=False):
    sh = _shp(x)
    axes = _arg_axes(axis, len(sh), "argmax")
    for d in axes:
        if sh[d] == 0:
            raise ValueError(f"attempt to get argmax of an empty sequence (dimension {d} of "
                             f"shape {sh} has size 0)")
    return _rule_reduce(x, axes, keepdims)


# --- dtypes: conversions and 16-bit floats -------------------------------------------------
# Ops compute in float32 (the kernels' type). A float16 / bfloat16 operand is converted to
# float32 on its devices, the op runs, and the result is rounded back to the operands'
# dtype: jax's dtype rules (bfloat16 op bfloat16 -> bfloat16; with a float32 Array -> float32;
# Python scalars are weak and keep the Array's dtype), with one rounding per op -- what XLA
# does for 16-bit floats on CPUs. Reductions and means accumulate in float32 and round once
# (jnp.sum / jnp.mean upcast 16-bit floats for the computation). The conversions are tape
# nodes, so gradients flow through them and a 16-bit float input gets a cotangent of its
# own dtype, as in jax.

_FLOATS = (_dtypes.float32, _dtypes.bfloat16, _dtypes.float16)
_FLOAT_SET = frozenset(np.dtype(d) for d in _FLOATS)
_grad_track = _C.grad_track
_grad_collect = _C.grad_collect
_LOWP = (_dtypes.bfloat16, _dtypes.float16)


def _convert(x: Array, dtype) -> Array:
    """``x`` converted to ``dtype`` on its own devices (same sharding), not recorded."""
    _, blocks = _alloc_blocks(x.shape, dtype, x.sharding, addressable=True)
    out = Array._create(x.shape, np.dtype(dtype), x.sharding, blocks)
    _C.op_convert(_bufs(x), _bufs(out))
    return out


def _copy(x: Array) -> Array:
    """A fresh copy of ``x`` (any dtype, every bit kept), on the same devices."""
    return x.copy()


def astype(x, dtype) -> Array:
    """``x`` converted to ``dtype`` (``jnp.astype`` / ``lax.convert_element_type``), on each
    device's own block (nothing is gathered; the sharding is kept). An Array already of
    ``dtype`` is returned as it is; numpy inputs are placed first (as ``device_put``).

    Semantics (jax's): floats round to nearest even (float32 -> bfloat16 / float16; float16
    overflows to inf); floats -> ints (int32, uint32, int16, uint16, int8, uint8) truncate
    toward zero and saturate at the type's range, NaN -> 0; ints -> ints wrap (int32 300 ->
    uint8 44); ``bool`` is ``x != 0``. Differentiable between float dtypes (the
    cotangent is converted back to ``x``'s dtype); other conversions pass no gradient.

    >>> import numpy as np, ctrainstate.numpy as cnp
    >>> y = cnp.astype(np.array([1.00390625, -2.5, 3e9], np.float32), cnp.bfloat16)
    >>> str(y.dtype), np.asarray(y).astype(np.float32).tolist()
    ('bfloat16', [1.0, -2.5, 3003121664.0])
    >>> np.asarray(cnp.astype(np.array([3e9, -1.7, np.nan], np.float32), cnp.int32)).tolist()
    [2147483647, -1, 0]
    """
    dtype = _dtypes.canonicalize(dtype)
    if isinstance(x, ShapeDtypeStruct):
        return ShapeDtypeStruct(x.shape, dtype, x.sharding)
    if not isinstance(x, Array):
        place = get_mesh()
        if place is None:
            x = device_put(np.asarray(x, dtype=_dtypes.canonicalize(np.asarray(x).dtype)),
                           local_devices()[0])
        else:
            x = device_put(np.asarray(x), NamedSharding(place, PartitionSpec()))
    x._check_alive()
    if x.dtype == dtype:
        return x
    return _convert_to(x, np.dtype(dtype))


def _convert_to(x: Array, dtype: np.dtype) -> Array:
    """``x`` (a live Array) converted to another ``dtype``, differentiable between float
    dtypes: :func:`astype` after its checks (a primitive: a C plan per block)."""
    out = _convert(x, dtype)
    if x.dtype in _FLOATS and dtype in _FLOATS:
        _record(out, (x,), lambda g: _vjp_convert(g, out, x, dtype))
    return out


def _vjp_convert(g, out, x, dtype):
    """The tape rule of a conversion: the cotangent converted back to ``x``'s dtype (none
    between a float and a non-float dtype)."""
    if x.dtype not in _FLOATS or dtype not in _FLOATS:
        return (None,)
    return (g if g.dtype == x.dtype else astype(g, x.dtype),)


def _operand_dtype(v):
    """(dtype, weak) of an op operand for dtype promotion: Python scalars are weak (None
    for ints and bools, float32 for floats); numpy values are narrowed as device_put does."""
    if isinstance(v, (Array, ShapeDtypeStruct)):
        return np.dtype(v.dtype), False
    if isinstance(v, (bool, int)):
        return None, True
    if isinstance(v, float):
        return _dtypes.float32, True
    try:
        return _dtypes.canonicalize(np.asarray(v).dtype), False
    except TypeError:
        return None, True


def _result_dtype(vals, who: str):
    """The float dtype an op on ``vals`` returns (jax's promotion on the dtypes stored here):
    one 16-bit float dtype among the strongly typed floats -> that dtype; float32, or both
    16-bit types (jax: bfloat16 + float16 -> float32) -> float32."""
    strong, weak_float, int_array = set(), False, None
    for v in vals:
        dt, weak = _operand_dtype(v)
        if dt is None:
            continue
        if dt in _FLOATS:
            if weak:
                weak_float = True
            else:
                strong.add(dt)
        elif isinstance(v, Array) or type(v).__name__ == "ShapeDtypeStruct":
            int_array = dt
    if not strong and not weak_float and int_array is not None:
        return result_type(*vals, who=who)
    if len(strong) == 1:
        return next(iter(strong))
    return _dtypes.float32


_DT_F32 = np.dtype(np.float32)   # (builtin dtypes are singletons: `is` before `!=`)


def _needs_policy(v) -> bool:
    if isinstance(v, Array):
        return v._dtype is not _DT_F32 and v._dtype != _DT_F32
    if isinstance(v, np.ndarray) or isinstance(v, np.generic):
        return v.dtype in _LOWP
    return False


def _as_f32(v):
    if isinstance(v, Array):
        return v if v.dtype == np.float32 else astype(v, _dtypes.float32)
    if isinstance(v, (np.ndarray, np.generic)) and v.dtype in _LOWP:
        return np.asarray(v, np.float32)
    return v


def _weak_in(v, rdt):
    """A Python scalar operand (weakly typed) takes a 16-bit result dtype first, as in jax:
    ``float16_array / 1e5`` divides by float16(1e5) = inf."""
    if rdt in _LOWP and type(v) in (float, int):
        return float(np.asarray(v, dtype=rdt))
    return v


def _int_in(v, rdt):
    """An integer Array operand of an op whose result is a 16-bit float is converted to that
    float first, as jax converts it (int16 or int32 values round to bfloat16 / float16 before
    the op, which then rounds once more): ``int16 + bfloat16`` gives jax's bits."""
    if rdt in _LOWP and isinstance(v, Array) and v.dtype not in _FLOATS:
        return astype(v, rdt)
    return v


def _data_args(fn, args, kwargs, pos, rest_from):
    """The positions (ints) and keyword names of ``fn``'s data operands in this call (a
    data operand passed by keyword counts by its parameter's name)."""
    idx = [i for i in pos if i < len(args)]
    if rest_from is not None:
        idx += list(range(rest_from, len(args)))
    if not kwargs:
        return idx, []
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return idx, []
    data = {params[i] for i in pos if i < len(params)}
    return idx, [k for k in kwargs if k in data]


def _with_dtype_policy(fn, pos=(0,), rest_from=None):
    """Wrap op ``fn`` with the 16-bit float policy above (``pos``: the positions of its data
    operands; ``rest_from``: all positions from there on, einsum's operands)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        # (only the data operands decide: where's bool condition, take_rows' int indices are
        # none, and the policy converts none but them)
        n = len(args)
        if not (any(_needs_policy(args[i]) for i in pos if i < n) or
                (rest_from is not None and any(_needs_policy(a) for a in args[rest_from:])) or
                any(_needs_policy(v) for v in kwargs.values())):
            return fn(*args, **kwargs)
        idx, names = _data_args(fn, args, kwargs, pos, rest_from)
        vals = [args[i] for i in idx] + [kwargs[k] for k in names]
        rdt = _result_dtype(vals, fn.__name__)
        if rdt not in _FLOATS:     # integer / bool operands that no integer kernel takes
            if fn.__name__ not in _INT_TO_FLOAT:
                raise TypeError(
                    f"{fn.__name__}: got {rdt} operands; this op computes in floats here "
                    f"(integer arithmetic covers add, subtract, multiply, maximum, minimum, "
                    f"negative, abs, sum, max, min, where, //, %, bitwise ops): convert with "
                    f".astype(float32) first")
            rdt = _dtypes.float32  # jnp.sin / exp / ... of ints: float32
        args = list(args)
        for i in idx:
            args[i] = _as_f32(_int_in(_weak_in(args[i], rdt), rdt))
        for k in names:
            kwargs[k] = _as_f32(_int_in(_weak_in(kwargs[k], rdt), rdt))
        out = fn(*args, **kwargs)
        return out if rdt == np.float32 or not isinstance(out, Array) else astype(out, rdt)
    wrapped._policy = (pos, rest_from)
    return wrapped


# float functions jnp applies to integer / bool operands by promoting them to float32
_INT_TO_FLOAT = ("sin", "cos", "tanh", "exp", "log", "sqrt", "rsqrt", "sigmoid", "gelu",
                 "log1p", "expm1", "erf", "erfc", "var", "std", "norm", "vector_norm",
                 "matrix_norm")


_POLICY_BINARY = ("add", "subtract", "multiply", "divide", "maximum", "minimum", "matmul", "power")
_POLICY_UNARY = ("negative", "sin", "cos", "tanh", "relu", "gelu", "exp", "log", "sqrt", "rsqrt",
                 "square", "sigmoid", "abs", "sum", "max", "min", "mean", "broadcast_to",
                 "take_rows", "log1p", "expm1", "erf", "erfc", "floor", "ceil", "trunc", "sign",
                 "round", "reciprocal")   # (transpose, reshape, expand_dims move bytes: any dtype, natively)
# the float32 implementations of the ops above and of where, before their wrappers
# (_fast_f32_paths)
_F32_IMPL: dict = {}


def _dtype_policies():
    g = globals()
    binary, unary = _POLICY_BINARY, _POLICY_UNARY
    for name in binary + unary + ("where",):
        _F32_IMPL[name] = g[name]
    for name in binary:
        g[name] = _with_dtype_policy(g[name], (0, 1))
    for name in unary:
        g[name] = _with_dtype_policy(g[name], (0,))
    g["where"] = _with_dtype_policy(g["where"], (1, 2))
    g["einsum"] = _with_dtype_policy(g["einsum"], (), rest_from=1)
    for name in ("add", "subtract", "multiply", "divide", "maximum", "minimum"):
        g[name] = _int_dispatch(g[name], name, (0, 1))
    for name in ("negative", "abs", "sum", "max", "min", "mean", "broadcast_to", "floor", "ceil",
                 "trunc", "round", "sign", "square"):
        g[name] = _int_dispatch(g[name], name, (0,))
    g["where"] = _int_dispatch(g["where"], "where", (1, 2))


def _intlike(v) -> bool:
    """An Array or numpy operand of an integer or bool dtype."""
    if isinstance(v, Array):
        return v._dtype is not _DT_F32 and v._dtype not in _FLOATS
    if isinstance(v, (np.ndarray, np.generic)):
        return v.dtype.kind in "biu"
    return False


# ops whose integer dispatch makes an integer Array of Python ints alone, as jax's weak ints:
# where(mask, 1, 0) is int32, broadcast_to(True, shape) bool and broadcast_to(1, shape) int32
_INT_FROM_PY_INTS = ("where", "broadcast_to")

# ops of one operand that jnp computes on integers in their own dtype (ew.int_unary)
_INT_UNARY = ("floor", "ceil", "trunc", "round", "sign", "square")


def _int_dispatch(fn, name, pos):
    """Route op ``fn`` to the integer / bool kernels (:mod:`ctrainstate._src.ops.elementwise`) when an
    operand is an integer or bool Array (or numpy value) and jax's promotion of the data
    operands is not a float dtype; float results keep the float path."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        names = ("x", "y") if name == "where" else ("a", "b") if len(pos) == 2 else ("x",)
        vals = [args[i] if i < len(args) else kwargs.get(nm) for i, nm in zip(pos, names)]
        if name in _INT_FROM_PY_INTS and builtins.all(
                isinstance(v, (int, np.integer, np.bool_)) for v in vals):
            pass    # typed by the integer path
        elif not builtins.any(_intlike(v) for v in vals):
            return fn(*args, **kwargs)
        if builtins.any(v is None for v in vals):
            return fn(*args, **kwargs)
        dt = ew.result_type(*vals, who=name)
        if dt in _FLOATS:
            return fn(*args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k not in names}
        if name in _INT_UNARY:
            decimals = args[1] if len(args) > 1 else rest.get("decimals", 0)
            if dt == _dtypes.bool_ or (name == "round" and decimals != 0):
                return fn(*args, **kwargs)     # (bools, and ints to tens: the float path's error)
            return ew.int_unary(name, vals[0])
        if name in ("add", "subtract", "multiply", "maximum", "minimum"):
            return ew.int_binary(name, vals[0], vals[1])
        if name == "divide":        # jnp.true_divide of ints: float32
            return fn(astype(vals[0], _dtypes.float32), astype(vals[1], _dtypes.float32))
        if name == "negative":
            return ew.int_negative(vals[0])
        if name == "abs":
            return ew.int_abs(vals[0])
        if name == "broadcast_to":
            return ew.int_broadcast_to(vals[0], *args[1:], **rest)
        if name == "mean":          # jnp.mean of ints and bools: float32
            return fn(astype(vals[0], _dtypes.float32), *args[1:], **rest)
        if name == "where":
            cond = args[0] if args else kwargs["condition"]
            return ew.int_where(cond, vals[0], vals[1])
        return ew.int_reduce(name, vals[0], *args[1:], **rest)
    return wrapped


def _abstract_dtype(fn, args, kwargs):
    """The result dtype of a policy-wrapped op called on ShapeDtypeStructs."""
    pol = getattr(fn, "_policy", None)
    if pol is None:
        return None
    idx, names = _data_args(fn, args, kwargs, pol[0], pol[1])
    dt = _result_dtype([args[i] for i in idx] + [kwargs[k] for k in names], fn.__name__)
    if dt not in _FLOATS:   # integer / bool operands (jnp's result dtypes)
        if fn.__name__ in ("mean", "divide"):
            return _dtypes.float32
        if fn.__name__ == "sum":
            return sum_dtype(dt)
    return dt


def _abstract_rules():
    rules = {
        "add": _rule_bcast, "subtract": _rule_bcast, "multiply": _rule_bcast,
        "divide": _rule_bcast, "maximum": _rule_bcast, "minimum": _rule_bcast,
        "power": lambda x, p: _bcast_shape(_shp(x), _shp(p)),
        "sum": _rule_reduce, "mean": _rule_reduce, "max": _rule_reduce, "min": _rule_reduce,
        "transpose": _rule_transpose,
        "reshape": _rule_reshape, "expand_dims": _rule_expand, "matmul": _rule_matmul,
        "broadcast_to": _rule_broadcast_to,
        "take_rows": lambda table, ids: tuple(np.shape(ids)) + (_shp(table)[1],),
        "where": lambda c, x, y: _bcast_shape(_bcast_shape(_shp(c), _shp(x)), _shp(y)),
        "with_sharding": _rule_same, "zeros_like": _rule_same, "ones_like": _rule_same,
    }
    for name in ("negative", "sin", "cos", "tanh", "relu", "gelu", "exp", "log", "sqrt", "rsqrt",
                 "square", "sigmoid", "abs", "log1p", "expm1", "erf", "erfc", "floor", "ceil",
                 "trunc", "sign", "round", "reciprocal"):
        rules[name] = _rule_same
    g = globals()
    for name, rule in rules.items():
        g[name] = _with_rule(g[name], rule, ShapeDtypeStruct)
    for name in ("argmax", "argmin"):  # int32 results
        g[name] = _with_rule(g[name], _rule_arg, ShapeDtypeStruct, dtype=_dtypes.int32)
    g["einsum"] = _with_rule(g["einsum"], _rule_einsum, ShapeDtypeStruct, first=1)
    g["around"] = g["round"]


def _with_rule(fn, rule, SDS, first=0, dtype=np.float32):

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if any(isinstance(a, SDS) for a in args[first:]):
            sharding = None
            dt = _abstract_dtype(fn, args, kwargs) or dtype
            if fn.__name__ in ("with_sharding", "zeros_like", "ones_like", "reshape",
                               "transpose", "expand_dims", "ravel"):
                dt = args[0].dtype
            if fn.__name__ == "with_sharding":
                sharding = _as_sharding(args[1] if len(args) > 1 else kwargs["sharding"])
            return SDS(rule(*args, **kwargs), dt, sharding)
        return fn(*args, **kwargs)
    return wrapped


def _fast_f32(outer, inner):
    """``outer`` (an op under its abstract-shape, integer-dispatch and 16-bit policy wrappers),
    calling ``inner`` (the float32 implementation) straight away when each wrapper would pass
    the call through unchanged:

    - every data operand (the policy's positions) is a float32 Array or a Python float / int,
      and for the ops of ``_INT_FROM_PY_INTS`` at least one of them is not an int;
    - every other positional operand (where's condition, take_rows' ids, an axis) is anything
      but a ShapeDtypeStruct;
    - every keyword argument is None, a bool, an int or a tuple of ints (``axis=``,
      ``keepdims=``).

    Its result is the same; it saves the wrappers' three argument scans (about 2 us of a 10 us
    ``a + b``, of a ``mean(x, axis=0)`` and of a ``where(mask, x, 0.0)``)."""
    f32 = _DT_F32
    pos, rest_from = outer._policy
    if rest_from is not None:
        raise ValueError(f"{inner.__name__}: the float32 fast path takes fixed data positions")
    data = frozenset(pos)
    typed_ints = inner.__name__ in _INT_FROM_PY_INTS

    @functools.wraps(outer)
    def fast(*args, **kwargs):
        ints_only = typed_ints
        for i, a in enumerate(args):
            t = type(a)
            if i in data:
                if t is Array:
                    if a._dtype is not f32:
                        return outer(*args, **kwargs)
                    ints_only = False
                elif t is float:
                    ints_only = False
                elif t is not int:
                    return outer(*args, **kwargs)
            elif isinstance(a, ShapeDtypeStruct):
                return outer(*args, **kwargs)
        if ints_only:
            return outer(*args, **kwargs)
        for v in kwargs.values():
            t = type(v)
            if t is tuple:
                for e in v:
                    if type(e) is not int:
                        return outer(*args, **kwargs)
            elif v is not None and t is not bool and t is not int:
                return outer(*args, **kwargs)
        return inner(*args, **kwargs)
    return fast


def _fast_f32_paths():
    g = globals()
    for name, inner in _F32_IMPL.items():
        g[name] = _fast_f32(g[name], inner)


def _lowp_integer_power(outer):
    """``power`` with 16-bit floats raised to an integer going to :func:`_integer_pow` in
    their own dtype (the dtype policy would compute the whole power in float32 and round
    once, which is not what jax's integer_pow does)."""

    @functools.wraps(outer)
    def wrapped(x, p):
        if (isinstance(p, (int, np.integer)) and not isinstance(p, (bool, np.bool_))
                and (isinstance(x, Array) and x.dtype in _LOWP
                     or isinstance(x, (np.ndarray, np.generic)) and x.dtype in _LOWP)):
            return _integer_pow(_lift_any(x), int(p))
        return outer(x, p)
    return wrapped


_dtype_policies()
_abstract_rules()
_fast_f32_paths()
power = _lowp_integer_power(power)


# --- primitives: the C path of the common ops (csrc/python/py_dispatch.c) -----------------
# Each op below becomes a ``_C.Primitive``: a call whose operands are live Arrays (and Python
# scalars where the op takes them), without keywords and with no tape recording, runs from a
# plan cached in C (no Python); the first call of a kind asks the planner here, which reuses
# the ops' own layout rules, and any other call runs the Python op above (the fallback).

_K = _C.dispatch_kinds
_SR = _C.dispatch_scalar_rules
_EW = {name: _C.op_codes["ewise"][code] for name, code in (
    ("add", "ADD"), ("subtract", "SUB"), ("multiply", "MUL"), ("maximum", "MAX"),
    ("minimum", "MIN"))}
_EW_DTYPES = (_dtypes.bfloat16, _dtypes.float16, np.dtype(np.int32))


def _plan_out(kind, op, shape, dtype, place, norm, red_mask=0, groups=(), red_op=0,
              mnk=()):
    """A plan tuple (py_dispatch.c) for an output of ``shape`` with per-dimension axes
    ``norm`` on ``place``, allocated as :func:`_new` allocates it."""
    sharding = _sharding_for(place, norm)
    shard_shape, layout, _ = sharding._layout(tuple(shape))
    return (kind, op, tuple(shape), np.dtype(dtype), _dtypes.code(dtype), sharding,
            tuple(shard_shape), [(dev, start, rid) for dev, start, rid in layout], red_mask,
            [list(g) for g in groups], red_op, tuple(mnk))


def _in_process(planner):
    """``planner``, for operands this process holds whole: an Array that spans processes
    gets no C plan (None), so its calls run the Python op, whose blocks are this process's
    and whose all-reduces cross processes (:func:`_allreduce_processes`). The planners run
    on a plan-cache miss only."""
    def plan(*args):
        for x in args:
            if type(x) is Array and not x._sharding.is_fully_addressable:
                return None
        return planner(*args)
    plan.__name__ = plan.__qualname__ = getattr(planner, "__name__", "plan")
    plan.__doc__ = planner.__doc__
    return plan


def _same_devices(a: Array, plan) -> bool:
    """Whether ``a``'s blocks are on the plan's output devices, in the same order (the C
    path pairs blocks by position)."""
    blocks = a._blocks
    return (type(blocks) is list and len(blocks) == len(plan[7]) and
            builtins.all(b[0] is p[0] for b, p in zip(blocks, plan[7])))


def _plan_unary(op):
    """Planner of a unary op: a float32 Array (the float32 kernel), or a bfloat16 / float16 one
    (the typed kernel: widened, the float32 formula, rounded back — the bits of the Python
    path's convert / float32 op / round; recorded on a tape by the Python path)."""
    def plan(x):
        dt = x._dtype
        if x._donated is not False:
            return None
        if dt is _DT_F32:
            kind = _K["UNARY"]
        elif dt in _LOWP:
            kind = _K["UNARY16"]
        else:
            return None
        p = _plan_out(kind, op, x._shape, dt, _place_of(x), _norm(x._sharding, len(x._shape)))
        return p if _same_devices(x, p) else None
    return plan


def _plan_binary(name, op_f32, rules):
    """Planner of a binary op: float32 Arrays (op_f32, broadcasting), two Arrays of one
    16-bit float or int32 dtype (the typed kernel, one rounding: the bits of the Python
    path's convert / float32 op / round), a float32 Array and a Python scalar (``rules``:
    the scalar rule with the scalar on the right, on the left; None: no C path), or an int32
    Array and a Python scalar (the typed kernel; the C path converts the scalar at each call
    where jax's weak typing keeps int32: an int in int32's range; any other runs the Python
    op)."""
    ew = _EW.get(name)

    def plan(a, b):
        if type(a) is not Array or type(b) is not Array:
            x, rule = (a, rules[0]) if type(a) is Array else (b, rules[1])
            if ew is not None and x._dtype == _DT_I32:
                rule, kind, dt = ew, _K["EWISE"], _DT_I32
            else:
                kind, dt = _K["SCALAR"], _DT_F32
            if rule is None or x._dtype is not dt:
                return None
            p = _plan_out(kind, rule, x._shape, dt, _place_of(x),
                          _norm(x._sharding, len(x._shape)))
            return p if _same_devices(x, p) else None
        dt = a._dtype
        if dt != b._dtype:
            return None
        if dt is _DT_F32:
            kind, op = _K["BINARY"], op_f32
        elif ew is not None and dt in _EW_DTYPES:
            kind, op = _K["EWISE"], ew
        else:
            return None
        return _plan_pair(kind, op, a, b, dt)
    return plan


def _plan_pair(kind, op, a, b, dtype):
    """The plan of an elementwise op of two Arrays (broadcasting, :func:`_binary_plan`'s
    layout) with an output of ``dtype``; None for shapes that do not broadcast, operands on
    two meshes, or an operand whose blocks would move."""
    try:
        place, shape, out, _, _, stay_a, stay_b = _id_cached(
            _BIN_LAYOUTS, (a._shape, b._shape, id(a._sharding), id(b._sharding)),
            a._sharding, b._sharding, _binary_plan, a, b)
    except ValueError:   # shapes that do not broadcast, operands on two meshes
        return None
    if not (stay_a and stay_b):
        return None
    p = _plan_out(kind, op, shape, dtype, place, out)
    return p if _same_devices(a, p) and _same_devices(b, p) else None


_EWC = _C.op_codes["ewise"]
_CMP = {name: _EWC[code] for name, code in (
    ("less", "LT"), ("less_equal", "LE"), ("equal", "EQ"), ("not_equal", "NE"),
    ("greater", "GT"), ("greater_equal", "GE"))}
# the bitwise ops of ints and bools, and the logical ops of bool Arrays (each other operand:
# the Python op)
_BITS = {name: _EWC[code] for name, code in (
    ("bitwise_and", "AND"), ("bitwise_or", "OR"), ("bitwise_xor", "XOR"), ("invert", "NOT"))}
_LOGICAL = {name: _EWC[code] for name, code in (
    ("logical_and", "AND"), ("logical_or", "OR"), ("logical_xor", "XOR"), ("logical_not", "NOT"))}
_DT_I32 = np.dtype(np.int32)
_DT_BOOL = np.dtype(np.bool_)


def _plan_typed(op, kinds, compare=False):
    """Planner of a typed-kernel op (a comparison: ``compare``, a bool result; else the
    operands' dtype): two Arrays of one dtype whose kind is in ``kinds`` (None: any dtype,
    the 16-bit floats included; broadcasting), or for a comparison also a float32 / int32
    Array beside a Python scalar (the C path converts
    the scalar at each call where jax's promotion keeps the Array's dtype: a float or an int
    of at most 2^24 in magnitude beside float32, an int32 int beside int32; any other scalar
    runs the Python op)."""
    def plan(a, b):
        if type(a) is not Array or type(b) is not Array:
            x = a if type(a) is Array else b
            if not compare or (x._dtype is not _DT_F32 and x._dtype != _DT_I32):
                return None
            p = _plan_out(_K["EWISE"], op, x._shape, _DT_BOOL, _place_of(x),
                          _norm(x._sharding, len(x._shape)))
            return p if _same_devices(x, p) else None
        if a._dtype != b._dtype or (kinds is not None and a._dtype.kind not in kinds):
            return None
        return _plan_pair(_K["EWISE"], op, a, b, _DT_BOOL if compare else a._dtype)
    return plan


def _plan_typed_unary(op, kinds):
    """Planner of a unary typed-kernel op (``invert``, ``logical_not``) of an Array whose
    dtype's kind is in ``kinds``: the operand's dtype and layout."""
    def plan(x):
        if x._dtype.kind not in kinds:
            return None
        p = _plan_out(_K["EWISE"], op, x._shape, x._dtype, _place_of(x),
                      _norm(x._sharding, len(x._shape)))
        return p if _same_devices(x, p) else None
    return plan


def _plan_reduce(op, x, axis, keepdims):
    """The plan of a float32 reduction ``op`` (_RED_SUM / _RED_MAX) of ``x`` over ``axis``,
    as :func:`_reduce_raw` runs it (each device reduces its block, then an all-reduce with
    the same op over the mesh axes of the reduced dims); with ``keepdims`` (True) the
    reduced dimensions stay as size-1 unsharded ones, the layout the Python op's reshape
    gives them (the same elements in the same order). None where the Python op must run (it
    raises the errors: a bad axis; max of an empty dimension; a ``keepdims`` that is not a
    bool)."""
    if x._dtype is not _DT_F32 or (keepdims is not False and keepdims is not True):
        return None
    nd = len(x._shape)
    try:
        axes = _axes(axis, nd)
    except (TypeError, ValueError):   # the Python op raises its error
        return None
    if op == _RED_MAX and builtins.any(x._shape[d] == 0 for d in axes):
        return None
    xn = _axes_of(x)
    place = _place_of(x)
    groups: list = []
    mesh_axes = tuple(m for d in axes for m in xn[d])
    if mesh_axes and isinstance(x._sharding, NamedSharding):
        mesh = x._sharding.mesh
        groups = _id_cached(_AR_GROUPS, (id(mesh), mesh_axes), mesh, None, _allreduce_groups,
                            mesh, mesh_axes)
    if keepdims:
        kept_shape = [1 if d in axes else s for d, s in enumerate(x._shape)]
        kept_norm = [() if d in axes else xn[d] for d in range(nd)]
    else:
        kept_shape = [s for d, s in enumerate(x._shape) if d not in axes]
        kept_norm = [xn[d] for d in range(nd) if d not in axes]
    mask = 0
    for d in axes:
        mask |= 1 << d
    p = _plan_out(_K["REDUCE"], op, kept_shape, _DT_F32, place, kept_norm,
                  red_mask=mask, groups=groups, red_op=op)
    return p if _same_devices(x, p) else None


def _plan_sum(x, axis=None, keepdims=False):
    """``sum(x, axis, keepdims)`` of a float32 Array (:func:`_plan_reduce`)."""
    return _plan_reduce(_RED_SUM, x, axis, keepdims)


def _plan_max(x, axis=None, keepdims=False):
    """``max(x, axis, keepdims)`` of a float32 Array (:func:`_plan_reduce`)."""
    return _plan_reduce(_RED_MAX, x, axis, keepdims)


def _vjp_max(g, out, x, axis=None, keepdims=False):
    """The tape rule of ``max(x, axis, keepdims)`` on the C path: the Python op's (``g``
    split equally among the elements equal to the maximum)."""
    axes = _axes(axis, x.ndim)
    return (_max_vjp(g, out, x, axes),)


def _vjp_sum(g, out, x, axis=None, keepdims=False):
    """The tape rule of ``sum(x, axis)`` on the C path: ``g`` broadcast back over the summed
    dimensions, laid out as ``x``."""
    axes = _axes(axis, x.ndim)
    if not axes:    # (a scalar's sum, or over no axis)
        return (g,)
    keep_shape = tuple(1 if d in axes else s for d, s in enumerate(x.shape))
    return (_broadcast_like(reshape(g, keep_shape), x),)


def _broadcast_like(g, x) -> Array:
    """``g`` broadcast to ``x``'s shape, with ``x``'s sharding (the cotangent of a reduction
    of ``x``)."""
    out = broadcast_to(g, x.shape)
    if not isinstance(x, Array) or out.sharding == x.sharding:
        return out
    return _put(out, x.sharding)


def _plan_reshape(x, shape):
    """``reshape(x, shape)`` where every block keeps its elements (no dimension group is
    gathered): each device copies its block's bytes; any dtype. ``shape`` is a tuple of ints
    (other forms, a shape equal to ``x``'s, sizes 0: the Python op)."""
    if type(shape) is not tuple:
        return None
    try:
        shape = _rule_reshape(x, shape)
    except ValueError:
        return None
    if shape == x._shape or 0 in shape or 0 in x._shape:
        return None
    place = _place_of(x)
    xn, keep_old, new_norm = _reshape_layout(x, shape, place)
    if keep_old != list(xn):
        return None
    p = _plan_out(_K["COPY"], 0, shape, x._dtype, place, new_norm)
    return p if _same_devices(x, p) else None


_BCAST_DTYPES = (_DT_F32,) + _EW_DTYPES


def _plan_bcast(x, shape, like=None):
    """A broadcasting copy of ``x`` to ``shape`` with ``x``'s mesh axes on its dimensions that
    are not broadcast (``like``: with ``like``'s instead, where ``x``'s agree with them)."""
    if x._dtype not in _BCAST_DTYPES or x._donated is not False or shape == x._shape:
        return None
    try:
        _check_broadcast_to(x._shape, shape)
    except ValueError:
        return None
    off = len(shape) - len(x._shape)
    xn = _axes_of(x)
    place = _place_of(x)
    out = [()] * off + [xn[d] if x._shape[d] == shape[d + off] else () for d in range(len(xn))]
    if builtins.any(xn[d] and x._shape[d] != shape[d + off] for d in range(len(xn))):
        return None
    if like is not None:
        ln = _axes_of(like)
        # each block of x meets the block of like's layout on the same device: x's mesh
        # axes are like's on every dimension x does not broadcast
        if _place_of(like) is not place or builtins.any(
                x._shape[d] == shape[d + off] and xn[d] != ln[d + off] for d in range(len(xn))):
            return None
        out = list(ln)
    p = _plan_out(_K["BCAST"], 0, shape, x._dtype, place, out)
    return p if _same_devices(x, p) else None


def _plan_broadcast_to(x, shape):
    return _plan_bcast(x, shape) if type(shape) is tuple else None


def _plan_broadcast_like(g, x):
    if type(x) is not Array or x._dtype is not g._dtype:
        return None
    p = _plan_bcast(g, x._shape, x)
    return p if p is None or _same_devices(x, p) else None


def _plan_convert(x, dtype):
    """``_convert_to(x, dtype)``: each device converts its block (ct_op_convert); the sharding
    is kept."""
    if not isinstance(dtype, np.dtype) or dtype == x._dtype or x._donated is not False:
        return None
    try:
        p = _plan_out(_K["CONVERT"], 0, x._shape, dtype, _place_of(x), _axes_of(x))
    except (TypeError, ValueError, KeyError):   # a dtype the kernels do not have
        return None
    return p if _same_devices(x, p) else None


def _plan_transpose(x, axes=None):
    """``transpose(x, axes)`` (``axes`` None or a tuple permutation of the dimensions, at most
    15 of them): each device permutes its block, the mesh axes move with the dimensions."""
    nd = len(x._shape)
    if axes is None:
        axes = tuple(reversed(range(nd)))
    if type(axes) is not tuple or nd > 15 or sorted(axes) != list(range(nd)):
        return None
    xn = _axes_of(x)
    packed = 0
    for d, a in enumerate(axes):
        packed |= a << (4 * d)
    p = _plan_out(_K["TRANSPOSE"], 0, [x._shape[a] for a in axes], x._dtype, _place_of(x),
                  [xn[a] for a in axes], mnk=(packed, 0, 0))
    return p if _same_devices(x, p) else None


def _vjp_transpose(g, out, x, axes=None):
    """The tape rule of :func:`transpose` on the C path: the inverse permutation."""
    nd = x.ndim
    axes = tuple(reversed(range(nd))) if axes is None else axes
    inv = [0] * nd
    for i, a in enumerate(axes):
        inv[a] = i
    return (transpose(g, tuple(inv)),)


def _vjp_reshape(g, out, x, shape):
    """The tape rule of :func:`reshape` on the C path."""
    return (reshape(g, x.shape),)


def _vjp_broadcast_to(g, out, x, shape):
    """The tape rule of :func:`broadcast_to` on the C path."""
    return (_unbroadcast(g, x.shape),)


def _vjp_broadcast_like(g, out, x, like):
    """The tape rule of :func:`_broadcast_like` on the C path (``like`` only gives the shape
    and layout)."""
    return (_unbroadcast(g, x.shape), None)


def _plan_matmul_t(ta: bool, tb: bool):
    """Planner of ``op(a) @ op(b)`` of float32 Arrays (:func:`_matmul`; op transposes a stored
    2-d operand), ``b`` 2-d, both already laid out as :func:`_matmul` wants them: one GEMM
    per device (a's batch folded into M), then the all-reduce over the mesh axes of a
    sharded K. The precision (float32 only on the C path) is checked at every call."""
    def plan(a, b):
        if (type(a) is not Array or type(b) is not Array or a._dtype is not _DT_F32
                or b._dtype is not _DT_F32 or len(a._shape) < 2 or len(b._shape) != 2
                or (ta and len(a._shape) != 2)
                or a._shape[-2 if ta else -1] != b._shape[1 if tb else 0]):
            return None
        try:
            (place, _, _, stay_a, stay_b, out_shape, out_norm, kax, batch, m_loc, n_loc, k_loc,
             b2d) = _id_cached(_MM_PLANS, (a._shape, b._shape, id(a._sharding),
                                           id(b._sharding), ta, tb), a._sharding,
                               b._sharding, _matmul_plan, a, b, ta, tb)
        except ValueError:
            return None
        if not (stay_a and stay_b and b2d):
            return None
        _ensure_blas(n_loc, k_loc)
        groups: list = []
        if kax and not isinstance(place, Device):
            groups = _id_cached(_AR_GROUPS, (id(place), tuple(kax)), place, None,
                                _allreduce_groups, place, tuple(kax))
        p = _plan_out(_K["MATMUL"], int(ta) | int(tb) << 1, out_shape, _DT_F32, place,
                      out_norm, groups=groups, red_op=_RED_SUM,
                      mnk=(batch * m_loc, n_loc, k_loc))
        return p if _same_devices(a, p) and _same_devices(b, p) else None
    return plan


def _vjp_matmul(g, out, a, b):
    """The tape rule of ``a @ b`` on the C path (float32 products)."""
    return _matmul_grads(g, a, b, False, False, _precision_F32)


def _mm_python(ta: bool, tb: bool):
    def mm(a, b):
        return _matmul(a, b, ta, tb, _precision_F32)
    mm.__name__ = mm.__qualname__ = f"_matmul_{'t' if ta else 'n'}{'t' if tb else 'n'}"
    mm.__doc__ = (f"``_matmul(a, b, {ta}, {tb})`` in float32 (the gradients' products): a C "
                  f"plan, or the Python op")
    return mm


# the transposed float32 products of matmul's gradients (_matmul_grads): from C plans
_MM_T = {(ta, tb): _C.Primitive(f"_matmul_{'t' if ta else 'n'}{'t' if tb else 'n'}", 2,
                                _mm_python(ta, tb), _in_process(_plan_matmul_t(ta, tb)))
         for ta in (False, True) for tb in (False, True) if ta or tb}


_UNARY_PRIMS = {"negative": U_NEG, "sin": U_SIN, "cos": U_COS, "tanh": U_TANH,
                "relu": U_RELU, "gelu": U_GELU, "exp": U_EXP, "log": U_LOG, "sqrt": U_SQRT,
                "rsqrt": U_RSQRT, "square": U_SQUARE, "sigmoid": U_SIGMOID, "abs": U_ABS,
                "log1p": U_LOG1P, "expm1": U_EXPM1, "erf": U_ERF, "erfc": U_ERFC,
                "floor": U_FLOOR, "ceil": U_CEIL, "trunc": U_TRUNC, "sign": U_SIGN,
                "round": U_ROUND}
_BINARY_PRIMS = {"add": (B_ADD, (_SR["ADD"], _SR["ADD"])),
                 "subtract": (B_SUB, (_SR["SUB_R"], _SR["SUB_L"])),
                 "multiply": (B_MUL, (_SR["MUL"], _SR["MUL"])),
                 "divide": (B_DIV, (_SR["DIV_R"], _SR["DIV_L"])),
                 "maximum": (B_MAX, (None, None)),
                 "minimum": (B_MIN, (None, None))}


def _rule_unary(d):
    """The tape rule of a unary primitive's C path: as ``_unary`` records ``d``."""
    def rule(g, out, x):
        return (d(g, x, out),)
    return rule


def _rule_binary(da, db, scalar_r, scalar_l):
    """The tape rule of a binary primitive's C path: as ``_binary`` records ``da`` / ``db``
    (then un-broadcast), and for an Array and a Python scalar as the op's scalar form does
    (``scalar_r(g, x, s, out)`` for ``x (op) s``, ``scalar_l`` for ``s (op) x``)."""
    def rule(g, out, a, b):
        if type(a) is Array and type(b) is Array:
            return (_unbroadcast(da(g, a, b, out), a.shape),
                    _unbroadcast(db(g, a, b, out), b.shape))
        if type(a) is Array:
            return (scalar_r(g, a, b, out),)
        return (scalar_l(g, b, a, out),)
    return rule


def _d_scaled(g, x, s, out):          # x * s, s * x
    return multiply(g, float(s))


def _d_over(g, x, s, out):            # x / s: multiply(x, 1 / s)
    s = float(s)
    return multiply(g, 1.0 / s if s != 0.0 else math.copysign(math.inf, s))


def _d_rdiv_s(g, x, s, out):          # s / x
    return _d_rdiv(g, x, out)


_UNARY_VJPS = {"negative": _d_negative, "sin": _d_sin, "cos": _d_cos, "tanh": _d_tanh,
               "relu": _d_relu, "gelu": _d_gelu, "exp": _d_exp, "log": _d_log,
               "sqrt": _d_sqrt, "rsqrt": _d_rsqrt, "square": _d_square,
               "sigmoid": _d_sigmoid, "abs": _d_abs, "log1p": _d_log1p, "expm1": _d_expm1,
               "erf": _d_erf, "erfc": _d_erfc, "floor": _d_zero, "ceil": _d_zero,
               "trunc": _d_zero, "sign": _d_zero, "round": _d_zero}
_BINARY_VJPS = {"add": (_d_pass, _d_pass, _d_pass, _d_pass),
                "subtract": (_d_pass, _d_neg, _d_pass, _d_neg),
                "multiply": (_d_mul_a, _d_mul_b, _d_scaled, _d_scaled),
                "divide": (_d_div_a, _d_div_b, _d_over, _d_rdiv_s),
                "maximum": (_d_max_a, _d_max_b, None, None),
                "minimum": (_d_max_b, _d_max_a, None, None)}


_HOST_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _host_operand_first(fallback, prim):
    """The fallback of a two-operand primitive, which first places a numpy float32 / float64
    operand next to a float32 Array one, as the op would (:func:`_lift_pair`: replicated where
    the Array lives, as float32), and calls the primitive (``prim()``) again, so the C plan
    runs the op: a model applied to a numpy batch takes the C path from its first op on,
    not the Python op. The placed operand's sharding is the op outputs' object for that
    placement (:func:`_sharding_for`), so the plan cache finds it at the next call. Keyword
    arguments pass along where they are None (``precision=None``). Any other call (and
    every call inside a jit trace) goes to ``fallback``."""
    def call(*args, **kwargs):
        if len(args) == 2 and not _C.trace_active() and (
                not kwargs or all(v is None for v in kwargs.values())):
            a, b = args
            ta, tb = type(a), type(b)
            if ta is Array and tb is np.ndarray:
                if a._dtype is _DT_F32 and b.dtype in _HOST_FLOATS:
                    return prim()(a, _lift_host(b, _place_of(a)), **kwargs)
            elif tb is Array and ta is np.ndarray:
                if b._dtype is _DT_F32 and a.dtype in _HOST_FLOATS:
                    return prim()(_lift_host(a, _place_of(b)), b, **kwargs)
        return fallback(*args, **kwargs)
    call.__name__ = call.__qualname__ = getattr(fallback, "__name__", "fallback")
    call.__doc__ = fallback.__doc__
    call.__wrapped__ = fallback
    return call


def _lift_host(x: np.ndarray, place) -> Array:
    """:func:`_lift` of a numpy float array onto ``place``, with the op outputs' sharding
    object for it (replicated)."""
    arr = np.asarray(x, dtype=np.float32)
    return device_put(arr, _sharding_for(place, ((),) * arr.ndim))


def _primitive(name, nin, planner, vjp=None, none_keywords=(), statics=()):
    """Make op ``name`` of this module a primitive; ``statics``: (name, default) of its static
    parameters after the operands, in their positional order."""
    f = globals()[name]
    planner = _in_process(planner)
    # the fallback (any call the C path does not plan) inside a jit trace: one op node
    fallback = _op_node(name)(f)
    if nin == 2:
        fallback = _host_operand_first(fallback, lambda: p)
    p = _C.Primitive(name, nin, fallback, planner, f.__doc__, vjp, tuple(none_keywords),
                     tuple(n for n, _ in statics), tuple(d for _, d in statics))
    p.__module__ = f.__module__
    p.__dict__.update({k: v for k, v in getattr(f, "__dict__", {}).items()
                       if k != "__wrapped__"})
    globals()[name] = p
    return p


def _make_primitives():
    for name, op in _UNARY_PRIMS.items():
        _primitive(name, 1, _plan_unary(op), _rule_unary(_UNARY_VJPS[name]))
    for name, (op, rules) in _BINARY_PRIMS.items():
        _primitive(name, 2, _plan_binary(name, op, rules), _rule_binary(*_BINARY_VJPS[name]))
    _primitive("sum", 1, _plan_sum, _vjp_sum, statics=(("axis", None), ("keepdims", False)))
    _primitive("max", 1, _plan_max, _vjp_max, statics=(("axis", None), ("keepdims", False)))
    _primitive("reshape", 1, _plan_reshape, _vjp_reshape, statics=(("shape", None),))
    _primitive("broadcast_to", 1, _plan_broadcast_to, _vjp_broadcast_to,
               statics=(("shape", None),))
    _primitive("_broadcast_like", 2, _plan_broadcast_like, _vjp_broadcast_like)
    _primitive("_convert_to", 1, _plan_convert, _vjp_convert, statics=(("dtype", None),))
    # where's select (two picks and an add): a float32 Array and a float32 mask
    _primitive("_pick", 2, _plan_binary("_pick", B_PICK, (None, None)), _vjp_pick)
    _primitive("transpose", 1, _plan_transpose, _vjp_transpose, statics=(("axes", None),))
    _primitive("matmul", 2, _plan_matmul_t(False, False), _vjp_matmul,
               none_keywords=("precision",))
    g = globals()
    g["around"] = g["round"]
    # ctrainstate._src.ops.elementwise's comparisons, bitwise and logical ops: bools and
    # ints, never recorded on a tape (nondiff), also the Array's < <= == != > >= & | ^ ~
    typed = [(name, _plan_typed(op, None, compare=True)) for name, op in _CMP.items()]
    typed += [(name, _plan_typed_unary(op, "iub") if name == "invert" else
               _plan_typed(op, "iub")) for name, op in _BITS.items()]
    typed += [(name, _plan_typed_unary(op, "b") if name == "logical_not" else
               _plan_typed(op, "b")) for name, op in _LOGICAL.items()]
    for name, planner in typed:
        f = getattr(ew, name)
        nin = 1 if name in ("invert", "logical_not") else 2
        p = _C.Primitive(name, nin, f, _in_process(planner), f.__doc__)
        p.nondiff = True
        p.__module__ = f.__module__
        setattr(ew, name, p)
    ew.bitwise_not = ew.invert
    _C.dispatch_register_typed(*(getattr(ew, name) for name in (*_CMP, *_BITS)))
    _C.dispatch_register(_tls, _Tape, _precision._tls, NamedSharding, g["add"], g["subtract"],
                         g["multiply"], g["divide"], g["negative"], g["matmul"])
    _derivative_programs()
    for name in (*_UNARY_PRIMS, *_BINARY_PRIMS):
        g[name].vjp16 = _rule16(g[name])


def _rule16(p):
    """The tape rule of primitive ``p`` called on 16-bit float operands, which its C plan
    runs as one kernel (widened, the float32 op, rounded back). It gives the bits of what the
    Python op's float32 policy records (each operand converted to float32, the float32 op, its
    result converted back), run backwards: the cotangent converted to float32, ``p``'s float32
    rule (on the float32 result, computed again: the same kernel, the same bits), each
    operand's cotangent converted back to the operand's dtype."""
    f32 = _dtypes.float32

    def rule(g, out, *ops):
        ops32 = [astype(o, f32) if type(o) is Array and o.dtype != f32 else o for o in ops]
        gs = p.vjp(g if g.dtype == f32 else astype(g, f32), p(*ops32), *ops32)
        return tuple(c if c is None or type(o) is not Array or c.dtype == o.dtype
                     else astype(c, o.dtype) for c, o in zip(gs, ops))
    return rule


# --- derivative programs: tape rules run in C (_C.VjpProgram, csrc/python/py_dispatch.c) ----
# The rules below are the Python rules above (_d_*, _vjp_matmul) written as the primitive
# calls they make, in the same order, so the C backward pass calls no Python for them. A
# program's registers: g, the output, the operands; each step's result is the next register.

_G, _OUT, _A, _B = 0, 1, 2, 3


def _t(k):
    """The register of a program's k-th step's result."""
    return 4 + k


def _program(*steps, outs):
    return (tuple(steps), tuple(outs))


def _derivative_programs():
    g = globals()
    P = _program
    mul, neg, sub, div = g["multiply"], g["negative"], g["subtract"], g["divide"]
    unary = {
        "negative": P((neg, _G), outs=(_t(0),)),                                  # _d_negative
        "sin": P((g["cos"], _A), (mul, _G, _t(0)), outs=(_t(1),)),                # _d_sin
        "cos": P((g["sin"], _A), (mul, _G, _t(0)), (neg, _t(1)), outs=(_t(2),)),  # _d_cos
        "tanh": P((g["square"], _OUT), (sub, 1.0, _t(0)), (mul, _G, _t(1)),       # _d_tanh
                  outs=(_t(2),)),
        "exp": P((mul, _G, _OUT), outs=(_t(0),)),                                 # _d_exp
        "log": P((div, _G, _A), outs=(_t(0),)),                                   # _d_log
        "sqrt": P((mul, _G, 0.5), (div, _t(0), _OUT), outs=(_t(1),)),             # _d_sqrt
        "square": P((mul, _A, 2.0), (mul, _G, _t(0)), outs=(_t(1),)),             # _d_square
        "sigmoid": P((sub, 1.0, _OUT), (mul, _OUT, _t(0)), (mul, _G, _t(1)),      # _d_sigmoid
                     outs=(_t(2),)),
    }
    # (both Arrays, un-broadcast after; Array (op) scalar; scalar (op) Array): _BINARY_VJPS
    binary = {
        "add": (P(outs=(_G, _G)), P(outs=(_G,)), P(outs=(_G,))),
        "subtract": (P((neg, _G), outs=(_G, _t(0))), P(outs=(_G,)), P((neg, _G), outs=(_t(0),))),
        "multiply": (P((mul, _G, _B), (mul, _G, _A), outs=(_t(0), _t(1))),
                     P((float, _B), (mul, _G, _t(0)), outs=(_t(1),)),          # _d_scaled
                     P((float, _A), (mul, _G, _t(0)), outs=(_t(1),))),
        "divide": (P((div, _G, _B), (div, _OUT, _B), (mul, _G, _t(1)), (neg, _t(2)),
                     outs=(_t(0), _t(3))),
                   None,                                                        # _d_over
                   P((div, -1.0, _B), (mul, _OUT, _t(0)), (mul, _G, _t(1)),    # _d_rdiv
                     outs=(_t(2),))),
        # _vjp_matmul of 2-d operands: g @ b^T and a^T @ g (_matmul_grads)
        "matmul": (P((_MM_T[False, True], _G, _B), (_MM_T[True, False], _A, _G),
                     outs=(_t(0), _t(1))), None, None),
    }
    for name, prog in unary.items():
        g[name].vjp = _C.VjpProgram((prog,), g[name].vjp, _unbroadcast)
    for name, cases in binary.items():
        g[name].vjp = _C.VjpProgram(cases, g[name].vjp, _unbroadcast,
                                    1 if name == "matmul" else 0)
    # un-broadcasting a two-Array program's cotangent (_unbroadcast) and sum's rule
    # (_vjp_sum, flag 2) call these primitives from C
    _C.vjp_register(g["sum"], g["reshape"], g["_broadcast_like"])
    g["sum"].vjp = _C.VjpProgram((None,), g["sum"].vjp, _unbroadcast, _VP_SUM)


_VP_SUM = 2   # VjpProgram's flag: the rule of a sum (axis the 4th argument), in C


# ops without a C plan that read host values: single nodes of a jitted program (node.py)
from . import node as _node  # noqa: E402
from .node import op_node as _op_node  # noqa: E402

_node._bind(sys.modules[__name__])

_make_primitives()

take_rows = _op_node("take_rows")(take_rows)
_matmul = _op_node("_matmul")(_matmul)   # batched and transposed products (no C plan)
# the kernel calls the Python ops are made of (their callers record the derivatives)
_unary_raw = _op_node("_unary_raw", raw=True)(_unary_raw)
_binary_raw = _op_node("_binary_raw", raw=True)(_binary_raw)
_reduce_raw = _op_node("_reduce_raw", raw=True)(_reduce_raw)
_integer_pow_raw = _op_node("_integer_pow_raw", raw=True)(_integer_pow_raw)
_convert = _op_node("_convert", raw=True)(_convert)
_copy = _op_node("_copy", raw=True)(_copy)
_put_node = _op_node("device_put", raw=True)(device_put)


def _put(x: Array, sharding) -> Array:
    """``device_put(x, sharding)`` of an Array; inside a jit trace a reshard is an op node of
    the program, and an Array already placed so is ``x`` itself (no node, no copy)."""
    cur = x._sharding
    if cur is sharding or (type(sharding) is type(cur) and cur == sharding):
        return x
    return _put_node(x, sharding)
