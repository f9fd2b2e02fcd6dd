"""The marks of every step's end (mgpu.state.memory.step_mark), in one process: what a survivor's save holds of the
marked step (the small objects as they were at the mark, the parameters and optimizer states as they are, the derived
RNG), when it can say nothing (no mark yet, an optimizer stepped since), who may take it (a per-rank object makes
it this rank's alone), and the generators re-seeded from (seed, rank, step) alone; the watchdog's trigger (a stop
signal whose step does not end) against a fake clock."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from mgpu.state.memory.content import STEP
from mgpu.state.rng import capture_rng_state, seed_step, step_rng_state
from mgpu.state.memory.step_mark import StepMarks


@dataclass
class Progress:
    step: int = 0
    best: float = 0.0


class PerRank:
    """An object with a per-rank state (a stateful stream's position): a survivor's save is its rank's alone."""

    def __init__(self) -> None:
        self.position = 0

    def rank_state_dict(self) -> dict[str, int]:
        return {"position": self.position}


@pytest.fixture(autouse=True)
def _inductor_cache(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the optimizer's first step sets it


def loop(per_rank: bool = False) -> tuple[dict[str, Any], nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "progress": Progress(),
                             "tokens": 0}
    if per_rank:
        state["stream"] = PerRank()
    return state, model, optimizer


def step(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    state["model"](torch.ones(3, 4)).sum().backward()
    optimizer.step()
    state["scheduler"].step()
    state["progress"].step += 1


def marks_of(state: dict[str, Any]) -> StepMarks:
    return StepMarks(lambda: state, lambda: [], rank=1, world_size=2, seed=7, version="v")


def test_a_survivors_save_holds_the_marked_step_whatever_the_next_step_changed_before_its_optimizer() -> None:
    state, model, optimizer = loop()
    marks = marks_of(state)
    assert marks.state()[2] == "no step has ended yet"
    step(state, optimizer)
    marks.mark(1)
    weights = model.weight.detach().clone()
    lr = optimizer.param_groups[0]["lr"]
    # The next step's start: its batch fetched, the loop's counters moved, a forward and backward; no optimizer step.
    state["progress"].step, state["progress"].best, state["tokens"] = 99, 0.5, 1234
    model(torch.ones(3, 4)).sum().backward()
    saved, share, why = marks.state()
    assert why == "" and saved is not None and share is not None and share.any_rank
    assert saved[STEP] == 1 and saved["progress"] == {"step": 1, "best": 0.0} and saved["tokens"] == 0
    assert torch.equal(saved["model"]["weight"], weights) and saved["scheduler"]["last_epoch"] == 1
    assert saved["optimizer"]["param_groups"][0]["lr"] == lr
    assert saved["rng"][0] is None and torch.equal(saved["rng"][1]["torch"], step_rng_state(7, 1, 1)["torch"])
    optimizer.step()  # the next step's optimizer: the parameters are no longer the mark's
    assert marks.state()[0] is None and "an optimizer stepped after step 1 ended" in marks.state()[2]
    marks.mark(2)
    assert marks.state()[0] is not None
    marks.close()


def test_a_per_rank_object_makes_a_survivors_save_its_ranks_alone() -> None:
    state, _, optimizer = loop(per_rank=True)
    marks = marks_of(state)
    step(state, optimizer)
    state["stream"].position = 40
    marks.mark(1)
    state["stream"].position = 44
    saved, share, _ = marks.state()
    assert saved is not None and share is not None and not share.any_rank
    assert saved["stream"] == {"per_rank": [None, {"position": 40}]}
    marks.close()


def test_a_ranks_generators_after_a_step_are_a_function_of_seed_rank_and_step_alone() -> None:
    draws = []
    for noise in (0, 1):
        random.seed(noise), np.random.seed(noise), torch.manual_seed(noise)  # whatever came before
        seed_step(3, 1, 17)
        draws.append((random.random(), float(np.random.rand()), float(torch.rand(()))))
    assert draws[0] == draws[1]
    seed_step(3, 0, 17)
    other_rank = (random.random(), float(np.random.rand()), float(torch.rand(())))
    seed_step(3, 1, 18)
    next_step = (random.random(), float(np.random.rand()), float(torch.rand(())))
    assert len({draws[0], other_rank, next_step}) == 3
    before = capture_rng_state()
    derived = step_rng_state(3, 1, 17)  # what seed_step would leave, without touching this process's generators
    assert torch.equal(capture_rng_state()["torch"], before["torch"])
    seed_step(3, 1, 17)
    assert torch.equal(capture_rng_state()["torch"], derived["torch"])


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("beat_after_signal, waited, said", [
    (False, 1.0, False),  # within the bound: the step may end yet
    (False, 2.5, True),  # the step the signal came in still runs: a peer died, srun's SIGKILL comes next
    (True, 10.0, False),  # the rank went on (a step ended, an evaluation batch): its own stop saves as always
])
def test_the_watchdog_says_the_last_words_when_a_stop_signals_step_does_not_end(
        tmp_path: Any, beat_after_signal: bool, waited: float, said: bool) -> None:
    from mgpu.stop.watchdog import Watchdog

    clock = Clock()
    dog = Watchdog(0, 2, tmp_path, step_multiple=10, floor_s=60, first_step_s=60, checkpoint_s=60,
                   on_hang=lambda *a: None, clock=clock)
    dog.beat("forward", 5)
    heard: list[str] = []
    dog.last_words = heard.append
    dog.signalled = lambda: 1000.5
    clock.now = 1000.5 + waited
    if beat_after_signal:
        dog.beat("backward")
    dog._after_signal()
    dog._after_signal()  # once at most
    import time

    deadline = time.monotonic() + 5
    while said and not heard and time.monotonic() < deadline:  # said on a bounded helper thread
        time.sleep(0.01)
    assert len(heard) == (1 if said else 0), heard
    if said:
        assert "step 5 has not ended" in heard[0]


def test_no_survivors_save_while_an_ema_is_in_the_model_for_an_evaluation() -> None:
    # `with ema.applied():` swaps the average into the model: its parameters are not the step's then.
    import mgpu

    state, model, optimizer = loop()
    state["ema"] = ema = mgpu.EMA(model, decay=0.9)
    marks = marks_of(state)
    step(state, optimizer)
    ema.update()
    marks.mark(1)
    with ema.applied():
        assert marks.state()[0] is None and "EMA" in marks.state()[2]
    assert marks.state()[0] is not None
    marks.close()


def test_a_mark_copies_nested_plain_values_and_objects_deep_even_one_that_holds_itself() -> None:
    """The mark's own copy (pickled, not copy.deepcopy, for its cost at every step) is as deep: nothing the next step
    does in place reaches the survivor's save, whether the mark copied the object or reused an unchanged one's copy;
    a list that holds itself is copied too; 1 and 1.0 are told apart."""
    state, model, optimizer = loop()
    history: dict[str, Any] = {"losses": [1.0, 2.0], "seen": {"a": [1, (2, [3])]}, "scale": torch.ones(2)}
    loops: list[Any] = [1]
    loops.append(loops)
    state.update(history=history, loops=loops)
    marks = marks_of(state)
    step(state, optimizer)
    marks.mark(1)
    history["losses"].append(3.0)
    history["seen"]["a"][1][1].append(4)
    history["scale"].add_(1)
    loops[0] = 2
    saved, _, why = marks.state()
    assert why == "" and saved is not None
    assert saved["history"]["losses"] == [1.0, 2.0] and saved["history"]["seen"] == {"a": [1, (2, [3])]}
    assert torch.equal(saved["history"]["scale"], torch.ones(2))
    assert saved["loops"][0] == 1 and saved["loops"][1] is saved["loops"]
    # Marks of unchanged objects reuse their copy; a change, even to an equal value of another type, is copied.
    state["tokens"] = 1
    marks.mark(2)
    marks.mark(3)
    history["losses"].append(5.0)
    state["tokens"] = 1.0
    assert marks.state()[0]["history"]["losses"] == [1.0, 2.0, 3.0] and type(marks.state()[0]["tokens"]) is int
    marks.mark(4)
    saved = marks.state()[0]
    assert saved["history"]["losses"] == [1.0, 2.0, 3.0, 5.0] and type(saved["tokens"]) is float
    marks.close()


def test_plain_data_is_copied_as_deep_as_the_pickled_copy_and_as_type_exact() -> None:
    """A mark copies plain data (atoms, and lists, tuples and dicts of them, one level down in a dict) without
    pickling it: still nothing done in place after the mark reaches the save, 1, 1.0 and True stay apart, a tuple
    that holds a list is not shared, and an object that stops being plain data is copied as deep from then on."""
    state, _, optimizer = loop()
    plain: dict[str, Any] = {"losses": [1.0, 2.0], "best": {"acc": 1}, "flag": True, "pair": (1, 2)}
    held = ([1], 2)
    state.update(plain=plain, held=held, counts=[1, 2])
    marks = marks_of(state)
    step(state, optimizer)
    marks.mark(1)
    plain["losses"].append(3.0)
    plain["best"]["acc"] = 1.0
    plain["flag"] = 1
    held[0].append(2)
    state["counts"].append(3)
    saved = marks.state()[0]
    assert saved is not None
    assert saved["plain"] == {"losses": [1.0, 2.0], "best": {"acc": 1}, "flag": True, "pair": (1, 2)}
    assert type(saved["plain"]["best"]["acc"]) is int and type(saved["plain"]["flag"]) is bool
    assert saved["held"] == ([1], 2) and saved["counts"] == [1, 2]
    marks.mark(2)
    saved = marks.state()[0]
    assert type(saved["plain"]["best"]["acc"]) is float and type(saved["plain"]["flag"]) is int
    plain["best"]["acc"] = [7]  # no longer plain data one level down: copied deep
    marks.mark(3)
    plain["best"]["acc"].append(8)
    assert marks.state()[0]["plain"]["best"] == {"acc": [7]}
    marks.mark(4)
    plain["losses"].clear()
    saved = marks.state()[0]
    assert saved["plain"]["best"] == {"acc": [7, 8]} and saved["plain"]["losses"] == [1.0, 2.0, 3.0]
    marks.close()


class FakeDDP:
    """What the marks use of a DDP: its module (a single process has no process group to wrap one)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module


@pytest.mark.parametrize("recorded", [True, False], ids=["record written", "record failing"])
def test_rank_0s_save_holds_its_buffers_of_the_mark_after_the_next_forward(tmp_path: Any, recorded: bool) -> None:
    """Rank 0's buffers at the mark are in its save though the next forward changed them: read back from its record
    where the mark wrote it (no copy at that forward), else copied at that forward as on every other rank."""
    from mgpu.state.memory.buffer_record import BufferRecord
    from mgpu.state.memory.store import Identity, SnapshotStore

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer}
    ddp = FakeDDP(model)
    marks = StepMarks(lambda: state, lambda: [ddp], rank=0, world_size=2, seed=7, version="v")
    directory = tmp_path / "rank0-buffers" if recorded else tmp_path / "file"
    if not recorded:
        directory.write_text("")  # a file where its directory would be: the record cannot be written
    marks.record = BufferRecord(SnapshotStore(directory, Identity("7", 0, "run", "cfg", 2, 0, "shape")))
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    marks.mark(1)
    mean, count = model[1].running_mean.clone(), model[1].num_batches_tracked.clone()
    model(torch.randn(5, 4)).sum().backward()  # the next step's forward: batch norm's statistics move on
    assert not torch.equal(model[1].running_mean, mean)
    saved, share, why = marks.state()
    assert why == "" and saved is not None and share is not None and share.rank0_buffers
    assert torch.equal(saved["model"]["1.running_mean"], mean) and torch.equal(saved["model"]["1.num_batches_tracked"],
                                                                                count)
    assert (marks.buffers == {}) is recorded  # no copy at the forward where the record holds them
    marks.record.close()
    marks.close()
