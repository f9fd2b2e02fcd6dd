"""What a checkpoint holds, and putting it back: everything a resumed run needs to be bit-identical.

model, optimizer, LR scheduler, grad scaler, progress (step, epoch, position inside the epoch in
global samples, early-stopping state), the RNG states of every rank, the world size, the resolved
config and the code version.
"""

from __future__ import annotations

import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from mgpu.rng import capture_rng_state, derived_seed, restore_rng_state, seed_everything

__all__ = ["Progress", "code_version", "gather_state", "restore_state"]

FORMAT = 1


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    position: int = 0
    """Global samples of `epoch` already consumed (across all ranks)."""
    samples_seen: int = 0
    best_metric: float | None = None
    evals_without_improvement: int = 0
    eval_pending: bool = False
    """A stop came in the middle of this step's evaluation: the resumed run evaluates first."""


def code_version(root: Path | None = None) -> str | None:
    """The git commit of the code (with `+dirty` for uncommitted changes), or None outside a checkout."""
    root = root or Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "")


def _all_rank_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG state (a collective); a list of one in a world of one."""
    mine = capture_rng_state()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def gather_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
                 progress: Progress, config: dict[str, Any], version: str | None) -> dict[str, Any] | None:
    """The checkpoint's content on rank 0 (None elsewhere). A collective: every rank must call it."""
    rng = _all_rank_rng_states()
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)  # the shards meet on rank 0
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return {
        "format": FORMAT,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "progress": asdict(progress),
        "rng": rng,
        "world_size": len(rng),
        "config": config,
        "code_version": version,
    }


def restore_state(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                  scaler: Any, rank: int, seed: int) -> Progress:
    """Load a checkpoint into the live objects. A rank the saved run did not have gets a fresh seed."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    if rank < len(state["rng"]):
        restore_rng_state(state["rng"][rank])
    else:
        # World grew: no saved stream for this rank; derive one that no other rank or run uses.
        step = state["progress"]["step"]
        seed_everything(derived_seed(seed + rank + 100_003 * (step + 1), 0 <= rank < 100_003, "grew", seed, rank, step))
    return Progress(**state["progress"])
