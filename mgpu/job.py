"""A whole job on one rank: train, and when stopped by a signal, come back if and only if it should.

`run_job` is what `jobs/train.py` (plain, torchrun, srun from the sbatch templates) runs, and
`TrainJob` is the callable that `jobs/submit.py` hands to submitit. Both follow one protocol:

1. signal handlers (installed before the process group forms) only set flags;
2. the trainer's ranks agree at a step boundary, stop together and write one durable checkpoint;
3. rank 0, and only rank 0, asks Slurm what happened (`mgpu.requeue.decide`) and requeues the job
   itself when Slurm will not (time limit; preemption with GraceTime > 0), never after a `scancel`,
   and not beyond `MGPU_MAX_REQUEUES` stop requeues (default: no limit; see `mgpu.recovery.Limits`).
   A run that made no progress at all is counted against the failure budget instead, so a job whose
   time limit leaves no time to train does not requeue forever;
4. every rank exits: code 0 when requeued or finished; under submitit a requeued job writes no
   result (the submitter keeps waiting), a cancelled or exhausted one raises so `job.result()`
   raises with the reason, which ends with the exact command that resumes the run.
5. when a rank fails instead, the batch script requeues the job after srun returns, within the
   failure budget (`mgpu.recovery`); where the script does not (`MGPU_RECOVERY` unset), the first
   surviving rank does it before its process group is torn down.

Slurm is asked about a job only when it is this process's own (`mgpu.slurm_job.owns_slurm_job`).
This module imports no torch at import time: submitit unpickles `TrainJob` on the submitting side too.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from typing import TYPE_CHECKING, Any

from mgpu.config import Config, config_from_dict
from mgpu.environment import ProcessEnv, detect_environment
from mgpu.errors import MgpuError

if TYPE_CHECKING:
    from mgpu.requeue import Budget
    from mgpu.rundir import RunDir

__all__ = ["JobStopped", "TrainJob", "failure_note", "resume_command", "run_job"]

log = logging.getLogger("mgpu.job")
STOPPED_EXIT_CODE = 3


class JobStopped(Exception):
    """The job stopped on a signal and will not come back (cancelled, or out of requeues)."""


def resume_command(env: ProcessEnv) -> str:
    """The exact command that continues this run: what the submitter recorded, else this process's own."""
    if os.environ.get("MGPU_RESUME_COMMAND"):
        from mgpu.requeue import resume_command as recorded  # the templates' sbatch options, from accounting

        return recorded(ask=env.rank == 0)
    if env.launcher == "torchrun":
        return "the same torchrun command"
    return f"cd {shlex.quote(os.getcwd())} && {shlex.join([os.path.basename(sys.executable), *sys.argv])}"


def _task_frame(error: BaseException, target: str) -> str | None:
    """`file:line in function` of the innermost traceback frame in the task's own module, if any."""
    import importlib.util
    import traceback

    module = target.partition(":")[0]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    origin = os.path.realpath(spec.origin) if spec and spec.origin else None
    frames = [f for f in traceback.extract_tb(error.__traceback__) if origin and os.path.realpath(f.filename) == origin]
    if not frames:
        return None
    frame = frames[-1]
    return f"{os.path.relpath(frame.filename)}:{frame.lineno} in {frame.name}"


