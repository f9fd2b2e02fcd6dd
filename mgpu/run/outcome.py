"""How a run ends on one rank: finished, or stopped and then requeued or left down. No torch.

After the ranks stopped together and wrote their checkpoint, rank 0, and only rank 0, asks Slurm what
happened (`mgpu.cluster.requeue.decide`) and requeues the job itself when Slurm will not (time limit; preemption
with GraceTime > 0), never after a `scancel`, and not beyond `MGPU_MAX_REQUEUES` stop requeues (default:
no limit; see `mgpu.record.budgets.Limits`). A run that made no progress at all counts against the failure
budget instead, so a job whose time limit leaves no time to train does not requeue forever. Slurm is
asked about a job only when it is this process's own (`mgpu.cluster.slurm_job.owns_slurm_job`).

Every Slurm call here ends before Slurm's SIGKILL (`mgpu.cluster.kill_time`: the signals' times and KillWait). Where
Slurm gives no answer, rank 0 decides on the stop's evidence (`mgpu.cluster.requeue.decide_unanswered`); what stays
unknown (no decision, or a requeue without an answer) is the `unknown` outcome: exit UNANSWERED_EXIT_CODE, the
ledger's `stop_decision` carries `unknown` (or a `requeue_unknown` follows it), and `mgpu.run.unanswered` settles it:
in the batch script's `mgpu.run.recovery` after srun, else in rank 0 once its session has ended; a stop that came
with Slurm's signal keeps the job alive until Slurm answers or ends it (a preemption then requeues it).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

from mgpu.cluster.environment import ProcessEnv
from mgpu.record.ledger import Ledger, read_ledger
from mgpu.errors import USAGE_EXIT_CODE
from mgpu.record.budgets import Limits, failure_requeues, stop_requeues
from mgpu.cluster.requeue import Budget, Decision, decide, decide_unanswered, query_job, requeue
from mgpu.record.rundir import RunDir
from mgpu.cluster.kill_time import KillTimes
from mgpu.cluster.slurm import SlurmError, SlurmUnanswered, client

__all__ = ["SPAWN_ARGV", "STOPPED_EXIT_CODE", "UNANSWERED_EXIT_CODE", "USER_VARIABLES", "JobStopped", "Outcome",
           "StopBudgets", "decide_after_stop", "exit_code", "recorded_exit_code", "resume_command"]

log = logging.getLogger("mgpu.train.job")
STOPPED_EXIT_CODE = 3
"""A process's exit code when the run stopped on a signal, saved, and stays down (not requeued)."""
UNANSWERED_EXIT_CODE = 5
"""Rank 0's exit code when the run stopped and saved, but Slurm did not answer what to do (mgpu.run.recovery asks
again): never 2, which says bad input and is not requeued."""


class JobStopped(Exception):
    """The job stopped on a signal and will not come back (cancelled, or out of requeues), or Slurm did not
    say whether it does (`code`: UNANSWERED_EXIT_CODE)."""

    def __init__(self, message: str, code: int = STOPPED_EXIT_CODE) -> None:
        super().__init__(message)
        self.code = code


SPAWN_ARGV = "MGPU_SPAWN_ARGV"
"""Set by mgpu.spawn in each rank it starts: the spawning process's command line (JSON), which the resume
command repeats (a spawned rank's own command line is multiprocessing's)."""

USER_VARIABLES = ("MGPU_MAX_REQUEUES", "MGPU_MAX_FAILURES", "MGPU_RECOVERY")
"""The environment variables a user sets that change what mgpu does: a resume command keeps them."""


def _torchrun_options(environ: Mapping[str, str]) -> list[str]:
    """torchrun's options, rebuilt from what it tells its workers (node count, processes per node, rendezvous)."""
    options = ["--nproc-per-node", environ.get("LOCAL_WORLD_SIZE", "1")]
    nodes = int(environ.get("GROUP_WORLD_SIZE", "1") or 1)
    if nodes > 1:  # every node runs it, each with its own --node-rank
        options += ["--nnodes", str(nodes), "--node-rank", environ.get("GROUP_RANK", "0"),
                    "--master-addr", environ.get("MASTER_ADDR", "localhost"),
                    "--master-port", environ.get("MASTER_PORT", "29500")]
    if int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
        options += ["--max-restarts", environ["TORCHELASTIC_MAX_RESTARTS"]]
    return options


def _own_command(launcher: str, environ: Mapping[str, str], argv: Sequence[str], orig_argv: Sequence[str] | None,
                 executable: str, cwd: str) -> str:
    variables = [f"{name}={shlex.quote(environ[name])}" for name in USER_VARIABLES if environ.get(name)]
    if launcher == "torchrun":
        command = [executable, "-m", "torch.distributed.run", *_torchrun_options(environ), *argv]
    elif orig_argv:  # the interpreter's own command line: `-m package`, `-u` and the rest as typed
        command = [executable, *orig_argv[1:]]
    else:
        command = [executable, *argv]
    tasks = environ.get("SLURM_NTASKS", "1") if launcher == "slurm" else "1"
    if tasks.isdigit() and int(tasks) > 1:  # an srun step of several tasks (no submitter's command): srun it again
        nodes = environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES") or "1"
        command = ["srun", "--nodes", nodes, "--ntasks", tasks, *command]
    return f"cd {shlex.quote(cwd)} && {' '.join([*variables, shlex.join(command)])}"


