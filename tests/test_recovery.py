"""Whose Slurm job is this, the requeue limits, and the batch script's decision after a failed step.

Pure tables (a fake /proc, plain dicts, a real ledger in a temp directory); the requeue itself runs
against the real cluster in tests/e2e."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mgpu.errors import MgpuError
from mgpu.record.ledger import Ledger, read_ledger
from mgpu.record.budgets import DEFAULT_MAX_FAILURES, Limits, failure_requeues, stop_requeues
from mgpu.run.recovery import handle_failure
from mgpu.record.rundir import RunDir
from mgpu.cluster.slurm_job import ancestors, owns_slurm_job

# pid -> (parent, command): slurmstepd 100 started task 200 (python), whose child 300 is a torchrun worker;
# a login shell 10 started 20 (python), and a container whose slurmstepd is invisible: 7 -> 8.
PROC = {1: (0, "init"), 100: (1, "slurmstepd"), 200: (100, "python"), 300: (200, "python"),
        10: (1, "bash"), 20: (10, "python"), 7: (1, "conmon"), 8: (7, "python")}


def read(pid: int) -> tuple[int, str] | None:
    return PROC.get(pid)


@pytest.mark.parametrize("environ, pid, owned", [
    ({"SLURM_JOB_ID": "5", "SLURM_TASK_PID": "200"}, 200, True),   # the srun task itself
    ({"SLURM_JOB_ID": "5", "SLURM_TASK_PID": "200"}, 300, True),   # torchrun's worker, a child of the task
    ({"SLURM_JOB_ID": "5"}, 300, True),                            # no SLURM_TASK_PID, but under slurmstepd
    ({"SLURM_JOB_ID": "5", "SLURM_TASK_PID": "200"}, 20, False),   # the variables copied into a login shell
    ({"SLURM_JOB_ID": "5"}, 20, False),
    ({"SLURM_JOB_ID": "5", "SLURM_TASK_PID": "8"}, 8, True),       # a PID namespace: the task pid is ours
    ({"SLURM_JOB_ID": "5", "SLURM_TASK_PID": "9999"}, 8, False),   # ... or not
    ({"SLURM_TASK_PID": "200"}, 200, False),                       # no job at all
    ({"SLURM_JOB_ID": "", "SLURM_TASK_PID": "200"}, 200, False),
    ({"SLURM_JOB_ID": "5", "SLURM_TASK_PID": "x"}, 300, True),     # garbage pid: the slurmstepd ancestor decides
    ({"SLURM_JOB_ID": "5", "SLURM_TASK_PID": "1"}, 20, False),     # init is everybody's ancestor
])
def test_owns_slurm_job(environ: dict[str, str], pid: int, owned: bool) -> None:
    assert owns_slurm_job(environ, pid, read) is owned


def test_ancestors_are_bounded_on_a_cycle() -> None:
    cycle = {5: (6, "a"), 6: (5, "b")}
    assert len(ancestors(5, cycle.get, limit=10)) == 10


@pytest.mark.parametrize("environ, limits", [
    ({}, Limits(None, DEFAULT_MAX_FAILURES)),
    ({"MGPU_MAX_REQUEUES": "0"}, Limits(0, 3)),
    ({"MGPU_MAX_REQUEUES": "250", "MGPU_MAX_FAILURES": "0"}, Limits(250, 0)),
    ({"MGPU_MAX_REQUEUES": "unlimited", "MGPU_MAX_FAILURES": ""}, Limits(None, 3)),
    ({"MGPU_MAX_REQUEUES": " 7 "}, Limits(7, 3)),
])
def test_limits(environ: dict[str, str], limits: Limits) -> None:
    assert Limits.from_environ(environ) == limits


@pytest.mark.parametrize("environ", [{"MGPU_MAX_REQUEUES": "-1"}, {"MGPU_MAX_FAILURES": "3.5"},
                                     {"MGPU_MAX_REQUEUES": "ten"}])
def test_bad_limits_are_one_line(environ: dict[str, str]) -> None:
    with pytest.raises(MgpuError, match=f"{next(iter(environ))}=.*integer >= 0"):
        Limits.from_environ(environ)


def test_failure_requeues_count_only_this_jobs_failures() -> None:
    events = [{"event": "requeued", "job_id": "7", "after": "failure"},
              {"event": "requeued", "job_id": "7"},                       # a preemption's self-requeue
              {"event": "requeued", "job_id": "7", "after": "no_progress"},
              {"event": "requeued", "job_id": "8", "after": "failure"},   # an earlier job of the same run
              {"event": "restarted", "job_id": "7", "after": "hang"},     # a hang nobody was blamed for
              {"event": "requeued", "job_id": "7", "after": "hang"},      # a hang pinned on a node
              {"event": "failed", "job_id": "7"}]
    assert failure_requeues(events, "7") == 4  # a hang that keeps coming back ends within MGPU_MAX_FAILURES
    assert failure_requeues(events, "9") == 0


# Job 7 at SLURM_RESTART_COUNT 4: requeued once after a failure, restarted in place twice (no new restart
# count), so 3 of its 4 restarts were stops (preemptions, time limits).
MIXED = [{"event": "requeued", "job_id": "7", "after": "failure"},
         {"event": "restarted", "job_id": "7", "after": "failure"},
         {"event": "restarted", "job_id": "7", "after": "hang"},
         {"event": "requeued", "job_id": "7", "how": "self"},
         {"event": "requeued", "job_id": "8", "after": "failure"}]


def test_stop_requeues_subtract_only_the_failures_that_requeued() -> None:
    assert failure_requeues(MIXED, "7") == 3  # all three count against MGPU_MAX_FAILURES
    assert stop_requeues(MIXED, "7", 4) == 3  # but only one of them raised the restart count
    assert stop_requeues(MIXED, "7", 0) == 0 and stop_requeues([], None, 2) == 2


@pytest.mark.multiprocess
def test_in_place_restarts_do_not_buy_extra_stop_requeues(tmp_path: Path) -> None:
    """A job at restart 4 with MGPU_MAX_REQUEUES=2 whose ledger shows one failure requeue and two in-place
    restarts has made 3 stop requeues: over its budget, it must not train (it did: 4 - 3 = 1 was counted)."""
    import subprocess

    from tests.conftest import PYTHON, ROOT
    from tests.test_protocol import TRAIN, slurm_env

    env = slurm_env(tmp_path, SLURM_RESTART_COUNT="4", MGPU_MAX_REQUEUES="2")
    ledger = Ledger(tmp_path / "events.jsonl", env["SLURM_JOB_ID"], 0)
    for event in MIXED[:4]:
        ledger.write(event["event"], **{k: v for k, v in event.items() if k not in ("event", "job_id")})
    result = subprocess.run([PYTHON, TRAIN, f"run.dir={tmp_path}", "task.target=tests.tasks:BlobTask"], env=env,
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]
    assert "requeue budget exhausted: this is restart 3 of at most 2" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "checkpoints").exists()  # did not train


def ledger_events(run: RunDir) -> list[dict]:
    return [json.loads(line) for line in run.ledger.read_text().splitlines()]


def test_a_stop_the_ranks_decided_is_left_alone(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    Ledger(run.ledger, "7", 2).write("stop_decision", what="cancelled", requeue=False, reason="cancelled")
    action, outcome = handle_failure(run, "7", 2, Limits(), "the training step exited with code 1")
    assert action == "none" and outcome.startswith("nothing to do: the run recorded stop_decision"), outcome
    assert [e["event"] for e in ledger_events(run)] == ["stop_decision"]  # nothing asked of Slurm, nothing added


def test_a_deterministic_failure_is_not_requeued(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    Ledger(run.ledger, "7", 0).write("failed", error="CheckpointWriteError: disk full", retry=False)
    assert "nothing to do: the run recorded failed" in handle_failure(run, "7", 0, Limits(), "exit 1")[1]
    assert handle_failure(run, "7", 0, Limits(), "exit 1") == ("none", "another process handles this failure")


def test_only_one_caller_handles_a_failure(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    Ledger(run.ledger, "7", 0).write("stop_decision", what="cancelled", requeue=False)
    first = handle_failure(run, "7", 0, Limits(), "rank 1 failed", rank=1)
    second = handle_failure(run, "7", 0, Limits(), "exit 1")
    assert first[1].startswith("nothing to do") and second == ("none", "another process handles this failure")
    assert run.failure_claim("7", 0).read_text() == "rank 1 failed\n"


def test_an_attempt_restarted_in_place_is_a_new_attempt(tmp_path: Path) -> None:
    # Run 0's first attempt stopped cleanly and decided; then the step was restarted in the allocation: the
    # second attempt's failure is its own (its own claim, the first attempt's decision does not count).
    run = RunDir(tmp_path)
    ledger = Ledger(run.ledger, "7", 0)
    ledger.write("stop_decision", what="terminated", requeue=True, action="restart")
    ledger.write("restarted", after="failure")
    ledger.write("failed", error="the second attempt's bug", retry=False)
    action, outcome = handle_failure(run, "7", 0, Limits(), "exit 1")
    assert (action, outcome) == ("none", "nothing to do: the run recorded failed (the second attempt's bug)")
    assert run.failure_claim("7", 0).with_name(".failure-7-0-1").exists()


# ------------------------------------------------------------- a job that stays down says how to resume
RESUME = "cd /r && python jobs/submit.py --nodes 2 --config c.yaml"


@pytest.fixture
def running_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm's view of job 7: running, no restart (what `scontrol show job` would say); the resume command;
    no requeue."""
    from mgpu.cluster.requeue import JobView

    monkeypatch.setattr("mgpu.run.recovery.query_job", lambda job_id: JobView("RUNNING", "None", 0, None, num_nodes=2,
                                                                          partition="main"))
    monkeypatch.setenv("MGPU_RESUME_COMMAND", RESUME)
    # Never the real cluster's job 7: a requeue here is a test failure (pytest's Failed is no Exception).
    monkeypatch.setattr("mgpu.run.recovery.requeue", lambda job_id: pytest.fail(f"job {job_id} requeued"))


