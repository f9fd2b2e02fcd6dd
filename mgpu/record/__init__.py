"""The run directory and what it records: its paths and claim (`rundir`), the ledger `events.jsonl` (`ledger`) and
the records beside it (each rank's failure: `failures`; save and resume attempts: `save_record`; the resume
check's batches: `check_hooks`), what they add up to (the requeue budgets: `budgets`; nodes to avoid:
`exclusion`), and what is shown of it: status's read model (`runview`), where the time went (`goodput`), the
timeline picture, TensorBoard/wandb (`reporting`) and a loop's progress events (`loop_progress`). Imports
`mgpu.parallel` and below.
"""
