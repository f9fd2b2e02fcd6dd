"""How a process that ran mgpu ends once the run's outcome is durable: fast, bounded, nothing lost.

Slurm SIGKILLs a job KillWait (often 5-30 s) after its SIGTERM. By the time a stopped rank leaves the session,
everything that matters is on disk: the stop's checkpoint, the ledger's `preempted` and decision events, the
loggers' data (TensorBoard's writer closed, wandb's run finished: `Reporter.close`). What a normal interpreter
exit still does is join the non-daemon threads, run the atexit handlers (logging's flush, wandb's service
teardown, multiprocessing's children), then finalize the interpreter: garbage-collect the whole heap (torch's
modules and tensors, DDP, the gloo stores), clear every module, run C++ static destructors. That last part
is about 1 s of CPU for a trainer process on an idle core (bench/stop_teardown.py), ten times that on a loaded
node, and it frees nothing the operating system would not free anyway.

- `exit_process(code)`: for the trainer's commands, which own their process (`jobs/train.py`, the ranks of
  `jobs/submit.py --cluster local`): flush stdout and stderr, join the other non-daemon threads and run the
  atexit handlers, together within EXIT_WITHIN_S, then `os._exit(code)`. It skips only the finalization (and
  whatever of the threads and handlers overran the bound, said in one line).
- `skip_collection_at_exit()`: for own loops, whose process is the user's: nothing is cut short; at the
  interpreter's exit (an atexit handler, so a caller that catches the SystemExit and goes on is unaffected)
  the objects alive then are frozen (`gc.freeze()`), so the finalization does not garbage-collect them one by
  one. Objects in reference cycles then have no finalizer run at exit, which Python does not promise anyway.

No torch here: `jobs/train.py` imports this module before anything else.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import threading
import time
from typing import Callable, NoReturn

from mgpu.parallel import gloo_threads

__all__ = ["EXIT_WITHIN_S", "exit_process", "run_and_exit", "skip_collection_at_exit"]

EXIT_WITHIN_S = 1.0
"""The most `exit_process` waits for the other non-daemon threads and the atexit handlers together."""

_frozen_at_exit = False


def exit_code_of(code: object) -> int:
    """The process exit status `SystemExit(code)` gives: None is 0, an int itself, anything else is printed to
    stderr and gives 1 (as the interpreter does)."""
    if code is None:
        return 0
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    print(code, file=sys.stderr, flush=True)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing more can be said there
            pass


def finish_exit_work(within_s: float = EXIT_WITHIN_S) -> list[str]:
    """What a normal exit does before the finalization, within `within_s`: join the other non-daemon threads,
    then run the atexit handlers (in a daemon thread, so that a stuck one cannot hold the exit). Returns what
    did not end in time (thread names, "atexit handlers")."""
    deadline = time.monotonic() + within_s
    me = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not me and not thread.daemon and thread is not threading.main_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
    late = [t.name for t in threading.enumerate()
            if t is not me and not t.daemon and t is not threading.main_thread() and t.is_alive()]
    handlers = threading.Thread(target=atexit._run_exitfuncs, name="mgpu-atexit", daemon=True)
    handlers.start()
    handlers.join(max(0.0, deadline - time.monotonic()))
    if handlers.is_alive():
        late.append("atexit handlers")
    return late


def exit_process(code: object, within_s: float = EXIT_WITHIN_S) -> NoReturn:
    """End this process with `code` (as `sys.exit(code)` would) without the interpreter's finalization: for a
    command that owns its process, once its outcome is recorded (see the module docstring)."""
    status = exit_code_of(code)
    _flush()
    gloo_threads.skip()  # no finalization follows: its atexit wait for gloo's workers is not needed
    late = finish_exit_work(within_s)
    if late:
        try:  # the handlers may have shut logging down already: a plain line on stderr
            print(f"mgpu: exiting without waiting longer than {within_s:.1f} s for: {', '.join(late)}",
                  file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
        for handler in logging.getLogger().handlers:  # logging.shutdown may be among the late handlers
            try:
                handler.flush()
            except Exception:  # a handler's failure at the very end costs its last lines, never the exit
                pass
    _flush()
    os._exit(status)


def run_and_exit(main: Callable[[], object], within_s: float = EXIT_WITHIN_S) -> NoReturn:
    """`exit_process(main())`, a SystemExit out of `main` included (argparse's, a requeue's); any other exception
    propagates and the process exits as usual, with its traceback."""
    try:
        code = main()
    except SystemExit as stop:
        code = stop.code
    exit_process(code, within_s)


def _freeze() -> None:
    gc.freeze()


def skip_collection_at_exit() -> None:
    """At the interpreter's exit, leave the objects alive then to the operating system instead of collecting
    them one by one (see the module docstring). Idempotent; does nothing until the interpreter exits."""
    global _frozen_at_exit
    if not _frozen_at_exit:
        _frozen_at_exit = True
        atexit.register(_freeze)  # runs before the handlers registered earlier (wandb's, logging's): LIFO
