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
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["REASONS", "StopRequest", "signal_number"]

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
    """(signal name, monotonic time) in arrival order, on this rank."""
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
            self.received.append((signal.Signals(signum).name, time.monotonic()))

        return handle

    def request(self, reason: str) -> None:
        """Ask for a stop from code (the `stop_at_step` test hook)."""
        self._flags[REASONS.index(reason)] = 1

    @property
    def pending(self) -> bool:
        return any(self._flags)

    def agree(self, device: torch.device) -> set[str]:
        """The union of every rank's stop reasons; the same set on every rank (a collective)."""
        flags = torch.tensor(self._flags, dtype=torch.int32, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return {reason for reason, flag in zip(REASONS, flags.tolist()) if flag}

    def __enter__(self) -> "StopRequest":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
