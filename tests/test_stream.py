"""mgpu.data.stream's pure logic by tables (order, buffer, cursors, readers) and the ResumableLoader over a stream
in-process: ranks are loaders with explicit rank/world_size, workers are real DataLoader workers."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mgpu.data.sampling import ShardPlan
from mgpu.data.loader import ResumableLoader
from mgpu.data.stream import EpochOrder, JsonLines, ShardedStream, StreamError, TokenWindows


def token_shards(tmp_path: Path, sizes: list[int], dtype: str = "uint16") -> list[str]:
    """Token files whose token t of shard k is k * 10_000 + t: a window tells where it came from."""
    paths = []
    for k, size in enumerate(sizes):
        path = tmp_path / f"shard-{k:03d}.bin"
        (k * 10_000 + np.arange(size)).astype(dtype).tofile(path)
        path.with_suffix(".json").write_text(json.dumps({"dtype": dtype}))
        paths.append(str(path))
    return paths


class CountingReader:
    """Records of a known count per file; counts every read (a resume must not read skipped samples)."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts, self.reads = counts, 0

    def count(self, path: str) -> int:
        return self.counts[path]

    def read(self, path: str, index: int) -> tuple[str, int]:
        self.reads += 1
        return (path, index)


@pytest.mark.parametrize("counts, window, shuffle, lanes", [
    ([10], 1, True, 1), ([10], 4, True, 3), ([7, 0, 13, 1], 5, True, 1), ([7, 0, 13, 1], 5, True, 4),
    ([3] * 20, 7, True, 8), ([100, 50], 1000, True, 7), ([5, 6, 7], 4, False, 2), ([1], 1, True, 5),
    ([2, 3], 2, True, 50),
])
def test_an_epochs_order_holds_every_sample_once(counts: list[int], window: int, shuffle: bool, lanes: int) -> None:
    for epoch in range(3):
        order = EpochOrder(counts, seed=5, epoch=epoch, window=window, shuffle=shuffle, interleave=lanes)
        assert sorted(order[0:len(order)]) == list(range(sum(counts)))
        if not shuffle:
            assert order[0:len(order)] == list(range(sum(counts)))


def test_the_buffer_mixes_only_within_its_window_and_the_order_is_a_function_of_seed_and_epoch() -> None:
    counts, window = [40, 25, 35], 16
    order = EpochOrder(counts, seed=1, epoch=2, window=window)
    again = EpochOrder(counts, seed=1, epoch=2, window=window)
    assert order[0:100] == again[0:100]
    assert order[0:100] != EpochOrder(counts, seed=1, epoch=3, window=window)[0:100]
    assert order[0:100] != EpochOrder(counts, seed=2, epoch=2, window=window)[0:100]
    for position in range(100):
        w = position // window
        assert w * window <= order.read_position(position) < (w + 1) * window
    # Random access deep into the epoch equals walking it (the buffer is rebuilt, not replayed).
    assert [order[p] for p in (99, 3, 50, 17)] == [again[0:100][p] for p in (99, 3, 50, 17)]


def test_shards_are_read_one_after_another_in_a_permuted_order() -> None:
    counts = [10] * 8
    order = EpochOrder(counts, seed=0, epoch=0, window=10)
    shards = [order.locate(order[p])[0] for p in range(80)]
    assert [shards[i * 10] for i in range(8)] == order.shard_order
    assert all(len(set(shards[i * 10:(i + 1) * 10])) == 1 for i in range(8))
    assert order.shard_order != list(range(8))


def test_interleaved_lanes_take_turns_each_reading_its_own_stretch_in_order() -> None:
    counts = [10] * 8
    order = EpochOrder(counts, seed=0, epoch=0, window=1, interleave=4)  # window 1: the read order itself
    reads = [order.locate(order[p]) for p in range(80)]
    for lane in range(4):
        mine = reads[lane::4]  # 20 reads: two whole shards, front to back
        assert [shard for shard, _ in mine] == [order.shard_order[2 * lane]] * 10 + [order.shard_order[2 * lane + 1]] * 10
        assert [index for _, index in mine] == list(range(10)) * 2
    assert len({shard for shard, _ in reads[:4]}) == 4


