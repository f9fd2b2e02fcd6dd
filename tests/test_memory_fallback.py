"""A snapshot only ever helps (mgpu.state.memory.snapshots.MemorySnapshots.restore_if_newer), in one process: two ranks
as threads whose MIN all-reduce meets at a barrier, real torch states in real slots. A snapshot whose CRC-32
matches but which does not restore (bytes that do not load, another model's state, a content of another step) is
set aside on its rank in one line naming why, and every rank goes back alike to the next newest step they all
hold, then to the durable checkpoint; every refused snapshot is one line. The real-Slurm case:
tests/e2e/test_memory_snapshots.py."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from mgpu.state.files.digest import crc32
from mgpu.state.memory.content import STEP, rank_state
from mgpu.state.memory.store import SnapshotStore
from mgpu.state.memory.snapshots import MemorySnapshots
from tests.test_memory_snapshot import as_ranks

WORLD = 2


class Rank:
    """One rank's loop state (a model and its AdamW, trained a step at a time) and its snapshots."""

    def __init__(self, rank: int, base: Path) -> None:
        torch.manual_seed(0)
        self.rank, self.model = rank, nn.Linear(4, 3)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.objects: dict[str, Any] = {"model": self.model, "optimizer": self.optimizer}
        self.snapshots = MemorySnapshots.open(slurm_job="7", run_id="run-a", config={"optim": {"lr": 0.1}},
                                              world_size=WORLD, rank=rank, every=1, version=None, base=base,
                                              objects=self.objects)
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def train_and_take(self, step: int) -> None:
        self.model(torch.ones(2, 4)).pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        assert self.snapshots.take(step, self.objects, dict)
        self.weights[step] = {k: v.clone() for k, v in self.model.state_dict().items()}

    def restore(self, durable_step: int) -> Callable[[Callable[[int], int]], Any]:
        return lambda reduce_min: self.snapshots.restore_if_newer(durable_step, reduce_min, self.objects, seed=0)

    def holds(self, step: int) -> bool:
        return all(torch.equal(self.model.state_dict()[k], v) for k, v in self.weights[step].items())


@pytest.fixture
def ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Rank]:
    """Two ranks with snapshots of steps 1 and 2 (then trained on to step 3, not snapshotted: the crash)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the optimizer's first step sets it
    both = [Rank(r, tmp_path) for r in range(WORLD)]
    for rank in both:
        rank.train_and_take(1)
        rank.train_and_take(2)
        rank.model(torch.ones(2, 4)).sum().backward()
        rank.optimizer.step()
    return both


def tamper(store: SnapshotStore, step: int, content: bytes) -> None:
    """The slot of `step` given `content`, its commit record rewritten to match (size, CRC-32): committed whole."""
    for slot in range(2):
        record_path = store.directory / f"slot{slot}.json"
        record = json.loads(record_path.read_text())
        if record["step"] == step:
            (store.directory / f"slot{slot}.pt").write_bytes(content)
            record_path.write_text(json.dumps({**record, "bytes": len(content), "crc32": f"{crc32(content):08x}"}))
            return
    raise AssertionError(f"no slot of step {step}")


def saved(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def another_model(step: int) -> bytes:
    """What a snapshot of another architecture holds (the model code changed): loads, does not fit."""
    other = nn.Linear(5, 2)
    return saved({**rank_state({"model": other, "optimizer": torch.optim.AdamW(other.parameters())}, 1, WORLD, None),
                  STEP: step})


def lines(caplog: pytest.LogCaptureFixture, rank: int) -> list[str]:
    """The warnings rank `rank` gave."""
    return [r.getMessage() for r in caplog.records
            if f"rank {rank}: " in r.getMessage() and r.levelno >= logging.WARNING]


def test_unloadable_bytes_are_set_aside_and_the_ranks_go_back_to_the_next_snapshot_alike(
        ranks: list[Rank], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "mgpu.train")
    tamper(ranks[1].snapshots.store, 2, b"not a torch file" * 100)
    results = as_ranks([rank.restore(durable_step=0) for rank in ranks])
    assert [r.step for r in results] == [1, 1], results
    assert all(rank.holds(1) for rank in ranks)  # rank 0 read step 2 whole, but put back step 1, as rank 1
    kept = ranks[1].snapshots.store.directory / "set-aside-step2.pt"
    assert kept.read_bytes() == b"not a torch file" * 100  # renamed, not deleted
    why = "UnpicklingError: does not load with weights_only=True: Unsupported operand 110"
    assert json.loads(kept.with_suffix(".json").read_text())["set_aside"] == why
    assert lines(caplog, 1) == [
        f"checkpoint.memory_every_steps: rank 1: the snapshot of step 2 does not restore ({why}): set aside as {kept}; "
        "the ranks go back to the next newest snapshot they all hold, else the durable checkpoint"]
    assert lines(caplog, 0) == [] and ranks[0].snapshots.store.valid_steps() == [1]  # step 2 dropped as after a resume
    assert ranks[1].snapshots.store.valid_steps() == [1]


@pytest.mark.parametrize("durable_step", [0, -1])  # a durable checkpoint of step 0; none at all
def test_another_models_state_falls_back_to_the_older_snapshot_overwriting_what_was_put_back(
        ranks: list[Rank], durable_step: int, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1's step 2 loads but does not fit (another architecture): rank 0 had put its step 2 back already; both
    go to step 1, bit for bit."""
    tamper(ranks[1].snapshots.store, 2, another_model(2))
    results = as_ranks([rank.restore(durable_step) for rank in ranks])
    assert [r.step for r in results] == [1, 1], results
    assert all(rank.holds(1) for rank in ranks)
    assert "size mismatch" in lines(caplog, 1)[0] and lines(caplog, 0) == []


