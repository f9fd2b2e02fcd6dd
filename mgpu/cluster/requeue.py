"""After a stop: what happened to the job, and should it come back? Asked of Slurm, not guessed.

SIGTERM alone does not tell preemption from `scancel`; Slurm's view of the job does. What a task
sees in `scontrol show job` right after the signal, measured on Slurm 22.05 (2 nodes, KillWait 5):

| event                                   | signals      | JobState   | RestartCnt | PreemptTime | Slurm requeues? |
|-----------------------------------------|--------------|------------|------------|-------------|-----------------|
| preempted, GraceTime 0                  | (USR2+) TERM | COMPLETING | +1         | -           | yes             |
| `scontrol requeue` from outside         | TERM         | COMPLETING | +1         | -           | yes             |
| preempted, GraceTime > 0 (user signal)  | USR2         | RUNNING    | same       | set         | no: self        |
| preempted, GraceTime > 0 (no user sig.) | TERM         | RUNNING    | same       | set         | no: self        |
| `--signal=USR2@lead` before time limit  | USR2         | RUNNING    | same       | unset       | no: self        |
| `scancel --signal=USR2` (on demand)     | USR2         | RUNNING    | same       | unset       | no: self        |
| time limit reached (no lead signal)     | TERM         | COMPLETING | same       | unset, Reason=TimeLimit | no: self |
| `scancel`                               | TERM         | COMPLETING | same       | unset       | no, stays down  |

A self-requeue of a cancelled job *does* bring it back, so the cancelled case must be recognised
before requeueing. A preempted job with GraceTime > 0 that exits without requeueing itself ends
COMPLETED and never returns.

When Slurm gives no answer (a hung or failing scontrol, a container without it), `decide_unanswered`
decides on the evidence the ranks have: the user signal (USR2 without a SIGTERM before it) or the job's
own deadline means a time limit or a preemption with grace, never a `scancel` (which sends SIGTERM), so
the job requeues itself as it would have; after a SIGTERM alone it cannot tell a cancel from a preemption
and decides nothing (`unknown`): the batch script's `mgpu.run.recovery` asks again after srun.
"""

from __future__ import annotations

import os
import re
import shlex
import time
from dataclasses import dataclass
from typing import Literal, Mapping

from mgpu.cluster.slurm import (MIN_TRY_S, JobView, RequeueOutcome, SlurmClient, SlurmError, client, parse_job_view,
                                recorded_resume_command)
from mgpu.cluster.slurm_job import owns_slurm_job

__all__ = ["Budget", "Decision", "JobView", "RequeueError", "RequeueOutcome", "classify", "complete_resume_command", "decide",
           "decide_unanswered", "parse_job_view", "query_job", "requeue", "resume_command", "sbatch_options"]

Event = Literal["preempted", "time_limit", "user_signal", "requeued_by_slurm", "cancelled", "interrupted",
                "terminated", "not_slurm", "unknown", "node_drain"]
RequeueError = SlurmError
"""Slurm cannot be asked or told (the name callers catch; mgpu.cluster.slurm's error)."""


@dataclass(frozen=True)
class Decision:
    event: Event
    requeue: bool
    """True: this job must run `scontrol requeue` on itself to come back."""
    why: str


# What slurm/*.sbatch put in MGPU_RESUME_COMMAND where the options given to sbatch belong: a batch script
# cannot see them (only their effect). `resume_command` puts in the ones accounting recorded.
_OPEN_OPTIONS = re.compile(r"(?P<head>.*?)\bsbatch <the sbatch options of job (?P<job>[^>]+)> (?P<script>\S+)"
                           r"(?P<args>(?: .*)?)")  # the arguments as bash's printf %q wrote them (`a\ b`)


