"""One rank's state snapshots in node-local shared memory (`/dev/shm`), which outlive the process: after a
crash, a killed rank or a hang, the step that srun starts again in the same allocation finds them there.

`/dev/shm/mgpu-<job>-<run>/rank<N>/` holds two slots (`slot0.pt`, `slot1.pt`), each with its commit record
(`slot0.json`, ...: step, CRC-32, job, its restart count, run, config digest, world size, rank) written last by an atomic rename.
A write goes into the older slot and removes that slot's record first: a failure during the copy leaves the
other slot whole. The slot's file is written over in place (its pages stay allocated: no page fault per 4 KiB,
three times faster than a new file here), and checked with a CRC-32, not a cryptographic digest: it guards
against a torn copy, not an adversary (the directory is the user's alone, 0700). A read refuses a stale snapshot (another job, or the same one before a requeue, run, config or world size) and a torn one
(its CRC-32). No torch at import: the serialization is given (`write`'s `dump`, `read`'s `load`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Callable

from mgpu.state.digest import crc32

__all__ = ["BASE_ENV", "Identity", "Snapshot", "SnapshotStore", "job_dir", "local_job_id", "remove_job", "safe_name"]

BASE_ENV = "MGPU_SNAPSHOT_DIR"
"""Where the job directories go instead of /dev/shm (tests; a node whose /dev/shm is too small)."""
SLOTS = 2
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class Identity:
    """What a snapshot must match to be restored: the job (and its restart count: a requeued job's snapshots
    from before the requeue are not restored) and run it belongs to, the config it ran under, the world it was
    taken in and the rank that took it."""

    job: str
    restart: int
    run: str
    config: str
    world_size: int
    rank: int


@dataclass(frozen=True)
class Snapshot:
    """A committed slot: its step, its file and the CRC-32 of that file."""

    step: int
    slot: int
    path: Path
    digest: str

    def still_committed(self) -> bool:
        """Whether its slot still holds it: a write into the slot removes the commit record before it touches the
        file and writes a new one (another step) only after, so while this is True the file was not written over."""
        record = read_record(self.path.with_suffix(".json"))
        return record is not None and record.get("step") == self.step and record.get("crc32") == self.digest


def read_record(path: Path) -> dict[str, Any] | None:
    """A slot's commit record; None where it is missing, torn or not an object."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def safe_name(text: str) -> str:
    """`text` as one part of a file name: every character outside [A-Za-z0-9_.-] becomes "_"."""
    return _SAFE.sub("_", text)


def local_job_id(run_id: str) -> str:
    """The job id outside Slurm: derived from the run, so a local restart of the same run finds its snapshots."""
    return f"local-{run_id}"


def base_dir() -> Path:
    return Path(os.environ.get(BASE_ENV) or "/dev/shm")


def job_dir(job: str, run: str, base: Path | None = None) -> Path:
    """`<base>/mgpu-<job>-<run>`: one job's snapshots on this node, every rank's."""
    return (base or base_dir()) / f"mgpu-{safe_name(job)}-{safe_name(run)}"


