"""A session's failure recorded when its process dies of an uncaught exception before `finish()`: a loop that ends
with `session.finish()` instead of `with mgpu.Session(...)` (as the shipped jobs/loops examples do) is recorded as
failed, with its error, exactly as leaving the `with` block with that exception records it (`Session.fail`).
No torch.

`sys.excepthook` runs for an exception that reaches the top of the main thread, before the interpreter tears
anything down; a process that is killed (SIGKILL, os._exit) records nothing here (the watchdog's and the batch
script's paths cover those). A rank of `mgpu.spawn` reaches the hook through `mgpu.spawn`, which gives a rank's
uncaught exception to it (multiprocessing prints such an exception without calling the hook).
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Callable

__all__ = ["record_uncaught"]


def record_uncaught(fail: Callable[[BaseException], None]) -> Callable[[], None]:
    """Install a `sys.excepthook` that, after the hook it replaces has printed the traceback, calls `fail(error)`
    for an uncaught exception; returns the function that uninstalls it (when the session ends)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        previous(kind, error, tb)
        try:
            fail(error)
        except BaseException as inner:  # noqa: BLE001  (the process is dying: say why the record failed, no more)
            print(f"mgpu: the failure could not be recorded: {type(inner).__name__}: {inner}", file=sys.stderr,
                  flush=True)

    def uninstall() -> None:
        if sys.excepthook is hook:
            sys.excepthook = previous

    sys.excepthook = hook
    return uninstall
