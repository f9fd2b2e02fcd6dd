"""A session's way back: find the run's newest checkpoint, put it into the loop's state, say so in one line, and
refuse what would silently go wrong. The one line for every resume (where, from which checkpoint, on how many
ranks and what that changed: the global batch against the one the checkpoint recorded), the warning when the
global batch (so the steps per epoch) changed, the note on a finished run run again, the refusal to save over a run's
checkpoints that the session did not load, and `fresh=True`'s setting aside. No torch at import.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping, MutableMapping

from mgpu.errors import MgpuError
from mgpu.record.ledger import Ledger
from mgpu.record.rundir import RunDir

__all__ = ["Resumption", "batch_size_of", "finished_note", "resume_line", "samples_per_epoch_of", "schedule_warning",
           "set_aside", "unloaded_checkpoint"]

log = logging.getLogger("mgpu.train")
UNSEEN = object()
"""`Resumption.found` before anyone looked."""


def batch_size_of(state: Mapping[str, Any]) -> int | None:
    """The per-rank batch size of the state's `session.loader` (None: no such loader)."""
    for value in state.values():
        size = getattr(getattr(value, "plan", None), "batch_size", None)
        if isinstance(size, int):
            return size
    return None


def samples_per_epoch_of(state: Mapping[str, Any]) -> int | None:
    """Global samples an epoch of the state's `session.loader` trains on (None: no such loader)."""
    for value in state.values():
        samples = getattr(value, "samples_per_epoch", None) if hasattr(value, "plan") else None
        if isinstance(samples, int):
            return samples
    return None


def resume_line(step: int, where: Mapping[str, int], checkpoint: Path, world: int, saved_world: int | None,
                batch_size: int | None, global_batch: int | None = None, saved_global: int | None = None) -> str:
    """`resumed at step 120 (epoch 1, sample 384) from <checkpoint> on 2 ranks (saved on 4: the global batch is
    now 128 samples, was 256)`. `batch_size`: samples per rank per optimizer step (None: unknown); with
    `global_batch` (data.global_batch_size, kept on every world size) samples per rank per micro-step, and the
    line says how the accumulation changed. `saved_global`: the saved run's global batch, as its checkpoint
    recorded it (None: an older checkpoint, which did not)."""
    at = f"resumed at step {step}"
    if "epoch" in where:
        at += f" (epoch {where['epoch']}, sample {where.get('position', 0)})"
    line = f"{at} from {checkpoint} on {world} rank{'s' if world != 1 else ''}"
    now = global_batch or (batch_size * world if batch_size else None)
    moved = saved_world is not None and saved_world != world
    if not moved and (saved_global is None or now is None or saved_global == now):
        return line
    said = [f"saved on {saved_world}"] if moved else []
    if batch_size and global_batch and saved_global in (None, global_batch):
        accum = global_batch // (batch_size * world)
        text = (f"the global batch stays {global_batch} samples (data.global_batch_size), accumulated over "
                f"{accum} micro-step{'s' if accum != 1 else ''} per step")
        said.append(text + (f", was {global_batch // (batch_size * saved_world)}" if moved and saved_world else ""))
    elif now is not None and saved_global == now:
        said.append(f"the global batch stays {now} samples")
    elif now is not None:
        said.append(f"the global batch is now {now} samples" + (f", was {saved_global}" if saved_global else ""))
    return f"{line} ({': '.join(said)})" if said else line


