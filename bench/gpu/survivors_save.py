"""The survivors' save of a big state on a GPU (issue 44): a model and its AdamW state on CUDA (default 4.9 GB: 410M
float32 parameters and two moments), a step marked (mgpu.state.memory.step_mark), then the save a survivor makes when a
peer fails (mgpu.state.memory.snapshots.MemorySnapshots.last_words: the marked state from the GPU into the node's shared
memory), timed; beside it, in the same process, a plain `torch.save` of the same state_dicts into the same memory (the
peer), and what one step's mark costs. Also rank 0's buffer record from CUDA buffers (pinned copy, event, thread).

    python bench/gpu/survivors_save.py [--gb 4.9] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=4.9)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import torch
    from torch import nn

    from mgpu.state.memory.buffer_record import BufferRecord
    from mgpu.state.memory.store import Identity, SnapshotStore
    from mgpu.state.memory.snapshots import MemorySnapshots
    from mgpu.state.memory.step_mark import StepMarks

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    params = int(args.gb * 1e9 / 12)  # float32 weights + AdamW's two moments: 12 bytes a parameter
    width = 8192
    layers = max(1, params // (width * width))
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # its moments exist
    state = {"model": model, "optimizer": optimizer, "progress": {"step": 1}}
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    total += sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    base = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    rows: dict[str, float | int | str] = {"device": str(device), "state_bytes": total, "layers": layers}
    try:
        marks = StepMarks(lambda: state, lambda: [], rank=0, world_size=2, seed=0, version=None)
        marks.mark(0)  # its imports and hooks, once
        started = time.perf_counter()
        for step in range(1, 101):
            marks.mark(step)
        rows["mark_us"] = round((time.perf_counter() - started) / 100 * 1e6, 1)
        identity = Identity("bench", 0, "bench", "c", 2, 0)
        snapshots = MemorySnapshots(SnapshotStore(base / "rank0", identity), 0, None)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        line = snapshots.last_words(marks)
        rows["survivors_save_s"] = round(time.perf_counter() - started, 3)
        rows["survivors_save_line"] = line
        shutil.rmtree(base / "rank0", ignore_errors=True)
        started = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, base / "plain.pt")
        rows["plain_torch_save_s"] = round(time.perf_counter() - started, 3)
        (base / "plain.pt").unlink()
        rows["survivors_vs_plain"] = round(float(rows["survivors_save_s"]) / float(rows["plain_torch_save_s"]), 3)
        rows["survivors_gb_per_s"] = round(total / float(rows["survivors_save_s"]) / 1e9, 2)
        buffers = {"model": {f"b{i}": torch.randn(1024, device=device) for i in range(100)}}
        record = BufferRecord(SnapshotStore(base / "rank0-buffers", identity))
        started = time.perf_counter()
        record.offer(5, buffers)
        rows["buffer_offer_us"] = round((time.perf_counter() - started) * 1e6, 1)
        deadline = time.monotonic() + 30
        while 5 not in record.steps() and time.monotonic() < deadline:
            time.sleep(0.01)
        kept = record.read(5)["model"]
        rows["buffer_record_exact"] = str(all(torch.equal(kept[k], v.cpu()) for k, v in buffers["model"].items()))
        record.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(rows, indent=1))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
