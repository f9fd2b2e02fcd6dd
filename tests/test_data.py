"""Resumable sharding: every sample once per epoch, on any world size, from any position."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mgpu.data.sampling import ShardPlan, epoch_permutation, eval_shard


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
    from mgpu.state.rng import _this_device_state

    per_device = ["s0", "s1", "s2", "s3"]
    assert _this_device_state(per_device, 2) == "s2"
    assert _this_device_state(per_device, 0) == "s0"
    assert _this_device_state(["s0"], 3) == "s0"  # saved with one visible device, restored on device 3
    assert _this_device_state("mine", 5) == "mine"  # this format: the saving rank's own device only


class FakeCuda:
    """torch.cuda on a node whose rank owns device `current` of `visible`: a mock of CUDA (no GPU here).
    A device's generator state is a one-element tensor holding its index."""

    def __init__(self, current: int, visible: int) -> None:
        self.current, self.visible = current, visible
        self.set: list[tuple[int, int]] = []  # (state's device, device it was set on)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import torch

        for name in ("is_available", "is_initialized", "current_device", "device_count", "get_rng_state",
                     "get_rng_state_all", "set_rng_state", "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return self.current

    def device_count(self) -> int:
        return self.visible

    def get_rng_state(self, device: object = "cuda") -> object:
        import torch

        index = self.current if device in ("cuda", None) else torch.device(device).index  # type: ignore[arg-type]
        return torch.tensor([index])

    def get_rng_state_all(self) -> list[object]:
        return [self.get_rng_state(f"cuda:{i}") for i in range(self.visible)]

    def set_rng_state(self, state: object, device: object = "cuda") -> None:
        import torch

        index = self.current if device in ("cuda", None) else torch.device(device).index  # type: ignore[arg-type]
        self.set.append((int(state[0]), index))  # type: ignore[index]

    def set_rng_state_all(self, states: list[object]) -> None:
        for index, state in enumerate(states):
            self.set.append((int(state[0]), index))  # type: ignore[index]


def test_only_this_ranks_cuda_generator_is_saved_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from mgpu.state.rng import capture_rng_state, restore_rng_state

    saving = FakeCuda(current=2, visible=4)  # --gpus-per-node=4: every GPU visible, local rank 2 owns cuda:2
    saving.install(monkeypatch)
    state = capture_rng_state()
    assert isinstance(state["cuda"], torch.Tensor) and state["cuda"].tolist() == [2]  # its own, not all 4
    resuming = FakeCuda(current=0, visible=1)  # --gpus-per-task=1: its one GPU is cuda:0
    resuming.install(monkeypatch)
    restore_rng_state(state)
    assert resuming.set == [(2, 0)]  # the saved device's stream, set on this rank's device, and nothing else
    older = dict(state, cuda=[torch.tensor([i]) for i in range(4)])  # the per-visible-device format
    third = FakeCuda(current=3, visible=4)
    third.install(monkeypatch)
    restore_rng_state(older)
    assert third.set == [(3, 3)]


# --------------------------------------------------------------------------- batches on the device (D13)
def test_to_device_moves_every_tensor_and_keeps_every_type() -> None:
    import torch

    from mgpu.train.step_batches import to_device
    from tests.tasks import Inputs, Pair

    meta = torch.device("meta")  # a device other than the CPU that needs no GPU
    batch = {"pair": Pair(Inputs(torch.ones(2), torch.arange(2)), torch.zeros(2)), "list": [torch.ones(1), 3],
             "tuple": (torch.ones(1),), "name": "x"}
    moved = to_device(batch, meta)
    assert isinstance(moved["pair"], Pair) and isinstance(moved["pair"].inputs, Inputs)
    tensors = [moved["pair"].inputs.x, moved["pair"].inputs.ids, moved["pair"].y, moved["list"][0], moved["tuple"][0]]
    assert all(t.device == meta for t in tensors)
    assert moved["list"][1] == 3 and moved["name"] == "x" and type(moved["tuple"]) is tuple


def test_to_device_moves_mappings_of_every_kind_and_every_dataclass_field() -> None:
    # Hugging Face's BatchEncoding is a UserDict; defaultdicts need their factory; a field with init=False
    # cannot go through the constructor: each was left on the CPU or failed before.
    import collections
    import dataclasses

    import torch

    from mgpu.train.step_batches import to_device

    @dataclasses.dataclass(frozen=True)
    class Derived:
        x: torch.Tensor
        mask: torch.Tensor = dataclasses.field(init=False, default=None)  # type: ignore[assignment]

    meta = torch.device("meta")
    derived = Derived(torch.ones(1))
    object.__setattr__(derived, "mask", torch.ones(1))
    user = collections.UserDict({"input_ids": torch.ones(2)})
    counts: collections.defaultdict[str, torch.Tensor] = collections.defaultdict(lambda: torch.zeros(1))
    counts["a"] = torch.ones(1)
    moved = to_device([user, counts, derived], meta)
    assert type(moved[0]) is collections.UserDict and moved[0]["input_ids"].device == meta
    assert type(moved[1]) is collections.defaultdict and moved[1]["a"].device == meta
    assert moved[1].default_factory is counts.default_factory
    assert moved[2].x.device == meta and moved[2].mask.device == meta
    assert user["input_ids"].device.type == "cpu"  # the batch itself is not changed


@pytest.mark.multiprocess
def test_deterministic_kernels_switch() -> None:
    # In a child: the switch is process-wide. What it sets is what the GPU bit-identity needs (README).
    import subprocess
    import sys

    code = ("import os, torch; from mgpu.state.rng import use_deterministic_kernels as d; d(False); "
            "print(torch.are_deterministic_algorithms_enabled()); d(True); "
            "print(torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic, "
            "torch.backends.cudnn.benchmark, os.environ['CUBLAS_WORKSPACE_CONFIG'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["False", "True", "True", "False", ":4096:8"]


# --------------------------------------------------------------------------- seeds at every config seed (D12)
class RandomCrop:
    """A dataset whose items are random draws (augmentation): what a sample's seed decides."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[int, float]:
        import torch

        return index, torch.rand(()).item()


def _draws(seed: int, batches: list[list[int]], workers: int) -> dict[int, float]:
    from mgpu.data.loader import make_loader

    loader = make_loader(RandomCrop(), batches, num_workers=workers, seed=seed,  # type: ignore[arg-type]
                         epoch=3, rank=0, requeue_signal="USR2", collate_fn=lambda items: items, pin_memory=False)
    return {index: value for batch in loader for index, value in batch}


def test_workers_draw_per_sample_at_the_largest_seed() -> None:
    # train.seed may be up to 2**32 - 1: its per-sample seeds once overflowed torch.manual_seed in every worker
    # ("Overflow when unpacking long long") from train.seed 18447 on.
    seed = 2**32 - 1
    by_two = _draws(seed, [[0, 1, 2, 3], [4, 5, 6, 7]], workers=2)
    by_one = _draws(seed, [[5, 2], [7, 0, 1], [3, 6, 4]], workers=1)
    assert sorted(by_two) == list(range(8)) and by_two == by_one  # a sample's draw, whichever worker loads it
    assert len(set(by_two.values())) == 8


class Collecting:
    """Eight samples; a worker runs a full garbage collection at each, as any worker may at any allocation."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        import gc

        gc.collect()
        return index


def test_a_workers_garbage_collection_leaves_the_training_processs_garbage_alone() -> None:
    """Destroyed gloo groups still held by reference cycles (as an FSDP2 model dropped after Session.finish()
    holds its mesh's group) are garbage in this process when a loader forks its workers. Collected in a
    worker, each group's destructor joins gloo threads that only this process has: the worker segfaulted
    ('Unexpected segmentation fault encountered in worker': tests/test_stream_stateful.py's resume after
    tests/test_session_api.py in one pytest process) or, with a single such group, hung (the loader's timeout
    says so). The workers are forked with this process's objects frozen: their collections never reach them."""
    import gc

    import torch.distributed as dist

    from mgpu.cluster.environment import detect_environment
    from mgpu.data.loader import ResumableLoader
    from mgpu.parallel.distributed import process_group

    gc.disable()  # the cycles stay uncollected here until the workers exist, as they may between two collections
    try:
        for _ in range(4):  # four groups: the worker segfaults (with one it hung)
            with process_group(detect_environment({})):
                cycle: dict[str, Any] = {"group": dist.group.WORLD}
                cycle["self"] = cycle
            del cycle
        loader = ResumableLoader(Collecting(), 4, rank=0, world_size=1, shuffle=False,  # type: ignore[arg-type]
                                 num_workers=1, collate_fn=list, timeout=10)
        assert list(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    finally:
        gc.enable()
        gc.collect()  # the groups go here, where their threads are


def test_seeds_fit_torch_stay_distinct_and_keep_the_streams_that_worked() -> None:
    import torch

    from mgpu.data.loader import loader_seed, sample_seed
    from mgpu.state.rng import derived_seed, stream_seed

    # Every seed torch accepts, at any config seed, epoch, sample index or rank.
    for seed in (0, 18446, 18447, 2**32 - 1):
        for epoch, index in ((0, 0), (7, 10**6), (10**7, 3 * 10**9)):
            for value in (sample_seed(seed, epoch, index), loader_seed(seed, epoch, index)):
                assert 0 <= value < 2**64
                torch.Generator().manual_seed(value)
    # Distinct per sample (the packing where it is exact, a 63-bit hash elsewhere).
    assert len({sample_seed(2**32 - 1, e, i) for e in range(3) for i in range(2000)}) == 6000
    assert len({sample_seed(9, 0, i) for i in (5, 1_000_000_007 + 5, 2 * 1_000_000_007 + 5)}) == 3
    # Unchanged wherever the old packing worked: a run resumed across the upgrade stays bit-identical.
    assert sample_seed(18446, 2, 7) == (18446 * 1_000_003 + 2) * 1_000_000_007 + 7
    assert loader_seed(3, 2, 1) == 3 * 1_000_003 + 2 * 1009 + 1
    order = torch.randperm(50, generator=torch.Generator().manual_seed(3 * 1_000_003 + 1)).tolist()
    assert epoch_permutation(50, 3, 1) == order
    assert epoch_permutation(50, 2**32 - 1, 10**7) != epoch_permutation(50, 2**32 - 1, 10**7 + 1)
    assert derived_seed(5, True, "x") == 5 and derived_seed(5, False, "x", 1) == stream_seed("x", 1)
    assert 0 <= derived_seed(2**64, True, "x") < 2**63 and stream_seed("x", 1) != stream_seed("x", 2)


def test_a_rank_the_saved_run_did_not_have_gets_a_seed_at_any_config_seed(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    import torch
    from torch import nn

    from mgpu.state.train_state import Progress, restore_state

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # set by torch's first optimizer otherwise
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "scaler": scaler.state_dict(), "rng": [], "progress": {"step": 10**12}}
    for rank in (0, 200_000):  # the world grew: no saved stream for this rank
        objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler,
                   "progress": Progress()}
        restore_state(state, objects, rank, 2**32 - 1)
        assert objects["progress"].step == 10**12


def test_a_loader_refuses_a_batch_size_a_worker_count_or_an_empty_dataset_in_one_line() -> None:
    # Issue 46: Session.loader(batch_size=0) was a ZeroDivisionError at its first epoch, an empty dataset trained
    # 0 steps without a word, and num_workers=100000 forked until the machine ran out of processes.
    import torch
    from torch.utils.data import TensorDataset

    from mgpu.data.loader import ResumableLoader, eval_loader, make_loader, worker_cap
    from mgpu.data.stream_loader import StatefulStreamLoader
    from mgpu.errors import MgpuError

    data, cap = TensorDataset(torch.zeros(10, 2)), worker_cap()
    refused = [
        (lambda: ResumableLoader(data, 0, rank=0, world_size=1), "Session.loader(batch_size=0): a batch holds"),
        (lambda: ResumableLoader(data, 2.5, rank=0, world_size=1), "batch_size=2.5"),  # type: ignore[arg-type]
        (lambda: ResumableLoader(data, True, rank=0, world_size=1), "batch_size=True"),
        (lambda: ResumableLoader(TensorDataset(torch.zeros(0, 2)), 2, rank=0, world_size=2),
         "Session.loader(): the dataset is empty (TensorDataset of length 0)"),
        (lambda: ResumableLoader(data, 2, rank=0, world_size=1, num_workers=-1), "num_workers=-1"),
        (lambda: ResumableLoader(data, 2, rank=0, world_size=1, num_workers=cap + 1),
         f"num_workers={cap + 1}): more DataLoader worker processes per rank than this machine can run ({cap}"),
        (lambda: StatefulStreamLoader(data, 0, rank=0, world_size=1), "Session.loader(batch_size=0)"),
        (lambda: eval_loader(data, 0, rank=0, world_size=1, seed=0, requeue_signal="USR2"),
         "Session.eval_loader(batch_size=0)"),
        (lambda: make_loader(data, [[0, 1]], num_workers=100_000, seed=0, epoch=0, rank=0, requeue_signal="USR2",
                             collate_fn=None), "data.num_workers: DataLoader(num_workers=100000)"),
    ]
    for build, expected in refused:
        with pytest.raises(MgpuError) as error:
            build()
        assert expected in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert len(ResumableLoader(data, 3, rank=0, world_size=1, num_workers=cap)) == 4  # the cap itself is fine
