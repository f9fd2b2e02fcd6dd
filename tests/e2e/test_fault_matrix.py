"""The fault matrix on the real test cluster: each scenario (tests/e2e/fault_matrix.py) is a 2-node job
submitted with jobs/submit.py, stopped by a real Slurm event at a chosen moment, and followed to its end.

Every scenario checks: the job ends or comes back as the README's table says (sacct's runs; a killed rank:
one `restarted` step in the same allocation); a stop that gives a signal loses no step (each run resumes
at the last step the previous one trained); the final checkpoint verifies, no newer one was skipped as
broken, and its weights, optimizer and schedule are bit-identical to an uninterrupted run; a full disk
was reported as ENOSPC; every wait is bounded. A job that stays down (scancel, or a disk that was full at its start) is
resubmitted with the same command, which continues the same run. CI runs the seeded subset
(`MGPU_FAULT_MATRIX` unset); `python tests/e2e/fault_matrix.py` runs them all and writes the table.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import pytest
from fault_matrix import LATE_RANK, REPORT_ENV, SELECT_ENV, SIGNAL_KINDS, Scenario, all_scenarios, selected
from job_helpers import (ALL_CPUS, TWO_RANKS, Reference, cancel, events, job_output, latest_checkpoint, preempt,
                         rank_record, submit_one, wait_steps)
from slurm_helpers import final_state, job, runs, wait_until

from tests.conftest import fill
from tests.test_trainer import assert_identical

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = pytest.mark.slurm

# BlobTask's numerics (dropout, batch norm, warmup + cosine): 2 ranks x 2 samples, 10 steps an epoch, 30 in
# all; a checkpoint every 2 steps (what a killed rank resumes from); an evaluation every 10 steps.
MATRIX = ["task.target=tests.e2e.jobtasks:MatrixTask", "task.args.step_s=0.25", "task.args.later_step_s=0.25",
          "task.args.eval_step_s=0.2", "train.epochs=3", "data.batch_size=2", "data.eval_batch_size=2",
          "log.every_steps=1", "checkpoint.every_steps=2", "eval.every_steps=10", "schedule.name=cosine",
          "schedule.warmup_steps=3", "optim.lr=0.01"]
STEPS = 30
FULL_FOR_S = 4.0
FULL_AT_MOST_S = 90.0
# The time limit's signal comes at Slurm's 30 s check, 20-50 s into a `--time 1 --signal-lead 10` job:
# a first run of 30 x 2 s steps always meets it; the run after the requeue is quick.
# The time limit's row is the --signal lead's: mgpu's own stop before the limit (rank 0 reading the job's end) is
# off here, since at 2 s a step it needs (every + 1) x 2 s + a write + 6 s, about the 10 s lead, and whichever came
# first stopped the job (CI once saw the deadline's). That stop has its own test (test_loops_and_deadlines).
TIME_LIMIT = ["--time", "1", "--signal-lead", "10", "task.args.step_s=2.0", "task.args.later_step_s=0.05",
              "preemption.deadline_margin_s=0"]
ORDER = {s.id: i for i, s in enumerate(all_scenarios())}
# The late rank: rank 1 writes its shard of the first run's 2nd save (step 4) 14 s late; the ranks wait 10 s for
# each other (peer_wait_s: half the save allowance, watchdog.checkpoint_s while no save is measured).
LATE = ["task.args.late_save=2", "task.args.late_s=14", "watchdog.checkpoint_s=20"]
LATE_STEP = 4


@pytest.fixture(scope="module")
def references(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Reference]]:
    """The uninterrupted runs, started at once in the background: DDP's, and FSDP2's (sharded checkpoints)
    when a selected scenario trains with it."""
    quiet = ["task.args.step_s=0", "task.args.later_step_s=0", "task.args.eval_step_s=0"]
    refs = {"ddp": Reference(tmp_path_factory.mktemp("matrix-reference") / "run", 2, [*MATRIX, *quiet])}
    if any(s.parallel == "fsdp" for s in selected(os.environ.get(SELECT_ENV))):
        refs["fsdp"] = Reference(tmp_path_factory.mktemp("matrix-reference-fsdp") / "run", 2,
                                 [*MATRIX, *quiet, "train.parallel=fsdp"])
    try:
        yield refs
    finally:
        for ref in refs.values():
            ref.close()


# ------------------------------------------------------------------------------------------ moments
def _eval_started(markers: Path) -> bool:
    """An evaluation of the first run is under way (call 1 is the start-up check of eval.metric)."""
    path = markers / "eval"
    return path.exists() and any(line.split() == ["0", str(n)] for line in path.read_text().splitlines()
                                 for n in range(2, 100))


def land(scenario: Scenario, cluster: SlurmCluster, jobid: str, folder: Path, run_dir: Path, markers: Path) -> int:
    """Wait for the scenario's moment; the run (1 = the job's first) it lands in."""
    moment = scenario.moment
    if scenario.kind == LATE_RANK:  # the late save has failed (rank 0 stopped waiting), and a later one is done
        wait_until("the late save to fail, then a save", lambda: events(run_dir, "checkpoint_failed") and [
            e for e in events(run_dir, "checkpoint_saved") if e["step"] > LATE_STEP], 120, 0.05)
        return 1
    if moment == "rendezvous":
        wait_until("the job to start", lambda: job(cluster, jobid).get("JobState") == "RUNNING", 90, 0.05)
        if scenario.kind in ("kill-rank", "disk-full"):  # a process to kill, or to write on the full disk
            wait_until("a training process", lambda: _find_rank_pid(folder, run_dir, 1), 90, 0.05)
        return 1
    if moment == "first-step-after-resume":
        wait_steps(run_dir, run=1, steps=3)
        cluster.run("scontrol", "requeue", jobid)
        wait_steps(run_dir, run=2, steps=1, timeout=120)
        return 2
    if moment == "mid-step":
        if scenario.kind != "time-limit":  # that one comes by itself
            wait_steps(run_dir, run=1, steps=3)
        return 1
    if moment == "evaluation":
        wait_until("an evaluation", lambda: _eval_started(markers), 120, 0.02)
        return 1
    assert moment == "checkpoint-write", moment
    ckpt = run_dir / "checkpoints"
    wait_until("a checkpoint write", lambda: ckpt.is_dir() and any(ckpt.glob(".tmp-step_*")), 120, 0.01)
    return 1


def _rank_pid(folder: Path, run_dir: Path, run: int) -> int:
    pid = _find_rank_pid(folder, run_dir, run)
    if pid is None:
        raise AssertionError(f"no training process of {folder} found")
    return pid


def _find_rank_pid(folder: Path, run_dir: Path, run: int) -> int | None:
    """A training rank's pid (rank 1 once the ranks have recorded themselves in this run, else any task)."""
    try:
        record = rank_record(run_dir, 1)
        if record["restart_count"] == run - 1:
            return int(record["pid"])
    except (OSError, ValueError, KeyError):
        pass
    for pid in sorted((int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()), reverse=True):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("python") and b"submitit.core._submit" in cmdline and str(folder).encode() in b" ".join(cmdline):
            return pid
    return None


