"""jobs/loops/translate_spawn.py, the seeds' mp.spawn transformer loop (Noam warmup, label smoothing,
accumulation, clipping, BLEU, early stopping, TensorBoard), on mgpu.Session: the same loop, preempted,
requeued and resumed bit-identically, under any launcher (docs/own-loop.md).

    python jobs/loops/translate_loop.py --nprocs 2                   # 2 local ranks; Ctrl-C stops and saves
    torchrun --nproc-per-node 2 jobs/loops/translate_loop.py
    sbatch --nodes=2 slurm/loop.sbatch jobs/loops/translate_loop.py  # one task per GPU
"""

import argparse
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from jobs.tasks.translation import EOS, PAD, Seq2Seq, SyntheticPairs, collate, noam  # noqa: E402
from mgpu.train.metrics import bleu_statistics, corpus_bleu  # noqa: E402
import mgpu  # noqa: E402


@dataclass
class EarlyStopper:
    patience: int
    best: float = 0.0
    bad_epochs: int = 0

    def step(self, score: float) -> bool:
        """True when `score` has not improved for `patience` epochs."""
        if score > self.best:
            self.best, self.bad_epochs = score, 0
        else:
            self.bad_epochs += 1
        return self.bad_epochs >= self.patience


def evaluate(model: Seq2Seq, loader: DataLoader, device: torch.device) -> torch.Tensor:
    """[summed token NLL, tokens, BLEU statistics...] of this rank's share of the validation set."""
    model.eval()
    totals = torch.zeros(12, dtype=torch.float64, device=device)
    with torch.no_grad():
        for batch in loader:
            source, target_in, target_out = (t.to(device) for t in batch)
            logits = model(source, target_in)
            nll = nn.functional.cross_entropy(logits.transpose(1, 2), target_out, ignore_index=PAD, reduction="sum")
            hypotheses = model.greedy(source, max_len=target_out.shape[1] + 4)
            references = [[t for t in row if t not in (PAD, EOS)] for row in target_out.tolist()]
            totals += torch.cat([torch.tensor([nll.item(), (target_out != PAD).sum().item()], dtype=torch.float64),
                                 bleu_statistics(hypotheses, references)]).to(device)
    model.train()
    return totals


def main(rank: int, world_size: int, args: argparse.Namespace) -> None:
    session = mgpu.Session(args.out, seed=args.seed)
    rank, world_size, device = session.rank, session.world_size, session.device

    train_set, valid_set = SyntheticPairs(args.train_size, seed=0), SyntheticPairs(300, seed=1)
    loader = session.loader(train_set, batch_size=args.batch_size, collate_fn=collate)
    valid_loader = DataLoader(valid_set, batch_size=64, collate_fn=collate,
                              sampler=DistributedSampler(valid_set, num_replicas=world_size, rank=rank, shuffle=False))
    model = session.wrap(Seq2Seq(27))
    criterion = nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=0.1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, noam(64, args.warmup, 2.0))
    early_stopper = EarlyStopper(args.patience)
    writer = SummaryWriter(os.path.join(args.out, "tensorboard")) if rank == 0 else None
    state = session.load(dict(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, early=early_stopper))

    for epoch in loader.epochs(args.epochs):
        model.train()
        for step, batch in enumerate(loader, start=1):
            source, target_in, target_out = (t.to(device) for t in batch)
            loss = criterion(model(source, target_in).transpose(1, 2), target_out) / args.accumulate
            loss.backward()
            if step % args.accumulate == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                if session.should_stop():
                    break
        if session.stopping:
            break

        totals = evaluate(getattr(model, "module", model), valid_loader, device)  # type: ignore[arg-type]  # DDP or one rank's Module
        dist.all_reduce(totals)
        valid_loss, bleu = (totals[0] / totals[1]).item(), corpus_bleu(totals[2:].tolist())
        improved = bleu > early_stopper.best
        if rank == 0:
            print(f"epoch {epoch}: valid loss {valid_loss:.4f} bleu {bleu:.2f}", flush=True)
            assert writer is not None
            writer.add_scalar("valid/loss", valid_loss, epoch)
            writer.add_scalar("valid/bleu", bleu, epoch)
        stop = early_stopper.step(bleu)
        session.save(state, best=improved)
        if stop:
            break

    session.finish()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--patience", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--out", default="runs/translate-loop")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    mgpu.spawn(main, args=(args.nprocs, args), nprocs=args.nprocs)
