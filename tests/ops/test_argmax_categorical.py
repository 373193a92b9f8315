"""argmax / argmin (jnp semantics, sharded reductions) and the samplers built on them:
random.gumbel, random.categorical, random.choice. Expected values come from numpy (whose
argmax has jnp's first-index and first-NaN rules) and, where jax is installed, from jax
itself: the samplers must return jax.random's exact values for the same keys."""
import numpy as np
import ml_dtypes
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import _C
from ctrainstate._src.ops import ops as _ops
from ctrainstate import random as R
from ctrainstate._src.random import core as _random_core
from recorded import bits_digest

NAN, INF = np.nan, np.inf
MESHES = [((8,), ("x",)), ((2, 4), ("data", "model")), ((4, 2), ("data", "model"))]
# Sampler math finished on the host (numpy and the C core's XLA log): the same on any backend,
# so runs with GPU devices as the default backend leave it to the CPU run.
host_only = pytest.mark.skipif(cts.devices()[0].platform != "cpu",
                               reason="host-side math, covered by the CPU run")


def _tied(rng, shape):
    """Small integers (many ties) with NaNs, infinities and signed zeros sprinkled in."""
    x = np.round(rng.standard_normal(shape) * 1.5).astype(np.float32)
    if x.size:
        flat = x.reshape(-1)
        for v in (NAN, INF, -INF, -0.0, NAN):
            if rng.random() < 0.5:
                flat[rng.integers(flat.size)] = v
    return x


def _axes_of(ndim):
    return [None] + list(range(ndim)) + list(range(-ndim, 0))


# --- argmax / argmin ------------------------------------------------------------------------

