"""Which rank holds the others up: every rank's compute per step (mgpu.stop.rank_timing, carried by the stop
agreement) compared, and a rank persistently slower than the others named. Pure; no torch.

Each reading is one agreement's interval (about a second of steps): every rank's median compute and wait per
step. A rank's *factor* in a reading is its compute over the median of the *other* ranks' (with two ranks, the
other one: a rank 30 % slower is 1.3, not 1.3 / 1.15 against a median it is part of).

- Named: a rank whose factor is at least `margin` in at least half the steps of the last `hold_s` seconds and
  `hold_steps` steps (the window's step-weighted median factor is over the margin) is a straggler, in one line
  (rank, node, factor: the window's median, since: the window's first step); cleared once that median is under
  the margin again.
- Shown: per rank an EWMA of its compute and wait over steps (ALPHA a step: an interval of n steps weighs
  1 - (1 - ALPHA)^n), their min, median and max over ranks, and the slowest rank's EWMA over the others'.

Why a window's median, not an EWMA held over the margin: measured on this project's test machine (2 cores,
shared with other developers' jobs; tests/fixtures/rank_noise), a rank's compute per interval swings 1.5-3.4x
against another's, and one rank can get half a core for ten seconds. An EWMA that must stay over the margin
throughout a hold dips under it now and then even for a rank 30 % slower (its minimum over 20 s windows fell
to 1.00-1.18 on the CPU-bound traces), while a burst lifts it over the margin for a noisy rank; the median over
20 s stayed at most 1.17 for every unperturbed trace and at least 1.20 for a rank made 1.3x slower in windows
without a burst on another rank (tests/test_stragglers.py replays the traces). Counting the steps over the
margin costs one comparison per rank and reading, whatever the world size.
"""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

__all__ = ["ALPHA", "SHOWN_NODES", "Change", "StragglerWatch", "attempt_stragglers", "change_line", "exclusion_reason", "others_median",
           "others_medians", "rank_scalars", "straggler_line",
           "summary_line"]

ALPHA = 0.1
"""The EWMA's weight of one step (a time constant of ~10 steps): what status and TensorBoard show."""


