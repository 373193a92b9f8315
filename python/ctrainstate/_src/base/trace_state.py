"""Thread-local modes that nest: whether the calling thread is inside a ``jit`` / ``pjit``
call (and so inside ``eval_shape``, which traces as jit does).

Some behaviour differs under ``jit`` as it does in jax: a sharding that does not divide a
dimension is an error for an eager ``device_put`` but is replicated along that dimension
inside a jitted function (XLA's choice). ``_jit`` enters :func:`jit_scope` around the
function it runs; other modules ask :func:`in_jit`.
"""
from __future__ import annotations

import contextlib

from .threadlocal import NotifyingLocal


class _DepthLocal(NotifyingLocal):
    """One thread's depth; the class attribute is what a thread that never entered reads
    (a plain read, where a missing attribute would raise and catch an AttributeError)."""

    depth = 0


class Depth:
    """A nesting depth per thread: ``with depth.scope():`` enters the mode (blocks nest and
    leave it on exceptions too), ``depth.active()`` asks whether this thread is in it."""

    __slots__ = ("_tls",)

    def __init__(self):
        self._tls = _DepthLocal()

    def active(self) -> bool:
        return self._tls.depth > 0

    @contextlib.contextmanager
    def scope(self):
        self._tls.depth += 1
        try:
            yield
        finally:
            self._tls.depth -= 1


_jit = Depth()
_jit_tls = _jit._tls


def in_jit() -> bool:
    """True while this thread runs a function called through ``jit`` / ``pjit``."""
    return _jit_tls.depth > 0     # _jit.active(), one call less


def jit_scope():
    """Marks this thread as inside ``jit`` for the duration (nests)."""
    return _jit.scope()
