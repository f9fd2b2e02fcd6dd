"""A training loop of the user's own (tests/own_loop.py on mgpu.Session) as a real Slurm job through
slurm/loop.sbatch: preempted, and stopped by its time limit with no `--signal` at all (the deadline the
session reads from Slurm); each time saved, requeued, resumed, and bit-identical to an unbroken run."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
from job_helpers import checkpoint_state, events, preempt
from slurm_helpers import final_state, runs, wait_until

from tests.conftest import PYTHON, ROOT, base_env
from tests.test_own_loop import run_ranks
from tests.test_trainer import assert_identical

OWN_LOOP = str(ROOT / "tests" / "own_loop.py")
TEMPLATE = ROOT / "slurm" / "loop.sbatch"
KEYS = ("model", "optimizer", "scheduler", "loader", "best", "bad_evals")


def reference(tmp_path: Path, *args: str) -> dict[str, Any]:
    """The same loop, unbroken, on 2 local ranks."""
    run_dir = tmp_path / "reference"
    results = run_ranks([OWN_LOOP, str(run_dir), *args])
    assert [rc for rc, _ in results] == [0, 0], results
    return checkpoint_state(run_dir)


def submit_loop(cluster: Any, tmp_path: Path, script: Path, *args: str, time_limit: str = "5") -> str:
    cmd = ["sbatch", "--parsable", "-p", "main", "-N2", "--ntasks-per-node=1", "--gpus-per-node=1",
           "--cpus-per-task=4", f"--time={time_limit}", "-o", f"{tmp_path}/%x-%j.out", "--export=ALL", str(script),
           *args]
    env = base_env(PYTHON=PYTHON, SLURM_CONF=str(cluster.conf))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().split(";")[0]


def output(tmp_path: Path, jobid: str) -> str:
    return "\n".join(p.read_text()[-3000:] for p in tmp_path.glob(f"*-{jobid}.out"))


def test_an_own_loop_job_is_preempted_requeued_and_resumes_bit_identically(slurm_cluster: Any, tmp_path: Path) -> None:
    args = ["--epochs=3", "--step-s=0.4"]
    expected = reference(tmp_path, "--epochs=3")  # the sleep paces the job; it changes no number
    run_dir = tmp_path / "run"
    jobid = submit_loop(slurm_cluster, tmp_path, TEMPLATE, OWN_LOOP, str(run_dir), *args)
    high = ""
    try:
        wait_until("the loop's first checkpoint", lambda: [e for e in events(run_dir, "checkpoint_saved")]
                   if (run_dir / "events.jsonl").exists() else None, 120)
        high = preempt(slurm_cluster)  # GraceTime 0 with the user signal (the default policy): Slurm requeues it
        assert final_state(slurm_cluster, jobid, timeout=180) == "COMPLETED", output(tmp_path, jobid)
        assert runs(slurm_cluster, jobid)[-1] == "COMPLETED" and len(runs(slurm_cluster, jobid)) == 2
        (preempted,) = events(run_dir, "preempted")
        assert [e["step"] for e in events(run_dir, "resumed")] == [preempted["step"]]  # no step lost
        assert_identical({k: checkpoint_state(run_dir)[k] for k in KEYS}, {k: expected[k] for k in KEYS}, "")
    finally:
        for job in (jobid, high):
            if job:
                slurm_cluster.run("scancel", job, check=False)


def test_a_time_limit_without_a_signal_stops_in_time_and_loses_no_step(slurm_cluster: Any, tmp_path: Path) -> None:
    # --time=1 and no --signal: Slurm would kill the job at its end (and check every 30 s). The first run
    # trains at 0.4 s a step for longer than the limit allows; rank 0 reads the end from squeue and stops
    # when less than the margin (60 s, at most a tenth of the limit: 6 s) plus a write and a few steps are
    # left; the second run finishes.
    # 144 steps: 58 s of sleep alone, more than the ~52 s a first run has before it must stop
    args = ["--epochs=24", "--step-s=0.4", "--save-every=1000"]
    expected = reference(tmp_path, "--epochs=24", "--save-every=1000")
    script = tmp_path / "loop-nosignal.sbatch"
    script.write_text("".join(line for line in TEMPLATE.read_text().splitlines(keepends=True)
                              if not line.startswith("#SBATCH --signal")))
    run_dir = tmp_path / "run"
    jobid = submit_loop(slurm_cluster, tmp_path, script, OWN_LOOP, str(run_dir), *args, time_limit="1")
    try:
        assert final_state(slurm_cluster, jobid, timeout=420) == "COMPLETED", output(tmp_path, jobid)
        assert runs(slurm_cluster, jobid) == ["REQUEUED", "COMPLETED"], output(tmp_path, jobid)
        (preempted,) = events(run_dir, "preempted")
        assert preempted["reasons"] == ["deadline"] and preempted["signals"] == [], preempted
        (decision,) = events(run_dir, "stop_decision")
        assert (decision["what"], decision["requeue"]) == ("time_limit", True), decision
        assert [e["step"] for e in events(run_dir, "resumed")] == [preempted["step"]]  # no step lost
        assert preempted["step"] in {e["step"] for e in events(run_dir, "checkpoint_saved") if e["restart"] == 0}
        assert_identical({k: checkpoint_state(run_dir)[k] for k in KEYS}, {k: expected[k] for k in KEYS}, "")
    finally:
        slurm_cluster.run("scancel", jobid, check=False)


@pytest.fixture(autouse=True)
def _no_leftover_run_dir_files() -> Iterator[None]:
    """slurm/loop.sbatch announces run directories in .mgpu/ of the submission directory."""
    yield
    for path in (ROOT / ".mgpu").glob("run-dir-*"):
        path.unlink(missing_ok=True)
