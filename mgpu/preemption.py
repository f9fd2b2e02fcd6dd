"""Stop requests: signal handlers that only set a flag, and the ranks' agreement on when to stop.

A requeue signal (USR2 by default; never USR1, which NCCL uses) or SIGTERM may reach one rank, all
of them, or arrive at different steps on different ranks. The handlers only record it. At a step
boundary every rank calls `StopRequest.agree()`, one all-reduce (MAX) of a few flags, so all ranks
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

# Index in the agreement vector -> reason. "test" is the `stop_at_step` hook (a deterministic preemption).
REASONS = ("requeue_signal", "sigterm", "test")


def signal_number(name: str) -> int:
    """`"USR2"` or `"SIGUSR2"` -> its number."""
    name = name.upper()
    return int(getattr(signal, name if name.startswith("SIG") else f"SIG{name}"))


@dataclass
class StopRequest:
    """Collects stop signals on this rank; `agree()` turns them into one decision for all ranks."""

    requeue_signal: str = "USR2"
    received: list[tuple[str, float]] = field(default_factory=list)
    """(signal name, unix time) in arrival order, on this rank."""
    _flags: list[int] = field(default_factory=lambda: [0] * len(REASONS))
    _previous: dict[int, Any] = field(default_factory=dict)

    def install(self) -> "StopRequest":
        """Take over the requeue signal and SIGTERM (replacing e.g. submitit's handlers until `uninstall`)."""
        for index, signum in enumerate((signal_number(self.requeue_signal), signal.SIGTERM)):
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


def _decode(flags: "torch.Tensor") -> set[str]:
    return {reason for reason, flag in zip(REASONS, flags.tolist()) if flag}


class StopAgreement:
    """The ranks' agreement on `StopRequest` flags, pipelined so that no step waits for it.

    Each `poll()` returns what every rank had flagged at the previous poll (the reduction has long
    finished by then) and starts the next one, so all ranks stop at the same step, one step after the
    flag was shared. The reduction runs on a gloo side group with CPU tensors: with NCCL it never
    synchronises the GPU stream. A world of one needs no collective and answers at once.
    """

    def __init__(self, stop: StopRequest) -> None:
        import torch.distributed as dist

        self.stop = stop
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        # Every rank constructs this at the same point: new_group is itself a collective.
        self.group = dist.new_group(backend="gloo") if distributed else None
        self._pending: tuple[Any, torch.Tensor] | None = None

    def poll(self) -> set[str]:
        import torch
        import torch.distributed as dist

        flags = torch.tensor(self.stop.flags(), dtype=torch.int32)
        if self.group is None:
            return _decode(flags)
        agreed: set[str] = set()
        if self._pending is not None:
            work, previous = self._pending
            work.wait()
            agreed = _decode(previous)
            self._pending = None
        if agreed:
            return agreed
        self._pending = (dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flags)
        return set()

    def drain(self) -> None:
        """Wait for the reduction in flight (before the group is destroyed)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
