"""Pretrained weights from HuggingFace files, born sharded: ``flax_model.msgpack``,
``model.safetensors`` and their sharded ``*.index.json`` forms.

No file is read whole. A safetensors header gives each tensor's byte range; a Flax msgpack
file is walked for the positions of its arrays' raw bytes (Flax stores an array as a msgpack
extension holding ``(shape, dtype name, raw C-order bytes)``; arrays over 1 GiB are split into
chunks). The walk reads only the structure (map keys, extension and binary headers) through
``pread``: the ``msgpack`` package's unpacker can only hand an array's bytes over as one
``bytes`` object, a host copy of the whole array, so the few container and header codes are
decoded here (small values, such as shapes and dtype names, are still decoded by ``msgpack``).
Each device then reads the byte runs of its own block into its buffer.
"""
from .._src.checkpoint.pretrained import *  # noqa: F401,F403
from .._src.checkpoint.pretrained import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
