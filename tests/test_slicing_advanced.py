"""Slice steps other than 1, integer-array and boolean-mask indexing on sharded Arrays:
``x[idx]`` and ``x.at[idx].set/add/multiply/divide/get`` equal numpy's (and jax's, live, when
installed) on meshes (1,), (8,) and (2, 4); the result's dimensions go where numpy puts them;
dimensions taken whole keep their mesh axes; gradients are scatter-adds of the cotangent
(checked against np.add.at and jax.grad); out-of-range index entries are clamped in reads and
dropped in updates and cotangents, as jax; any dtype; eval_shape; clear errors."""
import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from conftest import assert_same_bits, on_gpu

MESHES = [((1,), ("x",)), ((8,), ("x",)), ((2, 4), ("data", "model"))]
SHAPE = (8, 4, 6)


def _specs(names):
    if len(names) == 1:
        return [cts.P(), cts.P("x")]
    return [cts.P("data", "model"), cts.P("model", None, "data"), cts.P(None, "data", None)]


MASK8 = np.array([1, 0, 1, 1, 0, 0, 0, 1], bool)
MASK84 = (np.arange(32).reshape(8, 4) % 3) == 0

# (index, description); every index array entry is in bounds here (numpy is the reference)
CASES = [
    (np.s_[::2], "step 2"),
    (np.s_[::-1], "reversed"),
    (np.s_[5:1:-2], "negative step"),
    (np.s_[:, ::3, 1::-1], "steps in two dims"),
    (np.s_[..., 7::-4], "ellipsis and step"),
    (np.s_[3:3:2], "empty stepped slice"),
    (np.array([0, 7, 7, 2]), "array with duplicates"),
    ([[1, 2], [3, 3]], "2-d list"),
    (np.s_[:, np.array([3, -1, 0])], "negative entries wrap"),
    (np.s_[:, [0, 1], [[2], [5]]], "adjacent arrays broadcast in place"),
    (np.s_[[1, 2], :, [[0], [5]]], "separated arrays go first"),
    (np.s_[0, :, [1, 2]], "an int counts as an array: separated"),
    (np.s_[:, 0, [1, 2]], "an int next to an array: in place"),
    (np.s_[None, [1, 3], None, 1:3], "None between"),
    (np.s_[:, [0], ..., [1]], "an empty ... separates"),
    (np.s_[::-2, [2, 0], None], "step and array"),
    (MASK8, "1-d mask"),
    (MASK84, "2-d mask"),
    (np.s_[:, MASK84[0], ::2], "mask in the middle"),
    (np.s_[True], "True: a new axis"),
    (np.s_[False, 1], "False: an empty new axis"),
    (np.s_[np.array([], np.int64)], "empty array"),
    (np.s_[[[]]], "empty nested list"),
]
IDS = [c[1] for c in CASES]


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_getitem_values_layouts_and_gradients(mesh_shape, names):
    rng = np.random.default_rng(0)
    h = rng.standard_normal(SHAPE).astype(np.float32)
    mesh = cts.make_mesh(mesh_shape, names)
    for spec in _specs(names):
        x = cts.device_put(h, cts.NamedSharding(mesh, spec))
        axes = {a for e in spec if e for a in ((e,) if isinstance(e, str) else e)}
        for idx, what in CASES:
            want = h[tuple(idx) if isinstance(idx, tuple) else idx]
            y = x[idx]
            assert y.shape == want.shape and y.dtype == np.float32, (spec, what)
            np.testing.assert_array_equal(np.asarray(y), want, err_msg=f"{spec} {what}")
            if isinstance(y.sharding, cts.NamedSharding):  # no mesh axis appears from nowhere
                used = [a for e in y.sharding.spec if e for a in ((e,) if isinstance(e, str) else e)]
                assert set(used) <= axes and len(used) == len(set(used)), (spec, what)
            w = rng.standard_normal(want.shape).astype(np.float32)
            g = cts.grad(lambda v: cnp.sum(v[idx] * w))(x)
            gw = np.zeros_like(h)
            np.add.at(gw, idx, w)  # duplicates accumulate
            assert g.sharding == x.sharding
            np.testing.assert_allclose(np.asarray(g), gw, rtol=1e-6, atol=1e-6,
                                       err_msg=f"{spec} {what}")


