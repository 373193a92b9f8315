"""The implementation of :mod:`ctrainstate.checkpoint.manager` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import dataclasses
import datetime
import os
import re
import shutil
import threading
import warnings
import weakref
from typing import Any, Callable, Container, Sequence

import numpy as np

from ..array.abstract import ShapeDtypeStruct
from ..array.array import Array
from ..distributed import distributed as _dist
from ..serialization.serialization import from_state_dict, to_state_dict
from . import fileio as _io, processes as _procs, store as _store

__all__ = ["CheckpointManager", "CheckpointManagerOptions", "StandardCheckpointer",
           "PyTreeCheckpointer", "AsyncCheckpointer", "Checkpointer", "StandardSave",
           "StandardRestore", "PyTreeSave", "PyTreeRestore", "AsyncManager", "save_checkpoint",
           "restore_checkpoint", "latest_checkpoint", "available_steps",
           "StepAlreadyExistsError", "InvalidCheckpointError"]


class StepAlreadyExistsError(ValueError):
    """A checkpoint of this step exists already (orbax's error of the same name)."""


class InvalidCheckpointError(ValueError):
    """``save_checkpoint`` was asked to write a step not after the latest (Flax's error)."""


# --- the background writer --------------------------------------------------------------------

# Every object that may have a background save running (weakly: a manager with a running
# save stays alive through its thread). ctrainstate.distributed.shutdown() and interpreter
# exit finish them first (_finish_background_saves), while the process engine still runs.
_live: "weakref.WeakSet" = weakref.WeakSet()


def _finish_background_saves() -> None:
    """Wait for every background save; raise the first error (after waiting for all)."""
    error = None
    for obj in list(_live):
        try:
            obj._finish()
        except BaseException as e:   # noqa: BLE001 - raised once every save has ended
            if error is None:
                error = e
    if error is not None:
        raise error


_dist._before_shutdown(_finish_background_saves)


class AsyncManager:
    """Runs one save at a time in a background thread (``flax.training.checkpoints.AsyncManager``).

    ``save_async(fn)`` waits for the previous save, then runs ``fn()`` in a new thread; an
    exception it raised is re-raised by the next ``save_async`` or ``wait_previous_save``
    (in a job of several processes, on every process: the save's commit, in that thread,
    makes them agree).

    >>> from ctrainstate.checkpoint import AsyncManager
    >>> m = AsyncManager(); out = []
    >>> m.save_async(lambda: out.append(1)); m.wait_previous_save(); out
    [1]
    """

    def __init__(self, max_workers: int = 1):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        _live.add(self)

    def _owned(self) -> "AsyncManager":
        """This manager as the writer of an object that finishes it itself (its own
        ``wait_until_finished``), not on its own at shutdown."""
        _live.discard(self)
        return self

    def _run(self, fn):
        try:
            fn()
        except BaseException as e:   # kept for the caller's next call
            self._error = e

    def wait_previous_save(self) -> None:
        """Block until the running save ends; raise what it raised, once."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise err

    def save_async(self, fn: Callable[[], Any]) -> None:
        self.wait_previous_save()
        # not a daemon: an interpreter that exits mid-save finishes the save first
        self._thread = threading.Thread(target=self._run, args=(fn,), name="ctrainstate-ckpt")
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _finish(self) -> None:
        self.wait_previous_save()


# --- step directories ------------------------------------------------------------------------

def _step_re(prefix: str):
    return re.compile(re.escape(prefix) + r"(\d+)$")


def available_steps(directory, prefix: str = "checkpoint_") -> list[int]:
    """Steps of the committed checkpoints ``<directory>/<prefix><step>`` in increasing order
    (temporary and half-deleted directories are not checkpoints)."""
    directory = os.fspath(directory)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    pat, out = _step_re(prefix), []
    for n in names:
        m = pat.match(n)
        if m and os.path.isfile(os.path.join(directory, n, _store.INDEX)):
            out.append(int(m.group(1)))
    return sorted(out)


def _cleanup_partial(directory, prefix: str) -> None:
    """Remove what interrupted saves and deletions left (temporary names)."""
    pat = re.compile(re.escape(prefix) + r"\d+\.(tmp|delete)-[0-9a-f]+$")
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for n in names:
        if pat.match(n):
            shutil.rmtree(os.path.join(directory, n), ignore_errors=True)


def _metadata(step, custom=None) -> dict:
    md = {"step": int(step), "time": _store.now()}
    if custom:
        md["custom"] = dict(custom)
    return md


def _restore(path: str, target, cast: bool):
    if target is None:
        return _store.restore_dir(path, None, cast=cast)
    restored = _store.restore_dir(path, to_state_dict(target), cast=cast)
    return from_state_dict(target, restored)


# --- orbax ----------------------------------------------------------------------------------

@dataclasses.dataclass
class CheckpointManagerOptions:
    """Options of :class:`CheckpointManager` (orbax's names and meanings).

    ``save_interval_steps``: ``save(step)`` writes the first step, then only steps that are
    a multiple of it or in ``save_on_steps`` (a set of steps), or with ``force=True``.
    ``should_save_fn(step, latest_step)``, if set, decides instead of those two.
    ``max_to_keep``: keep the newest N checkpoints (None: all), or with ``best_fn`` the N
    best. Of the others, these are kept too: every step that is a multiple of
    ``keep_period``, and with ``keep_time_interval`` (a ``datetime.timedelta``) the oldest
    step and each later one saved at least that long after the previous one so kept.
    ``best_fn``: a function of a step's ``metrics`` (``save(step, state, metrics=...)``)
    returning a number, its quality; ``best_mode``: whether ``'max'`` (default) or
    ``'min'`` is best. ``keep_checkpoints_without_metrics``: steps saved without metrics
    are never deleted (default); False: they count among the ``max_to_keep`` and are
    deleted first. ``step_prefix``: directories are ``<prefix>_<step>`` (None:
    ``<step>``); ``step_format_fixed_length``: the step with that many digits (leading
    zeros). ``create``: create the directory. ``cleanup_tmp_directories``: remove what
    interrupted saves left (before each save). ``todelete_subdir``: deleted steps are
    moved into this subdirectory instead of removed. ``read_only``: ``save`` and
    ``delete`` raise. ``enable_async_checkpointing``: ``save`` returns after copying the
    state to the host and writes in the background.
    ``single_host_load_and_broadcast`` and ``enable_background_delete`` are accepted and
    change nothing (every process reads the step list; with async saves, old steps are
    deleted in the save's background thread). ``step_name_format``, ``async_options``,
    non-default ``multiprocessing_options`` and ``file_options``,
    ``save_decision_policy`` and ``preservation_policy`` are not supported: setting them
    raises.
    """
    save_interval_steps: int = 1
    max_to_keep: int | None = None
    keep_time_interval: datetime.timedelta | None = None
    keep_period: int | None = None
    best_fn: Callable[[Any], float] | None = None
    best_mode: str = "max"
    keep_checkpoints_without_metrics: bool = True
    step_prefix: str | None = None
    step_format_fixed_length: int | None = None
    step_name_format: Any = None
    create: bool = True
    cleanup_tmp_directories: bool = True
    save_on_steps: Container[int] | None = None
    single_host_load_and_broadcast: bool = False
    todelete_subdir: str | None = None
    enable_background_delete: bool = False
    read_only: bool = False
    enable_async_checkpointing: bool = True
    async_options: Any = None
    multiprocessing_options: Any = None
    should_save_fn: Callable[[int, int | None], bool] | None = None
    file_options: Any = None
    save_decision_policy: Any = None
    preservation_policy: Any = None

    def __post_init__(self):
        name = "CheckpointManagerOptions"
        for field in ("save_interval_steps", "max_to_keep", "keep_period",
                      "step_format_fixed_length"):
            v = getattr(self, field)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name}.{field} must be a positive int or None, got {v!r}")
        if self.keep_time_interval is not None:
            if not isinstance(self.keep_time_interval, datetime.timedelta):
                raise TypeError(
                    f"{name}.keep_time_interval must be a datetime.timedelta or None, got "
                    f"{type(self.keep_time_interval).__name__} {self.keep_time_interval!r} "
                    f"(e.g. datetime.timedelta(hours=1))")
            if self.keep_time_interval <= datetime.timedelta(0):
                raise ValueError(f"{name}.keep_time_interval must be positive, got "
                                 f"{self.keep_time_interval!r}")
        for field in ("best_fn", "should_save_fn"):
            v = getattr(self, field)
            if v is not None and not callable(v):
                what = ("a function of a step's metrics returning a number" if field == "best_fn"
                        else "a function (step, latest_step) -> bool")
                raise TypeError(f"{name}.{field} must be {what}, or None; got "
                                f"{type(v).__name__} {v!r}")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"{name}.best_mode must be 'min' or 'max', got {self.best_mode!r}")
        for field in ("keep_checkpoints_without_metrics", "create", "cleanup_tmp_directories",
                      "single_host_load_and_broadcast", "enable_background_delete",
                      "read_only", "enable_async_checkpointing"):
            v = getattr(self, field)
            if not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"{name}.{field} must be a bool, got {type(v).__name__} {v!r}")
        for field in ("step_prefix", "todelete_subdir"):
            v = getattr(self, field)
            if v is not None and (not isinstance(v, str) or not v):
                raise TypeError(f"{name}.{field} must be a non-empty str or None, got {v!r}")
        t = self.todelete_subdir
        if t is not None and (t in (".", "..") or "/" in t or os.sep in t):
            raise ValueError(f"{name}.todelete_subdir must be the name of a subdirectory of "
                             f"the checkpoint directory (one path component), got {t!r}")
        steps = self.save_on_steps
        if steps is not None:
            try:
                steps = list(steps)
            except TypeError:
                raise TypeError(f"{name}.save_on_steps must be a set of steps (ints) or None, "
                                f"got {type(steps).__name__} {steps!r}") from None
            bad = [v for v in steps if isinstance(v, (bool, np.bool_))
                   or not isinstance(v, (int, np.integer)) or v < 0]
            if bad:
                raise ValueError(f"{name}.save_on_steps must hold non-negative int steps; got "
                                 f"{bad[0]!r}")
        self.save_on_steps = frozenset(int(v) for v in steps or ())
        unsupported = [f for f in ("step_name_format", "async_options", "save_decision_policy",
                                   "preservation_policy") if getattr(self, f) is not None]
        mp = self.multiprocessing_options
        if mp is not None and (getattr(mp, "primary_host", 0) != 0
                               or getattr(mp, "active_processes", None) is not None):
            unsupported.append("multiprocessing_options (a primary_host other than 0, or "
                               "active_processes)")
        fo = self.file_options
        if fo is not None and getattr(fo, "path_permission_mode", None) is not None:
            unsupported.append("file_options.path_permission_mode")
        if unsupported:
            raise ValueError(f"{name}: {', '.join(unsupported)} not supported by ctrainstate's "
                             f"CheckpointManager (leave them at their defaults); directories "
                             f"are named by step_prefix and step_format_fixed_length, every "
                             f"process of the job takes part, process 0 commits")


def _metrics_json(metrics, path: str = "metrics"):
    """``metrics`` (a dict of numbers, 0-d arrays or nested dicts) as JSON values."""
    if isinstance(metrics, dict):
        return {str(k): _metrics_json(v, f"{path}[{k!r}]") for k, v in metrics.items()}
    if isinstance(metrics, (bool, int, float, np.integer, np.floating)):
        return metrics.item() if isinstance(metrics, np.generic) else metrics
    if isinstance(metrics, (Array, np.ndarray)) and metrics.size == 1:
        v = np.asarray(metrics).reshape(())
        if v.dtype.kind in "biuf" or v.dtype.name == "bfloat16":
            return v.item() if v.dtype.kind in "biu" else float(v)
    raise TypeError(f"CheckpointManager.save: {path} must be a number or a one-element "
                    f"array (metrics are a dict of them, nested dicts allowed); got "
                    f"{type(metrics).__name__} {metrics!r}"[:300])


def _score(best_fn, metrics, step) -> float:
    """``best_fn(metrics)`` as a float, or an error naming the step."""
    try:
        v = best_fn(metrics)
    except Exception as e:
        msg = f"CheckpointManagerOptions.best_fn raised on the metrics of step {step} " \
              f"({metrics!r}): {type(e).__name__}: {e}"
        try:
            err = type(e)(msg)
        except Exception:   # noqa: BLE001 - an exception type that takes other arguments
            err = RuntimeError(msg)
        raise err from e
    if isinstance(v, (Array, np.ndarray)) and v.size == 1:
        v = np.asarray(v).reshape(())
    if isinstance(v, (bool, np.bool_)) or not isinstance(
            v, (int, float, np.integer, np.floating, np.ndarray)) or (
            isinstance(v, np.ndarray) and v.dtype.kind not in "iuf"):
        raise TypeError(f"CheckpointManagerOptions.best_fn must return a number; on the "
                        f"metrics of step {step} ({metrics!r}) it returned "
                        f"{type(v).__name__} {v!r}")
    return float(v)


@dataclasses.dataclass
class StandardSave:
    """``args=StandardSave(state)`` for :meth:`CheckpointManager.save` (orbax.args)."""
    item: Any


@dataclasses.dataclass
class StandardRestore:
    """``args=StandardRestore(target)`` for :meth:`CheckpointManager.restore`: a state or an
    abstract state (``eval_shape``) whose shardings the arrays are restored onto; None gives
    host numpy arrays in nested dicts."""
    item: Any = None


PyTreeSave, PyTreeRestore = StandardSave, StandardRestore


class CheckpointManager:
    """Numbered checkpoints of a training run in one directory (orbax's ``CheckpointManager``).

    ``save(step, state)`` writes ``<directory>/<step>`` (see :mod:`ctrainstate.checkpoint` for
    the format); with ``enable_async_checkpointing`` (the default) it returns once the
    state is copied to the host, and the files are written by a background thread. An error
    there is raised by the next ``save`` or by ``wait_until_finished``. ``restore(step,
    target)`` reads onto the shardings of ``target`` (a state, or ``eval_shape`` of one).
    ``checkpointers``, orbax's older second argument (``CheckpointManager(dir,
    PyTreeCheckpointer(), options)``), is accepted and has no effect: there is one format.
    ``metadata`` (JSON values) is stored with every step.

    >>> import tempfile, numpy as np, ctrainstate as cts
    >>> from ctrainstate import checkpoint as ocp
    >>> d = tempfile.mkdtemp()
    >>> state = {'w': cts.device_put(np.arange(4, dtype=np.float32)), 'step': 1}
    >>> with ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(max_to_keep=2)) as m:
    ...     for step in (1, 2, 3):
    ...         _ = m.save(step, args=ocp.args.StandardSave(state))
    ...     m.wait_until_finished()
    ...     print(m.all_steps(), m.latest_step())
    ...     r = m.restore(3, args=ocp.args.StandardRestore(state))
    [2, 3] 3
    >>> np.asarray(r['w']).tolist(), r['step']
    ([0.0, 1.0, 2.0, 3.0], 1)
    """

    def __init__(self, directory, checkpointers=None,
                 options: CheckpointManagerOptions | None = None, metadata=None):
        self._directory = os.path.abspath(os.fspath(directory))
        self._options = options or CheckpointManagerOptions()
        o = self._options
        self._prefix = f"{o.step_prefix}_" if o.step_prefix else ""
        self._digits = o.step_format_fixed_length or 0
        if o.create and not o.read_only:
            os.makedirs(self._directory, exist_ok=True)
        self._async = AsyncManager()._owned()
        _live.add(self)   # finished by ctrainstate.distributed.shutdown() and at exit
        self._pending: int | None = None
        self._pending_md: dict | None = None
        self._infos: dict[int, tuple] = {}   # committed steps' (metrics, time), as read
        self._warned_no_metrics = False
        self._metadata = metadata

    # -- queries --
    @property
    def directory(self) -> str:
        return self._directory

    def _name(self, step: int) -> str:
        return f"{self._prefix}{int(step):0{self._digits}d}"

    def _path(self, step: int) -> str:
        return os.path.join(self._directory, self._name(step))

    def all_steps(self, read: bool = False) -> list[int]:
        """Steps of the committed checkpoints, plus the one being written in the background."""
        steps = available_steps(self._directory, self._prefix)
        if self._pending is not None and self._pending not in steps:
            steps = sorted(steps + [self._pending])
        return steps

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _step_info(self, step: int) -> tuple:
        """(the metrics saved with ``step`` or None, the time it was saved)."""
        if step == self._pending and step not in self._infos and self._pending_md:
            md = self._pending_md
            return md.get("metrics"), md.get("time", 0.0)
        if step not in self._infos:
            try:
                md = _store.step_metadata(self._path(step))
            except FileNotFoundError:   # deleted meanwhile
                return None, 0.0
            self._infos[step] = (md.get("metrics"), float(md.get("time", 0.0)))
        return self._infos[step]

    def _step_metrics(self, step: int):
        """The metrics saved with ``step`` (None: saved without)."""
        return self._step_info(step)[0]

    def _ranked(self, steps):
        """(steps without metrics, steps with metrics from worst to best): by ``best_fn``
        under ``best_mode``, ties by step (the later is better), NaN worst of all."""
        o = self._options
        metrics = {s: self._step_metrics(s) for s in steps}
        without = [s for s in steps if metrics[s] is None]

        def quality(s):
            v = _score(o.best_fn, metrics[s], s)
            return (0, 0.0) if v != v else (1, v if o.best_mode == "max" else -v)
        return without, sorted((s for s in steps if metrics[s] is not None), key=quality)

    def best_step(self) -> int | None:
        """The step whose metrics ``best_fn`` ranks best (orbax's): the latest step without
        ``best_fn``; None when no step has metrics."""
        if self._options.best_fn is None:
            return self.latest_step()
        _, ranked = self._ranked(self.all_steps())
        return ranked[-1] if ranked else None

    def should_save(self, step: int) -> bool:
        """Whether ``save(step)`` would write (orbax's rule): never in a read-only manager
        nor for a step not after the latest; then ``should_save_fn(step, latest_step)`` if
        set; otherwise the first step, a multiple of ``save_interval_steps``, or one of
        ``save_on_steps``."""
        o = self._options
        if o.read_only:
            return False
        latest = self.latest_step()
        if latest is not None and latest >= step:
            return False
        if o.should_save_fn is not None:
            return bool(o.should_save_fn(step, latest))
        return latest is None or step % o.save_interval_steps == 0 or step in o.save_on_steps

    # -- saving --
    def save(self, step: int, items=None, *, args=None, metrics=None, force: bool = False,
             custom_metadata: dict | None = None) -> bool:
        """Save ``items`` (or ``args.item``) as ``step``; returns whether it was saved.

        Waits for the previous background save (raising its error, if any), removes what
        interrupted saves left, and, unless ``force``, skips steps :meth:`should_save` refuses.
        A step that already exists raises :class:`StepAlreadyExistsError`. ``metrics`` (a dict
        of numbers, nested dicts allowed) and ``custom_metadata`` are stored in the step's
        metadata; with ``best_fn``, retention keeps the ``max_to_keep`` best steps by them."""
        if args is not None:
            if items is not None:
                raise ValueError("CheckpointManager.save: pass the state as items or as args, "
                                 "not both")
            items = args.item
        if items is None:
            raise ValueError("CheckpointManager.save: nothing to save (items / args is None)")
        if self._options.read_only:
            raise ValueError(f"CheckpointManager on {self._directory} is read-only")
        step = int(step)
        self.wait_until_finished()
        if not os.path.isdir(self._directory):
            raise FileNotFoundError(f"CheckpointManager.save: the directory {self._directory} "
                                    f"does not exist (CheckpointManagerOptions(create=True) "
                                    f"creates it)")
        if not force and not self.should_save(step):
            return False
        if step in self.all_steps():
            raise StepAlreadyExistsError(f"a checkpoint of step {step} exists already in "
                                         f"{self._directory}")
        self._infos.pop(step, None)
        md = _metadata(step, custom_metadata)
        if self._metadata is not None:
            md["manager"] = self._metadata
        if metrics is not None:
            if not isinstance(metrics, dict):
                raise TypeError(f"CheckpointManager.save: metrics must be a dict of numbers, "
                                f"got {type(metrics).__name__}")
            md["metrics"] = _metrics_json(metrics)
            if self._options.best_fn is not None:
                _score(self._options.best_fn, md["metrics"], step)   # raises here, not later
        elif self._options.best_fn is not None and not self._warned_no_metrics:
            self._warned_no_metrics = True
            warnings.warn(f"CheckpointManager.save({step}) without metrics, but best_fn is set: "
                          f"the step is {'never deleted' if self._options.keep_checkpoints_without_metrics else 'deleted first'} "
                          f"by retention (keep_checkpoints_without_metrics="
                          f"{self._options.keep_checkpoints_without_metrics})", stacklevel=2)
        async_ = self._options.enable_async_checkpointing
        plan = _store.SavePlan(to_state_dict(items), snapshot=async_)
        cleanup = ((lambda: _cleanup_partial(self._directory, self._prefix))
                   if self._options.cleanup_tmp_directories else None)
        save = _procs.Save(plan, self._path(step), md, before=cleanup,
                           after=self._garbage_collect, background=async_)
        if async_:
            self._pending, self._pending_md = step, md
            self._async.save_async(save.background())
        else:
            save.run()
        return True

    def _garbage_collect(self) -> None:
        """Retention after a commit (orbax's): beyond ``max_to_keep`` steps, delete the oldest,
        or with ``best_fn`` the worst (and, unless ``keep_checkpoints_without_metrics``, those
        without metrics first); never one ``keep_time_interval`` keeps (the oldest step and,
        in step order, each saved at least that long after the previous one kept so), nor a
        multiple of ``keep_period``."""
        o = self._options
        if o.max_to_keep is None:
            return
        steps = available_steps(self._directory, self._prefix)
        if len(steps) <= o.max_to_keep:
            return
        if o.best_fn is None:
            maybe = steps[:-o.max_to_keep]
        else:
            without, ranked = self._ranked(steps)
            maybe = (ranked if o.keep_checkpoints_without_metrics
                     else without + ranked)[:-o.max_to_keep]
        chain, interval = None, None
        if o.keep_time_interval is not None:
            interval = o.keep_time_interval.total_seconds()
            chain = [steps[0]]
            for s in steps[1:]:
                if self._step_info(s)[1] >= self._step_info(chain[-1])[1] + interval:
                    chain.append(s)
        for s in maybe:
            if chain is not None:
                if s in chain:
                    continue
                if self._step_info(s)[1] >= self._step_info(chain[-1])[1] + interval:
                    chain.append(s)
                    continue
            if o.keep_period is not None and s % o.keep_period == 0:
                continue
            self._remove(self._path(s))
            self._infos.pop(s, None)

    def _remove(self, path: str) -> None:
        """Delete a step's directory, or with ``todelete_subdir`` move it there."""
        sub = self._options.todelete_subdir
        if sub is None:
            _store.remove(path)
            return
        where = os.path.join(self._directory, sub)
        os.makedirs(where, exist_ok=True)
        dest = os.path.join(where, os.path.basename(path))
        if os.path.exists(dest):   # a step deleted before under the same name
            _store.remove(dest)
        os.rename(path, dest)
        _io.fsync_dir(self._directory)

    def wait_until_finished(self) -> None:
        """Block until the background save is written; raise its error, if it failed."""
        try:
            self._async.wait_previous_save()
        finally:
            self._pending = self._pending_md = None

    _finish = wait_until_finished

    def check_for_errors(self) -> None:
        """Raise the error of a finished background save (without waiting for a running one;
        in a job of several processes, each process sees its own background thread)."""
        if not self._async.running:
            self.wait_until_finished()

    # -- restoring --
    def restore(self, step: int | None = None, items=None, *, args=None, directory=None,
                cast: bool = False):
        """The state saved at ``step`` (default: the latest) placed like ``items`` /
        ``args.item``: each array on its target's sharding (any mesh, any layout), checked
        against its target's shape and dtype (``cast=True`` converts dtypes instead of
        raising). Without a target: nested dicts of host numpy arrays and values."""
        if args is not None:
            items = args.item
        self.wait_until_finished()
        root = os.path.abspath(os.fspath(directory)) if directory is not None else None
        if step is None:
            steps = (available_steps(root, self._prefix) if root else self.all_steps())
            if not steps:
                raise FileNotFoundError(f"no checkpoint in {root or self._directory}")
            step = steps[-1]
        path = os.path.join(root, self._name(step)) if root else self._path(step)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no checkpoint of step {step} in "
                                    f"{root or self._directory} (steps: {self.all_steps()})")
        return _restore(path, items, cast)

    def item_metadata(self, step: int):
        """The saved tree with each array as a ``ShapeDtypeStruct`` (no sharding) and other
        leaves as saved; a target for ``restore`` once shardings are attached."""
        index = _store.read_index(self._path(step))
        items = []
        for e in index["leaves"]:
            keys = tuple(e["keys"])
            if e["kind"] == "array":
                items.append((keys, ShapeDtypeStruct(e["shape"], _io.np_dtype(e["dtype"]))))
            elif e["kind"] == "value":
                items.append((keys, e["value"]))
            else:
                items.append((keys, {}))
        return _store.unflatten(items)

    def metadata(self, step: int | None = None) -> dict:
        """The step's metadata: ``step``, ``time`` (seconds since the epoch), ``custom``."""
        step = self.latest_step() if step is None else step
        return _store.step_metadata(self._path(step))

    def delete(self, step: int) -> None:
        """Remove the checkpoint of ``step`` (with ``todelete_subdir``: move it there)."""
        if self._options.read_only:
            raise ValueError(f"CheckpointManager on {self._directory} is read-only")
        self.wait_until_finished()
        if step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint of step {step} in {self._directory}")
        _remove_on_process_0(self._path(step), self._remove)
        self._infos.pop(int(step), None)

    def reload(self) -> None:
        """Steps are read from the directory at each call; this forgets the steps' metrics
        read so far (for a directory changed by others)."""
        self._infos = {}

    def close(self) -> None:
        """Wait for the background save (raising its error)."""
        self.wait_until_finished()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class StandardCheckpointer:
    """One checkpoint at a path of your choice (orbax's ``StandardCheckpointer`` /
    ``PyTreeCheckpointer``). ``save(path, state)``; ``restore(path, target)``. The async
    variant (:class:`AsyncCheckpointer`) returns from ``save`` after the host snapshot.

    >>> import os, tempfile, numpy as np
    >>> from ctrainstate.checkpoint import StandardCheckpointer
    >>> p = os.path.join(tempfile.mkdtemp(), 'ckpt')
    >>> c = StandardCheckpointer(); c.save(p, {'a': np.arange(3)})
    >>> c.restore(p)['a'].tolist()
    [0, 1, 2]
    """

    _async_default = False

    def __init__(self):
        self._async = AsyncManager()._owned()
        _live.add(self)   # finished by ctrainstate.distributed.shutdown() and at exit

    def save(self, directory, item=None, *, args=None, force: bool = False) -> None:
        item = args.item if args is not None else item
        final = os.path.abspath(os.fspath(directory))
        self._async.wait_previous_save()
        if os.path.exists(final) and not force:
            raise StepAlreadyExistsError(f"{final} exists; pass force=True to replace it")
        os.makedirs(os.path.dirname(final), exist_ok=True)
        plan = _store.SavePlan(to_state_dict(item), snapshot=self._async_default)
        save = _procs.Save(plan, final, _metadata(0), background=self._async_default)
        if self._async_default:
            self._async.save_async(save.background())
        else:
            save.run()

    def restore(self, directory, item=None, *, args=None, cast: bool = False):
        item = args.item if args is not None else item
        self._async.wait_previous_save()
        return _restore(os.path.abspath(os.fspath(directory)), item, cast)

    def wait_until_finished(self) -> None:
        self._async.wait_previous_save()

    _finish = wait_until_finished

    def close(self) -> None:
        self.wait_until_finished()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncCheckpointer(StandardCheckpointer):
    """:class:`StandardCheckpointer` whose ``save`` writes in the background."""
    _async_default = True


PyTreeCheckpointer = Checkpointer = StandardCheckpointer


# --- flax.training.checkpoints ------------------------------------------------------------------

def latest_checkpoint(ckpt_dir, prefix: str = "checkpoint_") -> str | None:
    """Path of the newest committed checkpoint ``<ckpt_dir>/<prefix><step>``, or None."""
    steps = available_steps(ckpt_dir, prefix)
    return os.path.join(os.fspath(ckpt_dir), f"{prefix}{steps[-1]}") if steps else None


def save_checkpoint(ckpt_dir, target, step, prefix: str = "checkpoint_", keep: int = 1,
                    overwrite: bool = False, keep_every_n_steps: int | None = None,
                    async_manager: AsyncManager | None = None, orbax_checkpointer=None) -> str:
    """Save ``target`` as ``<ckpt_dir>/<prefix><step>`` (``flax.training.checkpoints``).

    Keeps the newest ``keep`` checkpoints, and every one whose step is a multiple of
    ``keep_every_n_steps``. A step not after the latest raises :class:`InvalidCheckpointError`
    unless ``overwrite`` (which replaces it and removes the newer ones). With an
    ``async_manager`` the call returns after the host snapshot. Returns the path.

    >>> import tempfile, numpy as np
    >>> from ctrainstate.checkpoint import save_checkpoint, restore_checkpoint
    >>> d = tempfile.mkdtemp()
    >>> p = save_checkpoint(d, {'w': np.ones(2, np.float32)}, step=10)
    >>> os.path.basename(p), restore_checkpoint(d, None)['w'].tolist()
    ('checkpoint_10', [1.0, 1.0])
    """
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    step = int(step)
    if async_manager is not None:
        async_manager.wait_previous_save()
    os.makedirs(ckpt_dir, exist_ok=True)
    steps = available_steps(ckpt_dir, prefix)
    if steps and step <= steps[-1] and not overwrite:
        raise InvalidCheckpointError(
            f"trying to save an outdated checkpoint at step {step}: the latest in {ckpt_dir} "
            f"is step {steps[-1]} (pass overwrite=True to replace it)")
    final = os.path.join(ckpt_dir, f"{prefix}{step}")
    plan = _store.SavePlan(to_state_dict(target), snapshot=async_manager is not None)

    def retain():
        have = available_steps(ckpt_dir, prefix)
        newer = [s for s in have if s > step]
        for s in newer:   # overwrite: later steps belong to the run being replaced
            _store.remove(os.path.join(ckpt_dir, f"{prefix}{s}"))
        have = [s for s in have if s <= step]
        for s in have[:-keep] if keep and len(have) > keep else []:
            if keep_every_n_steps and s % keep_every_n_steps == 0:
                continue
            _store.remove(os.path.join(ckpt_dir, f"{prefix}{s}"))

    save = _procs.Save(plan, final, _metadata(step),
                       before=lambda: _cleanup_partial(ckpt_dir, prefix), after=retain,
                       background=async_manager is not None)
    if async_manager is not None:
        async_manager.save_async(save.background())
    else:
        save.run()
    return final


def restore_checkpoint(ckpt_dir, target, step=None, prefix: str = "checkpoint_",
                       parallel: bool = True, gda_manager=None,
                       allow_partial_mpa_restoration: bool = False, orbax_checkpointer=None,
                       orbax_transforms=None, *, cast: bool = False):
    """The checkpoint in ``ckpt_dir`` (the latest, or ``step``; ``ckpt_dir`` may also be a
    checkpoint directory itself) placed like ``target``; with no checkpoint there,
    ``target`` itself, as in Flax. ``target=None`` gives nested dicts of host arrays."""
    ckpt_dir = os.fspath(ckpt_dir)
    if os.path.isfile(os.path.join(ckpt_dir, _store.INDEX)):
        path = ckpt_dir
    elif step is not None:
        path = os.path.join(ckpt_dir, f"{prefix}{int(step)}")
        if not os.path.isfile(os.path.join(path, _store.INDEX)):
            raise ValueError(f"Matching checkpoint not found: {path}")
    else:
        path = latest_checkpoint(ckpt_dir, prefix)
        if path is None:
            return target
    return _restore(path, target, cast)


# --- t5x ------------------------------------------------------------------------------------------

def _remove_on_process_0(path: str, remove=_store.remove) -> None:
    """Delete a checkpoint directory: by process 0 alone in a job of several processes, once
    every process has reached the call (none still reads the steps), the others waiting
    until it is gone (an error there raises on every process)."""
    me, n = _procs.job()
    if n == 1:
        remove(path)
        return
    _procs.agree(None, f"deleting the checkpoint {path}")   # a barrier
    err = None
    if me == 0:
        try:
            remove(path)
        except Exception as e:   # noqa: BLE001 - raised on every process
            err = f"{type(e).__name__}: {e}"
    _procs.agree(err, f"deleting the checkpoint {path}")


class T5xCheckpointer:
    """t5x's ``checkpoints.Checkpointer``: ``save(train_state)`` writes
    ``<checkpoints_dir>/checkpoint_<step>`` (float params cast to ``save_dtype``, float32 by
    default, as t5x does); ``restore(step=None, path=None)`` returns ``train_state`` with the
    saved values, each array on its sharding in the ``train_state`` given here (a state or
    ``eval_shape`` of one), cast to its dtype, then to ``restore_dtype`` if given.
    ``state_transformation_fns`` are called ``fn(state_dict, target_state_dict)`` in order on
    restore (before saving, on the state dict to be written). Dataset iterators are not
    checkpointed (``dataset_iterator`` must be None); ``fallback_state``,
    ``lazy_parameters`` and ``concurrent_gb`` are accepted and have no effect (every array is
    read onto its sharding when ``restore`` runs, one slice at a time).
    """

    def __init__(self, train_state, partitioner=None, checkpoints_dir="",
                 dataset_iterator=None, *, keep: int | None = None,
                 save_dtype=np.float32, restore_dtype=None, keep_dataset_checkpoints=None):
        if dataset_iterator is not None:
            raise ValueError("ctrainstate's t5x Checkpointer does not checkpoint dataset "
                             "iterators: pass dataset_iterator=None")
        self._train_state = train_state
        self._partitioner = partitioner
        self.checkpoints_dir = os.path.abspath(os.fspath(checkpoints_dir))
        self.keep = keep
        self.save_dtype = np.dtype(save_dtype) if save_dtype is not None else None
        self.restore_dtype = np.dtype(restore_dtype) if restore_dtype is not None else None

    @staticmethod
    def _state_dict(train_state):
        if hasattr(train_state, "state_dict"):
            return train_state.state_dict()
        return to_state_dict(train_state)

    def _save_cast(self, keys, leaf):
        if self.save_dtype is None or not keys or keys[0] != "target":
            return None
        dt = np.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype))
        if dt.kind == "f" or dt.name == "bfloat16":
            return self.save_dtype if dt != self.save_dtype else None
        return None

    def save(self, train_state, state_transformation_fns: Sequence[Callable] = (), *,
             concurrent_gb: int = 128) -> str:
        """Write ``train_state`` as ``checkpoint_<step>``; returns the path."""
        step = int(np.asarray(train_state.step))
        sd = self._state_dict(train_state)
        for fn in state_transformation_fns:
            sd = fn(sd, sd)
        os.makedirs(self.checkpoints_dir, exist_ok=True)
        final = os.path.join(self.checkpoints_dir, f"checkpoint_{step}")
        plan = _store.SavePlan(sd, snapshot=False, cast=self._save_cast)

        def retain():
            if self.keep:
                steps = available_steps(self.checkpoints_dir, "checkpoint_")
                for s in steps[:-self.keep]:
                    _store.remove(os.path.join(self.checkpoints_dir, f"checkpoint_{s}"))
        save = _procs.Save(plan, final, _metadata(step),
                           before=lambda: _cleanup_partial(self.checkpoints_dir, "checkpoint_"),
                           after=retain)
        save.run()
        return final

    def restore(self, step: int | None = None, path: str | None = None,
                state_transformation_fns: Sequence[Callable] = (), fallback_state=None,
                lazy_parameters: bool = False):
        """The train state of ``path`` (a checkpoint directory), or of ``step`` (default: the
        latest) under ``checkpoints_dir``."""
        if path is None:
            steps = available_steps(self.checkpoints_dir, "checkpoint_")
            if step is None:
                if not steps:
                    raise ValueError(f"no checkpoint in {self.checkpoints_dir}")
                step = steps[-1]
            path = os.path.join(self.checkpoints_dir, f"checkpoint_{int(step)}")
        target_sd = self._state_dict(self._train_state)
        sd = _store.restore_dir(os.fspath(path), target_sd, cast=True)
        for fn in state_transformation_fns:
            sd = fn(sd, target_sd)
        if self.restore_dtype is not None and "target" in sd:
            sd["target"] = _cast_floats(sd["target"], self.restore_dtype)
        if hasattr(self._train_state, "restore_state"):
            return self._train_state.restore_state(sd)
        return from_state_dict(self._train_state, sd)


def _cast_floats(tree, dtype):
    if isinstance(tree, dict):
        return {k: _cast_floats(v, dtype) for k, v in tree.items()}
    if isinstance(tree, (Array, np.ndarray)) and (tree.dtype.kind == "f"
                                                  or tree.dtype.name == "bfloat16"):
        return tree.astype(dtype)
    return tree


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
