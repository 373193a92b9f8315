"""Global devices and Arrays without MPI: the jax placement functions
(make_array_from_callback / _single_device_arrays / _process_local_data), addressable_data,
global_shards and multihost_utils' host-local <-> global conversions in a job of one process;
and, in a child process, the view of process 1 of a job of two (the device layout that
ctrainstate.distributed.initialize sets, set directly): global ids, Arrays that hold only
this process's shards, operations that need no other process, and the errors for what
needs it (without MPI). The same under
mpirun is tests/mpi/global_arrays.py (test_distributed_mpi.py)."""
import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import NamedSharding, P
from ctrainstate.experimental import multihost_utils as mhu
from conftest import run_python


@pytest.fixture
def mesh():
    return cts.make_mesh((2, 4), ("data", "model"))


G = np.arange(64, dtype=np.float32).reshape(8, 8)


def test_one_process_is_fully_addressable(mesh):
    s = NamedSharding(mesh, P("data", "model"))
    x = cts.device_put(G, s)
    assert x.is_fully_addressable and s.is_fully_addressable
    assert s.addressable_devices == s.device_set
    assert s.addressable_devices_indices_map(G.shape) == s.devices_indices_map(G.shape)
    assert [(g.device, g.index) for g in x.global_shards] == [
        (a.device, a.index) for a in x.addressable_shards]
    assert mesh.local_mesh is mesh and mesh.local_devices == list(mesh.devices.flat)
    assert not mesh.is_multi_process
    assert cts.process_count() == 1 and cts.process_index() == 0
    assert cts.local_devices() == cts.devices() == cts.local_devices(process_index=0)
    assert cts.local_device_count() == cts.device_count() == 8
    assert all(d.process_index == 0 for d in cts.devices())
    with pytest.raises(ValueError, match="process_index 1 does not exist; there is one"):
        cts.local_devices(process_index=1)
    with pytest.raises(TypeError, match="process_index must be an int"):
        cts.local_devices(process_index="0")


def test_addressable_data(mesh):
    x = cts.device_put(G, NamedSharding(mesh, P("data", "model")))
    for i, sh in enumerate(x.addressable_shards):
        d = x.addressable_data(i)
        assert d.devices() == {sh.device} and np.array_equal(np.asarray(d), G[sh.index])
    assert np.array_equal(np.asarray(x.addressable_data(-1)), G[x.addressable_shards[-1].index])
    with pytest.raises(IndexError, match="out of range for 8"):
        x.addressable_data(8)
    with pytest.raises(TypeError, match="index must be an int"):
        x.addressable_data(0.0)
    with pytest.raises(ValueError, match="view"):   # a view cannot be donated
        x.addressable_data(0)._donate()


@pytest.mark.parametrize("spec", [P("data", "model"), P("model"), P(None, ("data", "model")),
                                  P()])
def test_make_array_from_callback(mesh, spec):
    s = NamedSharding(mesh, spec)
    seen = []
    x = cts.make_array_from_callback(G.shape, s, lambda i: seen.append(i) or G[i])
    assert x.sharding == s and x.dtype == np.float32
    assert np.array_equal(np.asarray(x), G)
    # once per distinct index: replicas share the result
    assert len(seen) == len(set(map(str, s.devices_indices_map(G.shape).values())))
    for sh in x.addressable_shards:
        assert np.array_equal(sh.data, G[sh.index])


def test_make_array_from_callback_dtypes_and_errors(mesh):
    s = NamedSharding(mesh, P("data"))
    x = cts.make_array_from_callback(G.shape, s, lambda i: G[i].astype(np.float64))
    assert x.dtype == np.float32       # canonicalized as device_put does
    b = cts.make_array_from_callback(G.shape, s, lambda i: G[i] > 10, dtype=bool)
    assert b.dtype == np.bool_ and np.array_equal(np.asarray(b), G > 10)
    h = cts.make_array_from_callback(G.shape, s, lambda i: G[i], dtype=np.int32)
    assert h.dtype == np.int32 and np.array_equal(np.asarray(h), G.astype(np.int32))
    x = cts.make_array_from_callback(G.shape, s, lambda i: cts.device_put(G[i]))   # Arrays
    assert np.array_equal(np.asarray(x), G)
    with pytest.raises(ValueError, match=r"returned shape \(8, 8\); the shard at that index "
                                         r"has shape \(4, 8\)"):
        cts.make_array_from_callback(G.shape, s, lambda i: G)
    with pytest.raises(TypeError, match="must be callable"):
        cts.make_array_from_callback(G.shape, s, G)
    with pytest.raises(TypeError, match="sharding must be a NamedSharding"):
        cts.make_array_from_callback(G.shape, P("data"), lambda i: G[i])
    with pytest.raises(TypeError, match="not numeric data"):
        cts.make_array_from_callback((2,), cts.SingleDeviceSharding(cts.devices()[0]),
                                     lambda i: np.array(["a", None], dtype=object))
    with pytest.raises(ValueError, match="not divisible"):
        cts.make_array_from_callback((7, 8), s, lambda i: G[i])


