"""Mesh, PartitionSpec and NamedSharding: semantics, layout and validation."""
import json
import pickle
import threading

import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import P, PartitionSpec, Mesh, NamedSharding, mesh_utils
from ctrainstate.sharding import get_mesh

MESHES = {
    (8,): ("x",),
    (2, 4): ("data", "model"),
    (4, 2): ("data", "model"),
    (1, 8): ("data", "model"),
    (2, 2, 2): ("a", "b", "c"),
}


def mesh_of(shape):
    return cts.make_mesh(shape, MESHES[shape])


# --- PartitionSpec -------------------------------------------------------------------


def test_partition_spec_is_a_tuple():
    assert P("data", None) == ("data", None)
    assert isinstance(P("a"), tuple)
    assert P() != P(None)
    assert P(("x", "y"), None) == (("x", "y"), None)
    assert P(["x", "y"]) == (("x", "y"),)  # lists become tuples
    assert hash(P("a", None)) == hash(("a", None))
    assert repr(P("data", None)) == "PartitionSpec('data', None)"
    assert repr(P(("x", "y"))) == "PartitionSpec(('x', 'y'),)"
    assert repr(P()) == "PartitionSpec()"
    assert PartitionSpec is cts.PartitionSpec is cts.P


def test_partition_spec_unconstrained():
    u = P.UNCONSTRAINED
    assert str(u) == "UNCONSTRAINED" and repr(u) == "UNCONSTRAINED"
    assert P("a", u)[1] is u
    assert pickle.loads(pickle.dumps(P("a", u)))[1] is u
    assert pickle.loads(pickle.dumps(P("a", ("b", "c")))) == P("a", ("b", "c"))


@pytest.mark.parametrize("bad", [1, 2.0, ("a", 1), object()])
def test_partition_spec_bad_entries(bad):
    with pytest.raises(TypeError, match="PartitionSpec entry"):
        P(bad)


# --- Mesh ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", list(MESHES))
def test_mesh_properties(shape):
    names = MESHES[shape]
    devs = mesh_utils.create_device_mesh(shape)
    m = Mesh(devs, names)
    assert m.axis_names == names
    assert list(m.shape.items()) == list(zip(names, shape))
    assert m.size == 8
    assert m.devices.shape == shape
    assert m.device_ids.tolist() == np.arange(8).reshape(shape).tolist()
    assert m == Mesh(devs, names) and hash(m) == hash(Mesh(devs, names))
    assert m != Mesh(devs[::-1] if len(shape) == 1 else devs, names) or len(shape) > 1


def test_mesh_errors():
    devs = cts.devices()
    with pytest.raises(ValueError, match="device id 1 appears more than once"):
        Mesh(np.array([devs[0], devs[1], devs[1], devs[2]]), ("x",))
    with pytest.raises(ValueError, match="axis name 'x' appears more than once"):
        Mesh(np.array(devs).reshape(2, 4), ("x", "x"))
    with pytest.raises(ValueError, match="3 axis names"):
        Mesh(np.array(devs).reshape(2, 4), ("a", "b", "c"))
    with pytest.raises(ValueError, match="1 axis names"):
        Mesh(np.array(devs).reshape(2, 4), ("a",))
    with pytest.raises(TypeError, match="Device objects"):
        Mesh(np.arange(8), ("x",))
    with pytest.raises(TypeError, match="must be strings"):
        Mesh(np.array(devs), (1,))
    with pytest.raises(ValueError, match="need 16 devices but only 8 exist"):
        cts.make_mesh((4, 4), ("a", "b"))
    with pytest.raises(ValueError, match="needs 6 devices but 8"):
        mesh_utils.create_device_mesh((2, 3))


def test_mesh_context_is_thread_local_and_nests():
    m1 = mesh_of((8,))
    m2 = mesh_of((2, 4))
    assert get_mesh() is None
    seen = {}
    with m1:
        assert get_mesh() is m1
        with m2 as inner:
            assert inner is m2 and get_mesh() is m2

            def other():
                seen["thread"] = get_mesh()

            t = threading.Thread(target=other)
            t.start()
            t.join()
        assert get_mesh() is m1
    assert get_mesh() is None
    assert seen["thread"] is None


