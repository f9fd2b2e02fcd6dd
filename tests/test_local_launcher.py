"""The local launcher: `jobs/submit.py --cluster local` and `python -m mgpu.run.spawn` as a user drives them from a
terminal: Ctrl-C (SIGINT to the whole foreground process group) or a SIGTERM to the launcher alone stops every
rank at the same step; they save; the launcher exits 3 with the command that resumes, leaving no process
behind; the same command resumes; a second launch on a run in use is refused in one line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from mgpu.record.ledger import read_ledger
from tests.conftest import PYTHON, ROOT, base_env, live_children

pytestmark = pytest.mark.multiprocess

SLOW = ["task.target=tests.tasks:SlowBlobTask", "task.args.step_s=0.2", "train.epochs=30", "data.batch_size=4",
        "log.every_steps=5"]


def launch(args: list[str]) -> subprocess.Popen[str]:
    # Its own session and process group, as a terminal's foreground job: killpg is the terminal's Ctrl-C.
    return subprocess.Popen([PYTHON, *args], cwd=ROOT, env=base_env(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_steps(run_dir: Path, proc: subprocess.Popen[str], steps: int = 5, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not [e for e in read_ledger(run_dir / "events.jsonl") if e["event"] == "progress" and e["step"] >= steps]:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)


def ranks_of(proc: subprocess.Popen[str]) -> list[int]:
    return [pid for pid in live_children(proc.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def stop(proc: subprocess.Popen[str], how: str) -> str:
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGUSR1 if how == "sigusr1" else signal.SIGTERM)  # to the launcher alone
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return out


# Ctrl-C or a SIGTERM to `jobs/submit.py --cluster local` and to `python -m mgpu.run.spawn`: every rank stops at the
# same step, saves, the launcher exits 3 with the command that resumes it (the launcher's own), nothing is left
# running, and the same command resumes bit-identically: the launch matrix's local cells (tests/test_launch_matrix.py).


def test_a_second_launch_on_a_run_in_use_is_refused(tmp_path: Path) -> None:
    args = [str(ROOT / "jobs" / "submit.py"), "--cluster", "local", "--gpus-per-node", "2", "--folder",
            str(tmp_path / "runs"), *SLOW]
    proc = launch(args)
    try:
        wait_for_steps(tmp_path / "runs" / "run", proc, steps=1)
        second = subprocess.run([PYTHON, *args], cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=120)
    finally:
        stop(proc, "sigterm")
    assert second.returncode == 2, second.stdout + second.stderr
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "is in use by process" in lines[0], second.stderr


@pytest.mark.parametrize("how", ["sigusr1"])  # Ctrl-C: the launch matrix
def test_mgpu_spawn_runs_a_script_on_local_ranks_and_a_stop_exits_3(how: str, tmp_path: Path) -> None:
    # SIGUSR1 to the launcher alone killed it (its default action); its ranks, orphaned, stopped on SIGTERM with 12
    # C++ stack dumps. Now passed on to them as a stop like SIGTERM.
    run_dir = tmp_path / "run"
    proc = launch(["-m", "mgpu.run.spawn", "-n", "2", str(ROOT / "jobs" / "train.py"), f"run.dir={run_dir}", *SLOW])
    wait_for_steps(run_dir, proc)
    ranks = ranks_of(proc)
    out = stop(proc, how)
    assert proc.returncode == 3 and "Traceback" not in out and "C++" not in out, out[-3000:]
    assert "to resume:" in out
    (preempted,) = [e for e in read_ledger(run_dir / "events.jsonl") if e["event"] == "preempted"]
    assert preempted["reasons"] == (["interrupt"] if how == "ctrl-c" else ["sigterm"]), preempted
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()], "a rank outlived the launcher"
