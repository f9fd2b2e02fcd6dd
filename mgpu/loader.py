"""DataLoaders whose workers survive a stop, and whose randomness survives a resume.

Slurm signals every process of a step (scancel, preemption, requeue, the time limit), DataLoader
workers included. A worker killed by that SIGTERM makes torch raise in the training process wherever
it happens to be (its SIGCHLD handler), inside `backward()` as likely as anywhere, and the stop
checkpoint is never written. So:

- workers ignore SIGTERM, SIGINT and the requeue signal (the training process alone decides when to
  stop): the signals are blocked while a worker is forked and ignored before it unblocks them, so none
  lands in between; workers still exit when the loader is done or the training process dies (torch's
  watchdog), and any left at interpreter exit are SIGKILLed (multiprocessing would SIGTERM and wait for
  them forever);
- torch's SIGCHLD handler is removed: a worker that dies anyway (OOM killer) is found by the loader at
  its next fetch, a step boundary, where `Batches` either re-raises it or, when a stop was already
  requested, finishes the run's last steps loading in the training process;
- a worker draws each sample's randomness from a seed of (seed, epoch, sample index): augmentation is
  the same for a sample whichever worker, rank or run loads it, so a resumed run repeats the
  uninterrupted one exactly. With `num_workers: 0` samples use the training process's own generators,
  which the checkpoint saves.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import multiprocessing
import signal
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from mgpu.preemption import signal_number
from mgpu.rng import derived_seed, seed_everything

__all__ = ["Batches", "ResumableLoader", "SampleSeeded", "StatefulStreamLoader", "is_stateful", "eval_loader", "is_worker_death", "loader_seed", "make_loader", "sample_seed",
           "start"]

log = logging.getLogger("mgpu.train")
_torch_sigchld_removed = False
_reaper_installed = False


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed sample `index` of `epoch` is drawn under in a worker: (seed, epoch, index) packed as in earlier
    versions while that is exact and fits torch's seed range, else hashed (see mgpu.rng.derived_seed)."""
    packed = (seed * 1_000_003 + epoch) * 1_000_000_007 + index
    return derived_seed(packed, epoch < 1_000_003 and 0 <= index < 1_000_000_007, "sample", seed, epoch, index)


def loader_seed(seed: int, epoch: int, rank: int) -> int:
    """The seed of a loader's own generator (its workers' base seed), one per (seed, epoch, rank)."""
    return derived_seed(seed * 1_000_003 + epoch * 1009 + rank, 0 <= rank < 1009 and epoch * 1009 + rank < 1_000_003,
                        "loader", seed, epoch, rank)


class SampleSeeded(Dataset):
    """`dataset` whose items, in a worker process, are drawn under a seed of (seed, epoch, index)."""

    def __init__(self, dataset: Dataset, seed: int, epoch: int) -> None:
        self.dataset, self.seed, self.epoch = dataset, seed, epoch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # torch's Dataset declares no __len__

    def __getitem__(self, index: int) -> Any:
        if get_worker_info() is not None:
            seed_everything(sample_seed(self.seed, self.epoch, int(index)))
        return self.dataset[index]


def _quiet_worker(signals: tuple[int, ...], then: Callable[[int], None] | None, worker_id: int) -> None:
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)  # a signal pending since the fork is discarded here
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    if then is not None:
        then(worker_id)  # the caller's own worker_init_fn


def _stop_signals(requeue_signal: str) -> tuple[int, ...]:
    return signal.SIGTERM, signal.SIGINT, signal_number(requeue_signal)


def _reap_workers() -> None:
    # At exit, multiprocessing SIGTERMs daemonic children and joins them: ours ignore SIGTERM.
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def _drop_torch_sigchld() -> None:
    """Remove torch's SIGCHLD handler (installed by the first worker iterator, once per process)."""
    global _torch_sigchld_removed
    handler = signal.getsignal(signal.SIGCHLD)
    if not _torch_sigchld_removed and getattr(handler, "__module__", "") == "torch.utils.data._utils.signal_handling":
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _torch_sigchld_removed = True


