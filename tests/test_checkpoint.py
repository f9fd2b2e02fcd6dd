"""The checkpoint store on real files: round trips, pruning, corruption, the background writer, and
SIGKILLs landing at every phase of a save."""

from __future__ import annotations

import collections
import errno
import hashlib
import io
import json
import logging
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import mgpu.state.single.store
import mgpu.state.files.zip_options
from mgpu.state.single.store import CheckpointError, CheckpointStore, CheckpointWriteError, SavedCheckpoint
from mgpu.state.single.host_copy import snapshot_to_cpu
from mgpu.state.loadable import check_loadable
from mgpu.state.files.digest import digest_file
from mgpu.state.files.removal import wait_removed
from tests.conftest import PYTHON, ROOT, base_env, fill

WRITER_SCRIPT = str(ROOT / "tests" / "checkpoint_writer.py")


class NotAllowed:
    """A class a weights_only load must refuse to construct."""


def _state(value: float = 1.0) -> dict[str, Any]:
    return {"model": {"w": torch.full((3, 4), value), "b": torch.arange(4, dtype=torch.int64)},
            "optim": {"lr": 0.1, "betas": [0.9, 0.999], "state": {0: {"m": torch.zeros(2)}}},
            "epoch": 3, "name": "run-a", "ratio": 0.25}


def _assert_same(actual: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype
        assert torch.equal(actual, expected)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys()
        for key in expected:
            _assert_same(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _assert_same(a, e)
    else:
        assert type(actual) is type(expected) and actual == expected


def _tmp_entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".tmp-"))


def test_round_trip_meta_and_list_steps(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", keep_last=5)
    before = time.time()
    saved = store.save(_state(), 5, extra={"epoch": 3, "metrics": {"loss": 0.5}})
    assert (saved.path, saved.step) == (tmp_path / "ckpt" / "step_00000005", 5)
    assert saved.bytes == (saved.path / "state.pt").stat().st_size and saved.seconds >= 0
    store.save(_state(7.0), 7)
    store.save(_state(6.0), 6)
    assert store.list_steps() == [5, 6, 7]
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_00000006\n"  # the last save, not the highest
    assert store.latest_path() == tmp_path / "ckpt" / "step_00000006"

    loaded = CheckpointStore(tmp_path / "ckpt").latest()
    assert loaded is not None and (loaded.step, loaded.skipped) == (6, ())
    _assert_same(loaded.state, _state(6.0))
    first = CheckpointStore.load_dir(saved.path)
    _assert_same(first.state, _state())
    meta = json.loads((saved.path / "meta.json").read_text())
    assert first.meta == meta
    assert meta["step"] == 5 and meta["format"] == 1 and meta["bytes"] == saved.bytes
    assert meta["checksum"] == digest_file(saved.path / "state.pt") and meta["checksum"]["algorithm"] == "crc32"
    assert before <= meta["created"] <= time.time()
    assert meta["extra"] == {"epoch": 3, "metrics": {"loss": 0.5}}
    assert store.best() is None and _tmp_entries(tmp_path / "ckpt") == []


def test_bad_arguments_fail_before_writing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        store.save(_state(), 1, extra={"bad": object()})
    with pytest.raises(CheckpointError, match="step must be an int"):
        store.save(_state(), -1)
    with pytest.raises(CheckpointError, match="keep_last"):
        CheckpointStore(tmp_path, keep_last=0)
    assert list(tmp_path.iterdir()) == []


def test_pruning_keeps_last_k_and_best(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    store.save(_state(1.0), 1, is_best=True)
    for step in range(2, 6):
        store.save(_state(float(step)), step)
    assert store.list_steps() == [1, 4, 5]
    best = store.best()
    assert best is not None and best.step == 1
    _assert_same(best.state, _state(1.0))
    store.save(_state(6.0), 6, is_best=True)
    assert store.list_steps() == [5, 6]


def test_latest_is_never_pruned(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    store.save(_state(10.0), 10)
    store.save(_state(20.0), 20)
    store.save(_state(5.0), 5)  # a run resumed from an older checkpoint saves below the newest steps
    assert store.list_steps() == [5, 10, 20]
    loaded = store.latest()
    assert loaded is not None and loaded.step == 5


def test_a_save_is_reported_durable_before_the_older_ones_are_pruned(tmp_path: Path) -> None:
    """Pruning runs after the save's outcome is reported, outside its time; the newest is never pruned."""
    store = CheckpointStore(tmp_path, keep_last=1)
    store.save(_state(1.0), 1)
    seen: list[tuple[Any, list[int]]] = []
    store.save_async(_state(2.0), 2, on_done=lambda outcome: seen.append((outcome, store.list_steps())))
    store.wait()
    [(outcome, steps_when_reported)] = seen
    assert isinstance(outcome, SavedCheckpoint) and outcome.step == 2
    assert steps_when_reported == [1, 2]  # reported first: step 2 durable and pointed at, step 1 not yet pruned
    assert store.list_steps() == [2]  # pruned (renamed away) before the writer was free
    saved = store.save(_state(3.0), 3)
    assert store.list_steps() == [3] and saved.step == 3  # the stop's save: pruned before it returns
    assert wait_removed(30) and _tmp_entries(tmp_path) == []  # and deleted in the background
    loaded = store.latest()
    assert loaded is not None and loaded.step == 3
    _assert_same(loaded.state, _state(3.0))


def test_a_prune_that_fails_leaves_the_durable_save_standing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(tmp_path, keep_last=1)
    store.save(_state(1.0), 1)
    real = CheckpointStore._prune

    def refused(self: CheckpointStore) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "step_00000001"))

    monkeypatch.setattr(CheckpointStore, "_prune", refused)
    with caplog.at_level(logging.WARNING, logger="mgpu.state.step_dirs"):
        saved = store.save(_state(2.0), 2)
    assert saved.step == 2 and store.list_steps() == [1, 2]
    assert "could not prune old checkpoints" in caplog.text and "EACCES" in caplog.text
    loaded = store.latest()
    assert loaded is not None and loaded.step == 2
    monkeypatch.setattr(CheckpointStore, "_prune", real)
    store.save(_state(3.0), 3)
    assert store.list_steps() == [3]  # the next prune catches up


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_saving_a_step_again_replaces_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool) -> None:
    if not exchange:  # as on a platform or filesystem without renameat2
        monkeypatch.setattr("mgpu.state.step_dirs.exchange_paths", lambda a, b: False)
    store = CheckpointStore(tmp_path)
    store.save(_state(1.0), 3)
    store.save(_state(2.0), 3, is_best=True)
    loaded = store.latest()
    assert loaded is not None and loaded.step == 3
    _assert_same(loaded.state, _state(2.0))
    assert store.list_steps() == [3] and _tmp_entries(tmp_path) == []


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [(_truncate, "bytes"), (_flip_a_byte, "crc32 checksum")])
def test_a_damaged_latest_falls_back_to_the_previous(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                     damage: Callable[[Path], None], reason: str) -> None:
    store = CheckpointStore(tmp_path, keep_last=3)
    store.save(_state(1.0), 1)
    bad = store.save(_state(2.0), 2).path
    damage(bad / "state.pt")
    with caplog.at_level(logging.WARNING, logger="mgpu.state.step_dirs"):
        loaded = store.latest()
    assert loaded is not None and loaded.step == 1
    _assert_same(loaded.state, _state(1.0))
    [(path, why)] = loaded.skipped
    assert path == bad and str(bad / "state.pt") in why and reason in why
    # (the saves' INFO records are there too where an earlier test in this process left the logger at INFO)
    [record] = [r for r in caplog.records if r.name == "mgpu.state.step_dirs" and r.levelno >= logging.WARNING]
    assert record.levelno == logging.WARNING and str(bad / "state.pt") in record.getMessage()
    assert "\n" not in record.getMessage()


