"""What a resume says, and what it refuses: the one line for every resume (where, from which checkpoint, on
how many ranks and what that changed), the note on a finished run run again, and the refusal to save over a
run's checkpoints that the session did not load. Pure text and file checks; no torch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping

from mgpu.errors import MgpuError

__all__ = ["batch_size_of", "finished_note", "resume_line", "set_aside", "unloaded_checkpoint"]


def batch_size_of(state: Mapping[str, Any]) -> int | None:
    """The per-rank batch size of the state's `session.loader` (None: no such loader)."""
    for value in state.values():
        plan = getattr(value, "plan", None)
        if isinstance(getattr(plan, "batch_size", None), int):
            return int(plan.batch_size)
    return None


def resume_line(step: int, where: Mapping[str, int], checkpoint: Path, world: int, saved_world: int | None,
                batch_size: int | None) -> str:
    """`resumed at step 120 (epoch 1, sample 384) from <checkpoint> on 2 ranks (saved on 4: the global batch is
    now 128 samples, was 256)`. `batch_size`: samples per rank per optimizer step (None: unknown)."""
    at = f"resumed at step {step}"
    if "epoch" in where:
        at += f" (epoch {where['epoch']}, sample {where.get('position', 0)})"
    line = f"{at} from {checkpoint} on {world} rank{'s' if world != 1 else ''}"
    if saved_world is not None and saved_world != world:
        line += f" (saved on {saved_world}"
        if batch_size:
            line += (f": the global batch is now {batch_size * world} samples, was {batch_size * saved_world}; "
                     f"to keep it, scale the per-rank batch or the accumulation by {saved_world}/{world}")
        line += ")"
    return line


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
