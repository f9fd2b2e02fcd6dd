"""Rank 0's module buffers at every step's end, kept in its node's memory: what a restarted rank 0 needs when it died
before the next step's forward, where DDP broadcasts them to the other ranks (mgpu.state.memory.step_mark).

Under DDP a checkpoint holds rank 0's buffers (batch norm's running statistics: each rank's own forward changes its
copy, and DDP gives every rank rank 0's at the next forward). A survivor's save holds them once that broadcast
happened; before it, only rank 0 had them. So rank 0 copies them at every step's end (`offer`: a copy on the device,
microseconds for batch norm's) and a thread of its own writes the newest copy into two slots with commit records
(mgpu.state.memory.store.SnapshotStore, `<job dir>/rank0-buffers/`), the loop never waiting: from a GPU, once
the copy's event has completed. Only where a DDP module has buffers; nothing otherwise.
"""

from __future__ import annotations

import io
import logging
import threading
from typing import Any

from mgpu.state.memory.store import SnapshotStore

__all__ = ["BufferRecord"]

log = logging.getLogger("mgpu.train")


class BufferRecord:
    """Rank 0's buffers by step in `store` (see the module's docstring)."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self._pending: tuple[int, dict[str, dict[str, Any]], Any] | None = None
        # Two sets of pinned host buffers for a GPU's copies, allocated once (cudaHostAlloc takes milliseconds: per
        # step it cost 3.3 ms for 100 buffers on an H200): one the thread may be writing, the other filled.
        self._pinned: list[dict[tuple[str, str], Any]] = [{}, {}]
        self._writing: int | None = None
        self._filled = 0
        self._cond = threading.Condition()
        self._closing = False
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="mgpu-buffer-record", daemon=True)
        self._thread.start()

    def offer(self, step: int, buffers: dict[str, dict[str, Any]]) -> None:
        """Step `step`'s buffers ({state key: {buffer name: tensor}}), copied now (on their device; to pinned host
        memory without waiting, from a GPU) and written by the thread; a newer offer replaces one not yet written."""
        import torch

        event = None
        copies: dict[str, dict[str, Any]] = {}
        with self._cond:
            self._pending = None  # replaced by this one: the thread never takes a set while it is being filled
            index = 1 - self._writing if self._writing is not None else 1 - self._filled
        pinned = self._pinned[index]
        for name, tensors in buffers.items():
            copies[name] = {}
            for key, tensor in tensors.items():
                if tensor.is_cuda:
                    host = pinned.get((name, key))
                    if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
                        host = pinned[(name, key)] = torch.empty_like(tensor, device="cpu", pin_memory=True)
                    host.copy_(tensor.detach(), non_blocking=True)
                    copies[name][key] = host
                    event = event or torch.cuda.Event()
                else:
                    copies[name][key] = tensor.detach().clone()
        if event is not None:
            event.record()
        with self._cond:
            self._pending, self._filled = (step, copies, event), index
            self._cond.notify()

    def _run(self) -> None:
        from mgpu.state.single.store import save_state_file

        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._pending is None:
                    return
                step, copies, event = self._pending
                self._pending, self._writing = None, self._filled
            try:
                if event is not None:
                    event.synchronize()
                self.store.write(step, lambda file: save_state_file({"step": step, "buffers": copies}, file))
            except Exception as error:  # noqa: BLE001  # the record helps a restart; its loss never ends the run
                if not self._failed:
                    self._failed = True
                    log.warning("rank 0's buffers could not be kept in memory (a restarted rank 0 falls back to the "
                                "snapshots or the durable checkpoint): %s: %s", type(error).__name__, error)
            finally:
                with self._cond:
                    self._writing = None

    def steps(self) -> list[int]:
        return self.store.valid_steps()

    def read(self, step: int) -> dict[str, dict[str, Any]]:
        """Step `step`'s buffers ({state key: {buffer name: tensor}}); FileNotFoundError where none is kept."""
        import torch

        content = self.store.read(step, lambda file: torch.load(io.BytesIO(file.read()), weights_only=True))
        return dict(content["buffers"])

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(5.0)
