"""Hangs end in minutes: a watchdog on every rank that knows what progress means, finds who is stuck,
leaves evidence and ends the step, so that the job comes back (mgpu.run.recovery) instead of waiting out a
30-minute collective timeout.

The training thread beats (`beat(phase, step)`: a few attribute writes) at each micro-step's forward and
backward, each optimizer step, each evaluation batch and each checkpoint. A watch thread per rank compares,
with nothing but clocks, how long ago the last beat was against an allowance learned from the run itself:
`step_multiple` times the median step time with the floor `floor_s` (`first_step_s` before a run's first
step); `step_multiple` times the median evaluation batch time with the floor `eval_s` (`eval_s` for a run's
first evaluation batch); `checkpoint_s` while a checkpoint is gathered or written, `resume_s` while a checkpoint
is found, hashed and loaded (both sized by the saves and resumes measured so far: mgpu.state.save_budget); and while
a resume reads, each read counts as progress (any thread's bytes read and page faults but the watchdog's, from
/proc, sampled by the publisher thread: mgpu.stop.phase_progress): a big checkpoint on a slow filesystem, read or
memory-mapped, is read, not hung. A step's time runs from its first beat to the end of its optimizer phase: the
evaluation or checkpoint that may follow it has its own allowance and is not part of it.

Heartbeats go on a board (mgpu.stop.heartbeat_board), never on the run's shared filesystem (one stalled
`open()` there would block every rank's watchdog at once, and attribute caching would make a live rank look
stale): the rendezvous store (a TCPStore, through a connection of the watchdog's own with a 5 s timeout) in a
world of several ranks, a node-local tmpfs directory otherwise. A publisher thread writes this rank's heartbeat every WRITE_EVERY_S;
the watch thread does no I/O at all, so a stalled board or filesystem can delay evidence, never detection.
Everything that touches a file, a socket or a log handler runs on a helper thread with a bound.

Past the allowance, the rank:

1. writes the Python stack of every thread (faulthandler) to its log, and asks every other rank to do the
   same (`.stacks-requested` on the board, looked at once a poll): it leaves only once every live rank has, since
   its exit ends the step (srun --kill-on-bad-exit) before a rank that waits for it would see its own hang;
2. reads every rank's heartbeat and names the stuck ranks (mgpu.stop.hang_evidence): a heartbeat that stopped
   changing (a frozen process: SIGSTOP, a D-state read, C code holding the GIL), or ranks behind the others (still in
   a forward while the others wait in the gradient all-reduce of that step). Frozen means no new heartbeat since
   the hang was found, by the rank's own clock (`still_silent`: no two machines' clocks are compared), within
   STALE_AFTER_S and then a second look as long as the machine's load makes a live publisher slow
   (`second_look_s`, from the load each heartbeat reports): an overloaded but live rank is not blamed;
3. one rank (the first to claim `.hang-<job>-<restart>`) writes a `hang` event to the ledger (`report_hang`): the
   stuck ranks, their hosts, the last step every rank completed, each rank's phase (steps 1-3 on a helper thread,
   bounded: on a filesystem that does not answer they are cut short, never the exit);
4. exits with HANG_EXIT_CODE: srun ends the step (--kill-on-bad-exit), and the batch script excludes a
   node that alone is to blame and requeues, or starts the step again in the same allocation.

A slow but healthy rank is not hung: every rank waits for it in the same collectives, so every rank's
step time (the allowance's base: wall time, waits included, never a rank's own compute) is as slow as it is.

Once training is over, `teardown()` bounds the process group's teardown (a rank can hang there too, e.g.
destroying a communicator whose peer is gone): past `TEARDOWN_S` (`ENDED_TEARDOWN_S` once the run's outcome is
recorded) the rank writes its stacks and exits with the code it was given, without blaming anybody (the others
may have left already).
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import logging
import os
import socket
import statistics
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from mgpu.stop.hang_evidence import Heartbeat, blame, still_silent
from mgpu.stop.heartbeat_board import STORE_TIMEOUT_S, Board, DirBoard, StoreBoard, default_board
from mgpu.stop.phase_progress import LongPhases, ThreadsProgress, process_threads, thread_progress

if TYPE_CHECKING:
    from mgpu.config.schema import WatchdogConfig

__all__ = ["ENDED_TEARDOWN_S", "HANG_EXIT_CODE", "TEARDOWN_S", "Board", "DirBoard", "StoreBoard", "Watchdog",
           "default_board"]

log = logging.getLogger("mgpu.train")
HANG_EXIT_CODE = 4
WRITE_EVERY_S = 2.0
STALE_AFTER_S = 4 * WRITE_EVERY_S
SECOND_LOOK_MAX_S = 2 * STALE_AFTER_S
"""At most this much longer a rank that did not republish within STALE_AFTER_S is waited for, on a loaded machine
(`second_look_s`), before it is called frozen: within LOOK_SLACK_S, the collective timeout's margin for a loaded
machine, so the others' collectives still outlast the verdict."""
LOOK_SLACK_S = 30.0  # margin for a loaded machine between the watchdog's verdict and the collective's timeout
EVIDENCE_S = 10.0  # beyond waiting for the others' heartbeats: stacks, the ledger event
TEARDOWN_S = 60.0
"""Allowance for the process group's teardown once training is over (`Watchdog.teardown`)."""
LAST_WORDS_AFTER_S = 2.0
"""A stop signal this long ago (or two median steps, if longer) and the step it came in still runs: say the last
words (a peer died; srun's SIGKILL follows its SIGTERM after KillWait, 30 s by default, 5 s on the test cluster)."""
ENDED_TEARDOWN_S = 5.0
"""The same once the run's outcome is recorded (checkpoint, ledger, loggers): cutting it short loses nothing,
and Slurm's KillWait (often 5-30 s after a stop's signal) is near."""
CHECKPOINT_PHASES = ("checkpoint", "write", "checkpoint-wait")
MAX_ALLOWANCE_S = 86_400.0
"""No allowance, and no collective timeout derived from one, is longer (mgpu.state.save_budget.MAX_ALLOWANCE_S): a
step or save timed across a suspended job must not make a timeout overflow."""


