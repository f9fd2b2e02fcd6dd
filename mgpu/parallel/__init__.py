"""Ranks working as one: the process group and its collectives (`distributed`), DDP with a resumed run's buckets
(`ddp`), FSDP2 (`fsdp`), the autocast dtype (`precision`), gloo's worker
threads done before the interpreter finalizes (`gloo_threads`). Imports `mgpu.cluster` and below.
"""