def others_median(ordered: Sequence[float], value: float) -> float:
    """The median of `ordered` (sorted) with one occurrence of `value` left out (O(1) after the sort)."""
    n = len(ordered) - 1
    if n <= 0:
        return 0.0
    gone = bisect.bisect_left(ordered, value)

    def at(i: int) -> float:  # the i-th of the list without `gone`
        return ordered[i if i < gone else i + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


@dataclass(frozen=True)
class Change:
    """A rank named a straggler (`named`), or cleared."""

    rank: int
    node: str
    factor: float
    """Named: its window's median factor (compute over the median of the other ranks'); cleared: the same, now."""
    since: int
    """Named: the first step of the window that named it; cleared: the first step of the window that cleared it."""
    step: int
    """The step of the reading that decided it."""
    compute_s: float
    """Its compute EWMA (seconds a step)."""
    typical_s: float
    """The median of the other ranks' compute EWMAs."""
    named: bool

    def fields(self) -> dict[str, Any]:
        """The ledger event's fields (`straggler` or `straggler_cleared`)."""
        return {"rank": self.rank, "node": self.node, "factor": round(self.factor, 3), "since_step": self.since,
                "step": self.step, "compute_s": round(self.compute_s, 6), "typical_s": round(self.typical_s, 6)}


def exclusion_reason(rank: Any, factor: Any) -> str:
    """Why a straggler's node is excluded (`node_excluded`'s reason)."""
    return f"straggler: rank {rank} {factor}x slower than the other ranks"


def change_line(change: Change) -> str:
    """The one line a straggler (or its clearing) is said in."""
    if change.named:
        return (f"straggler: rank {change.rank} on {change.node} is {change.factor:.2f}x slower than the other ranks "
                f"(compute {change.compute_s:.3g} s a step against their {change.typical_s:.3g} s) since step "
                f"{change.since}")
    return (f"straggler cleared: rank {change.rank} on {change.node} is back to {change.factor:.2f}x the other ranks "
            f"since step {change.since}")


SHOWN_NODES = 8
"""The nodes of this many slowest ranks are in the summary (each rank's node is read from its record once)."""


@dataclass(frozen=True)
class _Reading:
    when: float
    first: int
    steps: int
    over: Any  # per rank (a numpy array): its factor at or over the margin
    compute: Any  # per rank: its compute
    typical: Any  # per rank: the median of the other ranks' compute


def others_medians(values: Any) -> Any:
    """Per element of `values` (a numpy array), the median of the others (`others_median`, all at once)."""
    import numpy as np

    n = len(values) - 1
    if n <= 0:
        return np.zeros(len(values))
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    gone = np.empty(len(values), dtype=np.int64)
    gone[order] = np.arange(len(values))  # each element's own place in the order (searchsorted: 7x slower)

    def at(i: int) -> Any:  # the i-th of each list without its own element
        return ordered[np.where(i < gone, i, i + 1)]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def _ratios(own: Any, typical: Any) -> Any:
    import numpy as np

    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(typical > 0, own / np.where(typical > 0, typical, 1.0), np.where(own > 0, np.inf, 1.0))


@dataclass
class StragglerWatch:
    """Every rank's compute and wait, and who is a straggler, from one reading after another (`update`). Its
    arrays are numpy's (imported at the first reading): a reading of 4,096 ranks costs rank 0 well under a
    millisecond (bench/rank_timing.py)."""

    world: int
    margin: float
    hold_steps: int
    hold_s: float = 0.0
    node_of: Callable[[int], str] = str
    """The node a rank runs on (rank 0 reads the ranks' records; its answer is kept)."""
    alpha: float = ALPHA
    compute: Any = None
    """Per rank, the EWMA of its compute (seconds a step; None before a reading)."""
    wait: Any = None
    named: set[int] = field(default_factory=set)
    last_step: int = 0
    _window: collections.deque[_Reading] = field(default_factory=collections.deque)
    _steps: int = 0  # the window's steps
    _over: Any = None  # per rank: the window's steps with its factor over the margin
    _own: Any = None  # per rank: its compute over the window (seconds)
    _typical: Any = None  # per rank: the other ranks' median compute over the window
    _nodes: dict[int, str] = field(default_factory=dict)

    def node(self, rank: int) -> str:
        if rank not in self._nodes:
            self._nodes[rank] = self.node_of(rank)
        return self._nodes[rank]

    def update(self, step: int, steps: int, compute: Sequence[float], wait: Sequence[float],
               now: float = 0.0) -> list[Change]:
        """One reading at `now` (seconds, any monotonic clock): `steps` steps ending at `step`, every rank's median
        compute and wait. The changes it makes."""
        import numpy as np

        if self.world < 2 or steps < 1 or len(compute) != self.world or len(wait) != self.world:
            return []
        self.last_step = step
        now_compute, now_wait = np.asarray(compute, dtype=np.float64), np.asarray(wait, dtype=np.float64)
        if self.compute is None:
            self.compute, self.wait = now_compute.copy(), now_wait.copy()
            self._over, self._own, self._typical = (np.zeros(self.world) for _ in range(3))
        else:
            weight = 1.0 - (1.0 - self.alpha) ** steps
            self.compute += weight * (now_compute - self.compute)
            self.wait += weight * (now_wait - self.wait)
        typical = others_medians(now_compute)
        self._add(_Reading(now, max(1, step - steps + 1), steps, _ratios(now_compute, typical) >= self.margin,
                           now_compute, typical))
        if not self._full(now):
            return []
        # Most of the window's steps over the margin (its median factor: a burst does not name a rank), and its
        # compute over the window at least halfway there (ranks slower by turns, half the time each, are not).
        over = (2 * self._over > self._steps) & (self._own >= (1 + self.margin) / 2 * self._typical)
        changes = []
        for rank in np.flatnonzero(over != np.isin(np.arange(self.world), list(self.named))).tolist():
            named = bool(over[rank])
            (self.named.add if named else self.named.discard)(rank)
            changes.append(Change(rank, self.node(rank), self.window_factor(rank), self._window[0].first, step,
                                  float(self.compute[rank]), self.typical(rank), named))
        return changes

    def _add(self, reading: _Reading) -> None:
        self._count(reading, +1)
        # Drop the oldest while the rest still covers the hold (in seconds and in steps).
        while len(self._window) > 1 and reading.when - self._window[1].when >= self.hold_s \
                and self._steps - self._window[0].steps >= self.hold_steps:
            self._count(self._window[0], -1)

    def _count(self, reading: _Reading, sign: int) -> None:
        """`reading` into the window's sums (sign 1), or out of them (-1)."""
        if sign > 0:
            self._window.append(reading)
        else:
            self._window.popleft()
        steps = sign * reading.steps
        self._steps += steps
        self._over += steps * reading.over
        self._own += steps * reading.compute
        self._typical += steps * reading.typical

    def _full(self, now: float) -> bool:
        """The window covers the hold: `hold_s` seconds (from its first reading) and `hold_steps` steps."""
        return now - self._window[0].when >= self.hold_s and self._steps >= self.hold_steps

    def window_factor(self, rank: int) -> float:
        """The step-weighted median of `rank`'s factors over the window."""
        values = sorted((float(_ratios(r.compute[rank], r.typical[rank])), r.steps) for r in self._window)
        half, seen = sum(steps for _, steps in values) / 2, 0
        for value, steps in values:
            seen += steps
            if seen >= half:
                return value
        return 1.0

    def typical(self, rank: int) -> float:
        """The median of the other ranks' compute EWMAs."""
        return float(others_medians(self.compute)[rank])

    def factor(self, rank: int) -> float:
        """`rank`'s compute EWMA over the median of the other ranks'."""
        return float(_ratios(self.compute, others_medians(self.compute))[rank])

    @property
    def stragglers(self) -> list[int]:
        return sorted(self.named)

    def summary(self) -> dict[str, Any] | None:
        """What the ledger's `progress` event, TensorBoard and status show: the EWMAs' min, median and max compute
        and wait per step, the slowest rank (its node, its factor), the factor of the slowest rank of each node
        among the SHOWN_NODES slowest ranks', the stragglers named. None before a reading."""
        import numpy as np

        if self.compute is None:
            return None
        factors = _ratios(self.compute, others_medians(self.compute))
        slowest = np.argsort(-self.compute, kind="stable")[:SHOWN_NODES].tolist()
        nodes: dict[str, float] = {}
        for rank in slowest:
            nodes.setdefault(self.node(rank), round(float(factors[rank]), 3))
        spread = lambda values: [round(float(np.min(values)), 6), round(float(np.median(values)), 6),  # noqa: E731
                                 round(float(np.max(values)), 6)]
        return {"step": self.last_step, "compute_s": spread(self.compute), "wait_s": spread(self.wait),
                "slowest": {"rank": slowest[0], "node": self.node(slowest[0]), "factor": round(float(factors[slowest[0]]), 3)},
                "nodes": dict(sorted(nodes.items())), "stragglers": self.stragglers}


def summary_line(summary: Mapping[str, Any]) -> str | None:
    """`compute 0.201/0.203/0.262 s, wait 0/0.059/0.061 s a step (min/median/max over ranks); slowest rank 1 on
    n2, 1.30x the others` from a `summary()` as the ledger holds it (None when it is not one)."""
    try:
        compute, wait, slowest = summary["compute_s"], summary["wait_s"], summary["slowest"]
        numbers = "/".join(f"{v:.3g}" for v in compute), "/".join(f"{v:.3g}" for v in wait)
        return (f"compute {numbers[0]} s, wait {numbers[1]} s a step (min/median/max over ranks); slowest rank "
                f"{slowest['rank']} on {slowest['node']}, {float(slowest['factor']):.2f}x the others")
    except (KeyError, TypeError, ValueError):
        return None


def rank_scalars(summary: Mapping[str, Any]) -> dict[str, float]:
    """A `summary()` as TensorBoard scalars (under `ranks/`): compute and wait min/median/max, the slowest rank,
    its factor, the number of stragglers named."""
    scalars = {f"{what}_{which}_s": float(summary[f"{what}_s"][i]) for what in ("compute", "wait")
               for i, which in enumerate(("min", "median", "max"))}
    scalars["slowest_rank"] = float(summary["slowest"]["rank"])
    scalars["slowest_factor"] = float(summary["slowest"]["factor"])
    scalars["stragglers"] = float(len(summary["stragglers"]))
    return scalars


def attempt_stragglers(attempt: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Each rank's newest `straggler` or `straggler_cleared` event among an attempt's events, by rank."""
    newest: dict[Any, Mapping[str, Any]] = {}
    for event in attempt:
        if event.get("event") in ("straggler", "straggler_cleared"):
            newest[event.get("rank")] = event
    return sorted(newest.values(), key=lambda e: str(e.get("rank")))


def straggler_line(event: Mapping[str, Any]) -> str:
    """A `straggler` (or `straggler_cleared`) ledger event as status shows it."""
    try:
        factor = f"{float(event['factor']):.2f}x"
    except (KeyError, TypeError, ValueError):
        factor = "?"
    who = f"rank {event.get('rank')} on {event.get('node', '?')}"
    if event.get("event") == "straggler_cleared":
        return f"{who}: cleared at step {event.get('step')} ({factor} the other ranks since step {event.get('since_step')})"
    typical, own = event.get("typical_s"), event.get("compute_s")
    times = (f" (compute {own:.3g} s a step against {typical:.3g} s)" if isinstance(own, (int, float))
             and isinstance(typical, (int, float)) else "")
    return f"{who}: {factor} slower than the other ranks since step {event.get('since_step')}{times}"
