"""Train one job: `python jobs/train.py --config X.yaml [key=value ...]`.

    python jobs/train.py --config jobs/configs/mnist.yaml                  # one process
    torchrun --nproc-per-node 2 jobs/train.py --config jobs/configs/mnist.yaml   # DDP, 2 ranks
    srun python jobs/train.py --config ...                                 # one Slurm task per GPU

Running the same command again resumes the run from its newest valid checkpoint.
Exit codes: 0 finished (or stopped and requeued under Slurm), 1 a failure (its traceback, then one line
saying what happens next), 2 bad input or a full disk, 3 stopped by a signal and not requeued (the
checkpoint is written: run the same command to resume), 4 hung (the watchdog ended it; see
mgpu/stop/watchdog.py). See mgpu/train/job.py. The process ends with os._exit once its outcome is recorded, after
the atexit handlers (bounded; mgpu/stop/process_exit.py).

Testing: `--stop-at-step K` stops after optimizer step K exactly as a preemption does (every rank at that
step, the stop's checkpoint, exit 3 outside Slurm), without a signal: run the same command without it to
resume (mgpu.stop.stopping's test stop; the flag sets MGPU_STOP_AT_STEP=K for this process, which the stop
controller reads).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mgpu.config.loading import load_config  # noqa: E402  (no torch: validation is fast)
from mgpu.errors import MgpuError, exit_with  # noqa: E402

PROG = "train"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, like every other input error
        exit_with(MgpuError(message), PROG)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="jobs/train.py", description=__doc__.splitlines()[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (default: the built-in defaults, the MNIST-style example)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.epochs=3")
    parser.add_argument("--stop-at-step", type=int, metavar="K",
                        help="testing: stop after step K as if preempted (checkpoint, exit code 3)")
    # intermixed, as jobs/submit.py: `--config X a=1 --stop-at-step 3 b=2` keeps both overrides
    args = parser.parse_intermixed_args(argv)
    if args.stop_at_step is not None and args.stop_at_step < 1:
        parser.error(f"--stop-at-step {args.stop_at_step}: must be >= 1 (a step number)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mgpu.train.job import cli_exit_code  # no torch at import: a bad config still fails in milliseconds
    from mgpu.stop.stopping import STOP_AT_STEP

    if args.stop_at_step is not None:  # the test stop's one path: the environment the stop controller reads
        os.environ[STOP_AT_STEP] = str(args.stop_at_step)
    return cli_exit_code(lambda: load_config(args.config, args.overrides), args.config, PROG)


if __name__ == "__main__":
    from mgpu.stop.process_exit import run_and_exit

    # This command owns its process: once the outcome is recorded, it ends without the interpreter's
    # finalization (about 1 s of CPU with torch loaded; see mgpu/stop/process_exit.py).
    run_and_exit(main)
