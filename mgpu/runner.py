"""One rank's whole job: environment -> run directory -> process group -> trainer -> result.

`run_training` is the entry every launcher ends in: `jobs/train.py` (plain python or torchrun),
the sbatch templates, and the callable submitit pickles. Everything that can be checked without
peers (the config, the task import, the launcher's variables) is checked before the process
group is formed, so a bad input fails in one line instead of waiting for ranks that never come.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import shutil
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from mgpu.config import Config, save_config
from mgpu.environment import ProcessEnv, detect_environment
from mgpu.errors import MgpuError
from mgpu.ledger import Ledger
from mgpu.rundir import RunDir, RunInUse
from mgpu.task import build_task, import_task_class

__all__ = ["run_training", "setup_logging"]

log = logging.getLogger("mgpu.train")


def setup_logging(run: RunDir, rank: int) -> None:
    """Every rank logs to `<run>/logs/rank<N>.log`; rank 0 also to stdout (the batch log)."""
    root = logging.getLogger("mgpu")
    root.setLevel(logging.INFO)
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S")
    run.logs.mkdir(parents=True, exist_ok=True)
    try:
        file_handler = logging.FileHandler(run.rank_log(rank))
    except OSError as error:  # a run directory that exists on a read-only filesystem, or another user's
        raise MgpuError(f"run directory {run.path}: cannot write {run.rank_log(rank)} ({error.strerror}): make it "
                        f"writable for this user, or set run.root (or jobs/submit.py --folder) to a writable "
                        f"directory (a new run)") from None
    file_handler.setFormatter(formatter)
    root.addHandler(file_handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        root.addHandler(console)
    root.propagate = False
    # A handler that cannot write (a full disk) must not print a traceback per log line.
    logging.raiseExceptions = False


def _record_rank(run: RunDir, env: ProcessEnv, device: str, backend: str) -> None:
    """`logs/rank<N>.json`: who this rank was in this run (the launcher's view, for debugging and tests)."""
    import torch

    record = {**dataclasses.asdict(env), "device": device, "backend": backend, "hostname": socket.gethostname(),
              "slurmd_nodename": os.environ.get("SLURMD_NODENAME"), "pid": os.getpid(),
              "cpu_threads": torch.get_num_threads()}
    try:
        run.rank_record(env.rank).write_text(json.dumps(record, indent=1))
    except OSError as error:  # a full disk: the record is for debugging, training must not stop for it
        log.warning("cannot write %s: %s", run.rank_record(env.rank), error.strerror)


def run_training(cfg: Config, config_path: str | None = None, stop_at_step: int | None = None,
                 env: ProcessEnv | None = None, stop: Any = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> tuple[Any, Ledger]:
    """Train on this rank until finished, early-stopped or stopped by a signal.

    Returns (FitResult, the run's ledger). `stop`: an installed `StopRequest` (default: one installed
    for the duration of the call). `on_failure(error)`: called when training raises, while the process
    group still exists: tearing it down can block on a dead peer until srun's KILL, so whatever must
    happen after a failure (the requeue) happens first. torch is imported here, not at module import.
    """
    env = env or detect_environment()
    import_task_class(cfg.task.target)  # a bad import path fails here, before any peer waits
    run = RunDir.of(cfg.run)
    for path in (run.path, run.checkpoints, run.tensorboard):
        if path.exists() and not path.is_dir():
            raise MgpuError(f"{path} is a file, not a directory: move it away, or start another run (run.name=...)")
    created = _first_missing(run.path)  # what this attempt creates, to remove again if it never trains
    try:
        run.logs.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise MgpuError(f"run directory {run.path}: cannot create it ({error.strerror}): set run.root (or "
                        f"jobs/submit.py --folder) to a writable directory") from None
    setup_logging(run, env.rank)
    began: list[bool] = []
    try:
        return _train(cfg, config_path, stop_at_step, env, stop, on_failure, run, began)
    except MgpuError:
        if created is not None and not began:
            _discard(run, env.rank, created)  # bad input found before any training: leave no trace of the attempt
        raise


def _train(cfg: Config, config_path: str | None, stop_at_step: int | None, env: ProcessEnv, stop: Any,
           on_failure: Callable[[BaseException], None] | None, run: RunDir, began: list[bool]) -> tuple[Any, Ledger]:
    from mgpu.distributed import process_group
    from mgpu.preemption import StopRequest
    from mgpu.trainer import Trainer

    ledger = Ledger(run.ledger if env.rank == 0 else None, env.job_id, env.restart_count)
    started = time.time()
    # Signals are caught from here on: one arriving during the rendezvous or the resume is not lost.
    own_stop = stop is None
    stop = StopRequest(cfg.preemption.signal).install() if own_stop else stop
    with contextlib.ExitStack() as cleanup:
        if own_stop:
            cleanup.callback(stop.uninstall)
        ctx = cleanup.enter_context(process_group(
            env, timeout=timedelta(seconds=cfg.distributed.init_timeout_s),
            backend=None if cfg.distributed.backend == "auto" else cfg.distributed.backend))
        _record_rank(run, env, str(ctx.device), ctx.backend)
        _claim(run, env)
        watchdog = _start_watchdog(cfg, env, run, ctx.backend) if cfg.watchdog.enabled else None
        if watchdog is not None:
            cleanup.callback(watchdog.stop)  # before the group's teardown (the ExitStack unwinds in reverse)
        task = build_task(cfg.task.target, cfg.task.args)
        try:
            trainer = Trainer(cfg, task, ctx, run, ledger, stop, stop_at_step, watchdog)
            began.append(True)
            if env.rank == 0:
                # Only now: a resume refused for an unsafe config change leaves the run's config.yaml as it was.
                save_config(cfg, run.config)
                ledger.write("started", world_size=env.world_size, nodes=list(env.nodes), launcher=env.launcher,
                             config_path=config_path, device=str(ctx.device), backend=ctx.backend,
                             run_dir=str(run.path), git_sha=trainer.version)
                if trainer.resumed_from is not None:
                    p = trainer.progress
                    ledger.write("resumed", step=p.step, epoch=p.epoch, position=p.position,
                                 **{"from": str(trainer.resumed_from)}, skipped=trainer.resume_skipped)
            result = trainer.fit()
            # DDP's reducer must go while the group is alive: destroyed after it, its destructor joins a
            # gloo thread that waits for the GIL the destructor holds (an intermittent hang at exit).
            del trainer, task
            gc.collect()
        except BaseException as error:
            if env.rank == 0:
                # retry: whether a requeue can help; bad input or a full disk fails the same way again.
                ledger.write("failed", error=f"{type(error).__name__}: {error}",
                             retry=not isinstance(error, MgpuError))
            if on_failure is not None:
                on_failure(error)
            raise
        if env.rank == 0 and result.status != "stopped":
            ledger.write("finished", step=result.step, epoch=result.epoch, status=result.status,
                         seconds=round(time.time() - started, 3), metrics=result.metrics)
            run.release(env.job_id)
    log.info("%s at step %d (run directory %s)", result.status, result.step, run.path)
    return result, ledger


def _start_watchdog(cfg: Config, env: ProcessEnv, run: RunDir, backend: str) -> Any:
    from mgpu.watchdog import Watchdog, report_hang

    def on_hang(beats: Any, stuck: list[int], waited: float, detected: float) -> None:
        if backend == "nccl":
            _dump_nccl_trace(run, env.rank)
        report_hang(run, env.job_id, env.restart_count, env.rank, beats, stuck, waited, watchdog.allowance(),
                    detected)

    def log_file() -> Any:
        return next((h.stream for h in logging.getLogger("mgpu").handlers
                     if isinstance(h, logging.FileHandler)), None)

    w = cfg.watchdog
    watchdog = Watchdog(env.rank, env.world_size, run.logs, step_multiple=w.step_multiple, floor_s=w.floor_s,
                        first_step_s=w.first_step_s, checkpoint_s=w.checkpoint_s, on_hang=on_hang, log_file=log_file)
    return watchdog.start()


def _dump_nccl_trace(run: RunDir, rank: int) -> None:
    """NCCL's flight recorder (enabled by mgpu.distributed: TORCH_NCCL_TRACE_BUFFER_SIZE): what every
    collective in flight was doing, for torch's `torchfrtrace` analyser. Not run here (no GPU)."""
    try:
        import torch

        trace = torch._C._distributed_c10d._dump_nccl_trace()  # noqa: SLF001
        (run.logs / f"nccl-trace-rank{rank}.pkl").write_bytes(trace)
    except Exception as error:  # noqa: BLE001  (evidence is best effort; the exit must still happen)
        log.warning("NCCL flight recorder dump failed: %s", error)


def _first_missing(path: Path) -> Path | None:
    """The outermost directory of `path` that does not exist yet (None: `path` exists)."""
    missing = None
    while not path.exists() and path != path.parent:
        missing, path = path, path.parent
    return missing


def _discard(run: RunDir, rank: int, created: Path) -> None:
    """Remove what this attempt created in a run directory it created itself, up to `created` (each rank its
    own files, rank 0 the rest; the last to finish removes the emptied directories)."""
    root = logging.getLogger("mgpu")
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    if rank == 0:
        shutil.rmtree(run.path, ignore_errors=True)
    for path in (run.rank_log(rank), run.rank_record(rank)):
        path.unlink(missing_ok=True)
    directories = [run.logs, run.path, *[p for p in run.path.parents if created in (p, *p.parents)]]
    for directory in directories:
        with contextlib.suppress(OSError):
            directory.rmdir()


def _claim(run: RunDir, env: ProcessEnv) -> None:
    """Rank 0 claims the run directory; every rank fails alike if another live job holds it."""
    from mgpu.distributed import broadcast_object
    from mgpu.slurm_job import owns_slurm_job

    refusal = None
    if env.rank == 0:
        try:
            run.claim(env.job_id, slurm=owns_slurm_job())
        except MgpuError as error:
            refusal = str(error)
    refusal = broadcast_object(refusal)
    if refusal is not None:
        raise RunInUse(refusal)
