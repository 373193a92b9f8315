"""Byte-level I/O for checkpoints: safetensors headers, dtype names, boxes, durable writes.

The safetensors *format* (an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw C-order bytes) is written here rather than
through ``safetensors.numpy.save_file``, which builds each tensor's ``bytes`` first (a full
host copy of the state) and does not fsync. Writing the header ourselves lets every slice go
from its device block (or its snapshot) to the file without a copy, with its checksum taken
on the way (slices on ``workers()`` threads). Every file written this way is a plain safetensors file (the tests read them with
``safetensors.numpy.load_file``). Reading goes through ``pread`` of the byte ranges a device
needs, so no file is ever mapped or read whole.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import ml_dtypes
import json
import math
import os
import struct
import sys
import threading
import zlib

import numpy as np

from ..base import dtypes as _dtypes

# numpy dtype name -> safetensors dtype code (the package's table; 64-bit and 8-bit types
# occur in host-array leaves and in pretrained files)
ST_CODE = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
           "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
           "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
           "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_FROM_CODE = {v: k for k, v in ST_CODE.items()}

#: Slices are cut so that each holds at most this many bytes: a restore onto another sharding
#: reads one slice at a time into a scratch buffer of this size (its checksum covers it whole).
#: At 4 MiB the scratch is still in cache when it is copied out (a 1 GiB restore onto other
#: shardings took 0.22-0.26 s, against 0.29-0.31 s with 16 MiB slices).
SLICE_BYTES = 4 << 20
#: Runs shorter than this are read with their neighbours rather than one syscall each.
TINY_RUN = 64


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a numpy dtype name or a safetensors code."""
    name = _FROM_CODE.get(name, name)
    if name == "bfloat16":
        return np.dtype(_dtypes.bfloat16)
    if name.startswith("float8"):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def st_code(dtype) -> str:
    name = np.dtype(dtype).name
    if name not in ST_CODE:
        raise TypeError(f"dtype {name} has no safetensors code (supported: {sorted(ST_CODE)})")
    return ST_CODE[name]


def _xxh3():
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash.xxh3_64_intdigest


#: The checksum new checkpoints use: XXH3-64 (the ``xxhash`` package, a dependency; about
#: 6x faster than zlib's CRC-32 here, so verifying a restore costs little next to reading it),
#: or CRC-32 (zlib) where xxhash is not installed. The index names the one it holds.
DEFAULT_CHECKSUM = "xxh3_64" if _xxh3() is not None else "crc32"


class _Crc32:
    """zlib's CRC-32 with xxhash's streaming interface (update / intdigest)."""
    __slots__ = ("value",)

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


def hasher(name: str):
    """A streaming checksum of the kind an index names: ``update(bytes)``, ``intdigest()``."""
    if name == "crc32":
        return _Crc32()
    if name == "xxh3_64":
        if _xxh3() is None:
            raise ImportError("this checkpoint's checksums are XXH3-64: verifying them needs "
                              "the xxhash package (pip install xxhash)")
        import xxhash
        return xxhash.xxh3_64()
    raise ValueError(f"unknown checksum {name!r} (known: 'xxh3_64', 'crc32')")


#: Bytes moved between a read or write and its checksum update: small enough to stay in the
#: CPU's cache, so the checksum reads them from there rather than from memory again.
HASH_CHUNK = 1 << 20


def read_hashed(fd: int, mv: memoryview, offset: int, h, what) -> None:
    """Fill ``mv`` from ``fd`` at ``offset`` and feed every byte to the checksum ``h``."""
    for a in range(0, len(mv), HASH_CHUNK):
        part = mv[a:a + HASH_CHUNK]
        pread_into(fd, part, offset + a, what)
        h.update(part)


def write_hashed(fd: int, mv: memoryview, offset: int, h) -> None:
    """Write ``mv`` to ``fd`` at ``offset`` and feed every byte to the checksum ``h``."""
    for a in range(0, len(mv), HASH_CHUNK):
        part = mv[a:a + HASH_CHUNK]
        pwrite_all(fd, part, offset + a)
        h.update(part)


# --- boxes: (lo, hi) per dimension ------------------------------------------------------------

