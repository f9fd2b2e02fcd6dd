"""A sharded checkpoint (mgpu.state.sharded.checkpointer) read whole in one process, without a process group: for
inference (`mgpu.load_model`), another tool, or a look inside.

    python -m mgpu.state.sharded.export RUN_DIR_OR_STEP_DIR OUT.pt    # one torch.save file, weights_only-loadable

The export never writes into a checkpoint (a file there breaks its verification) nor over an existing file;
every argument it cannot use is one line, exit 2, nothing written. `consolidated_model` reads one module's
tensors alone (not the optimizers': about 3x the model with AdamW).
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from mgpu.state.single.store import CheckpointStore
from mgpu.state.checkpoint_format import (META_FILE, STATE_FILE, TMP_PREFIX, CheckpointError, describe_os_error,
                                          one_line)
from mgpu.errors import MgpuError
from mgpu.fsutil import fsync_path
from mgpu.record.ledger import Ledger
from mgpu.state.sharded.dcp_safe import SafeEmptyPlanner, SafeReader, module_of
from mgpu.state.sharded.checkpointer import ShardedCheckpointer
from mgpu.state.sharded.format import COMMON, KIND, rank_file, read_meta, verify_rank

__all__ = ["consolidate", "consolidated_model", "is_sharded_checkpoint", "main"]

PROG = "mgpu.state.sharded.export"


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether the step directory `path` holds a sharded checkpoint (by its meta.json)."""
    try:
        return json.loads((Path(path) / META_FILE).read_text()).get("kind") == KIND
    except (OSError, ValueError, AttributeError):
        return False


def _step_number(path: Path) -> int:
    name, _, number = path.name.rpartition("_")
    if not name or not number.isdigit():
        raise CheckpointError(f"{path} is not a checkpoint's step directory (its name ends in _<step>, as "
                              f"step_00000012)")
    return int(number)


def _verified(path: Path, verify: bool) -> dict[str, Any]:
    """`path`'s meta.json, every file verified first (`verify`), and DCP's metadata read through the allow-list:
    a CheckpointError (one line) for anything else."""
    try:
        meta = read_meta(path, _step_number(path))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"checkpoint {path} is invalid: {one_line(error, 300)}") from None
    for saved in range(meta["world_size"]) if verify else ():
        problem = verify_rank(path, saved, meta)
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} is invalid: {problem}")
    return meta


def _load_flat(path: Path, module: str | None = None) -> dict[str, Any]:
    """DCP's part of the checkpoint at `path`, in one process: all of it, or one module's entries alone."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    try:
        metadata = SafeReader(path).read_metadata()
    except Exception as error:  # noqa: BLE001  (a refused global, or a pickle that is not DCP's metadata)
        raise CheckpointError(f"checkpoint {path} does not load safely: {one_line(error, 200)}") from None
    if module is not None:
        names = {name for key in metadata.state_dict_metadata if (name := module_of(key, metadata)) is not None}
        if module not in names:
            raise CheckpointError(f"checkpoint {path} holds no module named {module!r} (it has {sorted(names)})")
    flat: dict[str, Any] = {}
    _load_state_dict(flat, storage_reader=SafeReader(path), planner=SafeEmptyPlanner(module), no_dist=True)
    return flat


def _modules(flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    modules: dict[str, dict[str, Any]] = {}
    for key, value in flat.get("model", {}).items():
        name, _, rest = key.partition(".")
        modules.setdefault(name, {})[rest] = value
    return modules


def consolidate(path: Path, verify: bool = True) -> dict[str, Any]:
    """The whole of the sharded checkpoint at `path` in one process, as plain tensors (no process group): its
    common state, every saved module's full state_dict under its name, the optimizers' state (`"optim"`,
    keyed by parameter name) and `"rng"`, every saved rank's RNG state. Every file verified first (`verify`)."""
    path = Path(path)
    meta = _verified(path, verify)
    flat = _load_flat(path)
    state = torch.load(path / COMMON, map_location="cpu", weights_only=True)
    for name, values in _modules(flat).items():
        state.setdefault(name, {}).update(values)
    if "optim" in flat:
        state["optim"] = flat["optim"]
    state["rng"] = [torch.load(path / rank_file(r), map_location="cpu", weights_only=True)["rng"]
                    for r in range(meta["world_size"])]
    return state


