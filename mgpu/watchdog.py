"""Hangs end in minutes: a watchdog on every rank that knows what progress means, finds who is stuck,
leaves evidence and ends the step, so that the job comes back (mgpu.recovery) instead of waiting out a
30-minute collective timeout.

The training thread beats (`beat(phase, step)`: a few attribute writes) at each micro-step's forward and
backward, each optimizer step, each evaluation batch and each checkpoint. A daemon thread per rank
writes `logs/heartbeat-rank<N>.json` every few seconds and checks how long ago the last beat was, against
an allowance learned from the run itself: `step_multiple` times the median step time with the floor
`floor_s` (`first_step_s` before a run's first step); `step_multiple` times the median evaluation batch
time with the floor `eval_s` (`eval_s` for a run's first evaluation batch); `checkpoint_s` while a
checkpoint is gathered or written. A step's time runs from its first beat to the end of its optimizer
phase: the evaluation or checkpoint that may follow it has its own allowance and is not part of it.
Past the allowance, the rank:

1. writes the Python stack of every thread (faulthandler) to its log, and asks every other rank to do the
   same (`logs/.stacks-requested`, looked at once a poll): it leaves only once every live rank has, since
   its exit ends the step (srun --kill-on-bad-exit) before a rank that waits for it would see its own hang;
2. reads every rank's heartbeat file and names the stuck ranks: a file that stopped changing (a frozen
   process: SIGSTOP, a D-state read, C code holding the GIL), or ranks behind the others (still in a
   forward while the others wait in the gradient all-reduce of that step);
3. one rank (the first to claim `.hang-<job>-<restart>`) writes a `hang` event to the ledger: the stuck
   ranks, their hosts, the last step every rank completed, each rank's phase;
4. exits with HANG_EXIT_CODE: srun ends the step (--kill-on-bad-exit), and the batch script excludes a
   node that alone is to blame and requeues, or starts the step again in the same allocation.

A slow but healthy rank is not hung: every rank waits for it in the same collectives, so every rank's
step time (the allowance's base: wall time, waits included, never a rank's own compute) is as slow as it is.

Once training is over, `teardown()` bounds the process group's teardown (a rank can hang there too, e.g.
destroying a communicator whose peer is gone): past `TEARDOWN_S` the rank writes its stacks and exits
with the code it was given, without blaming anybody (the others may have left already).
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
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from mgpu.config_schema import WatchdogConfig

__all__ = ["HANG_EXIT_CODE", "PHASES", "TEARDOWN_S", "Heartbeat", "Watchdog", "blame"]

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
TEARDOWN_S = 60.0
"""Allowance for the process group's teardown once training is over (`Watchdog.teardown`)."""
STACKS_REQUESTED = ".stacks-requested"
"""In `logs/`: the wall time at which a rank found a hang; a later one than a watchdog's start asks it for its
stacks."""
EVAL_PHASES = ("eval", "agree")
CHECKPOINT_PHASES = ("checkpoint", "write", "checkpoint-wait")


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
    """One rank's watchdog; `start()` it once the process group is formed, `teardown()` before the group's
    teardown and `stop()` after it."""

    def __init__(self, rank: int, world: int, logs: Path, *, step_multiple: float, floor_s: float,
                 first_step_s: float, checkpoint_s: float, eval_s: float | None = None,
                 on_hang: Callable[[list[Heartbeat], list[int], float, float], None],
                 log_file: Callable[[], Any] | None = None, exit: Callable[[int], None] = os._exit,
                 clock: Callable[[], float] = time.time) -> None:
        self.rank, self.world, self.logs = rank, world, logs
        self.step_multiple, self.floor_s = step_multiple, floor_s
        self.first_step_s, self.checkpoint_s = first_step_s, checkpoint_s
        # None: the first step's allowance, as before evaluation had its own (a caller not passing it yet).
        self.eval_s = first_step_s if eval_s is None else eval_s
        self.on_hang, self.log_file, self.exit, self.clock = on_hang, log_file, exit, clock
        self.step, self.phase, self.since = 0, "start", clock()
        self._step_started: float | None = None  # the current step's first beat
        self._eval_mark = 0.0  # the current evaluation batch's beat
        self._step_times: deque[float] = deque(maxlen=50)
        self._eval_times: deque[float] = deque(maxlen=50)
        self._teardown: tuple[float, int] | None = None  # (allowance, exit code) once the teardown began
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._created = time.time()  # a stacks request older than this one is a former run's
        self._stacks = False  # this rank's stacks are in its log
        self.host = socket.gethostname()

    @classmethod
    def from_config(cls, config: "WatchdogConfig", rank: int, world: int, logs: Path, *,
                    on_hang: Callable[[list[Heartbeat], list[int], float, float], None],
                    log_file: Callable[[], Any] | None = None) -> "Watchdog":
        """A watchdog with the allowances of the config's `watchdog` section."""
        return cls(rank, world, logs, step_multiple=config.step_multiple, floor_s=config.floor_s,
                   first_step_s=config.first_step_s, checkpoint_s=config.checkpoint_s, eval_s=config.eval_s,
                   on_hang=on_hang, log_file=log_file)

    # ------------------------------------------------------------------ the training thread's side
    def beat(self, phase: str, step: int | None = None) -> None:
        """Progress: this rank is now in `phase` (of optimizer step `step`, when it changes)."""
        now = self.clock()
        if self.phase == "optimizer" and phase != "optimizer" and self._step_started is not None:
            # The step ends with its optimizer phase (and what runs until the next beat: the log line's
            # all-reduce, the stop agreement); an evaluation or checkpoint after it is not part of it.
            self._step_times.append(now - self._step_started)
        if phase == "eval":
            if self.phase in EVAL_PHASES:  # the previous batch, with the stop agreement after it if any
                self._eval_times.append(now - self._eval_mark)
            self._eval_mark = now
        if step is not None:
            self.step = step
            self._step_started = now
        self.phase, self.since = phase, now

    def allowance(self) -> float:
        """Seconds without a beat after which this rank counts as hung, in its current phase."""
        if self.phase == "teardown" and self._teardown is not None:
            return self._teardown[0]
        if self.phase in CHECKPOINT_PHASES:
            return self.checkpoint_s
        if self.phase in EVAL_PHASES:
            if not self._eval_times:
                return self.eval_s
            return max(self.eval_s, self.step_multiple * statistics.median(self._eval_times))
        if not self._step_times:
            return self.first_step_s
        return max(self.floor_s, self.step_multiple * statistics.median(self._step_times))

    def collective_timeout(self, configured: float) -> float:
        """The process group's timeout once training runs: `configured`, but longer than any allowance this
        watchdog may apply (a checkpoint write, a first evaluation batch, the steps so far times
        step_multiple) plus the time it takes to notice and leave evidence: a hang then ends through the
        watchdog, with the stacks, the ledger's `hang` event and the node's exclusion, not through a
        collective's timeout error, and a long but healthy save is never cut short by one."""
        so_far = [*self._step_times, *self._eval_times,
                  *([self.clock() - self._step_started] if self._step_started is not None else [])]
        longest = max(self.first_step_s, self.checkpoint_s, self.eval_s, self.floor_s,
                      self.step_multiple * max(so_far, default=0.0))
        return max(configured, longest + WRITE_EVERY_S + STALE_AFTER_S + EVIDENCE_S + LOOK_SLACK_S)

    def teardown(self, exit_code: int = HANG_EXIT_CODE, allowance_s: float = TEARDOWN_S) -> None:
        """Training is over and the process group's teardown begins: from here on the watchdog only bounds
        it. Past `allowance_s` without `stop()`, this rank writes every thread's stack to its log and exits
        with `exit_code` (0 where the run finished and its result is recorded; else HANG_EXIT_CODE, so
        that the batch script brings the job back). No `hang` event: the others may have left already."""
        self._teardown = (allowance_s, exit_code)
        self.beat("teardown")

    # ------------------------------------------------------------------ the watchdog thread
    def start(self) -> "Watchdog":
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
                "since": round(self.since, 3), "written": round(time.time(), 3), "stacks": self._stacks}
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
            now = self.clock()
            if not self._stacks and self._stacks_requested():
                log.error("another rank found a hang: dumping every thread's stack")
                self._bounded(self._dump_stacks, EVIDENCE_S)
                last_write = 0.0  # tell the one waiting for it at once
            if now - last_write >= WRITE_EVERY_S:
                self._write()
                last_write = now
            waited = now - self.since
            if waited > self.allowance():
                if self.phase == "teardown" and self._teardown is not None:
                    self._stuck_in_teardown(waited, self._teardown[1])
                else:
                    self._hung(waited)
                return

    def _stacks_requested(self) -> bool:
        try:
            return float((self.logs / STACKS_REQUESTED).read_text()) > self._created
        except (OSError, ValueError):
            return False

    def _request_stacks(self, detected: float) -> None:
        path = self.logs / STACKS_REQUESTED
        tmp = path.with_name(f"{path.name}.{self.rank}.tmp")
        try:
            tmp.write_text(repr(detected))
            os.replace(tmp, path)
        except OSError:
            pass

    @staticmethod
    def _bounded(work: Callable[[], None], timeout: float) -> None:
        # Evidence is best effort and bounded: on a hung filesystem, writing it could block forever too.
        worker = threading.Thread(target=work, name="mgpu-watchdog-evidence", daemon=True)
        worker.start()
        worker.join(timeout=timeout)

    def _hung(self, waited: float) -> None:
        self._bounded(lambda: self._evidence(waited), STALE_AFTER_S + EVIDENCE_S)
        try:
            logging.shutdown()
        finally:
            self.exit(HANG_EXIT_CODE)

    def _stuck_in_teardown(self, waited: float, code: int) -> None:
        log.error("the process group's teardown made no progress for %.0f s (allowance %.0f s): dumping every "
                  "thread's stack and exiting with code %d", waited, self.allowance(), code)
        self._bounded(self._dump_stacks, EVIDENCE_S)
        try:
            logging.shutdown()
        finally:
            self.exit(code)

    def _dump_stacks(self) -> None:
        file = self.log_file() if self.log_file is not None else None
        if file is not None and not self._stacks:
            faulthandler.dump_traceback(file=file, all_threads=True)
            file.flush()
        self._stacks = True

    def _evidence(self, waited: float) -> None:
        log.error("no progress for %.0f s in phase %s of step %d (allowance %.0f s): dumping every thread's stack",
                  waited, self.phase, self.step, self.allowance())
        detected = time.time()
        self._request_stacks(detected)
        self._dump_stacks()
        # A live rank's thread rewrites its file within WRITE_EVERY_S, with its stacks written; one that does
        # not by STALE_AFTER_S is frozen. Waiting for them also lets the others' watchdogs reach the same view.
        while True:
            self._write()  # this thread is alive, whatever its training thread does
            beats = self.read_all()
            if (len(beats) == self.world and all(b.written >= detected and b.stacks for b in beats)) or \
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
