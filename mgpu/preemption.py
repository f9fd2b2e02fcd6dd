"""Stop requests: signal handlers that only set a flag, and the ranks' agreement on when to stop.

A requeue signal (USR2 by default; never USR1, which NCCL uses) or SIGTERM may reach one rank, all
of them, or arrive at different steps on different ranks. The handlers only record it. At step
boundaries that every rank picks alike, `StopAgreement` all-reduces (MAX) the few flags, so all ranks
see the same answer at the same step, stop together and write one checkpoint. What happens next
(requeue or not) is decided outside the loop, from Slurm's own view of the job (`mgpu.requeue`).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

# torch is imported only by StopAgreement: StopRequest must be installable before the seconds it takes
# to import torch, or a signal arriving in them would kill the process (or reach submitit's handler).

__all__ = ["REASONS", "StopAgreement", "StopRequest", "signal_number"]

# Index in the agreement vector -> reason. "test" is the `stop_at_step` hook (a deterministic preemption);
# "interrupt" is Ctrl-C (SIGINT): a stop like SIGTERM, and a second Ctrl-C interrupts at once.
REASONS = ("requeue_signal", "sigterm", "test", "interrupt")


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


def _decode_list(flags: list[int]) -> set[str]:
    return {reason for reason, flag in zip(REASONS, flags) if flag}


class StopAgreement:
    """The ranks' agreement on `StopRequest` flags, pipelined so that no step waits for it.

    `at_step(step, every)` starts an asynchronous MAX all-reduce of the flags at each step that is a
    multiple of `every` and reads it one step later, when it has long finished: every rank stops at
    the same step, at most `every + 1` steps after a flag was raised, for one small reduction per
    `every` steps. With `every == 1` each step reads the previous step's reduction and starts the next.
    When `every` changes, a reduction in flight is still read at the step after it started.
    `now()` agrees at once (blocking), for long stretches between steps such as an evaluation.
    The reduction runs on a gloo side group with CPU tensors: with NCCL it never synchronises the GPU
    stream. A world of one needs no collective and answers at once.
    """

    def __init__(self, stop: StopRequest) -> None:
        import torch.distributed as dist

        self.stop = stop
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        # Every rank constructs this at the same point: new_group is itself a collective.
        self.group = dist.new_group(backend="gloo") if distributed else None
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._pending_step = -1

    def at_step(self, step: int, every: int) -> set[str]:
        """The agreed stop reasons at this step boundary (empty: go on). Call it at every step with the
        same `every` on all ranks; a step where it has nothing to do costs two integer checks."""
        if self.group is None:
            return _decode_list(self.stop.flags())  # nobody to agree with: free at every step
        agreed: set[str] = set()
        # A reduction started at an earlier step is read at the first step after it, whatever `every` has
        # become since: a stop comes at most `every + 1` steps after the flag even when the interval grows.
        if self._pending is not None and self._pending_step < step:
            agreed = self._collect()
        if not agreed and step % every == 0:
            self._start(step)
        return agreed

    def now(self) -> set[str]:
        """A blocking agreement, for points between steps that every rank reaches alike (e.g. every k-th
        evaluation batch): a reduction in flight is read first, so the side group's order stays the same."""
        if self.group is None:
            return _decode_list(self.stop.flags())
        import torch
        import torch.distributed as dist

        agreed = self._collect()
        if agreed:
            return agreed
        flags = torch.tensor(self.stop.flags(), dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return _decode_list(flags.tolist())

    def _start(self, step: int) -> None:
        import torch
        import torch.distributed as dist

        if self._pending is None:
            flags = torch.tensor(self.stop.flags(), dtype=torch.int32)
            self._pending = (dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flags)
            self._pending_step = step

    def _collect(self) -> set[str]:
        if self._pending is None:
            return set()
        work, flags = self._pending
        self._pending = None
        work.wait()
        return _decode_list(flags.tolist())

    def drain(self) -> None:
        """Wait for the reduction in flight (before the group is destroyed)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
