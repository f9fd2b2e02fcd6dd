"""Checkpoints across ranks: the one owner of checkpoint coordination (as torchtitan's checkpoint manager).

Every rank calls `save()` and `find_latest()` at the same points; rank 0 alone holds the store
(mgpu.state.single.store). A save gathers the state (a collective the caller supplies), rank 0 writes it in the
background or at once (a periodic save never waits for the writer: one that comes due while the last is still
being written is deferred, on every rank alike, to the first due save after the writer is free, whose
`checkpoint_saved` says how many were, `deferred`; a best save then waits in the store's queue instead), and
every rank learns the same outcome: a failed background save is reported
(log line, `checkpoint_failed`) and the next due save tries again; a synchronous one that fails raises
the same CheckpointError on every rank. The first save of a process checks that a resume could load
the state. A resume: rank 0 finds the newest checkpoint that verifies, every rank loads that file,
memory-mapped, without hashing it again.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

from mgpu.state.single.store import CheckpointError, CheckpointStore, CheckpointSuperseded, LoadedCheckpoint
from mgpu.state.loadable import check_loadable
from mgpu.parallel.distributed import broadcast_object
from mgpu.record.check_hooks import checking
from mgpu.record.ledger import Ledger
from mgpu.record.rundir import RunDir

__all__ = ["Checkpointer", "open_checkpointer"]

log = logging.getLogger("mgpu.train")


def _no_beat(phase: str, step: int | None = None) -> None:
    """Without a watchdog, progress is not recorded."""


class Checkpointer:
    """The run's checkpoints, seen from one rank."""

    def __init__(self, run: RunDir, rank: int, world: int, ledger: Ledger, *, keep_last: int = 2,
                 async_save: bool = True, keep_snapshot_buffers: bool = True,
                 beat: Callable[..., None] = _no_beat) -> None:
        self.rank, self.world, self.ledger, self.async_save, self.beat = rank, world, ledger, async_save, beat
        self.store = CheckpointStore(run.checkpoints, keep_last=keep_last,
                                     keep_snapshot_buffers=keep_snapshot_buffers) if rank == 0 else None
        self.last_saved_step = -1
        self._failed_step = -1  # rank 0: the step of the last save that failed
        self._checked_loadable = False
        self._superseded: dict[int, int] = {}  # rank 0: a newer save's step -> the queued step it superseded
        self._deferred = 0  # periodic saves deferred since the last one started (the writer was busy)
        self.longest_write_s = 0.0
        """Rank 0: the longest checkpoint write so far (what a stop before the time limit must leave room for)."""

    # ------------------------------------------------------------------ resume
    def find_latest(self) -> LoadedCheckpoint | None:
        """The newest valid checkpoint, loaded on every rank (a collective); None for a new run."""
        found, refusal = None, None
        if self.store is not None:
            try:
                found = self.store.latest()
            except CheckpointError as error:  # none valid, or a newer format: every rank raises it alike
                refusal = str(error)
            for bad, reason in found.skipped if found else ():
                log.warning("checkpoint %s rejected (%s); using an older one", bad, reason)
        path, refusal = broadcast_object((str(found.path) if found else None, refusal))
        if refusal is not None:
            raise CheckpointError(refusal)
        if path is None:
            return None
        # Rank 0 verified it (sha256); the others load the same file without hashing it again.
        loaded = found if found is not None else CheckpointStore.load_dir(Path(path), verify=False)
        self.last_saved_step = loaded.step
        return loaded

    # ------------------------------------------------------------------ save
    def save(self, gather: Callable[[], dict[str, Any] | None], step: int, reason: str, *, is_best: bool = False,
             wait: bool = False, extra: dict[str, Any] | None = None) -> Path | None:
        """Checkpoint `step` (a collective: `gather()` returns the state on rank 0, None elsewhere).

        `wait`: return only once it is durable (the path on rank 0). A step saved already is not saved
        again, unless that save failed."""
        if step == self.last_saved_step and not is_best:
            if not wait:
                return None
            # Saved at this step already, maybe in the background: only a failure of that save (it may
            # have just ended) makes the stop write it again.
            if self.store is not None:
                self.store.settle()
            failed = self._failed_step == step
            if not (broadcast_object(failed) if self.world > 1 else failed):
                return self.store.latest_path() if self.store is not None else None
        if not wait and not is_best and self.async_save and self._writer_busy() and not checking():
            # Deferred, not queued: no host copy (and no second one held) for a save the writer could not start.
            self._deferred += 1
            log.info("checkpoint step %d deferred: the last save is still being written; training goes on", step)
            return None
        self.beat("checkpoint")
        state = gather()
        path, error = None, None
        if self.store is not None and state is not None:
            self.beat("write")
            try:
                path = self._write(state, step, reason, is_best, wait, extra or {})
            except CheckpointError as failure:
                error = f"{failure}; the newest checkpoint on disk is {self.store.latest_path() or 'none'}"
        self.beat("checkpoint-wait")
        if self.world > 1 and (wait or not self._checked_loadable):
            # Every rank learns the outcome together (a barrier otherwise): none is left waiting in a
            # collective for a rank that gave up.
            error = broadcast_object(error)
        if error is not None:
            raise CheckpointError(error)
        self._checked_loadable = True
        self.last_saved_step = step
        return path

    def _writer_busy(self) -> bool:
        """*Collective* (ranks > 1): whether rank 0's writer is still writing the last save, on every rank."""
        busy = self.store is not None and self.store.in_flight
        return bool(broadcast_object(busy)) if self.world > 1 else busy

    def _write(self, state: dict[str, Any], step: int, reason: str, is_best: bool, wait: bool,
               extra: dict[str, Any]) -> Path | None:
        """Rank 0: hand the gathered state to the store, in the background unless `wait` (or async is off)."""
        assert self.store is not None
        if not self._checked_loadable:
            check_loadable(state)  # the first save of this process: a state a resume could not read fails now
        extra = {**extra, "reason": reason}
        started = time.perf_counter()
        blocked = 0.0
        deferred, self._deferred = self._deferred, 0

        def done(result: Any) -> None:
            if isinstance(result, CheckpointSuperseded):  # called by the newer save, before its own outcome
                self._superseded[result.by] = result.step
                return
            superseded = self._superseded.pop(step, None)
            named = {"superseded_step": superseded} if superseded is not None else {}
            if deferred:
                named["deferred"] = deferred  # due saves skipped while the writer was busy, since the last one
            if isinstance(result, BaseException):
                self._failed_step = step
                message = " ".join(str(result).split())
                log.error("%s; training goes on, the next checkpoint will try again", message)
                self.ledger.write("checkpoint_failed", step=step, reason=reason, error=message,
                                  errno=getattr(result, "errno", None), **named)
            else:
                self.longest_write_s = max(self.longest_write_s, result.seconds)
                self.ledger.write("checkpoint_saved", step=result.step, seconds=round(result.seconds, 4),
                                  blocked_s=round(blocked, 4), bytes=result.bytes, path=str(result.path),
                                  **({"queued_s": round(result.queued_s, 4)} if result.queued_s else {}), **named,
                                  reason=reason)

        if self.async_save and not wait:
            if checking():
                # The resume check compares the saves of two runs step by step: a save queued behind a slow write
                # would be superseded by the next (never written) as the machine's timing decides. Wait instead.
                self.store.settle()
            queued_behind = self.store.in_flight  # this save waits for the writer; training does not
            self.store.save_async(state, step, is_best=is_best, extra=extra, on_done=done)
            blocked = time.perf_counter() - started
            if queued_behind:
                log.info("checkpoint step %d queued behind the save being written; training goes on", step)
            return None
        try:
            saved = self.store.save(state, step, is_best=is_best, extra=extra)
        except CheckpointError as failure:
            self._failed_step = step
            superseded = self._superseded.pop(step, None)
            self.ledger.write("checkpoint_failed", step=step, reason=reason, error=" ".join(str(failure).split()),
                              errno=getattr(failure, "errno", None),
                              **({"superseded_step": superseded} if superseded is not None else {}))
            raise
        blocked = time.perf_counter() - started
        done(saved)
        return saved.path

    def close(self) -> None:
        """Wait for a background save in flight (its outcome was reported by then); free its buffers."""
        if self.store is not None:
            self.store.close()


