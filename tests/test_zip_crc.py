"""torch.save without its zip CRC32s in one thread only (mgpu.state.zip_crc): every other thread's torch.save,
and this thread's outside the block, keeps them; what is written so loads back the same."""

from __future__ import annotations

import io
import threading
import zipfile
import zlib

import torch

from mgpu.state.zip_crc import available, without_zip_crc32


def _saved(value: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _crcs(data: bytes) -> dict[str, int]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return {info.filename.split("/", 1)[1]: info.CRC for info in archive.infolist()}


def _true_crcs(data: bytes) -> dict[str, int]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return {info.filename.split("/", 1)[1]: zlib.crc32(archive.read(info)) for info in archive.infolist()}


def test_only_the_blocks_own_thread_writes_no_crc32() -> None:
    assert available()
    value = torch.arange(1000, dtype=torch.float32)
    inside, entered, other_done = {}, threading.Event(), threading.Event()

    def other_thread() -> None:
        entered.wait(10)
        inside["other"] = _saved(value)  # while the main thread is inside the block
        other_done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with without_zip_crc32():
        with without_zip_crc32():  # nested: still off after the inner block ends
            pass
        entered.set()
        assert other_done.wait(10)
        inside["own"] = _saved(value)
    thread.join()
    after = _saved(value)

    assert set(_crcs(inside["own"]).values()) == {0}
    assert _crcs(inside["other"]) == _true_crcs(inside["other"]) and any(_crcs(inside["other"]).values())
    assert _crcs(after) == _true_crcs(after) and any(_crcs(after).values())
    assert torch.equal(torch.load(io.BytesIO(inside["own"]), weights_only=True), value)


def test_disabled_it_changes_nothing() -> None:
    with without_zip_crc32(enabled=False):
        data = _saved(torch.ones(10))
    assert _crcs(data) == _true_crcs(data) and any(_crcs(data).values())
