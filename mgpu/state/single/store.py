"""The on-disk checkpoint store: atomic saves, verified loads, pruning, and an optional background writer.

`directory` holds one `step_XXXXXXXX/` per save (`state.pt`, then `meta.json` with its size and checksum:
mgpu.state.files.digest's per-chunk crc32, computed while writing; a checkpoint written before records a sha256)
and `latest` / `best`, one-line files naming a step directory (the format, its names and its verification:
mgpu.state.checkpoint_format). A save is built under a `.tmp-*` name and renamed into place, so a killed writer
leaves the old checkpoint or the new one, never a torn one. Rank 0 only; call a store from one thread (its own
background writer aside).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

from mgpu.fsutil import fsync_path, write_durably
from mgpu.state.checkpoint_format import (BEST, FORMAT, LATEST, META_FILE, STATE_FILE, TMP_PREFIX, CheckpointError,
                                          CheckpointSuperseded, CheckpointWriteError, LoadedCheckpoint,
                                          SavedCheckpoint, checked_extra, claimed, describe_os_error, one_line,
                                          tmp_name)
from mgpu.state.files.digest import DigestingFile, digest_file
from mgpu.state.files.direct_io import DirectFile, open_direct
from mgpu.state.files.writeback import WritebackFile
from mgpu.state.files.zip_options import holds_storage_of, page_aligned_storages, without_zip_crc32
from mgpu.state.single.host_copy import CopyGate, copy_snapshot, plan_snapshot, release_pinned_cache
from mgpu.state.step_dirs import StepDirectories

# The format's names are re-exported: callers of the store take its errors and results from here.
__all__ = ["CheckpointError", "CheckpointStore", "CheckpointSuperseded", "CheckpointWriteError", "LoadedCheckpoint",
           "META_FILE", "STATE_FILE", "SavedCheckpoint", "TMP_PREFIX", "describe_os_error", "one_line",
           "save_state_file"]

WRITER_NICE = 10
"""How much nicer than training the background writer thread runs (Linux, where niceness is per thread). Its
work is hashing and copying into the page cache, on a CPU, not the GIL (bench/save_in_flight.py): where the
cores are all busy (a rank per core, DataLoader workers), it then takes what training leaves, about a tenth
of a core under full contention, instead of slowing the step by its share of a core."""
DIGEST = "crc32"
"""The checksum of new saves (mgpu.state.files.digest: "crc32" or "sha256", per 64 MiB chunk; what each catches is
said there). A load verifies whichever a checkpoint records, a sha256 of the whole file included (checkpoints saved
before)."""
ZIP_CRC32 = False
"""Whether torch.save computes its zip format's CRC32 of every record. The checksum in meta.json (a sharded
save's manifests) covers every byte already and torch.load does not read the CRC (it is 0 in our files; `unzip -t`
reports it): a quarter of the writer's CPU saved. True, or a torch without the setting mgpu.state.files.zip_options
wraps: torch.save as it is. The same for state.pt, a memory snapshot and a sharded save's DCP shards: torch.save of the
writing thread only (mgpu.state.files.zip_options)."""
DIRECT_IO = True
"""Whether checkpoint files are written past the page cache (O_DIRECT, mgpu.state.files.direct_io) where the filesystem
takes it: the disk's full speed with a fraction of the CPU and none of the page cache. False, or a filesystem
without O_DIRECT (tmpfs): through the page cache, with early writeback (mgpu.state.files.writeback). The same for a
sharded save's files."""
PIPELINED_SNAPSHOT = True
"""Whether a background save's writer starts on the snapshot's first buffers while save_async still copies the rest
(mgpu.state.single.host_copy.CopyGate): durable by about the copy's time sooner (a GiB: 0.06 s of 0.3 on the CI
machine). False: the whole snapshot is copied before the writer takes it (the form before; a bench's A/B)."""

log = logging.getLogger("mgpu.state.single.store")

Writer = Callable[[dict[str, Any], Path], None]
OnDone = Callable[["SavedCheckpoint | BaseException"], None]


