"""The checksums of a sharded save's files, computed while DCP writes them (mgpu.state.files.digest): a rank's manifest
then needs no second read of its shard. Which stream wrote which file is recorded by name. DCP's torch.save of each
tensor into such a stream writes no zip CRC32 (mgpu.state.files.zip_options: this thread only, while the stream is
open): the stream's own checksum covers the same bytes. The files are written past the page cache where the filesystem
takes it (mgpu.state.files.direct_io), as a single-file save's are; a staged save's big tensors from the stager's own
buffers, in place (`ItemAlignedStream`)."""

from __future__ import annotations

import io
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Protocol

from torch.distributed.checkpoint.filesystem import FileSystem

from mgpu.state.files.digest import DigestingFile
from mgpu.state.files.direct_io import ALIGN, open_direct
from mgpu.state.files.writeback import WritebackFile
from mgpu.state.files.zip_options import align_next_saves, next_saves_aligned, without_zip_crc32

__all__ = ["DigestingFileSystem", "Gate", "ItemAlignedStream"]


class Gate(Protocol):
    """What a stream waits on while the state it writes is still being copied."""

    def __call__(self, address: int, nbytes: int) -> None: ...

    def wait_all(self) -> None: ...

    def holds(self, address: int, nbytes: int) -> bool: ...


class ItemAlignedStream(io.RawIOBase):
    """A DCP stream whose items each start at a page-aligned offset of the file (`file`, written through).

    DCP takes an item's offset by `tell()` before it writes the item and its length by `tell()` after
    (torch.distributed.checkpoint.filesystem._write_item; torch.save inside writes, never tells). So a `tell()`
    right after a `tell()`, with nothing written between, is the start of the next item: there, where that item's
    archive puts its storage at a page-aligned offset (AligningPlanner told this thread so), the stream pads with
    zeros to the next page. The storage then lies at a page-aligned offset of the file, which an O_DIRECT file writes
    from the staged tensor itself. The padding lies between two items' recorded ranges: DCP's reader never reads
    it. A small tensor's item is not padded."""

    def __init__(self, file: Any) -> None:
        super().__init__()
        self.file = file
        self._told = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._told = False
        return int(self.file.write(data))

    def tell(self) -> int:
        position = int(self.file.tell())
        if self._told and position % ALIGN and next_saves_aligned():
            self.file.write(bytes(ALIGN - position % ALIGN))
            position = int(self.file.tell())
        self._told = True
        return position

    def fileno(self) -> int:
        return int(self.file.fileno())

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        """DCP's close of the stream; the file is closed by its owner (DigestingFileSystem.create_stream)."""
        io.RawIOBase.close(self)


class DigestingFileSystem(FileSystem):
    """DCP's local filesystem, whose written streams are digested on the way: `digests[file name]` is each
    file's checksum record once its stream closed without an error (`algorithm`: mgpu.state.files.digest's).
    `zip_crc32`: torch.save into a digested stream computes its zip CRC32s as well (False: it does not).
    `direct`: written with O_DIRECT where the filesystem takes it (mgpu.state.files.direct_io). It fsyncs nothing: the
    caller fsyncs each file once, after its close (mgpu.state.sharded.checkpointer). `gate`: the state is still being
    copied (mgpu.state.sharded.staging.PipelinedStager): an O_DIRECT stream waits per buffer before it reads one, a
    stream through the page cache waits for the whole copy before it opens; an O_DIRECT stream writes what the gate
    `holds` in place, every item from a page-aligned offset (ItemAlignedStream)."""

    def __init__(self, digests: dict[str, dict[str, Any]], algorithm: str = "crc32", zip_crc32: bool = False,
                 direct: bool = True, gate: Gate | None = None) -> None:
        super().__init__()
        self.digests, self.algorithm, self.zip_crc32, self.direct = digests, algorithm, zip_crc32, direct
        self.gate = gate

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        in_place = self.gate.holds if self.gate is not None else False
        direct = open_direct(Path(path), self.algorithm, in_place=in_place, gate=self.gate) if self.direct else None
        if direct is not None:
            try:
                with without_zip_crc32(not self.zip_crc32):
                    yield ItemAlignedStream(direct) if self.gate is not None else direct
            finally:
                align_next_saves(False)  # (what AligningPlanner said of the last tensor ends with its file)
                direct.close()  # its last block (made durable with the rest by the caller's fsync)
            self.digests[Path(path).name] = direct.digest.entry()
            return
        if self.gate is not None:
            self.gate.wait_all()
        with super().create_stream(path, mode) as raw:
            digesting = DigestingFile(WritebackFile(raw), self.algorithm)  # (mgpu.state.files.writeback)
            try:
                with without_zip_crc32(not self.zip_crc32):
                    yield digesting
            finally:
                digesting.close()  # its digest thread; DCP may have closed it already
            self.digests[Path(path).name] = digesting.digest.entry()
