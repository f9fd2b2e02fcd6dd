"""DataLoader workers that never reach Python after their fork: found within a bound, and forked again.

CPython 3.11's child-after-fork code deletes the parent's other thread states under the runtime's lock of its
thread list (HEAD_LOCK) before it re-creates that lock. A thread of the parent that held the lock at the instant
of the fork leaves the child waiting on it forever. torch's C++ threads take it without the GIL whenever they
create or delete a Python thread state: gloo's runloop dropping a collective's last tensor, for one (see
tests/test_fingerprint.py). The worker stays alive, so neither torch's liveness checks nor its watchdog notice,
and the training process waits for its batch forever: seen once in about ten test-suite runs, a resumed run
hung at step 19 of 50; the orphaned worker's stack (gdb): os_fork -> PyOS_AfterFork_Child ->
_PyEval_ReInitThreads -> _PyThreadState_DeleteExcept -> PyThread_acquire_lock.

So each worker marks its first Python line (mgpu's worker_init_fn, `mark`) in a page shared with the parent,
and `wait` gives every worker of a new iterator STARTED_WITHIN_S to do so: a healthy fork takes milliseconds,
and a worker that has not run a line of Python by then never will. The caller kills the iterator's workers
and forks them again (mgpu.data.loader.start), FORK_ATTEMPTS times at most.
"""

from __future__ import annotations

import mmap
import time
from typing import Any, Sequence

__all__ = ["FORK_ATTEMPTS", "STARTED_WITHIN_S", "Marks", "kill_workers", "mark"]

STARTED_WITHIN_S = 30.0
"""How long a forked worker may take to reach its first line of Python (a healthy one: milliseconds; a slow
fork of a process with a large address space on a loaded node: about a second)."""

FORK_ATTEMPTS = 3
"""How many times an iterator's workers are forked before the stuck start is an error."""

_current: "Marks | None" = None  # the marks of the iterator being forked (a worker inherits this global)


class Marks:
    """One byte per worker in an anonymous shared page: a forked worker sets its own, the parent reads them."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._page = mmap.mmap(-1, max(1, workers))  # MAP_SHARED: a fork shares it, not copies it

    def __enter__(self) -> "Marks":
        global _current
        _current = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _current
        _current = None

    def set(self, worker_id: int) -> None:
        self._page[worker_id] = 1

    def unstarted(self) -> list[int]:
        return [w for w in range(self.workers) if not self._page[w]]

    def wait(self, processes: Sequence[Any], within_s: float | None = None) -> list[int]:
        """The workers that have not started within `within_s` (default STARTED_WITHIN_S); none once every
        one has, or one has exited (the loader reports that at its next fetch, as it would have)."""
        deadline = time.monotonic() + (STARTED_WITHIN_S if within_s is None else within_s)
        pause = 0.001
        while True:
            late = self.unstarted()
            if not late or any(p.exitcode is not None for p in processes):
                return []
            if time.monotonic() >= deadline:
                return late
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def close(self) -> None:
        self._page.close()


def mark(worker_id: int) -> None:
    """In a worker, first thing: it reached Python (a no-op where its loader was not forked by `start`)."""
    if _current is not None:
        _current.set(worker_id)


def kill_workers(iterator: Any) -> list[int]:
    """SIGKILL an iterator's workers (one stuck after its fork has every signal of mgpu's blocked, SIGTERM
    included) and release its queues and threads; the pids killed."""
    workers = list(getattr(iterator, "_workers", []))  # torch's private list of the worker processes
    for process in workers:
        process.kill()
    for process in workers:
        process.join(timeout=5)
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    return [process.pid for process in workers]
