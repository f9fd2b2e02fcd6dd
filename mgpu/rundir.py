"""The run directory: its name, every path inside it, and who may use it. No torch.

A run is identified by `run.name`: its directory is `<run.root>/<run.name>` (or `run.dir`) whatever
launched it, so resubmitting the same config (a new Slurm job id) or running the same command again
continues the same run. A new run takes a new `run.name`.

    <run dir>/config.yaml        the resolved config (rank 0; checked against the checkpoints on resume)
    <run dir>/checkpoints/       mgpu.checkpoint's store
    <run dir>/tensorboard/       event files
    <run dir>/events.jsonl       the ledger (mgpu.ledger)
    <run dir>/logs/rank<N>.log   every rank's log; rank<N>.json: its view of the launcher
    <run dir>/.owner             which job is using the run now (see `RunDir.claim`)
    <run dir>/.failure-<job>-<restart>  who handles a failed run (see mgpu.job)
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from mgpu.errors import MgpuError
from mgpu.fsutil import write_atomic

__all__ = ["Owner", "RunDir", "RunInUse", "owner_alive"]


class RunInUse(MgpuError):
    """Another live job or process is using the run directory."""


@dataclass(frozen=True)
class Owner:
    """Who holds a run directory: enough to tell later whether it is still alive."""

    job_id: str
    host: str
    pid: int
    pid_start: str
    """The process's start time in clock ticks (/proc/PID/stat field 22): a reused PID does not match."""
    slurm: bool
    """job_id is a Slurm job id (ask squeue whether it lives) rather than a local process."""
    since: float

    @classmethod
    def this_process(cls, job_id: str, slurm: bool) -> "Owner":
        return cls(job_id, socket.gethostname(), os.getpid(), _pid_start(os.getpid()) or "", slurm,
                   round(time.time(), 3))

    def describe(self) -> str:
        return f"Slurm job {self.job_id}" if self.slurm else f"process {self.pid} on {self.host}"


def _pid_start(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _squeue_state(job_id: str) -> str | None:
    """Slurm's state of a job (mgpu.slurm's client: squeue, then accounting); None when unknown."""
    from mgpu.slurm import client

    return client().state(job_id)


def owner_alive(owner: Owner, squeue_state: Callable[[str], str | None] = _squeue_state) -> bool:
    """Whether `owner` may still write to the run: its Slurm job is queued or running, or its process lives."""
    if owner.slurm:
        from mgpu.slurm import is_alive  # one meaning of alive: a job that ended is not, though squeue lists it

        return is_alive(squeue_state(owner.job_id))
    if owner.host != socket.gethostname():
        return False  # cannot be checked from here; a local run on another machine is not ours to guard
    return _pid_start(owner.pid) == owner.pid_start


@dataclass(frozen=True)
class RunDir:
    """One run's directory and the paths inside it."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))  # a str from the command line is fine too

    @classmethod
    def of(cls, run: Any) -> "RunDir":
        """From a config's `run` section: `run.dir`, else `<run.root>/<run.name>`."""
        return cls(Path(run.dir) if run.dir else Path(run.root) / run.name)

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def ledger(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def rank_record(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.json"

    @property
    def owner_file(self) -> Path:
        return self.path / ".owner"

    def failure_claim(self, job_id: str, restart: int) -> Path:
        return self.path / f".failure-{job_id}-{restart}"

    # ------------------------------------------------------------------ ownership
    def owner(self) -> Owner | None:
        """Who claimed the run last (None: nobody, or an unreadable claim)."""
        try:
            data = json.loads(self.owner_file.read_text())
            return Owner(**data)
        except (OSError, ValueError, TypeError):
            return None

    def check_free(self, job_id: str | None = None,
                   squeue_state: Callable[[str], str | None] = _squeue_state) -> None:
        """RunInUse if a live job or process other than this one (Slurm job `job_id`) holds the run."""
        owner = self.owner()
        if owner is None or not owner_alive(owner, squeue_state):
            return
        if owner.job_id == job_id if owner.slurm else (owner.host, owner.pid) == (socket.gethostname(), os.getpid()):
            return  # our own job, requeued (a new process, the same job id), or this very process
        fix = f"wait for it or stop it (scancel {owner.job_id})" if owner.slurm else "wait for it or stop it"
        raise RunInUse(f"run {self.path} is in use by {owner.describe()} since "
                       f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(owner.since))}: {fix}, or start "
                       f"another run (run.name=...)")

    def claim(self, job_id: str, slurm: bool,
              squeue_state: Callable[[str], str | None] = _squeue_state) -> Owner:
        """Take the run for this process (rank 0), unless someone alive holds it. A requeued job (same id)
        takes it back; a killed run's claim is stale once its job or process is gone."""
        self.check_free(job_id, squeue_state)
        owner = Owner.this_process(job_id, slurm)
        self.path.mkdir(parents=True, exist_ok=True)
        write_atomic(self.owner_file, json.dumps(asdict(owner)).encode())
        return owner

    def release(self, job_id: str) -> None:
        """Drop this process's claim once the run is over (a requeued job keeps it: it comes back)."""
        owner = self.owner()
        if owner is not None and (owner.job_id, owner.host, owner.pid) == (job_id, socket.gethostname(), os.getpid()):
            self.owner_file.unlink(missing_ok=True)