def fire(scenario: Scenario, cluster: SlurmCluster, jobid: str, folder: Path, run_dir: Path, run: int,
         highs: list[str]) -> None:
    kind = scenario.kind
    if kind.startswith("preempt"):
        highs.append(preempt(cluster))
    elif kind == "scancel":
        cluster.run("scancel", jobid)
    elif kind == "scancel-usr2":
        cluster.run("scancel", "--signal=USR2", jobid)
    elif kind in ("outside-requeue", LATE_RANK):  # the late rank's: the stop's save after the failed one
        cluster.run("scontrol", "requeue", jobid)
    elif kind == "kill-rank":
        os.kill(_rank_pid(folder, run_dir, run), signal.SIGKILL)
    elif kind == "disk-full":
        ballast = fill(run_dir.parent)  # the run's filesystem (run.dir on a small tmpfs)

        def free() -> None:  # at least FULL_FOR_S, and until a write has met the full disk and said so
            time.sleep(FULL_FOR_S)
            deadline = time.monotonic() + FULL_AT_MOST_S
            while not enospc_reports(folder, run_dir, [jobid]) and time.monotonic() < deadline:
                time.sleep(0.2)
            ballast.unlink(missing_ok=True)

        threading.Thread(target=free, daemon=True).start()
        highs.append(str(ballast))  # (not a job: the test waits for it to be gone before resubmitting)
    else:
        assert kind == "time-limit", kind


