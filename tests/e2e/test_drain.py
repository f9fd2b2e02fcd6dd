"""A drain seen before the signal (issue 32, deliver 2), on the real local cluster: `scontrol update
nodename=<the second node> state=drain` while a 2-node job trains; rank 0's poll of Slurm (mgpu.cluster.deadline; every 5 s here, `preemption.slurm_poll_s`) sees it, the ranks
stop at a step boundary, save and requeue the job before Slurm sends any signal; the node is resumed in
`finally` whatever happens, and the job comes back once it is."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from job_helpers import SLOW, TWO_RANKS, cancel, events, job_output, submit_one, wait_steps
from slurm_helpers import wait_until

from mgpu.state.single.store import CheckpointStore

if TYPE_CHECKING:
    from conftest import SlurmCluster


def test_a_drained_node_gets_a_checkpoint_before_any_signal(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # 0.2 s steps, 60 epochs of 10 steps; rank 0 asks Slurm every 5 s (preemption.slurm_poll_s; 60 s by default), so
    # the drain is seen within 5 s and a poll's answer (scontrol, seconds on a loaded machine): 30 s is the bound.
    jobid, run_dir = submit_one(tmp_path, *TWO_RANKS, *SLOW, "train.epochs=60", "preemption.slurm_poll_s=5")
    node = slurm_cluster.nodes[1]
    drained = False
    try:
        wait_steps(run_dir, run=1, steps=2, timeout=120)
        slurm_cluster.run("scontrol", "update", f"nodename={node}", "state=drain", "reason=mgpu-e2e-drain")
        drained = True
        wait_until("the drain's stop decision", lambda: events(run_dir, "stop_decision"), timeout=30)
        (preempted,) = events(run_dir, "preempted")
        assert preempted["reasons"] == ["drain"] and preempted["signals"] == [], (preempted, job_output(tmp_path, jobid))
        (decision,) = events(run_dir, "stop_decision")
        assert (decision["what"], decision["requeue"]) == ("node_drain", True), decision
        # rank 0 writes the decision, then asks Slurm to requeue (scontrol: seconds on a loaded machine), then
        # writes what Slurm answered: wait for that answer, whichever it is
        wait_until("the requeue's answer", lambda: [e for kind in ("requeued", "requeue_unknown", "requeue_refused")
                                                    for e in events(run_dir, kind)], timeout=60)
        assert [e["how"] for e in events(run_dir, "requeued")] == ["self"], job_output(tmp_path, jobid)
        saved = [e for e in events(run_dir, "checkpoint_saved") if e.get("reason") == "preemption"]
        assert saved and saved[-1]["step"] == decision["step"] and saved[-1]["time"] <= decision["time"]
        latest = CheckpointStore(run_dir / "checkpoints").latest()
        assert latest is not None and latest.step == decision["step"]
        slurm_cluster.run("scontrol", "update", f"nodename={node}", "state=resume")
        drained = False
        wait_steps(run_dir, run=2, steps=1, timeout=150)  # back once the node is
    finally:
        if drained:
            slurm_cluster.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
        cancel(slurm_cluster, jobid)
