"""ctrainstate's pytest plugin: pytest.mark.devices(n) gives each test its CPU device count
in one session (a fresh interpreter where the process has another count), and the
cpu_devices / mesh fixtures."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pytest(args, cwd):
    env = dict(os.environ)
    env.pop("CTRAINSTATE_NUM_CPU_DEVICES", None)   # the plugin, not the environment, decides
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.join(ROOT, "python"), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p",
                           "ctrainstate_pytest"] + args, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_modules_asking_for_8_and_4_devices_pass_in_one_session():
    r = _pytest(["-q", os.path.join(ROOT, "examples", "user_tests")], ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "4 passed" in r.stdout


def test_devices_mark_runs_here_when_it_can_and_reports_a_child_failure(tmp_path):
    (tmp_path / "test_a.py").write_text(textwrap.dedent("""
        import os
        import pytest
        import ctrainstate as cts

        @pytest.mark.devices(2)
        def test_two_here():
            assert cts.device_count("cpu") == 2
            print("PID", os.getpid())

        @pytest.mark.devices(3)
        def test_three_in_a_child(cpu_devices, mesh):
            assert len(cpu_devices) == 3
            assert mesh((3,), ("x",)).shape == {"x": 3}
            print("PID", os.getpid())

        @pytest.mark.devices(2)
        def test_two_again_here():
            assert cts.device_count("cpu") == 2

        @pytest.mark.devices(5)
        def test_five_fails_in_its_child():
            assert cts.device_count("cpu") == 4, "five devices, as asked"
    """))
    r = _pytest(["-q", "-s", "test_a.py"], tmp_path)
    out = r.stdout
    assert r.returncode == 1 and "1 failed, 3 passed" in out, out[-3000:]
    pids = {line.split()[1] for line in out.splitlines() if line.startswith("PID")}
    assert len(pids) == 1          # the 3-device test's output is the child's, not shown
    assert ("test_a.py::test_five_fails_in_its_child failed when run with 5 CPU devices in a "
            "fresh interpreter") in out
    assert "five devices, as asked" in out


def test_devices_mark_with_a_bad_argument_is_a_usage_error(tmp_path):
    (tmp_path / "test_b.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.devices(0)
        def test_zero():
            pass
    """))
    r = _pytest(["-q", "test_b.py"], tmp_path)
    assert r.returncode != 0
    assert "pytest.mark.devices takes one positive int, got (0,)" in r.stdout + r.stderr