def make_loader(dataset: Dataset, batches: Sequence[Sequence[int]] | None, *, num_workers: int, seed: int, epoch: int,
                rank: int, requeue_signal: str, collate_fn: Callable[[list[Any]], Any] | None,
                pin_memory: bool = False, **options: Any) -> DataLoader:
    """A loader over the given index `batches` (already this rank's share of the epoch); `batches` None: an
    iterable `dataset` that yields whole batches itself."""
    global _reaper_installed
    # An own generator: creating an iterator draws a base seed, and from the global RNG that draw would
    # shift dropout's stream differently in a resumed run than in an unbroken one.
    generator = torch.Generator().manual_seed(loader_seed(seed, epoch, rank))
    extra: dict[str, Any] = dict(options)
    if num_workers > 0:
        extra["worker_init_fn"] = functools.partial(_quiet_worker, _stop_signals(requeue_signal),
                                                    extra.get("worker_init_fn"))
        if batches is not None:
            dataset = SampleSeeded(dataset, seed, epoch)
        if not _reaper_installed:
            atexit.register(_reap_workers)
            _reaper_installed = True
    batching: dict[str, Any] = {"batch_sampler": batches} if batches is not None else {"batch_size": None}
    return DataLoader(dataset, num_workers=num_workers, collate_fn=collate_fn, pin_memory=pin_memory,
                      generator=generator, **batching, **extra)


def is_worker_death(error: BaseException) -> bool:
    """A DataLoader worker that exited or was killed (not an exception raised by the dataset's code)."""
    return isinstance(error, RuntimeError) and "DataLoader worker" in str(error) and (
        "exited unexpectedly" in str(error) or "killed by signal" in str(error))


def start(loader: DataLoader, requeue_signal: str) -> Iterator[Any]:
    """`iter(loader)`, its workers forked with the stop signals blocked (see `_quiet_worker`)."""
    if not loader.num_workers:
        return iter(loader)
    signals = _stop_signals(requeue_signal)
    # Only this thread's mask: the process still receives the signals (on another thread if need be).
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        iterator = iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    _drop_torch_sigchld()
    return iterator


class Batches:
    """Iterate a loader; if a worker dies once a stop is requested, go on in-process from that batch.

    `build(start, workers)` makes a loader over the batches from index `start`; `stopping()` says
    whether a stop is requested on this rank (the ranks' agreement then ends the run a few steps later).
    """

    def __init__(self, build: Callable[[int, int], DataLoader], count: int, workers: int,
                 stopping: Callable[[], bool], requeue_signal: str) -> None:
        self.build, self.count, self.workers, self.stopping = build, count, workers, stopping
        self.requeue_signal = requeue_signal

    def __iter__(self) -> Iterator[Any]:
        index, workers = 0, self.workers
        while index < self.count:
            iterator = start(self.build(index, workers), self.requeue_signal)
            try:
                for batch in iterator:
                    index += 1
                    yield batch
                return
            except RuntimeError as error:
                if not (workers and is_worker_death(error) and self.stopping()):
                    raise
                log.warning("%s after a stop was requested: loading the rest in this process", error)
                workers = 0
            finally:
                del iterator


