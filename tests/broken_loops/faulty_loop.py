"""A small loop of one's own on mgpu.Session with one planted resume fault (tests/test_check_resume.py's table):

    python tests/broken_loops/faulty_loop.py RUN_DIR [--fault NAME] [--ema DECAY] [--accumulate N] [--epochs E]
        [--sleep S]

--fault none: resumes exactly (on any world size with --accumulate keeping the global batch); --ema DECAY keeps an
    mgpu.EMA of the weights in `state`, updated every step (the correct way).
The bugs users make (issue 43's six kinds, and earlier ones):
--fault scheduler_missing: the LambdaLR schedule is not in `state` (starts over on a resume).
--fault ema_outside: the usual EMA (torch's AveragedModel, updated every step, never read by training, exported at
    the end) not in `state`: a resume starts it over from the weights.
--fault shuffle_random: the loop's own order, `random.shuffle` at each epoch's start (a resume mid-epoch shuffles
    again), its position in `state`.
--fault shuffle_numpy: the loop's own order from a numpy generator made once at start (`default_rng(0)`): exact
    while resumed in epoch 0, another order in every later epoch.
--fault hf_shuffle_buffer: a Hugging Face `datasets` stream shuffled through a buffer its state does not hold
    (tests/hf_stream.py): a resume loses the buffer's samples.
--fault counter: the learning rate's warmup from a step counter in a variable (no scheduler; with --ema, an EMA
    in `state`): it restarts at 0 on a resume.
--fault dropout_generator: dropout masks from a torch.Generator of the loop's own, made at start, not in `state`.
--fault outside_value: a plain counter outside `state` scales the loss (restarts at 0 on a resume).
--fault rng_at_epoch_start: a random draw at each epoch's start (a resume mid-epoch draws it again).
--fault own_dataloader: a torch DataLoader of its own (a resume starts its epoch over).
--fault ema_not_saved: a mean-teacher EMA model in the loss, not in `state` (a resume copies the weights).
--fault schedule_from_len: the schedule's length from len(loader) (micro-batches: changes with the world size).
--fault hang: the last rank sleeps for an hour after step 3's optimizer step (a short watchdog: it is found in
    seconds), in every run.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mgpu  # noqa: E402
from tests.hf_stream import hf_stream  # noqa: E402

FAULTS = ("none", "scheduler_missing", "ema_outside", "shuffle_random", "shuffle_numpy", "hf_shuffle_buffer",
          "counter", "dropout_generator", "outside_value", "rng_at_epoch_start", "own_dataloader", "ema_not_saved",
          "schedule_from_len", "hang")
OWN_ORDER = ("shuffle_random", "shuffle_numpy")  # the loop draws its own order and keeps its position in `state`


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = torch.tanh(self.fc1(x))
        return self.fc2(hidden if mask is None else hidden * mask)


def blobs() -> TensorDataset:
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--fault", default="none", choices=FAULTS)
    parser.add_argument("--ema", type=float, help="an mgpu.EMA with this decay in `state` (the correct way)")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds after each step (a slow loop)")
    args = parser.parse_args()
    config = mgpu.Config()
    config.log.every_steps = 2
    if args.fault == "hang":
        config.watchdog.floor_s, config.watchdog.step_multiple = 2.0, 2.0
    dataset = blobs()
    fault = args.fault
    with mgpu.Session(args.run_dir, seed=1, config=config) as session:
        model = session.wrap(Net())
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        if fault == "own_dataloader":
            sampler = DistributedSampler(dataset, session.world_size, session.rank, seed=1)
            loader: object = DataLoader(dataset, batch_size=4, sampler=sampler)
            batches_per_epoch = len(sampler) // 4
        elif fault == "hf_shuffle_buffer":
            stream = hf_stream(64, 4, session.rank, session.world_size, buffer_size=8)
            loader = session.loader(stream, batch_size=4)
            batches_per_epoch = 64 // 4 // session.world_size
        elif fault in OWN_ORDER:
            loader, batches_per_epoch = None, 64 // 4 // session.world_size
        else:
            loader = session.loader(dataset, batch_size=4)
            batches_per_epoch = len(loader)  # type: ignore[arg-type]
        micro = args.epochs * batches_per_epoch
        total = micro if fault == "schedule_from_len" else micro // args.accumulate
        # A lambda's schedule is not in its state_dict (OneCycleLR's total_steps would be): rebuilt on a resume.
        scheduler = (torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.05, 1 - step / total))
                     if fault != "counter" else None)
        teacher = AveragedModel(model) if fault == "ema_not_saved" else None
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9)) if fault == "ema_outside" else None
        dropout = torch.Generator().manual_seed(7) if fault == "dropout_generator" else None
        order_rng = np.random.default_rng(0) if fault == "shuffle_numpy" else None
        state: dict[str, object] = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}
        if args.ema is not None:
            state["ema"] = mgpu.EMA(model, args.ema)
        if fault in ("scheduler_missing", "counter"):
            del state["scheduler"]
        if fault in ("own_dataloader", *OWN_ORDER):
            del state["loader"]
        if fault in OWN_ORDER:
            state.update(epoch=0, batch=0)  # the loop's own position
        state = session.load(state)
        seen = 0
        for epoch in range(args.epochs):
            if fault in OWN_ORDER:
                if epoch < state["epoch"]:
                    continue
                order = list(range(len(dataset)))
                if fault == "shuffle_random":
                    random.shuffle(order)
                else:
                    order = [int(i) for i in order_rng.permutation(len(dataset))]  # type: ignore[union-attr]
                mine = order[session.rank::session.world_size]
                epoch_batches: object = [dataset[mine[b * 4:(b + 1) * 4]] for b in range(state["batch"],
                                                                                         batches_per_epoch)]
            elif fault != "own_dataloader" and epoch < loader.epoch:  # type: ignore[union-attr]
                continue
            else:
                epoch_batches = loader
            if fault == "own_dataloader":
                sampler.set_epoch(epoch)
            jitter = torch.rand(1).item() if fault == "rng_at_epoch_start" else 0.0
            for index, batch in enumerate(epoch_batches):  # type: ignore[call-overload]
                inputs, targets = (batch["x"], batch["x"].sum(1, keepdim=True).sin()) if isinstance(batch, dict) else batch
                mask = (torch.rand(len(inputs), 16, generator=dropout) > 0.3).float() / 0.7 if dropout else None
                prediction = model(inputs, mask)
                loss = F.mse_loss(prediction, targets) * (1 + jitter)
                if fault == "outside_value":
                    loss = loss * min(1.0, (seen + 1) / 8)  # a warmup counted outside `state`
                if teacher is not None:
                    loss = loss + F.mse_loss(prediction, teacher(inputs).detach())
                (loss / args.accumulate).backward()
                if (index + 1) % args.accumulate:
                    continue
                if fault == "counter":  # a warmup from a counter of the loop's own (a plain variable)
                    for group in optimizer.param_groups:
                        group["lr"] = 0.05 * min(1.0, (seen + 1) / 8)
                optimizer.step()
                if fault == "hang" and session.step + 1 == 3 and session.rank == session.world_size - 1:
                    time.sleep(3600)  # the hung rank
                optimizer.zero_grad()
                if scheduler is not None:
                    scheduler.step()
                for average in (teacher, ema):
                    if average is not None:
                        average.update_parameters(model)
                if "ema" in state:
                    state["ema"].update()  # type: ignore[attr-defined]
                if fault in OWN_ORDER:
                    state["batch"] += 1  # type: ignore[operator]
                seen += 1
                time.sleep(args.sleep)
                if session.should_stop():
                    break
                session.log(loss=loss)
                if session.step % 4 == 0:
                    session.save(state)
            if session.stopping:
                break
            if fault in OWN_ORDER:
                state["epoch"], state["batch"] = epoch + 1, 0
        if ema is not None and session.is_main:  # the export the EMA is kept for
            torch.save(ema.module.state_dict(), Path(args.run_dir) / "ema.pt")


if __name__ == "__main__":
    main()
