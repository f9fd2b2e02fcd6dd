"""The stop protocol with real processes: a signal to one rank stops every rank at the same step with
one checkpoint; signals during a checkpoint write; the requeue budget; a missing scontrol."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from mgpu.state.single.store import CheckpointStore
from mgpu.record.ledger import read_ledger
from tests.conftest import PYTHON, ROOT, Rank, base_env, start_ranks, wait_ranks
from tests.test_environment import srun_task

TRAIN = str(ROOT / "jobs" / "train.py")
SLOW = ["task.target=tests.tasks:SlowBlobTask", "task.args.step_s=0.1", "train.epochs=50", "data.batch_size=4",
        "log.every_steps=1"]


def trained(run_dir: Path, procs: list[Rank], timeout: float = 60) -> None:
    """Wait until the ranks have trained a step (its progress event is in the ledger)."""
    deadline = time.monotonic() + timeout
    while not [e for e in read_ledger(run_dir / "events.jsonl") if e["event"] == "progress"]:
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "no step trained"
        time.sleep(0.05)


def stop_steps(run_dir: Path, world: int) -> list[int]:
    steps = []
    for rank in range(world):
        found = re.findall(r"stopping at step (\d+)", (run_dir / "logs" / f"rank{rank}.log").read_text())
        assert len(found) == 1, f"rank {rank} stopped {len(found)} times"
        steps.append(int(found[0]))
    return steps


def start(run_dir: Path, *args: str) -> list[Rank]:
    """Two ranks of jobs/train.py, as srun starts a step's tasks (tests.conftest.start_ranks)."""
    return start_ranks([TRAIN, f"run.dir={run_dir}", *args], 2)


def finish(procs: list[Rank], timeout: float = 120) -> tuple[list[int], str]:
    """Each rank's exit code, and their output."""
    results = wait_ranks(procs, timeout)
    return [rc for rc, _ in results], "".join(out for _, out in results)