SHAPES = [(), (1,), (5,), (1, 1), (7, 13), (3, 1, 4), (2, 3, 5), (1, 9), (6, 1), (4, 0, 3)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_numpy_and_jax(shape, jax_ref):
    rng = np.random.default_rng(abs(hash(shape)) % 2**32)
    for trial in range(3):
        x = _tied(rng, shape)
        xa = cts.device_put(x)
        for axis in _axes_of(len(shape)):
            if x.size == 0 and (axis is None or x.shape[axis] == 0):
                continue
            for keepdims in (False, True):
                for name in ("argmax", "argmin"):
                    want = getattr(np, name)(x, axis=axis, keepdims=keepdims)
                    for arg in (xa, x):  # an Array, and a numpy array placed by the op
                        got = getattr(cnp, name)(arg, axis=axis, keepdims=keepdims)
                        assert isinstance(got, cts.Array) and got.dtype == np.int32
                        assert got.shape == want.shape, (name, axis, keepdims)
                        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{name} {axis} {x}")
                    np.testing.assert_array_equal(np.asarray(got), jax_ref(
                        f"{trial}/{axis}/{keepdims}/{name}",
                        lambda jax: getattr(jax.numpy, name)(x, axis=axis, keepdims=keepdims)))


def test_nan_infinities_and_ties():
    x = np.array([[1.0, 7.0, 7.0, -INF],
                  [NAN, 2.0, NAN, INF],
                  [-INF, -INF, -INF, -INF],
                  [INF, INF, 3.0, NAN],
                  [-0.0, 0.0, -0.0, 0.0]], np.float32)
    xa = cts.device_put(x)
    # the first of the tied extremes; any NaN in a row wins, the first one
    assert np.asarray(cnp.argmax(xa, axis=1)).tolist() == [1, 0, 0, 3, 0]
    assert np.asarray(cnp.argmin(xa, axis=1)).tolist() == [3, 0, 0, 3, 0]
    assert np.asarray(cnp.argmax(xa, axis=0)).tolist() == [1, 3, 1, 3]
    assert np.asarray(cnp.argmin(xa, axis=0)).tolist() == [1, 2, 1, 3]
    for name in ("argmax", "argmin"):
        for axis in (None, 0, 1):
            np.testing.assert_array_equal(np.asarray(getattr(cnp, name)(xa, axis)),
                                          getattr(np, name)(x, axis))
    assert int(cnp.argmax(xa)) == 4 and int(cnp.argmin(xa)) == 4      # the flat index of the first NaN
    assert int(cnp.argmax(x[[0, 2, 4]])) == 1 and int(cnp.argmin(x[[0, 2, 4]])) == 3


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_sharded_reductions_equal_one_device(mesh_shape, names, jax_ref):
    mesh = cts.make_mesh(mesh_shape, names)
    rng = np.random.default_rng(len(names) * 10 + mesh_shape[0])
    x = _tied(rng, (8, 16))
    x[5, [3, 11]] = NAN                      # NaNs in two shards of a row sharded on its columns
    x[2, :] = 4.0                            # a row that is all ties
    specs = [cts.P(), cts.P(names[0]), cts.P(None, names[-1]), cts.P(*names)]
    if len(names) == 2:
        specs += [cts.P(names[1], names[0]), cts.P(None, (names[0], names[1]))]
    for spec in specs:
        xs = cts.device_put(x, cts.NamedSharding(mesh, spec))
        for axis in (None, 0, 1, -1):
            for name in ("argmax", "argmin"):
                got = getattr(cnp, name)(xs, axis=axis)
                want = getattr(np, name)(x, axis=axis)
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{spec} {axis} {name}")
                one = getattr(cnp, name)(cts.device_put(x), axis=axis)
                np.testing.assert_array_equal(np.asarray(got), np.asarray(one))
                np.testing.assert_array_equal(np.asarray(got), jax_ref(
                    f"{spec}/{axis}/{name}", lambda jax: getattr(jax.numpy, name)(x, axis=axis)))
                if axis is not None:  # the kept dimension keeps its sharding
                    kept = 1 - (axis % 2)
                    assert got.sharding.is_equivalent_to(
                        cts.NamedSharding(mesh, cts.P(spec[kept] if len(spec) > kept else None)), 1)
                    gk = getattr(cnp, name)(xs, axis=axis, keepdims=True)
                    np.testing.assert_array_equal(np.asarray(gk), np.expand_dims(want, axis))


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_three_dims_sharded_over_the_reduced_dims(mesh_shape, names):
    mesh = cts.make_mesh(mesh_shape, names)
    rng = np.random.default_rng(7)
    x = _tied(rng, (4, 8, 6))
    spec = cts.P(None, names) if len(names) == 1 else cts.P(names[1], names[0])
    xs = cts.device_put(x, cts.NamedSharding(mesh, spec))
    for axis in (None, 0, 1, 2):
        np.testing.assert_array_equal(np.asarray(cnp.argmax(xs, axis)), np.argmax(x, axis))
        np.testing.assert_array_equal(np.asarray(cnp.argmin(xs, axis)), np.argmin(x, axis))


@pytest.mark.parametrize("mesh_shape,names", [((1,), ("x",))] + MESHES)
def test_indices_past_2_24_use_two_digits(monkeypatch, mesh_shape, names):
    # the split path with tiny radices (the real one starts past 2**24 positions)
    monkeypatch.setattr(_ops, "_ARG_EXACT", 8)
    monkeypatch.setattr(_ops, "_ARG_BASE", 4)
    mesh = cts.make_mesh(mesh_shape, names)
    rng = np.random.default_rng(3)
    x = np.round(rng.standard_normal((3, 40, 8)), 0).astype(np.float32)
    x[1, 37, :] = NAN
    xs = cts.device_put(x, cts.NamedSharding(mesh, cts.P(None, names[0])))
    for axis in (None, 0, 1, 2):
        for name in ("argmax", "argmin"):
            np.testing.assert_array_equal(np.asarray(getattr(cnp, name)(xs, axis)),
                                          getattr(np, name)(x, axis), err_msg=f"{axis} {name}")


@pytest.mark.skipif(cts.devices()[0].platform != "cpu",
                    reason="a 64 MiB axis is slow on emulated GPUs; the two-digit path runs "
                           "everywhere in test_indices_past_2_24_use_two_digits")
def test_an_axis_longer_than_2_24():
    n = (1 << 24) + 8
    x = np.zeros(n, np.float32)
    x[[7, (1 << 24) + 1, (1 << 24) + 3]] = [0.5, 1.0, 1.0]  # float32 cannot hold 2**24 + 1
    assert int(cnp.argmax(x)) == (1 << 24) + 1
    assert int(cnp.argmin(-x)) == (1 << 24) + 1


def test_integer_bool_and_half_inputs(jax_ref):
    i32 = np.array([5, 2**31 - 1, -2**31, 2**31 - 2, 2**31 - 1, 2**24 + 1, 2**24], np.int32)
    u32 = np.array([2**32 - 2, 2**32 - 1, 0, 2**32 - 1, 2**24, 2**24 + 1], np.uint32)
    big = np.array([2**30 + 1, 2**30, 2**30 + 1, -(2**30) - 1, -(2**30)], np.int32)  # equal as float32
    cases = [i32, u32, big, np.array([False, True, True]), np.array([[False], [False]]),
             np.array([1.0, NAN, 3.0], np.float16), np.array([2.0, -1.0, 2.0], ml_dtypes.bfloat16)]
    for i, x in enumerate(cases):
        for name in ("argmax", "argmin"):
            want = getattr(np, name)(x.astype(np.float64) if x.dtype == ml_dtypes.bfloat16 else x)
            for arg in (x, cts.device_put(x)):
                got = getattr(cnp, name)(arg)
                assert got.dtype == np.int32 and int(got) == int(want), (x, name)
            assert int(jax_ref(f"{i}/{name}", lambda jax: getattr(jax.numpy, name)(x))) == int(want)
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(5)
    xi = (rng.integers(-3, 3, (4, 8)) * 2**28 + rng.integers(0, 3, (4, 8))).astype(np.int32)
    xs = cts.device_put(xi, cts.NamedSharding(mesh, cts.P("data", "model")))
    assert xs.dtype == np.int32
    for axis in (None, 0, 1):
        np.testing.assert_array_equal(np.asarray(cnp.argmax(xs, axis)), np.argmax(xi, axis))
        np.testing.assert_array_equal(np.asarray(cnp.argmin(xs, axis)), np.argmin(xi, axis))
    # narrow integer numpy inputs are widened (values kept)
    assert int(cnp.argmax(np.array([3, -7, 100, 100], np.int8))) == 2
    assert int(cnp.argmin(np.array([3, 7, 0, 0], np.uint16))) == 2


@pytest.mark.parametrize("mesh_shape,names", [((1,), ("x",))] + MESHES)
def test_positions_are_found_on_the_devices(monkeypatch, mesh_shape, names):
    """argmax / argmin of float, bool and narrow int Arrays whose reduced dimensions hold at
    most 2**24 positions run on the devices: no block is copied to the host or from it (the
    maxima, the NaN slices and the position's digits stay in kernels), sharded or not, with
    NaNs and ties, keepdims or not; inside value_and_grad they record nothing on the tape."""
    mesh = cts.make_mesh(mesh_shape, names)
    rng = np.random.default_rng(3)
    x = _tied(rng, (8, 16))
    x[5, [3, 11]] = NAN
    x[2, :] = 4.0
    arrays = [cts.device_put(x.astype(dt), cts.NamedSharding(mesh, spec))
              for dt in (np.float32, ml_dtypes.bfloat16)
              for spec in (cts.P(), cts.P(names[0]), cts.P(None, names[-1]))]
    wants = {(np.dtype(dt), axis, name, kd): getattr(np, name)(
                 x.astype(dt).astype(np.float32), axis=axis, keepdims=kd)
             for dt in (np.float32, ml_dtypes.bfloat16) for axis in (None, 0, 1)
             for name in ("argmax", "argmin") for kd in (False, True)}

    def run():
        out = {}
        for k, xs in enumerate(arrays):
            for axis in (None, 0, 1):
                for name in ("argmax", "argmin"):
                    for kd in (False, True):
                        out[(k, axis, name, kd)] = getattr(cnp, name)(xs, axis=axis, keepdims=kd)
            if xs.dtype.kind == "f":
                (_, aux), _ = cts.value_and_grad(loss, has_aux=True)(xs.astype(np.float32))
                out[(k, "grad")] = aux
        return out

    def loss(v):
        nodes = len(_ops._tape().nodes)
        i, j = cnp.argmax(v, axis=1), cnp.argmin(v)
        assert len(_ops._tape().nodes) == nodes     # nothing recorded
        return cnp.sum(v * 1.0), (i, j)

    ints = (np.arange(8 * 16).reshape(8, 16) * 7 % 11).astype(np.int64)
    for dt in (np.bool_, np.int8, np.uint16):
        h = (ints % 2 if dt is np.bool_ else ints - 3 * (dt is np.int8)).astype(dt)
        arrays.append(cts.device_put(h, cts.NamedSharding(mesh, cts.P(None, names[-1]))))
        wants.update({(np.dtype(dt), axis, name, kd): getattr(np, name)(h, axis=axis, keepdims=kd)
                      for axis in (None, 0, 1) for name in ("argmax", "argmin")
                      for kd in (False, True)})
    run()   # (the digits' constants are made at their first use)

    def refuse(*args):
        raise AssertionError("a block went through the host")

    for name in ("copy_to_host", "copy_from_host"):
        monkeypatch.setattr(_C, name, refuse)
    got = run()
    monkeypatch.undo()
    for (k, *rest), out in got.items():
        dt = np.dtype(arrays[k].dtype)
        if rest == ["grad"]:
            np.testing.assert_array_equal(np.asarray(out[0]), wants[(dt, 1, "argmax", False)])
            assert int(out[1]) == wants[(dt, None, "argmin", False)]
            continue
        axis, name, kd = rest
        assert out.dtype == np.int32
        np.testing.assert_array_equal(np.asarray(out), wants[(dt, axis, name, kd)],
                                      err_msg=f"{arrays[k].sharding} {axis} {name} {kd}")


def test_inside_value_and_grad():
    rng = np.random.default_rng(11)
    w = rng.standard_normal((4, 6)).astype(np.float32)
    labels = np.array([1, 0, 5, 2])

    def loss(v):
        y = cnp.tanh(v) * 3.0
        pred = cnp.argmax(y, axis=-1)        # an accuracy metric on a traced value
        idx = cnp.argmin(v)                  # and on the traced input itself
        return cnp.sum(cnp.square(y)), (pred, idx)

    (val, (pred, idx)), g = cts.value_and_grad(loss, has_aux=True)(cts.device_put(w))
    np.testing.assert_array_equal(np.asarray(pred), np.argmax(np.tanh(w), axis=-1))
    assert int(idx) == int(np.argmin(w))
    assert pred.dtype == np.int32
    v2, g2 = cts.value_and_grad(lambda v: cnp.sum(cnp.square(cnp.tanh(v) * 3.0)))(cts.device_put(w))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g2))  # argmax left the trace alone
    assert float(val) == float(v2)
    acc = float(np.mean(np.asarray(pred) == labels))
    assert acc == float(np.mean(np.argmax(np.tanh(w), -1) == labels))


