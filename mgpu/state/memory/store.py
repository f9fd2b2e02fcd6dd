"""One rank's state snapshots in node-local shared memory (`/dev/shm`), which outlive the process: after a
crash, a killed rank or a hang, the step that srun starts again in the same allocation finds them there.

`/dev/shm/mgpu-<job>-<run>/rank<N>/` holds two slots (`slot0.pt`, `slot1.pt`), each with its commit record
(`slot0.json`, ...: step, CRC-32, job, its restart count, run, config digest, world size, rank) written last by an atomic rename.
A write goes into the older slot and removes that slot's record first: a failure during the copy leaves the
other slot whole. The slot's file is written over in place (its pages stay allocated: no page fault per 4 KiB,
three times faster than a new file here), and checked with a CRC-32, not a cryptographic digest: it guards
against a torn copy, not an adversary (the directory is the user's alone, 0700). A read refuses a stale snapshot (another job, or the same one before a requeue, run, config or world size) and a torn one
(its CRC-32), and a commit record whose fields are not what a write records (`record_problem`: a step of `true`).
A snapshot that is committed whole but does not restore is set aside (`set_aside`: renamed, kept beside the slots
until the job's snapshots are removed). No torch at import: the serialization is given (`write`'s `dump`, `read`'s
`load`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any, Callable

from mgpu.state.files.digest import crc32

__all__ = ["BASE_ENV", "SHARE_KEYS", "Identity", "Snapshot", "SnapshotStore", "job_dir", "local_job_id", "record_problem",
           "remove_job", "remove_run", "safe_name"]

BASE_ENV = "MGPU_SNAPSHOT_DIR"
"""Where the job directories go instead of /dev/shm (tests; a node whose /dev/shm is too small)."""
SLOTS = 2
SET_ASIDE = "set-aside-step"
"""A snapshot that did not restore, renamed out of its slot: `set-aside-step<S>.pt` and its record `.json`."""
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_CRC = re.compile(r"[0-9a-f]{8}")
SHARE_KEYS = ("any_rank", "rank0_buffers")
"""A commit record's `share`: who else may resume from the snapshot (mgpu.state.memory.step_mark.Shareable)."""


@dataclass(frozen=True)
class Identity:
    """What a snapshot must match to be restored: the job (and its restart count: a requeued job's snapshots
    from before the requeue are not restored) and run it belongs to, the config it ran under (the keys a resume
    may not change: mgpu.state.memory.snapshots.config_digest), the world it was taken in, the rank that took it and
    the shape of the state."""

    job: str
    restart: int
    run: str
    config: str
    world_size: int
    rank: int
    structure: str = ""
    """A digest of the state's shape (its modules' tensors, its optimizers' parameter groups:
    mgpu.state.memory.content.structure_digest): a snapshot of another model or optimizer is refused as stale, not
    loaded into this one."""


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


_STALE = {"job": "another job's", "restart": "this job's before a requeue", "run": "another run's",
          "config": "another config: a key a resume may not change differs", "world_size": "another world size",
          "rank": "another rank's", "structure": "another model or optimizer: their tensors' shapes differ"}


def _whole(value: Any) -> bool:
    return type(value) is int and value >= 0  # not a bool: `true` is no step


def record_problem(record: dict[str, Any], slot: int) -> str | None:
    """Why the commit record of `slot` cannot be believed (None: its fields are what `write` records): a step,
    size or world that is not a whole number (`true` is not one), a CRC-32 that is not 8 hex digits, another
    slot's number, an identity field of another type."""
    for key in ("step", "bytes", "restart", "world_size", "rank"):
        if not _whole(record.get(key)):
            return f"its {key} is {record.get(key)!r}, not a whole number"
    if record.get("slot") != slot or type(record.get("slot")) is not int:
        return f"it names slot {record.get('slot')!r}"
    if not (isinstance(record.get("crc32"), str) and _CRC.fullmatch(record["crc32"])):
        return f"its crc32 is {record.get('crc32')!r}, not 8 hex digits"
    for key in ("job", "run", "config"):
        if not isinstance(record.get(key), str):
            return f"its {key} is {record.get(key)!r}, not a string"
    share = record.get("share", {})
    if not (isinstance(share, dict) and set(share) <= set(SHARE_KEYS) and all(type(v) is bool for v in share.values())):
        return f"its share is {share!r}, not {{{', '.join(SHARE_KEYS)}: true or false}}"
    return None


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
    """Remove this node's snapshots of `job` (of one run, or of every run of the job, and the job's watchdog
    board: mgpu.stop.heartbeat_board.node_local_dir): the paths removed."""
    root = base or base_dir()
    return _remove(root, job_dir(job, run, root).name if run is not None else f"mgpu-{safe_name(job)}-*")


