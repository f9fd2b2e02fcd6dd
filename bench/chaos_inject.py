"""The chaos benchmark's hands on the test cluster (bench/chaos.py): Slurm commands, the training ranks' processes,
and each failure kind's injection, the way tests/e2e does them (tests/e2e/job_helpers.preempt, the fault matrix's
SIGKILL, test_hangs' SIGSTOP, test_drain's `scontrol update`). `Cluster` remembers everything it changed (jobs
submitted, nodes drained, the preemption policy, processes frozen) and `restore` puts it back, also after Ctrl-C.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

ROOT = Path(__file__).resolve().parent.parent
POLICY = ROOT / "slurm" / "cluster" / "policy.sh"
SHM = Path(os.environ.get("MGPU_SNAPSHOT_DIR", "/dev/shm"))
SLURM_DIR = Path(os.environ.get("MGPU_SLURM_DIR", "/var/tmp/mgpu-slurm"))
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def sh(*cmd: str, timeout: float = 60, check: bool = True) -> str:
    """A Slurm client command, bounded; its stdout (RuntimeError with its output when it fails and `check`)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> rc {proc.returncode}: {(proc.stdout + proc.stderr).strip()}")
    return proc.stdout


def job_state(job_id: str) -> str:
    """Slurm's state of the job (`scontrol show job`), or "" once slurmctld has forgotten it."""
    out = sh("scontrol", "show", "job", "-o", job_id, check=False)
    fields = dict(tok.split("=", 1) for tok in out.split() if "=" in tok)
    return fields.get("JobState", "")


def node_state(node: str) -> str:
    out = sh("scontrol", "show", "node", "-o", node)
    return next((tok.split("=", 1)[1] for tok in out.split() if tok.startswith("State=")), "")


def read_policy() -> tuple[int, bool]:
    """(GraceTime of partition main, preempt_send_user_signal on)."""
    part = sh("scontrol", "show", "partition", "main")
    grace = int(next(tok.split("=", 1)[1] for tok in part.split() if tok.startswith("GraceTime=")))
    return grace, "preempt_send_user_signal" in sh("scontrol", "show", "config")


def wait_idle(nodes: tuple[str, ...], timeout: float = 180.0) -> float:
    """Wait until the queue is empty and every node is IDLE (the last configuration's job gone, its nodes freed), so
    that each configuration's clock starts on the same idle cluster; the seconds waited (RuntimeError past
    `timeout`)."""
    began = time.time()
    while True:
        queue = sh("squeue", "-h", "-o", "%i").split()
        if not queue and all(node_state(n) == "IDLE" for n in nodes):
            return time.time() - began
        if time.time() - began > timeout:
            raise RuntimeError(f"the cluster is not idle after {timeout:.0f} s (queue: {' '.join(queue) or 'empty'}; "
                               + ", ".join(f"{n} {node_state(n)}" for n in nodes) + ")")
        time.sleep(1)


@dataclass(frozen=True)
class Rank:
    rank: int
    pid: int
    node: str


