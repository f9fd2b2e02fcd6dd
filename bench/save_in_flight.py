"""A save in flight: training step time while `CheckpointStore.save_async` writes in the background, over the
step time with no save in flight, measured side by side in one run (302M parameters + AdamW, 3.6 GB, as in
bench/checkpoint_stall.py), for the writer as it was (`before`) and as it is (`after`), alternating.

    python bench/save_in_flight.py                         # 302M parameters, 4 repeats of before and after
    python bench/save_in_flight.py --threads 2             # the step on every core of this 2-core machine
    python bench/save_in_flight.py --layers 2 --repeats 2 --variants before,after,nice-only,no-crc-only
    python bench/save_in_flight.py --profile               # + cProfile of both threads while writing

The step stands for a GPU step on this CPU machine: a few large matmuls (torch releases the GIL inside every
op, as a training thread waiting for its GPU does) plus the Python-dispatch-heavy part of a small model's step
(a deep narrow MLP's forward, backward and a per-parameter AdamW: the GIL held most of the time, as while
launching kernels). By default on one torch thread, leaving the writer a core as a GPU node's spare cores do;
`--threads` = the cores: every core busy with the step, as one CPU rank per core. Per repeat and variant:
`--idle-steps` steps with no save in flight, then one `save_async` (its blocking snapshot is
bench/checkpoint_stall.py's figure, not counted here) and every step until the write is durable, then idle
steps again. The figure: median over repeats of median(step while writing) / median(step of the idle phases
before and after). Target: <= 1.05.

Where a slowdown comes from, per step of the training thread (Linux schedstat of the thread): on a CPU
(`cpu_ms`), waiting for a CPU (`runqueue_ms`: the cores are busy, e.g. with the writer's hashing), or
neither (`blocked_ms`: with one torch thread, waiting for the GIL, since the step does no I/O; with more,
also waiting for an op's other threads, themselves waiting for a CPU).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.checkpoint_stall import build_state  # noqa: E402
from bench.common import ROOT, median, report  # noqa: E402


def schedstat(tid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting in a run queue) of one thread so far."""
    fields = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
    return int(fields[0]) / 1e9, int(fields[1]) / 1e9


class Step:
    """One stand-in training step: GIL-free compute (matmuls) plus GIL-held dispatch (a small model's step)."""

    def __init__(self, size: int, matmuls: int, layers: int, width: int) -> None:
        import torch
        from torch import nn

        generator = torch.Generator().manual_seed(0)
        self.a = torch.randn(size, size, generator=generator)
        self.b = torch.randn(size, size, generator=generator) / size ** 0.5
        self.c = torch.empty(size, size)
        self.matmuls = matmuls
        self.model = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=False)
        self.x = torch.randn(16, width, generator=generator)
        self.tid = threading.get_native_id()

    def __call__(self) -> dict[str, float]:
        import torch

        cpu0, wait0 = schedstat(self.tid)
        start = time.perf_counter()
        for _ in range(self.matmuls):
            torch.mm(self.a, self.b, out=self.c)
        middle = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        self.model(self.x).square().mean().backward()
        self.optimizer.step()
        end = time.perf_counter()
        cpu1, wait1 = schedstat(self.tid)
        wall = end - start
        return {"step": wall, "matmul": middle - start, "dispatch": end - middle, "cpu": cpu1 - cpu0,
                "runqueue": wait1 - wait0, "blocked": max(0.0, wall - (cpu1 - cpu0) - (wait1 - wait0))}


def _mean(steps: list[dict[str, float]], key: str) -> float:
    return statistics.fmean(s[key] for s in steps) if steps else float("nan")


