"""mgpu.deadline: the job's end time as squeue gives it, and when a stop must start (tables; no Slurm)."""

from __future__ import annotations

import datetime as dt

import pytest

from mgpu.deadline import JobClock, parse_end_time, time_needed

LOCAL = dt.datetime(2026, 11, 25, 10, 32, 9).timestamp()


@pytest.mark.parametrize("text, expected", [
    ("2026-11-25T10:32:09\n", LOCAL),
    ("2026-11-25T10:32:09", LOCAL),
    ("N/A\n", None),          # no time limit
    ("Unknown\n", None),
    ("NONE\n", None),
    ("", None),               # squeue missing, failed or the job is gone
    ("garbage", None),
])
def test_parse_end_time(text: str, expected: float | None) -> None:
    assert parse_end_time(text) == expected


@pytest.mark.parametrize("step_s, every, write_s, margin_s, expected", [
    (0.5, 1, 0.0, 60.0, 61.0),     # read one step later at worst: 2 steps, then the margin
    (0.5, 16, 3.0, 60.0, 71.5),    # about a second of steps between agreements
    (10.0, 1, 120.0, 60.0, 200.0),  # long steps and a long write
])
def test_time_needed(step_s: float, every: int, write_s: float, margin_s: float, expected: float) -> None:
    assert time_needed(step_s, every, write_s, margin_s) == pytest.approx(expected)


def test_the_clock_keeps_the_last_known_end_and_follows_a_changed_limit() -> None:
    answers = iter(["2026-11-25T10:32:09\n", "", "2026-11-25T11:32:09\n"])
    clock = JobClock("42", read=lambda job: next(answers))
    assert clock.refresh() == LOCAL
    assert clock.refresh() == LOCAL  # squeue did not answer this time: the end is still known
    assert clock.refresh() == LOCAL + 3600  # `scontrol update TimeLimit=` moved it
    assert not clock.too_close(LOCAL + 3600 - 100, 99) and clock.too_close(LOCAL + 3600 - 100, 100)
    assert not JobClock("7", read=lambda job: "N/A").too_close(LOCAL, 1e9)  # no limit: never too close
