"""Keeping a job off a node that hung it: which nodes to exclude, whether the job can still run, and
`scontrol update ExcNodeList=` while the requeued job is pending (Slurm refuses it on a running job).

A hang the watchdog (mgpu.watchdog) pins on the ranks of one node is that node's doing as far as anyone
can tell: a requeued job that lands on it again hangs again. Excluding it is merged with what the user
excluded, and never leaves the job's partition with fewer usable nodes than the job needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from mgpu.hostlist import HostlistError, expand_hostlist
from mgpu.requeue import RequeueError, Runner, _run, _scontrol

__all__ = ["ExclusionPlan", "apply_exclusion", "partition_nodes", "plan_exclusion"]


@dataclass(frozen=True)
class ExclusionPlan:
    """`nodes`: the job's whole exclusion list to set (None: do not exclude); `why`: one line either way."""

    nodes: tuple[str, ...] | None
    why: str


def plan_exclusion(bad: str, already: Sequence[str], partition: Sequence[str], needed: int) -> ExclusionPlan:
    """Exclude `bad` on top of `already`, if the partition keeps `needed` nodes that are not excluded."""
    merged = tuple(sorted({*already, bad}))
    usable = [node for node in partition if node not in merged]
    if bad in already:
        return ExclusionPlan(None, f"{bad} was already excluded")
    if partition and len(usable) < needed:
        return ExclusionPlan(None, f"excluding {bad} would leave {len(usable)} of the {needed} nodes the job needs "
                                   f"in its partition ({', '.join(usable) or 'none'})")
    return ExclusionPlan(merged, f"excluding {bad} (now excluded: {', '.join(merged)})")


def partition_nodes(partition: str, run: Runner = _run) -> list[str]:
    """The nodes of a Slurm partition ([] when they cannot be read)."""
    if not partition:
        return []
    proc = run([_scontrol(), "show", "partition", "-o", partition.split(",")[0]])
    fields = dict(token.split("=", 1) for token in proc.stdout.split() if "=" in token) if proc.returncode == 0 else {}
    try:
        return expand_hostlist(fields.get("Nodes", "")) if fields.get("Nodes") not in (None, "", "(null)") else []
    except HostlistError:
        return []


def apply_exclusion(job_id: str, nodes: Sequence[str], run: Runner = _run) -> None:
    """Set the job's ExcNodeList (the job must be pending: right after `scontrol requeue`)."""
    proc = run([_scontrol(), "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"])
    if proc.returncode != 0:
        raise RequeueError(f"scontrol update JobId={job_id} ExcNodeList={','.join(nodes)} failed: "
                           f"{(proc.stderr or proc.stdout).strip()}")