def _drop_locals(error: BaseException) -> None:
    """Clear the local variables of every frame in `error`'s tracebacks (its causes' too); lines stay printable."""
    pending, seen = [error], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        pending += [current.__cause__, current.__context__]  # type: ignore[list-item]  # None is skipped when popped


def _lower_writer_priority() -> None:
    """Make the calling thread WRITER_NICE nicer. Linux only: elsewhere setpriority would renice the whole
    process, training included. A refusal leaves the priority as it is."""
    if WRITER_NICE <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE))
    except OSError as error:
        log.debug("checkpoint writer keeps its priority: %s", error)


def save_state_file(state: dict[str, Any], file: BinaryIO) -> None:
    """torch.save(state, file), without the zip CRC32s unless ZIP_CRC32 (see there; mgpu.state.files.zip_options)."""
    with without_zip_crc32(not ZIP_CRC32):
        torch.save(state, file)
    file.flush()


def _save_into(state: dict[str, Any], file: DirectFile | DigestingFile) -> None:
    """save_state_file into a digesting file (O_DIRECT or buffered), closed after (its last block written, its
    digest thread ended); a write's OSError is raised as itself, not as the RuntimeError torch's zip writer turns
    it into. Every storage at a page-aligned offset where the state holds a tensor big enough to be written in place
    (mgpu.state.files.direct_io.IN_PLACE_BYTES): an O_DIRECT file can write a snapshot's tensors from where they are;
    a state without one keeps torch's 64 bytes (no 4 KiB of padding per record), as a memory snapshot, which
    save_state_file also writes, always does."""
    try:
        with page_aligned_storages(holds_storage_of(state)):
            save_state_file(state, file)  # type: ignore[arg-type]  # write-only RawIOBase: all torch.save needs
    except RuntimeError as error:
        if file.error is not None:
            raise file.error from error
        raise
    finally:
        file.close()


@dataclass
class _Queued:
    """A background save: its snapshot (in a box the writer empties) and particulars."""
    box: list[dict[str, Any]]
    step: int
    is_best: bool
    extra: dict[str, Any]
    started: float
    on_done: OnDone | None
    staging: dict[tuple[Any, ...], torch.Tensor]
    gate: CopyGate  # which of the snapshot's buffers save_async has filled
    queued_at: float = 0.0  # when it was queued