def test_make_array_from_single_device_arrays(mesh):
    s = NamedSharding(mesh, P("data", "model"))
    idx = s.addressable_devices_indices_map(G.shape)
    parts = [cts.device_put(G[i], d) for d, i in idx.items()]
    x = cts.make_array_from_single_device_arrays(G.shape, s, reversed(parts))   # any order
    assert x.sharding == s and np.array_equal(np.asarray(x), G)
    for p in parts:   # the new Array owns copies
        p.delete()
    assert np.array_equal(np.asarray(x), G)
    parts = [cts.device_put(G[i], d) for d, i in idx.items()]
    with pytest.raises(ValueError, match="got 7 arrays;.* has 8 devices in this process"):
        cts.make_array_from_single_device_arrays(G.shape, s, parts[:7])
    with pytest.raises(ValueError, match=r"arrays\[0\] and arrays\[1\] are both on"):
        cts.make_array_from_single_device_arrays(G.shape, s, [parts[0]] * 8)
    with pytest.raises(ValueError, match="has shape"):
        cts.make_array_from_single_device_arrays((16, 8), s, parts)
    with pytest.raises(ValueError, match="dtype int32, not float32"):
        cts.make_array_from_single_device_arrays(G.shape, s, parts[:7] + [parts[7].astype(np.int32)])
    with pytest.raises(ValueError, match="dtype float32, not int32"):
        cts.make_array_from_single_device_arrays(G.shape, s, parts, dtype=np.int32)
    with pytest.raises(TypeError, match=r"arrays\[0\] is a ndarray, not an Array"):
        cts.make_array_from_single_device_arrays(G.shape, s, [G[i] for i in idx.values()])
    with pytest.raises(ValueError, match="each must be on one"):
        cts.make_array_from_single_device_arrays(
            G.shape, s, [cts.device_put(G[:4, :2], NamedSharding(mesh, P()))] * 8)
    with pytest.raises(TypeError, match="must be a sequence"):
        cts.make_array_from_single_device_arrays(G.shape, s, 3)
    small = cts.make_mesh((2,), ("x",), devices=cts.devices()[:2])
    other = [cts.device_put(G[:4], d) for d in cts.devices()[2:4]]
    with pytest.raises(ValueError, match="no array on CpuDevice"):
        cts.make_array_from_single_device_arrays(G.shape, NamedSharding(small, P("x")), other)


def test_make_array_from_process_local_data_one_process(mesh):
    s = NamedSharding(mesh, P("data"))
    x = cts.make_array_from_process_local_data(s, G)
    assert x.sharding == s and np.array_equal(np.asarray(x), G)
    x = cts.make_array_from_process_local_data(s, G.astype(np.float64), G.shape)
    assert x.dtype == np.float32
    with pytest.raises(ValueError, match="differs from global_shape"):
        cts.make_array_from_process_local_data(s, G, (16, 8))
    with pytest.raises(ValueError, match="has 1 dimensions"):
        cts.make_array_from_process_local_data(s, G, (8,))


def test_host_local_global_round_trip_in_one_process(mesh):
    tree = {"a": G, "b": [np.ones((2, 4), np.int32)]}
    g = mhu.host_local_array_to_global_array(tree, mesh, {"a": P("data", "model"), "b": None})
    assert g["a"].sharding == NamedSharding(mesh, P("data", "model"))
    assert np.array_equal(np.asarray(g["a"]), G) and g["b"][0].dtype == np.int32
    back = mhu.global_array_to_host_local_array(g, mesh, P())
    assert back["a"] is g["a"]    # fully addressable: returned as it is, as in jax
    with pytest.raises(ValueError, match="not a prefix"):
        mhu.host_local_array_to_global_array(tree, mesh, {"a": P(), "c": P()})
    with pytest.raises(TypeError, match="global_mesh must be a Mesh"):
        mhu.host_local_array_to_global_array(tree, None, P())
    with pytest.raises(TypeError, match="not a PartitionSpec"):
        mhu.host_local_array_to_global_array(tree, mesh, {"a": "data", "b": None})
    with pytest.raises(ValueError, match=r"'z' of PartitionSpec\('z',\) is undefined"):
        mhu.host_local_array_to_global_array(G, mesh, P("z"))


