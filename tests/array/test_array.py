"""Arrays: device_put, gather, resharding, shards, dtypes, memory, errors."""
import gc
import itertools

import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import P, NamedSharding
from conftest import bytes_in_use
from test_sharding import MESHES, _random_specs, mesh_of


def _all_shardings(rng, ndim=2, per_mesh=4):
    out = []
    for shape in MESHES:
        m = mesh_of(shape)
        out += [NamedSharding(m, s) for s in _random_specs(m, ndim, rng, per_mesh)]
    return out


@pytest.mark.parametrize("shape", list(MESHES))
def test_round_trip_random_specs(shape):
    rng = np.random.default_rng(42)
    m = mesh_of(shape)
    for spec in _random_specs(m, 3, rng, 10):
        x = rng.standard_normal((8, 16, 8)).astype(np.float32)
        s = NamedSharding(m, spec)
        a = cts.device_put(x, s)
        assert a.shape == x.shape and a.dtype == np.float32 and a.sharding is s
        np.testing.assert_array_equal(np.asarray(a), x)
        shards = a.addressable_shards
        assert len(shards) == 8
        for sh in shards:
            np.testing.assert_array_equal(sh.data, x[sh.index])
            assert sh.data.shape == s.shard_shape(x.shape)


def test_resharding_between_all_pairs_is_exact(mem_baseline):
    rng = np.random.default_rng(7)
    shardings = _all_shardings(rng, ndim=2, per_mesh=3)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    placed = [cts.device_put(x, s) for s in shardings]
    for a, s in itertools.product(placed, shardings):
        b = cts.device_put(a, s)
        assert b.sharding == s
        np.testing.assert_array_equal(np.asarray(b), x)
        for sh in b.addressable_shards:
            np.testing.assert_array_equal(sh.data, x[sh.index])
    del placed, a, b, sh
    gc.collect()
    assert bytes_in_use() == mem_baseline


def test_each_device_holds_only_its_shard(mem_baseline):
    m = mesh_of((8,))
    x = np.zeros((2048, 8192), np.float32)  # 64 MiB
    a = cts.device_put(x, NamedSharding(m, P("x", None)))
    grown = [n - b for n, b in zip(bytes_in_use(), mem_baseline)]
    assert grown == [8 << 20] * 8
    del a
    gc.collect()
    assert bytes_in_use() == mem_baseline


def test_replicas_are_separate_buffers():
    m = mesh_of((2, 4))
    x = np.arange(8, dtype=np.float32)
    a = cts.device_put(x, NamedSharding(m, P("model")))
    shards = a.addressable_shards
    assert sorted(s.replica_id for s in shards) == [0, 0, 0, 0, 1, 1, 1, 1]
    s0 = shards[0]
    twin = [s for s in shards if s.index == s0.index and s is not s0][0]
    s0.data[0] = 100.0  # write through one replica's view
    assert twin.data[0] == x[s0.index][0]


NARROW_INTS = [np.uint8, np.int8, np.int16, np.uint16]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.uint32,
                                   np.bool_] + NARROW_INTS)
def test_dtypes_round_trip(dtype):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((8, 6)) * 50).astype(dtype)
    s = NamedSharding(mesh_of((2, 4)), P(("data", "model")))
    a = cts.device_put(x, s)
    assert a.dtype == np.dtype(dtype)
    y = np.asarray(a)
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(y.view(np.uint8), x.view(np.uint8))
    b = cts.device_put(a, NamedSharding(mesh_of((4, 2)), P(None, "model")))
    np.testing.assert_array_equal(np.asarray(b).view(np.uint8), x.view(np.uint8))


def test_64bit_inputs_are_narrowed_like_jax():
    assert cts.device_put(np.zeros(3)).dtype == np.float32
    assert cts.device_put(np.zeros(3, np.int64)).dtype == np.int32
    assert cts.device_put(1.5).dtype == np.float32
    assert cts.device_put(7).dtype == np.int32
    assert cts.device_put(True).dtype == np.bool_
    assert float(cts.device_put(2.5)) == 2.5


def test_unsupported_dtype():
    with pytest.raises(TypeError, match="complex64 is not supported"):
        cts.device_put(np.zeros(3, np.complex64))
    # the message lists what is stored, the narrow ints included
    with pytest.raises(TypeError, match="complex128 is not supported; ctrainstate stores .*uint8, "
                                        "int8, int16, uint16"):
        cnp.zeros(3, np.complex128)
    for bad in (np.complex64, np.float128 if hasattr(np, "float128") else np.complex128,
                np.dtype("U3")):
        with pytest.raises(TypeError, match=f"{np.dtype(bad)} is not supported"):
            cnp.asarray(np.zeros(2), dtype=bad)
        with pytest.raises(TypeError, match=f"{np.dtype(bad)} is not supported"):
            cts.device_put(np.zeros(3, np.uint8)).astype(bad)
    # 64-bit ints keep narrowing as jax does without x64
    assert cnp.zeros(3, np.uint64).dtype == np.uint32 and cnp.zeros(3, np.int64).dtype == np.int32


def test_scalars_and_zero_size():
    s = cts.device_put(np.float32(3.0))
    assert s.shape == () and s.ndim == 0 and s.size == 1 and s.item() == 3.0
    m = mesh_of((8,))
    z = cts.device_put(np.zeros((0, 8), np.float32), NamedSharding(m, P(None, "x")))
    assert z.shape == (0, 8) and np.asarray(z).shape == (0, 8)
    r = cts.device_put(np.float32(2.0), NamedSharding(m, P()))
    assert len(r.addressable_shards) == 8 and float(r) == 2.0


