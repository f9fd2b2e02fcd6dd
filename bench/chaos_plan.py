"""The chaos benchmark's pure parts (bench/chaos.py runs them on the test cluster): the failure schedule, the
configurations, and the arithmetic from a run's ledger to its ETTR and each failure's cost. No torch, no cluster.

The schedule is declarative (torchft's habit): `Plan` lists every `Injection` (kind, when, target) drawn from a
seed, so a printed plan reproduces the run's failures. Inter-arrival times are exponential with the stated mean
time between failures; each failure's kind is drawn from the mix's weights and its target (a rank, a node) at
random too.

The arithmetic, per configuration, from the run's ledger (the events mgpu writes; the plain loop writes the same
ones) cut into segments by `mgpu.record.goodput.segments`:

    productive   each step of the final trajectory counted once, at its last training (a step trained again after
                 a failure counts only the second time); its time is the wall time since the step before it in the
                 same segment (a segment's first step: the segment's median step time)
    ETTR         productive step time / the configuration's wall time (submission to the window's end)
    recomputed   per failure: the highest step trained between the start it hit and the next start, minus the step
                 that next start resumed from
    back         per failure: the failure -> the first step of the next segment that trained
"""

from __future__ import annotations

import math
import random
import re
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from mgpu.record.goodput import Segment, compare_fingerprints, fingerprints, goodput, segments

__all__ = ["KINDS", "SETTLE_S", "Config", "Costs", "FailureCost", "Fired", "Injection", "Plan", "RunResult",
           "by_kind", "failure_costs", "make_plan", "may_fire", "parse_config", "parse_mix", "productive", "publish",
           "render", "run_result", "weights_verdict"]

KINDS = ("preempt-grace0", "preempt-grace10", "kill-rank", "freeze-rank", "drain-node", "kill-node")
"""preempt-grace0 / -grace10: a job in partition `high` preempts it, GraceTime 0 or 10 s (the user signal on);
kill-rank: one rank's process SIGKILLed; freeze-rank: one rank SIGSTOPped (it never wakes: the job must notice);
drain-node: `scontrol update state=drain`, resumed `drain_s` later; kill-node: both ranks of a node SIGKILLed and
its node memory (mgpu's snapshots and the replicas it holds) deleted; the node itself stays usable."""
TARGETED = {"kill-rank": "rank", "freeze-rank": "rank", "drain-node": "node", "kill-node": "node"}
BEGIN, END = "<!-- chaos -->", "<!-- /chaos -->"
"""docs/chaos.md's generated block."""
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*\Z")
_KEY = re.compile(r"[a-z_]+(\.[a-z_]+)+=")
PLAIN_KEYS = ("save_every", "timeout_s", "max_restarts")
"""What the plain loop's configuration may set (bench/chaos_plain.py's options)."""


# ------------------------------------------------------------------------------------------------ schedule
@dataclass(frozen=True)
class Injection:
    kind: str
    at_s: float
    """When it is due, in seconds after the configuration's submission."""
    target: str
    """`job`, `rank N` or a node's name."""


@dataclass(frozen=True)
class Plan:
    seed: int
    mtbf_s: float
    wall_s: float
    mix: tuple[tuple[str, float], ...]
    drain_s: float
    injections: tuple[Injection, ...] = field(default=())

    def lines(self) -> list[str]:
        mix = ", ".join(f"{kind} {weight:g}" for kind, weight in self.mix)
        head = (f"seed {self.seed}; mean time between failures {self.mtbf_s:g} s (exponential); wall time "
                f"{self.wall_s:g} s per configuration; mix {mix}; a drained node resumed after {self.drain_s:g} s")
        return [head, *(f"  {i.at_s:7.1f} s  {i.kind:<16} {i.target}" for i in self.injections)]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_mix(text: str) -> tuple[tuple[str, float], ...]:
    """`kill-rank=2,freeze-rank=1` (or `all`) -> ((kind, weight), ...) in KINDS' order; ValueError in one line."""
    if text.strip() == "all":
        return tuple((kind, 1.0) for kind in KINDS)
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, eq, value = part.partition("=")
        if kind not in KINDS:
            raise ValueError(f"--mix: unknown failure kind {kind!r}; the kinds: {', '.join(KINDS)}")
        try:
            weight = float(value) if eq else 1.0
        except ValueError:
            raise ValueError(f"--mix {part!r}: the weight must be a number, e.g. {kind}=2") from None
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"--mix {part!r}: the weight must be a number >= 0")
        weights[kind] = weight
    if not any(weights.values()):
        raise ValueError(f"--mix {text!r}: give at least one kind a weight above 0 (e.g. kill-rank=1), or `all`")
    return tuple((kind, weights[kind]) for kind in KINDS if weights.get(kind))


