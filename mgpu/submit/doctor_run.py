"""Running the doctor: check the input, submit the probe jobs, wait for their answers (every wait bounded,
by its own limit and by the doctor's --timeout), read their logs back, and cancel every job it submitted
on any way out (an error, Ctrl-C, SIGTERM). No torch. The logic and the report are mgpu/submit/doctor.py's.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from mgpu.submit.doctor import (JOB_PREFIX, ClusterConfig, EnvFacts, PreemptionFacts, analyze_env, analyze_preemption,
                         batch_script, check_name, parse_config, parse_kv, read_probe_log, report, requeue_unanswered,
                         settings_and_risks)
from mgpu.errors import MgpuError
from mgpu.record.goodput import parse_slurm_time

__all__ = ["Doctor", "Interrupted", "Options"]

T = TypeVar("T")
PROBE = Path(__file__).resolve().with_name("doctor_probe.py")
COMMAND_S = 30.0
SIGNAL_WAIT_S = 120.0  # the preemptor submitted -> the victim's first signal
REQUEUE_WAIT_S = 240.0  # a requeued probe -> its next run (the hold is cred_expire+1: 121 s by default)
SETTLE_S = 3.0  # no heartbeat for this long: the victim was killed
POLL_S = 0.25
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: the doctor stops, after cancelling its jobs."""


@dataclasses.dataclass(frozen=True)
class Options:
    partition: str
    preemptor: str | None = None
    run_root: Path = Path("runs")
    nodes: int = 2
    timeout_s: float = 600.0
    account: str | None = None
    qos: str | None = None
    probes: tuple[str, ...] = ("preemption", "env")
    keep: bool = False


