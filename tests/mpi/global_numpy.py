"""Run under mpirun (by tests/mpi/global_slicing.py, whose runs include these checks, or on its
own), each process with 2 CPU devices: the jax.numpy functions that read their operand on the
host or plan on it -- nanargmax / nanargmin, median / quantile / percentile and their nan
forms, unique and its array-API kin, the set operations, isin, histogram, bincount,
digitize, lexsort, partition / argpartition, delete / insert / compress / extract /
trim_zeros / choose / put_along_axis, interp -- nn.one_hot of labels sharded over processes
(eager, differentiated through and under jit), and the scans and differences along a
dimension that spans processes (cumsum, cumprod, nancumsum, diff, ediff1d), of Arrays
sharded over a mesh that spans processes. Each is compared bit for bit, shardings included,
with a run of one process that has as many devices as the whole job (the reference run
writes its values and its results' shardings), and the integer ones also with numpy on the
global value.

    python tests/mpi/global_numpy.py --reference ref.npz   # one process, 2 * N devices
    mpirun -n N python tests/mpi/global_numpy.py ref.npz   # N processes, 2 devices each

Each process prints "OK <process> <count> <checks>" at the end (and writes it to a file in
CT_TEST_OUT); any failure raises (non-zero exit).
"""
import numpy as np

from report import compare, finish, raw, run, save_reference, start

import ctrainstate as cts
import ctrainstate.numpy as jnp
from ctrainstate import NamedSharding, P, nn

BF16 = jnp.bfloat16


def values(n):
    """The global values (host), the same in every run: floats with NaNs (one row all NaN),
    -0.0 / 0.0, infinities and repeated values, and small ints with many repeats."""
    rng = np.random.default_rng(1)
    g = rng.standard_normal((4 * n, 2 * n)).astype(np.float32)
    g[::3, 0] = g[1, 0]                             # ties
    g[2, 1], g[3, 0], g[-1, :] = np.nan, np.nan, np.nan
    g[0, 0], g[1, 1], g[0, 1] = -0.0, np.inf, 0.0
    gi = np.round(np.nan_to_num(g, nan=3.0, posinf=9.0) * 2).astype(np.int32)
    return g, gi


