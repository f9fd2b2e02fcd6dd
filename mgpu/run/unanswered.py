"""A stop whose requeue Slurm did not confirm: ask again, and where a preemption may be under way, stay alive until
Slurm answers or ends the job. No torch.

Rank 0 asks Slurm at a stop within the time before the kill (`mgpu.run.outcome.decide_after_stop`). Where the
question or the requeue got no answer, the stop is left open (`unknown` in its `stop_decision`, or
`requeue_unknown`), and `settle_stop` closes it: in the batch script's `python -m mgpu.run.recovery` after srun,
or in rank 0 itself after its session's teardown where no batch script does (MGPU_RECOVERY unset).

- It asks again, as rank 0 would have (within the stop budget), and acts on the answer.
- Still no answer, and the stop came from a signal (the user signal, a SIGTERM): Slurm may be preempting the
  job, and it requeues a preempted job itself if the job is still alive when the grace ends. A job that exits
  during its grace ends COMPLETED or FAILED and never comes back (measured on the test cluster, issue 42: FAILED
  9.5 s after the user signal, 6 s before the preemption's SIGTERM). So the job stays alive, saved and idle (one
  small process: no rank, no GPU memory), asking again every ASK_EVERY_S, until Slurm answers (it acts on the
  answer), Slurm ends the job (its SIGTERM: a preemption's grace is over and Slurm requeues the job, a scancel
  cancels it, the time limit ends it; the wait ends there, what Slurm decided stands), or `KillTimes.wait_until`
  passes (it exits, saying what to do). The `awaiting_slurm` event records the wait, a `stop_decision` its end.
- A stop of another kind (the job's own deadline, a drain, a test stop, Ctrl-C) has no kill on its way, so
  waiting would only hold the allocation: it exits at once, saying what to do.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Mapping, Sequence

from mgpu.cluster.kill_time import MIN_WINDOW_S, KillTimes
from mgpu.cluster.requeue import Budget, Decision, decide, decide_unanswered, query_job, requeue, resume_command
from mgpu.cluster.slurm import TIMEOUT_S, RequeueOutcome, SlurmError, SlurmUnanswered, client
from mgpu.record.budgets import Limits, failure_requeues, stop_requeues
from mgpu.record.ledger import Ledger
from mgpu.record.rundir import RunDir

__all__ = ["ASK_EVERY_S", "Settled", "open_stop", "settle_stop", "signals_of", "this_attempt"]

ASK_EVERY_S = 10.0
"""How often a job waiting for Slurm asks again (each ask is two short commands; a struggling controller at a mass
preemption gets one a job every 10 s, not a retry loop)."""
SIGNALLED = ("requeue_signal", "sigterm")
"""Stop reasons that came with a signal from Slurm: a kill may be on its way."""


@dataclass(frozen=True)
class Settled:
    """How an open stop ended: `kind` as `mgpu.run.outcome.Outcome`'s (requeued, stays_down, unknown)."""

    kind: Literal["requeued", "stays_down", "unknown"]
    message: str


def this_attempt(events: Sequence[Mapping[str, Any]], job_id: str, restart: int) -> list[Mapping[str, Any]]:
    """The events of the latest attempt of run `restart`: after its last in-allocation restart."""
    mine = [e for e in events if e.get("job_id") == job_id and e.get("restart") == restart]
    starts = [i for i, e in enumerate(mine) if e.get("event") == "restarted"]
    return mine[starts[-1] + 1:] if starts else mine