def make_plan(seed: int, mtbf_s: float, wall_s: float, mix: Sequence[tuple[str, float]], world: int,
              nodes: Sequence[str], drain_s: float, first_s: float = 0.0) -> Plan:
    """The failures due in [first_s, wall_s): exponential gaps of mean `mtbf_s` from `first_s`, each one's kind
    drawn by the mix's weights and its target (a rank of `world`, one of `nodes`) uniformly. The same arguments
    give the same plan."""
    if mtbf_s <= 0 or wall_s <= 0:
        raise ValueError("the mean time between failures and the wall time must be above 0")
    rng = random.Random(seed)
    kinds, weights = [k for k, _ in mix], [w for _, w in mix]
    out: list[Injection] = []
    at = first_s
    while True:
        at += rng.expovariate(1.0 / mtbf_s)
        if at >= wall_s:
            break
        kind = rng.choices(kinds, weights)[0]
        rank, node = rng.randrange(world), rng.choice(list(nodes))  # both drawn always: a kind's draw moves none
        what = TARGETED.get(kind)
        target = f"rank {rank}" if what == "rank" else node if what == "node" else "job"
        out.append(Injection(kind, round(at, 1), target))
    return Plan(seed, mtbf_s, wall_s, tuple(mix), drain_s, tuple(out))


SETTLE_S = 90.0
"""A failure the job trains on through for this long without starting again is over (a drain the plain loop ignores;
mgpu looks at its nodes every 60 s): the next may come."""


def may_fire(progress: float, started: float, since: float | None, start: float, now: float,
             settle_s: float = SETTLE_S) -> bool:
    """Whether the next failure may come, from the times of the ledger's newest `progress` and `started` events:
    the job has trained since its submission (`start`; no failure yet, `since` None), or since it started again
    after the last failure (fired at `since`), or it has trained on through that failure for `settle_s` and still
    does. So failures never overlap: each one's cost is its own."""
    if since is None:
        return progress > start
    if started > since:
        return progress > started
    return progress > since and now - since >= settle_s and progress >= now - 10


# ------------------------------------------------------------------------------------------------ configurations
@dataclass(frozen=True)
class Config:
    name: str
    plain: bool
    """The peer (bench/chaos_plain.py under torchrun) rather than mgpu."""
    overrides: tuple[str, ...]
    """mgpu's `key=value` overrides, or the plain loop's options (`save_every=100`)."""

    @property
    def spec(self) -> str:
        return f"{self.name}=" + " ".join((["plain"] if self.plain else []) + list(self.overrides))


def parse_config(text: str) -> Config:
    """`NAME=[plain] [key=value ...]` (spaces or commas between): mgpu with these overrides (none: its defaults),
    or with `plain` first the plain loop with its options. ValueError in one line."""
    name, eq, rest = text.partition("=")
    if not eq or not _NAME.match(name):
        raise ValueError(f"--config {text!r}: use NAME=[plain] [key=value ...], NAME a word (e.g. previous="
                         "checkpoint.memory_every_steps=100)")
    tokens = [t for t in re.split(r"[\s,]+", rest.strip()) if t]
    plain = bool(tokens) and tokens[0] == "plain"
    tokens = tokens[1:] if plain else tokens
    for token in tokens:
        key, has, value = token.partition("=")
        if plain and (not has or key not in PLAIN_KEYS or not value.isdigit()):
            raise ValueError(f"--config {name}: {token!r}: the plain loop takes {', '.join(PLAIN_KEYS)} (whole numbers)")
        if not plain and not _KEY.match(token):
            raise ValueError(f"--config {name}: {token!r} is no mgpu override (a dotted key=value, e.g. "
                             "checkpoint.memory_every_steps=100); `plain` must come first")
    return Config(name, plain, tuple(tokens))


