"""Loaders for IterableDatasets that keep their own position: `StatefulStreamLoader` for a dataset with the
Stateful protocol (`state_dict()`/`load_state_dict()`: a Hugging Face streaming dataset, a torchdata node, your
own), checkpointed per rank and per DataLoader worker; and `open_loader`, the loader a dataset gets (this one,
or mgpu.data.loader.ResumableLoader for a map-style dataset or an mgpu.data.stream.ShardedStream).

Workers are mgpu.data.loader's (they survive the step's signals); only the state bookkeeping is here.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import get_worker_info

from mgpu.record.check_hooks import record_batch
from mgpu.data.loader import ResumableLoader, check_loader_args, make_loader

__all__ = ["StatefulStreamLoader", "is_stateful", "open_loader", "shuffle_buffer"]

log = logging.getLogger("mgpu.train")


def is_stateful(dataset: Any) -> bool:
    """torchdata's Stateful protocol: `state_dict()` and `load_state_dict(state)`."""
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def shuffle_buffer(dataset: Any, depth: int = 6) -> tuple[str, int] | None:
    """(its class, its size) when `dataset` shuffles through a buffer: an object in its chain of wrapped
    iterables (Hugging Face's `_ex_iterable`/`ex_iterable`, torchdata's `source_datapipe`/`source`/`dataset`)
    whose class name says it shuffles and that has a `buffer_size`. Such a buffer is not in the state
    `state_dict()` returns (Hugging Face's `BufferShuffledExamplesIterable`): a resume loses its samples."""
    seen: set[int] = set()
    node = dataset
    for _ in range(depth):
        if node is None or id(node) in seen:
            return None
        seen.add(id(node))
        size = getattr(node, "buffer_size", None)
        if "shuffl" in type(node).__name__.lower() and isinstance(size, int) and size > 1:
            return type(node).__name__, size
        node = next((getattr(node, name) for name in ("_ex_iterable", "ex_iterable", "source_datapipe", "source",
                                                      "dataset") if getattr(node, name, None) is not None), None)
    return None


def _act_as_worker(logical: int) -> None:
    """Make this DataLoader worker report `logical` as its id (torch.utils.data.get_worker_info()), reseeded as
    that worker: a dataset that splits its shards by worker id reads logical worker `logical`'s share.

    Why: torch hands out an iterable dataset's batches round-robin from worker 0; a resumed loader whose next
    batch is worker j's renumbers its workers so that j is asked first (the unbroken run's order)."""
    import random

    from torch.utils.data._utils import worker as torch_worker

    info = get_worker_info()
    assert info is not None
    seed = info.seed - info.id + logical
    torch_worker._worker_info = torch_worker.WorkerInfo(id=logical, num_workers=info.num_workers, seed=seed,
                                                        dataset=info.dataset)
    torch.manual_seed(seed)
    random.seed(seed)


class _WorkerBatches(torch.utils.data.IterableDataset):
    """In each worker: the user's stream from its saved state, batched there, each batch sent with the
    stream's state after it (so the training process knows every worker's state at the batch it trains on)."""

    def __init__(self, dataset: Any, batch_size: int, collate_fn: Callable[[list[Any]], Any], drop_last: bool,
                 states: list[Any] | None, first: int) -> None:
        self.dataset, self.batch_size, self.collate_fn, self.drop_last = dataset, batch_size, collate_fn, drop_last
        self.states, self.first = states, first

    def __iter__(self) -> Iterator[tuple[Any, int, Any, int]]:
        info = get_worker_info()
        assert info is not None
        logical = (info.id + self.first) % info.num_workers
        _act_as_worker(logical)
        state = None if self.states is None else self.states[logical]  # None: it had sent no batch yet
        yield from _batched(self.dataset, state, self.batch_size, self.collate_fn, self.drop_last, logical)


_ENDED = "ended"
"""A worker's state once its stream ended inside a short batch: the dataset's own state may already be its next
epoch's start (the protocol says nothing about a finished iterator), so the loader remembers the end itself."""


def _batched(dataset: Any, state: Any, batch_size: int, collate_fn: Callable[[list[Any]], Any], drop_last: bool,
             worker: int) -> Iterator[tuple[Any, int, Any, int]]:
    """`dataset` from `state` (None: as it is), in batches, each with the dataset's state after it and its size."""
    if state == _ENDED:
        return
    if state is not None:
        dataset.load_state_dict(state)
    samples = iter(dataset)
    while True:
        batch = list(itertools.islice(samples, batch_size))
        if not batch or (drop_last and len(batch) < batch_size):
            return
        yield collate_fn(batch), worker, _ENDED if len(batch) < batch_size else dataset.state_dict(), len(batch)


