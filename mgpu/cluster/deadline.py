"""The job's end, known ahead: stop at the last step that leaves time to save, without trusting `--signal`.

Slurm kills a job at its time limit whether or not the user signal came (`--signal` may be missing,
stripped by a wrapper, or too short for a slow save). Rank 0 reads the job's end time from Slurm when the
run starts (in the clock's thread: a hanging squeue does not delay the start) and again every `preemption.slurm_poll_s` (a minute by default; a time limit can be changed while the job runs: `scontrol update
TimeLimit=`), and the session compares it at every step with what a stop still needs: the agreement's
delay (its interval plus one step, at the slowest step seen lately), the longest checkpoint write seen,
and a margin (at most a tenth of the job's time limit). When that reaches the end, rank 0 requests a stop
(`deadline`); the ranks agree as for a signal, save, and the job requeues itself as at a time limit. The
signal stays the fast path. A time limit so short that a stop would need more than half of it is left to
the signal: a requeued job gets the same limit again, so each run would stop after a few steps, forever.

The same poll looks at the job's own nodes (`scontrol show node`): one set to DRAIN or DRAINING, in a
maintenance reservation (MAINT) or with a reboot requested is known to Slurm long before its first signal. The
session then stops at a step boundary for `drain`, saves, and requeues the job: Slurm gives a drained node no
new job, so it comes back elsewhere or once the node is resumed.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from typing import Callable, Sequence

__all__ = ["JobClock", "draining_nodes", "parse_times", "time_needed"]

log = logging.getLogger("mgpu.train")
POLL_S = 60.0
MARGIN_SHARE = 0.1
"""The margin is at most this share of the job's time limit (60 s would stop a 1-minute job at once)."""
MAX_SHARE = 0.5
"""A stop needing more than this share of the time limit is left to the signal (see the module's doc)."""


def _time(value: str) -> float | None:
    try:
        return dt.datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None  # "N/A", "Unknown", "NONE": no time to prepare for


def parse_times(text: str) -> tuple[float | None, float | None]:
    """squeue's `%S %e` (the job's start and end, local time, `2026-11-25T10:32:09`) as Unix times; None for
    what it does not know (no limit, not started) or when it gave no answer."""
    fields = text.strip().splitlines()[0].split() if text.strip() else []
    if len(fields) != 2:
        return None, None
    return _time(fields[0]), _time(fields[1])


def _squeue_times(job_id: str) -> str:
    from mgpu.cluster.slurm import client

    return client().times(job_id)


DRAIN_FLAGS = {"DRAIN", "DRAINING", "DRAINED", "MAINT", "REBOOT_REQUESTED", "REBOOT_ISSUED", "POWER_DOWN",
               "POWERING_DOWN"}
"""Node state flags that say the node is about to go (its jobs will be stopped or it takes no new one)."""


def draining_nodes(text: str) -> dict[str, str]:
    """`scontrol show node -o` output -> {node: its state and reason} for the nodes about to go (DRAIN_FLAGS)."""
    found = {}
    for line in text.splitlines():
        fields = dict(token.split("=", 1) for token in line.split() if "=" in token)
        flags = {flag.rstrip("*~#!%$@^-") for flag in fields.get("State", "").split("+")}
        if fields.get("NodeName") and flags & DRAIN_FLAGS:
            reason = fields.get("Reason", "")
            found[fields["NodeName"]] = fields["State"] + (f" ({reason})" if reason and reason != "(null)" else "")
    return found


def _scontrol_nodes(nodes: Sequence[str]) -> str:
    from mgpu.cluster.slurm import SlurmError, client

    try:
        return client().show_nodes(nodes)
    except SlurmError:
        return ""  # no answer: nothing is known to be draining


def time_needed(step_s: float, every: int, longest_write_s: float, margin_s: float,
                limit_s: float | None = None) -> float:
    """Seconds a stop takes from the step where it is requested to a durable checkpoint: the agreement
    (read `every + 1` steps later at worst), the write, and a margin for the gather and the exit (at most
    MARGIN_SHARE of the job's time limit `limit_s`, when known)."""
    if limit_s is not None:
        margin_s = min(margin_s, MARGIN_SHARE * limit_s)
    return (every + 1) * step_s + longest_write_s + margin_s


class JobClock:
    """Rank 0's view of when Slurm will end the job, refreshed in a daemon thread every `poll_s`."""

    def __init__(self, job_id: str, poll_s: float = POLL_S, read: Callable[[str], str] = _squeue_times,
                 nodes: Sequence[str] = (), read_nodes: Callable[[Sequence[str]], str] = _scontrol_nodes) -> None:
        self.job_id, self.poll_s, self.read = job_id, poll_s, read
        self.nodes, self.read_nodes = tuple(nodes), read_nodes
        self.start_time: float | None = None
        self.end: float | None = None
        self.draining: dict[str, str] = {}
        """The job's nodes about to go (draining, maintenance, reboot), as of the last poll."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> float | None:
        start, end = parse_times(self.read(self.job_id))
        self.start_time = start if start is not None else self.start_time
        if end is not None and end != self.end:
            log.info("job %s ends at %s (Slurm's time limit)", self.job_id,
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(end)))
        self.end = end if end is not None else self.end
        if self.nodes:
            draining = draining_nodes(self.read_nodes(self.nodes))
            if draining and draining != self.draining:
                log.warning("the job's node(s) about to go: %s", "; ".join(f"{n}: {w}" for n, w in draining.items()))
            self.draining = draining
        return self.end

    def start(self) -> "JobClock":
        """Poll in a daemon thread, the first time at once: a squeue that hangs must not hold up the start."""
        self._thread = threading.Thread(target=self._poll, name="mgpu-job-clock", daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        self.refresh()
        while not self._stop.wait(self.poll_s):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def limit_s(self) -> float | None:
        """The job's time limit (this run's start to its end), when Slurm said both."""
        if self.start_time is None or self.end is None or self.end <= self.start_time:
            return None
        return self.end - self.start_time

    def too_close(self, now: float, needed_s: float) -> bool:
        return self.end is not None and now + needed_s >= self.end

    def too_short(self, needed_s: float) -> bool:
        """A stop would need more than MAX_SHARE of the time limit: leave it to the signal."""
        limit = self.limit_s
        return limit is not None and needed_s > MAX_SHARE * limit
