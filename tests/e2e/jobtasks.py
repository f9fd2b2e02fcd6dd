"""Tasks for the end-to-end jobs (imported by the job as `tests.e2e.jobtasks:...`).

They only change timing or fail on purpose; the numerics are tests.tasks.BlobTask's.
"""

from __future__ import annotations

import os
import time

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
