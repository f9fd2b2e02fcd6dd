"""Whether a node has room for a run's snapshots in memory (checkpoint.memory_every_steps): asked before every
snapshot a rank takes and every replica it receives, from what the node holds now (file sizes, one directory
walk and one statvfs: cheap), never from what a state would weigh in tensors alone.

Per node, not per rank: at steady state a node holds two slots of each of its ranks' snapshots and, with
replicas, two of each partner's (mgpu.state.memory.replica); what this run already holds there counts as used.
Snapshots never take the last `margin` of the node's shared memory: NCCL's intra-node buffers and the DataLoader
workers' batches go through /dev/shm too, and a full one fails them (a bus error in a worker, an NCCL error),
which would end the run that the snapshots were to protect. The memory cgroups' headroom is checked the same way
(tmpfs pages are charged to the job: a full one would get a rank OOM-killed). No torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mgpu.state.memory.store import SLOTS

__all__ = ["MARGIN_FRACTION", "MARGIN_PER_RANK", "Room", "memory_headroom", "run_bytes"]

MARGIN_FRACTION = 0.10
"""Of the shared memory filesystem's size, left free by the snapshots (where they are on /dev/shm's filesystem)."""
MARGIN_PER_RANK = 256 << 20
"""At least this much per rank on the node, left free by the snapshots: of /dev/shm (NCCL's buffers, a few
DataLoader batches in flight) and of the job's memory limit (the processes' own growth)."""
_UNLIMITED = 1 << 62
"""cgroup v1 writes "no limit" as a number near 2**63 (PAGE_COUNTER_MAX pages): at or above this, none."""


def memory_headroom(proc_cgroup: str, root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The bytes this process's memory cgroups let it add (None: no limit): the least of limit less usage over its
    cgroup and every ancestor, since a limit is often set on the job's cgroup and not on the step's or task's below
    it (Slurm). `proc_cgroup`: the text of /proc/self/cgroup. v1 where a hierarchy has the memory controller
    (memory.limit_in_bytes, memory.usage_in_bytes under `root`/memory), else v2 (memory.max, memory.current)."""
    v1 = [line.split(":", 2)[2] for line in proc_cgroup.splitlines()
          if line.count(":") >= 2 and "memory" in line.split(":", 2)[1].split(",")]
    v2 = [line.split(":", 2)[2] for line in proc_cgroup.splitlines() if line.startswith("0::")]
    if v1:
        path, base, limit_file, usage_file = v1[0], root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
    elif v2:
        path, base, limit_file, usage_file = v2[0], root, "memory.max", "memory.current"
    else:
        return None
    parts = [part for part in path.strip().split("/") if part]
    headroom = None
    for depth in range(len(parts), -1, -1):
        level = base.joinpath(*parts[:depth])
        try:
            limit = (level / limit_file).read_text().strip()
            usage = int((level / usage_file).read_text())
        except (OSError, ValueError):
            continue  # no limit at this level (the v2 root has no memory.max), or unreadable
        if limit == "max" or not limit.isdigit() or int(limit) >= _UNLIMITED:
            continue
        headroom = min(headroom, int(limit) - usage) if headroom is not None else int(limit) - usage
    return headroom


def run_bytes(directory: Path) -> int:
    """The bytes of the files under `directory` (a job directory: its ranks' slots, the replicas held, a snapshot
    set aside), two levels deep; 0 where it does not exist."""
    total = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                with os.scandir(entry.path) as inner:
                    total += sum(item.stat(follow_symlinks=False).st_size for item in inner
                                 if item.is_file(follow_symlinks=False))
            elif entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue  # removed meanwhile
    return total


def _gb(size: float) -> str:
    return f"{size / 1e9:.2f} GB" if abs(size) >= 1e9 else f"{size / 1e6:.1f} MB"


@dataclass(frozen=True)
class Room:
    """One rank's view of its node's room for the run's snapshots: `base` (where the job directories are),
    `job_dir` (this run's on this node), the node's ranks."""

    base: Path
    job_dir: Path
    ranks_per_node: int = 1
    shm: Path = Path("/dev/shm")
    cgroup: Path = Path("/sys/fs/cgroup")
    proc_cgroup: Path = Path("/proc/self/cgroup")
    margin_fraction: float = MARGIN_FRACTION
    margin_per_rank: int = MARGIN_PER_RANK
    statvfs: Callable[[Path], Any] = os.statvfs

    def _stats(self) -> Any:
        self.base.mkdir(parents=True, exist_ok=True)
        return self.statvfs(self.base)

    def margin(self, stats: Any) -> int:
        """What the snapshots leave free of the filesystem at `base`: none where it is not /dev/shm's."""
        try:
            if os.stat(self.base).st_dev != os.stat(self.shm).st_dev:
                return 0
        except OSError:
            pass  # no /dev/shm to compare with: the margin, to be safe
        size = stats.f_blocks * stats.f_frsize
        return max(int(self.margin_fraction * size), self.margin_per_rank * self.ranks_per_node)

    def _limits(self, more: int, what: str) -> str | None:
        """Why `more` bytes more of this run's on this node would not fit (None: they would)."""
        try:
            stats = self._stats()
        except OSError as error:
            return f"{self.base}: {error.strerror or error}"
        free, margin = stats.f_bavail * stats.f_frsize, self.margin(stats)
        if free - more < margin:
            return (f"{self.base} has {_gb(free)} free: {what} {_gb(more)} more, and {_gb(margin)} stay free for "
                    f"NCCL's and the DataLoader's shared memory")
        try:
            headroom = memory_headroom(self.proc_cgroup.read_text(), self.cgroup)
        except OSError:
            return None  # no /proc/self/cgroup: the filesystem's free space decides
        kept = self.margin_per_rank * self.ranks_per_node
        if headroom is not None and headroom - more < kept:
            return (f"this job's memory limit leaves {_gb(headroom)}: {what} {_gb(more)} more, and {_gb(kept)} stay "
                    f"free for the processes' own memory")
        return None

    def problem(self, size: int, replicated: bool = False) -> str | None:
        """Why this node cannot hold the run's snapshots at steady state when a rank's is `size` bytes (None: it
        can): every rank's two slots and, `replicated`, the two of the partner each holds, less what the run
        holds here already."""
        copies = SLOTS * (2 if replicated else 1)
        more = max(0, self.ranks_per_node * copies * size - run_bytes(self.job_dir))
        held = " (and the replicas they hold)" if replicated else ""
        return self._limits(more, f"{self.ranks_per_node} rank(s) x {SLOTS} snapshots of {_gb(size)}{held} need")

    def replica_problem(self, size: int, reused: int) -> str | None:
        """Why a replica of `size` bytes cannot be received into a slot whose file is `reused` bytes now."""
        return self._limits(max(0, size - reused), f"a replica of {size} bytes needs")
