"""jobs/loops/mnist_ddp.py, a hand-written DDP loop with its own checkpointing, on mgpu.Session: the
same loop, with every guarantee of mgpu's trainer (docs/own-loop.md shows the lines that changed).

    python jobs/loops/mnist_loop.py                                    # one process, no Slurm
    torchrun --nproc-per-node 2 jobs/loops/mnist_loop.py               # 2 ranks; Ctrl-C stops and saves
    sbatch --nodes=2 slurm/loop.sbatch jobs/loops/mnist_loop.py        # one task per GPU, requeued on preemption

Running the same command again continues the run from its newest checkpoint, at the exact sample.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from jobs.tasks.digits import RandomShift, SyntheticDigits  # noqa: E402
from jobs.tasks.mnist import SmallCNN  # noqa: E402
import mgpu  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--train-size", type=int, default=6000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="runs/mnist-loop")
    args = parser.parse_args()

    session = mgpu.Session(args.out, seed=0)
    rank, world_size, device = session.rank, session.world_size, session.device

    net: torch.nn.Module = SmallCNN()
    if world_size > 1 and device.type == "cuda":
        net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)  # BatchNorm statistics over all GPUs
    model = session.wrap(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_set = RandomShift(SyntheticDigits(args.train_size, seed=0))
    val_set = SyntheticDigits(2000, seed=1)
    loader = session.loader(train_set, batch_size=args.batch_size, num_workers=args.workers)
    val_loader = DataLoader(val_set, batch_size=256, sampler=DistributedSampler(val_set, shuffle=False))
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.epochs * len(loader))
    writer = SummaryWriter(os.path.join(args.out, "tensorboard")) if rank == 0 else None

    state = session.load({"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader})

    loss = torch.tensor(float("nan"))  # an epoch resumed at its last step trains no batch in this process
    for epoch in loader.epochs(args.epochs):
        model.train()
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if session.should_stop():
                break
            session.log(loss=loss)  # step, epoch, loss for jobs/status.py (every log.every_steps steps)
        if session.stopping:
            break

        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for images, labels in val_loader:
                images, labels = images.to(device), labels.to(device)
                correct += torch.tensor([(model(images).argmax(1) == labels).sum().item(), len(labels)], device=device)
        dist.all_reduce(correct)
        accuracy = (correct[0] / correct[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f} accuracy {accuracy:.4f}", flush=True)
            assert writer is not None
            writer.add_scalar("eval/accuracy", accuracy, epoch)
        session.save(state)

    session.finish()


if __name__ == "__main__":
    main()
