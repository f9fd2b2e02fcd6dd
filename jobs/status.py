"""Show a run's state: `python jobs/status.py RUN_DIR_OR_JOB_ID [--folder runs]`.

    python jobs/status.py runs/mnist-12345     # a run directory
    python jobs/status.py 12345                # a Slurm job id: the runs under runs/ that job trained
                                               # (an array id: every task's run)

Reads `<run dir>/events.jsonl` (see mgpu/ledger.py) and asks squeue/sacct where they exist; ledger
lines that are not well-formed events are skipped with a note on stderr.
Exit codes: 0 shown, 2 no such run (or bad arguments, or an unreadable ledger).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mgpu.config import control_problem  # noqa: E402
from mgpu.errors import MgpuError, exit_with  # noqa: E402
from mgpu.ledger import read_ledger  # noqa: E402

__all__ = ["describe", "find_run_dirs", "progress_line", "scheduler_state", "summarize"]

_SLURM_ID = re.compile(r"\d+(_\d+)?\Z")  # \Z, not $: "123\n" is no job id
PROG = "status"


def _job_ids(run_dir: Path) -> set[str]:
    return {str(e.get("job_id")) for e in read_ledger(run_dir / "events.jsonl") if e.get("job_id")}


def find_run_dirs(arg: str, folder: str | Path = "runs") -> list[Path]:
    """A run directory as given, else the run directories under `folder` whose ledger names job `arg`
    (for an array id: every task's, in task order)."""
    path = Path(arg)
    if path.is_dir():
        return [path]
    root = Path(folder)
    found: list[tuple[int, Path]] = []
    if _SLURM_ID.match(arg) and root.is_dir():
        for run_dir in sorted(p for p in root.iterdir() if p.is_dir()):
            # Runs made before run directories dropped the job id carry it in their name: <name>-<job id>.
            legacy = run_dir.name.rsplit("-", 1)[-1] if "-" in run_dir.name else ""
            ids = _job_ids(run_dir) | ({legacy} if _SLURM_ID.match(legacy) else set())
            tasks = [int(i.rsplit("_", 1)[1]) for i in ids if "_" not in arg and i.startswith(f"{arg}_")]
            if arg in ids or tasks:
                found.append((min(tasks) if tasks and arg not in ids else -1, run_dir))
    if not found:
        raise MgpuError(f"{arg!r}: neither a run directory nor a Slurm job id found in the ledgers under {root} "
                        f"(pass --folder, the root the job was submitted with)")
    return [run_dir for _, run_dir in sorted(found, key=lambda item: (item[0], str(item[1])))]


def _int(value: Any) -> int:
    """A ledger field read as a count: 0 for anything that is not an int (a malformed line)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


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
    for event in reversed(events):
        name = event["event"]
        if name == "finished":
            status = event.get("status")
            state = "finished" if status in (None, "finished") else f"finished ({status})"
        elif name == "failed":
            state = f"failed: {event.get('error', '?')}"
        elif name == "preempted":
            state = "stopped by a signal (requeue pending)"
        elif name not in ("started", "resumed"):
            continue
        break
    summary["state"] = state
    stepped = [e for e in events if isinstance(e.get("step"), int)]
    if stepped:
        summary["step"] = stepped[-1]["step"]
        summary["epoch"] = next((e["epoch"] for e in reversed(stepped) if "epoch" in e), None)
    saves = [e for e in events if e["event"] == "checkpoint_saved"]
    if saves:
        summary["checkpoint"] = {"step": saves[-1].get("step"), "age_s": now - saves[-1]["time"],
                                 "reason": saves[-1].get("reason"), "path": saves[-1].get("path")}
    # Throughput over the current run (since the last start/resume): steps between two ledger events.
    current = [e for e in events if _int(e.get("restart")) == restart]
    start = next((e for e in reversed(current) if e["event"] in ("started", "resumed")), None)
    if start is not None and stepped:
        begin_step = _int(start.get("step")) if start["event"] == "resumed" else 0
        end = stepped[-1]
        if end["time"] > start["time"] and end["step"] > begin_step:
            summary["steps_per_s"] = (end["step"] - begin_step) / (end["time"] - start["time"])
            summary["throughput_window_s"] = end["time"] - start["time"]
    totals = [e["total_steps"] for e in events if isinstance(e.get("total_steps"), int)]
    if totals and "step" in summary:
        summary["total_steps"] = totals[-1]
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
    phases = hang.get("phases") if isinstance(hang.get("phases"), dict) else {}
    who = (f"rank(s) {', '.join(map(str, ranks))} on {', '.join(map(str, hosts)) or '?'}" if ranks
           else "no rank identified")
    where = ", ".join(f"{phases[str(r)]}" for r in ranks if str(r) in phases)
    return (f"after step {hang.get('step')}: {who}" + (f" in {where}" if where else "")
            + (f", found after {hang['waited_s']} s" if isinstance(hang.get("waited_s"), (int, float)) else ""))


def progress_line(summary: dict[str, Any]) -> str:
    """One line: state, step, last checkpoint, throughput."""
    parts = [summary["state"]]
    if "step" in summary:
        total = f"/{summary['total_steps']}" if "total_steps" in summary else ""
        parts.append(f"step {summary['step']}{total}")
    if "checkpoint" in summary:
        ckpt = summary["checkpoint"]
        parts.append(f"checkpoint step {ckpt['step']} {_age(ckpt['age_s'])} ago")
    if "steps_per_s" in summary:
        parts.append(f"{summary['steps_per_s']:.3g} steps/s")
    if summary.get("restart"):
        parts.append(f"restart {summary['restart']}")
    return ", ".join(parts)


def scheduler_state(job_id: str) -> str | None:
    """Slurm's state of the job (squeue while queued or running, then sacct), or None if unknown."""
    if not _SLURM_ID.match(job_id):
        return None
    for command in (["squeue", "-h", "-j", job_id, "-o", "%T"], ["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id]):
        if shutil.which(command[0]) is None:
            continue
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=15, check=False).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        lines = [line.strip() for line in out.splitlines() if line.strip()]
        if lines:
            return lines[-1].split()[0]
    return None


def describe(run_dir: Path, now: float | None = None) -> list[str]:
    """The lines `status.py` prints for one run directory."""
    summary = summarize(read_ledger(run_dir / "events.jsonl"), now)
    lines = [f"run         {run_dir}"]
    job_id = summary.get("job_id") or run_dir.name.rsplit("-", 1)[-1]
    sched = scheduler_state(str(job_id)) if summary.get("launcher") != "submitit-local" else None
    lines.append(f"job         {job_id}" + (f" (slurm: {sched})" if sched else ""))
    lines.append(f"state       {summary['state']}")
    if not summary["events"]:
        return lines
    lines.append(f"requeues    {summary['restart']} restart(s), {summary['requeues']} requeue event(s)")
    if "step" in summary:
        total = f" of {summary['total_steps']}" if "total_steps" in summary else ""
        epoch = f", epoch {summary['epoch']}" if summary.get("epoch") is not None else ""
        lines.append(f"progress    step {summary['step']}{total}{epoch}")
    if "checkpoint" in summary:
        ckpt = summary["checkpoint"]
        lines.append(f"checkpoint  step {ckpt['step']}, {_age(ckpt['age_s'])} ago ({ckpt['reason']})")
    else:
        lines.append("checkpoint  none yet")
    if "steps_per_s" in summary:
        lines.append(f"throughput  {summary['steps_per_s']:.3g} steps/s over {_age(summary['throughput_window_s'])}")
    if "hangs" in summary:
        lines.append(f"hangs       {summary['hangs']['count']}; last {hang_line(summary['hangs']['last'])}")
    if "excluded" in summary:
        lines.append(f"excluded    {', '.join(map(str, summary['excluded']))} (nodes a hang was pinned on)")
    lines.append(f"last event  {summary['last_event']}, {_age(summary['last_event_age_s'])} ago")
    return lines


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, like every other input error
        exit_with(MgpuError(message), PROG)


def _check_target(target: str, folder: str) -> None:
    """MgpuError for a target find_run_dirs cannot look up: empty, a control character, a path that is not
    a directory (a glob with '/' in it would raise), or a --folder that is not a directory."""
    for flag, value in (("RUN_DIR_OR_JOB_ID", target), ("--folder", folder)):
        if not value:
            raise MgpuError(f"{flag} '': give a run directory or a job id")
        if problem := control_problem(value):
            raise MgpuError(f"{flag} {value!r}: {problem}")
    if Path(target).is_dir():
        return
    if "/" in target or target in (".", ".."):
        raise MgpuError(f"{target!r}: no such run directory (or pass a job id and --folder)")
    if not Path(folder).is_dir():
        raise MgpuError(f"--folder {folder!r}: no such directory (pass --folder, the run root the job was "
                        "submitted with)")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="jobs/status.py", description=__doc__.splitlines()[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", metavar="RUN_DIR_OR_JOB_ID")
    parser.add_argument("--folder", default="runs", help="root of the run directories (default: runs)")
    args = parser.parse_args(argv)
    try:
        _check_target(args.target, args.folder)
        run_dirs = find_run_dirs(args.target, args.folder)
        shown = []
        for run_dir in run_dirs:
            skipped: list[int] = []
            read_ledger(run_dir / "events.jsonl", skipped)  # for the note; describe() reads it itself
            shown.append((run_dir, describe(run_dir), skipped))
    except MgpuError as error:
        exit_with(error, PROG)
    for i, (run_dir, lines, skipped) in enumerate(shown):
        print(("\n" if i else "") + "\n".join(lines))
        if skipped:
            listed = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
            print(f"{PROG}: note: {run_dir / 'events.jsonl'}: skipped {len(skipped)} malformed line(s) "
                  f"(line {listed})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