def schedule_warning(now: int | None, was: int | None, samples_per_epoch: int | None) -> str | None:
    """The warning when a resume changed the global batch (`now`, `was`: samples per optimizer step), and the
    steps per epoch with it: a schedule sized from `len(loader)` would change mid-run; how to keep the run's.
    None when it did not change (or is unknown)."""
    if now is None or was is None or now == was:
        return None
    epoch = ""
    if samples_per_epoch:
        steps_now, steps_was = -(-samples_per_epoch // now), -(-samples_per_epoch // was)
        epoch = f"; an epoch is {steps_now} steps now, was {steps_was}"
    return (f"the global batch changed on resume: {now} samples per step, was {was}{epoch}, so a schedule sized "
            f"from the steps per epoch (len(loader)) changes mid-run. To keep the run's: the trainer: "
            f"data.global_batch_size={was}; a loop of one's own: keep {was} samples per step (per-rank batch x "
            f"accumulation x ranks; load(state, global_batch={was})) and size its schedule from "
            f"loader.steps_per_epoch({was}) (loader.samples_per_epoch / that global batch), not len(loader)")


def finished_note(meta: Mapping[str, Any], step: int, run: Path) -> str | None:
    """A note when the checkpoint (its `meta.json`) is a finished run's final one (None otherwise)."""
    if meta.get("extra", {}).get("reason") != "final":
        return None
    return (f"run {run} had finished at step {step} (its final checkpoint): it goes on only where the loop has "
            f"more to do (more epochs or steps); to train it anew, load(state, fresh=True) or another run directory")


def unloaded_checkpoint(step: int | None, run: Path) -> None:
    """MgpuError when the run has a checkpoint (`step`: its newest) and this session saves without loading it."""
    if step is None:
        return
    raise MgpuError(f"run {run} has a checkpoint (step {step}) that this session did not load: call "
                    f"session.load(state) before training to resume it, or session.load(state, fresh=True) to "
                    f"start the run over (its checkpoints are set aside), or use another run directory")


def set_aside(checkpoints: Path) -> Path | None:
    """Move a run's checkpoints out of the way of a fresh start (kept, renamed); the new name, or None."""
    if not checkpoints.exists() or not any(checkpoints.iterdir()):
        return None
    target = checkpoints.with_name(f"{checkpoints.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    checkpoints.rename(target)
    return target


class Resumption:
    """One rank's resume: what it found (`found`, looked up once), where it resumed (`step`, `path`, `at`)."""

    def __init__(self, run: RunDir, rank: int, world_size: int, seed: int, ledger: Ledger,
                 checkpointer: Callable[[], Any]) -> None:
        self.run, self.rank, self.world_size, self.seed, self.ledger = run, rank, world_size, seed, ledger
        self.checkpointer = checkpointer
        self.found: Any = UNSEEN
        self.step = 0
        self.path: Path | None = None
        self.skipped: list[tuple[str, str]] = []
        self.at: dict[str, int] = {}
        """The epoch and position in the data it resumes at, when the state says (a Progress, a loader)."""
        self.global_batch: int | None = None
        """Samples per optimizer step over all ranks (from `load()`'s batch sizes), recorded with every save."""

    @property
    def looked(self) -> bool:
        return self.found is not UNSEEN

    def latest(self, rejected: tuple[tuple[Path, str], ...] = ()) -> Any:
        """*Collective.* The newest valid checkpoint (a LoadedCheckpoint), or None; found once. A sharded one's
        shard files are checked as `restore` reads them (mgpu.state.sharded.verify: read once); `rejected`: those
        found damaged there, looked past."""
        if self.found is UNSEEN or rejected:
            checkpointer = self.checkpointer()
            sharded = getattr(checkpointer, "defers_shards", False)
            self.found = checkpointer.find_latest(**({"defer_shards": True, "rejected": rejected} if sharded else {}))
        return self.found

    def restore(self, state: MutableMapping[str, Any], missing_ok: set[str], batch_size: int | None,
                global_batch: int | None = None) -> Any:
        """Put the found checkpoint into `state` (mgpu.state.train_state.restore_state) and say where it resumes."""
        from mgpu.state.train_state import restore_state

        batch_size = batch_size or batch_size_of(state)
        self.global_batch = global_batch or (batch_size * self.world_size if batch_size else None)
        loaded = self.latest()
        if loaded is None:
            return None
        # models and optimizers through DCP, resharded (mgpu.state.sharded.checkpointer)
        if loaded.meta.get("kind") == "sharded":
            from mgpu.state.sharded.format import DamagedCheckpoint, restore_sharded

            while True:
                try:
                    restore_sharded(loaded, state, self.rank, self.seed, missing_ok)
                    break
                except DamagedCheckpoint as damaged:  # every rank alike: the previous checkpoint, loaded anew
                    if self.rank == 0:
                        log.warning("skipping checkpoint %s: %s", damaged.path, damaged.reason)
                    loaded = self.latest(rejected=(*loaded.skipped, (damaged.path, damaged.reason)))
                    if loaded is None:
                        raise
        else:
            restore_state(loaded.state, state, self.rank, self.seed, missing_ok)
        self.step, self.path = loaded.step, loaded.path
        self.skipped = [(str(bad), reason) for bad, reason in loaded.skipped]
        self.at = next(({"epoch": value.epoch, "position": value.position} for value in state.values()
                        if isinstance(getattr(value, "epoch", None), int)
                        and isinstance(getattr(value, "position", None), int)), {})
        if self.rank == 0:
            saved_global = loaded.meta.get("extra", {}).get("global_batch")
            saved_global = saved_global if isinstance(saved_global, int) else None
            log.info("%s", resume_line(loaded.step, self.at, loaded.path, self.world_size,
                                       loaded.state.get("world_size"), batch_size, global_batch, saved_global))
            if (warning := schedule_warning(self.global_batch, saved_global, samples_per_epoch_of(state))):
                log.warning("%s", warning)
            if (note := finished_note(loaded.meta, loaded.step, self.run.path)) is not None:
                log.warning("%s", note)
        return loaded

    def save_meta(self, meta: Mapping[str, Any] | None) -> dict[str, Any]:
        """A save's metadata: `meta`, with the run's global batch (what a later resume compares its own with)."""
        recorded = {"global_batch": self.global_batch} if self.global_batch else {}
        return {**recorded, **(meta or {})}

    def record(self) -> None:
        """The ledger's `resumed` event (after `started`): from which checkpoint, at which step, epoch and sample;
        nothing for a new run."""
        if self.path is not None:
            self.ledger.write("resumed", step=self.step, **self.at, **{"from": str(self.path)}, skipped=self.skipped)

    def start_over(self) -> None:
        """*Collective.* `load(fresh=True)`: rank 0 sets the run's checkpoints aside, every rank waits for it."""
        from mgpu.parallel.distributed import broadcast_object

        moved = set_aside(self.run.checkpoints) if self.rank == 0 else None
        broadcast_object(None)
        self.found = None
        if moved is not None:
            log.warning("starting run %s over: its checkpoints are kept in %s", self.run.path, moved)
            self.ledger.write("fresh_start", set_aside=str(moved))

    def refuse_unloaded(self) -> None:
        """*Collective.* A first save without a look at the run's checkpoints: MgpuError on every rank where it
        would replace them."""
        from mgpu.parallel.distributed import broadcast_object

        steps = self.checkpointer().store.list_steps() if self.rank == 0 else None
        newest = broadcast_object(steps[-1] if steps else None)
        self.found = None
        unloaded_checkpoint(newest, self.run.path)
