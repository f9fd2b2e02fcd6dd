"""The training loop end to end, through jobs/train.py: exact resume, world-size change, corrupted
checkpoints, TensorBoard across a resume, config errors. Real processes, real gloo groups."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mgpu.state.single.store import CheckpointStore
from mgpu.record.ledger import read_ledger
from tests.conftest import PYTHON, ROOT, base_env, run_processes, run_world

TRAIN = str(ROOT / "jobs" / "train.py")
# 40 samples, 3 per rank, 2 ranks, 2 micro-steps per step: 4 steps per epoch (the last one has a single
# micro-step of 4 samples), 12 in all. Warmup, cosine, clipping, dropout and batch norm all in play.
BLOBS = ["task.target=tests.tasks:BlobTask", "train.epochs=3", "data.batch_size=3", "train.grad_accum=2",
         "train.clip_grad_norm=1.0", "schedule.name=cosine", "schedule.warmup_steps=3", "log.every_steps=1",
         "checkpoint.keep_last=10", "optim.lr=0.01"]


def train(run_dir: Path, *args: str, ranks: int = 1, timeout: float = 120,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """jobs/train.py on `ranks` ranks (RANK/WORLD_SIZE, as srun starts them: the launcher is not what these tests
    prove); its exit code is the ranks' common one, its output theirs in rank order."""
    if ranks > 1:
        return run_world([TRAIN, f"run.dir={run_dir}", *args], ranks, timeout, env)
    (result,) = run_processes([([PYTHON, TRAIN, f"run.dir={run_dir}", *args], base_env(**(env or {})))],
                              timeout=timeout)
    return result


def final_state(run_dir: Path) -> dict[str, Any]:
    loaded = CheckpointStore(run_dir / "checkpoints").latest()
    assert loaded is not None, f"no checkpoint in {run_dir}"
    return loaded.state


