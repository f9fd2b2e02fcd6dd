"""Host memory at resume and during a save, against the checkpoint's size: the PSS of every process of the
node's ranks (shared pages, such as one memory-mapped checkpoint, counted once), sampled by a watcher
process, and each rank's VmHWM (peak RSS, which counts shared pages in full on every rank).

    OMP_NUM_THREADS=1 python bench/resume_memory.py                # 2 ranks, a ~300 MB checkpoint, 3 resumes
    OMP_NUM_THREADS=1 python bench/resume_memory.py --ranks 4 --hidden 3000
    OMP_NUM_THREADS=1 python bench/resume_memory.py --no-mmap     # a control: torch.load(mmap=False) per rank

The job: `jobs/train.py` on bench.tasks:BenchTask (an MLP of `--hidden` width with AdamW: the checkpoint is
about 12 bytes per parameter) under torchrun. One run stops after step 2 (a stop's checkpoint); then each
measured run resumes from the previous one's, saves in the background at its first step (the periodic
save: a snapshot into staging buffers, written by a thread) and stops at its second (the stop's save).
Phases come from the ledger (`first_step` timings, `checkpoint_saved` events), samples from the watcher;
each figure is in checkpoints per node (the PSS of all ranks over the size of state.pt):

  load             the rise in node PSS from rank 0 looking for a checkpoint to the first batch (every rank
                   has loaded it; DDP has allocated its buckets), less the same rise in the stopped run, a
                   new run (nothing loaded): what loading adds (target: about one checkpoint per
                   node, not one per rank)
  to training      the same up to the run's first save: with AdamW's state, gradients, DDP's rebuilt buckets
                   (on a CPU every rank's own, as any run has); what the resume costs beyond a new run
  save             rank 0's rise in PSS while its background save is in flight, less rank 1's over the same
                   time (the same steps, no save): the staging buffer and the writer (target: bounded, at
                   most one copy of the state on the node)

VmHWM per rank is the peak RSS; it counts shared pages (the mapped checkpoint) in full on every rank.
`--no-mmap` is the control: each rank loads with torch.load(mmap=False), a copy per rank.
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


NO_MMAP = """
import torch
_load = torch.load
torch.load = lambda *args, **kwargs: _load(*args, **{**kwargs, "mmap": False})
"""
"""sitecustomize for the control: every rank reads the whole file into its own memory, as a plain torch.load."""


def train(run_dir: Path, stop_at: int, args: argparse.Namespace, samples: Path | None) -> None:
    periodic = 1 if samples and stop_at > 2 else 1000  # the resumed runs save in the background at their first step
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(args.ranks), str(ROOT / "jobs" / "train.py"),
           f"run.dir={run_dir}", "task.target=bench.tasks:BenchTask", f"task.args.hidden={args.hidden}",
           "task.args.size=1024", "data.batch_size=16", "train.epochs=100", "eval.every_steps=0",
           "log.tensorboard=false", f"checkpoint.every_steps={periodic}", "--stop-at-step",
           str(stop_at)]
    path = f"{args.control_dir}:{ROOT}" if args.no_mmap and samples else str(ROOT)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=path)
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


def rise(run_dir: Path, samples: list[dict[str, Any]], first_step: int, until: str) -> float:
    """The rise in node PSS (bytes) from rank 0 looking for a checkpoint (`find`) to `until`: `first_batch`
    (every rank has loaded, and DDP has allocated its buckets), or `save` (the run's first save starts: AdamW's
    state, gradients and DDP's buckets rebuilt after the first step all exist; a resumed run builds its
    reducer with the saved buckets, a new one rebuilds at its second step, and the first save comes after both)."""
    events = ledger(run_dir)
    timings = [e for e in events if e["event"] == "first_step" and e["step"] == first_step][-1]["timings"]
    if until == "save":
        save = [e for e in events if e["event"] == "checkpoint_saved" and e["step"] >= first_step][0]
        end = save["time"] - save["seconds"]
    else:
        end = timings[until]
    before = [s["pss_kib"] for s in samples if s["t"] <= timings["find"]][-1]
    return (max(s["pss_kib"] for s in samples if timings["find"] <= s["t"] <= end) - before) * 1024


def save_cost(run_dir: Path, samples: list[dict[str, Any]], step: int) -> tuple[float, float]:
    """(bytes, seconds) of the background save at `step`: rank 0's rise in PSS while it is in flight, less rank
    1's. The save is rank 0's alone; rank 1 takes the same steps meanwhile (not in lockstep: it runs ahead
    while rank 0 snapshots), so its rise is what the steps cost."""
    save = [e for e in ledger(run_dir) if e["event"] == "checkpoint_saved" and e["step"] == step][-1]
    start, end = save["time"] - save["seconds"], save["time"]

    def rank_rise(rank: str) -> float:
        before = [s["rank_pss_kib"].get(rank, 0) for s in samples if s["t"] <= start][-1]
        return (max(s["rank_pss_kib"].get(rank, 0) for s in samples if start <= s["t"] <= end) - before) * 1024

    return rank_rise("0") - rank_rise("1"), save["seconds"]


def peak_hwm(samples: list[dict[str, Any]]) -> list[int]:
    """Each rank's VmHWM (bytes), the highest seen, by rank."""
    hwm: dict[str, int] = {}
    for sample in samples:
        for key, value in sample["hwm_kib"].items():
            hwm[key] = max(hwm.get(key, 0), value * 1024)
    return [value for key, value in sorted(hwm.items()) if not key.startswith("?")]


