"""Hung ranks on the real test cluster: the watchdog finds them within its bound, leaves every live rank's
stacks in its log, names the stuck rank and node in a `hang` event, and the batch script brings the job
back: onto the other node when a 1-node job's node is to blame (excluded), in the same allocation when no
node can be blamed, or not at all (one clear line) when excluding the node would leave the job too few.
Every job resumes from its last checkpoint and ends bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import pytest
from job_helpers import (ALL_CPUS, SLOW, SLOW_STEPS, TWO_RANKS, Reference, assert_same_training, cancel, events,
                         job_output, rank_record, submit_one, wait_steps)
from slurm_helpers import final_state, job, runs, wait_until

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = pytest.mark.slurm

# SLOW's numerics; the watchdog's allowance: 5 x the step time (0.2 s), at least 3 s.
WATCHDOG = ["watchdog.floor_s=3", "watchdog.step_multiple=5", "watchdog.first_step_s=60", "watchdog.checkpoint_s=6"]
ONE_NODE = ["--nodes", "1", "--gpus-per-node", "2"]


def hanging(tmp_path: Path, mode: str, rank: int, at: int = 6) -> list[str]:
    return [*SLOW, *WATCHDOG, "task.target=tests.tasks:HangingBlobTask", f"task.args.mode={mode}",
            f"task.args.rank={rank}", f"task.args.at={at}", f"task.args.hang_file={tmp_path / 'hung-once'}"]


@pytest.fixture(scope="module")
def reference(references: dict[int, Reference]) -> Reference:
    """SLOW on 2 ranks, uninterrupted: the session's run (tests/e2e/conftest.py), shared with test_jobs."""
    return references[2]


def the_hang(run_dir: Path) -> dict:
    (hang,) = events(run_dir, "hang")
    return hang


# One way to hang here: a rank frozen from outside (SIGSTOP), the one only a real job shows end to end. The
# other ways (asleep in its loss, stuck in a checkpoint write) are found, named and ended the same way in
# tests/test_watchdog.py::test_a_hung_rank_is_found_named_and_ended; what follows the hang event (the
# node excluded, the requeue, the resume on the other node) does not depend on how the rank hung.
@pytest.mark.parametrize("mode, culprit", [pytest.param("stop", 1, id="sigstopped")])
def test_a_one_node_jobs_bad_node_is_excluded_and_the_job_resumes_on_the_other(
        mode: str, culprit: int, slurm_cluster: SlurmCluster, slurm_policy: Callable[..., str],
        reference: Reference, tmp_path: Path) -> None:
    slurm_policy()
    extra = ["checkpoint.async_save=false"] if mode == "save" else []
    jobid, run_dir = submit_one(tmp_path, *ONE_NODE, *hanging(tmp_path, mode if mode != "stop" else "sleep", culprit,
                                                                at=10**9 if mode == "stop" else 6), *extra)
    try:
        if mode == "stop":  # frozen from outside, as a dead NIC or a D-state read would leave it
            wait_steps(run_dir, run=1, steps=5)
            os.kill(rank_record(run_dir, culprit)["pid"], signal.SIGSTOP)
        first_node = wait_until("the job to run", lambda: job(slurm_cluster, jobid).get("NodeList"), 60)
        hung = wait_until("the hang event", lambda: events(run_dir, "hang"), timeout=90, interval=0.5)
        hang = hung[0]  # type: ignore[index]
        assert hang["ranks"] == [culprit] and hang["hosts"] == [first_node], hang
        assert hang["waited_s"] <= 3 + 2 + 6, hang  # the allowance (floor 3 s; 6 s for a write) and a poll
        assert (culprit in hang["frozen"]) == (mode == "stop"), hang
        assert final_state(slurm_cluster, jobid, timeout=180) == "COMPLETED", job_output(tmp_path, jobid)
        assert runs(slurm_cluster, jobid) == ["REQUEUED", "COMPLETED"]
        (excluded,) = events(run_dir, "node_excluded")
        assert excluded["node"] == first_node and excluded["excluded"] == [first_node]
        (other_node,) = set(slurm_cluster.nodes) - {first_node}
        assert job(slurm_cluster, jobid).get("NodeList", "gone") in ("gone", other_node)
        assert rank_record(run_dir, 0)["hostname"] != first_node  # the second run ran on the other node
        # Every rank that could still run left its threads' stacks.
        for rank in range(2):
            if mode == "stop" and rank == culprit:
                continue
            assert "most recent call first" in (run_dir / "logs" / f"rank{rank}.log").read_text()
        (resumed,) = events(run_dir, "resumed")
        saved = [e["step"] for e in events(run_dir, "checkpoint_saved") if e["restart"] == 0]
        assert resumed["step"] == max(saved) and hang["step"] - 2 <= resumed["step"] <= hang["step"]
        assert [e["step"] for e in events(run_dir, "finished")] == [SLOW_STEPS]
        assert_same_training(run_dir, reference.state())
    finally:
        if mode == "stop":
            try:
                os.kill(rank_record(run_dir, culprit)["pid"], signal.SIGKILL)
            except (OSError, KeyError, ValueError):
                pass
        cancel(slurm_cluster, jobid)


