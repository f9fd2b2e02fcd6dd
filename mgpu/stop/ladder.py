"""The timeout ladder: every bound a job lives under, inner to outer, in one place, and the order they must keep.

Each bound is computed where it always was (the save's and the resume's allowances: mgpu.state.save_budget; the
watchdog's allowances, its verdict and the collective timeout: mgpu.stop.watchdog; Slurm's KillWait and GraceTime:
mgpu.cluster.kill_time; the exit's bounds: mgpu.record.reporting, mgpu.stop.watchdog, mgpu.stop.process_exit). This
module only reads them, puts them in order and checks it (docs/allowances.md, "The ladder"):

- a hang: every watchdog allowance, plus the time the watchdog takes to reach its verdict and leave evidence, ends
  before the process group's timeout (the collective timeout after the first step; `distributed.init_timeout_s`
  until then, which the first step's allowance must fit): else a collective's timeout error, with no stacks and no
  rank named, ends the job instead of the watchdog;
- a stop: the agreement (the next one, and the step after it), the stop's save and rank 0's reserve for asking
  Slurm fit between Slurm's first signal and its SIGKILL: KillWait after a SIGTERM (scancel, a preemption with
  GraceTime 0, an outside requeue), GraceTime + KillWait after a preemption's first signal; else the stop's
  checkpoint is lost. The exit after it is bounded (EXIT_S) but may be cut by the kill: nothing is lost then. The
  deadline stop's margin holds the exit.

A broken order is one line each (`Ladder.problems`); the session says them at its start (rank 0), prints the ladder
as training starts (its first step) and records it in the ledger's `started` and `first_step` events, which
`jobs/status.py` shows
(mgpu.record.timeouts). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mgpu.cluster.deadline import time_needed
from mgpu.cluster.kill_time import EXIT_RESERVE_S, KillTimes
from mgpu.record.reporting import CLOSE_WITHIN_S
from mgpu.state.save_budget import MAX_ALLOWANCE_S
from mgpu.stop.preemption import AGREE_EVERY_S
from mgpu.stop.process_exit import EXIT_WITHIN_S
from mgpu.stop.watchdog import ENDED_TEARDOWN_S, EVIDENCE_S, LOOK_SLACK_S, STALE_AFTER_S, WRITE_EVERY_S

__all__ = ["EXIT_S", "VERDICT_S", "Figures", "Ladder", "Rung", "ladder"]

VERDICT_S = WRITE_EVERY_S + STALE_AFTER_S + EVIDENCE_S + LOOK_SLACK_S
"""After an allowance: noticing (a heartbeat), the second look for a frozen rank, the evidence, a loaded machine's
slack: what Watchdog.collective_timeout adds to the longest allowance."""
EXIT_S = CLOSE_WITHIN_S + ENDED_TEARDOWN_S + EXIT_WITHIN_S
"""A stopped rank's way out after its checkpoint, at most: the loggers, the group's teardown, the process's exit."""


@dataclass(frozen=True)
class Figures:
    """What the ladder is read from (the session's, at its start and at its first step)."""

    init_timeout_s: float
    """distributed.init_timeout_s: the process group's timeout until the first step."""
    watchdog: bool
    step_multiple: float
    floor_s: float
    first_step_s: float
    eval_s: float
    save_allowance_s: float
    resume_allowance_s: float
    expected_save_s: float | None
    """The stop's save as the saves so far say it takes (None: none measured yet)."""
    step_s: float | None = None
    """The measured step (None: before the first)."""
    collective_timeout_s: float | None = None
    """The process group's timeout set after the first step (None: not yet, or no watchdog)."""
    agree_every: int | None = None
    """Steps between the stop agreements (None: about a second's worth)."""
    kill: KillTimes | None = None
    """Slurm's KillWait and GraceTime, for a job of Slurm's (None: no Slurm job)."""
    deadline_margin_s: float = 0.0


@dataclass(frozen=True)
class Rung:
    name: str
    seconds: float | None
    """None: not known yet."""
    why: str


@dataclass
class Ladder:
    hang: list[Rung] = field(default_factory=list)
    """Inner to outer: the watchdog's allowances, its verdict, the group's timeouts."""
    stop: list[Rung] = field(default_factory=list)
    """A stop, from Slurm's first signal: the agreement, the save, the exit, Slurm's kill."""
    problems: list[str] = field(default_factory=list)
    """One line per broken order."""

    def record(self) -> dict[str, Any]:
        """The ledger's form (`started` and `first_step` events' `ladder`; shown by mgpu.record.timeouts)."""
        rows = lambda rungs: [[r.name, None if r.seconds is None else round(r.seconds, 3), r.why] for r in rungs]  # noqa: E731
        return {"hang": rows(self.hang), "stop": rows(self.stop), "problems": list(self.problems)}


from mgpu.record.timeouts import seconds as _s  # noqa: E402  (one way to print a bound)


