"""One checkpoint directory: write it (atomically) and read it back onto any sharding.

Layout of a committed step directory::

    <name>/index.json                          tree, global shapes, dtypes, shardings, slices
    <name>/arrays.p00000.safetensors           the slices process 0 holds (one file a process)

``index.json`` lists the state dict's leaves in tree order. An array leaf records its global
shape, dtype, the sharding it had, and its slices: each a box of the global array (``index``:
``[lo, hi)`` per dimension), the file and the absolute byte range holding it, the safetensors
tensor name, and the checksum of its bytes (XXH3-64, or CRC-32 where the ``xxhash``
package is missing; the index's ``checksum`` names it). Slices are keyed by global index ranges
only, so files written by several processes combine into one index, and a reader on any
mesh finds the bytes of its own block. Each unique block is written once (replicas, whose
``replica_id`` is not 0, write nothing), cut into C-contiguous slices of at most
``SLICE_BYTES``. Other leaves (ints, floats, bools, strings, None) are stored in the JSON.

In a job of several processes (``ctrainstate.distributed.initialize()``) every process
writes the blocks of replica 0 it holds of each Array that spans processes into its own
file (``arrays.p<process>.safetensors``; a process holding none writes no file); a leaf
that does not span processes (a numpy array, a number, an Array on one process's devices)
is written by process 0 alone, as every process is expected to hold the same value.
``processes.py`` says how the processes agree on the directory, gather the index and commit.

A directory is written under a temporary name in the same parent, every file fsync'd, the
directory fsync'd, then renamed to its final name (the commit) and the parent fsync'd. A
reader ignores temporary names; the next save removes them.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
import uuid

import numpy as np

from ... import _C
from ..array.abstract import ShapeDtypeStruct
from ..array.array import Array, _alloc_blocks, _as_sharding, _buffer_view, device_put
from ..array.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from ..base.tree_util import tree_leaves
from . import fileio as _io
from ..base.devices import process_index as _process_index

FORMAT = "ctrainstate.checkpoint"
VERSION = 1
INDEX = "index.json"


class CorruptCheckpointError(ValueError):
    """A checkpoint's bytes do not match their checksum, or a file is truncated or missing."""


# --- the state dict as a list of leaves --------------------------------------------------------

def flatten(sd, keys=()):
    """[(keys, leaf)] of a state dict in order; an empty dict below the root is a leaf {}."""
    if isinstance(sd, dict):
        if not sd and keys:
            return [(keys, {})]
        out = []
        for k, v in sd.items():
            out.extend(flatten(v, keys + (str(k),)))
        return out
    return [(keys, sd)]


def unflatten(items):
    out: dict = {}
    for keys, v in items:
        if not keys:
            return v
        d = out
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = v
    return out


def path_name(keys) -> str:
    return "/".join(keys) if keys else "<root>"


def _sharding_record(s):
    if isinstance(s, NamedSharding):
        mesh = s.mesh
        return {"type": "NamedSharding", "mesh_shape": list(mesh.axis_sizes),
                "axis_names": list(mesh.axis_names),
                "device_ids": np.asarray(mesh.device_ids).tolist(),
                "spec": [list(e) if isinstance(e, tuple) else e for e in s.spec]}
    if isinstance(s, SingleDeviceSharding):
        return {"type": "SingleDeviceSharding", "device_id": next(iter(s.device_set)).id}
    return {"type": type(s).__name__}


_JSON_SCALARS = (bool, int, float, str, type(None))


def _static(leaf) -> bool:
    """A leaf of the state dict that holds no data: a PartitionSpec, or a pytree node with no
    leaves (t5x's ``AxisMetadata`` in ``params_axes``)."""
    if isinstance(leaf, PartitionSpec):
        return True
    if isinstance(leaf, (Array, ShapeDtypeStruct, np.ndarray, np.generic) + _JSON_SCALARS):
        return False
    return tree_leaves(leaf) == []


# --- saving -----------------------------------------------------------------------------------

