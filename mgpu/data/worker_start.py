"""Forked DataLoader workers that never reach Python: found within a bound, and forked again, on the CPythons
where that can happen.

CPython 3.11 before 3.11.8 (fixed there and in 3.12; 3.10 is taken as affected: whether its last releases carry
the backport was not confirmed here) deletes the parent's other thread states in a forked
child under the runtime's lock of its thread list (HEAD_LOCK) before it re-creates that lock (CPython gh-112275). A
thread of the parent that held the lock at the instant of the fork leaves the child waiting on it forever. torch's
C++ threads take it without the GIL whenever they create or delete a Python thread state: gloo's runloop dropping a
collective's last tensor, for one (see tests/test_fingerprint.py). mgpu's own Python threads cannot cause it: they
create and delete their states under the GIL, which `os.fork` holds too. The worker stays alive, so neither torch's
liveness checks nor its watchdog notice, and the training process waits for its batch forever: seen once in about ten
test-suite runs on CPython 3.11.7, a resumed run hung at step 19 of 50; the orphaned worker's stack (gdb): os_fork ->
PyOS_AfterFork_Child -> _PyEval_ReInitThreads -> _PyThreadState_DeleteExcept -> PyThread_acquire_lock.

Only a *forked* worker can meet it: one started by `spawn` or `forkserver` is a new interpreter (forkserver's server
runs no thread of the training process). So `guarded(loader)` is true only for a loader whose workers are forked, on
an affected CPython (`AFFECTED`). There each worker marks its first Python line (mgpu's worker_init_fn, `mark`) in a
page shared with the parent (a forked child inherits the page and the module global that names it), and `wait` gives
every worker of a new iterator STARTED_WITHIN_S to do so: a healthy fork reaches Python in milliseconds, and a worker
that has not by then never will. The caller kills the iterator's workers and forks them again
(mgpu.data.loader.start), FORK_ATTEMPTS times at most. Elsewhere nothing is waited for and no worker is ever killed.
`hazard_line` is what rank 0 says once where the guard is on: the fix (a fixed CPython, or forkserver workers).
"""

from __future__ import annotations

import mmap
import multiprocessing
import platform
import sys
import time
from typing import Any, Sequence

__all__ = ["AFFECTED", "FORK_ATTEMPTS", "STARTED_WITHIN_S", "Marks", "affected", "guarded", "hazard_line",
           "kill_workers", "mark", "start_method"]

STARTED_WITHIN_S = 30.0
"""How long a forked worker may take to reach its first line of Python (a healthy one: milliseconds; a slow
fork of a process with a large address space on a loaded node: about a second)."""

FORK_ATTEMPTS = 3
"""How many times an iterator's workers are forked before the stuck start is an error."""

_current: "Marks | None" = None  # the marks of the iterator being forked (a forked worker inherits this global)


def affected(version: tuple[int, int, int], implementation: str = "CPython") -> bool:
    """Whether this Python's forked children can wait forever on HEAD_LOCK (CPython gh-112275): CPython 3.11 before
    3.11.8 (the backport), and 3.10 (taken as affected); 3.12 and later have the fix, and mgpu needs 3.10 or later."""
    if implementation != "CPython":
        return False
    return (3, 10) <= version < (3, 11, 8)


AFFECTED = affected(tuple(sys.version_info[:3]), platform.python_implementation())  # type: ignore[arg-type]  # a 3-tuple of ints
"""This interpreter's forked DataLoader workers can hang at their start (gh-112275)."""


def start_method(loader: Any) -> str:
    """How `loader`'s workers start: its own `multiprocessing_context`, else multiprocessing's default (the start
    method set with `set_start_method`, which a process started by `spawn` inherits, else the platform's default),
    read without fixing it (a later `set_start_method` still works)."""
    context = getattr(loader, "multiprocessing_context", None)
    if context is not None:
        return str(context.get_start_method())
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


def guarded(loader: Any) -> bool:
    """Whether `loader`'s workers are watched at their start: forked, on an affected CPython."""
    return AFFECTED and start_method(loader) == "fork"


def hazard_line() -> str:
    """What rank 0 says once where the guard is on: the cause, what mgpu does, and the two fixes."""
    version = platform.python_version()
    return (f"CPython {version} can leave a forked worker of a DataLoader waiting forever at its start (CPython gh-112275, "
            f"fixed in 3.11.8 and 3.12): mgpu forks the workers again when one has not reached Python within "
            f"{STARTED_WITHIN_S:.0f} s. To rule it out: a fixed CPython, or workers started by forkserver "
            f"(data.worker_start_method: forkserver; a loop of your own: session.loader(..., "
            f"multiprocessing_context=\"forkserver\"))")


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
    """In a worker, first thing: it reached Python (a no-op where its loader is not guarded: a spawned or
    forkserver-started worker inherits no marks)."""
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
