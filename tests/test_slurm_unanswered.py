"""Slurm's answers slow, wrong or absent at every point a job asks (start, stop decision, requeue, the batch
script's recovery, status): real stub executables on PATH (a hanging, a failing and a Latin-1-printing
`scontrol`/`squeue`/`sacct`; the real ones would act on the shared cluster's jobs) behind the real client.

What must hold: every call at a stop ends within the time left before the kill (MGPU_KILL_WAIT_S here, a few
seconds), bytes that are not UTF-8 are read, and "no answer" is never bad input (exit 2, not requeued): the
stop requeues on its evidence where it can, else exits UNANSWERED_EXIT_CODE with the ledger saying what was
unknown, and mgpu.run.recovery asks again."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from mgpu.state.single.store import CheckpointStore
from mgpu.cluster.environment import ProcessEnv
from mgpu.record.ledger import Ledger, read_ledger
from mgpu.run.outcome import UNANSWERED_EXIT_CODE, StopBudgets, decide_after_stop, exit_code
from mgpu.record.budgets import Limits
from mgpu.run.recovery import main as recovery_main
from mgpu.cluster.requeue import Budget
from mgpu.record.rundir import RunDir
from mgpu.cluster.kill_time import stop_window_s
from mgpu.cluster.requeue import JobView
from mgpu.cluster.slurm import RequeueOutcome, SlurmClient, SlurmUnanswered, set_client
from tests.conftest import PYTHON, ROOT

LATIN1_SHOW = (b"JobId=7 JobName=caf\xe9 UserId=ren\xe9(1000) JobState=RUNNING Reason=None Restarts=0 "
               b"PreemptTime=2026-11-23T11:53:28 WorkDir=/home/ren\xe9/runs NumNodes=1 Partition=main\n")
TRANSIENT = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)"


def script(kind: str, log: Path, answer: bytes = b"") -> str:
    """A stub that logs its arguments, then: hangs, fails as an unreachable controller does, or answers."""
    head = f'#!/bin/sh\necho "$(basename "$0") $*" >> {shlex.quote(str(log))}\n'
    if kind == "hang":
        return head + "exec sleep 60\n"
    if kind == "fail":
        return head + f"echo {shlex.quote(TRANSIENT)} >&2\nexit 1\n"
    octal = "".join(f"\\{byte:03o}" for byte in answer)
    return head + f"printf '{octal}'\nexit 0\n"


def stub_bin(tmp_path: Path, **tools: str | tuple[str, bytes]) -> Path:
    """A directory of stub Slurm commands; each value a kind ("hang", "fail") or ("answer", bytes); for
    scontrol a dict-like "show|requeue" split: `scontrol_show`, `scontrol_requeue`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "slurm-calls.log"
    scontrol = {verb: tools.pop(f"scontrol_{verb}", ("answer", b"")) for verb in ("show", "requeue")}
    for name, spec in tools.items():
        kind, answer = (spec, b"") if isinstance(spec, str) else spec
        (bin_dir / name).write_text(script(kind, log, answer))
    parts = ['#!/bin/sh\ncase "$1" in']
    for verb, spec in scontrol.items():
        kind, answer = (spec, b"") if isinstance(spec, str) else spec
        (bin_dir / f"scontrol-{verb}").write_text(script(kind, log, answer))
        parts.append(f'  {verb}) exec {shlex.quote(str(bin_dir / f"scontrol-{verb}"))} "$@";;')
    parts.append('esac\nexit 0\n')
    (bin_dir / "scontrol").write_text("\n".join(parts))
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    return bin_dir


def calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "slurm-calls.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def real_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process's client as a job has it (the real runner, shutil.which on PATH), a short KillWait."""
    monkeypatch.setenv("MGPU_KILL_WAIT_S", "3")
    old = set_client(SlurmClient())
    try:
        yield
    finally:
        set_client(old)


def env(rank: int = 0) -> ProcessEnv:
    return ProcessEnv("srun", rank, 0, 1, 1, 0, 1, ("n1",), "7", 0, "n1", 29500)


def stop(tmp_path: Path, reasons: set[str], signals: list[tuple[str, float]]):  # type: ignore[no-untyped-def]
    ledger = Ledger(tmp_path / "events.jsonl", "7", 0)
    budgets = StopBudgets("7", Budget(0, None), 0, Limits())
    started = time.monotonic()
    outcome = decide_after_stop(reasons, 5, 0, "ckpt", budgets, env(), ledger, signals=signals)
    return outcome, time.monotonic() - started, read_ledger(tmp_path / "events.jsonl")


