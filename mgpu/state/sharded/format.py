"""The layout of a sharded checkpoint's directory: which of a run's objects go through DCP and which into
common.pt, each file's name, the manifests' lines and their verification, and the restore (the files are
described in mgpu.state.sharded.checkpointer, whose ShardedCheckpointer writes them; mgpu.state.sharded.export reads
them in one process)."""

from __future__ import annotations

import io
import json
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Mapping, MutableMapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from mgpu.errors import MgpuError
from mgpu.state.single import store as checkpoint_settings
from mgpu.state.checkpoint_format import META_FILE, CheckpointError, LoadedCheckpoint, newer_format, one_line, sha256_file
from mgpu.state.sharded.dcp_safe import SafeLoadPlanner, SafeReader
from mgpu.state.sharded.verify import ChunkChecks, VerifyingReader, deferrable
from mgpu.state.files.digest import digest_bytes, digest_file, mismatch
from mgpu.state.rng import derived_seed, restore_rng_state, seed_everything
from mgpu.state.train_state import unwrapped

__all__ = ["COMMON", "FORMAT", "KIND", "DamagedCheckpoint", "common_state", "dcp_container", "dcp_state", "entry_problem", "file_entry",
           "manifest_name", "rank_file", "read_meta", "restore_sharded", "shard_entries", "split_objects", "sync_buffers", "to_bytes",
           "verify_rank"]

KIND = "sharded"
FORMAT = 1
COMMON = "common.pt"


def rank_file(rank: int) -> str:
    """The file of a rank's own entries (its RNG, its sampler's position) in a sharded checkpoint's directory."""
    return f"rank_{rank}.pt"


def manifest_name(rank: int) -> str:
    """The file in which rank `rank` lists its files with their size and checksum."""
    return f"manifest_{rank}.json"


# ---------------------------------------------------------------------------------------------- state layout
def split_objects(objects: Mapping[str, Any]) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer],
                                                        dict[str, Any]]:
    """(modules, optimizers, the rest): the first two go through DCP (sharded), the rest into common.pt."""
    modules, optimizers, rest = {}, {}, {}
    for name, value in objects.items():
        value = unwrapped(value)
        if isinstance(value, nn.Module):
            modules[name] = value
        elif isinstance(value, torch.optim.Optimizer):
            optimizers[name] = value
        else:
            rest[name] = value
    return modules, optimizers, rest


def dcp_container(modules: dict[str, nn.Module]) -> nn.ModuleDict:
    # A view of the modules under their state names (no copy): DCP's keys are then "<name>.<parameter>".
    return nn.ModuleDict(modules)


