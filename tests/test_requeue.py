"""The requeue decision, table-driven from what Slurm 22.05 showed inside a job (see mgpu/cluster/requeue.py),
and the requeue command itself against a fake scontrol only where the real one cannot be used."""

from __future__ import annotations

import os
import subprocess

import pytest

from mgpu.cluster.requeue import (SUBMIT_LINE_TRIES, Budget, JobView, RequeueError, classify, decide, parse_job_view,
                                  query_job, requeue, resume_command, sbatch_options)
from mgpu.cluster.slurm import SlurmClient

RUNNING = JobView("RUNNING", "None", 0, None)
CASES = [
    # (reasons, view, restarts at start) -> event
    ({"requeue_signal", "sigterm"}, JobView("COMPLETING", "None", 1, None), 0, "requeued_by_slurm"),  # GraceTime 0
    ({"sigterm"}, JobView("COMPLETING", "None", 3, None), 2, "requeued_by_slurm"),  # outside scontrol requeue
    ({"requeue_signal"}, JobView("RUNNING", "None", 0, "2026-11-23T11:53:28"), 0, "preempted"),  # grace + signal
    ({"sigterm"}, JobView("RUNNING", "None", 0, "2026-11-23T11:55:17"), 0, "preempted"),  # grace, no user signal
    ({"requeue_signal"}, RUNNING, 0, "user_signal"),  # --signal lead before the time limit / scancel --signal
    ({"sigterm"}, JobView("COMPLETING", "TimeLimit", 0, None), 0, "time_limit"),
    ({"sigterm"}, JobView("COMPLETING", "None", 0, None), 0, "cancelled"),  # scancel
    ({"sigterm"}, JobView("CANCELLED", "None", 1, None), 1, "cancelled"),
    ({"sigterm"}, RUNNING, 0, "terminated"),
    ({"test"}, RUNNING, 0, "terminated"),
    ({"interrupt"}, RUNNING, 0, "interrupted"),  # Ctrl-C on an interactive srun
    ({"interrupt", "requeue_signal"}, RUNNING, 0, "user_signal"),
    ({"drain"}, RUNNING, 0, "node_drain"),  # stopped ahead of a node's drain (mgpu.cluster.deadline): requeued
    ({"drain", "sigterm"}, JobView("COMPLETING", "None", 0, None), 0, "cancelled"),  # scancel meanwhile
]


@pytest.mark.parametrize("reasons, view, restarts, event", CASES)
def test_classify(reasons: set[str], view: JobView, restarts: int, event: str) -> None:
    assert classify(reasons, view, restarts) == event


def fake_scontrol(show: str, requeue_rc: int = 0, requeue_err: str = "") -> tuple[list[list[str]], SlurmClient]:
    """A client whose scontrol answers `show` and the requeue as given (the real one would act on a real job)."""
    calls: list[list[str]] = []

    def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        calls.append(cmd[1:])
        if cmd[1] == "show":
            return subprocess.CompletedProcess(cmd, 0, show, "")
        return subprocess.CompletedProcess(cmd, requeue_rc, "", requeue_err)

    return calls, SlurmClient(run=run, which=lambda name: name, retry_wait_s=0)


SHOW = "JobId=7 JobName=x JobState={state} Reason={reason} Restarts={restarts} PreemptTime={preempt} Requeue=1"


@pytest.mark.parametrize("show, restarts, budget, requeue_wanted, words", [
    (SHOW.format(state="RUNNING", reason="None", restarts=0, preempt="2026-11-23T11:53:28"), 0, 3, True, "preempted"),
    (SHOW.format(state="RUNNING", reason="None", restarts=3, preempt="2026-11-23T11:53:28"), 3, 3, False, "budget"),
    (SHOW.format(state="COMPLETING", reason="None", restarts=0, preempt="None"), 0, 3, False, "cancelled"),
    (SHOW.format(state="COMPLETING", reason="None", restarts=1, preempt="-"), 0, 3, False, "Slurm is requeueing"),
])
def test_decide(show: str, restarts: int, budget: int, requeue_wanted: bool, words: str) -> None:
    # Pure: a job view in, a decision out (the view is what `scontrol show job -o` said).
    decision = decide({"requeue_signal"} if "RUNNING" in show else {"sigterm"}, parse_job_view(show), restarts,
                      Budget(restarts, budget))
    assert decision.requeue is requeue_wanted and words in decision.why


def test_not_slurm_never_requeues() -> None:
    decision = decide({"sigterm"}, None, 0, Budget(0, 3))
    assert decision.event == "not_slurm" and not decision.requeue and "same command" in decision.why


def test_requeue_names_the_array_task() -> None:
    calls, slurm = fake_scontrol("")
    assert slurm.requeue("4200_7").how == "self"
    assert calls == [["requeue", "4200_7"]]


def test_requeue_already_pending_is_harmless() -> None:
    _, slurm = fake_scontrol("", 1, "scontrol: error: Job is pending execution")
    assert slurm.requeue("7").how == "slurm"