# ------------------------------------------------------------------------------------------ rank 0's decision
@pytest.mark.parametrize("show, reasons, kind, requeued", [
    # A SIGTERM alone may be a scancel: without Slurm's view nothing is decided (was: exit 2, not requeued).
    ("hang", {"sigterm"}, "unknown", False),
    ("fail", {"sigterm"}, "unknown", False),
    # The user signal says the job was not cancelled: it requeues itself on that evidence.
    ("hang", {"requeue_signal"}, "requeued", True),
    ("fail", {"requeue_signal"}, "requeued", True),
    # Latin-1 bytes in the job's name and directory are read (was: UnicodeDecodeError): preempted, requeued.
    (("answer", LATIN1_SHOW), {"sigterm"}, "requeued", True),
])
def test_a_stop_that_slurm_does_not_answer_is_decided_within_the_kill_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, real_client: None, show: object, reasons: set[str],
        kind: str, requeued: bool) -> None:
    monkeypatch.setenv("PATH", f"{stub_bin(tmp_path, scontrol_show=show)}:/usr/bin:/bin")  # type: ignore[arg-type]
    outcome, seconds, events = stop(tmp_path, reasons, [("SIGTERM", time.time())] if "sigterm" in reasons else [])
    assert outcome.kind == kind, outcome
    (decision,) = [e for e in events if e["event"] == "stop_decision"]
    assert decision["requeue"] is requeued
    assert ("requeue 7" in " ".join(calls(tmp_path))) is requeued
    if show != ("answer", LATIN1_SHOW):
        assert "scontrol show job -o 7: no answer from Slurm" in decision["unknown"], decision
    if kind == "unknown":
        assert exit_code(outcome) == UNANSWERED_EXIT_CODE != 2
        assert "Slurm gave no answer" in outcome.message and "checkpoint ckpt" in outcome.message
    assert seconds < 3 + 5  # KillWait 3 s (not 84 s: 2 tries x 20 s, twice); slack for a loaded machine


def test_a_requeue_slurm_does_not_answer_is_unknown_not_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  real_client: None) -> None:
    path = stub_bin(tmp_path, scontrol_show=("answer", LATIN1_SHOW), scontrol_requeue="hang")
    monkeypatch.setenv("PATH", f"{path}:/usr/bin:/bin")
    outcome, seconds, events = stop(tmp_path, {"sigterm"}, [("SIGTERM", time.time())])
    assert outcome.kind == "unknown" and "the requeue got no answer" in outcome.message
    assert [e["event"] for e in events] == ["stop_decision", "requeue_unknown"]
    assert seconds < 3 + 5


def test_a_missing_scontrol_is_unknown_not_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     real_client: None) -> None:
    # A container without Slurm's commands: the batch script outside it asks again (Lightning #21404).
    monkeypatch.setenv("PATH", str(tmp_path))
    outcome, _, events = stop(tmp_path, {"sigterm"}, [])
    assert outcome.kind == "unknown" and "scontrol not found on PATH" in events[0]["unknown"]


@pytest.mark.parametrize("signals, environ, expected", [
    ([], {}, 30 - 3),                                     # no signal (a deadline, a test stop): KillWait from now
    ([("SIGTERM", 990.0)], {"MGPU_KILL_WAIT_S": "30"}, 20 - 3),  # 10 s of it spent on the save
    ([("SIGUSR2", 900.0), ("SIGTERM", 995.0)], {"MGPU_KILL_WAIT_S": "5"}, 1),  # past: the floor
    ([("SIGTERM", 900.0)], {"MGPU_KILL_WAIT_S": "30"}, 1),  # the kill is due: one short try still
    ([], {"MGPU_KILL_WAIT_S": "x"}, 30 - 3),              # unreadable: the default
    ([], {"MGPU_KILL_WAIT_S": "nan"}, 30 - 3),
    # The user signal alone: a SIGTERM may follow at once as far as the job knows, so KillWait counts from the
    # signal, not from now (was: from now, 2 s later than the kill could come here); GraceTime does not lengthen it.
    ([("SIGUSR2", 998.0)], {"MGPU_KILL_WAIT_S": "5", "MGPU_GRACE_S": "10"}, 5 - 2 - 1),
    # The measured case without MGPU_KILL_WAIT_S: the cluster's KillWait 5, as jobs/submit.py exports it.
    ([("SIGUSR2", 999.0)], {"MGPU_KILL_WAIT_S": "5"}, 5 - 1 - 1),
])
def test_the_stop_window(signals: list[tuple[str, float]], environ: dict[str, str], expected: float) -> None:
    assert stop_window_s(signals, now=1000.0, environ=environ) == pytest.approx(expected)