def test_dimensions_taken_whole_keep_their_axes():
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    x = cts.device_put(np.zeros((4, 8, 6), np.float32),
                       cts.NamedSharding(mesh, cts.P("data", "model")))

    def spec(a):
        return tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))
    assert spec(x[:, ::2]) == ("data", None, None)          # the stepped dim comes out unsharded
    assert spec(x[:, [0, 5, 2]]) == ("data", None, None)
    assert spec(x[[1, 0], :, ::-1]) == (None, "model", None)
    assert spec(x[[0, 1], :, [2, 3]]) == (None, "model")     # separated: B first, then dim 1
    assert spec(x[::-1][None]) == (None, None, "model", None)
    assert spec(x[..., np.array([1, 1])]) == ("data", "model", None)
    assert spec(x[np.ones(4, bool)]) == (None, "model", None)
    ints = cts.device_put(np.zeros((8, 8), np.int32), cts.NamedSharding(mesh, cts.P("data", "model")))
    assert spec(ints[:, ::2]) == ("data", None)              # other dtypes too


def test_jax_parity_getitem_and_gradients():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(1)
    h = rng.standard_normal(SHAPE).astype(np.float32)
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    x = cts.device_put(h, cts.NamedSharding(mesh, cts.P("data", "model")))
    # out of range entries: jax clamps reads and drops their cotangents ("promise_in_bounds")
    cases = [np.s_[5:1:-2], np.s_[[1, 2], :, [[0], [5]]], np.s_[:, [0], ..., [1]],
             np.s_[None, [1, 3], None, 1:3], np.s_[:, MASK84[0], ::2], np.s_[False, 1],
             np.s_[np.array([0, 9, -1, -12])], np.s_[:, np.array([[5, -6]]), 7:0:-3],
             np.s_[np.array([2**31 - 1, -2**31]), 1]]
    for idx in cases:
        w = rng.standard_normal(jax.eval_shape(lambda v: v[idx], h).shape).astype(np.float32)
        # jax's read and gradient in one program (one XLA compile, most of this test's time)
        want, gj = jax.jit(lambda v: (v[idx], jax.grad(lambda u: jnp.sum(u[idx] * w))(v)))(
            jnp.asarray(h))
        np.testing.assert_array_equal(np.asarray(x[idx]), np.asarray(want), err_msg=str(idx))
        g = cts.grad(lambda v: cnp.sum(v[idx] * w))(x)
        np.testing.assert_allclose(np.asarray(g), np.asarray(gj), rtol=1e-6, atol=1e-6,
                                   err_msg=str(idx))


def test_out_of_range_entries_are_clamped_in_reads_and_dropped_in_updates():
    """jax's documented default ("promise_in_bounds"): a gather clamps, a scatter drops."""
    x = cts.device_put(np.arange(5, dtype=np.float32))
    i = np.array([0, 7, -1, -7])
    assert np.asarray(x[i]).tolist() == [0.0, 4.0, 4.0, 0.0]
    assert np.asarray(x.at[i].get()).tolist() == [0.0, 4.0, 4.0, 0.0]
    assert np.asarray(x[cts.device_put(i.astype(np.int32))]).tolist() == [0.0, 4.0, 4.0, 0.0]
    assert np.asarray(x.at[i].set(100.0)).tolist() == [100.0, 1.0, 2.0, 3.0, 100.0]
    assert np.asarray(x.at[i].add(1.0)).tolist() == [1.0, 1.0, 2.0, 3.0, 5.0]
    g = cts.grad(lambda v: cnp.sum(v[i] * np.array([1.0, 2.0, 3.0, 4.0], np.float32)))(x)
    assert np.asarray(g).tolist() == [1.0, 0.0, 0.0, 0.0, 3.0]


def _np_at(h, idx, v, kind):
    """numpy reference for x.at[idx].<kind>(v) with jax's duplicate semantics: set keeps the
    last value, add/multiply accumulate, divide divides by the product."""
    out = h.astype(np.float64)
    v = np.broadcast_to(v, h[idx].shape)
    if kind == "set":
        flat = np.arange(h.size).reshape(h.shape)[idx]
        for f, val in zip(flat.reshape(-1), v.reshape(-1)):
            out.reshape(-1)[f] = val
    elif kind == "add":
        np.add.at(out, idx, v)
    else:
        p = np.ones_like(out)
        np.multiply.at(p, idx, v)
        out = out * p if kind == "multiply" else out / p
    return out