class _Block:
    """One unique block of an array leaf: where it sits and how to get its bytes. ``dtype`` is
    the dtype written (``src_dtype`` the device's, when a save casts)."""
    __slots__ = ("lo", "shape", "dtype", "src_dtype", "host", "buf", "device")

    def __init__(self, lo, shape, dtype, host=None, buf=None, device=None, src_dtype=None):
        self.lo, self.shape, self.dtype = tuple(lo), tuple(shape), np.dtype(dtype)
        self.src_dtype = np.dtype(src_dtype or dtype)
        self.host, self.buf, self.device = host, buf, device

    def data(self) -> np.ndarray:
        """The block as a C-contiguous host array of ``dtype``: the snapshot, a view of a CPU
        device's buffer, or a copy from another device (cast, if asked) made now."""
        if self.host is not None:
            return self.host
        if self.device.platform == "cpu":
            out = _buffer_view(self.buf, self.shape, self.src_dtype)
        else:
            out = _copy_to_host(self.buf, self.shape, self.src_dtype)
        return out if self.src_dtype == self.dtype else out.astype(self.dtype)


def _copy_to_host(buf, shape, dtype) -> np.ndarray:
    host = np.empty(shape, dtype)
    _C.copy_to_host(buf, host.view(np.uint8) if dtype == np.bool_ else host, (0,) * len(shape))
    return host


class SavePlan:
    """What one save writes: the leaves (array blocks, JSON values) of a state dict. Built in
    the caller's thread (``snapshot=True`` copies every block to the host there, so the
    caller may change or donate its arrays as soon as the plan exists); written by
    :func:`write_plan`, in any thread."""

    def __init__(self, state_dict, *, snapshot: bool, process_index: int | None = None,
                 cast=None):
        if process_index is None:
            process_index = _process_index()
        self.process_index = process_index
        self.leaves = []     # the index's leaf entries, in tree order
        self.arrays = []     # (array leaf entry, [_Block]): what goes into the file
        self.file = f"arrays.p{process_index:05d}.safetensors"
        self.spans_processes = False   # an Array leaf spans processes
        self._spanning = []            # the entries of such leaves
        for keys, leaf in flatten(state_dict):
            name = path_name(keys)
            if isinstance(leaf, dict):
                self.leaves.append({"keys": list(keys), "kind": "empty_dict"})
                continue
            if isinstance(leaf, _JSON_SCALARS) and not isinstance(leaf, np.generic):
                self.leaves.append({"keys": list(keys), "kind": "value", "value": leaf})
                continue
            if _static(leaf):   # metadata without data (axis names): the target's is kept
                self.leaves.append({"keys": list(keys), "kind": "static", "repr": repr(leaf)})
                continue
            if isinstance(leaf, ShapeDtypeStruct):
                raise TypeError(f"checkpoint: {name} is a ShapeDtypeStruct (an abstract array "
                                f"has no data to save)")
            want = cast(keys, leaf) if cast is not None else None
            if isinstance(leaf, Array):
                leaf._check_alive()
                spans = not leaf.is_fully_addressable
                self.spans_processes |= spans
                dtype = np.dtype(want or leaf.dtype)
                blocks = []
                for dev, buf, start, rid in leaf._blocks:
                    # a replica writes nothing: the block's replica 0 (the first device of
                    # the mesh holding it, on whichever process) is written instead; a leaf
                    # that does not span processes is process 0's to write
                    if rid != 0 or (not spans and process_index != 0):
                        continue
                    b = _Block(start, leaf._shard_shape, dtype, buf=buf, device=dev,
                               src_dtype=leaf.dtype)
                    if snapshot:   # the device-to-host copy, before save returns
                        host = _copy_to_host(buf, leaf._shard_shape, leaf.dtype)
                        b.host = host if dtype == leaf.dtype else host.astype(dtype)
                    blocks.append(b)
                shape, sharding = leaf.shape, _sharding_record(leaf.sharding)
            else:
                try:
                    a = np.asarray(leaf)
                except Exception:
                    a = None
                if a is None or a.dtype.hasobject or a.dtype.names is not None:
                    raise TypeError(f"checkpoint: cannot save {name}, a "
                                    f"{type(leaf).__name__}: leaves are arrays, numbers, "
                                    f"strings or None")
                if want is not None:
                    a = a.astype(want)
                if a.dtype.byteorder == ">":
                    a = a.astype(a.dtype.newbyteorder("<"))
                a = np.ascontiguousarray(a)
                if snapshot and (a is leaf or a.base is not None):
                    a = a.copy()
                dtype, shape, sharding = a.dtype, a.shape, None
                blocks = ([_Block((0,) * a.ndim, a.shape, a.dtype, host=a)]
                          if process_index == 0 else [])
            _io.st_code(dtype)   # an unsupported dtype fails here, before anything is written
            entry = {"keys": list(keys), "kind": "array", "shape": list(shape),
                     "dtype": np.dtype(dtype).name, "sharding": sharding, "slices": []}
            self.leaves.append(entry)
            self.arrays.append((entry, blocks))
            if isinstance(leaf, Array) and not leaf.is_fully_addressable:
                self._spanning.append(entry)


    def signature(self) -> str:
        """The tree as the index records it, without data or slices (what every process of
        a save must agree on): keys, kinds, shapes, dtypes, shardings, JSON values."""
        spanning = {id(e) for e in self._spanning}
        out = []
        for e in self.leaves:
            skip = {"slices", "value"} | (set() if id(e) in spanning else {"sharding"})
            out.append({k: v for k, v in e.items() if k not in skip})
        return json.dumps(out, sort_keys=True)

    def slices(self) -> list:
        """[[leaf position, [slice entry]]] of the array leaves this process wrote."""
        pos = {id(e): i for i, e in enumerate(self.leaves)}
        return [[pos[id(entry)], entry["slices"]] for entry, _ in self.arrays
                if entry["slices"]]