def consolidated_model(directory: Path, which: str = "best", name: str = "model") -> dict[str, Any] | None:
    """The full state_dict of module `name` in a run's best (else latest) checkpoint, when it is sharded (None:
    the run's checkpoints are single files). The latest falls back past a damaged checkpoint; `best` does not.
    Only that module's tensors are read (every file is verified)."""
    store = CheckpointStore(Path(directory))
    best = store.pointer("best") if which == "best" else None
    path = store.directory / best if best else store.latest_path()
    if path is None or not is_sharded_checkpoint(path):
        return None
    if not best:
        loaded = ShardedCheckpointer(store.directory, 0, 1, Ledger(None, "", 0)).find_latest()
        path = loaded.path if loaded is not None else path
    _verified(path, verify=True)
    return _modules(_load_flat(path, module=name)).get(name, {})


# ---------------------------------------------------------------------------------------------- the command
def _source(given: Path) -> Path:
    """The sharded step directory `given` names (itself, or a run's / a checkpoints directory's latest)."""
    if not given.exists():
        raise MgpuError(f"{given}: no such file or directory (give a run directory or a checkpoint's step "
                        f"directory)")
    if (given / META_FILE).is_file():
        if (given / STATE_FILE).is_file() and not is_sharded_checkpoint(given):
            raise MgpuError(f"{given} is a single-file checkpoint: it is one file already ({given / STATE_FILE}; "
                            f"mgpu.load_model reads its weights)")
        _step_number(given)
        return given
    directory = given / "checkpoints" if (given / "checkpoints").is_dir() else given
    if not directory.is_dir():
        raise MgpuError(f"{given}: neither a run directory nor a checkpoint's step directory")
    latest = CheckpointStore(directory).latest_path()
    if latest is not None and (latest / STATE_FILE).is_file() and not is_sharded_checkpoint(latest):
        raise MgpuError(f"{given}: the run's checkpoints are single files (train.parallel=ddp, "
                        f"checkpoint.format=single): {latest / STATE_FILE} is one file already; mgpu.load_model "
                        f"reads its weights")
    loaded = ShardedCheckpointer(directory, 0, 1, Ledger(None, "", 0)).find_latest()
    if loaded is None:
        raise MgpuError(f"{given}: no sharded checkpoint there")
    return loaded.path


def _inside_checkpoints(where: Path, source: Path) -> Path | None:
    """The checkpoint directory (a step's, a save's temporary one, or a run's checkpoints/, the source's
    included) that `where` lies in, if any."""
    store = source.resolve().parent if source.name.startswith("step_") else None
    for folder in (where, *where.parents):
        if ((folder / META_FILE).exists() or folder.name.startswith(TMP_PREFIX) or folder == store
                or ((folder / "latest").is_file() and any(folder.glob("step_*")))):
            return folder
    return None


def _check_out(out: Path, source: Path) -> None:
    """A one-line MgpuError for an OUT the export must not write."""
    if out.is_dir():
        raise MgpuError(f"{out} is a directory: name the file to write (as {out / 'model.pt'})")
    if out.exists() or out.is_symlink():
        raise MgpuError(f"{out} exists: an export never overwrites a file (remove it, or name another)")
    parent = out.absolute().parent
    if not parent.is_dir():
        raise MgpuError(f"{out}: its directory {parent} does not exist")
    inside = _inside_checkpoints(parent.resolve(), source)
    if inside is not None:
        raise MgpuError(f"{out} is inside the checkpoint directory {inside}: a file written there changes a "
                        f"checkpoint (it no longer verifies); write the export outside the run's checkpoints/")
    if not os.access(parent, os.W_OK):
        raise MgpuError(f"{out}: its directory {parent} is not writable")


def _write(state: dict[str, Any], out: Path) -> None:
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        torch.save(state, tmp)
        fsync_path(tmp)
        try:
            os.link(tmp, out)  # never over a file that appeared meanwhile
        except OSError as error:
            if error.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP) or out.exists():
                raise
            os.replace(tmp, out)  # a filesystem without hard links
    except OSError as error:
        raise MgpuError(f"{out} not written: {describe_os_error(error, out)}") from None
    finally:
        tmp.unlink(missing_ok=True)


class _Refused(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    """`python -m mgpu.state.sharded.export CHECKPOINT_DIR OUT.pt`: a sharded checkpoint (a step directory, or a run's
    checkpoints/ for its latest) consolidated into one torch.save file (weights_only-loadable). Exit 2, one
    line and nothing written for an argument it cannot use."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> Any:  # one line, as every other input error
            raise _Refused(message)

    parser = Parser(prog=f"python -m {PROG}", description=main.__doc__)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    try:
        args = parser.parse_args(argv)
        source = _source(args.checkpoint)
        _check_out(args.out, source)
        state = consolidate(source)
        _write(state, args.out)
    except (_Refused, MgpuError) as error:
        print(f"{PROG}: error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
        return 2
    print(f"{source} -> {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