def _start_time(pid: int) -> str:
    """The process's start time (field 22 of /proc/PID/stat): a pid reused by another process differs."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def find_ranks(marker: str, plain: bool) -> dict[int, Rank]:
    """The training ranks whose command line names `marker` (the run's folder): mgpu's are submitit's tasks
    (rank = SLURM_PROCID), the plain loop's torchrun's workers (rank = RANK; its agents have none)."""
    found: dict[int, Rank] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if marker.encode() not in cmdline or (not plain and b"submitit.core._submit" not in cmdline):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                continue
            env = dict(item.split(b"=", 1) for item in (entry / "environ").read_bytes().split(b"\0") if b"=" in item)
        except (OSError, IndexError, ValueError):
            continue
        key = b"RANK" if plain else b"SLURM_PROCID"
        if key in env and (not plain or b"LOCAL_RANK" in env):
            rank = int(env[key])
            found[rank] = Rank(rank, int(entry.name), env.get(b"SLURMD_NODENAME", b"?").decode())
    return found


@dataclass
class Cluster:
    """What the benchmark changed on the cluster, to be put back by `restore`."""

    policy: tuple[int, bool] = field(default_factory=read_policy)
    current: tuple[int, bool] = (-1, False)
    jobs: set[str] = field(default_factory=set)
    drained: dict[str, float] = field(default_factory=dict)
    """node -> when to resume it."""
    frozen: list[tuple[int, str]] = field(default_factory=list)
    """(pid, start time) of every process SIGSTOPped."""

    def __post_init__(self) -> None:
        self.current = self.policy

    def set_policy(self, grace: int, user_signal: bool) -> None:
        if self.current != (grace, user_signal):
            sh("bash", str(POLICY), "--grace", str(grace), "--user-signal", "yes" if user_signal else "no", timeout=120)
            self.current = (grace, user_signal)

    def preempt(self, grace: int) -> str:
        """A 1-CPU job in partition `high` (tests/e2e/job_helpers.preempt) at this GraceTime, with the user signal."""
        self.set_policy(grace, True)
        job = sh("sbatch", "--parsable", "-p", "high", "-N1", "-n1", "-J", "chaos-preemptor", "-o", "/dev/null",
                 "--wrap", "sleep 1").strip().split(";")[0]
        self.jobs.add(job)
        return job

    def drain(self, node: str, for_s: float) -> None:
        sh("scontrol", "update", f"nodename={node}", "state=drain", "reason=mgpu-chaos-benchmark")
        self.drained[node] = time.time() + for_s

    def resume_due(self, now: float | None = None) -> list[str]:
        """Resume the drained nodes whose time has come; their names."""
        due = [n for n, at in self.drained.items() if now is None or at <= now]
        for node in due:
            sh("scontrol", "update", f"nodename={node}", "state=resume", check=False)
            del self.drained[node]
        return due

    def freeze(self, pid: int) -> None:
        self.frozen.append((pid, _start_time(pid)))
        os.kill(pid, signal.SIGSTOP)

    def restore(self) -> list[str]:
        """Cancel every job submitted, resume the nodes drained, put the policy back, SIGKILL what is still frozen;
        what was done, one line each."""
        said = []
        for job in sorted(self.jobs):
            if job_state(job) not in DONE | {""}:
                sh("scancel", job, check=False)
                said.append(f"cancelled job {job}")
        deadline = time.time() + 90  # mgpu's ranks save and remove their own snapshots as they stop
        while time.time() < deadline and any(job_state(job) not in DONE | {""} for job in self.jobs):
            time.sleep(1)
        for node in self.resume_due():
            said.append(f"resumed node {node}")
        if self.current != self.policy:
            self.set_policy(*self.policy)
            said.append(f"preemption policy back to GraceTime {self.policy[0]}, user signal "
                        f"{'on' if self.policy[1] else 'off'}")
        for pid, started in self.frozen:
            if started and _start_time(pid) == started:
                os.kill(pid, signal.SIGKILL)
                said.append(f"killed frozen process {pid}")
        self.frozen.clear()
        for job in sorted(self.jobs):  # what mgpu left in node memory (a job cancelled while it restarted a step)
            for left in SHM.glob(f"mgpu-{job}-*"):
                shutil.rmtree(left, ignore_errors=True)
                said.append(f"removed {left}, left by job {job}")
        return said


def kill(ranks: list[Rank]) -> None:
    for r in ranks:
        try:
            os.kill(r.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wipe_node_memory(job_id: str, ranks: list[Rank], node: str) -> list[str]:
    """What a node's loss takes of mgpu's memory (docs/memory-snapshots.md): its ranks' snapshots and the replicas
    it holds for other nodes' ranks, under /dev/shm/mgpu-<job>-<run>/; the names removed."""
    removed = []
    for job_dir in SHM.glob(f"mgpu-{job_id}-*"):
        doomed = [job_dir / f"rank{r.rank}" for r in ranks] + list(job_dir.glob(f"replica-of-rank*-on-{node}"))
        for path in doomed:
            if path.exists():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(f"{job_dir.name}/{path.name}")
    return removed


# ------------------------------------------------------------------------------------------------ the e2e lock
def stale_lock_holders(path: Path) -> list[int]:
    """The cluster daemons that alone keep `path`'s flock held after the process that took it has gone (they
    inherited its descriptor from a start.sh run under `flock`), or [] when it is held as it should be."""
    inode = os.stat(path).st_ino
    lines = [line.split() for line in Path("/proc/locks").read_text().splitlines()
             if "FLOCK" in line and line.split()[-3].endswith(f":{inode}")]
    holders = [int(f[4]) for f in lines if f[1] != "->"]
    waiters = {int(f[5]) for f in lines if f[1] == "->"}
    if not holders or any(Path(f"/proc/{pid}").exists() for pid in holders):
        return []
    daemons = {int(p.read_text().strip()) for p in (SLURM_DIR / "pids").glob("*.pid") if p.read_text().strip().isdigit()}
    having = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == str(path):
                having.add(int(fd.parts[2]))
        except OSError:
            continue
    having -= waiters | {os.getpid()}
    return sorted(having) if having and having <= daemons else []


def take_lock(path: Path, say: Callable[[str], None]) -> IO[str]:
    """Hold `path`'s flock (the e2e tests' lock), waiting for it; a lock only the cluster's daemons still keep
    (stale_lock_holders: nobody else can take it either) is said and gone ahead without."""
    file = open(path, "a")
    said = False
    while True:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return file
        except BlockingIOError:
            pass
        stale = stale_lock_holders(path)
        if stale:
            say(f"{path} is held only by the cluster's daemons (pids {', '.join(map(str, stale))}: they inherited "
                "the descriptor of a start.sh run under flock), which nobody can take until they restart: going "
                "ahead without it")
            return file
        if not said:
            say(f"waiting for {path} (the e2e tests' lock) ...")
            said = True
        time.sleep(5)
