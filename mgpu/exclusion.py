"""Keeping a job off a node that hung it: which nodes to exclude, whether the job can still run, and
`scontrol update ExcNodeList=` while the requeued job is pending (Slurm refuses it on a running job).

A hang the watchdog (mgpu.watchdog) pins on the ranks of one node is that node's doing as far as anyone
can tell: a requeued job that lands on it again hangs again. Excluding it is merged with what the user
excluded, and never leaves the job's partition with fewer usable nodes than the job needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

from mgpu.hostlist import HostlistError, expand_hostlist
from mgpu.slurm import SlurmClient, client

__all__ = ["ExclusionPlan", "apply_exclusion", "partition_nodes", "plan_exclusion", "unavailable_nodes"]

# Node states (and flags) in which a node takes no new job: Slurm would hold a job that needs it pending.
_UNAVAILABLE = {"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "FUTURE", "NOT_RESPONDING", "INVAL",
                "INVALID_REG"}


@dataclass(frozen=True)
class ExclusionPlan:
    """`nodes`: the job's whole exclusion list to set (None: do not exclude); `why`: one line either way."""

    nodes: tuple[str, ...] | None
    why: str


def plan_exclusion(bad: str, already: Sequence[str], partition: Sequence[str], needed: int,
                   unavailable: Collection[str] = ()) -> ExclusionPlan:
    """Exclude `bad` on top of `already`, if the partition keeps `needed` nodes that are neither excluded
    nor `unavailable` (down, drained: see `unavailable_nodes`)."""
    merged = tuple(sorted({*already, bad}))
    usable = [node for node in partition if node not in merged and node not in unavailable]
    if bad in already:
        return ExclusionPlan(None, f"{bad} was already excluded")
    if partition and len(usable) < needed:
        down = sorted(node for node in partition if node in unavailable and node not in merged)
        return ExclusionPlan(None, f"excluding {bad} would leave {len(usable)} of the {needed} nodes the job needs "
                                   f"in its partition ({', '.join(usable) or 'none'}"
                                   + (f"; down or drained: {', '.join(down)})" if down else ")"))
    return ExclusionPlan(merged, f"excluding {bad} (now excluded: {', '.join(merged)})")


def unavailable_nodes(nodes: Sequence[str], slurm: SlurmClient | None = None) -> set[str]:
    """Those of `nodes` that take no new job now (down, drained or draining, failing, not responding);
    none when Slurm cannot say (the plan then counts them as usable, as before)."""
    if not nodes:
        return set()
    wanted, found = set(nodes), set()
    for line in (slurm or client()).show_nodes(nodes).splitlines():
        fields = dict(token.split("=", 1) for token in line.split() if "=" in token)
        state = fields.get("State", "")
        flags = {flag.rstrip("*~#!%$@^-") for flag in state.split("+")}
        if fields.get("NodeName") in wanted and (flags & _UNAVAILABLE or "*" in state):  # '*': not responding
            found.add(fields["NodeName"])
    return found


def partition_nodes(partition: str, slurm: SlurmClient | None = None) -> list[str]:
    """The nodes of a Slurm partition ([] when they cannot be read)."""
    if not partition:
        return []
    text = (slurm or client()).show_partition(partition.split(",")[0])
    fields = dict(token.split("=", 1) for token in text.split() if "=" in token)
    try:
        return expand_hostlist(fields.get("Nodes", "")) if fields.get("Nodes") not in (None, "", "(null)") else []
    except HostlistError:
        return []


def apply_exclusion(job_id: str, nodes: Sequence[str], slurm: SlurmClient | None = None) -> None:
    """Set the job's ExcNodeList (the job must be pending: right after `scontrol requeue`)."""
    (slurm or client()).exclude(job_id, nodes)
