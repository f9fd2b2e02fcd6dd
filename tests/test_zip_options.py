"""torch.save without its zip CRC32s in one thread only (mgpu.state.files.zip_options): every other thread's torch.save,
and this thread's outside the block, keeps them; what is written so loads back the same."""

from __future__ import annotations

import io
from pathlib import Path
import threading
import zipfile
import zlib

import torch

from mgpu.state.files.zip_options import PAGE, available, page_aligned_storages, without_zip_crc32


def _saved(value: object) -> bytes:
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


def _data_offsets(data: bytes) -> dict[str, int]:
    """Where each storage record's bytes start in the archive (its local header: 30 bytes, name, extra field)."""
    offsets = {}
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            if "/data/" in info.filename:
                start = info.header_offset
                name_len, extra_len = int.from_bytes(data[start + 26:start + 28], "little"), int.from_bytes(
                    data[start + 28:start + 30], "little")
                offsets[info.filename] = start + 30 + name_len + extra_len
    return offsets


def test_only_the_blocks_own_thread_aligns_storages_to_a_page() -> None:
    values = {"a": torch.arange(1001, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int8),
              "c": torch.randn(4097)}
    inside, entered, other_done = {}, threading.Event(), threading.Event()

    def other_thread() -> None:
        entered.wait(10)
        inside["other"] = _saved(values)
        other_done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with page_aligned_storages():
        entered.set()
        assert other_done.wait(10)
        inside["own"] = _saved(values)
    thread.join()
    own, other = _data_offsets(inside["own"]), _data_offsets(inside["other"])
    assert len(own) == 3 and all(offset % PAGE == 0 for offset in own.values()), own
    assert any(offset % PAGE for offset in other.values()), other  # torch's 64 bytes
    loaded = torch.load(io.BytesIO(inside["own"]), weights_only=True, mmap=False)
    assert all(torch.equal(loaded[key], value) for key, value in values.items())


def test_a_checkpoint_pads_its_storages_to_pages_only_when_it_holds_a_tensor_written_in_place(tmp_path: Path) -> None:
    # Issue 46: every record of every state.pt was padded to 4 KiB (a test task's checkpoint: 17.7 kB -> 162 kB),
    # though only a tensor of IN_PLACE_BYTES or more is ever written from where it is.
    from mgpu.state.single.store import CheckpointStore
    from mgpu.state.files.direct_io import IN_PLACE_BYTES

    small = {f"layer{i}": {"weight": torch.randn(16, 8), "bias": torch.randn(16)} for i in range(20)}
    big = {**small, "embedding": torch.randn(IN_PLACE_BYTES // 4)}
    store = CheckpointStore(tmp_path / "checkpoints")
    sizes = {}
    for step, state in ((1, small), (2, big)):
        saved = store.save(state, step)
        data = (saved.path / "state.pt").read_bytes()
        offsets = _data_offsets(data)
        sizes[step] = len(data)
        assert len(offsets) == len(state) * 2 - (step == 2)
        if step == 1:
            assert any(offset % PAGE for offset in offsets.values()), offsets  # torch's 64 bytes
        else:
            assert all(offset % PAGE == 0 for offset in offsets.values()), offsets
        loaded = torch.load(saved.path / "state.pt", weights_only=True)
        assert torch.equal(loaded["layer3"]["weight"], state["layer3"]["weight"])
    store.close()
    payload = sum(t.numel() * 4 for layer in small.values() for t in layer.values())
    # Each of the 40 records: its headers (local and central, ~150 bytes) and up to 64 bytes of padding, not 4 KiB.
    assert sizes[1] < payload + 40 * 256 + 4096 < 40 * PAGE, sizes
