"""The run ledger: `events.jsonl`, one JSON object per line, appended by rank 0.

Every event has `time` (unix seconds), `event` and the job's `job_id` and `restart`; the rest
depends on the event. Tools (jobs/status.py, the tests) read it back with `read_ledger`.

    started          world_size, nodes, launcher, device, backend, run_dir, config_path, git_sha, limits
                     (max_requeues, max_failures: the job's requeue limits as the ranks read them)
    resumed          step, epoch, position, from (checkpoint path), skipped (rejected newer checkpoints)
    first_step       step (the first step this run completed), collective_timeout_s, timings (rank 0's Unix
                     times: process start, session start, group formed, checkpoint find/loaded/restored,
                     first batch, first step done: the way back to training, measured)
    progress         step, epoch, total_steps, metrics (the log line's: loss, lr, grad_norm, samples_per_s,
                     step_time_s), fingerprint (hex float: a weighted sum of every parameter; equal
                     weights give equal fingerprints); written at every log interval (log.every_steps)
    checkpoint_saved step, seconds, bytes, path, reason ("periodic" | "epoch" | "preemption" | "final" | "best")
    checkpoint_failed step, reason, error (one line naming the errno and the path), errno; training goes on
                     and the next due save tries again (a stop's save that fails ends the run: `failed`)
    preempted        step, reasons (mgpu.preemption.REASONS agreed by all ranks), signals and signal_times
                     (seen by rank 0)
    stop_decision    step, what (mgpu.requeue's event: preempted, time_limit, cancelled, ...), requeue, reason
    requeued         step, how ("self" | "slurm"), message
    evaluated        step, metrics
    early_stopped    step, metric, best
    finished         step, epoch, seconds
    failed           step, error, retry (false: bad input or a full disk, a requeue would fail the same way)
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from mgpu.errors import MgpuError
from mgpu.fsutil import read_bounded

__all__ = ["MAX_LEDGER_BYTES", "Ledger", "read_ledger"]

MAX_LEDGER_BYTES = 256 << 20  # a few hundred bytes an event: a million events

log = logging.getLogger("mgpu.ledger")


class Ledger:
    """Append-only event log; a no-op on ranks other than 0."""

    def __init__(self, path: Path | None, job_id: str = "", restart: int = 0) -> None:
        self.path = path
        self.context = {"job_id": job_id, "restart": restart}
        self._warned = False
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        record = {"time": round(time.time(), 3), "event": event, **self.context, **fields}
        line = json.dumps(record, default=str) + "\n"
        # One write of one line in append mode: concurrent runs never interleave within a line, and the
        # fsync makes a "checkpoint_saved" line as durable as the checkpoint it announces.
        try:
            with open(self.path, "a", encoding="utf-8") as file:
                file.write(line)
                file.flush()
                os.fsync(file.fileno())
        except OSError as error:
            # A full or failing disk must not stop training (the checkpoint path reports it); say it once.
            if not self._warned:
                self._warned = True
                log.warning("ledger %s: cannot append (%s); events are lost until it can", self.path, error.strerror)


def _well_formed(event: Any) -> bool:
    """An object with a finite numeric `time` and a string `event`: what every reader may rely on."""
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return False
    when = event.get("time")
    return isinstance(when, (int, float)) and not isinstance(when, bool) and math.isfinite(when)


def read_ledger(path: Path, skipped: list[int] | None = None) -> list[dict[str, Any]]:
    """The well-formed events of a ledger, oldest first; a missing ledger has none.

    Anything else is left out: a torn last line (a killed writer), and lines that are not JSON objects
    with a finite numeric `time` and a string `event` (their 1-based numbers are appended to `skipped`).
    MgpuError in one line when the file exists but cannot be read (a directory, no permission).
    """
    try:
        raw, _ = read_bounded(path, MAX_LEDGER_BYTES)
    except FileNotFoundError:
        return []
    except OSError as error:
        raise MgpuError(f"{path}: cannot read the ledger: {error.strerror or error}") from None
    if len(raw) > MAX_LEDGER_BYTES:
        raise MgpuError(f"{path}: larger than {MAX_LEDGER_BYTES >> 20} MiB, no ledger of a run; is it the right file?")
    text = raw.decode("utf-8", errors="replace")
    events = []
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        try:
            event = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            event = None
        if _well_formed(event):
            events.append(event)
        elif skipped is not None and line.strip() and not (number == len(lines) and not text.endswith("\n")):
            skipped.append(number)
    return events
