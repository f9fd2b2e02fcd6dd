"""How long the next checkpoint save may take, from the saves the run measured so far, across requeues.

A save's time is its size over the filesystem's write rate. A fixed allowance fails a run whose state outgrew
it (50 GB at a loaded filesystem's 85 MB/s is 10 minutes: past a 600 s watchdog allowance, and the stop's
checkpoint is lost), and a deadline stop that knows only this process's saves assumes 0 s after every requeue.
So the ledger's `checkpoint_saved` events (seconds, bytes, and for a sharded save the ranks that wrote it) are
read back at a run's start, from the ledger's tail (bounded; the same file on every rank, so every rank derives
the same allowance), and give:

- `expected_save_s`: the newest checkpoint's size at the slowest write rate of the last RECENT saves, per
  writing rank: a resume on fewer ranks writes more bytes per rank (assumed to take longer), on more ranks
  is assumed no faster (the filesystem's total rate may be the limit);
- `save_allowance_s`: the watchdog's allowance for one save, SAFETY x that, never below the configured
  `watchdog.checkpoint_s`; the collective timeout follows from it (mgpu.watchdog.collective_timeout);
- `peer_wait_s`: how long the ranks of a sharded save wait for each other (its own group's timeout): a share
  of that allowance, so that a late rank ends the save, named (mgpu.shard_arrivals), before the watchdog.

No torch at import; pure functions but `saves_in_ledger`, which reads the file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = ["PEER_WAIT_SHARE", "RECENT", "SAFETY", "TAIL_BYTES", "Save", "expected_save_s", "parse_saves",
           "peer_wait_s", "save_allowance_s", "saves_in_ledger"]

RECENT = 5
"""Saves whose write rate counts (the slowest of them): a filesystem's load changes over hours."""
SAFETY = 3.0
"""The allowance over the expected time: a write may be this much slower than the slowest one seen."""
PEER_WAIT_SHARE = 0.5
"""A sharded save's ranks wait this share of the save's allowance for each other (a write's skew, not a write)."""
TAIL_BYTES = 4 << 20
"""How much of the ledger's end is read for its saves (thousands of events: the last saves are near the end)."""


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


def expected_save_s(saves: list[Save], world: int) -> float | None:
    """Seconds the next save on `world` ranks should take: the newest save's size at the slowest rate per
    writing rank of the last RECENT saves (None: nothing measured yet)."""
    recent = saves[-RECENT:]
    if not recent:
        return None
    newest = recent[-1]
    expected = 0.0
    for save in recent:
        writers_now = world if save.sharded else 1
        # bytes per second per writing rank, at that save; this save's bytes per rank now
        per_rank_rate = save.bytes / save.writers / save.seconds
        per_rank_bytes = newest.bytes / min(writers_now, save.writers)  # more ranks: assumed no faster
        expected = max(expected, per_rank_bytes / per_rank_rate)
    return expected


def save_allowance_s(expected_s: float | None, configured_s: float) -> float:
    """The watchdog's allowance for one save: SAFETY x the expected time, at least `configured_s`."""
    return configured_s if expected_s is None else max(configured_s, SAFETY * expected_s)


def peer_wait_s(allowance_s: float) -> float:
    """How long the ranks of a sharded save wait for each other: PEER_WAIT_SHARE of the save's allowance."""
    return PEER_WAIT_SHARE * allowance_s
