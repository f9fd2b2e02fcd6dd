"""A Session's end: the stop's last save (unless the loop made it durably at this step), the ledger's
`finished` or `preempted` event, the requeue decision (mgpu.run.outcome.decide_after_stop) and the run directory's
release; a stop Slurm left open, settled by rank 0 once the session is over where no batch script does; the
watchdog's bound on the process group's teardown; and removing what an attempt that failed on bad input before it
began created. `mgpu.run.session.Session` calls these; nothing else should. No torch at import.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

from mgpu.errors import MgpuError
from mgpu.run.outcome import Outcome, decide_after_stop
from mgpu.run.runner import discard
from mgpu.run.session_base import SessionBase


__all__ = ["arm_teardown", "conclude", "discard_if_unused", "never_asked", "settle_open_stop",
           "straggler_to_exclude"]

log = logging.getLogger("mgpu.train")


def conclude(session: SessionBase, status: str | None, fields: dict[str, Any]) -> Outcome:
    """What `Session.end` decides: after a stop, the state saved (if not at this step already) and whether the
    job comes back; otherwise the run finished. `status`, `fields`: as `Session.end`'s."""
    reasons = session.reasons
    stopped = bool(reasons) if status is None else status == "stopped"
    saved_at, path = session._durable  # a stop's checkpoint has one owner: the loop, else here
    if session._state is not None and saved_at != session.step:
        path = session.save(reason="preemption" if stopped else "final", wait=True)
    if not stopped:
        if session.is_main and (line := never_asked(session)) is not None:
            log.warning("%s", line)
        session.ledger.write("finished", step=session.step, status=status or "finished",
                             seconds=round(time.time() - session.started, 3), **fields)
        if session.is_main:
            session.run.release(session.env.job_id)
        return Outcome("finished")
    received = session.stop.received
    log.info("stopping at step %d (%s; signals on this rank: %s)", session.step, ", ".join(sorted(reasons)),
             [name for name, _ in received])
    session.ledger.write("preempted", step=session.step, reasons=sorted(reasons),
                         signals=[name for name, _ in received], signal_times=[round(t, 3) for _, t in received])
    outcome = decide_after_stop(reasons, session.step, session.resume_step, str(path) if path else None,
                                session.budgets, session.env, session.ledger, signals=list(received),
                                straggler=straggler_to_exclude(session))
    if outcome.kind == "stays_down":
        session.run.release(session.env.job_id)
    return outcome


def straggler_to_exclude(session: SessionBase) -> tuple[str, str] | None:
    """Rank 0, with stragglers.exclude_node: (node, why) of the slowest straggler named now, whose node a requeue
    by this rank excludes; None otherwise."""
    watch = session.stragglers
    if watch is None or not session.cfg.stragglers.exclude_node or not watch.named:
        return None
    from mgpu.record.stragglers import exclusion_reason

    rank = max(watch.named, key=watch.window_factor)
    return watch.node(rank), exclusion_reason(rank, round(watch.window_factor(rank), 3))


def settle_open_stop(session: SessionBase, outcome: Outcome) -> Outcome:
    """Rank 0, once its session has ended (no group, no watchdog), where no batch script settles a stop Slurm left
    open (MGPU_RECOVERY unset): `mgpu.run.unanswered.settle_stop`, which may keep this process alive, idle, until
    Slurm answers or ends the job. Any other outcome, rank or launcher: `outcome` as it is."""
    import os

    by_batch = session._by_batch if session._by_batch is not None else os.environ.get("MGPU_RECOVERY") == "batch"
    job_id = session.budgets.job_id
    if outcome.kind != "unknown" or not session.is_main or by_batch or job_id is None:
        return outcome
    from mgpu.record.ledger import read_ledger
    from mgpu.run.unanswered import open_stop, settle_stop, this_attempt

    events = read_ledger(session.run.ledger)
    attempt = this_attempt(events, job_id, session.env.restart_count)
    decided = open_stop(attempt)
    if decided is None:
        return outcome
    settled = settle_stop(session.run, job_id, session.env.restart_count, session.limits, events, attempt, decided,
                          by="rank 0", prog="mgpu")
    if settled.kind == "stays_down":
        session.run.release(session.env.job_id)
    return Outcome(settled.kind, settled.message)


def never_asked(session: SessionBase) -> str | None:
    """The warning for a loop that trained without ever asking `should_stop()`: it ends at step 0 although a loader
    of its state read batches (None otherwise). Such a loop is never stopped together nor saved at a stop."""
    state = session._state
    read = [value.epoch * value.samples_per_epoch + value.position for value in state.values()
            if hasattr(value, "plan") and isinstance(getattr(value, "position", None), int)] \
        if isinstance(state, Mapping) else []
    if session.step or session.resume_step or not any(read):
        return None
    return (f"the loop ended at step 0 after its loader read {max(read)} samples: it never asked "
            f"session.should_stop(); call it once per optimizer step, after optimizer.step(): mgpu counts a step "
            f"there, and a stop is agreed and saved there (without it a preemption loses the run's work)")


def arm_teardown(session: SessionBase) -> None:
    """From here the watchdog bounds the group's teardown (a dead peer can block it): past its allowance,
    stacks to the log and an exit, 4 when the run did not end as it should; when it did (its outcome is
    recorded: nothing is lost by cutting the teardown short), within ENDED_TEARDOWN_S and with the outcome's
    exit code, so that the rank is gone before Slurm's KillWait runs out."""
    assert session.watchdog is not None
    from mgpu.stop.watchdog import ENDED_TEARDOWN_S, HANG_EXIT_CODE, TEARDOWN_S

    if session._ended:
        session.watchdog.teardown(exit_code=session._ended_code, allowance_s=ENDED_TEARDOWN_S)
    else:
        session.watchdog.teardown(exit_code=HANG_EXIT_CODE, allowance_s=TEARDOWN_S)


def discard_if_unused(session: SessionBase, error: BaseException) -> None:
    """Bad input found before the run began leaves no trace of this attempt."""
    if isinstance(error, MgpuError) and not session._began and session._created is not None:
        discard(session.run, session.rank, session._created)
