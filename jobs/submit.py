"""Submit training as a Slurm batch job, or run it here: `python jobs/submit.py --config X.yaml [key=value ...]`.

    python jobs/submit.py --nodes 2 --gpus-per-node 4 --time 04:00:00 --config jobs/configs/mnist.yaml
    python jobs/submit.py --gpus-per-node 2 --config jobs/configs/mnist.yaml      # no sbatch here: runs locally
    python jobs/submit.py ... --sweep optim.lr=1e-3,3e-4 --sweep data.batch_size=32,64   # a 4-task job array
    python jobs/submit.py ... --dry-run                                            # print the sbatch file only

Everything is validated before anything is created or submitted. One task per GPU; the job
checkpoints and requeues itself --signal-lead seconds before its time limit or on preemption.
Exit codes: 0 submitted (completed, when waiting), 1 the job failed, 2 bad input (nothing submitted).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import math
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator, NoReturn, Sequence

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # find task modules as the job will, from the working directory, not from jobs/
    sys.path[0:1] = [os.getcwd()] + ([str(ROOT)] if str(ROOT) != os.getcwd() else [])

from mgpu.errors import MgpuError, exit_with  # noqa: E402  (no torch anywhere on this path)
from mgpu.cluster.kill_time import cluster_exports  # noqa: E402
from mgpu.config.loading import Config  # noqa: E402
from mgpu.record.exclusion import NodeMemory  # noqa: E402
from mgpu.submit.script_line import check_line  # noqa: E402
from mgpu.submit.submission import (Resources, Submission, build_submission, check_resumable, run_dir_for,  # noqa: E402
                             sbatch_script, slurm_parameters, submitit_command, submitit_folder)

PROG = "submit"
_NODE = re.compile(r"[A-Za-z0-9_.-]+")
# Slurm states after which a job may still run again (submitit's list and the transient ones).
_UNFINISHED = {"READY", "PENDING", "RUNNING", "UNKNOWN", "REQUEUED", "COMPLETING", "PREEMPTED", "CONFIGURING",
               "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, like every other input error
        exit_with(MgpuError(message), PROG)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = _Parser(prog="jobs/submit.py", description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (default: the built-in defaults)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.epochs=3")
    r = p.add_argument_group("resources")
    r.add_argument("--nodes", type=int, default=1, help="nodes (default: 1)")
    r.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per node, one task each; 0: CPU (default: 1)")
    r.add_argument("--tasks-per-node", type=int, help="tasks per node with --gpus-per-node 0 (default: 1)")
    r.add_argument("--cpus-per-task", type=int, help="CPUs per task (default: the partition's)")
    r.add_argument("--mem", help="memory per node, Slurm's syntax, e.g. 64G (default: the partition's)")
    r.add_argument("--time", default="01:00:00", help="time limit: MM, HH:MM:SS, D-HH:MM or D-HH (default: 01:00:00)")
    for flag in ("partition", "account", "qos", "constraint"):
        r.add_argument(f"--{flag}", help=f"sbatch --{flag}")
    r.add_argument("--exclude", help="nodes to avoid, a Slurm node list (e.g. gpu[03-04]); nodes this run blamed in "
                   "two attempts (hangs, failures confined to them) are added")
    r.add_argument("--forget-node", action="append", default=[], metavar="NODE",
                   help="allow a node this run remembers as bad again (its blames are cleared); repeatable")
    r.add_argument("--job-name", help="Slurm job name (default: run.name)")
    j = p.add_argument_group("job")
    j.add_argument("--folder", help="root of the run directories; sets run.root (default: run.root, i.e. runs)")
    j.add_argument("--signal-lead", type=int, default=120, metavar="S",
                   help="signal the job S seconds before its time limit, to checkpoint (default: 120)")
    j.add_argument("--max-requeues", type=int, help="requeues after preemptions and time limits (default: no limit)")
    j.add_argument("--max-failures", type=int, default=3,
                   help="requeues after a failed step, per job (default: 3)")
    j.add_argument("--new-run", action="store_true",
                   help="start a new run (run.name gets a free -2, -3, ... suffix) instead of resuming run.name")
    j.add_argument("--cluster", choices=("auto", "slurm", "local", "debug"), default="auto",
                   help="auto: slurm if sbatch is on PATH, else local (processes here); debug: in-process")
    j.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help="run every combination as a job array (repeatable)")
    j.add_argument("--max-parallel", type=int, default=4, help="array tasks running at once (default: 4)")
    j.add_argument("--dry-run", action="store_true", help="print what would be submitted; submit nothing")
    j.add_argument("--wait", action="store_true", help="follow the job until it ends; exit 0 if it completed")
    j.add_argument("--poll-interval", type=float, default=15.0, help=argparse.SUPPRESS)
    return p.parse_intermixed_args(argv)


def _resources(args: argparse.Namespace, sub: Submission) -> Resources:
    cfg = sub.configs[0]
    return Resources(nodes=args.nodes, gpus_per_node=args.gpus_per_node, tasks_per_node=args.tasks_per_node,
                     cpus_per_task=args.cpus_per_task, mem=args.mem, time=args.time, partition=args.partition,
                     account=args.account, qos=args.qos, constraint=args.constraint, exclude=args.exclude,
                     job_name=sub.name if args.job_name is None else args.job_name, signal_lead_s=args.signal_lead,
                     max_requeues=args.max_requeues, max_failures=args.max_failures,
                     requeue_signal=cfg.preemption.signal)


def _new_run_name(cfg: Config) -> str:
    """`run.name` with the first `-N` suffix (N >= 2) whose run directory does not exist yet."""
    for n in itertools.count(2):
        name = f"{cfg.run.name}-{n}"
        if not (Path(cfg.run.root) / name).exists():
            return name
    raise AssertionError("unreachable")


def _validate(args: argparse.Namespace) -> tuple[str, Submission, Resources]:
    cluster = args.cluster
    args.auto_note = None
    if cluster == "auto" and not shutil.which("sbatch"):
        # No Slurm here (a laptop, where a user reads the script first): a run here is one node; a dry run of a
        # several-node job prints the script a login node would submit.
        if args.nodes > 1 and args.dry_run:
            args.auto_note = ("# no sbatch on this machine: the Slurm script it would submit from a login node "
                              "(--cluster slurm)")
        elif args.nodes > 1:
            raise MgpuError(f"--nodes {args.nodes}: no sbatch on this machine, so --cluster auto would run here, on one "
                            "node; submit from a Slurm login node, or use --nodes 1 (--dry-run prints the Slurm script)")
        elif args.dry_run:
            args.auto_note = "# no sbatch on this machine: this runs here; the Slurm script: --cluster slurm --dry-run"
        cluster = "slurm" if args.nodes > 1 else "local"
    elif cluster == "auto":
        cluster = "slurm"
    if args.max_parallel < 1:
        raise MgpuError(f"--max-parallel {args.max_parallel}: must be >= 1")
    if not (math.isfinite(args.poll_interval) and args.poll_interval > 0):
        raise MgpuError(f"--poll-interval {args.poll_interval}: must be a positive number of seconds")
    sub = build_submission(args.config, args.overrides, args.sweep, args.folder)
    if args.new_run:
        if sub.configs[0].run.dir:
            raise MgpuError(f"--new-run: run.dir={sub.configs[0].run.dir!r} names one directory; remove run.dir")
        args.overrides = [*args.overrides, f"run.name={_new_run_name(sub.configs[0])}"]
        sub = build_submission(args.config, args.overrides, args.sweep, args.folder)
    res = _resources(args, sub)
    for node in args.forget_node:
        check_line("--forget-node", node)
        if not _NODE.fullmatch(node):
            raise MgpuError(f"--forget-node {node!r}: give one node's name (letters, digits, . _ -)")
    args.nodes_memory = NodeMemory.read([run_dir_for(cfg) for cfg in sub.configs], args.forget_node)
    if cluster == "slurm":
        res = dataclasses.replace(res, exclude=args.nodes_memory.merged_exclude(res.exclude))
    if cluster in ("local", "debug") and res.nodes > 1:
        raise MgpuError(f"--nodes {res.nodes}: --cluster {cluster} runs on this machine only; use --nodes 1")
    if cluster == "slurm" and not args.dry_run and not (shutil.which("sbatch") and shutil.which("srun")):
        raise MgpuError("--cluster slurm: sbatch/srun not found on PATH; submit from a login node or use --cluster local")
    args.resume_steps = [check_resumable(cfg) for cfg in sub.configs]
    return cluster, sub, res


def _resume_command(args: argparse.Namespace, argv: Sequence[str]) -> str:
    """The exact command that resubmits this run (--new-run replaced by the run.name it chose).

    It goes into the batch script (`export MGPU_RESUME_COMMAND=...`), so each part must be one line:
    argparse and int() accept `--nodes $'2\\n'`, which no other check sees."""
    kept = [arg for arg in argv if arg not in ("--new-run", "--dry-run")]
    if args.new_run:
        kept.append(next(o for o in reversed(args.overrides) if o.startswith("run.name=")))
    for what, value in (("working directory", os.getcwd()), ("interpreter", sys.executable), ("script", sys.argv[0])):
        check_line(what, value)
    for before, arg in zip(["", *kept], kept):  # `--nodes '2\n'` names the flag the value was given to
        check_line(before if before.startswith("--") and "=" not in before else "argument", arg)
    return f"cd {shlex.quote(os.getcwd())} && {shlex.join([sys.executable, sys.argv[0], *kept])}"


def _resume_note(sub: Submission, steps: list[int | None]) -> list[str]:
    return [f"# run {run_dir_for(cfg)}: " + ("new" if step is None else f"resumes from its checkpoint at step {step}")
            for cfg, step in zip(sub.configs, steps)]


def _describe_tasks(sub: Submission) -> list[str]:
    if len(sub.configs) == 1:
        return []
    return [f"# task {i}: run.name={cfg.run.name} {' '.join(o)}" for i, (cfg, o) in enumerate(zip(sub.configs, sub.overrides))]


def dry_run(cluster: str, sub: Submission, res: Resources, max_parallel: int, resume: str,
            steps: list[int | None]) -> None:
    folder = submitit_folder(sub.configs[0].run.root)
    if cluster == "slurm":
        print(sbatch_script(res, submitit_command(folder), folder, len(sub.configs), max_parallel,
                            [run_dir_for(cfg) for cfg in sub.configs], resume), end="")
    else:
        print(f"# {cluster}: 1 node, {res.ntasks_per_node if cluster == 'local' else 1} process(es), "
              f"time limit {res.time} ({res.time_s} s), signal {res.requeue_signal} {res.signal_lead_s} s before; "
              f"logs in {folder}")
    from mgpu.config.loading import dump_config

    # The resolved config goes with the notes to stderr: stdout stays a script that `> job.sh` can keep.
    resolved = [f"# resolved config{' of task 0' if len(sub.configs) > 1 else ''}:",
                *(f"#   {line}" for line in dump_config(sub.configs[0]).splitlines())]
    for line in [*resolved, f"# dry run: nothing submitted; run root {sub.configs[0].run.root}",
                 *_resume_note(sub, steps), *_describe_tasks(sub)]:
        print(line, file=sys.stderr)


@contextlib.contextmanager
def _job_environ(res: Resources, resume: str) -> Iterator[None]:
    """What the sbatch setup lines export, for the ranks that run here (they inherit os.environ)."""
    values = {"MGPU_MAX_FAILURES": str(res.max_failures), "MGPU_RESUME_COMMAND": resume}
    if res.max_requeues is not None:
        values["MGPU_MAX_REQUEUES"] = str(res.max_requeues)
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def submit(cluster: str, sub: Submission, res: Resources, max_parallel: int, resume: str) -> list[Any]:
    """Create the executor and submit one job per config (an array on Slurm); returns submitit jobs."""
    import submitit

    from mgpu.train.job import TrainJob  # only now: the job's callable (no torch at import either)

    folder = submitit_folder(sub.configs[0].run.root)
    fns = [TrainJob(config, sub.config_path) for config in sub.dicts]
    # submitit's own requeue counter: its handler never runs (mgpu's replaces it), so only a bound.
    max_num_timeout = res.max_requeues if res.max_requeues is not None else 1_000_000
    if cluster == "slurm":
        executor = submitit.SlurmExecutor(folder, max_num_timeout=max_num_timeout)
        executor.update_parameters(**slurm_parameters(res, max_parallel, [run_dir_for(c) for c in sub.configs],
                                                      resume, folder))
        said = io.StringIO()  # submitit prints sbatch's complaint itself: keep it for our one line
        try:
            with contextlib.redirect_stderr(said):
                jobs = list(executor.submit_array(fns))
        except submitit.core.utils.FailedJobError as error:
            why = "; ".join(line.strip().removeprefix("sbatch: error: ") for line in str(error).splitlines()
                            if line.strip()) or "no reason given"
            raise MgpuError(f"sbatch refused the job: {why}; nothing submitted (check --partition, --account, "
                            "--qos and the resources)") from None
        print(said.getvalue(), end="", file=sys.stderr)
        return jobs
    debug = submitit.DebugExecutor(folder)
    return [debug.submit(fn) for fn in fns]


def local_devices(res: Resources, gpus: int | None = None) -> str | None:
    """What `--cluster local` runs the ranks on, when it is not what --gpus-per-node asked: a note for CPU ranks on
    a machine without a GPU (the README's first command on a laptop trains there, on gloo); MgpuError for fewer
    GPUs than ranks (two ranks cannot share one under NCCL). `gpus`: this machine's count (None: torch's)."""
    if not res.gpus_per_node:
        return None
    if gpus is None:
        import torch  # a local run imports it anyway; the dry run does not come here

        gpus = torch.cuda.device_count()
    if gpus == 0:
        return (f"this machine has no GPU: --gpus-per-node {res.gpus_per_node} runs {res.ntasks_per_node} CPU "
                f"rank{'s' if res.ntasks_per_node != 1 else ''} here (gloo); --gpus-per-node 0 says so")
    if gpus < res.gpus_per_node:
        raise MgpuError(f"--gpus-per-node {res.gpus_per_node}: this machine has {gpus} GPU{'s' if gpus != 1 else ''}; "
                        f"use --gpus-per-node {gpus} (or 0 and --tasks-per-node for CPU ranks)")
    return None


def run_local(sub: Submission, res: Resources, resume: str) -> int:
    """--cluster local: each config's ranks as processes here (mgpu.spawn), one run after another. Ctrl-C
    (or SIGTERM to this process) stops them at the same step; they save, and this exits 3 with the
    command that resumes; --time is kept with its signal lead, as Slurm would; no rank outlives it."""
    from mgpu.train.job import local_rank
    from mgpu.run.spawn import spawn

    for i, cfg in enumerate(sub.configs):
        run_dir = run_dir_for(cfg)
        print(f"local run: {res.ntasks_per_node} rank(s)\n  run directory  {run_dir}\n"
              f"  follow         python jobs/status.py {run_dir}", flush=True)
        code = 0
        with _job_environ(res, resume):
            try:
                spawn(local_rank, (sub.dicts[i], sub.config_path), res.ntasks_per_node, local=True,
                      time_limit_s=res.time_s, signal_lead_s=res.signal_lead_s, requeue_signal=res.requeue_signal)
            except SystemExit as ended:
                code = int(ended.code or 0)
        if code:
            if code != 3:  # a stop's one line, with the command that resumes, came from rank 0 already
                print(f"submit: run {run_dir} failed (exit {code}); fix it, then: {resume}", file=sys.stderr, flush=True)
            return code
        print(f"done: run {run_dir} finished", flush=True)
    return 0


def _print_job(job: Any, cfg: Any, cluster: str) -> Path:
    run_dir = run_dir_for(cfg)
    follow = f"python jobs/status.py {run_dir}" + (f"   (or: squeue -j {job.job_id})" if cluster == "slurm" else "")
    print(f"{cluster} job {job.job_id}\n  run directory  {run_dir}\n  stdout         {job.paths.stdout}\n"
          f"  stderr         {job.paths.stderr}\n  follow         {follow}", flush=True)
    return run_dir


def follow(jobs: list[Any], run_dirs: list[Path], cluster: str, poll_s: float) -> bool:
    """Print state changes and progress until every job ends; True if all completed."""
    from mgpu.record.runview import RunView, progress_line, scheduler_state, summarize

    shown: dict[int, tuple[str, str]] = {}
    final: dict[int, bool] = {}
    while len(final) < len(jobs):
        if cluster == "slurm":
            jobs[0].watcher.update()  # one sacct for all of them (the watcher is shared)
        for i, (job, run_dir) in enumerate(zip(jobs, run_dirs)):
            if i in final:
                continue
            summary = summarize(RunView.load(run_dir).events)
            if cluster == "slurm":
                state = (job.watcher.get_state(job.job_id, mode="cache").split() or ["UNKNOWN"])[0].upper()
                if state == "UNKNOWN":  # no accounting: squeue while queued, then the ledger decides
                    state = scheduler_state(str(job.job_id)) or ("COMPLETED" if summary["state"].startswith(
                        "finished") else "FAILED" if summary["state"].startswith("failed") else "UNKNOWN")
                done = state not in _UNFINISHED
                ok = state == "COMPLETED"
            else:
                state = job.state
                done = job.done()
                ok = done and summary["state"].startswith("finished")
            line = progress_line(summary) if summary["events"] else "waiting for the first event"
            if shown.get(i) != (state, line):
                prefix = f"[{time.strftime('%H:%M:%S')}] job {job.job_id}"
                print(f"{prefix} {state}: {line}", flush=True)
                shown[i] = (state, line)
            if done:
                final[i] = ok
        if len(final) < len(jobs):
            time.sleep(poll_s)
    return all(final.values())


def _error_line(error: BaseException) -> str:
    """The exception line of the traceback inside submitit's FailedJobError (else its first line)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Stopped)\b", line)]
    return (raised or lines or [type(error).__name__])[-1]