def machine_load() -> float:
    """This machine's 1-minute load average per CPU (0 where the system does not say)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def second_look_s(load_per_cpu: float) -> float:
    """How much longer than STALE_AFTER_S to wait for a rank that has not republished: none on a machine with a
    CPU per runnable thread, STALE_AFTER_S per unit of load beyond that, at most SECOND_LOOK_MAX_S. At 32 ranks
    on 2 cores (load ~20 per CPU) a live rank's publisher went unscheduled for more than 8 s and was blamed."""
    return min(SECOND_LOOK_MAX_S, max(0.0, load_per_cpu - 1.0) * STALE_AFTER_S)


def attempt_key(logs: Path, environ: Mapping[str, str] | None = None) -> str:
    """What names one attempt of one run: its logs, its Slurm job and restart, torchrun's restart."""
    environ = os.environ if environ is None else environ
    return "|".join([str(logs.resolve()), environ.get("SLURM_JOB_ID", ""), environ.get("SLURM_RESTART_COUNT", ""),
                     environ.get("TORCHELASTIC_RESTART_COUNT", ""), environ.get("MGPU_RESTART", "")])


def _bounded(work: Callable[[], Any], timeout: float, name: str = "mgpu-watchdog-evidence") -> bool:
    """Run `work` on a daemon thread for at most `timeout` s: True if it ended. Whatever touches a file, a
    socket or a log handler (whose lock a stalled training thread may hold) goes through here."""
    worker = threading.Thread(target=work, name=name, daemon=True)
    worker.start()
    worker.join(timeout=timeout)
    return not worker.is_alive()


