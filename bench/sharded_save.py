"""What a save and a resume cost: DDP single-file vs DDP sharded vs FSDP2.

    python bench/sharded_save.py [--ranks 2] [--mb 64] [--saves 3]

One run, side by side, on gloo/CPU ranks of this machine: a stack of Linear layers (`--mb` of fp32 weights,
AdamW state on top: about 3x that in all). `returns_s`: the time save() holds the loop (since the host copy is
taken before it returns, the whole copy); `blocked_s`: that plus any wait for a host copy still being taken
after it returned (8a0cea0's sharded save: the next forward waited for it; now none); `write_s`: until
durable; `step_s` / `step_in_flight_s`: one training step alone / while the save is still being written (its
slowdown); `resume_s`: finding the newest checkpoint
and putting it back into fresh objects (every rank); `peak_host_mb_node`: the ranks' resident memory above
their level before the save, at its highest during save and write, summed over the node's ranks (the copy a
save stages); `bytes_rank<r>`: what rank r wrote. Medians over the saves.
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


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _PeakRss:
    """The highest resident memory while it runs, sampled every 2 ms in a thread."""

    def __enter__(self) -> "_PeakRss":
        import threading

        self.base = self.peak = _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_mb())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())


def _timed_step(model: Any, optimizer: Any) -> float:
    started = time.perf_counter()
    _step(model, optimizer)
    return time.perf_counter() - started


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from mgpu.state.checkpointer import Checkpointer
    from mgpu.parallel.fsdp import shard
    from mgpu.record.ledger import Ledger
    from mgpu.record.rundir import RunDir
    from mgpu.state.sharded.checkpointer import ShardedCheckpointer
    from mgpu.state.train_state import gather_state

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
            saver: Any = Checkpointer(run, rank, world, Ledger(None, "", 0), keep_last=1)
        else:
            saver = ShardedCheckpointer(root / "checkpoints", rank, world, Ledger(None, "", 0), keep_last=1)
        returns, blocked, written, alone, in_flight, peaks = [], [], [], [], [], []
        for save in range(1, args.saves + 1):
            dist.barrier()
            alone.append(_timed_step(model, optimizer))
            dist.barrier()
            with _PeakRss() as rss:
                started = time.perf_counter()
                if form == "ddp-single":
                    saver.save(lambda: gather_state(objects, None), save, "periodic")
                    end = returned = time.perf_counter()
                    in_flight.append(_timed_step(model, optimizer))  # the write goes on in the background
                    saver.store and saver.store.wait()
                else:
                    saver.save_objects(objects, save, "periodic")
                    returned = time.perf_counter()
                    # 8a0cea0's saver returned before its host copy was taken (the next forward waited for it)
                    getattr(saver, "wait_staged", lambda: None)()
                    end = time.perf_counter()
                    in_flight.append(_timed_step(model, optimizer))
                    saver.settle()
                dist.barrier()
            returns.append(returned - started)
            blocked.append(end - started)
            written.append(time.perf_counter() - started)
            peak = [0.0] * world
            dist.all_gather_object(peak, rss.peak - rss.base)
            peaks.append(sum(peak))  # every rank of this run is on this node
        saver.close()
        resumed = _resume_s(form, root, rank, world, args.mb)
        step_dir = max((root / "checkpoints").glob("step_*"))
        mine = [p for p in step_dir.iterdir() if p.name.startswith(f"__{rank}_") or p.name == f"rank_{rank}.pt"]
        if form == "ddp-single":
            mine = list(step_dir.iterdir()) if rank == 0 else []
        sizes = [None] * world
        dist.all_gather_object(sizes, sum(p.stat().st_size for p in mine))
        rows.append({"form": form, "ranks": world, "returns_s": median(returns),
                     "blocked_s": median(blocked), "write_s": median(written),
                     "step_s": median(alone), "step_in_flight_s": median(in_flight), "resume_s": resumed,
                     "peak_host_mb_node": round(median(peaks), 1),
                     **{f"bytes_rank{r}": sizes[r] for r in range(world)}})
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def _resume_s(form: str, root: Path, rank: int, world: int, mb: int) -> float:
    """Seconds, on the slowest rank, to find the newest checkpoint and restore it into fresh objects."""
    import torch
    import torch.distributed as dist

    from mgpu.state.checkpointer import Checkpointer
    from mgpu.parallel.fsdp import shard
    from mgpu.record.ledger import Ledger
    from mgpu.record.rundir import RunDir
    from mgpu.state.sharded.checkpointer import ShardedCheckpointer
    from mgpu.state.sharded.format import restore_sharded
    from mgpu.state.train_state import restore_state

    model = _model(mb)
    if form == "fsdp-sharded":
        model = shard(model, torch.device("cpu"))
    objects: dict[str, Any] = {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4),
                               "progress": {"step": 0}}
    dist.barrier()
    started = time.perf_counter()
    if form == "ddp-single":
        loaded = Checkpointer(RunDir(root), rank, world, Ledger(None, "", 0), keep_last=1).find_latest()
        assert loaded is not None
        restore_state(loaded.state, objects, rank, 0)
    else:
        found = ShardedCheckpointer(root / "checkpoints", rank, world, Ledger(None, "", 0), keep_last=1).find_latest()
        assert found is not None
        restore_sharded(found, objects, rank, 0)
    took = [0.0] * world
    dist.all_gather_object(took, time.perf_counter() - started)
    return max(took)


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
