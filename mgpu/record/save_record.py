"""The run's save and resume attempts, kept beside the ledger (`saves.json`), however long the ledger grows.

A save's or a resume's allowance is learned from the ones before it (mgpu.state.save_budget). The ledger alone is not
enough: its events are found only by reading it (a long run has hundreds of thousands of progress lines), and
a save the watchdog or Slurm killed writes no `checkpoint_saved`. So rank 0 writes each attempt here when it
starts (`open_attempt`: a save at its first beat, a resume before it looks for a checkpoint), and the ledger
closes it (`note_event`, called by mgpu.record.ledger.Ledger.write) when its event is written:

    checkpoint_saved   the save's seconds and bytes (and its writing ranks, for a sharded one): "saved"
    checkpoint_failed  the time since it started: "failed" (a lower bound for the next save)
    hang               in a checkpoint phase (a save) or `resume`: the time since it started, "killed"
    started            a resume that found its way back (the run's start): "resumed", with its seconds

An attempt still "open" at the next run's start was killed without a word (SIGKILL, a node lost): the last
ledger event of its process bounds how long it ran (mgpu.state.save_budget).

The file is small (the last KEEP attempts of each kind) and replaced atomically (a temporary file, fsync,
rename): a reader sees the old record or the new one, never a torn one, whichever rank or requeue writes it. No
torch at import.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

__all__ = ["KEEP", "RECORD_FILE", "Attempt", "note_event", "open_attempt", "read_attempts", "record_path",
           "saving_beat"]

RECORD_FILE = "saves.json"
KEEP = 32
"""Attempts kept per kind: many more than the estimate reads (mgpu.state.save_budget.RECENT)."""
MAX_RECORD_BYTES = 1 << 20
SAVE_PHASES = ("checkpoint", "write", "checkpoint-wait")  # mgpu.stop.watchdog.CHECKPOINT_PHASES (no import: no cycle)

_lock = threading.Lock()  # a background save's ledger event and the training thread's next attempt


@dataclass(frozen=True)
class Attempt:
    """One save or resume: when it began and, once known, how long it took and how many bytes it moved."""

    kind: str
    """"save" | "resume"."""
    started: float
    outcome: str
    """"open" (no end recorded) | "saved" | "resumed" | "failed" | "killed"."""
    seconds: float | None = None
    """Measured ("saved", "resumed"), or a lower bound ("failed", "killed")."""
    bytes: int | None = None
    """What it wrote or read (for an open or failed attempt: the newest checkpoint's size, when known)."""
    writers: int = 1
    """Ranks that wrote (a save) or read (a resume) it in parallel: the world size if sharded, else 1."""
    sharded: bool = False
    job: str = ""
    restart: int = 0


def record_path(ledger: Path) -> Path:
    """The side record of the ledger at `ledger`: beside it."""
    return ledger.with_name(RECORD_FILE)


def _positive(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def _attempt(raw: Any) -> Attempt | None:
    """An Attempt from its JSON form (None: not one; a record written by hand or by another version)."""
    if not isinstance(raw, dict) or raw.get("kind") not in ("save", "resume") or not isinstance(raw.get("outcome"), str):
        return None
    started = raw.get("started")
    if isinstance(started, bool) or not isinstance(started, (int, float)) or not math.isfinite(started):
        return None
    size = _positive(raw.get("bytes"))
    writers = raw.get("writers")
    restart = raw.get("restart")
    return Attempt(raw["kind"], float(started), raw["outcome"], _positive(raw.get("seconds")),
                   None if size is None else int(size),
                   writers if isinstance(writers, int) and not isinstance(writers, bool) and writers > 0 else 1,
                   raw.get("sharded") is True, str(raw.get("job", "")),
                   restart if isinstance(restart, int) and not isinstance(restart, bool) else 0)


def read_attempts(path: Path) -> list[Attempt] | None:
    """The attempts recorded at `path`, oldest first; None when there is no readable record (a run from before
    it existed: the ledger is read instead)."""
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_RECORD_BYTES + 1)
        data = json.loads(raw) if len(raw) <= MAX_RECORD_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("attempts"), list):
        return None
    return [a for a in map(_attempt, data["attempts"]) if a is not None]


