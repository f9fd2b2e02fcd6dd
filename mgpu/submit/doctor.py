"""The doctor's logic: the probe jobs' scripts, Slurm's answers and the probes' logs read back into facts,
and the report with the settings mgpu will use. Pure functions (no Slurm is called here, no torch);
mgpu/submit/doctor_run.py submits, waits and cancels; mgpu/submit/doctor_probe.py is what runs inside the jobs.

What the measurements rest on (docs/slurm-measurements.md): at a preemption a task gets the user signal
(USR2) only with `preempt_send_user_signal`, with SIGTERM at once when GraceTime is 0 and SIGTERM after
the grace otherwise (a partition without the user signal sends SIGTERM twice), then SIGKILL KillWait
later; `--signal=SIG@N` reaches the tasks up to about 60 s earlier than asked (Slurm checks time limits
every ~30 s); a requeued job is held cred_expire + 1 s before it may run again.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from mgpu.errors import MgpuError

__all__ = ["ClusterConfig", "EnvFacts", "PreemptionFacts", "analyze_env", "analyze_preemption", "batch_script",
           "check_name", "parse_config", "parse_kv", "read_probe_log", "report", "requeue_unanswered", "settings_and_risks"]

JOB_PREFIX = "mgpu-doctor"
TOGETHER_S = 1.0
"""Signals this close were sent together (Slurm sends USR2, CONT and TERM of a GraceTime-0 preemption in
the same few milliseconds)."""
SIGNAL_ASKED_S = 30
"""The probe's --signal lead: with --time=1 the first time-limit check (every ~30 s) may already send it."""
DEFAULT_LEAD_S = 120  # jobs/submit.py --signal-lead
SLOW_REQUEUE_S = 60.0
SLOW_FS_S = 1.0
_NAME = re.compile(r"[A-Za-z0-9_.+@:-]+")


def check_name(flag: str, value: str) -> str:
    """A partition, account or QOS name as Slurm writes it; MgpuError naming the flag otherwise."""
    if not _NAME.fullmatch(value or ""):
        raise MgpuError(f"{flag} {value!r}: not a Slurm name (letters, digits and _.+@:- only)")
    return value


# ----------------------------------------------------------------------------------------------- scripts
def batch_script(kind: str, probe_dir: Path, python: str, probe: Path, partition: str, nodes: int = 1,
                 node: str | None = None, account: str | None = None, qos: str | None = None,
                 tag: str = "") -> str:
    """The sbatch file of one probe job: `preempt` (the victim: a whole node, requeueable, signals logged),
    `preemptor` (a 1-CPU job on the victim's node in the higher partition) or `env` (--nodes tasks, a
    1-minute limit with --signal, a self-requeue). Its name is `mgpu-doctor-<kind>[-<tag>]`."""
    name = f"{JOB_PREFIX}-{kind}" + (f"-{tag}" if tag else "")
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --partition={partition}"]
    lines += [f"#SBATCH --account={account}"] if account else []
    lines += [f"#SBATCH --qos={qos}"] if qos else []
    run = [python, str(probe)]
    if kind == "preempt":
        lines += ["#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive", "#SBATCH --requeue",
                  f"#SBATCH --signal=USR2@{SIGNAL_ASKED_S}", "#SBATCH --time=5", "#SBATCH --open-mode=append",
                  f"#SBATCH --output={probe_dir / 'preempt.out'}",
                  "srun " + shlex.join([*run, "preempt", str(probe_dir), "--max-s", "280"])]
    elif kind == "preemptor":
        lines += ["#SBATCH --nodes=1", "#SBATCH --ntasks=1", f"#SBATCH --nodelist={node}", "#SBATCH --time=1",
                  f"#SBATCH --output={probe_dir / 'preemptor.out'}", "sleep 1"]
    elif kind == "env":
        lines += [f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1", "#SBATCH --requeue",
                  f"#SBATCH --signal=USR2@{SIGNAL_ASKED_S}", "#SBATCH --time=1", "#SBATCH --open-mode=append",
                  f"#SBATCH --output={probe_dir / 'env.out'}",
                  "srun " + shlex.join([*run, "env", str(probe_dir), "--max-s", "150"])]
    else:
        raise ValueError(kind)
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- parsers
def parse_kv(text: str) -> dict[str, str]:
    """`scontrol show job|partition -o`: `Key=Value Key=Value ...` (the first record)."""
    first = next((line for line in text.splitlines() if "=" in line), "")
    return dict(token.split("=", 1) for token in first.split() if "=" in token)


