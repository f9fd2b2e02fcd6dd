"""The seeds' translation transformer (the mp.spawn loop with warmup, clipping, early stopping on BLEU) on a
synthetic language pair, as an mgpu Task: a token-weighted, label-smoothed loss, Adam with betas (0.9,
0.98) and eps 1e-9 under the inverse-square-root (Noam) warmup, corpus BLEU of greedy translations for
early stopping and the best checkpoint, a few decoded samples logged as text. Nothing is downloaded.

The "language": a source sentence is 4-10 words of a 24-word vocabulary; its translation is the
sentence reversed, each word mapped through a fixed dictionary, and every fifth word (ids divisible by
5) rendered as two target words: lengths differ, and a model must attend to the whole source.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from mgpu.train.metrics import LossSum, Ratio, Statistics, bleu_statistics, corpus_bleu
from mgpu.train.task import Task

PAD, BOS, EOS = 0, 1, 2
FIRST_WORD = 3


class Pair(NamedTuple):
    """A padded batch: source ids, the target fed to the decoder (BOS first), the target to predict (EOS last)."""

    source: torch.Tensor
    target_in: torch.Tensor
    target_out: torch.Tensor


def translate(source: list[int], vocab: int) -> list[int]:
    """The reference translation of a source sentence (word ids)."""
    dictionary = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234)).tolist()
    out: list[int] = []
    for word in reversed(source):
        mapped = FIRST_WORD + dictionary[word - FIRST_WORD]
        out.append(mapped)
        if word % 5 == 0:
            out.append(FIRST_WORD + dictionary[(word - FIRST_WORD + 7) % vocab])
    return out


class SyntheticPairs(Dataset):
    """`size` (source, target) pairs of word ids, the same for the same `(size, seed, vocab)`."""

    def __init__(self, size: int, seed: int, vocab: int = 24, min_len: int = 4, max_len: int = 10) -> None:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(min_len, max_len + 1, (size,), generator=generator).tolist()
        self.sources = [torch.randint(FIRST_WORD, FIRST_WORD + vocab, (n,), generator=generator).tolist()
                        for n in lengths]
        self.targets = [translate(source, vocab) for source in self.sources]

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, index: int) -> tuple[list[int], list[int]]:
        return self.sources[index], self.targets[index]


def collate(samples: list[tuple[list[int], list[int]]]) -> Pair:
    def pad(rows: list[list[int]]) -> torch.Tensor:
        width = max(len(row) for row in rows)
        return torch.tensor([row + [PAD] * (width - len(row)) for row in rows], dtype=torch.long)

    sources, targets = zip(*samples)
    return Pair(pad(list(sources)), pad([[BOS, *t] for t in targets]), pad([[*t, EOS] for t in targets]))


class Seq2Seq(nn.Module):
    """A small pre-norm encoder-decoder transformer with learned positions and a tied output layer."""

    def __init__(self, vocab: int, d_model: int = 64, heads: int = 4, layers: int = 2, ff: int = 128,
                 dropout: float = 0.1, max_len: int = 32) -> None:
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.position = nn.Embedding(max_len, d_model)
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d_model, heads, ff, dropout, batch_first=True,
                                                                   norm_first=True), layers,
                                        norm=nn.LayerNorm(d_model), enable_nested_tensor=False)
        self.transformer = nn.Transformer(d_model, heads, layers, layers, ff, dropout, custom_encoder=encoder,
                                          batch_first=True, norm_first=True)
        self.out = nn.Linear(d_model, vocab)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.embed(ids) * math.sqrt(self.d_model) + self.position(positions)

    def forward(self, source: torch.Tensor, target_in: torch.Tensor) -> torch.Tensor:
        width = target_in.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=source.device).triu(1)  # True: not attended
        hidden = self.transformer(self._embed(source), self._embed(target_in), tgt_mask=causal,
                                  src_key_padding_mask=source == PAD, tgt_key_padding_mask=target_in == PAD,
                                  memory_key_padding_mask=source == PAD, tgt_is_causal=True)
        return self.out(hidden)

    @torch.no_grad()
    def greedy(self, source: torch.Tensor, max_len: int) -> list[list[int]]:
        """Greedy translations of a batch (word ids, without BOS/EOS)."""
        ids = torch.full((source.shape[0], 1), BOS, dtype=torch.long, device=source.device)
        done = torch.zeros(source.shape[0], dtype=torch.bool, device=source.device)
        for _ in range(max_len):
            next_ids = self(source, ids)[:, -1].argmax(-1)
            next_ids = torch.where(done, torch.full_like(next_ids, PAD), next_ids)
            ids = torch.cat([ids, next_ids[:, None]], dim=1)
            done |= next_ids == EOS
            if done.all():
                break
        return [[t for t in row[1:] if t not in (PAD, BOS)][:(row[1:] + [EOS]).index(EOS)]
                for row in ids.tolist()]


def noam(d_model: int, warmup: int, factor: float) -> Any:
    """The inverse-square-root schedule of "Attention is all you need", as a LambdaLR factor of lr=1."""
    def rate(step: int) -> float:
        step = max(step, 1)
        return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)

    return rate


class TranslationTask(Task):
    def __init__(self, train_size: int = 4000, eval_size: int = 300, vocab: int = 24, d_model: int = 64,
                 layers: int = 2, dropout: float = 0.1, label_smoothing: float = 0.1, warmup_steps: int = 200,
                 warmup_factor: float = 2.0, samples_to_log: int = 3, per_sample_loss: bool = False,
                 optimizer: str = "adam") -> None:
        """`per_sample_loss`: each sentence's mean token loss instead (short sentences then weigh more than their
        tokens); `optimizer="sgd"`: SGD with momentum instead of the seed's Adam (whose first steps move every
        weight by about the learning rate, whatever the sign of a near-zero gradient: a poor probe for comparing
        two runs' gradients). Both for comparisons only."""
        self.train_size, self.eval_size, self.vocab = train_size, eval_size, vocab
        self.d_model, self.layers, self.dropout = d_model, layers, dropout
        self.label_smoothing, self.warmup_steps, self.warmup_factor = label_smoothing, warmup_steps, warmup_factor
        self.samples_to_log, self.per_sample_loss, self.optimizer_name = samples_to_log, per_sample_loss, optimizer
        self.tokens = FIRST_WORD + vocab

    def build_model(self) -> nn.Module:
        return Seq2Seq(self.tokens, self.d_model, layers=self.layers, dropout=self.dropout)

    def train_dataset(self) -> SyntheticPairs:
        return SyntheticPairs(self.train_size, seed=0, vocab=self.vocab)

    def eval_dataset(self) -> SyntheticPairs:
        return SyntheticPairs(self.eval_size, seed=1, vocab=self.vocab)

    def collate_fn(self) -> Any:
        return collate

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        # The seed's Adam; no weight decay anywhere (the seed has none). lr=1: the schedule is the rate.
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
        return torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)

    def scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, noam(self.d_model, self.warmup_steps, self.warmup_factor))

    def loss(self, model: nn.Module, batch: Pair) -> dict[str, Any]:
        logits = model(batch.source, batch.target_in)
        tokens = batch.target_out != PAD
        losses = F.cross_entropy(logits.transpose(1, 2), batch.target_out, ignore_index=PAD,
                                 label_smoothing=self.label_smoothing, reduction="none")
        correct = ((logits.argmax(-1) == batch.target_out) & tokens).sum()
        if self.per_sample_loss:
            return {"loss": losses.sum(1) / tokens.sum(1), "token_accuracy": Ratio(correct, tokens.sum())}
        # Summed over the batch's tokens: the gradient is the mean over every token of the step (as the seed's
        # token-averaged criterion), not over sentences.
        return {"loss": LossSum(losses.sum(), tokens.sum()), "token_accuracy": Ratio(correct, tokens.sum())}

    def metrics(self, model: nn.Module, batch: Pair) -> dict[str, Any]:
        logits = model(batch.source, batch.target_in)
        tokens = batch.target_out != PAD
        nll = F.cross_entropy(logits.transpose(1, 2), batch.target_out, ignore_index=PAD, reduction="sum")
        correct = ((logits.argmax(-1) == batch.target_out) & tokens).sum()
        hypotheses = cast(Seq2Seq, model).greedy(batch.source, max_len=batch.target_out.shape[1] + 4)
        references = [[t for t in row if t not in (PAD, EOS)] for row in batch.target_out.tolist()]
        if self.log is not None:
            for source, hypothesis, reference in list(zip(batch.source.tolist(), hypotheses, references))[
                    :self.samples_to_log]:
                self.log.text("samples", f"{[t for t in source if t != PAD]} -> {hypothesis} (reference {reference})")
        return {"loss": Ratio(nll, tokens.sum()), "token_accuracy": Ratio(correct, tokens.sum()),
                "bleu": Statistics(bleu_statistics(hypotheses, references), corpus_bleu)}
