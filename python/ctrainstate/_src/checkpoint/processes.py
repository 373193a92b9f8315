"""One save of a checkpoint, by one process or by every process of a job.

A save of several processes (``ctrainstate.distributed.initialize()``) is :meth:`Save.run`,
every step on every process:

1. process 0 removes what interrupted saves left (``before``) and creates the step's
   temporary directory; one exchange (host all-gather) gives every process the directory's
   name and checks that every process passed the same tree (keys, shapes, dtypes, shardings
   of the Arrays that span processes);
2. each process writes its safetensors file, fsync'd; an error is kept, not raised, so that
   every process still reaches step 3;
3. an exchange of every process's slices (offsets, checksums) or error, which is also the
   barrier after which every file is fsync'd. If any process failed, process 0 removes the
   temporary directory and every process raises, naming the processes and their errors:
   nothing is committed. Otherwise process 0 merges the slices into the index, writes it,
   fsyncs the directory, renames it to its final name and runs ``after`` (retention); a
   last exchange tells every process whether that worked, so that all raise or none does,
   and none returns before the commit is visible.

A synchronous save runs these in the caller's thread, on the engine's main channel. A
background save (``background=True``; :meth:`Save.background` is what the background
thread runs) runs all of them in that thread, on the engine's checkpoint channel: its own
communicator, whose collectives wait alongside those the training loop issues meanwhile on
the main channel without holding them up (csrc/process/ct_dist.h). The background saves of
a process run one after another in the order they were started (:func:`in_order`), so
every process issues the checkpoint channel's collectives in the same order.

One process alone removes what interrupted saves left in the caller's thread and writes,
commits and runs ``after`` in :meth:`Save.run` (no collective).

Each exchange waits at most ``ctrainstate.distributed``'s timeout: a process that died or
hangs makes the others raise ``TimeoutError`` (process 0 then removes the temporary
directory; the next save removes anything left). The processes must see one file system
(the directory is shared): process 0 renames the directory holding every process's file.
"""
from __future__ import annotations

import json
import os
import shutil
import threading

import numpy as np

from ... import _C
from ..distributed import distributed as _dist
from . import store as _store


def job() -> tuple[int, int]:
    """(this process's index, the number of processes): (0, 1) without
    ``ctrainstate.distributed.initialize()``."""
    if _dist.is_initialized() and _dist.process_count() > 1:
        return _dist.process_index(), _dist.process_count()
    return 0, 1


MAIN, CHECKPOINT = 0, 1   # the process engine's channels (csrc/process/ct_dist.h)


def exchange(obj, channel: int = MAIN) -> list:
    """Every process's ``obj`` (JSON values), on every process, in process order (two
    host all-gathers on ``channel``: the lengths, then the bytes)."""
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    n = _dist.process_count()
    sizes = np.empty(n, np.int64)
    _C.dist_allgather(np.array([data.size], np.int64), sizes, _dist.default_timeout(),
                      channel)
    parts = _dist._allgather_padded(data, [int(v) for v in sizes], channel)
    return [json.loads(bytes(p).decode()) for p in parts]


def agree(error: str | None, what: str, channel: int = MAIN) -> None:
    """Raise on every process when any process passes an ``error`` (a collective)."""
    if job()[1] == 1:
        if error:
            raise RuntimeError(f"{what}: {error}")
        return
    failed = [(p, e) for p, e in enumerate(exchange(error, channel)) if e]
    if failed:
        raise RuntimeError(f"{what}: " + "; ".join(f"process {p}: {e}" for p, e in failed))


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


_order_lock = threading.Lock()
_latest: threading.Event | None = None   # set once the latest background save has ended


def in_order(fn):
    """``fn`` wrapped to run only after every background save started before it has ended
    (called in the caller's thread, in program order: every process then runs its
    background saves, and their collectives, in the same order)."""
    global _latest
    done = threading.Event()
    with _order_lock:
        before, _latest = _latest, done

    def run():
        try:
            if before is not None:
                before.wait()
            fn()
        finally:
            done.set()
    return run