def test_non_contiguous_and_byteswapped_inputs():
    rng = np.random.default_rng(5)
    base = rng.standard_normal((16, 24)).astype(np.float32)
    x = base[::2, ::3].T  # non-contiguous, transposed view
    s = NamedSharding(mesh_of((2, 4)), P("model", "data"))
    np.testing.assert_array_equal(np.asarray(cts.device_put(x, s)), x)
    big_endian = base.astype(">f4")
    np.testing.assert_array_equal(np.asarray(cts.device_put(big_endian, s)), base)


def test_default_placement():
    a = cts.device_put(np.ones(4, np.float32))
    assert [sh.device for sh in a.addressable_shards] == [cts.devices()[0]]
    m = mesh_of((2, 4))
    with m:
        b = cts.device_put(np.ones(4, np.float32))
    assert b.sharding == NamedSharding(m, P())
    assert len(b.addressable_shards) == 8 and b.is_fully_replicated
    c = cts.device_put(np.ones(4, np.float32), cts.devices()[6])
    assert [sh.device.id for sh in c.addressable_shards] == [6]
    assert cts.device_put(c) is c


def test_pytrees_are_placed_leaf_by_leaf():
    tree = {"w": np.ones((8, 2), np.float32), "b": [np.zeros(8, np.float32), None]}
    s = NamedSharding(mesh_of((8,)), P("x"))
    out = cts.device_put(tree, s)
    assert isinstance(out["w"], cts.Array) and out["b"][1] is None
    assert out["w"].sharding == s
    cts.block_until_ready(out)


def test_bad_inputs_raise_and_do_not_leak(mem_baseline):
    m = mesh_of((2, 4))
    x = np.zeros((10, 4), np.float32)
    cases = [
        (lambda: cts.device_put(x, NamedSharding(m, P("model"))), ValueError, "not divisible"),
        (lambda: cts.device_put(x, NamedSharding(m, P("data", "model", None))), ValueError, "rank 2"),
        (lambda: cts.device_put(x, "data"), TypeError, "expected a NamedSharding"),
        (lambda: cts.device_put(np.zeros(3, np.complex128)), TypeError, "not supported"),
    ]
    a = cts.device_put(np.zeros((8, 8), np.float32), NamedSharding(m, P("data")))
    cases.append((lambda: cts.device_put(a, NamedSharding(m, P(None, ("data", "model"), None))),
                  ValueError, "rank 2"))
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn()
    del a
    gc.collect()
    assert bytes_in_use() == mem_baseline


def test_delete_and_donated_errors(mem_baseline):
    a = cts.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh_of((8,)), P("x")))
    a.delete()
    assert a.is_deleted()
    with pytest.raises(cts.DonatedBufferError, match="deleted"):
        np.asarray(a)
    gc.collect()
    assert bytes_in_use() == mem_baseline
    b = cts.device_put(np.ones(8, np.float32))
    blocks = b._donate()
    assert len(blocks) == 1
    with pytest.raises(cts.DonatedBufferError, match="donated"):
        np.asarray(b)
    assert "donated" in repr(b)


def test_delete_refused_while_a_view_lives():
    a = cts.device_put(np.ones(8, np.float32))
    view = a.addressable_shards[0].data
    with pytest.raises(RuntimeError, match="live view"):
        a.delete()
    del view
    gc.collect()
    a.delete()
    assert a.is_deleted()


def test_array_constructor_is_private():
    with pytest.raises(TypeError, match="device_put"):
        cts.Array()


def test_repr_and_visualize(capsys):
    m = mesh_of((2, 4))
    a = cts.device_put(np.zeros((4, 8), np.float32), NamedSharding(m, P("data", "model")))
    row = "[0., 0., 0., 0., 0., 0., 0., 0.]"
    assert repr(a) == ("Array([" + ",\n       ".join([row] * 4) + "], dtype=float32,\n"
                       "      sharding=P('data', 'model') on Mesh('data': 2, 'model': 4))")
    assert cts.visualize_array_sharding(a) is None
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert len(lines) == 5  # top, row, separator, row, bottom
    assert [c.strip() for c in lines[1].strip("│").split("│")] == ["CPU 0", "CPU 1", "CPU 2", "CPU 3"]
    assert [c.strip() for c in lines[3].strip("│").split("│")] == ["CPU 4", "CPU 5", "CPU 6", "CPU 7"]
    r = cts.device_put(np.zeros(8, np.float32), NamedSharding(m, P("model")))
    cts.visualize_array_sharding(r)
    t = capsys.readouterr().out
    assert [c.strip() for c in t.splitlines()[1].strip("│").split("│")] == ["CPU 0,4", "CPU 1,5", "CPU 2,6", "CPU 3,7"]
    html = a._repr_html_()
    assert html.count("<td") == 8 and "CPU 5" in html
    with pytest.raises(ValueError, match="1-d and 2-d"):
        cts.visualize_array_sharding(cts.device_put(np.zeros((2, 2, 2), np.float32)))


