"""One rank's part in a run, for any training loop: who am I, the process group, stopping together,
checkpoints, and coming back. mgpu's trainer is built on it; a loop of your own uses it the same way:

    with mgpu.Session("runs/my-run", seed=0) as session:      # any launcher: srun, submitit, torchrun, python
        model = session.wrap(Net())                            # on this rank's device, in DDP
        optimizer = torch.optim.AdamW(model.parameters())
        loader = session.loader(train_set, batch_size=64, num_workers=2)
        state = {"model": model, "optimizer": optimizer, "loader": loader, "best": None}
        session.load(state)                                    # resume in place, if the run has a checkpoint
        for epoch in loader.epochs(10):
            for batch in loader:
                ...forward, backward, optimizer.step()...
                if session.should_stop():                      # every rank gets the same answer, same step
                    break
            session.save(state)
    # leaving the block (or session.finish()) after a stop: the job requeues (exit 0) or stays down (exit 3,
    # with the command that resumes); an exception: the failure is recorded, within the budget requeued,
    # and raised.

What a Session guarantees, and what it does not, is in README ("Your own loop").
"""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import logging
import os
import sys
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from mgpu.config import Config
from mgpu.environment import ProcessEnv, detect_environment
from mgpu.errors import MgpuError
from mgpu.fsutil import write_atomic
from mgpu.ledger import Ledger
from mgpu.outcome import STOPPED_EXIT_CODE, JobStopped, Outcome, StopBudgets, decide_after_stop, resume_command
from mgpu.preemption import StopRequest
from mgpu.recovery import Limits, handle_failure
from mgpu.rundir import RunDir
from mgpu.runner import claim, discard, first_missing, record_rank, setup_logging, start_watchdog
from mgpu.slurm_job import owns_slurm_job

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from mgpu.checkpoint import LoadedCheckpoint
    from mgpu.loader import ResumableLoader
    from mgpu.watchdog import Watchdog

__all__ = ["Session"]

log = logging.getLogger("mgpu.train")


def _no_beat(phase: str, step: int | None = None) -> None:
    """Without a watchdog, progress is not recorded."""


