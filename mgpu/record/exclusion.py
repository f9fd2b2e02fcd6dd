"""Keeping a job off a node that hung it (or, with `stragglers.exclude_node`, that held it up: a straggler's): which
nodes to exclude, whether the job can still run, and `scontrol update ExcNodeList=` while the requeued job is
pending (Slurm refuses it on a running job).

A hang the watchdog (mgpu.stop.watchdog) pins on the ranks of one node is that node's doing as far as anyone
can tell: a requeued job that lands on it again hangs again. Excluding it is merged with what the user
excluded, and never leaves the job's partition with fewer usable nodes than the job needs.

Remembered across submissions (`remembered_nodes`): the run's ledger is its record of blamed nodes, with the
evidence: a hang pinned on one node, and a failure confined to one node of several (the others' errors only
said a peer went away). A node blamed in BLAMES_TO_EXCLUDE attempts is excluded at the next submission of the
run (jobs/submit.py says so, and writes one `node_decision` line); `--forget-node NODE` writes a `forgotten`
decision, from which its blames count afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

from mgpu.cluster.hostlist import HostlistError, expand_hostlist
from mgpu.cluster.slurm import SlurmClient, client

__all__ = ["BLAMES_TO_EXCLUDE", "Blamed", "ExclusionPlan", "NodeMemory", "apply_exclusion", "blamed_nodes",
           "exclude_straggler", "node_lines", "partition_nodes", "plan_exclusion", "remembered_nodes", "straggler_node",
           "unavailable_nodes"]

BLAMES_TO_EXCLUDE = 2
"""Attempts a node must be blamed in (since it was last forgotten) to be excluded at the next submission."""

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


def straggler_node(attempt: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    """(node, why) of the straggler an attempt's ledger events name for exclusion (its `straggler` event carries
    `exclude`: stragglers.exclude_node was on), unless a later `straggler_cleared` cleared it; None: none."""
    named: dict[Any, Mapping[str, Any]] = {}
    for event in attempt:
        if event.get("event") == "straggler" and event.get("exclude") is True and isinstance(event.get("node"), str):
            named[event.get("rank")] = event
        elif event.get("event") == "straggler_cleared":
            named.pop(event.get("rank"), None)
    if not named:
        return None
    from mgpu.record.stragglers import exclusion_reason

    def factor(event: Mapping[str, Any]) -> float:
        value = event.get("factor")
        return float(value) if isinstance(value, (int, float)) else 0.0

    worst = max(named.values(), key=factor)
    return str(worst["node"]), exclusion_reason(worst.get("rank"), worst.get("factor"))


def exclude_straggler(job_id: str, node: str, why: str, ledger: Any, slurm: SlurmClient | None = None) -> str:
    """Just after the job's requeue (pending now): exclude a straggler's `node` if the job's partition keeps the nodes
    it needs without it (never a reason to stay down); the `node_excluded` event when it is. One line either way
    (a Slurm that does not answer is said, not raised: the requeue stands)."""
    from mgpu.cluster.requeue import query_job
    from mgpu.cluster.slurm import SlurmError

    try:
        view = query_job(job_id)
        nodes = partition_nodes(view.partition, slurm)
        already = expand_hostlist(view.excluded) if view.excluded else []
        plan = plan_exclusion(node, already, nodes, view.num_nodes, unavailable_nodes(nodes, slurm))
        if plan.nodes is None:
            return f"{why}: not excluded: {plan.why}"
        apply_exclusion(job_id, plan.nodes, slurm)
    except (SlurmError, HostlistError) as error:
        return f"{why}: not excluded: {error}"
    ledger.write("node_excluded", node=node, excluded=list(plan.nodes), reason=why)
    return f"{why}: {plan.why}"


# ------------------------------------------------------------------------------------------ remembered
@dataclass
class Blamed:
    """A node's blames since it was last forgotten, one line of evidence each."""

    node: str
    evidence: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.evidence)


def _strings(value: Any) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []


def blamed_nodes(events: Sequence[Mapping[str, Any]]) -> dict[str, Blamed]:
    """Every node the run's events blame (the ledger with the ranks' failure records merged in, oldest first):
    a `hang` whose stuck ranks are on one host; an attempt of a job on several nodes whose ranks' own errors
    (not a peer's consequence, not bad input) all came from one host. A `node_decision` `forgotten` clears it."""
    blamed: dict[str, Blamed] = {}
    nodes: list[str] = []  # the current attempt's nodes (its `started` event)
    own: dict[str, str] = {}  # host -> first own error, in the current attempt
    where = ""

    def close_attempt() -> None:
        if len(nodes) > 1 and len(own) == 1:
            (host, error), = own.items()
            blamed.setdefault(host, Blamed(host)).evidence.append(f"failure on {host} alone{where}: {error[:160]}")
        own.clear()

    for event in events:
        name = event.get("event")
        if name == "started":
            close_attempt()
            nodes = _strings(event.get("nodes"))
            where = f" (job {event.get('job_id')} run {event.get('restart')})"
        elif name == "hang":
            hosts, ranks = _strings(event.get("hosts")), event.get("ranks")
            if ranks and len(hosts) == 1:
                blamed.setdefault(hosts[0], Blamed(hosts[0])).evidence.append(
                    f"hang: ranks {ranks} stuck after step {event.get('step')} (job {event.get('job_id')} run "
                    f"{event.get('restart')})")
        elif name == "failed" and isinstance(event.get("host"), str) and not event.get("consequence") \
                and event.get("retry") is not False:
            own.setdefault(event["host"], str(event.get("error", "")))
        elif name == "node_decision" and event.get("decision") == "forgotten":
            blamed.pop(str(event.get("node")), None)
    close_attempt()
    return blamed