class Save:
    """One save of ``plan`` as the checkpoint directory ``final`` (the module docstring says
    how). ``before()`` runs before the temporary directory is made (on process 0 only),
    ``after()`` after the commit (on process 0 only): cleanup and retention. ``background``:
    the save will run in a background thread (:meth:`background`), its collectives on the
    checkpoint channel."""

    def __init__(self, plan, final: str, metadata: dict, *, before=None, after=None,
                 background: bool = False):
        self.plan, self.final, self.metadata = plan, final, metadata
        self.before, self.after = before, after
        self.me, self.n = job()
        self.channel = CHECKPOINT if background else MAIN
        self.tmp: str | None = None
        if self.n == 1:
            if plan.spans_processes:   # the job was shut down under the Arrays
                raise ValueError("checkpoint: an Array spans processes, but "
                                 "ctrainstate.distributed is not initialized")
            if before is not None:
                before()
            self.tmp = _store.tmp_name(final)

    def background(self):
        """What the background thread runs: :meth:`run`, after the background saves started
        before this one (several processes)."""
        return self.run if self.n == 1 else in_order(self.run)

    def run(self) -> None:
        """The whole save (every process calls it, in any one thread)."""
        if self.n == 1:
            try:
                _store.write_plan(self.plan, self.tmp, self.metadata)
                _store.commit(self.tmp, self.final)
            except BaseException:
                shutil.rmtree(self.tmp, ignore_errors=True)
                raise
            if self.after is not None:
                self.after()
            return
        self._prepare()
        error = None
        try:
            _store.write_file(self.plan, self.tmp)
        except Exception as e:   # noqa: BLE001 - every process raises it in _commit()
            error = e
        self._commit(error)

    def _prepare(self) -> None:
        tmp, err = None, None
        if self.me == 0:
            try:
                if self.before is not None:
                    self.before()
                tmp = _store.tmp_name(self.final)
                os.mkdir(tmp)
            except Exception as e:   # noqa: BLE001 - raised on every process below
                err = _describe(e)
        got = exchange({"tmp": tmp, "error": err, "signature": self.plan.signature()},
                       self.channel)
        if got[0]["error"]:
            raise RuntimeError(f"checkpoint {self.final}: process 0 could not create the "
                               f"step's directory: {got[0]['error']}")
        differ = [p for p, g in enumerate(got) if g["signature"] != got[0]["signature"]]
        if differ:
            if self.me == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise ValueError(
                f"checkpoint {self.final}: processes {differ} passed another tree than process "
                f"0 (keys, shapes, dtypes or the shardings of Arrays that span processes "
                f"differ); every process saves the same state")
        self.tmp = got[0]["tmp"]

    def _commit(self, error: BaseException | None) -> None:
        """Gather, commit and agree (every process)."""
        committed = False
        try:
            mine = {"error": _describe(error) if error is not None else None,
                    "slices": [] if error is not None else self.plan.slices()}
            got = exchange(mine, self.channel)
            failed = [(p, g["error"]) for p, g in enumerate(got) if g["error"]]
            if failed:
                raise RuntimeError(
                    f"checkpoint {self.final} was not saved (nothing committed): "
                    + "; ".join(f"process {p} failed: {e}" for p, e in failed)) from error
            err = None
            if self.me == 0:
                try:
                    leaves = self.plan.leaves
                    for g in got[1:]:
                        for pos, slices in g["slices"]:
                            leaves[pos]["slices"].extend(slices)
                    for e in leaves:
                        if e.get("kind") == "array":
                            e["slices"].sort(key=lambda sl: sl["index"])
                    _store.write_index(self.tmp, leaves, self.metadata)
                    _store.commit(self.tmp, self.final)
                    committed = True
                    if self.after is not None:
                        self.after()
                except Exception as e:   # noqa: BLE001 - raised on every process below
                    err = _describe(e)
            agree(err, f"checkpoint {self.final}: process 0 could not "
                       f"{'clean up after committing' if committed else 'commit'}",
                  self.channel)
        finally:
            if self.me == 0 and not committed:
                shutil.rmtree(self.tmp, ignore_errors=True)