class StatefulStreamLoader:
    """A loop's loader over an IterableDataset that has `state_dict()`/`load_state_dict()` (torchdata's
    Stateful protocol: a Hugging Face streaming dataset, a torchdata node, your own): checkpointed per rank,
    and per DataLoader worker, at the step the ranks agreed on, and resumed there.

    Each rank iterates its own copy: sharding over ranks is the dataset's (e.g. `split_dataset_by_node`), over
    workers too (`get_worker_info()`). An epoch ends on every rank when one rank's stream ends (an all-reduce
    per batch: DDP needs every rank in every step); what the other ranks had left that epoch is skipped and
    counted in `skipped_at_end`. A resume needs the same world size and worker count (0 and 1 are the same):
    a per-worker state cannot be split or merged, and the loader refuses in one line. Batches are the unbroken
    run's when the dataset's iteration is a function of its state; per-sample randomness in workers is not
    replayed (it draws from the worker's seed, reset by a resume).
    """

    def __init__(self, dataset: Any, batch_size: int, *, rank: int, world_size: int, seed: int = 0,
                 drop_last: bool = False, num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None,
                 requeue_signal: str = "USR2", stopping: Callable[[], bool] = lambda: False,
                 agreed: Callable[[], bool] = lambda: False, **dataloader_options: Any) -> None:
        from torch.utils.data import default_collate

        for option in ("sampler", "batch_sampler", "shuffle", "batch_size", "drop_last", "generator"):
            if option in dataloader_options:
                raise ValueError(f"the stream's loader batches it itself: {option}= is not an option here")
        check_loader_args(batch_size, num_workers)
        self.dataset, self.batch_size, self.rank, self.world_size, self.seed = dataset, batch_size, rank, world_size, seed
        self.drop_last, self.num_workers = drop_last, num_workers
        self.collate_fn = collate_fn or default_collate
        self.requeue_signal, self.stopping, self.agreed, self.options = requeue_signal, stopping, agreed, dataloader_options
        self.epoch = 0
        self.position = 0
        """Batches of `epoch` this rank has consumed."""
        self.start_position = 0
        """Batches of `epoch` consumed before this process's pass over it began (a resumed run's start)."""
        self.skipped_at_end = 0
        self.last_size = 0
        """Samples in the batch handed out last (a stream's batches may be short: a worker's last one)."""
        self.last_global_size = 0
        """Samples in that step's batches on all ranks together."""
        self._states: Any = None  # the dataset's state after the last consumed batch (per worker: a list)
        self._next = 0  # the worker whose batch comes next
        buffer = shuffle_buffer(dataset)
        if buffer is not None and rank == 0:
            log.warning("%s shuffles through a buffer of %d samples (%s) that its state_dict() does not hold: a "
                        "resume loses the samples in it and trains others twice; shuffle without a buffer (the "
                        "shard order, or a map-style dataset) or read the files through mgpu.data.stream.ShardedStream, "
                        "which rebuilds its buffer on a resume", type(dataset).__name__, buffer[1], buffer[0])

    # One state per rank: mgpu.state.train_state gathers every rank's `rank_state_dict()` into the checkpoint.
    def rank_state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "workers": max(self.num_workers, 1),
                "num_workers": self.num_workers, "next": self._next, "states": self._states}

    def state_dict(self) -> dict[str, Any]:
        return {"per_rank": [self.rank_state_dict()]}  # a world of one; mgpu fills every rank's in a job

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from mgpu.data.stream import StreamError

        ranks = state.get("per_rank")
        if ranks is None:
            raise StreamError("the checkpoint's loader was not a stateful stream's: the same dataset is needed to resume")
        if len(ranks) != self.world_size:
            raise StreamError(f"the stream's state was saved by {len(ranks)} rank(s), this run has {self.world_size}: "
                              "a Stateful dataset's per-rank position cannot be split or merged; resume on "
                              f"{len(ranks)} rank(s), or read files through mgpu.data.stream.ShardedStream (any world size)")
        mine = ranks[self.rank]
        if mine["states"] is not None and mine["workers"] != max(self.num_workers, 1):
            # 0 workers (the stream read in the training process) keeps one state, as 1 worker does: either resumes.
            saved = mine.get("num_workers", mine["workers"])
            same = "0 or 1" if mine["workers"] == 1 else str(mine["workers"])
            raise StreamError(f"the stream's state was saved with num_workers={saved} per rank, this run has "
                              f"num_workers={self.num_workers}: a per-worker state cannot be split or merged; resume "
                              f"with num_workers={same}, or use mgpu.data.stream.ShardedStream")
        self.epoch, self.position, self._next, self._states = mine["epoch"], mine["position"], mine["next"], mine["states"]

    def _agree(self, item: tuple[Any, int, Any, int] | None) -> tuple[Any, int, Any, int, int] | None:
        """`item` with the size of the global batch it belongs to, or None when any rank's stream ended (one
        all-reduce: DDP needs every rank in every step)."""
        import torch.distributed as dist

        counts = [1.0 if item is None else 0.0, 0.0 if item is None else float(item[3])]
        if self.world_size > 1 and dist.is_initialized():
            flag = torch.tensor(counts, dtype=torch.float64)
            dist.all_reduce(flag)
            counts = flag.tolist()
        if counts[0]:
            self.skipped_at_end += item is not None
            return None
        assert item is not None
        return (*item, int(counts[1]))

    def _batches(self) -> Iterator[tuple[Any, int, Any, int]]:
        resuming = self.position > 0
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        if not self.num_workers:
            yield from _batched(self.dataset, self._states[0] if resuming else None, self.batch_size,
                                self.collate_fn, self.drop_last, 0)
            return
        first = self._next if resuming else 0
        states = self._states if resuming else None
        loader = make_loader(_WorkerBatches(self.dataset, self.batch_size, self.collate_fn, self.drop_last, states,
                                            first),
                             None, num_workers=self.num_workers, seed=self.seed, epoch=self.epoch, rank=self.rank,
                             requeue_signal=self.requeue_signal, collate_fn=_first, **self.options)
        yield from loader

    def __iter__(self) -> Iterator[Any]:
        self.start_position = self.position
        workers = max(self.num_workers, 1)
        if self.position == 0:
            self._states, self._next = [None] * workers, 0
        batches = self._batches() if self.position == 0 else self._resumed(self._batches())
        # One batch ahead: when a batch is handed out it is known whether it ends the epoch, so the state after
        # it (what a checkpoint then holds) is already the next epoch's start, and a trainer knows an epoch's end
        # at its last step. The ranks' agreement on the next batch comes one step early, the same on every rank.
        item = self._agree(next(batches, None))
        if item is None:  # an epoch without a batch (or a resume at its very end)
            self._end_epoch()
        while item is not None:
            batch, worker, state, size, global_size = item
            item = self._agree(next(batches, None))
            self._states[worker] = state
            self._next = (worker + 1) % workers
            self.position += 1
            self.last_size, self.last_global_size = size, global_size
            record_batch(self.rank, self.epoch, self.position, batch, workers=self.num_workers)  # check_resume only
            if item is None:
                self._end_epoch()
            yield batch

    def _resumed(self, batches: Iterator[tuple[Any, int, Any, int]]) -> Iterator[tuple[Any, int, Any, int]]:
        """`batches` of a resumed epoch: a failure on its first batch is the stream's state not fitting (one line)."""
        from mgpu.data.stream import StreamError

        try:
            first = next(batches, None)
        except Exception as error:  # noqa: BLE001  (whatever the user's stream raises, said in one line)
            cause = str(error).strip().splitlines()
            said = cause[-1] if cause else type(error).__name__
        else:
            said = ""
        if said:  # outside the handler: the error's frames (the workers' iterator) are let go
            where = f" under {self.num_workers} DataLoader workers" if self.num_workers else ""
            raise StreamError(f"{type(self.dataset).__name__} failed on its first batch after a resume{where} "
                              f"({said}): its load_state_dict() does not resume there; resume with num_workers=0, "
                              "or read the files through mgpu.data.stream.ShardedStream (exact on any worker count)")
        if first is not None:
            yield first
            yield from batches

    def _end_epoch(self) -> None:
        self.epoch, self.position, self._states, self._next = self.epoch + 1, 0, None, 0

    def epochs(self, count: int) -> Iterator[int]:
        """As ResumableLoader.epochs."""
        while self.epoch < count and not self.agreed():
            yield self.epoch


