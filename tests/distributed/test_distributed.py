"""ctrainstate.distributed and experimental.multihost_utils in one process, without MPI:
launcher detection from environments (monkeypatched), argument checks of initialize (all
raise before MPI is loaded), errors before initialize, the bindings' argument checks, the
errors for a missing or foreign MPI library (in a child process), and multihost_utils as a
job of one. The multi-process tests are in test_distributed_mpi.py."""
import math

import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import _C
from ctrainstate import distributed as dist
from ctrainstate._src.distributed import distributed as _impl
from ctrainstate.experimental import multihost_utils as mhu
from conftest import run_python

_LAUNCHER_VARS = ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                  "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "SLURM_PROCID", "SLURM_NTASKS",
                  "SLURM_LOCALID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                  "MASTER_PORT"]


@pytest.fixture
def no_launcher(monkeypatch):
    for v in _LAUNCHER_VARS + ["CTRAINSTATE_DIST_TIMEOUT"]:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


# --- launcher detection ------------------------------------------------------------------

DETECT = [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
     (3, 4, 1, None, "Open MPI")),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, (1, 2, None, None, "MPICH")),
    ({"PMI_RANK": "0", "PMI_SIZE": "8", "MPI_LOCALRANKID": "0"}, (0, 8, 0, None, "MPICH")),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2"}, (5, 6, 2, None, "Slurm")),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "node7",
      "MASTER_PORT": "29500"}, (1, 2, 1, "node7:29500", "torchrun")),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "10.1.2.3"}, (0, 1, None, "10.1.2.3", "torchrun")),
    # mpirun inside a Slurm allocation: the allocation's SLURM_* stay in the environment
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "OMPI_COMM_WORLD_RANK": "1",
      "OMPI_COMM_WORLD_SIZE": "2"}, (1, 2, None, None, "Open MPI")),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "RANK": "0", "WORLD_SIZE": "2"}, (1, 2, None, None, "MPICH")),
    ({" RANK": "1", "WORLD_SIZE": "2"}, None),          # no RANK: not a launch
    ({"RANK": "1"}, None),                              # RANK alone is not a launch
    ({"OMPI_COMM_WORLD_RANK": "0"}, None),
    ({}, None),
]


@pytest.mark.parametrize("env,want", DETECT)
def test_detect_environment(env, want):
    got = _impl._detect_environment(env)
    if want is None:
        assert got is None
        return
    pid, n, local, coord, source = want
    assert (got["process_id"], got["num_processes"], got["local_rank"],
            got["coordinator_address"]) == (pid, n, local, coord)
    assert got["source"].startswith(source), got["source"]


@pytest.mark.parametrize("env,match", [
    ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK='x'.*not an integer"),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"}, "not below OMPI_COMM_WORLD_SIZE=2"),
    ({"PMI_RANK": "-1", "PMI_SIZE": "2"}, "PMI_RANK='-1'.*negative"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}, "SLURM_NTASKS='0'.*at least 1"),
    ({"RANK": "0", "WORLD_SIZE": "2.5"}, "WORLD_SIZE='2.5'.*not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "a"}, "LOCAL_RANK='a'"),
])
def test_detect_environment_rejects_bad_values(env, match):
    with pytest.raises(ValueError, match=match):
        _impl._detect_environment(env)


def test_detect_environment_reads_os_environ(no_launcher):
    assert _impl._detect_environment() is None
    no_launcher.setenv("SLURM_PROCID", "1")
    no_launcher.setenv("SLURM_NTASKS", "3")
    assert _impl._detect_environment()["process_id"] == 1


# --- initialize: argument checks (each raises before MPI is loaded) -------------------

@pytest.mark.parametrize("kwargs,err,match", [
    ({"num_processes": 0, "process_id": 0}, ValueError, "num_processes must be at least 1"),
    ({"num_processes": 2, "process_id": -1}, ValueError, "process_id must be at least 0"),
    ({"num_processes": 2, "process_id": 2}, ValueError, "process_id 2 is not below num_processes 2"),
    ({"num_processes": 2.0, "process_id": 0}, TypeError, "num_processes must be an int"),
    ({"num_processes": True, "process_id": 0}, TypeError, "num_processes must be an int"),
    ({"num_processes": 2, "process_id": "0"}, TypeError, "process_id must be an int"),
    ({"coordinator_address": "host", "num_processes": 1, "process_id": 0}, ValueError, "host:port"),
    ({"coordinator_address": "host:0", "num_processes": 1, "process_id": 0}, ValueError, "1..65535"),
    ({"coordinator_address": "host:99999", "num_processes": 1, "process_id": 0}, ValueError, "1..65535"),
    ({"coordinator_address": 1234, "num_processes": 1, "process_id": 0}, TypeError, "coordinator_address"),
    ({"local_device_ids": [0, 0], "num_processes": 1, "process_id": 0}, ValueError, "duplicates"),
    ({"local_device_ids": [-1], "num_processes": 1, "process_id": 0}, ValueError, "at least 0"),
    ({"local_device_ids": "ab", "num_processes": 1, "process_id": 0}, TypeError, "local_device_ids"),
    ({"local_device_ids": 1.5, "num_processes": 1, "process_id": 0}, TypeError, "local_device_ids"),
    ({"timeout": 0, "num_processes": 1, "process_id": 0}, ValueError, "positive number"),
    ({"timeout": -3, "num_processes": 1, "process_id": 0}, ValueError, "positive number"),
    ({"timeout": math.nan, "num_processes": 1, "process_id": 0}, ValueError, "positive number"),
    ({"timeout": "5", "num_processes": 1, "process_id": 0}, TypeError, "timeout"),
    ({}, ValueError, "found no launcher and was not given num_processes and process_id"),
    ({"num_processes": 2}, ValueError, "was not given process_id"),
    ({"process_id": 0}, ValueError, "was not given num_processes"),
])
def test_initialize_checks_arguments(no_launcher, kwargs, err, match):
    with pytest.raises(err, match=match):
        dist.initialize(**kwargs)
    assert not dist.is_initialized() and not _C.dist_info()["initialized"]