def parse_config(text: str) -> dict[str, str]:
    """`scontrol show config`: `Key = Value` lines."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = value.strip()
    return out


def read_probe_log(text: str) -> list[dict[str, Any]]:
    """A probe's JSON lines; a torn last line (a SIGKILL mid-write) and anything else malformed is left out."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("t"), (int, float)) and isinstance(record.get("ev"), str):
            records.append(record)
    return records


def _seconds(text: str | None) -> int | None:
    match = re.match(r"\s*(\d+)", text or "")
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class ClusterConfig:
    """What Slurm says it is configured to do (as opposed to what the probes measure)."""

    grace_s: int | None
    kill_wait_s: int | None
    preempt_mode: str
    user_signal: bool | None
    cred_expire_s: int | None
    job_requeue: str

    @classmethod
    def read(cls, config: Mapping[str, str], partition: Mapping[str, str]) -> "ClusterConfig":
        params = config.get("SlurmctldParameters")
        cred = re.search(r"cred_expire=(\d+)", config.get("AuthInfo", ""))
        mode = partition.get("PreemptMode") or config.get("PreemptMode", "?")
        return cls(_seconds(partition.get("GraceTime")), _seconds(config.get("KillWait")), mode,
                   None if params is None else "preempt_send_user_signal" in params,
                   int(cred.group(1)) if cred else None, config.get("JobRequeue", "?"))

    def line(self, partition: str) -> str:
        user = {True: "yes", False: "no", None: "?"}[self.user_signal]
        return (f"configured  GraceTime={'?' if self.grace_s is None else self.grace_s} ({partition}), "
                f"KillWait={'?' if self.kill_wait_s is None else self.kill_wait_s}, PreemptMode={self.preempt_mode}, "
                f"preempt_send_user_signal: {user}, JobRequeue={self.job_requeue}"
                + ("" if self.cred_expire_s is None else f", requeue hold cred_expire+1={self.cred_expire_s + 1} s"))


# ----------------------------------------------------------------------------------------------- preemption
@dataclass(frozen=True)
class PreemptionFacts:
    observed: bool
    why_not: str = ""
    node: str = ""
    signals: list[tuple[str, float]] = field(default_factory=list)
    """(signal, seconds after the first one), in order."""
    user_signal: str = "none"
    """before_term (a lead before SIGTERM), with_term (in the same instant), none."""
    user_signal_lead_s: float | None = None
    grace_s: float | None = None
    """First signal -> the SIGTERM that the kill followed."""
    kill_after_term_s: float | None = None
    requeued: bool | None = None
    back_after_s: float | None = None
    """The kill -> the job's next run started."""


def analyze_preemption(records: Sequence[Mapping[str, Any]], last_beat: float | None,
                       next_run: Sequence[Mapping[str, Any]] = (), node: str = "") -> PreemptionFacts:
    """The victim's first-run log, its last heartbeat and its next run's log -> what the preemption did."""
    signals = [(r["sig"], float(r["t"])) for r in records if r["ev"] == "signal" and isinstance(r.get("sig"), str)]
    if not signals:
        return PreemptionFacts(False, "the probe job received no signal", node)
    t0 = signals[0][1]
    usr2 = next((t for s, t in signals if s == "SIGUSR2"), None)
    terms = [t for s, t in signals if s == "SIGTERM"]
    if last_beat is not None:
        terms_before_kill = [t for t in terms if t <= last_beat + 0.2]
        terms = terms_before_kill or terms
    final_term = terms[-1] if terms else None
    if usr2 is None:
        user, lead = "none", None
    elif not terms or usr2 < terms[0] - TOGETHER_S:
        user, lead = "before_term", (terms[0] - usr2 if terms else None)
    else:
        user, lead = "with_term", 0.0
    kill = (last_beat - final_term) if last_beat is not None and final_term is not None and last_beat >= final_term \
        else None
    back = next((float(r["t"]) for r in next_run if r["ev"] == "start"), None)
    gone = last_beat if last_beat is not None else (final_term or t0)
    return PreemptionFacts(True, "", node, [(s, round(t - t0, 3)) for s, t in signals], user,
                           None if lead is None else round(lead, 2),
                           None if final_term is None else round(final_term - t0, 2),
                           None if kill is None else round(kill, 2), back is not None,
                           None if back is None else round(back - gone, 2))


