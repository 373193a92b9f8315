"""CheckpointManager: orbax's options (keep_time_interval, save_on_steps, should_save_fn,
step names, create, read_only, todelete_subdir, the unsupported ones) and the background saves
that ``ctrainstate.distributed.shutdown()`` and interpreter exit finish."""
import datetime
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ctrainstate import checkpoint as ocp
from ctrainstate._src.checkpoint import store as _store

HOUR = 3600.0
STATE = {"w": np.arange(4, dtype=np.float32), "step": 1}


@pytest.fixture
def clock(monkeypatch):
    """The time a save records (its metadata's ``time``): set ``clock[0]`` before a save."""
    now = [0.0]
    monkeypatch.setattr(_store, "now", lambda: now[0])
    return now


def _run(m, steps, clock, metrics=None):
    for step in steps:
        clock[0] = step * HOUR
        kw = {"metrics": {"acc": metrics[step]}} if metrics else {}
        assert m.save(step, STATE, **kw)
        m.wait_until_finished()


# --- keep_time_interval -----------------------------------------------------------------------

@pytest.mark.parametrize("async_", [False, True])
def test_keep_time_interval_keeps_the_oldest_then_one_per_interval(tmp_path, clock, async_):
    # a save an hour; every 3 hours one is kept: from the oldest, each saved at least 3 hours
    # after the previous one kept (not after the previous one saved)
    o = ocp.CheckpointManagerOptions(max_to_keep=1, keep_time_interval=datetime.timedelta(hours=3),
                                     enable_async_checkpointing=async_)
    with ocp.CheckpointManager(tmp_path, options=o) as m:
        _run(m, range(1, 6), clock)
        assert m.all_steps() == [1, 4, 5]
    with ocp.CheckpointManager(tmp_path, options=o) as m:   # the times are read from disk
        _run(m, range(6, 9), clock)
        assert m.all_steps() == [1, 4, 7, 8]


def test_keep_time_interval_measures_from_the_previous_kept_step(tmp_path, clock):
    # saved at hours 0, 2, 4, 5, 7, 9: 2 is not 3 h after 0; 4 is 4 h after 0 (kept); 5 is 1 h
    # after 4; 7 is 3 h after 4 (kept); 9 the newest. Measured from the previous *saved* step,
    # 4 (2 h after 2) would go; measured from step 1's time and 3 h multiples, 9 would differ.
    o = ocp.CheckpointManagerOptions(max_to_keep=1,
                                     keep_time_interval=datetime.timedelta(hours=3),
                                     enable_async_checkpointing=False)
    hours = {1: 0, 2: 2, 3: 4, 4: 5, 5: 7, 6: 9}
    with ocp.CheckpointManager(tmp_path, options=o) as m:
        for step, h in hours.items():
            clock[0] = h * HOUR
            m.save(step, STATE)
        assert m.all_steps() == [1, 3, 5, 6]


def test_keep_time_interval_with_keep_period_and_best_fn(tmp_path, clock):
    o = ocp.CheckpointManagerOptions(max_to_keep=1, keep_time_interval=datetime.timedelta(hours=3),
                                     keep_period=5, enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path / "period", options=o) as m:
        _run(m, range(1, 9), clock)
        assert m.all_steps() == [1, 4, 5, 7, 8]   # 1, 4, 7 by time; 5 by keep_period
    # best_fn: the worst steps are the candidates; the time chain is still in step order
    o = ocp.CheckpointManagerOptions(max_to_keep=1, keep_time_interval=datetime.timedelta(hours=3),
                                     best_fn=lambda mt: mt["acc"],
                                     enable_async_checkpointing=False)
    acc = {1: 0.1, 2: 0.9, 3: 0.2, 4: 0.3, 5: 0.4, 6: 0.5, 7: 0.05}
    with ocp.CheckpointManager(tmp_path / "best", options=o) as m:
        _run(m, range(1, 8), clock, metrics=acc)
        assert m.all_steps() == [1, 2, 4, 7] and m.best_step() == 2


def test_keep_time_interval_is_checked():
    with pytest.raises(TypeError, match=r"keep_time_interval must be a datetime.timedelta.*"
                                        r"int 3600"):
        ocp.CheckpointManagerOptions(keep_time_interval=3600)
    with pytest.raises(ValueError, match="keep_time_interval must be positive"):
        ocp.CheckpointManagerOptions(keep_time_interval=datetime.timedelta(0))


# --- which steps are saved ---------------------------------------------------------------------

