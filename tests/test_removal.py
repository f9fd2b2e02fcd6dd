"""Old checkpoints are deleted off the saving thread's path (mgpu.state.files.removal): a prune renames and returns,
the deletion runs in the background, claimed until it ends, and the interpreter's exit waits for it a bounded time."""

from __future__ import annotations

import logging
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from mgpu.state.checkpoint_format import active_claims
from mgpu.state.files import removal
from mgpu.state.single.store import CheckpointStore
from tests.conftest import PYTHON, ROOT, base_env


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), value)}


def test_a_prune_returns_before_the_old_step_is_deleted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release, deleting = threading.Event(), []
    real = removal._delete

    def slow(path: Path) -> None:  # the filesystem freeing a big checkpoint's blocks, held until the test says
        deleting.append(path)
        release.wait(30)
        real(path)

    monkeypatch.setattr(removal, "_delete", slow)
    store = CheckpointStore(tmp_path, keep_last=1)
    store.save(_state(1.0), 1)
    saved = store.save(_state(2.0), 2)  # returns while step 1's deletion is held
    try:
        assert saved.step == 2 and store.list_steps() == [2]
        assert removal.wait_removed(0.2) is False
        [trash] = deleting
        assert trash.name.startswith(".tmp-pruned-step_00000001-") and (trash / "state.pt").is_file()
        assert trash in active_claims()
        store.remove_stale_tmp()  # a save's cleanup in another thread leaves it to the remover
        assert trash.is_dir()
    finally:
        release.set()
    assert removal.wait_removed(30)
    assert not trash.exists() and trash not in active_claims()
    loaded = store.latest()
    assert loaded is not None and loaded.step == 2


def test_a_deletion_that_fails_is_logged_and_its_claim_released(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    def refused(path: Path) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(removal, "_delete", refused)
    store = CheckpointStore(tmp_path, keep_last=1)
    store.save(_state(1.0), 1)
    with caplog.at_level(logging.WARNING, logger="mgpu.state.files.removal"):
        store.save(_state(2.0), 2)
        assert removal.wait_removed(30)
    assert "could not remove the old checkpoint" in caplog.text and "Permission denied" in caplog.text
    [left] = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-pruned-step_00000001-")]
    assert left not in active_claims()
    monkeypatch.undo()
    store.save(_state(3.0), 3)  # the next save's cleanup takes what was left
    assert removal.wait_removed(30) and not left.exists() and store.list_steps() == [3]


def test_an_earlier_processs_pruned_step_is_deleted_in_the_background_and_a_killed_save_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pruned, killed = tmp_path / ".tmp-pruned-step_00000001-999999-ab", tmp_path / ".tmp-step_00000003-999999-cd"
    for leftover in (pruned, killed):
        leftover.mkdir(parents=True)
        (leftover / "state.pt").write_bytes(b"x" * 4096)
    release = threading.Event()
    real = removal._delete

    def slow(path: Path) -> None:
        release.wait(30)
        real(path)

    monkeypatch.setattr(removal, "_delete", slow)
    store = CheckpointStore(tmp_path, keep_last=1)
    try:
        store.save(_state(2.0), 2)
        assert not killed.exists()  # its space back before the save's own write
        assert pruned.is_dir() and pruned in active_claims()  # complete and superseded: not on the save's path
    finally:
        release.set()
    assert removal.wait_removed(30) and not pruned.exists() and pruned not in active_claims()
    assert store.list_steps() == [2]


_EXITING = """
import sys, time
from pathlib import Path
from mgpu.state.files import removal
tree = Path(sys.argv[1])
if sys.argv[2] == "held":
    removal.EXIT_WAIT_S = 0.5
    removal._delete = lambda path: time.sleep(60)
removal.remove_later(tree)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("held", [False, True], ids=["finishes", "held-past-the-wait"])
def test_the_exit_waits_for_queued_deletions_a_bounded_time(held: bool, tmp_path: Path) -> None:
    tree = tmp_path / ".tmp-step_00000001-1-ab"
    tree.mkdir()
    for i in range(300):
        (tree / f"file_{i}").write_bytes(b"x" * 4096)
    started = time.monotonic()
    done = subprocess.run([PYTHON, "-c", textwrap.dedent(_EXITING), str(tree), "held" if held else "free"],
                          cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    if held:
        assert time.monotonic() - started < 30 and tree.is_dir()  # left for the next save's cleanup
    else:
        assert not tree.exists()
