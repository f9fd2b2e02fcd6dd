"""The training metrics between two log lines: the loss summed on the device (no host sync per step), the task's
own training metrics, the steps, samples and time; at a log step, one all-reduce makes them the mean over every
rank's real samples (or a LossSum's units) and the window's rates."""

from __future__ import annotations

import time
from typing import Any, Mapping

import torch

from mgpu.errors import MgpuError
from mgpu.parallel.distributed import all_reduce
from mgpu.train.metrics import Sums

__all__ = ["LogWindow"]


class LogWindow:
    """One rank's window. The trainer adds to `loss_sum` and `loss_count` (float64 on the device) as it goes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.loss_count = torch.zeros((), dtype=torch.float64, device=device)
        self.sums = Sums()  # the task's training metrics beside its loss
        self.started, self.steps, self.samples = time.perf_counter(), 0, 0

    def add_metrics(self, extras: Mapping[str, Any], real: int, task: str) -> None:
        """A micro-batch's own metrics beside its loss (`real`: its real samples); bad values name the task."""
        try:
            self.sums.add(extras, real=real)
        except ValueError as error:
            raise MgpuError(f"{task}.loss: {error}") from None

    def step_done(self, samples: int) -> None:
        """An optimizer step ended, of `samples` samples over all ranks."""
        self.steps += 1
        self.samples += samples

    def metrics(self, lr: float, grad_norm: float, tokens_per_sample: int | None) -> dict[str, float]:
        """*Collective.* The window's metrics, the same on every rank (the step path's only host sync)."""
        elapsed = time.perf_counter() - self.started
        step_time = elapsed / max(self.steps, 1)
        own = torch.tensor([self.loss_sum.item(), float(self.loss_count), step_time], dtype=torch.float64,
                           device=self.device)
        totals = all_reduce(torch.cat([own, self.sums.vector(self.device)]))
        metrics = {
            "loss": (totals[0] / totals[1].clamp(min=1)).item(),
            "lr": lr,
            "grad_norm": grad_norm,
            "samples_per_s": self.samples / max(elapsed, 1e-9),
            "step_time_s": step_time,
        }
        if tokens_per_sample:
            metrics["tokens_per_s"] = metrics["samples_per_s"] * tokens_per_sample
        metrics.update(self.sums.compute(totals[3:].tolist()))
        return metrics

    def reset(self) -> None:
        """A new window, from now."""
        self.loss_sum.zero_()
        self.loss_count.zero_()
        self.sums.reset()
        self.started, self.steps, self.samples = time.perf_counter(), 0, 0