class Watchdog:
    """One rank's watchdog; `start()` it once the process group is formed, `teardown()` before the group's
    teardown and `stop()` after it.

    Two threads: the watch thread only compares clocks (no file, no socket, no log line: nothing it calls can
    block), and starts bounded helpers for evidence; the publisher thread writes this rank's heartbeat to the
    `board` and looks for another rank's request for stacks. A publisher stalled on the board makes this rank
    look frozen to the others, which is what they can know; it never keeps this rank's own hang unnoticed."""

    def __init__(self, rank: int, world: int, board: "Board | Path", *, step_multiple: float, floor_s: float,
                 first_step_s: float, checkpoint_s: float, eval_s: float | None = None,
                 resume_s: float | None = None,
                 on_hang: Callable[[list[Heartbeat], list[int], float, float], None],
                 log_file: Callable[[], Any] | None = None, exit: Callable[[int], None] = os._exit,
                 clock: Callable[[], float] = time.time,
                 progress: Callable[[int], int | None] = thread_progress,
                 threads: Callable[[], Iterable[int]] = process_threads) -> None:
        self.rank, self.world = rank, world
        # A path: heartbeat files there (a test's directory, or a node-local one); else the board given.
        self._board: Board | None = DirBoard(board) if isinstance(board, Path) else board
        self._board_path = board if isinstance(board, Path) else None
        self.step_multiple, self.floor_s = step_multiple, floor_s
        self.first_step_s, self.checkpoint_s = first_step_s, checkpoint_s
        # None: the first step's allowance, as before evaluation had its own (a caller not passing it yet).
        self.eval_s = first_step_s if eval_s is None else eval_s
        # A resume: at least the first step's allowance (None: that alone, as before it had its own).
        self.resume_s = first_step_s if resume_s is None else max(first_step_s, resume_s)
        # During a resume: the process's threads' reads and page faults (not the watchdog's own), and when they last grew.
        self._moved = ThreadsProgress(progress, threads, self._own_threads)
        self._read_mark: float | None = None
        self.on_hang, self.log_file, self.exit, self.clock = on_hang, log_file, exit, clock
        self.step, self.phase, self.since = 0, "start", clock()
        self._step_started: float | None = None  # the current step's first beat
        self._eval_mark = 0.0  # the current evaluation batch's beat
        self._in_eval = False  # an evaluation runs: `agree` is its stop agreement, not a step's end
        self._step_timed = True  # the current step's time is recorded (nothing to record before the first)
        self._step_times: deque[float] = deque(maxlen=50)
        self._eval_times: deque[float] = deque(maxlen=50)
        self._teardown: tuple[float, int] | None = None  # (allowance, exit code) once the teardown began
        self._stop = threading.Event()
        self._publish_now = threading.Event()  # the publisher writes at once (stacks written, a hang found)
        self._asked = threading.Event()  # another rank asked for this rank's stacks
        self._thread: threading.Thread | None = None
        self._publisher: threading.Thread | None = None
        self._created = time.time()  # a stacks request older than this one is a former run's
        self._stacks = False  # this rank's stacks are in its log
        self.published = 0.0  # wall time of the last heartbeat the board took
        self.host = socket.gethostname()
        self._long_phases = LongPhases(rank)  # progress lines of a long resume, save or rendezvous
        self.last_words: Callable[[str], None] | None = None
        """A survivor's save of the last step this rank completed (the session's, mgpu.run.session_state.last_words),
        said from this thread, bounded: once a hang is found on another rank, or once a stop signal came and this
        rank's step has not ended within `LAST_WORDS_AFTER_S` (a peer died: srun's SIGTERM, then its SIGKILL)."""
        self.signalled: Callable[[], float | None] = lambda: None
        """When the first stop signal reached this rank (None: none yet)."""
        self._last_words_said = False

    @classmethod
    def from_config(cls, config: "WatchdogConfig", rank: int, world: int, logs: Path, *,
                    on_hang: Callable[[list[Heartbeat], list[int], float, float], None],
                    log_file: Callable[[], Any] | None = None, board: "Board | None" = None,
                    checkpoint_s: float | None = None, resume_s: float | None = None) -> "Watchdog":
        """A watchdog with the allowances of the config's `watchdog` section, its heartbeats on `board`
        (default: the rendezvous store, or a node-local directory; `logs` only names the attempt);
        `checkpoint_s`, `resume_s`: the save's and the resume's allowances derived from the saves and resumes
        measured so far (mgpu.state.save_budget)."""
        return cls(rank, world, board if board is not None else default_board(world, attempt_key(logs)),
                   step_multiple=config.step_multiple, floor_s=config.floor_s, first_step_s=config.first_step_s,
                   checkpoint_s=config.checkpoint_s if checkpoint_s is None else checkpoint_s, eval_s=config.eval_s,
                   resume_s=resume_s, on_hang=on_hang, log_file=log_file)

    # ------------------------------------------------------------------ the training thread's side
    def beat(self, phase: str, step: int | None = None) -> None:
        """Progress: this rank is now in `phase` (of optimizer step `step`, when it changes)."""
        now = self.clock()
        if self.phase == "optimizer" and phase != "optimizer" and self._step_started is not None \
                and not self._step_timed:
            # The step ends with its optimizer phase (and what runs until the next beat: the log line's
            # all-reduce, the stop agreement); an evaluation or checkpoint after it is not part of it.
            self._step_times.append(now - self._step_started)
            self._step_timed = True
        if step is not None and step != self.step and self._step_started is not None and not self._step_timed \
                and not self._in_eval and self.phase not in CHECKPOINT_PHASES:
            # A loop of one's own beats no optimizer phase (mgpu.Session: `model` at a step's first forward,
            # `agree` at its end): its step lasts until the next one begins.
            self._step_times.append(now - self._step_started)
        if phase == "eval":
            if self._in_eval:  # the previous batch, with the stop agreement after it if any
                self._eval_times.append(now - self._eval_mark)
            self._eval_mark = now
            self._in_eval = True
        elif phase != "agree":  # `agree` belongs to what it follows: an evaluation batch, or a step's end
            self._in_eval = False
        if step is not None:
            self.step = step
            self._step_started = now
            self._step_timed = False
        if phase == "resume" and self.phase != "resume":
            self._read_mark = None
            self._moved.reset()
        self.phase, self.since = phase, now

    def allowance(self) -> float:
        """Seconds without a beat after which this rank counts as hung, in its current phase."""
        if self.phase == "teardown" and self._teardown is not None:
            return self._teardown[0]
        if self.phase in CHECKPOINT_PHASES:
            return self.checkpoint_s
        if self.phase == "resume":
            return self.resume_s
        if self.phase == "eval" or (self.phase == "agree" and self._in_eval):
            if not self._eval_times:
                return self.eval_s
            return max(self.eval_s, self.step_multiple * statistics.median(self._eval_times))
        if not self._step_times:
            return self.first_step_s
        return max(self.floor_s, self.step_multiple * statistics.median(self._step_times))

    def collective_timeout(self, configured: float, *, resuming: bool = False) -> float:
        """The process group's timeout once training runs: `configured`, but longer than any allowance this
        watchdog may apply (a checkpoint write, a first evaluation batch, the steps so far times
        step_multiple) plus the time it takes to notice and leave evidence: a hang then ends through the
        watchdog, with the stacks, the ledger's `hang` event and the node's exclusion, not through a
        collective's timeout error, and a long but healthy save is never cut short by one. `resuming`: while a
        resume's collectives wait for a rank that hashes a checkpoint (its allowance counts too)."""
        so_far = [*self._step_times, *self._eval_times,
                  *([self.clock() - self._step_started] if self._step_started is not None else [])]
        longest = min(max(self.first_step_s, self.checkpoint_s, self.eval_s, self.floor_s,
                          self.resume_s if resuming else 0.0, self.step_multiple * max(so_far, default=0.0)),
                      MAX_ALLOWANCE_S)
        return max(configured, longest + WRITE_EVERY_S + STALE_AFTER_S + EVIDENCE_S + LOOK_SLACK_S)

    def teardown(self, exit_code: int = HANG_EXIT_CODE, allowance_s: float = TEARDOWN_S) -> None:
        """Training is over and the process group's teardown begins: from here on the watchdog only bounds
        it. Past `allowance_s` without `stop()`, this rank writes every thread's stack to its log and exits
        with `exit_code` (0 where the run finished and its result is recorded; else HANG_EXIT_CODE, so
        that the batch script brings the job back). No `hang` event: the others may have left already."""
        self._teardown = (allowance_s, exit_code)
        self.beat("teardown")

    # ------------------------------------------------------------------ the threads
    def start(self) -> "Watchdog":
        # The first heartbeat at once (a rank frozen before its publisher's first write is then seen as
        # stale), but bounded: the caller is the training thread.
        _bounded(self._publish, STORE_TIMEOUT_S, "mgpu-watchdog-publish")
        self._publisher = threading.Thread(target=self._publish_loop, name="mgpu-watchdog-publish", daemon=True)
        self._publisher.start()
        self._thread = threading.Thread(target=self._watch, name="mgpu-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._publish_now.set()
        for thread in (self._thread, self._publisher):
            if thread is not None:
                thread.join(timeout=10 if thread is self._thread else 1)
        board = self._board
        if board is not None:
            _bounded(lambda: board.close(self.rank), 1.0, "mgpu-watchdog-close")

    def _beat_text(self) -> str:
        return json.dumps({"rank": self.rank, "host": self.host, "pid": os.getpid(), "step": self.step,
                           "phase": self.phase, "since": round(self.since, 3), "written": round(time.time(), 3),
                           "stacks": self._stacks, "load": round(machine_load(), 2)})

    def _publish(self) -> None:
        if self._board is None:
            return
        try:
            self._board.publish(self.rank, self._beat_text())
            self.published = time.time()
            requested = self._board.stacks_requested()
            if requested is not None and requested > self._created and not self._stacks:
                self._asked.set()
        except (OSError, RuntimeError, ValueError):
            pass  # the others then see this rank as frozen, which is what they can know

    def note_reads(self) -> None:
        """During a resume, the time the process last moved data (the publisher's, once a poll): any thread's bytes
        read or page faults (mgpu.stop.phase_progress.ThreadsProgress; the watchdog's own threads left out). A
        resume that keeps reading, or faulting a mapped checkpoint in, is making progress, whatever its allowance."""
        if self.phase != "resume":
            return
        if self._moved.grew():
            self._read_mark = self.clock()

    def _own_threads(self) -> list[int]:
        """The kernel ids of the watchdog's threads (the watch, the publisher, their bounded helpers)."""
        return [thread.native_id for thread in threading.enumerate()
                if thread.name.startswith("mgpu-watchdog") and thread.native_id is not None]

    def waited(self) -> float:
        """Seconds since this rank's last progress: its last beat, or during a resume its last read, but
        never past MAX_ALLOWANCE_S since the beat."""
        now = self.clock()
        mark = self._read_mark
        if self.phase == "resume" and mark is not None and mark > self.since:
            return max(now - mark, now - self.since - MAX_ALLOWANCE_S)
        return now - self.since

    def _publish_loop(self) -> None:
        # Every WRITE_EVERY_S, as documented (it was every 1 s: twice the store's load, ~1,000 requests/s at 512
        # ranks on the store the rendezvous and DCP use); at once when asked (stacks written, a hang found).
        while not self._stop.is_set():
            self.note_reads()
            line = self._long_phases.poll(self.phase, self.step, self.since, self.clock(), self.allowance())
            if line is not None:
                _bounded(functools.partial(log.info, "%s", line), 1.0, "mgpu-watchdog-progress")
            self._publish()
            self._publish_now.wait(WRITE_EVERY_S)
            self._publish_now.clear()

    def read_all(self) -> list[Heartbeat]:
        """Every rank's last heartbeat the board holds (bounded: the board's own timeout)."""
        if self._board is None:
            return []
        beats = []
        for text in self._board.read(self.world).values():
            try:
                beats.append(Heartbeat(**json.loads(text)))
            except (ValueError, TypeError):
                continue
        return beats

    def _watch(self) -> None:
        # Nothing here may block: clocks, events, and bounded helpers only.
        while not self._stop.wait(0.5):
            if self._asked.is_set() and not self._stacks:
                _bounded(lambda: self._dump_stacks("another rank found a hang: dumping every thread's stack"),
                         EVIDENCE_S)
                self._publish_now.set()  # tell the one waiting for it at once
            waited = self.waited()
            self._after_signal()
            if waited > self.allowance():
                if self.phase == "teardown" and self._teardown is not None:
                    self._stuck_in_teardown(waited, self._teardown[1])
                else:
                    self._hung(waited)
                return

    def _after_signal(self) -> None:
        """A stop signal came, and the step it came in has not ended since (no beat): a peer died and this rank
        waits in a collective that will not complete before srun's SIGKILL, or a step longer than the bound. The
        survivor's save, then (harmless where the step ends after all: the step's own stop saves as always)."""
        signalled = self.signalled()
        if (self.last_words is None or self._last_words_said or signalled is None or self.since > signalled
                or self.phase in CHECKPOINT_PHASES or self.phase in ("resume", "start", "teardown")):
            return
        step = statistics.median(self._step_times) if self._step_times else 0.0
        if self.clock() - signalled >= max(LAST_WORDS_AFTER_S, 2 * step):
            self._say_last_words(f"a stop signal {self.clock() - signalled:.0f} s ago and step {self.step} has not "
                                 f"ended")

    def _say_last_words(self, why: str) -> None:
        if self.last_words is not None and not self._last_words_said:
            self._last_words_said = True
            say = self.last_words
            _bounded(lambda: say(why), max(self.checkpoint_s, EVIDENCE_S), "mgpu-last-words")

    def _leave(self, code: int) -> None:
        _bounded(logging.shutdown, 2.0, "mgpu-watchdog-shutdown")  # a log on a stalled filesystem cannot keep us
        self.exit(code)

    def _hung(self, waited: float) -> None:
        _bounded(lambda: self._evidence(waited), STALE_AFTER_S + SECOND_LOOK_MAX_S + EVIDENCE_S)
        self._leave(HANG_EXIT_CODE)

    def _stuck_in_teardown(self, waited: float, code: int) -> None:
        message = (f"the process group's teardown made no progress for {waited:.0f} s (allowance "
                   f"{self.allowance():.0f} s): dumping every thread's stack and exiting with code {code}")
        _bounded(lambda: self._dump_stacks(message), EVIDENCE_S)
        self._leave(code)

    def _dump_stacks(self, message: str) -> None:
        log.error("%s", message)
        file = self.log_file() if self.log_file is not None else None
        if file is not None and not self._stacks:
            faulthandler.dump_traceback(file=file, all_threads=True)
            file.flush()
        self._stacks = True

    def _evidence(self, waited: float) -> None:
        detected = time.time()
        board = self._board
        first = self._first_look()
        if board is not None:  # first, so that the others start on their stacks while this rank writes its own
            _bounded(lambda: board.request_stacks(detected), STORE_TIMEOUT_S)
        self._dump_stacks(f"no progress for {waited:.0f} s in phase {self.phase} of step {self.step} (allowance "
                          f"{self.allowance():.0f} s): dumping every thread's stack")
        # A live rank's publisher rewrites its heartbeat within WRITE_EVERY_S, with its stacks written. One that has
        # not by STALE_AFTER_S gets a second look on a loaded machine (second_look_s: its publisher may be waiting
        # for a CPU): only one silent until then is frozen. Waiting also lets the others reach the same view.
        beats: list[Heartbeat] = []
        silent: list[int] = []
        while True:
            self._publish_now.set()  # this rank's publisher is alive, whatever its training thread does
            try:
                beats = self.read_all()
            except (OSError, RuntimeError):
                beats = []  # the board is out of reach: nobody can be blamed on what it held
            silent = [r for r in still_silent(first, beats, self.world, detected) if r != self.rank]
            everyone = len(beats) == self.world and not silent and all(b.stacks for b in beats)
            now = time.time()
            load = max([machine_load(), *(b.load for b in beats)])
            # No second look without a board to look at (its host, rank 0's process, may have left already).
            look_s = second_look_s(load) if beats else 0.0
            if everyone or (now > detected + STALE_AFTER_S and
                            (not silent or now > detected + STALE_AFTER_S + look_s)):
                break
            time.sleep(0.25)
        if silent and beats:
            log.error("rank(s) %s did not publish a heartbeat for %.0f s since the hang was found (load %.1f per "
                      "CPU): frozen", silent, time.time() - detected, load)
        stuck = blame(beats, detected, self.world, frozen_ranks=silent) if beats else []
        self.on_hang(beats, stuck, waited, detected)
        if self.rank not in stuck:  # a survivor: the last step it completed, for the step started again
            self._say_last_words(f"rank(s) {stuck or 'unknown'} hung in step {self.step}")

    def _first_look(self) -> dict[int, float]:
        """Every rank's heartbeat time (by its own clock) when the hang is found, to tell later which moved."""
        found: list[dict[int, float]] = []

        def read() -> None:
            with contextlib.suppress(OSError, RuntimeError):
                found.append({b.rank: b.written for b in self.read_all()})

        _bounded(read, STORE_TIMEOUT_S, "mgpu-watchdog-first-look")
        return found[0] if found else {}

