"""Host memory at resume and during a save, against the checkpoint's size: the PSS of every process of the
node's ranks (shared pages, such as one memory-mapped checkpoint, counted once), sampled by a watcher
process, and each rank's VmHWM (peak RSS, which counts shared pages in full on every rank).

    OMP_NUM_THREADS=1 python bench/resume_memory.py                # 2 ranks, a ~300 MB checkpoint, 3 resumes
    OMP_NUM_THREADS=1 python bench/resume_memory.py --ranks 4 --hidden 3000

The job: `jobs/train.py` on bench.tasks:BenchTask (an MLP of `--hidden` width with AdamW: the checkpoint is
about 12 bytes per parameter) under torchrun. One run stops after step 2 (a stop's checkpoint); then each
measured run resumes from the previous one's, saves in the background at its first step (the periodic
save: a snapshot into staging buffers, written by a thread) and stops at its second (the stop's save).
Phases come from the ledger (`first_step` timings, `checkpoint_saved` events), samples from the watcher:

  before load      the last sample before rank 0 looks for the checkpoint (model and optimizer built)
  loaded           the highest sample from then until every state_dict is loaded (before the first step)
  to training      the highest sample from `before load` until the run's first save starts: the load plus
                   what training takes once it runs (AdamW's state, gradients, DDP's buckets: on a CPU
                   every rank's own), against the same for the stopped run, a new run (nothing loaded);
                   their difference is what the resume costs beyond a new run
  save             rank 0's rise in PSS while its background save is in flight (highest sample less the last
                   before), less rank 1's over the same time (the same steps, no save)

The figures, in checkpoints per node: loaded - before load, and the resume's extra to training: what the
resume costs in host memory (target: about one checkpoint per node, not one per rank); the save's: the
staging buffer and the writer (target: bounded, at most one copy of the state on the node).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, median, report  # noqa: E402

PY = sys.executable
TORCHRUN = str(Path(PY).parent / "torchrun")
MB = 1 << 20


# ------------------------------------------------------------------------------------------ the watcher
def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def _kib(path: Path, field: str) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _rank(pid: int) -> str:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return "?"
    ranks = [item.split(b"=", 1)[1].decode() for item in env if item.startswith(b"RANK=")]
    return ranks[0] if ranks else "?"


def watch(agent: int, out: Path, interval: float) -> None:
    """Sample the PSS of every process below `agent` (the ranks and their workers; not torchrun's agent) and
    each one's VmHWM until `agent` exits; one JSON line per sample."""
    ranks: dict[int, str] = {}
    with open(out, "w") as file:
        while Path(f"/proc/{agent}").exists():
            sample: dict[str, Any] = {"t": time.time(), "pss_kib": 0, "rank_pss_kib": {}, "hwm_kib": {}}
            for pid in _descendants(agent):
                try:
                    pss = _kib(Path(f"/proc/{pid}/smaps_rollup"), "Pss")
                    status = Path(f"/proc/{pid}/status")
                    hwm = _kib(status, "VmHWM")
                except OSError:  # exited meanwhile
                    continue
                rank = ranks.setdefault(pid, _rank(pid))
                sample["pss_kib"] += pss
                sample["rank_pss_kib"][rank] = sample["rank_pss_kib"].get(rank, 0) + pss  # with its workers
                sample["hwm_kib"][f"{rank}:{pid}"] = hwm
            file.write(json.dumps(sample) + "\n")
            file.flush()
            time.sleep(interval)


# ----------------------------------------------------------------------------------------- the runs
def ledger(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def train(run_dir: Path, stop_at: int, args: argparse.Namespace, samples: Path | None) -> None:
    periodic = 1 if samples and stop_at > 2 else 1000  # the resumed runs save in the background at their first step
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(args.ranks), str(ROOT / "jobs" / "train.py"),
           f"run.dir={run_dir}", "task.target=bench.tasks:BenchTask", f"task.args.hidden={args.hidden}",
           "task.args.size=1024", "data.batch_size=16", "train.epochs=100", "eval.every_steps=0",
           "log.tensorboard=false", f"checkpoint.every_steps={periodic}", "--stop-at-step",
           str(stop_at)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watcher = None
    if samples is not None:
        watcher = subprocess.Popen([PY, __file__, "--watch", str(proc.pid), "--samples", str(samples),
                                    "--interval", str(args.interval)], env=env, cwd=ROOT)
    output, _ = proc.communicate(timeout=900)
    if watcher is not None:
        watcher.wait(timeout=60)
    stops = [e for e in ledger(run_dir) if e["event"] == "checkpoint_saved" and e["step"] == stop_at]
    if not stops:  # a stopped run exits 3 and torchrun reports a failure: the ledger says whether it saved
        raise RuntimeError(f"{' '.join(cmd)}: no checkpoint at step {stop_at}:\n{output[-3000:]}")


def rise_to_training(run_dir: Path, samples_path: Path, first_step: int) -> float:
    """The rise in node PSS from rank 0 looking for a checkpoint to the run's first save: loading (if it resumed)
    and what training takes once it runs (AdamW's state, gradients, DDP's buckets, rebuilt after the first
    step: a resumed run replays that rebuild, a new one does it at its second step, hence up to the first save,
    which comes after both)."""
    samples = [json.loads(line) for line in samples_path.read_text().splitlines()]
    events = ledger(run_dir)
    timings = [e for e in events if e["event"] == "first_step" and e["step"] == first_step][-1]["timings"]
    save = [e for e in events if e["event"] == "checkpoint_saved" and e["step"] >= first_step][0]
    before = [s["pss_kib"] for s in samples if s["t"] <= timings["find"]][-1]
    inside = [s["pss_kib"] for s in samples if timings["find"] <= s["t"] <= save["time"] - save["seconds"]]
    return (max(inside) - before) * 1024


def analyse(run_dir: Path, samples_path: Path, resume_step: int, ckpt_bytes: int) -> dict[str, Any]:
    samples = [json.loads(line) for line in samples_path.read_text().splitlines()]
    events = ledger(run_dir)
    timings = [e for e in events if e["event"] == "first_step" and e["step"] == resume_step + 1][-1]["timings"]
    save = [e for e in events if e["event"] == "checkpoint_saved" and e["step"] == resume_step + 1][-1]
    save_start, save_end = save["time"] - save["seconds"], save["time"]

    def last_before(t: float) -> float:
        before = [s["pss_kib"] for s in samples if s["t"] <= t]
        return before[-1] * 1024 if before else float("nan")

    def peak(start: float, end: float) -> float:
        inside = [s["pss_kib"] for s in samples if start <= s["t"] <= end]
        return max(inside) * 1024 if inside else float("nan")

    hwm: dict[str, int] = {}
    for sample in samples:
        for key, value in sample["hwm_kib"].items():
            hwm[key] = max(hwm.get(key, 0), value)
    rank_hwm = sorted((key.split(":")[0], value * 1024) for key, value in hwm.items() if key.split(":")[0] != "?")
    before = last_before(timings["find"])
    loaded = peak(timings["find"], timings["restored"])
    # The save is rank 0's alone; rank 1 takes the same steps meanwhile (not in lockstep: it runs ahead while
    # rank 0 snapshots), so rank 1's own rise over the window is what the steps cost, and the rest of rank 0's
    # rise is the save's.
    def rank_rise(rank: str) -> float:
        before_save = [s["rank_pss_kib"].get(rank, 0) for s in samples if s["t"] <= save_start][-1]
        during = max(s["rank_pss_kib"].get(rank, 0) for s in samples if save_start <= s["t"] <= save_end)
        return (during - before_save) * 1024

    save_cost = rank_rise("0") - rank_rise("1")
    return {"ckpt_MB": ckpt_bytes / MB, "pss_before_load_MB": before / MB, "pss_loaded_MB": loaded / MB,
            "load_over_ckpt": (loaded - before) / ckpt_bytes,
            "save_over_ckpt": save_cost / ckpt_bytes,
            "max_rank_hwm_MB": max(v for _, v in rank_hwm) / MB, "rank_hwm_MB": [round(v / MB) for _, v in rank_hwm],
            "samples": len(samples), "save_s": save["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=5000, help="MLP width: ~12 x hidden^2 bytes of checkpoint")
    parser.add_argument("--resumes", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.02, help="watcher's sampling interval (s)")
    parser.add_argument("--watch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.watch:
        watch(args.watch, args.samples, args.interval)
        return

    work = Path(tempfile.mkdtemp(prefix="mgpu-bench-memory-"))
    rows = []
    try:
        run_dir = work / "run"
        train(run_dir, 2, args, work / "samples-fresh.jsonl")
        fresh = rise_to_training(run_dir, work / "samples-fresh.jsonl", 1)
        for index in range(args.resumes):
            resume_step = 2 + 2 * index
            latest = run_dir / "checkpoints" / f"step_{resume_step:08d}" / "state.pt"
            ckpt = latest.stat().st_size
            samples = work / f"samples-{index}.jsonl"
            train(run_dir, resume_step + 2, args, samples)
            row = analyse(run_dir, samples, resume_step, ckpt)
            row["to_training_over_ckpt"] = rise_to_training(run_dir, samples, resume_step + 1) / ckpt
            row["new_run_to_training_over_ckpt"] = fresh / ckpt
            row["resume_extra_over_ckpt"] = row["to_training_over_ckpt"] - row["new_run_to_training_over_ckpt"]
            print(f"resume {index + 1}: load {row['load_over_ckpt']:.2f}, save {row['save_over_ckpt']:.2f} "
                  f"checkpoints per node", flush=True)
            rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary: dict[str, Any] = {"ranks": args.ranks}
    for key in rows[0]:
        values = [row[key] for row in rows]
        summary[key] = median(values) if isinstance(values[0], (int, float)) else values[len(values) // 2]
    summary["resumes"] = len(rows)
    report("resume_memory", [summary], args.out)


if __name__ == "__main__":
    main()
