"""The checksums of a sharded save's files, computed while DCP writes them (mgpu.state.files.digest): a rank's manifest
then needs no second read of its shard. Which stream wrote which file is recorded by name. DCP's torch.save of each
tensor into such a stream writes no zip CRC32 (mgpu.state.files.zip_options: this thread only, while the stream is
open): the stream's own checksum covers the same bytes. The files are written past the page cache where the filesystem
takes it (mgpu.state.files.direct_io), as a single-file save's are."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Protocol

from torch.distributed.checkpoint.filesystem import FileSystem

from mgpu.state.files.digest import DigestingFile
from mgpu.state.files.direct_io import open_direct
from mgpu.state.files.writeback import WritebackFile
from mgpu.state.files.zip_options import without_zip_crc32

__all__ = ["DigestingFileSystem", "Gate"]


class Gate(Protocol):
    """What a stream waits on while the state it writes is still being copied."""

    def __call__(self, address: int, nbytes: int) -> None: ...

    def wait_all(self) -> None: ...


class DigestingFileSystem(FileSystem):
    """DCP's local filesystem, whose written streams are digested on the way: `digests[file name]` is each
    file's checksum record once its stream closed without an error (`algorithm`: mgpu.state.files.digest's).
    `zip_crc32`: torch.save into a digested stream computes its zip CRC32s as well (False: it does not).
    `direct`: written with O_DIRECT where the filesystem takes it (mgpu.state.files.direct_io). It fsyncs nothing: the
    caller fsyncs each file once, after its close (mgpu.state.sharded.checkpointer). `gate`: the state is still being
    copied (mgpu.state.sharded.staging.PipelinedStager): an O_DIRECT stream waits per buffer before it reads one, a
    stream through the page cache waits for the whole copy before it opens."""

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
        direct = open_direct(Path(path), self.algorithm, gate=self.gate) if self.direct else None
        if direct is not None:
            try:
                with without_zip_crc32(not self.zip_crc32):
                    yield direct
            finally:
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
