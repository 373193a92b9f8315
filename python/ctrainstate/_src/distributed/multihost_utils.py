"""The implementation of :mod:`ctrainstate.experimental.multihost_utils` (which re-exports its API; the module
docstring is there)."""
import hashlib as _hashlib

import numpy as _np

from ... import _C
from . import distributed as _dist
from ..array.array import Array as _Array, _alloc_blocks, device_put as _device_put
from ..array.sharding import Mesh as _Mesh, NamedSharding as _NamedSharding
from ..array.sharding import PartitionSpec as _P
from ..base import tree_util as _tree_util

__all__ = ["sync_global_devices", "process_allgather", "broadcast_one_to_all", "assert_equal",
           "host_local_array_to_global_array", "global_array_to_host_local_array"]

_MAX_BYTES = (1 << 31) - 1  # one MPI call moves at most this many bytes per process


def _world() -> int:
    return _dist.process_count() if _dist.is_initialized() else 1


def _allgather_bytes(buf: _np.ndarray) -> _np.ndarray:
    """(process_count(), buf.size) uint8: every process's bytes."""
    out = _np.empty((_world(), buf.size), _np.uint8)
    if _dist.is_initialized():
        _C.dist_allgather(buf, out, _dist.default_timeout())
    else:
        out[0] = buf
    return out


def _digest(text: str) -> _np.ndarray:
    return _np.frombuffer(_hashlib.blake2b(text.encode(), digest_size=16).digest(), _np.uint8)


def _same_everywhere(text: str, what: str) -> None:
    """Raise AssertionError on every process unless every process passed the same ``text``
    (one allgather of a digest; the texts themselves are gathered only to explain a
    difference)."""
    digests = _allgather_bytes(_digest(text))
    if (digests == digests[:1]).all():
        return
    data = _np.frombuffer(text.encode(), _np.uint8)
    lengths = _allgather_bytes(_np.array([data.size], _np.int64).view(_np.uint8))
    lengths = lengths.view(_np.int64)[:, 0]
    padded = _np.zeros(int(lengths.max()), _np.uint8)
    padded[:data.size] = data
    texts = _allgather_bytes(padded)
    seen = [bytes(texts[p, :lengths[p]]).decode(errors="replace") for p in range(len(lengths))]
    differ = [p for p in range(len(seen)) if seen[p] != seen[0]]
    raise AssertionError(f"{what}: processes {differ} differ from process 0: "
                         + "; ".join(f"process {p}: {seen[p]}" for p in [0] + differ))


def _leaves(in_tree, what: str):
    leaves, treedef = _tree_util.tree_flatten(in_tree)
    arrays = [_dist._host(x, what) for x in leaves]
    sig = f"{treedef}; " + ", ".join(f"{a.dtype.name}{list(a.shape)}" for a in arrays)
    return arrays, treedef, sig


def _is_global(x) -> bool:
    """An Array that spans processes (not fully addressable)."""
    return isinstance(x, _Array) and not x.is_fully_addressable


def _global_sig(x) -> str:
    s = x.sharding
    where = (f"{s.mesh.device_ids.tolist()} {tuple(s.mesh.axis_names)} {tuple(s._norm_spec())}"
             if isinstance(s, _NamedSharding) else repr(s))
    return f"global {x.dtype.name}{list(x.shape)} on {where}"


def _pack(arrays) -> _np.ndarray:
    """The leaves' bytes, one after another, in a new uint8 array."""
    if not arrays:
        return _np.zeros(0, _np.uint8)
    return _np.concatenate([a.reshape(-1).view(_np.uint8) for a in arrays])


def sync_global_devices(name: str) -> None:
    """Wait until every process has called ``sync_global_devices`` with this ``name``
    (a barrier). Raises ``AssertionError`` on every process if they passed different names.
    Without ``distributed.initialize()`` it returns at once."""
    if not isinstance(name, str):
        raise TypeError(f"sync_global_devices: name must be a str, got {type(name).__name__}")
    _same_everywhere(name, "sync_global_devices name mismatch")


