"""The room for a run's snapshots in memory (mgpu.state.memory.room), per node and from file sizes, in one process
against a fake filesystem's free space and fake cgroup files: every rank of the node and the replicas counted,
what the run holds there already counted as used, the margin left for NCCL's and the DataLoader's shared memory,
and the check made again before every snapshot: no room is one line and snapshots off, never the run's end."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mgpu.state.memory.room import MARGIN_PER_RANK, Room, run_bytes
from mgpu.state.memory.store import Identity, SnapshotStore
from mgpu.state.memory.snapshots import MemorySnapshots


class FakeFs:
    """statvfs of a filesystem of `capacity` bytes holding what is under `root` and `other` bytes of others'."""

    def __init__(self, root: Path, capacity: int, other: int = 0) -> None:
        self.root, self.capacity, self.other = root, capacity, other

    def __call__(self, path: Path) -> Any:
        used = sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file()) + self.other
        return SimpleNamespace(f_frsize=1, f_blocks=self.capacity, f_bavail=max(0, self.capacity - used))


def room(tmp_path: Path, capacity: int, ranks: int = 1, other: int = 0) -> Room:
    """No margin (`shm` is another filesystem's directory, the margins 0) unless a test sets one."""
    base = tmp_path / "shm"
    return Room(base, base / "mgpu-7-run", ranks, shm=Path("/proc"), proc_cgroup=tmp_path / "no-cgroup",
                margin_fraction=0, margin_per_rank=0, statvfs=FakeFs(base, capacity, other))


@pytest.mark.parametrize("ranks, replicated, held, capacity, fits", [
    (1, False, [], 200, True),  # one rank: 2 slots of 100
    (4, False, [], 200, False),  # four ranks on the node need 800 (the check counted one rank's two before)
    (4, False, [], 800, True),
    (4, True, [], 800, False),  # each also holds a partner's two: 1600
    (4, True, [100] * 8, 1600, True),  # 800 of it is there already: 800 more, 800 free
    (4, True, [100] * 8, 1500, False),
])
def test_the_room_counts_every_rank_of_the_node_and_the_replicas_from_file_sizes(
        tmp_path: Path, ranks: int, replicated: bool, held: list[int], capacity: int, fits: bool) -> None:
    node = room(tmp_path, capacity, ranks)
    for index, size in enumerate(held):
        rank = node.job_dir / f"rank{index // 2}"
        rank.mkdir(parents=True, exist_ok=True)
        (rank / f"slot{index % 2}.pt").write_bytes(b"x" * size)
    assert run_bytes(node.job_dir) == sum(held)
    assert (node.problem(100, replicated) is None) == fits


def test_no_room_is_said_with_the_figures(tmp_path: Path) -> None:
    node = room(tmp_path, 10**9, ranks=2)
    assert node.problem(300_000_000, replicated=True) == (
        f"{node.base} has 1.00 GB free: 2 rank(s) x 2 snapshots of 300.0 MB (and the replicas they hold) need "
        "2.40 GB more, and 0.0 MB stay free for NCCL's and the DataLoader's shared memory")
    assert node.replica_problem(2 * 10**9, reused=1000) == (
        f"{node.base} has 1.00 GB free: a replica of 2000000000 bytes needs 2.00 GB more, and 0.0 MB stay free for "
        "NCCL's and the DataLoader's shared memory")


