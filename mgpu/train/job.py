"""A whole job on one rank: train, and when stopped by a signal, come back if and only if it should.

`run_job` is what `jobs/train.py` (plain, torchrun, srun from the sbatch templates) runs, and
`TrainJob` is the callable that `jobs/submit.py` hands to submitit. Both follow one protocol:

1. signal handlers (installed before the process group forms) only set flags;
2. the trainer's ranks agree at a step boundary, stop together and write one durable checkpoint;
3. rank 0, and only rank 0, asks Slurm what happened (`mgpu.cluster.requeue.decide`) and requeues the job
   itself when Slurm will not (time limit; preemption with GraceTime > 0), never after a `scancel`,
   and not beyond `MGPU_MAX_REQUEUES` stop requeues (default: no limit; see `mgpu.record.budgets.Limits`).
   A run that made no progress at all is counted against the failure budget instead, so a job whose
   time limit leaves no time to train does not requeue forever;
4. every rank exits: code 0 when requeued or finished; under submitit a requeued job writes no
   result (the submitter keeps waiting), a cancelled or exhausted one raises so `job.result()`
   raises with the reason, which ends with the exact command that resumes the run.
5. when a rank fails instead, the batch script requeues the job after srun returns, within the
   failure budget (`mgpu.run.recovery`); where the script does not (`MGPU_RECOVERY` unset), the first
   surviving rank does it before its process group is torn down.

Slurm is asked about a job only when it is this process's own (`mgpu.cluster.slurm_job.owns_slurm_job`).
This module imports no torch at import time: submitit unpickles `TrainJob` on the submitting side too.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

from mgpu.config.loading import Config, config_from_dict
from mgpu.cluster.environment import ProcessEnv, detect_environment
from mgpu.errors import MgpuError
from mgpu.run.outcome import JobStopped, Outcome, exit_code, resume_command

__all__ = ["JobStopped", "TrainJob", "cli_exit_code", "failure_note", "local_rank", "resume_command", "run_job",
           "run_training"]

log = logging.getLogger("mgpu.train.job")


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


def hang_behind(error: BaseException, cfg: Config, env: ProcessEnv | None = None) -> dict[str, Any] | None:
    """This attempt's `hang` event when `error` only says that a peer went away (gloo's `Connection closed by
    peer`: mgpu.run.recovery.peer_consequence). The watchdog ends a hung rank only after every live rank wrote its
    stacks, and the hang is in the ledger before that rank exits; a rank whose collective then fails is part of that
    hang, not a failure of its own task code. None otherwise, or where the ledger cannot be read."""
    from mgpu.record.ledger import read_ledger
    from mgpu.record.rundir import RunDir
    from mgpu.run.recovery import peer_consequence
    from mgpu.run.unanswered import this_attempt

    if not peer_consequence(error):
        return None
    try:
        env = env or detect_environment()
        attempt = this_attempt(read_ledger(RunDir.of(cfg.run).ledger), env.job_id, env.restart_count)
    except (MgpuError, OSError):
        return None
    return next((dict(e) for e in reversed(attempt) if e.get("event") == "hang"), None)


def hang_note(hang: dict[str, Any], code: int) -> str:
    """The one line of a rank whose collective failed because the watchdog ended a hung peer."""
    ranks = [str(rank) for rank in hang.get("ranks") or []]
    phases = hang.get("phases") or {}
    where = ", ".join(f"rank {rank} in {phases.get(rank, 'an unknown phase')}" for rank in ranks) or "a rank"
    return (f"{where} hung after step {hang.get('step')} (the watchdog's verdict: the run's ledger holds its "
            f"evidence); this rank's collective failed as the hung rank was ended, not by the task's code: exit "
            f"{code}, as the hung rank's, so that the job comes back as after a hang")


def failure_note(error: BaseException, cfg: Config, env: ProcessEnv | None = None) -> str:
    """The one line under a failure's traceback: where it came from, and what happens to the job now."""
    from mgpu.record.ledger import read_ledger
    from mgpu.record.budgets import Limits, failure_requeues
    from mgpu.record.rundir import RunDir
    from mgpu.cluster.slurm_job import owns_slurm_job

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
    batch = os.environ.get("MGPU_RECOVERY") == "batch"  # the batch script restarts the step (mgpu.run.recovery)
    how, noun = ("starts again in this allocation", "restart") if batch else ("is requeued", "requeue")
    return (f"{what}; the job {how} from its last checkpoint (failure {noun} {used + 1} of "
            f"{limits.max_failures}), unless it was cancelled")


def cli_exit_code(load: Callable[[], Config], config_path: str | None, prog: str) -> int:
    """A rank's job as a command runs it (jobs/train.py, `jobs/submit.py --cluster local`): bad input or a full
    disk is one line and exit 2; a stop that stays down, one line with the resume command and exit 3; a
    collective failed because the watchdog ended a hung peer, one line naming the hang and exit 4 (as the hung
    rank's); a failure, its traceback, then one line saying what happens now, exit 1; else 0."""
    import traceback

    from mgpu.errors import exit_with

    cfg = None
    try:
        cfg = load()
        run_job(cfg, config_path=config_path)
    except MgpuError as error:
        exit_with(error, prog)
    except JobStopped as stopped:
        print(f"{prog}: {stopped}", file=sys.stderr, flush=True)
        return stopped.code
    except Exception as error:  # not the user's input: keep the traceback, then say what it means
        traceback.print_exc()
        hang = hang_behind(error, cfg) if cfg is not None else None
        if hang is not None:
            from mgpu.stop.watchdog import HANG_EXIT_CODE

            print(f"{prog}: {hang_note(hang, HANG_EXIT_CODE)}", file=sys.stderr, flush=True)
            return HANG_EXIT_CODE
        note = failure_note(error, cfg) if cfg is not None else f"{type(error).__name__} while reading the config"
        print(f"{prog}: {note}", file=sys.stderr, flush=True)
        return 1
    return 0


