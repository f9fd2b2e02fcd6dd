"""Sharded checkpoints inside mgpu's store: every rank writes its own shard through torch.distributed.checkpoint.

A sharded save is one `step_XXXXXXXX/` directory of the same store (mgpu.state.single.store: `latest`/`best`, keep-K,
stale `.tmp-*` removal), built under a temporary name every rank writes into:

    .metadata, __R_0.distcp   DCP's metadata (rank 0) and rank R's shard of the models and optimizers
    common.pt                 rank 0: everything else (progress, scheduler, scaler, loader, plain values)
    rank_R.pt                 rank R's own pieces: its RNG state
    manifest_R.json           rank R's files with their size and checksum (mgpu.state.files.digest), computed while
                              written
    meta.json                 rank 0, last: the step, the world size, every manifest's sha256

Rank 0 renames the directory into place only after every rank reported its manifest durable, so a killed
save leaves a `.tmp-*` (removed later) and the `latest` of before. A load verifies in parallel (saved rank r's
files by current rank r % W), falls back to the previous checkpoint when any file is damaged, and never
unpickles anything but tensors, numbers, strings and DCP's own metadata classes (mgpu.state.sharded.find; one
process reads a whole sharded checkpoint with mgpu.state.sharded.export). DCP reshards the models and
optimizers onto any world size; a rank the saved run did not have gets a fresh, derived RNG stream.

`async_save`: the state is copied to host memory before `save_objects` returns (a save is a snapshot of its step:
nothing the loop does afterwards, an EMA's in-place update included, changes what is written) and that copy is
written in a thread; without CUDA the writer starts on each tensor as soon as its copy is made
(mgpu.state.sharded.staging); at most one save is in flight.

Every save's collectives wait `wait_s` at most (the save's group's timeout), and a save that failed on any rank
never leaves its group to the next: the ranks agree at the start of each save (one gather on the training
thread's group, which every save makes anyway) and make a fresh group when any of them saw the last one fail.
A gloo group whose collective timed out is broken for good (its connections closed: every later collective on
it fails at once, "Application timeout caused pair closure", and the late rank's name was lost with it); a fresh
one per failure costs nothing while saves succeed.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from mgpu.state.single.store import CheckpointStore
from mgpu.state.checkpoint_format import (META_FILE, CheckpointError, LoadedCheckpoint, claimed, describe_os_error,
                                          one_line, sha256_file, tmp_name)
from mgpu.state.loadable import check_loadable
from mgpu.state.single import store as _checkpoint
from mgpu.state.sharded.filesystem import DigestingFileSystem
from mgpu.state.sharded.find import find_latest
from mgpu.state.sharded.staging import AligningPlanner, PipelinedStager, next_stager
from mgpu.state.sharded.format import (COMMON, FORMAT, KIND, common_state, dcp_state, file_entry, manifest_name,
                                       rank_file, read_meta, split_objects, sync_buffers, to_bytes, verify_rank)
from mgpu.fsutil import fsync_all, fsync_path, write_durably
from mgpu.record.ledger import Ledger
from mgpu.state.rng import capture_rng_state
from mgpu.state.sharded.arrivals import Arrivals, MarkingWriter, late_line
from mgpu.state.train_state import gather_rank_states

# The layout's names are re-exported: mgpu.state.sharded.checkpointer is where callers take a sharded checkpoint's API.
__all__ = ["KIND", "ShardedCheckpointer", "rank_file", "read_meta", "split_objects", "verify_rank"]

log = logging.getLogger("mgpu.train")

REUSE_STAGER = True
"""Where CUDA is not available, one asynchronous-save stager (and its host copy's buffers) for the checkpointer's
life; False: a new one per save, as where CUDA is (a bench's A/B)."""

PIPELINED_STAGING = True
"""Where CUDA is not available, a periodic save's writer starts while its host copy is still being made
(mgpu.state.sharded.staging); False: DCP's DefaultStager copies it all first (a bench's A/B)."""


# ---------------------------------------------------------------------------------------------- the checkpointer
class ShardedCheckpointer:
    """The run's sharded checkpoints, seen from one rank: every rank writes, rank 0 installs.

    The same interface as mgpu.state.checkpointer.Checkpointer, except that a save takes the objects themselves
    (`save_objects`): each rank contributes its shard; and `find_latest` can leave the shard files' checksums to
    the load that reads them (`defers_shards`)."""

    defers_shards = True

    def __init__(self, directory: Path, rank: int, world: int, ledger: Ledger, *, keep_last: int = 2,
                 async_save: bool = True, beat: Callable[..., None] | None = None,
                 version: str | None = None, wait_s: float | None = None) -> None:
        self.directory, self.rank, self.world, self.ledger = Path(directory), rank, world, ledger
        _import_dynamo()
        self.async_save, self.beat, self.version = async_save, beat or (lambda *a, **k: None), version
        # The store's pointers, pruning and stale-file removal; its single-file writer is not used.
        self.store = CheckpointStore(self.directory, keep_last=keep_last)
        # Collectives of a save in flight run on their own group: the training thread's never wait behind them.
        # A gloo one on a world of one too: dcp.async_save refuses a group without a CPU backend (NCCL alone, as
        # one GPU rank's default group is; seen on an H100).
        # `wait_s`: how long its ranks wait for each other (DCP's gathers, the outcome's), so that a late rank ends
        # the save in that bound, named (mgpu.state.sharded.arrivals), not in torch's default 30 minutes (None: that).
        self.wait_s = wait_s
        self.group = self._new_group() if dist.is_initialized() else None
        self._group_failed = False  # a save failed on this rank since the group was made: replaced at the next
        self._store = dist.distributed_c10d._get_default_store() if dist.is_initialized() and world > 1 else None
        self.last_saved_step = -1
        self.longest_write_s = 0.0
        self._failed_step = -1
        self._thread: threading.Thread | None = None
        self._outcome: str | None = None  # the last background save's error (None: it succeeded)
        self._checked_loadable = False
        self._stager: Any = None

    # ------------------------------------------------------------------ saving
    def save_objects(self, objects: Mapping[str, Any], step: int, reason: str, *, is_best: bool = False,
                     wait: bool = False, extra: dict[str, Any] | None = None) -> Path | None:
        """*Collective.* Checkpoint `objects` at `step`: the models and optimizers sharded, the rest on rank 0.
        `wait`: durable on return (raises the same CheckpointError on every rank if it failed)."""
        called = time.monotonic()
        if step == self.last_saved_step and not is_best:
            self.settle()
            if not wait or not self._agree(self._failed_step == step):
                return self.store.latest_path() if wait and self.rank == 0 else None
        self.settle()
        self.beat("checkpoint")
        modules, optimizers, rest = split_objects(objects)
        per_rank = gather_rank_states(rest)  # a stateful stream's loader: every rank's state, not rank 0's alone
        common = common_state(rest, self.world, self.version) if self.rank == 0 else None
        if common is not None:
            common.update({name: {"per_rank": states} for name, states in per_rank.items()})
        if not self._checked_loadable:
            # A state a resume could not read fails at the first save, not at the resume: on every rank.
            problem = None
            if common is not None:
                try:
                    check_loadable(common)
                except CheckpointError as error:
                    problem = str(error)
            problem = self._broadcast(problem)
            if problem is not None:
                raise CheckpointError(problem)
        sync_buffers(modules)
        state = dcp_state(modules, optimizers)
        pieces = {"rng": capture_rng_state()}
        tmp = self._make_tmp(step)
        started = time.monotonic()
        job = _Job(step, reason, is_best, {**(extra or {}), "reason": reason}, tmp, started,
                   to_bytes(common) if common is not None else None, to_bytes(pieces), called)
        self.beat("write")
        if wait or not self.async_save:
            failure = self._write_now(state, job)
            self.beat("checkpoint-wait")
            if failure is not None:
                self._failed_step = step
                raise CheckpointError(failure)
            self.last_saved_step = step
            self._checked_loadable = True
            return self.directory / f"step_{step:08d}" if self.rank == 0 else None
        self._write_async(state, job)
        self.last_saved_step = step
        self._checked_loadable = True
        return None

    def _agree(self, flag: bool) -> bool:
        return bool(self._broadcast(flag))

    def _broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (the training thread's group)."""
        if self.world == 1:
            return value
        holder = [value]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def _make_tmp(self, step: int) -> Path:
        """Rank 0 creates the save's temporary directory; every rank learns its name, and the save runs on a
        fresh group when the last one failed on any rank (a collective of every rank on the training thread's
        group: the previous save has settled everywhere, so the new group's connections do not wait on one)."""
        name = None
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.store.remove_stale_tmp()  # a killed save's space back before this one needs it
            name = tmp_name(f"step_{step:08d}")
            (self.directory / name).mkdir()
        views: list[Any] = [(name, self._group_failed)]
        if self.world > 1:
            views = [None] * self.world
            dist.all_gather_object(views, (name, self._group_failed))
        if any(failed for _, failed in views):
            try:
                self._replace_group()
            except RuntimeError as error:  # a rank gone as well: this save fails; the next one tries again
                raise CheckpointError(f"sharded checkpoint step {step} not written: its ranks could not form the "
                                      f"save's group: {one_line(error, 200)}") from None
        return self.directory / str(views[0][0])

    def _new_group(self) -> Any:
        """A gloo group for one save's collectives (DCP's and the outcome's), each waiting `wait_s` at most."""
        return dist.new_group(backend="gloo", timeout=None if self.wait_s is None else timedelta(seconds=self.wait_s))

    def _replace_group(self) -> None:
        """*Collective.* The failed save's group given up (never waited on again), a fresh one in its place."""
        old, self.group = self.group, None
        if old is not None:
            try:
                dist.destroy_process_group(old)
            except Exception as error:  # noqa: BLE001  (a broken group that cannot even close: dropped anyway)
                log.debug("closing a failed save's group: %s", error)
        self.group = self._new_group()  # (until it exists, _group_failed stays set: the next save tries again)
        self._group_failed = False

    def _arrivals(self, job: "_Job") -> Arrivals | None:
        return Arrivals(self._store, job.tmp.name, self.rank, self.world) if self._store is not None else None

    def _writer(self, job: "_Job", staged: bool = False) -> FileSystemWriter:
        """DCP's writer into the save's directory; it marks this rank's shard written (a late rank is named).
        `staged`: the state is already copied to host memory (an asynchronous save)."""
        arrivals = self._arrivals(job)
        # Where CUDA is available DCP's single-threaded writer loads tensors through a copy-ahead loader that
        # synchronizes the writing thread's CUDA stream every 10 MB (per_thread_copy_ahead), host tensors
        # included: a staged save in the background then waited ~150 times per 1.5 GB for the training loop's
        # queued kernels (3.5 s to durable against a single file's 0.8-1.2 s on an H200). Staged tensors need no
        # copy: 0 selects DCP's plain loader. A synchronous save (the stop's) keeps the copy-ahead from the GPU.
        # sync_files off: every file a rank wrote is fsync'd once, after its close, by `_write_manifest`. DCP's own
        # fsync comes before the close, while an O_DIRECT file still has writes in flight and its last block to
        # come: a second journal commit per file (15 ms of a 1 GiB save's 360 on the CI machine).
        options: dict[str, Any] = {"sync_files": False, **({"per_thread_copy_ahead": 0} if staged else {})}
        writer = (FileSystemWriter(job.tmp, **options) if arrivals is None
                  else MarkingWriter(job.tmp, on_written=arrivals.mark, **options))
        # The manifest's checksums, no re-read; DCP's torch.save into these streams without its zip CRC32s.
        # The gate: a staged save's copy, still being made (the stop's save writes the live state: nothing to wait for).
        pipelined = staged and isinstance(self._stager, PipelinedStager)
        writer.fs = DigestingFileSystem(job.digests, _checkpoint.DIGEST, zip_crc32=_checkpoint.ZIP_CRC32,
                                        direct=_checkpoint.DIRECT_IO, gate=self._stager if pipelined else None)
        return writer

    def _write_now(self, state: dict[str, Any], job: "_Job") -> str | None:
        error = None
        try:
            dcp.save(state, storage_writer=self._writer(job), process_group=self.group)
        except BaseException as failure:  # noqa: BLE001  (every rank still takes part in the outcome's gather)
            error = self._naming_late(job, failure)
        return self._finish(job, error)

    def _write_async(self, state: dict[str, Any], job: "_Job") -> None:
        self._stager = next_stager(self._stager, torch.cuda.is_available(), REUSE_STAGER, PIPELINED_STAGING)
        response = dcp.async_save(state, storage_writer=self._writer(job, staged=True), process_group=self.group,
                                  async_stager=self._stager,
                                  planner=AligningPlanner() if isinstance(self._stager, PipelinedStager) else None)
        staging = getattr(response, "staging_completion", None)
        if staging is not None:  # (not with synchronous staging; kept so that no torch version tears a save)
            staging.result()
        if isinstance(self._stager, PipelinedStager):  # planned only: filled now, DCP's writer taking each buffer
            try:
                self._stager.copy()
            except Exception as error:  # noqa: BLE001  (the write waiting on it fails: its outcome names this)
                job.copy_error = f"the host copy failed: {type(error).__name__}: {one_line(error)}"
        upload = getattr(response, "upload_completion", response)
        job.blocked_s = time.monotonic() - job.called  # staged: the loop goes on from here
        self._thread = threading.Thread(target=self._background, args=(upload, job), daemon=False,
                                        name=f"mgpu-sharded-checkpoint-{job.step}")
        self._thread.start()

    def _background(self, upload: Future[Any], job: "_Job") -> None:
        error = None
        try:
            upload.result()
        except BaseException as failure:  # noqa: BLE001
            error = job.copy_error or self._naming_late(job, failure)
        try:
            self._outcome = self._finish(job, error)
        except BaseException as failure:  # noqa: BLE001  (a peer gone mid-save: reported, never a silent success)
            self._failed_step = job.step
            self._group_failed = True
            self._outcome = f"sharded checkpoint step {job.step} not written: {_describe(failure, job.tmp)}"
            log.error("%s", self._outcome)

    def _finish(self, job: "_Job", error: str | None) -> str | None:
        """Every rank: its own files fsync'd and hashed into its manifest; rank 0 installs once all are. The
        outcome (an error line, or None) is the same on every rank."""
        if error is None:
            try:
                self._write_manifest(job)
            except OSError as failure:
                error = _describe(failure, job.tmp)
        errors: list[Any] = [error]
        if self.world > 1:
            gathered: list[Any] = [None] * self.world
            try:
                dist.all_gather_object(gathered, error, group=self.group)
            except RuntimeError as failure:  # a rank still writing, or gone: the group's timeout (wait_s)
                return self._failed(job, error or self._naming_late(job, failure))
            errors = gathered
        first = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
        if first is not None:
            error = f"sharded checkpoint step {job.step} not written (rank {first[0]}: {first[1]})"
        elif self.rank == 0:
            try:
                size = self.install(job)
                seconds = time.monotonic() - job.started
                self.longest_write_s = max(self.longest_write_s, seconds)
                # What the save held the loop: a synchronous one, all of it (goodput's checkpoint time).
                blocked = job.blocked_s if job.blocked_s is not None else time.monotonic() - job.called
                self.ledger.write("checkpoint_saved", step=job.step, seconds=round(seconds, 4),
                                  blocked_s=round(blocked, 4), bytes=size,
                                  path=str(self.directory / f"step_{job.step:08d}"), reason=job.reason,
                                  sharded=True, world_size=self.world)
            except OSError as failure:
                error = f"sharded checkpoint step {job.step} not installed: {_describe(failure, job.tmp)}"
        if self.world > 1:
            holder = [error]
            try:
                dist.broadcast_object_list(holder, src=0, group=self.group)
            except RuntimeError as failure:
                return self._failed(job, error or self._naming_late(job, failure))
            error = holder[0]
        if error is not None:
            return self._failed(job, error)
        if self.rank == 0:
            self.store.prune()  # once durable and reported, every rank released: outside the save's time
        arrivals = self._arrivals(job)
        if arrivals is not None:
            arrivals.clear()
        return None

    def _naming_late(self, job: "_Job", failure: BaseException) -> str:
        """`failure` in one line; when it is a collective's (a wait that ended, not this rank's own write), with
        the ranks whose shard was not written when this rank stopped waiting (mgpu.state.sharded.arrivals)."""
        error = _describe(failure, job.tmp)
        arrivals = self._arrivals(job)
        if arrivals is None or _os_cause(failure) is not None:
            return error
        late = late_line(arrivals.late(), self.rank, self.wait_s)
        return f"{error}; {late}" if late else error

    def _failed(self, job: "_Job", error: str) -> str:
        """A failed save: the same line on every rank when the outcome could be gathered, else this rank's."""
        if not error.startswith("sharded checkpoint"):
            error = f"sharded checkpoint step {job.step} not written: {error}"
        self._failed_step = job.step
        self._group_failed = True
        if self.rank == 0:
            with claimed(job.tmp):
                pass  # removes what the failed save left
            self.ledger.write("checkpoint_failed", step=job.step, reason=job.reason, error=error)
            log.error("%s", error)
        return error

    def _write_manifest(self, job: "_Job") -> None:
        tmp = job.tmp
        (tmp / rank_file(self.rank)).write_bytes(job.pieces)
        names = [rank_file(self.rank)]
        from_bytes = {rank_file(self.rank): job.pieces}
        if job.common is not None:
            (tmp / COMMON).write_bytes(job.common)
            names += [COMMON, ".metadata"]
            from_bytes[COMMON] = job.common
        names += sorted(p.name for p in tmp.iterdir() if p.name.startswith(f"__{self.rank}_")
                        and p.name.endswith(".distcp"))
        # The one fsync of each (DCP's writer is told not to: `_writer`), all at once: the filesystem commits them
        # together (one journal commit, not one per file in turn: 4-6 of them were 10-60 ms of a 1 GiB save).
        fsync_all([tmp / name for name in names])
        files = {name: file_entry(tmp / name, job.digests, from_bytes.get(name)) for name in names}
        write_durably(tmp / manifest_name(self.rank), (json.dumps({"rank": self.rank, "files": files}, indent=1)
                                                   + "\n").encode())

    def install(self, job: "_Job") -> int:
        """Rank 0: meta.json (binding every manifest), the atomic rename, `latest`, `best` (keep-K after, `_finish`)."""
        tmp = job.tmp
        manifests = {str(r): sha256_file(tmp / manifest_name(r)) for r in range(self.world)}
        size = sum(p.stat().st_size for p in tmp.iterdir())
        meta = {"step": job.step, "kind": KIND, "format": FORMAT, "world_size": self.world, "bytes": size,
                "manifests": manifests, "created": time.time(), "extra": job.extra}
        write_durably(tmp / META_FILE, (json.dumps(meta, indent=2) + "\n").encode())
        fsync_path(tmp, directory=True)
        name = f"step_{job.step:08d}"
        with claimed(tmp):
            self.store.install(tmp, self.directory / name)
        self.store.point("latest", name)
        if job.is_best:
            self.store.point("best", name)
        return size

    def settle(self) -> str | None:
        """Wait for the save in flight (if any); its error line, or None."""
        thread, self._thread = self._thread, None
        if thread is None:
            return None
        thread.join()
        outcome, self._outcome = self._outcome, None
        return outcome

    def close(self) -> None:
        self.settle()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    # ------------------------------------------------------------------ resume
    def find_latest(self, defer_shards: bool = False, rejected: tuple[tuple[Path, str], ...] = ()
                    ) -> LoadedCheckpoint | None:
        """*Collective.* The newest sharded checkpoint whose every file verifies, loaded (mgpu.state.sharded.find);
        None for a new run. Saves after it continue from its step."""
        loaded = find_latest(self.store, self.rank, self.world, defer_shards, rejected)
        if loaded is not None:
            self.last_saved_step = loaded.step
        return loaded


def _import_dynamo() -> None:
    """DCP's get_state_dict asks torch._dynamo whether a module is compiled, and that import (0.4-0.6 s on the CI
    machine) fell on the first save's time: the stop's, in a process that had saved nothing yet. Imported when the
    checkpointer is made (at the resume's first look), leaving the environment as it was (the import sets
    TORCHINDUCTOR_CACHE_DIR, which DataLoader workers and every child would inherit)."""
    if "torch._dynamo" in sys.modules:
        return
    before = set(os.environ)
    import torch._dynamo  # noqa: F401

    for key in set(os.environ) - before:
        del os.environ[key]


class _Job:
    """One save's particulars, handed from the training thread to the thread that finishes it."""

    def __init__(self, step: int, reason: str, is_best: bool, extra: dict[str, Any], tmp: Path, started: float,
                 common: bytes | None, pieces: bytes, called: float) -> None:
        self.step, self.reason, self.is_best, self.extra, self.tmp = step, reason, is_best, extra, tmp
        self.started, self.common, self.pieces, self.called = started, common, pieces, called
        self.blocked_s: float | None = None  # an asynchronous save's time holding the loop (to its staging's end)
        self.digests: dict[str, dict[str, Any]] = {}  # file name -> checksum, recorded while DCP wrote it
        self.copy_error: str | None = None  # a pipelined host copy's failure (the write waiting on it failed too)


def _os_cause(error: BaseException) -> OSError | None:
    """The OSError of a failed write, also inside DCP's CheckpointException (every rank's failure)."""
    if isinstance(error, OSError):
        return error
    for failure in getattr(error, "failures", {}).values():
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, OSError):
            return cause
    return None


def _describe(error: BaseException, where: Path) -> str:
    cause: BaseException | None = _os_cause(error)
    if isinstance(cause, OSError):
        return describe_os_error(cause, where)
    cause = error
    for failure in getattr(error, "failures", {}).values():  # DCP's: the last rank's failure inside
        cause = failure[0] if isinstance(failure, tuple) else failure
    return one_line(f"{type(cause).__name__}: {cause}", 300)
