"""Sharding that can resume from any global sample position, on any world size.

Each epoch has one permutation of the whole dataset, a function of `(seed, epoch)` only (never of
the world size). Training consumes it front to back, one *global micro-batch* (`world_size *
batch_size` samples) per micro-step; rank r takes the r-th contiguous slice. The position inside
the epoch is counted in global samples, so a run resumed at position p on a different number of
ranks continues at exactly the same sample: none is seen twice, none is skipped.

The last global micro-batch of an epoch may be short. It is split as evenly as possible; a rank
left with nothing gets one padding sample of weight 0, because every rank must take part in every
DDP all-reduce. The trainer weights each rank's per-sample losses by its count of real samples, so
the gradient is the exact mean over the samples of the optimizer step, whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from mgpu.state.rng import derived_seed

__all__ = ["MicroBatch", "ShardPlan", "epoch_permutation", "eval_shard", "plan_for"]


@dataclass(frozen=True)
class MicroBatch:
    """This rank's share of one global micro-batch."""

    indices: list[int]
    real: int
    """How many of `indices` are real samples; the rest (at most one) are padding of weight 0."""
    global_count: int
    """Real samples in the whole global micro-batch (all ranks)."""
    end_position: int
    """Epoch position (global samples) once this micro-batch is consumed."""
    ends_epoch: bool = False
    """It is the epoch's last."""


def epoch_permutation(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The epoch's sample order, identical on every rank and for every world size."""
    if not shuffle:
        return list(range(num_samples))
    generator = torch.Generator()
    # Distinct, reproducible stream per epoch (DistributedSampler's seed + epoch, made collision-free); the
    # packing of earlier versions wherever it is exact, so a checkpoint's position means the same samples.
    generator.manual_seed(derived_seed(seed * 1_000_003 + epoch, 0 <= epoch < 1_000_003, "epoch", seed, epoch))
    return torch.randperm(num_samples, generator=generator).tolist()


@dataclass(frozen=True)
class ShardPlan:
    """How one rank walks the training set: per-rank batch size, rank and world size."""

    num_samples: int
    batch_size: int
    rank: int
    world_size: int
    seed: int = 0
    shuffle: bool = True
    order: Callable[[int, int, bool], Sequence[int]] | None = field(default=None, compare=False)
    """(seed, epoch, shuffle) -> the epoch's sample order; None: `epoch_permutation` (a stream's: mgpu.data.stream)."""

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def micro_batches(self, epoch: int, start: int = 0) -> Iterator[MicroBatch]:
        """This rank's micro-batches of `epoch`, from global position `start` to the end of the epoch."""
        if not 0 <= start <= self.num_samples:
            raise ValueError(f"position {start} outside an epoch of {self.num_samples} samples")
        if self.order is None:
            order: Sequence[int] = epoch_permutation(self.num_samples, self.seed, epoch, self.shuffle)
        else:
            order = self.order(self.seed, epoch, self.shuffle)
            if len(order) != self.num_samples:
                raise ValueError(f"an order of {len(order)} samples for a plan of {self.num_samples}")
        position = start
        while position < self.num_samples:
            count = min(self.global_batch, self.num_samples - position)
            # Even split: the first `count % world` ranks take one sample more.
            base, extra = divmod(count, self.world_size)
            begin = position + self.rank * base + min(self.rank, extra)
            size = base + (1 if self.rank < extra else 0)
            indices = list(order[begin:begin + size])
            real = len(indices)
            if real == 0:
                indices = [order[position]]
            yield MicroBatch(indices, real, count, position + count, position + count >= self.num_samples)
            position += count

    def smallest_micro_batch(self, start: int = 0) -> int:
        """The fewest samples any rank gets in a micro-batch from `start` on (the last one may be short)."""
        rest = (self.num_samples - start) % self.global_batch
        return max(rest // self.world_size, 1) if rest else self.batch_size

    def micro_steps_left(self, start: int) -> int:
        """Micro-steps from `start` to the end of the epoch (the same on every rank)."""
        return -(-(self.num_samples - start) // self.global_batch)


def plan_for(dataset: Any, batch_size: int, rank: int, world_size: int, seed: int, shuffle: bool
             ) -> tuple[Any, ShardPlan]:
    """The map-style dataset a loader indexes and the plan that walks it: `dataset` itself with a global
    permutation per epoch, or for an mgpu.data.stream.ShardedStream its samples by id in the stream's order."""
    from mgpu.data.stream import ShardedStream

    if isinstance(dataset, ShardedStream):
        return dataset.by_id(), ShardPlan(dataset.samples, batch_size, rank, world_size, seed, shuffle, dataset.order)
    return dataset, ShardPlan(len(dataset), batch_size, rank, world_size, seed, shuffle)


def eval_shard(num_samples: int, rank: int, world_size: int) -> list[int]:
    """Rank r evaluates samples r, r+W, ...: no padding, so no sample counts twice."""
    return list(range(rank, num_samples, world_size))
