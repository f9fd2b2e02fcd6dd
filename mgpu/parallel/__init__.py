"""Ranks working as one: the process group and its collectives (`distributed`), DDP with a resumed run's buckets
(`ddp`), FSDP2 (`fsdp`), the autocast dtype (`precision`). Imports `mgpu.cluster` and below.
"""
