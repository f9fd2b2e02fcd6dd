"""How long the next checkpoint save, and a resume, may take: from every save and resume the run measured or
tried so far, across requeues.

A save's time is its size over the filesystem's write rate. A fixed allowance fails a run whose state outgrew
it (50 GB at a loaded filesystem's 85 MB/s is 10 minutes: past a 600 s watchdog allowance, and the stop's
checkpoint is lost), and a deadline stop that knows only this process's saves assumes 0 s after every requeue.
So the attempts recorded beside the ledger (mgpu.record.save_record: the same small file on every rank, however long
the ledger is; the ledger's tail for a run from before it) are read back at a run's start, and give:

- `expected_save_s`: the newest checkpoint's size at the slowest write rate of the last RECENT saves, per
  writing rank (a resume on fewer ranks writes more bytes per rank, assumed to take longer; on more ranks,
  assumed no faster: the filesystem's total rate may be the limit), leaving out a save absurdly slower than
  the others (OUTLIER x below their median rate: one timed across a suspended job); and at least as long as
  any save that failed or was killed since the last one that succeeded ran before it ended (a state whose
  first save does not fit gets SAFETY x longer at the next try, not the same allowance at every requeue);
- `save_allowance_s`: the watchdog's allowance for one save, SAFETY x that, never below the configured
  `watchdog.checkpoint_s`; the collective timeout follows from it (mgpu.stop.watchdog.collective_timeout);
- `resume_allowance_s`: the watchdog's allowance for finding, hashing and loading a checkpoint, SAFETY x the
  expected resume, never below `watchdog.first_step_s`: the newest checkpoint's size at the read rate of the
  last resumes, or, before any was measured, its bytes per rank read READ_PASSES times (a single file: hashed,
  then loaded; a sharded one once) at the slower of the saves' write rate and SLOWEST_READ_BYTES_S; at least as
  long as a resume killed since the last one that succeeded ran;
- `peer_wait_s`: how long the ranks of a sharded save wait for each other (its own group's timeout): a share
  of that allowance, so that a late rank ends the save, named (mgpu.state.sharded.arrivals), before the watchdog.

Every time is capped at MAX_ALLOWANCE_S (a day): no figure in the record can make a timeout overflow (gloo's
deadline did at 3e12 s). No torch at import; pure functions but `saves_in_ledger` and `allowances`, which read.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from mgpu.record.save_record import Attempt, read_attempts, record_path

__all__ = ["MAX_ALLOWANCE_S", "OUTLIER", "PEER_WAIT_SHARE", "READ_PASSES", "RECENT", "SAFETY", "SLOWEST_READ_BYTES_S",
           "TAIL_BYTES", "Allowances", "Save", "allowances", "expected_resume_s", "expected_save_s", "last_sign_of_life",
           "lower_bounds", "measured", "newest_checkpoint",
           "parse_saves", "peer_wait_s", "save_allowance_s", "saves_in_ledger"]

RECENT = 5
"""Saves whose write rate counts (the slowest of them): a filesystem's load changes over hours."""
SAFETY = 3.0
"""The allowance over the expected time: a write may be this much slower than the slowest one seen."""
PEER_WAIT_SHARE = 0.5
"""A sharded save's ranks wait this share of the save's allowance for each other (a write's skew, not a write)."""
TAIL_BYTES = 4 << 20
"""How much of the ledger's end is read: for a run without a side record, its saves; for an attempt killed
without a word, its process's last event."""
OUTLIER = 10.0
"""A save whose rate is this many times below the median of the recent ones is left out (timed across a
suspended job, a stalled mount): one such figure would otherwise set every allowance."""
MAX_ALLOWANCE_S = 86_400.0
"""The cap on every expected time and allowance (a day): far past any real save, far below any overflow."""
READ_PASSES = 2
"""Reads of a single-file checkpoint per resume, for its first allowance (hashed, then loaded): the same bytes at
the write rate of its saves, until a resume's read rate is measured. A sharded one is read once (its chunks checked
as the load reads them: mgpu.state.sharded.verify)."""
SLOWEST_READ_BYTES_S = 50e6
"""The slowest read rate a first resume is allowed for (50 MB/s: a loaded network filesystem's share per client,
below the 85 MB/s of a loaded filesystem's writes above): before any resume was measured, the checkpoint's bytes
per rank at this rate, per read pass, whatever the saves' write rate (a save measured on a quiet filesystem, or
none measured at all: a run directory copied, a record lost), never only `watchdog.first_step_s`."""


