"""mgpu.state.files.direct_io: checkpoint files written with O_DIRECT hold exactly the bytes written, carry the same
checksum as a buffered write, raise the writes' errors, and leave nothing in the page cache."""

from __future__ import annotations

import ctypes
import json
import errno
import mmap
import os
import random
import threading
import time
from pathlib import Path
from typing import Any
import pytest
import torch

from mgpu.state.single import store as checkpoint_module
from mgpu.state.single.store import CheckpointStore
from mgpu.state.files.digest import digest_bytes
from mgpu.state.files.direct_io import (ALIGN, BUFFER_BYTES, IN_PLACE_BYTES, DirectFile, _address, aligned_buffer,
                                        open_direct)

_SMALL = 4 * ALIGN  # buffers of 16 KiB: a few bytes span several of them


def _direct(path: Path) -> DirectFile:
    file = open_direct(path)
    if file is None:
        pytest.skip(f"{path.parent}'s filesystem refuses O_DIRECT")
    return file


@pytest.mark.parametrize("size", [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, _SMALL, 3 * _SMALL + 13])
def test_the_file_holds_the_bytes_written_and_their_checksum(size: int, tmp_path: Path) -> None:
    data = random.Random(size).randbytes(size + 3)[3:]  # from an unaligned address
    path = tmp_path / "state.pt"
    opened = _direct(path)
    file = DirectFile(os.dup(opened.fd), buffer_bytes=_SMALL)
    opened.close()
    pieces = random.Random(1)
    at = 0
    while at < size:  # writes of every size, across the buffers' edges
        count = min(size - at, pieces.choice([1, 7, ALIGN - 3, ALIGN, _SMALL + 5]))
        assert file.write(memoryview(data)[at:at + count]) == count
        at += count
        assert file.tell() == at
    file.close()
    assert path.read_bytes() == data
    assert file.digest.entry() == digest_bytes(data)


class _Refused(Exception):
    pass


def test_a_write_refused_below_is_raised_as_itself_and_the_file_closed(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    file = _direct(tmp_path / "state.pt")
    fd = file.fd
    monkeypatch.setattr(DirectFile, "_pwrite", lambda self, data, offset: (_ for _ in ()).throw(
        OSError(errno.EIO, os.strerror(errno.EIO))))
    with pytest.raises(OSError) as raised:
        for _ in range(4):  # a full buffer is written in the other thread: the error comes at a later call
            file.write(bytes(BUFFER_BYTES))
        file.close()
    assert raised.value.errno == errno.EIO
    with pytest.raises(OSError, match="Input/output error"):
        file.close()  # the close too: nothing written after a failed write counts
    assert file.closed
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)  # closed, not leaked


