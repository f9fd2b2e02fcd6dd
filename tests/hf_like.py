"""A stand-in for a Hugging Face `datasets` streaming dataset (the library is not installed here and there is
no network for data): the same classes, state_dict shapes and resume behaviour as datasets 2.18-3.x's
`IterableDataset` over `ExamplesIterable`, and `shuffle(seed, buffer_size)`'s `BufferShuffledExamplesIterable`,
written from datasets' `iterable_dataset.py`:

- an `ExamplesIterable`'s state is `{"shard_idx", "shard_example_idx", "type"}`, counted as examples are
  read from the source, before they are yielded;
- `BufferShuffledExamplesIterable` draws from a buffer of `buffer_size` examples filled from its source; its
  state IS its source's state (`_init_state_dict` returns `ex_iterable._init_state_dict()`): the buffer is not
  saved, and its generator restarts from the seed on every iteration;
- `IterableDataset.state_dict()` is `{"examples_iterable": ..., "epoch": ...}` (a copy); `load_state_dict` keeps
  it for the next `__iter__`; `set_epoch` reshuffles with seed + epoch.

So a resume skips the examples that were in the buffer when the state was taken, as the library does.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset as TorchIterableDataset


class ExamplesIterable:
    """Examples from shards of `rows` each: (key, {"id": i, "x": [...]})."""

    def __init__(self, shards: list[range]) -> None:
        self.shards = shards
        self._state_dict: dict[str, Any] | None = None

    def _init_state_dict(self) -> dict[str, Any]:
        self._state_dict = {"shard_idx": 0, "shard_example_idx": 0, "type": type(self).__name__}
        return self._state_dict

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self._state_dict is not None
        self._state_dict.update(state)

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        start_shard = self._state_dict["shard_idx"] if self._state_dict else 0
        start_example = self._state_dict["shard_example_idx"] if self._state_dict else 0
        for shard_idx in range(start_shard, len(self.shards)):
            shard = self.shards[shard_idx]  # an IndexError for a state from another shard list
            for example_idx in range(start_example if shard_idx == start_shard else 0, len(shard)):
                if self._state_dict:
                    self._state_dict["shard_example_idx"] += 1
                i = shard[example_idx]
                yield f"{shard_idx}_{example_idx}", {"id": i, "x": [i / 64, i % 7 / 7, i % 3 / 3, 1.0]}
            if self._state_dict:
                self._state_dict["shard_idx"] += 1
                self._state_dict["shard_example_idx"] = 0


class BufferShuffledExamplesIterable:
    """datasets' shuffle buffer: its state is its source's; the buffer itself is not in it."""

    def __init__(self, ex_iterable: ExamplesIterable, buffer_size: int, generator: np.random.Generator) -> None:
        self.ex_iterable, self.buffer_size, self.generator = ex_iterable, buffer_size, generator

    def _init_state_dict(self) -> dict[str, Any]:
        return self.ex_iterable._init_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ex_iterable.load_state_dict(state)

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        rng = copy.deepcopy(self.generator)
        buffer: list[tuple[str, dict[str, Any]]] = []
        for example in self.ex_iterable:
            if len(buffer) == self.buffer_size:
                i = int(rng.integers(0, self.buffer_size))
                yield buffer[i]
                buffer[i] = example
            else:
                buffer.append(example)
        rng.shuffle(buffer)  # type: ignore[arg-type]
        yield from buffer


class IterableDataset(TorchIterableDataset):
    """datasets.IterableDataset's resume surface: state_dict, load_state_dict, set_epoch, shuffle."""

    def __init__(self, ex_iterable: Any, seed: int | None = None) -> None:
        self._ex_iterable, self._seed, self.epoch = ex_iterable, seed, 0
        self._starting_state_dict: dict[str, Any] | None = None
        self._state_dict = {"examples_iterable": self._ex_iterable._init_state_dict(), "epoch": 0}

    @classmethod
    def from_ids(cls, count: int, n_shards: int, rank: int = 0, world: int = 1) -> "IterableDataset":
        shards = [range(s, count, n_shards) for s in range(n_shards)][rank::world]  # split_dataset_by_node
        return cls(ExamplesIterable(shards))

    def shuffle(self, seed: int, buffer_size: int) -> "IterableDataset":
        generator = np.random.default_rng(seed)
        return IterableDataset(BufferShuffledExamplesIterable(self._ex_iterable, buffer_size, generator), seed)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._state_dict)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._starting_state_dict = state

    def _effective(self) -> Any:
        iterable = self._ex_iterable
        if isinstance(iterable, BufferShuffledExamplesIterable) and self._seed is not None:
            iterable = BufferShuffledExamplesIterable(iterable.ex_iterable, iterable.buffer_size,
                                                      np.random.default_rng(self._seed + self.epoch))
        return iterable

    def __iter__(self) -> Iterator[dict[str, Any]]:
        iterable = self._effective()
        self._state_dict = {"examples_iterable": iterable._init_state_dict(), "epoch": self.epoch}
        if self._starting_state_dict:
            iterable.load_state_dict(self._starting_state_dict["examples_iterable"])
            self._starting_state_dict = None
        for _, example in iterable:
            yield {"id": torch.tensor(example["id"]), "x": torch.tensor(example["x"])}
