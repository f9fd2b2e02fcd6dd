"""A training loop of a user's own on mgpu.Session, for tests/test_own_loop.py: dropout, random per-sample
augmentation, AdamW with a warmup schedule, gradient accumulation, clipping, an evaluation with
all-reduced sums and early-stopping state, saves every few steps. Run one process per rank (RANK,
WORLD_SIZE, ... or torchrun):

    python tests/own_loop.py RUN_DIR [--epochs 2] [--workers 0] [--save-every 4] [--ballast-mb 0]
        [--signal-at K] [--agree-every N] [--stop-at-step K] [--step-s S] [--deadline-margin S]
        [--parallel ddp|fsdp] [--ema DECAY] [--start-method spawn|forkserver|fork]

--ema DECAY: an mgpu.EMA of the weights in the state, updated every step, evaluated (`ema.applied()`).
--start-method: the loop sets multiprocessing's start method first thing, as CUDA code often does
(`torch.multiprocessing.set_start_method("spawn")`): its DataLoader workers start that way.

--signal-at K: right after optimizer step K (before the loop asks `should_stop`), the last rank sends
SIGTERM to its whole process group, as slurmstepd signals every process of a step: every rank and
DataLoader worker the test started in that group gets it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mgpu  # noqa: E402
from mgpu.stop.stopping import STOP_AT_STEP  # noqa: E402


class Noisy(Dataset):
    """Two Gaussian blobs; every access adds fresh noise from torch's generator (augmentation)."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 2, (size,), generator=generator)
        self.x = torch.randn(size, 8, generator=generator) + self.labels[:, None].float() * 1.5

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + 0.1 * torch.randn(8), self.labels[index]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--ballast-mb", type=int, default=0)
    parser.add_argument("--signal-at", type=int)
    parser.add_argument("--agree-every", type=int)
    parser.add_argument("--stop-at-step", type=int)
    parser.add_argument("--step-s", type=float, default=0.0, help="sleep after each optimizer step (pacing)")
    parser.add_argument("--deadline-margin", type=float, default=60.0)
    parser.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument("--ema", type=float, help="keep an mgpu.EMA with this decay (in the state, evaluated)")
    parser.add_argument("--start-method", choices=["fork", "spawn", "forkserver"])
    args = parser.parse_args()
    if args.start_method:
        torch.multiprocessing.set_start_method(args.start_method)
    config = mgpu.Config()
    config.preemption.check_every_steps = args.agree_every
    config.preemption.deadline_margin_s = args.deadline_margin
    config.log.every_steps = 2  # session.log's progress events: status --verify compares runs at each of them

    if args.stop_at_step is not None:  # the test stop (mgpu.stop.stopping reads it)
        os.environ[STOP_AT_STEP] = str(args.stop_at_step)
    with mgpu.Session(args.run_dir, seed=3, config=config) as session:
        model = session.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2)),
                             parallel=args.parallel)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
        loader = session.loader(Noisy(96, seed=0), batch_size=4, num_workers=args.workers)
        evaluation = session.eval_loader(Noisy(30, seed=1), batch_size=8)
        kept = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader,
                "best": None, "bad_evals": 0, "ballast": torch.zeros(args.ballast_mb << 18)}
        ema = mgpu.EMA(model, args.ema) if args.ema is not None else None
        if ema is not None:
            kept["ema"] = ema
        state = session.load(kept)
        accumulate = 2
        for epoch in loader.epochs(args.epochs):
            model.train()
            for index, (x, y) in enumerate(loader):
                loss = F.cross_entropy(model(x.to(session.device)), y.to(session.device)) / accumulate
                loss.backward()
                if (index + 1) % accumulate and index + 1 < len(loader):
                    continue  # (a real loop would use no_sync here; the gradient is the same)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                if ema is not None:
                    ema.update()
                time.sleep(args.step_s)
                if session.step + 1 == args.signal_at and session.rank == session.world_size - 1:
                    os.killpg(os.getpgid(0), signal.SIGTERM)
                if session.should_stop():
                    break
                session.log(loss=loss * accumulate, lr=scheduler.get_last_lr()[0])  # read every 2nd step only
                if session.step % args.save_every == 0:
                    session.save(state)
            if session.stopping:
                break
            model.eval()
            sums = torch.zeros(2, dtype=torch.float64, device=session.device)
            with torch.no_grad(), ema.applied() if ema is not None else contextlib.nullcontext():
                for x, y in evaluation:
                    x, y = x.to(session.device), y.to(session.device)  # (on a GPU, the model's device)
                    sums += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)], dtype=torch.float64,
                                         device=session.device)
            correct, total = session.all_reduce(sums).tolist()
            accuracy = correct / total
            if state.best is None or accuracy > state.best:  # plain values live in the state: restored
                state.best, state.bad_evals = accuracy, 0
                session.save(state, best=True)
            else:
                state.bad_evals += 1
            if session.is_main:
                print(f"epoch {epoch} accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
