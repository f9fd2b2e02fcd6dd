"""Stop requests: signal handlers that only set a flag, and the ranks' agreement on when to stop.

A requeue signal (USR2 by default; never USR1, which NCCL uses) or SIGTERM may reach one rank, all
of them, or arrive at different steps on different ranks. The handlers only record it. At step
boundaries that every rank picks alike, `StopAgreement` all-reduces (MAX) the few flags, so all ranks
see the same answer at the same step, stop together and write one checkpoint. What happens next
(requeue or not) is decided outside the loop, from Slurm's own view of the job (`mgpu.cluster.requeue`).
"""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from mgpu.stop.rank_timing import RankTimer, RankTimes

# torch is imported only by StopAgreement: StopRequest must be installable before the seconds it takes
# to import torch, or a signal arriving in them would kill the process (or reach submitit's handler).

__all__ = ["REASONS", "StopAgreement", "StopRequest", "install_stop_request", "signal_number",
           "uninstall_stop_request"]

# Index in the agreement vector -> reason. "test" is the `stop_at_step` hook (a deterministic preemption);
# "interrupt" is Ctrl-C (SIGINT): a stop like SIGTERM, and a second Ctrl-C interrupts at once; "deadline":
# rank 0 saw the job's time limit too close for one more interval of steps (mgpu.cluster.deadline); "drain": one of the
# job's nodes is draining, in maintenance or to be rebooted (mgpu.cluster.deadline's poll).
REASONS = ("requeue_signal", "sigterm", "test", "interrupt", "deadline", "drain")
AGREE_EVERY_S = 1.0
"""How often the ranks agree on a stop when `preemption.check_every_steps` is null."""


def signal_number(name: str) -> int:
    """`"USR2"` or `"SIGUSR2"` -> its number."""
    name = name.upper()
    return int(getattr(signal, name if name.startswith("SIG") else f"SIG{name}"))


@dataclass
class StopRequest:
    """Collects stop signals on this rank; `StopAgreement` turns them into one decision for all ranks."""

    requeue_signal: str = "USR2"
    received: list[tuple[str, float]] = field(default_factory=list)
    """(signal name, unix time) in arrival order, on this rank."""
    _flags: list[int] = field(default_factory=lambda: [0] * len(REASONS))
    _previous: dict[int, Any] = field(default_factory=dict)

    def install(self) -> "StopRequest":
        """Take over the requeue signal, SIGTERM and SIGINT (replacing e.g. submitit's handlers until
        `uninstall`)."""
        signals = {signal_number(self.requeue_signal): 0, signal.SIGTERM: 1, signal.SIGINT: REASONS.index("interrupt")}
        for signum, index in signals.items():
            self._previous[signum] = signal.signal(signum, self._handler(index))
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handler(self, index: int) -> Callable[[int, FrameType | None], None]:
        def handle(signum: int, frame: FrameType | None) -> None:
            # A flag and a timestamp, nothing else: the step boundary does the work.
            self._flags[index] = 1
            self.received.append((signal.Signals(signum).name, time.time()))
            if signum == signal.SIGINT:
                signal.signal(signal.SIGINT, signal.default_int_handler)  # the next Ctrl-C: KeyboardInterrupt

        return handle

    def request(self, reason: str) -> None:
        """Ask for a stop from code (the `stop_at_step` test hook)."""
        self._flags[REASONS.index(reason)] = 1

    @property
    def pending(self) -> bool:
        return any(self._flags)

    def flags(self) -> list[int]:
        return list(self._flags)

    def __enter__(self) -> "StopRequest":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


_installed: StopRequest | None = None


def install_stop_request(requeue_signal: str = "USR2") -> tuple[StopRequest, bool]:
    """The one installer of the stop signals in this process: (its StopRequest, whether this call installed
    it). Called first by whoever starts first (a job before importing torch, else the session); a later call
    gets the same request, so a signal between the two is not lost. Whoever installed it uninstalls it with
    `uninstall_stop_request()`."""
    global _installed
    if _installed is not None:
        return _installed, False
    _installed = StopRequest(requeue_signal).install()
    return _installed, True


def uninstall_stop_request() -> None:
    """Give the stop signals back to their previous handlers (the installer's call, at its end)."""
    global _installed
    if _installed is not None:
        _installed.uninstall()
        _installed = None


def _decode_list(flags: list[int]) -> set[str]:
    return {reason for reason, flag in zip(REASONS, flags) if flag}