def test_a_spent_failure_budget_prints_the_command_that_resumes(tmp_path: Path, running_job: None) -> None:
    run = RunDir(tmp_path)
    Ledger(run.ledger, "7", 0).write("restarted", after="failure")
    action, outcome = handle_failure(run, "7", 0, Limits(max_failures=1), "exit 1", may_restart=True)
    assert action == "none"
    assert outcome == ("terminated, but the failure budget is spent (1 of 1 failure requeues used); the job stays "
                       f"down; fix what failed, then resume with: {RESUME}")
    (decision,) = [e for e in ledger_events(run) if e["event"] == "stop_decision"]
    assert decision["reason"] == f"after a failure: {outcome}"  # what jobs/status.py shows


def test_a_node_that_cannot_be_excluded_prints_the_command_that_resumes(tmp_path: Path, running_job: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # A batch script that cannot start the step again (no --may-restart): the job stays down, saying why.
    monkeypatch.setattr("mgpu.run.recovery.partition_nodes", lambda partition: ["n1", "n2"])
    monkeypatch.setattr("mgpu.run.recovery.unavailable_nodes", lambda nodes: set())
    run = RunDir(tmp_path)
    Ledger(run.ledger, "7", 0).write("hang", ranks=[1], hosts=["n2"])
    action, outcome = handle_failure(run, "7", 0, Limits(), "exit 4", may_restart=False)
    assert action == "none" and outcome.startswith("after a hang: excluding n2 would leave 1 of the 2 nodes"), outcome
    assert outcome.endswith(f"the job stays down: check n2 (scontrol show node n2), then resume with: {RESUME}")


def test_a_hang_on_a_node_that_cannot_be_excluded_restarts_in_place_until_the_budget_is_spent(
        tmp_path: Path, running_job: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen on the test cluster: a SIGSTOPped rank blamed on its node, correctly; excluding the node would leave
    # the 2-node job one node, so the job stayed down although the allocation was intact. Now: restarts in place,
    # each counted against --max-failures (2 here), then it stays down naming the node.
    monkeypatch.setattr("mgpu.run.recovery.partition_nodes", lambda partition: ["n1", "n2"])
    monkeypatch.setattr("mgpu.run.recovery.unavailable_nodes", lambda nodes: set())
    run = RunDir(tmp_path)
    actions = []
    for attempt in range(3):
        Ledger(run.ledger, "7", 0).write("hang", ranks=[1], hosts=["n2"])
        actions.append(handle_failure(run, "7", 0, Limits(max_failures=2), "exit 4", may_restart=True))
    assert [action for action, _ in actions] == ["restart", "restart", "none"], actions
    events = ledger_events(run)
    assert [e["after"] for e in events if e["event"] == "restarted"] == ["hang", "hang"]
    first = [e for e in events if e["event"] == "stop_decision"][0]
    assert "excluding n2 would leave 1 of the 2 nodes" in first["reason"] and "restarting in place instead (failure " \
        "requeue 1 of 2)" in first["reason"], first
    assert actions[2][1].startswith("terminated, but the failure budget is spent (2 of 2 failure requeues used); the "
                                    "hangs were pinned on n2: check it (scontrol show node n2)"), actions[2][1]
    assert actions[2][1].endswith(f"resume with: {RESUME}")


@pytest.mark.parametrize("view, action", [
    (("RUNNING", "None", 0, None), "restart"),                        # a crash: start the step again here
    (("RUNNING", "None", 0, "2026-11-25T08:51:18"), "requeued"),      # preempted (GraceTime > 0): the allocation ends
    (("RUNNING", "TimeLimit", 0, None), "requeued"),                  # the time limit is reached
])
def test_a_step_that_fails_while_the_allocation_ends_is_requeued_not_restarted(
        view: tuple, action: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen in the fault matrix: the preemption's USR2 reached a rank before its handler (exit 140); the step
    # was started again in the allocation being preempted, and Slurm requeued the job at the grace's end.
    from mgpu.cluster.requeue import JobView, RequeueOutcome

    requeued: list[str] = []
    monkeypatch.setattr("mgpu.run.recovery.query_job", lambda job_id: JobView(*view))
    monkeypatch.setattr("mgpu.run.recovery.requeue", lambda job_id: requeued.append(job_id) or RequeueOutcome("self", "ok"))
    run = RunDir(tmp_path)
    got, outcome = handle_failure(run, "7", 0, Limits(), "the training step exited with code 140", may_restart=True)
    assert got == action, outcome
    assert requeued == ([] if action == "restart" else ["7"])
    assert [e.get("after") for e in ledger_events(run) if e["event"] in ("restarted", "requeued")] == ["failure"]


def test_recovery_after_bad_input_prints_the_command_that_resumes(tmp_path: Path) -> None:
    import os
    import subprocess

    from tests.conftest import PYTHON, ROOT, base_env

    env = base_env(SLURM_JOB_ID="7", SLURM_TASK_PID=str(os.getpid()), MGPU_RESUME_COMMAND=RESUME)
    result = subprocess.run([PYTHON, "-m", "mgpu.run.recovery", "--exit-code", "2", "--run-dir", str(tmp_path)], env=env,
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("mgpu.run.recovery: the step exited 2 (bad input or a full disk, see its one-line error): not "
                             f"requeued; fix it, then resume with: {RESUME}\n")


@pytest.mark.parametrize("bad, already, partition, needed, nodes, words", [
    ("n2", [], ["n1", "n2", "n3"], 2, ("n2",), "excluding n2 (now excluded: n2)"),
    ("n2", ["n9"], ["n1", "n2", "n3"], 1, ("n2", "n9"), "now excluded: n2, n9"),  # merged with the user's
    ("n2", [], ["n1", "n2"], 2, None, "would leave 1 of the 2 nodes the job needs in its partition (n1)"),
    ("n2", ["n1"], ["n1", "n2", "n3"], 2, None, "would leave 1 of the 2 nodes"),
    ("n2", ["n2"], ["n1", "n2", "n3"], 1, None, "n2 was already excluded"),
    ("n2", [], [], 4, ("n2",), "excluding n2"),  # partition unknown: trust Slurm to hold it if it cannot run
])
def test_plan_exclusion(bad: str, already: list[str], partition: list[str], needed: int,
                        nodes: tuple[str, ...] | None, words: str) -> None:
    from mgpu.record.exclusion import plan_exclusion

    plan = plan_exclusion(bad, already, partition, needed)
    assert plan.nodes == nodes and words in plan.why


def test_nodes_down_or_drained_are_not_usable() -> None:
    # n1, n2, n3 in the partition, n3 drained: excluding n2 leaves one node for a 2-node job (it was counted as 2).
    from mgpu.record.exclusion import plan_exclusion

    plan = plan_exclusion("n2", [], ["n1", "n2", "n3"], 2, {"n3"})
    assert plan.nodes is None
    assert plan.why == ("excluding n2 would leave 1 of the 2 nodes the job needs in its partition "
                        "(n1; down or drained: n3)")
    assert plan_exclusion("n2", [], ["n1", "n2", "n3", "n4"], 2, {"n3"}).nodes == ("n2",)


def test_unavailable_nodes_from_their_state(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    from mgpu.record.exclusion import unavailable_nodes
    from mgpu.cluster.slurm import SlurmClient

    states = {"n1": "IDLE", "n2": "ALLOCATED", "n3": "DOWN*", "n4": "IDLE+DRAIN", "n5": "MIXED+DRAIN", "n6": "FUTURE",
              "n7": "IDLE+POWERED_DOWN", "n8": "IDLE*", "n9": "DOWN+NOT_RESPONDING", "n10": "MIXED+COMPLETING"}
    calls: list[list[str]] = []

    def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        calls.append(cmd[1:])
        return subprocess.CompletedProcess(cmd, 0, "".join(f"NodeName={n} Arch=x86_64 State={s} Partitions=main\n"
                                                           for n, s in states.items()), "")

    slurm = SlurmClient(run=run, which=lambda name: name)
    assert unavailable_nodes(list(states), slurm) == {"n3", "n4", "n5", "n6", "n8", "n9"}
    assert calls == [["show", "node", "-o", ",".join(states)]]
    assert unavailable_nodes([], slurm) == set() and len(calls) == 1
    failing = lambda cmd, timeout: subprocess.CompletedProcess(cmd, 1, "", "scontrol: error")  # noqa: E731
    assert unavailable_nodes(["n1"], SlurmClient(run=failing, which=lambda name: name)) == set()  # unknown: usable


def test_a_hang_on_a_node_whose_partition_is_half_drained_keeps_the_job_down(
        tmp_path: Path, running_job: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mgpu.run.recovery.partition_nodes", lambda partition: ["n1", "n2", "n3"])
    monkeypatch.setattr("mgpu.run.recovery.unavailable_nodes", lambda nodes: {"n3"})
    run = RunDir(tmp_path)
    Ledger(run.ledger, "7", 0).write("hang", ranks=[1], hosts=["n2"])
    action, outcome = handle_failure(run, "7", 0, Limits(), "exit 4", may_restart=False)
    assert action == "none", outcome  # excluding n2 would have left the job pending on the drained n3
    assert "would leave 1 of the 2 nodes the job needs in its partition (n1; down or drained: n3)" in outcome


def test_the_run_directory_a_session_announced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # slurm/loop.sbatch: a loop of one's own names its run directory itself; its session writes it to a file.
    import argparse

    from mgpu.run.recovery import _run_dir

    announced = tmp_path / "run-dir-7"
    args = argparse.Namespace(run_dir=None, run_dir_file=str(announced), config=None, overrides=[])
    assert _run_dir(args) is None  # the session never started: nothing to requeue
    announced.write_text(str(tmp_path / "runs" / "mine") + "\n")
    assert _run_dir(args) == RunDir(tmp_path / "runs" / "mine")


@pytest.mark.multiprocess
def test_the_ledger_records_the_failing_ranks_own_error(tmp_path: Path) -> None:
    # Rank 1's loss raises its own error; rank 0 only sees gloo's `Connection closed by peer`. Before, the ledger
    # had rank 0's consequence alone; now rank 1's cause, and rank 0's error marked as a consequence.
    from mgpu.run.recovery import peer_consequence
    from tests.test_faults import finish_step, start_step

    results = finish_step(start_step(tmp_path, 2, "task.target=tests.tasks:CrashingBlobTask", "train.epochs=2",
                                     "data.batch_size=4", "log.tensorboard=false"), timeout=150)
    assert [rc for rc, _ in results] == [1, 1]
    from mgpu.record.runview import RunView

    # Rank 1's record is a file of its own (mgpu.record.failures); the ledger has rank 0's; status reads both.
    failed = [e for e in RunView.load(tmp_path).events if e["event"] == "failed"]
    own = [e for e in failed if not e.get("consequence")]
    assert [(e["rank"], e["error"]) for e in own] == [(1, "ValueError: rank 1's own bug at loss call 3")], failed
    assert all(e["rank"] == 0 for e in failed if e.get("consequence")), failed
    assert not peer_consequence(ValueError("rank 1's own bug")) and peer_consequence(RuntimeError(
        "[pair.cc:553] Connection closed by peer [127.0.0.1]:38817"))


# ------------------------------------------------------------- Slurm gives no answer after a failed step
@pytest.mark.parametrize("hang_on, limits, may_restart, action", [
    (None, Limits(), True, "restart"),            # a crash: the allocation is here, the budget in the ledger
    ("n2", Limits(), True, "restart"),            # a hang on n2: no exclusion without Slurm, a restart in place
    (None, Limits(max_failures=0), True, "none"),  # the budget is spent: stays down, saying how to resume
    (None, Limits(), False, "none"),              # a script that cannot start the step again: nothing needs no Slurm
])
def test_a_failed_step_restarts_in_place_when_slurm_does_not_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hang_on: str | None, limits: Limits, may_restart: bool,
        action: str) -> None:
    # Was: `scontrol show job` without an answer raised out of the decision, and the job stayed down ("could not
    # requeue after the failure"), although a restart in place asks Slurm nothing.
    from mgpu.cluster.slurm import SlurmUnanswered

    def unanswered(job_id: str) -> None:
        raise SlurmUnanswered("scontrol show job -o 7: no answer from Slurm within 20 s (2 tries)")

    monkeypatch.setattr("mgpu.run.recovery.query_job", unanswered)
    monkeypatch.setattr("mgpu.run.recovery.requeue", lambda job_id: pytest.fail(f"job {job_id} requeued"))
    monkeypatch.setenv("MGPU_RESUME_COMMAND", RESUME)
    run = RunDir(tmp_path)
    if hang_on:
        Ledger(run.ledger, "7", 0).write("hang", ranks=[1], hosts=[hang_on])
    got, outcome = handle_failure(run, "7", 0, limits, "the training step exited with code 1", may_restart=may_restart)
    assert got == action, outcome
    (decision,) = [e for e in ledger_events(run) if e["event"] == "stop_decision"]
    assert "scontrol show job -o 7: no answer" in decision["unknown"] and decision["action"] == action
    restarted = [e["after"] for e in ledger_events(run) if e["event"] == "restarted"]
    if action == "restart":
        assert restarted == ["hang" if hang_on else "failure"]
        assert "a restart in place needs nothing from Slurm" in outcome
        assert ("pinned on n2" in outcome) is bool(hang_on)
    else:
        assert restarted == [] and outcome.endswith(f"resume with: {RESUME}"), outcome


@pytest.mark.parametrize("attempt, code", [
    ([], None),                                                                    # nothing decided: srun's code
    ([{"event": "stop_decision", "what": "cancelled", "requeue": False}], 3),      # stays down
    ([{"event": "stop_decision", "what": "preempted", "requeue": True}, {"event": "requeued"}], 0),
    ([{"event": "stop_decision", "what": "requeued_by_slurm", "requeue": False}], 0),
    ([{"event": "stop_decision", "what": "unknown", "requeue": False, "unknown": "x"}], 5),
    ([{"event": "stop_decision", "requeue": True}, {"event": "requeue_unknown"}], 5),
    ([{"event": "stop_decision", "requeue": True}, {"event": "requeue_unknown"}, {"event": "awaiting_slurm"}], 5),
    ([{"event": "stop_decision", "requeue": True}, {"event": "requeue_refused"}], 3),
    ([{"event": "failed", "retry": False}], 2),                                     # bad input, a full disk
    ([{"event": "failed", "retry": True}], None),                                   # a crash: its own code
    ([{"event": "stop_decision", "requeue": True, "error": "exit 1"}, {"event": "requeued", "after": "failure"}], None),
    ([{"event": "stop_decision", "requeue": False, "error": "exit 1"}], None),       # a failure that stays down
    ([{"event": "stop_decision", "requeue": True}, {"event": "requeued", "after": "no_progress"}], 0),
])
def test_the_exit_code_mgpu_set_is_read_back_from_the_ledger(attempt: list[dict], code: int | None) -> None:
    from mgpu.run.outcome import recorded_exit_code

    assert recorded_exit_code(attempt) == code


def run_recovery(tmp_path: Path, exit_code: int, **environ: str) -> "subprocess.CompletedProcess[str]":
    import os
    import subprocess

    from tests.conftest import PYTHON, ROOT, base_env

    env = base_env(SLURM_JOB_ID="7", SLURM_TASK_PID=str(os.getpid()), MGPU_RESUME_COMMAND=RESUME, **environ)
    return subprocess.run([PYTHON, "-m", "mgpu.run.recovery", "--exit-code", str(exit_code), "--run-dir", str(tmp_path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_a_launchers_exit_1_reaches_slurm_as_the_code_mgpu_set(tmp_path: Path) -> None:
    # torchrun (and submitit before TrainJob exited with it) report rank 0's exit 3 or 5 as their own failure, 1;
    # the batch script ends with what recovery returns: mgpu's code, read back from the ledger.
    Ledger(RunDir(tmp_path).ledger, "7", 0).write("stop_decision", what="cancelled", requeue=False, reason="cancelled")
    result = run_recovery(tmp_path, 1)
    assert result.returncode == 3, result.stderr


def test_a_non_integer_restart_count_is_one_line_in_recovery(tmp_path: Path) -> None:
    result = run_recovery(tmp_path, 1, SLURM_RESTART_COUNT="two")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr == "mgpu.run.recovery: error: SLURM_RESTART_COUNT='two' is not an integer: unset it\n"
