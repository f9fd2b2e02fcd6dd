"""One rank's life for any loop: the `Session` (process group, stop, checkpoints, the way back) and its parts
(`session_start`, `session_wrap`, `session_state`, `session_end`), its setup and teardown (`runner`), local
ranks (`spawn`), an uncaught exception recorded (`uncaught`), how it ends (`outcome`), a stop Slurm left open
(`unanswered`) and the batch script's recovery after a failed step (`recovery`). Imports `mgpu.data` and below.
"""
