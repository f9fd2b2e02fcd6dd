"""mgpu.Session's API without silent wrong results, in process (a world of one, a real gloo group): plain values
come back, a state a checkpoint cannot hold is refused at load(), a save over checkpoints the session did not load
is refused, a key the checkpoint lacks is named, hyperparameters change only on purpose, misuse is one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from mgpu.config.loading import Config
from mgpu.errors import MgpuError
from mgpu.record.ledger import read_ledger
from mgpu.state.resumption import resume_line
from mgpu.run.session import Session


@pytest.fixture(autouse=True)
def world_of_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    for name in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "MGPU_RESUME_COMMAND", "MGPU_RUN_DIR_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # torch's own side effect
    yield


def session(run: Path, **options: Any) -> Session:
    config = Config()
    config.watchdog.enabled = False
    from mgpu.cluster.environment import detect_environment

    return Session(run, seed=0, config=config, env=detect_environment({}), **options)


def parts(lr: float = 0.01) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler}


def train(state: Any, s: Session, steps: int) -> None:
    for _ in range(steps):
        loss = state["model"](torch.ones(3, 4)).sum()
        loss.backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()
        state["scheduler"].step()
        s.should_stop()


def said(capsys: pytest.CaptureFixture[str]) -> str:
    """What rank 0 printed (its log lines go to stdout)."""
    return capsys.readouterr().out


def test_plain_values_come_back_to_the_loop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    with session(run) as s:
        state = s.load({**parts(), "best": 0.0})
        train(state, s, 3)
        state.best = 0.75  # the blog's best_score, kept where it is saved
        s.save(state, wait=True)
    with session(run) as s:
        given = {**parts(), "best": 0.0}
        state = s.load(given)
        assert state.best == 0.75 and state["best"] == 0.75 and given["best"] == 0.75  # one mapping, restored
        assert s.step == 3
    assert f"resumed at step 3 from {run / 'checkpoints'}" in said(capsys)


class EarlyStopper:  # the blog's: a plain class, no state_dict
    def __init__(self) -> None:
        self.best, self.bad = 0.0, 0


@pytest.mark.parametrize("value, where", [
    (EarlyStopper(), "state['early']"),
    ([1, {"deep": EarlyStopper()}], "state['early'][1]['deep']"),
])
def test_a_state_a_checkpoint_cannot_hold_is_refused_at_load(tmp_path: Path, value: Any, where: str) -> None:
    run = tmp_path / "run"
    s = session(run)
    with pytest.raises(MgpuError) as info:
        with s:
            s.load({**parts(), "early": value})
            raise AssertionError("load() accepted it")  # before any training
    message = str(info.value)
    assert message.startswith(f"{where} is a EarlyStopper, which a checkpoint cannot save and restore")
    assert "state_dict() and load_state_dict(state)" in message and "@dataclass" in message
    assert "add_safe_globals" not in message
    assert not (run / "checkpoints").exists()


@dataclasses.dataclass
class Inner:
    seen: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Stopper:
    best: float = 0.0
    bad: int = 0
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_a_dataclass_is_saved_and_restored_in_place(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with session(run) as s:
        stopper = Stopper()
        state = s.load({**parts(), "early": stopper})
        train(state, s, 2)
        stopper.best, stopper.bad, stopper.inner.seen = 0.5, 2, [1, 2]
        s.save(state, wait=True)
    with session(run) as s:
        stopper = Stopper()
        inner = stopper.inner
        s.load({**parts(), "early": stopper})
        assert stopper == Stopper(0.5, 2, Inner([1, 2])) and stopper.inner is inner  # the loop's own objects


def test_a_save_over_checkpoints_this_session_did_not_load_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with session(run) as s:
        state = s.load(parts())
        train(state, s, 3)
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    s = session(run)
    with pytest.raises(MgpuError, match=r"has a checkpoint \(step 3\) that this session did not load: call "
                                        r"session.load\(state\) .* fresh=True"):
        with s:  # a loop that forgot load(): trains from 0 and saves
            state = parts()
            train(state, s, 3)
            s.save(state, wait=True)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == saved
    with session(run) as s:  # the explicit new start: the old checkpoints are kept aside
        state = s.load(parts(), fresh=True)
        assert s.step == 0
        train(state, s, 1)
    (aside,) = run.glob("checkpoints.replaced-*")
    assert sorted(p.name for p in aside.iterdir()) == saved
    assert [e["step"] for e in read_ledger(run / "events.jsonl") if e["event"] == "finished"] == [3, 1]


def test_a_state_key_the_checkpoint_lacks_is_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with session(run) as s:
        train(s.load(parts()), s, 2)
    s = session(run)
    with pytest.raises(MgpuError, match=r"the checkpoint holds no 'ema' .*load\(state, missing_ok=\{'ema'\}\)"):
        with s:
            s.load({**parts(), "ema": 0.0})
    with session(run) as s:
        state = s.load({**parts(), "ema": 0.5}, missing_ok={"ema"})
        assert state.ema == 0.5 and s.step == 2


def test_learning_rate_changes_only_on_purpose_and_is_recorded(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    with session(run) as s:
        train(s.load(parts(lr=0.01)), s, 3)  # the schedule's factor is now 1/4
    with session(run) as s:
        state = s.load(parts(lr=0.001))  # an edited --lr: the checkpoint's wins, with a warning
        assert state.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 / 4)
        train(state, s, 1)
    assert "optimizer lr: the loop set 0.001, the checkpoint's 0.01 is used" in said(capsys)
    with session(run) as s:
        state = s.load(parts(lr=0.01), override={"lr": 0.1, "momentum": 0.5})
        group = state.optimizer.param_groups[0]
        assert (group["initial_lr"], group["momentum"], state.scheduler.base_lrs) == (0.1, 0.5, [0.1])
        assert group["lr"] == pytest.approx(0.1 / 5)  # the schedule goes on from where it stands, at the new scale
        train(state, s, 1)
        assert state.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 6)
    (event,) = [e for e in read_ledger(run / "events.jsonl") if e["event"] == "hyperparameters"]
    assert event["step"] == 4 and event["changes"] == ["optimizer lr: 0.01 -> 0.1", "optimizer momentum: 0.9 -> 0.5"]
    with pytest.raises(MgpuError, match="override 'nesterov_x': optimizer .SGD. has no hyperparameter"):
        with session(run) as s:
            s.load(parts(), override={"nesterov_x": True})


def test_a_finished_run_run_again_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    with session(run) as s:
        train(s.load(parts()), s, 2)
    with session(run) as s:
        s.load(parts())
    assert f"run {run} had finished at step 2 (its final checkpoint)" in said(capsys)


@pytest.mark.parametrize("status", ["stopped", "finished"])
def test_the_loops_own_last_save_is_the_only_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 status: str) -> None:
    """The trainer's way: the loop saves its last step itself (wait=True); end() acts on that checkpoint and
    does not save (or ask the checkpointer) again. A loop that did not save its last step gets it from end()."""
    s = session(tmp_path / "run")
    state = s.load(parts())
    train(state, s, 2)
    saved = s.save(wait=True, reason="preemption" if status == "stopped" else "final")
    calls: list[str] = []
    monkeypatch.setattr(s.checkpointer, "save", lambda *args, **kwargs: calls.append("save"))
    s.end(status)
    assert calls == [] and saved is not None and saved.name == "step_00000002"
    other = session(tmp_path / "other")
    train(other.load(parts()), other, 1)
    other.end("finished")
    assert [e["step"] for e in read_ledger(tmp_path / "other" / "events.jsonl") if e["event"] == "checkpoint_saved"] == [1]


def test_the_test_stop_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MGPU_STOP_AT_STEP (what jobs/train.py --stop-at-step sets) is the test stop's one path: a stop as if
    preempted after that step, its checkpoint saved at once; a bad value is one line before any training."""
    monkeypatch.setenv("MGPU_STOP_AT_STEP", "2")
    s = session(tmp_path / "run")
    state = s.load(parts())
    answers = []
    for _ in range(3):
        train(state, s, 0)
        answers.append(s.should_stop())
    assert answers == [False, True, False] and s.reasons == {"test"}
    assert [e["step"] for e in read_ledger(tmp_path / "run" / "events.jsonl") if e["event"] == "checkpoint_saved"] == [2]
    s.end()
    monkeypatch.setenv("MGPU_STOP_AT_STEP", "soon")
    with pytest.raises(MgpuError, match="MGPU_STOP_AT_STEP='soon': must be a step number >= 1"):
        session(tmp_path / "bad")