def test_array_methods_and_numpy_dispatch():
    x = cts.device_put(np.array([[3.0, 9.0], [4.0, -1.0]], np.float32))
    assert np.asarray(x.argmax(axis=0)).tolist() == [1, 0]
    assert np.asarray(x.argmin(axis=1, keepdims=True)).tolist() == [[0], [1]]
    assert int(np.argmax(x)) == 1 and int(np.argmin(x)) == 3   # numpy calls the methods
    with pytest.raises(TypeError, match="out="):
        x.argmax(out=np.zeros(2))


def test_errors_and_eval_shape():
    x = cts.device_put(np.zeros((0, 3), np.float32))
    for name in ("argmax", "argmin"):
        fn = getattr(cnp, name)
        with pytest.raises(ValueError, match="empty sequence"):
            fn(x, axis=0)
        with pytest.raises(ValueError, match="empty sequence"):
            fn(x)
        assert np.asarray(fn(x, axis=1)).shape == (0,)        # an empty batch is fine
        for bad in (2, -3):
            with pytest.raises(IndexError):                      # as jnp
                fn(np.zeros((2, 3), np.float32), axis=bad)
            with pytest.raises(ValueError):                      # as numpy (AxisError is both)
                fn(np.zeros((2, 3), np.float32), axis=bad)
        with pytest.raises(IndexError):
            fn(np.float32(1.0), axis=0)
        assert int(fn(np.float32(1.0))) == 0
        with pytest.raises(TypeError, match="axis"):
            fn(np.zeros((2, 3), np.float32), axis=(0, 1))
        with pytest.raises(TypeError):
            fn(np.array(["a", "b"]))
    s = cts.eval_shape(lambda a: cnp.argmax(a, axis=1), cts.ShapeDtypeStruct((3, 4), np.float32))
    assert s.shape == (3,) and s.dtype == np.int32
    s = cts.eval_shape(lambda a: cnp.argmin(a, keepdims=True), cts.ShapeDtypeStruct((3, 4), np.float32))
    assert s.shape == (1, 1) and s.dtype == np.int32
    s = cts.eval_shape(lambda a: a.argmax(axis=-1), cts.ShapeDtypeStruct((2, 5, 7), np.float32))
    assert s.shape == (2, 5)
    with pytest.raises(ValueError, match="empty"):
        cts.eval_shape(lambda a: cnp.argmax(a, axis=0), cts.ShapeDtypeStruct((0, 4), np.float32))


