"""A periodic sharded save's host copy, written while it is still being made (without CUDA).

DCP's own stager copies the whole state before its writer starts, so a periodic sharded save cost the copy and the
write one after the other. `PipelinedStager` is a DCP `AsyncStager` whose `stage` only plans the copy: the state's
buffers (kept from one save to the next, keyed by their place in the state: mgpu.state.single.host_copy, as the
single-file save's snapshot) with every DTensor wrapped around its local shard's buffer. The caller fills
them after `dcp.async_save` returned (`copy`), in its own thread, while DCP's writer, started by then, writes
each tensor as soon as its buffer is filled: the save's files open through a `DigestingFileSystem` whose `gate` is
this stager (an O_DIRECT file waits per buffer; a file through the page cache waits for the whole copy). `copy`
returns once every buffer is filled, so the save is still a snapshot of its step: nothing the loop changes after
`save_objects` returns is written. A copy that fails fails the write that waits on it; the save then fails as any
write does.

The buffers of big tensors are page-aligned (huge pages where granted), and each is written from where it is, not
copied again into the O_DIRECT file's buffers: `AligningPlanner` has DCP's writer save each big tensor's archive with
its storage at a page-aligned offset, and the `DigestingFileSystem` starts every archive at one (`ItemAlignedStream`).

Where CUDA is, DCP's DefaultStager stays (a GPU's copy to pinned memory and its DTensors on a CUDA mesh are not
planned here). `next_stager` chooses a save's stager.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from mgpu.state.files.direct_io import IN_PLACE_BYTES
from mgpu.state.files.zip_options import align_next_saves
from mgpu.state.single.host_copy import Copy, CopyGate, copy_snapshot, plan_snapshot

__all__ = ["AligningPlanner", "IN_PLACE", "PipelinedStager", "next_stager"]

IN_PLACE = True
"""Whether a staged save's big tensors are written from the stager's buffers (off: buffers in torch's memory, each
copied again into the O_DIRECT file's, the form before; a bench's A/B)."""


class PipelinedStager:
    """DCP's `AsyncStager` protocol: `stage` plans (and returns the state that will be written), `copy` fills."""

    def __init__(self) -> None:
        self._staging: dict[tuple[Any, ...], torch.Tensor] = {}
        self._copies: list[Copy] = []
        self._gate: CopyGate | None = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        """No: DCP's own staging synchronization has nothing to wait for (the copy is `copy`'s)."""
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._copies and self._gate is not None:  # planned, never copied: its save failed before (a writer waiting
            self._gate.fail(RuntimeError("the save was given up before its copy"))  # on it stops)
        staged, self._copies = plan_snapshot(state_dict, self._staging, aligned=IN_PLACE)  # (then written in place)
        self._gate = CopyGate(self._copies)
        return staged

    def copy(self) -> None:
        """Fill the planned buffers, each reported to the writer as it is filled; raises what the copy raised (the
        writer's waits then raise it too)."""
        copies, gate, self._copies = self._copies, self._gate, []
        if gate is None:
            return
        # Largest first: the order in which DCP's writer takes a rank's tensors (its _split_by_size_and_type).
        order = sorted(range(len(copies)), key=lambda index: -copies[index][0].nbytes)
        try:
            copy_snapshot([copies[index] for index in order], done=lambda at: gate.mark(order[at]))
        except BaseException as error:
            gate.fail(error)
            raise

    def __call__(self, address: int, nbytes: int) -> None:
        """The writer's gate: returns once the buffer holding `nbytes` at `address` is filled."""
        if self._gate is not None:
            self._gate(address, nbytes)

    def holds(self, address: int, nbytes: int) -> bool:
        """Whether the `nbytes` at `address` are in this save's buffers (kept until the write ends: written in
        place)."""
        return IN_PLACE and self._gate is not None and self._gate.holds(address, nbytes)

    def wait_all(self) -> None:
        """A writer that cannot wait per buffer: until the whole copy is done."""
        if self._gate is not None:
            self._gate.wait_all()

    def synchronize_staging(self) -> None:
        """DCP's call (deprecated there): the copy is the caller's (`copy`)."""

    def close(self) -> None:
        self._staging.clear()
        self._copies, self._gate = [], None


class AligningPlanner(DefaultSavePlanner):
    """DCP's default save planner, which tells its writer's thread, as it hands over each tensor, whether to save
    that tensor's archive with its storage at a page-aligned offset: only a storage an O_DIRECT file would write in
    place (IN_PLACE_BYTES or more). Every record of an aligned archive is padded to a page, 20 KiB or so a tensor:
    worth it for the big ones only. DCP's plain loader (a staged save's, without CUDA) resolves each tensor right
    before its writer saves it, in the same thread."""

    def resolve_data(self, write_item: Any) -> Any:
        data = super().resolve_data(write_item)
        align_next_saves(IN_PLACE and isinstance(data, torch.Tensor)
                         and data.untyped_storage().nbytes() >= IN_PLACE_BYTES)
        return data


def next_stager(current: Any, cuda: bool, reuse: bool = True, pipelined: bool = True) -> Any:
    """The stager of a checkpointer's next asynchronous save, `current` its last one (closed where replaced).

    Where CUDA is, a DefaultStager for every save: reused, torch's fails each save after its first on CUDA tensors
    (KeyError: <class 'type'> in its deepcopy dispatch; torch 2.11 on an H100, pinned or not). Elsewhere one for the
    checkpointer's life (`reuse`): it keeps the host copy's buffers for the next save, which copies into memory already
    mapped instead of faulting in a new copy of the state (a fault per 4 KiB: 1 GiB staged in ~0.35 s fresh, ~0.07 s
    reused on the CI machine); a `PipelinedStager` where `pipelined`, DCP's DefaultStager otherwise."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    own = pipelined and reuse and not cuda
    if current is not None and (cuda or not reuse or own != isinstance(current, PipelinedStager)):
        current.close()
        current = None
    if current is not None:
        return current
    if own:
        return PipelinedStager()
    # Staged before dcp.async_save returns (not in a thread that only the next forward or optimizer step waited for):
    # a module changed without its own forward (an EMA, a momentum teacher, p.data.clamp_()) was written half old,
    # half new. A non-blocking device copy is synchronized before the return too.
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=cuda))
