"""Startup: `jobs/submit.py --help` and `--dry-run` wall time (target <= 0.5 s: no torch import), and
process start -> first training step, locally on the CPU.

    python bench/startup.py            # 7 runs of each, medians
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, median, report  # noqa: E402

PY = sys.executable


def wall(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def first_step(env: dict[str, str], run_dir: str) -> float:
    """From process start to the log line of step 1 (single process, the built-in default task)."""
    cmd = [PY, "jobs/train.py", f"run.dir={run_dir}", "log.every_steps=1", "train.max_steps=1"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = None
    for line in proc.stdout:
        if seen is None and " step 1/" in line:
            seen = time.perf_counter() - start
    proc.wait()
    if seen is None:
        raise RuntimeError("no 'step 1/' line: did training start?")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    folder = tempfile.mkdtemp(prefix="mgpu-bench-")
    commands = {
        "python -c pass (baseline)": [PY, "-c", "pass"],
        "python -c 'import torch' (for scale)": [PY, "-c", "import torch"],
        "jobs/submit.py --help": [PY, "jobs/submit.py", "--help"],
        "jobs/submit.py --dry-run": [PY, "jobs/submit.py", "--cluster", "slurm", "--nodes", "2", "--gpus-per-node", "4",
                                     "--config", "jobs/configs/mnist.yaml", "--folder", folder, "--dry-run"],
    }
    rows = []
    for name, cmd in commands.items():
        times = [wall(cmd, env) for _ in range(args.runs)]
        rows.append({"what": name, "median_s": median(times), "target_s": 0.5 if "submit" in name else "",
                     "runs": args.runs})
    with tempfile.TemporaryDirectory() as run_dir:
        times = []
        for index in range(max(3, args.runs // 2)):
            times.append(first_step(env, f"{run_dir}/r{index}"))
        rows.append({"what": "jobs/train.py: process start -> step 1", "median_s": median(times), "target_s": "",
                     "runs": len(times)})
    report("startup", rows)


if __name__ == "__main__":
    main()
