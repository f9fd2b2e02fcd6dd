"""Rank 0's module buffers at every step's end, kept in its node's memory: what a restarted rank 0 needs when it died
before the next step's forward, where DDP broadcasts them to the other ranks (mgpu.state.memory.step_mark).

Under DDP a checkpoint holds rank 0's buffers (batch norm's running statistics: each rank's own forward changes its
copy, and DDP gives every rank rank 0's at the next forward). A survivor's save holds them once that broadcast
happened; before it, only rank 0 had them. So rank 0 keeps them at every step's end (`offer`) in two slots,
`<job dir>/rank0-buffers/slot{0,1}.bin`, written in turn, the older one overwritten.

It runs at every step, so it is kept to a memory copy: each slot is a file in /dev/shm, mapped, holding a 24-byte
head (magic, CRC-32, length, step), a JSON line (the snapshots' identity, each tensor's key, dtype and shape) and the
tensors' bytes, each tensor's place a tensor over the mapping. A step's record clears the head, copies each buffer
into its place, then writes the head (the commit); a slot whose head does not match what follows it (a rank killed
mid-copy) is not believed, and the other slot still holds the step before. No file opened at a step, no `torch.save`, no
thread on a CPU: a record costs microseconds (with SnapshotStore's write, a thread's 300 us of CPU a step and the GIL:
bench/failure_overhead.py). From a GPU the copy goes to pinned host memory without waiting and a thread copies it
into the slot once the copy's event has completed. Only where a DDP module has buffers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import struct
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mgpu.state.files.digest import crc32  # zlib's CRC-32, by zlib-ng where installed (6x as fast)
from mgpu.state.memory.store import SLOTS, SnapshotStore

__all__ = ["BufferRecord"]

log = logging.getLogger("mgpu.train")

MAGIC = b"MGB2"
HEAD = struct.Struct("<4sIQq")
"""A slot's head: MAGIC, the CRC-32 (of the step, then what follows the head), that length, the step."""
STEP = struct.Struct("<q")


class BufferRecord:
    """Rank 0's buffers by step beside `store`'s snapshots, with its identity (see the module's docstring)."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self.directory = store.directory
        self._identity = asdict(store.identity)
        self._slots: list[_Slot | None] = [None] * SLOTS
        self._layout: list[Any] | None = None
        self._next = 0
        self._failed = False
        # From a GPU: two sets of pinned host buffers, allocated once (cudaHostAlloc takes milliseconds: per step it
        # cost 3.3 ms for 100 buffers on an H200), one the thread may be writing, the other filled.
        self._pinned: list[dict[tuple[str, str], Any]] = [{}, {}]
        self._pending: tuple[int, dict[str, dict[str, Any]], Any] | None = None
        self._writing: int | None = None
        self._filled = 0
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    def offer(self, step: int, buffers: dict[str, dict[str, Any]]) -> bool:
        """Step `step`'s buffers ({state key: {buffer name: tensor}}): written now from the CPU; from a GPU, copied to
        pinned host memory without waiting and written by the thread (a newer offer replaces one not yet written).
        Whether they were written now (`read(step)` gives them back)."""
        if not any(tensor.is_cuda for tensors in buffers.values() for tensor in tensors.values()):
            return self._write(step, buffers)
        import torch

        with self._cond:
            self._pending = None  # replaced by this one: the thread never takes a set while it is being filled
            index = 1 - self._writing if self._writing is not None else 1 - self._filled
        pinned = self._pinned[index]
        copies: dict[str, dict[str, Any]] = {}
        for name, tensors in buffers.items():
            copies[name] = {}
            for key, tensor in tensors.items():
                host = pinned.get((name, key))
                if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
                    host = pinned[(name, key)] = torch.empty_like(tensor, device="cpu", pin_memory=True)
                host.copy_(tensor.detach(), non_blocking=True)
                copies[name][key] = host
        event = torch.cuda.Event()
        event.record()
        with self._cond:
            self._pending, self._filled = (step, copies, event), index
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mgpu-buffer-record", daemon=True)
                self._thread.start()
            self._cond.notify()
        return False

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._pending is None:
                    return
                step, copies, event = self._pending
                self._pending, self._writing = None, self._filled
            try:
                event.synchronize()
                self._write(step, copies)
            finally:
                with self._cond:
                    self._writing = None

    def _write(self, step: int, buffers: dict[str, dict[str, Any]]) -> bool:
        try:
            layout = [(name, key, tensor.dtype, tuple(tensor.shape)) for name, tensors in buffers.items()
                      for key, tensor in tensors.items()]
            if layout != self._layout:  # the first write, or a buffer reshaped: each slot mapped anew when written
                self._close_slots()
                self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
                # The first write goes over the older (or an empty) slot: the newer stays whole meanwhile.
                self._next = min(range(SLOTS), key=lambda slot: _step_of(self._path(slot), self._identity))
                self._layout = layout
            index, self._next = self._next, (self._next + 1) % SLOTS
            slot = self._slots[index]
            if slot is None:
                slot = self._slots[index] = _Slot(self._path(index), self._identity, layout)
            slot.write(step, [tensor for tensors in buffers.values() for tensor in tensors.values()])
        except (OSError, ValueError, RuntimeError) as error:  # the record helps a restart; its loss never ends the run
            if not self._failed:
                self._failed = True
                log.warning("rank 0's buffers could not be kept in memory (a restarted rank 0 falls back to the "
                            "snapshots or the durable checkpoint): %s: %s", type(error).__name__, error)
            return False
        return True

    def _close_slots(self) -> None:
        for slot in self._slots:
            if slot is not None:
                slot.close()
        self._slots = [None] * SLOTS

    def _path(self, slot: int) -> Path:
        return self.directory / f"slot{slot}.bin"

    def steps(self) -> list[int]:
        """The steps whose buffers a slot holds whole, with this record's identity, newest first."""
        steps = [_step_of(self._path(slot), self._identity) for slot in range(SLOTS)]
        return sorted((step for step in steps if step >= 0), reverse=True)

    def read(self, step: int) -> dict[str, dict[str, Any]]:
        """Step `step`'s buffers ({state key: {buffer name: tensor}}); FileNotFoundError where none is kept."""
        for slot in range(SLOTS):
            found = _read(self._path(slot), self._identity)
            if found is not None and found[0] == step:
                return _tensors(found[1], found[2])
        raise FileNotFoundError(f"{self.directory}: no record of rank 0's buffers at step {step}")

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(5.0)
        self._close_slots()


