"""Run under mpirun (tests/distributed/test_distributed_mpi.py), each process with 2 CPU
devices: global devices, meshes and Arrays spanning processes, input placement
(make_array_from_*), multihost_utils on such Arrays, and born-sharded init compared bit for
bit with a run of one process that has as many devices as the whole job.

    python tests/mpi/global_arrays.py --reference ref.npz   # one process, 2 * N devices
    mpirun -n N python tests/mpi/global_arrays.py ref.npz   # N processes, 2 devices each

Each process prints "OK <process> <count> <checks>" at the end (and writes it to a file
in CT_TEST_OUT); any failure raises (non-zero exit).
"""
import os

import numpy as np

from report import finish, report, run, start

import ctrainstate as cts
from ctrainstate import NamedSharding, P
from ctrainstate import nn, random, partitioning as nn_partitioning
import ctrainstate.numpy as jnp


class MLPParams(nn.Module):
    """An MLP's parameters, declared with logical axes (``__call__`` computes nothing with
    them: init alone; tests/mpi/global_ops.py runs a forward pass)."""

    @nn.compact
    def __call__(self, x):
        nn_partitioning.param_with_axes("w1", nn.initializers.lecun_normal(), (16, 64),
                                        axes=("embed", "mlp"))
        nn_partitioning.param_with_axes("w2", nn.initializers.xavier_uniform(), (64, 16),
                                        axes=("mlp", "embed"))
        nn_partitioning.param_with_axes("b", nn.initializers.normal(0.5), (64,),
                                        axes=("mlp",))
        nn_partitioning.param_with_axes("scale", nn.initializers.ones, (16,), axes=("embed",))
        return x


RULES = (("batch", "data"), ("embed", "data"), ("mlp", "model"))


def born_sharded(mesh):
    """The values each run compares: a model's params, born sharded over ``mesh``, and
    random Arrays made directly with an out_sharding (every dtype path of the sampler
    that init uses)."""
    with mesh, nn_partitioning.axis_rules(RULES):
        params = nn.unbox(MLPParams().init(random.PRNGKey(0), np.ones((8, 16), np.float32)))
    params = dict(params["params"])
    key = random.PRNGKey(7)
    s = NamedSharding(mesh, P("data", "model"))
    params["normal"] = random.normal(key, (4 * mesh.shape["data"], 6), out_sharding=s)
    params["uniform"] = random.uniform(key, (4 * mesh.shape["data"], 6), out_sharding=s)
    params["bits"] = random.bits(key, (2 * mesh.shape["data"], 6), out_sharding=s)
    return params


def reference(path):
    """One process with every device: the values to compare with."""
    n = cts.device_count() // 2
    mesh = cts.make_mesh((n, 2), ("data", "model"))
    params = born_sharded(mesh)
    np.savez(path, **{k: np.asarray(v) for k, v in params.items()})
    specs = {k: tuple(v.sharding.spec) for k, v in params.items()}
    print("REFERENCE", n, sorted(specs.items()))


