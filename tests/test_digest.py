"""mgpu.state.files.digest: per-chunk checksums computed while writing equal those of the file read back, whatever the
write sizes; damage is found and located."""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest

from mgpu.state.files.digest import ChunkDigest, DigestingFile, digest_bytes, digest_file, mismatch


@pytest.mark.parametrize("algorithm", ["crc32", "sha256"])
def test_digesting_while_writing_equals_reading_back_for_any_write_sizes(algorithm: str, tmp_path: Path) -> None:
    data = os.urandom((3 << 20) + 200_000)  # the last chunk a short one
    sizes = [1, 7, 100_000, 2 << 20, 5, (1 << 20) - 3]  # small ones inline, the 2 MiB one in the second thread
    path = tmp_path / "f"
    with open(path, "wb") as file:
        digesting = DigestingFile(file, algorithm, chunk_bytes=1 << 20)
        at = 0
        for size in sizes:
            assert digesting.write(memoryview(data)[at:at + size]) == len(data[at:at + size])
            at += size
        digesting.close()
        assert not file.closed  # the caller fsyncs and closes its own file
    written = path.read_bytes()
    entry = digesting.digest.entry()
    assert entry == digest_file(path, algorithm, 1 << 20) == digest_bytes(written, algorithm, 1 << 20)
    assert len(entry["values"]) == -(-len(written) // (1 << 20))
    if algorithm == "crc32":
        assert entry["values"][0] == f"{zlib.crc32(written[:1 << 20]):08x}"
    else:
        assert entry["values"][-1] == hashlib.sha256(written[((len(written) - 1) >> 20) << 20:]).hexdigest()


def test_a_large_write_is_digested_in_another_thread_while_it_is_written(tmp_path: Path) -> None:
    seen: list[str] = []
    real = ChunkDigest.update

    def update(self: ChunkDigest, data: Any) -> None:
        seen.append(threading.current_thread().name)
        real(self, data)

    ChunkDigest.update = update  # type: ignore[method-assign]
    try:
        with open(tmp_path / "f", "wb") as file:
            digesting = DigestingFile(file)
            digesting.write(b"x" * 10)
            digesting.write(b"y" * (4 << 20))
            digesting.close()
    finally:
        ChunkDigest.update = real  # type: ignore[method-assign]
    assert seen[0] == threading.current_thread().name and seen[1].startswith("mgpu-digest")


def test_damage_is_found_and_located(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(5000))
    recorded = digest_file(path, "crc32", 1000)
    assert mismatch(path, recorded) is None
    data = bytearray(path.read_bytes())
    data[3500] ^= 1
    path.write_bytes(bytes(data))
    assert mismatch(path, recorded) == f"{path} does not match its crc32 checksum from byte 3000 on (corrupted)"
    path.write_bytes(bytes(data[:2000]))  # torn: the chunks after the tear are missing
    assert "from byte 2000 on" in str(mismatch(path, digest_file(path, "crc32", 1000) | {"values": recorded["values"]}))
    assert mismatch(path, {"algorithm": "md4"}) == f"{path}'s recorded checksum is malformed"


def test_an_unknown_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        ChunkDigest("md5")


def test_the_crc32_is_zlib_ngs_with_zlibs_values_chained_across_pieces() -> None:
    """The digest's CRC-32 comes from zlib-ng (a dependency: 3x zlib's speed, docs/benchmarks.md), and a file
    saved with either verifies with the other: the same values, chained across pieces of any size."""
    from zlib_ng import zlib_ng

    from mgpu.state.files import digest

    assert digest.crc32 is zlib_ng.crc32
    data = memoryview(bytearray(os.urandom((2 << 20) + 12_345)))
    crc = 0
    for at, size in ((0, 1), (1, 4095), (4096, 1 << 20), ((1 << 20) + 4096, len(data))):
        crc = digest.crc32(data[at:at + size], crc)
    assert crc == zlib.crc32(data)
    assert digest_bytes(data, "crc32", 1 << 20)["values"][0] == f"{zlib.crc32(data[:1 << 20]):08x}"
