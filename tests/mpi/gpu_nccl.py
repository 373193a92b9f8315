"""Run under mpirun by tools/cuda_emu.sh (its mpi_gpu2 run), each process with one emulated
GPU: all-reduces across processes of Arrays over a global mesh of the processes' GPUs go
through NCCL communicators across processes (ncclCommInitRank, the unique id broadcast through
the MPI engine), and give the bits of the host path (CTRAINSTATE_NO_NCCL=1: the blocks gathered
through MPI). The same job computes both: first through NCCL, then through the host.

It also runs fused optimizer steps whose reductions combine the processes' GPUs (global norm,
finite gate, trust ratios: per-device partial sums exchanged through the MPI engine; adafactor's
factored statistics: the step staged through the host) and compares them bit for bit with the
same steps on a mesh of the processes' CPU devices (the CPU driver's step across processes),
the clipped AdamW also with numpy.

    mpirun -n 2 python tests/mpi/gpu_nccl.py     # CTRAINSTATE_CUDA_BACKEND: the emulated build

With CT_EMU_NGPU GPUs per process, each split into CTRAINSTATE_GPU_SPLIT logical devices
(CTRAINSTATE_NUM_CPU_DEVICES: as many CPU devices), the mesh holds every logical device of the
job: NCCL then has a rank per GPU (several per process), and with split GPUs its sums group the
logical devices per GPU first, so they are checked against the host path within float32
rounding instead of bit for bit (maxima and the optimizer steps still bit for bit).

Prints "OK <process> <count> <checks>" at the end; any failure raises (non-zero exit).
"""
import ctypes
import os

# each process's emulated GPU its own identity (NCCL refuses two ranks on one GPU)
os.environ.setdefault("CT_EMU_GPU_ID_BASE",
                      str(100 * int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))))

import numpy as np  # noqa: E402

from report import finish  # noqa: E402

import ctrainstate as cts  # noqa: E402
import ctrainstate.numpy as jnp  # noqa: E402
from ctrainstate import NamedSharding, P, optim  # noqa: E402
from ctrainstate import distributed as dist  # noqa: E402
from ctrainstate.experimental import multihost_utils  # noqa: E402
from ctrainstate._src.ops import ops as _ops  # noqa: E402
from ctrainstate.train_state import TrainState  # noqa: E402


def computed(mesh) -> dict:
    """{name: host value} of reductions that all-reduce over the processes' GPUs."""
    rng = np.random.default_rng(3)
    g = (rng.standard_normal((8, 6)) * 10.0 ** rng.integers(-2, 3, (8, 6))).astype(np.float32)
    h = rng.standard_normal((6, 4)).astype(np.float32)
    x = cts.device_put(g, NamedSharding(mesh, P("data", None)))
    w0 = cts.device_put(h, NamedSharding(mesh, P()))
    out = {"sum": jnp.sum(x), "mean0": jnp.mean(x, axis=0), "max": jnp.max(x),
           "max0": jnp.max(x, axis=0), "sumsq": jnp.sum(x * x + 1.0)}

    def loss_fn(params):
        return jnp.mean(jnp.tanh(x @ params["w"]) ** 2)

    state = TrainState.create(apply_fn=None, params={"w": w0}, tx=optim.adam(1e-2))
    for step in range(2):
        loss, grads = cts.value_and_grad(loss_fn)(state.params)
        out[f"loss{step}"], out[f"grad{step}"] = loss, grads["w"]
        state = state.apply_gradients(grads=grads)
    out["w"] = state.params["w"]
    return {k: np.asarray(v) for k, v in out.items()}


def emu_proc_stats() -> list:
    lib = ctypes.CDLL(os.environ["CTRAINSTATE_CUDA_BACKEND"])
    got = (ctypes.c_longlong * 2)()
    lib.cuda_emu_nccl_proc_stats(got)
    return list(got)


def emu_launches(part: str) -> int:
    lib = ctypes.CDLL(os.environ["CTRAINSTATE_CUDA_BACKEND"])
    lib.cuda_emu_launches.restype = ctypes.c_longlong
    return lib.cuda_emu_launches(part.encode())


OPTIMS = {   # name: (transform, whether its step runs the GPU passes, not host staging)
    "clipnorm": (lambda: optim.chain(optim.clip_by_global_norm(1.0),
                                     optim.adamw(1e-2, weight_decay=1e-3)), True),
    "lamb": (lambda: optim.lamb(1e-2, weight_decay=1e-3), True),
    "finite": (lambda: optim.apply_if_finite(optim.adam(1e-2), 2), True),
    "adafactor": (lambda: optim.adafactor(1e-2, min_dim_size_to_factor=4), False),
}


def grads_of(step: int) -> dict:
    rng = np.random.default_rng(10 + step)
    return {"w": (rng.standard_normal((8, 6)) * (1 + step)).astype(np.float32),
            "b": rng.standard_normal(6).astype(np.float32)}


def optimized(mesh, name) -> dict:
    """{name: host value} of two fused steps of OPTIMS[name] over params that span the
    processes of ``mesh`` ("w" sharded over them, "b" replicated)."""
    rng = np.random.default_rng(5)
    shard = {"w": NamedSharding(mesh, P("data", None)), "b": NamedSharding(mesh, P())}
    params = {"w": rng.standard_normal((8, 6)).astype(np.float32),
              "b": rng.standard_normal(6).astype(np.float32)}
    params = {k: cts.device_put(v, shard[k]) for k, v in params.items()}
    state = TrainState.create(apply_fn=None, params=params, tx=OPTIMS[name][0]())
    for step in range(2):
        g = grads_of(step)
        if name == "finite" and step == 0:   # a step the gate rejects
            g["b"][2] = np.inf
        state = state.apply_gradients(grads={k: cts.device_put(v, shard[k])
                                             for k, v in g.items()})
    assert not state.params["w"].is_fully_addressable
    out = {f"param_{k}": v for k, v in state.params.items()}
    for j, v in enumerate(cts.tree_util.tree_leaves(state.opt_state)):
        out[f"state{j}"] = v
    return {k: multihost_utils.process_allgather(v) if isinstance(v, cts.Array)
            else np.asarray(v) for k, v in out.items()}


