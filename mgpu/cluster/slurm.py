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
- `calls` counts what was asked (bench/scale.py's Slurm calls per job-hour);
- output is decoded tolerantly (a Latin-1 job name or working directory in `scontrol show job` is not UTF-8:
  it must not raise at a job's start or stop), and `unanswered` says which calls gave no answer, and why;
- `within(seconds)` bounds every call and retry inside it by one deadline: at a stop, the time left before
  Slurm's SIGKILL (`mgpu.cluster.kill_time`: from the signals' times and KillWait), so a hanging scontrol cannot
  outlast the job (it used to cost 2 tries x 20 s per call, twice, 84 s, past most KillWaits).

Tests inject `run` (argv, timeout -> CompletedProcess) and `which` instead of the real commands.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, Mapping, Sequence

from mgpu.errors import MgpuError

__all__ = ["ALIVE_STATES", "JobView", "RequeueOutcome", "SlurmClient", "SlurmError", "SlurmUnanswered", "client",
           "is_alive", "parse_job_view", "set_client"]

Runner = Callable[[list[str], float], "subprocess.CompletedProcess[str]"]
TIMEOUT_S = 20.0
RETRIES = 1
MAX_NOTES = 20
MIN_TRY_S = 0.5
"""The shortest try a deadline leaves a call (less cannot start a Slurm command and read its answer)."""
ALIVE_STATES = frozenset({"PENDING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                          "CONFIGURING", "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"})
"""Job states in which a job may still write to its run: queued, running, ending, or on its way back."""
_TRANSIENT = ("socket timed out", "unable to contact slurm controller", "slurm_load_jobs error: socket",
              "connection refused", "try again")


class SlurmError(MgpuError):
    """Slurm cannot be asked or told (e.g. scontrol is missing in the container, or it refused)."""


class SlurmUnanswered(SlurmError):
    """Slurm gave no answer (its command is missing, hung past the deadline, was killed, or the controller was
    unreachable): nothing is known, which is not the same as a refusal, and never the user's bad input."""

    def __init__(self, message: str, note: str | None = None) -> None:
        super().__init__(message)
        self.note = note or message
        """The call and why it gave no answer, in a few words (what a ledger's `unknown` records)."""


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
    """Run it in a session of its own, and past `timeout` kill the whole session: a wrapper script's child that
    holds the output pipe (a site's scontrol shim) must not outlive the bound. Bytes that are not UTF-8 (a
    Latin-1 job name) are replaced, never raised on."""
    with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out.decode("utf-8", "replace"),
                                       err.decode("utf-8", "replace"))


def recorded_resume_command(environ: Mapping[str, str] | None = None) -> str:
    """The command that continues the run as its submitter recorded it (MGPU_RESUME_COMMAND), or a placeholder
    naming the job; mgpu.cluster.requeue.resume_command completes a template's from accounting."""
    environ = os.environ if environ is None else environ
    recorded = environ.get("MGPU_RESUME_COMMAND", "")
    if recorded:
        return recorded
    job = environ.get("SLURM_JOB_ID")
    return f"the command that submitted {'job ' + job if job else 'this run'} (MGPU_RESUME_COMMAND is not set)"


def _missing(tool: str) -> str:
    return (f"{tool} not found on PATH (inside a container? bind-mount Slurm's client commands): cannot ask Slurm "
            f"about the job or requeue it; the checkpoint is kept; to resume: {recorded_resume_command()}")


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

    deadline: float | None = None
    """time.monotonic() by which every call and retry must be done (None: only `timeout_s` per try)."""
    unanswered: list[str] = field(default_factory=list)
    """One line per call that gave no answer, and why (what `status` and a stop say they could not ask)."""
    lost_tries: int = 0
    """The last call's tries that got no answer (timed out or killed): each may still have taken effect."""

    @contextlib.contextmanager
    def within(self, seconds: float) -> Iterator["SlurmClient"]:
        """Every call inside ends within `seconds` from now, retries included (a tighter outer bound stays)."""
        before = self.deadline
        until = time.monotonic() + max(0.0, seconds)
        self.deadline = until if before is None else min(before, until)
        try:
            yield self
        finally:
            self.deadline = before

    def seconds_left(self) -> float | None:
        """Seconds until the deadline of `within` (None: no deadline)."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    # ------------------------------------------------------------------ the runner
    def call(self, tool: str, *args: str, required: bool = False) -> "subprocess.CompletedProcess[str] | None":
        """Run `tool args`; None when the tool is missing (SlurmUnanswered if `required`) or gave no answer
        within the retries and the deadline (a timeout, a signal, an unreachable controller); each such call
        is noted in `unanswered`. A refusal is returned as it is."""
        path = self.which(tool)
        command = " ".join([tool, *args])
        if path is None:
            self._note(f"{command}: {tool} not found on PATH")
            if required:
                raise SlurmUnanswered(_missing(tool), self.unanswered[-1])
            return None
        key = f"{tool} {args[0]}" if tool == "scontrol" and args else tool
        proc, why, tries = None, "", 0
        self.lost_tries = 0
        for attempt in range(self.retries + 1):
            left = self.seconds_left()
            if attempt:
                if left is not None and left < self.retry_wait_s + MIN_TRY_S:
                    break  # no time for another try before the deadline
                time.sleep(self.retry_wait_s)
                left = self.seconds_left()
            timeout = self.timeout_s if left is None else max(MIN_TRY_S, min(self.timeout_s, left))
            self.calls[key] = self.calls.get(key, 0) + 1
            tries += 1
            try:
                proc = self.run([path, *args], timeout)
            except subprocess.TimeoutExpired:
                proc, why = None, f"no answer from Slurm within {round(timeout, 1):g} s"
                self.lost_tries += 1
                continue
            except OSError as error:
                self._note(f"{command}: cannot run {tool}: {error.strerror or error}")
                return None
            message = (proc.stderr or "").lower()
            if proc.returncode >= 0 and not (proc.returncode and any(t in message for t in _TRANSIENT)):
                return proc
            self.lost_tries += proc.returncode < 0
            why = (f"no answer from Slurm: killed by signal {-proc.returncode}" if proc.returncode < 0
                   else f"no answer from Slurm: exit {proc.returncode}: {' '.join((proc.stderr or '').split())[:160]}")
        self._note(f"{command}: {why} ({tries} {'try' if tries == 1 else 'tries'})")
        # A controller unreachable on every try is returned as its refusal (its words are the evidence; `_required`
        # reads it as no answer); a timeout or a killed command told nothing at all.
        return proc if proc is not None and proc.returncode >= 0 else None

    def _note(self, line: str) -> None:
        self.unanswered[:] = [*self.unanswered[-(MAX_NOTES - 1):], line]  # a long outage must not grow it forever

    def _required(self, tool: str, *args: str) -> "subprocess.CompletedProcess[str]":
        """The answer, or SlurmUnanswered: none came, or the controller could not be reached on any try."""
        proc = self.call(tool, *args, required=True)
        if proc is None or (proc.returncode and any(t in (proc.stderr or "").lower() for t in _TRANSIENT)):
            raise SlurmUnanswered(self.unanswered[-1])
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
            if self.lost_tries:
                # A try that got no answer in time (a loaded controller) still requeued it: the retry finds
                # the job pending. Ours: far likelier than a preemption's requeue landing within those seconds.
                return RequeueOutcome("self", f"requeued job {job_id} (the first try got no answer in time but "
                                              f"took effect: {message})")
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
        """`scontrol show partition -o` of `partition` ("": every partition), "" when Slurm refuses."""
        proc = self._required("scontrol", "show", "partition", "-o", *([partition] if partition else []))
        return proc.stdout if proc.returncode == 0 else ""

    def show_config(self) -> str:
        """`scontrol show config` ("" when Slurm refuses)."""
        proc = self._required("scontrol", "show", "config")
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
