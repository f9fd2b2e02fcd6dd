"""Training jobs on the real local Slurm cluster: placement, preemption, requeue, time limit, scancel,
the requeue budget, a killed rank, job arrays. Real sbatch/srun/scontrol/scancel, no mocks.

Every job is submitted the way users do (jobs/submit.py, or sbatch on the templates), every wait is
bounded, and every job is cancelled in `finally`. Bit-identity is checked against one uninterrupted
run per world size of the same config, started in the background when the module starts (torchrun
on this machine: the same config and world size give the same numbers as a Slurm job).

Resources: a "preemptible" job asks for 4 CPUs per task on both nodes (all of them), so a 1-CPU job
in partition `high` must preempt it. Steps sleep (SlowBlobTask) so that signals land mid-training.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import pytest
from slurm_helpers import DONE, final_state, hostnames, job, runs, sacct, sbatch, wait_until

from mgpu.checkpoint import CheckpointStore
from mgpu.environment import derive_master_port
from mgpu.ledger import read_ledger
from tests.conftest import PYTHON, ROOT, base_env
from tests.test_trainer import assert_identical

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = pytest.mark.slurm

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
SLOW_STEPS = 30
STEPS_PER_EPOCH = 10
# World size 4 (2 nodes x 2 ranks): 40 samples, 1 per rank -> 10 steps per epoch as well. No batch norm
# (one sample per rank per step). find_unused_parameters: it stops DDP from rebuilding its gradient
# buckets after the first step of each run. With the rebuild, the first step after a resume reduces in
# the initial bucket layout where an uninterrupted run uses the rebuilt one, and with 3+ ranks gloo's
# ring all-reduce then sums some elements in another order: a resumed world-4 run differs in the last
# bits (seen with a plain --stop-at-step resume too; 2 ranks are immune, a + b == b + a). A trainer
# matter, not the job protocol's: with it switched off, what is checked here is the protocol.
SLOW4 = [*SLOW, "data.batch_size=1", "task.args.batch_norm=false", "train.find_unused_parameters=true"]
TWO_RANKS = ["--nodes", "2", "--gpus-per-node", "1"]
FOUR_RANKS = ["--nodes", "2", "--gpus-per-node", "2"]
ALL_CPUS = ["--cpus-per-task", "4"]  # with 1 task per node: both nodes full, a `high` job must preempt
KILL_WAIT_S = 5


# ---------------------------------------------------------------------------------------------- helpers
def submit(folder: Path, *args: str) -> tuple[list[str], list[Path]]:
    """`jobs/submit.py --cluster slurm` into `folder`; the job ids and run directories it printed."""
    cmd = [PYTHON, SUBMIT, "--cluster", "slurm", "--partition", "main", "--time", "10", "--folder", str(folder),
           *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
    ids = re.findall(r"^slurm job (\S+)$", proc.stdout, re.M)
    dirs = [Path(p) for p in re.findall(r"^\s+run directory\s+(\S+)$", proc.stdout, re.M)]
    assert ids and len(ids) == len(dirs), proc.stdout
    return ids, dirs


def submit_one(folder: Path, *args: str) -> tuple[str, Path]:
    ids, dirs = submit(folder, *args)
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
    found = read_ledger(run_dir / "events.jsonl")
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
    loaded = CheckpointStore(run_dir / "checkpoints").latest()
    assert loaded is not None, f"no checkpoint in {run_dir}"
    return loaded.state


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
                     launcher: str) -> None:
    """Every rank's logs/rank<N>.json against Slurm's own view of the allocation."""
    nodelist = sacct(cluster, jobid)[-1]["NodeList"]
    nodes = hostnames(cluster, nodelist)
    assert nodes == ["n1", "n2"], nodelist
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
    started = events(run_dir, "started")
    assert [(e["world_size"], e["nodes"], e["launcher"]) for e in started] == [(world, nodes, launcher)]
    assert len(events(run_dir, "finished")) == 1


# --------------------------------------------------------------------------- uninterrupted references
class Reference:
    """An uninterrupted torchrun run of SLOW (or SLOW4) on this machine, started in the background."""

    def __init__(self, run_dir: Path, world: int, config: list[str]) -> None:
        self.run_dir = run_dir
        self.log = open(run_dir.parent / f"{run_dir.name}.out", "w")
        port = str(29400 + os.getpid() % 500 + world)
        self.proc = subprocess.Popen([TORCHRUN, "--nproc-per-node", str(world), "--master-port", port, TRAIN,
                                      f"run.dir={run_dir}", *config], cwd=ROOT, env=base_env(), stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self._state: dict[str, Any] | None = None

    def state(self) -> dict[str, Any]:
        if self._state is None:
            rc = self.proc.wait(timeout=180)
            self.log.close()
            out = Path(self.log.name).read_text()
            assert rc == 0, f"reference run failed:\n{out[-3000:]}"
            self._state = checkpoint_state(self.run_dir)
        return self._state

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def references(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Reference]]:
    base = tmp_path_factory.mktemp("reference")
    refs = {2: Reference(base / "world2", 2, SLOW)}
    refs[4] = Reference(base / "world4", 4, SLOW4)
    try:
        yield refs
    finally:
        for ref in refs.values():
            ref.close()


@pytest.fixture(autouse=True)
def _start_references_early(references: dict[int, Reference]) -> None:
    """Every test asks for the references, so they start with the module's first test."""


