"""Array.__getitem__'s C path (csrc/python/py_slice.c): basic indices of an Array that every
device holds whole give what the Python op (ops.slicing.getitem) gives -- the same bits, dtype,
shape, sharding (type, equality, spec), blocks (device, start, replica id) and errors -- with no
Python frame on a plan hit; every other index, a sharded layout, a tape and a jit trace go to the
Python op, so gradients and jitted programs are unchanged."""
import enum
import functools
import operator
import threading

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import _C
from ctrainstate._src.ops import slicing
from call_counts import python_calls, python_frames

DTYPES = [np.float32, cnp.bfloat16, np.float16, np.int32, np.uint32, np.bool_, np.uint8,
          np.int8, np.int16, np.uint16]

# indices the C path takes (on an Array of the SHAPES below that they fit)
BASIC = [
    0, -1, 3, np.int64(2), np.int32(-2), np.uint8(1), slice(None), slice(1, 3), slice(-3, None),
    slice(None, -1), slice(5, 2), slice(-100, 100), slice(2**70, None), slice(None, -2**70),
    slice(1, 3, 1), slice(np.int64(1), np.int32(4)), None, Ellipsis, (), (0,), (0, 1), (-1, -1),
    (slice(None), 0), (slice(None), -1), (Ellipsis, None), (None, Ellipsis), (None, 0, None),
    (Ellipsis, 0), (0, Ellipsis), (slice(1, 3), None, slice(2, 4)), (None, None),
    (slice(0, 0), slice(None)), (Ellipsis, slice(1, 2)), (1, Ellipsis, None),
]
# indices the Python op takes (advanced indices, or steps the C path leaves to it)
OTHER = [
    True, False, np.bool_(True), [0, 1], np.array([1, 0]), np.array(1), slice(None, None, 2),
    slice(None, None, -1), slice(None, None, np.int64(1)), (slice(None), [0, 2]),
    (np.array([True, False, True, True]),),
]
# errors: the C path leaves each to the Python op, whose type and message it gives
BAD = [
    4, -5, 2**70, -2**70, np.int64(9), (0, 0, 0, 0), (Ellipsis, Ellipsis), 1.5, "a",
    slice(1.5, None), slice(None, None, 0), (0, 0, 0, None, 0), {}, object(),
]
SHAPES = [(4, 6), (4, 3, 5), (4,), (4, 0), (4, 1)]


def _data(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) < 0.5
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=np.int64, endpoint=True).astype(dtype)
    h = (rng.standard_normal(shape) * 100).astype(dtype)
    flat = h.reshape(-1)
    for k, v in enumerate([np.nan, -0.0, np.inf, -np.inf]):   # bits the copies must keep
        if k < flat.size:
            flat[k] = v
    return h


def _python(x, idx):
    """The Python op (outside a trace, getitem is the op itself)."""
    return slicing.getitem(x, idx)


def _layout(a):
    return [(dev, tuple(start), rid) for dev, _, start, rid in a._blocks]


def _assert_same(got, want, what=""):
    assert type(got) is cts.Array, what
    assert got.dtype == want.dtype, what
    assert got.shape == want.shape and type(got.shape) is tuple, what
    assert got._shard_shape == want._shard_shape, what
    assert type(got.sharding) is type(want.sharding), what
    assert got.sharding == want.sharding, what
    if isinstance(want.sharding, cts.NamedSharding):
        assert got.sharding.spec == want.sharding.spec, what
        assert got.sharding.mesh == want.sharding.mesh, what
    assert _layout(got) == _layout(want), what
    assert got._host_scalar is None and got._base is None and got._donated is False, what
    g, w = np.asarray(got), np.asarray(want)
    assert g.dtype == w.dtype and g.shape == w.shape, what
    assert g.tobytes() == w.tobytes(), what


def _fits(idx, shape):
    try:
        np.empty(shape)[idx]
        return True
    except (IndexError, TypeError, ValueError):
        return False


def _hits():
    return _C.getitem_cache_info()["hits"]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_basic_indices_match_the_python_op(dtype, shape):
    h = _data(shape, dtype)
    x = cts.device_put(h)
    n = 0
    for idx in BASIC:
        if not _fits(idx, shape):
            continue
        before = _hits()
        got = x[idx]
        assert _hits() == before + 1, f"{idx!r}: not the C path"
        want = _python(x, idx)
        _assert_same(got, want, repr(idx))
        assert np.asarray(got).tobytes() == h[idx].tobytes(), repr(idx)   # numpy's values too
        assert got is not x
        assert all(gb is not xb for (_, gb, _, _) in got._blocks for (_, xb, _, _) in x._blocks)
        n += 1
    assert n >= 20


@pytest.mark.parametrize("dtype", [np.float32, cnp.bfloat16, np.int32, np.bool_],
                         ids=lambda d: np.dtype(d).name)
