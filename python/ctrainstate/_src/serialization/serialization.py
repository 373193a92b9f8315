"""The implementation of :mod:`ctrainstate.serialization` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..array.abstract import ShapeDtypeStruct
from ..base.dtypes import bfloat16
from ..array.array import Array, device_put
from ..nn.meta import Partitioned
from ..nn.spmd import LogicallyPartitioned
from .state_dict import (current_path, from_state_dict, is_serializable,
                         register_serialization_state, to_state_dict)
from ..core.frozen_dict import FrozenDict
from ..base.tree_util import (_flatten_up_to, _one_level, _sorted_keys, keystr,
                              tree_flatten_with_path, tree_unflatten)

__all__ = ["to_state_dict", "from_state_dict", "to_bytes", "from_bytes", "msgpack_serialize",
           "msgpack_restore", "register_serialization_state", "is_serializable", "current_path"]

MAX_CHUNK_SIZE = 2**30
_EXT_NDARRAY, _EXT_COMPLEX, _EXT_NPSCALAR = 1, 2, 3
_CHUNKED = "__msgpack_chunked_array__"


def _box_to_state_dict(box):
    return {"value": to_state_dict(box.value)}


def _box_from_state_dict(box, state):
    where = current_path()
    if not isinstance(state, dict) or set(state) != {"value"}:
        got = sorted(state) if isinstance(state, dict) else f"a {type(state).__name__}"
        raise ValueError(f"state dict at {where} has {got} where the target is a "
                         f"{type(box).__name__} box: expected {{'value': ...}} (Flax's layout)")
    return box.replace(value=from_state_dict(box.value, state["value"], name=f"{where}/value"))


# nn.Partitioned boxes are Flax structs: their state dict is {'value': ...} (names are static)
for _box in (Partitioned, LogicallyPartitioned):
    register_serialization_state(_box, _box_to_state_dict, _box_from_state_dict)


def _msgpack():
    try:
        import msgpack
    except ImportError:
        raise ImportError("ctrainstate.serialization's bytes format needs the msgpack package "
                          "(pip install msgpack)") from None
    return msgpack


def _array_bytes(a: np.ndarray) -> bytes:
    if a.dtype.hasobject or a.dtype.isalignedstruct:
        raise ValueError("object and structured dtypes cannot be serialized")
    return _msgpack().packb((a.shape, a.dtype.name, a.tobytes("C")), use_bin_type=True)


def _array_from_bytes(data: bytes) -> np.ndarray:
    shape, name, buf = _msgpack().unpackb(data, raw=True)
    dt = bfloat16 if name == b"bfloat16" else np.dtype(name.decode())
    return np.frombuffer(buf, dtype=dt).reshape(shape, order="C")


def _pack_ext(x):
    msgpack = _msgpack()
    if isinstance(x, np.ndarray):
        return msgpack.ExtType(_EXT_NDARRAY, _array_bytes(x))
    if isinstance(x, np.generic):
        return msgpack.ExtType(_EXT_NPSCALAR, _array_bytes(np.asarray(x)))
    if isinstance(x, complex):
        return msgpack.ExtType(_EXT_COMPLEX, msgpack.packb((x.real, x.imag)))
    raise TypeError(f"cannot serialize a {type(x).__name__}: a state dict holds dicts, "
                    f"arrays, numbers and strings")


def _unpack_ext(code, data):
    msgpack = _msgpack()
    if code == _EXT_NDARRAY:
        return _array_from_bytes(data)
    if code == _EXT_NPSCALAR:
        return _array_from_bytes(data)[()]
    if code == _EXT_COMPLEX:
        re, im = msgpack.unpackb(data)
        return complex(re, im)
    return msgpack.ExtType(code, data)


def _foreign(d) -> bool:
    """An array of another library: has __array__ and is not numpy data, a list or a str."""
    return (hasattr(d, "__array__") and not isinstance(d, (np.ndarray, np.generic, list, tuple,
                                                             str, bytes, dict)))


def _to_host(d, sort: bool, chunk: bool = True):
    """A copy of the state dict with Arrays gathered and big arrays chunked (``sort``: dict
    keys in sorted order, as Flax's copy of the tree through ``jax.tree_util`` has them)."""
    if isinstance(d, dict):
        keys = _sorted_keys(d) if sort else d
        return {k: _to_host(d[k], sort, chunk) for k in keys}
    if type(d) is list:   # Flax converts jax Arrays in lists too, but chunks only in dicts
        return [_to_host(v, sort, False) for v in d]
    if isinstance(d, Array):
        d = np.asarray(d)
    elif _foreign(d):   # a jax / torch array in the tree (Flax serializes jax Arrays)
        d = np.asarray(d)   # 0-d too: Flax packs a jax Array as an ndarray whatever its rank
    if chunk and isinstance(d, np.ndarray) and d.nbytes > MAX_CHUNK_SIZE:
        per = max(1, MAX_CHUNK_SIZE // d.dtype.itemsize)
        flat = d.reshape(-1)
        return {_CHUNKED: True,
                "shape": {str(i): n for i, n in enumerate(d.shape)},
                "chunks": {str(i): flat[j:j + per]
                           for i, j in enumerate(range(0, flat.size, per))}}
    return d


def _unchunk(d):
    if isinstance(d, dict):
        if _CHUNKED in d:
            shape = tuple(d["shape"][str(i)] for i in range(len(d["shape"])))
            chunks = [d["chunks"][str(i)] for i in range(len(d["chunks"]))]
            return np.concatenate(chunks).reshape(shape)
        return {k: _unchunk(v) for k, v in d.items()}
    return d


def msgpack_serialize(pytree, in_place: bool = False) -> bytes:
    """Bytes of a tree of dicts (and lists) with array / number / string leaves (Flax's format).

    As in Flax, dict keys are written in sorted order unless ``in_place=True`` (which keeps
    their order; ``pytree`` itself is never modified here)."""
    return _msgpack().packb(_to_host(pytree, sort=not in_place), default=_pack_ext,
                            strict_types=True)


def msgpack_restore(encoded: bytes):
    """The tree of :func:`msgpack_serialize` (arrays as read-only host numpy arrays)."""
    tree = _msgpack().unpackb(encoded, ext_hook=_unpack_ext, raw=False, strict_map_key=False)
    return _unchunk(tree)


def to_bytes(target) -> bytes:
    """``msgpack_serialize(to_state_dict(target))``."""
    return msgpack_serialize(to_state_dict(target), in_place=True)


def from_bytes(target, encoded: bytes) -> Any:
    """``target``'s structure with the values of ``encoded``; leaves whose target is an Array
    are placed with that Array's sharding. A saved value that is not an array of the shape of
    its target array (an Array, ``ShapeDtypeStruct``, numpy or jax array) is a ``ValueError``
    naming the path."""
    restored = from_state_dict(target, msgpack_restore(encoded))

    def place(path, t, v):
        ours = isinstance(t, (Array, ShapeDtypeStruct))
        if (ours or isinstance(t, np.ndarray) or _foreign(t)) and not isinstance(v, Array):
            if not isinstance(v, (np.ndarray, np.generic, int, float, bool, complex)):
                raise ValueError(f"from_bytes: at {keystr(path) or 'the root'} the target is an "
                                 f"array of shape {tuple(t.shape)}, the saved value a "
                                 f"{type(v).__name__}")
            a = np.asarray(v)
            if a.shape != tuple(t.shape):
                raise ValueError(f"from_bytes: a saved array has shape {a.shape}, its target "
                                 f"{tuple(t.shape)}, at {keystr(path) or 'the root'}")
            if not ours:   # a host / foreign target: the value as read, as Flax returns it
                return v
            return device_put(a, t.sharding) if t.sharding is not None else device_put(a)
        return v
    # paired by construction (restored has target's structure): no metadata check here
    pl, td = tree_flatten_with_path(target, is_leaf=lambda x: x is None)
    vals = _flatten_up_to(td, restored)
    out = tree_unflatten(td, [place(p, t, v) for (p, t), v in zip(pl, vals)])
    return _in_order(td, out, restored)


def _in_order(td, x, like):
    """``x`` with its dicts in ``like``'s key order (the target's, as Flax returns them;
    tree_unflatten sorts them)."""
    if td.num_children == 0:
        return x
    children, keys, node = _one_level(x)
    kids = [_in_order(c, xc, lc) for c, xc, lc in zip(td.children(), children,
                                                      _one_level(like)[0])]
    if type(x) in (dict, FrozenDict) and list(x) != list(like):
        by_key = dict(zip((k[0].key for k in keys), kids))
        return type(x)((k, by_key[k]) for k in like)
    return node.unflatten(kids)


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
