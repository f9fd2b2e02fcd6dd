"""Early writeback (mgpu.state.files.writeback): the file's bytes are the same, writeback is started for every step's
worth of bytes written (a large write passed down in pieces), and a filesystem that refuses it is written as
without it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import mgpu.state.files.writeback as writeback
from mgpu.state.files.writeback import WritebackFile


def _write(path: Path, pieces: list[bytes], step: int) -> None:
    with open(path, "wb") as file:
        wrapped = WritebackFile(file, step=step)
        for piece in pieces:
            assert wrapped.write(piece) == len(piece)
        wrapped.flush()
        assert wrapped.tell() == sum(map(len, pieces)) and wrapped.fileno() == file.fileno()
        os.fsync(wrapped.fileno())


def test_the_bytes_are_the_same_and_writeback_follows_the_writes(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []
    real = writeback._SYNC_FILE_RANGE
    assert real is not None  # Linux: the call exists

    def recording(fd: int, offset: int, length: int, flags: int) -> int:
        calls.append((offset, length, flags))
        return real(fd, offset, length, flags)

    monkeypatch.setattr(writeback, "_SYNC_FILE_RANGE", recording)
    pieces = [os.urandom(n) for n in (10, 5000, 300_000, 7, 1 << 20)]
    _write(tmp_path / "f", pieces, step=64 << 10)
    assert (tmp_path / "f").read_bytes() == b"".join(pieces)
    assert calls and all(flags == 2 for _, _, flags in calls)
    assert [offset for offset, _, _ in calls] == [0] + [o + n for o, n, _ in calls[:-1]]  # contiguous ranges
    assert all(length >= 64 << 10 for _, length, _ in calls)
    assert calls[-1][0] + calls[-1][1] > len(b"".join(pieces)) - (64 << 10)  # the 1 MiB write in pieces too


def test_a_refused_writeback_leaves_a_plain_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(writeback, "_SYNC_FILE_RANGE", lambda *args: calls.append(args) or -1)
    pieces = [os.urandom(200_000) for _ in range(5)]
    _write(tmp_path / "f", pieces, step=64 << 10)
    assert (tmp_path / "f").read_bytes() == b"".join(pieces) and len(calls) == 1  # tried once, then not again


def test_a_file_without_a_descriptor_is_written_through() -> None:
    import io

    buffer = io.BytesIO()
    wrapped = WritebackFile(buffer, step=4)
    assert wrapped.write(b"0123456789") == 10 and buffer.getvalue() == b"0123456789"