def test_a_retried_requeue_whose_first_try_took_effect_is_ours() -> None:
    # A loaded controller: the first `scontrol requeue` times out but requeues the job; the retry finds it
    # pending. That is this job's own requeue (it was recorded as Slurm's: a fault-matrix row failed on it in CI).
    tries: list[str] = []

    def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        tries.append(cmd[1])
        if len(tries) == 1:
            raise subprocess.TimeoutExpired(cmd, timeout)
        return subprocess.CompletedProcess(cmd, 1, "", "scontrol: error: Job is pending execution")

    outcome = SlurmClient(run=run, which=lambda name: name, retry_wait_s=0).requeue("7")
    assert tries == ["requeue", "requeue"]
    assert outcome.how == "self" and "first try got no answer in time but took effect" in outcome.message


def test_missing_scontrol_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setenv("MGPU_RESUME_COMMAND", "cd /r && python jobs/submit.py --nodes 2")
    monkeypatch.setattr("mgpu.cluster.slurm._client", SlurmClient(which=lambda name: None))
    with pytest.raises(RequeueError, match="scontrol not found on PATH.*; to resume: cd /r && python jobs/submit.py "
                                           "--nodes 2$"):
        requeue("7")
    with pytest.raises(RequeueError, match="scontrol not found"):
        query_job("7")


def test_parse_job_view() -> None:
    view = parse_job_view(SHOW.format(state="RUNNING", reason="None", restarts=2, preempt="None"))
    assert view == JobView("RUNNING", "None", 2, None)


@pytest.mark.parametrize("budget, spent, words", [
    (Budget(0, None), False, "requeueing, requeue 1 (no limit)"),
    (Budget(999, None), False, "requeueing, requeue 1000 (no limit)"),
    (Budget(2, 3, "failure"), False, "requeueing, failure requeue 3 of 3"),
    (Budget(3, 3, "failure"), True, "failure budget is spent (3 of 3 failure requeues used)"),
    (Budget(0, 0), True, "requeue budget is spent (0 of 0 requeues used)"),
])
def test_budget_kinds(budget: Budget, spent: bool, words: str) -> None:
    decision = decide({"requeue_signal"}, JobView("RUNNING", "None", 0, None), 0, budget)
    assert budget.spent is spent and decision.requeue is not spent and words in decision.why


# ------------------------------------------------------------------------ the command that resumes a run
@pytest.mark.parametrize("line, args, words", [
    ("sbatch --nodes=2 -p main --requeue slurm/train.sbatch c.yaml a=1", ["c.yaml", "a=1"],
     ["sbatch", "--nodes=2", "-p", "main", "--requeue", "slurm/train.sbatch"]),
    ("/usr/bin/sbatch -N 2 my.sbatch c.yaml x=a b", ["c.yaml", "x=a b"], ["sbatch", "-N", "2", "my.sbatch"]),
    ("sbatch slurm/train.sbatch c.yaml", ["c.yaml"], ["sbatch", "slurm/train.sbatch"]),
    ("sbatch --comment a b slurm/train.sbatch c.yaml", ["c.yaml"], None),  # was it "a b", or a then b?
    ("sbatch -N 2 slurm/train.sbatch c.yaml x", ["c.yaml", "y"], None),  # not the arguments this job got
    ("sbatch -N 2 slurm/train.sbatch", ["c.yaml"], None),
    ("srun -N 2 slurm/train.sbatch c.yaml", ["c.yaml"], None),
    ("", ["c.yaml"], None),
])
def test_sbatch_options_from_the_submit_line(line: str, args: list[str], words: list[str] | None) -> None:
    assert sbatch_options(line, args) == words


OPEN = ("cd /r && PYTHON=.venv/bin/python sbatch <the sbatch options of job 12> slurm/train.sbatch c.yaml "
        "run.name=it\\'s")
OWN = {"MGPU_RESUME_COMMAND": OPEN, "SLURM_JOB_ID": "12", "SLURM_TASK_PID": str(os.getpid())}


def sacct(line: str, rc: int = 0) -> tuple[list[list[str]], SlurmClient]:
    calls: list[list[str]] = []

    def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        calls.append(cmd[1:])
        return subprocess.CompletedProcess(cmd, rc, line, "sacct: error" if rc else "")

    return calls, SlurmClient(run=run, which=lambda name: f"/usr/bin/{name}", retry_wait_s=0)


