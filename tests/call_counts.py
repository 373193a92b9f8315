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


def python_frames(fn, result=None) -> list:
    """The (file, function name) of each Python function call ``fn()`` makes, in order (C
    functions not listed); ``result``, a list, gets ``fn()``'s return value appended."""
    seen = []

    def prof(frame, event, arg):
        if event == "call":
            seen.append((frame.f_code.co_filename, frame.f_code.co_name))
    sys.setprofile(prof)
    try:
        r = fn()
    finally:
        sys.setprofile(None)
    if result is not None:
        result.append(r)
    return seen
