"""Snapshots in host memory (mgpu.state.memory.store, mgpu.state.memory.snapshots), in one process: what a restore
refuses (stale, torn), the double buffer after a copy that failed half way, cleanup, the ranks' agreement on a step,
and a state taken and put back bit for bit. The real-process restart in place: test_memory_restart.py."""

from __future__ import annotations

import dataclasses
import pickle
import signal
import subprocess
import threading
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import pytest

from mgpu.state.memory.store import Identity, SnapshotStore, job_dir, local_job_id, remove_job
from mgpu.state.memory.snapshots import MemorySnapshots, agree_on_step

ME = Identity(job="123", restart=0, run="run-abc", config="cfg1", world_size=2, rank=1)


def dump(value: Any) -> Callable[[IO[bytes]], object]:
    return lambda file: file.write(pickle.dumps(value))


def load(file: IO[bytes]) -> Any:
    return pickle.loads(file.read())


def test_a_snapshot_reads_back_and_lives_under_the_job_and_run(tmp_path: Path) -> None:
    store = SnapshotStore.for_rank(ME, tmp_path)
    assert store.directory == tmp_path / "mgpu-123-run-abc" / "rank1"
    store.write(5, dump({"w": [1, 2]}))
    assert store.valid_steps() == [5]
    assert store.read(5, load) == {"w": [1, 2]}
    assert local_job_id("run-abc") == "local-run-abc"


@pytest.mark.parametrize("field, other", [("job", "124"), ("restart", 1), ("run", "run-xyz"), ("config", "cfg2"),
                                          ("world_size", 4), ("rank", 0)])
def test_a_stale_snapshot_is_refused(tmp_path: Path, field: str, other: Any) -> None:
    """Another job (or the same before a requeue), run, config or world size (or another rank's file) is never
    restored."""
    SnapshotStore(tmp_path / "r", dataclasses.replace(ME, **{field: other})).write(7, dump("theirs"))
    mine = SnapshotStore(tmp_path / "r", ME)
    [(snapshot, refusal)] = mine.committed()
    assert snapshot.step == 7 and refusal is not None and refusal.startswith(f"stale: taken with {field}=")
    assert mine.valid_steps() == []
    with pytest.raises(FileNotFoundError):
        mine.read(7, load)
    mine.write(8, dump("mine"))  # the stale slot is the one overwritten first; never this identity's newest
    mine.write(9, dump("mine"))
    assert mine.valid_steps() == [9, 8]


def test_a_torn_snapshot_is_refused_and_the_other_slot_restores(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "r", ME)
    store.write(1, dump("one"))
    newest = store.write(2, dump("two"))
    content = bytearray(newest.path.read_bytes())
    content[-1] ^= 1
    newest.path.write_bytes(bytes(content))
    refusals = {snapshot.step: refusal for snapshot, refusal in store.committed()}
    assert refusals == {2: "torn: its CRC-32 is not the commit record's", 1: None}
    assert store.valid_steps() == [1] and store.read(1, load) == "one"


class Crash(Exception):
    pass


@pytest.mark.parametrize("written", [0, 3, 100])  # nothing yet; a few bytes; most of it
def test_a_copy_that_fails_half_way_leaves_the_previous_snapshot_whole(tmp_path: Path, written: int) -> None:
    """The process dies during a copy (here: the copy raises after `written` bytes): the newest committed
    snapshot, in the other slot, is untouched; the half-written slot has no commit record."""
    store = SnapshotStore(tmp_path / "r", ME)
    store.write(1, dump("one"))
    store.write(2, dump("two" * 100))

    def crashing(file: IO[bytes]) -> None:
        file.write(pickle.dumps("three" * 100)[:written])
        raise Crash

    with pytest.raises(Crash):
        store.write(3, crashing)  # overwrites slot of step 1, the older
    assert store.valid_steps() == [2] and store.read(2, load) == "two" * 100
    store.write(4, dump("four"))  # the failed slot is the one taken again: step 2 stays
    assert store.valid_steps() == [4, 2]


def test_cleanup_removes_the_rank_then_the_job_and_only_that_job(tmp_path: Path) -> None:
    ranks = [SnapshotStore.for_rank(dataclasses.replace(ME, rank=r), tmp_path) for r in (0, 1)]
    other = SnapshotStore.for_rank(dataclasses.replace(ME, job="999"), tmp_path)
    for store in (*ranks, other):
        store.write(1, dump("x"))
    ranks[0].remove()
    assert not ranks[0].directory.exists() and ranks[1].directory.exists()
    ranks[1].remove()
    assert not job_dir("123", "run-abc", tmp_path).exists()
    assert other.valid_steps() == [1]
    assert remove_job("999", base=tmp_path) == [job_dir("999", "run-abc", tmp_path)]
    assert list(tmp_path.iterdir()) == []