# ------------------------------------------------------------------------------------------- checks
def run_logs(run_dir: Path) -> list[tuple[int, list[int]]]:
    """(start step, steps logged) of every run, in order, from rank 0's log (every run appends to it)."""
    text = (run_dir / "logs" / "rank0.log").read_text()
    parts = re.split(r"starts at step (\d+)", text)
    return [(int(parts[i]), [int(s) for s in re.findall(r"\bstep (\d+)/\d+", parts[i + 1])])
            for i in range(1, len(parts), 2)]


def steps_lost(run_dir: Path) -> list[int]:
    """For each restart: the steps the previous run trained beyond where the next one started."""
    logged = run_logs(run_dir)
    return [max([start, *steps]) - nxt for (start, steps), (nxt, _) in zip(logged, logged[1:])]


ALLOWED = {  # each kind: the states sacct may show for the runs before the last (which must be COMPLETED)
    "preempt-grace0": {"PREEMPTED", "REQUEUED"}, "preempt-grace10": {"REQUEUED"}, "scancel": set(),
    "scancel-usr2": {"REQUEUED"}, "time-limit": {"REQUEUED"}, "outside-requeue": {"REQUEUED"},
    "kill-rank": set(),  # the batch script starts the step again in the same allocation: no requeue
    "disk-full": {"REQUEUED"}, LATE_RANK: {"REQUEUED"},
}


def verified_state(run_dir: Path) -> dict[str, Any]:
    """The latest checkpoint's state (a sharded one's consolidated); it must verify, and no newer one may have
    been skipped as broken."""
    state, skipped = latest_checkpoint(run_dir)
    assert skipped == (), f"checkpoints skipped as broken: {skipped}"
    return state


def enospc_reports(folder: Path, run_dir: Path, jobids: list[str]) -> list[str]:
    """Every place a full disk was reported: the ledger's failed saves and failures, the ranks' logs and
    the jobs' output (a job that stayed down because of it says so there)."""
    found = [e.get("error", "") for e in events(run_dir) if e["event"] in ("checkpoint_failed", "failed")]
    files = [*(run_dir / "logs").glob("rank*.log"), *(p for j in jobids for p in (folder / "submitit").glob(f"{j}_*"))]
    found += [line for path in files if path.is_file() for line in path.read_text(errors="replace").splitlines()]
    return [line for line in found if "ENOSPC" in line or "No space left on device" in line]