def test_a_checkpoint_that_would_run_code_is_rejected(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(tmp_path)
    store.save(_state(1.0), 1)
    store.save({"obj": NotAllowed()}, 2)  # checksum and size match: only the weights_only load refuses it
    with caplog.at_level(logging.WARNING, logger="mgpu.state.step_dirs"):
        loaded = store.latest()
    assert loaded is not None and loaded.step == 1
    assert "weights_only" in loaded.skipped[0][1] and "state.pt" in caplog.text
    with pytest.raises(CheckpointError, match="step_00000002"):
        CheckpointStore.load_dir(tmp_path / "step_00000002")


def test_incomplete_dirs_are_skipped_and_stale_tmp_removed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    good = store.save(_state(1.0), 1).path
    stale = tmp_path / ".tmp-step_00000009-999999-deadbeef"
    stale.mkdir()
    (stale / "state.pt").write_bytes((good / "state.pt").read_bytes())
    (tmp_path / ".tmp-latest-999999-deadbeef").write_text("step_00000009\n")
    no_meta = tmp_path / "step_00000008"
    no_meta.mkdir()
    (no_meta / "state.pt").write_bytes((good / "state.pt").read_bytes())
    (tmp_path / "latest").write_text("step_00000008\n")  # e.g. a filesystem that reordered the writes

    assert store.list_steps() == [1]
    loaded = store.latest()
    assert loaded is not None and loaded.step == 1
    assert loaded.skipped == ((no_meta, f"{no_meta / 'meta.json'} is missing (incomplete save)"),)
    store.save(_state(2.0), 2)
    assert wait_removed(30) and _tmp_entries(tmp_path) == []


def test_no_checkpoint_is_none_and_all_bad_is_one_line_error(tmp_path: Path) -> None:
    assert CheckpointStore(tmp_path).latest() is None
    assert CheckpointStore(tmp_path / "missing").latest() is None
    store = CheckpointStore(tmp_path)
    for step in (1, 2):
        _flip_a_byte(store.save(_state(), step).path / "state.pt")
    with pytest.raises(CheckpointError) as raised:
        store.latest()
    message = str(raised.value)
    assert "\n" not in message and str(tmp_path) in message and "2 rejected" in message


def test_snapshot_copies_tensors_and_keeps_structure() -> None:
    linear = torch.nn.BatchNorm1d(3).state_dict()
    tied = torch.ones(2)
    state = {"model": linear, "a": tied, "b": tied, "pair": (tied, 1), "view": torch.arange(10)[2:4]}
    snap = snapshot_to_cpu(state)
    assert getattr(snap["model"], "_metadata") == getattr(linear, "_metadata")
    assert type(snap["model"]) is type(linear) and snap["a"] is snap["b"] is snap["pair"][0]
    assert snap["a"].data_ptr() != tied.data_ptr() and snap["view"].untyped_storage().nbytes() == 16
    tied.add_(1)
    assert torch.equal(snap["a"], torch.ones(2))


class PausedWriter:
    """A writer that blocks until released, and records when each call entered and left."""

    def __init__(self, fail: bool = False) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.calls: list[tuple[float, float]] = []
        self.fail = fail

    def __call__(self, state: dict[str, Any], path: Path) -> None:
        entered = time.monotonic()
        self.entered.set()
        assert self.release.wait(10)
        if self.fail:
            raise RuntimeError("disk on fire")
        torch.save(state, path)
        self.calls.append((entered, time.monotonic()))


def test_save_async_writes_a_snapshot(tmp_path: Path) -> None:
    writer = PausedWriter()
    results: list[SavedCheckpoint | BaseException] = []
    store = CheckpointStore(tmp_path, writer=writer)
    state = _state(1.0)
    store.save_async(state, 1, extra={"epoch": 0}, on_done=results.append)
    assert writer.entered.wait(10)
    state["model"]["w"].add_(100)  # training goes on while the write is in flight
    state["optim"]["state"][0]["m"].fill_(7)
    writer.release.set()
    saved = store.wait()
    assert saved is not None and results == [saved] and saved.step == 1
    assert store.wait() is None
    loaded = store.latest()
    assert loaded is not None
    _assert_same(loaded.state, _state(1.0))
    store.close()
    store.close()


def test_the_zero_optimizers_consolidated_state_is_not_kept_after_a_save() -> None:
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from mgpu.state.train_state import gather_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(64, 64)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam)
        model(torch.ones(2, 64)).sum().backward()
        optimizer.step()
        state = gather_state({"model": model, "optimizer": optimizer}, None)
        assert state is not None and state["optimizer"]["state"][0]["exp_avg"].shape == (64, 64)
        assert optimizer._all_state_dicts == []  # rank 0 held a second copy of the optimizer state for the run
        assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], optimizer.optim.state[model.weight]["exp_avg"])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("keep", [True, False])
