"""ctrainstate.distributed across processes, on Open MPI: the scripts in tests/mpi/ under
`mpirun -n 2` and `mpirun -n 4 --oversubscribe` (each process with 2 CPU devices), a process
that dies or hangs mid-collective, Ctrl-C, and MPI started without a launcher (a world of
one) in a child process.

Run with CTRAINSTATE_TEST_MPI=1 (about a minute on 2 cores: CI runs them in a stage of their
own; the README's test command leaves them out) and Open MPI installed (Debian: apt-get
install openmpi-bin libopenmpi-dev). The single-process tests are in test_distributed.py.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "tests", "mpi")

pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None,
                       reason="mpirun not found: install Open MPI (Debian: apt-get install "
                              "openmpi-bin libopenmpi-dev) to run the multi-process tests"),
    pytest.mark.skipif(os.environ.get("CTRAINSTATE_TEST_MPI") != "1",
                       reason="multi-process tests run with CTRAINSTATE_TEST_MPI=1 (about a "
                              "minute; CI runs them in their own stage)"),
    pytest.mark.skipif(os.environ.get("CTRAINSTATE_SANITIZED") == "1",
                       reason="mpirun and Open MPI are not built for ASan, whose LD_PRELOAD "
                              "would reach them"),
]


def _env(**extra):
    e = dict(os.environ)
    for k in list(e):
        if k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_")) or k in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            del e[k]
    e["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "python")] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    e.update(CTRAINSTATE_NUM_CPU_DEVICES="2", OMPI_ALLOW_RUN_AS_ROOT="1",
             OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    e.update(extra)
    return e


def _mpirun(n, *args, flags=(), timeout=120, out=None):
    """Run a script under mpirun: (CompletedProcess, seconds, what the processes reported).
    The scripts write their result lines to files in `out` too (CT_TEST_OUT), one per
    process, since mpirun's forwarding of their output may merge lines."""
    cmd = ["mpirun", "-n", str(n), "--oversubscribe", *flags, sys.executable, *args]
    env = _env(CT_TEST_OUT=str(out)) if out is not None else _env()
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    lines = ""
    if out is not None:
        lines = "".join(open(os.path.join(out, f)).read() for f in sorted(os.listdir(out)))
    return r, time.monotonic() - t0, lines


def _oks(lines, n):
    """The processes that reported OK (their index), in order."""
    return sorted(int(m.group(1)) for m in re.finditer(rf"^OK (\d+) {n} (\d+)$", lines, re.M))


def _run_checks(n, *args, out):
    """A tests/mpi script under mpirun -n n: every process must exit 0 and report OK; the
    number of checks each ran."""
    r, _, lines = _mpirun(n, *args, out=out)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-6000:]
    assert _oks(lines, n) == list(range(n)), text[-6000:]
    return [int(m.group(1)) for m in re.finditer(r"^OK \d+ \d+ (\d+)$", lines, re.M)]


@pytest.mark.parametrize("n", [2, 4])
def test_every_collective_across_processes(n, tmp_path):
    counts = set(_run_checks(n, os.path.join(SCRIPTS, "collectives.py"), out=tmp_path))
    assert len(counts) == 1 and counts.pop() > 150  # the same checks ran everywhere


@pytest.mark.parametrize("n", [2, 3])
def test_reductions_add_in_process_order_in_every_path(n, tmp_path):
    # tests/mpi/reductions.py: real-valued data, compared bytewise with numpy adding the
    # processes' buffers in process order: small and large all-reduces, in place and not,
    # reduce-scatter, NaN through max / min, sizes growing and shrinking between calls
    counts = set(_run_checks(n, os.path.join(SCRIPTS, "reductions.py"), out=tmp_path))
    assert counts == {324}, counts   # every check ran everywhere


