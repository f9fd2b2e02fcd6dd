"""The doctor's logic by tables (mgpu/submit/doctor.py), its probe as a real process (mgpu/submit/doctor_probe.py, signals
sent by hand), and jobs/doctor.py's bad input: one line, exit 2, nothing submitted or created. The runs on
the real test cluster, under every preemption policy, are tests/e2e/test_doctor.py.

The signal timelines below are the ones docs/slurm-measurements.md recorded on the test cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from mgpu.submit.doctor import (ClusterConfig, EnvFacts, PreemptionFacts, analyze_env, analyze_preemption, batch_script,
                         check_name, parse_config, parse_kv, read_probe_log, report, settings_and_risks)
from mgpu.errors import MgpuError
from tests.conftest import PYTHON, ROOT, base_env

DOCTOR = str(ROOT / "jobs" / "doctor.py")
PROBE = ROOT / "mgpu" / "submit" / "doctor_probe.py"
T0 = 1000.0


def sig(t: float, name: str) -> dict[str, Any]:
    return {"t": T0 + t, "ev": "signal", "sig": name}


# policy: (victim's records, its last heartbeat (s after T0), its next run's records) -> expected facts
PREEMPTION_CASES: dict[str, tuple[list[dict[str, Any]], float | None, list[dict[str, Any]], dict[str, Any]]] = {
    "GraceTime 0, user signal": (
        [{"t": T0 - 5, "ev": "start"}, sig(0, "SIGUSR2"), sig(0.001, "SIGCONT"), sig(0.002, "SIGTERM"),
         sig(0.012, "SIGCONT"), sig(0.013, "SIGTERM")], 5.08, [{"t": T0 + 11.1, "ev": "start"}],
        {"user_signal": "with_term", "user_signal_lead_s": 0.0, "grace_s": 0.01, "kill_after_term_s": 5.07,
         "requeued": True, "back_after_s": 6.02}),
    "GraceTime 0, TERM before the user signal in the same instant": (
        [sig(0, "SIGTERM"), sig(0.003, "SIGUSR2")], 5.0, [],
        {"user_signal": "with_term", "grace_s": 0.0, "requeued": False, "back_after_s": None}),
    "GraceTime 0, no user signal": (
        [sig(0, "SIGTERM"), sig(0.001, "SIGCONT"), sig(0.004, "SIGTERM")], 5.1, [{"t": T0 + 12, "ev": "start"}],
        {"user_signal": "none", "user_signal_lead_s": None, "grace_s": 0.0, "kill_after_term_s": 5.1,
         "requeued": True}),
    "GraceTime 10, user signal": (
        [sig(0, "SIGUSR2"), sig(0.001, "SIGCONT"), sig(14.2, "SIGTERM"), sig(14.201, "SIGCONT"),
         sig(14.202, "SIGTERM")],
        19.25, [{"t": T0 + 26, "ev": "start"}],
        {"user_signal": "before_term", "user_signal_lead_s": 14.2, "grace_s": 14.2, "kill_after_term_s": 5.05,
         "requeued": True, "back_after_s": 6.75}),
    "GraceTime 10, no user signal: SIGTERM twice": (
        [sig(0, "SIGTERM"), sig(0.001, "SIGCONT"), sig(16.5, "SIGTERM"), sig(16.501, "SIGCONT"),
         sig(16.502, "SIGTERM")],
        21.5, [],
        {"user_signal": "none", "grace_s": 16.5, "kill_after_term_s": 5.0, "requeued": False}),
    "a TERM logged after the last beat does not count": (
        [sig(0, "SIGUSR2"), sig(10, "SIGTERM"), sig(30, "SIGTERM")], 15.0, [],
        {"user_signal": "before_term", "grace_s": 10.0, "kill_after_term_s": 5.0}),
}


@pytest.mark.parametrize("name", PREEMPTION_CASES)
def test_analyze_preemption(name: str) -> None:
    records, beat, after, expected = PREEMPTION_CASES[name]
    facts = analyze_preemption(records, None if beat is None else T0 + beat, after, "n1")
    assert facts.observed and facts.node == "n1"
    for key, value in expected.items():
        assert getattr(facts, key) == (pytest.approx(value, abs=0.011) if isinstance(value, float) else value), key


def test_analyze_preemption_without_signals() -> None:
    facts = analyze_preemption([{"t": T0, "ev": "start"}], T0 + 100, [], "n2")
    assert not facts.observed and facts.why_not == "the probe job received no signal"


def _env_logs(**changes: Any) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """A 2-node env probe that found everything fine, with `changes` applied (see the cases)."""
    start = lambda t, node: {"t": T0 + t, "ev": "start", "node": node, "scontrol": "/usr/bin/scontrol"}  # noqa: E731
    r0 = [start(0, "n1"), {"t": T0 + 0.1, "ev": "resolve", "host": "n1", "addrs": ["127.0.0.1"]},
          {"t": T0 + 0.1, "ev": "resolve", "host": "n2", "addrs": ["127.0.0.1"]},
          {"t": T0 + 0.5, "ev": "listen", "port": 20077, "accepted": 1},
          {"t": T0 + 0.6, "ev": "renamed", "written": T0 + 0.55}, {"t": T0 + 0.7, "ev": "ready"},
          sig(22, "SIGUSR2"), sig(22.001, "SIGCONT"), {"t": T0 + 22.3, "ev": "requeue", "rc": 0, "out": ""},
          sig(22.4, "SIGTERM"), {"t": T0 + 22.5, "ev": "exit"}]
    r1 = [start(0, "n2"), {"t": T0 + 0.1, "ev": "resolve", "host": "n1", "addrs": ["127.0.0.1"]},
          {"t": T0 + 0.1, "ev": "resolve", "host": "n2", "addrs": ["127.0.0.1"]},
          {"t": T0 + 0.3, "ev": "connect", "host": "n1", "port": 20077},
          {"t": T0 + 0.6, "ev": "seen", "written": T0 + 0.55},
          {"t": T0 + 0.7, "ev": "ready"}, sig(22, "SIGUSR2"), sig(22.4, "SIGTERM"), {"t": T0 + 22.5, "ev": "exit"}]
    logs = {(0, 0): r0, (0, 1): r1, (1, 0): [{"t": T0 + 28.8, "ev": "start"}],
            (1, 1): [{"t": T0 + 28.9, "ev": "start"}]}
    for key, value in changes.items():
        task, event, field = key.split("__")
        records = logs[(0, int(task[1:]))]
        for record in records:
            if record["ev"] == event or (event == "usr2" and record.get("sig") == "SIGUSR2"):
                if value == "DROP":
                    records.remove(record)
                else:
                    record[field] = value
                break
    return logs


ENV_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "all fine": ({}, {"signal_lead_s": 38.0, "signal_tasks": 2, "requeue_rc": 0, "requeue_hold_s": 6.5,
                      "shared_error": None, "rendezvous": None, "unresolved": [],
                      "scontrol": {"n1": "/usr/bin/scontrol", "n2": "/usr/bin/scontrol"}}),
    "no scontrol on n2": ({"t1__start__scontrol": None}, {"scontrol": {"n1": "/usr/bin/scontrol", "n2": None}}),
    "n2 cannot resolve n1": ({"t1__resolve__error": "[Errno -2] Name or service not known"},
                             {"unresolved": ["on n2: n1: [Errno -2] Name or service not known"]}),
    "n2 cannot connect": ({"t1__connect__error": "[Errno 111] Connection refused", "t0__listen__accepted": 0},
                          {"rendezvous": "connecting to n1:20077: [Errno 111] Connection refused"}),
    "port in use on n1": ({"t0__listen__error": "[Errno 98] Address already in use"},
                          {"rendezvous": "listening on port 20077: [Errno 98] Address already in use"}),
    "not shared": ({"t1__seen__error": "not there after 30 s"}, {"shared_error": "not there after 30 s",
                                                                  "shared_delay_s": None}),
    "requeue refused": ({"t0__requeue__rc": 1, "t0__requeue__out": "Access/permission denied"},
                        {"requeue_rc": 1, "requeue_message": "Access/permission denied", "requeue_hold_s": None}),
    # scontrol killed by the requeue's own SIGTERM (Slurm signals the job's processes, a new session included: CI
    # saw rc -15): the job's next run says whether it took effect
    "requeue killed by its own TERM, job back": ({"t0__requeue__rc": -15},
                                                 {"requeue_rc": 0, "requeue_hold_s": 6.5}),
    "requeue killed, job not back": ({"t0__requeue__rc": -15, "BACK": "DROP"},
                                     {"requeue_rc": -15, "requeue_hold_s": None}),
    "no user signal: SIGTERM at the limit": ({"t0__usr2__sig": "DROP", "t1__usr2__sig": "DROP"},
                                             {"signal_lead_s": None, "signal_tasks": 0, "term_first": True}),
}


@pytest.mark.parametrize("name", ENV_CASES)
def test_analyze_env(name: str) -> None:
    changes, expected = ENV_CASES[name]
    logs = _env_logs(**{k: v for k, v in changes.items() if k != "BACK"})
    if changes.get("BACK") == "DROP":  # no next run
        logs = {key: value for key, value in logs.items() if key[0] == 0}
    if changes.get("t0__usr2__sig") == "DROP":
        for key in ((0, 0), (0, 1)):
            logs[key] = [r for r in logs[key] if r["ev"] != "requeue"]
    facts = analyze_env(logs, end_time=T0 + 60)
    got = {key: getattr(facts, key) for key in expected}
    assert got == expected


@pytest.mark.parametrize("value, ok", [("main", True), ("gpu-a100_x", True), ("a.b+c@d:e", True), ("", False),
                                       ("main high", False), ("main\n#SBATCH --x", False), ("a;b", False)])
def test_check_name(value: str, ok: bool) -> None:
    if ok:
        assert check_name("--partition", value) == value
    else:
        with pytest.raises(MgpuError, match="--partition .*: not a Slurm name"):
            check_name("--partition", value)


def test_batch_scripts() -> None:
    victim = batch_script("preempt", Path("/r/.mgpu-doctor/x"), "/v/bin/python", PROBE, "main", qos="q", tag="42")
    for line in ("#SBATCH --job-name=mgpu-doctor-preempt-42", "#SBATCH --partition=main", "#SBATCH --exclusive",
                 "#SBATCH --requeue", "#SBATCH --signal=USR2@30",
                 "#SBATCH --qos=q", "#SBATCH --open-mode=append"):
        assert line in victim.splitlines()
    assert victim.splitlines()[-1] == f"srun /v/bin/python {PROBE} preempt /r/.mgpu-doctor/x --max-s 280"
    preemptor = batch_script("preemptor", Path("/r"), "p", PROBE, "high", node="n2").splitlines()
    assert "#SBATCH --nodelist=n2" in preemptor and preemptor[-1] == "sleep 1"
    env = batch_script("env", Path("/r/x y"), "p", PROBE, "main", nodes=2).splitlines()
    assert "#SBATCH --nodes=2" in env and "#SBATCH --time=1" in env
    assert env[-1] == f"srun p {PROBE} env '/r/x y' --max-s 150"


def test_parsers() -> None:
    assert parse_kv("PartitionName=main GraceTime=10 Nodes=n[1-2]\nother=1\n") == {
        "PartitionName": "main", "GraceTime": "10", "Nodes": "n[1-2]"}
    assert parse_kv("Partition nosuch not found\n") == {}
    config = parse_config("Configuration data as of 2026-11-25T09:00:00\nAuthInfo                = cred_expire=5\n"
                          "KillWait                = 5 sec\nSlurmctldParameters     = preempt_send_user_signal\n"
                          "Slurmctld(primary) at vm is UP\n")
    assert config == {"AuthInfo": "cred_expire=5", "KillWait": "5 sec",
                      "SlurmctldParameters": "preempt_send_user_signal"}
    cfg = ClusterConfig.read({**config, "PreemptMode": "REQUEUE", "JobRequeue": "1"},
                             {"GraceTime": "10", "PreemptMode": "REQUEUE"})
    assert cfg == ClusterConfig(10, 5, "REQUEUE", True, 5, "1")
    assert ClusterConfig.read({"SlurmctldParameters": "enable_configless"}, {}).user_signal is False
    assert ClusterConfig.read({}, {}).user_signal is None
    text = ('{"t": 1, "ev": "start"}\n[1]\n{"t": "x", "ev": "a"}\nnot json\n'
            '{"t": 2, "ev": "signal", "sig": "SIGTERM"}\n{"t": 3, "e')
    assert [r["ev"] for r in read_probe_log(text)] == ["start", "signal"]


CFG0 = ClusterConfig(0, 5, "REQUEUE", True, 5, "1")
ENV_OK = analyze_env(_env_logs(), T0 + 60)


@pytest.mark.parametrize("name, pre, env, settings, risks", [
    ("grace 0 + user signal", analyze_preemption(PREEMPTION_CASES["GraceTime 0, user signal"][0], T0 + 5.08,
                                                 [{"t": T0 + 11, "ev": "start"}]), ENV_OK,
     ["signal lead: --signal-lead 120 (the default) or more; Slurm sent it 38 s before the limit when asked for 30 s "
      "(up to ~60 s early)",
      "self-requeue: yes (scontrol requeue from inside the job works); a requeued job was held 6.5 s before it ran "
      "again",
      "preemption: GraceTime 0: mgpu stops on SIGTERM and Slurm requeues the job; the stop's checkpoint has 5 s until "
      "SIGKILL"],
     ["a preemption leaves 5 s from SIGTERM to SIGKILL: a stop's checkpoint that takes longer is lost and the steps "
      "since the previous one are trained again"]),
    ("grace 10 + user signal", analyze_preemption(PREEMPTION_CASES["GraceTime 10, user signal"][0], T0 + 19.25,
                                                  [{"t": T0 + 26, "ev": "start"}]), None,
     ["preemption: mgpu stops on USR2 and requeues itself, 14 s before SIGTERM and 5 s more before SIGKILL"], []),
    ("grace 10, no user signal", analyze_preemption(PREEMPTION_CASES["GraceTime 10, no user signal: SIGTERM twice"][0],
                                                    T0 + 21.5, [{"t": T0 + 28, "ev": "start"}]), None,
     ["preemption: mgpu stops on the first SIGTERM and requeues itself within the grace (SIGTERM again after 16 s, "
      "SIGKILL 5 s later)"], []),
    ("no preemptor", None, None,
     ["preemption: not measured (give --preemptor-partition, a partition that preempts this one)"], []),
    ("nothing preempted", PreemptionFacts(False, "no signal within 120 s"), None,
     ["preemption: not measured (the probe job was not preempted)"],
     ["no preemption happened (no signal within 120 s): the preemptor partition may not preempt this one"]),
])
def test_settings_and_risks(name: str, pre: PreemptionFacts | None, env: EnvFacts | None, settings: list[str],
                            risks: list[str]) -> None:
    assert settings_and_risks(CFG0, pre, env) == (settings, risks)


@pytest.mark.parametrize("case, risk", [
    ("no scontrol on n2", "no scontrol in the job's environment on n2: mgpu cannot ask Slurm"),
    ("n2 cannot resolve n1", "node names do not resolve (on n2: n1: [Errno -2] Name or service not known)"),
    ("n2 cannot connect", "the nodes could not reach each other on mgpu's rendezvous port"),
    ("not shared", "the run root is not shared between the nodes (not there after 30 s)"),
    ("requeue refused", "scontrol requeue from inside the job failed (Access/permission denied): after a time limit"),
    ("no user signal: SIGTERM at the limit", "--signal=USR2@N never reached the tasks"),
])
def test_env_risks(case: str, risk: str) -> None:
    changes, _ = ENV_CASES[case]
    logs = _env_logs(**changes)
    _, risks = settings_and_risks(CFG0, None, analyze_env(logs, T0 + 60))
    assert len(risks) == 1 and risks[0].startswith(risk), risks


def test_report_lines() -> None:
    pre = analyze_preemption(PREEMPTION_CASES["GraceTime 10, user signal"][0], T0 + 19.25,
                             [{"t": T0 + 26, "ev": "start"}], "n1")
    lines = report("main", ClusterConfig(10, 5, "REQUEUE", True, 5, "1"), pre, ENV_OK, "runs", ["env: something"])
    assert lines[0] == ("configured  GraceTime=10 (main), KillWait=5, PreemptMode=REQUEUE, preempt_send_user_signal: "
                        "yes, JobRequeue=1, requeue hold cred_expire+1=6 s")
    assert lines[1] == ("preemption  on n1: the user signal (USR2) comes 14.2 s before SIGTERM; SIGKILL 5.0 s "
                        "after the "
                        "last SIGTERM; Slurm requeued it: running again 6.8 s after the kill")
    assert "--signal    USR2 reached 2 of 2 task(s) 38 s before the time limit (asked: 30 s)" in lines
    assert "requeue     scontrol requeue from inside the job: allowed; back 6.5 s later" in lines
    assert "scontrol    in the job: /usr/bin/scontrol" in lines
    assert "shared fs   runs: an fsync'd rename on n1 seen on n2 after 0.05 s" in lines
    assert "nodes       resolve on every node (n1 -> 127.0.0.1, n2 -> 127.0.0.1); rendezvous port reached" in lines
    assert "incomplete  env: something" in lines
    assert lines.index("settings mgpu will use on main:") < lines.index("risks: none found") == len(lines) - 1


# ----------------------------------------------------------------------------------------------- the probe
def _probe(tmp_path: Path, mode: str, **env: str) -> subprocess.Popen[bytes]:
    environ = dict(base_env(), SLURM_JOB_ID="77", SLURM_PROCID="0", SLURM_JOB_NODELIST="localhost",
                   SLURMD_NODENAME="n1", **env)
    return subprocess.Popen([PYTHON, str(PROBE), mode, str(tmp_path), "--max-s", "60"], env=environ)


def _records(path: Path, event: str, timeout: float = 30) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = read_probe_log(path.read_text()) if path.exists() else []
        if any(r["ev"] == event for r in records):
            return records
        time.sleep(0.05)
    raise AssertionError(f"no {event} in {path} after {timeout} s")


def test_probe_records_a_preemption_until_killed(tmp_path: Path) -> None:
    proc = _probe(tmp_path, "preempt")
    try:
        _records(tmp_path / "preempt-r0-t0.log", "start")
        for name in ("SIGUSR2", "SIGCONT", "SIGTERM"):  # as Slurm sends them with GraceTime 0
            proc.send_signal(getattr(signal, name))
        _records(tmp_path / "preempt-r0-t0.log", "signal")
        time.sleep(0.5)
        assert proc.poll() is None  # SIGTERM is recorded, not obeyed
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records = read_probe_log((tmp_path / "preempt-r0-t0.log").read_text())
    # Pending signals are handled in the kernel's order (by number), not in the order they were sent.
    assert sorted(r["sig"] for r in records if r["ev"] == "signal") == ["SIGCONT", "SIGTERM", "SIGUSR2"]
    beat = float((tmp_path / "preempt-r0-t0.beat").read_text().split()[0])
    facts = analyze_preemption(records, beat)
    assert facts.user_signal == "with_term" and facts.kill_after_term_s is not None
    assert records[0]["node"] == "n1" and records[0]["restart"] == 0


def test_probe_requeues_itself_on_the_user_signal(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$*" > {tmp_path}/requeued\n')
    (bin_dir / "scontrol").chmod(0o755)
    proc = _probe(tmp_path, "env", PATH=f"{bin_dir}:{os.environ['PATH']}")
    try:
        _records(tmp_path / "env-r0-t0.log", "ready")
        proc.send_signal(signal.SIGUSR2)
        _records(tmp_path / "env-r0-t0.log", "requeue")
        proc.send_signal(signal.SIGTERM)  # what a requeue brings
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / "requeued").read_text() == "requeue 77\n"
    records = read_probe_log((tmp_path / "env-r0-t0.log").read_text())
    assert [r["ev"] for r in records] == ["start", "resolve", "ready", "signal", "requeue", "signal", "exit"]
    assert records[1]["host"] == "localhost" and records[1]["addrs"]
    # A requeued job's next run only says it is back.
    again = subprocess.run([PYTHON, str(PROBE), "env", str(tmp_path)], timeout=60,
                           env=dict(base_env(), SLURM_JOB_ID="77", SLURM_RESTART_COUNT="1"))
    assert again.returncode == 0
    assert [r["ev"] for r in read_probe_log((tmp_path / "env-r1-t0.log").read_text())] == ["start"]


# ----------------------------------------------------------------------------------------------- bad input
def _stub_bin(tmp_path: Path) -> Path:
    """sbatch/scancel that leave a file when called (nothing may be submitted); scontrol knows `main`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = ('#!/bin/sh\nif [ "$2" = partition ]; then\n  [ "$4" = main ] && echo "PartitionName=main TotalNodes=2 '
                'State=UP GraceTime=0" && exit 0\n  echo "Partition $4 not found"; exit 1\nfi\nexit 0\n')
    for name, text in {"sbatch": f'#!/bin/sh\ntouch {tmp_path}/SUBMITTED\nexit 1\n',
                       "scancel": f'#!/bin/sh\ntouch {tmp_path}/CANCELLED\n', "scontrol": scontrol}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("args, expect", [
    ([], "the following arguments are required: --partition"),
    (["--partition", "main high"], "--partition 'main high': not a Slurm name"),
    (["--partition", "main\nx"], "--partition 'main\\nx': contains a newline"),
    (["--partition", "nosuch"], "--partition 'nosuch': Partition nosuch not found (sinfo -s lists the partitions)"),
    (["--partition", "main", "--preemptor-partition", "main"], "--preemptor-partition 'main' is --partition itself"),
    (["--partition", "main", "--preemptor-partition", "nope"],
     "--preemptor-partition 'nope': Partition nope not found"),
    (["--partition", "main", "--nodes", "0"], "--nodes 0: give 1"),
    (["--partition", "main", "--nodes", "3"], "--nodes 3: partition 'main' has 2 node(s); give --nodes 2"),
    (["--partition", "main", "--timeout", "5"], "--timeout 5: give 60 to 86400 seconds"),
    (["--partition", "main", "--only", "preemption"], "--only preemption needs --preemptor-partition"),
    (["--partition", "main", "--only", "x"], "argument --only: invalid choice: 'x'"),
    (["--partition", "main", "--json", "/nonexistent/f.json"], "--json '/nonexistent/f.json': no such directory"),
    (["--partition", "main", "--run-root", "/nonexistent/a/b"], "--run-root '/nonexistent/a/b': no such directory"),
    (["--partition", "main", "--run-root", "{file}"], "--run-root '{file}' is not a directory"),
    (["--partition", "main", "--account", "a b"], "--account 'a b': not a Slurm name"),
])
def test_doctor_bad_input(tmp_path: Path, args: list[str], expect: str) -> None:
    bin_dir = _stub_bin(tmp_path)
    (tmp_path / "file").write_text("x")
    args = [a.replace("{file}", str(tmp_path / "file")) for a in args]
    before = sorted(p.name for p in tmp_path.iterdir())
    result = subprocess.run([PYTHON, DOCTOR, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env=base_env(PATH=f"{bin_dir}:{os.environ['PATH']}"))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("doctor: error: ") and expect.replace("{file}", str(
        tmp_path / "file")) in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing submitted, no run root created


def test_doctor_without_slurm_commands(tmp_path: Path) -> None:
    result = subprocess.run([PYTHON, DOCTOR, "--partition", "main"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60, env=base_env(PATH=str(tmp_path)))
    assert result.returncode == 2 and result.stderr == ("doctor: error: sbatch, scontrol, scancel not found on PATH: "
                                                        "run the doctor where Slurm's client commands are (a login "
                                                        "node)\n")
    assert list(tmp_path.iterdir()) == []


def test_json_facts_are_plain(tmp_path: Path) -> None:
    """What --json writes round-trips (dataclasses of plain values)."""
    import dataclasses

    facts = {"env": dataclasses.asdict(ENV_OK), "configured": dataclasses.asdict(CFG0)}
    assert json.loads(json.dumps(facts))["env"]["signal_lead_s"] == 38.0
