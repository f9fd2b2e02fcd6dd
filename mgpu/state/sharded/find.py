"""A sharded checkpoint found and loaded, the read side of mgpu.state.sharded.checkpointer: the newest one whose every
file verifies (the ranks verify in parallel: saved rank r's files by current rank r % W), its common state and this
rank's own pieces loaded, and the previous one in its place where any file is damaged. Nothing is unpickled but
tensors, numbers, strings and DCP's own metadata classes (mgpu.state.sharded.dcp_safe); the models and optimizers
are restored by mgpu.state.sharded.format.restore_sharded, which resharding needs the loop's objects for.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mgpu.state.checkpoint_format import META_FILE, CheckpointError, LoadedCheckpoint, one_line, refuse_newer
from mgpu.state.sharded.dcp_safe import SafeReader
from mgpu.state.sharded.format import COMMON, FORMAT, rank_file, read_meta, shard_entries, verify_rank
from mgpu.state.single.store import CheckpointStore

log = logging.getLogger("mgpu.train")


def find_latest(store: CheckpointStore, rank: int, world: int, defer_shards: bool = False,
                rejected: tuple[tuple[Path, str], ...] = ()) -> LoadedCheckpoint | None:
    """*Collective.* The newest sharded checkpoint in `store` whose every file verifies (each rank hashes a share),
    its common state and this rank's own pieces loaded; None for a new run. `defer_shards`: the shard files'
    checksums are checked by the load as it reads them (`LoadedCheckpoint.unverified`; restore_sharded), their
    sizes here: a resume reads them once. `rejected`: checkpoints found damaged since (skipped, and said)."""
    candidates, refusal = None, None
    if rank == 0:
        pointed = store.pointer("latest")
        steps = [(step, path) for step, path in store._step_dirs() if (path / META_FILE).is_file()]
        candidates = [(step, str(path)) for step, path in sorted(steps, key=lambda s: s[1].name != pointed)]
        try:
            refuse_newer([path for _, path in steps], FORMAT)  # never passed over: the run would save over it
        except CheckpointError as error:
            refusal = str(error)
    if world > 1:
        holder = [(candidates, refusal)]
        dist.broadcast_object_list(holder, src=0)
        candidates, refusal = holder[0]
    if refusal is not None:
        raise CheckpointError(refusal)  # on every rank alike
    skipped: list[tuple[Path, str]] = list(rejected)
    for step, where in candidates or []:
        path = Path(where)
        if any(path == bad for bad, _ in rejected):
            continue
        unverified: dict[str, Any] | None = {} if defer_shards else None
        reason, meta = _verify(path, step, rank, world, unverified)
        if reason is None:
            try:
                return _load(path, step, meta, tuple(skipped), rank, unverified)
            except Exception as error:  # noqa: BLE001  (alike on every rank: the files verified)
                reason = f"does not load safely: {one_line(error, 200)}"
        if rank == 0:
            log.warning("skipping checkpoint %s: %s", path, reason)
        skipped.append((path, reason))
    if skipped:
        raise CheckpointError(f"no valid checkpoint in {store.directory}: {len(skipped)} rejected, the first "
                              f"because {skipped[0][1]}")
    return None


def _verify(path: Path, step: int, rank: int, world: int, unverified: dict[str, Any] | None = None
            ) -> tuple[str | None, dict[str, Any]]:
    """(why `path` is damaged, as every rank sees it; its meta). Saved rank r's files are hashed by rank r % W.
    `unverified`: filled with the shard files left to the load (`files`: every saved rank's, `own`: this rank's)."""
    try:
        meta: dict[str, Any] | None = read_meta(path, step)
        problem = None
    except (OSError, ValueError) as error:
        meta, problem = None, one_line(error, 300)
    if problem is None and meta is not None:
        own: dict[str, Any] | None = {} if unverified is not None else None
        for saved in range(rank, meta["world_size"], world):
            problem = verify_rank(path, saved, meta, own)
            if problem is not None:
                break
        if unverified is not None and own is not None and problem is None:
            unverified.update(files=shard_entries(path, meta, range(meta["world_size"])), own=set(own))
    problems: list[Any] = [problem]
    if world > 1:
        problems = [None] * world
        dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p is not None), None)
    return first, meta or {}


def _load(path: Path, step: int, meta: dict[str, Any], skipped: tuple[tuple[Path, str], ...], rank: int,
          unverified: dict[str, Any] | None = None) -> LoadedCheckpoint:
    SafeReader(path).read_metadata()  # DCP's pickle read through the allow-list now: a refusal falls back
    state = torch.load(path / COMMON, map_location="cpu", weights_only=True)
    own = path / rank_file(rank)
    state["rank_pieces"] = torch.load(own, map_location="cpu", weights_only=True) if own.is_file() else None
    return LoadedCheckpoint(path=path, step=step, state=state, meta=meta, skipped=skipped,
                            unverified=unverified or {})