class Doctor:
    def __init__(self, opts: Options, python: str = sys.executable) -> None:
        self.opts, self.python = opts, python
        self.jobs: list[str] = []
        self.deadline = time.monotonic() + opts.timeout_s
        self.incomplete: list[str] = []
        self.stopping = False
        self.dir = Path()
        self._config_s: dict[str, int | None] = {}
        self._unconfirmed: list[str] = []  # job names whose sbatch did not return an id (interrupted)

    # ------------------------------------------------------------------------------------------- Slurm
    def _cmd(self, *cmd: str, timeout: float = COMMAND_S) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(list(cmd), 124, "", f"{cmd[0]} did not answer in {timeout:.0f} s")

    def job(self, job_id: str) -> dict[str, str]:
        proc = self._cmd("scontrol", "show", "job", "-o", job_id)
        return parse_kv(proc.stdout) if proc.returncode == 0 else {}

    def submit(self, kind: str, **kw: Any) -> str:
        o = self.opts
        # A name unique to this doctor (its pid): squeue shows what it is, and it can be cancelled by name.
        name = f"{JOB_PREFIX}-{kind}-{os.getpid()}"
        script = batch_script(kind, self.dir, self.python, PROBE, kw.pop("partition", o.partition),
                              account=o.account, qos=o.qos, tag=str(os.getpid()), **kw)
        path = self.dir / f"{kind}.sbatch"
        path.write_text(script)
        self._unconfirmed.append(name)  # until sbatch names the id: an interrupted sbatch may have queued it
        proc = self._cmd("sbatch", "--parsable", str(path))
        if proc.returncode != 0:
            why = " ".join((proc.stderr or proc.stdout).split()).replace("sbatch: error: ", "")
            raise MgpuError(f"sbatch refused the {kind} probe: {why or 'no reason given'} (check --partition, "
                            "--account, --qos)")
        job_id = proc.stdout.strip().split(";")[0]
        self.jobs.append(job_id)
        self._unconfirmed.remove(name)
        return job_id

    def cancel_all(self) -> None:
        """scancel every probe job, even while Ctrl-C is pressed again."""
        if not self.jobs and not self._unconfirmed:
            return
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if self.jobs:
                self._cmd("scancel", *self.jobs)
            for name in self._unconfirmed:  # unique to this doctor (its pid): nobody else's job
                self._cmd("scancel", f"--name={name}")
        finally:
            signal.signal(signal.SIGINT, previous)

    # ------------------------------------------------------------------------------------------- waiting
    def _remaining(self) -> float:
        return self.deadline - time.monotonic()

    def wait(self, predicate: Callable[[], T | None], limit_s: float) -> T | None:
        """Poll until `predicate` gives a value, for at most `limit_s` (and never past --timeout)."""
        end = time.monotonic() + min(limit_s, max(0.0, self._remaining()))
        while True:
            if self.stopping:
                raise Interrupted()
            value = predicate()
            if value is not None and value is not False:
                return value
            if time.monotonic() >= end:
                return None
            time.sleep(POLL_S)

    def _logs(self, mode: str) -> dict[tuple[int, int], list[dict[str, Any]]]:
        out = {}
        for path in self.dir.glob(f"{mode}-r*-t*.log"):
            restart, task = path.stem.split("-")[1:3]
            try:
                out[(int(restart[1:]), int(task[1:]))] = read_probe_log(path.read_text(errors="replace"))
            except (OSError, ValueError):
                continue
        return out

    def _first(self, mode: str, restart: int, event: str, tasks: int = 1) -> list[dict[str, Any]] | None:
        """The `event` records of every task's run `restart`, once all `tasks` wrote one."""
        logs = self._logs(mode)
        found = [next((r for r in logs.get((restart, t), []) if r["ev"] == event), None) for t in range(tasks)]
        return found if all(found) else None  # type: ignore[return-value]  # all(found): no None is left

    def _pending_why(self, job_id: str) -> str:
        info = self.job(job_id)
        return f"job {job_id} is {info.get('JobState', 'gone')} (Reason={info.get('Reason', '?')})"

    def _start(self, mode: str, job_id: str, tasks: int) -> list[dict[str, Any]] | None:
        started = self.wait(lambda: self._first(mode, 0, "start", tasks), self._remaining())
        if started is None:
            out = self.dir / f"{mode}.out"
            tail = out.read_text(errors="replace").strip().splitlines()[-1:] if out.exists() else []
            self.incomplete.append(f"{mode}: the probe did not start before --timeout: {self._pending_why(job_id)}"
                                   + (f"; its output: {tail[0]}" if tail else ""))
        return started

    def _back(self, mode: str, job_id: str) -> None:
        """Wait for run 1 of a requeued probe (it logs `start` and exits), unless the job is over for good."""
        def back_or_over() -> bool | None:
            if self._first(mode, 1, "start"):
                return True
            state = self.job(job_id).get("JobState", "COMPLETED")
            return False if state in FINAL else None

        if self.wait(back_or_over, REQUEUE_WAIT_S) is None:
            self.incomplete.append(f"{mode}: the requeued probe did not run again within {REQUEUE_WAIT_S:.0f} s: "
                                   f"{self._pending_why(job_id)}")

    def _gone(self, *job_ids: str) -> None:
        self._cmd("scancel", *job_ids)
        self.wait(lambda: all(self.job(j).get("JobState", "COMPLETED") in FINAL for j in job_ids), 30)

    # ------------------------------------------------------------------------------------------- probes
    def preflight(self) -> ClusterConfig:
        """Bad input (MgpuError) before anything is created or submitted."""
        o = self.opts
        for flag, value in (("--partition", o.partition), ("--preemptor-partition", o.preemptor),
                            ("--account", o.account), ("--qos", o.qos)):
            if value is not None:
                check_name(flag, value)
        missing = [c for c in ("sbatch", "scontrol", "scancel") if shutil.which(c) is None]
        if missing:
            raise MgpuError(f"{', '.join(missing)} not found on PATH: run the doctor where Slurm's client commands are "
                            "(a login node)")
        if o.preemptor == o.partition:
            raise MgpuError(f"--preemptor-partition {o.preemptor!r} is --partition itself: give a partition whose "
                            "jobs preempt those of --partition")
        partitions = {}
        for flag, name in (("--partition", o.partition), ("--preemptor-partition", o.preemptor)):
            if name is None:
                continue
            proc = self._cmd("scontrol", "show", "partition", "-o", name)
            if proc.returncode != 0 or not parse_kv(proc.stdout):
                why = " ".join((proc.stderr or proc.stdout).split()) or f"rc {proc.returncode}"
                raise MgpuError(f"{flag} {name!r}: {why} (sinfo -s lists the partitions)")
            partitions[name] = parse_kv(proc.stdout)
        part = partitions[o.partition]
        total = int(part.get("TotalNodes", "0") or 0)
        if "env" in o.probes and o.nodes > total:
            raise MgpuError(f"--nodes {o.nodes}: partition {o.partition!r} has {total} node(s); give --nodes {total}")
        if part.get("State", "UP") != "UP":
            raise MgpuError(f"--partition {o.partition!r} is {part.get('State')}: nothing would run there")
        root = o.run_root
        if root.exists() and not root.is_dir():
            raise MgpuError(f"--run-root {str(root)!r} is not a directory")
        if not root.exists() and not root.parent.is_dir():
            raise MgpuError(f"--run-root {str(root)!r}: no such directory, nor its parent")
        return ClusterConfig.read(parse_config(self._cmd("scontrol", "show", "config").stdout), part)

    def probe_preemption(self) -> PreemptionFacts:
        victim = self.submit("preempt")
        started = self._start("preempt", victim, 1)
        if started is None:
            return PreemptionFacts(False, "the probe job did not start")
        node = str(started[0].get("node") or started[0].get("host"))
        preemptor = self.submit("preemptor", partition=self.opts.preemptor, node=node)
        signalled = self.wait(lambda: self._first("preempt", 0, "signal"), SIGNAL_WAIT_S)
        if signalled is None:
            why = f"no signal within {SIGNAL_WAIT_S:.0f} s of the preemptor: {self._pending_why(preemptor)}"
            self._gone(victim, preemptor)
            return PreemptionFacts(False, why, node)
        beat_file = self.dir / "preempt-r0-t0.beat"

        def last_beat() -> float | None:
            try:
                return float(beat_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                return None

        def killed() -> float | None:  # no beat for SETTLE_S, and Slurm no longer runs that first run
            beat = last_beat()
            info = self.job(victim)
            over = info.get("JobState") != "RUNNING" or info.get("Restarts", "0") != "0"
            return beat if beat is not None and over and time.time() - beat > SETTLE_S else None

        cfg_wait = 60.0 + sum(self._config_s.get(k) or 0 for k in ("grace", "kill_wait"))
        beat = self.wait(killed, cfg_wait)
        if beat is None:
            self.incomplete.append(f"preemption: the probe was still alive {cfg_wait:.0f} s after its first signal")
        else:
            self._back("preempt", victim)
        logs = self._logs("preempt")
        self._gone(victim, preemptor)
        return analyze_preemption(logs.get((0, 0), []), last_beat(), logs.get((1, 0), []), node)

    def probe_env(self) -> EnvFacts:
        nodes = self.opts.nodes
        job_id = self.submit("env", nodes=nodes)
        started = self._start("env", job_id, nodes)
        end_time = parse_slurm_time(self.job(job_id).get("EndTime", "")) if started else None
        if started:
            # The user signal comes from a time-limit check every ~30 s: at most about a minute, then the limit.
            answered = self.wait(lambda: self._first("env", 0, "exit", nodes), 150)
            if answered is None:
                self.incomplete.append(f"env: no answer before the probe's time limit: {self._pending_why(job_id)}")
            elif any(r["ev"] == "requeue" and (r.get("rc") == 0 or requeue_unanswered(r.get("rc")))
                     for r in self._logs("env").get((0, 0), [])):
                self._back("env", job_id)
        logs = self._logs("env")
        self._gone(job_id)
        return analyze_env(logs, end_time)

    def run(self, cfg: ClusterConfig) -> tuple[list[str], dict[str, Any]]:
        """The report's lines and its facts (for --json), after `preflight`; cancels every probe job on the
        way out."""
        self._config_s = {"grace": cfg.grace_s, "kill_wait": cfg.kill_wait_s}
        o = self.opts
        self.dir = o.run_root / ".mgpu-doctor" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        try:
            self.dir.mkdir(parents=True)
        except OSError as error:
            raise MgpuError(f"--run-root {str(o.run_root)!r}: cannot create {self.dir}: {error.strerror}") from None
        pre = env = None
        try:
            if o.preemptor and "preemption" in o.probes:
                pre = self.probe_preemption()
            if "env" in o.probes:
                env = self.probe_env()
        finally:
            self.cancel_all()
            if not o.keep:
                shutil.rmtree(self.dir, ignore_errors=True)
                for parent in (self.dir.parent,):  # the .mgpu-doctor folder, when this run was its only one
                    try:
                        parent.rmdir()
                    except OSError:
                        pass
        lines = report(o.partition, cfg, pre, env, str(o.run_root), self.incomplete)
        settings, risks = settings_and_risks(cfg, pre, env)
        facts = {"partition": o.partition, "preemptor": o.preemptor, "configured": dataclasses.asdict(cfg),
                 "preemption": None if pre is None else dataclasses.asdict(pre),
                 "env": None if env is None else dataclasses.asdict(env), "settings": settings, "risks": risks,
                 "incomplete": list(self.incomplete), "jobs": list(self.jobs)}
        return lines, facts
