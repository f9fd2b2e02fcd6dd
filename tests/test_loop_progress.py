"""A loop of one's own in the ledger and in status, in process: `session.log` writes the trainer's `progress`
event (step, the loader's epoch, the metrics, the models' fingerprint) every log.every_steps, reads a tensor only
when due, refuses what is not a number in one line; the read model shows such a run's epoch, metrics and loss
curve, says there is no ETA rather than make one up, and says a stop that stays down stays down. The same on real
ranks: tests/test_own_loop.py (DDP) and tests/test_fsdp.py (FSDP2, the fingerprint a collective)."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from mgpu.config.loading import Config
from mgpu.cluster.environment import detect_environment
from mgpu.errors import MgpuError
from mgpu.parallel.fsdp import weights_fingerprint
from mgpu.record.goodput import segments
from mgpu.record.ledger import read_ledger
from mgpu.record.runview import describe, progress_line, summarize, verify
from mgpu.run.session import Session
from mgpu.record.timeline import loss_curves
from tests.test_goodput import ev


@pytest.fixture(autouse=True)
def world_of_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    for name in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "MGPU_RESUME_COMMAND", "MGPU_RUN_DIR_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    yield


def session(run: Path, every: int = 2) -> Session:
    config = Config()
    config.watchdog.enabled = False
    config.log.every_steps = every
    return Session(run, seed=0, config=config, env=detect_environment({}))


def progress(run: Path) -> list[dict[str, Any]]:
    return [e for e in read_ledger(run / "events.jsonl") if e["event"] == "progress"]


def test_log_writes_the_trainers_progress_event_when_due(tmp_path: Path) -> None:
    s = session(tmp_path / "run", every=2)
    model, head = s.wrap(nn.Linear(4, 3)), s.wrap(nn.Linear(3, 1))
    optimizer = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)
    loader = s.loader(TensorDataset(torch.randn(12, 4)), batch_size=4)  # 3 steps an epoch
    state = s.load({"model": model, "head": head, "optimizer": optimizer, "loader": loader})
    due, prints = [], {}
    for _ in loader.epochs(2):
        for (x,) in loader:
            loss = head(model(x)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if s.should_stop():
                break
            due.append(s.log(loss=loss, lr=0.1) if s.step != 4 else s.log({"loss": loss.item()}, extra=torch.tensor(7)))
            prints[s.step] = f"{weights_fingerprint(model)},{weights_fingerprint(head)}"  # the state's models, in order
    s.save(state)
    s.finish()
    assert due == [False, True, False, True, False, True]  # every 2nd step of 6, by the session's step
    events = progress(tmp_path / "run")
    assert [(e["step"], e["epoch"]) for e in events] == [(2, 0), (4, 1), (6, 1)]  # the loader's epoch
    assert all(type(v) is float for e in events for v in e["metrics"].values())
    assert set(events[0]["metrics"]) == {"loss", "lr"} and set(events[1]["metrics"]) == {"loss", "extra"}
    assert events[1]["metrics"]["extra"] == 7.0
    assert {e["step"]: e["fingerprint"] for e in events} == {step: prints[step] for step in (2, 4, 6)}
    # What status shows for it: the loader's epoch, the metrics, a loss curve, and --verify compares it.
    assert verify(tmp_path / "run", tmp_path / "run")[0] == 0
    assert loss_curves(segments(read_ledger(tmp_path / "run" / "events.jsonl")))[0][-1][1] == \
        events[-1]["metrics"]["loss"]


def test_a_metric_is_read_only_when_due(tmp_path: Path) -> None:
    # A meta tensor has no value to read: .item() on it raises. Not due: nothing is read (no host sync a step).
    s = session(tmp_path / "run", every=10)
    s.load({"model": s.wrap(nn.Linear(2, 2))})
    s.should_stop()
    assert s.log(loss=torch.empty((), device="meta")) is False
    assert progress(tmp_path / "run") == []
    s.finish()


@pytest.mark.parametrize("args, kwargs, message", [
    ((), {"loss": "0.5"}, r"Session.log\(loss=...\): a number or a one-element tensor, got a str"),
    ((), {"loss": torch.ones(3)}, r"Session.log\(loss=...\): a tensor of 3 values; give one number "
                                  r"\(e.g. loss.mean\(\)\)"),
    ((), {"done": True}, r"Session.log\(done=...\): a number or a one-element tensor, got a bool"),
    ((), {"flag": torch.tensor(True)}, r"Session.log\(flag=...\): a torch.bool tensor; give a real number"),
    ((), {"loss": None}, r"Session.log\(loss=...\): a number or a one-element tensor, got a NoneType"),
    (([0.5],), {}, r"Session.log\(\) takes a dict of metrics or name=value, got a list"),
])
def test_what_is_not_a_number_is_refused_in_one_line(tmp_path: Path, args: tuple[Any, ...], kwargs: dict[str, Any],
                                                      message: str) -> None:
    s = session(tmp_path / "run", every=10)
    s.load({"model": s.wrap(nn.Linear(2, 2))})
    s.should_stop()
    with pytest.raises(MgpuError, match=message):  # refused at a step that is not due too: found at the first call
        s.log(*args, **kwargs)
    assert progress(tmp_path / "run") == []
    s.finish()
    with pytest.raises(MgpuError, match=r"Session.log\(\) after finish\(\)"):
        s.log(loss=0.5)


def test_a_loop_without_a_loader_or_a_model_logs_what_it_has(tmp_path: Path) -> None:
    s = session(tmp_path / "run", every=0)  # 0: every call (the loop chooses when)
    s.load({"count": 0})
    s.should_stop()
    assert s.log(loss=float("nan")) and s.log(loss=1.5)
    s.finish()
    events = progress(tmp_path / "run")
    assert [("epoch" in e, e["fingerprint"], e["metrics"]["loss"]) for e in events][1:] == [(False, None, 1.5)]
    with pytest.raises(MgpuError, match="no fingerprints in its ledger .*a loop of one's own with session.log"):
        verify(tmp_path / "run", tmp_path / "run")


# ------------------------------------------------------------------- what status shows for a loop of one's own
def own_loop_events(now: float) -> list[dict[str, Any]]:
    """A loop of one's own as session.log writes it: no total_steps, no step_time_s; resumed in epoch 0."""
    def logged(t: float, step: int, epoch: int, loss: float) -> dict[str, Any]:
        return ev(now - t, "progress", job="local-1", step=step, epoch=epoch, metrics={"loss": loss, "accuracy": 0.5},
                  fingerprint="0x1p+0")

    return [ev(now - 100, "started", job="local-1", launcher="single"), ev(now - 99, "first_step", job="local-1", step=1),
            logged(95, 2, 0, 2.0), ev(now - 90, "preempted", job="local-1", step=3, reasons=["test"]),
            ev(now - 80, "started", job="local-1", launcher="single"),
            ev(now - 80, "resumed", job="local-1", step=3, epoch=0, position=24),
            logged(60, 4, 0, 1.0), logged(10, 8, 1, 0.5)]