def failure_note(error: BaseException, cfg: Config, env: ProcessEnv | None = None) -> str:
    """The one line under a failure's traceback: where it came from, and what happens to the job now."""
    from mgpu.ledger import read_ledger
    from mgpu.recovery import Limits, failure_requeues
    from mgpu.rundir import RunDir
    from mgpu.slurm_job import owns_slurm_job

    where = _task_frame(error, cfg.task.target)
    what = (f"the task's code raised {type(error).__name__} at {where}" if where
            else f"training failed with {type(error).__name__}")
    try:
        env = env or detect_environment()
        run = RunDir.of(cfg.run)
        if not owns_slurm_job():
            return f"{what}; not a Slurm job, so nothing requeues it: fix it, then {resume_command(env)}"
        limits = Limits.from_environ()
        used = failure_requeues(read_ledger(run.ledger), env.job_id)
    except MgpuError as inner:
        return f"{what}; whether the job comes back is unknown ({inner})"
    if used >= limits.max_failures:
        return (f"{what}; the failure budget is spent ({used} of {limits.max_failures}): the job stays down; "
                f"fix it, then {resume_command(env)}")
    batch = os.environ.get("MGPU_RECOVERY") == "batch"  # the batch script restarts the step (mgpu.recovery)
    how, noun = ("starts again in this allocation", "restart") if batch else ("is requeued", "requeue")
    return (f"{what}; the job {how} from its last checkpoint (failure {noun} {used + 1} of "
            f"{limits.max_failures}), unless it was cancelled")


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
    from mgpu.ledger import read_ledger
    from mgpu.recovery import Limits, failure_requeues, handle_failure, stop_requeues as stops_used

    limits = Limits.from_environ()  # before torch is imported: a bad value fails in milliseconds
    from mgpu.requeue import Budget, decide, requeue
    from mgpu.rundir import RunDir
    from mgpu.runner import run_training
    from mgpu.slurm_job import owns_slurm_job

    env = env or detect_environment()
    run = RunDir.of(cfg.run)
    job_id = env.job_id if owns_slurm_job() else None
    events = read_ledger(run.ledger) if job_id else []
    failures = failure_requeues(events, job_id) if job_id else 0
    # Slurm's restart counter counts every requeue; the failure requeues are the ledger's to count.
    stop_requeues = Budget(stops_used(events, job_id, env.restart_count), limits.max_requeues)
    if job_id and stop_requeues.limit is not None and stop_requeues.used > stop_requeues.limit:
        _refuse_over_budget(run, env, stop_requeues)
    handled: list[BaseException] = []

    def after_failure(error: BaseException) -> None:
        # Bad input (e.g. an unsafe config change on resume) is the same on every run: never requeued;
        # where the batch script handles failures after srun (MGPU_RECOVERY=batch), it alone does.
        if (job_id and isinstance(error, Exception) and not isinstance(error, MgpuError) and not handled
                and os.environ.get("MGPU_RECOVERY") != "batch"):
            handled.append(error)
            _, outcome = handle_failure(run, job_id, env.restart_count, limits,
                                        f"rank {env.rank} failed: {type(error).__name__}: {error}", rank=env.rank)
            log.error("rank %d failed: %s: %s; %s", env.rank, type(error).__name__, error, outcome)

    try:
        result, ledger = run_training(cfg, config_path, stop_at_step, env, stop, on_failure=after_failure)
    except Exception as error:
        after_failure(error)  # a failure before training started (e.g. the rendezvous); once only
        raise
    summary = {"status": result.status, "step": result.step, "epoch": result.epoch, "metrics": result.metrics,
               "checkpoint": str(result.checkpoint) if result.checkpoint else None}
    if result.status != "stopped":
        return summary
    if env.rank != 0:
        # Rank 0 alone asks Slurm and acts; a non-zero exit here would make srun kill it first.
        raise SystemExit(0)
    progressed = result.step > result.resumed_step
    budget = stop_requeues if progressed else Budget(failures, limits.max_failures, "failure")
    decision = decide(set(result.reasons), job_id, env.restart_count, budget)
    why = decision.why if progressed else f"{decision.why} (this run made no progress)"
    ledger.write("stop_decision", step=result.step, what=decision.event, requeue=decision.requeue, reason=why)
    log.info("stopped at step %d: %s", result.step, why)
    if decision.requeue:
        outcome = requeue(job_id)  # type: ignore[arg-type]  (decide() requeues only a job of ours)
        ledger.write("requeued", step=result.step, how=outcome.how, message=outcome.message,
                     **({} if progressed else {"after": "no_progress"}))
        log.info("requeue: %s", outcome.message)
    if decision.requeue or decision.event == "requeued_by_slurm":
        raise SystemExit(0)
    run.release(env.job_id)
    raise JobStopped(f"stopped at step {result.step}: {why}; checkpoint {summary['checkpoint']}; to resume: "
                     f"{resume_command(env)}")


def _refuse_over_budget(run: RunDir, env: ProcessEnv, budget: Budget) -> None:
    """Slurm brought the job back more often than allowed (e.g. preemptions with GraceTime 0): stop now."""
    from mgpu.ledger import Ledger

    message = (f"requeue budget exhausted: this is restart {budget.used} of at most {budget.limit} "
               f"(MGPU_MAX_REQUEUES); not training. The last checkpoint in {run.path} is kept; to resume: "
               f"{resume_command(env)}")
    if env.rank != 0:
        raise SystemExit(0)
    Ledger(run.ledger, env.job_id, env.restart_count).write("failed", error=message, retry=False)
    raise JobStopped(message)


class TrainJob:
    """The picklable callable submitit runs in every task (one per GPU)."""

    def __init__(self, config: dict[str, Any], config_path: str | None = None) -> None:
        self.config = config
        self.config_path = config_path

    def __call__(self) -> dict[str, Any]:
        cfg = config_from_dict(self.config)
        try:
            return run_job(cfg, self.config_path)
        except (MgpuError, JobStopped, SystemExit):
            raise
        except Exception as error:
            print(f"mgpu: {failure_note(error, cfg)}", file=sys.stderr, flush=True)
            raise
