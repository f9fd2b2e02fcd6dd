"""What each DataLoader worker start method costs, side by side in one process: fork (Python's default on Linux
before 3.14; on CPython 3.10 and 3.11 before 3.11.8 with mgpu's watch for gh-112275's hang), forkserver (no hang
possible, mgpu's `data.worker_start_method: forkserver`) and spawn (a loop that sets it). Per method: the time from
a new epoch's iterator to its first batch (the workers' start, paid every epoch by a loader without
persistent_workers), for a small dataset and for one that holds `--dataset-mb` of tensors (forkserver and spawn pickle
the dataset to every worker; a fork shares it). The process first imports torch and forms a gloo group, as a rank
has (a forkserver is started once per process: its first epoch is counted apart).

    python bench/worker_start.py [--workers 2] [--epochs 5] [--dataset-mb 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402  # at the top, as a training script has it: a forkserver preloads it once

from bench.common import median, report  # noqa: E402


class Tensors:
    """`size` samples of 64 floats, plus `ballast_mb` of data the dataset object holds (pickled with it)."""

    def __init__(self, size: int, ballast_mb: int) -> None:
        self.x = torch.randn(size, 64)
        self.ballast = torch.zeros(ballast_mb << 18)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> Any:
        return self.x[index]


def first_batches(method: str, dataset: Tensors, workers: int, epochs: int) -> list[float]:
    """Seconds from each epoch's iterator to its first batch."""
    from mgpu.data.loader import ResumableLoader

    options = {} if method == "fork" else {"multiprocessing_context": method}
    loader = ResumableLoader(dataset, 16, rank=0, world_size=1, seed=0, num_workers=workers, **options)
    times = []
    for _ in range(epochs):
        started = time.perf_counter()
        iterator = iter(loader)
        next(iterator)
        times.append(time.perf_counter() - started)
        del iterator
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--dataset-mb", type=int, default=256)
    args = parser.parse_args()
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    rows = []
    for ballast in (0, args.dataset_mb):
        dataset = Tensors(4096, ballast)
        fork = None
        for method in ("fork", "forkserver", "spawn"):
            times = first_batches(method, dataset, args.workers, args.epochs + 1)
            steady = median(times[1:])
            fork = steady if method == "fork" else fork
            rows.append({"dataset_mb": ballast, "method": method, "first_epoch_s": round(times[0], 3),
                         "per_epoch_s": round(steady, 3), "vs_fork": round(steady / fork, 1) if fork else None})
    dist.destroy_process_group()
    report("worker_start", rows)


if __name__ == "__main__":
    main()
