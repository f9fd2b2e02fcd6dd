"""A session's snapshots in host memory (checkpoint.memory_every_steps): every k steps each rank writes what a
checkpoint at that step would hold for it into node-local shared memory (mgpu.state.memory_snapshot); when the step
is started again in the same allocation (a killed rank, a crash, a hang), the ranks agree on the newest step
every one of them holds (its own, or the replica its partner on another node holds: mgpu.state.memory_replica)
and restore it when it is newer than the durable checkpoint.

Under DDP every rank keeps the whole replicated state (model, optimizer, ...) with its own RNG and loader
position: each rank restores alone, with no peer, at the cost of one state per rank in the node's memory.
Under FSDP2 a rank keeps its shard: each DTensor as its local tensor, put back in place (a module's) or
rebuilt as a DTensor like its parameter (an optimizer's). Not for ZeroRedundancyOptimizer (its state is
consolidated on rank 0 only): a session with one takes no snapshots and says so once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Mapping, MutableMapping

from mgpu.state.memory_snapshot import SLOTS, Identity, SnapshotStore, local_job_id

if TYPE_CHECKING:
    from mgpu.state.memory_replica import Replication

__all__ = ["MemorySnapshots", "Restored", "agree_on_step", "config_digest", "rank_state"]

log = logging.getLogger("mgpu.train")


@dataclass(frozen=True)
class Restored:
    """A restore from memory: the step, the snapshot's content (its "ddp" layouts among it), where it was."""

    step: int
    state: dict[str, Any]
    path: Path


def config_digest(config: Any) -> str:
    """A digest of the resolved config (a dataclass or a mapping): a snapshot taken under another is stale."""
    plain = asdict(config) if is_dataclass(config) and not isinstance(config, type) else config
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:16]


def agree_on_step(own: list[int], reduce_min: Callable[[int], int]) -> int | None:
    """*Collective* through `reduce_min` (an all-reduce MIN over the ranks): the newest step every rank holds
    (`own`: the steps this rank can restore: its own slots and its replica's), or None. Each round proposes every
    rank's newest step below the last proposal and keeps the least; it is taken when every rank has it. At most
    2 x SLOTS + 1 rounds (two slots of its own, two of its replica), the same number on every rank (every
    decision is on reduced values)."""
    bound: int | None = None
    for _ in range(2 * SLOTS + 1):
        proposal = reduce_min(max((s for s in own if bound is None or s < bound), default=-1))
        if proposal < 0:
            return None
        if reduce_min(1 if proposal in own else 0) == 1:
            return proposal
        bound = proposal
    return None


def rank_state(objects: Mapping[str, Any], rank: int, world_size: int, version: str | None) -> dict[str, Any]:
    """What a checkpoint holds, as this rank can give it with no collective: the objects' states (replicated
    under DDP), and in the per-rank entries (RNG, a stateful stream's position) this rank's alone, at its place."""
    from mgpu.state.rng import capture_rng_state
    from mgpu.state.train_state import FORMAT, unwrapped

    def at_rank(value: Any) -> list[Any]:
        entries: list[Any] = [None] * world_size
        entries[rank] = value
        return entries

    state: dict[str, Any] = {"format": FORMAT, "rng": at_rank(capture_rng_state()), "world_size": world_size,
                             "code_version": version}
    for name, value in objects.items():
        if callable(getattr(value, "rank_state_dict", None)):
            state[name] = {"per_rank": at_rank(value.rank_state_dict())}
            continue
        value = unwrapped(value)
        if hasattr(value, "state_dict"):
            state[name] = _local(value.state_dict())
        elif is_dataclass(value) and not isinstance(value, type):
            state[name] = asdict(value)
        else:
            state[name] = value
    return state


LOCAL = "__mgpu_dtensor_local__"
"""A DTensor in a snapshot: {LOCAL: its local tensor} (plain data: loads with weights_only)."""


def _dtensor_class() -> Any:
    import sys

    module = sys.modules.get("torch.distributed.tensor")  # imported where a DTensor exists (FSDP2 imported it)
    return getattr(module, "DTensor", None)


