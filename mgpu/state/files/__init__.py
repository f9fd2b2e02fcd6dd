"""How a checkpoint file is written and checked, shared by every form (the single file, a sharded save's files, a
snapshot in memory): checksums computed while writing and a file verified against its record (`digest`), files
written past the page cache (`direct_io`), the disk's writeback started while writing where they go through it
(`writeback`), torch.save's zip writer set up for them (`zip_options`), and old checkpoints deleted off the saving
thread's path (`removal`). Imports no other part of mgpu.
"""