def test_a_hang_nobody_can_be_blamed_for_restarts_in_the_same_allocation(
        slurm_cluster: SlurmCluster, slurm_policy: Callable[..., str], reference: Reference, tmp_path: Path) -> None:
    slurm_policy()
    # Every rank sleeps in its loss at the same call: all in the same phase, nobody behind anybody.
    config = [*SLOW, *WATCHDOG, "task.target=tests.tasks:HangingBlobTask", "task.args.mode=sleep", "task.args.at=6",
              "task.args.rank=-1", f"task.args.hang_file={tmp_path / 'hung-once'}"]
    jobid, run_dir = submit_one(tmp_path, *TWO_RANKS, *ALL_CPUS, *config)
    try:
        started = time.monotonic()
        assert final_state(slurm_cluster, jobid, timeout=180) == "COMPLETED", job_output(tmp_path, jobid)
        hang = the_hang(run_dir)
        assert hang["ranks"] == [] and hang["hosts"] == [], hang
        assert runs(slurm_cluster, jobid) == ["COMPLETED"]  # no requeue: the step started again in place
        (restarted,) = events(run_dir, "restarted")
        assert restarted["after"] == "hang" and events(run_dir, "requeued") == []
        assert time.monotonic() - started < 120
        assert_same_training(run_dir, reference.state())
    finally:
        cancel(slurm_cluster, jobid)


def test_a_bad_node_a_job_cannot_do_without_restarts_the_step_in_place(
        slurm_cluster: SlurmCluster, slurm_policy: Callable[..., str], reference: Reference, tmp_path: Path) -> None:
    slurm_policy()
    # 2 nodes needed, 2 in the partition: excluding the culprit's would leave one. The allocation is intact, so
    # the step starts again in place, counted against --max-failures (it stayed down before; a node that hangs
    # every time spends the budget and then stays down: tests/test_recovery.py). The rank freezes once here
    # (SIGSTOP, in step 6); with the defaults the other saves step 5 when its watchdog finds the hang, and the step
    # started again resumes there: one step lost.
    jobid, run_dir = submit_one(tmp_path, *TWO_RANKS, *hanging(tmp_path, "stop", 1))
    try:
        assert final_state(slurm_cluster, jobid, timeout=180) == "COMPLETED", job_output(tmp_path, jobid)
        hang = the_hang(run_dir)
        assert hang["ranks"] == [1] and len(hang["hosts"]) == 1, hang
        (decision,) = events(run_dir, "stop_decision")
        assert decision["action"] == "restart", decision
        assert (f"excluding {hang['hosts'][0]} would leave 1 of the 2 nodes the job needs in its partition"
                in decision["reason"] and "restarting in place instead" in decision["reason"]), decision
        (restarted,) = events(run_dir, "restarted")
        assert restarted["after"] == "hang" and events(run_dir, "requeued") == []
        assert runs(slurm_cluster, jobid) == ["COMPLETED"]
        (resumed,) = events(run_dir, "resumed")
        assert resumed.get("memory") is True and resumed["step"] >= hang["step"] - 1, (resumed, hang)
        assert_same_training(run_dir, reference.state())
    finally:
        cancel(slurm_cluster, jobid)


# A rank three times slower than the others is not hung: tests/test_watchdog.py's
# test_a_slow_but_healthy_rank_is_not_hung (the same job on one machine: the heartbeats go through the same
# rendezvous store a two-node job's do).