def _local(value: Any) -> Any:
    """`value` with every DTensor replaced by {LOCAL: its local tensor}; `value` itself where it has none."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return value

    def walk(item: Any) -> Any:
        if isinstance(item, dtensor):
            return {LOCAL: item.to_local()}
        if isinstance(item, dict):
            changed = {key: walk(part) for key, part in item.items()}
            return changed if any(changed[key] is not part for key, part in item.items()) else item
        if type(item) in (list, tuple):
            parts = [walk(part) for part in item]
            return type(item)(parts) if any(a is not b for a, b in zip(parts, item)) else item
        return item

    return walk(value)


def _has_local(value: Any) -> bool:
    if isinstance(value, dict):
        return LOCAL in value or any(_has_local(item) for item in value.values())
    if type(value) in (list, tuple):
        return any(_has_local(item) for item in value)
    return False


def _restore_shards(saved: dict[str, Any], target: Any, name: str) -> None:
    """A sharded object's snapshot put back: a module's tensors copied into its own (local shards in place), an
    optimizer's state rebuilt as DTensors like the parameters they belong to, then loaded."""
    from torch import nn

    if isinstance(target, nn.Module):
        live = target.state_dict()
        missing = sorted(set(live) ^ set(saved))
        if missing:
            raise KeyError(f"state[{name!r}]: the snapshot's keys differ from the module's: {missing[:5]}")
        dtensor = _dtensor_class()
        for key, value in saved.items():
            dest = live[key]
            dest = dest.to_local() if dtensor is not None and isinstance(dest, dtensor) else dest
            dest.copy_(value[LOCAL] if isinstance(value, dict) else value)
        return
    params = [p for group in getattr(target, "param_groups", []) for p in group["params"]]
    if not params or not isinstance(saved.get("state"), dict):
        raise TypeError(f"state[{name!r}]: a {type(target).__name__} with sharded tensors: only modules and "
                        f"optimizers are put back from a snapshot in memory")
    from torch.distributed.tensor import DTensor

    for index, entries in saved["state"].items():
        param = params[index]
        for key, value in list(entries.items()):
            if isinstance(value, dict) and LOCAL in value:
                entries[key] = DTensor.from_local(value[LOCAL].clone(), param.device_mesh, param.placements,
                                                  run_check=False, shape=param.shape, stride=param.stride())
    target.load_state_dict(saved)


def _unsupported(objects: Mapping[str, Any]) -> str | None:
    from mgpu.state.train_state import is_zero_optimizer

    if any(is_zero_optimizer(value) for value in objects.values()):
        return "a ZeroRedundancyOptimizer's state is split across the ranks"
    return None


