"""A run's state on disk and back: what a checkpoint holds (`train_state`, `rng`, `hparams`), the single-file store
(`checkpoint`) and sharded one (`sharded`, `shard_arrivals`), checksums taken while writing (`digest`,
`shard_digest`; torch's redundant zip CRC32 off for those bytes, `zip_options`), the disk's writeback started while
writing (`writeback`), snapshots in host memory (`memory_snapshot`, `memory_state`, `memory_content`, `memory_room`,
`memory_replica`), the owner of their coordination
across ranks (`checkpointer`), the save's time budget (`save_budget`), finding and loading the way back
(`resumption`), and reading a run for inference (`inference`, `sharded_export`). Imports `mgpu.record` and
below.
"""
