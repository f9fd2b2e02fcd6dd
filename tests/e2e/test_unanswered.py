"""A preempted job whose Slurm does not answer comes back (issue 42, item 4), on the real cluster.

GraceTime 20 with the user signal; inside the job (and only there: jobs/submit.py and this test ask the real
ones) `scontrol`, `squeue` and `sacct` hang, as a controller swamped at a mass preemption: shims first on the
job's PATH that sleep when SLURM_JOB_ID is set (tests/test_slurm_unanswered.py's stubs, for a real job). Before,
with MGPU_KILL_WAIT_S=5 the job ended FAILED 9.5 s after the user signal, before the preemption's SIGTERM at ~16 s,
and Slurm never requeued it; without it, rank 0's `scontrol show job` was still hanging at the kill and no stop
decision was recorded. Now each stop is decided within the time before the kill, the job stays alive (saved,
idle) until Slurm's preemption ends it, and Slurm requeues it: it resumes at its stop step.

Both variants in one preemption: two jobs, one node each (all of its CPUs), one with the user's MGPU_KILL_WAIT_S,
one with what jobs/submit.py read from Slurm at submission (KillWait 5, GraceTime 20).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import pytest
from job_helpers import SLOW, assert_resumed_where_stopped, cancel, events, job_output, mid_epoch, preempt, \
    submit_one, wait_steps
from slurm_helpers import final_state, job, runs

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = pytest.mark.slurm

ONE_NODE = ["--nodes", "1", "--gpus-per-node", "2", "--cpus-per-task", "2"]  # 2 ranks, the node's 4 CPUs
SLURM_COMMANDS = ("scontrol", "squeue", "sacct")
GRACE_S = 20


def hanging_slurm(tmp_path: Path) -> Path:
    """A directory of shims: inside a Slurm job each logs its call and hangs; elsewhere it is the real command."""
    shims = tmp_path / "shims"
    shims.mkdir()
    for name in SLURM_COMMANDS:
        real = shutil.which(name)
        assert real, f"{name} not on PATH"
        (shims / name).write_text(f'#!/bin/sh\nif [ -n "$SLURM_JOB_ID" ]; then\n'
                                  f'  echo "$(date +%s.%N) job $SLURM_JOB_ID: {name} $*" >> {tmp_path}/calls.log\n'
                                  f'  exec sleep 600\nfi\nexec {real} "$@"\n')
        (shims / name).chmod(0o755)
    return shims


def test_a_preempted_job_whose_slurm_does_not_answer_comes_back(slurm_cluster: SlurmCluster,
                                                                 slurm_policy: Callable[..., str],
                                                                 tmp_path: Path) -> None:
    # 20 s of grace: the ranks' exit, srun's end and the recovery's start come before its first ask ends, on a
    # loaded machine too (with 10 s, CI's load once pushed the ask past the grace: Slurm's SIGTERM came first, the job
    # was requeued as it should be, but no wait was recorded)
    slurm_policy(grace=GRACE_S, user_signal=True)
    import os

    path = f"{hanging_slurm(tmp_path)}:{os.environ['PATH']}"
    # the user's MGPU_KILL_WAIT_S; none (jobs/submit.py exports what Slurm said at submission)
    variants = {"kill-wait-given": {"PATH": path, "MGPU_KILL_WAIT_S": "5"}, "kill-wait-read": {"PATH": path}}
    jobs: dict[str, tuple[str, Path]] = {}
    highs: list[str] = []
    try:
        for name, environ in variants.items():
            jobs[name] = submit_one(tmp_path / name, *ONE_NODE, *SLOW, environ=environ)
        for jobid, run_dir in jobs.values():
            wait_steps(run_dir, run=1, steps=2, when=mid_epoch, timeout=150)
        nodes = {job(slurm_cluster, jobid)["NodeList"] for jobid, _ in jobs.values()}
        assert nodes == set(slurm_cluster.nodes), nodes
        highs = [preempt(slurm_cluster, node) for node in sorted(nodes)]
        for name, (jobid, run_dir) in jobs.items():
            assert final_state(slurm_cluster, jobid, timeout=240) == "COMPLETED", job_output(tmp_path / name, jobid)
            # The first run ended by Slurm's preemption (it requeued the job: nobody else could), not by mgpu.
            assert runs(slurm_cluster, jobid)[1:] == ["COMPLETED"], runs(slurm_cluster, jobid)
            (stop_step,) = assert_resumed_where_stopped(run_dir, stops=1)
            first = [e for e in events(run_dir) if e["restart"] == 0]
            (stop,) = [e for e in first if e["event"] == "preempted"]
            assert stop["reasons"] == ["requeue_signal"] and stop["signals"] == ["SIGUSR2"], stop
            # Rank 0 decided within the time before the kill (was: still asking when killed, nothing recorded) ...
            decisions = [e for e in first if e["event"] == "stop_decision"]
            assert decisions and decisions[0].get("by") is None and "no answer from Slurm" in decisions[0]["unknown"]
            assert decisions[0]["time"] - stop["signal_times"][0] < 5, decisions[0]  # KillWait 5 from the signal
            # ... and the batch script's recovery kept the job alive for Slurm's kill, knowing the real times.
            (waiting,) = [e for e in first if e["event"] == "awaiting_slurm"]
            assert waiting["by"] == "recovery" and f"KillWait 5 s, GraceTime {GRACE_S} s" in waiting["reason"], waiting
            assert [e for e in first if e["event"] == "requeued"] == [], first  # not ours: Slurm's
            # Slurm's SIGTERM at the grace's end ended the wait (was: waited on for the SIGKILL, orphaned when the TERM
            # ended the batch shell, and outlived the job by 30 s: the requeued job started 45 s after its end).
            (ended,) = [e for e in first if e["time"] > waiting["time"]]
            assert ended["event"] == "stop_decision" and ended["ended_by"] == "SIGTERM", ended
            assert ended["time"] - stop["signal_times"][0] < GRACE_S + 30, ended  # the grace, slurmctld's period
            assert stop_step == stop["step"]
            # rank 0's exit code reached srun as mgpu set it under submitit: 5, Slurm did not say (was: 1)
            log = (tmp_path / name / "submitit" / f"{jobid}_0_log.err").read_text()
            assert "task 0: Exited with exit code 5" in log, log[-3000:]
        calls = (tmp_path / "calls.log").read_text()
        assert "scontrol show job" in calls and "scontrol requeue" in calls, calls  # the shims did hang inside
    finally:
        cancel(slurm_cluster, *[jobid for jobid, _ in jobs.values()], *highs)
