"""Which rank a sharded save waits for: each rank marks its shard written in the rendezvous store, so a save
that times out waiting for a late rank names it (gloo's and NCCL's timeouts name no peer; a DCP load at 1,024
GPUs hung for 4 hours with ranks minutes apart, with no error at all).

How long the ranks wait is mgpu.state.save_budget's `peer_wait_s`: the save's own process group times out first,
with the late rank named, and the watchdog stays the backstop.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.distributed.checkpoint import FileSystemWriter

__all__ = ["Arrivals", "MarkingWriter", "late_line"]


class Arrivals:
    """One save's marks in a c10d store (`store`: set/check/delete_key), keyed by the save's temporary
    directory name (the same on every rank)."""

    def __init__(self, store: Any, save: str, rank: int, world: int) -> None:
        self.store, self.prefix, self.rank, self.world = store, f"mgpu-shard-written/{save}/", rank, world

    def mark(self) -> None:
        """This rank's shard is written (its files are on disk; DCP's gather of the results comes next)."""
        self.store.set(self.prefix + str(self.rank), b"1")

    def late(self) -> list[int]:
        """The ranks that have not marked (yet): the ones a timed-out save waited for."""
        try:
            return [r for r in range(self.world) if not self.store.check([self.prefix + str(r)])]
        except Exception:  # noqa: BLE001  (a store gone as well: nothing more to say than the save's own error)
            return []

    def clear(self) -> None:
        """This rank's mark removed once the save is done (the store keeps no key per save forever)."""
        try:
            self.store.delete_key(self.prefix + str(self.rank))
        except Exception:  # noqa: BLE001  (a leftover key costs a few bytes; never fails a save that worked)
            pass


def late_line(late: list[int], rank: int, wait_s: float | None) -> str:
    """`rank(s) 3, 7 had not written their shard when rank 0 stopped waiting (after 300 s)`; empty when none
    is known to be late."""
    others = [r for r in late if r != rank]
    if not others:
        return ""
    after = f" (after {wait_s:.0f} s)" if wait_s is not None else ""
    ranks = ", ".join(map(str, others[:16])) + (f" and {len(others) - 16} more" if len(others) > 16 else "")
    return (f"rank{'s' if len(others) > 1 else ''} {ranks} had not written {'their' if len(others) > 1 else 'its'} "
            f"shard when rank {rank} stopped waiting{after}")


class MarkingWriter(FileSystemWriter):
    """DCP's file writer that calls `on_written()` once this rank's shard files are written."""

    def __init__(self, *args: Any, on_written: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_written = on_written

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)  # written when it returns (torch 2.13); an error raises here
        self.on_written()
        return future
