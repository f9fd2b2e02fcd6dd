"""The save's allowance from the saves measured so far (mgpu.save_budget): tables, the ledger's tail read
back, and a Session that sizes its watchdog and its deadline stop from an earlier run's saves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mgpu.config import Config
from mgpu.ledger import Ledger, read_ledger
from mgpu.save_budget import RECENT, SAFETY, Save, expected_save_s, parse_saves, save_allowance_s, saves_in_ledger

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
    from mgpu.environment import detect_environment
    from mgpu.session import Session

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