# ----------------------------------------------------------------------------------------------- environment
@dataclass(frozen=True)
class EnvFacts:
    tasks: int
    nodes: list[str]
    scontrol: dict[str, str | None]
    """node -> scontrol's path in the job's environment (None: not on PATH)."""
    unresolved: list[str]
    """`on <node>: <host>: <error>` for each name a node could not resolve."""
    addresses: dict[str, list[str]]
    rendezvous: str | None
    """None: reached (or one node); else what failed."""
    shared_delay_s: float | None
    shared_error: str | None
    signal_lead_s: float | None
    """Seconds before the time limit the user signal arrived (None: it did not)."""
    signal_tasks: int
    term_first: bool
    """The time limit's SIGTERM came with no user signal before it."""
    requeue_rc: int | None
    requeue_message: str
    requeue_hold_s: float | None
    """The self-requeue -> the next run's start."""


def requeue_unanswered(rc: object) -> bool:
    """Whether `scontrol requeue`'s exit status leaves its outcome open: it died of a signal (a negative status).
    Slurm signals every process of the requeued job, scontrol among them even in a session of its own, and one that
    has sent the request but not yet exited dies of that TERM: the job's next run is the answer."""
    return isinstance(rc, int) and rc < 0


def analyze_env(logs: Mapping[tuple[int, int], Sequence[Mapping[str, Any]]], end_time: float | None) -> EnvFacts:
    """The env probe's logs, keyed by (restart, task), and the first run's EndTime -> facts."""
    first = {task: recs for (restart, task), recs in logs.items() if restart == 0}
    starts = {task: next((r for r in recs if r["ev"] == "start"), None) for task, recs in first.items()}
    node_of = {task: str((s or {}).get("node") or (s or {}).get("host") or f"task {task}")
               for task, s in starts.items()}
    scontrol = {node_of[t]: (s or {}).get("scontrol") for t, s in sorted(starts.items())}
    unresolved: list[str] = []
    addresses: dict[str, list[Any]] = {}
    for task, recs in sorted(first.items()):
        for r in recs:
            if r["ev"] != "resolve":
                continue
            if r.get("error"):
                unresolved.append(f"on {node_of[task]}: {r.get('host')}: {r['error']}")
            else:
                addresses.setdefault(str(r.get("host")), sorted(set(addresses.get(str(r.get("host")), [])) |
                                                               set(r.get("addrs") or [])))
    events = [(task, r) for task, recs in first.items() for r in recs]
    problems = [(f"listening on port {r.get('port')}" if r["ev"] == "listen" else
                 f"connecting to {r.get('host')}:{r.get('port')}") + f": {r['error']}"
                for _, r in events if r["ev"] in ("listen", "connect") and r.get("error")]
    listen = next((r for _, r in events if r["ev"] == "listen"), None)
    expected = len(first) - 1
    if not problems and listen is not None and listen.get("accepted", 0) < expected:
        problems.append(f"the first node accepted {listen.get('accepted')} of {expected} connections")
    rendezvous = "; ".join(problems) or (None if len(first) < 2 or listen else "no result")
    renamed = next((r for _, r in events if r["ev"] == "renamed"), None)
    seen = [r for _, r in events if r["ev"] == "seen"]
    shared_error = next((r["error"] for r in seen if r.get("error")), None)
    delays = [max(0.0, float(r["t"]) - float(r["written"])) for r in seen if not r.get("error") and "written" in r]
    if renamed is None and len(first) > 1 and shared_error is None:
        shared_error = "the first node wrote nothing (see the probe's output)"
    usr2 = {task: next((float(r["t"]) for r in recs if r["ev"] == "signal" and r.get("sig") == "SIGUSR2"), None)
            for task, recs in first.items()}
    term = {task: next((float(r["t"]) for r in recs if r["ev"] == "signal" and r.get("sig") == "SIGTERM"), None)
            for task, recs in first.items()}
    arrived = [t for t in usr2.values() if t is not None]
    lead = end_time - min(arrived) if arrived and end_time is not None else None
    term_first = any(t_term is not None and (usr2[t] is None or t_term < usr2[t])  # type: ignore[operator]  # usr2[t] is not None there
                     for t, t_term in term.items())
    requeue = next((r for _, r in events if r["ev"] == "requeue"), None)
    back = min((float(r["t"]) for (restart, _), recs in logs.items() if restart > 0 for r in recs
                if r["ev"] == "start"), default=None)
    rc = None if requeue is None else requeue.get("rc")
    if requeue_unanswered(rc) and back is not None:
        rc = 0  # scontrol died of the requeue's own signal, and the job ran again: the requeue worked
    hold = back - float(requeue["t"]) if back is not None and requeue is not None and rc == 0 else None
    return EnvFacts(len(first), [node_of[t] for t in sorted(first)], scontrol, unresolved, addresses, rendezvous,
                    max(delays) if delays else None, shared_error, None if lead is None else round(lead, 1),
                    len(arrived), term_first and not arrived,
                    rc,
                    "" if requeue is None else str(requeue.get("out") or requeue.get("error") or ""),
                    None if hold is None else round(hold, 1))


