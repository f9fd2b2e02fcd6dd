"""Checksums of checkpoint files, computed while they are written: no second read, and no second pass in the
writing thread. No torch.

A file's checksum is one value per fixed-size chunk (`CHUNK_BYTES`, the last one shorter), recorded as
`{"algorithm": "crc32", "chunk_bytes": N, "values": [...]}` beside its size. `crc32` (zlib's CRC-32, computed by
zlib-ng where installed: 21 GB/s on one core of the CI machine, against 6.8 GB/s for zlib's own, the same values;
`crc32` below) is the default: with the size it catches a torn file (short, or a tail of
zeros or of an older file's bytes) and any accidental change (every burst of up to 32 bits, all 1- and 2-bit
errors, any other with probability 1 - 2^-32 per chunk). It does not resist a deliberate forger; neither did the
sha256 before it, stored unsigned beside the file it covers. `sha256` (per chunk) can be chosen
(mgpu.state.single.store.DIGEST). A large write is digested in a second thread while the writing thread copies it out
(both release the GIL), so the digest costs no wall time while it is faster than the write.
"""

from __future__ import annotations

import hashlib
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

try:
    # zlib-ng's CRC-32 (carry-less multiplication, PCLMULQDQ/VPCLMULQDQ): zlib's values at 3x its speed, the GIL
    # released. It halves the writer's CPU per byte, and at zlib's 6.8 GB/s the digest thread would cap a save on
    # a faster disk (docs/benchmarks.md). Without the wheel (a platform it lacks), zlib's: the same checksums.
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover  (the package is a dependency; this is the platform without its wheel)
    from zlib import crc32

__all__ = ["ALGORITHMS", "CHUNK_BYTES", "ChunkDigest", "DigestingFile", "crc32", "digest_bytes", "digest_file",
           "mismatch"]

ALGORITHMS = ("crc32", "sha256")
CHUNK_BYTES = 64 << 20
_THREADED = 1 << 20  # writes from this size on are digested in a second thread while they are written
_READ = 1 << 20
"""A verification's read: its bytes count as the resume's progress when the read returns (mgpu.stop.phase_progress),
so it returns often on a slow filesystem (8 MiB took 4 s at 2 MB/s, past a 2 s allowance); the kernel's readahead
keeps the device's requests large."""


class ChunkDigest:
    """The running per-chunk digest of a byte stream fed in order."""

    def __init__(self, algorithm: str = "crc32", chunk_bytes: int = CHUNK_BYTES) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown checksum algorithm {algorithm!r} (one of {', '.join(ALGORITHMS)})")
        self.algorithm, self.chunk_bytes = algorithm, chunk_bytes
        self.values: list[str] = []
        self._filled = 0  # bytes in the current chunk
        self._crc = 0
        self._sha = hashlib.sha256() if algorithm == "sha256" else None

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view:
            piece = view[:self.chunk_bytes - self._filled]
            if self._sha is not None:
                self._sha.update(piece)
            else:
                self._crc = crc32(piece, self._crc)
            self._filled += len(piece)
            view = view[len(piece):]
            if self._filled == self.chunk_bytes:
                self._close_chunk()

    def _close_chunk(self) -> None:
        if self._sha is not None:
            self.values.append(self._sha.hexdigest())
            self._sha = hashlib.sha256()
        else:
            self.values.append(f"{self._crc:08x}")
            self._crc = 0
        self._filled = 0

    def entry(self) -> dict[str, Any]:
        """The record for meta.json / a manifest (the partial last chunk included; call once, at the end)."""
        if self._filled:
            self._close_chunk()
        return {"algorithm": self.algorithm, "chunk_bytes": self.chunk_bytes, "values": list(self.values)}


def digest_bytes(data: Any, algorithm: str = "crc32", chunk_bytes: int = CHUNK_BYTES) -> dict[str, Any]:
    digest = ChunkDigest(algorithm, chunk_bytes)
    digest.update(data)
    return digest.entry()


def digest_file(path: Path, algorithm: str = "crc32", chunk_bytes: int = CHUNK_BYTES) -> dict[str, Any]:
    """The record of a file on disk (a verification: one sequential read)."""
    digest = ChunkDigest(algorithm, chunk_bytes)
    buffer = bytearray(_READ)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(buffer):
            digest.update(view[:count])
    return digest.entry()


def mismatch(path: Path, recorded: Any) -> str | None:
    """Why `path` does not match its `recorded` checksum (None: it matches); reads the file once."""
    if not (isinstance(recorded, dict) and recorded.get("algorithm") in ALGORITHMS
            and isinstance(recorded.get("chunk_bytes"), int) and recorded["chunk_bytes"] > 0
            and isinstance(recorded.get("values"), list)):
        return f"{path}'s recorded checksum is malformed"
    actual = digest_file(path, recorded["algorithm"], recorded["chunk_bytes"])["values"]
    if actual == recorded["values"]:
        return None
    bad = next((i for i, (a, b) in enumerate(zip(actual, recorded["values"])) if a != b),
               min(len(actual), len(recorded["values"])))
    return (f"{path} does not match its {recorded['algorithm']} checksum from byte "
            f"{bad * recorded['chunk_bytes']} on (corrupted)")


class DigestingFile(io.RawIOBase):
    """A write-only file that digests what passes through it: a large write is digested in a second thread
    while this one writes it (the caller's buffer stays valid: write() returns after both). Keeps the first
    OSError of the file below (torch's zip writer swallows it into 'unexpected pos', naming neither errno nor
    file). `file`: a buffered binary file (its write takes all of a buffer or raises)."""

    def __init__(self, file: Any, algorithm: str = "crc32", chunk_bytes: int = CHUNK_BYTES) -> None:
        super().__init__()
        self.file, self.digest = file, ChunkDigest(algorithm, chunk_bytes)
        self.error: OSError | None = None
        self._helper: ThreadPoolExecutor | None = None  # created by the writing thread: its priority

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        pending = None
        if len(view) >= _THREADED:
            if self._helper is None:
                self._helper = ThreadPoolExecutor(1, thread_name_prefix="mgpu-digest")
            pending = self._helper.submit(self.digest.update, view)
        try:
            self.file.write(view)
        except OSError as error:
            self.error = self.error or error
            raise
        finally:
            if pending is not None:
                pending.result()
        if pending is None:
            self.digest.update(view)
        return len(view)

    def tell(self) -> int:
        return self.file.tell()

    def fileno(self) -> int:
        return self.file.fileno()

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as error:
            self.error = self.error or error
            raise

    def close(self) -> None:
        if self._helper is not None:
            self._helper.shutdown()
            self._helper = None
        if not self.closed:
            try:
                self.flush()
            finally:
                super().close()
