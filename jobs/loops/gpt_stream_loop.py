"""A loop of your own over a stream of token shards (mgpu.data.stream.ShardedStream) on mgpu.Session: the GPT
example's model and corpus (jobs/tasks/gpt.py), read as 8 token files with no __len__ in sight.

    python jobs/loops/gpt_stream_loop.py                               # one process, no Slurm
    torchrun --nproc-per-node 2 jobs/loops/gpt_stream_loop.py          # 2 ranks; Ctrl-C stops and saves
    sbatch --nodes=2 slurm/loop.sbatch jobs/loops/gpt_stream_loop.py   # one task per GPU, requeued on preemption

Running the same command again continues at the exact window, also on another number of ranks or workers:
each epoch is one order of the shards' windows (shard order and shuffle buffer from seed and epoch), and the
loader's position in it is the only cursor. Each epoch prints its mean training loss over the windows this
run trained on (`loader.start_position` says where a resumed run came in).
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from jobs.tasks.gpt import GptTask  # noqa: E402
import mgpu  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=None, help="stop for good after this many steps")
    parser.add_argument("--out", default="runs/gpt-stream-loop")
    args = parser.parse_args()

    session = mgpu.Session(args.out, seed=0)
    task = GptTask(stream=True, shards=args.shards)  # the stdlib corpus, made on first use; 8 token shards
    stream = task.train_dataset()  # a ShardedStream: files, a reader per kind, a shuffle buffer
    model = session.wrap(task.build_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    loader = session.loader(stream, batch_size=args.batch_size, num_workers=args.workers, drop_last=True)
    # Streams have no __len__; the loader knows an epoch's batches from the shards' sizes.
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.epochs * len(loader))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}
    session.load(state)

    for epoch in loader.epochs(args.epochs):
        model.train()
        loss_sum = torch.zeros(2, dtype=torch.float64, device=session.device)  # this run's share of the epoch
        for windows in loader:
            windows = windows.to(session.device)
            logits = model(windows[:, :-1])
            loss = F.cross_entropy(logits.transpose(1, 2), windows[:, 1:])
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            loss_sum += torch.tensor([loss.item() * len(windows), len(windows)], dtype=torch.float64,
                                     device=session.device)
            if session.should_stop() or session.step == args.max_steps:
                break
            session.log(loss=loss)  # step, epoch, loss for jobs/status.py (every log.every_steps steps)
        if session.stopping:
            break
        total, count = session.all_reduce(loss_sum).tolist()
        if session.is_main:
            came_in = f" (this run came in at window {loader.start_position})" if loader.start_position else ""
            print(f"epoch {epoch}: mean training loss {total / count:.4f} over {int(count)} windows{came_in}",
                  flush=True)
        session.save(state)
        if session.step == args.max_steps:
            break

    session.finish()


if __name__ == "__main__":
    main()
