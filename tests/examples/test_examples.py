"""The examples run end to end (reduced sizes) as a new user would run them."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(args, timeout=300):
    env = dict(os.environ)
    env.pop("CTRAINSTATE_NUM_CPU_DEVICES", None)  # each example sets its own default
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable] + args, cwd=ROOT, capture_output=True, text=True,
                       env=env, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


def test_demo_mesh():
    out = run(["examples/demo_mesh.py"])
    assert "resharded to PartitionSpec('model', None) exact: True" in out


def test_siren_small_reaches_30db(tmp_path):
    png = tmp_path / "recon.png"
    out = run(["examples/siren.py", "--steps", "60", "--size", "32", "--hidden", "64",
               "--lr", "1e-3", "--out", str(png)])
    last = out.strip().splitlines()[-1]
    assert last.startswith("PSNR: ") and last.endswith(" dB"), last
    assert float(last.split()[1]) >= 30.0, out[-1500:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "kernel" in out and "PartitionSpec(None, 'model')" in out


def test_siren_reads_its_own_png_and_other_meshes(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from png import read_png, write_png
    import numpy as np
    img = np.random.default_rng(0).random((16, 16, 3)).astype(np.float32)
    write_png(str(tmp_path / "in.png"), img)
    back = read_png(str(tmp_path / "in.png"))
    assert np.abs(back - img).max() <= 0.5 / 255 + 1e-6
    out = run(["examples/siren.py", "--steps", "3", "--image", str(tmp_path / "in.png"),
               "--mesh", "1x8", "--hidden", "32", "--out", str(tmp_path / "o.png")])
    assert "mesh {'data': 1, 'model': 8}" in out and "image 16x16x3" in out


def test_siren_writes_its_output_under_out_not_over_a_tracked_file(tmp_path):
    """The main job's default output is out/siren_reconstruction.png in the current
    directory (made if missing), and no generated image is committed to the repository."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    env.pop("CTRAINSTATE_NUM_CPU_DEVICES", None)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "siren.py"), "--steps",
                        "2", "--size", "16", "--hidden", "16", "--mesh", "1x2"], cwd=tmp_path,
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    png = tmp_path / "out" / "siren_reconstruction.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {os.path.join('out', 'siren_reconstruction.png')}" in r.stdout
    tracked = subprocess.run(["git", "ls-files", "*.png"], cwd=ROOT, capture_output=True,
                             text=True)
    if tracked.returncode == 0:                     # (a source tree without git: no check)
        assert "siren_reconstruction.png" not in tracked.stdout


def test_siren_rejects_bad_flags():
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    r = subprocess.run([sys.executable, "examples/siren.py", "--mesh", "3x3"], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and "must be divisible by the model axis 3" in r.stderr


def test_flax_guide_mlp_small():
    out = run(["examples/flax_guide_mlp.py", "--depth", "128", "--layers", "2", "--steps", "2"])
    assert "logical variant shards exactly like the mesh-axis variant: OK" in out


def test_examples_launcher_reads_the_launchers_environment():
    # examples/launcher.py: how many processes a launcher started, before ctrainstate is
    # imported (the examples size each process's CPU devices by it)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import launcher
    finally:
        sys.path.pop(0)
    n = launcher.launched_processes
    assert n({}) == 1
    assert n({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}) == 2
    assert n({"PMI_SIZE": "4", "PMI_RANK": "0"}) == 4
    # a batch script's own shell has SLURM_NTASKS but is one process; srun's steps have a step id
    assert n({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}) == 1
    assert n({"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_STEP_ID": "0"}) == 4
    with pytest.raises(SystemExit, match="OMPI_COMM_WORLD_SIZE='x'"):
        n({"OMPI_COMM_WORLD_SIZE": "x", "OMPI_COMM_WORLD_RANK": "0"})
    with pytest.raises(SystemExit, match="OMPI_COMM_WORLD_SIZE='0'"):
        n({"OMPI_COMM_WORLD_SIZE": "0", "OMPI_COMM_WORLD_RANK": "0"})


def test_siren_under_a_launcher_refuses_a_mesh_that_does_not_split():
    # 3 processes cannot share a 2x4 mesh: the example says so before starting MPI
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), OMPI_COMM_WORLD_SIZE="3",
               OMPI_COMM_WORLD_RANK="0")
    env.pop("CTRAINSTATE_NUM_CPU_DEVICES", None)
    r = subprocess.run([sys.executable, "examples/siren.py", "--mesh", "2x4"], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0
    assert "--mesh 2x4 needs 8 devices, which do not split over 3 processes" in r.stderr, r.stderr
