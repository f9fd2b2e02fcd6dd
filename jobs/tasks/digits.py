"""Synthetic handwritten-style digits, 28x28 grey images made on the spot (no download, no torchvision).

Each sample is one of ten 5x7 glyphs, drawn with a random stroke width, rotation, scale, shear,
shift and noise; the same `(size, seed)` always gives the same data. Hard enough that a linear
model stays well below a small CNN.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

GLYPHS = [
    "01110 10001 10011 10101 11001 10001 01110",  # 0
    "00100 01100 00100 00100 00100 00100 01110",  # 1
    "01110 10001 00001 00010 00100 01000 11111",  # 2
    "11111 00010 00100 00010 00001 10001 01110",  # 3
    "00010 00110 01010 10010 11111 00010 00010",  # 4
    "11111 10000 11110 00001 00001 10001 01110",  # 5
    "00110 01000 10000 11110 10001 10001 01110",  # 6
    "11111 00001 00010 00100 01000 01000 01000",  # 7
    "01110 10001 10001 01110 10001 10001 01110",  # 8
    "01110 10001 10001 01111 00001 00010 01100",  # 9
]


def _glyph_images() -> torch.Tensor:
    """The ten glyphs as 1x28x28 images, centred, before any distortion."""
    rows = [[[float(c) for c in row] for row in glyph.split()] for glyph in GLYPHS]
    small = torch.tensor(rows).unsqueeze(1)  # 10x1x7x5
    big = F.interpolate(small, size=(21, 15), mode="nearest")
    return F.pad(big, (6, 7, 3, 4))  # 10x1x28x28


class SyntheticDigits(Dataset):
    """`size` labelled digit images; (image [1,28,28] float, label int64)."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 10, (size,), generator=generator)
        images = _glyph_images()[self.labels]
        # Thicker or thinner strokes: a random max-pool dilation on part of the samples.
        thick = torch.rand(size, generator=generator) < 0.5
        images[thick] = F.max_pool2d(images[thick], 3, stride=1, padding=1)
        angle = (torch.rand(size, generator=generator) - 0.5) * math.radians(70)
        scale = 0.6 + 0.6 * torch.rand(size, generator=generator)
        shear = (torch.rand(size, generator=generator) - 0.5) * 0.8
        shift = (torch.rand(size, 2, generator=generator) - 0.5) * 0.5
        cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
        theta = torch.stack([torch.stack([cos, -sin + shear, shift[:, 0]], 1),
                             torch.stack([sin, cos, shift[:, 1]], 1)], 1)
        grid = F.affine_grid(theta, list(images.shape), align_corners=False)
        images = F.grid_sample(images, grid, align_corners=False)
        # Clutter: a random bright bar through part of the images, then heavy pixel noise.
        bars = torch.zeros_like(images)
        rows = torch.randint(0, 28, (size,), generator=generator)
        has_bar = torch.rand(size, generator=generator) < 0.5
        bars[torch.arange(size)[has_bar], 0, rows[has_bar], :] = 1.0
        images = torch.maximum(images, bars) + 0.5 * torch.randn(images.shape, generator=generator)
        self.images = ((images - 0.15) / 0.35).contiguous()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class RandomShift(Dataset):
    """`dataset`'s images shifted by up to `pixels` in each direction, drawn afresh at every access from
    torch's random generator (the kind of augmentation a torchvision transform does)."""

    def __init__(self, dataset: Dataset, pixels: int = 2) -> None:
        self.dataset, self.pixels = dataset, pixels

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # torch's Dataset declares no __len__

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = self.dataset[index]
        dy, dx = torch.randint(-self.pixels, self.pixels + 1, (2,)).tolist()
        return torch.roll(image, shifts=(dy, dx), dims=(1, 2)), label