def write_plan(plan: SavePlan, directory: str, metadata: dict) -> None:
    """Write ``plan`` into ``directory`` (created here; its parent exists): the safetensors
    file, fsync'd, then ``index.json``, fsync'd, then the directory fsync'd."""
    os.mkdir(directory)
    write_file(plan, directory)
    write_index(directory, plan.leaves, metadata)


def write_file(plan: SavePlan, directory: str) -> None:
    """Write this process's blocks of ``plan`` into its safetensors file in ``directory``
    (which exists), fsync'd, filling the slices' offsets and checksums into the plan's
    leaf entries. Nothing is written when the plan holds no block (a process whose
    blocks are all replicas)."""
    tensors, pieces = [], []
    for entry, blocks in plan.arrays:
        name = path_name(entry["keys"])
        for b in blocks:
            itemsize = b.dtype.itemsize
            for start, pshape, boff in _io.split_block(b.shape, itemsize):
                lo = [l + s for l, s in zip(b.lo, start)]
                hi = [l + n for l, n in zip(lo, pshape)]
                nbytes = math.prod(pshape) * itemsize
                tname = f"{name}[{','.join(f'{a}:{z}' for a, z in zip(lo, hi))}]"
                sl = {"index": [[a, z] for a, z in zip(lo, hi)], "file": plan.file,
                      "tensor": tname}
                entry["slices"].append(sl)
                tensors.append((tname, _io.st_code(b.dtype), pshape, nbytes))
                pieces.append((b, boff, nbytes, sl))
    if not tensors:
        return
    header = _io.safetensors_header(tensors, {"format": FORMAT})
    pos = len(header)
    by_block: dict = {}
    for b, boff, nbytes, sl in pieces:
        sl["offsets"] = [pos, pos + nbytes]
        pos += nbytes
        by_block.setdefault(id(b), (b, []))[1].append((boff, nbytes, sl))
    path = os.path.join(directory, plan.file)
    _io.hasher(_io.DEFAULT_CHECKSUM)   # an unknown or missing checksum fails before writing
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def write_block(b, items):
        # a block's bytes are fetched once (a GPU block is copied to the host here), then
        # each of its slices goes to its place in the file with its checksum
        data = b.data().reshape(-1).view(np.uint8)
        for boff, nbytes, sl in items:
            h = _io.hasher(_io.DEFAULT_CHECKSUM)
            _io.write_hashed(fd, memoryview(data[boff:boff + nbytes]), sl["offsets"][0], h)
            sl["checksum"] = h.intdigest()

    try:
        _io.write_all(fd, header)
        # blocks already on the host (snapshots, CPU devices) a few at a time; blocks copied
        # from GPU devices one at a time, so the host holds one such block at once
        on_host = [(b, items) for b, items in by_block.values()
                   if b.host is not None or b.device.platform == "cpu"]
        _io.run_parallel([lambda b=b, items=items: write_block(b, items)
                          for b, items in on_host])
        for b, items in by_block.values():
            if not (b.host is not None or b.device.platform == "cpu"):
                write_block(b, items)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_index(directory: str, leaves: list, metadata: dict) -> None:
    """Write ``index.json`` (fsync'd) into ``directory``, then fsync the directory (which
    makes the entries of every file written there durable)."""
    index = {"format": FORMAT, "version": VERSION, "checksum": _io.DEFAULT_CHECKSUM,
             "metadata": metadata, "leaves": leaves}
    _io.write_json(os.path.join(directory, INDEX), index)
    _io.fsync_dir(directory)


