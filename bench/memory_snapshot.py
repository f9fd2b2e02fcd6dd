"""What snapshots in host memory cost (checkpoint.memory_every_steps): the step time with a snapshot every k
steps against none, side by side in one process, and the memory a snapshot takes.

    python bench/memory_snapshot.py                       # k = 1, 10, 100 and off; 7 repeats of 200 steps
    python bench/memory_snapshot.py --hidden 2048 --batch 256 --repeats 5
    python bench/memory_snapshot.py --replica             # also k = 1, 10, 100 with the replica on a partner

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

`--replica` adds each k once more with the snapshots also replicated (mgpu.state.memory.replica): this process
is rank 0 of a world of 2 on "node a", its partner rank 1 on "node b" is a second process (no torch) serving the
replica over loopback TCP. The loop never waits for a send, so its cost to this process is the sender thread's
CPU (reading the snapshot back, its CRC-32, the socket), in this process's CPU time; the partner's receiving
and writing is another node's work, not counted here (on this one machine it shares the cores: wall time
shows it). Reported besides: how many snapshots were sent of those offered (a newer snapshot replaces one still
waiting to be sent), whether the partner held the newest at the end, and one send's time and rate.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402

if TYPE_CHECKING:
    from mgpu.state.memory.store import Identity

WARMUP = 5


class _FileDirectory:
    """The replica servers' addresses, as files (the job's rendezvous store in a run)."""

    def __init__(self, where: Path) -> None:
        self.where = where

    def publish(self, key: str, value: str) -> None:
        path = self.where / key.replace("/", "_")
        path.with_suffix(".tmp").write_text(value)
        path.with_suffix(".tmp").rename(path)

    def lookup(self, key: str, timeout: float) -> str:
        path, deadline = self.where / key.replace("/", "_"), time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {key} published within {timeout} s")
            time.sleep(0.01)
        return path.read_text()


PARTNER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from bench.memory_snapshot import _FileDirectory, _identity
from mgpu.state.memory.replica import Replication
base, run_id = Path(sys.argv[2]), sys.argv[3]
replication = Replication.start(_identity(run_id, 1), node="b", ranks_per_node=1, num_nodes=2, host="127.0.0.1",
                                directory=lambda: _FileDirectory(base), base=base)
print("serving", flush=True)
sys.stdin.read()  # until the bench closes it
replication.close()
"""


def _identity(run_id: str, rank: int) -> "Identity":
    """The identity rank `rank` of the bench's world of 2 gives its snapshots (the partner process's too)."""
    from mgpu.state.memory.store import Identity
    from mgpu.state.memory.snapshots import config_digest

    return Identity("bench", 0, run_id, config_digest({}), 2, rank)


