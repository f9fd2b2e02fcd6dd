"""What slows a CPU training step while a checkpoint is written beside it: the step's time with one background
thread doing each part of a save's work alone, side by side.

    python bench/step_interference.py [--mb 128] [--steps 30] [--repeats 3]

One process, the step of bench/periodic_saves.py (Linear layers + AdamW, one torch thread, glibc's freed memory
kept: `steady_malloc`) timed over `--steps` steps, per repeat in this order, each with one background thread:
- `none`: no thread;
- `compute`: crc32 of a 64 KiB buffer in a loop (a core's worth of work in its own cache, the GIL released);
- `memcpy`: a 400 MB copy in a loop (torch, the GIL released): the memory traffic of a save's copies;
- `direct_write`: O_DIRECT writes of one 8 MiB page-aligned buffer in a loop (mgpu.state.files.direct_io's unit): the
  disk's own work, its bytes already in the cache;
`ratio`: the median step time over `none`'s, `gb_s`: what the thread moved per second. On a 2-core machine the
step has one core and the thread the other: where a thread slows the step, it does so through what the cores
share (memory bandwidth, the hypervisor's I/O), not through the CPU it takes.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, report  # noqa: E402
from bench.periodic_saves import build, step, steady_malloc  # noqa: E402


def _compute(stop: threading.Event, moved: list[int], directory: Path) -> None:
    buffer = bytes(64 << 10)
    while not stop.is_set():
        for _ in range(100):
            zlib.crc32(buffer)
        moved[0] += 100 * len(buffer)


def _memcpy(stop: threading.Event, moved: list[int], directory: Path) -> None:
    import torch

    source, target = torch.empty(50 << 20, dtype=torch.float64), torch.empty(50 << 20, dtype=torch.float64)
    while not stop.is_set():
        target.copy_(source)
        moved[0] += source.nbytes


def _direct_write(stop: threading.Event, moved: list[int], directory: Path) -> None:
    path = directory / "direct.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    buffer, offset = mmap.mmap(-1, 8 << 20), 0
    try:
        while not stop.is_set():
            os.pwrite(fd, buffer, offset)
            moved[0] += len(buffer)
            offset = (offset + len(buffer)) % (400 << 20)
    finally:
        os.close(fd)
        path.unlink()


THREADS: dict[str, Callable[[threading.Event, list[int], Path], None] | None] = {
    "none": None, "compute": _compute, "memcpy": _memcpy, "direct_write": _direct_write}


def timed_steps(objects: tuple[Any, Any, Any], steps: int, work: Any, directory: Path) -> tuple[float, float]:
    stop, moved = threading.Event(), [0]
    thread = threading.Thread(target=work, args=(stop, moved, directory)) if work else None
    if thread:
        thread.start()
        time.sleep(0.2)  # the thread at full speed before the first step
    times = []
    started = time.perf_counter()
    for _ in range(steps):
        begun = time.perf_counter()
        step(*objects)
        times.append(time.perf_counter() - begun)
    elapsed = time.perf_counter() - started
    stop.set()
    if thread:
        thread.join()
    return median(times), moved[0] / elapsed / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    steady_malloc()
    objects = build(args.mb)
    for _ in range(3):
        step(*objects)
    directory = Path(tempfile.mkdtemp(prefix="step-interference-", dir=args.dir or Path.cwd()))
    results: dict[str, list[tuple[float, float]]] = {form: [] for form in THREADS}
    try:
        for repeat in range(args.repeats):
            for form, work in THREADS.items():
                results[form].append(timed_steps(objects, args.steps, work, directory))
            print(f"repeat {repeat + 1}: " + ", ".join(f"{f} {r[-1][0] * 1e3:.1f} ms" for f, r in results.items()),
                  flush=True)
    finally:
        directory.rmdir()
    rows = []
    for form, runs in results.items():
        ratios = [r[0] / none[0] for r, none in zip(runs, results["none"])]
        rows.append({"form": form, "step_ms": median([r[0] for r in runs]) * 1e3, "ratio": median(ratios),
                     "ratios": [round(r, 3) for r in ratios], "gb_s": median([r[1] for r in runs])})
    report("step_interference", rows, args.out)


if __name__ == "__main__":
    main()
