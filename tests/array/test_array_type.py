"""ctrainstate.Array is a C type (csrc/python/py_array.c): its fields, construction rules,
the Python methods attached to it at import, and the moves of in-place steps."""
import copy
import pickle
import weakref

import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import _C


def test_array_is_the_c_type_and_cannot_be_constructed_or_subclassed():
    x = cts.device_put(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert type(x) is cts.Array is _C.Array
    assert cts.Array.__module__ == "ctrainstate" and cts.Array.__name__ == "Array"
    with pytest.raises(TypeError, match="device_put"):
        cts.Array()
    with pytest.raises(TypeError):
        class Sub(cts.Array):   # noqa: F841 - not a base type
            pass
    with pytest.raises(TypeError):   # immutable once the Python methods are attached
        cts.Array.shape = None
    with pytest.raises(RuntimeError, match="already complete"):
        _C.array_type_extend({"extra": 1})


def test_fields_and_metadata():
    x = cts.device_put(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert x.shape == x._shape == (2, 3) and x.ndim == 2 and x.size == 6 and x.nbytes == 24
    assert x.dtype == np.float32 and x._dtype is x.dtype
    assert x.sharding is x._sharding and x._shard_shape == (2, 3)
    assert x._donated is False and x._base is None and x._host_scalar is None
    dev, buf, start, rid = x._blocks[0]
    assert isinstance(buf, _C.Buffer) and start == (0, 0) and rid == 0
    assert np.asarray(x).tolist() == [[0, 1, 2], [3, 4, 5]]


def test_python_methods_are_attached_with_array_names():
    assert cts.Array.__repr__.__qualname__ == "Array.__repr__"
    assert cts.Array.astype.__qualname__ == "Array.astype"
    assert "per-device shards" in cts.Array.__doc__
    x = cts.device_put(np.float32([1, 2]))
    assert repr(x) == "Array([1., 2.], dtype=float32)"
    assert x.__array_priority__ == 100
    assert hash(x) == object.__hash__(x)   # identity hash (plans key on Arrays)
    assert (x == x).tolist() == [True, True]


def test_weakref_copy_pickle():
    x = cts.device_put(np.float32([1, 2, 3]))
    r = weakref.ref(x)
    assert r() is x
    y = copy.deepcopy(x)
    assert type(y) is cts.Array and y is not x and y.tolist() == [1.0, 2.0, 3.0]
    z = pickle.loads(pickle.dumps(x))
    assert type(z) is cts.Array and z.tolist() == [1.0, 2.0, 3.0]
    del x
    assert r() is None


def test_create_and_moved():
    x = cts.device_put(np.float32([1, 2]))
    y = cts.Array._create([2], "float32", x.sharding, x._blocks)
    assert y.shape == (2,) and y.dtype == np.float32 and y._shard_shape == (2,)
    assert y._blocks is x._blocks
    m = y._moved()
    assert y._donated is True and m._donated is False and m._blocks is y._blocks
    with pytest.raises(cts.DonatedBufferError, match="donated"):
        y._moved()
    with pytest.raises(cts.DonatedBufferError, match="donated"):
        y._check_alive()
    with pytest.raises(TypeError, match="4 arguments"):
        cts.Array._create((2,), "float32")


def test_check_alive_after_delete_and_views():
    x = cts.device_put(np.float32([1, 2]))
    x._check_alive()
    x.delete()
    with pytest.raises(cts.DonatedBufferError, match="deleted"):
        x._check_alive()
    with pytest.raises(cts.DonatedBufferError, match="deleted"):
        x + 1.0
    v = cts.device_put(np.float32([1, 2]))
    v._base = cts.device_put(np.float32([0]))   # (a view, as a GPU Shard.data)
    with pytest.raises(ValueError, match="view"):
        v._moved()


def test_move_arrays_all_or_nothing():
    a = cts.device_put(np.float32([1]))
    b = cts.device_put(np.float32([2]))
    out = _C.move_arrays([a, b])
    assert [o.tolist() for o in out] == [[1.0], [2.0]]
    assert a._donated is True and b._donated is True
    c = cts.device_put(np.float32([3]))
    assert _C.move_arrays([c, a]) == 1        # a is donated: nothing changes
    assert c._donated is False
    with pytest.raises(TypeError, match="not an Array"):
        _C.move_arrays([c, object()])
