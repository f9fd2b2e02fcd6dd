"""Show a run's state: `python jobs/status.py RUN_DIR_OR_JOB_ID [--folder runs] [--plot PNG]`.

    python jobs/status.py runs/mnist-12345     # a run directory
    python jobs/status.py 12345                # a Slurm job id: the runs under runs/ that job trained
                                               # (an array id: every task's run)
    python jobs/status.py runs/mnist --plot timeline.png    # and a picture of the run (needs matplotlib)
    python jobs/status.py --verify runs/a runs/b            # same weights at every step both logged?

Reads `<run dir>/events.jsonl` (see mgpu/record/ledger.py): the newest step, its epoch and logged metrics (the
trainer's, or a loop's own `session.log`), throughput and ETA (none for a loop that logs no total), evaluations,
requeues and the budgets left, and where the time went (mgpu/record/goodput.py); asks squeue/sacct/scontrol
where they exist, each try within SLURM_TRY_S and all of them within SLURM_TOTAL_S (what gave no answer is
left out, with a note on stderr); ledger lines that are not well-formed events are skipped with a note on stderr.
Exit codes: 0 shown (--verify: the runs agree), 1 (--verify) they differ, 2 no such run (or bad
arguments, or an unreadable ledger, or runs --verify cannot compare).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mgpu.config.loading import control_problem  # noqa: E402
from mgpu.errors import MgpuError, exit_with  # noqa: E402
from mgpu.record.ledger import read_ledger  # noqa: E402
from mgpu.record.rundir import RunDir  # noqa: E402
from mgpu.cluster.slurm import SlurmClient, set_client  # noqa: E402
from mgpu.record.runview import (SLURM_ID, RunView, budgets, describe, is_run_dir, job_limits, progress_line,  # noqa: E402
                          sacct_runs, scheduler_state, summarize, verify)

__all__ = ["budgets", "describe", "find_run_dirs", "job_limits", "progress_line", "scheduler_state", "summarize",
           "verify"]  # the read model's names stay importable from here (mgpu.record.runview holds them)

PROG = "status"
_SLURM_ID = SLURM_ID
SLURM_TRY_S = 4.0
"""One try of a Slurm command (the jobs' own client waits 20 s: a person waits here)."""
SLURM_TOTAL_S = 8.0
"""Every Slurm command status runs, together (a hanging squeue used to keep it silent for 122 s)."""


def _bounded_slurm() -> SlurmClient:
    slurm = SlurmClient(timeout_s=SLURM_TRY_S)
    set_client(slurm)
    return slurm


def _say_unanswered(slurm: SlurmClient) -> None:
    """What status could not ask (a command not installed is no news: a run looked at off the cluster)."""
    for line in slurm.unanswered:
        if "not found on PATH" not in line:
            print(f"{PROG}: note: {line}: left out of what is shown", file=sys.stderr)


def _job_ids(run_dir: Path) -> set[str]:
    return {str(e.get("job_id")) for e in read_ledger(RunDir(run_dir).ledger) if e.get("job_id")}


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
        if not is_run_dir(Path(target)):
            raise MgpuError(f"{target!r}: not a run directory (no events.jsonl, config.yaml, logs/ or checkpoints/ in "
                            "it); give a run directory or a job id")
        return
    if "/" in target or target in (".", ".."):
        raise MgpuError(f"{target!r}: no such run directory (or pass a job id and --folder)")
    if not Path(folder).is_dir():
        raise MgpuError(f"--folder {folder!r}: no such directory (pass --folder, the run root the job was "
                        "submitted with)")


def _check_run_dir(flag: str, value: str) -> Path:
    if not value:
        raise MgpuError(f"{flag} '': give a run directory")
    if problem := control_problem(value):
        raise MgpuError(f"{flag} {value!r}: {problem}")
    path = Path(value)
    if not path.is_dir():
        raise MgpuError(f"{flag} {value!r}: no such run directory")
    if not RunDir(path).ledger.is_file():
        raise MgpuError(f"{flag} {value!r}: no events.jsonl in it: not a run directory")
    return path


def _check_plot(value: str | None) -> Path | None:
    if value is None:
        return None
    if problem := control_problem(value):
        raise MgpuError(f"--plot {value!r}: {problem}")
    path = Path(value)
    if path.suffix.lower() != ".png":
        raise MgpuError(f"--plot {value!r}: give a .png file name")
    if not path.parent.is_dir():
        raise MgpuError(f"--plot {value!r}: no such directory {str(path.parent)!r}")
    if path.is_dir():
        raise MgpuError(f"--plot {value!r}: is a directory; give a .png file name")
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise MgpuError("--plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="jobs/status.py", description=__doc__.splitlines()[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", metavar="RUN_DIR_OR_JOB_ID", nargs="?")
    parser.add_argument("--folder", default="runs", help="root of the run directories (default: runs)")
    parser.add_argument("--plot", metavar="PNG", help="also draw the run's timeline into this PNG (needs matplotlib)")
    parser.add_argument("--verify", nargs=2, metavar=("RUN_A", "RUN_B"),
                        help="compare two runs' weight fingerprints step by step; exit 0 if they agree, 1 if not")
    args = parser.parse_args(argv)
    if args.verify is not None:
        if args.target is not None or args.plot is not None:
            parser.error("--verify RUN_A RUN_B takes no other run and no --plot")
        try:
            code, line = verify(*(_check_run_dir(flag, value) for flag, value in zip(("RUN_A", "RUN_B"), args.verify)))
        except MgpuError as error:
            exit_with(error, PROG)
        print(line)
        return code
    if args.target is None:
        parser.error("the following arguments are required: RUN_DIR_OR_JOB_ID")
    slurm = _bounded_slurm()
    try:
        _check_target(args.target, args.folder)
        plot = _check_plot(args.plot)
        run_dirs = find_run_dirs(args.target, args.folder)
        if plot is not None and len(run_dirs) > 1:
            raise MgpuError(f"--plot draws one run; {args.target!r} has {len(run_dirs)}: give one run directory")
        shown = []
        with slurm.within(SLURM_TOTAL_S):
            for run_dir in run_dirs:
                view = RunView.load(run_dir)  # the ledger, read once for everything below
                shown.append((view, describe(view)))
    except MgpuError as error:
        exit_with(error, PROG)
    _say_unanswered(slurm)
    slurm.unanswered.clear()
    for i, (view, lines) in enumerate(shown):
        print(("\n" if i else "") + "\n".join(lines))
        if view.skipped:
            listed = ", ".join(map(str, view.skipped[:5])) + (", ..." if len(view.skipped) > 5 else "")
            print(f"{PROG}: note: {view.run.ledger}: skipped {len(view.skipped)} malformed line(s) "
                  f"(line {listed})", file=sys.stderr)
    if plot is not None:
        from mgpu.record.timeline import plot_timeline

        view = shown[0][0]
        try:
            with slurm.within(SLURM_TOTAL_S):
                runs, _ = sacct_runs(view.events)
            _say_unanswered(slurm)
            plot_timeline(view.events, plot, runs, title=str(view.run.path))
        except OSError as error:
            exit_with(MgpuError(f"--plot {str(plot)!r}: cannot write: {error.strerror or error}"), PROG)
        except (OverflowError, ValueError) as error:  # matplotlib's dates from a ledger time no clock can show
            exit_with(MgpuError(f"--plot {str(plot)!r}: the ledger holds a time that cannot be drawn ({error})"), PROG)
        except MgpuError as error:
            exit_with(error, PROG)
        print(f"timeline    {plot}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `status.py RUN | head`: the reader left before the rest; no traceback for that
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
        sys.exit(1)