def test_mesh_context_restored_on_exception():
    m = mesh_of((8,))
    with pytest.raises(KeyError):
        with m:
            raise KeyError("x")
    assert get_mesh() is None


# --- NamedSharding ---------------------------------------------------------------------


def test_named_sharding_basics():
    m = mesh_of((2, 4))
    s = NamedSharding(m, P("data", "model"))
    assert s.mesh is m and s.spec == P("data", "model")
    assert s.shard_shape((8, 12)) == (4, 3)
    assert not s.is_fully_replicated
    assert NamedSharding(m, P()).is_fully_replicated
    assert NamedSharding(m, P(None, None)).is_fully_replicated
    assert NamedSharding(mesh_of((1, 8)), P("data")).is_fully_replicated
    assert s == NamedSharding(m, P("data", "model"))
    assert NamedSharding(m, P("data")) == NamedSharding(m, P("data", None))
    assert hash(NamedSharding(m, P("data"))) == hash(NamedSharding(m, P("data", None)))
    assert s != NamedSharding(m, P("model", "data"))
    assert s.device_set == set(cts.devices())
    assert "NamedSharding(mesh=Mesh('data': 2, 'model': 4), spec=PartitionSpec('data', 'model'))" == repr(s)


def test_named_sharding_devices_indices_map_2x4():
    m = mesh_of((2, 4))
    d = cts.devices()
    idx = NamedSharding(m, P("data", "model")).devices_indices_map((4, 8))
    # device (i, j) of the mesh holds rows 2i:2i+2 and columns 2j:2j+2
    for i in range(2):
        for j in range(4):
            assert idx[d[4 * i + j]] == (slice(2 * i, 2 * i + 2), slice(2 * j, 2 * j + 2))
    idx = NamedSharding(m, P(("model", "data"))).devices_indices_map((16,))
    # 'model' is major: device (i, j) -> block j * 2 + i
    for i in range(2):
        for j in range(4):
            b = 2 * j + i
            assert idx[d[4 * i + j]] == (slice(2 * b, 2 * b + 2),)


def test_unsplit_dimensions_index_as_slice_none():
    """jax's convention: a dimension a shard spans whole is slice(None), split ones are
    slice(start, stop) -- also when split over a mesh axis of size 1 (one piece)."""
    m = mesh_of((2, 4))
    d = cts.devices()
    idx = NamedSharding(m, P(None, "model")).devices_indices_map((4, 8))
    assert idx[d[6]] == (slice(None), slice(4, 6))
    assert NamedSharding(m, P()).devices_indices_map((4, 8))[d[3]] == (slice(None),) * 2
    one = Mesh(np.array(d[:1]), ("x",))
    assert NamedSharding(one, P("x")).devices_indices_map((4,))[d[0]] == (slice(None),)
    a = cts.device_put(np.ones((4, 2), np.float32))
    assert [s.index for s in a.addressable_shards] == [(slice(None), slice(None))]
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    for s in cts.device_put(x, NamedSharding(m, P(None, "model"))).addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), x[s.index])


@pytest.mark.parametrize("spec,shape,msg", [
    (P("nope"), (8,), "Resource axis: 'nope' of PartitionSpec\\('nope',\\) is undefined"),
    (P("model", "model"), (8, 8), "mesh axis 'model' for dimensions 0 and 1"),
    (P(("model", "model")), (8,), "uses mesh axis 'model' twice in dimension 0"),
])
def test_named_sharding_bad_specs(spec, shape, msg):
    m = mesh_of((2, 4))
    with pytest.raises(ValueError, match=msg):
        NamedSharding(m, spec)


def test_named_sharding_shape_errors():
    m = mesh_of((2, 4))
    with pytest.raises(ValueError, match="dimension 0 of size 10 is not divisible by mesh axis 'model' of size 4"):
        NamedSharding(m, P("model")).shard_shape((10,))
    with pytest.raises(ValueError, match=r"dimension 1 of size 4 is not divisible by mesh axes \('data', 'model'\) of total size 8"):
        NamedSharding(m, P(None, ("data", "model"))).shard_shape((3, 4))
    with pytest.raises(ValueError, match="has 3 entries but the array has rank 2"):
        NamedSharding(m, P("data", None, None)).shard_shape((4, 4))
    with pytest.raises(ValueError, match="for scalars the PartitionSpec should be P()"):
        NamedSharding(m, P("data")).shard_shape(())
    with pytest.raises(ValueError, match="UNCONSTRAINED"):
        NamedSharding(m, P(P.UNCONSTRAINED))
    with pytest.raises(TypeError, match="needs a Mesh"):
        NamedSharding("mesh", P())