def test_no_snapshot_restores_anywhere_the_durable_checkpoint_goes_on(ranks: list[Rank],
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1's two snapshots: bytes that do not load, and a content that says another step. Both set aside, one
    line each; every rank returns None (the durable checkpoint), none of them changed."""
    tamper(ranks[1].snapshots.store, 2, b"\0" * 64)
    tamper(ranks[1].snapshots.store, 1, saved({**rank_state(ranks[1].objects, 1, WORLD, None), STEP: 2}))
    before = [{k: v.clone() for k, v in rank.model.state_dict().items()} for rank in ranks]
    assert as_ranks([rank.restore(durable_step=0) for rank in ranks]) == [None, None]
    assert all(torch.equal(rank.model.state_dict()[k], v) for rank, b in zip(ranks, before) for k, v in b.items())
    said = lines(caplog, 1)
    assert len(said) == 2 and "the snapshot of step 1 does not restore (ValueError: its content is not a snapshot " \
                                "of step 1 (it says 2))" in said[1]
    assert sorted(p.name for p in ranks[1].snapshots.store.directory.glob("set-aside-*")) == [
        "set-aside-step1.json", "set-aside-step1.pt", "set-aside-step2.json", "set-aside-step2.pt"]


def test_a_snapshot_put_back_on_some_ranks_with_nothing_to_overwrite_it_fails_the_attempt(
        ranks: list[Rank]) -> None:
    """Another model's state in rank 1's two slots, no durable checkpoint: rank 0 put a snapshot back and cannot
    undo it, so the attempt fails (not as bad input: the next attempt starts afresh, the snapshots set aside)."""
    for step in (1, 2):
        tamper(ranks[1].snapshots.store, step, another_model(step))
    results = as_ranks([rank.restore(durable_step=-1) for rank in ranks])
    assert all(isinstance(r, RuntimeError) and "starts the run afresh" in str(r) for r in results), results
    assert ranks[1].snapshots.store.valid_steps() == []
    assert as_ranks([rank.restore(durable_step=-1) for rank in ranks]) == [None, None]  # the next attempt


def test_every_refused_snapshot_is_one_line_with_its_reason(ranks: list[Rank],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """A record whose step is `true` (believed over the content before), an unreadable record: each refused in a
    line of its own; nothing restores (rank 1 holds nothing valid)."""
    store = ranks[1].snapshots.store
    record = json.loads((store.directory / "slot0.json").read_text())
    (store.directory / "slot0.json").write_text(json.dumps({**record, "step": True}))
    (store.directory / "slot1.json").write_text("{torn")
    assert as_ranks([rank.restore(durable_step=0) for rank in ranks]) == [None, None]
    assert lines(caplog, 1) == [
        f"checkpoint.memory_every_steps: rank 1: {store.directory}/slot0.pt: not restored: a commit record not to "
        "believe: its step is True, not a whole number",
        f"checkpoint.memory_every_steps: rank 1: {store.directory}/slot1.pt: not restored: an unreadable commit "
        "record (not JSON)"]


def test_a_snapshot_of_another_model_is_stale_and_a_cut_one_torn(tmp_path: Path, ranks: list[Rank]) -> None:
    other = MemorySnapshots.open(slurm_job="7", run_id="run-a", config={"optim": {"lr": 0.1}}, world_size=WORLD,
                                 rank=0, every=1, version=None, base=tmp_path, objects={"model": nn.Linear(5, 2)})
    said: list[str] = []
    assert other.store.restorable(said.append) == []
    assert len(said) == 2 and all("not restored: stale: taken with structure=" in line for line in said), said
    store = ranks[0].snapshots.store
    slot = store.directory / "slot0.pt"  # step 1's
    size = slot.stat().st_size
    with open(slot, "r+b") as file:
        file.truncate(10)
    said.clear()
    assert store.restorable(said.append) == [2]
    assert said == [f"{slot} (step 1): not restored: torn: its file is 10 bytes, its commit record says {size}"]


def test_a_replica_that_does_not_restore_is_dropped_and_the_next_step_restores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1's node lost its memory; its replica of step 2 on rank 0's node is bytes that do not load: it fetches
    them, says so, and both ranks go back to step 1 (its replica of which restores)."""
    from mgpu.state.memory.replica import Replication, replica_dir
    from tests.test_memory_replica import FakeDirectory

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    directory = FakeDirectory()
    both = [Rank(r, tmp_path) for r in range(WORLD)]
    for rank, node in zip(both, ("nA", "nB")):
        rank.snapshots.replication = Replication.start(rank.snapshots.store.identity, node=node, ranks_per_node=1,
                                                       num_nodes=2, host="127.0.0.1", directory=lambda: directory,
                                                       base=tmp_path, timeout=5)
    try:
        for step in (1, 2):
            for rank in both:
                rank.train_and_take(step)
                assert rank.snapshots.replication is not None and rank.snapshots.replication.sender.wait_idle(10)
        both[1].snapshots.store.remove()  # node nB's memory
        identity = both[1].snapshots.store.identity
        tamper(SnapshotStore(replica_dir("7", "run-a", 1, "nA", tmp_path), identity), 2, b"\0" * 64)
        results = as_ranks([rank.restore(durable_step=0) for rank in both])
        assert [r.step for r in results] == [1, 1] and all(rank.holds(1) for rank in both)
        (line,) = lines(caplog, 1)
        assert line.startswith("checkpoint.memory_every_steps: rank 1: the snapshot of step 2 does not restore "
                               "(UnpicklingError: ") and "its replica on rank 0 is dropped" in line
    finally:
        for rank in both:
            rank.snapshots.remove()