def cases(a, b, ai, bi, v, f, c):
    """(name, fn()): ``a`` / ``ai`` (float32 / int32) sharded over ('data', 'model'), ``b``
    / ``bi`` the same values over ('model', 'data'), ``v`` 1-d non-negative ints and ``f``
    1-d floats over 'data', ``c`` 3-d over ('data', None, 'model')."""
    q2 = np.array([0.1, 0.5, 0.9], np.float32)
    n = a.shape[0] // 4
    return [
        # nan arg-reductions (an all-NaN row: jax's -1)
        ("nanargmax0", lambda: jnp.nanargmax(a, 0)),
        ("nanargmax1", lambda: jnp.nanargmax(a, axis=1)),
        ("nanargmin_all", lambda: jnp.nanargmin(a)),
        ("nanargmin0_keep", lambda: jnp.nanargmin(b, 0, keepdims=True)),
        # order statistics
        ("median0", lambda: jnp.median(a, 0)),
        ("median1", lambda: jnp.median(b, axis=1, keepdims=True)),
        ("median_all", lambda: jnp.median(ai)),
        ("nanmedian0", lambda: jnp.nanmedian(a, 0)),
        ("nanmedian1", lambda: jnp.nanmedian(b, 1)),
        ("quantile0", lambda: jnp.quantile(a, q2, axis=0)),
        ("quantile_lower", lambda: jnp.quantile(ai, 0.3, axis=1, method="lower")),
        ("quantile_nearest", lambda: jnp.quantile(b, 0.7, axis=0, method="nearest")),
        ("quantile_mid_3d", lambda: jnp.quantile(c, 0.25, axis=(0, 2), method="midpoint")),
        ("percentile", lambda: jnp.percentile(a, 40.0, axis=0)),
        ("nanquantile", lambda: jnp.nanquantile(a, q2, axis=1)),
        ("nanpercentile", lambda: jnp.nanpercentile(b, 70.0, axis=0, keepdims=True)),
        # unique and its kin
        ("unique", lambda: jnp.unique(ai)),
        ("unique_all_f", lambda: jnp.unique(a, return_index=True, return_inverse=True,
                                            return_counts=True)),
        ("unique_all_i", lambda: jnp.unique(bi, return_index=True, return_inverse=True,
                                            return_counts=True)),
        ("unique_size", lambda: jnp.unique(ai, return_counts=True, size=6 * n, fill_value=-5)),
        ("unique_size_cut", lambda: jnp.unique(a, return_index=True, size=3)),
        ("unique_axis0", lambda: jnp.unique(ai, axis=0, return_inverse=True)),
        ("unique_axis1", lambda: jnp.unique(bi, axis=1, return_counts=True)),
        ("unique_values", lambda: jnp.unique_values(a)),
        ("unique_counts", lambda: jnp.unique_counts(ai)),
        ("unique_inverse", lambda: jnp.unique_inverse(bi)),
        ("unique_all_api", lambda: jnp.unique_all(ai, size=4 * n, fill_value=0)),
        # sets, isin
        ("isin_host", lambda: jnp.isin(ai, np.array([0, 1, 6]))),
        ("isin_sharded", lambda: jnp.isin(bi, v)),
        ("setdiff1d", lambda: jnp.setdiff1d(ai, v)),
        ("setdiff1d_size", lambda: jnp.setdiff1d(ai, v, size=12, fill_value=-1)),
        ("union1d", lambda: jnp.union1d(bi, v)),
        ("intersect1d", lambda: jnp.intersect1d(ai, v, return_indices=True)),
        ("intersect1d_size", lambda: jnp.intersect1d(ai, v, return_indices=True, size=8)),
        ("setxor1d", lambda: jnp.setxor1d(ai, v)),
        # binning
        ("histogram", lambda: jnp.histogram(a, bins=4, range=(-2.0, 2.0))),
        ("histogram_auto", lambda: jnp.histogram(f, bins=5)),
        ("histogram_w", lambda: jnp.histogram(f, bins=3, weights=f * f)),
        ("histogram_density", lambda: jnp.histogram(ai, bins=4, density=True)),
        ("histogram_bin_edges", lambda: (jnp.histogram_bin_edges(f, bins=3),)),
        ("bincount", lambda: (jnp.bincount(v),)),
        ("bincount_len", lambda: (jnp.bincount(v, minlength=20),)),
        ("bincount_w", lambda: (jnp.bincount(v, weights=f, length=6),)),
        ("bincount_wi", lambda: (jnp.bincount(v, weights=v),)),
        ("digitize", lambda: jnp.digitize(a, np.array([-1.0, 0.0, 1.0], np.float32))),
        ("digitize_sharded_bins", lambda: jnp.digitize(ai, jnp.sort(v), right=True)),
        # sorts and partitions
        ("lexsort", lambda: jnp.lexsort((ai[:, 0], ai[:, 1]))),
        ("lexsort_2d", lambda: jnp.lexsort((ai, bi), axis=0)),
        ("partition0", lambda: jnp.partition(a, 2, axis=0)),
        ("partition1", lambda: jnp.partition(bi, 1, axis=1)),
        ("argpartition0", lambda: jnp.argpartition(a, 3, axis=0)),
        ("argpartition_i", lambda: jnp.argpartition(bi, 0, axis=1)),
        # scans and differences along a dimension that spans processes
        ("cumsum0", lambda: jnp.cumsum(a, 0)),
        ("cumsum1", lambda: jnp.cumsum(b, 1)),
        ("cumsum_flat_i", lambda: jnp.cumsum(ai)),
        ("cumprod0", lambda: jnp.cumprod(a * 0.5, 0)),
        ("nancumsum0", lambda: jnp.nancumsum(a, 0)),
        ("nancumprod1", lambda: jnp.nancumprod(b, 1)),
        ("cumulative_sum", lambda: jnp.cumulative_sum(bi, axis=1, include_initial=True)),
        ("cummax", lambda: cts.lax.cummax(a, axis=0)),
        ("diff0", lambda: jnp.diff(a, axis=0)),
        ("diff1_n2", lambda: jnp.diff(b, n=2, axis=1)),
        ("diff_i", lambda: jnp.diff(ai, axis=0)),
        ("ediff1d", lambda: jnp.ediff1d(f, to_begin=np.float32(7.0))),
        # counts and the host-planned gathers
        ("count_nonzero", lambda: jnp.count_nonzero(ai, axis=0)),
        ("count_nonzero_all", lambda: jnp.count_nonzero(b)),
        ("nanmax", lambda: jnp.nanmax(a, 0)),
        ("nanmean", lambda: jnp.nanmean(b, 1)),
        ("nanstd", lambda: jnp.nanstd(a, 0)),
        ("any_all", lambda: (jnp.any(ai > 5, 0), jnp.all(bi < 5, 1))),
        ("int_sum_max", lambda: (jnp.sum(ai, 0), jnp.max(bi, 1), jnp.min(ai))),
        ("delete", lambda: jnp.delete(a, np.array([1, 3]), axis=0)),
        ("delete_sharded_obj", lambda: jnp.delete(ai, v[:2], axis=0)),
        ("insert", lambda: jnp.insert(b, 2, 5.0, axis=0)),
        ("compress", lambda: jnp.compress(v > 1, a, axis=0)),
        ("compress_size", lambda: jnp.compress(v > 1, b, axis=0, size=3, fill_value=-2.0)),
        ("extract", lambda: jnp.extract(a > 0, a)),
        ("trim_zeros", lambda: jnp.trim_zeros(v)),
        ("choose", lambda: jnp.choose((ai % 2 == 0).astype(np.int32) * 3 - 1, [a, b * 2.0],
                                      mode="clip")),
        ("choose_raise", lambda: jnp.choose(jnp.abs(ai) % 2, [ai, bi])),
        ("put_along_axis", lambda: jnp.put_along_axis(
            a, jnp.argmin(jnp.nan_to_num(a), 0, keepdims=True), 9.0, axis=0, inplace=False)),
        ("interp", lambda: jnp.interp(a, np.array([-1.0, 0.0, 2.0], np.float32),
                                      np.array([0.0, 1.0, 5.0], np.float32))),
        ("interp_sharded_xp", lambda: jnp.interp(f, jnp.sort(f[:-1]), jnp.cos(f[:-1]))),
        ("ravel_multi_index", lambda: jnp.ravel_multi_index((v, v), (4 * n, 4 * n))),
        ("one_arg_where", lambda: jnp.where(ai > 2)),
        # one_hot of labels sharded over processes: compared on their devices
        ("one_hot", lambda: nn.one_hot(v, 7)),
        ("one_hot_2d_axis1", lambda: nn.one_hot(bi, 6, axis=1, dtype=BF16)),
        ("one_hot_int8_axis0", lambda: nn.one_hot(ai.astype(np.int8), 5, axis=0)),
    ]


