"""FSDP2 and sharded checkpoints across real processes (gloo): the trainer stopped and resumed bit-identically,
a sharded checkpoint resumed on other world sizes, a damaged shard, a SIGKILL in the middle of a sharded save."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import mgpu

from mgpu.data.sampling import epoch_permutation
from mgpu.record.ledger import Ledger, read_ledger
from mgpu.record.runview import verify
from mgpu.state.sharded.checkpointer import ShardedCheckpointer
from mgpu.state.sharded.export import consolidate
from tests.conftest import start_ranks, wait_ranks
from tests.test_trainer import BLOBS, assert_identical, train

# BLOBS (2 ranks: 4 steps an epoch, 12 in all, accumulation, clipping, warmup, batch norm, dropout) under FSDP2,
# with an eval set that rank 0 has one batch more of than rank 1 (19 samples, 3 a batch: 4 and 3), and an EMA of the
# weights (evaluated; sharded like the model).
FSDP = [*BLOBS, "train.parallel=fsdp", "task.args.eval_size=19", "eval.every_steps=3", "train.ema_decay=0.9"]


def final(run_dir: Path) -> dict[str, Any]:
    loaded = ShardedCheckpointer(run_dir / "checkpoints", 0, 1, Ledger(None, None, 0)).find_latest()
    assert loaded is not None, f"no checkpoint in {run_dir}"
    return consolidate(loaded.path)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("unbroken")
    result = train(run_dir, *FSDP, ranks=2, timeout=240)
    assert result.returncode == 0, result.stdout
    return run_dir, final(run_dir)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stop_at", [2, 4])  # mid-epoch; the last step of epoch 0
def test_fsdp_resume_is_bit_identical(stop_at: int, unbroken: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    first = train(tmp_path, *FSDP, f"--stop-at-step={stop_at}", ranks=2, timeout=240)
    assert first.returncode == 3, first.stdout
    stopped = tmp_path / "checkpoints" / f"step_{stop_at:08d}"
    # One shard per rank, each rank's manifest, rank 0's metadata and common state.
    names = {p.name for p in stopped.iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp", "manifest_0.json", "manifest_1.json", ".metadata", "common.pt"} <= names
    second = train(tmp_path, *FSDP, ranks=2, timeout=240)
    assert second.returncode == 0, second.stdout
    resumed, reference = final(tmp_path), unbroken[1]
    assert resumed["progress"]["step"] == reference["progress"]["step"] == 12
    for key in ("model", "optim", "scheduler", "rng", "ema"):
        assert_identical(resumed[key], reference[key], key)
    assert resumed["ema"]["n_averaged"].item() == 12
    events = read_ledger(tmp_path / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "resumed"] == [stop_at]
    fingerprints = lambda run: {e["step"]: e["fingerprint"] for e in read_ledger(run / "events.jsonl")  # noqa: E731
                                if e["event"] == "progress"}
    assert fingerprints(tmp_path) == fingerprints(unbroken[0])  # every logged step, as status.py --verify


@pytest.mark.multiprocess
def test_fsdp_checkpoint_resumes_on_one_rank_with_the_same_global_batch(tmp_path: Path) -> None:
    """2 ranks -> 1 under data.global_batch_size=12 (3 a rank per micro-step): the accumulation doubles (2 -> 4),
    and every optimizer step trains on the same 12 samples of the epoch's order as on 2 ranks."""
    run, ids = tmp_path / "run", tmp_path / "ids"
    ids.mkdir()
    # 42 samples: no one-sample batch for BatchNorm on 1 rank either
    args = [*FSDP, "task.args.size=42", "train.grad_accum=1", "data.global_batch_size=12", f"task.args.ids_dir={ids}"]
    first = train(run, *args, "--stop-at-step=2", ranks=2, timeout=240)
    assert first.returncode == 3, first.stdout
    saved = final(run)
    second = train(run, *args, "train.max_steps=3", ranks=1, timeout=240)
    assert second.returncode == 0, second.stdout
    assert ("(saved on 2: the global batch stays 12 samples (data.global_batch_size), accumulated over 4 "
            "micro-steps per step, was 2)") in second.stdout, second.stdout
    events = read_ledger(run / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "resumed"] == [2]
    assert [e["world_size"] for e in events if e["event"] == "started"] == [2, 1]
    after = final(run)
    assert after["progress"]["step"] == 3 and after["world_size"] == 1
    assert after["progress"]["position"] == after["progress"]["samples_seen"] == 36  # 12 a step, on both
    assert not torch.equal(after["model"]["4.weight"], saved["model"]["4.weight"])  # it trained on from there
    # The EMA, resharded onto one rank, follows the model exactly: step 3's average is step 2's (saved on 2 ranks)
    # averaged with step 3's weights and buffers, bit for bit.
    for key, value in after["model"].items():
        previous = saved["ema"][f"module.{key}"]
        expected = previous.lerp(value, 1.0 - 0.9) if value.is_floating_point() else value
        assert torch.equal(after["ema"][f"module.{key}"], expected), key
    # The samples each micro-step trained on (BlobTask's ids files): 2 ranks x 2 micro-steps x 2 steps, then one
    # rank's 4 micro-steps; step 3 is the epoch order's next 12 (without the global batch: its next 6).
    lines = {r: [[int(i) for i in line.split()] for line in (ids / f"ids-rank{r}.txt").read_text().splitlines()]
             for r in (0, 1)}
    assert [len(lines[0]), len(lines[1])] == [8, 4]
    order = epoch_permutation(42, 0, 0)
    assert sorted(i for line in lines[0][:4] + lines[1] for i in line) == sorted(order[:24])
    assert [i for line in lines[0][4:] for i in line] == order[24:36]


