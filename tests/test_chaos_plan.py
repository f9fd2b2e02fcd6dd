"""The chaos benchmark's pure parts (bench/chaos_plan.py): the seeded schedule, the configurations, and the
arithmetic from a ledger to ETTR, steps recomputed and time back per failure. Tables over hand-written ledgers;
no cluster (bench/chaos.py runs them on it)."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from bench.chaos_plan import (BEGIN, END, KINDS, Config, Fired, FailureCost, by_kind, failure_costs, make_plan,
                              may_fire, parse_config, parse_mix, productive, publish, render, run_result,
                              weights_verdict)


def ev(t: float, name: str, job: str = "7", restart: int = 0, **fields: Any) -> dict[str, Any]:
    return {"time": t, "event": name, "job_id": job, "restart": restart, **fields}


def trained(first: float, steps: range, pace: float = 1.0, restart: int = 0, job: str = "7",
            prints: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """A progress event per step, `pace` seconds apart, the first at `first`."""
    return [ev(first + i * pace, "progress", job, restart, step=s, fingerprint=(prints or {}).get(s, f"bits:{s:x}"),
               metrics={"step_time_s": pace}) for i, s in enumerate(steps)]


# ------------------------------------------------------------------------------------------------ schedule
def test_the_same_seed_gives_the_same_plan_and_another_seed_another() -> None:
    mix = parse_mix("all")
    plan = make_plan(44, 60, 600, mix, 4, ("n1", "n2"), 75)
    assert plan == make_plan(44, 60, 600, mix, 4, ("n1", "n2"), 75)
    assert plan.injections != make_plan(45, 60, 600, mix, 4, ("n1", "n2"), 75).injections
    times = [i.at_s for i in plan.injections]
    assert times == sorted(times) and all(0 < t < 600 for t in times)
    assert plan.lines()[0].startswith("seed 44; mean time between failures 60 s (exponential)")
    assert len(plan.lines()) == len(plan.injections) + 1


def test_gaps_are_exponential_of_the_stated_mean_and_kinds_follow_the_weights() -> None:
    plan = make_plan(1, 10, 200_000, parse_mix("kill-rank=3,drain-node=1"), 4, ("n1", "n2"), 75)
    times = [0.0] + [i.at_s for i in plan.injections]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(10, rel=0.03)
    assert statistics.median(gaps) == pytest.approx(10 * 0.693, rel=0.05)  # an exponential's median: mean x ln 2
    kinds = [i.kind for i in plan.injections]
    assert set(kinds) == {"kill-rank", "drain-node"}
    assert kinds.count("kill-rank") / len(kinds) == pytest.approx(0.75, abs=0.02)
    targets = {i.kind: set() for i in plan.injections}
    for i in plan.injections:
        targets[i.kind].add(i.target)
    assert targets == {"kill-rank": {"rank 0", "rank 1", "rank 2", "rank 3"}, "drain-node": {"n1", "n2"}}


def test_a_kind_out_of_the_mix_never_comes_and_preemptions_target_the_job() -> None:
    plan = make_plan(3, 5, 500, parse_mix("preempt-grace0=1,preempt-grace10=1"), 4, ("n1", "n2"), 75)
    assert {i.target for i in plan.injections} == {"job"}
    assert {i.kind for i in plan.injections} == {"preempt-grace0", "preempt-grace10"}


@pytest.mark.parametrize("text, expected", [
    ("all", tuple((k, 1.0) for k in KINDS)),
    ("kill-rank=2, freeze-rank", (("kill-rank", 2.0), ("freeze-rank", 1.0))),
    ("kill-node=1,kill-rank=0", (("kill-node", 1.0),)),  # KINDS' order; a weight of 0 leaves the kind out
])
def test_a_mix_is_parsed(text: str, expected: tuple[tuple[str, float], ...]) -> None:
    assert parse_mix(text) == expected


@pytest.mark.parametrize("text, says", [
    ("kill-ranks=1", "unknown failure kind 'kill-ranks'"), ("kill-rank=x", "must be a number"),
    ("kill-rank=-1", "must be a number >= 0"), ("kill-rank=0", "at least one kind"), ("", "at least one kind"),
])
def test_a_bad_mix_is_one_line(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_mix(text)


@pytest.mark.parametrize("progress, started, since, now, may", [
    (0.0, 5.0, None, 10.0, False),     # submitted at 1, no step yet
    (12.0, 5.0, None, 13.0, True),     # trained since the submission
    (52.0, 5.0, 50.0, 53.0, False),    # a step after a failure at 50 but no new start: maybe still stopping (a grace)
    (80.0, 70.0, 50.0, 81.0, True),    # started again at 70 and trained since
    (69.0, 70.0, 50.0, 71.0, False),   # started again, no step yet
    (139.0, 5.0, 50.0, 139.5, False),  # trained through it for 89.5 s: not yet
    (140.5, 5.0, 50.0, 141.0, True),   # ... for 91 s, and still training: the failure was ignored
    (100.0, 5.0, 50.0, 141.0, False),  # trained a while, then stopped (a frozen rank found late): not over
])
def test_a_failure_waits_until_the_last_one_is_over(progress: float, started: float, since: float | None, now: float,
                                                    may: bool) -> None:
    assert may_fire(progress, started, since, 1.0, now) is may


# ------------------------------------------------------------------------------------------------ configurations
@pytest.mark.parametrize("text, expected", [
    ("defaults=", Config("defaults", False, ())),
    ("previous=checkpoint.memory_every_steps=100 checkpoint.every_steps=0",
     Config("previous", False, ("checkpoint.memory_every_steps=100", "checkpoint.every_steps=0"))),
    ("k1=checkpoint.memory_every_steps=1,watchdog.floor_s=10",
     Config("k1", False, ("checkpoint.memory_every_steps=1", "watchdog.floor_s=10"))),
    ("plain=plain", Config("plain", True, ())),
    ("p50=plain save_every=50", Config("p50", True, ("save_every=50",))),
])
def test_a_configuration_is_parsed(text: str, expected: Config) -> None:
    assert parse_config(text) == expected
    assert parse_config(expected.spec) == expected


@pytest.mark.parametrize("text, says", [
    ("checkpoint.memory_every_steps=100", "use NAME="), ("=x", "use NAME="), ("1x=", "use NAME="),
    ("a=memory_every_steps=1", "no mgpu override"), ("a=checkpoint.every_steps=1 plain", "no mgpu override"),
    ("p=plain every=5", "the plain loop takes"), ("p=plain save_every=x", "the plain loop takes"),
])
def test_a_bad_configuration_is_one_line(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_config(text)


# ------------------------------------------------------------------------------------------------ arithmetic
# A 1 s step. Rank killed at t=155.5 after step 150 (t=150..155 trains 150..155: reached 155); the step starts again
# in place at 170, resumes from 100 (the last save), first step at 178; trains on to step 200.
KILLED = [ev(0, "started"), ev(5, "first_step", step=1), *trained(5, range(1, 156)),
          ev(160, "stop_decision", what="failure", action="restart", error="exit 137"),
          ev(160.1, "restarted", after="failure"),
          ev(170, "started"), ev(170.5, "resumed", step=100), ev(178, "first_step", step=101),
          *trained(178, range(101, 201))]


def test_a_killed_rank_costs_the_steps_since_the_save_and_the_way_back() -> None:
    fired = [Fired("kill-rank", "rank 1", 150.0, 155.5)]
    (cost,) = failure_costs(KILLED, fired, start=0, end=300)
    assert cost == FailureCost("kill-rank", "rank 1", 155.5, True, 55, 22.5)
    assert run_result("x", KILLED, fired, 0, 300, []).lost_steps_ledger == 55  # goodput's own count agrees


def test_productive_time_counts_each_kept_step_once_at_its_last_training() -> None:
    steps, seconds = productive(KILLED, 0, 300)
    # steps 1..200 kept once each, 1 s apiece (a segment's first step: its median gap); 101..155 the second time
    assert (steps, seconds) == (200, pytest.approx(200.0))
    result = run_result("x", KILLED, [Fired("kill-rank", "rank 1", 150.0, 155.5)], 0, 300, [])
    assert result.ettr == pytest.approx(200 / 300, abs=1e-4)
    # the window ends at 250: steps after it are not counted, nor the time
    assert productive(KILLED, 0, 250)[0] == 101 + int(250 - 178)


def test_a_stop_that_saves_first_loses_nothing() -> None:
    # preempted with a grace period: the signal at 50.2, the stop's save at step 52, back at step 53 at 80
    events = [ev(0, "started"), *trained(1, range(1, 53)),
              ev(53.5, "preempted", step=52, signal_times=[50.2]),
              ev(54, "stop_decision", what="preempted", requeue=True),
              ev(70, "started", restart=1), ev(70.2, "resumed", restart=1, step=52), *trained(80, range(53, 70), restart=1)]
    (cost,) = failure_costs(events, [Fired("preempt-grace10", "job", 50.0, 50.1)], 0, 100)
    assert (cost.stopped, cost.recomputed, cost.back_s) == (True, 0, 29.9)


def test_a_failure_the_job_trains_through_costs_nothing_and_one_not_back_in_the_window_is_said() -> None:
    events = [ev(0, "started"), *trained(1, range(1, 100))]
    fired = [Fired("drain-node", "n2", 10, 10.0), Fired("freeze-rank", "rank 2", 50, 50.5)]
    drain, frozen = failure_costs(events, fired, 0, 200)
    assert (drain.stopped, drain.recomputed, drain.back_s) == (False, 0, 0.0)  # trained on until the next one
    assert (frozen.stopped, frozen.recomputed, frozen.back_s) == (True, None, None)  # nothing in the last 10 s
    # a drain at the window's end while the job still trains: not stopped
    (late,) = failure_costs(events, [Fired("drain-node", "n2", 95, 95.0)], 0, 101)
    assert (late.stopped, late.back_s) == (False, 0.0)
    costs = by_kind([drain, frozen])
    assert (costs["drain-node"].not_stopped, costs["freeze-rank"].not_back) == (1, 1)
    assert costs["freeze-rank"].recomputed == [] and costs["drain-node"].back_s == []


def test_the_next_failure_bounds_where_a_failures_effect_is_sought() -> None:
    # a drain the job ignores, then a kill: the restart after the kill is the kill's, not the drain's
    fired = [Fired("drain-node", "n2", 20, 20.0), Fired("kill-rank", "rank 1", 150, 155.5)]
    drain, killed = failure_costs(KILLED, fired, 0, 300)
    assert (drain.stopped, drain.recomputed) == (False, 0)
    assert (killed.recomputed, killed.back_s) == (55, 22.5)


def test_a_restart_that_fails_again_before_training_counts_from_the_one_that_trains() -> None:
    cut = next(i for i, e in enumerate(KILLED) if e["event"] == "restarted") + 1
    events = [*KILLED[:cut], ev(165, "started"), ev(166, "failed", error="boom"),  # an attempt that never trained
              *KILLED[cut:]]
    (cost,) = failure_costs(events, [Fired("kill-node", "n1", 150, 155.5)], 0, 300)
    assert (cost.recomputed, cost.back_s) == (55, 22.5)


def test_each_failure_counts_the_steps_trained_since_the_start_it_hit() -> None:
    # the plain loop before its first save: killed at step 27, back from 0; preempted at step 11, back from 0 again
    events = [ev(0, "started"), *trained(5, range(1, 28)), ev(40, "started"), *trained(45, range(1, 12)),
              ev(70, "started", restart=1), *trained(80, range(1, 30), restart=1)]
    fired = [Fired("kill-rank", "rank 0", 31, 32.0), Fired("preempt-grace0", "job", 55, 56.0)]
    killed, preempted = failure_costs(events, fired, 0, 120)
    assert (killed.recomputed, preempted.recomputed) == (27, 11)
    assert run_result("plain", events, fired, 0, 120, []).lost_steps_ledger == 38  # goodput's count agrees


def test_the_weights_are_compared_at_every_step_both_logged() -> None:
    reference = trained(0, range(1, 300))
    assert weights_verdict(KILLED, reference, 200) == {"identical": True, "steps_compared": 200, "final_step": 200,
                                                       "first_difference": None}
    # the plain loop: after its restart, other dropout draws, other weights from step 101 on
    other = [*KILLED[:-100], *trained(178, range(101, 201), prints={s: "bits:0" for s in range(101, 201)})]
    assert weights_verdict(other, reference, 200)["first_difference"] == 101
    # steps a failure threw away past the final trajectory's end are not compared: here 121..155, retrained to 120 only
    cut = [*KILLED[:-80]]
    assert productive(cut, 0, 300)[0] == 120
    assert weights_verdict(cut, reference, 120) == {"identical": True, "steps_compared": 120, "final_step": 120,
                                                    "first_difference": None}
    # no reference (it failed): not identical, nothing compared
    assert weights_verdict(KILLED, [], 200)["identical"] is False


def test_the_table_puts_the_configurations_side_by_side_per_kind() -> None:
    plan = make_plan(44, 60, 300, parse_mix("all"), 4, ("n1", "n2"), 75)
    reference = trained(0, range(1, 300))
    a = run_result("defaults", KILLED, [Fired("kill-rank", "rank 1", 150.0, 155.5)], 0, 300, reference)
    b = run_result("plain", KILLED, [Fired("drain-node", "n2", 20, 20.0), Fired("kill-rank", "rank 1", 150.0, 155.5)],
                   0, 300, [])
    table = render(plan, [a, b], {"defaults": "(mgpu's defaults)", "plain": "plain save_every=100"})
    assert "| defaults (`(mgpu's defaults)`) | 0.667 | 200 | 5 s | 1 | 55 (goodput: 55) | identical (200 steps) | 0 |" \
        in table
    assert "| plain (`plain save_every=100`) | 0.667 | 200 | 5 s | 2 | 55 (goodput: 55) | not compared (0 steps in " \
        "common)" in table
    assert "| kill-rank | 55 [1] | 55 [1] |" in table
    assert "| kill-rank | 22 s [1] | 22 s [1] |" in table  # 22.5 s, to the even second
    assert "| drain-node | - | - [1] (1 ignored) |" in table
    assert "freeze-rank" not in table  # no failure of that kind fired


def test_the_block_is_replaced_between_its_markers_only() -> None:
    page = f"# Chaos\n\nintro\n\n{BEGIN}\nold\n{END}\n\nafter\n"
    assert publish(page, "new table\n") == f"# Chaos\n\nintro\n\n{BEGIN}\nnew table\n{END}\n\nafter\n"
    with pytest.raises(ValueError, match="no <!-- chaos -->"):
        publish("# no markers\n", "x")