def _tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in `value` (nested dicts, lists, tuples)."""
    if hasattr(value, "untyped_storage") and hasattr(value, "element_size"):
        return int(value.numel() * value.element_size())
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


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


def no_room(base: Path, size: int, cgroup: Path = Path("/sys/fs/cgroup"),
            proc_cgroup: Path = Path("/proc/self/cgroup")) -> str | None:
    """Why this node cannot hold two more snapshots of `size` bytes (None: it can): the free space of the shared
    memory filesystem at `base`, or the headroom of this process's memory cgroups (`memory_headroom`; tmpfs pages
    are charged to them, so a full one would get the rank OOM-killed)."""
    import os

    need = 2 * size + size // 10
    try:
        base.mkdir(parents=True, exist_ok=True)
        stats = os.statvfs(base)
    except OSError as error:
        return f"{base}: {error}"
    if stats.f_bavail * stats.f_frsize < need:
        return (f"{base} has {stats.f_bavail * stats.f_frsize / 1e9:.2f} GB free, two snapshots of this rank need "
                f"{need / 1e9:.2f} GB")
    try:
        headroom = memory_headroom(proc_cgroup.read_text(), cgroup)
    except OSError:
        return None  # no /proc/self/cgroup: the filesystem's free space decides
    if headroom is not None and headroom < need:
        return (f"this job's memory limit leaves {headroom / 1e9:.2f} GB, two snapshots of this rank "
                f"need {need / 1e9:.2f} GB")
    return None


_RANK_OWN = "on this rank: "


class MemorySnapshots:
    """One rank's snapshots for its session. `every`: steps between snapshots (0: none)."""

    def __init__(self, store: SnapshotStore, every: int, version: str | None) -> None:
        self.store, self.every, self.version = store, every, version
        self.disabled: str | None = None
        """Why this rank takes no snapshots (None: it takes them)."""
        self.taken = 0
        self.last_seconds = 0.0
        self.last_bytes = 0
        self.replication: Replication | None = None
        """The replica of these snapshots on a partner of another node, and the one this rank holds (None: none)."""

    @classmethod
    def open(cls, *, slurm_job: str | None, run_id: str, config: Any, world_size: int, rank: int, every: int,
             version: str | None, restart: int = 0, base: Path | None = None) -> "MemorySnapshots":
        """Outside Slurm the job id is derived from the run (`local-<run id>`), so a local restart finds them.
        `restart`: the job's restart count (SLURM_RESTART_COUNT: the same for a step restarted in place)."""
        identity = Identity(slurm_job or local_job_id(run_id), restart, run_id, config_digest(config), world_size,
                            rank)
        return cls(SnapshotStore.for_rank(identity, base), every, version)

    def take(self, step: int, objects: Mapping[str, Any], layouts: Callable[[], dict[str, Any]]) -> bool:
        """*Collective only where `layouts` is* (a DDP comm hook's state: called on every rank at every due step,
        even where this rank takes no snapshot). This rank's state at `step`, written now (the loop waits for this
        copy alone). Whether one was taken. A rank whose node has no room for two snapshots (the shared memory's
        free space, the memory cgroup's headroom), or whose write fails, takes none from then on and says so."""
        if not (self.every > 0 and step > 0 and step % self.every == 0):
            return False
        if self.disabled is None and (why := _unsupported(objects)) is not None:
            self.disabled = why  # alike on every rank: no rank calls `layouts` from here on
            if self.store.identity.rank == 0:
                log.warning("checkpoint.memory_every_steps: no snapshots in memory: %s", why)
        if self.disabled is not None and self._unsupported_here:
            return False
        extra = layouts()
        if self.disabled is not None:
            return False
        from mgpu.state.checkpoint import save_state_file

        started = time.perf_counter()
        state = rank_state(objects, self.store.identity.rank, self.store.identity.world_size, self.version)
        state.update(extra)
        if self.taken == 0 and (why := no_room(self.store.directory.parent.parent, _tensor_bytes(state))):
            return self._disable(why)
        try:
            snapshot = self.store.write(step, lambda file: save_state_file(state, file))
        except OSError as error:
            return self._disable(f"writing one failed: {error}")
        self.last_seconds, self.last_bytes = time.perf_counter() - started, snapshot.path.stat().st_size
        if self.replication is not None:
            self.replication.offer(snapshot)  # sent in the background: the loop does not wait for it
        if self.taken == 0 and self.store.identity.rank == 0:
            log.info("a snapshot in memory every %d step(s): %.1f MB per rank in %.3f s (%s)", self.every,
                     self.last_bytes / 1e6, self.last_seconds, self.store.directory)
        self.taken += 1
        return True

    @property
    def _unsupported_here(self) -> bool:
        """Disabled alike on every rank (the state's kind), not by this rank's room or write."""
        return self.disabled is not None and not self.disabled.startswith(_RANK_OWN)

    def _disable(self, why: str) -> bool:
        self.disabled = f"{_RANK_OWN}{why}"
        self.store.remove()
        log.warning("checkpoint.memory_every_steps: rank %d takes no more snapshots in memory: %s",
                    self.store.identity.rank, why)
        return False

    def agreed_step(self, reduce_min: Callable[[int], int]) -> int | None:
        """*Collective.* The newest step every rank can restore from memory, its own or its replica (None: none)."""
        own = self.store.valid_steps()
        replica = self.replication.steps() if self.replication is not None else []
        return agree_on_step(sorted(set(own) | set(replica), reverse=True), reduce_min)

    def restore(self, step: int, objects: MutableMapping[str, Any], seed: int,
                missing_ok: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
        """Put this rank's snapshot of `step` into `objects` (mgpu.state.train_state.restore_state); its content."""
        import torch

        from mgpu.state.train_state import restore_state

        def load(file: IO[bytes]) -> Any:
            return torch.load(file, map_location="cpu", weights_only=True)

        from mgpu.state.train_state import unwrapped

        try:
            state = self.store.read(step, load)
        except FileNotFoundError:  # not on this node (lost, replaced): the replica on the partner's
            if self.replication is None:
                raise
            state = load(self.replication.fetch(step))
            log.info("rank %d: step %d restored from its replica on rank %d", self.store.identity.rank, step,
                     self.replication.partner.rank)
        sharded = [name for name in objects if name in state and _has_local(state[name])]
        for name in sharded:
            _restore_shards(state[name], unwrapped(objects[name]), name)
        rest = {name: value for name, value in objects.items() if name not in sharded}
        restore_state(state, rest, self.store.identity.rank, seed, missing_ok)
        objects.update(rest)  # the plain values restore_state replaced
        return state

    def restore_if_newer(self, durable_step: int, reduce_min: Callable[[int], int], objects: MutableMapping[str, Any],
                         seed: int, missing_ok: frozenset[str] | set[str] = frozenset()) -> Restored | None:
        """*Collective.* Restore the newest step every rank holds in memory when it is newer than the durable
        checkpoint's (`durable_step`; -1: none), and say so on rank 0; None: the durable checkpoint, as before."""
        step = self.agreed_step(reduce_min)
        if step is None or step <= durable_step:
            step = None
        for store in (self.store, self.replication.held if self.replication is not None else None):
            if store is not None:  # the slots after the step the run goes on from are another attempt's
                store.discard_after(max(durable_step, 0) if step is None else step)
        if step is None:
            return None  # the durable checkpoint
        state = self.restore(step, objects, seed, missing_ok)
        if self.store.identity.rank == 0:
            log.info("resumed at step %d from the snapshots in memory (%s), newer than the durable checkpoint%s",
                     step, self.store.directory.parent, f" (step {durable_step})" if durable_step >= 0 else " (none)")
        return Restored(step, state, self.store.directory.parent)

    def discard(self) -> None:
        """This rank's snapshots and the replica it holds (a fresh start); the replicas go on from here."""
        if self.replication is not None:
            self.replication.clear()
        self.store.remove()

    def remove(self) -> None:
        """This rank's snapshots and the replica it holds, the replicas stopped first (the run ended: finished,
        stopped with its checkpoint, or stays down)."""
        if self.replication is not None:
            self.replication.close()
        self.store.remove()

    def remove_other_jobs(self) -> None:
        """Snapshots of this run on this node from another job (never restorable here: another job id)."""
        import shutil

        from mgpu.state.memory_snapshot import safe_name

        mine = self.store.directory.parent
        for path in mine.parent.glob(f"mgpu-*-{safe_name(self.store.identity.run)}"):
            if path != mine:
                shutil.rmtree(path, ignore_errors=True)
