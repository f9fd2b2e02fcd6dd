"""A session's snapshots in host memory (checkpoint.memory_every_steps): every k steps each rank writes what a
checkpoint at that step would hold for it (mgpu.state.memory.content) into node-local shared memory
(mgpu.state.memory.store), when its node has room for them (mgpu.state.memory.room, asked before every one);
when the step is started again in the same allocation (a killed rank, a crash, a hang), the ranks agree on the
newest step every one of them holds (its own, or the replica its partner on another node holds:
mgpu.state.memory.replica) and restore it when it is newer than the durable checkpoint.

A snapshot only ever helps: one that does not restore on some rank (bytes that do not load although their CRC-32
matches, another model's state) is set aside there, in one line naming why, and every rank goes back alike to the
next newest step they all hold, then to the durable checkpoint (`restore_if_newer`: every decision on reduced
values, so the ranks stay in step); every snapshot refused is one line with its reason.

Under DDP every rank keeps the whole replicated state (model, optimizer, ...) with its own RNG and loader
position: each rank restores alone, with no peer, at the cost of one state per rank in the node's memory.
Under FSDP2 a rank keeps its shard: each DTensor as its local tensor, put back in place (a module's) or
rebuilt as a DTensor like its parameter (an optimizer's). Not for ZeroRedundancyOptimizer (its state is
consolidated on rank 0 only): a session with one takes no snapshots and says so once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Mapping, MutableMapping

from mgpu.state.memory.content import (STEP, check_content, config_digest, estimated_bytes, put_back, rank_state,
                                       structure_digest, unsupported)
from mgpu.state.memory.cadence import FALLBACK_BUDGET, Cadence
from mgpu.state.memory.room import Room
from mgpu.state.memory.store import SLOTS, Identity, SnapshotStore, local_job_id, safe_name

if TYPE_CHECKING:
    from mgpu.state.memory.buffer_record import BufferRecord
    from mgpu.state.memory.replica import Replication
    from mgpu.state.memory.step_mark import StepMarks

__all__ = ["MemorySnapshots", "Restored", "agree_on_step", "config_digest", "rank_state"]

log = logging.getLogger("mgpu.train")


@dataclass(frozen=True)
class Restored:
    """A restore from memory: the step, the snapshot's content (its "ddp" layouts among it), where it was."""

    step: int
    state: dict[str, Any]
    path: Path


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


_RANK_OWN = "on this rank: "
OWN, REPLICA, PEER, PARTNER = "own", "replica", "peer", "partner"
"""Where a restored snapshot's bytes came from: this rank's slot, its replica fetched from its partner, or another
rank's snapshot any rank may resume from (a survivor's save) on this node (PEER) or its partner's (PARTNER)."""


def _reason(error: BaseException) -> str:
    """An exception as one short line: torch's refusal to unpickle as its own reason, not its advice around it."""
    text = str(error)
    if "WeightsUnpickler error:" in text:
        text = "does not load with weights_only=True: " + text.split("WeightsUnpickler error:", 1)[1].split(
            "Check the documentation of torch.load")[0]
    return f"{type(error).__name__}: {' '.join(text.split())}"[:300]


def _load(file: IO[bytes]) -> Any:
    import torch

    return torch.load(file, map_location="cpu", weights_only=True)


