"""A loop of a user's own that logs to wandb with the session's run id, for tests/test_run_id.py:

    WANDB_MODE=offline python tests/logger_loop.py RUN_DIR [--stop-at-step K]

as the README's own-loop section shows it: `wandb.init(id=session.run_id, resume="allow")`, a context manager
inside the session's, so the wandb run finishes before the session ends the process after a stop.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mgpu  # noqa: E402
from mgpu.stop.stopping import STOP_AT_STEP  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--stop-at-step", type=int)
    args = parser.parse_args()
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    import wandb

    if args.stop_at_step is not None:  # the test stop (mgpu.stop.stopping reads it)
        os.environ[STOP_AT_STEP] = str(args.stop_at_step)
    with mgpu.Session(args.run_dir, seed=0) as session, \
            wandb.init(id=session.run_id, resume="allow", project="mgpu-test", dir=str(session.run.path)) as run:
        model = session.wrap(nn.Linear(4, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = session.loader(data, batch_size=8)
        state = {"model": model, "optimizer": optimizer, "loader": loader}
        session.load(state)
        for _ in loader.epochs(1):
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                run.log({"loss": loss.item()}, step=session.step + 1)
                if session.should_stop():
                    break


if __name__ == "__main__":
    main()
