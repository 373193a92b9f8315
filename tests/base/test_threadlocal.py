"""The package's thread-locals read by the C code (base.threadlocal.NotifyingLocal): the C
readers keep a memo of the values the current thread read, which every attribute write
drops, on any thread and on the class. Checked through a C reader: the float32 matmul's C path, which
reads the thread's precision `default` and the process's `process` (base.precision)."""
import threading

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import _C
from ctrainstate._src.base import precision as _precision
from ctrainstate._src.base.threadlocal import NotifyingLocal

X = np.array([[1 + 2.0 ** -12, 1.0]], np.float32)
EXACT = [[1 + 2.0 ** -12, 1.0]]
TF32 = [[1.0, 1.0]]     # the product rounded to tensorfloat32 (10 mantissa bits)


def _product():
    x, eye = cts.device_put(X), cts.device_put(np.eye(2, dtype=np.float32))
    return (x @ eye).tolist()


def test_the_hot_path_locals_notify_their_writes():
    from ctrainstate._src.array import sharding
    from ctrainstate._src.base import trace_state
    from ctrainstate._src.nn import module, scope, spmd
    from ctrainstate._src.ops import ops
    for cls in (ops._TapeLocal, module._Context, spmd._StrictState, scope._ScopeLocal,
                sharding._MeshLocal, _precision._PrecisionLocal, trace_state._DepthLocal):
        assert issubclass(cls, NotifyingLocal) and cls._ct_notifies_writes is True, cls


def test_instance_writes_and_deletes_reach_the_c_reader():
    assert _product() == EXACT                  # memoised: default None, process float32
    _precision._tls.default = _precision.TF32
    try:
        assert _product() == TF32
        assert _product() == TF32               # (read again from the memo)
    finally:
        del _precision._tls.default
    assert _product() == EXACT
    with cts.default_matmul_precision("tensorfloat32"):
        assert _product() == TF32
    assert _product() == EXACT


def test_class_writes_reach_the_c_reader():
    assert _product() == EXACT
    _precision.set_process_default("tensorfloat32")     # _PrecisionLocal.process = TF32
    try:
        assert _product() == TF32
    finally:
        _precision.set_process_default(None)
    assert _product() == EXACT


def test_each_thread_reads_its_own_values():
    """A thread's write drops every thread's memo, and each thread still reads its own
    dict: one thread inside a tensorfloat32 block, another reading float32 meanwhile."""
    entered, done = threading.Event(), threading.Event()
    seen = {}

    def inside():
        with cts.default_matmul_precision("tensorfloat32"):
            seen["inside"] = _product()
            entered.set()
            done.wait(10)
            seen["inside, later"] = _product()

    assert _product() == EXACT
    t = threading.Thread(target=inside)
    t.start()
    assert entered.wait(10)
    seen["outside"] = _product()
    done.set()
    t.join(10)
    assert seen == {"inside": TF32, "outside": EXACT, "inside, later": TF32}
    assert _product() == EXACT


def test_tls_changed_takes_no_arguments():
    assert _C.tls_changed() is None
    with pytest.raises(TypeError):
        _C.tls_changed(1)