# --- XLA's log on the host ------------------------------------------------------------------

@host_only
def test_xla_math_is_jax_log_bit_for_bit(jax_ref):
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, 200000, dtype=np.uint64).astype(np.uint32)  # every kind of float
    x = np.concatenate([rng.random(20000).astype(np.float32), words.view(np.float32),
                        np.array([0.0, -0.0, 1.0, -1.0, 1e-45, -3e-39, INF, -INF, NAN, 0.5, 2.0],
                                 np.float32)])
    for fn, ref in ((0, "log"), (1, "log1p")):
        arg = x if fn == 0 else np.concatenate([x, x[:20000] - np.float32(0.5)])
        y = arg.copy()
        _C.xla_math(fn, y)
        # jax's bits, recorded as a digest (and every 97th value, for a readable failure)
        want = jax_ref(ref, lambda jax: (lambda o: {"digest": bits_digest(o), "sample": o[::97]})(
            np.asarray(getattr(jax.numpy, ref)(arg))))
        np.testing.assert_array_equal(y[::97].view(np.uint32), want["sample"].view(np.uint32))
        assert bits_digest(y) == want["digest"], ref
    with pytest.raises(TypeError):
        _C.xla_math(0, np.ones(3))          # float64
    with pytest.raises(ValueError):
        _C.xla_math(7, np.ones(3, np.float32))