def remembered_nodes(events: Sequence[Mapping[str, Any]], forget: Collection[str] = ()) -> dict[str, Blamed]:
    """The nodes to exclude at the next submission: blamed in BLAMES_TO_EXCLUDE attempts or more, less `forget`."""
    return {node: b for node, b in blamed_nodes(events).items()
            if b.count >= BLAMES_TO_EXCLUDE and node not in forget}


@dataclass
class NodeMemory:
    """What a submission does with the runs' remembered nodes: which to exclude (and why), which to forget."""

    runs: dict[Path, dict[str, Blamed]]
    """Run directory -> its nodes to exclude now."""
    forgotten: dict[Path, list[str]]
    """Run directory -> the `--forget-node` nodes it had blamed (their blames are cleared)."""

    @classmethod
    def read(cls, run_paths: Sequence[Path], forget: Collection[str]) -> "NodeMemory":
        from mgpu.record.failures import merge, read_failures
        from mgpu.record.ledger import read_ledger

        runs: dict[Path, dict[str, Blamed]] = {}
        forgotten: dict[Path, list[str]] = {}
        for path in run_paths:
            ledger = path / "events.jsonl"
            events = merge(read_ledger(ledger), read_failures(path)) if ledger.is_file() else []
            blamed = blamed_nodes(events)
            runs[path] = remembered_nodes(events, forget)
            forgotten[path] = sorted(node for node in forget if node in blamed)
        return cls(runs, forgotten)

    @property
    def excluded(self) -> list[str]:
        return sorted({node for nodes in self.runs.values() for node in nodes})

    def merged_exclude(self, user: str | None) -> str | None:
        """The sbatch --exclude: the user's node list and the remembered nodes."""
        extra = ",".join(self.excluded)
        return ",".join(part for part in (user, extra) if part) or None

    def lines(self) -> list[str]:
        """One line per decision, for the submit output."""
        lines = []
        for path, nodes in self.runs.items():
            for node, blamed in sorted(nodes.items()):
                lines.append(f"excluding {node}: blamed in {blamed.count} attempts of run {path} "
                             f"({'; '.join(blamed.evidence[-BLAMES_TO_EXCLUDE:])}); --forget-node {node} allows it "
                             f"again")
        for path, forgotten in self.forgotten.items():
            lines += [f"forgetting {node}'s blames in run {path} (--forget-node): it may be used again"
                      for node in forgotten]
        return lines

    def record(self) -> None:
        """Each decision, one `node_decision` line in its run's ledger (the submission's: no job id yet)."""
        from mgpu.record.ledger import Ledger

        for path in self.runs:
            ledger = Ledger(path / "events.jsonl") if (path / "events.jsonl").is_file() else None
            if ledger is None:
                continue
            for node in self.forgotten.get(path, []):
                ledger.write("node_decision", node=node, decision="forgotten", by="submit")
            for node, blamed in sorted(self.runs[path].items()):
                ledger.write("node_decision", node=node, decision="excluded", blames=blamed.count,
                             evidence=blamed.evidence, by="submit")


def node_lines(events: list[dict[str, Any]], now: float) -> list[str]:
    """The nodes this run blames (mgpu.record.exclusion: remembered across submissions) and the submissions' decisions."""
    from mgpu.record.goodput import duration

    lines = []
    for node, blamed in sorted(blamed_nodes(events).items()):
        then = ("excluded at the next submission" if blamed.count >= BLAMES_TO_EXCLUDE
                else f"excluded once blamed {BLAMES_TO_EXCLUDE} times")
        lines.append(f"bad node    {node}: blamed {blamed.count}x ({blamed.evidence[-1]}); {then} "
                     f"(--forget-node {node} clears it)")
    decisions = [e for e in events if e.get("event") == "node_decision"]
    for decision in decisions[-5:]:
        lines.append(f"node        {decision.get('node')} {decision.get('decision')} at a submission, "
                     f"{duration(now - decision['time'])} ago")
    return lines
