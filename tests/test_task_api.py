"""Real workloads in the task API, through jobs/train.py on real gloo ranks: a token-weighted loss against a
one-process reference, corpus metrics reduced across ranks against the whole set computed at once, the
task's own optimizer and schedule resumed exactly, texts and scalars in TensorBoard (read back with its
own reader), wandb offline across a resume, the best evaluation next to the last, mgpu.load_model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import mgpu
from jobs.tasks.translation import EOS, PAD, Seq2Seq, SyntheticPairs, collate
from mgpu.state.single.store import CheckpointStore
from mgpu.record.ledger import read_ledger
from mgpu.train.metrics import bleu_statistics, corpus_bleu
from tests.test_trainer import assert_identical, final_state, train
from tests.wandb_log import wandb_history

pytestmark = pytest.mark.multiprocess

# 96 pairs, 4 per rank, 2 micro-steps per step on 2 ranks: 6 steps an epoch; sentences of 4-10 words, so
# ranks and micro-batches hold different numbers of target tokens. No dropout: 1 and 2 processes compare.
TINY = ["task.target=jobs.tasks.translation:TranslationTask", "task.args.train_size=96", "task.args.eval_size=24",
        "task.args.d_model=16", "task.args.layers=1", "task.args.dropout=0.0", "task.args.warmup_steps=4",
        "task.args.samples_to_log=2", "train.epochs=2", "train.grad_accum=2", "train.clip_grad_norm=1.0",
        "eval.metric=bleu", "eval.mode=max", "log.every_steps=2", "checkpoint.keep_last=10"]


def test_a_token_weighted_loss_trains_as_one_process_would(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    sgd = "task.args.optimizer=sgd"  # Adam's first steps are sign(gradient): near-zero gradients would flip weights
    assert train(one, *TINY, sgd, "data.batch_size=8", timeout=300).returncode == 0
    result = train(two, *TINY, sgd, "data.batch_size=4", ranks=2, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    a, b = final_state(one)["model"], final_state(two)["model"]
    # The same samples in every step, the mean over every token of the step: equal up to the order of sums.
    worst = max((a[k] - b[k]).abs().max().item() / (a[k].abs().max().item() + 1e-12) for k in a)
    assert worst < 1e-4, worst
    # ... and not what a mean over each rank's sentences (a per-sample loss) would give: the test can tell.
    per_sample = tmp_path / "per-sample"
    assert train(per_sample, *TINY, sgd, "data.batch_size=4", "task.args.per_sample_loss=true", ranks=2,
                 timeout=300).returncode == 0
    c = final_state(per_sample)["model"]
    assert max((a[k] - c[k]).abs().max().item() / (a[k].abs().max().item() + 1e-12) for k in a) > 100 * worst


def test_corpus_metrics_are_reduced_across_ranks_before_they_are_computed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert train(run_dir, *TINY, "data.batch_size=4", "train.epochs=1", ranks=2, timeout=300).returncode == 0
    (evaluated,) = [e for e in read_ledger(run_dir / "events.jsonl") if e["event"] == "evaluated"]
    model = mgpu.load_model(run_dir, Seq2Seq(27, 16, layers=1, dropout=0.0), which="latest").eval()
    pairs = SyntheticPairs(24, seed=1)
    batch = collate([pairs[i] for i in range(len(pairs))])  # the whole set at once, on one process
    with torch.no_grad():
        logits = model(batch.source, batch.target_in)
        hypotheses = model.greedy(batch.source, max_len=batch.target_out.shape[1] + 4)
    tokens = batch.target_out != PAD
    references = [[t for t in row if t not in (PAD, EOS)] for row in batch.target_out.tolist()]
    accuracy = ((logits.argmax(-1) == batch.target_out) & tokens).sum().item() / tokens.sum().item()
    bleu = corpus_bleu(bleu_statistics(hypotheses, references).tolist())
    assert evaluated["metrics"]["token_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert evaluated["metrics"]["bleu"] == pytest.approx(bleu, abs=1e-9)
    # Not the mean of the ranks' own BLEUs (what averaging per-rank values would report), unless they agree.
    halves = [corpus_bleu(bleu_statistics(hypotheses[r::2], references[r::2]).tolist()) for r in (0, 1)]
    assert halves[0] == halves[1] or evaluated["metrics"]["bleu"] != pytest.approx(sum(halves) / 2, abs=1e-9)


@pytest.fixture(scope="module")
def unbroken_translation(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("translation") / "run"
    result = train(run_dir, *TINY, "data.batch_size=4", ranks=2, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    return final_state(run_dir)


@pytest.mark.parametrize("stop_at", [3, 6])  # mid-epoch; the first epoch's last step, before its evaluation
def test_the_tasks_optimizer_and_schedule_resume_exactly(unbroken_translation: dict, stop_at: int,
                                                         tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    stopped = train(run_dir, *TINY, "data.batch_size=4", f"--stop-at-step={stop_at}", ranks=2, timeout=300)
    assert stopped.returncode == 3, stopped.stdout[-3000:]
    state = final_state(run_dir)
    group = state["optimizer"]["param_groups"][0]
    assert (group["eps"], group["betas"]) == (1e-9, (0.9, 0.98))  # the task's Adam, not the config's AdamW
    assert state["scheduler"]["last_epoch"] == stop_at
    assert train(run_dir, *TINY, "data.batch_size=4", ranks=2, timeout=300).returncode == 0
    resumed = final_state(run_dir)
    for key in ("model", "optimizer", "scheduler", "progress", "rng"):
        assert_identical(resumed[key], unbroken_translation[key], key)


def test_texts_scalars_best_and_wandb_across_a_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    wandb = ["log.wandb=true", "log.wandb_project=mgpu-test"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}
    stopped = train(run_dir, *TINY, *wandb, "data.batch_size=4", "--stop-at-step=8", ranks=2, timeout=300, env=env)
    assert stopped.returncode == 3, stopped.stdout[-3000:]
    assert train(run_dir, *TINY, *wandb, "data.batch_size=4", ranks=2, timeout=300, env=env).returncode == 0

    events = read_ledger(run_dir / "events.jsonl")
    evaluated = [e for e in events if e["event"] == "evaluated"]
    best = max(evaluated, key=lambda e: e["metrics"]["bleu"])
    (finished,) = [e for e in events if e["event"] == "finished"]
    assert finished["metrics"] == evaluated[-1]["metrics"]  # the last evaluation ...
    assert finished["best_step"] == best["step"] and finished["best_metrics"] == best["metrics"]  # ... and the best
    best_weights = CheckpointStore(run_dir / "checkpoints").best().state["model"]
    assert all(torch.equal(best_weights[k], v) for k, v in mgpu.load_model(run_dir).items())

    tb = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0}).Reload()
    assert [e.step for e in tb.Scalars("train/token_accuracy")] == [2, 4, 6, 8, 10, 12]  # the task's training metric
    texts = tb.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [6, 12] and "reference" in texts[0].tensor_proto.string_val[0].decode()

    runs = wandb_history(run_dir / "wandb")  # wandb's files live in the run directory
    assert len(runs) == 2 and len({run_id for run_id, _ in runs}) == 1  # the resumed job continues the same run
    first, second = (sorted(row["_step"] for row in rows if "train/loss" in row) for _, rows in runs)
    assert first == [2, 4, 6, 8] and second == [10, 12]
    assert any("eval/bleu" in row for _, rows in runs for row in rows)
    assert os.path.isdir(run_dir / "tensorboard")
