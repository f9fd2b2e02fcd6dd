"""Periodic saves that come faster than writes: the step time with them over the step time without, side by side.

    python bench/periodic_saves.py [--mb 128] [--steps 120] [--repeats 3] [--ab-direct]

One process (the single-file `Checkpointer`, rank 0 of a world of one): a stack of Linear layers with AdamW
(`--mb` of fp32 weights, about 3x that of state), `--steps` training steps timed as a whole, three ways per
repeat, alternating: `none` (no checkpoint), `deferred` (a save every N steps, as mgpu saves now: a save that comes
due while the last is being written is deferred to the first due save after the writer is free) and `blocking`
(the same saves, each first waiting for the one in flight, as mgpu did before); with `--ab-direct`, also `buffered`
(`deferred` with its files written through the page cache, mgpu.state.single.store.DIRECT_IO off: as mgpu wrote them
before, and as it still does on a filesystem that refuses O_DIRECT); with `--ab-in-place`, also `copied` (`deferred`
with the snapshot copied into the O_DIRECT writer's buffers, mgpu.state.files.direct_io.IN_PLACE_BYTES out of reach, not
written from where it is: as before); with `--ab-zlib`, also `zlib` (`deferred` with the digest's
CRC-32 computed by zlib's own code, as before, not zlib-ng's; the same values); with `--ab-plain`, also `plain` (a hand-written background writer at the
disk's speed, the peer: at each due save with its thread free, the same host copy into kept huge-page memory, then
one thread writes the tensors' bytes with O_DIRECT from where they are, fsyncs and unlinks the file before: no
torch.save, no digest, no ledger; what writing the state beside the step costs on this machine, whoever writes it).
N is chosen so that N steps take
about half a write (measured first): saves come twice as fast as the disk takes them. `--steady-malloc`: glibc
keeps the step's freed memory (see `steady_malloc`).
`saved` / `deferred`: saves written / due saves deferred (the ledger's `checkpoint_saved` counts them, `deferred`). `ratio`: the run's time / `none`'s; `ratio_less_copy`: the same less the time the saves held the loop for their
host copy (`blocked_s`, the snapshot every save must take) — the target is <= 1.05 for `deferred`; `vs_plain`:
`ratio_less_copy` over `plain`'s, per repeat (what mgpu's writer costs beyond a bare one). `step_ms_run`:
the median of the steps' own times (the saves' calls left out); `after_copy_ms`: of the steps right after a host
copy; `other_ms`: of the rest (where the step time goes with the writer busy beside it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, report  # noqa: E402


_DEFAULTS: dict[str, Any] = {}  # the settings a form changes, as they were: restored for the next form


def build(mb: int) -> tuple[Any, Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    width = 1024
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(max(1, mb * 2**20 // (4 * width * width)))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(32, width)
    return model, optimizer, batch


def step(model: Any, optimizer: Any, batch: Any) -> None:
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def run(form: str, every: int, steps: int, objects: dict[str, Any], directory: Path) -> dict[str, Any]:
    from mgpu.state.checkpointer import Checkpointer
    from mgpu.record.ledger import Ledger, read_ledger
    from mgpu.record.rundir import RunDir
    from mgpu.state.train_state import gather_state

    model, optimizer, batch = objects["model"], objects["optimizer"], objects["batch"]
    root = directory / form
    shutil.rmtree(root, ignore_errors=True)
    run_dir = RunDir(root)
    ledger_path = root / "ledger.jsonl"
    checkpointer = Checkpointer(run_dir, 0, 1, Ledger(ledger_path, "bench", 0), keep_last=1)
    plain = PlainWriter(root / "plain") if form == "plain" else None
    state = {"model": model, "optimizer": optimizer, "progress": {"step": 0}}
    from mgpu.state.single import store as checkpoint_module

    from mgpu.state.files import digest, direct_io

    checkpoint_module.DIRECT_IO = form != "buffered"
    # `copied`: the snapshot copied into the writer's buffers, not written in place (as before)
    _DEFAULTS.setdefault("in_place_bytes", direct_io.IN_PLACE_BYTES)
    direct_io.IN_PLACE_BYTES = 1 << 62 if form == "copied" else _DEFAULTS["in_place_bytes"]
    # `zlib`: the digest's CRC-32 by zlib's own code (as before), not zlib-ng's (the same values)
    _DEFAULTS.setdefault("crc32", digest.crc32)
    digest.crc32 = zlib.crc32 if form == "zlib" else _DEFAULTS["crc32"]
    blocked = 0.0
    os.sync()  # the last run's checkpoints written back first: their writeback would otherwise load this run's CPUs
    step_times: list[tuple[float, bool]] = []  # each step's own time, and whether a host copy came just before it
    copied = False
    started = time.perf_counter()
    for n in range(1, steps + 1):
        begun = time.perf_counter()
        step(model, optimizer, batch)
        step_times.append((time.perf_counter() - begun, copied))
        copied = False
        if form != "none" and n % every == 0:
            held = time.perf_counter()
            if form == "blocking" and checkpointer.store is not None:
                checkpointer.store.settle()  # as before: a save waited for the one in flight
            waited = time.perf_counter() - held
            state["progress"] = {"step": n}
            if plain is not None:
                copied = plain.offer(gather_state(state, None), n)
            else:
                deferred_before = checkpointer._deferred  # counts deferred saves; a save taken resets it
                checkpointer.save(lambda: gather_state(state, None), n, "periodic")
                copied = checkpointer._deferred != deferred_before + 1
            blocked += time.perf_counter() - held - waited
    elapsed = time.perf_counter() - started
    checkpointer.close()
    saved = [e for e in read_ledger(ledger_path) if e["event"] == "checkpoint_saved"] if ledger_path.exists() else []
    if plain is not None:
        plain.close()
    after = [t for t, c in step_times if c]
    return {"form": form, "seconds": elapsed, "blocked_s": blocked,
            "saved": plain.saved if plain is not None else len(saved),
            "deferred": plain.deferred if plain is not None else sum(e.get("deferred", 0) for e in saved),
            "step_ms": median([t for t, _ in step_times]) * 1e3,
            "after_copy_ms": median(after) * 1e3 if after else None,
            "other_ms": median([t for t, c in step_times if not c]) * 1e3}


class PlainWriter:
    """The peer of `deferred`: a bare background writer. `offer` takes a host copy and hands it to the thread
    unless the last one is still being written (then the save is skipped, as mgpu defers it); the thread writes the
    copy's bytes with O_DIRECT (page-aligned tensors from where they are, the rest packed into one aligned buffer),
    fsyncs, and unlinks the file before it."""

    def __init__(self, directory: Path) -> None:
        import threading

        self.directory, self.staging, self.thread = directory, {}, None
        self.saved, self.deferred, self.previous, self.threading = 0, 0, None, threading
        self.error: BaseException | None = None
        directory.mkdir(parents=True, exist_ok=True)

    def offer(self, state: dict[str, Any], step: int) -> bool:
        from mgpu.state.single.host_copy import snapshot_to_cpu

        if self.thread is not None and self.thread.is_alive():
            self.deferred += 1
            return False
        snapshot = snapshot_to_cpu(state, self.staging)
        self.thread = self.threading.Thread(target=self._write, args=(snapshot, step))
        self.thread.start()
        return True

    def _write(self, snapshot: Any, step: int) -> None:
        try:
            self._write_unchecked(snapshot, step)
        except BaseException as error:  # raised again by `close`: a bench that silently wrote nothing would flatter
            self.error = error

    def _write_unchecked(self, snapshot: Any, step: int) -> None:
        import torch

        from mgpu.state.files.direct_io import ALIGN, aligned_buffer

        tensors: list[Any] = []
        _collect(snapshot, tensors)
        path = self.directory / f"step_{step:08d}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            offset, rest = 0, []
            for tensor in tensors:
                data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data.cast("B") if tensor.numel() else b""
                if len(data) % ALIGN == 0 and tensor.data_ptr() % ALIGN == 0 and len(data):
                    offset += _pwrite_all(fd, memoryview(data), offset)
                elif len(data):
                    rest.append(bytes(data))
            packed = b"".join(rest)
            if packed:
                _, buffer = aligned_buffer(-(-len(packed) // ALIGN) * ALIGN)
                buffer[:len(packed)] = packed
                _pwrite_all(fd, buffer, offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        if self.previous is not None:
            self.previous.unlink()
        self.previous, self.saved = path, self.saved + 1

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error


def _collect(value: Any, into: list[Any]) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        into.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, into)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, into)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> int:
    done = 0
    while done < len(data):
        done += os.pwritev(fd, [data[done:]], offset + done)
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=128)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--ab-direct", action="store_true", help="also `buffered`: deferred, through the page cache")
    parser.add_argument("--ab-in-place", action="store_true",
                        help="also `copied`: deferred, the snapshot copied into the writer's buffers, not written in place")
    parser.add_argument("--ab-zlib", action="store_true",
                        help="also `zlib`: deferred, its digest's CRC-32 by zlib's code instead of zlib-ng's")
    parser.add_argument("--ab-plain", action="store_true",
                        help="also `plain`: the same saves written by a bare O_DIRECT background writer (the peer)")
    parser.add_argument("--no-blocking", action="store_true", help="leave out `blocking` (the slowest form)")
    parser.add_argument("--steady-malloc", action="store_true",
                        help="glibc keeps freed memory for the next step instead of faulting it in again")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch

    from mgpu.state.single.store import CheckpointStore
    from mgpu.state.train_state import gather_state

    torch.set_num_threads(1)  # the step on one core, the writer on the other (a GPU node's spare cores)
    if args.steady_malloc:
        steady_malloc()
    base = args.dir or Path.cwd()
    directory = Path(tempfile.mkdtemp(prefix="periodic-saves-", dir=base))
    try:
        model, optimizer, batch = build(args.mb)
        objects = {"model": model, "optimizer": optimizer, "batch": batch}
        for _ in range(3):
            step(model, optimizer, batch)
        step_s = median([_timed(lambda: step(model, optimizer, batch)) for _ in range(10)])
        probe = CheckpointStore(directory / "probe", keep_last=1)
        state = gather_state({"model": model, "optimizer": optimizer}, None)
        assert state is not None
        write_s = median([_timed(lambda: probe.save(state, n)) for n in range(2)])
        del state
        every = max(1, int(0.5 * write_s / step_s))
        print(f"step {step_s * 1e3:.1f} ms, write {write_s:.2f} s: a save every {every} steps", flush=True)
        forms = ["none", "deferred", *(["copied"] if args.ab_in_place else []), *(["buffered"] if args.ab_direct else []),
                 *(["zlib"] if args.ab_zlib else []),
                 *(["plain"] if args.ab_plain else []),
                 *([] if args.no_blocking else ["blocking"])]
        results: dict[str, list[dict[str, Any]]] = {form: [] for form in forms}
        for repeat in range(args.repeats):
            for form in results:
                results[form].append(run(form, every, args.steps, objects, directory))
            print(f"repeat {repeat + 1}: " + ", ".join(f"{f} {r[-1]['seconds']:.2f} s" for f, r in results.items()),
                  flush=True)
        rows = []
        for form, runs in results.items():
            ratios = [r["seconds"] / none["seconds"] for r, none in zip(runs, results["none"])]
            less = [(r["seconds"] - r["blocked_s"]) / none["seconds"] for r, none in zip(runs, results["none"])]
            plain = [(r["seconds"] - r["blocked_s"]) / (p["seconds"] - p["blocked_s"])
                     for r, p in zip(runs, results.get("plain", []))]
            rows.append({"form": form, "every": every, "step_ms": step_s * 1e3, "write_s": write_s,
                         "seconds": median([r["seconds"] for r in runs]), "blocked_s": median([r["blocked_s"] for r in runs]),
                         "saved": median([r["saved"] for r in runs]), "deferred": median([r["deferred"] for r in runs]),
                         "ratio": median(ratios), "ratio_less_copy": median(less),
                         **({"vs_plain": median(plain)} if plain else {}),
                         "step_ms_run": median([r["step_ms"] for r in runs]),
                         "after_copy_ms": median([r["after_copy_ms"] for r in runs if r["after_copy_ms"] is not None] or [0]),
                         "other_ms": median([r["other_ms"] for r in runs])})
        report("periodic_saves", rows, args.out)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def steady_malloc() -> None:
    """Keep glibc from returning the step's freed memory to the system (trimming the heap, unmapping large blocks)
    only to fault it in again at the next step, as a GPU's caching allocator keeps its blocks: on the CI machine
    the step took 5k-19k page faults and its time varied 1.5x between runs, more than the saves move it."""
    import ctypes

    libc = ctypes.CDLL(None)
    # M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD (32 MiB: glibc's largest on 64 bits; the step's tensors are 4 MiB)
    for option, value in ((-1, 2**31 - 1), (-2, 1 << 30), (-3, 32 << 20)):
        if not libc.mallopt(option, value):
            raise SystemExit(f"mallopt({option}, {value}) refused")


def _timed(action: Any) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
