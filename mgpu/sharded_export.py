"""A sharded checkpoint (mgpu.sharded) read whole in one process, without a process group: for inference
(`mgpu.load_model`), another tool, or a look inside.

    python -m mgpu.sharded_export RUN_DIR_OR_STEP_DIR OUT.pt    # one torch.save file, weights_only-loadable
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from mgpu.checkpoint import META_FILE, CheckpointError, CheckpointStore, _one_line
from mgpu.fsutil import fsync_path
from mgpu.ledger import Ledger
from mgpu.sharded import (COMMON, KIND, SafeReader, ShardedCheckpointer, _rank_file, _read_meta, _SafeEmptyPlanner,
                          _verify_rank)

__all__ = ["consolidate", "consolidated_model", "is_sharded_checkpoint", "main"]


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether the step directory `path` holds a sharded checkpoint (by its meta.json)."""
    try:
        return json.loads((Path(path) / META_FILE).read_text()).get("kind") == KIND
    except (OSError, ValueError, AttributeError):
        return False


def consolidate(path: Path, verify: bool = True) -> dict[str, Any]:
    """The whole of the sharded checkpoint at `path` in one process, as plain tensors (no process group): its
    common state, every saved module's full state_dict under its name, the optimizers' state (`"optim"`,
    keyed by parameter name) and `"rng"`, every saved rank's RNG state. Every file verified first (`verify`)."""
    path = Path(path)
    step = int(path.name.split("_")[-1])
    try:
        meta = _read_meta(path, step)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"checkpoint {path} is invalid: {_one_line(error, 300)}") from None
    for saved in range(meta["world_size"]) if verify else ():
        problem = _verify_rank(path, saved, meta)
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} is invalid: {problem}")
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    try:
        SafeReader(path).read_metadata()
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"checkpoint {path} does not load safely: {_one_line(error, 200)}") from None
    flat: dict[str, Any] = {}
    _load_state_dict(flat, storage_reader=SafeReader(path), planner=_SafeEmptyPlanner(), no_dist=True)
    state = torch.load(path / COMMON, map_location="cpu", weights_only=True)
    for key, value in flat.get("model", {}).items():
        name, _, rest = key.partition(".")
        state.setdefault(name, {})[rest] = value
    if "optim" in flat:
        state["optim"] = flat["optim"]
    state["rng"] = [torch.load(path / _rank_file(r), map_location="cpu", weights_only=True)["rng"]
                    for r in range(meta["world_size"])]
    return state


def consolidated_model(directory: Path, which: str = "best", name: str = "model") -> dict[str, Any] | None:
    """The full state_dict of module `name` in a run's best (else latest) checkpoint, when it is sharded (None:
    the run's checkpoints are single files). The latest falls back past a damaged checkpoint; `best` does not."""
    store = CheckpointStore(Path(directory))
    best = store._pointer("best") if which == "best" else None
    path = store.directory / best if best else store.latest_path()
    if path is None or not is_sharded_checkpoint(path):
        return None
    if not best:
        loaded = ShardedCheckpointer(store.directory, 0, 1, Ledger(None, "", 0)).find_latest()
        path = loaded.path if loaded is not None else path
    state = consolidate(path)
    if name not in state:
        raise CheckpointError(f"checkpoint {path} holds no module named {name!r} (it has {sorted(state)})")
    return state[name]


def main(argv: list[str] | None = None) -> int:
    """`python -m mgpu.sharded_export CHECKPOINT_DIR OUT.pt`: a sharded checkpoint (a step directory, or a run's
    checkpoints/ for its latest) consolidated into one torch.save file (weights_only-loadable)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mgpu.sharded_export", description=main.__doc__)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    path = args.checkpoint
    if not (path / META_FILE).is_file():
        directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        loaded = ShardedCheckpointer(directory, 0, 1, Ledger(None, "", 0)).find_latest() \
            if directory.is_dir() else None
        if loaded is None:
            print(f"mgpu.sharded_export: {path}: no sharded checkpoint there", flush=True)
            return 2
        path = loaded.path
    try:
        state = consolidate(path)
    except CheckpointError as error:
        print(f"mgpu.sharded_export: {error}", flush=True)
        return 2
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    torch.save(state, tmp)
    fsync_path(tmp)
    os.replace(tmp, args.out)
    print(f"{path} -> {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