def ladder(f: Figures) -> Ladder:
    """The rungs from `f` and the problems with their order."""
    out = Ladder()
    hang: list[Rung] = []
    if f.watchdog:
        step = max(f.floor_s, f.step_multiple * f.step_s) if f.step_s is not None else f.floor_s
        measured = f"{f.step_multiple:g} x the median step ({_s(f.step_s)}), " if f.step_s is not None else \
            f"{f.step_multiple:g} x the median step once measured, "
        hang += [Rung("step", step, f"{measured}at least watchdog.floor_s"),
                 Rung("evaluation", f.eval_s, f"watchdog.eval_s, or {f.step_multiple:g} x the median evaluation batch"),
                 Rung("save", f.save_allowance_s, "3 x the expected save" + (
                     f" ({_s(f.expected_save_s)})" if f.expected_save_s else "") + ", at least watchdog.checkpoint_s"),
                 Rung("resume", f.resume_allowance_s, "3 x the expected read of the checkpoint, at least "
                                                      "watchdog.first_step_s"),
                 Rung("first step", f.first_step_s, "watchdog.first_step_s: a run's first step"),
                 Rung("verdict", VERDICT_S, "after an allowance: a heartbeat, the second look, the stacks, slack")]
    longest = max((r.seconds or 0.0 for r in hang[:5]), default=0.0)
    if f.collective_timeout_s is not None:
        hang.append(Rung("collective", f.collective_timeout_s, "the group's timeout after the first step: "
                                                                "watchdog.collective_timeout_s, raised over every "
                                                                "allowance and the verdict"))
        if f.collective_timeout_s < min(longest, MAX_ALLOWANCE_S) + VERDICT_S:
            out.problems.append(f"the collective timeout ({_s(f.collective_timeout_s)}) ends before the longest "
                                f"watchdog allowance ({_s(longest)}) and its verdict ({_s(VERDICT_S)}): a hang "
                                "would end in a collective's timeout, with no rank named")
    hang.append(Rung("rendezvous", f.init_timeout_s, "distributed.init_timeout_s: the group's timeout until the "
                                                     "first step"))
    if f.watchdog and f.init_timeout_s < f.first_step_s + VERDICT_S:
        out.problems.append(f"distributed.init_timeout_s ({_s(f.init_timeout_s)}) is shorter than watchdog.first_step_s "
                            f"({_s(f.first_step_s)}) and the watchdog's verdict ({_s(VERDICT_S)}): a first step slower "
                            f"than {_s(f.init_timeout_s)} fails in a collective's timeout, with no rank named; raise "
                            f"distributed.init_timeout_s to {f.first_step_s + VERDICT_S:.0f} or lower "
                            f"watchdog.first_step_s")
    out.hang = hang
    out.stop = _stop(f, out.problems)
    return out


def _stop(f: Figures, problems: list[str]) -> list[Rung]:
    if f.agree_every is None:  # about a second's worth of steps, and the step in progress
        agree: float | None = AGREE_EVERY_S + (f.step_s or 0.0)
        how = "the step in progress, then the next agreement, about a second later"
    elif f.step_s is not None:
        agree = time_needed(f.step_s, f.agree_every, 0.0, 0.0)
        how = f"the next agreement, {f.agree_every} step(s) of {_s(f.step_s)} away, and the step after it"
    else:
        agree, how = None, f"the next agreement, {f.agree_every} step(s) away, and the step after it"
    save = f.expected_save_s
    rungs = [Rung("agreement", agree, how),
             Rung("stop's save", save, "the expected save (the saves so far)" if save else "not measured yet")]
    fix = ("checkpoint more often (checkpoint.every_steps, checkpoint.memory_every_steps) or ask the cluster for "
           "a longer {what}")
    if f.kill is not None:
        # What must fit: the agreement and the save (the checkpoint durable) and the decision's reserve (rank 0's Slurm
        # calls are bounded by what is left: mgpu.cluster.kill_time). The exit after it may be cut: nothing is lost.
        reserve = min(EXIT_RESERVE_S, f.kill.kill_wait_s / 5)
        needed = (agree or 0.0) + (save or 0.0) + reserve
        rungs.append(Rung("decision", reserve, "the least rank 0 keeps to ask Slurm and requeue (kill_time's reserve)"))
        rungs.append(Rung("KillWait", f.kill.kill_wait_s, "Slurm's SIGTERM to its SIGKILL (scancel, a preemption "
                                                          "with GraceTime 0, an outside requeue)"))
        if needed > f.kill.kill_wait_s:
            problems.append(f"a stop needs about {_s(needed)} (agreement, save, decision) but Slurm's KillWait is "
                            f"{_s(f.kill.kill_wait_s)}: after a scancel or a preemption with GraceTime 0 the stop's "
                            f"checkpoint may be cut short; " + fix.format(what="KillWait"))
        if f.kill.grace_s:  # with GraceTime 0 the window is KillWait's
            window = f.kill.grace_s + f.kill.kill_wait_s
            rungs.append(Rung("GraceTime + KillWait", window, "a preemption's first signal to its SIGKILL"))
            if needed > window:
                problems.append(f"a stop needs about {_s(needed)} (agreement, save, decision) but a preemption gives "
                                f"{_s(window)} (GraceTime {_s(f.kill.grace_s)} + KillWait {_s(f.kill.kill_wait_s)}): "
                                f"a preempted run loses the steps since its last checkpoint; "
                                + fix.format(what="GraceTime"))
    rungs.append(Rung("exit", EXIT_S, f"at most, after the decision: the loggers {_s(CLOSE_WITHIN_S)}, the group's "
                                      f"teardown {_s(ENDED_TEARDOWN_S)}, the process {_s(EXIT_WITHIN_S)} (a kill "
                                      f"during it loses nothing)"))
    if 0 < f.deadline_margin_s < EXIT_S:
        problems.append(f"preemption.deadline_margin_s ({_s(f.deadline_margin_s)}) is shorter than the exit after a "
                        f"stop ({_s(EXIT_S)}): the stop before the time limit may be killed on its way out; raise it "
                        f"to {EXIT_S:.0f} or more (0: rely on the time limit's signal)")
    return rungs
