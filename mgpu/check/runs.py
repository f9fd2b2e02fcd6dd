"""The ranks of one check run (`python -m mgpu.check.resume`): the checked command for a run directory, local
ranks started in one process group with the checker's environment (no launcher variables, the test stop,
MGPU_CHECK_RESUME_DIR), every wait within the check's deadline, no process left behind: the ranks' groups are
killed at the end of each segment, and a watcher process of its own session kills any group still registered
when the checker ends, however it ends (SIGKILL included: the watcher reads the end of its pipe)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mgpu.errors import MgpuError
from mgpu.run.outcome import STOPPED_EXIT_CODE

__all__ = ["OutOfTime", "Run", "Runner", "Target", "WATCHER", "failed"]

ROOT = Path(__file__).resolve().parents[2]  # the checkout (mgpu/check/runs.py)
_LAUNCHER = ("SLURM_", "SUBMITIT_", "TORCHELASTIC_")
FAILED_RANK_GRACE_S = 10.0
"""How long the other ranks of a segment get to leave on their own after one failed (its error recorded)."""
_RANK_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}


class OutOfTime(MgpuError):
    """--timeout ran out."""


@dataclass
class Target:
    """What is checked: the command of one rank for a run directory, and how a world-size change keeps the batch."""
    script: Path | None
    args: list[str]
    config: str | None
    overrides: list[str]
    halved_args: list[str] | None  # extra arguments for N/2 ranks; None: no world-size change
    label: str

    def command(self, run_dir: Path, halved: bool = False) -> list[str]:
        if self.script is not None:
            args = [a.replace("{run}", str(run_dir)) for a in self.args]
            return [sys.executable, str(self.script), *args, *(self.halved_args or [] if halved else [])]
        return [sys.executable, str(ROOT / "jobs" / "train.py"), "--config", str(self.config), *self.overrides,
                f"run.dir={run_dir}", "checkpoint.keep_last=1000"]


@dataclass
class Run:
    """One run (its segments share `run_dir`): what each segment's ranks exited with and wrote."""
    name: str
    run_dir: Path
    segments: list[Path] = field(default_factory=list)  # each segment's check directory (batch records)
    codes: list[list[int]] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)


def _host_store() -> Any:
    """The ranks' rendezvous store, hosted here on a port the system picks, as mgpu.run.spawn hosts it: a port
    chosen free and then bound by rank 0 can be taken in between (another test's ranks), and rank 1 then waits
    out the rendezvous timeout."""
    from mgpu.run.spawn import host_store as host

    return host()


WATCHER = """
import os, signal, sys
groups = set()
for line in sys.stdin:
    (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
"""
"""The watcher (`python -S -c WATCHER`, its own session): `+PGID` / `-PGID` lines register and forget the ranks'
process groups; at the end of its input (the checker closed it, or died) it kills those still registered."""


class Runner:
    """Starts ranks of the target, one segment at a time, within the check's deadline; `close()` at the end."""

    def __init__(self, target: Target, scratch: Path, cwd: Path, deadline: float, keep: Path | None = None) -> None:
        self.target, self.scratch, self.cwd, self.deadline, self.keep = target, scratch, cwd, deadline, keep
        self._watcher: subprocess.Popen[str] | None = None

    def _watch(self, line: str) -> None:
        if self._watcher is None:
            self._watcher = subprocess.Popen([sys.executable, "-S", "-c", WATCHER], stdin=subprocess.PIPE, text=True,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                             start_new_session=True)
        assert self._watcher.stdin is not None
        self._watcher.stdin.write(line + "\n")
        self._watcher.stdin.flush()

    def kept(self, name: str) -> Path:
        """Where a failed run's evidence (each rank's log with its stacks) is kept for the user: under --keep's
        directory, else a directory of its own in the system's temporary directory (the scratch is removed)."""
        if self.keep is not None:
            return self.keep / f"{name}-stacks"
        import tempfile

        return Path(tempfile.mkdtemp(prefix=f"mgpu-check-resume-{name}-stacks-"))

    def close(self) -> None:
        """The watcher told that nothing is left (it exits)."""
        if self._watcher is not None and self._watcher.stdin is not None:
            self._watcher.stdin.close()
            self._watcher.wait()
            self._watcher = None

    def segment(self, run: Run, world: int, stop_at: int | None, halved: bool = False) -> list[int]:
        """One start of `run` on `world` ranks, stopped after `stop_at` (None: to its end); the ranks' exit codes."""
        check_dir = self.scratch / f"{run.name}.segment{len(run.segments)}"
        check_dir.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER) and k not in _RANK_VARS}
        store = _host_store()  # kept alive until the segment's ranks are gone
        env.update(OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), str(self.cwd), env.get("PYTHONPATH")) if p),
                   MGPU_CHECK_RESUME_DIR=str(check_dir), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                   TORCHELASTIC_USE_AGENT_STORE="True",
                   WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(self.scratch / "torchinductor"))  # torch's, in the scratch
        env.pop("MGPU_STOP_AT_STEP", None)
        if stop_at is not None:
            env["MGPU_STOP_AT_STEP"] = str(stop_at)
        command = self.target.command(run.run_dir, halved)
        procs: list[subprocess.Popen[bytes]] = []
        logs = [open(check_dir / f"rank{r}.out", "wb") for r in range(world)]
        try:
            for rank in range(world):
                group: dict[str, Any] = {"process_group": procs[0].pid if procs else 0}  # one group: killed together
                procs.append(subprocess.Popen(command, cwd=self.cwd, env={**env, "RANK": str(rank),
                                                                          "LOCAL_RANK": str(rank)},
                                              stdout=logs[rank], stderr=subprocess.STDOUT, **group))
                if rank == 0:
                    self._watch(f"+{procs[0].pid}")
            # A rank that failed ends the segment within a few seconds: the others would wait for it in a
            # collective until the rendezvous or collective timeout (minutes), not until the check's deadline.
            failed_at: float | None = None
            while any(proc.poll() is None for proc in procs):
                now = time.monotonic()
                if now > self.deadline:
                    raise subprocess.TimeoutExpired(command, 0)
                if failed_at is None and any(proc.poll() not in (None, 0, STOPPED_EXIT_CODE) for proc in procs):
                    failed_at = now
                if failed_at is not None and now - failed_at > FAILED_RANK_GRACE_S:
                    break
                time.sleep(0.1)
        except subprocess.TimeoutExpired:
            raise OutOfTime(f"out of time (--timeout) in the {run.name} run: give it more time, or fewer --steps") from None
        finally:
            if procs:  # what is left of the group (a rank's DataLoader workers too)
                _kill_group(procs[0].pid)
                for proc in procs:
                    proc.wait()
                self._watch(f"-{procs[0].pid}")
            for log in logs:
                log.close()
        codes = [p.returncode for p in procs]
        run.segments.append(check_dir)
        run.codes.append(codes)
        run.outputs.append((check_dir / "rank0.out").read_text(errors="replace"))
        return codes


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def failed(codes: list[int]) -> bool:
    """Whether a segment failed: 0 finished (or requeued), 3 stopped outside Slurm (rank 0)."""
    return any(c not in (0, 3) for c in codes)
