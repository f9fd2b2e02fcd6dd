"""The watchdog: who is to blame (a table), the allowance it learns, and hung ranks on real gloo groups:
a rank asleep inside its loss, a frozen (SIGSTOPped) rank, a rank stuck in a checkpoint write."""

from __future__ import annotations

import os
import re
import signal
import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mgpu.config.loading import load_config
from mgpu.config.schema import WatchdogConfig
from mgpu.record.ledger import read_ledger
from mgpu.stop.hang_evidence import Heartbeat, blame
from mgpu.stop.watchdog import EVIDENCE_S, HANG_EXIT_CODE, SECOND_LOOK_MAX_S, STALE_AFTER_S, Watchdog
from tests.tasks import BlobTask
from tests.test_faults import finish_step, start_step

NOW = 1000.0


def hb(rank: int, step: int, phase: str, written: float = NOW - 1) -> Heartbeat:
    return Heartbeat(rank, f"n{rank // 2 + 1}", 100 + rank, step, phase, written - 5, written)


@pytest.mark.parametrize("beats, stuck", [
    ([hb(0, 5, "backward"), hb(1, 5, "forward")], [1]),                      # asleep in its loss
    ([hb(0, 5, "model"), hb(1, 5, "forward")], [1]),  # ... while the other waits in DDP's buffer broadcast
    ([hb(0, 5, "backward"), hb(1, 5, "backward", written=NOW - 60)], [1]),   # frozen: its file stopped
    ([hb(0, 5, "write"), hb(1, 5, "checkpoint-wait"), hb(2, 5, "checkpoint-wait")], [0]),  # rank 0's save
    ([hb(0, 7, "eval"), hb(1, 7, "agree"), hb(2, 7, "agree"), hb(3, 7, "agree")], [0]),    # one slow eval batch
    ([hb(0, 6, "data"), hb(1, 6, "forward"), hb(2, 6, "backward")], [0, 1]),  # behind the furthest
    ([hb(0, 5, "backward"), hb(1, 5, "backward")], []),                       # all waiting: nobody to blame
    ([hb(0, 4, "backward"), hb(1, 5, "backward")], [0]),                      # a step behind
    # bench/scale.py at 8 ranks: rank 3 still in DDP's buffer broadcast, which ended on the others first
    ([*(hb(r, 6, "backward") for r in (0, 1, 2, 4, 5, 6)), hb(3, 6, "model"), hb(7, 6, "forward")], [7]),
    ([hb(0, 6, "model"), hb(1, 6, "backward")], [0]),  # a waiting rank nobody is behind: it is the one
    ([], []),
])
def test_blame(beats: list[Heartbeat], stuck: list[int]) -> None:
    assert blame(beats, fresh_after=NOW - 8) == stuck


def test_a_rank_without_a_heartbeat_is_blamed() -> None:
    assert blame([hb(0, 5, "model"), hb(2, 5, "model")], NOW - 8, world=3) == [1]
    # The second look's verdict names a rank without a heartbeat too: named once (it was "1+1" in a hang event).
    assert blame([hb(0, 5, "model"), hb(2, 5, "model")], NOW - 8, world=3, frozen_ranks=[1]) == [1]


class Clock:
    """A clock the test moves by hand: `Watchdog(clock=...)`, so that no assertion depends on timing."""

    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def watchdog(clock: Clock, **allowances: float) -> Watchdog:
    settings = {"step_multiple": 10, "floor_s": 1, "first_step_s": 300, "checkpoint_s": 50, **allowances}
    return Watchdog(0, 1, Path("."), on_hang=lambda *args: None, clock=clock, **settings)  # type: ignore[arg-type]


def train_step(dog: Watchdog, clock: Clock, step: int, seconds: float) -> None:
    """One optimizer step's beats, as the trainer makes them, `seconds` long in all."""
    for phase in ("forward", "model", "backward", "optimizer"):
        dog.beat(phase, step) if phase == "forward" else dog.beat(phase)
        clock.tick(seconds / 4)


def evaluation(dog: Watchdog, clock: Clock, batches: int, seconds: float, agree_every: int = 0) -> None:
    """Evaluation batches `seconds` apart; every `agree_every` batches the ranks' stop agreement takes the
    second half of that time, as the trainer's does between two batches."""
    for index in range(batches):
        dog.beat("eval")
        if agree_every and (index + 1) % agree_every == 0:
            clock.tick(seconds / 2)
            dog.beat("agree")
            clock.tick(seconds / 2)
        else:
            clock.tick(seconds)


