"""A stop ends fast, and every step of its teardown is bounded: the loggers' (TensorBoard's close, wandb's finish;
mgpu.record.reporting), with the real wandb (offline, read back with its own schema) still finishing its run; the
process group's, once the outcome is recorded (the watchdog, within ENDED_TEARDOWN_S, with the outcome's exit
code); DDP's release without a full garbage collection; the command's own exit (mgpu.stop.process_exit: a stuck
thread or atexit handler cannot hold it, what does finish is kept). The figure, durable checkpoint to process
exit, is bench/stop_teardown.py's; tests/test_trainer.py's stop test reads back what a real stopped
`jobs/train.py` left after its fast exit."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest

from mgpu.record.reporting import Reporter, wandb_run_id
from tests.conftest import ROOT, base_env
from tests.wandb_log import wandb_history


class StuckRun:
    """A wandb run whose finish never returns on its own (a service that does not answer): only a fake can
    hang on demand."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.finishing = threading.Event()

    def finish(self) -> None:
        self.finishing.set()
        self.release.wait()


def test_a_logger_that_does_not_finish_does_not_hold_the_exit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    reporter = Reporter(True, tmp_path / "tb", total_steps=10, resume_step=0, progress_bar="off")
    reporter.scalars(1, {"loss": 1.0}, "train")
    stuck = StuckRun()
    reporter.wandb = stuck
    closer = threading.Thread(target=reporter.close, kwargs={"within_s": 0.5}, daemon=True)
    with caplog.at_level(logging.WARNING, logger="mgpu.train"):
        closer.start()
        closer.join(60)
    try:
        assert stuck.finishing.is_set()
        assert not closer.is_alive(), "Reporter.close() waited for a wandb finish that never ends"
        assert "wandb's finish did not end within" in caplog.text
        assert list((tmp_path / "tb").glob("events.out.tfevents.*"))  # TensorBoard closed before it
    finally:
        stuck.release.set()


def test_wandb_still_finishes_its_run_within_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    reporter = Reporter(True, None, total_steps=10, resume_step=0, progress_bar="off",
                        wandb={"id": wandb_run_id(run_dir), "project": "mgpu-test", "dir": str(run_dir)})
    for step in (1, 2):
        reporter.scalars(step, {"loss": 1.0 / step}, "train")
    try:
        reporter.close(within_s=60)  # generous here: the point is that finishing from a thread works
    finally:
        import wandb

        wandb.teardown()  # the service process this test started, as the process's exit would
        os.environ.pop("WANDB_SERVICE", None)
    (run_id, rows), = wandb_history(run_dir / "wandb")
    assert run_id == wandb_run_id(run_dir)
    assert [row["_step"] for row in rows if "train/loss" in row] == [1, 2]


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=base_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_a_commands_exit_waits_for_what_finishes_and_not_for_what_is_stuck(tmp_path: Path) -> None:
    done = tmp_path / "done"
    result = _python(f"""
        import atexit, threading, time
        from mgpu.stop.process_exit import exit_process

        atexit.register(lambda: open({str(done)!r}, "a").write("atexit\\n"))  # runs last (LIFO)
        atexit.register(lambda: time.sleep(3600))  # a handler that never ends
        def worker():
            time.sleep(0.2)
            open({str(done)!r}, "a").write("thread\\n")
        threading.Thread(target=worker).start()  # non-daemon: finishes within the bound
        threading.Thread(target=lambda: time.sleep(3600), name="stuck").start()  # non-daemon: never ends
        print("said before the exit", end="")  # unflushed: the exit flushes it
        exit_process(3, within_s=1.0)
    """)
    assert result.returncode == 3, result.stderr
    assert result.stdout == "said before the exit"
    assert done.read_text() == "thread\n"  # the stuck handler before it was cut short; the thread was waited for
    assert "exiting without waiting longer than 1.0 s for: stuck, atexit handlers" in result.stderr