def _random_specs(mesh, ndim, rng, n):
    """Random valid specs: each mesh axis goes to at most one dimension (or none)."""
    out = []
    names = list(mesh.axis_names)
    for _ in range(n):
        dims = [[] for _ in range(ndim)]
        for a in rng.permutation(names):
            k = rng.integers(-1, ndim)
            if k >= 0:
                dims[k].append(str(a))
        entries = [None if not e else (e[0] if len(e) == 1 else tuple(e)) for e in dims]
        cut = rng.integers(0, ndim + 1)  # sometimes drop trailing entries
        if all(e is None for e in entries[cut:]):
            entries = entries[:cut]
        out.append(P(*entries))
    return out


@pytest.mark.parametrize("shape", list(MESHES))
def test_layout_tiles_the_array_with_replica_ids(shape):
    rng = np.random.default_rng(0)
    m = mesh_of(shape)
    for spec in _random_specs(m, 3, rng, 12):
        s = NamedSharding(m, spec)
        gshape = (8, 16, 8)
        shard_shape, blocks, nrep = s._layout(gshape)
        cover = np.zeros(gshape, np.int64)
        rep0 = np.zeros(gshape, np.int64)
        by_block = {}
        for dev, start, rid in blocks:
            sl = tuple(slice(a, a + n) for a, n in zip(start, shard_shape))
            cover[sl] += 1
            if rid == 0:
                rep0[sl] += 1
            by_block.setdefault(start, []).append(rid)
        assert (rep0 == 1).all(), spec      # replica 0 blocks tile the array exactly once
        assert (cover == nrep).all(), spec  # every element held nrep times
        for rids in by_block.values():
            assert sorted(rids) == list(range(nrep))
        assert len(by_block) * nrep == 8


def _slices(idx):
    """A tuple of slices as JSON-able [start, stop, step] triples."""
    return [[sl.start, sl.stop, sl.step] for sl in idx]


def _jax_layouts(jax, shape, names, specs, gshape):
    """jax's layout of each spec on a mesh of its 8 CPU devices, as JSON."""
    from jax.sharding import Mesh as JMesh, NamedSharding as JNS, PartitionSpec as JP
    if jax.device_count() < 8:
        pytest.skip("jax has fewer than 8 CPU devices")
    jm = JMesh(np.array(jax.devices()[:8]).reshape(shape), names)
    x = np.arange(np.prod(gshape), dtype=np.float32).reshape(gshape)
    out = []
    for spec in specs:
        theirs = JNS(jm, JP(*spec))
        ja = jax.device_put(x, theirs)
        out.append({"map": {str(d.id): _slices(i) for d, i in
                            theirs.devices_indices_map(gshape).items()},
                    "shards": {str(sh.device.id): _slices(sh.index) for sh in ja.addressable_shards},
                    "shard_shape": list(theirs.shard_shape(gshape)),
                    "replicated": bool(theirs.is_fully_replicated)})
    return json.dumps(out)


def test_layout_matches_jax(jax_ref):
    rng = np.random.default_rng(1)
    gshape = (8, 16, 8)
    x = np.arange(np.prod(gshape), dtype=np.float32).reshape(gshape)
    for shape in MESHES:
        names = MESHES[shape]
        m = mesh_of(shape)
        specs = list(_random_specs(m, 3, rng, 10))
        wants = json.loads(jax_ref(str(shape), lambda jax: _jax_layouts(
            jax, shape, names, specs, gshape)))
        for spec, want in zip(specs, wants, strict=True):
            ours = NamedSharding(m, spec)
            # the same slices, slice(None) for unsplit dimensions
            assert {str(d.id): _slices(i) for d, i in ours.devices_indices_map(gshape).items()} \
                == want["map"], spec
            # Array.addressable_shards spells them as jax's Shard.index does
            ca = cts.device_put(x, ours)
            assert {str(sh.device.id): _slices(sh.index) for sh in ca.addressable_shards} == \
                want["shards"], spec
            assert list(ours.shard_shape(gshape)) == want["shard_shape"]
            assert ours.is_fully_replicated == want["replicated"]