AT_CASES = [np.s_[[1, 1, 6, 1]], np.s_[::2, [3, 0, 3]], np.s_[:, MASK84[0], ::-3],
            np.s_[[[0], [7]], 1, [2, 5]], np.s_[5:0:-2]]


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_at_updates_values_and_gradients(mesh_shape, names):
    rng = np.random.default_rng(2)
    h = rng.standard_normal(SHAPE).astype(np.float32)
    mesh = cts.make_mesh(mesh_shape, names)
    x = cts.device_put(h, cts.NamedSharding(mesh, _specs(names)[-1]))
    w = rng.standard_normal(SHAPE).astype(np.float32)
    for idx in AT_CASES:
        shp = h[idx].shape
        v = (rng.standard_normal(shp) + 3.0).astype(np.float32)
        for kind in ("set", "add", "multiply", "divide"):
            got = getattr(x.at[idx], kind)(v)
            assert got.sharding == x.sharding
            np.testing.assert_allclose(np.asarray(got), _np_at(h, idx, v, kind), rtol=1e-5,
                                       err_msg=f"{kind} {idx}")
        np.testing.assert_array_equal(np.asarray(x), h)  # x is unchanged
        np.testing.assert_array_equal(np.asarray(x.at[idx].get()), h[idx])
        # gradients from numpy: set routes w to the winning values and zeroes x there
        gx, gv = cts.grad(lambda a, b: cnp.sum(a.at[idx].set(b) * w), argnums=(0, 1))(x, v)
        flat = np.arange(h.size).reshape(h.shape)[idx].reshape(-1)
        last = {f: k for k, f in enumerate(flat)}
        want_gv = np.zeros(flat.size, np.float32)
        for f, k in last.items():
            want_gv[k] = w.reshape(-1)[f]
        hit = np.zeros(h.size, bool)
        hit[flat] = True
        np.testing.assert_array_equal(np.asarray(gx), np.where(hit.reshape(h.shape), 0, w))
        np.testing.assert_array_equal(np.asarray(gv), want_gv.reshape(shp))
        gx, gv = cts.grad(lambda a, b: cnp.sum(a.at[idx].add(b) * w), argnums=(0, 1))(x, v)
        np.testing.assert_array_equal(np.asarray(gx), w)
        np.testing.assert_array_equal(np.asarray(gv), w[idx])
        # multiply with duplicates: d/dx = w * prod(v), d/dv_k = w * x * prod(other v)
        gx, gv = cts.grad(lambda a, b: cnp.sum(a.at[idx].multiply(b) * w), argnums=(0, 1))(x, v)
        p = np.ones(h.size)
        np.multiply.at(p, flat, v.reshape(-1))
        np.testing.assert_allclose(np.asarray(gx), w * p.reshape(h.shape), rtol=1e-5)
        want_gv = (w.reshape(-1) * h.reshape(-1))[flat] * p[flat] / v.reshape(-1)
        np.testing.assert_allclose(np.asarray(gv), want_gv.reshape(shp), rtol=1e-4, atol=1e-6)


