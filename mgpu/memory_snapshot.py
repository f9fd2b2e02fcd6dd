"""One rank's state snapshots in node-local shared memory (`/dev/shm`), which outlive the process: after a
crash, a killed rank or a hang, the step that srun starts again in the same allocation finds them there.

`/dev/shm/mgpu-<job>-<run>/rank<N>/` holds two slots (`slot0.pt`, `slot1.pt`), each with its commit record
(`slot0.json`, ...: step, sha256, job, run, config digest, world size, rank) written last by an atomic rename.
A write goes into the older slot and removes that slot's record first: a failure during the copy leaves the
other slot whole. A read refuses a stale snapshot (another job, run, config or world size) and a torn one
(its digest). No torch at import: the serialization is given (`write`'s `dump`, `read`'s `load`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Callable

__all__ = ["BASE_ENV", "Identity", "Snapshot", "SnapshotStore", "job_dir", "local_job_id", "remove_job"]

BASE_ENV = "MGPU_SNAPSHOT_DIR"
"""Where the job directories go instead of /dev/shm (tests; a node whose /dev/shm is too small)."""
SLOTS = 2
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class Identity:
    """What a snapshot must match to be restored: the job and run it belongs to, the config it ran under, the
    world it was taken in and the rank that took it."""

    job: str
    run: str
    config: str
    world_size: int
    rank: int


@dataclass(frozen=True)
class Snapshot:
    """A committed slot: its step, its file and the sha256 of that file."""

    step: int
    slot: int
    path: Path
    digest: str


def local_job_id(run_id: str) -> str:
    """The job id outside Slurm: derived from the run, so a local restart of the same run finds its snapshots."""
    return f"local-{run_id}"


def base_dir() -> Path:
    return Path(os.environ.get(BASE_ENV) or "/dev/shm")


def job_dir(job: str, run: str, base: Path | None = None) -> Path:
    """`<base>/mgpu-<job>-<run>`: one job's snapshots on this node, every rank's."""
    return (base or base_dir()) / f"mgpu-{_SAFE.sub('_', job)}-{_SAFE.sub('_', run)}"


def remove_job(job: str, run: str | None = None, base: Path | None = None) -> list[Path]:
    """Remove this node's snapshots of `job` (of one run, or of every run of the job): the paths removed."""
    root = base or base_dir()
    pattern = job_dir(job, run, root).name if run is not None else f"mgpu-{_SAFE.sub('_', job)}-*"
    removed = []
    for path in sorted(root.glob(pattern)) if root.is_dir() else ():
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class _Hashing:
    """A write-only file that hashes what passes through it."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file, self.digest = file, hashlib.sha256()

    def write(self, data: Any) -> int:
        written = self.file.write(data)
        self.digest.update(memoryview(data)[:written])
        return written

    def flush(self) -> None:
        self.file.flush()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class SnapshotStore:
    """One rank's two slots in `directory` (`job_dir(...)/rank<N>`), for `identity`."""

    def __init__(self, directory: Path, identity: Identity) -> None:
        self.directory, self.identity = directory, identity

    @classmethod
    def for_rank(cls, identity: Identity, base: Path | None = None) -> "SnapshotStore":
        return cls(job_dir(identity.job, identity.run, base) / f"rank{identity.rank}", identity)

    def _record_path(self, slot: int) -> Path:
        return self.directory / f"slot{slot}.json"

    def _data_path(self, slot: int) -> Path:
        return self.directory / f"slot{slot}.pt"

    def _record(self, slot: int) -> dict[str, Any] | None:
        try:
            record = json.loads(self._record_path(slot).read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def _age(self, slot: int) -> int:
        """A slot's step, for choosing the one to overwrite: -1 if empty or unreadable, -2 if another identity's."""
        record = self._record(slot)
        if record is None or not isinstance(record.get("step"), int):
            return -1
        if any(record.get(key) != mine for key, mine in asdict(self.identity).items()):
            return -2
        return int(record["step"])

    def write(self, step: int, dump: Callable[[Any], object]) -> Snapshot:
        """`dump(file)` into the slot not holding the newest snapshot, then its commit record (atomically). The
        other slot stays whole whatever happens meanwhile."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        slot = min(range(SLOTS), key=self._age)  # the newest snapshot of this identity is never overwritten
        with contextlib.suppress(FileNotFoundError):
            self._record_path(slot).unlink()  # from here the slot is uncommitted: a torn copy is never believed
        data = self._data_path(slot)
        with open(data, "wb") as file:
            hashing = _Hashing(file)
            dump(hashing)
            hashing.flush()
        record = {**asdict(self.identity), "step": step, "slot": slot, "sha256": hashing.digest.hexdigest(),
                  "bytes": data.stat().st_size}
        tmp = self._record_path(slot).with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self._record_path(slot))  # the commit: last
        return Snapshot(step, slot, data, record["sha256"])

    def committed(self) -> list[tuple[Snapshot, str | None]]:
        """Every committed slot, newest first, each with why it cannot be restored (None: it can): another job,
        run, config, world size or rank (stale), or a file whose digest is not the record's (torn)."""
        found = []
        for slot in range(SLOTS):
            record = self._record(slot)
            if record is None or not isinstance(record.get("step"), int):
                continue
            snapshot = Snapshot(record["step"], slot, self._data_path(slot), str(record.get("sha256")))
            found.append((snapshot, self._refusal(record, snapshot)))
        return sorted(found, key=lambda item: -item[0].step)

    def _refusal(self, record: dict[str, Any], snapshot: Snapshot) -> str | None:
        for key, mine in asdict(self.identity).items():
            if record.get(key) != mine:
                return f"stale: taken with {key}={record.get(key)!r}, this rank has {mine!r}"
        try:
            digest = _sha256(snapshot.path)
        except OSError as error:
            return f"unreadable: {error}"
        return None if digest == snapshot.digest else "torn: its sha256 is not the commit record's"

    def valid_steps(self) -> list[int]:
        """The steps this rank can restore, newest first."""
        return [snapshot.step for snapshot, refusal in self.committed() if refusal is None]

    def read(self, step: int, load: Callable[[IO[bytes]], Any]) -> Any:
        """`load(file)` of the valid snapshot of `step` (verified again: read once into memory, then hashed)."""
        for snapshot, refusal in self.committed():
            if snapshot.step == step and refusal is None:
                content = snapshot.path.read_bytes()
                if hashlib.sha256(content).hexdigest() != snapshot.digest:
                    continue  # changed since it was checked: the other slot, if it has this step
                return load(io.BytesIO(content))
        raise FileNotFoundError(f"{self.directory}: no valid snapshot of step {step}")

    def remove(self) -> None:
        """This rank's snapshots, and the job directory once no rank's is left."""
        shutil.rmtree(self.directory, ignore_errors=True)
        with contextlib.suppress(OSError):  # another rank's is still there
            self.directory.parent.rmdir()