def test_zero_size_split_dimension_index_is_a_slice_as_in_jax():
    """A size-0 dimension split over mesh axes of more than one device is slice(0, 0), not
    slice(None): splitting is read from the mesh, not from the sizes (jax's rule)."""
    m = mesh_of((2, 4))
    s = NamedSharding(m, P("data", "model"))
    idx = s.devices_indices_map((0, 4))
    d = cts.devices()
    assert idx[d[5]] == (slice(0, 0), slice(1, 2))
    a = cts.device_put(np.zeros((0, 4), np.float32), s)
    assert {sh.device.id: sh.index for sh in a.addressable_shards}[5] == (slice(0, 0), slice(1, 2))
    one = Mesh(np.array(d[:1]), ("x",))
    assert NamedSharding(one, P("x")).devices_indices_map((0,))[d[0]] == (slice(None),)


def test_op_outputs_take_their_own_meshs_sharding():
    # ops take output shardings from a table keyed by the place: equal placements share one
    # object (its layout cache), and two meshes over other device orders never share one
    devs = cts.devices()[:8]
    m1 = Mesh(np.array(devs).reshape(2, 4), ("x", "y"))
    m2 = Mesh(np.array(devs[::-1]).reshape(2, 4), ("x", "y"))
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    outs = []
    for m in (m1, m2, m1):
        a = cts.device_put(x, NamedSharding(m, P("x", "y")))
        s1, s2 = (a + a).sharding, (a * 2.0).sharding
        assert s1 is s2 and s1.mesh is m and s1.spec == P("x", "y")
        shard_shape, blocks, _ = s1._layout((8, 4))
        fresh = NamedSharding(m, P("x", "y"))._layout((8, 4))
        assert (shard_shape, [(d.id, st, r) for d, st, r in blocks]) == \
            (fresh[0], [(d.id, st, r) for d, st, r in fresh[1]])
        np.testing.assert_array_equal(np.asarray(a + a), 2 * x)
        outs.append(s1)
    assert outs[0] is outs[2] and outs[0] is not outs[1]
    # a list shape is accepted by the layout cache too
    assert outs[0].shard_shape([8, 4]) == outs[0].shard_shape((8, 4)) == (4, 1)


def test_partition_spec_entries_are_normalised_as_in_jax():
    """jax stores a one-name tuple as the name and an empty tuple as None (the same split),
    so such specs compare and hash equal; two or more names stay a tuple."""
    assert P(("x",)) == P("x") and hash(P(("x",))) == hash(P("x"))
    assert P(()) == P(None) and P(("x",), ())[1] is None
    assert P(("x", "y")) == (("x", "y"),) and P(("x", "y")) != P("x", "y")
    assert P("x", None) != P("x")   # trailing Nones are not dropped (jax neither)
    from ctrainstate.partitioning import logical_to_mesh_axes
    assert logical_to_mesh_axes(("a",), (("a", ("x",)),)) == P("x")


_MESH_BAD_ARGS = [
    (lambda: cts.make_mesh(8, ("x",)),
     r"make_mesh: axis_shapes must be a sequence of integers, got int 8; for one axis write \(8,\)"),
    (lambda: cts.make_mesh((8.0,), ("x",)), r"make_mesh: axis_shapes must be a sequence of integers"),
    (lambda: cts.make_mesh((8,), ("x",), devices=3),
     "make_mesh: devices must be a sequence of Devices, got int"),
    (lambda: cts.make_mesh((2,), ("x",), devices=[1, 2]),
     "make_mesh: devices must be a sequence of Devices, got an element of type int"),
    (lambda: cts.make_mesh((8,), 3), "make_mesh: axis_names must be a sequence of strings"),
    (lambda: mesh_utils.create_device_mesh(8),
     "create_device_mesh: mesh_shape must be a sequence of integers, got 8"),
    (lambda: mesh_utils.create_device_mesh((2,), devices=5),
     "create_device_mesh: devices must be a sequence of Devices, got int"),
]


