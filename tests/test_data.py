"""Resumable sharding: every sample once per epoch, on any world size, from any position."""

from __future__ import annotations

import pytest

from mgpu.data import ShardPlan, epoch_permutation, eval_shard


def epoch_samples(num: int, batch: int, world: int, start: int = 0, epoch: int = 0) -> list[list[int]]:
    """Per micro-step, the real samples of all ranks in rank order."""
    plans = [ShardPlan(num, batch, rank, world, seed=3) for rank in range(world)]
    steps = list(zip(*(plan.micro_batches(epoch, start) for plan in plans)))
    return [[i for mb in step for i in mb.indices[:mb.real]] for step in steps]


@pytest.mark.parametrize("num, batch, world", [(10, 2, 1), (10, 2, 2), (11, 2, 2), (7, 4, 2), (5, 1, 4),
                                               (3, 2, 4), (100, 8, 3)])
def test_each_sample_exactly_once(num: int, batch: int, world: int) -> None:
    seen = [i for step in epoch_samples(num, batch, world) for i in step]
    assert sorted(seen) == list(range(num))
    assert seen == epoch_permutation(num, 3, 0)  # the global order is the permutation, whatever the world


@pytest.mark.parametrize("num, batch, world", [(11, 2, 2), (3, 2, 4), (5, 1, 4)])
def test_every_rank_steps_together_and_short_batches_pad(num: int, batch: int, world: int) -> None:
    plans = [ShardPlan(num, batch, rank, world) for rank in range(world)]
    per_rank = [list(plan.micro_batches(0)) for plan in plans]
    assert len({len(steps) for steps in per_rank}) == 1  # same number of DDP all-reduces everywhere
    for step in zip(*per_rank):
        assert all(len(mb.indices) >= 1 for mb in step)
        assert all(len(mb.indices) - mb.real in (0, 1) for mb in step)
        assert sum(mb.real for mb in step) == step[0].global_count
        assert len({mb.end_position for mb in step}) == 1


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (2, 3), (4, 2)])
def test_world_size_change_continues_at_the_same_sample(before: int, after: int) -> None:
    num, batch = 37, 3
    first = epoch_samples(num, batch, before)[:2]
    position = sum(len(step) for step in first)
    rest = epoch_samples(num, batch, after, start=position)
    seen = [i for step in first + rest for i in step]
    assert sorted(seen) == list(range(num)), "a sample was repeated or skipped"
    assert seen == epoch_permutation(num, 3, 0)


def test_epochs_reshuffle_and_seed_determines_order() -> None:
    assert epoch_permutation(50, 0, 0) != epoch_permutation(50, 0, 1)
    assert epoch_permutation(50, 0, 1) == epoch_permutation(50, 0, 1)
    assert epoch_permutation(50, 1, 0) != epoch_permutation(50, 0, 0)
    assert epoch_permutation(5, 0, 0, shuffle=False) == [0, 1, 2, 3, 4]


def test_micro_steps_left() -> None:
    plan = ShardPlan(10, 2, 0, 2)
    assert plan.micro_steps_left(0) == 3 and plan.micro_steps_left(8) == 1 and plan.micro_steps_left(10) == 0
    assert len(list(plan.micro_batches(0, 10))) == 0
    with pytest.raises(ValueError):
        list(plan.micro_batches(0, 11))


def test_eval_shard_covers_once() -> None:
    shards = [eval_shard(10, r, 3) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(10))


@pytest.mark.parametrize("num, batch, world, smallest", [(12, 3, 2, 3), (13, 3, 2, 1), (40, 3, 1, 1), (41, 3, 2, 2),
                                                          (7, 4, 2, 3), (3, 2, 4, 1)])
def test_smallest_micro_batch(num: int, batch: int, world: int, smallest: int) -> None:
    plans = [ShardPlan(num, batch, rank, world) for rank in range(world)]
    sizes = [len(mb.indices) for plan in plans for mb in plan.micro_batches(0)]
    assert min(sizes) == plans[0].smallest_micro_batch() == smallest
    assert ShardPlan(41, 3, 0, 2).smallest_micro_batch(start=9) == 1  # 32 left: the last 2 split 1 + 1


# ------------------------------------------------------------------------- CUDA generator states (D9)
def test_cuda_rng_state_is_this_devices_whatever_the_format() -> None:
    # No GPU here: the pure part. A checkpoint of the older format holds one state per visible device
    # (4 on the saving node); a resume that sees one device (--gpus-per-task=1) takes its own, index 0.
    from mgpu.rng import _this_device_state

    per_device = ["s0", "s1", "s2", "s3"]
    assert _this_device_state(per_device, 2) == "s2"
    assert _this_device_state(per_device, 0) == "s0"
    assert _this_device_state(["s0"], 3) == "s0"  # saved with one visible device, restored on device 3
    assert _this_device_state("mine", 5) == "mine"  # this format: the saving rank's own device only


# --------------------------------------------------------------------------- batches on the device (D13)
def test_to_device_moves_every_tensor_and_keeps_every_type() -> None:
    import torch

    from mgpu.trainer import to_device
    from tests.tasks import Inputs, Pair

    meta = torch.device("meta")  # a device other than the CPU that needs no GPU
    batch = {"pair": Pair(Inputs(torch.ones(2), torch.arange(2)), torch.zeros(2)), "list": [torch.ones(1), 3],
             "tuple": (torch.ones(1),), "name": "x"}
    moved = to_device(batch, meta)
    assert isinstance(moved["pair"], Pair) and isinstance(moved["pair"].inputs, Inputs)
    tensors = [moved["pair"].inputs.x, moved["pair"].inputs.ids, moved["pair"].y, moved["list"][0], moved["tuple"][0]]
    assert all(t.device == meta for t in tensors)
    assert moved["list"][1] == 3 and moved["name"] == "x" and type(moved["tuple"]) is tuple


def test_deterministic_kernels_switch() -> None:
    # In a child: the switch is process-wide. What it sets is what the GPU bit-identity needs (README).
    import subprocess
    import sys

    code = ("import os, torch; from mgpu.rng import use_deterministic_kernels as d; d(False); "
            "print(torch.are_deterministic_algorithms_enabled()); d(True); "
            "print(torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic, "
            "torch.backends.cudnn.benchmark, os.environ['CUBLAS_WORKSPACE_CONFIG'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["False", "True", "True", "False", ":4096:8"]
