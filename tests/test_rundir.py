"""The run directory: its paths, and the claim that keeps two live jobs out of one run."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mgpu.config.loading import load_config
from mgpu.record.rundir import Owner, RunDir, RunInUse, owner_alive


def test_paths_follow_the_run_name(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=exp"])
    run = RunDir.of(cfg.run)
    assert run.path == tmp_path / "exp"  # no job id: a resubmitted job continues the same run
    assert (run.checkpoints, run.ledger, run.rank_log(3)) == (
        tmp_path / "exp" / "checkpoints", tmp_path / "exp" / "events.jsonl", tmp_path / "exp" / "logs" / "rank3.log")
    cfg = load_config(None, [f"run.dir={tmp_path / 'elsewhere'}"])
    assert RunDir.of(cfg.run).path == tmp_path / "elsewhere"
    assert RunDir(str(tmp_path)).ledger == tmp_path / "events.jsonl"  # as `python -m mgpu.run.recovery --run-dir` gives it


def queue(*live: str):
    return lambda job_id: "RUNNING" if job_id in live else None


def test_a_live_slurm_job_keeps_the_run(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.claim("100", slurm=True, squeue_state=queue())
    with pytest.raises(RunInUse, match=r"in use by Slurm job 100 .*scancel 100.*run.name"):
        run.claim("200", slurm=True, squeue_state=queue("100"))
    with pytest.raises(RunInUse):
        run.check_free(squeue_state=queue("100"))  # what jobs/submit.py asks before submitting
    run.claim("100", slurm=True, squeue_state=queue("100"))  # the same job, requeued: takes it back
    run.claim("200", slurm=True, squeue_state=queue())  # job 100 is gone: its claim is stale
    assert run.owner() is not None and run.owner().job_id == "200"


def test_a_live_local_process_keeps_the_run(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        owner = Owner.this_process("local", slurm=False)
        claim = {**owner.__dict__, "pid": child.pid, "pid_start": Path(f"/proc/{child.pid}/stat").read_text()
                 .rsplit(")", 1)[1].split()[19]}
        run.owner_file.write_text(json.dumps(claim))
        with pytest.raises(RunInUse, match=f"in use by process {child.pid} on {socket.gethostname()}"):
            run.claim("local", slurm=False)
    finally:
        child.kill()
        child.wait()
    run.claim("local", slurm=False)  # the process died (a killed run): the claim is stale
    assert run.owner().pid == os.getpid()


def test_a_reused_pid_is_not_the_owner() -> None:
    mine = Owner.this_process("x", slurm=False)
    assert owner_alive(mine)
    assert not owner_alive(Owner(**{**mine.__dict__, "pid_start": "1"}))  # same pid, other start time
    assert not owner_alive(Owner(**{**mine.__dict__, "host": "another-host"}))


def test_release_only_drops_our_own_claim(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.claim("100", slurm=True, squeue_state=queue())
    run.release("999")
    assert run.owner() is not None
    run.release("100")
    assert run.owner() is None
    run.release("100")  # nothing to drop


def test_an_unreadable_claim_is_no_claim(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.owner_file.write_text("{not json")
    assert run.owner() is None
    run.claim("1", slurm=True, squeue_state=queue())


def test_two_starts_cannot_both_win(tmp_path: Path) -> None:
    # Both find the same stale claim (job 0, gone) and ask Slurm about it at the same moment (a barrier): the
    # claim is one step under a lock (O_EXCL), so the second sees the first's claim, alive, and is refused.
    run = RunDir(tmp_path)
    run.claim("0", slurm=True, squeue_state=queue())
    one_winner(run, wait_s=2)  # the old check-then-write let both through
    assert not run.claim_lock.exists()


def one_winner(run: RunDir, wait_s: float) -> None:
    """Starts "1" and "2" claim `run` at once, both finding its claim (job 0) gone; Slurm's answer about job 0 waits
    up to `wait_s` for the other start to ask too (two starts inside the lock at once meet there). One must win."""
    import threading

    barrier = threading.Barrier(2)

    def slurm(job_id: str) -> str | None:
        if job_id == "0":
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(timeout=wait_s)
            return None
        return "RUNNING"

    outcomes: dict[str, str] = {}

    def start(job_id: str) -> None:
        try:
            run.claim(job_id, slurm=True, squeue_state=slurm)
            outcomes[job_id] = "won"
        except RunInUse as refused:
            outcomes[job_id] = str(refused)

    threads = [threading.Thread(target=start, args=(job,), name=job) for job in ("1", "2")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes.values()).count("won") == 1, outcomes
    (winner,) = [job for job, outcome in outcomes.items() if outcome == "won"]
    assert run.owner() is not None and run.owner().job_id == winner


def test_two_starts_that_find_a_stale_lock_cannot_both_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 46: a claim lock left by a start that died mid-claim is stale after LOCK_STALE_S. Both starts saw it
    # stale; one broke it and took the lock; the other, acting on its older look, removed that fresh lock and took
    # one too: both were inside, both found the old owner gone, both won. Start "2" here acts 0.5 s after its look.
    import threading
    from pathlib import Path as PathType

    run = RunDir(tmp_path)
    run.claim("0", slurm=True, squeue_state=queue())
    run.claim_lock.write_text("a start that died mid-claim\n")
    os.utime(run.claim_lock, (time.time() - 3600, time.time() - 3600))
    looked = threading.Barrier(2)
    real_stat = PathType.stat

    def stat(self: PathType, *args: Any, **kwargs: Any) -> os.stat_result:
        if self.name != run.claim_lock.name:
            return real_stat(self, *args, **kwargs)
        first = not getattr(local, "looked", False)
        local.looked = True
        if first:
            with contextlib.suppress(threading.BrokenBarrierError):
                looked.wait(timeout=2)  # both take their first look at the stale lock together
        result = real_stat(self, *args, **kwargs)
        if first and threading.current_thread().name == "2":
            time.sleep(0.5)  # ... and "2" acts on what it saw a moment later
        return result

    local = threading.local()
    monkeypatch.setattr(PathType, "stat", stat)
    one_winner(run, wait_s=3)


def fake_squeue(directory: Path, stderr: str, code: int) -> str:
    directory.mkdir()
    script = directory / "squeue"
    script.write_text(f"#!/bin/sh\necho '{stderr}' >&2\nexit {code}\n")
    script.chmod(0o755)
    return f"{directory}:{os.environ['PATH']}"


def test_a_failing_squeue_does_not_make_a_live_owner_dead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = RunDir(tmp_path / "run")
    run.claim("100", slurm=True, squeue_state=queue())
    claim = run.owner_file.read_text()
    monkeypatch.setenv("PATH", fake_squeue(tmp_path / "down", "slurm_load_jobs error: Unable to contact slurm "
                                           "controller (connect failure)", 1))
    with pytest.raises(RunInUse, match=r"held by Slurm job 100 since .*, and whether it still runs cannot be told "
                                       r"\(squeue exited 1: slurm_load_jobs error: Unable to contact slurm controller "
                                       r"\(connect failure\)\): try again when Slurm answers; if that job is over, "
                                       r"remove .*\.owner$"):
        run.claim("200", slurm=True)
    assert run.owner_file.read_text() == claim
    monkeypatch.setenv("PATH", fake_squeue(tmp_path / "forgot", "slurm_load_jobs error: Invalid job id specified", 1))
    run.claim("200", slurm=True)  # Slurm answered: it no longer knows the job, so the claim is stale
    assert run.owner().job_id == "200"


def test_a_second_start_on_a_held_run_names_the_holder(tmp_path: Path) -> None:
    # A real jobs/train.py against a run that a live process holds: one line, exit 2 (it used to be an
    # AttributeError, exit 1, which the batch script retried).
    from tests.conftest import ROOT, base_env

    run = RunDir(tmp_path / "run")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        owner = Owner.this_process("local", slurm=False)
        run.path.mkdir()
        run.owner_file.write_text(json.dumps({**owner.__dict__, "pid": child.pid, "pid_start": Path(
            f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]}))
        result = subprocess.run([sys.executable, str(ROOT / "jobs" / "train.py"), f"run.dir={run.path}",
                                 "task.target=tests.tasks:BlobTask"], env=base_env(), cwd=ROOT, capture_output=True,
                                text=True, timeout=120)
    finally:
        child.kill()
        child.wait()
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"train: error: run {run.path} is in use by process {child.pid} on {socket.gethostname()} since "
        f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(owner.since))}: wait for it or stop it, or start another "
        f"run (run.name=...)"], result.stderr
