"""A loop of a user's own over an mgpu.data.stream.ShardedStream of token shards, for tests/test_stream_resume.py:
a tiny next-token model with dropout, AdamW, a save every few steps, and a per-sample log: every rank appends
`step epoch id` for each real sample it trained on to RUN_DIR/ids/rank-R.txt. One process per rank:

    python tests/stream_loop.py RUN_DIR DATA_DIR [--epochs 2] [--workers 0] [--batch-size 3]
        [--signal-at K] [--shuffle-buffer 16] [--stateful]

--signal-at K: right after optimizer step K the last rank sends SIGTERM to its whole process group (every
rank and DataLoader worker the test started), as slurmstepd does. --stateful: the shards through a Stateful
IterableDataset of the loop's own (mgpu.data.stream_loader.StatefulStreamLoader) instead of mgpu.data.stream.
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mgpu  # noqa: E402
from mgpu.data.stream import ShardedStream, TokenWindows  # noqa: E402
from tests.tasks import StatefulTokenShards  # noqa: E402  (the Stateful stream the trainer's tests use too)

BLOCK = 8


def sample_id(window: torch.Tensor) -> int:
    """The test's shards hold token k * 1000 + t at token t of shard k, 50 windows a shard at most."""
    first = int(window[0])
    return first // 1000 * 100 + first % 1000 // BLOCK


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("data_dir")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=3)
    parser.add_argument("--shuffle-buffer", type=int, default=16)
    parser.add_argument("--signal-at", type=int)
    parser.add_argument("--stateful", action="store_true", help="a Stateful IterableDataset of the shards instead")
    args = parser.parse_args()
    config = mgpu.Config()
    config.preemption.check_every_steps = 1

    files = sorted(glob.glob(f"{args.data_dir}/*.bin"))
    with mgpu.Session(args.run_dir, seed=5, config=config) as session:
        reader = TokenWindows(BLOCK, "uint16")
        stream: IterableDataset = (StatefulTokenShards(files, reader, session.rank, session.world_size) if args.stateful
                                   else ShardedStream(files, reader, shuffle_buffer=args.shuffle_buffer))
        model = session.wrap(nn.Sequential(nn.Embedding(64, 16), nn.Dropout(0.2), nn.Linear(16, 64)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        loader = session.loader(stream, batch_size=args.batch_size, num_workers=args.workers, collate_fn=torch.stack)
        state = {"model": model, "optimizer": optimizer, "loader": loader}
        session.load(state)
        log_dir = Path(args.run_dir) / "ids"
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / f"rank-{session.rank}.txt", "a") as ids:
            for epoch in loader.epochs(args.epochs):
                for windows in loader:
                    real = len(windows) if args.stateful else loader.last.real
                    tokens = windows % 64
                    logits = model(tokens[:, :-1])
                    losses = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)
                    # Weight 0 for the padding sample a rank gets when the epoch's last batch is short.
                    (losses[:real].sum() / args.batch_size).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    for window in windows[:real]:
                        ids.write(f"{session.step + 1} {epoch} {sample_id(window)}\n")
                    ids.flush()
                    if session.step + 1 == args.signal_at and session.rank == session.world_size - 1:
                        os.killpg(os.getpgid(0), signal.SIGTERM)
                    if session.should_stop():
                        break
                    if session.step % 4 == 0:
                        session.save(state)
                if session.stopping:
                    break
            if not session.stopping:
                session.save(state)  # the final weights, for the comparison with an unbroken run


if __name__ == "__main__":
    main()
