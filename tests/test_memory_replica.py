"""The replica of each rank's snapshots on a partner of another node (mgpu.state.memory.replica), in one process
with real sockets on localhost and a dict for the rendezvous store: the pairing, the transfer (a torn one leaves
the previous replica whole; stale, unknown and superseded ones), a failure said once, the agreement and the
restore when one node's memory is gone, cleanup. The real-process restart: test_memory_restart.py."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import socket
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from mgpu.state.memory.replica import Partner, Refused, Replication, Superseded, partners, replica_dir
from mgpu.state.memory.replica_wire import recv_msg, send_msg
from mgpu.state.memory.store import Identity, SnapshotStore, job_dir, remove_job
from mgpu.state.memory.snapshots import MemorySnapshots
from tests.test_memory_snapshot import agree_all, dump, load

R0 = Identity(job="123", restart=0, run="run-abc", config="cfg1", world_size=2, rank=0)
R1 = dataclasses.replace(R0, rank=1)


class FakeDirectory:
    """The rendezvous store: a dict whose lookup waits for the key, as TCPStore's does."""

    def __init__(self) -> None:
        self.entries: dict[str, str] = {}
        self.cond = threading.Condition()

    def publish(self, key: str, value: str) -> None:
        with self.cond:
            self.entries[key] = value
            self.cond.notify_all()

    def lookup(self, key: str, timeout: float) -> str:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.entries, timeout):
                raise TimeoutError(f"{key} not published within {timeout} s")
            return self.entries[key]


@pytest.mark.parametrize("rank, world, per_node, nodes, pair", [
    (0, 4, 2, 2, (2, 2)), (1, 4, 2, 2, (3, 3)), (3, 4, 2, 2, (1, 1)),  # two nodes: pairs hold each other's
    (0, 6, 2, 3, (2, 4)), (5, 6, 2, 3, (1, 3)),  # three: a ring, node to the next node
    (0, 2, 1, 2, (1, 1)),
    (0, 2, 2, 1, None),  # one node: no replica
    (0, 5, 2, 2, None),  # unequal nodes (2 + 3): no pairing every rank would compute alike
])
def test_the_partner_is_the_same_local_rank_on_the_next_node(rank: int, world: int, per_node: int, nodes: int,
                                                             pair: tuple[int, int] | None) -> None:
    assert partners(rank, world, per_node, nodes) == pair


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Replication, Replication]]:
    """Ranks 0 (node nA) and 1 (node nB), each holding the other's replica."""
    directory = FakeDirectory()
    both = [Replication.start(identity, node=node, ranks_per_node=1, num_nodes=2, host="127.0.0.1",
                              directory=lambda: directory, base=tmp_path, timeout=5)
            for identity, node in ((R0, "nA"), (R1, "nB"))]
    zero, one = both
    assert zero is not None and one is not None
    yield zero, one
    zero.close()
    one.close()


def test_a_snapshot_is_sent_to_the_partner_and_fetched_back(tmp_path: Path, pair: tuple[Replication, Replication]
                                                            ) -> None:
    zero, one = pair
    own = SnapshotStore.for_rank(R0, tmp_path)
    for step in (4, 5):
        zero.offer(own.write(step, dump({"step": step})))
        assert zero.sender.wait_idle(10)
    assert one.held.directory == replica_dir("123", "run-abc", 0, "nB", tmp_path)
    assert one.held.directory.name == "replica-of-rank0-on-nB"
    assert one.held.valid_steps() == [5, 4] and zero.sender.sent == 2
    assert zero.steps() == [5, 4]
    assert load(zero.fetch(4)) == {"step": 4}
    assert zero.held.valid_steps() == []  # rank 1 sent nothing