@pytest.mark.parametrize("signals, environ, until", [
    ([], {"MGPU_GRACE_S": "10"}, None),                                      # no signal: no kill on its way
    ([("SIGINT", 1000.0)], {}, None),                                        # Ctrl-C: nobody kills the job
    ([("SIGUSR2", 1000.0)], {"MGPU_GRACE_S": "10", "MGPU_KILL_WAIT_S": "5"}, 1000 + 10 + 30 + 5),
    ([("SIGTERM", 1000.0), ("SIGTERM", 1016.0)], {"MGPU_GRACE_S": "10"}, 1000 + 10 + 30 + 30),
    ([("SIGUSR2", 1000.0)], {}, 1000 + 300 + 30 + 30),                       # the grace not known: 300 s
    ([("SIGUSR2", 1000.0)], {"MGPU_GRACE_S": "-1", "MGPU_KILL_WAIT_S": "0"}, 1000 + 300 + 30 + 30),  # unreadable
    ([("SIGUSR2", 1000.0)], {"MGPU_GRACE_S": "0"}, 1000 + 0 + 30 + 30),
])
def test_how_long_a_job_waits_for_slurms_kill(signals: list[tuple[str, float]], environ: dict[str, str],
                                              until: float | None) -> None:
    from mgpu.cluster.kill_time import KillTimes

    assert KillTimes.from_environ(environ).wait_until(signals) == until


CONFIG = "Configuration data as of 2026-11-29T10:00:00\nJobAcctGatherType       = jobacct_gather/none\n" \
         "KillOnBadExit           = 0\nKillWait                = 5 sec\nLaunchParameters        = (null)\n"
PARTITIONS = ("PartitionName=main AllowGroups=ALL Default=YES GraceTime=10 Hidden=NO MaxTime=UNLIMITED\n"
              "PartitionName=high AllowGroups=ALL Default=NO GraceTime=0 Hidden=NO PreemptMode=OFF\n")


@pytest.mark.parametrize("partition, environ, exports", [
    (None, {}, {"MGPU_KILL_WAIT_S": "5", "MGPU_GRACE_S": "10"}),     # the default partition's GraceTime
    ("high", {}, {"MGPU_KILL_WAIT_S": "5", "MGPU_GRACE_S": "0"}),
    ("nowhere", {}, {"MGPU_KILL_WAIT_S": "5"}),
    (None, {"MGPU_KILL_WAIT_S": "7"}, {"MGPU_GRACE_S": "10"}),       # the user's own value is kept: not asked
])
def test_the_clusters_kill_times_are_read_for_the_job(partition: str | None, environ: dict[str, str],
                                                      exports: dict[str, str]) -> None:
    from mgpu.cluster.kill_time import cluster_exports

    asked: list[list[str]] = []

    def run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        asked.append(argv[1:])
        out = CONFIG if argv[1:3] == ["show", "config"] else PARTITIONS
        return subprocess.CompletedProcess(argv, 0, out, "")

    old = set_client(SlurmClient(run=run, which=lambda tool: f"/usr/bin/{tool}"))
    try:
        assert cluster_exports(partition, environ) == exports
    finally:
        set_client(old)
    assert (["show", "config"] in asked) is ("MGPU_KILL_WAIT_S" not in environ)


def test_a_slurm_that_does_not_answer_leaves_the_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          real_client: None) -> None:
    from mgpu.cluster.kill_time import cluster_exports

    monkeypatch.setenv("PATH", f"{stub_bin(tmp_path, scontrol_show='hang')}:/usr/bin:/bin")
    started = time.monotonic()
    assert cluster_exports(None, {}, within_s=1.5) == {}
    assert time.monotonic() - started < 1.5 + 3


# ------------------------------------------------------------------------------------------ the batch script
def open_stop(run: Path, *, unknown: bool = True, signalled_s_ago: float = 0.0) -> None:
    ledger = Ledger(run / "events.jsonl", "7", 0)
    ledger.write("preempted", step=5, reasons=["sigterm"], signals=["SIGTERM"],
                 signal_times=[time.time() - signalled_s_ago])
    ledger.write("stop_decision", step=5, what="unknown", requeue=False, reason="Slurm gave no answer",
                 progressed=True, **({"unknown": "scontrol show job -o 7: no answer"} if unknown else {}))


@pytest.fixture
def own_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_TASK_PID", str(os.getpid()))
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("MGPU_RESUME_COMMAND", raising=False)
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)  # recovery ignores SIGTERM (scontrol requeue signals it)