def _process_start() -> float:
    """This process's start (Unix time), from /proc (Linux); now, where it cannot be read."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class Session:
    """This rank's run. Construct it first (it catches the stop signals from then on), use it as a
    context manager or call `finish()` at the end. Every method marked *collective* must be called by
    every rank at the same point.

    `run_dir`: the run's directory (default `runs/run`, or the config's `run.*`): running the same
    command again, or a requeued job, continues from its newest checkpoint. `seed`: every rank's
    generators are seeded from it (rank r: seed + r). `config`: a `mgpu.Config` for everything else
    (`distributed`, `preemption`, `checkpoint`, `watchdog`, `train.seed`, `train.deterministic`, `run`).
    """

    def __init__(self, run_dir: str | Path | None = None, *, seed: int | None = None, config: Config | None = None,
                 stop_at_step: int | None = None, env: ProcessEnv | None = None, stop: StopRequest | None = None,
                 recovery_by_batch_script: bool | None = None) -> None:
        self.timings: dict[str, float] = {"process": _process_start(), "session": time.time()}
        """Unix times of this process's way to its first step (the ledger's `first_step` event has rank 0's)."""
        cfg = copy.deepcopy(config) if config is not None else Config()
        if run_dir is not None:
            cfg.run.dir = str(run_dir)
        if seed is not None:
            cfg.train.seed = seed
        self.cfg = cfg
        # First of all, before anything slow: from here on a signal is a stop request, never the default
        # action or submitit's handler (which would checkpoint inside the handler and requeue a second time).
        self.stop = stop if stop is not None else StopRequest(cfg.preemption.signal).install()
        self._own_stop = stop is None
        self._cleanup = contextlib.ExitStack()
        self._cleanup.callback(self._uninstall_stop)
        self._created: Path | None = None
        self._began = False
        try:
            self._start(env, stop_at_step, recovery_by_batch_script)
        except BaseException as error:
            self._cleanup.close()
            self._discard_if_unused(error)
            raise

    def _uninstall_stop(self) -> None:
        if self._own_stop:
            self.stop.uninstall()

    def _start(self, env: ProcessEnv | None, stop_at_step: int | None, by_batch: bool | None) -> None:
        cfg = self.cfg
        self.limits = Limits.from_environ()  # before torch is imported: a bad value fails in milliseconds
        self.env = env or detect_environment()
        self.rank, self.world_size, self.local_rank = self.env.rank, self.env.world_size, self.env.local_rank
        self.is_main = self.rank == 0
        self.run = RunDir.of(cfg.run)
        for path in (self.run.path, self.run.checkpoints, self.run.tensorboard):
            if path.exists() and not path.is_dir():
                raise MgpuError(f"{path} is a file, not a directory: move it away, or start another run "
                                f"(run.name=...)")
        self._created = first_missing(self.run.path)  # what this attempt creates, removed if it never trains
        try:
            self.run.logs.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise MgpuError(f"run directory {self.run.path}: cannot create it ({error.strerror}): set run.root "
                            f"(or jobs/submit.py --folder) to a writable directory") from None
        setup_logging(self.run, self.rank)
        self.slurm_job = self.env.job_id if owns_slurm_job() else None
        """The Slurm job this process belongs to, the only one it may ask about or requeue (None: none)."""
        self.budgets = StopBudgets.read(self.run, self.env, self.slurm_job, self.limits)
        self.budgets.refuse_if_spent(self.run, self.env)
        self._by_batch = by_batch
        self.ledger = Ledger(self.run.ledger if self.is_main else None, self.env.job_id, self.env.restart_count)
        self.started = time.time()

        from mgpu.distributed import process_group
        from mgpu.preemption import StopAgreement
        from mgpu.rng import seed_everything, use_deterministic_kernels

        # The watchdog outlives the group's teardown, which it bounds (see _arm_teardown): stopped after it.
        self.watchdog: Watchdog | None = None
        self._cleanup.callback(lambda: self.watchdog.stop() if self.watchdog is not None else None)
        ctx = self._cleanup.enter_context(process_group(
            self.env, timeout=timedelta(seconds=cfg.distributed.init_timeout_s),
            backend=None if cfg.distributed.backend == "auto" else cfg.distributed.backend, trace_dir=self.run.logs))
        self._cleanup.callback(self._release_ddp)  # runs before the group's teardown (reverse order)
        self.timings["group"] = time.time()
        self.device: torch.device = ctx.device
        self.backend = ctx.backend
        record_rank(self.run, self.env, str(self.device), self.backend)
        claim(self.run, self.env)
        announce = os.environ.get("MGPU_RUN_DIR_FILE")
        if announce and self.is_main:  # where slurm/loop.sbatch's recovery finds the run (its own script names it)
            write_atomic(Path(announce), str(self.run.path.resolve()).encode())
        if cfg.watchdog.enabled:
            self.watchdog = start_watchdog(cfg, self.env, self.run, self.backend)
            self._cleanup.callback(self._arm_teardown)
        self.beat: Callable[..., None] = self.watchdog.beat if self.watchdog is not None else _no_beat
        self.agreement = StopAgreement(self.stop)
        self._cleanup.callback(self.agreement.drain)
        self.clock = None
        if self.is_main and self.slurm_job and cfg.preemption.deadline_margin_s > 0:
            from mgpu.deadline import JobClock

            self.clock = JobClock(self.slurm_job).start()
            self._cleanup.callback(self.clock.stop)
        self._step_times: collections.deque[float] = collections.deque(maxlen=20)
        self._last_step_at: float | None = None
        self._check_every = cfg.preemption.check_every_steps  # None: about once a second
        self.stop_at_step = stop_at_step
        use_deterministic_kernels(cfg.train.deterministic)
        seed_everything(cfg.train.seed + self.rank)
        self._checkpointer: Any = None
        self._ddps: list[weakref.ref[Any]] = []
        self._ddp_layouts: list[Any] = []  # [mgpu.ddp bucket layout] the checkpoint's, one per wrapped model
        self._state: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None
        self.step = 0
        """Optimizer steps done in the run (restored on resume): one per `should_stop()`."""
        self.resume_step = 0
        """The step this process started from (0 for a new run)."""
        self.resumed_from: Path | None = None
        self.resume_skipped: list[tuple[str, str]] = []
        self._deadline_too_short = False  # said once: the time limit is too short for a deadline stop
        self._resumed_at: dict[str, int] = {}  # epoch and position in the data, when the state says
        self.reasons: set[str] = set()
        """The stop reasons the ranks agreed on (empty: no stop)."""
        self._finished = False
        self._ended = False  # the run's outcome is recorded: a hang in the teardown after it is not a failure

    # ------------------------------------------------------------------ the model and the data
    def wrap(self, model: nn.Module, *, find_unused_parameters: bool = False, static_graph: bool = False) -> nn.Module:
        """`model` on this rank's device, in DistributedDataParallel when there are several ranks. On a resumed
        run its reducer gets the saved run's gradient buckets, so that it reduces exactly as the unbroken run
        did (mgpu.ddp). Call after `load()`, or before it: either works."""
        from mgpu.ddp import wrap

        model = model.to(self.device)
        if self.world_size == 1:
            return model
        ddp = wrap(model, self.device, find_unused_parameters, static_graph)
        self._ddps.append(weakref.ref(ddp))
        self._resume_ddp(len(self._ddps) - 1)  # [mgpu.ddp bucket layout]
        if self.watchdog is not None:  # entering DDP's forward (of the next step): this rank waits for the others
            ddp.register_forward_pre_hook(lambda module, args: self._beat_model())
        return ddp

    def _beat_model(self) -> None:
        # A loop that beats nothing else starts its step here; a step's first forward starts it, not each one.
        assert self.watchdog is not None
        following = self.step + 1
        self.beat("model", following if self.watchdog.step != following else None)

    def loader(self, dataset: Dataset, batch_size: int, *, shuffle: bool = True, drop_last: bool = False,
               num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None,
               **dataloader_options: Any) -> ResumableLoader:
        """This rank's batches of `dataset` (`batch_size` per rank), resumable at the exact sample on any
        number of ranks: put it in the state you `save()`. See mgpu.loader.ResumableLoader."""
        from mgpu.loader import ResumableLoader

        options = {"pin_memory": self.device.type == "cuda", **dataloader_options}
        return ResumableLoader(dataset, batch_size, rank=self.rank, world_size=self.world_size,
                               seed=self.cfg.train.seed, shuffle=shuffle, drop_last=drop_last,
                               num_workers=num_workers, collate_fn=collate_fn,
                               requeue_signal=self.cfg.preemption.signal, stopping=self._stopping,
                               agreed=lambda: self.stopping, **options)

    def eval_loader(self, dataset: Dataset, batch_size: int, *, num_workers: int = 0,
                    collate_fn: Callable[[list[Any]], Any] | None = None, **dataloader_options: Any) -> DataLoader:
        """This rank's share of an evaluation set: samples rank, rank + W, ... (each sample on exactly one
        rank; counts differ by at most one). Reduce sums and counts across ranks with `all_reduce`."""
        from mgpu.data import eval_shard
        from mgpu.loader import make_loader

        indices = eval_shard(len(dataset), self.rank, self.world_size)  # type: ignore[arg-type]
        batches = [indices[i:i + batch_size] for i in range(0, len(indices), batch_size)]
        return make_loader(dataset, batches, num_workers=num_workers, seed=self.cfg.train.seed, epoch=0,
                           rank=self.rank, requeue_signal=self.cfg.preemption.signal, collate_fn=collate_fn,
                           **{"pin_memory": self.device.type == "cuda", **dataloader_options})

    def all_reduce(self, value: Any, op: str = "sum") -> torch.Tensor:
        """*Collective.* `value` (a tensor or a number) reduced over the ranks: sum, mean, max or min."""
        from mgpu.distributed import all_reduce

        return all_reduce(value, op, device=self.device)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ stopping together
    def should_stop(self, step: int | None = None, save: bool = True) -> bool:
        """*Collective*, once per optimizer step, after `optimizer.step()`: True when the ranks agreed to
        stop at this step (a signal reached any of them). Every rank gets the same answer at the same
        step; it costs nothing measurable (an asynchronous all-reduce about once a second, read one step
        later). On True the state given to `load()`/`save()` is saved at once and durably (`save=False`:
        the caller saves it), so nothing the loop does after it (an evaluation, its DataLoader's random
        draw) can change what resumes. `step`: the step just done, for a loop that counts its own
        (default: one more than the last call)."""
        self.step = self.step + 1 if step is None else step
        now = time.monotonic()
        if self._last_step_at is not None:
            self._step_times.append(now - self._last_step_at)
        self._last_step_at = now
        if self.step == self.resume_step + 1:
            self._after_first_step()
        self._check_deadline()
        if self.stop_at_step is not None and self.step == self.stop_at_step:
            reasons = {"test"}  # a deterministic stop, the same step on every rank: nothing to agree on
        else:
            reasons = self.agreement.at_step(self.step, self._check_every)
        if self.watchdog is not None:
            # The step's end; a loop whose forwards the watchdog does not see (no `wrap`) advances its step here.
            self.beat("agree", self.step if self.watchdog.step < self.step else None)
        if reasons:
            self.reasons |= reasons
            if save and self._state is not None:
                self.save(reason="preemption", wait=True)
            return True
        return False

    def poll_stop(self) -> bool:
        """*Collective*, between steps (e.g. every evaluation batch that every rank has): whether the ranks
        agreed to stop, pipelined like `should_stop`. A long evaluation then does not hold a stop."""
        self.beat("agree")
        self._check_deadline()
        reasons = self.agreement.poll()
        self.reasons |= reasons
        return bool(reasons)

    def _check_deadline(self) -> None:
        """Rank 0, under Slurm: request a stop when the job's end is closer than what a stop needs."""
        if self.clock is None or self.stop.pending or not self._step_times:
            return
        from mgpu.deadline import time_needed

        every = self.agreement.auto_every if self._check_every is None else self._check_every
        longest = self._checkpointer.longest_write_s if self._checkpointer is not None else 0.0
        needed = time_needed(max(self._step_times), every, longest, self.cfg.preemption.deadline_margin_s,
                             self.clock.limit_s)
        if self.clock.too_short(needed):
            if not self._deadline_too_short:
                self._deadline_too_short = True
                log.warning("a stop needs %.0f s, more than half the job's time limit (%.0f s): no stop before "
                            "the limit, only on Slurm's signal (--signal); give the job a longer --time",
                            needed, self.clock.limit_s or 0)
            return
        if self.clock.too_close(time.time(), needed):
            log.info("stopping before the job's time limit: %.0f s left, a stop needs %.0f s (steps of %.1f s, a "
                     "checkpoint write of %.1f s, preemption.deadline_margin_s %.0f)",
                     (self.clock.end or 0) - time.time(), needed, max(self._step_times), longest,
                     self.cfg.preemption.deadline_margin_s)
            self.stop.request("deadline")

    @property
    def stopping(self) -> bool:
        """The ranks agreed to stop (after `should_stop()` or `poll_stop()` said so)."""
        return bool(self.reasons)

    def _stopping(self) -> bool:
        # For the loaders: a stop is requested on this rank, or agreed (a dead worker is then not a crash).
        return bool(self.reasons) or self.stop.pending

    def _after_first_step(self) -> None:
        """Every rank reached a first step: collectives need no rendezvous allowance any more (a hung peer
        then fails a collective in minutes, not in distributed.init_timeout_s)."""
        from mgpu.distributed import set_collective_timeout

        seconds = None
        if self.watchdog is not None and self.world_size > 1:
            seconds = round(self.watchdog.collective_timeout(self.cfg.watchdog.collective_timeout_s), 1)
            set_collective_timeout(timedelta(seconds=seconds), self.agreement.group)
        self.timings["first_step"] = time.time()
        self.ledger.write("first_step", step=self.step, collective_timeout_s=seconds,
                          timings={k: round(v, 3) for k, v in self.timings.items()})

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpointer(self) -> Any:
        if self._checkpointer is None:
            from mgpu.checkpointer import Checkpointer

            c = self.cfg.checkpoint
            self._checkpointer = Checkpointer(self.run, self.rank, self.world_size, self.ledger,
                                              keep_last=c.keep_last, async_save=c.async_save,
                                              keep_snapshot_buffers=c.keep_snapshot_buffers, beat=self.beat)
            self._cleanup.callback(self._checkpointer.close)
        return self._checkpointer

    def latest(self) -> LoadedCheckpoint | None:
        """*Collective.* The run's newest checkpoint that verifies (rank 0 checks it), loaded memory-mapped
        on every rank; None for a new run. `restore()` puts it back."""
        self.timings["find"] = time.time()
        loaded = self.checkpointer.find_latest()
        self.timings["loaded"] = time.time()
        return loaded

    def restore(self, loaded: LoadedCheckpoint, state: dict[str, Any]) -> None:
        """Put `loaded` back into `state` (see `load`) and this rank's random generators."""
        from mgpu.train_state import restore_state

        restore_state(loaded.state, state, self.rank, self.cfg.train.seed)
        self.timings["restored"] = time.time()
        self.step = self.resume_step = loaded.step
        self._ddp_layouts = list(loaded.state.get("ddp") or [])  # [mgpu.ddp bucket layout]
        for index in range(len(self._ddps)):  # wrapped before the resume: their saved buckets now
            self._resume_ddp(index)
        self.resumed_from = loaded.path
        self.resume_skipped = [(str(bad), reason) for bad, reason in loaded.skipped]
        # Where in the data it resumes, for the ledger: the trainer's Progress or a loop's loader.
        self._resumed_at = next(({"epoch": value.epoch, "position": value.position} for value in state.values()
                                 if isinstance(getattr(value, "epoch", None), int)
                                 and isinstance(getattr(value, "position", None), int)), {})
        self._state = state

    def load(self, state: dict[str, Any]) -> bool:
        """*Collective.* Resume `state` in place from the newest checkpoint, if the run has one: objects with
        `load_state_dict` (model, optimizer, scheduler, scaler, loader, ...) load theirs, other values are
        replaced in the dict. Returns whether it resumed. `state` is also what a stop saves."""
        loaded = self.latest()
        if loaded is not None:
            self.restore(loaded, state)
        self._state = state
        self.begin()
        return loaded is not None

    def save(self, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None, *, best: bool = False,
             wait: bool = False, reason: str | None = None, meta: dict[str, Any] | None = None) -> Path | None:
        """*Collective.* Checkpoint `state` (default: the one given to `load()`) at the current step: every
        `state_dict()` in it, its plain values, and every rank's RNG state; atomic and verified, written
        in the background unless `wait`. `best`: also the run's best checkpoint. Returns the path once
        durable (with `wait`, on rank 0). A background save that fails is reported and the next one tries
        again; a save with `wait` that fails raises the same one-line error on every rank."""
        from mgpu.train_state import gather_state

        state = self._state if state is None else state
        if state is None:
            raise MgpuError("Session.save(): nothing to save: pass the state (or load() it first)")
        self._state = state
        self.begin()
        objects = state() if callable(state) else state
        return self.checkpointer.save(lambda: self._with_ddp_layouts(gather_state, objects), self.step,
                                      reason or ("best" if best else "periodic"), is_best=best, wait=wait,
                                      extra=meta)

    # [mgpu.ddp bucket layout] every wrapped model's gradient buckets (and comm hook state), saved beside the
    # state under "ddp" and given back to the resumed DDPs: they reduce as the unbroken run (mgpu.ddp).
    def _with_ddp_layouts(self, gather: Callable[..., Any], objects: Mapping[str, Any]) -> Any:
        from mgpu.ddp import bucket_layout

        layouts = [bucket_layout(ref()) for ref in self._ddps]  # a collective, on every rank
        state = gather(objects, self.version)
        if state is not None and any(layout is not None for layout in layouts):
            state["ddp"] = layouts
        return state

    def _resume_ddp(self, index: int) -> None:
        ddp = self._ddps[index]()
        if ddp is not None and index < len(self._ddp_layouts) and self._ddp_layouts[index] is not None:
            ddp.resume_layout(self._ddp_layouts[index])

    @property
    def run_id(self) -> str:
        """[run id for loggers] The run's identity for loggers: the same for every requeue and resubmission of
        this run directory, another for another run (`wandb.init(id=session.run_id, resume="allow")`
        continues one wandb run across requeues; the trainer's wandb uses it too)."""
        from mgpu.reporting import wandb_run_id

        return wandb_run_id(self.run.path)

    @property
    def version(self) -> str | None:
        """The git commit of mgpu's checkout (`+dirty` with local changes), saved in every checkpoint."""
        if not hasattr(self, "_version"):
            from mgpu.train_state import code_version

            self._version = code_version()
        return self._version

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
                          **{"git_sha": self.version, **fields})
        if self.resumed_from is not None:
            self.ledger.write("resumed", step=self.step, **self._resumed_at, **{"from": str(self.resumed_from)},
                              skipped=self.resume_skipped)

    def finish(self) -> None:
        """End this rank's run and act on it: after a stop, save the state (if not saved at this step already)
        and decide, on rank 0 alone, whether the job comes back; then leave the process group. Returns when
        the run finished; exits the process (SystemExit(0)) when the job is requeued (or on a rank other
        than 0 after a stop), and with code 3, after one line with the command that resumes, when it stays
        down. The context manager calls it on leaving the block."""
        outcome = self.end()
        if outcome.kind in ("requeued", "other_rank"):
            raise SystemExit(0)
        if outcome.kind == "stays_down":
            print(f"mgpu: {outcome.message}", file=sys.stderr, flush=True)
            raise SystemExit(STOPPED_EXIT_CODE)

    def end(self, status: str | None = None, **fields: Any) -> Outcome:
        """`finish()` without acting on the outcome: returns what happens to the job (the trainer's way out).
        `status`: finished, early_stopped or stopped (default: stopped if the ranks agreed to stop); `fields`
        go into the ledger's `finished` event."""
        if self._finished:
            raise MgpuError("the session has ended already (finish() or end() was called)")
        try:
            outcome = self._conclude(status, fields)
        except BaseException as error:  # the stop's save failed: recorded like any failure, then raised
            self.fail(error)
            raise
        self._finished = self._ended = True
        self._close()
        return outcome

    def _conclude(self, status: str | None, fields: dict[str, Any]) -> Outcome:
        stopped = bool(self.reasons) if status is None else status == "stopped"
        path = None
        if self._state is not None:
            path = self.save(reason="preemption" if stopped else "final", wait=True)
        if not stopped:
            self.ledger.write("finished", step=self.step, status=status or "finished",
                              seconds=round(time.time() - self.started, 3), **fields)
            if self.is_main:
                self.run.release(self.env.job_id)
            return Outcome("finished")
        log.info("stopping at step %d (%s; signals on this rank: %s)", self.step, ", ".join(sorted(self.reasons)),
                 [name for name, _ in self.stop.received])
        self.ledger.write("preempted", step=self.step, reasons=sorted(self.reasons),
                          signals=[name for name, _ in self.stop.received],
                          signal_times=[round(t, 3) for _, t in self.stop.received])
        outcome = decide_after_stop(set(self.reasons), self.step, self.resume_step, str(path) if path else None,
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
        if self.is_main:
            # retry: whether a requeue can help; bad input or a full disk fails the same way again.
            self.ledger.write("failed", error=f"{type(error).__name__}: {error}",
                              retry=not isinstance(error, MgpuError))
        by_batch = self._by_batch if self._by_batch is not None else os.environ.get("MGPU_RECOVERY") == "batch"
        if self.slurm_job and isinstance(error, Exception) and not isinstance(error, MgpuError) and not by_batch:
            _, what = handle_failure(self.run, self.slurm_job, self.env.restart_count, self.limits,
                                     f"rank {self.rank} failed: {type(error).__name__}: {error}", rank=self.rank)
            log.error("rank %d failed: %s: %s; %s", self.rank, type(error).__name__, error, what)
        self._close()
        self._discard_if_unused(error)

    def _close(self) -> None:
        self._cleanup.close()

    def _arm_teardown(self) -> None:
        """From here the watchdog bounds the group's teardown (a dead peer can block it): past its allowance,
        stacks to the log and an exit, 0 when the run ended as it should (its outcome is recorded), else 4."""
        assert self.watchdog is not None
        from mgpu.watchdog import HANG_EXIT_CODE

        self.watchdog.teardown(exit_code=0 if self._ended else HANG_EXIT_CODE)

    def _release_ddp(self) -> None:
        # DDP's reducer must go while the group is alive: destroyed after it, its destructor joins a gloo
        # thread that waits for the GIL the destructor holds (an intermittent hang at exit).
        for ref in self._ddps:
            ddp = ref()
            if ddp is not None:
                ddp.__dict__.pop("reducer", None)
                ddp.__dict__.pop("logger", None)
        gc.collect()

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
