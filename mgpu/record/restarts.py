"""Every restart explained in one place: for each stop or failure of a run, its cause, the rank and node, what
was decided and why, and where the time went on the way back to training. Pure functions over the ledger
(mgpu.record.ledger; segments from mgpu.record.goodput); no torch.

The way back, from the stop to the next first step, is cut at the moments the ledger holds:

    stopping       the stop (the first signal, the hang's last progress, the last sign of life) -> the attempt's
                   last event (the stop's checkpoint, asking Slurm, requeueing)
    hold           -> the next attempt's process start: the exit, Slurm's requeue hold and the queue wait (the
                   allocation's end and start, where sacct is known, tell the queue apart: mgpu.record.goodput)
    process start  -> the session's start (the interpreter, torch's import)
    rendezvous     -> the process group formed
    state load     -> the checkpoint found, read and restored (or the group, for a run with none)
    first step     -> the first step done

The four last are rank 0's clock (the `first_step` event's `timings`); an attempt killed before its first step has
none, and its restart says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from mgpu.record.goodput import Segment, duration, segments

__all__ = ["PHASES", "UNTIMED", "Restart", "phase_totals", "restart_lines", "restarts"]

Event = Mapping[str, Any]
PHASES = ("stopping", "hold", "process start", "rendezvous", "state load", "first step")
"""The way back to training, in order."""
UNTIMED = "to the first step"
"""The way back of an attempt whose first step recorded no timings (a ledger from before them), as one stretch."""
_MARKS = ("process", "session", "group", "restored", "first_step")
"""The `first_step` timings that end the phases from `process start` on (`restored`, else `loaded`, else `group`)."""


@dataclass(frozen=True)
class Restart:
    """One stop or failure and what followed."""

    step: int
    """The last step the stopped attempt reached."""
    cause: str
    where: str
    """The rank(s) and node(s) to blame ("" when none is: a preemption, a time limit)."""
    decision: str
    """requeued (by whom), restarted in place, node excluded, stays down, waits for Slurm, or unknown."""
    why: str
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds in each of PHASES that the ledger can tell (none after a stop the run has not come back from)."""
    back: bool = False
    """The run came back to training after it."""

    @property
    def total_s(self) -> float:
        return sum(self.phases.values())


