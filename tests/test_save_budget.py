"""The save's allowance from the saves measured so far (mgpu.state.save_budget): tables, the ledger's tail read
back, and a Session that sizes its watchdog and its deadline stop from an earlier run's saves."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from mgpu.config.loading import Config, load_config
from mgpu.record.ledger import Ledger, read_ledger
from mgpu.state.save_budget import RECENT, SAFETY, TAIL_BYTES, Save, expected_save_s, parse_saves, save_allowance_s, saves_in_ledger

GB, MB = 10**9, 10**6


def saved(seconds: Any, size: Any, **extra: Any) -> dict[str, Any]:
    return {"event": "checkpoint_saved", "time": 1.0, "seconds": seconds, "bytes": size, **extra}


@pytest.mark.parametrize("event, expected", [
    (saved(2.0, 100), [Save(2.0, 100, 1, False)]),
    (saved(2.0, 100, sharded=True, world_size=4), [Save(2.0, 100, 4, True)]),
    (saved(2.0, 100, sharded=True), [Save(2.0, 100, 1, True)]),  # a world size it does not say: one writer
    (saved(0, 100), []), (saved(2.0, 0), []), (saved(-1, 100), []), (saved(float("nan"), 100), []),
    (saved("2", 100), []), (saved(2.0, None), []), (saved(True, 100), []),
    ({"event": "progress", "seconds": 2.0, "bytes": 100}, []),
])
def test_parse_saves(event: dict[str, Any], expected: list[Save]) -> None:
    assert parse_saves([event]) == expected


S = lambda seconds, size, writers=1: Save(seconds, size, writers, writers > 1)  # noqa: E731


@pytest.mark.parametrize("saves, world, expected", [
    ([], 4, None),  # nothing measured: the configured allowance alone
    ([S(10.0, 1 * GB)], 4, 10.0),  # single file: rank 0 writes it all on any world size
    ([S(10.0, 1 * GB), S(20.0, 1 * GB)], 1, 20.0),  # the slowest rate of the recent saves
    ([S(10.0, 1 * GB), S(10.0, 2 * GB)], 1, 20.0),  # the newest size: it grew, at the slowest rate (100 MB/s)
    ([S(100.0, 1 * GB)] + [S(1.0, 1 * GB)] * RECENT, 1, 1.0),  # a slow save older than RECENT saves: forgotten
    ([S(10.0, 4 * GB, 4)], 4, 10.0),  # sharded on the same world size
    ([S(10.0, 4 * GB, 4)], 2, 20.0),  # 4 -> 2 ranks: twice the bytes per rank
    ([S(10.0, 4 * GB, 4)], 8, 10.0),  # 4 -> 8 ranks: assumed no faster (the filesystem's total rate)
    ([S(588.0, 50 * GB)], 4, 588.0),  # the 50 GB at 85 MB/s
])
def test_expected_save_s(saves: list[Save], world: int, expected: float | None) -> None:
    assert expected_save_s(saves, world) == pytest.approx(expected)


@pytest.mark.parametrize("expected_s, configured_s, allowance", [
    (None, 600.0, 600.0),  # a run's first save: the configured allowance
    (1.0, 600.0, 600.0),  # a fast filesystem never lowers it
    (588.0, 600.0, SAFETY * 588.0),  # 50 GB at 85 MB/s: past 600 s, raised
    (300.0, 60.0, SAFETY * 300.0),
])
def test_save_allowance_s(expected_s: float | None, configured_s: float, allowance: float) -> None:
    assert save_allowance_s(expected_s, configured_s) == pytest.approx(allowance)


def test_the_ledgers_tail_gives_the_saves(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    assert saves_in_ledger(path) == []  # no ledger yet
    ledger = Ledger(path, "1", 0)
    ledger.write("checkpoint_saved", step=1, seconds=50.0, bytes=1 * GB, path="x", reason="periodic")
    for step in range(2000):  # progress events push the first save out of a small tail
        ledger.write("progress", step=step, metrics={"loss": 1.0})
    ledger.write("checkpoint_saved", step=2, seconds=5.0, bytes=1 * GB, path="y", reason="preemption",
                 sharded=True, world_size=2)
    with open(path, "a") as file:
        file.write('{"event": "checkpoint_saved", "seconds": 9')  # a torn last line (a killed writer)
    assert len(read_ledger(path)) == 2002
    assert saves_in_ledger(path) == [Save(50.0, 1 * GB, 1, False), Save(5.0, 1 * GB, 2, True)]
    assert saves_in_ledger(path, tail_bytes=4096) == [Save(5.0, 1 * GB, 2, True)]  # the cut first line skipped
    (tmp_path / "dir.jsonl").mkdir()
    assert saves_in_ledger(tmp_path / "dir.jsonl") == []  # unreadable: nothing measured


def test_a_session_sizes_its_save_allowance_from_earlier_runs(tmp_path: Path) -> None:
    """A requeued run whose earlier run saved 50 GB in 588 s: its watchdog allows 3 x 588 s for a save (not the
    configured 600 s), its collective timeout outlasts that, and the deadline stop counts 588 s for the save
    before this process has saved anything."""
    from mgpu.cluster.environment import detect_environment
    from mgpu.run.session import Session

    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(json.dumps(saved(588.0, 50 * GB, step=3, path="p", reason="preemption")) + "\n")
    config = Config()
    session = Session(run, seed=0, config=config, env=detect_environment({}))
    try:
        assert session.watchdog is not None
        assert session.watchdog.checkpoint_s == pytest.approx(SAFETY * 588.0)
        assert session.watchdog.collective_timeout(config.watchdog.collective_timeout_s) > SAFETY * 588.0
        assert session.stopper is not None and session.stopper.longest_write_s() == pytest.approx(588.0)
        session.load({"progress": {"step": 0}})
        assert not session.should_stop(save=False)
    finally:
        session.finish()
    (first,) = [e for e in read_ledger(run / "events.jsonl") if e["event"] == "first_step"]
    assert first["checkpoint_allowance_s"] == pytest.approx(SAFETY * 588.0, abs=0.1)
    fresh = tmp_path / "fresh"
    session = Session(fresh, seed=0, config=config, env=detect_environment({}))
    try:  # nothing measured: the configured allowance, and no save time assumed
        assert session.watchdog is not None and session.watchdog.checkpoint_s == config.watchdog.checkpoint_s
        assert session.stopper is not None and session.stopper.longest_write_s() == 0.0
    finally:
        session.finish()


# ------------------------------------------------------------------ issue 30: allowances from everything known
from mgpu.state.save_budget import (MAX_ALLOWANCE_S, OUTLIER, READ_PASSES, SLOWEST_READ_BYTES_S,  # noqa: E402
                                    expected_resume_s, lower_bounds, newest_checkpoint)
from mgpu.record.save_record import Attempt, read_attempts, record_path  # noqa: E402


@pytest.mark.parametrize("saves, world, at_least, expected", [
    ([S(10.0, 1 * GB)] * 4 + [S(1e6, 1 * GB)], 1, 0.0, 10.0),  # timed across a suspended job: left out
    ([S(10.0, 1 * GB), S(10.0 * OUTLIER * 0.9, 1 * GB)], 1, 0.0, 90.0),  # slower, not absurdly: counts
    ([S(1e12, 1 * GB)], 1, 0.0, MAX_ALLOWANCE_S),  # the only figure, absurd: capped
    ([], 1, 700.0, 700.0),  # nothing saved yet, one save killed after 700 s: at least that
    ([S(10.0, 1 * GB)], 1, 700.0, 700.0),  # ... and after a success, the failure since it bounds it
    ([], 1, 1e9, MAX_ALLOWANCE_S),
])
def test_expected_save_s_robust_and_bounded(saves: list[Save], world: int, at_least: float,
                                            expected: float) -> None:
    assert expected_save_s(saves, world, at_least) == pytest.approx(expected)


A = lambda kind, started, outcome, seconds=None, size=None, writers=1: Attempt(  # noqa: E731
    kind, started, outcome, seconds, size, writers, writers > 1, "7", 0)


@pytest.mark.parametrize("attempts, world, alive, expected", [
    ([], 1, None, 0.0),
    ([A("save", 0, "killed", 650.0)], 1, None, 650.0),  # the watchdog ended the first save after 650 s
    ([A("save", 0, "failed", 30.0), A("save", 100, "killed", 650.0)], 1, None, 650.0),  # the longest
    ([A("save", 0, "killed", 650.0), A("save", 900, "saved", 800.0, GB)], 1, None, 0.0),  # a success since
    ([A("save", 0, "open")], 1, None, 0.0),  # killed without a word, nothing after its start: unknown
    ([A("save", 0, "open")], 1, 400.0, 400.0),  # ... its process's last event 400 s after its start
    ([A("save", 0, "open"), A("resume", 300, "open")], 1, 400.0, 300.0),  # ... but the next run began at 300
    ([A("save", 0, "killed", 600.0, writers=4)], 2, None, 1200.0),  # sharded, 4 -> 2 ranks: twice per rank
    ([A("save", 0, "killed", 600.0, writers=4)], 8, None, 600.0),  # 4 -> 8 ranks: assumed no faster
    ([A("resume", 0, "killed", 650.0)], 1, None, 0.0),  # a resume's is not a save's
    ([A("save", 0, "killed", 1e12)], 1, None, MAX_ALLOWANCE_S),
])
def test_lower_bounds(attempts: list[Attempt], world: int, alive: float | None, expected: float) -> None:
    assert lower_bounds(attempts, "save", world, lambda attempt: alive) == pytest.approx(expected)


@pytest.mark.parametrize("resumes, saves, at_least, expected", [
    ([], [], 0.0, None),  # nothing known
    # Before any resume: read twice, at the slower of the write rate and SLOWEST_READ_BYTES_S (issue 46: 50 MB/s)
    ([], [S(588.0, 50 * GB)], 0.0, READ_PASSES * 50 * GB / SLOWEST_READ_BYTES_S),
    ([], [S(1800.0, 50 * GB)], 0.0, READ_PASSES * 1800.0),  # a write slower than that: its rate
    ([S(100.0, 50 * GB)], [S(588.0, 50 * GB)], 0.0, 100.0),  # a resume measured: its read rate
    ([S(100.0, 50 * GB)], [S(588.0, 100 * GB)], 0.0, 200.0),  # the checkpoint grew since
    ([S(100.0, 50 * GB)] * 2 + [S(1e9, 50 * GB)], [S(588.0, 50 * GB)], 0.0, 100.0),  # an absurd one left out
    ([], [], 1300.0, 1300.0),  # a resume killed after 1300 s: at least that
    ([], [S(1e12, GB)], 0.0, MAX_ALLOWANCE_S),
])
def test_expected_resume_s(resumes: list[Save], saves: list[Save], at_least: float, expected: float | None) -> None:
    assert expected_resume_s(resumes, saves, 1, at_least) == pytest.approx(expected)


@pytest.mark.parametrize("checkpoint, world, saves, expected", [
    # Issue 46: a first resume with nothing measured got watchdog.first_step_s whatever the checkpoint's size.
    (Save(0.0, 50 * GB, 1, False), 1, [], READ_PASSES * 1000.0),  # a single file: hashed, then loaded
    (Save(0.0, 50 * GB, 4, True), 4, [], 250.0),  # sharded: each rank reads its quarter once
    (Save(0.0, 50 * GB, 4, True), 2, [], 500.0),  # ... on 2 ranks, half each
    (Save(0.0, 50 * GB, 1, False), 1, [S(5.0, 50 * GB)], READ_PASSES * 1000.0),  # a fast save: the slowest read
    (Save(0.0, 100 * GB, 1, False), 1, [S(588.0, 50 * GB)], READ_PASSES * 2000.0),  # the checkpoint on disk: bigger
])
def test_a_first_resume_is_sized_from_the_checkpoints_bytes(checkpoint: Save, world: int, saves: list[Save],
                                                           expected: float) -> None:
    assert expected_resume_s([], saves, world, 0.0, checkpoint) == pytest.approx(expected)


def test_the_newest_checkpoint_is_read_from_its_meta(tmp_path: Path) -> None:
    assert newest_checkpoint(tmp_path) is None and newest_checkpoint(None) is None
    (tmp_path / "step_00000003").mkdir()
    (tmp_path / "latest").write_text("step_00000003\n")
    assert newest_checkpoint(tmp_path) is None  # no meta.json: none
    (tmp_path / "step_00000003" / "meta.json").write_text(json.dumps({"bytes": 5 * GB, "kind": "sharded",
                                                                        "world_size": 4}))
    assert newest_checkpoint(tmp_path) == Save(0.0, 5 * GB, 4, True)
    (tmp_path / "step_00000003" / "meta.json").write_text(json.dumps({"bytes": 7 * GB}))
    assert newest_checkpoint(tmp_path) == Save(0.0, 7 * GB, 1, False)
    (tmp_path / "step_00000003" / "meta.json").write_text("{torn")
    assert newest_checkpoint(tmp_path) is None


@pytest.mark.parametrize("expected_s, configured_s, allowance", [
    (MAX_ALLOWANCE_S, 600.0, MAX_ALLOWANCE_S),  # SAFETY x a day: capped at a day
    (MAX_ALLOWANCE_S, 2 * MAX_ALLOWANCE_S, 2 * MAX_ALLOWANCE_S),  # a configured allowance stays what it is
])
def test_save_allowance_is_capped(expected_s: float, configured_s: float, allowance: float) -> None:
    assert save_allowance_s(expected_s, configured_s) == pytest.approx(allowance)


def test_the_ledger_keeps_each_attempt_in_the_side_record(tmp_path: Path) -> None:
    """A save opened at its first beat and closed by its ledger event; a failed and a killed one keep how long
    they ran; a resume is closed by the run's `started`; another process's event closes nothing of this one."""
    from mgpu.record.save_record import open_attempt, saving_beat

    path = tmp_path / "events.jsonl"
    ledger = Ledger(path, "7", 0)
    beats: list[str] = []
    beat = saving_beat(lambda phase, step=None: beats.append(phase), path, writers=1, sharded=False, job="7",
                       restart=0)
    beat("checkpoint")
    beat("write")
    ledger.write("checkpoint_saved", step=1, seconds=2.0, bytes=GB, path="x", reason="periodic")
    assert beats == ["checkpoint", "write"]
    open_attempt(path, "save", job="7", restart=0)
    time.sleep(0.01)
    ledger.write("checkpoint_failed", step=2, reason="periodic", error="ENOSPC")
    open_attempt(path, "save", job="7", restart=0)
    Ledger(path, "7", 1).write("checkpoint_failed", step=3, reason="periodic", error="x")  # another process's
    Ledger(path, "7", 0).write("hang", ranks=[0], phases={"0": "write", "1": "checkpoint-wait"})
    open_attempt(path, "resume", job="7", restart=1)
    Ledger(path, "7", 1).write("started", world_size=1)
    saved, failed, killed, resumed = read_attempts(record_path(path)) or []
    assert (saved.kind, saved.outcome, saved.seconds, saved.bytes) == ("save", "saved", 2.0, GB)
    assert (failed.outcome, failed.bytes) == ("failed", GB)  # its size: the newest checkpoint's
    assert failed.seconds is not None and 0.01 <= failed.seconds < 60
    assert killed.outcome == "killed" and killed.seconds is not None and killed.started > failed.started
    assert (resumed.kind, resumed.outcome, resumed.restart) == ("resume", "resumed", 1)
    # Only the side record changed: the ledger lines are what they were, and a record in a shape not known
    # reads as none (the ledger's tail is read instead).
    assert [e["event"] for e in read_ledger(path)] == ["checkpoint_saved", "checkpoint_failed",
                                                       "checkpoint_failed", "hang", "started"]
    record_path(path).write_text('{"attempts": 3}')
    assert read_attempts(record_path(path)) is None
    record_path(path).write_text('{"attempts": [{"kind": "save"}, 5]}')
    assert read_attempts(record_path(path)) == []


def _session(run: Path, config: Config | None = None) -> Any:
    from mgpu.cluster.environment import detect_environment
    from mgpu.run.session import Session

    return Session(run, seed=0, config=config or Config(), env=detect_environment({}))


def test_a_long_ledger_keeps_its_saves_allowance(tmp_path: Path) -> None:
    """Issue 30: after ~17,000 progress lines (past the ledger's 4 MB tail) the last save is still known: the
    watchdog allows SAFETY x 588 s for the next one and the deadline stop leaves 588 s for it, not 0."""
    run = tmp_path / "run"
    Ledger(run / "events.jsonl", "1", 0).write("checkpoint_saved", step=3, seconds=588.0, bytes=50 * GB, path="p",
                                               reason="periodic")
    progress = {"time": 1.0, "event": "progress", "job_id": "1", "restart": 0, "step": 0, "epoch": 0,
                "total_steps": 10**6, "metrics": {"loss": 2.302585, "lr": 0.001, "grad_norm": 1.234567,
                                                  "samples_per_s": 12345.6, "step_time_s": 0.1234},
                "fingerprint": "0x1.23456789abcdep+3"}
    with open(run / "events.jsonl", "a") as file:
        for step in range(17_000):
            file.write(json.dumps({**progress, "step": step}) + "\n")
    assert (run / "events.jsonl").stat().st_size > TAIL_BYTES
    session = _session(run)
    try:
        assert session.watchdog is not None and session.watchdog.checkpoint_s == pytest.approx(SAFETY * 588.0)
        assert session.stopper is not None and session.stopper.longest_write_s() == pytest.approx(588.0)
    finally:
        session.finish()


ABSURD_LOOP = """
import sys
import mgpu
with mgpu.Session(sys.argv[1], seed=0) as session:
    state = session.load({"progress": {"step": 0}})
    while not session.should_stop(save=False) and session.step < 4:
        pass
print("timeouts", session.watchdog.checkpoint_s, session.watchdog.collective_timeout(300.0))
"""


@pytest.mark.multiprocess
def test_an_absurd_save_time_gives_a_sane_capped_timeout(tmp_path: Path) -> None:
    """Issue 30: one save timed across a suspended job (3e12 s) in the ledger: on 2 ranks the allowance and the
    collective timeout the first step sets stay under a day and its slack, and the collectives after it work
    (at 9e12 s gloo's deadline overflowed and every collective failed at once)."""
    from tests.conftest import start_ranks, wait_ranks

    Ledger(tmp_path / "events.jsonl", "1", 0).write("checkpoint_saved", step=3, seconds=3e12, bytes=GB, path="p",
                                                    reason="periodic")
    results = wait_ranks(start_ranks(["-c", ABSURD_LOOP, str(tmp_path)], 2), timeout=120)
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    (first,) = [e for e in read_ledger(tmp_path / "events.jsonl") if e["event"] == "first_step"]
    assert first["checkpoint_allowance_s"] == pytest.approx(MAX_ALLOWANCE_S)
    assert MAX_ALLOWANCE_S < first["collective_timeout_s"] < MAX_ALLOWANCE_S + 120
    assert max(e["step"] for e in read_ledger(tmp_path / "events.jsonl") if e["event"] == "finished") == 4


@pytest.mark.multiprocess
def test_a_first_save_that_does_not_fit_raises_the_next_runs_allowance(tmp_path: Path) -> None:
    """Issue 30: a run's first save outlasts watchdog.checkpoint_s (2 s) and is ended as a hang (exit 4): the
    next run of that directory allows SAFETY x at least as long as it ran, not the same 2 s again (at every
    requeue)."""
    from mgpu.stop.watchdog import HANG_EXIT_CODE
    from tests.test_faults import finish_step, start_step

    ((code, output),) = finish_step(start_step(
        tmp_path, 1, "task.target=tests.tasks:HangingBlobTask", "task.args.step_s=0.01", "task.args.mode=save",
        "task.args.rank=0", "task.args.at=1", "train.epochs=5", "data.batch_size=4", "checkpoint.every_steps=1",
        "checkpoint.async_save=false", "watchdog.checkpoint_s=2", "watchdog.first_step_s=60", "log.tensorboard=false"),
        timeout=120)
    assert code == HANG_EXIT_CODE, output[-3000:]
    (hang,) = [e for e in read_ledger(tmp_path / "events.jsonl") if e["event"] == "hang"]
    assert hang["phases"] == {"0": "write"} and not [e for e in read_ledger(tmp_path / "events.jsonl")
                                                      if e["event"] == "checkpoint_saved"]
    session = _session(tmp_path, load_config(None, ["watchdog.checkpoint_s=2"]))
    try:
        assert session.watchdog is not None
        # The ledger rounds waited_s to 0.1 s (2.46 s reads 2.5, 2.01 s reads 2.0): the save ran at least
        # waited_s - 0.05, and past the 2 s allowance; so the next allowance is about SAFETY x 2 s, not 2 s again.
        assert hang["waited_s"] >= 2.0
        assert session.watchdog.checkpoint_s >= SAFETY * (hang["waited_s"] - 0.05)
    finally:
        session.finish()


def test_allowances_from_the_record_or_the_ledger(tmp_path: Path) -> None:
    """`allowances` reads the side record: a save left open by a process killed without a word (SIGKILL in the
    middle of it) counts until that process's last ledger event; a resume killed as a hang counts for the next
    resume. A run from before the record: the saves in the ledger's tail, as before."""
    from mgpu.state.save_budget import Allowances, allowances
    from mgpu.record.save_record import open_attempt

    path = tmp_path / "events.jsonl"
    ledger = Ledger(path, "9", 0)
    ledger.write("checkpoint_saved", step=1, seconds=10.0, bytes=GB, path="a", reason="periodic")
    assert allowances(path, 1, 60.0, 600.0) == Allowances(10.0, 60.0, 600.0)  # the floors: checkpoint_s, first_step_s
    start = time.time()
    open_attempt(path, "save", job="9", restart=0, now=start)  # a save began; its process's last sign of life
    with open(path, "a") as file:  # came 500 s later (then SIGKILL: no event of the save's end)
        file.write(json.dumps({"time": start + 500, "event": "progress", "job_id": "9", "restart": 0}) + "\n")
    budget = allowances(path, 1, 60.0, 600.0)
    assert budget.expected_save_s == pytest.approx(500.0)
    assert budget.save_allowance_s == pytest.approx(SAFETY * 500.0)
    open_attempt(path, "resume", job="9", restart=1, now=start - 100)  # a resume began 100 s ago ...
    Ledger(path, "9", 1).write("hang", ranks=[], phases={"0": "resume"})  # ... and was ended as a hang now
    assert allowances(path, 1, 60.0, 1.0).resume_allowance_s == pytest.approx(SAFETY * 100.0, abs=3.0)
    legacy = tmp_path / "legacy" / "events.jsonl"  # a ledger from before the side record
    legacy.parent.mkdir()
    legacy.write_text(json.dumps(saved(588.0, 50 * GB, step=3)) + "\n")
    assert allowances(legacy, 1, 600.0, 600.0) == Allowances(588.0, SAFETY * 588.0,
                                                             SAFETY * 2 * 50 * GB / SLOWEST_READ_BYTES_S)
