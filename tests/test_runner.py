"""mgpu.train.job.run_training in-process, world of one: what happens around a failure while the group still exists."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from mgpu.config.loading import load_config
from mgpu.cluster.environment import detect_environment
from mgpu.train.job import run_training


def test_on_failure_runs_before_the_process_group_is_torn_down(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # The requeue after a failure must not wait behind the group's teardown, which can block on a dead peer.
    for name in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    # torch sets this on first use of its JIT cache; a process-wide side effect, not ours.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    cfg = load_config(None, ["task.target=tests.e2e.jobtasks:BuggyBlobTask", "task.args.fail_after=2",
                             "task.args.step_s=0", f"run.dir={tmp_path / 'run'}", "log.tensorboard=false"])
    seen: list[tuple[str, bool]] = []
    with pytest.raises(ValueError, match="bug in the training code"):
        run_training(cfg, env=detect_environment(),
                     on_failure=lambda error: seen.append((str(error), dist.is_initialized())))
    assert seen == [("bug in the training code (call 2)", True)]
    assert not dist.is_initialized()
