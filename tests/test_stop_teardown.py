"""A stop ends fast: the loggers' teardown (TensorBoard's close, wandb's finish) is bounded (mgpu.reporting), with
the real wandb (offline, read back with its own schema) still finishing its run. The figure, durable checkpoint
to process exit, is bench/stop_teardown.py's."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from mgpu.reporting import Reporter, wandb_run_id
from tests.wandb_log import wandb_history


class StuckRun:
    """A wandb run whose finish never returns on its own (a service that does not answer): only a fake can
    hang on demand."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.finishing = threading.Event()

    def finish(self) -> None:
        self.finishing.set()
        self.release.wait()


def test_a_logger_that_does_not_finish_does_not_hold_the_exit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    reporter = Reporter(True, tmp_path / "tb", total_steps=10, resume_step=0, progress_bar="off")
    reporter.scalars(1, {"loss": 1.0}, "train")
    stuck = StuckRun()
    reporter.wandb = stuck
    closer = threading.Thread(target=reporter.close, kwargs={"within_s": 0.5}, daemon=True)
    with caplog.at_level(logging.WARNING, logger="mgpu.train"):
        closer.start()
        closer.join(60)
    try:
        assert stuck.finishing.is_set()
        assert not closer.is_alive(), "Reporter.close() waited for a wandb finish that never ends"
        assert "wandb's finish did not end within" in caplog.text
        assert list((tmp_path / "tb").glob("events.out.tfevents.*"))  # TensorBoard closed before it
    finally:
        stuck.release.set()


def test_wandb_still_finishes_its_run_within_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    reporter = Reporter(True, None, total_steps=10, resume_step=0, progress_bar="off",
                        wandb={"id": wandb_run_id(run_dir), "project": "mgpu-test", "dir": str(run_dir)})
    for step in (1, 2):
        reporter.scalars(step, {"loss": 1.0 / step}, "train")
    try:
        reporter.close(within_s=60)  # generous here: the point is that finishing from a thread works
    finally:
        import wandb

        wandb.teardown()  # the service process this test started, as the process's exit would
        os.environ.pop("WANDB_SERVICE", None)
    (run_id, rows), = wandb_history(run_dir / "wandb")
    assert run_id == wandb_run_id(run_dir)
    assert [row["_step"] for row in rows if "train/loss" in row] == [1, 2]
