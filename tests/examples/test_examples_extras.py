"""The main job's progress bar and figure: with the `examples` extra (tqdm, matplotlib) and
without it.

`python examples/siren.py` draws a tqdm bar and writes a matplotlib figure of its training when
those are installed, and prints plain progress lines (no figure, a note saying why) when they
are not; the training, the reconstruction and the last line (the PSNR) are the same either
way. The run without them always runs here (the imports are blocked); the run with them skips
where they are not installed (CI's notebook stage installs them).
"""
import importlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--steps", "20", "--size", "16", "--hidden", "32", "--lr", "1e-3", "--mesh", "2x4"]

# runs examples/siren.py as `python examples/siren.py ARGS`, with tqdm and matplotlib made
# unimportable when BLOCK is set (as on a machine without the extra)
RUNNER = """
import os, runpy, sys
if os.environ.get("BLOCK") == "1":
    for m in ("tqdm", "tqdm.auto", "matplotlib", "matplotlib.pyplot"):
        sys.modules[m] = None
sys.argv = [sys.argv[1]] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_siren(tmp_path, block, args=None):
    if args is None:
        args = [*SMALL, "--out", str(tmp_path / "recon.png"),
                "--plot", str(tmp_path / "plot" / "fig.png")]
    env = dict(os.environ, BLOCK="1" if block else "0")
    env.pop("CTRAINSTATE_NUM_CPU_DEVICES", None)
    env.pop("MPLBACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run(
        [sys.executable, "-c", RUNNER, os.path.join(ROOT, "examples", "siren.py"), *args],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def psnr_line(out):
    last = out.strip().splitlines()[-1]
    assert last.startswith("PSNR: ") and last.endswith(" dB"), last
    return last


def test_siren_without_tqdm_and_matplotlib(tmp_path):
    r = run_siren(tmp_path, block=True)
    lines = r.stdout.splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert len(steps) == 10 and steps[-1].startswith("step    20/20  loss "), r.stdout
    assert "SIREN" not in r.stderr and "%|" not in r.stderr, r.stderr   # no bar
    assert "matplotlib is not installed (pip install -e '.[examples]')" in r.stdout
    assert not (tmp_path / "plot").exists()
    assert (tmp_path / "recon.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    psnr_line(r.stdout)


def need(*modules):
    for m in modules:
        if os.environ.get("CTRAINSTATE_REQUIRE_NOTEBOOKS") == "1":
            importlib.import_module(m)
        else:
            pytest.importorskip(m)


def test_siren_with_tqdm_and_matplotlib(tmp_path):
    need("tqdm", "matplotlib")
    with_extra = run_siren(tmp_path, block=False)
    # tqdm's bar on stderr, refreshed once per tenth of the run (stderr is not a terminal)
    err = with_extra.stderr
    assert "SIREN: 100%|" in err and "20/20" in err and "PSNR" in err, err
    assert err.count("SIREN:") <= 12, err
    assert not any(ln.startswith("step ") for ln in with_extra.stdout.splitlines())
    fig = tmp_path / "plot" / "fig.png"
    assert f"wrote {fig} (loss and PSNR curves, target and reconstruction)" in with_extra.stdout
    data = fig.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    import matplotlib.image
    h, w = matplotlib.image.imread(str(fig)).shape[:2]
    assert (w, h) == (1400, 340), (w, h)
    # the same training and result as without the extra
    (tmp_path / "b").mkdir()
    without = run_siren(tmp_path / "b", block=True)
    assert psnr_line(with_extra.stdout) == psnr_line(without.stdout)


def test_siren_figure_goes_beside_the_reconstruction_by_default(tmp_path):
    need("matplotlib")
    r = run_siren(tmp_path, block=False, args=["--steps", "2", "--size", "8", "--hidden", "8",
                                                "--mesh", "1x2", "--out", str(tmp_path / "a" / "r.png")])
    fig = tmp_path / "a" / "siren_training.png"
    assert f"wrote {fig} (" in r.stdout and fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
