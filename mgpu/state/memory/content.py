"""What a snapshot in memory holds for one rank and how it is put back (mgpu.state.memory.snapshots coordinates them):
`rank_state`, what a checkpoint at that step would hold for this rank, taken with no collective (under DDP the whole
replicated state with this rank's RNG and loader position; under FSDP2 this rank's shard, each DTensor as its local
tensor), its step beside it (`STEP`: a commit record's step is checked against it), and `put_back`, checking the
content first (a dict, of that step) and then restoring it into the loop's objects (a DTensor's local tensor copied
back in place into a module, rebuilt like its parameter for an optimizer). Also what a snapshot's identity holds of
the state and the config (`structure_digest`, `config_digest`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, is_dataclass
from typing import Any, Mapping, MutableMapping

__all__ = ["LOCAL", "STEP", "check_content", "config_digest", "estimated_bytes", "put_back", "rank_state",
           "structure_digest", "unsupported"]

STEP = "snapshot_step"
"""The step a snapshot was taken at, in its content (its commit record says it too; both must agree)."""


def config_digest(config: Any) -> str:
    """A digest of the config's keys a resume may not change (a dataclass or a mapping; the keys of
    mgpu.config.schema.SAFE_TO_CHANGE left out: the durable resume accepts a change of `optim.lr`, `train.epochs`,
    `data.num_workers`, ..., so a snapshot does too): a snapshot taken under another is stale."""
    from mgpu.config.loading import flatten_config
    from mgpu.config.resume_compat import is_safe_to_change

    plain = asdict(config) if is_dataclass(config) and not isinstance(config, type) else dict(config)
    kept = {key: value for key, value in flatten_config(plain).items() if not is_safe_to_change(key)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _shape(tensor: Any) -> list[int] | str:
    try:
        return list(tensor.shape)
    except (AttributeError, RuntimeError, ValueError):  # a lazy module's parameter before its first forward
        return type(tensor).__name__


def structure_digest(objects: Mapping[str, Any]) -> str:
    """A digest of the state's shape: each module's tensors (name, shape, dtype) and each optimizer's class and the
    shapes of its parameter groups' parameters (not their settings: a resume may change the learning rate). A
    snapshot of another model or optimizer is then stale, not loaded into this one."""
    import torch

    from mgpu.state.train_state import unwrapped

    parts: list[Any] = []
    for name in sorted(objects):
        value = unwrapped(objects[name])
        if isinstance(value, torch.nn.Module):
            parts.append([name, "module", [[key, _shape(item), str(item.dtype)] for key, item
                                           in value.state_dict().items() if hasattr(item, "dtype")]])
        elif isinstance(value, torch.optim.Optimizer):
            parts.append([name, type(value).__name__, [[_shape(p) for p in group["params"]]
                                                       for group in value.param_groups]])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


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


def unsupported(objects: Mapping[str, Any]) -> str | None:
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


def estimated_bytes(state: Any) -> int:
    """A snapshot's size before its first write: its tensors' bytes and a margin for the file's own structure
    (torch.save's zip records, the pickled structure); every later one is counted from the file written."""
    return _tensor_bytes(state) + (64 << 10)


def check_content(state: Any, step: int) -> None:
    """ValueError where a snapshot's loaded content is not a snapshot of `step` (its commit record's)."""
    if not isinstance(state, dict) or type(state.get(STEP)) is not int or state[STEP] != step:
        found = state.get(STEP) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"its content is not a snapshot of step {step} (it says {found!r})")


def put_back(state: Any, step: int, objects: MutableMapping[str, Any], rank: int, seed: int,
             missing_ok: frozenset[str] | set[str] = frozenset()) -> None:
    """Restore a snapshot's content `state` of `step` into `objects` (mgpu.state.train_state.restore_state; the
    sharded objects' local tensors in place). Raises where the content is not a snapshot of that step, or does not
    fit the objects (another model's state)."""
    from mgpu.state.train_state import restore_state, unwrapped

    check_content(state, step)
    sharded = [name for name in objects if name in state and _has_local(state[name])]
    for name in sharded:
        _restore_shards(state[name], unwrapped(objects[name]), name)
    rest = {name: value for name, value in objects.items() if name not in sharded}
    restore_state(state, rest, rank, seed, missing_ok)
    objects.update(rest)  # the plain values restore_state replaced