def process_allgather(in_tree, tiled: bool = False):
    """Every process's ``in_tree``, on every process: a pytree of numpy arrays, each leaf
    stacked along a new axis 0 (shape ``(process_count(), *shape)``) or, with
    ``tiled=True``, concatenated along axis 0. Every process passes the same tree
    structure, shapes and dtypes (``AssertionError`` on every process otherwise).

    Leaves are numpy arrays, scalars or ctrainstate Arrays of this process (copied to the
    host). A leaf that is an Array spanning processes (``is_fully_addressable`` False)
    comes back whole, as one numpy array of its global shape (``tiled`` does not apply to
    it, as in jax): each of its blocks is sent by the process that holds the block's
    primary copy.
    """
    leaves, treedef = _tree_util.tree_flatten(in_tree)
    glob = [i for i, x in enumerate(leaves) if _is_global(x)]
    if glob:
        local = [x for x in leaves if not _is_global(x)]
        arrays, _, sig = _leaves(local, "process_allgather")
        sig += "; " + ", ".join(f"{i}: {_global_sig(leaves[i])}" for i in glob)
        sig = f"{treedef}; " + sig
        if tiled and any(a.ndim == 0 for a in arrays):
            raise ValueError("process_allgather(tiled=True): a scalar leaf cannot be "
                             "concatenated along axis 0; use tiled=False")
        _same_everywhere(sig, "process_allgather: tree structure, shapes, dtypes or "
                              "shardings differ")
        gathered = [_dist._gather_global(leaves[i]) for i in glob]
        rest = iter(_tree_util.tree_leaves(process_allgather(local, tiled)) if local else [])
        whole = iter(gathered)
        out = [next(whole) if _is_global(x) else next(rest) for x in leaves]
        return _tree_util.tree_unflatten(treedef, out)
    arrays, treedef, sig = _leaves(in_tree, "process_allgather")
    if tiled and any(a.ndim == 0 for a in arrays):
        raise ValueError("process_allgather(tiled=True): a scalar leaf cannot be concatenated "
                         "along axis 0; use tiled=False")
    _same_everywhere(sig, "process_allgather: tree structure, shapes or dtypes differ")
    n = _world()
    buf = _pack(arrays)
    if buf.size <= _MAX_BYTES:
        gathered = _allgather_bytes(buf)
        out, off = [], 0
        for a in arrays:
            part = gathered[:, off:off + a.nbytes]
            out.append(_np.ascontiguousarray(part).view(a.dtype).reshape((n,) + a.shape))
            off += a.nbytes
    else:  # one call per leaf (each at most 2**31 - 1 elements per process)
        out = []
        for a in arrays:
            o = _np.empty((n,) + a.shape, a.dtype)
            if _dist.is_initialized():
                _C.dist_allgather(a, o, _dist.default_timeout())
            else:
                o[0] = a
            out.append(o)
    if tiled:
        out = [o.reshape((n * a.shape[0],) + a.shape[1:]) for o, a in zip(out, arrays)]
    return _tree_util.tree_unflatten(treedef, out)


def broadcast_one_to_all(in_tree, is_source: bool | None = None):
    """The source process's ``in_tree``, on every process, as numpy arrays (jax returns jax
    Arrays). ``is_source`` defaults to ``process_index() == 0``; exactly one process must
    be the source. Every process passes the same tree structure, shapes and dtypes."""
    arrays, treedef, sig = _leaves(in_tree, "broadcast_one_to_all")
    me = _dist.process_index() if _dist.is_initialized() else 0
    src = (me == 0) if is_source is None else bool(is_source)
    flags = _allgather_bytes(_np.array([src], _np.uint8))[:, 0]
    sources = [int(p) for p in _np.flatnonzero(flags)]
    if len(sources) != 1:
        raise ValueError(f"broadcast_one_to_all: exactly one process must be the source; "
                         f"{'processes ' + str(sources) + ' are' if sources else 'none is'}")
    _same_everywhere(sig, "broadcast_one_to_all: tree structure, shapes or dtypes differ")
    if not _dist.is_initialized():
        return _tree_util.tree_unflatten(treedef, [_np.array(a, copy=True) for a in arrays])
    buf = _pack(arrays)
    if buf.size <= _MAX_BYTES:
        _C.dist_broadcast(buf, sources[0], _dist.default_timeout())
        out, off = [], 0
        for a in arrays:
            out.append(buf[off:off + a.nbytes].copy().view(a.dtype).reshape(a.shape))
            off += a.nbytes
    else:  # one call per leaf
        out = [_np.array(a, copy=True) for a in arrays]
        for o in out:
            _C.dist_broadcast(o, sources[0], _dist.default_timeout())
    return _tree_util.tree_unflatten(treedef, out)


