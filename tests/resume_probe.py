"""One rank of a resume's checkpoint search, instrumented (tests/test_checkpoint.py, D8): run under torchrun.

    torchrun --nproc-per-node 3 tests/resume_probe.py RUN_DIR OUT_DIR

Every rank forms a gloo group and calls `Checkpointer.find_latest()` as the trainer does, counting the bytes
it feeds to a checksum (mgpu.state.files.digest's, or an older checkpoint's sha256) and how it calls `torch.load` and
`CheckpointStore.load_dir`; it writes them to `OUT_DIR/rank<N>.json`.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

from mgpu.state.files import digest
from mgpu.state.single import store as checkpoint
from mgpu.state.single.store import CheckpointStore
from mgpu.state.checkpointer import Checkpointer
from mgpu.parallel.distributed import process_group
from mgpu.record.ledger import Ledger
from mgpu.record.rundir import RunDir

hashed: list[int] = []  # bytes per sha256 or ChunkDigest object this process created
loads: list[dict[str, Any]] = []
load_dirs: list[dict[str, Any]] = []


class CountingSha256:
    """hashlib.sha256, counting what it is fed."""

    def __init__(self, data: bytes = b"") -> None:
        self._inner, self._index = hashlib.new("sha256"), len(hashed)
        hashed.append(0)
        self.update(data)

    def update(self, data: Any) -> None:
        hashed[self._index] += len(data)
        self._inner.update(data)

    def hexdigest(self) -> str:
        return self._inner.hexdigest()


def main() -> int:
    run, out = RunDir(Path(sys.argv[1])), Path(sys.argv[2])
    real_load, real_load_dir = torch.load, CheckpointStore.load_dir

    def load(*args: Any, **kwargs: Any) -> Any:
        loads.append({"mmap": kwargs.get("mmap", False), "weights_only": kwargs.get("weights_only")})
        return real_load(*args, **kwargs)

    def load_dir(path: Path, verify: bool = True) -> Any:
        load_dirs.append({"verify": verify})
        return real_load_dir(path, verify=verify)

    hashlib.sha256 = CountingSha256  # type: ignore[assignment,misc]
    real_update = digest.ChunkDigest.update

    def counting_update(self: digest.ChunkDigest, data: Any) -> None:
        if not hasattr(self, "counted"):
            self.counted = len(hashed)  # type: ignore[attr-defined]
            hashed.append(0)
        hashed[self.counted] += memoryview(data).nbytes  # type: ignore[attr-defined]
        real_update(self, data)

    digest.ChunkDigest.update = counting_update  # type: ignore[method-assign]
    checkpoint.torch.load = load  # type: ignore[assignment]
    CheckpointStore.load_dir = staticmethod(load_dir)  # type: ignore[method-assign]
    with process_group() as ctx:
        rank, world = ctx.env.rank, ctx.env.world_size
        found = Checkpointer(run, rank, world, Ledger(None)).find_latest()
        assert found is not None
        record = {"rank": rank, "step": found.step, "digested_bytes": sum(hashed), "digests": len(hashed),
                  "loads": loads, "load_dirs": load_dirs, "file_bytes": (found.path / "state.pt").stat().st_size}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
