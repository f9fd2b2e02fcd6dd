"""A rank that dies costs at most the step it died in, with snapshots in memory at their default cadence: the ranks
that survive save the last step they completed (mgpu.state.memory.step_mark), and the step started again in place (as
mgpu.run.recovery's `restart` does under Slurm) resumes from it; the lost rank takes its state from a survivor's
save, on its node or over the network from its partner's, with its own generators (re-seeded at every step's end)
and, for rank 0, its batch-norm buffers as DDP synced them. Ends bit-identical to an unbroken run. Real processes:
2 gloo ranks of jobs/train.py (BlobTask: dropout, batch norm), SIGKILLed inside a step."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from mgpu.record.ledger import read_ledger
from mgpu.state.single.store import CheckpointStore
from mgpu.state.memory.store import BASE_ENV
from tests.conftest import start_ranks, wait_ranks

# 40 samples, 4 per rank on 2 ranks: 5 steps an epoch, 20 in all; the durable checkpoint is the epoch end's (step 10);
# a snapshot in memory every 100 steps: none in this run, so only a survivor's save can make the loss one step.
ARGS = ["task.target=tests.tasks:KilledBlobTask", "train.epochs=4", "data.batch_size=4", "log.tensorboard=false",
        "checkpoint.memory_every_steps=100", "checkpoint.keep_last=10", "log.every_steps=1"]
TRAIN = str(Path(__file__).resolve().parent.parent / "jobs" / "train.py")

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run = tmp_path_factory.mktemp("reference") / "run"
    done = wait_ranks(start_ranks([TRAIN, f"run.dir={run}", *ARGS], 2), timeout=150)
    assert [rc for rc, _ in done] == [0, 0], done[0][1][-3000:]
    return CheckpointStore(run / "checkpoints").latest().state


# (the rank killed, in which step, nodes): rank 0 on one node with rank 1, killed in its loss before its forward (so
# before DDP broadcast its batch-norm buffers, the ones a checkpoint holds): rank 1's save and rank 0's own record
# of its buffers; rank 1's node lost with its memory: rank 0's save over the network.
# And rank 1 frozen (SIGSTOP) in its step 12: rank 0's watchdog finds the hang and saves before it ends the step;
# the frozen rank is killed, as srun would (`--kill-on-bad-exit`).
FROZEN = ["task.target=tests.tasks:HangingBlobTask", "task.args.mode=stop", "task.args.step_s=0.05",
          "watchdog.floor_s=2", "watchdog.step_multiple=5", "watchdog.first_step_s=30", "watchdog.checkpoint_s=4"]


@pytest.mark.parametrize("killed, at, nodes, how", [(0, 13, 1, "killed"), (1, 14, 2, "killed"), (1, 12, 1, "frozen")],
                         ids=["rank 0 killed", "a node lost", "rank 1 frozen"])
def test_a_lost_rank_costs_at_most_its_step_and_resumes_bit_identically(
        killed: int, at: int, nodes: int, how: str, reference: dict[str, Any], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import signal

    from tests.test_trainer import assert_identical

    shm = tmp_path / "shm"
    monkeypatch.setenv(BASE_ENV, str(shm))  # the ranks' /dev/shm (base_env passes it on)
    run = tmp_path / "run"
    killing = [TRAIN, f"run.dir={run}", *ARGS, *(FROZEN if how == "frozen" else []), f"task.args.at={at}",
               f"task.args.rank={killed}", f"task.args.{'hang_file' if how == 'frozen' else 'once_file'}={tmp_path / 'lost'}"]
    procs = start_ranks(killing, 2, nodes=nodes)
    survivor = 1 - killed
    if how == "frozen":
        procs[survivor].wait(timeout=120)  # its watchdog ends the step (exit 4) after the last words
        os.kill(procs[killed].pid, signal.SIGKILL)
    crashed = wait_ranks(procs, timeout=150)
    assert crashed[killed][0] == -9 and crashed[survivor][0] != 0, crashed[survivor][1][-3000:]
    on_disk = CheckpointStore(run / "checkpoints").latest()  # the resume's own pick: the save `latest` names first
    durable = -1 if on_disk is None else on_disk.step
    # Step 10's epoch-end save, unless the one before was still being written; none, where rank 0, the writer, died
    # with its background save on this loaded machine; step 5 also where it died between step 10's rename and its
    # `latest` (the last save, not the highest step, is the one a resume takes: tests/test_checkpoint.py).
    assert durable in (-1, 5, 10)
    said = (run / "logs" / f"rank{survivor}.log").read_text()
    assert f"rank {survivor}: step {at - 1}, its last, saved to its node's memory" in said, said[-3000:]
    if nodes == 2:  # node n2 (rank 1's) lost: its snapshots and the replica of rank 0 it held
        (job,) = shm.iterdir()
        for lost in ("rank1", "replica-of-rank0-on-n2"):
            shutil.rmtree(job / lost, ignore_errors=True)

    again = wait_ranks(start_ranks(killing, 2, nodes=nodes), timeout=150)  # the step started again in place
    assert [rc for rc, _ in again] == [0, 0], again[killed][1][-3000:]
    (resumed,) = [e for e in read_ledger(run / "events.jsonl") if e["event"] == "resumed"]
    assert (resumed["step"], resumed.get("memory"), resumed["durable_step"]) == (at - 1, True, durable), resumed
    where = "over the network" if nodes == 2 else "this node"
    assert f"rank {killed}: step {at - 1} restored from rank {survivor}'s save ({where})" in \
        (run / "logs" / f"rank{killed}.log").read_text()
    final = CheckpointStore(run / "checkpoints").latest().state
    assert final["progress"]["step"] == reference["progress"]["step"] == 20
    for key in ("model", "optimizer", "scheduler"):
        assert_identical(final[key], reference[key], key)
    assert list(shm.iterdir()) == [], "snapshots left after the run finished"
