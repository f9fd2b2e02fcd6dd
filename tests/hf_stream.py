"""Hugging Face `datasets` streaming datasets as users build them (the real library, the test extra installs it):
`count` examples {"id": i, "x": 4 features} in `n_shards` shards, split by rank with
`datasets.distributed.split_dataset_by_node`, optionally shuffled through `shuffle(seed, buffer_size)`, whose
buffer its `state_dict()` does not hold. Made in memory: nothing is downloaded."""

from __future__ import annotations

from typing import Any


def hf_stream(count: int, n_shards: int, rank: int = 0, world: int = 1, buffer_size: int | None = None,
              seed: int = 0) -> Any:
    import datasets
    from datasets.distributed import split_dataset_by_node

    rows = {"id": list(range(count)), "x": [[i / count, i % 7 / 7, i % 3 / 3, 1.0] for i in range(count)]}
    stream = datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=n_shards)
    if world > 1:
        stream = split_dataset_by_node(stream, rank=rank, world_size=world)
    if buffer_size is not None:
        stream = stream.shuffle(seed=seed, buffer_size=buffer_size)
    return stream.with_format("torch")