def test_visualize_array_sharding_prints_once_and_returns_none(capsys):
    from ctrainstate import debug
    m = mesh_of((2, 4))
    a = cts.device_put(np.zeros((4, 8), np.float32), NamedSharding(m, P("data", "model")))
    assert debug.visualize_array_sharding(a, use_color=True, scale=2.0, min_width=4,
                                          max_width=100, color_map=None) is None
    printed = capsys.readouterr().out
    assert printed.count("┌") == 1 and "CPU 7" in printed
    # visualize_sharding draws the same grid from a shape and a sharding
    assert debug.visualize_sharding((4, 8), a.sharding) is None
    assert capsys.readouterr().out == printed
    seen = []
    debug.inspect_array_sharding(a, callback=seen.append)
    assert seen == [a.sharding]
    with pytest.raises(TypeError, match="Sharding"):
        debug.visualize_sharding((4, 8), P("data"))


# Recorded from jax 0.10.2 (repr(jnp.asarray(h)) / str(...)) for the same host values.
_JAX_REPRS = [
    (np.float32([1, 4]), "Array([1., 4.], dtype=float32)", "[1. 4.]"),
    (np.array([True, False]), "Array([ True, False], dtype=bool)", "[ True False]"),
    (np.zeros((2, 3), np.int32), "Array([[0, 0, 0],\n       [0, 0, 0]], dtype=int32)",
     "[[0 0 0]\n [0 0 0]]"),
    (np.float32(1.5), "Array(1.5, dtype=float32)", "1.5"),
    (np.zeros((0, 3), np.float32), "Array([], shape=(0, 3), dtype=float32)", "[]"),
    (np.arange(2000, dtype=np.float32),
     "Array([0.000e+00, 1.000e+00, 2.000e+00, ..., 1.997e+03, 1.998e+03,\n"
     "       1.999e+03], dtype=float32)",
     "[0.000e+00 1.000e+00 2.000e+00 ... 1.997e+03 1.998e+03 1.999e+03]"),
]


@pytest.mark.parametrize("host,want_repr,want_str", _JAX_REPRS,
                         ids=[str(h.shape) for h, _, _ in _JAX_REPRS])
def test_array_repr_shows_values_like_jax(host, want_repr, want_str):
    a = cts.device_put(host)
    assert repr(a) == want_repr
    assert str(a) == want_str


def test_array_repr_of_large_sharded_array_matches_numpy_summary():
    m = mesh_of((2, 4))
    rng = np.random.default_rng(0)
    for shape, spec in [((100, 200), P("data", "model")), ((6, 2000), P(None, "model")),
                        ((5, 7, 300), P()), ((7, 7, 7, 7), P())]:
        h = (rng.standard_normal(shape) * 100).astype(np.float32)
        a = cts.device_put(h, NamedSharding(m, spec))
        # numpy 2's repr adds shape= to a summary; the values part is numpy's
        want = np.array2string(h, prefix="Array(", suffix=",", separator=", ")
        assert repr(a).startswith("Array(" + want + ",")
        assert "..." in want and str(a) == str(h)
        assert "sharding=P(" in repr(a)


@pytest.mark.parametrize("dtype", ["float32", "int32", "uint32", "bool", "bfloat16", "float16"])
def test_array_repr_reads_only_the_edge_items(dtype):
    m = mesh_of((2, 4))
    h = (np.arange(40 * 48).reshape(40, 48) % 251).astype(np.dtype(getattr(ml_dtypes, dtype, dtype)))
    a = cts.device_put(h, NamedSharding(m, P("data", "model")))
    host, summarise = a._host_preview()
    assert summarise and host.shape == (7, 7)   # 3 + 3 edge items and one stand-in
    idx = [np.r_[0:3, 36:40], np.r_[0:3, 44:48]]
    np.testing.assert_array_equal(host, h[np.ix_(*idx)])
    # the device-side gather (used for GPU blocks) selects the same items
    np.testing.assert_array_equal(a._gather_items(idx), h[np.ix_(*idx)])
    with np.printoptions(threshold=5000):   # under the threshold: the whole array
        assert a._host_preview()[0].shape == (40, 48)


def test_array_repr_one_device_has_no_sharding_and_html_has_values():
    a = cts.device_put(np.float32([1, 2]))
    assert "sharding" not in repr(a)
    assert a._repr_html_() == "<pre>Array([1., 2.], dtype=float32)</pre>"
    a.delete()
    assert repr(a) == "Array(<deleted>, shape=(2,), dtype=float32)"
    assert "deleted" in str(a) and "deleted" in a._repr_html_()


def test_concurrent_device_put_from_threads():
    import threading
    m = mesh_of((2, 4))
    s = NamedSharding(m, P("data", "model"))
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(20):
                x = rng.standard_normal((16, 16)).astype(np.float32)
                a = cts.device_put(x, s)
                b = cts.device_put(a, NamedSharding(m, P("model")))
                np.testing.assert_array_equal(np.asarray(b), x)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


# --- DLPack ----------------------------------------------------------------------------------

def test_dlpack_export_is_zero_copy_and_keeps_the_buffer_alive():
    a = cts.device_put(np.arange(6, dtype=np.float32).reshape(2, 3))
    v = np.from_dlpack(a)
    np.testing.assert_array_equal(v, np.arange(6).reshape(2, 3))
    a.addressable_shards[0].data[0, 0] = 42.0   # same memory
    assert v[0, 0] == 42.0
    with pytest.raises(RuntimeError, match="live view"):
        a.delete()
    del v
    gc.collect()
    a.delete()


