"""What a training process imports on its way to the first step: nothing it does not use (issue 16:
bench/resume_breakdown.py measures the way back after a stop)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, base_env

START_PATH = """
import sys
import torch
from mgpu.config.loading import OptimConfig
from mgpu.train.optim import build_optimizer
from mgpu.state.train_state import Progress, gather_state
import mgpu.train.trainer, mgpu.run.session, mgpu.state.checkpointer
model = torch.nn.Linear(3, 2)
optimizer = build_optimizer(model, OptimConfig(name="adamw", zero=True), distributed=False)
state = gather_state({"model": model, "optimizer": optimizer, "progress": Progress(step=1)}, None)
assert state is not None and state["progress"]["step"] == 1 and "state" in state["optimizer"]
print(sorted(m for m in sys.modules if m.startswith("torch.distributed.optim")))
"""


@pytest.mark.multiprocess
def test_the_start_path_does_not_import_torch_distributed_optim() -> None:
    """torch.distributed.optim (ZeRO) brings FSDP, DTensor and sympy: about a second of every start, paid by
    every rank at every requeue. It is imported only where optim.zero shards the optimizer."""
    result = subprocess.run([sys.executable, "-c", START_PATH], env=base_env(), cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