def adamw_clipped_numpy() -> np.ndarray:
    """OPTIMS["clipnorm"]'s "w" after its two steps, in numpy (float64)."""
    rng = np.random.default_rng(5)
    p = {"w": rng.standard_normal((8, 6)), "b": rng.standard_normal(6)}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t in (1, 2):
        g = {k: x.astype(np.float64) for k, x in grads_of(t - 1).items()}
        norm = np.sqrt(sum(np.sum(x * x) for x in g.values()))
        g = {k: x * min(1.0, 1.0 / norm) for k, x in g.items()}
        for k in p:
            m[k] = 0.9 * m[k] + 0.1 * g[k]
            v[k] = 0.999 * v[k] + 0.001 * g[k] ** 2
            mh, vh = m[k] / (1 - 0.9 ** t), v[k] / (1 - 0.999 ** t)
            p[k] = p[k] - 1e-2 * (mh / (np.sqrt(vh) + 1e-8) + 1e-3 * p[k])
    return p["w"]


def optim_checks(gpu_mesh, cpu_mesh, me) -> int:
    """Fused steps whose reductions span the processes' GPUs, against the CPU devices'."""
    checks = 0
    for name, (_, passes) in OPTIMS.items():
        before = emu_launches("cuda_optim.cu")
        gpu = optimized(gpu_mesh, name)
        launched = emu_launches("cuda_optim.cu") - before
        # the GPU passes ran (a reduction pass and the apply pass per step, at least), or,
        # for adafactor, the step was staged through the host (no optimizer kernel)
        assert (launched >= 4) if passes else (launched == 0), (name, launched)
        cpu = optimized(cpu_mesh, name)
        assert sorted(gpu) == sorted(cpu), name
        for k in gpu:
            assert gpu[k].dtype == cpu[k].dtype and gpu[k].shape == cpu[k].shape, (name, k)
            assert gpu[k].tobytes() == cpu[k].tobytes(), (name, k, me, gpu[k], cpu[k])
        checks += 1
        if name == "clipnorm":
            np.testing.assert_allclose(gpu["param_w"], adamw_clipped_numpy(), rtol=1e-5,
                                       atol=1e-6)
            checks += 1
    return checks


def main():
    dist.initialize(timeout=60)
    me, n = dist.process_index(), dist.process_count()
    ngpu = int(os.environ.get("CT_EMU_NGPU", "1"))
    split = int(os.environ.get("CTRAINSTATE_GPU_SPLIT", "1"))
    gpus = sorted((d for d in cts.devices() if d.platform == "gpu"),
                  key=lambda d: (d.process_index, d.id))
    assert len(gpus) == n * ngpu * split and {d.process_index for d in gpus} == set(range(n)), gpus
    mesh = cts.sharding.Mesh(np.array(gpus), ("data",))
    checks = 0

    nccl = computed(mesh)
    stats = _ops.nccl_process_stats()
    assert stats["available"] is True, stats
    assert stats["communicators"] == 1 and stats["allreduces"] >= 8, stats
    ranks, colls = emu_proc_stats()
    assert ranks == ngpu and colls == stats["allreduces"], (ranks, colls, stats)
    checks += 2

    # the host path: every process turns NCCL off (the engine asks again, all together)
    os.environ["CTRAINSTATE_NO_NCCL"] = "1"
    _ops._NCCL_PROCS["ok"] = None
    host = computed(mesh)
    after = _ops.nccl_process_stats()
    assert after["available"] is False and after["allreduces"] == stats["allreduces"], after
    assert emu_proc_stats()[1] == colls
    checks += 1

    # whole GPUs: NCCL's sum and max are the host's, bit for bit; split GPUs: maxima
    assert sorted(nccl) == sorted(host)
    for k in nccl:
        assert nccl[k].dtype == host[k].dtype and nccl[k].shape == host[k].shape, k
        if split == 1 or k.startswith("max"):
            assert nccl[k].tobytes() == host[k].tobytes(), (k, me, nccl[k], host[k])
        else:
            np.testing.assert_allclose(nccl[k], host[k], rtol=1e-5,
                                       atol=1e-6 * float(np.abs(host[k]).max()), err_msg=k)
        checks += 1
    # and against numpy where exact: the maxima
    g = np.random.default_rng(3)
    g = (g.standard_normal((8, 6)) * 10.0 ** g.integers(-2, 3, (8, 6))).astype(np.float32)
    assert nccl["max"] == g.max() and np.array_equal(nccl["max0"], g.max(axis=0))
    np.testing.assert_allclose(nccl["sum"], g.sum(dtype=np.float64), rtol=1e-5)
    checks += 2

    cpus = sorted(cts.devices("cpu"), key=lambda d: (d.process_index, d.id))
    assert len(cpus) == len(gpus), cpus
    checks += optim_checks(mesh, cts.sharding.Mesh(np.array(cpus), ("data",)), me)
    finish(dist, me, n, checks)


if __name__ == "__main__":
    main()
