"""What a checkpoint holds, and putting it back: everything a resumed run needs to be bit-identical.

The objects a loop names (the trainer's: model, optimizer, LR scheduler, grad scaler, progress (step,
epoch, position inside the epoch in global samples, early-stopping state) and the resolved config),
plus what every checkpoint holds: the RNG states of every rank, the world size and the code version.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Mapping

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from mgpu.rng import capture_rng_state, derived_seed, restore_rng_state, seed_everything

__all__ = ["RESERVED", "Progress", "code_version", "gather_state", "restore_state"]

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
    best_metrics: dict[str, float] = field(default_factory=dict)
    """Every metric of the best evaluation so far (by eval.metric), at `best_step`."""
    best_step: int | None = None


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


RESERVED = ("format", "rng", "world_size", "code_version", "ddp")  # ddp: the session's (mgpu.ddp.bucket_layout)
"""Keys the session adds to every checkpoint; a state of yours cannot use them."""


def _is_zero(value: Any) -> bool:
    """Whether `value` is a ZeroRedundancyOptimizer. Without importing torch.distributed.optim (FSDP, DTensor and
    sympy: about a second of every start): an instance exists only once something imported its module."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    zero = getattr(module, "ZeroRedundancyOptimizer", None)
    return zero is not None and isinstance(value, zero)


def _unwrapped(value: Any) -> Any:
    """The module inside DDP: its state loads into a plain module too (another world size, inference)."""
    return value.module if isinstance(value, DistributedDataParallel) else value


def gather_state(objects: Mapping[str, Any], version: str | None) -> dict[str, Any] | None:
    """The checkpoint's content on rank 0 (None elsewhere). A collective: every rank must call it.

    `objects`: name -> anything with `state_dict()` (modules, optimizers, schedulers, scalers, loaders;
    DDP is saved as its module), a dataclass (saved as a dict), or a plain value. Every rank's RNG
    state is added, so a resumed rank draws what the saved one would have drawn next."""
    rng = _all_rank_rng_states()
    for value in objects.values():
        if _is_zero(value):
            value.consolidate_state_dict(to=0)  # the shards meet on rank 0
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    state: dict[str, Any] = {"format": FORMAT, "rng": rng, "world_size": len(rng), "code_version": version}
    for name, value in objects.items():
        value = _unwrapped(value)
        if hasattr(value, "state_dict"):
            state[name] = value.state_dict()
            if _is_zero(value):
                # ZeRO keeps every rank's consolidated shard until the next consolidation: a second full
                # optimizer state on rank 0 for the rest of the run. The checkpoint holds what it needs.
                value._all_state_dicts = []
        elif is_dataclass(value) and not isinstance(value, type):
            state[name] = asdict(value)
        else:
            state[name] = value
    return state


def restore_state(state: Mapping[str, Any], objects: dict[str, Any], rank: int, seed: int) -> None:
    """Load a checkpoint into the live objects of `objects` (a dataclass's fields are set in place), and
    replace its plain values with the saved ones in the dict. Then this rank's RNG state; a rank the saved run did not have gets a
    fresh seed. A name the checkpoint does not hold is left as it is."""
    for name, value in objects.items():
        if name not in state:
            continue
        target = _unwrapped(value)
        if hasattr(target, "load_state_dict"):
            target.load_state_dict(state[name])
        elif is_dataclass(target) and not isinstance(target, type):
            for key, value in state[name].items():  # in place: the loop's own references see it
                setattr(target, key, value)
        else:
            objects[name] = state[name]
    if rank < len(state["rng"]):
        restore_rng_state(state["rng"][rank])
    else:
        # World grew: no saved stream for this rank; derive one that no other rank or run uses.
        step = int(state.get("progress", {}).get("step", 0))
        seed_everything(derived_seed(seed + rank + 100_003 * (step + 1), 0 <= rank < 100_003, "grew", seed, rank, step))
