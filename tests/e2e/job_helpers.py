"""Helpers for the end-to-end jobs: submitting the way users do, following a run through its ledger and
logs, and uninterrupted reference runs to compare final weights with. Shared by test_jobs.py and the
fault matrix (test_fault_matrix.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from slurm_helpers import hostnames, sacct, sbatch, wait_until

from mgpu.state.single.store import CheckpointStore
from mgpu.cluster.environment import derive_master_port
from mgpu.record.ledger import read_ledger
from tests.conftest import PYTHON, ROOT, base_env
from tests.test_trainer import assert_identical

if TYPE_CHECKING:
    from conftest import SlurmCluster

SUBMIT = str(ROOT / "jobs" / "submit.py")
TRAIN = str(ROOT / "jobs" / "train.py")
TORCHRUN = str(Path(PYTHON).parent / "torchrun")

# A quick job: 40 samples, 4 per rank; 2 epochs.
BLOB = ["task.target=tests.tasks:BlobTask", "train.epochs=2", "data.batch_size=4", "log.every_steps=1"]
# The job that gets interrupted: 0.2 s per step; 2 ranks x 2 samples -> 10 steps per epoch, 30 in all;
# a checkpoint every 2 steps (what a killed rank resumes from). Dropout, batch norm, warmup + cosine.
SLOW = ["task.target=tests.tasks:SlowBlobTask", "task.args.step_s=0.2", "train.epochs=3", "data.batch_size=2",
        "log.every_steps=1", "checkpoint.every_steps=2", "schedule.name=cosine", "schedule.warmup_steps=3",
        "optim.lr=0.01"]
# The same job over a token-shard stream (tests.e2e.jobtasks.SlowStreamTask): 40 windows, 10 steps an epoch too.
# `data_dir` (where the task writes its shards) is the caller's: slow_stream(dir).
def slow_stream(data_dir: Path) -> list[str]:
    return ["task.target=tests.e2e.jobtasks:SlowStreamTask", f"task.args.data_dir={data_dir}",
            *[arg for arg in SLOW if not arg.startswith("task.")], "task.args.step_s=0.2"]


SLOW_STEPS = 30
STEPS_PER_EPOCH = 10
# World size 4 (2 nodes x 2 ranks): 40 samples, 1 per rank -> 10 steps per epoch as well. No batch norm
# (one sample per rank per step). DDP's defaults: a resumed run gets the saved gradient buckets (mgpu.parallel.ddp), so
# with 3+ ranks too it reduces in the same order as the uninterrupted one.
SLOW4 = [*SLOW, "data.batch_size=1", "task.args.batch_norm=false"]
TWO_RANKS = ["--nodes", "2", "--gpus-per-node", "1"]
FOUR_RANKS = ["--nodes", "2", "--gpus-per-node", "2"]
ALL_CPUS = ["--cpus-per-task", "4"]  # with 1 task per node: both nodes full, a `high` job must preempt
KILL_WAIT_S = 5


# ---------------------------------------------------------------------------------------------- helpers
def submit(folder: Path, *args: str, environ: dict[str, str] | None = None) -> tuple[list[str], list[Path]]:
    """`jobs/submit.py --cluster slurm` into `folder` (`environ`: added to its environment, which the job gets);
    the job ids and run directories it printed."""
    cmd = [PYTHON, SUBMIT, "--cluster", "slurm", "--partition", "main", "--time", "10", "--folder", str(folder),
           *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=base_env(**(environ or {})), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
    ids = re.findall(r"^slurm job (\S+)$", proc.stdout, re.M)
    dirs = [Path(p) for p in re.findall(r"^\s+run directory\s+(\S+)$", proc.stdout, re.M)]
    assert ids and len(ids) == len(dirs), proc.stdout
    return ids, dirs


def submit_one(folder: Path, *args: str, environ: dict[str, str] | None = None) -> tuple[str, Path]:
    ids, dirs = submit(folder, *args, environ=environ)
    assert len(ids) == 1
    return ids[0], dirs[0]


def preempt(cluster: SlurmCluster, node: str | None = None) -> str:
    """A 1-CPU job in partition `high` (on `node`): Slurm must preempt what fills the node(s)."""
    where = ["-w", node] if node else []
    return sbatch(cluster, "-p", "high", "-N1", "-n1", *where, "-o", "/dev/null", "--wrap", "sleep 1")


def cancel(cluster: SlurmCluster, *jobids: str) -> None:
    for jobid in jobids:
        if jobid:
            cluster.run("scancel", jobid, check=False)


def job_output(folder: Path, jobid: str) -> str:
    """The tail of rank 0's submitit stdout and stderr (for assertion messages)."""
    paths = [folder / "submitit" / f"{jobid}_0_log.{kind}" for kind in ("out", "err")]
    return "\n".join(p.read_text()[-2000:] for p in paths if p.exists())


