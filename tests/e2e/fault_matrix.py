"""The fault-injection matrix: every way a job stops, at every moment it can land, with and without
DataLoader workers, on the real test cluster. The scenarios are generated here (pure, seeded); they
run in tests/e2e/test_fault_matrix.py.

    python tests/e2e/fault_matrix.py                 # the whole matrix; writes docs/fault-matrix.md
    python tests/e2e/fault_matrix.py --ci            # the seeded subset CI runs (one per stop kind)
    python tests/e2e/fault_matrix.py --list          # the scenarios, without running them

Stop kinds: preemption with GraceTime 0 (Slurm requeues; the user signal, then TERM, KILL 5 s later),
preemption with GraceTime 10 and the user signal (the job requeues itself), `scancel`, `scancel
--signal=USR2`, the time limit's `--signal` lead, an outside `scontrol requeue`, one rank SIGKILLed,
the run's filesystem full for 4 s. Moments: the rendezvous (the job has just started), the first
step after a resume (an outside requeue first), mid-step, inside an evaluation, inside a checkpoint
write. The time limit's signal comes at Slurm's own 30 s check, so it has one moment: whenever it
lands (recorded as mid-step).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

KINDS = ("preempt-grace0", "preempt-grace10", "scancel", "scancel-usr2", "time-limit", "outside-requeue",
         "kill-rank", "disk-full")
MOMENTS = ("rendezvous", "first-step-after-resume", "mid-step", "evaluation", "checkpoint-write")
WORKERS = (0, 2)
CI_SEED = 20261123
SIGNAL_KINDS = frozenset(KINDS) - {"kill-rank", "disk-full"}
"""Stops that give the ranks a signal to save on: no step may be lost."""

ROOT = Path(__file__).resolve().parents[2]
REPORT_ENV = "MGPU_FAULT_REPORT"
SELECT_ENV = "MGPU_FAULT_MATRIX"


@dataclass(frozen=True)
class Scenario:
    kind: str
    moment: str
    workers: int

    @property
    def id(self) -> str:
        return f"{self.kind}@{self.moment}/w{self.workers}"


def all_scenarios() -> list[Scenario]:
    """Kinds x moments x workers, in a fixed order; the time limit at its one moment."""
    return [Scenario(kind, moment, workers) for kind, moment, workers in itertools.product(KINDS, MOMENTS, WORKERS)
            if kind != "time-limit" or moment == "mid-step"]


def ci_subset(seed: int = CI_SEED) -> list[Scenario]:
    """One scenario per stop kind, its moment and workers drawn with `seed`; every moment and both
    worker counts appear (the draw is repeated until they do)."""
    rng = random.Random(seed)
    by_kind = {kind: [s for s in all_scenarios() if s.kind == kind] for kind in KINDS}
    while True:
        picked = [rng.choice(by_kind[kind]) for kind in KINDS]
        if {s.moment for s in picked} == set(MOMENTS) and {s.workers for s in picked} == set(WORKERS):
            return picked


def selected(selection: str | None) -> list[Scenario]:
    """What `MGPU_FAULT_MATRIX` asks for: unset or `ci` (the CI subset), `all`, or `seed:N`."""
    if selection in (None, "", "ci"):
        return ci_subset()
    if selection == "all":
        return all_scenarios()
    if selection.startswith("seed:") and selection[5:].isdigit():
        return ci_subset(int(selection[5:]))
    raise ValueError(f"{SELECT_ENV}={selection!r}: use ci, all or seed:N")


def render(rows: list[dict]) -> str:
    """The README's table, from the rows test_fault_matrix.py appended to the report."""
    lines = ["| scenario | outcome (Slurm runs) | stops at step | steps lost | identical | seconds |",
             "|---|---|---|---|---|---|"]
    for row in sorted(rows, key=lambda r: r["order"]):
        lines.append(f"| {row['id']} | {row['outcome']} | {', '.join(map(str, row['stops'])) or '-'} | "
                     f"{row['lost']} | {'yes' if row['identical'] else 'NO'} | {row['seconds']:.0f} |")
    failed = [r["id"] for r in rows if not r["passed"]]
    lines.append("")
    lines.append(f"{len(rows)} scenarios, {len(rows) - len(failed)} passed"
                 + (f"; failed: {', '.join(failed)}" if failed else "") + ".")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ci", action="store_true", help="only the seeded subset CI runs")
    parser.add_argument("--seed", type=int, help="a seeded subset (one scenario per kind) other than CI's")
    parser.add_argument("--list", action="store_true", help="print the scenarios and exit")
    parser.add_argument("--out", default=str(ROOT / "docs" / "fault-matrix.md"), help="the table (markdown)")
    args = parser.parse_args()
    selection = "ci" if args.ci else f"seed:{args.seed}" if args.seed is not None else "all"
    scenarios = selected(selection)
    if args.list:
        print("\n".join(s.id for s in scenarios))
        return 0
    report = Path(args.out).with_suffix(".jsonl")
    report.unlink(missing_ok=True)
    env = dict(os.environ, **{SELECT_ENV: selection, REPORT_ENV: str(report), "OMP_NUM_THREADS": "1"})
    rc = subprocess.run([sys.executable, "-m", "pytest", "tests/e2e/test_fault_matrix.py", "-q", "-p",
                         "no:cacheprovider"], cwd=ROOT, env=env).returncode
    rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    header = (f"# Fault matrix\n\nGenerated by `python tests/e2e/fault_matrix.py"
              f"{' --ci' if args.ci else f' --seed {args.seed}' if args.seed is not None else ''}` on the "
              f"local test cluster (2 nodes x 1 rank, gloo).\n\n")
    Path(args.out).write_text(header + render(rows))
    print(f"{len(rows)} scenarios; table in {args.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
