"""One rank of tests/test_fsdp.py's initial-weights test, started by tests.conftest.start_ranks:

    python -m tests.fsdp_init_loop RUN_DIR OUT     # Session(seed=5), wrap(InitNet(rank), parallel="fsdp"); rank 0
                                                   # writes the sharded model's full weights and buffers to OUT
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import mgpu
from mgpu.parallel.fsdp import plain

SEED = 5


class InitNet(nn.Module):
    """Inits that are not i.i.d. per element: an orthogonal matrix (a patchwork of two ranks' is not orthogonal),
    an identity, weights "loaded" per rank (each rank's file differs: `rank` stands for it), a buffer."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)
        nn.init.orthogonal_(self.a.weight)
        nn.init.eye_(self.b.weight)
        with torch.no_grad():
            self.c.weight.fill_(float(rank + 1))
        self.register_buffer("scale", torch.rand(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x))) * self.scale


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer in full (a collective for a sharded model)."""
    return {name: plain(value.detach()).clone() for name, value in model.state_dict().items()}


def main(run_dir: str, out: str) -> None:
    config = mgpu.Config()
    config.watchdog.enabled = False
    with mgpu.Session(run_dir, seed=SEED, config=config) as session:
        model = session.wrap(InitNet(session.rank), parallel="fsdp")
        weights = full_weights(model)
        if session.is_main:
            torch.save(weights, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