def assert_equal(in_tree, fail_message: str = "") -> None:
    """Raise ``AssertionError`` on a process whose ``in_tree`` differs from process 0's (as
    jax's does: the other processes return normally)."""
    expected = broadcast_one_to_all(in_tree)
    got = _tree_util.tree_leaves(in_tree)
    want = _tree_util.tree_leaves(expected)
    if not all(_np.array_equal(_np.asarray(g), w) for g, w in zip(got, want)):
        raise AssertionError(f"{fail_message} Expected: {expected}; got: {in_tree}.")


def _spec_leaves(pspecs, tree, who: str) -> list:
    """``pspecs`` (a PartitionSpec, None, or a pytree of them that is a prefix of
    ``tree``) as one PartitionSpec per leaf of ``tree``."""
    is_spec = lambda v: v is None or isinstance(v, _P)   # noqa: E731
    n = len(_tree_util.tree_leaves(tree))
    if is_spec(pspecs):
        return [_P() if pspecs is None else pspecs] * n
    s_leaves, s_td = _tree_util.tree_flatten(pspecs, is_leaf=is_spec)
    for v in s_leaves:
        if not is_spec(v):
            raise TypeError(f"{who}: pspecs holds a {type(v).__name__}, not a PartitionSpec")
    try:
        subtrees = _tree_util._flatten_up_to(s_td, tree)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{who}: pspecs' tree is not a prefix of the inputs' tree ({e})") from None
    out = []
    for spec, sub in zip(s_leaves, subtrees):
        out += [_P() if spec is None else spec] * len(_tree_util.tree_leaves(sub))
    return out


def _check_mesh(mesh, who: str) -> _Mesh:
    if not isinstance(mesh, _Mesh):
        raise TypeError(f"{who}: global_mesh must be a Mesh, got {type(mesh).__name__}")
    return mesh


def _scaled_shape(shape, spec, big: _Mesh, small: _Mesh, grow: bool, who: str) -> tuple:
    """``shape`` with each dimension that ``spec`` splits scaled by the product of its mesh
    axes' sizes in ``big`` over that in ``small`` (times it when ``grow``, else divided)."""
    spec = tuple(spec)
    if len(spec) > len(shape):
        raise ValueError(f"{who}: {_P(*spec)!r} has {len(spec)} entries for an array of rank "
                         f"{len(shape)}")
    out = list(shape)
    for d, e in enumerate(spec):
        if e is None:
            continue
        axes = (e,) if isinstance(e, str) else tuple(e)
        for a in axes:
            if a not in big.shape:
                raise ValueError(f"{who}: {_P(*spec)!r} names mesh axis {a!r}, which "
                                 f"{big!r} does not have")
        f_big = int(_np.prod([big.shape[a] for a in axes]))
        f_small = int(_np.prod([small.shape[a] for a in axes]))
        if grow:
            out[d] = shape[d] * f_big // f_small
        else:
            if (shape[d] * f_small) % f_big:
                raise ValueError(f"{who}: dimension {d} ({shape[d]}) does not split over "
                                 f"{f_big // f_small} processes' parts along {axes}")
            out[d] = shape[d] * f_small // f_big
    return tuple(out)


