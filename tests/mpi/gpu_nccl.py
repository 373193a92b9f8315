"""Run under mpirun by tools/cuda_emu.sh (its mpi_gpu2 run), each process with one emulated
GPU: all-reduces across processes of Arrays over a global mesh of the processes' GPUs go
through NCCL communicators across processes (ncclCommInitRank, the unique id broadcast through
the MPI engine), and give the bits of the host path (CTRAINSTATE_NO_NCCL=1: the blocks gathered
through MPI). The same job computes both: first through NCCL, then through the host.

    mpirun -n 2 python tests/mpi/gpu_nccl.py     # CTRAINSTATE_CUDA_BACKEND: the emulated build

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


def main():
    dist.initialize(timeout=60)
    me, n = dist.process_index(), dist.process_count()
    gpus = [d for d in cts.devices() if d.platform == "gpu"]
    assert len(gpus) == n and {d.process_index for d in gpus} == set(range(n)), gpus
    mesh = cts.sharding.Mesh(np.array(gpus), ("data",))
    checks = 0

    nccl = computed(mesh)
    stats = _ops.nccl_process_stats()
    assert stats["available"] is True, stats
    assert stats["communicators"] == 1 and stats["allreduces"] >= 8, stats
    ranks, colls = emu_proc_stats()
    assert ranks == 1 and colls == stats["allreduces"], (ranks, colls, stats)
    checks += 2

    # the host path: every process turns NCCL off (the engine asks again, all together)
    os.environ["CTRAINSTATE_NO_NCCL"] = "1"
    _ops._NCCL_PROCS["ok"] = None
    host = computed(mesh)
    after = _ops.nccl_process_stats()
    assert after["available"] is False and after["allreduces"] == stats["allreduces"], after
    assert emu_proc_stats()[1] == colls
    checks += 1

    # two ranks: NCCL's sum and max are the host's, bit for bit
    assert sorted(nccl) == sorted(host)
    for k in nccl:
        assert nccl[k].dtype == host[k].dtype and nccl[k].shape == host[k].shape, k
        assert nccl[k].tobytes() == host[k].tobytes(), (k, me, nccl[k], host[k])
        checks += 1
    # and against numpy where exact: the maxima
    g = np.random.default_rng(3)
    g = (g.standard_normal((8, 6)) * 10.0 ** g.integers(-2, 3, (8, 6))).astype(np.float32)
    assert nccl["max"] == g.max() and np.array_equal(nccl["max0"], g.max(axis=0))
    np.testing.assert_allclose(nccl["sum"], g.sum(dtype=np.float64), rtol=1e-5)
    checks += 2
    finish(dist, me, n, checks)


if __name__ == "__main__":
    main()
