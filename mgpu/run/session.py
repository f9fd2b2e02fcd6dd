"""One rank's part in a run, for any training loop: who am I, the process group, stopping together,
checkpoints, and coming back. mgpu's trainer is built on it; a loop of your own uses it the same way:

    with mgpu.Session("runs/my-run", seed=0) as session:      # any launcher: srun, submitit, torchrun, python
        model = session.wrap(Net())                            # on this rank's device, in DDP
        optimizer = torch.optim.AdamW(model.parameters())
        loader = session.loader(train_set, batch_size=64, num_workers=2)
        state = session.load({"model": model, "optimizer": optimizer, "loader": loader, "best": 0.0})
        for epoch in loader.epochs(10):                        # resumed in place, if the run has a checkpoint
            for batch in loader:
                ...forward, backward, optimizer.step()...
                if session.should_stop():                      # every rank gets the same answer, same step
                    break
            if session.stopping:
                break
            accuracy = ...
            if accuracy > state.best:                          # a plain value lives in the state: restored
                state.best = accuracy
            session.save(state)
    # leaving the block (or session.finish()) after a stop: the job requeues (exit 0) or stays down (exit 3,
    # with the command that resumes); an exception: the failure is recorded, within the budget requeued,
    # and raised.

What a Session guarantees, and what it does not, is in docs/own-loop.md.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import time
import weakref
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, overload

from mgpu.run import session_state, session_wrap
from mgpu.record.check_hooks import record_outside, record_outside_end, record_step
from mgpu.config.loading import Config, config_from_dict, config_to_dict
from mgpu.cluster.environment import ProcessEnv
from mgpu.errors import MgpuError
from mgpu.record.ledger import Ledger
from mgpu.run.outcome import JobStopped, Outcome, StopBudgets, exit_code, resume_command
from mgpu.stop.preemption import install_stop_request, uninstall_stop_request
from mgpu.record.budgets import Limits
from mgpu.run.recovery import rank_failed
from mgpu.state.resumption import Resumption
from mgpu.record.rundir import RunDir
from mgpu.run.runner import no_beat, process_start
from mgpu.run.session_base import SessionBase
from mgpu.run.session_end import conclude, discard_if_unused, settle_open_stop
from mgpu.run.session_start import after_first_step, record_start, start
from mgpu.run.uncaught import record_uncaught, refusals_in_one_line

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset, IterableDataset

    from mgpu.state.single.store import LoadedCheckpoint
    from mgpu.parallel.ddp import SessionDDPs
    from mgpu.data.loader import ResumableLoader
    from mgpu.data.stream_loader import StatefulStreamLoader
    from mgpu.data.stream import ShardedStream
    from mgpu.stop.stopping import StopController
    from mgpu.state.train_state import State
    from mgpu.stop.watchdog import Watchdog

__all__ = ["Session"]


class Session(SessionBase):
    """This rank's run. Construct it first (it catches the stop signals from then on), use it as a
    context manager or call `finish()` at the end. Every method marked *collective* must be called by
    every rank at the same point.

    `run_dir`: the run's directory (default `runs/run`, or the config's `run.*`): running the same
    command again, or a requeued job, continues from its newest checkpoint. `seed`: every rank's
    generators are seeded from it (rank r: seed + r). `config`: a `mgpu.Config` for everything else
    (`distributed`, `preemption`, `checkpoint`, `watchdog`, `train.seed`, `train.deterministic`, `run`).
    Testing: `MGPU_STOP_AT_STEP=K` in the environment stops after step K as if preempted (mgpu.stop.stopping).
    """

    def __init__(self, run_dir: str | Path | None = None, *, seed: int | None = None, config: Config | None = None,
                 env: ProcessEnv | None = None, recovery_by_batch_script: bool | None = None,
                 config_path: str | None = None) -> None:
        if config is not None and not isinstance(config, Config):
            raise MgpuError(f"Session(config=...) takes a mgpu.Config, got a {type(config).__name__}: "
                            f"mgpu.config_from_dict(...) or mgpu.load_config(path, overrides) makes one")
        self.timings: dict[str, float] = {"process": process_start(), "session": time.time()}
        """Unix times of this process's way to its first step (the ledger's `first_step` event has rank 0's)."""
        cfg = copy.deepcopy(config) if config is not None else Config()
        if run_dir is not None:
            cfg.run.dir = str(run_dir)
        if seed is not None:
            cfg.train.seed = seed
        # Every value checked as a YAML's is (one line naming the key): Session(seed=2**64) was a ValueError deep in
        # torch's seeding, and a Config edited in Python never met the rules.
        cfg = config_from_dict(config_to_dict(cfg))
        self.cfg, self.config_path = cfg, config_path
        # First of all, before anything slow: from here on a signal is a stop request, never the default
        # action or submitit's handler (which would checkpoint inside the handler and requeue a second time).
        self.stop, installed = install_stop_request(cfg.preemption.signal)
        self._cleanup = contextlib.ExitStack()
        if installed:
            self._cleanup.callback(uninstall_stop_request)
        # Everything this rank holds, declared before anything can fail (the cleanup reads it).
        self._created: Path | None = None
        self._began = self._finished = False
        self._ended = False  # the run's outcome is recorded: a hang in the teardown after it is not a failure
        self._ended_code = 0  # the process's exit code for that outcome (the watchdog's, if the teardown hangs)
        self.watchdog: Watchdog | None = None
        self.beat: Callable[..., None] = no_beat
        self.stopper: StopController | None = None
        self._checkpointer: Any = None
        self._ddps: SessionDDPs | None = None  # [mgpu.parallel.ddp bucket layout] the wrapped DDPs and their saved buckets
        self._fsdp = False  # [fsdp hook] a model was sharded: the checkpoints are sharded (see `sharded`)
        self._wrapped: weakref.WeakSet[Any] = weakref.WeakSet()  # what wrap() returned
        self._state: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None
        self._memory: Any = None  # this rank's snapshots in host memory, opened at first use (session_state.memory)
        self._marks: Any = None  # the last step this rank completed, for a survivor's save (session_state.open_marks)
        self._durable_step = -1  # the durable checkpoint's step when the state was loaded (-1: none)
        self._durable: tuple[int, Path | None] = (-1, None)  # the last save() with wait: its step, its path (rank 0)
        self.step = 0
        """Optimizer steps done in the run (restored on resume): one per `should_stop()`."""
        self.resume_step = 0
        """The step this process started from (0 for a new run)."""
        self.total_steps: int | None = None
        """The run's optimizer steps, when the loop knows them (set it): `log()`'s progress line then has an ETA."""
        self._log_clock: Any = None  # the pace of log()'s lines (mgpu.record.loop_progress.Clock)
        self._by_batch = recovery_by_batch_script
        self.timer = None  # this rank's compute and wait per step (mgpu.stop.rank_timing), set by start()
        self._sync_wait = None
        self.stragglers = None  # rank 0's watch of every rank's step times (mgpu.record.stragglers)
        refusals_in_one_line()  # an MgpuError nobody catches: one line on rank 0, exit 2 (mgpu.run.uncaught)
        try:
            start(self, env)  # mgpu.run.session_start: who am I, the run, the group, the watchdog
            refusals_in_one_line(self.rank)
            self._cleanup.callback(record_uncaught(self.fail))  # a loop ending in finish(), not `with`, that raises
        except BaseException as error:
            self._cleanup.close()
            discard_if_unused(self, error)
            raise

    # ------------------------------------------------------------------ the model and the data
    def wrap(self, model: nn.Module, *, find_unused_parameters: bool = False, static_graph: bool = False,
             parallel: str = "ddp", shard_hook: Callable[[Any, Any], Any] | None = None) -> nn.Module:
        """`model` on this rank's device, in DistributedDataParallel when there are several ranks. On a resumed
        run its reducer gets the saved run's gradient buckets, so that it reduces exactly as the unbroken run
        did (mgpu.parallel.ddp). Call after `load()`, or before it: either works. Once per model: the plain module, not
        one `wrap` returned.

        `parallel="fsdp"`: sharded with FSDP2 instead (mgpu.parallel.fsdp; `shard_hook(model, mesh)` shards it your
        way), and checkpoints become sharded; call it before building the optimizer and before `load()`."""
        return session_wrap.wrap(self, model, find_unused_parameters, static_graph, parallel, shard_hook)

    @property
    def sharded(self) -> bool:
        """Whether this run's checkpoints are sharded (checkpoint.format, or auto and an FSDP2 model)."""
        from mgpu.parallel.fsdp import sharded_checkpoints

        return sharded_checkpoints(self.cfg.checkpoint.format, self.cfg.train.parallel, self._fsdp)

    # A ShardedStream and a map-style dataset get a ResumableLoader (it has len()); another IterableDataset a
    # StatefulStreamLoader. An IterableDataset is also a Dataset: the first overload that matches wins.
    @overload
    def loader(self, dataset: ShardedStream, batch_size: int, *, shuffle: bool = True, drop_last: bool = False,
               num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None,
               **dataloader_options: Any) -> ResumableLoader: ...

    @overload
    def loader(self, dataset: IterableDataset[Any], batch_size: int, *, shuffle: bool = True,
               drop_last: bool = False, num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None,
               **dataloader_options: Any) -> ResumableLoader | StatefulStreamLoader: ...

    @overload
    def loader(self, dataset: Dataset[Any], batch_size: int, *, shuffle: bool = True, drop_last: bool = False,
               num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None,
               **dataloader_options: Any) -> ResumableLoader: ...

    def loader(self, dataset: Dataset[Any], batch_size: int, *, shuffle: bool = True, drop_last: bool = False,
               num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None,
               **dataloader_options: Any) -> ResumableLoader | StatefulStreamLoader:
        """This rank's batches of `dataset` (`batch_size` per rank), resumable at the exact sample on any
        number of ranks: put it in the state you `save()`. See mgpu.data.loader.ResumableLoader (map-style, and
        mgpu.data.stream.ShardedStream) and StatefulStreamLoader (an IterableDataset with state_dict())."""
        from mgpu.data.stream_loader import open_loader

        options = {"pin_memory": self.device.type == "cuda", **dataloader_options}
        return open_loader(dataset, batch_size, rank=self.rank, world_size=self.world_size,
                           seed=self.cfg.train.seed, shuffle=shuffle, drop_last=drop_last,
                           num_workers=num_workers, collate_fn=collate_fn,
                           requeue_signal=self.cfg.preemption.signal, stopping=lambda: self.stop_requested,
                           agreed=lambda: self.stopping, **options)

    def eval_loader(self, dataset: Dataset, batch_size: int, *, num_workers: int = 0,
                    collate_fn: Callable[[list[Any]], Any] | None = None, **dataloader_options: Any) -> DataLoader:
        """This rank's share of an evaluation set: samples rank, rank + W, ... (each sample on exactly one
        rank; counts differ by at most one). Reduce sums and counts across ranks with `all_reduce`."""
        from mgpu.data.loader import eval_loader

        return eval_loader(dataset, batch_size, rank=self.rank, world_size=self.world_size, seed=self.cfg.train.seed,
                           requeue_signal=self.cfg.preemption.signal, num_workers=num_workers, collate_fn=collate_fn,
                           **{"pin_memory": self.device.type == "cuda", **dataloader_options})

    def all_reduce(self, value: Any, op: str = "sum") -> torch.Tensor:
        """*Collective.* `value` (a tensor or a number) reduced over the ranks: sum, mean, max or min."""
        from mgpu.parallel.distributed import all_reduce

        return all_reduce(value, op, device=self.device)  # type: ignore[arg-type]  # a str op: an unknown one is a KeyError there

    # ------------------------------------------------------------------ stopping together
    def should_stop(self, step: int | None = None, save: bool = True) -> bool:
        """*Collective*, once per optimizer step, after `optimizer.step()`: True when the ranks agreed to
        stop at this step (a signal reached any of them). Every rank gets the same answer at the same
        step; it costs nothing measurable (an asynchronous all-reduce about once a second, read one step
        later). On True the state given to `load()`/`save()` is saved at once and durably (`save=False`:
        the caller saves it), so nothing the loop does after it (an evaluation, its DataLoader's random
        draw) can change what resumes. `step`: the step just done, for a loop that counts its own
        (default: one more than the last call)."""
        stopper = self._live("should_stop()")
        self.step = self.step + 1 if step is None else step
        # Every generator re-seeded from (seed, rank, step): a rank's RNG at a step's end is derived, never kept, so
        # a rank lost with its process resumes that step exactly from a survivor's save (mgpu.state.memory.step_mark).
        from mgpu.state.rng import seed_step

        seed_step(self.cfg.train.seed, self.rank, self.step)
        if self.step == self.resume_step + 1:
            after_first_step(self)
            record_outside(self.rank, self._state, sys._getframe(1))  # check_resume only: what `state` lacks
        record_step(self.rank, self.step)  # check_resume only
        reasons = stopper.at_step(self.step)
        if self._marks is not None and not reasons:
            self._marks.mark(self.step)  # what a survivor saves if a peer fails in the next step
        if self.watchdog is not None:
            # The step's end; a loop whose forwards the watchdog does not see (no `wrap`) advances its step here.
            self.beat("agree", self.step if self.watchdog.step < self.step else None)
        if reasons and save and self._state is not None:
            self.save(reason="preemption", wait=True)
        elif save and not reasons:
            self.snapshot()  # [memory snapshots hook] checkpoint.memory_every_steps; a loop saving its stop calls it
        return bool(reasons)

    def poll_stop(self) -> bool:
        """*Collective*, between steps (e.g. every evaluation batch that every rank has): whether the ranks
        agreed to stop, pipelined like `should_stop`. A long evaluation then does not hold a stop."""
        stopper = self._live("poll_stop()")
        self.beat("agree")
        return bool(stopper.poll())

    def outside_step(self) -> contextlib.AbstractContextManager[None]:
        """`with session.outside_step(): ...` around work between steps that is not training (an evaluation,
        a log line): left out of this rank's step time, which names a slow rank (stragglers; `save()` and `log()`
        leave themselves out)."""
        return self.timer.outside() if self.timer is not None else contextlib.nullcontext()

    def rank_times(self) -> dict[str, Any] | None:
        """Rank 0: every rank's compute and wait per step so far (EWMAs: min, median, max), the slowest rank, its
        node and its factor over the others, the stragglers named (mgpu.record.stragglers); None elsewhere, before
        the first agreement, or in a world of one. The trainer logs it with each log line."""
        return self.stragglers.summary() if self.stragglers is not None else None

    @property
    def stopping(self) -> bool:
        """The ranks agreed to stop (after `should_stop()` or `poll_stop()` said so)."""
        return self.stopper is not None and self.stopper.agreed

    @property
    def stop_requested(self) -> bool:
        """A stop is requested on this rank, or agreed: a DataLoader worker that dies now is not a crash."""
        return self.stopper is not None and self.stopper.requested

    @property
    def reasons(self) -> set[str]:
        """The stop reasons the ranks agreed on (empty: no stop)."""
        return set(self.stopper.reasons) if self.stopper is not None else set()

    def _live(self, what: str) -> StopController:
        if self._finished or self.stopper is None:
            raise MgpuError(f"Session.{what} after finish(): the session has ended (its process group is gone)")
        return self.stopper

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpointer(self) -> Any:
        """The run's checkpoint coordination (mgpu.state.checkpointer; sharded: mgpu.state.sharded.checkpointer),
        made at first use."""
        if self._checkpointer is None:
            self._checkpointer = session_state.open_checkpointer(self)
        return self._checkpointer

    def latest(self) -> LoadedCheckpoint | None:
        """*Collective.* The run's newest checkpoint that verifies (rank 0 checks it), loaded memory-mapped
        on every rank; None for a new run. A look before `load()` (the trainer reads its progress to size
        its schedule): `load()` restores this one."""
        if not self.resumption.looked:
            session_state.resume_begins(self)
        self.timings.setdefault("find", time.time())
        found = self.resumption.latest()
        self.timings.setdefault("loaded", time.time())
        return found

    def load(self, state: MutableMapping[str, Any], *, missing_ok: set[str] | frozenset[str] = frozenset(),
             override: Mapping[str, Any] | None = None, fresh: bool = False, batch_size: int | None = None,
             global_batch: int | None = None) -> State:
        """*Collective.* Resume `state` from the run's newest checkpoint, if it has one, and return it as a
        `mgpu.State` (the same mapping; its values also as attributes: `state.best`). Objects with
        `load_state_dict` (model, optimizer, scheduler, scaler, loader, ...) load theirs, dataclasses get
        their fields back in place, plain values are replaced in the state: read them from it. A value a
        checkpoint cannot hold is refused here, before any training. `state` is also what a stop saves.

        `missing_ok`: keys the checkpoint may lack (added to the loop since; left as they are; any other
        missing key is an error). `override`: optimizer hyperparameters set in every parameter group after
        the restore, e.g. `{"lr": 1e-4}` (recorded in the ledger; see mgpu.state.hparams). `fresh`: start the run
        over: its checkpoints are set aside (renamed), nothing is restored. `batch_size`: samples per rank
        per optimizer step, for the resume line (default: the state's `session.loader`'s); `global_batch`: the
        global batch the loop keeps on every world size (data.global_batch_size; then `batch_size` is per
        micro-step): the resume line says how the accumulation changed."""
        return session_state.load(self, state, missing_ok, override, fresh, batch_size, global_batch)

    def snapshot(self) -> bool:
        """*Collective* (every rank at the same step, like `save`). When `checkpoint.memory_every_steps` says it
        is due at this step: what a checkpoint now would hold for this rank, into the node's shared memory, from
        which a step restarted in this allocation resumes (see mgpu.state.memory.snapshots). `should_stop()` calls it;
        a loop that saves its stop itself (`should_stop(save=False)`) calls it where it would save a stop.
        Whether one was taken."""
        return session_state.snapshot(self)

    @property
    def resumed_from(self) -> Path | None:
        """The checkpoint this process resumed from (None: a new run)."""
        return self.resumption.path

    def save(self, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None, *, best: bool = False,
             wait: bool = False, reason: str | None = None, meta: dict[str, Any] | None = None) -> Path | None:
        """*Collective.* Checkpoint `state` (default: the one given to `load()`) at the current step: every
        `state_dict()` in it, its plain values, and every rank's RNG state; atomic and verified, written
        in the background unless `wait`. `best`: also the run's best checkpoint. Returns the path once
        durable (with `wait`, on rank 0). A background save that fails is reported and the next one tries
        again; a save with `wait` that fails raises the same one-line error on every rank. Refused into a
        run whose checkpoint this session did not `load()`."""
        with self.outside_step():
            return session_state.save(self, state, best, wait, reason, meta)

    @property
    def run_id(self) -> str:
        """[run id for loggers] The run's identity for loggers: the same for every requeue and resubmission of
        this run directory, another for another run (`wandb.init(id=session.run_id, resume="allow")`
        continues one wandb run across requeues; the trainer's wandb uses it too)."""
        from mgpu.record.reporting import wandb_run_id

        return wandb_run_id(self.run.path)

    def log(self, metrics: Mapping[str, Any] | None = None, /, **named: Any) -> bool:
        """*Collective* (every rank, once per optimizer step, after `should_stop()`): every `log.every_steps`
        steps, the loop's `progress` in the run's ledger, as the trainer's: the step, the epoch of the state's
        `session.loader`, the metrics (`log(loss=loss)` or `log({...})`: numbers or one-element tensors,
        rank 0's, read only when due) and a fingerprint of the state's models; rank 0 prints the trainer's line
        (step, epoch, metrics, steps a second, an ETA once `total_steps` is set). `jobs/status.py` shows them
        (epoch, metrics, `--plot`'s loss curve); `--verify` compares two runs by them. Returns whether it
        was due. See mgpu.record.loop_progress."""
        from mgpu.record.loop_progress import Clock, log_progress

        self._live("log()")
        if metrics is not None and not isinstance(metrics, Mapping):
            raise MgpuError(f"Session.log() takes a dict of metrics or name=value, got a {type(metrics).__name__}")
        self._log_clock = self._log_clock or Clock()
        with self.outside_step():
            return log_progress(self.ledger, self.step, self.cfg.log.every_steps, self._state, self.is_main,
                                {**(metrics or {}), **named}, self._log_clock, self.total_steps,
                                ranks=self.rank_times())

    @functools.cached_property
    def version(self) -> str | None:
        """The git commit of mgpu's checkout (`+dirty` with local changes), saved in every checkpoint."""
        from mgpu.state.train_state import code_version

        return code_version()

    # ------------------------------------------------------------------ the run's life
    def begin(self, **fields: Any) -> None:
        """The run has started (`load()` and `save()` say so themselves): the ledger's `started` (and
        `resumed`) events; from here on a failure leaves the run directory as it is."""
        if self._began:
            return
        self._began = True
        record_start(self, fields)

    def finish(self) -> None:
        """End this rank's run and act on it: after a stop, save the state (if not saved at this step already)
        and decide, on rank 0 alone, whether the job comes back; then leave the process group. Returns when
        the run finished; exits the process (SystemExit(0)) when the job is requeued (or on a rank other
        than 0 after a stop), and with code 3, after one line with the command that resumes, when it stays
        down. The context manager calls it on leaving the block."""
        outcome = self.end()
        if outcome.kind in ("stays_down", "unknown"):
            print(f"mgpu: {outcome.message}", file=sys.stderr, flush=True)
        if outcome.kind != "finished":
            raise SystemExit(exit_code(outcome))

    def end(self, status: str | None = None, **fields: Any) -> Outcome:
        """`finish()` without acting on the outcome: returns what happens to the job (the trainer's way out).
        `status`: finished, early_stopped or stopped (default: stopped if the ranks agreed to stop); `fields`
        go into the ledger's `finished` event. The process's exit then leaves its heap to the system instead of
        collecting it (mgpu.stop.process_exit.skip_collection_at_exit)."""
        if self._finished:
            raise MgpuError("the session has ended already (finish() or end() was called)")
        record_outside_end(self.rank)  # check_resume only: where the objects `state` lacks ended
        try:
            outcome = conclude(self, status, fields)  # mgpu.run.session_end
        except BaseException as error:  # the stop's save failed: recorded like any failure, then raised
            self.fail(error)
            raise
        self._finished = self._ended = True
        self._ended_code = exit_code(outcome)
        if self._memory is not None:  # the run ended with a durable checkpoint: its snapshots go
            self._memory.remove()
        self._cleanup.close()
        outcome = settle_open_stop(self, outcome)  # where no batch script will (mgpu.run.session_end)
        from mgpu.stop.process_exit import skip_collection_at_exit

        skip_collection_at_exit()  # the run is over: the process's exit need not collect its heap (~1 s of CPU)
        return outcome

    def fail(self, error: BaseException) -> None:
        """Record a failure and, within the failure budget, requeue the job while the group still exists
        (tearing it down can block on a dead peer until srun's KILL). Where the batch script decides after
        srun returns (MGPU_RECOVERY=batch), it alone does. Bad input is never requeued."""
        if self._finished:
            return
        self._finished = True
        session_state.last_words(self, f"{type(error).__name__} in step {self.step + 1}")
        rank_failed(error, self.run, rank=self.rank, job_id=self.env.job_id, restart=self.env.restart_count,
                    slurm_job=self.slurm_job, limits=self.limits, by_batch=self._by_batch)
        self._cleanup.close()
        discard_if_unused(self, error)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> None:
        if error is not None:
            if not self._finished:
                self.fail(error)
            return  # the exception goes on (its traceback is the user's)
        if not self._finished:
            self.finish()


__all__ += ["JobStopped", "resume_command"]