@pytest.mark.parametrize("show, requeued", [(("answer", LATIN1_SHOW), True), ("hang", False)])
def test_recovery_asks_again_after_a_stop_slurm_did_not_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, real_client: None, own_job: None,
        capsys: pytest.CaptureFixture[str], show: object, requeued: bool) -> None:
    monkeypatch.setenv("PATH", f"{stub_bin(tmp_path, scontrol_show=show)}:/usr/bin:/bin")  # type: ignore[arg-type]
    run = tmp_path / "run"
    run.mkdir()
    # The SIGTERM came long ago: past the time a preempted job waits for Slurm's kill (that wait: the tables of
    # tests/test_unanswered_wait.py), so Slurm is asked once more and the step's end is final.
    open_stop(run, signalled_s_ago=3600)
    started = time.monotonic()
    code = recovery_main(["--exit-code", str(UNANSWERED_EXIT_CODE), "--run-dir", str(run)])
    assert code == (0 if requeued else UNANSWERED_EXIT_CODE)  # the code mgpu set: requeued, or still unknown
    assert time.monotonic() - started < 3 + 5
    events = read_ledger(run / "events.jsonl")
    again = events[2]
    assert (again["event"], again["by"], again["requeue"]) == ("stop_decision", "recovery", requeued)
    assert [e["event"] for e in events[3:]] == (["requeued"] if requeued else ["stop_decision"])
    assert ("requeue 7" in " ".join(calls(tmp_path))) is requeued
    assert "asked again after the step" in capsys.readouterr().err


def test_recovery_names_rank_0s_lost_requeue_as_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         real_client: None, own_job: None) -> None:
    # Rank 0's requeue got no answer in time but took effect: the recovery's asks again and finds the job
    # pending. The requeue is the job's own ("self"), not Slurm's (what a GraceTime-0 preemption would be).
    bin_dir = stub_bin(tmp_path, scontrol_show=("answer", LATIN1_SHOW))
    (bin_dir / "scontrol-requeue").write_text("#!/bin/sh\necho 'scontrol: error: Job is pending execution' >&2\n"
                                              "exit 1\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    run = tmp_path / "run"
    run.mkdir()
    open_stop(run, unknown=False)
    Ledger(run / "events.jsonl", "7", 0).write("requeue_unknown", step=5, error="scontrol requeue 7: no answer")
    recovery_main(["--exit-code", str(UNANSWERED_EXIT_CODE), "--run-dir", str(run)])
    (requeued,) = [e for e in read_ledger(run / "events.jsonl") if e["event"] == "requeued"]
    assert requeued["how"] == "self" and "rank 0's earlier try" in requeued["message"], requeued


def test_recovery_leaves_a_decided_stop_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, real_client: None,
                                              own_job: None) -> None:
    monkeypatch.setenv("PATH", f"{stub_bin(tmp_path, scontrol_show=('answer', LATIN1_SHOW))}:/usr/bin:/bin")
    run = tmp_path / "run"
    run.mkdir()
    open_stop(run, unknown=False)  # Slurm answered rank 0: its decision stands
    recovery_main(["--exit-code", "3", "--run-dir", str(run)])
    assert calls(tmp_path) == [] and len(read_ledger(run / "events.jsonl")) == 2


# ------------------------------------------------------------------------------------------ the wait for Slurm's kill
PREEMPTED = JobView("RUNNING", "None", 0, "2026-11-29T10:00:00")
REQUEUED_BY_SLURM = JobView("COMPLETING", "None", 1, None)
HANG = "hang"


