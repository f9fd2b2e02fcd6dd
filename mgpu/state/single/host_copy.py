"""The host copy a background save writes from: every tensor of a state copied to CPU memory (pinned where it comes
from a GPU, into buffers kept from the last copy), and that pinned memory given back to the system when freed. The
copy can be planned first and filled after (`plan_snapshot`, `copy_snapshot`), with a `CopyGate` that a writer of
the snapshot waits on per buffer: the write of the first tensors then starts while the rest are still copied."""

from __future__ import annotations

import bisect
import copy
import logging
import math
import threading
from typing import Any, Callable, TypeVar

import torch

from mgpu.state.files.direct_io import ALIGN, IN_PLACE_BYTES, aligned_buffer

__all__ = ["CopyGate", "copy_snapshot", "plan_snapshot", "release_pinned_cache", "snapshot_to_cpu"]

log = logging.getLogger("mgpu.state.single.store")

T = TypeVar("T")
Copy = tuple[torch.Tensor, torch.Tensor]
"""One buffer of a snapshot and the tensor it copies: (destination on the host, source)."""


def release_pinned_cache() -> None:
    """Give freed pinned (page-locked) host memory back to the system. Freeing the staging buffers only returns
    their blocks to torch's host caching allocator, which keeps them for reuse: the process would hold a full
    copy of the state anyway. Only once CUDA is initialised (nothing was pinned before); a torch without
    the call keeps its cache. Costs a cudaFreeHost per block (it synchronises the device), once per free."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    accelerator = getattr(torch, "accelerator", None)
    release = getattr(accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if release is None:
        return
    try:
        release()
    except RuntimeError as error:  # the memory stays cached; nothing else depends on it
        log.warning("could not release the checkpoint's pinned host memory: %s", error)


def _page_aligned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An empty CPU tensor; of IN_PLACE_BYTES or more, in page-aligned memory on huge pages where granted
    (mgpu.state.files.direct_io.aligned_buffer): an O_DIRECT checkpoint file writes it from there, without a copy, in
    the device's largest requests. torch's own allocator aligns to 64 bytes."""
    size = math.prod(shape) * dtype.itemsize
    if size < IN_PLACE_BYTES:
        return torch.empty(shape, dtype=dtype)
    try:
        _, view = aligned_buffer(-(-size // ALIGN) * ALIGN)
    except OSError as error:  # out of mappings (vm.max_map_count) or memory: torch's allocator may still have some
        log.debug("a snapshot buffer in torch's own memory: %s", error)
        return torch.empty(shape, dtype=dtype)
    # The tensor keeps `view`, and through it the mapping, alive; unmapped when the tensor is freed.
    return torch.frombuffer(view, dtype=torch.uint8, count=size).view(dtype).view(shape)


def snapshot_to_cpu(obj: T, staging: dict[tuple[Any, ...], torch.Tensor] | None = None) -> T:
    """A copy of nested dicts, lists and tuples in which every tensor is a CPU copy.

    Training may go on changing the live tensors while a background thread writes the copy. A tensor
    reached twice (tied weights) is copied once; a dict keeps its type and attributes (a state_dict's
    `_metadata`). `staging`: buffers kept from the previous snapshot, keyed by position, reused when
    shape and dtype match: copying into memory that is already mapped avoids a page fault per 4 KiB,
    which costs more than the copy itself for a large state. The caller must not reuse `staging`
    while an earlier snapshot taken with it is still being written.
    """
    result, copies = plan_snapshot(obj, staging)
    copy_snapshot(copies)
    return result


def plan_snapshot(obj: T, staging: dict[tuple[Any, ...], torch.Tensor] | None = None,
                  aligned: bool = True) -> tuple[T, list[Copy]]:
    """snapshot_to_cpu's result with its buffers in place (reused from `staging` or allocated) but not yet filled,
    and the copies that fill them, in the order they are reached (`copy_snapshot`). A tensor that is not strided
    (sparse) is copied here. A DTensor (on a CPU mesh) becomes one of the same mesh and placements around a buffer
    for its local shard. `aligned`: a host tensor's buffer of IN_PLACE_BYTES or more in page-aligned memory on huge
    pages, which an O_DIRECT file writes in place (False: torch's allocator, for a writer that copies anyway)."""
    memo: dict[int, torch.Tensor] = {}
    copies: list[Copy] = []

    def copy_tensor(tensor: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        tensor = tensor.detach()
        kept = staging.get(path) if staging is not None else None
        if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype or tensor.layout != torch.strided:
            if tensor.layout != torch.strided:
                return tensor.to("cpu", copy=True)
            # Pinned host memory makes a device-to-host copy fast and asynchronous; synchronised after. (cudaHostAlloc
            # returns page-aligned memory, which the O_DIRECT file writes in place; where not, it copies it.)
            kept = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True) if tensor.is_cuda \
                else _page_aligned_empty(tensor.shape, tensor.dtype) if aligned \
                else torch.empty(tensor.shape, dtype=tensor.dtype)
            if staging is not None:
                staging[path] = kept
        copies.append((kept, tensor))
        return kept

    def walk(value: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in memo:
                memo[id(value)] = copy_tensor(value, path) if not _is_dtensor(value) else _local_copy(value, path)
            return memo[id(value)]
        if isinstance(value, dict):
            out = copy.copy(value)
            for key, item in value.items():
                out[key] = walk(item, (*path, key))
            return out
        if isinstance(value, list):
            return [walk(item, (*path, i)) for i, item in enumerate(value)]
        if isinstance(value, tuple):
            items = [walk(item, (*path, i)) for i, item in enumerate(value)]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return copy.deepcopy(value)

    def _local_copy(dtensor: Any, path: tuple[Any, ...]) -> Any:
        # A sharded save's DTensor: its local shard copied, wrapped again with the same mesh and placements. from_local
        # moves the shard to the mesh's device: only a CPU mesh's DTensor is planned so (mgpu.state.sharded.staging).
        from torch.distributed.tensor import DTensor

        if dtensor.device_mesh.device_type != "cpu":
            raise ValueError(f"a snapshot plans DTensors on a CPU mesh only, not {dtensor.device_mesh.device_type}")
        return DTensor.from_local(copy_tensor(dtensor.to_local(), path), dtensor.device_mesh, dtensor.placements,
                                  run_check=False, shape=dtensor.shape, stride=dtensor.stride())

    return walk(obj, ()), copies


def _is_dtensor(value: torch.Tensor) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "device_mesh")


def copy_snapshot(copies: list[Copy], done: Callable[[int], None] = lambda index: None) -> None:
    """Fill a planned snapshot's buffers: a host tensor's at once, each then reported (`done(index)`); a GPU
    tensor's issued without blocking and all reported once their devices are synchronised."""
    devices: set[torch.device] = set()
    on_device: list[int] = []
    for index, (kept, tensor) in enumerate(copies):
        if tensor.is_cuda:
            devices.add(tensor.device)
            on_device.append(index)
            kept.copy_(tensor, non_blocking=True)
        else:
            kept.copy_(tensor)
            done(index)
    for device in devices:
        torch.cuda.synchronize(device)
    for index in on_device:
        done(index)


class CopyGate:
    """Which buffers of a planned snapshot are filled: a writer about to read `nbytes` at `address` waits until the
    buffer holding them is (`__call__`; memory outside every buffer passes). `fail(error)`: every wait, now and
    after, raises it (the copy failed: the write must not go on with a half-filled buffer)."""

    def __init__(self, copies: list[Copy]) -> None:
        spans = sorted((kept.untyped_storage().data_ptr(), kept.untyped_storage().nbytes(), index)
                       for index, (kept, _) in enumerate(copies))
        self._starts = [start for start, _, _ in spans]
        self._spans = spans
        self._filled = [False] * len(copies)
        self._error: BaseException | None = None
        self._changed = threading.Condition()

    def mark(self, index: int) -> None:
        with self._changed:
            self._filled[index] = True
            self._changed.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._changed:
            self._error = error
            self._changed.notify_all()

    def __call__(self, address: int, nbytes: int) -> None:
        at = bisect.bisect_right(self._starts, address) - 1
        if at < 0:
            return
        start, size, index = self._spans[at]
        if address < start + size:
            self._wait(lambda: self._filled[index])

    def holds(self, address: int, nbytes: int) -> bool:
        """Whether the `nbytes` at `address` lie inside one of the snapshot's buffers (memory that stays put until
        the write ends: mgpu.state.files.direct_io writes it in place)."""
        at = bisect.bisect_right(self._starts, address) - 1
        if at < 0:
            return False
        start, size, _ = self._spans[at]
        return address + nbytes <= start + size

    def wait_all(self) -> None:
        """Until every buffer is filled (a writer that cannot wait per buffer)."""
        self._wait(lambda: all(self._filled))

    def _wait(self, ready: Callable[[], bool]) -> None:
        with self._changed:
            self._changed.wait_for(lambda: ready() or self._error is not None)
            if self._error is not None:
                raise RuntimeError(f"the snapshot's copy failed: {self._error}") from self._error
