"""How fast a stopped run ends: from the stop's durable checkpoint to the exit of the last rank, side by side
for the trainer without and with wandb (offline), TensorBoard on in both, and for an own loop.

    python bench/stop_teardown.py [--ranks 2] [--repeats 3] [--trees TREE ...]

Each run: `jobs/train.py` (tests.tasks:BlobTask) on `--ranks` local ranks (RANK/WORLD_SIZE, gloo), stopped at
step 3 (`--stop-at-step`); the own loop is `tests/own_loop.py --workers 2` (mgpu.Session, two DataLoader
workers per rank), stopped the same way. From rank 0's ledger: `checkpoint_saved` of the stop (durable) and
`preempted` (the trainer's loggers are closed by then: TensorBoard, wandb's finish); the parent notes each
rank's exit as it happens. Phases: durable -> loggers closed, loggers closed -> last exit (the session's end:
the decision, DDP's release, the process group's teardown, the watchdog; then the process's exit: atexit
hooks such as wandb's service teardown, the interpreter's finalization unless skipped, mgpu/stop/process_exit.py).
The floor no library removes, measured in the same run: a bare `import torch, torch.distributed` from its last
line to its exit; `over_floor_s` is durable -> last exit minus that floor. `--trees A B`: the same runs on each
source tree (e.g. a checkout of the code before a change, and this one), interleaved, so that all see the
same machine. Target (issue 22): durable -> last exit <= 3 s.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, median, report  # noqa: E402
from mgpu.record.ledger import read_ledger  # noqa: E402

OWN_LOOP = "own loop (tests/own_loop.py)"


def _env(tree: Path = ROOT, **extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_")) and k not in (
                "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    keep.update(OMP_NUM_THREADS="1", PYTHONPATH=str(tree), PYTHONUNBUFFERED="1", WANDB_MODE="offline",
                WANDB_SILENT="true")
    keep.update(extra)
    return keep


def _exits(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[float]:
    """The time each process exits, noted by a thread waiting on it."""
    ends = [0.0] * len(procs)

    def wait(i: int) -> None:
        procs[i].wait(timeout=timeout)
        ends[i] = time.time()

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(len(procs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ends


def one_run(ranks: int, mode: str, root: Path, tree: Path) -> dict[str, float]:
    run_dir = root / f"run-{mode.split()[0]}-{random.randrange(10**6)}"
    port = str(random.SystemRandom().randint(20000, 32000))
    if mode == OWN_LOOP:
        argv = [sys.executable, str(tree / "tests" / "own_loop.py"), str(run_dir), "--workers=2", "--stop-at-step=3"]
    else:
        argv = [sys.executable, str(tree / "jobs" / "train.py"), f"run.dir={run_dir}",
                "task.target=tests.tasks:BlobTask", "data.batch_size=4", "log.tensorboard=true",
                f"log.wandb={'true' if 'wandb' in mode else 'false'}", "log.wandb_project=mgpu-bench",
                "--stop-at-step=3"]
    procs = [subprocess.Popen(argv, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=_env(tree, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks),
                                       LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(ranks)]
    ends = _exits(procs, timeout=900)
    codes = [p.returncode for p in procs]
    assert codes == [3] + [0] * (ranks - 1), f"exit codes {codes} ({run_dir})"
    events = read_ledger(run_dir / "events.jsonl")
    durable = next(e["time"] for e in events if e["event"] == "checkpoint_saved" and e.get("reason") == "preemption")
    closed = next(e["time"] for e in events if e["event"] == "preempted")
    return {"durable_to_exit_s": max(ends) - durable, "loggers_s": closed - durable,
            "after_loggers_s": max(ends) - closed}


def bare_exit() -> float:
    """Seconds from a bare torch process's last line to its exit (the interpreter's own teardown)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time, torch, torch.distributed; print(time.time())"],
                            stdout=subprocess.PIPE, text=True, env=_env())
    out, _ = proc.communicate(timeout=600)
    return time.time() - float(out.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trees", type=Path, nargs="+", default=[ROOT],
                        help="source trees to run (default: this one), interleaved")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    modes = ["tensorboard", "tensorboard + wandb offline", OWN_LOOP]
    try:
        import wandb  # noqa: F401
    except ImportError:
        print("wandb is not installed: without it")
        modes.remove("tensorboard + wandb offline")
    trees = [tree.resolve() for tree in args.trees]
    samples: dict[tuple[Path, str], list[dict[str, float]]] = {(tree, mode): [] for tree in trees for mode in modes}
    floor: list[float] = []
    with tempfile.TemporaryDirectory(prefix="mgpu-teardown-") as tmp:
        for _ in range(args.repeats):  # interleaved: every tree and mode sees the same machine
            for mode in modes:
                for tree in trees:
                    samples[(tree, mode)].append(one_run(args.ranks, mode, Path(tmp), tree))
                floor.append(bare_exit())
    floor_s = median(floor)
    rows: list[dict[str, Any]] = []
    for (tree, mode), runs in samples.items():
        durable = median([r["durable_to_exit_s"] for r in runs])
        rows.append({"tree": str(tree), "stop of": mode, "ranks": args.ranks, "runs": len(runs),
                     **{key: round(median([r[key] for r in runs]), 3) for key in runs[0]},
                     "worst_durable_to_exit_s": round(max(r["durable_to_exit_s"] for r in runs), 3),
                     "over_floor_s": round(durable - floor_s, 3)})
    rows.append({"tree": "", "stop of": "bare torch process (floor)", "ranks": 1, "runs": len(floor),
                 "durable_to_exit_s": "", "loggers_s": "", "after_loggers_s": round(floor_s, 3),
                 "worst_durable_to_exit_s": round(max(floor), 3), "over_floor_s": ""})
    report("stop_teardown", rows, args.out)


if __name__ == "__main__":
    main()