def test_status_shows_an_own_loops_epoch_metrics_and_no_made_up_eta(tmp_path: Path) -> None:
    now = 1_800_000_000.0
    events = own_loop_events(now)
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    lines = describe(tmp_path, now=now)
    assert "progress    step 8, epoch 1; logged 10s ago" in lines, lines  # the epoch of the newest step, not the resume's
    assert "metrics     step 8: loss 0.5, accuracy 0.5" in lines, lines
    throughput = next(line for line in lines if line.startswith("throughput"))
    assert throughput.endswith("; no ETA: the run logs no total step count (a loop of its own)"), throughput
    assert "ETA" not in progress_line(summarize(events, now=now))
    assert [[loss for _, loss in curve] for curve in loss_curves(segments(events))] == [[2.0], [1.0, 0.5]]


def test_a_stop_that_stays_down_is_not_shown_as_a_pending_requeue() -> None:
    stopped = [ev(0, "started", job="local-1"), ev(5, "preempted", job="local-1", step=5, reasons=["test"])]
    assert summarize(stopped, now=9)["state"] == "stopped by a signal (requeue pending)"
    down = [*stopped, ev(6, "stop_decision", job="local-1", step=5, what="not_slurm", requeue=False,
                         reason="not a Slurm job: run the same command again to resume")]
    assert summarize(down, now=9)["state"] == ("stopped, stays down: not a Slurm job: run the same command again to "
                                               "resume")
    # The recovery's decision after a failure is not a stop's: the failure is the state.
    failed = [ev(0, "started"), ev(5, "failed", error="ValueError: x", rank=0),
              ev(6, "stop_decision", what="failed", requeue=False, reason="budget spent")]
    assert summarize(failed, now=9)["state"] == "failed: ValueError: x"


def test_an_own_loop_prints_the_trainers_progress_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 prints, when `log()` is due, the step (of `session.total_steps`), the epoch, the metrics, the pace
    since the last line and the ETA; the first line has no pace yet (a clock faked: 0.5 s a step)."""
    from mgpu.record import loop_progress

    times = iter(float(t) for t in range(0, 100))
    # loop_progress's clock alone (patching time.monotonic itself also fed the fake to whatever imported later: the
    # stop controller, imported by the session, took two ticks between the lines when no test had imported it first)
    monkeypatch.setattr(loop_progress, "time", types.SimpleNamespace(monotonic=lambda: next(times)))
    s = session(tmp_path / "run", every=2)
    s.total_steps = 10
    model = s.wrap(nn.Linear(4, 1))
    loader = s.loader(TensorDataset(torch.randn(20, 4)), batch_size=4)
    s.load({"model": model, "loader": loader})
    for step in range(1, 5):
        s.should_stop()
        s.log(loss=torch.tensor(0.25 * step))
    s.finish()
    # the progress lines (rank 0 also prints the timeout ladder as training starts, whose rungs name steps too)
    lines = [line.split(" ", 1)[1] for line in capsys.readouterr().out.splitlines()
             if re.match(r"\d\d:\d\d:\d\d step ", line)]
    assert lines == ["step 2/10 epoch 0  loss 0.5", "step 4/10 epoch 0  loss 1  2 steps/s  ETA 3s"], lines
    assert loop_progress.progress_line(7, None, None, {}, 1.5) == "step 7  1.5 steps/s"  # no total: no ETA