def _first(item: Any) -> Any:
    return item  # batch_size=None: the worker already collated


def open_loader(dataset: Any, batch_size: int, **options: Any) -> ResumableLoader | StatefulStreamLoader:
    """The loader a Session gives `dataset`: a ResumableLoader for a map-style dataset or an mgpu.data.stream.ShardedStream
    (exact on any world size and worker count), a StatefulStreamLoader for another IterableDataset with the
    Stateful protocol; another IterableDataset is refused in one line (mgpu.data.stream.StreamError), and so is
    anything else that is not a map-style dataset (MgpuError)."""
    from torch.utils.data import IterableDataset

    from mgpu.errors import MgpuError
    from mgpu.data.stream import ShardedStream, StreamError

    if not isinstance(dataset, IterableDataset) and not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise MgpuError(f"Session.loader() takes a dataset with len() and [index] (a map-style Dataset) or an "
                        f"IterableDataset (mgpu.data.stream.ShardedStream, or one with state_dict()), got a "
                        f"{type(dataset).__name__}: an iterator cannot say where a resume starts")
    if isinstance(dataset, IterableDataset) and not isinstance(dataset, ShardedStream):
        if not is_stateful(dataset):
            raise StreamError(f"{type(dataset).__name__} is an IterableDataset without state_dict()/load_state_dict(): "
                              "a resume could not find where it stopped; give it that protocol (torchdata's Stateful), "
                              "or read its files through mgpu.data.stream.ShardedStream")
        options.pop("shuffle", None)  # the stream's own order
        return StatefulStreamLoader(dataset, batch_size, **options)
    return ResumableLoader(dataset, batch_size, **options)
