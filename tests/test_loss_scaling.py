"""mgpu.train.loss_scaling on one process and real tensors: a step's gradients are the mean over its real samples (or
a LossSum's units), padding rows excluded, however the samples fall into micro-batches; the per-sample shape check;
and mgpu.train.evaluation.track_best, the best-metric and early-stopping decision."""

from __future__ import annotations

import re
from typing import Literal

import pytest
import torch
from torch import nn

from mgpu.config.schema import EvalConfig
from mgpu.data.sampling import MicroBatch
from mgpu.errors import MgpuError
from mgpu.state.train_state import Progress
from mgpu.train.evaluation import track_best
from mgpu.train.log_window import LogWindow
from mgpu.train.loss_scaling import backward_per_sample, backward_summed, mean_over_units
from mgpu.train.metrics import LossSum

CPU = torch.device("cpu")


def model_and_data(rows: int) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(3, 1), torch.randn(rows, 3), torch.randn(rows, 1)


def per_row(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).squeeze(1)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def expected_grads(model: nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out


def micro(rows: int, real: int, global_count: int) -> MicroBatch:
    return MicroBatch(indices=list(range(rows)), real=real, global_count=global_count, end_position=0)


def test_per_sample_is_the_mean_over_real_samples_padding_excluded() -> None:
    model, x, y = model_and_data(6)
    # Two micro-batches: 2 real rows, then 3 real rows and 1 padding row (row 5): 5 real samples in the step.
    want = expected_grads(model, per_row(model, x[:5], y[:5]).mean())
    scaler, window = torch.amp.GradScaler("cpu", enabled=False), LogWindow(CPU)
    total = 5
    for rows, mb in ((slice(0, 2), micro(2, 2, 2)), (slice(2, 6), micro(4, 3, 3))):
        backward_per_sample(per_row(model, x[rows], y[rows]), mb, total, 1, scaler, window, "BlobTask")
    for got, exp in zip(grads(model), want):
        torch.testing.assert_close(got, exp)
    assert window.loss_count.item() == 5
    torch.testing.assert_close(window.loss_sum, per_row(model, x[:5], y[:5]).detach().double().sum())


def test_per_sample_scales_by_world_over_total() -> None:
    """With several ranks, this rank's share is scaled by world / total: DDP's average over ranks is then the mean."""
    model, x, y = model_and_data(3)
    want = expected_grads(model, per_row(model, x, y).sum() * (4 / 10))
    backward_per_sample(per_row(model, x, y), micro(3, 3, 10), 10, 4, torch.amp.GradScaler("cpu", enabled=False),
                        LogWindow(CPU), "BlobTask")
    for got, exp in zip(grads(model), want):
        torch.testing.assert_close(got, exp)


@pytest.mark.parametrize("loss, shape", [(torch.tensor(1.0), "[]"), (torch.zeros(4, 1), "[4, 1]"),
                                         (torch.zeros(3), "[3]"), (1.5, "float")])
def test_per_sample_refuses_anything_but_one_loss_per_row(loss: object, shape: str) -> None:
    message = (f"BlobTask.loss must return one loss per sample (shape [4]) or a mgpu.train.metrics.LossSum, "
               f"got {shape}")
    with pytest.raises(MgpuError, match=re.escape(message)):
        backward_per_sample(loss, micro(4, 4, 4), 4, 1, torch.amp.GradScaler("cpu", enabled=False), LogWindow(CPU),
                            "BlobTask")


def test_summed_is_the_mean_over_units_of_the_step() -> None:
    model, x, y = model_and_data(7)
    # Units per row (tokens): row i counts i + 1 units; a rank left with a padding micro-batch (real=0) adds none.
    units = torch.arange(1, 8, dtype=torch.float32)
    want = expected_grads(model, (per_row(model, x[:5], y[:5]) * units[:5]).sum() / units[:5].sum())
    scaler, window = torch.amp.GradScaler("cpu", enabled=False), LogWindow(CPU)
    weight = None
    parts = ((slice(0, 2), micro(2, 2, 2), False), (slice(2, 5), micro(3, 3, 3), False),
             (slice(5, 7), micro(2, 0, 0), True))
    for rows, mb, last in parts:
        loss = LossSum((per_row(model, x[rows], y[rows]) * units[rows]).sum(), units[rows].sum())
        weight, reduction = backward_summed(loss, mb, weight, last, 1, CPU, scaler, window)
        assert reduction is None  # one rank: nothing to sum over ranks
    assert weight is not None and weight.item() == units[:5].sum().item()
    mean_over_units(model, weight, 1)
    for got, exp in zip(grads(model), want):
        torch.testing.assert_close(got, exp)
    assert window.loss_count.item() == units[:5].sum().item()


def test_summed_without_units_zeroes_the_gradients() -> None:
    model, x, y = model_and_data(2)
    loss = LossSum(per_row(model, x, y).sum(), 0.0)
    weight, _ = backward_summed(loss, micro(2, 2, 2), None, True, 1, CPU, torch.amp.GradScaler("cpu", enabled=False),
                                LogWindow(CPU))
    mean_over_units(model, weight, 1)
    assert all(torch.count_nonzero(g) == 0 for g in grads(model))


# eval.mode, eval.min_delta, eval.early_stopping_patience; the metric over successive evaluations; then after each
# evaluation: (improved, patience spent), and the best value at the end.
TRACK = [
    ("min", 0.0, None, [3.0, 2.0, 2.0, 1.0], [(True, False), (True, False), (False, False), (True, False)], 1.0),
    ("min", 0.5, 2, [3.0, 2.6, 2.4, 1.0, 1.2, 0.9],
     [(True, False), (False, False), (True, False), (True, False), (False, False), (False, True)], 1.0),
    ("max", 0.1, 1, [0.5, 0.7, 0.75], [(True, False), (True, False), (False, True)], 0.7),
    ("max", 0.0, 3, [0.5, 0.5, 0.4, 0.6, 0.6], [(True, False), (False, False), (False, False), (True, False),
                                                (False, False)], 0.6),
]


@pytest.mark.parametrize("mode, min_delta, patience, values, decisions, best", TRACK)
def test_track_best(mode: Literal["min", "max"], min_delta: float, patience: int | None, values: list[float],
                    decisions: list[tuple[bool, bool]], best: float) -> None:
    cfg = EvalConfig(metric="acc", mode=mode, min_delta=min_delta, early_stopping_patience=patience)
    p = Progress()
    got, best_step = [], None
    for step, value in enumerate(values, start=1):
        p.step = step
        improved, spent = track_best(p, {"acc": value, "loss": -value}, cfg)
        got.append((improved, spent))
        best_step = step if improved else best_step
    assert got == decisions
    assert best_step is not None and p.best_metric == best and p.best_step == best_step
    assert p.best_metrics == {"acc": best, "loss": -best}
    assert p.evals_without_improvement == len(values) - best_step