def split_block(shape: tuple, itemsize: int, limit: int | None = None):
    """C-contiguous pieces of a block of ``shape``, each of at most ``limit`` bytes (default
    SLICE_BYTES; more when one element is bigger): a list of (start, piece_shape,
    byte_offset_in_block)."""
    limit = SLICE_BYTES if limit is None else limit
    shape = tuple(shape)
    if not shape or math.prod(shape) == 0 or math.prod(shape) * itemsize <= limit:
        return [((0,) * len(shape), shape, 0)]
    out = []
    strides = [itemsize * math.prod(shape[d + 1:]) for d in range(len(shape))]

    def rec(prefix: tuple, d: int):
        row = strides[d]
        base = sum(i * s for i, s in zip(prefix, strides))
        rest = shape[d + 1:]
        if row <= limit or d == len(shape) - 1:
            per = max(1, limit // row)
            for a in range(0, shape[d], per):
                b = min(shape[d], a + per)
                out.append((prefix + (a,) + (0,) * len(rest),
                            (1,) * d + (b - a,) + rest, base + a * row))
        else:
            for i in range(shape[d]):
                rec(prefix + (i,), d + 1)
    rec((), 0)
    return out


def intersect(alo, ahi, blo, bhi):
    """The intersection of two boxes as (lo, hi), or None when it is empty (0-d boxes meet)."""
    lo = tuple(max(a, b) for a, b in zip(alo, blo))
    hi = tuple(min(a, b) for a, b in zip(ahi, bhi))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, hi


def contiguous_offset(lo, hi, within_lo, within_shape):
    """Element offset of box [lo, hi) inside the C-order block at ``within_lo`` of
    ``within_shape`` when the box is one contiguous run there, else None."""
    n = len(within_shape)
    rel = [l - w for l, w in zip(lo, within_lo)]
    ext = [h - l for l, h in zip(lo, hi)]
    # dims after the last partial one must be full; dims before it must have extent 1
    last_partial = -1
    for d in range(n):
        if ext[d] != within_shape[d]:
            last_partial = d
    for d in range(last_partial):
        if ext[d] != 1:
            return None
    off = 0
    for d in range(n):
        off = off * within_shape[d] + rel[d]
    return off


def slices_of(lo, hi, base) -> tuple:
    return tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, base))


# --- durable writes ----------------------------------------------------------------------------

def workers() -> int:
    """Threads a save or restore uses for its slices: ``CTRAINSTATE_CHECKPOINT_THREADS``,
    default 1. Reads, writes and checksums release the GIL, so more threads help where the
    storage serves several requests at once (striped NVMe, network file systems); on one
    virtual disk with 2 vCPUs, one sequential stream measured faster (two threads' reads
    contended: 0.22-0.45 s against 0.16 s for 1 GiB). Each thread holds at most one
    SLICE_BYTES scratch buffer."""
    v = os.environ.get("CTRAINSTATE_CHECKPOINT_THREADS", "1")
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"CTRAINSTATE_CHECKPOINT_THREADS={v!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"CTRAINSTATE_CHECKPOINT_THREADS={v!r}: at least 1 thread")
    return n


def run_parallel(tasks) -> None:
    """Run the callables ``tasks`` on ``workers()`` threads; the first error is raised once
    all have finished (none is left running behind the caller)."""
    tasks = list(tasks)
    n = min(workers(), len(tasks))
    if n <= 1:
        for t in tasks:
            t()
        return
    with ThreadPoolExecutor(n, thread_name_prefix="ctrainstate-ckpt-io") as pool:
        futures = [pool.submit(t) for t in tasks]
    for f in futures:
        f.result()


#: A restore on one I/O thread has the disk read ahead of it: a helper thread pulls the
#: byte ranges it is about to read into the page cache, PREFETCH_CHUNK at a time and at most
#: PREFETCH_AHEAD bytes ahead of it, so the disk keeps reading while the reader checks and
#: copies (benchmarks/bench_checkpoint.py; figures in benchmarks/RESULTS.md). The helper
#: uses sendfile to /dev/null: the pages are read and nothing is copied to user memory, so
#: it takes no CPU time or host memory the restore needs (posix_fadvise(WILLNEED) was slower
#: than no read-ahead at all on the disk measured). With several I/O threads
#: (CHECKPOINT_THREADS > 1) nothing reads ahead.
PREFETCH_CHUNK = 8 << 20
PREFETCH_AHEAD = 32 << 20


