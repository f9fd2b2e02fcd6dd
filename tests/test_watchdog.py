"""The watchdog: who is to blame (a table), the allowance it learns, and hung ranks on real gloo groups:
a rank asleep inside its loss, a frozen (SIGSTOPped) rank, a rank stuck in a checkpoint write."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from mgpu.ledger import read_ledger
from mgpu.watchdog import HANG_EXIT_CODE, Heartbeat, Watchdog, blame
from tests.test_faults import finish_step, start_step

NOW = 1000.0


def hb(rank: int, step: int, phase: str, written: float = NOW - 1) -> Heartbeat:
    return Heartbeat(rank, f"n{rank // 2 + 1}", 100 + rank, step, phase, written - 5, written)


@pytest.mark.parametrize("beats, stuck", [
    ([hb(0, 5, "backward"), hb(1, 5, "forward")], [1]),                      # asleep in its loss
    ([hb(0, 5, "model"), hb(1, 5, "forward")], [1]),  # ... while the other waits in DDP's buffer broadcast
    ([hb(0, 5, "backward"), hb(1, 5, "backward", written=NOW - 60)], [1]),   # frozen: its file stopped
    ([hb(0, 5, "write"), hb(1, 5, "checkpoint-wait"), hb(2, 5, "checkpoint-wait")], [0]),  # rank 0's save
    ([hb(0, 7, "eval"), hb(1, 7, "agree"), hb(2, 7, "agree"), hb(3, 7, "agree")], [0]),    # one slow eval batch
    ([hb(0, 6, "data"), hb(1, 6, "forward"), hb(2, 6, "backward")], [0, 1]),  # behind the furthest
    ([hb(0, 5, "backward"), hb(1, 5, "backward")], []),                       # all waiting: nobody to blame
    ([hb(0, 4, "backward"), hb(1, 5, "backward")], [0]),                      # a step behind
    ([], []),
])
def test_blame(beats: list[Heartbeat], stuck: list[int]) -> None:
    assert blame(beats, fresh_after=NOW - 8) == stuck


def test_a_rank_without_a_heartbeat_is_blamed() -> None:
    assert blame([hb(0, 5, "model"), hb(2, 5, "model")], NOW - 8, world=3) == [1]


def test_the_allowance_is_learned_from_the_run(tmp_path: Path) -> None:
    dog = Watchdog(0, 1, tmp_path, step_multiple=10, floor_s=1, first_step_s=300, checkpoint_s=50,
                   on_hang=lambda *args: None)
    dog._step_started = time.time()
    assert dog.allowance() == 300  # before any step: the first step's allowance
    for step in range(2, 8):
        dog.beat("forward")
        dog.since -= 0.2  # pretend each step took 0.2 s
        dog._step_started -= 0.2
        dog.beat("data", step)
    assert dog.allowance() == pytest.approx(2.0, rel=0.2)  # 10 x the median step time
    dog.beat("checkpoint")
    assert dog.allowance() == 50
    dog.beat("eval")
    assert dog.allowance() == 300  # no evaluation batch timed yet


@pytest.mark.parametrize("configured, step_s, expected", [
    (300, None, 650),     # the defaults: the largest allowance (600 s) and the time to notice and leave evidence
    (2000, None, 2000),   # a longer one asked for is kept
    (300, 100.0, 1050),   # 100 s steps: 10 x the step time, then the margin
])
def test_the_collective_timeout_outlasts_every_allowance(configured: float, step_s: float | None,
                                                         expected: float) -> None:
    dog = Watchdog(0, 2, Path("."), step_multiple=10, floor_s=60, first_step_s=600, checkpoint_s=600,
                   on_hang=lambda *args: None)
    if step_s is not None:
        dog._step_times.append(step_s)
    assert dog.collective_timeout(configured) == pytest.approx(expected)


# ------------------------------------------------------------------------- hung ranks, real gloo groups
HANG = ["task.target=tests.tasks:HangingBlobTask", "task.args.step_s=0.05", "train.epochs=30", "data.batch_size=4",
        "log.every_steps=1", "watchdog.floor_s=2", "watchdog.step_multiple=5", "watchdog.first_step_s=30",
        "watchdog.checkpoint_s=4", "log.tensorboard=false"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, rank, culprit_phase", [("sleep", 1, "forward"), ("stop", 1, None),
                                                       ("save", 0, "write")])
def test_a_hung_rank_is_found_named_and_ended(mode: str, rank: int, culprit_phase: str | None,
                                              tmp_path: Path) -> None:
    extra = ["checkpoint.every_steps=1", "checkpoint.async_save=false"] if mode == "save" else []
    procs = start_step(tmp_path, 2, *HANG, f"task.args.mode={mode}", f"task.args.rank={rank}", "task.args.at=8",
                       *extra)
    started = time.monotonic()
    if mode == "stop":
        # A frozen rank cannot end itself: the others' exit ends the step (srun --kill-on-bad-exit does this
        # on a cluster); here the test kills it once the other rank has gone.
        other = procs[1 - rank]
        other.wait(timeout=120)
        os.kill(procs[rank].pid, signal.SIGKILL)
    results = finish_step(procs, timeout=120)
    elapsed = time.monotonic() - started
    codes = [rc for rc, _ in results]
    assert codes[1 - rank] == HANG_EXIT_CODE, results[1 - rank][1][-2000:]
    if mode != "stop":
        assert codes[rank] == HANG_EXIT_CODE, results[rank][1][-2000:]
    (hang,) = [e for e in read_ledger(tmp_path / "events.jsonl") if e["event"] == "hang"]
    assert hang["ranks"] == [rank] and len(hang["hosts"]) == 1, hang
    assert (rank in hang["frozen"]) == (mode == "stop"), hang
    if culprit_phase:
        assert hang["phases"][str(rank)] == culprit_phase, hang
    assert hang["waited_s"] < 30 and elapsed < 90
    # Evidence: every thread's stack of each rank that could still run, in its log.
    for r in range(2):
        if mode == "stop" and r == rank:
            continue
        text = (tmp_path / "logs" / f"rank{r}.log").read_text()
        assert "Thread 0x" in text and "most recent call first" in text, text[-2000:]
    if mode == "sleep":
        assert re.search(r'File ".*tests/tasks.py", line \d+ in loss', (tmp_path / "logs" / "rank1.log").read_text())


@pytest.mark.multiprocess
def test_a_slow_but_healthy_rank_is_not_hung(tmp_path: Path) -> None:
    # The case: rank 1's loss takes 3x as long (3 s) as rank 0's (1 s), so rank 0 waits ~2 s for it
    # in every step (DDP's forward broadcasts the batch-norm buffers), and once, at step 6, 1.5 s more.
    # Allowance: step_multiple 2 x the median step time, floor 1 s. Learned from the step's wall time (3 s,
    # the wait included) it is 6 s on both ranks: no hang. Learned from rank 0's own compute (1 s) it would
    # be 2 s, and rank 0's 3.5 s wait at step 6 would be called a hang. (With step_multiple >= 2, the
    # config's least, a steady 3x rank alone leaves a wait of exactly 2 x the fast rank's compute: the pause
    # makes the difference between the two ways of learning certain, while staying within the 6 s.)
    results = finish_step(start_step(tmp_path, 2, "task.target=tests.tasks:UnevenBlobTask", "task.args.step_s=1.0",
                                     "task.args.slow_factor=3", "task.args.pause_at=6", "task.args.pause_s=1.5",
                                     "train.epochs=2", "data.batch_size=4", "log.every_steps=1", "watchdog.floor_s=1",
                                     "watchdog.step_multiple=2", "watchdog.first_step_s=30",
                                     "watchdog.checkpoint_s=30", "log.tensorboard=false"), timeout=240)
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    events = read_ledger(tmp_path / "events.jsonl")
    assert not [e for e in events if e["event"] == "hang"]
    assert [e["step"] for e in events if e["event"] == "finished"] == [10]


@pytest.mark.multiprocess
def test_a_pause_within_the_allowance_outlasts_a_shorter_collective_timeout(tmp_path: Path) -> None:
    # Rank 1 takes 15x as long per step (1.5 s) as rank 0 computes (0.1 s), and once pauses 13 s more, within
    # the 20 s floor: the 10 s collective timeout asked for would cut rank 0's wait short; it is raised above
    # the watchdog's allowances (here 20 + 50 s), so the watchdog alone judges a hang.
    results = finish_step(start_step(tmp_path, 2, "task.target=tests.tasks:UnevenBlobTask", "task.args.step_s=0.1",
                                     "task.args.slow_factor=15", "task.args.pause_at=6", "task.args.pause_s=13",
                                     "train.epochs=2", "data.batch_size=4", "log.every_steps=1", "watchdog.floor_s=20",
                                     "watchdog.step_multiple=3", "watchdog.first_step_s=10", "watchdog.checkpoint_s=20",
                                     "watchdog.collective_timeout_s=10", "log.tensorboard=false"))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-2000:]
    events = read_ledger(tmp_path / "events.jsonl")
    assert not [e for e in events if e["event"] == "hang"]
    (first,) = [e for e in events if e["event"] == "first_step"]
    assert 70 <= first["collective_timeout_s"] < 100, first