def test_misuse_is_one_clear_line(tmp_path: Path) -> None:
    from mgpu.cluster.environment import detect_environment

    with pytest.raises(MgpuError, match="Session.config=.... takes a mgpu.Config, got a dict"):
        Session(tmp_path / "x", config={"train": {"seed": 1}}, env=detect_environment({}))  # type: ignore[arg-type]
    s = session(tmp_path / "run")
    model = s.wrap(nn.Linear(2, 2))
    for wrapped in (model, nn.parallel.DistributedDataParallel(nn.Linear(2, 2))):  # wrap(wrap(m)), on any world
        with pytest.raises(MgpuError, match=r"Session.wrap\(\): this model is wrapped already"):
            s.wrap(wrapped)
    with pytest.raises(MgpuError, match="takes a dataset with len.. and .index..*got a range_iterator"):
        s.loader(iter(range(10)), batch_size=2)  # type: ignore[arg-type]
    with pytest.raises(MgpuError, match="Session.load.. takes a dict .*got a list"):
        s.load([parts()["model"]])  # type: ignore[arg-type]
    with pytest.raises(MgpuError, match="Session.save.. takes the state mapping .*got a list"):
        s.save([parts()["model"]])  # type: ignore[arg-type]
    s.finish()
    with pytest.raises(MgpuError, match=r"Session.should_stop\(\) after finish\(\)"):
        s.should_stop()


