"""Where a run's time went, from its ledger (`events.jsonl`, see mgpu.record.ledger): pure functions, no torch.

A run is a sequence of *segments*: one per start of the training processes (a `started` event; a new
job id, restart count or an in-allocation `restarted` also begins one). Its time is cut into

    starting     the run's first start -> its first step (torch import, rendezvous; with sacct, from the
                 allocation's start)
    training     first step -> the stop (the first stop signal, the hang's last progress, the last sign of
                 life before a failure) or the end of training; steps that a later segment trains again are
                 `recomputing` instead (lost steps x the median step time)
    stopping     the stop -> the segment's last event (the stop's checkpoint, asking Slurm, requeueing);
                 with sacct, to the allocation's end
    restarting   one segment's end -> the next one's first step: the exit, Slurm's requeue hold, the process
                 start, loading the checkpoint; from the ledger alone also the time the job waited in the queue
    queued       only with sacct (`parse_sacct`): submit -> the first allocation, and a requeued job's pending
                 time between allocations (taken out of `restarting`)

Allocated time is only known from sacct: without it the ledger spans from its first event to its last, the
wait before the first start is unknown, and the queue wait between runs is part of `restarting`.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["Interval", "Segment", "Goodput", "SacctRun", "StopCost", "Verdict", "compare_fingerprints",
           "duration", "fingerprints", "goodput", "goodput_lines", "parse_sacct", "parse_slurm_time", "segments", "timeline",
           "PREEMPTION_KINDS", "SACCT_FIELDS"]

Event = Mapping[str, Any]
DAY_S = 86400.0
PREEMPTION_KINDS = ("preempted", "requeued_by_slurm")
"""Stops counted as preemptions: inside a grace period (self-requeued) or with GraceTime 0 (Slurm requeued;
an outside `scontrol requeue` looks the same to the job)."""
SACCT_FIELDS = ("JobID", "State", "Submit", "Start", "End")
_STEP_EVENTS = ("progress", "checkpoint_saved", "evaluated", "first_step", "preempted", "finished", "hang",
                "resumed", "early_stopped")
_LIFE_EVENTS = ("progress", "checkpoint_saved", "evaluated", "first_step", "started", "resumed")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


@dataclass(frozen=True)
class Segment:
    """One start of the training processes, as the ledger saw it."""

    job_id: str
    restart: int
    start: float
    end: float
    """Its last event (the run's own clock stops there)."""
    first_step_time: float | None
    resumed_step: int | None
    """The step it resumed from; 0 when it started from scratch; None when it never got that far."""
    last_step: int
    stop_time: float | None
    """When it was told to stop or stopped making progress; None when it finished or still runs."""
    kind: str
    """How it ended: finished, early_stopped, a stop (mgpu.cluster.requeue's event: preempted, time_limit, ...),
    stopped, hang, failure, failed_not_retried, killed (no trace), or running (the newest, no end yet)."""
    step_time_s: float | None
    checkpoint_blocked_s: float
    events: tuple[Event, ...] = field(repr=False, default=())


def _split(events: Sequence[Event]) -> list[list[Event]]:
    """A new segment at every `started`, at a new (job id, restart), and after an in-allocation `restarted`."""
    groups: list[list[Event]] = []
    key: tuple[str, int] | None = None
    for event in events:
        this = (str(event.get("job_id")), _int(event.get("restart")) or 0)
        if not groups or event["event"] == "started" or this != key or groups[-1][-1]["event"] == "restarted":
            if not groups or groups[-1]:
                groups.append([])
        groups[-1].append(event)
        key = this
    return groups


def _has(group: Sequence[Event], name: str) -> bool:
    return any(e["event"] == name for e in group)


def _kind(group: Sequence[Event], newest: bool) -> str:
    names = {e["event"] for e in group}
    if "hang" in names:
        return "hang"
    if any(e["event"] == "failed" and e.get("retry") is False for e in group):
        return "failed_not_retried"
    decisions = [e for e in group if e["event"] == "stop_decision"]
    if "failed" in names or any("error" in e for e in decisions):
        return "failure"
    if decisions:
        what = decisions[-1].get("what")
        return what if isinstance(what, str) and what else "stopped"
    if "preempted" in names:
        return "stopped"
    for event in reversed(group):
        if event["event"] == "finished":
            status = event.get("status")
            return "early_stopped" if status == "early_stopped" else "finished"
    return "running" if newest else "killed"


def _stop_time(group: Sequence[Event], kind: str, floor: float, end: float) -> float | None:
    if kind in ("finished", "early_stopped", "running"):
        return None
    clamp = lambda t: min(max(t, floor), end)  # noqa: E731
    if kind == "hang":
        hang = next(e for e in group if e["event"] == "hang")
        return clamp(hang["time"] - (_num(hang.get("waited_s")) or 0.0))
    preempted = next((e for e in group if e["event"] == "preempted"), None)
    if preempted is not None:
        times = [t for t in (preempted.get("signal_times") or []) if _num(t) is not None] \
            if isinstance(preempted.get("signal_times"), list) else []
        if times:
            return clamp(min(times))
        save = next((e for e in group if e["event"] == "checkpoint_saved" and e.get("reason") == "preemption"), None)
        if save is not None:
            return clamp(save["time"] - (_num(save.get("seconds")) or 0.0))
        return clamp(preempted["time"])
    alive = [e["time"] for e in group if e["event"] in _LIFE_EVENTS]
    return clamp(max(alive)) if alive else floor


def segments(events: Sequence[Event]) -> list[Segment]:
    """The ledger's events (oldest first, as `read_ledger` returns them) cut into segments."""
    out: list[Segment] = []
    groups = _split(events)
    for index, group in enumerate(groups):
        start, end = group[0]["time"], max(e["time"] for e in group)
        first = next((e["time"] for e in group if e["event"] == "first_step"), None)
        if first is None:  # a ledger without the event: its first sign of a trained step
            first = next((e["time"] for e in group if e["event"] in ("progress", "checkpoint_saved")), None)
        resumed = next((e for e in group if e["event"] == "resumed"), None)
        resumed_step = (_int(resumed.get("step")) or 0) if resumed else (0 if _has(group, "started") else None)
        steps = [s for e in group if e["event"] in _STEP_EVENTS and (s := _int(e.get("step"))) is not None]
        kind = _kind(group, index == len(groups) - 1)
        stop = _stop_time(group, kind, first if first is not None else start, end)
        step_times = [t for e in group if e["event"] == "progress" and isinstance(e.get("metrics"), dict)
                      and (t := _num(e["metrics"].get("step_time_s"))) is not None and t > 0]
        blocked = sum(_num(e.get("blocked_s")) or 0.0 for e in group if e["event"] == "checkpoint_saved")
        out.append(Segment(str(group[0].get("job_id")), _int(group[0].get("restart")) or 0, start, end, first,
                           resumed_step, max(steps, default=resumed_step or 0), stop, kind,
                           statistics.median(step_times) if step_times else None, blocked, tuple(group)))
    return out


# ----------------------------------------------------------------------------------------------- sacct
def parse_slurm_time(text: str) -> float | None:
    """sacct's `2026-11-25T09:03:58` (the local time zone, as sacct prints it) -> unix seconds; None for
    `Unknown`, `None` and anything else."""
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


@dataclass(frozen=True)
class SacctRun:
    """One run of a job (`sacct -D -X`: a requeued job has one row per run)."""

    job_id: str
    state: str
    submit: float | None
    start: float | None
    end: float | None


def parse_sacct(text: str) -> list[SacctRun]:
    """`sacct -D -X -n -P -o JobID,State,Submit,Start,End` -> runs, oldest first. Lines of another shape
    (a warning, a torn line) are left out."""
    runs = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != len(SACCT_FIELDS) or not parts[0]:
            continue
        job, state, submit, start, end = parts
        runs.append(SacctRun(job, state.split()[0] if state.strip() else "", parse_slurm_time(submit),
                             parse_slurm_time(start), parse_slurm_time(end)))
    return sorted(runs, key=lambda r: (r.start is None, r.start or 0.0))


# ----------------------------------------------------------------------------------------------- timeline
@dataclass(frozen=True)
class Interval:
    start: float
    end: float
    kind: str
    """queued, starting, training, recomputing, stopping, restarting."""
    segment: int | None = None

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


def _run_of(seg: Segment, runs: Sequence[SacctRun]) -> SacctRun | None:
    """The sacct run whose allocation holds the segment's start (its own job id)."""
    for run in runs:
        if run.job_id.split(".")[0] == seg.job_id and run.start is not None and run.start - 2 <= seg.start \
                and (run.end is None or seg.start <= run.end + 2):
            return run
    return None


def _lost_steps(segs: Sequence[Segment]) -> list[int]:
    """Steps each segment's stop threw away: trained, then trained again by the next start that resumed
    from an earlier step (normally 0: a stop saves at its step)."""
    lost = [0] * len(segs)
    high, owner = 0, None
    for i, seg in enumerate(segs):
        if seg.resumed_step is not None and owner is not None and high > seg.resumed_step:
            lost[owner] += high - seg.resumed_step
            high = seg.resumed_step
        if seg.resumed_step is not None or seg.last_step:
            high, owner = max(high, seg.last_step), i
    return lost


def timeline(segs: Sequence[Segment], runs: Sequence[SacctRun] = (), now: float | None = None) -> list[Interval]:
    """Every second of the run in one category, oldest first. `runs`: sacct's, when known; `now`: extend
    a running newest segment to this time."""
    out: list[Interval] = []
    lost = _lost_steps(segs)
    step_times = [s.step_time_s for s in segs if s.step_time_s]
    typical = statistics.median(step_times) if step_times else 0.0
    owners = [_run_of(seg, runs) for seg in segs]
    for i, seg in enumerate(segs):
        run = owners[i]
        first_in_run = run is not None and (i == 0 or owners[i - 1] is not run)
        last_in_run = run is not None and (i == len(segs) - 1 or owners[i + 1] is not run)
        if first_in_run and run is not None and run.start is not None:
            before = owners[i - 1] if i else None
            queued_from = before.end if before is not None and before.job_id == run.job_id else run.submit
            if queued_from is not None and i:
                # sacct's whole seconds may end a run before its last ledger event: the ledger wins.
                queued_from = max(queued_from, segs[i - 1].end)
            if queued_from is not None and run.start > queued_from:
                out.append(Interval(queued_from, run.start, "queued", i))
        begin = run.start if first_in_run and run is not None and run.start is not None else seg.start
        end = seg.end
        if seg.kind == "running" and now is not None:
            end = max(end, now)
        elif last_in_run and run is not None and run.end is not None:
            end = max(end, run.end)
        trained_from = seg.first_step_time
        starting = "starting" if i == 0 else "restarting"
        if trained_from is None:
            out.append(Interval(begin, end, starting, i))
        else:
            out.append(Interval(begin, trained_from, starting, i))
            stop = seg.stop_time if seg.stop_time is not None else (end if seg.kind == "running" else seg.end)
            redo = lost[i] * (seg.step_time_s or typical)
            # The lost steps are the last ones trained before the stop: that stretch was for nothing.
            redo_from = max(trained_from, stop - redo)
            out.append(Interval(trained_from, redo_from, "training", i))
            if stop > redo_from:
                out.append(Interval(redo_from, stop, "recomputing", i))
            out.append(Interval(stop, end, "stopping", i))
        if i + 1 < len(segs):
            nxt = segs[i + 1]
            owner = owners[i + 1]
            same_alloc = run is not None and owner is run
            gap_end = nxt.start if (same_alloc or owner is None or owner.start is None) else owner.start
            if run is None or owner is None or same_alloc:
                if gap_end > end:
                    out.append(Interval(end, gap_end, "restarting", i))
    # Sources disagree by a second here and there (sacct's whole seconds, clocks of other nodes): every
    # second is counted once, in the category that began first.
    clipped: list[Interval] = []
    for iv in sorted(out, key=lambda iv: iv.start):
        start = max(iv.start, clipped[-1].end) if clipped else iv.start
        if iv.end > start:
            clipped.append(Interval(start, iv.end, iv.kind, iv.segment))
    return clipped


# ----------------------------------------------------------------------------------------------- goodput
@dataclass(frozen=True)
class StopCost:
    kind: str
    count: int
    total_s: float
    """From each stop to the next segment's first step, plus its recomputed steps."""
    lost_steps: int
    unrecovered: int
    """Stops no later segment came back from (the run stayed down, or still waits)."""


@dataclass(frozen=True)
class Goodput:
    span_s: float
    """First to last moment known (the first submit with sacct, else the first event; now while running)."""
    by_kind: dict[str, float]
    """Seconds per Interval kind."""
    allocated_s: float | None
    """The time in sacct's allocations (None: unknown without sacct)."""
    lost_steps: int
    stops: list[StopCost]
    preemptions: int
    segments: int
    memory_steps: int = 0
    """Steps a failure would have lost that a restore from the snapshots in memory kept (each such resume's step
    minus its durable checkpoint's: checkpoint.memory_every_steps), apart from the lost steps trained again."""

    @property
    def useful_s(self) -> float:
        return self.by_kind.get("training", 0.0)

    @property
    def preemptions_per_day(self) -> float | None:
        return self.preemptions * DAY_S / self.span_s if self.span_s > 0 else None


def goodput(events: Sequence[Event], runs: Sequence[SacctRun] = (), now: float | None = None) -> Goodput:
    """The run's time by category, its stops' costs and its preemption rate."""
    segs = segments(events)
    if not segs:
        return Goodput(0.0, {}, None, 0, [], 0, 0)
    intervals = timeline(segs, runs, now)
    by_kind: dict[str, float] = {}
    for iv in intervals:
        by_kind[iv.kind] = by_kind.get(iv.kind, 0.0) + iv.seconds
    lost = _lost_steps(segs)
    typical = statistics.median([s.step_time_s for s in segs if s.step_time_s] or [0.0])
    stops: dict[str, StopCost] = {}
    for i, seg in enumerate(segs):
        if seg.kind in ("finished", "early_stopped", "running"):
            continue
        back = next((s.first_step_time for s in segs[i + 1:] if s.first_step_time is not None), None)
        stop = seg.stop_time if seg.stop_time is not None else seg.end
        cost = (back - stop if back is not None else 0.0) + lost[i] * (seg.step_time_s or typical)
        old = stops.get(seg.kind, StopCost(seg.kind, 0, 0.0, 0, 0))
        stops[seg.kind] = StopCost(seg.kind, old.count + 1, old.total_s + max(0.0, cost), old.lost_steps + lost[i],
                                   old.unrecovered + (back is None))
    first = min([iv.start for iv in intervals] + [segs[0].start])
    last = max([iv.end for iv in intervals] + [segs[-1].end])
    # With sacct every interval but `queued` lies in an allocation (sacct's whole seconds and the ledger's
    # clock agree to a second or so): that is the allocated time.
    matched = any(_run_of(s, runs) for s in segs)
    allocated = sum(v for k, v in by_kind.items() if k != "queued") if matched else None
    return Goodput(last - first, by_kind, allocated, sum(lost), sorted(stops.values(), key=lambda c: c.kind),
                   sum(1 for s in segs if s.kind in PREEMPTION_KINDS), len(segs), memory_steps=_memory_steps(events))


def _memory_steps(events: Sequence[Event]) -> int:
    """Steps kept by restores from memory: the `resumed` events marked `memory`, past their durable step."""
    return sum(max(0, step - max(durable, 0)) for e in events if e.get("event") == "resumed" and e.get("memory")
               if (step := _int(e.get("step"))) is not None and (durable := _int(e.get("durable_step"))) is not None)


def duration(seconds: float) -> str:
    """`42s`, `3m07s`, `5h02m`, `2d03h`: a duration (or an age) as the status and goodput reports print it."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < DAY_S:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


_ROWS = (
    ("queued", "waiting for an allocation (sacct: submit or requeue -> start)"),
    ("starting", "the first start -> first step (imports, rendezvous)"),
    ("training", "first step -> stop, steps kept"),
    ("recomputing", "steps trained again after a stop lost them"),
    ("stopping", "stop signal or failure -> exited (saving, requeueing)"),
    ("restarting", "exited -> the next first step (requeue hold, start, loading the checkpoint{queue})"),
)


_WAY_BACK = {
    "hold": "exited -> the next process start (the requeue hold, the queue wait)",
    "process start": "-> the session (the interpreter, imports)",
    "rendezvous": "-> the process group formed",
    "state load": "-> the checkpoint found, read and restored",
    "first step": "-> the first step done",
}


def goodput_lines(g: Goodput, sacct_known: bool, way_back: Mapping[str, float] | None = None) -> list[str]:
    """The goodput table and the stops table, as `jobs/status.py` prints them; `way_back`: the restarts' phases
    summed (mgpu.record.restarts.phase_totals), shown under `restarting`."""
    if not g.segments:
        return []
    base = g.allocated_s if g.allocated_s else g.span_s
    of = "allocated (sacct)" if g.allocated_s else "from the first event to the last"
    lines = [f"goodput     {100 * g.useful_s / base if base else 0:.1f}% of {duration(base)} {of} spent training; "
             f"{g.segments} segment(s)" + ("" if g.allocated_s else
                                           f"; {'sacct has no record of its jobs' if sacct_known else 'no sacct'}: "
                                           "time queued is not known apart")]
    for key, what in _ROWS:
        seconds = g.by_kind.get(key)
        if seconds is None and key != "training":
            continue
        share = f"{100 * (seconds or 0) / base:5.1f}%" if key != "queued" and base else "      "
        what = what.format(queue="" if g.allocated_s else "; and the queue wait, without sacct")
        lines.append(f"  {key:<13}{duration(seconds or 0):>9} {share}  {what}")
        if key == "restarting" and way_back and any(name in way_back for name in _WAY_BACK):
            lines.append("   the way back, every restart summed (status's `restarts`):")
            lines += [f"    {name:<14}{duration(way_back[name]):>6}         {meaning}"
                      for name, meaning in _WAY_BACK.items() if name in way_back]
    lines.append(f"  {'lost steps':<13}{g.lost_steps:>9}         trained again after a stop (normally 0)")
    if g.memory_steps:
        lines.append(f"  {'from memory':<13}{g.memory_steps:>9}         restored from memory after a failure, not trained "
                     "again (checkpoint.memory_every_steps)")
    if g.stops:
        per_day = g.preemptions_per_day
        rate = f"{per_day:.3g}" if per_day is not None else "?"
        lines.append(f"stops       {sum(s.count for s in g.stops)}; preemptions {g.preemptions} ({rate} per day)")
        lines.append(f"  {'kind':<20}{'count':>6}{'cost each':>11}{'total':>9}{'lost steps':>12}")
        for s in g.stops:
            done = s.count - s.unrecovered
            each = duration(s.total_s / done) if done else "-"
            note = f"  ({s.unrecovered} not back yet)" if s.unrecovered else ""
            lines.append(f"  {s.kind:<20}{s.count:>6}{each:>11}{duration(s.total_s):>9}{s.lost_steps:>12}{note}")
    return lines


# ----------------------------------------------------------------------------------------------- continuity
def fingerprints(events: Iterable[Event]) -> dict[int, str]:
    """step -> the weights' fingerprint at that step (`progress` events); a step logged twice (trained again
    after a lost stop) keeps its newest."""
    out: dict[int, str] = {}
    for event in events:
        step, value = _int(event.get("step")), event.get("fingerprint")
        if event.get("event") == "progress" and step is not None and isinstance(value, str) and value:
            out[step] = value
    return out


def _same(a: str, b: str) -> bool:
    try:
        return float.fromhex(a) == float.fromhex(b) or a == b
    except (ValueError, OverflowError):
        return a == b


@dataclass(frozen=True)
class Verdict:
    agree: bool
    common: list[int]
    """Steps both runs logged, in order."""
    first_difference: int | None
    a: str | None = None
    b: str | None = None


def compare_fingerprints(a: Mapping[int, str], b: Mapping[int, str]) -> Verdict:
    """Whether two runs had the same weights at every step both logged; the first step where not."""
    common = sorted(set(a) & set(b))
    for step in common:
        if not _same(a[step], b[step]):
            return Verdict(False, common, step, a[step], b[step])
    return Verdict(bool(common), common, None)