@pytest.mark.parametrize("call,msg", _MESH_BAD_ARGS, ids=range(len(_MESH_BAD_ARGS)))
def test_make_mesh_wrong_argument_types_name_the_argument(call, msg):
    with pytest.raises(TypeError, match=msg):
        call()


def test_make_mesh_takes_a_device_array():
    devs = np.array(cts.devices()[:4], dtype=object).reshape(2, 2)
    assert cts.make_mesh((4,), ("x",), devices=devs).device_ids.tolist() == [0, 1, 2, 3]


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define, live when installed (those parts skip cleanly otherwise) and derived
# by hand

def _jax():
    return pytest.importorskip("jax")


def _equiv_cases(Mesh, NS, P, SDS, devs):
    m24 = Mesh(np.array(devs[:8]).reshape(2, 4), ("data", "model"))
    m42 = Mesh(np.array(devs[:8]).reshape(4, 2), ("a", "b"))
    m8 = Mesh(np.array(devs[:8]), ("x",))
    m1 = Mesh(np.array(devs[:1]), ("x",))
    return [
        (NS(m24, P("data")), NS(m24, P("data", None)), 2),          # trailing None
        (NS(m24, P("data")), NS(m24, P("data", "model")), 2),
        (NS(m24, P(("data", "model"))), NS(m8, P("x")), 1),         # same devices, same order
        (NS(m24, P()), NS(m42, P()), 2),                            # replicated on 8 either way
        (NS(m24, P("model")), NS(m24, P(None, "model")), 2),
        (NS(m1, P("x")), SDS(devs[0]), 2),                          # one device
        (NS(m1, P()), SDS(devs[1]), 1),
    ]


def test_is_equivalent_to():
    got = [a.is_equivalent_to(b, nd) for a, b, nd in _equiv_cases(
        cts.Mesh, cts.NamedSharding, cts.P, cts.SingleDeviceSharding, cts.devices())]
    # derived: which cases put every element on the same devices
    assert got == [True, False, True, True, False, True, False]


def test_is_equivalent_to_matches_jax():
    jax = _jax()
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
    if jax.device_count() < 8:
        pytest.skip("needs 8 XLA CPU devices")
    want = [a.is_equivalent_to(b, nd) for a, b, nd in _equiv_cases(
        Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding, jax.devices())]
    got = [a.is_equivalent_to(b, nd) for a, b, nd in _equiv_cases(
        cts.Mesh, cts.NamedSharding, cts.P, cts.SingleDeviceSharding, cts.devices())]
    assert got == want


def test_set_mesh_context_and_setter():
    from ctrainstate import partitioning as nn_partitioning
    m = cts.make_mesh((2, 4), ("data", "model"))
    m2 = cts.make_mesh((8,), ("x",))
    assert cts.get_mesh() is None
    with cts.set_mesh(m) as entered:
        assert entered is m and cts.get_mesh() is m
        x = cts.device_put(np.ones((8, 4), np.float32), cts.P("data"))   # a spec on the set mesh
        assert x.sharding == cts.NamedSharding(m, cts.P("data"))
        with nn_partitioning.axis_rules((("batch", "data"),)):
            y = nn_partitioning.with_sharding_constraint(cts.device_put(np.ones((8, 2), np.float32)),
                                                         ("batch", None))
        assert y.sharding == cts.NamedSharding(m, cts.P("data", None))
        with cts.set_mesh(m2):
            assert cts.get_mesh() is m2
        assert cts.get_mesh() is m
        with cts.set_mesh(None):
            assert cts.get_mesh() is None
    assert cts.get_mesh() is None
    cts.set_mesh(m)                      # the setter form stays until replaced
    try:
        assert cts.get_mesh() is m
    finally:
        cts.set_mesh(None)
    assert cts.get_mesh() is None
    with pytest.raises(TypeError):
        cts.set_mesh("data")