# In a child process: the layout initialize() sets for process 1 of a job of two processes
# of 4 CPU devices each (ids 0-3 are process 0's, 4-7 this process's).
_PROCESS_1 = r"""
import numpy as np, ctrainstate as cts
from ctrainstate import NamedSharding, P
from ctrainstate._src.base import devices as D
from ctrainstate.experimental import multihost_utils as mhu
import ctrainstate.numpy as jnp

def raises(err, text, fn):
    try:
        fn()
    except err as e:
        assert text in str(e), (text, str(e))
        return
    raise AssertionError(f"no {err.__name__}: {text}")

D._set_processes(1, [(4, 0), (4, 0)])
devs = cts.devices()
assert [d.id for d in devs] == list(range(8)) and cts.device_count() == 8
assert [d.process_index for d in devs] == [0] * 4 + [1] * 4
assert cts.local_devices() == devs[4:] and cts.local_device_count() == 4
assert cts.local_devices(process_index=0) == devs[:4]
assert (cts.process_index(), cts.process_count()) == (1, 2)
assert repr(devs[5]) == "CpuDevice(id=5, process_index=1)"
raises(RuntimeError, "set once", lambda: D._set_processes(1, [(4, 0), (4, 0)]))
raises(ValueError, "device 2 belongs to another process (this process has devices 4..7)",
       devs[2].memory_stats)
devs[4].memory_stats()
a = cts.device_put(np.float32([1, 2]), devs[6])       # a local Array, on a global id
assert a.addressable_shards[0].data.tolist() == [1.0, 2.0] and a.is_fully_addressable
assert a._blocks[0][1].device_id == 6
assert float(jnp.sum(a * a)) == 5.0

mesh = cts.make_mesh((2, 4), ("data", "model"))
assert mesh.local_mesh.devices.tolist() == [devs[4:]]
g = np.arange(64, dtype=np.float32).reshape(8, 8)
x = cts.device_put(g, NamedSharding(mesh, P("data", "model")))
assert not x.is_fully_addressable and [s.device for s in x.addressable_shards] == devs[4:]
assert all(np.array_equal(s.data, g[s.index]) for s in x.addressable_shards)
assert {b[1].device_id for b in x._blocks} == {4, 5, 6, 7}
assert [s.data is None for s in x.global_shards] == [True] * 4 + [False] * 4
assert x.devices() == set(devs)
raises(RuntimeError, "multihost_utils.process_allgather", lambda: np.asarray(x))
raises(RuntimeError, "multihost_utils.process_allgather", lambda: str(x))
assert "is_fully_addressable=False" in repr(x)
# operations that need no other process run on this process's blocks
for got, want in ((x * 2 + 1, g * 2 + 1), (-x, -g), (x.astype(np.int32), g.astype(np.int32)),
                  (x.T, g.T), (jnp.maximum(x, 9.0), np.maximum(g, 9)), (x.reshape(8, 2, 4), g.reshape(8, 2, 4))):
    assert not got.is_fully_addressable
    assert [s.device for s in got.addressable_shards] == devs[4:]
    for s in got.addressable_shards:
        assert np.array_equal(np.asarray(s.data), want[s.index]), s.index
rows = jnp.sum(x, axis=1)                         # over 'model': within this process
assert all(np.allclose(np.asarray(s.data), g.sum(axis=1)[s.index]) for s in rows.addressable_shards)
# those that need the other process's blocks communicate: without MPI they raise
raises(RuntimeError, "not initialized", lambda: jnp.sum(x))
raises(RuntimeError, "not initialized", lambda: cts.device_put(x, NamedSharding(mesh, P("model"))))
r = cts.device_put(g, NamedSharding(mesh, P(None, "model")))   # replicated over processes
assert np.array_equal(np.asarray(r), g) and not r.is_fully_addressable
assert float(cts.device_put(np.float32(3), NamedSharding(mesh, P()))) == 3.0
y = cts.make_array_from_process_local_data(NamedSharding(mesh, P("data")), g[4:])
assert y.shape == (8, 8) and all(np.array_equal(s.data, g[s.index]) for s in y.addressable_shards)
w = cts.make_array_from_process_local_data(NamedSharding(mesh, P("data", "model")), g[4:])
assert w.shape == (8, 8) and all(np.array_equal(s.data, g[s.index]) for s in w.addressable_shards)
raises(ValueError, "must be the global size 8 or the 4 elements", lambda:
       cts.make_array_from_process_local_data(NamedSharding(mesh, P("data")), g[:3], (8, 8)))
h = mhu.host_local_array_to_global_array(g[4:], mesh, P("data"))
assert h.shape == (8, 8) and all(np.array_equal(s.data, g[s.index]) for s in h.addressable_shards)
back = mhu.global_array_to_host_local_array(h, mesh, P("data"))
assert back.shape == (4, 8) and np.array_equal(np.asarray(back), g[4:])
# born sharded: only this process's shards are made, with the values of the whole array
from ctrainstate import random
k = random.normal(random.PRNGKey(3), (8, 8), out_sharding=NamedSharding(mesh, P("data", "model")))
print("SHARDS", [(s.index[0].start, s.index[1].start, np.asarray(s.data).tobytes().hex())
                 for s in k.addressable_shards])
print("DONE")
"""