@pytest.mark.parametrize("environ, line, ask, expected", [
    # The templates' placeholder, filled from accounting's SubmitLine (the arguments stay as the template quoted them).
    (OWN, "sbatch -N2 --time=1:00 slurm/train.sbatch c.yaml run.name=it's\n", True,
     "cd /r && PYTHON=.venv/bin/python sbatch -N2 --time=1:00 slurm/train.sbatch c.yaml run.name=it\\'s"),
    ({**OWN, "MGPU_RESUME_COMMAND": OPEN + " task.args.x=a\\ b"}, "sbatch -N2 slurm/train.sbatch c.yaml "
     "run.name=it's task.args.x=a b", True, "cd /r && PYTHON=.venv/bin/python sbatch -N2 slurm/train.sbatch c.yaml "
     "run.name=it\\'s task.args.x=a\\ b"),                          # an argument with a space (bash's %q: a\ b)
    (OWN, "", True, OPEN),                                          # no accounting record (yet)
    (OWN, "sbatch --comment a b slurm/train.sbatch c.yaml run.name=it's", True, OPEN),  # ambiguous: kept open
    (OWN, "sbatch -N2 slurm/train.sbatch c.yaml run.name=it's", False, OPEN),  # not asked (a rank other than 0)
    ({**OWN, "SLURM_TASK_PID": "1"}, "sbatch -N2 slurm/train.sbatch c.yaml run.name=it's", True, OPEN),  # foreign
    ({**OWN, "SLURM_JOB_ID": "13"}, "sbatch -N2 slurm/train.sbatch c.yaml run.name=it's", True, OPEN),  # another job
    ({**OWN, "MGPU_RESUME_COMMAND": "cd /r && python jobs/submit.py --nodes 2"}, "x", True,
     "cd /r && python jobs/submit.py --nodes 2"),                   # submit.py's command is exact already
    ({"SLURM_JOB_ID": "12"}, "", True, "the command that submitted job 12 (MGPU_RESUME_COMMAND is not set)"),
])
def test_resume_command(environ: dict[str, str], line: str, ask: bool, expected: str) -> None:
    calls, slurm = sacct(line)
    assert resume_command(environ, ask=ask, slurm=slurm, wait_s=0) == expected
    asked = ask and "<the sbatch options" in environ.get("MGPU_RESUME_COMMAND", "") and environ["SLURM_TASK_PID"] \
        == str(os.getpid()) and environ["SLURM_JOB_ID"] == "12"
    times = SUBMIT_LINE_TRIES if asked and not line else 1 if asked else 0  # an empty answer is asked again
    assert calls == [["-X", "-n", "-P", "-o", "SubmitLine", "-j", "12"]] * times


def test_an_empty_submit_line_is_asked_again_until_accounting_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Accounting shows a job's row with an empty SubmitLine until it records the start (seconds behind the
    # controller): a stop that asked once printed the placeholder (a template test failed on it in CI).
    answers = ["|\n", "sbatch -N2 slurm/train.sbatch c.yaml run.name=it's\n"]
    calls: list[list[str]] = []

    def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        calls.append(cmd[1:])
        return subprocess.CompletedProcess(cmd, 0, answers[min(len(calls), len(answers)) - 1].split("|")[0], "")

    slurm = SlurmClient(run=run, which=lambda name: name, retry_wait_s=0)
    assert resume_command(OWN, slurm=slurm, wait_s=0) == ("cd /r && PYTHON=.venv/bin/python sbatch -N2 "
                                                          "slurm/train.sbatch c.yaml run.name=it\\'s")
    assert len(calls) == 2
    # Within a stop's window too short for another ask, the placeholder stays: no sleep past the kill.
    calls.clear()
    with slurm.within(0.5):
        assert resume_command(OWN, slurm=slurm, wait_s=1.0) == OPEN
    assert len(calls) == 1


def test_rank_0_completes_the_command_once_the_job_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from mgpu.cluster.requeue import complete_resume_command
    from mgpu.cluster.slurm import set_client

    for name, value in OWN.items():
        monkeypatch.setenv(name, value)
    calls, slurm = sacct("sbatch -N2 slurm/train.sbatch c.yaml run.name=it's\n")
    old = set_client(slurm)
    try:
        complete_resume_command()
        assert os.environ["MGPU_RESUME_COMMAND"] == ("cd /r && PYTHON=.venv/bin/python sbatch -N2 slurm/train.sbatch "
                                                     "c.yaml run.name=it\\'s")
        assert resume_command() == os.environ["MGPU_RESUME_COMMAND"] and len(calls) == 1  # a stop asks nothing
    finally:
        set_client(old)


def test_resume_command_survives_a_failing_sacct() -> None:
    assert resume_command(OWN, slurm=sacct("", rc=1)[1]) == OPEN

    def timeout(cmd: list[str], seconds: float) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(cmd, seconds)

    assert resume_command(OWN, slurm=SlurmClient(run=timeout, which=lambda name: name, retry_wait_s=0)) == OPEN


@pytest.mark.parametrize("reasons, event, requeue_wanted", [
    ({"requeue_signal"}, "user_signal", True), ({"deadline"}, "time_limit", True), ({"drain"}, "node_drain", True),
    ({"sigterm"}, "unknown", False), ({"test"}, "unknown", False), ({"interrupt"}, "interrupted", False),
])
def test_decide_unanswered_on_the_stops_evidence(reasons: set[str], event: str, requeue_wanted: bool) -> None:
    from mgpu.cluster.requeue import decide_unanswered

    decision = decide_unanswered(reasons, Budget(0, None), "scontrol show job -o 7: no answer")
    assert (decision.event, decision.requeue) == (event, requeue_wanted)
    assert not decide_unanswered(reasons, Budget(2, 2), "x").requeue  # a spent budget still holds
