"""The run directory: its name, every path inside it, and who may use it. No torch.

A run is identified by `run.name`: its directory is `<run.root>/<run.name>` (or `run.dir`) whatever
launched it, so resubmitting the same config (a new Slurm job id) or running the same command again
continues the same run. A new run takes a new `run.name`.

    <run dir>/config.yaml        the resolved config (rank 0; checked against the checkpoints on resume)
    <run dir>/checkpoints/       mgpu.state.single.store's store
    <run dir>/tensorboard/       event files
    <run dir>/events.jsonl       the ledger (mgpu.record.ledger)
    <run dir>/logs/rank<N>.log   every rank's log; rank<N>.json: its view of the launcher
    <run dir>/.owner             which job is using the run now (see `RunDir.claim`)
    <run dir>/.owner.lock        held for the moment of a claim: two starts take turns (O_EXCL)
    <run dir>/.owner.lock.break  held while a stale .owner.lock is looked at again and removed (O_EXCL)
    <run dir>/.failure-<job>-<restart>  who handles a failed run (see mgpu.train.job)
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from mgpu.errors import MgpuError
from mgpu.fsutil import write_atomic

__all__ = ["Owner", "OwnerUnknown", "RunDir", "RunInUse", "owner_alive"]

LOCK_WAIT_S = 30.0
"""How long a claim waits for another start's claim in progress (it takes milliseconds)."""
LOCK_STALE_S = 120.0
"""A lock this old belongs to a start that died in the middle of its claim: it is broken."""


class RunInUse(MgpuError):
    """Another live job or process is using the run directory."""


class OwnerUnknown(Exception):
    """Whether the run's owner lives cannot be told (squeue failed): not the same as gone."""


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
    """Slurm's state of a job while it is queued or running; None once it is gone. OwnerUnknown when squeue
    cannot say (missing, timed out, failed): a live job must not count as gone because Slurm did not answer."""
    from mgpu.cluster.slurm import client  # the one Slurm client: its runner, timeout and retries

    proc = client().call("squeue", "-h", "-j", job_id, "-o", "%T")
    if proc is None:
        raise OwnerUnknown("squeue is not on PATH or gave no answer")
    if proc.returncode != 0:
        if "invalid job id" in (proc.stderr or "").lower():
            return None  # Slurm forgot the job: it ended a while ago
        raise OwnerUnknown(f"squeue exited {proc.returncode}: {' '.join((proc.stderr or '').split())[:200]}")
    states = proc.stdout.split()
    return states[0] if states else None


def owner_alive(owner: Owner, squeue_state: Callable[[str], str | None] = _squeue_state) -> bool:
    """Whether `owner` may still write to the run: its Slurm job is queued or running, or its process lives.
    OwnerUnknown when Slurm cannot tell."""
    if owner.slurm:
        from mgpu.cluster.slurm import is_alive  # one meaning of alive: a job that ended is not, though squeue lists it

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

    @property
    def claim_lock(self) -> Path:
        return self.path / ".owner.lock"

    def check_free(self, job_id: str | None = None,
                   squeue_state: Callable[[str], str | None] = _squeue_state) -> None:
        """RunInUse if a live job or process other than this one (Slurm job `job_id`) holds the run, or if
        Slurm cannot say whether the job that holds it still lives."""
        owner = self.owner()
        if owner is None:
            return
        if owner.job_id == job_id if owner.slurm else (owner.host, owner.pid) == (socket.gethostname(), os.getpid()):
            return  # our own job, requeued (a new process, the same job id), or this very process
        since = time.strftime('%Y-%m-%d %H:%M', time.localtime(owner.since))
        try:
            alive = owner_alive(owner, squeue_state)
        except OwnerUnknown as unknown:
            raise RunInUse(f"run {self.path} is held by {owner.describe()} since {since}, and whether it still runs "
                           f"cannot be told ({unknown}): try again when Slurm answers; if that job is over, remove "
                           f"{self.owner_file}") from None
        if not alive:
            return
        fix = f"wait for it or stop it (scancel {owner.job_id})" if owner.slurm else "wait for it or stop it"
        raise RunInUse(f"run {self.path} is in use by {owner.describe()} since {since}: {fix}, or start another run "
                       f"(run.name=...)")

    def claim(self, job_id: str, slurm: bool,
              squeue_state: Callable[[str], str | None] = _squeue_state) -> Owner:
        """Take the run for this process (rank 0), unless someone alive holds it. A requeued job (same id)
        takes it back; a killed run's claim is stale once its job or process is gone. Two starts take turns
        (an O_EXCL lock file around the check and the write): they cannot both win."""
        self.path.mkdir(parents=True, exist_ok=True)
        with self._claim_lock():
            self.check_free(job_id, squeue_state)
            owner = Owner.this_process(job_id, slurm)
            write_atomic(self.owner_file, json.dumps(asdict(owner)).encode())
        return owner

    @contextlib.contextmanager
    def _claim_lock(self) -> Iterator[None]:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fd = os.open(self.claim_lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                break
            except FileExistsError:
                try:
                    age = time.time() - self.claim_lock.stat().st_mtime
                except FileNotFoundError:
                    continue  # released just now
                if age > LOCK_STALE_S:
                    self._break_if_stale()  # its start died in the middle of the claim
                    continue
                if time.monotonic() > deadline:
                    raise RunInUse(f"run {self.path}: another start is claiming it ({self.claim_lock} exists, "
                                   f"{age:.0f} s old): try again, or remove that file if no start is running") from None
                time.sleep(0.05)
        try:
            os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
            os.close(fd)
            yield
        finally:
            self.claim_lock.unlink(missing_ok=True)

    @property
    def claim_breaker(self) -> Path:
        return self.path / ".owner.lock.break"

    def _break_if_stale(self) -> None:
        """Remove the claim lock if it is still stale, deciding under `.owner.lock.break` (O_EXCL). Two starts that
        both saw the lock stale once both removed it: the later one, acting on its older look, removed the lock the
        first had just taken, and both claimed. Under the breaker the look and the removal are one step, and a lock
        taken since is fresh. A breaker lives for microseconds; one older than LOCK_STALE_S (its start died between
        the two) is removed as such."""
        try:
            fd = os.open(self.claim_breaker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):
                if time.time() - self.claim_breaker.stat().st_mtime > LOCK_STALE_S:
                    self.claim_breaker.unlink(missing_ok=True)
            return
        os.close(fd)
        try:
            with contextlib.suppress(FileNotFoundError):
                if time.time() - self.claim_lock.stat().st_mtime > LOCK_STALE_S:
                    self.claim_lock.unlink(missing_ok=True)
        finally:
            self.claim_breaker.unlink(missing_ok=True)

    def release(self, job_id: str) -> None:
        """Drop this process's claim once the run is over (a requeued job keeps it: it comes back)."""
        owner = self.owner()
        if owner is not None and (owner.job_id, owner.host, owner.pid) == (job_id, socket.gethostname(), os.getpid()):
            self.owner_file.unlink(missing_ok=True)


    def announce(self, environ: Mapping[str, str]) -> None:
        """Where slurm/loop.sbatch's recovery finds the run: its path into the file `MGPU_RUN_DIR_FILE` names
        (the script names it; call on rank 0 only)."""
        target = environ.get("MGPU_RUN_DIR_FILE")
        if target:
            write_atomic(Path(target), str(self.path.resolve()).encode())
