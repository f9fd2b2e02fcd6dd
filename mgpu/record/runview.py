"""The run's read model: what a run's ledger says (state, step, epoch, logged metrics, throughput, ETA,
evaluations, hangs, excluded nodes, budgets, where the time went), for the trainer's runs and loops of their
own alike, for `jobs/status.py`, `jobs/submit.py --wait` and anyone who asks from Python. No torch.

`RunView.load(run)` reads the ledger once (its malformed lines counted, not raised); every path comes from
mgpu.record.rundir.RunDir; Slurm is asked through mgpu.cluster.slurm's client. A value the ledger holds that no clock can
show (a `time` of 1e308) is one line (`MgpuError`), never a traceback.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mgpu.errors import MgpuError
from mgpu.record.exclusion import node_lines
from mgpu.record.failures import merge, read_failures
from mgpu.record.goodput import SACCT_FIELDS, SacctRun, duration, goodput, goodput_lines, parse_sacct
from mgpu.record.ledger import read_ledger
from mgpu.record.budgets import Limits, failure_requeues
from mgpu.record.restarts import phase_totals, restart_lines, restarts
from mgpu.record.rundir import RunDir
from mgpu.record.stragglers import attempt_stragglers, straggler_line, summary_line
from mgpu.record.timeouts import ladder_lines, newest_ladder
from mgpu.cluster.slurm import client, is_alive

__all__ = ["LIVE_S", "RunView", "budgets", "describe", "failure_cause", "hang_line", "is_run_dir", "job_limits",
           "progress_line", "sacct_runs", "scheduler_state", "summarize", "verify"]

SLURM_ID = re.compile(r"\d+(_\d+)?\Z")  # \Z, not $: "123\n" is no job id
_EXPORT = re.compile(r"^export (MGPU_MAX_REQUEUES|MGPU_MAX_FAILURES)=(\S*)\s*(?:#.*)?$", re.M)
LIVE_S = 900
_RATES = ("samples_per_s", "tokens_per_s", "step_time_s")  # the trainer's throughput: its own line
_SLURM_ID = SLURM_ID


@dataclass
class RunView:
    """One run directory and its ledger, read once."""

    run: RunDir
    events: list[dict[str, Any]]
    skipped: list[int] = field(default_factory=list)
    """1-based numbers of the ledger's malformed lines (left out of `events`)."""

    @classmethod
    def load(cls, run: RunDir | Path) -> "RunView":
        run = run if isinstance(run, RunDir) else RunDir(Path(run))
        skipped: list[int] = []
        events = read_ledger(run.ledger, skipped)
        return cls(run, merge(events, read_failures(run.path)), skipped)  # the ranks' own failures (mgpu.record.failures)


def is_run_dir(path: Path) -> bool:
    """A directory mgpu made for a run: its ledger, config, logs or checkpoints are there (a run submitted but
    not started yet has its config)."""
    run = RunDir(path)
    return path.is_dir() and any(p.exists() for p in (run.ledger, run.config, run.logs, run.checkpoints))


def local_time(when: Any) -> str:
    """A ledger time as the local `YYYY-MM-DDTHH:MM:SS` (MgpuError for one no clock can show)."""
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(float(when)))
    except (OverflowError, ValueError, OSError, TypeError):
        raise MgpuError(f"the ledger holds a time no clock can show ({when!r}): is events.jsonl a run's ledger?") \
            from None


