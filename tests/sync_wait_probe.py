"""Run under torchrun (2 ranks, gloo): rank 1 sleeps SLEEP_S before its DDP forward (where the buffer broadcast
waits for it), or before its backward (where the gradient reduction does); every rank writes what
mgpu.parallel.sync_wait measured per step, and the step's wall time, to OUT/<where>-rank<N>.json.

    torchrun --nproc-per-node 2 tests/sync_wait_probe.py OUT [DEVICE]

DEVICE `cuda`: both ranks on the one GPU (gloo reduces CUDA tensors), the waits measured by CUDA events.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mgpu.parallel import gloo_threads
from mgpu.parallel.sync_wait import SyncWait

SLEEP_S = 0.1
STEPS = 5

if __name__ == "__main__":
    out = Path(sys.argv[1])
    device = torch.device(sys.argv[2] if len(sys.argv) > 2 else "cpu")
    dist.init_process_group("gloo")
    gloo_threads.settle_at_exit()  # a DDP model keeps the group past its destruction
    rank = dist.get_rank()
    torch.manual_seed(0)
    for where in ("forward", "backward"):
        # BatchNorm's buffers: DDP broadcasts them at every forward (a wait for the late rank there)
        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)).to(device))
        meter = SyncWait(device)
        meter.attach(ddp)
        steps = []
        for _ in range(STEPS):
            began = time.perf_counter()
            if rank == 1 and where == "forward":
                time.sleep(SLEEP_S)
            loss = ddp(torch.randn(8, 16, device=device)).sum()
            if rank == 1 and where == "backward":
                time.sleep(SLEEP_S)
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()  # the step's events done: take() reads them now, not at a later step
            steps.append({"wall": time.perf_counter() - began, "waited": meter.take()})
        (out / f"{where}-rank{rank}.json").write_text(json.dumps(steps))
        del ddp, meter  # the reducer before the group: a DDP alive at the group's destruction aborted the process
    import gc

    gc.collect()
    dist.destroy_process_group()
