"""A run's state on disk and back: one folder per form of a checkpoint, around what every form shares.

Here: what a checkpoint holds (`train_state`, `rng`, `hparams`), one checkpoint directory's layout, shared by both
formats (`checkpoint_format`), a run's `checkpoints/` of step directories with its pointers, pruning and newest valid
checkpoint, also shared (`step_dirs`), whether a resume could load a state (`loadable`), the save's and the resume's time
budget (`save_budget`), and the way back, above the forms: the coordination across ranks that picks the form
(`checkpointer`), finding and loading the way back (`resumption`) and a run's weights for inference (`inference`).

- `files/`: how a checkpoint file is written and checked, for every form (checksums while writing, O_DIRECT,
  early writeback, torch.save's zip writer).
- `single/`: the single-file store (`CheckpointStore`, its background writer and host copy).
- `sharded/`: the sharded checkpointer (every rank its shard through torch.distributed.checkpoint).
- `memory/`: snapshots in node memory and their replicas on another node.

Imports `mgpu.record` and below. Inside, nothing imports up: `files` imports no other part of `mgpu.state`; the
modules here that a checkpoint holds import only `files` (and each other); `single`, `sharded` and `memory` import
those, `files` and `single`, never each other otherwise; `checkpointer`, `resumption` and `inference` import any.
"""