@pytest.fixture(scope="module")
def global_job(tmp_path_factory):
    """job(n): tests/mpi/global_all.py's reference run (one process of 2 * n devices) and its
    mpirun -n n, run once for the three scripts it runs (each process's start costs more than
    most scripts' checks): (the reference run, the mpirun, the result lines)."""
    jobs = {}

    def job(n):
        if n not in jobs:
            d = tmp_path_factory.mktemp(f"global{n}")
            script = os.path.join(SCRIPTS, "global_all.py")
            ref = subprocess.run([sys.executable, script, "--reference", str(d / "ref")],
                                 capture_output=True, text=True, timeout=180, cwd=ROOT,
                                 env=_env(CTRAINSTATE_NUM_CPU_DEVICES=str(2 * n)))
            (d / "out").mkdir()
            run = (_mpirun(n, script, str(d / "ref"), timeout=240, out=d / "out")
                   if ref.returncode == 0 else None)
            jobs[n] = ref, run
        return jobs[n]
    return job


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("script, least", [("global_arrays.py", 70), ("global_ops.py", 180),
                                           ("global_slicing.py", 400)])
def test_global_arrays_and_training_across_processes(script, least, n, global_job):
    # tests/mpi/global_arrays.py: global devices, Arrays spanning processes, the
    # make_array_from_* placements, multihost_utils on them, born-sharded params;
    # tests/mpi/global_ops.py: operations on such Arrays and training steps (the fused
    # optimizer's global norm, finite gate, trust ratios and adafactor included);
    # tests/mpi/global_slicing.py: indexing, slicing, joins and .at[] updates of Arrays
    # sharded over processes, their gradients and jit, and argmax / sorts / nonzero; it runs
    # tests/mpi/global_numpy.py's cases too (unique, quantiles, histogram, the set
    # operations, scans: the jax.numpy functions that plan on the host), in the same
    # reference run and mpirun. Each compares what it computed
    # (gathered) bit for bit with one process of 2 * n devices (the reference run of the
    # same script). The three run in one job (tests/mpi/global_all.py), each script's checks
    # counted apart
    ref, run = global_job(n)
    assert ref.returncode == 0 and f"REFERENCE {n} " in ref.stdout, ref.stdout + ref.stderr[-4000:]
    r, _, lines = run
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-6000:]
    counts = {int(p): int(c) for p, c in
              re.findall(rf"^OK (\d+) {n} (\d+) {re.escape(script)}$", lines, re.M)}
    assert sorted(counts) == list(range(n)), text[-6000:]
    assert min(counts.values()) > least, counts   # the checks ran


TIMEOUT = 3.0
SLACK = 2.5  # a loaded 2-core machine: scheduling, and the poll interval


def _raised(stdout):
    """{process: (exception type, seconds waited, failure kind)} from fault.py's RAISED lines
    (the seconds of the collective that raised)."""
    return {int(m.group(1)): (m.group(2), float(m.group(3)), m.group(4))
            for m in re.finditer(r"^RAISED (\d+) (\w+) ([\d.]+) (\w+) ", stdout, re.M)}


def test_a_process_that_exits_mid_collective_makes_the_others_raise(tmp_path):
    # process 1 exits while in an allreduce that process 3 has not yet joined. Under
    # --enable-recovery mpirun keeps the survivors running (plain mpirun ends them itself when
    # a process dies). A survivor whose part had completed before process 1 died goes on to
    # the next allreduce; each survivor raises within the timeout of the collective it is in,
    # within its first two collectives, and none waits longer
    r, wall, lines = _mpirun(4, os.path.join(SCRIPTS, "fault.py"), "exit", str(TIMEOUT),
                             flags=("--enable-recovery",), timeout=90, out=tmp_path)
    out = lines + r.stdout[-3000:] + r.stderr[-2000:]
    raised = _raised(lines)
    assert set(raised) == {0, 2, 3}, out
    assert "COMPLETED" not in lines, out
    for p, (kind, waited, failure) in raised.items():
        assert kind in ("TimeoutError", "RuntimeError"), out
        assert failure == ("timeout" if kind == "TimeoutError" else "mpi"), out
        assert waited < TIMEOUT + SLACK, (p, waited)
        assert re.search(rf"^RAISED {p} .* step [01]: ", lines, re.M), out
        # and the engine refuses the next collective at once
        assert re.search(rf"^AFTER {p} RuntimeError .*unusable after an earlier failure",
                         lines, re.M), out
    assert wall < 60, wall


