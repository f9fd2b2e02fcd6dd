"""Submitting: a submission built and checked before anything is submitted (`submission`; its sweeps in `sweep`,
the task's import path checked without importing it in `task_target`, every value kept to one line of the batch
script in `script_line`), and the doctor that measures what a partition does to a job (`doctor`, `doctor_run`,
`doctor_probe`). No torch. Imports `mgpu.record` and below.
"""
