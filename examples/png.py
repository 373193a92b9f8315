"""Minimal PNG reading and writing for the examples (8-bit grey/RGB/RGBA, no interlace).

Only the standard library (zlib, struct) and numpy: the examples run on a fresh
machine without Pillow.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np


def write_png(path: str, img: np.ndarray) -> None:
    """Write a float image in [0, 1] (H, W) or (H, W, 3) as an 8-bit PNG."""
    a = np.clip(np.asarray(img, dtype=np.float64), 0.0, 1.0)
    a = (a * 255.0 + 0.5).astype(np.uint8)
    if a.ndim == 2:
        color = 0
        a = a[:, :, None]
    elif a.ndim == 3 and a.shape[2] == 3:
        color = 2
    else:
        raise ValueError(f"write_png: expected (H, W) or (H, W, 3), got {a.shape}")
    h, w, c = a.shape
    raw = b"".join(b"\x00" + a[y].tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, color, 0, 0, 0)))
        f.write(chunk(b"IDAT", zlib.compress(raw, 9)))
        f.write(chunk(b"IEND", b""))


def _paeth(a, b, c):
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    if pa <= pb and pa <= pc:
        return a
    return b if pb <= pc else c


def read_png(path: str) -> np.ndarray:
    """Read an 8-bit PNG as float32 in [0, 1], shape (H, W, C) with C in {1, 3, 4}."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG file")
    pos, idat, hdr = 8, b"", None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        tag = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if tag == b"IHDR":
            hdr = struct.unpack(">IIBBBBB", body)
        elif tag == b"IDAT":
            idat += body
        elif tag == b"IEND":
            break
    if hdr is None:
        raise ValueError(f"{path}: no IHDR chunk")
    w, h, depth, color, _, _, interlace = hdr
    channels = {0: 1, 2: 3, 6: 4, 4: 2}.get(color)
    if depth != 8 or channels is None or interlace:
        raise ValueError(f"{path}: only 8-bit non-interlaced grey/RGB/RGBA PNGs are supported")
    raw = zlib.decompress(idat)
    stride = w * channels
    out = np.zeros((h, stride), np.uint8)
    prev = np.zeros(stride, np.int32)
    for y in range(h):
        ftype = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int32)
        cur = np.zeros(stride, np.int32)
        for x in range(stride):
            left = cur[x - channels] if x >= channels else 0
            up = prev[x]
            ul = prev[x - channels] if x >= channels else 0
            pred = (0, left, up, (left + up) // 2, _paeth(left, up, ul))[ftype] if ftype < 5 else 0
            cur[x] = (line[x] + pred) & 0xFF
        out[y] = cur
        prev = cur
    img = out.reshape(h, w, channels).astype(np.float32) / 255.0
    return img[:, :, :3] if channels == 4 else (img[:, :, :1] if channels == 2 else img)