def test_a_process_that_hangs_makes_the_others_time_out(tmp_path):
    # process 1 never joins (it sleeps 120 s): the others raise TimeoutError after the
    # timeout, exit with status 1, and mpirun then ends process 1: the job ends long before
    # the sleep would
    r, wall, lines = _mpirun(4, os.path.join(SCRIPTS, "fault.py"), "hang", str(TIMEOUT),
                             timeout=110, out=tmp_path)
    out = lines + r.stdout[-3000:] + r.stderr[-2000:]
    raised = _raised(lines)
    assert r.returncode != 0, out
    # mpirun may end the slower survivors before they report: at least one reports, and what
    # is reported is a timeout after the timeout
    assert raised and set(raised) <= {0, 2, 3}, out
    for p, (kind, waited, failure) in raised.items():
        assert (kind, failure) == ("TimeoutError", "timeout"), out
        assert TIMEOUT - 0.05 <= waited < TIMEOUT + SLACK, (p, waited)
    assert "did not complete within its timeout of 3 s" in lines
    assert wall < 60, wall


def test_processes_that_pass_different_shapes_raise(tmp_path):
    # process 0 passes 3 elements to an allgather, processes 1 and 2 pass 4: each process
    # checks what it received, and all raise at once (no timeout), naming the difference
    r, _, lines = _mpirun(3, os.path.join(SCRIPTS, "fault.py"), "mismatch", "30", timeout=90,
                          out=tmp_path)
    out = lines + r.stdout[-3000:] + r.stderr[-2000:]
    raised = _raised(lines)
    assert set(raised) == {0, 1, 2}, out
    for p, (kind, waited, failure) in raised.items():
        assert (kind, failure) == ("RuntimeError", "mpi") and waited < 10, out
    assert "process 0 sent 12 bytes where 16 were expected" in lines, out
    assert "MPI_ERR_TRUNCATE" in lines and "different shapes or dtypes" in lines, out


def _start_sigint_job():
    p = subprocess.Popen(["mpirun", "-n", "2", "--oversubscribe", sys.executable,
                          os.path.join(SCRIPTS, "fault.py"), "sigint", "60"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=_env(), cwd=ROOT, start_new_session=True)
    line = p.stdout.readline()
    if not line.startswith("PID "):
        p.kill()
        pytest.fail(f"fault.py sigint did not start: {line}{p.stdout.read()[-3000:]}")
    time.sleep(0.5)  # in the barrier
    return p, int(line.split()[1])


def _gone(pid, within):
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_ctrl_c_stops_a_waiting_collective():
    p, pid = _start_sigint_job()
    try:
        os.kill(pid, signal.SIGINT)
        out = p.communicate(timeout=60)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    m = re.search(r"INTERRUPTED 0 ([\d.]+) interrupted", out)
    assert m, out[-4000:]
    assert float(m.group(1)) < 5, out[-4000:]


def test_ctrl_c_to_mpirun_stops_every_process():
    p, pid = _start_sigint_job()
    try:
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=30)
        assert time.monotonic() - t0 < 15
        assert _gone(pid, 10), "process 0 outlived mpirun"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


# --- MPI without a launcher: a world of one, in a child process -------------------------

def _child(code, **env):
    r = run_python(code, _env(**env))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def test_one_process_without_a_launcher():
    out = _child("""
import numpy as np
import ctrainstate.distributed as d
from ctrainstate import _C
d.initialize(num_processes=1, process_id=0, local_device_ids=[0], timeout=5)
print(d.is_initialized(), d.process_index(), d.process_count(), d.default_timeout())
info = _C.dist_info()
print(info['owns_mpi'], info['library'].split('/')[-1].startswith('libmpi'))
print(d.allreduce(np.arange(3.0), 'max').tolist(), d.allgather(np.int32(4)).tolist(),
      d.reduce_scatter(np.arange(4), 'min').tolist(), d.broadcast([1, 2]).tolist())
d.barrier(timeout=1)
try:
    d.initialize(num_processes=1, process_id=0)
except RuntimeError as e:
    print('again:', e)
d.shutdown()
print(d.is_initialized(), d.process_count())
try:
    d.initialize(num_processes=1, process_id=0)
except RuntimeError as e:
    print('after shutdown:', e)
""")
    lines = out.splitlines()
    assert lines[0] == "True 0 1 5.0", out
    assert lines[1] == "True True", out
    assert lines[2] == "[0.0, 1.0, 2.0] [4] [0, 1, 2, 3] [1, 2]", out
    assert lines[3].startswith("again: ctrainstate.distributed.initialize should only be called once")
    assert lines[4] == "False 1", out
    assert "after shutdown: MPI was finalized in this process by shutdown()" in lines[5], out