def operands(mesh):
    n = mesh.shape["data"]
    g, gi = values(n)
    s2, t2 = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P("model", "data"))
    a, b = cts.device_put(g, s2), cts.device_put(g, t2)
    ai, bi = cts.device_put(gi, s2), cts.device_put(gi, t2)
    v = cts.device_put(np.abs(gi[:, 0]) % 7, NamedSharding(mesh, P("data")))
    f = cts.device_put(np.nan_to_num(g[:, 1], nan=0.5, posinf=3.0),
                       NamedSharding(mesh, P("data")))
    c = cts.device_put(np.nan_to_num(g, nan=1.0).reshape(2 * n, 2, 2 * n) * 0.5,
                       NamedSharding(mesh, P("data", None, "model")))
    return a, b, ai, bi, v, f, c


def computed(mesh, host):
    """({name: value}, {name: the result's PartitionSpec as a string}); ``host(a)`` reads an
    Array whole."""
    out, specs = {}, {}

    def keep(name, y):
        assert isinstance(y, cts.Array) and y.sharding.mesh == mesh, (name, y.sharding)
        out[name] = raw(host(y))
        specs[name] = str(tuple(y.sharding.spec))

    a, b, ai, bi, v, f, c = operands(mesh)
    for name, fn in cases(a, b, ai, bi, v, f, c):
        y = fn()
        for i, yi in enumerate(y if isinstance(y, tuple) else (y,)):
            keep(f"{name}_{i}", yi)
    # bfloat16 order statistics and unique (compared as float32 on the host)
    a16 = a.astype(BF16)
    for name, y in (("median", jnp.median(a16, 0)), ("nanquantile", jnp.nanquantile(a16, 0.4, 1)),
                    ("unique", jnp.unique(a16, return_counts=True)),
                    ("cumsum", jnp.cumsum(a16, 0)), ("nanargmax", jnp.nanargmax(a16, 0))):
        for i, yi in enumerate(y if isinstance(y, tuple) else (y,)):
            keep(f"bf16_{name}_{i}", yi)
    # gradients through the host-planned gathers
    fin = jnp.nan_to_num(a, nan=0.25, posinf=2.0)
    w = np.linspace(-1, 1, fin.size, dtype=np.float32).reshape(fin.shape)
    grads = {
        "median": lambda x: jnp.sum(jnp.median(x, 0) * w[0]),
        "nanquantile": lambda x: jnp.sum(jnp.nanquantile(x, np.float32(0.3), axis=1)),
        "partition": lambda x: jnp.sum(jnp.partition(x, 2, axis=0) * w),
        "unique": lambda x: jnp.sum(jnp.unique(x, size=5) ** 2),
        "cumsum": lambda x: jnp.sum(jnp.cumsum(x, 0) * w),
        "diff": lambda x: jnp.sum(jnp.diff(x, axis=0) ** 2),
        "histogram_w": lambda x: jnp.sum(jnp.histogram(x[:, 0], bins=3, weights=x[:, 1])[0]),
        "xent_one_hot": lambda x: -jnp.sum(nn.log_softmax(x) * nn.one_hot(v, x.shape[1])),
    }
    for name, fn in grads.items():
        val, gr = cts.value_and_grad(fn)(fin)
        out[f"grad_{name}_value"] = np.float32(float(val))
        keep(f"grad_{name}", gr)
    # jit (the scans and differences; the host-planned ones read values, so not under jit):
    # traced once, replayed
    jf = cts.jit(lambda x: (jnp.cumsum(x, 0), jnp.diff(x, axis=0), jnp.nancumsum(x, 1)))
    for i in range(2):
        for k, yk in enumerate(jf(fin * float(i + 1))):
            keep(f"jit_{i}_{k}", yk)
    # one_hot under jit: the labels' compare recorded, replayed on new labels
    jh = cts.jit(lambda x, i: (nn.one_hot(i, 7) * 2.0, nn.one_hot(i[:, None], x.shape[1]) + x))
    for i, lab in enumerate((v, (v + 3) % 7)):
        for k, yk in enumerate(jh(fin, lab)):
            keep(f"jit_one_hot_{i}_{k}", yk)
    return out, specs


