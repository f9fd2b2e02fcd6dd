"""A task for benchmarks: an MLP on random features, sized so one CPU step takes a few milliseconds."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from mgpu.train.task import Task


def random_dataset(size: int, features: int = 256, classes: int = 10) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(size, features, generator=generator),
                         torch.randint(0, classes, (size,), generator=generator))


def mlp(features: int = 256, hidden: int = 1024, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


class BenchTask(Task):
    def __init__(self, size: int = 4096, hidden: int = 1024) -> None:
        self.size, self.hidden = size, hidden

    def build_model(self) -> nn.Module:
        return mlp(hidden=self.hidden)

    def train_dataset(self) -> Dataset:
        return random_dataset(self.size)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="none")
