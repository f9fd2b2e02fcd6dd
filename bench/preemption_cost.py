"""Preemption cost on the local Slurm cluster (slurm/cluster/start.sh must be running; root).

    python bench/preemption_cost.py                 # GraceTime 0 and 10, with the user signal, 2 runs each

A 2-node job (1 task per node, `tests.tasks:SlowBlobTask`) is preempted by a job in the `high`
partition; from the run's ledger: signal -> checkpoint durable (every rank passes a barrier after it
and then exits), requeue -> first resumed step (Slurm's hold of cred_expire+1 s, the start, imports,
rendezvous and resume included), and steps lost (the stop step minus the resumed step: target 0).
"Every rank exited" is not measured apart: sacct's End of a preempted run is the preemption time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, median, report  # noqa: E402
from mgpu.record.ledger import read_ledger  # noqa: E402

CLUSTER = ROOT / "slurm" / "cluster"


def sh(*cmd: str, timeout: float = 60) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout, cwd=ROOT).stdout


def wait(what: str, predicate, timeout: float):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise TimeoutError(f"timed out waiting for {what}")


def events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_ledger(run_dir / "events.jsonl") if e["event"] == name]


def one_preemption(folder: Path) -> dict[str, float]:
    out = sh(sys.executable, "jobs/submit.py", "--cluster", "slurm", "--nodes", "2", "--gpus-per-node", "1",
             "--cpus-per-task", "4", "--partition", "main", "--folder", str(folder), "--time", "10",
             "task.target=tests.tasks:SlowBlobTask", "task.args.step_s=0.2", "train.epochs=12", "data.batch_size=4",
             "log.every_steps=1", "run.name=bench")
    job_id = next(line.split()[-1] for line in out.splitlines() if line.startswith("slurm job "))
    run_dir = folder / f"bench-{job_id}"
    try:
        wait("the job's 10th step", lambda: any(e["step"] >= 1 for e in events(run_dir, "first_step"))
             and len((run_dir / "logs" / "rank0.log").read_text().split(" step ")) > 10, 120)
        sh("sbatch", "-p", "high", "-N2", "-c4", "-o", "/dev/null", "--wrap", "sleep 1")
        wait("the resumed run's first step", lambda: len(events(run_dir, "first_step")) >= 2, 180)
        preempted = events(run_dir, "preempted")[0]
        saved = next(e for e in events(run_dir, "checkpoint_saved") if e["step"] == preempted["step"])
        resumed = events(run_dir, "resumed")[0]
        first_after = events(run_dir, "first_step")[1]
        requeued = events(run_dir, "requeued")
        signal_at = min(preempted["signal_times"])
        requeue_at = requeued[0]["time"] if requeued else signal_at  # GraceTime 0: Slurm requeues at the signal
        return {"signal_to_durable_s": saved["time"] - signal_at,
                "requeue_to_first_step_s": first_after["time"] - requeue_at,
                "steps_lost": preempted["step"] - resumed["step"]}
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graces", type=int, nargs="+", default=[0, 10])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--keep", default=None, help="parent of the temporary run folders")
    args = parser.parse_args()
    rows = []
    try:
        for grace in args.graces:
            sh("bash", str(CLUSTER / "policy.sh"), "--grace", str(grace), "--user-signal", "yes", timeout=120)
            with tempfile.TemporaryDirectory(dir=args.keep) as folder:
                results = [one_preemption(Path(folder)) for _ in range(args.runs)]
            rows.append({"grace_s": grace, **{k: median([r[k] for r in results]) for k in results[0]},
                         "runs": args.runs, "each": json.dumps(results)})
    finally:
        sh("bash", str(CLUSTER / "policy.sh"), "--grace", "0", "--user-signal", "yes", timeout=120)
    report("preemption_cost", rows)


if __name__ == "__main__":
    main()