def test_dlpack_of_sharded_array_needs_a_shard():
    m = mesh_of((8,))
    a = cts.device_put(np.arange(8, dtype=np.float32), NamedSharding(m, P("x")))
    with pytest.raises(BufferError, match="addressable_shards"):
        np.from_dlpack(a)
    r = cts.device_put(np.arange(8, dtype=np.float32), NamedSharding(m, P()))
    np.testing.assert_array_equal(np.from_dlpack(r), np.arange(8))  # replicated: whole on each device


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint32, np.float16, np.bool_] + NARROW_INTS)
def test_from_dlpack_copies_strided_host_tensors(dtype):
    x = (np.arange(24).reshape(4, 6) % 5).astype(dtype)[:, ::2]
    try:
        x.__dlpack__()
    except BufferError as e:      # numpy < 1.25 exports no bool tensors
        pytest.skip(f"numpy {np.__version__} cannot export {np.dtype(dtype)}: {e}")
    b = cts.from_dlpack(x)
    assert b.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(b), x)


def test_dlpack_with_jax_when_installed():
    jnp = pytest.importorskip("jax.numpy")
    a = cts.device_put(np.arange(5, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(jnp.from_dlpack(a)), np.arange(5))
    np.testing.assert_array_equal(np.asarray(cts.from_dlpack(jnp.arange(3.0))), [0, 1, 2])
    for dt in NARROW_INTS:      # DLPack's int / uint codes of 8 and 16 bits, both ways
        h = np.array([1, 200, 3]).astype(dt)
        j = jnp.from_dlpack(cts.device_put(h))
        assert j.dtype == dt and np.asarray(j).tolist() == h.tolist()
        back = cts.from_dlpack(jnp.asarray(h))
        assert back.dtype == dt and np.asarray(back).tolist() == h.tolist()


def test_device_put_with_a_pytree_of_shardings():
    """As jax.device_put: the sharding argument may be a pytree prefix of x's."""
    if cts.device_count() < 4:
        pytest.skip("needs 4 CPU devices")
    mesh = cts.make_mesh((2, 2), ("x", "y"))
    rng = np.random.default_rng(0)
    x = {"w": rng.standard_normal((4, 6)).astype(np.float32),
         "sub": {"a": np.arange(8, dtype=np.float32), "b": np.ones((2, 2), np.float32)}}
    sh = {"w": NamedSharding(mesh, P("x", "y")), "sub": NamedSharding(mesh, P())}
    t = cts.device_put(x, sh)
    assert t["w"].sharding == sh["w"] and t["sub"]["a"].sharding == sh["sub"]
    assert t["sub"]["b"].sharding == sh["sub"]          # one sharding for a whole subtree
    np.testing.assert_array_equal(np.asarray(t["w"]), x["w"])
    assert [s.data.shape for s in t["w"].addressable_shards] == [(2, 3)] * 4
    dev = cts.devices()[1]
    t2 = cts.device_put(x, {"w": dev, "sub": {"a": None, "b": dev}})
    assert t2["w"].devices() == {dev} and t2["sub"]["b"].devices() == {dev}
    del t, t2
    with pytest.raises(ValueError, match="tree structure mismatch"):
        cts.device_put(x, {"w": dev, "other": dev})
    with pytest.raises(TypeError, match="not a sharding or device"):
        cts.device_put(x, {"w": dev, "sub": "x"})


@pytest.mark.parametrize("make", [
    lambda: cnp.asarray(2 ** 40), lambda: cnp.array([2 ** 40, 3]), lambda: cnp.asarray((1, 2 ** 35)),
    lambda: cts.device_put(2 ** 32 + 7), lambda: cnp.asarray(-2 ** 31 - 1), lambda: cnp.asarray(2 ** 31)])
def test_python_ints_beyond_int32_raise_as_in_jax(make):
    """jax (without x64) raises OverflowError for a Python int that int32 cannot hold; they
    used to wrap silently (2**40 -> 0)."""
    with pytest.raises(OverflowError, match="too large to convert to int32"):
        make()


def test_int32_limits_and_numpy_int64_data_convert_as_in_jax():
    assert int(cnp.asarray(2 ** 31 - 1)) == 2 ** 31 - 1
    assert int(cnp.asarray(-2 ** 31)) == -2 ** 31
    assert np.asarray(cnp.asarray([[1, 2], [3, -2 ** 31]])).tolist() == [[1, 2], [3, -2 ** 31]]
    # numpy int64 data is narrowed (jax truncates it too, it does not raise)
    assert int(cnp.asarray(np.int64(2 ** 40 + 5))) == 5
    assert np.asarray(cnp.asarray(np.array([2 ** 33 + 1]))).tolist() == [1]
    assert int(cnp.asarray(2 ** 32 - 1, np.uint32)) == 2 ** 32 - 1
    assert float(cnp.asarray(2 ** 40, dtype=np.float32)) == 2.0 ** 40


def test_device_put_takes_foreign_arrays_and_refuses_strings(jax_ref):
    """A jax array (the params of a ported Flax/HF checkpoint), a buffer or anything with
    __array__ is copied from the host; device_put recursed forever on them. A str is a clear
    TypeError."""
    import array as pyarray
    got = cts.device_put({"m": memoryview(np.arange(3, dtype=np.float32)),
                          "a": pyarray.array("f", [1.0, 2.0])})
    assert np.asarray(got["m"]).tolist() == [0.0, 1.0, 2.0]
    assert np.asarray(got["a"]).tolist() == [1.0, 2.0] and got["a"].dtype == np.float32
    with pytest.raises(TypeError, match="cannot place a str"):
        cts.device_put("abc")
    if not jax_ref.live:   # jax arrays themselves: in the live twin only (nothing to record)
        return
    jnp = jax_ref.jax.numpy
    import ml_dtypes
    from ctrainstate.train_state import TrainState
    import ctrainstate.optim as optim
    a = cts.device_put(jnp.arange(4, dtype=jnp.bfloat16))
    assert a.dtype == ml_dtypes.bfloat16 and np.asarray(a, np.float32).tolist() == [0, 1, 2, 3]
    s = TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=optim.sgd(0.5))
    s = s.apply_gradients(grads={"w": jnp.ones(3)})
    np.testing.assert_array_equal(np.asarray(s.params["w"]), 0.5)


