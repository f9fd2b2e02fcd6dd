"""mgpu.run.spawn's local ranks: the rendezvous store hosted by the spawning process (no port race), and a failed
rank stopping the others. Real processes (torch's spawn context)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, base_env

SCRIPT = r"""
import os, sys, time
from datetime import timedelta

def main(rank):
    import torch.distributed as dist
    # The store is up before any rank runs (hosted by mgpu.spawn's process): no rank binds the port itself.
    try:
        store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=5), wait_for_workers=False)
        store.set(f"rank{rank}", "here")
        print(f"rank {rank} reached the store; agent store {os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}",
              flush=True)
    except Exception as error:
        print(f"rank {rank} found no store: {error}", flush=True)
    if rank == 1:
        raise ValueError("rank 1 fails")
    time.sleep(600)  # a rank that would wait for the failed one forever (no collective to tell it)

if __name__ == "__main__":
    import mgpu
    mgpu.spawn(main, nprocs=2)
"""


@pytest.mark.multiprocess
def test_a_failed_rank_stops_the_others_and_the_store_is_hosted_by_spawn(tmp_path) -> None:
    script = tmp_path / "two.py"
    script.write_text(SCRIPT)
    started = time.monotonic()
    try:
        result = subprocess.run([sys.executable, str(script)], env=base_env(), cwd=ROOT, capture_output=True,
                                text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("mgpu.run.spawn waited for a rank that would wait for the failed one (600 s)")
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr[-2000:]
    assert "mgpu.run.spawn: rank1 failed: stopping the other ranks" in result.stderr, result.stderr[-2000:]
    assert elapsed < 60, elapsed  # rank 0 slept 600 s: it was stopped, not waited for
    assert result.stdout.count("reached the store; agent store True") == 2, result.stdout + result.stderr


LOOP = r"""
import sys

import torch

import mgpu

config = mgpu.Config()
config.watchdog.enabled = False
session = mgpu.Session(sys.argv[1], seed=0, config=config)
state = session.load({"model": session.wrap(torch.nn.Linear(2, 2))})
if sys.argv[2] == "raise":
    raise ValueError(f"rank {session.rank}'s bug")
session.should_stop()
session.finish()  # not `with`: as the shipped jobs/loops examples end
"""


@pytest.mark.multiprocess
def test_under_spawn_the_resume_command_restarts_the_same_world_and_a_crash_without_with_is_recorded(
        tmp_path) -> None:
    """`python -m mgpu.run.spawn -n 2 loop.py`: a stop's resume command is that command (pasted, 2 ranks again, not 1);
    a loop that ends with finish() and raises is recorded as failed, with its error, on each rank."""
    from mgpu.record.failures import merge, read_failures
    from mgpu.record.ledger import read_ledger
    from mgpu.record.runview import summarize

    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    run = tmp_path / "run"

    def spawned(mode: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "mgpu.run.spawn", "-n", "2", str(script), str(run), mode],
                              env=base_env(**env), cwd=ROOT, capture_output=True, text=True, timeout=180)

    stopped = spawned("stop", MGPU_STOP_AT_STEP="1")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    line = next(line for line in stopped.stderr.splitlines() if line.startswith("mgpu: stopped at step 1"))
    assert line.endswith(f"to resume: cd {ROOT} && {sys.executable} -m mgpu.run.spawn -n 2 {script} {run} stop"), line
    crashed = spawned("raise")
    assert crashed.returncode == 1, crashed.stderr[-3000:]
    events = merge(read_ledger(run / "events.jsonl"), read_failures(run))  # rank 1's in a file of its own
    failed = sorted((e["rank"], e["error"]) for e in events if e["event"] == "failed")
    assert failed == [(0, "ValueError: rank 0's bug"), (1, "ValueError: rank 1's bug")], failed
    assert summarize(events)["state"].startswith("failed"), summarize(events)


START_METHODS = r"""
import multiprocessing, sys

def main(rank, out):
    # What a rank's DataLoader workers would start with: the spawning process's own choice, else the platform's.
    with open(f"{out}.{rank}", "w") as file:
        file.write(str(multiprocessing.get_start_method(allow_none=True)))

if __name__ == "__main__":
    import mgpu
    if sys.argv[2] != "none":
        multiprocessing.set_start_method(sys.argv[2])
    mgpu.spawn(main, (sys.argv[1],), nprocs=2)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("chosen", ["none", "forkserver"])
def test_ranks_start_their_workers_as_the_spawning_process_chose_not_by_spawn(tmp_path, chosen: str) -> None:
    # torch's mp.spawn leaves its ranks' start method at `spawn`, so their DataLoader workers would each start a new
    # interpreter; under srun or torchrun they fork. mgpu.spawn's ranks get the spawning process's choice.
    script = tmp_path / "methods.py"
    script.write_text(START_METHODS)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "method"), chosen], env=base_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    want = "None" if chosen == "none" else chosen
    assert [(tmp_path / f"method.{rank}").read_text() for rank in (0, 1)] == [want, want]


class _ExitsWhenLookedAt:
    """A rank whose process ends between two looks at it: alive at the first `is_alive()`, gone at the next."""

    def __init__(self) -> None:
        self.looks = 0
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        self.looks += 1
        if self.looks > 1:
            self.exitcode = 0
        return self.looks == 1

    def join(self, timeout: float | None = None) -> None:
        pass


def test_the_wait_for_the_ranks_ends_when_the_last_exits_between_two_looks() -> None:
    """`python -m mgpu.run.spawn` ended a finished run with a StopIteration traceback (exit 1) when the last rank
    exited between the wait's check that one lived and its pick of the one to join (bench/failure_overhead.py)."""
    from mgpu.run.spawn import _wait

    sent: list[int] = []
    _wait([_ExitsWhenLookedAt()], sent.append, None, 0.0, "USR1")
    assert sent == []


TWO_SESSIONS = r"""
import sys

import torch
from torch import nn

import mgpu

def train(rank, out):
    for attempt in range(2):  # a sweep in one script: one Session after another in the same processes
        with mgpu.Session(f"{out}/run{attempt}", seed=attempt) as session:
            model = session.wrap(nn.Linear(4, 2))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            session.load({"model": model, "optimizer": optimizer})
            for _ in range(3):
                optimizer.zero_grad()
                model(torch.ones(8, 4)).sum().backward()
                optimizer.step()
                session.should_stop()
            total = session.all_reduce(torch.tensor(float(rank + 1)))
            print(f"session {attempt} rank {rank} sum {total.item():g}", flush=True)

if __name__ == "__main__":
    if sys.argv[1] == "spawn":
        mgpu.spawn(train, args=(sys.argv[2],), nprocs=2)
    else:
        import os
        train(int(os.environ["RANK"]), sys.argv[2])
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_two_sessions_one_after_the_other_in_the_same_ranks_both_train(tmp_path, launcher: str) -> None:
    """The second Session's process group meets none of the first's keys on a store that outlives it (the
    spawning process's, torchrun's agent's): it waited for ever at its rendezvous (the watchdog ended it at 600 s)."""
    script = tmp_path / "sweep.py"
    script.write_text(TWO_SESSIONS)
    cmd = [sys.executable, str(script), "spawn", str(tmp_path)] if launcher == "spawn" else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), "torchrun",
         str(tmp_path)]
    try:
        result = subprocess.run(cmd, env=base_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the second Session did not train: {str(error.stdout)[-1500:]}")
    assert result.returncode == 0, result.stderr[-3000:]
    for attempt in range(2):
        for rank in range(2):
            assert f"session {attempt} rank {rank} sum 3" in result.stdout, result.stdout + result.stderr[-2000:]
