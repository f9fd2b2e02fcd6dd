"""Sources that cannot resume exactly, named before they cost a run: a Hugging Face `datasets` streaming dataset
(the real library, tests/hf_stream.py) shuffled through a buffer its state_dict() does not hold gets one warning
at start, and what it does across a stop (samples lost); a stream whose saved state does not fit its DataLoader
worker on a resume (the library's own with 2 workers, and a minimal one) fails in one line naming the fix, not
with a worker's IndexError. In-process, real DataLoader workers."""

from __future__ import annotations

import logging
import multiprocessing
from typing import Any, Iterator

import pytest
from torch.utils.data import IterableDataset, get_worker_info

from mgpu.data.stream import StreamError
from mgpu.data.stream_loader import StatefulStreamLoader, open_loader, shuffle_buffer
from tests.hf_stream import hf_stream


def ids(loader: StatefulStreamLoader, count: int | None = None) -> list[int]:
    seen: list[int] = []
    for n, batch in enumerate(loader):
        seen += batch["id"].tolist()
        if count is not None and n + 1 == count:
            break
    return seen


def stream(shuffled: bool) -> Any:
    return hf_stream(48, n_shards=4, buffer_size=8 if shuffled else None)


def loader(dataset: Any, workers: int = 0) -> StatefulStreamLoader:
    made = open_loader(dataset, 4, rank=0, world_size=1, num_workers=workers)
    assert isinstance(made, StatefulStreamLoader)
    return made


def test_a_shuffle_buffer_is_found_in_the_streams_chain() -> None:
    assert shuffle_buffer(stream(shuffled=True)) == ("BufferShuffledExamplesIterable", 8)
    assert shuffle_buffer(stream(shuffled=False)) is None
    assert shuffle_buffer([1, 2, 3]) is None


def test_the_loader_names_a_shuffle_buffer_at_start_with_the_fix(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mgpu.train"):
        loader(stream(shuffled=False))
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="mgpu.train"):
        loader(stream(shuffled=True))
    (record,) = caplog.records
    said = record.getMessage()
    assert "IterableDataset shuffles through a buffer of 8 samples (BufferShuffledExamplesIterable)" in said
    assert "shuffle without a buffer" in said and "mgpu.data.stream.ShardedStream" in said


@pytest.mark.parametrize("shuffled", [False, True])
def test_what_a_buffered_stream_does_across_a_stop(shuffled: bool) -> None:
    """The library's behaviour, which the warning is about: without a buffer a stop loses nothing; with one, the
    samples in the buffer at the stop never come back (the resumed epoch is short by as many)."""
    unbroken = ids(loader(stream(shuffled)))
    first = loader(stream(shuffled))
    before = ids(first, 3)
    resumed = loader(stream(shuffled))
    resumed.load_state_dict(first.state_dict())
    after = ids(resumed)
    assert sorted(unbroken) == list(range(48))
    lost = set(unbroken) - set(before + after)
    assert bool(lost) is shuffled and len(before + after) == 48 - len(lost), (sorted(lost), before, after)


def test_the_librarys_own_crash_on_a_resume_under_workers_is_one_line() -> None:
    """The buffered stream resumed under 2 DataLoader workers: the library raises an IndexError in a worker
    (datasets' per-worker shard state); the loader says it in one line with the fix."""
    first = loader(stream(shuffled=True), workers=2)
    ids(first, 3)
    resumed = loader(stream(shuffled=True), workers=2)
    resumed.load_state_dict(first.state_dict())
    try:
        with pytest.raises(StreamError) as raised:
            ids(resumed)
    finally:
        for worker in multiprocessing.active_children():  # workers that raised stay up until the process exits
            worker.kill()
            worker.join()
    said = str(raised.value)
    assert "\n" not in said and "failed on its first batch after a resume under 2 DataLoader workers (IndexError" in said, said
    assert "num_workers=0" in said and "ShardedStream" in said


class Misfit(IterableDataset):
    """Worker w of W reads shards w, w + W, ... of 7; its state's shard index is taken as is (as a source
    whose state was made for another split does): a shard beyond the worker's share is an IndexError."""

    def __init__(self) -> None:
        self.cursor = {"shard": 0, "item": 0}

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = list(range(worker, 7, workers))
        while True:
            shard = mine[self.cursor["shard"]]
            yield shard * 100 + self.cursor["item"]
            self.cursor["item"] += 1
            if self.cursor["item"] == 3:
                self.cursor = {"shard": self.cursor["shard"] + 1, "item": 0}
                if self.cursor["shard"] == len(mine):
                    return

    def state_dict(self) -> dict[str, Any]:
        return dict(self.cursor)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = dict(state)


def test_a_state_that_does_not_fit_its_worker_fails_in_one_line_with_the_fix() -> None:
    resumed = loader(Misfit(), workers=2)
    resumed.load_state_dict({"per_rank": [{"epoch": 0, "position": 2, "workers": 2, "next": 0,
                                           "states": [{"shard": 5, "item": 0}, {"shard": 5, "item": 0}]}]})
    try:
        with pytest.raises(StreamError) as raised:
            list(resumed)
    finally:
        for worker in multiprocessing.active_children():  # workers that raised stay up until the process exits
            worker.kill()  # (mgpu.data.loader's atexit reaps them), as before this change
            worker.join()
    said = str(raised.value)
    assert "\n" not in said
    assert "Misfit failed on its first batch after a resume under 2 DataLoader workers (IndexError: list index " \
           "out of range)" in said, said
    assert "num_workers=0" in said and "ShardedStream" in said
