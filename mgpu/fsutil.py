"""Durable file writes: fsync a file or directory, and replace a file atomically; a bounded read that
never waits on a pipe nobody writes to. No torch."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["fsync_path", "read_bounded", "write_atomic", "write_durably"]


def fsync_path(path: Path, directory: bool = False) -> None:
    """fsync a file, or a directory (which makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_all(paths: list[Path]) -> None:
    """fsync every file of `paths` at once (a thread each): a journaling filesystem commits them together, where
    one after the other each waits for a commit of its own. Raises the first OSError (after every fsync ended)."""
    if len(paths) <= 1:
        for path in paths:
            fsync_path(path)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(paths), thread_name_prefix="mgpu-fsync") as pool:
        for future in [pool.submit(fsync_path, path) for path in paths]:
            future.result()


def write_durably(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it (no rename: the caller names a temporary path)."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` by `data`: readers see the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)  # mkstemp's 0600 would hide the file from collaborators
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # persist the rename itself
        fsync_path(path.parent, directory=True)


def read_bounded(path: Path, limit: int) -> tuple[bytes, bool]:
    """At most `limit` + 1 bytes of `path` (more than `limit`: too big), and whether it is a pipe.

    Opened without blocking, so a named pipe with no writer reads as empty instead of hanging in open()
    (a pipe with a writer, e.g. bash's `<(...)`, reads normally); /dev/zero stops at the limit.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        is_pipe = stat.S_ISFIFO(os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as file:
            return file.read(limit + 1), is_pipe
    finally:
        os.close(fd)
