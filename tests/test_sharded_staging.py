"""mgpu.state.sharded.staging: a periodic sharded save's writer starts while the host copy is still being made, and
writes each tensor only once its buffer is filled."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from mgpu.record.ledger import Ledger
from mgpu.state.files.direct_io import DirectFile, _address
from mgpu.state.sharded import checkpointer as sharded_module
from mgpu.state.sharded import staging
from mgpu.state.sharded.checkpointer import ShardedCheckpointer
from mgpu.state.sharded.export import consolidate
from mgpu.state.single.host_copy import copy_snapshot, plan_snapshot
from tests.test_sharded import group  # noqa: F401  (the fixture: a gloo world of one)

MIB = 1 << 20


def test_a_planned_dtensor_is_one_of_the_same_placements_around_its_local_shards_buffer(group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    source = distribute_tensor(torch.randn(8, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
    staging_buffers: dict[tuple[Any, ...], torch.Tensor] = {}
    planned, copies = plan_snapshot({"w": source, "n": 3}, staging_buffers)
    staged = planned["w"]
    assert isinstance(staged, DTensor) and staged.placements == source.placements and staged.shape == source.shape
    assert staged.to_local().data_ptr() == copies[0][0].data_ptr() != source.to_local().data_ptr()
    copy_snapshot(copies)
    assert torch.equal(staged.to_local(), source.to_local()) and planned["n"] == 3
    again, _ = plan_snapshot({"w": source, "n": 4}, staging_buffers)  # the next save: the same buffer
    assert again["w"].to_local().data_ptr() == staged.to_local().data_ptr()


class Two(nn.Module):
    """Two tensors big enough that writing the first fills the O_DIRECT file's buffers (16 MiB) more than once."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.zeros(48 * MIB // 4))
        self.small = nn.Parameter(torch.zeros(32 * MIB // 4))


def test_a_periodic_sharded_saves_writer_writes_the_first_tensor_while_the_rest_is_copied_and_never_a_stale_buffer(
        group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is held after its first (largest) tensor: the shard's writer still writes that tensor's bytes. The
    buffers hold the save before's values until the copy reaches them: a writer that did not wait for them would
    write those, and the checkpoint would not be its step's."""
    writes: list[int] = []
    real_pwrite = DirectFile._pwrite

    def counting(self: DirectFile, pieces: list[memoryview], offset: int) -> int:
        writes.append(offset)
        return real_pwrite(self, pieces, offset)

    monkeypatch.setattr(DirectFile, "_pwrite", counting)
    held, first_copied, hold = threading.Event(), threading.Event(), [False]

    def copy_held(copies: list[tuple[torch.Tensor, torch.Tensor]], done: Any) -> None:
        copy_snapshot(copies[:1], done)
        if hold[0]:
            first_copied.set()
            assert held.wait(30)
        copy_snapshot(copies[1:], lambda index: done(index + 1))

    monkeypatch.setattr(staging, "copy_snapshot", copy_held)
    model = Two()
    saver = ShardedCheckpointer(tmp_path / "checkpoints", 0, 1, Ledger(None, None, 0), async_save=True)
    saver.save_objects({"model": model}, 1, "periodic")  # fills the buffers with step 1's zeros
    assert saver.settle() is None and isinstance(saver._stager, staging.PipelinedStager)
    with torch.no_grad():
        model.big.fill_(2.0)
        model.small.fill_(3.0)
    hold[0], writes[:] = True, []
    saving = threading.Thread(target=saver.save_objects, args=({"model": model}, 2, "periodic"))
    saving.start()
    try:
        assert first_copied.wait(30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not writes:
            time.sleep(0.01)
        assert writes, "nothing written while the copy was held after the first tensor"
        time.sleep(0.5)  # a writer that did not wait for the buffers would write the second one's stale bytes now
    finally:
        held.set()
        saving.join(30)
    assert saver.settle() is None
    saver.close()
    saved = consolidate(tmp_path / "checkpoints" / "step_00000002")["model"]
    assert torch.equal(saved["big"], model.big.detach()) and torch.equal(saved["small"], model.small.detach())


def test_a_copy_that_fails_fails_its_save_and_the_next_one_is_written(
        group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failing = [True]

    def copy_failing(copies: list[tuple[torch.Tensor, torch.Tensor]], done: Any) -> None:
        copy_snapshot(copies[:1], done)
        if failing[0]:
            raise MemoryError("no memory for the host copy")
        copy_snapshot(copies[1:], lambda index: done(index + 1))

    monkeypatch.setattr(staging, "copy_snapshot", copy_failing)
    model = Two()
    saver = ShardedCheckpointer(tmp_path / "checkpoints", 0, 1, Ledger(None, None, 0), async_save=True)
    saver.save_objects({"model": model}, 1, "periodic")
    outcome = saver.settle()
    assert outcome is not None and "no memory for the host copy" in outcome
    assert not (tmp_path / "checkpoints" / "step_00000001").exists()
    failing[0] = False
    saver.save_objects({"model": model}, 2, "periodic")
    assert saver.settle() is None
    saver.close()
    assert (tmp_path / "checkpoints" / "step_00000002").is_dir()


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "staged-first"])
def test_the_stager_is_mgpus_own_only_where_pipelined(pipelined: bool, group: None, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharded_module, "PIPELINED_STAGING", pipelined)
    saver = ShardedCheckpointer(tmp_path / "checkpoints", 0, 1, Ledger(None, None, 0), async_save=True)
    saver.save_objects({"model": nn.Linear(3, 2)}, 1, "periodic")
    assert saver.settle() is None
    assert isinstance(saver._stager, staging.PipelinedStager) is pipelined
    saver.close()


class BigAndSmall(nn.Module):
    """Two tensors an O_DIRECT file writes in place, and forty it copies (under IN_PLACE_BYTES each)."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.randn(3 * MIB // 4))
        self.other = nn.Parameter(torch.randn(2 * MIB // 4 + 5))
        self.small = nn.ParameterList([nn.Parameter(torch.randn(7 + n)) for n in range(40)])


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copied"])
def test_a_periodic_sharded_save_writes_its_staged_big_tensors_in_place_and_pads_only_those(
        in_place: bool, group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stager's page-aligned buffers of the big tensors are what the write requests read (no copy into the
    O_DIRECT file's buffers); the small tensors' archives are not padded to pages; the shard loads back the same.
    `copied` (staging.IN_PLACE off, the form before) is the control: no staged buffer is written from."""
    monkeypatch.setattr(staging, "IN_PLACE", in_place)
    sources: list[int] = []
    real_pwrite = DirectFile._pwrite

    def recording(self: DirectFile, pieces: list[memoryview], offset: int) -> int:
        sources.extend(_address(piece) for piece in pieces)
        return real_pwrite(self, pieces, offset)

    monkeypatch.setattr(DirectFile, "_pwrite", recording)
    model = BigAndSmall()
    saver = ShardedCheckpointer(tmp_path / "checkpoints", 0, 1, Ledger(None, None, 0), async_save=True)
    saver.save_objects({"model": model}, 1, "periodic")
    assert saver.settle() is None
    stager = saver._stager
    assert isinstance(stager, staging.PipelinedStager)
    buffers = {kept.data_ptr(): kept.nbytes for kept in stager._staging.values()}
    big = [address for address, size in buffers.items() if size >= 2 * MIB]
    assert len(big) == 2
    written_from = [address for address in big if address in sources]
    assert written_from == (big if in_place else [])
    saver.close()
    shard = sum(path.stat().st_size for path in (tmp_path / "checkpoints" / "step_00000001").glob("*.distcp"))
    tensors = sum(p.nbytes for p in model.parameters())
    assert shard < tensors + 40 * 2048 + 64 * 1024  # a page-padded small archive alone takes 20 KiB or so
    saved = consolidate(tmp_path / "checkpoints" / "step_00000001")["model"]
    assert all(torch.equal(saved[name], value.detach()) for name, value in model.state_dict().items())
