"""A small loop of one's own on mgpu.Session with one planted resume fault (tests/test_check_resume.py's table):

    python tests/broken_loops/faulty_loop.py RUN_DIR [--fault NAME] [--accumulate N] [--epochs E]

--fault none: resumes exactly (on any world size with --accumulate keeping the global batch).
--fault outside_value: a plain counter outside `state` scales the loss (restarts at 0 on a resume).
--fault scheduler_missing: the LambdaLR schedule is not in `state` (starts over on a resume).
--fault rng_at_epoch_start: a random draw at each epoch's start (a resume mid-epoch draws it again).
--fault own_dataloader: a torch DataLoader of its own (a resume starts its epoch over).
--fault ema_not_saved: a mean-teacher EMA model in the loss, not in `state` (a resume copies the weights).
--fault schedule_from_len: the schedule's length from len(loader) (micro-batches: changes with the world size).
--fault hf_shuffle_buffer: a Hugging Face `datasets` stream shuffled through a buffer its state does not hold
    (tests/hf_stream.py): a resume loses the buffer's samples.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mgpu  # noqa: E402
from tests.hf_stream import hf_stream  # noqa: E402

FAULTS = ("none", "outside_value", "scheduler_missing", "rng_at_epoch_start", "own_dataloader", "ema_not_saved",
          "schedule_from_len", "hf_shuffle_buffer")


def blobs() -> TensorDataset:
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--fault", default="none", choices=FAULTS)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    config = mgpu.Config()
    config.log.every_steps = 2
    dataset = blobs()
    with mgpu.Session(args.run_dir, seed=1, config=config) as session:
        model = session.wrap(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        if args.fault == "own_dataloader":
            sampler = DistributedSampler(dataset, session.world_size, session.rank, seed=1)
            loader: object = DataLoader(dataset, batch_size=4, sampler=sampler)
            batches_per_epoch = len(sampler) // 4
        elif args.fault == "hf_shuffle_buffer":
            stream = hf_stream(64, 4, session.rank, session.world_size, buffer_size=8)
            loader = session.loader(stream, batch_size=4)
            batches_per_epoch = 64 // 4 // session.world_size
        else:
            loader = session.loader(dataset, batch_size=4)
            batches_per_epoch = len(loader)  # type: ignore[arg-type]
        micro = args.epochs * batches_per_epoch
        total = micro if args.fault == "schedule_from_len" else micro // args.accumulate
        # A lambda's schedule is not in its state_dict (OneCycleLR's total_steps would be): rebuilt on a resume.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.05, 1 - step / total))
        ema = AveragedModel(model) if args.fault == "ema_not_saved" else None
        state: dict[str, object] = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}
        if args.fault == "scheduler_missing":
            del state["scheduler"]
        if args.fault == "own_dataloader":
            del state["loader"]
        state = session.load(state)
        seen = 0
        for epoch in range(args.epochs):
            if args.fault != "own_dataloader" and epoch < loader.epoch:  # type: ignore[attr-defined]
                continue
            if args.fault == "own_dataloader":
                sampler.set_epoch(epoch)
            jitter = torch.rand(1).item() if args.fault == "rng_at_epoch_start" else 0.0
            for index, batch in enumerate(loader):  # type: ignore[call-overload]
                inputs, targets = (batch["x"], batch["x"].sum(1, keepdim=True).sin()) if isinstance(batch, dict) else batch
                prediction = model(inputs)
                loss = F.mse_loss(prediction, targets) * (1 + jitter)
                if args.fault == "outside_value":
                    loss = loss * min(1.0, (seen + 1) / 8)  # a warmup counted outside `state`
                if ema is not None:
                    loss = loss + F.mse_loss(prediction, ema(inputs).detach())
                (loss / args.accumulate).backward()
                if (index + 1) % args.accumulate:
                    continue
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                if ema is not None:
                    ema.update_parameters(model)
                seen += 1
                if session.should_stop():
                    break
                session.log(loss=loss)
                if session.step % 4 == 0:
                    session.save(state)
            if session.stopping:
                break


if __name__ == "__main__":
    main()
