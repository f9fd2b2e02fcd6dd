"""What the defaults that make a lost rank cost at most a step cost (checkpoint.memory_every_steps at its default:
every step's marks and generators re-seeded, a survivor's save ready, rank 0's buffer record, snapshots at the
cadence their cost allows) against snapshots off (checkpoint.memory_every_steps=0), side by side in one run, on a
loop of one's own (bench/overhead_loop.py: an MLP with batch norm) and on the trainer (jobs/train.py, bench.tasks'
MLP), each a fresh 2-rank job under `python -m mgpu.run.spawn`, the variants' order rotated every repeat.

    python bench/failure_overhead.py [--repeats 8] [--steps 300] [--hidden 1024]

The figure: the ratio of mean step times (mean over a run's steps after a warm-up: the steps with a snapshot are
the slow ones, a median would hide them), the median over repeats of the paired ratios, with their least and
greatest; the trainer's step ends are its ledger's `progress` events (log.every_steps=1, in both variants).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, report  # noqa: E402

WARMUP = 10
VARIANTS = {"defaults": "default", "snapshots off": "0"}


def run_loop(workdir: Path, steps: int, hidden: int, memory: str) -> list[float]:
    out = workdir / "ends"
    cmd = [sys.executable, "-m", "mgpu.run.spawn", "-n", "2", str(ROOT / "bench" / "overhead_loop.py"),
           str(workdir / "run"), str(out), f"--steps={steps}", f"--hidden={hidden}", f"--memory-every-steps={memory}"]
    subprocess.run(cmd, check=True, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL)
    return json.loads(Path(f"{out}.rank0.json").read_text())["ends"]


def run_trainer(workdir: Path, steps: int, hidden: int, memory: str) -> list[float]:
    from mgpu.record.ledger import read_ledger

    batch = 64
    overrides = ["task.target=bench.tasks:BenchTask", f"task.args.size={steps * batch * 2}", f"task.args.hidden={hidden}",
                 f"data.batch_size={batch}", "train.epochs=1", "log.every_steps=1", "log.tensorboard=false",
                 "checkpoint.every_steps=0", *([] if memory == "default" else [f"checkpoint.memory_every_steps={memory}"])]
    cmd = [sys.executable, "-m", "mgpu.run.spawn", "-n", "2", str(ROOT / "jobs" / "train.py"),
           f"run.dir={workdir / 'run'}", *overrides]
    subprocess.run(cmd, check=True, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL)
    return [e["time"] for e in read_ledger(workdir / "run" / "events.jsonl") if e["event"] == "progress"]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")


def mean_step(ends: list[float]) -> float:
    steady = ends[WARMUP:]
    return (steady[-1] - steady[0]) / (len(steady) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--programs", nargs="+", default=["loop", "trainer"], choices=["loop", "trainer"])
    args = parser.parse_args()
    runners = {"loop": run_loop, "trainer": run_trainer}
    rows = []
    for program in args.programs:
        means: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for repeat in range(args.repeats):
            order = list(VARIANTS) if repeat % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                with tempfile.TemporaryDirectory() as workdir:
                    means[name].append(mean_step(runners[program](Path(workdir), args.steps, args.hidden,
                                                                  VARIANTS[name])))
        paired = [d / o for d, o in zip(means["defaults"], means["snapshots off"])]
        rows.append({"program": program, "defaults_step_ms": round(statistics.median(means["defaults"]) * 1e3, 3),
                     "off_step_ms": round(statistics.median(means["snapshots off"]) * 1e3, 3),
                     "ratio_median": round(statistics.median(paired), 4), "ratio_min": round(min(paired), 4),
                     "ratio_max": round(max(paired), 4), "repeats": args.repeats, "steps": args.steps,
                     "per_repeat": [round(r, 4) for r in paired]})
    report("failure_overhead", rows)


if __name__ == "__main__":
    main()
