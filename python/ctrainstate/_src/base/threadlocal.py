"""Thread-locals whose values the C code reads on the hot path (the tape stack, the module
and mesh contexts, the matmul precision, the jit depth, strict rules).

``_C`` keeps a memo of the values the current thread read from such locals (py_dispatch.c,
``ct_py_tls_getattr``; another thread's read starts it afresh); every write to one (an
instance attribute set or deleted on any thread, or a class attribute, which is what a
thread that never set it reads) calls ``_C.tls_changed()``, which drops the memo. So values
are stored by attribute assignment only, never through the local's ``__dict__``; mutating a
stored list in place needs no notice (the memo holds the same list).
"""
from __future__ import annotations

import threading

from ... import _C

_changed = _C.tls_changed


class _NotifyingType(type):
    """The metaclass: a class attribute set or deleted (a default of every thread) notifies."""

    def __setattr__(cls, name, value):
        type.__setattr__(cls, name, value)
        _changed()

    def __delattr__(cls, name):
        type.__delattr__(cls, name)
        _changed()


class NotifyingLocal(threading.local, metaclass=_NotifyingType):
    """A ``threading.local`` whose writes notify the C readers (see the module's docstring).
    Subclasses declare their defaults as class attributes."""

    _ct_notifies_writes = True   # (what the C code checks before it memoises a value)

    def __setattr__(self, name, value):
        threading.local.__setattr__(self, name, value)
        _changed()

    def __delattr__(self, name):
        threading.local.__delattr__(self, name)
        _changed()