def run(variant: int, steps: int, batch: int, hidden: int, base: Path,
        takes: list[tuple[float, float]], replica: dict[str, Any] | None = None) -> tuple[float, float]:
    """Mean wall and CPU seconds per step after the warm-up, a snapshot every `variant` steps (0: none).
    `replica`: also replicated to a partner process (rank 1 of 2, node b); what it committed goes into the dict."""
    import torch
    import torch.nn.functional as F

    from bench.tasks import mlp
    from mgpu.state.memory.snapshots import MemorySnapshots
    from mgpu.state.train_state import Progress

    torch.manual_seed(0)
    model = mlp(hidden=hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    progress = Progress()
    objects = {"model": model, "optimizer": optimizer, "progress": progress}
    run_id = f"k{variant}{'r' if replica is not None else ''}"
    memory = MemorySnapshots.open(slurm_job="bench", run_id=run_id, config={}, world_size=2 if replica is not None
                                  else 1, rank=0, every=variant, version=None, base=base)
    partner = None
    if replica is not None:
        from mgpu.state.memory.replica import Replication

        partner = subprocess.Popen([sys.executable, "-c", PARTNER, str(ROOT), str(base), run_id], text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert partner.stdout is not None and partner.stdout.readline().strip() == "serving"
        memory.replication = Replication.start(memory.store.identity, node="a", ranks_per_node=1, num_nodes=2,
                                               host="127.0.0.1", directory=lambda: _FileDirectory(base), base=base)
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
    if partner is not None and replica is not None and memory.replication is not None:
        sender = memory.replication.sender
        idle = sender.wait_idle(60)
        replica["offered"] = replica.get("offered", 0) + memory.taken
        replica["sent"] = replica.get("sent", 0) + sender.sent
        replica["failure"] = replica.get("failure") or sender.failure or (None if idle else "not idle after 60 s")
        newest = memory.store.committed()[0][0]
        replica["newest_held"] = replica.get("newest_held", True) and memory.replication.partner.steps()[:1] == [newest.step]
        started, started_cpu = time.perf_counter(), time.process_time()  # the newest once more, timed alone:
        memory.replication.partner.put(newest)                            # one send (read, CRC-32, loopback TCP)
        replica.setdefault("sends", []).append((time.perf_counter() - started, time.process_time() - started_cpu))
        partner.communicate("", timeout=60)
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
    parser.add_argument("--replica", action="store_true", help="also each k with a replica on a partner process")
    parser.add_argument("--out", help="the results' file (default: bench/results/memory_snapshot.json)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    ks = [int(k) for k in args.ks.split(",")]
    variants = [(0, False), *((k, False) for k in ks), *(((k, True) for k in ks) if args.replica else ())]
    base = Path(tempfile.mkdtemp(prefix="mgpu-bench-", dir=args.base))
    times: dict[tuple[int, bool], list[tuple[float, float]]] = {v: [] for v in variants}
    takes: list[tuple[float, float]] = []
    replicas: dict[int, dict[str, Any]] = {k: {} for k in ks}
    try:
        for repeat in range(args.repeats):
            order = variants[repeat % len(variants):] + variants[:repeat % len(variants)]
            for variant in order:
                k, replicated = variant
                times[variant].append(run(k, args.steps, args.batch, args.hidden, base, takes,
                                          replicas[k] if replicated else None))
        from bench.tasks import mlp
        from mgpu.state.memory.snapshots import MemorySnapshots
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
    off = statistics.median(wall for wall, _ in times[(0, False)])
    off_cpu = statistics.median(cpu for _, cpu in times[(0, False)])
    snapshot_s = statistics.median(wall for wall, _ in takes)
    snapshot_cpu_s = statistics.median(cpu for _, cpu in takes)
    rows = []
    for variant in variants:
        k, replicated = variant
        step_s = statistics.median(wall for wall, _ in times[variant])
        cpu_s = statistics.median(cpu for _, cpu in times[variant])
        paired = sorted(t[1] / o[1] for t, o in zip(times[variant], times[(0, False)]))
        row: dict[str, Any] = {"memory_every_steps": k or "off", "replica": replicated}
        if args.replica:
            row.update(offered=None, sent=None, newest_held=None, failure=None, send_ms=None, send_cpu_ms=None,
                       send_gb_s=None)
        own_cpu_s = snapshot_cpu_s
        if replicated:
            sent = replicas[k]
            send_s = statistics.median(wall for wall, _ in sent["sends"])
            send_cpu_s = statistics.median(cpu for _, cpu in sent["sends"])
            own_cpu_s += send_cpu_s  # the sender thread's work in this process, per snapshot
            row.update(offered=sent["offered"], sent=sent["sent"], newest_held=sent["newest_held"],
                       failure=sent["failure"], send_ms=round(send_s * 1e3, 2), send_cpu_ms=round(send_cpu_s * 1e3, 2),
                       send_gb_s=round(size / send_s / 1e9, 2))
        rows.append({**row, "step_ms": round(step_s * 1e3, 3),
                     "overhead_pct": round((step_s / off - 1) * 100, 2),
                     "cpu_step_ms": round(cpu_s * 1e3, 3), "cpu_overhead_pct": round((cpu_s / off_cpu - 1) * 100, 2),
                     "cpu_paired_pct_min": round((paired[0] - 1) * 100, 2),
                     "cpu_paired_pct_max": round((paired[-1] - 1) * 100, 2),
                     "expected_cpu_pct": round(own_cpu_s / (k * off_cpu) * 100, 2) if k else 0.0,
                     "snapshot_mb": round(size / 1e6, 2), "snapshot_ms": round(snapshot_s * 1e3, 2),
                     "snapshot_cpu_ms": round(snapshot_cpu_s * 1e3, 2),
                     "copy_gb_s": round(size / snapshot_s / 1e9, 2),
                     "node_mb_per_rank": round(2 * size / 1e6, 2)})
    report("memory_snapshot", rows, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