def settle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reasons: list[str], signals: list[tuple[str, float]],
           views: list[object], requeues: list[object], limits: Limits = Limits(), grace: float | None = 10.0):
    """mgpu.run.unanswered.settle_stop on a stop rank 0 left open, Slurm's answers scripted per ask (a JobView,
    HANG, or for the requeue "ok"/"refused"), on a clock that only the waits move: (settled, asks' times and
    windows, the requeues' times, the ledger's events after rank 0's)."""
    from mgpu.cluster.kill_time import KillTimes
    from mgpu.cluster.slurm import SlurmError, SlurmUnanswered, client
    from mgpu.run.unanswered import open_stop, settle_stop

    clock = [1000.0]
    asks: list[tuple[float, float]] = []
    tried: list[float] = []

    def query(job_id: str) -> JobView:
        asks.append((clock[0], round(client().seconds_left() or 0.0)))
        view = views[min(len(asks), len(views)) - 1]
        if view == HANG:
            raise SlurmUnanswered("scontrol show job -o 7: no answer from Slurm within 1 s (1 try)")
        if view == "refused":
            raise SlurmError("scontrol show job 7 failed: slurm_load_jobs error: Invalid job id specified")
        return view  # type: ignore[return-value]

    def requeue(job_id: str) -> RequeueOutcome:
        tried.append(clock[0])
        answer = requeues[min(len(tried), len(requeues)) - 1]
        if answer == HANG:
            raise SlurmUnanswered("scontrol requeue 7: no answer from Slurm within 1 s (1 try)")
        if answer == "refused":
            raise SlurmError("scontrol requeue 7 failed: Requeue of job disabled")
        return RequeueOutcome("self", "requeued job 7")

    monkeypatch.setattr("mgpu.run.unanswered.query_job", query)
    monkeypatch.setattr("mgpu.run.unanswered.requeue", requeue)
    monkeypatch.setenv("MGPU_RESUME_COMMAND", "cd /r && python jobs/submit.py")
    run = RunDir(tmp_path / "run")
    ledger = Ledger(run.ledger, "7", 0)
    ledger.write("preempted", step=5, reasons=reasons, signals=[n for n, _ in signals],
                 signal_times=[t for _, t in signals])
    ledger.write("stop_decision", step=5, what="unknown", requeue=False, reason="Slurm gave no answer",
                 progressed=True, unknown="scontrol show job -o 7: no answer")
    events = read_ledger(run.ledger)
    settled = settle_stop(run, "7", 0, limits, events, events, open_stop(events) or {}, times=KillTimes(5.0, grace),
                          now=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s))
    return settled, asks, tried, read_ledger(run.ledger)[2:]


WAITS = {
    # The measured case (GraceTime 10, the user signal, KillWait 5, Slurm hanging): the job ended FAILED
    # 9.5 s after the signal, before the preemption's SIGTERM at 16 s, and never came back. Now it stays alive,
    # asking every 10 s, until Slurm's kill (not simulated here: the wait's end, 10 + 30 + 5 s after the signal).
    "user signal, no answer ever": (["requeue_signal"], [("SIGUSR2", 999.0)], [HANG], [HANG], Limits(), "unknown",
                                    [1000, 1010, 1020, 1030, 1040, 1044], [1000, 1010, 1020, 1030, 1040, 1044],
                                    ["stop_decision", "requeue_unknown", "awaiting_slurm", "stop_decision"]),
    # Slurm comes back during the wait: the job is preempted, requeued then (by the job itself).
    "user signal, answered after 20 s": (["requeue_signal"], [("SIGUSR2", 999.0)], [HANG, HANG, PREEMPTED],
                                         [HANG, HANG, "ok"], Limits(), "requeued", [1000, 1010, 1020],
                                         [1000, 1010, 1020],
                                         ["stop_decision", "requeue_unknown", "awaiting_slurm", "stop_decision",
                                          "requeued"]),
    # ... or it says it requeued the job itself (GraceTime 0, or the grace ended): nothing to do.
    "SIGTERM alone, Slurm requeued it": (["sigterm"], [("SIGTERM", 999.0)], [HANG, REQUEUED_BY_SLURM], [], Limits(),
                                         "requeued", [1000, 1010], [],
                                         ["stop_decision", "awaiting_slurm", "stop_decision"]),
    "requeue refused during the wait": (["requeue_signal"], [("SIGUSR2", 999.0)], [HANG, PREEMPTED], [HANG, "refused"],
                                        Limits(), "stays_down", [1000, 1010], [1000, 1010],
                                        ["stop_decision", "requeue_unknown", "awaiting_slurm", "stop_decision",
                                         "requeue_refused"]),
    "answered at once": (["requeue_signal"], [("SIGUSR2", 999.0)], [PREEMPTED], ["ok"], Limits(), "requeued", [1000],
                         [1000], ["stop_decision", "requeued"]),
    # No signal, so no kill on its way: waiting would only hold the allocation. One ask, then the exit says what to do.
    "the job's own deadline": (["deadline"], [], [HANG], [HANG], Limits(), "unknown", [1000], [1000],
                               ["stop_decision", "requeue_unknown"]),
    "a test stop": (["test"], [], [HANG], [], Limits(), "unknown", [1000], [], ["stop_decision"]),
    "Ctrl-C": (["interrupt"], [("SIGINT", 999.0)], [HANG], [], Limits(), "stays_down", [1000], [], ["stop_decision"]),
    # Slurm answered, with a refusal (it does not know the job): no kill of its own is worth waiting for.
    "SIGTERM alone, Slurm refuses": (["sigterm"], [("SIGTERM", 999.0)], ["refused"], [], Limits(), "unknown", [1000], [],
                                     ["stop_decision"]),
    # The requeue budget is spent: the job was to stay down anyway.
    "user signal, budget spent": (["requeue_signal"], [("SIGUSR2", 999.0)], [HANG], [], Limits(max_requeues=0),
                                  "stays_down", [1000], [], ["stop_decision"]),
}