# ----------------------------------------------------------------------------------------------- report
def _pre_line(p: PreemptionFacts) -> str:
    if not p.observed:
        return f"preemption  not observed: {p.why_not}"
    if p.user_signal == "with_term":
        first = "the user signal (USR2) comes with SIGTERM, no earlier"
    elif p.user_signal == "before_term":
        first = f"the user signal (USR2) comes {p.user_signal_lead_s:.1f} s before SIGTERM"
    else:
        first = "no user signal: SIGTERM first" + (f", SIGTERM again {p.grace_s:.1f} s later" if p.grace_s else "")
    kill = f"; SIGKILL {p.kill_after_term_s:.1f} s after the last SIGTERM" if p.kill_after_term_s is not None else ""
    back = (f"; Slurm requeued it: running again {p.back_after_s:.1f} s after the kill" if p.requeued
            else "; not requeued by Slurm (still down when the doctor stopped waiting)")
    return f"preemption  on {p.node or '?'}: {first}{kill}{back}"


def settings_and_risks(cfg: ClusterConfig, pre: PreemptionFacts | None,
                       env: EnvFacts | None) -> tuple[list[str], list[str]]:
    """One line per setting mgpu will use on the partition, one per risk found."""
    settings: list[str] = []
    risks: list[str] = []
    if env is not None:
        if env.signal_lead_s is not None:
            settings.append(f"signal lead: --signal-lead {DEFAULT_LEAD_S} (the default) or more; Slurm sent it "
                            f"{env.signal_lead_s:.0f} s before the limit when asked for {SIGNAL_ASKED_S} s "
                            "(up to ~60 s early)")
        else:
            settings.append("signal lead: --signal does not reach the tasks; stops before the time limit rely on "
                            "SIGTERM alone")
            risks.append(f"--signal=USR2@N never reached the tasks (job_submit plugin? a launcher in between?): at the "
                         f"time limit the job gets only KillWait={cfg.kill_wait_s} s from SIGTERM to SIGKILL to save")
        if env.requeue_rc == 0:
            hold = f"; a requeued job was held {env.requeue_hold_s:.1f} s before it ran again" \
                if env.requeue_hold_s is not None else ""
            settings.append(f"self-requeue: yes (scontrol requeue from inside the job works){hold}")
            if env.requeue_hold_s is not None and env.requeue_hold_s > SLOW_REQUEUE_S:
                risks.append(f"every requeue costs {env.requeue_hold_s:.0f} s before the job can run again "
                             "(Slurm's requeue hold, cred_expire + 1 s): each time limit and preemption costs that")
        elif env.requeue_rc is not None or env.requeue_message:
            settings.append("self-requeue: no")
            why = env.requeue_message or f"rc {env.requeue_rc}"
            risks.append(f"scontrol requeue from inside the job failed ({why}"
                         "): after a time limit or a grace-period preemption the job stays down; resubmit it "
                         "(the same submit command resumes)")
        missing = [node for node, path in env.scontrol.items() if not path]
        if missing:
            risks.append(f"no scontrol in the job's environment on {', '.join(missing)}: mgpu cannot ask Slurm why it "
                         "stopped nor requeue itself; bind-mount Slurm's client commands into the container")
        if env.shared_error:
            risks.append(f"the run root is not shared between the nodes ({env.shared_error}): a job resumed "
                         "elsewhere does not find its checkpoint; put run.root on a shared filesystem")
        elif env.shared_delay_s is not None and env.shared_delay_s > SLOW_FS_S:
            risks.append(f"a renamed file took {env.shared_delay_s:.1f} s to appear on another node (attribute "
                         "caching): checkpoint pointers may be read stale for that long")
        if env.unresolved:
            risks.append(f"node names do not resolve ({'; '.join(env.unresolved)}): the rendezvous at the first "
                         "node's name fails; set MASTER_ADDR to an address every node can reach")
        elif env.rendezvous:
            risks.append(f"the nodes could not reach each other on mgpu's rendezvous port ({env.rendezvous}): "
                         "check the firewall between compute nodes")
    if pre is not None and pre.observed:
        kill = pre.kill_after_term_s if pre.kill_after_term_s is not None else cfg.kill_wait_s
        if pre.user_signal == "before_term":
            settings.append(f"preemption: mgpu stops on USR2 and requeues itself, {pre.user_signal_lead_s:.0f} s "
                            f"before SIGTERM and {kill:.0f} s more before SIGKILL")
        elif pre.grace_s and pre.grace_s > TOGETHER_S:
            settings.append(f"preemption: mgpu stops on the first SIGTERM and requeues itself within the grace "
                            f"(SIGTERM again after {pre.grace_s:.0f} s, SIGKILL {kill:.0f} s later)")
        else:
            settings.append(f"preemption: GraceTime 0: mgpu stops on SIGTERM and Slurm requeues the job; the stop's "
                            f"checkpoint has {kill:.0f} s until SIGKILL")
            risks.append(f"a preemption leaves {kill:.0f} s from SIGTERM to SIGKILL: a stop's checkpoint that takes "
                         "longer is lost and the steps since the previous one are trained again")
        if not pre.requeued:
            risks.append("a preempted probe job did not come back within the wait: PreemptMode "
                         f"{cfg.preempt_mode} may cancel preempted jobs; they would need resubmitting")
    elif pre is None:
        settings.append("preemption: not measured (give --preemptor-partition, a partition that preempts this one)")
    else:
        settings.append("preemption: not measured (the probe job was not preempted)")
        risks.append(f"no preemption happened ({pre.why_not}): the preemptor partition may not preempt this one")
    return settings, risks