def test_the_snapshot_copy_is_freed_at_close_or_after_each_write(keep: bool, tmp_path: Path) -> None:
    """D17: the background save's host copy of the state (pinned on GPUs) does not outlive training, and
    with keep_snapshot_buffers=False not even its write."""
    import gc
    import weakref

    snapshots: list[weakref.ref[torch.Tensor]] = []

    def writer(state: dict[str, Any], path: Path) -> None:
        snapshots.append(weakref.ref(state["model"]["w"]))
        torch.save(state, path)

    store = CheckpointStore(tmp_path, writer=writer, keep_snapshot_buffers=keep)
    store.save_async(_state(1.0), 1)
    store.settle()
    store.save_async(_state(2.0), 2)  # the first copy is reused (kept) or was freed (not kept)
    store.wait()
    gc.collect()
    assert (snapshots[0]() is not None) == keep and (snapshots[1]() is not None) == keep
    if keep:
        assert snapshots[0]() is snapshots[1]()  # one copy, reused: bounded at one state
    store.close()
    gc.collect()
    assert snapshots[1]() is None  # closed: nothing of the state is kept


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("fails", [False, True])
def test_freed_snapshot_buffers_go_back_to_the_system_when_cuda_is_initialised(
        keep: bool, fails: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """D17 on GPUs: freed pinned buffers only return to torch's host caching allocator; once they are freed the
    store empties that cache (torch.accelerator.empty_host_cache), or it keeps a copy of the state anyway.
    CUDA is a mock here (initialised, as on a GPU rank); the release records whether the snapshot was gone."""
    import gc
    import weakref

    snapshots: list[weakref.ref[torch.Tensor]] = []
    released: list[bool] = []  # per release: every snapshot tensor already freed?

    def writer(state: dict[str, Any], path: Path) -> None:
        snapshots.append(weakref.ref(state["model"]["w"]))
        if fails:
            raise OSError(28, "No space left on device", str(path))
        torch.save(state, path)

    def release() -> None:
        gc.collect()
        released.append(all(ref() is None for ref in snapshots))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", release)
    store = CheckpointStore(tmp_path, writer=writer, keep_snapshot_buffers=keep)
    store.save_async(_state(1.0), 1)
    store.settle()
    assert released == ([] if keep else [True])  # kept for the next save, or freed and released after the write
    store.close()
    assert released == [True]  # closed: freed, and released once
    store.close()
    assert released == [True]


def test_without_cuda_nothing_is_released(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: calls.append(1))
    store = CheckpointStore(tmp_path, keep_snapshot_buffers=False)
    store.save_async(_state(1.0), 1)
    store.wait()
    store.close()
    assert calls == [] and not torch.cuda.is_initialized()  # nothing was pinned: no call (it raises on a CPU)


def test_save_async_never_waits_for_the_writer_and_a_newer_save_supersedes_a_queued_one(tmp_path: Path) -> None:
    """Issue 31: a periodic save that comes while the last is being written does not hold the loop: it waits for
    the writer in a queue of one, and a newer one takes its place there (the one being written is finished)."""
    from mgpu.state.single.store import CheckpointSuperseded

    writer = PausedWriter()
    results: list[Any] = []
    store = CheckpointStore(tmp_path, writer=writer, keep_last=5)
    store.save_async(_state(1.0), 1, on_done=results.append)  # returns while the writer is paused
    assert writer.entered.wait(10)
    for step in (2, 3):
        second = threading.Thread(target=store.save_async, args=(_state(float(step)), step),
                                  kwargs={"on_done": results.append})
        second.start()
        second.join(5)
        assert not second.is_alive() and writer.calls == []  # returned while step 1 is still being written
        assert store.in_flight and store.queued_step == step
    [superseded] = results
    assert isinstance(superseded, CheckpointSuperseded) and (superseded.step, superseded.by) == (2, 3)
    time.sleep(0.05)  # step 3 waits in the queue longer than queued_s's 10 ms floor, however fast the machine
    writer.release.set()
    last = store.wait()
    assert last is not None and last.step == 3 and last.queued_s > 0  # written next, once the writer was free
    store.close()
    assert store.list_steps() == [1, 3] and [r.step for r in results[1:]] == [1, 3]
    (_, first_left), (third_entered, _) = writer.calls
    assert third_entered >= first_left
    loaded = store.latest()
    assert loaded is not None and loaded.step == 3
    _assert_same(loaded.state, _state(3.0))


def test_the_stops_save_supersedes_a_queued_save_and_waits_for_the_one_being_written(tmp_path: Path) -> None:
    from mgpu.state.single.store import CheckpointSuperseded

    writer = PausedWriter()
    results: list[Any] = []
    store = CheckpointStore(tmp_path, writer=writer, keep_last=5)
    store.save_async(_state(1.0), 1, on_done=results.append)
    assert writer.entered.wait(10)
    store.save_async(_state(2.0), 2, on_done=results.append)
    stop = threading.Thread(target=store.save, args=(_state(3.0), 3))
    stop.start()
    stop.join(0.3)
    assert stop.is_alive()  # waits for step 1's write (one writer at a time)
    assert isinstance(results[0], CheckpointSuperseded) and results[0].step == 2
    writer.release.set()
    stop.join(10)
    store.close()
    assert store.list_steps() == [1, 3] and [len(writer.calls)] == [2]


def test_a_periodic_save_due_while_the_writer_is_busy_is_deferred_and_the_stops_save_still_waits(
        tmp_path: Path) -> None:
    """Issue 31: the checkpointer takes no host copy for a periodic save the writer could not start: it is deferred
    to the first due save after the writer is free, which says how many were (`deferred`); a stop's save waits."""
    from mgpu.state.checkpointer import Checkpointer
    from mgpu.record.ledger import Ledger, read_ledger
    from mgpu.record.rundir import RunDir

    run = RunDir(tmp_path)
    checkpointer = Checkpointer(run, rank=0, world=1, ledger=Ledger(run.ledger, "7", 0), keep_last=5)
    writer = PausedWriter()
    assert checkpointer.store is not None
    checkpointer.store._writer = writer
    gathered: list[int] = []

    def gather(step: int) -> Callable[[], dict[str, Any]]:
        return lambda: gathered.append(step) or _state(float(step))

    checkpointer.save(gather(1), 1, "interval")
    assert writer.entered.wait(10)
    for step in (2, 3):
        due = threading.Thread(target=checkpointer.save, args=(gather(step), step, "interval"))
        due.start()
        due.join(5)
        assert not due.is_alive()  # training goes on
    assert gathered == [1]  # no copy taken for the deferred ones
    writer.release.set()
    checkpointer.store.settle()
    checkpointer.save(gather(4), 4, "interval")
    checkpointer.store.settle()
    writer.release.clear()
    writer.entered.clear()
    checkpointer.save(gather(5), 5, "interval")
    assert writer.entered.wait(10)  # being written when the stop comes
    stop = threading.Thread(target=checkpointer.save, args=(gather(6), 6, "preemption"), kwargs={"wait": True})
    stop.start()
    stop.join(0.3)
    assert stop.is_alive()  # the stop's save waits for the writer, and is written
    writer.release.set()
    stop.join(10)
    checkpointer.close()
    events = [(e["event"], e["step"], e.get("deferred")) for e in read_ledger(run.ledger)]
    assert events == [("checkpoint_saved", 1, None), ("checkpoint_saved", 4, 2), ("checkpoint_saved", 5, None),
                      ("checkpoint_saved", 6, None)], events
    assert gathered == [1, 4, 5, 6] and CheckpointStore(run.checkpoints).list_steps() == [1, 4, 5, 6]


def test_under_the_resume_check_every_due_save_reaches_the_disk_however_slow_the_writer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resume check compares two runs' saves step by step: there a due save is neither deferred nor queued to
    be superseded by the next while the writer is slow (a loaded machine); it waits for the writer, so both runs
    save the same steps (CI saw the counter row's saved step 8 superseded in one run: the LR went unnamed)."""
    from mgpu.record import check_hooks
    from mgpu.state.checkpointer import Checkpointer
    from mgpu.record.ledger import Ledger
    from mgpu.record.rundir import RunDir

    monkeypatch.setenv(check_hooks.CHECK_DIR, str(tmp_path / "check"))
    run = RunDir(tmp_path / "run")
    checkpointer = Checkpointer(run, rank=0, world=1, ledger=Ledger(run.ledger, "7", 0), keep_last=1000)
    writer = PausedWriter()
    assert checkpointer.store is not None
    checkpointer.store._writer = writer
    checkpointer.save(lambda: _state(1.0), 1, "interval")
    assert writer.entered.wait(10)
    due = threading.Thread(target=lambda: [checkpointer.save(lambda s=s: _state(float(s)), s, "interval")
                                           for s in (2, 3)])
    due.start()
    due.join(0.3)
    assert due.is_alive()  # step 2 waits for step 1's write rather than queue behind it
    writer.release.set()
    due.join(10)
    checkpointer.close()
    assert CheckpointStore(run.checkpoints).list_steps() == [1, 2, 3]


def test_wait_reraises_the_writer_error(tmp_path: Path) -> None:
    writer = PausedWriter(fail=True)
    writer.release.set()
    results: list[SavedCheckpoint | BaseException] = []
    store = CheckpointStore(tmp_path, writer=writer)
    store.save_async(_state(), 1, on_done=results.append)
    with pytest.raises(RuntimeError, match="disk on fire"):
        store.wait()
    assert len(results) == 1 and isinstance(results[0], RuntimeError)
    store.close()  # the error was delivered once
    assert store.latest() is None and _tmp_entries(tmp_path) == []


class LineReader:
    """Lines from a child's stdout, with a deadline on each wait."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.fd = proc.stdout.fileno()
        self.buffer = b""
        self.seen: list[str] = []

    def expect(self, prefix: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\n", 1)
                line = raw.decode(errors="replace")
                self.seen.append(line)
                if line.startswith(prefix):
                    return line
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise AssertionError(f"no {prefix!r} line within {timeout}s; output: {self.seen}")
            chunk = os.read(self.fd, 65536)
            if not chunk:
                raise AssertionError(f"writer server exited before {prefix!r}; output: {self.seen}")
            self.buffer += chunk


def _phase(directory: Path) -> str:
    """Where the save of step 2 stood when it was killed, from what it left on disk."""
    tmp = [p for p in directory.glob(".tmp-step_00000002-*") if p.is_dir()]
    if tmp:
        return "before rename" if (tmp[0] / "meta.json").exists() else "writing state.pt"
    latest = (directory / "latest").read_text().strip()
    if latest == "step_00000001":
        return "before latest" if (directory / "step_00000002").exists() else "before tmp dir"
    return "before best" if not (directory / "best").exists() else "pruning"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_kill_during_save_never_loses_a_complete_checkpoint(tmp_path: Path) -> None:
    trials, expected_write_s = 20, 0.3
    delays = [(i + random.random()) / trials * 1.3 * expected_write_s for i in range(trials)]
    failures: list[str] = []
    phases: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    proc = subprocess.Popen([PYTHON, WRITER_SCRIPT], env=base_env(), cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdin is not None
    reader = LineReader(proc)
    try:
        for trial, delay in enumerate(delays):
            directory = tmp_path / f"trial{trial}"
            proc.stdin.write(f"trial {directory}\n".encode())
            proc.stdin.flush()
            pid = int(reader.expect("writing ").split()[1])
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)  # not reaped until "reap": the pid is still this child's
            proc.stdin.write(b"reap\n")
            proc.stdin.flush()
            reader.expect("reaped ")
            completed = f"done {pid}" in reader.seen
            phases["completed" if completed else _phase(directory)] += 1
            try:
                loaded = CheckpointStore(directory).latest()
                assert loaded is not None and loaded.step in (1, 2) and loaded.skipped == ()
                assert loaded.step == 2 or not completed
                assert torch.equal(loaded.state["w"], torch.full((64 * 1024,), float(loaded.step)))
                assert loaded.state["step"] == loaded.step
                for step_dir in directory.glob("step_*"):  # none is ever torn, pointed at or not
                    CheckpointStore.load_dir(step_dir)
                store = CheckpointStore(directory)
                store.save({"w": torch.zeros(1)}, 3)
                assert wait_removed(30)  # (the pruned step is deleted in the background)
                assert _tmp_entries(directory) == [] and store.list_steps()[-1] == 3
            except Exception as e:
                failures.append(f"trial {trial} (delay {delay:.3f}s, {phases}): {e!r}")
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    elapsed = time.monotonic() - started
    print(f"kill test: {trials} trials in {elapsed:.1f}s, phases at kill: {dict(phases)}")
    assert failures == [], f"{len(failures)}/{trials} trials failed: {failures}"
    assert trials - phases["completed"] >= 1, f"no trial was killed before step 2 completed: {dict(phases)}"
    assert proc.returncode == 0, reader.seen


# ----------------------------------------------------------------------------- full disks (real tmpfs)
def _big_state(value: float) -> dict[str, Any]:
    return {"w": torch.full((64 * 1024,), value)}  # 256 KiB of state.pt


@pytest.mark.parametrize("kind, direct", [("tmpfs", False), ("ext4", True)])  # files.direct_io on a disk's fs
def test_a_full_disk_is_named_and_leaves_the_last_checkpoint(kind: str, direct: bool, small_fs: Callable[..., Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from mgpu.state.single import store as checkpoint

    monkeypatch.setattr(checkpoint, "DIRECT_IO", direct)
    directory = small_fs(1024, kind) / "ckpt"
    store = CheckpointStore(directory, keep_last=1)
    store.save(_big_state(1.0), 1)
    ballast = fill(directory.parent)
    with pytest.raises(CheckpointWriteError, match=r"checkpoint step 2 not written: disk full \(ENOSPC\) at "
                                                   rf"{directory}") as raised:
        store.save(_big_state(2.0), 2)
    assert raised.value.errno == 28 and "\n" not in str(raised.value)
    assert _tmp_entries(directory) == []  # the partial write was removed: its space is free again
    latest = store.latest()
    assert latest is not None and latest.step == 1 and not latest.skipped
    ballast.unlink()
    assert store.save(_big_state(2.0), 2).step == 2


def test_a_failed_background_save_does_not_fail_the_next_one(small_fs: Callable[[int], Path]) -> None:
    directory = small_fs(1024) / "ckpt"
    store = CheckpointStore(directory)
    store.save(_big_state(1.0), 1)
    ballast = fill(directory.parent)
    results: list[SavedCheckpoint | BaseException] = []
    store.save_async(_big_state(2.0), 2, on_done=results.append)
    assert isinstance(store.settle(), CheckpointWriteError)
    assert len(results) == 1 and "ENOSPC" in str(results[0])  # reported once, through on_done
    ballast.unlink()
    # The stop path's save: a fresh attempt, not the stale error of the failed one.
    assert store.save(_big_state(3.0), 3).step == 3
    store.save_async(_big_state(4.0), 4)
    store.close()
    assert store.list_steps() == [3, 4]


class _RefusingFile(io.RawIOBase):
    """What a filesystem that refuses every write looks like to the checkpoint's hashing file."""

    def __init__(self, code: int) -> None:
        super().__init__()
        self.code = code

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        raise OSError(self.code, os.strerror(self.code))


def _refuse_writes(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """Every state.pt written from now on meets `code` (below torch.save, which would hide it): through the page
    cache, or with O_DIRECT, in the thread that writes the full buffers."""
    from mgpu.state.files.digest import DigestingFile
    from mgpu.state.files.direct_io import DirectFile

    wrap = DigestingFile.__init__
    monkeypatch.setattr(DigestingFile, "__init__", lambda self, file, *args: wrap(self, _RefusingFile(code), *args))
    monkeypatch.setattr(DirectFile, "_pwrite", lambda self, data, offset: _RefusingFile(code).write(data))


@pytest.mark.parametrize("code, words", [
    (errno.ENOSPC, "disk full (ENOSPC)"),
    (errno.EDQUOT, "disk quota exceeded (EDQUOT)"),
    (errno.EIO, "I/O error (EIO)"),
    (errno.EROFS, "read-only filesystem (EROFS)"),
    (errno.EACCES, "permission denied (EACCES)"),
    (errno.ENAMETOOLONG, "File name too long (ENAMETOOLONG)"),
])
def test_a_refused_write_names_the_errno_and_the_path(code: int, words: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from mgpu.state.single.store import describe_os_error

    assert describe_os_error(OSError(code, os.strerror(code), "/d/state.pt"), Path("/x")) == f"{words} at /d/state.pt"
    assert describe_os_error(OSError(code, os.strerror(code)), Path("/x")) == f"{words} at /x"  # no file named
    store = CheckpointStore(tmp_path / "ckpt")
    _refuse_writes(monkeypatch, code)
    results: list[SavedCheckpoint | BaseException] = []
    store.save_async(_state(), 2, on_done=results.append)
    store.close()
    (failure,) = results
    assert isinstance(failure, CheckpointWriteError) and failure.errno == code
    assert str(failure) == f"checkpoint step 2 not written: {words} at {tmp_path / 'ckpt' / 'step_00000002'}"


def test_no_errno_is_said_so() -> None:
    from mgpu.state.single.store import describe_os_error

    assert describe_os_error(OSError("torn"), Path("/x")) == "torn (no errno) at /x"


def test_a_failed_background_save_is_in_the_ledger_and_the_next_one_is_tried(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from mgpu.state.checkpointer import Checkpointer
    from mgpu.record.ledger import Ledger, read_ledger
    from mgpu.record.rundir import RunDir

    run = RunDir(tmp_path)
    checkpointer = Checkpointer(run, rank=0, world=1, ledger=Ledger(run.ledger, "7", 0))
    with monkeypatch.context() as patch:
        _refuse_writes(patch, errno.EIO)
        assert checkpointer.save(_state, 2, "interval") is None  # in the background: training goes on
        checkpointer.close()
    checkpointer.save(lambda: _state(3.0), 3, "interval")
    checkpointer.close()
    events = [(e["event"], e["step"]) for e in read_ledger(run.ledger)]
    assert events == [("checkpoint_failed", 2), ("checkpoint_saved", 3)], events
    failed = read_ledger(run.ledger)[0]
    assert failed["errno"] == errno.EIO and failed["reason"] == "interval"
    assert failed["error"] == f"checkpoint step 2 not written: I/O error (EIO) at {run.checkpoints / 'step_00000002'}"
    assert CheckpointStore(run.checkpoints).list_steps() == [3]


def test_the_checksum_is_computed_while_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Re-reading a large state.pt for its hash would happen inside the stop's time window.
    monkeypatch.setattr("mgpu.state.checkpoint_format.sha256_file", lambda path: pytest.fail("state.pt read back to hash it"))
    monkeypatch.setattr("mgpu.state.single.store.digest_file", lambda *a: pytest.fail("state.pt read back to hash it"))
    saved = CheckpointStore(tmp_path).save(_big_state(5.0), 5)
    meta = json.loads((saved.path / "meta.json").read_text())
    assert meta["checksum"] == digest_file(saved.path / "state.pt")


@pytest.mark.parametrize("algorithm", ["crc32", "sha256"])
def test_a_checkpoint_of_either_checksum_or_an_older_sha256_verifies_and_damage_is_found(
        algorithm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mgpu.state.single.store, "DIGEST", algorithm)
    store = CheckpointStore(tmp_path, keep_last=3)
    older = store.save(_big_state(1.0), 1).path
    meta = json.loads((older / "meta.json").read_text())
    assert meta["checksum"]["algorithm"] == algorithm
    # As saved before mgpu.state.files.digest: the sha256 of the whole file.
    del meta["checksum"]
    meta["sha256"] = hashlib.sha256((older / "state.pt").read_bytes()).hexdigest()
    (older / "meta.json").write_text(json.dumps(meta))
    assert CheckpointStore.load_dir(older).step == 1
    newer = store.save(_big_state(2.0), 2).path
    _flip_a_byte(newer / "state.pt")
    with pytest.raises(CheckpointError, match=f"does not match its {algorithm} checksum"):
        CheckpointStore.load_dir(newer)
    _flip_a_byte(older / "state.pt")
    with pytest.raises(CheckpointError, match="has sha256"):
        CheckpointStore.load_dir(older)


# ------------------------------------------------------------- the writer's cost to training (issue 16)
def test_in_flight_is_true_while_the_background_save_writes(tmp_path: Path) -> None:
    writer = PausedWriter()
    store = CheckpointStore(tmp_path, writer=writer)
    assert not store.in_flight
    store.save_async(_state(), 1)
    assert writer.entered.wait(10) and store.in_flight
    writer.release.set()
    store.wait()
    assert not store.in_flight
    store.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_the_background_writer_thread_runs_nicer_than_training(tmp_path: Path) -> None:
    """The writer's hashing and copying take what the training thread leaves of a busy CPU
    (bench/save_in_flight.py); the training thread keeps its priority."""
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []
    store = CheckpointStore(tmp_path)
    store.save_async(_state(), 1,
                     on_done=lambda _: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    store.close()
    assert seen == [min(19, main + mgpu.state.single.store.WRITER_NICE)] and mgpu.state.single.store.WRITER_NICE > 0
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main
    assert store.save(_state(2.0), 2).step == 2  # a save in the caller's thread leaves it as it is
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main


def _zip_crcs(path: Path) -> list[int]:
    with zipfile.ZipFile(path) as archive:
        return [info.CRC for info in archive.infolist() if info.file_size]


def test_state_pt_is_written_without_torchs_crc32_and_still_verifies(tmp_path: Path) -> None:
    """The sha256 covers every byte; torch's per-record CRC32 was a second pass over the state."""
    store = CheckpointStore(tmp_path)
    saved = store.save(_big_state(3.0), 3)
    assert set(_zip_crcs(saved.path / "state.pt")) == {0}
    for mmap in (True, False):  # torch.load does not read the CRC
        _assert_same(torch.load(saved.path / "state.pt", weights_only=True, mmap=mmap), _big_state(3.0))
    loaded = CheckpointStore(tmp_path).latest()
    assert loaded is not None and loaded.step == 3
    _assert_same(loaded.state, _big_state(3.0))


@pytest.mark.parametrize("how", ["asked", "a torch without the setting"])
def test_otherwise_it_is_torch_save_with_its_crc32(how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "asked":
        monkeypatch.setattr(mgpu.state.single.store, "ZIP_CRC32", True)
    else:  # torch.serialization.get_crc32_options absent: nothing to wrap (mgpu.state.files.zip_options)
        monkeypatch.setattr(mgpu.state.files.zip_options, "_install", lambda name, override: False)
    saved = CheckpointStore(tmp_path).save(_big_state(4.0), 4)
    assert 0 not in _zip_crcs(saved.path / "state.pt")
    loaded = CheckpointStore(tmp_path).latest()
    assert loaded is not None
    _assert_same(loaded.state, _big_state(4.0))


def test_a_full_disk_is_named_without_torchs_crc32_too(small_fs: Callable[[int], Path]) -> None:
    directory = small_fs(1024) / "ckpt"
    store = CheckpointStore(directory, keep_last=1)
    store.save(_big_state(1.0), 1)
    ballast = fill(directory.parent)
    store.save_async(_big_state(2.0), 2)
    error = store.settle()
    assert isinstance(error, CheckpointWriteError) and error.errno == 28 and "ENOSPC" in str(error)
    ballast.unlink()
    assert _tmp_entries(directory) == [] and store.save(_big_state(2.0), 2).step == 2


# ----------------------------------------------------------------------- states a resume cannot load
def _optimizer_state(**group_extra: Any) -> dict[str, Any]:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.param_groups[0].update(group_extra)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": [{"python": (3, (1, 2), None)}]}


def test_a_loadable_state_passes() -> None:
    check_loadable(_optimizer_state())
    check_loadable(_state())


@pytest.mark.parametrize("state, key, kind", [
    (_optimizer_state(schedule=NotAllowed()), "state.optimizer.param_groups[0].schedule", "NotAllowed"),
    ({"model": {"w": torch.ones(1)}, "extra": [1, {"obj": NotAllowed()}]}, "state.extra[1].obj", "NotAllowed"),
    (_optimizer_state(lr=np.float64(0.1)), "state.optimizer.param_groups[0].lr", "float64"),  # a numpy scalar
])
def test_an_unloadable_value_is_named_at_save_time(state: dict[str, Any], key: str, kind: str) -> None:
    with pytest.raises(CheckpointError, match=rf"checkpoint {re.escape(key)} holds a {kind}, which a resume cannot"):
        check_loadable(state)


# ------------------------------------------------------------------ one verification per job (D8)
@pytest.mark.multiprocess
def test_a_resume_hashes_the_checkpoint_once_per_job_and_every_rank_memory_maps_it(tmp_path: Path) -> None:
    """3 real ranks (a gloo group under torchrun) resume: rank 0 alone reads the newest checkpoint through
    its checksum (once); the others load the file it verified, memory-mapped, without hashing it: not 8 full
    reads and copies per 8-GPU node."""
    run = tmp_path / "run"
    store = CheckpointStore(run / "checkpoints", keep_last=3)
    store.save(_state(1.0), 1)
    newest = store.save(_state(2.0), 2)
    torchrun = str(Path(PYTHON).parent / "torchrun")
    port = str(random.SystemRandom().randint(20000, 32000))
    cmd = [torchrun, "--nproc-per-node", "3", "--master-port", port, str(ROOT / "tests" / "resume_probe.py"),
           str(run), str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=base_env(), cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["step"] for r in ranks] == [2, 2, 2]
    size = newest.path.joinpath("state.pt").stat().st_size
    assert [r["digested_bytes"] for r in ranks] == [size, 0, 0]  # one verification for the whole job
    assert all(r["loads"] == [{"mmap": True, "weights_only": True}] for r in ranks)  # each maps the one file
    assert ranks[0]["load_dirs"] == [] and all(r["load_dirs"] == [{"verify": False}] for r in ranks[1:])


def test_a_resumed_optimizer_keeps_no_checkpoint_file_mapped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A checkpoint is loaded memory-mapped; Adam keeps the moments it is given. Restored through the store,
    the run holds no mapping of the file: once pruned, its blocks are free (no `(deleted)` mapping left)."""
    import gc

    import torch
    from torch import nn

    from mgpu.state.train_state import Progress, restore_state

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    optimizer.step()
    store = CheckpointStore(tmp_path / "ckpt")
    store.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": [],
                "progress": {"step": 1}, "best": torch.tensor(0.5)}, 1)
    loaded = store.latest()
    assert loaded is not None
    fresh = nn.Linear(64, 64)
    objects: dict = {"model": fresh, "optimizer": torch.optim.Adam(fresh.parameters()), "progress": Progress(),
                     "best": None}
    restore_state(loaded.state, objects, 0, 0)
    assert objects["optimizer"].state_dict()["state"][0]["exp_avg"].equal(optimizer.state_dict()["state"][0]["exp_avg"])
    del loaded
    gc.collect()
    shutil.rmtree(tmp_path / "ckpt")  # as keep_last prunes it
    mapped = [line.strip() for line in Path("/proc/self/maps").read_text().splitlines() if str(tmp_path) in line]
    assert mapped == [], mapped