def _write(path: Path, attempts: list[Attempt]) -> None:
    kept = [a for kind in ("save", "resume") for a in [a for a in attempts if a.kind == kind][-KEEP:]]
    kept.sort(key=lambda a: a.started)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as file:
            json.dump({"format": 1, "attempts": [asdict(a) for a in kept]}, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass


def _update(path: Path, change: Callable[[list[Attempt]], list[Attempt] | None]) -> None:
    """Read, change and atomically replace the record; never raises (it only sizes allowances: a full disk
    must not end a save or a run)."""
    try:
        with _lock:
            changed = change(read_attempts(path) or [])
            if changed is not None:
                _write(path, changed)
    except OSError:
        pass


def open_attempt(ledger: Path | None, kind: str, *, writers: int = 1, sharded: bool = False, job: str = "",
                 restart: int = 0, now: float | None = None) -> None:
    """Record that a save or resume of this process (`job`, `restart`) starts now; its size is assumed the newest
    checkpoint's (the state's size before it is gathered). A no-op without a ledger (ranks other than 0), and
    for a resume without a record (no save recorded: nothing to resume, and a new run's directory is left as
    it was until it trains)."""
    if ledger is None or (kind == "resume" and not record_path(ledger).exists()):
        return
    started = time.time() if now is None else now

    def add(attempts: list[Attempt]) -> list[Attempt]:
        size = next((a.bytes for a in reversed(attempts) if a.kind == "save" and a.outcome == "saved"), None)
        return [*attempts, Attempt(kind, started, "open", None, size, writers, sharded, job, restart)]

    _update(record_path(ledger), add)


def _close(attempts: list[Attempt], kind: str, job: str, restart: int, now: float,
           **fields: Any) -> list[Attempt] | None:
    """The newest open attempt of `kind` of the process (`job`, `restart`) closed with `fields` (None: none open)."""
    for index in range(len(attempts) - 1, -1, -1):
        attempt = attempts[index]
        if attempt.kind == kind and attempt.outcome == "open" and attempt.job == job and attempt.restart == restart:
            fields.setdefault("seconds", max(now - attempt.started, 0.0) or None)
            return [*attempts[:index], replace(attempt, **fields), *attempts[index + 1:]]
    return None


def note_event(ledger: Path, event: Mapping[str, Any]) -> None:
    """Close the attempt that the ledger event just written ends, if any (mgpu.record.ledger.Ledger.write)."""
    name, now = event.get("event"), event.get("time")
    if name not in ("checkpoint_saved", "checkpoint_failed", "hang", "started") or not isinstance(now, (int, float)):
        return
    job, counted = str(event.get("job_id", "")), event.get("restart")
    restart = counted if isinstance(counted, int) and not isinstance(counted, bool) else 0

    def close(attempts: list[Attempt]) -> list[Attempt] | None:
        if name == "checkpoint_saved":
            seconds, size = _positive(event.get("seconds")), _positive(event.get("bytes"))
            if seconds is None or size is None:
                return None
            world = event.get("world_size")
            sharded = event.get("sharded") is True
            writers = world if sharded and isinstance(world, int) and not isinstance(world, bool) and world > 0 else 1
            done = Attempt("save", now - seconds, "saved", seconds, int(size), writers, sharded, job, restart)
            # A save no session opened (a checkpointer used on its own) is recorded all the same.
            return _close(attempts, "save", job, restart, now, outcome="saved", seconds=seconds, bytes=int(size),
                          writers=writers, sharded=sharded) or [*attempts, done]
        if name == "checkpoint_failed":
            return _close(attempts, "save", job, restart, now, outcome="failed")
        if name == "started":
            return _close(attempts, "resume", job, restart, now, outcome="resumed")
        phases = event.get("phases")
        phases = set(phases.values()) if isinstance(phases, dict) else set()
        changed = attempts
        if phases & set(SAVE_PHASES):
            changed = _close(changed, "save", job, restart, now, outcome="killed") or changed
        if "resume" in phases:
            changed = _close(changed, "resume", job, restart, now, outcome="killed") or changed
        return changed if changed is not attempts else None

    _update(record_path(ledger), close)


def saving_beat(beat: Callable[..., None], ledger: Path | None, *, writers: int, sharded: bool, job: str,
                restart: int) -> Callable[..., None]:
    """`beat` (the watchdog's), recording a save's start on rank 0 (the one with a ledger) at its first beat."""
    if ledger is None:
        return beat

    def saving(phase: str, step: int | None = None) -> None:
        if phase == "checkpoint":
            open_attempt(ledger, "save", writers=writers, sharded=sharded, job=job, restart=restart)
        beat(phase, step)

    return saving
