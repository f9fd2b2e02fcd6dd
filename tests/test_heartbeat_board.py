"""One board per job (mgpu.stop.heartbeat_board): a rank whose watchdog cannot reach the rendezvous store at its
start keeps the store as its board and connects at a later heartbeat; it used to fall back to its node's
directory, where no other rank looks (at 32 ranks on 2 cores three live ranks were blamed for a hang as
frozen, the culprit not). In one process: a real TCPStore and gloo group of one; the failed first connection
is the one fake (a connection refused under load cannot be made to happen on demand)."""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any, Iterator

import pytest
import torch.distributed as dist

from mgpu.stop import heartbeat_board
from mgpu.stop.heartbeat_board import RECONNECT_EVERY_S, DirBoard, StoreBoard, default_board


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def group() -> Iterator[Any]:
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield store
    finally:
        dist.destroy_process_group()


def test_a_store_out_of_reach_at_the_start_stays_the_board(group: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    real, refused = dist.TCPStore, []

    def first_refused(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("is_master", False) and not refused:
            refused.append(args)
            raise RuntimeError("timed out connecting to the store (a loaded node)")
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "TCPStore", first_refused)
    board = default_board(2, "attempt")
    assert isinstance(board, StoreBoard) and not isinstance(board, DirBoard) and refused
    with pytest.raises(RuntimeError, match="not reachable yet"):
        board.publish(1, '{"beat": 1}')  # within RECONNECT_EVERY_S of the failed try: not asked again
    time.sleep(RECONNECT_EVERY_S + 0.1)
    board.publish(1, '{"beat": 2}')
    other = default_board(2, "attempt")  # another rank's watchdog, on the same store
    assert other.read(2) == {1: '{"beat": 2}'}


def test_reconnects_are_spaced() -> None:
    now, tries = [0.0], []

    def connect() -> Any:
        tries.append(now[0])
        raise RuntimeError("refused")

    board = StoreBoard(connect=connect, clock=lambda: now[0])
    for t in (0.0, 0.5, 1.9, 2.0, 2.1, 4.5):
        now[0] = t
        with pytest.raises(RuntimeError):
            board.publish(0, "x")
    assert tries == [0.0, 2.0, 4.5] and heartbeat_board.RECONNECT_EVERY_S == 2.0


def test_the_last_rank_to_close_a_directory_board_removes_it(tmp_path: Any) -> None:
    """A world on one node's board leaves nothing behind (every run used to leave its directory in /dev/shm);
    a rank that publishes after another removed it makes it again."""
    user = tmp_path / "mgpu-1000"
    boards = [DirBoard(user / "watchdog-0123456789abcdef") for _ in range(2)]
    for rank, board in enumerate(boards):
        board.publish(rank, "{}")
    boards[0].request_stacks(1.0)
    boards[0].close(0)
    assert sorted(p.name for p in boards[0].path.iterdir()) == [".stacks-requested", "heartbeat-rank1.json"]
    boards[1].close(1)
    assert not user.exists()
    boards[1].publish(1, "{}")  # a late heartbeat: the board again, not an error
    assert boards[1].read(2) == {1: "{}"}
    other = DirBoard(user / "watchdog-fedcba9876543210")  # another run's board keeps the user's directory
    boards[1].close(1)
    assert [p.name for p in user.iterdir()] == [other.path.name]


def test_a_directory_board_in_a_slurm_job_is_named_after_the_job() -> None:
    """So that the job's cleanup on every node (`python -m mgpu.state.memory.store --remove-this-job`) removes
    the board of a rank that was killed before it could."""
    from mgpu.stop.heartbeat_board import node_local_dir

    path = node_local_dir("key", {"SLURM_JOB_ID": "42", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "2"})
    assert path.name.startswith("mgpu-40_2-watchdog-") and path.parent.name in ("shm", "tmp")
    assert node_local_dir("key", {}).parent.name.startswith("mgpu-")