def test_the_allowance_is_learned_from_the_run() -> None:
    clock = Clock()
    dog = watchdog(clock, eval_s=30)
    assert dog.allowance() == 300  # before any step: the first step's allowance
    for step in range(1, 8):
        dog.beat("data", step)
        train_step(dog, clock, step, 0.2)
    dog.beat("data", 8)
    assert dog.allowance() == pytest.approx(2.0)  # 10 x the median step time (0.2 s)
    dog.beat("checkpoint")
    assert dog.allowance() == 50
    dog.beat("eval")
    assert dog.allowance() == 30  # no evaluation batch timed yet: eval_s


def test_a_steps_time_is_its_own_not_the_evaluation_or_checkpoint_after_it() -> None:
    # 0.2 s steps, each followed by a 5 s evaluation or checkpoint: the step allowance is 10 x 0.2 s, not
    # 10 x 5.2 s (a hang in a step would then wait 52 s instead of 2 s).
    clock = Clock()
    dog = watchdog(clock)
    for step in range(1, 9):
        dog.beat("data", step)
        train_step(dog, clock, step, 0.2)
        if step % 2:
            evaluation(dog, clock, 5, 1.0)
        else:
            dog.beat("checkpoint")
            clock.tick(5)
    dog.beat("data", 9)
    assert dog.allowance() == pytest.approx(2.0)


def test_a_resumed_runs_pending_evaluation_is_not_its_first_step() -> None:
    # A resume that first finishes an interrupted evaluation beats `data` of the same step before and after it.
    clock = Clock()
    dog = watchdog(clock)
    dog.beat("data", 11)
    evaluation(dog, clock, 3, 20.0)
    dog.beat("data", 11)
    train_step(dog, clock, 11, 0.2)
    dog.beat("data", 12)
    assert dog.allowance() == pytest.approx(2.0)


@pytest.mark.parametrize("agree_every", [0, 2])
def test_evaluation_has_its_own_allowance(agree_every: int) -> None:
    # 0.2 s steps (allowance: the 1 s floor); 0.05 s evaluation batches: their allowance is eval_s (20 s), more
    # than 10 x their median. The stop agreement between two batches belongs to the batch before it.
    clock = Clock()
    dog = watchdog(clock, eval_s=20)
    for step in range(1, 4):
        dog.beat("data", step)
        train_step(dog, clock, step, 0.2)
    dog.beat("eval")
    assert dog.allowance() == 20  # the first evaluation batch
    clock.tick(0.05)
    evaluation(dog, clock, 6, 0.05, agree_every)
    assert dog.allowance() == 20
    assert len(dog._eval_times) == 6 and all(t == pytest.approx(0.05) for t in dog._eval_times)
    evaluation(dog, clock, 10, 4.0, agree_every)  # slower batches: 10 x their median is more than eval_s
    assert dog.allowance() == pytest.approx(10 * statistics.median(dog._eval_times)) and dog.allowance() > 20
    dog.beat("data", 4)
    assert dog.allowance() == pytest.approx(2.0)  # back in a step: the step allowance, which evaluation never changed


def test_evaluation_allowance_falls_back_on_the_first_steps() -> None:
    # A caller that does not pass eval_s (mgpu.run.runner before it used Watchdog.from_config) keeps the
    # allowance evaluation had before it got its own: first_step_s for the first batch.
    dog = Watchdog(0, 1, Path("."), step_multiple=10, floor_s=1, first_step_s=300, checkpoint_s=50,
                   on_hang=lambda *args: None)
    dog.beat("eval")
    assert dog.allowance() == 300


def test_from_config_takes_every_allowance() -> None:
    config = WatchdogConfig(step_multiple=4, floor_s=7, first_step_s=70, eval_s=40, checkpoint_s=90)
    dog = Watchdog.from_config(config, 1, 2, Path("."), on_hang=lambda *args: None)
    assert (dog.rank, dog.world, dog.step_multiple, dog.floor_s, dog.first_step_s, dog.eval_s, dog.checkpoint_s) == \
        (1, 2, 4, 7, 70, 40, 90)