def assert_identical(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for key in a:
            assert_identical(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("unbroken")
    result = train(run_dir, *BLOBS, ranks=2)
    assert result.returncode == 0, result.stdout
    return final_state(run_dir)


@pytest.mark.multiprocess
# The first step, the last step of epoch 0, mid-epoch 2 (step 2, a second mid-epoch-0 stop, proved nothing
# step 1 does not).
@pytest.mark.parametrize("stop_at", [1, 4, 9])
def test_resume_is_bit_identical(stop_at: int, uninterrupted: dict[str, Any], tmp_path: Path) -> None:
    first = train(tmp_path, *BLOBS, f"--stop-at-step={stop_at}", ranks=2)
    assert first.returncode == 3, first.stdout  # every rank: stopped
    assert final_state(tmp_path)["progress"]["step"] == stop_at
    # The ranks ended with os._exit (mgpu.stop.process_exit): what they wrote last is all there, read back.
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == list(range(1, stop_at + 1))
    for rank in (0, 1):
        assert f"stopped at step {stop_at} (run directory" in (tmp_path / "logs" / f"rank{rank}.log").read_text()
    second = train(tmp_path, *BLOBS, ranks=2)
    assert second.returncode == 0, second.stdout
    resumed = final_state(tmp_path)
    assert resumed["progress"]["step"] == uninterrupted["progress"]["step"] == 12
    assert_identical(resumed["model"], uninterrupted["model"], "model")
    assert_identical(resumed["optimizer"], uninterrupted["optimizer"], "optimizer")
    assert_identical(resumed["scheduler"], uninterrupted["scheduler"], "scheduler")
    events = read_ledger(tmp_path / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "resumed"] == [stop_at]
    assert [e["step"] for e in events if e["event"] == "preempted"] == [stop_at]


def read_ids(directory: Path, world: int, remainder: int) -> list[int]:
    """Every trained sample id. When the epoch's last global batch has fewer samples than ranks
    (`remainder` < world), ranks >= remainder train on one zero-weight padding sample (mgpu.data.sampling):
    their last line is not a sample seen."""
    ids = []
    for rank in range(world):
        lines = (directory / f"ids-rank{rank}.txt").read_text().splitlines()
        if 0 < remainder < world and rank >= remainder:
            lines = lines[:-1]
        ids += [int(i) for line in lines for i in line.split()]
    return ids


@pytest.mark.multiprocess
@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_world_size_change_sees_every_sample_once(before: int, after: int, tmp_path: Path) -> None:
    ids_dir = tmp_path / "ids"
    ids_dir.mkdir()
    # No batch norm: the epoch's last batches have a single sample on some rank (40 = 13 * 3 + 1).
    run = ["task.target=tests.tasks:BlobTask", f"task.args.ids_dir={ids_dir}", "task.args.batch_norm=false",
           "train.epochs=1",
           "data.batch_size=3", "checkpoint.every_steps=1", "log.every_steps=1"]
    first = train(tmp_path / "run", *run, "--stop-at-step=3", ranks=before)
    assert "step 3/" in first.stdout and final_state(tmp_path / "run")["progress"]["step"] == 3, first.stdout
    seen_before = read_ids(ids_dir, before, 0)
    assert len(seen_before) == 3 * 3 * before
    for path in ids_dir.iterdir():
        path.unlink()
    second = train(tmp_path / "run", *run, ranks=after)
    assert second.returncode == 0, second.stdout
    seen_after = read_ids(ids_dir, after, (40 - len(seen_before)) % (3 * after))
    both = seen_before + seen_after
    assert sorted(both) == list(range(40)), "a sample was seen twice or skipped"
    assert final_state(tmp_path / "run")["world_size"] == after


@pytest.mark.multiprocess
def test_corrupted_latest_falls_back_to_previous(tmp_path: Path) -> None:
    run = ["task.target=tests.tasks:BlobTask", "train.epochs=2", "data.batch_size=8", "checkpoint.keep_last=5"]
    assert train(tmp_path, *run).returncode == 0
    store = CheckpointStore(tmp_path / "checkpoints")
    steps = store.list_steps()
    assert steps == [5, 10]
    bad = tmp_path / "checkpoints" / "step_00000010" / "state.pt"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern, same size
    bad.write_bytes(bytes(data))
    # One more epoch (a safe change): it must resume from step 5, name the bad file, and finish.
    result = train(tmp_path, *run[:1], "train.epochs=3", *run[2:])
    assert result.returncode == 0, result.stdout
    assert str(bad.parent) in result.stdout
    resumed = [e for e in read_ledger(tmp_path / "events.jsonl") if e["event"] == "resumed"]
    assert resumed[-1]["step"] == 5 and str(bad.parent) in json.dumps(resumed[-1]["skipped"])
    assert final_state(tmp_path)["progress"]["step"] == 15


@pytest.mark.multiprocess
def test_truncated_latest_falls_back_to_previous(tmp_path: Path) -> None:
    run = ["task.target=tests.tasks:BlobTask", "train.epochs=2", "data.batch_size=8"]
    assert train(tmp_path, *run).returncode == 0
    bad = tmp_path / "checkpoints" / "step_00000010" / "state.pt"
    bad.write_bytes(bad.read_bytes()[:100])
    result = train(tmp_path, *run)
    assert result.returncode == 0 and str(bad.parent) in result.stdout, result.stdout
    resumed = [e for e in read_ledger(tmp_path / "events.jsonl") if e["event"] == "resumed"]
    assert resumed[-1]["step"] == 5


@pytest.mark.multiprocess
def test_one_sample_batch_norm_batch_is_refused_up_front(tmp_path: Path) -> None:
    result = train(tmp_path, "task.target=tests.tasks:BlobTask", "data.batch_size=3")  # 40 = 13 * 3 + 1
    assert result.returncode == 2 and "one-sample batch" in result.stdout, result.stdout


@pytest.mark.multiprocess
def test_unsafe_config_change_on_resume_is_refused(tmp_path: Path) -> None:
    run = ["task.target=tests.tasks:BlobTask", "train.epochs=1", "data.batch_size=8"]
    assert train(tmp_path, *run).returncode == 0
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "checkpoints").iterdir())
    config = (tmp_path / "config.yaml").read_text()
    result = train(tmp_path, *run, "optim.momentum=0.5")
    assert result.returncode == 2
    errors = [line for line in result.stdout.splitlines() if "error" in line]
    assert len(errors) == 1 and "optim.momentum" in errors[0], result.stdout
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "checkpoints").iterdir()) == before
    assert (tmp_path / "config.yaml").read_text() == config  # the refused run did not overwrite it (D11)


