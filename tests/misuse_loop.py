"""A loop of one's own with one misuse, for tests/test_own_loop.py: every rank makes the same mistake, mgpu refuses it,
and the user gets one line from one rank (exit 2), not a traceback per rank.

    python tests/misuse_loop.py RUN_DIR --case optimizer_before_wrap   # AdamW over the parameters FSDP2 replaces
    python tests/misuse_loop.py RUN_DIR --case diverged [--parallel ddp|fsdp] [--format single|sharded]
        # a plain module beside the model, initialised on each rank from its own seed (seed + rank), saved
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mgpu  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--case", required=True, choices=["optimizer_before_wrap", "diverged"])
    parser.add_argument("--parallel", default="fsdp", choices=["ddp", "fsdp"])
    parser.add_argument("--format", default="auto", choices=["auto", "single", "sharded"])
    args = parser.parse_args()
    config = mgpu.Config()
    config.checkpoint.format = args.format
    with mgpu.Session(args.run_dir, seed=0, config=config) as session:
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        if args.case == "optimizer_before_wrap":
            optimizer = torch.optim.AdamW(net.parameters())
            model = session.wrap(net, parallel="fsdp")
            session.load({"model": model, "optimizer": optimizer})
            raise AssertionError("load() accepted an optimizer built before wrap")
        model = session.wrap(net, parallel=args.parallel)
        teacher = nn.Linear(4, 1)  # each rank's own init: seed + rank
        optimizer = torch.optim.AdamW(model.parameters())
        state = session.load({"model": model, "optimizer": optimizer, "teacher": teacher})
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        session.should_stop()
        session.save(state)
        raise AssertionError("save() kept one rank's copy of a module whose copies differ")


if __name__ == "__main__":
    main()
