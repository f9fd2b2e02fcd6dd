"""mgpu.train.metrics: values reduced over a whole set. Corpus BLEU from summed statistics against torchmetrics'
own BLEU on the whole corpus at once; any split into batches (and ranks) sums to the same; Sums' layout,
kinds and refusals."""

from __future__ import annotations

import random
import re

import pytest
import torch

from mgpu.train.metrics import LossSum, Ratio, Statistics, Sums, bleu_statistics, corpus_bleu, f1_score, torchmetric


def corpus(seed: int, size: int = 40) -> tuple[list[list[str]], list[list[str]]]:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(12)]
    refs = [[rng.choice(words) for _ in range(rng.randint(3, 12))] for _ in range(size)]
    hyps = [[w if rng.random() < 0.7 else rng.choice(words) for w in ref[:rng.randint(2, len(ref) + 2)]]
            for ref in refs]
    return hyps, refs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_corpus_bleu_matches_torchmetrics_and_any_split_sums_to_it(seed: int) -> None:
    from torchmetrics.text import BLEUScore

    hyps, refs = corpus(seed)
    reference = 100 * BLEUScore()([" ".join(h) for h in hyps], [[" ".join(r)] for r in refs]).item()
    whole = corpus_bleu(bleu_statistics(hyps, refs).tolist())
    assert whole == pytest.approx(reference, rel=1e-6)
    cut = sorted(random.Random(seed).sample(range(1, len(hyps)), 5))
    parts = [bleu_statistics(hyps[a:b], refs[a:b]) for a, b in zip([0, *cut], [*cut, len(hyps)])]
    assert corpus_bleu(torch.stack(parts).sum(0).tolist()) == pytest.approx(whole, rel=1e-12)
    # The mean of per-part BLEUs is not corpus BLEU: what a per-sample average would have reported.
    assert sum(corpus_bleu(p.tolist()) for p in parts) / len(parts) != pytest.approx(whole, rel=1e-3)


def test_bleu_edge_cases() -> None:
    assert corpus_bleu(bleu_statistics([], []).tolist()) == 0.0
    assert corpus_bleu(bleu_statistics([["a", "b"]], [["a", "b", "c", "d"]]).tolist()) == 0.0  # no 3-gram match
    perfect = bleu_statistics([list("abcdef")], [list("abcdef")]).tolist()
    assert corpus_bleu(perfect) == pytest.approx(100.0)


def test_a_torchmetrics_metric_split_over_batches_computes_as_on_the_whole_set() -> None:
    from torchmetrics.classification import BinaryF1Score

    generator = torch.Generator().manual_seed(0)
    preds, target = torch.rand(100, generator=generator), torch.randint(0, 2, (100,), generator=generator)
    template = BinaryF1Score()
    sums = Sums()
    for start in range(0, 100, 30):
        sums.add({"f1": torchmetric(template, preds[start:start + 30], target[start:start + 30])})
    assert sums.compute(sums.vector().tolist())["f1"] == pytest.approx(BinaryF1Score()(preds, target).item(), rel=1e-6)
    assert template.update_count == 0  # the template itself is never updated


@pytest.mark.parametrize("seed", [0, 1])
def test_f1_from_summed_counts_matches_torchmetrics_over_any_split(seed: int) -> None:
    from torchmetrics.classification import BinaryF1Score

    generator = torch.Generator().manual_seed(seed)
    preds, target = torch.randint(0, 2, (200,), generator=generator), torch.randint(0, 2, (200,), generator=generator)
    sums = Sums()
    for start in range(0, 200, 37):  # uneven batches, as a rank's share of an eval set
        p, t = preds[start:start + 37], target[start:start + 37]
        counts = torch.stack([(p & t).sum(), (p & ~t.bool()).sum(), (~p.bool() & t).sum()]).double()
        sums.add({"f1": Statistics(counts, f1_score)})
    assert sums.compute(sums.vector().tolist())["f1"] == pytest.approx(BinaryF1Score()(preds, target).item(), rel=1e-6)
    assert f1_score([0, 3, 4]) == 0.0  # no true positive: 0, not a division by zero


def test_sums_reduce_each_kind_and_keep_their_order() -> None:
    sums = Sums()
    sums.add({"loss": torch.tensor([1.0, 3.0, 100.0]), "acc": Ratio(torch.tensor(2), torch.tensor(4)),
              "f1": Statistics([1.0, 1.0, 0.0], f1_score)}, real=2)  # the third sample is padding
    sums.add({"loss": torch.tensor([2.0]), "acc": Ratio(3, 4), "f1": Statistics(torch.tensor([1.0, 0.0, 1.0]), f1_score)})
    assert list(sums.layout) == ["loss", "acc", "f1"]
    totals = (sums.vector() * 2).tolist()  # two ranks that saw the same: sums double, values do not move
    assert sums.compute(totals) == pytest.approx({"loss": 2.0, "acc": 5 / 8, "f1": 2 * 2 / (2 * 2 + 1 + 1)})
    sums.reset()
    assert sums.vector().abs().sum() == 0


@pytest.mark.parametrize("value, message", [
    (torch.tensor(1.0), "is []: return one value per sample"),
    (torch.ones(2, 2), "is [2, 2]"),
    (0.5, "is float"),
    (LossSum(torch.tensor(1.0), 2), "is LossSum"),
])
def test_sums_refuse_what_cannot_be_reduced(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Sums().add({"x": value})


def test_a_value_that_changes_kind_between_batches_is_refused() -> None:
    sums = Sums()
    sums.add({"acc": torch.tensor([1.0])})
    with pytest.raises(ValueError, match="changed from mean to ratio"):
        sums.add({"acc": Ratio(1, 1)})