def test_the_margin_is_left_on_the_shared_memory_filesystem_only(tmp_path: Path) -> None:
    stats = SimpleNamespace(f_frsize=4096, f_blocks=(100 << 30) // 4096, f_bavail=0)
    on_shm = Room(tmp_path, tmp_path / "job", ranks_per_node=8, shm=tmp_path)  # the same filesystem
    assert on_shm.margin(stats) == int(0.1 * (100 << 30))  # a tenth of 100 GiB: more than 8 x 256 MiB
    assert Room(tmp_path, tmp_path / "job", ranks_per_node=64, shm=tmp_path).margin(stats) == 64 * MARGIN_PER_RANK
    if os.stat(tmp_path).st_dev != os.stat("/proc").st_dev:
        assert Room(tmp_path, tmp_path / "job", ranks_per_node=8, shm=Path("/proc")).margin(stats) == 0


def test_the_job_memory_limit_is_a_limit_of_the_node_too(tmp_path: Path) -> None:
    cgroup, proc = tmp_path / "cg", tmp_path / "proc-self-cgroup"
    proc.write_text("0::/job_7/task_0\n")
    _limits(cgroup, {"job_7": ("3000000000", 2_000_000_000), "job_7/task_0": ("max", 1_000_000_000)})
    node = Room(tmp_path / "shm", tmp_path / "shm" / "job", shm=Path("/proc"), cgroup=cgroup, proc_cgroup=proc,
                statvfs=FakeFs(tmp_path / "shm", 10**12))
    assert node.problem(300_000_000) is None  # 600 MB more, 1 GB left of which 268 MB stay free
    assert node.problem(400_000_000) == ("this job's memory limit leaves 1.00 GB: 1 rank(s) x 2 snapshots of 400.0 MB "
                                         "need 800.0 MB more, and 268.4 MB stay free for the processes' own memory")
    (cgroup / "job_7" / "memory.max").write_text("max\n")
    assert node.problem(400_000_000) is None


def test_the_room_is_asked_before_every_snapshot_and_no_room_is_one_line_not_the_end(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two snapshots fit, and the margin beside them; then the node's shared memory fills with others' files (a
    DataLoader's batches, another job) into the margin: the third is refused before it is written, in one line,
    the rank's snapshots removed (room given back); the run goes on and nothing more is said. (The check was made
    once, before the first snapshot.)"""
    identity = Identity("7", 0, "run", "cfg", 2, 1)
    store = SnapshotStore.for_rank(identity, tmp_path / "shm")
    fs = FakeFs(tmp_path / "shm", capacity=10**6)
    node = Room(tmp_path / "shm", store.directory.parent, shm=tmp_path / "shm", proc_cgroup=tmp_path / "none",
                margin_fraction=0, margin_per_rank=300_000, statvfs=fs)
    snapshots = MemorySnapshots(store, every=1, version=None, room=node)
    state = {"x": list(range(20_000))}  # about 100 kB pickled
    assert snapshots.take(1, state, dict) and snapshots.take(2, state, dict)
    fs.other = 10**6 - 2 * snapshots.last_bytes - 200_000
    layouts: list[int] = []
    assert not snapshots.take(3, state, lambda: layouts.append(3) or {})
    assert not snapshots.take(4, state, lambda: layouts.append(4) or {})
    assert layouts == [3, 4] and not store.directory.exists()
    said = [r.getMessage() for r in caplog.records if "takes no more snapshots" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("checkpoint.memory_every_steps: rank 1 takes no more snapshots in "
                                                 f"memory: no room: {node.base} has 0.2 MB free: 1 rank(s) x 2 "
                                                 "snapshots of 0.1 MB need 0.0 MB more, and 0.3 MB stay free for "
                                                 "NCCL's and the DataLoader's shared memory"), said


def test_a_replica_the_holder_has_no_budget_for_is_refused(tmp_path: Path) -> None:
    """Its budget: at most twice its own snapshot (what the room check counted for it), and what the node has."""
    identity = Identity("7", 0, "run", "cfg", 2, 1)
    store = SnapshotStore.for_rank(identity, tmp_path / "shm")
    holder = MemorySnapshots(store, every=1, version=None, room=room(tmp_path, 10**8))
    assert holder.replica_refusal(90_000_000, reused=0) is None  # no snapshot of its own yet: the room decides
    assert holder.replica_refusal(1 << 40, reused=0) is not None
    holder.last_bytes = 100_000
    assert holder.replica_refusal(1_300_000, reused=0) == ("1300000 bytes, more than twice this rank's own snapshot "
                                                           "(100000 bytes)")
    assert holder.replica_refusal(1_200_000, reused=0) is None  # with a MiB to spare: a shard of another size


def _limits(root: Path, levels: dict[str, tuple[str, int]], v1: bool = False) -> None:
    """Fake cgroup files: {level: (limit, usage)}, v2 names (memory.max, memory.current) or v1 ones."""
    for level, (limit, usage) in levels.items():
        where = root / "memory" / level if v1 else root / level
        where.mkdir(parents=True, exist_ok=True)
        (where / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(f"{limit}\n")
        (where / ("memory.usage_in_bytes" if v1 else "memory.current")).write_text(f"{usage}\n")


V1_NONE = "9223372036854771712"  # what cgroup v1 writes for no limit
SLURM_V2 = "0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n"
SLURM_V1 = "12:pids:/\n4:memory:/slurm/uid_0/job_7/step_0/task_0\n3:cpu,cpuacct:/slurm/uid_0/job_7\n0::/\n"


@pytest.mark.parametrize("proc, levels, v1, headroom", [
    # Slurm's v2 tree: the job's limit, none on the step's or the task's (the level the rank is in)
    (SLURM_V2, {"system.slice/slurmstepd.scope/job_7": ("3000000000", 2_000_000_000),
                "system.slice/slurmstepd.scope/job_7/step_0/user/task_0": ("max", 500_000_000)}, False, 1_000_000_000),
    # two limits on the way up: the tighter headroom
    ("0::/a/b\n", {"a": ("8000000000", 2_000_000_000), "a/b": ("3000000000", 2_500_000_000)}, False, 500_000_000),
    # a hybrid host (v1 memory controller, as this machine): the v1 files, the job's limit
    (SLURM_V1, {"slurm/uid_0/job_7": ("4000000000", 1_000_000_000),
                "slurm/uid_0/job_7/step_0/task_0": (V1_NONE, 300_000_000)}, True, 3_000_000_000),
    (SLURM_V1, {"slurm/uid_0/job_7/step_0/task_0": (V1_NONE, 300_000_000), "": (V1_NONE, 9_000_000_000)}, True, None),
    ("3:cpu,cpuacct:/x\n0::/y\n", {"y": ("2000000000", 500_000_000)}, False, 1_500_000_000),  # no v1 memory: v2
    ("0::/\n", {}, False, None),  # the v2 root has no memory.max
    ("", {}, False, None),
])
def test_the_memory_headroom_is_the_least_on_the_way_up(tmp_path: Path, proc: str, levels: dict[str, tuple[str, int]],
                                                       v1: bool, headroom: int | None) -> None:
    from mgpu.state.memory.room import memory_headroom

    _limits(tmp_path, levels, v1)
    assert memory_headroom(proc, tmp_path) == headroom