def end(procs: list[Rank]) -> None:
    """Kill the ranks still running (a test that failed before they finished)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.multiprocess
@pytest.mark.parametrize("signame", ["SIGUSR2", "SIGTERM"])
def test_signal_to_one_rank_stops_all_at_the_same_step(signame: str, tmp_path: Path) -> None:
    procs = start(tmp_path, *SLOW)
    try:
        trained(tmp_path, procs)  # mid-training, not during start-up: no fixed sleep
        procs[1].send_signal(getattr(signal, signame))
        codes, out = finish(procs)
    finally:
        end(procs)
    steps = stop_steps(tmp_path, 2)
    assert steps[0] == steps[1] > 0, out
    events = read_ledger(tmp_path / "events.jsonl")
    # One checkpoint of the stop step (the stop's own, or the epoch's when the stop fell on an epoch end).
    saves_at_stop = [e for e in events if e["event"] == "checkpoint_saved" and e["step"] == steps[0]]
    assert len(saves_at_stop) == 1 and CheckpointStore(tmp_path / "checkpoints").latest().step == steps[0]
    assert [e["step"] for e in events if e["event"] == "stop_decision"] == [steps[0]]
    assert [e["signals"] for e in events if e["event"] == "preempted"] == [[]]  # rank 0 got no signal itself
    assert codes == [3, 0], out  # not a Slurm job: stopped, not requeued


@pytest.mark.multiprocess
def test_signals_during_checkpoint_writes_do_not_corrupt(tmp_path: Path) -> None:
    # A 40 MB buffer makes every save take a while; async saves every step, signals every 20 ms.
    procs = start(tmp_path, *SLOW, "task.args.step_s=0.02", "task.args.ballast_mb=40", "checkpoint.every_steps=1",
                  "checkpoint.keep_last=3")
    try:
        trained(tmp_path, procs)  # the window below starts once the ranks train (and save), not at their start
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and procs[0].poll() is None:
            if any(p.name.startswith(".tmp-") for p in (tmp_path / "checkpoints").glob(".tmp-*")):
                procs[0].send_signal(signal.SIGUSR2)
            time.sleep(0.02)
        _, out = finish(procs)
    finally:
        end(procs)
    steps = stop_steps(tmp_path, 2)
    store = CheckpointStore(tmp_path / "checkpoints")
    latest = store.latest()
    assert latest is not None and latest.step == steps[0] and not latest.skipped, out
    for step in store.list_steps():  # every complete checkpoint on disk verifies
        assert CheckpointStore.load_dir(tmp_path / "checkpoints" / f"step_{step:08d}").step == step
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    saves = [e for e in read_ledger(tmp_path / "events.jsonl") if e["event"] == "checkpoint_saved"]
    assert len({e["step"] for e in saves}) == len(saves), "a step was saved twice"


def slurm_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = base_env(**srun_task(0, 0, 0, SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1", SLURM_JOB_NODELIST="localhost",
                               SLURM_STEP_NODELIST="localhost", SLURM_JOB_NUM_NODES="1", SLURM_STEP_NUM_NODES="1",
                               SLURM_TASKS_PER_NODE="1", SLURM_STEP_TASKS_PER_NODE="1", SLURM_NTASKS_PER_NODE="1",
                               SLURM_JOB_ID=str(random.randint(10**6, 10**7))))
    # As slurmstepd would set it: the task's pid. This test process is the task's parent here, which
    # makes the variables this job's own for mgpu.cluster.slurm_job (a foreign SLURM_JOB_ID is never acted on).
    env["SLURM_TASK_PID"] = str(os.getpid())
    env.update(extra)
    return env


@pytest.mark.multiprocess
def test_requeue_budget_is_honoured(tmp_path: Path) -> None:
    env = slurm_env(tmp_path, SLURM_RESTART_COUNT="3", MGPU_MAX_REQUEUES="2")
    result = subprocess.run([PYTHON, TRAIN, f"run.dir={tmp_path}", "task.target=tests.tasks:BlobTask"], env=env,
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    assert "requeue budget exhausted: this is restart 3 of at most 2" in result.stderr
    assert not (tmp_path / "checkpoints").exists()  # did not train
    assert read_ledger(tmp_path / "events.jsonl")[-1]["event"] == "failed"


@pytest.mark.multiprocess
def test_missing_scontrol_after_a_stop_is_a_clear_line_and_not_bad_input(tmp_path: Path) -> None:
    # A container without Slurm's client commands: only the venv's programs on PATH. Not exit 2 (bad input, which
    # mgpu.run.recovery never requeues): UNANSWERED_EXIT_CODE, and the batch script outside the container asks again.
    env = slurm_env(tmp_path, PATH=str(Path(PYTHON).parent))
    result = subprocess.run([PYTHON, TRAIN, f"run.dir={tmp_path}", "task.target=tests.tasks:BlobTask",
                             "data.batch_size=8", "--stop-at-step=2"], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 5, result.stdout + result.stderr
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and "scontrol not found on PATH" in errors[0]
    assert CheckpointStore(tmp_path / "checkpoints").latest().step == 2  # the checkpoint is kept


@pytest.mark.multiprocess
def test_a_foreign_slurm_job_id_is_never_asked_about(tmp_path: Path) -> None:
    # SLURM_JOB_ID left in a shell from another job (no slurmstepd above us, a task pid that is not ours):
    # the stop must not query or requeue that job. No scontrol on PATH: asking would fail loudly.
    env = slurm_env(tmp_path, PATH=str(Path(PYTHON).parent), SLURM_TASK_PID="1")
    result = subprocess.run([PYTHON, TRAIN, f"run.dir={tmp_path}", "task.target=tests.tasks:BlobTask",
                             "data.batch_size=8", "--stop-at-step=2"], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "not a Slurm job" in result.stderr and "scontrol" not in result.stderr
    (decision,) = [e for e in read_ledger(tmp_path / "events.jsonl") if e["event"] == "stop_decision"]
    assert (decision["what"], decision["requeue"]) == ("not_slurm", False)


@pytest.mark.multiprocess
def test_a_bug_in_the_task_keeps_its_traceback_under_one_line_that_says_what_now(tmp_path: Path) -> None:
    result = subprocess.run([PYTHON, TRAIN, f"run.dir={tmp_path}", "task.target=tests.e2e.jobtasks:BuggyBlobTask",
                             "task.args.fail_after=2", "task.args.step_s=0", "log.tensorboard=false"],
                            env=base_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert "Traceback (most recent call last):" in lines and lines[-2].startswith("ValueError: bug in the training")
    assert re.fullmatch(r"train: the task's code raised ValueError at tests/e2e/jobtasks\.py:\d+ in loss; not a Slurm "
                        r"job, so nothing requeues it: fix it, then cd .* && \S*python\S* .*jobs/train\.py .*",
                        lines[-1]), lines[-1]


@pytest.mark.multiprocess
def test_a_slurm_jobs_bug_says_it_will_be_requeued(tmp_path: Path) -> None:
    env = slurm_env(tmp_path, MGPU_MAX_FAILURES="2", MGPU_RECOVERY="batch")  # the batch script requeues it
    result = subprocess.run([PYTHON, TRAIN, f"run.dir={tmp_path}", "task.target=tests.e2e.jobtasks:BuggyBlobTask",
                             "task.args.fail_after=2", "task.args.step_s=0", "log.tensorboard=false"],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].endswith(
        "the job starts again in this allocation from its last checkpoint (failure restart 1 of 2), unless it "
        "was cancelled")


@pytest.mark.multiprocess
def test_a_state_a_resume_could_not_load_fails_at_the_first_save(tmp_path: Path) -> None:
    # Days of training would otherwise save it fine and fail only at the first resume.
    result = subprocess.run([PYTHON, TRAIN, f"run.dir={tmp_path}", "task.target=tests.tasks:UnloadableStateTask",
                             "checkpoint.every_steps=2", "train.epochs=3", "log.every_steps=1", "log.tensorboard=false"],
                            env=base_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("train: error: checkpoint state.model._extra_state.tokenizer holds a Opaque, which a "
                           "resume cannot load with torch.load(weights_only=True)"), line
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").glob("step_*"))
    steps = [e["step"] for e in read_ledger(tmp_path / "events.jsonl") if e["event"] == "progress"]
    assert max(steps) == 2  # it stopped at the first save, not after training on
