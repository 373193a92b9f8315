"""One save of a checkpoint, by one process or by every process of a job.

:class:`Save` runs a save in three steps, so that the part that may run in a background
thread never calls a collective (the training loop's own collectives may run in the main
thread meanwhile, and every process must issue the collectives in the same order):

1. ``Save(...)`` (the caller's thread): in a job of several processes, process 0 removes
   what interrupted saves left (``before``) and creates the step's temporary directory;
   then one exchange (host all-gather) gives every process the directory's name and checks
   that every process passed the same tree (keys, shapes, dtypes, shardings of the Arrays
   that span processes). One process alone creates the directory in ``write``.
2. ``write()`` (any thread): this process's safetensors file, fsync'd. One process alone
   also writes the index, commits (renames the directory) and runs ``after`` (retention)
   here, as a single-process save always has. Across processes an error is kept for step 3
   rather than raised, so that every process still reaches it.
3. ``finish()`` (the caller's thread, on every process; a no-op for one process): an
   exchange of every process's slices (offsets, checksums) or error — it is also the
   barrier after which every file is fsync'd. If any process failed, process 0 removes the
   temporary directory and every process raises, naming the processes and their errors:
   nothing is committed. Otherwise process 0 merges the slices into the index, writes it,
   fsyncs the directory, renames it to its final name and runs ``after``; a last exchange
   tells every process whether that worked, so that all raise or none does, and none
   returns before the commit is visible.

Each exchange waits at most ``ctrainstate.distributed``'s timeout: a process that died or
hangs makes the others raise ``TimeoutError`` (process 0 then removes the temporary
directory; the next save removes anything left). The processes must see one file system
(the directory is shared): process 0 renames the directory holding every process's file.
"""
from __future__ import annotations

import json
import os
import shutil

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


def exchange(obj) -> list:
    """Every process's ``obj`` (JSON values), on every process, in process order (two
    host all-gathers: the lengths, then the bytes)."""
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    n = _dist.process_count()
    sizes = np.empty(n, np.int64)
    _C.dist_allgather(np.array([data.size], np.int64), sizes, _dist.default_timeout())
    parts = _dist._allgather_padded(data, [int(v) for v in sizes])
    return [json.loads(bytes(p).decode()) for p in parts]


def agree(error: str | None, what: str) -> None:
    """Raise on every process when any process passes an ``error`` (a collective)."""
    if job()[1] == 1:
        if error:
            raise RuntimeError(f"{what}: {error}")
        return
    failed = [(p, e) for p, e in enumerate(exchange(error)) if e]
    if failed:
        raise RuntimeError(f"{what}: " + "; ".join(f"process {p}: {e}" for p, e in failed))


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class Save:
    """One save of ``plan`` as the checkpoint directory ``final`` (the module docstring says
    how). ``before()`` runs before the temporary directory is made (on process 0 only),
    ``after()`` after the commit (on process 0 only): cleanup and retention."""

    def __init__(self, plan, final: str, metadata: dict, *, before=None, after=None):
        self.plan, self.final, self.metadata = plan, final, metadata
        self.after = after
        self.me, self.n = job()
        self.error: BaseException | None = None
        self.done = False
        if self.n == 1:
            if plan.spans_processes:   # the job was shut down under the Arrays
                raise ValueError("checkpoint: an Array spans processes, but "
                                 "ctrainstate.distributed is not initialized")
            if before is not None:
                before()
            self.tmp = _store.tmp_name(final)
            return
        tmp, err = None, None
        if self.me == 0:
            try:
                if before is not None:
                    before()
                tmp = _store.tmp_name(final)
                os.mkdir(tmp)
            except Exception as e:   # noqa: BLE001 - raised on every process below
                err = _describe(e)
        sig = plan.signature()
        got = exchange({"tmp": tmp, "error": err, "signature": sig})
        if got[0]["error"]:
            raise RuntimeError(f"checkpoint {final}: process 0 could not create the "
                               f"step's directory: {got[0]['error']}")
        differ = [p for p, g in enumerate(got) if g["signature"] != got[0]["signature"]]
        if differ:
            if self.me == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise ValueError(
                f"checkpoint {final}: processes {differ} passed another tree than process 0 "
                f"(keys, shapes, dtypes or the shardings of Arrays that span processes "
                f"differ); every process saves the same state")
        self.tmp = got[0]["tmp"]

    def write(self) -> None:
        """This process's file (and, for one process, the whole save); in any thread."""
        if self.n == 1:
            try:
                _store.write_plan(self.plan, self.tmp, self.metadata)
                _store.commit(self.tmp, self.final)
            except BaseException:
                shutil.rmtree(self.tmp, ignore_errors=True)
                raise
            self.done = True
            if self.after is not None:
                self.after()
            return
        try:
            _store.write_file(self.plan, self.tmp)
        except Exception as e:   # noqa: BLE001 - every process raises it in finish()
            self.error = e

    def finish(self) -> None:
        """Gather, commit and agree (every process calls it; nothing for one process)."""
        if self.n == 1 or self.done:
            return
        self.done = True
        committed = False
        try:
            mine = {"error": _describe(self.error) if self.error is not None else None,
                    "slices": [] if self.error is not None else self.plan.slices()}
            got = exchange(mine)
            failed = [(p, g["error"]) for p, g in enumerate(got) if g["error"]]
            if failed:
                raise RuntimeError(
                    f"checkpoint {self.final} was not saved (nothing committed): "
                    + "; ".join(f"process {p} failed: {e}" for p, e in failed)) \
                    from self.error
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
                       f"{'clean up after committing' if committed else 'commit'}")
        finally:
            if self.me == 0 and not committed:
                shutil.rmtree(self.tmp, ignore_errors=True)
