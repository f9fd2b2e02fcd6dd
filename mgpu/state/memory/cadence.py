"""When a snapshot in memory is due (checkpoint.memory_every_steps): every k steps as configured, or, by default, as
often as its cost allows: the time a snapshot holds the loop (its copy into the node's memory) at most a budget of the
steps' time. Pure: the steps' times and the snapshots' costs are given (mgpu.state.memory.snapshots measures them).

Under FSDP2 (each rank's shard is its own) the periodic snapshots are what bounds the steps a lost rank costs: at most
k, at BUDGET. Under DDP a survivor's save (mgpu.state.memory.step_mark) makes a lost rank cost at most its step
whatever the cadence; the periodic snapshots are only what a restart falls back to where no survivor could save (the
whole step's ranks lost at once, an optimizer already stepped, a rank whose per-rank state is not derivable), at
FALLBACK_BUDGET: the rarer the failures a snapshot is needed for, the smaller the share of time worth spending on them
(Young and Daly: with copies of C seconds, a share b of the time plus half the time between snapshots lost per failure,
M seconds apart, is b + C / (2 b M), least at b = sqrt(C / (2 M)); M counts here only the failures no survivor saves).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Callable

__all__ = ["BUDGET", "FALLBACK_BUDGET", "FIRST_STEP", "Cadence", "steps_between"]

BUDGET = 0.005
"""A snapshot's copy every k steps costs at most this share of those k steps' time (0.5 %) where the snapshots are
what bounds a lost rank's cost (FSDP2, one rank)."""
FALLBACK_BUDGET = 0.003
"""The same where survivors' saves bound it and the snapshots are their fallback (DDP): 0.3 %, so that with every
step's marks and rank 0's buffer record the defaults' own work stays within 1 % of the steps' time
(bench/failure_overhead.py)."""
FIRST_STEP = 5
"""The default's first snapshot, at this step: its cost measured against the steps' time so far."""
MAX_EVERY = 10_000


def steps_between(snapshot_s: float, step_s: float, budget: float = BUDGET) -> int:
    """The fewest steps between snapshots that keeps a snapshot's `snapshot_s` within `budget` of the steps' time."""
    if step_s <= 0 or not math.isfinite(snapshot_s) or not math.isfinite(step_s):
        return MAX_EVERY
    return max(1, min(MAX_EVERY, math.ceil(snapshot_s / (budget * step_s))))


class Cadence:
    """`every` steps (0: never), or with `every` None the default: the first at FIRST_STEP, then `steps_between` the
    last snapshot's cost and the median step within `budget` (re-derived after each). `due(step)` once per step,
    `taken(step, s)` after each snapshot."""

    def __init__(self, every: int | None, clock: Callable[[], float] = time.perf_counter,
                 budget: float = BUDGET) -> None:
        self.every, self.clock, self.budget = every, clock, budget
        self.current = every if every is not None else None
        """The steps between snapshots now (None: not yet derived)."""
        self._last: int | None = None
        self._last_due = 0
        self._seen: float | None = None
        self._steps: deque[float] = deque(maxlen=50)

    @property
    def on(self) -> bool:
        return self.every != 0

    def due(self, step: int) -> bool:
        now = self.clock()
        if self._seen is not None:
            self._steps.append(now - self._seen)
        self._seen = now
        self._last_due = step
        if self.every is not None:
            return self.every > 0 and step > 0 and step % self.every == 0
        if self.current is None:
            return step >= FIRST_STEP
        return self._last is None or step - self._last >= self.current

    def needs(self, seconds: float | None) -> int:
        """The steps between snapshots this rank needs, its first having taken `seconds` (None: it took none)."""
        if seconds is None:
            return MAX_EVERY
        return steps_between(seconds, statistics.median(self._steps) if self._steps else 0.0, self.budget)

    def agree(self, every: int) -> None:
        """The steps between snapshots from here on (the most any rank needs: every rank's `needs` reduced), the
        first of them taken now."""
        self.current, self._last = every, self._last_due

    def taken(self, step: int) -> None:
        """A snapshot of `step` was taken (at the cadence in force)."""
        self._last = step
