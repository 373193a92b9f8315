"""Slice steps other than 1, integer-array and boolean-mask indexing on sharded Arrays:
``x[idx]`` and ``x.at[idx].set/add/multiply/divide/get`` equal numpy's (and jax's: recorded,
checked live in the parity twins) on meshes (1,), (8,) and (2, 4); the result's dimensions go
where numpy puts them; dimensions taken whole keep their mesh axes; gradients are scatter-adds of
the cotangent (checked against np.add.at and jax.grad); out-of-range index entries are clamped in
reads and dropped in updates and cotangents, as jax; any dtype; eval_shape; clear errors."""
import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from conftest import assert_same_bits, on_gpu, without_host_copies

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


def test_jax_parity_getitem_and_gradients(jax_ref):
    rng = np.random.default_rng(1)
    h = rng.standard_normal(SHAPE).astype(np.float32)
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    x = cts.device_put(h, cts.NamedSharding(mesh, cts.P("data", "model")))
    # out of range entries: jax clamps reads and drops their cotangents ("promise_in_bounds")
    cases = [np.s_[5:1:-2], np.s_[[1, 2], :, [[0], [5]]], np.s_[:, [0], ..., [1]],
             np.s_[None, [1, 3], None, 1:3], np.s_[:, MASK84[0], ::2], np.s_[False, 1],
             np.s_[np.array([0, 9, -1, -12])], np.s_[:, np.array([[5, -6]]), 7:0:-3],
             np.s_[np.array([2**31 - 1, -2**31]), 1]]
    for i, idx in enumerate(cases):
        shape = jax_ref(f"{i}/shape", lambda jax: tuple(jax.eval_shape(lambda v: v[idx], h).shape))
        w = rng.standard_normal(shape).astype(np.float32)
        # jax's read and gradient in one program (one XLA compile, most of the live twin's time)
        want, gj = jax_ref(i, lambda jax, jnp: jax.jit(
            lambda v: (v[idx], jax.grad(lambda u: jnp.sum(u[idx] * w))(v)))(jnp.asarray(h)))
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


def _clamped(h, entries):
    """numpy's ``h[entries]`` under jax's gather rules: array entries wrapped, then clamped;
    also the mask of the entries in range (broadcast), for the cotangents."""
    idx, ok = [], True
    for d, i in enumerate(entries):
        n = h.shape[d]
        if isinstance(i, int):
            idx.append(i)
            continue
        w = np.where(i < 0, i + n, i).astype(np.int64)
        ok = ok & (w >= 0) & (w < n)
        idx.append(np.clip(w, 0, n - 1))
    return h[tuple(idx)], tuple(idx), ok


@pytest.mark.parametrize("mesh_shape", [None, (2, 4)])
def test_integer_array_indices_of_an_array_whole_on_each_device_are_read_there(monkeypatch,
                                                                              mesh_shape):
    """``x[i]``, ``x[i, 2]``, ``x[-1, j]``, broadcasting index Arrays, a 0-d one and one per
    dimension, for an Array that every device holds whole (one device; replicated on a 2x4
    mesh) and integer Arrays (int32, int8, uint16) on the same devices: the row numbers are
    computed and the rows read on the devices -- no block is copied to or from the host --
    for every stored dtype; negative entries wrap and out-of-range ones are clamped (jax's
    gather); the result is placed as ``x``; the gradient adds the cotangent at the entries
    in range, as numpy's add.at."""
    sh = None if mesh_shape is None else cts.NamedSharding(cts.make_mesh(mesh_shape, ("a", "b")),
                                                           cts.P())
    rng = np.random.default_rng(5)
    shape = (6, 5, 4)
    ih = {"i": rng.integers(-8, 9, (7,)).astype(np.int32),
          "j": rng.integers(-5, 5, (3, 1)).astype(np.int8),
          "k": rng.integers(0, 7, (1, 4)).astype(np.uint16),
          "z": np.array(-2, np.int32)}
    ia = {k: cts.device_put(v, sh) for k, v in ih.items()}
    keys = [("i",), ("i", 2), (-1, "j"), ("j", "k"), ("z",), ("i", "i", "i"), ("j", 0, "k")]

    def index(entries, src):
        return tuple(src[e] if isinstance(e, str) else e for e in entries)
    hs = {dt: (rng.standard_normal(shape) * 4).astype(dt) for dt in
          (np.float32, ml_dtypes.bfloat16, np.float16, np.int32)}
    hs.update({np.uint8: rng.integers(0, 256, shape).astype(np.uint8),
               np.bool_: rng.random(shape) > 0.5})
    xs = {dt: cts.device_put(h, sh) for dt, h in hs.items()}

    def run():
        return {(dt, e): x[index(e, ia)] for dt, x in xs.items() for e in keys}
    got = without_host_copies(monkeypatch, run)
    for (dt, e), y in got.items():
        want, _, _ = _clamped(hs[dt], index(e, ih))
        assert_same_bits(y, want, on_gpu(y), f"{np.dtype(dt)} {e}")
        assert y.sharding == xs[dt].sharding, (dt, e)
    for e in keys:
        x, h = xs[np.float32], hs[np.float32]
        _, idx, ok = _clamped(h, index(e, ih))
        c = rng.standard_normal(np.broadcast(*idx).shape + h.shape[len(e):]).astype(np.float32)
        g = cts.grad(lambda v: cnp.sum(v[index(e, ia)] * cts.device_put(c, sh)))(x)
        okb = np.broadcast_to(np.reshape(ok, np.shape(ok) + (1,) * (h.ndim - len(e))), c.shape)
        want = np.zeros_like(h)
        np.add.at(want, idx, np.where(okb, c, 0.0))
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-6, atol=1e-6, err_msg=str(e))


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