class ResumableLoader:
    """A DataLoader for a loop of your own: this rank's share of each epoch, resumable at the exact sample.

    Every epoch is one order of the whole dataset (a function of seed and epoch only: a permutation for a
    map-style dataset, mgpu.data; a shard order and a rebuilt shuffle buffer for an mgpu.stream.ShardedStream);
    rank r takes the r-th slice of each global batch (`batch_size` samples per rank), and `position` counts
    the global samples consumed, so a checkpoint taken between two batches resumes at the next one on any
    number of ranks and workers. Iterate it once per epoch (or `for epoch in loader.epochs(N)`);
    `state_dict()` goes into the session's checkpoint with the model. Workers survive the step's signals
    and seed each sample from (seed, epoch, sample), as the trainer's do. `dataloader_options` go to each
    epoch's torch DataLoader (pin_memory, prefetch_factor, persistent_workers, ...; not the sampler,
    shuffle or batch options: this loader owns the order).

    The last global batch of an epoch may be short: it is split as evenly as possible, and a rank left
    with nothing gets one sample again (weight 0 in the trainer; `last.real` says how many of a batch are
    real). `drop_last=True` drops that batch instead.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, rank: int, world_size: int, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False, num_workers: int = 0,
                 collate_fn: Callable[[list[Any]], Any] | None = None, requeue_signal: str = "USR2",
                 stopping: Callable[[], bool] = lambda: False, agreed: Callable[[], bool] = lambda: False,
                 **dataloader_options: Any) -> None:
        """`stopping()`: a stop is requested on this rank (a worker that dies then is not a crash); `agreed()`:
        the ranks agreed to stop (`epochs()` ends)."""
        from mgpu.data import plan_for
        from mgpu.stream import ShardedStream

        for option in ("sampler", "batch_sampler", "shuffle", "batch_size", "drop_last", "generator"):
            if option in dataloader_options:
                raise ValueError(f"ResumableLoader owns the sample order: {option}= is not an option here")
        self.stream_fingerprint = dataset.fingerprint() if isinstance(dataset, ShardedStream) else None
        self.stream = dataset if isinstance(dataset, ShardedStream) else None
        self.dataset, self.plan = plan_for(dataset, batch_size, rank, world_size, seed, shuffle)
        self.num_workers, self.collate_fn = num_workers, collate_fn
        self.drop_last, self.requeue_signal, self.stopping, self.agreed = drop_last, requeue_signal, stopping, agreed
        self.options = dataloader_options
        self.epoch = 0
        self.position = 0
        """Global samples of `epoch` consumed so far (all ranks together)."""
        self.start_position = 0
        """Where this process's pass over `epoch` began: 0, or the position a resumed run starts from. An
        epoch's mean over what this run saw covers `position - start_position` samples, not the epoch's."""
        self.last: Any = None
        """The `mgpu.data.MicroBatch` of the batch yielded last: its indices, real samples, global count."""

    @property
    def samples_per_epoch(self) -> int:
        """Global samples one whole epoch trains on (the short last batch left out with drop_last)."""
        n = self.plan.num_samples
        return n - n % self.plan.global_batch if self.drop_last else n

    def _batches_from(self, start: int) -> int:
        """How many micro-batches are left from global position `start` (the same on every rank)."""
        return -(-(self.samples_per_epoch - start) // self.plan.global_batch) if start < self.samples_per_epoch else 0

    def _micro_batches(self, start: int) -> Iterator[Any]:
        # Lazy: a stream's epoch may hold millions of samples, and a resume must not walk them.
        for m in self.plan.micro_batches(self.epoch, start):
            if self.drop_last and m.global_count < self.plan.global_batch:
                return
            yield m

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank (the same on every rank)."""
        return self._batches_from(0)

    def __iter__(self) -> Iterator[Any]:
        self.start_position = self.position
        position = self.position

        def build(start: int, workers: int) -> DataLoader:
            indices = _IndexBatches(lambda: (m.indices for m in itertools.islice(self._micro_batches(position),
                                                                                 start, None)))
            return make_loader(self.dataset, indices, num_workers=workers, seed=self.plan.seed,  # type: ignore[arg-type]  # index sequences; the stub wants lists
                               epoch=self.epoch, rank=self.plan.rank, requeue_signal=self.requeue_signal,
                               collate_fn=self.collate_fn, **self.options)

        count = self._batches_from(position)
        batches = Batches(build, count, self.num_workers, self.stopping, self.requeue_signal)
        for mb, batch in zip(self._micro_batches(position), batches):
            self.last, self.position = mb, mb.end_position
            yield batch
        # Only a loop that ran to the end of the epoch gets here (a `break` leaves the position as it is).
        self.epoch, self.position = self.epoch + 1, 0

    def epochs(self, count: int) -> Iterator[int]:
        """The epochs left of `count`, from where a resumed run stands; ends early once the ranks agreed
        to stop (so `break` out of the batch loop is enough)."""
        while self.epoch < count and not self.agreed():  # a stop only requested may not be every rank's yet
            yield self.epoch

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler's call: a new epoch starts at its first sample; the current one (a resumed
        run's) continues where it stands."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "position": self.position}
        if self.stream is not None:
            state.update(samples=self.plan.num_samples, stream=self.stream_fingerprint, files=self.stream.manifest())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("files") is not None and self.stream is not None:
            from mgpu.stream import check_files

            check_files(state["files"], self.stream, log.warning)  # names the file that changed
        saved = state.get("stream")
        if saved is not None and saved != self.stream_fingerprint:
            from mgpu.stream import StreamError

            now = "a map-style dataset" if self.stream_fingerprint is None else \
                f"a stream of {self.plan.num_samples} samples ({self.stream_fingerprint})"
            raise StreamError(f"the checkpoint's loader read a stream of {state.get('samples')} samples ({saved}), "
                              f"this run gives {now}: the same files (names, order, sizes) are needed to resume "
                              "at the exact sample")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class _IndexBatches:
    """A batch sampler made on each iteration by `make()` (lazy, so a resume deep in an epoch is O(1))."""

    def __init__(self, make: Callable[[], Iterator[list[int]]]) -> None:
        self.make = make

    def __iter__(self) -> Iterator[list[int]]:
        return self.make()