def test_a_commands_exit_runs_the_atexit_handlers_and_keeps_a_system_exits_code(tmp_path: Path) -> None:
    done = tmp_path / "done"
    result = _python(f"""
        import atexit, logging, sys
        from mgpu.stop.process_exit import run_and_exit

        logging.basicConfig(filename={str(tmp_path / "log")!r}, level=logging.INFO)
        atexit.register(lambda: open({str(done)!r}, "w").write("ran"))
        def main():
            logging.getLogger("x").info("the last line")
            sys.exit("a SystemExit with a message")  # as a requeue's SystemExit(0) or argparse's
        run_and_exit(main)
    """)
    assert result.returncode == 1 and result.stderr.strip() == "a SystemExit with a message"
    assert done.read_text() == "ran"
    assert "the last line" in (tmp_path / "log").read_text()


def test_an_own_loops_exit_leaves_its_heap_to_the_system_only_when_the_interpreter_exits() -> None:
    result = _python("""
        import atexit, gc
        from mgpu.stop.process_exit import skip_collection_at_exit

        atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0))  # runs after mgpu's
        skip_collection_at_exit()
        skip_collection_at_exit()
        print("frozen before:", gc.get_freeze_count() > 0)  # a caller that goes on after a SystemExit
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["frozen before: False", "frozen at exit: True"]


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "MGPU_RESUME_COMMAND", "MGPU_RUN_DIR_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # torch's own side effect


def test_ddps_reducer_goes_before_the_group_without_a_full_collection(world_of_one: None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from torch import nn

    from mgpu.parallel.ddp import ResumableDDP
    from mgpu.parallel.distributed import process_group
    from mgpu.cluster.environment import detect_environment
    from mgpu.parallel.ddp import release_ddps

    collections: list[Any] = []
    real_collect = gc.collect

    def collect(*args: Any) -> int:
        collections.append(args)
        return real_collect(*args)

    monkeypatch.setattr(gc, "collect", collect)
    with process_group(detect_environment({})):
        for kind in (torch.nn.parallel.DistributedDataParallel, ResumableDDP):
            ddp = kind(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
            for _ in range(2):  # the reducer's rebuild included
                ddp(torch.randn(3, 4)).sum().backward()
            release_ddps([weakref.ref(ddp)])
            assert "reducer" not in ddp.__dict__ and "logger" not in ddp.__dict__
            assert collections == [], f"{kind.__name__}: a full collection where dropping the reducer freed it"
        held = ResumableDDP(nn.Linear(4, 2))
        elsewhere = [held.reducer]  # held elsewhere too (as a reference cycle would): then it collects
        release_ddps([weakref.ref(held)])
        assert len(collections) == 1
        del elsewhere


def test_a_stuck_group_teardown_after_a_stop_ends_within_the_bound_with_the_outcomes_code(
        world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The group's destroy hangs (a fake: a peer gone mid-teardown cannot be made to order): the watchdog ends
    the rank within ENDED_TEARDOWN_S (not TEARDOWN_S, 60 s), with the stop's code (3, it stays down), not 0."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from mgpu.config.loading import Config
    from mgpu.cluster.environment import detect_environment
    from mgpu.run.session import Session
    from mgpu.stop.watchdog import ENDED_TEARDOWN_S

    exits: list[int] = []
    release = threading.Event()
    real_destroy = dist.destroy_process_group

    def stuck_destroy(*args: Any, **kwargs: Any) -> None:
        release.wait(120)
        real_destroy(*args, **kwargs)

    monkeypatch.setattr(dist, "destroy_process_group", stuck_destroy)
    monkeypatch.setattr(logging, "shutdown", lambda *args: None)  # the watchdog's, on its way out: not pytest's
    config = Config()
    config.watchdog.enabled = True
    monkeypatch.setenv("MGPU_STOP_AT_STEP", "1")
    session = Session(tmp_path / "run", seed=0, config=config, env=detect_environment({}))
    assert session.watchdog is not None

    def watchdog_exit(code: int) -> None:  # instead of os._exit: this is pytest's process
        exits.append(code)
        release.set()

    session.watchdog.exit = watchdog_exit
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session.load({"model": model, "optimizer": optimizer})
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    assert session.should_stop()
    started = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        session.finish()
    waited = time.monotonic() - started
    assert exits == [3], (f"the watchdog's exit codes: {exits}, after {waited:.1f} s (the bound: "
                          f"{ENDED_TEARDOWN_S} s and polling)")
    assert stopped.value.code == 3
