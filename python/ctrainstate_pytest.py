"""ctrainstate's pytest plugin for tests of sharded code (active wherever ctrainstate is
installed).

A module of its own, outside the ``ctrainstate`` package: pytest loads plugins before a test
suite's conftest runs, and this one imports ctrainstate only when a test uses it, so a
conftest can still choose which ctrainstate a suite imports (and pytest starts no slower).

The number of CPU virtual devices is read once per process, when devices are first used, so
one pytest session cannot give one module 8 devices and another 4 by setting
``CTRAINSTATE_NUM_CPU_DEVICES``: the first module to use devices would win and the others
would silently run with its count. Here a test says what it needs:

* ``@pytest.mark.devices(n)`` (or ``pytestmark = pytest.mark.devices(n)`` for a module):
  the test runs with ``n`` CPU virtual devices. When this process has not made its devices
  yet, it gets ``n`` and the test runs here; when it has another count, the test runs in a
  fresh interpreter (``python -m pytest <the test's id>`` with ``n`` devices, the same
  rootdir and options) and its outcome and output are reported here. A test whose count is
  the process's runs here, with no extra process.
* fixture ``cpu_devices``: the test's CPU devices (``ctrainstate.devices('cpu')``).
* fixture ``mesh``: a factory, ``mesh((2, 4), ('data', 'model'))`` makes a mesh of the test's
  devices (the product of the shape must not exceed their number).

Subprocess runs cost an interpreter start (about a second) each; group tests that share a
count in one module with a module-level mark, and give the most common count first.

The plugin is registered as the ``pytest11`` entry point ``ctrainstate_pytest``; where
ctrainstate is not installed (only on ``PYTHONPATH``), load it with ``-p ctrainstate_pytest``.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

_ENV = "CTRAINSTATE_NUM_CPU_DEVICES"
_CHILD = "CTRAINSTATE_PYTEST_DEVICES_CHILD"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "devices(n): run the test with n CPU virtual devices (ctrainstate; in a "
                   "fresh interpreter when this process already has another count)")


def _wanted(item):
    mark = item.get_closest_marker("devices")
    if mark is None:
        return None
    if len(mark.args) != 1 or isinstance(mark.args[0], bool) or not isinstance(
            mark.args[0], int) or mark.args[0] < 1:
        raise pytest.UsageError(f"{item.nodeid}: pytest.mark.devices takes one positive int, "
                                f"got {mark.args!r}")
    return mark.args[0]


def _process_count():
    """This process's CPU device count once its devices exist, else None."""
    from ctrainstate._src.base import devices as _devices
    if not _devices._created:
        return None
    import ctrainstate as cts
    return cts.device_count("cpu")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    n = _wanted(item)
    if n is None or os.environ.get(_CHILD) == "1":
        return
    have = _process_count()
    if have is None:                  # this process's devices will be made with n
        from ctrainstate import config
        config.update("ctrainstate_num_cpu_devices", n)
        item._ct_devices_here = True
    else:
        item._ct_devices_here = have == n


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    n = _wanted(pyfuncitem)
    if n is None or os.environ.get(_CHILD) == "1" or getattr(pyfuncitem, "_ct_devices_here",
                                                               True):
        return None
    _run_in_child(pyfuncitem, n)
    return True


def _run_in_child(item, n):
    config = item.config
    env = dict(os.environ, **{_ENV: str(n), _CHILD: "1"})
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", __name__,
            "--rootdir", str(config.rootpath), item.nodeid]
    r = subprocess.run(args, cwd=str(config.rootpath), env=env, capture_output=True,
                       text=True, timeout=float(os.environ.get("CTRAINSTATE_PYTEST_TIMEOUT",
                                                               "900")))
    if r.returncode == 5:
        raise RuntimeError(f"{item.nodeid}: the interpreter started with {n} devices "
                           f"collected no such test")
    if r.returncode != 0:
        tail = (r.stdout + r.stderr)[-6000:]
        pytest.fail(f"{item.nodeid} failed when run with {n} CPU devices in a fresh "
                    f"interpreter:\n{tail}", pytrace=False)


@pytest.fixture
def cpu_devices(request):
    """The CPU devices of this test (``ctrainstate.devices('cpu')``)."""
    import ctrainstate as cts
    return cts.devices("cpu")


@pytest.fixture
def mesh(request):
    """``mesh(shape, axis_names)``: a ``ctrainstate.Mesh`` of this test's CPU devices."""
    import ctrainstate as cts

    def make(shape, axis_names):
        return cts.make_mesh(tuple(shape), tuple(axis_names))
    return make

