"""The single-file store: one `state.pt` per checkpoint directory, saved atomically, verified on load, pruned, and
written by an optional background writer (`store`: `CheckpointStore`, on mgpu.state.step_dirs' directory), from a host copy of the state (`host_copy`).
Imports `mgpu.state.files`, the modules of `mgpu.state` that a checkpoint's directory shares (`checkpoint_format`),
and the top-level leaves.
"""