def test_at_updates_match_jax(jax_ref):
    rng = np.random.default_rng(3)
    h = rng.standard_normal(SHAPE).astype(np.float32)
    mesh = cts.make_mesh((8,), ("x",))
    x = cts.device_put(h, cts.NamedSharding(mesh, cts.P("x")))
    w = rng.standard_normal(SHAPE).astype(np.float32)
    for i, idx in enumerate([AT_CASES[0], AT_CASES[2], np.s_[np.array([9, -9, 2, 2]), ::2]]):
        jdx = np.asarray(idx) if isinstance(idx, list) else idx  # jax refuses a bare list
        shape = jax_ref(f"{i}/shape", lambda jax: tuple(jax.eval_shape(lambda a: a[jdx], h).shape))
        v = (rng.standard_normal(shape) + 3.0).astype(np.float32)
        kinds = ("set", "add", "multiply", "divide")
        grad_kinds = ("set", "add")  # jax differentiates scatter_mul only for unique indices

        def upd(a, b, kind):
            return a.at[jdx].set(b) if kind == "set" else a.at[jdx].add(b)

        def theirs(jax, jnp):
            def jax_side(a, b):
                # every update and gradient of this index in one jax program (one XLA compile)
                outs = [getattr(a.at[jdx], kind)(b) for kind in kinds]
                grads = [jax.grad(lambda a_, b_, k=kind: jnp.sum(upd(a_, b_, k) * w),
                                  argnums=(0, 1))(a, b) for kind in grad_kinds]
                return outs, grads
            return jax.jit(jax_side)(jnp.asarray(h), v)

        wants, jgrads = jax_ref(i, theirs)
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


# --- x.at[...] updates of integer Arrays (found probing ctrainstate.numpy against jax)

def _mesh_sharding(spec):
    return cts.NamedSharding(cts.make_mesh((2, 4), ("data", "model")), cts.P(*spec))


def _shift_tokens_right(ids, np_, start=7, pad=0):
    s = np_.zeros_like(ids)
    s = s.at[:, 1:].set(ids[:, :-1])
    s = s.at[:, 0].set(start)
    return np_.where(s == -100, pad, s)


