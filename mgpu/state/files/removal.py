"""Old checkpoints deleted off the saving thread's path. No torch.

Pruning renames a superseded step directory away (one atomic rename) and hands it here: one background thread per
process deletes it. Freeing a file's blocks is the filesystem's slowest metadata work: ext4 took 0.13 s per GiB on
the CI machine, a third of the time that GiB took to write. In the saving thread it held the stop's save (and so
the requeue that follows it) and kept a periodic writer from the next save. Here it runs beside the next steps.

At the interpreter's exit, what is queued is given at most EXIT_WAIT_S to finish: a trainer's whole exit work has a
second (mgpu.stop.process_exit), and the other atexit handlers come after this one. What is left then stays behind
under its temporary name, and the next save's stale-file cleanup (mgpu.state.step_dirs) hands it back here. A kill
leaves the same. The thread is a daemon: it holds no exit past that wait (the interpreter stops it where
it is), and it runs only in os calls (no C++ below it).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

__all__ = ["EXIT_WAIT_S", "remove_later", "remove_path", "wait_removed"]

log = logging.getLogger("mgpu.state.files.removal")

EXIT_WAIT_S = 0.4
"""How long the interpreter's exit waits for the queued deletions (at 0.13 s per GiB, ~3 GiB)."""

_queue: "queue.Queue[tuple[Path, Callable[[], None]]]" = queue.Queue()
_lock = threading.Lock()
_thread: threading.Thread | None = None


def remove_later(path: Path, done: Callable[[], None] = lambda: None) -> None:
    """Delete `path` (a file or a directory tree) in the background; `done()` runs after, deleted or not (a failure
    is logged: the next cleanup tries again)."""
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="mgpu-checkpoint-removal", daemon=True)
            _thread.start()
        _queue.put((path, done))


def wait_removed(timeout: float | None = None) -> bool:
    """Wait until every path queued so far is deleted (at most `timeout` s); whether it was."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _queue.all_tasks_done:
        while _queue.unfinished_tasks:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            _queue.all_tasks_done.wait(left)
    return True


def _run() -> None:
    while True:
        path, done = _queue.get()
        try:
            _delete(path)
        except OSError as error:
            log.warning("could not remove the old checkpoint %s: %s", path, error)
        finally:
            try:
                done()
            finally:
                _queue.task_done()


def remove_path(path: Path) -> None:
    """Delete a file or a directory tree now; one already gone is fine."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


_delete = remove_path  # what the deletion thread calls (a test holds or fails it here)


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) deletes nothing of its parent's queue, and its exit waits for none."""
    global _queue, _lock, _thread
    _queue, _lock, _thread = queue.Queue(), threading.Lock(), None


def _at_exit() -> None:
    if not wait_removed(EXIT_WAIT_S):
        log.info("old checkpoints still being removed at exit: left for the next save's cleanup")


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)
