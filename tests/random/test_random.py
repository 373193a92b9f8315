"""ctrainstate.random: recorded jax vectors, live jax parity, mesh invariance, memory."""
import os

import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import random as R
from ctrainstate import random
from ctrainstate._src.random import core as _random_core

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def raw(a):
    a = np.asarray(a)
    if a.dtype == np.bool_:
        return a.astype(np.uint8)
    if a.dtype.kind == "f" or a.dtype == DTYPES["bfloat16"]:
        return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])
    return a


def _cases():
    with open(os.path.join(HERE, "data", "random_vectors.txt")) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            head, vals = line.split(":")
            yield head.split(), [int(v, 16) for v in vals.split()]


CASES = list(_cases())


def _run(head, out_sharding=None):
    """Run a recorded 'sample' case with ctrainstate."""
    dist, dtype, k0, k1 = head[1], head[2], int(head[3]), int(head[4])
    mn, mx, lo, hi, p = (float(v) for v in head[5:10])
    has_scale, scale, ndim = int(head[10]), float(head[11]), int(head[12])
    shape = tuple(int(d) for d in head[13:13 + ndim])
    key = np.array([k0, k1], np.uint32)
    if dist.startswith("bits"):
        dt = {"8": np.uint8, "16": np.uint16, "32": np.uint32}[dist[4:]]
        return R.bits(key, shape, dt, out_sharding=out_sharding), shape
    dt = DTYPES[dtype]
    sc = scale if has_scale else None
    if dist == "bernoulli":
        return R.bernoulli(key, dt.type(p), shape, out_sharding=out_sharding), shape
    code = {"uniform": _random_core._UNIFORM, "normal": _random_core._NORMAL, "truncated_normal": _random_core._TRUNCATED_NORMAL}
    if sc is None and dist == "uniform":
        return R.uniform(key, shape, dt, mn, mx, out_sharding=out_sharding), shape
    if sc is None and dist == "normal":
        return R.normal(key, shape, dt, out_sharding=out_sharding), shape
    if sc is None:
        return R.truncated_normal(key, lo, hi, shape, dt, out_sharding=out_sharding), shape
    return _random_core._sample(key, shape, dt, out_sharding, code[dist], minval=mn, maxval=mx, lower=lo,
                     upper=hi, scale=sc), shape


def test_recorded_vectors():
    n = 0
    for head, want in CASES:
        if head[0] == "split":
            got = R.split(np.array([int(head[1]), int(head[2])], np.uint32), int(head[3]))
            assert got.ravel().tolist() == want, head
        elif head[0] == "fold_in":
            got = R.fold_in(np.array([int(head[1]), int(head[2])], np.uint32), int(head[3]))
            assert got.tolist() == want, head
        else:
            got, shape = _run(head)
            assert got.shape == shape
            assert raw(got).ravel().tolist() == want, " ".join(head)
        n += 1
    assert n > 500


def test_keys():
    assert R.PRNGKey(5).tolist() == [0, 5]
    assert R.PRNGKey(2 ** 32 + 5).tolist() == [0, 5]
    assert R.PRNGKey(-1).tolist() == [0, 0xFFFFFFFF]
    assert R.split(R.PRNGKey(0), (2, 3)).shape == (2, 3, 2)
    with pytest.raises(TypeError):
        R.normal(R.split(R.PRNGKey(0)), (3,))
    with pytest.raises(TypeError):
        R.PRNGKey(1.5)
    with pytest.raises(ValueError):
        R.uniform(R.PRNGKey(0), (3,), np.int32)
    with pytest.raises(ValueError):
        R.normal(R.PRNGKey(0), (-1, 3))


def test_permutation_is_a_permutation():
    p = R.permutation(R.PRNGKey(3), 1000)
    assert sorted(p.tolist()) == list(range(1000))
    x = np.arange(12).reshape(3, 4)
    y = R.permutation(R.PRNGKey(3), x, axis=1)
    cols = y - 4 * np.arange(3)[:, None]  # every row permuted by the same column order
    assert sorted(cols[0].tolist()) == [0, 1, 2, 3] and (cols == cols[0]).all()


