"""Tasks for the end-to-end jobs and the fault tests (imported by the job as `tests.e2e.jobtasks:...`).

They only change timing or fail on purpose; the numerics are tests.tasks.BlobTask's.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn

from tests.tasks import BlobTask, Blobs, SignalingBlobTask, TokenShardTask


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
    can land a stop inside an evaluation. `ballast_mb` (SlowBlobTask) makes checkpoint writes slow.
    `late_save`, `late_s`: in the job's first run, rank 1 writes its shard of the `late_save`-th sharded save
    `late_s` seconds late (a slow or stalled filesystem on one node)."""

    def __init__(self, marker_dir: str = "", eval_step_s: float = 0.0, ballast_mb: int = 0, late_save: int = 0,
                 late_s: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.marker_dir, self.eval_step_s, self.ballast_mb, self.metric_calls = marker_dir, eval_step_s, ballast_mb, 0
        if late_save and int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0:
            _write_late(late_save, late_s)

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


def _write_late(save: int, late_s: float) -> None:
    """Rank 1's `save`-th shard write (DCP's FileSystemWriter, which every sharded save goes through) `late_s` late."""
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data
    calls = [0]

    def write_data(writer, plan, planner):
        calls[0] += 1
        if calls[0] == save and dist.get_rank() == 1:
            time.sleep(late_s)
        return original(writer, plan, planner)

    FileSystemWriter.write_data = write_data


class DyingWorkerBlobs(Blobs):
    """Blobs whose first DataLoader worker to load a sample once `trigger` exists SIGKILLs itself (once in
    all: the one that creates `claim` first); in the training process itself, nothing happens."""

    def __init__(self, size: int, seed: int, trigger: str, claim: str) -> None:
        super().__init__(size, seed)
        self.trigger, self.claim = trigger, claim

    def __getitem__(self, i: int):
        import signal

        from torch.utils.data import get_worker_info

        if get_worker_info() is not None and os.path.exists(self.trigger):
            try:
                os.close(os.open(self.claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


class WorkerDeathAfterStopTask(SignalingBlobTask):
    """SignalingBlobTask (rank 0 signals the whole step at its `at`-th loss call, creating `once_file`
    first) whose training data kill one DataLoader worker right after that: a worker that dies once a
    stop is requested (the OOM killer, say), which must end in the stop's checkpoint, not a crash."""

    def __init__(self, claim_file: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.claim_file = claim_file

    def train_dataset(self):
        return DyingWorkerBlobs(self.size, 0, self.once_file, self.claim_file)


STREAM_WINDOWS = [13, 5, 12, 10]  # 40 windows of 8 tokens, in shards of uneven size


class SlowStreamTask(TokenShardTask):
    """A token-shard stream (mgpu.data.stream.ShardedStream) for a preempted streaming job: the shards are written
    into `data_dir` on first use (token t of shard k is k * 1000 + t; each file once, atomically, whichever rank
    gets there first), 40 windows: with 2 ranks and data.batch_size=2, 10 steps an epoch, as SlowBlobTask's
    job. `step_s` per loss call paces it so that a preemption lands mid-epoch."""

    def __init__(self, data_dir: str = "", **kwargs) -> None:
        import numpy as np

        os.makedirs(data_dir, exist_ok=True)
        for k, windows in enumerate(STREAM_WINDOWS):
            path = os.path.join(data_dir, f"shard-{k}.bin")
            if not os.path.exists(path):
                part = f"{path}.{os.getpid()}.part"
                (k * 1000 + np.arange(windows * 8 + 1)).astype("uint16").tofile(part)
                os.replace(part, path)
        super().__init__(files=os.path.join(data_dir, "*.bin"), **kwargs)
