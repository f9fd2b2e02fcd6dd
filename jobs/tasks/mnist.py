"""The seeds' single-GPU MNIST loop (small CNN, Adam, cross-entropy, accuracy) as an mgpu Task.

No distributed code: the trainer shards the data, wraps the model in DDP, checkpoints and logs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jobs.tasks.digits import SyntheticDigits
from mgpu.train.task import Task


class SmallCNN(nn.Module):
    def __init__(self, width: int = 32, dropout: float = 0.25) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * width * 7 * 7, 128),
                                  nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class MnistTask(Task):
    def __init__(self, train_size: int = 20_000, eval_size: int = 4_000, width: int = 32, dropout: float = 0.25):
        self.train_size, self.eval_size, self.width, self.dropout = train_size, eval_size, width, dropout

    def build_model(self) -> nn.Module:
        return SmallCNN(self.width, self.dropout)

    def train_dataset(self) -> SyntheticDigits:
        return SyntheticDigits(self.train_size, seed=0)

    def eval_dataset(self) -> SyntheticDigits:
        return SyntheticDigits(self.eval_size, seed=1)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels, reduction="none")

    def metrics(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        images, labels = batch
        logits = model(images)
        return {"loss": F.cross_entropy(logits, labels, reduction="none"),
                "accuracy": (logits.argmax(dim=1) == labels).float()}
