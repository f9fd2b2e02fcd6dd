"""When the ranks stop: one object that turns stop requests into one decision per step, for every rank alike.

`StopController` puts together what decides a stop, each part given to it (so that it runs in one process
against fakes in tests): the stop request (signal flags, `mgpu.stop.preemption.StopRequest`), the agreement
across ranks (`mgpu.stop.preemption.StopAgreement`), the job's clock (`mgpu.cluster.deadline.JobClock`, rank 0 under
Slurm: a stop before the time limit) and the test stop (`stop_at_step`: a deterministic preemption, the
same step on every rank; `MGPU_STOP_AT_STEP`, which `jobs/train.py --stop-at-step K` sets, read here alone).
It knows nothing of checkpoints or of the process group; the session saves and
acts on what it answers. No torch.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

from mgpu.cluster.deadline import time_needed
from mgpu.errors import MgpuError

__all__ = ["STOP_AT_STEP", "StopController", "stop_at_step_from"]

STOP_AT_STEP = "MGPU_STOP_AT_STEP"
"""Testing: a stop as if preempted after this optimizer step, the same on every rank (`jobs/train.py
--stop-at-step K` sets it; a loop of one's own under test sets it before its Session)."""

log = logging.getLogger("mgpu.train")


def stop_at_step_from(environ: Mapping[str, str]) -> int | None:
    """The test stop's step from `environ` (MGPU_STOP_AT_STEP): None when it is unset or empty."""
    text = environ.get(STOP_AT_STEP, "").strip()
    if not text:
        return None
    try:
        step = int(text)
    except ValueError:
        step = 0
    if step < 1:
        raise MgpuError(f"{STOP_AT_STEP}={text!r}: must be a step number >= 1 (the step after which a test stops "
                        f"as if preempted); unset it to train without one")
    return step


class Flags(Protocol):
    @property
    def pending(self) -> bool: ...

    def request(self, reason: str) -> None: ...


class Agreement(Protocol):
    auto_every: int

    def at_step(self, step: int, every: int | None = None) -> set[str]: ...

    def poll(self) -> set[str]: ...


class Clock(Protocol):
    end: float | None
    draining: dict[str, str]

    @property
    def limit_s(self) -> float | None: ...

    def too_close(self, now: float, needed_s: float) -> bool: ...

    def too_short(self, needed_s: float) -> bool: ...


class StopController:
    """This rank's answer to "stop now?" at each step boundary: the same on every rank at the same step.

    `check_every`: steps between agreements (None: about once a second, see StopAgreement); `margin_s`: the
    deadline stop's margin (preemption.deadline_margin_s); `longest_write_s()`: the longest checkpoint write so
    far; `monotonic`/`now`: the clocks (injected for tests); `stragglers`: a StragglerWatch
    (mgpu.record.stragglers) fed every rank's step times the agreement carried, its changes given to
    `on_straggler` (rank 0's; None: not watched)."""

    def __init__(self, flags: Flags, agreement: Agreement, *, clock: Clock | None = None,
                 check_every: int | None = None, stop_at_step: int | None = None, margin_s: float = 60.0,
                 longest_write_s: Callable[[], float] = lambda: 0.0,
                 monotonic: Callable[[], float] = time.monotonic, now: Callable[[], float] = time.time,
                 stragglers: Any = None, on_straggler: Callable[[Any], None] = lambda change: None) -> None:
        self.flags, self.agreement, self.clock = flags, agreement, clock
        self.stragglers, self.on_straggler = stragglers, on_straggler
        self._readings = 0  # the agreement's readings of the ranks' step times seen so far
        self._step = 0  # the newest step boundary
        self.check_every, self.stop_at_step, self.margin_s = check_every, stop_at_step, margin_s
        self.longest_write_s, self.monotonic, self.now = longest_write_s, monotonic, now
        self.reasons: set[str] = set()
        """The stop reasons the ranks agreed on (empty: go on)."""
        self.step_times: collections.deque[float] = collections.deque(maxlen=20)
        self._last_step_at: float | None = None
        self._said_too_short = False

    @classmethod
    def for_rank(cls, flags: Any, preemption: Any, cleanup: contextlib.ExitStack, *, slurm_job: str | None,
                 longest_write_s: Callable[[], float], environ: Mapping[str, str] = os.environ,
                 nodes: Sequence[str] = (), timer: Any = None, stragglers: Any = None,
                 on_straggler: Callable[[Any], None] = lambda change: None) -> "StopController":
        """*Collective* (the agreement's side group): the real parts for one rank of a run, their teardown in
        `cleanup`. `preemption`: the config's section; `slurm_job`: rank 0's own Slurm job (its clock), else None;
        `nodes`: the job's nodes, whose drains the clock watches;
        `environ`: where the test stop is read (MGPU_STOP_AT_STEP); `timer`: this rank's RankTimer, whose step
        times the agreement carries (mgpu.stop.rank_timing; None: not measured); `stragglers`, `on_straggler`: see
        the class."""
        from mgpu.stop.preemption import StopAgreement

        stop_at_step = stop_at_step_from(environ)  # before the agreement's group: a bad value fails at once
        agreement = StopAgreement(flags, timer=timer)
        cleanup.callback(agreement.drain)
        clock = None
        if slurm_job and preemption.deadline_margin_s > 0:
            from mgpu.cluster.deadline import JobClock

            clock = JobClock(slurm_job, poll_s=preemption.slurm_poll_s, nodes=nodes).start()
            cleanup.callback(clock.stop)
        return cls(flags, agreement, clock=clock, check_every=preemption.check_every_steps, stop_at_step=stop_at_step,
                   margin_s=preemption.deadline_margin_s, longest_write_s=longest_write_s, stragglers=stragglers,
                   on_straggler=on_straggler)

    @property
    def agreed(self) -> bool:
        """The ranks agreed to stop."""
        return bool(self.reasons)

    @property
    def requested(self) -> bool:
        """A stop is requested on this rank or agreed (a DataLoader worker that dies now is not a crash)."""
        return bool(self.reasons) or self.flags.pending

    def at_step(self, step: int) -> set[str]:
        """*Collective* (through the agreement): the reasons to stop after `step`, every rank alike."""
        moment = self.monotonic()
        self._step = step
        if self._last_step_at is not None:
            self.step_times.append(moment - self._last_step_at)
        self._last_step_at = moment
        self.check_deadline()
        if self.stop_at_step is not None and step == self.stop_at_step:
            reasons = {"test"}  # the same step on every rank: nothing to agree on
        else:
            reasons = self.agreement.at_step(step, self.check_every)
        self.reasons |= reasons
        self._watch_ranks()
        return reasons

    def poll(self) -> set[str]:
        """*Collective*, between steps (every evaluation batch all ranks have): the agreement, pipelined."""
        self.check_deadline()
        reasons = self.agreement.poll()
        self.reasons |= reasons
        self._watch_ranks()
        return reasons

    def _watch_ranks(self) -> None:
        """A new reading of the ranks' step times (the agreement's): to the straggler watch. Its interval ended at
        the step its reduction started at, or, started between steps (an evaluation's), at the last step."""
        readings = getattr(self.agreement, "readings", 0)
        if self.stragglers is None or readings == self._readings:
            return
        self._readings = readings
        times = self.agreement.rank_times  # type: ignore[attr-defined]  # an agreement with readings has them
        ended = times.step if times.step >= 0 else self._step
        for change in self.stragglers.update(ended, times.steps, times.compute, times.wait, self.monotonic()):
            self.on_straggler(change)

    def check_deadline(self) -> None:
        """Rank 0 under Slurm: request a stop when the job's end is closer than what a stop needs, or when one of
        its nodes is about to go (draining, maintenance, reboot: before Slurm's first signal)."""
        if self.clock is None or self.flags.pending:
            return
        if self.clock.draining:
            log.info("stopping: the job's node(s) %s are about to go (%s): saving and requeueing before Slurm's "
                     "signal", ", ".join(self.clock.draining), "; ".join(self.clock.draining.values()))
            self.flags.request("drain")
            return
        if not self.step_times:
            return
        every = self.agreement.auto_every if self.check_every is None else self.check_every
        longest = self.longest_write_s()
        needed = time_needed(max(self.step_times), every, longest, self.margin_s, self.clock.limit_s)
        if self.clock.too_short(needed):
            if not self._said_too_short:
                self._said_too_short = True
                log.warning("a stop needs %.0f s, more than half the job's time limit (%.0f s): no stop before "
                            "the limit, only on Slurm's signal (--signal); give the job a longer --time",
                            needed, self.clock.limit_s or 0)
            return
        now = self.now()
        if self.clock.too_close(now, needed):
            log.info("stopping before the job's time limit: %.0f s left, a stop needs %.0f s (steps of %.1f s, a "
                     "checkpoint write of %.1f s, preemption.deadline_margin_s %.0f)",
                     (self.clock.end or 0) - now, needed, max(self.step_times), longest, self.margin_s)
            self.flags.request("deadline")
