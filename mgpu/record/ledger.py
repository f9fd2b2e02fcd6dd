"""The run ledger: `events.jsonl`, one JSON object per line, appended by rank 0 (and by the watchdog rank that
reports a hang, and the batch script's recovery). A rank other than 0 with an error of its own records it in a
file of its own (mgpu.record.failures: many nodes' concurrent appends are not atomic on NFS); readers merge them in.

Every event has `time` (unix seconds), `event` and the job's `job_id` and `restart`; the rest
depends on the event. Tools (jobs/status.py, the tests) read it back with `read_ledger`.

    started          world_size, nodes, launcher, device, backend, run_dir, config_path, git_sha, limits
                     (max_requeues, max_failures: the job's requeue limits as the ranks read them), ladder (the
                     timeout ladder at the start: hang and stop rungs [name, seconds, why], problems: the orders
                     broken, one line each; mgpu.stop.ladder)
    resumed          step, epoch, position, from (checkpoint path), skipped (rejected newer checkpoints)
    fresh_start      set_aside (where the run's earlier checkpoints were moved: an explicit `fresh` start)
    hyperparameters  step, changes ("optimizer lr: 0.001 -> 0.5"...: an explicit change on resume, applied
                     over the restored optimizer state)
    first_step       step (the first step this run completed), collective_timeout_s, checkpoint_allowance_s
                     (the watchdog's for one save: mgpu.state.save_budget), timings (rank 0's Unix
                     times: process start, session start, group formed, checkpoint find/loaded/restored,
                     first batch, first step done: the way back to training, measured), ladder (the timeout
                     ladder again, with the first step's time and the collective timeout)
    progress         step, epoch, total_steps, metrics (the log line's: loss, lr, grad_norm, samples_per_s,
                     step_time_s), fingerprint (hex float: a weighted sum of every parameter; equal
                     weights give equal fingerprints), ranks (every rank's compute and wait per step, EWMAs:
                     compute_s and wait_s [min, median, max], slowest {rank, node, factor}, nodes {node: its
                     slowest rank's factor}, stragglers; several ranks and stragglers.enabled: mgpu.record.stragglers);
                     written at every log interval (log.every_steps); a loop
                     of its own (Session.log, mgpu.record.loop_progress): step, epoch (its loader's, if any), metrics
                     (what it gave), fingerprint (of its state's models, comma-joined), no total_steps
    checkpoint_saved step, seconds, bytes, path, reason ("periodic" | "epoch" | "preemption" | "final" | "best")
                     (with `checkpoint_failed`, `hang` and `started`, also kept in the side record `saves.json`
                     beside the ledger: mgpu.record.save_record, read back for the allowances, mgpu.state.save_budget)
    checkpoint_failed step, reason, error (one line naming the errno and the path), errno; training goes on
                     and the next due save tries again (a stop's save that fails ends the run: `failed`)
    preempted        step, reasons (mgpu.stop.preemption.REASONS agreed by all ranks), signals and signal_times
                     (seen by rank 0)
    stop_decision    step, what (mgpu.cluster.requeue's event: preempted, time_limit, cancelled, ...; node_excluded: a
                     hang's node that cannot be excluded keeps the job down), requeue, reason, action ("restart" |
                     "requeued" | "none"), error, rank (mgpu.run.recovery, after a failed step); progressed; unknown
                     (what Slurm did not answer: the decision is the stop's evidence, or "unknown" and the batch
                     script's mgpu.run.recovery, or rank 0 after its session, asks again: its own has by "recovery"
                     or "rank 0"; after a failed step: the step restarts in place, which needs no answer)
    requeue_unknown  step, error, by: the requeue got no answer (mgpu.run.recovery asks again)
    requeue_refused  step, error, by: Slurm refused the requeue (e.g. a job submitted with --no-requeue)
    awaiting_slurm   step, until (Unix time), unknown, reason, by ("recovery" | "rank 0"): Slurm did not answer a
                     stop that came with its signal, so the job stays alive, idle, until Slurm answers (a
                     `stop_decision` follows) or ends it (a preemption requeues it; mgpu.run.unanswered)
    requeued         step, how ("self" | "slurm"), message, after (a failure's kind: "failure" | "no_progress" |
                     "hang"; absent after a stop)
    restarted        after ("failure" | "hang"), message: the step starts again in the same allocation (counted
                     against the failure budget)
    node_excluded    node, excluded (the job's whole ExcNodeList now), reason
    node_decision    node, decision ("excluded": blamed in 2 attempts, kept off at this submission; "forgotten":
                     --forget-node), blames, evidence, by ("submit"; mgpu.record.exclusion)
    straggler        rank, node, factor (its compute per step over the median of the other ranks', the median over
                     the window that named it), since_step (the window's first step), step, compute_s and
                     typical_s (its compute EWMA, the other ranks' median): a rank persistently slower than the
                     others (mgpu.record.stragglers; rank 0, from the stop agreement's timing slots)
    straggler_cleared the same fields: the rank is no longer slower by the margin
    hang             ranks (the stuck ones), hosts, step (the last step every live rank completed), phases and
                     steps (per rank), frozen, missing, detected_by, waited_s, allowance_s (mgpu.stop.watchdog)
    evaluated        step, metrics
    early_stopped    step, metric, best
    finished         step, epoch, seconds
    failed           error, retry (false: bad input or a full disk, a requeue would fail the same way), rank
                     (every rank whose error is its own writes one), consequence (true: only another rank's
                     going away, gloo's `Connection closed by peer`; the cause is the other rank's event)
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
from mgpu.record.save_record import note_event

__all__ = ["EVENTS", "MAX_LEDGER_BYTES", "Ledger", "read_ledger"]

EVENTS = ("started", "resumed", "fresh_start", "hyperparameters", "first_step", "progress", "checkpoint_saved", "checkpoint_failed", "preempted",
          "stop_decision", "requeue_unknown", "requeue_refused", "awaiting_slurm", "requeued", "restarted", "node_excluded", "node_decision", "straggler", "straggler_cleared", "hang", "evaluated", "early_stopped", "finished",
          "failed")
"""Every event mgpu writes (tests/test_goodput.py checks it against the code's writes and this docstring)."""

MAX_LEDGER_BYTES = 256 << 20  # a few hundred bytes an event: a million events

log = logging.getLogger("mgpu.record.ledger")


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
            return
        # The event that ends a save or a resume also ends its attempt in the side record (mgpu.record.save_record),
        # where the next run's allowances are read from, however long this file grows.
        note_event(self.path, record)


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