@pytest.mark.parametrize("case", list(WAITS))
def test_a_stop_slurm_left_open_waits_for_slurms_kill_only_after_its_signal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    reasons, signals, views, requeues, limits, kind, asked, tried, written = WAITS[case]
    settled, asks, requeue_times, events = settle(tmp_path, monkeypatch, reasons, signals, views, requeues, limits)
    assert settled.kind == kind, settled
    assert [when for when, _ in asks] == asked and requeue_times == tried
    assert [e["event"] for e in events] == written
    assert all(e.get("by") == "recovery" for e in events)
    if "awaiting_slurm" in written:
        (waiting,) = [e for e in events if e["event"] == "awaiting_slurm"]
        assert waiting["until"] == 999 + 10 + 30 + 5 and "KillWait 5 s, GraceTime 10 s" in waiting["reason"]
        # the first ask within the time before the earliest kill (the signal + KillWait, less the exit's reserve);
        # once waiting, KillWait each (none outlasts Slurm's SIGTERM by more)
        assert [window for _, window in asks][:3] == [3, 5, 5][:len(asks)]
    if kind == "unknown":
        assert settled.message.endswith("resume with: cd /r && python jobs/submit.py"), settled.message
    if case == "user signal, answered after 20 s":
        assert "Slurm answered after 20 s of waiting: preempted: requeueing" in events[3]["reason"], events[3]