def numpy_checks(mesh, gather) -> int:
    """The integer and exact results against numpy on the global value (``gather(a)``
    reads an Array whole); the number of checks."""
    n = mesh.shape["data"]
    g, gi = values(n)
    a, b, ai, bi, v, f, c = operands(mesh)
    vh = np.abs(gi[:, 0]) % 7
    want_got = [
        (np.unique(gi, return_index=True, return_inverse=True, return_counts=True),
         jnp.unique(ai, return_index=True, return_inverse=True, return_counts=True)),
        (np.unique(gi, axis=0), jnp.unique(bi, axis=0)),
        (np.nanargmax(g[:-1], 0), jnp.nanargmax(a[:-1], 0)),
        (np.nanargmin(g[:-1], 1), jnp.nanargmin(b, 1)[:-1]),
        (np.quantile(gi, 0.3, axis=0, method="lower"), jnp.quantile(ai, 0.3, 0, method="lower")),
        (np.median(gi, 1), jnp.median(bi, 1)),
        (np.bincount(vh, minlength=9), jnp.bincount(v, minlength=9)),
        (np.histogram(g, bins=4, range=(-2, 2))[0], jnp.histogram(a, bins=4, range=(-2, 2))[0]),
        (np.digitize(g, np.array([-1.0, 0.0, 1.0])), jnp.digitize(b, np.array([-1.0, 0.0, 1.0]))),
        (np.isin(gi, vh), jnp.isin(ai, v)),
        (np.setdiff1d(gi, vh), jnp.setdiff1d(bi, v)),
        (np.union1d(gi, vh), jnp.union1d(ai, v)),
        (np.intersect1d(gi, vh), jnp.intersect1d(bi, v)),
        (np.setxor1d(gi, vh), jnp.setxor1d(ai, v)),
        (np.lexsort((gi[:, 0], gi[:, 1])), jnp.lexsort((ai[:, 0], bi[:, 1]))),
        (np.partition(gi, 2, axis=0)[2], jnp.partition(ai, 2, axis=0)[2]),
        (np.cumsum(gi, 0), jnp.cumsum(ai, 0)),
        (np.cumsum(gi, 1), jnp.cumsum(bi, 1)),
        (np.diff(gi, 2, axis=0), jnp.diff(bi, 2, axis=0)),
        (np.count_nonzero(gi, 0), jnp.count_nonzero(ai, 0)),
        (np.sum(gi, 0), jnp.sum(bi, 0)),
        (np.max(gi, 1), jnp.max(ai, 1)),
        (np.nonzero(gi > 2), jnp.where(bi > 2)),
        ((vh[:, None] == np.arange(7)).astype(np.float32), nn.one_hot(v, 7)),
        (np.moveaxis(gi[..., None] == np.arange(4), -1, 0).astype(np.float32),
         nn.one_hot(bi, 4, axis=0)),
    ]
    checks = 0
    for k, (want, got) in enumerate(want_got):
        want = want if isinstance(want, tuple) else (want,)
        got = got if isinstance(got, tuple) else (got,)
        assert len(want) == len(got), k
        for w, y in zip(want, got):
            y = gather(y)
            w = np.asarray(w).reshape(-1) if y.ndim == 1 and np.ndim(w) > 1 else np.asarray(w)
            assert y.shape == w.shape and np.array_equal(y, w), (k, y, w)
            checks += 1
    return checks


def reference(path):
    n = cts.device_count() // 2
    save_reference(path, n, *computed(cts.make_mesh((n, 2), ("data", "model")), np.asarray))


def main(ref_path):
    from ctrainstate import distributed as dist
    from ctrainstate.experimental import multihost_utils as mhu

    start(dist)
    me, n = cts.process_index(), cts.process_count()
    mesh = cts.make_mesh((n, 2), ("data", "model"))
    checks = numpy_checks(mesh, mhu.process_allgather)
    checks += compare(*computed(mesh, mhu.process_allgather), np.load(ref_path))
    finish(dist, me, n, checks)


if __name__ == "__main__":
    run(main, reference)
