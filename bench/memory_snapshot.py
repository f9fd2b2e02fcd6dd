"""What snapshots in host memory cost (checkpoint.memory_every_steps): the step time with a snapshot every k
steps against none, side by side in one process, and the memory a snapshot takes.

    python bench/memory_snapshot.py                       # k = 1, 10, 100 and off; 7 repeats of 200 steps
    python bench/memory_snapshot.py --hidden 2048 --batch 256 --repeats 5

A plain AdamW loop (bench.tasks.mlp) with, after each step, exactly what the session adds at its step end
(`MemorySnapshots.take`: this rank's state as a checkpoint would hold it, into /dev/shm, two slots, sha256,
commit record). Every variant runs once per repeat, their order rotated each repeat, so a drift of the shared
machine hits all alike. The figure per k is the ratio of mean step times (mean over a repeat's steps after a
warm-up: the snapshot steps are the slow ones, a median would hide them; then the median over repeats) to
the variant without snapshots, in wall time and in the process's CPU time (steadier on a shared machine: other
processes' load stretches wall time, not this process's work), with the least and greatest of the per-repeat
(paired) CPU ratios; `expected_cpu_pct` is a snapshot's median CPU time over k median CPU step times without
snapshots (steadier still: it needs no difference of two noisy step times). Also: one snapshot's size (the node holds 2 slots x its ranks of them) and its
time, as a copy rate, from which the overhead of another model and step time follows:
overhead(k) ~ snapshot_s / (k x step_s).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import report  # noqa: E402

WARMUP = 5


def run(variant: int, steps: int, batch: int, hidden: int, base: Path,
        takes: list[tuple[float, float]]) -> tuple[float, float]:
    """Mean wall and CPU seconds per step after the warm-up, a snapshot every `variant` steps (0: none)."""
    import torch
    import torch.nn.functional as F

    from bench.tasks import mlp
    from mgpu.state.memory_state import MemorySnapshots
    from mgpu.state.train_state import Progress

    torch.manual_seed(0)
    model = mlp(hidden=hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    progress = Progress()
    objects = {"model": model, "optimizer": optimizer, "progress": progress}
    memory = MemorySnapshots.open(slurm_job="bench", run_id=f"k{variant}", config={}, world_size=1, rank=0,
                                  every=variant, version=None, base=base)
    x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))
    ends, cpu = [], []
    for step in range(1, WARMUP + steps + 1):
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        progress.step = step
        started, started_cpu = time.perf_counter(), time.process_time()
        if memory.take(step, objects, dict):
            takes.append((time.perf_counter() - started, time.process_time() - started_cpu))
        ends.append(time.perf_counter())
        cpu.append(time.process_time())
    memory.remove()
    return (ends[-1] - ends[WARMUP - 1]) / steps, (cpu[-1] - cpu[WARMUP - 1]) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="1,10,100", help="snapshot intervals to compare with none")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--base", default="/dev/shm", help="where the snapshots go (default: /dev/shm)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    variants = [0, *(int(k) for k in args.ks.split(","))]
    base = Path(tempfile.mkdtemp(prefix="mgpu-bench-", dir=args.base))
    times: dict[int, list[tuple[float, float]]] = {v: [] for v in variants}
    takes: list[tuple[float, float]] = []
    try:
        for repeat in range(args.repeats):
            order = variants[repeat % len(variants):] + variants[:repeat % len(variants)]
            for variant in order:
                times[variant].append(run(variant, args.steps, args.batch, args.hidden, base, takes))
        from bench.tasks import mlp
        from mgpu.state.memory_state import MemorySnapshots
        from mgpu.state.train_state import Progress

        model = mlp(hidden=args.hidden)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 256)).sum().backward()
        optimizer.step()
        probe = MemorySnapshots.open(slurm_job="bench", run_id="size", config={}, world_size=1, rank=0, every=1,
                                     version=None, base=base)
        probe.take(1, {"model": model, "optimizer": optimizer, "progress": Progress()}, dict)
        size = probe.last_bytes
        probe.remove()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    off = statistics.median(wall for wall, _ in times[0])
    off_cpu = statistics.median(cpu for _, cpu in times[0])
    snapshot_s = statistics.median(wall for wall, _ in takes)
    snapshot_cpu_s = statistics.median(cpu for _, cpu in takes)
    rows = []
    for variant in variants:
        step_s = statistics.median(wall for wall, _ in times[variant])
        cpu_s = statistics.median(cpu for _, cpu in times[variant])
        paired = sorted(t[1] / o[1] for t, o in zip(times[variant], times[0]))
        rows.append({"memory_every_steps": variant or "off", "step_ms": round(step_s * 1e3, 3),
                     "overhead_pct": round((step_s / off - 1) * 100, 2),
                     "cpu_step_ms": round(cpu_s * 1e3, 3), "cpu_overhead_pct": round((cpu_s / off_cpu - 1) * 100, 2),
                     "cpu_paired_pct_min": round((paired[0] - 1) * 100, 2),
                     "cpu_paired_pct_max": round((paired[-1] - 1) * 100, 2),
                     "expected_cpu_pct": round(snapshot_cpu_s / (variant * off_cpu) * 100, 2) if variant else 0.0,
                     "snapshot_mb": round(size / 1e6, 2), "snapshot_ms": round(snapshot_s * 1e3, 2),
                     "snapshot_cpu_ms": round(snapshot_cpu_s * 1e3, 2),
                     "copy_gb_s": round(size / snapshot_s / 1e9, 2),
                     "node_mb_per_rank": round(2 * size / 1e6, 2)})
    report("memory_snapshot", rows)


if __name__ == "__main__":
    main()
