"""A sharded stream of files that resumes at the exact sample, on any number of ranks and workers.

    stream = ShardedStream(["data/train-000.bin", "data/train-001.bin", ...], TokenWindows(block_size=128))
    loader = session.loader(stream, batch_size=16, num_workers=2)      # or a Task's train_dataset()

The design (why world-size and worker-count changes stay exact): every sample has a fixed *id*, its
place in the canonical concatenation of the files (shard k, record o -> base[k] + o). Each epoch has
one *order* of those ids that depends on (seed, epoch) only, never on ranks or workers:

1. the shards are permuted by (seed, epoch) and concatenated; `interleave` lanes read that sequence at once,
   each through its own contiguous stretch (a few shards), taking turns: nearby reads come from far apart;
2. a shuffle buffer of `shuffle_buffer` samples: the read sequence is cut into windows of that size and
   each window is permuted by (seed, epoch, window). The buffer's contents at any point are therefore a
   function of (seed, epoch, position): a resume rebuilds it by reading only the current window, and
   nothing in it is lost or repeated.

Training consumes the order front to back exactly as a map-style epoch (mgpu.data.sampling.ShardPlan): one
global micro-batch per step, rank r takes the r-th slice, DataLoader workers take whole batches in turn.
The only cursor is the global position in samples; each shard's cursor follows from it (`cursors`).
So a run stopped at position p resumes at p on any world size and worker count, every sample exactly
once per epoch, and a resume reads no skipped sample: a record is found by its index in its file
(fixed-size token windows: arithmetic; jsonl: an index of line offsets built when the stream opens).

What it costs: the files' sample counts are needed up front (a stat per token file, one scan per jsonl
file), and all ranks read the same window of the same shard(s) at a time (one window's worth of
locality, not one shard per reader). A source that cannot seek (a remote tar stream, a Hugging Face
streaming dataset) is not this: give it the state_dict()/load_state_dict() protocol instead (see
mgpu.data.stream_loader).
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from mgpu.data.shard_readers import JsonLines, ShardReader, StreamError, TokenWindows, unreadable
from mgpu.state.rng import stream_seed

__all__ = ["EpochOrder", "JsonLines", "ShardReader", "ShardedStream", "StreamError", "StreamFiles", "TokenWindows",
           "check_files"]


class EpochOrder(Sequence[int]):
    """The sample ids of one epoch in training order (see the module's docstring); O(1) per position, a
    window's permutation computed on first use (the last two kept)."""

    def __init__(self, counts: Sequence[int], seed: int, epoch: int, window: int, shuffle: bool = True,
                 interleave: int = 1) -> None:
        if window < 1:
            raise StreamError(f"shuffle_buffer={window}: it holds at least one sample")
        if interleave < 1:
            raise StreamError(f"interleave={interleave}: read at least one lane")
        self.seed, self.epoch, self.window, self.shuffle = seed, epoch, window if shuffle else 1, shuffle
        self.lanes = interleave if shuffle else 1
        self.bases = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
        if shuffle:
            generator = torch.Generator().manual_seed(stream_seed("shards", seed, epoch))
            self.shard_order = torch.randperm(len(counts), generator=generator).tolist()
        else:
            self.shard_order = list(range(len(counts)))
        self.starts = np.concatenate([[0], np.cumsum([counts[k] for k in self.shard_order], dtype=np.int64)]).tolist()
        self.total = int(self.bases[-1])
        self.lane_length, self.longer_lanes = divmod(self.total, self.lanes)
        self._windows: dict[int, np.ndarray] = {}
        self._starts = np.asarray(self.starts, np.int64)
        self._order_bases = np.asarray(self.bases, np.int64)[self.shard_order]  # each read shard's first id

    def __len__(self) -> int:
        return self.total

    def _permutation(self, w: int) -> np.ndarray:
        perm = self._windows.get(w)
        if perm is None:
            size = min(self.window, self.total - w * self.window)
            generator = torch.Generator().manual_seed(stream_seed("window", self.seed, self.epoch, w))
            perm = torch.randperm(size, generator=generator).numpy()
            if len(self._windows) >= 2:
                self._windows.pop(next(iter(self._windows)))
            self._windows[w] = perm
        return perm

    def read_position(self, position: int) -> int:
        """Where in the shards' read sequence the sample at training `position` lies (the buffer's doing)."""
        if not self.shuffle:
            return position
        w, within = divmod(position, self.window)
        return w * self.window + int(self._permutation(w)[within])

    def sequence_position(self, q: int) -> int:
        """Where read `q` lies in the shards' concatenation: `lanes` readers, each through a contiguous
        stretch (lengths differing by at most one), taken in turn, so a window mixes `lanes` places."""
        rounds = self.lanes * self.lane_length
        lane, index = (q % self.lanes, q // self.lanes) if q < rounds else (q - rounds, self.lane_length)
        return lane * self.lane_length + min(lane, self.longer_lanes) + index

    def id_at_read(self, q: int) -> int:
        q = self.sequence_position(q)
        k = bisect.bisect_right(self.starts, q) - 1
        return int(self.bases[self.shard_order[k]] + q - self.starts[k])

    def __getitem__(self, position: Any) -> Any:
        if isinstance(position, slice):
            return self._ids(range(*position.indices(self.total)))
        if not 0 <= position < self.total:
            raise IndexError(f"position {position} outside an epoch of {self.total} samples")
        return self.id_at_read(self.read_position(position))

    def _ids(self, positions: range) -> list[int]:
        """`[self[p] for p in positions]` (the loader asks for a batch's ids as a slice); in numpy when long."""
        if len(positions) < 256:  # a batch: numpy's per-call overhead costs more than it saves
            return [self.id_at_read(self.read_position(p)) for p in positions]
        p = np.arange(positions.start, positions.stop, positions.step, dtype=np.int64)
        if self.shuffle:
            w, within = np.divmod(p, self.window)
            q = w * self.window
            for window in np.unique(w).tolist():
                chosen = w == window
                q[chosen] += self._permutation(window)[within[chosen]]
        else:
            q = p
        rounds = self.lanes * self.lane_length
        lane = np.where(q < rounds, q % self.lanes, q - rounds)
        index = np.where(q < rounds, q // self.lanes, self.lane_length)
        q = lane * self.lane_length + np.minimum(lane, self.longer_lanes) + index
        k = np.searchsorted(self._starts, q, side="right") - 1
        return (self._order_bases[k] + q - self._starts[k]).tolist()

    def cursors(self, position: int) -> list[int]:
        """Per shard (canonical order): how many of its samples are consumed once `position` samples are
        (a report: the position alone is what a resume needs). O(position)."""
        consumed = [0] * len(self.shard_order)
        for p in range(position):
            consumed[self.locate(self[p])[0]] += 1
        return consumed

    def locate(self, sample_id: int) -> tuple[int, int]:
        """(shard, record) of a sample id."""
        shard = bisect.bisect_right(self.bases, sample_id) - 1
        return shard, sample_id - int(self.bases[shard])


def _expand(files: str | Sequence[str | Path]) -> list[str]:
    if isinstance(files, (str, Path)):
        found = sorted(glob.glob(str(files)))
        if not found:
            raise StreamError(f"no file matches {str(files)!r}")
        return found
    if not isinstance(files, Sequence) or any(not isinstance(f, (str, Path)) for f in files):
        raise StreamError(f"a ShardedStream's files are a glob or a list of paths, got {_shown(files)}")
    return [str(f) for f in files]


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _whole(name: str, value: Any, least: int) -> int:
    """`value` as an int of at least `least`; StreamError naming the argument otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise StreamError(f"{name}={_shown(value)}: give a whole number")
    if value < least:
        what = {"shuffle_buffer": "it holds at least one sample", "interleave": "read at least one lane"}
        raise StreamError(f"{name}={value}: {what.get(name, f'at least {least}')}")
    return int(value)


class ShardedStream(IterableDataset):
    """Samples from a list of files (a glob or a list, in that order), read by `reader` (one ShardReader
    for all, or a mapping from file suffix such as ".jsonl" to its reader); `shuffle_buffer` samples mixed at
    a time, from `interleave` places in the epoch's shard sequence (see the module's docstring). No __len__: mgpu's loaders ask
    `samples` and read by id; iterating it directly (a plain DataLoader) yields epoch `set_epoch()`'s order,
    positions dealt to workers in turn."""

    def __init__(self, files: str | Sequence[str | Path], reader: ShardReader | Mapping[str, ShardReader], *,
                 shuffle_buffer: int = 10_000, interleave: int = 8, seed: int = 0) -> None:
        self.files = _expand(files)
        if not self.files:
            raise StreamError("a ShardedStream needs at least one file")
        shuffle_buffer, interleave = _whole("shuffle_buffer", shuffle_buffer, 1), _whole("interleave", interleave, 1)
        seed = _whole("seed", seed, 0)
        self.readers = [self._reader_for(path, reader) for path in self.files]
        counts = []
        for path, shard_reader in zip(self.files, self.readers):
            try:
                counts.append(int(shard_reader.count(path)))
            except OSError as error:  # a reader of one's own that lets the system's error through
                raise unreadable(path, error) from None
        self.counts: list[int] = counts
        if not sum(counts):
            raise StreamError(f"the {len(self.files)} shard(s) hold no sample (first: {self.files[0]})")
        self.shuffle_buffer, self.interleave, self.seed, self.epoch = shuffle_buffer, interleave, seed, 0
        self.bases = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
        self._manifest: dict[str, Any] | None = None

    @staticmethod
    def _reader_for(path: str, reader: ShardReader | Mapping[str, ShardReader]) -> ShardReader:
        if not isinstance(reader, Mapping):
            if not (callable(getattr(reader, "count", None)) and callable(getattr(reader, "read", None))):
                raise StreamError(f"a ShardedStream's reader has count(path) and read(path, index) (TokenWindows, "
                                  f"JsonLines, or a mapping from suffix to one), got {_shown(reader)}")
            return reader
        for suffix, found in reader.items():
            if path.endswith(suffix):
                return ShardedStream._reader_for(path, found)
        raise StreamError(f"no reader for {path}: readers are given for {sorted(reader)}")

    @property
    def samples(self) -> int:
        """Samples in one epoch (all shards)."""
        return int(self.bases[-1])

    def fingerprint(self) -> str:
        """The files and their sample counts, in order: a resume refuses a stream that changed."""
        text = json.dumps([[[Path(f).name, c] for f, c in zip(self.files, self.counts)], self.shuffle_buffer,
                           self.interleave])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def manifest(self) -> dict[str, Any]:
        """What a checkpoint keeps of the files (see `check_files`): per file its name, sample count, size, mtime
        and a digest of its first and last 4 KiB; and the buffer and lanes. Taken once per process: the files
        this run read."""
        if self._manifest is None:
            self._manifest = {"files": [_file_record(path, count) for path, count in zip(self.files, self.counts)],
                              "shuffle_buffer": self.shuffle_buffer, "interleave": self.interleave}
        return self._manifest

    def order(self, seed: int, epoch: int, shuffle: bool = True) -> EpochOrder:
        return EpochOrder(self.counts, seed, epoch, self.shuffle_buffer, shuffle, self.interleave)

    def read(self, sample_id: int) -> Any:
        shard = bisect.bisect_right(self.bases, sample_id) - 1
        return self.readers[shard].read(self.files[shard], sample_id - int(self.bases[shard]))

    def by_id(self) -> "SamplesById":
        return SamplesById(self)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        order = self.order(self.seed, self.epoch)
        for position in range(worker, len(order), workers):
            yield self.read(order[position])


_EDGE = 4096  # bytes hashed at each end of a file: a rewrite of the same size is caught without reading it all


def _file_record(path: str, count: int) -> dict[str, Any]:
    stat = Path(path).stat()
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        digest.update(handle.read(_EDGE))
        if stat.st_size > _EDGE:
            handle.seek(max(stat.st_size - _EDGE, _EDGE))
            digest.update(handle.read(_EDGE))
    return {"name": Path(path).name, "samples": count, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "digest": digest.hexdigest()[:16]}


def check_files(saved: Mapping[str, Any], stream: ShardedStream, warn: Callable[[str], None] | None = None) -> None:
    """StreamError in one line, naming the file, when `stream` is not the checkpoint's (`saved`, its manifest): a
    file missing, added or moved, its size, sample count or sampled content changed, another buffer or lane count;
    each would silently give another order or other samples at the saved position. A file whose mtime alone
    changed (a copy: the same size and sampled content) is told to `warn` and accepted."""
    fix = "put back the files the run was started with, or train on these as a new run (a new run.dir; " \
          "Session.load(fresh=True))"
    now = stream.manifest()
    before, after = [f["name"] for f in saved["files"]], [f["name"] for f in now["files"]]
    if before != after:
        gone = [name for name in before if name not in after]
        new = [name for name in after if name not in before]
        what = f"shard {gone[0]} is missing" if gone else f"shard {new[0]} is new" if new else next(
            f"shard {b} is now number {after.index(b)} (was {i})" for i, (b, a) in enumerate(zip(before, after))
            if a != b)
        raise StreamError(f"the stream's files changed since the checkpoint ({len(before)} then, {len(after)} now): "
                          f"{what}; {fix}")
    for old, new_file, path in zip(saved["files"], now["files"], stream.files):
        for key, what in (("bytes", "size in bytes"), ("samples", "sample count"), ("digest", "content")):
            if old[key] != new_file[key]:
                change = f" ({old[key]} -> {new_file[key]})" if key != "digest" else " (same size, other bytes)"
                raise StreamError(f"shard {path} changed since the checkpoint: its {what}{change}; {fix}")
        if old["mtime_ns"] != new_file["mtime_ns"] and warn is not None:
            warn(f"shard {path} has another modification time than at the checkpoint, with the same size and "
                 "sampled content: taken as a copy of the same file")
    for key in ("shuffle_buffer", "interleave"):
        if saved[key] != now[key]:
            raise StreamError(f"the stream's {key} was {saved[key]} at the checkpoint, it is {now[key]}: another "
                              f"order of the same samples from here; resume with {key}={saved[key]}, or {fix}")


class StreamFiles:
    """A trainer's checkpoint entry for a ShardedStream task dataset: the files' manifest, checked on resume."""

    def __init__(self, stream: ShardedStream, warn: Callable[[str], None] | None = None) -> None:
        self.stream, self.warn = stream, warn

    def state_dict(self) -> dict[str, Any]:
        return self.stream.manifest()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_files(state, self.stream, self.warn)


class SamplesById(Dataset):
    """A stream as a map-style dataset over its sample ids (what mgpu's batch plans index)."""

    def __init__(self, stream: ShardedStream) -> None:
        self.stream = stream

    def __len__(self) -> int:
        return self.stream.samples

    def __getitem__(self, sample_id: int) -> Any:
        if not 0 <= sample_id < self.stream.samples:
            raise IndexError(sample_id)
        return self.stream.read(int(sample_id))