# --- live parity with jax -------------------------------------------------------------



def test_reference_jax_rounds_each_float16_op():
    """The live float16 parity below assumes that jax rounds each float16 multiply and add, as
    its HLO says. XLA on a CPU with AVX512-FP16 fuses them into one FMA unless capped at AVX2
    (tests/conftest.py); this says so directly if that ever stops holding, instead of a
    parity failure deep in a sampler."""
    jax = pytest.importorskip("jax")
    a = np.random.default_rng(0).uniform(0, 1, 20000).astype(np.float16)
    c1, c2 = np.float16(1.9092), np.float16(-0.95459)
    per_op = (a * c1).astype(np.float16) + c2  # numpy rounds each float16 op
    fused = (a.astype(np.float64) * float(c1) + float(c2)).astype(np.float16)
    assert (per_op != fused).sum() > 1000  # the two roundings are told apart by these inputs
    got = np.asarray(jax.jit(lambda x: x * c1 + c2)(a))
    assert (got == per_op).all(), (
        f"jax fused a float16 multiply-add ({(got == fused).mean():.0%} match one rounding); "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")


def test_parity_random_keys_and_shapes(jax_ref):
    rng = np.random.default_rng(1234)
    shapes = [(), (1,), (5,), (11,), (3, 7), (2, 3, 5), (1, 13, 3), (4, 0), (33, 65)]
    names = list(DTYPES)
    # One float dtype per trial, so that each (shape, dtype) pair costs jax one compile of each
    # sampler (most of the live twin's time): every dtype meets four of the shapes, the pairs
    # differ between the two passes over the shapes, and a new key and new bounds come each trial.
    for trial in range(12):
        seed = int(rng.integers(0, 2 ** 31))
        key = np.asarray(R.fold_in(R.PRNGKey(seed), trial))
        shape = shapes[trial % len(shapes)]
        name = names[(trial + trial // len(shapes)) % len(names)]
        dt = DTYPES[name]
        mn, mx = sorted(rng.uniform(-5, 5, 2).tolist())
        lo, hi = sorted(rng.uniform(-3, 3, 2).tolist())
        p = dt.type(rng.uniform())
        small = dt.type(10.0 ** rng.uniform(-7, 0))

        def theirs(jax):
            jdt = getattr(jax.numpy, name)
            kk = jax.random.fold_in(jax.random.PRNGKey(seed), trial)
            return {"key": kk, "uniform": jax.random.uniform(kk, shape, jdt, mn, mx),
                    "normal": jax.random.normal(kk, shape, jdt),
                    "truncated_normal": jax.random.truncated_normal(kk, lo, hi, shape, jdt),
                    "bernoulli": jax.random.bernoulli(kk, p, shape),
                    "bernoulli_high": jax.random.bernoulli(kk, small, shape, mode="high"),
                    "bits": jax.random.bits(kk, shape), "split": jax.random.split(kk, 3),
                    "permutation": jax.random.permutation(kk, 50),
                    "key_data": jax.random.key_data(jax.random.key(seed))}

        want = jax_ref(trial, theirs)
        assert (key == want["key"]).all()
        assert (raw(R.uniform(key, shape, dt, mn, mx)) == raw(want["uniform"])).all()
        assert (raw(R.normal(key, shape, dt)) == raw(want["normal"])).all()
        assert (raw(R.truncated_normal(key, lo, hi, shape, dt)) ==
                raw(want["truncated_normal"])).all(), (lo, hi)
        assert (R.bernoulli(key, p, shape) == want["bernoulli"]).all()
        assert (R.bernoulli(key, small, shape, mode="high") == want["bernoulli_high"]).all(), (
            name, small)
        assert (R.bits(key, shape) == want["bits"]).all()
        assert (R.split(key, 3) == want["split"]).all()
        assert (R.permutation(key, 50) == want["permutation"]).all()
        assert (R.key_data(R.PRNGKey(seed)) == want["key_data"]).all()


# --- mesh invariance ---------------------------------------------------------------

MESHES = [((1,), ("x",)), ((8,), ("x",)), ((2, 4), ("x", "y")), ((4, 2), ("x", "y"))]


def _specs(names):
    P = cts.P
    if len(names) == 1:
        return [P(), P("x"), P(None, "x"), P(None, None, "x")]
    return [P(), P("x", "y"), P("y", "x"), P(("x", "y")), P(None, ("y", "x")), P("y"),
            P(None, "x", "y")]


def _need_devices(n):
    if cts.device_count() < n:
        pytest.skip(f"needs CTRAINSTATE_NUM_CPU_DEVICES >= {n}")


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_mesh_invariance(mesh_shape, names):
    _need_devices(int(np.prod(mesh_shape)))
    mesh = cts.make_mesh(mesh_shape, names)
    key = R.PRNGKey(77)
    shape = (8, 16, 24)
    samplers = [
        lambda s: R.bits(key, shape, out_sharding=s),
        lambda s: R.uniform(key, shape, np.float32, -2.0, 3.0, out_sharding=s),
        lambda s: R.normal(key, shape, DTYPES["bfloat16"], out_sharding=s),
        lambda s: R.normal(key, shape, np.float16, out_sharding=s),
        lambda s: R.truncated_normal(key, -1.0, 2.0, shape, out_sharding=s),
        lambda s: R.bernoulli(key, 0.4, shape, out_sharding=s),
        lambda s: R.bernoulli(key, np.float16(0.3), shape, mode="high", out_sharding=s),
    ]
    for spec in _specs(names):
        sharding = cts.NamedSharding(mesh, spec)
        for f in samplers:
            a = f(sharding)
            assert isinstance(a, cts.Array)
            assert (raw(np.asarray(a)) == raw(f(None))).all(), spec
            for shard in a.addressable_shards:  # each device holds exactly its block
                assert (raw(shard.data) == raw(f(None))[shard.index]).all()


def test_memory_bound_for_sharded_normal():
    _need_devices(8)
    mesh = cts.make_mesh((8,), ("x",))
    sharding = cts.NamedSharding(mesh, cts.P("x"))
    devs = list(mesh.devices.flat) if hasattr(mesh.devices, "flat") else list(mesh.devices)
    cts.reset_peak_memory_stats()
    before = {d.id: d.memory_stats()["bytes_in_use"] for d in devs}
    a = R.normal(R.PRNGKey(0), (2048, 4096), out_sharding=sharding)
    shard_bytes = 2048 * 4096 * 4 // 8
    assert shard_bytes == 4 << 20
    for d in devs:
        st = d.memory_stats()
        grew = st["peak_bytes_in_use"] - before[d.id]
        # the 4 MiB shard; generation scratch is per-thread stack tiles, not device memory
        assert shard_bytes <= grew <= shard_bytes + (64 << 10), (d, st)
    del a


def test_random_on_device_is_false_for_cpu_buffers():
    """CPU buffers are filled by the core on the host; only GPU backends have a kernel."""
    from ctrainstate import _C
    from ctrainstate._src.base import dtypes as _dtypes
    buf = _C.Buffer(cts.devices("cpu")[0].id, (4,), _dtypes.code(np.float32))
    assert _C.random_on_device(buf) is False
    with pytest.raises(TypeError):
        _C.random_on_device(np.zeros(4, np.float32))


@pytest.mark.parametrize("dt", [np.float32, np.float16, DTYPES["bfloat16"]], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (7,), (3, 5, 2)])
def test_bernoulli_high_is_jaxs_two_uniform_construction(dt, shape):
    """mode='high' from this library's own uniform (bit-exact with JAX's, tested above):
    u1, u2 = uniform(key, (2, *shape)); u2 * 2**-nmant < p - u1, in p's dtype."""
    import ml_dtypes
    dt = np.dtype(dt).type
    key = R.PRNGKey(9)
    for p in (0.5, 1e-3, 3e-6):
        pt = dt(p)
        u = R.uniform(key, (2,) + shape, dt)
        want = (u[1] * dt(2.0 ** -ml_dtypes.finfo(dt).nmant)) < (pt - u[0])
        got = R.bernoulli(key, pt, shape, mode="high")
        assert got.dtype == np.bool_ and got.shape == shape
        assert (got == want).all(), p


def test_bernoulli_high_resolves_small_probabilities():
    """In float16 a uniform is a multiple of 2^-10, so mode='low' fires with probability
    2^-10 for any 0 < p <= 2^-10; mode='high' gets p = 1e-4 right (5-sigma bands)."""
    key = R.PRNGKey(4)
    n = 400_000
    p = np.float16(1e-4)
    low = int(R.bernoulli(key, p, (n,)).sum())
    high = int(R.bernoulli(key, p, (n,), mode="high").sum())
    assert abs(low - n * 2.0 ** -10) < 5 * np.sqrt(n * 2.0 ** -10), low
    assert abs(high - n * float(p)) < 5 * np.sqrt(n * float(p)), high
    with pytest.raises(ValueError, match="mode"):
        R.bernoulli(key, 0.5, (3,), mode="medium")


def test_key_data_takes_a_batch_of_keys():
    from ctrainstate import random as crandom
    k = crandom.PRNGKey(0)
    ks = crandom.split(k, 5)
    assert crandom.key_data(ks).shape == (5, 2) and crandom.key_data(ks).dtype == np.uint32
    np.testing.assert_array_equal(crandom.key_data(ks), ks)
    assert crandom.key_data(crandom.split(k, (2, 3))).shape == (2, 3, 2)
    np.testing.assert_array_equal(crandom.wrap_key_data(crandom.key_data(ks)), ks)
    out = crandom.key_data(ks)
    out[0] = 0                     # a copy: the keys are unchanged
    assert ks[0].tolist() != [0, 0]
    for bad, msg in [("x", "got str"), (np.uint32([1, 2, 3]), r"got shape \(3,\)"),
                     (np.float32([1, 2]), "uint32 values")]:
        with pytest.raises(TypeError, match="key_data: .*" + msg):
            crandom.key_data(bad)


def test_fold_in_names_data_when_not_an_integer():
    from ctrainstate import random as crandom
    k = crandom.PRNGKey(0)
    for bad in ("x", None, float("nan")):
        with pytest.raises(TypeError, match="fold_in: data must be an integer scalar"):
            crandom.fold_in(k, bad)
    # jax 0.10 truncates a float and takes a bool: fold_in(k, 1.5) == fold_in(k, True)
    assert crandom.fold_in(k, 1.5).tolist() == [928981903, 3453687069]
    assert crandom.fold_in(k, True).tolist() == [928981903, 3453687069]


# --- narrow integer dtypes: bits and randint as sharded Arrays ------------------------------

# recorded from jax 0.10.2 on CPU: jax.random.bits(PRNGKey(7), (10,), dt) and
# jax.random.randint(PRNGKey(3), (10,), lo, hi, dt)
_NARROW_BITS_JAX = {
    np.uint8: [11, 0, 170, 48, 134, 107, 88, 106, 139, 174],
    np.uint16: [10507, 32256, 10666, 17712, 25478, 39787, 13144, 54634, 3723, 45230],
}
_NARROW_RANDINT_JAX = [
    ((-100, 100, np.int8), [95, 39, -95, 54, 16, -28, -77, -96, -98, 94]),
    ((0, 256, np.uint8), [75, 115, 157, 170, 12, 104, 111, 92, 10, 234]),
    ((-40000, 40000, np.int16), [5707, -5517, -16995, -25942, 11276, 29288, -14481, -27044,
                                 -2550, 25834]),
    ((5, 65536, np.uint16), [23732, 29072, 61416, 1813, 47283, 41593, 33883, 8636, 35807,
                             59233]),
]


def _mesh_sharding():
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    return cts.NamedSharding(mesh, cts.P("data", "model"))


@pytest.mark.parametrize("dt", [np.uint8, np.uint16], ids=lambda d: np.dtype(d).name)
def test_narrow_bits_recorded_and_sharded(dt):
    """bits of 8 / 16 bits: jax's values, on the host and as a sharded Array of that dtype
    whose every device computed its own block (the same elements either way)."""
    got = R.bits(R.PRNGKey(7), (10,), dt)
    assert got.dtype == dt and got.tolist() == _NARROW_BITS_JAX[dt]
    host = R.bits(R.PRNGKey(7), (6, 8), dt)
    sh = R.bits(R.PRNGKey(7), (6, 8), dt, out_sharding=_mesh_sharding())
    assert isinstance(sh, cts.Array) and sh.dtype == dt and sh.sharding.spec == cts.P("data", "model")
    np.testing.assert_array_equal(np.asarray(sh), host)
    # the flat elements are the recorded ones (an element's bits depend on its global index)
    np.testing.assert_array_equal(np.asarray(R.bits(R.PRNGKey(7), (2, 5), dt,
                                                    out_sharding=cts.NamedSharding(
                                                        cts.make_mesh((2,), ("x",)), cts.P("x")))
                                             ).ravel(), _NARROW_BITS_JAX[dt])
    with pytest.raises(TypeError, match="uint64 is not supported in sharded Arrays"):
        R.bits(R.PRNGKey(7), (4,), np.uint64, out_sharding=_mesh_sharding())


@pytest.mark.parametrize("case", _NARROW_RANDINT_JAX, ids=lambda c: np.dtype(c[0][2]).name)
def test_narrow_randint_recorded_and_sharded(case):
    (lo, hi, dt), want = case
    got = R.randint(R.PRNGKey(3), (10,), lo, hi, dt)
    assert got.dtype == dt and got.tolist() == want
    sh = R.randint(R.PRNGKey(3), (2, 5), lo, hi, dt,
                   out_sharding=cts.NamedSharding(cts.make_mesh((2,), ("x",)), cts.P("x")))
    assert isinstance(sh, cts.Array) and sh.dtype == dt
    np.testing.assert_array_equal(np.asarray(sh).ravel(), want)


@pytest.mark.parametrize("dt", [np.uint8, np.int8, np.int16, np.uint16], ids=lambda d: np.dtype(d).name)
def test_narrow_bits_and_randint_match_jax(dt, jax_ref):
    info = np.iinfo(dt)
    s = _mesh_sharding()
    for seed in (0, 11):
        if info.min == 0:
            want = jax_ref(f"bits/{seed}",
                           lambda jax: jax.random.bits(jax.random.PRNGKey(seed), (6, 8), dt))
            np.testing.assert_array_equal(np.asarray(R.bits(R.PRNGKey(seed), (6, 8), dt,
                                                            out_sharding=s)), want)
        for lo, hi in ((int(info.min), int(info.max) + 1), (0, 10), (-3, 70000), (int(info.max) - 5, 2 ** 20)):
            want = jax_ref(f"randint/{seed}/{lo}/{hi}", lambda jax: jax.random.randint(
                jax.random.PRNGKey(seed), (6, 8), lo, hi, dt))
            got = R.randint(R.PRNGKey(seed), (6, 8), lo, hi, dt, out_sharding=s)
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{lo} {hi}")


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define (recorded, checked live in the parity twins) and derived by hand

# recorded from jax 0.10.2 (jax.random.randint on CPU)
_RANDINT_JAX = [
    ((0, (6,), 0, 10, None), [9, 0, 2, 3, 1, 7]),
    ((42, (5,), -2**31, 2**31 - 1, None),
     [977810628, 1236381714, -1367112521, -1019495231, -1671904627]),
    ((1, (8,), 0, 256, np.uint8), [252, 175, 224, 105, 160, 172, 22, 149]),
]

_RANDINT_CASES = [((6,), 0, 10, None), ((1000,), -5, 5, None), ((3, 4), 0, 2**31 - 1, None),
                  ((50,), -2**31, 2**31 - 1, None), ((50,), 5, 5, None), ((50,), 7, 3, None),
                  ((100,), 0, 256, np.uint8), ((100,), -100, 100, np.int8),
                  ((100,), 0, 70000, np.int16), ((100,), 3, 1000, np.uint32), ((7,), 0, 1, None),
                  ((100,), 0, 65537, None), ((100,), 2.7, 9.9, None)]


def test_randint_recorded_and_properties():
    for (seed, shape, lo, hi, dt), want in _RANDINT_JAX:
        got = random.randint(random.PRNGKey(seed), shape, lo, hi, dt)
        assert got.tolist() == want
    x = random.randint(random.PRNGKey(3), (2000,), -5, 5)
    assert x.dtype == np.int32 and x.min() == -5 and x.max() == 4
    assert (random.randint(random.PRNGKey(3), (9,), 7, 3) == 7).all()     # empty span: minval
    u = random.randint(random.PRNGKey(3), (4000,), 0, 256, np.uint8)      # maxval one past uint8
    assert u.dtype == np.uint8 and u.max() == 255
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    s = cts.NamedSharding(mesh, cts.P("data"))
    sh = random.randint(random.PRNGKey(0), (8, 2), 0, 10, out_sharding=s)
    assert sh.sharding == s
    np.testing.assert_array_equal(np.asarray(sh), random.randint(random.PRNGKey(0), (8, 2), 0, 10))
    with pytest.raises(ValueError, match="scalar"):
        random.randint(random.PRNGKey(0), (2,), np.zeros(2, np.int32), 5)
    assert random.wrap_key_data(np.array([1, 2], np.uint32)).tolist() == [1, 2]


def test_randint_matches_jax(jax_ref):
    for shape, lo, hi, dt in _RANDINT_CASES:
        for seed in (0, 42):
            want = jax_ref(f"{shape}/{lo}/{hi}/{np.dtype(dt).name if dt else 'int'}/{seed}",
                           lambda jax: jax.random.randint(jax.random.PRNGKey(seed), shape, lo, hi,
                                                          dt if dt else int))
            got = random.randint(random.PRNGKey(seed), shape, lo, hi, dt)
            assert got.dtype == want.dtype, (shape, lo, hi, dt)
            np.testing.assert_array_equal(got, want, err_msg=str((shape, lo, hi, dt, seed)))


def test_permutation_of_an_array_narrows_like_jax(jax_ref):
    x = np.arange(10) * 2                        # int64 on the host
    out = random.permutation(random.PRNGKey(42), x)
    assert out.dtype == np.int32                  # JAX without x64
    assert sorted(out.tolist()) == sorted(x.tolist())
    assert random.permutation(random.PRNGKey(0), np.ones(3)).dtype == np.float32
    want = jax_ref("permutation", lambda jax: jax.random.permutation(jax.random.PRNGKey(42), x))
    assert want.dtype == out.dtype
    np.testing.assert_array_equal(out, want)


def test_a_numpy_key_is_read_without_formatting_its_dtype():
    """_key_words tells a typed jax key by its dtype's class: a numpy key's dtype is not turned
    into a string (numpy's dtype.__str__ is Python code, ~5 us: as much as the rest of a
    split), and split / fold_in / normal of a numpy key run none of it."""
    from call_counts import python_frames
    k = R.PRNGKey(3)
    for f in (lambda: R.split(k), lambda: R.fold_in(k, 5), lambda: R.normal(k, (4, 3)),
              lambda: R.uniform(k, (2,), dtype=ml_dtypes.bfloat16)):
        f()
        files = {os.path.basename(fn) for fn, _ in python_frames(f)}
        assert "_dtype.py" not in files, files
    np.testing.assert_array_equal(R.split(k), R.split(np.asarray(k).astype(np.int64)))
