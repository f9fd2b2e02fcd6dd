"""A Session's checkpoint path: the run's checkpointer (made at first use), `load` (the refusals of a state a
checkpoint cannot hold, `fresh`'s setting aside, the restore through mgpu.state.resumption, the wrapped DDPs' saved
buckets, optimizer hyperparameters a checkpoint overrode or `override` sets) and `save` (the refusal to save over
checkpoints not loaded; sharded, every rank its shard; otherwise the gathered state with the DDPs' buckets beside
it; a durable save remembered so that the end does not save that step again). `mgpu.run.session.Session` calls
these; nothing else should. No torch at import.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from mgpu.errors import MgpuError
from mgpu.run.session_base import SessionBase

if TYPE_CHECKING:
    from mgpu.state.train_state import State

__all__ = ["last_words", "load", "memory", "open_checkpointer", "open_marks", "refuse_diverged", "restore_from_memory",
           "resume_begins", "save", "snapshot"]

log = logging.getLogger("mgpu.train")


def open_checkpointer(session: SessionBase) -> Any:
    """The run's checkpoint coordination (mgpu.state.checkpointer; sharded: mgpu.state.sharded.checkpointer), closed
    with the session."""
    from mgpu.state.checkpointer import open_checkpointer as open_for_run
    from mgpu.state.save_budget import peer_wait_s
    from mgpu.record.save_record import saving_beat

    beat = saving_beat(session.beat, session.ledger.path, writers=session.world_size if session.sharded else 1,
                       sharded=session.sharded, job=session.env.job_id, restart=session.env.restart_count)
    checkpointer = open_for_run(session.run, session.rank, session.world_size, session.ledger,
                                session.cfg.checkpoint, sharded=session.sharded, beat=beat,
                                version=session.version, wait_s=peer_wait_s(session.save_allowance_s))
    session._cleanup.callback(checkpointer.close)
    return checkpointer


def check_state(objects: Mapping[str, Any], sharded: bool) -> None:
    """Refuse, before any training, a state a checkpoint cannot save (mgpu.state.train_state.check_checkpointable),
    an EMA made of parameters its model no longer has, and, when the checkpoints are `sharded`, an optimizer over
    parameters that are not its models'."""
    from mgpu.parallel.ema import EMA
    from mgpu.parallel.fsdp import refuse_stale_optimizers
    from mgpu.state.train_state import check_checkpointable

    check_checkpointable(objects)
    for value in objects.values():
        if isinstance(value, EMA):
            value.check_source()
    if sharded:
        refuse_stale_optimizers(objects)


def resume_begins(session: SessionBase) -> None:
    """The resume's own watchdog allowance until load() ends (mgpu.state.save_budget), its start recorded
    (mgpu.record.save_record), and a group timeout that waits out rank 0's hash when that may be longer."""
    from mgpu.record.save_record import open_attempt

    open_attempt(session.ledger.path, "resume", writers=session.world_size, sharded=session.sharded,
                 job=session.env.job_id, restart=session.env.restart_count)
    session.beat("resume")
    if session.watchdog is not None:
        from mgpu.parallel.distributed import set_collective_timeout

        wait = session.watchdog.collective_timeout(session.cfg.distributed.init_timeout_s, resuming=True)
        if wait > session.cfg.distributed.init_timeout_s:
            set_collective_timeout(timedelta(seconds=wait))


def load(session: SessionBase, state: MutableMapping[str, Any], missing_ok: set[str] | frozenset[str],
         override: Mapping[str, Any] | None, fresh: bool, batch_size: int | None,
         global_batch: int | None) -> State:
    """`Session.load`: `state` resumed from the run's newest checkpoint, if it has one; the run begun."""
    from mgpu.state import hparams
    from mgpu.state.train_state import State

    if not isinstance(state, MutableMapping):
        raise MgpuError(f"Session.load() takes a dict of what to checkpoint (name -> model, optimizer, loader, "
                        f"value), got a {type(state).__name__}")
    check_state(state, session.sharded)
    if fresh:
        session.resumption.start_over()
    session.latest()
    before = hparams.constructed(state)
    loaded = restore_from_memory(session, state, set(missing_ok), fresh)
    loaded = loaded or session.resumption.restore(state, set(missing_ok), batch_size, global_batch)
    if loaded is not None:
        session.timings["restored"] = time.time()
        session.step = session.resume_step = loaded.step
        if session._ddps is not None:  # [mgpu.parallel.ddp bucket layout] the wrapped DDPs' saved buckets
            session._ddps.resume(loaded.state.get("ddp"))
        for line in hparams.overridden_by_checkpoint(before, state, override or {}) if session.is_main else ():
            log.warning("%s (to change it on purpose: load(state, override={...}))", line)
    changes = hparams.apply(state, override or {})
    open_marks(session, state)
    session.beat("start")  # resumed: the first step's allowance from here
    session._state = state
    session.begin()
    if loaded is not None and session.resumption.path is None:  # restored from the snapshots in memory
        session.ledger.write("resumed", step=session.step, memory=True, durable_step=session._durable_step,
                             **{"from": f"memory:{loaded.path}"})
    if changes:
        session.ledger.write("hyperparameters", step=session.step, changes=changes)
        log.info("hyperparameters changed at step %d: %s", session.step, "; ".join(changes))
    return state if isinstance(state, State) else State(state)


