"""Counting the Python function calls a piece of code makes (sys.setprofile), for the tests
that bound the Python work of a hot path."""
import sys


def python_calls(fn) -> int:
    """The number of Python function calls ``fn()`` makes (C functions not counted)."""
    n = [0]

    def prof(frame, event, arg):
        if event == "call":
            n[0] += 1
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0]
