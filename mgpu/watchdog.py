"""Hangs end in minutes: a watchdog on every rank that knows what progress means, finds who is stuck,
leaves evidence and ends the step, so that the job comes back (mgpu.recovery) instead of waiting out a
30-minute collective timeout.

The training thread beats (`beat(phase, step)`: a few attribute writes) at each micro-step's forward and
backward, each optimizer step, each evaluation batch and each checkpoint. A daemon thread per rank
writes `logs/heartbeat-rank<N>.json` every few seconds and checks how long ago the last beat was, against
an allowance learned from the run itself: `step_multiple` times the median step time (or evaluation
batch time) with a floor, `first_step_s` before a run's first step, `checkpoint_s` while a checkpoint is
gathered or written. Past it, the rank:

1. writes the Python stack of every thread (faulthandler) to its log;
2. reads every rank's heartbeat file and names the stuck ranks: a file that stopped changing (a frozen
   process: SIGSTOP, a D-state read, C code holding the GIL), or ranks behind the others (still in a
   forward while the others wait in the gradient all-reduce of that step);
3. one rank (the first to claim `.hang-<job>-<restart>`) writes a `hang` event to the ledger: the stuck
   ranks, their hosts, the last step every rank completed, each rank's phase;
4. exits with HANG_EXIT_CODE: srun ends the step (--kill-on-bad-exit), and the batch script excludes a
   node that alone is to blame and requeues, or starts the step again in the same allocation.

A slow but healthy rank is not hung: every rank waits for it in the same collectives, so every rank's
step time (the allowance's base) is as slow as it is.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence


__all__ = ["HANG_EXIT_CODE", "PHASES", "Heartbeat", "Watchdog", "blame"]

log = logging.getLogger("mgpu.train")
HANG_EXIT_CODE = 4
PHASES = ("start", "data", "forward", "model", "backward", "optimizer", "eval", "agree", "checkpoint", "write",
          "checkpoint-wait")
"""A step's phases in order: a rank in an earlier phase of the same step is behind the others. `forward` is
the task's loss, `model` the DDP forward inside it (whose buffer broadcast waits for every rank), so a
rank stuck in its own code before the model is behind those waiting in DDP; `agree` (an evaluation's stop
agreement) waits for the others; rank 0 `write`s a checkpoint while the others wait (`checkpoint-wait`)."""
WRITE_EVERY_S = 2.0
STALE_AFTER_S = 4 * WRITE_EVERY_S
LOOK_SLACK_S = 30.0  # margin for a loaded machine between the watchdog's verdict and the collective's timeout
EVIDENCE_S = 10.0  # beyond waiting for the others' heartbeats: stacks, the ledger event


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


def blame(beats: Sequence[Heartbeat], fresh_after: float, world: int | None = None) -> list[int]:
    """The ranks that hold the others up: frozen ones (a file not rewritten since `fresh_after`, or none at
    all), else those behind the rest."""
    seen = {b.rank for b in beats}
    frozen = [b.rank for b in beats if b.written < fresh_after]
    frozen += [rank for rank in range(world or 0) if rank not in seen]
    if frozen:
        return sorted(frozen)
    if not beats:
        return []
    order = {phase: i for i, phase in enumerate(PHASES)}
    position = {b.rank: (b.step, order.get(b.phase, 0)) for b in beats}
    furthest = max(position.values())
    behind = [rank for rank, where in position.items() if where < furthest]
    return sorted(behind)


class Watchdog:
    """One rank's watchdog; `start()` it once the process group is formed, `stop()` it before teardown."""

    def __init__(self, rank: int, world: int, logs: Path, *, step_multiple: float, floor_s: float,
                 first_step_s: float, checkpoint_s: float,
                 on_hang: Callable[[list[Heartbeat], list[int], float, float], None],
                 log_file: Callable[[], Any] | None = None, exit: Callable[[int], None] = os._exit) -> None:
        self.rank, self.world, self.logs = rank, world, logs
        self.step_multiple, self.floor_s = step_multiple, floor_s
        self.first_step_s, self.checkpoint_s = first_step_s, checkpoint_s
        self.on_hang, self.log_file, self.exit = on_hang, log_file, exit
        self.step, self.phase, self.since = 0, "start", time.time()
        self._step_times: deque[float] = deque(maxlen=50)
        self._eval_times: deque[float] = deque(maxlen=50)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.host = socket.gethostname()

    # ------------------------------------------------------------------ the training thread's side
    def beat(self, phase: str, step: int | None = None) -> None:
        """Progress: this rank is now in `phase` (of optimizer step `step`, when it changes)."""
        now = time.time()
        if phase == "eval" and self.phase in ("eval", "agree"):
            self._eval_times.append(now - self.since)
        if step is not None and step != self.step:
            if self.phase != "start":
                self._step_times.append(now - self._step_started)
            self.step = step
            self._step_started = now
        self.phase, self.since = phase, now

    def allowance(self) -> float:
        """Seconds without a beat after which this rank counts as hung, in its current phase."""
        if self.phase in ("checkpoint", "write", "checkpoint-wait"):
            return self.checkpoint_s
        times = self._eval_times if self.phase in ("eval", "agree") else self._step_times
        if not times:
            return self.first_step_s
        return max(self.floor_s, self.step_multiple * statistics.median(times))

    def collective_timeout(self, configured: float) -> float:
        """The process group's timeout once training runs: `configured`, but longer than any allowance this
        watchdog may apply (a checkpoint write, a first evaluation batch, the steps so far times
        step_multiple) plus the time it takes to notice and leave evidence: a hang then ends through the
        watchdog, with the stacks, the ledger's `hang` event and the node's exclusion, not through a
        collective's timeout error, and a long but healthy save is never cut short by one."""
        so_far = [*self._step_times, *([time.time() - self._step_started] if hasattr(self, "_step_started") else [])]
        longest = max(self.first_step_s, self.checkpoint_s, self.floor_s,
                      self.step_multiple * max(so_far, default=0.0))
        return max(configured, longest + WRITE_EVERY_S + STALE_AFTER_S + EVIDENCE_S + LOOK_SLACK_S)

    # ------------------------------------------------------------------ the watchdog thread
    def start(self) -> "Watchdog":
        self._step_started = time.time()
        self._write()  # at once: a rank frozen before its thread's first write is then seen as stale
        self._thread = threading.Thread(target=self._watch, name="mgpu-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        (self.logs / f"heartbeat-rank{self.rank}.json").unlink(missing_ok=True)

    def _write(self) -> None:
        beat = {"rank": self.rank, "host": self.host, "pid": os.getpid(), "step": self.step, "phase": self.phase,
                "since": round(self.since, 3), "written": round(time.time(), 3)}
        path = self.logs / f"heartbeat-rank{self.rank}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            # No fsync: a heartbeat is worth nothing after a crash, and a hung filesystem must not hang
            # the thread that watches for hangs.
            tmp.write_text(json.dumps(beat))
            os.replace(tmp, path)
        except OSError:
            pass  # a full disk: the others then see this rank as frozen, which is what they can know

    def read_all(self) -> list[Heartbeat]:
        beats = []
        for rank in range(self.world):
            try:
                beats.append(Heartbeat(**json.loads((self.logs / f"heartbeat-rank{rank}.json").read_text())))
            except (OSError, ValueError, TypeError):
                continue
        return beats

    def _watch(self) -> None:
        last_write = 0.0
        while not self._stop.wait(min(1.0, WRITE_EVERY_S)):
            now = time.time()
            if now - last_write >= WRITE_EVERY_S:
                self._write()
                last_write = now
            waited = now - self.since
            if waited > self.allowance():
                self._hung(waited)
                return

    def _hung(self, waited: float) -> None:
        # The evidence is best effort and bounded: on a hung filesystem, writing it could block forever too.
        worker = threading.Thread(target=self._evidence, args=(waited,), name="mgpu-watchdog-evidence", daemon=True)
        worker.start()
        worker.join(timeout=STALE_AFTER_S + EVIDENCE_S)
        try:
            logging.shutdown()
        finally:
            self.exit(HANG_EXIT_CODE)

    def _evidence(self, waited: float) -> None:
        log.error("no progress for %.0f s in phase %s of step %d (allowance %.0f s): dumping every thread's stack",
                  waited, self.phase, self.step, self.allowance())
        detected = time.time()
        file = self.log_file() if self.log_file is not None else None
        if file is not None:
            faulthandler.dump_traceback(file=file, all_threads=True)
            file.flush()
        # A live rank's thread rewrites its file within WRITE_EVERY_S; one that does not by STALE_AFTER_S
        # is frozen. Waiting for them also lets the others' watchdogs reach the same view.
        while True:
            self._write()  # this thread is alive, whatever its training thread does
            beats = self.read_all()
            if (len(beats) == self.world and all(b.written >= detected for b in beats)) or \
                    time.time() > detected + STALE_AFTER_S:
                break
            time.sleep(0.25)
        stuck = blame(beats, detected, self.world)
        self.on_hang(beats, stuck, waited, detected)


def report_hang(run: Any, job_id: str, restart: int, rank: int, beats: Sequence[Heartbeat], stuck: list[int],
                waited: float, allowance: float, detected: float) -> bool:
    """Write the `hang` event (the first rank to claim `.hang-<job>-<restart>` does); True if this rank did.

    `run` is the mgpu.rundir.RunDir. The event: the stuck ranks and their hosts (all ranks' hosts when none
    can be blamed), the last step every rank completed, each rank's phase, who saw it and after how long."""
    from mgpu.ledger import Ledger

    try:
        fd = os.open(run.path / f".hang-{job_id}-{restart}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return False
    os.close(fd)
    by_rank = {b.rank: b for b in beats}
    hosts = sorted({by_rank[r].host if r in by_rank else _recorded_host(run, r) for r in stuck} - {None})
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
