"""One rank of the sharded-checkpoint tests (tests/test_fsdp.py), started by tests.conftest.start_ranks:

    python -m tests.sharded_worker save DIR STEPS      # FSDP2 training, a sharded save every step (async but
                                                       # the last); the full state in memory to DIR/ref.pt
    python -m tests.sharded_worker load DIR            # resume on this world size: MATCH if every parameter
                                                       # and optimizer state equals ref.pt, then one more step
    python -m tests.sharded_worker kill DIR POINT RANK # save step 1, then SIGKILL rank RANK at POINT of step 2's save
    python -m tests.sharded_worker late DIR RANK       # save step 1, then rank RANK writes step 2's shard 8 s late
                                                       # (the ranks wait 3 s for each other), then steps 3 and 4
                                                       # (asynchronous) and 5 (the final, waited-for save) on time:
                                                       # each rank's outcome of each save
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from mgpu.parallel import gloo_threads
from mgpu.parallel.fsdp import shard
from mgpu.record.ledger import Ledger
from mgpu.state.sharded.checkpointer import ShardedCheckpointer
from mgpu.state.sharded.format import restore_sharded


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # Uneven sizes (13, 7 rows): shards of different lengths on 2, 3 and 4 ranks.
    model = nn.Sequential(nn.Linear(5, 13), nn.BatchNorm1d(13), nn.ReLU(), nn.Linear(13, 7), nn.Linear(7, 3))
    model = shard(model, torch.device("cpu"))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    model(torch.randn(6, 5, generator=generator)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter, buffer and optimizer state in full (a collective)."""
    model_sd, optim_sd = get_state_dict(model, [optimizer], options=StateDictOptions(full_state_dict=True))
    return {"model": model_sd, "optim": optim_sd["state"]}


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return set(a) == set(b) and all(equal(a[k], b[k]) for k in a)
    return bool(a == b)


def main() -> None:
    mode, directory = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    gloo_threads.settle_at_exit()  # FSDP's mesh keeps the group past its destruction
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build()
    checkpointer = ShardedCheckpointer(directory / "checkpoints", rank, world, Ledger(None, None, 0), keep_last=3,
                                       wait_s=3.0 if mode == "late" else None)
    progress = {"step": 0}
    objects = {"model": model, "optimizer": optimizer, "progress": progress}
    if mode == "save":
        steps = int(sys.argv[3])
        for step in range(1, steps + 1):
            train_step(model, optimizer, step)
            objects["progress"] = {"step": step}
            checkpointer.save_objects(objects, step, "periodic", wait=step == steps)
        state = full_state(model, optimizer)
        if rank == 0:
            torch.save(state, directory / "ref.pt")
    elif mode == "load":
        loaded = checkpointer.find_latest()
        assert loaded is not None
        restore_sharded(loaded, objects, rank, seed=0)
        state = full_state(model, optimizer)
        ref = torch.load(directory / "ref.pt", weights_only=True)
        print(f"rank {rank}: step {objects['progress']['step']} {'MATCH' if equal(state, ref) else 'DIFFER'}",
              flush=True)
        train_step(model, optimizer, 99)  # the resharded optimizer steps
    elif mode == "kill":
        point, victim = sys.argv[3], int(sys.argv[4])
        train_step(model, optimizer, 1)
        checkpointer.save_objects({**objects, "progress": {"step": 1}}, 1, "periodic", wait=True)
        train_step(model, optimizer, 2)
        kill = lambda *_: os.kill(os.getpid(), signal.SIGKILL) if rank == victim else None  # noqa: E731
        if point == "write":  # while DCP writes the shard files
            from torch.distributed.checkpoint import FileSystemWriter

            original = FileSystemWriter.write_data

            def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
                future = original(self, plan, planner)
                future.wait()
                kill()
                return future

            FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
        elif point == "manifest":  # the shards are written, this rank's manifest is not
            original_manifest = ShardedCheckpointer._write_manifest
            ShardedCheckpointer._write_manifest = lambda self, job: (kill(), original_manifest(self, job))[1]  # type: ignore[method-assign]
        elif point == "install":  # rank 0 wrote meta.json, the directory is not renamed into place
            import mgpu.state.sharded.checkpointer as sharded

            original_install = sharded.CheckpointStore.install
            sharded.CheckpointStore.install = lambda self, tmp, final: (kill(), original_install(self, tmp, final))[1]  # type: ignore[method-assign]
        checkpointer.save_objects({**objects, "progress": {"step": 2}}, 2, "periodic", wait=point == "install")
        checkpointer.settle()
    elif mode == "late":
        from torch.distributed.checkpoint import FileSystemWriter

        from mgpu.state.single.store import CheckpointError

        victim = int(sys.argv[3])
        train_step(model, optimizer, 1)
        checkpointer.save_objects({**objects, "progress": {"step": 1}}, 1, "periodic", wait=True)
        original_write = FileSystemWriter.write_data
        late_once = [rank == victim]

        def late_write(self: Any, plan: Any, planner: Any) -> Any:
            if late_once.pop() if late_once else False:
                time.sleep(8)
            return original_write(self, plan, planner)

        FileSystemWriter.write_data = late_write  # type: ignore[method-assign]
        started = time.monotonic()
        try:
            checkpointer.save_objects({**objects, "progress": {"step": 2}}, 2, "periodic", wait=True)
            print(f"rank {rank}: step 2 saved", flush=True)
        except CheckpointError as error:
            print(f"rank {rank}: after {time.monotonic() - started:.0f} s: {error}", flush=True)
        for step in (3, 4, 5):  # the later saves, asynchronous ones and the final one (as a stop's)
            train_step(model, optimizer, step)
            try:
                checkpointer.save_objects({**objects, "progress": {"step": step}}, step, "periodic", wait=step == 5)
                outcome = checkpointer.settle() if step < 5 else None
                print(f"rank {rank}: step {step} {'saved' if outcome is None else outcome}", flush=True)
            except CheckpointError as error:
                print(f"rank {rank}: step {step} {error}", flush=True)
    checkpointer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