def test_zero_d_and_new_axes(dtype):
    h = np.asarray(_data((1,), dtype)[0])
    x = cts.device_put(h)
    assert x.shape == ()
    for idx in [(), Ellipsis, None, (None, None), (Ellipsis, None), (None, Ellipsis, None)]:
        before = _hits()
        got = x[idx]
        assert _hits() == before + 1, repr(idx)
        _assert_same(got, _python(x, idx), repr(idx))
        assert got is not x


@pytest.mark.parametrize("idx", OTHER, ids=repr)
def test_other_indices_go_to_the_python_op(idx):
    h = _data((4, 4), np.float32)
    x = cts.device_put(h)
    before = _C.getitem_cache_info()
    got = x[idx]
    after = _C.getitem_cache_info()
    assert after["hits"] == before["hits"] and after["fallbacks"] == before["fallbacks"] + 1
    _assert_same(got, _python(x, idx), repr(idx))


def _error(fn):
    try:
        fn()
    except Exception as e:   # noqa: BLE001 (the comparison is the point)
        return type(e), str(e)
    return None


@pytest.mark.parametrize("idx", BAD, ids=repr)
def test_errors_are_the_python_ops(idx):
    x = cts.device_put(_data((4, 3, 2), np.float32))
    got, want = _error(lambda: x[idx]), _error(lambda: _python(x, idx))
    assert want is not None, "the case must be an error"
    assert got == want


def test_index_objects_that_raise_are_the_python_ops():
    class Bad:
        def __index__(self):
            raise ValueError("no index")

    class Seven(enum.IntEnum):
        SEVEN = 7

    x = cts.device_put(_data((8, 3), np.float32))
    for idx in [Bad(), slice(Bad(), None), (0, Bad())]:
        got, want = _error(lambda: x[idx]), _error(lambda: _python(x, idx))
        assert want is not None and got == want
    _assert_same(x[Seven.SEVEN], _python(x, Seven.SEVEN))   # an int subclass: its value
    _assert_same(x[slice(Seven.SEVEN, None)], _python(x, slice(Seven.SEVEN, None)))

    class Odd(int):   # an int subclass whose int() is not its value: the Python op's int()
        def __int__(self):
            return 1

    for idx in [Odd(2), (Odd(3), 0)]:
        _assert_same(x[idx], _python(x, idx))


def test_donated_and_deleted_operands_raise_as_the_python_op():
    x = cts.device_put(np.ones((4, 3), np.float32))
    y = x._moved()   # x is donated
    for idx in [0, slice(1, 2), Ellipsis, 9]:
        got, want = _error(lambda: x[idx]), _error(lambda: _python(x, idx))
        assert want is not None and got == want
    assert np.asarray(y[0]).tolist() == [1.0, 1.0, 1.0]
    y.delete()
    for idx in [0, (), None]:
        got, want = _error(lambda: y[idx]), _error(lambda: _python(y, idx))
        assert want is not None and got == want


def test_whole_index_is_a_new_array_with_its_own_buffers():
    h = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = cts.device_put(h)
    for idx in [slice(None), Ellipsis, (), (slice(None), slice(None))]:
        y = x[idx]
        assert y is not x and y.sharding is x.sharding
        _assert_same(y, _python(x, idx), repr(idx))
    y = x[:]
    x.delete()
    np.testing.assert_array_equal(np.asarray(y), h)


def test_no_python_frames_on_a_plan_hit():
    x = cts.device_put(np.ones((16, 8), np.float32))
    for idx in [0, slice(1, 3), (slice(None), 0), (Ellipsis, None), (slice(None), -1),
                None, slice(None), np.int64(3)]:
        x[idx]   # (the plan)
        call = functools.partial(operator.getitem, x, idx)   # (a C callable: no frame of its own)
        assert python_calls(call) == 0, repr(idx)
    frames = python_frames(lambda: x[1:3][0][None])
    assert [name for _, name in frames] == ["<lambda>"]
    assert python_calls(functools.partial(operator.getitem, x, [0])) > 0   # (the Python op)


def _meshes():
    n = len(cts.devices())
    out = [((1,), ("x",))]
    if n >= 8:
        out += [((8,), ("x",)), ((2, 4), ("data", "model"))]
    return out


@pytest.mark.parametrize("mesh_shape,names", _meshes(), ids=str)
def test_replicated_mesh_arrays(mesh_shape, names):
    mesh = cts.make_mesh(mesh_shape, names)
    h = _data((4, 6), np.float32)
    for spec in [cts.P(), cts.P(None, None)]:
        x = cts.device_put(h, cts.NamedSharding(mesh, spec))
        for idx in [0, -1, slice(1, 3), (slice(None), 2), (Ellipsis, None), Ellipsis, (None, 0),
                    slice(3, 1)]:
            before = _hits()
            got = x[idx]
            assert _hits() == before + 1, repr(idx)
            _assert_same(got, _python(x, idx), f"{spec} {idx!r}")
            assert len(got._blocks) == mesh.size


