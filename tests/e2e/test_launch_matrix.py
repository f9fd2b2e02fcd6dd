"""The launch matrix's srun cells (tests/launch_matrix.py): the trainer through slurm/train.sbatch, or a loop of one's
own through slurm/loop.sbatch, on 2 nodes x 1 task with 2 DataLoader workers each, started by fork, spawn or
forkserver; preempted mid-epoch (GraceTime 0 with the user signal: every process of the step gets USR2 and TERM at
once, the workers and a forkserver included); Slurm requeues the job, which resumes and finishes bit-identical to
the unbroken run of tests/test_launch_matrix.py's reference."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
from job_helpers import checkpoint_state, events, preempt
from slurm_helpers import final_state, runs, wait_until

from tests.conftest import PYTHON, ROOT, base_env, start_ranks, wait_ranks
from tests.launch_matrix import Cell, selected
from tests.test_launch_matrix import (KEYS, SIGNAL_AFTER, STEPS_PER_EPOCH, mgpu_trouble, program_args,
                                      progress_at_least)
from tests.test_trainer import assert_identical

pytestmark = pytest.mark.slurm

TEMPLATES = {"trainer": ROOT / "slurm" / "train.sbatch", "loop": ROOT / "slurm" / "loop.sbatch"}


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    """The unbroken runs' final states, by program (trained at first use)."""
    return {}


def unbroken(states: dict[str, Any], program: str, tmp: Path) -> dict[str, Any]:
    if program not in states:
        run_dir = tmp / f"unbroken-{program}" / "run"
        results = wait_ranks(start_ranks(program_args(Cell(program, "", "default", ""), run_dir, False), 2), 300)
        assert [rc for rc, _ in results] == [0, 0], results
        states[program] = checkpoint_state(run_dir)
    return states[program]


def submit(cluster: Any, cell: Cell, run_dir: Path, tmp_path: Path) -> str:
    args = program_args(cell, run_dir, True)
    if cell.program == "trainer":  # slurm/train.sbatch CONFIG [key=value ...]: the overrides on a bare config
        config = tmp_path / "matrix.yaml"
        config.write_text("train:\n  epochs: 3\n")
        script_args = [str(config), *args[1:]]
    else:
        script_args = args
    cmd = ["sbatch", "--parsable", "-p", "main", "-N2", "--ntasks-per-node=1", "--gpus-per-node=1",
           "--cpus-per-task=4", "--time=5", "-o", f"{tmp_path}/%x-%j.out", "--export=ALL",
           str(TEMPLATES[cell.program]), *script_args]
    proc = subprocess.run(cmd, cwd=ROOT, env=base_env(PYTHON=PYTHON, SLURM_CONF=str(cluster.conf)),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().split(";")[0]


@pytest.mark.parametrize("cell", [c for c in selected() if c.launcher == "srun"], ids=lambda c: c.id)
def test_a_preemption_mid_epoch_with_workers_resumes_bit_identically(cell: Cell, slurm_cluster: Any,
                                                                     references: dict[str, Any],
                                                                     tmp_path: Path) -> None:
    expected = unbroken(references, cell.program, tmp_path)
    run_dir = tmp_path / "run"
    jobid = submit(slurm_cluster, cell, run_dir, tmp_path)
    high = ""
    try:
        wait_until(f"step {SIGNAL_AFTER[cell.program]}", lambda: (run_dir / "events.jsonl").exists()
                   and progress_at_least(run_dir, SIGNAL_AFTER[cell.program]), 240, interval=0.1)
        high = preempt(slurm_cluster)  # GraceTime 0 with the user signal (the default policy): Slurm requeues it
        output = lambda: "\n".join(p.read_text() for p in tmp_path.glob(f"*-{jobid}.out"))  # noqa: E731
        assert final_state(slurm_cluster, jobid, timeout=240) == "COMPLETED", output()[-4000:]
        assert len(runs(slurm_cluster, jobid)) == 2, runs(slurm_cluster, jobid)
        assert not mgpu_trouble(output()), "\n".join(mgpu_trouble(output()))
        (stopped,) = events(run_dir, "preempted")
        assert stopped["step"] % STEPS_PER_EPOCH[cell.program], f"stopped at step {stopped['step']}, an epoch's end"
        assert [e["step"] for e in events(run_dir, "resumed")] == [stopped["step"]]  # no step lost
        state = checkpoint_state(run_dir)
        for key in KEYS[cell.program]:
            assert_identical(state[key], expected[key], key)
    finally:
        for job in (jobid, high):
            if job:
                slurm_cluster.run("scancel", job, check=False)


@pytest.fixture(autouse=True)
def _no_leftover_run_dir_files() -> Iterator[None]:
    """slurm/loop.sbatch announces run directories in .mgpu/ of the submission directory."""
    yield
    for path in (ROOT / ".mgpu").glob("run-dir-*"):
        path.unlink(missing_ok=True)
