"""The sharded checkpointer: every rank writes its own shard through torch.distributed.checkpoint into the same store
(`checkpointer`: `ShardedCheckpointer`) and finds the newest that verifies (`find`), the directory's layout, its
verification and the restore (`format`), DCP's filesystem that digests every file as it is written (`filesystem`),
which rank a save waits for (`arrivals`), a resume that reads its files once (`verify`), DCP's files read without
running their code (`dcp_safe`), and a sharded checkpoint read whole in one process (`export`). Imports
`mgpu.state.files`, `mgpu.state.single` (the store's pointers, pruning and settings), the modules of `mgpu.state` that
a checkpoint holds, and `mgpu.record` and below.

`from mgpu.state.sharded import ShardedCheckpointer` (the names of `checkpointer`, as when mgpu.state.sharded was that
one module) still works.
"""

from typing import Any

_CHECKPOINTER = {"KIND", "ShardedCheckpointer", "rank_file", "read_meta", "split_objects", "verify_rank"}
"""The names mgpu.state.sharded.checkpointer exports (its `__all__`): only these, so that a submodule not yet imported
(`from mgpu.state.sharded import format`) never imports the checkpointer, and torch.distributed with it."""


def __getattr__(name: str) -> Any:
    if name not in _CHECKPOINTER:
        raise AttributeError(f"module 'mgpu.state.sharded' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module("mgpu.state.sharded.checkpointer"), name)
