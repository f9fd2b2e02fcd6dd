"""The run directory: its paths, and the claim that keeps two live jobs out of one run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mgpu.config import load_config
from mgpu.rundir import Owner, RunDir, RunInUse, owner_alive


def test_paths_follow_the_run_name(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=exp"])
    run = RunDir.of(cfg.run)
    assert run.path == tmp_path / "exp"  # no job id: a resubmitted job continues the same run
    assert (run.checkpoints, run.ledger, run.rank_log(3)) == (
        tmp_path / "exp" / "checkpoints", tmp_path / "exp" / "events.jsonl", tmp_path / "exp" / "logs" / "rank3.log")
    cfg = load_config(None, [f"run.dir={tmp_path / 'elsewhere'}"])
    assert RunDir.of(cfg.run).path == tmp_path / "elsewhere"
    assert RunDir(str(tmp_path)).ledger == tmp_path / "events.jsonl"  # as `python -m mgpu.recovery --run-dir` gives it


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
