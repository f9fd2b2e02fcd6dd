"""What each of the trainer's optimizer steps trains on: its `accum` micro-batches, epoch after epoch from where the
run stands (a map-style dataset's plan, or a stateful stream's loader), the DataLoaders that read them (the config's
workers, pinned memory on a GPU, the workers' start method), and a batch moved onto the device."""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from mgpu.config.loading import Config
from mgpu.data.loader import Batches, make_loader
from mgpu.data.sampling import MicroBatch, ShardPlan
from mgpu.data.stream import ShardedStream
from mgpu.data.stream_loader import StatefulStreamLoader
from mgpu.errors import MgpuError
from mgpu.record.check_hooks import record_batch
from mgpu.state.train_state import Progress
from mgpu.train.task import Task

__all__ = ["StepBatches", "to_device"]

Step = list[tuple[MicroBatch, Any]]
"""One optimizer step's micro-batches: (its place in the plan, the batch)."""


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it on `device`: tensors, lists, tuples, namedtuples, mappings (dict,
    defaultdict, OrderedDict, UserDict such as Hugging Face's BatchEncoding, updated in a copy), dataclasses
    (every field, `init=False` ones too)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple takes its fields positionally
        return type(batch)(*(to_device(item, device) for item in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(item, device) for item in batch)
    if isinstance(batch, (dict, collections.UserDict)):
        moved = copy.copy(batch)  # keeps the type and what its constructor needs (a defaultdict's factory)
        for key, value in batch.items():
            moved[key] = to_device(value, device)
        return moved
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        moved = copy.copy(batch)  # type: ignore[assignment]  # a dataclass here, the Mapping branch above
        for f in dataclasses.fields(batch):
            object.__setattr__(moved, f.name, to_device(getattr(batch, f.name), device))  # frozen ones too
        return moved
    return batch


class StepBatches:
    """The loaders of one rank's trainer and the micro-batches of its steps. `stop_requested`: whether this rank
    has a stop to agree on (a loader being started then gives up its workers' start, mgpu.data.loader.Batches)."""

    def __init__(self, cfg: Config, task: Task, rank: int, world: int, device: torch.device,
                 stop_requested: Callable[[], bool]) -> None:
        self.cfg, self.task, self.rank, self.world, self.device = cfg, task, rank, world, device
        self.stop_requested = stop_requested

    def stateful_stream(self, dataset: Any) -> StatefulStreamLoader | None:
        """For an IterableDataset with state_dict()/load_state_dict() (mgpu.train.task.sized_dataset let it through):
        its loader, checkpointed per rank and worker; None for a map-style dataset or a ShardedStream."""
        if not isinstance(dataset, IterableDataset) or isinstance(dataset, ShardedStream):
            return None
        cfg = self.cfg
        if cfg.train.max_steps is None:
            raise MgpuError(f"{type(self.task).__name__}.train_dataset() is a stream without a length "
                            f"({type(dataset).__name__}): set train.max_steps (the run's optimizer steps; the LR "
                            f"schedule needs them); train.epochs stays an upper bound")
        return StatefulStreamLoader(dataset, cfg.data.batch_size, rank=self.rank, world_size=self.world,
                                    seed=cfg.train.seed, num_workers=cfg.data.num_workers,
                                    collate_fn=self.task.collate_fn(), requeue_signal=cfg.preemption.signal,
                                    **self.loader_options())

    def loader(self, dataset: Dataset, batches: list[list[int]], epoch: int, workers: int | None = None) -> DataLoader:
        return make_loader(dataset, batches, num_workers=self.cfg.data.num_workers if workers is None else workers,
                           seed=self.cfg.train.seed, epoch=epoch, rank=self.rank,
                           requeue_signal=self.cfg.preemption.signal, collate_fn=self.task.collate_fn(),
                           **self.loader_options())

    def loader_options(self) -> dict[str, Any]:
        """The DataLoader options of the config: pinned memory on a GPU, the workers' start method."""
        options: dict[str, Any] = {"pin_memory": self.device.type == "cuda"}
        if self.cfg.data.worker_start_method != "default":
            options["multiprocessing_context"] = self.cfg.data.worker_start_method
        return options

    def batches(self, dataset: Dataset, indices: list[list[int]], epoch: int) -> Batches:
        return Batches(lambda start, workers: self.loader(dataset, indices[start:], epoch, workers), len(indices),
                       self.cfg.data.num_workers, self.stop_requested)

    def steps(self, progress: Progress, accum: int, plan: ShardPlan | None, train_set: Dataset | None,
              stream: StatefulStreamLoader | None) -> Iterator[Step]:
        """Groups of `accum` micro-batches, epoch after epoch, from `progress`'s position (read as it advances)."""
        if stream is not None:
            yield from self._stream_steps(stream, accum)
            return
        assert plan is not None and train_set is not None
        while progress.epoch < self.cfg.train.epochs:
            micro = list(plan.micro_batches(progress.epoch, progress.position))
            indices = [m.indices for m in micro]
            batches = self.batches(train_set, indices, progress.epoch)
            group: Step = []
            for index, (mb, batch) in enumerate(zip(micro, batches)):
                record_batch(self.rank, progress.epoch, mb.end_position, batch, mb.indices,
                             self.cfg.data.num_workers)  # check_resume only
                group.append((mb, batch))
                if len(group) == accum or index == len(micro) - 1:
                    yield group
                    group = []

    def _stream_steps(self, stream: StatefulStreamLoader, accum: int) -> Iterator[Step]:
        """As `steps`, for a stateful stream: its position counts this rank's batches of the epoch, and it says at
        an epoch's last batch that it is the last (it looks one batch ahead)."""
        while stream.epoch < self.cfg.train.epochs:
            group: Step = []
            for batch in stream:
                # A streamed sample has no index: `indices` are its places in the batch; all are real.
                group.append((MicroBatch(list(range(stream.last_size)), stream.last_size, stream.last_global_size,
                                         stream.position, stream.position == 0), batch))
                if len(group) == accum or stream.position == 0:
                    yield group
                    group = []
