"""The one Slurm client: every `scontrol`, `squeue` and `sacct` mgpu runs goes through `SlurmClient`, with one
timeout, one retry policy and one meaning of "alive". No torch.

Before, four modules spoke to Slurm, each with its own runner and timeout (30 s, 15 s, 30 s, 15 s twice), and
"alive" meant "squeue lists it" in one (a job that ended a minute ago is still listed, for MinJobAge) and "in
a queued or running state" in another. Here:

- a call gets `timeout_s` (20 s), and is tried once more after `retry_wait_s` when it timed out, was killed
  by a signal (Slurm signals the whole step at preemption, this process's children included), or the
  controller did not answer (`Socket timed out`, `Unable to contact slurm controller`): a busy slurmctld
  at the moment of a preemption is the usual case, and a second try is what users do by hand;
- "alive" is one of ALIVE_STATES: queued, running, or on its way back (requeued, held for requeue);
- `calls` counts what was asked (bench/scale.py's Slurm calls per job-hour).

Tests inject `run` (argv, timeout -> CompletedProcess) and `which` instead of the real commands.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

from mgpu.errors import MgpuError

__all__ = ["ALIVE_STATES", "JobView", "RequeueOutcome", "SlurmClient", "SlurmError", "client", "is_alive",
           "parse_job_view", "set_client"]

Runner = Callable[[list[str], float], "subprocess.CompletedProcess[str]"]
TIMEOUT_S = 20.0
RETRIES = 1
ALIVE_STATES = frozenset({"PENDING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                          "CONFIGURING", "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"})
"""Job states in which a job may still write to its run: queued, running, ending, or on its way back."""
_TRANSIENT = ("socket timed out", "unable to contact slurm controller", "slurm_load_jobs error: socket",
              "connection refused", "try again")


class SlurmError(MgpuError):
    """Slurm cannot be asked or told (e.g. scontrol is missing in the container, or it refused)."""


def is_alive(state: str | None) -> bool:
    """The one meaning of alive: a job in one of ALIVE_STATES (`CANCELLED by 12` reads as CANCELLED)."""
    return state is not None and state.split()[0].rstrip("+") in ALIVE_STATES


@dataclass(frozen=True)
class JobView:
    """The fields of `scontrol show job` the requeue decision and the recovery need."""

    state: str
    reason: str
    restarts: int
    preempt_time: str | None
    excluded: str = ""
    """ExcNodeList, a Slurm node list ("" for none)."""
    num_nodes: int = 1
    partition: str = ""


@dataclass(frozen=True)
class RequeueOutcome:
    how: Literal["self", "slurm"]
    message: str


def parse_job_view(text: str) -> JobView:
    """`scontrol show job -o` output -> JobView."""
    fields = dict(token.split("=", 1) for token in text.split() if "=" in token)
    preempt = fields.get("PreemptTime")
    excluded = fields.get("ExcNodeList", "(null)")
    restarts = fields.get("Restarts", "0")
    nodes = fields.get("NumNodes", "1").split("-")[0]
    return JobView(state=fields.get("JobState", "UNKNOWN"), reason=fields.get("Reason", "None"),
                   restarts=int(restarts) if restarts.isdigit() else 0,
                   preempt_time=None if preempt in (None, "None", "-", "Unknown") else preempt,
                   excluded="" if excluded == "(null)" else excluded,
                   num_nodes=int(nodes) if nodes.isdigit() and int(nodes) > 0 else 1,
                   partition=fields.get("Partition", ""))


def _subprocess_run(argv: list[str], timeout: float) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def _missing(tool: str) -> str:
    from mgpu.requeue import resume_command  # the resume command's reader asks accounting through this client

    return (f"{tool} not found on PATH (inside a container? bind-mount Slurm's client commands): cannot ask Slurm "
            f"about the job or requeue it; the checkpoint is kept; to resume: {resume_command(ask=False)}")


@dataclass
class SlurmClient:
    """Slurm's commands behind one runner, timeout and retry policy."""

    run: Runner = _subprocess_run
    which: Callable[[str], str | None] = shutil.which
    timeout_s: float = TIMEOUT_S
    retries: int = RETRIES
    retry_wait_s: float = 0.5
    calls: dict[str, int] = field(default_factory=dict)
    """What was run, by tool and verb (`scontrol show`, `squeue`...): counted per attempt."""

    # ------------------------------------------------------------------ the runner
    def call(self, tool: str, *args: str, required: bool = False) -> "subprocess.CompletedProcess[str] | None":
        """Run `tool args`; None when the tool is missing (SlurmError if `required`) or gave no answer after
        the retries (a timeout, a signal, an unreachable controller). A refusal is returned as it is."""
        path = self.which(tool)
        if path is None:
            if required:
                raise SlurmError(_missing(tool))
            return None
        key = f"{tool} {args[0]}" if tool == "scontrol" and args else tool
        proc = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.retry_wait_s)
            self.calls[key] = self.calls.get(key, 0) + 1
            try:
                proc = self.run([path, *args], self.timeout_s)
            except subprocess.TimeoutExpired:
                proc = None
                continue
            except OSError:
                return None
            message = (proc.stderr or "").lower()
            if proc.returncode >= 0 and not (proc.returncode and any(t in message for t in _TRANSIENT)):
                return proc
        return proc if proc is not None and proc.returncode >= 0 else None

    def _required(self, tool: str, *args: str) -> "subprocess.CompletedProcess[str]":
        proc = self.call(tool, *args, required=True)
        if proc is None:
            raise SlurmError(f"{tool} {' '.join(args)}: no answer from Slurm within {self.timeout_s:.0f} s "
                             f"({self.retries + 1} tries)")
        return proc

    # ------------------------------------------------------------------ jobs
    def job(self, job_id: str) -> JobView:
        """`scontrol show job` of one job (SlurmError when Slurm cannot say)."""
        proc = self._required("scontrol", "show", "job", "-o", job_id)
        if proc.returncode != 0:
            raise SlurmError(f"scontrol show job {job_id} failed: {(proc.stderr or proc.stdout).strip()}")
        return parse_job_view(proc.stdout)

    def state(self, job_id: str) -> str | None:
        """The job's state: squeue while Slurm holds it, then accounting; None when neither knows."""
        for tool, args in (("squeue", ("-h", "-j", job_id, "-o", "%T")),
                           ("sacct", ("-n", "-X", "-P", "-o", "State", "-j", job_id))):
            proc = self.call(tool, *args)
            lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()] if proc and not proc.returncode else []
            if lines:
                return lines[-1].split()[0]
        return None

    def alive(self, job_id: str) -> bool:
        return is_alive(self.state(job_id))

    def times(self, job_id: str) -> str:
        """squeue's `%S %e` for the job (its start and end), "" when it gives no answer."""
        proc = self.call("squeue", "-h", "-j", job_id, "-o", "%S %e")
        return proc.stdout if proc is not None and proc.returncode == 0 else ""

    def batch_script(self, job_id: str) -> str | None:
        proc = self.call("scontrol", "write", "batch_script", job_id, "-")
        return proc.stdout if proc is not None and proc.returncode == 0 else None

    def sacct(self, job_ids: Sequence[str], fields: Sequence[str], since: str | None = None,
              duplicates: bool = False) -> str | None:
        """sacct's parsable rows (`-X -n -P`) of `job_ids`, or None when it gives no answer."""
        args = [*(["-D"] if duplicates else []), "-X", "-n", "-P", *(["-S", since] if since else []),
                "-o", ",".join(fields), "-j", ",".join(job_ids)]
        proc = self.call("sacct", *args)
        return proc.stdout if proc is not None and proc.returncode == 0 else None

    # ------------------------------------------------------------------ actions
    def requeue(self, job_id: str) -> RequeueOutcome:
        """`scontrol requeue <job id>` (array-aware: `<array job>_<task>` requeues that task only)."""
        proc = self._required("scontrol", "requeue", job_id)
        if proc.returncode == 0:
            return RequeueOutcome("self", f"requeued job {job_id}")
        message = (proc.stderr or proc.stdout).strip()
        if "pending" in message.lower():
            # GraceTime=0: Slurm requeued the job already; ours arrives second and fails harmlessly.
            return RequeueOutcome("slurm", f"Slurm had already requeued job {job_id} ({message})")
        raise SlurmError(f"scontrol requeue {job_id} failed: {message}")

    def exclude(self, job_id: str, nodes: Sequence[str]) -> None:
        """Set the job's ExcNodeList (the job must be pending: right after `scontrol requeue`)."""
        proc = self._required("scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}")
        if proc.returncode != 0:
            raise SlurmError(f"scontrol update JobId={job_id} ExcNodeList={','.join(nodes)} failed: "
                             f"{(proc.stderr or proc.stdout).strip()}")

    # ------------------------------------------------------------------ nodes
    def show_nodes(self, nodes: Sequence[str]) -> str:
        """`scontrol show node -o` of `nodes` ("" when Slurm cannot say)."""
        proc = self._required("scontrol", "show", "node", "-o", ",".join(nodes))
        return proc.stdout if proc.returncode == 0 else ""

    def show_partition(self, partition: str) -> str:
        proc = self._required("scontrol", "show", "partition", "-o", partition)
        return proc.stdout if proc.returncode == 0 else ""


_client = SlurmClient()


def client() -> SlurmClient:
    """The process's client (what every module asks through; tests replace it with `set_client`)."""
    return _client


def set_client(new: SlurmClient) -> SlurmClient:
    """Replace the process's client; returns the one it replaced."""
    global _client
    old, _client = _client, new
    return old
