"""Run under mpirun (tests/distributed/test_distributed_mpi.py), each process with 2 CPU
devices: indexing, slicing, ``concatenate`` / ``stack`` / ``split`` and ``.at[]`` updates of
Arrays *sharded* over a mesh that spans processes (and of Arrays replicated over it), their
gradients and a jitted use, and argmax / argmin, sorts and nonzero of such Arrays, compared bit
for bit with a run of one process that has as many devices as the whole job (the reference run
writes its values and its results' shardings), and the basic indices and joins also with
numpy on the global value. The same runs check tests/mpi/global_numpy.py's cases (the
jax.numpy functions that plan on the host: unique, quantiles, histogram, sets, ...): one
reference run and one mpirun for both scripts.

    python tests/mpi/global_slicing.py --reference ref.npz   # one process, 2 * N devices
    mpirun -n N python tests/mpi/global_slicing.py ref.npz   # N processes, 2 devices each

Each process prints "OK <process> <count> <checks>" at the end (and writes it to a file in
CT_TEST_OUT); any failure raises (non-zero exit).
"""
import numpy as np

import global_numpy
from report import compare, finish, raw, run, save_reference, start

import ctrainstate as cts
import ctrainstate.numpy as jnp
from ctrainstate import NamedSharding, P

BF16 = jnp.bfloat16


def values(n):
    """The global values (host), the same in every run."""
    rng = np.random.default_rng(0)
    g = rng.standard_normal((4 * n, 2 * n)).astype(np.float32)
    g[0, 0], g[1, 1] = -0.0, np.inf                 # bits that copies must keep
    h = rng.standard_normal((2 * n, 4, 6)).astype(np.float32)
    return g, h


def basic_cases(n):
    """(name, fn(a, b, c, cat)): basic indices and joins of the 2-d ``a`` (sharded over
    ('data', 'model')), ``b`` (the same value over ('model', 'data')) and the 3-d ``c``
    (('data', None, 'model')); ``cat`` is jnp.concatenate or np.concatenate, so each runs
    on Arrays and on numpy arrays alike."""
    return [
        ("int_sharded", lambda a, b, c, cat: a[1]),
        ("int_neg", lambda a, b, c, cat: a[-1, 2]),
        ("rows_sharded_dim", lambda a, b, c, cat: a[1:3]),
        ("rows_across_blocks", lambda a, b, c, cat: a[3:4 * n - 2]),
        ("cols_model_dim", lambda a, b, c, cat: a[:, 1:]),
        ("cols_block", lambda a, b, c, cat: a[:, :2]),
        ("both", lambda a, b, c, cat: a[1:-1, 1:2 * n - 1]),
        ("empty", lambda a, b, c, cat: a[2:2]),
        ("whole", lambda a, b, c, cat: a[:]),
        ("ellipsis", lambda a, b, c, cat: a[...]),
        ("none_ellipsis", lambda a, b, c, cat: a[None, ..., 1:2]),
        ("transposed_mesh", lambda a, b, c, cat: b[2:, 0]),
        ("3d_int_ellipsis", lambda a, b, c, cat: c[..., 3]),
        ("3d_mid", lambda a, b, c, cat: c[:, 1:3]),
        ("3d_mixed", lambda a, b, c, cat: c[1, None, :, 2:5]),
        ("3d_keep_sharded", lambda a, b, c, cat: c[:, 2]),
        ("cat_sharded_axis", lambda a, b, c, cat: cat([a, a[1:], b], 0)),
        ("cat_unsharded_axis", lambda a, b, c, cat: cat([c, c[:, :1]], 1)),
        ("cat_model_axis", lambda a, b, c, cat: cat([a, b[:, :1], a], 1)),
        ("cat_3d_last", lambda a, b, c, cat: cat([c, c], -1)),
    ]


IDX = np.array([0, 3, 1, 3, -1])


