"""Who is hung, and how it is said: mgpu.stop.watchdog finds that a rank made no progress and reads every rank's
heartbeat; this module judges what it read and writes the verdict. What a heartbeat says (`Heartbeat`); the ranks
that hold the others up (`blame`: frozen ones, else those behind the rest in PHASES' order, a rank waiting in a
collective only if nobody is further behind); the ranks with no sign of life since the hang was found, each by its
own clock (`still_silent`: no two machines' clocks are compared); the ledger's `hang` event, written by the first
rank to claim `.hang-<job>-<restart>` (`report_hang`: the stuck ranks and their hosts, every rank's last step and
phase).

No thread, no board, no clock of its own: the watchdog decides when to look and for how long (its allowance, the
second look scaled by the machine's load), and its `on_hang` (mgpu.run.runner) calls `report_hang` on one
of the watchdog's bounded helpers.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["PHASES", "WAITING_PHASES", "Heartbeat", "blame", "report_hang", "still_silent"]

log = logging.getLogger("mgpu.train")
PHASES = ("start", "resume", "data", "forward", "model", "backward", "optimizer", "eval", "agree", "checkpoint", "write",
          "checkpoint-wait")
"""A step's phases in order: a rank in an earlier phase of the same step is behind the others. `forward` is
the task's loss, `model` the DDP forward inside it (whose buffer broadcast waits for every rank), so a
rank stuck in its own code before the model is behind those waiting in DDP; `agree` (an evaluation's stop
agreement) waits for the others; rank 0 `write`s a checkpoint while the others wait (`checkpoint-wait`); `resume`:
finding, hashing and loading the checkpoint a run resumes from."""
WAITING_PHASES = ("model", "agree", "checkpoint-wait")
"""Phases in which a rank waits for the others in a collective."""


@dataclass(frozen=True)
class Heartbeat:
    """What a rank's heartbeat file says."""

    rank: int
    host: str
    pid: int
    step: int
    """Optimizer steps this rank completed."""
    phase: str
    since: float
    """Wall time of this rank's last beat (its last progress)."""
    written: float
    """Wall time the watchdog thread wrote the file (it stops changing when the process is frozen)."""
    stacks: bool = False
    """This rank's stacks are in its log (for this hang)."""
    load: float = 0.0
    """Its machine's load average per CPU when it was written (how slow a live publisher may be there)."""


def blame(beats: Sequence[Heartbeat], fresh_after: float, world: int | None = None,
          frozen_ranks: Sequence[int] | None = None) -> list[int]:
    """The ranks that hold the others up: frozen ones (a file not rewritten since `fresh_after`, or none at
    all; `frozen_ranks`, when given, is the verdict of the second look instead of the clocks), else those
    behind the rest."""
    seen = {b.rank for b in beats}
    frozen = set(frozen_ranks) if frozen_ranks is not None else {b.rank for b in beats if b.written < fresh_after}
    frozen |= {rank for rank in range(world or 0) if rank not in seen}  # the second look counts these already
    if frozen:
        return sorted(frozen)
    if not beats:
        return []
    order = {phase: i for i, phase in enumerate(PHASES)}
    position = {b.rank: (b.step, order.get(b.phase, 0)) for b in beats}
    furthest, least = max(position.values()), min(position.values())
    phase = {b.rank: b.phase for b in beats}
    # A rank waiting in a collective may look behind: gloo's broadcast (DDP's forward) ends on some ranks before
    # others (seen at 8 ranks: one rank still in `model` beside the culprit in its loss). Such a rank is to
    # blame only if nobody is further behind than it.
    behind = [rank for rank, where in position.items()
              if where < furthest and (where == least or phase[rank] not in WAITING_PHASES)]
    return sorted(behind)


def still_silent(first: Mapping[int, float], beats: Sequence[Heartbeat], world: int, detected: float) -> list[int]:
    """The ranks that showed no sign of life since the hang was found: none at all, or a heartbeat written before
    `detected` (this machine's clock) and unchanged since `first` (the rank's own clock: a rank whose clock is
    behind this one's is alive once its heartbeat changes)."""
    now = {b.rank: b for b in beats}
    silent = []
    for rank in range(world):
        beat = now.get(rank)
        if beat is None:
            silent.append(rank)
        elif beat.written < detected and (rank not in first or beat.written == first[rank]):
            silent.append(rank)
    return silent


def report_hang(run: Any, job_id: str, restart: int, rank: int, beats: Sequence[Heartbeat], stuck: list[int],
                waited: float, allowance: float, detected: float) -> bool:
    """Write the `hang` event (the first rank to claim `.hang-<job>-<restart>` does); True if this rank did.

    `run` is the mgpu.record.rundir.RunDir. The event: the stuck ranks and their hosts (all ranks' hosts when none
    can be blamed), the last step every rank completed, each rank's phase, who saw it and after how long."""
    from mgpu.record.ledger import Ledger

    try:
        fd = os.open(run.path / f".hang-{job_id}-{restart}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return False
    os.close(fd)
    by_rank = {b.rank: b for b in beats}
    hosts = sorted({by_rank[r].host if r in by_rank else _recorded_host(run, r) for r in stuck} - {None})  # type: ignore[type-var]  # None is taken out
    frozen = [r for r in stuck if r not in by_rank or by_rank[r].written < detected]
    live = [b for b in beats if b.rank not in frozen] or list(beats)  # a frozen rank's file is out of date
    completed = min((b.step - 1 for b in live), default=None)  # a beat's step is the one in progress
    Ledger(run.ledger, job_id, restart).write(
        "hang", ranks=stuck, hosts=hosts, step=completed, phases={str(b.rank): b.phase for b in beats},
        steps={str(b.rank): b.step for b in beats}, frozen=frozen,
        missing=[r for r in stuck if r not in by_rank], detected_by=rank,
        waited_s=round(waited, 1), allowance_s=round(allowance, 1))
    log.error("hung: rank(s) %s on %s hold the others up (phases %s)", stuck or "none identified", hosts or "?",
              {b.rank: f"{b.phase}@{b.step}" for b in beats})
    return True


def _recorded_host(run: Any, rank: int) -> str | None:
    """The host a rank recorded at its start (logs/rank<N>.json), for a rank without a heartbeat."""
    try:
        return str(json.loads(run.rank_record(rank).read_text())["hostname"])
    except (OSError, ValueError, KeyError):
        return None
