"""Smoke tests of the local Slurm test cluster itself: nodes, a 2x2 GPU job, accounting, preemption."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import pytest
from slurm_helpers import final_state, job, read_events, sacct, sbatch, wait_until

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = pytest.mark.slurm

# Logs every signal a task receives, one file per task: "<event> <SLURM_RESTART_COUNT>". Python, not
# bash traps: bash lost one of several signals arriving within a millisecond (USR2, CONT, TERM at
# GraceTime=0), while Python's handlers got every one. Each line is one os.write on an O_APPEND
# descriptor: a buffered file object is not reentrant, and a handler running inside another's write
# raised "reentrant call" and killed the logger before it logged the TERM (seen in CI). After SIGTERM
# it stays 1.5 s (the user signal may come just after the TERM), then exits instead of waiting
# KillWait for SIGKILL.
SIGNAL_LOGGER = """\
import os, signal, sys, time
fd = os.open(f"{sys.argv[1]}.{os.environ['SLURM_PROCID']}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
run = os.environ.get("SLURM_RESTART_COUNT", "0")
deadline = None
def handler(sig, frame):
    global deadline
    os.write(fd, f"{signal.Signals(sig).name[3:]} {run}\\n".encode())
    if sig == signal.SIGTERM and deadline is None:
        deadline = time.monotonic() + 1.5
for s in (signal.SIGUSR2, signal.SIGTERM, signal.SIGCONT):
    signal.signal(s, handler)
os.write(fd, f"start {run} {os.uname().nodename}\\n".encode())
while deadline is None or time.monotonic() < deadline:
    time.sleep(0.1)
"""


def test_nodes_idle_in_both_partitions(slurm_cluster: SlurmCluster) -> None:
    def states() -> set[tuple[str, str, str]]:
        out = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N|%P|%T").stdout
        return {tuple(line.replace("*", "").split("|")) for line in out.splitlines()}  # type: ignore[misc]

    want = {(n, p, "idle") for n in slurm_cluster.nodes for p in ("main", "high")}
    wait_until(f"sinfo to show {sorted(want)}", lambda: want <= states(), timeout=30)


@pytest.fixture(scope="module")
def env_job(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A 2-node x 2-task job with 2 GPUs per node; each task writes its environment to a file."""
    out = tmp_path_factory.mktemp("envjob")
    step = f"srun -o {out}/env-%t.txt bash -c 'env; echo UTS_HOSTNAME=$(hostname)'"
    jobid = sbatch(slurm_cluster, "-N2", "--ntasks-per-node=2", "--gpus-per-node=2", "-o", f"{out}/batch.out",
                   "--wrap", step)
    try:
        final_state(slurm_cluster, jobid, timeout=60)
        yield jobid, out
    finally:
        slurm_cluster.run("scancel", jobid, check=False)


def test_two_node_job_environment(slurm_cluster: SlurmCluster, env_job: tuple[str, Path]) -> None:
    _, out = env_job
    tasks = {}
    for rank in range(4):
        path = out / f"env-{rank}.txt"
        assert path.exists(), f"task {rank} wrote no environment; batch output: {(out / 'batch.out').read_text()}"
        env = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
        tasks[rank] = env
    assert [tasks[r]["SLURM_PROCID"] for r in range(4)] == ["0", "1", "2", "3"]
    assert [tasks[r]["SLURM_NODEID"] for r in range(4)] == ["0", "0", "1", "1"]
    assert [tasks[r]["SLURM_LOCALID"] for r in range(4)] == ["0", "1", "0", "1"]
    first, second = slurm_cluster.nodes
    assert [tasks[r]["SLURMD_NODENAME"] for r in range(4)] == [first, first, second, second]
    for env in tasks.values():
        assert env["SLURM_JOB_NODELIST"] == slurm_cluster.nodelist
        assert env["SLURM_NTASKS"] == "4"
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert env["SLURM_GPUS_ON_NODE"] == "2"
        # start.sh runs each slurmd in its own UTS namespace: `hostname` is the node's name.
        assert env["UTS_HOSTNAME"] == env["SLURMD_NODENAME"]


def test_sacct_reports_completed(slurm_cluster: SlurmCluster, env_job: tuple[str, Path]) -> None:
    jobid, _ = env_job
    rows = sacct(slurm_cluster, jobid)
    assert [r["State"] for r in rows] == ["COMPLETED"], rows


def _preempt(cluster: SlurmCluster, tmp_path: Path) -> tuple[str, str, Path]:
    """Run a requeueable job filling both nodes in 'main', then a job in 'high' that preempts it."""
    logger = tmp_path / "logger.py"
    logger.write_text(SIGNAL_LOGGER)
    logs = tmp_path / "sig"
    # --exclusive: all CPUs of both nodes, so the high job must preempt; --signal: the user signal.
    low = sbatch(cluster, "-p", "main", "-N2", "--exclusive", "--ntasks-per-node=1", "--requeue",
                 "--signal=USR2@60", "--open-mode=append", "-o", f"{tmp_path}/low.out",
                 "--wrap", f"srun {sys.executable} {logger} {logs}")
    wait_until(f"job {low} to start", lambda: job(cluster, low).get("JobState") == "RUNNING", timeout=30)
    wait_until("both tasks to start", lambda: all(read_events(Path(f"{logs}.{r}")) for r in (0, 1)), timeout=30)
    high = sbatch(cluster, "-p", "high", "-N1", "-n1", "-o", f"{tmp_path}/high.out", "--wrap", "sleep 3")
    return low, high, logs


def test_preemption_requeues_and_restarts(slurm_cluster: SlurmCluster, slurm_policy: Callable[..., str],
                                          tmp_path: Path) -> None:
    slurm_policy(grace=0, user_signal=True)  # the default; explicit so test order does not matter
    low = high = ""
    try:
        low, high, logs = _preempt(slurm_cluster, tmp_path)
        # Back again: Slurm requeued it, held it cred_expire+1 s, and restarted it once 'high' was done.
        wait_until(f"job {low} to run again", lambda: job(slurm_cluster, low).get("Restarts") == "1"
                   and job(slurm_cluster, low).get("JobState") == "RUNNING", timeout=120)
        assert final_state(slurm_cluster, high, timeout=30) == "COMPLETED"
        runs = sacct(slurm_cluster, low, "-D")
        assert [r["State"] for r in runs][0] in ("PREEMPTED", "REQUEUED"), runs
        assert runs[-1]["State"] == "RUNNING", runs
        assert runs[-1]["Start"] >= sacct(slurm_cluster, high)[0]["End"], "restarted before the high job ended"
        for rank in (0, 1):
            events = wait_until("the restarted task to log", lambda: ("start", "1") in read_events(
                Path(f"{logs}.{rank}")), timeout=30) and read_events(Path(f"{logs}.{rank}"))
            first_run = {e for e, run in events if run == "0"}
            # GraceTime=0 + preempt_send_user_signal: USR2 and TERM at once.
            assert {"start", "USR2", "TERM"} <= first_run, events
    finally:
        for j in (low, high):
            if j:
                slurm_cluster.run("scancel", j, check=False)


def test_policy_switch_takes_effect(slurm_cluster: SlurmCluster, slurm_policy: Callable[..., str],
                                    tmp_path: Path) -> None:
    out = slurm_policy(grace=0, user_signal=False)
    assert "GraceTime=0" in out and "preempt_send_user_signal: no" in out, out
    config = slurm_cluster.run("scontrol", "show", "config").stdout
    assert "preempt_send_user_signal" not in config
    low = high = ""
    try:
        low, high, logs = _preempt(slurm_cluster, tmp_path)
        for rank in (0, 1):
            path = Path(f"{logs}.{rank}")
            wait_until("the preempted task to get SIGTERM", lambda: ("TERM", "0") in read_events(path), timeout=30)
        time.sleep(1)  # a USR2 would have come in the same millisecond as the TERM
        for rank in (0, 1):
            events = read_events(Path(f"{logs}.{rank}"))
            assert ("USR2", "0") not in events, f"user signal sent although switched off: {events}"
    finally:
        for j in (low, high):
            if j:
                slurm_cluster.run("scancel", j, check=False)
    restored = slurm_cluster.policy(grace=7, user_signal=True)  # and back on, with a grace period
    assert "GraceTime=7" in restored and "preempt_send_user_signal: yes" in restored, restored
    assert "GraceTime=7" in slurm_cluster.run("scontrol", "show", "partition", "main").stdout