def test_at_updates_match_jax():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(3)
    h = rng.standard_normal(SHAPE).astype(np.float32)
    mesh = cts.make_mesh((8,), ("x",))
    x = cts.device_put(h, cts.NamedSharding(mesh, cts.P("x")))
    w = rng.standard_normal(SHAPE).astype(np.float32)
    for idx in [AT_CASES[0], AT_CASES[2], np.s_[np.array([9, -9, 2, 2]), ::2]]:
        jdx = np.asarray(idx) if isinstance(idx, list) else idx  # jax refuses a bare list
        v = (rng.standard_normal(jax.eval_shape(lambda a: a[jdx], h).shape) + 3.0).astype(np.float32)
        kinds = ("set", "add", "multiply", "divide")
        grad_kinds = ("set", "add")  # jax differentiates scatter_mul only for unique indices

        def upd(a, b, kind):
            return a.at[jdx].set(b) if kind == "set" else a.at[jdx].add(b)

        def jax_side(a, b):
            # every update and gradient of this index in one jax program (one XLA compile)
            outs = [getattr(a.at[jdx], kind)(b) for kind in kinds]
            grads = [jax.grad(lambda a_, b_, k=kind: jnp.sum(upd(a_, b_, k) * w), argnums=(0, 1))(a, b)
                     for kind in grad_kinds]
            return outs, grads

        wants, jgrads = jax.jit(jax_side)(jnp.asarray(h), v)
        for kind, want in zip(kinds, wants):
            np.testing.assert_allclose(np.asarray(getattr(x.at[idx], kind)(v)), np.asarray(want),
                                       rtol=1e-6, err_msg=f"{kind} {idx}")
        for kind, (gxj, gvj) in zip(grad_kinds, jgrads):
            gx, gv = cts.grad(lambda a, b: cnp.sum(upd(a, b, kind) * w), argnums=(0, 1))(x, v)
            np.testing.assert_allclose(np.asarray(gx), np.asarray(gxj), rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(np.asarray(gv), np.asarray(gvj), rtol=1e-6, atol=1e-7)


def test_at_keeps_other_bits_and_overwrites_inf_nan():
    h = np.array([[-0.0, 1.0, np.inf, -np.inf], [np.nan, -0.0, 2.0, 3.0]], np.float32)
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    x = cts.device_put(h, cts.NamedSharding(mesh, cts.P("data", "model")))
    for idx, v, kind in [(np.s_[:, ::-2], -0.0, "set"), (np.s_[[0, 0], [2, 2]], 5.0, "set"),
                         (np.s_[:, [1, 1]], 1.0, "add"), (np.s_[1, ::2], 2.0, "multiply"),
                         (np.s_[[1]], -1.0, "divide"), (np.s_[0], -0.0, "set")]:
        want = _np_at(h, idx, np.float32(v), kind).astype(np.float32)
        got = getattr(x.at[idx], kind)(v)
        # on GPU devices any NaN matches any NaN: CUDA's arithmetic gives its canonical NaN,
        # and the update runs over the whole array (a NaN outside the region included)
        assert_same_bits(got, want, on_gpu(got), err_msg=f"{idx} {kind}")
    # a strided read across shards: on GPU devices the gather's collective sums zero-padded
    # blocks, and a NaN + 0 there is CUDA's canonical NaN (README: NaN bits are the backend's)
    r = x[::-1, ::3]
    assert_same_bits(r, h[::-1, ::3], on_gpu(r))


def test_sharded_float32_lookups_never_gather_the_table():
    """table[ids] on a table sharded over its rows: each device gathers the rows it owns and
    an all-reduce completes them; no device ever holds more than its block plus the result."""
    from ctrainstate import _C
    import gc
    mesh = cts.make_mesh((8,), ("x",))
    h = np.random.default_rng(4).standard_normal((1024, 64)).astype(np.float32)
    t = cts.device_put(h, cts.NamedSharding(mesh, cts.P("x")))
    ids = np.array([[5, 1000, 17], [5, 5, 999]])
    gc.collect()
    base = [d.memory_stats()["bytes_in_use"] for d in cts.devices()]
    _C.reset_peak_memory_stats()
    y = t[ids]
    g = cts.grad(lambda v: cnp.sum(v[ids]))(t)
    v = t.at[ids[0]].set(np.zeros(64, np.float32))
    peak = max(d.memory_stats()["peak_bytes_in_use"] - b for d, b in zip(cts.devices(), base))
    assert peak < h.nbytes // 2, peak  # a few blocks (g, v and its parts) and rows: ~100 KB
    np.testing.assert_array_equal(np.asarray(y), h[ids])
    want = np.zeros_like(h)
    np.add.at(want, ids, 1.0)
    np.testing.assert_array_equal(np.asarray(g), want)
    assert g.sharding == t.sharding and v.sharding == t.sharding
    np.testing.assert_array_equal(np.asarray(v)[[5, 1000, 17]], 0.0)


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.bool_, np.float16, "bfloat16"])
def test_other_dtypes(dtype):
    from ctrainstate._src.base import dtypes as _dtypes
    dt = _dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    h = (np.arange(8 * 4 * 6).reshape(SHAPE) % 7).astype(dt)
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    x = cts.device_put(h, cts.NamedSharding(mesh, cts.P("data", "model")))
    # rows of 6, 3 or 1 elements: whole 4-byte words or not (the host path for 2- and 1-byte)
    for idx in [np.s_[::2], np.s_[:, ::-1], np.s_[[1, 1, 0]], np.s_[..., [5, 0]], np.s_[MASK84],
                np.s_[:, :, 1::2], np.s_[[2, 3], :, [0, 1]]]:
        y = x[idx]
        assert y.dtype == dt
        np.testing.assert_array_equal(np.asarray(y), h[idx], err_msg=str(idx))
    m = cts.device_put(MASK8)  # a bool Array as the mask
    np.testing.assert_array_equal(np.asarray(x[m]), h[MASK8])