VARIANTS = {"before": (0, True), "after": (10, False), "nice-only": (10, True), "no-crc-only": (0, False)}
"""The writer as it was (the training thread's priority, torch's zip CRC32s) and as it is: (WRITER_NICE, ZIP_CRC32)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="of the saved model (8 x 6144^2: 302M parameters)")
    parser.add_argument("--width", type=int, default=6144)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--variants", default="before,after", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the step")
    parser.add_argument("--idle-steps", type=int, default=30)
    parser.add_argument("--matmul-size", type=int, default=1024)
    parser.add_argument("--matmuls", type=int, default=2)
    parser.add_argument("--dispatch-layers", type=int, default=24, help="of the small model whose step is dispatch")
    parser.add_argument("--dispatch-width", type=int, default=32)
    parser.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (s)")
    parser.add_argument("--profile", action="store_true", help="cProfile both threads while writing")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"unknown variant {unknown[0]!r}: choose from {', '.join(VARIANTS)}")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still removes its 7 GB of files

    import os

    import torch

    from mgpu.state.single import store as checkpoint
    from mgpu.state.single.store import CheckpointStore

    torch.set_num_threads(args.threads)
    state, params = build_state(args.layers, args.width)
    step = Step(args.matmul_size, args.matmuls, args.dispatch_layers, args.dispatch_width)
    root = Path(tempfile.mkdtemp(prefix="mgpu-bench-", dir=args.dir))
    writer_profile = cProfile.Profile() if args.profile else None
    train_profile = cProfile.Profile() if args.profile else None

    class Store(CheckpointStore):
        def _write_state(self, state: dict[str, Any], path: Path, snapshot: Any = None) -> dict[str, Any]:
            if writer_profile is None:
                return super()._write_state(state, path, snapshot)
            return writer_profile.runcall(super()._write_state, state, path, snapshot)  # type: ignore[no-any-return]

    store = Store(root / "store", keep_last=1)
    # variant -> [(idle steps around the write, steps while writing)]
    phases: dict[str, list[tuple[list[dict[str, float]], list[dict[str, float]]]]] = {v: [] for v in variants}
    write_s: dict[str, list[float]] = {v: [] for v in variants}
    saves = 0
    try:
        store.save_async(state, 0)  # the staging buffers, allocated once (checkpoint_stall's first save)
        store.wait()
        for _ in range(5):
            step()
        idle = [step() for _ in range(args.idle_steps)]
        for repeat in range(args.repeats):
            for variant in variants if repeat % 2 == 0 else variants[::-1]:  # ABBA: drift cancels
                checkpoint.WRITER_NICE, checkpoint.ZIP_CRC32 = VARIANTS[variant]
                saves += 1
                store.save_async(state, saves)
                started = time.perf_counter()
                writing = []
                if train_profile is not None and variant == variants[-1]:
                    train_profile.enable()
                while store.in_flight:
                    writing.append(step())
                if train_profile is not None:
                    train_profile.disable()
                store.wait()
                write_s[variant].append(time.perf_counter() - started)
                after = [step() for _ in range(args.idle_steps)]
                phases[variant].append((idle + after, writing))
                print(f"repeat {repeat + 1} {variant}: {len(writing)} steps while writing "
                      f"({write_s[variant][-1]:.1f} s), "
                      f"step {median([s['step'] for s in writing]) * 1e3:.1f} ms vs "
                      f"{median([s['step'] for s in idle + after]) * 1e3:.1f} ms idle", flush=True)
                idle = after
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)

    rows = []
    for variant in variants:
        ratios = [median([s["step"] for s in w]) / median([s["step"] for s in i]) for i, w in phases[variant] if w]
        all_idle = [s for i, _ in phases[variant] for s in i]
        all_writing = [s for _, w in phases[variant] for s in w]
        nice, crc = VARIANTS[variant]
        row: dict[str, Any] = {"writer": variant, "nice": nice, "crc32": crc, "params_M": params / 1e6,
                               "torch_threads": torch.get_num_threads(), "cores": os.cpu_count(),
                               "switch_interval_ms": sys.getswitchinterval() * 1e3,
                               "step_idle_ms": median([s["step"] for s in all_idle]) * 1e3,
                               "step_writing_ms": median([s["step"] for s in all_writing]) * 1e3,
                               "ratio": median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                               "write_s": median(write_s[variant]), "steps_writing": len(all_writing),
                               "repeats": len(ratios)}
        for part in ("matmul", "dispatch", "cpu", "runqueue", "blocked"):
            row[f"{part}_idle_ms"] = _mean(all_idle, part) * 1e3
            row[f"{part}_writing_ms"] = _mean(all_writing, part) * 1e3
        rows.append(row)
    out = args.out or ROOT / "bench" / "results" / "save_in_flight.json"
    report("save_in_flight", rows, out)
    if writer_profile is not None and train_profile is not None:
        text = io.StringIO()
        for name, profile in (("writer thread (CheckpointStore._write_state), every save", writer_profile),
                              (f"training thread, while the {variants[-1]!r} writer writes", train_profile)):
            text.write(f"==== {name}\n")
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        path = out.with_name(out.stem + "_profile.txt")
        path.write_text(text.getvalue())
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
