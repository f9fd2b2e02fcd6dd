"""A rank SIGKILLed mid-run, the step started again in place (the same command, as mgpu.run.recovery's `restart`
does under Slurm): with checkpoint.memory_every_steps=1 it resumes from the snapshots in memory, one step
back, not from the durable checkpoint, and ends bit-identical to an unbroken run (its EMA too); the snapshots are gone once
the run finishes. Real processes: 2 gloo ranks of jobs/train.py, under DDP and FSDP2; and on 2 "nodes" of one
rank each whose second loses its memory: its rank restores from the replica on the first."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from mgpu.state.single.store import CheckpointStore
from mgpu.record.ledger import read_ledger
from mgpu.state.memory.store import BASE_ENV

# 40 samples, 4 per rank on 2 ranks: 5 steps an epoch, 20 in all; the epoch-end checkpoint of step 10 (or 5) is
# the durable one when rank 1 dies inside step 12.
ARGS = ["task.target=tests.tasks:KilledBlobTask", "train.epochs=4", "data.batch_size=4", "log.tensorboard=false",
        "checkpoint.memory_every_steps=1", "checkpoint.keep_last=10", "log.every_steps=1"]


def final_state(run: Path, parallel: str) -> dict[str, Any]:
    """The run's last checkpoint, whole (a sharded one consolidated), with the optimizer under "optimizer"."""
    if parallel == "fsdp":
        from tests.test_fsdp import final

        state = final(run)
        return {**state, "optimizer": state["optim"]}
    return CheckpointStore(run / "checkpoints").latest().state


# DDP: every rank keeps the whole replicated state (a snapshot every step: the periodic snapshots' own path, the
# survivors' save aside: tests/test_survivors.py); FSDP2: each rank its shard (sharded checkpoints on disk), at the
# default cadence: the steps lost at most the k it chose (its line says it).
@pytest.mark.multiprocess
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_killed_rank_restarted_in_place_resumes_from_memory_bit_identically(
        parallel: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    from tests.test_faults import finish_step, start_step
    from tests.test_trainer import assert_identical

    shm = tmp_path / "shm"
    monkeypatch.setenv(BASE_ENV, str(shm))  # the ranks' /dev/shm (base_env passes it on)
    args = [*[a for a in ARGS if parallel == "ddp" or not a.startswith("checkpoint.memory_every_steps")],
            f"train.parallel={parallel}", "train.ema_decay=0.9"]  # an EMA in the snapshots too
    reference = tmp_path / "reference"
    done = finish_step(start_step(reference, 2, *args), timeout=150)
    assert [rc for rc, _ in done] == [0, 0], done[0][1][-3000:]

    run = tmp_path / "run"
    killing = [*args, "task.args.at=12", f"task.args.once_file={tmp_path / 'killed'}"]
    crashed = finish_step(start_step(run, 2, *killing), timeout=150)
    assert crashed[1][0] == -9 and crashed[0][0] != 0, crashed[0][1][-3000:]
    durable = CheckpointStore(run / "checkpoints").list_steps()[-1]
    assert durable in (5, 10)  # step 10's epoch-end save, unless a background sharded one was still in flight
    assert list(shm.iterdir()), "no snapshot survived the killed step"

    again = finish_step(start_step(run, 2, *killing), timeout=150)  # the step started again in place
    assert [rc for rc, _ in again] == [0, 0], again[0][1][-3000:]
    resumed = [e for e in read_ledger(run / "events.jsonl") if e["event"] == "resumed"]
    if parallel == "ddp":
        assert [(e["step"], e.get("memory"), e.get("durable_step")) for e in resumed] == [(11, True, durable)], resumed
    else:
        every = re.search(r"a snapshot in memory every (\d+) step", crashed[0][1] + (run / "logs" / "rank0.log").read_text())
        assert every, crashed[0][1][-3000:]
        (event,) = resumed  # from memory, or the durable checkpoint where it is newer: never more than k back
        assert 12 - event["step"] <= int(every[1]) and event["step"] >= durable, (resumed, every[0])
    final, expected = (final_state(d, parallel) for d in (run, reference))
    assert final["progress"]["step"] == expected["progress"]["step"] == 20
    assert_identical(final["model"], expected["model"], "model")
    assert_identical(final["optimizer"], expected["optimizer"], "optimizer")
    assert_identical(final["ema"], expected["ema"], "ema")  # under FSDP2 each rank's shard, put back in place
    assert list(shm.iterdir()) == [], "snapshots left after the run finished"


@pytest.mark.multiprocess
def test_a_node_that_lost_its_memory_restores_from_the_replicas_bit_identically(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 "nodes" (n1, n2) x 1 rank sharing this host's memory, each rank's snapshots replicated to the other's node.
    Rank 1 is SIGKILLed in step 14; then everything n2 held is removed (rank 1's own snapshots and the replica of
    rank 0 it kept), as if the node had been replaced. The step started again resumes from memory (newer than the
    durable step 10): rank 1 from its replica on n1, fetched back over its socket; the run ends bit-identical."""
    from tests.conftest import start_ranks
    from tests.test_faults import TRAIN, finish_step
    from tests.test_trainer import assert_identical

    shm = tmp_path / "shm"
    monkeypatch.setenv(BASE_ENV, str(shm))
    reference = tmp_path / "reference"
    done = finish_step(start_ranks([TRAIN, f"run.dir={reference}", *ARGS], 2, nodes=2), timeout=150)
    assert [rc for rc, _ in done] == [0, 0], done[0][1][-3000:]

    run = tmp_path / "run"
    killing = [TRAIN, f"run.dir={run}", *ARGS, "task.args.at=14", f"task.args.once_file={tmp_path / 'killed'}"]
    crashed = finish_step(start_ranks(killing, 2, nodes=2), timeout=150)
    assert crashed[1][0] == -9 and crashed[0][0] != 0, crashed[0][1][-3000:]
    durable = CheckpointStore(run / "checkpoints").list_steps()[-1]
    assert durable in (5, 10)  # step 10's epoch-end save, unless the background one was still being written
    (jobs,) = shm.iterdir()
    assert sorted(p.name for p in jobs.iterdir()) == ["rank0", "rank0-buffers", "rank1", "replica-of-rank0-on-n2",
                                                      "replica-of-rank1-on-n1"]  # rank0-buffers: batch norm's
    for lost in ("rank1", "replica-of-rank0-on-n2"):  # node n2's memory
        shutil.rmtree(jobs / lost)

    again = finish_step(start_ranks(killing, 2, nodes=2), timeout=150)
    assert [rc for rc, _ in again] == [0, 0], again[1][1][-3000:]
    (resumed,) = [e for e in read_ledger(run / "events.jsonl") if e["event"] == "resumed"]
    assert resumed.get("memory") is True and resumed["durable_step"] == durable and resumed["step"] in (12, 13), resumed
    assert f"rank 1: step {resumed['step']} restored from its replica on rank 0" in (run / "logs" / "rank1.log").read_text()
    final, expected = (CheckpointStore(d / "checkpoints").latest().state for d in (run, reference))
    assert final["progress"]["step"] == expected["progress"]["step"] == 20
    assert_identical(final["model"], expected["model"], "model")
    assert_identical(final["optimizer"], expected["optimizer"], "optimizer")
    assert list(shm.iterdir()) == [], "snapshots or replicas left after the run finished"