@dataclass(frozen=True)
class Save:
    """One measured checkpoint write."""

    seconds: float
    bytes: int
    writers: int
    """Ranks that wrote it: the world size of a sharded save, 1 for rank 0's single file."""
    sharded: bool


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def parse_saves(events: Iterable[Mapping[str, Any]]) -> list[Save]:
    """The `checkpoint_saved` events with a positive time and size, oldest first; anything else is skipped."""
    saves = []
    for event in events:
        if event.get("event") != "checkpoint_saved":
            continue
        seconds, size = _number(event.get("seconds")), _number(event.get("bytes"))
        if seconds is None or size is None:
            continue
        sharded = event.get("sharded") is True
        world = event.get("world_size")
        writers = world if sharded and isinstance(world, int) and not isinstance(world, bool) and world > 0 else 1
        saves.append(Save(seconds, int(size), writers, sharded))
    return saves


def saves_in_ledger(path: Path, tail_bytes: int = TAIL_BYTES) -> list[Save]:
    """The saves recorded in the last `tail_bytes` of the ledger at `path` (none: no ledger, or unreadable)."""
    try:
        with open(path, "rb") as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(max(0, size - tail_bytes))
            raw = file.read(tail_bytes)
    except OSError:
        return []
    events = []
    for line in raw.decode("utf-8", errors="replace").splitlines():
        if '"checkpoint_saved"' not in line:  # most lines are progress events: not parsed
            continue
        try:
            event = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue  # the tail's cut first line, a torn last one
        if isinstance(event, dict):
            events.append(event)
    return parse_saves(events)




def _rate_bound(samples: Sequence[Save], size: int, writers_of: Callable[[Save], int]) -> float:
    """Seconds for `size` bytes at the slowest per-rank rate of `samples`, the absurdly slow ones left out.
    `writers_of(sample)`: how many ranks would share the work now."""
    rates = [s.bytes / s.writers / s.seconds for s in samples]
    typical = statistics.median(rates)
    expected = 0.0
    for sample, rate in zip(samples, rates):
        if rate * OUTLIER < typical:
            continue
        per_rank_bytes = size / min(writers_of(sample), sample.writers)  # more ranks: assumed no faster
        expected = max(expected, per_rank_bytes / rate)
    return expected


def expected_save_s(saves: Sequence[Save], world: int, at_least: float = 0.0) -> float | None:
    """Seconds the next save on `world` ranks should take: the newest save's size at the slowest rate per
    writing rank of the last RECENT saves, the outliers left out, and at least `at_least` (what a failed or
    killed save since ran: `lower_bounds`); capped at MAX_ALLOWANCE_S (None: nothing measured or tried yet)."""
    recent = saves[-RECENT:]
    if not recent:
        return min(at_least, MAX_ALLOWANCE_S) if at_least > 0 else None
    expected = _rate_bound(recent, recent[-1].bytes, lambda save: world if save.sharded else 1)
    return min(max(expected, at_least), MAX_ALLOWANCE_S)


def expected_resume_s(resumes: Sequence[Save], saves: Sequence[Save], world: int, at_least: float = 0.0,
                      checkpoint: Save | None = None) -> float | None:
    """Seconds a resume on `world` ranks should take to find, hash and load the newest checkpoint (`checkpoint`, as
    found on disk: its bytes, format and writers; else the newest of `saves`): its size at the slowest read rate of
    the last RECENT `resumes` (the outliers left out), or before any, its read passes (READ_PASSES, a sharded one's
    1) at the slower of the saves' write rate and SLOWEST_READ_BYTES_S, per rank; at least `at_least`; capped
    (None: nothing known)."""
    recent = resumes[-RECENT:]
    newest = checkpoint or (saves[-1] if saves else None)
    expected: float | None = None
    if recent and newest is not None:
        expected = _rate_bound(recent, newest.bytes, lambda resume: world if resume.sharded else 1)
    elif newest is not None:
        passes = 1 if newest.sharded else READ_PASSES
        per_rank = newest.bytes / (min(world, newest.writers) if newest.sharded else 1)
        expected = passes * max(expected_save_s(saves, world) or 0.0, per_rank / SLOWEST_READ_BYTES_S)
    if expected is None and at_least <= 0:
        return None
    return min(max(expected or 0.0, at_least), MAX_ALLOWANCE_S)


def newest_checkpoint(checkpoints: Path | None) -> Save | None:
    """The checkpoint a resume would read first, as its `meta.json` describes it (the `latest` pointer's: its bytes,
    whether sharded, its writers; `seconds` 0), or None where there is none or it cannot be read. Never raises."""
    if checkpoints is None:
        return None
    try:
        name = (checkpoints / "latest").read_text().strip()
        meta = json.loads((checkpoints / name / "meta.json").read_text())
        size, sharded = _number(meta.get("bytes")), meta.get("kind") == "sharded"
        world = meta.get("world_size")
        writers = world if sharded and isinstance(world, int) and not isinstance(world, bool) and world > 0 else 1
        return Save(0.0, int(size), writers, sharded) if size is not None and "/" not in name else None
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def save_allowance_s(expected_s: float | None, configured_s: float) -> float:
    """The watchdog's allowance for one save: SAFETY x the expected time, at least `configured_s`, capped."""
    return configured_s if expected_s is None else min(max(configured_s, SAFETY * expected_s),
                                                      max(configured_s, MAX_ALLOWANCE_S))