@pytest.mark.parametrize("spec", [None, ("data", "model")])
def test_int_at_updates_cast_like_jax(spec):
    x = np.arange(-12, 20, dtype=np.int32).reshape(4, 8)
    a = cts.device_put(x) if spec is None else cts.device_put(x, _mesh_sharding(spec))
    # numpy references: set casts the value (2.7 -> 2); arithmetic runs in float32 for a
    # float value, then truncates back to int32 (as jax's scatter on the promoted values)
    ref = x.copy(); ref[0] = 2
    np.testing.assert_array_equal(np.asarray(a.at[0].set(2.7)), ref)
    ref = x.copy(); ref[:, 1:] += 3
    np.testing.assert_array_equal(np.asarray(a.at[:, 1:].add(3)), ref)
    ref = x.copy(); ref[1] = (ref[1] + np.float32(2.7)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(a.at[1].add(2.7)), ref)
    ref = x.copy(); ref[..., -1] = np.minimum(ref[..., -1], 0)
    np.testing.assert_array_equal(np.asarray(a.at[..., -1].min(0)), ref)
    ref = x.copy(); ref[2, 3] *= -2
    np.testing.assert_array_equal(np.asarray(a.at[2, 3].multiply(-2)), ref)
    ref = x.copy(); ref[:, 0] = np.arange(4)
    np.testing.assert_array_equal(np.asarray(a.at[:, 0].set(np.arange(4, dtype=np.int32))), ref)
    b = cts.device_put(x > 0)
    ref = x > 0; ref[1:3] = True
    got = b.at[1:3].set(True)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(np.asarray(got), ref)
    assert np.asarray(a).tolist() == x.tolist()      # functional: x unchanged
    with pytest.raises(TypeError, match="astype"):
        a.at[np.array([0, 2])].set(1)                 # advanced index: not here
    with pytest.raises(TypeError, match="astype"):
        b.at[0].add(True)


@pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types:FutureWarning")
def test_int_at_updates_parity(jax_ref):
    rng = np.random.default_rng(5)
    for x in (rng.integers(-5, 5, (4, 8)).astype(np.int32), rng.integers(0, 9, (4, 8)).astype(np.uint32)):
        for i, idx in enumerate([(0,), (slice(None), 0), (slice(None), slice(1, None)),
                                 (Ellipsis, -1), (1, 2)]):
            for meth in ("set", "add", "subtract", "multiply", "min", "max"):
                for j, v in enumerate((3, 2.7, np.int32(2))):
                    want = jax_ref(f"{x.dtype}/{i}/{meth}/{j}",
                                   lambda jnp: getattr(jnp.asarray(x).at[idx], meth)(v))
                    got = getattr(cts.device_put(x).at[idx], meth)(v)
                    assert got.dtype == want.dtype
                    np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                                  err_msg=f"{x.dtype} {idx} {meth} {v}")
    ids = rng.integers(-100, 50, (4, 8)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(_shift_tokens_right(cts.device_put(ids), cnp)),
                                  jax_ref("shift_tokens_right",
                                          lambda jnp: _shift_tokens_right(jnp.asarray(ids), jnp)))


# --- x.at[idx].<op>() of every op (set, add, multiply, divide, power, min, max, apply, get): values
# against numpy one index entry at a time and jax (recorded; live twins marked `parity`), 16-bit
# dtypes, eval_shape, gradients against jax and finite differences

BF16 = np.dtype(ml_dtypes.bfloat16)


_RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _own_rng(twin_seed):
    """Each test draws its inputs from a stream of its own: the same in its recorded and live
    twins (jax's side is recorded for those inputs), whichever tests ran before."""
    global _RNG
    _RNG = np.random.default_rng(twin_seed)


def _fd_tree(f, x, h=1e-2):
    out = np.zeros(x.shape)
    for i in np.ndindex(x.shape):
        e = np.zeros(x.shape, np.float32)
        e[i] = h
        out[i] = (float(np.asarray(f(x + e))) - float(np.asarray(f(x - e)))) / (2 * h)
    return out


def _np_at_more_ops(x, idx, kind, v, fn=None):
    """Independent reference: numpy, one index entry at a time in index order; negative
    entries wrap, out-of-range ones are dropped (jax's default update mode)."""
    out = x.astype(np.float64).copy()
    pos = np.arange(x.shape[0])
    idx = np.asarray(idx)
    vv = np.broadcast_to(np.asarray(v, np.float64), idx.shape + x.shape[1:])
    for k, i in enumerate(idx):
        if not -x.shape[0] <= i < x.shape[0]:
            continue
        r = pos[i]
        cur = out[r]
        val = vv[k]
        out[r] = {"subtract": lambda: cur - val, "min": lambda: np.minimum(cur, val),
                  "max": lambda: np.maximum(cur, val), "power": lambda: cur ** val,
                  "mul": lambda: cur * val, "apply": lambda: fn(cur)}[kind]()
    return out


_AT_INDICES = {"repeated": [1, 1, 3], "negative": [-1, 0, -4], "out_of_range": [2, 7, -9, 2],
               "mixed": [3, -1, 1, 3, 0, 5]}