def test_a_newer_snapshot_supersedes_the_one_waiting(tmp_path: Path, pair: tuple[Replication, Replication],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 1's send is held up; steps 2-29 come meanwhile (the loop does not wait): 29 replaces each one waiting,
    and step 1, whose slot step 3 wrote over, is not sent (superseded, no failure)."""
    zero, one = pair
    own = SnapshotStore.for_rank(R0, tmp_path)
    release, put = threading.Event(), zero.partner.put

    def slow_put(snapshot: Any) -> None:
        release.wait(10)
        put(snapshot)

    monkeypatch.setattr(zero.partner, "put", slow_put)
    for step in range(1, 30):
        zero.offer(own.write(step, dump(f"step {step}")))
    release.set()
    assert zero.sender.wait_idle(10)
    assert zero.sender.sent == 1 and zero.sender.failure is None
    assert one.held.valid_steps() == [29] and load(zero.fetch(29)) == "step 29"


def put_raw(replication: Replication, header: dict[str, Any], payload: bytes, declared: int | None = None
            ) -> dict[str, Any] | None:
    """A put by hand: `payload` sent after the partner's go, then the connection closed (`declared` bytes said)."""
    partner = replication.partner
    entry = partner.entry()
    host, port = entry["address"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        send_msg(conn, {"op": "put", "token": entry["token"], "identity": dataclasses.asdict(R0),
                         "bytes": len(payload) if declared is None else declared, **header})
        answer = recv_msg(conn)
        if not answer["ok"]:
            return answer
        conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        try:
            return recv_msg(conn)
        except ConnectionError:
            return None


@pytest.mark.parametrize("torn", ["cut short", "not its CRC-32"])
def test_a_torn_transfer_leaves_the_previous_replica_whole(torn: str, tmp_path: Path,
                                                           pair: tuple[Replication, Replication]) -> None:
    import zlib

    zero, one = pair
    own = SnapshotStore.for_rank(R0, tmp_path)
    for step in (1, 2):
        zero.offer(own.write(step, dump(f"whole {step}")))
        assert zero.sender.wait_idle(10)
    payload = pickle.dumps("three" * 1000)
    if torn == "cut short":
        assert put_raw(zero, {"step": 3, "crc32": f"{zlib.crc32(payload):08x}"}, payload[:100], len(payload)) is None
    else:
        assert put_raw(zero, {"step": 3, "crc32": "00000000"}, payload) is None
    assert one.held.valid_steps() == [2]  # the slot of step 1 was being written over: uncommitted; 2 is whole
    assert load(zero.fetch(2)) == "whole 2"
    zero.offer(own.write(4, dump("whole 4")))  # the next one goes into the slot the torn one left
    assert zero.sender.wait_idle(10) and one.held.valid_steps() == [4, 2]


def test_a_stale_or_unknown_asker_is_refused(tmp_path: Path, pair: tuple[Replication, Replication]) -> None:
    zero, one = pair
    own = SnapshotStore.for_rank(R0, tmp_path)
    zero.offer(own.write(1, dump("x")))
    assert zero.sender.wait_idle(10)
    others: list[tuple[str, Any]] = [("job", "124"), ("restart", 1), ("run", "run-xyz"), ("config", "cfg2"),
                                     ("world_size", 4), ("rank", 1)]
    for field, other in others:
        stale = Partner(1, dataclasses.replace(R0, **{field: other}), zero.partner.directory,
                        zero.partner.namespace, "nA", timeout=5)
        with pytest.raises(Refused, match="^stale: "):
            stale.steps()
    entry = dict(zero.partner.entry(), token="guessed")
    intruder = Partner(1, R0, zero.partner.directory, zero.partner.namespace, "nA", timeout=5)
    intruder._entry = entry
    with pytest.raises(Refused, match="bad token"):
        intruder.fetch(1)
    with pytest.raises(Refused, match="no valid snapshot of step 7"):
        zero.partner.fetch(7)
    assert one.held.valid_steps() == [1]


def test_a_partner_on_the_same_node_is_refused(tmp_path: Path) -> None:
    directory = FakeDirectory()
    both = [Replication.start(identity, node="same", ranks_per_node=1, num_nodes=2, host="127.0.0.1",
                              directory=lambda: directory, base=tmp_path, timeout=5) for identity in (R0, R1)]
    try:
        assert both[0] is not None
        with pytest.raises(Refused, match="is on this rank's node"):
            both[0].partner.steps()
    finally:
        for replication in both:
            assert replication is not None
            replication.close()


def test_a_failed_send_is_said_once_and_ends_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The partner never published its address (it is gone): each send fails; said once, at the next snapshot."""
    lonely = Replication.start(R0, node="nA", ranks_per_node=1, num_nodes=2, host="127.0.0.1",
                               directory=FakeDirectory, base=tmp_path, timeout=0.2)
    assert lonely is not None
    own = SnapshotStore.for_rank(R0, tmp_path)
    try:
        for step in (1, 2, 3):
            lonely.offer(own.write(step, dump("x")))
            assert lonely.sender.wait_idle(10)
        assert lonely.sender.failure == "TimeoutError: mgpu-replica/123/0/run-abc/1 not published within 0.2 s"
        warnings = [r.message for r in caplog.records if "a replica to rank 1 failed" in r.message]
        assert len(warnings) == 1, warnings
        assert lonely.steps() == []  # and a restore goes on without it
    finally:
        lonely.close()


def test_one_node_has_no_replica_and_says_so_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def never() -> FakeDirectory:
        raise AssertionError("no directory is needed on one node")

    caplog.set_level(logging.INFO, "mgpu.train")
    for identity in (R0, R1):
        assert Replication.start(identity, node="n", ranks_per_node=2, num_nodes=1, host="127.0.0.1",
                                 directory=never, base=tmp_path) is None
    assert [r.message for r in caplog.records if "no replica" in r.message] == [
        "checkpoint.memory_every_steps: one node: the snapshots have no replica on another node (a lost node costs "
        "the durable checkpoint)"]


@pytest.mark.parametrize("own, replicas, agreed", [
    ([[10, 9], []], [[10, 9], [10, 9]], 10),  # rank 1's node lost: its replica on rank 0's node
    ([[10, 9], []], [[], [9, 8]], 9),  # its replica one step behind (the newest was still being sent)
    ([[10, 9], []], [[], []], None),  # no replica either: the durable checkpoint
    ([[11, 10], [10, 9]], [[10, 9], [11, 10]], 11),  # each has the other's newest in its replica
])
def test_the_agreement_counts_each_ranks_own_and_replica_steps(own: list[list[int]], replicas: list[list[int]],
                                                               agreed: int | None) -> None:
    assert agree_all([sorted(set(o) | set(r), reverse=True) for o, r in zip(own, replicas)]) == [agreed] * len(own)


def test_a_rank_whose_node_lost_its_memory_restores_from_the_replica(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks on nodes nA and nB take snapshots at steps 1 and 2; nB's memory is removed (rank 1's own
    snapshots and the replica of rank 0 it held). Both agree on step 2; rank 1 restores it from its replica on
    nA, bit for bit; the slots after it are dropped; cleanup removes the replicas with the snapshots."""
    import torch

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    directory = FakeDirectory()
    ranks, models = [], []
    for rank, node in ((0, "nA"), (1, "nB")):
        snapshots = MemorySnapshots.open(slurm_job="123", run_id="run-abc", config={}, world_size=2, rank=rank,
                                         every=1, version=None, base=tmp_path)
        snapshots.replication = Replication.start(snapshots.store.identity, node=node, ranks_per_node=1, num_nodes=2,
                                                  host="127.0.0.1", directory=lambda: directory, base=tmp_path,
                                                  timeout=5)
        ranks.append(snapshots)
        models.append(torch.nn.Linear(3, 2))
    expected = torch.empty(0)
    for step in (1, 2, 3):
        for snapshots, model in zip(ranks, models):
            with torch.no_grad():
                model.weight.add_(step)
            assert snapshots.take(step, {"model": model}, dict)
            assert snapshots.replication is not None and snapshots.replication.sender.wait_idle(10)
        if step == 2:
            expected = models[1].weight.clone()
    ranks[1].store.remove()  # node nB's memory: rank 1's snapshots, and the replica of rank 0 it held
    assert ranks[1].replication is not None
    ranks[1].replication.clear()
    assert [s.store.valid_steps() for s in ranks] == [[3, 2], []]
    ranks[0].store.discard_after(2)  # rank 0 was one snapshot further than the others: 2 is the newest in common

    results: list[Any] = [None, None]
    agreed = agree_all([sorted(set(s.store.valid_steps()) | set(s.replication.steps() if s.replication else []),
                               reverse=True) for s in ranks])
    assert agreed == [2, 2]
    for rank, snapshots in enumerate(ranks):
        results[rank] = snapshots.restore(2, {"model": models[rank]}, seed=0)
    assert torch.equal(models[1].weight, expected)
    (replica_of_1,) = job_dir("123", "run-abc", tmp_path).glob("replica-of-rank1-on-nA")
    assert SnapshotStore(replica_of_1, ranks[1].store.identity).valid_steps() == [3, 2]
    for snapshots in ranks:
        snapshots.remove()
    assert not job_dir("123", "run-abc", tmp_path).exists()


def test_the_batch_scripts_teardown_removes_the_replicas_too(tmp_path: Path) -> None:
    SnapshotStore(replica_dir("123", "run-abc", 0, "nB", tmp_path), R0).write(1, dump("x"))
    SnapshotStore.for_rank(R1, tmp_path).write(1, dump("x"))
    assert remove_job("123", base=tmp_path) == [job_dir("123", "run-abc", tmp_path)]
    assert list(tmp_path.iterdir()) == []


def test_a_fresh_start_removes_the_replica_held_and_goes_on_holding_the_next(
        tmp_path: Path, pair: tuple[Replication, Replication]) -> None:
    zero, one = pair
    own = SnapshotStore.for_rank(R0, tmp_path)
    zero.offer(own.write(1, dump("old")))
    assert zero.sender.wait_idle(10) and one.held.valid_steps() == [1]
    holder = MemorySnapshots(SnapshotStore.for_rank(R1, tmp_path), every=1, version=None)
    holder.replication = one
    holder.discard()  # load(fresh=True)
    assert not one.held.directory.exists()
    zero.offer(own.write(2, dump("new")))
    assert zero.sender.wait_idle(10) and one.held.valid_steps() == [2] and zero.sender.failure is None


@pytest.mark.parametrize("when", ["before it is sent", "while it is sent"])
def test_a_snapshot_written_over_is_superseded_and_the_replica_held_stays_whole(
        when: str, tmp_path: Path, pair: tuple[Replication, Replication], monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender sends the slot's file as it is (no copy, no CRC-32 of its own): the two snapshots after it may
    write over it before or during the send. Either way it is superseded (no failure), and the holder commits
    nothing torn: it keeps step 2."""
    zero, one = pair
    own = SnapshotStore.for_rank(R0, tmp_path)
    zero.offer(own.write(2, dump("step 2 " * 1000)))
    assert zero.sender.wait_idle(10) and one.held.valid_steps() == [2]
    first = own.write(3, dump("step 3 " * 1000))
    if when == "before it is sent":
        own.write(4, dump("step 4"))
        own.write(5, dump("step 5 " * 2000))  # step 3's slot again
    else:
        request = zero.partner._request

        def overwritten_after_the_go(message: dict[str, Any]) -> Any:
            answer = request(message)  # the holder waits for `bytes` bytes with step 3's CRC-32
            own.write(4, dump("step 4"))
            own.write(5, dump("step 5 " * 2000))  # longer: the sender sends the first `bytes` of it
            return answer

        monkeypatch.setattr(zero.partner, "_request", overwritten_after_the_go)
    with pytest.raises(Superseded):
        zero.partner.put(first)
    zero.offer(first)
    assert zero.sender.wait_idle(10) and zero.sender.failure is None
    assert one.held.valid_steps() == [2] and load(zero.fetch(2)) == "step 2 " * 1000


def test_a_size_beyond_the_holders_budget_is_refused_before_the_replica_held_is_touched(tmp_path: Path) -> None:
    """The holder's budget (mgpu.state.memory.snapshots.MemorySnapshots.replica_refusal: the room of its node, twice its
    own snapshot): a put announcing 2**40 bytes, or a step of `true`, is refused before its slot is touched; the
    two replicas held stay whole (the older one used to be overwritten)."""
    directory = FakeDirectory()
    holder = MemorySnapshots(SnapshotStore.for_rank(R1, tmp_path), every=1, version=None)
    zero = Replication.start(R0, node="nA", ranks_per_node=1, num_nodes=2, host="127.0.0.1",
                             directory=lambda: directory, base=tmp_path, timeout=5)
    one = Replication.start(R1, node="nB", ranks_per_node=1, num_nodes=2, host="127.0.0.1",
                            directory=lambda: directory, base=tmp_path, timeout=5, budget=holder.replica_refusal)
    assert zero is not None and one is not None
    try:
        own = SnapshotStore.for_rank(R0, tmp_path)
        for step in (1, 2):
            zero.offer(own.write(step, dump(f"whole {step}")))
            assert zero.sender.wait_idle(10)
        answer = put_raw(zero, {"step": 3, "crc32": "00000000"}, b"", declared=1 << 40)
        assert answer is not None and answer["ok"] is False and answer["why"].startswith(
            f"refused by its holder: {tmp_path} has ") and "a replica of 1099511627776 bytes needs" in answer["why"]
        assert put_raw(zero, {"step": True, "crc32": "00000000"}, b"x") == {
            "ok": False, "why": "a put of step True announcing 1 bytes"}
        holder.last_bytes = 1000
        answer = put_raw(zero, {"step": 3, "crc32": "00000000"}, b"", declared=3 << 20)
        assert answer == {"ok": False, "why": "refused by its holder: 3145728 bytes, more than twice this rank's own "
                                              "snapshot (1000 bytes)"}
        assert one.held.valid_steps() == [2, 1] and load(zero.fetch(1)) == "whole 1"
    finally:
        zero.close()
        one.close()
