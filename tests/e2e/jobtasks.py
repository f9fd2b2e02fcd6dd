"""Tasks for the end-to-end jobs (imported by the job as `tests.e2e.jobtasks:...`).

They only change timing or fail on purpose; the numerics are tests.tasks.BlobTask's.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn

from tests.tasks import BlobTask


class FirstRunSlowBlobTask(BlobTask):
    """BlobTask whose steps take `step_s` seconds in the job's first run only (SLURM_RESTART_COUNT unset
    or 0) and `later_step_s` afterwards: a first run long enough to meet its time-limit signal, and a
    second run short enough to finish before its own."""

    def __init__(self, step_s: float = 0.5, later_step_s: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        first = int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0
        self.sleep_s = step_s if first else later_step_s

    def loss(self, model: nn.Module, batch: tuple):
        time.sleep(self.sleep_s)
        return super().loss(model, batch)


class BuggyBlobTask(BlobTask):
    """A bug: `loss` raises on every rank at the `fail_after`-th call of each run (after `step_s` sleeps)."""

    def __init__(self, fail_after: int = 3, step_s: float = 0.1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail_after, self.step_s, self.calls = fail_after, step_s, 0

    def loss(self, model: nn.Module, batch: tuple):
        time.sleep(self.step_s)
        self.calls += 1
        if self.calls >= self.fail_after:
            raise ValueError(f"bug in the training code (call {self.calls})")
        return super().loss(model, batch)


class MatrixTask(FirstRunSlowBlobTask):
    """The fault matrix's job (tests/e2e/test_fault_matrix.py): BlobTask's numerics, with timing only.

    `step_s` per loss call in the job's first run, `later_step_s` after; `eval_step_s` per evaluation
    batch; rank 0 appends `<restart> <call>` to `<marker_dir>/eval` at every metrics() call, so the test
    can land a stop inside an evaluation. `ballast_mb` (SlowBlobTask) makes checkpoint writes slow."""

    def __init__(self, marker_dir: str = "", eval_step_s: float = 0.0, ballast_mb: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.marker_dir, self.eval_step_s, self.ballast_mb, self.metric_calls = marker_dir, eval_step_s, ballast_mb, 0

    def build_model(self) -> nn.Module:
        model = super().build_model()
        if self.ballast_mb:
            model.register_buffer("ballast", torch.zeros(self.ballast_mb * 2**18))
        return model

    def metrics(self, model: nn.Module, batch: tuple):
        self.metric_calls += 1
        if self.marker_dir and (not dist.is_initialized() or dist.get_rank() == 0):
            with open(os.path.join(self.marker_dir, "eval"), "a") as marker:
                marker.write(f"{os.environ.get('SLURM_RESTART_COUNT') or 0} {self.metric_calls}\n")
        time.sleep(self.eval_step_s)
        return super().metrics(model, batch)