def ranks(world: int, *argv: str, timeout: float = 180) -> list[tuple[int, str]]:
    return wait_ranks(start_ranks(["-m", "tests.sharded_worker", *argv], world), timeout)


@pytest.mark.multiprocess
def test_sharded_checkpoint_reshards_onto_other_world_sizes(tmp_path: Path) -> None:
    saved = ranks(4, "save", str(tmp_path), "3")
    assert all(rc == 0 for rc, _ in saved), saved
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "step_00000003").glob("*.distcp")) == [
        f"__{r}_0.distcp" for r in range(4)]
    # Onto 3 ranks: every shard boundary moves (2 ranks would keep half of them). 4 -> 2 and 2 -> 3 were run by
    # hand; a trainer's 2 -> 1 is test_fsdp_checkpoint_resumes_on_one_rank_with_the_same_global_batch.
    # (9 processes cost CI 4 minutes.)
    loaded = ranks(3, "load", str(tmp_path))
    assert [rc for rc, _ in loaded] == [0, 0, 0], loaded
    assert all("step 3 MATCH" in out for _, out in loaded), loaded


@pytest.mark.multiprocess
@pytest.mark.parametrize("point,victim", [("write", 1), ("manifest", 0), ("install", 0)])
def test_sigkill_during_a_sharded_save_leaves_a_latest_that_loads(point: str, victim: int, tmp_path: Path) -> None:
    procs = start_ranks(["-m", "tests.sharded_worker", "kill", str(tmp_path), point, str(victim)], 2)
    try:
        procs[victim].wait(timeout=120)
    finally:  # as srun --kill-on-bad-exit: a rank killed, the others go too
        for proc in procs:
            proc.kill()
    results = wait_ranks(procs, 10)
    assert results[victim][0] == -9, results
    directory = tmp_path / "checkpoints"
    assert (directory / "latest").read_text().strip() == "step_00000001"
    assert not (directory / "step_00000002").exists()
    loaded = ShardedCheckpointer(directory, 0, 1, Ledger(None, None, 0)).find_latest()
    assert loaded is not None and loaded.step == 1 and not loaded.skipped
    assert consolidate(loaded.path)["progress"] == {"step": 1}
    # The killed save's temporary directory goes with the next save (or stays out of every listing).
    assert [p.name for p in directory.iterdir() if p.name.startswith("step_")] == ["step_00000001"]



