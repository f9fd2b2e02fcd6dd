"""A loop of one's own gets a stable run id for its loggers (`session.run_id`): wandb, offline, continues one run
across a stop and its resume (read back with wandb's own protobuf schema, tests/wandb_log.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from mgpu.record.reporting import wandb_run_id
from tests.conftest import PYTHON, ROOT, base_env
from tests.wandb_log import wandb_history

pytest.importorskip("wandb")


def test_the_run_id_is_the_run_directorys(tmp_path: Path) -> None:
    assert wandb_run_id(tmp_path / "a") == wandb_run_id(tmp_path / "x" / ".." / "a")  # the same run
    assert wandb_run_id(tmp_path / "a") != wandb_run_id(tmp_path / "b" / "a")  # another run of the same name


def test_wandb_continues_one_run_across_a_stop_and_its_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = base_env(WANDB_MODE="offline", WANDB_SILENT="true")

    def loop(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PYTHON, str(ROOT / "tests" / "logger_loop.py"), str(run_dir), *extra], env=env,
                              cwd=ROOT, capture_output=True, text=True, timeout=900)

    stopped = loop("--stop-at-step=3")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    resumed = loop()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    runs = wandb_history(run_dir / "wandb")
    assert [run_id for run_id, _ in runs] == [wandb_run_id(run_dir)] * 2  # one wandb run, continued
    assert [[row["_step"] for row in rows if "loss" in row] for _, rows in runs] == [[1, 2, 3], [4, 5, 6, 7, 8]]
