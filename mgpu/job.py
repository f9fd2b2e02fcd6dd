"""A whole job on one rank: train, and when stopped by a signal, come back if and only if it should.

`run_job` is what `jobs/train.py` (plain, torchrun, srun from the sbatch templates) runs, and
`TrainJob` is the callable that `jobs/submit.py` hands to submitit. Both follow one protocol:

1. signal handlers (installed before the process group forms) only set flags;
2. the trainer's ranks agree at a step boundary, stop together and write one durable checkpoint;
3. rank 0 asks Slurm what happened (`mgpu.requeue.decide`) and requeues the job itself when Slurm
   will not (time limit; preemption with GraceTime > 0), never after a `scancel`, and not beyond
   the requeue budget (`MGPU_MAX_REQUEUES`, counted with Slurm's own restart counter);
4. every rank exits: code 0 when requeued or finished; under submitit a requeued job writes no
   result (the submitter keeps waiting), a cancelled or exhausted one raises so `job.result()`
   raises with the reason.
5. when a rank fails instead (an exception, or a peer killed: see `_requeue_after_failure`), one
   surviving rank asks the same question and requeues the job within the same budget, then the
   error propagates and the step ends FAILED.

This module imports no torch at import time: submitit unpickles `TrainJob` on the submitting side too.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from mgpu.config import Config, config_from_dict
from mgpu.environment import ProcessEnv, detect_environment
from mgpu.errors import MgpuError

__all__ = ["JobStopped", "TrainJob", "run_job"]

log = logging.getLogger("mgpu.job")
STOPPED_EXIT_CODE = 3
DEFAULT_MAX_REQUEUES = 10


class JobStopped(Exception):
    """The job stopped on a signal and will not come back (cancelled, or out of requeues)."""


def _max_requeues() -> int:
    value = os.environ.get("MGPU_MAX_REQUEUES", str(DEFAULT_MAX_REQUEUES))
    try:
        return int(value)
    except ValueError:
        raise MgpuError(f"MGPU_MAX_REQUEUES={value!r} is not an integer: set it to the number of requeues "
                        "allowed") from None


def run_job(cfg: Config, config_path: str | None = None, stop_at_step: int | None = None,
            env: ProcessEnv | None = None) -> dict[str, Any]:
    """Train this rank; on a stop, requeue or not (see the module docstring). Returns a summary.

    Raises SystemExit(0) on every rank once a requeue is under way, JobStopped when the job stays down.
    """
    from mgpu.preemption import StopRequest

    # First of all, before torch is imported: our handlers stay installed until the process exits, so
    # neither an early signal nor a late one reaches the default action or submitit's handler (which
    # would checkpoint inside the handler and requeue a second time).
    stop = StopRequest(cfg.preemption.signal).install()
    from mgpu.requeue import decide, requeue
    from mgpu.runner import run_training

    env = env or detect_environment()
    max_requeues = _max_requeues()
    in_slurm = env.launcher == "slurm" or "SLURM_JOB_ID" in os.environ
    if in_slurm and env.restart_count > max_requeues:
        _refuse_over_budget(cfg, env, max_requeues)
    handled: list[BaseException] = []

    def after_failure(error: BaseException) -> None:
        # Bad input (e.g. an unsafe config change on resume) is the same on every run: never requeued.
        if in_slurm and isinstance(error, Exception) and not isinstance(error, MgpuError) and not handled:
            handled.append(error)
            _requeue_after_failure(cfg, env, error, max_requeues)

    try:
        result, ledger = run_training(cfg, config_path, stop_at_step, env, stop, on_failure=after_failure)
    except Exception as error:
        after_failure(error)  # a failure before training started (e.g. the rendezvous); once only
        raise
    summary = {"status": result.status, "step": result.step, "epoch": result.epoch, "metrics": result.metrics,
               "checkpoint": str(result.checkpoint) if result.checkpoint else None}
    if result.status != "stopped":
        return summary
    decision = decide(set(result.reasons), in_slurm=in_slurm, job_id=env.job_id if in_slurm else None,
                      restarts=env.restart_count, max_requeues=max_requeues)
    if env.rank == 0:
        ledger.write("stop_decision", step=result.step, what=decision.event, requeue=decision.requeue,
                     reason=decision.why)
        log.info("stopped at step %d: %s", result.step, decision.why)
        if decision.requeue:
            outcome = requeue(env.job_id)
            ledger.write("requeued", step=result.step, how=outcome.how, message=outcome.message)
            log.info("requeue: %s", outcome.message)
    if decision.requeue or decision.event == "requeued_by_slurm":
        raise SystemExit(0)
    if env.rank == 0:
        raise JobStopped(f"stopped at step {result.step}: {decision.why}; checkpoint {summary['checkpoint']}")
    # Only rank 0 carries the failure: a non-zero exit here would make srun kill rank 0 before it
    # records why (submitit's result file).
    raise SystemExit(0)


def _requeue_after_failure(cfg: Config, env: ProcessEnv, error: BaseException, max_requeues: int) -> None:
    """A rank failed: its own exception, or a peer's death seen as a collective error. Come back if the
    budget allows, since nothing else will: srun ends the step (--kill-on-bad-exit), the batch script
    fails, and Slurm never requeues a FAILED job by itself.

    What srun does to the survivors when one task dies (measured, Slurm 22.05, KillWait=5): CONT+TERM
    to every other task ~10 ms later, KILL after KillWait. A survivor's next collective fails at once
    ("Connection closed by peer"; the TERM itself only sets the stop flag), which leaves it seconds
    to ask Slurm and requeue while the job is still RUNNING (the batch shell waits for srun).

    Exactly one rank acts, without talking to the others (their group is broken): the first to create
    `<run dir>/.failure-<job id>-<restart>` (O_EXCL; the run directory is on the filesystem every
    node shares, as the checkpoints are). It is rank 0 when rank 0 survives to fail first, else any
    survivor. It asks `mgpu.requeue.decide` as after a stop, with no stop reason: RUNNING -> requeue
    ("terminated") if the budget (MGPU_MAX_REQUEUES vs SLURM_RESTART_COUNT) remains; COMPLETING ->
    cancelled (never resurrected) or already requeued by Slurm. A deterministic bug therefore runs at
    most 1 + MGPU_MAX_REQUEUES times. The acting rank records `stop_decision` (with `error`, `rank`)
    and `requeued` in the ledger, and `failed` too when it is not rank 0 (rank 0 records its own).
    Never raises: the caller re-raises the original error, so the step still ends FAILED.
    """
    from mgpu.ledger import Ledger
    from mgpu.requeue import decide, requeue
    from mgpu.runner import resolve_run_dir

    message = f"rank {env.rank} failed: {type(error).__name__}: {error}"
    try:
        run_dir = resolve_run_dir(cfg, env)
        run_dir.mkdir(parents=True, exist_ok=True)
        claim = run_dir / f".failure-{env.job_id}-{env.restart_count}"
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            log.info("%s; another rank handles the requeue", message)
            return
        with os.fdopen(fd, "w") as file:
            file.write(f"{message}\n")
        ledger = Ledger(run_dir / "events.jsonl", env.job_id, env.restart_count)
        if env.rank != 0:
            ledger.write("failed", error=message, rank=env.rank)
        decision = decide(set(), in_slurm=True, job_id=env.job_id, restarts=env.restart_count,
                          max_requeues=max_requeues)
        ledger.write("stop_decision", what=decision.event, requeue=decision.requeue,
                     reason=f"after a failure: {decision.why}", error=message, rank=env.rank)
        log.error("%s; %s", message, decision.why)
        if decision.requeue:
            outcome = requeue(env.job_id)
            ledger.write("requeued", how=outcome.how, message=outcome.message, after="failure")
            log.error("requeue after the failure: %s", outcome.message)
    except Exception as inner:  # noqa: BLE001  (never hide the error that brought us here)
        log.error("%s; could not requeue after it: %s: %s", message, type(inner).__name__, inner)


def _refuse_over_budget(cfg: Config, env: ProcessEnv, max_requeues: int) -> None:
    """Slurm brought the job back more often than allowed (e.g. preemptions with GraceTime 0): stop now."""
    from mgpu.ledger import Ledger
    from mgpu.runner import resolve_run_dir

    message = (f"requeue budget exhausted: this is restart {env.restart_count} of at most {max_requeues} "
               f"(MGPU_MAX_REQUEUES); not training. Resubmit (or raise --max-requeues) to resume from the "
               f"last checkpoint in {resolve_run_dir(cfg, env)}")
    if env.rank != 0:
        raise SystemExit(0)
    Ledger(resolve_run_dir(cfg, env) / "events.jsonl", env.job_id, env.restart_count).write("failed", error=message)
    raise JobStopped(message)


class TrainJob:
    """The picklable callable submitit runs in every task (one per GPU)."""

    def __init__(self, config: dict[str, Any], config_path: str | None = None) -> None:
        self.config = config
        self.config_path = config_path

    def __call__(self) -> dict[str, Any]:
        return run_job(config_from_dict(self.config), self.config_path)
