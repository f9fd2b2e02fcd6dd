"""mgpu.EMA in one process (a world of one): the average is timm's (lerp of every parameter, floating buffers
averaged, the others copied, from the model's weights at construction), tied weights stay tied, `applied()` gives the
model the average and its own weights back bit for bit, what would be silently wrong is one line, and the average
saves, resumes and loads into a plain module (`mgpu.load_model(run, model, ema=True)`). Under DDP and FSDP2 across
real ranks: tests/test_fsdp.py (an own loop and the trainer, stopped and resumed, sharded like the model)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import mgpu
from mgpu.errors import MgpuError
from mgpu.parallel.ema import EMA, ema_weights
from tests.test_session_api import parts, session, train, world_of_one  # noqa: F401  (the fixture, by name)


class Tied(nn.Module):
    """An embedding tied to its output layer, and a BatchNorm (floating statistics, an integer counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("cache", torch.ones(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(x)))


def steps(model: nn.Module, count: int, ema: EMA | None = None) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(count):
        model(torch.randint(0, 10, (8,), generator=generator)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if ema is not None:
            ema.update()


def test_the_average_is_a_lerp_of_every_weight_with_buffers_averaged_and_counters_copied() -> None:
    torch.manual_seed(0)
    model = Tied()
    ema = EMA(model, decay=0.9)
    expected = {k: v.clone() for k, v in model.state_dict().items()}  # the first copy: the weights at construction
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        model(torch.randint(0, 10, (8,))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        for key, value in model.state_dict().items():
            expected[key] = expected[key].lerp(value, 0.1) if value.is_floating_point() else value.clone()
    saved = ema.state_dict()
    assert sorted(saved) == sorted(["n_averaged", *(f"module.{k}" for k in model.state_dict())])
    assert "module.cache" not in saved  # a non-persistent buffer is not the model's state either
    for key, value in expected.items():
        assert torch.equal(saved[f"module.{key}"], value), key
    assert ema.updates == 4 and saved["module.norm.num_batches_tracked"].item() == 4
    assert ema.module.head.weight is ema.module.embed.weight  # tied in the average as in the model
    assert not any(p.requires_grad for p in ema.parameters())


def test_applied_gives_the_model_the_average_and_its_own_weights_back_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = Tied()
    ema = EMA(model, decay=0.5)
    steps(model, 3, ema)
    own, average = copy.deepcopy(model.state_dict()), copy.deepcopy(ema_weights(ema.state_dict()))
    with ema.applied() as inside:
        assert inside is model
        assert all(torch.equal(model.state_dict()[k], v) for k, v in average.items())
        with pytest.raises(MgpuError, match=r"a save inside `with ema.applied\(\):`"):
            ema.state_dict()
        with pytest.raises(MgpuError, match=r"EMA.update\(\) inside `with ema.applied\(\):`"):
            ema.update()
        with pytest.raises(MgpuError, match="inside another"):
            with ema.applied():
                pass
    assert all(torch.equal(model.state_dict()[k], v) for k, v in own.items())
    assert all(torch.equal(ema_weights(ema.state_dict())[k], v) for k, v in average.items())
    with pytest.raises(RuntimeError), ema.applied():  # an exception inside: the weights still come back
        raise RuntimeError("evaluation failed")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in own.items())
    with pytest.raises(MgpuError, match="evaluate the model inside `with ema.applied"):
        ema.module(torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize("decay, message", [
    (1.0, r"EMA\(decay=1.0\): a number in \[0, 1\)"), (float("nan"), "a number in"), (True, "a number in"),
    ("0.9", "a number in"),
])
def test_a_decay_outside_0_1_is_one_line(decay: Any, message: str) -> None:
    with pytest.raises(MgpuError, match=message):
        EMA(nn.Linear(2, 2), decay=decay)


def test_an_ema_of_parameters_the_model_no_longer_has_is_refused_at_load(tmp_path: Path) -> None:
    """As `session.wrap(model, parallel="fsdp")` does, the model's parameters replaced after the EMA was made: it
    would average weights that no longer train."""
    model = nn.Linear(4, 2)
    ema = EMA(model)
    model.weight = nn.Parameter(model.weight.detach().clone())
    with pytest.raises(MgpuError, match=r"mgpu.EMA: the model's parameters are not those the EMA was made of .*make "
                                        r"the EMA after wrap"):
        ema.update()
    with session(tmp_path / "run") as s, pytest.raises(MgpuError, match="make the EMA after wrap"):
        s.load({"model": model, "ema": ema})


def test_an_ema_in_the_state_resumes_exactly_and_loads_into_a_plain_module(tmp_path: Path) -> None:
    run, unbroken = tmp_path / "run", tmp_path / "unbroken"

    def segment(where: Path, count: int) -> dict[str, Any]:
        with session(where) as s:
            state = parts()
            state["ema"] = mgpu.EMA(state["model"], decay=0.8)
            state = s.load(state)
            for _ in range(count):
                train(state, s, 1)
                state["ema"].update()
            s.save(state, wait=True)
            return copy.deepcopy(state["ema"].state_dict())

    segment(run, 2)
    resumed = segment(run, 3)  # steps 3-5, from step 2's checkpoint
    reference = segment(unbroken, 5)
    assert all(torch.equal(resumed[k], v) for k, v in reference.items()) and resumed["n_averaged"].item() == 5
    plain = mgpu.load_model(run, nn.Linear(4, 2), which="latest", ema=True)
    assert torch.equal(plain.weight, reference["module.weight"])
    assert not torch.equal(plain.weight, mgpu.load_model(run, nn.Linear(4, 2), which="latest").weight)
    with pytest.raises(MgpuError, match=r"holds no 'teacher' \(it has 'model', 'optimizer', 'scheduler', 'ema'"):
        mgpu.load_model(run, ema="teacher")
