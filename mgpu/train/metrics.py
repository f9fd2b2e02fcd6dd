"""Values a task reduces over a whole set, not averaged per sample: token-weighted losses, corpus
metrics from summed statistics (BLEU, F1), and torchmetrics objects. No distributed code in a task:
the trainer sums what a task returns over batches, micro-batches and ranks, then computes.

A task's `loss()` returns per-sample losses (a tensor `[batch]`), or a `LossSum` (e.g. the summed
cross-entropy of every non-pad token and the token count): the gradient is then the exact mean over
every token of the optimizer step, across ranks and accumulation micro-batches. `loss()` may also
return a dict with the loss under "loss" and training metrics beside it (logged as `train/<name>`).

A task's `metrics()` (and the training metrics) map names to per-sample tensors (averaged over
samples), `Ratio(numerator, denominator)` (e.g. correct tokens / tokens), or `Statistics(values,
compute)` (a vector of counts summed over the set, then `compute(totals)`: corpus BLEU, F1, anything
a torchmetrics metric with summed states computes, via `torchmetric(...)`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = ["LossSum", "Ratio", "Statistics", "Sums", "bleu_statistics", "corpus_bleu", "f1_score", "torchmetric"]


@dataclass(frozen=True)
class LossSum:
    """A loss summed over `weight` units (tokens, pixels, ...). The trainer's gradient is the mean over
    every unit of the step: sum of `total` over ranks and micro-batches / sum of `weight`."""

    total: torch.Tensor
    """A scalar with a gradient: the summed loss of this batch."""
    weight: torch.Tensor | float
    """How many units `total` sums (e.g. non-pad tokens); may be 0 for a batch with none."""


@dataclass(frozen=True)
class Ratio:
    """Σ numerator / Σ denominator over the whole set (every batch, every rank)."""

    numerator: torch.Tensor | float
    denominator: torch.Tensor | float


@dataclass(frozen=True)
class Statistics:
    """A vector of counts summed over the whole set (every batch, every rank), then `compute(totals)`."""

    values: torch.Tensor | Sequence[float]
    compute: Callable[[list[float]], float]


def _ngrams(tokens: Sequence[Any], n: int) -> Counter[tuple[Any, ...]]:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def bleu_statistics(hypotheses: Sequence[Sequence[Any]], references: Sequence[Sequence[Any]],
                    max_n: int = 4) -> torch.Tensor:
    """The counts corpus BLEU is computed from, for a batch of (hypothesis, reference) token sequences:
    [matches_1..max_n, candidates_1..max_n, hypothesis length, reference length], float64. Sums of these
    over any split of a corpus give the corpus's (Papineni et al. 2002, one reference per sentence)."""
    stats = [0.0] * (2 * max_n + 2)
    for hypothesis, reference in zip(hypotheses, references, strict=True):
        for n in range(1, max_n + 1):
            hyp, ref = _ngrams(hypothesis, n), _ngrams(reference, n)
            stats[n - 1] += sum(min(count, ref[gram]) for gram, count in hyp.items())
            stats[max_n + n - 1] += max(len(hypothesis) - n + 1, 0)
        stats[-2] += len(hypothesis)
        stats[-1] += len(reference)
    return torch.tensor(stats, dtype=torch.float64)


def corpus_bleu(totals: Sequence[float]) -> float:
    """BLEU in [0, 100] from summed `bleu_statistics`: the geometric mean of the n-gram precisions times
    the brevity penalty. 0 when some order has no match (no smoothing, as sacrebleu's 'none')."""
    max_n = (len(totals) - 2) // 2
    matches, candidates = totals[:max_n], totals[max_n:2 * max_n]
    hyp_len, ref_len = totals[-2], totals[-1]
    if hyp_len == 0 or min(matches) == 0:
        return 0.0
    log_precision = sum(math.log(m / c) for m, c in zip(matches, candidates)) / max_n
    brevity = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    return 100.0 * brevity * math.exp(log_precision)


