"""After a failed training step: requeue the job within its failure budget. No torch.

When a rank dies (OOM, SIGKILL, a crash, a hung NCCL call), `srun --kill-on-bad-exit` ends the step
and the batch script goes on. Slurm never requeues a FAILED job by itself, so something must ask for
it, and it cannot be a training rank: with NCCL the survivors sit in CUDA waits where no Python runs
until srun's KILL. The batch script can: after srun returns it runs

    python -m mgpu.recovery --exit-code $? --run-dir DIR            (jobs/submit.py's teardown line)
    python -m mgpu.recovery --exit-code $? --config CFG [k=v ...]   (slurm/*.sbatch)

and this module decides. A run that stopped cleanly has already decided (its `stop_decision` is in
the ledger) and is left alone; a deterministic failure (bad input, a full disk: `failed` with
`retry: false`) is not requeued into the same wall; anything else is requeued while the job is still
RUNNING and the failure budget (`MGPU_MAX_FAILURES` per job, default 3) allows. Scripts without
this line fall back on the first surviving rank doing the same (`mgpu.job`), deduplicated by the
`.failure-<job>-<restart>` claim either way.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from mgpu.errors import USAGE_EXIT_CODE, MgpuError
from mgpu.ledger import Ledger, read_ledger
from mgpu.requeue import Budget, decide, requeue
from mgpu.rundir import RunDir
from mgpu.slurm_job import owns_slurm_job

__all__ = ["DEFAULT_MAX_FAILURES", "Limits", "failure_requeues", "handle_failure", "main"]

log = logging.getLogger("mgpu.job")
DEFAULT_MAX_FAILURES = 3
FAILURE_KINDS = ("failure", "no_progress")


@dataclass(frozen=True)
class Limits:
    """The job's requeue limits, from the variables jobs/submit.py and the templates export.

    `max_requeues` bounds requeues after a stop (preemption, time limit, the user signal, an outside
    requeue): None (the default) is no limit, since a long run lives by them. `max_failures` bounds
    requeues after a failure or a run that made no progress, per job: a crash loop ends there.
    """

    max_requeues: int | None = None
    max_failures: int = DEFAULT_MAX_FAILURES

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "Limits":
        environ = os.environ if environ is None else environ

        def read(name: str, default: int | None) -> int | None:
            text = environ.get(name, "").strip()
            if text in ("", "none", "unlimited"):
                return default
            if not text.isdigit():
                raise MgpuError(f"{name}={text!r} is not a count: set it to an integer >= 0 (or unset it)")
            return int(text)

        failures = read("MGPU_MAX_FAILURES", DEFAULT_MAX_FAILURES)
        return cls(read("MGPU_MAX_REQUEUES", None), DEFAULT_MAX_FAILURES if failures is None else failures)


def failure_requeues(events: Sequence[Mapping[str, Any]], job_id: str) -> int:
    """Requeues of `job_id` after a failure or a run without progress, as the ledger recorded them."""
    return sum(1 for e in events if e.get("event") == "requeued" and e.get("job_id") == job_id
               and e.get("after") in FAILURE_KINDS)


def _handled(events: Sequence[Mapping[str, Any]], job_id: str, restart: int) -> Mapping[str, Any] | None:
    """This run's own stop decision, or its non-retryable failure, if it recorded one."""
    for event in reversed(events):
        if event.get("job_id") != job_id or event.get("restart") != restart:
            continue
        if event.get("event") == "stop_decision" or (event.get("event") == "failed" and event.get("retry") is False):
            return event
    return None


def handle_failure(run: RunDir, job_id: str, restart: int, limits: Limits, message: str,
                   rank: int | None = None) -> str:
    """Requeue job `job_id` after run `restart` failed with `message`, if it should; returns what was done.

    Exactly one caller acts: the first to create the run's failure claim. Never raises."""
    try:
        run.path.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(run.failure_claim(job_id, restart), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return "another process handles this failure"
        with os.fdopen(fd, "w") as file:
            file.write(f"{message}\n")
        events = read_ledger(run.ledger)
        ledger = Ledger(run.ledger, job_id, restart)
        handled = _handled(events, job_id, restart)
        if handled is not None:
            return f"nothing to do: the run recorded {handled['event']} ({handled.get('reason') or handled.get('error')})"
        who = {} if rank is None else {"rank": rank}
        if rank not in (None, 0):
            ledger.write("failed", error=message, **who)
        budget = Budget(failure_requeues(events, job_id), limits.max_failures, "failure")
        decision = decide(set(), job_id, restart, budget)
        ledger.write("stop_decision", what=decision.event, requeue=decision.requeue,
                     reason=f"after a failure: {decision.why}", error=message, **who)
        if not decision.requeue:
            return decision.why
        outcome = requeue(job_id)
        ledger.write("requeued", how=outcome.how, message=outcome.message, after="failure")
        return f"requeued after the failure: {outcome.message}"
    except Exception as inner:  # noqa: BLE001  (never hide the failure that brought us here)
        return f"could not requeue after the failure: {type(inner).__name__}: {inner}"


def _run_dir(args: argparse.Namespace) -> RunDir:
    if args.run_dir:
        return RunDir(args.run_dir)
    from mgpu.config import load_config

    return RunDir.of(load_config(args.config, args.overrides).run)


def main(argv: Sequence[str] | None = None) -> int:
    """The batch script's line after srun. Exits with the step's own code, so the job's state stays true."""
    parser = argparse.ArgumentParser(prog="python -m mgpu.recovery", description=__doc__.splitlines()[0])
    parser.add_argument("--exit-code", type=int, required=True, help="srun's exit code ($?)")
    parser.add_argument("--run-dir", help="the run directory")
    parser.add_argument("--config", help="or: the job's config and overrides, to find the run directory")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    if args.exit_code == 0 or not owns_slurm_job():
        return args.exit_code
    if args.exit_code == USAGE_EXIT_CODE:
        # jobs/train.py's exit for bad input or a full disk (mgpu.errors): the same again on a requeue. The
        # ledger says so too, when it could be written; a full disk may have stopped that.
        print(f"mgpu.recovery: the step exited {USAGE_EXIT_CODE} (bad input or a full disk, see its one-line "
              "error): not requeued; fix it, then resubmit", file=sys.stderr, flush=True)
        return args.exit_code
    try:
        run = _run_dir(args)
        limits = Limits.from_environ()
    except MgpuError as error:
        print(f"mgpu.recovery: error: {error}", file=sys.stderr, flush=True)
        return args.exit_code
    from mgpu.environment import SlurmEnvironment

    job_id = SlurmEnvironment.job_id(os.environ)
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    outcome = handle_failure(run, job_id, restart, limits, f"the training step exited with code {args.exit_code}")
    print(f"mgpu.recovery: job {job_id} run {restart}: {outcome}", file=sys.stderr, flush=True)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