def test_slurms_sigterm_ends_the_wait_and_the_handlers_are_given_back(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The preemption's SIGTERM at the grace's end (or a scancel's): Slurm has decided, the wait is over. Waiting on
    # for the SIGKILL, the recovery, orphaned when the TERM ended the batch shell, outlived the job on the test
    # cluster (it wrote its give-up 46 s after the signal, the job ended at 15 s). A user signal changes nothing.
    from mgpu.cluster.kill_time import KillTimes
    from mgpu.run.unanswered import open_stop, settle_stop

    received: list[int] = []
    before = {signum: signal.signal(signum, lambda signum, frame: received.append(signum))
              for signum in (signal.SIGTERM, signal.SIGUSR2)}
    try:
        import threading

        def query(job_id: str) -> JobView:
            # Slurm's signals come while the job waits (the first ask is already inside the wait's handlers)
            threading.Timer(0.3, lambda: (os.kill(os.getpid(), signal.SIGUSR2),
                                          os.kill(os.getpid(), signal.SIGTERM))).start()
            raise SlurmUnanswered("scontrol show job -o 7: no answer")

        monkeypatch.setattr("mgpu.run.unanswered.query_job", query)
        run = RunDir(tmp_path / "run")
        Ledger(run.ledger, "7", 0).write("preempted", step=5, reasons=["sigterm"], signals=["SIGTERM"],
                                         signal_times=[time.time()])
        Ledger(run.ledger, "7", 0).write("stop_decision", step=5, what="unknown", requeue=False, unknown="x")
        events = read_ledger(run.ledger)
        started = time.monotonic()
        settled = settle_stop(run, "7", 0, Limits(), events, events, open_stop(events) or {}, times=KillTimes(5.0, 10.0))
        assert time.monotonic() - started < 3  # not the wait's 45 s: the TERM ended it (the real sleep, sliced)
        assert settled.kind == "unknown" and "Slurm ended it (SIGTERM after" in settled.message, settled
        assert received == []  # neither reached the handlers the process had: the wait's own took them
        last = read_ledger(run.ledger)[-1]
        assert (last["event"], last["ended_by"], last["by"]) == ("stop_decision", "SIGTERM", "recovery"), last
        for signum in (signal.SIGUSR2, signal.SIGTERM):
            os.kill(os.getpid(), signum)
        assert received == [signal.SIGUSR2, signal.SIGTERM]  # given back
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


# ------------------------------------------------------------------------------------------ start and stop, real
@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["hang", "latin1"])
def test_a_job_whose_slurm_hangs_or_prints_latin1_still_ends_as_it_should(tmp_path: Path, kind: str) -> None:
    # One rank of jobs/train.py as a Slurm task of this test (SLURM_TASK_PID), every Slurm command a stub: at the
    # start (the job clock's squeue), at the stop (scontrol show job), the requeue, the resume command's sacct.
    from tests.test_protocol import TRAIN, slurm_env

    latin1 = ("answer", LATIN1_SHOW)
    times = ("answer", b"2026-11-25T10:31:09 caf\xe9\n")
    path = stub_bin(tmp_path, squeue="hang" if kind == "hang" else times, sacct="hang" if kind == "hang" else latin1,
                    scontrol_show="hang" if kind == "hang" else latin1)
    run = tmp_path / "run"
    environ = slurm_env(tmp_path, PATH=f"{path}:{Path(PYTHON).parent}:/usr/bin:/bin", MGPU_KILL_WAIT_S="3",
                        MGPU_RECOVERY="batch")
    result = subprocess.run([PYTHON, TRAIN, f"run.dir={run}", "task.target=tests.tasks:BlobTask", "data.batch_size=8",
                             "--stop-at-step=2"], env=environ, cwd=ROOT, capture_output=True, text=True, timeout=60)
    where = result.stdout[-2000:] + result.stderr[-3000:]
    assert CheckpointStore(run / "checkpoints").latest().step == 2, where  # type: ignore[union-attr]
    (decision,) = [e for e in read_ledger(run / "events.jsonl") if e["event"] == "stop_decision"]
    if kind == "hang":  # a test stop is a SIGTERM's kind of evidence: unknown, asked again by the batch script
        assert result.returncode == UNANSWERED_EXIT_CODE, where
        assert decision["what"] == "unknown" and "no answer from Slurm within" in decision["unknown"]
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith("train: stopped at step 2: Slurm gave no answer") and \
            lines[-1].endswith("the batch script's mgpu.run.recovery asks Slurm again after srun"), where
    else:
        assert result.returncode == 0, where
        assert (decision["what"], decision["requeue"]) == ("preempted", True)
        assert any(line.endswith(f"requeue {environ['SLURM_JOB_ID']}") for line in calls(tmp_path)), calls(tmp_path)
    assert "Traceback" not in result.stderr, where


@pytest.mark.multiprocess
def test_rank_0_without_a_batch_script_stays_alive_until_slurm_answers(tmp_path: Path) -> None:
    # jobs/train.py as the one task of an srun step with no recovery after it (MGPU_RECOVERY unset): the user signal,
    # then Slurm hangs. Rank 0 saves, its session ends, and it waits, asking again, until Slurm answers (here, once
    # the test sees the wait in the ledger): preempted, so it requeues the job then, and exits 0. Before, it exited
    # 5 at once with "nothing asks Slurm again", and a preempted job with a grace never came back.
    from tests.test_protocol import TRAIN, slurm_env

    answer = tmp_path / "slurm-answers"
    wait = f"while [ ! -e {shlex.quote(str(answer))} ]; do sleep 0.1; done\n"
    bin_dir = stub_bin(tmp_path, squeue="hang", sacct="hang")
    show = LATIN1_SHOW.decode("latin-1").replace("JobId=7", "JobId=$SLURM_JOB_ID").encode("latin-1")
    (bin_dir / "scontrol-show").write_text(script("answer", tmp_path / "slurm-calls.log", show).replace(
        "printf", wait + "printf", 1))
    (bin_dir / "scontrol-requeue").write_text(script("answer", tmp_path / "slurm-calls.log").replace(
        "printf", wait + "printf", 1))
    run = tmp_path / "run"
    environ = slurm_env(tmp_path, PATH=f"{bin_dir}:{Path(PYTHON).parent}:/usr/bin:/bin", MGPU_KILL_WAIT_S="2",
                        MGPU_GRACE_S="10")
    environ.pop("MGPU_RECOVERY", None)
    proc = subprocess.Popen([PYTHON, TRAIN, f"run.dir={run}", "task.target=tests.tasks:SignalingBlobTask",
                             "task.args.signals=USR2", "task.args.at=3", "task.args.step_s=0.05", "data.batch_size=8"],
                            env=environ, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # the task signals its whole process group
    try:
        deadline = time.monotonic() + 120
        while not any(e["event"] == "awaiting_slurm" for e in read_ledger(run / "events.jsonl")
                      if (run / "events.jsonl").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)
            time.sleep(0.2)
        answer.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    events = read_ledger(run / "events.jsonl")
    names = [e["event"] for e in events]
    assert proc.returncode == 0, err[-3000:]
    assert names[-5:] == ["stop_decision", "requeue_unknown", "awaiting_slurm", "stop_decision", "requeued"], names
    waited, answered = events[-3], events[-2]
    assert waited["by"] == answered["by"] == "rank 0" and waited["until"] > events[-4]["time"]
    assert answered["reason"].startswith("Slurm answered after") and answered["what"] == "preempted", answered
    assert "the job stays alive, idle, until Slurm answers or ends it" in err and "Traceback" not in err, err[-3000:]
    (stop,) = [e for e in events if e["event"] == "preempted"]
    assert CheckpointStore(run / "checkpoints").latest().step == stop["step"]  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------ status
@pytest.mark.parametrize("kind", ["hang", "latin1"])
def test_status_bounds_its_waits_and_says_what_it_could_not_ask(tmp_path: Path, kind: str) -> None:
    latin1 = ("answer", b"RUNNING caf\xe9\xff\n")
    path = stub_bin(tmp_path, squeue="hang" if kind == "hang" else latin1,
                    sacct="hang" if kind == "hang" else ("answer", b"7|caf\xe9|\xff\xfe|RUNNING\n"),
                    scontrol_show="hang" if kind == "hang" else latin1)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    Ledger(run / "events.jsonl", "4242", 0).write("started", world_size=1, launcher="srun")
    environ = {**os.environ, "PATH": f"{path}:/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([PYTHON, str(ROOT / "jobs" / "status.py"), str(run)], env=environ, capture_output=True,
                            text=True, timeout=60)
    where = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in where, where
    assert result.stdout.startswith(f"run         {run}\n"), where
    if kind == "hang":
        notes = result.stderr.strip().splitlines()
        assert notes and all(n.startswith("status: note: ") and "no answer from Slurm" in n for n in notes), where
        assert any("squeue -h -j 4242" in n for n in notes), where


@pytest.mark.parametrize("after, state", [
    ([("stop_decision", {"requeue": False, "unknown": "x", "reason": "Slurm gave no answer (x)"})],
     "stopped, Slurm gave no answer: Slurm gave no answer (x)"),
    ([("stop_decision", {"requeue": True}), ("requeue_unknown", {"error": "scontrol requeue 7: hung"})],
     "stopped, the requeue got no answer: scontrol requeue 7: hung"),
    ([("stop_decision", {"requeue": True}), ("requeue_refused", {"error": "disabled"})],
     "stopped, the requeue was refused: disabled"),
    # recovery asked again and requeued: rank 0's open decision is superseded
    ([("stop_decision", {"requeue": False, "unknown": "x"}), ("stop_decision", {"requeue": True, "by": "recovery"}),
      ("requeued", {})], "stopped by a signal (requeue pending)"),
    ([("stop_decision", {"requeue": True}), ("requeue_unknown", {"error": "e"}),
      ("stop_decision", {"requeue": True, "by": "recovery"}), ("requeued", {})], "stopped by a signal (requeue pending)"),
    # the job waits, alive, for Slurm (mgpu.run.unanswered); then Slurm answers, or the wait ends
    ([("stop_decision", {"requeue": True}), ("requeue_unknown", {"error": "e"}),
      ("stop_decision", {"requeue": True, "by": "recovery", "unknown": "x"}), ("requeue_unknown", {"error": "e"}),
      ("awaiting_slurm", {"until": 1e12, "unknown": "scontrol requeue 7: hung"})],
     f"stopped, waiting for Slurm to answer or end the job (until {time.strftime('%H:%M:%S', time.localtime(1e12))}): "
     "scontrol requeue 7: hung"),
    ([("stop_decision", {"requeue": True, "by": "recovery", "unknown": "x"}), ("awaiting_slurm", {"until": "never"}),
      ("stop_decision", {"requeue": True, "by": "recovery"}), ("requeued", {})], "stopped by a signal (requeue pending)"),
    ([("awaiting_slurm", {"until": 1e300, "unknown": "x"})],
     "stopped, waiting for Slurm to answer or end the job (until ?): x"),
])
def test_status_says_what_slurm_left_open(after: list[tuple[str, dict]], state: str) -> None:
    from mgpu.record.runview import summarize

    events = [{"time": 1.0, "event": "started", "job_id": "7", "restart": 0},
              {"time": 2.0, "event": "preempted", "job_id": "7", "restart": 0, "step": 5}]
    events += [{"time": 3.0 + i, "event": name, "job_id": "7", "restart": 0, **fields}
               for i, (name, fields) in enumerate(after)]
    assert summarize(events, now=10.0)["state"] == state
