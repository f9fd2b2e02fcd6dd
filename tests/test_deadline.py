"""mgpu.cluster.deadline: the job's end time as squeue gives it, and when a stop must start (tables; no Slurm)."""

from __future__ import annotations

import datetime as dt

import pytest

from mgpu.cluster.deadline import JobClock, parse_times, time_needed

LOCAL = dt.datetime(2026, 11, 25, 10, 32, 9).timestamp()


@pytest.mark.parametrize("text, expected", [
    ("2026-11-25T10:31:09 2026-11-25T10:32:09\n", (LOCAL - 60, LOCAL)),
    ("2026-11-25T10:31:09 2026-11-25T10:32:09", (LOCAL - 60, LOCAL)),
    ("2026-11-25T10:31:09 NONE\n", (LOCAL - 60, None)),  # no time limit
    ("N/A N/A\n", (None, None)),                        # not started
    ("Unknown Unknown\n", (None, None)),
    ("", (None, None)),                                  # squeue missing, failed or the job is gone
    ("garbage", (None, None)),
    ("2026-11-25T10:32:09", (None, None)),               # not what was asked for
])
def test_parse_times(text: str, expected: tuple[float | None, float | None]) -> None:
    assert parse_times(text) == expected


@pytest.mark.parametrize("step_s, every, write_s, margin_s, limit_s, expected", [
    (0.5, 1, 0.0, 60.0, None, 61.0),     # read one step later at worst: 2 steps, then the margin
    (0.5, 16, 3.0, 60.0, 3600.0, 71.5),  # about a second of steps between agreements
    (10.0, 1, 120.0, 60.0, None, 200.0),  # long steps and a long write
    (0.5, 1, 0.0, 60.0, 60.0, 7.0),      # a 1-minute job: the margin is a tenth of it, not all of it
])
def test_time_needed(step_s: float, every: int, write_s: float, margin_s: float, limit_s: float | None,
                     expected: float) -> None:
    assert time_needed(step_s, every, write_s, margin_s, limit_s) == pytest.approx(expected)


def test_the_clock_keeps_the_last_known_end_and_follows_a_changed_limit() -> None:
    answers = iter(["2026-11-25T09:32:09 2026-11-25T10:32:09\n", "", "2026-11-25T09:32:09 2026-11-25T11:32:09\n"])
    clock = JobClock("42", read=lambda job: next(answers))
    assert clock.refresh() == LOCAL and clock.limit_s == 3600
    assert clock.refresh() == LOCAL  # squeue did not answer this time: the end is still known
    assert clock.refresh() == LOCAL + 3600 and clock.limit_s == 7200  # `scontrol update TimeLimit=` moved it
    assert not clock.too_close(LOCAL + 3600 - 100, 99) and clock.too_close(LOCAL + 3600 - 100, 100)
    assert not JobClock("7", read=lambda job: "N/A N/A").too_close(LOCAL, 1e9)  # no limit: never too close


@pytest.mark.parametrize("needed_s, too_short", [(29.0, False), (30.0, False), (31.0, True)])
def test_a_stop_that_needs_most_of_the_time_limit_is_left_to_the_signal(needed_s: float, too_short: bool) -> None:
    # Seen in CI: a 1-minute job with the 60 s margin stopped after its first steps, was requeued with the
    # same limit and did it again, ten times in a row, 3 steps a run.
    clock = JobClock("42", read=lambda job: "2026-11-25T10:31:09 2026-11-25T10:32:09")
    clock.refresh()
    assert clock.too_short(needed_s) == too_short
    assert not JobClock("7", read=lambda job: "N/A N/A").too_short(1e9)  # no limit known: nothing to judge


# ------------------------------------------------------------------------------------------ drains (issue 32)
NODE = "NodeName={name} Arch=x86_64 CoresPerSocket=1 State={state} Partitions=main Reason={reason}"


@pytest.mark.parametrize("states, expected", [
    ([("n1", "ALLOCATED", "(null)"), ("n2", "ALLOCATED", "(null)")], {}),
    ([("n1", "ALLOCATED", "(null)"), ("n2", "MIXED+DRAIN", "x")], {"n2": "MIXED+DRAIN (x)"}),
    ([("n1", "ALLOCATED+DRAIN", "disk")], {"n1": "ALLOCATED+DRAIN (disk)"}),   # draining: its jobs still run
    ([("n1", "ALLOCATED+MAINT", "(null)")], {"n1": "ALLOCATED+MAINT"}),         # in a maintenance reservation
    ([("n1", "MIXED+REBOOT_REQUESTED", "kernel")], {"n1": "MIXED+REBOOT_REQUESTED (kernel)"}),
    ([("n1", "ALLOCATED*", "(null)")], {}),                                    # not responding: not a drain
])
def test_draining_nodes(states: list[tuple[str, str, str]], expected: dict[str, str]) -> None:
    from mgpu.cluster.deadline import draining_nodes

    text = "\n".join(NODE.format(name=n, state=s, reason=r) for n, s, r in states) + "\n"
    assert draining_nodes(text) == expected
    assert draining_nodes("") == {}


def test_the_clock_watches_the_jobs_own_nodes() -> None:
    asked: list[tuple[str, ...]] = []
    answers = iter(["", NODE.format(name="n2", state="MIXED+DRAIN", reason="x")])

    def read_nodes(nodes: tuple[str, ...]) -> str:
        asked.append(tuple(nodes))
        return next(answers)

    clock = JobClock("7", read=lambda job: "", nodes=("n1", "n2"), read_nodes=read_nodes)  # type: ignore[arg-type]
    clock.refresh()
    assert clock.draining == {}
    clock.refresh()
    assert clock.draining == {"n2": "MIXED+DRAIN (x)"} and asked == [("n1", "n2")] * 2
    assert JobClock("7", read=lambda job: "").draining == {}  # no nodes given: none asked about
