"""Each rank's compute and wait per step, summarised once per stop agreement and carried in its all-reduce.

A rank's step (from one step boundary, the stop agreement's `at_step`, to the next) is its *wait* for the
others inside the step's synchronisations (mgpu.parallel.sync_wait: DDP's buffer broadcast and gradient
reduction) and its *compute*, the rest: its data, forward, backward and optimizer, whatever slows them. Time
that is not a training step is left out (`outside`: a checkpoint save, an evaluation, rank 0's log line and
ledger write), so that rank 0's bookkeeping and an evaluation do not read as a slow rank.

Each agreement carries, per rank, the median compute and wait of the steps since the previous one (a median:
one step with a page fault or a garbage collection does not move it) in slots of the vector the agreement
already all-reduces with MAX (each rank writes its own slots, zeros elsewhere: the maximum is every rank's
value): no extra collective, 16 bytes per rank about once a second. No torch.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

__all__ = ["KEEP_STEPS", "RankTimer", "RankTimes", "decode", "encode"]

KEEP_STEPS = 512
"""At most this many steps per interval are kept for its medians (the newest): ~1 s of steps of 2 ms."""


@dataclass(frozen=True)
class RankTimes:
    """What one agreement carried: the interval's steps and every rank's median compute and wait (seconds)."""

    step: int
    """The step at which the agreement started (-1: between steps, an evaluation's)."""
    steps: int
    """Steps in the interval (the same on every rank: the agreements start at the same step)."""
    compute: tuple[float, ...]
    wait: tuple[float, ...]


class RankTimer:
    """This rank's steps, as compute and wait. `waited()` answers the seconds this rank waited in synchronisations
    since it was last asked (mgpu.parallel.sync_wait.SyncWait.take; 0 where nothing measures them)."""

    def __init__(self, waited: Callable[[], float] = lambda: 0.0, clock: Callable[[], float] = time.perf_counter
                 ) -> None:
        self.waited = waited
        self._clock = clock
        self._last: float | None = None
        self._outside = 0.0  # seconds of this step spent outside training (a save, an evaluation, a log line)
        self._blocked = 0.0  # seconds of this step blocked on the stop agreement's own reduction (`add_wait`)
        self._compute: list[float] = []
        self._wait: list[float] = []

    def step(self) -> None:
        """A step boundary: the step since the previous one is recorded (the first boundary only starts the clock)."""
        now = self._clock()
        waited = self.waited() + self._blocked
        if self._last is not None:
            wall = max(0.0, now - self._last - self._outside)
            wait = min(waited, wall)
            self._compute.append(wall - wait)
            self._wait.append(wait)
            if len(self._compute) > KEEP_STEPS:
                del self._compute[0], self._wait[0]
        self._last, self._outside, self._blocked = now, 0.0, 0.0

    def add_wait(self, seconds: float) -> None:
        """This step waited `seconds` for the others elsewhere (the stop agreement's reduction, when it was not
        done by the step that reads it)."""
        self._blocked += seconds

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Time that is not part of a training step (its waits too): left out of the step it falls in."""
        began = self._clock()
        self.waited()  # what was waited so far belongs to the step
        try:
            yield
        finally:
            self.waited()  # what was waited inside does not
            self._outside += self._clock() - began

    def interval(self) -> tuple[int, float, float]:
        """(steps, median compute, median wait) since the last call; (0, 0, 0) when no step ended in it."""
        steps = len(self._compute)
        if not steps:
            return 0, 0.0, 0.0
        compute, wait = statistics.median(self._compute), statistics.median(self._wait)
        self._compute, self._wait = [], []
        return steps, compute, wait


def encode(world: int, rank: int, steps: int, compute: float, wait: float) -> list[float]:
    """This rank's part of the agreement's vector: [steps, compute per rank..., wait per rank...], its own slots
    filled, zeros elsewhere (MAX-reduced: every rank's values)."""
    slots = [0.0] * (1 + 2 * world)
    slots[0] = float(steps)
    slots[1 + rank] = compute
    slots[1 + world + rank] = wait
    return slots


def decode(values: Sequence[float], world: int, step: int) -> RankTimes | None:
    """The reduced slots (`encode`'s layout) as RankTimes; None when the interval had no step."""
    steps = int(values[0])
    if steps <= 0:
        return None
    return RankTimes(step, steps, tuple(values[1:1 + world]), tuple(values[1 + world:1 + 2 * world]))
