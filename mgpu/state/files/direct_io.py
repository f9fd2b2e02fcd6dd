"""Checkpoint files written past the page cache (O_DIRECT), digested on the way. No torch.

A buffered write costs the writing thread a copy into the page cache plus the kernel's bookkeeping of every page
(allocating it, dirtying it, writing it back, reclaiming it later): 1-2 GB/s of one core on the CI machine,
under the write speed of an NVMe drive, and a stream of memory traffic that slows a training step which shares the
memory bus (bench/periodic_saves.py). It also evicts what the page cache held, a dataset's files included. Written
with O_DIRECT, the bytes go from a few aligned buffers straight to the device: the writing thread copies each
piece into a buffer (a memmove, outside the GIL) and digests it there while it is still in the CPU's cache, and
another thread writes each full buffer as the next one fills (the way DeepNVMe and FastPersist write). The buffers
are on huge pages (`aligned_buffer`): the device takes a request of physically contiguous pieces, and from scattered
4 KiB pages its requests were an eighth of the size. A caller whose memory stays put until the close (a background
save's own snapshot) has its page-aligned pieces written from where they are, without the copy (`in_place`), and
digested by a third thread while they are written.

O_DIRECT needs the buffer's address, the file offset and the length aligned to the device's block: every write
here is a whole buffer at an aligned offset, except the last, which is padded with zeros and then cut back to the
file's true size (ftruncate). Where the filesystem refuses O_DIRECT (tmpfs before Linux 6.6, some network
filesystems, not Linux) `open_direct` returns None and the caller writes through the page cache as before; where it
opens the file with O_DIRECT and then refuses a write (EINVAL), the flag is dropped and the file written through the
page cache. What is durable, and when, is still the fsync's to say: O_DIRECT bypasses the page cache, not the
device's own write cache or the file's metadata.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import io
import logging
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from mgpu.state.files.digest import ChunkDigest

__all__ = ["ALIGN", "BUFFER_BYTES", "DirectFile", "aligned_buffer", "open_direct"]

_log = logging.getLogger("mgpu.state.files.direct_io")

ALIGN = 4096
"""The alignment of every O_DIRECT write's address, offset and length (a page: every Linux block device's
logical block size divides it)."""
BUFFER_BYTES = 16 << 20
"""The size of each aligned buffer (a multiple of ALIGN): four of the CI disk's largest requests (4 MiB) in flight
per write (8 MiB wrote a GiB in 0.51 s, 16 MiB in 0.475 s, 64 MiB in 0.47 s), three of them per open file."""
DEPTH = 3
"""Buffers per file: one filling while the others are written."""
IN_PLACE_BYTES = 1 << 20
"""A file told its caller's memory stays put (`in_place`) writes a page-aligned piece of at least this many bytes
that falls at an aligned file offset straight from that memory, not copied into a buffer first."""
DIGEST_AS_COPIED = True
"""Whether the bytes a file copies into its buffers are digested by the copying thread right after each piece's copy
(at most DIGEST_PIECE bytes: read back from the cache), not by the digest thread once the buffer is full (read back
from memory). One pass over memory fewer: on the CI machine a GiB's stop save went from 0.85 to 0.91 of the disk's
speed (median of 5, bench/write_speed.py --ab-digest: write_speed_digest.json). Off: a bench's A/B."""
DIGEST_PIECE = 1 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)
HUGE_PAGES = True
"""Whether the buffers ask for transparent huge pages (`aligned_buffer`); off, they are 4 KiB pages (a bench's A/B)."""
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


class _PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]


def _address(view: memoryview) -> int:
    """The address of a contiguous (read-only or not) buffer's first byte. `view` keeps the memory alive."""
    buffer = _PyBuffer()
    _get_buffer(view, ctypes.byref(buffer), 0)  # PyBUF_SIMPLE: contiguous bytes
    try:
        return int(buffer.buf or 0)
    finally:
        _release_buffer(ctypes.byref(buffer))