def events(run_dir: Path, name: str | None = None) -> list[dict[str, Any]]:
    from mgpu.record.failures import merge, read_failures  # the ranks' own failures are files of their own

    found = merge(read_ledger(run_dir / "events.jsonl"), read_failures(run_dir))
    return [e for e in found if name is None or e["event"] == name]


def run_progress(run_dir: Path) -> tuple[int, list[int]]:
    """(runs started, steps logged by the latest run) from rank 0's log, which every run appends to."""
    path = run_dir / "logs" / "rank0.log"
    text = path.read_text() if path.exists() else ""
    parts = re.split(r"starts at step \d+", text)
    return len(parts) - 1, [int(s) for s in re.findall(r"\bstep (\d+)/\d+", parts[-1])] if len(parts) > 1 else []


def wait_steps(run_dir: Path, run: int, steps: int, timeout: float = 90,
               when: Callable[[int], bool] = lambda step: True) -> int:
    """Wait until run number `run` (1 = the first) has logged `steps` steps and its last step satisfies
    `when`; returns that step."""
    def ready() -> int | None:
        started, logged = run_progress(run_dir)
        if started == run and len(logged) >= steps and when(logged[-1]):
            return logged[-1]
        return None

    return int(wait_until(f"run {run} of {run_dir.name} to log {steps} steps", ready, timeout, interval=0.1))


def mid_epoch(step: int) -> bool:
    """Far enough from the epoch's end that the stop (a few steps later at most) is mid-epoch too."""
    return 1 <= step % STEPS_PER_EPOCH <= 4


def checkpoint_state(run_dir: Path) -> dict[str, Any]:
    """The latest valid checkpoint's state: a single file's, or a sharded one's consolidated (model, `optim`
    keyed by parameter name, scheduler, progress, rng: mgpu.state.sharded.export)."""
    return latest_checkpoint(run_dir)[0]


def latest_checkpoint(run_dir: Path) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """(state, the newer checkpoints skipped as broken) of the latest valid checkpoint, single-file or sharded."""
    from mgpu.record.ledger import Ledger
    from mgpu.state.sharded.checkpointer import ShardedCheckpointer
    from mgpu.state.sharded.export import consolidate, is_sharded_checkpoint

    store = CheckpointStore(run_dir / "checkpoints")
    newest = store.latest_path()
    if newest is not None and is_sharded_checkpoint(newest):
        sharded = ShardedCheckpointer(store.directory, 0, 1, Ledger(None, "", 0)).find_latest()
        assert sharded is not None, f"no valid sharded checkpoint in {run_dir}"
        return consolidate(sharded.path), tuple(sharded.skipped)
    loaded = store.latest()
    assert loaded is not None, f"no checkpoint in {run_dir}"
    return loaded.state, tuple(loaded.skipped)


def assert_same_training(run_dir: Path, reference: dict[str, Any]) -> None:
    state = checkpoint_state(run_dir)
    assert state["progress"]["step"] == reference["progress"]["step"] == SLOW_STEPS
    assert_identical(state["model"], reference["model"], "model")
    assert_identical(state["optimizer"], reference["optimizer"], "optimizer")
    assert_identical(state["scheduler"], reference["scheduler"], "scheduler")


def assert_resumed_where_stopped(run_dir: Path, stops: int) -> list[int]:
    """`stops` preemption stops, each saved and resumed from at exactly that step; finished at the end."""
    preempted = [e["step"] for e in events(run_dir, "preempted")]
    resumed = [e["step"] for e in events(run_dir, "resumed")]
    saved = {e["step"] for e in events(run_dir, "checkpoint_saved")}
    assert len(preempted) == stops, events(run_dir)
    assert resumed == preempted, f"resumed at {resumed}, stopped at {preempted}"
    assert set(preempted) <= saved, f"stop steps {preempted} not all saved ({sorted(saved)})"
    assert [e["restart"] for e in events(run_dir, "resumed")] == list(range(1, stops + 1))
    finished = events(run_dir, "finished")
    assert [(e["step"], e["restart"]) for e in finished] == [(SLOW_STEPS, stops)], finished
    return preempted


