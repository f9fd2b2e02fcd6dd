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

from mgpu.state.checkpoint import CheckpointStore
from mgpu.cluster.environment import ProcessEnv
from mgpu.record.ledger import Ledger, read_ledger
from mgpu.run.outcome import UNANSWERED_EXIT_CODE, StopBudgets, decide_after_stop, exit_code
from mgpu.record.budgets import Limits
from mgpu.run.recovery import main as recovery_main
from mgpu.cluster.requeue import Budget
from mgpu.record.rundir import RunDir
from mgpu.cluster.slurm import SlurmClient, set_client, stop_window_s
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
    ([], {}, 30 - 3),                                     # no SIGTERM yet: Slurm's default KillWait from now
    ([("SIGTERM", 990.0)], {"MGPU_KILL_WAIT_S": "30"}, 20 - 3),  # 10 s of it spent on the save
    ([("SIGUSR2", 900.0), ("SIGTERM", 995.0)], {"MGPU_KILL_WAIT_S": "5"}, 1),  # past: the floor
    ([("SIGTERM", 900.0)], {"MGPU_KILL_WAIT_S": "30"}, 1),  # the kill is due: one short try still
    ([], {"MGPU_KILL_WAIT_S": "x"}, 30 - 3),              # unreadable: the default
])
def test_the_stop_window(signals: list[tuple[str, float]], environ: dict[str, str], expected: float) -> None:
    assert stop_window_s(signals, now=1000.0, environ=environ) == pytest.approx(expected)


# ------------------------------------------------------------------------------------------ the batch script
def open_stop(run: Path, *, unknown: bool = True) -> None:
    ledger = Ledger(run / "events.jsonl", "7", 0)
    ledger.write("preempted", step=5, reasons=["sigterm"], signals=["SIGTERM"], signal_times=[time.time()])
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
    open_stop(run)
    started = time.monotonic()
    assert recovery_main(["--exit-code", str(UNANSWERED_EXIT_CODE), "--run-dir", str(run)]) == UNANSWERED_EXIT_CODE
    assert time.monotonic() - started < 3 + 5
    events = read_ledger(run / "events.jsonl")
    again = events[2]
    assert (again["event"], again["by"], again["requeue"]) == ("stop_decision", "recovery", requeued)
    assert ([e["event"] for e in events[3:]] == ["requeued"]) is requeued
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
])
def test_status_says_what_slurm_left_open(after: list[tuple[str, dict]], state: str) -> None:
    from mgpu.record.runview import summarize

    events = [{"time": 1.0, "event": "started", "job_id": "7", "restart": 0},
              {"time": 2.0, "event": "preempted", "job_id": "7", "restart": 0, "step": 5}]
    events += [{"time": 3.0 + i, "event": name, "job_id": "7", "restart": 0, **fields}
               for i, (name, fields) in enumerate(after)]
    assert summarize(events, now=10.0)["state"] == state