def resume_command(env: ProcessEnv) -> str:
    """The exact command that continues this run: what the submitter recorded (a template's sbatch options
    completed from accounting, see mgpu.cluster.requeue.resume_command), else this process's own, runnable as printed:
    the interpreter's full path (a virtual environment need not be active), the MGPU_* variables set, under
    torchrun its command line rebuilt from its variables, under mgpu.spawn the spawning command, and a task of
    an srun step of several tasks behind `srun --nodes N --ntasks T` (the same world again; the job's other
    srun/sbatch options are not known here)."""
    if os.environ.get("MGPU_RESUME_COMMAND"):
        from mgpu.cluster.requeue import resume_command as recorded

        return recorded(ask=env.rank == 0)
    spawned = multiprocessing.parent_process() is not None
    orig = _command_line(env.launcher, os.environ, spawned, getattr(sys, "orig_argv", None))
    return _own_command(env.launcher, os.environ, sys.argv, orig, sys.executable, os.getcwd())


def _command_line(launcher: str, environ: Mapping[str, str], spawned: bool,
                  orig_argv: Sequence[str] | None) -> list[str] | None:
    """The interpreter command line a resume repeats (None: sys.argv's). A rank mgpu.spawn started: the spawning
    process's (`python -m mgpu.run.spawn -n 2 loop.py`: the same world again); another spawned process: None (its
    own is multiprocessing's, its sys.argv its parent's); under torchrun: None (rebuilt from its variables)."""
    if spawned:
        try:
            line = json.loads(environ.get(SPAWN_ARGV) or "null")
        except ValueError:
            return None
        return [str(word) for word in line] if isinstance(line, list) and line else None
    return None if launcher == "torchrun" else (list(orig_argv) if orig_argv else None)


def exit_code(outcome: "Outcome") -> int:
    """The process's exit code for what happens to the job: 0 finished, requeued (or another rank's end after a
    stop: rank 0 decides), STOPPED_EXIT_CODE when it stays down after a stop, UNANSWERED_EXIT_CODE when Slurm
    did not say."""
    return {"stays_down": STOPPED_EXIT_CODE, "unknown": UNANSWERED_EXIT_CODE}.get(outcome.kind, 0)


def recorded_exit_code(attempt: Sequence[Mapping[str, Any]]) -> int | None:
    """The exit code mgpu set for an attempt, read back from its ledger events (`exit_code` of what rank 0, or the
    batch script's mgpu.run.recovery, decided last): a launcher that reports any rank's non-zero exit as its own
    failure (torchrun, submitit: exit 1) loses it, and the batch script ends with this instead. None: nothing
    decided a stop (a failure keeps the step's own code)."""
    for event in reversed(attempt):
        name = event.get("event")
        if name == "requeued":
            return None if event.get("after") in ("failure", "hang") else 0
        if name in ("requeue_unknown", "awaiting_slurm"):
            return UNANSWERED_EXIT_CODE
        if name == "requeue_refused":
            return STOPPED_EXIT_CODE
        if name == "failed":
            return USAGE_EXIT_CODE if event.get("retry") is False else None
        if name == "stop_decision":
            if "error" in event:  # the recovery's decision after a failed step: the failure's own code stands
                return None
            if event.get("requeue") or event.get("what") == "requeued_by_slurm":
                return 0
            return UNANSWERED_EXIT_CODE if event.get("unknown") else STOPPED_EXIT_CODE
    return None


@dataclass(frozen=True)
class StopBudgets:
    """This job's budgets, read when the run starts: requeues after stops, and after failures."""

    job_id: str | None
    """The Slurm job this process may requeue (its own), or None."""
    stops: Budget
    failures_used: int
    limits: Limits

    @classmethod
    def read(cls, run: RunDir, env: ProcessEnv, job_id: str | None, limits: Limits) -> "StopBudgets":
        events = read_ledger(run.ledger) if job_id else []
        failures = failure_requeues(events, job_id) if job_id else 0
        # Slurm's restart counter counts every requeue; the failure requeues that raised it are the ledger's.
        stops = stop_requeues(events, job_id, env.restart_count) if job_id else 0
        return cls(job_id, Budget(stops, limits.max_requeues), failures, limits)

    def refuse_if_spent(self, run: RunDir, env: ProcessEnv) -> None:
        """Slurm brought the job back more often than allowed (e.g. preemptions with GraceTime 0): stop now
        (JobStopped on rank 0, SystemExit(0) on the others)."""
        if not self.job_id or self.stops.limit is None or self.stops.used <= self.stops.limit:
            return
        message = (f"requeue budget exhausted: this is restart {self.stops.used} of at most {self.stops.limit} "
                   f"(MGPU_MAX_REQUEUES); not training. The last checkpoint in {run.path} is kept; to resume: "
                   f"{resume_command(env)}")
        if env.rank != 0:
            raise SystemExit(0)
        Ledger(run.ledger, env.job_id, env.restart_count).write("failed", error=message, retry=False)
        raise JobStopped(message)