# ------------------------------------------------------------------------------------------------ results
@dataclass(frozen=True)
class Fired:
    """An injection as it happened: due, actually fired (unix time), and what was done."""

    kind: str
    target: str
    due_s: float
    at: float
    detail: str = ""


@dataclass(frozen=True)
class FailureCost:
    kind: str
    target: str
    at_s: float
    """Fired, seconds after the submission."""
    stopped: bool
    """Training stopped because of it (a drain the job ignores, or one it has not seen yet: no)."""
    recomputed: int | None
    """Steps trained again; None: not back within the window."""
    back_s: float | None
    """The failure -> the first step trained after it; None: not back within the window (0: never stopped)."""


def _progress(events: Iterable[Mapping[str, Any]]) -> list[tuple[float, int]]:
    return [(float(e["time"]), int(e["step"])) for e in events
            if e.get("event") == "progress" and isinstance(e.get("step"), int)]


def failure_costs(events: Sequence[Mapping[str, Any]], fired: Sequence[Fired], start: float, end: float,
                  idle_s: float = 10.0) -> list[FailureCost]:
    """Each fired failure's cost (module docstring). A failure's effect is sought up to the next one (which only
    fires once the job has trained since) or the window's end; one with no new segment by then did not stop
    training, unless the job logged no step in the window's last `idle_s` (then it is not back)."""
    segs = segments(events)
    steps = _progress(events)
    out = []
    for i, f in enumerate(fired):
        until = fired[i + 1].at if i + 1 < len(fired) else end
        after = next((s for s in segs if f.at < s.start <= until and s.first_step_time is not None
                      and s.first_step_time <= end), None)
        back = after.first_step_time if after is not None else None
        at_s = round(f.at - start, 1)
        if after is not None and back is not None:
            # the steps trained since the start the failure hit (not those an earlier failure threw away)
            hit = max((s.start for s in segs if s.start <= f.at), default=start)
            reached = max((step for t, step in steps if hit <= t <= after.start), default=0)
            recomputed = max(0, reached - (after.resumed_step or 0))
            out.append(FailureCost(f.kind, f.target, at_s, True, recomputed, round(back - f.at, 1)))
            continue
        trained_since = [t for t, _ in steps if f.at < t <= until]
        still = bool(trained_since) and (until < end or max(trained_since) >= end - idle_s)
        out.append(FailureCost(f.kind, f.target, at_s, not still, 0 if still else None, 0.0 if still else None))
    return out


def productive(events: Sequence[Mapping[str, Any]], start: float, end: float) -> tuple[int, float]:
    """(the final trajectory's steps, their productive seconds) within [start, end] (module docstring)."""
    kept: dict[int, float] = {}
    final = 0
    for seg in segments([e for e in events if start <= e["time"] <= end]):
        marks = _progress(seg.events)
        if not marks:
            continue
        gaps = [b[0] - a[0] for a, b in zip(marks, marks[1:]) if b[1] == a[1] + 1]
        typical = statistics.median(gaps) if gaps else (seg.step_time_s or 0.0)
        previous: tuple[float, int] | None = None
        for t, step in marks:
            kept[step] = t - previous[0] if previous is not None and step == previous[1] + 1 else typical
            previous = (t, step)
        final = marks[-1][1]
    return final, sum(seconds for step, seconds in kept.items() if step <= final)


@dataclass(frozen=True)
class Costs:
    count: int
    recomputed: list[int]
    back_s: list[float]
    not_back: int
    not_stopped: int


def by_kind(costs: Sequence[FailureCost]) -> dict[str, Costs]:
    """Each kind's failures: the steps recomputed and the times back of those that stopped training and came back."""
    out = {}
    for kind in KINDS:
        mine = [c for c in costs if c.kind == kind]
        if not mine:
            continue
        back = [c for c in mine if c.stopped and c.back_s is not None]
        out[kind] = Costs(len(mine), [c.recomputed or 0 for c in back], [c.back_s or 0.0 for c in back],
                          sum(1 for c in mine if c.stopped and c.back_s is None), sum(1 for c in mine if not c.stopped))
    return out


