"""A checkpoint written by a newer mgpu format (mgpu.state.checkpoint_format.NewerFormat) is refused in one line,
never passed over for an older one and never overwritten: single-file and sharded, in one process; the trainer's
exit (one line, exit 2, every file as it was) in a real process."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from mgpu.record.ledger import Ledger
from mgpu.state.single.store import CheckpointStore
from mgpu.state.checkpoint_format import FORMAT, CheckpointError, NewerFormat
from mgpu.state.sharded.checkpointer import ShardedCheckpointer
from tests.conftest import PYTHON, ROOT, base_env

TRAIN = str(ROOT / "jobs" / "train.py")


def newer(step_dir: Path) -> None:
    meta = json.loads((step_dir / "meta.json").read_text())
    (step_dir / "meta.json").write_text(json.dumps({**meta, "format": FORMAT + 1}))


@pytest.mark.parametrize("pointed", [8, 4])  # `latest` names the newer one; the older (its save crashed before it)
def test_a_newer_single_file_checkpoint_is_refused_not_passed_over(tmp_path: Path, pointed: int) -> None:
    store = CheckpointStore(tmp_path, keep_last=5)
    for step in (4, 8):
        store.save({"w": torch.full((3,), float(step))}, step)
    newer(tmp_path / "step_00000008")
    (tmp_path / "latest").write_text(f"step_{pointed:08d}\n")
    with pytest.raises(NewerFormat) as refused:
        CheckpointStore(tmp_path).latest()
    assert str(refused.value) == (f"checkpoint {tmp_path}/step_00000008 was written by mgpu format {FORMAT + 1}; this "
                                  f"mgpu reads up to {FORMAT}: resume this run with the newer mgpu (nothing was "
                                  "changed), or start a new run (run.name=...)")
    with pytest.raises(NewerFormat):
        CheckpointStore.load_dir(tmp_path / "step_00000008")


def test_a_newer_sharded_checkpoint_is_refused_not_passed_over(tmp_path: Path) -> None:
    """Its `format` was written and never read: a newer one was loaded as if it were this mgpu's."""
    for step in (4, 8):
        path = tmp_path / f"step_{step:08d}"
        path.mkdir()
        (path / "meta.json").write_text(json.dumps({"step": step, "kind": "sharded", "format": FORMAT,
                                                    "world_size": 1, "manifests": {"0": "x"}}))
    newer(tmp_path / "step_00000008")
    (tmp_path / "latest").write_text("step_00000004\n")  # even where `latest` names the older one
    with pytest.raises(CheckpointError, match=f"step_00000008 was written by mgpu format {FORMAT + 1}; this mgpu "
                                              f"reads up to {FORMAT}"):
        ShardedCheckpointer(tmp_path, 0, 1, Ledger(None, "", 0)).find_latest()


@pytest.mark.multiprocess
def test_the_trainer_exits_2_in_one_line_and_changes_nothing(tmp_path: Path) -> None:
    """A run whose newest checkpoint a newer mgpu wrote, run again by this one: before, it resumed from the older
    checkpoint and trained on, saving over the newer step."""
    args = [PYTHON, TRAIN, f"run.dir={tmp_path}", "task.target=tests.tasks:BlobTask", "data.batch_size=8",
            "checkpoint.every_steps=2", "checkpoint.keep_last=10", "log.tensorboard=false"]
    first = subprocess.run([*args, "train.epochs=1"], env=base_env(), cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    checkpoints = tmp_path / "checkpoints"
    newest = checkpoints / CheckpointStore(checkpoints).pointer("latest")  # type: ignore[operator]
    newer(newest)
    before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in checkpoints.rglob("*")}
    again = subprocess.run([*args, "train.epochs=2"], env=base_env(), cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 2, again.stderr[-2000:]
    (line,) = again.stderr.strip().splitlines()
    assert line == (f"train: error: checkpoint {newest} was written by mgpu format {FORMAT + 1}; this mgpu reads up to "
                    f"{FORMAT}: resume this run with the newer mgpu (nothing was changed), or start a new run "
                    "(run.name=...)")
    assert {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in checkpoints.rglob("*")} == before
