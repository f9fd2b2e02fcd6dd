"""The peer most users have, for bench/chaos.py: a plain PyTorch DDP loop with no mgpu, restarted by
`torchrun --max-restarts` (bench/chaos_plain.sbatch) and requeued by Slurm after a preemption (`#SBATCH --requeue`).

    torchrun --standalone --nproc-per-node 4 bench/chaos_plain.py --dir RUN [--save-every 100] [--max-steps N]

What it does, as PyTorch's torchrun tutorial does with a step counter: rank 0 `torch.save`s the model, the
optimizer and the step every `--save-every` steps (to a temporary file, then renamed: a kill mid-write leaves the
last one whole), and at every start each rank loads it and skips the epoch's batches it had trained (the
DistributedSampler's order is the same for a given epoch). What it does not keep: the RNG streams (the dropout
draws after a restart are not the unbroken run's), anything after its last save, and nothing in memory; it has no
signal handler (a preemption's SIGTERM ends torchrun, which ends its workers) and no watchdog (a frozen rank holds
the others in their all-reduce until the process group's timeout, `--timeout-s`, NCCL's default 600 s).

The same model, data and step time as mgpu's job (bench/chaos_task.py). For the measurement only, rank 0 writes
mgpu's ledger events (`started`, `resumed`, `first_step`, `progress` with the weights' fingerprint,
mgpu.parallel.fsdp.weights_fingerprint), so bench/chaos.py reads both runs alike; nothing else of mgpu is used.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.chaos_task import ChaosTask  # noqa: E402
from mgpu.parallel.fsdp import weights_fingerprint  # noqa: E402
from mgpu.record.ledger import Ledger  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="the run's directory (checkpoint.pt, events.jsonl, ranks/)")
    parser.add_argument("--save-every", type=int, default=100, help="steps between torch.saves")
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this step (0: never)")
    parser.add_argument("--step-s", type=float, default=0.2, help="seconds each step sleeps (the pace)")
    parser.add_argument("--size", type=int, default=400, help="training samples")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="the process group's timeout")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Path(args.dir)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    (run / "ranks").mkdir(parents=True, exist_ok=True)
    # where this rank runs, for bench/chaos.py's injections (a real user has no need of it)
    (run / "ranks" / f"rank{rank}.json").write_text(json.dumps(
        {"pid": os.getpid(), "node": os.environ.get("SLURMD_NODENAME", socket.gethostname())}))
    ledger = Ledger(run / "events.jsonl" if rank == 0 else None, os.environ.get("SLURM_JOB_ID", "local"),
                    int(os.environ.get("SLURM_RESTART_COUNT") or 0))
    ledger.write("started", world_size=world, launcher="torchrun",
                 torchrun_restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0))

    torch.manual_seed(0)
    task = ChaosTask(size=args.size, step_s=args.step_s)
    model = DistributedDataParallel(task.build_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dataset = task.train_dataset()
    sampler: DistributedSampler[object] = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=1, sampler=sampler)
    checkpoint = run / "checkpoint.pt"
    step = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        ledger.write("resumed", step=step)
    resumed = step
    model.train()
    per_epoch = len(loader)
    last = time.time()
    while not args.max_steps or step < args.max_steps:
        sampler.set_epoch(step // per_epoch)
        skip = step % per_epoch
        for index, (x, y, _) in enumerate(loader):
            if index < skip:
                continue
            time.sleep(args.step_s)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0:
                now = time.time()
                if step == resumed + 1:
                    ledger.write("first_step", step=step)
                ledger.write("progress", step=step, fingerprint=weights_fingerprint(model.module),
                             metrics={"loss": loss.item(), "step_time_s": round(now - last, 4)})
                last = now
                if step % args.save_every == 0 or step == args.max_steps:
                    tmp = checkpoint.with_suffix(".tmp")
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "step": step}, tmp)
                    os.replace(tmp, checkpoint)
            if step == args.max_steps:
                break
    dist.barrier()  # rank 0 may still be saving
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
