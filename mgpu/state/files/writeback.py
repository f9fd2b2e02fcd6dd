"""Early writeback of a checkpoint file while it is written: the disk writes what was copied into the page cache
while the rest is still being copied, and the final fsync finds little left. No torch.

Without it the kernel starts writing a file's dirty pages only past its dirty thresholds (a share of the node's
memory: gigabytes on a GPU node) or at the fsync, so a save costs the copy into the page cache plus the whole
write to the disk, one after the other. Linux's `sync_file_range(SYNC_FILE_RANGE_WRITE)` starts the writeback of
a range without waiting for it (RocksDB's `bytes_per_sync`, PostgreSQL's `*_flush_after`). It is a hint: what is
durable, and when, is still the fsync's to say. Where the call is missing or refused (not Linux, a filesystem
without it) the file is written as before.
"""

from __future__ import annotations

import ctypes
import io
import sys
from typing import Any, Callable

__all__ = ["WRITEBACK_BYTES", "WritebackFile"]

WRITEBACK_BYTES = 32 << 20
"""Writeback is started after every this many bytes (a larger write is passed down in pieces of this size); 0: off."""
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE = _sync_file_range()


class WritebackFile(io.RawIOBase):
    """A write-only file over `file` (a buffered binary file whose write takes all of a buffer or raises) that
    starts the writeback of every `WRITEBACK_BYTES` written. Closing it leaves `file` open."""

    def __init__(self, file: Any, step: int | None = None) -> None:
        super().__init__()
        self.file = file
        self.step = WRITEBACK_BYTES if step is None else step
        self._fd: int | None = None
        self._started = 0  # writeback started up to here
        if self.step > 0 and _SYNC_FILE_RANGE is not None:
            try:
                self._fd, self._started = file.fileno(), file.tell()
            except (OSError, ValueError):  # no descriptor or position (io.UnsupportedOperation is both)
                self._fd = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._fd is None:
            self.file.write(view)
            return len(view)
        for start in range(0, len(view), self.step):
            self.file.write(view[start:start + self.step])
            self._kick()
        return len(view)

    def _kick(self) -> None:
        if self._fd is None or _SYNC_FILE_RANGE is None:
            return
        end = self.file.tell()  # a few KiB may still sit in `file`'s buffer: the hint covers them next time
        if end - self._started < self.step:
            return
        if _SYNC_FILE_RANGE(self._fd, self._started, end - self._started, _SYNC_FILE_RANGE_WRITE) != 0:
            self._fd = None  # refused here (ESPIPE, EINVAL, ...): written as without it
            return
        self._started = end

    def tell(self) -> int:
        return int(self.file.tell())

    def fileno(self) -> int:
        return int(self.file.fileno())

    def flush(self) -> None:
        if not self.file.closed:  # (also called when this wrapper is collected, maybe after `file` was closed)
            self.file.flush()