# --- gumbel -----------------------------------------------------------------------------------

def _raw(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@host_only
@pytest.mark.parametrize("mode", ["low", "high"])
def test_gumbel_matches_jax(mode, jax_ref):
    for dt in (np.float32, np.float16, ml_dtypes.bfloat16):
        for seed, shape in ((0, (4000,)), (1, (3, 17))):
            got = R.gumbel(R.PRNGKey(seed), shape, dt, mode)
            want = jax_ref(f"{np.dtype(dt).name}/{seed}", lambda jax: jax.random.gumbel(
                jax.random.PRNGKey(seed), shape, dt, mode))
            assert got.shape == shape and got.dtype == np.dtype(dt)
            np.testing.assert_array_equal(_raw(got), _raw(want), err_msg=f"{dt} {shape}")
    got = R.gumbel(R.PRNGKey(5), (), mode=mode)
    assert got.shape == () and _raw(got) == _raw(jax_ref("0-d", lambda jax: jax.random.gumbel(
        jax.random.PRNGKey(5), (), mode=mode)))


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_gumbel_sharded_equals_host(mesh_shape, names):
    mesh = cts.make_mesh(mesh_shape, names)
    host = R.gumbel(R.PRNGKey(9), (8, 16), mode="high")
    for spec in (cts.P(names[0]), cts.P(None, names[-1]), cts.P(*names)):
        a = R.gumbel(R.PRNGKey(9), (8, 16), mode="high", out_sharding=cts.NamedSharding(mesh, spec))
        assert isinstance(a, cts.Array)
        np.testing.assert_array_equal(_raw(a), _raw(host))
    x = R.gumbel(R.PRNGKey(1), (20000,))
    assert abs(float(x.mean()) - 0.5772157) < 0.03 and abs(float(x.var()) - np.pi ** 2 / 6) < 0.08
    with pytest.raises(ValueError, match="mode"):
        R.gumbel(R.PRNGKey(0), (2,), mode="medium")
    with pytest.raises(ValueError, match="dtype"):
        R.gumbel(R.PRNGKey(0), (2,), np.int32)
    s = cts.eval_shape(lambda k: R.gumbel(k, (3, 2)), R.PRNGKey(0))
    assert s.shape == (3, 2) and s.dtype == np.float32


# --- categorical ------------------------------------------------------------------------------

# (logits shape, axis, shape): one jax compilation each, so several keys per case
CAT_CASES = [((7,), -1, (200,)), ((4, 9), -1, None), ((4, 9), 0, (25, 9)), ((2, 6, 3), 1, (10, 2, 3)),
             ((1, 5), -1, (30, 4)), ((2, 3), -2, (40, 1, 3)), ((1,), 0, None)]


@host_only
def test_categorical_matches_jax(jax_ref):
    rng = np.random.default_rng(0)
    draws = mismatches = 0
    for case, (lshape, axis, shape) in enumerate(CAT_CASES):
        mode = ("low", "high")[case % 2]
        for seed in range(6):
            logits = (rng.standard_normal(lshape) * 2).astype(np.float32)
            if seed % 3 == 1:
                logits[..., 0] = -INF                        # an impossible category
            if seed % 3 == 2:
                logits = np.round(logits)                    # tied logits
            key = 100 * case + seed
            got = R.categorical(R.PRNGKey(key), logits, axis, shape, mode=mode)
            want = jax_ref(key, lambda jax: jax.random.categorical(
                jax.random.PRNGKey(key), logits, axis, shape, mode=mode))
            assert isinstance(got, np.ndarray) and got.shape == want.shape and got.dtype == want.dtype
            draws += want.size
            mismatches += int((got != want).sum())
    for dt in (np.float16, ml_dtypes.bfloat16):            # noise and sum in the logits' dtype
        for seed in range(3):
            logits = (rng.standard_normal((6, 20)) * 2).astype(dt)
            got = R.categorical(R.PRNGKey(seed), logits, -1, (10, 6))
            want = jax_ref(f"{np.dtype(dt).name}/{seed}", lambda jax: jax.random.categorical(
                jax.random.PRNGKey(seed), logits, -1, (10, 6)))
            draws += want.size
            mismatches += int((got != want).sum())
    assert draws > 4000 and mismatches == 0, f"{mismatches} of {draws} draws differ from jax"


@host_only
def test_categorical_without_replacement_matches_jax(jax_ref):
    rng = np.random.default_rng(1)
    for seed, (lshape, axis, k) in enumerate([((10,), 0, 10), ((4, 9), -1, 3), ((6, 3), 0, 2), ((2, 5, 3), 1, 5)]):
        logits = rng.standard_normal(lshape).astype(np.float32)
        batch = tuple(np.delete(lshape, axis))
        got = R.categorical(R.PRNGKey(seed), logits, axis, (k,) + batch, replace=False)
        want = jax_ref(seed, lambda jax: jax.random.categorical(
            jax.random.PRNGKey(seed), logits, axis, (k,) + batch, replace=False))
        np.testing.assert_array_equal(got, want)
        first = np.moveaxis(got, 0, -1).reshape(-1, k)
        assert all(len(set(r)) == k for r in first.tolist())   # distinct per batch element


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_categorical_on_sharded_logits(mesh_shape, names, jax_ref):
    mesh = cts.make_mesh(mesh_shape, names)
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((8, 16)).astype(np.float32)
    specs = [cts.P(), cts.P(names[0]), cts.P(None, names[-1]), cts.P(*names)]
    for spec in specs:
        lg = cts.device_put(logits, cts.NamedSharding(mesh, spec))
        for axis, shape in ((-1, None), (0, None), (-1, (3, 8))):
            got = R.categorical(R.PRNGKey(4), lg, axis, shape)
            host = R.categorical(R.PRNGKey(4), logits, axis, shape)
            assert isinstance(got, cts.Array) and got.dtype == np.int32
            np.testing.assert_array_equal(np.asarray(got), host, err_msg=f"{spec} {axis} {shape}")
            np.testing.assert_array_equal(host, jax_ref(
                f"{spec}/{axis}/{shape}",
                lambda jax: jax.random.categorical(jax.random.PRNGKey(4), logits, axis, shape)))
        # the batch dimension keeps its sharding: no device ever held the whole batch
        got = R.categorical(R.PRNGKey(4), lg, -1)
        assert got.sharding.is_equivalent_to(cts.NamedSharding(mesh, cts.P(spec[0] if len(spec) else None)), 1)
        got = R.categorical(R.PRNGKey(5), lg, -1, (2, 8), replace=False)
        np.testing.assert_array_equal(np.asarray(got),
                                      R.categorical(R.PRNGKey(5), logits, -1, (2, 8), replace=False))


def test_categorical_inside_value_and_grad():
    logits = np.random.default_rng(3).standard_normal((5, 7)).astype(np.float32)

    def f(v):
        s = R.categorical(R.PRNGKey(0), v)
        return cnp.sum(cnp.square(v)), s
    (val, s), g = cts.value_and_grad(f, has_aux=True)(cts.device_put(logits))
    np.testing.assert_array_equal(np.asarray(s), R.categorical(R.PRNGKey(0), logits))
    np.testing.assert_allclose(np.asarray(g), 2 * logits, rtol=1e-6)


@host_only
def test_categorical_statistics():
    p = np.array([0.05, 0.6, 0.0, 0.35], np.float32)
    with np.errstate(divide="ignore"):
        logits = np.log(p)
    n = 40000
    s = R.categorical(R.PRNGKey(123), logits, shape=(n,))
    freq = np.bincount(s, minlength=4) / n
    assert freq[2] == 0
    np.testing.assert_allclose(freq, p, atol=4 * np.sqrt(0.25 / n))
    # batched: each row its own distribution
    lg = np.log(np.array([[0.9, 0.1], [0.2, 0.8]], np.float32))
    s = R.categorical(R.PRNGKey(7), lg, shape=(n, 2))
    np.testing.assert_allclose((s == 0).mean(axis=0), [0.9, 0.2], atol=0.02)


def test_categorical_errors():
    lg = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match="broadcast"):
        R.categorical(R.PRNGKey(0), lg, shape=(5,))
    with pytest.raises(ValueError, match="broadcast-compatible"):
        R.categorical(R.PRNGKey(0), lg, axis=1, shape=(2, 1))   # batch (3,) does not fit (2, 1)
    with pytest.raises(ValueError, match="float dtype"):
        R.categorical(R.PRNGKey(0), np.zeros(4, np.int32))
    with pytest.raises(IndexError):
        R.categorical(R.PRNGKey(0), lg, axis=2)
    with pytest.raises(ValueError, match="cannot exceed"):
        R.categorical(R.PRNGKey(0), lg, shape=(5, 3), replace=False)
    with pytest.raises(TypeError, match="float32"):
        R.categorical(R.PRNGKey(0), cts.device_put(lg.astype(np.float16)))
    with pytest.raises(ValueError, match="empty"):
        R.categorical(R.PRNGKey(0), np.zeros((3, 0), np.float32))
    s = cts.eval_shape(lambda k, v: R.categorical(k, v, shape=(2, 3)), R.PRNGKey(0),
                       cts.ShapeDtypeStruct((3, 4), np.float32))
    assert s.shape == (2, 3) and s.dtype == np.int32