@pytest.mark.multiprocess
def test_an_lr_change_on_resume_is_applied_and_recorded(tmp_path: Path) -> None:
    # The documented way to change the LR of a running run: optim.lr on the resumed command (it was refused).
    run = ["task.target=tests.tasks:BlobTask", "data.batch_size=8", "log.every_steps=1"]
    assert train(tmp_path, *run, "train.epochs=1").returncode == 0
    result = train(tmp_path, *run, "train.epochs=2", "optim.lr=0.5")
    assert result.returncode == 0, result.stdout
    events = read_ledger(tmp_path / "events.jsonl")
    (change,) = [e for e in events if e["event"] == "hyperparameters"]
    assert change["step"] == 5 and change["changes"] == ["optimizer lr: 0.001 -> 0.5"], change
    assert {e["metrics"]["lr"] for e in events if e["event"] == "progress" and e["step"] > 5} == {0.5}
    assert "hyperparameters changed at step 5: optimizer lr: 0.001 -> 0.5" in result.stdout


@pytest.mark.multiprocess
def test_tensorboard_curve_never_overlaps_across_a_resume(tmp_path: Path) -> None:
    run = ["task.target=tests.tasks:SlowBlobTask", "task.args.step_s=0.05", "train.epochs=2", "data.batch_size=2",
           "log.every_steps=1", "checkpoint.every_steps=4", "checkpoint.async_save=false"]
    cmd = [PYTHON, TRAIN, f"run.dir={tmp_path}", *run]
    proc = subprocess.Popen(cmd, env=base_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        for line in proc.stdout:  # killed after step 7's line, 3 steps past the step-4 checkpoint
            if "step 7/" in line or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert final_state(tmp_path)["progress"]["step"] == 4
    assert train(tmp_path, *run).returncode == 0
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    steps = [event.step for event in events.Scalars("train/loss")]
    assert steps == sorted(set(steps)), f"loss steps not strictly increasing: {steps}"
    assert steps == list(range(1, 41))


MALFORMED = [
    ("trian:\n  epochs: 1\n", [], "did you mean 'train'"),
    ("train:\n  epoch: 1\n", [], "did you mean 'train.epochs'"),
    ("optim:\n  lr: abc\n", [], "optim.lr: expected float, got 'abc'"),
    ("data:\n  batch_size: 2.5\n", [], "data.batch_size"),
    ("data:\n  batch_size: -4\n", [], "data.batch_size"),
    ("train:\n  precision: fp8\n", [], "train.precision"),
    ("eval:\n  mode: minimum\n", [], "eval.mode"),
    ("task:\n  target: no_colon\n", [], "task.target"),
    ("preemption:\n  signal: USR1\n", [], "preemption.signal"),
    ("train: [1, 2\n", [], "YAML"),
    ("- a list\n", [], "mapping"),
    ("", ["train.epochs"], "train.epochs"),
    ("", ["train.epochs=many"], "train.epochs"),
    ("task:\n  target: tests.no_such_module:Task\n", [], "tests.no_such_module"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("text, overrides, message", MALFORMED)
def test_malformed_config_fails_in_one_line_before_any_group(text: str, overrides: list[str], message: str,
                                                             tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    run_dir = tmp_path / "run"
    result = subprocess.run([PYTHON, TRAIN, "--config", str(config), f"run.dir={run_dir}", *overrides],
                            env=base_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not run_dir.exists(), "something was created before the config was validated"


@pytest.mark.multiprocess
def test_missing_config_file(tmp_path: Path) -> None:
    result = subprocess.run([PYTHON, TRAIN, "--config", str(tmp_path / "nope.yaml")], env=base_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "nope.yaml" in result.stderr and len(result.stderr.splitlines()) == 1


@pytest.mark.multiprocess
def test_zero_optimizer_resume_is_bit_identical(tmp_path: Path) -> None:
    """ZeroRedundancyOptimizer shards Adam's state; the checkpoint consolidates it on rank 0."""
    run = ["task.target=tests.tasks:BlobTask", "train.epochs=2", "data.batch_size=4", "optim.zero=true",
           "train.sync_batchnorm=true"]  # SyncBatchNorm has no CPU kernel: logged and ignored here
    assert train(tmp_path / "unbroken", *run, ranks=2).returncode == 0
    first = train(tmp_path / "resumed", *run, "--stop-at-step=3", ranks=2)
    assert "sync_batchnorm ignored" in first.stdout
    assert train(tmp_path / "resumed", *run, ranks=2).returncode == 0
    unbroken, resumed = final_state(tmp_path / "unbroken"), final_state(tmp_path / "resumed")
    assert resumed["progress"]["step"] == 10
    assert_identical(resumed["model"], unbroken["model"], "model")
    assert_identical(resumed["optimizer"], unbroken["optimizer"], "optimizer")


@pytest.fixture(scope="module")
def warmup_bf16_on_cpu(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """2 CPU ranks, 5 steps, warmup over 4, log every step, train.precision=bf16: (run dir, rank 0's stdout)."""
    run_dir = tmp_path_factory.mktemp("warmup")
    result = train(run_dir, "task.target=tests.tasks:BlobTask", "train.epochs=1", "data.batch_size=4",
                   "schedule.warmup_steps=4", "optim.lr=0.01", "log.every_steps=1", "train.precision=bf16",
                   "eval.every_steps=0", ranks=2)
    assert result.returncode == 0, result.stdout
    return run_dir, result.stdout


@pytest.mark.multiprocess
def test_the_logged_lr_is_the_steps_own(warmup_bf16_on_cpu: tuple[Path, str]) -> None:
    # Warmup: step k (1-based) trains at lr * k / 4; the ledger once said the next step's (step 1: 0.005).
    run_dir, _ = warmup_bf16_on_cpu
    logged = {e["step"]: e["metrics"]["lr"] for e in read_ledger(run_dir / "events.jsonl") if e["event"] == "progress"}
    assert [logged[step] for step in (1, 2, 3, 4)] == [0.0025, 0.005, 0.0075, 0.01], logged


@pytest.mark.multiprocess
def test_bf16_on_cpu_ranks_says_so_in_one_line(warmup_bf16_on_cpu: tuple[Path, str]) -> None:
    run_dir, stdout = warmup_bf16_on_cpu
    line = "train.precision=bf16: this rank has no GPU; training runs in fp32"
    assert stdout.count(line) == 1, stdout  # rank 0's console: one line, not one per rank
    assert (run_dir / "logs" / "rank0.log").read_text().count(line) == 1
    assert line not in (run_dir / "logs" / "rank1.log").read_text()


@pytest.mark.multiprocess
def test_a_resume_on_fewer_ranks_warns_and_its_advice_can_be_followed(tmp_path: Path) -> None:
    """Saved on 2 ranks (3 a rank x 2 micro-steps: 12 samples a step, 4 steps an epoch of 42), resumed on 1: without
    data.global_batch_size the step halves and the run lengthens, said in a warning that names
    data.global_batch_size=12; set so (train.grad_accum=1), it is accepted (not refused as a changed key), the
    step stays 12 samples and the run 12 steps."""
    import shutil

    blobs = [*BLOBS, "task.args.size=42"]  # 42: no one-sample batch for BatchNorm on 1 rank either
    first = train(tmp_path / "run", *blobs, "--stop-at-step=2", ranks=2, timeout=240)
    assert first.returncode == 3, first.stdout
    shutil.copytree(tmp_path / "run", tmp_path / "kept")
    halved = train(tmp_path / "run", *blobs, "train.max_steps=3", timeout=240)
    assert halved.returncode == 0, halved.stdout
    assert "on 1 rank (saved on 2: the global batch is now 6 samples, was 12)" in halved.stdout, halved.stdout
    assert "the global batch changed on resume: 6 samples per step, was 12" in halved.stdout, halved.stdout
    assert "the trainer: data.global_batch_size=12" in halved.stdout, halved.stdout
    kept = train(tmp_path / "kept", *[arg for arg in blobs if arg != "train.grad_accum=2"],
                 "data.global_batch_size=12", timeout=240)
    assert kept.returncode == 0, kept.stdout
    assert ("on 1 rank (saved on 2: the global batch stays 12 samples (data.global_batch_size), accumulated over 4 "
            "micro-steps per step, was 2)") in kept.stdout, kept.stdout
    assert "the global batch changed" not in kept.stdout and "step 12/12" in kept.stdout, kept.stdout
    assert final_state(tmp_path / "kept")["progress"]["step"] == 12
