"""A Session's snapshots in memory across a restart, in process (a world of one, a real gloo group, the snapshots in
a temporary directory): a change the durable resume accepts (optim.lr) keeps them, a change of the training does
not (one line), a restart with snapshots off removes them. The digest's keys against the durable resume's rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from mgpu.config.loading import Config, config_to_dict, flatten_config
from mgpu.config.resume_compat import is_safe_to_change
from mgpu.record.ledger import read_ledger
from mgpu.run.session import Session
from mgpu.state.memory.content import config_digest
from mgpu.state.memory.store import BASE_ENV
from tests.test_session_api import world_of_one  # noqa: F401  # the fixture: no launcher, a world of one


@pytest.fixture(autouse=True)
def snapshots_here(world_of_one: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv(BASE_ENV, str(tmp_path / "shm"))
    yield


def session(run: Path, **changes: Any) -> Session:
    from mgpu.cluster.environment import detect_environment

    config = Config()
    config.watchdog.enabled = False
    config.checkpoint.every_steps = 0
    config.checkpoint.memory_every_steps = 1
    for key, value in changes.items():
        section, name = key.split("__")
        setattr(getattr(config, section), name, value)
    return Session(run, seed=0, config=config, env=detect_environment({}))


def parts() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)}


def crash_at(run: Path, steps: int) -> None:
    """A run that took a snapshot at each of `steps` steps and then failed (no durable checkpoint)."""
    s = session(run)
    state = s.load(parts())
    for _ in range(steps):
        state["model"](torch.ones(3, 4)).sum().backward()
        state["optimizer"].step()
        s.should_stop()
    s.fail(RuntimeError("the crash"))


def test_a_change_the_durable_resume_accepts_keeps_the_snapshots(tmp_path: Path) -> None:
    run = tmp_path / "run"
    crash_at(run, 3)
    with session(run, optim__lr=0.5, train__epochs=9, data__num_workers=2) as s:  # safe to change on resume
        s.load(parts())
        assert s.step == 3 and s.resumed_from is None
    resumed = [e for e in read_ledger(run / "events.jsonl") if e["event"] == "resumed"]
    assert [(e["step"], e.get("memory")) for e in resumed] == [(3, True)]


def test_a_change_of_the_training_refuses_them_in_one_line_each(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    crash_at(run, 3)
    capsys.readouterr()
    with session(run, data__batch_size=7) as s:
        s.load(parts())
        assert s.step == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "not restored: stale: taken with config=" in line]
    assert len(said) == 2 and all(line.endswith("(another config: a key a resume may not change differs)")
                                  for line in said), said  # both slots


def test_a_restart_with_snapshots_off_removes_them(tmp_path: Path) -> None:
    run = tmp_path / "run"
    crash_at(run, 2)
    assert [p.name for p in (tmp_path / "shm").iterdir()] != []
    with session(run, checkpoint__memory_every_steps=0) as s:
        s.load(parts())
        assert s.step == 0
        assert list((tmp_path / "shm").iterdir()) == []


def test_the_digest_leaves_out_exactly_the_keys_a_durable_resume_accepts() -> None:
    """Every key of the config, changed alone: the snapshots' config digest changes where the durable resume
    refuses the change (mgpu.config.resume_compat.check_resume_compatible), and only there."""
    default = config_to_dict(Config())
    before = config_digest(default)
    for key in flatten_config(default):
        section, *path = key.split(".")
        changed = {**default, section: _set(default[section], path, "changed")}
        assert (config_digest(changed) == before) == is_safe_to_change(key), key


def _set(tree: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    head, *rest = path
    return {**tree, head: _set(tree[head], rest, value) if rest else value}
