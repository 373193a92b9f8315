"""The implementation of :mod:`ctrainstate.checkpoint.pretrained` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import json
import os
import struct
import threading
import numpy as np

from ... import _C
from ..array.abstract import ShapeDtypeStruct
from ..partitioning.rules import set_partitions
from ..array.array import Array, _alloc_blocks, _as_sharding, _buffer_view
from ..array.sharding import Mesh, NamedSharding, PartitionSpec
from . import fileio as _io, store as _store
from ..nn.meta import unbox
from ..serialization.serialization import _unpack_ext, to_state_dict

__all__ = ["load_pretrained_params", "read_pretrained_shapes"]

_CHUNKED = "__msgpack_chunked_array__"


class _Stored:
    """An array in a file: its fd, byte segments, shape, dtype."""
    __slots__ = ("fd", "segments", "shape", "dtype", "file")

    def __init__(self, fd, segments, shape, dtype, file):
        self.fd, self.segments, self.shape, self.dtype = fd, segments, tuple(shape), dtype
        self.file = file


# --- Flax msgpack ---------------------------------------------------------------------------

class _Walker:
    """Positions of the values of a msgpack file, read through pread in small pieces."""

    def __init__(self, fd, path):
        self.fd, self.path = fd, path
        self.size = os.fstat(fd).st_size
        self._cache_off, self._cache = 0, b""

    def bytes(self, pos, n) -> bytes:
        c0 = self._cache_off
        if not (c0 <= pos and pos + n <= c0 + len(self._cache)):
            want = max(n, 1 << 16)
            self._cache = os.pread(self.fd, min(want, self.size - pos), pos)
            self._cache_off = pos
            if len(self._cache) < n:
                raise ValueError(f"{self.path}: msgpack data ends early (truncated file)")
        return self._cache[pos - self._cache_off:pos - self._cache_off + n]

    def _uint(self, pos, n) -> int:
        return int.from_bytes(self.bytes(pos, n), "big")

    def header(self, pos):
        """(kind, count or length, position of the payload) of the value at ``pos``; kinds:
        'map', 'array', 'str', 'bin', 'ext' (count: (type, length)), 'scalar' (count: its
        total size)."""
        t = self.bytes(pos, 1)[0]
        if t <= 0x7f or t >= 0xe0 or t in (0xc0, 0xc2, 0xc3):
            return "scalar", 1, pos
        if 0x80 <= t <= 0x8f:
            return "map", t & 0x0f, pos + 1
        if 0x90 <= t <= 0x9f:
            return "array", t & 0x0f, pos + 1
        if 0xa0 <= t <= 0xbf:
            return "str", t & 0x1f, pos + 1
        sizes = {0xc4: 1, 0xc5: 2, 0xc6: 4}
        if t in sizes:
            n = sizes[t]
            return "bin", self._uint(pos + 1, n), pos + 1 + n
        sizes = {0xc7: 1, 0xc8: 2, 0xc9: 4}
        if t in sizes:
            n = sizes[t]
            length = self._uint(pos + 1, n)
            code = struct.unpack("b", self.bytes(pos + 1 + n, 1))[0]
            return "ext", (code, length), pos + 2 + n
        fixed = {0xd4: 1, 0xd5: 2, 0xd6: 4, 0xd7: 8, 0xd8: 16}
        if t in fixed:
            code = struct.unpack("b", self.bytes(pos + 1, 1))[0]
            return "ext", (code, fixed[t]), pos + 2
        scalars = {0xca: 5, 0xcb: 9, 0xcc: 2, 0xcd: 3, 0xce: 5, 0xcf: 9, 0xd0: 2, 0xd1: 3,
                   0xd2: 5, 0xd3: 9}
        if t in scalars:
            return "scalar", scalars[t], pos
        sizes = {0xd9: 1, 0xda: 2, 0xdb: 4}
        if t in sizes:
            n = sizes[t]
            return "str", self._uint(pos + 1, n), pos + 1 + n
        if t in (0xdc, 0xdd):
            n = 2 if t == 0xdc else 4
            return "array", self._uint(pos + 1, n), pos + 1 + n
        if t in (0xde, 0xdf):
            n = 2 if t == 0xde else 4
            return "map", self._uint(pos + 1, n), pos + 1 + n
        raise ValueError(f"{self.path}: not a Flax msgpack file (byte 0x{t:02x} at {pos})")

    def skip_small(self, pos):
        """(decoded value, end) of a value that is not a map (shapes, names, scalars)."""
        import msgpack
        end = self.end(pos)
        return msgpack.unpackb(self.bytes(pos, end - pos), raw=False,
                               strict_map_key=False), end

    def end(self, pos) -> int:
        kind, n, p = self.header(pos)
        if kind == "scalar":
            return pos + n
        if kind in ("str", "bin"):
            return p + n
        if kind == "ext":
            return p + n[1]
        for _ in range(n * (2 if kind == "map" else 1)):
            p = self.end(p)
        return p

    def value(self, pos):
        """(value, end): maps as dicts, Flax arrays as _Stored, other values decoded."""
        kind, n, p = self.header(pos)
        if kind == "map":
            out = {}
            for _ in range(n):
                key, p = self.skip_small(p)
                out[str(key)], p = self.value(p)
            return out, p
        if kind == "array":
            items = []
            for _ in range(n):
                v, p = self.value(p)
                items.append(v)
            return items, p
        if kind == "ext" and n[0] == 1:   # Flax's ndarray: (shape, dtype name, raw bytes)
            akind, count, q = self.header(p)
            if akind != "array" or count != 3:
                raise ValueError(f"{self.path}: malformed array at byte {pos}")
            shape, q = self.skip_small(q)
            name, q = self.skip_small(q)
            bkind, length, data = self.header(q)
            if bkind != "bin":
                raise ValueError(f"{self.path}: malformed array at byte {pos}")
            dtype = _io.np_dtype(name)
            return _Stored(self.fd, [(data, length)], shape, dtype, self.path), p + n[1]
        if kind == "ext":   # numpy scalars and complex numbers: small
            return _unpack_ext(n[0], self.bytes(p, n[1])), p + n[1]
        return self.skip_small(pos)


def _unchunk(tree):
    if isinstance(tree, dict):
        if _CHUNKED in tree:
            shape = tuple(tree["shape"][str(i)] for i in range(len(tree["shape"])))
            chunks = [tree["chunks"][str(i)] for i in range(len(tree["chunks"]))]
            segs = [s for c in chunks for s in c.segments]
            return _Stored(chunks[0].fd, segs, shape, chunks[0].dtype, chunks[0].file)
        return {k: _unchunk(v) for k, v in tree.items()}
    return tree


def _open_msgpack(path, fds):
    fd = os.open(path, os.O_RDONLY)
    fds.append(fd)
    tree, end = _Walker(fd, path).value(0)
    return _unchunk(tree)


# --- safetensors ------------------------------------------------------------------------------

def _open_safetensors(path, fds, sep):
    fd = os.open(path, os.O_RDONLY)
    fds.append(fd)
    header, base = _io.read_safetensors_header(fd, path)
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        a, b = h["data_offsets"]
        stored = _Stored(fd, [(base + a, b - a)], h["shape"], _io.np_dtype(h["dtype"]), path)
        d = out
        keys = name.split(sep)
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = stored
    return out


def _merge(a: dict, b: dict) -> dict:
    for k, v in b.items():
        if k in a and isinstance(a[k], dict) and isinstance(v, dict):
            _merge(a[k], v)
        else:
            a[k] = v
    return a


def _open_any(path, fds, sep):
    path = os.fspath(path)
    if os.path.isdir(path):
        for name in ("model.safetensors.index.json", "model.safetensors",
                     "flax_model.msgpack.index.json", "flax_model.msgpack"):
            if os.path.exists(os.path.join(path, name)):
                return _open_any(os.path.join(path, name), fds, sep)
        raise FileNotFoundError(f"{path} holds none of model.safetensors(.index.json), "
                                f"flax_model.msgpack(.index.json)")
    if path.endswith(".index.json"):
        with open(path) as f:
            index = json.load(f)
        root = os.path.dirname(path)
        tree: dict = {}
        for file in dict.fromkeys(index["weight_map"].values()):
            _merge(tree, _open_any(os.path.join(root, file), fds, sep))
        return tree
    if path.endswith(".safetensors"):
        return _open_safetensors(path, fds, sep)
    return _open_msgpack(path, fds)


def read_pretrained_shapes(path, *, sep: str = "."):
    """The parameter tree of a pretrained file or directory with each array as a
    ``ShapeDtypeStruct`` (nothing but headers is read).

    >>> import os, tempfile, numpy as np
    >>> from safetensors.numpy import save_file
    >>> from ctrainstate.checkpoint import read_pretrained_shapes
    >>> p = os.path.join(tempfile.mkdtemp(), 'model.safetensors')
    >>> save_file({'dense.kernel': np.zeros((3, 2), np.float32)}, p)
    >>> read_pretrained_shapes(p)
    {'dense': {'kernel': ShapeDtypeStruct(shape=(3, 2), dtype=float32)}}
    """
    fds: list = []
    try:
        tree = _open_any(path, fds, sep)
    finally:
        for fd in fds:
            os.close(fd)
    return _map(tree, lambda s: ShapeDtypeStruct(s.shape, s.dtype))


def _map(tree, fn, keys=()):
    if isinstance(tree, dict):
        return {k: _map(v, fn, keys + (k,)) for k, v in tree.items()}
    return fn(tree) if isinstance(tree, _Stored) else tree


def _flat(tree, keys=()):
    if isinstance(tree, dict):
        out = []
        for k, v in tree.items():
            out.extend(_flat(v, keys + (str(k),)))
        return out
    return [(keys, tree)]


def _place(stored: _Stored, name, shape, dtype, sharding) -> Array:
    """An Array of ``sharding`` whose every block is read from the byte runs it covers: on
    CPU devices straight into the device buffers (a few blocks at a time), on others through
    one host block at a time."""
    shard_shape, blocks = _alloc_blocks(shape, dtype, sharding)
    src = _io.Source(stored.fd, stored.segments, stored.shape, stored.dtype,
                     f"{name} in {stored.file}")
    local = threading.local()

    def scratch():
        if getattr(local, "buf", None) is None:
            local.buf = np.empty(_io.SLICE_BYTES, np.uint8)
        return local.buf

    def read(lo, out):
        hi = tuple(a + n for a, n in zip(lo, shard_shape))
        _io.read_box(src, lo, hi, out, scratch())

    def cast_into(lo, view):
        host = np.empty(shard_shape, stored.dtype)
        read(lo, host)
        view[...] = host

    firsts, direct, staged = {}, [], []
    for dev, buf, start, rid in blocks:
        if rid != 0:
            continue
        lo = tuple(start)
        firsts[lo] = buf
        if dev.platform == "cpu":
            view = _buffer_view(buf, shard_shape, dtype)
            direct.append(lambda lo=lo, v=view: read(lo, v) if dtype == stored.dtype
                          else cast_into(lo, v))
        else:
            staged.append((lo, buf))
    _io.run_parallel(direct)
    for lo, buf in staged:
        host = np.empty(shard_shape, stored.dtype)
        read(lo, host)
        if dtype != stored.dtype:
            host = host.astype(dtype)
        _C.copy_from_host(buf, host.view(np.uint8) if dtype == np.bool_ else host,
                          (0,) * len(shard_shape))
    for dev, buf, start, rid in blocks:
        if rid != 0:
            _C.copy_bytes(buf, firsts[tuple(start)])
    return Array._create(shape, dtype, sharding, blocks)


def load_pretrained_params(path, target=None, *, mesh: Mesh | None = None, rules=None,
                           dtype=None, cast: bool = False, sep: str = "."):
    """Parameters of a HuggingFace Flax checkpoint, born sharded.

    ``path``: a ``flax_model.msgpack`` or ``model.safetensors`` file, a sharded
    ``*.index.json`` (its ``weight_map`` names the files), or a directory holding one of
    them. Safetensors keys are the '.'-joined parameter paths (``sep``), as HF's Flax
    ``save_pretrained(safe_serialization=True)`` writes them.

    Where each array goes, in order of precedence: ``target``, a params tree of Arrays or
    ``ShapeDtypeStruct`` (``eval_shape`` of an init under a mesh and axis rules), whose
    shardings, shapes and dtypes the file must match (``cast=True`` converts dtypes; the
    ``nn.Partitioned`` boxes of an ``eval_shape(model.init, ...)`` are looked through);
    ``rules`` with ``mesh``, HF's regex partition rules (``(regex tuple, PartitionSpec)``, as
    :func:`ctrainstate.hf.partitions.set_partitions` takes them); ``mesh`` alone: replicated
    over it; else the default device. ``dtype`` converts every floating array. Each device
    reads only the byte runs of its own block (``pread``), so host memory beyond the result
    stays within a scratch buffer (4 MiB) per I/O thread, one block on GPU devices.

    >>> import os, tempfile, numpy as np, ctrainstate as cts
    >>> from safetensors.numpy import save_file
    >>> from ctrainstate import P
    >>> from ctrainstate.checkpoint import load_pretrained_params
    >>> p = os.path.join(tempfile.mkdtemp(), 'model.safetensors')
    >>> save_file({'wte.embedding': np.arange(16, dtype=np.float32).reshape(8, 2)}, p)
    >>> mesh = cts.make_mesh((1,), ('mp',))
    >>> params = load_pretrained_params(p, mesh=mesh, rules=[(('wte', 'embedding'), P('mp', None))])
    >>> params['wte']['embedding'].sharding.spec, np.asarray(params['wte']['embedding'])[3].tolist()
    (PartitionSpec('mp', None), [6.0, 7.0])
    """
    fds: list = []
    try:
        tree = _open_any(path, fds, sep)
        stored = dict(_flat(tree))
        if target is not None:
            tflat = dict(_store.flatten(to_state_dict(unbox(target))))
            missing = sorted("/".join(k) for k in tflat if k not in stored
                             and not (isinstance(tflat[k], dict) and not tflat[k]))
            extra = sorted("/".join(k) for k in stored if k not in tflat)
            if missing or extra:
                raise ValueError(
                    f"{path} does not match the target: "
                    + (f"missing {', '.join(missing[:8])}" if missing else "")
                    + ("; " if missing and extra else "")
                    + (f"not in the target {', '.join(extra[:8])}" if extra else ""))
        elif rules is not None:
            if mesh is None:
                raise ValueError("load_pretrained_params: rules need a mesh")
            shapes = _map(tree, lambda s: ShapeDtypeStruct(s.shape, s.dtype))
            specs = dict(_flat(set_partitions(shapes, rules)))
        out = []
        for keys, s in stored.items():
            name = "/".join(keys)
            if not isinstance(s, _Stored):
                out.append((keys, s))
                continue
            want = s.dtype
            if dtype is not None and (s.dtype.kind == "f" or s.dtype.name == "bfloat16"):
                want = np.dtype(dtype)
            if target is not None:
                t = tflat[keys]
                if tuple(t.shape) != s.shape:
                    raise ValueError(f"{name} has shape {s.shape} in {path}, the target "
                                     f"{tuple(t.shape)}")
                if np.dtype(t.dtype) != want and not cast:
                    raise ValueError(f"{name} is {want.name} in {path}, the target "
                                     f"{np.dtype(t.dtype).name} (pass cast=True to convert)")
                want = np.dtype(t.dtype)
                sharding = getattr(t, "sharding", None) or _as_sharding(None)
            elif rules is not None:
                spec = specs[keys]
                sharding = NamedSharding(mesh, spec if spec is not None else PartitionSpec())
            elif mesh is not None:
                sharding = NamedSharding(mesh, PartitionSpec())
            else:
                sharding = _as_sharding(None)
            out.append((keys, _place(s, name, s.shape, want, sharding)))
        return _store.unflatten(out)
    finally:
        for fd in fds:
            os.close(fd)


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