def test_a_hung_teardown_leaves_its_stacks_and_exits_with_the_code_given(tmp_path: Path) -> None:
    # The real watchdog thread, with the process's exit replaced by a record of it.
    exits: list[int] = []
    hangs: list[object] = []
    stacks = (tmp_path / "rank0.log").open("w+")
    dog = Watchdog(0, 2, tmp_path, step_multiple=10, floor_s=60, first_step_s=600, checkpoint_s=600,
                   on_hang=lambda *args: hangs.append(args), log_file=lambda: stacks, exit=exits.append)
    dog.start()
    try:
        dog.teardown(exit_code=0, allowance_s=1.0)  # and then the group's teardown never returns
        assert dog.allowance() == 1.0
        deadline = time.monotonic() + 30
        while not exits and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        dog.stop()
        stacks.close()
    assert exits == [0] and hangs == []  # nobody blamed: the others may have left already
    text = (tmp_path / "rank0.log").read_text()
    assert "most recent call first" in text and "test_a_hung_teardown" in text


def test_the_rank_that_finds_a_hang_leaves_only_once_the_others_stacks_are_written(tmp_path: Path) -> None:
    # Seen on the cluster: the stuck rank found its own hang first and exited; srun then killed the other
    # rank, still waiting in the all-reduce within its allowance, before it had written its stacks.
    logs = {rank: (tmp_path / f"rank{rank}.log").open("w+") for rank in range(2)}
    seen_at_exit: list[str] = []

    def exit_(code: int) -> None:
        logs[0].flush()
        seen_at_exit.append((tmp_path / "rank0.log").read_text())

    waiting = Watchdog(0, 2, tmp_path, step_multiple=10, floor_s=600, first_step_s=600, checkpoint_s=600,
                       on_hang=lambda *args: None, log_file=lambda: logs[0], exit=lambda code: None)
    stuck = Watchdog(1, 2, tmp_path, step_multiple=10, floor_s=1, first_step_s=1, checkpoint_s=1,
                     on_hang=lambda *args: None, log_file=lambda: logs[1], exit=exit_)
    waiting.start(), stuck.start()
    try:
        deadline = time.monotonic() + 60
        while not seen_at_exit and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        waiting.stop(), stuck.stop()
        for file in logs.values():
            file.close()
    assert seen_at_exit and "most recent call first" in seen_at_exit[0]
    assert "most recent call first" in (tmp_path / "rank1.log").read_text()


def test_a_teardown_that_ends_in_time_is_left_alone(tmp_path: Path) -> None:
    exits: list[int] = []
    dog = Watchdog(0, 2, tmp_path, step_multiple=10, floor_s=60, first_step_s=600, checkpoint_s=600,
                   on_hang=lambda *args: None, exit=exits.append).start()
    dog.teardown(allowance_s=30)
    dog.stop()
    assert dog._thread is not None and not dog._thread.is_alive() and exits == []
    assert not (tmp_path / "heartbeat-rank0.json").exists()


# ------------------------------------------------------------------------- a filesystem that does not answer
STALLED = r"""
import os, sys, time, logging
from pathlib import Path
from mgpu.stop.watchdog import Watchdog
logs = Path(sys.argv[1])
# A log whose writes block: a FIFO nobody reads, its pipe buffer filled (a stalled NFS write blocks the same).
fd = os.open(logs / "rank0.log", os.O_RDWR | os.O_NONBLOCK)
try:
    while True:
        os.write(fd, b"x" * 4096)
except BlockingIOError:
    pass
os.set_blocking(fd, True)
stream = os.fdopen(fd, "w")
logging.getLogger("mgpu").addHandler(logging.StreamHandler(stream))
dog = Watchdog(0, 1, logs / "board", step_multiple=10, floor_s=1, first_step_s=2, checkpoint_s=2,
               on_hang=lambda *args: time.sleep(3600),  # the ledger's write on the same filesystem
               log_file=lambda: stream).start()
print("started", flush=True)
dog.beat("forward", 1)
time.sleep(60)  # hung in the step
print("not ended", flush=True)
"""


@pytest.mark.multiprocess
def test_a_hang_is_ended_when_the_run_directory_does_not_answer(tmp_path: Path) -> None:
    # Every write of the evidence blocks (the log, the ledger): the hang is still found and the rank leaves
    # with HANG_EXIT_CODE within the evidence's bound, not never (before: logging.shutdown() blocked the exit).
    import subprocess
    import sys

    os.mkfifo(tmp_path / "rank0.log")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", STALLED, str(tmp_path)], capture_output=True, text=True,
                          timeout=90, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    elapsed = time.monotonic() - started
    assert proc.returncode == HANG_EXIT_CODE, proc.stdout + proc.stderr
    assert "started" in proc.stdout and "not ended" not in proc.stdout
    # allowance, poll, the stale heartbeat and its second look on a loaded machine (issue 32), evidence, shutdown
    assert elapsed < 2 + 1 + STALE_AFTER_S + SECOND_LOOK_MAX_S + EVIDENCE_S + 2 + 15, elapsed