def sbatch_options(submit_line: str, args: list[str]) -> list[str] | None:
    """`sbatch`, its options and the script, from accounting's SubmitLine of a job submitted with `args`
    after the script; None where the line cannot be split back exactly.

    Accounting joins the command's words with spaces and keeps no quotes: the script's own arguments
    are known (`args`), and an option value with a space in it cannot be told from two words, so a word
    that is neither an option nor right after one makes the line ambiguous."""
    tail = " ".join(args)
    if args and not submit_line.endswith(" " + tail):
        return None
    words = (submit_line[:-len(tail)] if args else submit_line).split()
    if len(words) < 2 or os.path.basename(words[0]) != "sbatch":
        return None
    for before, word in zip(words[1:-2], words[2:-1]):
        if not word.startswith("-") and (not before.startswith("-") or "=" in before):
            return None
    if len(words) > 2 and not words[1].startswith("-"):
        return None
    return ["sbatch", *words[1:]]


SUBMIT_LINE_TRIES = 3
"""Asks of accounting for a job's SubmitLine: Slurm records it with the job's start, seconds behind the
controller (2-5 s measured on the test cluster, idle; more on a loaded database), and shows an empty one
until then."""
SUBMIT_LINE_WAIT_S = 1.0


def resume_command(environ: Mapping[str, str] | None = None, ask: bool = True, slurm: SlurmClient | None = None,
                   tries: int = SUBMIT_LINE_TRIES, wait_s: float = SUBMIT_LINE_WAIT_S) -> str:
    """The exact command that continues the run, as the submitter recorded it in MGPU_RESUME_COMMAND.

    slurm/*.sbatch cannot know the sbatch options it was submitted with and leave a placeholder: with
    `ask`, they come from accounting (`sacct -o SubmitLine`, recorded by Slurm >= 21.08 when the
    cluster keeps accounting; an empty one is asked again up to `tries` times, `wait_s` apart, within the
    client's deadline); without it, or when it cannot be split back exactly, the placeholder stays and
    says whose options to repeat. Never raises."""
    environ = os.environ if environ is None else environ
    recorded = environ.get("MGPU_RESUME_COMMAND", "")
    if not recorded:
        return recorded_resume_command(environ)
    found = _OPEN_OPTIONS.fullmatch(recorded)
    # Accounting is asked only about this process's own job (mgpu.cluster.slurm_job), never a leftover's.
    if not (ask and found and found["job"] == environ.get("SLURM_JOB_ID") and owns_slurm_job(environ)):
        return recorded
    try:
        words = _submitted_with(found["job"], shlex.split(found["args"]), slurm or client(), tries, wait_s)
    except ValueError:
        words = None
    return recorded if words is None else f"{found['head']}{shlex.join(words)}{found['args']}"


def _submitted_with(job: str, args: list[str], slurm: SlurmClient, tries: int, wait_s: float) -> list[str] | None:
    """`sbatch` and the options job `job` was submitted with, from accounting (None: not known)."""
    for attempt in range(max(1, tries)):
        if attempt:
            left = slurm.seconds_left()
            if left is not None and left < wait_s + MIN_TRY_S:
                return None  # the stop's window has no room for another ask
            time.sleep(wait_s)
        out = slurm.sacct([job], ["SubmitLine"])
        if out is None:
            return None  # no answer (noted by the client): asking again would only spend the window
        line = out.splitlines()[0].strip() if out.strip() else ""
        if line:
            return sbatch_options(line, args)
    return None


def complete_resume_command(within_s: float = 5.0) -> None:
    """Rank 0, once the job runs (its first step): fill a template's placeholder from accounting now, while there
    is time, and keep it in MGPU_RESUME_COMMAND, so that a stop's message needs no ask within KillWait."""
    recorded = os.environ.get("MGPU_RESUME_COMMAND", "")
    if "<the sbatch options of job" not in recorded:
        return
    with client().within(within_s):
        completed = resume_command(tries=1)
    if completed != recorded:
        os.environ["MGPU_RESUME_COMMAND"] = completed


def query_job(job_id: str) -> JobView:
    """Slurm's view of the job, through the process's client (mgpu.cluster.slurm)."""
    return client().job(job_id)