def aligned_buffer(size: int) -> tuple[mmap.mmap, memoryview]:
    """`size` bytes of page-aligned memory for O_DIRECT writes (the mapping, and the view to write through),
    backed by transparent huge pages where the system grants them. Why: the device takes a write in requests of
    at most `max_segments` physically contiguous pieces; from 4 KiB pages scattered in memory a request held
    ~0.5 MiB, from 2 MiB pages the device's whole `max_sectors_kb` (4 MiB on the CI machine's virtio disk), and
    the same GiB was written in 0.49 s instead of 0.71 s (docs/benchmarks.md). A private mapping, not
    Python's default shared one: shared anonymous memory is shmem, which has no huge pages unless
    `shmem_enabled` says so."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if not HUGE_PAGES or _MADV_HUGEPAGE is None or not flags:
        mapping = mmap.mmap(-1, size)
        return mapping, memoryview(mapping)
    mapping = mmap.mmap(-1, size + _HUGE_PAGE, flags=flags)
    offset = -_address(memoryview(mapping)) % _HUGE_PAGE
    try:
        mapping.madvise(_MADV_HUGEPAGE, offset, size)
    except OSError:  # a kernel without transparent huge pages: the 4 KiB pages serve, more slowly
        pass
    return mapping, memoryview(mapping)[offset:offset + size]


_spare: dict[tuple[int, bool], list[memoryview]] = {}
_spare_lock = threading.Lock()
SPARE_BUFFERS = DEPTH
"""Buffers a closed file leaves for the next (per size): a process faults its huge pages in once, not at every
save. Where memory is fragmented, the fault of a huge page is where the kernel compacts memory (`defrag`), which
can take milliseconds to seconds: paid once per process, not once per checkpoint."""


def _take_buffers(size: int, count: int) -> list[memoryview]:
    with _spare_lock:
        spare = _spare.get((size, HUGE_PAGES), [])
        taken = [spare.pop() for _ in range(min(count, len(spare)))]
    try:
        return taken + [aligned_buffer(size)[1] for _ in range(count - len(taken))]
    except BaseException:
        _give_back(taken)  # a mapping that failed (ENOMEM) leaves the spares for the next file
        raise


def _give_back(views: list[memoryview]) -> None:
    with _spare_lock:
        for view in views:
            spare = _spare.setdefault((len(view), HUGE_PAGES), [])
            if len(spare) < SPARE_BUFFERS:
                spare.append(view)


InPlace = Callable[[int, int], bool]
"""Whether the caller's `nbytes` at `address` stay allocated and unchanged until the file's close."""


def open_direct(path: Path, algorithm: str = "crc32", in_place: bool | InPlace = False,
                gate: Callable[[int, int], None] | None = None) -> "DirectFile | None":
    """A new file at `path` written with O_DIRECT, or None where this system or filesystem refuses it (`in_place`,
    `gate`: see DirectFile)."""
    if not _O_DIRECT:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _O_DIRECT, 0o644)
    except OSError as error:
        if error.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # a filesystem without O_DIRECT (tmpfs before Linux 6.6)
            return None
        raise
    try:
        return DirectFile(fd, algorithm, in_place=in_place, gate=gate)  # it owns `fd` now, closed if it raised
    except OSError as error:  # its buffers could not be mapped (ENOMEM): the page cache needs none of them
        _log.warning("%s: no memory for the O_DIRECT write buffers (%s): written through the page cache", path,
                     error.strerror or error)
        return None


class DirectFile(io.RawIOBase):
    """A write-only O_DIRECT file (`fd`, which it owns and closes) that digests what it writes (`digest`:
    mgpu.state.files.digest's record, complete once closed). The caller's thread copies each piece into a buffer and
    digests it (DIGEST_AS_COPIED); each full buffer is written by another thread while the caller fills the next.
    The first OSError of the writes below is kept (`error`) and raised again by the next write or the close: torch's
    zip writer would swallow it.

    `in_place`: the caller promises that the memory of every piece it writes stays allocated and unchanged until
    the close (True: a snapshot of its own, not torch.save's temporary copy of a GPU storage), or says of which
    memory it does (a function of the address and size: a snapshot's buffers, not the temporary copy DCP makes of a
    tensor that is not its storage's whole). Then a page-aligned piece
    of IN_PLACE_BYTES or more at an aligned file offset (torch.save's storages, with mgpu.state.files.zip_options'
    page_aligned_storages) is written from there, in one request with the buffer before it, and digested by a
    thread of its own (the caller's thread goes on to the next piece): one pass over memory fewer, a copy the size of
    the state. The digest keeps the bytes' order: such a file's buffers are digested by that thread too.

    `gate(address, nbytes)`: called before the caller's memory is read (copied or handed over), it returns once
    those bytes are ready (a snapshot still being copied: mgpu.state.single.host_copy.CopyGate) or raises."""

    def __init__(self, fd: int, algorithm: str = "crc32", buffer_bytes: int = BUFFER_BYTES, depth: int = DEPTH,
                 in_place: bool | InPlace = False, gate: Callable[[int, int], None] | None = None) -> None:
        super().__init__()
        self.error: OSError | None = None
        try:
            if buffer_bytes % ALIGN:
                raise ValueError(f"buffer_bytes must be a multiple of {ALIGN}")
            self._buffers = _take_buffers(buffer_bytes, depth)  # (each view keeps its mapping alive)
        except BaseException:
            # It owns `fd`: closed here, not leaked (one per save that cannot map its buffers); marked closed, so
            # that the collector's close() finds nothing to do.
            os.close(fd)
            io.RawIOBase.close(self)
            raise
        self.fd, self.digest, self.gate = fd, ChunkDigest(algorithm), gate
        self.in_place: InPlace | None = (lambda address, nbytes: True) if in_place is True else in_place or None
        self._size = 0  # bytes written by the caller
        self._offset = 0  # file offset of the current buffer's first byte (aligned)
        self._fill = 0  # bytes in the current buffer
        self._free = list(self._buffers)
        # (buffer or None where only the caller's memory went, digested, written), oldest first
        self._in_flight: collections.deque[tuple[memoryview | None, Future[None] | None, Future[None]]] = \
            collections.deque()
        # One thread each, so the digest keeps the bytes' order and the file's writes stay sequential; a digest
        # thread only where pieces are written in place (every other byte is digested as it is copied).
        self._digest_as_copied = DIGEST_AS_COPIED and not in_place
        self._digester = None if self._digest_as_copied else \
            ThreadPoolExecutor(1, thread_name_prefix="mgpu-direct-digest")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="mgpu-direct-write")
        self._current = self._free.pop()
        self._current_address = _address(self._current)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._raise_error()
        view = memoryview(data).cast("B")
        source, left, capacity = _address(view) if view.nbytes else 0, view.nbytes, len(self._current)
        if self.gate is not None and left:
            self.gate(source, left)
        if self.in_place is not None and left >= IN_PLACE_BYTES and source % ALIGN == 0 and self._fill % ALIGN == 0 \
                and self.in_place(source, left - left % ALIGN):
            whole = left - left % ALIGN
            self._hand_over(self._fill, view[:whole])
            source += whole
            left -= whole
        while left:
            count = min(left, capacity - self._fill, DIGEST_PIECE if self._digest_as_copied else left)
            ctypes.memmove(self._current_address + self._fill, source, count)  # outside the GIL
            if self._digest_as_copied:
                self.digest.update(self._current[self._fill:self._fill + count])
            self._fill += count
            source += count
            left -= count
            if self._fill == capacity:
                self._hand_over(capacity)
        self._size += view.nbytes
        return view.nbytes

    def _hand_over(self, length: int, then: memoryview | None = None) -> None:
        """Digest and write the current buffer (`length`: its bytes, padding included, a multiple of ALIGN), and
        after it `then` (the caller's aligned memory, in place) in the same request; take a free buffer, waiting for
        the oldest in flight if none is free. An empty buffer stays current."""
        buffer = self._current if length else None
        borrowed = [then] if then is not None else []
        pieces = ([self._current[:length]] if length else []) + borrowed  # written: the padding included
        digested = ([self._current[:self._fill]] if length else []) + borrowed  # digested: the bytes written to it
        self._in_flight.append((buffer, self._digester.submit(self._digest, digested) if self._digester else None,
                                self._writer.submit(self._write_pieces, pieces, self._offset)))
        self._offset += sum(piece.nbytes for piece in pieces)
        if buffer is not None:
            self._fill = 0
            if not self._free:
                self._settle_oldest()
            self._current = self._free.pop()
            self._current_address = _address(self._current)
        self._raise_error()

    def _digest(self, pieces: list[memoryview]) -> None:
        for piece in pieces:
            self.digest.update(piece)

    def _settle_oldest(self) -> None:
        buffer, digested, written = self._in_flight.popleft()
        if digested is not None:
            digested.result()
        try:
            written.result()
        except OSError as error:
            self.error = self.error or error
        if buffer is not None:
            self._free.append(buffer)

    def _write_pieces(self, pieces: list[memoryview], offset: int) -> None:
        """`pieces` (each aligned) written one after the other from `offset`, in as few requests as the kernel
        takes (a short write resumes where it stopped)."""
        if self.error is not None:
            return  # a failed write ends the file: nothing after it counts
        while pieces:
            try:
                done = self._pwrite(pieces, offset)
            except OSError as error:
                if error.errno != errno.EINVAL or not self._drop_direct():
                    raise
                continue
            offset += done
            while pieces and done >= pieces[0].nbytes:
                done -= pieces[0].nbytes
                pieces = pieces[1:]
            if done:
                pieces = [pieces[0][done:], *pieces[1:]]

    def _drop_direct(self) -> bool:
        """Whether O_DIRECT was still on and is now off: a filesystem that opened the file with it and then
        refuses the writes (EINVAL: an alignment it needs and this one does not meet) gets them through the page
        cache instead, the rest of this file included."""
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        if not flags & _O_DIRECT:
            return False
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        return True

    def _pwrite(self, pieces: list[memoryview], offset: int) -> int:
        return os.pwritev(self.fd, pieces, offset)

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def tell(self) -> int:
        return self._size

    def fileno(self) -> int:
        return self.fd

    def flush(self) -> None:
        self._raise_error()

    def close(self) -> None:
        """Write what is left (its last block padded, then the file cut back to its size) and close the file.
        Raises the first write error; the descriptor is closed either way."""
        if self.closed:
            return
        try:
            if self._fill and self.error is None:
                padded = -(-self._fill // ALIGN) * ALIGN
                self._current[self._fill:padded] = bytes(padded - self._fill)
                self._hand_over(padded)
            while self._in_flight:
                self._settle_oldest()
            self._raise_error()
            os.ftruncate(self.fd, self._size)
        finally:
            if self._digester is not None:
                self._digester.shutdown()
            self._writer.shutdown()
            os.close(self.fd)
            # (Both threads have finished: no write reads a buffer any more.)
            _give_back(self._buffers)
            self._free.clear()
            self._buffers.clear()
            self._current = memoryview(b"")
            super().close()