@pytest.mark.parametrize("kind", ["subtract", "min", "max", "power", "mul", "apply"])
@pytest.mark.parametrize("which", sorted(_AT_INDICES))
def test_at_updates_match_numpy_and_jax(kind, which, jax_ref):
    # small integers and halves: every intermediate is exact, so the order of rounding cannot
    # hide a wrong semantics, and the numpy reference is exact
    x = np.array([[1.0, 2.0], [3.0, -2.0], [0.5, 4.0], [2.0, 1.5]], np.float32)
    idx = np.array(_AT_INDICES[which])
    v = np.array([[2.0, -1.0], [0.5, 3.0], [-2.5, 2.0], [1.0, 1.0], [3.0, 0.5], [2.0, 2.0]],
                 np.float32)[:len(idx)]
    if kind == "power":
        v = np.abs(np.round(v))      # integer exponents: exact powers of the small values
    fn_c, fn_n = (lambda t: t * 2.0 + 1.0), (lambda t: t * 2.0 + 1.0)
    X = cts.device_put(x)
    if kind == "apply":
        got = np.asarray(X.at[idx].apply(fn_c))
    else:
        got = np.asarray(getattr(X.at[idx], kind)(v))
    want = _np_at_more_ops(x, idx, kind, v, fn_n)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    def theirs(jax):
        J = jax.numpy.asarray(x).at[jax.numpy.asarray(idx)]
        return J.apply(fn_n) if kind == "apply" else getattr(J, kind)(v)

    np.testing.assert_array_equal(got, jax_ref("values", theirs))


def test_at_updates_with_slices_and_scalars():
    x = _RNG.standard_normal((4, 5)).astype(np.float32)
    X = cts.device_put(x)
    np.testing.assert_array_equal(np.asarray(X.at[1:3, ::2].subtract(1.5)),
                                  _slice_ref(x, (slice(1, 3), slice(None, None, 2)), lambda t: t - np.float32(1.5)))
    np.testing.assert_array_equal(np.asarray(X.at[:, 1].min(0.0)),
                                  _slice_ref(x, (slice(None), 1), lambda t: np.minimum(t, 0)))
    np.testing.assert_array_equal(np.asarray(X.at[2].max(0.25)),
                                  _slice_ref(x, 2, lambda t: np.maximum(t, np.float32(0.25))))
    np.testing.assert_array_equal(np.asarray(X.at[0, :3].power(2.0)),
                                  _slice_ref(x, (0, slice(0, 3)), lambda t: t * t))
    got = np.asarray(X.at[1:, 2:].apply(cnp.floor))
    np.testing.assert_array_equal(got, _slice_ref(x, (slice(1, None), slice(2, None)), np.floor))
    with pytest.raises(ValueError, match="must be elementwise"):
        X.at[1].apply(lambda t: cnp.sum(t))


def _slice_ref(x, idx, f):
    out = x.copy()
    out[idx] = f(out[idx])
    return out


def test_at_16_bit_and_eval_shape():
    x = np.array([3.0, 1.125, 2.0, 0.5], BF16)
    X = cts.device_put(x)
    idx = np.array([0, 1, 1])
    v = np.array([2.5, 3.0, 0.5], np.float32)
    got = X.at[idx].power(v)
    assert got.dtype == BF16
    ref = x.astype(np.float64)
    vb = v.astype(BF16).astype(np.float64)
    ref[0] = ref[0] ** vb[0]
    ref[1] = (ref[1] ** vb[1]) ** vb[2]     # the float32 widening, rounded once at the end
    np.testing.assert_array_equal(np.asarray(got).astype(np.float32),
                                  ref.astype(np.float32).astype(BF16).astype(np.float32))
    a = X.at[idx].apply(lambda t: t * 3.0)
    assert a.dtype == BF16
    s = cts.eval_shape(lambda a: a.at[np.array([0, 0])].max(1.0), cts.ShapeDtypeStruct((4,), np.float32))
    assert s.shape == (4,)


