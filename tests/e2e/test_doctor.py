"""jobs/doctor.py on the real test cluster: its report matches each preemption policy policy.sh can set
(GraceTime 0 or > 0, with or without the user signal), the environment probe finds what start.sh set up
(scontrol in jobs, a shared run root, resolvable nodes, a working self-requeue), and every probe job is
cancelled, Ctrl-C and SIGTERM included. Bad input submits nothing.

The full doctor runs once (the default policy); the other policies run its preemption probe only.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pytest
from slurm_helpers import wait_until

from tests.conftest import PYTHON, ROOT, base_env

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = pytest.mark.slurm

DOCTOR = str(ROOT / "jobs" / "doctor.py")
GRACE_S = 5


def _doctor_jobs(cluster: SlurmCluster, pid: int | None = None) -> list[str]:
    """Probe jobs still queued or running (of the doctor with `pid`, or of any)."""
    out = cluster.run("squeue", "-h", "-o", "%i %j %T").stdout
    suffix = f"-{pid}" if pid is not None else ""
    return [line for line in out.splitlines() if line.split()[1].startswith("mgpu-doctor-")
            and line.split()[1].endswith(suffix) and line.split()[2] != "COMPLETING"]


def _doctor(args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run the doctor to its end; its result and pid (every probe job it submits is named ...-<pid>)."""
    cmd = [PYTHON, DOCTOR, *args]
    with subprocess.Popen(cmd, cwd=ROOT, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), proc.pid


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], int]:
    facts = tmp_path / "facts.json"
    result, pid = _doctor(["--partition", "main", "--run-root", str(tmp_path / "runs"), "--json", str(facts), *args],
                          timeout=900)
    assert result.returncode == 0, f"{' '.join(result.args)}\n{result.stdout}{result.stderr}"
    return result, json.loads(facts.read_text()), pid


def _no_leftovers(cluster: SlurmCluster, tmp_path: Path, pid: int) -> None:
    wait_until("the probe jobs to be gone", lambda: not _doctor_jobs(cluster, pid), timeout=60)
    assert not (tmp_path / "runs" / ".mgpu-doctor").exists()


def _since(started: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started - 1))


def _sacct_states(cluster: SlurmCluster, since: str, pid: int) -> list[str]:
    """State of each probe job of the doctor with `pid` that sacct recorded since `since`; only this doctor's:
    the cluster's history has every earlier test's (and user's) probe jobs too."""
    rows = cluster.run("sacct", "-n", "-X", "-P", "-S", since, "-o", "JobName,State").stdout.splitlines()
    return [row.split("|")[1] for row in rows if row.startswith("mgpu-doctor-") and row.split("|")[0].endswith(f"-{pid}")]


def _ended(states: list[str]) -> list[str]:
    """`states` when there are some and none is still pending or running; else [] (wait_until's falsy)."""
    return states if states and not any(s in ("PENDING", "RUNNING", "COMPLETING") for s in states) else []


def test_doctor_full_report_default_policy(slurm_cluster: SlurmCluster, slurm_policy: Callable[..., str],
                                           tmp_path: Path) -> None:
    slurm_policy(grace=0, user_signal=True)
    result, facts, pid = _run(tmp_path, "--preemptor-partition", "high")
    out = result.stdout
    pre, env = facts["preemption"], facts["env"]
    assert facts["configured"]["grace_s"] == 0 and facts["configured"]["user_signal"] is True
    # GraceTime 0 with preempt_send_user_signal: USR2 with SIGTERM, no time before it; Slurm requeues.
    assert pre["observed"] and pre["user_signal"] == "with_term" and pre["requeued"], pre
    assert pre["kill_after_term_s"] is not None, pre  # the probe outlived SIGTERM: it saw when SIGKILL came
    assert "the user signal (USR2) comes with SIGTERM, no earlier" in out
    # The environment start.sh built: scontrol in jobs, one filesystem, the node names in /etc/hosts.
    assert env["tasks"] == 2 and sorted(env["nodes"]) == list(slurm_cluster.nodes)
    assert all(env["scontrol"].values()), env
    assert env["shared_error"] is None and env["shared_delay_s"] is not None
    assert env["unresolved"] == [] and env["rendezvous"] is None
    assert env["signal_lead_s"] is not None and env["signal_lead_s"] > 0 and env["signal_tasks"] == 2, env
    assert env["requeue_rc"] == 0 and env["requeue_hold_s"] is not None, env
    settings = facts["settings"]
    assert any(s.startswith("signal lead: --signal-lead 120") for s in settings), settings
    assert any(s.startswith("self-requeue: yes") for s in settings), settings
    assert any(s.startswith("preemption: GraceTime 0") for s in settings), settings
    # The one risk of this policy: only KillWait to save at a preemption.
    assert [r.split(":")[0] for r in facts["risks"]] == [f"a preemption leaves {pre['kill_after_term_s']:.0f} s from "
                                                         "SIGTERM to SIGKILL"], facts["risks"]
    assert out.splitlines()[-1].startswith("  - a preemption leaves")
    _no_leftovers(slurm_cluster, tmp_path, pid)