def failure_cause(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest attempt's failure as its cause: the first `failed` event of that attempt that is a rank's own
    error (not `consequence`: another rank's gloo `Connection closed by peer`), else its first."""
    failed = [e for e in events if e.get("event") == "failed"]
    if not failed:
        return None
    last = failed[-1]
    same = [e for e in failed if e.get("job_id") == last.get("job_id") and e.get("restart") == last.get("restart")
            and last["time"] - e["time"] < 600]
    return next((e for e in same if not e.get("consequence")), same[0] if same else last)


def _int(value: Any) -> int:
    """A ledger field read as a count: 0 for anything that is not an int (a malformed line)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _metrics(metrics: Any, limit: int = 3) -> str:
    """`accuracy 0.812, loss 0.583`: the first few numeric metrics, 4 significant digits."""
    if not isinstance(metrics, dict):
        return ""
    shown = [f"{k} {v:.4g}" for k, v in metrics.items() if _num(v) is not None][:limit]
    return ", ".join(shown)


def summarize(events: list[dict[str, Any]], now: float | None = None) -> dict[str, Any]:
    """The facts status and `submit.py --wait` show, from the ledger's events (oldest first)."""
    now = time.time() if now is None else now
    if not events:
        return {"state": "not started", "events": 0}
    last = events[-1]
    restart = max(_int(e.get("restart")) for e in events)
    summary: dict[str, Any] = {
        "events": len(events), "job_id": last.get("job_id"), "restart": restart,
        "requeues": sum(e["event"] == "requeued" for e in events),
        "last_event": last["event"], "last_event_age_s": now - last["time"],
        "launcher": next((e.get("launcher") for e in reversed(events) if e["event"] == "started"), None),
    }
    state = "running"
    down: dict[str, Any] | None = None  # a stop's decision that the job stays down (not requeued)
    unanswered: dict[str, Any] | None = None  # a stop's requeue that Slurm did not answer (or refused)
    awaiting: dict[str, Any] | None = None  # the job waits, alive, for Slurm to answer or end it (mgpu.run.unanswered)
    decided = False  # the newest stop decision seen (mgpu.run.recovery's, asked again, supersedes rank 0's)
    for event in reversed(events):
        name = event["event"]
        if name == "stop_decision":
            if not decided and event.get("requeue") is False:
                down = event
            decided = True
            continue
        if name in ("requeue_unknown", "requeue_refused"):
            unanswered = unanswered or (None if decided else event)
            continue
        if name == "awaiting_slurm":
            awaiting = awaiting or (None if decided else event)
            continue
        if name == "finished":
            status = event.get("status")
            state = "finished" if status in (None, "finished") else f"finished ({status})"
        elif name == "failed":
            cause = failure_cause(events) or event
            rank = f" (rank {cause['rank']})" if isinstance(cause.get("rank"), int) and cause.get("rank") else ""
            state = f"failed{rank}: {cause.get('error', '?')}"
        elif name == "preempted":
            if awaiting is not None:
                try:
                    until = awaiting.get("until")  # a ledger value: a bad one is the except's "?"
                    when = time.strftime("%H:%M:%S", time.localtime(float(until)))  # type: ignore[arg-type]  # Any from JSON
                except (TypeError, ValueError, OverflowError, OSError):
                    when = "?"
                state = f"stopped, waiting for Slurm to answer or end the job (until {when}): {awaiting.get('unknown')}"
            elif down is not None and down.get("unknown"):
                state = f"stopped, Slurm gave no answer: {down.get('reason') or '?'}"
            elif down is not None:
                state = f"stopped, stays down: {down.get('reason') or down.get('what') or '?'}"
            elif unanswered is not None:
                said = "got no answer" if unanswered["event"] == "requeue_unknown" else "was refused"
                state = f"stopped, the requeue {said}: {unanswered.get('error') or '?'}"
            else:
                state = "stopped by a signal (requeue pending)"
        elif name not in ("started", "resumed"):
            continue
        break
    summary["state"] = state
    stepped = [e for e in events if isinstance(e.get("step"), int)]
    # The current segment (since the newest start): its highest step is where training is; a background
    # save or an evaluation may be written after a newer progress event.
    begin = max((i for i, e in enumerate(events) if e["event"] == "started"), default=0)
    current_steps = [e["step"] for e in events[begin:] if isinstance(e.get("step"), int)]
    if stepped:
        summary["step"] = max(current_steps) if current_steps else stepped[-1]["step"]
        summary["epoch"] = next((e["epoch"] for e in reversed(stepped) if "epoch" in e), None)
    saves = [e for e in events if e["event"] == "checkpoint_saved"]
    if saves:
        summary["checkpoint"] = {"step": saves[-1].get("step"), "age_s": now - saves[-1]["time"],
                                 "reason": saves[-1].get("reason"), "path": saves[-1].get("path")}
    heartbeat = next((e for e in reversed(events[begin:]) if e["event"] == "progress"), None)
    if heartbeat is not None and isinstance(heartbeat.get("metrics"), dict):
        m = heartbeat["metrics"]
        summary["heartbeat"] = {"step": heartbeat.get("step"), "age_s": now - heartbeat["time"],
                                **{k: m[k] for k in ("samples_per_s", "tokens_per_s", "step_time_s", "loss")
                                   if _num(m.get(k)) is not None}}
        # What the loop logged (the trainer's loss, lr, grad_norm; a loop of one's own: what it gave session.log).
        logged = {k: v for k, v in m.items() if k not in _RATES and _num(v) is not None}
        if logged:
            summary["metrics"] = {"step": heartbeat.get("step"), "metrics": logged}
    # Throughput over the current run (since the last start/resume): steps between two ledger events.
    current = [e for e in events if _int(e.get("restart")) == restart]
    start = next((e for e in reversed(current) if e["event"] in ("started", "resumed")), None)
    if start is not None and stepped:
        begin_step = _int(start.get("step")) if start["event"] == "resumed" else 0
        end = stepped[-1]
        if end["time"] > start["time"] and end["step"] > begin_step:
            summary["steps_per_s"] = (end["step"] - begin_step) / (end["time"] - start["time"])
            summary["throughput_window_s"] = end["time"] - start["time"]
    step_time = summary.get("heartbeat", {}).get("step_time_s")
    if step_time:
        summary["steps_per_s"] = 1.0 / step_time  # the trainer's own measure, evaluations and saves left out
    totals = [e["total_steps"] for e in events if isinstance(e.get("total_steps"), int)]
    if totals and "step" in summary:
        summary["total_steps"] = totals[-1]
        if state == "running" and step_time and totals[-1] >= summary["step"]:
            summary["eta_s"] = (totals[-1] - summary["step"]) * step_time
    evals = [e for e in events if e["event"] == "evaluated" and isinstance(e.get("metrics"), dict)]
    if evals:
        summary["last_eval"] = {"step": evals[-1].get("step"), "metrics": evals[-1]["metrics"]}
        best = [e for e in evals if e.get("best") is True]
        if best:
            summary["best_eval"] = {"step": best[-1].get("step"), "metrics": best[-1]["metrics"]}
    if (ranks := next((e["ranks"] for e in reversed(events[begin:]) if e["event"] == "progress"
                       and isinstance(e.get("ranks"), dict)), None)) is not None:
        summary["ranks"] = ranks
    if (ladder := newest_ladder(events[begin:])) is not None:
        summary["ladder"] = ladder  # the timeout ladder: the first step's, else the start's
    if named := attempt_stragglers(events[begin:]):
        summary["stragglers"] = named
    hangs = [e for e in events if e["event"] == "hang"]
    if hangs:
        summary["hangs"] = {"count": len(hangs), "last": hangs[-1]}
    excluded = [e for e in events if e["event"] == "node_excluded"]
    if excluded:
        nodes = excluded[-1].get("excluded")
        summary["excluded"] = nodes if isinstance(nodes, list) else [excluded[-1].get("node")]
    return summary


def hang_line(hang: dict[str, Any]) -> str:
    """Who held the others up, where, and in which phase, from a `hang` event."""
    ranks, hosts = (value if isinstance(value, list) else [] for value in (hang.get("ranks"), hang.get("hosts")))
    found = hang.get("phases")
    phases: dict[str, Any] = found if isinstance(found, dict) else {}
    who = (f"rank(s) {', '.join(map(str, ranks))} on {', '.join(map(str, hosts)) or '?'}" if ranks
           else "no rank identified")
    found_steps = hang.get("steps")
    steps: dict[str, Any] = found_steps if isinstance(found_steps, dict) else {}
    # Each late rank's phase and the last step it completed (a heartbeat's step is the one in progress).
    where = ", ".join(f"{phases[str(r)]}" + (f" (its last step {steps[str(r)] - 1})" if isinstance(
        steps.get(str(r)), int) and steps[str(r)] - 1 != hang.get("step") else "") for r in ranks if str(r) in phases)
    return (f"after step {hang.get('step')}: {who}" + (f" in {where}" if where else "")
            + (f", found after {hang['waited_s']} s" if isinstance(hang.get("waited_s"), (int, float)) else ""))


def progress_line(summary: dict[str, Any]) -> str:
    """One line: state, step, throughput, ETA, evaluation, restarts. Nothing in it changes unless the ledger
    does (no ages): `submit.py --wait` prints it again only when it differs."""
    parts = [summary["state"]]
    if "step" in summary:
        total = f"/{summary['total_steps']}" if "total_steps" in summary else ""
        parts.append(f"step {summary['step']}{total}")
    beat = summary.get("heartbeat", {})
    if "samples_per_s" in beat:
        parts.append(f"{beat['samples_per_s']:.4g} samples/s")
    elif "steps_per_s" in summary:
        parts.append(f"{summary['steps_per_s']:.3g} steps/s")
    if "eta_s" in summary:
        parts.append(f"ETA {duration(summary['eta_s'])}")
    if "checkpoint" in summary:
        parts.append(f"checkpoint step {summary['checkpoint']['step']}")
    if "last_eval" in summary:
        parts.append(f"eval {_metrics(summary['last_eval']['metrics'], 1)}")
    if summary.get("restart"):
        parts.append(f"restart {summary['restart']}")
    return ", ".join(parts)


def scheduler_state(job_id: str) -> str | None:
    """Slurm's state of the job (squeue while queued or running, then sacct), or None if unknown."""
    if not _SLURM_ID.match(job_id):
        return None
    return client().state(job_id)


def job_limits(script: str) -> Limits | None:
    """The requeue limits a batch script exports (jobs/submit.py's setup lines); None if it sets neither."""
    found = dict(_EXPORT.findall(script))
    if not found:
        return None
    try:
        return Limits.from_environ({k: v.strip("'\"") for k, v in found.items()})
    except MgpuError:
        return None


def _recorded_limits(record: dict[str, Any]) -> Limits | None:
    """The limits a `started` event recorded (None if they do not read as limits)."""
    try:
        return Limits(max_failures=int(record["max_failures"]),
                      max_requeues=None if record.get("max_requeues") is None else int(record["max_requeues"]))
    except (KeyError, TypeError, ValueError):
        return None


def budgets(events: list[dict[str, Any]], job_id: str, restart: int, limits: Limits | None) -> str:
    """The job's requeue budgets as mgpu.train.job counts them: stop requeues are Slurm's restarts less the
    failure requeues the ledger counts; failure requeues per job."""
    failures = failure_requeues(events, job_id)
    stops = max(0, restart - failures)
    shown = limits or Limits()
    stop_text = (f"{stops} used, no limit" if shown.max_requeues is None
                 else f"{stops} of {shown.max_requeues} used, {max(0, shown.max_requeues - stops)} left")
    fail_text = f"{failures} of {shown.max_failures} used, {max(0, shown.max_failures - failures)} left"
    source = "" if limits is not None else " (the defaults: the job's own limits are not known here)"
    return f"requeues after stops {stop_text}; after failures {fail_text}{source}"


def sacct_runs(events: list[dict[str, Any]]) -> tuple[list[SacctRun], bool]:
    """sacct's runs of the ledger's Slurm jobs, and whether sacct answered."""
    ids = sorted({str(e.get("job_id")) for e in events if _SLURM_ID.match(str(e.get("job_id"))) is not None})
    if not ids:
        return [], False
    since = local_time(events[0]["time"] - 7 * 86400)
    out = client().sacct(ids, SACCT_FIELDS, since=since, duplicates=True)
    return (parse_sacct(out), True) if out is not None else ([], False)


_LONG_PHASE = re.compile(r"^\d\d:\d\d:\d\d \[rank \d+\] INFO (rank \d+: in .+ for \d+ s .*)$")
LONG_PHASE_FRESH_S = 90.0
"""A rank's progress line of a long phase (mgpu.stop.phase_progress: one every 30 s) shows in `status` while its
log was written this recently and the line is its last: the phase is still going on."""


def long_phases(logs: Path, now: float, tail_bytes: int = 4096, limit: int = 4) -> list[str]:
    """The ranks still in a long resume, save or rendezvous, as their logs last said (at most `limit`: the
    first ranks by number; the others' are in their logs)."""
    found = []
    try:
        candidates = sorted(logs.glob("rank*.log"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0))
    except OSError:
        return []
    for log_path in candidates:
        try:
            if now - log_path.stat().st_mtime > LONG_PHASE_FRESH_S:
                continue
            with open(log_path, "rb") as file:
                size = file.seek(0, 2)
                file.seek(max(0, size - tail_bytes))
                last = file.read().decode("utf-8", "replace").rstrip("\n").rsplit("\n", 1)[-1]
        except OSError:
            continue
        matched = _LONG_PHASE.match(last)
        if matched:
            found.append(matched[1])
            if len(found) == limit:
                break
    return found


def describe(run: RunView | RunDir | Path, now: float | None = None) -> list[str]:
    """The lines `status.py` prints for one run directory (its ledger read once: pass a RunView)."""
    view = run if isinstance(run, RunView) else RunView.load(run)
    events, run_dir = view.events, view.run.path
    now = time.time() if now is None else now
    summary = summarize(events, now)
    lines = [f"run         {run_dir}"]
    job_id = summary.get("job_id") or run_dir.name.rsplit("-", 1)[-1]
    # A Slurm job id (torchrun inside srun has one too); submitit's local executor numbers its jobs alike.
    slurm = summary.get("launcher") != "submitit-local" and _SLURM_ID.match(str(job_id)) is not None
    sched = scheduler_state(str(job_id)) if slurm else None
    lines.append(f"job         {job_id}" + (f" (slurm: {sched})" if sched else ""))
    lines.append(f"state       {summary['state']}")
    if not summary["events"]:
        return lines
    if "step" in summary:
        total = f" of {summary['total_steps']}" if "total_steps" in summary else ""
        epoch = f", epoch {summary['epoch']}" if summary.get("epoch") is not None else ""
        beat = summary.get("heartbeat")
        seen = f"; logged {duration(beat['age_s'])} ago" if beat else ""
        lines.append(f"progress    step {summary['step']}{total}{epoch}{seen}")
    if "metrics" in summary:
        lines.append(f"metrics     step {summary['metrics']['step']}: {_metrics(summary['metrics']['metrics'], 4)}")
    # A loop of one's own does not say how many steps it will take: no ETA rather than a made-up one.
    no_eta = ("; no ETA: the run logs no total step count (a loop of its own)"
              if summary["state"] == "running" and "total_steps" not in summary else "")
    beat = summary.get("heartbeat", {})
    if "step_time_s" in beat:
        rate = ", ".join(f"{beat[k]:.4g} {unit}" for k, unit in (("samples_per_s", "samples/s"),
                                                                  ("tokens_per_s", "tokens/s")) if k in beat)
        eta = f"; ETA {duration(summary['eta_s'])} at this rate" if "eta_s" in summary else ""
        lines.append(f"throughput  {rate + ', ' if rate else ''}{beat['step_time_s']:.3g} s/step{eta or no_eta}")
    elif "steps_per_s" in summary:
        lines.append(f"throughput  {summary['steps_per_s']:.3g} steps/s over {duration(summary['throughput_window_s'])}"
                     f"{no_eta}")
    if "last_eval" in summary:
        last, best = summary["last_eval"], summary.get("best_eval")
        text = f"step {last['step']}: {_metrics(last['metrics'])}"
        if best is not None:
            same = best["step"] == last["step"]
            text += "  (best)" if same else f"; best step {best['step']}: {_metrics(best['metrics'])}"
        lines.append(f"evaluation  {text}")
    if "checkpoint" in summary:
        ckpt = summary["checkpoint"]
        lines.append(f"checkpoint  step {ckpt['step']}, {duration(ckpt['age_s'])} ago ({ckpt['reason']})")
    else:
        lines.append("checkpoint  none yet")
    lines.append(f"requeues    {summary['restart']} restart(s), {summary['requeues']} requeue event(s)")
    if slurm:
        # The limits the job's ranks read (their `started` event); else its batch script, kept while it is alive.
        recorded = [e["limits"] for e in events if e.get("event") == "started" and str(e.get("job_id")) == str(job_id)
                    and isinstance(e.get("limits"), dict)]
        limits = _recorded_limits(recorded[-1]) if recorded else None
        if limits is None:
            script = client().batch_script(str(job_id)) if is_alive(sched) else None
            limits = job_limits(script) if script else None
        lines.append(f"budgets     {budgets(events, str(job_id), summary['restart'], limits)}")
    if "ranks" in summary and (timing := summary_line(summary["ranks"])) is not None:
        lines.append(f"ranks       {timing}")
    for event in summary.get("stragglers", []):
        lines.append(f"straggler   {straggler_line(event)}")
    if "hangs" in summary:
        lines.append(f"hangs       {summary['hangs']['count']}; last {hang_line(summary['hangs']['last'])}")
    if "excluded" in summary:
        lines.append(f"excluded    {', '.join(map(str, summary['excluded']))} (nodes a hang was pinned on)")
    lines.extend(node_lines(events, now))
    if "ladder" in summary:
        lines.extend(ladder_lines(summary["ladder"]))
    lines.append(f"last event  {summary['last_event']}, {duration(summary['last_event_age_s'])} ago")
    runs, sacct_known = sacct_runs(events) if slurm else ([], False)
    # A running segment counts until now; without Slurm's word, only while the ledger is recent (a killed
    # local run also looks "running").
    live = sched in ("RUNNING", "COMPLETING") or (sched is None and summary["state"] == "running"
                                                  and summary["last_event_age_s"] < LIVE_S)
    if live:
        lines.extend(f"long phase  {line}" for line in long_phases(view.run.logs, now))
    found = restarts(events)
    lines.extend(restart_lines(found))
    lines.extend(goodput_lines(goodput(events, runs, now if live else None), sacct_known, phase_totals(found)))
    return lines


def verify(dir_a: Path, dir_b: Path) -> tuple[int, str]:
    """(exit code, line): whether two runs had the same weights at every step both logged."""
    from mgpu.record.goodput import compare_fingerprints, fingerprints

    prints = []
    for run_dir in (dir_a, dir_b):
        found = fingerprints(RunView.load(run_dir).events)
        if not found:
            raise MgpuError(f"{run_dir}: no fingerprints in its ledger (the trainer writes one with every progress "
                            "event, every log.every_steps; a loop of one's own with session.log(...), its models "
                            "in the state it loads): nothing to compare")
        prints.append(found)
    verdict = compare_fingerprints(*prints)
    if not verdict.common:
        raise MgpuError(f"{dir_a} and {dir_b} logged no step in common (steps {min(prints[0])}..{max(prints[0])} and "
                        f"{min(prints[1])}..{max(prints[1])}): give both runs the same log.every_steps")
    if not verdict.agree:
        before = verdict.common.index(verdict.first_difference)  # type: ignore[arg-type]  # set whenever not agree
        return 1, (f"differ: first at step {verdict.first_difference} ({dir_a}: {verdict.a}, {dir_b}: {verdict.b}); "
                   f"they agree at the {before} logged step(s) before it")
    last_a, last_b = max(prints[0]), max(prints[1])
    tail = "" if last_a == last_b else (f"; {dir_b if last_b < last_a else dir_a} logged up to step "
                                        f"{min(last_a, last_b)} only")
    return 0, (f"agree: the same weights at all {len(verdict.common)} steps both runs logged "
               f"({verdict.common[0]}..{verdict.common[-1]}){tail}")
