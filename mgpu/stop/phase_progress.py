"""Progress of a long phase in the rank's log (issue 32: long barriers report progress): a resume reading a big
checkpoint, a save writing one, a rendezvous waiting for the other ranks. Every PROGRESS_EVERY_S that a rank has
stayed in one such phase, one line: how long, against the watchdog's allowance, and the bytes this process read
and wrote meanwhile (Linux's /proc/self/io `rchar`/`wchar`: every thread's read() and write(), the checkpoint
writer's too), so that a slow resume or save is told from a stuck one in the logs before the watchdog decides.

The watchdog's publisher thread calls `LongPhases.poll` once a heartbeat; the line is written by a bounded helper
(a log on a stalled filesystem must not stop the heartbeats).
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Mapping

__all__ = ["LONG_PHASES", "PAGE", "PROGRESS_EVERY_S", "LongPhases", "ThreadsProgress", "process_io", "process_threads",
           "thread_progress"]

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

PROGRESS_EVERY_S = 30.0
LONG_PHASES = {"start": "the rendezvous and setup before the first step", "resume": "the resume",
               "checkpoint": "the checkpoint (gathering the state)", "write": "the checkpoint's write",
               "checkpoint-wait": "waiting for the other ranks' checkpoint"}


def process_io() -> tuple[int, int] | None:
    """(bytes read, bytes written) through this process's read()/write() so far (None: not Linux, unreadable).
    procfs answers from the kernel's counters: it never waits on a disk."""
    try:
        with open("/proc/self/io", "rb") as file:
            fields = dict(line.split(b":", 1) for line in file.read().splitlines() if b":" in line)
        return int(fields[b"rchar"]), int(fields[b"wchar"])
    except (OSError, ValueError, KeyError):
        return None


class LongPhases:
    """The line to log about the current phase, if it is a long one due for a report (see the module)."""

    def __init__(self, rank: int, every_s: float = PROGRESS_EVERY_S,
                 counters: Callable[[], tuple[int, int] | None] = process_io) -> None:
        self.rank, self.every_s, self.counters = rank, every_s, counters
        self._phase: tuple[str, float] | None = None  # (phase, since) being followed
        self._start_io: tuple[int, int] | None = None
        self._reported = 0.0

    def poll(self, phase: str, step: int, since: float, now: float, allowance_s: float) -> str | None:
        """The progress line due now (None: not a long phase, or not yet due)."""
        if phase not in LONG_PHASES:
            self._phase = None
            return None
        if self._phase != (phase, since):  # a new phase (or the same phase beaten again): count from here
            self._phase, self._start_io, self._reported = (phase, since), self.counters(), since
            return None
        if now - self._reported < self.every_s:
            return None
        self._reported = now
        moved = ""
        io_now = self.counters()
        if io_now is not None and self._start_io is not None:
            read, written = (io_now[0] - self._start_io[0]) / 1e9, (io_now[1] - self._start_io[1]) / 1e9
            moved = f"; this process read {read:.2f} GB and wrote {written:.2f} GB meanwhile"
        return (f"rank {self.rank}: in {LONG_PHASES[phase]} of step {step} for {now - since:.0f} s (the watchdog "
                f"allows {allowance_s:.0f} s){moved}")


def thread_progress(tid: int) -> int | None:
    """Bytes thread `tid` of this process moved so far, as the kernel counts them: what it passed through read()
    (/proc `rchar`) plus a page for every page fault it took, minor or major. A read of a memory-mapped file
    (torch.load(mmap=True) and the copies out of it into the model, a shard's chunk checked from its mapping) calls
    no read() at all: its page faults are its progress, and so are those of a read() into fresh memory, which show
    while one long read() has not returned yet. None where the counters cannot be read (not Linux)."""
    try:
        with open(f"/proc/self/task/{tid}/io", "rb") as file:
            rchar = next(int(line.split()[1]) for line in file.read().splitlines() if line.startswith(b"rchar:"))
        with open(f"/proc/self/task/{tid}/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
        return rchar + PAGE * (int(fields[7]) + int(fields[9]))  # minflt, majflt (stat fields 10 and 12)
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def process_threads() -> list[int]:
    """The kernel's ids of this process's threads (those of C libraries, OpenMP's and gloo's, included)."""
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except (OSError, ValueError):
        return []


class ThreadsProgress:
    """Whether a process moved data since the last look: any of its threads (but `ignored()`: the watchdog's own) whose
    `progress` counter grew. The resume's work is not the training thread's alone: a checkpoint's copies run in
    OpenMP's threads, a shard's chunks may be checked in a thread of their own."""

    def __init__(self, progress: Callable[[int], int | None] = thread_progress,
                 threads: Callable[[], Iterable[int]] = process_threads,
                 ignored: Callable[[], Iterable[int]] = tuple) -> None:
        self.progress, self.threads, self.ignored = progress, threads, ignored
        self._last: Mapping[int, int] | None = None

    def reset(self) -> None:
        """Forget the counters: the next look is a new baseline."""
        self._last = None

    def grew(self) -> bool:
        """True if a thread's counter grew since the last look (False at the first: its baseline)."""
        skip = set(self.ignored())
        now = {tid: count for tid in self.threads() if tid not in skip
               and (count := self.progress(tid)) is not None}
        last, self._last = self._last, now
        return last is not None and any(count > last.get(tid, count) for tid, count in now.items())
