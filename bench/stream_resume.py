"""The stream's resume and step costs, side by side in one process (mgpu.data.stream.ShardedStream vs map-style).

    python bench/stream_resume.py                         # 16 token shards, 3.2M windows, 2 ranks' share
    python bench/stream_resume.py --shards 16 --windows 200000 --repeats 5 --workers 0

Resume time: from a fresh loader's load_state_dict() at position p to its first batch, at the start of an
epoch, in its middle and near its end; the target is that it does not grow with the position (a resume
reads no skipped window: a window is found by its index in its shard) and stays under 1 s. Step time: the
median time per batch of the stream's loader against a ResumableLoader over one map-style token file that
holds the same windows (a global permutation per epoch), alternated R times; the figure is the ratio.
Rank 0 of `--world` ranks is measured (a rank's share of each global batch).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, report  # noqa: E402
from mgpu.data.loader import ResumableLoader  # noqa: E402
from mgpu.data.stream import ShardedStream, TokenWindows  # noqa: E402

BLOCK = 16


class MapWindows:
    """The same windows from one file, map-style (what jobs/tasks/gpt.py's TokenWindows does)."""

    def __init__(self, path: str, count: int) -> None:
        self.path, self.count, self.tokens = path, count, None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.tokens is None:
            self.tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        start = index * BLOCK
        return torch.from_numpy(self.tokens[start:start + BLOCK + 1].astype(np.int64))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "tokens": None}


def make_data(root: Path, shards: int, windows: int) -> tuple[list[str], str]:
    rng = np.random.default_rng(0)
    paths, pieces = [], []
    for k in range(shards):
        tokens = rng.integers(0, 256, windows * BLOCK + 1, dtype=np.uint16)
        path = root / f"shard-{k:03d}.bin"
        tokens.tofile(path)
        paths.append(str(path))
        pieces.append(tokens[:-1])
    whole = root / "whole.bin"
    np.concatenate(pieces + [np.zeros(1, np.uint16)]).tofile(whole)
    return paths, str(whole)


def first_batch_s(make: object, position: int) -> float:
    begin = time.perf_counter()
    loader = make()  # type: ignore[operator]
    loader.load_state_dict({**loader.state_dict(), "position": position})
    next(iter(loader))
    return time.perf_counter() - begin


def per_batch_s(loader: ResumableLoader, batches: int) -> float:
    iterator = iter(loader)
    next(iterator)  # workers started
    begin = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return (time.perf_counter() - begin) / batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--windows", type=int, default=200_000, help="per shard")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--shuffle-buffer", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths, whole = make_data(Path(tmp), args.shards, args.windows)
        total = args.shards * args.windows
        options = dict(rank=0, world_size=args.world, num_workers=args.workers, collate_fn=list)

        def stream_loader() -> ResumableLoader:
            stream = ShardedStream(paths, TokenWindows(BLOCK, "uint16"), shuffle_buffer=args.shuffle_buffer)
            return ResumableLoader(stream, args.batch_size, **options)  # type: ignore[arg-type]

        def map_loader() -> ResumableLoader:
            return ResumableLoader(MapWindows(whole, total), args.batch_size, **options)  # type: ignore[arg-type]

        rows = []
        global_batch = args.batch_size * args.world
        for name, position in (("start", 0), ("middle", total // 2 // global_batch * global_batch),
                               ("near end", (total - 10 * global_batch) // global_batch * global_batch)):
            stream_s = [first_batch_s(stream_loader, position) for _ in range(args.repeats)]
            map_s = [first_batch_s(map_loader, position) for _ in range(args.repeats)]
            rows.append({"what": f"resume at {name} (first batch)", "position": position,
                         "stream_s": median(stream_s), "map_style_s": median(map_s),
                         "ratio": median(stream_s) / median(map_s)})
        stream_steps, map_steps = [], []
        for repeat in range(args.repeats):
            pair = [(stream_steps, stream_loader), (map_steps, map_loader)]
            for out, make in pair if repeat % 2 == 0 else pair[::-1]:
                out.append(per_batch_s(make(), args.batches))
        rows.append({"what": f"time per batch ({args.batches} batches)", "position": 0,
                     "stream_s": median(stream_steps), "map_style_s": median(map_steps),
                     "ratio": median(stream_steps) / median(map_steps)})
        report(f"stream_resume_workers{args.workers}", rows)


if __name__ == "__main__":
    main()