def advanced_cases(n, idx_array, mask_array):
    """(name, fn(a)): advanced indices (steps, index arrays, masks; Arrays sharded over
    processes as indices too) and .at[] updates, compared with the one-process run."""
    return [
        ("step_rev", lambda a: a[::-1]),
        ("step_2d", lambda a: a[1::3, ::-2]),
        ("take_rows", lambda a: a[IDX]),
        ("take_clamped", lambda a: a[np.array([0, 99, -1])]),
        ("take_cols", lambda a: a[:, [1, 0, 1]]),
        ("take_pairs", lambda a: a[[1, 2], [0, 1]]),
        ("take_fn", lambda a: jnp.take(a, np.array([2, 0]), axis=1)),
        ("mask_host", lambda a: a[np.arange(a.shape[0]) % 3 == 1]),
        ("index_array_sharded", lambda a: a[idx_array]),
        ("mask_array_sharded", lambda a: a[mask_array]),
        ("at_set_row", lambda a: a.at[1].set(5.0)),
        ("at_add_block", lambda a: a.at[1:3, :1].add(1.5)),
        ("at_add_dup", lambda a: a.at[IDX].add(1.5)),
        ("at_set_cols", lambda a: a.at[:, [0, 2]].set(-1.0)),
        ("at_mul", lambda a: a.at[IDX, 1].multiply(3.0)),
        ("at_get", lambda a: a.at[np.array([0, 99])].get(mode="fill", fill_value=7.0)),
        ("stack", lambda a: jnp.stack([a, a * 2], 1)),
        ("split", lambda a: jnp.split(a, 2, 0)[1]),
        ("array_split", lambda a: jnp.array_split(a, 3, 1)[0]),
    ]


def order_cases(a, c):
    """(name, fn()): argmax / argmin and the sorts of ``a`` (sharded over ('data', 'model'))
    and the 3-d ``c`` (('data', None, 'model'))."""
    return [
        ("argmax0", lambda: jnp.argmax(a, 0)),
        ("argmax1", lambda: jnp.argmax(a, axis=1)),
        ("argmin0_keep", lambda: jnp.argmin(a, 0, keepdims=True)),
        ("argmax_all", lambda: jnp.argmax(a)),
        ("argmin_3d", lambda: jnp.argmin(c, 2)),
        ("sort0", lambda: jnp.sort(a, 0)),
        ("sort_desc", lambda: jnp.sort(a, 1, descending=True)),
        ("sort_flat", lambda: jnp.sort(c, axis=None)),
        ("argsort0", lambda: jnp.argsort(a, 0)),
        ("argsort_desc", lambda: jnp.argsort(c, 0, descending=True)),
        ("lax_sort", lambda: cts.lax.sort(a, dimension=0)),
    ]


def typed(v, dt):
    """``v`` as dtype ``dt`` (ints: ten times the values, 99 for inf; bool: v > 0)."""
    if dt == np.int32:
        return np.where(np.isfinite(v), v * 10, 99).astype(np.int32)
    return v > 0 if dt == np.bool_ else v.astype(dt)