def weights_verdict(events: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]],
                    final: int) -> dict[str, Any]:
    """The run's weights against the unbroken run's at every step of its final trajectory, up to `final`, that both
    logged (mgpu.record.goodput's fingerprints, a step's newest: exact bit sums), `final`'s included. Steps a
    failure threw away beyond `final` are not the run's weights."""
    mine = {step: value for step, value in fingerprints(events).items() if step <= final}
    verdict = compare_fingerprints(mine, fingerprints(reference))
    return {"identical": verdict.agree and final in verdict.common, "steps_compared": len(verdict.common),
            "final_step": final, "first_difference": verdict.first_difference}


@dataclass(frozen=True)
class RunResult:
    config: str
    wall_s: float
    steps: int
    productive_s: float
    ettr: float
    failures: list[FailureCost]
    lost_steps_ledger: int
    """mgpu.record.goodput's own count of lost steps over the whole ledger (a check on `recomputed`'s sum)."""
    resubmitted: int
    weights: dict[str, Any]
    first_step_s: float | None = None
    """Submission -> the first step: the start that ETTR's wall time includes even without a failure."""


def run_result(config: str, events: Sequence[Mapping[str, Any]], fired: Sequence[Fired], start: float, end: float,
               reference: Sequence[Mapping[str, Any]], resubmitted: int = 0) -> RunResult:
    steps, seconds = productive(events, start, end)
    window = [e for e in events if e["time"] <= end]
    first = min((t for t, _ in _progress(window) if t >= start), default=None)
    return RunResult(config, round(end - start, 1), steps, round(seconds, 1), round(seconds / (end - start), 4),
                     failure_costs(events, fired, start, end), goodput(window).lost_steps, resubmitted,
                     weights_verdict(window, reference, steps), None if first is None else round(first - start, 1))


# ------------------------------------------------------------------------------------------------ the table
def _spread(values: Sequence[float], unit: str, digits: int = 0) -> str:
    if not values:
        return "-"
    fmt = f"{{:.{digits}f}}"
    mid = fmt.format(statistics.median(values))
    return f"{mid}{unit}" if len(values) == 1 else f"{mid}{unit} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def render(plan: Plan, results: Sequence[RunResult], specs: Mapping[str, str]) -> str:
    """The tables: one line per configuration, then per failure kind its count, steps recomputed and time back
    (median, and the range, over that kind's failures), configurations side by side."""
    names = [r.config for r in results]
    lines = ["| configuration | ETTR | steps | first step after | failures | recomputed in all | final weights vs the "
             "unbroken run | resubmitted by hand |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        w = r.weights
        same = (f"identical ({w['steps_compared']} steps)" if w["identical"] else
                f"differ from step {w['first_difference']}" if w["first_difference"] is not None else
                f"not compared ({w['steps_compared']} steps in common)")
        total = sum(c.recomputed or 0 for c in r.failures)
        first = "-" if r.first_step_s is None else f"{r.first_step_s:.0f} s"
        lines.append(f"| {r.config} (`{specs.get(r.config, '')}`) | {r.ettr:.3f} | {r.steps} | {first} | {len(r.failures)} | "
                     f"{total} (goodput: {r.lost_steps_ledger}) | {same} | {r.resubmitted} |")
    kinds = [k for k in KINDS if any(c.kind == k for r in results for c in r.failures)]
    per = {r.config: by_kind(r.failures) for r in results}
    for title, cell in (("steps recomputed: median (range)", lambda c: _spread(c.recomputed, "")),
                        ("failure -> first step trained again, s: median (range)", lambda c: _spread(c.back_s, " s"))):
        lines += ["", f"| {title} | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for kind in kinds:
            cells = []
            for name in names:
                c = per[name].get(kind)
                if c is None:
                    cells.append("-")
                    continue
                notes = [f"{c.not_back} not back" if c.not_back else "", f"{c.not_stopped} ignored" if c.not_stopped
                         else ""]
                extra = "; ".join(n for n in notes if n)
                cells.append(f"{cell(c)} [{c.count}]" + (f" ({extra})" if extra else ""))
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def publish(page: str, block: str) -> str:
    """`page` with the text between BEGIN and END replaced by `block`; ValueError without the markers."""
    start, stop = page.find(BEGIN), page.find(END)
    if start < 0 or stop < start:
        raise ValueError(f"the page has no {BEGIN} ... {END} block to fill")
    return page[:start] + f"{BEGIN}\n{block.rstrip()}\n" + page[stop:]