def test_a_world_smaller_than_asked_raises():
    # two processes asked for (explicitly, then by torchrun-style variables), but the process
    # was not started by an MPI launcher: MPI makes a world of one, and initialize says so
    # instead of waiting for a peer that never comes
    code = """
import ctrainstate.distributed as d
try:
    d.initialize({args})
except ValueError as e:
    print(e)
print(d.is_initialized())
"""
    out = _child(code.format(args="num_processes=2, process_id=1"))
    assert "MPI started a world of 1 process with this one as process 0, but process 1 of 2 " \
           "was expected" in out, out
    assert "mpirun -n N" in out and "from: arguments" in out, out
    assert out.strip().endswith("False")
    out = _child(code.format(args=""), RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT="29500")
    assert "process 0 of 2 was expected" in out, out
    assert "torchrun-style: RANK/WORLD_SIZE" in out and "not supported yet" in out, out


def test_bench_collectives_runs():
    r, _, _ = _mpirun(2, os.path.join(ROOT, "benchmarks", "bench_collectives.py"), "--max-bytes",
                   "64KiB", "--iters", "3")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = [l for l in r.stdout.splitlines() if re.match(r"\s*(all_reduce|all_gather|reduce_scatter)\s", l)]
    assert len(rows) == 3 * 7, r.stdout  # 1 KiB .. 64 KiB, three collectives


@pytest.mark.parametrize("n", [2, 4])
def test_checkpoints_across_processes(n, tmp_path):
    # tests/mpi/checkpoint.py: a TrainState on a (n, 2) global mesh saved by n processes
    # (async, max_to_keep, a process failing mid-save), restored by them onto another
    # mesh and spec, by one process onto 8 devices and one (n=2), by 2 processes (n=4);
    # a checkpoint of one process restored by n. Bit-exact against the known values.
    script = os.path.join(SCRIPTS, "checkpoint.py")
    one, many = tmp_path / "one", tmp_path / "many"
    r = subprocess.run([sys.executable, script, "save1", str(one)], capture_output=True,
                       text=True, timeout=120, cwd=SCRIPTS,
                       env=_env(CTRAINSTATE_NUM_CPU_DEVICES="4"))
    assert r.returncode == 0 and "SAVED1 4" in r.stdout, r.stdout + r.stderr[-4000:]
    (tmp_path / "out").mkdir()
    r, _, lines = _mpirun(n, script, "main", str(many), str(one), out=tmp_path / "out")
    assert r.returncode == 0 and _oks(lines, n) == list(range(n)), (r.stdout + r.stderr)[-6000:]
    if n == 2:   # restored by one process with 8 devices (and onto one device)
        r = subprocess.run([sys.executable, script, "restore", str(many)],
                           capture_output=True, text=True, timeout=120, cwd=SCRIPTS,
                           env=_env(CTRAINSTATE_NUM_CPU_DEVICES="8"))
        assert r.returncode == 0 and "OK 0 1 " in r.stdout, r.stdout + r.stderr[-4000:]
    else:        # saved by 4 processes, restored by 2
        (tmp_path / "out2").mkdir()
        r, _, lines = _mpirun(2, script, "restore", str(many), out=tmp_path / "out2")
        assert r.returncode == 0 and _oks(lines, 2) == [0, 1], (r.stdout + r.stderr)[-6000:]