def classify(reasons: set[str], view: JobView, restarts_at_start: int) -> Event:
    """Name what happened from this run's stop reasons and Slurm's view (see the table above)."""
    if view.restarts > restarts_at_start:
        return "requeued_by_slurm"
    if view.preempt_time is not None:
        return "preempted"
    if view.reason == "TimeLimit" or "deadline" in reasons:
        return "time_limit"
    if "drain" in reasons and view.state not in ("COMPLETING", "CANCELLED"):
        return "node_drain"  # stopped ahead of a node's drain, maintenance or reboot: come back elsewhere or later
    if view.state in ("COMPLETING", "CANCELLED") and "requeue_signal" not in reasons:
        return "cancelled"
    if "interrupt" in reasons and "requeue_signal" not in reasons:
        return "interrupted"  # Ctrl-C on srun: the user stopped it
    if "requeue_signal" in reasons:
        return "user_signal"  # the --signal lead before the time limit, or `scancel --signal=USR2`
    return "terminated"  # SIGTERM from outside Slurm's scheduling (e.g. kill): come back, nothing was cancelled


@dataclass(frozen=True)
class Budget:
    """How many requeues of one kind this job has used, and how many it may (None: no limit)."""

    used: int
    limit: int | None
    kind: Literal["requeue", "failure"] = "requeue"

    @property
    def spent(self) -> bool:
        return self.limit is not None and self.used >= self.limit

    @property
    def noun(self) -> str:
        return "requeues" if self.kind == "requeue" else "failure requeues"

    def describe(self) -> str:
        limit = " (no limit)" if self.limit is None else f" of {self.limit}"
        return f"{self.noun[:-1]} {self.used + 1}{limit}"


def decide(reasons: set[str], view: JobView | None, restarts_at_start: int, budget: Budget) -> Decision:
    """Whether this job should requeue itself after stopping for `reasons` (mgpu.stop.preemption.REASONS). Pure.

    `view`: Slurm's view of this process's own Slurm job (None: not a Slurm job, see mgpu.cluster.slurm_job);
    `restarts_at_start`: SLURM_RESTART_COUNT of this run, to recognise a requeue Slurm already made.
    """
    if view is None:
        return Decision("not_slurm", False, "not a Slurm job: run the same command again to resume")
    event = classify(reasons, view, restarts_at_start)
    if event == "requeued_by_slurm":
        return Decision(event, False, "Slurm is requeueing the job (preemption or an outside requeue)")
    if event in ("cancelled", "interrupted"):
        return Decision(event, False, f"the job was {event}; it stays down")
    if budget.spent:
        return Decision(event, False, f"{event}, but the {budget.kind} budget is spent ({budget.used} of "
                                      f"{budget.limit} {budget.noun} used)")
    return Decision(event, True, f"{event}: requeueing, {budget.describe()}")


def decide_unanswered(reasons: set[str], budget: Budget, unanswered: str) -> Decision:
    """`decide` without Slurm's view (`unanswered`: what it did not answer), on the stop's own evidence. Pure.

    The user signal or the job's own deadline: the job was not cancelled (scancel sends SIGTERM), and whether
    Slurm requeues it already (GraceTime 0) or not, a requeue of our own is right (it fails harmlessly when
    Slurm's came first). Ctrl-C alone: stays down. A SIGTERM alone (or a test stop): `unknown`."""
    evidence = next((r for r in ("requeue_signal", "deadline", "drain") if r in reasons), None)
    if evidence is None and "interrupt" in reasons:
        return Decision("interrupted", False, "the job was interrupted; it stays down")
    if evidence is None:
        return Decision("unknown", False, f"Slurm gave no answer ({unanswered}); without it, a SIGTERM (or a test "
                                          "stop) cannot tell a scancel from a preemption or the time limit: not "
                                          "requeued from here")
    events: dict[str, Event] = {"requeue_signal": "user_signal", "deadline": "time_limit", "drain": "node_drain"}
    event = events[evidence]
    said = {"requeue_signal": "the user signal came", "deadline": "the job's own deadline was reached",
            "drain": "the job stopped ahead of a node's drain"}[evidence]
    if budget.spent:
        return Decision(event, False, f"{event}, but the {budget.kind} budget is spent ({budget.used} of "
                                      f"{budget.limit} {budget.noun} used)")
    return Decision(event, True, f"{event} (Slurm gave no answer: {unanswered}; {said}, so the job was not "
                                 f"cancelled): requeueing, {budget.describe()}")


def requeue(job_id: str) -> RequeueOutcome:
    """`scontrol requeue <job id>` through the process's client (array-aware)."""
    return client().requeue(job_id)
