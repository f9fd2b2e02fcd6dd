"""Is the Slurm job named in this process's environment really this process's job? No torch.

`SLURM_JOB_ID` travels with an environment: into a shell on a compute node, an `ssh`, a copied
`env` file, a tool started from another job. Asking Slurm about (or requeueing) a job on the word of
such a variable would act on somebody else's job. slurmstepd starts every task (and the batch script)
with `SLURM_TASK_PID` set to that task's own PID, so the variables are this process's when that PID
is this process or one of its ancestors (torchrun's workers are children of the srun task), or when
a `slurmstepd` is an ancestor (a task whose PID namespace hides the PID Slurm saw).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Mapping

__all__ = ["ancestors", "owns_slurm_job"]

ProcReader = Callable[[int], tuple[int, str] | None]
"""pid -> (parent pid, command name), or None when there is no such process."""


def _read_proc(pid: int) -> tuple[int, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    head, _, tail = stat.rpartition(")")
    return int(tail.split()[1]), head.partition("(")[2]


def ancestors(pid: int, read: ProcReader = _read_proc, limit: int = 64) -> list[tuple[int, str]]:
    """(pid, command) of `pid` and each of its parents up to init; bounded against cycles."""
    chain: list[tuple[int, str]] = []
    while pid > 0 and len(chain) < limit:
        found = read(pid)
        if found is None:
            break
        parent, comm = found
        chain.append((pid, comm))
        if parent == pid:
            break
        pid = parent
    return chain


def owns_slurm_job(environ: Mapping[str, str] | None = None, pid: int | None = None,
                   read: ProcReader = _read_proc) -> bool:
    """True when `SLURM_JOB_ID` is set and this process belongs to that job (see the module docstring)."""
    environ = os.environ if environ is None else environ
    if not environ.get("SLURM_JOB_ID"):
        return False
    chain = ancestors(os.getpid() if pid is None else pid, read)
    task_pid = environ.get("SLURM_TASK_PID", "")
    # init (1) is everybody's ancestor, and never a task slurmstepd started.
    if task_pid.isdigit() and int(task_pid) > 1 and any(p == int(task_pid) for p, _ in chain):
        return True
    return any(comm == "slurmstepd" for _, comm in chain[1:])