@pytest.mark.parametrize("position, done", [(0, 0), (30, 3), (80, 8)])
def test_cursors_count_each_shards_consumed_samples(position: int, done: int) -> None:
    order = EpochOrder([10] * 8, seed=4, epoch=1, window=10)
    cursors = order.cursors(position)
    assert [cursors[k] for k in order.shard_order] == [10] * done + [0] * (8 - done)
    assert sum(EpochOrder([10] * 8, seed=4, epoch=1, window=10, interleave=3).cursors(37)) == 37


def exactly_once_over_resumes(plan_of: Any, num_samples: int, worlds: list[int], stops: list[int],
                              batch: int) -> Counter:
    """Walk one epoch, switching world size at each stop (in micro-batches): the ids every rank took."""
    seen: Counter = Counter()
    position = 0
    for world, stop in zip(worlds, stops + [10 ** 9]):
        plans = [plan_of(rank, world) for rank in range(world)]
        walks = [plan.micro_batches(0, position) for plan in plans]
        for _ in range(stop):
            steps = [next(w, None) for w in walks]
            if steps[0] is None:
                break
            for mb in steps:
                seen.update(mb.indices[:mb.real])
            position = steps[0].end_position
    return seen


@pytest.mark.parametrize("worlds, stops", [([4, 2, 3], [3, 5]), ([1, 8, 1], [1, 2]), ([3, 3, 3, 3], [2, 1, 4]),
                                           ([2, 5], [0])])
def test_a_streams_plan_takes_every_sample_once_across_world_size_changes(worlds: list[int],
                                                                          stops: list[int]) -> None:
    counts = [23, 7, 31, 0, 12]
    stream_order = lambda seed, epoch, shuffle: EpochOrder(counts, seed, epoch, 9, shuffle, 3)  # noqa: E731
    seen = exactly_once_over_resumes(lambda r, w: ShardPlan(sum(counts), 3, r, w, 0, True, stream_order),
                                     sum(counts), worlds, stops, 3)
    assert seen == Counter(range(sum(counts)))


def test_token_windows_read_a_shard_by_index(tmp_path: Path) -> None:
    [bin_path] = token_shards(tmp_path, [41])
    npy_path = tmp_path / "tokens.npy"
    np.save(npy_path, np.arange(41, dtype=np.int32))
    for path, base in ((bin_path, 0), (str(npy_path), 0)):
        reader = TokenWindows(block_size=8)
        assert reader.count(path) == 5  # 40 targets: 5 windows of 8 (+1)
        assert reader.read(path, 3).tolist() == list(range(base + 24, base + 33))
    with pytest.raises(StreamError, match="sidecar"):
        (tmp_path / "bare.bin").write_bytes(b"\0" * 10)
        TokenWindows(4).count(str(tmp_path / "bare.bin"))


def test_json_lines_are_found_by_offset(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"i": 0}\n\n{"i": 1}\n{"i": 2, "t": "x\\ny"}')  # an empty line, no final newline
    reader = JsonLines()
    assert reader.count(str(path)) == 3
    assert [reader.read(str(path), i)["i"] for i in (2, 0, 1)] == [2, 0, 1]
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert JsonLines().count(str(tmp_path / "empty.jsonl")) == 0


def test_a_stream_refuses_what_it_cannot_read_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(StreamError, match="no file matches"):
        ShardedStream(str(tmp_path / "*.bin"), TokenWindows(4))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(StreamError, match=r"no reader for .*x\.txt"):
        ShardedStream([tmp_path / "x.txt"], {".jsonl": JsonLines()})
    with pytest.raises(StreamError, match="not found"):
        ShardedStream([tmp_path / "missing.jsonl"], JsonLines())
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(StreamError, match="hold no sample"):
        ShardedStream([tmp_path / "e.jsonl"], JsonLines())


