"""The GPT example as a stream (jobs/configs/gpt_stream.yaml): the same training windows as the map-style task,
read as token shards; through the trainer, stopped and resumed, it agrees with an unbroken run at every logged
step (jobs/status.py --verify)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from jobs import make_tokens
from jobs.tasks.gpt import GptTask
from mgpu.data.stream import ShardedStream
from mgpu.train.task import TaskError
from tests.conftest import PYTHON, base_env, run_processes, run_world
from tests.test_gpt_example import run, tiny_tokens


def test_the_stream_holds_exactly_the_map_style_training_windows(tmp_path: Path) -> None:
    path = tiny_tokens(tmp_path)
    windowed = GptTask(tokens=str(path), block_size=16)
    streamed = GptTask(tokens=str(path), block_size=16, stream=True, shards=5)
    stream = streamed.train_dataset()
    assert isinstance(stream, ShardedStream) and not hasattr(stream, "__len__")
    train = windowed.train_dataset()
    assert stream.samples == len(train) and len(stream.files) == 5
    assert all(torch.equal(stream.read(i), train[i]) for i in range(len(train)))
    again = GptTask(tokens=str(path), block_size=16, stream=True, shards=5).train_dataset()  # kept, not rewritten
    assert [Path(f).stat().st_mtime_ns for f in again.files] == [Path(f).stat().st_mtime_ns for f in stream.files]
    with pytest.raises(TaskError, match="shards of"):
        GptTask(tokens=str(path), block_size=16, stream=True, shards=10**6).train_dataset()
    with pytest.raises(make_tokens.TokenError, match="shards of"):
        make_tokens.write_shards(path, tmp_path / "x", 0, 16, 10)


TINY = ["task.args.block_size=16", "task.args.n_layer=1", "task.args.n_embd=32", "task.args.shuffle_buffer=8",
        "task.args.shards=3", "data.batch_size=4", "train.max_steps=8", "eval.every_steps=100", "log.every_steps=1",
        "log.tensorboard=false", "checkpoint.every_steps=100"]


def train(ranks: int, *args: str) -> subprocess.CompletedProcess[str]:
    """`python args...` alone, or on `ranks` ranks (tests.conftest.run_world), its output and stderr together."""
    if ranks > 1:
        return run_world(list(args), ranks, timeout=180)
    (result,) = run_processes([([PYTHON, *args], base_env())], timeout=180)
    return result


@pytest.mark.multiprocess
@pytest.mark.parametrize("task, ranks, resumed_at", [
    ([], 1, "sample 12"),
    # The same shards through a Stateful IterableDataset of the task's own, on 2 ranks with 2 DataLoader workers
    # each (a shard per reader): every rank's per-worker states are gathered into the stop's checkpoint and
    # restored (mgpu.data.stream_loader.StatefulStreamLoader). In the sharded store (FSDP2's; here under DDP), which
    # kept rank 0's alone before; the single-file store's gather: test_stream_resume's own loop on 2 ranks.
    (["task.target=tests.tasks:StatefulGptTask", "task.args.shards=4", "data.num_workers=2",
      "checkpoint.format=sharded"], 2, "batch per rank 3")])
def test_the_stream_config_stopped_and_resumed_agrees_with_an_unbroken_run(task: list[str], ranks: int,
                                                                           resumed_at: str, tmp_path: Path) -> None:
    path = tiny_tokens(tmp_path)
    args = ["jobs/train.py", "--config", "jobs/configs/gpt_stream.yaml", f"task.args.tokens={path}", *TINY, *task]
    unbroken = train(ranks, *args, f"run.dir={tmp_path / 'unbroken'}")
    assert unbroken.returncode == 0, unbroken.stdout
    stopped = train(ranks, *args, f"run.dir={tmp_path / 'broken'}", "--stop-at-step", "3")
    assert stopped.returncode == 3, stopped.stdout  # stopped (rank 0; the others end with 0)
    resumed = train(ranks, *args, f"run.dir={tmp_path / 'broken'}")
    assert resumed.returncode == 0 and f"from step 3 (epoch 0, {resumed_at})" in resumed.stdout, resumed.stdout
    verdict = run("jobs/status.py", "--verify", str(tmp_path / "unbroken"), str(tmp_path / "broken"))
    assert verdict.returncode == 0 and "agree" in verdict.stdout and "(1..8)" in verdict.stdout, verdict.stdout