def test_index_arrays_of_every_kind():
    h = np.arange(40, dtype=np.float32).reshape(8, 5)
    mesh = cts.make_mesh((8,), ("x",))
    x = cts.device_put(h, cts.NamedSharding(mesh, cts.P("x")))
    for i in [np.array([3, 1]), [3, 1], cts.device_put(np.array([3, 1], np.int32)),
              cts.device_put(np.array([3, 1], np.int32), cts.NamedSharding(mesh, cts.P())),
              np.array([3, 1], np.uint32), np.array([3, 1], np.int8)]:
        np.testing.assert_array_equal(np.asarray(x[i]), h[[3, 1]])
    assert np.asarray(x[np.int64(2), np.array(3)]) == h[2, 3]  # 0-d arrays act as ints
    mask = h[:, 0] > 10
    np.testing.assert_array_equal(np.asarray(x[cts.device_put(mask)]), h[mask])


def test_eval_shape():
    s = cts.ShapeDtypeStruct(SHAPE, np.float32)
    ids = cts.ShapeDtypeStruct((2, 3), np.int32)
    out = cts.eval_shape(lambda v, i: (v[::2], v[:, ::-1, 1], v[i], v[:, [0], ..., [1]],
                                       v[MASK8], v[:, i, 0], v.at[i].add(1.0), v.at[::3].set(0.0)),
                         s, ids)
    assert [o.shape for o in out] == [(4, 4, 6), (8, 4), (2, 3, 4, 6), (1, 8), (4, 4, 6),
                                      (8, 2, 3), SHAPE, SHAPE]
    with pytest.raises(IndexError, match="needs a concrete mask"):  # jax: NonConcreteBooleanIndexError
        cts.eval_shape(lambda v, m: v[m], s, cts.ShapeDtypeStruct((8,), np.bool_))
    with pytest.raises(IndexError, match="needs a concrete mask"):
        cts.eval_shape(lambda v, m: v.at[m].set(0.0), s, cts.device_put(MASK8))


def test_errors():
    x = cts.device_put(np.zeros((4, 5), np.float32))
    with pytest.raises(TypeError, match="integer or boolean dtype, got an indexer of dtype float64"):
        x[np.array([1.0])]
    with pytest.raises(TypeError, match="integer or boolean dtype"):
        x[cts.device_put(np.array([1.0], np.float32))]
    with pytest.raises(TypeError, match="must be ints, slices, None, ..., or integer or boolean"):
        x["a"]
    with pytest.raises(TypeError, match="ragged"):
        x[[[0, 1], [2]]]
    with pytest.raises(IndexError, match="boolean index did not match shape of indexed array in "
                                         "index 0: got \\(3,\\), expected \\(4,\\)"):
        x[np.ones(3, bool)]
    with pytest.raises(IndexError, match="shape mismatch: indexing arrays could not be broadcast "
                                         "together with shapes \\(2,\\) \\(3,\\)"):
        x[[0, 1], [0, 1, 2]]
    with pytest.raises(IndexError, match="too many indices for an array of rank 2: 3 were given"):
        x[[0], 1, ::2]
    with pytest.raises(IndexError, match="too many indices for an array of rank 2: 3 were given"):
        x[np.ones((4, 5), bool), 0]
    with pytest.raises(IndexError, match="index 9 is out of bounds for axis 1 with size 5"):
        x[[0, 1], 9]  # a Python int out of range is an error (jax clamps it), arrays or not
    with pytest.raises(IndexError, match="single ellipsis"):
        x[..., [0], ...]
    with pytest.raises(ValueError, match="slice step cannot be zero"):
        x[::0]
    with pytest.raises(IndexError, match="into dimension 0 of size 0"):
        cts.device_put(np.zeros((0, 3), np.float32))[[0]]
    with pytest.raises(ValueError, match="does not broadcast to the indexed shape \\(2, 5\\)"):
        x.at[[0, 1]].set(np.ones(3, np.float32))
    with pytest.raises(TypeError, match="compute in float32"):
        cts.device_put(np.zeros(4, np.int32)).at[::2].set(1)


@pytest.mark.parametrize("dt", [ml_dtypes.bfloat16, np.float16, np.int32, np.uint32],
                         ids=lambda d: np.dtype(d).name)
