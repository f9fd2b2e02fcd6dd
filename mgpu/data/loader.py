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
- workers are forked with the training process's objects frozen (`gc.freeze()`): a worker's garbage collector
  never finalizes the parent's garbage, whose destructors may need the parent's threads (a destroyed gloo
  group still held by a reference cycle, e.g. an FSDP2 model dropped after `Session.finish()`: its
  destructor joins gloo threads the fork did not copy, and the worker segfaults or hangs);
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
import contextlib
import functools
import gc
import itertools
import logging
import multiprocessing
import os
import signal
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from mgpu.data import worker_start
from mgpu.record.check_hooks import record_batch
from mgpu.stop.preemption import signal_number
from mgpu.state.rng import derived_seed, seed_everything

__all__ = ["Batches", "ResumableLoader", "SampleSeeded", "WorkerSafeLoader", "eval_loader", "is_worker_death", "loader_seed", "make_loader",
           "sample_seed", "start"]

log = logging.getLogger("mgpu.train")
_torch_sigchld_removed = False
_reaper_installed = False
_hazard_said = False
_WORKER_ONLY = ("multiprocessing_context", "prefetch_factor", "persistent_workers", "worker_init_fn")
"""DataLoader options it refuses without workers."""


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed sample `index` of `epoch` is drawn under in a worker: (seed, epoch, index) packed as in earlier
    versions while that is exact and fits torch's seed range, else hashed (see mgpu.state.rng.derived_seed)."""
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
    worker_start.mark(worker_id)  # first: this worker reached Python after its fork
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


WORKERS_PER_CPU = 4
"""The most DataLoader workers a rank may ask for, per CPU this process may run on (at least MIN_WORKER_CAP): more
only queue for the same cores, and a typo (100000) forked until the machine ran out of memory and processes."""
MIN_WORKER_CAP = 8


def check_loader_args(batch_size: Any, num_workers: Any, where: str = "Session.loader") -> None:
    """MgpuError in one line for a batch size that is not a whole number >= 1, or a worker count that is not a whole
    number from 0 to this machine's cap (WORKERS_PER_CPU per usable CPU)."""
    from mgpu.errors import MgpuError

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise MgpuError(f"{where}(batch_size={batch_size!r}): a batch holds a whole number of samples, at least 1 "
                        f"(per rank per step)")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise MgpuError(f"{where}(num_workers={num_workers!r}): give a whole number of DataLoader workers, 0 or more "
                        f"(0: load in the training process)")
    cap = worker_cap()
    if num_workers > cap:
        raise MgpuError(f"{where}(num_workers={num_workers}): more DataLoader worker processes per rank than this "
                        f"machine can run ({cap}: {WORKERS_PER_CPU} per usable CPU); use at most {cap}")


