"""Faults on real processes and real gloo groups: full disks during saves, DataLoader workers under
every stop signal, and the resumed world's gradient reduction. Each test fails on the code before the
fix it guards (see the issue's D0, D1, D3)."""

from __future__ import annotations

import random
import re
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from mgpu.checkpoint import CheckpointStore
from mgpu.ledger import read_ledger
from tests.conftest import PYTHON, ROOT, base_env, run_processes

TRAIN = str(ROOT / "jobs" / "train.py")
TORCHRUN = str(Path(PYTHON).parent / "torchrun")

pytestmark = pytest.mark.multiprocess


def torchrun(run_dir: Path, *args: str, ranks: int = 2, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    cmd = [TORCHRUN, "--nproc-per-node", str(ranks), "--master-port", str(random.randint(20000, 32000)), TRAIN,
           f"run.dir={run_dir}", *args]
    (result,) = run_processes([(cmd, base_env())], timeout=timeout)
    return result


# ------------------------------------------------------------------------------------- D3: full disks
FILLING = ["task.target=tests.tasks:DiskFillingBlobTask", "data.batch_size=4", "train.epochs=3",
           "checkpoint.every_steps=1", "log.every_steps=1", "log.tensorboard=false"]


def test_the_stop_saves_afresh_after_background_saves_failed(small_fs: Callable[[int], Path]) -> None:
    fs = small_fs(2048)
    run_dir = fs / "run"
    # Steps 3-5 meet a full disk (their background saves fail); space is back at step 6; stop at step 8.
    result = torchrun(run_dir, *FILLING, f"task.args.fill_dir={fs}", "task.args.fill_at=3", "task.args.free_at=6",
                      "--stop-at-step=8")
    assert "exitcode  : 3" in result.stdout, result.stdout[-3000:]  # stopped (not a Slurm job), not crashed
    failures = re.findall(r"checkpoint step (\d+) not written: disk full \(ENOSPC\) at (\S+);", result.stdout)
    assert {int(step) for step, _ in failures} >= {3, 4}, result.stdout[-3000:]
    assert all(path.startswith(str(run_dir / "checkpoints")) for _, path in failures)
    latest = CheckpointStore(run_dir / "checkpoints").latest()
    assert latest is not None and latest.step == 8 and not latest.skipped
    saved = [e["step"] for e in read_ledger(run_dir / "events.jsonl") if e["event"] == "checkpoint_saved"]
    assert saved[-3:] == [6, 7, 8], saved


def test_a_stop_that_cannot_save_ends_in_one_line_and_no_requeue(small_fs: Callable[[int], Path]) -> None:
    fs = small_fs(2048)
    run_dir = fs / "run"
    result = torchrun(run_dir, *FILLING, f"task.args.fill_dir={fs}", "task.args.fill_at=3", "--stop-at-step=5")
    # Every rank prints the same one line (torchrun merges their stderr: two lines may share a line).
    errors = re.findall(r"train: error: .*?step_\d{8}(?:; the newest checkpoint on disk is \S+?step_\d{8})?",
                        result.stdout)
    assert len(errors) == 2 and errors[0] == errors[1], result.stdout[-3000:]
    named = re.fullmatch(r"train: error: checkpoint step 5 not written: disk full \(ENOSPC\) at \S+; the newest "
                         r"checkpoint on disk is (\S+)", errors[0])
    assert named, errors[0]
    # No traceback of ours (torchrun prints its own ChildFailedError report for any non-zero worker).
    assert f'File "{ROOT}/mgpu' not in result.stdout and f'File "{ROOT}/jobs' not in result.stdout, result.stdout
    assert "exitcode  : 2" in result.stdout
    failed = [e for e in read_ledger(run_dir / "events.jsonl") if e["event"] == "failed"]
    assert [e["retry"] for e in failed] == [False], failed  # a full disk is not requeued into the same wall
    latest = CheckpointStore(run_dir / "checkpoints").latest()  # the disk filled up during step 3's loss
    assert latest is not None and latest.step in (1, 2) and str(latest.path) == named[1]