def report(partition: str, cfg: ClusterConfig, pre: PreemptionFacts | None, env: EnvFacts | None,
           run_root: str, incomplete: Sequence[str] = ()) -> list[str]:
    """The doctor's report: configured, measured, then the settings and the risks, one line each."""
    lines = [cfg.line(partition)]
    if pre is not None:
        lines.append(_pre_line(pre))
    if env is not None:
        if env.signal_lead_s is not None:
            lines.append(f"--signal    USR2 reached {env.signal_tasks} of {env.tasks} task(s) "
                         f"{env.signal_lead_s:.0f} s "
                         f"before the time limit (asked: {SIGNAL_ASKED_S} s)")
        else:
            lines.append("--signal    USR2 never reached the tasks" + (" (SIGTERM at the time limit came first)"
                                                                       if env.term_first else ""))
        if env.requeue_rc is not None or env.requeue_message:
            ok = env.requeue_rc == 0
            lines.append(f"requeue     scontrol requeue from inside the job: {'allowed' if ok else 'refused'}"
                         + (f" ({env.requeue_message})" if env.requeue_message and not ok else "")
                         + (f"; back {env.requeue_hold_s:.1f} s later" if env.requeue_hold_s is not None else ""))
        paths = sorted({str(p) for p in env.scontrol.values()})
        per_node = ", ".join(f"{node}: {path or 'missing'}" for node, path in env.scontrol.items())
        lines.append("scontrol    in the job: " + (per_node if len(paths) > 1 or None in env.scontrol.values()
                                                  else paths[0] if paths else "unknown (no probe started)"))
        if env.tasks > 1:
            shared = (f"not shared: {env.shared_error}" if env.shared_error else
                      f"an fsync'd rename on {env.nodes[0]} seen on {', '.join(env.nodes[1:])} after "
                      f"{env.shared_delay_s:.2f} s")
            lines.append(f"shared fs   {run_root}: {shared}")
            names = ", ".join(f"{h} -> {', '.join(a)}" for h, a in sorted(env.addresses.items()))
            lines.append("nodes       " + (f"unresolved: {'; '.join(env.unresolved)}" if env.unresolved else
                                           f"resolve on every node ({names})")
                         + ("; rendezvous port reached" if env.rendezvous is None else f"; {env.rendezvous}"))
        else:
            lines.append("shared fs   not checked (one node: --nodes 2 checks the run root and the names)")
    for what in incomplete:
        lines.append(f"incomplete  {what}")
    settings, risks = settings_and_risks(cfg, pre, env)
    lines.append(f"settings mgpu will use on {partition}:")
    lines += [f"  {s}" for s in settings]
    lines.append("risks:" if risks else "risks: none found")
    lines += [f"  - {r}" for r in risks]
    return lines
