"""Does a checkpoint write at the disk's speed? mgpu's saves beside a plain sequential write of the same bytes.

    python bench/write_speed.py [--mb 1024] [--repeats 3] [--dir DIR] [--ab-writeback] [--ab-direct] [--ab-in-place]
                                [--ab-huge-pages] [--ab-zlib] [--ab-busy-core] [--ab-stager] [--ab-pipeline]
                                [--ab-staging] [--ab-digest] [--ab-no-checksum] [--ab-sharded-in-place]
                                [--profile]

One process, one directory (`--dir`, default a temporary one under the working directory: the filesystem a run's
checkpoints would be on). The disk's speed is one reference (bench/disk_speed.py, which says why): the faster of a
buffered write + fsync and an O_DIRECT write + fsync of the same bytes, 64 MiB blocks, same directory, same
process; taken right before the first save and after every save, so that each save has one on either side. Per
repeat, in this order, each from its call to durable (fsync'd, renamed):
- `single`: `CheckpointStore.save` (the stop's save: synchronous, in the calling thread) of a state of N bytes;
- `single_async`: `save_async` + `wait` (a periodic save: the background writer), the snapshot included;
- `sharded`: `ShardedCheckpointer.save_objects(wait=True)` (the stop's) of a module holding the same N bytes (a gloo
  world of 1);
- `sharded_async`: `save_objects` then `settle` (a periodic one: the host copy staged, the write in a thread);
- `peer_snapshot`: the periodic saves' hand-written peer (bench/disk_speed.snapshot_write): the same bytes copied
  into page-aligned memory kept between saves, 64 MiB at a time, each chunk written with O_DIRECT by a second thread
  as soon as it is copied, then fsync. A periodic save must copy what it writes while training goes on; this is that
  copy and that write with nothing else (no format, no checksum). `single_async` and `sharded_async` each give
  `vs_peer` (the peer's time to durable over the save's, per repeat, median; 1.0: as fast) and `vs_peer_best`;
- with `--ab-direct`, also `single_buffered` and `sharded_buffered`: the saves through the page cache
  (mgpu.state.single.store.DIRECT_IO off), into stores of their own;
- with `--ab-in-place`, also `single_async_copied`: the background save with its snapshot copied into the
  writer's buffers (mgpu.state.files.direct_io.IN_PLACE_BYTES out of reach: the form before), not written in place;
- with `--ab-huge-pages`, also `plain_direct_4k`, `single_4k` and `sharded_4k`: an O_DIRECT write and saves from
  4 KiB pages (mgpu.state.files.direct_io.HUGE_PAGES off: the form before), into stores of their own;
- with `--ab-zlib`, also `single_zlib` and `sharded_zlib`: the saves with their digest's CRC-32 computed by zlib's
  own code (the form before; mgpu.state.files.digest.crc32 is zlib-ng's, the same values), into stores of their own;
- with `--ab-pipeline`, also `single_async_copied_first`: the periodic single-file save with its whole snapshot
  copied before the writer takes it (mgpu.state.single.store.PIPELINED_SNAPSHOT off: the form before);
- with `--ab-stager`, also `sharded_async_fresh_stager`: the periodic sharded save with a new DCP stager per save
  (mgpu.state.sharded.checkpointer.REUSE_STAGER off: what a save does where CUDA is, and did everywhere before);
- with `--ab-staging`, also `sharded_async_staged_first`: the periodic sharded save with DCP's DefaultStager, which
  copies the whole state before the writer starts (mgpu.state.sharded.checkpointer.PIPELINED_STAGING off: the form
  before);
- with `--ab-digest`, also `single_digest_thread`, `sharded_digest_thread` and `sharded_async_digest_thread`: the
  saves that copy their bytes into the O_DIRECT buffers with each full buffer digested by a thread of its own, read
  back from memory (mgpu.state.files.direct_io.DIGEST_AS_COPIED off: the form before), not by the copying thread from
  the cache; into stores of their own;
- with `--ab-no-checksum`, also `single_no_checksum`, `single_async_no_checksum` and `sharded_async_no_checksum`:
  the saves with their CRC-32 replaced by a function that reads nothing (their recorded checksums are wrong: timed,
  never loaded), into stores of their own: the checksum's share of a save's time on this machine;
- with `--ab-sharded-in-place`, also `sharded_async_copied`: the periodic sharded save with its staged tensors in
  torch's memory, each copied again into the O_DIRECT file's buffers (mgpu.state.sharded.staging.IN_PLACE off: the
  form before), not written from the stager's page-aligned buffers;
- with `--ab-busy-core`, also `plain_direct_busy`: the O_DIRECT plain write with another process spinning on one
  core (no memory traffic): how much CPU beside a write slows this disk. On the CI VM it did, 1.5-2.4x: the
  "disk" is the host copying guest memory, so a save's own copy and checksum cost it more than their CPU time;
- with `--ab-writeback`, also `plain_wb` (the buffered write with its writeback started every 64 MiB), and
  `single_nowb` and `sharded_nowb`: the same saves with mgpu.state.files.writeback off (`WRITEBACK_BYTES = 0`), into
  stores of their own (that technique's share alone).
Each form's `ratio` is the mean of the two references around it over its own time (1.0 = the disk's speed),
which follows the disk's drift (other processes' writes) better than comparing the best of each column;
`ratio_best`, `ratio_median` and `ratio_min` over the repeats; `vs_buffered` and `vs_direct`: the same against
each plain write alone (median). `cpu_s`: the process's CPU seconds during the form (all threads), a figure the
disk's noise does not move. `durable_s`: the save's own time to durable as it reports it (SavedCheckpoint.seconds,
the ledger's `checkpoint_saved`): the call's time less what follows durability (pruning: renaming the previous
step away), and `ratio_durable` its ratio (best: `ratio_durable_best`); `removal_s`: the previous step's deletion,
which runs in the background after the call returns (mgpu.state.files.removal), waited for before the next reference
and form, so that no write shares the disk with it (the references' own files are unlinked outside their time too);
for a background save (`single_async`, `sharded_async`) its two parts apart: `blocked_s`, the loop blocked (the
snapshot to host memory; each repeat's: `blocked_all_s`), and `write_ratio` (best: `write_ratio_best`), the write after it, to durable, against the
disk (not for a save whose writer starts while its snapshot is still copied: `single_async`, and `sharded_async`
without CUDA; their two parts overlap);
`first_gb_s`: the first repeat's rate, the process's first save of that form (what a fresh process pays once:
imports, buffers faulted in); `request_kib`: the mean size of the write requests the device took during the form
(/sys/dev/block/M:N/stat; other processes' writes included), median. The rows `reference_buffered` and
`reference_direct` give the references themselves (their rates; the buffered one's write and fsync phases apart:
`write_s`, `fsync_s`), and the report's `why` line says which one is the disk's speed here and why the other is
slower. The disk is noisy: run it a few times and read best, median and min together.

`--profile`: the phases of one single-file save timed apart (torch.save into a null sink, the digest of N bytes,
the plain write + fsync) and a cProfile of `CheckpointStore.save`, to bench/results/write_speed_profile.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
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
from bench.disk_speed import Point, aligned_copy, dirty_settings, plain_write, reference_point  # noqa: E402
from bench.write_forms import PERIODIC, Timing, build_module, save_forms, timed  # noqa: E402

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


def profile(directory: Path, state: dict[str, Any], data: memoryview) -> None:
    import hashlib

    import torch

    from mgpu.state.single.store import CheckpointStore

    class Null(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            return len(memoryview(b))

    lines = [f"{len(data) / 1e9:.3f} GB, {os.cpu_count()} cores, load {os.getloadavg()}"]
    lines.append(f"torch.save -> null sink   {len(data) / timed(lambda: torch.save(state, Null())) / 1e9:.2f} GB/s")
    lines.append(f"sha256 of N bytes         {len(data) / timed(lambda: hashlib.sha256(data).digest()) / 1e9:.2f} GB/s")
    lines.append(f"plain write + fsync       {len(data) / sum(plain_write(directory / 'p', data)) / 1e9:.2f} GB/s")
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


def _why(points: list[Point], total: int) -> str:
    """Which reference is the disk's speed here, and why the other is slower (bench/disk_speed.py)."""
    buffered, direct = median([p.buffered_s for p in points]), [p.direct_s for p in points if p.direct_s is not None]
    write_s, fsync_s = median([p.write_s for p in points]), median([p.fsync_s for p in points])
    if not direct:
        return f"only the buffered write: the filesystem refuses O_DIRECT ({total / buffered / 1e9:.2f} GB/s)"
    direct_s = median(direct)
    faster = "O_DIRECT" if direct_s < buffered else "buffered"
    return (f"{faster} is faster here (medians: O_DIRECT {total / direct_s / 1e9:.2f} GB/s, buffered "
            f"{total / buffered / 1e9:.2f} GB/s = {write_s:.2f} s copying into the page cache + {fsync_s:.2f} s in "
            f"fsync): below the dirty-background threshold {dirty_settings()} the disk sees the buffered bytes only at "
            f"fsync, after the copy, so the buffered write is the copy's time plus the disk's; O_DIRECT is the disk's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=1024, help="MiB of tensors per save")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory here)")
    parser.add_argument("--ab-writeback", action="store_true", help="also each save form with early writeback off")
    parser.add_argument("--ab-direct", action="store_true", help="also each save form through the page cache")
    parser.add_argument("--ab-in-place", action="store_true",
                        help="also the background save with its snapshot copied into the buffers (no in-place writes)")
    parser.add_argument("--ab-huge-pages", action="store_true",
                        help="also an O_DIRECT plain write and saves from 4 KiB pages (direct_io.HUGE_PAGES off)")
    parser.add_argument("--ab-pipeline", action="store_true",
                        help="also the periodic single-file save with its snapshot copied before the write starts")
    parser.add_argument("--ab-stager", action="store_true",
                        help="also the periodic sharded save with a new DCP stager per save (REUSE_STAGER off)")
    parser.add_argument("--ab-staging", action="store_true",
                        help="also the periodic sharded save with its host copy made before the write starts "
                             "(PIPELINED_STAGING off)")
    parser.add_argument("--ab-digest", action="store_true",
                        help="also the saves that copy into the O_DIRECT buffers with each full buffer digested by a "
                             "thread of its own (DIGEST_AS_COPIED off)")
    parser.add_argument("--ab-no-checksum", action="store_true",
                        help="also the saves with a CRC-32 that reads nothing (the checksum's share)")
    parser.add_argument("--ab-sharded-in-place", action="store_true",
                        help="also the periodic sharded save with its staged tensors copied into the O_DIRECT buffers "
                             "(staging.IN_PLACE off)")
    parser.add_argument("--ab-busy-core", action="store_true",
                        help="also the O_DIRECT plain write with another process spinning on one core")
    parser.add_argument("--ab-zlib", action="store_true",
                        help="also the saves with the digest's CRC-32 by zlib's code instead of zlib-ng's")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from mgpu.state.files.removal import wait_removed

    base = args.dir or Path.cwd()
    base.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="write-speed-", dir=base))
    closers: list[Callable[[], Any]] = []
    try:
        total = args.mb << 20
        module = build_module(total)
        state = {"model": module.state_dict()}
        data = memoryview(torch.cat([p.detach().view(-1) for p in module]).numpy()).cast("B")
        if args.profile:
            profile(directory, state, data)
            return
        aligned = aligned_copy(data)
        store_file = tempfile.NamedTemporaryFile(prefix="store-", delete=False)
        dist.init_process_group("gloo", init_method=f"file://{store_file.name}", rank=0, world_size=1)
        forms = save_forms(args, directory, module, state, data, closers)
        points: list[Point] = []
        times: dict[str, list[float]] = {form: [] for form in forms}
        cpu: dict[str, list[float]] = {form: [] for form in forms}
        durable: dict[str, list[float]] = {form: [] for form in forms}
        around: dict[str, list[tuple[Point, Point]]] = {form: [] for form in forms}
        requests: dict[str, list[float]] = {form: [] for form in forms}
        removal: dict[str, list[float]] = {form: [] for form in forms}
        blocked: dict[str, list[float]] = {form: [] for form in forms}
        phased: dict[str, list[bool]] = {form: [] for form in forms}
        counters = device_writes(directory)
        points.append(reference_point(directory, data, aligned))
        for step in range(1, args.repeats + 1):
            for form, save in forms.items():
                reported: list[Timing] = []
                counted = counters() if counters else None
                seconds = timed(lambda: reported.append(save(step)), cpu[form])
                if counters and counted:
                    writes, written = (now - then for now, then in zip(counters(), counted))
                    requests[form].append(written / max(writes, 1) / 1024)
                # The previous step's deletion runs in the background after the save returns: done before the
                # next write, so that no write shares the disk with it (its own time: `removal_s`).
                removal[form].append(timed(lambda: wait_removed()))
                points.append(reference_point(directory, data, aligned))
                times[form].append(seconds)
                durable[form].append(reported[0][0])
                if reported[0][1] is not None:
                    blocked[form].append(reported[0][1])
                phased[form].append(reported[0][2])
                around[form].append((points[-2], points[-1]))
            print(f"repeat {step}: reference {total / points[-1].faster_s / 1e9:.2f} GB/s, " + ", ".join(
                f"{k} {total / v[-1] / 1e9:.2f} GB/s" for k, v in times.items()), flush=True)
        rows = [_reference_row("reference_buffered", total, [p.buffered_s for p in points],
                               write_s=median([p.write_s for p in points]), fsync_s=median([p.fsync_s for p in points])),
                _reference_row("reference_direct", total, [p.direct_s for p in points if p.direct_s is not None])]
        for form, seconds in times.items():
            def ratios(of: Callable[[Point], float | None], against: list[float]) -> list[float]:
                pairs = [(of(a), of(b), s) for (a, b), s in zip(around[form], against)]
                return [(a + b) / 2 / s for a, b, s in pairs if a is not None and b is not None]

            faster = ratios(lambda p: p.faster_s, seconds)
            writes = [whole - held for whole, held in zip(durable[form], blocked[form])] if all(phased[form]) else []
            rows.append({"form": form, "bytes": total, "best_gb_s": total / min(seconds) / 1e9,
                         "median_gb_s": total / median(seconds) / 1e9, "first_gb_s": total / seconds[0] / 1e9,
                         "ratio_best": max(faster),
                         "ratio_median": median(faster), "ratio_min": min(faster),
                         "vs_buffered": median(ratios(lambda p: p.buffered_s, seconds)),
                         "vs_direct": median(ratios(lambda p: p.direct_s, seconds) or [float("nan")]),
                         "cpu_s": median(cpu[form]), "durable_s": median(durable[form]),
                         "ratio_durable": median(ratios(lambda p: p.faster_s, durable[form])),
                         "ratio_durable_best": max(ratios(lambda p: p.faster_s, durable[form])),
                         "request_kib": round(median(requests[form]), 1) if requests[form] else None,
                         "removal_s": round(median(removal[form]), 3),
                         **(_after_snapshot(ratios(lambda p: p.faster_s, writes), blocked[form]) if writes else
                            {"blocked_s": round(median(blocked[form]), 4),
                             "blocked_all_s": [round(b, 3) for b in blocked[form]]} if blocked[form] else {}),
                         **(_against_peer(durable[form], durable["peer_snapshot"]) if form in PERIODIC else {}),
                         "all_s": [round(s, 3) for s in seconds]})
        why = _why(points, total)
        print(f"why: {why}")
        report("write_speed", rows, args.out, why=why)
    finally:
        for close in closers:
            close()
        if dist.is_initialized():
            dist.destroy_process_group()
            os.unlink(store_file.name)  # (made just before the group)
        shutil.rmtree(directory, ignore_errors=True)


def _against_peer(form: list[float], peer: list[float]) -> dict[str, float]:
    """A periodic save against the hand-written snapshot + write of the same bytes, to durable: per repeat (the two
    run one after the other), median, and best of each against best of the other (1.0: as fast as the peer)."""
    return {"vs_peer": median([p / f for f, p in zip(form, peer)]), "vs_peer_best": min(peer) / min(form)}


def _after_snapshot(ratios: list[float], blocked: list[float]) -> dict[str, Any]:
    """A background save's two parts apart: the loop blocked (the snapshot), and the write after it against the disk."""
    return {"blocked_s": round(median(blocked), 4), "blocked_all_s": [round(b, 3) for b in blocked], "write_ratio_best": max(ratios), "write_ratio": median(ratios)}


def _reference_row(form: str, total: int, seconds: list[float], **phases: float) -> dict[str, Any]:
    return {"form": form, "bytes": total, "best_gb_s": total / min(seconds) / 1e9 if seconds else None,
            "median_gb_s": total / median(seconds) / 1e9 if seconds else None,
            **{name: round(value, 3) for name, value in phases.items()}, "all_s": [round(s, 3) for s in seconds]}


if __name__ == "__main__":
    main()