@pytest.mark.parametrize("grace, user_signal", [(0, False), (GRACE_S, True), (GRACE_S, False)])
def test_doctor_preemption_matches_the_policy(slurm_cluster: SlurmCluster, slurm_policy: Callable[..., str],
                                              tmp_path: Path, grace: int, user_signal: bool) -> None:
    slurm_policy(grace=grace, user_signal=user_signal)
    result, facts, pid = _run(tmp_path, "--preemptor-partition", "high", "--only", "preemption")
    pre = facts["preemption"]
    assert facts["configured"]["grace_s"] == grace and facts["configured"]["user_signal"] is user_signal
    assert facts["env"] is None and pre["observed"] and pre["requeued"], pre
    assert pre["kill_after_term_s"] is not None, pre
    settings = facts["settings"]
    # What each policy means for the job, as the doctor says it (no timings asserted: a loaded machine
    # stretches them; the classification is what the policy decides).
    if grace == 0:
        assert pre["user_signal"] == "none", pre
        assert any(s.startswith("preemption: GraceTime 0: mgpu stops on SIGTERM") for s in settings), settings
        assert any(r.startswith("a preemption leaves") for r in facts["risks"])
    elif user_signal:
        # USR2 first; SIGTERM only when the grace is over.
        assert pre["user_signal"] == "before_term", pre
        assert any(s.startswith("preemption: mgpu stops on USR2 and requeues itself") for s in settings), settings
        assert "the user signal (USR2) comes" in result.stdout and "before SIGTERM" in result.stdout
    else:
        # SIGTERM at once, and again when the grace is over.
        assert pre["user_signal"] == "none" and [s for s, _ in pre["signals"]].count("SIGTERM") >= 2, pre
        assert any(s.startswith("preemption: mgpu stops on the first SIGTERM") for s in settings), settings
        assert "no user signal: SIGTERM first, SIGTERM again" in result.stdout
    _no_leftovers(slurm_cluster, tmp_path, pid)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_doctor_interrupted_cancels_its_jobs(slurm_cluster: SlurmCluster, tmp_path: Path, sig: int) -> None:
    """Started as from a background shell (`doctor.py &` in a script, some CI runners): SIGINT ignored on entry,
    which Python keeps. The doctor takes SIGINT itself, as mgpu's training does: a SIGINT still cancels."""
    cmd = [PYTHON, DOCTOR, "--partition", "main", "--preemptor-partition", "high", "--run-root", str(tmp_path / "runs")]
    since = _since(time.time())
    proc = subprocess.Popen(cmd, cwd=ROOT, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ignore_sigint)
    try:
        wait_until("a probe job", lambda: _doctor_jobs(slurm_cluster, proc.pid), timeout=60)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert err.splitlines()[-1].startswith("doctor: interrupted; probe jobs cancelled: "), err
    wait_until("its probe jobs to be gone", lambda: not _doctor_jobs(slurm_cluster, proc.pid), timeout=30)
    assert not (tmp_path / "runs" / ".mgpu-doctor").exists()
    # Gone because the doctor cancelled them (not because their files went with the probe directory).
    # scancel returns before slurmdbd has the jobs' end (sacct may still say RUNNING for a moment): wait for an end.
    states = wait_until("sacct to record their end", lambda: _ended(_sacct_states(slurm_cluster, since, proc.pid)),
                        timeout=30)
    # Interrupted mid preemption probe, the probe job's record is PREEMPTED: the doctor's own preemptor ended
    # that run. Anything else (COMPLETED, FAILED, NODE_FAIL) would mean a job ended by itself, not by the doctor.
    assert all(state.startswith("CANCELLED") or state == "PREEMPTED" for state in states), states
    assert any(state.startswith("CANCELLED") for state in states), states


def test_doctor_bad_partition_submits_nothing(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    since = _since(time.time())
    result, pid = _doctor(["--partition", "nosuch", "--run-root", str(tmp_path / "runs")], timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == ["doctor: error: --partition 'nosuch': Partition nosuch not found (sinfo -s "
                                          "lists the partitions)"]
    assert not (tmp_path / "runs").exists()
    # Only this doctor's jobs (named ...-<pid>): other tests' probe jobs run and finish in the same window.
    assert _sacct_states(slurm_cluster, since, pid) == []
    assert _doctor_jobs(slurm_cluster, pid) == []
