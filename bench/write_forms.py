"""The save forms bench/write_speed.py times, each `step -> Timing`: mgpu's saves (the stop's and the periodic ones,
single file and sharded), their hand-written peer, and the A/B forms its `--ab-*` flags add, each with one mgpu
setting changed (`with_setting`; bench/write_speed.py's docstring says what each form is)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable

from bench.disk_speed import aligned_copy, plain_write, snapshot_write

__all__ = ["PERIODIC", "Timing", "build_module", "save_forms", "timed", "with_setting"]


def timed(action: Callable[[], Any], cpu: list[float] | None = None) -> float:
    started, cpu_started = time.perf_counter(), time.process_time()
    action()
    if cpu is not None:
        cpu.append(time.process_time() - cpu_started)
    return time.perf_counter() - started


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


Timing = tuple[float, float | None, bool]
"""A save form's (time to durable as it reports it, time until its call returned where that is earlier: the
loop's blocked time of a background save, None for a synchronous one; whether its write starts only once the call
returned, so that the two are phases apart: not where the writer starts on the snapshot while it is copied)."""


def with_setting(module: Any, name: str, value: Any, save: Callable[[int], Timing]) -> Callable[[int], Timing]:
    """`save` run with `module.name` set to `value` (restored after): a save form with one mgpu setting changed."""
    def run(step: int) -> Timing:
        kept = getattr(module, name)
        setattr(module, name, value)
        try:
            return save(step)
        finally:
            setattr(module, name, kept)
    return run


def save_forms(args: argparse.Namespace, directory: Path, module: Any, state: dict[str, Any], data: memoryview,
           closers: list[Callable[[], Any]]) -> dict[str, Callable[[int], Timing]]:
    """The save forms to time, each `step -> its own time to durable` (in this order per repeat)."""
    from mgpu.record.ledger import Ledger
    from mgpu.state.single.store import CheckpointStore
    from mgpu.state.sharded.checkpointer import ShardedCheckpointer

    ledger_path = directory / "ledger.jsonl"

    def ledger_seconds() -> float:
        return float(json.loads(ledger_path.read_text().splitlines()[-1])["seconds"])

    def single(name: str) -> Callable[[int], Timing]:
        store = CheckpointStore(directory / name, keep_last=1)
        closers.append(store.close)
        return lambda step: (store.save(state, step).seconds, None, False)

    def single_async(name: str) -> Callable[[int], Timing]:
        store = CheckpointStore(directory / name, keep_last=1)
        closers.append(store.close)

        def save(step: int) -> Timing:
            from mgpu.state.single import store as store_module

            blocked = timed(lambda: store.save_async(state, step))
            saved = store.wait()
            assert saved is not None
            return saved.seconds, blocked, not store_module.PIPELINED_SNAPSHOT
        return save

    def sharded(name: str, async_save: bool = False) -> Callable[[int], Timing]:
        saver = ShardedCheckpointer(directory / name, 0, 1, Ledger(ledger_path, "", 0), keep_last=1,
                                    async_save=async_save)
        closers.append(saver.close)

        def save(step: int) -> Timing:
            blocked = timed(lambda: saver.save_objects({"model": module}, step, "bench", wait=not async_save))
            if async_save and saver.settle() is not None:
                raise RuntimeError("the background sharded save failed")
            from mgpu.state.sharded.staging import PipelinedStager

            phased = async_save and not isinstance(saver._stager, PipelinedStager)  # a pipelined copy overlaps its write
            return ledger_seconds(), blocked if async_save else None, phased
        return save

    def peer_snapshot(name: str) -> Callable[[int], Timing]:
        snapshot = aligned_copy(data)  # kept from one save to the next, as a periodic save's snapshot buffers are

        def save(step: int) -> Timing:
            from mgpu.state.files.removal import remove_later

            path = directory / f"{name}-{step}.bin"
            whole, copy = snapshot_write(path, data, snapshot)
            remove_later(path)  # in the background, as a save's pruning is: `removal_s`, outside the form's time
            return whole, copy, False
        return save

    def plain(name: str, source: memoryview, **options: Any) -> Callable[[int], Timing]:
        def write(step: int) -> Timing:
            seconds = sum(plain_write(directory / f"{name}.bin", source, **options))
            (directory / f"{name}.bin").unlink()
            return seconds, None, False
        return write

    forms = {"single": single("single"), "single_async": single_async("single_async"), "sharded": sharded("sharded"),
             "sharded_async": sharded("sharded_async", async_save=True), "peer_snapshot": peer_snapshot("peer")}
    if args.ab_direct:
        from mgpu.state.single import store as checkpoint_module

        forms["single_buffered"] = with_setting(checkpoint_module, "DIRECT_IO", False, single("single_buffered"))
        forms["sharded_buffered"] = with_setting(checkpoint_module, "DIRECT_IO", False, sharded("sharded_buffered"))
    if args.ab_writeback:
        from mgpu.state.files import writeback

        forms["plain_wb"] = plain("plain_wb", data, writeback=True)
        forms["single_nowb"] = with_setting(writeback, "WRITEBACK_BYTES", 0, single("single_nowb"))
        forms["sharded_nowb"] = with_setting(writeback, "WRITEBACK_BYTES", 0, sharded("sharded_nowb"))
    if args.ab_in_place:
        from mgpu.state.files import direct_io

        forms["single_async_copied"] = with_setting(direct_io, "IN_PLACE_BYTES", 1 << 62,
                                                    single_async("single_async_copied"))
    if args.ab_huge_pages:
        from mgpu.state.files import direct_io

        forms["plain_direct_4k"] = plain("plain_direct_4k", aligned_copy(data, huge_pages=False), direct=True)
        forms["single_4k"] = with_setting(direct_io, "HUGE_PAGES", False, single("single_4k"))
        forms["sharded_4k"] = with_setting(direct_io, "HUGE_PAGES", False, sharded("sharded_4k"))
    if args.ab_pipeline:
        from mgpu.state.single import store as store_module

        forms["single_async_copied_first"] = with_setting(store_module, "PIPELINED_SNAPSHOT", False,
                                                          single_async("single_async_copied_first"))
    if args.ab_stager:
        from mgpu.state.sharded import checkpointer as sharded_module

        forms["sharded_async_fresh_stager"] = with_setting(sharded_module, "REUSE_STAGER", False,
                                                           sharded("sharded_async_fresh_stager", async_save=True))
    if args.ab_staging:
        from mgpu.state.sharded import checkpointer as sharded_module

        forms["sharded_async_staged_first"] = with_setting(sharded_module, "PIPELINED_STAGING", False,
                                                           sharded("sharded_async_staged_first", async_save=True))
    if args.ab_digest:
        from mgpu.state.files import direct_io

        forms["single_digest_thread"] = with_setting(direct_io, "DIGEST_AS_COPIED", False,
                                                     single("single_digest_thread"))
        forms["sharded_digest_thread"] = with_setting(direct_io, "DIGEST_AS_COPIED", False,
                                                      sharded("sharded_digest_thread"))
        forms["sharded_async_digest_thread"] = with_setting(
            direct_io, "DIGEST_AS_COPIED", False, sharded("sharded_async_digest_thread", async_save=True))
    if args.ab_no_checksum:
        from mgpu.state.files import digest

        def unread(data: Any, value: int = 0) -> int:
            return 0

        forms["single_no_checksum"] = with_setting(digest, "crc32", unread, single("single_no_checksum"))
        forms["single_async_no_checksum"] = with_setting(digest, "crc32", unread,
                                                         single_async("single_async_no_checksum"))
        forms["sharded_async_no_checksum"] = with_setting(
            digest, "crc32", unread, sharded("sharded_async_no_checksum", async_save=True))
    if args.ab_sharded_in_place:
        from mgpu.state.sharded import staging

        forms["sharded_async_copied"] = with_setting(staging, "IN_PLACE", False,
                                                     sharded("sharded_async_copied", async_save=True))
    if args.ab_busy_core:
        forms["plain_direct_busy"] = _beside_a_busy_core(plain("plain_direct_busy", aligned_copy(data), direct=True))
    if args.ab_zlib:
        import zlib

        from mgpu.state.files import digest

        forms["single_zlib"] = with_setting(digest, "crc32", zlib.crc32, single("single_zlib"))
        forms["sharded_zlib"] = with_setting(digest, "crc32", zlib.crc32, sharded("sharded_zlib"))
    return forms


def _spin(stop: Any) -> None:
    while not stop.is_set():
        sum(range(100_000))


def _beside_a_busy_core(save: Callable[[int], Timing]) -> Callable[[int], Timing]:
    """`save` run while another process keeps one core busy with arithmetic alone (no memory traffic)."""
    import multiprocessing

    def run(step: int) -> Timing:
        stop = multiprocessing.get_context("spawn").Event()
        spinner = multiprocessing.get_context("spawn").Process(target=_spin, args=(stop,), daemon=True)
        spinner.start()
        time.sleep(1.0)  # (a spawned interpreter's start: spinning before the write starts)
        try:
            return save(step)
        finally:
            stop.set()
            spinner.join()
    return run


PERIODIC = ("single_async", "sharded_async", "single_async_copied_first", "sharded_async_staged_first",
            "sharded_async_digest_thread", "single_async_no_checksum", "sharded_async_no_checksum",
            "sharded_async_copied")
"""The periodic saves, each also held against `peer_snapshot` (bench/disk_speed.snapshot_write)."""
