"""Building and validating a submission: resources, executor parameters and the sbatch text.

Everything a submission can get wrong (the config, the task's import path, the resources, the sweep)
is checked here before anything is created or submitted, with one-line errors naming the flag: the sweep
by mgpu.submit.sweep, the task's import path by mgpu.submit.task_target, every value's one line by
mgpu.submit.script_line.
Nothing here imports torch, and submitit only inside the functions that need it, so that
`jobs/submit.py --help` and `--dry-run` start fast.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mgpu.config.loading import Config, ConfigError, config_to_dict, load_config
from mgpu.config.resume_compat import check_resume_compatible
from mgpu.errors import MgpuError
from mgpu.cluster.hostlist import MAX_HOSTS, HostlistError, expand_hostlist
from mgpu.cluster.kill_time import GRACE_VARIABLE, KILL_WAIT_VARIABLE
from mgpu.record.rundir import RunDir
from mgpu.submit.script_line import check_line
from mgpu.submit.sweep import expand_sweep, parse_sweep, sweep_names
from mgpu.submit.task_target import check_task_target

__all__ = [
    "MAX_ARRAY_SIZE", "MAX_TIME_MIN", "Resources", "Submission", "build_submission", "check_resumable",
    "check_run_root", "parse_slurm_time", "run_dir_for", "sbatch_script", "setup_lines", "slurm_parameters",
    "submitit_command", "submitit_folder", "teardown_lines",
]

MAX_ARRAY_SIZE = 1000  # below Slurm's default MaxArraySize (1001)
MAX_TIME_MIN = 35_791_393
"""The longest `--time` Slurm (22.05) stores, in minutes (24855-03:13:00, just under 2**31 seconds):
measured on the test cluster, a longer limit wraps around to a wrong one without an error."""
MAX_TASKS_PER_NODE = 512  # Slurm's default MaxTasksPerNode
MAX_CPUS_PER_TASK = 65535  # Slurm keeps it in 16 bits
MAX_MEM_MB = 1 << 30  # 1 PiB per node: no node has it; Slurm accepts more, then cannot even print it
_TIME = re.compile(r"(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                   r"|(?P<h>\d+):(?P<hm>\d+):(?P<hs>\d+)|(?P<m>\d+)(?::(?P<ms>\d+))?)")
_MEM = re.compile(r"(?P<n>\d+)(?P<unit>[KMGT]?)", re.IGNORECASE)
# Every value below reaches an `#SBATCH --key=value` line (quoted by submitit, but a newline would still
# end the line), so each is matched whole against what Slurm itself accepts there.
_SLURM_NAMES = re.compile(r"[A-Za-z0-9_.+@:-]+(?:,[A-Za-z0-9_.+@:-]+)*")  # partition, account, qos lists
_CONSTRAINT = re.compile(r"[A-Za-z0-9_.+@:&|,*!()\[\]-]+")  # features with & | , * [ ] ( ) !
_NODELIST = re.compile(r"[A-Za-z0-9_.\[\],-]+")
_UNLIMITED = {"INFINITE", "UNLIMITED"}


def parse_slurm_time(text: str) -> int:
    """Slurm's `--time` formats (`MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`, `D-HH:MM:SS`) -> seconds.

    At most MAX_TIME_MIN minutes. Slurm's `INFINITE`/`UNLIMITED` (and `0`) are refused on purpose: the
    job checkpoints and requeues itself --signal-lead seconds before its limit, so it needs one.
    """
    stripped = text.strip()
    if stripped.upper() in _UNLIMITED:
        raise MgpuError(f"--time {text!r}: give a finite limit (the job checkpoints --signal-lead seconds before "
                        f"it), at most {MAX_TIME_MIN} minutes")
    match = _TIME.fullmatch(stripped)
    if match is None:
        raise MgpuError(f"--time {text!r}: not a Slurm time; use MM, HH:MM:SS, D-HH:MM or D-HH (e.g. 04:00:00)")
    parts = {k: v for k, v in match.groupdict().items() if v is not None}
    if any(len(v) > 12 for v in parts.values()):  # int() of thousands of digits would raise, not compare
        seconds = MAX_TIME_MIN * 60 + 60
    else:
        g = {k: int(v) for k, v in parts.items()}
        if "d" in g:
            seconds = ((g["d"] * 24 + g["dh"]) * 60 + g.get("dm", 0)) * 60 + g.get("ds", 0)
        elif "h" in g:
            seconds = (g["h"] * 60 + g["hm"]) * 60 + g["hs"]
        else:
            seconds = g["m"] * 60 + g.get("ms", 0)
    if math.ceil(seconds / 60) > MAX_TIME_MIN:
        raise MgpuError(f"--time {text!r}: longer than Slurm's maximum, {MAX_TIME_MIN} minutes (24855-03:13:00)")
    return seconds


def _mem_mb(text: str) -> int | None:
    """`64G` -> 65536 (Slurm's default unit is M); None if it is not Slurm's <number>[K|M|G|T]."""
    match = _MEM.fullmatch(text)
    if match is None or len(match["n"]) > 18:
        return None
    shift = {"K": -10, "": 0, "M": 0, "G": 10, "T": 20}[match["unit"].upper()]
    return int(match["n"]) << shift if shift >= 0 else int(match["n"]) >> -shift


@dataclass(frozen=True)
class Resources:
    """What the job asks Slurm for; construction validates (MgpuError naming the flag and the fix)."""

    nodes: int = 1
    gpus_per_node: int = 1
    tasks_per_node: int | None = None
    """Only with --gpus-per-node 0 (CPU); with GPUs there is one task per GPU."""
    cpus_per_task: int | None = None
    mem: str | None = None
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    job_name: str = "mgpu"
    signal_lead_s: int = 120
    max_requeues: int | None = None
    """Requeues after a preemption or time limit (None: no limit; see mgpu.record.budgets.Limits)."""
    max_failures: int = 3
    """Requeues after a failure, per job."""
    requeue_signal: str = "USR2"
    kill_times: tuple[tuple[str, str], ...] = ()
    """The cluster's KillWait and GraceTime for the job's stops, as read at submission (variable, seconds:
    mgpu.cluster.kill_time.cluster_exports); () where Slurm did not say."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise MgpuError(f"--nodes {self.nodes}: must be >= 1")
        if self.nodes > MAX_HOSTS:
            raise MgpuError(f"--nodes {self.nodes}: at most {MAX_HOSTS} (the longest node list mgpu expands)")
        if self.gpus_per_node < 0:
            raise MgpuError(f"--gpus-per-node {self.gpus_per_node}: must be >= 0 (0: CPU only)")
        if self.gpus_per_node > MAX_TASKS_PER_NODE:
            raise MgpuError(f"--gpus-per-node {self.gpus_per_node}: at most {MAX_TASKS_PER_NODE} "
                            "(one task per GPU; Slurm's default MaxTasksPerNode)")
        if self.tasks_per_node is not None:
            if self.tasks_per_node < 1:
                raise MgpuError(f"--tasks-per-node {self.tasks_per_node}: must be >= 1")
            if self.tasks_per_node > MAX_TASKS_PER_NODE:
                raise MgpuError(f"--tasks-per-node {self.tasks_per_node}: at most {MAX_TASKS_PER_NODE} "
                                "(Slurm's default MaxTasksPerNode)")
            if self.gpus_per_node and self.tasks_per_node != self.gpus_per_node:
                raise MgpuError(f"--tasks-per-node {self.tasks_per_node}: with GPUs there is one task per GPU; "
                                f"omit it (it is --gpus-per-node, {self.gpus_per_node})")
        if self.cpus_per_task is not None and not 1 <= self.cpus_per_task <= MAX_CPUS_PER_TASK:
            raise MgpuError(f"--cpus-per-task {self.cpus_per_task}: must be in [1, {MAX_CPUS_PER_TASK}]")
        if self.mem is not None:
            mem_mb = _mem_mb(self.mem)
            if mem_mb is None:
                raise MgpuError(f"--mem {self.mem!r}: use Slurm's <number>[K|M|G|T] per node, e.g. 64G")
            if mem_mb > MAX_MEM_MB:
                raise MgpuError(f"--mem {self.mem!r}: more than 1024T per node; use Slurm's <number>[K|M|G|T], "
                                "e.g. 64G")
        seconds = parse_slurm_time(self.time)
        if seconds < 60:
            raise MgpuError(f"--time {self.time!r}: Slurm's limit must be at least one minute")
        if not 10 <= self.signal_lead_s <= 65535:
            raise MgpuError(f"--signal-lead {self.signal_lead_s}: must be in [10, 65535] seconds "
                            "(time to checkpoint before the limit)")
        if self.signal_lead_s >= seconds:
            raise MgpuError(f"--signal-lead {self.signal_lead_s}: must be shorter than --time {self.time} "
                            f"({seconds} s); lower it or ask for more time")
        if self.max_requeues is not None and self.max_requeues < 0:
            raise MgpuError(f"--max-requeues {self.max_requeues}: must be >= 0 (omit it for no limit)")
        if self.max_failures < 0:
            raise MgpuError(f"--max-failures {self.max_failures}: must be >= 0")
        if f"SIG{self.requeue_signal}" not in signal.Signals.__members__:
            raise MgpuError(f"preemption.signal {self.requeue_signal!r}: not a signal name (e.g. USR2)")
        for flag, value, pattern in (("--partition", self.partition, _SLURM_NAMES),
                                     ("--account", self.account, _SLURM_NAMES),
                                     ("--qos", self.qos, _SLURM_NAMES),
                                     ("--constraint", self.constraint, _CONSTRAINT)):
            if value is None:
                continue
            if not value.strip() or any(c.isspace() for c in value):
                raise MgpuError(f"{flag} {value!r}: must be a non-empty word without spaces")
            if not pattern.fullmatch(value):
                allowed = "letters, digits and _ . + @ : - (a comma-separated list)" if pattern is _SLURM_NAMES \
                    else "feature names joined by & | , * [ ] ( ) ! (e.g. 'a100&ib')"
                raise MgpuError(f"{flag} {value!r}: Slurm expects {allowed}")
        check_line("--job-name", self.job_name)
        if not self.job_name.strip():
            raise MgpuError("--job-name: must not be empty")
        if self.exclude is not None:
            check_line("--exclude", self.exclude)
            if not _NODELIST.fullmatch(self.exclude):
                raise MgpuError(f"--exclude {self.exclude!r}: use a Slurm node list (letters, digits, . _ - [ ] ,), "
                                "e.g. gpu[01-03]")
            try:
                expand_hostlist(self.exclude)
            except HostlistError as error:
                raise MgpuError(f"--exclude {self.exclude!r}: {error}; use a Slurm node list, e.g. gpu[01-03]") \
                    from None

    @property
    def time_s(self) -> int:
        return parse_slurm_time(self.time)

    @property
    def time_min(self) -> int:
        """Whole minutes (what submitit passes to `--time`), rounded up like Slurm does."""
        return math.ceil(self.time_s / 60)

    @property
    def ntasks_per_node(self) -> int:
        return self.gpus_per_node or self.tasks_per_node or 1


def setup_lines(res: Resources, run_dirs: Sequence[Path] = (), resume: str | None = None,
                folder: str | Path | None = None) -> list[str]:
    """Lines the batch script runs before srun: what the job reads from its environment.

    `run_dirs`: one per array task (index SLURM_ARRAY_TASK_ID), for the teardown's `mgpu.run.recovery`;
    `resume`: the exact command that continues the run, quoted into every "resume" message;
    `folder`: submitit's, where a result it could not finish writing is removed before each step.
    """
    if resume:
        check_line("the resume command", resume)
    lines = [f"export MGPU_MAX_FAILURES={res.max_failures}",
             *([f"export MGPU_MAX_REQUEUES={res.max_requeues}"] if res.max_requeues is not None else []),
             # submitit's own handler in the job listens to this signal (its default, USR2, otherwise)
             f"export SUBMITIT_PREEMPT_SIGNAL={res.requeue_signal}"]
    times = [f"export {name}={int(value)}" for name, value in res.kill_times if name in (KILL_WAIT_VARIABLE,
                                                                                          GRACE_VARIABLE)]
    if times:  # read from Slurm at submission: inside the job, at the stop that needs them, Slurm may not answer
        lines += ["# the cluster's KillWait and GraceTime, read at submission (mgpu.cluster.kill_time)", *times]
    if resume:
        lines.append(f"export MGPU_RESUME_COMMAND={shlex.quote(resume)}")
    if len(run_dirs) == 1:
        lines.append(f"export MGPU_RUN_DIR={shlex.quote(str(run_dirs[0]))}")
    elif run_dirs:
        lines += [f"MGPU_RUN_DIRS=({' '.join(shlex.quote(str(d)) for d in run_dirs)})",
                  'export MGPU_RUN_DIR="${MGPU_RUN_DIRS[${SLURM_ARRAY_TASK_ID:-0}]}"']
    if run_dirs:
        # submitit writes a task's result to <result>.save_tmp, then renames it, and refuses to write one
        # where a .save_tmp exists: one left by a write that failed (a full disk) would fail every later run
        # of this job (same id, same names) at its very end. So each step starts without them.
        stale = "" if folder is None else (
            f'rm -f -- {shlex.quote(str(Path(folder).expanduser().absolute()))}/'
            '"${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}${SLURM_ARRAY_JOB_ID:+_$SLURM_ARRAY_TASK_ID}"_*_result.pkl.save_tmp; ')
        lines += ["export MGPU_RECOVERY=batch  # a failed step is requeued by the teardown, not by a rank",
                  # The teardown starts the step again with srun's own arguments, recorded here as it runs,
                  # not with a line read back from the script (another line could start with `srun ` too).
                  f'srun() {{ MGPU_SRUN_ARGS=("$@"); {stale}command srun "$@"; }}']
    return lines


_ONE_PER_NODE = ('--nodes="${SLURM_JOB_NUM_NODES:-1}" --ntasks="${SLURM_JOB_NUM_NODES:-1}" --ntasks-per-node=1 '
                 '--kill-on-bad-exit=0')


def teardown_lines() -> list[str]:
    """After srun (mgpu.run.recovery): start the step again in this allocation while recovery says `restart`
    (with the arguments the script's srun ran with, see `setup_lines`), else end with recovery's exit code (the
    code mgpu set for the step, whatever the launcher made of it). A step
    that failed for good leaves snapshots in memory on every node: removed, one task per node
    (mgpu.state.memory.store)."""
    python = shlex.quote(sys.executable)
    recovery = f'{python} -m mgpu.run.recovery --may-restart --exit-code "$rc" --run-dir "$MGPU_RUN_DIR"'
    # The job ends with recovery's code: the one mgpu set (submitit's process exits 1 for any rank's error).
    return ["rc=$?",
            "while :; do",
            f'  action=$({recovery}) && code=0 || code=$?',
            '  [ "$action" = restart ] || break',
            '  rc=0; srun "${MGPU_SRUN_ARGS[@]}" || rc=$?',
            "done",
            # One task per node: the batch environment's SLURM_NTASKS would otherwise make it one per rank.
            f'[ "$rc" = 0 ] || command srun {_ONE_PER_NODE} {python} -m '
            'mgpu.state.memory.store --remove-this-job >/dev/null 2>&1 || true',
            'exit "$code"']


def slurm_parameters(res: Resources, max_parallel: int = 4, run_dirs: Sequence[Path] = (),
                     resume: str | None = None, folder: str | Path | None = None) -> dict[str, Any]:
    """Parameters for `SlurmExecutor.update_parameters` (the names of submitit's `_make_sbatch_string`)."""
    params: dict[str, Any] = {
        "job_name": res.job_name, "nodes": res.nodes, "ntasks_per_node": res.ntasks_per_node,
        "time": res.time_min, "signal_delay_s": res.signal_lead_s, "array_parallelism": max_parallel,
        "setup": setup_lines(res, run_dirs, resume, folder), "srun_args": ["--kill-on-bad-exit=1"],
        # submitit adds --open-mode=append but not --requeue (it relies on the cluster's JobRequeue=1);
        # --mem goes through as Slurm spells it (submitit's own `mem` wants GB as a float).
        "additional_parameters": {"requeue": True, "signal": f"{res.requeue_signal}@{res.signal_lead_s}",
                                  **({"mem": res.mem} if res.mem else {})},
    }
    if run_dirs:
        params["teardown"] = teardown_lines()
    optional = {"gpus_per_node": res.gpus_per_node or None, "cpus_per_task": res.cpus_per_task,
                "partition": res.partition, "account": res.account, "qos": res.qos,
                "constraint": res.constraint, "exclude": res.exclude}
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


def submitit_folder(root: str | Path) -> Path:
    """Where submitit keeps pickles and logs: `<run.root>/submitit` (no %j: Slurm creates no directories)."""
    return Path(root).expanduser().absolute() / "submitit"


def submitit_command(folder: str | Path) -> str:
    """The command SlurmExecutor puts after srun (its `_submitit_command_str`)."""
    return " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])


def sbatch_script(res: Resources, command: str, folder: str | Path, array_size: int | None = None,
                  max_parallel: int = 4, run_dirs: Sequence[Path] = (), resume: str | None = None) -> str:
    """The exact sbatch file SlurmExecutor would submit, from submitit's own generator; submits nothing."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = slurm_parameters(res, max_parallel, run_dirs, resume, folder)
    if array_size is not None and array_size > 1:
        params["map_count"] = array_size  # what SlurmExecutor sets on its copy for an array
    return _make_sbatch_string(command=command, folder=Path(folder).expanduser().absolute(), **params)


@dataclass(frozen=True)
class Submission:
    """Validated configs (one per array task) and the overrides that made each."""

    configs: list[Config]
    overrides: list[list[str]]
    config_path: str | None
    name: str
    """run.name before any sweep suffix (the default Slurm job name)."""

    @property
    def dicts(self) -> list[dict[str, Any]]:
        return [config_to_dict(cfg) for cfg in self.configs]


def check_run_root(root: str, flag: str = "--folder") -> None:
    """MgpuError unless `root` can hold the run directories: no character Slurm or submitit would expand in
    a log file name (`%`, `\\`), not a file, and creatable (its nearest existing ancestor is a writable
    directory). Reads the filesystem only: nothing is created."""
    check_line(flag, root)
    if "%" in root or "\\" in root:
        raise MgpuError(f"{flag} {root!r}: no '%' or '\\' (Slurm and submitit expand them in log file names); "
                        "choose another directory")
    path = Path(root)
    try:
        for target in (path, path / "submitit"):
            if target.exists() and not target.is_dir():
                raise MgpuError(f"{flag} {root!r}: {target} exists and is not a directory; choose another directory")
        existing = next(p for p in (path, *path.parents) if p.exists())
    except OSError as error:  # e.g. a name longer than the filesystem allows
        raise MgpuError(f"{flag} {root!r}: {error.strerror}; choose another directory") from None
    if not existing.is_dir():
        raise MgpuError(f"{flag} {root!r}: {existing} is a file, not a directory; choose another directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise MgpuError(f"{flag} {root!r}: cannot create directories in {existing} (not writable); "
                        "choose a writable directory")


def _with_root(cfg: Config, root: str | None) -> Config:
    cfg.run.root = str(Path(root if root is not None else cfg.run.root).expanduser().absolute())
    return cfg


def build_submission(config_path: str | None, overrides: Sequence[str], sweep: Sequence[str] = (),
                     root: str | None = None) -> Submission:
    """Load and validate the config once per sweep combination; ConfigError/MgpuError in one line.

    `root` (jobs/submit.py's --folder) replaces run.root; either way it becomes absolute, so the job
    finds the same directory whatever its working directory.
    """
    base_overrides = list(overrides)
    if root is not None and not root:
        raise MgpuError("--folder '': give the directory for the runs (default: run.root)")
    flag = "--folder" if root is not None else "run.root"
    base = _with_root(load_config(config_path, base_overrides), root)
    for item in base_overrides:  # free-form values (task.args.*) are otherwise checked by nobody
        check_line("override", item)
    check_run_root(base.run.root, flag)
    check_task_target(base.task.target)
    parsed = parse_sweep(sweep)
    if not parsed:
        return Submission([base], [[]], config_path, base.run.name)
    count = math.prod(len(values) for _, values in parsed)  # before building the product: 10**10 would hang
    if count > MAX_ARRAY_SIZE:
        raise MgpuError(f"--sweep: {count} combinations exceed {MAX_ARRAY_SIZE} array tasks; sweep fewer values")
    combos = expand_sweep(parsed)
    keys = [key for key, _ in parsed]
    if base.run.dir and "run.dir" not in keys:
        raise MgpuError(f"run.dir={base.run.dir!r}: a sweep needs one directory per task; remove run.dir")
    names = [base.run.name] * len(combos) if "run.name" in keys else sweep_names(base.run.name, combos)
    configs = []
    for i, (combo, name) in enumerate(zip(combos, names)):
        extra = combo if "run.name" in keys else [*combo, f"run.name={name}"]
        try:
            cfg = _with_root(load_config(config_path, base_overrides + extra), root)
        except ConfigError as error:
            raise ConfigError(f"--sweep task {i} ({', '.join(combo)}): {error}") from None
        if cfg.task.target != base.task.target:
            check_task_target(cfg.task.target)
        if cfg.run.root != base.run.root:
            check_run_root(cfg.run.root, "run.root")
        if cfg.preemption.signal != base.preemption.signal:
            raise MgpuError("--sweep preemption.signal: one array has one sbatch --signal; do not sweep it")
        configs.append(cfg)
    return Submission(configs, combos, config_path, base.run.name)


def run_dir_for(cfg: Config) -> Path:
    """The run directory the job will use (mgpu.record.rundir: the same for every launcher and every job id)."""
    return RunDir.of(cfg.run).path


def check_resumable(cfg: Config) -> int | None:
    """Refuse (one line) a submission that could not use its run directory; the step it would resume from.

    The run is in use by a live job, or its saved config differs from this one in keys that change
    the run: either way the job would fail on its first node, so it is refused here. Returns the
    step of the run's latest checkpoint (None: a new run)."""
    run = RunDir.of(cfg.run)
    run.check_free()
    if run.config.is_file():
        try:
            saved = load_config(run.config)
        except ConfigError:
            saved = None  # an older schema: the job compares what it can, as saved in the checkpoint
        if saved is not None:
            try:
                check_resume_compatible(saved, cfg)
            except ConfigError as error:
                raise ConfigError(f"{error} (run {run.path}; --new-run starts a new one)") from None
    try:
        latest = (run.checkpoints / "latest").read_text().strip()
    except OSError:
        return None
    return int(latest[5:]) if re.fullmatch(r"step_\d{8,}", latest) else None
