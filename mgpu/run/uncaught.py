"""What a loop's process does with an exception nobody caught, once a session exists:

- `record_uncaught`: a session's failure recorded when its process dies of an uncaught exception before `finish()`:
  a loop that ends with `session.finish()` instead of `with mgpu.Session(...)` (as the shipped jobs/loops examples
  do) is recorded as failed, with its error, exactly as leaving the `with` block with that exception records it
  (`Session.fail`).
- `refusals_in_one_line`: an MgpuError (mgpu's refusal of a misuse, such as an optimizer built before
  `wrap(parallel="fsdp")`, made alike on every rank before anything is done) is one line on rank 0, `mgpu: error:
  ...`, nothing on the other ranks, and exit code 2, as every entry point's bad input; not a traceback per rank.
No torch.

`sys.excepthook` runs for an exception that reaches the top of the main thread, before the interpreter tears
anything down; a process that is killed (SIGKILL, os._exit) records nothing here (the watchdog's and the batch
script's paths cover those). A rank of `mgpu.spawn` reaches the hook through `mgpu.spawn`, which gives a rank's
uncaught exception to it (multiprocessing prints such an exception without calling the hook).
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Callable

from mgpu.errors import USAGE_EXIT_CODE, MgpuError

__all__ = ["record_uncaught", "refusals_in_one_line"]

_rank: list[int] = []  # this process's rank, once the hook is installed (the latest session's)


def record_uncaught(fail: Callable[[BaseException], None]) -> Callable[[], None]:
    """Install a `sys.excepthook` that, after the hook it replaces has printed the traceback, calls `fail(error)`
    for an uncaught exception (an MgpuError: before, since the hook under it ends the process); returns the
    function that uninstalls it (when the session ends)."""
    previous = sys.excepthook

    def record(error: BaseException) -> None:
        try:
            fail(error)
        except BaseException as inner:  # noqa: BLE001  (the process is dying: say why the record failed, no more)
            print(f"mgpu: the failure could not be recorded: {type(inner).__name__}: {inner}", file=sys.stderr,
                  flush=True)

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if isinstance(error, MgpuError):
            record(error)
            previous(kind, error, tb)
            return
        previous(kind, error, tb)
        record(error)

    def uninstall() -> None:
        if sys.excepthook is hook:
            sys.excepthook = previous

    sys.excepthook = hook
    return uninstall


def _rank_from_environment() -> int:
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def refusals_in_one_line(rank: int | None = None) -> None:
    """Install, once per process, the hook that prints an uncaught MgpuError as one line on rank 0 (`rank`, else the
    launcher's RANK) and ends the process with exit code 2 after its atexit handlers and threads
    (mgpu.stop.process_exit.exit_process); any other exception goes to the hook it replaced. Called again, it only
    updates the rank."""
    known = _rank_from_environment() if rank is None else rank
    if _rank:
        _rank[0] = known
        return
    _rank.append(known)
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if not isinstance(error, MgpuError):
            previous(kind, error, tb)
            return
        if _rank[0] == 0:  # the same refusal on every rank: said once
            # The real stderr: torch's process group puts a hook over this one that holds sys.stderr in a buffer
            # while it runs, to prefix each line with the rank, and this hook ends the process before it writes it.
            stream = sys.__stderr__ or sys.stderr
            print(f"mgpu: error: {' '.join(str(error).split())}", file=stream, flush=True)
        from mgpu.stop.process_exit import exit_process

        exit_process(USAGE_EXIT_CODE)

    sys.excepthook = hook