class MemorySnapshots:
    """One rank's snapshots for its session. `every`: steps between snapshots (0: none; None: the default cadence,
    mgpu.state.memory.cadence). `room`: its node's room
    for them (default: the store's base directory, one rank per node)."""

    def __init__(self, store: SnapshotStore, every: int | None, version: str | None, room: Room | None = None,
                 node_peers: tuple[int, ...] = ()) -> None:
        self.store, self.version = store, version
        self.cadence = Cadence(every)
        """When one is due: every `every` steps (0: never), or None: as often as costs at most its budget of a step
        (mgpu.state.memory.cadence.BUDGET; FALLBACK_BUDGET beside survivors' saves: `fallback`)."""
        self.node_peers = node_peers
        """The other ranks on this node: their shareable snapshots are read from their files here."""
        self._record: BufferRecord | None = None
        self.room = room or Room(store.directory.parent.parent, store.directory.parent)
        self.disabled: str | None = None
        """Why this rank takes no snapshots (None: it takes them)."""
        self.taken = 0
        self.last_seconds = 0.0
        self.last_bytes = 0
        self.replication: Replication | None = None
        """The replica of these snapshots on a partner of another node, and the one this rank holds (None: none)."""

    @classmethod
    def open(cls, *, slurm_job: str | None, run_id: str, config: Any, world_size: int, rank: int, every: int | None,
             version: str | None, restart: int = 0, base: Path | None = None,
             objects: Mapping[str, Any] | None = None, ranks_per_node: int = 1,
             node_ranks: tuple[int, ...] = ()) -> "MemorySnapshots":
        """Outside Slurm the job id is derived from the run (`local-<run id>`), so a local restart finds them.
        `restart`: the job's restart count (SLURM_RESTART_COUNT: the same for a step restarted in place).
        `objects`: the state (its structure is part of the snapshots' identity); `ranks_per_node`: this node's;
        `node_ranks`: the ranks on this node (this one among them)."""
        identity = Identity(slurm_job or local_job_id(run_id), restart, run_id, config_digest(config), world_size,
                            rank, structure_digest(objects) if objects is not None else "")
        store = SnapshotStore.for_rank(identity, base)
        return cls(store, every, version, Room(store.directory.parent.parent, store.directory.parent, ranks_per_node),
                   tuple(r for r in node_ranks if r != rank))

    def take(self, step: int, objects: Mapping[str, Any], layouts: Callable[[], dict[str, Any]],
             reduce_max: Callable[[int], int] = lambda k: k) -> bool:
        """*Collective only where `layouts` is* (a DDP comm hook's state: called on every rank at every due step,
        even where this rank takes no snapshot), and at the default cadence's first snapshot (`reduce_max`: the
        steps between snapshots agreed, the most any rank needs, so that every rank takes them at the same steps).
        Called at every step (the cadence measures the steps' time). This rank's state at `step`, written now (the
        loop waits for this copy alone) when due (mgpu.state.memory.cadence). Whether one was taken. Before each,
        the node's room for the run's snapshots is checked (mgpu.state.memory.room, from the files' sizes); a rank
        without room, or whose write fails, takes none from then on and says so in one line; the run goes on."""
        if not self.cadence.due(step):
            return False
        deriving = self.cadence.current is None
        taken = self._take(step, objects, layouts)
        if deriving and not self._unsupported_here:  # alike on every rank: the same steps from here on
            self.cadence.agree(reduce_max(self.cadence.needs(self.last_seconds if taken else None)))
            if self.store.identity.rank == 0:
                log.info("a snapshot in memory every %d step(s): %.1f MB per rank in %.3f s, at most %.1f %% of the "
                         "steps' time (%s)", self.cadence.current, self.last_bytes / 1e6, self.last_seconds,
                         100 * self.cadence.budget, self.store.directory)
        elif taken:
            self.cadence.taken(step)
        return taken

    def _take(self, step: int, objects: Mapping[str, Any], layouts: Callable[[], dict[str, Any]]) -> bool:
        if self.disabled is None and (why := unsupported(objects)) is not None:
            self.disabled = why  # alike on every rank: no rank calls `layouts` from here on
            if self.store.identity.rank == 0:
                log.warning("checkpoint.memory_every_steps: no snapshots in memory: %s", why)
        if self.disabled is not None and self._unsupported_here:
            return False
        extra = layouts()
        if self.disabled is not None:
            return False
        from mgpu.state.single.store import save_state_file

        started = time.perf_counter()
        state = rank_state(objects, self.store.identity.rank, self.store.identity.world_size, self.version)
        state.update(extra)
        state[STEP] = step
        if (why := self.room.problem(self.last_bytes or estimated_bytes(state), self.replication is not None)):
            return self._disable(f"no room: {why}")
        try:
            snapshot = self.store.write(step, lambda file: save_state_file(state, file))
        except OSError as error:
            return self._disable(f"writing one failed: {error}")
        self.last_seconds, self.last_bytes = time.perf_counter() - started, snapshot.path.stat().st_size
        if self.replication is not None:
            self.replication.offer(snapshot)  # sent in the background: the loop does not wait for it
        if self.taken == 0 and self.store.identity.rank == 0 and self.cadence.every:
            log.info("a snapshot in memory every %d step(s): %.1f MB per rank in %.3f s (%s)", self.cadence.every,
                     self.last_bytes / 1e6, self.last_seconds, self.store.directory)
        self.taken += 1
        return True

    def fallback(self) -> None:
        """Survivors' saves bound a lost rank's cost (mgpu.state.memory.step_mark): these snapshots are only their
        fallback, at its budget (mgpu.state.memory.cadence.FALLBACK_BUDGET). Before the first snapshot, on every
        rank alike."""
        self.cadence.budget = FALLBACK_BUDGET

    def buffer_record(self) -> BufferRecord:
        """Rank 0's buffers at every step's end, beside its snapshots (mgpu.state.memory.buffer_record), opened once."""
        from mgpu.state.memory.buffer_record import BufferRecord

        if self._record is None:
            self._record = BufferRecord(SnapshotStore(self.store.directory.parent / "rank0-buffers",
                                                      self.store.identity))
        return self._record

    def last_words(self, marks: StepMarks) -> str:
        """A survivor's save: the last step this rank completed (`marks`, mgpu.state.memory.step_mark), written to its
        node's memory as a snapshot that the ranks lost with their processes may resume from too (its commit record says
        who may: `share`), unless this rank holds that step already. Not a collective: a peer is dead or hung. One
        line saying what was done, or why not (no room, an optimizer stepped since, ...); never raises."""
        from mgpu.state.single.store import save_state_file

        rank = self.store.identity.rank
        try:
            if self.disabled is not None and self._unsupported_here:
                return f"rank {rank}: no save of its last step: {self.disabled}"
            state, share, why = marks.state()
            if state is None or share is None:
                return f"rank {rank}: no save of its last step: {why}"
            step = int(state[STEP])
            if step in self.store.valid_steps():
                return f"rank {rank}: step {step} is in its node's memory already"
            if (room := self.room.problem(self.last_bytes or estimated_bytes(state), False)):
                return f"rank {rank}: no save of step {step}: no room: {room}"
            started = time.perf_counter()
            snapshot = self.store.write(step, lambda file: save_state_file(state, file),
                                        share={"any_rank": share.any_rank, "rank0_buffers": share.rank0_buffers})
        except Exception as error:  # noqa: BLE001  # the failure that brought us here is the one to report
            return f"rank {rank}: its last step could not be saved: {_reason(error)}"
        return (f"rank {rank}: step {step}, its last, saved to its node's memory in {time.perf_counter() - started:.2f} s "
                f"({snapshot.path.stat().st_size / 1e6:.1f} MB{'' if share.any_rank else ', this rank only'})")

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

    def replica_refusal(self, size: int, reused: int) -> str | None:
        """Why the replica this rank holds cannot take a snapshot of `size` bytes into a slot of `reused` bytes
        (None: it can): more than twice this rank's own snapshot (what the room check counted for it, with room
        for a shard of another size), or more than its node has room for."""
        if self.last_bytes and size > 2 * self.last_bytes + (1 << 20):
            return f"{size} bytes, more than twice this rank's own snapshot ({self.last_bytes} bytes)"
        return self.room.replica_problem(size, reused)

    def _say(self, line: str) -> None:
        log.warning("checkpoint.memory_every_steps: rank %d: %s", self.store.identity.rank, line)

    def agreed_step(self, reduce_min: Callable[[int], int]) -> int | None:
        """*Collective.* The newest step every rank can restore from memory, its own or its replica (None: none)."""
        return agree_on_step(self._candidates(), reduce_min)

    def _candidates(self) -> list[int]:
        """The steps this rank can restore, newest first: its own, its replica's, and another rank's that any rank
        may resume from (a survivor's save: on this node, or its partner's over the network); each refused one
        said."""
        own = self.store.restorable(self._say)
        replica = self.replication.steps() if self.replication is not None else []
        return sorted(set(own) | set(replica) | set(self._shared()), reverse=True)

    def _shared(self) -> dict[int, tuple[str, int, bool]]:
        """The steps another rank's snapshot can give this one: step -> (PEER, the rank on this node whose files hold
        it, or PARTNER, the rank on another node that serves it; whether rank 0's buffers come from its own record:
        rank 0 resuming from a save taken before DDP broadcast them)."""
        rank0 = self.store.identity.rank == 0
        recorded = set(self.buffer_record().steps()) if rank0 else set()
        found: dict[int, tuple[str, int, bool]] = {}
        sources: list[tuple[str, int, Callable[[bool], list[int]]]] = []
        if self.replication is not None:
            sources.append((PARTNER, self.replication.partner.rank, self.replication.partners_own))
        sources += [(PEER, peer, self.store.for_peer(peer).shared_steps) for peer in self.node_peers]
        for kind, peer, steps in sources:
            whole = set(steps(rank0))
            for step in (set(steps(False)) & recorded if rank0 else set()) - whole:
                found[step] = (kind, peer, True)
            for step in whole:
                found[step] = (kind, peer, False)
        return found

    def _read(self, step: int, seed: int) -> tuple[Any, str, str | None]:
        """(the content of this rank's snapshot of `step`, OWN or REPLICA, why it cannot be read: None where it can):
        its slot, else (lost, replaced) the replica its partner on another node holds, fetched back; checked to be
        a snapshot of that step."""
        source = OWN
        rank = self.store.identity.rank
        try:
            try:
                state = self.store.read(step, _load)
            except FileNotFoundError:  # not on this node (lost, replaced): the replica on the partner's
                if self.replication is None or step not in self.replication.steps():
                    state, source = self._read_shared(step, seed), PEER
                else:
                    source = REPLICA
                    state = _load(self.replication.fetch(step))
                    log.info("rank %d: step %d restored from its replica on rank %d", rank, step,
                             self.replication.partner.rank)
            check_content(state, step)
        except Exception as error:  # noqa: BLE001  # anything that does not load falls back, never fails the run
            return None, source, _reason(error)
        return state, source, None

    def _read_shared(self, step: int, seed: int) -> Any:
        """Another rank's snapshot of `step` that any rank may resume from, with this rank's RNG of that step
        (derived: mgpu.state.rng.seed_step) in place of that rank's."""
        from mgpu.state.rng import step_rng_state

        where = self._shared().get(step)
        if where is None:
            raise FileNotFoundError(f"no snapshot of step {step} on this node, in its replica or to share")
        kind, peer, overlay = where
        if kind == PEER:
            state = self.store.for_peer(peer).read(step, _load)
        else:
            assert self.replication is not None
            state = _load(self.replication.fetch(step, own=True, rank0=self.store.identity.rank == 0 and not overlay))
        if overlay:  # rank 0's buffers of that step, from its own record: the save was taken before DDP synced them
            for name, buffers in self.buffer_record().read(step).items():
                state[name] = {**state[name], **buffers}
        rank = self.store.identity.rank
        state["rng"] = [None] * len(state["rng"])
        state["rng"][rank] = step_rng_state(seed, rank, step)
        log.info("rank %d: step %d restored from rank %d's save (%s), with this rank's own generators",
                 rank, step, peer, "this node" if kind == PEER else "over the network")
        return state

    def restore(self, step: int, objects: MutableMapping[str, Any], seed: int,
                missing_ok: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
        """Put this rank's snapshot of `step` into `objects` (mgpu.state.memory.content.put_back); its content."""
        state, _, why = self._read(step, seed)
        if why is not None:
            raise ValueError(f"the snapshot of step {step} does not restore: {why}")
        put_back(state, step, objects, self.store.identity.rank, seed, missing_ok)
        return dict(state)

    def restore_if_newer(self, durable_step: int, reduce_min: Callable[[int], int], objects: MutableMapping[str, Any],
                         seed: int, missing_ok: frozenset[str] | set[str] = frozenset()) -> Restored | None:
        """*Collective.* Restore the newest step every rank holds in memory when it is newer than the durable
        checkpoint's (`durable_step`; -1: none), and say so on rank 0; None: the durable checkpoint, as before.

        Every rank reads its snapshot of the agreed step first, and only where every rank could (a MIN over the
        outcomes) do they put it back, and agree again. A rank whose snapshot does not read or restore sets it
        aside (one line naming why) and the ranks try the next newest step they all hold, then the durable
        checkpoint, alike. Where some rank had put a snapshot back and none restores on every rank, with no durable
        checkpoint to overwrite it, this attempt fails (RuntimeError, not bad input): the next starts afresh."""
        rank = self.store.identity.rank
        candidates = self._candidates()
        restored, touched = None, False
        while (step := agree_on_step(candidates, reduce_min)) is not None and step > durable_step:
            state, source, why = self._read(step, seed)
            if reduce_min(0 if why else 1) == 1:
                touched = True
                try:
                    put_back(state, step, objects, rank, seed, missing_ok)
                except Exception as error:  # noqa: BLE001  # another model's state, say: the next one, alike
                    why = _reason(error)
                if reduce_min(0 if why else 1) == 1:
                    restored = Restored(step, state, self.store.directory.parent)
                    break
            if why is not None:
                self._set_aside(step, source, why)
            candidates = [s for s in candidates if s != step]  # alike on every rank: the step was agreed
        for store in (self.store, self.replication.held if self.replication is not None else None):
            if store is not None:  # the slots after the step the run goes on from are another attempt's
                store.discard_after(max(durable_step, 0) if restored is None else restored.step)
        if restored is None:
            if touched and durable_step < 0:
                raise RuntimeError("the snapshots in memory did not restore on every rank after some were put back, "
                                   "and there is no durable checkpoint to go back to: this attempt fails, the next "
                                   "starts the run afresh (the snapshots that failed are set aside)")
            return None  # the durable checkpoint
        if rank == 0:
            log.info("resumed at step %d from the snapshots in memory (%s), newer than the durable checkpoint%s",
                     restored.step, self.store.directory.parent,
                     f" (step {durable_step})" if durable_step >= 0 else " (none)")
        return restored

    def _set_aside(self, step: int, source: str, why: str) -> None:
        """This rank's snapshot of `step` did not restore: out of use, in one line."""
        if source == REPLICA:
            assert self.replication is not None
            where = f"its replica on rank {self.replication.partner.rank} is dropped with the slots after the resume"
        elif source == PEER:
            where = "another rank's save, not used by this one"
        else:
            kept = self.store.set_aside(step, why)
            where = f"set aside as {kept}" if kept is not None else "its slot was gone"
        self._say(f"the snapshot of step {step} does not restore ({why}): {where}; the ranks go back to the next "
                  f"newest snapshot they all hold, else the durable checkpoint")

    def discard(self) -> None:
        """This rank's snapshots and the replica it holds (a fresh start); the replicas go on from here."""
        if self.replication is not None:
            self.replication.clear()
        self.store.remove()

    def _close_record(self) -> None:
        if self._record is not None:
            self._record.close()
            self._record.store.remove()
            self._record = None

    def remove(self) -> None:
        """This rank's snapshots and the replica it holds, the replicas stopped first (the run ended: finished,
        stopped with its checkpoint, or stays down)."""
        if self.replication is not None:
            self.replication.close()
        self._close_record()
        self.store.remove()

    def remove_other_jobs(self) -> None:
        """Snapshots of this run on this node from another job (never restorable here: another job id)."""
        import shutil

        mine = self.store.directory.parent
        for path in mine.parent.glob(f"mgpu-*-{safe_name(self.store.identity.run)}"):
            if path != mine:
                shutil.rmtree(path, ignore_errors=True)