class StopAgreement:
    """The ranks' agreement on `StopRequest` flags, pipelined so that no step waits for it.

    `at_step(step, every)` starts an asynchronous MAX all-reduce of the flags at each step that is a
    multiple of `every` and reads it one step later, when it has long finished: every rank stops at
    the same step, at most `every + 1` steps after a flag was raised, for one small reduction per
    `every` steps. With `every == 1` each step reads the previous step's reduction and starts the next.
    When `every` changes, a reduction in flight is still read at the step after it started.
    `every=None` agrees about once a second: each reduction also carries the slowest rank's mean step
    time since the last one, and every rank derives the same next interval from it at the same step (a
    power of two: a jitter in the step time rarely changes it, and old multiples stay multiples).
    `poll()` is the same pipelined agreement between steps (every evaluation batch); `now()` agrees at
    once (blocking). The reduction runs on a gloo side group with CPU tensors: with NCCL it never
    synchronises the GPU stream. A world of one needs no collective and answers at once.
    With a `timer` (mgpu.stop.rank_timing.RankTimer) each reduction also carries every rank's median compute
    and wait since the last one, in slots of the same vector: `rank_times` is the newest read (every rank's).
    """

    def __init__(self, stop: StopRequest, seconds_between: float = AGREE_EVERY_S, timer: RankTimer | None = None
                 ) -> None:
        import torch.distributed as dist

        self.stop = stop
        self.seconds_between = seconds_between
        self.auto_every = 1
        """The interval `every=None` uses: 1 until the first reduction is read, then about a second of steps."""
        self.timer = timer
        self.rank_times: RankTimes | None = None
        """Every rank's compute and wait of the newest interval read (with a `timer`; None before one is read)."""
        self.readings = 0
        """How many intervals with steps were read into `rank_times`."""
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self._world = dist.get_world_size() if distributed else 1
        self._rank = dist.get_rank() if distributed else 0
        # Every rank constructs this at the same point: new_group is itself a collective.
        self.group = dist.new_group(backend="gloo") if distributed else None
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._pending_step = -1
        self._read_step = -1  # the step at which the reduction being read started
        self._last_call: float | None = None
        self._busy = 0.0  # seconds between this rank's calls since the last reduction started
        self._calls = 0

    def at_step(self, step: int, every: int | None = None) -> set[str]:
        """The agreed stop reasons at this step boundary (empty: go on). Call it at every step with the
        same `every` on all ranks; a step where it has nothing to do costs two integer checks."""
        self._tick()
        if self.group is None:
            return _decode_list(self.stop.flags())  # nobody to agree with: free at every step
        agreed: set[str] = set()
        # A reduction started at an earlier step is read at the first step after it, whatever `every` has
        # become since: a stop comes at most `every + 1` steps after the flag even when the interval grows.
        if self._pending is not None and self._pending_step < step:
            agreed = self._collect()
        if not agreed and step % (self.auto_every if every is None else every) == 0:
            self._start(step)
        return agreed

    def poll(self) -> set[str]:
        """`at_step` between steps: reads the reduction in flight (whenever it started) and starts the
        next. Every rank must call it at the same points (e.g. each evaluation batch all ranks have)."""
        if self.group is None:
            return _decode_list(self.stop.flags())
        agreed = self._collect()
        if not agreed:
            self._start(-1)  # the next at_step() or poll() reads it, whatever its step
        return agreed

    def now(self) -> set[str]:
        """A blocking agreement, for points between steps that every rank reaches alike: a reduction in
        flight is read first, so the side group's order stays the same."""
        if self.group is None:
            return _decode_list(self.stop.flags())
        agreed = self._collect()
        if agreed:
            return agreed
        self._start(-1)
        return self._collect()

    def _tick(self) -> None:
        if self.timer is not None:
            self.timer.step()
        now = time.perf_counter()
        if self._last_call is not None:
            self._busy += now - self._last_call
            self._calls += 1
        self._last_call = now

    def _start(self, step: int) -> None:
        import torch
        import torch.distributed as dist

        if self._pending is None:
            step_time = self._busy / self._calls if self._calls else 0.0
            self._busy, self._calls = 0.0, 0
            timing: list[float] = []
            if self.timer is not None:
                from mgpu.stop.rank_timing import encode

                timing = encode(self._world, self._rank, *self.timer.interval())
            vector = torch.tensor([*self.stop.flags(), step_time, *timing], dtype=torch.float64)
            self._pending = (dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=self.group, async_op=True), vector)
            self._pending_step = step

    def _collect(self) -> set[str]:
        if self._pending is None:
            return set()
        work, vector = self._pending
        self._pending = None
        self._read_step = self._pending_step
        began = time.perf_counter()
        work.wait()
        if self.timer is not None:  # a reduction not done by now waited for a late rank: wait, not compute
            self.timer.add_wait(time.perf_counter() - began)
        values = vector.tolist()
        flags, step_time = values[:len(REASONS)], values[len(REASONS)]
        if step_time > 0:  # the slowest rank's step time: the same number, at the same step, everywhere
            self.auto_every = 1 << int(math.log2(max(1.0, self.seconds_between / step_time)))
        if self.timer is not None:
            from mgpu.stop.rank_timing import decode

            times = decode(values[len(REASONS) + 1:], self._world, self._read_step)
            if times is not None:
                self.rank_times, self.readings = times, self.readings + 1
        return _decode_list([int(v) for v in flags])

    def drain(self) -> None:
        """Wait for the reduction in flight (before the group is destroyed). Its answer is not needed any more: a
        wait that fails (a peer gone, gloo's `Connection closed by peer` after a killed node) is said in one line and
        left there: re-raised from the session's cleanup, it was a second traceback over the failure that the
        rank's own error, or another rank's, already records."""
        if self._pending is None:
            return
        work, self._pending = self._pending[0], None
        try:
            work.wait()
        except Exception as error:  # noqa: BLE001  (the run is ending either way)
            logging.getLogger("mgpu.train").info("the last stop agreement did not complete (%s: %s)",
                                                 type(error).__name__, " ".join(str(error).split())[:200])