def remove_run(run: str, base: Path | None = None) -> list[Path]:
    """Remove this node's snapshots of `run`, whichever job took them (a run restarted with snapshots off)."""
    return _remove(base or base_dir(), f"mgpu-*-{safe_name(run)}")


def _remove(root: Path, pattern: str) -> list[Path]:
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

    def _record(self, slot: int) -> tuple[dict[str, Any] | None, str | None]:
        """(a slot's commit record, None where it has none or it cannot be believed; why it cannot be believed)."""
        path = self._record_path(slot)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None, None
        except OSError as error:
            return None, f"an unreadable commit record ({error.strerror or error})"
        try:
            record = json.loads(text)
        except ValueError:
            return None, "an unreadable commit record (not JSON)"
        if not isinstance(record, dict):
            return None, "an unreadable commit record (not an object)"
        problem = record_problem(record, slot)
        return (None, f"a commit record not to believe: {problem}") if problem else (record, None)

    def _age(self, slot: int) -> int:
        """A slot's step, for choosing the one to overwrite: -1 if empty or unreadable, -2 if another identity's."""
        record, _ = self._record(slot)
        if record is None:
            return -1
        if self._stale(record) is not None:
            return -2
        return int(record["step"])

    def for_peer(self, rank: int) -> "SnapshotStore":
        """The store of another rank of this job (on this node: its files are here), seen with its own identity."""
        return SnapshotStore(self.directory.parent / f"rank{rank}", replace(self.identity, rank=rank))

    def write(self, step: int, dump: Callable[[Any], object], share: dict[str, bool] | None = None) -> Snapshot:
        """`dump(file)` into the slot not holding the newest snapshot, then its commit record (atomically). The
        other slot stays whole whatever happens meanwhile. `share`: who else may resume from it (SHARE_KEYS)."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        slot = self.next_slot()
        with contextlib.suppress(FileNotFoundError):
            self._record_path(slot).unlink()  # from here the slot is uncommitted: a torn copy is never believed
        data = self._data_path(slot)
        with os.fdopen(os.open(data, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as file:  # over its pages, in place
            checksumming = _Checksumming(file)
            dump(checksumming)
            checksumming.flush()
            size = file.tell()
            file.truncate(size)
        record = {**asdict(self.identity), "step": step, "slot": slot, "crc32": checksumming.digest,
                  "bytes": size, **({"share": share} if share else {})}
        tmp = self._record_path(slot).with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self._record_path(slot))  # the commit: last
        return Snapshot(step, slot, data, checksumming.digest)

    def next_slot(self) -> int:
        """The slot the next write goes into: never the one holding this identity's newest snapshot."""
        return min(range(SLOTS), key=self._age)

    def slot_bytes(self, slot: int) -> int:
        """The size of a slot's file now (0: none): what writing into it reuses."""
        try:
            return self._data_path(slot).stat().st_size
        except OSError:
            return 0

    def committed(self) -> list[tuple[Snapshot, str | None]]:
        """Every committed slot, newest first, each with why it cannot be restored (None: it can): another job,
        run, config, world size, rank or state structure (stale), or a file whose size or digest is not the
        record's (torn). A slot whose commit record cannot be believed is not among them (see `refusals`)."""
        found = []
        for slot in range(SLOTS):
            record, _ = self._record(slot)
            if record is None:
                continue
            snapshot = Snapshot(record["step"], slot, self._data_path(slot), record["crc32"])
            found.append((snapshot, self._stale(record) or self._torn(record, snapshot)))
        return sorted(found, key=lambda item: -item[0].step)

    def _stale(self, record: dict[str, Any]) -> str | None:
        for key, mine in asdict(self.identity).items():
            if record.get(key) != mine or type(record.get(key)) is not type(mine):
                return f"stale: taken with {key}={record.get(key)!r}, this rank has {mine!r} ({_STALE[key]})"
        return None

    def _torn(self, record: dict[str, Any], snapshot: Snapshot) -> str | None:
        try:
            size = snapshot.path.stat().st_size
            if size != record["bytes"]:
                return f"torn: its file is {size} bytes, its commit record says {record['bytes']}"
            digest = _crc32(snapshot.path)
        except OSError as error:
            return f"unreadable: {error.strerror or error}"
        return None if digest == snapshot.digest else "torn: its CRC-32 is not the commit record's"

    def restorable(self, say: Callable[[str], object] | None = None) -> list[int]:
        """The steps this rank can restore, newest first; `say(line)` for every other slot with a commit record
        (one line each: which slot, its step, why it is refused)."""
        if say is not None:
            for slot in range(SLOTS):
                _, problem = self._record(slot)
                if problem is not None:
                    say(f"{self._data_path(slot)}: not restored: {problem}")
        steps = []
        for snapshot, refusal in self.committed():
            if refusal is None:
                steps.append(snapshot.step)
            elif say is not None:
                say(f"{snapshot.path} (step {snapshot.step}): not restored: {refusal}")
        return steps

    def shared_steps(self, rank0: bool) -> list[int]:
        """The restorable steps another rank may resume from (their commit record's `share`: any rank's content;
        with `rank0`, rank 0's buffers too), newest first."""
        steps = []
        for snapshot, refusal in self.committed():
            record = read_record(snapshot.path.with_suffix(".json")) or {}
            share = record.get("share") or {}
            if refusal is None and share.get("any_rank") and (share.get("rank0_buffers") or not rank0):
                steps.append(snapshot.step)
        return steps

    def valid_steps(self) -> list[int]:
        """The steps this rank can restore, newest first."""
        return self.restorable()

    def read(self, step: int, load: Callable[[IO[bytes]], Any]) -> Any:
        """`load(file)` of the valid snapshot of `step`, read once into memory and checked there (its size and
        CRC-32 against its commit record); FileNotFoundError where no slot holds it whole."""
        for slot in range(SLOTS):
            record, _ = self._record(slot)
            if record is None or record["step"] != step or self._stale(record) is not None:
                continue
            try:
                content = self._data_path(slot).read_bytes()
            except OSError:
                continue
            if len(content) == record["bytes"] and f"{crc32(content):08x}" == record["crc32"]:
                return load(io.BytesIO(content))
        raise FileNotFoundError(f"{self.directory}: no valid snapshot of step {step}")

    def set_aside(self, step: int, why: str) -> Path | None:
        """Take the snapshot of `step` out of use, kept for a look until the job's snapshots are removed: its slot
        renamed `set-aside-step<S>.pt`, its commit record (with `why`) `set-aside-step<S>.json` (the room check
        counts them). Its new path; None where no slot holds it."""
        for slot in range(SLOTS):
            record, _ = self._record(slot)
            if record is None or record["step"] != step or self._stale(record) is not None:
                continue
            kept = self.directory / f"{SET_ASIDE}{step}.pt"
            note = kept.with_suffix(".json")
            note.write_text(json.dumps({**record, "set_aside": why}))
            with contextlib.suppress(FileNotFoundError):
                self._record_path(slot).unlink()  # uncommitted first: never restored again
            try:
                os.replace(self._data_path(slot), kept)
            except FileNotFoundError:
                return None
            return kept
        return None

    def discard_after(self, step: int) -> None:
        """Uncommit the slots of steps after `step` (another attempt's, the run resumed before them): the next
        writes then overwrite the older slot, as they should, and a restore never goes back to them."""
        for slot in range(SLOTS):
            record, _ = self._record(slot)
            if record is not None and record["step"] > step:
                with contextlib.suppress(FileNotFoundError):
                    self._record_path(slot).unlink()

    def remove(self) -> None:
        """This rank's snapshots, and the job directory once no rank's is left."""
        shutil.rmtree(self.directory, ignore_errors=True)
        with contextlib.suppress(OSError):  # another rank's is still there
            self.directory.parent.rmdir()


def main(argv: list[str] | None = None) -> int:
    """`python -m mgpu.state.memory.store --remove-job JOB` (or `--remove-this-job`, the job of the Slurm task it
    runs in): this node's snapshots of the job (and its watchdog board), removed, in one line naming the node (the
    batch script's teardown, and mgpu.run.recovery before a requeue: one task per node, when the job ends without
    its ranks' own cleanup)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mgpu.state.memory.store", description=main.__doc__)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--remove-job", metavar="JOB", help="the Slurm job id (an array task's: JOB_TASK)")
    which.add_argument("--remove-this-job", action="store_true", help="the job in SLURM_JOB_ID (and its array task)")
    args = parser.parse_args(argv)
    if args.remove_this_job:
        from mgpu.cluster.environment import SlurmEnvironment

        if "SLURM_JOB_ID" not in os.environ:
            parser.error("--remove-this-job outside a Slurm job (no SLURM_JOB_ID): name it with --remove-job")
        args.remove_job = SlurmEnvironment.job_id(os.environ)
    import socket

    removed = remove_job(args.remove_job)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(f"mgpu.state.memory.store: {node}: " + (f"removed {', '.join(map(str, removed))}" if removed else
                                                     f"nothing of job {args.remove_job} in {base_dir()}"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
