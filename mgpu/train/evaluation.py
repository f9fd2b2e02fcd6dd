"""Evaluation: what a task's metrics must look like (checked at start, on two samples), one pass over the eval set
on every rank, with the task's values summed over batches and ranks (mgpu.train.metrics.Sums), and whether an
evaluation is the best so far and early stopping's patience is spent."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch
from torch import nn

from mgpu.parallel.ddp import sync_buffers
from mgpu.parallel.distributed import all_reduce, broadcast_object
from mgpu.errors import MgpuError
from mgpu.train.metrics import Sums

if TYPE_CHECKING:
    from mgpu.config.schema import EvalConfig
    from mgpu.state.train_state import Progress

__all__ = ["EvalInterrupted", "check_metrics", "evaluate", "track_best"]


class EvalInterrupted(Exception):
    """The ranks agreed to stop in the middle of an evaluation."""


def check_metrics(values: Any, samples: int, task: str, metric: str) -> None:
    """MgpuError in one line unless `values` (a task's metrics on a batch of `samples`) are a dict of per-sample
    tensors, Ratios and Statistics that names `metric` (eval.metric)."""
    if not isinstance(values, Mapping) or not values:
        raise MgpuError(f"{task}.metrics must return a dict of name -> per-sample tensor, Ratio or Statistics, "
                        f"got {values!r:.80}")
    for name, value in values.items():
        if isinstance(value, torch.Tensor) and value.shape != (samples,):
            raise MgpuError(f"{task}.metrics must return one value per sample (shape [batch]) for every tensor "
                            f"metric: {name!r} is {list(value.shape)} on a batch of {samples} (a mean? use "
                            f"reduction='none', or mgpu.train.metrics.Ratio for sums)")
    try:
        Sums().add(values)
    except ValueError as error:
        raise MgpuError(f"{task}.metrics: {error}") from None
    if metric not in values:
        raise MgpuError(f"eval.metric={metric!r} is not one of the task's metrics {sorted(values)}: set eval.metric "
                        f"to one of them")


def evaluate(model: nn.Module, batches: Iterable[Any], common: int, metrics: Callable[[nn.Module, Any], Any],
             poll_stop: Callable[[], bool], beat: Callable[..., None], autocast: Any, device: torch.device,
             world: int, even_forwards: int = 0) -> dict[str, float]:
    """Every metric over the whole eval set, the same on every rank (a collective).

    `batches`: this rank's (on device); `common`: how many batches every rank has, between which the ranks
    agree on a stop (EvalInterrupted): a long evaluation must not hold a stop past Slurm's KillWait.
    The plain module, not DDP: ranks run different numbers of batches, and DDP's forward may run
    collectives (buffer broadcast) that would then never match up; every rank evaluates with rank 0's
    buffers (mgpu.parallel.ddp.sync_buffers). `even_forwards`: a sharded (FSDP2) model's forward is a collective, so a
    rank with fewer batches runs its last one again, the result thrown away, up to this many forwards."""
    sums = Sums()
    beat("eval")  # the evaluation's own allowance from here on, the buffers' broadcast and first fetch included
    if world > 1:
        sync_buffers(model)
    model.eval()
    last, done = None, 0
    try:
        with torch.no_grad(), autocast:
            for index, batch in enumerate(batches):
                beat("eval")
                # Every batch that every rank has: the agreement read one batch after it starts, as in training.
                if index < common and poll_stop():
                    raise EvalInterrupted()
                sums.add(metrics(model, batch))
                last, done = batch, index + 1
            if done < even_forwards and last is None:
                raise MgpuError("the eval set has fewer samples than there are ranks, which a sharded model "
                                "cannot evaluate (every rank's forward takes part): give it more samples")
            for _ in range(even_forwards - done):
                metrics(model, last)  # thrown away: only to meet the other ranks' all-gathers
    finally:
        model.train()
    # Rank 0 (which always has samples) knows the layout and how to compute each value; the others add theirs.
    layout = broadcast_object(list(sums.layout.items())) if world > 1 else list(sums.layout.items())
    mine = sums.vector(device)
    vector = mine if mine.numel() else torch.zeros(sum(width for _, (_, width) in layout), dtype=torch.float64,
                                                   device=device)
    totals = all_reduce(vector).tolist()
    values = sums.compute(totals) if sums.layout else None
    return broadcast_object(values) if world > 1 else values  # type: ignore[return-value]  # rank 0's values, pickled: the same type


def track_best(progress: Progress, metrics: Mapping[str, float], cfg: EvalConfig) -> tuple[bool, bool]:
    """An evaluation's `metrics` against the best so far by eval.metric (in eval.mode, by more than eval.min_delta):
    `progress`'s best (best_metric, best_metrics, best_step at its step) and evaluations without improvement
    updated. Returns (improved, early stopping's patience spent: eval.early_stopping_patience evaluations in a
    row without improvement)."""
    p, value = progress, metrics[cfg.metric]
    improved = p.best_metric is None or (
        value < p.best_metric - cfg.min_delta if cfg.mode == "min" else value > p.best_metric + cfg.min_delta)
    if improved:
        p.best_metric, p.evals_without_improvement = value, 0
        p.best_metrics, p.best_step = dict(metrics), p.step
    else:
        p.evals_without_improvement += 1
    patience = cfg.early_stopping_patience
    return improved, patience is not None and p.evals_without_improvement >= patience
