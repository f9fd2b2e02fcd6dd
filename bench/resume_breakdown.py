"""The way back after a stop: from a resumed process's start to its first training step, broken down, for the
example jobs (2 ranks under torchrun on this machine), from real checkpoints of stopped runs.

    OMP_NUM_THREADS=1 python bench/resume_breakdown.py                         # mnist and gpt, 5 resumes each
    OMP_NUM_THREADS=1 python bench/resume_breakdown.py --baseline api --resumes 5   # + the code at `api`, alternating

Per example: one run stopped with `jobs/train.py --stop-at-step 3` (its checkpoint: the stop's), then
`--resumes` runs, each resuming from the previous one's stop and stopping after one step. Each resume's
times come from the ledger's `first_step` event (rank 0's Unix times, mgpu.run.session): the phases are
median seconds over the resumes. `--baseline REF` also runs the same resumes on a git worktree of REF, one
after the other with ours (alternating which goes first), to show before/after in one run.

The phases (as the trainer passes through them):
  launcher        torchrun's own start (it imports torch) until the worker process starts; srun has none
  imports         interpreter, imports (torch, the task's module), the config: process start -> Session
  rendezvous      run directory, ledger, the process group (every rank's imports end here): -> group
  task setup      watchdog, the task's datasets, model and optimizer: -> checkpoint find
  checkpoint      rank 0 finds the newest checkpoint and hashes it, every rank memory-maps it: -> loaded
  restore         the config check, load_state_dict of everything, RNG states: -> restored
  first batch     DDP, the reporter (TensorBoard), the loader and its first batch: -> first batch
  first step      forward, backward, all-reduce, optimizer: -> first step done
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
EXAMPLES = {"mnist": "jobs/configs/mnist.yaml", "gpt": "jobs/configs/gpt.yaml"}
PHASES = [("launcher", "launch", "process"), ("imports", "process", "session"), ("rendezvous", "session", "group"),
          ("task setup", "group", "find"), ("checkpoint", "find", "loaded"), ("restore", "loaded", "restored"),
          ("first batch", "restored", "first_batch"), ("first step", "first_batch", "first_step")]


def first_steps(run_dir: Path) -> list[dict[str, Any]]:
    events = run_dir / "events.jsonl"
    if not events.exists():
        return []
    return [e for e in map(json.loads, events.read_text().splitlines()) if e.get("event") == "first_step"]


def train(root: Path, example: str, run_dir: Path, stop_at: int, tokens: Path, ranks: int) -> dict[str, Any]:
    """One torchrun of jobs/train.py in checkout `root`, stopped after step `stop_at`: its first_step timings."""
    before = len(first_steps(run_dir))
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(ranks), str(root / "jobs" / "train.py"),
           "--config", str(root / EXAMPLES[example]), f"run.dir={run_dir}", "--stop-at-step", str(stop_at)]
    if example == "gpt":
        cmd.append(f"task.args.stdlib_tokens={tokens}")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=str(root))
    launch = time.time()
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    events = first_steps(run_dir)
    if len(events) != before + 1:  # a stopped run exits 3; torchrun then reports a failure: read the ledger
        raise RuntimeError(f"{' '.join(cmd)}: no first step (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"launch": launch, **events[-1]["timings"], "step": events[-1]["step"]}


def phases(timings: dict[str, Any]) -> dict[str, float]:
    out = {name: timings[end] - timings[start] for name, start, end in PHASES if start in timings and end in timings}
    out["process -> first step"] = timings["first_step"] - timings["process"]
    out["launch -> first step"] = timings["first_step"] - timings["launch"]
    return out


IMPORT_PROBE = """
import time
start = time.perf_counter()
import torch
torch_done = time.perf_counter()
import mgpu.train.job, mgpu.run.session, mgpu.train.trainer, mgpu.state.checkpointer, jobs.tasks.{example}
mgpu_done = time.perf_counter()
torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())  # torch imports torch._dynamo at the first optimizer
print(torch_done - start, mgpu_done - torch_done, time.perf_counter() - mgpu_done)
"""


def import_times(root: Path, example: str) -> dict[str, float]:
    """One process's imports on the start path, alone (no other rank beside it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    out = subprocess.run([PY, "-c", IMPORT_PROBE.format(example=example)], env=env, cwd=root, check=True,
                         capture_output=True, text=True).stdout.split()
    torch_s, mgpu_s, optimizer_s = map(float, out)
    return {"import torch": torch_s, "mgpu, trainer, task": mgpu_s, "first optimizer (torch._dynamo)": optimizer_s,
            "total": torch_s + mgpu_s + optimizer_s}


def checkout(ref: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), ref], check=True,
                   capture_output=True, text=True)
    return where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="mnist,gpt")
    parser.add_argument("--resumes", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--baseline", metavar="REF", help="also measure the code at this git ref (before/after)")
    parser.add_argument("--imports", type=int, default=7, help="runs of the lone-process import probe per code")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    examples = args.examples.split(",")
    if unknown := [e for e in examples if e not in EXAMPLES]:
        parser.error(f"unknown example {unknown[0]!r}: choose from {', '.join(EXAMPLES)}")

    work = Path(tempfile.mkdtemp(prefix="mgpu-bench-resume-"))
    roots = {"this": ROOT}
    try:
        if args.baseline:
            roots = {f"baseline ({args.baseline})": checkout(args.baseline, work / "baseline"), "this": ROOT}
        imports: dict[str, list[dict[str, float]]] = {}
        for index in range(args.imports):
            for code, root in (list(roots.items()) if index % 2 == 0 else list(roots.items())[::-1]):
                imports.setdefault(code, []).append(import_times(root, examples[0]))
        tokens = work / "stdlib.bin"
        measured: dict[tuple[str, str], list[dict[str, float]]] = {}
        for example in examples:
            for code, root in roots.items():
                stopped = train(root, example, work / code.split()[0] / example, 3, tokens, args.ranks)
                took = stopped["first_step"] - stopped["process"]
                print(f"{example} [{code}]: stopped run, first step {took:.2f} s after its process started", flush=True)
            for index in range(args.resumes):
                order = list(roots.items()) if index % 2 == 0 else list(roots.items())[::-1]
                for code, root in order:
                    timings = train(root, example, work / code.split()[0] / example, 4 + index, tokens, args.ranks)
                    assert timings["step"] == 4 + index, timings
                    measured.setdefault((example, code), []).append(phases(timings))
                    print(f"{example} [{code}] resume {index + 1}: process -> first step "
                          f"{measured[example, code][-1]['process -> first step']:.2f} s", flush=True)
    finally:
        if args.baseline:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "baseline")],
                           capture_output=True)
        shutil.rmtree(work, ignore_errors=True)

    rows = []
    for (example, code), runs in measured.items():
        row: dict[str, Any] = {"example": example, "code": code}
        for name in [p[0] for p in PHASES] + ["process -> first step", "launch -> first step"]:
            values = [run[name] for run in runs if name in run]
            row[name] = median(values) if values else ""
        row["resumes"] = len(runs)
        rows.append(row)
    report("resume_breakdown", rows, args.out)
    import_rows = [{"code": code, **{k: median([run[k] for run in runs]) for k in runs[0]}, "runs": len(runs)}
                   for code, runs in imports.items()]
    if import_rows:
        out = args.out.with_name(args.out.stem + "_imports.json") if args.out else None
        report("resume_breakdown_imports", import_rows, out)


if __name__ == "__main__":
    main()