def test_array_methods_jax_users_call():
    x = np.arange(24.0, dtype=np.float32).reshape(2, 3, 4)
    a = cts.device_put(x)
    assert a.transpose().shape == (4, 3, 2) and a.transpose(1, 0, 2).shape == (3, 2, 4)
    np.testing.assert_array_equal(np.asarray(a.transpose((2, 0, 1))), x.transpose(2, 0, 1))
    np.testing.assert_array_equal(np.asarray(a.mT), np.swapaxes(x, -1, -2))
    assert cnp.zeros((1, 3, 1)).squeeze().shape == (3,)
    assert cnp.zeros((1, 3, 1)).squeeze(0).shape == (3, 1)
    np.testing.assert_array_equal(np.asarray(a.flatten()), x.ravel())
    np.testing.assert_array_equal(np.asarray(a.clip(2, 5)), np.clip(x, 2, 5))
    assert (+a) is a
    assert [10, 20, 30][cts.device_put(np.int32(2))] == 30
    with pytest.raises(TypeError, match="only integer scalar arrays"):
        [1, 2][cts.device_put(np.float32(1.0))]


def test_bool_scalar_arrays_are_masks_not_indices():
    """__index__ is for integer scalars only: numpy takes a bool scalar as a mask (and jax
    refuses bool in __index__)."""
    x = np.arange(6).reshape(2, 3)
    assert x[cnp.asarray(True)].shape == (1, 2, 3) and x[cnp.asarray(False)].shape == (0, 2, 3)
    with pytest.raises(TypeError):
        [10, 20, 30][cnp.asarray(True)]


def test_python_ints_beyond_int64_raise_overflow_error():
    for make in (lambda: cnp.asarray(2 ** 70), lambda: cnp.asarray([1, 2 ** 70]),
                 lambda: cts.device_put(-2 ** 64)):
        with pytest.raises(OverflowError, match="too large to convert to int32"):
            make()


def test_numpy_ufuncs_on_arrays_return_numpy_as_jax():
    # jax 0.10: np.sqrt(jax_array) is an ndarray (via __array__), while numpy's operators
    # and methods-backed functions defer to the Array (ndarray + Array, np.mean(Array))
    x = cts.device_put(np.float32([1, 4, np.inf]))
    for f, want in [(np.sqrt, [1, 2, np.inf]), (np.abs, [1, 4, np.inf]),
                    (np.isfinite, [True, True, False])]:
        r = f(x)
        assert type(r) is np.ndarray and r.tolist() == want
    assert np.sqrt(x).dtype == np.float32 and np.isfinite(x).dtype == np.bool_
    assert type(np.add(np.ones(3, np.float32), x)) is np.ndarray
    for r in (np.ones(3, np.float32) + x, np.float32(2) * x, np.ones((3, 3), np.float32) @ x,
              np.ones(3) > x):
        assert isinstance(r, cts.Array)
    h = np.ones(3, np.float32)
    h += x          # as with jax: ndarray's in-place operator defers too
    assert isinstance(h, cts.Array) and np.asarray(h).tolist() == [2, 5, np.inf]


def test_deepcopy_of_array_keeps_sharding_and_is_independent():
    import copy
    m = mesh_of((2, 4))
    h = np.arange(32, dtype=np.float32).reshape(4, 8)
    a = cts.device_put(h, NamedSharding(m, P("data", "model")))
    for b in (copy.deepcopy(a), copy.copy(a), copy.deepcopy({"w": [a]})["w"][0]):
        assert b is not a and b.sharding == a.sharding
        np.testing.assert_array_equal(np.asarray(b), h)
    b = copy.deepcopy(a)
    a.delete()
    np.testing.assert_array_equal(np.asarray(b), h)   # its own buffers
    with pytest.raises(cts.DonatedBufferError):
        copy.deepcopy(a)


def test_pickle_of_array_keeps_sharding_in_process():
    import pickle
    m = mesh_of((2, 4))
    h = np.arange(32, dtype=np.float32).reshape(4, 8)
    for dt in (np.float32, np.int32, np.bool_):
        for s in (NamedSharding(m, P("data", "model")), NamedSharding(m, P(None, "data")),
                  cts.SingleDeviceSharding(cts.devices()[3])):
            a = cts.device_put(h.astype(dt), s)
            b = pickle.loads(pickle.dumps(a))
            assert b.sharding == a.sharding and b.dtype == a.dtype
            np.testing.assert_array_equal(np.asarray(b), h.astype(dt))


