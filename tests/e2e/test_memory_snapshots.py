"""On the test cluster (2 nodes x 2 ranks): a rank SIGKILLed mid-run with checkpoint.memory_every_steps=1 and
the durable checkpoints only at epoch ends (10 steps apart): the batch script starts the step again in the same
allocation, the ranks resume from the snapshots in memory at most one step back, the run ends bit-identical to
an unbroken one, and no snapshot is left on the nodes. (Both nodes of the test cluster share this host's
/dev/shm; each rank's directory is its own.)"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from job_helpers import (FOUR_RANKS, KILL_WAIT_S, SLOW4, Reference, assert_same_training, cancel, events, rank_record,
                         submit_one, wait_steps)
from slurm_helpers import final_state, runs, wait_until

if TYPE_CHECKING:
    from conftest import SlurmCluster


def test_a_killed_rank_loses_at_most_one_step_with_snapshots_in_memory(
        slurm_cluster: SlurmCluster, references: dict[int, Reference], tmp_path: Path) -> None:
    jobid, run_dir = submit_one(tmp_path, *FOUR_RANKS, *SLOW4, "checkpoint.every_steps=0",
                                "checkpoint.memory_every_steps=1")
    try:
        wait_steps(run_dir, run=1, steps=14, when=lambda step: step % 10 >= 4)  # mid-epoch 1: the disk has step 10
        os.kill(rank_record(run_dir, 1)["pid"], 9)
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
        assert list(Path("/dev/shm").glob(f"mgpu-{jobid}-*")) == [], "snapshots left after the job"
    finally:
        cancel(slurm_cluster, jobid)