@pytest.mark.multiprocess
def test_a_heartbeat_path_that_blocks_does_not_blind_the_watchdog(tmp_path: Path) -> None:
    # The reproduction: a FIFO where the heartbeat used to be written (logs/.heartbeat-rank<N>.json.tmp),
    # as an open() on a stalled NFS blocks. Before, the watchdog never started training and a 30 s hang under
    # a 2 s allowance was never found; now heartbeats never touch the run directory.
    (tmp_path / "logs").mkdir()
    for rank in range(2):
        os.mkfifo(tmp_path / "logs" / f".heartbeat-rank{rank}.json.tmp")
    procs = start_step(tmp_path, 2, *HANG, "task.args.mode=sleep", "task.args.rank=1", "task.args.at=8")
    results = finish_step(procs, timeout=120)
    assert [rc for rc, _ in results] == [HANG_EXIT_CODE] * 2, results[0][1][-2000:] + results[1][1][-2000:]
    (hang,) = [e for e in read_ledger(tmp_path / "events.jsonl") if e["event"] == "hang"]
    assert hang["ranks"] == [1] and hang["phases"]["1"] == "forward", hang


@pytest.mark.parametrize("configured, step_s, eval_s, expected", [
    (300, None, 300, 650),     # the defaults: the largest allowance (600 s) and the time to notice and leave evidence
    (2000, None, 300, 2000),   # a longer one asked for is kept
    (300, 100.0, 300, 1050),   # 100 s steps: 10 x the step time, then the margin
    (300, None, 900, 950),     # a longer first evaluation batch allowed
])
def test_the_collective_timeout_outlasts_every_allowance(configured: float, step_s: float | None, eval_s: float,
                                                         expected: float) -> None:
    dog = Watchdog(0, 2, Path("."), step_multiple=10, floor_s=60, first_step_s=600, checkpoint_s=600,
                   eval_s=eval_s, on_hang=lambda *args: None)
    if step_s is not None:
        dog._step_times.append(step_s)
    assert dog.collective_timeout(configured) == pytest.approx(expected)