def save(session: SessionBase, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None, best: bool,
         wait: bool, reason: str | None, meta: dict[str, Any] | None) -> Path | None:
    """`Session.save`: `state` (default: the one given to `load()`) checkpointed at the session's step."""
    from mgpu.state.train_state import gather_state

    state = session._state if state is None else state
    if state is None:
        raise MgpuError("Session.save(): nothing to save: pass the state (or load() it first)")
    if not (callable(state) or isinstance(state, Mapping)):
        raise MgpuError(f"Session.save() takes the state mapping (name -> object), got a {type(state).__name__}")
    if not session.resumption.looked:
        session.resumption.refuse_unloaded()
        check_state(state() if callable(state) else state, session.sharded)
    session._state = state
    session.begin()
    objects, reason = state() if callable(state) else state, reason or ("best" if best else "periodic")
    refuse_diverged(objects, replicated_by_ddp(session))
    extra = session.resumption.save_meta(meta)  # with the run's global batch, for a resume's line
    checkpointer, step = session.checkpointer, session.step
    if session.sharded:  # [fsdp hook] every rank contributes its shard
        path = checkpointer.save_objects(objects, step, reason, is_best=best, wait=wait, extra=extra)
    else:
        ddps = session._ddps  # [mgpu.parallel.ddp bucket layout] the wrapped DDPs' buckets, saved beside the state
        assert ddps is not None
        path = checkpointer.save(lambda: ddps.gather(lambda: gather_state(objects, session.version)),
                                 step, reason, is_best=best, wait=wait, extra=extra)
    if wait:  # durable now: end() does not save this step again
        session._durable = (step, path)
    return path


def replicated_by_ddp(session: SessionBase) -> set[int]:
    """The ids of the modules the session's DDPs hold: the same on every rank by DDP's own contract."""
    return {id(inner) for wrapped in session._wrapped if (inner := getattr(wrapped, "module", None)) is not None}


def refuse_diverged(objects: Mapping[str, Any], skip: set[int] | frozenset[int] = frozenset()) -> None:
    """*Collective.* A checkpoint keeps one copy of a module that is not sharded (rank 0's in a single file, any
    rank's through DCP): refused in one line, on every rank alike, when its copies differ between ranks
    (mgpu.parallel.fsdp.diverged_replicas: one all-gather of a number per module), never saved as one rank's.
    `skip`: the ids of modules that cannot differ (DDP's: it broadcasts and reduces them)."""
    from torch import nn

    from mgpu.parallel.fsdp import diverged_replicas
    from mgpu.state.checkpoint_format import CheckpointError
    from mgpu.state.train_state import unwrapped

    modules = {name: unwrapped(value) for name, value in objects.items()
               if isinstance(unwrapped(value), nn.Module) and id(unwrapped(value)) not in skip}
    problem = diverged_replicas(modules)
    if problem is not None:
        raise CheckpointError(f"not saved: {problem}")


def memory(session: SessionBase, objects: Mapping[str, Any]) -> Any:
    """This rank's snapshots in the node's memory (checkpoint.memory_every_steps, mgpu.state.memory.snapshots) of the
    state `objects`, opened at first use; another job's of this run on this node removed."""
    if session._memory is None:
        from mgpu.state.memory.snapshots import MemorySnapshots

        env = session.env
        first = session.rank - env.local_rank  # the node's ranks are consecutive (Slurm's block distribution)
        session._memory = snapshots = MemorySnapshots.open(
            slurm_job=session.slurm_job, run_id=session.run_id, config=session.cfg, world_size=session.world_size,
            rank=session.rank, every=session.cfg.checkpoint.memory_every_steps, version=session.version,
            restart=env.restart_count, objects=objects, ranks_per_node=env.local_world_size,
            node_ranks=tuple(range(first, first + env.local_world_size)))
        snapshots.remove_other_jobs()
        if session.cfg.checkpoint.memory_every_steps != 0:
            snapshots.replication = replication(session, snapshots.store.identity, snapshots.replica_refusal,
                                                snapshots.store)
    return session._memory


