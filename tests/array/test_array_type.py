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


def _mesh(shape=(2, 4)):
    return cts.Mesh(np.array(cts.devices()[:8]).reshape(shape), ("x", "y"))


@pytest.mark.parametrize("dtype", [np.float32, cts.numpy.bfloat16, np.int32, np.bool_])
def test_array_gathers_every_layout_in_c(dtype):
    """__array__ (C) writes each block once (replicas skipped) into a new numpy array of the
    Array's dtype, or of the dtype asked for."""
    h = (np.arange(64).reshape(8, 8) % 7 - 3).astype(dtype)
    for spec in ((), ("x",), (None, "y"), ("x", "y"), ("y", "x")):
        a = cts.device_put(h, cts.NamedSharding(_mesh(), cts.P(*spec)))
        out = a.__array__()
        assert type(out) is np.ndarray and out.dtype == h.dtype and out.flags.writeable
        np.testing.assert_array_equal(out, h)
        assert out is not a.__array__()                      # a new array each time
        np.testing.assert_array_equal(np.asarray(a, np.float64), h.astype(np.float64))
        assert np.asarray(a, dtype=np.float64).dtype == np.float64
        assert np.array(a, copy=True).dtype == h.dtype
    with pytest.raises(TypeError, match="unexpected keyword"):
        a.__array__(order="C")
    with pytest.raises(TypeError):
        a.__array__("not a dtype")


def test_item_float_int_bool_read_the_one_element():
    for v, dt in ((2.5, np.float32), (-3, np.int32), (1.5, cts.numpy.bfloat16), (True, np.bool_)):
        x = cts.device_put(np.array(v, dt))
        assert x.item() == v and type(x.item()) is type(np.array(v, dt).item())
        assert float(x) == float(v) and int(x) == int(v) and bool(x) is bool(v)
    one = cts.device_put(np.float32([[0.0]]), cts.NamedSharding(_mesh(), cts.P()))
    assert one.item() == 0.0 and not one
    many = cts.device_put(np.float32([1.0, 2.0]))
    with pytest.raises(ValueError, match="one element"):
        many.item()
    with pytest.raises(ValueError, match="ambiguous"):
        bool(many)
    with pytest.raises(ValueError, match="one element"):
        float(many)


def test_host_reads_of_a_donated_or_deleted_array_raise():
    x = cts.device_put(np.float32([1.0]))
    y = cts.device_put(np.float32(4.0))
    x._moved()
    y.delete()
    for f in (np.asarray, float, bool, lambda a: a.item()):
        with pytest.raises(cts.DonatedBufferError):
            f(x)
        with pytest.raises(cts.DonatedBufferError, match="deleted"):
            f(y)


def test_numpy_ufuncs_give_numpy_and_ndarray_operators_give_arrays():
    """As with jax.Array (no __array_ufunc__): np.sin(x) converts x and returns numpy;
    `ndarray + x` is x's reflected operator, an Array."""
    x = cts.device_put(np.float32([0.5, 1.0]))
    s = np.sin(x)
    assert type(s) is np.ndarray
    np.testing.assert_array_equal(s, np.sin(np.float32([0.5, 1.0])))
    r = np.float32([1.0, 2.0]) + x
    assert type(r) is cts.Array
    np.testing.assert_array_equal(np.asarray(r), [1.5, 3.0])


def test_the_extension_uses_multi_phase_init_and_runs_once_per_process():
    """ctrainstate._C is a multi-phase module (PyModuleDef_Init, its state owning its types):
    executing it a second time in the process — what a reload or a sub-interpreter does —
    raises ImportError naming why, and the Array type is a heap type (PyType_FromSpec)."""
    import importlib.util
    from ctrainstate import _C
    spec = importlib.util.find_spec("ctrainstate._C")
    again = importlib.util.module_from_spec(spec)
    with pytest.raises(ImportError, match="already initialised in this process"):
        spec.loader.exec_module(again)
    heap = 1 << 9   # Py_TPFLAGS_HEAPTYPE
    assert _C.Array.__flags__ & heap and _C.Program.__flags__ & heap
    assert (cts.numpy.ones(2) + 1.0).tolist() == [2.0, 2.0]   # the loaded module is unaffected