def dcp_state(modules: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(dcp_container(modules), list(optimizers.values()))
    return {"model": model_sd, "optim": optim_sd} if optimizers else {"model": model_sd}


def common_state(rest: Mapping[str, Any], world: int, version: str | None) -> dict[str, Any]:
    state: dict[str, Any] = {"format": FORMAT, "world_size": world, "code_version": version}
    for name, value in rest.items():
        if hasattr(value, "state_dict"):
            state[name] = value.state_dict()
        elif is_dataclass(value) and not isinstance(value, type):
            state[name] = asdict(value)
        else:
            state[name] = value
    return state


def to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def sync_buffers(modules: Mapping[str, nn.Module]) -> None:
    """Rank 0's buffers everywhere (BatchNorm statistics): DCP keeps one copy of a replicated tensor, from any
    rank; the next forward (DDP's, or mgpu.parallel.fsdp's pre-hook) makes them rank 0's anyway."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for module in modules.values():
            for buffer in module.buffers():
                dist.broadcast(buffer, src=0)


# ---------------------------------------------------------------------------------------------- verification
def file_entry(path: Path, recorded: Mapping[str, dict[str, Any]], data: bytes | None = None) -> dict[str, Any]:
    """A manifest's line for `path`: its size and checksum, as computed while writing (`recorded` by name, or
    from its bytes `data`); read back only for a file neither covers (DCP's small `.metadata`)."""
    if data is not None:
        checksum = digest_bytes(data, checkpoint_settings.DIGEST)
    else:
        checksum = recorded.get(path.name) or digest_file(path, checkpoint_settings.DIGEST)
    return {"bytes": path.stat().st_size, "checksum": checksum}


def entry_problem(file: Path, entry: Mapping[str, Any]) -> str | None:
    """Why `file` does not match its manifest line (a checksum, or the sha256 of a checkpoint saved before)."""
    if "checksum" in entry:
        return mismatch(file, entry["checksum"])
    if sha256_file(file) != entry["sha256"]:
        return f"{file} does not match the sha256 in its manifest (corrupted)"
    return None


def verify_rank(path: Path, saved_rank: int, meta: Mapping[str, Any],
                deferred: dict[str, Any] | None = None) -> str | None:
    """Why saved rank `saved_rank`'s files in `path` are damaged (None: intact). `deferred`: its shard files'
    checksums are left to the load, which checks them as it reads them (mgpu.state.sharded.verify): their manifest
    lines go into `deferred` by name, their sizes are checked here, every other file is verified whole."""
    manifest_path = path / manifest_name(saved_rank)
    try:
        sha = sha256_file(manifest_path)
        if sha != meta["manifests"][str(saved_rank)]:
            return f"{manifest_path} has sha256 {sha[:16]}..., {META_FILE} says another (corrupted)"
        manifest = json.loads(manifest_path.read_text())
        for name, entry in manifest["files"].items():
            file = path / name
            size = file.stat().st_size
            if size != entry["bytes"]:
                return f"{file} is {size} bytes, {manifest_path.name} says {entry['bytes']} (truncated?)"
            if deferred is not None and name.endswith(".distcp") and deferrable(entry):
                deferred[name] = entry
                continue
            problem = entry_problem(file, entry)
            if problem is not None:
                return f"{problem} ({manifest_path.name})"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{path}: rank {saved_rank}'s files unreadable: {one_line(error, 200)}"
    return None


def shard_entries(path: Path, meta: Mapping[str, Any], ranks: Any) -> dict[str, Any]:
    """The deferrable shard files' manifest lines of saved ranks `ranks` (the manifests verified by whoever answers
    for them: a line that is wrong here fails the load's checks, and is named there)."""
    found: dict[str, Any] = {}
    for saved in ranks:
        try:
            manifest = json.loads((path / manifest_name(saved)).read_text())
            found.update({name: entry for name, entry in manifest["files"].items()
                          if name.endswith(".distcp") and deferrable(entry)})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # the rank answering for it names the damage
    return found


def read_meta(path: Path, step: int) -> dict[str, Any]:
    """The meta.json of the sharded checkpoint of `step` in `path`; ValueError where it is not one, NewerFormat
    (mgpu.state.checkpoint_format) where a newer mgpu wrote it."""
    meta = json.loads((path / META_FILE).read_text())
    if (newer := newer_format(path, meta, FORMAT)) is not None:
        raise newer
    if not (isinstance(meta, dict) and meta.get("kind") == KIND and meta.get("step") == step
            and isinstance(meta.get("world_size"), int) and isinstance(meta.get("manifests"), dict)
            and len(meta["manifests"]) == meta["world_size"]):
        raise ValueError(f"{path / META_FILE} is not the metadata of a sharded checkpoint of step {step}")
    return meta


# ---------------------------------------------------------------------------------------------- restore
def restore_sharded(loaded: LoadedCheckpoint, objects: MutableMapping[str, Any], rank: int, seed: int,
                    missing_ok: frozenset[str] | set[str] = frozenset()) -> None:
    """*Collective.* Put a sharded checkpoint back: models and optimizers through DCP (resharded onto this world
    size), the rest from its common state, this rank's RNG from its own file; a rank the saved run did not
    have gets a derived stream no other rank or run uses. A name the checkpoint does not hold is an MgpuError
    naming it, unless it is in `missing_ok` (as mgpu.state.train_state.restore_state)."""
    modules, optimizers, rest = split_objects(objects)
    missing = [name for name in rest if name not in loaded.state and name not in missing_ok]
    if missing:
        raise MgpuError(f"the checkpoint holds no {', '.join(map(repr, missing))}: a state key added since it was "
                        f"saved starts fresh only when you say so: load(state, missing_ok={set(missing)!r})")
    if modules:
        state = dcp_state(modules, optimizers)
        _load_verified(loaded, state)
        set_state_dict(dcp_container(modules), list(optimizers.values()), model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}))
    elif loaded.unverified:
        _agree_intact(loaded, ChunkChecks(loaded.path, loaded.unverified["files"]), None)
    common = loaded.state
    for name, value in rest.items():
        if name not in common:
            continue
        if hasattr(value, "load_state_dict"):
            value.load_state_dict(common[name])
        elif is_dataclass(value) and not isinstance(value, type):
            for key, item in common[name].items():
                setattr(value, key, item)
        else:
            objects[name] = common[name]
    pieces = common.get("rank_pieces")
    if pieces is not None:
        restore_rng_state(pieces["rng"])
    else:  # the world grew: as mgpu.state.train_state does for a single-file checkpoint
        step = int(common.get("progress", {}).get("step", loaded.step))
        seed_everything(derived_seed(seed + rank + 100_003 * (step + 1), 0 <= rank < 100_003, "grew", seed, rank, step))


class DamagedCheckpoint(CheckpointError):
    """A sharded checkpoint whose shard file did not match its checksum while it was loaded: the same on every
    rank (the message names the file); the objects hold a partial load, and the previous checkpoint goes next."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"checkpoint {path}: {reason}")
        self.path, self.reason = path, reason


def _load_verified(loaded: LoadedCheckpoint, state: dict[str, Any]) -> None:
    """*Collective.* DCP's load of `state`; where the shard files' checksums were left to it (`loaded.unverified`),
    each chunk checked as the load reaches it, then the rest of this rank's files (mgpu.state.sharded.verify)."""
    if not loaded.unverified:
        dcp.load(state, storage_reader=SafeReader(loaded.path), planner=SafeLoadPlanner())
        return
    checks = ChunkChecks(loaded.path, loaded.unverified["files"])
    failure: BaseException | None = None
    try:
        dcp.load(state, storage_reader=VerifyingReader(loaded.path, checks), planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as error:  # noqa: BLE001  (every rank: DCP gathers its ranks' failures)
        failure = error  # (DCP's CheckpointException is a BaseException)
    _agree_intact(loaded, checks, failure)


def _agree_intact(loaded: LoadedCheckpoint, checks: ChunkChecks, failure: BaseException | None) -> None:
    """*Collective.* DamagedCheckpoint on every rank when any rank's checks found a mismatch; else the load's own
    failure, if any, raised as it was."""
    problem = checks.finish(sorted(loaded.unverified["own"]))
    problems: list[Any] = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise DamagedCheckpoint(loaded.path, first)
    if failure is not None:
        raise failure
