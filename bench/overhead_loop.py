"""A loop of one's own on mgpu.Session for bench/failure_overhead.py: an MLP with batch norm (buffers DDP syncs, so
rank 0's buffer record runs too), AdamW, a ResumableLoader; each rank's step end times (after `should_stop`) into
`<out>.rank<N>.json`. Run under a launcher: `python -m mgpu.run.spawn -n 2 bench/overhead_loop.py ...`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mgpu  # noqa: E402
from bench.tasks import random_dataset  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--memory-every-steps", default="default")
    args = parser.parse_args()
    config = mgpu.Config()
    if args.memory_every_steps != "default":
        config.checkpoint.memory_every_steps = int(args.memory_every_steps)
    config.log.tensorboard = False
    with mgpu.Session(args.run_dir, seed=0, config=config) as session:
        model = session.wrap(nn.Sequential(nn.Linear(256, args.hidden), nn.BatchNorm1d(args.hidden), nn.ReLU(),
                                           nn.Linear(args.hidden, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = session.loader(random_dataset(args.steps * args.batch * session.world_size), batch_size=args.batch)
        state = session.load({"model": model, "optimizer": optimizer, "loader": loader})
        ends = []
        for _ in loader.epochs(1):
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if session.should_stop():
                    break
                ends.append(time.perf_counter())
        Path(f"{args.out}.rank{session.rank}.json").write_text(json.dumps({"ends": ends, "cpu": time.process_time()}))
        del state


if __name__ == "__main__":
    main()
