"""A slow rank on the real test cluster: the e2e job (job_helpers.SLOW, 100 steps of 0.2 s, one rank on each
node) twice at once, as one job array: rank 1 of one task sleeps 30 % longer per step (task.args.slow_factor=1.3),
the other is the same job unperturbed. Status names the slow rank and its node, with its factor, within 100 steps
(the ledger's `straggler` event, TensorBoard's `ranks/` curves read back); the unperturbed job names nobody. Both
print the timeout ladder as training starts (rank 0's log) and in status, with Slurm's KillWait read for the job."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from job_helpers import SLOW, TWO_RANKS, cancel, events, job_output, rank_record, submit
from slurm_helpers import final_state

from tests.conftest import PYTHON, ROOT, base_env

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = pytest.mark.slurm


def status(run_dir: Path) -> list[str]:
    result = subprocess.run([PYTHON, str(ROOT / "jobs" / "status.py"), str(run_dir)], cwd=ROOT, env=base_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_a_rank_30_percent_slower_is_named_with_its_node_and_the_same_job_unperturbed_names_nobody(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    ids, dirs = submit(tmp_path, *TWO_RANKS, "--max-parallel", "2", "--sweep", "task.args.slow_factor=1.0,1.3",
                       *SLOW, "train.epochs=10", "task.args.slow_rank=1")
    try:
        for task in ids:
            assert final_state(slurm_cluster, task, timeout=180) == "COMPLETED", job_output(tmp_path, task)
    finally:
        cancel(slurm_cluster, *ids)
    unperturbed, slowed = dirs
    node = rank_record(slowed, 1)["node"]
    assert node in slurm_cluster.nodes and node != rank_record(slowed, 0)["node"]  # one rank on each node

    (named,) = events(slowed, "straggler")
    assert (named["rank"], named["node"]) == (1, node) and named["step"] <= 100, named
    assert 1.2 <= named["factor"] <= 1.45, named
    lines = status(slowed)
    line = next(line for line in lines if line.startswith("straggler   "))
    assert line.startswith(f"straggler   rank 1 on {node}: {named['factor']:.2f}x slower than the other ranks since "
                           f"step {named['since_step']}"), lines
    ranks = next(line for line in lines if line.startswith("ranks       "))
    assert f"slowest rank 1 on {node}, 1." in ranks, lines

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(slowed / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    assert board.Scalars("ranks/slowest_rank")[-1].value == 1
    # The factor of each log interval, as the ledger's progress events hold it, one point per interval; ~1.3 over the
    # run. One interval alone is a measurement on a loaded 2-core machine: CI saw the last one at 1.175.
    logged = {e["step"]: e["ranks"]["slowest"]["factor"] for e in events(slowed, "progress") if "ranks" in e}
    factors = {point.step: point.value for point in board.Scalars("ranks/slowest_factor")}
    assert factors.keys() == logged.keys() and all(factors[at] == pytest.approx(logged[at]) for at in logged), factors
    assert 1.2 <= sorted(factors.values())[len(factors) // 2] <= 1.45, factors
    assert board.Scalars("ranks/stragglers")[-1].value == 1

    assert events(unperturbed, "straggler") == [], events(unperturbed, "straggler")
    lines = status(unperturbed)
    assert not any(line.startswith("straggler") for line in lines), lines
    assert any(line.startswith("ranks       ") for line in lines), lines  # measured, and nobody named

    # the timeout ladder: as training starts in rank 0's log, in status with the job's KillWait (5 s here), in order
    assert "timeouts    inner to outer" in (unperturbed / "logs" / "rank0.log").read_text()
    at = lines.index("timeouts    inner to outer, each ending before the next (docs/allowances.md, the ladder):")
    rungs = {line.split()[0]: line for line in lines[at + 1:] if line.startswith("  ")}
    assert rungs["collective"].split()[1:3] == ["650", "s"] and rungs["KillWait"].split()[1:3] == ["5", "s"], lines
    assert not any("order broken" in line for line in lines), lines