def tmp_name(final: str) -> str:
    return f"{final}.tmp-{uuid.uuid4().hex[:12]}"


def commit(tmp: str, final: str) -> None:
    """Rename ``tmp`` to ``final`` and fsync the parent; an existing ``final`` is replaced
    (moved aside first, removed after the new one is in place)."""
    parent = os.path.dirname(os.path.abspath(final))
    old = None
    if os.path.exists(final):
        old = f"{final}.delete-{uuid.uuid4().hex[:12]}"
        os.rename(final, old)
    os.rename(tmp, final)
    _io.fsync_dir(parent)
    if old is not None:
        remove(old)


def remove(path: str) -> None:
    """Delete a checkpoint directory: renamed aside first (one atomic step, so a crash never
    leaves a half-deleted directory under a committed name), then removed."""
    base = os.path.basename(path)
    if ".delete-" not in base and ".tmp-" not in base:
        aside = f"{path}.delete-{uuid.uuid4().hex[:12]}"
        os.rename(path, aside)
        _io.fsync_dir(os.path.dirname(os.path.abspath(path)))
        path = aside
    shutil.rmtree(path, ignore_errors=True)


def is_partial(name: str) -> bool:
    return ".tmp-" in name or ".delete-" in name


def save_dir(state_dict, final: str, *, metadata: dict | None = None,
             snapshot: bool = False) -> None:
    """Write a state dict as the checkpoint directory ``final`` (synchronously)."""
    plan = SavePlan(state_dict, snapshot=snapshot)
    tmp = tmp_name(final)
    try:
        write_plan(plan, tmp, dict(metadata or {}))
        commit(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --- restoring --------------------------------------------------------------------------------

def read_index(directory: str) -> dict:
    p = os.path.join(directory, INDEX)
    try:
        with open(p, "rb") as f:
            index = json.loads(f.read())
    except FileNotFoundError:
        raise FileNotFoundError(f"{directory} is not a checkpoint (it has no {INDEX})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{p} is not valid JSON ({e})") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(f"{p}: not a {FORMAT} index of version {VERSION} "
                         f"(format {index.get('format')!r}, version {index.get('version')!r})")
    return index


class _Files:
    """Open read-only file descriptors of one checkpoint, closed together."""

    def __init__(self, directory):
        self.directory, self.fds = directory, {}

    def fd(self, name, what):
        if name not in self.fds:
            if os.path.basename(name) != name:
                raise CorruptCheckpointError(f"{what}: the index names a file outside the "
                                             f"checkpoint ({name!r})")
            try:
                self.fds[name] = os.open(os.path.join(self.directory, name), os.O_RDONLY)
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"{what}: the checkpoint's file {name} is missing from "
                    f"{self.directory}") from None
        return self.fds[name]

    def close(self):
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


