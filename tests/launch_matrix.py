"""The launch matrix: the core guarantee (a stop mid-epoch with 2 DataLoader workers, then the same command, ends
bit-identical to an unbroken run) under every way ranks are started and every way their workers start, for the
trainer and for a loop of one's own. The cells are generated here (pure, seeded); tests/test_launch_matrix.py runs
the local ones, tests/e2e/test_launch_matrix.py the srun ones (real Slurm).

    python tests/launch_matrix.py            # every cell (both test files, MGPU_LAUNCH_MATRIX=all), timed
    python tests/launch_matrix.py --list     # the cells, and the ones CI runs
    MGPU_LAUNCH_MATRIX=7 pytest ...          # the covering subset seed 7 draws (unset: CI's seed)

Launchers: `srun` (slurm/train.sbatch, slurm/loop.sbatch; stopped by a preemption), `torchrun`, `spawn`
(`python -m mgpu.run.spawn -n 2`), `submit-local` (`jobs/submit.py --cluster local`, the trainer only). Worker start
methods: `default` (Python's: fork here), `spawn` and `forkserver` (the trainer's `data.worker_start_method`; the
loop calls `torch.multiprocessing.set_start_method`, as CUDA code often does). A local cell is stopped by a signal
as its user sends it: SIGTERM to the launcher alone (a script's or a scheduler's kill) or SIGINT to its whole process
group (a terminal's Ctrl-C), alternating along the matrix so that each launcher meets both.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PROGRAMS = ("trainer", "loop")
LAUNCHERS = ("srun", "torchrun", "spawn", "submit-local")
START_METHODS = ("default", "spawn", "forkserver")
SIGNALS = ("sigterm", "ctrl-c")
CI_SEED = 20261128
SELECT_ENV = "MGPU_LAUNCH_MATRIX"
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Cell:
    program: str
    launcher: str
    start_method: str
    signal: str  # local launchers: how the stop is sent; srun: a preemption (Slurm sends the signals)

    @property
    def id(self) -> str:
        how = "preempted" if self.launcher == "srun" else self.signal
        return f"{self.program}/{self.launcher}/{self.start_method}/{how}"


def all_cells() -> list[Cell]:
    """Programs x launchers x start methods, in a fixed order (`jobs/submit.py` runs the trainer only); the signal
    alternates along each launcher's cells."""
    cells = []
    for launcher in LAUNCHERS:
        pairs = [(program, method) for program, method in itertools.product(PROGRAMS, START_METHODS)
                 if not (launcher == "submit-local" and program == "loop")]
        cells += [Cell(program, launcher, method, SIGNALS[i % 2]) for i, (program, method) in enumerate(pairs)]
    return cells


def covering_subset(seed: int) -> list[Cell]:
    """One cell per launcher, drawn with `seed`, such that every start method, both programs and both signals are
    among them: the fewest cells that still vary each dimension."""
    rng = random.Random(seed)
    by_launcher = {launcher: [c for c in all_cells() if c.launcher == launcher] for launcher in LAUNCHERS}
    local = [launcher for launcher in LAUNCHERS if launcher != "srun"]
    while True:
        pick = [rng.choice(by_launcher[launcher]) for launcher in LAUNCHERS]
        if ({c.start_method for c in pick} == set(START_METHODS) and {c.program for c in pick} == set(PROGRAMS)
                and {c.signal for c in pick if c.launcher in local} == set(SIGNALS)):
            return pick


def selected(selection: str | None = None) -> list[Cell]:
    """`MGPU_LAUNCH_MATRIX`: unset, CI's covering subset; `all`, every cell; a number, that seed's subset."""
    selection = os.environ.get(SELECT_ENV, "") if selection is None else selection
    if selection == "all":
        return all_cells()
    if selection and not selection.isdigit():
        raise SystemExit(f"{SELECT_ENV}={selection!r}: 'all', or a seed (a whole number)")
    return covering_subset(int(selection) if selection else CI_SEED)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the cells and CI's subset, run nothing")
    args = parser.parse_args(argv)
    ci = {c.id for c in covering_subset(CI_SEED)}
    if args.list:
        for cell in all_cells():
            print(f"{cell.id:42s}{'  CI' if cell.id in ci else ''}")
        return 0
    started = time.monotonic()
    python = str(ROOT / ".venv" / "bin" / "python")
    rc = subprocess.call([python if os.path.exists(python) else sys.executable, "-m", "pytest",
                          "tests/test_launch_matrix.py", "tests/e2e/test_launch_matrix.py"], cwd=ROOT,
                         env={**os.environ, SELECT_ENV: "all"})
    print(f"launch matrix: {len(all_cells())} cells, exit {rc}, {time.monotonic() - started:.0f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