@pytest.mark.multiprocess
def test_a_late_rank_fails_its_save_alone_named_and_the_next_saves_are_durable(tmp_path: Path) -> None:
    """Rank 1 writes step 2's shard 8 s late; the ranks wait 3 s for each other (peer_wait_s in a run): rank 0's
    save fails in that bound, naming rank 1, instead of waiting torch's 30 minutes with no name; `latest` stays.
    Then saves 3 and 4 (asynchronous) and 5 (waited for, as a stop's) are durable and verify: the failed save's
    group is never waited on again (on one long-lived group, every later save failed, blaming rank 0)."""
    results = ranks(2, "late", str(tmp_path), "1", timeout=120)
    assert [rc for rc, _ in results] == [0, 0], results
    first = results[0][1]
    assert "sharded checkpoint step 2 not written" in first, first
    assert "rank 1 had not written its shard when rank 0 stopped waiting (after 3 s)" in first, first
    assert "step 2 saved" not in first and "step 2 saved" not in results[1][1], results
    for rank, (_, out) in enumerate(results):
        for step in (3, 4, 5):
            assert f"rank {rank}: step {step} saved" in out, out
    directory = tmp_path / "checkpoints"
    assert not (directory / "step_00000002").exists()
    loaded = ShardedCheckpointer(directory, 0, 1, Ledger(None, None, 0)).find_latest()
    assert loaded is not None and loaded.step == 5 and not loaded.skipped
    assert consolidate(loaded.path)["progress"] == {"step": 5}
    assert sorted(p.name for p in directory.glob("step_*")) == ["step_00000003", "step_00000004", "step_00000005"]


@pytest.mark.multiprocess
def test_ddp_with_sharded_checkpoints_resumes_bit_identically(tmp_path: Path) -> None:
    """checkpoint.format=sharded under DDP: each replicated tensor written once (DCP's deduplication), resumed
    as the single-file form is."""
    ddp = [*BLOBS, "checkpoint.format=sharded"]
    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    assert train(unbroken, *ddp, ranks=2, timeout=240).returncode == 0
    first = train(broken, *ddp, "--stop-at-step=5", ranks=2, timeout=240)
    assert first.returncode == 3, first.stdout
    assert sorted(p.name for p in (broken / "checkpoints" / "step_00000005").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]
    assert train(broken, *ddp, ranks=2, timeout=240).returncode == 0
    a, b = final(unbroken), final(broken)
    for key in ("model", "optim", "scheduler", "progress"):
        assert_identical(a[key], b[key], key)


@pytest.mark.multiprocess
def test_a_users_loop_with_fsdp_resumes_bit_identically(tmp_path: Path) -> None:
    """Session.wrap(model, parallel="fsdp"), the one changed line, with an mgpu.EMA in the state: stopped, resumed,
    equal to an unbroken run, the EMA included; the EMA is sharded like the model (one shard per rank through DCP)
    and mgpu.load_model(..., ema=True) loads it whole into a plain module."""
    from torch.distributed.checkpoint import FileSystemReader

    from tests.test_own_loop import OWN_LOOP

    def run(run_dir: Path, *argv: str) -> list[tuple[int, str]]:
        return wait_ranks(start_ranks([OWN_LOOP, str(run_dir), "--parallel", "fsdp", "--ema", "0.9", *argv], 2), 240)

    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    first = run(unbroken)
    assert [rc for rc, _ in first] == [0, 0], first
    stopped = run(broken, "--stop-at-step", "7")
    assert [rc for rc, _ in stopped] == [3, 0], stopped  # stopped (not a Slurm job): rank 0 says so
    resumed = run(broken)
    assert [rc for rc, _ in resumed] == [0, 0], resumed
    a, b = final(unbroken), final(broken)
    for key in ("model", "optim", "scheduler", "loader", "best", "bad_evals", "ema"):
        assert_identical(a[key], b[key], key)
    assert b["ema"]["n_averaged"].item() == 12 and not torch.equal(b["ema"]["module.0.weight"], b["model"]["0.weight"])
    latest = sorted((broken / "checkpoints").glob("step_*"))[-1]
    chunks = FileSystemReader(str(latest)).read_metadata().state_dict_metadata["model.ema.module.0.weight"].chunks
    assert sorted(tuple(c.offsets) for c in chunks) == [(0, 0), (16, 0)]  # 32 rows: one shard per rank
    net = mgpu.load_model(broken, nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2)),
                          which="latest", ema=True)
    assert torch.equal(net[0].weight, b["ema"]["module.0.weight"])
    # session.log's fingerprint of the sharded model (a collective on both ranks), as status.py --verify reads it
    code, line = verify(unbroken, broken)
    assert code == 0 and line.startswith("agree: the same weights at all 6 steps both runs logged (2..12)"), line


