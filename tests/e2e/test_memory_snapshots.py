"""On the test cluster (2 nodes x 2 ranks): a rank SIGKILLed mid-run, or both ranks of a node with its memory, with
the default settings and the durable checkpoints only at epoch ends (10 steps apart): the batch script starts the
step again in the same allocation, the ranks resume at most one step back (from the survivors' save of the last
step they completed), the run ends bit-identical to an unbroken one, and no snapshot is left on the nodes. The same with the killed rank's snapshots tampered with
(bytes that do not load, another model's state; their commit records made to match): set aside, one line each,
and the job resumes from the durable checkpoint in one restart. And nothing of a run left in /dev/shm after a
restart with snapshots off, a world of one's run (its watchdog board), a recovery requeue and a failed run.
(Both nodes of the test cluster share this host's /dev/shm; each rank's directory is its own.)"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from job_helpers import (BLOB, FOUR_RANKS, KILL_WAIT_S, SLOW4, Reference, assert_same_training, cancel, events,
                         rank_record, submit_one, wait_steps)
from slurm_helpers import final_state, runs, wait_until

from tests.conftest import PYTHON, ROOT, base_env

if TYPE_CHECKING:
    from conftest import SlurmCluster


@pytest.mark.parametrize("lost", ["rank", "node"], ids=["a rank killed", "a node killed with its memory"])
def test_a_killed_rank_or_node_loses_at_most_one_step_with_the_defaults(
        lost: str, slurm_cluster: SlurmCluster, references: dict[int, Reference], tmp_path: Path) -> None:
    # The defaults (checkpoint.memory_every_steps: its cadence from the measured cost): the survivors save the last
    # step they completed (mgpu.state.memory.step_mark), the lost ranks take theirs from a survivor's save, on their
    # node or over the network from their partner's (a node's memory lost: its ranks' snapshots and the replicas it held).
    jobid, run_dir = submit_one(tmp_path, *FOUR_RANKS, *SLOW4, "checkpoint.every_steps=0")
    try:
        wait_steps(run_dir, run=1, steps=14, when=lambda step: step % 10 >= 4)  # mid-epoch 1: the disk has step 10
        second = slurm_cluster.nodes[1]
        victims = [1] if lost == "rank" else [2, 3]  # the second node's ranks
        for rank in victims:
            os.kill(rank_record(run_dir, rank)["pid"], 9)
        if lost == "node":
            (job_dir,) = SHM.glob(f"mgpu-{jobid}-*")
            for name in ("rank2", "rank3", f"replica-of-rank0-on-{second}", f"replica-of-rank1-on-{second}"):
                shutil.rmtree(job_dir / name, ignore_errors=True)
        wait_until("the step to start again", lambda: events(run_dir, "restarted"), timeout=KILL_WAIT_S + 15,
                   interval=0.2)
        assert final_state(slurm_cluster, jobid, timeout=150) == "COMPLETED"
        assert runs(slurm_cluster, jobid) == ["COMPLETED"]  # one allocation, two steps
        everything = events(run_dir)
        first_attempt = everything[:next(i for i, e in enumerate(everything) if e["event"] == "restarted")]
        reached = max(e["step"] for e in first_attempt if e["event"] == "progress")
        durable = max(e["step"] for e in first_attempt if e["event"] == "checkpoint_saved")
        (resumed,) = events(run_dir, "resumed")
        assert resumed.get("memory") is True and resumed["durable_step"] == durable == 10, resumed
        assert reached - resumed["step"] <= 1, (reached, resumed)  # at most one step lost (was: back to 10)
        assert_same_training(run_dir, references[4].state())
        time.sleep(1)
        assert list(SHM.glob(f"mgpu-{jobid}-*")) == [], "snapshots left after the job"
    finally:
        cancel(slurm_cluster, jobid)


SHM = Path("/dev/shm")


def left_of(jobid: str, logs: Path) -> list[Path]:
    """What job `jobid` could have left in /dev/shm: its snapshots, replicas and watchdog board (every name holds the
    job id), and the board a world of one's rank used to leave in the per-user directory (named by a digest of
    the attempt: mgpu.stop.watchdog.attempt_key)."""
    found = list(SHM.glob(f"mgpu-{jobid}-*"))
    for restart in ("", "1", "2"):
        key = "|".join([str(logs.resolve()), jobid, restart, "", ""])
        old = SHM / f"mgpu-{os.getuid()}" / f"watchdog-{hashlib.sha1(key.encode()).hexdigest()[:16]}"
        found += [old] if old.exists() else []
    return found


def tamper(slot: Path, content: bytes) -> None:
    """`slot` (a slot's .pt) given `content`, its commit record rewritten to match: committed whole."""
    record = json.loads(slot.with_suffix(".json").read_text())
    slot.write_bytes(content)
    slot.with_suffix(".json").write_text(json.dumps({**record, "bytes": len(content),
                                                     "crc32": f"{zlib.crc32(content):08x}"}))


def another_models_state(slot: Path) -> bytes:
    """The snapshot in `slot` with another architecture's model in it: it loads, and does not fit this run's."""
    import torch

    state: dict[str, Any] = torch.load(slot, weights_only=True)
    state["model"] = {"other.weight": torch.zeros(5, 2)}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def test_a_tampered_snapshot_is_set_aside_and_the_job_resumes_from_the_durable_checkpoint_in_one_restart(
        slurm_cluster: SlurmCluster, references: dict[int, Reference], tmp_path: Path) -> None:
    """Rank 1 SIGKILLed mid-epoch 1; at once its snapshots, own and replica, are made what a crash must survive:
    the newest bytes that do not load, the other another model's state, each with a commit record that matches.
    Before, Session.load raised on every restart until the failure budget was spent."""
    jobid, run_dir = submit_one(tmp_path, *FOUR_RANKS, *SLOW4, "checkpoint.every_steps=0",
                                "checkpoint.memory_every_steps=1")
    try:
        wait_steps(run_dir, run=1, steps=14, when=lambda step: step % 10 >= 4)
        os.kill(rank_record(run_dir, 1)["pid"], 9)
        tampered = []
        for held in SHM.glob(f"mgpu-{jobid}-*/rank1"), SHM.glob(f"mgpu-{jobid}-*/replica-of-rank1-on-*"):
            for directory in held:
                slots = sorted((json.loads(p.read_text())["step"], p.with_suffix(".pt"))
                               for p in directory.glob("slot*.json"))
                for index, (step, slot) in enumerate(reversed(slots)):
                    tamper(slot, b"not a torch file" * 1000 if index == 0 else another_models_state(slot))
                    tampered.append((directory.name, step))
        assert [name for name, _ in tampered].count("rank1") >= 1, tampered
        assert final_state(slurm_cluster, jobid, timeout=180) == "COMPLETED"
        assert runs(slurm_cluster, jobid) == ["COMPLETED"] and len(events(run_dir, "restarted")) == 1
        (resumed,) = events(run_dir, "resumed")
        assert resumed["step"] == 10 and not resumed.get("memory"), resumed  # the durable checkpoint
        said = [line for line in (run_dir / "logs" / "rank1.log").read_text().splitlines()
                if "does not restore" in line]
        own = sorted(step for name, step in tampered if name == "rank1")
        assert len(said) == len(own), (said, tampered)
        for line, step in zip(said, reversed(own)):
            assert f"rank 1: the snapshot of step {step} does not restore (" in line and \
                f"set aside as /dev/shm/mgpu-{jobid}-" in line and line.endswith(
                    "the ranks go back to the next newest snapshot they all hold, else the durable checkpoint"), line
        assert_same_training(run_dir, references[4].state())
        time.sleep(1)
        assert left_of(jobid, run_dir / "logs") == [], "snapshots left after the job"
    finally:
        cancel(slurm_cluster, jobid)


NO_RESTART_IN_PLACE = """#!/bin/bash
# A batch script whose recovery cannot start the step again (no --may-restart): a failure is requeued, which ends
# this script before its own teardown; then, with the failure budget spent, the job fails and the teardown runs.
set -u
export MGPU_RECOVERY=batch MGPU_MAX_FAILURES=1
cd {root}
rc=0
srun --kill-on-bad-exit=1 {python} jobs/train.py run.dir={run} {args} || rc=$?
{python} -m mgpu.run.recovery --exit-code "$rc" --run-dir {run}
if [[ $rc != 0 ]]; then
  srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=0 \\
    {python} -m mgpu.state.memory.store --remove-this-job
fi
exit "$rc"
"""


def test_nothing_of_a_run_is_left_in_shared_memory(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """1. A run restarted with snapshots off after a crash left its snapshots (planted: an earlier job's), on a
    world of one (whose watchdog board is a directory in /dev/shm): both gone after it finishes. 2. A job whose
    rank 1 SIGKILLs itself at its 8th step in every run, with snapshots on: recovery requeues it (held there:
    nothing left, and the cleanup ran on both nodes), then the failure budget is spent and it fails: nothing
    left."""
    from mgpu.record.reporting import wandb_run_id

    single = tmp_path / "single"
    planted = SHM / f"mgpu-1-{wandb_run_id(single)}" / "rank0"
    planted.mkdir(parents=True)
    (planted / "slot0.pt").write_bytes(b"x" * 1000)
    jobid, run_dir = submit_one(tmp_path, "--nodes", "1", "--gpus-per-node", "1", *BLOB, f"run.root={tmp_path}",
                                "run.name=single", "checkpoint.memory_every_steps=0")
    try:
        assert run_dir == single
        assert final_state(slurm_cluster, jobid, timeout=120) == "COMPLETED"
        assert not planted.parent.exists(), "the run's snapshots were left when it ran with snapshots off"
        assert left_of(jobid, run_dir / "logs") == []
    finally:
        cancel(slurm_cluster, jobid)

    run_dir = tmp_path / "requeued"
    args = ["task.target=tests.tasks:KilledBlobTask", "task.args.at=8", "task.args.batch_norm=false",
            "data.batch_size=1", "train.epochs=3", "checkpoint.every_steps=4", "checkpoint.memory_every_steps=1",
            "log.tensorboard=false"]
    script = tmp_path / "no-restart.sbatch"
    script.write_text(NO_RESTART_IN_PLACE.format(root=ROOT, python=PYTHON, run=run_dir, args=" ".join(args)))
    proc = subprocess.run(["sbatch", "--parsable", "-p", "main", "-N2", "--ntasks-per-node=2", "--gpus-per-node=2",
                           "--cpus-per-task=1", "--time=5", "--requeue", "--open-mode=append",
                           "-o", f"{tmp_path}/%j.out", str(script)], cwd=ROOT,
                          env=base_env(SLURM_CONF=str(slurm_cluster.conf)), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobid = proc.stdout.strip().split(";")[0]
    output = tmp_path / f"{jobid}.out"
    try:
        wait_until("the recovery's requeue",
                   lambda: (run_dir / "events.jsonl").exists() and events(run_dir, "requeued"), 150, interval=0.2)
        slurm_cluster.run("scontrol", "hold", jobid)
        assert left_of(jobid, run_dir / "logs") == [], "snapshots left after the recovery's requeue"
        cleaned = [line for line in output.read_text().splitlines() if "mgpu.state.memory.store: n" in line]
        assert len(cleaned) == 1 and all(f"mgpu.state.memory.store: {node}: " in cleaned[0]
                                         for node in slurm_cluster.nodes), output.read_text()[-3000:]
        slurm_cluster.run("scontrol", "release", jobid)
        assert final_state(slurm_cluster, jobid, timeout=180) == "FAILED", output.read_text()[-3000:]
        assert len(runs(slurm_cluster, jobid)) == 2 and len(events(run_dir, "requeued")) == 1
        time.sleep(1)
        assert left_of(jobid, run_dir / "logs") == [], "snapshots left after the job failed"
    finally:
        cancel(slurm_cluster, jobid)
