"""Training jobs on the real local Slurm cluster: placement, preemption, requeue, time limit, scancel,
the requeue budget, a killed rank, job arrays. Real sbatch/srun/scontrol/scancel, no mocks.

Every job is submitted the way users do (jobs/submit.py, or sbatch on the templates), every wait is
bounded, and every job is cancelled in `finally`. Bit-identity is checked against one uninterrupted
run per world size of the same config, started in the background when the module starts (torchrun
on this machine: the same config and world size give the same numbers as a Slurm job).

Resources: a "preemptible" job asks for 4 CPUs per task on both nodes (all of them), so a 1-CPU job
in partition `high` must preempt it. Steps sleep (SlowBlobTask) so that signals land mid-training.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import pytest
from job_helpers import (SLOW, SLOW_STEPS, slow_stream, SLOW4, TWO_RANKS, FOUR_RANKS, ALL_CPUS, KILL_WAIT_S, submit, submit_one, preempt, cancel, job_output, events, wait_steps, mid_epoch, checkpoint_state, assert_same_training, assert_resumed_where_stopped, rank_record, assert_placement, Reference)
from slurm_helpers import final_state, job, runs, wait_until

from tests.conftest import PYTHON, ROOT, base_env

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = pytest.mark.slurm


# `references` (the uninterrupted runs to compare with): tests/e2e/conftest.py, shared with test_hangs.


@pytest.fixture(autouse=True)
def _start_references_early(references: dict[int, Reference]) -> None:
    """Every test asks for the references, so they start with the module's first test."""


# ------------------------------------------------------------------------------------- 1-2: placement
# jobs/submit.py's 4 ranks on 2 nodes: placed as Slurm placed them, checked in
# test_killed_rank_ends_the_step_and_the_job_resumes before it kills one.


