"""The resume checker's pure parts in one process: states flattened to paths and compared (causes first), the
hint each kind of difference gets, optimizer moments named by their parameter, the batches' digests and their
comparison (lost and repeated samples), the mid-epoch stop it picks, and what a loop keeps outside `state`."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from mgpu.record import check_hooks
from mgpu.check.batch_diff import Batch, compare_batches, compare_samples, pieced, read_batches
from mgpu.check.plan import choose_stop
from mgpu.check.state_diff import differences, flatten, hint, named, parameter_names
from tests.conftest import ROOT


def state(**changes: object) -> dict:
    base = {"format": 1, "code_version": "abc", "world_size": 2,
            "model": {"0.weight": torch.ones(2, 3), "0.bias": torch.zeros(2), "1.running_mean": torch.zeros(2),
                      "2.weight": torch.ones(4, 2)},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 3)},
                                    1: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)},
                                    2: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4, 2)}},
                          "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1, 2]}]},
            "scheduler": {"last_epoch": 3, "_last_lr": [0.1]},
            "rng": [{"torch": torch.arange(4)}, {"torch": torch.arange(4)}],
            "loader": {"epoch": 0, "position": 24},
            "ema": {"module.0.weight": torch.ones(2, 3), "n_averaged": torch.tensor(3)},
            "best": 0.5, "step_count": 3}
    flat = flatten(base)
    flat.update(changes)
    return flat


def test_flatten_names_every_leaf_by_its_path() -> None:
    flat = state()
    assert {"model.0.weight", "optimizer.state.0.exp_avg", "optimizer.param_groups.0.lr", "rng.rank1.torch",
            "loader.position", "scheduler.last_epoch", "best", "optimizer.param_groups.0.betas"} <= set(flat)
    assert flat["optimizer.param_groups.0.params"] == [0, 1, 2]  # a list of numbers is one value


@pytest.mark.parametrize("change, first, largest", [
    ({"loader.position": 32}, "loader.position", 8.0),
    ({"step_count": 4}, "step_count", 1.0),  # the loop's own counter before what it decides
    ({"scheduler._last_lr": [0.05], "optimizer.param_groups.0.lr": 0.05}, "scheduler._last_lr", 0.05),
    ({"rng.rank1.torch": torch.arange(1, 5)}, "rng.rank1.torch", 1.0),
    ({"optimizer.param_groups.0.betas": (0.8, 0.999)}, "optimizer.param_groups.0.betas", 0.1),
    ({"optimizer.state.2.exp_avg": torch.full((4, 2), 1.5), "model.2.weight": torch.full((4, 2), 2.0)},
     "optimizer.state.2.exp_avg", 0.5),
    ({"model.0.weight": torch.ones(3, 2)}, "model.0.weight", math.inf),  # another shape
    # The loop's own module (an EMA) ranks with the model: the learning rate a counter set is named first.
    ({"ema.module.0.weight": torch.full((2, 3), 2.0), "optimizer.param_groups.0.lr": 0.05},
     "optimizer.param_groups.0.lr", 0.05),
    ({"ema.n_averaged": torch.tensor(2), "rng.rank1.torch": torch.arange(1, 5)}, "ema.n_averaged", 1.0),  # a counter
    ({"best": 0.25, "model.2.weight": torch.full((4, 2), 2.0)}, "model.2.weight", 1.0),  # a metric follows
    ({"extra": 1}, "extra", math.inf),  # present in one state only
])
def test_the_first_difference_is_the_cause_before_its_consequences(change: dict, first: str, largest: float) -> None:
    found = differences(state(), state(**change))
    assert found[0].path == first
    assert found[0].largest == pytest.approx(largest)
    assert len(found) == len(change)


def test_bookkeeping_and_skipped_prefixes_are_not_differences() -> None:
    assert differences(state(), state(world_size=1, code_version="def")) == []
    assert differences(state(), state(**{"rng.rank1.torch": torch.zeros(4, dtype=torch.long)}), skip=["rng"]) == []


def test_a_tolerance_is_relative_to_the_values() -> None:
    a, b = state(), state(**{"model.0.weight": torch.ones(2, 3, dtype=torch.float32) + 2 ** -20})
    assert differences(a, b)[0].largest == 2 ** -20
    assert differences(a, b, tolerance=1e-5) == []


def test_optimizer_moments_are_named_by_their_parameter_in_order_and_shape() -> None:
    flat = state()
    names = parameter_names(flat)
    # model.1.running_mean is a buffer, not a parameter: the third moment belongs to model.2.weight
    assert names == {"optimizer.state.0": "model.0.weight", "optimizer.state.1": "model.0.bias",
                     "optimizer.state.2": "model.2.weight"}
    assert named("optimizer.state.2.exp_avg", names) == "optimizer.state.2.exp_avg (model.2.weight)"


def _hint(first: str, **kw: object) -> str:
    found = differences(state(), state(**{first: "changed"}))
    options = {"outside": {}, "world_changed": False, "batches_differ": False, "has_scheduler": True,
               "no_batches": False}
    options.update(kw)
    return hint(found, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("first, options, phrase", [
    ("loader.position", {}, "the data differs"),
    ("model.0.weight", {"no_batches": True, "outside": {"dl": "DataLoader (DataLoader)"}},
     "`dl` is a DataLoader of your own, which starts its epoch over on a resume"),
    # No DataLoader held: the loop's own order (random.shuffle at an epoch's start) is the RNG the hint names.
    ("rng.rank0.python", {"no_batches": True}, "an RNG stream differs (Python's `random` (random.shuffle"),
    ("model.0.weight", {"no_batches": True, "outside": {"order": "generator (Generator)"}},
     "every saved entry before them agrees (the loop's own data is not compared: it does not come from "
     "session.loader): objects of yours not in `state`: `order` (generator (Generator))"),
    # A step counter in a variable sets the LR: no scheduler anywhere, none blamed.
    ("optimizer.param_groups.0.lr", {"has_scheduler": False}, "the loop has no scheduler: it sets them from something "
     "not in `state` (a step counter in a variable of yours restarts at 0 on a resume)"),
    ("step_count", {}, "your own entry `step_count` differs: a counter"),
    ("model.0.weight", {"batches_differ": True, "outside": {"train_loader": "DataLoader (DataLoader)"}},
     "`train_loader` is a DataLoader of your own"),
    ("scheduler.last_epoch", {"world_changed": True}, "the scheduler was built from len(loader)"),
    ("scheduler.last_epoch", {}, "the scheduler's state differs"),
    ("optimizer.param_groups.0.lr", {"has_scheduler": False, "outside": {"sched": "scheduler (LambdaLR)"}},
     "a scheduler of yours not in `state` restarts its schedule on a resume (not in `state`: `sched`"),
    ("rng.rank0.torch", {}, "an RNG stream differs"),
    ("model.1.running_mean", {}, "a module updated outside its forward"),
    ("model.0.weight", {}, "an object of yours not in `state`"),
    ("model.0.weight", {"outside": {"ema": "module (AveragedModel)", "val": "DataLoader (DataLoader)"}},
     "objects of yours not in `state`: `ema` (module (AveragedModel))"),
])
def test_each_kind_of_difference_gets_its_hint(first: str, options: dict, phrase: str) -> None:
    said = _hint(first, **options)
    assert phrase in said, said
    if "ema" in options.get("outside", {}):
        assert "`val`" not in said  # an evaluation loader decides no step


def batches(*items: tuple[int, int, int, str]) -> list[Batch]:
    return [Batch(step, epoch, position, tuple(samples), None) for step, epoch, position, samples in items]


def test_batches_are_read_with_the_step_they_ended_in(tmp_path: Path) -> None:
    path = tmp_path / "batches.rank0.jsonl"
    lines = [{"epoch": 0, "position": 4, "samples": ["a", "b"], "ids": [0, 1]}, {"step": 1},
             {"epoch": 0, "position": 8, "samples": ["c", "d"], "ids": None}, {"step": 2},
             {"epoch": 0, "position": 12, "samples": ["e", "f"], "ids": None}]  # read, never stepped on
    path.write_text("\n".join(map(json.dumps, lines)) + "\n{\"epoch\": 0, \"posi")  # a line cut by a kill
    assert read_batches(path) == [Batch(1, 0, 4, ("a", "b"), (0, 1)), Batch(2, 0, 8, ("c", "d"), None)]
    assert read_batches(tmp_path / "none") == []


def test_the_same_batches_pass_and_a_lost_and_repeated_sample_is_counted() -> None:
    unbroken = {0: batches((1, 0, 2, "ab"), (2, 0, 4, "cd"), (3, 0, 6, "ef"))}
    stopped = batches((1, 0, 2, "ab"), (2, 0, 4, "cd"))
    assert compare_batches(unbroken, {0: pieced(stopped, batches((3, 0, 6, "ef")), 2)}).same
    # A source that forgot its buffer: the resumed run trains c again and never e.
    verdict = compare_batches(unbroken, {0: pieced(stopped, batches((3, 0, 6, "cf")), 2)})
    assert (verdict.lost, verdict.repeated) == (1, 1)
    assert verdict.first.startswith("rank 0's batch at step 3 (epoch 0, position 6)")
    short = compare_batches(unbroken, {0: stopped})
    assert "the unbroken run trained 1 more batch(es), from step 3" in short.first


def test_samples_compare_as_a_multiset_across_world_sizes() -> None:
    two_ranks = batches((1, 0, 4, "ab"), (1, 0, 4, "cd"))
    one_rank = batches((1, 0, 4, "acbd"))
    assert compare_samples(two_ranks, one_rank).same
    assert compare_samples(two_ranks, batches((1, 0, 4, "acba"))).first.startswith("epoch 0: 1 sample(s)")


def test_digests_follow_the_sample_not_the_batch() -> None:
    x, y = torch.arange(12.0).reshape(4, 3), torch.tensor([0, 1, 0, 1])
    whole = check_hooks.digest_samples((x, y))
    halves = check_hooks.digest_samples((x[:2], y[:2])) + check_hooks.digest_samples({"x": x[2:], "y": y[2:]})
    assert len(set(whole)) == 4
    assert whole[:2] == halves[:2]
    assert check_hooks.digest_samples([x[:1], y[:1]]) == whole[:1]
    assert check_hooks.digest_samples((x, torch.tensor([0, 1, 0, 0]))) != whole


@pytest.mark.parametrize("ends, total, stop", [
    ([4, 8], 8, 2),  # 4 steps an epoch: a third of 8 is 2, mid-epoch
    ([3, 6, 9], 9, 2),  # a third is step 3, which ends an epoch: 2 and 4 are as near (the earlier)
    ([1, 2, 3], 3, 1),  # every step ends an epoch: no mid-epoch step, a third of the way
])
def test_the_stop_is_mid_epoch_about_a_third_of_the_way(ends: list[int], total: int, stop: int) -> None:
    records, epoch, first = [], 0, 1
    for end in ends:
        records += [Batch(step, epoch, step - first + 1, ("x",), None) for step in range(first, end + 1)]
        epoch, first = epoch + 1, end + 1
    assert choose_stop(records, total) == stop


def _records(ends: list[int]) -> list[Batch]:
    records, epoch, first = [], 0, 1
    for end in ends:
        records += [Batch(step, epoch, step - first + 1, ("x",), None) for step in range(first, end + 1)]
        epoch, first = epoch + 1, end + 1
    return records


@pytest.mark.parametrize("ends, total, stops", [
    ([4, 8], 8, [(2, "epoch 0, position 2"), (4, "the end of epoch 0"), (5, "epoch 1, position 1")]),
    ([6, 12, 18], 18, [(6 - 1, "epoch 0, position 5"), (6, "the end of epoch 0"), (11, "epoch 1, position 5")]),
    ([8], 8, [(2, "epoch 0, position 2")]),  # one epoch: mid-epoch only
    ([], 8, [(2, ""), (5, "")]),  # no batch records (the loop's own data): a third and two thirds of the way
])
def test_the_stops_are_in_the_first_epoch_at_its_end_and_in_a_later_one(ends: list[int], total: int,
                                                                        stops: list[tuple[int, str]]) -> None:
    from mgpu.check.plan import choose_stops

    assert [(x.step, x.where) for x in choose_stops(_records(ends), total)] == stops


def test_what_a_loop_keeps_outside_its_state_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(check_hooks.CHECK_DIR, str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # set by torch's first optimizer otherwise
    net = nn.Linear(2, 2)
    model = nn.Sequential(net)  # the wrapped one in the state; `net` inside it is held
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # not in the state
    ema = copy.deepcopy(model)  # an average of the weights, not in the state
    loop_state = {"model": model, "optimizer": optimizer}
    check_hooks.record_outside(0, loop_state, sys._getframe(0))
    (written,) = tmp_path.glob("outside.rank0.*.json")
    assert json.loads(written.read_text()) == {"scheduler": "scheduler (LambdaLR)", "ema": "module (Sequential)"}
    del net, scheduler, ema


def test_the_hooks_do_nothing_without_the_checker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(check_hooks.CHECK_DIR, raising=False)
    monkeypatch.chdir(tmp_path)
    check_hooks.record_batch(0, 0, 4, torch.ones(2, 2))
    check_hooks.record_step(0, 1)
    check_hooks.record_outside(0, {}, sys._getframe(0))
    assert list(tmp_path.iterdir()) == []


def parsed(*argv: str) -> Any:
    from mgpu.check.resume import parse_args, target_from

    return target_from(parse_args(list(argv)), ROOT)


def test_the_command_line_makes_each_runs_command() -> None:
    own = parsed("--", "tests/own_loop.py", "{run}", "--epochs", "1")
    assert own.command(Path("/s/run")) == [sys.executable, str(ROOT / "tests/own_loop.py"), "/s/run", "--epochs", "1"]
    assert own.halved_args is None  # a loop of one's own: no world-size change without --world-args
    resized = parsed("--world-args=--accumulate 2", "--", "tests/own_loop.py", "{run}")
    assert resized.command(Path("/r"), halved=True)[-3:] == ["/r", "--accumulate", "2"]
    assert parsed("--nproc", "3", "--world-args=--accumulate 2", "--", "tests/own_loop.py", "{run}").halved_args is None
    trainer = parsed("--config", "jobs/configs/mnist.yaml", "data.global_batch_size=128")
    assert trainer.halved_args == []  # the accumulation follows the world size
    assert trainer.command(Path("/t"))[-3:] == ["data.global_batch_size=128", "run.dir=/t", "checkpoint.keep_last=1000"]
    assert parsed("--config", "jobs/configs/mnist.yaml").halved_args is None  # a per-rank batch


def test_where_the_objects_outside_state_end_is_digested(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the end, a digest of each object `record_outside` found (one name per object: the first): equal states
    give equal digests, a state moved on another; a DataLoader's cannot be read (None)."""
    import random as python_random

    import numpy as np
    from torch.utils.data import DataLoader

    monkeypatch.setenv(check_hooks.CHECK_DIR, str(tmp_path))

    def loop(draws: int) -> dict[str, Any]:
        torch.manual_seed(0)
        model = nn.Linear(2, 2)
        teacher = nn.Linear(2, 1)
        order = np.random.default_rng(0)
        shuffler = python_random.Random(1)
        dropout = torch.Generator().manual_seed(2)
        batches = DataLoader(list(range(4)))
        alias = teacher  # noqa: F841  (the same object under a second name: named once)
        for _ in range(draws):
            order.permutation(4), shuffler.random(), torch.rand(1, generator=dropout)
        with torch.no_grad():
            teacher.weight.fill_(float(draws))
        check_hooks.record_outside(0, {"model": model}, sys._getframe(0))
        check_hooks.record_outside_end(0)
        (written,) = tmp_path.glob("outside_end.rank0.*.json")
        ends: dict[str, Any] = json.loads(written.read_text())
        written.unlink()
        for path in tmp_path.glob("outside.rank0.*.json"):
            assert "alias" not in json.loads(path.read_text())
            path.unlink()
        del batches
        return ends

    once, again, twice = loop(1), loop(1), loop(2)
    assert set(once) == {"teacher", "order", "shuffler", "dropout", "batches"} and once["batches"] is None
    assert once == again
    assert all(twice[name] != once[name] for name in ("teacher", "order", "shuffler", "dropout"))


