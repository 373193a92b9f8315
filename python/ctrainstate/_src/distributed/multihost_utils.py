"""The implementation of :mod:`ctrainstate.experimental.multihost_utils` (which re-exports its API; the module
docstring is there)."""
import hashlib as _hashlib

import numpy as _np

from ... import _C
from . import distributed as _dist
from ..base import tree_util as _tree_util

__all__ = ["sync_global_devices", "process_allgather", "broadcast_one_to_all", "assert_equal"]

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
    host). Arrays spanning processes are not supported yet.
    """
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