def read_samples(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=5000, help="MLP width: ~12 x hidden^2 bytes of checkpoint")
    parser.add_argument("--resumes", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.02, help="watcher's sampling interval (s)")
    parser.add_argument("--keep", type=Path, help="copy the samples and the ledger here")
    parser.add_argument("--no-mmap", action="store_true", help="the control: resumes load without mmap")
    parser.add_argument("--watch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.watch:
        watch(args.watch, args.samples, args.interval)
        return

    work = Path(tempfile.mkdtemp(prefix="mgpu-bench-memory-"))
    args.control_dir = work / "control"
    args.control_dir.mkdir()
    (args.control_dir / "sitecustomize.py").write_text(NO_MMAP)
    rows = []
    try:
        run_dir = work / "run"
        train(run_dir, 2, args, work / "samples-fresh.jsonl")  # a new run: nothing to load
        fresh = read_samples(work / "samples-fresh.jsonl")
        new_run = {until: rise(run_dir, fresh, 1, until) for until in ("first_batch", "save")}
        for index in range(args.resumes):
            resume_step = 2 + 2 * index
            ckpt = (run_dir / "checkpoints" / f"step_{resume_step:08d}" / "state.pt").stat().st_size
            path = work / f"samples-{index}.jsonl"
            train(run_dir, resume_step + 2, args, path)
            samples = read_samples(path)
            resumed = {until: rise(run_dir, samples, resume_step + 1, until) for until in ("first_batch", "save")}
            saved, seconds = save_cost(run_dir, samples, resume_step + 1)
            hwm = peak_hwm(samples)
            rows.append({"ckpt_MB": ckpt / MB,
                         "load_over_ckpt": (resumed["first_batch"] - new_run["first_batch"]) / ckpt,
                         "to_training_over_ckpt": (resumed["save"] - new_run["save"]) / ckpt,
                         "save_over_ckpt": saved / ckpt, "save_s": seconds,
                         "resumed_rise_MB": resumed["first_batch"] / MB,
                         "new_run_rise_MB": new_run["first_batch"] / MB,
                         "max_rank_hwm_MB": max(hwm) / MB, "rank_hwm_MB": [round(v / MB) for v in hwm],
                         "samples": len(samples)})
            print(f"resume {index + 1}: load {rows[-1]['load_over_ckpt']:.2f}, to training "
                  f"{rows[-1]['to_training_over_ckpt']:.2f}, save {rows[-1]['save_over_ckpt']:.2f} checkpoints "
                  f"per node", flush=True)
    finally:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            for path in [*work.glob("samples-*.jsonl"), work / "run" / "events.jsonl"]:
                if path.exists():
                    shutil.copy(path, args.keep / path.name)
        shutil.rmtree(work, ignore_errors=True)
    summary: dict[str, Any] = {"ranks": args.ranks, "load": "torch.load(mmap=False)" if args.no_mmap else "mgpu"}
    for key in rows[0]:
        values = [row[key] for row in rows]
        summary[key] = median(values) if isinstance(values[0], (int, float)) else values[len(values) // 2]
    summary["resumes"] = len(rows)
    report("resume_memory", [summary], args.out)


if __name__ == "__main__":
    main()