def main(ref_path):
    from ctrainstate import distributed as dist
    from ctrainstate.experimental import multihost_utils as mhu

    checks = 0

    def raises(err, text, fn):
        nonlocal checks
        try:
            fn()
        except err as e:
            assert text in str(e), (text, str(e))
            checks += 1
            return
        raise AssertionError(f"no {err.__name__} ({text})")

    start(dist)
    me, n = cts.process_index(), cts.process_count()
    assert (me, n) == (int(os.environ["OMPI_COMM_WORLD_RANK"]),
                       int(os.environ["OMPI_COMM_WORLD_SIZE"])), (me, n)
    assert (me, n) == (dist.process_index(), dist.process_count())

    # --- 0. a value made without a sharding outside a mesh: on this process's first device
    one = cts.numpy.ones(3) + 1.0
    assert one.sharding.device == cts.local_devices()[0], one.sharding
    assert one.sharding.device.process_index == me and one.is_fully_addressable
    assert np.asarray(one).tolist() == [2.0, 2.0, 2.0]
    checks += 1

    # --- 1. global devices -----------------------------------------------------------
    devs = cts.devices()
    assert [d.id for d in devs] == list(range(2 * n)), devs
    assert [d.process_index for d in devs] == [i // 2 for i in range(2 * n)], devs
    assert cts.device_count() == 2 * n and cts.local_device_count() == 2
    local = cts.local_devices()
    assert local == devs[2 * me:2 * me + 2], (local, devs)
    for p in range(n):
        assert cts.local_devices(process_index=p) == devs[2 * p:2 * p + 2]
    assert repr(local[0]) == f"CpuDevice(id={2 * me}, process_index={me})", repr(local[0])
    assert all(d.host_id == d.process_index for d in devs)
    checks += 8
    raises(ValueError, f"process_index {n} does not exist", lambda: cts.local_devices(n))
    other = devs[2 * ((me + 1) % n)]
    raises(ValueError, "belongs to another process", other.memory_stats)
    elsewhere = cts.device_put(np.ones(2, np.float32), other)   # as jax: no shard here
    assert elsewhere.addressable_shards == [] and not elsewhere.is_fully_addressable
    raises(RuntimeError, "process_allgather", lambda: np.asarray(elsewhere))
    # a leaf that spans processes on some and is local on others: mismatched, on every one
    last = cts.device_put(np.ones(2, np.float32), devs[-1])
    raises(AssertionError, "differ", lambda: mhu.process_allgather(last))
    local[0].memory_stats()
    # a local Array lives on this process's devices, with global ids
    a = cts.device_put(np.float32([1, 2]), local[1])
    assert a.devices() == {local[1]} and a.is_fully_addressable
    assert a.addressable_shards[0].data.tolist() == [1.0, 2.0]
    assert (a * 2 + 1).tolist() == [3.0, 5.0]    # ops on this process's devices
    lm = cts.Mesh(np.array(local), ("x",))
    b = cts.device_put(np.arange(4, dtype=np.float32), NamedSharding(lm, P("x")))
    assert float(jnp.sum(b * b)) == 14.0 and b.is_fully_addressable
    checks += 4

    # --- 2. meshes and Arrays spanning processes ----------------------------------------
    mesh = cts.make_mesh((n, 2), ("data", "model"))
    assert mesh.is_multi_process and mesh.devices.shape == (n, 2)
    assert mesh.local_devices == local
    lmesh = mesh.local_mesh
    assert lmesh.devices.shape == (1, 2) and list(lmesh.devices.flat) == local
    assert lmesh.axis_names == ("data", "model")
    if n > 1:
        # processes along 'model' on a transposed mesh: each holds a column, a block too
        tmesh = cts.Mesh(mesh.devices.T.copy(), ("model", "data"))
        assert tmesh.local_mesh.devices.shape == (2, 1)
        # a mesh where the devices of processes 0 and 1 are not blocks:
        # [[0, 2], [3, 1], ...]
        zig = cts.Mesh(np.array([devs[0], devs[2], devs[3], devs[1]] + devs[4:]).reshape(-1, 2),
                       ("a", "b"))
        if me in (0, 1):
            raises(ValueError, "do not form a block", lambda: zig.local_mesh)
        else:
            assert zig.local_mesh.devices.shape == (1, 2)
    checks += 4

    g = np.arange(8 * n * n, dtype=np.float32).reshape(4 * n, 2 * n)
    s = NamedSharding(mesh, P("data", "model"))
    assert not s.is_fully_addressable and s.addressable_devices == set(local)
    x = cts.device_put(g, s)      # every process passes the same global value
    assert not x.is_fully_addressable and x.shape == g.shape
    assert x.devices() == set(devs)
    shards = x.addressable_shards
    assert [sh.device for sh in shards] == local
    for sh in shards:
        assert np.array_equal(sh.data, g[sh.index]), sh.index
    assert np.array_equal(np.asarray(x.addressable_data(1)), g[shards[1].index])
    gs = x.global_shards
    assert [sh.device for sh in gs] == devs
    assert [sh.data is None for sh in gs] == [d.process_index != me for d in devs]
    assert [sh.index for sh in gs] == [s.devices_indices_map(g.shape)[d] for d in devs]
    checks += 8
    fix = "multihost_utils.process_allgather"
    raises(RuntimeError, fix, lambda: np.asarray(x))
    raises(RuntimeError, fix, lambda: str(x))
    raises(RuntimeError, fix, lambda: x.tolist())
    assert repr(x) == (f"Array(shape={g.shape}, dtype=float32, sharding=P('data', 'model') on "
                       f"Mesh('data': {n}, 'model': 2), is_fully_addressable=False)"), repr(x)
    # resharding that needs other processes' blocks gathers them (every process runs it)
    rg = cts.device_put(x, NamedSharding(mesh, P(None, "model")))
    assert np.array_equal(np.asarray(rg), g)
    # replicated over processes: every process holds the whole value
    r = cts.device_put(g, NamedSharding(mesh, P(None, "model")))
    assert not r.is_fully_addressable
    assert np.array_equal(np.asarray(r), g) and str(r) == str(g)
    assert float(cts.device_put(np.float32(2.5), NamedSharding(mesh, P()))) == 2.5
    # resharding that this process's blocks can serve: replicated -> sharded
    rs = cts.device_put(r, s)
    assert all(np.array_equal(sh.data, g[sh.index]) for sh in rs.addressable_shards)
    checks += 4

    # process_allgather of Arrays spanning processes: the global value (tiled or not),
    # beside host leaves, which stack
    for spec in (P("data", "model"), P("data"), P(None, "model"), P(("data", "model")),
                 P("model", "data"), P()):
        y = cts.device_put(g, NamedSharding(mesh, spec))
        for tiled in (False, True):
            got = mhu.process_allgather({"y": y, "h": np.array([me, 1]), "s": np.float32(me)},
                                        tiled=False) if not tiled else mhu.process_allgather(
                {"y": y, "h": np.array([me, 1])}, tiled=True)
            assert got["y"].dtype == np.float32 and np.array_equal(got["y"], g), spec
            want_h = (np.stack if not tiled else np.concatenate)(
                [np.array([p, 1]) for p in range(n)])
            assert np.array_equal(got["h"], want_h)
            checks += 1
    bf = cts.device_put(g.astype(np.int32), s)
    assert np.array_equal(mhu.process_allgather(bf), g.astype(np.int32))
    raises(AssertionError, "differ", lambda: mhu.process_allgather(
        cts.device_put(g, s) if me == 0 else cts.device_put(g, NamedSharding(mesh, P("data")))))
    checks += 1

    # --- 3. input placement ------------------------------------------------------------
    calls = []

    def cb(index):
        calls.append(index)
        return g[index]

    y = cts.make_array_from_callback(g.shape, s, cb)
    assert len(calls) == 2 and all(c in [sh.index for sh in shards] for c in calls)
    assert np.array_equal(mhu.process_allgather(y), g)
    yr = cts.make_array_from_callback(g.shape, NamedSharding(mesh, P()), lambda i: g[i],
                                      dtype=np.float16)
    assert yr.dtype == np.float16 and np.array_equal(np.asarray(yr), g.astype(np.float16))
    raises(ValueError, "returned shape", lambda: cts.make_array_from_callback(
        g.shape, s, lambda i: g))
    raises(TypeError, "callable", lambda: cts.make_array_from_callback(g.shape, s, 3))
    checks += 2

    parts = [cts.device_put(g[idx], d)
             for d, idx in s.addressable_devices_indices_map(g.shape).items()]
    z = cts.make_array_from_single_device_arrays(g.shape, s, parts[::-1])   # any order
    assert np.array_equal(mhu.process_allgather(z), g)
    parts[0].delete()   # z owns copies
    assert np.array_equal(mhu.process_allgather(z), g)
    parts = [cts.device_put(g[idx], d)
             for d, idx in s.addressable_devices_indices_map(g.shape).items()]
    raises(ValueError, "got 1 arrays", lambda: cts.make_array_from_single_device_arrays(
        g.shape, s, parts[:1]))
    raises(ValueError, "both on", lambda: cts.make_array_from_single_device_arrays(
        g.shape, s, [parts[0], parts[0]]))
    raises(ValueError, "has shape", lambda: cts.make_array_from_single_device_arrays(
        (4 * n, 4 * n), s, parts))
    raises(TypeError, "not an Array", lambda: cts.make_array_from_single_device_arrays(
        g.shape, s, [np.asarray(p) for p in parts]))
    raises(ValueError, "dtype", lambda: cts.make_array_from_single_device_arrays(
        g.shape, s, [parts[0], parts[1].astype(np.int32)]))
    checks += 2

    # process-local data: each process has its rows of a batch split over 'data'
    rows = g[4 * me:4 * me + 4]
    sb = NamedSharding(mesh, P("data"))
    w = cts.make_array_from_process_local_data(sb, rows)
    assert w.shape == g.shape and not w.is_fully_addressable
    assert np.array_equal(mhu.process_allgather(w), g)
    w2 = cts.make_array_from_process_local_data(s, rows, g.shape)   # also split over 'model'
    assert np.array_equal(mhu.process_allgather(w2), g)
    full = cts.make_array_from_process_local_data(sb, g, g.shape)   # dims given whole
    assert np.array_equal(mhu.process_allgather(full), g)
    repl = cts.make_array_from_process_local_data(NamedSharding(mesh, P(None, "model")), g)
    assert repl.shape == g.shape and np.array_equal(np.asarray(repl), g)
    raises(ValueError, "must be the global size", lambda:
           cts.make_array_from_process_local_data(sb, g[:3], g.shape))
    raises(ValueError, "dimensions", lambda:
           cts.make_array_from_process_local_data(sb, rows, (4 * n,)))
    checks += 6

    # host-local <-> global, as jax's multihost_utils
    tree = {"x": rows, "y": [np.full((2, 3), me, np.int32)]}
    gt = mhu.host_local_array_to_global_array(tree, mesh, {"x": P("data"), "y": [P(None)]})
    assert gt["x"].shape == g.shape and not gt["x"].is_fully_addressable
    assert np.array_equal(mhu.process_allgather(gt["x"]), g)
    assert gt["y"][0].shape == (2, 3)
    assert mhu.host_local_array_to_global_array(gt, mesh, P())["x"] is gt["x"]
    back = mhu.global_array_to_host_local_array(gt, mesh, {"x": P("data"), "y": [P(None)]})
    assert back["x"].is_fully_addressable and np.array_equal(np.asarray(back["x"]), rows)
    assert back["x"].sharding.mesh == mesh.local_mesh
    raises(ValueError, "does not have the sharding", lambda:
           mhu.global_array_to_host_local_array(gt["x"], mesh, P(None, "model")))
    checks += 5

    # --- 4. born-sharded init: bit-identical to one process with every device ---------------
    params = born_sharded(mesh)
    ref = np.load(ref_path)
    assert sorted(ref.files) == sorted(params), (ref.files, sorted(params))
    for k, v in params.items():
        assert isinstance(v, cts.Array) and v.sharding.mesh == mesh, k
        held = {d for d, _, _, _ in v._blocks}
        assert held <= set(local), (k, held)     # this process made only its own shards
        got = mhu.process_allgather(v)
        want = ref[k]
        assert got.dtype == want.dtype and got.shape == want.shape, k
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), k
        for sh in v.addressable_shards:
            assert np.array_equal(np.asarray(sh.data).view(np.uint8),
                                  want[sh.index].view(np.uint8)), k
        checks += 1
    assert not params["w1"].is_fully_addressable   # 'embed' -> 'data' spans processes
    finish(dist, me, n, checks)


if __name__ == "__main__":
    run(main, reference)