def _run_here(job: Any, run_dir: Path, cluster: str, poll_s: float) -> bool:
    """Wait for a debug job (in this process), print its result or its error; True if it succeeded."""
    try:
        results = job.results()
    except KeyboardInterrupt:
        job.cancel()
        print(f"submit: interrupted: job {job.job_id} cancelled", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except Exception as error:  # submitit's FailedJobError carries the rank's traceback
        print(f"job {job.job_id} failed: {_error_line(error)} (see {job.paths.stderr})", file=sys.stderr, flush=True)
        return False
    print(f"job {job.job_id} done: {str(results[0])[:300]}", flush=True)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        cluster, sub, res = _validate(args)
        resume = _resume_command(args, argv)
        if cluster == "slurm":  # once every input is checked: a mistake asks Slurm nothing
            # Read here, outside the job: inside it, the stop that needs them is when Slurm may not answer.
            times = cluster_exports(res.partition.split(",")[0] if res.partition else None)
            res = dataclasses.replace(res, kill_times=tuple(times.items()))
    except MgpuError as error:
        exit_with(error, PROG)
    memory: NodeMemory = args.nodes_memory
    if args.dry_run:
        dry_run(cluster, sub, res, args.max_parallel, resume, args.resume_steps)
        if args.auto_note:
            print(args.auto_note, file=sys.stderr)
        for line in memory.lines() if cluster == "slurm" else []:
            print(f"# {line} (dry run: not recorded)", file=sys.stderr)
        return 0
    if cluster == "slurm":
        for line in memory.lines():
            print(line, flush=True)
        memory.record()
    if cluster == "local":
        try:
            note = local_devices(res)
        except MgpuError as error:
            exit_with(error, PROG)
        if note:
            print(f"submit: note: {note}", file=sys.stderr, flush=True)
    for line in _resume_note(sub, args.resume_steps):
        print(line.lstrip("# "), flush=True)
    if cluster == "debug" and res.ntasks_per_node > 1:
        print("submit: note: --cluster debug runs one rank in this process", file=sys.stderr)
    if cluster == "local":
        return run_local(sub, res, resume)
    if cluster != "slurm":  # one job at a time on this machine, each waited for
        ok = True
        for i, cfg in enumerate(sub.configs):
            single = Submission([cfg], [sub.overrides[i]], sub.config_path, sub.name)
            job = submit(cluster, single, res, args.max_parallel, resume)[0]
            ok = _run_here(job, _print_job(job, cfg, cluster), cluster, min(args.poll_interval, 2.0)) and ok
        return 0 if ok else 1
    try:
        jobs = submit(cluster, sub, res, args.max_parallel, resume)
    except MgpuError as error:
        exit_with(error, PROG)
    run_dirs = [_print_job(job, cfg, cluster) for job, cfg in zip(jobs, sub.configs)]
    if len(jobs) > 1:
        array_id = str(jobs[0].job_id).split("_")[0]
        print(f"array {array_id}: {len(jobs)} tasks, at most {args.max_parallel} at once; "
              f"python jobs/status.py {array_id} --folder {sub.configs[0].run.root}   (or: squeue -j {array_id})")
    print(f"to resume later (the same run): {resume}", flush=True)
    if args.wait:
        try:
            return 0 if follow(jobs, run_dirs, cluster, args.poll_interval) else 1
        except MgpuError as error:  # e.g. a ledger that cannot be read; the jobs run on regardless
            exit_with(error, PROG)
    return 0


if __name__ == "__main__":
    sys.exit(main())
