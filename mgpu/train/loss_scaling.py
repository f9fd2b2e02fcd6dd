"""The step's gradient arithmetic: each micro-batch's loss scaled so that DDP's average of the gradients over ranks is
the exact mean over every real sample of the step (or, for a mgpu.train.metrics.LossSum, over every unit, such as
tokens), however unevenly the samples are split between ranks and micro-batches."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mgpu.data.sampling import MicroBatch
from mgpu.errors import MgpuError
from mgpu.parallel.fsdp import local_grads
from mgpu.train.log_window import LogWindow
from mgpu.train.metrics import LossSum

__all__ = ["backward_per_sample", "backward_summed", "mean_over_units"]


def backward_per_sample(loss: Any, mb: MicroBatch, total: int, world: int, scaler: torch.amp.GradScaler,
                        window: LogWindow, task_name: str) -> None:
    """Backward of a per-sample loss (one value per row of `mb`), scaled so that DDP's average over the `world`
    ranks is the exact mean over the step's `total` real samples; the real rows' losses added to `window`."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 1 or loss.shape[0] != len(mb.indices):
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise MgpuError(f"{task_name}.loss must return one loss per sample (shape "
                        f"[{len(mb.indices)}]) or a mgpu.train.metrics.LossSum, got {shape}")
    real = loss[:mb.real].float()
    # DDP averages gradients over ranks: scaling by world/total makes that average the exact
    # mean over every real sample of the step, however unevenly the samples were split.
    scaler.scale(real.sum() * (world / total)).backward()
    window.loss_sum += real.detach().sum()  # float64 accumulator: promoted in place, no extra op
    window.loss_count += mb.real


def backward_summed(loss: LossSum, mb: MicroBatch, weight: torch.Tensor | None, last: bool, world: int,
                    device: torch.device, scaler: torch.amp.GradScaler,
                    window: LogWindow) -> tuple[torch.Tensor, Any]:
    """Backward of a LossSum (a sum over units such as tokens, and their count), unscaled: mean_over_units scales
    the step's gradients once it is done. Returns the step's units on this rank so far (`weight`: before this
    micro-batch) and, at the step's `last` micro-batch, their sum over the ranks in flight (None before)."""
    kept = 1.0 if mb.real else 0.0  # a rank left without samples trains on a padding one: weight 0
    summed = loss.total.float() * kept
    units = torch.as_tensor(loss.weight, dtype=torch.float64, device=device) * kept
    weight = units if weight is None else weight + units
    reduction = None
    if last and world > 1:  # the step's units on all ranks, summed while backward runs
        weight = weight.clone()
        reduction = dist.all_reduce(weight, async_op=True)
    scaler.scale(summed).backward()
    window.loss_sum += summed.detach()
    window.loss_count += units
    return weight, reduction


def mean_over_units(model: nn.Module, weight: torch.Tensor, world: int, reduction: Any = None) -> None:
    """After a LossSum step's backward: its gradients, which DDP averaged over the `world` ranks, made the mean over
    every unit of the step. `weight`: the step's units, summed over the ranks once `reduction` (backward_summed's
    all-reduce in flight, None for one rank) is done; none at all: the gradients are zeroed."""
    if reduction is not None:
        reduction.wait()
    # DDP averaged the summed losses' gradients over ranks: world / units makes it the mean over every unit.
    factor = torch.where(weight > 0, world / weight.clamp(min=1e-300), torch.zeros_like(weight))
    grads = local_grads(model)  # a sharded gradient's local part: the factor is the same everywhere
    for dtype in {g.dtype for g in grads}:
        torch._foreach_mul_([g for g in grads if g.dtype == dtype], factor.to(dtype))