def test_the_batch_scripts_teardown_removes_this_nodes_snapshots_of_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from mgpu.state.memory.store import BASE_ENV, main

    monkeypatch.setenv(BASE_ENV, str(tmp_path))
    for identity in (ME, dataclasses.replace(ME, run="run-2"), dataclasses.replace(ME, job="77")):
        SnapshotStore.for_rank(identity).write(1, dump("x"))
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    (tmp_path / "mgpu-123-watchdog-0123456789abcdef").mkdir()  # a killed world of one's watchdog board
    assert main(["--remove-this-job"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["mgpu-77-run-abc"]
    assert capsys.readouterr().out == (f"mgpu.state.memory.store: n2: removed {tmp_path}/mgpu-123-run-2, "
                                       f"{tmp_path}/mgpu-123-run-abc, {tmp_path}/mgpu-123-watchdog-0123456789abcdef\n")
    assert main(["--remove-job", "77"]) == 0 and list(tmp_path.iterdir()) == []
    assert main(["--remove-job", "77"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (f"mgpu.state.memory.store: n2: nothing of job 77 in "
                                                        f"{tmp_path}")


def test_a_new_job_removes_this_runs_snapshots_of_another_job(tmp_path: Path) -> None:
    old = SnapshotStore.for_rank(dataclasses.replace(ME, job="100"), tmp_path)
    other_run = SnapshotStore.for_rank(dataclasses.replace(ME, job="100", run="run-other"), tmp_path)
    old.write(3, dump("x"))
    other_run.write(3, dump("x"))
    mine = MemorySnapshots.open(slurm_job="123", run_id="run-abc", config={}, world_size=2, rank=1, every=1,
                                version=None, base=tmp_path)
    mine.store.write(1, dump("y"))
    mine.remove_other_jobs()
    assert not old.directory.exists() and other_run.valid_steps() == [3] and mine.store.valid_steps() == [1]


def as_ranks(work: list[Callable[[Callable[[int], int]], Any]]) -> list[Any]:
    """`work[r](reduce_min)` on a thread per rank, the MIN all-reduce met at a barrier: each one's result, or the
    exception it raised."""
    barrier, values = threading.Barrier(len(work)), [0] * len(work)
    results: list[Any] = [None] * len(work)

    def reduce_min(rank: int, value: int) -> int:
        values[rank] = value
        barrier.wait(30)
        least = min(values)
        barrier.wait(30)
        return least

    def run(rank: int) -> None:
        try:
            results[rank] = work[rank](lambda value: reduce_min(rank, value))
        except Exception as error:  # noqa: BLE001  # the test looks at it
            results[rank] = error

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(work))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def agree_all(per_rank: list[list[int]]) -> list[int | None]:
    """agree_on_step on every rank at once (threads as ranks)."""
    return as_ranks([lambda reduce_min, own=own: agree_on_step(own, reduce_min) for own in per_rank])


@pytest.mark.parametrize("per_rank, agreed", [
    ([[10, 9], [10, 9]], 10),
    ([[10, 9], [9, 8]], 9),  # rank 1 died copying 10: its newest is 9, which rank 0 holds too
    ([[10, 9], [11, 10]], 10),  # rank 1 was one step ahead
    ([[10, 9], [8, 7]], None),  # nothing in common
    ([[10, 8], [9, 7]], None),
    ([[10, 9], []], None),  # a rank lost its node's memory
    ([[20, 10], [20], [30, 20]], 20),
])
def test_the_ranks_agree_on_the_newest_step_every_rank_holds(per_rank: list[list[int]], agreed: int | None) -> None:
    assert agree_all(per_rank) == [agreed] * len(per_rank)


def test_a_snapshot_puts_back_what_a_checkpoint_would_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Model, optimizer, a dataclass, a plain value and this rank's RNG, taken at a step and put back after
    more training changed them all: bit-identical, and the same draw of the RNG after it."""
    import torch

    from mgpu.state.train_state import Progress

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the optimizer's first step sets it
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def train() -> None:
        model(torch.randn(5, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    train()
    progress = Progress(step=1, epoch=0, position=5)
    objects: dict[str, Any] = {"model": model, "optimizer": optimizer, "progress": progress, "best": 0.5}
    snapshots = MemorySnapshots.open(slurm_job=None, run_id="r-1", config={"a": 1}, world_size=1, rank=0,
                                     every=2, version="v", base=tmp_path)
    assert not snapshots.take(1, objects, dict)  # not due at step 1
    assert snapshots.take(2, objects, dict)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    draw = torch.rand(3)
    for _ in range(3):
        train()
    progress.step, objects["best"] = 9, 0.1
    state = snapshots.restore(2, objects, seed=0)
    assert state["world_size"] == 1 and state["code_version"] == "v"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    assert all(torch.equal(optimizer.state_dict()["state"][0][k], v) for k, v in moments.items())
    assert progress.step == 1 and objects["best"] == 0.5
    assert torch.equal(torch.rand(3), draw)
    snapshots.remove()
    assert not snapshots.store.directory.parent.exists()


def test_no_snapshots_with_a_zero_optimizer_and_it_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """ZeroRedundancyOptimizer (a fake: the real one needs a process group) consolidates on rank 0 alone."""
    import sys
    import types

    zero = type("ZeroRedundancyOptimizer", (), {})
    module = types.ModuleType("torch.distributed.optim.zero_redundancy_optimizer")
    module.ZeroRedundancyOptimizer = zero  # type: ignore[attr-defined]  # the attribute train_state looks for
    monkeypatch.setitem(sys.modules, module.__name__, module)
    snapshots = MemorySnapshots.open(slurm_job="1", run_id="r", config={}, world_size=1, rank=0, every=1,
                                     version=None, base=tmp_path)
    layouts: list[int] = []
    assert not snapshots.take(1, {"optimizer": zero()}, lambda: layouts.append(1) or {})
    assert not snapshots.take(2, {"optimizer": zero()}, lambda: layouts.append(2) or {})
    assert snapshots.disabled == "a ZeroRedundancyOptimizer's state is split across the ranks" and layouts == []
    assert [r.message for r in caplog.records].count(
        f"checkpoint.memory_every_steps: no snapshots in memory: {snapshots.disabled}") == 1


@pytest.fixture
def sigterm_restored() -> Iterator[None]:
    """mgpu.run.recovery.main ignores SIGTERM for the rest of its process (`scontrol requeue` signals the batch
    script too, and its exit code must still be the step's): here the process is the test's, so it comes back."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("failures_before, kept", [(0, True), (1, False)])  # restarted in place; the budget spent
@pytest.mark.usefixtures("sigterm_restored")
def test_recovery_keeps_the_snapshots_for_a_restart_in_place_and_removes_them_otherwise(
        failures_before: int, kept: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mgpu.run import recovery
    from mgpu.record.ledger import Ledger
    from mgpu.state.memory.store import BASE_ENV
    from mgpu.cluster.requeue import JobView
    from mgpu.record.rundir import RunDir

    monkeypatch.setenv(BASE_ENV, str(tmp_path / "shm"))
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0", "MGPU_MAX_FAILURES": "1",
                        "MGPU_RESUME_COMMAND": "sbatch again"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setattr(recovery, "owns_slurm_job", lambda: True)
    monkeypatch.setattr(recovery, "query_job", lambda job_id: JobView("RUNNING", "None", 0, None, num_nodes=2))
    monkeypatch.setattr(recovery, "requeue", lambda job_id: pytest.fail(f"job {job_id} requeued"))
    store = SnapshotStore.for_rank(dataclasses.replace(ME, job="7"))
    store.write(3, dump("x"))
    run = RunDir(tmp_path / "run")
    for _ in range(failures_before):
        Ledger(run.ledger, "7", 0).write("restarted", after="failure")
    recovery.main(["--may-restart", "--exit-code", "1", "--run-dir", str(run.path)])
    assert store.valid_steps() == ([3] if kept else [])


def test_a_resume_before_the_newest_snapshots_uncommits_them(tmp_path: Path) -> None:
    """A restore that did not use them (a rank lacked its copy, or the durable checkpoint is newer): the steps
    after the resume are another attempt's; dropped, so the next writes keep two slots of this one."""
    store = SnapshotStore(tmp_path / "r", ME)
    for step in (11, 12):
        store.write(step, dump(step))
    store.discard_after(10)
    assert store.valid_steps() == []
    store.write(11, dump("again"))
    store.write(12, dump("again"))
    assert store.valid_steps() == [12, 11]
    store.discard_after(11)
    assert store.valid_steps() == [11] and store.read(11, load) == "again"


def test_goodput_counts_the_steps_restored_from_memory_apart_from_the_lost_ones() -> None:
    """KILLED_RANK of test_goodput (killed at step 10, the disk at 8), resumed from memory at step 9 instead."""
    from mgpu.record.goodput import goodput, goodput_lines
    from tests.test_goodput import KILLED_RANK

    from_disk = goodput(KILLED_RANK)
    from_memory = [dict(e, memory=True, durable_step=8, step=9) if e["event"] == "resumed" else e for e in KILLED_RANK]
    g = goodput(from_memory)
    assert (from_disk.lost_steps, from_disk.memory_steps) == (2, 0)
    assert (g.lost_steps, g.memory_steps) == (1, 1)
    assert [line for line in goodput_lines(g, False) if "from memory" in line] == [
        "  from memory          1         restored from memory after a failure, not trained again "
        "(checkpoint.memory_every_steps)"]


def test_a_failed_write_ends_this_ranks_snapshots_not_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    import errno

    snapshots = MemorySnapshots.open(slurm_job="1", run_id="r", config={}, world_size=2, rank=1, every=1,
                                     version=None, base=tmp_path)
    assert snapshots.take(1, {"x": 1}, dict)

    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("mgpu.state.single.store.save_state_file", full)
    calls: list[int] = []
    assert not snapshots.take(2, {"x": 1}, lambda: calls.append(2) or {})
    assert snapshots.disabled == "on this rank: writing one failed: [Errno 28] No space left on device"
    assert not snapshots.store.directory.exists()
    assert not snapshots.take(3, {"x": 1}, lambda: calls.append(3) or {})
    assert calls == [2, 3]  # the DDP layouts (a collective with comm hooks) still on every due step
    assert sum("takes no more snapshots" in r.message for r in caplog.records) == 1


@pytest.mark.usefixtures("sigterm_restored")
def test_recovery_removes_the_snapshots_on_every_node_before_it_requeues(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A batch script that cannot start the step again (no --may-restart): recovery requeues, which ends the batch
    script before its own teardown; so it removes the job's snapshots on every node first, one srun task per node.
    srun is the fake: it runs the real cleanup once per "node" (n1, n2, each its own directory here)."""
    import os
    import subprocess
    import sys

    from mgpu.cluster.requeue import JobView, RequeueOutcome
    from mgpu.record.rundir import RunDir
    from mgpu.run import recovery
    from mgpu.state.memory.store import BASE_ENV

    for name, value in {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0", "SLURM_JOB_NUM_NODES": "2",
                        "MGPU_RESUME_COMMAND": "sbatch again"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    nodes = {node: tmp_path / node for node in ("n1", "n2")}
    for node, shm in nodes.items():
        SnapshotStore.for_rank(dataclasses.replace(ME, job="7"), shm).write(3, dump(node))
    monkeypatch.setenv(BASE_ENV, str(nodes["n1"]))  # the batch script's node
    done: list[str] = []
    real_run = subprocess.run

    def srun(command: list[str], **options: Any) -> subprocess.CompletedProcess[str]:
        assert command[:6] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--overlap",
                               "--kill-on-bad-exit=0"] and options["timeout"] == recovery.CLEANUP_S
        assert command[6:] == [sys.executable, "-m", "mgpu.state.memory.store", "--remove-this-job"]
        out = ""
        for node, shm in nodes.items():
            task = real_run(command[6:], env={**os.environ, BASE_ENV: str(shm), "SLURMD_NODENAME": node},
                                  capture_output=True, text=True, timeout=60)
            out += task.stdout
        done.append("cleanup")
        return subprocess.CompletedProcess(command, 0, out, "")

    monkeypatch.setattr(recovery.subprocess, "run", srun)
    monkeypatch.setattr(recovery, "owns_slurm_job", lambda: True)
    monkeypatch.setattr(recovery, "query_job", lambda job_id: JobView("RUNNING", "None", 0, None, num_nodes=2))
    monkeypatch.setattr(recovery, "requeue", lambda job_id: done.append("requeue") or RequeueOutcome("self", "ok"))
    assert recovery.main(["--exit-code", "1", "--run-dir", str(RunDir(tmp_path / "run").path)]) == 1
    assert done == ["cleanup", "requeue"]
    assert all(not any(shm.iterdir()) for shm in nodes.values())
    said = [line for line in capsys.readouterr().err.splitlines() if "mgpu.state.memory.store" in line]
    assert said == [f"mgpu.run.recovery: mgpu.state.memory.store: n1: removed {nodes['n1']}/mgpu-7-run-abc; "
                    f"mgpu.state.memory.store: n2: removed {nodes['n2']}/mgpu-7-run-abc"], said


@pytest.mark.parametrize("result, said", [
    (subprocess.TimeoutExpired(["srun"], 30), "not removed: Command '['srun']' timed out after 30 seconds"),
    (OSError(2, "No such file or directory"), "not removed: [Errno 2] No such file or directory"),
    ((1, "", "srun: error: Unable to create step"), "not removed: srun exited 1: srun: error: Unable to create step"),
])
def test_a_cleanup_before_a_requeue_that_fails_is_said_and_ends_nothing(result: Any, said: str) -> None:
    from mgpu.run.recovery import remove_on_every_node

    def srun(command: list[str], **options: Any) -> Any:
        if isinstance(result, BaseException):
            raise result
        return subprocess.CompletedProcess(command, *result)

    assert remove_on_every_node("7", {"SLURM_JOB_NUM_NODES": "2"}, srun) == (
        f"the snapshots in memory of job 7 on its other nodes were {said}")
