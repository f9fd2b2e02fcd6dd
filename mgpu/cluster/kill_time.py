"""When Slurm will end a stopping job: from the signals it sent, its KillWait and the partition's GraceTime. No torch.

What a task receives, measured on Slurm 22.05 (docs/slurm-measurements.md, /work/shared/slurm-notes.md):

| the stop                                   | first signal  | then                                               |
|--------------------------------------------|---------------|----------------------------------------------------|
| preempted, GraceTime 0                     | (USR2+) TERM  | KILL after KillWait                                |
| preempted, GraceTime G, the user signal    | USR2          | TERM at about G (G 10: 15-16 s), KILL KillWait later |
| preempted, GraceTime G, no user signal     | TERM          | TERM again at about G, KILL KillWait later         |
| `--signal=USR2@lead`, the time limit       | USR2          | TERM at the limit (lead later), KILL KillWait later |
| `scancel`, `scontrol requeue` from outside | TERM          | KILL after KillWait                                |

Two questions are answered here, for every process that acts at a stop (rank 0, `mgpu.run.recovery`):

- `window_s`: how long the stop's Slurm calls may take, all of them, so that they end before the earliest
  SIGKILL the signals allow: KillWait after the first SIGTERM; after the user signal alone, KillWait after
  it (a TERM may follow at once as far as the job can know: the time limit's lead and GraceTime only make
  the kill later); with no signal (the job's own deadline, a drain, a test stop) KillWait from now. Less a
  reserve for the exit. Not a fixed window: a call cut short by its window is the same "no answer" as one
  that hangs, while one that outlives the job records nothing at all.
- `wait_until`: how long a job whose requeue Slurm did not confirm stays alive, idle, for Slurm's own
  preemption to end it (Slurm then requeues it, PreemptMode=REQUEUE) or for Slurm to answer: the first
  signal, the grace (the partition's GraceTime; UNKNOWN_GRACE_S when it is not known), SIGNAL_SLACK_S for
  slurmctld's periodic check, and KillWait.

KillWait is MGPU_KILL_WAIT_S (the doctor measures it; `jobs/submit.py` and the sbatch templates set it from
`scontrol show config` where the user did not), else DEFAULT_KILL_WAIT_S; the grace is MGPU_GRACE_S (set the
same way from the partition's GraceTime). An unreadable value counts as unset: a stop never fails on it.
`python -m mgpu.cluster.kill_time` prints the `export` lines for the values Slurm gives and the user did not set.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["DEFAULT_KILL_WAIT_S", "GRACE_VARIABLE", "KILL_WAIT_VARIABLE", "KillTimes", "cluster_exports",
           "stop_window_s"]

KILL_WAIT_VARIABLE = "MGPU_KILL_WAIT_S"
GRACE_VARIABLE = "MGPU_GRACE_S"
DEFAULT_KILL_WAIT_S = 30.0
"""Slurm's default KillWait (SIGTERM to SIGKILL)."""
EXIT_RESERVE_S = 3.0
"""Of the time before SIGKILL, what the exit after the stop's Slurm calls keeps (at most a fifth of KillWait)."""
MIN_WINDOW_S = 1.0
"""A stop's Slurm calls get at least this: one short try even when the kill is due (it costs nothing then)."""
SIGNAL_SLACK_S = 30.0
"""How late slurmctld may act on a grace's end: it checks its jobs' times periodically (a time limit about every
30 s; GraceTime 10 brought the TERM 15-16 s after the user signal on the test cluster)."""
UNKNOWN_GRACE_S = 300.0
"""The grace a job waits for when the partition's GraceTime is not known (MGPU_GRACE_S unset)."""
READ_WITHIN_S = 5.0
"""All of `cluster_exports`' asks: a hung controller delays a submission or a job's start by this at most."""


def _seconds(environ: Mapping[str, str], name: str) -> float | None:
    """A non-negative number of seconds from the environment; None when unset or unreadable."""
    try:
        value = float(environ.get(name, "").strip() or "nan")
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


