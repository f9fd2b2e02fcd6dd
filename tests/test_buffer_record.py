"""Rank 0's buffer record (mgpu.state.memory.buffer_record), in one process: what it keeps is read back exactly
(every dtype, a 0-d and an empty tensor), its two slots hold the newest two steps, a slot torn by a kill mid-copy
or changed after its commit is not believed while the other still is, another job's or run's record is not read,
a buffer that changes shape is kept in its new shape, and a restarted rank 0 writes over the older slot first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mgpu.state.memory.buffer_record import HEAD, BufferRecord
from mgpu.state.memory.store import Identity, SnapshotStore

IDENTITY = Identity("7", 0, "run", "cfg", 2, 0, "shape")


def record(tmp_path: Path, identity: Identity = IDENTITY) -> BufferRecord:
    return BufferRecord(SnapshotStore(tmp_path / "rank0-buffers", identity))


def buffers(value: float) -> dict[str, dict[str, Any]]:
    return {"model": {"bn.running_mean": torch.full((5,), value), "bn.num_batches_tracked": torch.tensor(int(value)),
                      "half": torch.full((2, 3), value, dtype=torch.bfloat16), "none": torch.empty(0, 4)},
            "ema": {"shadow.bn.running_var": torch.full((3,), value, dtype=torch.float64)}}


def assert_same(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys()
        for key, tensor in want[name].items():
            assert got[name][key].dtype == tensor.dtype and got[name][key].shape == tensor.shape, key
            assert torch.equal(got[name][key], tensor), key


def test_the_newest_two_steps_are_read_back_exactly(tmp_path: Path) -> None:
    kept = record(tmp_path)
    for step in range(1, 6):
        kept.offer(step, buffers(float(step)))
    assert kept.steps() == [5, 4]
    assert_same(kept.read(5), buffers(5.0))
    assert_same(kept.read(4), buffers(4.0))
    live = buffers(6.0)
    kept.offer(6, live)
    live["model"]["bn.running_mean"].add_(1)  # the forward after the mark changes the live buffer, not the record
    assert_same(kept.read(6), buffers(6.0))
    kept.close()
    # Read by a fresh record of the same identity (a restarted rank 0), not by another job's or run's.
    assert record(tmp_path).steps() == [6, 5]
    assert record(tmp_path, Identity("8", 0, "run", "cfg", 2, 0, "shape")).steps() == []
    assert record(tmp_path, Identity("7", 1, "run", "cfg", 2, 0, "shape")).steps() == []


def test_a_torn_or_changed_slot_is_not_believed_and_the_other_still_is(tmp_path: Path) -> None:
    kept = record(tmp_path)
    kept.offer(1, buffers(1.0))
    kept.offer(2, buffers(2.0))
    kept.close()
    slots = sorted((tmp_path / "rank0-buffers").glob("slot*.bin"))
    newest = next(path for path in slots if _step(path) == 2)
    # Killed mid-copy: the head is cleared before the copy and written after it.
    content = bytearray(newest.read_bytes())
    newest.write_bytes(bytes(HEAD.size) + bytes(content[HEAD.size:]))
    assert record(tmp_path).steps() == [1]
    # A byte changed after the commit.
    newest.write_bytes(bytes(content[:-1]) + bytes([content[-1] ^ 1]))
    assert record(tmp_path).steps() == [1]
    newest.write_bytes(bytes(content))
    assert record(tmp_path).steps() == [2, 1]


def test_a_restarted_rank_0_writes_over_the_older_slot_first(tmp_path: Path) -> None:
    kept = record(tmp_path)
    kept.offer(1, buffers(1.0))
    kept.offer(2, buffers(2.0))
    kept.close()
    again = record(tmp_path)
    again.offer(3, buffers(3.0))
    assert again.steps() == [3, 2]  # step 1's slot, the older, written over; step 2's kept whole meanwhile
    assert_same(again.read(2), buffers(2.0))


def test_a_buffer_that_changes_shape_is_kept_in_its_new_shape(tmp_path: Path) -> None:
    kept = record(tmp_path)
    kept.offer(1, buffers(1.0))
    grown = buffers(2.0)
    grown["model"]["bn.running_mean"] = torch.arange(9.0)
    kept.offer(2, grown)
    kept.offer(3, grown)
    assert kept.steps() == [3, 2]
    assert_same(kept.read(3), grown)
    assert_same(kept.read(2), grown)


def _step(path: Path) -> int:
    return HEAD.unpack_from(path.read_bytes())[3]