def test_unpickle_of_array_in_process_with_fewer_devices_falls_back_to_one_device(tmp_path):
    import pickle
    import textwrap
    from conftest import run_python
    m = mesh_of((2, 4))
    h = np.arange(32, dtype=np.float32).reshape(4, 8)
    path = tmp_path / "a.pkl"
    path.write_bytes(pickle.dumps(cts.device_put(h, NamedSharding(m, P("data", "model")))))
    code = textwrap.dedent(f"""
        import pickle, warnings
        import numpy as np, ctrainstate as cts
        with open({str(path)!r}, "rb") as f:
            data = f.read()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            a = pickle.loads(data)
        print(len(a.devices()), a.sharding, np.asarray(a).sum())
        print([str(x.message) for x in w])
    """)
    r = run_python(code)   # one device
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    assert first == "1 SingleDeviceSharding(device=CpuDevice(id=0)) 496.0"
    assert "no device 1" in second and "placed on CpuDevice(id=0)" in second
    r = run_python(code, {"CTRAINSTATE_NUM_CPU_DEVICES": "8"})   # the devices exist
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "8 NamedSharding(mesh=Mesh('data': 2, 'model': 4), spec=PartitionSpec('data', "
        "'model')) 496.0", "[]"]


def test_array_conj_real_imag_for_real_dtypes():
    m = mesh_of((2, 4))
    h = np.float32([[1, -2, 3, 4, 5, 6, 7, 8]] * 2)
    x = cts.device_put(h, NamedSharding(m, P(None, "model")))
    for y in (x.conj(), x.conjugate(), x.real):
        np.testing.assert_array_equal(np.asarray(y), h)
        assert y.sharding == x.sharding
    assert x.imag.sharding == x.sharding and x.imag.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(x.imag), np.zeros_like(h))
    i = cts.device_put(np.int32([3]))
    assert i.imag.dtype == np.int32 and i.real.tolist() == [3]


# --- the narrow integer dtypes ----------------------------------------------------------------

def _ref_convert(x, dt):
    """jax's convert_element_type (x64 off, CPU, measured with jax 0.10) written with numpy:
    floats -> ints truncate toward zero and saturate at the type's range, NaN -> 0; ints ->
    ints wrap; ints -> floats round to nearest even; anything -> bool is x != 0."""
    dt = np.dtype(dt)
    if dt == np.bool_:
        return x != 0
    if dt.kind in "iu":
        if x.dtype.kind in "iub":
            return x.astype(np.int64).astype(dt)
        v = x.astype(np.float64)
        info = np.iinfo(dt)
        return np.clip(np.trunc(np.nan_to_num(v, nan=0.0, posinf=info.max, neginf=info.min)),
                       info.min, info.max).astype(dt)
    return x.astype(dt)


def _convert_source(dt):
    dt = np.dtype(dt)
    if dt == np.bool_:
        return np.array([True, False, True, True, False, False, True, False])
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return np.array([0, 1, info.max, info.min, info.max - 1, 127, 200, 3]).astype(np.int64).astype(dt)
    v = np.array([np.nan, np.inf, -np.inf, -1.7, -0.5, 0.9, 127.9, 128.0, 255.5, 256.0, 300.0,
                  -129.0, -128.5, 32767.5, 32768.0, 65535.0, 65536.0, -32769.0, 1e10, -1e10],
                 np.float32)
    with np.errstate(over="ignore"):       # (inf from float32 -> float16, on purpose)
        return v.astype(dt)


_ALL = [np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.uint32, np.bool_] + NARROW_INTS


@pytest.mark.parametrize("narrow", NARROW_INTS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("other", _ALL, ids=lambda d: np.dtype(d).name)
def test_astype_to_and_from_narrow_ints(narrow, other):
    """Conversions in both directions on a sharded Array: the reference above, bit for bit."""
    s = NamedSharding(mesh_of((2, 4)), P(None))
    for src, dst in ((other, narrow), (narrow, other)):
        x = _convert_source(src)
        with np.errstate(invalid="ignore", over="ignore"):
            want = _ref_convert(x, dst)
        got = cts.device_put(x, s).astype(dst)
        assert got.dtype == np.dtype(dst) and got.sharding == s
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8),
                                      err_msg=f"{np.dtype(src)} -> {np.dtype(dst)}: {x}")


def test_astype_narrow_ints_match_jax(jax_ref):
    for narrow in NARROW_INTS:
        for other in _ALL:
            for src, dst in ((other, narrow), (narrow, other)):
                x = _convert_source(src)
                want = jax_ref(f"{np.dtype(src).name}->{np.dtype(dst).name}",
                               lambda jnp: jnp.asarray(x).astype(dst))
                got = np.asarray(cts.device_put(x).astype(dst))
                assert got.dtype == want.dtype
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8),
                                              err_msg=f"{np.dtype(src)} -> {np.dtype(dst)}")