@pytest.mark.parametrize("template", ["train.sbatch", "train_torchrun.sbatch"])
def test_sbatch_template_places_every_rank(template: str, slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    config = tmp_path / "blob.yaml"
    config.write_text("task:\n  target: tests.tasks:BlobTask\ntrain:\n  epochs: 2\ndata:\n  batch_size: 4\n")
    per_task = ["--ntasks-per-node=2", "--cpus-per-task=1"] if template == "train.sbatch" else \
        ["--ntasks-per-node=1", "--cpus-per-task=2"]
    cmd = ["sbatch", "--parsable", "-p", "main", "-N2", "--gpus-per-node=2", *per_task, "--time=5",
           "-o", f"{tmp_path}/%x-%j.out", "--export=ALL", f"slurm/{template}", str(config),
           f"run.root={tmp_path}", "run.name=tpl", "log.every_steps=1"]
    env = base_env(PYTHON=PYTHON, SLURM_CONF=str(slurm_cluster.conf))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobid = proc.stdout.strip().split(";")[0]
    try:
        state = final_state(slurm_cluster, jobid, timeout=120)
        out = next(tmp_path.glob(f"*-{jobid}.out"))
        assert state == "COMPLETED", out.read_text()[-3000:]
        launcher = "slurm" if template == "train.sbatch" else "torchrun"
        assert_placement(slurm_cluster, jobid, tmp_path / "tpl", world=4, per_node=2, launcher=launcher)
    finally:
        cancel(slurm_cluster, jobid)


def test_a_cancelled_template_job_prints_the_command_that_continues_it(slurm_cluster: SlurmCluster,
                                                                      tmp_path: Path) -> None:
    """slurm/train.sbatch cannot see its sbatch options; the message comes with them all the same (from
    accounting's SubmitLine), and running the printed command continues the run from its checkpoint."""
    config = tmp_path / "slow.yaml"
    config.write_text("task:\n  target: tests.tasks:SlowBlobTask\n")
    cmd = ["sbatch", "--parsable", "-p", "main", "-N2", "--gpus-per-node=1", "--ntasks-per-node=1", "--cpus-per-task=1",
           "--time=5", "-o", f"{tmp_path}/%x-%j.out", "slurm/train.sbatch", str(config), f"run.root={tmp_path}",
           "run.name=tpl", *SLOW[1:]]
    env = base_env(PYTHON=PYTHON, SLURM_CONF=str(slurm_cluster.conf))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobids = [proc.stdout.strip().split(";")[0]]
    run_dir = tmp_path / "tpl"
    try:
        wait_steps(run_dir, run=1, steps=2)
        slurm_cluster.run("scancel", jobids[0])
        assert final_state(slurm_cluster, jobids[0], timeout=60) == "CANCELLED"
        out = next(tmp_path.glob(f"*-{jobids[0]}.out")).read_text()
        found = re.findall(r"^train: stopped at step (\d+): the job was cancelled; .*; to resume: (.*)$", out, re.M)
        assert len(found) == 1, out[-3000:]
        step, resume = int(found[0][0]), found[0][1]
        options = " -p main -N2 --gpus-per-node=1 --ntasks-per-node=1 --cpus-per-task=1 --time=5 -o "
        assert "<" not in resume and options in resume, resume
        again = subprocess.run(["bash", "-c", resume], env=env, capture_output=True, text=True, timeout=30)
        assert again.returncode == 0, again.stdout + again.stderr
        jobids.append(again.stdout.strip().split(";")[0])
        assert final_state(slurm_cluster, jobids[1], timeout=150) == "COMPLETED"
        assert [(e["job_id"], e["step"]) for e in events(run_dir, "resumed")] == [(jobids[1], step)]
        assert [e["step"] for e in events(run_dir, "finished")] == [SLOW_STEPS]
    finally:
        cancel(slurm_cluster, *jobids)


# ---------------------------------------------------------------------------------- 3-5: preemption
# With the user signal (send_user_signal), both grace times are the fault matrix's preempt-grace0 and
# preempt-grace10 rows (tests/e2e/test_fault_matrix.py: the signal, the decision, bit-identical); here the
# policies without it, where SIGTERM alone starts the stop. One policy's job reads a token-shard stream
# (mgpu.data.stream.ShardedStream) instead of the map-style blobs: a preempted streaming job resumes at the exact
# sample, bit-identical to an unbroken stream run.
POLICIES = [pytest.param(0, False, False, id="grace0-nosignal"),
            pytest.param(10, False, True, id="grace10-nosignal-stream")]


@pytest.mark.parametrize("grace, user_signal, stream", POLICIES)
def test_preempted_job_resumes_bit_identical(grace: int, user_signal: bool, stream: bool, slurm_cluster: SlurmCluster,
                                             slurm_policy: Callable[..., str],
                                             references: dict[int | str, Reference], tmp_path: Path) -> None:
    slurm_policy(grace=grace, user_signal=user_signal)
    jobid, run_dir = submit_one(tmp_path, *TWO_RANKS, *ALL_CPUS,
                                *(slow_stream(tmp_path / "data") if stream else SLOW))
    high = ""
    try:
        wait_steps(run_dir, run=1, steps=2, when=mid_epoch)
        high = preempt(slurm_cluster)
        assert final_state(slurm_cluster, jobid, timeout=150) == "COMPLETED"
        assert final_state(slurm_cluster, high, timeout=30) == "COMPLETED"
        # GraceTime 0: Slurm requeued it (PREEMPTED); with a grace period the job requeued itself.
        assert runs(slurm_cluster, jobid) == ["PREEMPTED" if grace == 0 else "REQUEUED", "COMPLETED"]
        (stop_step,) = assert_resumed_where_stopped(run_dir, stops=1)
        assert events(run_dir, "resumed")[0]["position"] > 0, "not stopped mid-epoch"
        (preempted,) = events(run_dir, "preempted")
        signals = set(preempted["signals"])  # what rank 0 had received when it stopped
        if grace == 0:
            assert ("SIGUSR2" if user_signal else "SIGTERM") in signals, preempted
        else:  # only the preemption's first signal: the TERM comes at the end of the grace period
            assert signals == {"SIGUSR2" if user_signal else "SIGTERM"}, preempted
            assert preempted["reasons"] == ["requeue_signal" if user_signal else "sigterm"], preempted
        (decision,) = events(run_dir, "stop_decision")
        assert decision["step"] == stop_step
        requeued = events(run_dir, "requeued")
        if grace == 0:
            assert (decision["what"], decision["requeue"]) == ("requeued_by_slurm", False), decision
            assert requeued == []
        else:
            assert (decision["what"], decision["requeue"]) == ("preempted", True), decision
            assert [(e["how"], e["step"]) for e in requeued] == [("self", stop_step)], requeued
        assert_same_training(run_dir, references["stream" if stream else 2].state())
        if stream:  # the files' manifest went into the checkpoint (a resume on changed files is refused)
            assert [f["name"] for f in checkpoint_state(run_dir)["stream"]["files"]] == [
                f"shard-{k}.bin" for k in range(4)]
    finally:
        cancel(slurm_cluster, jobid, high)


def test_five_preemptions_in_a_row_stay_bit_identical(slurm_cluster: SlurmCluster,
                                                      slurm_policy: Callable[..., str],
                                                      references: dict[int, Reference], tmp_path: Path) -> None:
    slurm_policy()
    # Five runs must fit in the job's 30 steps. Each run makes 1 step before the preempting job is
    # submitted, then as many as pass until Slurm's scheduler preempts (about a second here) and the ranks
    # agree. So: agreement every step, and 0.5 s steps (a sleep: numerically irrelevant, the reference
    # sleeps 0.2 s), leaving ~4 steps per run; with 0.2 s steps 5 runs took up to 7 steps each.
    jobid, run_dir = submit_one(tmp_path, *TWO_RANKS, *ALL_CPUS, *SLOW, "task.args.step_s=0.5",
                                "preemption.check_every_steps=1")
    highs: list[str] = []
    try:
        for n in range(1, 6):
            wait_steps(run_dir, run=n, steps=1, timeout=60)
            highs.append(preempt(slurm_cluster))
            wait_until(f"preemption {n} to be saved", lambda: len(events(run_dir, "preempted")) == n, timeout=30)
        assert final_state(slurm_cluster, jobid, timeout=120) == "COMPLETED"
        assert runs(slurm_cluster, jobid) == ["PREEMPTED"] * 5 + ["COMPLETED"]
        stops = assert_resumed_where_stopped(run_dir, stops=5)
        assert stops == sorted(set(stops)), f"every run must make progress: {stops}"
        assert_same_training(run_dir, references[2].state())
        for high in highs:
            assert final_state(slurm_cluster, high, timeout=30) == "COMPLETED"
    finally:
        cancel(slurm_cluster, jobid, *highs)
    # jobs/status.py on this run: the goodput table from the ledger and sacct (queued time known apart, every
    # preemption a stop with its cost, no lost step) and the timeline picture
    png = tmp_path / "timeline.png"
    result = subprocess.run([PYTHON, str(ROOT / "jobs" / "status.py"), str(run_dir), "--plot", str(png)], cwd=ROOT,
                            env=base_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert f"job         {jobid} (slurm: COMPLETED)" in out
    assert "progress    step 30 of 30, epoch 3" in "\n".join(out)
    goodput = next(line for line in out if line.startswith("goodput "))
    assert "allocated (sacct) spent training; 6 segment(s)" in goodput, out
    rows = {line.split()[0]: line for line in out if line.startswith("  ")}
    for row in ("queued", "starting", "training", "stopping", "restarting"):
        assert row in rows, out
    assert rows["lost"].split()[:3] == ["lost", "steps", "0"], out  # a stop saves at its step
    assert any(line.startswith("stops       5; preemptions 5 (") for line in out), out
    assert rows["requeued_by_slurm"].split()[:2] == ["requeued_by_slurm", "5"], out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (1100, 550)
    assert 20_000 < len(data) < 1_000_000


# 6: the time limit's --signal lead, and an outside `scontrol requeue`: the fault matrix's time-limit and
# outside-requeue rows (tests/e2e/test_fault_matrix.py) check the signal, the decision and the resume.


# ----------------------------------------------------------------------------------------- 7: scancel
def test_scancel_saves_and_stays_cancelled(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    jobid, run_dir = submit_one(tmp_path, *TWO_RANKS, *SLOW)
    try:
        wait_steps(run_dir, run=1, steps=2)
        slurm_cluster.run("scancel", jobid)
        assert final_state(slurm_cluster, jobid, timeout=60) == "CANCELLED"
        (preempted,) = events(run_dir, "preempted")
        assert "SIGTERM" in preempted["signals"], preempted
        (decision,) = events(run_dir, "stop_decision")
        assert (decision["what"], decision["requeue"]) == ("cancelled", False), decision
        assert checkpoint_state(run_dir)["progress"]["step"] == preempted["step"]
        time.sleep(8)  # longer than a requeued job is held (cred_expire + 1 s): a second run would show now
        assert runs(slurm_cluster, jobid) == ["CANCELLED"]
        assert job(slurm_cluster, jobid).get("JobState", "CANCELLED") == "CANCELLED"
        assert len(events(run_dir, "started")) == 1 and events(run_dir, "requeued") == []
    finally:
        cancel(slurm_cluster, jobid)


# -------------------------------------------------------------------------------- 8: requeue budget
@pytest.mark.parametrize("grace", [pytest.param(0, id="slurm-requeues"), pytest.param(10, id="self-requeue")])
def test_exhausted_requeue_budget_stops_for_good(grace: int, slurm_cluster: SlurmCluster,
                                                 slurm_policy: Callable[..., str], tmp_path: Path) -> None:
    slurm_policy(grace=grace, user_signal=True)
    jobid, run_dir = submit_one(tmp_path, *TWO_RANKS, *ALL_CPUS, "--max-requeues", "0", *SLOW)
    high = ""
    try:
        wait_steps(run_dir, run=1, steps=2)
        high = preempt(slurm_cluster)
        assert final_state(slurm_cluster, jobid, timeout=90) == "FAILED"
        errors = (tmp_path / "submitit" / f"{jobid}_0_log.err").read_text()
        if grace == 0:
            # Slurm requeued it anyway; the second run refuses to train.
            assert runs(slurm_cluster, jobid) == ["PREEMPTED", "FAILED"]
            failed = events(run_dir, "failed")
            assert [e["restart"] for e in failed] == [1], failed
            message = "requeue budget exhausted: this is restart 1 of at most 0"
            assert failed[0]["error"].startswith(message), failed
            assert events(run_dir, "resumed") == [] and len(events(run_dir, "started")) == 1
        else:
            assert runs(slurm_cluster, jobid) == ["FAILED"]
            (decision,) = events(run_dir, "stop_decision")
            message = "preempted, but the requeue budget is spent (0 of 0 requeues used)"
            assert (decision["requeue"], decision["what"]) == (False, "preempted") and \
                decision["reason"].startswith(message), decision
            assert events(run_dir, "requeued") == []
        assert message in errors, errors[-2000:]
        time.sleep(8)
        assert len(runs(slurm_cluster, jobid)) == (2 if grace == 0 else 1), "ran again"
    finally:
        cancel(slurm_cluster, jobid, high)


# ------------------------------------------------------------------------------------ 9: a rank dies
# Rank 1 of 2 SIGKILLed: the fault matrix's kill-rank rows; here rank 0 (the one that decides) of 4.
@pytest.mark.parametrize("world, victim", [pytest.param(4, 0, id="world4-kill-rank0")])
def test_killed_rank_ends_the_step_and_the_job_resumes(world: int, victim: int, slurm_cluster: SlurmCluster,
                                                       references: dict[int, Reference], tmp_path: Path) -> None:
    config = SLOW if world == 2 else SLOW4
    jobid, run_dir = submit_one(tmp_path, *(TWO_RANKS if world == 2 else FOUR_RANKS), *config)
    try:
        wait_steps(run_dir, run=1, steps=3, when=lambda step: step % 2 == 1)  # a checkpoint 1 step behind
        # jobs/submit.py's ranks, as Slurm placed them (block distribution, 2 per node)
        assert_placement(slurm_cluster, jobid, run_dir, world=world, per_node=2, launcher="slurm", whole_run=False)
        # The ranks run in this machine's pid namespace (slurmd only changes the UTS namespace).
        os.kill(rank_record(run_dir, victim)["pid"], 9)
        killed = time.monotonic()
        # No hang: srun ends the step (TERM to the survivors, KILL after KillWait); the batch script starts
        # it again in the same allocation (no requeue hold).
        wait_until("the step to start again", lambda: events(run_dir, "restarted"), timeout=KILL_WAIT_S + 15,
                   interval=0.2)
        assert time.monotonic() - killed < KILL_WAIT_S + 10
        assert final_state(slurm_cluster, jobid, timeout=150) == "COMPLETED"
        assert runs(slurm_cluster, jobid) == ["COMPLETED"]  # one allocation, two steps
        (decision,) = events(run_dir, "stop_decision")  # exactly one decision: the batch script's, after srun
        assert (decision["what"], decision["requeue"], decision["action"]) == ("terminated", True, "restart"), decision
        assert "rank" not in decision and decision["restart"] == 0 and "after a failure" in decision["reason"]
        assert [(e["after"], e["restart"]) for e in events(run_dir, "restarted")] == [("failure", 0)]
        assert events(run_dir, "requeued") == []
        everything = events(run_dir)
        first_attempt = everything[:next(i for i, e in enumerate(everything) if e["event"] == "restarted")]
        saved_before = max(e["step"] for e in first_attempt if e["event"] == "checkpoint_saved")
        reached = max(e["step"] for e in first_attempt if e["event"] == "progress")
        # With the defaults the survivors save the step they completed (issue 44): at most one step lost, the
        # decider's death included; what the disk held is the floor.
        (resumed,) = events(run_dir, "resumed")
        assert saved_before <= resumed["step"] and reached - resumed["step"] <= 1, (saved_before, reached, resumed)
        if resumed.get("memory") is True:  # the survivors' save: newer than anything durable
            assert resumed["step"] > resumed["durable_step"] >= saved_before, resumed
        elif resumed["step"] > saved_before:
            # From the disk, a save newer than its event: the victim, rank 0, was killed between that save's commit
            # and the `checkpoint_saved` it writes after it (CI: step 4 durable without its event, resumed at 4)
            assert resumed["from"] == str(run_dir / "checkpoints" / f"step_{resumed['step']:08d}"), resumed
        assert [(e["step"], e["restart"]) for e in events(run_dir, "finished")] == [(SLOW_STEPS, 0)]
        assert_same_training(run_dir, references[world].state())
    finally:
        cancel(slurm_cluster, jobid)


def test_a_bug_is_requeued_only_within_the_budget(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    config = ["task.target=tests.e2e.jobtasks:BuggyBlobTask", "task.args.fail_after=3", "train.epochs=3",
              "data.batch_size=2", "checkpoint.every_steps=1"]
    jobid, run_dir = submit_one(tmp_path, *TWO_RANKS, "--max-failures", "1", *config)
    try:
        wait_until("two attempts to fail", lambda: len(events(run_dir, "stop_decision")) == 2, timeout=120)
        assert final_state(slurm_cluster, jobid, timeout=60) == "FAILED"
        decisions = events(run_dir, "stop_decision")
        # The first failure starts the step again in the allocation; the second finds the budget spent.
        assert [(d["requeue"], d.get("action")) for d in decisions] == [(True, "restart"), (False, "none")], decisions
        assert "the failure budget is spent (1 of 1 failure requeues used)" in decisions[1]["reason"]
        assert all("the training step exited with code" in d["error"] for d in decisions)
        failed = [e for e in events(run_dir, "failed") if "bug in the training code" in e["error"]]
        # Every rank records its own error (the bug raises on both), in each of the two attempts.
        assert sorted(e.get("rank") for e in failed) == [0, 0, 1, 1], failed
        assert [e["after"] for e in events(run_dir, "restarted")] == ["failure"]
        time.sleep(8)
        assert runs(slurm_cluster, jobid) == ["FAILED"], "started again beyond the budget"
    finally:
        cancel(slurm_cluster, jobid)


# ------------------------------------------------------------------------------------ 10: job arrays
def assert_resumed_where_stopped_once(run_dir: Path) -> None:
    (preempted,) = events(run_dir, "preempted")
    assert [e["step"] for e in events(run_dir, "resumed")] == [preempted["step"]]
    assert preempted["step"] in {e["step"] for e in events(run_dir, "checkpoint_saved")}
    assert [e["restart"] for e in events(run_dir, "finished")] == [1]


def test_preempting_one_array_task_requeues_only_that_task(slurm_cluster: SlurmCluster,
                                                          slurm_policy: Callable[..., str], tmp_path: Path) -> None:
    slurm_policy(grace=10, user_signal=True)  # the task requeues itself: by its <array>_<task> id
    ids, dirs = submit(tmp_path, "--nodes", "1", "--gpus-per-node", "1", *ALL_CPUS, "--max-parallel", "2",
                       "--sweep", "train.seed=0,1", *SLOW)
    assert len(ids) == 2
    array = ids[0].split("_")[0]
    assert ids == [f"{array}_0", f"{array}_1"]
    high = ""
    try:
        for run_dir in dirs:
            wait_steps(run_dir, run=1, steps=2)
        node = job(slurm_cluster, ids[0])["NodeList"]
        assert node != job(slurm_cluster, ids[1])["NodeList"]
        high = preempt(slurm_cluster, node)
        for task in ids:
            assert final_state(slurm_cluster, task, timeout=150) == "COMPLETED"
        assert runs(slurm_cluster, ids[0]) == ["REQUEUED", "COMPLETED"]
        assert runs(slurm_cluster, ids[1]) == ["COMPLETED"]
        requeued = events(dirs[0], "requeued")
        assert [(e["how"], e["message"]) for e in requeued] == [("self", f"requeued job {ids[0]}")], requeued
        assert rank_record(dirs[0], 0)["job_id"] == ids[0]
        assert_resumed_where_stopped_once(dirs[0])
        assert events(dirs[1], "preempted") == [] and len(events(dirs[1], "started")) == 1
        assert [e["restart"] for e in events(dirs[1], "finished")] == [0]
    finally:
        cancel(slurm_cluster, array, high)