def open_checkpointer(run: RunDir, rank: int, world: int, ledger: Ledger, config: Any, *, sharded: bool,
                      beat: Callable[..., None] = _no_beat, version: str | None = None,
                      wait_s: float | None = None) -> Any:
    """The run's checkpointer for the config's `checkpoint` section: `Checkpointer` (single file), or with
    `sharded` mgpu.state.sharded.checkpointer's `ShardedCheckpointer` (every rank writes its shard; [fsdp hook]; its
    ranks wait `wait_s` for each other). Under the resume check every checkpoint is kept (which of the newest `keep_last` a run
    still has at its end depends on when its writer pruned: the runs it compares keep every step they saved)."""
    keep_last = CHECKED_KEEP_LAST if checking() else config.keep_last
    if sharded:
        from mgpu.state.sharded.checkpointer import ShardedCheckpointer

        return ShardedCheckpointer(run.checkpoints, rank, world, ledger, keep_last=keep_last,
                                   async_save=config.async_save, beat=beat, version=version, wait_s=wait_s)
    return Checkpointer(run, rank, world, ledger, keep_last=keep_last, async_save=config.async_save,
                        keep_snapshot_buffers=config.keep_snapshot_buffers, beat=beat)


CHECKED_KEEP_LAST = 1_000_000
"""keep_last under the resume check (mgpu.record.check_hooks.checking): every checkpoint, to compare."""