def _bad_inputs(d: Path) -> list[tuple[str, Any, Any, dict[str, Any], str]]:
    """(case, files, reader, keywords, expected line) for inputs numpy or Python would answer with a traceback."""
    np.arange(100, dtype=np.uint16).tofile(d / "ok.bin")
    (d / "odd.bin").write_bytes(b"\x01" * 101)
    (d / "notnpy.npy").write_bytes(b"hello world")
    np.save(d / "f32.npy", np.arange(100, dtype=np.float32))
    np.save(d / "obj.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    (d / "adir.bin").mkdir()
    (d / "side.bin").write_bytes(b"\0" * 200)
    (d / "side.json").write_text('{"dtype": "uint17"}')
    (d / "bad.jsonl").write_text('{"a": 1}\n{bad\n')
    ok = [str(d / "ok.bin")]
    return [
        ("a size not a whole number of tokens", [d / "odd.bin"], TokenWindows(4, "uint16"), {},
         "is 101 bytes, not a whole number of uint16 tokens (2 bytes each)"),
        ("not a dtype", ok, lambda: TokenWindows(4, "uint17"), {}, "'uint17' is not a numpy dtype"),
        ("a float dtype", ok, lambda: TokenWindows(4, "float16"), {}, "float16 is not an integer dtype"),
        ("not a .npy", [d / "notnpy.npy"], TokenWindows(4), {}, "notnpy.npy is not a .npy file numpy can read"),
        ("a float .npy", [d / "f32.npy"], TokenWindows(4), {}, "f32.npy: token ids are integers"),
        ("an object .npy", [d / "obj.npy"], TokenWindows(4), {}, "object is not an integer dtype"),
        ("a directory", [d / "adir.bin"], TokenWindows(4, "uint16"), {}, "adir.bin is a directory, not a file"),
        ("a sidecar's bad dtype", [d / "side.bin"], TokenWindows(4), {}, "sidecar side.json: 'uint17' is not a numpy"),
        ("a line that is not JSON", [d / "bad.jsonl"], JsonLines(), {}, "bad.jsonl, record 1 (bytes 9-13): not valid JSON"),
        ("block_size a string", ok, lambda: TokenWindows("4", "uint16"), {}, "block_size='4': give a whole number"),
        ("files None", None, TokenWindows(4, "uint16"), {}, "files are a glob or a list of paths, got None"),
        ("files an int", 5, TokenWindows(4, "uint16"), {}, "files are a glob or a list of paths, got 5"),
        ("no reader", ok, None, {}, "reader has count(path) and read(path, index)"),
        ("shuffle_buffer a string", ok, TokenWindows(4, "uint16"), {"shuffle_buffer": "10"},
         "shuffle_buffer='10': give a whole number"),
        ("interleave 0", ok, TokenWindows(4, "uint16"), {"interleave": 0}, "interleave=0: read at least one lane"),
    ]


def test_each_bad_stream_input_is_one_line_naming_it(tmp_path: Path) -> None:
    # st06/st08 of issue 46: a shard cut short and a wrong dtype gave numpy's tracebacks (ValueError, TypeError).
    for case, files, reader, keywords, expected in _bad_inputs(tmp_path):
        with pytest.raises(StreamError) as refused:
            stream = ShardedStream(files, reader() if callable(reader) else reader, **keywords)
            list(stream)  # a record that cannot be decoded is found when it is read
        line = str(refused.value)
        assert expected in line and "\n" not in line, (case, line)


def test_a_stream_over_more_shards_than_file_handles_builds_and_reads_an_epoch(tmp_path: Path) -> None:
    # Issue 46: every token shard stayed memory-mapped from the count on (a descriptor each): 1,200 shards under
    # `ulimit -n 1024` failed with EMFILE while the stream was built.
    import resource

    paths = []
    for k in range(1200):
        path = tmp_path / f"s{k:05d}.bin"
        np.full(17, k, dtype=np.uint16).tofile(path)
        paths.append(str(path))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        stream = ShardedStream(paths, TokenWindows(8, "uint16"), shuffle_buffer=100)
        loader = ResumableLoader(stream, 16, rank=0, world_size=1, seed=0)
        seen = Counter(int(window[0]) for batch in loader for window in batch)
        stream.manifest()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert seen == Counter({k: 2 for k in range(1200)})  # 17 tokens: two windows of 8 (+1) per shard


def mixed_stream(tmp_path: Path, shuffle_buffer: int = 8) -> ShardedStream:
    """Two token shards and a jsonl file: every sample becomes its id (an int) through `id_of`."""
    paths = token_shards(tmp_path, [8 * 9 + 1, 8 * 5 + 1])
    lines = tmp_path / "extra.jsonl"
    lines.write_text("".join(json.dumps({"n": n}) + "\n" for n in range(11)))
    return ShardedStream(paths + [str(lines)], {".bin": TokenWindows(8), ".jsonl": JsonLines()},
                         shuffle_buffer=shuffle_buffer)


def id_of(sample: Any) -> int:
    if isinstance(sample, dict):
        return 14 + sample["n"]
    first = int(sample[0])
    return first // 10_000 * 9 + first % 10_000 // 8


def collate_ids(samples: list[Any]) -> list[int]:
    return [id_of(s) for s in samples]


def loaders(stream: ShardedStream, world: int, workers: int) -> list[ResumableLoader]:
    return [ResumableLoader(stream, 2, rank=r, world_size=world, seed=7, num_workers=workers,
                            collate_fn=collate_ids) for r in range(world)]


def run_epochs(stream: ShardedStream, legs: list[tuple[int, int, int]], epochs: int = 2) -> dict[int, Counter]:
    """Legs of (world, workers, batches before the stop; -1: to the end): ids seen per epoch."""
    seen: dict[int, Counter] = {}
    state = None
    for world, workers, stop in legs:
        ranks = loaders(stream, world, workers)
        if state is not None:
            for loader in ranks:
                loader.load_state_dict(state)
        done = 0
        while ranks[0].epoch < epochs and (stop < 0 or done < stop):
            epoch = ranks[0].epoch
            iterators = [iter(loader) for loader in ranks]
            for batches in zip(*iterators):
                for loader, ids in zip(ranks, batches):
                    seen.setdefault(epoch, Counter()).update(ids[:loader.last.real])
                done += 1
                if done == stop:
                    break
            else:
                for it in iterators:  # finish the epoch: the generators' epoch increment
                    next(it, None)
            for it in iterators:
                it.close()
        state = ranks[0].state_dict()
        assert all(loader.state_dict() == state for loader in ranks)
    return seen


@pytest.mark.parametrize("legs", [
    [(4, 0, 3), (2, 0, 7), (3, 0, -1)],   # the 4 -> 2 -> 3
    [(2, 2, 4), (2, 0, 9), (2, 4, -1)],   # worker count 2 -> 0 -> 4 on the same world size
    [(1, 0, 1), (3, 2, 5), (2, 4, 13), (4, 0, 2), (1, 2, -1)],
])
def test_a_stream_through_the_loader_sees_every_sample_once_per_epoch_across_changes(
        tmp_path: Path, legs: list[tuple[int, int, int]]) -> None:
    stream = mixed_stream(tmp_path)
    assert stream.samples == 9 + 5 + 11
    seen = run_epochs(stream, legs)
    assert seen == {0: Counter(range(25)), 1: Counter(range(25))}


def test_a_stopped_and_resumed_stream_yields_the_unbroken_batches(tmp_path: Path) -> None:
    stream = mixed_stream(tmp_path)
    unbroken = [list(b) for b in loaders(stream, 2, 0)[1]]
    first = loaders(stream, 2, 2)[1]
    got = []
    for batch in first:
        got.append(batch)
        if len(got) == 5:
            break
    resumed = loaders(stream, 2, 0)[1]
    resumed.load_state_dict(first.state_dict())
    assert resumed.start_position == 0 and resumed.position == 5 * 4
    assert got + [list(b) for b in resumed] == unbroken
    assert resumed.start_position == 5 * 4 and resumed.epoch == 1 and resumed.position == 0


def test_a_resume_reads_no_skipped_sample(tmp_path: Path) -> None:
    counts = {f"f{k}": 1000 for k in range(50)}
    reader = CountingReader(counts)
    stream = ShardedStream(list(counts), reader, shuffle_buffer=500)
    loader = ResumableLoader(stream, 4, rank=0, world_size=2, collate_fn=list)
    loader.load_state_dict({"epoch": 0, "position": 40_000})
    first = next(iter(loader))
    assert reader.reads == 4 and len(first) == 4


def test_a_changed_set_of_files_is_refused_on_resume(tmp_path: Path) -> None:
    stream = mixed_stream(tmp_path)
    state = loaders(stream, 1, 0)[0].state_dict()
    smaller = ShardedStream(stream.files[:2], TokenWindows(8))
    with pytest.raises(StreamError, match=r"files changed since the checkpoint \(3 then, 2 now\): shard extra.jsonl "
                                          r"is missing; put back the files the run was started with"):
        loaders(smaller, 1, 0)[0].load_state_dict(state)
    old_style = {key: value for key, value in state.items() if key != "files"}  # a checkpoint before the manifest
    with pytest.raises(StreamError, match="the same files .* are needed"):
        loaders(smaller, 1, 0)[0].load_state_dict(old_style)
    with pytest.raises(StreamError, match="this run gives a map-style dataset"):
        ResumableLoader(list(range(25)), 2, rank=0, world_size=1).load_state_dict(state)  # type: ignore[arg-type]


def test_a_changed_shard_file_is_refused_on_resume_naming_it(tmp_path: Path) -> None:
    """A file's size, content (same size), sample count, place in the list, or the buffer: each would give other
    samples or another order at the saved position. A new mtime alone (a copy) is said, and accepted."""
    import os

    from mgpu.data.stream import StreamFiles

    stream = mixed_stream(tmp_path)
    saved = StreamFiles(stream).state_dict()
    state = loaders(stream, 1, 0)[0].state_dict()
    first = Path(stream.files[0])
    original = first.read_bytes()

    def reopened(shuffle_buffer: int = 8, files: list[str] = stream.files) -> ShardedStream:
        return ShardedStream(files, {".bin": TokenWindows(8), ".jsonl": JsonLines()}, shuffle_buffer=shuffle_buffer)

    def refused(match: str, stream: ShardedStream) -> None:
        with pytest.raises(StreamError, match=match):
            StreamFiles(stream).load_state_dict(saved)  # the trainer's checkpoint entry
        with pytest.raises(StreamError, match=match):
            loaders(stream, 1, 0)[0].load_state_dict(state)  # a loop's loader

    first.write_bytes(original + b"\0\0")  # one token more: the same windows, another file
    refused(r"shard .*shard-000.bin changed since the checkpoint: its size in bytes \(146 -> 148\); put back", reopened())
    first.write_bytes(original[:-2] + b"\1\1")  # re-tokenized to the same size
    refused(r"shard .*shard-000.bin changed .*: its content \(same size, other bytes\)", reopened())
    first.write_bytes(original[:-18])  # one window fewer (the size is told first)
    refused(r"shard-000.bin changed .*: its size in bytes \(146 -> 128\)", reopened())
    first.write_bytes(original)
    refused(r"shard shard-000.bin is now number 1 \(was 0\)", reopened(files=[stream.files[1], stream.files[0],
                                                                               stream.files[2]]))
    refused(r"shuffle_buffer was 8 at the checkpoint, it is 4: .*resume with shuffle_buffer=8", reopened(4))
    os.utime(first, ns=(1, 1))  # a copy: another mtime, the same bytes
    told: list[str] = []
    StreamFiles(reopened(), told.append).load_state_dict(saved)
    assert len(told) == 1 and "shard-000.bin has another modification time" in told[0]
    resumed = loaders(reopened(), 1, 0)[0]
    resumed.load_state_dict(state)
    assert resumed.position == state["position"]


def test_the_trainer_refuses_a_resume_on_changed_shard_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task's ShardedStream: its files' manifest is in the trainer's checkpoint, checked on resume (in process,
    a world of one; tests.tasks.TokenShardTask)."""
    from mgpu.config.loading import load_config
    from mgpu.cluster.environment import detect_environment
    from mgpu.train.job import run_training

    for name in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # torch's own side effect
    files = token_shards(tmp_path, [8 * 9 + 1, 8 * 5 + 1])
    cfg = load_config(None, ["task.target=tests.tasks:TokenShardTask", f"task.args.files={tmp_path}/*.bin",
                             "data.batch_size=2", "train.epochs=2", "log.tensorboard=false", "eval.every_steps=0",
                             f"run.dir={tmp_path / 'run'}"])
    monkeypatch.setenv("MGPU_STOP_AT_STEP", "2")
    stopped, _ = run_training(cfg, env=detect_environment({}))
    assert stopped.status == "stopped" and stopped.step == 2
    monkeypatch.delenv("MGPU_STOP_AT_STEP")
    Path(files[1]).write_bytes(Path(files[1]).read_bytes()[:-16])  # a shard rewritten one window shorter
    with pytest.raises(StreamError, match=r"shard .*shard-001.bin changed since the checkpoint: its size in bytes "
                                          r"\(82 -> 66\); put back the files"):
        run_training(cfg, env=detect_environment({}))


@pytest.mark.parametrize("world, batch, drop_last, stop", [(2, 3, False, 2), (3, 2, True, 1), (1, 4, False, 0)])
def test_the_loader_says_where_a_resumed_run_starts_so_an_epoch_mean_is_right(
        world: int, batch: int, drop_last: bool, stop: int) -> None:
    """Issue 22 item 5: a loop that averages over what it saw divides by position - start_position."""
    data = [float(i) for i in range(25)]
    make = lambda: ResumableLoader(data, batch, rank=0, world_size=world, drop_last=drop_last,  # noqa: E731
                                   collate_fn=torch.tensor)  # type: ignore[arg-type]
    first = make()
    for index, _ in enumerate(first):
        if index + 1 == stop:
            break
    resumed = make()
    resumed.load_state_dict(first.state_dict() if stop else {"epoch": 0, "position": 0})
    start = resumed.position
    assert start == min(stop * world * batch, resumed.samples_per_epoch)
    rank_samples = 0
    iterator = iter(resumed)
    batch0 = next(iterator)
    assert resumed.start_position == start  # known from the first batch on
    rank_samples += resumed.last.real
    for _ in iterator:
        rank_samples += resumed.last.real
    assert resumed.start_position == start
    assert resumed.samples_per_epoch == 25 - (25 % (world * batch) if drop_last else 0)
    del batch0
    # All ranks' real samples of this run = the epoch's samples minus those before the resume.
    total = 0
    for rank in range(world):
        other = ResumableLoader(data, batch, rank=rank, world_size=world, drop_last=drop_last,  # type: ignore[arg-type]
                                collate_fn=torch.tensor)
        other.load_state_dict({"epoch": 0, "position": start})
        for _ in other:
            total += other.last.real
    assert total == resumed.samples_per_epoch - start


def test_the_stream_iterates_as_a_plain_iterable_dataset_with_workers(tmp_path: Path) -> None:
    stream = mixed_stream(tmp_path)
    plain = [id_of(s) for s in stream]
    assert sorted(plain) == list(range(25))
    with_workers = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2)
    assert sorted(id_of(s) for s in with_workers) == list(range(25))
    stream.set_epoch(1)
    assert [id_of(s) for s in stream] != plain


def test_random_resume_points_table() -> None:
    """Many seeded stop points on many world sizes, pure plan level (fast): exactly once each time."""
    rng = random.Random(25)
    for _ in range(40):
        counts = [rng.randrange(0, 30) for _ in range(rng.randrange(1, 9))]
        if not sum(counts):
            continue
        window, lanes = rng.randrange(1, 40), rng.randrange(1, 6)
        worlds = [rng.randrange(1, 6) for _ in range(rng.randrange(1, 5))]
        stops = [rng.randrange(0, 6) for _ in worlds[1:]]
        batch = rng.randrange(1, 5)
        order = lambda seed, epoch, shuffle, c=counts, w=window, k=lanes: EpochOrder(c, seed, epoch, w, shuffle, k)  # noqa: E731
        seen = exactly_once_over_resumes(lambda r, w: ShardPlan(sum(counts), batch, r, w, 3, True, order),
                                         sum(counts), worlds, stops, batch)
        assert seen == Counter(range(sum(counts))), (counts, window, worlds, stops, batch)


def test_a_slice_of_the_order_equals_its_positions_one_by_one() -> None:
    """The loader asks for a batch's ids as a slice (computed in numpy); it must be the scalar path's."""
    rng = random.Random(7)
    for _ in range(200):  # short slices (a batch: scalar path) and long ones (numpy), both
        counts = [rng.randrange(0, rng.choice([30, 300])) for _ in range(rng.randrange(1, 9))]
        if not sum(counts):
            continue
        order = EpochOrder(counts, rng.randrange(5), rng.randrange(3), rng.randrange(1, 40), rng.random() < 0.8,
                           rng.randrange(1, 6))
        begin = rng.randrange(len(order))
        end = rng.randrange(begin, len(order) + 1)
        assert order[begin:end] == [order[p] for p in range(begin, end)], (counts, begin, end)
