"""The timeout ladder (mgpu.stop.ladder): its rungs in order, and a table per rule that a setting can break, each
said in one line; the ledger's record shown back (mgpu.record.timeouts)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mgpu.cluster.kill_time import KillTimes
from mgpu.config.schema import Config
from mgpu.record.timeouts import ladder_lines, newest_ladder
from mgpu.stop.ladder import EXIT_S, VERDICT_S, Figures, ladder
from mgpu.stop.watchdog import Watchdog

DEFAULTS = Config()


def figures(**changes: object) -> Figures:
    """A run with the default config, its first step of 0.2 s done, the collective timeout the watchdog sets, a
    save measured at 1.2 s, under Slurm with KillWait 30 s and GraceTime 10 s."""
    w = DEFAULTS.watchdog
    base = Figures(init_timeout_s=DEFAULTS.distributed.init_timeout_s, watchdog=True, step_multiple=w.step_multiple,
                   floor_s=w.floor_s, first_step_s=w.first_step_s, eval_s=w.eval_s, save_allowance_s=w.checkpoint_s,
                   resume_allowance_s=w.first_step_s, expected_save_s=1.2, step_s=0.2, collective_timeout_s=None,
                   agree_every=None, kill=KillTimes(30.0, 10.0), deadline_margin_s=DEFAULTS.preemption.deadline_margin_s)
    return replace(base, **changes)  # type: ignore[arg-type]  # the test's own keyword arguments


def test_the_defaults_keep_every_order_and_the_rungs_go_inner_to_outer() -> None:
    w = DEFAULTS.watchdog
    dog = Watchdog(0, 2, board=None, step_multiple=w.step_multiple, floor_s=w.floor_s,  # type: ignore[arg-type]
                   first_step_s=w.first_step_s, checkpoint_s=w.checkpoint_s, eval_s=w.eval_s, on_hang=lambda *a: None)
    collective = dog.collective_timeout(w.collective_timeout_s)  # where it is computed
    result = ladder(figures(collective_timeout_s=collective))
    assert result.problems == []
    names = [r.name for r in result.hang]
    assert names == ["step", "evaluation", "save", "resume", "first step", "verdict", "collective", "rendezvous"]
    seconds = {r.name: r.seconds for r in result.hang}
    assert collective == seconds["collective"] >= max(seconds[n] or 0 for n in names[:5]) + VERDICT_S  # type: ignore[operator]
    assert seconds["rendezvous"] > seconds["collective"]  # type: ignore[operator]
    assert [r.name for r in result.stop] == ["agreement", "stop's save", "decision", "KillWait", "GraceTime + KillWait",
                                             "exit"]
    assert VERDICT_S == 50.0 and EXIT_S == 8.0


RULES = {
    # name: (changes, the problem's first words, or None when the order holds)
    "a rendezvous timeout shorter than the first step's allowance and its verdict": (
        {"init_timeout_s": 300.0}, "distributed.init_timeout_s (300 s) is shorter than watchdog.first_step_s (600 s)"),
    "... just long enough": ({"init_timeout_s": 650.0}, None),
    "... no watchdog, no allowance to outlast": ({"init_timeout_s": 300.0, "watchdog": False}, None),
    "a collective timeout that ends before the longest allowance and its verdict": (
        {"collective_timeout_s": 600.0}, "the collective timeout (600 s) ends before the longest watchdog allowance"),
    "... the one the watchdog sets": ({"collective_timeout_s": 650.0}, None),
    "a stop's save that does not fit KillWait (scancel, GraceTime 0)": (
        {"expected_save_s": 30.0, "kill": KillTimes(30.0, None)}, "a stop needs about 34 s (agreement, save, decision) "
                                                                  "but Slurm's KillWait is 30 s"),
    "... one that does": ({"expected_save_s": 25.0, "kill": KillTimes(30.0, None)}, None),
    "... the test cluster's KillWait of 5 s, a quick save: the exit after it may be cut, nothing is lost": (
        {"expected_save_s": 0.5, "kill": KillTimes(5.0, 0.0)}, None),
    "... GraceTime not known: only KillWait checked": ({"expected_save_s": 20.0, "kill": KillTimes(60.0, None)}, None),
    "... no Slurm job: nothing to fit": ({"expected_save_s": 4000.0, "kill": None}, None),
    "a deadline margin shorter than the exit": ({"deadline_margin_s": 5.0}, "preemption.deadline_margin_s (5 s) is "
                                                                            "shorter than the exit after a stop (8 s)"),
    "... 0: the time limit's signal alone": ({"deadline_margin_s": 0.0}, None),
}


@pytest.mark.parametrize("name", RULES)
def test_each_rule(name: str) -> None:
    changes, expected = RULES[name]
    problems = ladder(figures(**changes)).problems
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(expected), problems
        assert "\n" not in problems[0]  # one line


def test_a_stop_that_does_not_fit_a_preemptions_window() -> None:
    # GraceTime + KillWait is the longer window: a stop that does not fit it does not fit KillWait alone either.
    killwait, grace = ladder(figures(expected_save_s=28.0, kill=KillTimes(40.0, 10.0), agree_every=4,
                                     step_s=5.0)).problems
    assert killwait.startswith("a stop needs about 56 s (agreement, save, decision) but Slurm's KillWait is 40 s")
    assert grace == ("a stop needs about 56 s (agreement, save, decision) but a preemption gives 50 s (GraceTime 10 s "
                     "+ KillWait 40 s): a preempted run loses the steps since its last checkpoint; checkpoint more "
                     "often (checkpoint.every_steps, checkpoint.memory_every_steps) or ask the cluster for a longer "
                     "GraceTime")
    assert ladder(figures(expected_save_s=28.0, kill=KillTimes(60.0, 10.0), agree_every=4, step_s=5.0)).problems == []
    # GraceTime 0: the preemption's window is KillWait's, said once
    assert [r.name for r in ladder(figures(kill=KillTimes(5.0, 0.0))).stop] == ["agreement", "stop's save", "decision",
                                                                                "KillWait", "exit"]


def test_the_ledgers_ladder_is_shown_back() -> None:
    record = ladder(figures(init_timeout_s=300.0)).record()
    lines = ladder_lines(record)
    assert lines[0].startswith("timeouts    inner to outer")
    assert "  step                     60 s  10 x the median step (0.2 s), at least watchdog.floor_s" in lines
    assert "  rendezvous              300 s  distributed.init_timeout_s: the group's timeout until the first step" in lines
    assert lines[-1].startswith("  order broken: distributed.init_timeout_s (300 s)")
    events = [{"event": "started", "ladder": record}, {"event": "progress"},
              {"event": "first_step", "ladder": {"hang": [], "stop": [], "problems": []}}]
    assert newest_ladder(events) == {"hang": [], "stop": [], "problems": []}
    assert newest_ladder(events[:2]) == record and newest_ladder([]) is None
    assert ladder_lines({"hang": "?", "stop": [["x", "not a number", ""]]}) == [lines[0], "  a stop, from Slurm's first "
                                                                                          "signal:"]
