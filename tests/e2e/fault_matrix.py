"""The fault-injection matrix: every way a job stops, at every moment it can land, with and without
DataLoader workers, on the real test cluster; for the stops the issue of FSDP2 names (preemption at GraceTime
0 and 10, a killed rank, a full disk), also with FSDP2 (`train.parallel=fsdp`, sharded checkpoints). The
scenarios are generated here (pure, seeded); they run in tests/e2e/test_fault_matrix.py.

    python tests/e2e/fault_matrix.py                 # the whole matrix; writes docs/fault-matrix.md and
                                                     # the summary in docs/preemption.md (between its markers)
    python tests/e2e/fault_matrix.py --ci            # the seeded subset CI runs (one per stop kind)
    python tests/e2e/fault_matrix.py --fsdp          # the FSDP2 rows alone
    python tests/e2e/fault_matrix.py --list          # the scenarios, without running them

Stop kinds: preemption with GraceTime 0 (Slurm requeues; the user signal, then TERM, KILL 5 s later),
preemption with GraceTime 10 and the user signal (the job requeues itself), `scancel`, `scancel
--signal=USR2`, the time limit's `--signal` lead, an outside `scontrol requeue`, one rank SIGKILLed,
the run's own filesystem (`run.dir`; the job's output is elsewhere) full from that moment until a
write has met it and said so (at least 4 s, at most 94 s); and, FSDP2 alone (one row), one rank late past
the ranks' wait at one sharded save (`late-rank`: that save fails naming it, every later save and the stop's
after an outside requeue are durable). Moments: the rendezvous (the job has just
started; for a killed rank or a full disk, its processes have), the first step after a resume (an
outside requeue first), mid-step, inside an evaluation, inside a checkpoint write. The time limit's signal comes at Slurm's own 30 s check, so it has one moment: whenever it
lands (recorded as mid-step).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

KINDS = ("preempt-grace0", "preempt-grace10", "scancel", "scancel-usr2", "time-limit", "outside-requeue",
         "kill-rank", "disk-full")
MOMENTS = ("rendezvous", "first-step-after-resume", "mid-step", "evaluation", "checkpoint-write")
WORKERS = (0, 2)
FSDP_KINDS = ("preempt-grace0", "preempt-grace10", "kill-rank", "disk-full")
"""The kinds that also run with FSDP2: the ways a sharded save can be cut short or never come."""
LATE_RANK = "late-rank"
"""FSDP2 alone, one row: rank 1 writes its shard of one save past the ranks' wait (a save's own failure)."""
CI_SEED = 20261123
SIGNAL_KINDS = frozenset(KINDS) - {"kill-rank", "disk-full"} | {LATE_RANK}
"""Stops that give the ranks a signal to save on: no step may be lost."""

ROOT = Path(__file__).resolve().parents[2]
REPORT_ENV = "MGPU_FAULT_REPORT"
SELECT_ENV = "MGPU_FAULT_MATRIX"
BEGIN, END = "<!-- fault-matrix -->", "<!-- /fault-matrix -->"
"""docs/preemption.md's block that `publish` replaces with the whole matrix's summary."""


@dataclass(frozen=True)
class Scenario:
    kind: str
    moment: str
    workers: int
    parallel: str = "ddp"  # or "fsdp": FSDP2 with sharded checkpoints

    @property
    def id(self) -> str:
        return f"{self.kind}@{self.moment}/w{self.workers}" + ("/fsdp" if self.parallel == "fsdp" else "")


def all_scenarios() -> list[Scenario]:
    """Kinds x moments x workers, in a fixed order; the time limit at its one moment; then the FSDP2 rows, the
    late rank's last."""
    ddp = [Scenario(kind, moment, workers) for kind, moment, workers in itertools.product(KINDS, MOMENTS, WORKERS)
           if kind != "time-limit" or moment == "mid-step"]
    return ddp + [dataclasses.replace(s, parallel="fsdp") for s in ddp if s.kind in FSDP_KINDS] + [
        Scenario(LATE_RANK, "checkpoint-write", 0, "fsdp")]


def ci_subset(seed: int = CI_SEED) -> list[Scenario]:
    """One scenario per stop kind, its moment and workers drawn with `seed`; every moment and both
    worker counts appear (the draw is repeated until they do); then one of the picks whose kind has FSDP2 rows
    runs with FSDP2 (drawn too), so that every CI run trains one sharded job through a fault."""
    rng = random.Random(seed)
    by_kind = {kind: [s for s in all_scenarios() if s.kind == kind and s.parallel == "ddp"] for kind in KINDS}
    while True:
        picked = [rng.choice(by_kind[kind]) for kind in KINDS]
        if {s.moment for s in picked} == set(MOMENTS) and {s.workers for s in picked} == set(WORKERS):
            break
    sharded = rng.choice([i for i, s in enumerate(picked) if s.kind in FSDP_KINDS])
    picked[sharded] = dataclasses.replace(picked[sharded], parallel="fsdp")
    return picked


def selected(selection: str | None) -> list[Scenario]:
    """What `MGPU_FAULT_MATRIX` asks for: unset or `ci` (the CI subset), `all`, `fsdp` (its FSDP2 rows), or
    `seed:N`."""
    if selection in (None, "", "ci"):
        return ci_subset()
    if selection == "all":
        return all_scenarios()
    if selection == "fsdp":
        return [s for s in all_scenarios() if s.parallel == "fsdp"]
    if selection.startswith("seed:") and selection[5:].isdigit():
        return ci_subset(int(selection[5:]))
    raise ValueError(f"{SELECT_ENV}={selection!r}: use ci, all, fsdp or seed:N")