def peer_wait_s(allowance_s: float) -> float:
    """How long the ranks of a sharded save wait for each other: PEER_WAIT_SHARE of the save's allowance."""
    return PEER_WAIT_SHARE * allowance_s


def measured(attempts: Sequence[Attempt], kind: str) -> list[Save]:
    """The attempts of `kind` that ended well with a time and a size, as Saves, oldest first."""
    done = "saved" if kind == "save" else "resumed"
    return [Save(a.seconds, a.bytes, a.writers, a.sharded) for a in attempts
            if a.kind == kind and a.outcome == done and a.seconds is not None and a.bytes is not None]


AliveUntil = Callable[[Attempt], "float | None"]
"""When an attempt's process was last seen alive after the attempt began (None: unknown)."""


def _unknown(attempt: Attempt) -> float | None:
    return None


def lower_bounds(attempts: Sequence[Attempt], kind: str, world: int, alive_until: AliveUntil = _unknown) -> float:
    """The longest time a save or resume of `kind` ran before it failed or was killed, since the last one that
    ended well, scaled to `world` ranks as `expected_save_s` scales a rate (0: none). An attempt still open (its
    process ended without a word) ran at least until `alive_until(attempt)` (its process's last sign of life;
    None: unknown) or the next attempt's start, whichever is earlier."""
    done = "saved" if kind == "save" else "resumed"
    mine = [a for a in attempts if a.kind == kind]
    last_good = max((i for i, a in enumerate(mine) if a.outcome == done), default=-1)
    later_starts = sorted(a.started for a in attempts)
    longest = 0.0
    for attempt in mine[last_good + 1:]:
        seconds = attempt.seconds
        if attempt.outcome == "open":
            alive = alive_until(attempt)
            following = next((t for t in later_starts if t > attempt.started), None)
            end = min((t for t in (alive, following) if t is not None), default=None)
            seconds = None if end is None else end - attempt.started
        if seconds is None or not math.isfinite(seconds) or seconds <= 0:
            continue
        writers_now = world if attempt.sharded else 1
        longest = max(longest, seconds * attempt.writers / min(writers_now, attempt.writers))
    return min(longest, MAX_ALLOWANCE_S)


def last_sign_of_life(ledger: Path, tail_bytes: int = TAIL_BYTES) -> AliveUntil:
    """A function: the time of the last event in the ledger's tail written by an attempt's process (its job
    and restart) after the attempt started (None: none)."""
    latest: dict[tuple[str, int], list[float]] = {}
    try:
        with open(ledger, "rb") as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(max(0, size - tail_bytes))
            raw = file.read(tail_bytes)
    except OSError:
        raw = b""
    for line in raw.decode("utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        when = event.get("time") if isinstance(event, dict) else None
        if isinstance(when, (int, float)) and not isinstance(when, bool) and math.isfinite(when):
            latest.setdefault((str(event.get("job_id", "")), event.get("restart", 0)), []).append(float(when))

    def alive_until(attempt: Attempt) -> float | None:
        return max((t for t in latest.get((attempt.job, attempt.restart), ()) if t > attempt.started), default=None)

    return alive_until


@dataclass(frozen=True)
class Allowances:
    """What a run's start derives from the attempts so far (see the module's docstring)."""

    expected_save_s: float | None
    save_allowance_s: float
    resume_allowance_s: float


def allowances(ledger: Path, world: int, checkpoint_s: float, first_step_s: float,
               checkpoints: Path | None = None) -> Allowances:
    """The allowances of a run starting on `world` ranks, from the side record beside `ledger` (or, for a run
    from before it, the saves in the ledger's tail) and the newest checkpoint in `checkpoints` (its size, for a
    first resume); `checkpoint_s`, `first_step_s`: the configured floors."""
    attempts = read_attempts(record_path(ledger))
    if attempts is None:
        saves, resumes, save_floor, resume_floor = saves_in_ledger(ledger), [], 0.0, 0.0
    else:
        saves, resumes = measured(attempts, "save"), measured(attempts, "resume")
        alive = last_sign_of_life(ledger) if any(a.outcome == "open" for a in attempts) else _unknown
        save_floor = lower_bounds(attempts, "save", world, alive)
        resume_floor = lower_bounds(attempts, "resume", world, alive)
    expected_save = expected_save_s(saves, world, save_floor)
    resume = expected_resume_s(resumes, saves, world, resume_floor, newest_checkpoint(checkpoints))
    return Allowances(expected_save, save_allowance_s(expected_save, checkpoint_s),
                      save_allowance_s(resume, first_step_s))