def test_a_filesystem_that_refuses_o_direct_is_written_through_the_page_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal is faked (os.open answers EINVAL to O_DIRECT, as a filesystem without it does: tmpfs before Linux
    6.6, some network filesystems); this machine's filesystems all take it."""
    real_open = os.open

    def refusing_open(path: object, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    assert open_direct(tmp_path / "probe") is None
    store = CheckpointStore(tmp_path / "ckpt")
    store.save({"w": torch.ones(1000)}, 1)
    loaded = store.latest()
    assert loaded is not None and torch.equal(loaded.state["w"], torch.ones(1000))


def test_a_filesystem_that_refuses_the_direct_writes_gets_them_through_the_page_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that opens with O_DIRECT and then answers EINVAL to every write made with it (faked): the
    flag is dropped and the file holds every byte, its checksum unchanged."""
    import fcntl

    def refusing(self: DirectFile, pieces: list[memoryview], offset: int) -> int:
        if fcntl.fcntl(self.fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return os.pwritev(self.fd, pieces, offset)

    monkeypatch.setattr(DirectFile, "_pwrite", refusing)
    data = random.Random(0).randbytes(3 * _SMALL + 5)
    opened = _direct(tmp_path / "state.pt")
    file = DirectFile(os.dup(opened.fd), buffer_bytes=_SMALL)
    opened.close()
    file.write(data)
    file.close()
    assert (tmp_path / "state.pt").read_bytes() == data
    assert file.digest.entry() == digest_bytes(data)


def _cached_pages(path: Path) -> int:
    """How many of `path`'s pages are in the page cache (mincore of a read-only mapping of it)."""
    from mgpu.state.files.direct_io import _address

    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vector = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    with open(path, "rb") as file, mmap.mmap(file.fileno(), size, prot=mmap.PROT_READ) as mapped:
        view = memoryview(mapped)
        try:
            assert libc.mincore(_address(view), size, vector) == 0, os.strerror(ctypes.get_errno())
        finally:
            view.release()
    return sum(byte & 1 for byte in vector)


@pytest.mark.parametrize("direct", [True, False])
def test_a_saved_checkpoint_leaves_the_page_cache_as_it_was(direct: bool, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """With O_DIRECT, the checkpoint's 32 MiB did not pass through the page cache (a dataset's cached files stay
    cached); the buffered write, the control, leaves them there, so the measurement can see them."""
    if open_direct(tmp_path / "probe") is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    monkeypatch.setattr(checkpoint_module, "DIRECT_IO", direct)
    state = {"w": torch.arange(8 << 20, dtype=torch.float32)}
    store = CheckpointStore(tmp_path / "ckpt")
    saved = store.save(state, 1)
    cached = _cached_pages(saved.path / "state.pt")
    pages = -(-saved.bytes // mmap.PAGESIZE)
    if direct:
        assert cached <= 2, f"{cached} of {pages} pages cached"  # the cut-back last block at most
    else:
        assert cached > pages // 2, f"only {cached} of {pages} pages cached: the control sees nothing"
    loaded = store.latest()  # its checksum verified on load
    assert loaded is not None and torch.equal(loaded.state["w"], state["w"])


def test_a_checkpoint_written_either_way_has_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same state saved with O_DIRECT and through the page cache: the same file, the same checksum."""
    state = {"w": torch.randn(300_001), "step": 3, "name": "x" * 5000}
    files = []
    for direct in (True, False):
        monkeypatch.setattr(checkpoint_module, "DIRECT_IO", direct)
        saved = CheckpointStore(tmp_path / f"ckpt-{direct}").save(state, 1)
        meta = json.loads((saved.path / "meta.json").read_text())
        files.append(((saved.path / "state.pt").read_bytes(), meta["checksum"], meta["bytes"]))
    assert files[0] == files[1]


def _huge_page_bytes(view: memoryview) -> int:
    """AnonHugePages of the mapping that holds `view`'s first byte (/proc/self/smaps), in bytes."""
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) << 10
    return 0


def test_the_write_buffers_are_huge_pages_where_the_system_grants_them() -> None:
    # The device takes each write in requests of at most max_segments contiguous pieces: from scattered 4 KiB
    # pages the CI machine's disk got ~0.5 MiB requests and wrote a GiB in 0.71 s, from 2 MiB pages 4 MiB
    # requests and 0.49 s. Python's mmap(-1, n) is shared memory, which never has huge pages here.
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("this kernel grants no transparent huge pages")
    mapping, view = aligned_buffer(BUFFER_BYTES)
    assert ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGN == 0 and len(view) == BUFFER_BYTES
    view[:] = bytes(len(view))  # (faulted in)
    assert _huge_page_bytes(view) >= BUFFER_BYTES // 2


def test_a_closed_files_buffers_serve_the_next_file(tmp_path: Path) -> None:
    # Faulting huge pages in is where a fragmented host compacts memory: once per process, not per checkpoint.
    from mgpu.state.files import direct_io

    first = _direct(tmp_path / "a")
    first.write(b"x" * 10)
    addresses = {ctypes.addressof(ctypes.c_char.from_buffer(view)) for view in first._buffers}
    first.close()
    second = _direct(tmp_path / "b")
    assert {ctypes.addressof(ctypes.c_char.from_buffer(view)) for view in second._buffers} == addresses
    files = [_direct(tmp_path / str(n)) for n in range(4)]  # more at once than are kept
    for file in [second, *files]:
        file.close()
    assert len(direct_io._spare[BUFFER_BYTES, direct_io.HUGE_PAGES]) == direct_io.SPARE_BUFFERS


def _writes_from(monkeypatch: pytest.MonkeyPatch, limit: int | None = None) -> list[int]:
    """The addresses of the pieces every write request reads from (each request cut to `limit` bytes: a short
    write the file must resume)."""
    addresses: list[int] = []

    def pwrite(self: DirectFile, pieces: list[memoryview], offset: int) -> int:
        addresses.extend(_address(piece) for piece in pieces)
        if limit is not None:
            pieces = [pieces[0][:limit]]
        return os.pwritev(self.fd, pieces, offset)

    monkeypatch.setattr(DirectFile, "_pwrite", pwrite)
    return addresses


@pytest.mark.parametrize("in_place", [True, False, "held", "not-held"])
def test_a_page_aligned_piece_is_written_from_the_callers_memory_only_if_it_stays_put(
        in_place: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    addresses = _writes_from(monkeypatch)
    _, big = aligned_buffer(IN_PLACE_BYTES + 3 * ALIGN)
    big[:] = random.Random(2).randbytes(len(big))
    head, tail = b"h" * (2 * ALIGN), b"t" * 100  # the aligned piece lands at an aligned offset, then more
    start = _address(big)
    # "held": the caller vouches for `big`'s memory alone (a snapshot's buffers); "not-held": for other memory only
    says = {"held": lambda address, nbytes: start <= address and address + nbytes <= start + len(big),
            "not-held": lambda address, nbytes: address >= start + len(big)}.get(in_place, in_place)
    opened = _direct(tmp_path / "state.pt")
    file = DirectFile(os.dup(opened.fd), buffer_bytes=4 * _SMALL, in_place=says)
    opened.close()
    for piece in (head, big, tail, big[1:ALIGN + 1]):  # the last: unaligned, copied either way
        file.write(piece)
    file.close()
    data = head + bytes(big) + tail + bytes(big[1:ALIGN + 1])
    assert (tmp_path / "state.pt").read_bytes() == data
    assert file.digest.entry() == digest_bytes(data)
    assert (start in addresses) == (in_place in (True, "held"))


@pytest.mark.parametrize("in_place", [False, True])
def test_copied_bytes_are_digested_by_the_copying_thread_piece_by_piece(in_place: bool, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Read back right after the copy, from the cache: not by a second thread once the buffer is full, from memory.
    # A file writing in place keeps its digest thread, and with it the bytes' order.
    from mgpu.state.files import digest, direct_io

    monkeypatch.setattr(direct_io, "DIGEST_PIECE", ALIGN)
    updates: list[tuple[str, int]] = []
    update = digest.ChunkDigest.update

    def recorded(self: digest.ChunkDigest, data: Any) -> None:
        updates.append((threading.current_thread().name, memoryview(data).nbytes))
        update(self, data)

    monkeypatch.setattr(digest.ChunkDigest, "update", recorded)
    _, big = aligned_buffer(IN_PLACE_BYTES)
    big[:] = random.Random(4).randbytes(len(big))
    data = random.Random(5).randbytes(3 * _SMALL + 5)
    opened = _direct(tmp_path / "state.pt")
    file = DirectFile(os.dup(opened.fd), buffer_bytes=_SMALL, in_place=in_place)
    opened.close()
    for piece in (data, big, data):
        file.write(piece)
    file.close()
    made = list(updates)  # (before this test's own digest below)
    assert (tmp_path / "state.pt").read_bytes() == data + bytes(big) + data
    assert file.digest.entry() == digest_bytes(data + bytes(big) + data)
    if in_place:
        assert made and all(name.startswith("mgpu-direct-digest") for name, _ in made)
    else:
        assert {name for name, _ in made} == {threading.current_thread().name}
        assert max(size for _, size in made) <= ALIGN


def test_a_short_write_resumes_where_it_stopped_across_the_pieces(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _writes_from(monkeypatch, limit=5000)  # (a plain file: unaligned resumptions are fine without O_DIRECT)
    _, big = aligned_buffer(IN_PLACE_BYTES)
    big[:] = random.Random(3).randbytes(len(big))
    fd = os.open(tmp_path / "state.pt", os.O_WRONLY | os.O_CREAT)
    file = DirectFile(fd, buffer_bytes=_SMALL, in_place=True)
    for piece in (b"x" * ALIGN, big, b"y" * 7):
        file.write(piece)
    file.close()
    assert (tmp_path / "state.pt").read_bytes() == b"x" * ALIGN + bytes(big) + b"y" * 7


def test_a_background_save_writes_its_snapshots_big_tensors_in_place(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    addresses = _writes_from(monkeypatch)
    from mgpu.state.single.host_copy import _page_aligned_empty

    big = _page_aligned_empty(torch.Size([IN_PLACE_BYTES // 4 * 3 + 5]), torch.float32).copy_(
        torch.randn(IN_PLACE_BYTES // 4 * 3 + 5))
    state = {"big": big, "small": torch.arange(7)}  # page-aligned itself: only the copy's ownership differs
    store = CheckpointStore(tmp_path / "checkpoints")
    store.save_async(state, 1)
    saved = store.wait()
    staged = store._spare[("big",)]  # the snapshot's buffer, kept for the next save
    assert staged.data_ptr() % ALIGN == 0 and staged.data_ptr() in addresses
    assert saved is not None
    loaded = torch.load(saved.path / "state.pt", weights_only=True)
    assert torch.equal(loaded["big"], state["big"]) and torch.equal(loaded["small"], state["small"])
    addresses.clear()
    store.save(state, 2)  # the caller's own tensors: copied, never written from where they are
    assert big.data_ptr() % ALIGN == 0 and addresses and big.data_ptr() not in addresses
    store.close()


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "copied-first"])
def test_a_background_saves_writer_starts_on_the_first_buffers_while_the_rest_are_copied(
        pipelined: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer waits per buffer for save_async's copy (mgpu.state.single.host_copy.CopyGate), not for the whole
    snapshot: the copy is held after the first tensor, and that tensor's bytes still reach the disk. Copied first
    (PIPELINED_SNAPSHOT off, the form before), nothing is written until the copy ends."""
    monkeypatch.setattr(checkpoint_module, "PIPELINED_SNAPSHOT", pipelined)
    addresses = _writes_from(monkeypatch)
    held, copied_first = threading.Event(), threading.Event()
    real_copy = checkpoint_module.copy_snapshot

    def copy_held(copies: list[tuple[torch.Tensor, torch.Tensor]], done: Any) -> None:
        real_copy(copies[:1], done)
        copied_first.set()
        assert held.wait(30)
        real_copy(copies[1:], lambda index: done(index + 1))

    monkeypatch.setattr(checkpoint_module, "copy_snapshot", copy_held)
    state = {name: torch.randn(IN_PLACE_BYTES // 4 * 2) for name in ("a", "b", "c")}  # 2 MiB each, in place
    store = CheckpointStore(tmp_path / "checkpoints")
    saving = threading.Thread(target=store.save_async, args=(state, 1))
    saving.start()
    try:
        assert copied_first.wait(30)
        deadline = time.monotonic() + (10 if pipelined else 2)
        while time.monotonic() < deadline and not addresses:
            time.sleep(0.01)
        assert bool(addresses) == pipelined, addresses  # the first tensor written while the others wait
    finally:
        held.set()
        saving.join(30)
    saved = store.wait()
    assert saved is not None
    loaded = torch.load(saved.path / "state.pt", weights_only=True)
    assert all(torch.equal(loaded[name], state[name]) for name in state)
    store.close()


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "copied-first"])
def test_each_snapshot_buffer_is_copied_once(pipelined: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint_module, "PIPELINED_SNAPSHOT", pipelined)
    real_copy, copied = checkpoint_module.copy_snapshot, []

    def counting(copies: list[tuple[torch.Tensor, torch.Tensor]], done: Any) -> None:
        copied.extend(kept.data_ptr() for kept, _ in copies)
        real_copy(copies, done)

    monkeypatch.setattr(checkpoint_module, "copy_snapshot", counting)
    state = {name: torch.randn(1024) for name in ("a", "b", "c")}
    store = CheckpointStore(tmp_path / "checkpoints")
    store.save_async(state, 1)
    assert store.wait() is not None
    assert len(copied) == len(set(copied)) == 3
    store.close()


def test_a_copy_that_fails_fails_its_save_and_the_next_one_is_written(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real_copy = checkpoint_module.copy_snapshot

    def broken(copies: list[tuple[torch.Tensor, torch.Tensor]], done: Any) -> None:
        real_copy(copies[:1], done)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    state = {name: torch.randn(IN_PLACE_BYTES // 4 * 2) for name in ("a", "b")}
    store = CheckpointStore(tmp_path / "checkpoints")
    outcomes: list[Any] = []
    monkeypatch.setattr(checkpoint_module, "copy_snapshot", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        store.save_async(state, 1, on_done=outcomes.append)
    monkeypatch.setattr(checkpoint_module, "copy_snapshot", real_copy)
    outcome = store.settle()  # a writer that had taken it failed at the buffer never filled; else never written
    assert outcome is None or isinstance(outcome, BaseException)
    assert all(isinstance(o, BaseException) for o in outcomes)
    assert store.list_steps() == []
    store.save_async(state, 2)
    saved = store.wait()
    assert saved is not None and store.list_steps() == [2]
    loaded = torch.load(saved.path / "state.pt", weights_only=True)
    assert all(torch.equal(loaded[name], state[name]) for name in state)
    store.close()


def test_the_copy_gate_holds_a_writer_per_buffer_and_passes_other_memory() -> None:
    from mgpu.state.single.host_copy import CopyGate

    buffers = [torch.zeros(1024), torch.zeros(2048)]
    gate = CopyGate([(buffer, buffer) for buffer in buffers])
    gate(12345, 8)  # no buffer's memory: passes
    address = buffers[1].data_ptr() + 100
    waiting = threading.Thread(target=gate, args=(address, 64))
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive()  # buffer 1 not filled
    gate.mark(0)
    waiting.join(0.2)
    assert waiting.is_alive()  # another buffer's mark does not let it through
    gate.mark(1)
    waiting.join(10)
    assert not waiting.is_alive()
    gate.fail(ValueError("copy failed"))
    with pytest.raises(RuntimeError, match="copy failed"):
        gate(buffers[0].data_ptr(), 4)
    with pytest.raises(RuntimeError, match="copy failed"):
        gate.wait_all()


def test_the_copy_gate_says_which_memory_is_its_buffers() -> None:
    from mgpu.state.single.host_copy import CopyGate

    buffers = [torch.zeros(1024), torch.zeros(2048)]
    gate = CopyGate([(buffer, buffer) for buffer in buffers])
    first, second = (buffer.data_ptr() for buffer in buffers)
    assert gate.holds(first, 4096) and gate.holds(second + 4, 8000) and gate.holds(second + 8188, 4)
    assert not gate.holds(second + 8188, 5)  # past the buffer's end
    assert not gate.holds(min(first, second) - 1, 1) and not gate.holds(12345, 8)


def test_a_save_that_cannot_map_its_buffers_leaks_no_descriptor_and_goes_through_the_page_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each save whose O_DIRECT buffers could not be mapped (ENOMEM) left its file's descriptor open (issue 42):
    a long run out of memory ran out of descriptors. Faked: the mapping fails."""
    _direct(tmp_path / "probe").close()  # this filesystem takes O_DIRECT

    def no_memory(size: int) -> tuple[mmap.mmap, memoryview]:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr("mgpu.state.files.direct_io.aligned_buffer", no_memory)
    monkeypatch.setattr("mgpu.state.files.direct_io._spare", {})  # no buffer left by an earlier file: each is mapped
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        assert open_direct(tmp_path / "state.pt") is None  # the caller writes through the page cache
    with pytest.raises(OSError, match="Cannot allocate memory"):
        DirectFile(os.open(tmp_path / "state.pt", os.O_WRONLY))  # the file owns its descriptor: closed on failure
    store = CheckpointStore(tmp_path / "ckpt")
    store.save({"w": torch.ones(1000)}, 1)
    assert len(os.listdir("/proc/self/fd")) == before
    loaded = store.latest()
    assert loaded is not None and torch.equal(loaded.state["w"], torch.ones(1000))
