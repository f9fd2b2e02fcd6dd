"""mgpu's trainer on a Session: the user's `Task`, the step loop (`trainer`), what each step trains on
(`step_batches`), the training metrics between two log lines (`log_window`), evaluation, optimizer and schedule,
metrics that reduce exactly, and the whole job on one rank (`job`). Imports `mgpu.run` and below.
"""
