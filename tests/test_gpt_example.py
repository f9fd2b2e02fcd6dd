"""The GPT example: jobs/make_tokens.py, the model and task in jobs/tasks/gpt.py, and a tiny training run."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from jobs import make_tokens
from jobs.tasks.gpt import GPT, GptTask
from mgpu.train.task import TaskError
from tests.conftest import PYTHON, ROOT, base_env

TEXT = "def f(x):\n    return x * 2  # café ☕\n" * 40


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, *args], env=base_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_make_tokens_round_trip(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text(TEXT, encoding="utf-8")
    assert make_tokens.main([str(source), str(tmp_path / "out.bin")]) == 0
    data = source.read_bytes()
    meta = json.loads((tmp_path / "out.json").read_text())
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint8" and meta["num_tokens"] == len(data)
    assert meta["source_sha256"] == hashlib.sha256(data).hexdigest()
    tokens = np.memmap(tmp_path / "out.bin", dtype=meta["dtype"], mode="r")
    assert tokens.tolist() == list(data)
    assert make_tokens.read_meta(tmp_path / "out.bin") == meta
    assert not list(tmp_path.glob(".*.tmp"))


def test_make_tokens_from_stdlib_is_deterministic(tmp_path: Path) -> None:
    first = make_tokens.make_stdlib_tokens(tmp_path / "a.bin")
    second = make_tokens.make_stdlib_tokens(tmp_path / "b.bin")
    assert first == second and 200_000 < first["num_tokens"] < 600_000
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()


@pytest.mark.parametrize("case", ["missing", "empty"])
def test_make_tokens_bad_input_is_one_line(tmp_path: Path, case: str) -> None:
    source = tmp_path / "in.txt"
    if case == "empty":
        source.write_bytes(b"")
    result = run("jobs/make_tokens.py", str(source), str(tmp_path / "out.bin"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    expected = {"missing": "not found", "empty": "is empty"}[case]
    assert len(lines) == 1 and lines[0].startswith("make_tokens: error:") and expected in lines[0], result.stderr
    assert not (tmp_path / "out.bin").exists()


def test_model_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1).eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    with torch.no_grad():
        before, after = model(idx), model(changed)
    assert before.shape == (2, 16, 256)
    torch.testing.assert_close(before[:, :9], after[:, :9], rtol=0, atol=0)
    assert not torch.allclose(before[:, 9:], after[:, 9:])
    assert model.head.weight is model.tok_emb.weight


def tiny_tokens(tmp_path: Path) -> Path:
    source = tmp_path / "tiny.txt"
    source.write_text(TEXT, encoding="utf-8")
    make_tokens.encode_file(source, tmp_path / "tiny.bin")
    return tmp_path / "tiny.bin"


def test_task_windows_loss_and_metrics(tmp_path: Path) -> None:
    path = tiny_tokens(tmp_path)
    task = GptTask(tokens=str(path), block_size=16, n_layer=1, n_head=2, n_embd=32)
    data = path.read_bytes()
    train, held_out = task.train_dataset(), task.eval_dataset()
    windows = (len(data) - 1) // 16
    assert len(train) + len(held_out) == windows and len(held_out) == windows // 10
    assert train[1].tolist() == list(data[16:33]) and held_out[0].tolist() == list(data[len(train) * 16:][:17])
    assert task.tokens_per_sample() == 16
    batch = torch.stack([train[i] for i in range(4)])
    model = task.build_model()
    loss = task.loss(model, batch)
    assert loss.shape == (4,) and bool(torch.isfinite(loss).all())
    metrics = task.metrics(model.eval(), batch)
    assert sorted(metrics) == ["accuracy", "loss"] and all(v.shape == (4,) for v in metrics.values())
    assert float(metrics["accuracy"].min()) >= 0 and float(metrics["accuracy"].max()) <= 1


def test_task_token_file_errors(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="not found: make it with"):
        GptTask(tokens=str(tmp_path / "none.bin"))
    (tmp_path / "short.txt").write_text("abc")
    make_tokens.encode_file(tmp_path / "short.txt", tmp_path / "short.bin")
    with pytest.raises(TaskError, match="too few"):
        GptTask(tokens=str(tmp_path / "short.bin"))
    task = GptTask(stdlib_tokens=str(tmp_path / "made" / "stdlib.bin"), block_size=64)
    assert task.meta["num_tokens"] > 200_000 and (tmp_path / "made" / "stdlib.json").is_file()


@pytest.mark.multiprocess
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])  # fsdp: the default layout meets a ModuleList, tied weights
def test_train_gpt_config_tiny(parallel: str, tmp_path: Path) -> None:
    path = tiny_tokens(tmp_path)
    result = run("jobs/train.py", "--config", "jobs/configs/gpt.yaml", f"task.args.tokens={path}", f"train.parallel={parallel}",
                 "task.args.block_size=16", "task.args.n_layer=1",
                 "task.args.n_embd=32", "data.batch_size=4", "train.max_steps=5", "eval.every_steps=5",
                 "log.every_steps=5", "log.tensorboard=false", f"run.dir={tmp_path / 'run'}", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tokens_per_s" in result.stdout and "eval step 5" in result.stdout, result.stdout
    assert list((tmp_path / "run" / "checkpoints").glob("step_*5")), list((tmp_path / "run").rglob("*"))