def computed(mesh, host):
    """({name: value}, {name: the result's PartitionSpec as a string}); ``host(a)`` reads an
    Array whole."""
    n = mesh.shape["data"]
    g, h = values(n)
    out, specs = {}, {}

    def keep(name, y):
        assert isinstance(y, cts.Array) and y.sharding.mesh == mesh, name
        out[name] = raw(host(y))
        specs[name] = str(tuple(y.sharding.spec))

    for dt in (np.float32, np.int32, BF16, np.bool_):
        a = cts.device_put(typed(g, dt), NamedSharding(mesh, P("data", "model")))
        b = cts.device_put(typed(g, dt), NamedSharding(mesh, P("model", "data")))
        c = cts.device_put(typed(h, dt), NamedSharding(mesh, P("data", None, "model")))
        tag = np.dtype(dt).name
        for name, f in basic_cases(n):
            keep(f"{tag}_{name}", f(a, b, c, jnp.concatenate))
        idx_array = cts.device_put(np.array([3, 1, 0, 3] * n, np.int32),
                                   NamedSharding(mesh, P("data")))
        mask_array = a.astype(np.float32) > 0.5 if dt != np.bool_ else a
        for name, f in advanced_cases(n, idx_array, mask_array):
            if dt not in (np.float32, BF16) and name.startswith("at_") and name not in (
                    "at_set_row", "at_add_block", "at_get"):
                continue    # integer / bool updates: basic indices only (as in one process)
            if dt == np.bool_ and name in ("at_add_block", "at_get"):
                continue
            keep(f"{tag}_{name}", f(a))
    # replicated over the processes (each holds it whole), and mixed with a sharded one
    r = cts.device_put(g, NamedSharding(mesh, P(None, "model")))
    a = cts.device_put(g, NamedSharding(mesh, P("data", "model")))
    keep("replicated_slice", r[1:, :1])
    keep("replicated_take", r[IDX])
    keep("replicated_cat_sharded", jnp.concatenate([r, a, np.ones((1, 2 * n), np.float32)], 0))
    # ops built on slices, joins and row gathers
    others = {
        "take_along_axis": lambda: jnp.take_along_axis(a, np.array([[1], [0]] * 2 * n), 1),
        "dynamic_slice": lambda: cts.lax.dynamic_slice(a, (1, 1), (2, 2)),
        "dynamic_update_slice": lambda: cts.lax.dynamic_update_slice(
            a, np.ones((2, 2), np.float32), (1, 0)),
        "pad": lambda: jnp.pad(a, 1), "roll": lambda: jnp.roll(a, 1, 0),
        "flip": lambda: jnp.flip(a, 0), "tril": lambda: jnp.tril(a),
        "hstack": lambda: jnp.hstack([a, a]), "vstack": lambda: jnp.vstack([a, a]),
    }
    for name, f in others.items():
        keep(f"other_{name}", f())
    # the index and order ops: argmax / argmin along (and over) dimensions sharded over
    # processes, sort / argsort / lax.sort, nonzero and one-argument where (NaNs, -0.0, inf
    # and ties included; bool values are mostly ties)
    gn = g.copy()
    gn[3, 0], gn[-1, 1] = np.nan, np.nan
    for dt in (np.float32, np.int32, BF16, np.bool_):
        an = cts.device_put(typed(gn, dt), NamedSharding(mesh, P("data", "model")))
        cn = cts.device_put(typed(h, dt), NamedSharding(mesh, P("data", None, "model")))
        tag = np.dtype(dt).name
        for name, f in order_cases(an, cn):
            y = f()
            for i, yi in enumerate(y if isinstance(y, tuple) else (y,)):
                keep(f"{tag}_{name}_{i}", yi)
    x = cts.device_put(gn, NamedSharding(mesh, P("data", "model")))
    xs = cts.device_put(np.sort(gn[:, 0]), NamedSharding(mesh, P("data")))
    for name, f in (("nonzero", lambda: jnp.nonzero(x > 0.5)),
                    ("nonzero_size", lambda: jnp.nonzero(x > 0.5, size=5, fill_value=-1)),
                    ("where1", lambda: jnp.where(x < -0.5)),
                    ("argwhere", lambda: (jnp.argwhere(x > 1.0),)),
                    ("flatnonzero", lambda: (jnp.flatnonzero(x > 1.0),)),
                    ("lax_sort_pair", lambda: cts.lax.sort((a, x), dimension=0, num_keys=2)),
                    ("top_k", lambda: cts.lax.top_k(x, 2)),
                    ("searchsorted", lambda: (jnp.searchsorted(xs, x[:, 1]),
                                              jnp.searchsorted(xs, x[:, 1], side="right")))):
        for i, yi in enumerate(f()):
            keep(f"index_{name}_{i}", yi)
    ws = np.linspace(-1, 1, 8 * n * n, dtype=np.float32).reshape(4 * n, 2 * n)
    val, gr = cts.value_and_grad(lambda v: jnp.sum(jnp.sort(v, 0) * ws))(x)
    out["grad_sort_value"] = np.float32(float(val))
    keep("grad_sort", gr)
    # gradients (float32 and bfloat16): the cotangents of slices, joins and updates
    w = np.linspace(-1, 1, 8 * n * n, dtype=np.float32).reshape(4 * n, 2 * n)
    grads = {
        "int": lambda x: x[1] * 3.0,
        "slice": lambda x: x[1:, 1:] ** 2,
        "none": lambda x: x[None, ..., 0] * x[None, ..., -1],
        "cat": lambda x: jnp.concatenate([x, x[1:] * 2.0, x], 0) ** 2,
        "cat1": lambda x: jnp.concatenate([x[:, :1], x], 1) ** 2,
        "step": lambda x: x[::-1, ::2] * w[::-1, ::2],
        "take": lambda x: x[IDX] ** 2,
        "at_set": lambda x: x.at[1:3].set(x[:2] * 2.0) ** 2,
        "at_add": lambda x: x.at[IDX].add(x[:5] * 0.5) * w,
    }
    for dt in (np.float32, BF16):
        x0 = cts.device_put(typed(g, dt), NamedSharding(mesh, P("data", "model")))
        for name, f in grads.items():
            val, gr = cts.value_and_grad(
                lambda x: jnp.sum(jnp.where(jnp.isfinite(f(x).astype(np.float32)),
                                            f(x).astype(np.float32), 0.0)))(x0)
            out[f"grad_{np.dtype(dt).name}_{name}_value"] = np.float32(float(val))
            keep(f"grad_{np.dtype(dt).name}_{name}", gr)
    val, gr = cts.value_and_grad(lambda x: jnp.sum(x[1:, :1] ** 2))(r)
    out["grad_replicated_value"] = np.float32(float(val))
    keep("grad_replicated", gr)
    # jit: traced once, replayed
    jf = cts.jit(lambda x: jnp.concatenate([x[1:, :1] * 2.0, x[:-1, 1:]], 1)[::-1])
    jg = cts.jit(cts.value_and_grad(lambda x: jnp.sum(x[1:, None, 1] ** 2)
                                    + jnp.sum(x.at[0].add(1.0)[IDX])))
    for i in range(2):
        keep(f"jit_{i}", jf(a * float(i + 1)))
        val, gr = jg(a * float(i + 1))
        out[f"jit_grad_{i}_value"] = np.float32(float(val))
        keep(f"jit_grad_{i}", gr)
    return out, specs


