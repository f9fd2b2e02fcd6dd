"""A loop of a user's own on mgpu.Session with a model shape that a resume can trip on, for
tests/test_ddp_resume.py. One process per rank (RANK, WORLD_SIZE, ...):

    python tests/ddp_shapes_loop.py RUN_DIR --shape {aux,counter,powersgd,batchnorm} [--stop-at-step K]

aux: the forward appends an auxiliary loss (MoE-style load balancing) that the loop adds to its loss;
counter: a forward counter kept in `get_extra_state` that scales the activations; powersgd: torch's
PowerSGD comm hook with error feedback and warm start (its state changes every step); batchnorm:
BatchNorm and dropout. DDP with its defaults. At the end rank 0 prints whether mgpu's recorded bucket
layout is the one DDP's reducer rebuilt (its logging data).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mgpu  # noqa: E402
from mgpu.stop.stopping import STOP_AT_STEP  # noqa: E402


class Router(nn.Module):
    """Two experts and a gate; each forward appends the gate's load-balancing loss to `aux_losses`."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.gate = nn.Linear(16, 2)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.out = nn.Linear(16, 2)
        self.aux_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        weights = torch.softmax(self.gate(h), dim=-1)
        self.aux_losses.append((weights.mean(0) ** 2).sum() * 2)  # low when the experts share the load
        h = sum(weights[:, i:i + 1] * expert(h) for i, expert in enumerate(self.experts))
        return self.out(h)


class Counting(nn.Module):
    """Counts its training forwards (saved with the model, as get_extra_state); the count scales a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 2)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.forwards += 1
        return self.b(torch.relu(self.a(x)) * (1.0 + 0.25 * (self.forwards % 3)))

    def get_extra_state(self) -> Any:
        return {"forwards": self.forwards}

    def set_extra_state(self, state: Any) -> None:
        self.forwards = state["forwards"]


def build(shape: str) -> nn.Module:
    if shape == "aux":
        return Router()
    if shape == "counter":
        return Counting()
    if shape == "batchnorm":
        return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--shape", choices=["aux", "counter", "powersgd", "batchnorm"], required=True)
    parser.add_argument("--stop-at-step", type=int)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (128,), generator=generator)
    data = TensorDataset(torch.randn(128, 8, generator=generator) + labels[:, None] * 1.5, labels)

    if args.stop_at_step is not None:  # the test stop (mgpu.stop.stopping reads it)
        os.environ[STOP_AT_STEP] = str(args.stop_at_step)
    with mgpu.Session(args.run_dir, seed=3) as session:
        torch.manual_seed(0)  # the same initial weights on every rank
        model = session.wrap(build(args.shape))
        hook_state = None
        if args.shape == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            hook_state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                     start_powerSGD_iter=2, min_compression_rate=0.5)
            model.register_comm_hook(hook_state, powerSGD_hook.powerSGD_hook)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
        loader = session.loader(data, batch_size=4)
        state = {"model": model, "optimizer": optimizer, "loader": loader}
        session.load(state)
        for _ in loader.epochs(1):
            for x, y in loader:
                loss = F.cross_entropy(model(x.to(session.device)), y.to(session.device))
                if args.shape == "aux":
                    loss = loss + 0.1 * sum(model.module.aux_losses)
                    model.module.aux_losses.clear()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if session.should_stop():
                    break
        if session.is_main and not session.stopping:
            rebuilt = model._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
            layout = getattr(model, "_layout", None) or {"buckets": []}  # (None before mgpu recorded layouts)
            ours = ", ".join(" ".join(map(str, bucket)) for bucket in layout["buckets"])
            print(f"reducer's rebuilt buckets: {rebuilt}; mgpu's: {ours}", flush=True)
        if hook_state is not None and session.is_main:
            print(f"powersgd iter {hook_state.iter}", flush=True)


if __name__ == "__main__":
    main()