def render(rows: list[dict]) -> str:
    """docs/fault-matrix.md's table, from the rows test_fault_matrix.py appended to the report; each
    failed scenario is listed after it with the line it failed on."""
    lines = ["| scenario | outcome (Slurm runs) | stops at step | steps lost | identical | seconds |",
             "|---|---|---|---|---|---|"]
    for row in sorted(rows, key=lambda r: r["order"]):
        lines.append(f"| {row['id']} | {row['outcome'] or '-'} | {', '.join(map(str, row['stops'])) or '-'} | "
                     f"{row['lost']} | {'yes' if row['identical'] else 'NO'} | {row['seconds']:.0f} |")
    failed = [r for r in sorted(rows, key=lambda r: r["order"]) if not r["passed"]]
    lines.append("")
    lines.append(f"{len(rows)} scenarios, {len(rows) - len(failed)} passed"
                 + (f"; failed: {', '.join(r['id'] for r in failed)}" if failed else "") + ".")
    if failed:
        lines += ["", "Failures:", ""] + [f"- {r['id']}: {r.get('error') or 'no reason recorded'}" for r in failed]
    return "\n".join(lines) + "\n"


def summarize(rows: list[dict]) -> str:
    """The summary's compact table: per stop kind, its scenarios, their outcomes, passes, median seconds."""
    lines = ["| stop kind | scenarios | outcomes (Slurm's runs: count) | passed | median seconds |",
             "|---|---|---|---|---|"]
    for kind in [*KINDS, *(f"{k} (FSDP2)" for k in (*FSDP_KINDS, LATE_RANK))]:
        mine = [r for r in rows if r["id"].split("@")[0] + (" (FSDP2)" if r["id"].endswith("/fsdp") else "") == kind]
        if not mine:
            continue
        outcomes = collections.Counter(r["outcome"] or "-" for r in mine)
        shown = "; ".join(f"{outcome}: {count}" for outcome, count in sorted(outcomes.items(), key=lambda o: -o[1]))
        lines.append(f"| {kind} | {len(mine)} | {shown} | {sum(r['passed'] for r in mine)} of {len(mine)} | "
                     f"{statistics.median(r['seconds'] for r in mine):.0f} |")
    return "\n".join(lines) + "\n"


def publish(page: str, rows: list[dict], command: str, when: str) -> str:
    """`page` with the text between BEGIN and END replaced by the summary of `rows`; ValueError without
    the markers (nothing else is touched)."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no {BEGIN} ... {END} block to fill")
    passed = sum(r["passed"] for r in rows)
    block = (f"{BEGIN}\nThe whole matrix, `{command}` ({when}): {len(rows)} scenarios, {passed} passed, "
             f"{sum(r['seconds'] for r in rows) / 60:.0f} minutes. Every scenario's row, and why any failed: "
             f"[fault-matrix.md](fault-matrix.md).\n\n{summarize(rows)}")
    return page[:start] + block + page[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--ci", action="store_true", help="only the seeded subset CI runs")
    parser.add_argument("--seed", type=int, help="a seeded subset (one scenario per kind) other than CI's")
    parser.add_argument("--fsdp", action="store_true", help="only the FSDP2 rows")
    parser.add_argument("--list", action="store_true", help="print the scenarios and exit")
    parser.add_argument("--out", default=str(ROOT / "docs" / "fault-matrix.md"), help="the table (markdown)")
    parser.add_argument("--summary", default=str(ROOT / "docs" / "preemption.md"),
                        help="the page whose fault-matrix block gets the summary (the whole matrix only; '' for none)")
    args = parser.parse_args()
    selection = ("ci" if args.ci else "fsdp" if args.fsdp else f"seed:{args.seed}" if args.seed is not None
                 else "all")
    scenarios = selected(selection)
    if args.list:
        print("\n".join(s.id for s in scenarios))
        return 0
    command = "python tests/e2e/fault_matrix.py" + (" --ci" if args.ci else " --fsdp" if args.fsdp
                                                     else f" --seed {args.seed}" if args.seed is not None else "")
    with tempfile.TemporaryDirectory(prefix="fault-matrix-") as scratch:  # the rows, one JSON line each
        report = Path(scratch) / "rows.jsonl"
        env = dict(os.environ, **{SELECT_ENV: selection, REPORT_ENV: str(report), "OMP_NUM_THREADS": "1"})
        rc = subprocess.run([sys.executable, "-m", "pytest", "tests/e2e/test_fault_matrix.py", "-q", "-p",
                             "no:cacheprovider"], cwd=ROOT, env=env).returncode
        rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    when = time.strftime("%Y-%m-%d")
    header = (f"# Fault matrix\n\nGenerated by `{command}` on {when}, on the local test cluster (2 nodes x 1 rank, "
              f"gloo, 2 shared CPU cores). How each scenario runs and what it checks: "
              f"tests/e2e/test_fault_matrix.py.\n\n")
    Path(args.out).write_text(header + render(rows))
    print(f"{len(rows)} scenarios; table in {args.out}")
    if selection == "all" and args.summary and rows:
        page = Path(args.summary)
        page.write_text(publish(page.read_text(), rows, command, when))
        print(f"summary in {page}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