def open_stop(attempt: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """This attempt's stop decision that Slurm left open (no answer to the question or to the requeue)."""
    for event in reversed(attempt):
        if event.get("event") == "requeue_unknown":
            return next((e for e in reversed(attempt) if e.get("event") == "stop_decision"), event)
        if event.get("event") in ("requeued", "requeue_refused"):
            return None
        if event.get("event") == "stop_decision":
            return event if event.get("unknown") else None
    return None


def signals_of(stop: Mapping[str, Any]) -> list[tuple[str, float]]:
    """The (signal, Unix time) pairs a `preempted` event recorded (rank 0's); [] where they do not read."""
    names, times = stop.get("signals") or [], stop.get("signal_times") or []
    if not isinstance(names, list) or not isinstance(times, list):
        return []
    return [(str(n), float(t)) for n, t in zip(names, times) if isinstance(t, (int, float)) and not isinstance(t, bool)]


@dataclass
class _Ask:
    """One ask of Slurm and what was done on its answer; `unknown`: what was not answered (the stop stays open)."""

    decision: Decision
    why: str
    unknown: str | None
    settled: Settled | None
    silent: bool = False
    """Slurm gave no answer (hung, unreachable, missing): not a refusal such as `Invalid job id`, which says the
    job is not Slurm's to end, so no kill is worth waiting for."""


def settle_stop(run: RunDir, job_id: str, restart: int, limits: Limits, events: Sequence[Mapping[str, Any]],
                attempt: Sequence[Mapping[str, Any]], decided: Mapping[str, Any], *, by: str = "recovery",
                prog: str = "mgpu.run.recovery", times: KillTimes | None = None, now: Callable[[], float] = time.time,
                sleep: Callable[[float], None] | None = None) -> Settled:
    """Close the stop rank 0 left open (`decided`: its stop decision) as the module's doc says; `by` names who did
    in the ledger, `prog` in the line that says the job waits. `times`, `now`, `sleep`: injected for tests.
    Raises nothing it can catch."""
    ledger = Ledger(run.ledger, job_id, restart)
    stop: Mapping[str, Any] = next((e for e in reversed(attempt) if e.get("event") == "preempted"), {})
    reasons = {str(r) for r in stop.get("reasons") or []}
    signals = signals_of(stop)
    step = decided.get("step")
    progressed = decided.get("progressed") is not False
    budget = (Budget(stop_requeues(events, job_id, restart), limits.max_requeues) if progressed
              else Budget(failure_requeues(events, job_id), limits.max_failures, "failure"))
    times = times or KillTimes.from_environ()
    signalled = bool(reasons & set(SIGNALLED)) and "interrupt" not in reasons
    until = times.wait_until(signals) if signalled else None
    began = now()
    with _slurm_ending() as ended:
        pause = sleep or ended.wait
        for asks in range(1, sys.maxsize):
            waiting = asks > 1
            # The first ask within the time before the kill. Once waiting, the kill is what the job waits for: an ask
            # it cuts short loses nothing, and none outlasts a SIGTERM by more than KillWait.
            window = min(TIMEOUT_S, times.kill_wait_s, (until or 0.0) - now()) if waiting else \
                times.window_s(signals, now())
            with client().within(max(window, MIN_WINDOW_S)):
                ask = _ask(reasons, job_id, restart, budget, ledger, step, progressed, attempt, by,
                           waited=now() - began if waiting else None)
            if ask.settled is not None:
                return ask.settled
            why, unknown = ask.why, ask.unknown or "no answer"
            if until is None or not ask.silent:  # no signal, or Slurm refused (e.g. a job id it does not know)
                said = ("no signal says a kill is on its way (a stop of the job's own)" if until is None else
                        "Slurm refused, so no kill of its own is worth waiting for")
                return Settled("unknown", f"{why}; Slurm gave no answer ({unknown}) and {said}: the job does not come "
                                          f"back by itself; resume with: {resume_command()}")
            if ended.is_set():
                return _ended_by_slurm(ledger, step, progressed, by, why, unknown, now() - began)
            if now() >= until:
                message = (f"{why}; Slurm did not answer ({unknown}) nor end the job within {now() - began:.0f} s: the "
                           f"job ends here and does not come back by itself; resume with: {resume_command()}")
                ledger.write("stop_decision", step=step, what="unknown", requeue=False, reason=message,
                             progressed=progressed, by=by, unknown=unknown)
                return Settled("unknown", message)
            if not waiting:
                ledger.write("awaiting_slurm", step=step, until=round(until, 3), unknown=unknown, by=by,
                             reason=f"{why}; {times.describe()}")
                print(f"{prog}: stopped at step {step}, saved; Slurm gave no answer ({unknown}): the job stays alive, "
                      f"idle, until Slurm answers or ends it (a preemption: Slurm requeues it), at most until "
                      f"{time.strftime('%H:%M:%S', time.localtime(until))} ({times.describe()}); if it does not come "
                      f"back, resume with: {resume_command()}", file=sys.stderr, flush=True)
            pause(max(0.0, min(ASK_EVERY_S, until - now())))
            if ended.is_set():  # no ask more: it would only hold the job
                return _ended_by_slurm(ledger, step, progressed, by, why, unknown, now() - began)
    raise AssertionError("unreachable")


def _ended_by_slurm(ledger: Ledger, step: Any, progressed: bool, by: str, why: str, unknown: str,
                    waited: float) -> Settled:
    """Slurm's SIGTERM came while the job waited: it ends the job now (a preemption's grace is over, and it requeues
    the job; a scancel; the time limit), and what it decided stands, so the wait ends. Waiting for its SIGKILL
    instead, the waiting process, orphaned when the TERM ended the batch shell, outlived the job on the test
    cluster (proctrack/linuxproc no longer finds an orphan)."""
    message = (f"{why}; while the job waited, Slurm ended it (SIGTERM after {waited:.0f} s): a preemption requeues "
               f"it; if it does not come back, resume with: {resume_command()}")
    ledger.write("stop_decision", step=step, what="unknown", requeue=False, reason=message, progressed=progressed,
                 by=by, unknown=unknown, ended_by="SIGTERM")
    return Settled("unknown", message)


def _ask(reasons: set[str], job_id: str, restart: int, budget: Budget, ledger: Ledger, step: Any, progressed: bool,
         attempt: Sequence[Mapping[str, Any]], by: str, waited: float | None) -> _Ask:
    """Ask Slurm once and act on its answer (on the stop's evidence where none comes). The first ask (`waited`
    None) records its decision and what it did, as rank 0's did; a later one only what closes the stop."""
    first = waited is None
    unknown = None
    silent = False
    try:
        decision = decide(reasons, query_job(job_id), restart, budget)
    except SlurmUnanswered as error:
        silent, unknown = True, error.note
        decision = decide_unanswered(reasons, budget, unknown)
    except SlurmError as error:  # a refusal: Slurm does not know the job, or will not say
        unknown = str(error)
        decision = decide_unanswered(reasons, budget, unknown)
    lead = ("asked again after the step: " if by == "recovery" else "asked again: ") if first else \
        f"{'no answer' if unknown else 'Slurm answered'} after {waited:.0f} s of waiting: "
    why = f"{lead}{decision.why}" + ("" if progressed else " (this run made no progress)")
    fields = dict(step=step, what=decision.event, requeue=decision.requeue, reason=why, progressed=progressed, by=by,
                  **({"unknown": unknown} if unknown else {}))
    if first:
        ledger.write("stop_decision", **fields)
    if not decision.requeue:
        if decision.event == "unknown":
            return _Ask(decision, why, unknown, None, silent)
        if not first:
            ledger.write("stop_decision", **fields)
        if decision.event == "requeued_by_slurm":
            return _Ask(decision, why, unknown, Settled("requeued", why))
        return _Ask(decision, why, unknown, Settled("stays_down", f"{why}; the job stays down; to resume: "
                                                             f"{resume_command()}"))
    try:
        outcome = requeue(job_id)
    except SlurmUnanswered as error:
        if first:
            ledger.write("requeue_unknown", step=step, error=error.note, by=by)
        return _Ask(decision, why, error.note, None, silent=True)
    except SlurmError as error:
        if not first:
            ledger.write("stop_decision", **fields)
        ledger.write("requeue_refused", step=step, error=str(error), by=by)
        return _Ask(decision, why, unknown, Settled("stays_down", f"{why}; but Slurm refused the requeue ({error}); to "
                                                             f"resume: {resume_command()}"))
    if outcome.how == "slurm" and any(e.get("event") == "requeue_unknown" for e in attempt):
        # Rank 0's requeue got no answer in time yet took effect (the job is pending now): it was ours.
        outcome = RequeueOutcome("self", f"requeued job {job_id} by rank 0's earlier try, which got no answer in "
                                         f"time ({outcome.message})")
    if not first:
        ledger.write("stop_decision", **fields)
    ledger.write("requeued", step=step, how=outcome.how, message=outcome.message, by=by,
                 **({} if progressed else {"after": "no_progress"}))
    return _Ask(decision, why, unknown, Settled("requeued", f"{why}: {outcome.message}"))


class _Ended:
    """Set by Slurm's SIGTERM (the handler only sets a flag: an Event's lock taken in a handler could deadlock the
    main thread that holds it); `wait` sleeps in short slices, so the wait ends within a fifth of a second."""

    def __init__(self) -> None:
        self.flag = False

    def set(self) -> None:
        self.flag = True

    def is_set(self) -> bool:
        return self.flag

    def wait(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        while not self.flag and (left := until - time.monotonic()) > 0:
            time.sleep(min(0.2, left))


@contextlib.contextmanager
def _slurm_ending() -> Iterator[_Ended]:
    """While a stopped job waits for Slurm: its SIGTERM (a preemption's grace over, a scancel, the time limit) ends
    the wait; a user signal is ignored (it changes nothing now). Only in the main thread (Python's rule); elsewhere
    nothing ends the wait before its bound."""
    ended = _Ended()
    if threading.current_thread() is not threading.main_thread():
        yield ended
        return
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: ended.set()),
                **{signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGUSR1, signal.SIGUSR2)}}
    try:
        yield ended
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