def local_rank(rank: int, config: dict[str, Any], config_path: str | None) -> None:
    """One rank of `jobs/submit.py --cluster local` (started by mgpu.spawn); exits with its code, fast once the
    outcome is recorded (mgpu.stop.process_exit: this process is the command's own)."""
    from mgpu.stop.process_exit import run_and_exit

    run_and_exit(lambda: cli_exit_code(lambda: config_from_dict(config), config_path, "submit"))


def run_job(cfg: Config, config_path: str | None = None, env: ProcessEnv | None = None) -> dict[str, Any]:
    """Train this rank; on a stop, requeue or not (see the module docstring). Returns a summary.

    Raises SystemExit(0) on every rank once a requeue is under way, JobStopped when the job stays down.
    """
    from mgpu.stop.preemption import install_stop_request

    # First of all, before torch is imported: these handlers stay installed until the process exits, so
    # neither an early signal nor a late one reaches the default action or submitit's handler (which
    # would checkpoint inside the handler and requeue a second time). The session finds them installed.
    install_stop_request(cfg.preemption.signal)
    result, outcome = run_training(cfg, config_path, env)
    summary = {"status": result.status, "step": result.step, "epoch": result.epoch, "metrics": result.metrics,
               "best_metrics": result.best_metrics, "best_step": result.best_step,
               "checkpoint": str(result.checkpoint) if result.checkpoint else None}
    if outcome.kind in ("stays_down", "unknown"):
        raise JobStopped(outcome.message, exit_code(outcome))
    if outcome.kind != "finished":
        raise SystemExit(exit_code(outcome))
    return summary


def run_training(cfg: Config, config_path: str | None = None, env: ProcessEnv | None = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> tuple[Any, Outcome]:
    """The trainer on a Session: (FitResult, what happens to the job). The stop signals are the session's
    (installed by it for the call, unless the process installed them first: mgpu.stop.preemption).
    `on_failure(error)` runs when training raises, while the process group still exists, before the
    session's own failure handling."""
    from mgpu.record.budgets import Limits

    Limits.from_environ()  # before torch is imported: a bad value fails in milliseconds
    env = env or detect_environment()
    from mgpu.config.loading import save_config
    from mgpu.run.session import Session
    from mgpu.train.task import build_task, import_task_class

    import_task_class(cfg.task.target)  # a bad import path fails here, before any peer waits
    session = Session(config=cfg, env=env, config_path=config_path)
    try:
        from mgpu.train.trainer import Trainer

        trainer = Trainer(cfg, build_task(cfg.task.target, cfg.task.args), session)
        if session.is_main:
            # Only now: a resume refused for an unsafe config change leaves the run's config.yaml as it was.
            save_config(cfg, session.run.config)
        result = trainer.fit()
        # DDP's reducers go while the group is alive: the session's end releases them (mgpu.parallel.ddp.SessionDDPs.release)
        # without a full collection here (0.2 s of CPU with torch loaded, in a stop's way to the exit).
        del trainer
    except BaseException as error:
        session.fail(error) if on_failure is None else _fail_with(session, error, on_failure)
        raise
    outcome = session.end(result.status, epoch=result.epoch, metrics=result.metrics,
                          best_metrics=result.best_metrics, best_step=result.best_step)
    log.info("%s at step %d (run directory %s)", result.status, result.step, session.run.path)
    return result, outcome


def _fail_with(session: Any, error: BaseException, on_failure: Callable[[BaseException], None]) -> None:
    on_failure(error)  # while the group exists, as the session's own failure handling
    session.fail(error)


class TrainJob:
    """The picklable callable submitit runs in every task (one per GPU)."""

    def __init__(self, config: dict[str, Any], config_path: str | None = None) -> None:
        self.config = config
        self.config_path = config_path

    def __call__(self) -> dict[str, Any]:
        cfg = config_from_dict(self.config)
        try:
            return run_job(cfg, self.config_path)
        except JobStopped as stopped:
            if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
                raise  # --cluster debug: the submitting process itself, where job.result() raises it
            # submitit's process exits 1 for any exception: the code mgpu set (3 stays down, 5 Slurm did not answer)
            # would not reach srun. Its result is written as submitit would (job.result() raises with the reason),
            # then the process exits with the code.
            _submitit_error(f"{type(stopped).__name__}: {stopped}")
            print(f"mgpu: {stopped}", file=sys.stderr, flush=True)
            raise SystemExit(stopped.code) from None
        except (MgpuError, SystemExit):
            raise
        except Exception as error:
            print(f"mgpu: {failure_note(error, cfg)}", file=sys.stderr, flush=True)
            raise


def _submitit_error(message: str) -> None:
    """The result submitit writes for a callable that raised (`job.result()` raises FailedJobError with it)."""
    try:
        from submitit import JobEnvironment
        from submitit.core import utils

        with utils.temporary_save_path(JobEnvironment().paths.result_pickle) as path:
            utils.cloudpickle_dump(("error", message), path)
    except Exception as error:  # noqa: BLE001  (the exit code still says it; the submitter then sees no result)
        log.warning("could not write submitit's result: %s: %s", type(error).__name__, error)