def rank_record(run_dir: Path, rank: int) -> dict[str, Any]:
    return json.loads((run_dir / "logs" / f"rank{rank}.json").read_text())


def assert_placement(cluster: SlurmCluster, jobid: str, run_dir: Path, world: int, per_node: int,
                     launcher: str, whole_run: bool = True) -> None:
    """Every rank's logs/rank<N>.json against Slurm's own view of the allocation; with `whole_run`, the run
    started once and finished (else it may be running still)."""
    nodelist = sacct(cluster, jobid)[-1]["NodeList"]
    nodes = hostnames(cluster, nodelist)
    assert nodes == list(cluster.nodes), nodelist
    pids = set()
    for rank in range(world):
        r = rank_record(run_dir, rank)
        node_rank = rank // per_node  # Slurm's block distribution; torchrun's --node-rank=$SLURM_NODEID
        want = {"launcher": launcher, "rank": rank, "local_rank": rank % per_node, "world_size": world,
                "local_world_size": per_node, "node_rank": node_rank, "num_nodes": 2, "nodes": nodes,
                "job_id": jobid, "restart_count": 0, "master_addr": nodes[0],
                "master_port": derive_master_port(jobid), "slurmd_nodename": nodes[node_rank],
                "hostname": nodes[node_rank], "backend": "gloo"}
        assert {k: r[k] for k in want} == want, f"rank {rank}: {r}"
        if launcher == "slurm":
            assert r["gpus_per_node"] == per_node
        pids.add((r["hostname"], r["pid"]))
    assert len(pids) == world
    if not whole_run:
        return
    started = events(run_dir, "started")
    assert [(e["world_size"], e["nodes"], e["launcher"]) for e in started] == [(world, nodes, launcher)]
    assert len(events(run_dir, "finished")) == 1


# --------------------------------------------------------------------------- uninterrupted references
class Reference:
    """An uninterrupted torchrun run of SLOW (or SLOW4) on this machine, started in the background; the first process
    of a test session to ask for `run_dir` trains it, any other (pytest-xdist's other worker) reads its result.

    Training claims the directory (`<run_dir>.claim`, created exclusively); the run's exit status lands in
    `<run_dir>.rc` when it ends, written by the shell that ran it, so a reader does not depend on the trainer's
    process. Its rendezvous port is one the kernel picked (ephemeral: never a Slurm job's derived port)."""

    def __init__(self, run_dir: Path, world: int, config: list[str]) -> None:
        self.run_dir = run_dir
        self.rc_path = run_dir.parent / f"{run_dir.name}.rc"
        self.log_path = run_dir.parent / f"{run_dir.name}.out"
        self._state: dict[str, Any] | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            (run_dir.parent / f"{run_dir.name}.claim").open("x").close()
        except FileExistsError:
            return  # another worker of this session trains it
        cmd = [TORCHRUN, "--nproc-per-node", str(world), "--master-port", str(free_port()), TRAIN, f"run.dir={run_dir}",
               *config]
        script = f"{shlex.join(cmd)} >{shlex.quote(str(self.log_path))} 2>&1; echo $? >{self.rc_path}.new && " \
                 f"mv {self.rc_path}.new {self.rc_path}"
        self.proc = subprocess.Popen(["sh", "-c", script], cwd=ROOT, env=base_env(), start_new_session=True)

    def state(self) -> dict[str, Any]:
        if self._state is None:
            wait_until(f"the reference run {self.run_dir}", self.rc_path.exists, timeout=180)
            out = self.log_path.read_text() if self.log_path.exists() else ""
            assert self.rc_path.read_text().strip() == "0", f"reference run failed:\n{out[-3000:]}"
            self._state = checkpoint_state(self.run_dir)
        return self._state

    def close(self, wait_s: float = 0) -> None:
        """End the run if this process trains it: after up to `wait_s` for it to finish (another worker may need it)."""
        if self.proc is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=wait_s)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def free_port() -> int:
    """A port the kernel hands out now (in the ephemeral range: no Slurm job of the test clusters derives one there)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