def test_a_hung_ranks_line_is_read_from_its_stacks() -> None:
    from mgpu.check.failures import innermost

    log = """12:00:01 [rank 1] ERROR no progress for 5 s in phase model of step 4 (allowance 2 s): dumping every thread's stack
Thread 0x00007f01 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/x/mgpu/stop/watchdog.py", line 400 in _watch

Current thread 0x00007f02 (most recent call first):
  File "/x/mgpu/stop/watchdog.py", line 458 in _dump_stacks

Thread 0x00007f00 (most recent call first):
  File "/x/torch/nn/modules/module.py", line 1500 in _call_impl
  File "/work/loops/train.py", line 88 in main
  File "/work/loops/train.py", line 120 in <module>
"""
    again = log + "12:00:02 [rank 1] ERROR another rank found a hang: dumping every thread's stack\n"  # said twice
    assert innermost(again, Path("loops/train.py")) == innermost(log, Path("loops/train.py"))
    assert innermost(log, Path("loops/train.py")) == ("/x/torch/nn/modules/module.py line 1500 (in _call_impl), from "
                                                      "/work/loops/train.py line 88 (in main)")
    assert innermost(log.replace("module.py", "train.py").replace("/x/torch/nn/modules/", "/work/loops/"),
                     Path("train.py")).startswith("/work/loops/train.py line 1500")
    assert innermost("no stacks here", Path("train.py")) is None
