"""The DDP training loop, top to bottom: resume, step, log, evaluate, checkpoint, stop.

One `Trainer` per rank, on a `mgpu.run.session.Session` (the process group, the stop agreement, the
checkpoints and the requeue decision, as any loop of a user's own gets them). Every rank runs the
same sequence of collectives in the same order: DDP's gradient all-reduce, the stop agreement, metric
reductions and checkpoint gathers happen at the same steps everywhere, decided only by the step count
and by values that were all-reduced first.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping

import torch
from torch import nn
from torch.utils.data import Dataset

from mgpu.state.single.store import LoadedCheckpoint
from mgpu.config.loading import Config, config_to_dict, dump_config, flatten_config, grad_accum_for
from mgpu.config.resume_compat import check_resume_compatible
from mgpu.data.sampling import eval_shard, plan_for
from mgpu.errors import MgpuError
from mgpu.train.evaluation import EvalInterrupted, check_metrics, evaluate, track_best
from mgpu.parallel.ema import EMA
from mgpu.parallel.fsdp import no_sync, plain, weights_fingerprint
from mgpu.train.log_window import LogWindow
from mgpu.train.loss_scaling import backward_per_sample, backward_summed, mean_over_units
from mgpu.train.metrics import LossSum
from mgpu.train.optim import optimizer_for, scheduler_for
from mgpu.parallel.precision import resolve_precision
from mgpu.record.reporting import Reporter, TaskLog, format_metrics
from mgpu.record.stragglers import rank_scalars
from mgpu.state.rng import seed_everything
from mgpu.run.session import Session
from mgpu.data.stream import ShardedStream, StreamFiles
from mgpu.train.step_batches import Step, StepBatches, to_device
from mgpu.train.task import Task, sized_dataset
from mgpu.state.train_state import Progress

__all__ = ["FitResult", "Trainer"]

log = logging.getLogger("mgpu.train")
STEP_ENDS_KEPT = 100_000  # a week of 6 s steps; bounded so that a long run does not grow it forever


@dataclass(frozen=True)
class FitResult:
    status: Literal["finished", "stopped", "early_stopped"]
    step: int
    epoch: int
    reasons: frozenset[str] = frozenset()
    """Why a stopped run stopped (see mgpu.stop.preemption.REASONS)."""
    checkpoint: Path | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    resumed_step: int = 0
    """The step this run started from (0 for a new run)."""
    best_metrics: dict[str, float] = field(default_factory=dict)
    """The evaluation that was best by eval.metric (empty: none yet), at `best_step`."""
    best_step: int | None = None


class Trainer:
    def __init__(self, cfg: Config, task: Task, session: Session) -> None:
        self.cfg, self.task, self.session, self.run = cfg, task, session, session.run
        self.beat, self.ledger = session.beat, session.ledger
        self.rank, self.world = session.rank, session.world_size
        self.device = session.device
        self.is_main = self.rank == 0
        self.config_dict = config_to_dict(cfg)

        # Checked before anything is built: an empty or streaming dataset fails here in one line.
        train_set = sized_dataset(task.train_dataset(), f"{type(task).__name__}.train_dataset()")
        self.eval_set: Dataset | None = sized_dataset(task.eval_dataset(), f"{type(task).__name__}.eval_dataset()",
                                                      optional=True)
        # Micro-steps per optimizer step: data.global_batch_size keeps the step's samples on any world size.
        self.accum = grad_accum_for(cfg, self.world)
        # A Stateful IterableDataset walks itself (its loader); anything else mgpu plans: a stream (mgpu.data.stream) is
        # trained as its samples by id, in the stream's own order per epoch.
        self.feed = StepBatches(cfg, task, self.rank, self.world, self.device, lambda: session.stop_requested)
        self.stream = self.feed.stateful_stream(train_set)
        self.stream_files = StreamFiles(train_set, log.warning) if isinstance(train_set, ShardedStream) else None
        if self.stream is None:
            self.train_set, self.plan = plan_for(train_set, cfg.data.batch_size, self.rank, self.world,
                                                 cfg.train.seed, cfg.data.shuffle)

        # The same initial weights everywhere (DDP also broadcasts rank 0's), then per-rank streams
        # so dropout and augmentation differ between ranks.
        seed_everything(cfg.train.seed)
        model = task.build_model()
        if cfg.train.sync_batchnorm and self.world > 1:
            if self.device.type == "cuda":
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            elif self.is_main:
                # PyTorch's SyncBatchNorm has no CPU kernel; the same config must still run on a laptop.
                log.warning("train.sync_batchnorm ignored: SyncBatchNorm needs GPUs; BatchNorm stays per rank")
        self.model: nn.Module = model.to(self.device)
        self.fsdp = cfg.train.parallel == "fsdp"
        if self.fsdp:  # [fsdp hook] sharded before the optimizer is built over its parameters (mgpu.parallel.fsdp)
            if cfg.optim.zero:
                raise MgpuError("optim.zero=true with train.parallel=fsdp: FSDP2 shards the optimizer state "
                                "already; set optim.zero=false")
            self.model = session.wrap(self.model, parallel="fsdp", shard_hook=task.shard)
        # once: asking CUDA every step would cost each step
        self.precision = resolve_precision(cfg.train.precision, self.device, warn=self.is_main)
        name = type(task).__name__
        self.optimizer = optimizer_for(task.optimizer(self.model), name, self.model, cfg.optim,
                                       distributed=self.world > 1)
        # After FSDP2's wrap (the average is sharded like the parameters it follows), before the load (it resumes).
        self.ema = EMA(self.model, cfg.train.ema_decay) if cfg.train.ema_decay is not None else None
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == torch.float16)
        loaded = session.latest()  # a look first: where the run stands sizes its schedule
        self.progress, override = self._resume_point(loaded)
        self.total_steps = self._total_steps()
        self._check_batch_norm_batches()
        self.scheduler = scheduler_for(task.scheduler(self.optimizer, self.total_steps), name, self.optimizer,
                                       cfg.schedule, self.total_steps)
        self._check_eval_metric()  # before the run counts as started (load): a broken metric leaves no trace
        if loaded is None:
            seed_everything(cfg.train.seed + self.rank)
        # The one way back: the session restores what _objects() names (and changes what `override` says).
        glob = cfg.data.global_batch_size
        session.load(self._objects(), override=override, global_batch=glob,
                     batch_size=cfg.data.batch_size * (1 if glob else self.accum))
        # DDP (several ranks); resumed, with the saved run's gradient buckets: it reduces as the unbroken run.
        self.ddp: nn.Module = self.model if self.fsdp else session.wrap(
            self.model, find_unused_parameters=cfg.train.find_unused_parameters, static_graph=cfg.train.static_graph)
        self.resume_step = session.resume_step
        self.resumed_from = session.resumed_from
        wandb = {"id": session.run_id, "project": cfg.log.wandb_project, "dir": str(self.run.path),
                 "name": self.run.path.name, "config": self.config_dict} if cfg.log.wandb else None
        self.reporter = Reporter(self.is_main, self.run.tensorboard if cfg.log.tensorboard else None,
                                 self.total_steps, self.resume_step, cfg.log.progress_bar, wandb=wandb)
        self.version = session.version
        self.window = LogWindow(self.device)  # the training metrics since the last log line
        task.log = TaskLog(self.reporter, lambda: self.progress.step)
        self._grad_norm = torch.zeros((), device=self.device)
        self._step_lr = self.optimizer.param_groups[0]["lr"]
        self.step_ends: collections.deque[float] = collections.deque(maxlen=STEP_ENDS_KEPT)
        """perf_counter() at the end of each of this run's latest optimizer steps (benchmarks read it)."""
        self._last_eval = -1  # the step of the last evaluation
        self._last_metrics: dict[str, float] = {}  # its metrics

    # ------------------------------------------------------------------ setup
    def _check_batch_norm_batches(self) -> None:
        """BatchNorm cannot train on one sample: fail now rather than at the end of the first epoch."""
        if self.stream is not None:
            return  # a stream's batch sizes are known only as it is read
        has_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.model.modules())
        starts = {self.progress.position, 0} if self.progress.epoch + 1 < self.cfg.train.epochs else {
            self.progress.position}
        if has_norm and min(self.plan.smallest_micro_batch(start) for start in starts) == 1:
            raise MgpuError(f"with {len(self.train_set)} samples, data.batch_size={self.cfg.data.batch_size} "
                            f"and {self.world} ranks, some rank gets a one-sample batch at the end of each epoch, "
                            f"which BatchNorm cannot train on: change data.batch_size")

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.precision)

    def _objects(self) -> dict[str, Any]:
        """What a checkpoint of this run holds (mgpu.state.train_state adds every rank's RNG state)."""
        objects = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "scaler": self.scaler,
                   "progress": self.progress, "config": self.config_dict}
        if self.ema is not None:
            objects["ema"] = self.ema
        if self.stream is not None:
            objects["loader"] = self.stream
        elif self.stream_files is not None:
            objects["stream"] = self.stream_files  # a resume on changed files is refused, naming the file
        return objects

    def _resume_point(self, loaded: LoadedCheckpoint | None) -> tuple[Progress, dict[str, Any]]:
        """Where the newest checkpoint stands (see mgpu.state.checkpointer), checked against this run's config, and
        the optimizer hyperparameters the config changes on purpose (`optim.lr`, `optim.weight_decay`)."""
        if loaded is None:
            return Progress(), {}
        saved = loaded.state["config"]
        changes = check_resume_compatible(saved, self.config_dict, saved_world=loaded.state.get("world_size"))
        if self.is_main:
            for change in changes:
                log.info("config changed on resume (safe): %s", change)
        optim = self.config_dict["optim"]
        override = {key: optim[key] for key in ("lr", "weight_decay") if saved.get("optim", {}).get(key) != optim[key]}
        return Progress(**loaded.state["progress"]), override

    def _total_steps(self) -> int:
        """Optimizer steps of the whole run: done so far + what is left from here on this world size."""
        if self.stream is not None:  # no length: train.max_steps (checked set) is the run's length
            return max(self.cfg.train.max_steps or 0, self.progress.step)
        accum = self.accum
        per_epoch = math.ceil(self.plan.micro_steps_left(0) / accum)
        p = self.progress
        left = 0
        if p.epoch < self.cfg.train.epochs:
            left = math.ceil(self.plan.micro_steps_left(p.position) / accum)
            left += (self.cfg.train.epochs - p.epoch - 1) * per_epoch
        total = p.step + left
        if self.cfg.train.max_steps is not None:
            total = min(total, self.cfg.train.max_steps)
        return max(total, p.step)

    # ------------------------------------------------------------------ data
    def _optimizer_steps(self) -> Iterator[Step]:
        """Groups of `accum` micro-batches, epoch after epoch, from the current position (mgpu.train.step_batches)."""
        plan, train_set = (None, None) if self.stream is not None else (self.plan, self.train_set)
        return self.feed.steps(self.progress, self.accum, plan, train_set, self.stream)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> FitResult:
        """Train from where the run stands to its end, a stop or early stopping; the run's last checkpoint."""
        p = self.progress
        self._announce()
        self.model.train()
        self.beat("data", p.step + 1)
        try:
            status = self._train()
            if status == "finished" and self.eval_set is not None and p.step != self._last_eval:
                _, stopped = self._evaluate_or_stop()
                status = "stopped" if stopped else status
            # The run's last checkpoint, the stop's included, is this loop's (its progress, eval_pending, metrics):
            # durable here, so the session's end() acts on it and saves nothing more.
            path = self._save("preemption" if status == "stopped" else "final", wait=True)
        finally:
            self.reporter.close()
        return FitResult(status, p.step, p.epoch, frozenset(self.session.reasons), path, self._last_metrics,
                         self.resume_step, dict(p.best_metrics), p.best_step)

    def _train(self) -> Literal["finished", "stopped", "early_stopped"]:
        """The steps, each top to bottom: its batches, forward and backward over the accumulation, clipping, the
        optimizer, the schedule, the stop agreement, the log, an evaluation, a checkpoint."""
        cfg, p, session = self.cfg, self.progress, self.session
        if p.eval_pending:  # a stop interrupted this step's evaluation: it comes first
            early, stopped = self._evaluate_or_stop()
            if early or stopped:
                return "early_stopped" if early else "stopped"
        for group in self._optimizer_steps():  # `accum` micro-batches (index plan, batch) per optimizer step
            if p.step >= self.total_steps:
                break
            session.timings.setdefault("first_batch", time.time())
            samples = self._forward_backward(group)  # DDP's gradient all-reduce runs once, in the last backward
            self._clip_gradients()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self._step_lr = self.optimizer.param_groups[0]["lr"]  # this step's; after scheduler.step() the next's
            self.scheduler.step()
            if self.ema is not None:
                self.ema.update()
            epoch_end = self._advance(group, samples)
            last = p.step >= self.total_steps
            # Every rank, every step: the same answer at the same step (this loop saves the stop itself).
            stop = session.should_stop(p.step, save=False)
            if self._log_due(p.step) or (not cfg.log.every_steps and epoch_end):
                with session.outside_step():  # rank 0's ledger and loggers are not its step's work
                    self._log_train()
            if stop and not last:
                # The stop's checkpoint is this step's; an evaluation due now comes first after the resume.
                p.eval_pending = self._eval_due(epoch_end)
                return "stopped"
            if self._eval_due(epoch_end):
                with session.outside_step():
                    early, stopped = self._evaluate_or_stop()
                if early or stopped:
                    return "early_stopped" if early else "stopped"
            if self._checkpoint_due(epoch_end):
                self._save("epoch" if epoch_end else "periodic")
            if last:
                break
            self.session.snapshot()  # this step's state into host memory when due (checkpoint.memory_every_steps)
            self.beat("data", p.step + 1)  # the next step begins with fetching its batches
        return "finished"

    def _announce(self) -> None:
        """The run's first lines: its hyperparameters to the loggers, where it starts, how big a step is."""
        p = self.progress
        if self.is_main:
            self.reporter.hparams(flatten_config(self.config_dict), dump_config(self.cfg))
            self.reporter.line(f"training {self.total_steps} steps on {self.world} rank(s), device "
                               f"{self.device}, from step {p.step} (epoch {p.epoch}, " + (
                                   f"sample {p.position}), {self.plan.global_batch * self.accum} samples a step "
                                   f"({self.accum} micro-step(s))" if self.stream is None
                                   else f"batch per rank {p.position}), {self.accum} micro-step(s) a step"))
        log.info("rank %d (pid %d) on %s starts at step %d", self.rank, os.getpid(), self.device, p.step)

    def _forward_backward(self, group: Step) -> int:
        """Forward, loss and backward over the step's micro-batches, the gradients accumulated locally until the
        last (no_sync), then made the mean over every real sample (or, for a LossSum, every unit) of the step.
        Returns the step's samples over all ranks."""
        total = sum(mb.global_count for mb, _ in group)
        weight: torch.Tensor | None = None  # a LossSum task's: this rank's units (tokens) in the step
        reduction = None
        for index, (mb, batch) in enumerate(group):
            last = index == len(group) - 1
            # no_sync: the micro-steps before the last only accumulate locally; DDP reduces once.
            sync = no_sync(self.ddp) if (self.world > 1 and not last) else contextlib.nullcontext()
            with sync:
                self.beat("forward")
                with self._autocast():
                    out = self.task.loss(self.ddp, to_device(batch, self.device))
                loss, extras = (out["loss"], {k: v for k, v in out.items() if k != "loss"}) if isinstance(
                    out, Mapping) else (out, {})
                self.beat("backward")
                if isinstance(loss, LossSum):
                    weight, reduction = backward_summed(loss, mb, weight, last, self.world, self.device, self.scaler,
                                                        self.window)
                else:
                    backward_per_sample(loss, mb, total, self.world, self.scaler, self.window, type(self.task).__name__)
            if extras:
                self.window.add_metrics(extras, mb.real, type(self.task).__name__)
        if weight is not None:
            mean_over_units(self.model, weight, self.world, reduction)
        return total

    def _clip_gradients(self) -> None:
        """Unscaled gradients, clipped to train.clip_grad_norm; their norm kept for the log line."""
        self.beat("optimizer")
        self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.train.clip_grad_norm
        if max_norm is not None or self._log_due(self.progress.step + 1):
            # Without clipping the norm is only for the log line: not computed on other steps.
            self._grad_norm = plain(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                                   max_norm if max_norm is not None else math.inf))

    def _advance(self, group: Step, samples: int) -> bool:
        """The step done: its end time, the step, the position in the data, the log window. Whether it ended an
        epoch."""
        p = self.progress
        self.step_ends.append(time.perf_counter())
        self.window.step_done(samples)
        p.step += 1
        p.position = group[-1][0].end_position
        p.samples_seen += sum(mb.global_count for mb, _ in group)
        epoch_end = group[-1][0].ends_epoch
        if epoch_end:
            p.epoch, p.position = p.epoch + 1, 0
        return epoch_end

    # ------------------------------------------------------------------ logging
    def _log_due(self, step: int) -> bool:
        every = self.cfg.log.every_steps
        return bool(every and step % every == 0) or step == self.total_steps

    def _log_train(self) -> None:
        # The only host sync of the step path: once per log interval, not per step.
        metrics = self.window.metrics(self._step_lr, float(self._grad_norm), self.task.tokens_per_sample())
        p = self.progress
        # [fsdp hook] sharded weights: every rank takes part in the fingerprint
        fingerprint = weights_fingerprint(self.model) if self.fsdp or self.is_main else None
        self.reporter.scalars(p.step, metrics, "train")
        self.reporter.progress(p.step, p.epoch, metrics)
        ranks = self.session.rank_times()  # rank 0's: every rank's step times, the slowest rank and its factor
        if ranks is not None:
            self.reporter.scalars(p.step, rank_scalars(ranks), "ranks")
        if self.is_main:
            # The heartbeat status reads, and a fingerprint of the weights two runs can be compared by.
            self.ledger.write("progress", step=p.step, epoch=p.epoch, total_steps=self.total_steps,
                              metrics={k: round(v, 6) for k, v in metrics.items()},
                              fingerprint=fingerprint, **({"ranks": ranks} if ranks is not None else {}))
        if not self.reporter.bar:
            self.reporter.line(f"step {p.step}/{self.total_steps} epoch {p.epoch}  {format_metrics(metrics)}")
        self.window.reset()

    # ------------------------------------------------------------------ evaluation
    def _eval_due(self, epoch_end: bool) -> bool:
        if self.eval_set is None:
            return False
        every = self.cfg.eval.every_steps
        return (every > 0 and self.progress.step % every == 0) or (every == 0 and epoch_end)

    def _check_eval_metric(self) -> None:
        """Fail now, not after the first epoch, if eval.metric is not one of the task's metrics or the
        metrics are not per-sample values, Ratios or Statistics (on a two-sample batch)."""
        if self.eval_set is None:
            return
        probe = list(range(min(2, len(self.eval_set))))  # type: ignore[arg-type]  # torch's Dataset declares no __len__
        batch = next(iter(self.feed.loader(self.eval_set, [probe], self.progress.epoch, workers=0)))
        self.model.eval()
        log, self.task.log = self.task.log, None  # the probe's texts are not an evaluation's
        with torch.no_grad(), self._autocast():
            values = self.task.metrics(self.model, to_device(batch, self.device))
        self.task.log = log
        self.model.train()
        check_metrics(values, len(probe), type(self.task).__name__, self.cfg.eval.metric)

    def evaluate(self) -> dict[str, float]:
        """Every metric over the whole eval set (mgpu.train.evaluation), the same on every rank. Raises
        EvalInterrupted when the ranks agree to stop midway."""
        assert self.eval_set is not None
        size = len(self.eval_set)  # type: ignore[arg-type]  # torch's Dataset declares no __len__
        indices = eval_shard(size, self.rank, self.world)
        batch_size = self.cfg.data.eval_batch_size or self.cfg.data.batch_size
        batches = [indices[i:i + batch_size] for i in range(0, len(indices), batch_size)]
        common = -(-(size // self.world) // batch_size)  # batches of the rank with the fewest samples
        on_device = (to_device(batch, self.device)
                     for batch in self.feed.batches(self.eval_set, batches, self.progress.epoch))
        # [fsdp hook] a sharded model's forward is a collective: every rank runs as many as rank 0 has batches
        most = math.ceil(math.ceil(size / self.world) / batch_size) if self.fsdp else 0
        # train.ema_decay: the average is evaluated (the model holds its weights inside the block, its own after it)
        with self.ema.applied() if self.ema is not None else contextlib.nullcontext():
            return evaluate(self.model, on_device, common, self.task.metrics, self.session.poll_stop, self.beat,
                            self._autocast(), self.device, self.world, even_forwards=most)

    def _evaluate_or_stop(self) -> tuple[bool, bool]:
        """(early stopping says stop, the ranks agreed to stop midway: the evaluation is left pending)."""
        try:
            return self._evaluate_and_track(), False
        except EvalInterrupted:
            self.progress.eval_pending = True
            return False, True

    def _evaluate_and_track(self) -> bool:
        """Evaluate, log, keep the best checkpoint; True when early stopping says stop."""
        cfg, p = self.cfg.eval, self.progress
        metrics = self.evaluate()
        p.eval_pending = False
        self._last_eval, self._last_metrics = p.step, metrics
        improved, exhausted = track_best(p, metrics, cfg)
        self.reporter.scalars(p.step, metrics, "eval")
        self.reporter.flush_texts(p.step)  # what the task logged as text during the evaluation
        best = "  (best)" if improved else f"  (best {cfg.metric} {p.best_metric:.4g} at step {p.best_step})"
        self.reporter.line(f"eval step {p.step}  {format_metrics(metrics)}{best}")
        if self.is_main:
            self.ledger.write("evaluated", step=p.step, metrics=metrics, best=improved)
        if improved and self.cfg.checkpoint.keep_best:
            self._save("best", is_best=True)
        if exhausted:
            if self.is_main:
                self.ledger.write("early_stopped", step=p.step, metric=cfg.metric, best=p.best_metric)
            self.reporter.line(f"early stopping at step {p.step}: {cfg.metric} did not improve in "
                               f"{cfg.early_stopping_patience} evaluations (best {p.best_metric:.4g})")
            return True
        return False

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_due(self, epoch_end: bool) -> bool:
        every = self.cfg.checkpoint.every_steps
        return (every > 0 and self.progress.step % every == 0) or (every == 0 and epoch_end)

    def _save(self, reason: str, is_best: bool = False, wait: bool = False) -> Path | None:
        """Checkpoint the current step (a collective; see Session.save)."""
        p = self.progress
        meta = {"epoch": p.epoch, "metrics": self._last_metrics}
        return self.session.save(self._objects, best=is_best, wait=wait, reason=reason, meta=meta)
