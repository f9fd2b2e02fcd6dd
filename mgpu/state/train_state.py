"""What a checkpoint holds, and putting it back: everything a resumed run needs to be bit-identical.

The objects a loop names (the trainer's: model, optimizer, LR scheduler, grad scaler, progress (step,
epoch, position inside the epoch in global samples, early-stopping state) and the resolved config),
plus what every checkpoint holds: the RNG states of every rank, the world size and the code version.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, MutableMapping
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mgpu.state.rng import capture_rng_state, derived_seed, restore_rng_state, seed_everything

from mgpu.errors import MgpuError

__all__ = ["RESERVED", "Progress", "State", "check_checkpointable", "code_version", "gather_rank_states", "gather_state",
           "is_zero_optimizer", "restore_state", "unwrapped"]

FORMAT = 1


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    position: int = 0
    """Global samples of `epoch` already consumed (across all ranks); a Stateful stream's: this rank's batches."""
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
    root = root or Path(__file__).resolve().parents[2]  # the checkout: mgpu/state/ is two folders down
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "")


def _gathered(mine: Any) -> list[Any]:
    """Every rank's `mine` (a collective); a list of one in a world of one."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def _all_rank_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG state (a collective); a list of one in a world of one."""
    return _gathered(capture_rng_state())


# ddp: the session's (mgpu.parallel.ddp.bucket_layout); snapshot_step: a snapshot in memory's
# (mgpu.state.memory.content.STEP)
RESERVED = ("format", "rng", "world_size", "code_version", "ddp", "snapshot_step")
"""Keys the session adds to every checkpoint; a state of yours cannot use them."""


def is_zero_optimizer(value: Any) -> bool:
    """Whether `value` is a ZeroRedundancyOptimizer. Without importing torch.distributed.optim (FSDP, DTensor and
    sympy: about a second of every start): an instance exists only once something imported its module."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    zero = getattr(module, "ZeroRedundancyOptimizer", None)
    return zero is not None and isinstance(value, zero)


def unwrapped(value: Any) -> Any:
    """The module inside DDP: its state loads into a plain module too (another world size, inference)."""
    return value.module if isinstance(value, DistributedDataParallel) else value


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype, torch.device, torch.Size)


def _is_dataclass_object(value: Any) -> bool:
    return is_dataclass(value) and not isinstance(value, type)


def _unstorable(value: Any, where: str) -> tuple[str, Any] | None:
    """(where, the value) of the first part of `value` a checkpoint cannot hold and give back; None: all can."""
    value = unwrapped(value)
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return None
    if isinstance(value, _PLAIN):
        return None
    if _is_dataclass_object(value):
        parts: Any = ((f"{where}.{f.name}", getattr(value, f.name)) for f in fields(value))
    elif isinstance(value, Mapping):
        parts = ((f"{where}[{key!r}]", item) for key, item in value.items())
    elif isinstance(value, (list, tuple, set, frozenset)):
        parts = ((f"{where}[{i}]", item) for i, item in enumerate(value))
    else:
        return where, value
    return next((bad for part, item in parts if (bad := _unstorable(item, part)) is not None), None)


def check_checkpointable(objects: Mapping[str, Any]) -> None:
    """MgpuError naming the first value of `objects` that a checkpoint cannot save and give back (an object of
    a class of the loop's own without `state_dict`/`load_state_dict`), and the fix. Before any training."""
    for name in objects:
        if name in RESERVED:
            raise MgpuError(f"state[{name!r}]: {name!r} is a name every checkpoint uses ({', '.join(RESERVED)}): "
                            f"rename it")
    for name, value in objects.items():
        bad = _unstorable(value, f"state[{name!r}]")
        if bad is None:
            continue
        where, what = bad
        kind = type(what).__name__
        raise MgpuError(f"{where} is a {kind}, which a checkpoint cannot save and restore: give {kind} "
                        f"state_dict() and load_state_dict(state) methods, or make it a @dataclass (its fields "
                        f"are saved and set back in place)")


class State(MutableMapping[str, Any]):
    """What `Session.load()` returns: the state mapping given to it, with its values also readable and
    settable as attributes (`state.best`). A plain value restored from a checkpoint lives here, not in a
    variable of the loop's: read it back from here, and keep it here when it changes (that is what is
    saved)."""

    def __init__(self, values: MutableMapping[str, Any]) -> None:
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"the state has no {name!r} (it has {', '.join(map(repr, self._values))})") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self._values[name] = value

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._values[key] = value

    def __delitem__(self, key: str) -> None:
        del self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"State({self._values!r})"