@pytest.mark.parametrize("kind", ["subtract", "min", "max", "power", "mul"])
def test_at_gradients_match_jax(kind, jax_ref):
    """Gradients to x and to the values; jax gives power / mul gradients only for unique
    indices (NotImplementedError otherwise), so those are compared with unique indices and,
    with duplicates, against finite differences."""
    x = np.array([1.5, 2.0, 3.0, 4.0, 0.75], np.float32)
    w = np.array([1.0, 2.0, 3.0, 4.0, 5.0], np.float32)
    dup = np.array([1, 1, -1, 0, 9])             # a duplicate, a negative, one out of range
    uniq = np.array([1, -1, 0])
    vals = {"subtract": [0.5, 0.25, 1.0, 1.0, 7.0], "min": [1.0, 0.5, 4.0, 2.0, 0.0],
            "max": [3.0, 5.0, 4.0, 0.5, 9.0], "power": [2.0, 1.5, 0.5, 3.0, 2.0],
            "mul": [3.0, 0.5, 2.0, 1.5, 4.0]}
    vd = np.array(vals[kind], np.float32)

    def ours(idx, v):
        return [np.asarray(t) for t in cts.grad(
            lambda a, b: cnp.sum(getattr(a.at[idx], kind)(b) * w), (0, 1))(x, v)]

    g_dup = ours(dup, vd)
    # finite differences of our own function (both x and the values)
    fx = _fd_tree(lambda a: cnp.sum(getattr(cts.device_put(a).at[dup], kind)(vd) * w), x, 1e-3)
    fv = _fd_tree(lambda b: cnp.sum(getattr(cts.device_put(x).at[dup], kind)(b) * w), vd, 1e-3)
    if kind not in ("min", "max"):   # (kinks at the ties of min/max)
        np.testing.assert_allclose(g_dup[0], fx, rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(g_dup[1], fv, rtol=2e-2, atol=2e-2)
    assert g_dup[1][4] == 0.0        # the out-of-range entry gets no gradient

    def theirs(jax, idx, v, unique):
        jnp = jax.numpy
        return [np.asarray(t) for t in jax.grad(
            lambda a, b: (getattr(a.at[jnp.asarray(idx)], kind)(b, unique_indices=unique) * w).sum(),
            (0, 1))(x, v)]

    for idx, v, u in ((uniq, vd[:3], True),) + (((dup, vd, False),) if kind in ("subtract", "min", "max") else ()):
        for a, b in zip(ours(idx, v), jax_ref(f"unique={u}", lambda jax: theirs(jax, idx, v, u))):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_at_min_max_ties_split_like_jax():
    """A tie between x and one value splits the cotangent 0.5 / 0.5 (jax's rule, measured);
    with duplicates the order of the values does not change the result."""
    x = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    idx = np.array([0, 0, 1, -1])
    v = np.array([1.0, 0.5, 5.0, 4.0], np.float32)
    w = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    gx, gv = (np.asarray(t) for t in cts.grad(
        lambda a, b: cnp.sum(a.at[idx].min(b) * w), (0, 1))(x, v))
    assert gx.tolist() == [0.0, 2.0, 3.0, 2.0] and gv.tolist() == [0.0, 1.0, 0.0, 2.0]
    gx, gv = (np.asarray(t) for t in cts.grad(
        lambda a, b: cnp.sum(a.at[idx].max(b) * w), (0, 1))(x, v))
    assert gx.tolist() == [0.5, 0.0, 3.0, 2.0] and gv.tolist() == [0.5, 0.0, 2.0, 2.0]
    X = cts.device_put(x)
    perm = np.array([3, 2, 1, 0])
    for kind in ("min", "max"):
        a = np.asarray(getattr(X.at[idx], kind)(v))
        b = np.asarray(getattr(X.at[idx[perm]], kind)(v[perm]))
        assert a.tobytes() == b.tobytes()


def test_at_apply_gradient_against_finite_differences():
    """jax has no gradient for .at[].apply (scatter_apply JVP not implemented); ours goes
    through fn once per occurrence: d/dx sin(sin(x)) for a repeated index."""
    x = np.array([0.3, 1.1, -0.7, 2.0], np.float32)
    idx = np.array([1, 1, 3, 8])
    g = np.asarray(cts.grad(lambda a: cnp.sum(a.at[idx].apply(cnp.sin)))(x))
    x64 = x.astype(np.float64)
    want = np.array([1.0, np.cos(np.sin(x64[1])) * np.cos(x64[1]), 1.0, np.cos(x64[3])])
    np.testing.assert_allclose(g, want, rtol=1e-6)
    fd = _fd_tree(lambda a: cnp.sum(cts.device_put(a).at[idx].apply(cnp.sin)), x, 1e-3)
    np.testing.assert_allclose(g, fd, rtol=1e-2, atol=1e-3)
