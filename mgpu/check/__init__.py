"""The resume check, `python -m mgpu.check.resume`: a loop or a config run unbroken, stopped and resumed, during a
save, on half the ranks (`resume`, `plan`, `runs`), and the first saved value or batch that differs named by its
path (`state_diff`, `batch_diff`). Imports anything below it; nothing imports it.
"""
