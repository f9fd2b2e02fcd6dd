"""Hang detection on the local Slurm cluster (slurm/cluster/start.sh must be running; root).

    python bench/hang_detection.py            # 2 runs of each way back, 3 s floor
    python bench/hang_detection.py --floor 60 --ways exclude --runs 1 --out bench/results/hang_detection_floor60.json

A 2-rank job whose rank 1 falls asleep inside its loss at step 6 (tests.tasks:HangingBlobTask, once),
with the watchdog's default multiple (10 x the median step time of 0.2 s) and a 3 s floor (`--floor`;
the default floor, 60 s, adds a constant: `--floor 60` measures it). From the marker the task writes as it stalls, the ledger and
sacct: stall -> hang detected (the `hang` event), stall -> every rank exited (the step's end in sacct),
and the way back to the first resumed step, both ways mgpu takes:
- `exclude`: a 1-node job, whose node is excluded; Slurm's requeue hold (cred_expire + 1 s here,
  minutes on production clusters) and a start on the other node;
- `restart`: a 2-node job whose hang nobody can be blamed for (every rank asleep at the same call):
  the step starts again in the same allocation, with no requeue hold.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402
from mgpu.record.ledger import read_ledger  # noqa: E402

SLOW = ["task.target=tests.tasks:HangingBlobTask", "task.args.step_s=0.2", "task.args.mode=sleep", "task.args.at=6",
        "train.epochs=3", "data.batch_size=2", "log.every_steps=1", "checkpoint.every_steps=2"]
WAYS = {"exclude": (["--nodes", "1", "--gpus-per-node", "2"], "task.args.rank=1"),
        "restart": (["--nodes", "2", "--gpus-per-node", "1", "--cpus-per-task", "4"], "task.args.rank=-1")}


def _sacct(job: str, *fields: str) -> list[list[str]]:
    out = subprocess.run(["sacct", "-n", "-P", "-D", "-j", job, "-o", ",".join(fields)], capture_output=True,
                         text=True, check=True).stdout
    return [line.split("|") for line in out.splitlines() if line]


def _epoch(slurm_time: str) -> float:
    return time.mktime(time.strptime(slurm_time, "%Y-%m-%dT%H:%M:%S"))


def one(way: str, folder: Path, floor: float) -> dict[str, float]:
    resources, who = WAYS[way]
    marker = folder / "hung"
    cmd = [sys.executable, str(ROOT / "jobs" / "submit.py"), "--cluster", "slurm", "--partition", "main", "--time",
           "10", "--folder", str(folder), *resources, *SLOW, f"watchdog.floor_s={floor:g}", who,
           f"task.args.hang_file={marker}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    job = next(line.split()[-1] for line in out.splitlines() if line.startswith("slurm job "))
    run_dir = folder / "run"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        events = read_ledger(run_dir / "events.jsonl")
        if any(e["event"] == "finished" for e in events):
            break
        time.sleep(1)
    else:
        subprocess.run(["scancel", job])
        raise SystemExit(f"{way}: job {job} did not finish")
    stalled = min(p.stat().st_mtime for p in folder.glob("hung.rank*"))
    hang = next(e for e in events if e["event"] == "hang")
    first_step_ends: list[float] = []
    for _ in range(30):  # accounting lags the job by a moment
        first_step_ends = sorted(_epoch(end) for name, _, end in _sacct(job, "JobID", "Start", "End")
                                 if name.startswith(f"{job}.") and name.split(".")[-1].isdigit() and end[:1].isdigit())
        if first_step_ends:
            break
        time.sleep(1)
    resumed = [e for e in events if e["event"] == "first_step"][-1]
    return {"detected_s": round(hang["time"] - stalled, 2), "exited_s": round(first_step_ends[0] - stalled, 2),
            "back_s": round(resumed["time"] - stalled, 2), "waited_s": hang["waited_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--floor", type=float, default=3.0, help="watchdog.floor_s (default 3; mgpu's default: 60)")
    parser.add_argument("--ways", nargs="+", choices=sorted(WAYS), default=list(WAYS), help="the ways back to measure")
    parser.add_argument("--out", help="the JSON file (default bench/results/hang_detection.json)")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    for way in args.ways:
        results[way] = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix=f"hang-{way}-") as folder:
                results[way].append(one(way, Path(folder), args.floor))
    rows = [{"way back": way, "floor_s": args.floor, "runs": len(runs),
             **{f"median {key}": statistics.median(r[key] for r in runs) for key in runs[0]}}
            for way, runs in results.items()]
    report("hang_detection", rows, Path(args.out) if args.out else None)  # sacct's times: 1 s resolution
    return 0


if __name__ == "__main__":
    sys.exit(main())