@pytest.mark.parametrize("world, saved, batch, saved_global, expected", [
    (2, 2, 64, 128, "resumed at step 7 (epoch 1, sample 96) from /r/step_7 on 2 ranks"),
    # "was": the saved run's own global batch (its checkpoint's record), not this run's per-rank batch x its world
    (2, 4, 64, 256, "resumed at step 7 (epoch 1, sample 96) from /r/step_7 on 2 ranks (saved on 4: the global batch is "
                    "now 128 samples, was 256)"),
    # the per-rank batch was doubled to keep it (saved 2 x 8, now 1 x 16): it stays (it said "now 16, was 32")
    (1, 2, 16, 16, "resumed at step 7 (epoch 1, sample 96) from /r/step_7 on 1 rank (saved on 2: the global batch "
                   "stays 16 samples)"),
    # the same world, another per-rank batch: said too
    (2, 2, 32, 128, "resumed at step 7 (epoch 1, sample 96) from /r/step_7 on 2 ranks (the global batch is now 64 "
                    "samples, was 128)"),
    # an older checkpoint (no record of its global batch): no guess at "was"
    (2, 4, 64, None, "resumed at step 7 (epoch 1, sample 96) from /r/step_7 on 2 ranks (saved on 4: the global batch "
                     "is now 128 samples)"),
    (1, 2, None, None, "resumed at step 7 (epoch 1, sample 96) from /r/step_7 on 1 rank (saved on 2)"),
    # data.global_batch_size=256, 32 a rank per micro-step: the accumulation follows the world size
    ((2, 256), 4, 32, 256, "resumed at step 7 (epoch 1, sample 96) from /r/step_7 on 2 ranks (saved on 4: the global "
                           "batch stays 256 samples (data.global_batch_size), accumulated over 4 micro-steps per "
                           "step, was 2)"),
    ((8, 256), 4, 32, None, "resumed at step 7 (epoch 1, sample 96) from /r/step_7 on 8 ranks (saved on 4: the global "
                            "batch stays 256 samples (data.global_batch_size), accumulated over 1 micro-step per "
                            "step, was 2)"),
    ((4, 256), 4, 32, 256, "resumed at step 7 (epoch 1, sample 96) from /r/step_7 on 4 ranks"),
    # data.global_batch_size set on resume to the saved run's global batch (its advice): it stays
    ((1, 16), 2, 8, 16, "resumed at step 7 (epoch 1, sample 96) from /r/step_7 on 1 rank (saved on 2: the global "
                        "batch stays 16 samples (data.global_batch_size), accumulated over 2 micro-steps per step, "
                        "was 1)"),
])
def test_the_resume_line(world: int | tuple[int, int], saved: int, batch: int | None, saved_global: int | None,
                         expected: str) -> None:
    world, global_batch = world if isinstance(world, tuple) else (world, None)
    assert resume_line(7, {"epoch": 1, "position": 96}, Path("/r/step_7"), world, saved, batch,
                       global_batch, saved_global) == expected