def remove_job(job: str, run: str | None = None, base: Path | None = None) -> list[Path]:
    """Remove this node's snapshots of `job` (of one run, or of every run of the job): the paths removed."""
    root = base or base_dir()
    pattern = job_dir(job, run, root).name if run is not None else f"mgpu-{safe_name(job)}-*"
    removed = []
    for path in sorted(root.glob(pattern)) if root.is_dir() else ():
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class _Checksumming:
    """A write-only file that computes the CRC-32 of what passes through it."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file, self.crc = file, 0

    def write(self, data: Any) -> int:
        written = self.file.write(data)
        self.crc = crc32(memoryview(data)[:written], self.crc)
        return written

    def flush(self) -> None:
        self.file.flush()

    @property
    def digest(self) -> str:
        return f"{self.crc:08x}"


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as file:
        while chunk := file.read(8 << 20):
            crc = crc32(chunk, crc)
    return f"{crc:08x}"


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
        return read_record(self._record_path(slot))

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
        with os.fdopen(os.open(data, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as file:  # over its pages, in place
            checksumming = _Checksumming(file)
            dump(checksumming)
            checksumming.flush()
            file.truncate(file.tell())
        record = {**asdict(self.identity), "step": step, "slot": slot, "crc32": checksumming.digest,
                  "bytes": data.stat().st_size}
        tmp = self._record_path(slot).with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self._record_path(slot))  # the commit: last
        return Snapshot(step, slot, data, checksumming.digest)

    def committed(self) -> list[tuple[Snapshot, str | None]]:
        """Every committed slot, newest first, each with why it cannot be restored (None: it can): another job,
        run, config, world size or rank (stale), or a file whose digest is not the record's (torn)."""
        found = []
        for slot in range(SLOTS):
            record = self._record(slot)
            if record is None or not isinstance(record.get("step"), int):
                continue
            snapshot = Snapshot(record["step"], slot, self._data_path(slot), str(record.get("crc32")))
            found.append((snapshot, self._refusal(record, snapshot)))
        return sorted(found, key=lambda item: -item[0].step)

    def _refusal(self, record: dict[str, Any], snapshot: Snapshot) -> str | None:
        for key, mine in asdict(self.identity).items():
            if record.get(key) != mine:
                return f"stale: taken with {key}={record.get(key)!r}, this rank has {mine!r}"
        try:
            digest = _crc32(snapshot.path)
        except OSError as error:
            return f"unreadable: {error}"
        return None if digest == snapshot.digest else "torn: its CRC-32 is not the commit record's"

    def valid_steps(self) -> list[int]:
        """The steps this rank can restore, newest first."""
        return [snapshot.step for snapshot, refusal in self.committed() if refusal is None]

    def read(self, step: int, load: Callable[[IO[bytes]], Any]) -> Any:
        """`load(file)` of the valid snapshot of `step` (verified again: read once into memory, then hashed)."""
        for snapshot, refusal in self.committed():
            if snapshot.step == step and refusal is None:
                content = snapshot.path.read_bytes()
                if f"{crc32(content):08x}" != snapshot.digest:
                    continue  # changed since it was checked: the other slot, if it has this step
                return load(io.BytesIO(content))
        raise FileNotFoundError(f"{self.directory}: no valid snapshot of step {step}")

    def discard_after(self, step: int) -> None:
        """Uncommit the slots of steps after `step` (another attempt's, the run resumed before them): the next
        writes then overwrite the older slot, as they should, and a restore never goes back to them."""
        for slot in range(SLOTS):
            record = self._record(slot)
            if record is not None and isinstance(record.get("step"), int) and record["step"] > step:
                with contextlib.suppress(FileNotFoundError):
                    self._record_path(slot).unlink()

    def remove(self) -> None:
        """This rank's snapshots, and the job directory once no rank's is left."""
        shutil.rmtree(self.directory, ignore_errors=True)
        with contextlib.suppress(OSError):  # another rank's is still there
            self.directory.parent.rmdir()


def main(argv: list[str] | None = None) -> int:
    """`python -m mgpu.state.memory_snapshot --remove-job JOB` (or `--remove-this-job`, the job of the Slurm task it
    runs in): this node's snapshots of the job, removed (the batch script's teardown, one task per node, when
    the job ends without its ranks' own cleanup)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mgpu.state.memory_snapshot", description=main.__doc__)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--remove-job", metavar="JOB", help="the Slurm job id (an array task's: JOB_TASK)")
    which.add_argument("--remove-this-job", action="store_true", help="the job in SLURM_JOB_ID (and its array task)")
    args = parser.parse_args(argv)
    if args.remove_this_job:
        from mgpu.cluster.environment import SlurmEnvironment

        if "SLURM_JOB_ID" not in os.environ:
            parser.error("--remove-this-job outside a Slurm job (no SLURM_JOB_ID): name it with --remove-job")
        args.remove_job = SlurmEnvironment.job_id(os.environ)
    for path in remove_job(args.remove_job):
        print(f"mgpu.state.memory_snapshot: removed {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
