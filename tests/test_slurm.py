"""The one Slurm client (mgpu.cluster.slurm): its retry policy, its timeout, one meaning of "alive", and the modules
that used to run their own commands asking through it. The commands are fakes: the real scontrol would act on
the shared cluster's jobs (tests/e2e runs them for real)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from mgpu.cluster.slurm import SlurmClient, SlurmError, is_alive, set_client


class FakeSlurm:
    """Answers in turn, per tool: a CompletedProcess's (rc, stdout, stderr), or an exception to raise."""

    def __init__(self, **answers: list) -> None:
        self.answers = {tool: list(replies) for tool, replies in answers.items()}
        self.calls: list[tuple[list[str], float]] = []

    def __call__(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        self.calls.append((argv, timeout))
        reply = self.answers[Path(argv[0]).name].pop(0)
        if isinstance(reply, BaseException):
            raise reply
        rc, out, err = reply
        return subprocess.CompletedProcess(argv, rc, out, err)

    def client(self, **kwargs: float) -> SlurmClient:
        return SlurmClient(run=self, which=lambda name: f"/usr/bin/{name}", retry_wait_s=0, **kwargs)


@pytest.mark.parametrize("state, alive", [
    ("RUNNING", True), ("PENDING", True), ("COMPLETING", True), ("REQUEUE_HOLD", True), ("SUSPENDED", True),
    ("COMPLETED", False), ("FAILED", False), ("CANCELLED", False), ("CANCELLED by 1000", False), ("TIMEOUT", False),
    ("PREEMPTED", False), ("NODE_FAIL", False), ("OUT_OF_MEMORY", False), (None, False),
])
def test_one_meaning_of_alive(state: str | None, alive: bool) -> None:
    # squeue lists a job that ended for MinJobAge (300 s by default): listed is not alive (rundir used to say it was).
    assert is_alive(state) is alive


@pytest.mark.parametrize("first", [
    subprocess.TimeoutExpired(["squeue"], 20),
    (-15, "", ""),                                              # killed by the step's signal at a preemption
    (1, "", "slurm_load_jobs error: Socket timed out on send/recv operation"),
    (1, "", "squeue: error: Unable to contact slurm controller (connect failure)"),
])
def test_a_transient_failure_is_tried_once_more(first: object) -> None:
    fake = FakeSlurm(squeue=[first, (0, "RUNNING\n", "")])
    slurm = fake.client()
    assert slurm.state("7") == "RUNNING"
    assert [argv[1:] for argv, _ in fake.calls] == [["-h", "-j", "7", "-o", "%T"]] * 2
    assert all(timeout == slurm.timeout_s for _, timeout in fake.calls) and slurm.calls == {"squeue": 2}


def test_a_refusal_is_not_retried_and_the_state_falls_back_on_accounting() -> None:
    fake = FakeSlurm(squeue=[(1, "", "slurm_load_jobs error: Invalid job id specified")],
                     sacct=[(0, "COMPLETED\n", "")])
    slurm = fake.client()
    assert slurm.state("7") == "COMPLETED" and slurm.calls == {"squeue": 1, "sacct": 1}
    assert [Path(argv[0]).name for argv, _ in fake.calls] == ["squeue", "sacct"]


def test_no_answer_after_the_retries() -> None:
    fake = FakeSlurm(scontrol=[subprocess.TimeoutExpired(["scontrol"], 20)] * 2)
    with pytest.raises(SlurmError, match=r"scontrol show job -o 7: no answer from Slurm within 20 s \(2 tries\)"):
        fake.client().job("7")
    assert FakeSlurm(squeue=[subprocess.TimeoutExpired(["squeue"], 20)] * 2,
                     sacct=[subprocess.TimeoutExpired(["sacct"], 20)] * 2).client().state("7") is None


def test_the_job_view() -> None:
    fake = FakeSlurm(scontrol=[(0, "JobId=7 JobState=RUNNING Reason=None Restarts=2 PreemptTime=None "
                                   "ExcNodeList=n3 NumNodes=2-2 Partition=main\n", "")])
    view = fake.client().job("7")
    assert (view.state, view.restarts, view.preempt_time, view.excluded, view.num_nodes, view.partition) == \
        ("RUNNING", 2, None, "n3", 2, "main")


def test_a_real_command_past_the_timeout_is_cut(tmp_path: Path) -> None:
    # The real runner (subprocess) against a squeue that never answers: bounded by the client's timeout.
    squeue = tmp_path / "squeue"
    squeue.write_text("#!/bin/sh\nsleep 30\n")
    squeue.chmod(0o755)
    slurm = SlurmClient(which=lambda name: str(squeue) if name == "squeue" else None, timeout_s=0.5, retry_wait_s=0)
    assert slurm.times("7") == "" and slurm.calls == {"squeue": 2}


def test_every_module_asks_through_the_one_client(tmp_path: Path) -> None:
    # rundir's claim, the deadline's clock, the status script and the recovery's node checks: one client, so one
    # timeout and retry policy, and one count of what was asked.
    from mgpu.cluster.deadline import JobClock
    from mgpu.record.exclusion import partition_nodes
    from mgpu.record.rundir import Owner, owner_alive

    fake = FakeSlurm(squeue=[(0, "COMPLETED\n", ""), (0, "2026-11-25T10:31:09 2026-11-25T11:31:09\n", ""),
                             (0, "RUNNING\n", "")],
                     scontrol=[(0, "PartitionName=main Nodes=n[1-3]\n", "")])
    old = set_client(fake.client())
    try:
        assert not owner_alive(Owner("7", "h", 1, "", True, 0.0))  # listed, but ended: not alive
        assert JobClock("7").refresh() is not None
        from jobs.status import scheduler_state

        assert scheduler_state("7") == "RUNNING"
        assert partition_nodes("main") == ["n1", "n2", "n3"]
    finally:
        set_client(old)
    assert [Path(argv[0]).name for argv, _ in fake.calls] == ["squeue", "squeue", "squeue", "scontrol"]
