"""Malformed input through every entry script, as a user would type it: one table, one rule.

Each `Case` runs as a real subprocess of `jobs/submit.py`, `jobs/status.py` or `jobs/train.py` in a
fresh directory holding `blob.yaml` (a valid config) and the case's `files`, and must:
exit with code 2; print exactly one stderr line, `<prog>: error: ...`, containing `expect` (the flag,
key or variable at fault, and what to do); print nothing on stdout and no traceback; end within
`TIMEOUT_S` under a 3 GiB address-space limit (an input that expanded without bound would otherwise fill
the machine's memory); and change nothing in its directory (a before/after snapshot). Slurm's commands
are stubs, so no case can reach the real cluster: `sbatch`, `srun`, `scontrol` and `scancel` leave a
file behind if anything calls them (the snapshot sees it), `squeue` and `sacct` answer nothing.

To add a case, append a `Case` to `CASES`: `argv` starts with the script (`submit`, `status`, `train`);
`{tmp}` is replaced by the case's directory; `files` maps relative paths to str/bytes contents (None: a
directory, `Link(target)`: a symlink, `ReadOnlyFs()`: a tmpfs mounted there, made read-only once the case's
files are in it, unmounted after the case; needs root: skipped without it, except in CI); `env` is added to
a clean environment (no launcher variables).
A case that fails today because of a file this table does not own is marked with `xfail=` saying why.

Cases by entry point (see `test_case_counts`): submit 145, status 17, train 46, check_resume 15 (223 in all); plus
`ODD_LEDGERS`, 6 ledgers whose malformed lines status skips with a one-line note (exit 0).
The cases run in a small thread pool, once per session; all of them take about 30 s on 2 cores, the
train cases with an environment to check being most of it (each imports torch before it checks).
"""

from __future__ import annotations

import os
import resource
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import pytest

from tests.conftest import PYTHON, ROOT, base_env

TIMEOUT_S = 60
MEMORY_LIMIT = 3 << 30
PROGS = {"submit": "jobs/submit.py", "status": "jobs/status.py", "train": "jobs/train.py",
         "check_resume": "mgpu/check/resume.py"}
BLOB_YAML = """\
task: {target: 'tests.tasks:BlobTask', args: {size: 32, eval_size: 8}}
data: {batch_size: 4}
train: {epochs: 1}
log: {tensorboard: false, every_steps: 0}
checkpoint: {async_save: false}
run: {name: blob}
"""
LAUGHS = "task:\n  args:\n    a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"    {b}: &{b} [{', '.join([f'*{a}'] * 10)}]\n" for a, b in zip("abcdefg", "bcdefgh"))
STUB = '#!/bin/sh\necho "$0 $*" >> "$PWD/CALLED_{name}"\nexit 1\n'  # leaves a file: the snapshot sees it
QUERY_STUB = "#!/bin/sh\nexit 0\n"  # squeue, sacct: read-only, asked by status for a run it shows


@dataclass(frozen=True)
class Link:
    """A symbolic link to `target`."""

    target: str


@dataclass(frozen=True)
class Fifo:
    """A named pipe that nobody writes to: opening it for reading would wait forever."""


@dataclass(frozen=True)
class ReadOnlyFs:
    """A filesystem mounted read-only at this directory (a tmpfs: root's chmod would not stop root's writes)."""


class MountUnavailable(Exception):
    """A `ReadOnlyFs` could not be mounted (not root)."""


Files = dict[str, Union[str, bytes, Link, Fifo, ReadOnlyFs, None]]


@dataclass(frozen=True)
class Case:
    id: str
    argv: list[str | bytes]
    """The script's name (submit, status, train), then its arguments; bytes for undecodable ones."""
    env: dict[str, str] = field(default_factory=dict)
    files: Files = field(default_factory=dict)
    expect: str = ""
    """A substring of the one error line: what names the flag, key or variable at fault."""
    xfail: str | None = None
    """Why this case fails today, in a file this table does not own (strict: it reports when fixed)."""


def _submit(id: str, *args: str | bytes, expect: str, files: Files | None = None, **kw: Any) -> Case:
    """`submit.py --dry-run --cluster slurm --config blob.yaml --folder runs <args>`: prints, never submits."""
    return Case(id, ["submit", "--dry-run", "--cluster", "slurm", "--config", "blob.yaml", "--folder", "runs", *args],
                files=files or {}, expect=expect, **kw)


def _submit_raw(id: str, *args: str | bytes, expect: str, files: Files | None = None, **kw: Any) -> Case:
    """`submit.py <args>` as given (no dry run: the stubbed sbatch shows whether it got that far)."""
    return Case(id, ["submit", *args], files=files or {}, expect=expect, **kw)


def _train(id: str, *args: str | bytes, expect: str, env: dict[str, str] | None = None, **kw: Any) -> Case:
    return Case(id, ["train", *args], env=env or {}, expect=expect, **kw)


# A config that cannot train even if an environment case got through: the run would fail on the import
# (another message), never train.
NO_TASK = ["task.target=tests.tasks:NoSuchTask", "run.root={tmp}/runs"]
SLURM_TASK = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
              "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "2"}
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29555"}


def _env(id: str, env: dict[str, str], expect: str, **kw: Any) -> Case:
    return _train(id, *NO_TASK, env=env, expect=expect, **kw)


