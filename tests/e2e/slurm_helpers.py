"""Small helpers shared by the end-to-end tests: bounded waits and Slurm's own view of a job.

Every Slurm client command goes through `SlurmCluster.run` (bounded, raises with its output).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from conftest import SlurmCluster

# sacct only looks at jobs since this module was imported: ids of jobs from earlier cluster
# incarnations may repeat, and `sacct -j ID` would return those old jobs too.
SINCE = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 5))
# Allocation states after which a job (or this run of it) is over.
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
        "DEADLINE"}


def wait_until(what: str, predicate: Callable[[], object], timeout: float, interval: float = 0.5) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def sbatch(cluster: SlurmCluster, *args: str) -> str:
    return cluster.run("sbatch", "--parsable", *args).stdout.strip().split(";")[0]


def job(cluster: SlurmCluster, jobid: str) -> dict[str, str]:
    """`scontrol show job` as a dict (empty once the job has left slurmctld's memory)."""
    proc = cluster.run("scontrol", "show", "job", "-o", jobid, check=False)
    return dict(tok.split("=", 1) for tok in proc.stdout.split() if "=" in tok) if proc.returncode == 0 else {}


SACCT_FIELDS = ("JobID", "State", "Partition", "Start", "End", "NodeList", "ExitCode")


def sacct(cluster: SlurmCluster, jobid: str, *flags: str) -> list[dict[str, str]]:
    """Allocation-level accounting rows of a job (with -D: one per run of a requeued job)."""
    out = cluster.run("sacct", "-n", "-P", "-X", "-S", SINCE, *flags, "-j", jobid, "-o",
                      ",".join(SACCT_FIELDS)).stdout
    return [dict(zip(SACCT_FIELDS, line.split("|"))) for line in out.splitlines() if line]


def final_state(cluster: SlurmCluster, jobid: str, timeout: float = 60) -> str:
    """Wait until the job's last run is over in sacct; its state (first word: `CANCELLED by 0` -> CANCELLED).

    A requeued job shows PREEMPTED/REQUEUED only for a moment before it is PENDING again, so a state
    seen here is re-read once, 1.5 s later, and must still be the same (and the job gone from the queue
    or finished there) before it counts as final.
    """

    def state() -> str | None:
        rows = sacct(cluster, jobid)
        s = rows[-1]["State"].split()[0] if rows else ""
        if s not in DONE:
            return None
        if job(cluster, jobid).get("JobState", s) not in DONE:  # e.g. PENDING again after a requeue
            return None
        return s

    def settled() -> str | None:
        first = state()
        if first is None:
            return None
        time.sleep(1.5)
        return first if state() == first else None

    return str(wait_until(f"job {jobid} to finish", settled, timeout))


def runs(cluster: SlurmCluster, jobid: str) -> list[str]:
    """States of every run of a job, oldest first (sacct -D), e.g. ['PREEMPTED', 'COMPLETED']."""
    return [r["State"].split()[0] for r in sacct(cluster, jobid, "-D")]


def hostnames(cluster: SlurmCluster, nodelist: str) -> list[str]:
    """`scontrol show hostnames` of a Slurm node list: Slurm's own expansion."""
    return cluster.run("scontrol", "show", "hostnames", nodelist).stdout.split()


def read_events(path: Path) -> list[tuple[str, str]]:
    """(event, run) pairs of a signal log; missing file -> []."""
    if not path.exists():
        return []
    return [tuple(line.split()[:2]) for line in path.read_text().splitlines() if line.strip()]  # type: ignore[misc]