def _num(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _first(group: Sequence[Event], name: str) -> Event | None:
    return next((e for e in group if e.get("event") == name), None)


def _last(group: Sequence[Event], name: str) -> Event | None:
    return next((e for e in reversed(group) if e.get("event") == name), None)


def _strings(value: Any) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []


def _cause(seg: Segment) -> tuple[str, str]:
    """(what stopped the attempt, who is to blame)."""
    group = seg.events
    hang = _first(group, "hang")
    if hang is not None:
        ranks, hosts = _strings(hang.get("ranks")), _strings(hang.get("hosts"))
        where = f"rank {', '.join(ranks)} on {', '.join(hosts) or '?'}" if ranks else "no rank identified"
        return f"hang (no progress for {_num(hang.get('waited_s')) or 0:.0f} s)", where
    failed = [e for e in group if e.get("event") == "failed"]
    own = next((e for e in failed if not e.get("consequence")), failed[0] if failed else None)
    decision = _last(group, "stop_decision")
    if own is not None:
        error = " ".join(str(own.get("error", "")).split())[:120]
        rank = own.get("rank")
        where = f"rank {rank}" + (f" on {own['host']}" if isinstance(own.get("host"), str) else "") \
            if isinstance(rank, int) else ""
        return f"failure: {error}", where
    if decision is not None and "error" in decision:
        rank = decision.get("rank")
        return (f"failure: {' '.join(str(decision['error']).split())[:120]}",
                f"rank {rank}" if isinstance(rank, int) else "")
    preempted = _first(group, "preempted")
    if preempted is not None:
        reasons = ", ".join(_strings(preempted.get("reasons"))) or "stop"
        signals = ", ".join(_strings(preempted.get("signals")))
        what = decision.get("what") if decision is not None and isinstance(decision.get("what"), str) else seg.kind
        return f"{what}: {reasons}" + (f" ({signals})" if signals else ""), ""
    if seg.kind == "killed":
        return "killed without a trace (SIGKILL, a lost node, the time limit's kill)", ""
    return seg.kind, ""


def _decision(group: Sequence[Event]) -> tuple[str, str]:
    """(what was decided, why)."""
    decision = _last(group, "stop_decision")
    why = str(decision.get("reason", "")) if decision is not None else ""
    excluded = _last(group, "node_excluded")
    requeued = _last(group, "requeued")
    if _last(group, "restarted") is not None:
        return "restarted in place", why
    if requeued is not None:
        how = "by itself" if requeued.get("how") == "self" else "by Slurm"
        node = f", {excluded.get('node')} excluded" if excluded is not None else ""
        return f"requeued {how}{node}", why
    if _last(group, "awaiting_slurm") is not None:
        return "waits for Slurm", why
    if decision is not None:
        if decision.get("what") == "requeued_by_slurm":
            return "requeued by Slurm", why
        if decision.get("unknown"):
            return "unknown (Slurm did not answer)", why
        if decision.get("requeue") is False or decision.get("action") == "none":
            return "stays down", why
    return "none recorded", why


def _phases(seg: Segment, nxt: Segment | None) -> dict[str, float]:
    """The seconds of each phase from this attempt's stop to the next one's first step, as far as known."""
    stop = seg.stop_time if seg.stop_time is not None else seg.end
    phases = {"stopping": max(0.0, seg.end - stop)}
    if nxt is None:
        return phases
    first = _first(nxt.events, "first_step")
    timings = first.get("timings") if first is not None else None
    marks: dict[str, float] = {}
    if isinstance(timings, Mapping):
        for key, value in timings.items():
            if (number := _num(value)) is not None:
                marks[str(key)] = number
    marks.setdefault("restored", marks.get("loaded", marks.get("group", math.nan)))
    if first is not None:
        marks.setdefault("first_step", first["time"])
    if not all(name in marks and math.isfinite(marks[name]) for name in _MARKS):
        if nxt.first_step_time is not None:  # no timings (an older ledger): the way back as one stretch
            phases[UNTIMED] = max(0.0, nxt.first_step_time - seg.end)
        return phases
    phases["hold"] = max(0.0, marks["process"] - seg.end)
    for name, (begin, end) in zip(PHASES[2:], zip(_MARKS, _MARKS[1:])):
        phases[name] = max(0.0, marks[end] - marks[begin])
    return phases


def restarts(events: Sequence[Event]) -> list[Restart]:
    """Every stop or failure in the ledger (oldest first), explained."""
    segs = segments(events)
    found = []
    for index, seg in enumerate(segs):
        if seg.kind in ("finished", "early_stopped", "running"):
            continue
        nxt = segs[index + 1] if index + 1 < len(segs) else None
        cause, where = _cause(seg)
        decision, why = _decision(seg.events)
        back = nxt is not None and nxt.first_step_time is not None
        found.append(Restart(seg.last_step, cause, where, decision, why, _phases(seg, nxt if back else None), back))
    return found


def phase_totals(found: Sequence[Restart]) -> dict[str, float]:
    """The seconds of each phase over every restart that came back (what the goodput table sums)."""
    totals: dict[str, float] = {}
    for restart in found:
        if restart.back:
            for name, seconds in restart.phases.items():
                totals[name] = totals.get(name, 0.0) + seconds
    return totals


def restart_lines(found: Sequence[Restart], limit: int = 10) -> list[str]:
    """What `status` lists: each restart (the newest `limit`) in two lines (the goodput table sums the phases:
    `phase_totals`)."""
    if not found:
        return []
    lines = [f"restarts    {len(found)}: cause, where, decision and why; the way back to training"
             + (f" (the newest {limit})" if len(found) > limit else "")]
    for number, restart in list(enumerate(found, 1))[-limit:]:
        where = f" [{restart.where}]" if restart.where else ""
        why = f": {restart.why}" if restart.why else ""
        lines.append(f"  {number:>2}. after step {restart.step}: {restart.cause}{where}; {restart.decision}{why}")
        steps = ", ".join(f"{name} {duration(seconds)}" for name, seconds in restart.phases.items())
        tail = f"back in {duration(restart.total_s)}: {steps}" if restart.back else f"not back: {steps}"
        lines.append(f"      {tail}")
    return lines
