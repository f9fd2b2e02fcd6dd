"""Where a run's time went (mgpu/record/goodput.py), what status shows (jobs/status.py), --verify and the timeline PNG.

Tables over hand-written ledgers pin every rule; real runs of jobs/train.py (one stopped and resumed, one
not, one with another seed) check --verify and the picture end to end.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from mgpu.record.goodput import (Interval, SacctRun, compare_fingerprints, fingerprints, goodput, goodput_lines,
                          parse_sacct, parse_slurm_time, segments, timeline)
from mgpu.record.budgets import Limits
from tests.conftest import PYTHON, ROOT, base_env

STATUS = str(ROOT / "jobs" / "status.py")
TRAIN = str(ROOT / "jobs" / "train.py")


def ev(t: float, name: str, job: str = "7", restart: int = 0, **fields: Any) -> dict[str, Any]:
    return {"time": t, "event": name, "job_id": job, "restart": restart, **fields}


def progress(t: float, step: int, step_time: float = 1.0, restart: int = 0, fp: str = "0x1p+0",
             **metrics: float) -> dict[str, Any]:
    return ev(t, "progress", restart=restart, step=step, epoch=0, total_steps=100, fingerprint=fp,
              metrics={"loss": 1.0, "samples_per_s": 32 / step_time, "step_time_s": step_time, **metrics})


# A grace-period preemption: USR2 at 100, saved and self-requeued by 103; back at 200, first step at 210.
PREEMPTED = [
    ev(0, "started"), ev(5, "first_step", step=1), progress(50, 45), ev(90, "checkpoint_saved", step=85, blocked_s=0.5),
    ev(102, "checkpoint_saved", step=95, reason="preemption", seconds=1.0),
    ev(102, "preempted", step=95, reasons=["requeue_signal"], signals=["SIGUSR2"], signal_times=[100.0]),
    ev(102.5, "stop_decision", step=95, what="preempted", requeue=True), ev(103, "requeued", step=95, how="self"),
    ev(200, "started", restart=1), ev(200.1, "resumed", restart=1, step=95), ev(210, "first_step", restart=1, step=96),
    progress(250, 100, restart=1), ev(300, "finished", restart=1, step=100, status="finished"),
]
# A rank killed at step 10 (last checkpoint step 8), the step restarted in the same allocation.
KILLED_RANK = [
    ev(0, "started"), ev(2, "first_step", step=1), ev(40, "checkpoint_saved", step=8), progress(60, 10, step_time=2.0),
    ev(70, "stop_decision", what="user_signal", requeue=True, action="restart", error="exited 137"),
    ev(70.1, "restarted", after="failure"),
    ev(80, "started"), ev(80.1, "resumed", step=8), ev(85, "first_step", step=9), progress(100, 20, step_time=2.0),
]
HUNG = [
    ev(0, "started"), ev(1, "first_step", step=1), progress(30, 20),
    ev(95, "hang", step=21, ranks=[1], hosts=["n2"], waited_s=60.0),
    ev(96, "stop_decision", what="user_signal", requeue=True, action="requeued", error="exit 4"),
    ev(96.5, "requeued", how="self", after="hang"),
    ev(120, "started", restart=1), ev(120.2, "resumed", restart=1, step=20), ev(125, "first_step", restart=1, step=21),
]

SEGMENT_CASES = {
    # name: (events, [(kind, resumed_step, last_step, stop_time)])
    "finished": ([ev(0, "started"), ev(1, "first_step", step=1), ev(9, "finished", step=5, status="finished")],
                 [("finished", 0, 5, None)]),
    "early stopped": ([ev(0, "started"), ev(9, "finished", step=5, status="early_stopped")],
                      [("early_stopped", 0, 5, None)]),
    "grace-period preemption": (PREEMPTED, [("preempted", 0, 95, 100.0), ("finished", 95, 100, None)]),
    "GraceTime 0": ([*PREEMPTED[:6], ev(102.5, "stop_decision", what="requeued_by_slurm", requeue=False)],
                    [("requeued_by_slurm", 0, 95, 100.0)]),
    "signal during startup, clamped to the first step": (
        [ev(10, "started"), ev(12, "first_step", step=1), ev(13, "preempted", step=1, signal_times=[4.0])],
        [("stopped", 0, 1, 12.0)]),
    "stop without a signal (--stop-at-step): from its save": (
        [ev(0, "started"), ev(1, "first_step", step=1), ev(20, "checkpoint_saved", step=9, reason="preemption",
                                                          seconds=3.0),
         ev(20, "preempted", step=9, signal_times=[]), ev(20.1, "stop_decision", what="not_slurm", requeue=False)],
        [("not_slurm", 0, 9, 17.0)]),
    "killed rank, restarted in place": (KILLED_RANK, [("failure", 0, 10, 60.0), ("running", 8, 20, None)]),
    "hang: stopped when progress did": (HUNG, [("hang", 0, 21, 35.0), ("running", 20, 21, None)]),
    "no trace, then another job": ([ev(0, "started"), progress(5, 3), ev(50, "started", job="8"),
                                    ev(50.5, "resumed", job="8", step=0)],
                                   [("killed", 0, 3, 5.0), ("running", 0, 0, None)]),
    "bad input before training": ([ev(0, "failed", error="MgpuError: x", retry=False)],
                                  [("failed_not_retried", None, 0, 0.0)]),
    "failed rendezvous, restarted": ([ev(0, "failed", error="timeout"), ev(1, "restarted", after="failure"),
                                      ev(2, "started"), ev(3, "first_step", step=1)],
                                     [("failure", None, 0, 0.0), ("running", 0, 1, None)]),
}


@pytest.mark.parametrize("name", SEGMENT_CASES)
def test_segments(name: str) -> None:
    events, expected = SEGMENT_CASES[name]
    got = [(s.kind, s.resumed_step, s.last_step, s.stop_time) for s in segments(events)]
    assert got == expected


LOST_CASES = {
    # name: (events, lost steps, recomputing seconds)
    "a stop saves at its step": (PREEMPTED, 0, 0.0),
    "killed after step 10, resumed from 8": (KILLED_RANK, 2, 4.0),  # 2 steps x 2.0 s
    "hang after step 21, resumed from 20": (HUNG, 1, 1.0),
    "no checkpoint at all: everything again": ([ev(0, "started"), ev(1, "first_step", step=1), progress(15, 10),
                                                 ev(30, "started", job="8"),
                                                 ev(31, "first_step", job="8", step=1)], 10, 10.0),
    "killed twice at the same checkpoint": (
        [ev(0, "started"), ev(1, "first_step", step=1), progress(5, 10), ev(10, "started", restart=1),
         ev(10.1, "resumed", restart=1, step=8), ev(11, "first_step", restart=1, step=9), progress(15, 9, restart=1),
         ev(20, "started", restart=2), ev(20.1, "resumed", restart=2, step=8)], 3, 3.0),
}


@pytest.mark.parametrize("name", LOST_CASES)
def test_lost_steps_and_recomputing(name: str) -> None:
    events, lost, seconds = LOST_CASES[name]
    g = goodput(events)
    assert g.lost_steps == lost
    assert g.by_kind.get("recomputing", 0.0) == pytest.approx(seconds)


def test_time_by_category_from_the_ledger_alone() -> None:
    g = goodput(PREEMPTED)
    # restarting: the exit at 103 -> the next first step at 210 (queue wait included: no sacct).
    assert g.by_kind == pytest.approx({"starting": 5, "training": 95 + 90, "stopping": 3, "restarting": 107})
    assert g.allocated_s is None and g.span_s == 300 and sum(g.by_kind.values()) == pytest.approx(300)
    (stop,) = g.stops
    assert (stop.kind, stop.count, stop.lost_steps, stop.unrecovered) == ("preempted", 1, 0, 0)
    assert stop.total_s == pytest.approx(110)  # the USR2 at 100 -> the resumed first step at 210
    assert g.preemptions == 1 and g.preemptions_per_day == pytest.approx(86400 / 300)


def test_time_by_category_with_sacct() -> None:
    runs = [SacctRun("7", "REQUEUED", -10, -3, 105), SacctRun("7", "COMPLETED", 105, 190, 301)]
    g = goodput(PREEMPTED, runs)
    # queued: submit -> start, then the requeued job's end -> its next start; the allocation's edges
    # (process start before `started`, exit after the last event) go to starting and stopping.
    assert g.by_kind == pytest.approx({"queued": 7 + 85, "starting": 8, "restarting": 20, "training": 95 + 90,
                                       "stopping": 5 + 1})
    assert g.allocated_s == pytest.approx((105 + 3) + (301 - 190))
    kinds = [iv.kind for iv in timeline(segments(PREEMPTED), runs)]
    assert kinds == ["queued", "starting", "training", "stopping", "queued", "restarting", "training", "stopping"]


def test_timeline_counts_every_second_once() -> None:
    # sacct's whole seconds end the first allocation before the ledger's last event (103): no overlap.
    runs = [SacctRun("7", "REQUEUED", 0, 0, 102), SacctRun("7", "COMPLETED", 102, 190, 300)]
    intervals = timeline(segments(PREEMPTED), runs)
    for a, b in zip(intervals, intervals[1:]):
        assert a.end <= b.start, (a, b)
    assert Interval(103, 190, "queued", 1) in intervals


def test_running_segment_extends_to_now() -> None:
    events = [ev(0, "started"), ev(1, "first_step", step=1), progress(10, 9)]
    assert goodput(events, now=60).by_kind["training"] == pytest.approx(59)
    assert goodput(events).by_kind["training"] == pytest.approx(9)


@pytest.mark.parametrize("line, expected", [
    ("7|REQUEUED|2026-11-25T09:03:42|2026-11-25T09:03:42|2026-11-25T09:03:57",
     [("7", "REQUEUED", "2026-11-25T09:03:42", "2026-11-25T09:03:42", "2026-11-25T09:03:57")]),
    ("7|CANCELLED by 0|2026-11-25T09:03:42|2026-11-25T09:03:50|2026-11-25T09:04:00",
     [("7", "CANCELLED", "2026-11-25T09:03:42", "2026-11-25T09:03:50", "2026-11-25T09:04:00")]),
    ("7|RUNNING|2026-11-25T09:03:42|2026-11-25T09:03:50|Unknown",
     [("7", "RUNNING", "2026-11-25T09:03:42", "2026-11-25T09:03:50", None)]),
    ("7|PENDING|2026-11-25T09:03:42|Unknown|Unknown", [("7", "PENDING", "2026-11-25T09:03:42", None, None)]),
    ("sacct: error: Problem talking to the database", []),
    ("7|COMPLETED|x", []),
    ("", []),
])
def test_parse_sacct(line: str, expected: list[tuple[Any, ...]]) -> None:
    want = [SacctRun(j, s, *(parse_slurm_time(t) if t else None for t in times)) for j, s, *times in expected]
    assert parse_sacct(line + "\n") == want


def test_parse_sacct_orders_runs_by_start() -> None:
    text = ("7|COMPLETED|2026-11-25T09:03:57|2026-11-25T09:04:04|2026-11-25T09:04:28\n"
            "7|REQUEUED|2026-11-25T09:03:42|2026-11-25T09:03:42|2026-11-25T09:03:57\n")
    assert [r.state for r in parse_sacct(text)] == ["REQUEUED", "COMPLETED"]
    assert parse_slurm_time("2026-11-25T09:03:42") == time.mktime((2026, 11, 25, 9, 3, 42, 0, 0, -1))


FINGERPRINT_CASES = {
    # name: (run a {step: fp}, run b, agree, first difference)
    "equal": ({10: "0x1.8p+1", 20: "0x1p+2"}, {10: "0x1.8p+1", 20: "0x1p+2"}, True, None),
    "the same float written longer": ({10: "0x1.8p+1"}, {10: "0x1.8000000000000p+1"}, True, None),
    "differs at 20": ({10: "0x1.8p+1", 20: "0x1p+2", 30: "0x1p+3"}, {10: "0x1.8p+1", 20: "0x1.1p+2", 30: "0x1p+4"},
                      False, 20),
    "only the common steps count": ({10: "0x1p+0", 20: "0x1p+1"}, {20: "0x1p+1", 30: "0x1p+5"}, True, None),
    "nothing in common": ({10: "0x1p+0"}, {20: "0x1p+0"}, False, None),
    "not hex: compared as text": ({10: "abc"}, {10: "abd"}, False, 10),
}


@pytest.mark.parametrize("name", FINGERPRINT_CASES)
def test_compare_fingerprints(name: str) -> None:
    a, b, agree, first = FINGERPRINT_CASES[name]
    verdict = compare_fingerprints(a, b)
    assert (verdict.agree, verdict.first_difference) == (agree, first)


def test_fingerprints_keep_the_newest_of_a_step_trained_twice() -> None:
    events = [progress(1, 10, fp="0x1p+0"), progress(2, 20, fp="0x1p+1"), ev(3, "started"),
              progress(4, 20, fp="0x1p+3"), ev(5, "evaluated", step=20, fingerprint="ignored"),
              {"time": 6, "event": "progress", "step": 30}]  # an old ledger's progress: no fingerprint
    assert fingerprints(events) == {10: "0x1p+0", 20: "0x1p+3"}


def test_goodput_lines() -> None:
    lines = goodput_lines(goodput(PREEMPTED), sacct_known=False)
    assert lines[0] == ("goodput     61.7% of 5m00s from the first event to the last spent training; 2 segment(s); "
                        "no sacct: time queued is not known apart")
    assert lines[1:6] == [
        "  starting            5s   1.7%  the first start -> first step (imports, rendezvous)",
        "  training         3m05s  61.7%  first step -> stop, steps kept",
        "  stopping            3s   1.0%  stop signal or failure -> exited (saving, requeueing)",
        "  restarting       1m47s  35.7%  exited -> the next first step (requeue hold, start, loading the checkpoint; "
        "and the queue wait, without sacct)",
        "  lost steps           0         trained again after a stop (normally 0)"]
    assert lines[6] == "stops       1; preemptions 1 (288 per day)"
    assert lines[-1].split() == ["preempted", "1", "1m50s", "1m50s", "0"]
    with_sacct = goodput_lines(goodput(PREEMPTED, [SacctRun("7", "REQUEUED", -10, -3, 105),
                                                   SacctRun("7", "COMPLETED", 105, 190, 301)]), sacct_known=True)
    assert with_sacct[0] == "goodput     84.5% of 3m39s allocated (sacct) spent training; 2 segment(s)"
    assert with_sacct[1] == ("  queued           1m32s         waiting for an allocation (sacct: submit or requeue "
                             "-> start)")
    assert goodput_lines(goodput([]), sacct_known=False) == []


# ----------------------------------------------------------------------------------------------- status
def test_status_step_is_the_newest_trained_step() -> None:
    from jobs.status import summarize

    # A background save of step 44 lands after the progress event of step 50 (status used to show 44).
    events = [ev(0, "started", launcher="slurm"), ev(1, "first_step", step=1), progress(10, 50, step_time=0.5),
              ev(11, "checkpoint_saved", step=44, reason="periodic")]
    summary = summarize(events, now=12)
    assert summary["step"] == 50 and summary["checkpoint"]["step"] == 44
    assert summary["eta_s"] == pytest.approx(25)  # 50 steps left at 0.5 s each
    assert summary["steps_per_s"] == pytest.approx(2)


def test_status_progress_line_is_current_and_changes_only_with_the_ledger() -> None:
    from jobs.status import progress_line, summarize

    events = [ev(0, "started", launcher="slurm"), ev(1, "first_step", step=1), ev(4, "checkpoint_saved", step=40),
              progress(5, 50, step_time=0.5), ev(6, "evaluated", step=50, metrics={"accuracy": 0.5}, best=True),
              ev(7, "evaluated", step=60, metrics={"accuracy": 0.4}, best=False), progress(8, 60, step_time=0.5)]
    line = progress_line(summarize(events, now=9))
    assert line == "running, step 60/100, 64 samples/s, ETA 20s, checkpoint step 40, eval accuracy 0.4"


def test_status_and_goodput_print_a_duration_alike_days_included() -> None:
    """One formatter (mgpu.record.goodput.duration) for the status's ages and ETA and goodput's report."""
    from jobs.status import progress_line
    from mgpu.record.goodput import duration

    assert [duration(s) for s in (59.4, 187, 5 * 3600 + 120, 2 * 86400 + 3 * 3600)] == ["59s", "3m07s", "5h02m",
                                                                                     "2d03h"]
    assert progress_line({"state": "running", "eta_s": 2 * 86400 + 3 * 3600}) == "running, ETA 2d03h"


def test_wait_prints_a_line_only_when_the_ledger_changed() -> None:
    from jobs.status import progress_line, summarize

    # `submit.py --wait` prints progress_line again only when it differs: the mere passing of time must not
    # change it (it said "checkpoint step 40 5s ago", so --wait printed at every poll).
    events = [ev(0, "started", launcher="slurm"), ev(1, "first_step", step=1), ev(4, "checkpoint_saved", step=40),
              progress(5, 50, step_time=0.5)]
    assert progress_line(summarize(events, now=9)) == progress_line(summarize(events, now=500))
    assert progress_line(summarize([*events, progress(20, 60)], now=500)) != progress_line(summarize(events, now=500))


def test_status_shows_evaluations_eta_and_budgets(tmp_path: Path) -> None:
    from jobs.status import describe

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    now = time.time()
    events = [ev(now - 100, "started", launcher="single", job="local-1"),
              ev(now - 99, "first_step", job="local-1", step=1),
              ev(now - 50, "evaluated", job="local-1", step=50, metrics={"accuracy": 0.5, "loss": 1.25}, best=True),
              ev(now - 20, "evaluated", job="local-1", step=80, metrics={"accuracy": 0.45, "loss": 1.5}, best=False),
              {**progress(now - 10, 90, step_time=0.25, tokens_per_s=512.0), "job_id": "local-1"}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    lines = describe(run_dir, now=now)
    assert "progress    step 90 of 100, epoch 0; logged 10s ago" in lines
    assert "throughput  128 samples/s, 512 tokens/s, 0.25 s/step; ETA 2s at this rate" in lines
    assert ("evaluation  step 80: accuracy 0.45, loss 1.5; best step 50: accuracy 0.5, loss 1.25") in lines
    assert not any(line.startswith("budgets") for line in lines)  # not a Slurm job: no Slurm budgets
    assert any(line.startswith("goodput ") for line in lines)


def test_a_dead_running_looking_run_does_not_accrue_time(tmp_path: Path) -> None:
    from jobs.status import describe

    now = time.time()
    events = [ev(now - 7200, "started", job="local-1", launcher="single"),
              ev(now - 7199, "first_step", job="local-1", step=1),
              {**progress(now - 7190, 10), "job_id": "local-1"}]  # then killed: no end event, hours ago
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    lines = describe(tmp_path, now=now)
    training = next(line for line in lines if line.startswith("  training"))
    assert training.split()[1] == "9s", lines  # not two hours
    fresh = [{**e, "time": e["time"] + 7000} for e in events]  # the same, 3 minutes ago: still running
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in fresh))
    training = next(line for line in describe(tmp_path, now=now) if line.startswith("  training"))
    assert training.split()[1] == "3m19s"


def test_budgets_as_the_job_counts_them() -> None:
    from jobs.status import budgets, job_limits
    from mgpu.submit.submission import Resources, setup_lines

    script = "\n".join(["#!/bin/bash", *setup_lines(Resources(max_requeues=5, max_failures=2)), "srun x"])
    assert job_limits(script) == Limits(max_requeues=5, max_failures=2)
    assert job_limits("\n".join(setup_lines(Resources()))) == Limits(None, 3)
    assert job_limits("#!/bin/bash\nsrun x\n") is None
    # Slurm's restart counter 3: one of them after a failure (the ledger's), two after stops.
    events = [ev(1, "requeued", after="failure"), ev(2, "requeued", after="preempted"), ev(3, "requeued", job="8",
                                                                                          after="failure")]
    assert budgets(events, "7", 3, Limits(5, 2)) == ("requeues after stops 2 of 5 used, 3 left; after failures "
                                                     "1 of 2 used, 1 left")
    assert budgets(events, "7", 3, None) == ("requeues after stops 2 used, no limit; after failures 1 of 3 used, "
                                             "2 left (the defaults: the job's own limits are not known here)")


# ----------------------------------------------------------------------------------------------- real runs
BLOB = ["task.target=tests.tasks:BlobTask", "train.epochs=2", "data.batch_size=4", "log.every_steps=1",
        "eval.every_steps=5"]


def _train(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, TRAIN, f"run.dir={run_dir}", *BLOB, *args], env=base_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=180)


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, STATUS, *args], env=base_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    out = {"whole": root / "whole", "stopped": root / "stopped", "other_seed": root / "other"}
    assert _train(out["whole"]).returncode == 0
    assert _train(out["stopped"], "--stop-at-step", "7").returncode == 3  # a stop: checkpoint, exit 3
    assert _train(out["stopped"]).returncode == 0  # the same command resumes it
    assert _train(out["other_seed"], "train.seed=1").returncode == 0
    return out


@pytest.mark.multiprocess
def test_verify_real_runs(runs: dict[str, Path]) -> None:
    same = _status("--verify", str(runs["whole"]), str(runs["stopped"]))
    assert same.returncode == 0, same.stdout + same.stderr
    assert same.stdout.startswith("agree: the same weights at all 20 steps both runs logged (1..20)")
    other = _status("--verify", str(runs["whole"]), str(runs["other_seed"]))
    assert other.returncode == 1, other.stdout + other.stderr
    assert other.stdout.startswith("differ: first at step 1 (")


@pytest.mark.parametrize("args, expect", [
    (["--verify", "{whole}", "/nonexistent"], "RUN_B '/nonexistent': no such run directory"),
    (["--verify", "{whole}", "{root}"], "RUN_B '{root}': no events.jsonl in it: not a run directory"),
    (["--verify", "{whole}"], "argument --verify: expected 2 arguments"),
    (["{whole}", "--verify", "{whole}", "{stopped}"], "--verify RUN_A RUN_B takes no other run and no --plot"),
    (["{whole}", "--plot", "{root}/x.jpg"], "--plot '{root}/x.jpg': give a .png file name"),
    (["{whole}", "--plot", "/nonexistent/x.png"], "--plot '/nonexistent/x.png': no such directory '/nonexistent'"),
    ([], "the following arguments are required: RUN_DIR_OR_JOB_ID"),
])
@pytest.mark.multiprocess
def test_status_bad_input(runs: dict[str, Path], args: list[str], expect: str) -> None:
    names = {k: str(v) for k, v in runs.items()} | {"root": str(runs["whole"].parent)}
    result = _status(*(a.format(**names) for a in args))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [f"status: error: {expect.format(**names)}"]
    assert result.stdout == ""


@pytest.mark.multiprocess
def test_verify_without_fingerprints(tmp_path: Path, runs: dict[str, Path]) -> None:
    old = tmp_path / "old"
    old.mkdir()
    (old / "events.jsonl").write_text('{"time": 1, "event": "progress", "step": 1}\n')
    result = _status("--verify", str(runs["whole"]), str(old))
    assert result.returncode == 2 and "no fingerprints in its ledger" in result.stderr


@pytest.mark.multiprocess
def test_status_goodput_and_timeline_png(runs: dict[str, Path], tmp_path: Path) -> None:
    png = tmp_path / "timeline.png"
    result = _status(str(runs["stopped"]), "--plot", str(png))
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert any(line.startswith("goodput ") for line in out), out
    assert any(line.split()[:2] == ["not_slurm", "1"] for line in out), out  # the --stop-at-step stop
    assert "  lost steps           0         trained again after a stop (normally 0)" in out
    # the restart explained, its way back in phases from the resumed process's timings (mgpu.record.restarts)
    assert "restarts    1: cause, where, decision and why; the way back to training" in out, out
    assert any(line.startswith("   1. after step 7: not_slurm: test; stays down: ") for line in out), out
    back = next(line for line in out if line.startswith("      back in "))
    assert [part.split()[0] for part in back.split(": ", 1)[1].split(", ")] == [
        "stopping", "hold", "process", "rendezvous", "state", "first"], back
    # the timeout ladder the session recorded (mgpu.stop.ladder): a world of one has no collective timeout
    at = out.index("timeouts    inner to outer, each ending before the next (docs/allowances.md, the ladder):")
    assert [line.split()[0] for line in out[at + 1:at + 8]] == ["step", "evaluation", "save", "resume", "first",
                                                                "verdict", "rendezvous"], out[at:at + 8]
    assert out[-1] == f"timeline    {png}"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1100, 550)
    assert 20_000 < len(data) < 1_000_000  # drawn, not blank (a blank 1100x550 PNG is ~5 KB)


def test_status_budgets_come_from_the_limits_the_job_recorded(tmp_path: Path) -> None:
    # After the job is gone Slurm no longer has its batch script: the ranks recorded its limits in `started`.
    from jobs.status import budgets, describe

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    now = time.time()
    events = [ev(now - 100, "started", launcher="slurm", job="991234", limits={"max_requeues": 5, "max_failures": 2}),
              ev(now - 99, "first_step", job="991234", step=1)]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    lines = describe(run_dir, now=now)
    assert f"budgets     {budgets(events, '991234', 0, Limits(5, 2))}" in lines, lines


# ------------------------------------------------------------------------- the read model (mgpu.record.runview)
def test_the_event_vocabulary_is_what_the_code_writes() -> None:
    # Every `<ledger>.write("<event>"` in the package is in mgpu.record.ledger.EVENTS and documented in its docstring,
    # and every event listed there is written somewhere (hang, restarted, node_excluded were missing before).
    import re

    import mgpu.record.ledger as ledger

    written = set()
    for path in (ROOT / "mgpu").rglob("*.py"):
        written |= set(re.findall(r"(?:ledger|Ledger\([^()]*\))\.write\(\s*\"([a-z_]+)\"", path.read_text()))
    assert written == set(ledger.EVENTS)
    documented = set(re.findall(r"^    ([a-z_]+) ", ledger.__doc__ or "", re.M))
    assert documented == set(ledger.EVENTS)


def test_status_on_a_directory_that_is_no_run(tmp_path: Path) -> None:
    result = _status("/etc")
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr == ("status: error: '/etc': not a run directory (no events.jsonl, config.yaml, logs/ or "
                             "checkpoints/ in it); give a run directory or a job id\n")
    (tmp_path / "config.yaml").write_text("run: {}\n")  # submitted, not started: a run all the same
    result = _status(str(tmp_path))
    assert result.returncode == 0 and "state       not started" in result.stdout, result.stderr


def test_status_into_a_pipe_its_reader_left_says_nothing_more(tmp_path: Path) -> None:
    """`jobs/status.py RUN | head -1`: once the reader is gone, no BrokenPipeError traceback (exit 1, as Python's
    own advice for EPIPE)."""
    (tmp_path / "config.yaml").write_text("run: {}\n")
    read, write = os.pipe()
    os.close(read)  # the reader has left before status writes a line
    proc = subprocess.run([PYTHON, STATUS, str(tmp_path)], env=base_env(), cwd=ROOT, stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.returncode == 1


@pytest.mark.parametrize("plot", [False, True])
def test_a_ledger_time_no_clock_can_show_is_one_line(tmp_path: Path, plot: bool) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / "events.jsonl").write_text(json.dumps({"time": 1e308, "event": "started", "job_id": "5", "restart": 0})
                                      + "\n" + json.dumps({"time": 1e308, "event": "progress", "step": 3, "job_id": "5"}) + "\n")
    result = _status(str(run), *(["--plot", str(tmp_path / "t.png")] if plot else []))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines() == ["status: error: the ledger holds a time no clock can show (1e+308): is "
                                          "events.jsonl a run's ledger?"], result.stderr


def test_status_reads_each_ledger_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    import jobs.status
    import mgpu.record.runview

    (tmp_path / "events.jsonl").write_text(json.dumps({"time": 1, "event": "started", "job_id": "local",
                                                       "restart": 0}) + "\n")
    reads: list[Path] = []
    real = mgpu.record.runview.read_ledger
    monkeypatch.setattr(mgpu.record.runview, "read_ledger", lambda path, *a: reads.append(path) or real(path, *a))
    monkeypatch.setattr(jobs.status, "read_ledger", lambda path, *a: reads.append(path) or real(path, *a))
    assert jobs.status.main([str(tmp_path)]) == 0
    assert reads == [tmp_path / "events.jsonl"]  # three reads before


def test_the_failing_ranks_own_error_is_the_state_shown() -> None:
    from mgpu.record.runview import summarize

    events = [{"time": 1, "event": "started", "job_id": "local", "restart": 0},
              {"time": 5, "event": "failed", "job_id": "local", "restart": 0, "rank": 1, "retry": True,
               "error": "ValueError: rank 1's own bug"},
              {"time": 6, "event": "failed", "job_id": "local", "restart": 0, "rank": 0, "retry": True,
               "consequence": True, "error": "RuntimeError: Connection closed by peer"}]
    assert summarize(events, now=10)["state"] == "failed (rank 1): ValueError: rank 1's own bug"
