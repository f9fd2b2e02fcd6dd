"""Loop overhead: mgpu's Trainer against a hand-written DDP loop (same model, data, optimizer, seeds, batch).

    python bench/loop_overhead.py                 # 1 process and 2 gloo ranks, 5 repeats each
    python bench/loop_overhead.py --ranks 2 --repeats 7 --steps 300

Both loops run in the same processes, alternating, R times; the figure is the ratio of the median step
times (median over steps after a warm-up, then median over repeats). Target: <= 1.02.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, median, report  # noqa: E402

WARMUP = 10


def hand_written(steps: int, batch: int, world: int, rank: int, hidden: int) -> list[float]:
    """The loop a user writes from the PyTorch DDP tutorial, timed per step."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from bench.tasks import mlp, random_dataset

    torch.manual_seed(0)
    model = mlp(hidden=hidden)
    ddp = DDP(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = random_dataset(steps * batch * world)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0)
    sampler.set_epoch(0)
    ends = []
    for x, y in DataLoader(dataset, batch_size=batch, sampler=sampler):
        loss = F.cross_entropy(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ends.append(time.perf_counter())
    return ends


def ours(steps: int, batch: int, world: int, ctx, hidden: int, overrides: list[str]) -> list[float]:
    from mgpu.config import load_config
    from mgpu.ledger import Ledger
    from mgpu.preemption import StopRequest
    from mgpu.task import build_task
    from mgpu.trainer import Trainer

    cfg = load_config(None, ["task.target=bench.tasks:BenchTask", f"task.args.size={steps * batch * world}",
                             f"task.args.hidden={hidden}", f"data.batch_size={batch}", "train.epochs=1",
                             "schedule.name=constant", *overrides])
    with tempfile.TemporaryDirectory() as run_dir:
        cfg.run.dir = run_dir
        trainer = Trainer(cfg, build_task(cfg.task.target, cfg.task.args), ctx, Path(run_dir), Ledger(None),
                          StopRequest())
        trainer.fit()
    return trainer.step_ends


def step_time(ends: list[float]) -> float:
    return median([b - a for a, b in zip(ends[WARMUP:], ends[WARMUP + 1:])])


def worker(args: argparse.Namespace) -> None:
    from mgpu.distributed import process_group
    from mgpu.environment import detect_environment

    env = detect_environment()
    with process_group(env) as ctx:
        rows = []
        for repeat in range(args.repeats):
            raw = step_time(hand_written(args.steps, args.batch, env.world_size, env.rank, args.hidden))
            mine = step_time(ours(args.steps, args.batch, env.world_size, ctx, args.hidden, args.override))
            rows.append({"repeat": repeat, "raw_s": raw, "mgpu_s": mine})
        if env.rank == 0:
            Path(args.worker).write_text(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--override", action="append", default=[], help="trainer config override (repeatable)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for ranks in args.ranks:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(ranks), "--master-port",
                   str(random.randint(20000, 32000)), __file__, "--worker", out.name, "--repeats", str(args.repeats),
                   "--steps", str(args.steps), "--batch", str(args.batch), "--hidden", str(args.hidden)]
            for item in args.override:
                cmd += ["--override", item]
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, 2 // ranks))),
                       PYTHONPATH=str(ROOT))
            subprocess.run(cmd, check=True, env=env, cwd=ROOT)
            repeats = json.loads(Path(out.name).read_text())
        raw, mine = median([r["raw_s"] for r in repeats]), median([r["mgpu_s"] for r in repeats])
        rows.append({"ranks": ranks, "raw_step_ms": raw * 1e3, "mgpu_step_ms": mine * 1e3, "ratio": mine / raw,
                     "repeats": args.repeats, "steps": args.steps, "batch": args.batch,
                     "per_repeat_ratios": [round(r["mgpu_s"] / r["raw_s"], 4) for r in repeats]})
    report("loop_overhead", rows)


if __name__ == "__main__":
    main()