class _Reader:
    """Reads array entries of one index onto shardings, slice by slice (on ``_io.workers()``
    threads), checking each slice's checksum. A slice that is not
    read straight into its destination goes through its thread's scratch buffer (at most
    SLICE_BYTES)."""

    def __init__(self, directory, checksum: str):
        self.files = _Files(directory)
        self.directory = directory
        self.checksum = checksum
        _io.hasher(checksum)   # an unknown checksum, or xxhash missing, fails before reading
        self._local = threading.local()
        self._lock = threading.Lock()

    def scratch(self, n):
        buf = getattr(self._local, "scratch", None)
        if buf is None or len(buf) < n:   # grows to the largest slice this thread reads
            buf = self._local.scratch = np.empty(n, np.uint8)
        return buf[:n]

    def _read_slice(self, sl, name, mv):
        lo, hi = sl["offsets"]
        if hi - lo != len(mv):
            raise CorruptCheckpointError(f"array '{name}': slice {sl['index']} has "
                                         f"{hi - lo} bytes in the index, {len(mv)} expected")
        with self._lock:
            fd = self.files.fd(sl["file"], f"array '{name}'")
        h = _io.hasher(self.checksum)
        try:
            _io.read_hashed(fd, mv, lo, h, f"array '{name}' in {sl['file']}")
        except ValueError as e:   # the file is shorter than the index says
            raise CorruptCheckpointError(str(e)) from None
        if h.intdigest() != sl["checksum"]:
            raise CorruptCheckpointError(
                f"checksum mismatch in array '{name}': slice {sl['index']} "
                f"({sl['file']}, bytes {lo}-{hi}) of the checkpoint {self.directory} is "
                f"corrupted")

    def fill(self, entry, name, targets, dtype):
        """Fill ``targets`` — a list of (lo, shape, writable ndarray of ``dtype``) blocks of
        the global array — from the entry's slices. Each slice is read once: straight into its
        block when it is a contiguous run of one block, else into a scratch buffer and copied
        (cast to ``dtype`` when it differs from the saved one) into every block it meets."""
        saved = _io.np_dtype(entry["dtype"])
        covered = [0] * len(targets)
        tasks, reads = [], []   # a task for each slice read, and its slice
        for sl in entry["slices"]:
            slo = tuple(a for a, _ in sl["index"])
            shi = tuple(b for _, b in sl["index"])
            sshape = tuple(b - a for a, b in zip(slo, shi))
            hits = []
            for i, (tlo, tshape, arr) in enumerate(targets):
                thi = tuple(a + n for a, n in zip(tlo, tshape))
                box = _io.intersect(slo, shi, tlo, thi)
                if box is not None:
                    hits.append((i, box))
                    covered[i] += math.prod(h - l for l, h in zip(*box))
            if not hits:
                continue
            nbytes = math.prod(sshape) * saved.itemsize
            if len(hits) == 1 and saved == dtype and hits[0][1] == (slo, shi):
                tlo, tshape, arr = targets[hits[0][0]]
                off = _io.contiguous_offset(slo, shi, tlo, tshape)
                if off is not None:
                    b0 = off * saved.itemsize
                    mv = memoryview(arr.reshape(-1).view(np.uint8)[b0:b0 + nbytes])
                    tasks.append(lambda sl=sl, mv=mv: self._read_slice(sl, name, mv))
                    reads.append(sl)
                    continue

            def via_scratch(sl=sl, hits=hits, slo=slo, sshape=sshape, nbytes=nbytes):
                buf = self.scratch(nbytes)
                self._read_slice(sl, name, memoryview(buf))
                src = buf.view(saved).reshape(sshape)
                for i, (lo, hi) in hits:
                    tlo, tshape, arr = targets[i]
                    arr[_io.slices_of(lo, hi, tlo)] = src[_io.slices_of(lo, hi, slo)]
            tasks.append(via_scratch)
            reads.append(sl)
        for (tlo, tshape, _), c in zip(targets, covered):
            if c != math.prod(tshape):
                raise CorruptCheckpointError(
                    f"array '{name}': the checkpoint's slices cover {c} of the "
                    f"{math.prod(tshape)} elements of the block at {list(tlo)} (slices are "
                    f"missing or overlap)")
        pre = self._prefetch(reads)
        if pre is None:
            _io.run_parallel(tasks)
            return
        try:   # one I/O thread: the slices in order, the disk reading ahead of them
            for task, sl in zip(tasks, reads):
                task()
                pre.advance(sl["offsets"][1] - sl["offsets"][0])
        finally:
            pre.close()

    def _prefetch(self, reads):
        """A :class:`fileio.Prefetch` of the byte ranges of ``reads`` (slices, in the order
        they are read), when they are read on one thread and are big enough to be worth a
        thread (at least two prefetch chunks); else None. The ranges come from files the
        index names inside the checkpoint only (anything else is left to the reads, which
        raise)."""
        if _io.workers() != 1 or not _io.can_prefetch():
            return None
        ranges = []
        try:
            for sl in reads:
                f, (lo, hi) = sl["file"], sl["offsets"]
                if os.path.basename(f) != f or not (0 <= lo <= hi):
                    return None
                path = os.path.join(self.directory, f)
                if ranges and ranges[-1][0] == path and ranges[-1][2] == lo:
                    ranges[-1][2] = hi
                else:
                    ranges.append([path, lo, hi])
        except (KeyError, TypeError, ValueError):   # a malformed entry: the reads raise
            return None
        if sum(hi - lo for _, lo, hi in ranges) < 2 * _io.PREFETCH_CHUNK:
            return None
        return _io.Prefetch(ranges)

    def host(self, entry, name, dtype=None):
        """The whole array on the host (a numpy array)."""
        dtype = np.dtype(dtype or _io.np_dtype(entry["dtype"]))
        shape = tuple(entry["shape"])
        out = np.empty(shape, dtype)
        self.fill(entry, name, [((0,) * len(shape), shape, out)], dtype)
        return out

    def array(self, entry, name, shape, dtype, sharding) -> Array:
        """An Array of ``sharding``: each device's block read from the slices it overlaps.
        On CPU devices the slices land in the device buffers; on others one block at a time
        is staged on the host and copied over. With devices of other processes, this
        process reads the blocks of its own devices only (each distinct block once, copied
        to the local devices holding a replica of it)."""
        shard_shape, blocks = _alloc_blocks(shape, dtype, sharding, addressable=True)
        firsts = {}
        for dev, buf, start, rid in blocks:
            firsts.setdefault(tuple(start), (dev, buf))   # mesh order: replica 0 first
        cpu = [(lo, shard_shape, _buffer_view(buf, shard_shape, dtype))
               for lo, (dev, buf) in firsts.items() if dev.platform == "cpu"]
        if cpu:
            self.fill(entry, name, cpu, dtype)
        for lo, (dev, buf) in firsts.items():
            if dev.platform != "cpu":
                host = np.empty(shard_shape, dtype)
                self.fill(entry, name, [(lo, shard_shape, host)], dtype)
                _C.copy_from_host(buf, host.view(np.uint8) if dtype == np.bool_ else host,
                                  (0,) * len(shard_shape))
        for dev, buf, start, rid in blocks:
            src = firsts[tuple(start)][1]
            if buf is not src:
                _C.copy_bytes(buf, src)
        return Array._create(shape, dtype, sharding, blocks)

    def close(self):
        self.files.close()