@pytest.mark.parametrize("scenario", [pytest.param(s, id=s.id) for s in selected(os.environ.get(SELECT_ENV))])
def test_fault_scenario(scenario: Scenario, slurm_cluster: SlurmCluster, slurm_policy: Callable[..., str],
                        references: dict[str, Reference], small_fs: Callable[[int], Path], tmp_path: Path) -> None:
    grace = 10 if scenario.kind == "preempt-grace10" else 0
    slurm_policy(grace=grace, user_signal=True)
    ballast = ["task.args.ballast_mb=150"] if scenario.moment == "checkpoint-write" and scenario.kind != LATE_RANK \
        else []
    folder = tmp_path / "runs"
    # disk-full: the run's own filesystem (checkpoints, ledger, logs) fills up; the job's stdout and stderr
    # (submitit's folder) are elsewhere, as on clusters with scratch space, so what the job says is kept.
    own_fs = [f"run.dir={small_fs((1024 if ballast else 96) * 1024) / 'run'}"] if scenario.kind == "disk-full" else []
    markers = tmp_path / "markers"
    markers.mkdir()
    args = [*TWO_RANKS, *ALL_CPUS, *MATRIX, f"data.num_workers={scenario.workers}", f"task.args.marker_dir={markers}",
            *ballast, *own_fs, *(TIME_LIMIT if scenario.kind == "time-limit" else []),
            *(["train.parallel=fsdp"] if scenario.parallel == "fsdp" else []),
            *(LATE if scenario.kind == LATE_RANK else [])]
    started = time.monotonic()
    row: dict[str, Any] = {"order": ORDER[scenario.id], "id": scenario.id, "outcome": "", "stops": [], "lost": "-",
                           "identical": False, "seconds": 0.0, "passed": False}
    jobids: list[str] = []
    highs: list[str] = []
    run_dir = folder / "run"
    try:
        jobid, run_dir = submit_one(folder, *args)
        jobids.append(jobid)
        run = land(scenario, slurm_cluster, jobid, folder, run_dir, markers)
        fire(scenario, slurm_cluster, jobid, folder, run_dir, run, highs)
        state = final_state(slurm_cluster, jobid, timeout=240)
        outcome = runs(slurm_cluster, jobid)
        if state != "COMPLETED":
            # The job stays down: scancel, or a full disk at its start. The same command continues the run.
            assert (scenario.kind, state) in {("scancel", "CANCELLED"), ("disk-full", "FAILED")}, \
                (outcome, job_output(folder, jobid))
            print(f"job {jobid} ended {state}:\n{job_output(folder, jobid)}")
            if scenario.kind == "scancel":
                stops = [e["step"] for e in events(run_dir, "preempted") if e["job_id"] == jobid]
                if stops:  # a stop was agreed (not a cancel before the ranks had started)
                    assert verified_state(run_dir)["progress"]["step"] == stops[-1]
            wait_until("the disk to be free again", lambda: not any(Path(h).exists() for h in highs if "/" in h),
                       FULL_FOR_S + FULL_AT_MOST_S + 10)
            again, same_dir = submit_one(folder, *args)
            jobids.append(again)
            assert same_dir == run_dir
            assert final_state(slurm_cluster, again, timeout=240) == "COMPLETED", job_output(folder, again)
            outcome += ["(resubmitted)", *runs(slurm_cluster, again)]
        row["outcome"] = " → ".join(outcome)
        assert outcome[-1] == "COMPLETED", outcome
        before_last = [s for s in outcome[:-1] if s != "(resubmitted)"]
        allowed = ALLOWED[scenario.kind] | ({"REQUEUED"} if scenario.moment == "first-step-after-resume" else set())
        allowed |= {"CANCELLED"} if scenario.kind == "scancel" else {"FAILED"} if scenario.kind == "disk-full" else set()
        assert set(before_last) <= allowed, outcome
        row["stops"] = [e["step"] for e in events(run_dir, "preempted")]
        lost = steps_lost(run_dir)
        row["lost"] = max(lost, default=0)
        if scenario.kind in SIGNAL_KINDS:
            assert all(n == 0 for n in lost), f"steps lost at the restarts: {lost}"
        elif scenario.kind == "kill-rank":
            assert all(n <= 2 for n in lost), lost  # back to the last checkpoint, at most checkpoint.every_steps
        if scenario.kind == "kill-rank":  # the README: the batch script starts the step again in place
            assert events(run_dir, "restarted"), events(run_dir)
            assert [e["after"] for e in events(run_dir, "restarted")] == ["failure"], events(run_dir, "restarted")
        state_now = verified_state(run_dir)
        assert state_now["progress"]["step"] == STEPS
        ref = references[scenario.parallel].state()
        assert_identical({k: v for k, v in state_now["model"].items() if k != "ballast"}, ref["model"], "model")
        optimizer = "optim" if scenario.parallel == "fsdp" else "optimizer"  # a sharded one's, consolidated
        assert_identical(state_now[optimizer], ref[optimizer], optimizer)
        assert_identical(state_now["scheduler"], ref["scheduler"], "scheduler")
        row["identical"] = True
        if scenario.kind == "time-limit":  # the --signal lead stops it, not the limit: a self-requeue at that step
            (preempted,) = events(run_dir, "preempted")
            assert preempted["signals"] == ["SIGUSR2"] and preempted["reasons"] == ["requeue_signal"], preempted
            (first_run, _) = events(run_dir, "started")
            assert preempted["time"] - first_run["time"] < 60, "stopped only at the time limit"
            (decision,) = events(run_dir, "stop_decision")
            assert (decision["what"], decision["requeue"]) == ("user_signal", True), decision
            assert [(e["how"], e["step"]) for e in events(run_dir, "requeued")] == [("self", preempted["step"])]
            assert [e["step"] for e in events(run_dir, "resumed")] == [preempted["step"]]
        if scenario.kind == "outside-requeue":  # Slurm requeues (SIGTERM): the ranks save, nobody requeues again
            for preempted in events(run_dir, "preempted"):
                assert set(preempted["signals"]) == {"SIGTERM"} and preempted["reasons"] == ["sigterm"], preempted
            decisions = [(e["what"], e["requeue"]) for e in events(run_dir, "stop_decision")]
            assert set(decisions) <= {("requeued_by_slurm", False)}, decisions
            assert events(run_dir, "requeued") == []
        if scenario.kind in ("preempt-grace0", "preempt-grace10") and scenario.moment != "rendezvous":
            # the user signal first (the policy's send_user_signal); with a grace period, only it, and the job
            # requeues itself; at GraceTime 0 Slurm requeues it
            preempts = [e for e in events(run_dir, "preempted") if "SIGUSR2" in e["signals"]]
            assert preempts, events(run_dir, "preempted")
            if grace:
                assert {tuple(e["reasons"]) for e in preempts} == {("requeue_signal",)}, preempts
                assert ("preempted", True) in {(e["what"], e["requeue"]) for e in events(run_dir, "stop_decision")}
            else:
                assert ("requeued_by_slurm", False) in {(e["what"], e["requeue"])
                                                         for e in events(run_dir, "stop_decision")}
        if scenario.kind == LATE_RANK:  # that save alone failed, naming rank 1; every later one is durable
            (failed,) = events(run_dir, "checkpoint_failed")
            assert failed["step"] == LATE_STEP, failed
            late = "rank 1 had not written its shard when rank 0 stopped waiting (after 10 s)"
            assert late in failed["error"], failed
            saved = [e["step"] for e in events(run_dir, "checkpoint_saved")]
            assert [s for s in saved if s > LATE_STEP] and LATE_STEP not in saved, saved
            assert {e["step"] for e in events(run_dir, "preempted")} <= set(saved), saved  # the stop's save
        if scenario.kind == "disk-full":
            failures = events(run_dir, "checkpoint_failed")
            assert all("ENOSPC" in e["error"] for e in failures), failures
            assert enospc_reports(folder, run_dir, jobids), "the disk filled up and nothing said ENOSPC"
        row["passed"] = True
    except BaseException as error:  # the table says why: the assertion's first line
        row["error"] = (f"{type(error).__name__}: " + (str(error).strip().splitlines() or [""])[0])[:300]
        raise
    finally:
        if not row["passed"] and scenario.kind == "disk-full" and run_dir.exists():
            shutil.copytree(run_dir, tmp_path / "run-copy", dirs_exist_ok=True)  # the tmpfs goes with the test
        row["seconds"] = round(time.monotonic() - started, 1)
        cancel(slurm_cluster, *jobids, *(h for h in highs if "/" not in h))
        report = os.environ.get(REPORT_ENV)
        if report:
            with open(report, "a") as file:
                file.write(json.dumps(row) + "\n")

