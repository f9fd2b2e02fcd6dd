"""A typical hand-written DDP loop with its own checkpoint-and-resume, as the seeds' multi-node walkthrough
(torch.distributed.launch / torchrun, one process per GPU) writes it. This is the "before" of
jobs/loops/mnist_loop.py, kept to show what changes (docs/own-loop.md); it runs as it is:

    torchrun --nproc-per-node 2 jobs/loops/mnist_ddp.py --epochs 2          # add --resume to continue

What it lacks: a preemption or a time limit loses everything since the last epoch's checkpoint (and a
rank-0 torch.save that is killed mid-write leaves a truncated file that --resume then fails on); ranks
resume at the start of an epoch, with other random augmentations than the unbroken run.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from jobs.tasks.digits import RandomShift, SyntheticDigits  # noqa: E402
from jobs.tasks.mnist import SmallCNN  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--train-size", type=int, default=6000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="runs/mnist-loop")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)

    net: torch.nn.Module = SmallCNN()
    if world_size > 1 and device.type == "cuda":
        net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)  # BatchNorm statistics over all GPUs
    model = DDP(net.to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_set = RandomShift(SyntheticDigits(args.train_size, seed=0))
    val_set = SyntheticDigits(2000, seed=1)
    sampler: DistributedSampler[int] = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers)
    val_loader = DataLoader(val_set, batch_size=256, sampler=DistributedSampler(val_set, shuffle=False))
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.epochs * len(loader))
    writer = SummaryWriter(os.path.join(args.out, "tensorboard")) if rank == 0 else None

    start_epoch = 0
    checkpoint = os.path.join(args.out, "checkpoint.pt")
    if args.resume and os.path.exists(checkpoint):
        state = torch.load(checkpoint, map_location=device)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch = state["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()

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
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, checkpoint)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
