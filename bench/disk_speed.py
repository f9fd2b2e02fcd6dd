"""The one reference for "the disk's speed" a checkpoint's write is measured against (issue 46): the faster of a
buffered write + fsync and an O_DIRECT write + fsync of the same bytes, in the same directory, by the same process,
in 64 MiB blocks, each then the directory fsync'd.

Why two, and why the faster: they measure different paths, and on the same disk they differ by 2-6x here.
- The buffered write copies every byte into the page cache (one core's memcpy and the kernel's bookkeeping of every
  page), and below the dirty-background threshold (vm.dirty_background_ratio, 10 % of memory here: 1.9 GB) the disk
  sees nothing until fsync: the copy and the write run one after the other, and the copy alone can be as slow as
  the disk. `write_s` and `fsync_s` time the two apart, so a report shows which one it was.
- The O_DIRECT write takes the bytes from page-aligned memory straight to the device: no copy, the device's time
  (on a virtual disk, the host's write cache included). Where the filesystem refuses O_DIRECT (tmpfs before Linux
  6.6, some network filesystems) there is only the buffered one.
A write cannot beat both, and a reference slower than what the disk can do flatters a save: the faster one is the
disk's speed. The machine's disk is noisy (other processes write too): the reference is taken right before and
right after each save and a save's ratio is the mean of the two over its own time.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mgpu.fsutil import fsync_path

__all__ = ["CHUNK", "Point", "aligned_copy", "dirty_settings", "plain_write", "reference_point", "snapshot_write"]

CHUNK = 64 << 20


def _sync_file_range() -> Any:
    import ctypes

    function = ctypes.CDLL(None, use_errno=True).sync_file_range
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


def plain_write(path: Path, data: memoryview, writeback: bool = False, direct: bool = False) -> tuple[float, float]:
    """Large sequential writes, then fsync (file and directory): (seconds writing, seconds in the fsyncs).
    `direct`: with O_DIRECT (`data` page-aligned, as `aligned_copy` makes it), as `dd oflag=direct` writes;
    `writeback`: each 64 MiB's writeback started as soon as it is written (mgpu.state.files.writeback's technique)."""
    start_writeback = _sync_file_range() if writeback else None
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        for start in range(0, len(data), CHUNK):
            os.write(fd, data[start:start + CHUNK])
            if start_writeback is not None:
                start_writeback(fd, start, CHUNK, 2)  # SYNC_FILE_RANGE_WRITE
        written = time.perf_counter()
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(path.parent, directory=True)
    return written - started, time.perf_counter() - written


def snapshot_write(path: Path, source: memoryview, snapshot: memoryview, chunk: int = CHUNK) -> tuple[float, float]:
    """A periodic save's hand-written peer: `source` (the live weights) copied into `snapshot` (page-aligned, the
    same buffer from one save to the next) one chunk at a time, by torch's copy (the GIL let go), while a second
    thread writes each chunk with O_DIRECT as soon as it is copied; then fsync (file and directory). Returns (seconds
    to durable, seconds until the copy was done: what a training loop waits for). No checksum, no format: the least a
    snapshot taken while training goes on costs on this machine, to hold a periodic save against."""
    import torch

    source_bytes = torch.frombuffer(source, dtype=torch.uint8)
    snapshot_bytes = torch.frombuffer(snapshot, dtype=torch.uint8)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    copied: queue.Queue[int | None] = queue.Queue()
    failed: list[BaseException] = []

    def write() -> None:
        while (start := copied.get()) is not None:
            if not failed:
                try:
                    os.pwrite(fd, snapshot[start:start + chunk], start)
                except OSError as error:
                    failed.append(error)

    writer = threading.Thread(target=write, name="snapshot-peer-writer")
    writer.start()
    try:
        for start in range(0, len(source), chunk):
            snapshot_bytes[start:start + chunk].copy_(source_bytes[start:start + chunk])
            copied.put(start)
        copy_done = time.perf_counter()
    finally:
        copied.put(None)
        writer.join()
    try:
        if failed:
            raise failed[0]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(path.parent, directory=True)
    return time.perf_counter() - started, copy_done - started


def aligned_copy(data: memoryview, huge_pages: bool = True) -> memoryview:
    """`data` copied into page-aligned memory, for O_DIRECT: by default where mgpu's O_DIRECT writer keeps its
    buffers (mgpu.state.files.direct_io.aligned_buffer: transparent huge pages where granted, the device's largest
    requests), else an anonymous shared mapping of 4 KiB pages (`huge_pages=False`: the form before)."""
    if huge_pages:
        from mgpu.state.files.direct_io import aligned_buffer

        _, view = aligned_buffer(len(data))
        view[:] = data
        return view
    copy = mmap.mmap(-1, len(data))
    copy[:] = data
    return memoryview(copy)


@dataclass(frozen=True)
class Point:
    """One reference point: the buffered write (its write and fsync phases) and the O_DIRECT one (None: refused)."""

    write_s: float
    fsync_s: float
    direct_s: float | None

    @property
    def buffered_s(self) -> float:
        return self.write_s + self.fsync_s

    @property
    def faster_s(self) -> float:
        """The reference: the faster of the two."""
        return min(self.buffered_s, self.direct_s) if self.direct_s is not None else self.buffered_s


def reference_point(directory: Path, data: memoryview, aligned: memoryview) -> Point:
    """Both plain writes of the same bytes into `directory`, one after the other, each file unlinked after it."""
    path = directory / "reference.bin"
    write_s, fsync_s = plain_write(path, data)
    path.unlink()
    direct_s: float | None
    try:
        direct_s = sum(plain_write(path, aligned, direct=True))
    except OSError:  # the filesystem refuses O_DIRECT: the buffered write is the reference
        direct_s = None
    path.unlink(missing_ok=True)
    return Point(write_s, fsync_s, direct_s)


def dirty_settings() -> dict[str, Any]:
    """The kernel's dirty-page settings that decide when a buffered write reaches the disk (a report's context)."""
    found: dict[str, Any] = {}
    for name in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes", "dirty_background_bytes"):
        try:
            found[name] = int(Path(f"/proc/sys/vm/{name}").read_text())
        except (OSError, ValueError):
            continue
    return found