def _check_fits(entry, name, shape, dtype, cast):
    saved_shape = tuple(entry["shape"])
    if tuple(shape) != saved_shape:
        raise ValueError(f"checkpoint: {name} has shape {saved_shape} in the checkpoint, the "
                         f"target {tuple(shape)}")
    saved = _io.np_dtype(entry["dtype"])
    if np.dtype(dtype) != saved and not cast:
        raise ValueError(f"checkpoint: {name} is {saved.name} in the checkpoint, the target "
                         f"{np.dtype(dtype).name} (pass cast=True to convert)")


def _restore_leaf(reader, entry, keys, target, cast):
    name = path_name(keys)
    kind = entry["kind"]
    if kind == "empty_dict":
        if target is None or (isinstance(target, dict) and not target):
            return {}
        raise ValueError(f"checkpoint: {name} is an empty dict in the checkpoint, the target "
                         f"a {type(target).__name__}")
    if kind == "static":
        return target if target is not None else entry["repr"]
    if kind == "value":
        v = entry["value"]
        if isinstance(target, (Array, ShapeDtypeStruct)) and target.sharding is not None \
                and v is not None:
            a = np.asarray(v)
            _check_fits({"shape": list(a.shape), "dtype": np.dtype(target.dtype).name},
                        name, target.shape, target.dtype, True)
            return device_put(a.astype(target.dtype), target.sharding)
        return v
    if isinstance(target, (Array, ShapeDtypeStruct)):
        _check_fits(entry, name, target.shape, target.dtype, cast)
        sharding = target.sharding if target.sharding is not None else _as_sharding(None)
        try:
            sharding.shard_shape(tuple(target.shape))
        except ValueError as e:
            raise ValueError(f"checkpoint: the target sharding of {name} does not fit its "
                             f"shape {tuple(target.shape)}: {e}") from None
        return reader.array(entry, name, tuple(target.shape), np.dtype(target.dtype), sharding)
    if isinstance(target, np.ndarray):
        _check_fits(entry, name, target.shape, target.dtype, cast)
        return reader.host(entry, name, target.dtype)
    return reader.host(entry, name)


