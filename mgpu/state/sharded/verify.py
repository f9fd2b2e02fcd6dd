"""A sharded resume that reads its files once: each shard file's checksum, recorded per chunk when it was written
(mgpu.state.files.digest), is checked chunk by chunk as DCP's load reaches the chunk, not in a pass of its own before
it.

DCP reads a shard file item by item, and torch.load reads inside an item out of order (the zip's directory at its
end first). So a shard file is memory-mapped (`MappedStream`): the first read that reaches a chunk digests that
whole chunk from the mapping, and the load then copies from pages just read (a page cache hit, even for a
checkpoint larger than memory), and every chunk is digested once. Whatever the load did not reach in the files
this rank answers for (saved rank r's by rank r % W; the parts another world size does not read here) is digested
after it (`ChunkChecks.finish`): the same verification as before, without the second read. A chunk that does not
match fails the read (DCP's load fails on every rank) and is named; the caller falls back to the previous
checkpoint (mgpu.state.resumption). The pages faulted in count as the resume's progress (mgpu.stop.phase_progress).
"""

from __future__ import annotations

import io
import mmap
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from torch.distributed.checkpoint.filesystem import FileSystem

from mgpu.state.sharded.dcp_safe import SafeReader
from mgpu.state.files.digest import ALGORITHMS, ChunkDigest

__all__ = ["ChunkChecks", "MappedStream", "ShardDamaged", "VerifyingReader", "deferrable"]


class ShardDamaged(OSError):
    """A chunk of a shard file does not match its recorded checksum (the message names the file and the byte)."""


def deferrable(entry: Mapping[str, Any]) -> bool:
    """Whether a manifest line's checksum can be checked chunk by chunk (mgpu.state.files.digest's record; a whole-file
    sha256 from before it cannot)."""
    checksum = entry.get("checksum")
    return (isinstance(checksum, dict) and checksum.get("algorithm") in ALGORITHMS
            and isinstance(checksum.get("chunk_bytes"), int) and checksum["chunk_bytes"] > 0
            and isinstance(checksum.get("values"), list) and isinstance(entry.get("bytes"), int))


class ChunkChecks:
    """The chunks of a checkpoint's shard files checked so far, from their manifest lines (`entries`: file name ->
    {"bytes", "checksum"}), and the first mismatch found."""

    def __init__(self, directory: Path, entries: Mapping[str, Mapping[str, Any]]) -> None:
        self.directory, self.entries = Path(directory), dict(entries)
        self.checked: dict[str, set[int]] = {name: set() for name in self.entries}
        self.problem: str | None = None
        self._lock = threading.Lock()

    def check(self, name: str, view: memoryview, start: int, end: int) -> None:
        """Digest every not yet checked chunk of file `name` (mapped as `view`) that [start, end) reaches;
        ShardDamaged on a mismatch."""
        entry = self.entries.get(name)
        if entry is None or end <= start:
            return
        record = entry["checksum"]
        size, chunk = entry["bytes"], record["chunk_bytes"]
        for index in range(start // chunk, min(-(-end // chunk), -(-size // chunk))):
            if index in self.checked[name]:
                continue
            digest = ChunkDigest(record["algorithm"], chunk)
            digest.update(view[index * chunk:min((index + 1) * chunk, size)])
            values = digest.entry()["values"]
            expected = record["values"][index] if index < len(record["values"]) else None
            if values != [expected]:
                self._fail(f"{self.directory / name} does not match its {record['algorithm']} checksum from byte "
                           f"{index * chunk} on (corrupted)")
            with self._lock:
                self.checked[name].add(index)

    def _fail(self, problem: str) -> None:
        with self._lock:
            self.problem = self.problem or problem
        raise ShardDamaged(problem)

    def finish(self, names: Any) -> str | None:
        """Check what the load did not reach of the files `names` (those this rank answers for); the first mismatch
        found here or during the load (None: every chunk matched)."""
        for name in names:
            if self.problem is not None:
                break
            entry = self.entries.get(name)
            if entry is None:
                continue
            chunks = -(-entry["bytes"] // entry["checksum"]["chunk_bytes"])
            if len(self.checked[name]) == chunks:
                continue
            try:
                with mapped(self.directory / name) as view:
                    self.check(name, view, 0, entry["bytes"])
            except ShardDamaged:
                pass
            except OSError as error:
                self.problem = self.problem or f"{self.directory / name} unreadable: {error.strerror or error}"
        return self.problem


@contextmanager
def mapped(path: Path) -> Iterator[memoryview]:
    """A read-only memoryview of the whole file at `path` (empty for an empty file)."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if not size:
            yield memoryview(b"")
            return
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mapping)
    try:
        yield view
    finally:
        view.release()
        mapping.close()


class MappedStream(io.RawIOBase):
    """A read-only, seekable stream over a mapped shard file whose chunks are checked (`checks`) as reads reach
    them: what DCP's reader and torch.load read an item through."""

    def __init__(self, path: Path, checks: ChunkChecks) -> None:
        super().__init__()
        self.name, self.checks, self._pos = Path(path).name, checks, 0
        self._context = mapped(Path(path))
        self.view = self._context.__enter__()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self.view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        end = min(self._pos + len(target), len(self.view))
        if end <= self._pos:
            return 0
        self.checks.check(self.name, self.view, self._pos, end)
        count = end - self._pos
        target[:count] = self.view[self._pos:end]
        self._pos = end
        return count

    def close(self) -> None:
        if not self.closed:
            self._context.__exit__(None, None, None)
        super().close()


class _VerifyingFileSystem(FileSystem):
    """DCP's local filesystem whose shard files open as MappedStreams (other files, and writes, as before)."""

    def __init__(self, checks: ChunkChecks) -> None:
        super().__init__()
        self.checks = checks

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "r" in mode and Path(path).name in self.checks.entries:
            mapped_stream = MappedStream(Path(path), self.checks)
            try:
                yield mapped_stream
            finally:
                mapped_stream.close()
            return
        with super().create_stream(path, mode) as stream:
            yield stream


class VerifyingReader(SafeReader):
    """mgpu.state.sharded.dcp_safe's reader (its `.metadata` through the allow-list) whose shard files are checked
    chunk by chunk as they are read (`checks`)."""

    def __init__(self, path: Path, checks: ChunkChecks) -> None:
        super().__init__(path)
        self.fs = _VerifyingFileSystem(checks)