CASES: list[Case] = [
    # ------------------------------------------------------------------ submit: resources at absurd extremes
    _submit("fsdp with single-file checkpoints", "train.parallel=fsdp", "checkpoint.format=single",
            expect="train.parallel=fsdp with checkpoint.format=single: a single-file checkpoint cannot hold a sharded "
                   "model"),
    _submit("nodes 0", "--nodes", "0", expect="--nodes 0: must be >= 1"),
    _submit("nodes negative", "--nodes", "-5", expect="--nodes -5: must be >= 1"),
    _submit("nodes 10**30", "--nodes", str(10**30), expect="--nodes 1000000000000000000000000000000: at most 100000"),
    _submit("nodes 100001", "--nodes", "100001", expect="--nodes 100001: at most 100000"),
    _submit("nodes text", "--nodes", "two", expect="argument --nodes: invalid int value: 'two'"),
    _submit("nodes float", "--nodes", "1e3", expect="argument --nodes: invalid int value: '1e3'"),
    _submit("nodes 5000 digits", "--nodes", "9" * 5000, expect="argument --nodes: invalid int value"),
    _submit("gpus negative", "--gpus-per-node", "-1", expect="--gpus-per-node -1: must be >= 0"),
    _submit("gpus 10**20", "--gpus-per-node", str(10**20), expect="--gpus-per-node 100000000000000000000: at most 512"),
    _submit("tasks 0", "--gpus-per-node", "0", "--tasks-per-node", "0", expect="--tasks-per-node 0: must be >= 1"),
    _submit("tasks huge", "--gpus-per-node", "0", "--tasks-per-node", "100000",
            expect="--tasks-per-node 100000: at most 512"),
    _submit("tasks vs gpus", "--gpus-per-node", "2", "--tasks-per-node", "3", expect="--tasks-per-node 3: with GPUs"),
    _submit("cpus 0", "--cpus-per-task", "0", expect="--cpus-per-task 0: must be in [1, 65535]"),
    _submit("cpus 10**12", "--cpus-per-task", str(10**12),
            expect="--cpus-per-task 1000000000000: must be in [1, 65535]"),
    _submit("mem words", "--mem", "lots", expect="--mem 'lots': use Slurm's <number>[K|M|G|T]"),
    _submit("mem negative", "--mem=-1G", expect="--mem '-1G'"),
    _submit("mem 10**30 T", "--mem", f"{10**30}T", expect="--mem '1000000000000000000000000000000T'"),
    _submit("mem 2 PiB", "--mem", "2048T", expect="--mem '2048T': more than 1024T per node"),
    _submit("mem trailing newline", "--mem", "64G\n", expect="--mem '64G\\n'"),
    _submit("mem space", "--mem", "64 G", expect="--mem '64 G'"),
    _submit("time 0", "--time", "0", expect="--time '0': Slurm's limit must be at least one minute"),
    _submit("time UNLIMITED", "--time", "UNLIMITED", expect="--time 'UNLIMITED': give a finite limit"),
    _submit("time infinite", "--time", "infinite", expect="--time 'infinite': give a finite limit"),
    _submit("time 99999999999 days", "--time", "99999999999-00",
            expect="longer than Slurm's maximum, 35791393 minutes"),
    _submit("time one minute too long", "--time", "35791394", expect="--time '35791394': longer than Slurm's maximum"),
    _submit("time 5000 digits", "--time", "9" * 5000, expect="longer than Slurm's maximum"),
    _submit("time 1h", "--time", "1h", expect="--time '1h': not a Slurm time"),
    _submit("time empty", "--time", "", expect="--time '': not a Slurm time"),
    _submit("time negative", "--time=-5", expect="--time '-5': not a Slurm time"),
    _submit("time newline inside", "--time", "1\n0", expect="not a Slurm time"),
    _submit("signal lead negative", "--signal-lead", "-1", expect="--signal-lead -1: must be in [10, 65535]"),
    _submit("signal lead 10**30", "--signal-lead", str(10**30), expect="must be in [10, 65535]"),
    _submit("signal lead over time", "--time", "2", "--signal-lead", "120", expect="must be shorter than --time 2"),
    _submit("signal lead text", "--signal-lead", "2m", expect="argument --signal-lead: invalid int value"),
    _submit("max requeues negative", "--max-requeues", "-1", expect="--max-requeues -1: must be >= 0"),
    _submit("max parallel 0", "--max-parallel", "0", expect="--max-parallel 0: must be >= 1"),
    _submit("max parallel -10**30", "--max-parallel", str(-10**30), expect="--max-parallel -1000"),
    _submit("poll interval nan", "--poll-interval", "nan", expect="--poll-interval nan: must be a positive number"),
    _submit("poll interval inf", "--poll-interval", "inf", expect="--poll-interval inf"),
    _submit("poll interval negative", "--poll-interval", "-1", expect="--poll-interval -1.0"),
    # ------------------------------------------------------------------ submit: values that reach #SBATCH lines
    _submit("partition with space", "--partition", "a b", expect="--partition 'a b': must be a non-empty word"),
    _submit("partition with ;", "--partition", "gpu;touch x", expect="--partition"),
    _submit("partition injects a line", "--partition", "gpu\n#SBATCH --x", expect="--partition"),
    _submit("partition trailing comma", "--partition", "gpu,", expect="--partition 'gpu,': Slurm expects"),
    _submit("account with $()", "--account", "$(id)", expect="--account '$(id)': Slurm expects"),
    _submit("account empty", "--account", "", expect="--account '': must be a non-empty word"),
    _submit("qos with backticks", "--qos", "`id`", expect="--qos '`id`'"),
    _submit("qos control character", "--qos", "q\x1b", expect="--qos"),
    _submit("constraint with ;", "--constraint", "a100;b", expect="--constraint 'a100;b': Slurm expects feature names"),
    _submit("constraint with quote", "--constraint", "a'b", expect="--constraint"),
    _submit("exclude 10**11 hosts", "--exclude", "n[0-99999999999]",
            expect="--exclude 'n[0-99999999999]': too many hosts"),
    _submit("exclude a million hosts", "--exclude", "a[1-1000]b[1-1000]", expect="more than 100000 hosts"),
    _submit("exclude unbalanced", "--exclude", "n[1-", expect="--exclude 'n[1-'"),
    _submit("exclude injects a line", "--exclude", "n1\ntouch {tmp}/pwned #", expect="--exclude 'n1\\ntouch"),
    _submit("exclude with ;", "--exclude", "n1;n2", expect="--exclude 'n1;n2': use a Slurm node list"),
    _submit("job name injects a line", "--job-name", "x\ntouch {tmp}/pwned #", expect="--job-name 'x\\ntouch"),
    _submit("job name carriage return", "--job-name", "x\rtouch", expect="--job-name 'x\\rtouch': contains a newline"),
    _submit("job name escape", "--job-name", "a\x1b[2J", expect="--job-name 'a\\x1b[2J': contains a control character"),
    _submit("job name not UTF-8", "--job-name", b"a\xff", expect="contains a byte that is not UTF-8"),
    _submit("job name empty", "--job-name", "", expect="--job-name: must not be empty"),
    _submit("job name blank", "--job-name", "   ", expect="--job-name: must not be empty"),
    Case("folder empty", ["submit", "--dry-run", "--cluster", "slurm", "--config", "blob.yaml", "--folder", ""],
         expect="--folder '': give the directory"),
    Case("folder is a file", ["submit", "--dry-run", "--cluster", "slurm", "--config", "blob.yaml", "--folder", "f"],
         files={"f": "x"}, expect="--folder '{tmp}/f': {tmp}/f exists and is not a directory"),
    Case("folder under a file", ["submit", "--dry-run", "--cluster", "slurm", "--config", "blob.yaml", "--folder",
                                 "f/runs"], files={"f": "x"}, expect="is a file, not a directory"),
    Case("folder's submitit is a file", ["submit", "--dry-run", "--cluster", "slurm", "--config", "blob.yaml",
                                         "--folder", "runs"], files={"runs/submitit": "x"},
         expect="submitit exists and is not a directory"),
    Case("folder injects a line", ["submit", "--dry-run", "--cluster", "slurm", "--config", "blob.yaml", "--folder",
                                   "{tmp}/r\ntouch {tmp}/pwned #"], expect="--folder '{tmp}/r\\ntouch"),
    Case("folder with %", ["submit", "--dry-run", "--cluster", "slurm", "--config", "blob.yaml", "--folder", "r%j"],
         expect="no '%' or '\\'"),
    Case("folder name too long", ["submit", "--dry-run", "--cluster", "slurm", "--config", "blob.yaml", "--folder",
                                  "x" * 300], expect="File name too long"),
    Case("folder not writable", ["submit", "--dry-run", "--cluster", "slurm", "--config", "blob.yaml", "--folder",
                                 "/proc/sys/mgpu-runs"],
         expect="cannot create directories in /proc/sys (not writable)"),
    Case("folder in /proc", ["submit", "--dry-run", "--cluster", "slurm", "--config", "blob.yaml", "--folder",
                             "/proc/self/status/runs"], expect="is a file, not a directory"),
    # ------------------------------------------------------------------ submit: cluster and flags
    _submit("unknown cluster", "--cluster", "k8s", expect="argument --cluster: invalid choice: 'k8s'"),
    _submit("unknown flag", "--frobnicate", expect="unrecognized arguments: --frobnicate"),
    _submit("flag without value", "--time", expect="argument --time: expected one argument"),
    _submit_raw("local on 2 nodes", "--cluster", "local", "--config", "blob.yaml", "--folder", "runs", "--nodes", "2",
                expect="--nodes 2: --cluster local runs on this machine only"),
    _submit_raw("slurm: bad partition before sbatch", "--cluster", "slurm", "--config", "blob.yaml", "--folder", "runs",
                "--partition", "a;b", expect="--partition 'a;b'"),
    _submit_raw("slurm: unlimited before sbatch", "--cluster", "slurm", "--config", "blob.yaml", "--folder", "runs",
                "--time", "INFINITE", expect="--time 'INFINITE'"),
    _submit_raw("slurm: bad run.name before sbatch", "--cluster", "slurm", "--config", "blob.yaml", "--folder", "runs",
                "run.name=a/b", expect="run.name: must be a directory name"),
    _submit_raw("debug: bad override", "--cluster", "debug", "--config", "blob.yaml", "--folder", "runs",
                "train.epochs=0", expect="train.epochs: must be >= 1"),
    # ------------------------------------------------------------------ submit: config files
    _submit_raw("config missing", "--dry-run", "--config", "nope.yaml", "--folder", "runs",
                expect="config file 'nope.yaml' not found"),
    _submit_raw("config empty path", "--dry-run", "--config", "", "--folder", "runs",
                expect="config file '.' cannot be read"),
    _submit_raw("config is a directory", "--dry-run", "--config", "d", "--folder", "runs", files={"d": None},
                expect="config file 'd' cannot be read"),
    _submit_raw("config binary", "--dry-run", "--config", "b.png", "--folder", "runs",
                files={"b.png": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"},
                expect="config file 'b.png' cannot be read"),
    _submit_raw("config NUL byte", "--dry-run", "--config", "n.yaml", "--folder", "runs",
                files={"n.yaml": "train:\x00\n"},
                expect="n.yaml: invalid YAML"),
    _submit_raw("config 2 MiB", "--dry-run", "--config", "big.yaml", "--folder", "runs",
                files={"big.yaml": "task:\n  args:\n    x: '" + "x" * (2 << 20) + "'\n"}, expect="larger than 1 MiB"),
    _submit_raw("config /dev/zero", "--dry-run", "--config", "/dev/zero", "--folder", "runs",
                expect="larger than 1 MiB"),
    _submit_raw("config /proc/self/mem", "--dry-run", "--config", "/proc/self/mem", "--folder", "runs",
                expect="config file '/proc/self/mem' cannot be read"),
    _submit_raw("config billion laughs", "--dry-run", "--config", "l.yaml", "--folder", "runs",
                files={"l.yaml": LAUGHS},
                expect="l.yaml: more than 100000 values"),
    _submit_raw("config refers to itself", "--dry-run", "--config", "s.yaml", "--folder", "runs",
                files={"s.yaml": "task:\n  args:\n    a: &a [*a]\n"}, expect="refers to itself"),
    _submit_raw("config nested 5000 deep", "--dry-run", "--config", "d.yaml", "--folder", "runs",
                files={"d.yaml": "task:\n  args:\n    x: " + "[" * 5000 + "]" * 5000 + "\n"},
                expect="nested too deeply"),
    _submit_raw("config a list", "--dry-run", "--config", "l.yaml", "--folder", "runs", files={"l.yaml": "- a\n- b\n"},
                expect="the top level must be a mapping of sections"),
    _submit_raw("config bad YAML", "--dry-run", "--config", "y.yaml", "--folder", "runs",
                files={"y.yaml": "train: [1\n"},
                expect="y.yaml:2: invalid YAML"),
    _submit_raw("config duplicate key", "--dry-run", "--config", "y.yaml", "--folder", "runs",
                files={"y.yaml": "train: {}\ntrain: {}\n"}, expect="duplicate key 'train'"),
    _submit_raw("config python tag", "--dry-run", "--config", "y.yaml", "--folder", "runs",
                files={"y.yaml": "run: !!python/object/apply:os.system ['touch pwned']\n"},
                expect="y.yaml:1: invalid YAML"),
    _submit_raw("config bad date", "--dry-run", "--config", "y.yaml", "--folder", "runs",
                files={"y.yaml": "run: {name: 2024-13-01}\n"}, expect="invalid YAML value: month must be in 1..12"),
    _submit_raw("config path with a newline", "--dry-run", "--config", "a\nb.yaml", "--folder", "runs",
                expect="the path contains a newline"),
    _submit_raw("config path not UTF-8", "--dry-run", "--config", b"\xff.yaml", "--folder", "runs",
                expect="the path contains a byte that is not UTF-8"),
    _submit_raw("config a pipe without writer", "--dry-run", "--config", "p.yaml", "--folder", "runs",
                files={"p.yaml": Fifo()}, expect="config file 'p.yaml': a pipe with nothing to read"),
    _submit_raw("config symlink loop", "--dry-run", "--config", "loop.yaml", "--folder", "runs",
                files={"loop.yaml": Link("loop.yaml")}, expect="config file 'loop.yaml' cannot be read"),
    # ------------------------------------------------------------------ submit: overrides
    _submit("override not an int", "train.epochs=abc", expect="train.epochs: expected int, got 'abc'"),
    _submit("override 1e999 batch", "data.batch_size=1e999", expect="data.batch_size: expected int, got inf"),
    _submit("override nan lr", "optim.lr=.nan", expect="optim.lr: expected float"),
    _submit("override 10**30 epochs", f"train.epochs={10**30}", expect="train.epochs: must fit in 64 bits"),
    _submit("override 5000 digits", "train.epochs=" + "9" * 5000, expect="Exceeds the limit (4300 digits)"),
    _submit("override timeout 1e300", "distributed.init_timeout_s=1e300",
            expect="distributed.init_timeout_s: must be in (0, 604800]"),
    _submit("override negative timeout", "distributed.init_timeout_s=-1", expect="distributed.init_timeout_s"),
    _submit("override seed negative", "train.seed=-1", expect="train.seed: must be in [0, 4294967296)"),
    _submit("override max steps 0", "train.max_steps=0", expect="train.max_steps: must be >= 1"),
    _submit("override run.name slash", "run.name=a/b", expect="run.name: must be a directory name"),
    _submit("override run.name ..", "run.name=..", expect="not starting with '.' or '-'"),
    _submit("override run.name dash", "run.name=-rf", expect="run.name: must be a directory name"),
    _submit("override run.name newline", 'run.name="x\\ntouch {tmp}/pwned #"',
            expect="run.name: must be a directory name"),
    _submit("override run.name space", "run.name=a b", expect="run.name: must be a directory name"),
    _submit("override run.name 201 chars", "run.name=" + "x" * 201, expect="1-200 characters"),
    _submit("override run.root newline", 'run.root="/tmp/a\\nb"', expect="run.root: must be one line"),
    _submit("override run.dir tab", 'run.dir="/tmp/a\\tb"', expect="run.dir: must be one line"),
    _submit("override signal KILL", "preemption.signal=KILL", expect="preemption.signal: cannot be 'KILL'"),
    _submit("override signal nonsense", "preemption.signal=USR9", expect="preemption.signal: 'USR9' is not a signal"),
    _submit("override not UTF-8", b"train.epochs=\xff", expect="invalid YAML"),
    _submit("override key not UTF-8", b"tr\xffain.epochs=1", expect="unknown section"),
    _submit("override no key", "=3", expect="override '=3': expected dotted.key=value"),
    _submit("override unknown section", "trian.epochs=3", expect="trian: unknown section (did you mean 'train'?)"),
    _submit("override task module missing", "task.target=no_such_pkg.mod:Task",
            expect="no module named 'no_such_pkg.mod'"),
    _submit("override task class missing", "task.target=tests.tasks:NoSuchTask", expect="defines no 'NoSuchTask'"),
    _submit("override task path-like", "task.target=../evil:X", expect="task.target: must look like"),
    _submit("override 5000 deep", "task.args.x=" + "[" * 5000, expect="nested too deeply"),
    # A plain override reaches the batch script inside the resume command (export MGPU_RESUME_COMMAND=...).
    _submit("override task.args newline srun", "task.args.note=a\nsrun touch {tmp}/pwned #",
            expect="override 'task.args.note=a\\nsrun touch"),
    _submit("override trailing newline", "train.epochs=2\n", expect="override 'train.epochs=2\\n': contains a newline"),
    _submit("override carriage return", "task.args.note=a\r", expect="override 'task.args.note=a\\r'"),
    _submit("override line separator", "task.args.note=a\u2028b", expect="override 'task.args.note=a\\u2028b'"),
    _submit("nodes trailing newline", "--nodes", "1\n", expect="--nodes '1\\n': contains a newline"),
    # ------------------------------------------------------------------ submit: sweeps
    _submit("sweep without =", "--sweep", "optim.lr", expect="--sweep 'optim.lr': expected dotted.key=v1,v2"),
    _submit("sweep without values", "--sweep", "optim.lr=", expect="--sweep 'optim.lr='"),
    _submit("sweep empty value", "--sweep", "optim.lr=1,,2", expect="--sweep 'optim.lr=1,,2'"),
    _submit("sweep key without section", "--sweep", "lr=1,2", expect="--sweep 'lr=1,2'"),
    _submit("sweep key misspelt", "--sweep", "optim.lr\u00e9=1,2", expect="optim.lr\u00e9: unknown key"),
    _submit("sweep 10**10 combinations",
            *[a for i in range(10) for a in ("--sweep", f"task.args.k{i}=" + ",".join(map(str, range(10))))],
            expect="--sweep: 10000000000 combinations exceed 1000 array tasks"),
    _submit("sweep 1001 values", "--sweep", "train.seed=" + ",".join(map(str, range(1001))),
            expect="--sweep: 1001 combinations exceed 1000"),
    _submit("sweep key twice", "--sweep", "optim.lr=1,2", "--sweep", "optim.lr=3", expect="optim.lr is swept twice"),
    _submit("sweep the signal", "--sweep", "preemption.signal=USR2,XCPU", expect="--sweep preemption.signal"),
    _submit("sweep with run.dir", "run.dir=/x", "--sweep", "optim.lr=1,2", expect="run.dir='/x': a sweep needs one"),
    _submit("sweep bad value", "--sweep", "optim.lr=0.1,-1",
            expect="--sweep task 1 (optim.lr=-1): optim.lr: must be > 0"),
    _submit("sweep unknown key", "--sweep", "optim.lrr=1,2",
            expect="optim.lrr: unknown key (did you mean 'optim.lr'?)"),
    _submit("sweep control character", "--sweep", "task.args.x=a,'b\n\nc'", expect="--sweep"),
    _submit("sweep run.name escapes", "--sweep", "run.name=a,../b", expect="run.name: must be a directory name"),
    # ------------------------------------------------------------------ status: targets and ledgers
    Case("status no target", ["status"], expect="the following arguments are required: RUN_DIR_OR_JOB_ID"),
    Case("status empty target", ["status", ""], expect="RUN_DIR_OR_JOB_ID '': give a run directory or a job id"),
    Case("status unknown flag", ["status", "5", "--frobnicate"], expect="unrecognized arguments: --frobnicate"),
    Case("status two targets", ["status", "5", "6"], expect="unrecognized arguments: 6"),
    Case("status no such job", ["status", "999", "--folder", "runs"], files={"runs": None},
         expect="'999': neither a run directory nor a Slurm job id"),
    Case("status no such path", ["status", "/nonexistent/run-5"], expect="'/nonexistent/run-5': no such run directory"),
    Case("status relative path", ["status", "../nope-5"], expect="'../nope-5': no such run directory"),
    Case("status target newline", ["status", "5\n6", "--folder", "runs"], files={"runs": None},
         expect="RUN_DIR_OR_JOB_ID '5\\n6': contains a newline"),
    Case("status target not UTF-8", ["status", b"\xff", "--folder", "runs"], files={"runs": None},
         expect="contains a byte that is not UTF-8"),
    Case("status folder missing", ["status", "5"], expect="--folder 'runs': no such directory"),
    Case("status folder is a file", ["status", "5", "--folder", "f"], files={"f": "x"},
         expect="--folder 'f': no such directory"),
    Case("status folder newline", ["status", "5", "--folder", "a\nb"], expect="--folder 'a\\nb': contains a newline"),
    Case("status match is a file", ["status", "5", "--folder", "runs"], files={"runs/blob-5": "x"},
         expect="'5': neither a run directory nor a Slurm job id found in the ledgers under runs"),
    Case("status ledger is a directory", ["status", "runs/blob-5"], files={"runs/blob-5/events.jsonl": None},
         expect="events.jsonl: cannot read the ledger: Is a directory"),
    Case("status ledger unreadable", ["status", "runs/blob-5"],
         files={"runs/blob-5/events.jsonl": Link("/proc/self/mem")},
                                                 expect="cannot read the ledger: Input/output error"),
    Case("status ledger too big", ["status", "runs/blob-5"], files={"runs/blob-5/events.jsonl": Link("/dev/zero")},
         expect="events.jsonl: larger than 256 MiB"),
    Case("status glob characters", ["status", "[", "--folder", "runs"], files={"runs": None},
         expect="'[': neither a run directory nor a Slurm job id"),
    # ------------------------------------------------------------------ train: arguments and configs
    _train("train unknown flag", "--frobnicate", expect="unrecognized arguments: --frobnicate"),
    _train("train stop at 0", "--stop-at-step", "0", expect="--stop-at-step 0: must be >= 1"),
    _train("train stop at -1", "--stop-at-step=-1", expect="--stop-at-step -1: must be >= 1"),
    _train("train stop at text", "--stop-at-step", "x", expect="argument --stop-at-step: invalid int value: 'x'"),
    _train("train config missing", "--config", "nope.yaml", expect="config file 'nope.yaml' not found"),
    _train("train config directory", "--config", ".", expect="config file '.' cannot be read"),
    _train("train config /dev/zero", "--config", "/dev/zero", expect="larger than 1 MiB"),
    _train("train config path newline", "--config", "a\nb", expect="the path contains a newline"),
    _train("train bad override", "train.epochs=x", expect="train.epochs: expected int, got 'x'"),
    _train("train intermixed, bad second override", "--config", "blob.yaml", "train.epochs=1", "--stop-at-step", "3",
           "train.seed=x", expect="train.seed: expected int, got 'x'"),  # before: unrecognized arguments
    _train("train run.name escapes", "run.name=../../etc", expect="run.name: must be a directory name"),
    _train("train run.dir newline", 'run.dir="a\\nb"', expect="run.dir: must be one line"),
    _train("train timeout 1e300", "distributed.init_timeout_s=1e300", expect="distributed.init_timeout_s: must be in"),
    _train("train 10**30 batch", f"data.batch_size={10**30}", expect="data.batch_size: must fit in 64 bits"),
    _train("train static graph with accumulation", "train.static_graph=true", "train.grad_accum=2",
           expect="train.static_graph: true with train.grad_accum=2 fails in torch's DDP"),
    # ------------------------------------------------------------------ train: tasks that break the contract
    # (each found before training starts; the run directory this attempt created is removed again)
    _train("train empty training set", "task.target=tests.tasks:EmptyTrainTask", "run.root={tmp}/runs",
           expect="EmptyTrainTask.train_dataset() is empty"),
    _train("train streaming dataset", "task.target=tests.tasks:StreamTask", "run.root={tmp}/runs",
           expect="StreamTask.train_dataset() returned an IterableDataset"),
    _train("train dataset without len", "task.target=tests.tasks:NoLenTask", "run.root={tmp}/runs",
           expect="NoLenTask.train_dataset() returned a NoLen, which has no len()"),
    _train("train empty eval set", "task.target=tests.tasks:EmptyEvalTask", "run.root={tmp}/runs",
           expect="EmptyEvalTask.eval_dataset() is empty (Blobs of length 0): return None"),
    _train("train scalar metric", "task.target=tests.tasks:ScalarMetricTask", "run.root={tmp}/runs",
           expect="ScalarMetricTask.metrics must return one value per sample (shape [batch]) for every tensor "
                  "metric: 'loss' is []"),
    _train("train peers never come", "task.target=tests.tasks:BlobTask", "run.root={tmp}/runs",
           "distributed.init_timeout_s=2", env={**TORCHRUN, "MASTER_PORT": "29557"},
           expect="rendezvous failed: rank 0 waited 2 s at 127.0.0.1:29557 for all 2 ranks"),
    _train("train run.dir is a file", "task.target=tests.tasks:BlobTask", "run.dir={tmp}/f", files={"f": "x"},
           expect="/f is a file, not a directory"),
    _train("train run directory read-only", "task.target=tests.tasks:BlobTask", "run.dir={tmp}/ro/run",
           files={"ro": ReadOnlyFs(), "ro/run/logs": None},
           expect="run directory {tmp}/ro/run: cannot write {tmp}/ro/run/logs/rank0.log (Read-only file system)"),
    _train("train run.dir under a file", "task.target=tests.tasks:BlobTask", "run.dir={tmp}/f/run", files={"f": "x"},
           expect="cannot create it (Not a directory)"),
    _train("train checkpoints is a file", "task.target=tests.tasks:BlobTask", "run.dir={tmp}/run",
           files={"run/checkpoints": "x"}, expect="run/checkpoints is a file, not a directory"),
    _train("train billion laughs", "--config", "{tmp}/l.yaml",
           expect="more than 100000 values", files={"l.yaml": LAUGHS}),
    # ------------------------------------------------------------------ train: garbage in the launcher's variables
    # (mgpu/cluster/environment.py and mgpu/train/job.py decide these; each imports torch first, hence few.)
    _env("env MGPU_MAX_REQUEUES text", {"MGPU_MAX_REQUEUES": "ten"}, "MGPU_MAX_REQUEUES='ten' is not a count"),
    _env("env MGPU_MAX_FAILURES negative", {"MGPU_MAX_FAILURES": "-1"}, "MGPU_MAX_FAILURES='-1' is not a count"),
    _env("env SLURM_PROCID text", {**SLURM_TASK, "SLURM_PROCID": "abc"}, "SLURM_PROCID='abc' is not an integer"),
    _env("env SLURM_JOB_ID without a node list", {"SLURM_JOB_ID": "x", "SLURM_PROCID": "0"},
         "SLURM_JOB_NODELIST is not set: launch every task with srun"),
    _env("env SLURM_PROCID 10**30", {**SLURM_TASK, "SLURM_PROCID": str(10**30)}, "SLURM_PROCID=1000"),
    _env("env batch shell of 2 tasks", {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                                        "SLURM_JOB_NODELIST": "n1"},
         "running in the batch shell of a 2-task Slurm job"),
    _env("env SLURM_PROCID beyond", {**SLURM_TASK, "SLURM_PROCID": "5"}, "SLURM_PROCID=5 but the step has 2 tasks"),
    _env("env nodelist 10**11 hosts", {**SLURM_TASK, "SLURM_JOB_NODELIST": "n[0-99999999999]"},
         "SLURM_JOB_NODELIST: too many hosts in range"),
    _env("env nodelist unbalanced", {**SLURM_TASK, "SLURM_JOB_NODELIST": "n[1-"}, "SLURM_JOB_NODELIST: unbalanced"),
    _env("env tasks per node 10**11", {**SLURM_TASK, "SLURM_TASKS_PER_NODE": "1(x99999999999)"},
         "SLURM_TASKS_PER_NODE: task counts"),
    _env("env restart count text", {**SLURM_TASK, "SLURM_RESTART_COUNT": "-x"}, "SLURM_RESTART_COUNT='-x'"),
    _env("env GPU count text", {**SLURM_TASK, "SLURM_GPUS_ON_NODE": "many"}, "SLURM_GPUS_ON_NODE='many' is not a GPU"),
    _env("env MASTER_PORT 99999", {"MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a TCP port"),
    _env("env torchrun WORLD_SIZE text", {**TORCHRUN, "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not an integer"),
    _env("env torchrun RANK beyond", {**TORCHRUN, "RANK": "7"}, "RANK=7/LOCAL_RANK=0 outside WORLD_SIZE=2"),
    _env("env torchrun nodelist", {**TORCHRUN, "SLURM_JOB_NODELIST": "n[1-"}, "SLURM_JOB_NODELIST"),
    _env("env submitit local without ids", {"SUBMITIT_EXECUTOR": "local"}, "SUBMITIT_LOCAL_GLOBALID is not set"),
    _env("env submitit rank beyond", {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_GLOBALID": "3",
                                      "SUBMITIT_LOCAL_LOCALID": "0", "SUBMITIT_LOCAL_NTASKS": "2"},
         "SUBMITIT_LOCAL_GLOBALID=3 outside SUBMITIT_LOCAL_NTASKS=2"),
    _env("env SLURM_NODEID beyond", {**SLURM_TASK, "SLURM_NODEID": "3"}, "SLURM_NODEID=3 but the step has 1 nodes"),
    _env("env node count contradicts", {**SLURM_TASK, "SLURM_JOB_NUM_NODES": "4"}, "names 1 nodes but"),
    # ------------------------------------------------------------------ check_resume (mgpu/check/resume.py)
    Case("check nothing", ["check_resume"], expect="nothing to check"),
    Case("check no script", ["check_resume", "--", "nosuch.py", "{run}"], expect="nosuch.py: no such script"),
    Case("check no {run}", ["check_resume", "--", "loop.py"], files={"loop.py": "x"}, expect="put {run} in its"),
    Case("check nproc 0", ["check_resume", "--nproc", "0", "--", "loop.py", "{run}"], files={"loop.py": "x"},
         expect="--nproc 0"),
    Case("check steps 1", ["check_resume", "--steps", "1", "--", "loop.py", "{run}"], files={"loop.py": "x"},
         expect="--steps 1"),
    Case("check stop-at beyond", ["check_resume", "--steps", "4", "--stop-at", "4", "--", "loop.py", "{run}"],
         files={"loop.py": "x"}, expect="--stop-at 4"),
    Case("check checks unknown", ["check_resume", "--checks", "stop,bogus", "--", "loop.py", "{run}"],
         files={"loop.py": "x"}, expect="--checks stop,bogus"),
    Case("check timeout 0", ["check_resume", "--timeout", "0", "--", "loop.py", "{run}"], files={"loop.py": "x"},
         expect="--timeout 0"),
    # nan and inf would never expire (every comparison with nan is false): a hung loop held the check forever
    Case("check timeout nan", ["check_resume", "--timeout", "nan", "--", "loop.py", "{run}"], files={"loop.py": "x"},
         expect="--timeout nan: must be a number of seconds > 0"),
    Case("check timeout inf", ["check_resume", "--timeout", "inf", "--", "loop.py", "{run}"], files={"loop.py": "x"},
         expect="--timeout inf: must be a number of seconds > 0"),
    Case("check config and script", ["check_resume", "--config", "blob.yaml", "--", "loop.py", "{run}"],
         files={"loop.py": "x"}, expect="not both"),
    Case("check config bad key", ["check_resume", "--config", "blob.yaml", "train.epoch=2"], expect="train.epoch"),
    Case("check config run.dir", ["check_resume", "--config", "blob.yaml", "run.dir=x"], expect="run.dir"),
    Case("check config stray word", ["check_resume", "--config", "blob.yaml", "epochs"], expect="unrecognized"),
    Case("check keep not empty", ["check_resume", "--keep", "kept", "--", "loop.py", "{run}"],
         files={"loop.py": "x", "kept/a": "x"}, expect="--keep kept: not empty"),
]

# Ledgers with malformed lines: status shows the rest, exit 0, one note on stderr naming the lines.
ODD_LEDGERS: dict[str, tuple[bytes, str]] = {
    "not objects": (b'[1]\n"x"\n3\nnull\n{"time": 1, "event": "started"}\n',
                    "skipped 4 malformed line(s) (line 1, 2, 3, 4)"),
    "missing fields": (b'{"event": "started"}\n{"time": 1}\n{"time": 2, "event": "started"}\n', "(line 1, 2)"),
    "wrong types": (b'{"time": "1", "event": "x"}\n{"time": true, "event": "x"}\n{"time": 1, "event": 5}\n'
                    b'{"time": NaN, "event": "x"}\n{"time": 1e999, "event": "x"}\n', "skipped 5 malformed line(s)"),
    "not UTF-8": (b'\xff\xfe\x00{"time"\n{"time": 1, "event": "started", "restart": "x"}\n', "(line 1)"),
    "odd field types": (b'{"time": 1, "event": "resumed", "restart": [1], "step": "7"}\n{"time": 1, "event": 1}\n'
                        b'{"time": 2, "event": "checkpoint_saved", "step": null, "reason": 3}\n', "(line 2)"),
    "deep JSON": (b"[" * 100_000 + b"]" * 100_000 + b'\n{"time": 1, "event": "started"}\n', "(line 1)"),
}


def _prog(case: Case) -> str:
    return str(case.argv[0])


def _fill(value: str | bytes, tmp: Path) -> str | bytes:
    return value.replace("{tmp}", str(tmp)) if isinstance(value, str) else value


def _stubs(bin_dir: Path) -> str:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ("sbatch", "srun", "scontrol", "scancel", "squeue", "sacct"):
        (bin_dir / name).write_text(QUERY_STUB if name in ("squeue", "sacct") else STUB.replace("{name}", name))
        (bin_dir / name).chmod(0o755)
    return f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"


def _mount(where: Path, *options: str) -> None:
    proc = subprocess.run(["mount", "-t", "tmpfs", *options, "tmpfs", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise MountUnavailable(f"cannot mount a tmpfs at {where} ({proc.stderr.strip() or 'not root'})")


def _make(tmp: Path, files: Files, mounts: list[Path]) -> None:
    """The case's files; a `ReadOnlyFs` is mounted (appended to `mounts`) before, and made read-only after."""
    (tmp / "blob.yaml").write_text(BLOB_YAML)
    for rel, content in files.items():
        if isinstance(content, ReadOnlyFs):
            (tmp / rel).mkdir(parents=True, exist_ok=True)
            _mount(tmp / rel, "-o", "size=1m")
            mounts.append(tmp / rel)
    for rel, content in files.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, ReadOnlyFs):
            continue
        if content is None:
            path.mkdir(exist_ok=True)
        elif isinstance(content, Link):
            path.symlink_to(content.target)
        elif isinstance(content, Fifo):
            os.mkfifo(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    for where in mounts:
        _mount(where, "-o", "remount,ro")


def _unmount(mounts: list[Path]) -> None:
    for where in reversed(mounts):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _snapshot(tmp: Path) -> dict[str, tuple[int, int, int]]:
    found = {}
    for dirpath, dirnames, filenames in os.walk(tmp):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            found[str(path.relative_to(tmp))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return found


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@dataclass
class Outcome:
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    changed: list[str]
    """Paths under the case's directory created, removed or modified by the run."""
    tmp: Path
    skipped: str | None = None
    """Why the case could not be set up here (a `ReadOnlyFs` without root)."""


def run_case(argv: list[str | bytes], files: Files, env: dict[str, str], tmp: Path, path: str) -> Outcome:
    """Run one entry script in `tmp` (its working directory) and report what it did there."""
    tmp.mkdir(parents=True)
    mounts: list[Path] = []
    try:
        _make(tmp, files, mounts)
        return _run_made(argv, env, tmp, path)
    except MountUnavailable as unavailable:
        return Outcome(None, "", "", 0.0, [], tmp, skipped=str(unavailable))
    finally:
        _unmount(mounts)


def _run_made(argv: list[str | bytes], env: dict[str, str], tmp: Path, path: str) -> Outcome:
    before = _snapshot(tmp)
    script = str(ROOT / PROGS[str(argv[0])])
    args = [_fill(a, tmp) for a in argv[1:]]
    full_env = base_env(PATH=path, **{k: str(_fill(v, tmp)) for k, v in env.items()})
    start = time.perf_counter()
    try:
        proc = subprocess.run([PYTHON, script, *args], cwd=tmp, env=full_env, capture_output=True, timeout=TIMEOUT_S,
                              preexec_fn=_limit_memory)
        code: int | None = proc.returncode
        out, err = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as expired:
        code, out, err = None, expired.stdout or b"", expired.stderr or b""
    seconds = time.perf_counter() - start
    after = _snapshot(tmp)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return Outcome(code, out.decode(errors="backslashreplace"), err.decode(errors="backslashreplace"), seconds, changed,
                   tmp)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """Every case, run once in a pool of 3 (torch-importing train cases first: they are the long ones)."""
    base = tmp_path_factory.mktemp("bad_input")
    path = _stubs(base / "bin")
    order = sorted(CASES, key=lambda c: not (c.argv[0] == "train" and c.env))
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {case.id: pool.submit(run_case, case.argv, case.files, case.env, base / f"case{i}", path)
                   for i, case in enumerate(order)}
        return {case_id: future.result() for case_id, future in futures.items()}


def test_case_ids_are_unique() -> None:
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def test_case_counts() -> None:
    """The counts the module docstring states, by entry point."""
    counts = {prog: sum(_prog(case) == prog for case in CASES) for prog in PROGS}
    assert counts == {"submit": 145, "status": 17, "train": 46, "check_resume": 15}, counts


@pytest.mark.multiprocess  # `outcomes` runs every case as a process of its own (46 of them import torch)
@pytest.mark.parametrize("case", [
    pytest.param(case, id=case.id, marks=[pytest.mark.xfail(reason=case.xfail, strict=True)] if case.xfail else [])
    for case in CASES])
def test_bad_input(case: Case, outcomes: dict[str, Outcome]) -> None:
    result = outcomes[case.id]
    if result.skipped is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(result.skipped, pytrace=False)
        pytest.skip(result.skipped)
    prog = _prog(case)
    where = f"{case.argv!r}\nexit {result.returncode} in {result.seconds:.1f} s\nstdout: {result.stdout[-2000:]}\n" \
            f"stderr: {result.stderr[-3000:]}"
    assert result.returncode is not None, f"no answer within {TIMEOUT_S} s: {where}"
    assert "Traceback" not in result.stdout + result.stderr, where
    assert result.returncode == 2, where
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), where
    assert str(_fill(case.expect, result.tmp)) in lines[0], where
    assert result.stdout == "", where
    assert result.changed == [], f"changed on disk: {result.changed}\n{where}"


@pytest.mark.parametrize("name", list(ODD_LEDGERS))
def test_status_skips_malformed_ledger_lines(name: str, tmp_path: Path) -> None:
    content, note = ODD_LEDGERS[name]
    result = run_case(["status", "runs/blob-5"], {"runs/blob-5/events.jsonl": content}, {}, tmp_path / "case",
                      _stubs(tmp_path / "bin"))
    where = f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    assert result.returncode == 0 and "Traceback" not in result.stdout + result.stderr, where
    assert result.stdout.startswith("run         runs/blob-5\n"), where
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and note in lines[0], where
    assert lines[0].startswith("status: note: runs/blob-5/events.jsonl: skipped "), where
    assert result.changed == []


def test_train_accepts_intermixed_overrides() -> None:
    from jobs.train import parse_args

    args = parse_args(["--config", "x.yaml", "a.b=1", "--stop-at-step", "3", "c.d=2"])
    assert (args.config, args.overrides, args.stop_at_step) == ("x.yaml", ["a.b=1", "c.d=2"], 3)
