"""How long a save blocks the loop, and how many bytes each rank writes: DDP single-file vs DDP sharded vs FSDP2.

    python bench/sharded_save.py [--ranks 2] [--mb 64] [--saves 3]

One run, side by side, on gloo/CPU ranks of this machine: a stack of Linear layers (`--mb` of fp32 weights,
AdamW state on top: about 3x that in all). `blocked_s`: the save call plus the wait for the host copy (what
the next step waits for at worst); `write_s`: until durable; `bytes_rank<r>`: what rank r wrote.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, report  # noqa: E402


def _model(mb: int) -> Any:
    from torch import nn

    width = 1024
    layers = max(1, mb * 2**20 // (4 * width * width))
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def _step(model: Any, optimizer: Any) -> None:
    import torch

    model(torch.randn(4, 1024)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from mgpu.checkpointer import Checkpointer
    from mgpu.fsdp import shard
    from mgpu.ledger import Ledger
    from mgpu.rundir import RunDir
    from mgpu.sharded import ShardedCheckpointer
    from mgpu.train_state import gather_state

    rows = []
    for form in ("ddp-single", "ddp-sharded", "fsdp-sharded"):
        root = Path(args.dir) / form
        torch.manual_seed(0)
        model = _model(args.mb)
        if form == "fsdp-sharded":
            model = shard(model, torch.device("cpu"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        _step(model, optimizer)
        objects = {"model": model, "optimizer": optimizer, "progress": {"step": 0}}
        if form == "ddp-single":
            run = RunDir(root)
            saver: Any = Checkpointer(run, rank, world, Ledger(None, None, 0), keep_last=1)
        else:
            saver = ShardedCheckpointer(root / "checkpoints", rank, world, Ledger(None, None, 0), keep_last=1)
        blocked, written = [], []
        for save in range(1, args.saves + 1):
            dist.barrier()
            started = time.perf_counter()
            if form == "ddp-single":
                saver.save(lambda: gather_state(objects, None), save, "periodic")
                end = time.perf_counter()
                saver.store and saver.store.wait()
            else:
                saver.save_objects(objects, save, "periodic")
                saver.wait_staged()
                end = time.perf_counter()
                saver.settle()
            dist.barrier()
            blocked.append(end - started)
            written.append(time.perf_counter() - started)
            _step(model, optimizer)
        saver.close()
        step_dir = max((root / "checkpoints").glob("step_*"))
        mine = [p for p in step_dir.iterdir() if p.name.startswith(f"__{rank}_") or p.name == f"rank_{rank}.pt"]
        if form == "ddp-single":
            mine = list(step_dir.iterdir()) if rank == 0 else []
        sizes = [None] * world
        dist.all_gather_object(sizes, sum(p.stat().st_size for p in mine))
        rows.append({"form": form, "ranks": world, "blocked_s": median(blocked), "write_s": median(written),
                     **{f"bytes_rank{r}": sizes[r] for r in range(world)}})
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        args.dir = directory
        context = mp.get_context("spawn")
        queue = context.SimpleQueue()
        port = 20000 + os.getpid() % 10000
        procs = [context.Process(target=_rank, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
        for proc in procs:
            proc.start()
        rows = queue.get()
        for proc in procs:
            proc.join()
    single = rows[0]["blocked_s"]
    for row in rows:
        row["blocked_vs_single"] = row["blocked_s"] / single
    report("sharded_save", rows)


if __name__ == "__main__":
    main()