@dataclass(frozen=True)
class Outcome:
    """What happens to the job after this rank's run."""

    kind: Literal["finished", "requeued", "stays_down", "other_rank", "unknown"]
    """finished: nothing to do; requeued: it comes back (by us or by Slurm); stays_down: it does not, see
    `message`; other_rank: a stopped rank other than 0 (rank 0 decides and acts); unknown: Slurm did not
    answer what to do or whether the requeue happened, see `message`."""
    message: str = ""


def decide_after_stop(reasons: set[str], step: int, resumed_step: int, checkpoint: str | None,
                      budgets: StopBudgets, env: ProcessEnv, ledger: Ledger,
                      signals: Sequence[tuple[str, float]] = (), straggler: tuple[str, str] | None = None) -> Outcome:
    """Rank 0, after the stop checkpoint: ask Slurm, requeue or not within the budgets, record it; every Slurm
    call within the time left before the kill (`signals`: rank 0's, with their Unix times). `straggler`: (node,
    why) of a straggler whose node this rank's requeue excludes (stragglers.exclude_node)."""
    if env.rank != 0:
        return Outcome("other_rank")  # a non-zero exit here would make srun kill rank 0 before it acts
    progressed = step > resumed_step
    budget = budgets.stops if progressed else Budget(budgets.failures_used, budgets.limits.max_failures, "failure")
    with client().within(KillTimes.from_environ().window_s(signals)):
        decision, unknown = _decision(reasons, budgets.job_id, env.restart_count, budget)
        why = decision.why if progressed else f"{decision.why} (this run made no progress)"
        ledger.write("stop_decision", step=step, what=decision.event, requeue=decision.requeue, reason=why,
                     progressed=progressed, **({"unknown": unknown} if unknown else {}))
        log.info("stopped at step %d: %s", step, why)
        if decision.requeue:
            try:
                outcome = requeue(budgets.job_id)  # type: ignore[arg-type]  # decide() requeues only a job of ours
            except SlurmUnanswered as error:
                ledger.write("requeue_unknown", step=step, error=error.note)
                return Outcome("unknown", f"stopped at step {step}: {why}; but the requeue got no answer "
                                          f"({error.note}); checkpoint {checkpoint}; {_asked_again(env)}")
            except SlurmError as error:  # refused (e.g. a job submitted with --no-requeue)
                ledger.write("requeue_refused", step=step, error=str(error))
                return Outcome("stays_down", f"stopped at step {step}: {why}; but Slurm refused the requeue "
                                             f"({error}); checkpoint {checkpoint}; to resume: {resume_command(env)}")
            ledger.write("requeued", step=step, how=outcome.how, message=outcome.message,
                         **({} if progressed else {"after": "no_progress"}))
            log.info("requeue: %s", outcome.message)
            if straggler is not None:
                from mgpu.record.exclusion import exclude_straggler

                log.info("%s", exclude_straggler(budgets.job_id, *straggler, ledger))  # type: ignore[arg-type]  # decide() requeues only a job of ours
        if decision.requeue or decision.event == "requeued_by_slurm":
            return Outcome("requeued", why)
        if decision.event == "unknown":
            return Outcome("unknown", f"stopped at step {step}: {why}; checkpoint {checkpoint}; {_asked_again(env)}")
        return Outcome("stays_down", f"stopped at step {step}: {why}; checkpoint {checkpoint}; to resume: "
                                     f"{resume_command(env)}")


def _decision(reasons: set[str], job_id: str | None, restarts: int, budget: Budget) -> tuple[Decision, str | None]:
    """Slurm's view decides; without an answer (or a view), the stop's evidence does. (decision, what Slurm
    did not answer)."""
    if job_id is None:
        return decide(reasons, None, restarts, budget), None
    try:
        view = query_job(job_id)
    except SlurmError as error:  # no answer, a refusal, or no scontrol here: never the user's bad input
        said = error.note if isinstance(error, SlurmUnanswered) else str(error)
        return decide_unanswered(reasons, budget, said), said
    return decide(reasons, view, restarts, budget), None


def _asked_again(env: ProcessEnv) -> str:
    if os.environ.get("MGPU_RECOVERY") == "batch":
        return "the batch script's mgpu.run.recovery asks Slurm again after srun"
    return "rank 0 asks Slurm again once its session has ended (mgpu.run.unanswered)"
