"""Does a checkpoint write at the disk's speed? mgpu's saves beside a plain sequential write of the same bytes.

    python bench/write_speed.py [--mb 1024] [--repeats 3] [--dir DIR] [--writeback] [--ab-writeback] [--ab-direct]
                                [--profile]

One process, one directory (`--dir`, default a temporary one under the working directory: the filesystem a run's
checkpoints would be on). Per repeat, in this order, each from its call to durable (fsync'd, renamed):
- `plain_direct`: the same with O_DIRECT, from page-aligned memory, past the page cache (`dd oflag=direct`): the
  disk's own limit, steadier than the page cache's (`vs_direct`: its time / the form's, per repeat, median);
- `plain`: the N bytes written with 64 MiB writes to a new file, fsync'd (the disk's sequential limit; with
  `--writeback`, the writeback of each 64 MiB started as soon as it is written, as mgpu.state.writeback does: the
  limit of that technique, not of a naive write);
- `single`: `CheckpointStore.save` (the stop's save: synchronous, in the calling thread) of a state of N bytes;
- `single_async`: `save_async` + `wait` (a periodic save: the background writer), the snapshot included;
- `sharded`: `ShardedCheckpointer.save_objects(wait=True)` of a module holding the same N bytes (a gloo world of 1).
- with `--ab-direct`, also `single_buffered` and `sharded_buffered`: the saves through the page cache
  (mgpu.state.checkpoint.DIRECT_IO off), into stores of their own;
- with `--ab-in-place`, also `single_async_copied`: the background save with its snapshot copied into the
  writer's buffers (mgpu.state.direct_io.IN_PLACE_BYTES out of reach: the form before), not written in place;
- with `--ab-huge-pages`, also `plain_direct_4k`, `single_4k` and `sharded_4k`: the O_DIRECT write and saves from
  4 KiB pages (mgpu.state.direct_io.HUGE_PAGES off: the form before), into stores of their own;
- with `--ab-zlib`, also `single_zlib` and `sharded_zlib`: the saves with their digest's CRC-32 computed by zlib's
  own code (the form before; mgpu.state.digest.crc32 is zlib-ng's, the same values), into stores of their own;
- with `--ab-writeback`, also `plain_wb` (the plain write with its writeback started every 64 MiB), and
  `single_nowb` and `sharded_nowb`: the same saves with mgpu.state.writeback off (`WRITEBACK_BYTES = 0`), into
  stores of their own, alternating with the others (that technique's share alone).
A plain write runs before the first save and after every save, so each save has a plain write on either side:
its `ratio` is the mean of those two plain times / its own time (1.0 = the disk's speed), which follows the
disk's drift (other processes' writes) better than comparing the best of each column; `ratio_best` /
`ratio_median` are the best and the median of those per-save ratios. `cpu_s`: the process's CPU seconds during
the operation (all threads; the plain write's is the copy into the page cache), a figure the disk's noise does
not move. `durable_s`: the save's own time to durable as it reports it (SavedCheckpoint.seconds, the ledger's
`checkpoint_saved`): the call's time less what follows durability (pruning the previous step), and
`ratio_durable` its per-save ratio; `request_kib`: the mean size of the write requests the device took during the
form (/sys/dev/block/M:N/stat; other processes' writes included), median; `vs_direct_durable`: the O_DIRECT plain write's time to durable (the unlink
of its file, which the call's time includes as a save's includes pruning, left out) / the form's, per repeat, median. The disk is noisy: run it a few times and read best and median together.

`--profile`: the phases of one single-file save timed apart (torch.save into a null sink, the digest of N bytes,
the plain write + fsync) and a cProfile of `CheckpointStore.save`, to bench/results/write_speed_profile.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, median, report  # noqa: E402

CHUNK = 64 << 20


def _sync_file_range() -> Any:
    import ctypes

    function = ctypes.CDLL(None, use_errno=True).sync_file_range
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


def plain_write(path: Path, data: memoryview, writeback: bool = False, direct: bool = False) -> None:
    """The physical limit: large sequential writes, then fsync (file and directory). `direct`: with O_DIRECT
    (`data` page-aligned, as `aligned_copy` makes it), past the page cache, as `dd oflag=direct` writes."""
    start_writeback = _sync_file_range() if writeback else None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        for start in range(0, len(data), CHUNK):
            os.write(fd, data[start:start + CHUNK])
            if start_writeback is not None:
                start_writeback(fd, start, CHUNK, 2)  # SYNC_FILE_RANGE_WRITE
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def aligned_copy(data: memoryview, huge_pages: bool = True) -> memoryview:
    """`data` copied into page-aligned memory, for O_DIRECT: by default where mgpu's O_DIRECT writer keeps its
    buffers (mgpu.state.direct_io.aligned_buffer: transparent huge pages where granted, the device's largest
    requests), else an anonymous shared mapping of 4 KiB pages (`huge_pages=False`: the form before)."""
    import mmap

    if huge_pages:
        from mgpu.state.direct_io import aligned_buffer

        _, view = aligned_buffer(len(data))  # (HUGE_PAGES is on but while a `_4k` form runs)
        view[:] = data
        return view
    copy = mmap.mmap(-1, len(data))
    copy[:] = data
    return memoryview(copy)


def build_module(total_bytes: int) -> Any:
    """A module of fp32 parameters holding `total_bytes` in all (pieces of 64 MiB: a model's big matrices)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    module = nn.ParameterList()
    left = total_bytes
    while left > 0:
        size = min(left, 64 << 20)
        module.append(nn.Parameter(torch.randn(size // 4)))
        left -= size
    return module


def with_setting(module: Any, name: str, value: Any, save: Callable[[int], float]) -> Callable[[int], float]:
    """`save` run with `module.name` set to `value` (restored after): a save form with one mgpu setting changed."""
    def run(step: int) -> float:
        kept = getattr(module, name)
        setattr(module, name, value)
        try:
            return save(step)
        finally:
            setattr(module, name, kept)
    return run


def device_writes(directory: Path) -> Callable[[], tuple[int, int]] | None:
    """A reader of the (write requests, bytes written) counters of the block device under `directory`
    (/sys/dev/block/M:N/stat), or None where there is none (tmpfs, overlay): the size of the requests a write
    reached the device in."""
    device = os.stat(directory).st_dev
    stat = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/stat")
    if not stat.exists():
        return None

    def read() -> tuple[int, int]:
        fields = stat.read_text().split()
        return int(fields[4]), int(fields[6]) * 512  # writes completed, sectors written (always 512-byte units)
    return read


def timed(action: Callable[[], Any], cpu: list[float] | None = None) -> float:
    started, cpu_started = time.perf_counter(), time.process_time()
    action()
    if cpu is not None:
        cpu.append(time.process_time() - cpu_started)
    return time.perf_counter() - started


def profile(directory: Path, state: dict[str, Any], data: memoryview) -> None:
    import hashlib

    import torch

    from mgpu.state.checkpoint import CheckpointStore

    class Null(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            return len(memoryview(b))

    lines = [f"{len(data) / 1e9:.3f} GB, {os.cpu_count()} cores, load {os.getloadavg()}"]
    lines.append(f"torch.save -> null sink   {len(data) / timed(lambda: torch.save(state, Null())) / 1e9:.2f} GB/s")
    lines.append(f"sha256 of N bytes         {len(data) / timed(lambda: hashlib.sha256(data).digest()) / 1e9:.2f} GB/s")
    lines.append(f"plain write + fsync       {len(data) / timed(lambda: plain_write(directory / 'p', data)) / 1e9:.2f} GB/s")
    (directory / "p").unlink()
    store = CheckpointStore(directory / "profiled", keep_last=1)
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.runcall(store.save, state, 1)
    lines.append(f"CheckpointStore.save      {len(data) / (time.perf_counter() - started) / 1e9:.2f} GB/s")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
    out = ROOT / "bench" / "results" / "write_speed_profile.txt"
    out.write_text("\n".join(lines) + "\n\n" + text.getvalue())
    print("\n".join(lines))
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=1024, help="MiB of tensors per save")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory here)")
    parser.add_argument("--writeback", action="store_true", help="the plain write starts writeback early too")
    parser.add_argument("--ab-writeback", action="store_true", help="also each save form with early writeback off")
    parser.add_argument("--ab-direct", action="store_true", help="also each save form through the page cache")
    parser.add_argument("--ab-in-place", action="store_true",
                        help="also the background save with its snapshot copied into the buffers (no in-place writes)")
    parser.add_argument("--ab-huge-pages", action="store_true",
                        help="also the O_DIRECT plain write and saves from 4 KiB pages (direct_io.HUGE_PAGES off)")
    parser.add_argument("--ab-zlib", action="store_true",
                        help="also the saves with the digest's CRC-32 by zlib's code instead of zlib-ng's")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from mgpu.state.checkpoint import CheckpointStore
    from mgpu.record.ledger import Ledger
    from mgpu.state.sharded import ShardedCheckpointer

    base = args.dir or Path.cwd()
    base.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="write-speed-", dir=base))
    try:
        total = args.mb << 20
        module = build_module(total)
        state = {"model": module.state_dict()}
        data = memoryview(torch.cat([p.detach().view(-1) for p in module]).numpy()).cast("B")
        if args.profile:
            profile(directory, state, data)
            return
        store = CheckpointStore(directory / "single", keep_last=1)
        async_store = CheckpointStore(directory / "single_async", keep_last=1)
        store_file = tempfile.NamedTemporaryFile(prefix="store-", delete=False)
        dist.init_process_group("gloo", init_method=f"file://{store_file.name}", rank=0, world_size=1)
        ledger_path = directory / "ledger.jsonl"
        sharded = ShardedCheckpointer(directory / "sharded", 0, 1, Ledger(ledger_path, "", 0), keep_last=1)

        def ledger_seconds() -> float:
            lines = ledger_path.read_text().splitlines()
            return float(json.loads(lines[-1])["seconds"])

        saves: dict[str, Callable[[int], float]] = {
            "single": lambda step: store.save(state, step).seconds,
            "single_async": lambda step: (async_store.save_async(state, step), async_store.wait())[1].seconds,
            "sharded": lambda step: (sharded.save_objects({"model": module}, step, "bench", wait=True),
                                     ledger_seconds())[1]}
        aligned = aligned_copy(data)

        def plain_direct(step: int) -> float:
            seconds = timed(lambda: plain_write(directory / "plain_direct.bin", aligned, direct=True))
            (directory / "plain_direct.bin").unlink()
            return seconds

        saves = {"plain_direct": plain_direct, **saves}
        if args.ab_direct:
            from mgpu.state import checkpoint as checkpoint_module

            def buffered(save: Callable[[int], float]) -> Callable[[int], float]:
                return with_setting(checkpoint_module, "DIRECT_IO", False, save)

            store_buffered = CheckpointStore(directory / "single_buffered", keep_last=1)
            sharded_buffered = ShardedCheckpointer(directory / "sharded_buffered", 0, 1, Ledger(ledger_path, "", 0),
                                                   keep_last=1)
            saves["single_buffered"] = buffered(lambda step: store_buffered.save(state, step).seconds)
            saves["sharded_buffered"] = buffered(lambda step: (
                sharded_buffered.save_objects({"model": module}, step, "bench", wait=True), ledger_seconds())[1])
            order = ["plain_direct", "single", "single_buffered", "single_async", "sharded", "sharded_buffered"]
            saves = {form: saves[form] for form in order}
        if args.ab_writeback:
            from mgpu.state import writeback

            def without_writeback(save: Callable[[int], float]) -> Callable[[int], float]:
                return with_setting(writeback, "WRITEBACK_BYTES", 0, save)

            store_nowb = CheckpointStore(directory / "single_nowb", keep_last=1)
            sharded_nowb = ShardedCheckpointer(directory / "sharded_nowb", 0, 1, Ledger(ledger_path, "", 0), keep_last=1)
            saves["single_nowb"] = without_writeback(lambda step: store_nowb.save(state, step).seconds)
            saves["sharded_nowb"] = without_writeback(
                lambda step: (sharded_nowb.save_objects({"model": module}, step, "bench", wait=True), ledger_seconds())[1])
            def plain_wb(step: int) -> float:
                seconds = timed(lambda: plain_write(directory / "plain_wb.bin", data, True))
                (directory / "plain_wb.bin").unlink()
                return seconds

            saves["plain_wb"] = plain_wb
            order = ["plain_direct", "plain_wb", "single", "single_nowb", "single_async", "sharded", "sharded_nowb"]
            saves = {form: saves[form] for form in order}
        if args.ab_in_place:
            from mgpu.state import direct_io

            async_copied = CheckpointStore(directory / "single_async_copied", keep_last=1)
            saves["single_async_copied"] = with_setting(direct_io, "IN_PLACE_BYTES", 1 << 62, lambda step: (
                async_copied.save_async(state, step), async_copied.wait())[1].seconds)
            order = ["plain_direct", "single", "single_async", "single_async_copied", "sharded"]
            saves = {form: saves[form] for form in order}
        if args.ab_huge_pages:
            from mgpu.state import direct_io

            def small_pages(save: Callable[[int], float]) -> Callable[[int], float]:
                return with_setting(direct_io, "HUGE_PAGES", False, save)

            aligned_4k = aligned_copy(data, huge_pages=False)

            def plain_direct_4k(step: int) -> float:
                seconds = timed(lambda: plain_write(directory / "plain_direct_4k.bin", aligned_4k, direct=True))
                (directory / "plain_direct_4k.bin").unlink()
                return seconds

            store_4k = CheckpointStore(directory / "single_4k", keep_last=1)
            sharded_4k = ShardedCheckpointer(directory / "sharded_4k", 0, 1, Ledger(ledger_path, "", 0), keep_last=1)
            saves["plain_direct_4k"] = plain_direct_4k
            saves["single_4k"] = small_pages(lambda step: store_4k.save(state, step).seconds)
            saves["sharded_4k"] = small_pages(lambda step: (
                sharded_4k.save_objects({"model": module}, step, "bench", wait=True), ledger_seconds())[1])
            order = ["plain_direct", "plain_direct_4k", "single", "single_4k", "single_async", "sharded", "sharded_4k"]
            saves = {form: saves[form] for form in order}
        if args.ab_zlib:
            import zlib

            from mgpu.state import digest

            def zlib_crc(save: Callable[[int], float]) -> Callable[[int], float]:
                return with_setting(digest, "crc32", zlib.crc32, save)

            store_zlib = CheckpointStore(directory / "single_zlib", keep_last=1)
            sharded_zlib = ShardedCheckpointer(directory / "sharded_zlib", 0, 1, Ledger(ledger_path, "", 0), keep_last=1)
            saves["single_zlib"] = zlib_crc(lambda step: store_zlib.save(state, step).seconds)
            saves["sharded_zlib"] = zlib_crc(lambda step: (
                sharded_zlib.save_objects({"model": module}, step, "bench", wait=True), ledger_seconds())[1])
            order = ["plain_direct", "single", "single_zlib", "single_async", "sharded", "sharded_zlib"]
            saves = {form: saves[form] for form in order}
        times: dict[str, list[float]] = {"plain": [], **{form: [] for form in saves}}
        cpu: dict[str, list[float]] = {form: [] for form in times}
        ratios: dict[str, list[float]] = {form: [] for form in times}
        durable: dict[str, list[float]] = {form: [] for form in times}
        durable_ratios: dict[str, list[float]] = {form: [] for form in times}
        requests: dict[str, list[float]] = {form: [] for form in times}
        counters = device_writes(directory)

        def plain() -> float:
            seconds = timed(lambda: plain_write(directory / "plain.bin", data, args.writeback), cpu["plain"])
            (directory / "plain.bin").unlink()
            times["plain"].append(seconds)
            return seconds

        before = plain()
        for step in range(1, args.repeats + 1):
            for form, save in saves.items():
                reported: list[float] = []
                counted = counters() if counters else None
                seconds = timed(lambda: reported.append(save(step)), cpu[form])
                if counters and counted:
                    writes, written = (now - then for now, then in zip(counters(), counted))
                    requests[form].append(written / max(writes, 1) / 1024)
                after = plain()
                times[form].append(seconds)
                ratios[form].append((before + after) / 2 / seconds)
                durable[form].append(reported[0])
                durable_ratios[form].append((before + after) / 2 / reported[0])
                ratios["plain"].append(1.0)
                before = after
            print(f"repeat {step}: " + ", ".join(f"{k} {total / v[-1] / 1e9:.2f} GB/s" for k, v in times.items()),
                  flush=True)
        sharded.close()
        if args.ab_writeback:
            sharded_nowb.close()
        if args.ab_direct:
            sharded_buffered.close()
        if args.ab_huge_pages:
            sharded_4k.close()
        if args.ab_zlib:
            sharded_zlib.close()
        async_store.close()
        if args.ab_in_place:
            async_copied.close()
        dist.destroy_process_group()
        os.unlink(store_file.name)
        rows = []
        for form, seconds in times.items():
            rows.append({"form": form, "bytes": total, "best_s": min(seconds), "median_s": median(seconds),
                         "best_gb_s": total / min(seconds) / 1e9, "median_gb_s": total / median(seconds) / 1e9,
                         "ratio_best": max(ratios[form]), "ratio_median": median(ratios[form]),
                         "cpu_s": median(cpu[form]),
                         "vs_direct": median([d / t for d, t in zip(times["plain_direct"], seconds)]),
                         "durable_s": median(durable[form] or seconds),
                         "vs_direct_durable": median([d / t for d, t in zip(durable["plain_direct"], durable[form] or seconds)]),
                         "ratio_durable": median(durable_ratios[form] or ratios[form]),
                         "request_kib": round(median(requests[form]), 1) if requests[form] else None,
                         "all_s": [round(s, 3) for s in seconds]})
        report("write_speed", rows, args.out)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