def is_stateful(dataset: Any) -> bool:
    """torchdata's Stateful protocol: `state_dict()` and `load_state_dict(state)`."""
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


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

    # One state per rank: mgpu.train_state gathers every rank's `rank_state_dict()` into the checkpoint.
    def rank_state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "workers": max(self.num_workers, 1),
                "next": self._next, "states": self._states}

    def state_dict(self) -> dict[str, Any]:
        return {"per_rank": [self.rank_state_dict()]}  # a world of one; mgpu fills every rank's in a job

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from mgpu.stream import StreamError

        ranks = state.get("per_rank")
        if ranks is None:
            raise StreamError("the checkpoint's loader was not a stateful stream's: the same dataset is needed to resume")
        if len(ranks) != self.world_size:
            raise StreamError(f"the stream's state was saved by {len(ranks)} rank(s), this run has {self.world_size}: "
                              "a Stateful dataset's per-rank position cannot be split or merged; resume on "
                              f"{len(ranks)} rank(s), or read files through mgpu.stream.ShardedStream (any world size)")
        mine = ranks[self.rank]
        if mine["states"] is not None and mine["workers"] != max(self.num_workers, 1):
            raise StreamError(f"the stream's state was saved by {mine['workers']} DataLoader worker(s) per rank, "
                              f"this run has num_workers={self.num_workers}: a per-worker state cannot be split or "
                              f"merged; resume with num_workers={mine['workers']}, or use mgpu.stream.ShardedStream")
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
        yield from start(loader, self.requeue_signal)

    def __iter__(self) -> Iterator[Any]:
        self.start_position = self.position
        workers = max(self.num_workers, 1)
        if self.position == 0:
            self._states, self._next = [None] * workers, 0
        batches = self._batches()
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
            if item is None:
                self._end_epoch()
            yield batch

    def _end_epoch(self) -> None:
        self.epoch, self.position, self._states, self._next = self.epoch + 1, 0, None, 0

    def epochs(self, count: int) -> Iterator[int]:
        """As ResumableLoader.epochs."""
        while self.epoch < count and not self.agreed():
            yield self.epoch


def _first(item: Any) -> Any:
    return item  # batch_size=None: the worker already collated


def open_loader(dataset: Any, batch_size: int, **options: Any) -> ResumableLoader | StatefulStreamLoader:
    """The loader a Session gives `dataset`: a ResumableLoader for a map-style dataset or an mgpu.stream.ShardedStream
    (exact on any world size and worker count), a StatefulStreamLoader for another IterableDataset with the
    Stateful protocol; another IterableDataset is refused in one line (mgpu.stream.StreamError), and so is
    anything else that is not a map-style dataset (MgpuError)."""
    from torch.utils.data import IterableDataset

    from mgpu.errors import MgpuError
    from mgpu.stream import ShardedStream, StreamError

    if not isinstance(dataset, IterableDataset) and not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise MgpuError(f"Session.loader() takes a dataset with len() and [index] (a map-style Dataset) or an "
                        f"IterableDataset (mgpu.stream.ShardedStream, or one with state_dict()), got a "
                        f"{type(dataset).__name__}: an iterator cannot say where a resume starts")
    if isinstance(dataset, IterableDataset) and not isinstance(dataset, ShardedStream):
        if not is_stateful(dataset):
            raise StreamError(f"{type(dataset).__name__} is an IterableDataset without state_dict()/load_state_dict(): "
                              "a resume could not find where it stopped; give it that protocol (torchdata's Stateful), "
                              "or read its files through mgpu.stream.ShardedStream")
        options.pop("shuffle", None)  # the stream's own order
        return StatefulStreamLoader(dataset, batch_size, **options)
    return ResumableLoader(dataset, batch_size, **options)


def eval_loader(dataset: Dataset, batch_size: int, *, rank: int, world_size: int, seed: int, requeue_signal: str,
                num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None, **options: Any) -> DataLoader:
    """This rank's share of an evaluation set (mgpu.data.eval_shard: samples rank, rank + W, ...), in batches."""
    from mgpu.data import eval_shard

    indices = eval_shard(len(dataset), rank, world_size)  # type: ignore[arg-type]  # torch's Dataset declares no __len__
    batches = [indices[i:i + batch_size] for i in range(0, len(indices), batch_size)]
    return make_loader(dataset, batches, num_workers=num_workers, seed=seed, epoch=0, rank=rank,
                       requeue_signal=requeue_signal, collate_fn=collate_fn, **options)