def can_prefetch() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "sendfile")


class Prefetch:
    """Reads ``ranges`` — (path, lo, hi) byte ranges in the order the caller will read them —
    into the page cache on a thread of its own (its own file descriptors, so it does not
    disturb the caller's read-ahead), staying at most PREFETCH_AHEAD bytes ahead of the
    bytes the caller reports done (``advance``). Best effort: any error (a missing or short
    file) stops it quietly, and the caller's own reads meet and raise it. ``close`` stops
    it and waits for it, so no thread outlives the caller's reads."""

    def __init__(self, ranges):
        self._ranges = list(ranges)
        self._cond = threading.Condition()
        self._done = 0
        self._pending = 0   # read by the caller, not yet told to the helper
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ctrainstate-ckpt-io-prefetch",
                                        daemon=True)
        self._thread.start()

    def advance(self, nbytes: int) -> None:
        """The caller has read ``nbytes`` more (called from one thread); the helper is woken
        once a chunk's worth has been read, not on every slice."""
        self._pending += nbytes
        if self._pending < PREFETCH_CHUNK:
            return
        with self._cond:
            self._done += self._pending
            self._pending = 0
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()

    def _run(self):
        fds = {}
        fetched = 0
        try:
            null = fds[None] = os.open(os.devnull, os.O_WRONLY)
            for path, lo, hi in self._ranges:
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                fd = fds[path]
                for a in range(lo, hi, PREFETCH_CHUNK):
                    with self._cond:
                        while not self._stop and fetched - self._done > PREFETCH_AHEAD:
                            self._cond.wait()
                        if self._stop:
                            return
                    n = min(PREFETCH_CHUNK, hi - a)
                    got = 0
                    while got < n:
                        k = os.sendfile(null, fd, a + got, n - got)
                        if k <= 0:   # the file ends early: the caller's read says so
                            return
                        got += k
                    fetched += n
        except (OSError, ValueError):
            return
        finally:
            for fd in fds.values():
                os.close(fd)


def pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    done, n = 0, len(mv)
    while done < n:
        done += os.pwrite(fd, mv[done:done + (1 << 30)], offset + done)


def write_all(fd: int, buf) -> None:
    mv = memoryview(buf).cast("B") if not isinstance(buf, (bytes, bytearray)) else memoryview(buf)
    done, n = 0, len(mv)
    while done < n:
        done += os.write(fd, mv[done:done + (1 << 30)])


def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path, obj) -> None:
    """A JSON file written and fsync'd (the caller fsyncs its directory)."""
    data = json.dumps(obj, indent=1, sort_keys=False).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def safetensors_header(tensors, metadata: dict | None = None) -> bytes:
    """The header bytes (length prefix included) for ``tensors``: a list of
    (name, dtype code, shape, nbytes) in file order."""
    header, off = {}, 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, code, shape, nbytes in tensors:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)   # data starts 8-byte aligned, as the safetensors writer does
    return struct.pack("<Q", len(hb)) + hb


def read_safetensors_header(fd: int, path) -> tuple[dict, int]:
    """(header dict, byte offset of the data section) of a safetensors file."""
    head = os.pread(fd, 8, 0)
    if len(head) != 8:
        raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", head)
    size = os.fstat(fd).st_size
    if n > size - 8 or n > 100 << 20:
        raise ValueError(f"{path} is not a safetensors file (header length {n} for a file of "
                         f"{size} bytes)")
    try:
        header = json.loads(pread_exact(fd, n, 8, path))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a safetensors file (its header is not JSON: {e})") \
            from None
    return header, 8 + n


def pread_exact(fd: int, n: int, offset: int, what) -> bytes:
    out = bytearray(n)
    pread_into(fd, memoryview(out), offset, what)
    return bytes(out)


def pread_into(fd: int, mv: memoryview, offset: int, what) -> None:
    """Fill ``mv`` with the bytes of ``fd`` at ``offset``; a short file raises naming ``what``."""
    done, n = 0, len(mv)
    while done < n:
        got = os.preadv(fd, [mv[done:done + (1 << 30)]], offset + done)
        if got == 0:
            raise ValueError(f"{what}: the file ends {n - done} bytes early (truncated)")
        done += got


# --- reading a box of a C-order array stored in a file -----------------------------------------