# ------------------------------------------------------------------------------------- 1-2: placement
def test_multi_node_submit_places_every_rank(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    jobid, run_dir = submit_one(tmp_path, *FOUR_RANKS, *BLOB)
    try:
        assert final_state(slurm_cluster, jobid, timeout=120) == "COMPLETED", job_output(tmp_path, jobid)
        assert_placement(slurm_cluster, jobid, run_dir, world=4, per_node=2, launcher="slurm")
    finally:
        cancel(slurm_cluster, jobid)


@pytest.mark.parametrize("template", ["train.sbatch", "train_torchrun.sbatch"])
def test_sbatch_template_places_every_rank(template: str, slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    config = tmp_path / "blob.yaml"
    config.write_text("task:\n  target: tests.tasks:BlobTask\ntrain:\n  epochs: 2\ndata:\n  batch_size: 4\n")
    per_task = ["--ntasks-per-node=2", "--cpus-per-task=1"] if template == "train.sbatch" else \
        ["--ntasks-per-node=1", "--cpus-per-task=2"]
    cmd = ["sbatch", "--parsable", "-p", "main", "-N2", "--gpus-per-node=2", *per_task, "--time=5",
           "-o", f"{tmp_path}/%x-%j.out", "--export=ALL", f"slurm/{template}", str(config),
           f"run.root={tmp_path}", "run.name=tpl", "log.every_steps=1"]
    env = base_env(PYTHON=PYTHON, SLURM_CONF=str(slurm_cluster.conf))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobid = proc.stdout.strip().split(";")[0]
    try:
        state = final_state(slurm_cluster, jobid, timeout=120)
        out = next(tmp_path.glob(f"*-{jobid}.out"))
        assert state == "COMPLETED", out.read_text()[-3000:]
        launcher = "slurm" if template == "train.sbatch" else "torchrun"
        assert_placement(slurm_cluster, jobid, tmp_path / "tpl", world=4, per_node=2, launcher=launcher)
    finally:
        cancel(slurm_cluster, jobid)


# ---------------------------------------------------------------------------------- 3-5: preemption
POLICIES = [pytest.param(0, True, id="grace0-usersignal"), pytest.param(0, False, id="grace0-nosignal"),
            pytest.param(10, True, id="grace10-usersignal"), pytest.param(10, False, id="grace10-nosignal")]


@pytest.mark.parametrize("grace, user_signal", POLICIES)
def test_preempted_job_resumes_bit_identical(grace: int, user_signal: bool, slurm_cluster: SlurmCluster,
                                             slurm_policy: Callable[..., str], references: dict[int, Reference],
                                             tmp_path: Path) -> None:
    slurm_policy(grace=grace, user_signal=user_signal)
    jobid, run_dir = submit_one(tmp_path, *TWO_RANKS, *ALL_CPUS, *SLOW)
    high = ""
    try:
        wait_steps(run_dir, run=1, steps=2, when=mid_epoch)
        high = preempt(slurm_cluster)
        assert final_state(slurm_cluster, jobid, timeout=150) == "COMPLETED"
        assert final_state(slurm_cluster, high, timeout=30) == "COMPLETED"
        # GraceTime 0: Slurm requeued it (PREEMPTED); with a grace period the job requeued itself.
        assert runs(slurm_cluster, jobid) == ["PREEMPTED" if grace == 0 else "REQUEUED", "COMPLETED"]
        (stop_step,) = assert_resumed_where_stopped(run_dir, stops=1)
        assert events(run_dir, "resumed")[0]["position"] > 0, "not stopped mid-epoch"
        (preempted,) = events(run_dir, "preempted")
        signals = set(preempted["signals"])  # what rank 0 had received when it stopped
        if grace == 0:
            assert ("SIGUSR2" if user_signal else "SIGTERM") in signals, preempted
        else:  # only the preemption's first signal: the TERM comes at the end of the grace period
            assert signals == {"SIGUSR2" if user_signal else "SIGTERM"}, preempted
            assert preempted["reasons"] == ["requeue_signal" if user_signal else "sigterm"], preempted
        (decision,) = events(run_dir, "stop_decision")
        assert decision["step"] == stop_step
        requeued = events(run_dir, "requeued")
        if grace == 0:
            assert (decision["what"], decision["requeue"]) == ("requeued_by_slurm", False), decision
            assert requeued == []
        else:
            assert (decision["what"], decision["requeue"]) == ("preempted", True), decision
            assert [(e["how"], e["step"]) for e in requeued] == [("self", stop_step)], requeued
        assert_same_training(run_dir, references[2].state())
    finally:
        cancel(slurm_cluster, jobid, high)


def test_outside_requeue_resumes_from_the_stop(slurm_cluster: SlurmCluster, slurm_policy: Callable[..., str],
                                               references: dict[int, Reference], tmp_path: Path) -> None:
    slurm_policy()  # the default policy, explicit so that test order does not matter
    jobid, run_dir = submit_one(tmp_path, *TWO_RANKS, *SLOW)
    try:
        wait_steps(run_dir, run=1, steps=2)
        slurm_cluster.run("scontrol", "requeue", jobid)
        assert final_state(slurm_cluster, jobid, timeout=150) == "COMPLETED"
        assert runs(slurm_cluster, jobid) == ["REQUEUED", "COMPLETED"]
        (stop_step,) = assert_resumed_where_stopped(run_dir, stops=1)
        (preempted,) = events(run_dir, "preempted")
        assert set(preempted["signals"]) == {"SIGTERM"} and preempted["reasons"] == ["sigterm"], preempted
        (decision,) = events(run_dir, "stop_decision")
        assert (decision["what"], decision["requeue"], decision["step"]) == ("requeued_by_slurm", False, stop_step)
        assert events(run_dir, "requeued") == []
        assert_same_training(run_dir, references[2].state())
    finally:
        cancel(slurm_cluster, jobid)


def test_five_preemptions_in_a_row_stay_bit_identical(slurm_cluster: SlurmCluster,
                                                      slurm_policy: Callable[..., str],
                                                      references: dict[int, Reference], tmp_path: Path) -> None:
    slurm_policy()
    # Five runs must fit in the job's 30 steps. Each run makes 1 step before the preempting job is
    # submitted, then as many as pass until Slurm's scheduler preempts (about a second here) and the ranks
    # agree. So: agreement every step, and 0.5 s steps (a sleep: numerically irrelevant, the reference
    # sleeps 0.2 s), leaving ~4 steps per run; with 0.2 s steps 5 runs took up to 7 steps each.
    jobid, run_dir = submit_one(tmp_path, *TWO_RANKS, *ALL_CPUS, *SLOW, "task.args.step_s=0.5",
                                "preemption.check_every_steps=1")
    highs: list[str] = []
    try:
        for n in range(1, 6):
            wait_steps(run_dir, run=n, steps=1, timeout=60)
            highs.append(preempt(slurm_cluster))
            wait_until(f"preemption {n} to be saved", lambda: len(events(run_dir, "preempted")) == n, timeout=30)
        assert final_state(slurm_cluster, jobid, timeout=120) == "COMPLETED"
        assert runs(slurm_cluster, jobid) == ["PREEMPTED"] * 5 + ["COMPLETED"]
        stops = assert_resumed_where_stopped(run_dir, stops=5)
        assert stops == sorted(set(stops)), f"every run must make progress: {stops}"
        assert_same_training(run_dir, references[2].state())
        for high in highs:
            assert final_state(slurm_cluster, high, timeout=30) == "COMPLETED"
    finally:
        cancel(slurm_cluster, jobid, *highs)


# ------------------------------------------------------------------------------------- 6: time limit
def test_time_limit_signal_saves_requeues_and_finishes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # --time 1 --signal-lead 10: Slurm checks time limits every 30 s and signals at the first check with
    # <= 10 + 30 s left, i.e. 20-50 s after the start (lead 50 would signal at the very first check, as
    # early as the imports). The first run trains for 60 s (120 steps x 0.5 s), so the signal always
    # comes mid-training; the second run does not sleep and finishes before its own signal (>= 20 s).
    config = ["task.target=tests.e2e.jobtasks:FirstRunSlowBlobTask", "task.args.step_s=0.5", "train.epochs=12",
              "data.batch_size=2", "log.every_steps=1"]
    jobid, run_dir = submit_one(tmp_path, *TWO_RANKS, "--time", "1", "--signal-lead", "10", *config)
    try:
        assert final_state(slurm_cluster, jobid, timeout=170) == "COMPLETED"
        assert runs(slurm_cluster, jobid) == ["REQUEUED", "COMPLETED"]
        (preempted,) = events(run_dir, "preempted")
        assert preempted["signals"] == ["SIGUSR2"] and preempted["reasons"] == ["requeue_signal"], preempted
        (started, _) = events(run_dir, "started")
        assert preempted["time"] - started["time"] < 60, "stopped only at the time limit"
        (decision,) = events(run_dir, "stop_decision")
        assert (decision["what"], decision["requeue"]) == ("user_signal", True), decision
        assert [(e["how"], e["step"]) for e in events(run_dir, "requeued")] == [("self", preempted["step"])]
        assert [e["step"] for e in events(run_dir, "resumed")] == [preempted["step"]]
        assert preempted["step"] in {e["step"] for e in events(run_dir, "checkpoint_saved") if e["restart"] == 0}
        assert [(e["step"], e["restart"]) for e in events(run_dir, "finished")] == [(120, 1)]
    finally:
        cancel(slurm_cluster, jobid)


# ----------------------------------------------------------------------------------------- 7: scancel
def test_scancel_saves_and_stays_cancelled(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    jobid, run_dir = submit_one(tmp_path, *TWO_RANKS, *SLOW)
    try:
        wait_steps(run_dir, run=1, steps=2)
        slurm_cluster.run("scancel", jobid)
        assert final_state(slurm_cluster, jobid, timeout=60) == "CANCELLED"
        (preempted,) = events(run_dir, "preempted")
        assert "SIGTERM" in preempted["signals"], preempted
        (decision,) = events(run_dir, "stop_decision")
        assert (decision["what"], decision["requeue"]) == ("cancelled", False), decision
        assert checkpoint_state(run_dir)["progress"]["step"] == preempted["step"]
        time.sleep(8)  # longer than a requeued job is held (cred_expire + 1 s): a second run would show now
        assert runs(slurm_cluster, jobid) == ["CANCELLED"]
        assert job(slurm_cluster, jobid).get("JobState", "CANCELLED") == "CANCELLED"
        assert len(events(run_dir, "started")) == 1 and events(run_dir, "requeued") == []
    finally:
        cancel(slurm_cluster, jobid)


# -------------------------------------------------------------------------------- 8: requeue budget
@pytest.mark.parametrize("grace", [pytest.param(0, id="slurm-requeues"), pytest.param(10, id="self-requeue")])
def test_exhausted_requeue_budget_stops_for_good(grace: int, slurm_cluster: SlurmCluster,
                                                 slurm_policy: Callable[..., str], tmp_path: Path) -> None:
    slurm_policy(grace=grace, user_signal=True)
    jobid, run_dir = submit_one(tmp_path, *TWO_RANKS, *ALL_CPUS, "--max-requeues", "0", *SLOW)
    high = ""
    try:
        wait_steps(run_dir, run=1, steps=2)
        high = preempt(slurm_cluster)
        assert final_state(slurm_cluster, jobid, timeout=90) == "FAILED"
        errors = (tmp_path / "submitit" / f"{jobid}_0_log.err").read_text()
        if grace == 0:
            # Slurm requeued it anyway; the second run refuses to train.
            assert runs(slurm_cluster, jobid) == ["PREEMPTED", "FAILED"]
            failed = events(run_dir, "failed")
            assert [e["restart"] for e in failed] == [1], failed
            message = "requeue budget exhausted: this is restart 1 of at most 0"
            assert failed[0]["error"].startswith(message), failed
            assert events(run_dir, "resumed") == [] and len(events(run_dir, "started")) == 1
        else:
            assert runs(slurm_cluster, jobid) == ["FAILED"]
            (decision,) = events(run_dir, "stop_decision")
            message = "preempted, but the requeue budget is spent (0 of 0 requeues used)"
            assert (decision["requeue"], decision["what"]) == (False, "preempted") and \
                decision["reason"].startswith(message), decision
            assert events(run_dir, "requeued") == []
        assert message in errors, errors[-2000:]
        time.sleep(8)
        assert len(runs(slurm_cluster, jobid)) == (2 if grace == 0 else 1), "ran again"
    finally:
        cancel(slurm_cluster, jobid, high)


# ------------------------------------------------------------------------------------ 9: a rank dies
@pytest.mark.parametrize("world, victim", [pytest.param(2, 1, id="world2-kill-rank1"),
                                           pytest.param(4, 0, id="world4-kill-rank0")])
def test_killed_rank_ends_the_step_and_the_job_resumes(world: int, victim: int, slurm_cluster: SlurmCluster,
                                                       references: dict[int, Reference], tmp_path: Path) -> None:
    config = SLOW if world == 2 else SLOW4
    jobid, run_dir = submit_one(tmp_path, *(TWO_RANKS if world == 2 else FOUR_RANKS), *config)
    try:
        wait_steps(run_dir, run=1, steps=3, when=lambda step: step % 2 == 1)  # a checkpoint 1 step behind
        # The ranks run in this machine's pid namespace (slurmd only changes the UTS namespace).
        os.kill(rank_record(run_dir, victim)["pid"], 9)
        killed = time.monotonic()
        # No hang: srun ends the step (TERM to the survivors, KILL after KillWait) and the run is over.
        wait_until("the first run to end", lambda: (runs(slurm_cluster, jobid) or [""])[0] in DONE | {"REQUEUED"},
                   timeout=KILL_WAIT_S + 15, interval=0.2)
        assert time.monotonic() - killed < KILL_WAIT_S + 10
        assert final_state(slurm_cluster, jobid, timeout=150) == "COMPLETED"
        assert runs(slurm_cluster, jobid) == ["REQUEUED", "COMPLETED"]
        (decision,) = events(run_dir, "stop_decision")  # exactly one decision: the batch script's, after srun
        assert (decision["what"], decision["requeue"]) == ("terminated", True), decision
        assert "rank" not in decision and decision["restart"] == 0 and "after a failure" in decision["reason"]
        assert [(e["how"], e["restart"]) for e in events(run_dir, "requeued")] == [("self", 0)]
        saved_before = max(e["step"] for e in events(run_dir, "checkpoint_saved") if e["restart"] == 0)
        assert [e["step"] for e in events(run_dir, "resumed")] == [saved_before]
        assert [(e["step"], e["restart"]) for e in events(run_dir, "finished")] == [(SLOW_STEPS, 1)]
        assert_same_training(run_dir, references[world].state())
    finally:
        cancel(slurm_cluster, jobid)


def test_a_bug_is_requeued_only_within_the_budget(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    config = ["task.target=tests.e2e.jobtasks:BuggyBlobTask", "task.args.fail_after=3", "train.epochs=3",
              "data.batch_size=2", "checkpoint.every_steps=1"]
    jobid, run_dir = submit_one(tmp_path, *TWO_RANKS, "--max-failures", "1", *config)
    try:
        wait_until("two runs to fail", lambda: len(events(run_dir, "stop_decision")) == 2, timeout=120)
        assert final_state(slurm_cluster, jobid, timeout=60) == "FAILED"
        decisions = events(run_dir, "stop_decision")
        assert [(d["restart"], d["requeue"]) for d in decisions] == [(0, True), (1, False)], decisions
        assert "the failure budget is spent (1 of 1 failure requeues used)" in decisions[1]["reason"]
        assert all("the training step exited with code" in d["error"] for d in decisions)
        failed = [e for e in events(run_dir, "failed") if "bug in the training code" in e["error"]]
        assert [e["restart"] for e in failed] == [0, 1], failed
        assert [e["restart"] for e in events(run_dir, "requeued")] == [0]
        time.sleep(8)
        assert runs(slurm_cluster, jobid) == ["REQUEUED", "FAILED"], "requeued beyond the budget"
    finally:
        cancel(slurm_cluster, jobid)


# ------------------------------------------------------------------------------------ 10: job arrays
def assert_resumed_where_stopped_once(run_dir: Path) -> None:
    (preempted,) = events(run_dir, "preempted")
    assert [e["step"] for e in events(run_dir, "resumed")] == [preempted["step"]]
    assert preempted["step"] in {e["step"] for e in events(run_dir, "checkpoint_saved")}
    assert [e["restart"] for e in events(run_dir, "finished")] == [1]


def test_preempting_one_array_task_requeues_only_that_task(slurm_cluster: SlurmCluster,
                                                          slurm_policy: Callable[..., str], tmp_path: Path) -> None:
    slurm_policy(grace=10, user_signal=True)  # the task requeues itself: by its <array>_<task> id
    ids, dirs = submit(tmp_path, "--nodes", "1", "--gpus-per-node", "1", *ALL_CPUS, "--max-parallel", "2",
                       "--sweep", "train.seed=0,1", *SLOW)
    assert len(ids) == 2
    array = ids[0].split("_")[0]
    assert ids == [f"{array}_0", f"{array}_1"]
    high = ""
    try:
        for run_dir in dirs:
            wait_steps(run_dir, run=1, steps=2)
        node = job(slurm_cluster, ids[0])["NodeList"]
        assert node != job(slurm_cluster, ids[1])["NodeList"]
        high = preempt(slurm_cluster, node)
        for task in ids:
            assert final_state(slurm_cluster, task, timeout=150) == "COMPLETED"
        assert runs(slurm_cluster, ids[0]) == ["REQUEUED", "COMPLETED"]
        assert runs(slurm_cluster, ids[1]) == ["COMPLETED"]
        requeued = events(dirs[0], "requeued")
        assert [(e["how"], e["message"]) for e in requeued] == [("self", f"requeued job {ids[0]}")], requeued
        assert rank_record(dirs[0], 0)["job_id"] == ids[0]
        assert_resumed_where_stopped_once(dirs[0])
        assert events(dirs[1], "preempted") == [] and len(events(dirs[1], "started")) == 1
        assert [e["restart"] for e in events(dirs[1], "finished")] == [0]
    finally:
        cancel(slurm_cluster, array, high)
