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
import logging
import sys
import time
import weakref
from collections.abc import MutableMapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, overload

from mgpu.config import Config
from mgpu.environment import ProcessEnv, detect_environment
from mgpu.errors import MgpuError
from mgpu.ledger import Ledger
from mgpu.outcome import JobStopped, Outcome, StopBudgets, decide_after_stop, exit_code, resume_command
from mgpu.preemption import install_stop_request, uninstall_stop_request
from mgpu.recovery import Limits, rank_failed
from mgpu.resumption import Resumption
from mgpu.rundir import RunDir
from mgpu.runner import discard, join_run, no_beat, prepare_run_dir, process_start, setup_logging, start_watchdog
from mgpu.slurm_job import owns_slurm_job

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset, IterableDataset

    from mgpu.checkpoint import LoadedCheckpoint
    from mgpu.ddp import SessionDDPs
    from mgpu.loader import ResumableLoader
    from mgpu.stream_loader import StatefulStreamLoader
    from mgpu.stream import ShardedStream
    from mgpu.stopping import StopController
    from mgpu.train_state import State
    from mgpu.watchdog import Watchdog

__all__ = ["Session"]

log = logging.getLogger("mgpu.train")


class Session:
    """This rank's run. Construct it first (it catches the stop signals from then on), use it as a
    context manager or call `finish()` at the end. Every method marked *collective* must be called by
    every rank at the same point.

    `run_dir`: the run's directory (default `runs/run`, or the config's `run.*`): running the same
    command again, or a requeued job, continues from its newest checkpoint. `seed`: every rank's
    generators are seeded from it (rank r: seed + r). `config`: a `mgpu.Config` for everything else
    (`distributed`, `preemption`, `checkpoint`, `watchdog`, `train.seed`, `train.deterministic`, `run`).
    Testing: `MGPU_STOP_AT_STEP=K` in the environment stops after step K as if preempted (mgpu.stopping).
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
        self._ddps: SessionDDPs | None = None  # [mgpu.ddp bucket layout] the wrapped DDPs and their saved buckets
        self._fsdp = False  # [fsdp hook] a model was sharded: the checkpoints are sharded (see `sharded`)
        self._wrapped: weakref.WeakSet[Any] = weakref.WeakSet()  # what wrap() returned
        self._state: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None
        self._durable: tuple[int, Path | None] = (-1, None)  # the last save() with wait: its step, its path (rank 0)
        self.step = 0
        """Optimizer steps done in the run (restored on resume): one per `should_stop()`."""
        self.resume_step = 0
        """The step this process started from (0 for a new run)."""
        self._by_batch = recovery_by_batch_script
        try:
            self._start(env)
        except BaseException as error:
            self._cleanup.close()
            self._discard_if_unused(error)
            raise

    def _start(self, env: ProcessEnv | None) -> None:
        cfg = self.cfg
        self.limits = Limits.from_environ()  # before torch is imported: a bad value fails in milliseconds
        self.env = env or detect_environment()
        self.rank, self.world_size, self.local_rank = self.env.rank, self.env.world_size, self.env.local_rank
        self.is_main = self.rank == 0
        self.run = RunDir.of(cfg.run)
        self._created = prepare_run_dir(self.run)  # what this attempt creates, removed if it never trains
        setup_logging(self.run, self.rank)
        self.slurm_job = self.env.job_id if owns_slurm_job() else None
        """The Slurm job this process belongs to, the only one it may ask about or requeue (None: none)."""
        self.budgets = StopBudgets.read(self.run, self.env, self.slurm_job, self.limits)
        self.budgets.refuse_if_spent(self.run, self.env)
        self.ledger = Ledger(self.run.ledger if self.is_main else None, self.env.job_id, self.env.restart_count)
        self.started = time.time()
        self.resumption = Resumption(self.run, self.rank, self.world_size, cfg.train.seed, self.ledger,
                                     lambda: self.checkpointer)

        from mgpu.ddp import SessionDDPs
        from mgpu.distributed import process_group
        from mgpu.rng import seed_rank
        from mgpu.stopping import StopController

        # The watchdog outlives the group's teardown, which it bounds (see _arm_teardown): stopped after it.
        self._cleanup.callback(lambda: self.watchdog.stop() if self.watchdog is not None else None)
        ctx = self._cleanup.enter_context(process_group(
            self.env, timeout=timedelta(seconds=cfg.distributed.init_timeout_s),
            backend=None if cfg.distributed.backend == "auto" else cfg.distributed.backend, trace_dir=self.run.logs))
        self._ddps = SessionDDPs()
        self._cleanup.callback(self._ddps.release)  # before the group's teardown (reverse order)
        self.timings["group"] = time.time()
        self.device: torch.device = ctx.device
        self.backend = ctx.backend
        join_run(self.run, self.env, str(self.device), self.backend)
        # The saves measured so far, earlier runs' included (the ledger's tail: the same on every rank): how long
        # the next one should take sizes the watchdog's allowance, the collective timeout and the deadline stop.
        from mgpu.save_budget import expected_save_s, save_allowance_s, saves_in_ledger

        self.expected_save_s = expected_save_s(saves_in_ledger(self.run.ledger), self.world_size)
        self.save_allowance_s = save_allowance_s(self.expected_save_s, cfg.watchdog.checkpoint_s)
        if self.is_main and self.save_allowance_s > cfg.watchdog.checkpoint_s:
            log.info("a checkpoint save is expected to take %.0f s here (the saves measured so far): the watchdog "
                     "allows %.0f s for one, more than watchdog.checkpoint_s", self.expected_save_s or 0.0,
                     self.save_allowance_s)
        if cfg.watchdog.enabled:
            self.watchdog = start_watchdog(cfg, self.env, self.run, self.backend, checkpoint_s=self.save_allowance_s)
            self._cleanup.callback(self._arm_teardown)
            self.beat = self.watchdog.beat
        self.stopper = StopController.for_rank(
            self.stop, cfg.preemption, self._cleanup, slurm_job=self.slurm_job if self.is_main else None,
            longest_write_s=self._longest_write_s)
        seed_rank(cfg.train.seed, self.rank, cfg.train.deterministic)

    def _longest_write_s(self) -> float:
        """What the deadline stop leaves for the save: this process's longest write, or the time the saves of
        earlier runs say the next one takes, whichever is longer."""
        own = self._checkpointer.longest_write_s if self._checkpointer is not None else 0.0
        return max(own, self.expected_save_s or 0.0)

    # ------------------------------------------------------------------ the model and the data
    def wrap(self, model: nn.Module, *, find_unused_parameters: bool = False, static_graph: bool = False,
             parallel: str = "ddp", shard_hook: Callable[[Any, Any], Any] | None = None) -> nn.Module:
        """`model` on this rank's device, in DistributedDataParallel when there are several ranks. On a resumed
        run its reducer gets the saved run's gradient buckets, so that it reduces exactly as the unbroken run
        did (mgpu.ddp). Call after `load()`, or before it: either works. Once per model: the plain module, not
        one `wrap` returned.

        `parallel="fsdp"`: sharded with FSDP2 instead (mgpu.fsdp; `shard_hook(model, mesh)` shards it your
        way), and checkpoints become sharded; call it before building the optimizer and before `load()`."""
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, nn.Module):
            raise MgpuError(f"Session.wrap() takes a torch.nn.Module, got a {type(model).__name__}")
        if isinstance(model, DistributedDataParallel) or model in self._wrapped:  # on one rank as on many
            raise MgpuError("Session.wrap(): this model is wrapped already (DDP inside DDP on several ranks): "
                            "wrap the plain module, once")
        if parallel == "fsdp":  # [fsdp hook] see mgpu.fsdp
            from mgpu.fsdp import shard

            if self._checkpointer is not None and not self.sharded:
                raise MgpuError("Session.wrap(parallel='fsdp') after load() or save(): shard the model first (its "
                                "checkpoints are sharded)")
            self._fsdp = True
            return self._watched(shard(model, self.device, shard_hook))
        if parallel != "ddp":
            raise MgpuError(f"Session.wrap(parallel={parallel!r}): use 'ddp' or 'fsdp'")
        model = model.to(self.device)
        if self.world_size == 1:
            self._wrapped.add(model)
            return model
        assert self._ddps is not None
        ddp = self._ddps.wrap(model, self.device, find_unused_parameters, static_graph)  # [mgpu.ddp bucket layout]
        self._wrapped.add(ddp)
        return self._watched(ddp)

    def _watched(self, model: nn.Module) -> nn.Module:
        """Entering the model's forward (of the next step), this rank waits for the others: a watchdog beat. A
        loop that beats nothing else starts its step here; a step's first forward starts it, not each one."""
        watchdog = self.watchdog
        if watchdog is not None:
            def beat(module: Any, args: Any) -> None:
                following = self.step + 1
                self.beat("model", following if watchdog.step != following else None)
            model.register_forward_pre_hook(beat)
        return model

    @property
    def sharded(self) -> bool:
        """Whether this run's checkpoints are sharded (checkpoint.format, or auto and an FSDP2 model)."""
        from mgpu.fsdp import sharded_checkpoints

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
        number of ranks: put it in the state you `save()`. See mgpu.loader.ResumableLoader (map-style, and
        mgpu.stream.ShardedStream) and StatefulStreamLoader (an IterableDataset with state_dict())."""
        from mgpu.stream_loader import open_loader

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
        from mgpu.loader import eval_loader

        return eval_loader(dataset, batch_size, rank=self.rank, world_size=self.world_size, seed=self.cfg.train.seed,
                           requeue_signal=self.cfg.preemption.signal, num_workers=num_workers, collate_fn=collate_fn,
                           **{"pin_memory": self.device.type == "cuda", **dataloader_options})

    def all_reduce(self, value: Any, op: str = "sum") -> torch.Tensor:
        """*Collective.* `value` (a tensor or a number) reduced over the ranks: sum, mean, max or min."""
        from mgpu.distributed import all_reduce

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
        if self.step == self.resume_step + 1:
            self._after_first_step()
        reasons = stopper.at_step(self.step)
        if self.watchdog is not None:
            # The step's end; a loop whose forwards the watchdog does not see (no `wrap`) advances its step here.
            self.beat("agree", self.step if self.watchdog.step < self.step else None)
        if reasons and save and self._state is not None:
            self.save(reason="preemption", wait=True)
        return bool(reasons)

    def poll_stop(self) -> bool:
        """*Collective*, between steps (e.g. every evaluation batch that every rank has): whether the ranks
        agreed to stop, pipelined like `should_stop`. A long evaluation then does not hold a stop."""
        stopper = self._live("poll_stop()")
        self.beat("agree")
        return bool(stopper.poll())

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

    def _after_first_step(self) -> None:
        """Every rank reached a first step: collectives need no rendezvous allowance any more (a hung peer
        then fails a collective in minutes, not in distributed.init_timeout_s)."""
        from mgpu.distributed import set_collective_timeout

        seconds = None
        if self.watchdog is not None and self.world_size > 1:
            assert self.stopper is not None
            seconds = round(self.watchdog.collective_timeout(self.cfg.watchdog.collective_timeout_s), 1)
            set_collective_timeout(timedelta(seconds=seconds), self.stopper.agreement.group)  # type: ignore[attr-defined]  # the agreement the controller built for this rank
        self.timings["first_step"] = time.time()
        self.ledger.write("first_step", step=self.step, collective_timeout_s=seconds,
                          checkpoint_allowance_s=round(self.save_allowance_s, 1),
                          timings={k: round(v, 3) for k, v in self.timings.items()})

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpointer(self) -> Any:
        """The run's checkpoint coordination (mgpu.checkpointer; sharded: mgpu.sharded), made at first use."""
        if self._checkpointer is None:
            from mgpu.checkpointer import open_checkpointer

            from mgpu.save_budget import peer_wait_s

            self._checkpointer = open_checkpointer(self.run, self.rank, self.world_size, self.ledger,
                                                   self.cfg.checkpoint, sharded=self.sharded, beat=self.beat,
                                                   version=self.version, wait_s=peer_wait_s(self.save_allowance_s))
            self._cleanup.callback(self._checkpointer.close)
        return self._checkpointer

    def latest(self) -> LoadedCheckpoint | None:
        """*Collective.* The run's newest checkpoint that verifies (rank 0 checks it), loaded memory-mapped
        on every rank; None for a new run. A look before `load()` (the trainer reads its progress to size
        its schedule): `load()` restores this one."""
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
        the restore, e.g. `{"lr": 1e-4}` (recorded in the ledger; see mgpu.hparams). `fresh`: start the run
        over: its checkpoints are set aside (renamed), nothing is restored. `batch_size`: samples per rank
        per optimizer step, for the resume line (default: the state's `session.loader`'s); `global_batch`: the
        global batch the loop keeps on every world size (data.global_batch_size; then `batch_size` is per
        micro-step): the resume line says how the accumulation changed."""
        from mgpu import hparams
        from mgpu.train_state import State, check_checkpointable

        if not isinstance(state, MutableMapping):
            raise MgpuError(f"Session.load() takes a dict of what to checkpoint (name -> model, optimizer, loader, "
                            f"value), got a {type(state).__name__}")
        check_checkpointable(state)
        if fresh:
            self.resumption.start_over()
        self.latest()
        before = hparams.constructed(state)
        loaded = self.resumption.restore(state, set(missing_ok), batch_size, global_batch)
        if loaded is not None:
            self.timings["restored"] = time.time()
            self.step = self.resume_step = loaded.step
            if self._ddps is not None:  # [mgpu.ddp bucket layout] the wrapped DDPs' saved buckets
                self._ddps.resume(loaded.state.get("ddp"))
            for line in hparams.overridden_by_checkpoint(before, state, override or {}) if self.is_main else ():
                log.warning("%s (to change it on purpose: load(state, override={...}))", line)
        changes = hparams.apply(state, override or {})
        self._state = state
        self.begin()
        if changes:
            self.ledger.write("hyperparameters", step=self.step, changes=changes)
            log.info("hyperparameters changed at step %d: %s", self.step, "; ".join(changes))
        return state if isinstance(state, State) else State(state)

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
        from mgpu.train_state import check_checkpointable, gather_state

        state = self._state if state is None else state
        if state is None:
            raise MgpuError("Session.save(): nothing to save: pass the state (or load() it first)")
        if not (callable(state) or isinstance(state, Mapping)):
            raise MgpuError(f"Session.save() takes the state mapping (name -> object), got a {type(state).__name__}")
        if not self.resumption.looked:
            self.resumption.refuse_unloaded()
            check_checkpointable(state() if callable(state) else state)
        self._state = state
        self.begin()
        objects, reason = state() if callable(state) else state, reason or ("best" if best else "periodic")
        if self.sharded:  # [fsdp hook] every rank contributes its shard
            path = self.checkpointer.save_objects(objects, self.step, reason, is_best=best, wait=wait, extra=meta)
        else:
            ddps = self._ddps  # [mgpu.ddp bucket layout] the wrapped DDPs' buckets, saved beside the state
            assert ddps is not None
            path = self.checkpointer.save(lambda: ddps.gather(lambda: gather_state(objects, self.version)),
                                          self.step, reason, is_best=best, wait=wait, extra=meta)
        if wait:  # durable now: end() does not save this step again
            self._durable = (self.step, path)
        return path

    @property
    def run_id(self) -> str:
        """[run id for loggers] The run's identity for loggers: the same for every requeue and resubmission of
        this run directory, another for another run (`wandb.init(id=session.run_id, resume="allow")`
        continues one wandb run across requeues; the trainer's wandb uses it too)."""
        from mgpu.reporting import wandb_run_id

        return wandb_run_id(self.run.path)

    def log(self, metrics: Mapping[str, Any] | None = None, /, **named: Any) -> bool:
        """*Collective* (every rank, once per optimizer step, after `should_stop()`): every `log.every_steps`
        steps, the loop's `progress` in the run's ledger, as the trainer's: the step, the epoch of the state's
        `session.loader`, the metrics (`log(loss=loss)` or `log({...})`: numbers or one-element tensors,
        rank 0's, read only when due) and a fingerprint of the state's models. `jobs/status.py` shows them
        (epoch, metrics, `--plot`'s loss curve); `--verify` compares two runs by them. Returns whether it
        was due. See mgpu.loop_progress."""
        from mgpu.loop_progress import log_progress

        self._live("log()")
        if metrics is not None and not isinstance(metrics, Mapping):
            raise MgpuError(f"Session.log() takes a dict of metrics or name=value, got a {type(metrics).__name__}")
        return log_progress(self.ledger, self.step, self.cfg.log.every_steps, self._state, self.is_main,
                            {**(metrics or {}), **named})

    @functools.cached_property
    def version(self) -> str | None:
        """The git commit of mgpu's checkout (`+dirty` with local changes), saved in every checkpoint."""
        from mgpu.train_state import code_version

        return code_version()

    # ------------------------------------------------------------------ the run's life
    def begin(self, **fields: Any) -> None:
        """The run has started (`load()` and `save()` say so themselves): the ledger's `started` (and
        `resumed`) events; from here on a failure leaves the run directory as it is."""
        if self._began:
            return
        self._began = True
        self.ledger.write("started", world_size=self.world_size, nodes=list(self.env.nodes),
                          launcher=self.env.launcher, device=str(self.device), backend=self.backend,
                          run_dir=str(self.run.path), limits={"max_requeues": self.limits.max_requeues,
                                                              "max_failures": self.limits.max_failures},
                          **{"config_path": self.config_path, "git_sha": self.version, **fields})
        self.resumption.record()

    def finish(self) -> None:
        """End this rank's run and act on it: after a stop, save the state (if not saved at this step already)
        and decide, on rank 0 alone, whether the job comes back; then leave the process group. Returns when
        the run finished; exits the process (SystemExit(0)) when the job is requeued (or on a rank other
        than 0 after a stop), and with code 3, after one line with the command that resumes, when it stays
        down. The context manager calls it on leaving the block."""
        outcome = self.end()
        if outcome.kind == "stays_down":
            print(f"mgpu: {outcome.message}", file=sys.stderr, flush=True)
        if outcome.kind != "finished":
            raise SystemExit(exit_code(outcome))

    def end(self, status: str | None = None, **fields: Any) -> Outcome:
        """`finish()` without acting on the outcome: returns what happens to the job (the trainer's way out).
        `status`: finished, early_stopped or stopped (default: stopped if the ranks agreed to stop); `fields`
        go into the ledger's `finished` event. The process's exit then leaves its heap to the system instead of
        collecting it (mgpu.process_exit.skip_collection_at_exit)."""
        if self._finished:
            raise MgpuError("the session has ended already (finish() or end() was called)")
        try:
            outcome = self._conclude(status, fields)
        except BaseException as error:  # the stop's save failed: recorded like any failure, then raised
            self.fail(error)
            raise
        self._finished = self._ended = True
        self._ended_code = exit_code(outcome)
        self._cleanup.close()
        from mgpu.process_exit import skip_collection_at_exit

        skip_collection_at_exit()  # the run is over: the process's exit need not collect its heap (~1 s of CPU)
        return outcome

    def _conclude(self, status: str | None, fields: dict[str, Any]) -> Outcome:
        reasons = self.reasons
        stopped = bool(reasons) if status is None else status == "stopped"
        saved_at, path = self._durable  # a stop's checkpoint has one owner: the loop, else here
        if self._state is not None and saved_at != self.step:
            path = self.save(reason="preemption" if stopped else "final", wait=True)
        if not stopped:
            self.ledger.write("finished", step=self.step, status=status or "finished",
                              seconds=round(time.time() - self.started, 3), **fields)
            if self.is_main:
                self.run.release(self.env.job_id)
            return Outcome("finished")
        log.info("stopping at step %d (%s; signals on this rank: %s)", self.step, ", ".join(sorted(reasons)),
                 [name for name, _ in self.stop.received])
        self.ledger.write("preempted", step=self.step, reasons=sorted(reasons),
                          signals=[name for name, _ in self.stop.received],
                          signal_times=[round(t, 3) for _, t in self.stop.received])
        outcome = decide_after_stop(reasons, self.step, self.resume_step, str(path) if path else None,
                                    self.budgets, self.env, self.ledger)
        if outcome.kind == "stays_down":
            self.run.release(self.env.job_id)
        return outcome

    def fail(self, error: BaseException) -> None:
        """Record a failure and, within the failure budget, requeue the job while the group still exists
        (tearing it down can block on a dead peer until srun's KILL). Where the batch script decides after
        srun returns (MGPU_RECOVERY=batch), it alone does. Bad input is never requeued."""
        if self._finished:
            return
        self._finished = True
        rank_failed(error, self.run, rank=self.rank, job_id=self.env.job_id, restart=self.env.restart_count,
                    slurm_job=self.slurm_job, limits=self.limits, by_batch=self._by_batch)
        self._cleanup.close()
        self._discard_if_unused(error)

    def _arm_teardown(self) -> None:
        """From here the watchdog bounds the group's teardown (a dead peer can block it): past its allowance,
        stacks to the log and an exit, 4 when the run did not end as it should; when it did (its outcome is
        recorded: nothing is lost by cutting the teardown short), within ENDED_TEARDOWN_S and with the outcome's
        exit code, so that the rank is gone before Slurm's KillWait runs out."""
        assert self.watchdog is not None
        from mgpu.watchdog import ENDED_TEARDOWN_S, HANG_EXIT_CODE, TEARDOWN_S

        if self._ended:
            self.watchdog.teardown(exit_code=self._ended_code, allowance_s=ENDED_TEARDOWN_S)
        else:
            self.watchdog.teardown(exit_code=HANG_EXIT_CODE, allowance_s=TEARDOWN_S)

    def _discard_if_unused(self, error: BaseException) -> None:
        """Bad input found before the run began leaves no trace of this attempt."""
        if isinstance(error, MgpuError) and not self._began and self._created is not None:
            discard(self.run, self.rank, self._created)

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