def test_initialize_checks_the_environment(no_launcher):
    no_launcher.setenv("OMPI_COMM_WORLD_RANK", "4")
    no_launcher.setenv("OMPI_COMM_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_RANK=4 is not below"):
        dist.initialize()
    no_launcher.setenv("OMPI_COMM_WORLD_RANK", "1")
    no_launcher.setenv("OMPI_COMM_WORLD_SIZE", "2")
    # an explicit process_id outside the detected world
    with pytest.raises(ValueError, match="process_id 3 is not below num_processes 2"):
        dist.initialize(process_id=3)
    no_launcher.setenv("CTRAINSTATE_DIST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="CTRAINSTATE_DIST_TIMEOUT='soon'"):
        dist.initialize()
    assert not _C.dist_info()["initialized"]


def test_default_timeout(no_launcher):
    assert dist.default_timeout() == 300.0
    no_launcher.setenv("CTRAINSTATE_DIST_TIMEOUT", "12.5")
    assert dist.default_timeout() == 12.5
    no_launcher.setenv("CTRAINSTATE_DIST_TIMEOUT", "-1")
    with pytest.raises(ValueError, match="CTRAINSTATE_DIST_TIMEOUT"):
        dist.default_timeout()


# --- before initialize ------------------------------------------------------------------

def test_not_initialized():
    assert not dist.is_initialized()
    assert (dist.process_index(), dist.process_count()) == (0, 1)
    dist.shutdown()  # nothing to shut down: no error
    x = np.ones(4, np.float32)
    for call in (lambda: dist.allreduce(x), lambda: dist.allgather(x),
                 lambda: dist.reduce_scatter(x), lambda: dist.broadcast(x), dist.barrier,
                 lambda: _C.dist_allreduce(x, x.copy(), "sum", 1.0),
                 lambda: _C.dist_allgather(x, x.copy(), 1.0),
                 lambda: _C.dist_reduce_scatter(x, x.copy(), "sum", 1.0),
                 lambda: _C.dist_broadcast(x, 0, 1.0), lambda: _C.dist_barrier(1.0)):
        with pytest.raises(RuntimeError, match="not initialized; call ctrainstate.distributed"
                                               ".initialize"):
            call()
    info = _C.dist_info()
    assert info["initialized"] is False and info["failure"] is None
    assert (info["process_id"], info["num_processes"]) == (-1, -1)
    assert cts.distributed is dist


def test_import_does_not_load_mpi():
    r = run_python("import ctrainstate, ctrainstate.distributed\n"
                   "from ctrainstate.experimental import multihost_utils\n"
                   "maps = open('/proc/self/maps').read()\n"
                   "print('libmpi' in maps, 'libopen-pal' in maps)")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("args,err,match", [
    ((np.ones(3), [1.0, 2.0, 3.0], "sum", 1.0), TypeError, "recv must be a numpy array"),
    ((np.ones(3, object), np.ones(3, object), "sum", 1.0), TypeError, "Python objects"),
    ((np.ones((3, 2))[:, 0], np.ones(3), "sum", 1.0), ValueError, "C-contiguous"),
    ((np.ones(3), np.ones(3).astype(">f8"), "sum", 1.0), ValueError, "native-order"),
    ((np.ones(3), np.ones(3, np.float32), "sum", 1.0), TypeError, "must be the same"),
    ((np.ones(3), np.ones(4), "sum", 1.0), ValueError, "3 elements and recv 4"),
    ((np.ones(3, bool), np.ones(3, bool), "sum", 1.0), TypeError, "cannot reduce"),
    ((np.ones(3, np.int8), np.ones(3, np.int8), "max", 1.0), TypeError, "cannot reduce"),
    ((np.ones(3), np.ones(3), "prod", 1.0), ValueError, "op must be 'sum', 'max' or 'min'"),
    ((np.ones(3), np.ones(3), 1, 1.0), ValueError, "op must be"),
    ((np.ones(3), np.ones(3), "sum", 0.0), ValueError, "timeout must be a positive"),
    ((np.ones(3), np.ones(3), "sum", math.nan), ValueError, "timeout must be a positive"),
    ((np.ones(3), np.ones(3), "sum", "1"), TypeError, "real number"),
])
def test_allreduce_binding_checks(args, err, match):
    with pytest.raises(err, match=match):
        _C.dist_allreduce(*args)


def test_binding_checks_of_the_other_collectives():
    ro = np.ones(4)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        _C.dist_allreduce(np.ones(4), ro, "sum", 1.0)
    with pytest.raises(ValueError, match="writeable"):
        _C.dist_broadcast(ro, 0, 1.0)
    buf = np.zeros(8)
    with pytest.raises(ValueError, match="overlap without being the same"):
        _C.dist_allreduce(buf[:4], buf[2:6], "sum", 1.0)
    with pytest.raises(ValueError, match="overlap"):
        _C.dist_allgather(buf[:2], buf, 1.0)
    with pytest.raises(ValueError, match="overlap"):
        _C.dist_reduce_scatter(buf, buf[:4], "sum", 1.0)
    with pytest.raises(TypeError, match="must be the same"):
        _C.dist_allgather(np.ones(2, np.int32), np.ones(2, np.uint32), 1.0)
    with pytest.raises(TypeError, match="cannot reduce"):
        _C.dist_reduce_scatter(np.ones(2, np.complex64), np.ones(2, np.complex64), "sum", 1.0)
    with pytest.raises(ValueError, match="timeout"):
        _C.dist_barrier(-1.0)
    with pytest.raises(OverflowError):
        _C.dist_broadcast(np.ones(2), 2 ** 40, 1.0)
    with pytest.raises(TypeError, match="Python objects"):
        _impl._host(np.array([object()]), "x")


def test_library_missing_names_the_package():
    r = run_python("import ctrainstate.distributed as d\n"
                   "try:\n"
                   "    d.initialize(num_processes=1, process_id=0)\n"
                   "except RuntimeError as e:\n"
                   "    print(e)\n"
                   "print(d.is_initialized())",
                   {"CTRAINSTATE_MPI_LIBRARY": "/nonexistent/libmpi.so.40"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "needs an MPI library and none could be loaded" in r.stdout
    assert "/nonexistent/libmpi.so.40" in r.stdout
    assert "apt-get install libopenmpi3 openmpi-bin" in r.stdout
    assert r.stdout.strip().endswith("False")


def test_library_that_is_not_open_mpi():
    # any shared library without Open MPI's symbols: libm
    r = run_python("import ctrainstate.distributed as d\n"
                   "try:\n"
                   "    d.initialize(num_processes=1, process_id=0)\n"
                   "except RuntimeError as e:\n"
                   "    print(e)\n",
                   {"CTRAINSTATE_MPI_LIBRARY": "libm.so.6"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "is not Open MPI (it has no symbol ompi_mpi_comm_world)" in r.stdout
    assert "MPICH" in r.stdout


# --- multihost_utils as a job of one ------------------------------------------------------

def test_multihost_utils_in_one_process():
    tree = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": [np.float32(1.5), 7],
            "c": np.ones(2, ml_dtypes.bfloat16), "d": cts.device_put(np.arange(4.0, dtype=np.float32))}
    got = mhu.process_allgather(tree)
    assert got["a"].shape == (1, 2, 3) and np.array_equal(got["a"][0], tree["a"])
    assert got["b"][0].shape == (1,) and got["b"][0].dtype == np.float32 and got["b"][0][0] == 1.5
    assert got["c"].dtype == ml_dtypes.bfloat16 and got["c"].shape == (1, 2)
    assert isinstance(got["d"], np.ndarray) and np.array_equal(got["d"][0], np.arange(4.0))
    tiled = mhu.process_allgather({"a": tree["a"]}, tiled=True)
    assert np.array_equal(tiled["a"], tree["a"])
    with pytest.raises(ValueError, match="scalar leaf"):
        mhu.process_allgather(np.float32(1), tiled=True)
    b = mhu.broadcast_one_to_all({"x": np.arange(3), "y": 2.5})
    assert np.array_equal(b["x"], np.arange(3)) and b["y"] == 2.5 and b["y"].shape == ()
    src = np.arange(3)
    assert mhu.broadcast_one_to_all(src) is not src
    with pytest.raises(ValueError, match="exactly one process must be the source; none is"):
        mhu.broadcast_one_to_all(np.arange(3), is_source=False)
    mhu.sync_global_devices("one process")
    with pytest.raises(TypeError, match="name must be a str"):
        mhu.sync_global_devices(3)
    mhu.assert_equal({"k": np.arange(3)})
    assert mhu.process_allgather([]) == []