def test_a_process_that_dies_mid_save_commits_nothing(tmp_path):
    # process 1 of 2 exits while writing step 3: mpirun ends the job; steps 1 and 2 are
    # the committed ones, step 3's temporary directory is ignored, and step 2 restores
    # bit-exactly in one process
    script = os.path.join(SCRIPTS, "checkpoint.py")
    d = tmp_path / "ckpt"
    r, _, _ = _mpirun(2, script, "die", str(d))
    assert r.returncode != 0, r.stdout + r.stderr
    names = sorted(os.listdir(d))
    partial = [x for x in names if x.startswith("3.tmp-")]
    assert sorted(set(names) - set(partial)) == ["1", "2", "known.npz"], names
    r = subprocess.run([sys.executable, script, "restore", str(d)], capture_output=True,
                       text=True, timeout=120, cwd=SCRIPTS,
                       env=_env(CTRAINSTATE_NUM_CPU_DEVICES="4"))
    assert r.returncode == 0 and "OK 0 1 " in r.stdout, r.stdout + r.stderr[-4000:]


# --- the examples under mpirun -n 2, against one process with as many devices -----------

def _losses(out):
    """{step: loss} from an example's --print-losses lines ('loss STEP repr(float)')."""
    got = {}
    for m in re.finditer(r"^loss (\d+) (\S+)$", out, re.M):
        step = int(m.group(1))
        assert step not in got, f"step {step} printed twice (only process 0 prints):\n{out}"
        got[step] = float(m.group(2))
    return got


def _one_process(args, devices, tmp_path):
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env=_env(CTRAINSTATE_NUM_CPU_DEVICES=str(devices)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    return r.stdout


def _two_processes(args, tmp_path):
    cmd = ["mpirun", "-n", "2", "--oversubscribe", sys.executable, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    return r.stdout


@pytest.mark.parametrize("mesh", ["2x2", "1x4"])
def test_siren_example_under_mpirun_matches_one_process(mesh, tmp_path):
    # 2x2: the data axis spans the processes (the loss's mean and the gradients' sums reduce
    # over them); 1x4: the model axis does (the row-parallel layers' all-reduces cross them).
    # The losses of every step, the PSNR and the written image are the one-process run's,
    # bit for bit; only process 0 prints and writes
    steps = 4
    args = [os.path.join(ROOT, "examples", "siren.py"), "--steps", str(steps), "--mesh", mesh,
            "--size", "24", "--hidden", "32", "--print-losses", "--plot", ""]
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = _one_process(args + ["--out", "one.png"], 4, tmp_path / "one")
    two = _two_processes(args + ["--out", "two.png"], tmp_path / "two")
    want, got = _losses(one), _losses(two)
    assert sorted(want) == list(range(1, steps + 1)), one
    assert got == want, (want, got)
    assert len(set(want.values())) == steps   # it trains: every step's loss differs
    assert two.count("mesh {") == 1 and f"(2 processes)" in two, two
    assert one.strip().splitlines()[-1] == two.strip().splitlines()[-1], (one, two)  # PSNR
    assert (tmp_path / "one" / "one.png").read_bytes() == (tmp_path / "two" / "two.png").read_bytes()


def test_hf_example_under_mpirun_matches_one_process(tmp_path):
    # the ('dp', 'mp') = (1, 4) mesh: the mp axis, and so every sharded kernel and its AdamW
    # moments, spans the processes; dropout on. The losses of every step and the eval
    # losses are the one-process run's, bit for bit
    steps = 3
    args = [os.path.join(ROOT, "examples", "hf_model_parallel.py"), "--steps", str(steps),
            "--layers", "1", "--print-losses"]
    one = _one_process(args, 4, tmp_path)
    two = _two_processes(args, tmp_path)
    want, got = _losses(one), _losses(two)
    assert sorted(want) == list(range(1, steps + 1)), one
    assert got == want, (want, got)
    assert "mesh {'dp': 1, 'mp': 4} (2 processes)" in two and two.count("mesh {") == 1, two
    evals = [re.search(r"eval loss (\S+) -> (\S+),", out).groups() for out in (one, two)]
    assert evals[0] == evals[1], evals