@pytest.mark.parametrize("dt", NARROW_INTS, ids=lambda d: np.dtype(d).name)
def test_narrow_int_creation_and_layout_ops(dt):
    """Constructors with dtype=, and the ops that move bytes (reshape, transpose, slicing,
    indexing, concatenate, stack, .at[]) keep the narrow dtype and its bits, sharded."""
    info = np.iinfo(dt)
    m = mesh_of((2, 4))
    h = np.random.default_rng(5).integers(info.min, info.max, (8, 12), endpoint=True).astype(dt)
    x = cts.device_put(h, NamedSharding(m, P("data", "model")))
    assert x.dtype == dt and [sh.data.dtype for sh in x.addressable_shards] == [np.dtype(dt)] * 8
    for sh in x.addressable_shards:
        np.testing.assert_array_equal(sh.data, h[sh.index])
    made = {"zeros": (cnp.zeros((3, 4), dt), np.zeros((3, 4), dt)),
            "ones": (cnp.ones((3, 4), dtype=dt), np.ones((3, 4), dt)),
            "full": (cnp.full((2, 2), 7, dt), np.full((2, 2), 7, dt)),
            "arange": (cnp.arange(10, dtype=dt), np.arange(10, dtype=dt)),
            "asarray": (cnp.asarray(h, dtype=dt), h),
            "asarray wide": (cnp.asarray(np.array([1, 300, -1]), dtype=dt),
                             np.array([1, 300, -1]).astype(dt)),       # int64 data wraps
            "zeros_like": (cnp.zeros_like(x), np.zeros_like(h)),
            "reshape.T": (cnp.reshape(x, (12, 8)).T, h.reshape(12, 8).T),
            "transpose": (cnp.transpose(x), h.T),
            "slice": (x[1:7:2, ::-3], h[1:7:2, ::-3]),
            "int index": (x[3], h[3]),
            "fancy": (x[np.array([5, 0, 5])], h[np.array([5, 0, 5])]),
            "mask": (x[h > h.mean()], h[h > h.mean()]),
            "concat": (cnp.concatenate([x, x[:2]], axis=0), np.concatenate([h, h[:2]], axis=0)),
            "stack": (cnp.stack([x, x], axis=1), np.stack([h, h], axis=1)),
            "at.set": (x.at[1, 2].set(5), _at_set(h, (1, 2), 5)),
            "expand_dims": (cnp.expand_dims(x, 0), h[None]),
            "flip": (cnp.flip(x, 1), h[:, ::-1])}
    for name, (got, want) in made.items():
        assert got.dtype == np.dtype(dt), name
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
    # concatenating with another dtype promotes as jax (uint8 with int8: int16)
    other = np.int8 if dt == np.uint8 else np.uint8
    both = cnp.concatenate([x[:, :2], cts.device_put(np.ones((8, 2), other))], axis=1)
    assert both.dtype == {np.uint8: np.int16, np.int8: np.int16, np.int16: np.int16,
                          np.uint16: np.uint16}[dt]


def _at_set(h, idx, v):
    h = h.copy()
    h[idx] = v
    return h


def test_delete_is_all_or_nothing_when_one_shard_has_a_view():
    m = mesh_of((8,))
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    a = cts.device_put(x, NamedSharding(m, P("x")))
    view = a.addressable_shards[5].data   # a numpy view of one shard only
    with pytest.raises(RuntimeError, match="live view"):
        a.delete()
    # nothing was freed: every shard still holds its values
    assert not a.is_deleted()
    np.testing.assert_array_equal(np.asarray(a), x)
    del view
    gc.collect()
    a.delete()
    assert a.is_deleted()
    with pytest.raises(cts.DonatedBufferError):
        np.asarray(a)


# The main thread runs one long matmul on an Array's buffers (the GIL released); another
# thread deletes that Array meanwhile, then interrupts the main thread to end the product.
# In a fresh interpreter: a delete that freed the memory under the kernel could crash it.
_DELETE_WHILE_COMPUTING = """
import os, signal, threading, time
import numpy as np
import ctrainstate as cts
C = cts._C
K = 1 << 20
a = cts.device_put(np.ones((8, K), np.float32))
b = cts.device_put(np.ones((K, 8), np.float32))
buf_a, buf_b = a._blocks[0][1], b._blocks[0][1]
batch = 1 << 14
c = C.Buffer(buf_a.device_id, (batch * 64,), 0)
result = []
def deleter():
    time.sleep(0.5)
    try:
        a.delete()
        result.append("deleted")
    except RuntimeError as e:
        result.append("refused: " + str(e))
    os.kill(os.getpid(), signal.SIGINT)
t = threading.Thread(target=deleter)
t0 = time.monotonic()
t.start()
try:
    C.op_matmul([buf_a], [buf_b], [c], batch, 8, 8, K, 0, 0, 0, 0, 1.0, 0.0)
    print("finished")
except KeyboardInterrupt:
    print("interrupted after %.1f s" % (time.monotonic() - t0))
t.join()
print(result[0])
print("deleted now:", a.is_deleted())
a.delete()
print("deleted after:", a.is_deleted())
"""


