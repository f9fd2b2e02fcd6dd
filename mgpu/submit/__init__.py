"""Submitting: a submission built and checked before anything is submitted (`submission`), and the doctor that
measures what a partition does to a job (`doctor`, `doctor_run`, `doctor_probe`). No torch. Imports
`mgpu.record` and below.
"""