def _set_mesh_sequence(make_mesh, set_mesh, current):
    """Mesh axis names seen along a sequence of setter / with-block uses (ctrainstate or JAX)."""
    a, b = make_mesh((8,), ("x",)), make_mesh((2, 4), ("d", "m"))
    seen = []
    for _ in range(1000):
        set_mesh(a)                     # the setter replaces; it does not stack
    seen.append(current())
    set_mesh(None)
    seen.append(current())
    with a:
        set_mesh(b)                     # inside a `with mesh:` block: no error at its exit
        seen.append(current())
    seen.append(current())              # the setter's mesh stays after the block
    set_mesh(a)
    with set_mesh(b):
        seen.append(current())
        set_mesh(None)
        seen.append(current())
    seen.append(current())              # the value before `with set_mesh(b)` is back
    set_mesh(None)
    seen.append(current())
    return seen


_SET_MESH_SEEN = [("x",), (), ("d", "m"), ("d", "m"), ("d", "m"), (), ("x",), ()]


def test_set_mesh_setter_replaces_and_nests_with_mesh_blocks():
    from ctrainstate._src.array import sharding
    names = lambda: tuple(cts.get_mesh().axis_names) if cts.get_mesh() is not None else ()
    try:
        assert _set_mesh_sequence(cts.make_mesh, cts.set_mesh, names) == _SET_MESH_SEEN
        assert sharding._mesh_stack() == []          # 1000 setter calls left nothing behind
        m = cts.make_mesh((2, 4), ("d", "m"))
        with cts.make_mesh((8,), ("x",)):
            cts.set_mesh(m)
            x = cts.device_put(np.ones((8, 4), np.float32), cts.P("d"))   # on the set mesh
        assert x.sharding == cts.NamedSharding(m, cts.P("d"))
    finally:
        cts.set_mesh(None)


def test_set_mesh_sequence_matches_jax():
    jax = _jax()
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 JAX CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    import warnings
    names = lambda: tuple(jax.sharding.get_abstract_mesh().axis_names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)       # jax's `with mesh:`
        try:
            assert _set_mesh_sequence(jax.make_mesh, jax.set_mesh, names) == _SET_MESH_SEEN
        finally:
            jax.set_mesh(None)


def test_device_put_partition_spec_on_active_mesh():
    m = cts.make_mesh((2, 4), ("data", "model"))
    a = np.arange(32, dtype=np.float32).reshape(8, 4)
    with pytest.raises(ValueError, match="no active mesh"):
        cts.device_put(a, cts.P("data"))
    with m:
        x = cts.device_put(a, cts.P("data", "model"))
        t = cts.device_put({"a": a, "b": a}, {"a": cts.P(), "b": cts.P("model")})
    assert x.sharding == cts.NamedSharding(m, cts.P("data", "model"))
    assert t["a"].sharding == cts.NamedSharding(m, cts.P())
    assert t["b"].sharding == cts.NamedSharding(m, cts.P("model"))
    np.testing.assert_array_equal(np.asarray(t["b"]), a)


def test_single_device_sharding_is_one_object_per_device():
    """SingleDeviceSharding(d) is the same object for the same device (the ops' plan caches
    key by sharding object, so Arrays placed from numpy values share their plans); equal
    to, and hashed as, before; a subclass makes new objects; a non-device still raises."""
    d0, d1 = cts.devices()[0], cts.devices()[1]
    s = cts.SingleDeviceSharding(d0)
    assert cts.SingleDeviceSharding(d0) is s and cts.SingleDeviceSharding(d1) is not s
    assert cts.SingleDeviceSharding(d1) == cts.SingleDeviceSharding(d1) != s
    assert hash(s) == hash(cts.SingleDeviceSharding(d0))
    x, y = cts.device_put(np.ones(3, np.float32)), cts.device_put(np.zeros(3, np.float32))
    assert x.sharding is y.sharding is cts.device_put(np.ones(2), d0).sharding
    assert s._layout((4, 3))[0] == (4, 3)        # its layout cache works as before

    class Mine(cts.SingleDeviceSharding):
        pass
    m = Mine(d0)
    assert type(m) is Mine and Mine(d0) is not m and m == s
    assert cts.SingleDeviceSharding(d0) is s     # a subclass does not replace the device's
    with pytest.raises(TypeError, match="needs a Device"):
        cts.SingleDeviceSharding("cpu:0")
    import copy
    import pickle
    for clone in (copy.copy, copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        assert clone(s) is s                      # made by the constructor: the device's object
    for clone in (copy.copy, copy.deepcopy):      # (a local class does not pickle)
        c = clone(m)
        assert type(c) is Mine and c == m
