"""jobs/status.py on a real Slurm run that crossed preemptions: the goodput table from the ledger and sacct
(queued time known apart, every preemption a stop with its cost, no lost step) and the timeline picture."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import pytest
from job_helpers import ALL_CPUS, SLOW, TWO_RANKS, cancel, mid_epoch, preempt, submit_one, wait_steps
from slurm_helpers import final_state

from tests.conftest import PYTHON, ROOT, base_env

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = pytest.mark.slurm

STATUS = str(ROOT / "jobs" / "status.py")


def test_status_of_a_preempted_run(slurm_cluster: SlurmCluster, slurm_policy: Callable[..., str],
                                   tmp_path: Path) -> None:
    slurm_policy(grace=0, user_signal=True)
    jobid, run_dir = submit_one(tmp_path, *TWO_RANKS, *ALL_CPUS, *SLOW)
    highs: list[str] = []
    try:
        for run in (1, 2):  # two preemptions: Slurm requeues the job each time (GraceTime 0)
            wait_steps(run_dir, run=run, steps=2, when=mid_epoch, timeout=150)
            highs.append(preempt(slurm_cluster))
        assert final_state(slurm_cluster, jobid, timeout=200) == "COMPLETED"
    finally:
        cancel(slurm_cluster, jobid, *highs)
    png = tmp_path / "timeline.png"
    result = subprocess.run([PYTHON, STATUS, str(run_dir), "--plot", str(png)], cwd=ROOT, env=base_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert f"job         {jobid} (slurm: COMPLETED)" in out
    assert "progress    step 30 of 30, epoch 3" in "\n".join(out)
    goodput = next(line for line in out if line.startswith("goodput "))
    assert "allocated (sacct) spent training; 3 segment(s)" in goodput, out
    rows = {line.split()[0]: line for line in out if line.startswith("  ")}
    for row in ("queued", "starting", "training", "stopping", "restarting"):
        assert row in rows, out
    assert rows["lost"].split()[:3] == ["lost", "steps", "0"], out  # a stop saves at its step
    assert any(line.startswith("stops       2; preemptions 2 (") for line in out), out
    assert rows["requeued_by_slurm"].split()[:2] == ["requeued_by_slurm", "2"], out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (1100, 550)
    assert 20_000 < len(data) < 1_000_000