class Source:
    """A C-order array stored in files as consecutive byte segments ``(file offset, length)``
    (one segment for safetensors; Flax's msgpack splits arrays over 1 GiB into chunks)."""

    def __init__(self, fd: int, segments, shape, dtype, what):
        self.fd, self.shape, self.dtype, self.what = fd, tuple(shape), np.dtype(dtype), what
        self.segments = list(segments)
        self.itemsize = self.dtype.itemsize
        self.strides = [self.itemsize * math.prod(self.shape[d + 1:])
                        for d in range(len(self.shape))]

    def read(self, mv: memoryview, logical: int) -> None:
        """Bytes [logical, logical + len(mv)) of the array into ``mv``."""
        pos, want, seg_start = 0, len(mv), 0
        for off, length in self.segments:
            seg_end = seg_start + length
            if logical + pos < seg_end and pos < want:
                a = logical + pos - seg_start
                n = min(length - a, want - pos)
                pread_into(self.fd, mv[pos:pos + n], off + a, self.what)
                pos += n
            seg_start = seg_end
            if pos >= want:
                return
        if pos < want:
            raise ValueError(f"{self.what}: the array's bytes end early")


def read_box(src: Source, lo, hi, out: np.ndarray, scratch: np.ndarray,
             limit: int | None = None) -> None:
    """Copy box [lo, hi) of ``src`` into ``out`` (an array of the box's shape; a view is
    fine). Contiguous runs go straight into ``out`` when it is contiguous; otherwise through
    ``scratch`` (uint8, at least ``limit`` bytes, default SLICE_BYTES), never more than
    ``limit`` bytes at a time."""
    limit = SLICE_BYTES if limit is None else limit
    n = len(src.shape)
    ext = [h - l for l, h in zip(lo, hi)]
    if n == 0 or math.prod(ext) == 0:
        if n == 0:
            src.read(memoryview(scratch[:src.itemsize]), 0)
            out[()] = scratch[:src.itemsize].view(src.dtype)[0]
        return
    start = sum(l * s for l, s in zip(lo, src.strides))
    nbytes = math.prod(ext) * src.itemsize
    run = contiguous_offset(lo, hi, (0,) * n, src.shape) is not None
    if run:
        if out.flags.c_contiguous and out.dtype == src.dtype:
            src.read(memoryview(out.reshape(-1).view(np.uint8)), start)
            return
        if nbytes <= limit:
            buf = scratch[:nbytes]
            src.read(memoryview(buf), start)
            out[...] = buf.view(src.dtype).reshape(ext)
            return
    else:
        # runs: for each index of the dims before the last partial one, a contiguous range
        t = max(d for d in range(n) if ext[d] != src.shape[d])
        run_bytes = ext[t] * src.strides[t]
        end = sum((h - 1) * s for h, s in zip(hi, src.strides)) + src.itemsize
        span = end - start
        if span <= limit and (span <= 2 * nbytes or run_bytes < TINY_RUN):
            # one read of the span holding the box, when little of it is not the box's (or
            # the runs are too short to read one by one)
            buf = scratch[:span]
            src.read(memoryview(buf), start)
            view = np.lib.stride_tricks.as_strided(buf.view(src.dtype), shape=ext,
                                                   strides=src.strides, writeable=False)
            out[...] = view
            return
        if run_bytes >= TINY_RUN:   # each run read on its own: only the box's bytes
            for idx in np.ndindex(*ext[:t]):
                sub_lo = [l + i for l, i in zip(lo, idx)] + list(lo[t:])
                sub_hi = [l + 1 for l in sub_lo[:t]] + list(hi[t:])
                read_box(src, sub_lo, sub_hi, out[tuple(slice(i, i + 1) for i in idx)],
                         scratch, limit)
            return
    d = next(i for i, e in enumerate(ext) if e > 1)
    per = max(1, limit // src.strides[d])
    if per >= ext[d]:
        per = max(1, ext[d] // 2)
    for a in range(0, ext[d], per):
        b = min(ext[d], a + per)
        sub_lo = list(lo)
        sub_hi = list(hi)
        sub_lo[d], sub_hi[d] = lo[d] + a, lo[d] + b
        idx = (slice(None),) * d + (slice(a, b),)
        read_box(src, sub_lo, sub_hi, out[idx], scratch, limit)