@pytest.mark.multiprocess
def test_fsdp_trains_as_ddp_does(unbroken: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """Accumulation, the per-sample weighting, clipping and evaluation under FSDP2 give DDP's loss, gradient
    norm and eval metrics at every step (to float rounding: the reductions run in another order)."""
    result = train(tmp_path, *[arg for arg in FSDP if arg != "train.parallel=fsdp"], ranks=2, timeout=240)
    assert result.returncode == 0, result.stdout

    def logged(run: Path) -> dict[tuple[str, int], dict[str, float]]:
        return {(e["event"], e["step"]): e["metrics"] for e in read_ledger(run / "events.jsonl")
                if e["event"] in ("progress", "evaluated")}

    fsdp, ddp = logged(unbroken[0]), logged(tmp_path)
    assert set(fsdp) == set(ddp) and len(fsdp) == 12 + 4
    for key, metrics in ddp.items():
        for name in ("loss", "grad_norm", "accuracy"):
            if name in metrics:
                assert fsdp[key][name] == pytest.approx(metrics[name], rel=1e-4, abs=1e-6), (key, name)


def test_the_default_layout_shards_a_module_lists_blocks_and_leaves_tied_weights_to_the_root(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The GPT example's model (its blocks in a ModuleList, its embedding tied to its output layer): fully_shard
    refuses a ModuleList (no forward); one unit per block, the tied pair with the root, and so are the position
    embedding and the final LayerNorm (each under an eighth of a block: three collectives a step for nothing);
    the sharded model runs."""
    from jobs.tasks.gpt import GPT
    from mgpu.parallel.distributed import process_group
    from mgpu.cluster.environment import detect_environment
    from mgpu.parallel.fsdp import default_units, is_sharded, shard

    model = GPT(64, 16, 3, 2, 32, 0.0)
    units = default_units(model)
    assert [id(u) for u in units] == [*map(id, model.blocks)]
    wide = GPT(64, 512, 3, 2, 32, 0.0)  # a position embedding of 512 x 32: larger than an eighth of a block
    assert [id(u) for u in default_units(wide)] == [id(wide.pos_emb), *map(id, wide.blocks)]
    for name in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    with process_group(detect_environment({})):
        sharded = shard(model, torch.device("cpu"))
        assert is_sharded(sharded) and all(is_sharded(block) for block in model.blocks)
        assert not is_sharded(model.tok_emb) and not is_sharded(model.head)
        logits = sharded(torch.randint(0, 64, (2, 16)))
        logits.float().mean().backward()
    assert logits.shape == (2, 16, 64)


@pytest.mark.multiprocess
def test_an_fsdp_own_loop_starts_from_the_same_weights_on_any_world_size(tmp_path: Path) -> None:
    """Session seeds rank r with seed + r; wrap(parallel="fsdp") broadcasts rank 0's weights before sharding (as
    DDP's wrap does): on 2 ranks the full model equals a 1-rank wrap's and the plain model seeded alike, for an
    orthogonal and an identity init, per-rank loaded weights and a buffer (no patchwork of two ranks' inits)."""
    from tests.fsdp_init_loop import SEED, InitNet

    def weights(world: int) -> dict[str, torch.Tensor]:
        out = tmp_path / f"weights-{world}.pt"
        results = wait_ranks(start_ranks(["-m", "tests.fsdp_init_loop", str(tmp_path / f"run{world}"), str(out)],
                                         world), 120)
        assert [rc for rc, _ in results] == [0] * world, results
        loaded: dict[str, torch.Tensor] = torch.load(out)
        return loaded

    torch.manual_seed(SEED)
    plain = {name: value.detach() for name, value in InitNet(0).state_dict().items()}
    one, two = weights(1), weights(2)
    assert set(one) == set(two) == set(plain)
    for name, value in plain.items():
        assert torch.equal(one[name], value), name
        assert torch.equal(two[name], value), name
    assert torch.allclose(two["a.weight"].T @ two["a.weight"], torch.eye(6), atol=1e-5)