def worker_cap() -> int:
    """The most DataLoader workers one rank may start here (see WORKERS_PER_CPU)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(MIN_WORKER_CAP, WORKERS_PER_CPU * cpus)


def make_loader(dataset: Dataset, batches: Sequence[Sequence[int]] | None, *, num_workers: int, seed: int, epoch: int,
                rank: int, requeue_signal: str, collate_fn: Callable[[list[Any]], Any] | None,
                pin_memory: bool = False, **options: Any) -> DataLoader:
    """A loader over the given index `batches` (already this rank's share of the epoch); `batches` None: an
    iterable `dataset` that yields whole batches itself."""
    global _reaper_installed
    if num_workers > worker_cap():  # the trainer's data.num_workers (a loop's was checked by its loader)
        check_loader_args(1, num_workers, "data.num_workers: DataLoader")
    # An own generator: creating an iterator draws a base seed, and from the global RNG that draw would
    # shift dropout's stream differently in a resumed run than in an unbroken one.
    generator = torch.Generator().manual_seed(loader_seed(seed, epoch, rank))
    extra: dict[str, Any] = dict(options)
    if num_workers == 0:  # in-process (asked for, or the fallback after a worker died): the workers' options refused
        for option in _WORKER_ONLY:
            extra.pop(option, None)
    if num_workers > 0:
        extra["worker_init_fn"] = functools.partial(_quiet_worker, _stop_signals(requeue_signal),
                                                    extra.get("worker_init_fn"))
        if batches is not None:
            dataset = SampleSeeded(dataset, seed, epoch)
        if not _reaper_installed:
            atexit.register(_reap_workers)
            _reaper_installed = True
    batching: dict[str, Any] = {"batch_sampler": batches} if batches is not None else {"batch_size": None}
    loader = WorkerSafeLoader(dataset, num_workers=num_workers, collate_fn=collate_fn, pin_memory=pin_memory,
                              generator=generator, **batching, **extra)
    loader.requeue_signal, loader.rank = requeue_signal, rank
    return loader


def is_worker_death(error: BaseException) -> bool:
    """A DataLoader worker that exited or was killed (not an exception raised by the dataset's code)."""
    return isinstance(error, RuntimeError) and "DataLoader worker" in str(error) and (
        "exited unexpectedly" in str(error) or "killed by signal" in str(error))


class WorkerSafeLoader(DataLoader):
    """The DataLoader mgpu hands out (`make_loader`: the trainer's, `session.loader`'s, `session.eval_loader`'s):
    every iterator's workers start through `start`, however it is iterated (a `for` over it, `iter()`)."""

    requeue_signal = "USR2"
    rank = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # torch declares _BaseDataLoaderIter
        if not self.num_workers:
            return super().__iter__()
        return start(self, self.requeue_signal)


def start(loader: DataLoader, requeue_signal: str) -> Iterator[Any]:
    """`iter(loader)`, its workers started with the stop signals blocked (see `_quiet_worker`), whatever the start
    method; forked workers on a CPython with gh-112275 watched, and forked again if one never reached Python
    (mgpu.data.worker_start)."""
    if not loader.num_workers:
        return DataLoader.__iter__(loader)
    ours = isinstance(loader.worker_init_fn, functools.partial) and loader.worker_init_fn.func is _quiet_worker
    if not (ours and worker_start.guarded(loader)):
        return _fork(loader, requeue_signal)
    _say_the_hazard_once(getattr(loader, "rank", 0))
    kept = getattr(loader, "_iterator", None) if loader.persistent_workers else None  # reused: nothing forks
    rewind = loader.generator.get_state() if loader.generator is not None else None
    for attempt in range(1, worker_start.FORK_ATTEMPTS + 1):
        marks = worker_start.Marks(loader.num_workers)
        try:
            with marks:
                iterator = _fork(loader, requeue_signal)
            if kept is not None and iterator is kept:
                return iterator
            late = marks.wait(getattr(iterator, "_workers", []))
            if not late:
                return iterator
            pids = worker_start.kill_workers(iterator)
        finally:
            marks.close()
        log.warning("DataLoader worker(s) %s (pids %s) had not reached Python %.0f s after their fork (CPython "
                    "gh-112275: the after-fork code waits forever on a lock another thread held at the fork): "
                    "killed%s", late, pids, worker_start.STARTED_WITHIN_S,
                    f", forking the workers again ({attempt + 1} of {worker_start.FORK_ATTEMPTS})"
                    if attempt < worker_start.FORK_ATTEMPTS else "")
        if rewind is not None:  # the same base seed as the first try drew
            loader.generator.set_state(rewind)
    raise RuntimeError(f"DataLoader workers did not start: {worker_start.FORK_ATTEMPTS} forks in a row left a worker "
                       f"that had not reached Python after {worker_start.STARTED_WITHIN_S:.0f} s")


def _say_the_hazard_once(rank: int) -> None:
    global _hazard_said
    if not _hazard_said and rank == 0:
        log.warning(worker_start.hazard_line())
    _hazard_said = True


def _fork(loader: DataLoader, requeue_signal: str) -> Iterator[Any]:
    signals = _stop_signals(requeue_signal)
    # Only this thread's mask: the process still receives the signals (on another thread if need be).
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        with _parents_objects_frozen():
            iterator = DataLoader.__iter__(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    _drop_torch_sigchld()
    return iterator


@contextlib.contextmanager
def _parents_objects_frozen() -> Iterator[None]:
    """Fork (the workers) with every object of this process frozen, so that no worker's garbage collector
    finalizes one. A fork copies the memory, not the threads: garbage that outlived its group (a reference
    cycle holding a destroyed gloo ProcessGroup, as an FSDP2 model dropped after the session's end does) is
    collected by the first worker that runs a collection, and the group's destructor joins gloo threads that
    exist only here: the worker segfaults (or hangs). Frozen, the workers' collections never look at the
    parent's objects (the fork-and-freeze pattern of gc.freeze's documentation, which also spares them the
    copy-on-write of every page the collector would touch). Thawed here once the workers exist (into the oldest
    generation), this process collects its own garbage, where its threads are. O(1) both ways: no collection
    is run. Where
    something else froze objects already (its own fork, mgpu.stop.process_exit at exit), thawing would undo
    that: the garbage is collected here instead, before the fork."""
    if gc.get_freeze_count():
        gc.collect()
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class Batches:
    """Iterate a loader; if a worker dies once a stop is requested, go on in-process from that batch.

    `build(start, workers)` makes a loader over the batches from index `start`; `stopping()` says
    whether a stop is requested on this rank (the ranks' agreement then ends the run a few steps later).
    """

    def __init__(self, build: Callable[[int, int], DataLoader], count: int, workers: int,
                 stopping: Callable[[], bool]) -> None:
        self.build, self.count, self.workers, self.stopping = build, count, workers, stopping

    def __iter__(self) -> Iterator[Any]:
        index, workers = 0, self.workers
        while index < self.count:
            iterator = iter(self.build(index, workers))
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
    map-style dataset, mgpu.data.sampling; a shard order and a rebuilt shuffle buffer for an mgpu.data.stream.ShardedStream);
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
        from mgpu.data.sampling import plan_for
        from mgpu.data.stream import ShardedStream

        for option in ("sampler", "batch_sampler", "shuffle", "batch_size", "drop_last", "generator"):
            if option in dataloader_options:
                raise ValueError(f"ResumableLoader owns the sample order: {option}= is not an option here")
        check_loader_args(batch_size, num_workers)
        self.stream_fingerprint = dataset.fingerprint() if isinstance(dataset, ShardedStream) else None
        self.stream = dataset if isinstance(dataset, ShardedStream) else None
        self.dataset, self.plan = plan_for(dataset, batch_size, rank, world_size, seed, shuffle)
        if not self.plan.num_samples:
            from mgpu.errors import MgpuError

            raise MgpuError(f"Session.loader(): the dataset is empty ({type(dataset).__name__} of length 0): an epoch "
                            f"would train no step; check the data it reads")
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
        """The `mgpu.data.sampling.MicroBatch` of the batch yielded last: its indices, real samples, global count."""

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

    def steps_per_epoch(self, global_batch: int) -> int:
        """Optimizer steps of a whole epoch at `global_batch` samples per step (all ranks together): what a loop
        that keeps its global batch sizes its schedule from, the same on any world size (`len(self)` counts this
        rank's batches, which change with it). Exact without drop_last, at most one more step with it."""
        if global_batch < 1:
            raise ValueError(f"steps_per_epoch({global_batch}): the global batch is at least 1 sample")
        return -(-self.plan.num_samples // global_batch)

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
        batches = Batches(build, count, self.num_workers, self.stopping)
        for mb, batch in zip(self._micro_batches(position), batches):
            self.last, self.position = mb, mb.end_position
            record_batch(self.plan.rank, self.epoch, mb.end_position, batch, mb.indices, self.num_workers)  # check_resume only
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
            from mgpu.data.stream import check_files

            check_files(state["files"], self.stream, log.warning)  # names the file that changed
        saved = state.get("stream")
        if saved is not None and saved != self.stream_fingerprint:
            from mgpu.data.stream import StreamError

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


def eval_loader(dataset: Dataset, batch_size: int, *, rank: int, world_size: int, seed: int, requeue_signal: str,
                num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None, **options: Any) -> DataLoader:
    """This rank's share of an evaluation set (mgpu.data.sampling.eval_shard: samples rank, rank + W, ...), in batches."""
    from mgpu.data.sampling import eval_shard

    check_loader_args(batch_size, num_workers, "Session.eval_loader")
    indices = eval_shard(len(dataset), rank, world_size)  # type: ignore[arg-type]  # torch's Dataset declares no __len__
    batches = [indices[i:i + batch_size] for i in range(0, len(indices), batch_size)]
    return make_loader(dataset, batches, num_workers=num_workers, seed=seed, epoch=0, rank=rank,
                       requeue_signal=requeue_signal, collate_fn=collate_fn, **options)