def test_save_on_steps_and_should_save_fn(tmp_path):
    o = ocp.CheckpointManagerOptions(save_interval_steps=10, save_on_steps=[3, 15],
                                     enable_async_checkpointing=False)
    assert o.save_on_steps == frozenset({3, 15})
    with ocp.CheckpointManager(tmp_path / "on", options=o) as m:
        assert [s for s in range(1, 26) if m.save(s, STATE)] == [1, 3, 10, 15, 20]
    calls = []

    def every_7th(step, latest):
        calls.append((step, latest))
        return step % 7 == 0
    o = ocp.CheckpointManagerOptions(save_interval_steps=2, save_on_steps={3},
                                     should_save_fn=every_7th, enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path / "fn", options=o) as m:
        # the function decides alone (even the first step); never for a step not after the latest
        assert [s for s in range(1, 16) if m.save(s, STATE)] == [7, 14]
        assert calls[0] == (1, None) and (8, 7) in calls and (15, 14) in calls
        assert not m.should_save(14) and m.save(13, STATE, force=False) is False
    with pytest.raises(ValueError, match="save_on_steps must hold non-negative int steps"):
        ocp.CheckpointManagerOptions(save_on_steps=[1, "2"])
    with pytest.raises(TypeError, match="save_on_steps must be a set of steps"):
        ocp.CheckpointManagerOptions(save_on_steps=5)
    with pytest.raises(TypeError, match=r"should_save_fn must be a function \(step, latest_step\)"):
        ocp.CheckpointManagerOptions(should_save_fn=True)


# --- directories ---------------------------------------------------------------------------------

def test_step_names_create_and_cleanup(tmp_path):
    o = ocp.CheckpointManagerOptions(step_prefix="ckpt", step_format_fixed_length=4)
    with ocp.CheckpointManager(tmp_path / "a", options=o) as m:
        m.save(3, STATE)
        m.save(12, STATE)
        m.wait_until_finished()
        assert sorted(os.listdir(tmp_path / "a")) == ["ckpt_0003", "ckpt_0012"]
        assert m.all_steps() == [3, 12]
        assert m.restore(3)["w"].tolist() == [0, 1, 2, 3]
        assert m.restore(12, directory=tmp_path / "a")["step"] == 1
    o = ocp.CheckpointManagerOptions(step_format_fixed_length=8)
    with ocp.CheckpointManager(tmp_path / "b", options=o) as m:
        m.save(5, STATE)
        m.wait_until_finished()
        assert os.listdir(tmp_path / "b") == ["00000005"] and m.latest_step() == 5
    # create=False: the directory is not made, and a save says so
    m = ocp.CheckpointManager(tmp_path / "c", options=ocp.CheckpointManagerOptions(create=False))
    assert not os.path.exists(tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="does not exist.*create=True"):
        m.save(1, STATE)
    # cleanup_tmp_directories=False: what an interrupted save left stays
    os.makedirs(tmp_path / "d" / "7.tmp-0123456789ab")
    o = ocp.CheckpointManagerOptions(cleanup_tmp_directories=False)
    with ocp.CheckpointManager(tmp_path / "d", options=o) as m:
        m.save(8, STATE)
    assert sorted(os.listdir(tmp_path / "d")) == ["7.tmp-0123456789ab", "8"]
    with ocp.CheckpointManager(tmp_path / "d") as m:   # the default removes it
        m.save(9, STATE)
    assert sorted(os.listdir(tmp_path / "d")) == ["8", "9"]
    for bad, err in (({"step_prefix": 3}, TypeError), ({"step_format_fixed_length": 0}, ValueError),
                     ({"create": "yes"}, TypeError), ({"read_only": 1}, TypeError),
                     ({"todelete_subdir": "a/b"}, ValueError)):
        with pytest.raises(err, match=next(iter(bad))):
            ocp.CheckpointManagerOptions(**bad)


def test_todelete_subdir_moves_deleted_steps(tmp_path):
    o = ocp.CheckpointManagerOptions(max_to_keep=1, todelete_subdir="trash")
    with ocp.CheckpointManager(tmp_path, options=o) as m:
        for step in (1, 2, 3):
            m.save(step, STATE)
        m.wait_until_finished()
        assert m.all_steps() == [3]
        assert sorted(os.listdir(tmp_path / "trash")) == ["1", "2"]
        m.save(4, STATE)
        m.wait_until_finished()
        m.delete(4)
        assert m.all_steps() == [] and sorted(os.listdir(tmp_path / "trash")) == ["1", "2", "3", "4"]
        m.save(5, STATE)   # the step list ignores the subdirectory
        m.wait_until_finished()
        assert m.all_steps() == [5]