@pytest.mark.skipif(len(cts.devices()) < 8, reason="needs 8 devices")
def test_sharded_layouts_go_to_the_python_op():
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    h = _data((4, 8), np.float32)
    one = cts.make_mesh((1,), ("x",))
    for x in [cts.device_put(h, cts.NamedSharding(mesh, cts.P("data"))),
              cts.device_put(h, cts.NamedSharding(mesh, cts.P(None, "model"))),
              cts.device_put(h, cts.NamedSharding(one, cts.P("x")))]:   # (a size-1 mesh axis)
        for idx in [0, slice(1, 3), (slice(None), 1), (Ellipsis, None), slice(None)]:
            before = _hits()
            got = x[idx]
            assert _hits() == before, (x.sharding, idx)
            _assert_same(got, _python(x, idx), f"{x.sharding} {idx!r}")


def test_gradients_through_indexing_are_unchanged():
    h = np.arange(12, dtype=np.float32).reshape(3, 4) / 4

    def loss(x):
        return cnp.sum(x[0] * x[1:3][1]) + cnp.sum(x[..., None][:, 2] * 3.0) + cnp.sum(x[:] * x[-1])

    x = cts.device_put(h)
    before = _hits()
    v, g = cts.value_and_grad(loss)(x)
    assert _hits() == before   # (under a tape: the Python op records the slices' vjps)
    want = np.zeros_like(h)
    want[0] += h[2]
    want[2] += h[0]
    want[:, 2] += 3.0
    want += h[-1]
    want[-1] += h.sum(0)
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-6)
    np.testing.assert_allclose(float(v), float(loss(x)), rtol=1e-6)
    # bfloat16 operands: the same gradient bits as the Python op's (recorded as copies)
    xb = cts.device_put(h.astype(cnp.bfloat16))
    _, gb = cts.value_and_grad(lambda x: cnp.sum(cnp.astype(x[1], np.float32)))(xb)
    wb = np.zeros((3, 4), np.float32)
    wb[1] = 1
    np.testing.assert_array_equal(np.asarray(gb).astype(np.float32), wb)


def test_jitted_functions_follow_their_inputs():
    @cts.jit
    def f(x):
        return x[0] * 2.0 + x[-1][1:3].sum() + x[..., None][1, 2, 0]

    h = np.arange(12, dtype=np.float32).reshape(3, 4)
    for k in range(4):   # (traced, then replayed on new values)
        hk = h + 10 * k
        got = np.asarray(f(cts.device_put(hk)))
        np.testing.assert_allclose(got, hk[0] * 2 + hk[-1][1:3].sum() + hk[1, 2])


def test_threads_index_large_arrays():
    # 1.5 MiB regions: copied with the GIL released, the operand's buffers pinned
    h = _data((640, 1024), np.float32)
    x = cts.device_put(h)
    errors = []

    def work(k):
        try:
            for r in range(6):
                a = (k * 37 + r * 11) % 200
                y = x[a:a + 400]
                if np.asarray(y).tobytes() != h[a:a + 400].tobytes():
                    errors.append((k, r))
                z = x[a]
                if np.asarray(z).tobytes() != h[a].tobytes():
                    errors.append((k, r, "row"))
        except Exception as e:   # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    _assert_same(x[100:500], _python(x, slice(100, 500)))


def test_getitem_register_checks_its_arguments():
    with pytest.raises(TypeError, match="getitem_register takes 2 arguments"):
        _C.getitem_register(slicing.getitem)
    with pytest.raises(TypeError, match="must be callable"):
        _C.getitem_register(slicing.getitem, 3)
    with pytest.raises(TypeError, match="doesn.t apply to a .numpy.ndarray"):
        _C.array_getitem(np.ones(3), 0)
    x = cts.device_put(np.ones(3, np.float32))
    assert np.asarray(x[1]).tolist() == 1.0   # (still registered)


def test_a_malformed_plan_raises():
    x = cts.device_put(np.ones((3, 2), np.float32))
    try:
        _C.getitem_register(slicing.getitem, lambda x, nd: ("not", "a", "plan"))
        with pytest.raises(TypeError, match="the planner returned"):
            x[0]
        _C.getitem_register(slicing.getitem, lambda x, nd: None)   # None: the Python op
        before = _C.getitem_cache_info()
        _assert_same(x[0], _python(x, 0))
        after = _C.getitem_cache_info()
        assert after["hits"] == before["hits"] and after["fallbacks"] == before["fallbacks"] + 1
    finally:
        _C.getitem_register(slicing.getitem, slicing._getitem_plan)
    before = _hits()
    x[0]
    assert _hits() == before + 1