def _same_blocks(x: _Array, shape: tuple, sharding) -> _Array:
    """A new Array of ``shape`` and ``sharding`` whose block on each of this process's
    devices is a copy of ``x``'s block on that device (the shard shapes agree)."""
    shard_shape, blocks = _alloc_blocks(shape, x.dtype, sharding, addressable=True)
    src = {dev: buf for dev, buf, _, _ in x._blocks}
    if tuple(x._shard_shape) != tuple(shard_shape) or set(src) != {b[0] for b in blocks}:
        raise ValueError(f"internal error: the shards of {x.shape} under {x.sharding!r} and of "
                         f"{shape} under {sharding!r} differ")
    zero = (0,) * len(shard_shape)
    for dev, buf, _, _ in blocks:
        _C.copy_overlap(buf, zero, src[dev], zero)
    return _Array._create(shape, x.dtype, sharding, blocks)


def host_local_array_to_global_array(local_inputs, global_mesh, pspecs):
    """Each process's host-local values as Arrays over ``global_mesh`` (jax's
    ``multihost_utils.host_local_array_to_global_array``): a leaf is placed on this
    process's part of the mesh (``global_mesh.local_mesh``) with its PartitionSpec, and
    the pieces of all processes make one global Array, each dimension that the spec splits
    over mesh axes that span processes growing by the number of processes' parts (a batch
    of 8 rows per process over ``P('data')`` on 2 processes is a global batch of 16).

    ``pspecs``: a PartitionSpec (or None) for every leaf, or a pytree of them that is a
    prefix of ``local_inputs``. A leaf that already spans processes is returned as it is.
    The Arrays made own their buffers (copies, where jax shares the input's).

    >>> import numpy as np, ctrainstate as cts
    >>> from ctrainstate.experimental import multihost_utils
    >>> mesh = cts.make_mesh((1,), ('data',))
    >>> g = multihost_utils.host_local_array_to_global_array(
    ...     np.float32([1, 2]), mesh, cts.P('data'))
    >>> g.shape
    (2,)
    """
    who = "host_local_array_to_global_array"
    mesh = _check_mesh(global_mesh, who)
    leaves, treedef = _tree_util.tree_flatten(local_inputs)
    specs = _spec_leaves(pspecs, local_inputs, who)
    local_mesh = mesh.local_mesh
    out = []
    for x, spec in zip(leaves, specs):
        if _is_global(x):
            out.append(x)
            continue
        out.append(_to_global(x, spec, mesh, local_mesh, who))
    return _tree_util.tree_unflatten(treedef, out)


def _to_global(x, spec, mesh, local_mesh, who):
    local_sharding = _NamedSharding(local_mesh, spec)
    placed = _device_put(x, local_sharding)
    gshape = _scaled_shape(tuple(placed.shape), spec, mesh, local_mesh, True, who)
    return _same_blocks(placed, gshape, _NamedSharding(mesh, spec))


def global_array_to_host_local_array(global_inputs, global_mesh, pspecs):
    """The inverse of :func:`host_local_array_to_global_array`: each Array that spans
    processes as this process's part of it, an Array over ``global_mesh.local_mesh`` with
    the same PartitionSpec (dimensions split over mesh axes that span processes shrink by
    the number of processes' parts). A leaf that is fully addressable is returned as it
    is, as in jax. The Arrays made own their buffers (copies)."""
    who = "global_array_to_host_local_array"
    mesh = _check_mesh(global_mesh, who)
    leaves, treedef = _tree_util.tree_flatten(global_inputs)
    specs = _spec_leaves(pspecs, global_inputs, who)
    local_mesh = mesh.local_mesh
    out = []
    for x, spec in zip(leaves, specs):
        if not _is_global(x):
            out.append(x)
            continue
        want = _NamedSharding(mesh, spec)
        if x.sharding != want:
            raise ValueError(f"{who}: an Array of {x.sharding!r} does not have the sharding "
                             f"{want!r} that global_mesh and its PartitionSpec give")
        lshape = _scaled_shape(tuple(x.shape), spec, mesh, local_mesh, False, who)
        out.append(_same_blocks(x, lshape, _NamedSharding(local_mesh, spec)))
    return _tree_util.tree_unflatten(treedef, out)