class SlowEvalBlobTask(BlobTask):
    """BlobTask whose rank 0 takes `pause_s` longer over its `at`-th evaluation batch of `batch` samples, once."""

    def __init__(self, pause_s: float = 6.0, at: int = 3, batch: int = 3, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pause_s, self.at, self.batch, self.calls, self.paused = pause_s, at, batch, 0, False

    def metrics(self, model: torch.nn.Module, batch: tuple) -> dict[str, torch.Tensor]:
        if (dist.get_rank() if dist.is_initialized() else 0) == 0 and len(batch[0]) == self.batch:
            self.calls += 1  # the trainer's probe of the metrics (2 samples) does not count
            if self.calls == self.at and not self.paused:
                self.paused = True
                time.sleep(self.pause_s)
        return super().metrics(model, batch)


def test_a_slow_evaluation_batch_is_judged_by_the_evaluation_allowance(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # In process, a world of one: the real Trainer beats a real watchdog made from the config (as mgpu.run.session
    # makes it), whose exit is replaced by a record of it. Steps take milliseconds (allowance: the 2 s floor);
    # one evaluation batch takes 6 s, within the evaluation allowance (watchdog.eval_s, 20 s): not a hang.
    from mgpu.cluster.environment import detect_environment
    from mgpu.run.session import Session
    from mgpu.train.trainer import Trainer

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # torch's own side effect
    cfg = load_config(None, [f"task.target={__name__}:SlowEvalBlobTask", "task.args.eval_size=30",
                             "data.eval_batch_size=3", "data.batch_size=4", "train.epochs=1", "eval.every_steps=3",
                             "watchdog.floor_s=2", "watchdog.step_multiple=5", "watchdog.first_step_s=30",
                             "watchdog.eval_s=20", "watchdog.checkpoint_s=20", "log.tensorboard=false",
                             f"run.dir={tmp_path / 'run'}"])
    exits: list[int] = []
    task = SlowEvalBlobTask(eval_size=30)
    session = Session(config=cfg, env=detect_environment({}))  # its watchdog is made from the config
    assert session.watchdog is not None
    session.watchdog.exit = exits.append
    try:
        trainer = Trainer(cfg, task, session)
        result = trainer.fit()
        del trainer
    finally:
        session.end()
    assert task.paused and result.status == "finished"
    assert exits == []


# ------------------------------------------------------------------------- NCCL's flight recorder (no GPU here)
FR_VARIABLES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_BUFFER_SIZE",
                "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


@pytest.mark.parametrize("version, user, expected", [
    ("2.13.0+cpu", {}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                        "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": "/run/logs/nccl-timeout-trace-rank"}),
    ("2.10.0a0+git1234", {}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                              "TORCH_FR_BUFFER_SIZE": "2000",
                              "TORCH_FR_DUMP_TEMP_FILE": "/run/logs/nccl-timeout-trace-rank"}),
    # before 2.9 only the old names are read
    ("2.4.1", {}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/run/logs/nccl-timeout-trace-rank"}),
    # the user's own settings win; an old name the user set is not overridden by the new one
    ("2.13.0", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/mine/fr_",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}),
    ("2.13.0", {"TORCH_FR_BUFFER_SIZE": "100", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"},
     {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_FR_DUMP_TEMP_FILE": "/run/logs/nccl-timeout-trace-rank"}),
])
def test_the_flight_recorder_settings(version: str, user: dict[str, str], expected: dict[str, str]) -> None:
    from mgpu.parallel.distributed import nccl_environment

    assert nccl_environment(user, version, Path("/run/logs")) == expected


def test_an_nccl_group_is_formed_with_the_flight_recorder_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU and no NCCL here: torch's init_process_group is replaced by a record of what it was called with
    # and of the environment it would read. Everything before it in mgpu.parallel.distributed.process_group is real.
    from mgpu.parallel import distributed
    from mgpu.cluster.environment import detect_environment

    for name in FR_VARIABLES:  # absent now, and restored to absent afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # the user's choice is kept
    seen: list[tuple[str, dict[str, str]]] = []
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kwargs: seen.append(
        (kwargs["backend"], {name: os.environ[name] for name in FR_VARIABLES if name in os.environ})))
    with distributed.process_group(detect_environment({}), backend="nccl", trace_dir=tmp_path):
        pass
    assert seen == [("nccl", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                              "TORCH_FR_BUFFER_SIZE": "2000",
                              "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "nccl-timeout-trace-rank")})]


def test_a_gloo_group_leaves_the_nccl_settings_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from mgpu.parallel.distributed import process_group
    from mgpu.cluster.environment import detect_environment

    for name in FR_VARIABLES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    with process_group(detect_environment({}), backend="gloo"):
        assert not [name for name in FR_VARIABLES if name in os.environ]


# ------------------------------------------------------------------------- hung ranks, real gloo groups
HANG = ["task.target=tests.tasks:HangingBlobTask", "task.args.step_s=0.05", "train.epochs=30", "data.batch_size=4",
        "log.every_steps=1", "watchdog.floor_s=2", "watchdog.step_multiple=5", "watchdog.first_step_s=30",
        "watchdog.checkpoint_s=4", "log.tensorboard=false"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, rank, culprit_phase", [("sleep", 1, "forward"), ("stop", 1, None),
                                                       ("save", 0, "write")])
def test_a_hung_rank_is_found_named_and_ended(mode: str, rank: int, culprit_phase: str | None,
                                              tmp_path: Path) -> None:
    extra = ["checkpoint.every_steps=1", "checkpoint.async_save=false"] if mode == "save" else []
    procs = start_step(tmp_path, 2, *HANG, f"task.args.mode={mode}", f"task.args.rank={rank}", "task.args.at=8",
                       *extra)
    started = time.monotonic()
    if mode == "stop":
        # A frozen rank cannot end itself: the others' exit ends the step (srun --kill-on-bad-exit does this
        # on a cluster); here the test kills it once the other rank has gone.
        other = procs[1 - rank]
        other.wait(timeout=120)
        os.kill(procs[rank].pid, signal.SIGKILL)
    results = finish_step(procs, timeout=120)
    elapsed = time.monotonic() - started
    codes = [rc for rc, _ in results]
    assert codes[1 - rank] == HANG_EXIT_CODE, results[1 - rank][1][-2000:]
    if mode != "stop":
        assert codes[rank] == HANG_EXIT_CODE, results[rank][1][-2000:]
    (hang,) = [e for e in read_ledger(tmp_path / "events.jsonl") if e["event"] == "hang"]
    assert hang["ranks"] == [rank] and len(hang["hosts"]) == 1, hang
    assert (rank in hang["frozen"]) == (mode == "stop"), hang
    if culprit_phase:
        assert hang["phases"][str(rank)] == culprit_phase, hang
    assert hang["waited_s"] < 30 and elapsed < 90
    # Evidence: every thread's stack of each rank that could still run, in its log.
    for r in range(2):
        if mode == "stop" and r == rank:
            continue
        text = (tmp_path / "logs" / f"rank{r}.log").read_text()
        assert "Thread 0x" in text and "most recent call first" in text, text[-2000:]
    if mode == "sleep":
        assert re.search(r'File ".*tests/tasks.py", line \d+ in loss', (tmp_path / "logs" / "rank1.log").read_text())


@pytest.mark.multiprocess
def test_a_peer_frozen_before_the_first_step_ends_in_the_start_allowance(tmp_path: Path) -> None:
    # Issue 46: rank 1 frozen in the run directory's claim, the first collective after the rendezvous: rank 0 waited
    # there for distributed.init_timeout_s (its watchdog started after the claim), here 600 s; now watchdog.first_step_s.
    procs = start_step(tmp_path, 2, "task.target=tests.frozen_claim:FrozenClaimTask", "train.epochs=1",
                       "data.batch_size=4", "watchdog.first_step_s=5", "distributed.init_timeout_s=600",
                       "log.tensorboard=false")
    started = time.monotonic()
    try:
        code = procs[0].wait(timeout=120)
    finally:
        os.kill(procs[1].pid, signal.SIGKILL)  # frozen: the others' exit ends the step (srun does it on a cluster)
    results = finish_step(procs, timeout=60)
    assert code == HANG_EXIT_CODE, results[0][1][-3000:]
    assert time.monotonic() - started < 90
    (hang,) = [e for e in read_ledger(tmp_path / "events.jsonl") if e["event"] == "hang"]
    assert hang["ranks"] == [1] and hang["frozen"] == [1] and hang["phases"]["0"] == "start", hang


@pytest.mark.multiprocess
def test_a_slow_but_healthy_rank_is_not_hung(tmp_path: Path) -> None:
    # The case: rank 1's loss takes 3x as long (3 s) as rank 0's (1 s), so rank 0 waits ~2 s for it
    # in every step (DDP's forward broadcasts the batch-norm buffers), and once, at step 6, 1.5 s more.
    # Allowance: step_multiple 2 x the median step time, floor 1 s. Learned from the step's wall time (3 s,
    # the wait included) it is 6 s on both ranks: no hang. Learned from rank 0's own compute (1 s) it would
    # be 2 s, and rank 0's 3.5 s wait at step 6 would be called a hang. (With step_multiple >= 2, the
    # config's least, a steady 3x rank alone leaves a wait of exactly 2 x the fast rank's compute: the pause
    # makes the difference between the two ways of learning certain, while staying within the 6 s.)
    results = finish_step(start_step(tmp_path, 2, "task.target=tests.tasks:UnevenBlobTask", "task.args.step_s=1.0",
                                     "task.args.slow_factor=3", "task.args.pause_at=6", "task.args.pause_s=1.5",
                                     "train.epochs=2", "data.batch_size=4", "log.every_steps=1", "watchdog.floor_s=1",
                                     "watchdog.step_multiple=2", "watchdog.first_step_s=30", "watchdog.eval_s=30",
                                     "watchdog.checkpoint_s=30", "log.tensorboard=false"), timeout=240)
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    events = read_ledger(tmp_path / "events.jsonl")
    assert not [e for e in events if e["event"] == "hang"]
    assert [e["step"] for e in events if e["event"] == "finished"] == [10]


@pytest.mark.multiprocess
def test_a_pause_within_the_allowance_outlasts_a_shorter_collective_timeout(tmp_path: Path) -> None:
    # Rank 1 takes 15x as long per step (1.5 s) as rank 0 computes (0.1 s), and once pauses 13 s more, within
    # the 20 s floor: the 10 s collective timeout asked for would cut rank 0's wait short; it is raised above
    # the watchdog's allowances (here 20 + 50 s), so the watchdog alone judges a hang.
    results = finish_step(start_step(tmp_path, 2, "task.target=tests.tasks:UnevenBlobTask", "task.args.step_s=0.1",
                                     "task.args.slow_factor=15", "task.args.pause_at=6", "task.args.pause_s=13",
                                     "train.epochs=2", "data.batch_size=4", "log.every_steps=1", "watchdog.floor_s=20",
                                     "watchdog.step_multiple=3", "watchdog.first_step_s=10", "watchdog.checkpoint_s=20",
                                     "watchdog.collective_timeout_s=10", "watchdog.eval_s=20", "log.tensorboard=false"))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-2000:]
    events = read_ledger(tmp_path / "events.jsonl")
    assert not [e for e in events if e["event"] == "hang"]
    (first,) = [e for e in events if e["event"] == "first_step"]
    assert 70 <= first["collective_timeout_s"] < 100, first


def test_an_own_loop_between_steps_has_the_step_allowance_not_the_evaluations() -> None:
    # mgpu.Session beats `model` at a step's first forward and `agree` at its end (should_stop), no optimizer
    # phase. Before: the allowance between two steps was eval_s (300 s), and no step time was ever learned.
    clock = Clock()
    dog = watchdog(clock, eval_s=300)
    for step in range(1, 9):
        dog.beat("model", step)
        clock.tick(0.15)
        dog.beat("agree")
        clock.tick(0.05)
    assert dog.phase == "agree" and dog.allowance() == pytest.approx(2.0)  # 10 x 0.2 s, not 300
    dog.beat("eval")  # an evaluation after it: its own allowance, its agreement too
    clock.tick(0.1)
    dog.beat("agree")
    assert dog.allowance() == 300
    dog.beat("model", 9)
    assert dog.allowance() == pytest.approx(2.0)


def test_a_world_of_one_own_loop_learns_its_steps_from_its_agreements() -> None:
    # Without DDP there is no `model` beat: each should_stop beats `agree` with the step it ends.
    clock = Clock()
    dog = watchdog(clock, eval_s=300)
    for step in range(1, 9):
        dog.beat("agree", step)
        clock.tick(0.3)
    assert dog.allowance() == pytest.approx(3.0)


# ------------------------------------------------------------------------- a resume's own allowance (issue 30)
def test_a_resume_has_its_own_allowance_and_reading_is_progress() -> None:
    """Finding, hashing and loading a checkpoint: the resume's allowance (not the first step's), and while the
    training thread's bytes read grow it is not hung, however long (up to a day); once they stop, the
    allowance counts from the last read."""
    from mgpu.stop.watchdog import MAX_ALLOWANCE_S

    clock, read = Clock(), {"bytes": 0}
    watchdog = Watchdog(0, 1, None, step_multiple=3, floor_s=10, first_step_s=600, checkpoint_s=60,  # type: ignore[arg-type]
                        resume_s=3528, on_hang=lambda *a: None, clock=clock,
                        progress=lambda tid: read["bytes"], threads=lambda: [1])
    assert watchdog.allowance() == 600
    watchdog.beat("resume")
    assert watchdog.allowance() == 3528
    assert watchdog.collective_timeout(300, resuming=True) > 3528  # the resume's collectives wait it out
    assert watchdog.collective_timeout(300) < 3528  # training's: not lengthened by the resume's allowance
    watchdog.note_reads()  # the bytes read when it began
    for _ in range(20):  # 20 x 500 s of reading: 10,000 s, past the allowance, yet not hung
        clock.now += 500
        read["bytes"] += 85 * 10**6 * 500
        watchdog.note_reads()
        assert watchdog.waited() == 0
    clock.now += 3000  # the reads stopped 3000 s ago: within the allowance, then past it
    watchdog.note_reads()
    assert watchdog.waited() == 3000 < watchdog.allowance()
    clock.now += 600
    assert watchdog.waited() > watchdog.allowance()
    clock.now += MAX_ALLOWANCE_S  # reading forever is not progress forever: a day after its beat at most
    read["bytes"] += 1
    watchdog.note_reads()
    assert watchdog.waited() > watchdog.allowance()
    watchdog.beat("start")  # resumed: the first step's allowance again, reads no longer count
    clock.now += 700
    read["bytes"] += 1
    watchdog.note_reads()
    assert watchdog.allowance() == 600 and watchdog.waited() == 700
    # Without a resume allowance of its own (a caller not passing it): the first step's; never below it.
    assert Watchdog(0, 1, None, step_multiple=3, floor_s=10, first_step_s=600, checkpoint_s=60,  # type: ignore[arg-type]
                    resume_s=5, on_hang=lambda *a: None).resume_s == 600


def test_a_sessions_resume_is_allowed_as_long_as_its_checkpoint_takes_to_read(tmp_path: Path) -> None:
    """Issue 30: a run whose saves took 1800 s for 50 GB resumes under 2 x 3 x 1800 s (the checkpoint read twice at
    that rate, with the save's margin), not the first step's fixed 600 s, until load() has restored it. (A save
    faster than save_budget.SLOWEST_READ_BYTES_S gets that rate instead: test_save_budget.)"""
    from mgpu.config.loading import Config
    from mgpu.cluster.environment import detect_environment
    from mgpu.record.ledger import Ledger
    from mgpu.state.save_budget import SAFETY
    from mgpu.run.session import Session

    Ledger(tmp_path / "events.jsonl", "1", 0).write("checkpoint_saved", step=3, seconds=1800.0, bytes=50 * 10**9,
                                                    path="p", reason="periodic")
    session = Session(tmp_path, seed=0, config=Config(), env=detect_environment({}))
    try:
        assert session.watchdog is not None
        assert session.latest() is None  # (no checkpoint on disk here: the allowance is the point)
        assert session.watchdog.allowance() == pytest.approx(2 * SAFETY * 1800.0)  # save_budget.READ_PASSES
        session.load({"progress": {"step": 0}})
        assert session.watchdog.allowance() == Config().watchdog.first_step_s
    finally:
        session.finish()


@pytest.mark.multiprocess
def test_a_first_resume_slower_than_the_first_step_allowance_finishes_and_trains(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46: a first resume with nothing measured had watchdog.first_step_s, and a read that returned after
    it was past (the hash's 8 MiB reads: 8 s each at 1 MB/s) was a hang. The kernel throttles the resuming
    process's reads to 1 MB/s (tests/throttle.py: a cgroup, nothing in mgpu hooked), its 21 MB checkpoint out of
    the page cache: the resume reads for ~21 s, twice watchdog.first_step_s=10 (the rest of the start fits 10 s on
    a loaded machine, not 6: a start with no read at all took 9 s beside the suite), and the run trains on."""
    from tests.throttle import evict, throttled_reads

    args = ["task.target=tests.tasks:ThrottledBlobTask", "task.args.step_s=0", "task.args.ballast_mb=20",
            "data.batch_size=8", "log.tensorboard=false"]
    ((code, output),) = finish_step(start_step(tmp_path, 1, *args, "train.epochs=1"), timeout=120)
    assert code == 0, output[-3000:]
    (tmp_path / "saves.json").unlink()  # nothing measured: as a run directory copied, or a record lost
    ledger = tmp_path / "events.jsonl"
    ledger.write_text("".join(line + "\n" for line in ledger.read_text().splitlines()
                              if '"checkpoint_saved"' not in line))
    evict(tmp_path / "checkpoints")
    with throttled_reads(tmp_path, 1 << 20) as procs:
        monkeypatch.setenv("MGPU_TEST_READ_CGROUP", str(procs))
        ((code, output),) = finish_step(start_step(tmp_path, 1, *args, "train.epochs=2", "watchdog.first_step_s=10"),
                                        timeout=240)
    events = read_ledger(ledger)
    assert code == 0, output[-3000:]
    assert not [e for e in events if e["event"] == "hang"]
    (resumed,) = [e for e in events if e["event"] == "resumed"]
    first = [e for e in events if e["event"] == "first_step"][-1]
    assert first["timings"]["loaded"] - first["timings"]["find"] > 15  # read slowly, well past first_step_s
    finished = [e for e in events if e["event"] == "finished"]
    assert finished[-1]["step"] > resumed["step"]  # and it trained on


@pytest.mark.multiprocess
def test_a_slow_hash_at_resume_is_not_a_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 30: the resume's hash reads 512 bytes every 0.3 s (~16 s for this 27 kB checkpoint), past
    watchdog.first_step_s (10 s: the rest of the start fits it on a loaded machine): it kept reading, so the
    run resumes and finishes (on 8a0cea0: exit 4, a `hang` with no culprit)."""
    args = ["task.target=tests.tasks:SlowHashBlobTask", "task.args.chunk=512", "data.batch_size=8",
            "log.tensorboard=false"]
    ((code, output),) = finish_step(start_step(tmp_path, 1, *args, "train.epochs=1"), timeout=120)
    assert code == 0, output[-3000:]
    monkeypatch.setenv("SLOW_HASH_PAUSE_S", "0.3")
    ((code, output),) = finish_step(start_step(tmp_path, 1, *args, "train.epochs=2", "watchdog.first_step_s=10"),
                                    timeout=120)
    events = read_ledger(tmp_path / "events.jsonl")
    assert code == 0, output[-3000:]
    assert not [e for e in events if e["event"] == "hang"]
    (resumed,) = [e for e in events if e["event"] == "resumed"]
    first = [e for e in events if e["event"] == "first_step"][-1]
    assert first["timings"]["loaded"] - first["timings"]["find"] > 10  # the slow hash did outlast first_step_s