class _Slot:
    """One slot's file, mapped: its head, the JSON line of `layout` and the tensors' bytes, each tensor's place
    a tensor over the mapping (a step's write is one copy into each)."""

    def __init__(self, path: Path, identity: dict[str, Any],
                 layout: list[tuple[str, str, Any, tuple[int, ...]]]) -> None:
        import math

        import torch

        self.layout = layout
        line = json.dumps({"identity": identity, "tensors": [[name, key, str(dtype).removeprefix("torch."), list(shape)]
                                                             for name, key, dtype, shape in layout]}).encode() + b"\n"
        sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for _, _, dtype, shape in layout]
        self.length = len(line) + sum(sizes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, bytes(HEAD.size), 0)  # uncommitted before anything else changes
            os.ftruncate(fd, HEAD.size + self.length)
            self.map = mmap.mmap(fd, HEAD.size + self.length)
        finally:
            os.close(fd)
        self.map[HEAD.size:HEAD.size + len(line)] = line
        self.places: list[Any] = []  # a tensor over the mapping per non-empty buffer
        self.filled: list[int] | None = None
        """The indices of the non-empty buffers among the layout's (None: all of them)."""
        offset = HEAD.size + len(line)
        for (_, _, dtype, shape), size in zip(layout, sizes):
            if size:
                self.places.append(torch.frombuffer(self.map, dtype=torch.uint8, count=size, offset=offset)
                                   .view(dtype).view(shape))
            offset += size
        if len(self.places) < len(layout):
            self.filled = [index for index, size in enumerate(sizes) if size]
        self._copy = torch._foreach_copy_
        self._grad_enabled, self._set_grad_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled

    def write(self, step: int, tensors: list[Any]) -> None:
        HEAD.pack_into(self.map, 0, bytes(4), 0, 0, 0)  # uncommitted first: a torn slot is never believed
        if self.filled is not None:
            tensors = [tensors[index] for index in self.filled]
        if self.places:
            # One call for all (a copy_ each cost ~8 us at a step's end), its data alone (no graph on the slot):
            # grad mode off as torch.no_grad sets it, without its Python context manager (~20 us at a step's end).
            enabled = self._grad_enabled()
            self._set_grad_enabled(False)
            try:
                self._copy(self.places, tensors)
            finally:
                self._set_grad_enabled(enabled)
        body = memoryview(self.map)[HEAD.size:HEAD.size + self.length]
        crc = crc32(body, crc32(STEP.pack(step)))
        body.release()
        HEAD.pack_into(self.map, 0, MAGIC, crc, self.length, step)  # the commit: last

    def close(self) -> None:
        self.places = []
        with contextlib.suppress(BufferError):  # a tensor over it still alive elsewhere: the mapping goes with it
            self.map.close()


def _read(path: Path, identity: dict[str, Any]) -> tuple[int, dict[str, Any], bytes] | None:
    """(its step, its JSON line, the bytes after it) of a whole slot with `identity`; None for any other."""
    try:
        content = path.read_bytes()
    except OSError:
        return None
    if len(content) < HEAD.size:
        return None
    magic, crc, length, step = HEAD.unpack_from(content)
    body = content[HEAD.size:HEAD.size + length]
    if magic != MAGIC or len(body) != length or crc32(body, crc32(STEP.pack(step))) != crc:
        return None
    line, _, data = body.partition(b"\n")
    try:
        header = json.loads(line)
    except ValueError:
        return None
    if not isinstance(header, dict) or header.get("identity") != identity:
        return None
    return step, header, data


def _step_of(path: Path, identity: dict[str, Any]) -> int:
    found = _read(path, identity)
    return found[0] if found is not None else -1


def _tensors(header: dict[str, Any], data: bytes) -> dict[str, dict[str, Any]]:
    import math

    import torch

    buffers: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, key, dtype, shape in header["tensors"]:
        kind = getattr(torch, dtype)
        size = math.prod(shape) * torch.empty((), dtype=kind).element_size()
        flat = torch.frombuffer(bytearray(data[offset:offset + size]), dtype=kind) if size else \
            torch.empty(0, dtype=kind)
        buffers.setdefault(name, {})[key] = flat.reshape(shape)
        offset += size
    return buffers