def test_read_only_restores_but_neither_saves_nor_deletes(tmp_path):
    with ocp.CheckpointManager(tmp_path) as m:
        m.save(1, STATE)
    o = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(tmp_path, options=o) as m:
        assert not m.should_save(2) and m.all_steps() == [1]
        with pytest.raises(ValueError, match="read-only"):
            m.save(2, STATE)
        with pytest.raises(ValueError, match="read-only"):
            m.delete(1)
        assert m.restore(1)["w"].tolist() == [0, 1, 2, 3]
    assert os.listdir(tmp_path) == ["1"]
    assert not os.path.exists(tmp_path / "new")
    ocp.CheckpointManager(tmp_path / "new", options=o)   # read-only creates nothing
    assert not os.path.exists(tmp_path / "new")


def test_sync_saves_are_committed_when_save_returns(tmp_path, monkeypatch):
    o = ocp.CheckpointManagerOptions(enable_async_checkpointing=False,
                                     single_host_load_and_broadcast=True,
                                     enable_background_delete=True)
    m = ocp.CheckpointManager(tmp_path, options=o)
    m.save(1, STATE)
    assert os.path.isfile(tmp_path / "1" / "index.json") and not m._async.running


class _Opts:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.mark.parametrize("field,value", [
    ("step_name_format", object()), ("async_options", _Opts(timeout_secs=10)),
    ("multiprocessing_options", _Opts(primary_host=1, active_processes=None)),
    ("multiprocessing_options", _Opts(primary_host=0, active_processes={0})),
    ("file_options", _Opts(path_permission_mode=0o750)),
    ("save_decision_policy", object()), ("preservation_policy", object())])
def test_unsupported_options_raise(field, value):
    with pytest.raises(ValueError, match=f"{field}.*not supported"):
        ocp.CheckpointManagerOptions(**{field: value})


def test_default_multiprocessing_and_file_options_are_accepted():
    ocp.CheckpointManagerOptions(multiprocessing_options=_Opts(primary_host=0,
                                                               active_processes=None),
                                 file_options=_Opts(path_permission_mode=None))
    with pytest.raises(TypeError, match="unexpected keyword"):
        ocp.CheckpointManagerOptions(no_such_option=1)


# --- shutdown() and exit finish the background saves ------------------------------------------------

_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from ctrainstate import checkpoint as ocp, distributed as dist
    from ctrainstate._src.checkpoint import store as _store
    d = sys.argv[1]
    real = _store.write_plan

    def slow_or_failing(plan, tmp, md):
        time.sleep(0.3)
        # (the manager's directory: the temporary name's random hex part may hold "bad" too)
        if os.path.basename(os.path.dirname(tmp)) == "bad":
            raise OSError(28, "No space left on device")
        real(plan, tmp, md)
    _store.write_plan = slow_or_failing
    state = {"w": np.arange(4, dtype=np.float32)}
    m = ocp.CheckpointManager(os.path.join(d, "good"))
    m.save(1, state)
    assert m._async.running
    dist.shutdown()                              # the save in flight is committed first
    assert m.all_steps() == [1] and not m._async.running
    print("COMMITTED", os.path.isfile(os.path.join(d, "good", "1", "index.json")), flush=True)
    bad = ocp.CheckpointManager(os.path.join(d, "bad"))
    bad.save(1, state)
    try:
        dist.shutdown()
    except OSError as e:
        print("RAISED", e, flush=True)
    bad.wait_until_finished()                    # raised once
    am = ocp.AsyncManager()                      # flax's writer too
    ocp.save_checkpoint(os.path.join(d, "flax"), state, 1, async_manager=am)
    m.save(2, state)                             # in flight at exit: committed
    bad.save(2, state)                           # fails at exit: reported
    assert m._async.running
""")


def test_shutdown_and_exit_finish_background_saves(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "..", "python")]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "COMMITTED True" in r.stdout and "RAISED [Errno 28] No space left" in r.stdout
    assert "background checkpoint save failed" in r.stderr and "No space left" in r.stderr
    with ocp.CheckpointManager(tmp_path / "good") as m:
        assert m.all_steps() == [1, 2] and m.restore(2)["w"].tolist() == [0, 1, 2, 3]
    assert ocp.restore_checkpoint(tmp_path / "flax", None)["w"].tolist() == [0, 1, 2, 3]
    assert ocp.CheckpointManager(tmp_path / "bad").all_steps() == []