def test_row_gathers_of_other_dtypes_copy_no_more_than_the_gathered_block(dt):
    """Rows of whole 4-byte words move by the row gather as words, reading the gathered
    block and writing the output block in place: a stepped slice of a dimension sharded over
    'a' peaks at the gathered block (a quarter of the array on this mesh) plus the output's
    block (another quarter), not at the whole array as when every block was copied twice."""
    from ctrainstate import _C
    import gc
    mesh = cts.make_mesh((2, 4), ("a", "b"))
    h = (np.arange(256 * 512) % 2039).reshape(256, 512).astype(dt)
    x = cts.device_put(h, cts.NamedSharding(mesh, cts.P("a", "b")))
    full = h.nbytes
    gc.collect()
    base = [d.memory_stats()["bytes_in_use"] for d in cts.devices()]
    _C.reset_peak_memory_stats()
    y = x[::-1]
    peak = max(d.memory_stats()["peak_bytes_in_use"] - b for d, b in zip(cts.devices(), base))
    assert tuple(y.sharding.spec) in ((None, "b"),)
    np.testing.assert_array_equal(np.asarray(y), h[::-1])
    assert peak <= full // 4 + full // 4 + (64 << 10), (peak, full)


def test_at_modes_match_jax():
    """.at[...] took mode= / fill_value= and ignored them. Expected values are jax 0.10's
    (the same calls, run on its CPU)."""
    a = cts.device_put(np.arange(5, dtype=np.float32))
    A = np.array
    g = lambda r: np.asarray(r).tolist()   # noqa: E731
    assert g(a.at[A([1, 7])].get(mode="fill", fill_value=-1.0)) == [1.0, -1.0]
    r = g(a.at[A([1, 7, -7, -2])].get(mode="fill"))
    assert r[0] == 1.0 and np.isnan(r[1]) and np.isnan(r[2]) and r[3] == 3.0
    assert g(a.at[7].get(mode="fill", fill_value=3.0)) == 3.0
    assert g(a.at[A([1, 7])].get(mode="clip")) == [1.0, 4.0]
    assert g(a.at[A([1, 7])].get(fill_value=2.0)) == [1.0, 4.0]     # default mode clamps
    assert g(a.at[A([1, 7])].set(9.0, mode="clip")) == [0, 9, 2, 3, 9]
    assert g(a.at[A([1, -7])].set(9.0, mode="clip")) == [9, 9, 2, 3, 4]
    assert g(a.at[7].set(9.0, mode="clip")) == [0, 1, 2, 3, 9]
    assert g(a.at[A([1, 7])].add(1.0, mode="drop")) == [0, 2, 2, 3, 4]
    assert g(a.at[A([1, 7])].add(1.0)) == [0, 2, 2, 3, 4]
    b = cts.device_put(np.arange(12, dtype=np.float32).reshape(3, 4))
    assert g(b.at[A([0, 5]), 1].get(mode="fill", fill_value=0)) == [1.0, 0.0]
    assert g(b.at[1, A([0, 9])].set(-1.0, mode="clip")) == [[0, 1, 2, 3], [-1, 5, 6, -1],
                                                            [8, 9, 10, 11]]
    i = cts.device_put(np.arange(5, dtype=np.int32))
    assert g(i.at[A([1, 7])].get(mode="fill")) == [1, -2 ** 31]
    with pytest.raises(ValueError, match='Unknown gather mode "foo"'):
        a.at[1].get(mode="foo")
    with pytest.raises(ValueError, match='Unknown scatter mode "bar"'):
        a.at[1].set(2.0, mode="bar")
    with pytest.raises(TypeError):
        a.at[1].get(foo=1)


def test_at_modes_with_python_int_indices_and_clip_gradient():
    """Explicit modes apply to Python-int indices too (jax: clip clamps, drop writes
    nothing), and get(mode='clip')'s gradient goes to the clamped positions (jax's values:
    [2, 0, 0, 3] for indices [0, 7, 3, -9, 3]); the default x[idx] keeps jax's [1, 0, 0, 2]."""
    x = cnp.asarray(np.arange(12.0, dtype=np.float32).reshape(3, 4))
    np.testing.assert_array_equal(np.asarray(x.at[5].get(mode="clip")), [8, 9, 10, 11])
    np.testing.assert_array_equal(np.asarray(x.at[3, 9].set(100.0, mode="drop")), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(x.at[3, 9].set(100.0, mode="clip"))[2, 3], 100.0)
    with pytest.raises(IndexError):
        x.at[3, 9].set(100.0)   # the default: a static index out of range is an error here
    i = np.array([0, 7, 3, -9, 3])
    v = cnp.asarray(np.arange(4.0, dtype=np.float32))
    g = cts.grad(lambda t: cnp.sum(t.at[i].get(mode="clip")))(v)
    np.testing.assert_array_equal(np.asarray(g), [2, 0, 0, 3])
    g = cts.grad(lambda t: cnp.sum(t[i]))(v)
    np.testing.assert_array_equal(np.asarray(g), [1, 0, 0, 2])
