"""A job's requeue budgets, counted from its ledger: how many requeues a stop or a failure may cost, and how many
it has cost. No torch. Read by the recovery, rank 0's stop decision, the session's start and status alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from mgpu.errors import MgpuError

__all__ = ["DEFAULT_MAX_FAILURES", "FAILURE_KINDS", "Limits", "failure_requeues", "stop_requeues"]

DEFAULT_MAX_FAILURES = 3
FAILURE_KINDS = ("failure", "no_progress", "hang")
"""What a comeback after counts against MGPU_MAX_FAILURES (a preemption or time limit does not)."""


@dataclass(frozen=True)
class Limits:
    """The job's requeue limits, from the variables jobs/submit.py and the templates export.

    `max_requeues` bounds requeues after a stop (preemption, time limit, the user signal, an outside
    requeue): None (the default) is no limit, since a long run lives by them. `max_failures` bounds
    requeues after a failure or a run that made no progress, per job: a crash loop ends there.
    """

    max_requeues: int | None = None
    max_failures: int = DEFAULT_MAX_FAILURES

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "Limits":
        environ = os.environ if environ is None else environ

        def read(name: str, default: int | None) -> int | None:
            text = environ.get(name, "").strip()
            if text in ("", "none", "unlimited"):
                return default
            if not text.isdigit():
                raise MgpuError(f"{name}={text!r} is not a count: set it to an integer >= 0 (or unset it)")
            return int(text)

        failures = read("MGPU_MAX_FAILURES", DEFAULT_MAX_FAILURES)
        return cls(read("MGPU_MAX_REQUEUES", None), DEFAULT_MAX_FAILURES if failures is None else failures)


def failure_requeues(events: Sequence[Mapping[str, Any]], job_id: str) -> int:
    """Comebacks of `job_id` after a failure or a run without progress (requeued, or restarted in the same
    allocation), as the ledger recorded them."""
    return sum(1 for e in events if e.get("event") in ("requeued", "restarted") and e.get("job_id") == job_id
               and e.get("after") in FAILURE_KINDS)


def stop_requeues(events: Sequence[Mapping[str, Any]], job_id: str | None, restart_count: int) -> int:
    """Requeues of `job_id` after a stop (preemption, time limit, the user signal, an outside requeue).

    Slurm's restart count counts every requeue; of the failures, only those that requeued the job
    raised it: a step restarted in the same allocation (`restarted`) did not, so it is not subtracted."""
    failed = sum(1 for e in events if e.get("event") == "requeued" and e.get("job_id") == job_id
                 and e.get("after") in FAILURE_KINDS)
    return max(0, restart_count - failed)