def test_a_changed_global_batch_warns_with_the_steps_per_epoch_and_how_to_keep_them() -> None:
    """Steps per epoch change with the global batch: a schedule sized from len(loader) would jump mid-run. The
    warning names data.global_batch_size (trainer) and how a loop of one's own keeps its schedule."""
    from mgpu.state.resumption import schedule_warning

    assert schedule_warning(16, 16, 1000) is None and schedule_warning(16, None, 1000) is None
    line = schedule_warning(8, 16, 1000)
    assert line is not None and "\n" not in line
    assert line.startswith("the global batch changed on resume: 8 samples per step, was 16; an epoch is 125 steps "
                           "now, was 63"), line
    assert "the trainer: data.global_batch_size=16" in line and "load(state, global_batch=16)" in line, line
    assert "loader.steps_per_epoch(16)" in line, line


@pytest.mark.parametrize("drop_last", [False, True])
def test_steps_per_epoch_at_a_global_batch_are_the_same_on_any_world_size(drop_last: bool) -> None:
    """What a loop that keeps its global batch sizes its schedule from: len(loader) changes with the world size,
    loader.steps_per_epoch(global_batch) does not, and bounds the steps the loop makes (exact without drop_last)."""
    from mgpu.data.loader import ResumableLoader

    loaders = [ResumableLoader(list(range(100)), 4, rank=0, world_size=world, drop_last=drop_last)
               for world in (1, 2, 4)]
    assert [len(loader) for loader in loaders] == ([25, 12, 6] if drop_last else [25, 13, 7])
    assert [loader.steps_per_epoch(16) for loader in loaders] == [7, 7, 7]
    for loader, world in zip(loaders, (1, 2, 4)):  # 16 samples a step: 4 / world micro-batches of 4 x world
        accum = 16 // (4 * world)
        steps = -(-len(loader) // accum)
        assert steps == 7 or (drop_last and steps == 6), (world, steps)
    with pytest.raises(ValueError, match="at least 1 sample"):
        loaders[0].steps_per_epoch(0)


def test_a_save_records_the_global_batch_and_a_resume_on_another_batch_warns(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each checkpoint records the run's global batch (batch_size x ranks, or global_batch); a resume compares its
    own with it: "was" is the saved run's, and a change warns."""
    import json

    run = tmp_path / "run"
    with session(run) as s:
        state = s.load(parts(), batch_size=16)
        train(state, s, 2)
        s.save(state, wait=True)
    meta = json.loads((run / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["extra"]["global_batch"] == 16
    said(capsys)
    with session(run) as s:
        s.load(parts(), batch_size=8)
    out = said(capsys)
    assert "resumed at step 2 from" in out and "(the global batch is now 8 samples, was 16)" in out, out
    assert "the global batch changed on resume: 8 samples per step, was 16" in out, out


def test_an_optimizer_built_before_the_fsdp_wrap_is_refused_at_load(tmp_path: Path) -> None:
    """The order that works with DDP (optimizer, then wrap) holds the parameters FSDP2 replaced: it would train
    nothing, then fail the first sharded save in DCP (KeyError). Refused at load(), one line naming the fix."""
    s = session(tmp_path / "run")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    model = s.wrap(net, parallel="fsdp")
    with pytest.raises(MgpuError) as info:
        s.load({"model": model, "optimizer": optimizer})
    message = str(info.value)
    assert "\n" not in message and message.startswith("state['optimizer'] optimizes 4 parameter(s) that are not the "
                                                      "state's models'"), message
    assert "build the optimizer after wrap" in message, message
    # Built after the wrap: accepted, and a step then changes the sharded weights.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = s.load({"model": model, "optimizer": optimizer})
    before = [p.detach().full_tensor().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    state["model"](torch.ones(2, 4)).sum().backward()
    optimizer.step()
    assert all(not torch.equal(a, p.detach().full_tensor()) for a, p in zip(before, model.parameters()))  # type: ignore[attr-defined]
    s.should_stop()
    s.save(wait=True)
    s.finish()


def test_wraps_that_cannot_work_are_one_line_at_the_call(tmp_path: Path) -> None:
    """Wrapping twice under FSDP2, FSDP2 then DDP (and DDP then FSDP2), a model without parameters under FSDP2,
    and FSDP2 with single-file checkpoints: an MgpuError at wrap() (bad input: exit 2, never requeued), instead
    of torch's AssertionError / NotImplementedError or a crash at the first save."""
    s = session(tmp_path / "run")
    sharded = s.wrap(nn.Linear(4, 2), parallel="fsdp")
    for parallel in ("fsdp", "ddp"):
        with pytest.raises(MgpuError, match=r"^Session.wrap\(\): this model is sharded with FSDP2 already"):
            s.wrap(sharded, parallel=parallel)
    with pytest.raises(MgpuError, match=r"^Session.wrap\(\): this model is sharded with FSDP2 already"):
        s.wrap(nn.Sequential(nn.ReLU(), sharded))  # a part of it
    plain = s.wrap(nn.Linear(4, 2))  # one rank: the module itself
    with pytest.raises(MgpuError, match=r"^Session.wrap\(\): this model is wrapped already"):
        s.wrap(plain, parallel="fsdp")
    with pytest.raises(MgpuError, match=r"^Session.wrap\(parallel='fsdp'\): the ReLU has no parameters, nothing to "
                                        r"shard: wrap it without parallel='fsdp'$"):
        s.wrap(nn.ReLU(), parallel="fsdp")
    s.finish()
    config = Config()
    config.watchdog.enabled = False
    config.checkpoint.format = "single"
    from mgpu.cluster.environment import detect_environment

    single = Session(tmp_path / "single", seed=0, config=config, env=detect_environment({}))
    with pytest.raises(MgpuError, match=r"^Session.wrap\(parallel='fsdp'\) with checkpoint.format=single: a "
                                        r"single-file checkpoint cannot hold a sharded model"):
        single.wrap(nn.Linear(4, 2), parallel="fsdp")
    single.finish()


def test_an_uncaught_exception_in_a_loop_without_with_is_recorded(tmp_path: Path) -> None:
    """A loop that ends with session.finish() (not `with`) and raises: the session's sys.excepthook (what Python
    calls for an exception that ends the process) records the failure as leaving `with` would; status says so.
    Once the session ended, the hook is gone."""
    import sys

    from mgpu.record.runview import summarize

    s = session(tmp_path / "run")
    s.load(parts())
    installed = sys.excepthook
    assert getattr(installed, "__module__", None) == "mgpu.run.uncaught"
    try:
        raise ValueError("the loop's bug")
    except ValueError as error:
        sys.excepthook(type(error), error, error.__traceback__)  # as the interpreter does, the process dying
    events = read_ledger(tmp_path / "run" / "events.jsonl")
    failed = [e for e in events if e["event"] == "failed"]
    assert [(e["error"], e["retry"]) for e in failed] == [("ValueError: the loop's bug", True)], failed
    assert summarize(events)["state"] == "failed: ValueError: the loop's bug"
    assert sys.excepthook is not installed  # the ended session's hook is uninstalled


@pytest.mark.parametrize("kind", ["one_cycle", "cyclic"])
def test_an_lr_override_scales_the_whole_cycle_of_a_cyclic_schedule(kind: str) -> None:
    # Issue 46: OneCycleLR keeps its peak and floor (max_lr, min_lr) in the param group and follows them at every
    # step; an `lr` override changed only its base, so after the warmup the schedule went back to the old peak.
    from mgpu.state import hparams

    def built(peak: float) -> tuple[torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        optimizer = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=peak, momentum=0.9)
        if kind == "one_cycle":
            return optimizer, torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=peak, total_steps=40)
        return optimizer, torch.optim.lr_scheduler.CyclicLR(optimizer, base_lr=peak / 10, max_lr=peak, step_size_up=7)

    def run(optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> list[float]:
        lrs = []
        for _ in range(steps):
            optimizer.step()
            scheduler.step()
            lrs.append(optimizer.param_groups[0]["lr"])
        return lrs

    saved_opt, saved_schedule = built(0.01)
    run(saved_opt, saved_schedule, 12)  # into the cycle: the stop's checkpoint
    resumed_opt, resumed_schedule = built(0.02)
    resumed_opt.load_state_dict(saved_opt.state_dict())
    resumed_schedule.load_state_dict(saved_schedule.state_dict())
    base = resumed_opt.param_groups[0]["initial_lr"]
    hparams.apply({"optimizer": resumed_opt, "scheduler": resumed_schedule}, {"lr": 2 * base})
    reference_opt, reference_schedule = built(0.02)  # the run at twice the rate from the start
    expected = run(reference_opt, reference_schedule, 40)[12:]
    assert run(resumed_opt, resumed_schedule, 28) == pytest.approx(expected, rel=1e-9)


def test_a_sessions_seed_and_config_are_checked_as_a_yamls_before_anything(tmp_path: Path) -> None:
    # Issue 46: Session(seed=2**64) was torch's "Overflow when unpacking long long" from inside the start, and a
    # Config edited in Python (batch_size 10**30) reached the run unchecked.
    from mgpu.cluster.environment import detect_environment
    from mgpu.config.loading import ConfigError

    edited = Config()
    edited.data.batch_size = 10**30
    for options, expected in [({"seed": 2**64}, "train.seed: must fit in 64 bits"),
                              ({"seed": -1}, "train.seed: must be in [0, 4294967296), got -1"),
                              ({"config": edited}, "data.batch_size: must fit in 64 bits")]:
        with pytest.raises(ConfigError) as refused:
            Session(tmp_path / "run", env=detect_environment({}), **options)
        assert expected in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()


def test_a_loop_that_never_asks_should_stop_is_told_at_its_end(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # Issue 46: such a loop trains, ends at step 0 and is never stopped together nor saved at a stop: say so.
    from torch.utils.data import TensorDataset

    with session(tmp_path / "run") as s:
        loader = s.loader(TensorDataset(torch.zeros(12, 4)), batch_size=3)
        state = s.load({**parts(), "loader": loader})
        for (x,) in loader:
            state.model(x).sum().backward()
            state.optimizer.step()
    assert ("the loop ended at step 0 after its loader read 12 samples: it never asked session.should_stop()"
            in said(capsys))
    with session(tmp_path / "asked") as s:
        state = s.load({**parts(), "loader": s.loader(TensorDataset(torch.zeros(12, 4)), batch_size=3)})
        train(state, s, 2)
    assert "never asked" not in said(capsys)
