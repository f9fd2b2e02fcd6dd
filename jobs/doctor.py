"""Measure what a Slurm partition does to a job: `python jobs/doctor.py --partition P [--preemptor-partition Q]`.

    python jobs/doctor.py --partition gpu --preemptor-partition urgent    # everything (a few minutes)
    python jobs/doctor.py --partition gpu                                 # no preemption probe
    python jobs/doctor.py --partition gpu --preemptor-partition urgent --only preemption --json facts.json

Submits small probe jobs (no GPU work, no torch; named mgpu-doctor-*) and reports, measured: which signals a
preempted job gets and when (the user signal before SIGTERM? GraceTime, KillWait), whether --signal reaches
the tasks and how early, whether `scontrol requeue` works from inside a job and how long a requeued job is
held, whether scontrol is in the job's environment, whether the run root is shared between nodes (an
fsync'd rename on one seen on another), whether the nodes resolve each other and reach the rendezvous
port. Ends with the settings mgpu will use there and the risks, one line each. The preemption probe needs
a partition whose jobs preempt those of --partition (on the test cluster: main and high). Every probe job
is cancelled on the way out, Ctrl-C included; every wait is bounded by --timeout.
Exit codes: 0 measured, 1 some probe found no answer in time (the report says which), 2 bad input
(nothing submitted), 130 interrupted (probe jobs cancelled).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mgpu.config.loading import control_problem  # noqa: E402
from mgpu.submit.doctor_run import Doctor, Interrupted, Options  # noqa: E402
from mgpu.errors import MgpuError, exit_with  # noqa: E402

PROG = "doctor"
PROBES = ("preemption", "env")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, like every other input error
        exit_with(MgpuError(message), PROG)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="jobs/doctor.py", description=__doc__.splitlines()[0],
                epilog="\n".join(__doc__.splitlines()[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--partition", required=True, help="the partition mgpu's jobs will run in")
    p.add_argument("--preemptor-partition", metavar="Q",
                   help="a partition whose jobs preempt those of --partition (without it: no preemption probe)")
    p.add_argument("--run-root", default="runs", help="the run root to check for sharing (default: runs)")
    p.add_argument("--nodes", type=int, default=2, help="nodes of the environment probe (default: 2)")
    p.add_argument("--account", help="sbatch --account for the probe jobs")
    p.add_argument("--qos", help="sbatch --qos for the probe jobs")
    p.add_argument("--only", choices=PROBES, help="run one probe: preemption or env (default: both)")
    p.add_argument("--timeout", type=float, default=900, metavar="S",
                   help="give up waiting after S seconds in all, cancel the probes (default: 900)")
    p.add_argument("--json", metavar="PATH", help="also write the measured facts as JSON")
    p.add_argument("--keep", action="store_true", help="keep the probes' files (<run root>/.mgpu-doctor/...)")
    return p.parse_args(argv)


def _options(args: argparse.Namespace) -> Options:
    for flag in ("partition", "preemptor_partition", "run_root", "account", "qos", "json"):
        value = getattr(args, flag)
        if value is not None and (problem := control_problem(value)):
            raise MgpuError(f"--{flag.replace('_', '-')} {value!r}: {problem}")
    if not 1 <= args.nodes <= 64:
        raise MgpuError(f"--nodes {args.nodes}: give 1 (no shared-filesystem and name checks) to 64; 2 is enough")
    if not 60 <= args.timeout <= 86400:
        raise MgpuError(f"--timeout {args.timeout:g}: give 60 to 86400 seconds (a probe takes a minute or two)")
    if args.only == "preemption" and not args.preemptor_partition:
        raise MgpuError("--only preemption needs --preemptor-partition, a partition whose jobs preempt --partition's")
    if args.json is not None and not Path(args.json).parent.is_dir():
        raise MgpuError(f"--json {args.json!r}: no such directory {str(Path(args.json).parent)!r}")
    return Options(partition=args.partition, preemptor=args.preemptor_partition, run_root=Path(args.run_root),
                   nodes=args.nodes, timeout_s=args.timeout, account=args.account, qos=args.qos,
                   probes=(args.only,) if args.only else PROBES, keep=args.keep)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        opts = _options(args)
        doctor = Doctor(opts)
        cfg = doctor.preflight()  # the rest of the bad input: before anything is created or submitted
    except MgpuError as error:
        exit_with(error, PROG)

    def on_term(signum: int, frame: Any) -> None:
        doctor.stopping = True  # the waits see it within a poll and unwind; the jobs are cancelled on the way

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    # Ctrl-C (or a SIGINT) cancels the probe jobs however the doctor was started: from a background shell it
    # inherits SIGINT ignored, which Python keeps (mgpu's training takes SIGINT explicitly too).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"{PROG}: probing partition {opts.partition}" + (f" (preempted from {opts.preemptor})" if opts.preemptor
                                                           else "") + f"; at most {opts.timeout_s:.0f} s", flush=True)
    try:
        lines, facts = doctor.run(cfg)
    except MgpuError as error:
        doctor.cancel_all()
        exit_with(error, PROG)
    except (KeyboardInterrupt, Interrupted):
        doctor.cancel_all()
        jobs = ", ".join(doctor.jobs) or "none submitted"
        print(f"{PROG}: interrupted; probe jobs cancelled: {jobs}", file=sys.stderr, flush=True)
        return 130
    print("\n".join(lines), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(facts, indent=2) + "\n")
    return 1 if facts["incomplete"] else 0


if __name__ == "__main__":
    sys.exit(main())