def test_delete_refused_while_another_thread_computes_on_the_array():
    from conftest import run_python
    r = run_python(_DELETE_WHILE_COMPUTING, {"CTRAINSTATE_NUM_CPU_DEVICES": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("interrupted after"), r.stdout
    assert lines[1].startswith("refused: ") and "in another thread" in lines[1], r.stdout
    assert lines[2:] == ["deleted now: False", "deleted after: True"], r.stdout


# --- asarray of a list of Arrays (found probing ctrainstate.numpy against jax)

def test_asarray_list_of_arrays_to_bfloat16():
    vals = [cts.device_put(np.float32(1.1)), cts.device_put(np.float32(2.5))]
    for dt in (cnp.bfloat16, np.float16):
        for f in (cnp.asarray, cnp.array):
            got = f(vals, dtype=dt)
            assert got.dtype == dt
            # numpy: the float32 values rounded once to dt
            np.testing.assert_array_equal(np.asarray(got),
                                          np.array([1.1, 2.5], np.float32).astype(dt))


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define, live when installed (those parts skip cleanly otherwise) and derived
# by hand

def _loss_array(value=1.8136346):
    return cts.device_put(np.float32(value))


def test_scalar_array_prints_and_formats_like_its_value():
    loss = _loss_array(2.5)
    # jax: f"{loss:.4f}" -> '2.5000', str(loss) -> '2.5'
    assert f"{loss:.4f}" == "2.5000"
    assert f"{loss}" == "2.5" and str(loss) == "2.5"
    assert repr(loss).startswith("Array(2.5, dtype=float32")
    step = cts.device_put(np.int32(7))
    assert f"{step:03d}" == "007" and str(step) == "7"
    from ctrainstate.hf.cast import cast
    assert f"{cast(loss, 'bfloat16'):.1f}" == "2.5"          # 0-d bfloat16 casts and formats
    lr = cts.device_put(np.float32(0.9))                     # numpy's shortest digits, as jax
    assert str(lr) == f"{lr}" == "0.9" and repr(lr).startswith("Array(0.9, dtype=float32")
    x = cts.device_put(np.ones((2, 3), np.float32))
    assert f"{x}" == str(x) == "[[1. 1. 1.]\n [1. 1. 1.]]"   # jax: format(ndarray, "")
    with pytest.raises(TypeError, match="np.asarray"):
        f"{x:.2f}"


_BF16_VALUES = (0.1, 1.0, 12345.0, 1e10, 2.5e-8, -0.0, 1 / 3)


def test_scalar_bfloat16_prints_like_jax():
    from ctrainstate.hf.cast import cast
    # derived: jax prints a bfloat16 scalar as ml_dtypes does, with 6 significant digits
    # (%g): bfloat16(0.1) = 0.10009765625 -> 0.100098; 12345 rounds to 12352
    want = ["0.100098", "1", "12352", "9.99922e+09", "2.50293e-08", "-0", "0.333984"]
    got = [str(cast(cts.device_put(np.float32(v)), "bfloat16")) for v in _BF16_VALUES]
    assert got == want
    b = cast(cts.device_put(np.float32(0.1)), "bfloat16")
    assert repr(b) == "Array(0.100098, dtype=bfloat16)"
    assert f"{b}" == "0.100098" and f"{b:.3f}" == "0.100"
    assert str(cast(cts.device_put(np.float32(0.1)), "float16")) == "0.1"


def test_scalar_bfloat16_prints_match_jax(jax_ref):
    from ctrainstate.hf.cast import cast
    for v in _BF16_VALUES:
        ours = cast(cts.device_put(np.float32(v)), "bfloat16")

        def theirs(jnp):
            t = jnp.asarray(v, jnp.bfloat16)
            return [str(t), repr(t), f"{t:.4g}"]
        s, r, g = jax_ref(repr(v), theirs)
        assert str(ours) == s
        assert repr(ours) == r
        assert f"{ours:.4g}" == g


def test_scalar_array_comparisons():
    loss, best = _loss_array(0.5), _loss_array(0.75)
    assert loss < best and best > loss and loss <= 0.5 and loss >= 0.5
    assert loss == 0.5 and loss != 0.25 and 1.0 > loss
    assert (loss == _loss_array(0.5)) and not (loss == best)
    assert (loss == "0.5") is False                  # not a number: identity, like Python
    x = cts.device_put(np.arange(4, dtype=np.float32))
    # elementwise comparisons give bool Arrays (jax); their truth value is ambiguous
    assert np.asarray(x == 3).tolist() == [False, False, False, True]
    assert np.asarray(loss < x).tolist() == [False, True, True, True]
    with pytest.raises(ValueError, match="ambiguous"):
        bool(x > 3)


def test_scalar_array_comparisons_match_jax(jax_ref):
    import operator
    for op in (operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne):
        for a, b in ((0.5, 0.75), (0.75, 0.5), (0.5, 0.5)):
            want = jax_ref(f"{op.__name__}/{a}/{b}",
                           lambda jnp: bool(op(jnp.float32(a), jnp.float32(b))))
            assert bool(op(_loss_array(a), _loss_array(b))) == want
            assert bool(op(_loss_array(a), b)) == want
    assert jax_ref("format", lambda jnp: f"{jnp.float32(2.5):.3f}") == f"{_loss_array(2.5):.3f}"


def test_array_host_conversions():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = cts.device_put(a, cts.NamedSharding(cts.make_mesh((2,), ("d",)), cts.P("d")))
    assert x.tolist() == a.tolist()
    assert float(np.mean(x)) == 2.5 and float(np.sum(x)) == 15.0   # numpy calls x.mean(dtype=, out=)
    h = x.astype(np.float16)
    assert h.dtype == np.float16 and h.sharding == x.sharding
    np.testing.assert_array_equal(np.asarray(h), a.astype(np.float16))
    assert x.astype(np.float32) is x
    c = x.copy()
    assert c is not x and c.sharding == x.sharding
    np.testing.assert_array_equal(np.asarray(c), a)
    np.testing.assert_array_equal(np.asarray(x[0]), a[0])  # basic indexing: tests/array/test_slicing.py
    rows = list(x)   # as jax.Array: x[0], x[1], ... (`k1, k2 = random.split(key)` under jit)
    assert len(rows) == len(a) and all(np.array_equal(np.asarray(r), a[i]) for i, r in enumerate(rows))
    with pytest.raises(TypeError, match="out="):
        np.sum(x, out=np.zeros(()))


def test_device_get():
    x = cts.device_put(np.arange(3, dtype=np.float32))
    out = cts.device_get({"x": x, "n": 3, "h": np.ones(2)})
    assert isinstance(out["x"], np.ndarray) and out["x"].tolist() == [0.0, 1.0, 2.0]
    assert out["n"] == 3 and out["h"].tolist() == [1.0, 1.0]
