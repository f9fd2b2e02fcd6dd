"""How fast a stopped run ends: from the stop's durable checkpoint to the exit of the last rank, side by side
without and with wandb (offline), TensorBoard on in both.

    python bench/stop_teardown.py [--ranks 2] [--repeats 3]

Each run: `jobs/train.py` (tests.tasks:BlobTask) on `--ranks` local ranks (RANK/WORLD_SIZE, gloo), stopped at
step 3 (`--stop-at-step`). From rank 0's ledger: `checkpoint_saved` of the stop (durable) and `preempted` (the
loggers are closed: TensorBoard, wandb's finish); the parent notes each rank's exit as it happens. Phases:
durable -> loggers closed, loggers closed -> last exit (the session's end: the decision, the process group's
teardown, the watchdog; then the interpreter's exit, atexit hooks such as wandb's service teardown). The
floor no library removes, measured in the same run: a bare `import torch, torch.distributed` from its last
line to its exit. Target (issue 22): durable -> last exit <= 3 s.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, median, report  # noqa: E402
from mgpu.ledger import read_ledger  # noqa: E402

TRAIN = str(ROOT / "jobs" / "train.py")


def _env(**extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_")) and k not in (
                "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    keep.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", WANDB_MODE="offline",
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


def one_run(ranks: int, wandb: bool, root: Path) -> dict[str, float]:
    run_dir = root / f"run-{'wandb' if wandb else 'plain'}-{random.randrange(10**6)}"
    port = str(random.randint(20000, 32000))
    argv = [sys.executable, TRAIN, f"run.dir={run_dir}", "task.target=tests.tasks:BlobTask", "data.batch_size=4",
            "log.tensorboard=true", f"log.wandb={'true' if wandb else 'false'}", "log.wandb_project=mgpu-bench",
            "--stop-at-step=3"]
    procs = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks),
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
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    try:
        import wandb  # noqa: F401

        modes = {"tensorboard": False, "tensorboard + wandb offline": True}
    except ImportError:
        print("wandb is not installed: TensorBoard alone")
        modes = {"tensorboard": False}
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in modes}
    floor: list[float] = []
    with tempfile.TemporaryDirectory(prefix="mgpu-teardown-") as tmp:
        for _ in range(args.repeats):  # interleaved: both see the same machine
            for name, wandb_on in modes.items():
                samples[name].append(one_run(args.ranks, wandb_on, Path(tmp)))
            floor.append(bare_exit())
    rows = [{"loggers": name, "ranks": args.ranks, "runs": len(runs),
             **{key: round(median([r[key] for r in runs]), 3) for key in runs[0]},
             "worst_durable_to_exit_s": round(max(r["durable_to_exit_s"] for r in runs), 3)}
            for name, runs in samples.items()]
    rows.append({"loggers": "bare torch process (floor)", "ranks": 1, "runs": len(floor), "durable_to_exit_s": "",
                 "loggers_s": "", "after_loggers_s": round(median(floor), 3), "worst_durable_to_exit_s": ""})
    report("stop_teardown", rows, args.out)


if __name__ == "__main__":
    main()