def everything(mesh, host):
    """:func:`computed`'s values and shardings, and those of tests/mpi/global_numpy.py (named
    ``numpy_...``)."""
    out, specs = computed(mesh, host)
    more, more_specs = global_numpy.computed(mesh, host)
    out.update({f"numpy_{k}": v for k, v in more.items()})
    specs.update({f"numpy_{k}": v for k, v in more_specs.items()})
    return out, specs


def reference(path):
    n = cts.device_count() // 2
    save_reference(path, n, *everything(cts.make_mesh((n, 2), ("data", "model")), np.asarray))


def main(ref_path):
    from ctrainstate import distributed as dist
    from ctrainstate.experimental import multihost_utils as mhu

    start(dist)
    me, n = cts.process_index(), cts.process_count()
    mesh = cts.make_mesh((n, 2), ("data", "model"))
    checks = 0

    # the basic indices and joins, against numpy on the global value
    g, h = values(n)
    for dt in (np.float32, np.int32, BF16, np.bool_):
        s2 = NamedSharding(mesh, P("data", "model"))
        a = cts.device_put(typed(g, dt), s2)
        b = cts.device_put(typed(g, dt), NamedSharding(mesh, P("model", "data")))
        c = cts.device_put(typed(h, dt), NamedSharding(mesh, P("data", None, "model")))
        assert n == 1 or not (a.is_fully_addressable or c.is_fully_addressable)
        for name, f in basic_cases(n):
            y = f(a, b, c, jnp.concatenate)
            want = f(typed(g, dt), typed(g, dt), typed(h, dt), np.concatenate)
            got = mhu.process_allgather(y)
            assert got.dtype == want.dtype and got.shape == want.shape, (dt, name, got.shape)
            assert got.tobytes() == np.ascontiguousarray(want).tobytes(), (dt, name)
            checks += 1
    # the documented layouts: a sliced / joined dimension comes out unsharded, the others
    # keep their mesh axes
    a = cts.device_put(g, NamedSharding(mesh, P("data", "model")))
    c = cts.device_put(h, NamedSharding(mesh, P("data", None, "model")))
    for y, spec in ((a[1:3], P(None, "model")), (a[:, 1:], P("data")), (a[1], P("model")),
                    (c[:, 1:3], P("data", None, "model")), (c[..., 3], P("data")),
                    (jnp.concatenate([a, a], 1), P("data")),
                    (jnp.concatenate([c, c], 1), P("data", None, "model"))):
        assert y.sharding == NamedSharding(mesh, spec), (y.sharding, spec)
        checks += 1

    # global_numpy.py's integer and exact results, against numpy on the global value
    checks += global_numpy.numpy_checks(mesh, mhu.process_allgather)

    # everything, against the one-process run: values and shardings
    checks += compare(*everything(mesh, mhu.process_allgather), np.load(ref_path))
    # a sharded Array spanning processes: the result holds only this process's blocks
    if n > 1:
        y = a[1:]
        assert not y.is_fully_addressable
        assert {d for d, _, _, _ in y._blocks} == set(cts.local_devices())
        checks += 1
    finish(dist, me, n, checks)


if __name__ == "__main__":
    run(main, reference)