@dataclass(frozen=True)
class KillTimes:
    """KillWait and the grace a stopping job can count on. Signals are (name, Unix time) pairs, as rank 0's
    StopRequest received them (`SIGTERM`, `SIGUSR2`, ...)."""

    kill_wait_s: float = DEFAULT_KILL_WAIT_S
    grace_s: float | None = None
    """The partition's GraceTime (None: not known)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "KillTimes":
        environ = os.environ if environ is None else environ
        kill_wait = _seconds(environ, KILL_WAIT_VARIABLE)
        return cls(kill_wait if kill_wait else DEFAULT_KILL_WAIT_S, _seconds(environ, GRACE_VARIABLE))

    def earliest_kill(self, signals: Sequence[tuple[str, float]], now: float) -> float:
        """The earliest Unix time at which Slurm may SIGKILL the job, given the signals seen so far."""
        terms = [when for name, when in signals if name == "SIGTERM"]
        others = [when for name, when in signals if name not in ("SIGTERM", "SIGINT")]
        first = min(terms) if terms else min(others) if others else now
        return first + self.kill_wait_s

    def window_s(self, signals: Sequence[tuple[str, float]], now: float | None = None) -> float:
        """Seconds the stop's Slurm calls may take from `now`: to the earliest kill, less the exit's reserve."""
        now = time.time() if now is None else now
        left = self.earliest_kill(signals, now) - now - min(EXIT_RESERVE_S, self.kill_wait_s / 5)
        return max(MIN_WINDOW_S, left)

    def wait_until(self, signals: Sequence[tuple[str, float]]) -> float | None:
        """The Unix time until which a job whose requeue Slurm left unconfirmed stays alive for Slurm's own
        preemption (None: no signal came, so no kill is on its way: the job's own deadline, a drain, a test)."""
        times = [when for name, when in signals if name != "SIGINT"]
        if not times:
            return None
        grace = UNKNOWN_GRACE_S if self.grace_s is None else self.grace_s
        return min(times) + grace + SIGNAL_SLACK_S + self.kill_wait_s

    def describe(self) -> str:
        grace = "unknown" if self.grace_s is None else f"{self.grace_s:g} s"
        return f"KillWait {self.kill_wait_s:g} s, GraceTime {grace}"


def stop_window_s(signals: Sequence[tuple[str, float]], now: float | None = None,
                  environ: Mapping[str, str] | None = None) -> float:
    """`KillTimes.from_environ(environ).window_s(signals, now)`."""
    return KillTimes.from_environ(environ).window_s(signals, now)


_KILL_WAIT = re.compile(r"^KillWait\s*=\s*(\d+)\s*sec", re.M)


def parse_kill_wait(config: str) -> int | None:
    """KillWait from `scontrol show config` (`KillWait                = 5 sec`)."""
    found = _KILL_WAIT.search(config)
    return int(found[1]) if found else None


def parse_grace(partitions: str, partition: str | None) -> int | None:
    """GraceTime of `partition` (None: the default one) from `scontrol show partition -o`, one line each."""
    for line in partitions.splitlines():
        fields = dict(token.split("=", 1) for token in line.split() if "=" in token)
        if (fields.get("PartitionName") == partition) if partition else fields.get("Default") == "YES":
            grace = fields.get("GraceTime", "")
            return int(grace) if grace.isdigit() else None
    return None


def cluster_exports(partition: str | None, environ: Mapping[str, str] | None = None,
                    within_s: float = READ_WITHIN_S) -> dict[str, str]:
    """KillWait and `partition`'s GraceTime (None: the default partition's) as Slurm configures them, for the
    variables the user did not set; {} for what Slurm does not answer within `within_s`. Never raises."""
    from mgpu.cluster.slurm import SlurmError, client

    environ = os.environ if environ is None else environ
    found: dict[str, str] = {}
    slurm = client()
    with slurm.within(within_s):
        try:
            if not environ.get(KILL_WAIT_VARIABLE):
                kill_wait = parse_kill_wait(slurm.show_config())
                if kill_wait:
                    found[KILL_WAIT_VARIABLE] = str(kill_wait)
            if not environ.get(GRACE_VARIABLE):
                grace = parse_grace(slurm.show_partition(partition or ""), partition)
                if grace is not None:
                    found[GRACE_VARIABLE] = str(grace)
        except SlurmError:
            pass  # no answer: the job uses the defaults, as without these lines
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """`export` lines for a batch script: `eval "$(python -m mgpu.cluster.kill_time)"`."""
    parser = argparse.ArgumentParser(prog="python -m mgpu.cluster.kill_time", description=main.__doc__)
    parser.add_argument("--partition", help="the partition whose GraceTime (default: SLURM_JOB_PARTITION)")
    args = parser.parse_args(argv)
    for name, value in cluster_exports(args.partition or os.environ.get("SLURM_JOB_PARTITION")).items():
        print(f"export {name}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