def test_process_1_of_2_without_mpi():
    r = run_python(_PROCESS_1, {"CTRAINSTATE_NUM_CPU_DEVICES": "4"})
    assert r.returncode == 0 and "DONE" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    k = cts.random.normal(cts.random.PRNGKey(3), (8, 8),
                          out_sharding=NamedSharding(mesh, P("data", "model")))
    want = np.asarray(k)
    line = next(l for l in r.stdout.splitlines() if l.startswith("SHARDS"))
    got = eval(line[len("SHARDS "):])   # noqa: S307 - our own printout
    assert len(got) == 4
    for r0, c0, hexbytes in got:   # bit for bit the 8-device single-process values
        block = np.frombuffer(bytes.fromhex(hexbytes), np.float32).reshape(4, 2)
        assert np.array_equal(block.view(np.uint32), want[r0:r0 + 4, c0:c0 + 2].view(np.uint32))


def test_initialize_after_devices_were_used_raises_before_mpi():
    r = run_python("import ctrainstate as cts, ctrainstate.distributed as d\n"
                   "cts.devices()\n"
                   "try:\n"
                   "    d.initialize(num_processes=2, process_id=1)\n"
                   "except RuntimeError as e:\n"
                   "    print(e)\n"
                   "print(d.is_initialized(), cts._C.dist_info()['initialized'])",
                   {"CTRAINSTATE_MPI_LIBRARY": "/nonexistent/libmpi.so.40"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "must be called before ctrainstate uses devices" in r.stdout
    assert r.stdout.strip().endswith("False False")


def test_devices_set_id_offset_checks_its_arguments():
    r = run_python("from ctrainstate import _C\n"
                   "def err(*a):\n"
                   "    try:\n"
                   "        _C.devices_set_id_offset(*a)\n"
                   "    except (ValueError, TypeError, OverflowError) as e:\n"
                   "        return f'{type(e).__name__}: {e}'\n"
                   "print(err(-1, 8))\n"
                   "print(err(4, 7))\n"
                   "print(err('4', 8))\n"
                   "print(err(2 ** 40, 8))\n"
                   "_C.devices_set_id_offset(4, 8)\n"
                   "_C.devices_set_id_offset(4, 8)\n"   # the same again: accepted
                   "print(err(0, 8))\n"
                   "print(_C.device_ids('cpu'), _C.Buffer(5, (2,), 0).device_id)\n"
                   "print(err(1, 0) is None)\n",
                   {"CTRAINSTATE_NUM_CPU_DEVICES": "4"})
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "ValueError: device id offset -1 and total 8 do not fit this process's 4 devices"
    assert lines[1] == "ValueError: device id offset 4 and total 7 do not fit this process's 4 devices"
    assert lines[2].startswith("TypeError")
    assert lines[3].startswith("OverflowError")
    assert lines[4] == "ValueError: the global device ids were already set (offset 4 of 8 devices)"
    assert lines[5] == "[4, 5, 6, 7] 5"
    assert lines[6] == "False"