def restore_dir(directory: str, target_sd=None, *, cast: bool = False):
    """The state dict saved in ``directory``. With a target state dict, every leaf is checked
    against and placed like its target leaf (an Array's or ShapeDtypeStruct's sharding; a
    numpy target gives a host array); without one, arrays come back as host numpy arrays."""
    index = read_index(directory)
    try:
        saved = {tuple(e["keys"]): e for e in index["leaves"]}
        checksum = index["checksum"]
    except (KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{directory}/{INDEX} is malformed ({e!r})") from None
    reader = _Reader(directory, checksum)

    def leaf(e, keys, t):
        try:
            return _restore_leaf(reader, e, keys, t, cast)
        except (KeyError, TypeError, IndexError) as err:   # an entry missing a field
            raise CorruptCheckpointError(f"{directory}/{INDEX}: the entry of "
                                         f"{path_name(keys)} is malformed ({err!r})") from None
    try:
        if target_sd is None:
            return unflatten([(keys, leaf(e, keys, None)) for keys, e in saved.items()])
        targets = flatten(target_sd)
        want = {keys for keys, _ in targets}
        extra = sorted(path_name(k) for k in saved if k not in want
                       and saved[k]["kind"] != "empty_dict")
        if extra:
            raise ValueError(f"checkpoint {directory} has entries the target lacks: "
                             f"{', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}")
        items = []
        for keys, t in targets:
            e = saved.get(keys)
            if e is None:
                if isinstance(t, dict) and not t:
                    items.append((keys, {}))
                    continue
                raise ValueError(f"checkpoint {directory} has no entry {path_name(keys)}")
            items.append((keys, leaf(e, keys, t)))
        return unflatten(items)
    finally:
        reader.close()


def step_metadata(directory: str) -> dict:
    return read_index(directory).get("metadata", {})


def now() -> float:
    return time.time()
