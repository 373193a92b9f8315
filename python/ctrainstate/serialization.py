"""State dicts and msgpack bytes (mirror of ``flax.serialization``).

``to_state_dict`` / ``from_state_dict`` turn a TrainState (or any pytree of dicts,
tuples, NamedTuples, structs, ``nn.Partitioned`` boxes and ``tree_util.Partial``) into
nested dicts with string keys and back; ``register_serialization_state`` adds a class.
``to_bytes`` / ``from_bytes`` write and read them in Flax's msgpack format — the same
bytes Flax reads and writes (arrays as ``(shape, dtype name, C-order buffer)``, numpy
scalars likewise, arrays over 1 GiB split into chunks) — so a checkpoint passes between
Flax and ctrainstate. Writing gathers each Array to the host (it is a full copy by
nature). Reading places every leaf whose target is an Array (or a ``ShapeDtypeStruct``
from ``eval_shape``) with the target's sharding, one block per device (Flax returns host
numpy arrays); other leaves come back as read. A saved value that does not fit its target
(another structure, an array of another shape) is a ``ValueError`` naming the path, and
the target is left as it was.
The bytes functions use the ``msgpack`` package, a dependency of ctrainstate (imported at
the first call).

>>> import numpy as np, ctrainstate as cts, ctrainstate.optim as optim
>>> from ctrainstate import serialization
>>> from ctrainstate.train_state import TrainState
>>> s = TrainState.create(apply_fn=None, params={'w': np.ones(2, np.float32)}, tx=optim.adam(0.1))
>>> sorted(serialization.to_state_dict(s))
['opt_state', 'params', 'step']
>>> r = serialization.from_bytes(s, serialization.to_bytes(s))
>>> r.step, np.asarray(r.params['w']).tolist(), r.params['w'].sharding == s.params['w'].sharding
(0, [1.0, 1.0], True)
"""
from ._src.serialization.serialization import *  # noqa: F401,F403
from ._src.serialization.serialization import __all__  # noqa: F401
# msgpack's ext hook for the bytes written here (``msgpack.unpackb(..., ext_hook=...)``)
from ._src.serialization.serialization import _unpack_ext  # noqa: F401
from ._src.serialization import serialization as _impl

from ._src.base.exports import forward_settings as _forward_settings, module_dir as _module_dir

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
# flax's chunk limit: reading and assigning it here sets what to_bytes uses
_forward_settings(__name__, _impl, ["MAX_CHUNK_SIZE"])
