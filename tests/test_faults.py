"""Faults on real processes and real gloo groups: full disks during saves, DataLoader workers under
every stop signal, and the resumed world's gradient reduction. Each test fails on the code before the
fix it guards (see the issue's D0, D1, D3)."""

from __future__ import annotations

import os
import random
import re
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from mgpu.state.single.store import CheckpointStore
from mgpu.record.ledger import read_ledger
from tests.conftest import PYTHON, ROOT, base_env, popen_rank, run_world, start_ranks, wait_ranks

TRAIN = str(ROOT / "jobs" / "train.py")

pytestmark = pytest.mark.multiprocess


def ranks(run_dir: Path, *args: str, world: int = 2, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """jobs/train.py on `world` ranks (tests.conftest.run_world: the launcher is not what these tests prove)."""
    return run_world([TRAIN, f"run.dir={run_dir}", *args], world, timeout)


# ------------------------------------------------------------------------------------- D3: full disks
FILLING = ["task.target=tests.tasks:DiskFillingBlobTask", "data.batch_size=4", "train.epochs=3",
           "checkpoint.every_steps=1", "log.every_steps=1", "log.tensorboard=false"]


def test_the_stop_saves_afresh_after_background_saves_failed(small_fs: Callable[[int], Path]) -> None:
    fs = small_fs(2048)
    run_dir = fs / "run"
    # Steps 3-5 meet a full disk (their background saves fail); space is back at step 6; stop at step 8. From
    # step 3 on, each step waits for the writer to be free first (settle_dir): the saves due at 3-5 meet the full
    # disk, those due at 6 and 7 are written.
    result = ranks(run_dir, *FILLING, f"task.args.fill_dir={fs}", "task.args.fill_at=3", "task.args.free_at=6",
                      f"task.args.settle_dir={run_dir / 'checkpoints'}", "--stop-at-step=8")
    assert result.returncode == 3, result.stdout[-3000:]  # stopped (not a Slurm job), not crashed
    failures = re.findall(r"checkpoint step (\d+) not written: disk full \(ENOSPC\) at (\S+);", result.stdout)
    # The disk is full from step 3's loss until step 6: a save being written then fails, whether due at 3-5 or still
    # in flight from step 1 or 2 (a periodic save due while the last is being written is deferred, issue 31: which
    # saves meet the full disk depends on the writer's timing; a fresh clone's CI run saw step 1's); at least one
    # did, and none after space was back.
    steps = {int(step) for step, _ in failures}
    assert steps and max(steps) <= 5, result.stdout[-3000:]
    assert all(path.startswith(str(run_dir / "checkpoints")) for _, path in failures)
    latest = CheckpointStore(run_dir / "checkpoints").latest()
    assert latest is not None and latest.step == 8 and not latest.skipped
    saved = [e["step"] for e in read_ledger(run_dir / "events.jsonl") if e["event"] == "checkpoint_saved"]
    assert saved[-1] == 8 and max(saved[:-1]) >= 6, saved  # saves went on once space was back; the stop's is last


def test_a_stop_that_cannot_save_ends_in_one_line_and_no_requeue(small_fs: Callable[[int], Path]) -> None:
    fs = small_fs(2048)
    run_dir = fs / "run"
    result = ranks(run_dir, *FILLING, f"task.args.fill_dir={fs}", "task.args.fill_at=3", "--stop-at-step=5")
    # Every rank prints the same one line.
    errors = re.findall(r"train: error: .*?step_\d{8}(?:; the newest checkpoint on disk is (?:\S+?step_\d{8}|none))?",
                        result.stdout)
    assert len(errors) == 2 and errors[0] == errors[1], result.stdout[-3000:]
    named = re.fullmatch(r"train: error: checkpoint step 5 not written: disk full \(ENOSPC\) at \S+; the newest "
                         r"checkpoint on disk is (\S+)", errors[0])
    assert named, errors[0]
    # No traceback of ours.
    assert f'File "{ROOT}/mgpu' not in result.stdout and f'File "{ROOT}/jobs' not in result.stdout, result.stdout
    # Exit 2, as for bad input: the batch script does not requeue it into the same wall (mgpu.run.recovery);
    # the ledger, on the same full disk, may not have been able to say so.
    assert result.returncode == 2, result.stdout[-3000:]  # every rank
    failed = [e for e in read_ledger(run_dir / "events.jsonl") if e["event"] == "failed"]
    assert all(e["retry"] is False for e in failed), failed
    # The disk filled up during step 3's loss: the newest durable checkpoint is step 1's or 2's, or none when
    # those were deferred or still being written then (issue 31: a due save waits for no writer); the line names it.
    latest = CheckpointStore(run_dir / "checkpoints").latest()
    if named[1] == "none":
        assert latest is None
    else:
        assert latest is not None and latest.step in (1, 2) and str(latest.path) == named[1]


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # its writer thread's traceback
def test_tensorboard_on_a_full_disk_loses_points_not_the_run(small_fs: Callable[[int], Path],
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    # Seen in the fault matrix (disk-full@evaluation): TensorBoard's writer thread met ENOSPC, its next call
    # raised it in rank 0's training loop, and the run crashed instead of going on as the README says.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mgpu.record.reporting import Reporter
    from tests.conftest import fill

    monkeypatch.setattr("mgpu.record.reporting.REOPEN_AFTER_S", 0.0)  # reopen at the next log interval
    fs = small_fs(512)
    reporter = Reporter(True, fs / "tb", total_steps=400, resume_step=0, progress_bar="off")
    metrics = {f"metric_{i}": float(i) for i in range(8)}
    reporter.scalars(1, metrics, "train")
    ballast = fill(fs)
    for step in range(2, 300):  # far more than the slack of the event file's last page
        reporter.scalars(step, metrics, "train")
    ballast.unlink()
    for step in range(300, 303):
        reporter.scalars(step, metrics, "train")
    reporter.close()
    warnings = [r.getMessage() for r in caplog.records if "TensorBoard: cannot write" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings
    events = EventAccumulator(str(fs / "tb"))
    events.Reload()
    steps = {e.step for e in events.Scalars("train/metric_0")}
    assert 1 in steps and {300, 301, 302} <= steps, sorted(steps)


# ---------------------------------------------------------------------------- D1: DataLoader workers
def start_step(run_dir: Path, world: int, *args: str) -> list[subprocess.Popen[str]]:
    """`world` ranks of jobs/train.py as slurmstepd runs a step's tasks (see tests.conftest.start_ranks)."""
    return start_ranks([TRAIN, f"run.dir={run_dir}", *args], world)


def finish_step(procs: list[subprocess.Popen[str]], timeout: float = 120) -> list[tuple[int, str]]:
    return wait_ranks(procs, timeout)


WORKERS = ["task.target=tests.tasks:SignalingBlobTask", "task.args.step_s=0.05", "train.epochs=20",
           "data.batch_size=4", "data.num_workers=2", "log.every_steps=1", "eval.every_steps=4",
           "task.args.eval_size=40", "data.eval_batch_size=2", "preemption.check_every_steps=1"]


# Every stop signal once, and each place a stop lands (mid-step; inside the 2nd evaluation) under two of them:
# the worker's survival depends on the signal reaching it and on where the loader is, not on the pair (the
# 8 pairs this once ran were 4 repeats). docs/testing.md: "DataLoader workers survive every stop signal".
@pytest.mark.parametrize("signals, where, at", [("TERM", "loss", 6), ("USR2", "metrics", 5), ("INT", "metrics", 5),
                                               ("USR2+TERM", "loss", 6)])
def test_workers_survive_every_stop_signal(signals: str, where: str, at: int, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    procs = start_step(run_dir, 2, *WORKERS, f"task.args.signals={signals}", f"task.args.where={where}",
                       f"task.args.at={at}", "task.args.eval_step_s=0.05")
    results = finish_step(procs)
    outputs = "\n".join(out for _, out in results)
    assert "DataLoader worker" not in outputs, outputs[-3000:]
    assert [rc for rc, _ in results] == [3, 0], outputs[-3000:]  # stopped: rank 0 says so, not a Slurm job
    steps = [int(s) for s in re.findall(r"stopping at step (\d+)", (run_dir / "logs" / "rank0.log").read_text()
                                        + (run_dir / "logs" / "rank1.log").read_text())]
    assert len(steps) == 2 and steps[0] == steps[1], steps
    latest = CheckpointStore(run_dir / "checkpoints").latest()
    assert latest is not None and latest.step == steps[0]
    (preempted,) = [e for e in read_ledger(run_dir / "events.jsonl") if e["event"] == "preempted"]
    names = {"TERM": "sigterm", "USR2": "requeue_signal", "INT": "interrupt"}
    assert set(preempted["reasons"]) == {names[s] for s in signals.split("+")}, preempted


# A worker that dies once the stop is requested (the OOM killer, say) would make the next fetch raise on that
# rank; the loader goes on in the training process instead, and the stop ends as any other. 400 samples: one
# epoch of 50 steps, so the dead worker's batch is needed long before the agreement at step 16 stops the run.
DYING = ["task.target=tests.e2e.jobtasks:WorkerDeathAfterStopTask", "task.args.step_s=0.05", "task.args.size=400",
         "train.epochs=1", "data.batch_size=4", "data.num_workers=2", "log.every_steps=1",
         "preemption.check_every_steps=16", "checkpoint.keep_last=10", "log.tensorboard=false"]


def test_a_worker_that_dies_after_the_stop_signal_ends_in_the_stop(tmp_path: Path) -> None:
    from tests.test_trainer import assert_identical

    reference = tmp_path / "reference"
    done = finish_step(start_step(reference, 2, *DYING, "task.args.at=0"))
    assert [rc for rc, _ in done] == [0, 0], done[0][1][-3000:]
    run_dir = tmp_path / "run"
    marks = ["task.args.signals=TERM", "task.args.at=3", f"task.args.once_file={tmp_path / 'signalled'}",
             f"task.args.claim_file={tmp_path / 'killed'}"]
    results = finish_step(start_step(run_dir, 2, *DYING, *marks))
    outputs = "\n".join(out for _, out in results)
    assert [rc for rc, _ in results] == [3, 0], outputs[-3000:]  # stopped (not a Slurm job), not crashed
    assert (tmp_path / "killed").exists(), "no worker was killed"
    logs = [(run_dir / "logs" / f"rank{rank}.log").read_text() for rank in range(2)]
    assert any("after a stop was requested: loading the rest in this process" in log for log in logs), logs
    steps = [int(s) for log in logs for s in re.findall(r"stopping at step (\d+)", log)]
    assert len(steps) == 2 and steps[0] == steps[1] > 3, steps
    latest = CheckpointStore(run_dir / "checkpoints").latest()
    assert latest is not None and latest.step == steps[0] and not latest.skipped
    resumed = finish_step(start_step(run_dir, 2, *DYING, *marks))  # the marks exist: no signal, no death now
    assert [rc for rc, _ in resumed] == [0, 0], resumed[0][1][-3000:]
    final, expected = (CheckpointStore(d / "checkpoints").latest().state for d in (run_dir, reference))
    assert final["progress"]["step"] == expected["progress"]["step"] == 50
    assert_identical(final["model"], expected["model"], "model")
    assert_identical(final["optimizer"], expected["optimizer"], "optimizer")


# ------------------------------------------------ D12: per-sample augmentation in workers, across a resume
AUGMENTED = ["task.target=tests.tasks:AugmentedBlobTask", "train.epochs=2", "data.batch_size=3",
             "data.num_workers=2", "log.every_steps=1", "checkpoint.keep_last=10"]


@pytest.fixture(scope="module")
def augmented_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("augmented")
    result = ranks(run_dir, *AUGMENTED)
    assert result.returncode == 0, result.stdout[-3000:]
    return CheckpointStore(run_dir / "checkpoints").latest().state


# Mid-epoch 1 (7 steps per epoch): the workers' per-sample draws of a later epoch, after an epoch boundary.
# (A mid-epoch-0 stop with workers: test_own_loop's mid-epoch case and the fault matrix's w2 scenarios.)
@pytest.mark.parametrize("stop_at", [5])
def test_augmentation_in_workers_resumes_bit_identically(stop_at: int, augmented_reference: dict,
                                                         tmp_path: Path) -> None:
    from tests.test_trainer import assert_identical

    first = ranks(tmp_path, *AUGMENTED, f"--stop-at-step={stop_at}")
    assert first.returncode == 3, first.stdout[-3000:]
    second = ranks(tmp_path, *AUGMENTED)
    assert second.returncode == 0, second.stdout[-3000:]
    resumed = CheckpointStore(tmp_path / "checkpoints").latest().state
    assert resumed["progress"]["step"] == augmented_reference["progress"]["step"]
    assert_identical(resumed["model"], augmented_reference["model"], "model")
    assert_identical(resumed["optimizer"], augmented_reference["optimizer"], "optimizer")


# --------------------------------------------------- D0: 4 ranks, default DDP settings, bit-identical resume
# 40 samples, 2 per rank, 4 ranks, 2 micro-steps per step: 3 steps per epoch (the last one short), 6 in all.
# Batch norm, dropout, warmup + cosine, clipping; DDP with its defaults (no find_unused_parameters).
FOUR = ["task.target=tests.tasks:BlobTask", "train.epochs=2", "data.batch_size=2", "train.grad_accum=2",
        "train.clip_grad_norm=1.0", "schedule.name=cosine", "schedule.warmup_steps=2", "log.every_steps=1",
        "optim.lr=0.01", "checkpoint.keep_last=10", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def four_rank_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("four")
    result = ranks(run_dir, *FOUR, world=4, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    return CheckpointStore(run_dir / "checkpoints").latest().state


@pytest.mark.parametrize("stop_at", [1, 4])  # the step before DDP's bucket rebuild; mid-epoch 1
def test_four_ranks_resume_bit_identically_with_default_ddp(stop_at: int, four_rank_reference: dict,
                                                            tmp_path: Path) -> None:
    from tests.test_trainer import assert_identical

    first = ranks(tmp_path, *FOUR, f"--stop-at-step={stop_at}", world=4, timeout=300)
    assert first.returncode == 3, first.stdout[-3000:]
    second = ranks(tmp_path, *FOUR, world=4, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:]
    resumed = CheckpointStore(tmp_path / "checkpoints").latest().state
    assert resumed["progress"]["step"] == four_rank_reference["progress"]["step"] == 6
    assert_identical(resumed["model"], four_rank_reference["model"], "model")
    assert_identical(resumed["optimizer"], four_rank_reference["optimizer"], "optimizer")


# ------------------------------------------------- D16: a stop lands inside a long evaluation, and resumes
SLOW_EVAL = ["task.target=tests.tasks:SignalingBlobTask", "task.args.step_s=0.02", "train.epochs=2",
             "data.batch_size=4", "log.every_steps=1", "eval.every_steps=3", "task.args.eval_size=40",
             "data.eval_batch_size=2", "task.args.eval_step_s=0.2", "preemption.check_every_steps=1",
             "checkpoint.keep_last=10", "task.args.where=metrics", "log.tensorboard=false"]


def test_a_stop_inside_a_long_evaluation_is_not_held_to_its_end(tmp_path: Path) -> None:
    from tests.test_trainer import assert_identical

    reference = tmp_path / "reference"
    assert [rc for rc, _ in finish_step(start_step(reference, 2, *SLOW_EVAL, "task.args.at=0"))] == [0, 0]
    run_dir = tmp_path / "run"
    # Metrics call 1 is the start-up check; the first evaluation (step 3) makes calls 2-11 on rank 0.
    once = ["task.args.signals=TERM", "task.args.at=4", f"task.args.once_file={tmp_path / 'fired'}"]
    results = finish_step(start_step(run_dir, 2, *SLOW_EVAL, *once))
    assert [rc for rc, _ in results] == [3, 0], results[0][1][-3000:]
    log0 = (run_dir / "logs" / "rank0.log").read_text()
    assert "stopping at step 3 (sigterm" in log0, log0[-2000:]
    calls = int(re.findall(r"metrics call (\d+)", results[0][1])[-1])
    assert calls <= 6, f"the evaluation ran on to call {calls} after the stop at call 4"  # 10 batches otherwise
    ledger = read_ledger(run_dir / "events.jsonl")
    assert [e["event"] for e in ledger if e["event"] in ("evaluated", "preempted")] == ["preempted"]
    assert CheckpointStore(run_dir / "checkpoints").latest().state["progress"]["eval_pending"] is True
    resumed = finish_step(start_step(run_dir, 2, *SLOW_EVAL, *once))
    assert [rc for rc, _ in resumed] == [0, 0], resumed[0][1][-3000:]
    ours = read_ledger(run_dir / "events.jsonl")
    theirs = read_ledger(reference / "events.jsonl")
    evaluations = [(e["step"], e["metrics"]) for e in ours if e["event"] == "evaluated"]
    assert evaluations == [(e["step"], e["metrics"]) for e in theirs if e["event"] == "evaluated"]
    final, expected = (CheckpointStore(d / "checkpoints").latest().state for d in (run_dir, reference))
    assert_identical(final["model"], expected["model"], "model")
    assert final["progress"] == expected["progress"]


# ---------------------------------------------------------------------- D4: only rank 0 asks Slurm
def test_only_rank_0_asks_slurm_after_a_stop(tmp_path: Path) -> None:
    # Workers of torchrun in a Slurm job of this test process (its pid as SLURM_TASK_PID, as slurmstepd sets
    # it), and no scontrol on PATH: rank 0 must ask Slurm (and says in one line it got no answer: exit 5, not the
    # bad input's 2); rank 1 must not.
    job = {"SLURM_JOB_ID": str(random.randint(10**6, 10**7)), "SLURM_TASK_PID": str(os.getpid()),
           "TORCHELASTIC_RUN_ID": "test", "PATH": str(Path(PYTHON).parent)}
    port, procs = str(random.SystemRandom().randint(20000, 32000)), []
    for rank in range(2):
        env = base_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **job)
        procs.append(popen_rank([TRAIN, f"run.dir={tmp_path}", "task.target=tests.tasks:BlobTask", "data.batch_size=4",
                                 "--stop-at-step=2"], env))
    (rc0, out0), (rc1, out1) = finish_step(procs)
    assert rc0 == 5 and "scontrol not found on PATH" in out0, out0[-2000:]
    assert rc1 == 0 and "scontrol" not in out1, out1[-2000:]
    assert CheckpointStore(tmp_path / "checkpoints").latest().step == 2