# --- choice -------------------------------------------------------------------------------

@host_only
def test_choice_matches_jax(jax_ref):
    rng = np.random.default_rng(4)
    draws = mismatches = 0
    for seed, n in enumerate([1, 17, 300]):
        p = rng.random(n).astype(np.float32)
        p[rng.random(n) < 0.3] = 0.0
        p[0] += 0.01
        arr = rng.standard_normal((3, n, 2)).astype(np.float32)
        for j, kw in enumerate((dict(), dict(replace=False), dict(p=p), dict(p=p, replace=False))):
            for i, (a, axis, shape) in enumerate(((n, 0, (min(n, 4),)), (arr, 1, (min(n, 2), 1)),
                                                  (arr, -2, ()), (np.arange(n) * 10, 0, (min(n, 3), 1)))):
                got = R.choice(R.PRNGKey(seed), a, shape, axis=axis, **kw)
                want = jax_ref(f"{seed}/{j}/{i}", lambda jax: jax.random.choice(
                    jax.random.PRNGKey(seed), a, shape, axis=axis, **kw))
                assert got.shape == want.shape and got.dtype == want.dtype, (kw, shape)
                draws += want.size
                mismatches += int((got != want).sum())
    assert mismatches == 0, f"{mismatches} of {draws} values differ from jax"