def gather_rank_states(objects: Mapping[str, Any]) -> dict[str, list[Any]]:
    """*Collective.* name -> every rank's `rank_state_dict()`, for the values that have one: a value whose state
    differs per rank (a stateful stream's loader) says so that way; every rank's goes into the checkpoint (as
    `{"per_rank": [...]}`), and its `load_state_dict` takes them all and picks its own."""
    return {name: _gathered(value.rank_state_dict()) for name, value in objects.items()
            if callable(getattr(value, "rank_state_dict", None))}


def gather_state(objects: Mapping[str, Any], version: str | None) -> dict[str, Any] | None:
    """The checkpoint's content on rank 0 (None elsewhere). A collective: every rank must call it.

    `objects`: name -> anything with `state_dict()` (modules, optimizers, schedulers, scalers, loaders;
    DDP is saved as its module), a dataclass (saved as a dict), or a plain value. Every rank's RNG
    state is added, so a resumed rank draws what the saved one would have drawn next."""
    rng = _all_rank_rng_states()
    per_rank = gather_rank_states(objects)
    for value in objects.values():
        if is_zero_optimizer(value):
            value.consolidate_state_dict(to=0)  # the shards meet on rank 0
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    state: dict[str, Any] = {"format": FORMAT, "rng": rng, "world_size": len(rng), "code_version": version}
    for name, value in objects.items():
        value = unwrapped(value)
        if name in per_rank:
            state[name] = {"per_rank": per_rank[name]}
        elif hasattr(value, "state_dict"):
            state[name] = value.state_dict()
            if is_zero_optimizer(value):
                # ZeRO keeps every rank's consolidated shard until the next consolidation: a second full
                # optimizer state on rank 0 for the rest of the run. The checkpoint holds what it needs.
                value._all_state_dicts = []
        elif is_dataclass(value) and not isinstance(value, type):
            state[name] = asdict(value)
        else:
            state[name] = value
    return state


def _set_fields(target: Any, saved: Mapping[str, Any]) -> None:
    """A dataclass's fields set back in place (frozen ones too), nested dataclasses field by field."""
    for key, value in saved.items():
        current = getattr(target, key, None)
        if _is_dataclass_object(current) and isinstance(value, Mapping):
            _set_fields(current, value)
        else:
            object.__setattr__(target, key, value)


def in_memory(value: Any) -> Any:
    """`value` with every tensor copied into memory of its own. A checkpoint is loaded memory-mapped; an
    optimizer keeps the moment tensors it is given (same device, same dtype: no copy), so without this the
    run would keep the checkpoint file mapped for its life, and a pruned checkpoint's blocks stay allocated."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: in_memory(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(in_memory(item) for item in value)
    return value


def restore_state(state: Mapping[str, Any], objects: MutableMapping[str, Any], rank: int, seed: int,
                  missing_ok: frozenset[str] | set[str] = frozenset()) -> None:
    """Load a checkpoint into the live objects of `objects` (a dataclass's fields are set in place), and
    replace its plain values with the saved ones in the mapping. Then this rank's RNG state; a rank the saved
    run did not have gets a fresh seed. A name the checkpoint does not hold is an MgpuError naming it, unless
    it is in `missing_ok` (left as it is: a deliberate change of what the loop keeps)."""
    missing = [name for name in objects if name not in state and name not in missing_ok]
    if missing:
        raise MgpuError(f"the checkpoint holds no {', '.join(map(repr, missing))} (it has "
                        f"{', '.join(repr(k) for k in state if k not in RESERVED)}): a state key added since it was "
                        f"saved starts fresh only when you say so: load(state, missing_ok={set(missing)!r})")
    for name, value in objects.items():
        if name not in state:
            continue
        target = unwrapped(value)
        if isinstance(target, nn.Module):
            target.load_state_dict(state[name])  # copied into its own parameters and buffers
        elif hasattr(target, "load_state_dict"):
            target.load_state_dict(in_memory(state[name]))
        elif _is_dataclass_object(target):
            _set_fields(target, in_memory(state[name]))  # in place: the loop's own references see it
        else:
            objects[name] = in_memory(state[name])
    if rank < len(state["rng"]):
        restore_rng_state(state["rng"][rank])
    else:
        # World grew: no saved stream for this rank; derive one that no other rank or run uses.
        step = int(state.get("progress", {}).get("step", 0))
        seed_everything(derived_seed(seed + rank + 100_003 * (step + 1), 0 <= rank < 100_003, "grew", seed, rank, step))
