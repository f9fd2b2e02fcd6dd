"""Checkpoint stall: how long the training loop is blocked per checkpoint, mgpu's background writer
against a plain synchronous `torch.save` of the same state (a >= 300M-parameter model with AdamW state).

    python bench/checkpoint_stall.py                    # 302M parameters, 3 repeats
    python bench/checkpoint_stall.py --layers 2 --repeats 2 --dir /tmp/ckpt   # quicker

Per repeat, in this order: `torch.save` + fsync (durable, like ours), `torch.save` alone (page cache
only), then our `save_async` (blocked = until it returns; total = until the save is durable). The
figure is median(blocked) / median(torch.save + fsync). Target: <= 0.10. The first save also allocates
the staging buffers that later saves reuse: it is reported on its own (`mgpu_first_blocked_s`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, report  # noqa: E402


def build_state(layers: int, width: int) -> tuple[dict, int]:
    import torch
    from torch import nn

    from mgpu.state.train_state import Progress, gather_state

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()  # Adam's exp_avg and exp_avg_sq now exist: 3 copies of every parameter in the state
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    params = sum(p.numel() for p in model.parameters())
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler,
               "progress": Progress(step=1), "config": {}}
    return gather_state(objects, None), params  # type: ignore[return-value]


def plain_save(state: dict, path: Path, fsync: bool) -> float:
    import torch

    start = time.perf_counter()
    with open(path, "wb") as file:
        torch.save(state, file)
        if fsync:
            file.flush()
            os.fsync(file.fileno())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=6144)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    from mgpu.state.single.store import CheckpointStore

    state, params = build_state(args.layers, args.width)
    root = Path(tempfile.mkdtemp(prefix="mgpu-bench-", dir=args.dir))
    store = CheckpointStore(root / "store", keep_last=1)
    sync_fsync, sync_plain, blocked, total, size = [], [], [], [], 0
    try:
        for repeat in range(args.repeats):
            target = root / "plain.pt"
            sync_fsync.append(plain_save(state, target, fsync=True))
            target.unlink()
            sync_plain.append(plain_save(state, target, fsync=False))
            size = target.stat().st_size
            target.unlink()
            start = time.perf_counter()
            store.save_async(state, repeat + 1)
            blocked.append(time.perf_counter() - start)
            store.wait()
            total.append(time.perf_counter() - start)
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    row = {"params_M": params / 1e6, "state_GB": size / 1e9, "torch_save_fsync_s": median(sync_fsync),
           "torch_save_s": median(sync_plain), "mgpu_blocked_s": median(blocked),
           "mgpu_first_blocked_s": blocked[0], "mgpu_total_s": median(total),
           "blocked_over_sync": median(blocked) / median(sync_fsync),
           "blocked_over_plain_save": median(blocked) / median(sync_plain), "repeats": args.repeats}
    report("checkpoint_stall", [row])


if __name__ == "__main__":
    main()
