"""Whether the calling thread is inside a ``jit`` / ``pjit`` call (a thread-local depth).

Some behaviour differs under ``jit`` as it does in jax: a sharding that does not divide a
dimension is an error for an eager ``device_put`` but is replicated along that dimension
inside a jitted function (XLA's choice). ``_jit`` enters :func:`jit_scope` around the
function it runs; other modules ask :func:`in_jit`.
"""
from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def in_jit() -> bool:
    """True while this thread runs a function called through ``jit`` / ``pjit``."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def jit_scope():
    """Marks this thread as inside ``jit`` for the duration (nests)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