def f1_score(totals: Sequence[float]) -> float:
    """F1 from summed [true positives, false positives, false negatives]."""
    tp, fp, fn = totals
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def torchmetric(metric: Any, *update_args: Any, **update_kwargs: Any) -> Statistics:
    """A torchmetrics `Metric` (optional dependency: `pip install torchmetrics`) as `Statistics`: this
    batch's update on a fresh copy of `metric`, whose states are summed over the set and handed back to
    `metric.compute()`. Works for metrics whose states all reduce by sum (most of them: accuracy, F1,
    BLEUScore, ...); others fail in one line. Pass the metric unused (a template): it is not updated."""
    fresh = metric.clone()
    fresh.reset()
    fresh.update(*update_args, **update_kwargs)
    names = list(fresh._defaults)  # noqa: SLF001  (the registered states, in order)
    shapes = []
    for name in names:
        if fresh._reductions[name] is not _sum_reduction(fresh):  # noqa: SLF001
            raise ValueError(f"{type(metric).__name__}: state {name!r} is not reduced by sum; return its "
                             f"per-sample values or Statistics of your own")
        shapes.append(getattr(fresh, name).shape)
    values = torch.cat([getattr(fresh, name).detach().double().reshape(-1).cpu() for name in names])

    def compute(totals: list[float]) -> float:
        result = metric.clone()
        result.reset()
        offset = 0
        for name, shape in zip(names, shapes):
            size = math.prod(shape)
            state = getattr(result, name)
            setattr(result, name, torch.tensor(totals[offset:offset + size], dtype=state.dtype).reshape(shape))
            offset += size
        result._update_count = 1  # noqa: SLF001  (compute() warns about a metric that was never updated)
        result.sync_on_compute = False  # the totals are the whole set's already: gathering would count them twice
        result._to_sync = False  # noqa: SLF001
        return float(result.compute())

    return Statistics(values, compute)


def _sum_reduction(metric: Any) -> Any:
    from torchmetrics.utilities.data import dim_zero_sum

    return dim_zero_sum


class Sums:
    """Running sums of a task's values (per-sample tensors, Ratio, Statistics) over batches, as one flat float64
    vector that a single all-reduce adds up across ranks; `compute(totals)` turns the totals into numbers.

    Per-sample tensors count their samples (`real`: how many of the batch are real, the rest padding)."""

    def __init__(self) -> None:
        self.layout: dict[str, tuple[str, int]] = {}  # name -> (kind, width), in first-seen order
        self.computes: dict[str, Callable[[list[float]], float]] = {}
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, values: Mapping[str, Any], real: int | None = None) -> None:
        for name, value in values.items():
            kind, vector = _as_vector(name, value, real)
            if name not in self.layout:
                self.layout[name] = (kind, vector.numel())
                self._sums[name] = torch.zeros_like(vector)
            elif self.layout[name] != (kind, vector.numel()):
                raise ValueError(f"{name!r} changed from {self.layout[name][0]} to {kind} between batches")
            if isinstance(value, Statistics):
                self.computes[name] = value.compute
            self._sums[name] += vector

    def vector(self, device: torch.device | None = None) -> torch.Tensor:
        """Every sum, in `layout` order (empty before the first `add`)."""
        if not self._sums:
            return torch.zeros(0, dtype=torch.float64, device=device)
        return torch.cat([self._sums[name].reshape(-1).to(device) for name in self.layout])

    def compute(self, totals: list[float]) -> dict[str, float]:
        """The set's values from `vector()`'s totals (summed over ranks)."""
        out, offset = {}, 0
        for name, (kind, width) in self.layout.items():
            part = totals[offset:offset + width]
            offset += width
            if kind == "statistics":
                out[name] = float(self.computes[name](part))
            else:
                out[name] = part[0] / part[1] if part[1] else math.nan
        return out

    def reset(self) -> None:
        for total in self._sums.values():
            total.zero_()


def _as_vector(name: str, value: Any, real: int | None) -> tuple[str, torch.Tensor]:
    """(kind, the float64 vector to add) for one value a task returned."""
    if isinstance(value, Ratio):
        parts = [torch.as_tensor(value.numerator).detach(), torch.as_tensor(value.denominator).detach()]
        return "ratio", torch.stack([p.double().reshape(()).to(parts[0].device) for p in parts])
    if isinstance(value, Statistics):
        return "statistics", torch.as_tensor(value.values).detach().double().reshape(-1)
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        kept = value.detach()[:real] if real is not None else value.detach()
        return "mean", torch.stack([kept.double().sum(), torch.tensor(float(kept.numel()), dtype=torch.float64,
                                                                      device=kept.device)])
    shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise ValueError(f"{name!r} is {shape}: return one value per sample (shape [batch]), a Ratio or Statistics "
                     f"(mgpu.train.metrics; a mean? use reduction='none')")
