"""torch's gloo worker threads, done with what they hold before the interpreter finalizes. No torch.

A gloo process group runs its collectives on worker threads of its own (`pt_gloo_runloop`, two per group). Once a
collective ends, its worker drops the work, and with it the work's tensors. Where one of those tensors' Python object
was dropped first (a parameter, a tensor with attributes of its own: torch then keeps the object alive from the C++
side), the worker takes the GIL to release it. A worker that asks for the GIL after the interpreter began to finalize
is ended by CPython with pthread_exit, and the forced unwind through torch's C++ frames aborts the process:
"terminate called without an active exception", SIGABRT, after a run that had finished (seen in CI: a loop of one's
own, rank 1, at its exit; torch 2.13 aborts a plain DDP script so in 3 of 10 runs here, `tests/gloo_exit_probe.py`
every time). A group outlives `destroy_process_group` while anything holds it, and a DDP model always does.

So every process that forms a group with mgpu registers `settle` to run at the interpreter's exit (before
finalization): it lets go of the GIL, a millisecond at a time, until every gloo worker of the process is parked in its
wait for the next collective, at most SETTLE_WITHIN_S (a worker still inside a collective at exit: a peer that did not
join; the process then exits as before, after one line). Where a worker's state cannot be read (no /proc, an
architecture not in FUTEX_SYSCALL), it waits FALLBACK_S once. A process that leaves by os._exit
(mgpu.stop.process_exit) does not finalize: `skip()` says so, and the exit does not wait.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path
from typing import Callable

__all__ = ["FALLBACK_S", "SETTLE_WITHIN_S", "busy_workers", "parked", "settle", "settle_at_exit", "skip"]

WORKER_NAME = "pt_gloo_runloop"
"""The name torch gives a gloo group's worker threads."""

SETTLE_WITHIN_S = 2.0
"""The most the exit waits for gloo workers to park."""

FALLBACK_S = 0.05
"""The exit's one wait where the workers' state cannot be read."""

FUTEX_SYSCALL = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "ppc64": 221, "s390x": 238, "riscv64": 98}
"""futex's system call number, by `os.uname().machine`."""

_FUTEX_WAIT_BITSET = 9  # glibc's condition-variable wait; a mutex waits with FUTEX_WAIT (0), the GIL with a timeout
_FUTEX_CMD_MASK = 0x7F  # without FUTEX_PRIVATE_FLAG and FUTEX_CLOCK_REALTIME

_registered = False
_skipped = False


def parked(syscall_line: str, futex: int) -> bool:
    """Whether a thread's `/proc/<pid>/task/<tid>/syscall` line shows it in an untimed condition-variable wait (a
    gloo worker between collectives). Running ("running"), preempted outside a system call ("-1 ..."), waiting with a
    timeout (for the GIL), on a mutex, or in any other call: not parked."""
    fields = syscall_line.split()
    if len(fields) < 5 or not fields[0].isdigit() or int(fields[0]) != futex:
        return False
    try:
        operation, timeout = int(fields[2], 16), int(fields[4], 16)
    except ValueError:
        return False
    return operation & _FUTEX_CMD_MASK == _FUTEX_WAIT_BITSET and timeout == 0


def busy_workers(tasks: Path = Path("/proc/self/task"), machine: str | None = None) -> list[int] | None:
    """The thread ids of this process's gloo workers that are not parked; None where that cannot be read."""
    futex = FUTEX_SYSCALL.get(machine or os.uname().machine)
    if futex is None:
        return None
    busy = []
    try:
        threads = list(tasks.iterdir())
    except OSError:
        return None
    for thread in threads:
        try:
            if (thread / "comm").read_text().strip() != WORKER_NAME:
                continue
            line = (thread / "syscall").read_text()
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
        except OSError:
            return None
        if not parked(line, futex):
            busy.append(int(thread.name))
    return busy


def settle(within_s: float = SETTLE_WITHIN_S, poll_s: float = 0.001,
           look: Callable[[], list[int] | None] = busy_workers, sleep: Callable[[float], None] = time.sleep,
           clock: Callable[[], float] = time.monotonic) -> list[int]:
    """Let go of the GIL until no gloo worker is busy, at most `within_s`. Returns the workers still busy then
    (empty: all parked, or none)."""
    deadline = clock() + within_s
    while True:
        busy = look()
        if busy is None:
            sleep(FALLBACK_S)
            return []
        if not busy or clock() >= deadline:
            return busy
        sleep(poll_s)


def _settle_at_exit() -> None:
    if _skipped:
        return
    busy = settle()
    if busy:
        try:
            print(f"mgpu: {len(busy)} gloo worker thread(s) still inside a collective {SETTLE_WITHIN_S:.0f} s into the "
                  "exit (a peer that did not join it): the interpreter's finalization may abort this process "
                  "(SIGABRT); the run's outcome is recorded already", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass


def settle_at_exit() -> None:
    """Run `settle` at the interpreter's exit. Idempotent. Registered when the first group forms, so it runs after
    the atexit handlers registered later (LIFO): close to the finalization."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_settle_at_exit)


def skip() -> None:
    """This process leaves without finalizing (os._exit after the atexit handlers): the exit need not wait."""
    global _skipped
    _skipped = True
