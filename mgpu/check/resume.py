"""Is my resume exact? One command that answers it for a loop of one's own or for the trainer:

    python -m mgpu.check.resume [--nproc N] [--steps S] [--stop-at K] -- script.py --out {run} [args]
    python -m mgpu.check.resume [--nproc N] --config cfg.yaml [key=value ...]

On local ranks (no Slurm), in scratch run directories, it trains an unbroken run; the same stopped at step K
(mid-epoch, by the test stop MGPU_STOP_AT_STEP) and resumed; the same stopped one step after a save (while
it is written); and, where the global batch can be kept, stopped on N ranks and resumed on N/2. It compares
every entry of the saved states by its path (model, optimizer moments, scheduler, every rank's RNG, loader
position, the loop's own entries) at every step both runs saved and at the end, the weights at every step
both logged, and the samples each rank trained on. The report: PASS, or the first step and path that differ
with a hint. Exit 0 pass, 1 differs (or a resumed run failed), 2 bad input (one line) or out of time.
Nothing is left behind but the report unless --keep DIR.

`{run}` in a script's arguments is that run's directory (where it gives its Session the run directory); a
relative script path is taken from where the command runs, and the ranks run there too.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Callable, NoReturn

from mgpu.check.plan import check
from mgpu.check.runs import Runner, Target
from mgpu.errors import MgpuError, exit_with

__all__ = ["main"]

PROG = "check_resume"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        exit_with(MgpuError(message), PROG)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="python -m mgpu.check.resume", description=__doc__.splitlines()[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the runs (default 2)")
    parser.add_argument("--steps", type=int, help="stop every run at this step (default: the loop's own end)")
    parser.add_argument("--stop-at", type=int, metavar="K", help="the mid-run stop's step (default: mid-epoch, "
                        "about a third of the way)")
    parser.add_argument("--config", help="the trainer's YAML config (instead of a script)")
    parser.add_argument("--world-args", default=None, metavar="ARGS",
                        help="a script's extra arguments on N/2 ranks that keep its global batch (e.g. "
                             "'--accumulate 2'); without it an own loop's world-size change is skipped")
    parser.add_argument("--checks", default="stop,save,world", metavar="LIST",
                        help="which stops to make: stop (mid-epoch), save (during a save), world (on half the "
                             "ranks); default all three")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole check (default 900)")
    parser.add_argument("--keep", metavar="DIR", help="keep the runs in DIR (default: removed)")
    if "--" in argv:
        cut = argv.index("--")
        mine, command = argv[:cut], argv[cut + 1:]
    else:
        mine, command = argv, []
    args, rest = parser.parse_known_args(mine)
    args.command = command
    if rest and not args.config:
        parser.error(f"unrecognized arguments: {' '.join(rest)} (a script and its arguments go after `--`)")
    if any(not r.partition("=")[1] for r in rest):
        parser.error(f"unrecognized arguments: {' '.join(r for r in rest if '=' not in r)} (overrides are key=value)")
    args.overrides = rest
    return args


def target_from(args: argparse.Namespace, cwd: Path) -> Target:
    """The checked loop from the arguments, or MgpuError (one line) for bad input."""
    if args.nproc < 1 or args.nproc > 64:
        raise MgpuError(f"--nproc {args.nproc}: give 1 to 64 local ranks")
    if args.steps is not None and args.steps < 2:
        raise MgpuError(f"--steps {args.steps}: a resume check needs at least 2 steps")
    if args.stop_at is not None and (args.stop_at < 1 or (args.steps is not None and args.stop_at >= args.steps)):
        raise MgpuError(f"--stop-at {args.stop_at}: must be a step from 1 to one before the last (--steps)")
    unknown = set(args.checks.split(",")) - {"stop", "save", "world"}
    if unknown or not args.checks:
        raise MgpuError(f"--checks {args.checks}: a comma-separated list of stop, save, world")
    if not math.isfinite(args.timeout) or args.timeout <= 0:  # nan and inf would never expire
        raise MgpuError(f"--timeout {args.timeout:g}: must be a number of seconds > 0")
    if args.config and args.command:
        raise MgpuError("give either --config (the trainer) or `-- script.py args` (a loop of your own), not both")
    if args.config:
        config = (cwd / args.config) if not os.path.isabs(args.config) else Path(args.config)
        from mgpu.config.loading import load_config

        cfg = load_config(str(config), args.overrides)  # a bad key or value: its one line
        if any(o.split("=", 1)[0] in ("run.dir", "run.root", "run.name") for o in args.overrides):
            raise MgpuError("run.dir/run.root/run.name: the checker gives each run its own scratch directory; leave them out")
        halved: list[str] | None = [] if cfg.data.global_batch_size and args.nproc % 2 == 0 else None
        return Target(None, [], str(config), args.overrides, halved, f"{args.config} (the trainer)")
    if not args.command:
        raise MgpuError("nothing to check: give `-- script.py [args]` (a loop of your own) or --config cfg.yaml")
    script = Path(args.command[0])
    script = script if script.is_absolute() else cwd / script
    if not script.is_file():
        raise MgpuError(f"{args.command[0]}: no such script (a relative path is taken from {cwd})")
    if not any("{run}" in a for a in args.command[1:]):
        raise MgpuError(f"{args.command[0]}: put {{run}} in its arguments where it takes its run directory (e.g. "
                        f"`-- {args.command[0]} --out {{run}}`): every run of the check needs its own")
    halved = args.world_args.split() if args.world_args is not None and args.nproc % 2 == 0 else None
    return Target(script, args.command[1:], None, [], halved, args.command[0])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    cwd = Path.cwd()
    try:
        target = target_from(args, cwd)
    except MgpuError as error:
        exit_with(error, PROG)
    if args.keep:
        keep = Path(args.keep)
        if keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
            exit_with(MgpuError(f"--keep {args.keep}: not empty (or not a directory); give a new or empty directory"),
                      PROG)
        keep.mkdir(parents=True, exist_ok=True)
        scratch = keep.resolve()
    else:
        scratch = Path(tempfile.mkdtemp(prefix="mgpu-check-resume-"))
    runner = Runner(target, scratch, cwd, time.monotonic() + args.timeout, Path(args.keep).resolve() if args.keep
                    else None)
    ended = _end_on_signals()
    try:
        code, report = check(target, args, runner, scratch)
    except MgpuError as error:  # out of time (OutOfTime) too
        exit_with(error, PROG)
    except _Ended as stop:  # the ranks' groups are killed on the way out (Runner.segment), the scratch below
        print(f"{PROG}: stopped by {signal.Signals(stop.signum).name}: its runs were ended"
              + ("" if args.keep else " and removed"), file=sys.stderr, flush=True)
        return 128 + stop.signum
    finally:
        ended(False)  # a second signal does not cut the cleanup short
        runner.close()
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
        ended(True)
    print(report, flush=True)
    return code


class _Ended(BaseException):
    """A signal ended the check (SIGTERM, SIGHUP, SIGINT): raised where the checker is, so every `finally` runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _end_on_signals() -> Callable[[bool], None]:
    """SIGTERM, SIGHUP and SIGINT end the check through `_Ended` (its ranks killed, its scratch removed, not left
    running); a SIGKILL leaves that to the watcher (mgpu.check.runs). Returns `after(done)`: the signals ignored
    while the check cleans up (`done` False), the handlers of before put back (`done` True)."""
    signums = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Ended(signum)

    previous = {signum: signal.signal(signum, handler) for signum in signums}

    def after(done: bool) -> None:
        for signum in signums:
            signal.signal(signum, previous[signum] if done else signal.SIG_IGN)

    return after

if __name__ == "__main__":
    sys.exit(main())