@host_only
def test_cumsum_and_searchsorted_follow_jax(jax_ref):
    rng = np.random.default_rng(5)
    for n in (1, 16, 17, 255, 257, 4100):
        x = rng.random(n).astype(np.float32)
        np.testing.assert_array_equal(_random_core._xla_cumsum(x), jax_ref(
            f"cumsum/{n}", lambda jax: jax.numpy.cumsum(x)))
    a = np.array([0.0, 1.0, 1.0, 2.5, NAN, 3.0], np.float32)     # NaN: jax's sort order
    v = np.array([-1.0, 0.0, -0.0, 1.0, 2.0, 3.0, INF, NAN], np.float32)
    np.testing.assert_array_equal(_random_core._searchsorted_left(a, v), jax_ref(
        "searchsorted/nan", lambda jax: jax.numpy.searchsorted(a, v)))
    u = rng.random(9).astype(np.float32)                        # unsorted: the same bisection
    q = rng.random(20).astype(np.float32)
    np.testing.assert_array_equal(_random_core._searchsorted_left(u, q), jax_ref(
        "searchsorted/unsorted", lambda jax: jax.numpy.searchsorted(u, q)))


def test_choice_statistics_and_placement():
    p = np.array([0.1, 0.0, 0.6, 0.3], np.float32)
    n = 40000
    s = R.choice(R.PRNGKey(3), 4, (n,), p=p)
    np.testing.assert_allclose(np.bincount(s, minlength=4) / n, p, atol=4 * np.sqrt(0.25 / n))
    s = R.choice(R.PRNGKey(4), 10, (n,))
    np.testing.assert_allclose(np.bincount(s, minlength=10) / n, 0.1, atol=0.01)
    for kw in (dict(), dict(p=np.arange(1, 11, dtype=np.float32))):
        d = R.choice(R.PRNGKey(5), np.arange(10) * 2, (2, 5), replace=False, **kw)
        assert d.shape == (2, 5) and sorted(d.ravel().tolist()) == list(range(0, 20, 2))
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    sh = cts.NamedSharding(mesh, cts.P("model"))
    a = R.choice(R.PRNGKey(6), 8, (8,), out_sharding=sh)
    assert isinstance(a, cts.Array) and a.sharding == sh
    np.testing.assert_array_equal(np.asarray(a), R.choice(R.PRNGKey(6), 8, (8,)))


def test_choice_errors():
    with pytest.raises(TypeError, match="sequence"):
        R.choice(R.PRNGKey(0), 5, 3)
    with pytest.raises(ValueError, match="greater than 0"):
        R.choice(R.PRNGKey(0), 0, (2,))
    with pytest.raises(ValueError, match="larger sample"):
        R.choice(R.PRNGKey(0), 3, (4,), replace=False)
    with pytest.raises(ValueError, match="p must be None or a 1D vector"):
        R.choice(R.PRNGKey(0), 3, (2,), p=np.ones(4, np.float32))
    with pytest.raises(ValueError, match="p must be None or a 1D vector"):
        R.choice(R.PRNGKey(0), np.zeros((2, 3)), (2,), p=np.ones(2, np.float32), axis=1)
    with pytest.raises(IndexError):
        R.choice(R.PRNGKey(0), np.zeros((2, 3)), (2,), axis=2)
    z = R.choice(R.PRNGKey(0), np.arange(4.0), (0, 3))     # no draws: zeros of the shape, as jax
    assert z.shape == (0, 3) and z.dtype == np.float32