def open_marks(session: SessionBase, state: Mapping[str, Any]) -> None:
    """The marks of every step's end (mgpu.state.memory.step_mark) and the survivor's save they allow
    (`last_words`), where one can help: snapshots in memory on, DDP (each rank holds the replicated state; under
    FSDP2 a lost rank's shard comes only from its replica), more than one rank. The watchdog says them too: a peer
    hung (its verdict), or a stop signal came and this rank's step does not end (srun ends a failed step's other
    tasks so: SIGTERM, then SIGKILL after KillWait)."""
    import threading

    from mgpu.state.memory.step_mark import StepMarks

    if (session._marks is not None or session.cfg.checkpoint.memory_every_steps == 0 or session.sharded
            or session.world_size < 2 or session._ddps is None):
        return
    memory(session, state)

    def objects() -> Mapping[str, Any]:  # what the session saves now (`save()` may be given another state)
        current = session._state if session._state is not None else state
        return current() if callable(current) else current

    session._marks = marks = StepMarks(objects, session._ddps.live, session.rank, session.world_size,
                                       session.cfg.train.seed, session.version)
    marks.lock = threading.Lock()
    session._memory.fallback()  # the marks' saves bound a lost rank's cost: the snapshots are their fallback
    if session.rank == 0:
        marks.record = session._memory.buffer_record()
    watchdog = session.watchdog
    if watchdog is not None:
        watchdog.last_words = lambda why: last_words(session, why)
        stop = session.stop
        watchdog.signalled = lambda: stop.received[0][1] if stop.received else None


def last_words(session: SessionBase, why: str) -> None:
    """A survivor's save, once: the last step this rank completed into its node's memory, so that the step started
    again resumes there (mgpu.state.memory.snapshots.MemorySnapshots.last_words); one line saying `why` and what was
    saved. Not a collective: safe from the watchdog's thread while the training thread waits in a collective."""
    marks, snapshots = session._marks, session._memory
    if marks is None or snapshots is None:
        return
    with marks.lock:
        if marks.said:
            return
        marks.said = True
        log.warning("%s: %s", why, snapshots.last_words(marks))


def replication(session: SessionBase, identity: Any, budget: Callable[[int, int], str | None], own: Any = None) -> Any:
    """This rank's side of the replicas on another node (mgpu.state.memory.replica), or None: one node, or the
    rendezvous store cannot be reached (said; the snapshots stay on their node). `budget`: what the replica it
    holds may take (mgpu.state.memory.snapshots.MemorySnapshots.replica_refusal)."""
    from mgpu.run.runner import node_name
    from mgpu.state.memory.replica import Replication, StoreDirectory, local_address

    env = session.env
    node = node_name(env)
    try:
        return Replication.start(identity, node=node, ranks_per_node=env.local_world_size, num_nodes=env.num_nodes,
                                 host=local_address(env.master_addr, env.master_port) if env.num_nodes > 1 else "",
                                 directory=StoreDirectory.rendezvous, budget=budget, own=own)
    except (OSError, RuntimeError, ValueError) as error:
        log.warning("checkpoint.memory_every_steps: rank %d: no replica of its snapshots on another node: %s: %s",
                    session.rank, type(error).__name__, error)
        return None


def snapshot(session: SessionBase) -> bool:
    """`Session.snapshot`: this step's state into the node's memory when `checkpoint.memory_every_steps` says so."""
    if session._state is None or session.cfg.checkpoint.memory_every_steps == 0:
        return False
    ddps = session._ddps
    assert ddps is not None
    objects = session._state() if callable(session._state) else session._state

    def reduce_max(value: int) -> int:
        return int(session.all_reduce(value, "max").item()) if session.world_size > 1 else value

    return bool(memory(session, objects).take(session.step, objects, lambda: ddps.gather(dict) or {}, reduce_max))


def restore_from_memory(session: SessionBase, state: MutableMapping[str, Any], missing_ok: set[str], fresh: bool) -> Any:
    """*Collective.* The snapshots in memory, restored into `state` when every rank has one newer than the
    durable checkpoint (mgpu.state.memory.snapshots.Restored), else None. `fresh`: none restored, this rank's removed.
    With snapshots off (checkpoint.memory_every_steps: 0), this run's on this node are removed: none would go."""
    found = session.resumption.latest()
    session._durable_step = found.step if found is not None else -1
    if session.cfg.checkpoint.memory_every_steps == 0:
        from mgpu.state.memory.store import remove_run

        remove_run(session.run_id)  # every rank of the node, alike: whichever comes first removes them
        return None
    if fresh:
        memory(session, state).discard()
        return None

    def reduce_min(value: int) -> int:
        return int(session.all_reduce(value, "min").item()) if session.world_size > 1 else value

    return memory(session, state).restore_if_newer(session._durable_step, reduce_min, state, session.cfg.train.seed,
                                                   missing_ok)