class CheckpointStore(StepDirectories):
    """The checkpoints of one run in `directory`: the newest `keep_last`, plus the best and the latest; each save's
    `state.pt` written here (its directory's pointers, pruning and loading: mgpu.state.step_dirs)."""

    def __init__(self, directory: Path, keep_last: int = 2, *, writer: Writer | None = None,
                 keep_snapshot_buffers: bool = True) -> None:
        super().__init__(directory, keep_last)
        self._writer = writer  # None: torch.save through a digesting file (no second read for the checksum)
        self._lock = threading.Lock()  # the queue below, between the caller's thread and the writer's
        self._thread: threading.Thread | None = None  # the writer: runs while saves are queued
        self._running = False
        self._queued: _Queued | None = None  # a snapshot waiting for the writer (at most one)
        self._outcome: SavedCheckpoint | BaseException | None = None
        self._spare: dict[tuple[Any, ...], torch.Tensor] = {}  # snapshot buffers kept for the next save
        self._keep_staging = keep_snapshot_buffers

    # ------------------------------------------------------------------ saving
    def save(self, state: dict[str, Any], step: int, *, is_best: bool = False,
             extra: dict[str, Any] | None = None) -> SavedCheckpoint:
        """Write a checkpoint and return once it is durable, after the background save being written (a queued
        one, older than this state, is superseded: never written).

        Always a fresh attempt: a background save that failed before was reported through its
        `on_done` and does not stop this one (the stop path must try, whatever happened earlier).
        A refusal of the filesystem raises CheckpointWriteError naming the errno and the path."""
        extra = checked_extra(state, step, extra)
        self._supersede(step)
        self.settle()
        saved = self._write(state, step, is_best, extra, time.monotonic())
        self.prune()
        return saved

    def save_async(self, state: dict[str, Any], step: int, *, is_best: bool = False,
                   extra: dict[str, Any] | None = None, on_done: OnDone | None = None) -> None:
        """Snapshot `state` to CPU memory now and write it in a background thread.

        Blocks only for the snapshot, never for the writer: while an earlier save is being written, this one
        waits in a queue of one and is written next; a snapshot still queued when the next save comes is
        superseded by it (its `on_done` gets a CheckpointSuperseded; it never reached the disk). Snapshot
        buffers: one set is kept for the next save (a copy of the state in host memory until `close()`), a
        second only while a save is queued behind one being written; with `keep_snapshot_buffers=False` each
        is freed once its write ends. `on_done` is called from the writer thread with the result or the
        exception; a failed save is not raised again later.
        """
        extra = checked_extra(state, step, extra)
        started = time.monotonic()
        staging = self._supersede(step)
        if staging is None:
            with self._lock:
                staging, self._spare = self._spare, {}
        snapshot, copies = plan_snapshot(state, staging)
        gate = CopyGate(copies)
        if not PIPELINED_SNAPSHOT:
            copy_snapshot(copies, gate.mark)
            copies = []  # filled: nothing is left for after the queueing
        # In a box the writer empties: the job's own reference to the snapshot lasts no longer than the write.
        job = _Queued([snapshot], step, is_best, extra, started, on_done, staging, gate)
        del snapshot
        job.queued_at = time.monotonic()
        with self._lock:
            self._queued = job
            if not self._running:
                self._running = True
                self._thread = threading.Thread(target=self._background, name=f"mgpu-checkpoint-{step}",
                                                daemon=False)
                self._thread.start()
        try:
            # Filled here, before this returns (the loop may change its tensors after), while an idle writer
            # already writes the buffers filled so far.
            copy_snapshot(copies, gate.mark)
        except BaseException as error:
            gate.fail(error)  # a writer that took it fails at the first buffer not filled
            with self._lock:
                if self._queued is job:
                    self._queued = None  # not taken yet: never written (this call raises)
            raise

    @property
    def in_flight(self) -> bool:
        """Whether a background save is still being written or waits for the writer."""
        with self._lock:
            return self._running

    @property
    def queued_step(self) -> int | None:
        """The step of the snapshot waiting for the writer (None: none waits)."""
        with self._lock:
            return self._queued.step if self._queued is not None else None

    def settle(self) -> SavedCheckpoint | BaseException | None:
        """Block until the background saves (the one being written, any queued) end; the last one's result or
        its exception."""
        thread = self._thread
        if thread is None:
            return None
        thread.join()  # it ends once nothing is queued (the caller's thread is the only one that queues)
        outcome, self._thread, self._outcome = self._outcome, None, None
        return outcome

    def wait(self) -> SavedCheckpoint | None:
        """Block until the background saves are durable; re-raise the last one's exception."""
        outcome = self.settle()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def close(self) -> None:
        """Wait for the background saves and free the snapshot buffers (a full copy of the state)."""
        self.settle()  # idempotent: a second call finds nothing in flight; a failure was reported by on_done
        if self._spare:
            self._spare.clear()
            release_pinned_cache()

    def _supersede(self, by: int) -> dict[tuple[Any, ...], torch.Tensor] | None:
        """Drop the queued snapshot (a newer state is being saved); its buffers, for reuse."""
        with self._lock:
            job, self._queued = self._queued, None
        if job is None:
            return None
        job.box.clear()
        log.info("checkpoint step %d superseded by step %d before its write began", job.step, by)
        if job.on_done is not None:
            try:
                job.on_done(CheckpointSuperseded(job.step, by))
            except Exception:
                log.exception("checkpoint on_done callback failed")
        return job.staging

    def _background(self) -> None:
        _lower_writer_priority()  # this thread only: it ends when nothing is queued
        while True:
            with self._lock:
                job, self._queued = self._queued, None
                if job is None:
                    self._running = False
                    return
            self._run(job)

    def _run(self, job: "_Queued") -> None:
        state = job.box.pop()
        waited = time.monotonic() - job.queued_at
        try:
            # The snapshot is ours and unchanged until the write ends: its tensors are written in place, each once
            # save_async has copied it (the gate).
            saved = self._write(state, job.step, job.is_best, job.extra, job.started + waited, snapshot=job.gate)
            outcome: SavedCheckpoint | BaseException = dataclasses.replace(saved, queued_s=waited) \
                if waited > 0.01 else saved
        except BaseException as e:
            _drop_locals(e)  # the frames of its traceback hold the snapshot, which must not outlive the write
            outcome = e
        del state
        with self._lock:
            keep = self._keep_staging and not self._spare  # one set kept between saves, not two
            if keep:
                self._spare = job.staging
        if not keep:
            job.staging.clear()
            release_pinned_cache()
        self._outcome = outcome
        if job.on_done is not None:
            try:
                job.on_done(outcome)
            except Exception:
                log.exception("checkpoint on_done callback failed")
        if isinstance(outcome, SavedCheckpoint):
            try:
                self.prune()  # after its durability was reported; still before the writer is free
            except Exception:  # noqa: BLE001  (the writer must end its loop: `in_flight` would never clear)
                log.exception("pruning old checkpoints failed")

    def _write(self, state: dict[str, Any], step: int, is_best: bool, extra: dict[str, Any],
               started: float, snapshot: CopyGate | None = None) -> SavedCheckpoint:
        where = self.directory / f"step_{step:08d}"
        try:
            return self._write_unchecked(state, step, is_best, extra, started, snapshot)
        except OSError as error:
            raise CheckpointWriteError(f"checkpoint step {step} not written: {describe_os_error(error, where)}",
                                       error.errno) from error

    def _write_state(self, state: dict[str, Any], path: Path, snapshot: CopyGate | None = None) -> dict[str, Any]:
        """state.pt, fsynced; returns its checksum (computed while writing with the default writer). `snapshot`: the
        state is a background save's own snapshot, still being filled: its memory stays allocated and unchanged until
        this returns, so it is written in place (mgpu.state.files.direct_io.DirectFile), each buffer once its copy
        is done (the gate)."""
        if snapshot is not None and (self._writer is not None or not DIRECT_IO):
            snapshot.wait_all()  # writers that cannot wait per buffer
        if self._writer is not None:
            self._writer(state, path)
            fsync_path(path)
            return digest_file(path, DIGEST)
        direct = open_direct(path, DIGEST, in_place=snapshot.holds if snapshot is not None else False,
                             gate=snapshot) if DIRECT_IO else None
        if direct is None and snapshot is not None:
            snapshot.wait_all()  # the page cache's file, from here on
        if direct is not None:
            _save_into(state, direct)
            fsync_path(path)
            return direct.digest.entry()
        with open(path, "wb") as file:
            digesting = DigestingFile(WritebackFile(file), DIGEST)  # the disk writes while the rest is copied
            _save_into(state, digesting)  # `file` stays open
            file.flush()
            os.fsync(file.fileno())
        return digesting.digest.entry()

    def _write_unchecked(self, state: dict[str, Any], step: int, is_best: bool, extra: dict[str, Any],
                         started: float, snapshot: CopyGate | None = None) -> SavedCheckpoint:
        if not self.directory.is_dir():
            self.directory.mkdir(parents=True, exist_ok=True)
            fsync_path(self.directory.parent, directory=True)
        self.remove_stale_tmp()  # frees the space a killed writer held before this one needs it
        name = f"step_{step:08d}"
        final = self.directory / name
        with claimed(self.directory / tmp_name(name)) as tmp:
            tmp.mkdir()
            checksum = self._write_state(state, tmp / STATE_FILE, snapshot)
            size = (tmp / STATE_FILE).stat().st_size
            meta = {"step": step, "checksum": checksum, "bytes": size, "created": time.time(), "format": FORMAT,
                    "extra": extra}
            write_durably(tmp / META_FILE, (json.dumps(meta, indent=2) + "\n").encode())
            fsync_path(tmp, directory=True)
            self.install(tmp, final)
        self.point(LATEST, name)
        if is_best:
            self.point(BEST, name)
        # Durable and pointed at: its time ends here; the older ones are pruned after (`prune`).
        saved = SavedCheckpoint(path=final, step=step, bytes=size, seconds=time.monotonic() - started)
        log.info("saved checkpoint %s (%d bytes, %.2fs)", final, size, saved.seconds)
        return saved
